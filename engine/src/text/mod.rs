//! Text ↔ token ids: the tokenizer bundle and the chat template.

pub mod chat_template;
pub mod tokenizer;
