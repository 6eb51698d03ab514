//! Typed errors of the loading path. Every variant names the file, field or tensor it is about, and
//! the message says what to do next where there is something to do.

use std::path::PathBuf;

/// Anything that goes wrong while reading a checkpoint directory.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: no such model directory or config file")]
    NotFound { path: PathBuf },

    // `error` (not `source`): the message already carries the cause, keep it out of the error chain.
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },

    #[error("{path}: not valid JSON: {error}")]
    Json { path: PathBuf, error: serde_json::Error },

    #[error("{path}: field `{field}`: {reason}")]
    ConfigField { path: PathBuf, field: String, reason: String },

    #[error("{path}: unsupported model_type `{found}`; supported: {}", supported.join(", "))]
    UnsupportedModelType { path: PathBuf, found: String, supported: Vec<&'static str> },

    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    #[error("{index}: shard `{shard}` is listed in weight_map but {reason}")]
    Shard { index: PathBuf, shard: String, reason: String },

    #[error("{dir}: no weights found (expected model.safetensors or model.safetensors.index.json)")]
    NoWeights { dir: PathBuf },

    #[error(
        "dummy weights need {:.1} GiB but only {:.1} GiB of memory is available; use a smaller config",
        *needed as f64 / (1u64 << 30) as f64, *available as f64 / (1u64 << 30) as f64
    )]
    DummyTooLarge { needed: usize, available: usize },

    #[error("tensor `{name}` appears in both {first} and {second}")]
    DuplicateTensor { name: String, first: PathBuf, second: PathBuf },

    #[error("{dir}: the checkpoint does not match the config ({} problem(s)):\n{}", problems.len(), format_problems(problems))]
    Tensors { dir: PathBuf, problems: Vec<TensorProblem> },
}

/// One mismatch between the tensors a config implies and the tensors a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorProblem {
    Missing { name: String, expected: Vec<usize> },
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },
    Dtype { name: String, found: String },
    Unexpected { name: String, shape: Vec<usize> },
}

impl TensorProblem {
    pub fn name(&self) -> &str {
        match self {
            Self::Missing { name, .. }
            | Self::Shape { name, .. }
            | Self::Dtype { name, .. }
            | Self::Unexpected { name, .. } => name,
        }
    }
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing { name, expected } => write!(f, "missing    {name} (expected shape {expected:?})"),
            Self::Shape { name, expected, found } => {
                write!(f, "shape      {name}: expected {expected:?}, found {found:?}")
            }
            Self::Dtype { name, found } => {
                write!(f, "dtype      {name}: found {found}, supported: F32, F16, BF16")
            }
            Self::Unexpected { name, shape } => write!(f, "unexpected {name} (shape {shape:?})"),
        }
    }
}

fn format_problems(problems: &[TensorProblem]) -> String {
    problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n")
}

/// Errors of a forward call (bad token ids, positions past the limit).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} at index {index} is out of range (vocab_size = {vocab_size})")]
    TokenOutOfRange { id: u32, index: usize, vocab_size: usize },
    #[error("empty input: at least one token is needed")]
    Empty,
    #[error("cache holds {capacity} tokens but {needed} are needed")]
    CacheFull { needed: usize, capacity: usize },
    #[error("position {position} exceeds max_position_embeddings = {limit}")]
    ContextLimit { position: usize, limit: usize },
}
