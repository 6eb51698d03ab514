//! Launchers for `cuda/attention.cu` (being written).
