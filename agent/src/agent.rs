//! The agent loop: prompt → generate → parse → hooks → tools → … → reply, at most `max_loops` generations,
//! all inside one request budget.
//!
//! One request: input hooks on the comment; the live-room status (from the request, else the `room_status`
//! tool when a server offers one); the harness builds the system prompt (skills, FAQ, room, rules); then each
//! loop generates once. Tool calls go through `before_tool` hooks, MCP (`tool_timeout_ms`, cut to the time
//! left), `after_tool` hooks, and come back as tool messages; a plain reply goes through `before_reply` hooks
//! (grounding of every figure, forbidden claims, length), then its action markers become [`Action`]s and its
//! speech is split into sentences for TTS. A hook `Retry` feeds its reason back to the model and costs a
//! loop; `Block` ends with `reply: None`.
//!
//! Faults on the tool side degrade, never kill, a request: a server that failed to start, died, timed out or
//! returned an error or a malformed result is recorded in the trace and its tools leave the prompt for the
//! rest of the request. The request budget (`request_budget_ms`, default 15 s) bounds everything: when the
//! next step cannot fit, the agent stops with the harness fallback and `outcome: "timeout"`.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use nextn_harness::actions::{KnownIds, parse_actions, resolve_actions, split_sentences};
use nextn_harness::{
    Decision, Harness, HookPayload, HookRecord, Product, RequestContext, RetryBudget, RoomStatus, ToolRegistry,
    reply_evidence,
};
use serde_json::{Value, json};

use crate::llm::{ChatRequest, Generation, LlmClient, LlmError};
use crate::mcp::{McpError, McpPool};
use crate::toolcall::parse_reply;
use crate::trace::{Phase, PromptBlock, Trace, TraceEvent};

pub use nextn_harness::actions::Action;

/// What the host says when it cannot answer (loop limit, model failure, out of time).
pub const FALLBACK_REPLY: &str = "Thanks for asking! Let me double-check that for you and come right back.";
/// The same to a viewer who wrote in Chinese (the harness rule: answer in the viewer's language).
pub const FALLBACK_REPLY_ZH: &str = "谢谢提问！我再确认一下，马上回来告诉你。";

/// The fallback in the comment's language (English when it has no letters).
pub fn fallback_reply(comment: &str) -> &'static str {
    match nextn_harness::text::language_of(comment) {
        Some(nextn_harness::text::Language::Zh) => FALLBACK_REPLY_ZH,
        _ => FALLBACK_REPLY,
    }
}

/// The least time an LLM call is started with; below it the request ends as a timeout.
const MIN_LLM_MS: u64 = 250;
/// The least time a tool call is started with.
const MIN_TOOL_MS: u64 = 50;

/// One viewer comment and its context.
#[derive(Debug, Clone, Default)]
pub struct AgentRequest {
    pub comment: String,
    /// Earlier turns, `(role, text)` with role `user`/`viewer` or `assistant`/`host`.
    pub history: Vec<(String, String)>,
    pub room: Option<RoomStatus>,
    pub products: Vec<Product>,
    /// When the request arrived (the budget counts from here); `None`: when `handle` starts.
    pub received: Option<Instant>,
}

/// Generation settings for every loop.
#[derive(Debug, Clone)]
pub struct GenSettings {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
}

impl Default for GenSettings {
    fn default() -> Self {
        GenSettings { max_tokens: 256, temperature: 0.0, top_p: 1.0, seed: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Replied,
    /// A hook blocked the comment or the reply: nothing is said.
    Blocked,
    /// `max_loops` generations without a final reply.
    LoopLimit,
    /// The request budget ran out before a reply.
    Timeout,
    /// The model's replies kept failing a hook until its retry budget was spent: the fallback line goes out.
    Fallback,
    /// The model failed (e.g. an endpoint error).
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Replied => "replied",
            Outcome::Blocked => "blocked",
            Outcome::LoopLimit => "loop_limit",
            Outcome::Timeout => "timeout",
            Outcome::Fallback => "fallback",
            Outcome::Error => "error",
        }
    }
}

pub struct AgentReply {
    /// The speech (action markers removed); the fallback line for loop limit / timeout / error; `None` when
    /// blocked.
    pub reply: Option<String>,
    /// `reply` split into sentences for TTS (empty when blocked).
    pub sentences: Vec<String>,
    /// Executable actions for the avatar (product cards, coupons), validated against this request's data.
    pub actions: Vec<Action>,
    pub outcome: Outcome,
    pub loops: usize,
    pub trace: Trace,
}

impl AgentReply {
    /// The reply text, or `""` when blocked.
    pub fn text(&self) -> &str {
        self.reply.as_deref().unwrap_or("")
    }
}

/// A server or hook problem found before the request (at start-up), reported in the next request's trace.
#[derive(Debug, Clone)]
pub struct StartupFault {
    pub stage: String,
    pub target: String,
    pub error: String,
}

pub struct Agent {
    harness: Harness,
    llm: Box<dyn LlmClient>,
    mcp: McpPool,
    registry: ToolRegistry,
    pub settings: GenSettings,
    next_request: u64,
    /// Faults found while starting (servers that did not connect, unknown tool references, skipped hooks).
    startup: Vec<StartupFault>,
}

/// Where the request stands against its budget.
#[derive(Debug, Clone, Copy)]
struct Budget {
    deadline: Instant,
}

impl Budget {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
    fn fits(&self, ms: u64) -> bool {
        self.remaining() >= Duration::from_millis(ms)
    }
}

/// Per-request tool state: results so far, tools taken out of the prompt, answers to repeated calls.
#[derive(Default)]
struct ToolState {
    results: Vec<Value>,
    disabled: HashSet<String>,
    answered: HashMap<(String, String), String>,
}

impl Agent {
    /// Tools are discovered from every MCP server in `mcp` and renamed / described per the harness.
    pub fn new(harness: Harness, llm: Box<dyn LlmClient>, mcp: McpPool) -> Result<Self, nextn_harness::HarnessError> {
        let registry = harness.tool_registry(mcp.harness_tool_specs())?;
        let mut startup = Vec::new();
        let offered: Vec<String> = mcp.tools().iter().map(|t| t.name.clone()).collect();
        for f in nextn_harness::check_tool_references(&harness.tool_references(), &offered) {
            let target = nextn_harness::Location { file: f.file.clone(), line: f.line }.to_string();
            startup.push(StartupFault { stage: "tool_reference".into(), target, error: f.message });
        }
        for h in harness.hooks().skipped() {
            startup.push(StartupFault { stage: "hook".into(), target: h.hook.clone(), error: h.reason.clone() });
        }
        Ok(Agent { harness, llm, mcp, registry, settings: GenSettings::default(), next_request: 0, startup })
    }

    /// Faults found before the first request (e.g. MCP servers that did not start); they are recorded in the
    /// next request's trace.
    pub fn add_startup_faults(&mut self, faults: impl IntoIterator<Item = StartupFault>) {
        self.startup.extend(faults);
    }

    pub fn harness(&self) -> &Harness {
        &self.harness
    }
    /// Swap the model client (e.g. a fresh scripted client per rendered case); returns the old one.
    pub fn replace_llm(&mut self, llm: Box<dyn LlmClient>) -> Box<dyn LlmClient> {
        std::mem::replace(&mut self.llm, llm)
    }
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// Answer one comment. Never fails: every problem becomes a trace event and, at worst, the fallback reply.
    pub async fn handle(&mut self, req: AgentRequest) -> AgentReply {
        self.handle_streaming(req, &mut |_| {}).await
    }

    /// [`Agent::handle`], calling `on_sentence` with each sentence of the final reply as soon as it is complete
    /// and has passed the reply hooks (before the rest of the reply is generated).
    pub async fn handle_streaming(&mut self, req: AgentRequest, on_sentence: &mut (dyn FnMut(&str) + Send)) -> AgentReply {
        let received = req.received.unwrap_or_else(Instant::now);
        let budget = Budget { deadline: received + Duration::from_millis(self.harness.constraints().request_budget_ms) };
        let request_id = format!("req-{}", self.next_request);
        self.next_request += 1;
        let mut trace = Trace::starting_at(request_id.clone(), received);
        trace.push(TraceEvent::Start {
            request_id,
            harness_version: self.harness.version().to_string(),
            comment: req.comment.clone(),
            llm: self.llm.name(),
        });
        for f in std::mem::take(&mut self.startup) {
            trace.push(TraceEvent::Fault { stage: f.stage, target: f.target, error: f.error });
        }
        let mut hook_budget = self.harness.hooks().new_budget();
        let mut run = Run { trace, hook_budget: &mut hook_budget, budget, sentences: Vec::new(), on_sentence };
        let (reply, outcome, loops) = self.run(req, &mut run).await;
        let (reply, actions) = match reply {
            Some(Final { speech, actions }) => (Some(speech), actions),
            None => (None, Vec::new()),
        };
        // Sentences: what was streamed, then whatever of the final speech was not.
        let mut sentences = std::mem::take(&mut run.sentences);
        if let Some(speech) = &reply {
            let all = split_sentences(speech);
            for s in all.into_iter().skip(sentences.len()) {
                run.emit(&s);
                sentences.push(s);
            }
        }
        let mut trace = run.trace;
        trace.push(TraceEvent::Reply {
            text: reply.clone(),
            loops,
            outcome: outcome.as_str().into(),
            actions: actions.iter().map(|a| serde_json::to_value(a).unwrap_or(Value::Null)).collect(),
        });
        trace.finish_timing();
        AgentReply { reply, sentences, actions, outcome, loops, trace }
    }

    async fn run(&mut self, req: AgentRequest, run: &mut Run<'_>) -> (Option<Final>, Outcome, usize) {
        let fallback_text = fallback_reply(&req.comment);
        let fallback = || Some(Final { speech: fallback_text.to_string(), actions: Vec::new() });
        // 1. Input hooks.
        let (decision, payload) = self.hooks(HookPayload::Input { comment: req.comment.clone() }, run);
        let comment = match (decision, payload) {
            (Decision::Block { .. } | Decision::Retry { .. }, _) => return (None, Outcome::Blocked, 0),
            (_, HookPayload::Input { comment }) => comment,
            _ => req.comment.clone(),
        };
        let constraints = self.harness.constraints().clone();
        let tool_timeout = Duration::from_millis(constraints.tool_timeout_ms);
        let mut tools_state = ToolState::default();

        // 2. The live room: the request's own, else the room-status tool.
        let room = match req.room.clone() {
            Some(r) => Some(r),
            None => fetch_room(&self.mcp, tool_timeout, run).await,
        };

        // 3. The system prompt from the harness.
        let ctx = RequestContext { comment: comment.clone(), history: req.history.clone(), room, products: req.products };
        let t = Instant::now();
        let prompt = match self.harness.build_prompt(&ctx, None) {
            Ok(p) => p,
            Err(e) => {
                run.trace.push(TraceEvent::Fault { stage: "prompt".into(), target: "harness".into(), error: e.to_string() });
                return (fallback(), Outcome::Error, 0);
            }
        };
        run.trace.add_time(Phase::Prompt, t.elapsed());
        run.trace.push(TraceEvent::Prompt {
            blocks: prompt.blocks.iter().map(|b| PromptBlock { name: b.name.clone(), hash: b.hash.clone(), chars: b.chars }).collect(),
            skills: prompt.skills.selected.clone(),
        });
        let mut messages = vec![json!({"role": "system", "content": prompt.system})];
        for (role, text) in &ctx.history {
            let role = if matches!(role.as_str(), "assistant" | "host") { "assistant" } else { "user" };
            messages.push(json!({"role": role, "content": text}));
        }
        messages.push(json!({"role": "user", "content": comment}));
        // What a reply's figures may come from besides tool results: the room, products, FAQ, the harness text
        // (system prompt, less its Limits block) and the viewer's own body measurements and the letter sizes they
        // ask for (a price or a coupon code the viewer names is no evidence).
        let mut base_evidence = vec![prompt.evidence.clone()];
        let viewer_texts = || std::iter::once(comment.as_str()).chain(ctx.history.iter().map(|(_, t)| t.as_str()));
        base_evidence.extend(viewer_measurements(viewer_texts()));
        base_evidence.extend(viewer_texts().flat_map(nextn_harness::grounding::size_labels));

        let max_loops = constraints.max_loops.max(1) as usize;
        // Whether this loop's call answers a hook's retry message (decoded with the harness's retry settings).
        let mut retrying = false;
        // Texts the model's later calls may not begin with (refused clauses, `feedback.ban_refused_clause`).
        let mut banned_prefixes: Vec<String> = Vec::new();
        for loop_index in 0..max_loops {
            // 4. Generate, if there is time for it.
            if !run.budget.fits(MIN_LLM_MS) {
                run.trace.push(TraceEvent::Fault {
                    stage: "budget".into(),
                    target: "llm".into(),
                    error: format!("{} ms left, not enough for another model call", run.budget.remaining().as_millis()),
                });
                return (fallback(), Outcome::Timeout, loop_index);
            }
            let tools = self.offered_tools(&tools_state.disabled);
            let (temperature, seed) = sampling_for(&self.settings, &self.harness.hooks_config().feedback, retrying, &messages);
            retrying = false;
            let request = ChatRequest {
                messages: messages.clone(),
                tools: tools.clone(),
                max_tokens: self.settings.max_tokens,
                temperature,
                top_p: self.settings.top_p,
                seed,
                enable_thinking: Some(false),
                stop: Vec::new(),
                banned_prefixes: banned_prefixes.clone(),
                deadline: Some(run.budget.deadline),
            };
            let evidence = evidence_now(&ctx, &prompt.faq, &tools_state.results, &base_evidence);
            let t = Instant::now();
            let generated = {
                let (llm, harness) = (&mut self.llm, &self.harness);
                let mut streamer = SentenceStreamer::new(harness, &evidence, run);
                tokio::task::block_in_place(|| llm.generate_stream(&request, &mut |piece| streamer.push(piece)))
            };
            run.trace.add_time(Phase::Model, t.elapsed());
            let generation: Generation = match generated {
                Ok(g) => g,
                Err(e) => {
                    let timeout = e.is_timeout();
                    run.trace.push(TraceEvent::Fault { stage: "llm".into(), target: self.llm.name(), error: e.to_string() });
                    return match (timeout, run.sentences.is_empty()) {
                        (_, false) => (Some(Final { speech: run.sentences.join(" "), actions: Vec::new() }), Outcome::Replied, loop_index + 1),
                        (true, true) => (fallback(), Outcome::Timeout, loop_index),
                        (false, true) => (fallback(), Outcome::Error, loop_index),
                    };
                }
            };
            run.trace.push(TraceEvent::Generation {
                loop_index,
                prompt_tokens: generation.prompt_tokens,
                completion_tokens: generation.completion_tokens,
                ttft_ms: generation.ttft_ms,
                decode_tokens_per_s: generation.decode_tokens_per_s,
                wall_ms: generation.wall_ms,
                finish_reason: generation.finish_reason.clone(),
                spec: generation.spec.clone(),
                text: generation.text.clone(),
            });
            let parsed = parse_reply(&generation.text, &tools);

            // 5. A malformed tool call: the tool-call-syntax hook decides (normally: retry with the reason).
            if parsed.has_errors() && !parsed.has_calls() {
                let err = &parsed.errors[0];
                let payload = HookPayload::BeforeTool {
                    name: err.tool.clone().unwrap_or_default(),
                    arguments: json!({}),
                    raw: Some(err.snippet.clone()),
                    parse_error: Some(err.message.clone()),
                };
                let (decision, _, exhausted) = self.hooks_run(payload, run);
                match decision {
                    Decision::Retry { reason } => {
                        messages.push(json!({"role": "assistant", "content": generation.text}));
                        messages.push(json!({"role": "user", "content": self.harness.hooks_config().feedback.tool_call_retry(&reason)}));
                        retrying = true;
                        continue;
                    }
                    Decision::Block { .. } if exhausted => return (fallback(), Outcome::Fallback, loop_index + 1),
                    Decision::Block { .. } => return (None, Outcome::Blocked, loop_index + 1),
                    _ => {}
                }
            }

            // 6. Tool calls: hooks, MCP, hooks, tool messages; then loop.
            if parsed.has_calls() {
                let calls: Vec<Value> =
                    parsed.calls.iter().enumerate().map(|(i, c)| c.to_openai(&format!("call_{loop_index}_{i}"))).collect();
                messages.push(json!({"role": "assistant", "content": parsed.text, "tool_calls": calls}));
                for call in &parsed.calls {
                    let parts = Parts { harness: &self.harness, mcp: &self.mcp, registry: &self.registry };
                    let args = Value::Object(call.arguments.clone());
                    let content = parts.call_tool(loop_index, &call.name, args, tool_timeout, run, &mut tools_state).await;
                    messages.push(json!({"role": "tool", "name": call.name, "content": content}));
                }
                continue;
            }

            // 7. A reply: before_reply hooks on its speech against the evidence.
            let (speech, marks) = parse_actions(&parsed.text);
            let evidence = evidence_now(&ctx, &prompt.faq, &tools_state.results, &base_evidence);
            let (decision, payload, exhausted) =
                self.hooks_run(HookPayload::BeforeReply { reply: speech.clone(), evidence: evidence.clone() }, run);
            let speech = match decision {
                Decision::Retry { .. } | Decision::Block { .. } if !run.sentences.is_empty() => {
                    // Part of the reply was already spoken: it stands, the rest is dropped.
                    run.trace.push(TraceEvent::Notice {
                        kind: "reply_cut".into(),
                        detail: format!("the rest of the reply failed the hooks after {} streamed sentences", run.sentences.len()),
                    });
                    run.sentences.join(" ")
                }
                Decision::Retry { reason } => {
                    if self.harness.hooks_config().feedback.ban_refused_clause
                        && let Some(prefix) = refused_prefix(&speech, &evidence, &generation.text)
                    {
                        run.trace.push(TraceEvent::Notice {
                            kind: "retry_ban".into(),
                            detail: format!("the retry may not begin with {prefix:?}"),
                        });
                        banned_prefixes.push(prefix);
                    }
                    messages.push(json!({"role": "assistant", "content": parsed.text}));
                    messages.push(json!({"role": "user", "content": self.harness.hooks_config().feedback.reply_retry(&reason)}));
                    retrying = true;
                    continue;
                }
                Decision::Block { .. } if exhausted => return (fallback(), Outcome::Fallback, loop_index + 1),
                Decision::Block { .. } => return (None, Outcome::Blocked, loop_index + 1),
                _ => match payload {
                    HookPayload::BeforeReply { reply, .. } => reply,
                    _ => speech,
                },
            };
            // 8. Actions: only ids that tools or room data of this request returned.
            let known = KnownIds::from_evidence(&evidence);
            let (actions, dropped) = resolve_actions(&marks, &known);
            for d in dropped {
                run.trace.push(TraceEvent::Notice { kind: "action_dropped".into(), detail: format!("{d:?}") });
            }
            return (Some(Final { speech, actions }), Outcome::Replied, loop_index + 1);
        }
        (fallback(), Outcome::LoopLimit, max_loops)
    }

    /// The tool list for the model, less the tools taken out for this request.
    fn offered_tools(&self, disabled: &HashSet<String>) -> Vec<Value> {
        self.registry
            .openai_tools()
            .into_iter()
            .filter(|t| t["function"]["name"].as_str().is_none_or(|n| !disabled.contains(n)))
            .collect()
    }

    fn hooks(&self, payload: HookPayload, run: &mut Run<'_>) -> (Decision, HookPayload) {
        let (decision, payload, _) = self.hooks_run(payload, run);
        (decision, payload)
    }

    /// [`Agent::hooks`], also saying whether a `Block` came from a spent retry budget.
    fn hooks_run(&self, payload: HookPayload, run: &mut Run<'_>) -> (Decision, HookPayload, bool) {
        Parts { harness: &self.harness, mcp: &self.mcp, registry: &self.registry }.hooks_run(payload, run)
    }

    /// Shut the MCP servers down.
    pub async fn close(self) {
        self.mcp.close().await;
    }
}

/// The banned prefix for the retry of a refused reply: `completion` (the raw model output) up to and including
/// the first word of the clause that states the reply's earliest figure the evidence does not show, when the
/// completion begins with the same text as the spoken reply. `None` when no figure is unsupported (the refusal
/// came from another rule).
fn refused_prefix(speech: &str, evidence: &[String], completion: &str) -> Option<String> {
    let figures = nextn_harness::grounding::unsupported_figures(speech, evidence);
    let (_, first) = figures.iter().filter_map(|f| speech.find(&f.text).map(|at| (at, f))).min_by_key(|&(at, _)| at)?;
    let prefix = nextn_harness::grounding::refused_clause_prefix(speech, &first.text)?;
    let lead = completion.len() - completion.trim_start().len();
    completion[lead..].starts_with(&prefix).then(|| completion[..lead + prefix.len()].to_string())
}

/// The reply that goes out: speech and actions.
struct Final {
    speech: String,
    actions: Vec<Action>,
}

/// One request in progress: its trace, budgets and the sentences streamed so far.
struct Run<'a> {
    trace: Trace,
    hook_budget: &'a mut RetryBudget,
    budget: Budget,
    sentences: Vec<String>,
    on_sentence: &'a mut (dyn FnMut(&str) + Send),
}

impl Run<'_> {
    fn emit(&mut self, sentence: &str) {
        self.trace.push(TraceEvent::Sentence { index: self.sentences.len(), text: sentence.to_string() });
        (self.on_sentence)(sentence);
    }
}

/// Temperature and seed of a loop's model call: the request's, except that a call answering a hook's retry
/// message runs at least at the harness's `feedback.retry_temperature`; without a request seed such a call is
/// seeded from the conversation (FNV-1a of its messages), so the same request retries the same way.
fn sampling_for(
    settings: &GenSettings,
    feedback: &nextn_harness::hooks::FeedbackConfig,
    retrying: bool,
    messages: &[Value],
) -> (f32, Option<u64>) {
    if !retrying || feedback.retry_temperature <= settings.temperature {
        return (settings.temperature, settings.seed);
    }
    let seed = settings.seed.unwrap_or_else(|| {
        let text = serde_json::to_string(messages).unwrap_or_default();
        nextn_harness::hash::Fnv64::new().update(text.as_bytes()).finish()
    });
    (feedback.retry_temperature, Some(seed))
}

fn evidence_now(ctx: &RequestContext, faq: &[nextn_harness::FaqHit], results: &[Value], base: &[String]) -> Vec<String> {
    let mut e = reply_evidence(ctx, faq, results);
    e.extend(base.iter().cloned());
    e
}

/// Streams the sentences of a reply while it is generated: each sentence is released once it is complete
/// (the next one has begun) and the reply so far passes the `before_reply` hooks; output that starts like
/// markup (a tool call, reasoning) is never streamed. The whole reply is checked again when it is complete.
struct SentenceStreamer<'r, 'a> {
    harness: &'r Harness,
    evidence: &'r [String],
    run: &'r mut Run<'a>,
    text: String,
    /// Sentences of this generation already released.
    released: usize,
    stopped: bool,
}

impl<'r, 'a> SentenceStreamer<'r, 'a> {
    fn new(harness: &'r Harness, evidence: &'r [String], run: &'r mut Run<'a>) -> Self {
        SentenceStreamer { harness, evidence, run, text: String::new(), released: 0, stopped: false }
    }

    fn push(&mut self, piece: &str) {
        if self.stopped {
            return;
        }
        self.text.push_str(piece);
        let trimmed = self.text.trim_start();
        if trimmed.starts_with('<') || trimmed.contains('<') || trimmed.contains("[show_") && !trimmed.contains(']') {
            // Markup, or an action marker still being written: wait for the whole reply.
            if trimmed.contains('<') {
                self.stopped = true;
            }
            return;
        }
        let (speech, _) = parse_actions(trimmed);
        let sentences = split_sentences(&speech);
        // The last sentence may still grow; release the ones before it.
        while sentences.len() > self.released + 1 {
            let candidate = sentences[..=self.released].join(" ");
            let mut budget = self.run.hook_budget.clone();
            let run = self.harness.hooks().run(
                HookPayload::BeforeReply { reply: candidate, evidence: self.evidence.to_vec() },
                None,
                &mut budget,
            );
            if !matches!(run.decision, Decision::Allow) {
                self.stopped = true;
                return;
            }
            let s = sentences[self.released].clone();
            self.run.emit(&s);
            self.run.sentences.push(s);
            self.released += 1;
        }
    }
}

/// The agent's shared (`Sync`) parts, borrowed across MCP awaits without borrowing the LLM client, so the
/// request future stays `Send` (an agent can run on a spawned task).
struct Parts<'a> {
    harness: &'a Harness,
    mcp: &'a McpPool,
    registry: &'a ToolRegistry,
}

impl Parts<'_> {
    /// Hooks at one point; every decision goes into the trace. Returns the decision and corrected payload.
    fn hooks(&self, payload: HookPayload, run: &mut Run<'_>) -> (Decision, HookPayload) {
        let (decision, payload, _) = self.hooks_run(payload, run);
        (decision, payload)
    }

    fn hooks_run(&self, payload: HookPayload, run: &mut Run<'_>) -> (Decision, HookPayload, bool) {
        let t = Instant::now();
        let result = self.harness.hooks().run(payload, Some(self.registry), run.hook_budget);
        run.trace.add_time(Phase::Hooks, t.elapsed());
        for r in &result.records {
            run.trace.push(hook_event(r));
        }
        (result.decision, result.payload, result.retries_exhausted.is_some())
    }

    /// One tool call through hooks and MCP; returns the text the model sees.
    async fn call_tool(
        &self,
        loop_index: usize,
        name: &str,
        arguments: Value,
        timeout: Duration,
        run: &mut Run<'_>,
        state: &mut ToolState,
    ) -> String {
        let Some(tool) = self.registry.resolve(name).cloned() else {
            let msg = format!("error: unknown tool `{name}`; available: {}", self.registry.names().join(", "));
            run.trace.push(TraceEvent::ToolCall { loop_index, server: String::new(), tool: name.into(), arguments, latency_ms: 0.0, ok: false, cached: false, result: None, error: Some(msg.clone()) });
            return msg;
        };
        if state.disabled.contains(&tool.name) {
            return format!("error: `{}` is unavailable for this request; answer without it", tool.name);
        }
        let payload = HookPayload::BeforeTool { name: tool.name.clone(), arguments, raw: None, parse_error: None };
        let (decision, payload) = self.hooks(payload, run);
        let arguments = match (decision, payload) {
            (Decision::Block { reason } | Decision::Retry { reason }, _) => return format!("error: the call was not made: {reason}"),
            (_, HookPayload::BeforeTool { arguments, .. }) => arguments,
            (_, other) => other.subject(),
        };
        // The same call twice in one request: answer from the first result.
        let key = (tool.real_name.clone(), arguments.to_string());
        if let Some(text) = state.answered.get(&key) {
            run.trace.push(TraceEvent::ToolCall { loop_index, server: tool.server.clone(), tool: tool.real_name.clone(), arguments, latency_ms: 0.0, ok: true, cached: true, result: Some(text.clone()), error: None });
            return text.clone();
        }
        let left = run.budget.remaining();
        if left < Duration::from_millis(MIN_TOOL_MS) {
            run.trace.push(TraceEvent::Fault { stage: "budget".into(), target: tool.real_name.clone(), error: "no time left for the tool call".into() });
            return format!("error: no time left to call `{}`; answer without it", tool.name);
        }
        let t = Instant::now();
        let result = self.mcp.call(&tool.server, &tool.real_name, arguments.clone(), timeout.min(left)).await;
        let latency = t.elapsed();
        run.trace.add_time(Phase::Tools, latency);
        let fault = |run: &mut Run<'_>, error: &str| {
            run.trace.push(TraceEvent::Fault { stage: "tool".into(), target: format!("{}/{}", tool.server, tool.real_name), error: error.to_string() });
        };
        let (text, ok, error) = match result {
            Ok(out) if !out.is_error && malformed(&out.text) => {
                let e = format!("malformed result from `{}`: not valid JSON", tool.real_name);
                fault(run, &e);
                state.disabled.insert(tool.name.clone());
                (format!("error: {e}; answer without this data"), false, Some(e))
            }
            Ok(out) if !out.is_error => (out.text, true, None),
            Ok(out) => {
                fault(run, &format!("isError: {}", out.text));
                state.disabled.insert(tool.name.clone());
                (format!("error: {}", out.text), false, Some(out.text))
            }
            Err(e) => {
                // Timeouts and dead servers: every tool of that server leaves the prompt for this request.
                fault(run, &e.to_string());
                if matches!(e, McpError::Timeout { .. } | McpError::ServerDied { .. } | McpError::Protocol { .. }) {
                    for n in self.registry.names() {
                        if self.registry.resolve(n).is_some_and(|t| t.server == tool.server) {
                            state.disabled.insert(n.to_string());
                        }
                    }
                }
                (format!("error: {e}; answer without this data"), false, Some(e.to_string()))
            }
        };
        run.trace.push(TraceEvent::ToolCall {
            loop_index,
            server: tool.server.clone(),
            tool: tool.real_name.clone(),
            arguments: arguments.clone(),
            latency_ms: latency.as_secs_f64() * 1e3,
            ok,
            cached: false,
            result: ok.then(|| text.clone()),
            error,
        });
        let result_value = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text.clone()));
        let payload = HookPayload::AfterTool { name: tool.name.clone(), arguments, result: result_value, is_error: !ok };
        let (decision, payload) = self.hooks(payload, run);
        let final_text = match (decision, payload) {
            (Decision::Block { reason } | Decision::Retry { reason }, _) => format!("error: result withheld: {reason}"),
            (_, HookPayload::AfterTool { result: Value::String(s), .. }) => s,
            (_, HookPayload::AfterTool { result, .. }) => result.to_string(),
            _ => text,
        };
        if ok {
            state.results.push(Value::String(final_text.clone()));
            state.answered.insert(key, final_text.clone());
        }
        final_text
    }
}

/// The live-room status from a connected server's `room_status` tool (none offered: `None`). A failure
/// is recorded and the prompt goes without a room block.
async fn fetch_room(mcp: &McpPool, timeout: Duration, run: &mut Run<'_>) -> Option<RoomStatus> {
    let tool = mcp.tools().iter().find(|t| t.name == "room_status")?.clone();
    let timeout = timeout.min(run.budget.remaining());
    let t = Instant::now();
    let result = mcp.call(&tool.server, &tool.name, json!({}), timeout).await;
    let latency_ms = t.elapsed().as_secs_f64() * 1e3;
    run.trace.add_time(Phase::Tools, t.elapsed());
    let (parsed, text) = match result {
        Ok(out) if !out.is_error => {
            let room = serde_json::from_str::<RoomStatus>(&out.text).map_err(|e| format!("room status is not a JSON object: {e}"));
            (room, Some(out.text))
        }
        Ok(out) => (Err(format!("isError: {}", out.text)), None),
        Err(e) => (Err(e.to_string()), None),
    };
    let (ok, error) = match &parsed {
        Ok(_) => (true, None),
        Err(e) => (false, Some(e.clone())),
    };
    let result = if ok { text } else { None };
    run.trace.push(TraceEvent::Room { server: tool.server.clone(), tool: tool.name.clone(), latency_ms, ok, result, error });
    parsed.ok()
}


/// Heights and weights the viewer gave ("170cm", "60 kg", "120斤"), which a size reply may repeat.
fn viewer_measurements<'a>(texts: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    for text in texts {
        let chars: Vec<char> = text.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            if !chars[i].is_ascii_digit() {
                i += 1;
                continue;
            }
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                i += 1;
            }
            let number: String = chars[start..i].iter().collect();
            let unit: String = chars[i..].iter().skip_while(|c| c.is_whitespace()).take(3).collect::<String>().to_lowercase();
            if ["cm", "kg", "斤", "公斤", "lb", "m "].iter().any(|u| unit.starts_with(u)) {
                out.push(number);
            }
        }
    }
    out
}

/// A result that claims to be JSON (starts with `{` or `[`) but does not parse.
fn malformed(text: &str) -> bool {
    let t = text.trim_start();
    (t.starts_with('{') || t.starts_with('[')) && serde_json::from_str::<Value>(text).is_err()
}

fn hook_event(r: &HookRecord) -> TraceEvent {
    let (decision, reason) = match &r.decision {
        Decision::Allow => ("allow", None),
        Decision::Correct { .. } => ("correct", None),
        Decision::Retry { reason } => ("retry", Some(reason.clone())),
        Decision::Block { reason } => ("block", Some(reason.clone())),
    };
    TraceEvent::Hook {
        point: r.point.name().into(),
        hook: r.hook.clone(),
        decision: decision.into(),
        reason: reason.or_else(|| r.error.clone()),
    }
}

/// Whether an LLM error is the caller's own mistake (a bad request) rather than a fault of the endpoint.
pub fn is_caller_error(e: &LlmError) -> bool {
    matches!(e, LlmError::InvalidRequest(_) | LlmError::Load(_) | LlmError::NoMtpHead(_))
}
