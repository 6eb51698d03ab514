#!/usr/bin/env python3
"""Train the MTP draft head on its own chained draft steps, the main model frozen (train.sh's stage after train.py).

    python tools/train/mtp_chain.py --data WORK/data --ckpt WORK/ckpt --out WORK/ckpt-chain

train.py trains the MTP on one step: (token p+1, main hidden h_p) predicts token p+2. Serving drafts three
tokens by feeding the MTP its own output hidden back in (engine/src/spec/speculator.rs), an input it never saw
in training: the bundled model's replay accepted the first draft 99% of the time, the second 42%, the third
23% (mean acceptance length 2.64 of 4). This stage trains all `--draft-steps` steps on exactly their serving
inputs and attention (model.mtp_chain_losses), with the main model's own next-token distribution as the target,
and updates only the MTP's weights: the main model, and so every token the agent emits at temperature 0, is
unchanged (export.py's checks and the replay's TC / RC show it).

Before training, the batched chain is checked against the serving order of operations (mtp_reference: the
draft extend over the committed rows through the MTP KV cache, then single-row chained steps): the same
logits for every step of a sampled chain. Writes --out/ckpt.pt (the main weights copied bit for bit) and
--out/history.json (train.py's history plus "mtp_chain": per-step losses and argmax agreement).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fastpath  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402


@torch.no_grad()
def serving_order_check(model, mtp, cap, prefix, x, w, steps):
    """Max |logit difference| between mtp_chain_losses and the serving order of operations, over every step of
    the chains of a few committed positions of row 0 of (x, w)."""
    r = M.mtp_chain_losses(model, mtp, cap, prefix, x[:1], w[:1], steps)
    full = torch.cat([prefix, x[0]]).tolist()
    P = len(prefix)
    worst = 0.0
    chains = sorted(set(r["draft_logits"][-1][1].tolist()))
    for j in chains[:: max(1, len(chains) // 3)][:4]:
        n = P + j  # committed tokens full[:n]; full[n] was just sampled (chain index j = row part j)
        h, _ = M.mtp_reference.main_hidden(model, full[:n])
        cache = mtp.new_cache()
        hm, logits = mtp(full[1 : n + 1], h, list(range(n)), cache=cache)
        prev_hm, prev = hm[-1], logits[-1]
        for k in range(steps):
            b, jj, lg = r["draft_logits"][k]
            at = ((b == 0) & (jj == j)).nonzero()
            if len(at):
                d = (lg[int(at[0])] - prev).abs().max().item()
                worst = d if d != d else max(worst, d)  # NaN stays NaN (and fails the check)
                if d != d:
                    return d
            if k + 1 < steps:
                hm, logits = mtp([full[n + k + 1]], prev_hm.view(1, -1), [n + k], cache=cache)
                prev_hm, prev = hm[0], logits[0]
    cap.pop()
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--ckpt", type=Path, required=True, help="train.py's output folder (ckpt.pt, history.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--draft-steps", type=int, default=3, help="chained steps trained (serving's --draft-steps)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TRAIN_THREADS", "2")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    M.env_setup(a.threads)
    fastpath.install()
    ck = torch.load(a.ckpt / "ckpt.pt", weights_only=True)
    hist = json.loads((a.ckpt / "history.json").read_text())
    stats = json.loads((a.data / "tokenizer_stats.json").read_text())
    added = stats["added_tokens"]
    pad_id, eos_id = added["<|endoftext|>"], added["<|im_end|>"]
    model, mtp = M.build(ck["vocab_size"], eos_id, pad_id, a.seed, ck.get("arch"), "sdpa")
    model.load_state_dict(ck["model"], strict=True)
    mtp.load_state_dict(ck["mtp"], strict=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mtp.train()
    cap = M.RouterCapture(mtp)

    rng = np.random.Generator(np.random.PCG64(a.seed))
    tr = np.load(a.data / "train.npz")
    weight = tr["loss_weight"] if "loss_weight" in tr.files else tr["reply_mask"]
    completion = (weight > 0.5).astype(np.float32)  # drafts run over what the model writes, not the prompt
    spans = T.request_spans(tr["offsets"])
    P = T.shared_prefix(tr["ids"], tr["offsets"], weight)
    if P < 2:
        raise SystemExit("mtp_chain: the training rows share no prompt prefix (need the harness' system prompt)")
    prefix = torch.from_numpy(tr["ids"][spans[0, 0] : spans[0, 0] + P].astype(np.int64))
    spans = spans + np.array([P, 0])
    batches = T.example_batches(tr["ids"], spans, completion, a.batch, pad_id, rng)
    batches = [batches[i] for i in rng.permutation(len(batches))]

    x, w = min(batches, key=lambda b: b[0].shape[1])
    err = serving_order_check(model, mtp, cap, prefix, x, w, a.draft_steps)
    print(f"mtp_chain: batched chain vs serving order (draft extend + chained single rows): max logit diff {err:.1e}",
          flush=True)
    if not err <= 1e-3:
        raise SystemExit(f"mtp_chain: batched chain differs from the serving order by {err} (> 1e-3)")

    params = [p for p in mtp.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    log = {"step": [], "ce": [], "agree": []}
    t0 = time.time()
    for step in range(a.steps):
        x, w = batches[step % len(batches)]
        lr = T.lr_at(step, a.steps, a.lr, a.warmup, a.lr * 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        r = M.mtp_chain_losses(model, mtp, cap, prefix, x, w, a.draft_steps)
        opt.zero_grad(set_to_none=True)
        r["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ce = [round(c.item(), 4) for c in r["steps"]]
        agree = [round(m / max(1, n), 3) for m, n in r["agree"]]
        log["step"].append(step + 1)
        log["ce"].append(ce)
        log["agree"].append(agree)
        if (step + 1) % 10 == 0 or step == 0:
            print(f"step {step + 1:4d}/{a.steps} soft CE per draft step {ce} argmax agreement {agree} "
                  f"lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)

    tail = max(1, a.steps // 5)
    summary = {"steps": a.steps, "batch_rows": a.batch, "draft_steps": a.draft_steps, "lr": a.lr,
               "wall_s": time.time() - t0, "serving_order_max_diff": err,
               "first_agreement": log["agree"][0],
               "last_agreement_mean": [round(float(np.mean([g[k] for g in log["agree"][-tail:]])), 3)
                                       for k in range(a.draft_steps)]}
    hist["mtp_chain"] = {"summary": summary, **log}
    torch.save({**ck, "mtp": mtp.state_dict()}, a.out / "ckpt.pt")
    (a.out / "history.json").write_text(json.dumps(hist))
    print(f"mtp_chain: done, {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
