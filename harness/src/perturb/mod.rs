//! Harness-State Augmentation: task-preserving perturbations of a harness directory (`nextn harness perturb`).
//!
//! A variant changes how the harness *looks* to the model — names, wording, order, limits, hook behaviour —
//! but not what a task needs: every real MCP tool stays callable with the same arguments, the rules a case
//! depends on stay, and the result passes [`check`](crate::check()). Five dimensions, one file each:
//!
//! | dimension | file | changes |
//! |---|---|---|
//! | `skill-id` | [`skill_id`] | rename skills, rewrite descriptions, add synthetic and noise skills, mask skills |
//! | `skill-content` | [`skill_content`] | paraphrase, reorder and mask non-essential skill rules |
//! | `tool-def` | [`tool_def`] | rename tools (tools.json `rename`: the registry maps the new name to the real MCP tool), rewrite tool and parameter descriptions, update backticked references |
//! | `prompt` | [`prompt`] | reorder prompt blocks and the items of rules.md / faq.jsonl; move `max_reply_chars`, `max_loops` inside their ranges |
//! | `hook` | [`hook`] | retry budgets, feedback wording and structure, which modifications apply (length truncate ↔ retry, result cut) |
//!
//! **Essential** (never masked or paraphrased, at most reordered): the boundary rules of `rules.md`; a skill
//! rule whose id is listed in the skill's front matter `essential: [ID, ...]` (top level or under `metadata`),
//! or whose text names a tool (a backticked snake_case word), an action marker (`[show_...`) or a figure (any
//! digit); a skill listed in `router.always` or whose front matter says `essential: true`.
//!
//! Every change is recorded in `perturbation.json` ([`Manifest`]): dimension, kind, target, file, before,
//! after. The same input, seed, dimensions and strength give a byte-identical directory: all randomness comes
//! from [`Rng`] seeded per dimension, and files are visited in sorted order.

pub mod hook;
pub mod paraphrase;
pub mod prompt;
pub mod skill_content;
pub mod skill_id;
pub mod tool_def;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::check::{Finding, has_errors};
use crate::error::HarnessError;
use crate::hash::Fnv64;
use crate::tools::ToolSpec;

/// The manifest file written into every variant.
pub const MANIFEST: &str = "perturbation.json";

/// One perturbation dimension of HSA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dimension {
    #[serde(rename = "skill-id")]
    SkillId,
    #[serde(rename = "skill-content")]
    SkillContent,
    #[serde(rename = "tool-def")]
    ToolDef,
    #[serde(rename = "prompt")]
    Prompt,
    #[serde(rename = "hook")]
    Hook,
}

impl Dimension {
    /// Every dimension, in the order they are applied.
    pub const ALL: [Dimension; 5] =
        [Dimension::SkillId, Dimension::SkillContent, Dimension::ToolDef, Dimension::Prompt, Dimension::Hook];

    pub fn name(self) -> &'static str {
        match self {
            Dimension::SkillContent => "skill-content",
            Dimension::SkillId => "skill-id",
            Dimension::ToolDef => "tool-def",
            Dimension::Prompt => "prompt",
            Dimension::Hook => "hook",
        }
    }

    pub fn parse(s: &str) -> Option<Dimension> {
        Dimension::ALL.into_iter().find(|d| d.name() == s.trim())
    }

    /// `skill-id,tool-def` → dimensions in application order, each once.
    pub fn parse_list(s: &str) -> Result<Vec<Dimension>, PerturbError> {
        let mut out = Vec::new();
        for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let d = Dimension::parse(item).ok_or_else(|| PerturbError::UnknownDimension(item.to_string()))?;
            if !out.contains(&d) {
                out.push(d);
            }
        }
        if out.is_empty() {
            return Err(PerturbError::UnknownDimension(s.to_string()));
        }
        out.sort();
        Ok(out)
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What to perturb and how much.
#[derive(Debug, Clone, PartialEq)]
pub struct PerturbOptions {
    pub seed: u64,
    pub dims: Vec<Dimension>,
    /// 0..=1: the share of candidates each dimension touches (each dimension makes at least one change).
    pub strength: f64,
}

impl Default for PerturbOptions {
    fn default() -> Self {
        PerturbOptions { seed: 0, dims: Dimension::ALL.to_vec(), strength: 0.5 }
    }
}

/// Rewrites a description in other words: the model behind `nextn harness perturb --llm URL`. A rewrite is
/// used only when it keeps every protected token of the original (backticked names, `[markers]`, figures)
/// and reads as one short description; otherwise the template paraphrase stands and the manifest says why.
pub trait Rewriter {
    /// What answers (for the manifest), e.g. `openai:http://host:8000/v1#model`.
    fn name(&self) -> String;
    /// `what`: `skill description`, `tool description` or `parameter description`. An error stops the perturbation
    /// (a variant half written by the model and half by the templates would not say what it is).
    fn rewrite(&mut self, what: &str, text: &str) -> Result<String, String>;
}

/// One transformation, as listed in `perturbation.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub dimension: Dimension,
    /// e.g. `rename_tool`, `mask_rule`, `reorder_blocks` (each dimension's module lists its kinds).
    pub kind: String,
    /// What changed: a tool's real name, `skill#RULE`, a skill name, a `harness.json` field, a hook.
    pub target: String,
    /// The file of the variant the change is in (for a removed file: the path it had).
    pub file: String,
    pub before: String,
    pub after: String,
}

/// `perturbation.json`: how a variant was made and every change in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Content hash of the source harness.
    pub source_version: String,
    pub seed: u64,
    pub strength: f64,
    pub dims: Vec<Dimension>,
    /// The model that rewrote descriptions (`--llm`); absent for template paraphrases only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewriter: Option<String>,
    pub changes: Vec<Change>,
}

impl Manifest {
    /// Changes per dimension, for a one-line summary.
    pub fn counts(&self) -> BTreeMap<Dimension, usize> {
        let mut out = BTreeMap::new();
        for c in &self.changes {
            *out.entry(c.dimension).or_insert(0) += 1;
        }
        out
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PerturbError {
    /// The source does not load: fix it first (`nextn harness check`).
    // Not a `#[source]`: the message already holds it, and `{:#}` would print it twice.
    #[error("source harness: {0}")]
    Source(HarnessError),
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("--out {0} already exists and is not empty; pick a new directory or remove it")]
    OutNotEmpty(PathBuf),
    #[error("--out {0} is the source directory itself")]
    OutIsSource(PathBuf),
    #[error("unknown dimension `{0}`; the dimensions are skill-id, skill-content, tool-def, prompt, hook")]
    UnknownDimension(String),
    #[error("--strength {0} is outside 0..=1")]
    Strength(f64),
    #[error("{file}: {message}")]
    Input { file: String, message: String },
    #[error("rewriting a {what} with {rewriter}: {message}")]
    Rewriter { rewriter: String, what: String, message: String },
    /// A defect of the perturbation itself: the variant fails `check` (every error listed).
    #[error("the variant fails check (a perturb defect, please report):\n{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    VariantRejected(Vec<Finding>),
}

impl From<HarnessError> for PerturbError {
    fn from(e: HarnessError) -> Self {
        PerturbError::Source(e)
    }
}

fn io(path: &Path, error: std::io::Error) -> PerturbError {
    PerturbError::Io { path: path.to_path_buf(), error }
}

/// splitmix64: small, fast, and the same sequence on every platform (no dependency whose algorithm may move).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The generator of one dimension: independent streams, so a one-dimension variant makes the same changes
    /// in that dimension as a variant with every dimension (same seed).
    pub fn for_dimension(seed: u64, dim: Dimension) -> Self {
        let mut h = Fnv64::new();
        h.update(&seed.to_le_bytes()).update(dim.name().as_bytes());
        Rng(h.finish())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }

    /// A permutation of `items` that differs from the input whenever two items differ.
    pub fn shuffle_changed<T: PartialEq + Clone>(&mut self, items: &mut [T]) {
        let before = items.to_vec();
        for _ in 0..8 {
            self.shuffle(items);
            if items != before.as_slice() {
                return;
            }
        }
        if items.len() > 1 {
            items.rotate_left(1);
        }
    }
}

/// The harness directory in memory: relative path → bytes. Dimensions edit this; it is written once at the end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tree {
    pub files: BTreeMap<String, Vec<u8>>,
}

impl Tree {
    pub fn read(dir: &Path) -> Result<Tree, PerturbError> {
        let mut files = BTreeMap::new();
        for rel in crate::harness::harness_files(dir)? {
            if rel == MANIFEST {
                continue; // a variant of a variant gets a fresh manifest
            }
            let path = dir.join(&rel);
            files.insert(rel, std::fs::read(&path).map_err(|e| io(&path, e))?);
        }
        Ok(Tree { files })
    }

    /// The file as text (`None` when absent); a file that is not UTF-8 is an input error naming it.
    pub fn text(&self, rel: &str) -> Result<Option<String>, PerturbError> {
        match self.files.get(rel) {
            None => Ok(None),
            Some(bytes) => String::from_utf8(bytes.clone())
                .map(Some)
                .map_err(|_| PerturbError::Input { file: rel.into(), message: "not UTF-8 text".into() }),
        }
    }

    pub fn set_text(&mut self, rel: &str, text: String) {
        self.files.insert(rel.to_string(), text.into_bytes());
    }

    /// Paths of every `skills/<name>/SKILL.md`, sorted.
    pub fn skill_files(&self) -> Vec<String> {
        self.files
            .keys()
            .filter(|k| k.starts_with("skills/") && k.ends_with("/SKILL.md") && k.matches('/').count() == 2)
            .cloned()
            .collect()
    }

    /// Move every file under `from/` to `to/`.
    pub fn move_dir(&mut self, from: &str, to: &str) {
        let moved: Vec<String> = self.files.keys().filter(|k| k.starts_with(&format!("{from}/"))).cloned().collect();
        for k in moved {
            let bytes = self.files.remove(&k).unwrap_or_default();
            self.files.insert(format!("{to}{}", &k[from.len()..]), bytes);
        }
    }

    pub fn remove_dir(&mut self, dir: &str) {
        self.files.retain(|k, _| !k.starts_with(&format!("{dir}/")));
    }

    fn write(&self, out: &Path) -> Result<(), PerturbError> {
        for (rel, bytes) in &self.files {
            let path = out.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
            }
            std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
        }
        Ok(())
    }
}

/// What a dimension works with.
pub struct Ctx<'a> {
    pub rng: Rng,
    pub strength: f64,
    pub dim: Dimension,
    /// The tools the MCP servers list (may be empty: then only tools named in tools.json are perturbed).
    pub tools: &'a [ToolSpec],
    pub changes: Vec<Change>,
    /// With `--llm`: rewrites descriptions in place of the template paraphrases.
    pub rewriter: Option<&'a mut (dyn Rewriter + 'static)>,
}

impl Ctx<'_> {
    pub fn record(&mut self, kind: &str, target: &str, file: &str, before: impl Into<String>, after: impl Into<String>) {
        self.changes.push(Change {
            dimension: self.dim,
            kind: kind.into(),
            target: target.into(),
            file: file.into(),
            before: before.into(),
            after: after.into(),
        });
    }

    /// The new text of a description: `template` (the bank's paraphrase of `original`), or with a rewriter its
    /// rewrite of `original` when that keeps every protected token; a refused rewrite is recorded as
    /// `llm_rewrite_rejected` (before: the model's text, after: the template used instead).
    pub fn rewrite(&mut self, what: &str, target: &str, file: &str, original: &str, template: String) -> Result<String, PerturbError> {
        let Some(r) = self.rewriter.as_deref_mut() else { return Ok(template) };
        let text = r.rewrite(what, original).map_err(|message| PerturbError::Rewriter {
            rewriter: r.name(),
            what: what.into(),
            message,
        })?;
        let text = text.trim().trim_matches('"').trim().to_string();
        match paraphrase::acceptable_rewrite(original, &text) {
            Ok(()) => Ok(text),
            Err(why) => {
                self.record("llm_rewrite_rejected", target, file, format!("{text} ({why})"), template.clone());
                Ok(template)
            }
        }
    }

    /// How many of `n` candidates to touch: `strength × share × n`, at least `min` (when there are any).
    pub fn count(&self, n: usize, share: f64, min: usize) -> usize {
        ((self.strength * share * n as f64).round() as usize).max(min).min(n)
    }
}

/// Perturb the harness in `src` into the new directory `out`. `tools`: the servers' tools (for renaming
/// tools that tools.json does not name, and for their parameter schemas). The variant is checked before it is
/// returned; the manifest is written as `out/perturbation.json`.
pub fn perturb(src: &Path, out: &Path, opts: &PerturbOptions, tools: &[ToolSpec]) -> Result<Manifest, PerturbError> {
    perturb_with(src, out, opts, tools, None)
}

/// [`perturb`], descriptions rewritten by `rewriter` where it keeps their protected tokens.
pub fn perturb_with(
    src: &Path,
    out: &Path,
    opts: &PerturbOptions,
    tools: &[ToolSpec],
    rewriter: Option<&mut (dyn Rewriter + 'static)>,
) -> Result<Manifest, PerturbError> {
    let (tree, manifest) = perturb_tree_with(src, opts, tools, rewriter)?;
    if out.exists() {
        let same = std::fs::canonicalize(out).ok() == std::fs::canonicalize(src).ok();
        if same {
            return Err(PerturbError::OutIsSource(out.to_path_buf()));
        }
        let mut entries = std::fs::read_dir(out).map_err(|e| io(out, e))?;
        if entries.next().is_some() {
            return Err(PerturbError::OutNotEmpty(out.to_path_buf()));
        }
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    tree.write(out)?;
    let json = serde_json::to_string_pretty(&manifest).expect("a manifest serializes") + "\n";
    std::fs::write(out.join(MANIFEST), json).map_err(|e| io(&out.join(MANIFEST), e))?;
    let findings = crate::check::check(out);
    if has_errors(&findings) {
        return Err(PerturbError::VariantRejected(
            findings.into_iter().filter(|f| f.severity == crate::check::Severity::Error).collect(),
        ));
    }
    Ok(manifest)
}

/// The variant in memory and its manifest (nothing written).
pub fn perturb_tree(src: &Path, opts: &PerturbOptions, tools: &[ToolSpec]) -> Result<(Tree, Manifest), PerturbError> {
    perturb_tree_with(src, opts, tools, None)
}

/// [`perturb_tree`] with an optional [`Rewriter`].
pub fn perturb_tree_with(
    src: &Path,
    opts: &PerturbOptions,
    tools: &[ToolSpec],
    mut rewriter: Option<&mut (dyn Rewriter + 'static)>,
) -> Result<(Tree, Manifest), PerturbError> {
    let rewriter_name = rewriter.as_ref().map(|r| r.name());
    if !(0.0..=1.0).contains(&opts.strength) {
        return Err(PerturbError::Strength(opts.strength));
    }
    // The source must load: a perturbation of a broken harness would hide what was broken.
    let harness = crate::Harness::load(src)?;
    let mut tree = Tree::read(src)?;
    let mut changes = Vec::new();
    let mut dims = opts.dims.clone();
    dims.sort();
    dims.dedup();
    for &dim in &dims {
        let mut ctx = Ctx {
            rng: Rng::for_dimension(opts.seed, dim),
            strength: opts.strength,
            dim,
            tools,
            changes: Vec::new(),
            rewriter: rewriter.as_deref_mut(),
        };
        match dim {
            Dimension::SkillId => skill_id::apply(&mut tree, &mut ctx)?,
            Dimension::SkillContent => skill_content::apply(&mut tree, &mut ctx)?,
            Dimension::ToolDef => tool_def::apply(&mut tree, &mut ctx)?,
            Dimension::Prompt => prompt::apply(&mut tree, &mut ctx)?,
            Dimension::Hook => hook::apply(&mut tree, &mut ctx)?,
        }
        changes.extend(ctx.changes);
    }
    let manifest = Manifest {
        source_version: harness.version().to_string(),
        seed: opts.seed,
        strength: opts.strength,
        dims,
        rewriter: rewriter_name,
        changes,
    };
    Ok((tree, manifest))
}

/// `text` parsed as JSON, or an input error naming the file.
pub(crate) fn json_of(rel: &str, text: &str) -> Result<serde_json::Value, PerturbError> {
    serde_json::from_str(text).map_err(|e| PerturbError::Input { file: rel.into(), message: format!("invalid JSON: {e}") })
}

/// Pretty JSON with a trailing newline (the form every perturbed JSON file is written in).
pub(crate) fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON values serialize") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_streams_are_reproducible_and_differ_by_seed_and_dimension() {
        let a: Vec<u64> = (0..4).map({
            let mut r = Rng::for_dimension(7, Dimension::Hook);
            move |_| r.next_u64()
        }).collect();
        let mut r = Rng::for_dimension(7, Dimension::Hook);
        assert_eq!(a, (0..4).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert_ne!(Rng::for_dimension(8, Dimension::Hook).next_u64(), a[0]);
        assert_ne!(Rng::for_dimension(7, Dimension::Prompt).next_u64(), a[0]);
    }

    #[test]
    fn shuffle_changed_always_changes_order() {
        let mut r = Rng::new(1);
        for n in 2..6 {
            let orig: Vec<usize> = (0..n).collect();
            for _ in 0..20 {
                let mut v = orig.clone();
                r.shuffle_changed(&mut v);
                assert_ne!(v, orig);
                let mut sorted = v.clone();
                sorted.sort();
                assert_eq!(sorted, orig, "a permutation");
            }
        }
    }

    #[test]
    fn dimension_lists_parse_in_application_order_and_reject_unknown_names() {
        assert_eq!(
            Dimension::parse_list("hook, skill-id,hook").unwrap(),
            vec![Dimension::SkillId, Dimension::Hook]
        );
        let e = Dimension::parse_list("skill-id,tools").unwrap_err();
        assert!(e.to_string().contains("`tools`"), "{e}");
    }
}
