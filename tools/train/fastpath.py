"""Training-only replacements for two pure-torch fallbacks of transformers' Qwen3.5-MoE Gated DeltaNet.

transformers (without flash-linear-attention / causal-conv1d) runs the chunked gated delta rule with
`torch.linalg.solve_triangular` (about 1 s per call on this CPU for a batch of 64x64 systems) and the
causal depthwise conv with `F.conv1d(groups=channels)`, whose CPU backward is very slow. `install()`
swaps in mathematically identical versions for TRAINING only:

  * chunk rule: the same algebra as `torch_chunk_gated_delta_rule` (chunks of 32 instead of 64: the
    result does not depend on the chunk size); the unit lower-triangular system (I + L) X = B is solved
    with the exact product form (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)(I + L^16)
    (L strictly lower 32x32, so L^32 = 0);
    the per-chunk outputs are concatenated instead of written in place.
  * causal conv: out[t] = sum_j w[j] * x[t - K + 1 + j] as K shifted multiply-adds.

`uninstall()` restores transformers' own functions; export.py never installs the fast path, so every
reference number in the exported files comes from stock transformers. train.py checks once, at start-up,
that both replacements match the stock functions (forward and gradients) on random inputs.
"""

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mq

_ORIG = {"torch_chunk_gated_delta_rule": mq.torch_chunk_gated_delta_rule, "causal_conv1d_fn": mq.causal_conv1d_fn}


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], C a power of two."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype)
    M = -L
    inv = eye + M
    p = M
    n = 2
    while n < C:
        p = p @ p
        inv = inv @ (eye + p)
        n *= 2
    return inv


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=32, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    initial_dtype = query.dtype
    B, T, Hk, Dk = key.shape
    Hv, Dv = value.shape[2], value.shape[3]
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32) for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    C = chunk_size
    pad = (C - T % C) % C
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    N = (T + pad) // C
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(B, Hv, N, C, x.shape[-1]) for x in (query, key, k_beta, v_beta)]
    g = g.reshape(B, Hv, N, C)
    upper = torch.ones(C, C, dtype=torch.bool).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    inv = unit_lower_inverse(ut.tril(-1))
    new_values = inv @ v_beta
    k_cumdecay = inv @ decayed_k_beta
    state = torch.zeros(B, Hv, Dk, Dv, dtype=torch.float32) if initial_state is None else initial_state.float()
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(N):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=2)[:, :, :T]
    out = out.transpose(1, 2).contiguous().to(initial_dtype)
    return out, (state if output_final_state else None)


def causal_conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
    """hidden_states [B, C, T], weight [C, K]."""
    K = weight.shape[-1]
    T = hidden_states.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (K - 1, 0))
    out = sum(x[:, :, j : j + T] * weight[:, j, None] for j in range(K))
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out) if activation in ("silu", "swish") else mq.ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def install():
    mq.torch_chunk_gated_delta_rule = chunk_gated_delta_rule
    mq.causal_conv1d_fn = causal_conv1d


def uninstall():
    for k, v in _ORIG.items():
        setattr(mq, k, v)


def self_test(seed=0):
    """Fast path == transformers' fallback (outputs and input gradients) on random inputs."""
    g = torch.Generator().manual_seed(seed)
    B, T, Hk, Hv, D = 2, 150, 2, 4, 32

    def inputs():
        q = torch.randn(B, T, Hk, D, generator=g)
        k = torch.randn(B, T, Hk, D, generator=g)
        v = torch.randn(B, T, Hv, D, generator=g)
        gg = -torch.rand(B, T, Hv, generator=g) * 2
        b = torch.rand(B, T, Hv, generator=g)
        return [x.requires_grad_(True) for x in (q, k, v, gg, b)]

    xs = inputs()
    ys = [x.detach().clone().requires_grad_(True) for x in xs]
    o1, _ = _ORIG["torch_chunk_gated_delta_rule"](*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
    o2, _ = chunk_gated_delta_rule(*ys[:3], g=ys[3], beta=ys[4], use_qk_l2norm_in_kernel=True)
    w = torch.randn(o1.shape, generator=g)
    (o1 * w).sum().backward()
    (o2 * w).sum().backward()
    err = [(o1 - o2).abs().max().item()] + [(a.grad - b.grad).abs().max().item() for a, b in zip(xs, ys)]
    x = torch.randn(B, 96, T, generator=g, requires_grad=True)
    wt = torch.randn(96, 4, generator=g, requires_grad=True)
    c1 = _ORIG["causal_conv1d_fn"](x, wt, None, activation="silu")
    x2, w2 = x.detach().clone().requires_grad_(True), wt.detach().clone().requires_grad_(True)
    c2 = causal_conv1d(x2, w2, None, activation="silu")
    (c1 * c1).sum().backward()
    (c2 * c2).sum().backward()
    err += [(c1 - c2).abs().max().item(), (x.grad - x2.grad).abs().max().item(), (wt.grad - w2.grad).abs().max().item()]
    if max(err) > 1e-3:
        raise AssertionError(f"fast path differs from transformers' fallback: {err}")
    return max(err)
