//! Qwen3.5 / Qwen3.6 MoE text model (`qwen3_5_moe`), as HF transformers' `modeling_qwen3_5_moe.py` computes it.
//!
//! Layers alternate Gated DeltaNet linear attention and gated full attention (3:1 in the released model);
//! every layer ends in a sparse MoE with a sigmoid-gated shared expert. All decoder norms are zero-centred
//! (`x̂ · (1 + w)`); the GDN output norm has a plain weight. See docs/qwen3_5_moe.md.

use super::attention::Attention;
use super::moe::SparseMoe;
use super::ops::{Family, GdnParams, GdnShape, Load, Norm, Ops, Ws};
use super::tap;
use super::MtpInput;
use crate::config::{LayerType, ModelConfig};
use super::host::Host;

/// Gated DeltaNet (`linear_attn.*`).
pub struct GatedDeltaNet<F: Family = Host> {
    pub in_proj_qkv: F::Mat,
    pub in_proj_z: F::Mat,
    pub in_proj_b: F::Mat,
    pub in_proj_a: F::Mat,
    /// Depthwise causal conv, `[conv_dim, K]` (checkpoint `[conv_dim, 1, K]`).
    pub conv1d: F::Vec,
    pub a_log: F::Vec,
    pub dt_bias: F::Vec,
    /// Gated RMSNorm weight, shared by all value heads (plain, not 1 + w).
    pub norm: F::Vec,
    pub out_proj: F::Mat,
    pub shape: GdnShape,
    eps: f32,
}

impl<F: Family> GatedDeltaNet<F> {
    fn load(w: &mut impl Load<F>, prefix: &str, cfg: &ModelConfig) -> Self {
        let la = cfg.linear_attention.clone().expect("config checked: linear attention dims present");
        let h = cfg.hidden_size;
        let hv = la.num_value_heads;
        let p = |n: &str| format!("{prefix}linear_attn.{n}");
        GatedDeltaNet {
            in_proj_qkv: w.mat(&p("in_proj_qkv.weight"), la.conv_dim(), h),
            in_proj_z: w.mat(&p("in_proj_z.weight"), la.value_dim(), h),
            in_proj_b: w.mat(&p("in_proj_b.weight"), hv, h),
            in_proj_a: w.mat(&p("in_proj_a.weight"), hv, h),
            conv1d: w.vec(&p("conv1d.weight"), &[la.conv_dim(), 1, la.conv_kernel_dim]),
            a_log: w.vec(&p("A_log"), &[hv]),
            dt_bias: w.vec(&p("dt_bias"), &[hv]),
            norm: w.vec(&p("norm.weight"), &[la.value_head_dim]),
            out_proj: w.mat(&p("out_proj.weight"), h, la.value_dim()),
            shape: GdnShape {
                key_heads: la.num_key_heads,
                value_heads: hv,
                key_head_dim: la.key_head_dim,
                value_head_dim: la.value_head_dim,
                conv_kernel: la.conv_kernel_dim,
            },
            eps: cfg.rms_norm_eps,
        }
    }

    /// `ws.x += gdn(norm(ws.x))`; each sequence's rows advance its own state (conv window + recurrent state)
    /// in layer `layer`.
    fn forward<O: Ops<F = F>>(&self, o: &mut O, layer: usize, norm: Norm<'_, F::Vec>, ws: &mut Ws<O>) {
        // 1. The input norm and the projections of all rows, in one pass (each weight read once).
        o.norm_linears(
            &ws.x,
            norm,
            &mut ws.a,
            &[&self.in_proj_qkv, &self.in_proj_z, &self.in_proj_b, &self.in_proj_a],
            &mut [&mut ws.mixed, &mut ws.z, &mut ws.beta, &mut ws.decay],
        );
        for (what, b) in [("normed", &ws.a), ("mixed", &ws.mixed), ("z", &ws.z), ("b", &ws.beta), ("a", &ws.decay)] {
            tap::put(o, || format!("L{layer}.gdn.{what}"), b);
        }
        // 2-5. Causal conv + SiLU, q/k L2 norm, β = σ(b), g = -exp(A_log)·softplus(a + dt_bias), delta rule;
        // 6. then the gated RMSNorm per value head: w · rmsnorm(o) · silu(z).
        let params = GdnParams { conv: &self.conv1d, a_log: &self.a_log, dt_bias: &self.dt_bias };
        o.gdn_mix_norm(
            &self.shape,
            layer,
            &ws.mixed,
            &ws.beta,
            &ws.decay,
            &ws.z,
            params,
            &self.norm,
            self.eps,
            &mut ws.core,
            &mut ws.core_normed,
        );
        tap::put(o, || format!("L{layer}.gdn.core_normed"), &ws.core_normed);
        // 7. out_proj, added to the residual stream.
        o.linear_add(&ws.core_normed, &self.out_proj, &mut ws.x);
    }
}

pub enum TokenMixer<F: Family = Host> {
    FullAttention(Attention<F>),
    LinearAttention(GatedDeltaNet<F>),
}

pub struct DecoderLayer<F: Family = Host> {
    pub input_layernorm: F::Vec,
    pub mixer: TokenMixer<F>,
    pub post_attention_layernorm: F::Vec,
    pub mlp: SparseMoe<F>,
}

/// The MTP ("NextN") head: predicts the token after next from (next token, hidden of the current one).
/// `e' = norm_e(embed(x)); h' = norm_h(h); z = fc([e', h'])` (embedding first) → one full-attention + MoE
/// decoder layer with its own KV → `mtp.norm` → the shared LM head.
pub struct Mtp<F: Family = Host> {
    pub fc: F::Mat,
    pub pre_fc_norm_embedding: F::Vec,
    pub pre_fc_norm_hidden: F::Vec,
    pub input_layernorm: F::Vec,
    pub self_attn: Attention<F>,
    pub post_attention_layernorm: F::Vec,
    pub mlp: SparseMoe<F>,
    pub norm: F::Vec,
}

impl<F: Family> Mtp<F> {
    fn load(w: &mut impl Load<F>, cfg: &ModelConfig) -> Self {
        let h = cfg.hidden_size;
        let p = "mtp.layers.0.";
        Mtp {
            fc: w.mat("mtp.fc.weight", h, 2 * h),
            pre_fc_norm_embedding: w.vec("mtp.pre_fc_norm_embedding.weight", &[h]),
            pre_fc_norm_hidden: w.vec("mtp.pre_fc_norm_hidden.weight", &[h]),
            input_layernorm: w.vec(&format!("{p}input_layernorm.weight"), &[h]),
            self_attn: Attention::load(w, p, cfg),
            post_attention_layernorm: w.vec(&format!("{p}post_attention_layernorm.weight"), &[h]),
            mlp: SparseMoe::load(w, p, cfg),
            norm: w.vec("mtp.norm.weight", &[h]),
        }
    }
}

pub struct Qwen3_5Moe<F: Family = Host> {
    pub cfg: ModelConfig,
    pub embed_tokens: F::Mat,
    pub layers: Vec<DecoderLayer<F>>,
    pub norm: F::Vec,
    pub lm_head: F::Mat,
    /// Present when the checkpoint carries `mtp.*` (the released layout does; save_pretrained drops it).
    pub mtp: Option<Mtp<F>>,
}

impl<F: Family> Qwen3_5Moe<F> {
    /// Names follow the checkpoint: `{prefix}layers.N.…` with prefix `model.language_model.` (released VL
    /// layout) or `model.` (text-only layout); `lm_head.weight` at top level; `mtp.*` when present.
    pub fn load(cfg: &ModelConfig, w: &mut impl Load<F>) -> Self {
        let prefix =
            if w.contains("model.language_model.embed_tokens.weight") { "model.language_model." } else { "model." };
        w.ignore_prefix("model.visual.");
        let mtp = if cfg.mtp_num_hidden_layers > 0 && w.contains("mtp.fc.weight") {
            Some(Mtp::load(w, cfg))
        } else {
            w.ignore_prefix("mtp.");
            None
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = w.mat(&format!("{prefix}embed_tokens.weight"), v, h);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("{prefix}layers.{i}.");
                let mixer = match cfg.layer_types[i] {
                    LayerType::FullAttention => TokenMixer::FullAttention(Attention::load(w, &p, cfg)),
                    LayerType::LinearAttention => TokenMixer::LinearAttention(GatedDeltaNet::load(w, &p, cfg)),
                };
                DecoderLayer {
                    input_layernorm: w.vec(&format!("{p}input_layernorm.weight"), &[h]),
                    mixer,
                    post_attention_layernorm: w.vec(&format!("{p}post_attention_layernorm.weight"), &[h]),
                    mlp: SparseMoe::load(w, &p, cfg),
                }
            })
            .collect();
        let norm = w.vec(&format!("{prefix}norm.weight"), &[h]);
        let lm_head = if cfg.tie_word_embeddings { embed_tokens.clone() } else { w.mat("lm_head.weight", v, h) };
        Qwen3_5Moe { cfg: cfg.clone(), embed_tokens, layers, norm, lm_head, mtp }
    }

    /// The step's rows through every layer; the final-normed hiddens end in `ws.hidden`.
    pub fn forward<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        let eps = self.cfg.rms_norm_eps;
        // 1. Embedding gather: the residual stream starts as the embeddings.
        o.embed(&self.embed_tokens, &mut ws.x);
        tap::put(o, || "embed".into(), &ws.x);
        let norm = |w| Norm { w, zero_centred: true, eps };
        for (i, layer) in self.layers.iter().enumerate() {
            // 2. Token mixer on the zero-centred-normed stream: x += mixer(norm(x)).
            match &layer.mixer {
                TokenMixer::FullAttention(attn) => attn.forward(o, i, norm(&layer.input_layernorm), ws),
                TokenMixer::LinearAttention(gdn) => gdn.forward(o, i, norm(&layer.input_layernorm), ws),
            }
            tap::put(o, || format!("L{i}.x after mixer"), &ws.x);
            // 3. Sparse MoE: x += moe(norm(x)).
            layer.mlp.forward(o, norm(&layer.post_attention_layernorm), ws);
            tap::put(o, || format!("L{i}.x after moe"), &ws.x);
        }
        // 4. The final norm (also the hidden the MTP head consumes).
        o.rms_norm(&ws.x, &self.norm, true, eps, &mut ws.hidden);
    }

    /// The MTP head over the step's rows: row i is (token `i` of the step = the token at `positions[i] + 1`,
    /// `input` row i = the target's (or the previous draft's) post-norm hidden at `positions[i]`), attending
    /// over the MTP's own KV (layer `num_hidden_layers`). Leaves `hm` (post `mtp.norm`) in `ws.hidden`; the
    /// draft logits are the LM head over it. Panics without an MTP head (callers check [`Self::mtp`]).
    pub fn mtp_forward<O: Ops<F = F>>(&self, o: &mut O, input: MtpInput<'_>, ws: &mut Ws<O>) {
        self.mtp_kv(o, input, ws);
        self.mtp_out(o, ws);
    }

    /// Steps 1-3 of [`Self::mtp_forward`] up to the attention's K/V: every row's MTP K/V in the cache, its
    /// residual stream in `ws.x`, queries and gates in `ws.q` / `ws.gate`. A draft extend needs no more for
    /// the rows it does not draft from: their K/V is all later steps read.
    pub fn mtp_kv<O: Ops<F = F>>(&self, o: &mut O, input: MtpInput<'_>, ws: &mut Ws<O>) {
        let mtp = self.mtp.as_ref().expect("caller checked for an MTP head");
        let (h, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        // 1. u = [norm_e(embed(x)) | norm_h(h)] per row.
        o.embed(&self.embed_tokens, &mut ws.y);
        o.rms_norm(&ws.y, &mtp.pre_fc_norm_embedding, true, eps, &mut ws.a);
        match input {
            MtpInput::Host(hidden) => o.upload(hidden, h, &mut ws.x),
            MtpInput::Step(rows) => o.gather_rows(&ws.step_hidden, rows, &mut ws.x),
            MtpInput::Draft(rows) => o.gather_rows(&ws.draft_hidden, rows, &mut ws.x),
        }
        o.rms_norm(&ws.x, &mtp.pre_fc_norm_hidden, true, eps, &mut ws.y);
        o.concat(&ws.a, &ws.y, &mut ws.mtp_in);
        // 2. z = fc(u): the residual stream of the MTP decoder layer.
        o.linear(&ws.mtp_in, &mtp.fc, &mut ws.x);
        // 3. Full attention over the MTP's own KV: z += attn(norm(z)); here its K/V and queries.
        let norm = Norm { w: &mtp.input_layernorm, zero_centred: true, eps };
        mtp.self_attn.kv(o, self.cfg.num_hidden_layers, norm, ws);
    }

    /// The rest of [`Self::mtp_forward`] after [`Self::mtp_kv`], for the rows of `o`'s step (whose residual
    /// stream, queries and gates `ws.x`, `ws.q`, `ws.gate` hold): the attention's output, the MoE and the
    /// final MTP norm into `ws.hidden`.
    pub fn mtp_out<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        let mtp = self.mtp.as_ref().expect("caller checked for an MTP head");
        let eps = self.cfg.rms_norm_eps;
        mtp.self_attn.out(o, self.cfg.num_hidden_layers, ws);
        // 4. Sparse MoE: z += moe(norm(z)).
        mtp.mlp.forward(o, Norm { w: &mtp.post_attention_layernorm, zero_centred: true, eps }, ws);
        // 5. The final MTP norm.
        o.rms_norm(&ws.x, &mtp.norm, true, eps, &mut ws.hidden);
    }
}
