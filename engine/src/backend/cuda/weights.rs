//! Weights on the device: the [`Device`] family and [`DeviceLoader`], the architectures' load tables run
//! against a checkpoint (each tensor uploaded in bf16 as the table names it) or against nothing (seeded
//! random fills on the device for `--load-format dummy`, so a full-size model needs no host memory).

use std::sync::Arc;

use half::bf16;
use nextn_kernels::cudarc::driver::CudaSlice;
use nextn_kernels::fill::{self, Uniform};
use nextn_kernels::{Gpu, GpuError};

use crate::models::ops::{Family, Load};
use crate::weights::{DType, Tensor, WeightLoader};

/// Weights in device memory, bf16.
pub struct Device;

impl Family for Device {
    type Mat = Arc<DMat>;
    type Vec = DVec;
    type Experts = DExperts;
}

/// A matrix `[rows, cols]` (a linear layer's `[out, in]`, an embedding, the LM head).
pub struct DMat {
    pub w: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

/// A small vector in both precisions: the norm kernels read bf16 weights, the GDN gates f32 parameters
/// (a few KB per layer either way).
pub struct DVec {
    pub bf16: CudaSlice<bf16>,
    pub f32: CudaSlice<f32>,
    pub len: usize,
}

/// The routed experts of one MoE block, stacked: `gate_up` `[E, 2I, H]` (each expert's gate rows, then its
/// up rows) and `down` `[E, H, I]`, the layout the grouped expert kernels read.
pub struct DExperts {
    pub gate_up: CudaSlice<bf16>,
    pub down: CudaSlice<bf16>,
    pub count: usize,
    pub inter: usize,
    pub hidden: usize,
}

/// Where the device weights come from.
pub enum DeviceSource<'a> {
    /// A checkpoint: tensors read (mmap) and converted to bf16 one at a time.
    Checkpoint(WeightLoader<'a>),
    /// Seeded random values of the shapes the load table asks for (the released layout, with `mtp.*` when
    /// `mtp`); norms near neutral, GDN decays like a trained model's.
    Dummy { seed: u64, zero_centred_norms: bool, mtp: bool },
}

/// Runs a load table into device memory. A driver failure stops further uploads and is reported by
/// [`DeviceLoader::finish`] together with the checkpoint's own problems.
pub struct DeviceLoader<'a> {
    gpu: &'a Gpu,
    source: DeviceSource<'a>,
    fills: u64,
    error: Option<GpuError>,
}

/// What went wrong while loading device weights.
#[derive(Debug, thiserror::Error)]
pub enum DeviceLoadError {
    #[error(transparent)]
    Checkpoint(#[from] crate::error::LoadError),
    #[error("uploading weights: {0}")]
    Gpu(#[from] GpuError),
}

impl<'a> DeviceLoader<'a> {
    pub fn new(gpu: &'a Gpu, source: DeviceSource<'a>) -> Self {
        DeviceLoader { gpu, source, fills: 0, error: None }
    }

    /// Every problem of the load: missing or mis-shaped tensors first, then the first device error.
    pub fn finish(self) -> Result<(), DeviceLoadError> {
        if let DeviceSource::Checkpoint(w) = self.source {
            w.finish()?;
        }
        match self.error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// `f`'s buffer, or (after the first failure) an empty one: the load table runs to its end either way
    /// and the failure is reported once.
    fn device<T: nextn_kernels::cudarc::driver::DeviceRepr + nextn_kernels::cudarc::driver::ValidAsZeroBits>(
        &mut self,
        f: impl FnOnce(&Gpu) -> Result<CudaSlice<T>, GpuError>,
    ) -> CudaSlice<T> {
        if self.error.is_none() {
            match f(self.gpu) {
                Ok(d) => return d,
                Err(e) => self.error = Some(e),
            }
        }
        self.gpu.alloc_zeros(1).expect("a one-element allocation after a device error")
    }

    /// Seeded uniform `offset ± scale`, `n` values, bf16.
    fn random(&mut self, n: usize, scale: f32, offset: f32) -> CudaSlice<bf16> {
        self.fills += 1;
        let seed = match self.source {
            DeviceSource::Dummy { seed, .. } => seed ^ self.fills.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            DeviceSource::Checkpoint(_) => self.fills,
        };
        self.device(|g| {
            let mut d = g.alloc_zeros::<bf16>(n)?;
            fill::uniform_bf16(g, &mut d, Uniform { seed, scale, offset })?;
            Ok(d)
        })
    }

    /// Converted inside the closure: after a device error the rest of the checkpoint is not converted (minutes of
    /// a large one) before the error is reported.
    fn upload_tensor(&mut self, t: &Tensor) -> CudaSlice<bf16> {
        self.device(|g| g.upload(&tensor_bf16(t)))
    }
}

/// A tensor's values as bf16 (bf16 checkpoints as stored, others rounded).
fn tensor_bf16(t: &Tensor) -> Vec<bf16> {
    match t.dtype() {
        DType::BF16 => t.bytes().chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect(),
        _ => t.to_f32_vec().into_iter().map(bf16::from_f32).collect(),
    }
}

/// Dummy value range `(scale, offset)` of a 1-D tensor, by name: what a trained model's look like.
fn dummy_vector_range(name: &str, zero_centred_norms: bool) -> (f32, f32) {
    if name.ends_with("A_log") {
        (1.386, 1.386) // A = exp(A_log) in (1, 16)
    } else if name.ends_with("dt_bias") || name.ends_with("conv1d.weight") {
        (0.5, 0.0)
    } else if name.ends_with("linear_attn.norm.weight") || !zero_centred_norms {
        (0.05, 1.0) // plain norm weight
    } else {
        (0.05, 0.0) // zero-centred: x̂ · (1 + w)
    }
}

impl Load<Device> for DeviceLoader<'_> {
    fn contains(&self, name: &str) -> bool {
        match &self.source {
            DeviceSource::Checkpoint(w) => w.contains(name),
            // The text-only layout (`model.` prefix), `mtp.*` when asked for.
            DeviceSource::Dummy { mtp, .. } => {
                if name.starts_with("model.language_model.") {
                    false
                } else {
                    !name.starts_with("mtp.") || *mtp
                }
            }
        }
    }
    fn ignore_prefix(&mut self, prefix: &str) {
        if let DeviceSource::Checkpoint(w) = &mut self.source {
            w.ignore_prefix(prefix);
        }
    }
    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Arc<DMat> {
        let w = match &mut self.source {
            DeviceSource::Checkpoint(loader) => {
                let t = loader.take(name, &[rows, cols]);
                self.upload_tensor(&t)
            }
            DeviceSource::Dummy { .. } => {
                let scale = if name.ends_with("embed_tokens.weight") { 1.0 } else { (3.0 / cols as f32).sqrt() };
                self.random(rows * cols, scale, 0.0)
            }
        };
        Arc::new(DMat { w, rows, cols })
    }
    fn vec(&mut self, name: &str, shape: &[usize]) -> DVec {
        let len = shape.iter().product();
        let host: Vec<f32> = match &mut self.source {
            DeviceSource::Checkpoint(loader) => loader.take(name, shape).to_f32_vec(),
            DeviceSource::Dummy { zero_centred_norms, .. } => {
                // Small vectors: generated on the host so both precisions hold the same values.
                let (scale, offset) = dummy_vector_range(name, *zero_centred_norms);
                let mut s = self.fills.wrapping_add(0x5EED) ^ name.len() as u64;
                (0..len)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        offset + scale * ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
                    })
                    .collect()
            }
        };
        self.fills += 1;
        if host.len() != len {
            // The checkpoint loader recorded the problem; keep shapes consistent for the rest of the table.
            return DVec { bf16: self.device(|g| g.alloc_zeros(len)), f32: self.device(|g| g.alloc_zeros(len)), len };
        }
        let narrow: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        DVec { bf16: self.device(|g| g.upload(&narrow)), f32: self.device(|g| g.upload(&host)), len }
    }
    fn experts(&mut self, prefix: &str, count: usize, inter: usize, hidden: usize) -> DExperts {
        let (gate_up, down) = match &mut self.source {
            DeviceSource::Checkpoint(loader) => {
                // After a device error: taken (the checkpoint's accounting), not converted.
                let failed = self.error.is_some();
                let tensor_bf16 = |t: &Tensor| if failed { Vec::new() } else { tensor_bf16(t) };
                let stacked = format!("{prefix}mlp.experts.gate_up_proj");
                let (gate_up, down) = if loader.contains(&stacked) {
                    let gu = tensor_bf16(&loader.take(&stacked, &[count, 2 * inter, hidden]));
                    let d = tensor_bf16(&loader.take(&format!("{prefix}mlp.experts.down_proj"), &[count, hidden, inter]));
                    (gu, d)
                } else {
                    // One entry per expert: stack [gate; up] and down per expert, in expert order.
                    let (mut gu, mut d) = (Vec::new(), Vec::new());
                    for e in 0..count {
                        let p = format!("{prefix}mlp.experts.{e}.");
                        gu.extend(tensor_bf16(&loader.take(&format!("{p}gate_proj.weight"), &[inter, hidden])));
                        gu.extend(tensor_bf16(&loader.take(&format!("{p}up_proj.weight"), &[inter, hidden])));
                        d.extend(tensor_bf16(&loader.take(&format!("{p}down_proj.weight"), &[hidden, inter])));
                    }
                    (gu, d)
                };
                if gate_up.len() != count * 2 * inter * hidden || down.len() != count * hidden * inter {
                    // A problem recorded (by the checkpoint's loader, or the device error above).
                    (self.device(|g| g.alloc_zeros(1)), self.device(|g| g.alloc_zeros(1)))
                } else {
                    (self.device(|g| g.upload(&gate_up)), self.device(|g| g.upload(&down)))
                }
            }
            DeviceSource::Dummy { .. } => (
                self.random(count * 2 * inter * hidden, (3.0 / hidden as f32).sqrt(), 0.0),
                self.random(count * hidden * inter, (3.0 / inter as f32).sqrt(), 0.0),
            ),
        };
        DExperts { gate_up, down, count, inter, hidden }
    }
}
