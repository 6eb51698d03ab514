//! The agent loop: prompt → generate → parse → hooks → tools → … → reply, at most `max_loops` generations.
//!
//! One request: input hooks on the comment; the harness builds the system prompt (skills, FAQ, room, rules);
//! then each loop generates once. Tool calls go through `before_tool` hooks, MCP (`tool_timeout_ms`),
//! `after_tool` hooks, and come back as tool messages; a plain reply goes through `before_reply` hooks. A hook
//! `Retry` feeds its reason back to the model and costs a loop; `Block` ends with a safe fallback reply. Every
//! step is recorded in the [`Trace`].

use std::time::{Duration, Instant};

use nextn_harness::{
    Decision, Harness, HookPayload, HookRecord, Product, RequestContext, RetryBudget, RoomStatus, ToolRegistry,
    reply_evidence,
};
use serde_json::{Value, json};

use crate::llm::{ChatRequest, LlmClient};
use crate::mcp::{McpError, McpPool};
use crate::toolcall::parse_reply;
use crate::trace::{Phase, PromptBlock, Trace, TraceEvent};

/// What the host says when it cannot answer safely (blocked input/reply, loop limit, model failure).
pub const FALLBACK_REPLY: &str = "Thanks for asking! Let me double-check that for you and come right back.";

/// One viewer comment and its context.
#[derive(Debug, Clone, Default)]
pub struct AgentRequest {
    pub comment: String,
    /// Earlier turns, `(role, text)` with role `user`/`viewer` or `assistant`/`host`.
    pub history: Vec<(String, String)>,
    pub room: Option<RoomStatus>,
    pub products: Vec<Product>,
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
    /// A hook blocked the comment or the reply.
    Blocked,
    /// `max_loops` generations without a final reply.
    LoopLimit,
    /// The model failed (e.g. an endpoint error).
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Replied => "replied",
            Outcome::Blocked => "blocked",
            Outcome::LoopLimit => "loop_limit",
            Outcome::Error => "error",
        }
    }
}

pub struct AgentReply {
    pub reply: String,
    pub outcome: Outcome,
    pub loops: usize,
    pub trace: Trace,
}

pub struct Agent {
    harness: Harness,
    llm: Box<dyn LlmClient>,
    mcp: McpPool,
    registry: ToolRegistry,
    pub settings: GenSettings,
    next_request: u64,
}

impl Agent {
    /// Tools are discovered from every MCP server in `mcp` and renamed / described per the harness.
    pub fn new(harness: Harness, llm: Box<dyn LlmClient>, mcp: McpPool) -> Result<Self, nextn_harness::HarnessError> {
        let specs = mcp
            .tools()
            .iter()
            .map(|t| nextn_harness::ToolSpec {
                server: t.server.clone(),
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: t.input_schema.clone(),
            })
            .collect();
        let registry = harness.tool_registry(specs)?;
        Ok(Agent { harness, llm, mcp, registry, settings: GenSettings::default(), next_request: 0 })
    }

    pub fn harness(&self) -> &Harness {
        &self.harness
    }
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// Answer one comment. Never fails: every problem becomes a trace event and, at worst, the fallback reply.
    pub async fn handle(&mut self, req: AgentRequest) -> AgentReply {
        let request_id = format!("req-{}", self.next_request);
        self.next_request += 1;
        let mut trace = Trace::new(request_id.clone());
        trace.push(TraceEvent::Start {
            request_id,
            harness_version: self.harness.version().to_string(),
            comment: req.comment.clone(),
            llm: self.llm.name(),
        });
        let mut budget = self.harness.hooks().new_budget();
        let (reply, outcome, loops) = self.run(req, &mut trace, &mut budget).await;
        trace.push(TraceEvent::Reply { text: reply.clone(), loops, outcome: outcome.as_str().into() });
        trace.finish_timing();
        AgentReply { reply, outcome, loops, trace }
    }

    async fn run(&mut self, req: AgentRequest, trace: &mut Trace, budget: &mut RetryBudget) -> (String, Outcome, usize) {
        // 1. Input hooks.
        let run = self.hooks(HookPayload::Input { comment: req.comment.clone() }, trace, budget);
        let comment = match (run.0, run.1) {
            (Decision::Block { .. } | Decision::Retry { .. }, _) => return (FALLBACK_REPLY.into(), Outcome::Blocked, 0),
            (_, HookPayload::Input { comment }) => comment,
            _ => req.comment.clone(),
        };

        // 2. The system prompt from the harness.
        let ctx = RequestContext { comment: comment.clone(), history: req.history.clone(), room: req.room, products: req.products };
        let t = Instant::now();
        let prompt = match self.harness.build_prompt(&ctx, None) {
            Ok(p) => p,
            Err(e) => {
                trace.push(TraceEvent::Hook { point: "prompt".into(), hook: "harness".into(), decision: "error".into(), reason: Some(e.to_string()) });
                return (FALLBACK_REPLY.into(), Outcome::Error, 0);
            }
        };
        trace.add_time(Phase::Prompt, t.elapsed());
        trace.push(TraceEvent::Prompt {
            blocks: prompt.blocks.iter().map(|b| PromptBlock { name: b.name.clone(), hash: b.hash.clone(), chars: b.chars }).collect(),
            skills: prompt.skills.selected.clone(),
        });
        let mut messages = vec![json!({"role": "system", "content": prompt.system})];
        for (role, text) in &ctx.history {
            let role = if matches!(role.as_str(), "assistant" | "host") { "assistant" } else { "user" };
            messages.push(json!({"role": role, "content": text}));
        }
        messages.push(json!({"role": "user", "content": comment}));

        let tools = self.registry.openai_tools();
        let constraints = self.harness.constraints().clone();
        let timeout = Duration::from_millis(constraints.tool_timeout_ms);
        let mut tool_results: Vec<Value> = Vec::new();
        let max_loops = constraints.max_loops.max(1) as usize;
        for loop_index in 0..max_loops {
            // 3. Generate.
            let request = ChatRequest {
                messages: messages.clone(),
                tools: tools.clone(),
                max_tokens: self.settings.max_tokens,
                temperature: self.settings.temperature,
                top_p: self.settings.top_p,
                seed: self.settings.seed,
                enable_thinking: Some(false),
                stop: Vec::new(),
            };
            let t = Instant::now();
            let llm = &mut self.llm;
            let generated = tokio::task::block_in_place(|| llm.generate(&request));
            trace.add_time(Phase::Model, t.elapsed());
            let generation = match generated {
                Ok(g) => g,
                Err(e) => {
                    trace.push(TraceEvent::Hook { point: "generate".into(), hook: "llm".into(), decision: "error".into(), reason: Some(e.to_string()) });
                    return (FALLBACK_REPLY.into(), Outcome::Error, loop_index);
                }
            };
            trace.push(TraceEvent::Generation {
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

            // 4. A malformed tool call: the tool-call-syntax hook decides (normally: retry with the reason).
            if parsed.has_errors() && !parsed.has_calls() {
                let err = &parsed.errors[0];
                let payload = HookPayload::BeforeTool {
                    name: err.tool.clone().unwrap_or_default(),
                    arguments: json!({}),
                    raw: Some(err.snippet.clone()),
                    parse_error: Some(err.message.clone()),
                };
                match self.hooks(payload, trace, budget).0 {
                    Decision::Retry { reason } => {
                        messages.push(json!({"role": "assistant", "content": generation.text}));
                        messages.push(json!({"role": "user", "content": format!("(system) Your tool call could not be parsed: {reason}. Write it again in the required format.")}));
                        continue;
                    }
                    Decision::Block { .. } => return (FALLBACK_REPLY.into(), Outcome::Blocked, loop_index + 1),
                    _ => {}
                }
            }

            // 5. Tool calls: hooks, MCP, hooks, tool messages; then loop.
            if parsed.has_calls() {
                let calls: Vec<Value> =
                    parsed.calls.iter().enumerate().map(|(i, c)| c.to_openai(&format!("call_{loop_index}_{i}"))).collect();
                messages.push(json!({"role": "assistant", "content": parsed.text, "tool_calls": calls}));
                for call in &parsed.calls {
                    let parts = Parts { harness: &self.harness, mcp: &self.mcp, registry: &self.registry };
                    let content = parts.call_tool(loop_index, &call.name, Value::Object(call.arguments.clone()), timeout, trace, budget, &mut tool_results).await;
                    messages.push(json!({"role": "tool", "name": call.name, "content": content}));
                }
                continue;
            }

            // 6. A reply: before_reply hooks against the evidence (room, products, FAQ, tool results).
            let evidence = reply_evidence(&ctx, &prompt.faq, &tool_results);
            let (decision, payload) = self.hooks(HookPayload::BeforeReply { reply: parsed.text.clone(), evidence }, trace, budget);
            match decision {
                Decision::Retry { reason } => {
                    messages.push(json!({"role": "assistant", "content": parsed.text}));
                    messages.push(json!({"role": "user", "content": format!("(system) Your reply was not sent: {reason}. Reply again.")}));
                }
                Decision::Block { .. } => return (FALLBACK_REPLY.into(), Outcome::Blocked, loop_index + 1),
                _ => {
                    let reply = match payload {
                        HookPayload::BeforeReply { reply, .. } => reply,
                        _ => parsed.text,
                    };
                    return (reply, Outcome::Replied, loop_index + 1);
                }
            }
        }
        (FALLBACK_REPLY.into(), Outcome::LoopLimit, max_loops)
    }

    fn hooks(&self, payload: HookPayload, trace: &mut Trace, budget: &mut RetryBudget) -> (Decision, HookPayload) {
        Parts { harness: &self.harness, mcp: &self.mcp, registry: &self.registry }.hooks(payload, trace, budget)
    }

    /// Shut the MCP servers down.
    pub async fn close(self) {
        self.mcp.close().await;
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
    fn hooks(&self, payload: HookPayload, trace: &mut Trace, budget: &mut RetryBudget) -> (Decision, HookPayload) {
        let t = Instant::now();
        let run = self.harness.hooks().run(payload, Some(self.registry), budget);
        trace.add_time(Phase::Hooks, t.elapsed());
        for r in &run.records {
            trace.push(hook_event(r));
        }
        (run.decision, run.payload)
    }

    /// One tool call through hooks and MCP; returns the text the model sees.
    #[allow(clippy::too_many_arguments)]
    async fn call_tool(
        &self,
        loop_index: usize,
        name: &str,
        arguments: Value,
        timeout: Duration,
        trace: &mut Trace,
        budget: &mut RetryBudget,
        tool_results: &mut Vec<Value>,
    ) -> String {
        let Some(tool) = self.registry.resolve(name).cloned() else {
            let msg = format!("error: unknown tool `{name}`; available: {}", self.registry.names().join(", "));
            trace.push(TraceEvent::ToolCall { loop_index, server: String::new(), tool: name.into(), arguments, latency_ms: 0.0, ok: false, result: None, error: Some(msg.clone()) });
            return msg;
        };
        let payload = HookPayload::BeforeTool { name: tool.name.clone(), arguments, raw: None, parse_error: None };
        let (decision, payload) = self.hooks(payload, trace, budget);
        let arguments = match (decision, payload) {
            (Decision::Block { reason } | Decision::Retry { reason }, _) => return format!("error: the call was not made: {reason}"),
            (_, HookPayload::BeforeTool { arguments, .. }) => arguments,
            _ => unreachable!("before_tool payload"),
        };
        let t = Instant::now();
        let result = self.mcp.call(&tool.server, &tool.real_name, arguments.clone(), timeout).await;
        let latency = t.elapsed();
        trace.add_time(Phase::Tools, latency);
        let (text, ok, error) = match result {
            Ok(out) if !out.is_error => (out.text, true, None),
            Ok(out) => (format!("error: {}", out.text), false, Some(out.text)),
            Err(e @ McpError::Timeout { .. }) => (format!("error: {e}; answer without this data"), false, Some(e.to_string())),
            Err(e) => (format!("error: {e}"), false, Some(e.to_string())),
        };
        trace.push(TraceEvent::ToolCall {
            loop_index,
            server: tool.server.clone(),
            tool: tool.real_name.clone(),
            arguments: arguments.clone(),
            latency_ms: latency.as_secs_f64() * 1e3,
            ok,
            result: ok.then(|| text.clone()),
            error,
        });
        let result_value = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text.clone()));
        let payload = HookPayload::AfterTool { name: tool.name.clone(), arguments, result: result_value, is_error: !ok };
        let (decision, payload) = self.hooks(payload, trace, budget);
        let final_text = match (decision, payload) {
            (Decision::Block { reason } | Decision::Retry { reason }, _) => format!("error: result withheld: {reason}"),
            (_, HookPayload::AfterTool { result: Value::String(s), .. }) => s,
            (_, HookPayload::AfterTool { result, .. }) => result.to_string(),
            _ => text,
        };
        if ok {
            tool_results.push(Value::String(final_text.clone()));
        }
        final_text
    }
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
