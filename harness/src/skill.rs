//! Skills: `skills/<name>/SKILL.md` files (front matter + a body of reply rules, tool-choice guidance and
//! examples), and the deterministic router that picks the skills whose bodies enter a request's prompt.
//!
//! Router: BM25 of the comment (plus, at a lower weight, the previous viewer turn) against each skill's name,
//! description and `triggers`; the top `top_n` skills scoring at least `min_score` are selected, plus any
//! `always` skills. The model (or the agent) may override the choice with an explicit list of names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Location};
use crate::frontmatter::{self, YamlValue};
use crate::text::{self, Bm25};

/// A reply rule with a stable id, written in a body as a list item `- [R1] text`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    pub id: String,
    pub text: String,
    /// 1-based line in the file the rule was read from.
    pub line: usize,
}

/// Rules `- [ID] text` (or `* [ID] text`) found in `text`, whose first line is file line `first_line`.
pub fn parse_rules(text: &str, first_line: usize) -> Vec<Rule> {
    text.lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let rest = line.trim_start().strip_prefix(['-', '*'])?.trim_start().strip_prefix('[')?;
            let close = rest.find(']')?;
            let id = &rest[..close];
            let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            valid.then(|| Rule { id: id.to_string(), text: rest[close + 1..].trim().to_string(), line: first_line + i })
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skill {
    pub name: String,
    pub description: String,
    pub version: String,
    /// Extra routing words: `triggers` at the top level or under `metadata`.
    pub triggers: Vec<String>,
    /// Every other front-matter field (e.g. `metadata`), as read.
    pub metadata: BTreeMap<String, YamlValue>,
    /// The Markdown after the front matter, trimmed; what enters the prompt when the skill is selected.
    pub body: String,
    pub rules: Vec<Rule>,
    /// The `SKILL.md` path, relative to the harness directory.
    pub path: PathBuf,
}

/// Parse one `SKILL.md`. `path` is used in errors (pass it relative to the harness directory).
pub fn parse_skill(path: &Path, text: &str) -> Result<Skill, HarnessError> {
    let fm = frontmatter::parse(text)
        .map_err(|e| HarnessError::parse(Location::line(path, e.line), format!("front matter: {}", e.message)))?;
    let required = |key: &str| -> Result<String, HarnessError> {
        let field = fm.get(key).ok_or_else(|| {
            HarnessError::invalid(
                Location::line(path, 1),
                format!("front matter is missing the required field `{key}`"),
            )
        })?;
        match field.value.as_str() {
            Some(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
            _ => Err(HarnessError::invalid(
                Location::line(path, field.line),
                format!("`{key}` must be a non-empty string"),
            )),
        }
    };
    let name = required("name")?;
    let description = required("description")?;
    let version = required("version")?;
    if !name.chars().all(|c| c.is_alphanumeric() || c == '-' || c == '_') {
        let line = fm.get("name").map_or(1, |f| f.line);
        return Err(HarnessError::invalid(
            Location::line(path, line),
            format!("skill name `{name}` may hold only letters, digits, `-` and `_`"),
        ));
    }
    let mut triggers = Vec::new();
    let mut metadata = BTreeMap::new();
    for field in &fm.fields {
        match field.key.as_str() {
            "name" | "description" | "version" => {}
            "triggers" => triggers.extend(field.value.as_list().unwrap_or_default()),
            _ => {
                if let Some(t) = field.value.get("triggers") {
                    let Some(list) = t.as_list() else {
                        return Err(HarnessError::invalid(
                            Location::line(path, field.line),
                            "`triggers` must be a list",
                        ));
                    };
                    triggers.extend(list);
                }
                metadata.insert(field.key.clone(), field.value.clone());
            }
        }
    }
    // Line numbers of rules count from the body's first line; the trimmed prefix is only blank lines.
    let leading_blank = fm.body.lines().take_while(|l| l.trim().is_empty()).count();
    let body = fm.body.trim().to_string();
    let rules = parse_rules(&body, fm.body_line + leading_blank);
    Ok(Skill { name, description, version, triggers, metadata, body, rules, path: path.to_path_buf() })
}

/// Every `skills/*/SKILL.md` path under `dir` (relative to `dir`), sorted. A missing `skills/` is no skills.
pub fn skill_files(dir: &Path) -> Result<Vec<PathBuf>, HarnessError> {
    let skills_dir = dir.join("skills");
    if !skills_dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&skills_dir).map_err(|e| HarnessError::io(&skills_dir, e))? {
        let entry = entry.map_err(|e| HarnessError::io(&skills_dir, e))?;
        if entry.path().is_dir() {
            let rel = Path::new("skills").join(entry.file_name()).join("SKILL.md");
            if dir.join(&rel).is_file() {
                out.push(rel);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Load every skill under `dir/skills/`, sorted by name; duplicate names are an error.
pub fn load_skills(dir: &Path) -> Result<Vec<Skill>, HarnessError> {
    let mut skills: Vec<Skill> = Vec::new();
    for rel in skill_files(dir)? {
        let text = std::fs::read_to_string(dir.join(&rel)).map_err(|e| HarnessError::io(dir.join(&rel), e))?;
        let skill = parse_skill(&rel, &text)?;
        if let Some(other) = skills.iter().find(|s| s.name == skill.name) {
            return Err(HarnessError::invalid(
                Location::line(&rel, 2),
                format!("skill name `{}` is already used by {}", skill.name, other.path.display()),
            ));
        }
        skills.push(skill);
    }
    skills.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(skills)
}

/// Router settings (`router` in `harness.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// At most this many skills are selected by score.
    pub top_n: usize,
    /// A skill needs at least this BM25 score to be selected.
    pub min_score: f32,
    /// Skills always selected (in addition to the scored ones).
    pub always: Vec<String>,
    /// Weight of the previous viewer turn's words relative to the comment's (0 ignores history).
    pub history_weight: f32,
    /// Added to a skill's score for each of its multi-token triggers (`how much`, `尺码`) found verbatim in the
    /// comment, since BM25 sees only the separate words.
    pub phrase_bonus: f32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig { top_n: 2, min_score: 1.0, always: Vec::new(), history_weight: 0.3, phrase_bonus: 1.0 }
    }
}

/// How a selection was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionSource {
    Router,
    Explicit,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SkillScore {
    pub name: String,
    pub score: f32,
}

/// The skills chosen for one request, with every skill's router score (for the trace).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SkillSelection {
    pub selected: Vec<String>,
    pub source: SelectionSource,
    /// All skills with a positive score, best first.
    pub scores: Vec<SkillScore>,
}

#[derive(Debug, Clone)]
pub struct SkillRouter {
    names: Vec<String>,
    /// Per skill, its lowercase multi-token triggers.
    phrases: Vec<Vec<String>>,
    index: Bm25,
    config: RouterConfig,
}

impl SkillRouter {
    pub fn new(skills: &[Skill], config: RouterConfig) -> Self {
        let docs: Vec<String> = skills
            .iter()
            .map(|s| {
                // Triggers twice: they are the skill author's explicit routing words.
                let triggers = s.triggers.join(" ");
                format!("{} {} {triggers} {triggers}", s.name.replace(['-', '_'], " "), s.description)
            })
            .collect();
        let phrases = skills
            .iter()
            .map(|s| {
                s.triggers
                    .iter()
                    .filter(|t| t.trim().contains(char::is_whitespace) || text::tokenize(t).len() > 1)
                    .map(|t| t.to_lowercase())
                    .collect()
            })
            .collect();
        SkillRouter { names: skills.iter().map(|s| s.name.clone()).collect(), phrases, index: Bm25::new(&docs), config }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Select skills for a comment (`previous` = the previous viewer turn, if any), or take `explicit` names.
    pub fn select(
        &self,
        comment: &str,
        previous: Option<&str>,
        explicit: Option<&[String]>,
    ) -> Result<SkillSelection, HarnessError> {
        let lower = comment.to_lowercase();
        let mut q = text::query(comment, 1.0);
        if let Some(prev) = previous.filter(|_| self.config.history_weight > 0.0) {
            for (term, w) in text::query(prev, self.config.history_weight) {
                q.entry(term).or_insert(w);
            }
        }
        let mut scores: Vec<SkillScore> = self
            .index
            .scores(&q)
            .into_iter()
            .zip(&self.phrases)
            .map(|(score, phrases)| {
                score
                    + self.config.phrase_bonus
                        * phrases.iter().filter(|p| text::contains_phrase(&lower, p)).count() as f32
            })
            .zip(&self.names)
            .filter(|(s, _)| *s > 0.0)
            .map(|(score, name)| SkillScore { name: name.clone(), score })
            .collect();
        scores.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.name.cmp(&b.name)));

        if let Some(explicit) = explicit {
            let mut selected = Vec::new();
            for name in explicit {
                if !self.names.contains(name) {
                    return Err(HarnessError::UnknownSkill { name: name.clone(), known: self.names.join(", ") });
                }
                if !selected.contains(name) {
                    selected.push(name.clone());
                }
            }
            return Ok(SkillSelection { selected, source: SelectionSource::Explicit, scores });
        }
        let mut selected: Vec<String> = scores
            .iter()
            .filter(|s| s.score >= self.config.min_score)
            .take(self.config.top_n)
            .map(|s| s.name.clone())
            .collect();
        for name in &self.config.always {
            if !selected.contains(name) && self.names.contains(name) {
                selected.push(name.clone());
            }
        }
        Ok(SkillSelection { selected, source: SelectionSource::Router, scores })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "---\nname: size-and-fit\ndescription: Size and fit questions\nversion: 1.0.0\n\
                        metadata:\n  triggers: [size, tall, 尺码]\n  owner: ops\n---\n\n# Size\n- [SF1] Ask height.\n- [SF2] Never guess.\nnot a rule [X]\n";

    #[test]
    fn skill_with_good_front_matter_loads_with_rules_and_lines() {
        let s = parse_skill(Path::new("skills/size-and-fit/SKILL.md"), GOOD).unwrap();
        assert_eq!(s.name, "size-and-fit");
        assert_eq!(s.version, "1.0.0");
        assert_eq!(s.triggers, vec!["size", "tall", "尺码"]);
        assert!(s.metadata.contains_key("metadata"));
        assert_eq!(s.rules.iter().map(|r| (r.id.as_str(), r.line)).collect::<Vec<_>>(), vec![("SF1", 11), ("SF2", 12)]);
        assert!(s.body.starts_with("# Size"));
    }

    #[test]
    fn missing_required_field_is_an_error_naming_the_file() {
        let text = "---\nname: x\nversion: 1\n---\nbody";
        let e = parse_skill(Path::new("skills/x/SKILL.md"), text).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("skills/x/SKILL.md:1:"), "{msg}");
        assert!(msg.contains("description"), "{msg}");
    }

    #[test]
    fn malformed_front_matter_error_names_file_and_line() {
        let text = "---\nname: x\ndescription: d\nversion 1\n---\nbody";
        let e = parse_skill(Path::new("skills/x/SKILL.md"), text).unwrap_err();
        assert!(e.to_string().starts_with("skills/x/SKILL.md:4:"), "{e}");
        assert_eq!(e.location().unwrap().line, Some(4));
    }

    #[test]
    fn empty_required_field_names_its_line() {
        let text = "---\nname: x\ndescription: \"\"\nversion: 1\n---\n";
        let e = parse_skill(Path::new("s.md"), text).unwrap_err();
        assert_eq!(e.location().unwrap().line, Some(3));
    }
}
