//! Feed-forward blocks shared by both architectures: the SwiGLU MLP and the sparse MoE block
//! (softmax router, top-k, optional renormalisation, SwiGLU experts, optional sigmoid-gated shared expert).

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::ops::{linear, sigmoid, silu, softmax};
use crate::weights::{Tensor, WeightLoader};

/// `down(silu(x·gateᵀ) ⊙ (x·upᵀ))`.
pub struct Mlp {
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
    /// `[gate; up]` as one `[2I, H]` view when the checkpoint stores them adjacently (fused experts), so
    /// both are streamed in one pass.
    pub gate_up: Option<Tensor>,
}

impl Mlp {
    /// `{prefix}gate_proj.weight` etc. (a dense layer, the shared expert, or one per-expert checkpoint entry).
    pub fn load(w: &mut WeightLoader, prefix: &str, hidden: usize, inter: usize) -> Self {
        Mlp {
            gate_proj: w.take(&format!("{prefix}gate_proj.weight"), &[inter, hidden]),
            up_proj: w.take(&format!("{prefix}up_proj.weight"), &[inter, hidden]),
            down_proj: w.take(&format!("{prefix}down_proj.weight"), &[hidden, inter]),
            gate_up: None,
        }
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let inter = self.gate_proj.rows();
        let h: Vec<f32> = match &self.gate_up {
            Some(gate_up) => {
                // Rows per input row: [gate (I) | up (I)].
                let gu = linear(x, gate_up);
                gu.chunks(2 * inter).flat_map(|r| r[..inter].iter().zip(&r[inter..]).map(|(g, u)| silu(*g) * u)).collect()
            }
            None => {
                let mut h = linear(x, &self.gate_proj);
                let up = linear(x, &self.up_proj);
                for (g, u) in h.iter_mut().zip(&up) {
                    *g = silu(*g) * u;
                }
                h
            }
        };
        linear(&h, &self.down_proj)
    }
}

/// The sparse MoE block of one layer.
pub struct SparseMoe {
    /// Router, `mlp.gate.weight` `[E, H]`.
    pub gate: Tensor,
    pub experts: Vec<Mlp>,
    /// Qwen3.5: a shared expert whose output is scaled by `sigmoid(x · shared_expert_gateᵀ)`.
    pub shared_expert: Option<(Mlp, Tensor)>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// Load `{prefix}mlp.*`. Experts come either fused (`experts.gate_up_proj` `[E, 2I, H]` with the gate rows
    /// first, `experts.down_proj` `[E, H, I]`; the released layout) or one entry per expert
    /// (`experts.{e}.{gate,up,down}_proj.weight`; what transformers' `save_pretrained` writes). Fused tensors
    /// are split into zero-copy per-expert views here, once.
    pub fn load(w: &mut WeightLoader, prefix: &str, cfg: &ModelConfig) -> Self {
        let (h, inter, e) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
        let gate = w.take(&format!("{prefix}mlp.gate.weight"), &[e, h]);
        let fused_name = format!("{prefix}mlp.experts.gate_up_proj");
        let experts = if w.contains(&fused_name) {
            let gate_up = w.take(&fused_name, &[e, 2 * inter, h]);
            let down = w.take(&format!("{prefix}mlp.experts.down_proj"), &[e, h, inter]);
            if gate_up.numel() == 0 || down.numel() == 0 {
                Vec::new() // problem already recorded
            } else {
                (0..e)
                    .map(|i| {
                        let gu = gate_up.index0(i);
                        Mlp {
                            gate_proj: gu.rows_range(0, inter),
                            up_proj: gu.rows_range(inter, 2 * inter),
                            down_proj: down.index0(i),
                            gate_up: Some(gu),
                        }
                    })
                    .collect()
            }
        } else {
            (0..e).map(|i| Mlp::load(w, &format!("{prefix}mlp.experts.{i}."), h, inter)).collect()
        };
        let shared_expert = (cfg.shared_expert_intermediate_size > 0).then(|| {
            let mlp = Mlp::load(w, &format!("{prefix}mlp.shared_expert."), h, cfg.shared_expert_intermediate_size);
            let gate = w.take(&format!("{prefix}mlp.shared_expert_gate.weight"), &[1, h]);
            (mlp, gate)
        });
        SparseMoe { gate, experts, shared_expert, top_k: cfg.num_experts_per_tok, norm_topk_prob: cfg.norm_topk_prob }
    }

    /// Router for each row: (expert ids, weights), top-k by softmax probability.
    pub fn route(&self, x: &[f32]) -> Vec<Vec<(usize, f32)>> {
        let e = self.gate.rows();
        let logits = linear(x, &self.gate);
        logits
            .chunks(e)
            .map(|row| {
                let mut p = row.to_vec();
                softmax(&mut p);
                let mut idx: Vec<usize> = (0..e).collect();
                // Stable sort: on exact ties the lower expert id wins.
                idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let mut top: Vec<(usize, f32)> = idx[..self.top_k].iter().map(|&i| (i, p[i])).collect();
                if self.norm_topk_prob {
                    let s: f32 = top.iter().map(|(_, w)| w).sum();
                    top.iter_mut().for_each(|(_, w)| *w /= s);
                }
                top
            })
            .collect()
    }

    /// `Σ_k w_k · expert_k(x) (+ σ(x·g) · shared(x))` for every row of `x` (`[t, H]`).
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let h = self.gate.row_len();
        let t = x.len() / h;
        let routes = self.route(x);
        // Group rows by expert so each selected expert's weights are streamed once.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for (row, picks) in routes.iter().enumerate() {
            for &(e, wgt) in picks {
                by_expert[e].push((row, wgt));
            }
        }
        let partial: Vec<(usize, Vec<f32>)> = by_expert
            .par_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(e, rows)| {
                let xs: Vec<f32> = rows.iter().flat_map(|&(r, _)| x[r * h..(r + 1) * h].iter().copied()).collect();
                (e, self.experts[e].forward(&xs))
            })
            .collect();
        let mut out = vec![0.0f32; t * h];
        for (e, ys) in partial {
            for (&(row, wgt), y) in by_expert[e].iter().zip(ys.chunks(h)) {
                for (o, v) in out[row * h..(row + 1) * h].iter_mut().zip(y) {
                    *o += wgt * v;
                }
            }
        }
        if let Some((mlp, gate)) = &self.shared_expert {
            let s = mlp.forward(x);
            let g = linear(x, gate);
            for row in 0..t {
                let scale = sigmoid(g[row]);
                for (o, v) in out[row * h..(row + 1) * h].iter_mut().zip(&s[row * h..(row + 1) * h]) {
                    *o += scale * v;
                }
            }
        }
        out
    }
}
