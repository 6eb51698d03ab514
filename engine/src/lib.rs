//! nextn-engine: everything between a checkpoint directory and logits / tokens.
//!
//! Data flow (see DESIGN.md): [`config`] → [`weights`] (safetensors, memmap, stored dtype) →
//! [`models`] (the forward, one architecture per file, on the f32 primitives in [`ops`]);
//! [`tokenizer`] + [`chat_template`] turn text into token ids and back.

pub mod backend;
pub mod block_manager;
pub mod cache;
pub mod chat_template;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dummy;
pub mod engine;
pub mod error;
pub mod gemv;
pub mod models;
pub mod ops;
pub mod prefix_cache;
pub mod record;
pub mod sampler;
pub mod scheduler;
pub mod service;
pub mod spec;
pub mod step;
pub mod state_slots;
pub mod tokenizer;
pub mod weights;

pub use backend::{Backend, BackendError, CacheGeometry, Device, ModelSource};
pub use config::{Architecture, LayerType, ModelConfig};
pub use error::{ForwardError, LoadError, TensorProblem};
pub use engine::{Engine, EngineConfig, EngineError, Event, Output, Stats, TokenEvent};
pub use models::{LoadOptions, Model, SeqCache};
pub use prefix_cache::{PrefixCacheConfig, PrefixCacheStats};
pub use sampler::{FinishReason, SamplingParams};
pub use service::{EngineHandle, EngineService, RecvError, RequestEvent, RequestHandle, ServiceError, ServiceInfo, ServiceSnapshot};
