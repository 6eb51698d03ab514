pub mod common;
pub mod logits;
pub mod generate;
