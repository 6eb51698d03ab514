//! Qwen3.5 / Qwen3.6 MoE text model (`qwen3_5_moe`), as HF transformers' `modeling_qwen3_5_moe.py` computes it.
//!
//! Layers alternate Gated DeltaNet linear attention and gated full attention (3:1 in the released model);
//! every layer ends in a sparse MoE with a sigmoid-gated shared expert. All decoder norms are zero-centred
//! (`x̂ · (1 + w)`); the GDN output norm has a plain weight. See `shared/reference/qwen3_5_moe.md` §2.

use rayon::prelude::*;

use super::attention::Attention;
use super::moe::SparseMoe;
use crate::cache::CacheStore;
use crate::config::{LayerType, LinearAttentionConfig, ModelConfig};
use crate::ops::{l2_normalize, linear, rms_norm, sigmoid, silu, softplus, Rope};
use crate::step::StepCtx;
use crate::weights::{Tensor, WeightLoader};

/// Gated DeltaNet (`linear_attn.*`).
pub struct GatedDeltaNet {
    pub in_proj_qkv: Tensor,
    pub in_proj_z: Tensor,
    pub in_proj_b: Tensor,
    pub in_proj_a: Tensor,
    /// Depthwise causal conv, `[conv_dim, K]` (checkpoint `[conv_dim, 1, K]`).
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight, shared by all value heads (plain, not 1 + w).
    pub norm: Vec<f32>,
    pub out_proj: Tensor,
    la: LinearAttentionConfig,
    eps: f32,
}

impl GatedDeltaNet {
    fn load(w: &mut WeightLoader, prefix: &str, cfg: &ModelConfig) -> Self {
        let la = cfg.linear_attention.clone().expect("config checked: linear attention dims present");
        let h = cfg.hidden_size;
        let hv = la.num_value_heads;
        let p = |n: &str| format!("{prefix}linear_attn.{n}");
        GatedDeltaNet {
            in_proj_qkv: w.take(&p("in_proj_qkv.weight"), &[la.conv_dim(), h]),
            in_proj_z: w.take(&p("in_proj_z.weight"), &[la.value_dim(), h]),
            in_proj_b: w.take(&p("in_proj_b.weight"), &[hv, h]),
            in_proj_a: w.take(&p("in_proj_a.weight"), &[hv, h]),
            conv1d: w.take(&p("conv1d.weight"), &[la.conv_dim(), 1, la.conv_kernel_dim]).to_f32_vec(),
            a_log: w.take(&p("A_log"), &[hv]).to_f32_vec(),
            dt_bias: w.take(&p("dt_bias"), &[hv]).to_f32_vec(),
            norm: w.take(&p("norm.weight"), &[la.value_head_dim]).to_f32_vec(),
            out_proj: w.take(&p("out_proj.weight"), &[h, la.value_dim()]),
            la,
            eps: cfg.rms_norm_eps,
        }
    }

    /// `x`: `[rows, H]` normed inputs of the step; each sequence's rows advance its own state slot
    /// (conv window + recurrent state) token by token (recurrent form, exact).
    fn forward(&self, x: &[f32], ctx: &StepCtx, layer: usize, cache: &mut CacheStore) -> Vec<f32> {
        // 1. Projections, for all rows of all sequences at once (weights are streamed once).
        let mixed = linear(x, &self.in_proj_qkv);
        let z = linear(x, &self.in_proj_z);
        let b = linear(x, &self.in_proj_b);
        let a = linear(x, &self.in_proj_a);
        let (cd, vd, nv) = (self.la.conv_dim(), self.la.value_dim(), self.la.num_value_heads);
        let mut o = vec![0.0f32; ctx.num_rows() * vd];
        for seq in &ctx.seqs {
            let r = seq.rows.clone();
            let (conv, rec) = cache.gdn_mut(layer, seq.state_slot);
            let (out, snaps) = self.mix(
                &mixed[r.start * cd..r.end * cd],
                &b[r.start * nv..r.end * nv],
                &a[r.start * nv..r.end * nv],
                conv,
                rec,
                seq.snapshot,
            );
            o[r.start * vd..r.end * vd].copy_from_slice(&out);
            if let Some((conv_snaps, rec_snaps)) = snaps {
                let (conv_lanes, rec_lanes) = cache.gdn_lanes_mut(layer, seq.state_slot);
                assert!(conv_snaps.len() <= conv_lanes.len(), "more verify rows than snapshot lanes");
                conv_lanes[..conv_snaps.len()].copy_from_slice(&conv_snaps);
                rec_lanes[..rec_snaps.len()].copy_from_slice(&rec_snaps);
            }
        }
        // 6. Gated RMSNorm per value head: w · rmsnorm(o) · silu(z).
        rms_norm(&mut o, &self.norm, self.eps, false);
        for (ov, &zv) in o.iter_mut().zip(&z) {
            *ov *= silu(zv);
        }
        // 7. out_proj.
        linear(&o, &self.out_proj)
    }

    /// Steps 2–5 for the `t` rows of one sequence: conv (from and into `conv_state`), q/k/v, gates, and the
    /// delta-rule recurrence (from and into `recurrent`). Returns the core output `[t, Hv · Dv]` and, with
    /// `snapshot`, the conv window and recurrent state after each row (`[t, conv_len]`, `[t, rec_len]`).
    #[allow(clippy::type_complexity)]
    fn mix(
        &self,
        mixed: &[f32],
        b: &[f32],
        a: &[f32],
        conv_state: &mut [f32],
        recurrent: &mut [f32],
        snapshot: bool,
    ) -> (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>) {
        let la = &self.la;
        let (nk, nv, dk, dv, kw) =
            (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel_dim);
        let conv_dim = la.conv_dim();
        let t = mixed.len() / conv_dim;

        // 2. Causal depthwise conv over q,k,v channels + SiLU; the window starts with the saved K-1 rows.
        let mut window = conv_state.to_vec();
        window.extend_from_slice(mixed);
        let mut c = vec![0.0f32; t * conv_dim];
        for ti in 0..t {
            for ch in 0..conv_dim {
                let taps = &self.conv1d[ch * kw..(ch + 1) * kw];
                let s: f32 = (0..kw).map(|j| taps[j] * window[(ti + j) * conv_dim + ch]).sum();
                c[ti * conv_dim + ch] = silu(s);
            }
        }
        conv_state.copy_from_slice(&window[t * conv_dim..]);
        let conv_len = conv_state.len();
        // Conv window after row ti = the K-1 raw rows ending at ti.
        let conv_snaps: Vec<f32> = if snapshot {
            (0..t).flat_map(|ti| window[(ti + 1) * conv_dim..(ti + 1) * conv_dim + conv_len].iter().copied()).collect()
        } else {
            Vec::new()
        };

        // 3. Split into q [t, Hk, Dk], k [t, Hk, Dk], v [t, Hv, Dv]; L2-normalise q and k; scale q.
        let (kd, vd) = (la.key_dim(), la.value_dim());
        let mut q = Vec::with_capacity(t * kd);
        let mut k = Vec::with_capacity(t * kd);
        let mut v = Vec::with_capacity(t * vd);
        for row in c.chunks(conv_dim) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        l2_normalize(&mut q, dk, 1e-6);
        l2_normalize(&mut k, dk, 1e-6);
        let q_scale = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= q_scale);

        // 4. beta = σ(b); g = -exp(A_log) · softplus(a + dt_bias)  (per-step decay exp(g) ∈ (0, 1]).
        let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
        let g: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, &x)| -self.a_log[i % nv].exp() * softplus(x + self.dt_bias[i % nv]))
            .collect();

        // 5. Delta-rule recurrence, independently per value head j (key head j / (Hv / Hk)).
        let ratio = nv / nk;
        let mut o = vec![0.0f32; t * vd];
        let mut per_head: Vec<Vec<f32>> = vec![Vec::new(); nv];
        let mut head_snaps: Vec<Vec<f32>> = vec![Vec::new(); nv];
        recurrent.par_chunks_mut(dk * dv).zip(per_head.par_iter_mut()).zip(head_snaps.par_iter_mut()).enumerate().for_each(
            |(j, ((s, out), snaps))| {
                let kh = j / ratio;
                out.resize(t * dv, 0.0);
                let mut mem = vec![0.0f32; dv];
                for ti in 0..t {
                    let qt = &q[ti * kd + kh * dk..][..dk];
                    let kt = &k[ti * kd + kh * dk..][..dk];
                    let vt = &v[ti * vd + j * dv..][..dv];
                    let decay = g[ti * nv + j].exp();
                    let bt = beta[ti * nv + j];
                    // S = decay·S;  mem = Sᵀk;  u = β(v − mem);  S += k ⊗ u;  o = Sᵀq
                    s.iter_mut().for_each(|x| *x *= decay);
                    mem.iter_mut().for_each(|m| *m = 0.0);
                    for (kk, &kv) in kt.iter().enumerate() {
                        for (m, &sv) in mem.iter_mut().zip(&s[kk * dv..(kk + 1) * dv]) {
                            *m += sv * kv;
                        }
                    }
                    let u: Vec<f32> = vt.iter().zip(&mem).map(|(&vv, &m)| bt * (vv - m)).collect();
                    let ot = &mut out[ti * dv..(ti + 1) * dv];
                    ot.iter_mut().for_each(|x| *x = 0.0);
                    for kk in 0..dk {
                        let row = &mut s[kk * dv..(kk + 1) * dv];
                        for (sv, &uv) in row.iter_mut().zip(&u) {
                            *sv += kt[kk] * uv;
                        }
                        for (ov, &sv) in ot.iter_mut().zip(row.iter()) {
                            *ov += sv * qt[kk];
                        }
                    }
                    if snapshot {
                        snaps.extend_from_slice(s);
                    }
                }
            },
        );
        for (j, head) in per_head.iter().enumerate() {
            for ti in 0..t {
                o[ti * vd + j * dv..][..dv].copy_from_slice(&head[ti * dv..(ti + 1) * dv]);
            }
        }
        let snaps = snapshot.then(|| {
            // Per-head snapshots [head][row][dk·dv] → per-row states [row][head][dk·dv].
            let hs = dk * dv;
            let mut rec_snaps = vec![0.0f32; t * nv * hs];
            for (j, head) in head_snaps.iter().enumerate() {
                for ti in 0..t {
                    rec_snaps[(ti * nv + j) * hs..][..hs].copy_from_slice(&head[ti * hs..(ti + 1) * hs]);
                }
            }
            (conv_snaps, rec_snaps)
        });

        (o, snaps)
    }
}

pub enum TokenMixer {
    FullAttention(Attention),
    LinearAttention(GatedDeltaNet),
}

pub struct DecoderLayer {
    pub input_layernorm: Vec<f32>,
    pub mixer: TokenMixer,
    pub post_attention_layernorm: Vec<f32>,
    pub mlp: SparseMoe,
}

/// The MTP ("NextN") head: predicts the token after next from (next token, hidden of the current one).
/// `e' = norm_e(embed(x)); h' = norm_h(h); z = fc([e', h'])` (embedding first) → one full-attention + MoE
/// decoder layer with its own KV → `mtp.norm` → the shared LM head. See the reference §3.
pub struct Mtp {
    pub fc: Tensor,
    pub pre_fc_norm_embedding: Vec<f32>,
    pub pre_fc_norm_hidden: Vec<f32>,
    pub input_layernorm: Vec<f32>,
    pub self_attn: Attention,
    pub post_attention_layernorm: Vec<f32>,
    pub mlp: SparseMoe,
    pub norm: Vec<f32>,
}

impl Mtp {
    fn load(w: &mut WeightLoader, cfg: &ModelConfig) -> Self {
        let h = cfg.hidden_size;
        let p = "mtp.layers.0.";
        Mtp {
            fc: w.take("mtp.fc.weight", &[h, 2 * h]),
            pre_fc_norm_embedding: w.take("mtp.pre_fc_norm_embedding.weight", &[h]).to_f32_vec(),
            pre_fc_norm_hidden: w.take("mtp.pre_fc_norm_hidden.weight", &[h]).to_f32_vec(),
            input_layernorm: w.take(&format!("{p}input_layernorm.weight"), &[h]).to_f32_vec(),
            self_attn: Attention::load(w, p, cfg),
            post_attention_layernorm: w.take(&format!("{p}post_attention_layernorm.weight"), &[h]).to_f32_vec(),
            mlp: SparseMoe::load(w, p, cfg),
            norm: w.take("mtp.norm.weight", &[h]).to_f32_vec(),
        }
    }
}

pub struct Qwen3_5Moe {
    pub cfg: ModelConfig,
    pub embed_tokens: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: Vec<f32>,
    pub lm_head: Tensor,
    /// Present when the checkpoint carries `mtp.*` (the released layout does; save_pretrained drops it).
    pub mtp: Option<Mtp>,
    rope: Rope,
}

impl Qwen3_5Moe {
    /// Names follow the checkpoint: `{prefix}layers.N.…` with prefix `model.language_model.` (released VL
    /// layout) or `model.` (text-only layout); `lm_head.weight` at top level. `mtp.*` is recognised but not
    /// used by the main forward.
    pub fn load(cfg: &ModelConfig, w: &mut WeightLoader) -> Self {
        let prefix = if w.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        w.ignore_prefix("model.visual.");
        let mtp = if cfg.mtp_num_hidden_layers > 0 && w.contains("mtp.fc.weight") {
            Some(Mtp::load(w, cfg))
        } else {
            w.ignore_prefix("mtp.");
            None
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_tokens = w.take(&format!("{prefix}embed_tokens.weight"), &[v, h]);
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("{prefix}layers.{i}.");
                let mixer = match cfg.layer_types[i] {
                    LayerType::FullAttention => TokenMixer::FullAttention(Attention::load(w, &p, cfg)),
                    LayerType::LinearAttention => TokenMixer::LinearAttention(GatedDeltaNet::load(w, &p, cfg)),
                };
                DecoderLayer {
                    input_layernorm: w.take(&format!("{p}input_layernorm.weight"), &[h]).to_f32_vec(),
                    mixer,
                    post_attention_layernorm: w.take(&format!("{p}post_attention_layernorm.weight"), &[h]).to_f32_vec(),
                    mlp: SparseMoe::load(w, &p, cfg),
                }
            })
            .collect();
        let norm = w.take(&format!("{prefix}norm.weight"), &[h]).to_f32_vec();
        let lm_head =
            if cfg.tie_word_embeddings { embed_tokens.clone() } else { w.take("lm_head.weight", &[v, h]) };
        let rope = Rope::new(cfg.head_dim, cfg.rotary_dim(), cfg.rope_theta);
        Qwen3_5Moe { cfg: cfg.clone(), embed_tokens, layers, norm, lm_head, mtp, rope }
    }

    /// Run the step's rows through every layer; returns final-normed hiddens `[rows, H]`.
    pub fn forward_hidden(&self, ctx: &StepCtx, cache: &mut CacheStore) -> Vec<f32> {
        let h = self.cfg.hidden_size;
        // 1. Embedding gather.
        let mut x = vec![0.0f32; ctx.num_rows() * h];
        for (row, &tok) in x.chunks_mut(h).zip(&ctx.tokens) {
            self.embed_tokens.row_to_f32(tok as usize, row);
        }
        let eps = self.cfg.rms_norm_eps;
        for (i, layer) in self.layers.iter().enumerate() {
            // 2. Token mixer on the zero-centred-normed stream, residual add.
            let mut a = x.clone();
            rms_norm(&mut a, &layer.input_layernorm, eps, true);
            let mixed = match &layer.mixer {
                TokenMixer::FullAttention(attn) => {
                    let (k_cache, v_cache) = cache.kv_mut(i);
                    attn.forward(&a, ctx, &self.rope, k_cache, v_cache)
                }
                TokenMixer::LinearAttention(gdn) => gdn.forward(&a, ctx, i, cache),
            };
            x.iter_mut().zip(&mixed).for_each(|(xv, m)| *xv += m);
            // 3. Sparse MoE on the normed stream, residual add.
            let mut m = x.clone();
            rms_norm(&mut m, &layer.post_attention_layernorm, eps, true);
            let moe = layer.mlp.forward(&m);
            x.iter_mut().zip(&moe).for_each(|(xv, m)| *xv += m);
        }
        // 4. Final norm (this is also the hidden the MTP head consumes).
        rms_norm(&mut x, &self.norm, eps, true);
        x
    }

    /// The MTP head over the step's rows: row i is (token `ctx.tokens[i]` = the token at `positions[i] + 1`,
    /// `hidden[i]` = the target's (or the previous draft's) post-norm hidden at `positions[i]`), attending over
    /// the MTP's own KV (cache layer `num_hidden_layers`). Returns `hm` (post `mtp.norm`), `[rows, H]`; the
    /// draft logits are `logits(hm)`.
    pub fn mtp_forward(&self, ctx: &StepCtx, hidden: &[f32], cache: &mut CacheStore) -> Vec<f32> {
        let mtp = self.mtp.as_ref().expect("caller checked has_mtp");
        let (h, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        // 1. u = [norm_e(embed(x)), norm_h(h)] per row.
        let mut e = vec![0.0f32; ctx.num_rows() * h];
        for (row, &tok) in e.chunks_mut(h).zip(&ctx.tokens) {
            self.embed_tokens.row_to_f32(tok as usize, row);
        }
        rms_norm(&mut e, &mtp.pre_fc_norm_embedding, eps, true);
        let mut hn = hidden.to_vec();
        rms_norm(&mut hn, &mtp.pre_fc_norm_hidden, eps, true);
        let u: Vec<f32> = e.chunks(h).zip(hn.chunks(h)).flat_map(|(a, b)| a.iter().chain(b).copied()).collect();
        // 2. z = fc(u): the residual stream of the MTP decoder layer.
        let mut z = linear(&u, &mtp.fc);
        // 3. Full attention over the MTP's own KV, residual add.
        let mut a = z.clone();
        rms_norm(&mut a, &mtp.input_layernorm, eps, true);
        let (k_cache, v_cache) = cache.kv_mut(self.cfg.num_hidden_layers);
        let attn = mtp.self_attn.forward(&a, ctx, &self.rope, k_cache, v_cache);
        z.iter_mut().zip(&attn).for_each(|(zv, d)| *zv += d);
        // 4. Sparse MoE, residual add.
        let mut m = z.clone();
        rms_norm(&mut m, &mtp.post_attention_layernorm, eps, true);
        let moe = mtp.mlp.forward(&m);
        z.iter_mut().zip(&moe).for_each(|(zv, d)| *zv += d);
        // 5. Final MTP norm.
        rms_norm(&mut z, &mtp.norm, eps, true);
        z
    }
}
