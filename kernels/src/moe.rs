//! Launchers for `cuda/moe.cu` (being written).
