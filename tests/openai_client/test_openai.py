"""`nextn serve` through the official `openai` client (run by run.sh, which starts the servers)."""

import json
import os
import sys
import time

import openai
from openai import OpenAI

PLAIN = os.environ["NEXTN_URL"] + "/v1"
KEYED = os.environ["NEXTN_KEYED_URL"] + "/v1"
REF = json.load(open(os.environ["NEXTN_REFERENCE"]))
CASES = {c["name"]: c for c in REF["cases"]}
MODEL = "nextn-live-tiny"

client = OpenAI(base_url=PLAIN, api_key="unused", max_retries=0, timeout=120)


def text_of(case):
    return case["text"].removesuffix("<|im_end|>")


def test_models():
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL], ids


def test_chat():
    c = CASES["greeting"]
    r = client.chat.completions.create(model=MODEL, messages=c["messages"], temperature=0, max_tokens=48)
    assert r.choices[0].message.content == text_of(c), r
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(c["input_ids"])
    assert r.usage.completion_tokens == len(c["greedy_ids"])
    spec = r.usage.model_extra["spec"]
    assert spec["drafted"] > 0 and spec["acceptance_length"] >= 1, spec


def test_chat_stream():
    c = CASES["shipping"]
    stream = client.chat.completions.create(
        model=MODEL, messages=c["messages"], temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True},
    )
    content, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert content == text_of(c), content
    assert finish == "stop"
    assert usage.completion_tokens == len(c["greedy_ids"])


def test_tool_round_trip():
    c = CASES["tools_stock"]
    r = client.chat.completions.create(model=MODEL, messages=c["messages"], tools=c["tools"], temperature=0, max_tokens=48)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "check_stock"
    args = json.loads(call.function.arguments)
    assert args == {"product": "black power bank"}, args

    # Streamed: the call arrives as tool_calls deltas.
    name, streamed_args, finish = "", "", None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=c["messages"], tools=c["tools"], temperature=0, max_tokens=48, stream=True
    ):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name += tc.function.name or ""
                streamed_args += tc.function.arguments or ""
            assert "<tool_call>" not in (ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert name == "check_stock" and json.loads(streamed_args) == args and finish == "tool_calls"

    messages = c["messages"] + [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"product": "black power bank", "stock": 3})},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=c["tools"], temperature=0, max_tokens=48)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls, r2


def test_completions_token_ids():
    c = CASES["price_size"]
    r = client.completions.create(model=MODEL, prompt=c["input_ids"], temperature=0, max_tokens=48)
    assert r.choices[0].text == text_of(c), r
    assert r.usage.prompt_tokens == len(c["input_ids"])


def test_400_names_the_field():
    for kwargs, param in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"n": 2}, "n"),
        ({"extra_body": {"nextn": {"spec": "off"}}}, "nextn.spec"),
    ]:
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            assert e.body["param"] == param, (kwargs, e.body)
            assert e.body["type"] == "invalid_request_error"
        else:
            raise AssertionError(f"{kwargs} was accepted")
    try:
        client.completions.create(model=MODEL, prompt=[5] * 9000, max_tokens=4)
    except openai.BadRequestError as e:
        assert e.body["param"] == "prompt" and e.body["code"] == "context_length_exceeded", e.body
    else:
        raise AssertionError("a prompt over the context was accepted")


def test_401():
    bad = OpenAI(base_url=KEYED, api_key="wrong", max_retries=0)
    try:
        bad.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    else:
        raise AssertionError("a wrong key was accepted")
    good = OpenAI(base_url=KEYED, api_key="test-key", max_retries=0)
    assert [m.id for m in good.models.list()] == [MODEL]


def test_429():
    good = OpenAI(base_url=KEYED, api_key="test-key", max_retries=0, timeout=120)
    long = good.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(long))  # the one slot is taken
    try:
        good.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert e.response.headers.get("retry-after") == "1"
    else:
        raise AssertionError("a request over --max-running + --max-queue was admitted")
    finally:
        long.close()  # disconnect: the server aborts the request and frees its slot
    deadline = time.time() + 30
    while True:
        try:
            good.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            break
        except openai.RateLimitError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


TESTS = [v for k, v in sorted(globals().items()) if k.startswith("test_")]

if __name__ == "__main__":
    failed = 0
    for t in TESTS:
        t0 = time.time()
        try:
            t()
            print(f"ok    {t.__name__} ({time.time() - t0:.2f}s)")
        except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
            failed += 1
            print(f"FAIL  {t.__name__}: {type(e).__name__}: {e}")
    print(f"{len(TESTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
