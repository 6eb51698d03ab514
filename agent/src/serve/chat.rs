//! `POST /v1/chat/completions`: messages (+ tools) → chat template → engine → assistant message with
//! `reasoning_content`, `content` and `tool_calls`, as one JSON object or an SSE stream of chunks.
//!
//! `tool_choice` is implemented in the prompt, not by constrained decoding: `none` renders no tools (and no
//! call is parsed); `auto` and `required` render all tools; a named function renders only that tool. With
//! `required` or a named function the model is still free not to call: the reply then comes back as text
//! with `finish_reason: "stop"`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use super::errors::ApiError;
use super::generation::{push_stream_end, push_stream_error, finish_reason, usage, Generation, Permit, Progress};
use super::reply::{AssistantReply, Delta, IncrementalReply, ReplyOptions};
use super::request::{check_nextn_extension, sampling, wrong_type, Body};
use super::{respond, response_id, sse, unix_now, State};
use crate::llm::map_tool_call_arguments;
use crate::toolcall::THINK_OPEN;

pub async fn handle(AxState(state): AxState<Arc<State>>, bytes: Bytes) -> Response {
    let arrival = Instant::now();
    let r = run(&state, &bytes, arrival).await;
    respond(&state, r)
}

/// A parsed chat request, ready for the engine.
struct Prepared {
    prompt: Vec<u32>,
    reply: ReplyOptions,
}

async fn run(state: &Arc<State>, bytes: &[u8], arrival: Instant) -> Result<Response, ApiError> {
    let body = Body::parse(bytes)?;
    body.check_model(&state.served_model_name)?;
    body.check_single_choice()?;
    body.refuse_unsupported(&["logprobs", "top_logprobs", "response_format", "logit_bias"])?;
    check_nextn_extension(state, &body)?;
    let (stream, include_usage) = body.stream()?;
    let prepared = prepare(state, &body)?;
    let mut params = sampling(state, &body, prepared.prompt.len(), "messages")?;
    params.stop_strings.retain(|s| !s.is_empty());
    let permit = Permit::admit(state)?;
    let mut generation = Generation::start(state, permit, prepared.prompt, params, arrival);
    let id = response_id("chatcmpl", generation.request_id());
    let created = unix_now();
    if stream {
        let streamer = ChatStream {
            generation,
            reply: IncrementalReply::new(prepared.reply.clone()),
            id,
            created,
            model: state.served_model_name.clone(),
            include_usage,
            started: false,
        };
        let events = futures_util::stream::unfold(Some(streamer), |s| async move {
            let mut s = s?;
            let (events, more) = s.next_events().await;
            Some((futures_util::stream::iter(events.into_iter().map(Ok::<Event, Infallible>)), more.then_some(s)))
        })
        .flatten();
        return Ok(sse(events));
    }
    let out = loop {
        if let Progress::Finished(out) = generation.next().await? {
            break out;
        }
    };
    let text = generation.text(false);
    let reply = AssistantReply::parse(&text, &prepared.reply);
    let finish = if reply.tool_calls.is_empty() { finish_reason(out.finish_reason) } else { "tool_calls" };
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": state.served_model_name,
        "choices": [{"index": 0, "message": reply.message(&id), "logprobs": null, "finish_reason": finish}],
        "usage": usage(generation.prompt_tokens, &out),
    }))
    .into_response())
}

/// Messages, tools and `tool_choice` → prompt ids and how to read the reply.
fn prepare(state: &State, body: &Body) -> Result<Prepared, ApiError> {
    let messages = messages(body)?;
    let tools = tools(body)?;
    let tools = apply_tool_choice(body, tools)?;
    let parallel_tool_calls = body.bool("parallel_tool_calls")?.unwrap_or(true);

    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), json!(state.enable_thinking));
    if let Some(kw) = body.object("chat_template_kwargs")? {
        extra.extend(kw.clone());
    }
    let template = state
        .bundle
        .chat_template()
        .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template; use /v1/completions"))?;
    let tools_arg = tools.as_deref().filter(|t| !t.is_empty());
    let text = template
        .render(&messages, tools_arg, true, &extra)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template rejected the messages: {e}")))?;
    let tokenizer = state.bundle.tokenizer().ok_or_else(|| ApiError::invalid("messages", "this model has no tokenizer"))?;
    let prompt = tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", format!("cannot tokenise the prompt: {e}")))?;
    let stop = match body.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).map(str::to_string).collect(),
        _ => Vec::new(),
    };
    let reply = ReplyOptions {
        tools: tools.filter(|t| !t.is_empty()),
        parallel_tool_calls,
        thinking_open: text.trim_end().ends_with(THINK_OPEN),
        stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
    };
    Ok(Prepared { prompt, reply })
}

/// `messages`: roles system / developer / user / assistant / tool; content a string, null or text parts;
/// assistant `tool_calls[].function.arguments` as a JSON string (the wire form) or object.
fn messages(body: &Body) -> Result<Vec<Value>, ApiError> {
    let list = match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        Some(other) => return Err(wrong_type("messages", "an array of messages", other)),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        let obj = m.as_object().ok_or_else(|| wrong_type(&format!("messages[{i}]"), "an object", m))?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(at("role"), "every message needs a `role` string"))?;
        let role = match role {
            "system" | "developer" => "system",
            "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    at("role"),
                    format!("unknown role `{other}`; use system, developer, user, assistant or tool"),
                ));
            }
        };
        let mut msg = obj.clone();
        msg.insert("role".into(), json!(role));
        let content = match obj.get("content") {
            None | Some(Value::Null) => Value::String(String::new()),
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                at(&format!("content[{j}]")),
                                "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                            ));
                        }
                    }
                }
                Value::String(text)
            }
            Some(other) => return Err(wrong_type(&at("content"), "a string, null or an array of text parts", other)),
        };
        msg.insert("content".into(), content);
        if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
            let calls = calls.as_array().ok_or_else(|| wrong_type(&at("tool_calls"), "an array", calls))?;
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").unwrap_or(c);
                if f.get("name").and_then(Value::as_str).is_none() {
                    return Err(ApiError::invalid(at(&format!("tool_calls[{j}].function.name")), "a tool call needs a function name"));
                }
                match f.get("arguments") {
                    None | Some(Value::Object(_)) => {}
                    Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => {}
                    Some(_) => {
                        return Err(ApiError::invalid(
                            at(&format!("tool_calls[{j}].function.arguments")),
                            "tool-call arguments must be a JSON object (or a string holding one)",
                        ));
                    }
                }
            }
        }
        out.push(Value::Object(msg));
    }
    // The template iterates argument objects; the wire form is a string.
    Ok(map_tool_call_arguments(&out, |a| match a {
        Value::String(s) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object),
        _ => None,
    }))
}

/// `tools`: OpenAI function specs.
fn tools(body: &Body) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(v) = body.get("tools") else { return Ok(None) };
    let list = v.as_array().ok_or_else(|| wrong_type("tools", "an array of tools", v))?;
    for (i, t) in list.iter().enumerate() {
        let ok = t.get("type").and_then(Value::as_str) == Some("function")
            && t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).is_some_and(|n| !n.is_empty());
        if !ok {
            return Err(ApiError::invalid(
                format!("tools[{i}]"),
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}",
            ));
        }
    }
    Ok(Some(list.clone()))
}

/// `tool_choice` → the tools the prompt shows (`None`: no tools).
fn apply_tool_choice(body: &Body, tools: Option<Vec<Value>>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(choice) = body.get("tool_choice") else { return Ok(tools) };
    match choice {
        Value::String(s) => match s.as_str() {
            "none" => Ok(None),
            "auto" => Ok(tools),
            "required" => match tools {
                Some(t) if !t.is_empty() => Ok(Some(t)),
                _ => Err(ApiError::invalid("tool_choice", "`tool_choice: \"required\"` needs `tools`")),
            },
            other => Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"),
            )),
        },
        Value::Object(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid("tool_choice", "a named `tool_choice` needs `function.name`"))?;
            let named: Vec<Value> = tools
                .unwrap_or_default()
                .into_iter()
                .filter(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) == Some(name))
                .collect();
            if named.is_empty() {
                return Err(ApiError::invalid("tool_choice", format!("`tool_choice` names `{name}`, which is not in `tools`")));
            }
            Ok(Some(named))
        }
        other => Err(wrong_type("tool_choice", "a string or an object", other)),
    }
}

/// The SSE side of a chat request: one `chat.completion.chunk` per released delta.
struct ChatStream {
    generation: Generation,
    reply: IncrementalReply,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// The first chunk (with `role`) was sent.
    started: bool,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Event {
        let v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        Event::default().data(v.to_string())
    }

    fn delta_events(&mut self, d: &Delta, out: &mut Vec<Event>) {
        if !self.started {
            self.started = true;
            out.push(self.chunk(json!({"role": "assistant", "content": ""}), None));
        }
        if !d.reasoning.is_empty() {
            out.push(self.chunk(json!({"reasoning_content": d.reasoning}), None));
        }
        if !d.content.is_empty() {
            out.push(self.chunk(json!({"content": d.content}), None));
        }
    }

    /// Events for the next engine event; `false` when the stream is over.
    async fn next_events(&mut self) -> (Vec<Event>, bool) {
        let mut out = Vec::new();
        match self.generation.next().await {
            Ok(Progress::Token) => {
                let text = self.generation.text(false);
                if !Generation::text_is_partial(&text) {
                    let d = self.reply.update(&text);
                    if !d.is_empty() || !self.started {
                        self.delta_events(&d, &mut out);
                    }
                }
                (out, true)
            }
            Ok(Progress::Finished(o)) => {
                let text = self.generation.text(false);
                let (d, reply) = self.reply.finish(&text);
                self.delta_events(&d, &mut out);
                // Tool calls: a delta naming each call, then its arguments in fragments.
                for (i, call) in reply.openai_tool_calls(&self.id).iter().enumerate() {
                    let head = json!({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""}}]});
                    out.push(self.chunk(head, None));
                    let args = call["function"]["arguments"].as_str().unwrap_or("{}");
                    for frag in fragments(args, 24) {
                        out.push(self.chunk(json!({"tool_calls": [{"index": i, "function": {"arguments": frag}}]}), None));
                    }
                }
                let finish = if reply.tool_calls.is_empty() { finish_reason(o.finish_reason) } else { "tool_calls" };
                out.push(self.chunk(json!({}), Some(finish)));
                let usage_value = self.include_usage.then(|| usage(self.generation.prompt_tokens, &o));
                push_stream_end(&mut out, (&self.id, "chat.completion.chunk", self.created, &self.model), usage_value);
                (out, false)
            }
            Err(e) => {
                push_stream_error(&mut out, &self.generation, &e);
                (out, false)
            }
        }
    }
}

/// `s` in pieces of about `n` bytes, split on character boundaries.
pub fn fragments(s: &str, n: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < s.len() {
        let mut end = (start + n).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        out.push(&s[start..end]);
        start = end;
    }
    out
}
