//! LLM clients: one synchronous trait, three implementations.
//!
//! * [`EngineClient`]: the in-process [`nextn_engine::Engine`] (the bundled model by default). It renders
//!   the model's chat template with the tool list, generates, and returns the raw reply with its special
//!   markup (`<tool_call>`, `</think>`) intact, so [`crate::toolcall::parse_reply`] sees what the model wrote.
//! * [`OpenAiClient`]: any OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang, …). Tool calls
//!   the server already parsed (`message.tool_calls`) and separated reasoning (`reasoning_content`) are
//!   re-rendered into the Qwen3.5 XML / `<think>` text, so the agent parses one format whichever backend ran.
//! * [`ScriptedClient`]: replays fixed outputs and records the requests, for tests of the agent loop.
//!
//! [`LlmClient::generate`] blocks. Call it from a blocking context (`tokio::task::spawn_blocking` or
//! `block_in_place`); [`OpenAiClient`] also copes with being called on a runtime thread by running its
//! request on a helper thread.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nextn_engine::spec::SpecConfig;
use nextn_engine::tokenizer::TokenizerBundle;
use nextn_engine::{Engine, EngineConfig, EngineError, LoadOptions, Model, SamplingParams};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::toolcall::{render_assistant_tool_calls, ToolCall, THINK_CLOSE, THINK_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

/// One chat-completion request, in OpenAI / HF chat-message terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// Chat messages (`system` / `user` / `assistant` with optional `tool_calls` / `tool`).
    pub messages: Vec<Value>,
    /// OpenAI-style function specs (`{"type": "function", "function": {name, description, parameters}}`).
    pub tools: Vec<Value>,
    /// At most this many generated tokens (≥ 1).
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// The chat template's `enable_thinking` switch (`None`: the template's default).
    pub enable_thinking: Option<bool>,
    /// Stop strings (excluded from the returned text, as OpenAI servers do).
    pub stop: Vec<String>,
}

impl Default for ChatRequest {
    fn default() -> Self {
        ChatRequest {
            messages: Vec::new(),
            tools: Vec::new(),
            max_tokens: 512,
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
            enable_thinking: None,
            stop: Vec::new(),
        }
    }
}

impl ChatRequest {
    pub fn new(messages: Vec<Value>) -> Self {
        ChatRequest { messages, ..Default::default() }
    }
}

/// One model reply with its timing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// Raw model output, including any `<think>` / `<tool_call>` markup.
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Time to first token (for a non-streamed HTTP reply: the whole request).
    pub ttft_ms: f64,
    /// Tokens after the first per second after the first (0 when unknown).
    pub decode_tokens_per_s: f64,
    /// The whole call, prompt rendering / HTTP included.
    pub wall_ms: f64,
    /// `stop`, `length`, `context` (engine) or whatever the server said (`tool_calls`, …).
    pub finish_reason: String,
    /// MTP acceptance statistics when speculating.
    pub spec: Option<Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error("loading the model: {0}")]
    Load(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("rendering the prompt: {0}")]
    Prompt(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot reach the LLM server: {0}")]
    Connect(String),
    #[error("HTTP {status} from the LLM server: {body}")]
    Http { status: u16, body: String },
    #[error("the LLM request timed out")]
    Timeout,
    #[error("unexpected reply from the LLM server: {0}")]
    Protocol(String),
    #[error("the scripted client has no outputs left")]
    Exhausted,
}

/// A chat model the agent can call.
pub trait LlmClient: Send {
    /// What is answering (for traces): `engine:<dir>`, `openai:<url>#<model>`, `scripted`.
    fn name(&self) -> String;
    /// Blocks until the reply is complete.
    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError>;
}

impl<T: LlmClient + ?Sized> LlmClient for Box<T> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        (**self).generate(req)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Rewrites every assistant `tool_calls[i].function.arguments` with `f` (string ↔ object).
pub fn map_tool_call_arguments(messages: &[Value], f: impl Fn(&Value) -> Option<Value>) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for call in calls {
                    let target = if call.get("function").is_some_and(Value::is_object) { &mut call["function"] } else { call };
                    if let Some(new) = target.get("arguments").and_then(&f) {
                        target["arguments"] = new;
                    }
                }
            }
            m
        })
        .collect()
}

/// `text` cut at the earliest occurrence of any stop string.
fn cut_at_stop(text: &mut String, stop: &[String]) {
    if let Some(at) = stop.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(at);
    }
}

// ---------------------------------------------------------------------------------------------
// EngineClient

/// The in-process engine.
pub struct EngineClient {
    engine: Engine,
    bundle: TokenizerBundle,
    name: String,
}

impl EngineClient {
    /// Load a model directory (config, safetensors, tokenizer files, chat template) and build an engine
    /// with default sizing; `spec` turns on MTP speculative decoding.
    pub fn load(model_dir: impl AsRef<Path>, spec: Option<SpecConfig>) -> Result<Self, LlmError> {
        let dir = model_dir.as_ref();
        let opts = LoadOptions { progress_above_bytes: Some(256 << 20) };
        let model = Model::load(dir, &opts).map_err(|e| LlmError::Load(format!("{}: {e}", dir.display())))?;
        let bundle = TokenizerBundle::load(dir).map_err(|e| LlmError::Load(e.to_string()))?;
        let mut client = Self::from_parts(model, bundle, EngineConfig { spec, ..EngineConfig::default() })?;
        client.name = format!("engine:{}", dir.display());
        Ok(client)
    }

    /// An engine over an already built model (e.g. a dummy one) and the tokenizer files to talk to it.
    /// The bundle needs `tokenizer.json` and a chat template.
    pub fn from_parts(model: Model, bundle: TokenizerBundle, cfg: EngineConfig) -> Result<Self, LlmError> {
        let tokenizer = bundle.require_tokenizer().map_err(|e| LlmError::Load(e.to_string()))?.clone();
        if bundle.chat_template().is_none() {
            return Err(LlmError::Load(format!("{} has no chat template", bundle.dir().display())));
        }
        let mut eos = bundle.eos_token_ids().to_vec();
        for id in &model.config().eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let name = format!("engine:{}", bundle.dir().display());
        let engine = Engine::new(model, Some(tokenizer), eos, cfg)?;
        Ok(EngineClient { engine, bundle, name })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
    pub fn bundle(&self) -> &TokenizerBundle {
        &self.bundle
    }

    /// Prompt ids for `req`: the chat template over the messages and tools, with the generation prompt.
    /// Assistant tool-call arguments given as JSON strings (the OpenAI wire form) become objects, which
    /// the template iterates.
    pub fn render_prompt(&self, req: &ChatRequest) -> Result<Vec<u32>, LlmError> {
        let messages = map_tool_call_arguments(&req.messages, |a| match a {
            Value::String(s) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object),
            _ => None,
        });
        let mut extra = Map::new();
        if let Some(t) = req.enable_thinking {
            extra.insert("enable_thinking".into(), json!(t));
        }
        let tools = (!req.tools.is_empty()).then_some(req.tools.as_slice());
        self.bundle.encode_chat(&messages, tools, true, &extra).map_err(|e| LlmError::Prompt(e.to_string()))
    }

    fn sampling(&self, req: &ChatRequest) -> Result<SamplingParams, LlmError> {
        if req.max_tokens == 0 {
            return Err(LlmError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        let mut p = SamplingParams::greedy();
        p.temperature = req.temperature;
        p.top_p = req.top_p;
        if req.temperature > 0.0 {
            // The checkpoint's recommended top_k / min_p apply to sampled requests.
            if let Some(g) = self.bundle.generation_config() {
                p.top_k = g.top_k.map_or(0, |k| k as usize);
                p.min_p = g.min_p.unwrap_or(0.0);
            }
        }
        p.seed = req.seed;
        p.max_new_tokens = req.max_tokens;
        p.stop_strings = req.stop.iter().filter(|s| !s.is_empty()).cloned().collect();
        Ok(p)
    }
}

impl LlmClient for EngineClient {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        let start = Instant::now();
        let params = self.sampling(req)?;
        let prompt = self.render_prompt(req)?;
        let out = self.engine.generate(prompt, params, |_| {})?;
        // Output.text skips special tokens; decode the ids ourselves so markup the tokenizer marks as special
        // (`<tool_call>` in some checkpoints) survives. The EOS that ended the request is dropped.
        let mut ids: &[u32] = &out.token_ids;
        while let Some((last, rest)) = ids.split_last() {
            if self.bundle.is_eos(*last) || self.engine.config().eos_token_ids.contains(last) {
                ids = rest;
            } else {
                break;
            }
        }
        let tokenizer = self.bundle.require_tokenizer().map_err(|e| LlmError::Prompt(e.to_string()))?;
        let mut text = tokenizer.decode(ids, false).map_err(|e| LlmError::Prompt(e.to_string()))?;
        cut_at_stop(&mut text, &req.stop);
        loop {
            let trimmed = ["<|im_end|>", "<|endoftext|>"].iter().find_map(|m| text.strip_suffix(m)).map(str::len);
            match trimmed {
                Some(len) => text.truncate(len),
                None => break,
            }
        }
        let spec = match &out.spec {
            Some(s) => Some(serde_json::to_value(s).map_err(|e| LlmError::Protocol(e.to_string()))?),
            None => None,
        };
        Ok(Generation {
            text,
            prompt_tokens: out.stats.prompt_tokens,
            completion_tokens: out.stats.generated_tokens,
            ttft_ms: out.stats.ttft_ms,
            decode_tokens_per_s: out.stats.decode_tokens_per_s,
            wall_ms: ms(start.elapsed()),
            finish_reason: out.finish_reason.as_str().to_string(),
            spec,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAiClient

/// An OpenAI-compatible `/v1/chat/completions` server.
pub struct OpenAiClient {
    base_url: String,
    model: String,
    api_key: Option<String>,
    timeout: Duration,
    stream: bool,
    http: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for OpenAiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiClient")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("timeout", &self.timeout)
            .field("stream", &self.stream)
            .finish()
    }
}

/// Default whole-request timeout.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(300);

impl OpenAiClient {
    /// `base_url`: the server root (`http://host:8000`) or its `/v1`. Streams by default (for TTFT and
    /// decode speed), 300 s timeout, no API key.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Result<Self, LlmError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| LlmError::Load(format!("HTTP client runtime: {e}")))?;
        let mut client = OpenAiClient {
            base_url: base_url.into().trim_end_matches('/').to_string(),
            model: model.into(),
            api_key: None,
            timeout: DEFAULT_HTTP_TIMEOUT,
            stream: true,
            http: reqwest::Client::new(),
            runtime,
        };
        client.rebuild_http()?;
        Ok(client)
    }

    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Result<Self, LlmError> {
        self.timeout = timeout;
        self.rebuild_http()?;
        Ok(self)
    }

    /// `false`: ask for one JSON reply (TTFT is then the whole request and the decode speed unknown).
    pub fn with_stream(mut self, stream: bool) -> Self {
        self.stream = stream;
        self
    }

    fn rebuild_http(&mut self) -> Result<(), LlmError> {
        self.http = reqwest::Client::builder()
            .timeout(self.timeout)
            .build()
            .map_err(|e| LlmError::Load(format!("HTTP client: {e}")))?;
        Ok(())
    }

    /// The chat-completions URL.
    pub fn url(&self) -> String {
        if self.base_url.ends_with("/v1") {
            format!("{}/chat/completions", self.base_url)
        } else {
            format!("{}/v1/chat/completions", self.base_url)
        }
    }

    /// The JSON body sent for `req`.
    pub fn request_body(&self, req: &ChatRequest) -> Value {
        // The wire form of assistant tool-call arguments is a JSON string.
        let messages = map_tool_call_arguments(&req.messages, |a| match a {
            Value::String(_) => None,
            other => Some(Value::String(other.to_string())),
        });
        let mut body = json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": self.stream,
        });
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        if !req.tools.is_empty() {
            let tools: Vec<Value> = req
                .tools
                .iter()
                .map(|t| if t.get("function").is_some() { t.clone() } else { json!({"type": "function", "function": t}) })
                .collect();
            body["tools"] = Value::Array(tools);
        }
        if let Some(seed) = req.seed {
            body["seed"] = json!(seed);
        }
        let stop: Vec<&String> = req.stop.iter().filter(|s| !s.is_empty()).collect();
        if !stop.is_empty() {
            body["stop"] = json!(stop);
        }
        if let Some(t) = req.enable_thinking {
            // vLLM and SGLang pass these to the chat template.
            body["chat_template_kwargs"] = json!({"enable_thinking": t});
        }
        body
    }

    async fn call(http: &reqwest::Client, url: &str, api_key: Option<&str>, body: &Value) -> Result<Generation, LlmError> {
        let start = Instant::now();
        let mut rb = http.post(url).json(body);
        if let Some(key) = api_key {
            rb = rb.bearer_auth(key);
        }
        let mut resp = rb.send().await.map_err(http_error)?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Err(LlmError::Http { status: status.as_u16(), body });
        }
        // Read the body as it arrives; an SSE stream is parsed line by line, anything else as one JSON.
        let mut acc = StreamAccumulator::default();
        let mut buf: Vec<u8> = Vec::new();
        let mut is_sse: Option<bool> = None;
        while let Some(chunk) = resp.chunk().await.map_err(http_error)? {
            buf.extend_from_slice(&chunk);
            if is_sse.is_none()
                && let Some(first) = buf.iter().find(|b| !b.is_ascii_whitespace())
            {
                is_sse = Some(*first != b'{');
            }
            if is_sse == Some(true) {
                while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=nl).collect();
                    acc.sse_line(&String::from_utf8_lossy(&line), start.elapsed())?;
                }
            }
        }
        let wall = start.elapsed();
        match is_sse {
            Some(true) => {
                if !buf.is_empty() {
                    let line = String::from_utf8_lossy(&buf).to_string();
                    acc.sse_line(&line, wall)?;
                }
                acc.finish(wall)
            }
            _ => {
                let v: Value = serde_json::from_slice(&buf)
                    .map_err(|e| LlmError::Protocol(format!("reply is not JSON ({e}): {}", String::from_utf8_lossy(&buf))))?;
                generation_from_json(&v, wall)
            }
        }
    }
}

fn http_error(e: reqwest::Error) -> LlmError {
    if e.is_timeout() {
        LlmError::Timeout
    } else if e.is_connect() {
        LlmError::Connect(e.to_string())
    } else {
        LlmError::Protocol(e.to_string())
    }
}

/// The raw-text form of an assistant message: `<think>` reasoning, content, then the server-parsed calls
/// rendered in the Qwen3.5 XML format (a call whose arguments are not a JSON object is rendered in the JSON
/// format with its raw arguments, so the agent's parser reports it).
pub fn assistant_text(reasoning: Option<&str>, content: &str, tool_calls: &[Value]) -> String {
    let mut text = String::new();
    if let Some(r) = reasoning.map(str::trim).filter(|r| !r.is_empty()) {
        text.push_str(&format!("{THINK_OPEN}\n{r}\n{THINK_CLOSE}\n\n"));
    }
    text.push_str(content);
    for call in tool_calls {
        if !text.trim().is_empty() {
            text.truncate(text.trim_end().len());
            text.push_str("\n\n");
        }
        match ToolCall::from_openai(call) {
            Ok(c) => text.push_str(&render_assistant_tool_calls(std::slice::from_ref(&c))),
            Err(_) => {
                let f = call.get("function").unwrap_or(call);
                let raw = json!({"name": f.get("name").cloned().unwrap_or(Value::Null), "arguments": f.get("arguments").cloned().unwrap_or(Value::Null)});
                text.push_str(&format!("{TOOL_CALL_OPEN}\n{raw}\n{TOOL_CALL_CLOSE}"));
            }
        }
    }
    text
}

fn usage_of(v: &Value) -> (usize, usize) {
    let u = &v["usage"];
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    (n("prompt_tokens"), n("completion_tokens"))
}

fn reasoning_of(m: &Value) -> Option<&str> {
    m.get("reasoning_content").or_else(|| m.get("reasoning")).and_then(Value::as_str)
}

/// A non-streamed chat-completion reply.
fn generation_from_json(v: &Value, wall: Duration) -> Result<Generation, LlmError> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| LlmError::Protocol(format!("no choices[0] in {}", crate_snippet(v))))?;
    let msg = choice.get("message").ok_or_else(|| LlmError::Protocol("choices[0] has no message".into()))?;
    let content = msg.get("content").and_then(Value::as_str).unwrap_or("");
    let calls = msg.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default();
    let (prompt_tokens, completion_tokens) = usage_of(v);
    Ok(Generation {
        text: assistant_text(reasoning_of(msg), content, &calls),
        prompt_tokens,
        completion_tokens,
        ttft_ms: ms(wall),
        decode_tokens_per_s: 0.0,
        wall_ms: ms(wall),
        finish_reason: choice.get("finish_reason").and_then(Value::as_str).unwrap_or("stop").to_string(),
        spec: None,
    })
}

fn crate_snippet(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// Accumulates a streamed (SSE) chat completion.
#[derive(Default)]
struct StreamAccumulator {
    content: String,
    reasoning: String,
    /// Tool-call deltas by index: (id, name, concatenated arguments).
    calls: Vec<(Value, String, String)>,
    finish_reason: Option<String>,
    usage: Option<(usize, usize)>,
    first: Option<Duration>,
    last: Option<Duration>,
    chunks_with_output: usize,
    done: bool,
}

impl StreamAccumulator {
    fn sse_line(&mut self, line: &str, at: Duration) -> Result<(), LlmError> {
        let line = line.trim();
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(()); // comments, `event:`, blank separators
        };
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value =
            serde_json::from_str(data).map_err(|e| LlmError::Protocol(format!("bad stream chunk ({e}): {data}")))?;
        if let Some(err) = v.get("error") {
            return Err(LlmError::Protocol(format!("server error in stream: {err}")));
        }
        if v.get("usage").is_some_and(Value::is_object) {
            self.usage = Some(usage_of(&v));
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else { return Ok(()) };
        if let Some(fr) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(fr.to_string());
        }
        let Some(delta) = choice.get("delta") else { return Ok(()) };
        let mut produced = false;
        if let Some(c) = delta.get("content").and_then(Value::as_str).filter(|c| !c.is_empty()) {
            self.content.push_str(c);
            produced = true;
        }
        if let Some(r) = reasoning_of(delta).filter(|r| !r.is_empty()) {
            self.reasoning.push_str(r);
            produced = true;
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for call in calls {
                let idx = call.get("index").and_then(Value::as_u64).unwrap_or(self.calls.len().saturating_sub(1) as u64) as usize;
                if idx > 64 {
                    return Err(LlmError::Protocol(format!("tool call index {idx} in stream")));
                }
                while self.calls.len() <= idx {
                    self.calls.push((Value::Null, String::new(), String::new()));
                }
                let slot = &mut self.calls[idx];
                if let Some(id) = call.get("id").filter(|i| !i.is_null()) {
                    slot.0 = id.clone();
                }
                let f = call.get("function").unwrap_or(call);
                if let Some(n) = f.get("name").and_then(Value::as_str) {
                    slot.1.push_str(n);
                }
                match f.get("arguments") {
                    Some(Value::String(a)) => slot.2.push_str(a),
                    Some(Value::Object(o)) => slot.2.push_str(&Value::Object(o.clone()).to_string()),
                    _ => {}
                }
                produced = true;
            }
        }
        if produced {
            self.first.get_or_insert(at);
            self.last = Some(at);
            self.chunks_with_output += 1;
        }
        Ok(())
    }

    fn finish(self, wall: Duration) -> Result<Generation, LlmError> {
        if !self.done && self.finish_reason.is_none() {
            return Err(LlmError::Protocol("the stream ended without finish_reason or [DONE]".into()));
        }
        let calls: Vec<Value> = self
            .calls
            .into_iter()
            .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
            .collect();
        let reasoning = (!self.reasoning.is_empty()).then_some(self.reasoning.as_str());
        let text = assistant_text(reasoning, &self.content, &calls);
        let (prompt_tokens, completion_tokens) = self.usage.unwrap_or((0, self.chunks_with_output));
        let first = self.first.unwrap_or(wall);
        let last = self.last.unwrap_or(first);
        let decode_s = (last - first).as_secs_f64();
        Ok(Generation {
            text,
            prompt_tokens,
            completion_tokens,
            ttft_ms: ms(first),
            decode_tokens_per_s: if completion_tokens > 1 && decode_s > 0.0 {
                (completion_tokens - 1) as f64 / decode_s
            } else {
                0.0
            },
            wall_ms: ms(wall),
            finish_reason: self.finish_reason.unwrap_or_else(|| "stop".into()),
            spec: None,
        })
    }
}

impl LlmClient for OpenAiClient {
    fn name(&self) -> String {
        format!("openai:{}#{}", self.base_url, self.model)
    }

    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        if req.max_tokens == 0 {
            return Err(LlmError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        let body = self.request_body(req);
        let url = self.url();
        let (http, rt, key) = (&self.http, &self.runtime, self.api_key.as_deref());
        let run = || rt.block_on(Self::call(http, &url, key, &body));
        if tokio::runtime::Handle::try_current().is_ok() {
            // On a runtime thread a nested block_on would panic: run the request on a helper thread.
            std::thread::scope(|s| s.spawn(run).join()).unwrap_or_else(|_| Err(LlmError::Protocol("HTTP thread panicked".into())))
        } else {
            run()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ScriptedClient

/// Replays fixed outputs in order (then fails with [`LlmError::Exhausted`]) and records every request.
pub struct ScriptedClient {
    outputs: VecDeque<Result<String, LlmError>>,
    requests: Arc<Mutex<Vec<ChatRequest>>>,
}

impl ScriptedClient {
    pub fn new<I, S>(outputs: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ScriptedClient { outputs: outputs.into_iter().map(|s| Ok(s.into())).collect(), requests: Arc::default() }
    }

    pub fn push(&mut self, output: impl Into<String>) {
        self.outputs.push_back(Ok(output.into()));
    }

    /// Make a later call fail with `err`.
    pub fn push_error(&mut self, err: LlmError) {
        self.outputs.push_back(Err(err));
    }

    pub fn remaining(&self) -> usize {
        self.outputs.len()
    }

    /// A handle to the recorded requests; it stays valid after the client is moved into an agent.
    pub fn requests(&self) -> Arc<Mutex<Vec<ChatRequest>>> {
        Arc::clone(&self.requests)
    }
}

impl LlmClient for ScriptedClient {
    fn name(&self) -> String {
        "scripted".into()
    }

    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        let start = Instant::now();
        self.requests.lock().unwrap_or_else(|p| p.into_inner()).push(req.clone());
        let mut text = self.outputs.pop_front().ok_or(LlmError::Exhausted)??;
        cut_at_stop(&mut text, &req.stop);
        // Token counts are estimates (about four bytes a token).
        let prompt_bytes: usize = req.messages.iter().map(|m| m.to_string().len()).sum();
        Ok(Generation {
            prompt_tokens: prompt_bytes.div_ceil(4),
            completion_tokens: text.len().div_ceil(4).max(1),
            ttft_ms: 0.0,
            decode_tokens_per_s: 0.0,
            wall_ms: ms(start.elapsed()),
            finish_reason: "stop".into(),
            spec: None,
            text,
        })
    }
}
