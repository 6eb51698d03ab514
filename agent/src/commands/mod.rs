pub mod common;
pub mod logits;
pub mod generate;
pub mod agent;
