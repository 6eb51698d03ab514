//! Launchers for `cuda/sample.cu` (being written).
