//! Qwen3-MoE (`qwen3_moe`, e.g. Qwen3-30B-A3B), as HF transformers' `modeling_qwen3_moe.py` computes it.
//!
//! Every layer: plain RMSNorm → GQA attention (q/k RMSNorm, rotate-half RoPE over the full head) → residual;
//! plain RMSNorm → sparse MoE (softmax router, top-k, renormalised if `norm_topk_prob`) or, where
//! `mlp_only_layers` / `decoder_sparse_step` say so, a dense SwiGLU MLP → residual.

use super::attention::Attention;
use super::moe::{Mlp, SparseMoe};
use super::ops::{Family, Load, Norm, Ops, Ws};
use crate::config::ModelConfig;
use super::host::Host;

pub enum FeedForward<F: Family = Host> {
    Dense(Mlp<F>),
    Moe(SparseMoe<F>),
}

pub struct DecoderLayer<F: Family = Host> {
    pub input_layernorm: F::Vec,
    pub self_attn: Attention<F>,
    pub post_attention_layernorm: F::Vec,
    pub mlp: FeedForward<F>,
}

pub struct Qwen3Moe<F: Family = Host> {
    pub cfg: ModelConfig,
    pub embed_tokens: F::Mat,
    pub layers: Vec<DecoderLayer<F>>,
    pub norm: F::Vec,
    pub lm_head: F::Mat,
}

impl<F: Family> Qwen3Moe<F> {
    pub fn load(cfg: &ModelConfig, w: &mut impl Load<F>) -> Self {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = w.mat("model.embed_tokens.weight", v, h);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                let mlp = if cfg.is_moe_layer(i) {
                    FeedForward::Moe(SparseMoe::load(w, &p, cfg))
                } else {
                    FeedForward::Dense(Mlp::load(w, &format!("{p}mlp."), h, cfg.intermediate_size))
                };
                DecoderLayer {
                    input_layernorm: w.vec(&format!("{p}input_layernorm.weight"), &[h]),
                    self_attn: Attention::load(w, &p, cfg),
                    post_attention_layernorm: w.vec(&format!("{p}post_attention_layernorm.weight"), &[h]),
                    mlp,
                }
            })
            .collect();
        let norm = w.vec("model.norm.weight", &[h]);
        let lm_head = if cfg.tie_word_embeddings { embed_tokens.clone() } else { w.mat("lm_head.weight", v, h) };
        Qwen3Moe { cfg: cfg.clone(), embed_tokens, layers, norm, lm_head }
    }

    /// The step's rows through every layer; the final-normed hiddens end in `ws.hidden`.
    pub fn forward<O: Ops<F = F>>(&self, o: &mut O, ws: &mut Ws<O>) {
        let eps = self.cfg.rms_norm_eps;
        // 1. Embedding gather: the residual stream starts as the embeddings.
        o.embed(&self.embed_tokens, &mut ws.x);
        let norm = |w| Norm { w, zero_centred: false, eps };
        for (i, layer) in self.layers.iter().enumerate() {
            // 2. Attention block: x += attn(norm(x)).
            layer.self_attn.forward(o, i, norm(&layer.input_layernorm), ws);
            // 3. Feed-forward block: x += ffn(norm(x)).
            match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.forward_block(o, norm(&layer.post_attention_layernorm), ws),
                FeedForward::Moe(moe) => moe.forward(o, norm(&layer.post_attention_layernorm), ws),
            }
        }
        // 4. The final norm.
        o.rms_norm(&ws.x, &self.norm, false, eps, &mut ws.hidden);
    }
}
