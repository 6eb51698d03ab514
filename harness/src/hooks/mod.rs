//! Hooks: checks at four fixed points of the agent loop that return a [`Decision`].
//!
//! | point | payload | subject a `Correct` replaces |
//! |---|---|---|
//! | `input` | the viewer comment | `comment` (string) |
//! | `before_tool` | tool name, arguments (+ raw text / parse error) | `arguments` (object) |
//! | `after_tool` | tool name, arguments, result | `result` |
//! | `before_reply` | the reply and the evidence (tool results, context) | `reply` (string) |
//!
//! [`Hooks::run`] runs every hook at a point in order (built-ins first, then external hooks in file order). A
//! `Correct` replaces the subject and the next hook sees the new value; `Retry` and `Block` stop the run. Each
//! hook has a retry budget per request ([`RetryBudget`]); a `Retry` past it becomes a `Block`. The agent charges
//! one loop per retry, so budgets should stay below `max_loops`.
//!
//! `hooks.json`:
//! ```json
//! {"builtins": {"reply_length": {"on_violation": "truncate"}, "forbidden_claims": {"extra": ["miracle"]},
//!               "grounding": {"enabled": true, "retry_budget": 1},
//!               "invented_discount": {"enabled": true, "retry_budget": 1}},
//!  "external": [{"name": "brand-words", "point": "before_reply", "command": "hooks/brand.sh", "args": [],
//!                "timeout_ms": 2000, "retry_budget": 1, "on_error": "allow"}]}
//! ```

mod builtin;
mod claims;
mod config;
mod external;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use builtin::truncate_at_sentences;
pub use builtin::{Builtin, LengthAction};
pub use claims::{CLAIM_FAMILIES, DiscountMention, ForbiddenClaim, discount_mentions, find_forbidden_claim};
pub use config::{BuiltinsConfig, ExternalHookConfig, FeedbackConfig, HooksConfig, OnError, REASON};
pub use external::{ExternalHook, HookError, resolve_command};

use crate::config::Constraints;
use crate::error::HarnessError;
use crate::tools::ToolRegistry;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookPoint {
    Input,
    BeforeTool,
    AfterTool,
    BeforeReply,
}

impl HookPoint {
    pub fn name(self) -> &'static str {
        match self {
            HookPoint::Input => "input",
            HookPoint::BeforeTool => "before_tool",
            HookPoint::AfterTool => "after_tool",
            HookPoint::BeforeReply => "before_reply",
        }
    }
}

/// What a hook decides. Serialized as `{"decision": "allow"}`, `{"decision": "correct", "value": ...}`,
/// `{"decision": "retry", "reason": ...}`, `{"decision": "block", "reason": ...}` — also the format an
/// external hook may print on stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Allow,
    /// Go on with `value` in place of the point's subject.
    Correct {
        value: Value,
    },
    /// Ask the model again, telling it `reason` (costs one loop).
    Retry {
        reason: String,
    },
    /// Stop: do not call the tool / do not send the reply / drop the comment.
    Block {
        reason: String,
    },
}

impl Decision {
    fn is_final(&self) -> bool {
        matches!(self, Decision::Retry { .. } | Decision::Block { .. })
    }
}

/// What a hook sees. Serialized with a `point` tag; external hooks get this object on stdin with a `hook`
/// field (the hook's name) added.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "point", rename_all = "snake_case")]
pub enum HookPayload {
    Input {
        comment: String,
    },
    BeforeTool {
        name: String,
        /// The parsed arguments (a JSON string here is parsed by the `tool_call_syntax` hook).
        arguments: Value,
        /// The tool call as the model wrote it, when the agent has it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raw: Option<String>,
        /// Why the agent could not parse the tool call, if it could not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parse_error: Option<String>,
    },
    AfterTool {
        name: String,
        arguments: Value,
        result: Value,
        #[serde(default)]
        is_error: bool,
    },
    BeforeReply {
        reply: String,
        /// Texts the reply may draw facts from: tool results, product specs, room status, FAQ answers.
        #[serde(default)]
        evidence: Vec<String>,
    },
}

impl HookPayload {
    pub fn point(&self) -> HookPoint {
        match self {
            HookPayload::Input { .. } => HookPoint::Input,
            HookPayload::BeforeTool { .. } => HookPoint::BeforeTool,
            HookPayload::AfterTool { .. } => HookPoint::AfterTool,
            HookPayload::BeforeReply { .. } => HookPoint::BeforeReply,
        }
    }

    /// The value a `Correct` replaces.
    pub fn subject(&self) -> Value {
        match self {
            HookPayload::Input { comment } => Value::String(comment.clone()),
            HookPayload::BeforeTool { arguments, .. } => arguments.clone(),
            HookPayload::AfterTool { result, .. } => result.clone(),
            HookPayload::BeforeReply { reply, .. } => Value::String(reply.clone()),
        }
    }

    /// Replace the subject; text subjects need a string.
    pub fn apply(&mut self, value: Value) -> Result<(), String> {
        match (self, value) {
            (HookPayload::Input { comment }, Value::String(s)) => *comment = s,
            (HookPayload::BeforeReply { reply, .. }, Value::String(s)) => *reply = s,
            (HookPayload::BeforeTool { arguments, .. }, v) => *arguments = v,
            (HookPayload::AfterTool { result, .. }, v) => *result = v,
            (p, v) => {
                return Err(format!("a correction at `{}` must be a string, got {v}", p.point().name()));
            }
        }
        Ok(())
    }
}

/// What a hook is.
#[derive(Debug, Clone)]
pub enum HookKind {
    Builtin(Builtin),
    External(ExternalHook),
}

#[derive(Debug, Clone)]
pub struct Hook {
    pub name: String,
    pub point: HookPoint,
    /// Retries this hook may ask for per request.
    pub retry_budget: u32,
    pub kind: HookKind,
}

impl Hook {
    /// Run this hook alone (no budget): its decision, or the error of an external hook.
    pub fn check(&self, payload: &HookPayload, tools: Option<&ToolRegistry>) -> Result<Decision, HookError> {
        match &self.kind {
            HookKind::Builtin(b) => Ok(b.check(payload, tools)),
            HookKind::External(e) => e.call(&self.name, payload),
        }
    }
}

/// One hook's decision in a run, for the trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HookRecord {
    pub hook: String,
    pub point: HookPoint,
    #[serde(flatten)]
    pub decision: Decision,
    /// An external hook's failure (its decision then follows `on_error`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub elapsed_ms: f64,
}

/// The outcome of running every hook at one point.
#[derive(Debug, Clone, PartialEq)]
pub struct HookRun {
    /// `Allow`; `Correct` with the final subject when any hook corrected it; or the `Retry`/`Block` that stopped
    /// the run.
    pub decision: Decision,
    /// The payload with every correction applied.
    pub payload: HookPayload,
    pub records: Vec<HookRecord>,
    /// The hook whose `Retry` became this run's `Block` because its retry budget was spent: the model could
    /// not get it right, as opposed to a hook that blocks outright.
    pub retries_exhausted: Option<String>,
}

/// Retries left per hook for one request (`Hooks::new_budget`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RetryBudget {
    remaining: BTreeMap<String, u32>,
}

impl RetryBudget {
    pub fn remaining(&self, hook: &str) -> u32 {
        self.remaining.get(hook).copied().unwrap_or(0)
    }

    /// Spend one retry of `hook`; false when none is left.
    pub fn charge(&mut self, hook: &str) -> bool {
        match self.remaining.get_mut(hook) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }
}

/// The configured hooks, in run order.
#[derive(Debug, Clone, Default)]
pub struct Hooks {
    hooks: Vec<Hook>,
    skipped: Vec<SkippedHook>,
}

/// An optional external hook left out because its command cannot run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedHook {
    pub hook: String,
    pub reason: String,
}

/// Why `ext`'s command cannot run; shared by `check` and [`Hooks::from_config`] so both say the same.
pub(crate) fn missing_command_message(ext: &ExternalHookConfig) -> String {
    format!(
        "hook `{}`: command `{}` not found (on PATH, or as an executable file relative to the harness directory)",
        ext.name, ext.command
    )
}

impl Hooks {
    /// Build from `hooks.json` (external commands resolve relative to `dir`). An external hook whose command
    /// cannot be found is an error, unless it is `optional`: then it is left out and listed in
    /// [`Hooks::skipped`].
    pub fn from_config(config: &HooksConfig, constraints: &Constraints, dir: &Path) -> Result<Self, HarnessError> {
        let mut hooks = config.builtins.hooks(constraints);
        let mut skipped = Vec::new();
        let at = || crate::error::Location::file("hooks.json");
        for ext in &config.external {
            if hooks.iter().any(|h| h.name == ext.name) {
                return Err(HarnessError::invalid(at(), format!("hook name `{}` is used twice", ext.name)));
            }
            if resolve_command(&ext.command, dir).is_none() {
                let why = missing_command_message(ext);
                if !ext.optional {
                    return Err(HarnessError::invalid(at(), why));
                }
                tracing::warn!(hook = %ext.name, reason = %why, "optional hook left out");
                skipped.push(SkippedHook { hook: ext.name.clone(), reason: why });
                continue;
            }
            hooks.push(Hook {
                name: ext.name.clone(),
                point: ext.point,
                retry_budget: ext.retry_budget,
                kind: HookKind::External(ExternalHook::new(ext, dir)),
            });
        }
        Ok(Hooks { hooks, skipped })
    }

    pub fn from_hooks(hooks: Vec<Hook>) -> Self {
        Hooks { hooks, skipped: Vec::new() }
    }

    pub fn hooks(&self) -> &[Hook] {
        &self.hooks
    }

    /// Optional external hooks that were left out because their command is missing, for the agent's trace.
    pub fn skipped(&self) -> &[SkippedHook] {
        &self.skipped
    }

    pub fn at(&self, point: HookPoint) -> impl Iterator<Item = &Hook> {
        self.hooks.iter().filter(move |h| h.point == point)
    }

    pub fn get(&self, name: &str) -> Option<&Hook> {
        self.hooks.iter().find(|h| h.name == name)
    }

    /// The retry budget of hook `name`.
    pub fn retry_budget(&self, name: &str) -> Option<u32> {
        self.get(name).map(|h| h.retry_budget)
    }

    /// A fresh per-request budget.
    pub fn new_budget(&self) -> RetryBudget {
        RetryBudget { remaining: self.hooks.iter().map(|h| (h.name.clone(), h.retry_budget)).collect() }
    }

    /// Run every hook at `payload`'s point (see the module docs). `tools` lets `tool_args` check schemas.
    pub fn run(&self, payload: HookPayload, tools: Option<&ToolRegistry>, budget: &mut RetryBudget) -> HookRun {
        let point = payload.point();
        let original = payload.subject();
        let mut payload = payload;
        let mut records = Vec::new();
        for hook in self.at(point) {
            let start = Instant::now();
            let (mut decision, error) = match hook.check(&payload, tools) {
                Ok(d) => (d, None),
                Err(e) => {
                    let on_error = match &hook.kind {
                        HookKind::External(x) => x.on_error,
                        HookKind::Builtin(_) => OnError::Allow,
                    };
                    let d = match on_error {
                        OnError::Allow => Decision::Allow,
                        OnError::Block => Decision::Block { reason: format!("hook `{}` failed: {e}", hook.name) },
                    };
                    (d, Some(e.to_string()))
                }
            };
            let mut error = error;
            if let Decision::Correct { value } = &decision
                && let Err(e) = payload.apply(value.clone())
            {
                error = Some(e);
                decision = Decision::Allow;
            }
            let mut retries_exhausted = None;
            if let Decision::Retry { reason } = &decision
                && !budget.charge(&hook.name)
            {
                decision =
                    Decision::Block { reason: format!("{reason} (retry budget of hook `{}` exhausted)", hook.name) };
                retries_exhausted = Some(hook.name.clone());
            }
            tracing::debug!(hook = %hook.name, point = point.name(), ?decision, "hook");
            let stop = decision.is_final();
            records.push(HookRecord {
                hook: hook.name.clone(),
                point,
                decision: decision.clone(),
                error,
                elapsed_ms: start.elapsed().as_secs_f64() * 1e3,
            });
            if stop {
                return HookRun { decision, payload, records, retries_exhausted };
            }
        }
        let subject = payload.subject();
        let decision = if subject != original { Decision::Correct { value: subject } } else { Decision::Allow };
        HookRun { decision, payload, records, retries_exhausted: None }
    }
}
