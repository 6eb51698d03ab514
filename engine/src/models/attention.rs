//! Full (softmax) attention with q/k RMSNorm and partial rotate-half RoPE, GQA, and — for Qwen3.5 — a
//! per-head sigmoid output gate carried in the second half of each q_proj head.

use crate::config::ModelConfig;
use crate::ops::{linear, paged_attention, rms_norm, sigmoid, Rope};
use crate::step::StepCtx;
use crate::weights::{Tensor, WeightLoader};

pub struct Attention {
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    output_gate: bool,
    zero_centred: bool,
    eps: f32,
}

impl Attention {
    /// `{prefix}self_attn.*`.
    pub fn load(w: &mut WeightLoader, prefix: &str, cfg: &ModelConfig) -> Self {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let p = |n: &str| format!("{prefix}self_attn.{n}.weight");
        Attention {
            q_proj: w.take(&p("q_proj"), &[cfg.q_proj_out(), h]),
            k_proj: w.take(&p("k_proj"), &[nkv * d, h]),
            v_proj: w.take(&p("v_proj"), &[nkv * d, h]),
            o_proj: w.take(&p("o_proj"), &[h, nh * d]),
            q_norm: w.take(&p("q_norm"), &[d]).to_f32_vec(),
            k_norm: w.take(&p("k_norm"), &[d]).to_f32_vec(),
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            output_gate: cfg.attn_output_gate,
            zero_centred: cfg.zero_centred_norms(),
            eps: cfg.rms_norm_eps,
        }
    }

    /// `x`: `[rows, H]` normed inputs of the step's rows. Writes each row's K/V (post-norm, post-RoPE) to its
    /// slot in `k_cache`/`v_cache`, then attends causally over each row's sequence.
    pub fn forward(&self, x: &[f32], ctx: &StepCtx, rope: &Rope, k_cache: &mut [f32], v_cache: &mut [f32]) -> Vec<f32> {
        let (nh, d) = (self.n_heads, self.head_dim);
        // 1. Projections. Qwen3.5's q_proj rows are per head [query d | gate d].
        let qg = linear(x, &self.q_proj);
        let (mut q, gate) = if self.output_gate {
            let mut q = Vec::with_capacity(qg.len() / 2);
            let mut gate = Vec::with_capacity(qg.len() / 2);
            for head in qg.chunks(2 * d) {
                q.extend_from_slice(&head[..d]);
                gate.extend_from_slice(&head[d..]);
            }
            (q, Some(gate))
        } else {
            (qg, None)
        };
        let mut k = linear(x, &self.k_proj);
        let v = linear(x, &self.v_proj);
        // 2. Per-head RMSNorm on q and k (not v, not the gate).
        rms_norm(&mut q, &self.q_norm, self.eps, self.zero_centred);
        rms_norm(&mut k, &self.k_norm, self.eps, self.zero_centred);
        // 3. RoPE at each row's absolute position; 4. K/V into the paged cache.
        let kv_row = self.n_kv_heads * d;
        for (row, &pos) in ctx.positions.iter().enumerate() {
            rope.apply(&mut q[row * nh * d..(row + 1) * nh * d], pos);
            let kr = &mut k[row * kv_row..(row + 1) * kv_row];
            rope.apply(kr, pos);
            let slot = ctx.slot_mapping[row];
            k_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(kr);
            v_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(&v[row * kv_row..(row + 1) * kv_row]);
        }
        // 5. Causal attention over the cache.
        let mut o = paged_attention(&q, k_cache, v_cache, ctx, nh, self.n_kv_heads, d);
        // 6. Output gate, then o_proj.
        if let Some(gate) = gate {
            for (ov, g) in o.iter_mut().zip(&gate) {
                *ov *= sigmoid(*g);
            }
        }
        linear(&o, &self.o_proj)
    }
}
