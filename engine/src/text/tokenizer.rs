//! Text <-> token ids for a checkpoint directory.
//!
//! * [`Tokenizer`]: `tokenizer.json` through the `tokenizers` crate (byte-level BPE for Qwen).
//! * [`DecodeStream`]: incremental detokenisation for generation; text is released only once its
//!   UTF-8 bytes are complete, so a Chinese character split over two tokens comes out whole.
//! * [`GenerationConfig`]: `generation_config.json` (stop ids and sampling defaults).
//! * [`TokenizerBundle`]: everything above plus the chat template, loaded from whatever the
//!   model directory has. A directory without `tokenizer.json` still loads (the engine then takes
//!   and returns token ids), and [`TokenizerBundle::eos_token_ids`] merges every stop id the
//!   checkpoint declares.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::text::chat_template::{self, ChatTemplate, ChatTemplateError};

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const MODEL_CONFIG_FILE: &str = "config.json";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a tokenizer the `tokenizers` crate can load: {source}")]
    Load {
        path: PathBuf,
        source: tokenizers::Error,
    },
    #[error("{path} is not valid JSON for this file: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: field `{field}` {problem}")]
    Field {
        path: PathBuf,
        field: String,
        problem: String,
    },
    #[error("model directory {0} does not exist or is not a directory")]
    NotADirectory(PathBuf),
    #[error(
        "{dir} has no {TOKENIZER_FILE}: pass token ids instead of text, or add the tokenizer files"
    )]
    MissingTokenizer { dir: PathBuf },
    #[error(
        "{dir} has no chat template (chat_template.jinja or `chat_template` in tokenizer_config.json)"
    )]
    MissingChatTemplate { dir: PathBuf },
    #[error("encoding text with {path} failed: {source}")]
    Encode {
        path: PathBuf,
        source: tokenizers::Error,
    },
    #[error("decoding ids with {path} failed: {source}")]
    Decode {
        path: PathBuf,
        source: tokenizers::Error,
    },
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
}

pub type Result<T> = std::result::Result<T, TokenizerError>;

// ---------------------------------------------------------------------------------------------
// Tokenizer

/// A `tokenizer.json` tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bytes = std::fs::read(&path).map_err(|source| TokenizerError::Io {
            path: path.clone(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|source| TokenizerError::Load {
                path: path.clone(),
                source,
            })?;
        Ok(Tokenizer { inner, path })
    }

    /// Token ids of `text`. `add_special_tokens` runs the post-processor (no BOS for Qwen);
    /// special tokens written in the text (`<|im_start|>`) are always recognised.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizerError::Encode {
                path: self.path.clone(),
                source,
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; ids the vocabulary does not know (e.g. embedding padding rows) are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|source| TokenizerError::Decode {
                path: self.path.clone(),
                source,
            })
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (248077 for Qwen3.5; the embedding has more rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A streaming detokeniser over this tokenizer.
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special_tokens)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The underlying `tokenizers` tokenizer, for anything not wrapped here.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming detokenisation

/// Turns a stream of generated ids into text pieces.
///
/// Each [`push`](Self::push) decodes the ids since the last released piece together with a
/// little context before it, and releases the new suffix only when it does not end in U+FFFD
/// (an incomplete UTF-8 sequence). Context keeps decoders that look at neighbours (spaces,
/// byte-level merges) consistent; ids before the context are dropped, so memory stays bounded.
#[derive(Debug)]
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// `ids[..read_offset]` is context already released as text; the rest is pending.
    ids: Vec<u32>,
    read_offset: usize,
    /// Decoded text of the context ids.
    prefix: String,
}

impl<'a> DecodeStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        DecodeStream {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            read_offset: 0,
            prefix: String::new(),
        }
    }

    /// Adds one id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let piece = self.new_suffix(&text);
        // The pending ids become the context of the next piece.
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
        self.prefix = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        Ok(Some(piece))
    }

    /// Releases whatever is still pending (an incomplete UTF-8 tail comes out as U+FFFD) and
    /// resets the stream.
    pub fn flush(&mut self) -> Result<Option<String>> {
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let piece = (text.len() > self.prefix.len()).then(|| self.new_suffix(&text));
        self.ids.clear();
        self.read_offset = 0;
        self.prefix.clear();
        Ok(piece)
    }

    /// `text` minus the already released prefix. A decoder that rewrites the context when more
    /// ids follow would break the prefix relation; then the text after the common prefix is
    /// released (nothing already released is taken back).
    fn new_suffix(&self, text: &str) -> String {
        if let Some(rest) = text.strip_prefix(self.prefix.as_str()) {
            return rest.to_owned();
        }
        let common = text
            .char_indices()
            .zip(self.prefix.chars())
            .find(|((_, a), b)| a != b)
            .map_or(self.prefix.len().min(text.len()), |((i, _), _)| i);
        text[common..].to_owned()
    }
}

// ---------------------------------------------------------------------------------------------
// generation_config.json

/// `generation_config.json`: stop ids and the checkpoint's sampling defaults.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    /// An int or a list in the file; empty when absent or null.
    #[serde(default, deserialize_with = "one_or_many")]
    pub eos_token_id: Vec<u32>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub do_sample: Option<bool>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u32>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub max_new_tokens: Option<u32>,
}

impl GenerationConfig {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|source| TokenizerError::Json {
            path: path.to_owned(),
            source,
        })
    }

    pub fn from_json_str(text: &str) -> std::result::Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<OneOrMany>::deserialize(deserializer)? {
        None => Vec::new(),
        Some(OneOrMany::One(id)) => vec![id],
        Some(OneOrMany::Many(ids)) => ids,
    })
}

/// Ids of an `eos_token_id` JSON value (int, list of ints, or null).
fn ids_of(value: &serde_json::Value) -> Option<Vec<u32>> {
    let one = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match value {
        serde_json::Value::Null => Some(Vec::new()),
        serde_json::Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|id| vec![id]),
    }
}

// ---------------------------------------------------------------------------------------------
// TokenizerBundle

/// The text side of a checkpoint: whatever of tokenizer, chat template and generation config
/// the model directory provides, and the merged stop ids.
#[derive(Debug)]
pub struct TokenizerBundle {
    dir: PathBuf,
    tokenizer: Option<Tokenizer>,
    chat_template: Option<ChatTemplate>,
    generation_config: Option<GenerationConfig>,
    eos_token_ids: Vec<u32>,
}

impl TokenizerBundle {
    /// Loads `tokenizer.json`, the chat template, `generation_config.json`, and the stop ids of
    /// `config.json` and `tokenizer_config.json`, each when present. A present but malformed
    /// file is an error naming it.
    pub fn load(model_dir: impl AsRef<Path>) -> Result<Self> {
        let dir = model_dir.as_ref().to_path_buf();
        if !dir.is_dir() {
            return Err(TokenizerError::NotADirectory(dir));
        }
        let tokenizer_path = dir.join(TOKENIZER_FILE);
        let tokenizer = if tokenizer_path.is_file() {
            Some(Tokenizer::from_file(&tokenizer_path)?)
        } else {
            None
        };

        let generation_path = dir.join(GENERATION_CONFIG_FILE);
        let generation_config = if generation_path.is_file() {
            Some(GenerationConfig::from_file(&generation_path)?)
        } else {
            None
        };

        let chat_template = ChatTemplate::load(&dir)?;

        // 1. generation_config.json, 2. config.json (top level and text_config), 3. the
        // tokenizer's eos_token; union in that order.
        let mut eos = generation_config
            .as_ref()
            .map(|g| g.eos_token_id.clone())
            .unwrap_or_default();
        eos.extend(model_config_eos_ids(&dir.join(MODEL_CONFIG_FILE))?);
        if let Some(token) = tokenizer_config_eos(&dir.join(chat_template::TOKENIZER_CONFIG_FILE))?
        {
            match tokenizer.as_ref().and_then(|t| t.token_to_id(&token)) {
                Some(id) => eos.push(id),
                None => {
                    tracing::warn!(%token, dir = %dir.display(), "tokenizer_config.json eos_token has no id (no tokenizer.json or unknown token); ignored")
                }
            }
        }
        let mut eos_token_ids = Vec::with_capacity(eos.len());
        for id in eos {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        Ok(TokenizerBundle {
            dir,
            tokenizer,
            chat_template,
            generation_config,
            eos_token_ids,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The tokenizer, or an error telling the caller to pass token ids.
    pub fn require_tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| TokenizerError::MissingTokenizer {
                dir: self.dir.clone(),
            })
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    pub fn generation_config(&self) -> Option<&GenerationConfig> {
        self.generation_config.as_ref()
    }

    /// Every stop id the checkpoint declares, deduplicated, in the order
    /// generation_config.json, config.json, tokenizer_config.json.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// Renders the chat template and encodes the prompt (no extra special tokens, as
    /// `apply_chat_template(tokenize=True)` does).
    pub fn encode_chat<M: serde::Serialize, T: serde::Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[T]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>> {
        let template =
            self.chat_template
                .as_ref()
                .ok_or_else(|| TokenizerError::MissingChatTemplate {
                    dir: self.dir.clone(),
                })?;
        let prompt = template.render(messages, tools, add_generation_prompt, extra)?;
        self.require_tokenizer()?.encode(&prompt, false)
    }
}

fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_owned(),
            source,
        })
}

/// `eos_token_id` of config.json, at the top level and under `text_config` (int, list or null).
fn model_config_eos_ids(path: &Path) -> Result<Vec<u32>> {
    let Some(config) = read_json_if_exists(path)? else {
        return Ok(Vec::new());
    };
    let mut ids = Vec::new();
    for (field, value) in [
        ("eos_token_id", config.get("eos_token_id")),
        (
            "text_config.eos_token_id",
            config
                .get("text_config")
                .and_then(|t| t.get("eos_token_id")),
        ),
    ] {
        let Some(value) = value else { continue };
        match ids_of(value) {
            Some(found) => ids.extend(found),
            None => {
                return Err(TokenizerError::Field {
                    path: path.to_owned(),
                    field: field.to_owned(),
                    problem: format!("must be a token id or a list of token ids, found {value}"),
                });
            }
        }
    }
    Ok(ids)
}

/// `eos_token` of tokenizer_config.json (a string or `{"content": ...}`), if set.
fn tokenizer_config_eos(path: &Path) -> Result<Option<String>> {
    let Some(config) = read_json_if_exists(path)? else {
        return Ok(None);
    };
    match config.get("eos_token") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(value) => match chat_template::token_content(value) {
            Some(token) => Ok(Some(token.to_owned())),
            None => Err(TokenizerError::Field {
                path: path.to_owned(),
                field: "eos_token".to_owned(),
                problem: format!("must be a string or {{\"content\": string}}, found {value}"),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundle_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<TokenizerBundle>();
        assert_send_sync::<DecodeStream<'static>>();
    }

    #[test]
    fn generation_config_eos_int_list_or_null() {
        let one = GenerationConfig::from_json_str(
            r#"{"eos_token_id": 7, "top_k": 20, "temperature": 0.6}"#,
        )
        .unwrap();
        assert_eq!(one.eos_token_id, vec![7]);
        assert_eq!(one.top_k, Some(20));
        assert_eq!(one.temperature, Some(0.6));
        assert_eq!(one.top_p, None);
        let many = GenerationConfig::from_json_str(
            r#"{"eos_token_id": [248046, 248044], "pad_token_id": 248044}"#,
        )
        .unwrap();
        assert_eq!(many.eos_token_id, vec![248046, 248044]);
        assert_eq!(many.pad_token_id, Some(248044));
        let null = GenerationConfig::from_json_str(
            r#"{"eos_token_id": null, "transformers_version": "5"}"#,
        )
        .unwrap();
        assert!(null.eos_token_id.is_empty());
        assert!(GenerationConfig::from_json_str(r#"{"eos_token_id": "x"}"#).is_err());
        assert!(GenerationConfig::from_json_str(r#"{"eos_token_id": -1}"#).is_err());
    }

    #[test]
    fn ids_of_accepts_int_list_null_only() {
        use serde_json::json;
        assert_eq!(ids_of(&json!(3)), Some(vec![3]));
        assert_eq!(ids_of(&json!([3, 4])), Some(vec![3, 4]));
        assert_eq!(ids_of(&json!(null)), Some(vec![]));
        assert_eq!(ids_of(&json!("3")), None);
        assert_eq!(ids_of(&json!([3, -4])), None);
        assert_eq!(ids_of(&json!(1u64 << 40)), None);
    }
}
