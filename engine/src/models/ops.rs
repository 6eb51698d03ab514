//! The op interface the forward is written against. Every architecture (one file each in `models/`) states
//! its forward once, as calls on an [`Ops`]; a backend executes them: [`crate::backend::cpu::CpuOps`] with the SIMD
//! f32 primitives of [`crate::backend::cpu::math`] over host buffers and the host cache, [`crate::backend::record::RecordOps`] by
//! writing down each op with its buffers and bytes (`nextn-bench plan`).
//!
//! Weights come as a [`Family`] (what a matrix, a vector and a block of experts are on that backend) and
//! are built by one load table per architecture through [`Load`] (checkpoint names, shapes, fusions).
//! Activations are [`Ops::Buf`]s of a [`Workspace`] made once, before any step: a step allocates nothing.

use crate::config::ModelConfig;

/// What weights are on one backend.
pub trait Family {
    /// A matrix `[out, in]` in its stored dtype (a linear layer, an embedding, the LM head).
    type Mat: Clone;
    /// A small f32 vector (norm weights, GDN gates' parameters, conv taps).
    type Vec;
    /// The routed experts of one MoE block: `E` SwiGLU MLPs `[2I, H]` (gate rows first) and `[H, I]`.
    type Experts;
}

/// The load table's view of a weight source: tensors by checkpoint name and exact shape. Problems (missing,
/// mis-shaped) are recorded by the implementation and reported together after the load.
pub trait Load<F: Family> {
    /// Whether the source holds `name` (layout detection).
    fn contains(&self, name: &str) -> bool;
    /// Tensors under `prefix` are known but not used.
    fn ignore_prefix(&mut self, prefix: &str);
    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> F::Mat;
    /// A vector from a tensor of `shape` (flattened: e.g. conv taps `[C, 1, K]`).
    fn vec(&mut self, name: &str, shape: &[usize]) -> F::Vec;
    /// `{prefix}mlp.experts.*`, stacked (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, the released
    /// layout) or one entry per expert (`experts.{e}.{gate,up,down}_proj.weight`, what transformers saves).
    fn experts(&mut self, prefix: &str, experts: usize, inter: usize, hidden: usize) -> F::Experts;
}

/// Shapes of one full-attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// Qwen3.5: each q_proj head is `[query d | gate d]`; the output is scaled by `σ(gate)`.
    pub gated: bool,
    /// q/k norms are `x̂ · (1 + w)` (Qwen3.5) rather than `x̂ · w`.
    pub zero_centred: bool,
    pub eps: f32,
}

impl AttnShape {
    pub fn of(cfg: &ModelConfig) -> Self {
        AttnShape {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            rotary_dim: cfg.rotary_dim(),
            rope_theta: cfg.rope_theta,
            gated: cfg.attn_output_gate,
            zero_centred: cfg.zero_centred_norms(),
            eps: cfg.rms_norm_eps,
        }
    }
}

/// Shapes of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy)]
pub struct GdnShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl GdnShape {
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }
    /// Channels of the causal conv: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The per-layer parameters of the gated delta rule.
pub struct GdnParams<'a, V> {
    /// Depthwise causal conv taps `[conv_dim, K]`.
    pub conv: &'a V,
    pub a_log: &'a V,
    pub dt_bias: &'a V,
}

/// An RMSNorm: its weight and form (`x̂ · (1 + w)` when `zero_centred`, else `x̂ · w`).
pub struct Norm<'a, V> {
    pub w: &'a V,
    pub zero_centred: bool,
    pub eps: f32,
}

/// What a workspace buffer holds: backends size and type buffers by it (a device keeps activations in bf16
/// with room for a step's rows, scores in f32, and the LM head's rows in buffers sized for the rows a step
/// samples, not for a whole prefill chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufKind {
    /// Activations of every row of a step.
    Act,
    /// f32 scores of every row (router and shared-expert gate logits: routing reads them at full precision).
    Scores,
    /// Activations of the rows picked for the LM head (at most the rows a step samples).
    Picked,
    /// f32 logits of the picked rows.
    Logits,
}

/// The ops of a forward. Buffers hold `[rows, cols]` f32 activations of the step's rows (a gather changes
/// the row count); `layer` arguments are decoder layer indices (the MTP layer is `num_hidden_layers`), by
/// which the backend finds that layer's KV cache or GDN state.
pub trait Ops {
    type F: Family;
    type Buf;
    /// Per-row top-k expert choices and weights of one MoE block.
    type Routing;

    /// A workspace buffer of `cols` columns (made before steps, reused by every step).
    fn buf(&mut self, cols: usize, kind: BufKind) -> Self::Buf;
    fn routing(&mut self, experts: usize, top_k: usize) -> Self::Routing;

    /// Rows of `table` for the step's tokens.
    fn embed(&mut self, table: &<Self::F as Family>::Mat, out: &mut Self::Buf);
    /// Host rows `[rows, cols]` into a buffer (the MTP's input hiddens).
    fn upload(&mut self, host: &[f32], cols: usize, out: &mut Self::Buf);
    /// RMSNorm over rows of `w`'s length: `x̂ · (1 + w)` when `zero_centred`, else `x̂ · w`.
    fn rms_norm(&mut self, x: &Self::Buf, w: &<Self::F as Family>::Vec, zero_centred: bool, eps: f32, out: &mut Self::Buf);
    /// `[a | b]` per row.
    fn concat(&mut self, a: &Self::Buf, b: &Self::Buf, out: &mut Self::Buf);
    /// `out = x · wᵀ` (`nn.Linear` without bias).
    fn linear(&mut self, x: &Self::Buf, w: &<Self::F as Family>::Mat, out: &mut Self::Buf);
    /// `outs[i] = x · ws[i]ᵀ` for every i: the projections that read the same rows, in one pass over
    /// their weights (one parallel loop on the CPU; a backend without a fused form runs them one by one).
    fn linears(&mut self, x: &Self::Buf, ws: &[&<Self::F as Family>::Mat], outs: &mut [&mut Self::Buf]) {
        assert_eq!(ws.len(), outs.len(), "linears: {} matrices, {} outputs", ws.len(), outs.len());
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.linear(x, w, out);
        }
    }
    /// A pre-norm block's input: `out = RMSNorm(x)` (`x` the residual stream), then `outs[i] = out · ws[i]ᵀ`
    /// (a device normalises inside the projection kernel, and still writes `out` for the ops that read the
    /// normed rows later).
    fn norm_linears(
        &mut self,
        x: &Self::Buf,
        norm: Norm<'_, <Self::F as Family>::Vec>,
        out: &mut Self::Buf,
        ws: &[&<Self::F as Family>::Mat],
        outs: &mut [&mut Self::Buf],
    ) {
        self.rms_norm(x, norm.w, norm.zero_centred, norm.eps, out);
        self.linears(out, ws, outs);
    }
    /// `out = (silu(gate) · up) · wᵀ`: a SwiGLU MLP's down projection over its separate gate and up rows (a
    /// device forms the activations inside the projection kernel; `act` is scratch for the rest).
    fn silu_mul_linear(&mut self, gate: &Self::Buf, up: &Self::Buf, act: &mut Self::Buf, w: &<Self::F as Family>::Mat, out: &mut Self::Buf) {
        self.silu_mul(gate, up, act);
        self.linear(act, w, out);
    }
    /// `acc += x · wᵀ`: a block's output projection added to the residual stream (in the projection's own
    /// pass on a device).
    fn linear_add(&mut self, x: &Self::Buf, w: &<Self::F as Family>::Mat, acc: &mut Self::Buf);
    /// SwiGLU of fused `[gate | up]` rows: `silu(gate) · up`.
    fn swiglu(&mut self, gate_up: &Self::Buf, out: &mut Self::Buf);
    /// SwiGLU of separate gate and up rows.
    fn silu_mul(&mut self, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf);

    /// Split q_proj rows into queries and output gates (when gated), q/k RMSNorm per head, RoPE at each row's
    /// position, and K/V into layer `layer`'s paged cache at each row's slot.
    #[allow(clippy::too_many_arguments)] // the attention's inputs, named as the math names them
    fn qk_norm_rope_kv(
        &mut self,
        s: &AttnShape,
        layer: usize,
        qg: &Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        q_norm: &<Self::F as Family>::Vec,
        k_norm: &<Self::F as Family>::Vec,
        q: &mut Self::Buf,
        gate: &mut Self::Buf,
    );
    /// Causal attention of every row over its sequence's cached keys and values; `gate`: scale the output
    /// by `σ(gate)`.
    fn paged_attention(&mut self, s: &AttnShape, layer: usize, q: &Self::Buf, gate: Option<&Self::Buf>, out: &mut Self::Buf);

    /// Causal conv (from and into each sequence's conv window) + SiLU, q/k L2 norm, gates, and the delta-rule
    /// recurrence (from and into its recurrent state; verifying sequences also fill one snapshot lane per row).
    #[allow(clippy::too_many_arguments)] // the recurrence's inputs, named as the math names them
    fn gdn_mix(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        w: GdnParams<'_, <Self::F as Family>::Vec>,
        out: &mut Self::Buf,
    );
    /// [`Ops::gdn_mix`] into `core`, then the layer's output norm into `out`: `norm_w · rmsnorm(core) · silu(z)`
    /// per value head (a device normalises in the recurrence's own launch for decode and verify batches).
    #[allow(clippy::too_many_arguments)] // gdn_mix's inputs and the norm's
    fn gdn_mix_norm(
        &mut self,
        s: &GdnShape,
        layer: usize,
        mixed: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        z: &Self::Buf,
        w: GdnParams<'_, <Self::F as Family>::Vec>,
        norm_w: &<Self::F as Family>::Vec,
        eps: f32,
        core: &mut Self::Buf,
        out: &mut Self::Buf,
    ) {
        self.gdn_mix(s, layer, mixed, b, a, w, core);
        self.gated_rms_norm(core, z, norm_w, eps, out);
    }
    /// `w · rmsnorm(x) · silu(z)` over rows of `w`'s length (one value head each).
    fn gated_rms_norm(&mut self, x: &Self::Buf, z: &Self::Buf, w: &<Self::F as Family>::Vec, eps: f32, out: &mut Self::Buf);

    /// Softmax over the router logits, top-k (ties: the lower expert id), optionally renormalised.
    fn moe_route(&mut self, logits: &Self::Buf, top_k: usize, renormalise: bool, routing: &mut Self::Routing);
    /// `acc += Σ_k w_k · SwiGLU_k(x)` per row (`acc` the residual stream), rows grouped by expert (each chosen
    /// expert's weights read once), plus `σ(gate) · shared` per row when `shared` = (the shared expert's output,
    /// its gate logits as a [`BufKind::Scores`] buffer) is given: all in the pass that combines the experts
    /// (one kernel on a device, where a separate gated add and residual add each cost a launch per layer).
    fn moe_experts(
        &mut self,
        x: &Self::Buf,
        routing: &Self::Routing,
        experts: &<Self::F as Family>::Experts,
        shared: Option<(&Self::Buf, &Self::Buf)>,
        acc: &mut Self::Buf,
    );

    /// A sparse MoE block with a shared expert, after its projections: route the `logits` rows ([`Ops::moe_route`]),
    /// the shared expert's down projection `shared_out = (silu(gate) · up) · downᵀ` (`act` scratch), then
    /// [`Ops::moe_experts`] with it and its gate logits `shared_gate`. A device does it in two launches for decode
    /// and verify rows: the routing inside the experts' gate/up GEMV, then the routed experts' down projections,
    /// the shared one, the combine and the residual add in one.
    #[allow(clippy::too_many_arguments)] // the router's, the experts' and the shared expert's inputs, named as the math names them
    fn moe_shared(
        &mut self,
        x: &Self::Buf,
        logits: &Self::Buf,
        (top_k, renormalise): (usize, bool),
        routing: &mut Self::Routing,
        experts: &<Self::F as Family>::Experts,
        (gate, up, down, shared_gate): (&Self::Buf, &Self::Buf, &<Self::F as Family>::Mat, &Self::Buf),
        act: &mut Self::Buf,
        shared_out: &mut Self::Buf,
        acc: &mut Self::Buf,
    ) {
        self.moe_route(logits, top_k, renormalise, routing);
        self.silu_mul_linear(gate, up, act, down, shared_out);
        self.moe_experts(x, routing, experts, Some((shared_out, shared_gate)), acc);
    }

    /// Rows `rows` of `x`, in that order.
    fn gather_rows(&mut self, x: &Self::Buf, rows: &[usize], out: &mut Self::Buf);
    /// `out = x` (every row).
    fn copy(&mut self, x: &Self::Buf, out: &mut Self::Buf);
    /// A buffer's rows back on the host.
    fn download(&mut self, x: &Self::Buf) -> Vec<f32>;
    /// The index of each row's largest value, on the host (greedy sampling: ties → the lowest index, NaN never
    /// wins, as [`crate::sample::argmax`]). A device backend reduces on the device and sends back 4 bytes a row.
    fn download_argmax(&mut self, x: &Self::Buf) -> Vec<u32>;
}

/// The workspace of an executor `O`.
pub type Ws<O> = Workspace<<O as Ops>::Buf, <O as Ops>::Routing>;

/// The activations of a forward, made once per backend (sized by the backend as steps need; a recording
/// shows that steps within the capacity allocate nothing). Generic over the buffer types alone, so a
/// backend can keep one across steps while its executor borrows each step's state.
pub struct Workspace<B, R> {
    /// The residual stream `[rows, H]` (blocks add their outputs into it).
    pub x: B,
    /// The normed stream a block reads.
    pub a: B,
    /// Scratch rows of width H (the MTP's normed embeddings).
    pub y: B,
    /// Final-normed hiddens (what the LM head and the MTP read).
    pub hidden: B,
    // Attention.
    pub qg: B,
    pub k: B,
    pub v: B,
    pub q: B,
    pub gate: B,
    pub attn: B,
    // Gated DeltaNet.
    pub mixed: B,
    pub z: B,
    pub beta: B,
    pub decay: B,
    pub core: B,
    pub core_normed: B,
    // MoE and MLPs.
    pub router: B,
    pub routing: R,
    pub gate_up: B,
    pub up: B,
    pub act: B,
    pub mlp_out: B,
    pub shared_gate: B,
    // MTP input `[e' | h']`.
    pub mtp_in: B,
    // LM head.
    pub picked: B,
    pub logits: B,
    /// Hiddens kept across forwards for the MTP head to draft from, where the backend keeps its workspace (a
    /// device: they never go to the host): the last target forward's ([`crate::models::Model::keep_hidden`])
    /// and the last MTP forward's.
    pub step_hidden: B,
    pub draft_hidden: B,
}

impl<B, R> Workspace<B, R> {
    /// Every activation buffer (the routing aside), in field order: a CUDA graph's replay runs no host code, so
    /// the backend puts back the shapes its capture left ([`crate::backend::cuda`]).
    pub fn bufs_mut(&mut self) -> [&mut B; 27] {
        [
            &mut self.x, &mut self.a, &mut self.y, &mut self.hidden,
            &mut self.qg, &mut self.k, &mut self.v, &mut self.q, &mut self.gate, &mut self.attn,
            &mut self.mixed, &mut self.z, &mut self.beta, &mut self.decay, &mut self.core, &mut self.core_normed,
            &mut self.router, &mut self.gate_up, &mut self.up, &mut self.act, &mut self.mlp_out, &mut self.shared_gate,
            &mut self.mtp_in, &mut self.picked, &mut self.logits, &mut self.step_hidden, &mut self.draft_hidden,
        ]
    }

    pub fn new<O: Ops<Buf = B, Routing = R>>(o: &mut O, cfg: &ModelConfig) -> Self {
        use BufKind::{Act, Logits, Picked, Scores};
        let h = cfg.hidden_size;
        let d = cfg.head_dim;
        let kv = cfg.num_key_value_heads * d;
        let heads = cfg.num_attention_heads * d;
        let la = cfg.linear_attention.as_ref();
        let (conv, vd, nv) = la.map_or((0, 0, 0), |l| (l.conv_dim(), l.value_dim(), l.num_value_heads));
        let inter = cfg.moe_intermediate_size.max(cfg.shared_expert_intermediate_size).max(cfg.intermediate_size);
        Workspace {
            x: o.buf(h, Act),
            a: o.buf(h, Act),
            y: o.buf(h, Act),
            hidden: o.buf(h, Act),
            qg: o.buf(cfg.q_proj_out(), Act),
            k: o.buf(kv, Act),
            v: o.buf(kv, Act),
            q: o.buf(heads, Act),
            gate: o.buf(heads, Act),
            attn: o.buf(heads, Act),
            mixed: o.buf(conv, Act),
            z: o.buf(vd, Act),
            beta: o.buf(nv, Act),
            decay: o.buf(nv, Act),
            core: o.buf(vd, Act),
            core_normed: o.buf(vd, Act),
            router: o.buf(cfg.num_experts, Scores),
            routing: o.routing(cfg.num_experts, cfg.num_experts_per_tok),
            gate_up: o.buf(2 * inter, Act),
            up: o.buf(inter, Act),
            act: o.buf(inter, Act),
            mlp_out: o.buf(h, Act),
            shared_gate: o.buf(1, Scores),
            mtp_in: o.buf(2 * h, Act),
            picked: o.buf(h, Picked),
            logits: o.buf(cfg.vocab_size, Logits),
            step_hidden: o.buf(h, Act),
            draft_hidden: o.buf(h, Act),
        }
    }
}
