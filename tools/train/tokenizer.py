#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer on the corpus, write the tokenizer files, encode the splits.

    python tools/train/tokenizer.py --corpus WORK/corpus --model-dir models/nextn-live-tiny --out WORK/data

Reuses tools/fixtures/tokenizer_fixture.py: the same Qwen-style pipeline (NFC, Qwen split regex or,
with --split words, that regex with spaces and symbols kept out of words, with --split words-han also
every Han character on its own; ByteLevel without prefix
space, ByteLevel decoder), the same added tokens (appended after the BPE vocabulary, as in Qwen),
the same chat template (tests/fixtures/tokenizer/chat_template.jinja, copied byte for byte) and the
same jinja environment as transformers' apply_chat_template.

Writes into --model-dir: tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json. Writes into --out: {train,test}.npz (flat token ids + per-conversation
offsets + a per-token "assistant reply" mask used for the metrics) and tokenizer_stats.json.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "fixtures"))
import tokenizer_fixture as tf  # noqa: E402

TEMPLATE_FILE = ROOT / "tests" / "fixtures" / "tokenizer" / "chat_template.jinja"
VOCAB_TOTAL = 4096  # BPE ids + the 9 added tokens
BPE_TRAIN_CONVS = 20000  # conversations (from the start of train.jsonl) the BPE is trained on
ASSISTANT_HEADER = "<|im_start|>assistant\n"
THINK_EMPTY = "<think>\n\n</think>\n\n"


def load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def render(template, conv, add_generation_prompt=False, **kwargs):
    return template.render(
        messages=conv["messages"], tools=conv["tools"], documents=None,
        add_generation_prompt=add_generation_prompt, **tf.SPECIAL_TOKEN_VARS, **kwargs,
    )


def reply_spans(text):
    """Character spans of the assistant replies: after the header (and an empty or filled think
    block), up to and including <|im_end|>."""
    spans, i = [], 0
    while True:
        s = text.find(ASSISTANT_HEADER, i)
        if s < 0:
            return spans
        s += len(ASSISTANT_HEADER)
        e = text.find("<|im_end|>", s)
        e = len(text) if e < 0 else e + len("<|im_end|>")
        if text.startswith("<think>\n", s):
            t = text.find("</think>\n\n", s, e)
            if t >= 0:
                s = t + len("</think>\n\n")
        spans.append((s, e))
        i = e


# `--split words`: the Qwen pattern except that a word never absorbs the character before it (a space or
# punctuation is its own pre-token). With the Qwen pattern a comment's " Emerald" and a tool argument's
# "\nEmerald" are different tokens, so putting a word the model has not memorised into a call is a
# learnt respelling; with this one both are the same ids and copying is what an attention head does.
WORDS_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[\p{L}\p{M}]+"
    r"|\p{N}"
    r"|[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
# `--split words-han`: the same, and every Han character its own pre-token. Chinese has no spaces, so under
# `words` a whole comment ("羽绒服有优惠吗呀") was one pre-token and BPE learnt training comments as single ids:
# a held-out Chinese comment came out as byte fragments the model had never seen (replay 2026-12-03: Chinese
# TC 0.10). Per character, 多 少 钱 are the same frequent ids in every comment that asks a price.
WORDS_HAN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|\p{Han}"
    r"|(?:(?!\p{Han})[\p{L}\p{M}])+"
    r"|\p{N}"
    r"|[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
SPLIT_PATTERNS = {"qwen": tf.SPLIT_PATTERN, "words": WORDS_SPLIT_PATTERN, "words-han": WORDS_HAN_SPLIT_PATTERN}


def train_tokenizer(texts, split="qwen"):
    n_added = len(tf.ADDED_TOKENS)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERNS[split]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TOTAL - n_added, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # The special / tool / think markers must not be learnt as BPE merges: strip them from the
    # training text (they are added tokens, matched before the BPE sees the text).
    def clean(t):
        for content, _ in tf.ADDED_TOKENS:
            t = t.replace(content, "\n")
        return t

    tok.train_from_iterator((clean(t) for t in texts), trainer=trainer)
    for content, special in tf.ADDED_TOKENS:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return tok


def example_texts(convs):
    """(prompt, completion + <|im_end|>, trained) for every model request of the agent corpus."""
    for c in convs:
        for e in c["examples"]:
            yield e["prompt"], e["completion"] + "<|im_end|>", e["train"]


CONTEXT_WEIGHT = 0.3  # loss weight of the conversation part of a prompt (see encode_examples)
PARAM_VALUE = re.compile(r"<parameter=[^>\n]*>\n(.*?)\n</parameter>", re.S)
# A word or a figure: a digit run, or a run of letters that are not Han characters. (With `\w+` a Chinese reply's
# "43码还有3件" was one word with a figure in it, so whole Chinese sentences were key tokens and English replies
# never: at temperature 0 the model answered English stock questions with the Chinese template.)
WORD = re.compile(r"\d+|(?:(?![\u3400-\u9fff])[^\W\d_])+")
# What shows a reply's language first: a Han character or a Latin word.
LANGUAGE_MARK = re.compile(r"[\u3400-\u9fff]|[A-Za-z]+")


def key_spans(prompt, system_end_char, completion, call_stop=False):
    """Character spans of the completion a reply's correctness hangs on: tool-call parameter values (which
    product, colour, size, region) and, in a spoken reply, the words and figures read from the conversation
    (the viewer's comment, tool results) that the system turn does not contain. The tiny model gets the
    format right early; these few tokens are where its held-out answers go wrong. A spoken reply's first own word
    (not read from the conversation: "in" of "Oat in L", "码" of "Oat L码") is one too: it is where the reply's
    language is chosen, and weighting only the copied words would tip that choice to the language whose template
    copies a value first. With `call_stop`, in a tool-call completion also the token after each `</tool_call>`
    (another call or `<|im_end|>`: whether a two-question comment gets its second tool)."""
    if "<tool_call>" in completion:
        spans = [m.span(1) for m in PARAM_VALUE.finditer(completion)]
        if call_stop:
            spans += [(m.end(), m.end() + 1) for m in re.finditer("</tool_call>", completion) if m.end() < len(completion)]
        return spans
    system = {w.lower() for w in WORD.findall(prompt[:system_end_char])}
    seen = {w.lower() for w in WORD.findall(prompt[system_end_char:])}
    spans = [m.span() for m in WORD.finditer(completion)
             if m.group().isdigit() or (m.group().lower() in seen and m.group().lower() not in system)]
    for m in LANGUAGE_MARK.finditer(completion):
        if not any(m.start() < e and m.end() > a for a, e in spans):
            spans.append(m.span())
            break
    return spans


def encode_examples(tok, convs, key_weight=1.0, call_stop=False):
    """Prompt and completion are encoded separately (as the engine sees them: the prompt is encoded,
    the completion is generated token by token), then concatenated. Returns the flat ids, per-example
    offsets, the mask of trained completion tokens (the metrics' "reply tokens") and the loss weights:
    1 on trained completions, CONTEXT_WEIGHT on the conversation part of the prompt after the system turn
    (viewer comment, earlier calls, tool results, hook feedback: language the model must read, and a much
    denser signal than the completions alone), 0 on the system turn (the same harness text every time)."""
    end_id = tok.token_to_id("<|im_end|>")
    ids, offsets, masks, weights = [], [0], [], []
    for prompt, completion, train in example_texts(convs):
        p = tok.encode(prompt, add_special_tokens=False).ids
        enc = tok.encode(completion, add_special_tokens=False)
        c = enc.ids
        system_end = p.index(end_id) + 1 if end_id in p else len(p)
        ids.extend(p + c)
        masks.append(np.asarray([0] * len(p) + [int(train)] * len(c), dtype=np.uint8))
        cw = np.full(len(c), float(train), dtype=np.float32)
        if train and key_weight != 1.0:
            spans = key_spans(prompt, prompt.find("<|im_end|>") + len("<|im_end|>"), completion, call_stop)
            for t, (a, e) in enumerate(enc.offsets):
                if any(a < se and e > sa for sa, se in spans):
                    cw[t] = key_weight
        weights.append(np.concatenate([np.zeros(system_end, dtype=np.float32),
                                       np.full(len(p) - system_end, CONTEXT_WEIGHT, dtype=np.float32), cw]))
        offsets.append(len(ids))
    return (np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64), np.concatenate(masks),
            np.concatenate(weights))


def encode_split(tok, template, convs):
    texts = [render(template, c) for c in convs]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    ids, offsets, masks = [], [0], []
    for text, enc in zip(texts, encs):
        starts = np.asarray([a for a, _ in enc.offsets], dtype=np.int64)
        m = np.zeros(len(enc.ids), dtype=bool)
        for s, e in reply_spans(text):
            m |= (starts >= s) & (starts < e)
        ids.extend(enc.ids)
        masks.append(m.astype(np.uint8))
        offsets.append(len(ids))
    return np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64), np.concatenate(masks)


def write_json(path, obj):
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--key-weight", type=float, default=1.0,
                    help="loss weight of the key completion tokens (tool-call argument values; words and figures a "
                         "reply takes from the comment or a tool result), 1 = like every other completion token")
    ap.add_argument("--key-call-stop", action="store_true",
                    help="with --key-weight: the token after each </tool_call> (a second call or the end) is a key token too")
    ap.add_argument("--split", choices=sorted(SPLIT_PATTERNS), default="qwen",
                    help="pre-tokenisation: qwen (Qwen's pattern: a word takes one leading space or symbol) or words "
                         "(spaces and symbols are their own pre-tokens, so a word has the same ids wherever it is) or words-han "
                         "(words, and each Han character its own pre-token)")
    a = ap.parse_args()
    a.model_dir.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)

    template_src = TEMPLATE_FILE.read_text(encoding="utf-8")
    if template_src != tf.TEMPLATE:
        raise SystemExit("tests/fixtures/tokenizer/chat_template.jinja differs from tokenizer_fixture.TEMPLATE")
    template = tf.compile_template(template_src)
    train = load(a.corpus / "train.jsonl")
    test = load(a.corpus / "test.jsonl")

    agent = bool(train) and "examples" in train[0]
    if agent:
        tok = train_tokenizer([p + c for p, c, _ in example_texts(train[:BPE_TRAIN_CONVS])], a.split)
    else:
        tok = train_tokenizer([render(template, c) for c in train[:BPE_TRAIN_CONVS]], a.split)
    ids = {content: tok.token_to_id(content) for content, _ in tf.ADDED_TOKENS}
    vocab = tok.get_vocab_size(with_added_tokens=True)
    tok.save(str(a.model_dir / "tokenizer.json"), pretty=True)
    (a.model_dir / "chat_template.jinja").write_text(template_src, encoding="utf-8")
    write_json(a.model_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": s}
            for c, s in tf.ADDED_TOKENS
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 8192,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    write_json(a.model_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.95,
    })

    stats = {"vocab_size": vocab, "added_tokens": ids, "split": a.split}
    for name, convs in (("train", train), ("test", test)):
        if agent:
            flat, offs, mask, weight = encode_examples(tok, convs, a.key_weight if name == "train" else 1.0, a.key_call_stop)
            np.savez(a.out / f"{name}.npz", ids=flat, offsets=offs, reply_mask=mask, loss_weight=weight)
        else:
            flat, offs, mask = encode_split(tok, template, convs)
            np.savez(a.out / f"{name}.npz", ids=flat, offsets=offs, reply_mask=mask)
        lens = np.diff(offs)
        stats[name] = {"conversations": len(convs), "tokens": int(flat.size), "reply_tokens": int(mask.sum()),
                       "mean_len": float(lens.mean()), "p99_len": int(np.percentile(lens, 99)), "max_len": int(lens.max())}
    write_json(a.out / "tokenizer_stats.json", stats)
    print(f"tokenizer: vocab {vocab}, added {ids}")
    for name in ("train", "test"):
        print(f"  {name}: {stats[name]}")


if __name__ == "__main__":
    main()
