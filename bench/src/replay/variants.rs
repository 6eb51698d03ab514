//! Harness-variant evaluation (`nextn-bench replay --harness-variants N --variant-seed S`): the same cases under
//! the original harness and perturbed ones (`nextn_harness::perturb`), every quality metric per harness, the
//! original-vs-variant gap, and a per-dimension breakdown.
//!
//! Variants, written under `<out>/harness-variants/` (or a temp directory without `--out`):
//! `all-1` … `all-N` perturb every dimension (seeds S+1 … S+N); `skill-id`, `skill-content`, `tool-def`,
//! `prompt`, `hook` perturb one dimension each (seed S). Each runs in the replay's first concurrency × spec
//! group. Tool calls are judged by the real MCP tool a call resolved to (the trace records it), so a renamed
//! tool called under its new name scores like the original.
//!
//! Gap = original − variant (for every metric; a positive TC/RC gap means the variants did worse, a positive
//! rate gap means they violated less).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nextn_harness::{Dimension, PerturbOptions, ToolSpec};
use serde::Serialize;

use super::metrics::{self, QualitySummary};
use super::run::{self, ReplayConfig, RequestRecord};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// One harness the cases ran under.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HarnessRun {
    /// `original`, `all-<i>`, or a dimension name.
    pub label: String,
    pub dims: Vec<Dimension>,
    pub seed: Option<u64>,
    pub dir: String,
    pub version: String,
    /// Manifest entries (0 for the original).
    pub changes: usize,
    pub quality: QualitySummary,
    pub quality_by_category: BTreeMap<String, QualitySummary>,
}

/// `original − mean over the variants` per metric (`None` where a side lacks the metric).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Gap {
    pub tc: Option<f64>,
    pub tco: Option<f64>,
    pub rc: Option<f64>,
    pub language_match: Option<f64>,
    pub grounding_violation_rate: f64,
    pub forbidden_rate: f64,
    pub rule_violations_per_case: f64,
    pub judge_avg: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DimensionGap {
    pub dimension: Dimension,
    pub gap: Gap,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VariantsSummary {
    pub variant_seed: u64,
    pub strength: f64,
    /// The group the variants ran in.
    pub concurrency: usize,
    pub spec: String,
    pub harnesses: Vec<HarnessRun>,
    /// Original vs the mean of the all-dimension variants.
    pub gap: Gap,
    /// Original vs each one-dimension variant.
    pub per_dimension: Vec<DimensionGap>,
}

/// A variant to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantSpec {
    pub label: String,
    pub opts: PerturbOptions,
}

/// The variants `--harness-variants n --variant-seed seed` asks for (all-dimension ones, then one per dimension).
pub fn plan(n: usize, seed: u64, strength: f64) -> Vec<VariantSpec> {
    let all = (1..=n).map(|i| VariantSpec {
        label: format!("all-{i}"),
        opts: PerturbOptions { seed: seed.wrapping_add(i as u64), dims: Dimension::ALL.to_vec(), strength },
    });
    let single = Dimension::ALL.into_iter().map(|d| VariantSpec {
        label: d.name().to_string(),
        opts: PerturbOptions { seed, dims: vec![d], strength },
    });
    all.chain(single).collect()
}

/// Write every planned variant of `src` under `root/<label>` (a directory left from an earlier run with the
/// same plan is replaced). Returns (spec, dir, manifest change count).
pub fn generate(src: &Path, root: &Path, plan: &[VariantSpec], tools: &[ToolSpec]) -> Result<Vec<(VariantSpec, PathBuf, usize)>, Error> {
    let mut out = Vec::new();
    for v in plan {
        let dir = root.join(&v.label);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        let m = nextn_harness::perturb(src, &dir, &v.opts, tools).map_err(|e| format!("variant {}: {e}", v.label))?;
        out.push((v.clone(), dir, m.changes.len()));
    }
    Ok(out)
}

/// The tools the replay's MCP servers list (for renaming and redescribing them).
pub fn discover_tools(cfg: &ReplayConfig) -> Result<Vec<ToolSpec>, Error> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(runtime.block_on(async {
        let pool = nextn_agent::mcp::McpPool::connect_all(cfg.mcp.iter().map(String::as_str)).await?;
        let tools: Vec<ToolSpec> = pool.harness_tool_specs();
        pool.close().await;
        Ok::<_, nextn_agent::mcp::McpError>(tools)
    })?)
}

fn measured<'a>(records: &'a [RequestRecord], group: (usize, &str)) -> Vec<&'a RequestRecord> {
    records.iter().filter(|r| !r.warmup && r.concurrency == group.0 && r.spec == group.1).collect()
}

fn quality(rs: &[&RequestRecord]) -> (QualitySummary, BTreeMap<String, QualitySummary>) {
    let of = |xs: &[&RequestRecord]| metrics::summarize(xs.iter().map(|r| (&r.quality, r.judge.as_ref().map(|j| j.avg))));
    let mut by_cat: BTreeMap<String, Vec<&RequestRecord>> = BTreeMap::new();
    for r in rs {
        by_cat.entry(r.category.clone()).or_default().push(r);
    }
    (of(rs), by_cat.iter().map(|(k, v)| (k.clone(), of(v))).collect())
}

fn mean_opt(xs: &[Option<f64>]) -> Option<f64> {
    let v: Vec<f64> = xs.iter().flatten().copied().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// `original − mean(variants)` per metric.
pub fn gap(original: &QualitySummary, variants: &[&QualitySummary]) -> Gap {
    let d = |o: Option<f64>, f: &dyn Fn(&QualitySummary) -> Option<f64>| {
        Some(o? - mean_opt(&variants.iter().map(|q| f(q)).collect::<Vec<_>>())?)
    };
    let r = |o: f64, f: &dyn Fn(&QualitySummary) -> f64| {
        if variants.is_empty() { 0.0 } else { o - variants.iter().map(|q| f(q)).sum::<f64>() / variants.len() as f64 }
    };
    Gap {
        tc: d(original.tc, &|q| q.tc),
        tco: d(original.tco, &|q| q.tco),
        rc: d(original.rc, &|q| q.rc),
        language_match: d(original.language_match, &|q| q.language_match),
        grounding_violation_rate: r(original.grounding_violation_rate, &|q| q.grounding_violation_rate),
        forbidden_rate: r(original.forbidden_rate, &|q| q.forbidden_rate),
        rule_violations_per_case: r(original.rule_violations_per_case, &|q| q.rule_violations_per_case),
        judge_avg: d(original.judge_avg, &|q| q.judge_avg),
    }
}

/// Run the cases under every variant (first group only) and compare with the original's records.
/// `judge`: scores each variant's records as the main run's were.
pub fn evaluate(
    cfg: &ReplayConfig,
    original: &[RequestRecord],
    original_version: &str,
    variants: &[(VariantSpec, PathBuf, usize)],
    mut judge: impl FnMut(&ReplayConfig, &mut [RequestRecord]),
    mut progress: impl FnMut(&str, &RequestRecord) + Send,
) -> Result<VariantsSummary, Error> {
    let (c, mode) = run::groups(cfg).first().copied().ok_or("no replay group to run the variants in")?;
    let group = (c, mode.as_str());
    let (q, by_cat) = quality(&measured(original, group));
    let mut harnesses = vec![HarnessRun {
        label: "original".into(),
        dims: Vec::new(),
        seed: None,
        dir: cfg.harness_dir.display().to_string(),
        version: original_version.to_string(),
        changes: 0,
        quality: q,
        quality_by_category: by_cat,
    }];
    for (spec, dir, changes) in variants {
        let mut vcfg = cfg.clone();
        vcfg.harness_dir = dir.clone();
        vcfg.concurrency = vec![c];
        vcfg.spec = vec![mode];
        let label = spec.label.clone();
        let mut records = run::replay(&vcfg, |r| progress(&label, r))?;
        judge(&vcfg, &mut records);
        let (q, by_cat) = quality(&measured(&records, group));
        harnesses.push(HarnessRun {
            label: spec.label.clone(),
            dims: spec.opts.dims.clone(),
            seed: Some(spec.opts.seed),
            dir: dir.display().to_string(),
            version: nextn_harness::content_hash(dir)?,
            changes: *changes,
            quality: q,
            quality_by_category: by_cat,
        });
    }
    let base = harnesses[0].quality.clone();
    let all: Vec<&QualitySummary> = harnesses.iter().filter(|h| h.label.starts_with("all-")).map(|h| &h.quality).collect();
    let per_dimension = harnesses
        .iter()
        .filter(|h| h.dims.len() == 1 && !h.label.starts_with("all-"))
        .map(|h| DimensionGap { dimension: h.dims[0], gap: gap(&base, &[&h.quality]) })
        .collect();
    Ok(VariantsSummary {
        variant_seed: variants.first().map_or(0, |v| v.0.opts.seed),
        strength: variants.first().map_or(0.0, |v| v.0.opts.strength),
        concurrency: c,
        spec: mode.as_str().into(),
        gap: gap(&base, &all),
        harnesses,
        per_dimension,
    })
}

fn opt(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3}"))
}

fn signed(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:+.3}"))
}

/// The variant tables (appended to the replay's markdown).
pub fn markdown(s: &VariantsSummary) -> String {
    let mut out = format!(
        "\nHarness variants (c{} {}, strength {}): quality per harness\n\n| harness | dims | version | changes | n | TC | TCO | RC | ungrounded | forbidden | rules | lang | judge AVG |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        s.concurrency, s.spec, s.strength
    );
    for h in &s.harnesses {
        let q = &h.quality;
        let dims = if h.dims.is_empty() { "-".into() } else { h.dims.iter().map(|d| d.name()).collect::<Vec<_>>().join("+") };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} |\n",
            h.label, dims, h.version, h.changes, q.n, opt(q.tc), opt(q.tco), opt(q.rc), q.grounding_violation_rate,
            q.forbidden_rate, q.rule_violations_per_case, opt(q.language_match), opt(q.judge_avg)
        ));
    }
    out.push_str("\nOriginal − variant (all-dimension mean, then one dimension each)\n\n| variants | TC | TCO | RC | ungrounded | forbidden | rules | lang | judge AVG |\n|---|---|---|---|---|---|---|---|---|\n");
    let row = |label: &str, g: &Gap| {
        format!(
            "| {label} | {} | {} | {} | {:+.3} | {:+.3} | {:+.3} | {} | {} |\n",
            signed(g.tc), signed(g.tco), signed(g.rc), g.grounding_violation_rate, g.forbidden_rate,
            g.rule_violations_per_case, signed(g.language_match), signed(g.judge_avg)
        )
    };
    out.push_str(&row("all", &s.gap));
    for d in &s.per_dimension {
        out.push_str(&row(d.dimension.name(), &d.gap));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_has_n_all_dimension_variants_then_one_per_dimension() {
        let p = plan(2, 10, 0.5);
        let labels: Vec<&str> = p.iter().map(|v| v.label.as_str()).collect();
        assert_eq!(labels, ["all-1", "all-2", "skill-id", "skill-content", "tool-def", "prompt", "hook"]);
        assert_eq!((p[0].opts.seed, p[1].opts.seed, p[2].opts.seed), (11, 12, 10));
        assert_eq!(p[4].opts.dims, vec![Dimension::ToolDef]);
    }

    #[test]
    fn gap_is_original_minus_the_variant_mean() {
        let q = |tc: f64, rate: f64| QualitySummary { n: 4, tc: Some(tc), grounding_violation_rate: rate, ..Default::default() };
        let g = gap(&q(1.0, 0.0), &[&q(0.5, 0.25), &q(0.75, 0.75)]);
        assert_eq!((g.tc, g.grounding_violation_rate, g.rc), (Some(0.375), -0.5, None));
    }
}
