//! `hooks.json`: which built-in hooks are on (with parameters and retry budgets) and the external command hooks.
//! A missing file means every built-in on with its defaults and no external hooks.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::builtin::{Builtin, LengthAction};
use super::{Hook, HookKind, HookPoint};
use crate::config::Constraints;
use crate::error::{HarnessError, Location, json_error};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HooksConfig {
    pub builtins: BuiltinsConfig,
    pub external: Vec<ExternalHookConfig>,
    pub feedback: FeedbackConfig,
}

impl HooksConfig {
    /// Parse `hooks.json` text; `path` is used in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, HarnessError> {
        let config: HooksConfig = serde_json::from_str(text).map_err(|e| json_error(path, &e))?;
        // The line of a field's key in the file (1 when it is not written out).
        let line_of = |field: &str| text.find(&format!("\"{field}\"")).map_or(1, |i| text[..i].matches('\n').count() + 1);
        let t = config.feedback.retry_temperature;
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(HarnessError::invalid(
                Location::line(path, line_of("retry_temperature")),
                format!("feedback.retry_temperature must be a number in 0..=2, got {t}"),
            ));
        }
        for (field, template) in [("reply_retry", &config.feedback.reply_retry), ("tool_call_retry", &config.feedback.tool_call_retry)] {
            if !template.contains(REASON) {
                return Err(HarnessError::invalid(
                    Location::line(path, line_of(field)),
                    format!("feedback.{field} must contain `{REASON}` (where the hook's reason goes)"),
                ));
            }
        }
        Ok(config)
    }
}

/// The placeholder a feedback template puts the hook's reason in.
pub const REASON: &str = "{reason}";

/// How a hook `Retry` is put to the model: templates of the message the agent adds before asking again, with
/// `{reason}` where the hook's reason goes, and how the retry is decoded. The default wording is what the bundled
/// model was trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FeedbackConfig {
    /// After a `before_reply` hook refused the reply.
    pub reply_retry: String,
    /// After a tool call that did not parse.
    pub tool_call_retry: String,
    /// Sampling temperature of the model call that follows a retry message: the call runs at the larger of this
    /// and the request's temperature (0, the default: the request's settings). A greedy retry from a context that
    /// differs from the refused one only by the feedback message tends to write the refused text again; with a
    /// temperature it draws another reply, which the hooks check again. A request without a seed gets one derived
    /// from the conversation, so temperature-0 requests stay reproducible.
    pub retry_temperature: f32,
    /// After a reply refused for a figure no evidence shows, the retry may not begin with the refused reply up to
    /// and including the first word of the clause that states it ([`crate::grounding::refused_clause_prefix`]):
    /// the agent sends that text as a banned prefix, so a greedy retry keeps the clauses before it and must
    /// take another word where the unsupported one began, instead of writing the refused reply again.
    pub ban_refused_clause: bool,
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig {
            reply_retry: "(system) Your reply was not sent: {reason}. Reply again.".into(),
            tool_call_retry: "(system) Your tool call could not be parsed: {reason}. Write it again in the required format."
                .into(),
            retry_temperature: 0.0,
            ban_refused_clause: false,
        }
    }
}

impl FeedbackConfig {
    pub fn reply_retry(&self, reason: &str) -> String {
        self.reply_retry.replace(REASON, reason)
    }
    pub fn tool_call_retry(&self, reason: &str) -> String {
        self.tool_call_retry.replace(REASON, reason)
    }
}

/// What an external hook's failure (spawn error, timeout, unexpected exit code, bad output) decides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Fail open: the failure is recorded and the run goes on.
    #[default]
    Allow,
    Block,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExternalHookConfig {
    pub name: String,
    pub point: HookPoint,
    /// A program on `PATH`, or a path (relative paths are relative to the harness directory).
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "one")]
    pub retry_budget: u32,
    #[serde(default)]
    pub on_error: OnError,
    /// A missing or non-executable `command` is then a warning, and the hook is left out (see
    /// `Hooks::skipped`), instead of an error that stops the harness from loading.
    #[serde(default)]
    pub optional: bool,
}

fn default_timeout_ms() -> u64 {
    2000
}
fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}

macro_rules! builtin_config {
    ($(#[$doc:meta])* $name:ident, budget = $budget:expr, { $($(#[$fdoc:meta])* $field:ident : $ty:ty = $default:expr),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            #[serde(default = "yes")]
            pub enabled: bool,
            pub retry_budget: u32,
            $($(#[$fdoc])* pub $field: $ty,)*
        }
        impl Default for $name {
            fn default() -> Self {
                $name { enabled: true, retry_budget: $budget, $($field: $default,)* }
            }
        }
    };
}

builtin_config!(
/// `input`: strip control characters and chat-template tokens, collapse whitespace, block empty comments,
/// truncate long ones.
InputSanityConfig, budget = 0, {
    /// Default: `max_input_chars` from `harness.json`.
    max_chars: Option<usize> = None,
});
builtin_config!(
    /// `before_tool`: a tool call that did not parse, or whose arguments are not a JSON object.
    ToolCallSyntaxConfig, budget = 2, {});
builtin_config!(
/// `before_tool`: the tool exists and its arguments match its input schema (after coercion).
ToolArgsConfig, budget = 2, {
    coerce: bool = true,
});
builtin_config!(
/// `after_tool`: long results are cut to `max_chars`.
ToolResultConfig, budget = 0, {
    max_chars: usize = 4000,
});
builtin_config!(
/// `before_reply`: the reply fits `max_reply_chars` (from `harness.json` unless `max_chars` is set).
ReplyLengthConfig, budget = 1, {
    max_chars: Option<usize> = None,
    on_violation: LengthAction = LengthAction::Truncate,
});
builtin_config!(
/// `before_reply`: no claims of the built-in families (absolute guarantees, medical effects, competitor
/// comparisons, unprovable superlatives, private data, instruction reveals; see `CLAIM_FAMILIES`). `extra` (and,
/// kept for old files, `phrases`) add exact phrases on top of the families.
ForbiddenClaimsConfig, budget = 1, {
    phrases: Option<Vec<String>> = None,
    extra: Vec<String> = Vec::new(),
});
builtin_config!(
    /// `before_reply`: every figure in the reply (price, percent, 折, count, fee, threshold, duration, date, time,
    /// size, any number) appears as a number in the evidence.
    GroundingConfig, budget = 1, {});
builtin_config!(
    /// `before_reply`: every discount the reply mentions is in the evidence; also catches figure-free ones
    /// ("half price", "buy one get one") that `grounding` cannot see.
    InventedDiscountConfig, budget = 1, {});
builtin_config!(
    /// `before_reply`: strip `<think>` reasoning from the reply.
    LeakedReasoningConfig, budget = 1, {});
builtin_config!(
    /// `before_reply`: no tool-call or chat-template syntax in the reply.
    LeakedToolSyntaxConfig, budget = 1, {});

/// The built-in hooks, in run order within each point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BuiltinsConfig {
    pub input_sanity: InputSanityConfig,
    pub tool_call_syntax: ToolCallSyntaxConfig,
    pub tool_args: ToolArgsConfig,
    pub tool_result: ToolResultConfig,
    pub leaked_reasoning: LeakedReasoningConfig,
    pub leaked_tool_syntax: LeakedToolSyntaxConfig,
    pub forbidden_claims: ForbiddenClaimsConfig,
    pub grounding: GroundingConfig,
    pub invented_discount: InventedDiscountConfig,
    pub reply_length: ReplyLengthConfig,
}

impl BuiltinsConfig {
    /// The enabled built-ins as hooks.
    pub fn hooks(&self, constraints: &Constraints) -> Vec<Hook> {
        let mut out = Vec::new();
        let mut add = |enabled: bool, name: &str, budget: u32, b: Builtin| {
            if enabled {
                out.push(Hook {
                    name: name.to_string(),
                    point: b.point(),
                    retry_budget: budget,
                    kind: HookKind::Builtin(b),
                });
            }
        };
        let c = &self.input_sanity;
        add(
            c.enabled,
            "input_sanity",
            c.retry_budget,
            Builtin::InputSanity { max_chars: c.max_chars.unwrap_or(constraints.max_input_chars) },
        );
        let c = &self.tool_call_syntax;
        add(c.enabled, "tool_call_syntax", c.retry_budget, Builtin::ToolCallSyntax);
        let c = &self.tool_args;
        add(c.enabled, "tool_args", c.retry_budget, Builtin::ToolArgs { coerce: c.coerce });
        let c = &self.tool_result;
        add(c.enabled, "tool_result", c.retry_budget, Builtin::ToolResult { max_chars: c.max_chars });
        let c = &self.leaked_reasoning;
        add(c.enabled, "leaked_reasoning", c.retry_budget, Builtin::LeakedReasoning);
        let c = &self.leaked_tool_syntax;
        add(c.enabled, "leaked_tool_syntax", c.retry_budget, Builtin::LeakedToolSyntax);
        let c = &self.forbidden_claims;
        let mut phrases: Vec<String> = c.phrases.clone().unwrap_or_default();
        phrases.extend(c.extra.iter().cloned());
        add(c.enabled, "forbidden_claims", c.retry_budget, Builtin::ForbiddenClaims { phrases });
        let c = &self.grounding;
        add(c.enabled, "grounding", c.retry_budget, Builtin::Grounding);
        let c = &self.invented_discount;
        add(c.enabled, "invented_discount", c.retry_budget, Builtin::InventedDiscount);
        let c = &self.reply_length;
        add(
            c.enabled,
            "reply_length",
            c.retry_budget,
            Builtin::ReplyLength {
                max_chars: c.max_chars.unwrap_or(constraints.max_reply_chars),
                on_violation: c.on_violation,
            },
        );
        out
    }
}
