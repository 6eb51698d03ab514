//! The engine on its own thread, shared by many callers: continuous batching across every request in flight.
//!
//! [`EngineService::spawn`] builds an [`Engine`] on a worker thread and returns an [`EngineHandle`] (cheap to
//! clone, `Send + Sync`). Each [`EngineHandle::submit`] returns a [`RequestHandle`] whose channel yields the
//! request's [`RequestEvent`]s: tokens as they are produced, then `Finished` (or `Failed`). Dropping a
//! `RequestHandle` before it finished aborts the request (a client that went away frees its KV blocks and
//! state slot at the next step). The channel works from blocking code (`recv_deadline`) and async code
//! (`recv_async`) alike, so the agent, the replay benchmark and the HTTP server drive one engine.
//!
//! The worker loop: take every queued command (submit / abort), run one [`Engine::step`] over all running
//! sequences, route its events, publish a [`ServiceSnapshot`] (queue depth, KV blocks and slots in use, token
//! counters) and repeat; it sleeps on the command queue when nothing is running.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::cache::blocks::SeqId;
use crate::config::ModelConfig;
use crate::engine::{Engine, EngineError, Event, Output, TokenEvent};
use crate::sample::SamplingParams;
use crate::cache::prefix::PrefixCacheStats;
use crate::spec::SpecStats;

/// What a submitted request produces, in order: tokens, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone)]
pub enum RequestEvent {
    Token(TokenEvent),
    Finished(Output),
    /// The engine refused the request (bad prompt, sampling values, too long) or a step failed.
    Failed(ServiceError),
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ServiceError {
    /// `add_request` refused it; the message names the field or limit.
    #[error("{0}")]
    Rejected(String),
    /// A forward step failed; every request in that step fails with it.
    #[error("engine step failed: {0}")]
    Step(String),
    /// The worker thread has stopped.
    #[error("the engine worker has stopped")]
    Stopped,
}

/// Counters and gauges the worker publishes after every step (for `/metrics`, traces and tests).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ServiceSnapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub state_slots_used: usize,
    pub state_slots_total: usize,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub requests_failed: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub steps: u64,
    /// Acceptance counters over every finished request (speculating engines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<SpecStats>,
    /// Prefix-cache hits, misses and evictions (engines with the prefix cache on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_cache: Option<PrefixCacheStats>,
}

/// Fixed facts about the engine behind a handle.
#[derive(Debug, Clone)]
pub struct ServiceInfo {
    pub config: ModelConfig,
    pub max_model_len: usize,
    /// MTP draft steps (`None`: plain decoding).
    pub draft_steps: Option<usize>,
    pub backend: &'static str,
    pub eos_ids: Vec<u32>,
}

enum Command {
    Submit { id: u64, prompt: Vec<u32>, params: SamplingParams, events: flume::Sender<RequestEvent> },
    Abort { id: u64 },
    Shutdown,
}

struct Shared {
    next_id: AtomicU64,
    snapshot: Mutex<ServiceSnapshot>,
    info: ServiceInfo,
}

/// A handle to the engine worker; clone it for every caller.
#[derive(Clone)]
pub struct EngineHandle {
    tx: flume::Sender<Command>,
    shared: Arc<Shared>,
}

/// Owns the worker thread; dropping it (after every handle is dropped, or on [`EngineService::shutdown`])
/// stops the worker.
pub struct EngineService {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl EngineService {
    /// Build the engine on a new thread with `make` (so backends that must live on one thread can) and
    /// start serving. Fails with `make`'s error.
    pub fn spawn(make: impl FnOnce() -> Result<Engine, EngineError> + Send + 'static) -> Result<Self, EngineError> {
        let (tx, rx) = flume::unbounded::<Command>();
        let (ready_tx, ready_rx) = flume::bounded::<Result<Arc<Shared>, EngineError>>(1);
        let thread = std::thread::Builder::new()
            .name("nextn-engine".into())
            .spawn(move || {
                let engine = match make() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let info = ServiceInfo {
                    config: engine.config().clone(),
                    max_model_len: engine.max_model_len(),
                    draft_steps: engine.spec_config().map(|s| s.draft_steps),
                    backend: engine.backend_name(),
                    eos_ids: engine.eos_ids().to_vec(),
                };
                let shared = Arc::new(Shared { next_id: AtomicU64::new(0), snapshot: Mutex::default(), info });
                let mut worker = Worker { engine, shared: Arc::clone(&shared), routes: HashMap::new(), by_request: HashMap::new() };
                worker.publish();
                let _ = ready_tx.send(Ok(shared));
                worker.run(rx);
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        let shared = match ready_rx.recv() {
            Ok(Ok(shared)) => shared,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(EngineError::Config("the engine thread died while building the engine".into())),
        };
        Ok(EngineService { handle: EngineHandle { tx, shared }, thread: Some(thread) })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stop the worker (requests in flight are aborted) and wait for it.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EngineService {
    fn drop(&mut self) {
        self.stop();
    }
}

impl EngineHandle {
    /// Queue a request. Errors (bad prompt, over the context) arrive as the first event.
    pub fn submit(&self, prompt: Vec<u32>, params: SamplingParams) -> RequestHandle {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = flume::unbounded();
        if self.tx.send(Command::Submit { id, prompt, params, events: events_tx.clone() }).is_err() {
            let _ = events_tx.send(RequestEvent::Failed(ServiceError::Stopped));
        }
        RequestHandle { id, events, tx: self.tx.clone(), done: false }
    }

    pub fn info(&self) -> &ServiceInfo {
        &self.shared.info
    }

    /// The worker's counters after its latest step.
    pub fn snapshot(&self) -> ServiceSnapshot {
        self.shared.snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One submitted request. Dropping it before `Finished`/`Failed` was received aborts the request.
pub struct RequestHandle {
    id: u64,
    events: flume::Receiver<RequestEvent>,
    tx: flume::Sender<Command>,
    done: bool,
}

impl RequestHandle {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event, blocking until `deadline` (`None`: no deadline). `Err(Timeout)` leaves the request
    /// running; call [`RequestHandle::abort`] or drop the handle to stop it.
    pub fn recv_deadline(&mut self, deadline: Option<Instant>) -> Result<RequestEvent, RecvError> {
        let ev = match deadline {
            Some(d) => self.events.recv_deadline(d).map_err(|e| match e {
                flume::RecvTimeoutError::Timeout => RecvError::Timeout,
                flume::RecvTimeoutError::Disconnected => RecvError::Stopped,
            }),
            None => self.events.recv().map_err(|_| RecvError::Stopped),
        }?;
        self.note(&ev);
        Ok(ev)
    }

    /// The next event, for async callers.
    pub async fn recv_async(&mut self) -> Result<RequestEvent, RecvError> {
        let ev = self.events.recv_async().await.map_err(|_| RecvError::Stopped)?;
        self.note(&ev);
        Ok(ev)
    }

    fn note(&mut self, ev: &RequestEvent) {
        if matches!(ev, RequestEvent::Finished(_) | RequestEvent::Failed(_)) {
            self.done = true;
        }
    }

    /// Stop the request; its `Finished` event (with finish reason `abort`) still arrives.
    pub fn abort(&self) {
        let _ = self.tx.send(Command::Abort { id: self.id });
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.done {
            self.abort();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecvError {
    #[error("no event before the deadline")]
    Timeout,
    #[error("the engine worker has stopped")]
    Stopped,
}

struct Route {
    request: u64,
    events: flume::Sender<RequestEvent>,
}

struct Worker {
    engine: Engine,
    shared: Arc<Shared>,
    routes: HashMap<SeqId, Route>,
    by_request: HashMap<u64, SeqId>,
}

impl Worker {
    fn run(&mut self, rx: flume::Receiver<Command>) {
        loop {
            // Sleep on the queue only when there is nothing to step.
            if !self.engine.has_unfinished() {
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.command(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            let mut stop = false;
            while let Ok(cmd) = rx.try_recv() {
                if !self.command(cmd) {
                    stop = true;
                    break;
                }
            }
            if stop {
                break;
            }
            if self.engine.has_unfinished() {
                self.step();
            }
            self.publish();
        }
        let ids: Vec<u64> = self.by_request.keys().copied().collect();
        for id in ids {
            self.abort(id);
        }
    }

    /// Handle one command; false on shutdown.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { id, prompt, params, events } => {
                let prompt_len = prompt.len() as u64;
                match self.engine.add_request(prompt, params) {
                    Ok(seq) => {
                        self.routes.insert(seq, Route { request: id, events });
                        self.by_request.insert(id, seq);
                        self.snapshot_mut().prompt_tokens_total += prompt_len;
                    }
                    Err(e) => {
                        self.snapshot_mut().requests_failed += 1;
                        let _ = events.send(RequestEvent::Failed(ServiceError::Rejected(e.to_string())));
                    }
                }
                true
            }
            Command::Abort { id } => {
                self.abort(id);
                true
            }
            Command::Shutdown => false,
        }
    }

    fn abort(&mut self, request: u64) {
        let Some(seq) = self.by_request.remove(&request) else { return };
        let route = self.routes.remove(&seq);
        let out = self.engine.abort(seq);
        self.snapshot_mut().requests_aborted += 1;
        if let Some(route) = route {
            let ev = match out {
                Ok(Some(out)) => RequestEvent::Finished(out),
                Ok(None) => RequestEvent::Failed(ServiceError::Step("aborted after it finished".into())),
                Err(e) => RequestEvent::Failed(ServiceError::Step(e.to_string())),
            };
            let _ = route.events.send(ev);
        }
    }

    fn step(&mut self) {
        let events = match self.engine.step() {
            Ok(events) => events,
            Err(e) => {
                // The step's state is unknown: fail every request in flight and free what they held.
                let msg = e.to_string();
                tracing::error!(error = %msg, "engine step failed");
                let ids: Vec<u64> = self.by_request.keys().copied().collect();
                for id in ids {
                    if let Some(seq) = self.by_request.remove(&id) {
                        let _ = self.engine.abort(seq);
                        if let Some(route) = self.routes.remove(&seq) {
                            let _ = route.events.send(RequestEvent::Failed(ServiceError::Step(msg.clone())));
                        }
                        self.snapshot_mut().requests_failed += 1;
                    }
                }
                return;
            }
        };
        self.snapshot_mut().steps += 1;
        let mut gone = Vec::new();
        for ev in events {
            match ev {
                Event::Token(t) => {
                    let seq = SeqId(t.seq);
                    self.snapshot_mut().generation_tokens_total += 1;
                    if let Some(route) = self.routes.get(&seq)
                        && route.events.send(RequestEvent::Token(t)).is_err()
                    {
                        gone.push(route.request);
                    }
                }
                Event::Finished(out) => {
                    let seq = SeqId(out.seq);
                    self.snapshot_mut().requests_finished += 1;
                    if let Some(route) = self.routes.remove(&seq) {
                        self.by_request.remove(&route.request);
                        let _ = route.events.send(RequestEvent::Finished(out));
                    }
                }
            }
        }
        // The receiver was dropped without an abort reaching us yet: free its cache now.
        for id in gone {
            self.abort(id);
        }
    }

    fn snapshot_mut(&self) -> std::sync::MutexGuard<'_, ServiceSnapshot> {
        self.shared.snapshot.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish(&self) {
        let sched = self.engine.scheduler();
        let mut s = self.snapshot_mut();
        s.running = sched.num_running();
        s.waiting = sched.num_waiting();
        s.kv_blocks_total = sched.blocks.num_blocks();
        s.kv_blocks_used = sched.blocks.num_blocks() - sched.blocks.num_free_blocks();
        s.state_slots_total = sched.slots.capacity();
        s.state_slots_used = sched.slots.capacity() - sched.slots.num_free();
        s.spec = self.engine.spec_totals().cloned();
        s.prefix_cache = self.engine.prefix_cache_stats();
    }
}
