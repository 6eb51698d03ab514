//! Full (softmax) attention with q/k RMSNorm and partial rotate-half RoPE, GQA, and — for Qwen3.5 — a
//! per-head sigmoid output gate carried in the second half of each q_proj head.

use super::ops::{AttnShape, Family, Load, Norm, Ops, Ws};
use super::tap;
use crate::config::ModelConfig;
use super::host::Host;

pub struct Attention<F: Family = Host> {
    pub q_proj: F::Mat,
    pub k_proj: F::Mat,
    pub v_proj: F::Mat,
    pub o_proj: F::Mat,
    pub q_norm: F::Vec,
    pub k_norm: F::Vec,
    pub shape: AttnShape,
}

impl<F: Family> Attention<F> {
    /// `{prefix}self_attn.*`.
    pub fn load(w: &mut impl Load<F>, prefix: &str, cfg: &ModelConfig) -> Self {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = |n: &str| format!("{prefix}self_attn.{n}.weight");
        Attention {
            q_proj: w.mat(&p("q_proj"), cfg.q_proj_out(), h),
            k_proj: w.mat(&p("k_proj"), nkv * d, h),
            v_proj: w.mat(&p("v_proj"), nkv * d, h),
            o_proj: w.mat(&p("o_proj"), h, nh * d),
            q_norm: w.vec(&p("q_norm"), &[d]),
            k_norm: w.vec(&p("k_norm"), &[d]),
            shape: AttnShape::of(cfg),
        }
    }

    /// `ws.x += attn(norm(ws.x))`. Writes each row's K/V (post-norm, post-RoPE) to its slot in layer `layer`'s
    /// cache, then attends causally over each row's sequence.
    pub fn forward<O: Ops<F = F>>(&self, o: &mut O, layer: usize, norm: Norm<'_, F::Vec>, ws: &mut Ws<O>) {
        self.kv(o, layer, norm, ws);
        self.out(o, layer, ws);
    }

    /// Steps 1-4 of [`Self::forward`]: every row's K/V into the cache, its queries and gates in `ws.q` /
    /// `ws.gate`. (The MTP draft extend stops here for rows nothing drafts from.)
    pub fn kv<O: Ops<F = F>>(&self, o: &mut O, layer: usize, norm: Norm<'_, F::Vec>, ws: &mut Ws<O>) {
        // 1. The input norm and the projections, in one pass (Qwen3.5's q_proj rows are per head
        //    [query d | gate d]).
        o.norm_linears(&ws.x, norm, &mut ws.a, &[&self.q_proj, &self.k_proj, &self.v_proj], &mut [&mut ws.qg, &mut ws.k, &mut ws.v]);
        for (what, b) in [("normed", &ws.a), ("qg", &ws.qg), ("k", &ws.k), ("v", &ws.v)] {
            tap::put(o, || format!("L{layer}.attn.{what}"), b);
        }
        // 2. q/k RMSNorm per head, 3. RoPE at each row's position, 4. K/V into the paged cache.
        o.qk_norm_rope_kv(&self.shape, layer, &ws.qg, &mut ws.k, &ws.v, &self.q_norm, &self.k_norm, &mut ws.q, &mut ws.gate);
        for (what, b) in [("q roped", &ws.q), ("gate", &ws.gate)] {
            tap::put(o, || format!("L{layer}.attn.{what}"), b);
        }
    }

    /// Steps 5-6 of [`Self::forward`] for the rows of `o`'s step, from their queries and gates in `ws.q` /
    /// `ws.gate` (the cache holds every key they attend to).
    pub fn out<O: Ops<F = F>>(&self, o: &mut O, layer: usize, ws: &mut Ws<O>) {
        // 5. Causal attention over the cache, scaled by the output gate.
        let gate = self.shape.gated.then_some(&ws.gate);
        o.paged_attention(&self.shape, layer, &ws.q, gate, &mut ws.attn);
        tap::put(o, || format!("L{layer}.attn.out"), &ws.attn);
        // 6. o_proj, added to the residual stream.
        o.linear_add(&ws.attn, &self.o_proj, &mut ws.x);
    }
}
