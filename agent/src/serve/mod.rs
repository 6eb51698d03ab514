//! `nextn serve`: an OpenAI-compatible HTTP server over one [`EngineService`](nextn_engine::EngineService).
//!
//! Every request is rendered (chat template + tools) and tokenised on the HTTP side, admitted against
//! `--max-running + --max-queue` (429 beyond), and submitted to the one engine worker, which batches all
//! requests in flight continuously. Streams are SSE; a client that disconnects drops its stream, which drops
//! the [`RequestHandle`](nextn_engine::RequestHandle) and aborts the request in the engine.
//!
//! * `mod.rs`: server state, router, auth, `/v1/models`, `/health`, `/metrics`, run until a signal.
//! * `chat.rs` / `completions.rs`: the two generation endpoints (JSON and SSE).
//! * `request.rs`: reading body fields with errors that name them; sampling parameters.
//! * `reply.rs`: raw reply → reasoning / content / tool calls, incrementally for streams.
//! * `generation.rs`: one admitted request in the engine, with its latency metrics.
//! * `metrics.rs`, `errors.rs`: Prometheus exposition, OpenAI error objects.

pub mod chat;
pub mod completions;
pub mod errors;
pub mod generation;
pub mod metrics;
pub mod reply;
pub mod request;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State as AxState};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::{EngineHandle, ServiceInfo};
use serde_json::json;

use errors::ApiError;
use metrics::Metrics;

/// Server settings (the engine is built by the caller).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Required as `Authorization: Bearer KEY` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// The `model` id reported by `/v1/models` and accepted in requests.
    pub served_model_name: String,
    /// Requests the engine steps at once (its `max_num_seqs`).
    pub max_running: usize,
    /// Requests admitted beyond `max_running` that wait for a slot; more get 429.
    pub max_queue: usize,
    /// How long in-flight requests get to finish after SIGINT/SIGTERM before the server exits.
    pub shutdown_grace: Duration,
    /// The chat template's `enable_thinking` when a request does not set it.
    pub enable_thinking: bool,
    /// The harness profile the model directory declares (nextn.json) and its version hash, reported by
    /// `/v1/models` so `nextn agent --llm URL` can use the harness the model was trained on.
    pub harness: Option<(std::path::PathBuf, String)>,
    /// For the listening line: model directory and speculation.
    pub model_label: String,
    pub spec_label: String,
}

/// Shared by every handler.
pub struct State {
    pub engine: EngineHandle,
    pub info: ServiceInfo,
    pub bundle: TokenizerBundle,
    pub metrics: Metrics,
    pub served_model_name: String,
    pub api_key: Option<String>,
    pub enable_thinking: bool,
    /// `max_running + max_queue`.
    pub limit: usize,
    admitted: AtomicUsize,
    /// Unix seconds at start (`created` of the model).
    pub created: u64,
    pub harness: Option<(std::path::PathBuf, String)>,
}

impl State {
    pub fn new(engine: EngineHandle, bundle: TokenizerBundle, cfg: &ServeConfig) -> Arc<State> {
        Arc::new(State {
            info: engine.info().clone(),
            engine,
            bundle,
            metrics: Metrics::default(),
            served_model_name: cfg.served_model_name.clone(),
            api_key: cfg.api_key.clone(),
            enable_thinking: cfg.enable_thinking,
            limit: cfg.max_running + cfg.max_queue,
            admitted: AtomicUsize::new(0),
            created: unix_now(),
            harness: cfg.harness.clone(),
        })
    }

    /// Requests admitted and not yet answered.
    pub fn admitted(&self) -> usize {
        self.admitted.load(Ordering::SeqCst)
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A response id: `{prefix}-{engine request id}{time}` in hex.
pub fn response_id(prefix: &str, request: u64) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{request:x}{nanos:08x}")
}

pub fn router(state: Arc<State>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), auth));
    Router::new().route("/health", get(health)).route("/metrics", get(metrics)).merge(v1).with_state(state)
}

async fn auth(AxState(state): AxState<Arc<State>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if given.and_then(|g| g.strip_prefix("Bearer ")).map(str::trim) != Some(key.as_str()) {
            state.metrics.count(metrics::Outcome::Rejected);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn models(AxState(state): AxState<Arc<State>>) -> Json<serde_json::Value> {
    let mut model = json!({
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "nextn",
        "max_model_len": state.info.max_model_len,
    });
    if let Some((dir, version)) = &state.harness {
        model["nextn"] = json!({"harness": dir.display().to_string(), "harness_version": version});
    }
    Json(json!({"object": "list", "data": [model]}))
}

/// Ready when the engine worker is alive (for load-balancer readiness checks).
async fn health(AxState(state): AxState<Arc<State>>) -> Response {
    let snap = state.engine.snapshot();
    Json(json!({
        "status": "ok",
        "model": state.served_model_name,
        "running": snap.running,
        "waiting": snap.waiting,
        "admitted": state.admitted(),
    }))
    .into_response()
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> Response {
    let body = state.metrics.render(&state.engine.snapshot(), state.admitted());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

/// An SSE response over `events` (each a `data:` line).
pub fn sse(events: impl Stream<Item = Result<Event, Infallible>> + Send + 'static) -> Response {
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// A finished handler result: errors become their OpenAI object; 4xx count as rejected in the metrics.
pub fn respond(state: &State, result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_client_error() && e.status != StatusCode::TOO_MANY_REQUESTS {
                state.metrics.count(metrics::Outcome::Rejected);
            }
            e.into_response()
        }
    }
}

/// Bind, print the listening line on stderr, serve until SIGINT/SIGTERM, then give in-flight requests
/// `shutdown_grace` to finish.
pub async fn run(state: Arc<State>, cfg: &ServeConfig) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    eprintln!("nextn serve: listening on http://{addr} (model {}, spec {})", cfg.model_label, cfg.spec_label);

    let stop = Arc::new(tokio::sync::Notify::new());
    let signal = {
        let stop = Arc::clone(&stop);
        async move {
            shutdown_signal().await;
            eprintln!("nextn serve: shutting down");
            stop.notify_waiters();
        }
    };
    // No Nagle delay: SSE chunks are small and must go out as soon as they are written.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let serve = axum::serve(listener, router(state)).with_graceful_shutdown(signal);
    let grace = cfg.shutdown_grace;
    let deadline = async move {
        stop.notified().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        r = serve => r?,
        () = deadline => eprintln!("nextn serve: requests still in flight after {grace:?}; stopping anyway"),
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
