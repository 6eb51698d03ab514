//! Chat templates: the model's Jinja template rendered with minijinja the way transformers'
//! `apply_chat_template` renders it with jinja2.
//!
//! Source lookup (`ChatTemplate::load`): `chat_template.jinja` in the model directory, else the
//! `chat_template` field of `tokenizer_config.json` (a string, or a list of `{name, template}` of
//! which the one named `"default"` is used).
//!
//! The environment mirrors transformers' `_compile_jinja_template`: `trim_blocks` and
//! `lstrip_blocks` on, no auto-escaping, `{% break %}`/`{% continue %}`, a `tojson` filter that is
//! Python's `json.dumps(x, ensure_ascii=False, ...)`, and the globals `raise_exception(msg)` and
//! `strftime_now(fmt)`. The render variables are `messages`, `tools` (none when absent),
//! `documents` (none), `add_generation_prompt`, the tokenizer's special tokens (`bos_token`,
//! `eos_token`, `pad_token`, `unk_token`; only those set) and the caller's extra variables
//! (`enable_thinking`, ...). HF's `{% generation %}` block tag is accepted and renders its body.
//!
//! Where minijinja differs from jinja2 the `python` submodule fills the gap:
//! Python string methods (minijinja-contrib `pycompat` plus `rsplit`, `removeprefix`,
//! `removesuffix`, `partition`, `rpartition`, `index`, `rindex`, `zfill`, `ljust`, `rjust`,
//! `center`), Python `str()` for `{{ value }}` and `|string` (floats as Python prints them, lists
//! and dicts as Python reprs), jinja2's `is sequence` (true for strings and mappings too), and
//! input maps that keep the caller's key order whatever features serde_json/minijinja are built
//! with.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::ObjectExt;
use minijinja::value::{Enumerator, Object, ObjectRepr};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde::de::{self, Deserializer as _, MapAccess, SeqAccess, Visitor};

mod python;

pub use python::strftime;
use python::{install_python_compat, py_str};

/// File name of a standalone template in a model directory.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// File holding the `chat_template` field and the special tokens.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

const TEMPLATE_NAME: &str = "chat_template";

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: field `{field}` {problem}")]
    Field {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },
    #[error("chat template from {origin} does not compile: {source}")]
    Syntax {
        origin: TemplateOrigin,
        source: minijinja::Error,
    },
    /// The template called `raise_exception(message)` (e.g. an unsupported role).
    #[error("chat template raised an exception: {message}")]
    Raised { message: String },
    #[error("rendering the chat template from {origin} failed: {source}")]
    Render {
        origin: TemplateOrigin,
        source: minijinja::Error,
    },
    #[error("chat template input `{what}` cannot be serialised to JSON: {source}")]
    Input {
        what: &'static str,
        source: serde_json::Error,
    },
}

pub type Result<T> = std::result::Result<T, ChatTemplateError>;

/// Where a template's source came from (for error messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// `chat_template.jinja` at this path.
    File(PathBuf),
    /// The `chat_template` field of this `tokenizer_config.json`.
    TokenizerConfig(PathBuf),
    /// Given as a string by the caller.
    Inline,
}

impl fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateOrigin::File(path) => write!(f, "{}", path.display()),
            TemplateOrigin::TokenizerConfig(path) => {
                write!(f, "{} (field `chat_template`)", path.display())
            }
            TemplateOrigin::Inline => f.write_str("an inline string"),
        }
    }
}

/// Special-token strings handed to the template as `bos_token`, `eos_token`, ... (the ones set).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
}

impl SpecialTokens {
    /// Reads the special tokens of `tokenizer_config.json` (each a string or `{"content": ...}`).
    pub fn from_tokenizer_config(config: &serde_json::Value) -> Self {
        let get = |key: &str| token_content(config.get(key)?).map(str::to_owned);
        SpecialTokens {
            bos_token: get("bos_token"),
            eos_token: get("eos_token"),
            pad_token: get("pad_token"),
            unk_token: get("unk_token"),
        }
    }

    fn vars(&self) -> impl Iterator<Item = (&'static str, &String)> {
        [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("pad_token", &self.pad_token),
            ("unk_token", &self.unk_token),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value.as_ref()?)))
    }
}

/// A special-token entry of `tokenizer_config.json`: `"<|im_end|>"` or `{"content": "<|im_end|>", ...}`.
pub fn token_content(value: &serde_json::Value) -> Option<&str> {
    match value {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Object(map) => map.get("content")?.as_str(),
        _ => None,
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: TemplateOrigin,
    special_tokens: SpecialTokens,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` (an inline template).
    pub fn new(source: impl Into<String>, special_tokens: SpecialTokens) -> Result<Self> {
        Self::compile(source.into(), TemplateOrigin::Inline, special_tokens)
    }

    /// Finds and compiles the template of a model directory; `Ok(None)` when it has none.
    pub fn load(model_dir: &Path) -> Result<Option<Self>> {
        let config_path = model_dir.join(TOKENIZER_CONFIG_FILE);
        let config = read_json_if_exists(&config_path)?;
        let special_tokens = config
            .as_ref()
            .map(SpecialTokens::from_tokenizer_config)
            .unwrap_or_default();

        let file = model_dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            let source =
                std::fs::read_to_string(&file).map_err(|source| ChatTemplateError::Io {
                    path: file.clone(),
                    source,
                })?;
            return Self::compile(source, TemplateOrigin::File(file), special_tokens).map(Some);
        }
        let Some(config) = config else {
            return Ok(None);
        };
        match template_from_config(&config, &config_path)? {
            Some(source) => Self::compile(
                source,
                TemplateOrigin::TokenizerConfig(config_path),
                special_tokens,
            )
            .map(Some),
            None => Ok(None),
        }
    }

    fn compile(
        source: String,
        origin: TemplateOrigin,
        special_tokens: SpecialTokens,
    ) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are a valid syntax");
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        install_python_compat(&mut env);
        let prepared = rewrite_generation_tags(&source);
        if let Err(source) = env.add_template_owned(TEMPLATE_NAME, prepared) {
            return Err(ChatTemplateError::Syntax { origin, source });
        }
        Ok(ChatTemplate {
            env,
            source,
            origin,
            special_tokens,
        })
    }

    /// The template text as found (before any rewriting).
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> &TemplateOrigin {
        &self.origin
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special_tokens
    }

    /// Renders a conversation like `tokenizer.apply_chat_template(messages, tools=tools,
    /// add_generation_prompt=..., tokenize=False, **extra)`.
    ///
    /// `messages` and `tools` are any `Serialize` values (usually `serde_json::Value`); their map
    /// keys reach the template in serialisation order (`tojson` output depends on it: build
    /// serde_json with `preserve_order`, or pass structs). `extra` holds template switches such
    /// as `enable_thinking`.
    pub fn render<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[T]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut vars: BTreeMap<String, Value> = BTreeMap::new();
        for (name, value) in self.special_tokens.vars() {
            vars.insert(name.to_owned(), Value::from(value.as_str()));
        }
        for (name, value) in extra {
            vars.insert(name.clone(), to_template_value(value, "extra")?);
        }
        vars.insert("messages".into(), to_template_value(messages, "messages")?);
        let tools = match tools {
            Some(tools) => to_template_value(tools, "tools")?,
            None => Value::from(()),
        };
        vars.insert("tools".into(), tools);
        vars.insert("documents".into(), Value::from(()));
        vars.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );

        let template =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|source| ChatTemplateError::Render {
                    origin: self.origin.clone(),
                    source,
                })?;
        template
            .render(Value::from(vars))
            .map_err(|err| match raised_message(&err) {
                Some(message) => ChatTemplateError::Raised { message },
                None => ChatTemplateError::Render {
                    origin: self.origin.clone(),
                    source: err,
                },
            })
    }
}

fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ChatTemplateError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| ChatTemplateError::Json {
            path: path.to_owned(),
            source,
        })
}

/// `chat_template` of a parsed `tokenizer_config.json`: a string, or a list of `{name, template}`.
fn template_from_config(config: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    let field_error = |problem: String| ChatTemplateError::Field {
        path: path.to_owned(),
        field: "chat_template",
        problem,
    };
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(source)) => Ok(Some(source.clone())),
        Some(serde_json::Value::Array(entries)) => {
            let mut names = Vec::new();
            for entry in entries {
                let name = entry.get("name").and_then(|n| n.as_str());
                let template = entry.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(template)) => return Ok(Some(template.to_owned())),
                    (Some(name), Some(_)) => names.push(name.to_owned()),
                    _ => {
                        return Err(field_error(
                            "has an entry that is not {\"name\": string, \"template\": string}"
                                .into(),
                        ));
                    }
                }
            }
            Err(field_error(format!(
                "lists templates {names:?} but none named \"default\"; add a chat_template.jinja to the model directory"
            )))
        }
        Some(other) => Err(field_error(format!(
            "must be a string or a list of {{name, template}}, found {other}"
        ))),
    }
}

/// HF's `{% generation %}...{% endgeneration %}` (assistant-mask tracking) renders its body
/// unchanged; minijinja has no such tag, so it becomes `{% if true %}...{% endif %}` with the
/// same whitespace-control markers.
fn rewrite_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_owned();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open, body) = split_marker_front(inner);
        let (body, close) = split_marker_back(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => write!(out, "{{%{open} {word} {close}%}}").expect("writing to a String"),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_marker_front(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some('-' | '+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_marker_back(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some('-' | '+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

// ---------------------------------------------------------------------------------------------
// Input conversion: Serialize -> minijinja Value, keeping map key order.

/// Converts any `Serialize` value into a template value; JSON objects become [`OrderedMap`]s.
fn to_template_value<S: Serialize + ?Sized>(value: &S, what: &'static str) -> Result<Value> {
    let json =
        serde_json::to_string(value).map_err(|source| ChatTemplateError::Input { what, source })?;
    let mut de = serde_json::Deserializer::from_str(&json);
    de.deserialize_any(TemplateValueVisitor)
        .map_err(|source| ChatTemplateError::Input { what, source })
}

struct TemplateValueVisitor;

impl<'de> Visitor<'de> for TemplateValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_none<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::from(()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(TemplateValueSeed)? {
            items.push(item);
        }
        Ok(Value::from(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = OrderedMap::default();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(TemplateValueSeed)?;
            out.insert(key, value);
        }
        Ok(Value::from_object(out))
    }
}

struct TemplateValueSeed;

impl<'de> de::DeserializeSeed<'de> for TemplateValueSeed {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> std::result::Result<Value, D::Error> {
        deserializer.deserialize_any(TemplateValueVisitor)
    }
}

/// A string-keyed map that iterates in insertion order (Python dict semantics: a repeated key
/// keeps its first position and takes the last value).
#[derive(Debug, Default)]
struct OrderedMap {
    entries: Vec<(Value, Value)>,
    index: HashMap<String, usize>,
}

impl OrderedMap {
    fn insert(&mut self, key: String, value: Value) {
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((Value::from(key), value));
            }
        }
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.get_value_by_str(key.as_str()?)
    }
    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.index.get(key).map(|&i| self.entries[i].1.clone())
    }
    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_enumerator(|this| Box::new(this.entries.iter().map(|(k, _)| k.clone())))
    }
    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

// ---------------------------------------------------------------------------------------------
// raise_exception: a typed error carrying the template's message.

#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(message: Value) -> std::result::Result<Value, Error> {
    let message = py_str(&message);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedException>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(super) fn render_str(source: &str, messages: serde_json::Value) -> Result<String> {
        let template = ChatTemplate::new(source, SpecialTokens::default())?;
        let messages = messages.as_array().cloned().unwrap_or_default();
        template.render(
            &messages,
            None::<&[serde_json::Value]>,
            false,
            &serde_json::Map::new(),
        )
    }

    #[test]
    fn struct_fields_keep_declaration_order() {
        #[derive(Serialize)]
        struct Tool {
            r#type: &'static str,
            name: &'static str,
        }
        let template = ChatTemplate::new(
            "{{ messages[0] | tojson }} {{ messages[0].keys() | list }}",
            SpecialTokens::default(),
        )
        .unwrap();
        let out = template
            .render(
                &[Tool {
                    r#type: "function",
                    name: "f",
                }],
                None::<&[serde_json::Value]>,
                false,
                &serde_json::Map::new(),
            )
            .unwrap();
        assert_eq!(out, r#"{"type": "function", "name": "f"} ['type', 'name']"#);
    }

    #[test]
    fn raise_exception_gives_typed_error() {
        let err = render_str("{% if messages | length == 0 %}{{ raise_exception('No messages: ' + 'x') }}{% endif %}", json!([]))
            .unwrap_err();
        match err {
            ChatTemplateError::Raised { message } => assert_eq!(message, "No messages: x"),
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn raise_exception_inside_macro_is_still_typed() {
        let err = render_str(
            "{% macro f() %}{{ raise_exception('deep') }}{% endmacro %}{{ f() }}",
            json!([]),
        )
        .unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::Raised { ref message } if message == "deep"),
            "{err:?}"
        );
    }

    #[test]
    fn syntax_error_is_reported_not_panicked() {
        let err = ChatTemplate::new("{% if %}", SpecialTokens::default()).unwrap_err();
        assert!(matches!(err, ChatTemplateError::Syntax { .. }), "{err:?}");
    }

    #[test]
    fn trim_and_lstrip_blocks_like_hf() {
        let out = render_str("A\n  {% if true %}\nB\n  {% endif %}\nC\n", json!([])).unwrap();
        assert_eq!(out, "A\nB\nC");
    }

    #[test]
    fn generation_tag_renders_its_body() {
        let out = render_str(
            "a{%- generation -%} b {%- endgeneration %}c{% generation %}d{% endgeneration %}",
            json!([]),
        )
        .unwrap();
        assert_eq!(out, "abcd");
        assert_eq!(
            rewrite_generation_tags("{% if generation %}"),
            "{% if generation %}"
        );
    }

    #[test]
    fn special_tokens_and_extra_vars_reach_the_template() {
        let special = SpecialTokens {
            eos_token: Some("<|im_end|>".into()),
            ..Default::default()
        };
        let template = ChatTemplate::new("{{ eos_token }}|{{ bos_token is defined }}|{{ enable_thinking }}|{{ tools }}|{{ add_generation_prompt }}", special).unwrap();
        let mut extra = serde_json::Map::new();
        extra.insert("enable_thinking".into(), json!(false));
        let out = template
            .render(&[json!({})], None::<&[serde_json::Value]>, true, &extra)
            .unwrap();
        assert_eq!(out, "<|im_end|>|False|False|None|True");
    }

    #[test]
    fn config_template_list_picks_default() {
        let path = Path::new("tokenizer_config.json");
        let config = json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(
            template_from_config(&config, path).unwrap().as_deref(),
            Some("D")
        );
        let bad = json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        assert!(matches!(
            template_from_config(&bad, path),
            Err(ChatTemplateError::Field { .. })
        ));
        assert!(matches!(
            template_from_config(&json!({"chat_template": 3}), path),
            Err(ChatTemplateError::Field { .. })
        ));
        assert_eq!(template_from_config(&json!({}), path).unwrap(), None);
    }
}
