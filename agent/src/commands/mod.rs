pub mod common;
pub mod draft_vocab;
pub mod logits;
pub mod generate;
pub mod agent;
pub mod serve;
pub mod render;
pub mod perturb;
