//! nextn-engine: everything between a checkpoint directory and tokens.
//!
//! - [`config`], [`weights`]: a checkpoint's config and tensors (safetensors, mmap, stored dtype; dummy weights).
//! - [`models`]: each architecture's weight tree, load table and forward, written once over the op
//!   interface of [`models::ops`].
//! - [`backend`]: where a forward runs — [`backend::cpu`] (SIMD f32 on the host), `backend::cuda` (custom
//!   BF16 kernels, feature `cuda`), [`backend::record`] (ops and bytes on shapes alone, `nextn-bench plan`).
//! - [`cache`]: KV blocks, GDN state slots, the prefix cache, and the host cache storage.
//! - [`sched`]: which sequences run in a step, and the step's metadata.
//! - [`spec`]: MTP speculation (propose → verify → commit) and its acceptance math.
//! - [`sample`]: sampling parameters, the sampler and stop conditions.
//! - [`text`]: tokenizer and chat template (text ↔ token ids).
//! - [`engine`], [`service`]: the step loop, and the worker thread requests talk to.
//! - [`alloc`]: the binaries' allocator (large blocks on huge pages, kept for reuse).

pub mod alloc;
pub mod backend;
pub mod cache;
pub mod config;
pub mod engine;
pub mod error;
pub mod models;
pub mod sample;
pub mod sched;
pub mod service;
pub mod spec;
mod stage;
pub mod text;
pub mod weights;

pub use backend::{Backend, BackendError, CacheGeometry, Device, ModelSource};
pub use cache::prefix::{PrefixCacheConfig, PrefixCacheStats};
pub use config::{Architecture, LayerType, ModelConfig};
pub use engine::{Engine, EngineConfig, EngineError, Event, Output, Stats, TokenEvent};
pub use error::{ForwardError, LoadError, TensorProblem};
pub use backend::cpu::model::SeqCache;
pub use models::{LoadOptions, Model};
pub use sample::{FinishReason, SamplingParams};
pub use service::{EngineHandle, EngineService, RecvError, RequestEvent, RequestHandle, ServiceError, ServiceInfo, ServiceSnapshot};
