//! The tool registry: tools discovered from MCP servers (`tools/list`), with the harness's renames, aliases,
//! description and schema overrides from `tools.json`, mapped from the model-facing name to
//! `(server, real name)` and rendered for the chat template.
//!
//! `tools.json`:
//! ```json
//! {"tools": {
//!   "list_promotions": {"aliases": ["get_coupons"], "description": "Promotions and coupons running now."},
//!   "commerce/room_status": {"rename": "live_room_status"},
//!   "debug_dump": {"hidden": true}
//! }}
//! ```
//! Keys are a tool's real name, or `server/name` to target one server; `server/name` wins over `name`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::error::{HarnessError, Location, json_error};
use crate::schema;

/// A tool as an MCP server lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub server: String,
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "empty_object_schema", alias = "inputSchema")]
    pub input_schema: Value,
}

fn empty_object_schema() -> Value {
    json!({"type": "object", "properties": {}})
}

/// One entry of `tools.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolOverride {
    /// The name the model sees instead of the real name.
    pub rename: Option<String>,
    /// More names the model may call the tool by (accepted, not shown).
    pub aliases: Vec<String>,
    /// Replaces the server's description.
    pub description: Option<String>,
    /// Replaces the server's input schema.
    pub input_schema: Option<Value>,
    /// Neither shown nor callable.
    pub hidden: bool,
}

/// `tools.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ToolsConfig {
    pub tools: Map<String, Value>,
}

impl ToolsConfig {
    /// Parse `tools.json` text, checking every entry and override schema; `path` is used in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, HarnessError> {
        let config = Self::parse_unchecked(path, text)?;
        match config.problems().into_iter().next() {
            Some(p) => Err(HarnessError::invalid(Location::file(path), p)),
            None => Ok(config),
        }
    }

    /// Parse without checking the entries (see `problems`).
    pub fn parse_unchecked(path: &Path, text: &str) -> Result<Self, HarnessError> {
        serde_json::from_str(text).map_err(|e| json_error(path, &e))
    }

    /// Every problem with the entries: unknown fields, malformed override schemas, a name declared twice.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for key in self.tools.keys() {
            match self.entry(key) {
                Err(m) => problems.push(m),
                Ok(o) => {
                    if let Some(s) = &o.input_schema {
                        problems.extend(
                            schema::check_schema(s).into_iter().map(|p| format!("tools.{key}.input_schema: {p}")),
                        );
                    }
                }
            }
        }
        let mut seen: Vec<(String, String)> = Vec::new();
        for (key, o) in self.entries() {
            for name in o.rename.iter().chain(&o.aliases) {
                if let Some((_, other)) = seen.iter().find(|(n, _)| n == name) {
                    problems.push(format!("tool name `{name}` is declared by both `{other}` and `{key}`"));
                }
                seen.push((name.clone(), key.clone()));
            }
        }
        problems
    }

    /// The typed override under `key`.
    pub fn entry(&self, key: &str) -> Result<ToolOverride, String> {
        let raw = self.tools.get(key).ok_or_else(|| format!("no entry `{key}`"))?;
        serde_json::from_value(raw.clone()).map_err(|e| format!("tools.{key}: {e}"))
    }

    /// Every override, keyed as written.
    pub fn entries(&self) -> Vec<(String, ToolOverride)> {
        self.tools.keys().filter_map(|k| self.entry(k).ok().map(|o| (k.clone(), o))).collect()
    }

    fn find(&self, spec: &ToolSpec) -> ToolOverride {
        let full = format!("{}/{}", spec.server, spec.name);
        self.entry(&full).or_else(|_| self.entry(&spec.name)).unwrap_or_default()
    }
}

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegisteredTool {
    /// The model-facing name.
    pub name: String,
    pub aliases: Vec<String>,
    pub server: String,
    /// The name to send in `tools/call`.
    pub real_name: String,
    pub description: String,
    pub input_schema: Value,
}

impl RegisteredTool {
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub fn openai(&self) -> Value {
        json!({
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema}
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ToolRegistry {
    tools: Vec<RegisteredTool>,
}

impl ToolRegistry {
    /// Apply `config` to the discovered `specs`. Tools are sorted by model-facing name so the rendered list is
    /// stable whatever order servers answer in. Two tools (or aliases) under one name are an error.
    pub fn build(specs: Vec<ToolSpec>, config: &ToolsConfig) -> Result<Self, HarnessError> {
        let mut tools: Vec<RegisteredTool> = Vec::new();
        for spec in specs {
            let o = config.find(&spec);
            if o.hidden {
                continue;
            }
            let name = o.rename.clone().unwrap_or_else(|| spec.name.clone());
            let tool = RegisteredTool {
                name,
                aliases: o.aliases.clone(),
                description: o.description.clone().unwrap_or(spec.description),
                input_schema: o.input_schema.clone().unwrap_or(spec.input_schema),
                server: spec.server,
                real_name: spec.name,
            };
            for new in std::iter::once(&tool.name).chain(&tool.aliases) {
                if let Some(old) = tools.iter().find(|t| &t.name == new || t.aliases.contains(new)) {
                    return Err(HarnessError::DuplicateTool {
                        name: new.clone(),
                        first: format!("{}/{}", old.server, old.real_name),
                        second: format!("{}/{}", tool.server, tool.real_name),
                    });
                }
            }
            tools.push(tool);
        }
        tools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(ToolRegistry { tools })
    }

    pub fn tools(&self) -> &[RegisteredTool] {
        &self.tools
    }

    /// The model-facing names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.tools.iter().map(|t| t.name.as_str()).collect()
    }

    /// The tool the model means by `name` (its model-facing name or an alias).
    pub fn resolve(&self, name: &str) -> Option<&RegisteredTool> {
        self.tools
            .iter()
            .find(|t| t.name == name)
            .or_else(|| self.tools.iter().find(|t| t.aliases.iter().any(|a| a == name)))
    }

    /// The tool list for the chat template (OpenAI-style function tools).
    pub fn openai_tools(&self) -> Vec<Value> {
        self.tools.iter().map(RegisteredTool::openai).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(server: &str, name: &str) -> ToolSpec {
        ToolSpec {
            server: server.into(),
            name: name.into(),
            description: format!("{name} desc"),
            input_schema: empty_object_schema(),
        }
    }

    fn config(text: &str) -> ToolsConfig {
        ToolsConfig::parse(Path::new("tools.json"), text).unwrap()
    }

    #[test]
    fn registry_maps_renames_and_aliases_to_server_and_real_name() {
        let c = config(
            r#"{"tools": {"list_promotions": {"aliases": ["get_coupons"], "description": "Deals now."},
                          "shop/room_status": {"rename": "live_room"}, "debug": {"hidden": true}}}"#,
        );
        let specs = vec![
            spec("shop", "room_status"),
            spec("shop", "list_promotions"),
            spec("shop", "debug"),
            spec("shop", "check_stock"),
        ];
        let r = ToolRegistry::build(specs, &c).unwrap();
        assert_eq!(r.names(), vec!["check_stock", "list_promotions", "live_room"]);
        let t = r.resolve("get_coupons").unwrap();
        assert_eq!(
            (t.server.as_str(), t.real_name.as_str(), t.description.as_str()),
            ("shop", "list_promotions", "Deals now.")
        );
        assert_eq!(r.resolve("live_room").unwrap().real_name, "room_status");
        assert!(r.resolve("room_status").is_none(), "a renamed tool is called by its new name");
        assert!(r.resolve("debug").is_none(), "hidden tools are not callable");
        let rendered = r.openai_tools();
        assert_eq!(rendered[1]["function"]["name"], "list_promotions");
        assert_eq!(rendered[1]["type"], "function");
        assert_eq!(rendered[1]["function"]["parameters"]["type"], "object");
    }

    #[test]
    fn same_name_from_two_servers_is_an_error_until_renamed() {
        let specs = vec![spec("a", "search_products"), spec("b", "search_products")];
        let e = ToolRegistry::build(specs.clone(), &ToolsConfig::default()).unwrap_err();
        assert!(e.to_string().contains("a/search_products and b/search_products"), "{e}");
        let c = config(r#"{"tools": {"b/search_products": {"rename": "search_catalog"}}}"#);
        assert_eq!(ToolRegistry::build(specs, &c).unwrap().names(), vec!["search_catalog", "search_products"]);
    }

    #[test]
    fn tools_json_rejects_bad_entries_and_schemas() {
        let p = Path::new("tools.json");
        assert!(
            ToolsConfig::parse(p, r#"{"tools": {"x": {"renam": "y"}}}"#).unwrap_err().to_string().contains("renam")
        );
        let e = ToolsConfig::parse(p, r#"{"tools": {"x": {"input_schema": {"type": "objekt"}}}}"#).unwrap_err();
        assert!(e.to_string().contains("input_schema"), "{e}");
        let e = ToolsConfig::parse(p, r#"{"tools": {"x": {"aliases": ["z"]}, "y": {"rename": "z"}}}"#).unwrap_err();
        assert!(e.to_string().contains("`z`"), "{e}");
    }
}
