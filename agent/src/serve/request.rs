//! Reading a request body: typed fields that name themselves in errors, sampling parameters, the `nextn`
//! extension object. Shared by `/v1/chat/completions` and `/v1/completions`.

use nextn_engine::sample::SamplingError;
use nextn_engine::SamplingParams;
use serde_json::{Map, Value};

use super::errors::ApiError;
use super::State;

/// A JSON request body; each getter checks one field's type and names it on error.
pub struct Body(pub Map<String, Value>);

impl Body {
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::bad_body(format!("the body is not valid JSON: {e}")))?;
        match v {
            Value::Object(m) => Ok(Body(m)),
            other => Err(ApiError::bad_body(format!("the body must be a JSON object, got {}", kind(&other)))),
        }
    }

    /// The field, `None` when absent or `null`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        self.get(name)
            .map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| wrong_type(name, "a number", v)))
            .transpose()
    }

    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        self.get(name).map(|v| v.as_i64().ok_or_else(|| wrong_type(name, "an integer", v))).transpose()
    }

    pub fn u64(&self, name: &str) -> Result<Option<u64>, ApiError> {
        self.get(name).map(|v| v.as_u64().ok_or_else(|| wrong_type(name, "a non-negative integer", v))).transpose()
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name).map(|v| v.as_bool().ok_or_else(|| wrong_type(name, "a boolean", v))).transpose()
    }

    pub fn str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        self.get(name).map(|v| v.as_str().ok_or_else(|| wrong_type(name, "a string", v))).transpose()
    }

    pub fn object(&self, name: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        self.get(name).map(|v| v.as_object().ok_or_else(|| wrong_type(name, "an object", v))).transpose()
    }

    /// `model`, when given, must be the served name (or `default`, which clients that do not know the name send,
    /// `nextn agent --llm URL` among them).
    pub fn check_model(&self, served: &str) -> Result<(), ApiError> {
        match self.str("model")? {
            Some(m) if m != served && m != "default" => Err(ApiError::unknown_model(m, served)),
            _ => Ok(()),
        }
    }

    /// `n` (and `best_of`) must be 1: one choice per request.
    pub fn check_single_choice(&self) -> Result<(), ApiError> {
        for name in ["n", "best_of"] {
            if let Some(n) = self.u64(name)?
                && n != 1
            {
                return Err(ApiError::invalid(name, format!("`{name}` must be 1 (this server returns one choice per request), got {n}")));
            }
        }
        Ok(())
    }

    /// `stream`, and `stream_options.include_usage`.
    pub fn stream(&self) -> Result<(bool, bool), ApiError> {
        let stream = self.bool("stream")?.unwrap_or(false);
        let include_usage = match self.object("stream_options")? {
            Some(o) => match o.get("include_usage").filter(|v| !v.is_null()) {
                Some(v) => v.as_bool().ok_or_else(|| wrong_type("stream_options.include_usage", "a boolean", v))?,
                None => false,
            },
            None => false,
        };
        if include_usage && !stream {
            return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed with `stream: true`"));
        }
        Ok((stream, include_usage))
    }

    /// Features this server does not implement, refused by name rather than ignored.
    pub fn refuse_unsupported(&self, names: &[&str]) -> Result<(), ApiError> {
        for name in names {
            match self.get(name) {
                None | Some(Value::Bool(false)) => {}
                Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
                Some(_) => return Err(ApiError::invalid(*name, format!("`{name}` is not supported by this server"))),
            }
        }
        Ok(())
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub fn wrong_type(name: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(name, format!("`{name}` must be {want}, got {}", kind(got)))
}

/// Sampling parameters from the body. Missing `temperature` / `top_p` / `top_k` / `min_p` take the
/// checkpoint's `generation_config.json` values (as vLLM does), else greedy. `max_tokens` (or
/// `max_completion_tokens`) defaults to the rest of the context; a prompt + `max_tokens` over the context is a
/// 400. `prompt_param` names the field that holds the prompt, for the context-length error.
pub fn sampling(state: &State, body: &Body, prompt_len: usize, prompt_param: &str) -> Result<SamplingParams, ApiError> {
    let defaults = state.bundle.generation_config();
    let mut p = SamplingParams::greedy();
    p.temperature = body.f32("temperature")?.or(defaults.and_then(|g| g.temperature)).unwrap_or(0.0);
    p.top_p = body.f32("top_p")?.or(defaults.and_then(|g| g.top_p)).unwrap_or(1.0);
    p.top_k = match body.i64("top_k")? {
        Some(k) if k < -1 => return Err(ApiError::invalid("top_k", format!("`top_k` must be -1 or 0 (off) or a positive count, got {k}"))),
        Some(k) => k.max(0) as usize,
        None => defaults.and_then(|g| g.top_k).map_or(0, |k| k as usize),
    };
    p.min_p = body.f32("min_p")?.or(defaults.and_then(|g| g.min_p)).unwrap_or(0.0);
    p.seed = match body.get("seed") {
        None => None,
        Some(v) => Some(v.as_u64().or_else(|| v.as_i64().map(|s| s as u64)).ok_or_else(|| wrong_type("seed", "an integer", v))?),
    };
    p.stop_strings = match body.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| s.as_str().map(str::to_string).ok_or_else(|| wrong_type(&format!("stop[{i}]"), "a string", s)))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong_type("stop", "a string or an array of strings", other)),
    };
    p.ignore_eos = body.bool("ignore_eos")?.unwrap_or(false);
    p.banned_prefixes = match body.get("banned_prefixes") {
        None => Vec::new(),
        Some(Value::Array(a)) => {
            let tokenizer = state.bundle.tokenizer().ok_or_else(|| {
                ApiError::invalid("banned_prefixes", "this model has no tokenizer to turn `banned_prefixes` into tokens")
            })?;
            let mut out = Vec::with_capacity(a.len());
            for (i, s) in a.iter().enumerate() {
                let text = s.as_str().ok_or_else(|| wrong_type(&format!("banned_prefixes[{i}]"), "a string", s))?;
                if text.is_empty() {
                    return Err(ApiError::invalid("banned_prefixes", format!("`banned_prefixes[{i}]` is empty (it would ban nothing)")));
                }
                let ids = tokenizer
                    .encode(text, false)
                    .map_err(|e| ApiError::invalid("banned_prefixes", format!("`banned_prefixes[{i}]` does not tokenize: {e}")))?;
                out.push(ids);
            }
            out
        }
        Some(other) => return Err(wrong_type("banned_prefixes", "an array of strings", other)),
    };

    let limit = state.info.max_model_len;
    if prompt_len >= limit {
        return Err(ApiError::invalid(
            prompt_param,
            format!("the prompt is {prompt_len} tokens, and this model's context is {limit} tokens (prompt + completion); shorten it"),
        )
        .with_code("context_length_exceeded"));
    }
    let room = limit - prompt_len;
    let (max_name, max) = match (body.u64("max_completion_tokens")?, body.u64("max_tokens")?) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    p.max_new_tokens = match max {
        None => room,
        Some(0) => return Err(ApiError::invalid(max_name, format!("`{max_name}` must be at least 1"))),
        Some(m) if m as usize > room => {
            return Err(ApiError::invalid(
                max_name,
                format!(
                    "`{max_name}` is {m}, but the prompt is {prompt_len} tokens and the context {limit}: at most {room} tokens can be generated"
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Some(m) => m as usize,
    };

    p.validate(state.info.config.vocab_size).map_err(|e| sampling_error(&e, max_name))?;
    Ok(p)
}

/// The request field behind a [`SamplingError`].
fn sampling_error(e: &SamplingError, max_name: &str) -> ApiError {
    let param = match e {
        SamplingError::MaxNewTokens => max_name,
        SamplingError::EmptyStopString { .. } => "stop",
        other => other.parameter(),
    };
    ApiError::invalid(param, e.to_string())
}

/// The `nextn` extension object: `{"spec": "mtp" | "off", "draft_steps": N}`. The engine has one speculation
/// setting for all requests, so a request may only restate it; anything else is a 400 naming the field.
pub fn check_nextn_extension(state: &State, body: &Body) -> Result<(), ApiError> {
    let Some(ext) = body.object("nextn")? else { return Ok(()) };
    let engine_steps = state.info.draft_steps;
    let engine_spec = if engine_steps.is_some() { "mtp" } else { "off" };
    for (key, v) in ext {
        match key.as_str() {
            "spec" => {
                let want = v.as_str().ok_or_else(|| wrong_type("nextn.spec", "\"mtp\" or \"off\"", v))?;
                if !matches!(want, "mtp" | "off") {
                    return Err(ApiError::invalid("nextn.spec", format!("`nextn.spec` must be \"mtp\" or \"off\", got {want:?}")));
                }
                if want != engine_spec {
                    return Err(ApiError::invalid(
                        "nextn.spec",
                        format!(
                            "`nextn.spec` is {want:?}, but speculation is set per server, not per request: this server runs \
                             with --spec {engine_spec}; start a server with --spec {want} (or drop the field)"
                        ),
                    ));
                }
            }
            "draft_steps" => {
                let want = v.as_u64().ok_or_else(|| wrong_type("nextn.draft_steps", "a positive integer", v))?;
                if engine_steps != Some(want as usize) {
                    let have = engine_steps.map_or("speculation off".to_string(), |k| format!("--draft-steps {k}"));
                    return Err(ApiError::invalid(
                        "nextn.draft_steps",
                        format!(
                            "`nextn.draft_steps` is {want}, but draft steps are set per server, not per request: this server runs \
                             with {have}; start a server with --spec mtp --draft-steps {want} (or drop the field)"
                        ),
                    ));
                }
            }
            other => {
                return Err(ApiError::invalid(
                    format!("nextn.{other}"),
                    format!("unknown field `nextn.{other}`; `nextn` takes `spec` and `draft_steps`"),
                ));
            }
        }
    }
    Ok(())
}
