//! `POST /v1/completions`: a raw prompt (text, or token ids) continued as plain text (special tokens
//! skipped), as one JSON object or an SSE stream of `text_completion` chunks. One prompt per request.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State as AxState;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::generation::{push_stream_end, push_stream_error, finish_reason, usage, Generation, Permit, Progress};
use super::request::{check_nextn_extension, sampling, wrong_type, Body};
use super::{respond, response_id, sse, unix_now, State};

pub async fn handle(AxState(state): AxState<Arc<State>>, bytes: Bytes) -> Response {
    let arrival = Instant::now();
    let r = run(&state, &bytes, arrival).await;
    respond(&state, r)
}

async fn run(state: &Arc<State>, bytes: &[u8], arrival: Instant) -> Result<Response, ApiError> {
    let body = Body::parse(bytes)?;
    body.check_model(&state.served_model_name)?;
    body.check_single_choice()?;
    body.refuse_unsupported(&["logprobs", "echo", "suffix", "logit_bias"])?;
    check_nextn_extension(state, &body)?;
    let (stream, include_usage) = body.stream()?;
    let prompt = prompt_ids(state, &body)?;
    let params = sampling(state, &body, prompt.len(), "prompt")?;
    let permit = Permit::admit(state)?;
    let mut generation = Generation::start(state, permit, prompt, params, arrival);
    let id = response_id("cmpl", generation.request_id());
    let created = unix_now();
    let model = state.served_model_name.clone();
    if stream {
        let s = CompletionStream { generation, id, created, model, include_usage, sent: 0 };
        let events = futures_util::stream::unfold(Some(s), |s| async move {
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
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": generation.text(true), "logprobs": null, "finish_reason": finish_reason(out.finish_reason)}],
        "usage": usage(generation.prompt_tokens, &out),
    }))
    .into_response())
}

/// `prompt`: a string, an array of token ids, or a one-element array of either.
fn prompt_ids(state: &State, body: &Body) -> Result<Vec<u32>, ApiError> {
    let vocab = state.info.config.vocab_size;
    let ids_of = |a: &[Value], param: &str| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, v)| match v.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(ApiError::invalid(param, format!("token id {id} at index {i} is out of range (vocab size {vocab})"))),
                None => Err(wrong_type(&format!("{param}[{i}]"), "a token id", v)),
            })
            .collect()
    };
    let text_ids = |t: &str| -> Result<Vec<u32>, ApiError> {
        let tok = state.bundle.tokenizer().ok_or_else(|| ApiError::invalid("prompt", "this model has no tokenizer; send token ids"))?;
        tok.encode(t, false).map_err(|e| ApiError::invalid("prompt", format!("cannot tokenise the prompt: {e}")))
    };
    let ids = match body.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => text_ids(s)?,
        Some(Value::Array(a)) => match a.first() {
            Some(Value::Number(_)) | None => ids_of(a, "prompt")?,
            Some(_) if a.len() > 1 => {
                return Err(ApiError::invalid("prompt", "one prompt per request: send a string or one array of token ids"));
            }
            Some(Value::String(s)) => text_ids(s)?,
            Some(Value::Array(inner)) => ids_of(inner, "prompt[0]")?,
            Some(other) => return Err(wrong_type("prompt[0]", "a string or an array of token ids", other)),
        },
        Some(other) => return Err(wrong_type("prompt", "a string or an array of token ids", other)),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    Ok(ids)
}

struct CompletionStream {
    generation: Generation,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Bytes of text sent.
    sent: usize,
}

impl CompletionStream {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Event {
        let v = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        });
        Event::default().data(v.to_string())
    }

    /// Text not sent yet (until the end: without a tail that could begin a stop string).
    fn release(&mut self, text: &str, finished: bool) -> Option<String> {
        let end = if finished { text.len() } else { self.stop_hold(text) };
        if end <= self.sent || !text.is_char_boundary(end) || !text.is_char_boundary(self.sent) {
            return None;
        }
        let out = text[self.sent..end].to_string();
        self.sent = end;
        Some(out)
    }

    /// Where a suffix of `text` that is a proper prefix of a stop string starts (else the end).
    fn stop_hold(&self, text: &str) -> usize {
        let longest = self.generation.stop_strings().iter().map(String::len).max().unwrap_or(0);
        let from = text.len().saturating_sub(longest);
        text.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= from)
            .find(|&i| self.generation.stop_strings().iter().any(|s| s.len() > text.len() - i && s.starts_with(&text[i..])))
            .unwrap_or(text.len())
    }

    async fn next_events(&mut self) -> (Vec<Event>, bool) {
        let mut out = Vec::new();
        match self.generation.next().await {
            Ok(Progress::Token) => {
                let text = self.generation.text(true);
                if !Generation::text_is_partial(&text)
                    && let Some(t) = self.release(&text, false)
                {
                    out.push(self.chunk(&t, None));
                }
                (out, true)
            }
            Ok(Progress::Finished(o)) => {
                let text = self.generation.text(true);
                let rest = self.release(&text, true).unwrap_or_default();
                out.push(self.chunk(&rest, Some(finish_reason(o.finish_reason))));
                let usage_value = self.include_usage.then(|| usage(self.generation.prompt_tokens, &o));
                push_stream_end(&mut out, (&self.id, "text_completion", self.created, &self.model), usage_value);
                (out, false)
            }
            Err(e) => {
                push_stream_error(&mut out, &self.generation, &e);
                (out, false)
            }
        }
    }
}
