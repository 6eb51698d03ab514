#!/usr/bin/env python3
"""Does the model read the viewer's comment? A one-minute check of a model directory or a training checkpoint.

    tools/train/.venv/bin/python tools/train/probe_conditioning.py --model-dir models/nextn-live-tiny
    tools/train/.venv/bin/python tools/train/probe_conditioning.py --ckpt WORK/ckpt/ckpt.pt --model-dir MODEL_DIR

Each group holds comments that differ only in the value the answer depends on (a region, a size, greeting or
question), rendered through the real agent (`nextn harness render`, the model's harness profile) and, for
argument groups, teacher-forced up to the argument. Per group it prints the next-token distribution's top
tokens per comment, whether the greedy answer is right (the first token; for arguments the value written up to its newline), and the mean total-variation distance between
the comments' distributions: 0 means the output does not depend on the comment at all (what the bundled model before 2026-12-03 and 500 steps
of a shared-prefix, sdpa run of 16-row batches showed: the same region distribution, to three decimals, for Taiwan,
Hong Kong and Xinjiang), which a reply-token accuracy of 0.95 does not reveal. `--json` prints the summary as one object.
"""

import argparse
import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

REGION = "<tool_call>\n<function=shipping_policy>\n<parameter=region>\n"
SIZE = ("<tool_call>\n<function=check_stock>\n<parameter=product_id>\np009\n</parameter>\n<parameter=colour>\n"
        "White\n</parameter>\n<parameter=size>\n")
COLOUR = "<tool_call>\n<function=check_stock>\n<parameter=product_id>\np002\n</parameter>\n<parameter=colour>\n"
# (group, forced completion prefix, [(comment, expected start of the next token's text)])
GROUPS = [
    ("first token: tool or not", "", [
        ("hello hello", "text"), ("lol", "text"), ("Anika: greetings from the night shift", "text"),
        ("return policy?", "<tool_call>"), ("is the Charcoal hoodie in stock in L?", "<tool_call>"),
        ("how much is the crossbody bag?", "<tool_call>")]),
    ("shipping region", REGION, [
        ("Tom: do you ship to Taiwan and how much", "Taiwan"), ("shipping fee to Hong Kong?", "Hong"),
        ("delivery cost Xinjiang pls", "Remote"), ("how long does shipping overseas take?", "International")]),
    ("stock size", SIZE, [
        ("sneakers White 37 in stock?", "37"), ("sneakers White 41 in stock?", "41"), ("sneakers White 43 in stock?", "43")]),
    ("stock colour", COLOUR, [
        ("is the Charcoal hoodie in stock in L?", "Charcoal"), ("is the Oat hoodie in stock in L?", "Oat"),
        ("is the Black hoodie in stock in L?", "Black")]),
]


def render(nextn, comment, harness_model):
    out = subprocess.run([str(nextn), "harness", "render", "--comment", comment, "--model", str(harness_model)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[0])["requests"][0]["prompt"]


@torch.no_grad()
def greedy_value(model, tok, ids, limit=6):
    """The argument value the model writes next (greedy, up to its newline)."""
    out = []
    for _ in range(limit):
        nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
        if "\n" in tok.decode([nxt], skip_special_tokens=False):
            break
        out.append(nxt)
    return tok.decode(out, skip_special_tokens=False)


def load(a):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(a.model_dir / "tokenizer.json"))
    if a.ckpt:
        import model as M
        ck = torch.load(a.ckpt, weights_only=False)
        model, _ = M.build(ck["vocab_size"], ck["eos_id"], ck["pad_id"], 0, ck.get("arch", {}), "sdpa")
        model.load_state_dict(ck["model"])
    else:
        from transformers import Qwen3_5MoeForCausalLM
        model = Qwen3_5MoeForCausalLM.from_pretrained(str(a.model_dir), dtype=torch.float32, attn_implementation="sdpa",
                                                      experts_implementation="eager")
    return model.eval(), tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True, help="model directory (tokenizer; weights unless --ckpt)")
    ap.add_argument("--ckpt", type=Path, help="train.py checkpoint (ckpt.pt) to probe instead of the directory's weights")
    ap.add_argument("--nextn", type=Path, default=ROOT / "target/release/nextn")
    ap.add_argument("--harness-model", type=Path, default=ROOT / "models/nextn-live-tiny",
                    help="model directory whose harness profile and chat template render the prompts")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load(a)
    summary = {"groups": {}}
    for name, forced, cases in GROUPS:
        dists, right = [], 0
        for comment, want in cases:
            ids = tok.encode(render(a.nextn, comment, a.harness_model), add_special_tokens=False).ids
            ids += tok.encode(forced, add_special_tokens=False).ids if forced else []
            with torch.no_grad():
                p = model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)
            dists.append(p)
            top = torch.topk(p, 3)
            if want == "text":
                got = tok.decode([int(top.indices[0])], skip_special_tokens=False)
                ok = not got.startswith("<tool_call>")
            elif want == "<tool_call>":
                got = tok.decode([int(top.indices[0])], skip_special_tokens=False)
                ok = got == want
            else:
                got = greedy_value(model, tok, ids)
                ok = got.startswith(want)
            right += ok
            if not a.json:
                shown = [(tok.decode([int(i)], skip_special_tokens=False), round(float(v), 3)) for v, i in zip(top.values, top.indices)]
                print(f"{name:24s} {'ok ' if ok else 'BAD'} {comment[:40]:40s} want {want!r:14s} got {got!r:14s} top {shown}")
        tv = [0.5 * (x - y).abs().sum().item() for x, y in combinations(dists, 2)]
        summary["groups"][name] = {"cases": len(cases), "argmax_right": right, "mean_tv": sum(tv) / len(tv)}
        if not a.json:
            print(f"{name:24s} argmax right {right}/{len(cases)}, mean total-variation distance between comments {sum(tv) / len(tv):.3f}")
    summary["argmax_right"] = sum(g["argmax_right"] for g in summary["groups"].values())
    summary["cases"] = sum(g["cases"] for g in summary["groups"].values())
    print(json.dumps(summary) if a.json else f"overall argmax right {summary['argmax_right']}/{summary['cases']}")


if __name__ == "__main__":
    main()
