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
//! request on a helper thread, and may be dropped anywhere (its runtime shuts down in the background).
//! [`ChatRequest::deadline`] bounds every call: the engine aborts the request, the HTTP client times out.
//! Every error names what failed: the endpoint URL, the HTTP status and the server's own message.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nextn_engine::spec::SpecConfig;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::{
    Device, Engine, EngineConfig, EngineError, EngineHandle, EngineService, LoadOptions, Model, ModelSource, RecvError,
    RequestEvent, SamplingParams,
};
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
    /// The completion may not begin with any of these texts (whole tokens of the model's tokenizer: the last
    /// token of each is masked where the completion so far is the rest). Sent to servers as `banned_prefixes`
    /// (a `nextn serve` extension; other servers ignore it).
    #[serde(default)]
    pub banned_prefixes: Vec<String>,
    /// The call must end by then (the agent's request budget); `None`: the client's own timeout.
    #[serde(skip)]
    pub deadline: Option<Instant>,
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
            banned_prefixes: Vec::new(),
            deadline: None,
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
    /// The checkpoint has no `mtp.*` tensors but speculation was asked for.
    #[error("{0} has no MTP head: run without speculation (--spec off)")]
    NoMtpHead(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("rendering the prompt: {0}")]
    Prompt(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the engine failed the request: {0}")]
    Service(String),
    #[error("cannot reach the LLM server at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("HTTP {status} from {url}: {message}")]
    Http { url: String, status: u16, message: String },
    #[error("{url} did not finish within {after_ms} ms")]
    Timeout { url: String, after_ms: u64 },
    #[error("unexpected reply from {url}: {reason}")]
    Protocol { url: String, reason: String },
    #[error("the scripted client has no outputs left")]
    Exhausted,
}

impl LlmError {
    /// Whether the call ran out of time (the request budget or the client's timeout).
    pub fn is_timeout(&self) -> bool {
        matches!(self, LlmError::Timeout { .. })
    }
}

/// A chat model the agent can call.
pub trait LlmClient: Send {
    /// What is answering (for traces): `engine:<dir>`, `openai:<url>#<model>`, `scripted`.
    fn name(&self) -> String;
    /// Blocks until the reply is complete.
    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError>;
    /// Like [`LlmClient::generate`], calling `on_text` with each piece of reply text as it arrives (clients
    /// that cannot stream call it once with the whole text).
    fn generate_stream(&mut self, req: &ChatRequest, on_text: &mut dyn FnMut(&str)) -> Result<Generation, LlmError> {
        let g = self.generate(req)?;
        on_text(&g.text);
        Ok(g)
    }
}

impl<T: LlmClient + ?Sized> LlmClient for Box<T> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        (**self).generate(req)
    }
    fn generate_stream(&mut self, req: &ChatRequest, on_text: &mut dyn FnMut(&str)) -> Result<Generation, LlmError> {
        (**self).generate_stream(req, on_text)
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

/// The in-process engine on its worker thread ([`EngineService`]) plus the tokenizer files to talk to it.
/// Hand out one [`EngineClient`] per caller with [`LocalEngine::client`]: requests from all of them are
/// batched together (continuous batching), as concurrent agents or a replay at concurrency N need.
pub struct LocalEngine {
    service: Arc<EngineService>,
    bundle: Arc<TokenizerBundle>,
    name: String,
}

impl LocalEngine {
    /// Load a model directory (config, safetensors, tokenizer files, chat template) and start an engine with
    /// default sizing; `spec` turns on MTP speculative decoding (a checkpoint without an MTP head is then
    /// [`LlmError::NoMtpHead`]).
    pub fn load(model_dir: impl AsRef<Path>, spec: Option<SpecConfig>) -> Result<Self, LlmError> {
        Self::load_with(model_dir, EngineConfig { spec, ..EngineConfig::default() })
    }

    /// [`LocalEngine::load`] with explicit engine sizing, on the CPU.
    pub fn load_with(model_dir: impl AsRef<Path>, cfg: EngineConfig) -> Result<Self, LlmError> {
        Self::load_on(model_dir, Device::Cpu, cfg)
    }

    /// [`LocalEngine::load_with`] on `device`: on the CPU the model is loaded into host memory (a progress bar
    /// for large checkpoints); on CUDA the checkpoint is opened and the backend uploads it tensor by tensor
    /// (a build without `--features cuda` says so).
    pub fn load_on(model_dir: impl AsRef<Path>, device: Device, cfg: EngineConfig) -> Result<Self, LlmError> {
        let dir = model_dir.as_ref();
        let opts = LoadOptions { progress_above_bytes: Some(256 << 20) };
        let source = ModelSource::for_device(dir, device, &opts).map_err(|e| LlmError::Load(format!("{}: {e}", dir.display())))?;
        if cfg.spec.is_some() && !source.has_mtp() {
            return Err(LlmError::NoMtpHead(dir.display().to_string()));
        }
        let bundle = TokenizerBundle::load(dir).map_err(|e| LlmError::Load(e.to_string()))?;
        let mut engine = Self::from_source(device, source, bundle, cfg)?;
        engine.name = format!("engine:{}", dir.display());
        Ok(engine)
    }

    /// An engine over an already built model (e.g. a dummy one) and the tokenizer files to talk to it.
    /// The bundle needs `tokenizer.json` and a chat template.
    pub fn from_parts(model: Model, bundle: TokenizerBundle, cfg: EngineConfig) -> Result<Self, LlmError> {
        Self::from_source(Device::Cpu, ModelSource::Loaded(model), bundle, cfg)
    }

    /// [`LocalEngine::from_parts`] from any [`ModelSource`] on `device`.
    pub fn from_source(device: Device, source: ModelSource, bundle: TokenizerBundle, cfg: EngineConfig) -> Result<Self, LlmError> {
        let tokenizer = bundle.require_tokenizer().map_err(|e| LlmError::Load(e.to_string()))?.clone();
        if bundle.chat_template().is_none() {
            return Err(LlmError::Load(format!("{} has no chat template", bundle.dir().display())));
        }
        let mut eos = bundle.eos_token_ids().to_vec();
        for id in &source.config().eos_token_ids {
            if !eos.contains(id) {
                eos.push(*id);
            }
        }
        let name = format!("engine:{}", bundle.dir().display());
        let service = EngineService::spawn(move || Engine::on_device(device, source, Some(tokenizer), eos, cfg))?;
        Ok(LocalEngine { service: Arc::new(service), bundle: Arc::new(bundle), name })
    }

    /// A client sharing this engine.
    pub fn client(&self) -> EngineClient {
        EngineClient {
            handle: self.service.handle(),
            service: Arc::clone(&self.service),
            bundle: Arc::clone(&self.bundle),
            name: self.name.clone(),
        }
    }

    pub fn handle(&self) -> EngineHandle {
        self.service.handle()
    }

    pub fn bundle(&self) -> &TokenizerBundle {
        &self.bundle
    }
}

/// One caller's view of a [`LocalEngine`]: cheap to clone; the engine stops when the last client and the
/// `LocalEngine` are gone.
#[derive(Clone)]
pub struct EngineClient {
    handle: EngineHandle,
    /// Keeps the worker alive as long as any client exists.
    service: Arc<EngineService>,
    bundle: Arc<TokenizerBundle>,
    name: String,
}

impl EngineClient {
    /// A client over its own engine (see [`LocalEngine::load`]).
    pub fn load(model_dir: impl AsRef<Path>, spec: Option<SpecConfig>) -> Result<Self, LlmError> {
        Ok(LocalEngine::load(model_dir, spec)?.client())
    }

    /// A client over its own engine built from parts (see [`LocalEngine::from_parts`]).
    pub fn from_parts(model: Model, bundle: TokenizerBundle, cfg: EngineConfig) -> Result<Self, LlmError> {
        Ok(LocalEngine::from_parts(model, bundle, cfg)?.client())
    }

    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }
    pub fn bundle(&self) -> &TokenizerBundle {
        &self.bundle
    }
    /// How many clients (and the `LocalEngine`) share this engine.
    pub fn sharers(&self) -> usize {
        Arc::strong_count(&self.service)
    }

    /// Prompt ids for `req`: the chat template over the messages and tools, with the generation prompt.
    /// Assistant tool-call arguments given as JSON strings (the OpenAI wire form) become objects, which
    /// the template iterates.
    pub fn render_prompt(&self, req: &ChatRequest) -> Result<Vec<u32>, LlmError> {
        let text = render_prompt_text(&self.bundle, req)?;
        let tokenizer = self.bundle.require_tokenizer().map_err(|e| LlmError::Prompt(e.to_string()))?;
        tokenizer.encode(&text, false).map_err(|e| LlmError::Prompt(e.to_string()))
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
        if req.banned_prefixes.iter().any(|s| !s.is_empty()) {
            let tokenizer = self.bundle.require_tokenizer().map_err(|e| LlmError::Prompt(e.to_string()))?;
            p.banned_prefixes = req
                .banned_prefixes
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| tokenizer.encode(s, false).map_err(|e| LlmError::Prompt(e.to_string())))
                .collect::<Result<_, _>>()?;
        }
        Ok(p)
    }

    /// The reply text of `ids`: decoded with special tokens kept (so markup the tokenizer marks as special,
    /// `<tool_call>` in some checkpoints, survives), the ending EOS and end-of-turn markers dropped.
    fn reply_text(&self, ids: &[u32], stop: &[String]) -> Result<String, LlmError> {
        let eos = &self.handle.info().eos_ids;
        let mut ids = ids;
        while let Some((last, rest)) = ids.split_last() {
            if self.bundle.is_eos(*last) || eos.contains(last) {
                ids = rest;
            } else {
                break;
            }
        }
        let tokenizer = self.bundle.require_tokenizer().map_err(|e| LlmError::Prompt(e.to_string()))?;
        let mut text = tokenizer.decode(ids, false).map_err(|e| LlmError::Prompt(e.to_string()))?;
        cut_at_stop(&mut text, stop);
        loop {
            let trimmed = ["<|im_end|>", "<|endoftext|>"].iter().find_map(|m| text.strip_suffix(m)).map(str::len);
            match trimmed {
                Some(len) => text.truncate(len),
                None => break,
            }
        }
        Ok(text)
    }
}

impl LlmClient for EngineClient {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        self.generate_stream(req, &mut |_| {})
    }

    fn generate_stream(&mut self, req: &ChatRequest, on_text: &mut dyn FnMut(&str)) -> Result<Generation, LlmError> {
        let start = Instant::now();
        let params = self.sampling(req)?;
        let prompt = self.render_prompt(req)?;
        let mut request = self.handle.submit(prompt, params);
        let out = loop {
            match request.recv_deadline(req.deadline) {
                Ok(RequestEvent::Token(t)) => {
                    if !t.text.is_empty() {
                        on_text(&t.text);
                    }
                }
                Ok(RequestEvent::Finished(out)) => break out,
                Ok(RequestEvent::Failed(e)) => return Err(LlmError::Service(e.to_string())),
                // Dropping `request` aborts it: its KV blocks and state slot are freed at the next step.
                Err(RecvError::Timeout) => {
                    return Err(LlmError::Timeout { url: self.name.clone(), after_ms: ms(start.elapsed()) as u64 });
                }
                Err(RecvError::Stopped) => return Err(LlmError::Service("the engine worker has stopped".into())),
            }
        };
        let text = self.reply_text(&out.token_ids, &req.stop)?;
        let spec = match &out.spec {
            Some(s) => Some(serde_json::to_value(s).map_err(|e| LlmError::Service(e.to_string()))?),
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
    /// Its own small runtime (the trait is blocking). `Option` so `Drop` can shut it down without blocking:
    /// the agent may drop the client inside an async context, where a blocking runtime drop panics.
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for OpenAiClient {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
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

/// The harness directory and version the model served at `base_url` declares (`nextn serve` reports them in
/// `/v1/models` as `nextn.harness` / `nextn.harness_version`), when that directory is on this machine: what
/// `nextn agent --llm URL` and `nextn-bench replay --llm URL` run without `--harness`. `model`: the entry with
/// that id, else the only one. A declared directory that is not here is said on stderr; an endpoint that does
/// not answer within 3 s, or answers without one, gives `None` (its problems show on the first call).
pub fn served_harness(base_url: &str, model: &str, api_key: Option<String>) -> Option<(std::path::PathBuf, String)> {
    let mut client = OpenAiClient::new(base_url, model).ok()?;
    if let Some(key) = api_key {
        client = client.with_api_key(key);
    }
    let list = client.models(Duration::from_secs(3)).ok()?;
    let models = list["data"].as_array()?;
    let entry = models.iter().find(|m| m["id"] == model).or(if models.len() == 1 { models.first() } else { None })?;
    let declared = entry["nextn"]["harness"].as_str()?;
    let version = entry["nextn"]["harness_version"].as_str().unwrap_or_default().to_string();
    let dir = std::path::PathBuf::from(declared);
    if !dir.is_dir() {
        eprintln!(
            "note: the served model {} declares harness {declared}, which is not on this machine; using the bundled harness/default (pass --harness DIR)",
            entry["id"]
        );
        return None;
    }
    Some((dir, version))
}

/// Default whole-request timeout when the request carries no deadline.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long establishing the TCP connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

impl OpenAiClient {
    /// `base_url`: the server root (`http://host:8000`) or its `/v1`. Streams by default (for TTFT and
    /// decode speed), 60 s timeout (or the request's deadline, whichever comes first), no API key.
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
            runtime: Some(runtime),
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
            .connect_timeout(CONNECT_TIMEOUT.min(self.timeout))
            .build()
            .map_err(|e| LlmError::Load(format!("HTTP client: {e}")))?;
        Ok(())
    }

    /// The model list (`GET /v1/models`) as JSON, within `timeout`. Called outside any async runtime (at
    /// start-up, before the agent's own).
    pub fn models(&self, timeout: Duration) -> Result<Value, LlmError> {
        let url = match self.base_url.ends_with("/v1") {
            true => format!("{}/models", self.base_url),
            false => format!("{}/v1/models", self.base_url),
        };
        let Some(rt) = self.runtime.as_ref() else {
            return Err(LlmError::Protocol { url, reason: "the HTTP runtime is shut down".into() });
        };
        let start = Instant::now();
        let mut rb = self.http.get(&url).timeout(timeout);
        if let Some(key) = &self.api_key {
            rb = rb.bearer_auth(key);
        }
        rt.block_on(async {
            let resp = rb.send().await.map_err(|e| http_error(&url, e, start))?;
            let status = resp.status();
            let text = resp.text().await.map_err(|e| http_error(&url, e, start))?;
            if !status.is_success() {
                return Err(LlmError::Http { url: url.clone(), status: status.as_u16(), message: error_message(&text) });
            }
            serde_json::from_str(&text).map_err(|e| LlmError::Protocol { url: url.clone(), reason: format!("model list: {e}") })
        })
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
        let banned: Vec<&String> = req.banned_prefixes.iter().filter(|s| !s.is_empty()).collect();
        if !banned.is_empty() {
            body["banned_prefixes"] = json!(banned);
        }
        if let Some(t) = req.enable_thinking {
            // vLLM and SGLang pass these to the chat template.
            body["chat_template_kwargs"] = json!({"enable_thinking": t});
        }
        body
    }

    async fn call(
        http: &reqwest::Client,
        url: &str,
        api_key: Option<&str>,
        body: &Value,
        timeout: Duration,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, LlmError> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        let timed_out = || LlmError::Timeout { url: url.to_string(), after_ms: ms(start.elapsed()) as u64 };
        let mut rb = http.post(url).json(body);
        if let Some(key) = api_key {
            rb = rb.bearer_auth(key);
        }
        let mut resp = match tokio::time::timeout_at(deadline, rb.send()).await {
            Ok(r) => r.map_err(|e| http_error(url, e, start))?,
            Err(_) => return Err(timed_out()),
        };
        let status = resp.status();
        if !status.is_success() {
            let text = match tokio::time::timeout_at(deadline, resp.text()).await {
                Ok(Ok(t)) => t,
                _ => String::new(),
            };
            return Err(LlmError::Http { url: url.to_string(), status: status.as_u16(), message: error_message(&text) });
        }
        // Read the body as it arrives; an SSE stream is parsed line by line, anything else as one JSON.
        let mut acc = StreamAccumulator::default();
        let mut buf: Vec<u8> = Vec::new();
        let mut is_sse: Option<bool> = None;
        let protocol = |reason: String| LlmError::Protocol { url: url.to_string(), reason };
        loop {
            let chunk = match tokio::time::timeout_at(deadline, resp.chunk()).await {
                Ok(c) => c.map_err(|e| http_error(url, e, start))?,
                Err(_) => return Err(timed_out()),
            };
            let Some(chunk) = chunk else { break };
            buf.extend_from_slice(&chunk);
            if is_sse.is_none()
                && let Some(first) = buf.iter().find(|b| !b.is_ascii_whitespace())
            {
                is_sse = Some(*first != b'{');
            }
            if is_sse == Some(true) {
                while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=nl).collect();
                    acc.sse_line(&String::from_utf8_lossy(&line), start.elapsed(), on_text).map_err(protocol)?;
                }
            }
        }
        let wall = start.elapsed();
        match is_sse {
            Some(true) => {
                if !buf.is_empty() {
                    let line = String::from_utf8_lossy(&buf).to_string();
                    acc.sse_line(&line, wall, on_text).map_err(protocol)?;
                }
                acc.finish(wall).map_err(protocol)
            }
            _ => {
                let v: Value = serde_json::from_slice(&buf).map_err(|e| {
                    protocol(format!("reply is not JSON ({e}): {}", snippet(&String::from_utf8_lossy(&buf))))
                })?;
                let g = generation_from_json(&v, wall).map_err(protocol)?;
                on_text(&g.text);
                Ok(g)
            }
        }
    }
}

fn http_error(url: &str, e: reqwest::Error, start: Instant) -> LlmError {
    if e.is_timeout() {
        LlmError::Timeout { url: url.to_string(), after_ms: ms(start.elapsed()) as u64 }
    } else if e.is_connect() {
        // reqwest's top-level text is generic; the source chain says why (refused, unreachable...).
        let mut reason = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            reason = s.to_string();
            src = s.source();
        }
        LlmError::Connect { url: url.to_string(), reason }
    } else {
        LlmError::Protocol { url: url.to_string(), reason: format!("the connection failed mid-reply: {e}") }
    }
}

/// The server's own message from an error body (`{"error": {"message": ...}}`, `{"message": ...}`,
/// `{"detail": ...}`), else the body itself, shortened.
fn error_message(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        let msg = v["error"]["message"].as_str().or(v["error"].as_str()).or(v["message"].as_str()).or(v["detail"].as_str());
        if let Some(m) = msg {
            return m.to_string();
        }
    }
    if body.trim().is_empty() { "(empty body)".into() } else { snippet(body) }
}

fn snippet(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
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
fn generation_from_json(v: &Value, wall: Duration) -> Result<Generation, String> {
    if let Some(err) = v.get("error") {
        return Err(format!("server error: {}", error_message(&json!({"error": err}).to_string())));
    }
    let choice = v.get("choices").and_then(|c| c.get(0)).ok_or_else(|| format!("no choices[0] in {}", snippet(&v.to_string())))?;
    let msg = choice.get("message").ok_or_else(|| "choices[0] has no message".to_string())?;
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
    fn sse_line(&mut self, line: &str, at: Duration, on_text: &mut dyn FnMut(&str)) -> Result<(), String> {
        let line = line.trim();
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(()); // comments, `event:`, blank separators
        };
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("bad stream chunk ({e}): {}", snippet(data)))?;
        if let Some(err) = v.get("error") {
            return Err(format!("server error in stream: {}", error_message(&json!({"error": err}).to_string())));
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
            on_text(c);
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
                    return Err(format!("tool call index {idx} in stream"));
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

    fn finish(self, wall: Duration) -> Result<Generation, String> {
        if !self.done && self.finish_reason.is_none() {
            return Err("the stream was cut: it ended without finish_reason or [DONE]".into());
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
        self.generate_stream(req, &mut |_| {})
    }

    fn generate_stream(&mut self, req: &ChatRequest, on_text: &mut dyn FnMut(&str)) -> Result<Generation, LlmError> {
        if req.max_tokens == 0 {
            return Err(LlmError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        let url = self.url();
        let timeout = match req.deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(self.timeout),
            None => self.timeout,
        };
        if timeout.is_zero() {
            return Err(LlmError::Timeout { url, after_ms: 0 });
        }
        let body = self.request_body(req);
        let (http, key) = (&self.http, self.api_key.as_deref());
        let Some(rt) = self.runtime.as_ref() else {
            return Err(LlmError::Protocol { url, reason: "the HTTP runtime is shut down".into() });
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // On a runtime thread a nested block_on would panic: run the request on a helper thread. The
            // callback crosses threads, so pieces are sent back and replayed here in order.
            let (tx, rx) = std::sync::mpsc::channel::<String>();
            let result = std::thread::scope(|s| {
                let worker = s.spawn(|| {
                    let mut forward = |t: &str| {
                        let _ = tx.send(t.to_string());
                    };
                    let r = rt.block_on(Self::call(http, &url, key, &body, timeout, &mut forward));
                    drop(tx);
                    r
                });
                for piece in rx.iter() {
                    on_text(&piece);
                }
                worker.join()
            });
            result.unwrap_or_else(|_| Err(LlmError::Protocol { url: url.clone(), reason: "the HTTP thread panicked".into() }))
        } else {
            rt.block_on(Self::call(http, &url, key, &body, timeout, on_text))
        }
    }
}

/// The prompt text the engine feeds the model for `req`: the bundle's chat template over the messages and
/// tools, with the generation prompt. Assistant tool-call arguments given as JSON strings (the OpenAI wire
/// form) become objects, which the template iterates. `nextn harness render` prints this text, so training
/// data is byte-identical to what the agent sends.
pub fn render_prompt_text(bundle: &TokenizerBundle, req: &ChatRequest) -> Result<String, LlmError> {
    let messages = map_tool_call_arguments(&req.messages, |a| match a {
        Value::String(s) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object),
        _ => None,
    });
    let mut extra = Map::new();
    if let Some(t) = req.enable_thinking {
        extra.insert("enable_thinking".into(), json!(t));
    }
    let tools = (!req.tools.is_empty()).then_some(req.tools.as_slice());
    let template = bundle
        .chat_template()
        .ok_or_else(|| LlmError::Prompt(format!("{} has no chat template", bundle.dir().display())))?;
    template.render(&messages, tools, true, &extra).map_err(|e| LlmError::Prompt(e.to_string()))
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
