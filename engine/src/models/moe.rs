//! Feed-forward blocks shared by both architectures: the SwiGLU MLP and the sparse MoE block
//! (softmax router, top-k, optional renormalisation, SwiGLU experts, optional sigmoid-gated shared expert).

use super::ops::{Family, Load, Norm, Ops, Ws};
use super::tap;
use crate::config::ModelConfig;

/// `down(silu(x·gateᵀ) ⊙ (x·upᵀ))`.
pub struct Mlp<F: Family> {
    pub gate_proj: F::Mat,
    pub up_proj: F::Mat,
    pub down_proj: F::Mat,
    /// `[gate; up]` as one `[2I, H]` matrix where the weights store them adjacently (stacked experts), so
    /// both are read in one pass.
    pub gate_up: Option<F::Mat>,
}

impl<F: Family> Mlp<F> {
    /// `{prefix}gate_proj.weight` etc. (a dense layer, the shared expert, or one per-expert checkpoint entry).
    pub fn load(w: &mut impl Load<F>, prefix: &str, hidden: usize, inter: usize) -> Self {
        Mlp {
            gate_proj: w.mat(&format!("{prefix}gate_proj.weight"), inter, hidden),
            up_proj: w.mat(&format!("{prefix}up_proj.weight"), inter, hidden),
            down_proj: w.mat(&format!("{prefix}down_proj.weight"), hidden, inter),
            gate_up: None,
        }
    }

    /// `ws.a` → `ws.mlp_out`.
    pub fn forward<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        match &self.gate_up {
            Some(gate_up) => {
                o.linear(&ws.a, gate_up, &mut ws.gate_up);
                o.swiglu(&ws.gate_up, &mut ws.act);
            }
            None => {
                o.linears(&ws.a, &[&self.gate_proj, &self.up_proj], &mut [&mut ws.gate_up, &mut ws.up]);
                o.silu_mul(&ws.gate_up, &ws.up, &mut ws.act);
            }
        }
        self.down(o, ws);
    }

    /// `ws.act` (the SwiGLU rows) → `ws.mlp_out`.
    fn down<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        o.linear(&ws.act, &self.down_proj, &mut ws.mlp_out);
    }

    /// A dense feed-forward block: `ws.x += mlp(norm(ws.x))`.
    pub fn forward_block<O: Ops<F = F>>(&self, o: &mut O, norm: Norm<'_, F::Vec>, ws: &mut Ws<O>) {
        match &self.gate_up {
            Some(gate_up) => {
                o.norm_linears(&ws.x, norm, &mut ws.a, &[gate_up], &mut [&mut ws.gate_up]);
                o.swiglu(&ws.gate_up, &mut ws.act);
            }
            None => {
                o.norm_linears(&ws.x, norm, &mut ws.a, &[&self.gate_proj, &self.up_proj], &mut [&mut ws.gate_up, &mut ws.up]);
                o.silu_mul(&ws.gate_up, &ws.up, &mut ws.act);
            }
        }
        o.linear_add(&ws.act, &self.down_proj, &mut ws.x);
    }
}

/// The sparse MoE block of one layer.
pub struct SparseMoe<F: Family> {
    /// Router, `mlp.gate.weight` `[E, H]`.
    pub gate: F::Mat,
    pub experts: F::Experts,
    /// Qwen3.5: a shared expert whose output is scaled by `sigmoid(x · shared_expert_gateᵀ)`.
    pub shared_expert: Option<(Mlp<F>, F::Mat)>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl<F: Family> SparseMoe<F> {
    /// `{prefix}mlp.*`.
    pub fn load(w: &mut impl Load<F>, prefix: &str, cfg: &ModelConfig) -> Self {
        let (h, inter, e) = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts);
        let gate = w.mat(&format!("{prefix}mlp.gate.weight"), e, h);
        let experts = w.experts(prefix, e, inter, h);
        let shared_expert = (cfg.shared_expert_intermediate_size > 0).then(|| {
            let mlp = Mlp::load(w, &format!("{prefix}mlp.shared_expert."), h, cfg.shared_expert_intermediate_size);
            let gate = w.mat(&format!("{prefix}mlp.shared_expert_gate.weight"), 1, h);
            (mlp, gate)
        });
        SparseMoe { gate, experts, shared_expert, top_k: cfg.num_experts_per_tok, norm_topk_prob: cfg.norm_topk_prob }
    }

    /// `ws.x += Σ_k w_k · expert_k(a) (+ σ(a·g) · shared(a))` with `a = norm(ws.x)` (left in `ws.a`).
    pub fn forward<O: Ops<F = F>>(&self, o: &mut O, norm: Norm<'_, F::Vec>, ws: &mut Ws<O>) {
        match &self.shared_expert {
            // The norm, then the router, shared-expert gate and the shared expert's gate and up projections
            // (they read the same rows): one pass over the four.
            Some((mlp, gate)) if mlp.gate_up.is_none() => o.norm_linears(
                &ws.x,
                norm,
                &mut ws.a,
                &[&self.gate, gate, &mlp.gate_proj, &mlp.up_proj],
                &mut [&mut ws.router, &mut ws.shared_gate, &mut ws.gate_up, &mut ws.up],
            ),
            _ => o.norm_linears(&ws.x, norm, &mut ws.a, &[&self.gate], &mut [&mut ws.router]),
        }
        tap::put(o, || "moe.normed".into(), &ws.a);
        tap::put(o, || "moe.router".into(), &ws.router);
        // Routing, the shared expert (into ws.mlp_out), then the routed experts combined with it.
        let route = (self.top_k, self.norm_topk_prob);
        match &self.shared_expert {
            Some((mlp, _)) if mlp.gate_up.is_none() => {
                let shared = (&ws.gate_up, &ws.up, &mlp.down_proj, &ws.shared_gate);
                let (act, out) = (&mut ws.act, &mut ws.mlp_out);
                o.moe_shared(&ws.a, &ws.router, route, &mut ws.routing, &self.experts, shared, act, out, &mut ws.x);
            }
            Some((mlp, gate)) => {
                o.moe_route(&ws.router, self.top_k, self.norm_topk_prob, &mut ws.routing);
                mlp.forward(o, ws);
                o.linear(&ws.a, gate, &mut ws.shared_gate);
                o.moe_experts(&ws.a, &ws.routing, &self.experts, Some((&ws.mlp_out, &ws.shared_gate)), &mut ws.x);
            }
            None => {
                o.moe_route(&ws.router, self.top_k, self.norm_topk_prob, &mut ws.routing);
                o.moe_experts(&ws.a, &ws.routing, &self.experts, None, &mut ws.x);
            }
        }
    }
}
