pub mod common;
pub mod logits;
