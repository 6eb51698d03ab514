#!/usr/bin/env python3
"""Train nextn-live-tiny: transformers' Qwen3_5MoeForCausalLM + the MTP module, next-token + MTP loss.

    python tools/train/train.py --data WORK/data --model-dir models/nextn-live-tiny --out WORK/ckpt

Loss per step: main CE (position p predicts token p+1)
             + MTP_WEIGHT * MTP CE (MTP row p = (token p+1, main post-final-norm hidden h_p, RoPE p)
                                    predicts token p+2; reference §3)
             + router_aux_loss_coef * (load balancing of the main MoE layers + MTP_WEIGHT * of the MTP layer).
The MTP input hidden is NOT detached (DeepSeek-V3 style joint training: the MTP gradient also flows
into the main model); `--detach-hidden` switches that off.

Rows: one agent request each (the exact prompt `nextn harness render` printed + the scripted completion +
<|im_end|>; the loss covers the trained completions only), batched by length and padded. Rows are
shuffled with the seed; CPU, float32, fixed thread count, torch.use_deterministic_algorithms(True):
the same seed and thread count give bit-identical weights on the same machine.

Writes --out/ckpt.pt (float32 state dicts of the model and the MTP) and --out/history.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fastpath  # noqa: E402
import model as M  # noqa: E402


def request_spans(offsets):
    """(start, end) of every request, from the n + 1 row boundaries of the .npz files."""
    return np.stack([offsets[:-1], offsets[1:]], 1)


def example_batches(ids, spans, loss_mask, batch, pad_id, rng):
    """One agent request per row (prompt + completion; the loss mask covers the trained completions), rows
    of similar length batched together and padded to the batch's longest, batches in a seeded order.
    No packing: every row starts at position 0 with fresh Gated DeltaNet state, as the agent's prompts do.
    `spans`: [n, 2] (start, end) of each row in `ids`."""
    n = len(spans)
    lens = spans[:, 1] - spans[:, 0]
    order = np.argsort(lens + rng.random(n) * 0.5, kind="stable")  # near-equal lengths side by side
    out = []
    for b in range(0, n, batch):
        sel = order[b : b + batch]
        T = int(lens[sel].max())
        x = np.full((len(sel), T), pad_id, dtype=np.int64)
        m = np.zeros((len(sel), T), dtype=np.float32)
        for r, i in enumerate(sel):
            a, e = spans[i]
            x[r, : e - a] = ids[a:e]
            m[r, : e - a] = loss_mask[a:e]
        out.append((torch.from_numpy(x), torch.from_numpy(m)))
    return [out[i] for i in rng.permutation(len(out))]


def conversation_batches(ids, spans, weight, batch, pad_id, rng, key_weight=None):
    """Rows of the given requests from their conversation part on (the system turn dropped: a row starts where
    its loss weights begin); with `key_weight`, the key tokens (weight > 1.5, tokenizer.py --key-weight) get it."""
    spans = spans.copy()
    spans[:, 0] += [int(np.argmax(weight[a:e] > 0)) for a, e in spans]
    if key_weight is not None:
        weight = np.where(weight > 1.5, np.float32(key_weight), weight)
    return example_batches(ids, spans, weight, batch, pad_id, rng)


def tail_batches(ids, offsets, weight, batch, pad_id, rng):
    """The same requests without their system turn (rows start at the conversation part, where the loss
    weights begin): short rows, about a tenth of the tokens, with the same completions. Trained beside the
    full prompts, they give the tiny model many cheap examples of answering *this* comment (which tool, which
    product, which language) instead of the format alone; the full rows teach it to do so after the
    ~900-token harness prompt it sees at run time."""
    return conversation_batches(ids, request_spans(offsets), weight, batch, pad_id, rng)


def drill_batches(ids, offsets, weight, batch, pad_id, rng, response_id, call_id, key_weight, rows="first-calls"):
    """Dense copy rows without the system turn, key tokens weighted `key_weight`. rows="first-calls": the first
    model request of every case whose completion copies a value (tool-call arguments, marked by tokenizer.py
    --key-weight). A few copied values among ~200 weighted tokens a row is too thin a signal for the tiny model to
    learn copying from; these rows are almost nothing else. Measured (README, 2026-12-03): one batch of 32 such rows
    (check_stock requests only) beside each 16 whole rows made sizes copied behind the 1119-token harness prompt
    within 250 steps; the same rows trained alone first, then whole rows alone, were forgotten within 120 steps.
    rows="decisions": every request where the model decides whether and which tool to call: each case's first
    request (a call or a direct answer) and every later request that calls a tool (none in the agent corpus, whose
    multi-intent cases write both calls in one completion). With first calls only, the drills held no greeting or
    complaint, and the replay's no-tool comments called a tool (17 of 31; 10 of 31 with these rows)."""
    spans = request_spans(offsets)
    if not (weight > 1.5).any():
        raise SystemExit("train: --drill-batch needs key tokens marked in the data (tokenizer.py --key-weight > 1)")
    if rows == "first-calls":
        keep = [i for i, (a, e) in enumerate(spans) if (weight[a:e] > 1.5).any() and response_id not in ids[a:e]]
    else:
        keep = [i for i, (a, e) in enumerate(spans)
                if (c := completion(ids, weight, a, e)) is not None and (response_id not in ids[a:e] or call_id in c)]
    return conversation_batches(ids, spans[keep], weight, batch, pad_id, rng, key_weight)


def completion(ids, weight, a, e):
    """Request [a, e)'s trained completion (from its first token weighted > 0.5; the conversation part is 0.3),
    None when nothing in it is trained."""
    trained = np.nonzero(weight[a:e] > 0.5)[0]
    return ids[a + trained[0] : e] if len(trained) else None


def reply_drill_batches(ids, offsets, weight, batch, pad_id, rng, call_id, key_weight):
    """Dense reply rows: every trained request whose completion is a spoken reply (no tool call), without the
    system turn, the words and figures it reads from the comment and the tool results weighted `key_weight`.
    The call drills above taught the 800-step model to write the comment's values into tool calls (TC 0.35 ->
    0.60 in the replay) but its replies still ignored the tool results (after-sales answers all one sentence,
    stock replies with figures the result did not give); these rows are the same signal for the reply, and the
    greetings among them (no tool, answered from the comment alone) balance the call drills' <tool_call>."""
    spans = request_spans(offsets)
    keep = [i for i, (a, e) in enumerate(spans) if (c := completion(ids, weight, a, e)) is not None and call_id not in c]
    return conversation_batches(ids, spans[keep], weight, batch, pad_id, rng, key_weight)


def shared_prefix(ids, offsets, weight):
    """The longest prefix every training row starts with (the harness prompt up to where rows diverge),
    cut so that no loss weight falls on it or on the token after it. Returns its length."""
    spans = request_spans(offsets)
    first = ids[spans[0, 0] : spans[0, 1]]
    P = len(first)
    for a, e in spans:
        n = min(P, e - a)
        diff = np.nonzero(ids[a : a + n] != first[:n])[0]
        P = int(diff[0]) if len(diff) else n
        w = np.nonzero(weight[a:e] > 0)[0]
        if len(w):
            P = min(P, int(w[0]) - 1)
    return max(P, 0)


class Cycle:
    """Batches in turn, reshuffled with `rng` at the start of every new pass."""

    def __init__(self, batches, rng):
        self.batches, self.rng, self.i = batches, rng, 0

    def next(self):
        if self.i == len(self.batches):
            self.batches, self.i = [self.batches[k] for k in self.rng.permutation(len(self.batches))], 0
        self.i += 1
        return self.batches[self.i - 1]


def lr_at(step, steps, peak, warmup, floor):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def prefix_self_test(model, mtp, cap, prefix, ids, spans, weight, pad_id):
    """Main and MTP losses of two rows, shared-prefix forward vs the whole rows: must agree."""
    (x, m), = example_batches(ids, spans[:2], weight, 2, pad_id, np.random.Generator(np.random.PCG64(0)))
    P = prefix.shape[0]
    whole = torch.cat([prefix.expand(2, P), x], 1)
    wmask = torch.cat([torch.zeros(2, P), m], 1)
    with torch.no_grad():
        r1 = M.losses(model, mtp, cap, whole, wmask, 1.0, False)
        r2 = M.shared_prefix_losses(model, mtp, cap, prefix, x, m, 1.0, False)
    diff = max(abs(r1["main"].item() - r2["main"].item()), abs(r1["mtp"].item() - r2["mtp"].item()))
    if diff > 1e-3:
        raise SystemExit(f"train: shared-prefix losses differ from whole-row losses by {diff}")
    return diff


def evaluate(model, mtp, cap, batches):
    """Held-out losses (mean over trained completion tokens) with the training forward."""
    tot = {"main": 0.0, "mtp": 0.0}
    n = {"main": 0.0, "mtp": 0.0}
    for x, m in batches:
        r = M.losses(model, mtp, cap, x, m, 1.0, True)
        w1, w2 = m[:, 1:].sum().item(), m[:, 2:].sum().item()
        tot["main"] += r["main"].item() * w1
        tot["mtp"] += r["mtp"].item() * w2
        n["main"] += w1
        n["mtp"] += w2
    return {k: tot[k] / n[k] for k in tot}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True, help="where tokenizer_config.json was written")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--detach-hidden", action="store_true")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="1: run the prompt prefix all rows share once per step (model.shared_prefix_losses); 0: every row whole")
    ap.add_argument("--tail-batch", type=int, default=8,
                    help="rows of system-turn-less requests trained beside each full batch (0: none; see tail_batches)")
    ap.add_argument("--drill-batch", type=int, default=0,
                    help="rows of dense copy drills (drill_batches) trained beside each full batch (0: none)")
    ap.add_argument("--drill-rows", choices=["first-calls", "decisions"], default="first-calls",
                    help="which requests the --drill-batch rows are: first-calls (first requests that call a tool) or "
                         "decisions (every first request, calling or not, and every later request that calls a tool)")
    ap.add_argument("--reply-drill-batch", type=int, default=0,
                    help="rows of dense reply drills (reply_drill_batches) trained beside each full batch (0: none)")
    ap.add_argument("--drill-key-weight", type=float, default=10.0, help="loss weight of the drills' copied tokens")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                    help="attention implementation while training: eager or sdpa (torch's "
                         "fused CPU attention: 1.5-2.4x faster steps on rows attending to the ~1.1K-token harness prefix; "
                         "export.py checks every number with eager either way; train.sh uses sdpa)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=500, help="also write ckpt.pt every N steps (to look at a long run)")
    ap.add_argument("--eval-rows", type=int, default=24)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TRAIN_THREADS", "2")))
    ap.add_argument("--ema", type=str, default="",
                    help="comma-separated decays, e.g. 0.99: also keep exponential moving averages of the weights and "
                         "write each to OUT/ema<decay>/ckpt.pt (+ history.json) beside the final weights; step s uses "
                         "min(decay, (1+s)/(10+s)), so decays above 0.99 differ only after ~1000 steps")
    ap.add_argument("--arch", type=json.loads, default={},
                    help='JSON overrides of model.TEXT_CONFIG, e.g. \'{"hidden_size": 192}\' (kept in ckpt.pt for export.py)')
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    M.env_setup(a.threads)
    err = fastpath.self_test()
    fastpath.install()
    print(f"train: threads {a.threads}, fast GDN/conv path installed (max diff vs transformers {err:.1e})", flush=True)

    stats = json.loads((a.data / "tokenizer_stats.json").read_text())
    added = stats["added_tokens"]
    vocab = int(math.ceil(stats["vocab_size"] / 64) * 64)  # padded embedding rows, like Qwen
    pad_id, eos_id = added["<|endoftext|>"], added["<|im_end|>"]
    model, mtp = M.build(vocab, eos_id, pad_id, a.seed, a.arch, a.attn)
    model.train()
    mtp.train()
    cap = M.RouterCapture(mtp)
    counts = M.count_params(model, mtp)
    print(f"train: params {counts}", flush=True)

    rng = np.random.Generator(np.random.PCG64(a.seed))
    tr = np.load(a.data / "train.npz")
    te = np.load(a.data / "test.npz")
    # Loss weights (trained completions 1, the prompt's conversation part less; see tokenizer.py); the
    # held-out loss is on the completions alone.
    weight = tr["loss_weight"] if "loss_weight" in tr.files else tr["reply_mask"]
    spans = request_spans(tr["offsets"])
    P = shared_prefix(tr["ids"], tr["offsets"], weight) if a.shared_prefix else 0
    prefix = None
    if P >= 2:
        prefix = torch.from_numpy(tr["ids"][spans[0, 0] : spans[0, 0] + P].astype(np.int64))
        spans = spans + np.array([P, 0])
        check = prefix_self_test(model, mtp, cap, prefix, tr["ids"], spans, weight, pad_id)
        print(f"train: shared prefix of {P} tokens run once per step (losses vs whole rows: max diff {check:.1e})", flush=True)
    batches = example_batches(tr["ids"], spans, weight, a.batch, pad_id, rng)
    n_rows = len(tr["offsets"]) - 1
    # Extra batches trained beside each full one: system-turn-less requests, dense copy drills.
    sides = []
    if a.tail_batch:
        sides.append(Cycle(tail_batches(tr["ids"], tr["offsets"], weight, a.tail_batch, pad_id, rng), rng))
    if a.drill_batch:
        drills = drill_batches(tr["ids"], tr["offsets"], weight, a.drill_batch, pad_id, rng, added["<tool_response>"],
                               added["<tool_call>"], a.drill_key_weight, a.drill_rows)
        print(f"train: {sum(x.shape[0] for x, _ in drills)} drill rows, {a.drill_batch} beside each batch", flush=True)
        sides.append(Cycle(drills, rng))
    if a.reply_drill_batch:
        replies = reply_drill_batches(tr["ids"], tr["offsets"], weight, a.reply_drill_batch, pad_id, rng,
                                      added["<tool_call>"], a.drill_key_weight)
        print(f"train: {sum(x.shape[0] for x, _ in replies)} reply drill rows, {a.reply_drill_batch} beside each batch",
              flush=True)
        sides.append(Cycle(replies, rng))
    ebatches = example_batches(te["ids"], request_spans(te["offsets"]), te["reply_mask"], a.batch, pad_id,
                               np.random.Generator(np.random.PCG64(a.seed + 1)))[: max(1, a.eval_rows // a.batch)]
    print(f"train: {n_rows} examples (one agent request each, mean {np.diff(tr['offsets']).mean():.0f} tokens, "
          f"{tr['reply_mask'].mean():.1%} completion tokens); {a.steps} steps x {a.batch} rows = {a.steps * a.batch / n_rows:.2f} epochs",
          flush=True)

    params = list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    all_params = [p for _, p in params]
    # Weight averages: the training itself is unchanged (same trajectory), so each average is compared with the
    # final weights of the same run, without a second seed's noise.
    ema_decays = [float(d) for d in a.ema.split(",") if d.strip()]
    emas = {d: [p.detach().clone() for p in all_params] for d in ema_decays}

    hist = {"step": [], "main": [], "mtp": [], "aux": [], "lr": [], "tokens": [], "eval": []}
    cursor, tokens, seen = 0, 0, 0

    def make_summary(done):
        wall = time.time() - t0
        return {
            "steps": done, "batch_rows": a.batch, "tokens": seen, "trained_tokens": tokens, "wall_s": wall,
            "tokens_per_s": seen / wall, "threads": a.threads, "seed": a.seed, "lr": a.lr, "warmup": a.warmup,
            "weight_decay": a.weight_decay, "tail_batch": a.tail_batch, "drill_batch": a.drill_batch, "drill_rows": a.drill_rows, "reply_drill_batch": a.reply_drill_batch, "drill_key_weight": a.drill_key_weight, "shared_prefix_tokens": P, "mtp_weight": a.mtp_weight, "detach_hidden": a.detach_hidden,
            "router_aux_loss_coef": model.config.router_aux_loss_coef, "examples": int(n_rows),
            "epochs": done * a.batch / n_rows, "params": counts, "vocab_size": vocab,
            "fast_path_max_diff": err, "attn": a.attn,
        }

    t0 = time.time()
    for step in range(a.steps):
        if cursor == len(batches):
            batches, cursor = [batches[i] for i in rng.permutation(len(batches))], 0
        x, m = batches[cursor]
        cursor += 1
        seen += x.numel()
        lr = lr_at(step, a.steps, a.lr, a.warmup, a.lr * 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        if prefix is None:
            r = M.losses(model, mtp, cap, x, m, a.mtp_weight, a.detach_hidden)
        else:
            r = M.shared_prefix_losses(model, mtp, cap, prefix, x, m, a.mtp_weight, a.detach_hidden)
        opt.zero_grad(set_to_none=True)
        r["total"].backward()
        for side in sides:
            sx, sm = side.next()
            seen += sx.numel()
            M.losses(model, mtp, cap, sx, sm, a.mtp_weight, a.detach_hidden)["total"].backward()
        torch.nn.utils.clip_grad_norm_(all_params, 1.0)
        opt.step()
        with torch.no_grad():
            for d, avg in emas.items():
                dd = min(d, (1 + step) / (10 + step))  # short warm-up: early averages are not dominated by init
                for e, p in zip(avg, all_params):
                    e.mul_(dd).add_(p.detach(), alpha=1 - dd)
        tokens += int(m.sum().item())
        hist["step"].append(step + 1)
        hist["main"].append(r["main"].item())
        hist["mtp"].append(r["mtp"].item())
        hist["aux"].append(r["aux"].item())
        hist["lr"].append(lr)
        hist["tokens"].append(tokens)
        if (step + 1) % 10 == 0 or step == 0:
            el = time.time() - t0
            print(f"step {step + 1:5d}/{a.steps} main {r['main'].item():.4f} mtp {r['mtp'].item():.4f} "
                  f"aux {r['aux'].item():.3f} lr {lr:.2e} | {seen / el:.0f} tok/s, {el:.0f}s", flush=True)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            model.eval()
            mtp.eval()
            ev = evaluate(model, mtp, cap, ebatches)
            model.train()
            mtp.train()
            hist["eval"].append({"step": step + 1, **ev})
            print(f"  eval @ {step + 1}: held-out main {ev['main']:.4f} mtp {ev['mtp']:.4f}", flush=True)
        if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            torch.save({"model": model.state_dict(), "mtp": mtp.state_dict(), "vocab_size": vocab,
                        "eos_id": eos_id, "pad_id": pad_id, "seed": a.seed, "arch": a.arch}, a.out / "ckpt.pt")
            (a.out / "history.json").write_text(json.dumps({**hist, "summary": make_summary(step + 1)}) + "\n")
    hist["summary"] = make_summary(a.steps)
    torch.save({"model": model.state_dict(), "mtp": mtp.state_dict(), "vocab_size": vocab,
                "eos_id": eos_id, "pad_id": pad_id, "seed": a.seed, "arch": a.arch}, a.out / "ckpt.pt")
    (a.out / "history.json").write_text(json.dumps(hist) + "\n")
    for d, avg in emas.items():
        live = [p.detach().clone() for p in all_params]
        with torch.no_grad():
            for p, e in zip(all_params, avg):
                p.copy_(e)
            model.eval()
            mtp.eval()
            ev = evaluate(model, mtp, cap, ebatches)
        out = a.out / f"ema{d}"
        out.mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "mtp": mtp.state_dict(), "vocab_size": vocab, "eos_id": eos_id,
                    "pad_id": pad_id, "seed": a.seed, "arch": a.arch, "ema": d}, out / "ckpt.pt")
        (out / "history.json").write_text(json.dumps({**hist, "eval": hist["eval"] + [{"step": a.steps, **ev}],
                                                       "summary": {**hist["summary"], "ema": d}}) + "\n")
        print(f"train: EMA {d}: held-out main {ev['main']:.4f} mtp {ev['mtp']:.4f} -> {out / 'ckpt.pt'}", flush=True)
        with torch.no_grad():
            for p, v in zip(all_params, live):
                p.copy_(v)
    print(f"train: done, {a.steps} steps, {seen} tokens in {hist['summary']['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
