//! `nextn harness check DIR`: every problem in a harness directory, not just the first, as errors (the harness
//! will not load or will misbehave) and warnings (it loads, but something looks unintended).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::HarnessConfig;
use crate::error::{HarnessError, Location};
use crate::faq::parse_faq;
use crate::harness::{FAQ_JSONL, HARNESS_JSON, HOOKS_JSON, RULES_MD, TOOLS_JSON, duplicate_rule_ids};
use crate::hooks::{HooksConfig, missing_command_message, resolve_command};
use crate::skill::{self, Skill, parse_rules, parse_skill};
use crate::tools::ToolsConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    /// Relative to the harness directory.
    pub file: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(f, "{sev}: {}: {}", Location { file: self.file.clone(), line: self.line }, self.message)
    }
}

impl Finding {
    /// Where the finding is (`file` or `file:line`).
    pub fn location(&self) -> Location {
        Location { file: self.file.clone(), line: self.line }
    }
    pub(crate) fn at(severity: Severity, at: Location, message: impl Into<String>) -> Self {
        Finding { severity, file: at.file, line: at.line, message: message.into() }
    }
    fn from_error(e: &HarnessError, fallback: &str) -> Self {
        let at = e.location().unwrap_or_else(|| Location::file(fallback));
        Finding::at(Severity::Error, at, e.message())
    }
}

/// Whether any finding is an error.
pub fn has_errors(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.severity == Severity::Error)
}

/// Check a harness directory. Findings are sorted errors first, then by file and line.
pub fn check(dir: impl AsRef<Path>) -> Vec<Finding> {
    let dir = dir.as_ref();
    let mut out = Vec::new();
    if !dir.is_dir() {
        out.push(Finding::at(Severity::Error, Location::file(dir), "not a directory"));
        return out;
    }
    let read = |name: &str| std::fs::read_to_string(dir.join(name));
    let err = |at: Location, m: String| Finding::at(Severity::Error, at, m);
    let warn = |at: Location, m: String| Finding::at(Severity::Warning, at, m);

    // harness.json
    let config = match read(HARNESS_JSON) {
        Err(e) => {
            out.push(err(Location::file(HARNESS_JSON), format!("cannot read: {e} (the harness needs it)")));
            None
        }
        Ok(text) => match HarnessConfig::parse_unchecked(Path::new(HARNESS_JSON), &text) {
            Ok(c) => {
                out.extend(c.problems(Path::new(HARNESS_JSON)).iter().map(|e| Finding::from_error(e, HARNESS_JSON)));
                Some(c)
            }
            Err(e) => {
                out.push(Finding::from_error(&e, HARNESS_JSON));
                None
            }
        },
    };
    if let Some(c) = &config
        && c.role.trim().is_empty()
    {
        out.push(warn(Location::file(HARNESS_JSON), "`role` is empty; the prompt will not say who the host is".into()));
    }

    // rules.md
    let rules = match read(RULES_MD) {
        Ok(text) => {
            let rules = parse_rules(&text, 1);
            if rules.is_empty() {
                out.push(warn(Location::file(RULES_MD), "no rules with ids (`- [B1] ...`) found".into()));
            }
            rules
        }
        Err(_) => {
            out.push(warn(Location::file(RULES_MD), "missing: the prompt will have no boundary rules".into()));
            Vec::new()
        }
    };

    // skills
    let mut skills: Vec<Skill> = Vec::new();
    match skill::skill_files(dir) {
        Err(e) => out.push(Finding::from_error(&e, "skills")),
        Ok(files) => {
            if let Ok(entries) = std::fs::read_dir(dir.join("skills")) {
                for entry in entries.flatten() {
                    if entry.path().is_dir() && !entry.path().join("SKILL.md").is_file() {
                        let rel = Path::new("skills").join(entry.file_name());
                        out.push(warn(Location::file(rel), "skill folder without a SKILL.md; it is ignored".into()));
                    }
                }
            }
            if files.is_empty() {
                out.push(warn(Location::file("skills"), "no skills (`skills/<name>/SKILL.md`)".into()));
            }
            for rel in files {
                let text = match std::fs::read_to_string(dir.join(&rel)) {
                    Ok(t) => t,
                    Err(e) => {
                        out.push(err(Location::file(&rel), format!("cannot read: {e}")));
                        continue;
                    }
                };
                match parse_skill(&rel, &text) {
                    Err(e) => out.push(Finding::from_error(&e, &rel.to_string_lossy())),
                    Ok(s) => {
                        let folder = rel.parent().and_then(Path::file_name).map(|f| f.to_string_lossy().into_owned());
                        if folder.as_deref() != Some(s.name.as_str()) {
                            out.push(warn(
                                Location::line(&rel, 2),
                                format!(
                                    "skill `{}` lives in folder `{}`; name them alike",
                                    s.name,
                                    folder.unwrap_or_default()
                                ),
                            ));
                        }
                        if s.rules.is_empty() {
                            out.push(warn(Location::file(&rel), "no reply rules with ids (`- [R1] ...`)".into()));
                        }
                        if let Some(other) = skills.iter().find(|o| o.name == s.name) {
                            out.push(err(
                                Location::line(&rel, 2),
                                format!("skill name `{}` is already used by {}", s.name, other.path.display()),
                            ));
                        }
                        skills.push(s);
                    }
                }
            }
        }
    }
    for (id, first, second) in duplicate_rule_ids(&rules, &skills) {
        out.push(err(second, format!("rule id `{id}` is already used at {first}")));
    }
    if let Some(c) = &config {
        for name in &c.router.always {
            if !skills.iter().any(|s| &s.name == name) {
                out.push(err(Location::file(HARNESS_JSON), format!("router.always names unknown skill `{name}`")));
            }
        }
    }

    // faq.jsonl: every line, not just the first bad one.
    match read(FAQ_JSONL) {
        Err(_) => out.push(warn(Location::file(FAQ_JSONL), "missing: no FAQ will be retrieved".into())),
        Ok(text) => {
            let mut questions: Vec<(String, usize)> = Vec::new();
            let mut n = 0;
            for (i, line) in text.lines().enumerate() {
                match parse_faq(Path::new(FAQ_JSONL), line) {
                    Err(e) => out.push(err(Location::line(FAQ_JSONL, i + 1), e.message())),
                    Ok(entries) => {
                        for e in entries {
                            n += 1;
                            let q = e.q.trim().to_lowercase();
                            if let Some((_, first)) = questions.iter().find(|(k, _)| *k == q) {
                                out.push(warn(
                                    Location::line(FAQ_JSONL, i + 1),
                                    format!("same question as line {first}"),
                                ));
                            }
                            questions.push((q, i + 1));
                        }
                    }
                }
            }
            if n == 0 {
                out.push(warn(Location::file(FAQ_JSONL), "no entries".into()));
            }
        }
    }

    // hooks.json
    if let Ok(text) = read(HOOKS_JSON) {
        match HooksConfig::parse(Path::new(HOOKS_JSON), &text) {
            Err(e) => out.push(Finding::from_error(&e, HOOKS_JSON)),
            Ok(h) => {
                let mut names: Vec<&str> = Vec::new();
                for ext in &h.external {
                    let at = Location::line(HOOKS_JSON, line_of(&text, &format!("\"{}\"", ext.name)));
                    if resolve_command(&ext.command, dir).is_none() {
                        let m = missing_command_message(ext);
                        if ext.optional {
                            out.push(warn(at.clone(), format!("{m}; the hook is optional and will be left out")));
                        } else {
                            out.push(err(at.clone(), m));
                        }
                    }
                    if ext.timeout_ms == 0 {
                        out.push(err(at.clone(), format!("hook `{}`: `timeout_ms` must be at least 1", ext.name)));
                    }
                    if let Some(c) = &config
                        && ext.retry_budget >= c.constraints.max_loops
                    {
                        out.push(warn(
                            at.clone(),
                            format!(
                                "hook `{}`: retry_budget {} is not below max_loops {}",
                                ext.name, ext.retry_budget, c.constraints.max_loops
                            ),
                        ));
                    }
                    let builtin = h.builtins.hooks(&Default::default()).iter().any(|b| b.name == ext.name);
                    if names.contains(&ext.name.as_str()) || builtin {
                        out.push(err(at, format!("hook name `{}` is used twice", ext.name)));
                    }
                    names.push(&ext.name);
                }
            }
        }
    }

    // tools.json
    if let Ok(text) = read(TOOLS_JSON) {
        match ToolsConfig::parse_unchecked(Path::new(TOOLS_JSON), &text) {
            Err(e) => out.push(Finding::from_error(&e, TOOLS_JSON)),
            Ok(t) => {
                for p in t.problems() {
                    let key = p.strip_prefix("tools.").and_then(|r| r.split(['.', ':']).next()).unwrap_or("");
                    let line = if key.is_empty() { 1 } else { line_of(&text, &format!("\"{key}\"")) };
                    out.push(err(Location::line(TOOLS_JSON, line), p));
                }
            }
        }
    }

    out.sort_by(|a, b| (a.severity, &a.file, a.line).cmp(&(b.severity, &b.file, b.line)));
    out
}

/// The 1-based line of the first occurrence of `needle` in `text` (1 when absent).
fn line_of(text: &str, needle: &str) -> usize {
    text.find(needle).map_or(1, |i| text[..i].matches('\n').count() + 1)
}
