//! Tool references: the tools a harness names, so that a skill telling the model to call a tool the MCP servers
//! do not offer is caught when the agent connects (`check` alone cannot know what the servers offer).
//!
//! The rule: in a `SKILL.md` body, any backticked snake_case identifier (lower-case words joined by `_`, at least
//! one `_`, e.g. `` `list_promotions` ``) is a tool reference, so write argument names in skills without
//! backticks ("the product id"). In `tools.json`, every key is one. A reference
//! written as a `tools.json` alias or rename is recorded under the real tool name it stands for.

use std::path::Path;
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;

use crate::check::{Finding, Severity};
use crate::error::Location;
use crate::tools::ToolsConfig;

/// A tool named by the harness, and where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolReference {
    /// The real tool name (an alias or rename from `tools.json` is mapped back to its key).
    pub tool: String,
    pub location: Location,
}

static BACKTICKED_TOOL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`").expect("valid tool-name regex"));

/// The real tool name for `name`: itself, or the `tools.json` key whose alias or rename it is.
fn real_name(name: &str, tools: &ToolsConfig) -> String {
    tools
        .entries()
        .into_iter()
        .find(|(_, o)| o.rename.as_deref() == Some(name) || o.aliases.iter().any(|a| a == name))
        .map_or_else(|| name.to_string(), |(key, _)| key)
}

/// References in one `SKILL.md` (`text` is the whole file; the front matter is skipped).
pub(crate) fn skill_references(path: &Path, text: &str, tools: &ToolsConfig) -> Vec<ToolReference> {
    let mut fences = 0;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if fences < 2 {
            fences += usize::from(line.trim_end() == "---");
            continue;
        }
        for c in BACKTICKED_TOOL.captures_iter(line) {
            out.push(ToolReference { tool: real_name(&c[1], tools), location: Location::line(path, i + 1) });
        }
    }
    out
}

/// One reference per `tools.json` key, at the key's line.
pub(crate) fn tools_json_references(path: &Path, text: &str, tools: &ToolsConfig) -> Vec<ToolReference> {
    tools
        .entries()
        .into_iter()
        .map(|(key, _)| {
            let line = text.find(&format!("\"{key}\"")).map_or(1, |i| text[..i].matches('\n').count() + 1);
            ToolReference { tool: key, location: Location::line(path, line) }
        })
        .collect()
}

/// A warning for every reference that no offered tool matches (`offered`: the real names from the MCP servers'
/// `tools/list`).
pub fn check_tool_references(refs: &[ToolReference], offered: &[String]) -> Vec<Finding> {
    refs.iter()
        .filter(|r| !offered.contains(&r.tool))
        .map(|r| {
            Finding::at(
                Severity::Warning,
                r.location.clone(),
                format!(
                    "tool `{}` is named here but no MCP server offers it (offered: {}); point the text at an \
                     offered tool or remove it",
                    r.tool,
                    offered.join(", ")
                ),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backticked_snake_case_words_in_skill_bodies_are_references() {
        let tools = ToolsConfig::parse(
            Path::new("tools.json"),
            r#"{"tools": {"list_promotions": {"aliases": ["get_promotions"]}}}"#,
        )
        .unwrap();
        let text = "---\nname: x\ndescription: `not_this`\nversion: 1\n---\nCall `get_promotions` or `check_stock`.\n\
                    Not `p007`, `LIVE20` or `Size`.\n";
        let refs = skill_references(Path::new("skills/x/SKILL.md"), text, &tools);
        let got: Vec<(&str, Option<usize>)> = refs.iter().map(|r| (r.tool.as_str(), r.location.line)).collect();
        assert_eq!(got, vec![("list_promotions", Some(6)), ("check_stock", Some(6))]);
        let offered = vec!["list_promotions".to_string()];
        let warnings = check_tool_references(&refs, &offered);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].message.contains("`check_stock`") && warnings[0].severity == Severity::Warning);
        assert_eq!(warnings[0].line, Some(6));
    }
}
