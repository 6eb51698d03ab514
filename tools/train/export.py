#!/usr/bin/env python3
"""Export nextn-live-tiny in the released Qwen3.5-MoE layout, verify it with stock transformers, measure it.

    python tools/train/export.py --ckpt WORK/ckpt --data WORK/data --corpus WORK/corpus \
        --model-dir models/nextn-live-tiny --report tools/train/report

Everything here runs stock transformers (the training fast path of fastpath.py is NOT installed):

  model.safetensors   bf16 (linear_attn.A_log kept float32, like tests/fixtures/qwen3_5_moe_bf16), names
                      `model.language_model.*`, top-level `lm_head.weight`, fused experts
                      `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) / `mlp.experts.down_proj`
                      [E, H, I], and the 19 `mtp.*` tensors (reference §1.5)
  config.json         the released wrapper structure of tests/fixtures/qwen3_5_moe/config.json
  nextn.json          {"harness": DIR}: the harness profile the model was trained on (--harness, default
                      harness/live-tiny), relative to the model directory; `nextn agent` uses it when no
                      --harness is given
  reference.json      5 held-out chat prompts: input_ids (chat template, add_generation_prompt=True,
                      enable_thinking=False) and transformers' greedy continuation (float32 compute of the
                      bf16 weights upcast, do_sample=False, max_new_tokens 64, stop at EOS; the EOS id is the
                      last greedy id when it stopped)
  heldout_prompts.jsonl  30 held-out viewer comments
  README.md           model card
(train.sh then adds draft_vocab.txt with `nextn draft-vocab`.)
and tools/train/report/{report.json, loss.png}.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import model as M  # noqa: E402
import tokenizer as T  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import mtp_reference  # noqa: E402  (path set up by model.py)

MAX_NEW = 64  # a check_stock call with a two-word colour is ~52 tokens with the words tokenizer
# Small vision tower config, as in tests/fixtures (ignored by a text-only engine; no visual tensors).
VISION = dict(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64, num_heads=2,
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
              num_position_embeddings=64)


def fail(msg):
    print(f"export.py: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


# ------------------------------------------------------------------------------------------------
# Weights and config
# ------------------------------------------------------------------------------------------------
def is_alog(name):
    return name.endswith("linear_attn.A_log")


def released_tensors(model_sd, mtp_sd):
    out = {}
    for n, t in model_sd.items():
        name = "model.language_model." + n[len("model."):] if n.startswith("model.") else n
        out[name] = t.detach().to(torch.float32) if is_alog(name) else t.detach().to(torch.bfloat16)
    for n, t in mtp_sd.items():
        out[mtp_reference.PREFIX + n] = t.detach().to(torch.bfloat16)
    return {n: out[n].contiguous() for n in sorted(out)}


def config_json(model):
    with __import__("tempfile").TemporaryDirectory() as tmp:
        cfg = model.config
        saved = (cfg.dtype, cfg.architectures)
        cfg.dtype, cfg.architectures = torch.bfloat16, [type(model).__name__]
        cfg.save_pretrained(tmp)
        cfg.dtype, cfg.architectures = saved
        text = json.loads((Path(tmp) / "config.json").read_text())
    text.pop("architectures", None)
    text.pop("transformers_version", None)
    text["dtype"] = "bfloat16"
    text["full_attention_interval"] = 4
    text["partial_rotary_factor"] = text["rope_parameters"]["partial_rotary_factor"]
    text["mamba_ssm_dtype"] = "float32"
    wrapper = Qwen3_5MoeConfig(text_config=dict(text), vision_config=dict(VISION))
    d = json.loads(wrapper.to_json_string(use_diff=True))
    d["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    d["text_config"] = dict(sorted({**d["text_config"], **text}.items()))
    d["tie_word_embeddings"] = False
    assert d["model_type"] == "qwen3_5_moe" and d["text_config"]["model_type"] == "qwen3_5_moe_text"
    return d


def write_nextn_json(model_dir, harness):
    """nextn.json: the harness profile the model was trained on, relative to the model directory."""
    if not (harness / "harness.json").is_file():
        fail(f"--harness {harness}: no harness.json there")
    rel = Path(os.path.relpath(harness.resolve(), model_dir.resolve())).as_posix()
    (model_dir / "nextn.json").write_text(json.dumps({"harness": rel}, indent=2) + "\n")


def load_exported(model_dir):
    """transformers' own from_pretrained (prefix strip, fused experts) + the mtp.* tensors."""
    model, info = Qwen3_5MoeForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if v and k != "unexpected_keys"}
    unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
    if bad or unexpected:
        fail(f"transformers loading info {info}")
    model.eval()
    mtp = mtp_reference.Qwen3_5MoeMTP(model)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        mtp.load_mtp({n: f.get_tensor(n) for n in f.keys() if n.startswith(mtp_reference.PREFIX)})
    return model, mtp


def load_by_hand(model_dir):
    """Second, independent load path: config -> model, state dict from the file with the prefix stripped."""
    cfg = json.loads((model_dir / "config.json").read_text())["text_config"]
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "dtype")})
    model = Qwen3_5MoeForCausalLM._from_config(config, attn_implementation="eager", experts_implementation="eager",
                                               dtype=torch.float32)
    sd = load_file(str(model_dir / "model.safetensors"))
    own = {}
    for n, t in sd.items():
        if n.startswith("model.language_model."):
            own["model." + n[len("model.language_model."):]] = t.float()
        elif n == "lm_head.weight":
            own[n] = t.float()
    model.load_state_dict(own, strict=True)
    model.eval()
    return model


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_metrics(model, mtp, data, limit):
    ids, offs, rmask = data["ids"], data["offsets"], data["reply_mask"]
    acc = {k: [0, 0] for k in ("main_all", "main_reply", "mtp_all", "mtp_reply", "mtp_vs_main_all", "mtp_vs_main_reply")}
    nll = {"main": [0.0, 0], "mtp": [0.0, 0]}
    n_conv = min(limit, len(offs) - 1)
    for i in range(n_conv):
        x = ids[offs[i] : offs[i + 1]].astype(np.int64)
        rm = rmask[offs[i] : offs[i + 1]].astype(bool)
        n = len(x)
        h, logits = mtp_reference.main_hidden(model, x.tolist())
        pred = logits.argmax(-1).numpy()  # pred[p] -> token p+1
        ok = pred[:-1] == x[1:]
        acc["main_all"][0] += int(ok.sum()); acc["main_all"][1] += n - 1
        acc["main_reply"][0] += int(ok[rm[1:]].sum()); acc["main_reply"][1] += int(rm[1:].sum())
        lp = torch.log_softmax(logits[:-1], -1)[torch.arange(n - 1), torch.from_numpy(x[1:])]
        nll["main"][0] -= lp.sum().item(); nll["main"][1] += n - 1
        # MTP rows p = 0..n-3: (token p+1, h_p, position p) -> token p+2
        _, ml = mtp(x[1 : n - 1].tolist(), h[: n - 2], list(range(n - 2)), cache=None)
        mp = ml.argmax(-1).numpy()
        okm = mp == x[2:]
        r2 = rm[2:]
        acc["mtp_all"][0] += int(okm.sum()); acc["mtp_all"][1] += n - 2
        acc["mtp_reply"][0] += int(okm[r2].sum()); acc["mtp_reply"][1] += int(r2.sum())
        agree = mp == pred[1 : n - 1]  # the main model's own argmax for token p+2 (given tokens <= p+1)
        acc["mtp_vs_main_all"][0] += int(agree.sum()); acc["mtp_vs_main_all"][1] += n - 2
        acc["mtp_vs_main_reply"][0] += int(agree[r2].sum()); acc["mtp_vs_main_reply"][1] += int(r2.sum())
        lq = torch.log_softmax(ml, -1)[torch.arange(n - 2), torch.from_numpy(x[2:])]
        nll["mtp"][0] -= lq.sum().item(); nll["mtp"][1] += n - 2
    out = {"conversations": n_conv, "tokens": acc["main_all"][1], "reply_tokens": acc["main_reply"][1]}
    for k, (a, b) in acc.items():
        out[k + "_acc"] = a / b
    out["main_loss"] = nll["main"][0] / nll["main"][1]
    out["mtp_loss"] = nll["mtp"][0] / nll["mtp"][1]
    return out


class RouterGap:
    def __init__(self, modules, k):
        self.k, self.min_gap = k, math.inf
        self.h = [r.register_forward_hook(self.hook) for m in modules for r in m.modules()
                  if isinstance(r, mtp_reference.Qwen3_5MoeTopKRouter)]

    def hook(self, mod, inp, out):
        p = torch.softmax(out[0].float(), -1)
        top = torch.topk(p, self.k + 1, -1).values
        self.min_gap = min(self.min_gap, (top[:, self.k - 1] - top[:, self.k]).min().item())

    def close(self):
        for h in self.h:
            h.remove()


@torch.no_grad()
def greedy(model, input_ids, eos_ids, pad_id):
    inp = torch.tensor([input_ids], dtype=torch.long)
    gen = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True, output_logits=True,
                         return_dict_in_generate=True, top_k=None, top_p=None, temperature=None)
    seq = gen.sequences[0].tolist()
    out = seq[len(input_ids):]
    step_logits = torch.stack([s[0] for s in gen.logits]).float()
    return out, step_logits


@torch.no_grad()
def greedy_case(model, ids, eos_ids, pad_id):
    gap = RouterGap([model], model.config.num_experts_per_tok)
    try:
        out, step_logits = greedy(model, ids, eos_ids, pad_id)
        full = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0].float()
    finally:
        gap.close()
    full = full[len(ids) - 1 : len(ids) - 1 + len(out)]
    if full.argmax(-1).tolist() != out or step_logits.argmax(-1).tolist() != out:
        fail("cached generate and the no-cache forward disagree on the greedy ids")
    margin = min((torch.topk(lg, 2, -1).values[:, 0] - torch.topk(lg, 2, -1).values[:, 1]).min().item()
                 for lg in (step_logits, full))
    return out, margin, gap.min_gap, (step_logits - full).abs().max().item()


@torch.no_grad()
def tool_use_probe(model, tok, test, eos_ids, pad_id, limit=40):
    """Greedy first model request of held-out agent cases (the exact agent prompt): is the first tool call
    the one the case makes (or no call where the case answers directly)? The real measure is the replay
    (`nextn-bench replay`); this is a quick check inside the pipeline."""
    want_call = [c for c in test if c["tools"]][:limit]
    no_call = [c for c in test if not c["tools"]][:limit]
    res = {}
    for kind, items in (("should_call", want_call), ("should_not_call", no_call)):
        right = 0
        for c in items:
            ids = tok.encode(c["examples"][0]["prompt"], add_special_tokens=False).ids
            out, _ = greedy(model, ids, eos_ids, pad_id)
            text = tok.decode(out, skip_special_tokens=False)
            got = [seg.split(">", 1)[0] for seg in text.split("<function=")[1:]]
            right += (got[:1] == [c["tools"][0][0]]) if c["tools"] else (not got)
        res[kind] = {"cases": len(items), "correct": right, "rate": right / max(1, len(items))}
    return res


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------
def pick_heldout_prompts(test, n):
    """Round-robin over the held-out cases' categories, in corpus order: diverse and deterministic."""
    by_cat = {}
    for c in test:
        if c["comment"].strip():
            by_cat.setdefault(c["category"], []).append(c["comment"])
    out, seen = [], set()
    while len(out) < n and any(by_cat.values()):
        for k in sorted(by_cat):
            while by_cat[k]:
                p = by_cat[k].pop(0)
                if p not in seen:
                    seen.add(p)
                    out.append(p)
                    break
            if len(out) == n:
                break
    return out


def wire_to_template(messages):
    """Tool-call arguments as the agent sends them (JSON strings, the OpenAI wire form) -> objects, which
    the chat template iterates (what the engine does before rendering)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                args = c["function"].get("arguments")
                if isinstance(args, str):
                    c["function"]["arguments"] = json.loads(args)
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def reference_candidates(test, per_kind=4):
    """Up to per_kind held-out agent requests (exact harness/live-tiny prompts) for each of 5 kinds:
    greeting (a direct reply), shipping and price_size (the reply after the tool result), tools_stock (the
    first request of a stock question: a check_stock call) and system_size (a Chinese viewer's first request)."""
    def find(cat, which, pred=lambda c: True):
        out = []
        for c in test:
            if c["category"] in cat and pred(c) and len(out) < per_kind:
                e = c["examples"][which]
                out.append((wire_to_template(e["messages"]), e["tools"] or None, e["prompt"]))
        if not out:
            fail(f"no held-out case of category {cat}")
        return out

    return [
        ("price_size", find(("product_facts",), -1, lambda c: len(c["examples"]) == 2)),
        ("shipping", find(("shipping",), -1, lambda c: len(c["examples"]) == 2)),
        ("greeting", find(("greeting", "negative_feedback", "compliance_bait", "empty_spam"), 0, lambda c: not c["tools"])),
        ("system_size", find(("chinese",), 0, lambda c: bool(c["tools"]))),
        ("tools_stock", find(("stock_size",), 0)),
    ]


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def ema(xs, a=0.95):
    out, v = [], None
    for x in xs:
        v = x if v is None else a * v + (1 - a) * x
        out.append(v)
    return out


def plot(hist, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    s = hist["step"]
    ax.plot(s, hist["main"], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(s, hist["mtp"], color="tab:orange", alpha=0.25, lw=0.8)
    ax.plot(s, ema(hist["main"]), color="tab:blue", lw=1.8, label="main next-token loss (train, EMA)")
    ax.plot(s, ema(hist["mtp"]), color="tab:orange", lw=1.8, label="MTP next-next-token loss (train, EMA)")
    ev = hist["eval"]
    ax.plot([e["step"] for e in ev], [e["main"] for e in ev], "o--", color="tab:blue", ms=4, label="main (held-out)")
    ax.plot([e["step"] for e in ev], [e["mtp"] for e in ev], "s--", color="tab:orange", ms=4, label="MTP (held-out)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    sm = hist["summary"]
    ax.set_title(f"nextn-live-tiny: {sm['steps']} steps, {sm['tokens'] / 1e6:.2f}M tokens, {sm['wall_s'] / 60:.1f} min CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def dump(obj, level=0):
    """JSON with dicts/lists of containers indented and flat lists of scalars on one line."""
    ind = "  " * level
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{ind}  {json.dumps(k)}: {dump(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + ind + "}"
    if isinstance(obj, (list, tuple)):
        if obj and all(not isinstance(v, (dict, list, tuple)) for v in obj):
            return "[" + ",".join(json.dumps(v, ensure_ascii=False) for v in obj) + "]"
        if not obj:
            return "[]"
        return "[\n" + ",\n".join(ind + "  " + dump(v, level + 1) for v in obj) + "\n" + ind + "]"
    return json.dumps(obj, ensure_ascii=False)


def shared_prefix_text(t):
    p = t.get("shared_prefix_tokens", 0)
    if not p:
        return ""
    return (f"; the {p}-token harness prompt prefix every request shares runs once per step and all rows continue "
            f"from its cache, with gradients: `model.shared_prefix_losses`, checked against whole rows at start-up")


def split_text(rep):
    split = rep["tokenizer"].get("split", "qwen")
    if split in ("words", "words-han"):
        text = ("the Qwen split regex except that a word never absorbs the space or symbol before it "
                f"(`tokenizer.py --split {split}`: \" Emerald\" in a comment and \"\\nEmerald\" in a tool call are the same ids")
        if split == "words-han":
            text += "; every Han character is its own pre-token, so a Chinese comment the corpus never had is made of the same character ids as the ones it had"
        return text + ")"
    return "Qwen split regex"


def drill_text(t):
    calls, replies = t.get("drill_batch", 0), t.get("reply_drill_batch", 0)
    if not (calls or replies):
        return ""
    which = ("every first request (a tool call or a direct answer: whether to call is decided there) and every later "
             "request that calls a tool" if t.get("drill_rows") == "decisions" else "first requests that call a tool")
    return (f" Beside each batch, dense drill rows without the system turn, the values a completion copies from the "
            f"comment or a tool result and a reply's first own word (where its language is chosen) weighted "
            f"{t['drill_key_weight']:g}: {calls} rows of {which} and {replies} rows of spoken replies (`train.py "
            f"--drill-batch`, `--drill-rows`, `--reply-drill-batch`); without them the model's answers did not depend "
            f"on the comment (`tools/train/probe_conditioning.py`).")


def hsa_text(corpus_stats):
    """The model card's sentence on Harness-State Augmentation; empty for a fixed-harness corpus."""
    hv = corpus_stats.get("harness_variants")
    if not hv:
        return ""
    by = corpus_stats["train"].get("by_harness", {})
    kept = ", ".join(f"{k} {v['kept']}" for k, v in by.items())
    return (f"\n\nHarness-State Augmentation: {hv['share']:.0%} of the training cases render through one of {hv['n']} perturbed "
            f"variants of the harness (`nextn harness perturb`, all five dimensions, seeds {hv['variant_seed'] + 1}.."
            f"{hv['variant_seed'] + hv['n']}), the scripted completions in each variant's tool names and hook wording; "
            f"cases kept per harness: {kept}. The held-out split stays on the original harness.")


def human(n):
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def chain_text(ch):
    """The mtp_chain.py stage, when it ran."""
    if not ch:
        return ""
    first, last = ", ".join(f"{x:.2f}" for x in ch["first_agreement"]), ", ".join(f"{x:.2f}" for x in ch["last_agreement_mean"])
    return f"""

Then `tools/train/mtp_chain.py` trained the MTP alone (main model frozen, so its outputs are unchanged) on its own
{ch['draft_steps']} chained draft steps as serving runs them (step k > 1 takes the MTP's own output hidden of step k-1;
the batched chain matches the serving order of operations to {ch['serving_order_max_diff']:.0e}), against the main
model's next-token distribution: {ch['steps']} steps x {ch['batch_rows']} rows, {ch['wall_s'] / 60:.1f} min. Argmax agreement
with the main model per draft step on the training rows went from {first} (first batch) to {last} (last fifth)."""


def model_card(rep):
    c, p, t, m = rep["config"], rep["params"], rep["training"], rep["heldout"]
    added = rep["tokenizer"]["added_tokens"]
    added_ids = ", ".join(f"`{k}` {v}" for k, v in added.items())
    samples = "\n".join(
        f"| `{s['prompt']}` | {s['reply'].replace('|', '/').replace(chr(10), ' ')} |" for s in rep["samples"]
    )
    return f"""# nextn-live-tiny

A **toy** `qwen3_5_moe` checkpoint (Qwen3.5-MoE architecture with an MTP head) trained from scratch on the
agent's own requests for the bundled shop: the exact prompts `nextn agent` sends with the compact harness profile
`harness/live-tiny` (rendered by `nextn harness render`), the bundled commerce MCP server's tools and real tool
results, and short grounded replies. It is a demo and benchmark artefact: it knows one shop (12 products) and a
few dozen reply patterns, and it needs its harness profile (`nextn.json` names it; `nextn agent` picks it up).

Built by `tools/train/train.sh` (one command: corpus, tokenizer, training, export, report).

## Architecture

| | |
|---|---|
| class | `Qwen3_5MoeForConditionalGeneration` wrapper config, text model `qwen3_5_moe_text` |
| layers | {c['num_hidden_layers']}: {', '.join(c['layer_types'])} (3:1 Gated DeltaNet : gated attention) |
| hidden | {c['hidden_size']} |
| attention | {c['num_attention_heads']} query heads / {c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}, output gate, partial RoPE {c['rope_parameters']['partial_rotary_factor']}, theta {c['rope_parameters']['rope_theta']:.0e} |
| Gated DeltaNet | {c['linear_num_key_heads']} q/k heads x {c['linear_key_head_dim']}, {c['linear_num_value_heads']} v heads x {c['linear_value_head_dim']}, conv kernel {c['linear_conv_kernel_dim']} |
| MoE (every layer) | {c['num_experts']} routed experts, top-{c['num_experts_per_tok']} (renormalised), expert FFN {c['moe_intermediate_size']}, one sigmoid-gated shared expert FFN {c['shared_expert_intermediate_size']} |
| MTP | {c['mtp_num_hidden_layers']} layer (full attention + MoE), shares `embed_tokens` / `lm_head` |
| vocab | {c['vocab_size']} rows ({rep['tokenizer']['vocab_size']} tokenizer ids, rest padding), untied `lm_head` |
| parameters | {human(p['total'])} total = {human(p['main_total'])} main + {human(p['mtp_total'])} MTP; active per token {human(p['main_active_per_token'])} (main) + {human(p['mtp_active_per_token'])} (MTP) |
| file | `model.safetensors`, bf16 (`linear_attn.A_log` float32), released Qwen3.5 names: `model.language_model.*`, `lm_head.weight`, fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) / `mlp.experts.down_proj` [E, H, I], 19 `mtp.*` tensors |

## Tokenizer and chat template

Byte-level BPE trained on the corpus with the `tokenizers` library (Qwen pipeline: NFC, {split_text(rep)},
ByteLevel), {rep['tokenizer']['vocab_size']} ids: the BPE vocabulary, then the added tokens {added_ids}.
The BPE stops short of a few thousand merges because the corpus has only a few thousand distinct words.
`chat_template.jinja` is the project's Qwen3.5-style template
(`tests/fixtures/tokenizer/chat_template.jinja`): ChatML turns, a `# Tools` system section, XML tool calls,
`<tool_response>` user turns, and `enable_thinking=false` → an empty `<think>\\n\\n</think>\\n\\n` block.
Stop ids (`generation_config.json`): `<|im_end|>`, `<|endoftext|>`.

## Data

`tools/train/agent_corpus.py`, deterministic from the seed ({rep['corpus']['seed']}): {rep['corpus']['train_conversations']} training and
{rep['corpus']['test_conversations']} held-out agent cases over a catalogue of {rep['corpus']['products']} products. Each case (a viewer comment in English
or Chinese, sometimes with history or a room file) runs twice through the real agent loop with a scripted model
(`nextn harness render`): once with its tool calls (the real server's results come back), once with the calls and
a reply composed from those results. Every model request is one training example: the exact prompt (loss-free
context) + the scripted completion (tool calls in Qwen3.5 XML, or the reply) + `<|im_end|>`. Some cases first
reply with an invented figure or a guarantee; the hook's retry message is in the next prompt and only the
corrected reply is trained. Cases cover product facts, stock by colour and size, promotions (the expired FLASH100
is never offered), shipping, after-sales, the room, multi-tool comments, greetings, negative feedback,
compliance bait, prompt injection and spam. Calls to `get_product`, `shipping_policy` and `after_sales_policy` name the fields the comment asks about (`fields`, `agent_corpus.py --tool-fields`), so the tool result holds just those and the reply reads them; a promotion question about one deal calls `list_promotions` with that deal's `code` and the asked `fields` (`--promo-codes`: "KNIT2" + "valid_until" for "when does the two-tops deal end"; the ended FLASH100 comes back marked `running: false`). Held out: the replay's cases use other templates and the stock
variants they ask about are never in training. Counts: `tools/train/report/report.json` (`corpus.agent_corpus`).{hsa_text(rep['corpus']['agent_corpus'])}

## Training

Next-token loss + {t['mtp_weight']} x MTP loss (MTP row p = normed embedding of token p+1 ++ the main model's
post-final-norm hidden at p, predicting token p+2; the hidden is {'detached' if t['detach_hidden'] else 'not detached, so the MTP gradient also trains the main model'})
+ {t['router_aux_loss_coef']} x load-balancing loss. PyTorch on CPU with transformers' `Qwen3_5MoeForCausalLM` and the
MTP module of `tools/fixtures/mtp_reference.py`; AdamW (lr {t['lr']}, cosine to 10%, warmup {t['warmup']}, wd {t['weight_decay']}),
{t['steps']} steps x {t['batch_rows']} rows (one agent request each, padded to the batch's longest{shared_prefix_text(t)}), {human(t['tokens'])} tokens
({t['epochs']:.2f} epochs), {t['threads']} threads, {t['wall_s'] / 60:.1f} min.{drill_text(t)} Loss curves: `tools/train/report/loss.png`.{chain_text(rep.get('mtp_chain'))}
For speed, training runs transformers' chunked Gated DeltaNet and causal conv through `tools/train/fastpath.py`
(exact reformulations, checked against transformers' own functions at start-up, max difference
{t['fast_path_max_diff']:.0e}); every number in this directory comes from stock transformers.

Reproduce: `tools/train/train.sh` (seed {t['seed']}; `TRAIN_THREADS` default 2). On the same machine with the same
thread count a rerun gives bit-identical weights; other CPUs or thread counts give slightly different ones.

## Held-out metrics (exported bf16 weights, float32 compute, teacher-forced)

| | all tokens | reply tokens |
|---|---|---|
| main next-token top-1 accuracy | {m['main_all_acc']:.3f} | {m['main_reply_acc']:.3f} |
| MTP top-1 accuracy (token p+2) | {m['mtp_all_acc']:.3f} | {m['mtp_reply_acc']:.3f} |
| MTP argmax == main model's argmax for p+2 (draft-1 acceptance proxy) | {m['mtp_vs_main_all_acc']:.3f} | {m['mtp_vs_main_reply_acc']:.3f} |

Main loss {m['main_loss']:.3f}, MTP loss {m['mtp_loss']:.3f} nats/token over {m['tokens']} tokens of {m['conversations']} held-out
conversations. "All tokens" includes the fixed `# Tools` system text and the template markup, which are easy;
"reply tokens" are the assistant turns after the think block, up to and including `<|im_end|>`
({m['reply_tokens']} tokens) and are the honest number. The MTP row p sees the true token p+1 (teacher forcing).

Tool use (greedy first reply of held-out conversations that have tools): the right first tool call where the
corpus calls one {rep['tool_use_probe']['should_call']['correct']}/{rep['tool_use_probe']['should_call']['cases']}; no tool call where the corpus answers
directly {rep['tool_use_probe']['should_not_call']['correct']}/{rep['tool_use_probe']['should_not_call']['cases']}.

The agent-level measures (tool correctness, required facts, grounding, language, MTP acceptance) come from
`nextn-bench replay` with the real agent and commerce server, run by `train.sh` after the export:
`tools/train/report/replay/summary.md`; whether the output follows the comment: `tools/train/report/probe.json`.

## Greedy samples (transformers, `do_sample=False`, first agent request of held-out cases)

| viewer comment | reply |
|---|---|
{samples}

## Files for engine checks

* `reference.json`: 5 held-out agent requests (harness/live-tiny prompts with the tools; `price_size` and
  `shipping` are second requests after a tool result, `tools_stock` a stock question answered by a call): `input_ids` (template with `add_generation_prompt=True`, `enable_thinking=False`) and
  `greedy_ids` from transformers (float32 compute of these bf16 weights, max 64 new tokens, stops at and
  includes the EOS id), plus `min_greedy_margin` / `min_router_margin`.
* `heldout_prompts.jsonl`: 30 held-out viewer comments (`{{"prompt": ...}}`; apply the chat template yourself).
* `nextn.json`: `{{"harness": ...}}`, the harness profile the model was trained on (relative to this directory);
  `nextn agent`, `nextn harness render` and `nextn-bench replay` use it when no `--harness` is given.
* `draft_vocab.txt`: token ids ranked by frequency in the training completions (end-of-turn ids first), written by
  `nextn draft-vocab` at the end of `train.sh`; `--draft-vocab N` drafts over the first N (output unchanged).
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--timings", type=Path, default=None)
    ap.add_argument("--harness", type=Path, default=ROOT / "harness" / "live-tiny",
                    help="the harness profile the model was trained on, declared in nextn.json")
    ap.add_argument("--eval-convs", type=int, default=400)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TRAIN_THREADS", "2")))
    a = ap.parse_args()
    t0 = time.time()
    M.env_setup(a.threads)
    transformers.utils.logging.disable_progress_bar()
    a.report.mkdir(parents=True, exist_ok=True)

    ck = torch.load(a.ckpt / "ckpt.pt", weights_only=True)
    hist = json.loads((a.ckpt / "history.json").read_text())
    tstats = json.loads((a.data / "tokenizer_stats.json").read_text())
    added = tstats["added_tokens"]
    eos_ids = [added["<|im_end|>"], added["<|endoftext|>"]]
    pad_id = added["<|endoftext|>"]

    # Build the stock model, load the trained float32 weights, write the released layout.
    model, mtp = M.build(ck["vocab_size"], eos_ids, pad_id, 0, ck.get("arch"))
    model.load_state_dict(ck["model"], strict=True)
    mtp.load_state_dict(ck["mtp"], strict=True)
    model.eval()
    stored = released_tensors(model.state_dict(), mtp.state_dict())
    if sum(n.startswith("mtp.") for n in stored) != 19:
        fail("expected 19 mtp.* tensors")
    cfg = config_json(model)
    d = a.model_dir
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_nextn_json(d, a.harness)
    save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(d / "model.safetensors", 0o644)
    print(f"export: wrote {d / 'model.safetensors'} ({(d / 'model.safetensors').stat().st_size / 1e6:.1f} MB)", flush=True)

    # Reload with transformers (prefix strip + fused experts) and check every tensor.
    emodel, emtp = load_exported(d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if names != set(stored):
            fail("tensor names in the file differ")
        for n in names:
            t = f.get_tensor(n)
            if t.dtype != stored[n].dtype or not torch.equal(t, stored[n]):
                fail(f"tensor {n} differs in the file")
    want = {("model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n): t.float()
            for n, t in stored.items() if not n.startswith("mtp.")}
    for n, p in emodel.named_parameters():
        if not torch.equal(p, want[n]):
            fail(f"transformers-loaded parameter {n} != stored value")
    for n, p in emtp.named_parameters():
        if not torch.equal(p, stored["mtp." + n].float()):
            fail(f"MTP parameter {n} != stored value")
    hand = load_by_hand(d)

    # Held-out metrics with the exported weights.
    test_data = np.load(a.data / "test.npz")
    metrics = heldout_metrics(emodel, emtp, test_data, a.eval_convs)
    print(f"export: held-out {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})}", flush=True)

    # Prompts: held-out comments, reference cases, samples.
    test = T.load(a.corpus / "test.jsonl")
    catalog = json.loads((HERE.parents[1] / "tools/commerce-mcp/data/catalog.json").read_text(encoding="utf-8"))

    template = T.tf.compile_template((d / "chat_template.jinja").read_text(encoding="utf-8"))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))

    def prompt_ids(messages, tools):
        text = template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True,
                               enable_thinking=False, **T.tf.SPECIAL_TOKEN_VARS)
        return text, tok.encode(text, add_special_tokens=False).ids

    heldout = pick_heldout_prompts(test, 30)
    with open(d / "heldout_prompts.jsonl", "w", encoding="utf-8") as f:
        for p in heldout:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")

    # Reference cases: for each kind, the candidate whose greedy run is furthest from a tie (top-1 vs
    # top-2 logit gap and router top-k gap), so that an engine's own rounding cannot flip a token.
    cases = []
    for name, candidates in reference_candidates(test):
        best = None
        for messages, tools, agent_prompt in candidates:
            text, ids = prompt_ids(messages, tools)
            if text != agent_prompt:
                fail(f"{name}: the chat template over the agent's messages differs from the prompt nextn harness render printed")
            out, margin, rgap, cache_diff = greedy_case(emodel, ids, eos_ids, pad_id)
            # A run cut at MAX_NEW cannot check how an engine ends a reply or a tool call: completed runs first.
            score = (bool(out and out[-1] in eos_ids), min(margin / 0.5, rgap / 1e-3))
            if best is None or score > best[0]:
                best = (score, messages, tools, ids, out, margin, rgap, cache_diff)
        _, messages, tools, ids, out, margin, rgap, cache_diff = best
        out2, _ = greedy(hand, ids, eos_ids, pad_id)
        if out2 != out:
            fail(f"{name}: the hand-loaded model's greedy ids differ from from_pretrained's")
        reply = tok.decode(out, skip_special_tokens=False)
        comment = next(m["content"] for m in messages if m["role"] == "user")
        cases.append({"name": name, "prompt": comment, "messages": messages, "tools": tools,
                      "input_ids": ids, "greedy_ids": out, "stopped_at_eos": bool(out and out[-1] in eos_ids),
                      "min_greedy_margin": margin, "min_router_margin": rgap, "text": reply,
                      "_cache_diff": cache_diff})
        print(f"  ref {name}: {comment!r} -> {reply!r} (margin {margin:.3f}, router gap {rgap:.2e})", flush=True)
    ref = {
        "generator": "tools/train/export.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "seed": ck["seed"],
        "model_class": "Qwen3_5MoeForCausalLM",
        "weights_dtype": "bfloat16",
        "compute_dtype": "float32",
        "chat_template_kwargs": {"add_generation_prompt": True, "enable_thinking": False},
        "max_new_tokens": MAX_NEW,
        "eos_token_ids": eos_ids,
        "cases": [{k: v for k, v in c.items() if not k.startswith("_")} for c in cases],
    }
    (d / "reference.json").write_text(dump(ref) + "\n", encoding="utf-8")

    samples = []
    for c in [c for c in test if c["examples"]][:: max(1, len(test) // 8)][:8]:
        _, ids = None, tok.encode(c["examples"][0]["prompt"], add_special_tokens=False).ids
        out, _ = greedy(emodel, ids, eos_ids, pad_id)
        samples.append({"prompt": c["comment"], "reply": tok.decode(out, skip_special_tokens=False).replace("<|im_end|>", "").strip(),
                        "in_training_set": None})
    train_users = {json.loads(line)["comment"] for line in open(a.corpus / "train.jsonl", encoding="utf-8")}
    for s_ in samples:
        s_["in_training_set"] = s_["prompt"] in train_users
        print(f"  sample: {s_['prompt']!r} -> {s_['reply']!r}", flush=True)

    probe = tool_use_probe(emodel, tok, test, eos_ids, pad_id)
    print(f"export: tool-use probe {probe}", flush=True)

    # Report + plot + model card.
    plot(hist, a.report / "loss.png")
    timings = json.loads(a.timings.read_text()) if a.timings and a.timings.exists() else {}
    corpus_train = sum(1 for _ in open(a.corpus / "train.jsonl", encoding="utf-8"))
    text_cfg = cfg["text_config"]
    rep = {
        "model": "models/nextn-live-tiny",
        "config": {k: text_cfg[k] for k in (
            "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_parameters", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size", "mtp_num_hidden_layers")},
        "params": hist["summary"]["params"],
        "tokenizer": {"vocab_size": tstats["vocab_size"], "added_tokens": added, "split": tstats.get("split", "qwen")},
        "corpus": {"seed": ck["seed"], "train_conversations": corpus_train, "test_conversations": len(test),
                   "products": len(catalog["products"]), "train_tokens": tstats["train"]["tokens"],
                   "agent_corpus": json.loads((a.corpus / "corpus_stats.json").read_text(encoding="utf-8")),
                   "test_tokens": tstats["test"]["tokens"]},
        "training": {k: v for k, v in hist["summary"].items() if k != "params"},
        "final_train_loss_ema": {"main": ema(hist["main"])[-1], "mtp": ema(hist["mtp"])[-1]},
        "mtp_chain": hist.get("mtp_chain", {}).get("summary"),
        "eval_curve": hist["eval"],
        "heldout": metrics,
        "tool_use_probe": probe,
        "reference_cases": [{"name": c["name"], "prompt": c["prompt"], "tools": bool(c["tools"]), "reply": c["text"],
                             "prompt_tokens": len(c["input_ids"]), "new_tokens": len(c["greedy_ids"]),
                             "stopped_at_eos": c["stopped_at_eos"], "min_greedy_margin": c["min_greedy_margin"],
                             "min_router_margin": c["min_router_margin"],
                             "cached_vs_uncached_max_abs_logit_diff": c["_cache_diff"]} for c in cases],
        "samples": samples,
        "model_dir_bytes": sum(f.stat().st_size for f in d.iterdir() if f.is_file()),
        "timings_s": timings,
        "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
        "loss_curve_data": "tools/train/report/loss.png (per-step values are in WORK/ckpt/history.json)",
    }
    (d / "README.md").write_text(model_card(rep), encoding="utf-8")
    rep["model_dir_bytes"] = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    rep["export_s"] = time.time() - t0
    if os.environ.get("PIPELINE_START"):
        rep["timings_s"]["export"] = round(time.time() - t0)
        rep["timings_s"]["total"] = round(time.time() - int(os.environ["PIPELINE_START"]))
    (a.report / "report.json").write_text(dump(rep) + "\n", encoding="utf-8")
    print(f"export: done in {time.time() - t0:.0f}s; model dir {rep['model_dir_bytes'] / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
