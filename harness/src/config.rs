//! `harness.json`: role and reply style, numeric constraints, router and retrieval settings, and the prompt
//! block order.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Location, json_error};
use crate::limits::{MAX_LOOPS_CEILING, REQUEST_BUDGET_CEILING_MS, TOOL_TIMEOUT_CEILING_MS};
use crate::prompt::BlockKind;
use crate::skill::RouterConfig;

/// Numeric constraints: typed values used by the agent loop and hooks, and rendered into the prompt's
/// `constraints` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Constraints {
    /// Longest reply, in characters (Unicode scalar values).
    pub max_reply_chars: usize,
    /// Most model rounds (tool loops) per comment; every hook retry costs one (at most [`MAX_LOOPS_CEILING`]).
    pub max_loops: u32,
    /// Timeout of one MCP `tools/call` (at most [`TOOL_TIMEOUT_CEILING_MS`], and not above `request_budget_ms`).
    pub tool_timeout_ms: u64,
    /// Wall-clock budget for answering one comment: every round, tool call and hook (at most
    /// [`REQUEST_BUDGET_CEILING_MS`]).
    pub request_budget_ms: u64,
    /// Longest accepted viewer comment (the `input_sanity` hook truncates longer ones).
    pub max_input_chars: usize,
}

impl Default for Constraints {
    fn default() -> Self {
        Constraints {
            max_reply_chars: 120,
            max_loops: 4,
            tool_timeout_ms: 5000,
            request_budget_ms: 15_000,
            max_input_chars: 300,
        }
    }
}

impl Constraints {
    /// The constraints as prompt text.
    pub fn render(&self) -> String {
        format!(
            "- Reply in at most {} characters: one or two short spoken sentences.\n\
             - You have at most {} rounds per comment; call a tool only when the answer depends on live data, \
             and call each tool at most once for the same arguments.\n\
             - A tool call that takes longer than {} ms fails; then answer without it and say you will check.",
            self.max_reply_chars, self.max_loops, self.tool_timeout_ms
        )
    }
}

/// `harness.json` (the constraint fields sit at the top level of the file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "RawConfig")]
pub struct HarnessConfig {
    /// Who the host is (persona, shop, audience).
    pub role: String,
    /// How replies sound (tone, length, language).
    pub style: String,
    #[serde(flatten)]
    pub constraints: Constraints,
    pub router: RouterConfig,
    /// FAQ entries retrieved per comment.
    pub faq_top_k: usize,
    /// Minimum BM25 score for a FAQ entry to be retrieved.
    pub faq_min_score: f32,
    /// Whether the prompt lists every skill's name and description (so the model can ask for one by name).
    pub skill_index: bool,
    /// Prompt block order; blocks not listed are left out. Default: stable blocks first.
    pub blocks: Vec<BlockKind>,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            role: String::new(),
            style: String::new(),
            constraints: Constraints::default(),
            router: RouterConfig::default(),
            faq_top_k: 3,
            faq_min_score: 1.0,
            skill_index: true,
            blocks: BlockKind::DEFAULT_ORDER.to_vec(),
        }
    }
}

/// The file as written: flat, so that unknown fields can be rejected (serde cannot deny unknown fields through
/// `flatten`).
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawConfig {
    role: String,
    style: String,
    max_reply_chars: usize,
    max_loops: u32,
    tool_timeout_ms: u64,
    request_budget_ms: u64,
    max_input_chars: usize,
    router: RouterConfig,
    faq_top_k: usize,
    faq_min_score: f32,
    skill_index: bool,
    blocks: Vec<BlockKind>,
}

impl Default for RawConfig {
    fn default() -> Self {
        let d = HarnessConfig::default();
        let c = d.constraints;
        RawConfig {
            role: d.role,
            style: d.style,
            max_reply_chars: c.max_reply_chars,
            max_loops: c.max_loops,
            tool_timeout_ms: c.tool_timeout_ms,
            request_budget_ms: c.request_budget_ms,
            max_input_chars: c.max_input_chars,
            router: d.router,
            faq_top_k: d.faq_top_k,
            faq_min_score: d.faq_min_score,
            skill_index: d.skill_index,
            blocks: d.blocks,
        }
    }
}

impl From<RawConfig> for HarnessConfig {
    fn from(r: RawConfig) -> Self {
        HarnessConfig {
            role: r.role,
            style: r.style,
            constraints: Constraints {
                max_reply_chars: r.max_reply_chars,
                max_loops: r.max_loops,
                tool_timeout_ms: r.tool_timeout_ms,
                request_budget_ms: r.request_budget_ms,
                max_input_chars: r.max_input_chars,
            },
            router: r.router,
            faq_top_k: r.faq_top_k,
            faq_min_score: r.faq_min_score,
            skill_index: r.skill_index,
            blocks: r.blocks,
        }
    }
}

impl Constraints {
    /// Every invalid value, each message naming the field and its limit.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut at_least_one = |field: &str, zero: bool| {
            if zero {
                out.push(format!("`{field}` must be at least 1"));
            }
        };
        at_least_one("max_reply_chars", self.max_reply_chars == 0);
        at_least_one("max_loops", self.max_loops == 0);
        at_least_one("tool_timeout_ms", self.tool_timeout_ms == 0);
        at_least_one("request_budget_ms", self.request_budget_ms == 0);
        at_least_one("max_input_chars", self.max_input_chars == 0);
        if self.max_loops > MAX_LOOPS_CEILING {
            out.push(format!("`max_loops` is {} but the ceiling is {MAX_LOOPS_CEILING}", self.max_loops));
        }
        if self.tool_timeout_ms > TOOL_TIMEOUT_CEILING_MS {
            out.push(format!(
                "`tool_timeout_ms` is {} but the ceiling is {TOOL_TIMEOUT_CEILING_MS}",
                self.tool_timeout_ms
            ));
        }
        if self.request_budget_ms > REQUEST_BUDGET_CEILING_MS {
            out.push(format!(
                "`request_budget_ms` is {} but the ceiling is {REQUEST_BUDGET_CEILING_MS}",
                self.request_budget_ms
            ));
        }
        if self.request_budget_ms > 0 && self.tool_timeout_ms > self.request_budget_ms {
            out.push(format!(
                "`tool_timeout_ms` ({}) is above `request_budget_ms` ({}); one tool call cannot take longer than the \
                 whole request",
                self.tool_timeout_ms, self.request_budget_ms
            ));
        }
        out
    }
}

impl HarnessConfig {
    /// Parse `harness.json` text; `path` is used in errors. The first invalid value is the error.
    pub fn parse(path: &Path, text: &str) -> Result<Self, HarnessError> {
        let config = Self::parse_unchecked(path, text)?;
        match config.problems(path).into_iter().next() {
            Some(e) => Err(e),
            None => Ok(config),
        }
    }

    /// Parse without checking values (JSON shape and unknown fields only); see [`HarnessConfig::problems`].
    pub fn parse_unchecked(path: &Path, text: &str) -> Result<Self, HarnessError> {
        serde_json::from_str(text).map_err(|e| json_error(path, &e))
    }

    /// Every invalid value (constraints out of range, duplicate blocks, non-finite scores).
    pub fn problems(&self, path: &Path) -> Vec<HarnessError> {
        let at = || Location::file(path);
        let mut out: Vec<HarnessError> =
            self.constraints.problems().into_iter().map(|m| HarnessError::invalid(at(), m)).collect();
        for (i, b) in self.blocks.iter().enumerate() {
            if self.blocks[..i].contains(b) {
                out.push(HarnessError::invalid(
                    at(),
                    format!("prompt block `{}` is listed twice in `blocks`", b.name()),
                ));
            }
        }
        if !self.router.min_score.is_finite() || !self.faq_min_score.is_finite() {
            out.push(HarnessError::invalid(at(), "scores must be finite numbers"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_missing_fields() {
        let c = HarnessConfig::parse(Path::new("harness.json"), "{\"role\": \"host\"}").unwrap();
        assert_eq!(c.constraints.max_loops, 4);
        assert_eq!(c.constraints.tool_timeout_ms, 5000);
        assert_eq!(c.blocks, BlockKind::DEFAULT_ORDER.to_vec());
    }

    #[test]
    fn invalid_values_and_unknown_fields_are_errors() {
        let p = Path::new("harness.json");
        assert!(HarnessConfig::parse(p, "{\"max_loops\": 0}").unwrap_err().to_string().contains("max_loops"));
        assert!(HarnessConfig::parse(p, "{\"max_lops\": 3}").unwrap_err().to_string().contains("max_lops"));
        let e = HarnessConfig::parse(p, "{\n\"role\": 3}").unwrap_err();
        assert!(e.to_string().starts_with("harness.json:2:"), "{e}");
        assert!(HarnessConfig::parse(p, "{\"blocks\": [\"rules\", \"rules\"]}").is_err());
    }

    #[test]
    fn values_above_ceilings_name_the_field_and_the_ceiling() {
        let p = Path::new("harness.json");
        let msg = |text: &str| HarnessConfig::parse(p, text).unwrap_err().to_string();
        assert!(msg("{\"max_loops\": 50}").contains("`max_loops` is 50 but the ceiling is 8"));
        assert!(msg("{\"tool_timeout_ms\": 600000}").contains("`tool_timeout_ms` is 600000 but the ceiling is 15000"));
        assert!(
            msg("{\"request_budget_ms\": 120000}").contains("`request_budget_ms` is 120000 but the ceiling is 60000")
        );
        assert!(msg("{\"request_budget_ms\": 0}").contains("`request_budget_ms` must be at least 1"));
        let both = msg("{\"tool_timeout_ms\": 9000, \"request_budget_ms\": 8000}");
        assert!(both.contains("`tool_timeout_ms` (9000) is above `request_budget_ms` (8000)"), "{both}");
        let c = HarnessConfig::parse(p, "{\"max_loops\": 8, \"tool_timeout_ms\": 15000, \"request_budget_ms\": 60000}");
        assert!(c.is_ok(), "values at the ceilings are allowed");
        assert_eq!(HarnessConfig::parse(p, "{}").unwrap().constraints.request_budget_ms, 15_000);
    }
}
