//! `nextn-bench compare A B --cases FILE`: one harness-evolution step measured. Both harness versions answer
//! the same cases through the whole agent (same model, same MCP servers, concurrency 1, temperature 0 by
//! default so the pairing is exact); each case gets a score, and the paired per-category deltas, the cases
//! that improved or regressed, the new regressions and a recommendation come out, tied to both content hashes.
//!
//! Case score: the mean of the checks that apply to it — TC, TCO, RC, language (1/0), no ungrounded figure
//! (1/0), no forbidden figure (1/0). A case *passes* when its score is 1.
//!
//! Recommendation ([`recommend`]), with Δ = mean score(B) − mean score(A), R = new regressions (cases that
//! pass under A and fail under B), F = new fixes (fail under A, pass under B):
//! * **rollback** when Δ < −0.01 or R > F: B is worse, or breaks more than it fixes;
//! * **promote** when R = 0, Δ > 0 or F > 0, and no category's mean drops by more than 0.01: a gain with
//!   nothing broken;
//! * **revise** otherwise: no measurable gain, or gains that come with regressions to inspect first.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use super::cases::Case;
use super::metrics::CaseQuality;
use super::run::{self, LlmTarget, ReplayConfig, RequestRecord, SpecMode};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Tolerance of the rule above: smaller changes of a mean are noise.
pub const TOLERANCE: f64 = 0.01;

pub const RULE: &str = "rollback if the mean case score drops by more than 0.01 or more cases newly fail than newly pass; \
promote if nothing newly fails, the mean rises or some case newly passes, and no category mean drops by more than 0.01; \
revise otherwise";

#[derive(clap::Args, Debug, Clone)]
#[command(after_help = "Case score: the mean of the checks that apply (TC, TCO, RC, language, no ungrounded figure, \
no forbidden figure); a case passes at 1.

Recommendation (Δ = mean score B − A; new regressions: pass under A, fail under B; new fixes: the reverse):
  rollback  Δ < −0.01, or more new regressions than new fixes
  promote   no new regressions, Δ > 0 or some new fix, and no category mean drops by more than 0.01
  revise    otherwise (no measurable gain, or a gain that comes with regressions to inspect)")]
pub struct CompareArgs {
    /// The current harness version.
    pub a: PathBuf,
    /// The candidate harness version.
    pub b: PathBuf,
    /// Case file (JSON lines; see bench/data/README.md).
    #[arg(long, default_value = "bench/data/live_cases.jsonl")]
    pub cases: PathBuf,
    /// `local` (in-process engine on --model) or an OpenAI-compatible base URL.
    #[arg(long, default_value = "local")]
    pub llm: String,
    /// Model name sent to an OpenAI-compatible endpoint.
    #[arg(long, default_value = "default")]
    pub llm_model: String,
    /// Model directory for `--llm local` (default: $NEXTN_MODEL, else the bundled models/nextn-live-tiny).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// MCP servers (default: the nextn-commerce-mcp binary next to this executable); repeatable.
    #[arg(long = "mcp")]
    pub mcp: Vec<String>,
    /// 0 (the default) decodes greedily, so a difference comes from the harness, not from sampling.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Only the first N cases.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// No per-request progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recommendation {
    Promote,
    Revise,
    Rollback,
}

impl Recommendation {
    pub fn as_str(self) -> &'static str {
        match self {
            Recommendation::Promote => "promote",
            Recommendation::Revise => "revise",
            Recommendation::Rollback => "rollback",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub dir: String,
    pub version: String,
    pub mean_score: f64,
    pub passed: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CategoryDelta {
    pub category: String,
    pub n: usize,
    pub a: f64,
    pub b: f64,
    pub delta: f64,
    pub improved: Vec<String>,
    pub regressed: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseDelta {
    pub id: String,
    pub category: String,
    pub a: f64,
    pub b: f64,
    pub reply_a: String,
    pub reply_b: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a: Side,
    pub b: Side,
    pub cases: usize,
    pub delta: f64,
    pub categories: Vec<CategoryDelta>,
    /// Pass under A, fail under B.
    pub new_regressions: Vec<String>,
    /// Fail under A, pass under B.
    pub new_fixes: Vec<String>,
    /// Every case whose score changed.
    pub changed: Vec<CaseDelta>,
    pub recommendation: Recommendation,
    pub rule: &'static str,
}

/// A case's score: the mean of the checks that apply (see the module docs).
pub fn case_score(q: &CaseQuality) -> f64 {
    let checks: Vec<f64> = [q.tc, q.tco, q.rc, q.language_ok.map(|ok| if ok { 1.0 } else { 0.0 })]
        .into_iter()
        .flatten()
        .chain([
            if q.grounding_violations.is_empty() { 1.0 } else { 0.0 },
            if q.forbidden_hits.is_empty() { 1.0 } else { 0.0 },
        ])
        .collect();
    checks.iter().sum::<f64>() / checks.len() as f64
}

fn passes(score: f64) -> bool {
    score >= 1.0 - 1e-9
}

/// The recommendation rule (module docs).
pub fn recommend(delta: f64, new_regressions: usize, new_fixes: usize, worst_category_delta: f64) -> Recommendation {
    if delta < -TOLERANCE || new_regressions > new_fixes {
        Recommendation::Rollback
    } else if new_regressions == 0 && (delta > 0.0 || new_fixes > 0) && worst_category_delta >= -TOLERANCE {
        Recommendation::Promote
    } else {
        Recommendation::Revise
    }
}

/// Pair the two runs' records by case id (cases missing on either side are left out).
pub fn compare(cases: &[Case], a: (&str, &str, &[RequestRecord]), b: (&str, &str, &[RequestRecord])) -> Comparison {
    let score_of = |rs: &[RequestRecord], id: &str| rs.iter().find(|r| r.id == id && !r.warmup).map(|r| (case_score(&r.quality), r.reply.clone()));
    let mut pairs = Vec::new();
    for c in cases {
        if let (Some(x), Some(y)) = (score_of(a.2, &c.id), score_of(b.2, &c.id)) {
            pairs.push((c, x, y));
        }
    }
    let n = pairs.len().max(1) as f64;
    let (mean_a, mean_b) = (pairs.iter().map(|p| p.1.0).sum::<f64>() / n, pairs.iter().map(|p| p.2.0).sum::<f64>() / n);
    let mut by_cat: BTreeMap<String, CategoryDelta> = BTreeMap::new();
    let (mut new_regressions, mut new_fixes, mut changed) = (Vec::new(), Vec::new(), Vec::new());
    for (c, (sa, ra), (sb, rb)) in &pairs {
        let e = by_cat.entry(c.category.clone()).or_insert_with(|| CategoryDelta {
            category: c.category.clone(),
            n: 0,
            a: 0.0,
            b: 0.0,
            delta: 0.0,
            improved: Vec::new(),
            regressed: Vec::new(),
        });
        e.n += 1;
        e.a += sa;
        e.b += sb;
        if sb > sa {
            e.improved.push(c.id.clone());
        } else if sb < sa {
            e.regressed.push(c.id.clone());
        }
        match (passes(*sa), passes(*sb)) {
            (true, false) => new_regressions.push(c.id.clone()),
            (false, true) => new_fixes.push(c.id.clone()),
            _ => {}
        }
        if sa != sb {
            changed.push(CaseDelta { id: c.id.clone(), category: c.category.clone(), a: *sa, b: *sb, reply_a: ra.clone(), reply_b: rb.clone() });
        }
    }
    let categories: Vec<CategoryDelta> = by_cat
        .into_values()
        .map(|mut d| {
            d.a /= d.n as f64;
            d.b /= d.n as f64;
            d.delta = d.b - d.a;
            d
        })
        .collect();
    let worst = categories.iter().map(|c| c.delta).fold(0.0, f64::min);
    let delta = mean_b - mean_a;
    let side = |(dir, version, rs): (&str, &str, &[RequestRecord]), mean: f64| Side {
        dir: dir.into(),
        version: version.into(),
        mean_score: mean,
        passed: pairs.iter().filter(|p| rs.iter().any(|r| r.id == p.0.id && passes(case_score(&r.quality)))).count(),
    };
    Comparison {
        a: side(a, mean_a),
        b: side(b, mean_b),
        cases: pairs.len(),
        delta,
        recommendation: recommend(delta, new_regressions.len(), new_fixes.len(), worst),
        categories,
        new_regressions,
        new_fixes,
        changed,
        rule: RULE,
    }
}

/// The comparison as text tables.
pub fn markdown(c: &Comparison) -> String {
    let mut out = format!(
        "A: {} (version {}): mean score {:.3}, {} of {} pass\nB: {} (version {}): mean score {:.3}, {} of {} pass\n\n",
        c.a.dir, c.a.version, c.a.mean_score, c.a.passed, c.cases, c.b.dir, c.b.version, c.b.mean_score, c.b.passed, c.cases
    );
    out.push_str("| category | n | A | B | Δ | improved | regressed |\n|---|---|---|---|---|---|---|\n");
    for d in &c.categories {
        out.push_str(&format!(
            "| {} | {} | {:.3} | {:.3} | {:+.3} | {} | {} |\n",
            d.category, d.n, d.a, d.b, d.delta, d.improved.join(" "), d.regressed.join(" ")
        ));
    }
    out.push_str(&format!("| ALL | {} | {:.3} | {:.3} | {:+.3} | | |\n\n", c.cases, c.a.mean_score, c.b.mean_score, c.delta));
    let list = |v: &[String]| if v.is_empty() { "none".to_string() } else { v.join(", ") };
    out.push_str(&format!("new regressions (pass → fail): {}\n", list(&c.new_regressions)));
    out.push_str(&format!("new fixes (fail → pass): {}\n", list(&c.new_fixes)));
    out.push_str(&format!("recommendation: {} ({})\n", c.recommendation.as_str(), c.rule));
    out
}

/// The replay configuration both sides run with (only the harness differs).
fn config(args: &CompareArgs) -> Result<ReplayConfig, Error> {
    let mut cases = super::cases::load_cases(&args.cases)?;
    if let Some(n) = args.limit {
        cases.truncate(n);
    }
    let llm = if args.llm == "local" {
        let dir = match (&args.model, std::env::var_os("NEXTN_MODEL")) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => PathBuf::from(m),
            (None, None) => super::bundled("models/nextn-live-tiny").ok_or("no --model given and models/nextn-live-tiny was not found")?,
        };
        LlmTarget::Local { model_dir: dir, device: nextn_engine::Device::Cpu }
    } else {
        LlmTarget::Url { base_url: args.llm.clone(), model: args.llm_model.clone() }
    };
    let mcp = if args.mcp.is_empty() { vec![super::default_mcp()?] } else { args.mcp.clone() };
    Ok(ReplayConfig {
        cases,
        concurrency: vec![1],
        spec: vec![SpecMode::Off],
        draft_steps: 0,
        draft_vocab: None,
        warmup: 0,
        llm,
        harness_dir: args.a.clone(),
        mcp,
        seed: args.seed,
        temperature: args.temperature,
        top_p: 1.0,
        max_tokens: args.max_tokens,
    })
}

/// Run the cases under A, then under B, and compare.
pub fn run_compare(args: &CompareArgs, cfg: &ReplayConfig) -> Result<Comparison, Error> {
    let mut sides = Vec::new();
    for dir in [&args.a, &args.b] {
        let harness = nextn_harness::Harness::load(dir).map_err(|e| format!("harness {}: {e}", dir.display()))?;
        let mut c = cfg.clone();
        c.harness_dir = dir.clone();
        let quiet = args.quiet;
        let label = dir.display().to_string();
        let records = run::replay(&c, |r| {
            if !quiet {
                eprintln!("[{label}] {} {:.0} ms, {} loops, {}", r.id, r.latency_ms, r.loops, r.outcome);
            }
        })?;
        sides.push((dir.display().to_string(), harness.version().to_string(), records));
    }
    let (a, b) = (&sides[0], &sides[1]);
    Ok(compare(&cfg.cases, (&a.0, &a.1, &a.2), (&b.0, &b.1, &b.2)))
}

/// `nextn-bench compare`.
pub fn command(args: CompareArgs) -> Result<(), Error> {
    let cfg = config(&args)?;
    let c = run_compare(&args, &cfg)?;
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        crate::out!("{}", markdown(&c));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_rolls_back_promotes_and_revises_as_documented() {
        assert_eq!(recommend(-0.02, 0, 0, -0.02), Recommendation::Rollback, "mean drop");
        assert_eq!(recommend(0.05, 3, 2, 0.0), Recommendation::Rollback, "breaks more than it fixes");
        assert_eq!(recommend(0.05, 0, 2, 0.0), Recommendation::Promote);
        assert_eq!(recommend(0.0, 0, 1, 0.0), Recommendation::Promote, "a fix with nothing broken");
        assert_eq!(recommend(0.05, 0, 2, -0.2), Recommendation::Revise, "one category got worse");
        assert_eq!(recommend(0.05, 1, 2, 0.0), Recommendation::Revise, "gains with a regression");
        assert_eq!(recommend(0.0, 0, 0, 0.0), Recommendation::Revise, "no measurable change");
    }

    #[test]
    fn case_score_is_the_mean_of_the_checks_that_apply() {
        let q = CaseQuality { tc: Some(1.0), rc: Some(0.0), language_ok: Some(true), ..Default::default() };
        assert!((case_score(&q) - 0.8).abs() < 1e-12, "(1 + 0 + 1 + 1 + 1) / 5");
        let q = CaseQuality { grounding_violations: vec!["87".into()], ..Default::default() };
        assert_eq!(case_score(&q), 0.5);
    }
}
