//! The CUDA backend: `qwen3_5_moe` on one GPU in BF16, with the custom kernels of `nextn-kernels`.
//!
//! The forward is the CPU model's (`models/qwen3_5_moe.rs`), step for step, on device buffers:
//! activations bf16 `[rows, dim]`, fp32 accumulation inside every kernel, the residual stream kept in
//! bf16 and added by the fused RMSNorm. Caches live on the device: paged K/V per full-attention layer
//! (+ the MTP layer) `[num_blocks, block_size, kv_heads, head_dim]`, GDN conv windows and fp32 recurrent
//! states per slot, and per-sequence snapshot lanes for speculative verify. The engine keeps scheduling,
//! sampling and acceptance on the host: hiddens and the requested logits come back each step.
//!
//! Speculative commit (`commit_lane`) is deferred: the verify step keeps each GDN layer's raw conv input
//! rows of the verifying sequences; the next device call first shifts the accepted rows into the conv
//! windows and copies the accepted snapshot lane into the recurrent state, for all layers at once.
//!
//! Prefix-cache checkpoints are extra state slots past the sequences' (`copy_state` saves and restores
//! them device to device, after applying any pending commit).

use std::sync::Arc;

use half::bf16;
use nextn_kernels::cudarc::driver::{CudaSlice, CudaStream};
use nextn_kernels::gdn::{GdnDims, GdnSeqs, RecurrentInputs};
use nextn_kernels::rope_kv::RopeKvDims;
use nextn_kernels::{Gpu, GpuError, attention, embedding, fill, gdn, linear, moe, norm, rope_kv};

use crate::backend::{Backend, BackendError, CacheGeometry, ModelSource};
use crate::config::{Architecture, LayerType, ModelConfig};
use crate::models::Model;
use crate::models::moe::{Mlp, SparseMoe};
use crate::models::qwen3_5_moe::{Qwen3_5Moe, TokenMixer};
use crate::models::attention::Attention;
use crate::step::StepCtx;
use crate::weights::Tensor;

fn err(e: GpuError) -> BackendError {
    BackendError { backend: "cuda", msg: e.to_string() }
}

fn unsupported(msg: impl Into<String>) -> BackendError {
    BackendError { backend: "cuda", msg: msg.into() }
}

type D<T> = CudaSlice<T>;

/// A torch-Linear weight `[n, k]` on the device.
struct DLinear {
    w: D<bf16>,
    n: usize,
    k: usize,
}

struct DAttn {
    q: DLinear,
    k: DLinear,
    v: DLinear,
    o: DLinear,
    q_norm: D<bf16>,
    k_norm: D<bf16>,
}

struct DGdn {
    qkv: DLinear,
    z: DLinear,
    b: DLinear,
    a: DLinear,
    out: DLinear,
    /// `[conv_dim, K]`.
    conv_w: D<bf16>,
    a_log: D<f32>,
    dt_bias: D<f32>,
    norm: D<bf16>,
}

/// Routed experts as one `[E, 2I, H]` gate_up and one `[E, H, I]` down tensor; the shared expert as a
/// one-expert group of the same layout, so it runs through the same kernels. The router carries the
/// shared expert's sigmoid gate as row E (`[E + 1, H]`): one GEMM gives both.
struct DMoe {
    router: DLinear,
    gate_up: D<bf16>,
    down: D<bf16>,
    experts: usize,
    inter: usize,
    shared_gate_up: D<bf16>,
    shared_down: D<bf16>,
    shared_inter: usize,
}

enum DMixer {
    Attn { attn: DAttn, kv: usize },
    Gdn { gdn: DGdn, idx: usize },
}

struct DLayer {
    ln_in: D<bf16>,
    mixer: DMixer,
    ln_post: D<bf16>,
    moe: DMoe,
}

struct DMtp {
    /// `mtp.fc` split by input half: `z = fc_e · e' + fc_h · h'` (the concat never materialises).
    fc_e: DLinear,
    fc_h: DLinear,
    pre_e: D<bf16>,
    pre_h: D<bf16>,
    ln_in: D<bf16>,
    attn: DAttn,
    ln_post: D<bf16>,
    moe: DMoe,
    norm: D<bf16>,
}

struct DWeights {
    embed: D<bf16>,
    layers: Vec<DLayer>,
    norm: D<bf16>,
    lm_head: DLinear,
    mtp: Option<DMtp>,
}

// ---------------------------------------------------------------------------------------------------------
// Weight upload (from a host model) and device-side dummy weights.

/// Builds device tensors either from host data or as seeded random fills.
struct Uploader<'a> {
    gpu: &'a Gpu,
    seed: u64,
}

impl Uploader<'_> {
    fn bf16_from(&self, host: &[f32]) -> Result<D<bf16>, BackendError> {
        self.gpu.upload_f32_as_bf16(host).map_err(err)
    }
    fn f32_from(&self, host: &[f32]) -> Result<D<f32>, BackendError> {
        self.gpu.upload(host).map_err(err)
    }
    fn tensor(&self, t: &Tensor) -> Result<D<bf16>, BackendError> {
        let bf: Vec<bf16> = t.to_f32_vec().into_iter().map(bf16::from_f32).collect();
        self.gpu.upload(&bf).map_err(err)
    }
    fn linear(&self, t: &Tensor) -> Result<DLinear, BackendError> {
        Ok(DLinear { w: self.tensor(t)?, n: t.rows(), k: t.row_len() })
    }
    /// Random `[n]` bf16, uniform in `offset ± scale`.
    fn random(&mut self, n: usize, scale: f32, offset: f32) -> Result<D<bf16>, BackendError> {
        let mut d = self.gpu.alloc_zeros::<bf16>(n).map_err(err)?;
        self.seed += 1;
        fill::uniform_bf16(self.gpu, &mut d, self.seed, scale, offset).map_err(err)?;
        Ok(d)
    }
    fn random_f32(&mut self, n: usize, scale: f32, offset: f32) -> Result<D<f32>, BackendError> {
        let mut d = self.gpu.alloc_zeros::<f32>(n).map_err(err)?;
        self.seed += 1;
        fill::uniform_f32(self.gpu, &mut d, self.seed, scale, offset).map_err(err)?;
        Ok(d)
    }
    /// A random torch-Linear `[n, k]` with the fan-in scale of the CPU dummy loader.
    fn random_linear(&mut self, n: usize, k: usize) -> Result<DLinear, BackendError> {
        Ok(DLinear { w: self.random(n * k, (3.0 / k as f32).sqrt(), 0.0)?, n, k })
    }
    /// A neutral-ish norm weight: zero-centred norms store offsets around 0.
    fn random_norm(&mut self, n: usize, zero_centred: bool) -> Result<D<bf16>, BackendError> {
        self.random(n, 0.05, if zero_centred { 0.0 } else { 1.0 })
    }

    fn attn(&self, a: &Attention) -> Result<DAttn, BackendError> {
        Ok(DAttn {
            q: self.linear(&a.q_proj)?,
            k: self.linear(&a.k_proj)?,
            v: self.linear(&a.v_proj)?,
            o: self.linear(&a.o_proj)?,
            q_norm: self.bf16_from(&a.q_norm)?,
            k_norm: self.bf16_from(&a.k_norm)?,
        })
    }

    fn random_attn(&mut self, cfg: &ModelConfig) -> Result<DAttn, BackendError> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Ok(DAttn {
            q: self.random_linear(cfg.q_proj_out(), h)?,
            k: self.random_linear(cfg.num_key_value_heads * d, h)?,
            v: self.random_linear(cfg.num_key_value_heads * d, h)?,
            o: self.random_linear(h, cfg.num_attention_heads * d)?,
            q_norm: self.random_norm(d, true)?,
            k_norm: self.random_norm(d, true)?,
        })
    }

    /// `[gate; up]` rows of one SwiGLU MLP, `[2I, H]` as f32.
    fn gate_up_rows(mlp: &Mlp) -> Vec<f32> {
        match &mlp.gate_up {
            Some(gu) => gu.to_f32_vec(),
            None => {
                let mut v = mlp.gate_proj.to_f32_vec();
                v.extend(mlp.up_proj.to_f32_vec());
                v
            }
        }
    }

    fn moe(&self, m: &SparseMoe) -> Result<DMoe, BackendError> {
        let (shared, shared_gate) = m
            .shared_expert
            .as_ref()
            .ok_or_else(|| unsupported("the CUDA backend needs the qwen3_5_moe shared expert"))?;
        let inter = m.experts[0].gate_proj.rows();
        let gate_up: Vec<f32> = m.experts.iter().flat_map(Self::gate_up_rows).collect();
        let down: Vec<f32> = m.experts.iter().flat_map(|e| e.down_proj.to_f32_vec()).collect();
        let mut router = m.gate.to_f32_vec();
        router.extend(shared_gate.to_f32_vec());
        Ok(DMoe {
            router: DLinear { w: self.bf16_from(&router)?, n: m.gate.rows() + 1, k: m.gate.row_len() },
            gate_up: self.bf16_from(&gate_up)?,
            down: self.bf16_from(&down)?,
            experts: m.experts.len(),
            inter,
            shared_gate_up: self.bf16_from(&Self::gate_up_rows(shared))?,
            shared_down: self.tensor(&shared.down_proj)?,
            shared_inter: shared.gate_proj.rows(),
        })
    }

    fn random_moe(&mut self, cfg: &ModelConfig) -> Result<DMoe, BackendError> {
        let (h, e, i, si) =
            (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
        Ok(DMoe {
            router: self.random_linear(e + 1, h)?,
            gate_up: self.random(e * 2 * i * h, (3.0 / h as f32).sqrt(), 0.0)?,
            down: self.random(e * h * i, (3.0 / i as f32).sqrt(), 0.0)?,
            experts: e,
            inter: i,
            shared_gate_up: self.random(2 * si * h, (3.0 / h as f32).sqrt(), 0.0)?,
            shared_down: self.random(h * si, (3.0 / si as f32).sqrt(), 0.0)?,
            shared_inter: si,
        })
    }

    fn upload_model(&self, m: &Qwen3_5Moe) -> Result<DWeights, BackendError> {
        let cfg = &m.cfg;
        let mut layers = Vec::new();
        let (mut n_attn, mut n_gdn) = (0, 0);
        for l in &m.layers {
            let mixer = match &l.mixer {
                TokenMixer::FullAttention(a) => {
                    n_attn += 1;
                    DMixer::Attn { attn: self.attn(a)?, kv: n_attn - 1 }
                }
                TokenMixer::LinearAttention(g) => {
                    n_gdn += 1;
                    DMixer::Gdn {
                        gdn: DGdn {
                            qkv: self.linear(&g.in_proj_qkv)?,
                            z: self.linear(&g.in_proj_z)?,
                            b: self.linear(&g.in_proj_b)?,
                            a: self.linear(&g.in_proj_a)?,
                            out: self.linear(&g.out_proj)?,
                            conv_w: self.bf16_from(&g.conv1d)?,
                            a_log: self.f32_from(&g.a_log)?,
                            dt_bias: self.f32_from(&g.dt_bias)?,
                            norm: self.bf16_from(&g.norm)?,
                        },
                        idx: n_gdn - 1,
                    }
                }
            };
            layers.push(DLayer {
                ln_in: self.bf16_from(&l.input_layernorm)?,
                mixer,
                ln_post: self.bf16_from(&l.post_attention_layernorm)?,
                moe: self.moe(&l.mlp)?,
            });
        }
        let h = cfg.hidden_size;
        let mtp = match &m.mtp {
            None => None,
            Some(t) => {
                let fc = t.fc.to_f32_vec(); // [H, 2H]: columns 0..H see e', H..2H see h'
                let fc_e: Vec<f32> = fc.chunks(2 * h).flat_map(|r| r[..h].to_vec()).collect();
                let fc_h: Vec<f32> = fc.chunks(2 * h).flat_map(|r| r[h..].to_vec()).collect();
                Some(DMtp {
                    fc_e: DLinear { w: self.bf16_from(&fc_e)?, n: h, k: h },
                    fc_h: DLinear { w: self.bf16_from(&fc_h)?, n: h, k: h },
                    pre_e: self.bf16_from(&t.pre_fc_norm_embedding)?,
                    pre_h: self.bf16_from(&t.pre_fc_norm_hidden)?,
                    ln_in: self.bf16_from(&t.input_layernorm)?,
                    attn: self.attn(&t.self_attn)?,
                    ln_post: self.bf16_from(&t.post_attention_layernorm)?,
                    moe: self.moe(&t.mlp)?,
                    norm: self.bf16_from(&t.norm)?,
                })
            }
        };
        Ok(DWeights {
            embed: self.tensor(&m.embed_tokens)?,
            layers,
            norm: self.bf16_from(&m.norm)?,
            lm_head: self.linear(&m.lm_head)?,
            mtp,
        })
    }

    fn dummy(&mut self, cfg: &ModelConfig, with_mtp: bool) -> Result<DWeights, BackendError> {
        let h = cfg.hidden_size;
        let la = cfg.linear_attention.clone().ok_or_else(|| unsupported("qwen3_5_moe config without linear attention"))?;
        let mut layers = Vec::new();
        let (mut n_attn, mut n_gdn) = (0, 0);
        for t in &cfg.layer_types {
            let mixer = match t {
                LayerType::FullAttention => {
                    n_attn += 1;
                    DMixer::Attn { attn: self.random_attn(cfg)?, kv: n_attn - 1 }
                }
                LayerType::LinearAttention => {
                    n_gdn += 1;
                    let hv = la.num_value_heads;
                    DMixer::Gdn {
                        gdn: DGdn {
                            qkv: self.random_linear(la.conv_dim(), h)?,
                            z: self.random_linear(la.value_dim(), h)?,
                            b: self.random_linear(hv, h)?,
                            a: self.random_linear(hv, h)?,
                            out: self.random_linear(h, la.value_dim())?,
                            conv_w: self.random(la.conv_dim() * la.conv_kernel_dim, 0.5, 0.0)?,
                            // A = exp(A_log) in (1, 16), dt_bias ~ 0: decays like a trained model's.
                            a_log: self.random_f32(hv, 1.386, 1.386)?,
                            dt_bias: self.random_f32(hv, 0.5, 0.0)?,
                            norm: self.random_norm(la.value_head_dim, false)?,
                        },
                        idx: n_gdn - 1,
                    }
                }
            };
            layers.push(DLayer {
                ln_in: self.random_norm(h, true)?,
                mixer,
                ln_post: self.random_norm(h, true)?,
                moe: self.random_moe(cfg)?,
            });
        }
        let mtp = if with_mtp {
            Some(DMtp {
                fc_e: self.random_linear(h, h)?,
                fc_h: self.random_linear(h, h)?,
                pre_e: self.random_norm(h, true)?,
                pre_h: self.random_norm(h, true)?,
                ln_in: self.random_norm(h, true)?,
                attn: self.random_attn(cfg)?,
                ln_post: self.random_norm(h, true)?,
                moe: self.random_moe(cfg)?,
                norm: self.random_norm(h, true)?,
            })
        } else {
            None
        };
        Ok(DWeights {
            embed: self.random(cfg.vocab_size * h, 1.0, 0.0)?,
            layers,
            norm: self.random_norm(h, true)?,
            lm_head: self.random_linear(cfg.vocab_size, h)?,
            mtp,
        })
    }
}

// ---------------------------------------------------------------------------------------------------------
// Caches and per-step scratch.

struct Caches {
    /// Per full-attention layer (+ the MTP layer last): K and V `[num_blocks, block_size, kv_heads, hd]`.
    k: Vec<D<bf16>>,
    v: Vec<D<bf16>>,
    /// Per GDN layer: `[num_slots, conv_dim, K-1]` and `[num_slots, HV, dk, dv]`.
    conv: Vec<D<bf16>>,
    state: Vec<D<f32>>,
    /// Per GDN layer: snapshot lanes `[lane_seqs, lanes, HV, dk, dv]`, indexed by the verify batch's
    /// sequence, and the verify rows' raw conv inputs `[lane_seqs · lanes, conv_dim]` (what the deferred
    /// conv commit shifts in). Grown to the largest verify batch seen (`ensure_lanes`), not allocated per
    /// slot: the prefix cache's checkpoint slots never verify.
    lanes: Vec<D<f32>>,
    keep: Vec<D<bf16>>,
    lane_seqs: usize,
}

/// Activation buffers for up to `rows` rows (reallocated when a step has more).
struct Scratch {
    rows: usize,
    x: D<bf16>,
    resid: D<bf16>,
    a: D<bf16>,
    y: D<bf16>,
    // attention
    qg: D<bf16>,
    kk: D<bf16>,
    vv: D<bf16>,
    q: D<bf16>,
    gate: D<bf16>,
    attn: D<bf16>,
    // GDN
    mixed: D<bf16>,
    conv: D<bf16>,
    z: D<bf16>,
    beta: D<bf16>,
    decay: D<bf16>,
    o: D<bf16>,
    on: D<bf16>,
    // MoE
    moe: moe_glue::MoeScratch,
    moe_out: D<bf16>,
}

impl Scratch {
    fn new(gpu: &Gpu, cfg: &ModelConfig, rows: usize) -> Result<Scratch, GpuError> {
        let h = cfg.hidden_size;
        let la = cfg.linear_attention.as_ref().expect("checked: qwen3_5_moe");
        let qd = cfg.num_attention_heads * cfg.head_dim;
        let kvd = cfg.num_key_value_heads * cfg.head_dim;
        let z = |n: usize| gpu.alloc_zeros::<bf16>(rows * n);
        Ok(Scratch {
            rows,
            x: z(h)?,
            resid: z(h)?,
            a: z(h)?,
            y: z(h)?,
            qg: z(cfg.q_proj_out())?,
            kk: z(kvd)?,
            vv: z(kvd)?,
            q: z(qd)?,
            gate: z(qd)?,
            attn: z(qd)?,
            mixed: z(la.conv_dim())?,
            conv: z(la.conv_dim())?,
            z: z(la.value_dim())?,
            beta: z(la.num_value_heads)?,
            decay: z(la.num_value_heads)?,
            o: z(la.value_dim())?,
            on: z(la.value_dim())?,
            moe: moe_glue::MoeScratch::new(gpu, cfg, rows)?,
            moe_out: z(h)?,
        })
    }
}

/// The device copy of one step's [`StepCtx`].
struct StepMeta {
    rows: usize,
    num_seqs: usize,
    tokens: D<i32>,
    positions: D<i32>,
    slot_mapping: D<i64>,
    row_ctx_len: D<i32>,
    seq_row_start: D<i32>,
    block_tables: D<i32>,
    max_blocks: usize,
    max_ctx: usize,
    max_rows_per_seq: usize,
    /// First row of each sequence (host copy).
    seq_rows: Vec<usize>,
    /// Every sequence's slot (the conv reads every window).
    slot_any: D<i32>,
    /// GDN: slots of sequences advanced in place (−1 for verifying ones) and of verifying ones (−1
    /// otherwise); rows each in-place sequence commits into its conv window.
    slot_in_place: D<i32>,
    slot_snapshot: D<i32>,
    accepted_in_place: D<i32>,
    any_snapshot: bool,
}

/// A verify step's sequences, kept until their commits are flushed.
#[derive(Default)]
struct VerifyRecord {
    /// (batch sequence index, slot, first row in the `keep` buffers, rows).
    seqs: Vec<(usize, usize, usize, usize)>,
    /// Accepted lane per slot, filled by `commit_lane`.
    commits: Vec<(usize, usize)>,
}

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    blas: linear::Blas,
    cfg: ModelConfig,
    w: Arc<DWeights>,
    cache: Caches,
    scratch: Scratch,
    geo: CacheGeometry,
    gdn_dims: GdnDims,
    attn_workspace: D<f32>,
    verify: Option<VerifyRecord>,
    /// What the prefix cache's keys are seeded with: config, device weights and where they came from, GPU.
    identity: String,
}

impl CudaBackend {
    pub fn new(ordinal: usize, source: ModelSource, geo: CacheGeometry) -> Result<Self, BackendError> {
        let cfg = source.config().clone();
        if cfg.architecture != Architecture::Qwen3_5Moe {
            return Err(unsupported(format!(
                "{:?} is not supported on CUDA yet (qwen3_5_moe only); use --device cpu",
                cfg.architecture
            )));
        }
        let la = cfg.linear_attention.clone().ok_or_else(|| unsupported("qwen3_5_moe config without linear attention"))?;
        let gpu = Gpu::new(ordinal).map_err(err)?;
        // cuBLAS (prefill GEMMs) loads on first use: decode runs on the custom GEMV alone.
        let blas = linear::Blas::lazy();
        let has_mtp = source.has_mtp();
        let origin = match &source {
            ModelSource::Loaded(m) => format!("{:?} weights as bf16", m.weights_dtype()),
            ModelSource::Dummy { seed, .. } => format!("dummy bf16 weights, seed {seed}"),
        };
        let identity = format!("{cfg:?}|{origin}|cuda {}", gpu.name);
        let w = match &source {
            ModelSource::Loaded(Model::Qwen3_5Moe(m)) => Uploader { gpu: &gpu, seed: 0 }.upload_model(m)?,
            ModelSource::Loaded(_) => unreachable!("architecture checked above"),
            ModelSource::Dummy { cfg, seed } => Uploader { gpu: &gpu, seed: *seed }.dummy(cfg, has_mtp)?,
        };
        drop(source); // host weights are no longer needed
        let gdn_dims = GdnDims {
            num_k_heads: la.num_key_heads,
            num_v_heads: la.num_value_heads,
            head_k_dim: la.key_head_dim,
            head_v_dim: la.value_head_dim,
        };
        let n_attn = cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count() + usize::from(has_mtp);
        let n_gdn = cfg.num_hidden_layers - cfg.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count();
        let kv_len = geo.num_blocks * geo.block_size * cfg.num_key_value_heads * cfg.head_dim;
        let alloc_bf = |n: usize| gpu.alloc_zeros::<bf16>(n).map_err(err);
        let alloc_f = |n: usize| gpu.alloc_zeros::<f32>(n).map_err(err);
        let cache = Caches {
            k: (0..n_attn).map(|_| alloc_bf(kv_len)).collect::<Result<_, _>>()?,
            v: (0..n_attn).map(|_| alloc_bf(kv_len)).collect::<Result<_, _>>()?,
            conv: (0..n_gdn).map(|_| alloc_bf(geo.num_slots * gdn_dims.conv_state_len())).collect::<Result<_, _>>()?,
            state: (0..n_gdn).map(|_| alloc_f(geo.num_slots * gdn_dims.state_len())).collect::<Result<_, _>>()?,
            lanes: Vec::new(),
            keep: Vec::new(),
            lane_seqs: 0,
        };
        let scratch = Scratch::new(&gpu, &cfg, 64).map_err(err)?;
        let attn_workspace = gpu.alloc_zeros::<f32>(1).map_err(err)?;
        Ok(CudaBackend {
            gpu,
            blas,
            cfg,
            w: Arc::new(w),
            cache,
            scratch,
            geo,
            gdn_dims,
            attn_workspace,
            verify: None,
            identity,
        })
    }

    fn ensure_rows(&mut self, rows: usize) -> Result<(), BackendError> {
        if rows > self.scratch.rows {
            let rows = rows.next_power_of_two();
            self.scratch = Scratch::new(&self.gpu, &self.cfg, rows).map_err(err)?;
        }
        Ok(())
    }

    fn upload_meta(&self, ctx: &StepCtx) -> Result<StepMeta, BackendError> {
        let g = &self.gpu;
        let up_i32 = |v: Vec<i32>| g.upload(&if v.is_empty() { vec![0] } else { v }).map_err(err);
        let rows = ctx.num_rows();
        let num_seqs = ctx.seqs.len();
        let max_blocks = ctx.seqs.iter().map(|s| s.block_table.len()).max().unwrap_or(1).max(1);
        let mut tables = vec![0i32; num_seqs * max_blocks];
        for (s, seq) in ctx.seqs.iter().enumerate() {
            for (j, &b) in seq.block_table.iter().enumerate() {
                tables[s * max_blocks + j] = b as i32;
            }
        }
        let mut seq_row_start: Vec<i32> = ctx.seqs.iter().map(|s| s.rows.start as i32).collect();
        seq_row_start.push(rows as i32);
        let snap = |s: &crate::step::StepSeq| s.snapshot && self.geo.lanes > 0;
        Ok(StepMeta {
            rows,
            num_seqs,
            tokens: up_i32(ctx.tokens.iter().map(|&t| t as i32).collect())?,
            positions: up_i32(ctx.positions.iter().map(|&p| p as i32).collect())?,
            slot_mapping: g.upload(&ctx.slot_mapping.iter().map(|&s| s as i64).collect::<Vec<_>>()).map_err(err)?,
            row_ctx_len: up_i32(ctx.positions.iter().map(|&p| p as i32 + 1).collect())?,
            seq_row_start: up_i32(seq_row_start)?,
            block_tables: up_i32(tables)?,
            max_blocks,
            max_ctx: ctx.positions.iter().max().map_or(1, |p| p + 1),
            max_rows_per_seq: ctx.seqs.iter().map(|s| s.rows.len()).max().unwrap_or(1).max(1),
            seq_rows: ctx.seqs.iter().map(|s| s.rows.start).collect(),
            slot_any: up_i32(ctx.seqs.iter().map(|s| s.state_slot as i32).collect())?,
            slot_in_place: up_i32(ctx.seqs.iter().map(|s| if snap(s) { -1 } else { s.state_slot as i32 }).collect())?,
            slot_snapshot: up_i32(ctx.seqs.iter().map(|s| if snap(s) { s.state_slot as i32 } else { -1 }).collect())?,
            accepted_in_place: up_i32(ctx.seqs.iter().map(|s| if snap(s) { 0 } else { s.rows.len() as i32 }).collect())?,
            any_snapshot: ctx.seqs.iter().any(snap),
        })
    }

    /// Room in the snapshot lanes and kept conv rows for a verify batch of `num_seqs` sequences (call with
    /// no commit pending: growing drops their contents).
    fn ensure_lanes(&mut self, num_seqs: usize) -> Result<(), BackendError> {
        if self.geo.lanes == 0 || num_seqs <= self.cache.lane_seqs {
            return Ok(());
        }
        let (n_gdn, lanes) = (self.cache.state.len(), self.geo.lanes);
        let (sl, cd) = (self.gdn_dims.state_len(), self.gdn_dims.conv_dim());
        // Free the old buffers first; on failure nothing is left and the next verify tries again.
        self.cache.lane_seqs = 0;
        self.cache.lanes.clear();
        self.cache.keep.clear();
        let g = &self.gpu;
        let lane_buf = |_| g.alloc_zeros::<f32>(num_seqs * lanes * sl);
        self.cache.lanes = (0..n_gdn).map(lane_buf).collect::<Result<_, _>>().map_err(err)?;
        let keep_buf = |_| g.alloc_zeros::<bf16>(num_seqs * lanes * cd);
        self.cache.keep = (0..n_gdn).map(keep_buf).collect::<Result<_, _>>().map_err(err)?;
        self.cache.lane_seqs = num_seqs;
        Ok(())
    }

    /// Apply the accepted lanes of the last verify to every GDN layer's conv window and state.
    fn flush_commits(&mut self) -> Result<(), BackendError> {
        let Some(rec) = self.verify.take() else { return Ok(()) };
        if rec.commits.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let lanes = self.geo.lanes.max(1);
        // Conv windows: the kept rows of the verifying sequences, compact, `accepted = lane + 1`.
        let mut keep_start: Vec<i32> = rec.seqs.iter().map(|&(_, _, start, _)| start as i32).collect();
        keep_start.push(rec.seqs.last().map_or(0, |&(_, _, start, rows)| (start + rows) as i32));
        let lane_of = |slot: usize| rec.commits.iter().rev().find(|(s, _)| *s == slot).map(|&(_, l)| l);
        let keep_slots: Vec<i32> = rec.seqs.iter().map(|&(_, slot, _, _)| if lane_of(slot).is_some() { slot as i32 } else { -1 }).collect();
        let accepted: Vec<i32> = rec.seqs.iter().map(|&(_, slot, _, _)| lane_of(slot).map_or(0, |l| l as i32 + 1)).collect();
        // Lanes: indexed by the verify batch's sequence index.
        let batch_seqs = rec.seqs.iter().map(|&(s, ..)| s + 1).max().unwrap_or(0);
        let mut lane_slot = vec![-1i32; batch_seqs];
        let mut lane = vec![-1i32; batch_seqs];
        for &(s, slot, _, _) in &rec.seqs {
            if let Some(l) = lane_of(slot) {
                lane_slot[s] = slot as i32;
                lane[s] = l as i32;
            }
        }
        let d_keep_start = g.upload(&keep_start).map_err(err)?;
        let d_keep_slots = g.upload(&keep_slots).map_err(err)?;
        let d_accepted = g.upload(&accepted).map_err(err)?;
        let d_lane_rows = g.upload(&vec![0i32; batch_seqs + 1]).map_err(err)?;
        let d_lane_slot = g.upload(&lane_slot).map_err(err)?;
        let d_lane = g.upload(&lane).map_err(err)?;
        let keep_seqs = GdnSeqs {
            rows: *keep_start.last().unwrap() as usize,
            num_seqs: rec.seqs.len(),
            seq_row_start: &d_keep_start,
            seq_slot: &d_keep_slots,
        };
        let lane_seqs = GdnSeqs { rows: 0, num_seqs: batch_seqs, seq_row_start: &d_lane_rows, seq_slot: &d_lane_slot };
        for l in 0..self.cache.conv.len() {
            gdn::conv_commit(g, &self.gdn_dims, &keep_seqs, &self.cache.keep[l], &d_accepted, &mut self.cache.conv[l])
                .map_err(err)?;
            gdn::commit_lane(g, &self.gdn_dims, &lane_seqs, &d_lane, &self.cache.lanes[l], lanes, &mut self.cache.state[l])
                .map_err(err)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------
// The forward.

/// `y[rows, n] = x[rows, k] · wᵀ` (bf16 out).
fn lin(gpu: &Gpu, blas: &linear::Blas, x: &D<bf16>, w: &DLinear, y: &mut D<bf16>, rows: usize) -> Result<(), GpuError> {
    linear::linear(gpu, blas, x, &w.w, y, rows, w.n, w.k)
}

/// `y[rows, n] = x[rows, k] · wᵀ` (f32 out: router and LM-head logits).
fn lin_f32(gpu: &Gpu, blas: &linear::Blas, x: &D<bf16>, w: &DLinear, y: &mut D<f32>, rows: usize) -> Result<(), GpuError> {
    linear::linear_f32out(gpu, blas, x, &w.w, y, rows, w.n, w.k)
}

mod moe_glue {
    use super::*;
    use nextn_kernels::moe::{MoeDims, MoeRouting, SharedExpert};

    /// Per-step MoE buffers for up to `rows` tokens.
    pub struct MoeScratch {
        route: MoeRouting,
        /// The shared expert as a one-expert routing (every token → expert 0). It depends only on the
        /// number of rows, so it is built once per row count, not once per layer.
        shared_route: MoeRouting,
        shared_route_rows: Option<usize>,
        logits: D<f32>,
        h: D<bf16>,
        expert_out: D<bf16>,
        shared_h: D<bf16>,
        shared_out: D<bf16>,
    }

    impl MoeScratch {
        pub fn new(gpu: &Gpu, cfg: &ModelConfig, rows: usize) -> Result<Self, GpuError> {
            let (h, e, k) = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok);
            Ok(MoeScratch {
                route: MoeRouting::new(gpu, rows, e, k)?,
                shared_route: MoeRouting::new(gpu, rows, 1, 1)?,
                shared_route_rows: None,
                logits: gpu.alloc_zeros(rows * (e + 1))?,
                h: gpu.alloc_zeros(rows * k * cfg.moe_intermediate_size)?,
                expert_out: gpu.alloc_zeros(rows * k * h)?,
                shared_h: gpu.alloc_zeros(rows * cfg.shared_expert_intermediate_size.max(1))?,
                shared_out: gpu.alloc_zeros(rows * h)?,
            })
        }
    }

    /// `out = Σ_top-k w_e · SwiGLU_e(x) + σ(x · g_shared) · SwiGLU_shared(x)` for `rows` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        gpu: &Gpu,
        blas: &linear::Blas,
        m: &DMoe,
        top_k: usize,
        x: &D<bf16>,
        s: &mut MoeScratch,
        out: &mut D<bf16>,
        rows: usize,
    ) -> Result<(), GpuError> {
        let hidden = m.router.k;
        // Router logits and the shared gate logit in one GEMM: [rows, E + 1] f32.
        lin_f32(gpu, blas, x, &m.router, &mut s.logits, rows)?;
        moe::moe_topk(gpu, &s.logits, m.experts + 1, &mut s.route, rows, true)?;
        moe::moe_group(gpu, &mut s.route, rows)?;
        let d = MoeDims { tokens: rows, hidden, inter: m.inter, experts: m.experts, top_k };
        moe::moe_experts(gpu, x, &m.gate_up, &m.down, &s.route, &mut s.h, &mut s.expert_out, &d)?;
        // The shared expert: a one-expert routing (softmax over one logit = weight 1; its gate is applied
        // by the combine), the same for every layer of a step.
        if s.shared_route_rows != Some(rows) {
            moe::moe_topk(gpu, &s.logits, m.experts + 1, &mut s.shared_route, rows, true)?;
            moe::moe_group(gpu, &mut s.shared_route, rows)?;
            s.shared_route_rows = Some(rows);
        }
        let ds = MoeDims { tokens: rows, hidden, inter: m.shared_inter, experts: 1, top_k: 1 };
        moe::moe_experts(gpu, x, &m.shared_gate_up, &m.shared_down, &s.shared_route, &mut s.shared_h, &mut s.shared_out, &ds)?;
        let shared = SharedExpert { out: &s.shared_out, gate_logits: &s.logits, gate_offset: m.experts, gate_ld: m.experts + 1 };
        moe::moe_combine(gpu, &s.expert_out, &s.route.topk_w, Some(shared), out, rows, hidden, top_k)
    }
}

impl CudaBackend {
    /// Gated full attention of the normed `scratch.a` into `scratch.y`, KV layer `kv`.
    fn attention(&mut self, attn: &DAttn, kv: usize, meta: &StepMeta) -> Result<(), GpuError> {
        let (g, b, s, rows) = (&*self.gpu, &self.blas, &mut self.scratch, meta.rows);
        let c = &self.cfg;
        lin(g, b, &s.a, &attn.q, &mut s.qg, rows)?;
        lin(g, b, &s.a, &attn.k, &mut s.kk, rows)?;
        lin(g, b, &s.a, &attn.v, &mut s.vv, rows)?;
        let rd = RopeKvDims {
            tokens: rows,
            q_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            rotary_dim: c.rotary_dim(),
            gated: c.attn_output_gate,
            zero_centred: true,
            eps: c.rms_norm_eps,
            rope_theta: c.rope_theta as f32,
            num_blocks: self.geo.num_blocks,
            block_size: self.geo.block_size,
        };
        let gate = if c.attn_output_gate { Some(&mut s.gate) } else { None };
        rope_kv::qk_norm_rope_kv(
            g, &rd, &s.qg, &s.kk, &s.vv, &attn.q_norm, &attn.k_norm, &meta.positions, &meta.slot_mapping,
            &mut s.q, gate, &mut self.cache.k[kv], &mut self.cache.v[kv],
        )?;
        let ad = attention::AttnDims {
            num_seqs: meta.num_seqs,
            rows,
            max_rows_per_seq: meta.max_rows_per_seq,
            max_ctx_len: meta.max_ctx,
            q_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            num_blocks: self.geo.num_blocks,
            block_size: self.geo.block_size,
            max_blocks_per_seq: meta.max_blocks,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let gate = if c.attn_output_gate { Some(&s.gate) } else { None };
        attention::paged_attention(
            g, &ad, &s.q, gate, &self.cache.k[kv], &self.cache.v[kv], &meta.block_tables, &meta.seq_row_start,
            &meta.row_ctx_len, &mut self.attn_workspace, &mut s.attn,
        )?;
        lin(g, b, &s.attn, &attn.o, &mut s.y, rows)
    }

    /// Gated DeltaNet of the normed `scratch.a` into `scratch.y`, state index `idx`.
    fn gdn(&mut self, w: &DGdn, idx: usize, meta: &StepMeta, record: Option<&VerifyRecord>) -> Result<(), GpuError> {
        let (g, b, s, rows) = (&*self.gpu, &self.blas, &mut self.scratch, meta.rows);
        let dims = self.gdn_dims;
        lin(g, b, &s.a, &w.qkv, &mut s.mixed, rows)?;
        lin(g, b, &s.a, &w.z, &mut s.z, rows)?;
        lin(g, b, &s.a, &w.b, &mut s.beta, rows)?;
        lin(g, b, &s.a, &w.a, &mut s.decay, rows)?;
        let all = GdnSeqs { rows, num_seqs: meta.num_seqs, seq_row_start: &meta.seq_row_start, seq_slot: &meta.slot_in_place };
        // The conv reads each sequence's window (slot only: lanes are by row). In-place sequences shift
        // their rows in now; verifying ones keep theirs for the deferred commit.
        let read = GdnSeqs { seq_slot: &meta.slot_any, ..all };
        gdn::conv(g, &dims, &read, &s.mixed, &w.conv_w, &self.cache.conv[idx], &mut s.conv)?;
        gdn::conv_commit(g, &dims, &all, &s.mixed, &meta.accepted_in_place, &mut self.cache.conv[idx])?;
        let inp = RecurrentInputs { c: &s.conv, b: &s.beta, a: &s.decay, a_log: &w.a_log, dt_bias: &w.dt_bias };
        gdn::recurrent(g, &dims, &all, &inp, &mut self.cache.state[idx], &mut s.o)?;
        if meta.any_snapshot {
            let snap = GdnSeqs { seq_slot: &meta.slot_snapshot, ..all };
            let lanes = self.geo.lanes.max(1);
            gdn::recurrent_lanes(g, &dims, &snap, &inp, &self.cache.state[idx], &mut self.cache.lanes[idx], lanes, &mut s.o)?;
            // Keep the verifying rows' raw conv inputs for the commit.
            if let Some(rec) = record.as_ref() {
                let cd = dims.conv_dim();
                for &(s_idx, _, keep_start, n) in &rec.seqs {
                    let row0 = meta.seq_rows[s_idx];
                    let src = s.mixed.slice(row0 * cd..(row0 + n) * cd);
                    let mut dst = self.cache.keep[idx].slice_mut(keep_start * cd..(keep_start + n) * cd);
                    g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| GpuError::Driver { what: "keep copy".into(), msg: format!("{e:?}") })?;
                }
            }
        }
        norm::rmsnorm_gated(g, &s.o, &s.z, &w.norm, &mut s.on, rows * dims.num_v_heads, dims.head_v_dim, self.cfg.rms_norm_eps)?;
        lin(g, b, &s.on, &w.out, &mut s.y, rows)
    }
}

fn drv(what: &'static str) -> impl FnOnce(nextn_kernels::cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver { what: what.into(), msg: format!("{e:?}") }
}

impl CudaBackend {
    /// Split-KV workspace: enough for decode/verify-sized row counts (prefill uses fewer splits).
    fn ensure_workspace(&mut self, rows: usize) -> Result<(), GpuError> {
        let c = &self.cfg;
        let want = attention::workspace_len(rows.min(64), c.num_attention_heads, c.head_dim);
        if self.attn_workspace.len() < want {
            self.attn_workspace = self.gpu.alloc_zeros(want)?;
        }
        Ok(())
    }

    /// Decoder layers over `meta`'s rows; `scratch.x` holds the embeddings on entry and the final-normed
    /// hiddens on exit.
    fn decoder(&mut self, meta: &StepMeta, record: Option<&VerifyRecord>) -> Result<(), GpuError> {
        let w = self.w.clone();
        let (rows, h, eps) = (meta.rows, self.cfg.hidden_size, self.cfg.rms_norm_eps);
        self.gpu.stream.memset_zeros(&mut self.scratch.resid).map_err(drv("memset"))?;
        for (i, layer) in w.layers.iter().enumerate() {
            // resid += delta (the embedding, then each layer's MoE output); a = norm(resid).
            {
                let s = &mut self.scratch;
                let delta = if i == 0 { &s.x } else { &s.moe_out };
                norm::rmsnorm(&self.gpu, delta, Some(&mut s.resid), &layer.ln_in, &mut s.a, rows, h, eps, true)?;
            }
            match &layer.mixer {
                DMixer::Attn { attn, kv } => self.attention(attn, *kv, meta)?,
                DMixer::Gdn { gdn, idx } => self.gdn(gdn, *idx, meta, record)?,
            }
            let s = &mut self.scratch;
            norm::rmsnorm(&self.gpu, &s.y, Some(&mut s.resid), &layer.ln_post, &mut s.a, rows, h, eps, true)?;
            moe_glue::forward(&self.gpu, &self.blas, &layer.moe, self.cfg.num_experts_per_tok, &s.a, &mut s.moe, &mut s.moe_out, rows)?;
        }
        let s = &mut self.scratch;
        norm::rmsnorm(&self.gpu, &s.moe_out, Some(&mut s.resid), &w.norm, &mut s.x, rows, h, eps, true)
    }

    /// Rows `rows` of the bf16 `[*, H]` buffer `src` → f32 logits `[rows.len(), vocab]` on the host.
    fn lm_head(&mut self, src_is_x: bool, rows: &[usize]) -> Result<Vec<f32>, GpuError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let (g, h, v) = (&*self.gpu, self.cfg.hidden_size, self.cfg.vocab_size);
        let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let d_ids = g.upload(&ids)?;
        let s = &mut self.scratch;
        let src = if src_is_x { &s.x } else { &s.y };
        let total_rows = s.rows;
        // Gather the wanted rows into `a`, then one GEMM against the LM head.
        embedding::gather(g, src, &d_ids, &mut s.a, rows.len(), total_rows, h)?;
        let mut logits = g.alloc_zeros::<f32>(rows.len() * v)?;
        lin_f32(g, &self.blas, &s.a, &self.w.lm_head, &mut logits, rows.len())?;
        g.stream.clone_dtoh(&logits).map_err(drv("logits download"))
    }

    fn hidden_to_host(&self, rows: usize) -> Result<Vec<f32>, GpuError> {
        let n = rows * self.cfg.hidden_size;
        let v: Vec<bf16> = self.gpu.stream.clone_dtoh(&self.scratch.x.slice(0..n)).map_err(drv("hidden download"))?;
        Ok(v.into_iter().map(|x| x.to_f32()).collect())
    }

    fn embed(&mut self, meta: &StepMeta) -> Result<(), GpuError> {
        let (g, h, v) = (&*self.gpu, self.cfg.hidden_size, self.cfg.vocab_size);
        embedding::gather(g, &self.w.embed, &meta.tokens, &mut self.scratch.x, meta.rows, v, h)
    }

    fn execute_inner(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.flush_commits()?;
        let rows = ctx.num_rows();
        self.ensure_rows(rows)?;
        self.ensure_workspace(rows).map_err(err)?;
        let meta = self.upload_meta(ctx)?;
        let record = if meta.any_snapshot {
            self.ensure_lanes(meta.num_seqs)?;
            let mut rec = VerifyRecord::default();
            let mut keep = 0;
            for (s, seq) in ctx.seqs.iter().enumerate().filter(|(_, s)| s.snapshot) {
                rec.seqs.push((s, seq.state_slot, keep, seq.rows.len()));
                keep += seq.rows.len();
            }
            let cap = self.cache.lane_seqs * self.geo.lanes;
            if keep > cap {
                let why = format!("{keep} verify rows exceed the {cap} snapshot lanes (batch sequences × lanes)");
                return Err(unsupported(why));
            }
            Some(rec)
        } else {
            None
        };
        self.embed(&meta).map_err(err)?;
        self.decoder(&meta, record.as_ref()).map_err(err)?;
        let hidden = self.hidden_to_host(rows).map_err(err)?;
        let logits = self.lm_head(true, &ctx.logits_rows).map_err(err)?;
        self.verify = record;
        Ok((hidden, logits))
    }

    fn mtp_inner(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        let w = self.w.clone();
        let mtp = w.mtp.as_ref().ok_or_else(|| unsupported("this model has no MTP head"))?;
        self.flush_commits()?;
        let rows = ctx.num_rows();
        let h = self.cfg.hidden_size;
        if hidden.len() != rows * h {
            return Err(unsupported(format!("MTP input hidden has {} values, expected rows × hidden = {}", hidden.len(), rows * h)));
        }
        self.ensure_rows(rows)?;
        self.ensure_workspace(rows).map_err(err)?;
        let meta = self.upload_meta(ctx)?;
        let kv = self.cache.k.len() - 1; // the MTP layer's KV is the last
        let eps = self.cfg.rms_norm_eps;
        let run = |this: &mut Self| -> Result<(), GpuError> {
            let g = this.gpu.clone();
            let hb: Vec<bf16> = hidden.iter().map(|&x| bf16::from_f32(x)).collect();
            g.stream.memcpy_htod(&hb, &mut this.scratch.y.slice_mut(0..rows * h)).map_err(drv("hidden upload"))?;
            this.embed(&meta)?;
            let s = &mut this.scratch;
            // z = fc_e · norm_e(embed) + fc_h · norm_h(hidden): z1 into moe_out, z2 into resid.
            norm::rmsnorm(&g, &s.x, None, &mtp.pre_e, &mut s.a, rows, h, eps, true)?;
            lin(&g, &this.blas, &s.a, &mtp.fc_e, &mut s.moe_out, rows)?;
            norm::rmsnorm(&g, &s.y, None, &mtp.pre_h, &mut s.a, rows, h, eps, true)?;
            lin(&g, &this.blas, &s.a, &mtp.fc_h, &mut s.resid, rows)?;
            norm::rmsnorm(&g, &s.moe_out, Some(&mut s.resid), &mtp.ln_in, &mut s.a, rows, h, eps, true)?;
            this.attention(&mtp.attn, kv, &meta)?;
            let s = &mut this.scratch;
            norm::rmsnorm(&g, &s.y, Some(&mut s.resid), &mtp.ln_post, &mut s.a, rows, h, eps, true)?;
            moe_glue::forward(&g, &this.blas, &mtp.moe, this.cfg.num_experts_per_tok, &s.a, &mut s.moe, &mut s.moe_out, rows)?;
            norm::rmsnorm(&g, &s.moe_out, Some(&mut s.resid), &mtp.norm, &mut s.x, rows, h, eps, true)
        };
        run(self).map_err(err)?;
        self.hidden_to_host(rows).map_err(err)
    }

    fn logits_inner(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        let h = self.cfg.hidden_size;
        let n = hidden.len() / h;
        if !hidden.len().is_multiple_of(h) || rows.iter().any(|&r| r >= n) {
            return Err(unsupported(format!("logits_of: rows {rows:?} outside the {n} hidden rows given")));
        }
        self.ensure_rows(n)?;
        let hb: Vec<bf16> = hidden.iter().map(|&x| bf16::from_f32(x)).collect();
        let g = self.gpu.clone();
        g.stream.memcpy_htod(&hb, &mut self.scratch.y.slice_mut(0..n * h)).map_err(|e| err(drv("hidden upload")(e)))?;
        self.lm_head(false, rows).map_err(err)
    }

    fn reset_inner(&mut self, slot: usize) -> Result<(), BackendError> {
        self.flush_commits()?;
        let (cl, sl) = (self.gdn_dims.conv_state_len(), self.gdn_dims.state_len());
        let stream = self.gpu.stream.clone();
        for c in &mut self.cache.conv {
            stream.memset_zeros(&mut c.slice_mut(slot * cl..(slot + 1) * cl)).map_err(|e| err(drv("memset")(e)))?;
        }
        for st in &mut self.cache.state {
            stream.memset_zeros(&mut st.slice_mut(slot * sl..(slot + 1) * sl)).map_err(|e| err(drv("memset")(e)))?;
        }
        Ok(())
    }

    /// Slot `src`'s GDN state (every layer's conv window and recurrent state) onto slot `dst`, device to
    /// device on the stream. A pending speculative commit is applied first: on `src` its state is not
    /// final before it; on `dst` it would overwrite the copy at the next forward.
    fn copy_state_inner(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        let n = self.geo.num_slots;
        for (which, slot) in [("source", src), ("destination", dst)] {
            if slot >= n {
                return Err(unsupported(format!(
                    "copy_state: {which} state slot {slot} is out of range: this backend has {n} slots \
                     (sequences + prefix-cache checkpoints)"
                )));
            }
        }
        self.flush_commits()?;
        if src == dst {
            return Ok(());
        }
        let (cl, sl) = (self.gdn_dims.conv_state_len(), self.gdn_dims.state_len());
        let stream = self.gpu.stream.clone();
        for c in &mut self.cache.conv {
            copy_chunk(&stream, c, cl, src, dst).map_err(|e| err(drv("conv state copy")(e)))?;
        }
        for st in &mut self.cache.state {
            copy_chunk(&stream, st, sl, src, dst).map_err(|e| err(drv("recurrent state copy")(e)))?;
        }
        Ok(())
    }
}

/// Chunk `src` of `buf` (elements `src·n..(src + 1)·n`) onto chunk `dst` (`src ≠ dst`), device to device.
fn copy_chunk<T>(
    stream: &Arc<CudaStream>,
    buf: &mut D<T>,
    n: usize,
    src: usize,
    dst: usize,
) -> Result<(), nextn_kernels::cudarc::driver::DriverError> {
    // Two disjoint views of one buffer: split at the higher chunk.
    let (lo, hi) = (src.min(dst), src.max(dst));
    let (mut below, mut above) = buf.split_at_mut(hi * n);
    let mut lo_view = below.slice_mut(lo * n..(lo + 1) * n);
    let mut hi_view = above.slice_mut(0..n);
    if src < dst { stream.memcpy_dtod(&lo_view, &mut hi_view) } else { stream.memcpy_dtod(&hi_view, &mut lo_view) }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn has_mtp(&self) -> bool {
        self.w.mtp.is_some()
    }
    fn reset_slot(&mut self, slot: usize) {
        // The trait has no error path here; a failure resurfaces on the next forward (same stream).
        if let Err(e) = self.reset_inner(slot) {
            tracing::error!("cuda reset_slot({slot}): {e}");
        }
    }
    fn commit_lane(&mut self, slot: usize, lane: usize) {
        if let Some(rec) = self.verify.as_mut() {
            rec.commits.push((slot, lane));
        }
    }
    fn model_identity(&self) -> String {
        self.identity.clone()
    }
    fn supports_state_copy(&self) -> bool {
        true
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), BackendError> {
        self.copy_state_inner(src, dst)
    }
    fn execute(&mut self, ctx: &StepCtx) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.execute_inner(ctx)
    }
    fn mtp_forward(&mut self, ctx: &StepCtx, hidden: &[f32]) -> Result<Vec<f32>, BackendError> {
        self.mtp_inner(ctx, hidden)
    }
    fn logits_of(&mut self, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>, BackendError> {
        self.logits_inner(hidden, rows)
    }
    fn device_name(&self) -> String {
        self.gpu.name.clone()
    }
    fn copy_bandwidth_gbs(&mut self) -> Result<Option<f64>, BackendError> {
        let g = &self.gpu;
        let n = 1usize << 30;
        let src = g.alloc_zeros::<u8>(n).map_err(err)?;
        let mut dst = g.alloc_zeros::<u8>(n).map_err(err)?;
        let copy = |dst: &mut D<u8>| g.stream.memcpy_dtod(&src, dst).map_err(|e| err(drv("memcpy")(e)));
        copy(&mut dst)?;
        g.synchronize().map_err(err)?;
        let iters = 10;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            copy(&mut dst)?;
        }
        g.synchronize().map_err(err)?;
        Ok(Some(2.0 * (n * iters) as f64 / t.elapsed().as_secs_f64() / 1e9))
    }
}

/// The name of CUDA device `ordinal`, or why there is none (for tests that skip without a GPU).
pub fn probe(ordinal: usize) -> Result<String, GpuError> {
    Gpu::new(ordinal).map(|g| g.name.clone())
}
