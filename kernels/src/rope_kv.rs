//! Launchers for `cuda/rope_kv.cu` (being written).
