//! Running the cases: every request is the whole agent (harness, MCP servers, LLM), N in flight at once.
//!
//! For each (concurrency N × spec mode) group: N agents, each with its own MCP connection(s) and a client of
//! the group's one engine (or endpoint), pull cases from one queue. The warm-up cases run first (same agents, recorded with `warmup: true`), then
//! the measured ones. Timestamps are milliseconds since the replay began, so overlap is visible in the
//! JSON lines.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nextn_agent::agent::{Agent, AgentReply, Outcome};
use nextn_agent::llm::{LlmClient, LlmError, LocalEngine, OpenAiClient};
use nextn_agent::mcp::McpPool;
use nextn_agent::trace::TraceEvent;
use nextn_engine::spec::{DraftVocab, SpecConfig};
use nextn_engine::{EngineConfig, ModelConfig};
use nextn_harness::Harness;
use serde::Serialize;
use serde_json::Value;

use super::cases::Case;
use super::judge::Verdict;
use super::metrics::{self, CaseQuality, ToolCallRecord};

/// Who answers.
#[derive(Debug, Clone, PartialEq)]
pub enum LlmTarget {
    /// The in-process engine on a model directory, on `device`.
    Local { model_dir: PathBuf, device: nextn_engine::Device },
    /// An OpenAI-compatible endpoint (base URL) and the model name sent to it.
    Url { base_url: String, model: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMode {
    Off,
    Mtp,
    /// A remote endpoint: whatever it runs (the replay cannot switch it).
    Remote,
}

impl SpecMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMode::Off => "off",
            SpecMode::Mtp => "mtp",
            SpecMode::Remote => "remote",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "off" => Some(SpecMode::Off),
            "mtp" => Some(SpecMode::Mtp),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ReplayConfig {
    pub cases: Vec<Case>,
    pub concurrency: Vec<usize>,
    pub spec: Vec<SpecMode>,
    pub draft_steps: usize,
    /// `--draft-vocab FILE|N` for the local engine's MTP drafts.
    pub draft_vocab: Option<String>,
    /// The first `warmup` cases warm each group up and are left out of the summary.
    pub warmup: usize,
    pub llm: LlmTarget,
    pub harness_dir: PathBuf,
    /// MCP server specs (`cmd args`, `URL`, optionally `name=`), as `nextn agent --mcp`.
    pub mcp: Vec<String>,
    /// Request i is sampled with seed `seed + i` (the same in every group).
    pub seed: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub max_tokens: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("harness {dir}: {source}")]
    Harness { dir: PathBuf, source: nextn_harness::HarnessError },
    #[error("MCP server: {0}")]
    Mcp(#[from] nextn_agent::mcp::McpError),
    #[error("LLM client: {0}")]
    Llm(#[from] LlmError),
    #[error("async runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error("a replay worker failed: {0}")]
    Worker(String),
    #[error("{0}")]
    Config(String),
}

// ---------------------------------------------------------------------------------------------
// The LLM adapter: the only place that knows how clients are made.

/// The LLM behind one (concurrency × spec) group; [`LlmSource::client`] gives each agent its client.
pub enum LlmSource {
    /// One engine (an `EngineService` on its own thread) shared by every agent of the group: concurrent
    /// requests batch continuously.
    Local(LocalEngine),
    Url { base_url: String, model: String },
}

impl LlmSource {
    pub fn open(target: &LlmTarget, mode: SpecMode, draft_steps: usize, draft_vocab: Option<&str>) -> Result<Self, LlmError> {
        Ok(match target {
            LlmTarget::Local { model_dir, device } => {
                let spec = (mode == SpecMode::Mtp).then_some(SpecConfig { draft_steps });
                // The draft vocabulary applies to MTP groups only (an `off` group has no drafts).
                let draft_vocab = match draft_vocab.filter(|_| spec.is_some()) {
                    None => None,
                    Some(arg) => {
                        let vocab = ModelConfig::from_path(model_dir).map_err(|e| LlmError::Load(e.to_string()))?.vocab_size;
                        Some(DraftVocab::resolve(arg, Some(model_dir), vocab).map_err(|e| LlmError::Load(e.to_string()))?)
                    }
                };
                LlmSource::Local(LocalEngine::load_on(model_dir, *device, EngineConfig { spec, draft_vocab, ..EngineConfig::default() })?)
            }
            LlmTarget::Url { base_url, model } => LlmSource::Url { base_url: base_url.clone(), model: model.clone() },
        })
    }

    /// One agent's client.
    pub fn client(&self) -> Result<Box<dyn LlmClient>, LlmError> {
        Ok(match self {
            LlmSource::Local(engine) => Box::new(engine.client()),
            LlmSource::Url { base_url, model } => {
                Box::new(OpenAiClient::new(base_url.clone(), model.clone())?)
            }
        })
    }
}

/// The reply text of an agent answer (`""` when a hook blocked it: nothing is said).
fn reply_text(r: &AgentReply) -> String {
    r.text().to_string()
}

// ---------------------------------------------------------------------------------------------
// Per-request records

/// One LLM call of a request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallStats {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_ms: f64,
    pub decode_tokens_per_s: f64,
    pub wall_ms: f64,
    pub finish_reason: String,
}

/// MTP acceptance over a request's generations.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecSummary {
    pub verify_steps: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Tokens per verify step, bonus included.
    pub acceptance_length: f64,
    /// `[i]`: share of verify steps whose draft at position i + 1 was accepted.
    pub acceptance_per_position: Vec<f64>,
}

/// Where a request's wall time went (ms).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stages {
    pub prompt_ms: f64,
    /// Σ TTFT of the LLM calls (prefill, plus any queueing inside the engine).
    pub prefill_ms: f64,
    /// Model time after the first token.
    pub decode_ms: f64,
    pub tools_ms: f64,
    pub hooks_ms: f64,
    /// Waiting for the engine, when the client reports it (not yet: folded into prefill).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    /// Wall time in none of the above (agent bookkeeping, MCP framing, trace).
    pub other_ms: f64,
}

/// One request of the replay, as written to `requests.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub id: String,
    pub category: String,
    pub warmup: bool,
    pub concurrency: usize,
    pub spec: String,
    /// Since the replay began.
    pub start_ms: f64,
    pub end_ms: f64,
    pub latency_ms: f64,
    /// TTFT of the first LLM call.
    pub ttft_first_ms: Option<f64>,
    /// From the request's start to the first token of the final (reply) generation.
    pub ttft_reply_ms: Option<f64>,
    /// From the request's start to the first sentence released to TTS.
    pub first_sentence_ms: Option<f64>,
    pub loops: usize,
    pub calls: Vec<CallStats>,
    /// Decode tokens/s over the request's calls (tokens after the first / decode time).
    pub decode_tps: Option<f64>,
    pub spec_stats: Option<SpecSummary>,
    pub stages: Stages,
    pub outcome: String,
    /// Completed with a reply or a deliberate fallback (blocked, loop limit), not an error or a timeout.
    pub success: bool,
    pub tool_calls: Vec<ToolCallRecord>,
    pub reply: String,
    pub quality: CaseQuality,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge: Option<Verdict>,
    /// Tool results and room data (for the judge; not written).
    #[serde(skip)]
    pub evidence: Vec<String>,
}

/// Build the record of one answered case from the agent's reply and trace.
pub fn record_of(case: &Case, reply: &AgentReply, group: (usize, SpecMode), warmup: bool, start_ms: f64, end_ms: f64) -> RequestRecord {
    let events: Vec<&TraceEvent> = reply.trace.events().collect();
    let mut calls = Vec::new();
    let (mut ttft_reply, mut spec, mut speculated) = (None, SpecSummary::default(), false);
    let mut per_pos: Vec<u64> = Vec::new();
    let (mut prefill_ms, mut model_ms_gen) = (0.0, 0.0);
    let (mut timing, mut first_sentence) = (None, None);
    for rec in reply.trace.records() {
        match &rec.event {
            TraceEvent::Sentence { .. } => {
                first_sentence.get_or_insert(rec.t_ms);
            }
            TraceEvent::Generation { prompt_tokens, completion_tokens, ttft_ms, decode_tokens_per_s, wall_ms, finish_reason, spec: s, .. } => {
                calls.push(CallStats {
                    prompt_tokens: *prompt_tokens,
                    completion_tokens: *completion_tokens,
                    ttft_ms: *ttft_ms,
                    decode_tokens_per_s: *decode_tokens_per_s,
                    wall_ms: *wall_ms,
                    finish_reason: finish_reason.clone(),
                });
                // The event is pushed when the call returns: it started wall_ms earlier.
                ttft_reply = Some((rec.t_ms - wall_ms).max(0.0) + ttft_ms);
                prefill_ms += ttft_ms;
                model_ms_gen += wall_ms;
                if let Some(s) = s {
                    speculated = true;
                    let n = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0);
                    spec.verify_steps += n("verify_steps");
                    spec.drafted += n("drafted");
                    spec.accepted += n("accepted");
                    if let Some(pp) = s.get("accepted_per_position").and_then(Value::as_array) {
                        per_pos.resize(per_pos.len().max(pp.len()), 0);
                        for (i, v) in pp.iter().enumerate() {
                            per_pos[i] += v.as_u64().unwrap_or(0);
                        }
                    }
                }
            }
            TraceEvent::Timing { prompt_ms, model_ms, tools_ms, hooks_ms, .. } => {
                timing = Some((*prompt_ms, *model_ms, *tools_ms, *hooks_ms));
            }
            _ => {}
        }
    }
    let spec_stats = speculated.then(|| {
        let steps = spec.verify_steps.max(1) as f64;
        spec.acceptance_length = if spec.verify_steps > 0 { (spec.accepted + spec.verify_steps) as f64 / steps } else { 0.0 };
        spec.acceptance_per_position = per_pos.iter().map(|&a| a as f64 / steps).collect();
        spec
    });
    let latency_ms = end_ms - start_ms;
    let (prompt_ms, model_ms, tools_ms, hooks_ms) = timing.unwrap_or((0.0, model_ms_gen, 0.0, 0.0));
    let prefill_ms = f64::min(prefill_ms, model_ms);
    let decode_ms = (model_ms - prefill_ms).max(0.0);
    let other_ms = (latency_ms - prompt_ms - model_ms - tools_ms - hooks_ms).max(0.0);
    let stages = Stages { prompt_ms, prefill_ms, decode_ms, tools_ms, hooks_ms, queue_ms: None, other_ms };
    // Decode speed: Σ tokens after the first / Σ their time, over calls that report a speed.
    let (mut toks, mut secs) = (0.0, 0.0);
    for c in &calls {
        if c.decode_tokens_per_s > 0.0 && c.completion_tokens > 1 {
            let t = (c.completion_tokens - 1) as f64;
            toks += t;
            secs += t / c.decode_tokens_per_s;
        }
    }
    let tool_calls = metrics::tool_calls(events.iter().copied());
    let text = reply_text(reply);
    let evidence = metrics::evidence_texts(case, &tool_calls, events.iter().copied());
    let quality = metrics::score_case(case, &text, &tool_calls, metrics::rule_violations(events.iter().copied()), &evidence);
    RequestRecord {
        id: case.id.clone(),
        category: case.category.clone(),
        warmup,
        concurrency: group.0,
        spec: group.1.as_str().into(),
        start_ms,
        end_ms,
        latency_ms,
        ttft_first_ms: calls.first().map(|c| c.ttft_ms),
        ttft_reply_ms: ttft_reply,
        first_sentence_ms: first_sentence,
        loops: reply.loops,
        decode_tps: (secs > 0.0).then(|| toks / secs),
        calls,
        spec_stats,
        stages,
        outcome: reply.outcome.as_str().into(),
        success: !matches!(reply.outcome, Outcome::Error | Outcome::Timeout),
        tool_calls,
        reply: text,
        quality,
        judge: None,
        evidence,
    }
}

// ---------------------------------------------------------------------------------------------
// The replay

struct Job {
    index: usize,
    case: Case,
    warmup: bool,
}

/// The groups a config runs, in order: every concurrency × every spec mode (one `remote` mode for a URL).
pub fn groups(cfg: &ReplayConfig) -> Vec<(usize, SpecMode)> {
    let modes: Vec<SpecMode> = match cfg.llm {
        LlmTarget::Url { .. } => vec![SpecMode::Remote],
        LlmTarget::Local { .. } => cfg.spec.clone(),
    };
    cfg.concurrency.iter().flat_map(|&c| modes.iter().map(move |&m| (c, m))).collect()
}

/// Run every group; `progress` sees each record as it completes. Records come back in completion order.
pub fn replay(cfg: &ReplayConfig, mut progress: impl FnMut(&RequestRecord) + Send) -> Result<Vec<RequestRecord>, ReplayError> {
    if cfg.concurrency.is_empty() || cfg.concurrency.contains(&0) {
        return Err(ReplayError::Config("--concurrency needs values ≥ 1".into()));
    }
    let max_c = cfg.concurrency.iter().copied().max().unwrap_or(1);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(max_c + 2).enable_all().build()?;
    let t0 = Instant::now();
    let mut all = Vec::new();
    for group in groups(cfg) {
        let records = runtime.block_on(run_group(cfg, group, t0, &mut progress))?;
        all.extend(records);
    }
    Ok(all)
}

async fn make_agent(cfg: &ReplayConfig, llm: &LlmSource) -> Result<Agent, ReplayError> {
    let harness = Harness::load(&cfg.harness_dir).map_err(|source| ReplayError::Harness { dir: cfg.harness_dir.clone(), source })?;
    let client = tokio::task::block_in_place(|| llm.client())?;
    let pool = McpPool::connect_all(cfg.mcp.iter().map(String::as_str)).await?;
    let mut agent = Agent::new(harness, client, pool).map_err(|source| ReplayError::Harness { dir: cfg.harness_dir.clone(), source })?;
    agent.settings.temperature = cfg.temperature;
    agent.settings.top_p = cfg.top_p;
    agent.settings.max_tokens = cfg.max_tokens;
    Ok(agent)
}

async fn run_group(
    cfg: &ReplayConfig,
    (concurrency, mode): (usize, SpecMode),
    t0: Instant,
    progress: &mut (impl FnMut(&RequestRecord) + Send),
) -> Result<Vec<RequestRecord>, ReplayError> {
    let llm = tokio::task::block_in_place(|| LlmSource::open(&cfg.llm, mode, cfg.draft_steps, cfg.draft_vocab.as_deref()))?;
    let mut agents = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        agents.push(make_agent(cfg, &llm).await?);
    }
    let warm = cfg.warmup.min(cfg.cases.len());
    let jobs = |range: std::ops::Range<usize>, warmup: bool| -> VecDeque<Job> {
        range.map(|index| Job { index, case: cfg.cases[index].clone(), warmup }).collect()
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<RequestRecord>();
    let mut out = Vec::new();
    for phase in [jobs(0..warm, true), jobs(warm..cfg.cases.len(), false)] {
        if phase.is_empty() {
            continue;
        }
        let queue = Arc::new(Mutex::new(phase));
        let mut workers = Vec::new();
        for mut agent in agents.drain(..) {
            let (queue, tx, seed) = (Arc::clone(&queue), tx.clone(), cfg.seed);
            workers.push(tokio::spawn(async move {
                loop {
                    let job = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                    let Some(job) = job else { break };
                    agent.settings.seed = Some(seed.wrapping_add(job.index as u64));
                    let received = Instant::now();
                    let start = received.duration_since(t0).as_secs_f64() * 1e3;
                    let mut request = job.case.request();
                    request.received = Some(received);
                    let reply = agent.handle(request).await;
                    let end = t0.elapsed().as_secs_f64() * 1e3;
                    let _ = tx.send(record_of(&job.case, &reply, (concurrency, mode), job.warmup, start, end));
                }
                agent
            }));
        }
        // Records as they come, until every worker of the phase is done.
        let mut done = join_workers(workers);
        loop {
            tokio::select! {
                Some(r) = rx.recv() => { progress(&r); out.push(r); }
                finished = &mut done => {
                    while let Ok(r) = rx.try_recv() { progress(&r); out.push(r); }
                    agents = finished?;
                    break;
                }
            }
        }
    }
    for agent in agents {
        agent.close().await;
    }
    Ok(out)
}

/// Await every worker; their agents come back for the next phase.
fn join_workers(workers: Vec<tokio::task::JoinHandle<Agent>>) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<Agent>, ReplayError>> + Send>> {
    Box::pin(async move {
        let mut agents = Vec::with_capacity(workers.len());
        for w in workers {
            agents.push(w.await.map_err(|e| ReplayError::Worker(e.to_string()))?);
        }
        Ok(agents)
    })
}
