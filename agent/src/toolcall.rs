//! Tool-call parsing for Qwen replies.
//!
//! Two formats are recognised, in any mix, after optional natural-language text:
//!
//! * Qwen3.5 / Qwen3.6 / Qwen3-Coder XML (what the bundled model's chat template asks for):
//!   ```text
//!   <tool_call>
//!   <function=NAME>
//!   <parameter=K>
//!   V
//!   </parameter>
//!   </function>
//!   </tool_call>
//!   ```
//!   Values are raw text (exactly one leading and one trailing newline stripped) and are coerced by the
//!   tool's JSON schema: `integer` / `number` / `boolean` / `null` / `object` / `array` properties are
//!   parsed, `string` and unknown properties stay strings.
//! * Qwen3 / Qwen2.5 JSON: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (`arguments` may
//!   also be a JSON-encoded string).
//!
//! Reasoning (`<think>…</think>`, including the implicit-open form a thinking prompt produces: reasoning
//! text, then `</think>`) is split off into [`ParsedReply::reasoning`]. Malformed calls never panic: they
//! become [`ToolCallError`]s (the agent's tool-call-syntax hook fires on them) and are not returned as calls;
//! a value that does not fit its schema type keeps the call (with the raw string) and records an error.
//!
//! Leniency, matching what serving parsers accept: a bare `<function=…>…</function>` without the
//! `<tool_call>` wrapper is a call; an unclosed `<tool_call>` whose function block is complete (the stream
//! stopped at `</tool_call>`) is a call; a missing `</function>` before `</tool_call>` is tolerated.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";
pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// End-of-turn markers a raw decode may leave at the end.
const END_MARKERS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];
/// Longest snippet kept in an error.
const SNIPPET_CHARS: usize = 200;

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    pub fn new(name: impl Into<String>, arguments: Map<String, Value>) -> Self {
        ToolCall { name: name.into(), arguments }
    }

    /// The OpenAI / HF chat-message form of this call (`arguments` as an object, which chat templates
    /// iterate; [`crate::llm::OpenAiClient`] re-encodes it as a string for the wire).
    pub fn to_openai(&self, id: &str) -> Value {
        serde_json::json!({
            "id": id,
            "type": "function",
            "function": {"name": self.name, "arguments": Value::Object(self.arguments.clone())},
        })
    }

    /// A call from an OpenAI `tool_calls[i]` entry (`{"function": {"name", "arguments"}}`, `arguments` a
    /// JSON string or object) or a bare `{"name", "arguments"}`.
    pub fn from_openai(value: &Value) -> Result<ToolCall, ToolCallError> {
        let f = value.get("function").unwrap_or(value);
        let snippet = || snippet_of(&value.to_string());
        let name = f.get("name").and_then(Value::as_str).filter(|n| !n.trim().is_empty()).ok_or_else(|| {
            ToolCallError::new(ToolCallErrorKind::MissingName, None, "tool call has no function name", snippet())
        })?;
        let arguments = arguments_of(f.get("arguments").or_else(|| f.get("parameters")), name, &snippet())?;
        Ok(ToolCall { name: name.trim().to_string(), arguments })
    }
}

/// What kind of malformation a [`ToolCallError`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallErrorKind {
    /// `<tool_call>` without `</tool_call>` and without a complete call inside.
    UnclosedToolCall,
    /// A `<tool_call>` block that holds neither `<function=…>` nor a JSON object.
    MissingFunction,
    /// `<function=` without a closing `>` or with an empty name.
    MalformedFunction,
    /// `<parameter=…>` without `</parameter>`.
    UnterminatedParameter,
    /// `<parameter=` without a closing `>` or with an empty name.
    MalformedParameter,
    /// The JSON format's body is not valid JSON (or not an object).
    InvalidJson,
    /// The JSON format's object has no `name` string.
    MissingName,
    /// `arguments` is neither an object nor a string holding a JSON object.
    InvalidArguments,
    /// A value does not parse as its schema type (the call is kept, with the raw string).
    TypeMismatch,
}

impl ToolCallErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnclosedToolCall => "unclosed_tool_call",
            Self::MissingFunction => "missing_function",
            Self::MalformedFunction => "malformed_function",
            Self::UnterminatedParameter => "unterminated_parameter",
            Self::MalformedParameter => "malformed_parameter",
            Self::InvalidJson => "invalid_json",
            Self::MissingName => "missing_name",
            Self::InvalidArguments => "invalid_arguments",
            Self::TypeMismatch => "type_mismatch",
        }
    }
}

impl std::fmt::Display for ToolCallErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A malformed call (or a value of the wrong type), with enough context to tell the model what to fix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ToolCallError {
    pub kind: ToolCallErrorKind,
    /// The tool the error is about, when known.
    pub tool: Option<String>,
    pub message: String,
    /// The offending text (at most 200 characters).
    pub snippet: String,
}

impl ToolCallError {
    pub fn new(kind: ToolCallErrorKind, tool: Option<&str>, message: impl Into<String>, snippet: String) -> Self {
        ToolCallError { kind, tool: tool.map(str::to_string), message: message.into(), snippet }
    }
}

/// A model reply split into visible text, reasoning, tool calls and malformations.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ParsedReply {
    /// Text outside calls and reasoning, trimmed.
    pub text: String,
    /// `<think>` content (blocks joined by a blank line), trimmed; `None` when there was none.
    pub reasoning: Option<String>,
    pub calls: Vec<ToolCall>,
    pub errors: Vec<ToolCallError>,
}

impl ParsedReply {
    pub fn has_calls(&self) -> bool {
        !self.calls.is_empty()
    }
    pub fn has_errors(&self) -> bool {
        !self.errors.is_empty()
    }
}

/// Where parameter schemas come from: looked up by tool name, returning the tool's parameters JSON schema
/// (or a whole tool spec: OpenAI `{"type":"function","function":{…,"parameters"}}`, `{"name","parameters"}`
/// or MCP `{"name","inputSchema"}` — the parameters schema is found inside).
pub trait ToolSchemas {
    fn schema(&self, tool: &str) -> Option<&Value>;
}

impl ToolSchemas for HashMap<String, Value> {
    fn schema(&self, tool: &str) -> Option<&Value> {
        self.get(tool)
    }
}

impl ToolSchemas for BTreeMap<String, Value> {
    fn schema(&self, tool: &str) -> Option<&Value> {
        self.get(tool)
    }
}

impl ToolSchemas for Map<String, Value> {
    fn schema(&self, tool: &str) -> Option<&Value> {
        self.get(tool)
    }
}

/// A list of tool specs (OpenAI function specs or MCP tools), matched by name.
impl ToolSchemas for [Value] {
    fn schema(&self, tool: &str) -> Option<&Value> {
        self.iter().find(|spec| {
            let f = spec.get("function").unwrap_or(spec);
            f.get("name").and_then(Value::as_str) == Some(tool)
        })
    }
}

impl ToolSchemas for Vec<Value> {
    fn schema(&self, tool: &str) -> Option<&Value> {
        self.as_slice().schema(tool)
    }
}

/// No schemas: every XML value stays a string.
pub struct NoSchemas;

impl ToolSchemas for NoSchemas {
    fn schema(&self, _tool: &str) -> Option<&Value> {
        None
    }
}

/// The parameters schema inside whatever [`ToolSchemas::schema`] returned.
pub fn parameters_schema(spec: &Value) -> &Value {
    let f = spec.get("function").filter(|f| f.is_object()).unwrap_or(spec);
    if let Some(p) = f.get("parameters").filter(|p| p.is_object()) {
        return p;
    }
    if let Some(p) = f.get("inputSchema").or_else(|| f.get("input_schema")).filter(|p| p.is_object()) {
        return p;
    }
    f
}

/// Split a model reply into text, reasoning, calls and errors. Never panics.
pub fn parse_reply<S: ToolSchemas + ?Sized>(output: &str, schemas: &S) -> ParsedReply {
    let mut out = strip_end_markers(output);
    let mut text = String::new();
    let mut reasoning: Vec<String> = Vec::new();
    let mut calls = Vec::new();
    let mut errors = Vec::new();

    // Implicit-open reasoning: a thinking prompt ends in `<think>\n`, so the reply starts with reasoning
    // and closes it with `</think>`; a `</think>` before any `<think>` ends reasoning that began the reply.
    if let Some(close) = out.find(THINK_CLOSE)
        && out.find(THINK_OPEN).is_none_or(|o| close < o)
    {
        reasoning.push(out[..close].to_string());
        out = &out[close + THINK_CLOSE.len()..];
    }

    let mut rest = out;
    loop {
        let next = [THINK_OPEN, TOOL_CALL_OPEN, FUNCTION_OPEN]
            .iter()
            .filter_map(|t| rest.find(t).map(|i| (i, *t)))
            .min_by_key(|(i, _)| *i);
        let Some((at, tag)) = next else {
            text.push_str(rest);
            break;
        };
        text.push_str(&rest[..at]);
        let after = &rest[at + tag.len()..];
        match tag {
            THINK_OPEN => match after.find(THINK_CLOSE) {
                Some(end) => {
                    reasoning.push(after[..end].to_string());
                    rest = &after[end + THINK_CLOSE.len()..];
                }
                None => {
                    // Reasoning cut off (length limit): everything after is reasoning.
                    reasoning.push(after.to_string());
                    rest = "";
                }
            },
            TOOL_CALL_OPEN => {
                let (body, closed, next_rest) = match after.find(TOOL_CALL_CLOSE) {
                    Some(end) => (&after[..end], true, &after[end + TOOL_CALL_CLOSE.len()..]),
                    None => (after, false, ""),
                };
                match parse_call_body(body, closed, schemas) {
                    Ok((call, mut errs)) => {
                        calls.push(call);
                        errors.append(&mut errs);
                    }
                    Err(e) => errors.push(e),
                }
                rest = next_rest;
            }
            _ => {
                // A bare `<function=…>` block without the `<tool_call>` wrapper.
                let from = &rest[at..];
                let (block, next_rest) = match from.find(FUNCTION_CLOSE) {
                    Some(end) => {
                        let block = &from[..end + FUNCTION_CLOSE.len()];
                        let mut after = &from[end + FUNCTION_CLOSE.len()..];
                        // Swallow a dangling `</tool_call>` right after it.
                        if let Some(r) = after.trim_start().strip_prefix(TOOL_CALL_CLOSE) {
                            after = r;
                        }
                        (block, after)
                    }
                    None => (from, ""),
                };
                match parse_xml_call(block, next_rest.is_empty() && !block.ends_with(FUNCTION_CLOSE), schemas) {
                    Ok((call, mut errs)) => {
                        calls.push(call);
                        errors.append(&mut errs);
                    }
                    Err(e) => errors.push(e),
                }
                rest = next_rest;
            }
        }
    }

    let reasoning: Vec<String> =
        reasoning.iter().map(|r| r.trim().to_string()).filter(|r| !r.is_empty()).collect();
    ParsedReply {
        text: text.trim().to_string(),
        reasoning: (!reasoning.is_empty()).then(|| reasoning.join("\n\n")),
        calls,
        errors,
    }
}

/// `output` without trailing `<|im_end|>` / `<|endoftext|>` markers.
fn strip_end_markers(output: &str) -> &str {
    let mut s = output;
    loop {
        let t = s.trim_end();
        match END_MARKERS.iter().find_map(|m| t.strip_suffix(m)) {
            Some(r) => s = r,
            None => return s,
        }
    }
}

/// One `<tool_call>` body (between the tags). `closed`: whether `</tool_call>` was found.
fn parse_call_body<S: ToolSchemas + ?Sized>(
    body: &str,
    closed: bool,
    schemas: &S,
) -> Result<(ToolCall, Vec<ToolCallError>), ToolCallError> {
    let trimmed = body.trim();
    let unclosed = |msg: &str| {
        ToolCallError::new(
            ToolCallErrorKind::UnclosedToolCall,
            None,
            format!("<tool_call> is never closed with </tool_call>{msg}"),
            snippet_of(&format!("{TOOL_CALL_OPEN}{body}")),
        )
    };
    if let Some(f) = trimmed.find(FUNCTION_OPEN) {
        let block = &trimmed[f..];
        if !closed && !block.contains(FUNCTION_CLOSE) {
            // Truncated mid-call: report that, unless something more specific is wrong.
            return match parse_xml_call(block, true, schemas) {
                Err(e) if e.kind != ToolCallErrorKind::UnterminatedParameter => Err(e),
                _ => Err(unclosed(" (the output stops inside the call)")),
            };
        }
        return parse_xml_call(block, false, schemas);
    }
    if trimmed.starts_with('{') {
        return match parse_json_call(trimmed) {
            Ok(call) => Ok((call, Vec::new())),
            Err(_) if !closed => Err(unclosed(" (the output stops inside the call)")),
            Err(e) => Err(e),
        };
    }
    if !closed {
        return Err(unclosed(""));
    }
    Err(ToolCallError::new(
        ToolCallErrorKind::MissingFunction,
        None,
        if trimmed.is_empty() {
            "empty <tool_call> block: expected <function=NAME> with <parameter=…> blocks".to_string()
        } else {
            "<tool_call> block holds neither <function=NAME> nor a JSON object".to_string()
        },
        snippet_of(&format!("{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")),
    ))
}

/// The JSON format: `{"name": ..., "arguments": {...} | "<json>"}`.
fn parse_json_call(body: &str) -> Result<ToolCall, ToolCallError> {
    let value: Value = serde_json::from_str(body).map_err(|e| {
        ToolCallError::new(ToolCallErrorKind::InvalidJson, None, format!("tool call is not valid JSON: {e}"), snippet_of(body))
    })?;
    if !value.is_object() {
        return Err(ToolCallError::new(
            ToolCallErrorKind::InvalidJson,
            None,
            "tool call JSON must be an object {\"name\": …, \"arguments\": {…}}",
            snippet_of(body),
        ));
    }
    ToolCall::from_openai(&value)
}

/// `arguments` of the JSON / OpenAI form: absent or null → empty, an object, or a string holding one.
fn arguments_of(args: Option<&Value>, tool: &str, snippet: &str) -> Result<Map<String, Value>, ToolCallError> {
    let bad = |msg: String| ToolCallError::new(ToolCallErrorKind::InvalidArguments, Some(tool), msg, snippet.to_string());
    match args {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(m)) => Ok(m.clone()),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(Map::new()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(other) => Err(bad(format!("arguments of `{tool}` must be a JSON object, found {other}"))),
            Err(e) => Err(bad(format!("arguments of `{tool}` are not valid JSON: {e}"))),
        },
        Some(other) => Err(bad(format!("arguments of `{tool}` must be an object, found {other}"))),
    }
}

/// The XML format, `block` starting at `<function=`. `truncated`: the text ends without `</function>`
/// and without `</tool_call>` (so an unterminated parameter is expected, not an error of its own).
fn parse_xml_call<S: ToolSchemas + ?Sized>(
    block: &str,
    truncated: bool,
    schemas: &S,
) -> Result<(ToolCall, Vec<ToolCallError>), ToolCallError> {
    let head = &block[FUNCTION_OPEN.len()..];
    let malformed = |msg: String| ToolCallError::new(ToolCallErrorKind::MalformedFunction, None, msg, snippet_of(block));
    let Some(gt) = head.find('>') else {
        return Err(malformed("`<function=` has no closing `>`".into()));
    };
    let name = head[..gt].trim();
    if name.is_empty() || name.contains('<') || name.contains('\n') {
        return Err(malformed(format!("`<function=…>` needs a tool name, found {:?}", snippet_of(name))));
    }
    let mut inner = &head[gt + 1..];
    if let Some(end) = inner.find(FUNCTION_CLOSE) {
        inner = &inner[..end];
    } else if truncated {
        return Err(ToolCallError::new(
            ToolCallErrorKind::UnclosedToolCall,
            Some(name),
            format!("call to `{name}` is cut off before </function>"),
            snippet_of(block),
        ));
    }
    let schema = schemas.schema(name).map(parameters_schema);
    let mut arguments = Map::new();
    let mut errors = Vec::new();
    let mut rest = inner;
    while let Some(p) = rest.find(PARAM_OPEN) {
        let head = &rest[p + PARAM_OPEN.len()..];
        let Some(gt) = head.find('>') else {
            return Err(ToolCallError::new(
                ToolCallErrorKind::MalformedParameter,
                Some(name),
                format!("`<parameter=` in the call to `{name}` has no closing `>`"),
                snippet_of(&rest[p..]),
            ));
        };
        let key = head[..gt].trim();
        if key.is_empty() || key.contains('<') || key.contains('\n') {
            return Err(ToolCallError::new(
                ToolCallErrorKind::MalformedParameter,
                Some(name),
                format!("a `<parameter=…>` in the call to `{name}` has no name"),
                snippet_of(&rest[p..]),
            ));
        }
        let body = &head[gt + 1..];
        let Some(end) = body.find(PARAM_CLOSE) else {
            return Err(ToolCallError::new(
                ToolCallErrorKind::UnterminatedParameter,
                Some(name),
                format!("parameter `{key}` of `{name}` is never closed with </parameter>"),
                snippet_of(&rest[p..]),
            ));
        };
        let raw = strip_one_newline(&body[..end]);
        let prop = schema.and_then(|s| s.get("properties")).and_then(|p| p.get(key));
        let value = match coerce(raw, prop) {
            Ok(v) => v,
            Err(expected) => {
                errors.push(ToolCallError::new(
                    ToolCallErrorKind::TypeMismatch,
                    Some(name),
                    format!("parameter `{key}` of `{name}` should be {expected}, got {:?}", snippet_of(raw)),
                    snippet_of(raw),
                ));
                Value::String(raw.to_string())
            }
        };
        arguments.insert(key.to_string(), value);
        rest = &body[end + PARAM_CLOSE.len()..];
    }
    Ok((ToolCall { name: name.to_string(), arguments }, errors))
}

/// `s` without one leading and one trailing newline (`\n` or `\r\n`).
fn strip_one_newline(s: &str) -> &str {
    let s = s.strip_prefix("\r\n").or_else(|| s.strip_prefix('\n')).unwrap_or(s);
    s.strip_suffix("\r\n").or_else(|| s.strip_suffix('\n')).unwrap_or(s)
}

/// JSON-schema type names a property allows (`type` string or list, and `anyOf` / `oneOf` members).
fn schema_types(prop: &Value) -> Vec<String> {
    let mut types = Vec::new();
    match prop.get("type") {
        Some(Value::String(t)) => types.push(t.clone()),
        Some(Value::Array(ts)) => types.extend(ts.iter().filter_map(Value::as_str).map(str::to_string)),
        _ => {}
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(alts)) = prop.get(key) {
            for alt in alts {
                types.extend(schema_types(alt));
            }
        }
    }
    if types.is_empty() {
        // Untyped enum / const: take the types of its values.
        let values: Vec<&Value> = match (prop.get("enum"), prop.get("const")) {
            (Some(Value::Array(vs)), _) => vs.iter().collect(),
            (_, Some(v)) => vec![v],
            _ => Vec::new(),
        };
        for v in values {
            let t = match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
                Value::Number(_) => "number",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            };
            types.push(t.to_string());
        }
    }
    types
}

/// Coerce a raw XML value by its property schema. `Err(expected type)` when a typed value does not parse.
fn coerce(raw: &str, prop: Option<&Value>) -> Result<Value, String> {
    let Some(prop) = prop else {
        return Ok(Value::String(raw.to_string()));
    };
    let types = schema_types(prop);
    if types.is_empty() || types.iter().any(|t| t == "string") && types.len() == 1 {
        return Ok(Value::String(raw.to_string()));
    }
    let t = raw.trim();
    for ty in &types {
        let parsed = match ty.as_str() {
            "null" => matches!(t, "null" | "None" | "NULL").then_some(Value::Null),
            "boolean" => match t.to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "integer" => parse_integer(t),
            "number" => parse_number(t),
            "object" => serde_json::from_str::<Value>(t).ok().filter(Value::is_object),
            "array" => serde_json::from_str::<Value>(t).ok().filter(Value::is_array),
            _ => None,
        };
        if let Some(v) = parsed {
            return Ok(v);
        }
    }
    if types.iter().any(|t| t == "string") {
        return Ok(Value::String(raw.to_string()));
    }
    if types.iter().all(|t| !matches!(t.as_str(), "null" | "boolean" | "integer" | "number" | "object" | "array")) {
        // Types this parser does not know: keep the text.
        return Ok(Value::String(raw.to_string()));
    }
    Err(types.join(" or "))
}

fn parse_integer(t: &str) -> Option<Value> {
    let t = t.strip_prefix('+').unwrap_or(t);
    if let Ok(i) = t.parse::<i64>() {
        return Some(Value::from(i));
    }
    if let Ok(u) = t.parse::<u64>() {
        return Some(Value::from(u));
    }
    // `5.0` → 5.
    let f: f64 = t.parse().ok()?;
    (f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15).then(|| Value::from(f as i64))
}

fn parse_number(t: &str) -> Option<Value> {
    if let Ok(n) = serde_json::from_str::<serde_json::Number>(t) {
        return Some(Value::Number(n));
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    let f: f64 = t.parse().ok()?;
    serde_json::Number::from_f64(f).map(Value::Number)
}

/// At most [`SNIPPET_CHARS`] characters of `s` (cut on a character boundary, `…` marks the cut).
fn snippet_of(s: &str) -> String {
    match s.char_indices().nth(SNIPPET_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// A value as the XML format writes it: strings raw, everything else as JSON.
fn xml_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Calls in the Qwen3.5 XML format (what the chat template renders for assistant `tool_calls`),
/// consecutive blocks separated by a newline.
pub fn render_assistant_tool_calls(calls: &[ToolCall]) -> String {
    let mut out = String::new();
    for (i, call) in calls.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(TOOL_CALL_OPEN);
        out.push_str("\n<function=");
        out.push_str(&call.name);
        out.push_str(">\n");
        for (k, v) in &call.arguments {
            out.push_str(PARAM_OPEN);
            out.push_str(k);
            out.push_str(">\n");
            out.push_str(&xml_value(v));
            out.push('\n');
            out.push_str(PARAM_CLOSE);
            out.push('\n');
        }
        out.push_str(FUNCTION_CLOSE);
        out.push('\n');
        out.push_str(TOOL_CALL_CLOSE);
    }
    out
}

/// A whole assistant reply in the model's own format: optional reasoning in `<think>`, text, then calls.
pub fn render_assistant_reply(reasoning: Option<&str>, text: &str, calls: &[ToolCall]) -> String {
    let mut out = String::new();
    if let Some(r) = reasoning.map(str::trim).filter(|r| !r.is_empty()) {
        out.push_str(THINK_OPEN);
        out.push('\n');
        out.push_str(r);
        out.push('\n');
        out.push_str(THINK_CLOSE);
        out.push_str("\n\n");
    }
    out.push_str(text.trim());
    if !calls.is_empty() {
        if !text.trim().is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(&render_assistant_tool_calls(calls));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strip_one_newline_only_one() {
        assert_eq!(strip_one_newline("\n\nx\n\n"), "\nx\n");
        assert_eq!(strip_one_newline("\r\nx\r\n"), "x");
        assert_eq!(strip_one_newline("x"), "x");
    }

    #[test]
    fn snippet_cuts_on_char_boundary() {
        let s = "价".repeat(300);
        let sn = snippet_of(&s);
        assert_eq!(sn.chars().count(), SNIPPET_CHARS + 1);
    }

    #[test]
    fn schema_types_reads_lists_anyof_and_enums() {
        assert_eq!(schema_types(&json!({"type": ["integer", "null"]})), ["integer", "null"]);
        assert_eq!(schema_types(&json!({"anyOf": [{"type": "number"}, {"type": "string"}]})), ["number", "string"]);
        assert_eq!(schema_types(&json!({"enum": [1, 2]})), ["integer", "integer"]);
    }
}
