//! Launchers for `cuda/linear.cu` (being written).
