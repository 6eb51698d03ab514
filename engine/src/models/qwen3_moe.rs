//! Qwen3-MoE (`qwen3_moe`, e.g. Qwen3-30B-A3B), as HF transformers' `modeling_qwen3_moe.py` computes it.
//!
//! Every layer: plain RMSNorm → GQA attention (q/k RMSNorm, rotate-half RoPE over the full head) → residual;
//! plain RMSNorm → sparse MoE (softmax router, top-k, renormalised if `norm_topk_prob`) or, where
//! `mlp_only_layers` / `decoder_sparse_step` say so, a dense SwiGLU MLP → residual.

use super::attention::Attention;
use super::moe::{Mlp, SparseMoe};
use crate::cache::CacheStore;
use crate::config::ModelConfig;
use crate::ops::{rms_norm, Rope};
use crate::step::StepCtx;
use crate::weights::{Tensor, WeightLoader};

pub enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

pub struct DecoderLayer {
    pub input_layernorm: Vec<f32>,
    pub self_attn: Attention,
    pub post_attention_layernorm: Vec<f32>,
    pub mlp: FeedForward,
}

pub struct Qwen3Moe {
    pub cfg: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: Vec<f32>,
    pub lm_head: Tensor,
    rope: Rope,
}

impl Qwen3Moe {
    pub fn load(cfg: &ModelConfig, w: &mut WeightLoader) -> Self {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = w.take("model.embed_tokens.weight", &[v, h]);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}.");
                let mlp = if cfg.is_moe_layer(i) {
                    FeedForward::Moe(SparseMoe::load(w, &p, cfg))
                } else {
                    FeedForward::Dense(Mlp::load(w, &format!("{p}mlp."), h, cfg.intermediate_size))
                };
                DecoderLayer {
                    input_layernorm: w.take(&format!("{p}input_layernorm.weight"), &[h]).to_f32_vec(),
                    self_attn: Attention::load(w, &p, cfg),
                    post_attention_layernorm: w.take(&format!("{p}post_attention_layernorm.weight"), &[h]).to_f32_vec(),
                    mlp,
                }
            })
            .collect();
        let norm = w.take("model.norm.weight", &[h]).to_f32_vec();
        let lm_head =
            if cfg.tie_word_embeddings { embed_tokens.clone() } else { w.take("lm_head.weight", &[v, h]) };
        let rope = Rope::new(cfg.head_dim, cfg.rotary_dim(), cfg.rope_theta);
        Qwen3Moe { cfg: cfg.clone(), embed_tokens, layers, norm, lm_head, rope }
    }

    /// Run the step's rows through every layer; returns final-normed hiddens `[rows, H]`.
    pub fn forward_hidden(&self, ctx: &StepCtx, cache: &mut CacheStore) -> Vec<f32> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        // 1. Embedding gather.
        let mut x = vec![0.0f32; ctx.num_rows() * h];
        for (row, &tok) in x.chunks_mut(h).zip(&ctx.tokens) {
            self.embed_tokens.row_to_f32(tok as usize, row);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            // 2. Attention block.
            let mut a = x.clone();
            rms_norm(&mut a, &layer.input_layernorm, eps, false);
            let (k_cache, v_cache) = cache.kv_mut(i);
            let attn = layer.self_attn.forward(&a, ctx, &self.rope, k_cache, v_cache);
            x.iter_mut().zip(&attn).for_each(|(xv, d)| *xv += d);
            // 3. Feed-forward block.
            let mut m = x.clone();
            rms_norm(&mut m, &layer.post_attention_layernorm, eps, false);
            let ff = match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.forward(&m),
                FeedForward::Moe(moe) => moe.forward(&m),
            };
            x.iter_mut().zip(&ff).for_each(|(xv, d)| *xv += d);
        }
        // 4. Final norm.
        rms_norm(&mut x, &self.norm, eps, false);
        x
    }
}
