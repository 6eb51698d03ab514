//! `harness.json`: role and reply style, numeric constraints, router and retrieval settings, and the prompt
//! block order.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Location, json_error};
use crate::prompt::BlockKind;
use crate::skill::RouterConfig;

/// Numeric constraints: typed values used by the agent loop and hooks, and rendered into the prompt's
/// `constraints` block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Constraints {
    /// Longest reply, in characters (Unicode scalar values).
    pub max_reply_chars: usize,
    /// Most model rounds (tool loops) per comment; every hook retry costs one.
    pub max_loops: u32,
    /// Timeout of one MCP `tools/call`.
    pub tool_timeout_ms: u64,
    /// Longest accepted viewer comment (the `input_sanity` hook truncates longer ones).
    pub max_input_chars: usize,
    /// Wall-clock budget for one comment: MCP start-up, every model call, tool call and hook.
    pub request_budget_ms: u64,
}

impl Default for Constraints {
    fn default() -> Self {
        Constraints { max_reply_chars: 120, max_loops: 4, tool_timeout_ms: 5000, max_input_chars: 300, request_budget_ms: 15_000 }
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
    max_input_chars: usize,
    request_budget_ms: u64,
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
            max_input_chars: c.max_input_chars,
            request_budget_ms: c.request_budget_ms,
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
                max_input_chars: r.max_input_chars,
                request_budget_ms: r.request_budget_ms,
            },
            router: r.router,
            faq_top_k: r.faq_top_k,
            faq_min_score: r.faq_min_score,
            skill_index: r.skill_index,
            blocks: r.blocks,
        }
    }
}

impl HarnessConfig {
    /// Parse `harness.json` text; `path` is used in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, HarnessError> {
        let config: HarnessConfig = serde_json::from_str(text).map_err(|e| json_error(path, &e))?;
        let at = || Location::file(path);
        let c = &config.constraints;
        if c.max_reply_chars == 0 {
            return Err(HarnessError::invalid(at(), "`max_reply_chars` must be at least 1"));
        }
        if c.max_loops == 0 {
            return Err(HarnessError::invalid(at(), "`max_loops` must be at least 1"));
        }
        if c.tool_timeout_ms == 0 {
            return Err(HarnessError::invalid(at(), "`tool_timeout_ms` must be at least 1"));
        }
        if c.max_input_chars == 0 {
            return Err(HarnessError::invalid(at(), "`max_input_chars` must be at least 1"));
        }
        for (i, b) in config.blocks.iter().enumerate() {
            if config.blocks[..i].contains(b) {
                return Err(HarnessError::invalid(
                    at(),
                    format!("prompt block `{}` is listed twice in `blocks`", b.name()),
                ));
            }
        }
        if !config.router.min_score.is_finite() || !config.faq_min_score.is_finite() {
            return Err(HarnessError::invalid(at(), "scores must be finite numbers"));
        }
        Ok(config)
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
}
