//! The replay case file: one JSON object per line (schema: `bench/data/README.md`).

use std::path::{Path, PathBuf};

use nextn_agent::agent::AgentRequest;
use nextn_harness::RoomFile;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One viewer comment with its context and what a good answer looks like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    pub id: String,
    pub category: String,
    pub comment: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Turn>,
    /// A `--room` file's content: `{"room": {...}, "products": [...]}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<Value>,
    pub expect: Expect,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    En,
    Zh,
}

impl Language {
    pub fn as_str(self) -> &'static str {
        match self {
            Language::En => "en",
            Language::Zh => "zh",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Expect {
    /// Tools the agent must call, each with the key arguments it must pass.
    #[serde(default)]
    pub tools: Vec<ExpectedTool>,
    /// The calls must happen in the listed order.
    #[serde(default)]
    pub tool_order: bool,
    /// Strings or numbers the reply must contain (numbers matched by value).
    #[serde(default)]
    pub facts: Vec<Value>,
    /// Figures the reply must not contain.
    #[serde(default)]
    pub forbidden_figures: Vec<Value>,
    pub language: Language,
    /// The right answer calls no tool at all.
    #[serde(default)]
    pub no_tool: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpectedTool {
    pub name: String,
    /// Key arguments: a value, or a list of accepted values (e.g. a product id or its name).
    #[serde(default)]
    pub args: Map<String, Value>,
}

#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {message}")]
    Parse { path: PathBuf, line: usize, message: String },
    #[error("{path}: no cases")]
    Empty { path: PathBuf },
}

/// Every case of a JSON-lines file (blank lines skipped); ids must be unique.
pub fn load_cases(path: &Path) -> Result<Vec<Case>, CaseError> {
    let text = std::fs::read_to_string(path).map_err(|source| CaseError::Io { path: path.into(), source })?;
    parse_cases(&text, path)
}

/// [`load_cases`] over text already read (`path` only names it in errors).
pub fn parse_cases(text: &str, path: &Path) -> Result<Vec<Case>, CaseError> {
    let mut cases: Vec<Case> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |message: String| CaseError::Parse { path: path.into(), line: i + 1, message };
        let case: Case = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        if let Some(room) = &case.room {
            serde_json::from_value::<RoomFile>(room.clone()).map_err(|e| err(format!("case {}: room: {e}", case.id)))?;
        }
        if cases.iter().any(|c| c.id == case.id) {
            return Err(err(format!("duplicate case id `{}`", case.id)));
        }
        cases.push(case);
    }
    if cases.is_empty() {
        return Err(CaseError::Empty { path: path.into() });
    }
    Ok(cases)
}

impl Case {
    /// The agent's input for this case (the room was validated at load).
    pub fn request(&self) -> AgentRequest {
        let room: RoomFile = self.room.clone().and_then(|r| serde_json::from_value(r).ok()).unwrap_or_default();
        AgentRequest {
            comment: self.comment.clone(),
            history: self.history.iter().map(|t| (t.role.clone(), t.content.clone())).collect(),
            room: room.room,
            products: room.products,
            received: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_case_file_parses_with_unique_ids_and_enough_cases() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/live_cases.jsonl");
        let cases = load_cases(&path).unwrap();
        assert!(cases.len() >= 110, "{} cases", cases.len());
        for c in &cases {
            assert!(c.expect.facts.iter().all(|f| f.as_str() != Some("FLASH100")), "{} expects FLASH100", c.id);
        }
    }

    #[test]
    fn duplicate_ids_and_bad_rooms_are_refused_with_the_line() {
        let line = r#"{"id":"a","category":"greeting","comment":"hi","expect":{"language":"en","no_tool":true}}"#;
        let err = parse_cases(&format!("{line}\n{line}\n"), Path::new("x.jsonl")).unwrap_err();
        assert!(err.to_string().contains("x.jsonl:2"), "{err}");
        let bad = r#"{"id":"b","category":"c","comment":"hi","room":{"products":3},"expect":{"language":"en"}}"#;
        assert!(parse_cases(bad, Path::new("y")).unwrap_err().to_string().contains("room"));
    }
}
