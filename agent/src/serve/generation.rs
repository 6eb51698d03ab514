//! One admitted request in the engine: admission permit, the [`RequestHandle`], the ids generated so far,
//! and the latency metrics it records. Dropping it before the end aborts the request (the engine frees its
//! KV blocks and state slot) and counts it as aborted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use nextn_engine::{FinishReason, Output, RequestEvent, RequestHandle, SamplingParams, ServiceError};

use super::errors::ApiError;
use super::metrics::Outcome;
use super::State;

/// A slot under `--max-running + --max-queue`, held from admission until the reply is complete.
pub struct Permit {
    state: Arc<State>,
}

impl Permit {
    /// Admit one more request, or 429 when running + queued requests are at the limit.
    pub fn admit(state: &Arc<State>) -> Result<Permit, ApiError> {
        let prev = state.admitted.fetch_add(1, Ordering::SeqCst);
        if prev >= state.limit {
            state.admitted.fetch_sub(1, Ordering::SeqCst);
            state.metrics.count(Outcome::Overloaded);
            return Err(ApiError::overloaded(state.limit));
        }
        Ok(Permit { state: Arc::clone(state) })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.state.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What [`Generation::next`] saw.
pub enum Progress {
    /// One more token is in [`Generation::ids`].
    Token,
    Finished(Box<Output>),
}

pub struct Generation {
    state: Arc<State>,
    handle: RequestHandle,
    _permit: Permit,
    arrival: Instant,
    last_token: Option<Instant>,
    /// Generated ids so far.
    pub ids: Vec<u32>,
    pub prompt_tokens: usize,
    stop: Vec<String>,
    done: bool,
}

impl Generation {
    pub fn start(state: &Arc<State>, permit: Permit, prompt: Vec<u32>, params: SamplingParams, arrival: Instant) -> Self {
        let prompt_tokens = prompt.len();
        let stop = params.stop_strings.clone();
        let handle = state.engine.submit(prompt, params);
        Generation {
            state: Arc::clone(state),
            handle,
            _permit: permit,
            arrival,
            last_token: None,
            ids: Vec::new(),
            prompt_tokens,
            stop,
            done: false,
        }
    }

    pub fn stop_strings(&self) -> &[String] {
        &self.stop
    }

    /// The engine refused the request after its stream had started.
    pub fn count_rejected(&self) {
        self.state.metrics.count(Outcome::Rejected);
    }

    pub fn request_id(&self) -> u64 {
        self.handle.id()
    }

    /// The next token or the end. Engine refusals become 400s, step failures 500s.
    pub async fn next(&mut self) -> Result<Progress, ApiError> {
        let ev = self.handle.recv_async().await;
        let now = Instant::now();
        let m = &self.state.metrics;
        match ev {
            Ok(RequestEvent::Token(t)) => {
                match self.last_token {
                    None => m.ttft.observe((now - self.arrival).as_secs_f64()),
                    Some(prev) => m.itl.observe((now - prev).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.ids.push(t.token);
                Ok(Progress::Token)
            }
            Ok(RequestEvent::Finished(out)) => {
                self.done = true;
                if out.finish_reason == FinishReason::Abort {
                    m.count(Outcome::Aborted);
                    return Err(ApiError::server(StatusCode::SERVICE_UNAVAILABLE, "the request was aborted (the server is stopping)"));
                }
                m.count(Outcome::Finished);
                m.e2e.observe((now - self.arrival).as_secs_f64());
                if let Some(s) = out.spec.as_ref().filter(|s| s.verify_steps > 0) {
                    m.acceptance_length.observe(s.acceptance_length);
                }
                self.ids.clone_from(&out.token_ids);
                Ok(Progress::Finished(Box::new(out)))
            }
            Ok(RequestEvent::Failed(e)) => {
                self.done = true;
                Err(match e {
                    // Counted as rejected where the 400 is answered (`respond`, or the stream's error event).
                    ServiceError::Rejected(msg) => ApiError::invalid("prompt", msg),
                    other => {
                        m.count(Outcome::Failed);
                        ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, other.to_string())
                    }
                })
            }
            Err(e) => {
                self.done = true;
                m.count(Outcome::Failed);
                Err(ApiError::server(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
            }
        }
    }

    /// The reply text so far: ids without a trailing end-of-sequence token, decoded (special tokens kept
    /// unless `skip_special`), cut at the first stop string.
    pub fn text(&self, skip_special: bool) -> String {
        let mut ids: &[u32] = &self.ids;
        while let Some((last, rest)) = ids.split_last() {
            if self.state.info.eos_ids.contains(last) || self.state.bundle.is_eos(*last) {
                ids = rest;
            } else {
                break;
            }
        }
        let mut text = match self.state.bundle.tokenizer() {
            Some(t) => t.decode(ids, skip_special).unwrap_or_default(),
            None => String::new(),
        };
        if let Some(at) = self.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(at);
        }
        text
    }

    /// A decode that ends inside a multi-byte character shows U+FFFD: wait for the next token.
    pub fn text_is_partial(text: &str) -> bool {
        text.ends_with('\u{FFFD}')
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.done {
            // The handle's drop aborts the request in the engine.
            self.state.metrics.count(Outcome::Aborted);
        }
    }
}

/// OpenAI's `finish_reason` for the engine's.
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Abort => "abort",
    }
}

/// The `usage` object: token counts, plus `spec` when the engine speculated.
pub fn usage(prompt_tokens: usize, out: &Output) -> serde_json::Value {
    let completion = out.token_ids.len();
    let mut u = serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    });
    if let Some(s) = &out.spec {
        u["spec"] = serde_json::json!({
            "drafted": s.drafted,
            "accepted": s.accepted,
            "verify_steps": s.verify_steps,
            "acceptance_length": s.acceptance_length,
            "acceptance_rate": s.acceptance_rate,
            "per_position": s.accepted_per_position,
        });
    }
    u
}

/// The end of a stream: the usage chunk (`object` names the chunk type) when the client asked for it, then `[DONE]`.
pub fn push_stream_end(
    out: &mut Vec<axum::response::sse::Event>,
    head: (&str, &str, u64, &str),
    usage_value: Option<serde_json::Value>,
) {
    let (id, object, created, model) = head;
    if let Some(u) = usage_value {
        let v = serde_json::json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": u});
        out.push(axum::response::sse::Event::default().data(v.to_string()));
    }
    out.push(axum::response::sse::Event::default().data("[DONE]"));
}

/// A stream that failed: the error object, then `[DONE]` (a client error also counts as rejected).
pub fn push_stream_error(out: &mut Vec<axum::response::sse::Event>, generation: &Generation, e: &ApiError) {
    if e.status.is_client_error() {
        generation.count_rejected();
    }
    out.push(axum::response::sse::Event::default().data(e.body().to_string()));
    out.push(axum::response::sse::Event::default().data("[DONE]"));
}
