//! Launchers for `cuda/gdn.cu` (being written).
