//! Launchers for `cuda/embedding.cu` (being written).
