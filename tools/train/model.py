"""Model definition shared by train.py and export.py: transformers' Qwen3.5-MoE text model plus the MTP
module of tools/fixtures/mtp_reference.py (reference §3), with a batched, differentiable MTP forward
for training.
"""

import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "fixtures"))
import mtp_reference  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func  # noqa: E402

# Architecture of nextn-live-tiny (vocab_size is filled in from the tokenizer).
TEXT_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    rope_parameters={
        "rope_type": "default",
        # 1e4, not Qwen3.6's 1e7: with 16 rotary dims, theta 1e7 leaves the one attention layer almost no
        # positional resolution over a ~1K-token agent prompt.
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    attn_output_gate=True,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # RoPE has no learned positions; 8192 lets the agent harness prompt fit (training rows are far shorter:
    # positions past them are untrained, see the model card).
    max_position_embeddings=8192,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    initializer_range=0.02,
    router_aux_loss_coef=0.01,
)


def env_setup(threads):
    """Determinism knobs; call before any torch work."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def build(vocab_size, eos_id, pad_id, seed, overrides=None, attn="eager"):
    """The model and its MTP module, seeded. `attn`: transformers' attention implementation ("eager": the
    reference path export.py checks every number with; "sdpa": torch's fused CPU attention, for training)."""
    cfg = dict(TEXT_CONFIG)
    cfg.update(overrides or {})
    cfg.update(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**cfg)
    model = Qwen3_5MoeForCausalLM._from_config(
        config, attn_implementation=attn, experts_implementation="eager", dtype=torch.float32
    )
    mtp = TrainableMTP(model)
    # The MTP module is a plain nn.Module (its experts are torch.empty): initialise it with the
    # model's own rules, from the same seeded stream.
    with torch.no_grad():
        for m in mtp.modules():
            model._init_weights(m)
        init_gdn_decay(model)
    return model, mtp


def init_gdn_decay(model, dt_min=1e-3, dt_max=1e-1):
    """Gated DeltaNet decay init as flash-linear-attention / Mamba do it: softplus(dt_bias) log-uniform in
    [dt_min, dt_max], A in [1, 16]. transformers' init (dt_bias = 1, so softplus = 1.31) makes every head
    forget within a few tokens (decay exp(-1.31 A) <= 0.27 for A >= 1), and a model trained from it never
    carried the viewer's comment across the ~10 template tokens to where the answer starts."""
    for layer in model.model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        n = gdn.dt_bias.shape[0]
        dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        gdn.A_log.copy_(torch.empty(n).uniform_(1.0, 16.0).log())


class TrainableMTP(mtp_reference.Qwen3_5MoeMTP):
    """mtp_reference.Qwen3_5MoeMTP plus a batched forward with gradients (no cache).

    Row p of a sequence: token x[p+1], main post-final-norm hidden h[p], RoPE position p; the rows
    attend causally to each other (the MTP's own attention layer), logits predict x[p+2].
    """

    def train_forward(self, next_tokens, hidden, position_ids, rows=None, cache=None, allowed=None):
        """MTP forward; `rows` (indices into the flattened [B, T] rows) limits the LM head to the rows
        that carry a loss (`rows`: their flat indices) (the rest of the prompt only feeds the attention).
        With `cache` (a differentiable KV cache, see `shared_prefix_losses`) the rows also attend to it.
        `allowed` [B, T, cached + T] (bool) replaces the causal mask: which keys each row attends to."""
        embed, lm_head, rotary = self.__dict__["_shared"]
        e = embed(next_tokens)
        u = torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1)
        z = self.fc(u)
        if allowed is None:
            mask = create_causal_mask(config=self.config, inputs_embeds=z, attention_mask=None, cache=cache,
                                      position_ids=position_ids)
        elif self.config._attn_implementation == "sdpa":
            mask = allowed.unsqueeze(1)  # torch sdpa: True = attend
        else:
            mask = torch.zeros(allowed.shape, dtype=z.dtype).masked_fill(~allowed, torch.finfo(z.dtype).min).unsqueeze(1)
        pe = rotary(z, position_ids)
        z = self.layers[0](z, position_embeddings=pe, attention_mask=mask, position_ids=position_ids, cache=cache)
        hm = self.norm(z)
        if rows is None and cache is not None:
            return hm, None
        if rows is not None:
            return hm, lm_head(hm.reshape(-1, hm.shape[-1]).index_select(0, rows))
        return hm, lm_head(hm)


class RouterCapture:
    """Collects the router logits of the MTP's MoE layer (for its load-balancing loss)."""

    def __init__(self, module):
        self.logits = []
        self.h = [m.register_forward_hook(self._hook) for m in mtp_reference.mtp_routers(module)]

    def _hook(self, mod, inp, out):
        self.logits.append(out[0])

    def pop(self):
        x, self.logits = tuple(self.logits), []
        return x


def losses(model, mtp, cap, ids, loss_mask, mtp_weight, detach_hidden):
    """ids [B, T] (long), loss_mask [B, T] (1 where ids[t] is a real token).

    main: CE(logits[:, p], ids[:, p+1]); mtp: CE(mtp_logits row p, ids[:, p+2]).
    Returns dict of scalar tensors (total is the optimised one).
    """
    cfg = model.config
    out = model.model(input_ids=ids, use_cache=False, output_router_logits=True)
    h = out.last_hidden_state  # post final norm
    # The LM heads run only where a loss is taken (agent prompts are ~98% context without loss).
    m1 = loss_mask[:, 1:].float()
    sel1 = (m1.reshape(-1) > 0).nonzero().squeeze(1)
    logits = model.lm_head(h[:, :-1].reshape(-1, h.shape[-1]).index_select(0, sel1))
    ce = F.cross_entropy(logits, ids[:, 1:].reshape(-1)[sel1], reduction="none")
    main = (ce * m1.reshape(-1)[sel1]).sum() / m1.sum()
    aux = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, None)

    T = ids.shape[1]
    hid = h[:, : T - 2]
    if detach_hidden:
        hid = hid.detach()
    pos = torch.arange(T - 2).unsqueeze(0).expand(ids.shape[0], -1)
    m2 = loss_mask[:, 2:].float()
    sel2 = (m2.reshape(-1) > 0).nonzero().squeeze(1)
    _, mlogits = mtp.train_forward(ids[:, 1 : T - 1], hid, pos, rows=sel2)
    ce2 = F.cross_entropy(mlogits, ids[:, 2:].reshape(-1)[sel2], reduction="none")
    mtp_loss = (ce2 * m2.reshape(-1)[sel2]).sum() / m2.sum()
    maux = load_balancing_loss_func(cap.pop(), cfg.num_experts, cfg.num_experts_per_tok, None)
    total = main + mtp_weight * mtp_loss + cfg.router_aux_loss_coef * (aux + mtp_weight * maux)
    return {"total": total, "main": main, "mtp": mtp_loss, "aux": aux, "mtp_aux": maux,
            "logits": logits, "mtp_logits": mlogits}


def _differentiable_cache(config):
    """A transformers DynamicCache whose linear-attention states are *assigned*, never copied in place, so
    that gradients flow from a continuation back into the forward that filled it (transformers copies new
    GDN states into the old tensors, which autograd forbids once the old ones are saved for backward)."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.activate_past_recording()  # conv states: assigned (and kept whole until cropped)

            def assign(states, state_idx=0, _layer=layer, **_kw):
                _layer.recurrent_states[state_idx] = states
                _layer.is_recurrent_states_initialized[state_idx] = True
                return states

            layer.update_recurrent_state = assign
    return cache


def _expand_cache(cache, batch):
    """Broadcast a batch-1 cache to `batch` rows (views; every row continues from the same prefix)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for i in range(layer.number_of_states):
                if layer.conv_states[i] is not None:
                    c = layer.conv_states[i][..., -layer.conv_kernel_size[i]:]
                    layer.conv_states[i] = c.expand(batch, *c.shape[1:])
                if layer.recurrent_states[i] is not None:
                    r = layer.recurrent_states[i]
                    layer.recurrent_states[i] = r.expand(batch, *r.shape[1:])
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.expand(batch, *layer.keys.shape[1:])
            layer.values = layer.values.expand(batch, *layer.values.shape[1:])


def _prefix_then_rows(model, prefix, ids, router_logits):
    """The main model over `prefix` once (batch 1), then every row of `ids` [B, T] continuing from its cache
    (positions P..P+T-1). Returns the two outputs (prefix, rows)."""
    B, T = ids.shape
    P = prefix.shape[0]
    cache = _differentiable_cache(model.config)
    pre = model.model(input_ids=prefix.view(1, P), cache=cache, use_cache=True, output_router_logits=router_logits,
                      position_ids=torch.arange(P).view(1, P))
    _expand_cache(cache, B)
    out = model.model(input_ids=ids, cache=cache, use_cache=True, output_router_logits=router_logits,
                      position_ids=torch.arange(P, P + T).view(1, T).expand(B, T))
    return pre, out


def _mtp_prefix_then_rows(mtp, prefix, ids, hp, hs, rows):
    """MTP rows of cat(prefix, ids[b]) from the main hiddens hp (prefix) and hs (rows): the prefix's rows
    p = 0..P-2 (token p+1, hidden h_p) once, then per row j = 0..T-2 (token ids[j], hidden h_{P-1+j}, position
    P-1+j; it predicts ids[j+1]). Returns (MTP hiddens [B, T-1, H], logits of the flat `rows`, the MTP cache)."""
    B, T = ids.shape
    P = prefix.shape[0]
    mcache = DynamicCache(config=mtp.config)
    mtp.train_forward(prefix[1:].view(1, P - 1), hp[:, : P - 1], torch.arange(P - 1).view(1, -1), cache=mcache)
    _expand_cache(mcache, B)
    hid = torch.cat([hp[:, P - 1 :].expand(B, 1, -1), hs[:, : T - 2]], dim=1)
    pos = torch.arange(P - 1, P + T - 2).view(1, -1).expand(B, -1)
    hm, logits = mtp.train_forward(ids[:, : T - 1], hid, pos, rows=rows, cache=mcache)
    return hm, logits, mcache


def shared_prefix_losses(model, mtp, cap, prefix, ids, loss_mask, mtp_weight, detach_hidden):
    """The losses of `losses` on rows cat(prefix, ids[b]), with the shared prefix run once.

    Every agent request starts with the same ~740-token harness prompt; running it once per step (batch 1,
    with gradients) and continuing all rows from its cache cuts a row's cost to its own ~190 tokens, so a
    step trains on 4x more requests for the same compute. prefix [P] long; ids [B, T] (right-padded);
    loss_mask [B, T] weights of ids (ids[:, 0] must carry none: it is predicted from the prefix's last row).
    The main and MTP losses equal those of `losses` on the concatenated rows (train.py checks this at
    start-up); the load-balancing terms count the prefix's tokens once instead of once per row.
    """
    cfg = model.config
    B, T = ids.shape
    P = prefix.shape[0]
    if loss_mask[:, 0].any():
        raise ValueError("shared_prefix_losses: loss weight on the first token after the prefix")
    pre, out = _prefix_then_rows(model, prefix, ids, router_logits=True)
    h = out.last_hidden_state
    m1 = loss_mask[:, 1:].float()
    sel1 = (m1.reshape(-1) > 0).nonzero().squeeze(1)
    logits = model.lm_head(h[:, :-1].reshape(-1, h.shape[-1]).index_select(0, sel1))
    ce = F.cross_entropy(logits, ids[:, 1:].reshape(-1)[sel1], reduction="none")
    main = (ce * m1.reshape(-1)[sel1]).sum() / m1.sum()
    aux = load_balancing_loss_func(tuple(pre.router_logits) + tuple(out.router_logits), cfg.num_experts,
                                   cfg.num_experts_per_tok, None)

    # MTP: prefix rows p = 0..P-2 (token p+1, hidden h_p) once; then per row p = P-1..P+T-3.
    hp, hs = pre.last_hidden_state, h
    if detach_hidden:
        hp, hs = hp.detach(), hs.detach()
    m2 = loss_mask[:, 1:].float()  # row j predicts ids[:, j + 1]
    sel2 = (m2.reshape(-1) > 0).nonzero().squeeze(1)
    _, mlogits, _ = _mtp_prefix_then_rows(mtp, prefix, ids, hp, hs, sel2)
    ce2 = F.cross_entropy(mlogits, ids[:, 1:].reshape(-1)[sel2], reduction="none")
    mtp_loss = (ce2 * m2.reshape(-1)[sel2]).sum() / m2.sum()
    maux = load_balancing_loss_func(cap.pop(), cfg.num_experts, cfg.num_experts_per_tok, None)
    total = main + mtp_weight * mtp_loss + cfg.router_aux_loss_coef * (aux + mtp_weight * maux)
    return {"total": total, "main": main, "mtp": mtp_loss, "aux": aux, "mtp_aux": maux,
            "logits": logits, "mtp_logits": mlogits}


def mtp_chain_losses(model, mtp, cap, prefix, ids, loss_mask, steps):
    """MTP CE of each of `steps` chained draft steps on rows cat(prefix, ids[b]), the main model frozen.

    Serving drafts by chaining (engine/src/spec/speculator.rs): step 1 is the row (token p+1, main hidden
    h_p, position p) over the MTP KV of every committed position; step k > 1 is (draft k-1, the MTP's own
    output hidden of step k-1, position p+k-1), attending to the committed positions' MTP keys and to the
    earlier steps of its own chain. `losses` trains step 1 alone, so the MTP never sees its own hidden as
    input (serving acceptance per draft position: 0.99, 0.42, 0.23). Here every step runs on its serving
    inputs, teacher forced (the true next tokens stand in for the drafts): row j of step k is (ids[j+k-1],
    hm_{k-1}[j], position P-1+j+k-1), predicts ids[j+k], and attends to the prefix's and the rows' step-1
    keys up to its chain's committed position P-1+j, plus row j of steps 2..k (the mask below).
    Steps > 1 run only on rows whose chain reaches a weighted token. The target of each row is the frozen
    main model's next-token distribution there (soft CE: a draft is accepted when it matches what the main
    model emits, not the training text). Returns {"total", "steps": [CE_k], "agree": [argmax matches_k, rows_k],
    "draft_logits": [(row b, chain index j, logits) of step k]}.
    """
    cfg = model.config
    B, T = ids.shape
    P = prefix.shape[0]
    with torch.no_grad():
        pre, out = _prefix_then_rows(model, prefix, ids, router_logits=False)
        hp, hs = pre.last_hidden_state, out.last_hidden_state
    agree = []

    def ce(logits, b, i, w):
        """Soft CE of draft logits vs the main model's distribution at row-part position i of row b (which
        predicts ids[b, i+1]), weighted w; also how many argmaxes agree."""
        with torch.no_grad():
            p = torch.softmax(model.lm_head(hs[b, i]), dim=-1)
        c = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
        agree.append([int((logits.argmax(-1) == p.argmax(-1)).sum()), len(b)])
        return (c * w).sum() / w.sum().clamp(min=1e-6)

    # Step 1: as in shared_prefix_losses (row j: token ids[j], hidden h_{P-1+j}, predicts ids[j+1]).
    w1 = loss_mask[:, 1:].float()
    sel1 = (w1.reshape(-1) > 0).nonzero().squeeze(1)
    hm, logits, mcache = _mtp_prefix_then_rows(mtp, prefix, ids, hp, hs, sel1)
    per_step = [ce(logits, sel1 // (T - 1), sel1 % (T - 1), w1.reshape(-1)[sel1])]
    draft_logits = [(sel1 // (T - 1), sel1 % (T - 1), logits)]  # (row, chain index j, logits) per step

    # Rows whose chain (steps 2..K) reaches a weighted token, gathered to [B, L] (padding: row 0, weight 0).
    K = steps
    wpad = torch.cat([loss_mask.float(), torch.zeros(B, K)], dim=1)
    ipad = torch.cat([ids, ids[:, -1:].expand(B, K)], dim=1)
    j = torch.arange(T - 1)
    reach = sum(wpad[:, j + k] for k in range(2, K + 1)) > 0
    L = max(1, int(reach.sum(1).max()))
    idx = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        r = reach[b].nonzero().squeeze(1)
        idx[b, : len(r)], valid[b, : len(r)] = r, True
    hid = hm.gather(1, idx.unsqueeze(2).expand(B, L, hm.shape[-1]))
    step1_keys = (torch.arange(T - 1).view(1, 1, -1) <= idx.unsqueeze(2))  # [B, L, T-1]
    eye = torch.eye(L, dtype=torch.bool).expand(B, L, L)
    for k in range(2, K + 1):
        tok = ipad.gather(1, idx + k - 1)
        pos = P - 1 + idx + k - 1
        w = wpad.gather(1, idx + k) * valid
        sel = (w.reshape(-1) > 0).nonzero().squeeze(1)
        allowed = torch.cat([torch.ones(B, L, P - 1, dtype=torch.bool), step1_keys] + [eye] * (k - 1), dim=2)
        hid, logits = mtp.train_forward(tok, hid, pos, rows=sel, cache=mcache, allowed=allowed)
        b = sel // L
        per_step.append(ce(logits, b, idx.reshape(-1)[sel] + k - 1, w.reshape(-1)[sel]))
        draft_logits.append((b, idx.reshape(-1)[sel], logits))
    maux = load_balancing_loss_func(cap.pop(), cfg.num_experts, cfg.num_experts_per_tok, None)
    total = sum(per_step) / K + cfg.router_aux_loss_coef * maux
    return {"total": total, "steps": per_step, "agree": agree, "mtp_aux": maux, "draft_logits": draft_logits}


def count_params(model, mtp):
    cfg = model.config
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    mtp_experts = sum(p.numel() for n, p in mtp.named_parameters() if ".experts." in n)
    frac = cfg.num_experts_per_tok / cfg.num_experts
    return {
        "main_total": n_main,
        "mtp_total": n_mtp,
        "total": n_main + n_mtp,
        "main_active_per_token": int(n_main - experts * (1 - frac)),
        "mtp_active_per_token": int(n_mtp - mtp_experts * (1 - frac)),
        "embedding": cfg.vocab_size * cfg.hidden_size,
        "lm_head": cfg.vocab_size * cfg.hidden_size,
    }
