#!/usr/bin/env python3
"""Make a random bf16 `qwen3_moe` checkpoint for the nextn vs llama.cpp CPU comparison.

    python bench/compare/make_qwen3moe.py --out DIR [--seed 0] [--layers 16 --hidden 1024 ...]

HF transformers builds `Qwen3MoeForCausalLM` from a `Qwen3MoeConfig` on the CPU, directly in bfloat16, with
its own initialisation (normal, std = initializer_range) after `torch.manual_seed(seed)`, and `save_pretrained`
writes it in the HF layout: `config.json`, one `model.safetensors` (per-expert
`mlp.experts.E.{gate,up,down}_proj.weight`, as Qwen3-30B-A3B ships), `generation_config.json`. The tokenizer
files come from tests/fixtures/tokenizer/ (a 609-id byte-level BPE with Qwen's special tokens); `vocab_size`
must cover it and may be larger (the extra ids are unused rows, as in Qwen's padded vocabularies).

The default shape is the one issue 15 measured: 16 layers, hidden 1024, 32 experts, top-4, GQA 16/4 heads of
128, experts 704 wide, vocabulary 1024 -> about 0.45 GB of weights read per decoded token (printed). The weights
are random, so the routing is close to uniform over experts; nothing here is meant to produce sensible text.

Prints one JSON object: the directory, the shape, total parameters, the bytes a decode step reads (attention,
router, top-k experts and norms of every layer, one embedding row, final norm, LM head) and the file size.
Use the pinned torch/transformers of tools/fixtures/requirements.txt (tools/train/.venv has them).
"""

import os

# Before torch is imported: CPU only, no hub access.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "tests" / "fixtures" / "tokenizer"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
BF16_BYTES = 2


def fail(msg: str) -> None:
    print(f"make_qwen3moe.py: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory (created; existing model files replaced)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the weights are drawn (default 0)")
    p.add_argument("--layers", type=int, default=16, help="num_hidden_layers (default 16)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden_size (default 1024)")
    p.add_argument("--experts", type=int, default=32, help="num_experts (default 32)")
    p.add_argument("--top-k", type=int, default=4, help="num_experts_per_tok (default 4)")
    p.add_argument("--moe-intermediate", type=int, default=704, help="moe_intermediate_size (default 704)")
    p.add_argument("--heads", type=int, default=16, help="num_attention_heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="num_key_value_heads (default 4)")
    p.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128)")
    p.add_argument("--vocab", type=int, default=1024, help="vocab_size, >= the tokenizer's 609 ids (default 1024)")
    p.add_argument("--tokenizer-dir", type=Path, default=TOKENIZER_DIR, help="tokenizer files to copy")
    return p.parse_args()


def tokenizer_size(d: Path) -> int:
    """Ids the tokenizer can produce: its BPE vocabulary plus added tokens (highest id + 1)."""
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        if not (d / name).is_file():
            fail(f"{d / name} is missing (the tokenizer files are copied from --tokenizer-dir)")
    tok = json.loads((d / "tokenizer.json").read_text())
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def active_params(cfg: Qwen3MoeConfig) -> dict:
    """Parameters one decode step reads, per component (qwen3_moe: every layer sparse, untied head)."""
    h, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attention = h * q + 2 * h * kv + q * h + 2 * hd  # q/k/v/o + q/k norms
    router = cfg.num_experts * h
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size  # gate, up, down of the top-k
    per_layer = attention + router + experts + 2 * h  # + input / post-attention norms
    return {
        "layers": cfg.num_hidden_layers * per_layer,
        "of_which_attention": cfg.num_hidden_layers * attention,
        "of_which_routed_experts": cfg.num_hidden_layers * experts,
        "embedding_row": h,
        "final_norm": h,
        "lm_head": v * h,
    }


def main() -> None:
    args = parse_args()
    n_tok = tokenizer_size(args.tokenizer_dir)
    if args.vocab < n_tok:
        fail(f"--vocab {args.vocab} does not cover the tokenizer's {n_tok} ids (use >= {n_tok})")
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.heads % args.kv_heads != 0:
        fail(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")

    tok_cfg = json.loads((args.tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((args.tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    eos = ids.get(tok_cfg.get("eos_token"), None)
    pad = ids.get(tok_cfg.get("pad_token"), None)

    # 1. Config: Qwen3-30B-A3B's conventions (every layer sparse, renormalised top-k, untied head, rope 1e6).
    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=3 * args.hidden,  # dense MLP width; unused (no mlp_only_layers)
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )

    # 2. Weights: transformers' own initialisation, drawn in bf16 on the CPU after the seed.
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        fail(f"expected every parameter in bfloat16, found {sorted(str(d) for d in dtypes)}")

    # 3. Write: HF layout, one safetensors file, then the tokenizer files.
    args.out.mkdir(parents=True, exist_ok=True)
    for old in list(args.out.glob("*.safetensors")) + list(args.out.glob("*.safetensors.index.json")):
        old.unlink()
    model.save_pretrained(args.out, max_shard_size="1000GB")
    for name in TOKENIZER_FILES:
        src = args.tokenizer_dir / name
        if src.is_file():
            shutil.copyfile(src, args.out / name)
    if not (args.out / "model.safetensors").is_file():
        fail(f"save_pretrained wrote no {args.out / 'model.safetensors'}")

    active = active_params(cfg)
    active_total = sum(v for k, v in active.items() if not k.startswith("of_which"))
    print(json.dumps({
        "out": str(args.out),
        "seed": args.seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "shape": {
            "layers": args.layers, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
            "moe_intermediate": args.moe_intermediate, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "vocab": args.vocab, "tokenizer_ids": n_tok,
        },
        "params_total": n_params,
        "active_params_per_token": active_total,
        "active_bytes_per_token": active_total * BF16_BYTES,
        "active_gb_per_token": round(active_total * BF16_BYTES / 1e9, 3),
        "active_params_by_part": active,
        "safetensors_bytes": (args.out / "model.safetensors").stat().st_size,
    }))


if __name__ == "__main__":
    main()
