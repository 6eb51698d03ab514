//! The harness state `h = (skills, tools, prompt pipeline, hooks)` loaded from a directory and versioned by a
//! content hash of every file in it.

use std::path::{Path, PathBuf};

use crate::config::{Constraints, HarnessConfig};
use crate::error::{HarnessError, Location};
use crate::faq::Faq;
use crate::hash::Fnv64;
use crate::hooks::{Hooks, HooksConfig};
use crate::skill::{self, Rule, Skill, SkillRouter};
use crate::tools::{ToolRegistry, ToolSpec, ToolsConfig};

pub const HARNESS_JSON: &str = "harness.json";
pub const RULES_MD: &str = "rules.md";
pub const FAQ_JSONL: &str = "faq.jsonl";
pub const HOOKS_JSON: &str = "hooks.json";
pub const TOOLS_JSON: &str = "tools.json";

#[derive(Debug, Clone)]
pub struct Harness {
    dir: PathBuf,
    version: String,
    config: HarnessConfig,
    rules_text: String,
    rules: Vec<Rule>,
    skills: Vec<Skill>,
    router: SkillRouter,
    faq: Faq,
    hooks_config: HooksConfig,
    hooks: Hooks,
    tools_config: ToolsConfig,
}

fn read_optional(dir: &Path, name: &str) -> Result<Option<String>, HarnessError> {
    let path = dir.join(name);
    if !path.exists() {
        return Ok(None);
    }
    std::fs::read_to_string(&path).map(Some).map_err(|e| HarnessError::io(path, e))
}

/// Every file under `dir` (hidden names skipped), as sorted `/`-separated relative paths.
pub fn harness_files(dir: &Path) -> Result<Vec<String>, HarnessError> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), HarnessError> {
        for entry in std::fs::read_dir(dir).map_err(|e| HarnessError::io(dir, e))? {
            let entry = entry.map_err(|e| HarnessError::io(dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.ends_with('~') {
                continue;
            }
            let child = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
            let path = entry.path();
            if path.is_dir() {
                walk(&path, &child, out)?;
            } else if path.is_file() {
                out.push(child);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, "", &mut out)?;
    out.sort();
    Ok(out)
}

/// The content hash of a harness directory: FNV-1a over every file's relative path, length and bytes, in sorted
/// path order; 16 hex digits. Same files → same hash on any machine; any byte changed, added or renamed → a new
/// one.
pub fn content_hash(dir: &Path) -> Result<String, HarnessError> {
    let mut h = Fnv64::new();
    for rel in harness_files(dir)? {
        let path = dir.join(&rel);
        let bytes = std::fs::read(&path).map_err(|e| HarnessError::io(path, e))?;
        h.update(rel.as_bytes()).update(&[0]).update(&(bytes.len() as u64).to_le_bytes()).update(&bytes);
    }
    Ok(h.hex())
}

/// Rule ids used twice across `rules.md` and the skills: (id, first place, second place).
pub(crate) fn duplicate_rule_ids(rules: &[Rule], skills: &[Skill]) -> Vec<(String, Location, Location)> {
    let mut seen: Vec<(&str, Location)> = Vec::new();
    let mut dups = Vec::new();
    let all = rules
        .iter()
        .map(|r| (r, Path::new(RULES_MD)))
        .chain(skills.iter().flat_map(|s| s.rules.iter().map(move |r| (r, s.path.as_path()))));
    for (rule, file) in all {
        let here = Location::line(file, rule.line);
        match seen.iter().find(|(id, _)| *id == rule.id) {
            Some((_, first)) => dups.push((rule.id.clone(), first.clone(), here)),
            None => seen.push((&rule.id, here)),
        }
    }
    dups
}

impl Harness {
    /// Load a harness directory: `harness.json` (required), `rules.md`, `skills/*/SKILL.md`, `faq.jsonl`,
    /// `hooks.json`, `tools.json` (all optional).
    ///
    /// One validation path: the directory first goes through [`check`](crate::check()), and any error it reports
    /// refuses the load ([`HarnessError::Rejected`] lists them all); warnings are logged. The building below
    /// repeats some of those checks only because it needs the parsed values; it cannot accept what `check`
    /// rejects.
    pub fn load(dir: impl AsRef<Path>) -> Result<Harness, HarnessError> {
        let dir = dir.as_ref();
        let findings = crate::check::check(dir);
        let (errors, warnings): (Vec<_>, Vec<_>) =
            findings.into_iter().partition(|f| f.severity == crate::check::Severity::Error);
        for w in &warnings {
            tracing::warn!(dir = %dir.display(), "harness: {w}");
        }
        if !errors.is_empty() {
            return Err(HarnessError::Rejected { errors });
        }
        let config_text =
            std::fs::read_to_string(dir.join(HARNESS_JSON)).map_err(|e| HarnessError::io(dir.join(HARNESS_JSON), e))?;
        let config = HarnessConfig::parse(Path::new(HARNESS_JSON), &config_text)?;
        let rules_text = read_optional(dir, RULES_MD)?.unwrap_or_default();
        let rules = skill::parse_rules(&rules_text, 1);
        let skills = skill::load_skills(dir)?;
        if let Some((id, first, second)) = duplicate_rule_ids(&rules, &skills).into_iter().next() {
            return Err(HarnessError::invalid(second, format!("rule id `{id}` is already used at {first}")));
        }
        for name in &config.router.always {
            if !skills.iter().any(|s| &s.name == name) {
                return Err(HarnessError::invalid(
                    Location::file(HARNESS_JSON),
                    format!("router.always names unknown skill `{name}`"),
                ));
            }
        }
        let router = SkillRouter::new(&skills, config.router.clone());
        let faq = Faq::load(&dir.join(FAQ_JSONL), Path::new(FAQ_JSONL))?;
        let hooks_config = match read_optional(dir, HOOKS_JSON)? {
            Some(text) => HooksConfig::parse(Path::new(HOOKS_JSON), &text)?,
            None => HooksConfig::default(),
        };
        let hooks = Hooks::from_config(&hooks_config, &config.constraints, dir)?;
        let tools_config = match read_optional(dir, TOOLS_JSON)? {
            Some(text) => ToolsConfig::parse(Path::new(TOOLS_JSON), &text)?,
            None => ToolsConfig::default(),
        };
        let version = content_hash(dir)?;
        let (n_skills, n_faq, n_hooks) = (skills.len(), faq.entries().len(), hooks.hooks().len());
        tracing::info!(dir = %dir.display(), %version, n_skills, n_faq, n_hooks, "harness loaded");
        Ok(Harness {
            dir: dir.to_path_buf(),
            version,
            config,
            rules_text,
            rules,
            skills,
            router,
            faq,
            hooks_config,
            hooks,
            tools_config,
        })
    }

    /// The content hash (16 hex digits) printed in every trace.
    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &HarnessConfig {
        &self.config
    }

    pub fn constraints(&self) -> &Constraints {
        &self.config.constraints
    }

    /// `rules.md` as written.
    pub fn rules_text(&self) -> &str {
        &self.rules_text
    }

    /// The boundary rules with ids from `rules.md`.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Skills sorted by name.
    pub fn skills(&self) -> &[Skill] {
        &self.skills
    }

    pub fn skill(&self, name: &str) -> Option<&Skill> {
        self.skills.iter().find(|s| s.name == name)
    }

    pub fn router(&self) -> &SkillRouter {
        &self.router
    }

    pub fn faq(&self) -> &Faq {
        &self.faq
    }

    pub fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    pub fn hooks_config(&self) -> &HooksConfig {
        &self.hooks_config
    }

    pub fn tools_config(&self) -> &ToolsConfig {
        &self.tools_config
    }

    /// Every tool this harness names: backticked snake_case identifiers in `SKILL.md` bodies and the keys of
    /// `tools.json` (see [`crate::references`]). Check them against the servers' tools with
    /// [`check_tool_references`](crate::check_tool_references).
    pub fn tool_references(&self) -> Vec<crate::references::ToolReference> {
        let mut out = Vec::new();
        for s in &self.skills {
            if let Ok(text) = std::fs::read_to_string(self.dir.join(&s.path)) {
                out.extend(crate::references::skill_references(&s.path, &text, &self.tools_config));
            }
        }
        if let Ok(text) = std::fs::read_to_string(self.dir.join(TOOLS_JSON)) {
            out.extend(crate::references::tools_json_references(Path::new(TOOLS_JSON), &text, &self.tools_config));
        }
        out
    }

    /// The registry for the tools the agent discovered, with this harness's renames and overrides.
    pub fn tool_registry(&self, specs: Vec<ToolSpec>) -> Result<ToolRegistry, HarnessError> {
        ToolRegistry::build(specs, &self.tools_config)
    }
}
