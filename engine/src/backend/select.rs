//! Which backend runs a model: [`make_backend`] builds the one a [`Device`] names.

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendError, CacheGeometry, Device, ModelSource};
use crate::error::LoadError;
use crate::models::Model;
use crate::sched::step::StepCtx;

/// Build the backend for `device`. Without the `cuda` feature, `Device::Cuda` is a clear error.
pub fn make_backend(device: Device, source: ModelSource, geo: CacheGeometry) -> Result<Box<dyn Backend>, BackendError> {
    match device {
        Device::Cpu => {
            let cpu_err = |e: LoadError| BackendError::Load { backend: "cpu", what: e.to_string() };
            let model = match source {
                ModelSource::Loaded(m) => m,
                ModelSource::Checkpoint { cfg, mut ckpt } => {
                    ckpt.make_resident(false).map_err(cpu_err)?;
                    Model::from_checkpoint(&cfg, &ckpt).map_err(cpu_err)?
                }
                ModelSource::Dummy { cfg, seed } => {
                    Model::load_dummy(&cfg, crate::weights::DType::BF16, seed).map_err(cpu_err)?
                }
            };
            Ok(Box::new(CpuBackend::new(model, geo.num_blocks, geo.block_size, geo.num_slots, geo.lanes)))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => crate::backend::cuda::CudaBackend::new(ordinal, source, geo).map(|b| Box::new(b) as Box<dyn Backend>),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(BackendError::Unsupported {
            backend: "cuda",
            what: "this build has no CUDA support: rebuild with `--features cuda` \
                  (after tools/install-cuda-toolchain.sh)"
                .into(),
        }),
    }
}

/// Logits at every position of a fresh sequence `tokens`, in one forward on `device`.
pub fn logits_on(device: Device, source: ModelSource, tokens: &[u32]) -> Result<Vec<Vec<f32>>, BackendError> {
    const BLOCK: usize = 16;
    let geo = CacheGeometry { num_blocks: tokens.len().div_ceil(BLOCK).max(1), block_size: BLOCK, num_slots: 1, lanes: 0 };
    let mut b = make_backend(device, source, geo)?;
    let vocab = b.config().vocab_size;
    let table: Vec<u32> = (0..geo.num_blocks as u32).collect();
    let mut ctx = StepCtx { block_size: BLOCK, ..Default::default() };
    ctx.push_seq(tokens, 0, &table, 0, |_| true);
    b.reset_slot(0);
    let (_, logits) = b.execute(&ctx)?;
    Ok(logits.chunks(vocab).map(<[f32]>::to_vec).collect())
}
