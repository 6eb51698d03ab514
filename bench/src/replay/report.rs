//! The summary of a replay: per (concurrency × spec) group latency percentiles, TTFT, decode speed,
//! success and 15 s attainment, the MTP on/off decode-throughput ratio per concurrency, and quality per
//! category; written as `summary.json`, `summary.md`, `requests.jsonl` and two SVG pictures.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::Serialize;

use super::metrics::{self, QualitySummary};
use super::plot;
use super::run::{RequestRecord, Stages};

/// The latency budget of a live reply.
pub const ATTAINMENT_MS: f64 = 15_000.0;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Linear interpolation between closest ranks (numpy's default); all zero for no values.
pub fn percentiles(values: &[f64]) -> Percentiles {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let pos = q * (v.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
    };
    Percentiles { n: v.len(), p50: at(0.5), p90: at(0.9), p95: at(0.95), p99: at(0.99), mean: v.iter().sum::<f64>() / v.len() as f64 }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupSummary {
    pub concurrency: usize,
    pub spec: String,
    /// Measured requests (warm-up excluded).
    pub n: usize,
    pub latency_ms: Percentiles,
    pub ttft_first_ms: Percentiles,
    pub ttft_reply_ms: Percentiles,
    pub decode_tps: Percentiles,
    pub acceptance_length: Option<f64>,
    pub acceptance_per_position: Vec<f64>,
    pub success_rate: f64,
    /// Share of all measured requests that finished within 15 s.
    pub attainment_15s: f64,
    pub mean_loops: f64,
    pub stages_mean_ms: Stages,
    pub quality: QualitySummary,
    pub quality_by_category: BTreeMap<String, QualitySummary>,
    /// Wall time of the measured phase (first start to last end), and requests per second over it.
    pub span_s: f64,
    pub throughput_rps: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MtpRatio {
    pub concurrency: usize,
    pub off_tps: f64,
    pub mtp_tps: f64,
    /// Mean decode tokens/s with MTP over without.
    pub ratio: f64,
}

/// The harness every agent of a replay ran with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayHarness {
    pub dir: String,
    /// Its content hash.
    pub version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Set by `nextn-bench replay` (the records do not carry it, so [`summarize`] leaves it `None`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub harness: Option<ReplayHarness>,
    pub groups: Vec<GroupSummary>,
    pub mtp_ratio: Vec<MtpRatio>,
    pub warmup_excluded: usize,
    /// `--draft-vocab` as given (MTP drafts over a reduced vocabulary), set by `nextn-bench replay`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_vocab: Option<String>,
    /// The in-process engine's device (`cpu`, `cuda:0`), set by `nextn-bench replay --llm local`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `--harness-variants N`: quality per harness, the original-vs-variant gap, per dimension.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub harness_variants: Option<super::variants::VariantsSummary>,
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

fn group_summary(concurrency: usize, spec: &str, rs: &[&RequestRecord]) -> GroupSummary {
    let n = rs.len();
    let lat: Vec<f64> = rs.iter().map(|r| r.latency_ms).collect();
    let specs: Vec<_> = rs.iter().filter_map(|r| r.spec_stats.as_ref()).filter(|s| s.verify_steps > 0).collect();
    let steps: u64 = specs.iter().map(|s| s.verify_steps).sum();
    let acceptance_length = (steps > 0).then(|| specs.iter().map(|s| (s.accepted + s.verify_steps) as f64).sum::<f64>() / steps as f64);
    let width = specs.iter().map(|s| s.acceptance_per_position.len()).max().unwrap_or(0);
    let acceptance_per_position = (0..width)
        .map(|i| specs.iter().map(|s| s.acceptance_per_position.get(i).copied().unwrap_or(0.0) * s.verify_steps as f64).sum::<f64>() / steps.max(1) as f64)
        .collect();
    let stage = |f: fn(&Stages) -> f64| mean(rs.iter().map(|r| f(&r.stages)));
    let mut by_cat: BTreeMap<String, Vec<&RequestRecord>> = BTreeMap::new();
    for r in rs {
        by_cat.entry(r.category.clone()).or_default().push(r);
    }
    let quality_of = |xs: &[&RequestRecord]| metrics::summarize(xs.iter().map(|r| (&r.quality, r.judge.as_ref().map(|j| j.avg))));
    let first = rs.iter().map(|r| r.start_ms).fold(f64::INFINITY, f64::min);
    let last = rs.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    let span_s = if n > 0 { (last - first).max(0.0) / 1e3 } else { 0.0 };
    GroupSummary {
        concurrency,
        spec: spec.to_string(),
        n,
        latency_ms: percentiles(&lat),
        ttft_first_ms: percentiles(&rs.iter().filter_map(|r| r.ttft_first_ms).collect::<Vec<_>>()),
        ttft_reply_ms: percentiles(&rs.iter().filter_map(|r| r.ttft_reply_ms).collect::<Vec<_>>()),
        decode_tps: percentiles(&rs.iter().filter_map(|r| r.decode_tps).collect::<Vec<_>>()),
        acceptance_length,
        acceptance_per_position,
        success_rate: if n == 0 { 0.0 } else { rs.iter().filter(|r| r.success).count() as f64 / n as f64 },
        attainment_15s: if n == 0 { 0.0 } else { lat.iter().filter(|&&l| l <= ATTAINMENT_MS).count() as f64 / n as f64 },
        mean_loops: mean(rs.iter().map(|r| r.loops as f64)),
        stages_mean_ms: Stages {
            prompt_ms: stage(|s| s.prompt_ms),
            prefill_ms: stage(|s| s.prefill_ms),
            decode_ms: stage(|s| s.decode_ms),
            tools_ms: stage(|s| s.tools_ms),
            hooks_ms: stage(|s| s.hooks_ms),
            queue_ms: None,
            other_ms: stage(|s| s.other_ms),
        },
        quality: quality_of(rs),
        quality_by_category: by_cat.iter().map(|(k, v)| (k.clone(), quality_of(v))).collect(),
        span_s,
        throughput_rps: if span_s > 0.0 { n as f64 / span_s } else { 0.0 },
    }
}

/// Summarise the measured (non-warm-up) records per group, groups in order of first appearance.
pub fn summarize(records: &[RequestRecord]) -> Summary {
    let mut order: Vec<(usize, String)> = Vec::new();
    for r in records {
        let key = (r.concurrency, r.spec.clone());
        if !order.contains(&key) {
            order.push(key);
        }
    }
    let groups: Vec<GroupSummary> = order
        .iter()
        .map(|(c, s)| {
            let rs: Vec<&RequestRecord> = records.iter().filter(|r| !r.warmup && r.concurrency == *c && &r.spec == s).collect();
            group_summary(*c, s, &rs)
        })
        .collect();
    let mut mtp_ratio = Vec::new();
    for g in groups.iter().filter(|g| g.spec == "mtp") {
        if let Some(off) = groups.iter().find(|o| o.spec == "off" && o.concurrency == g.concurrency)
            && off.decode_tps.mean > 0.0
        {
            mtp_ratio.push(MtpRatio { concurrency: g.concurrency, off_tps: off.decode_tps.mean, mtp_tps: g.decode_tps.mean, ratio: g.decode_tps.mean / off.decode_tps.mean });
        }
    }
    Summary { harness: None, groups, mtp_ratio, warmup_excluded: records.iter().filter(|r| r.warmup).count(), draft_vocab: None, device: None, harness_variants: None }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.digits$}"))
}

/// The summary as markdown tables (printed and written to `summary.md`).
pub fn markdown(s: &Summary) -> String {
    let mut out = String::new();
    if let Some(h) = &s.harness {
        out.push_str(&format!("Harness: `{}` (version {})\n\n", h.dir, h.version));
    }
    if let Some(dv) = &s.draft_vocab {
        out.push_str(&format!("MTP draft vocabulary: `{dv}`\n\n"));
    }
    if let Some(d) = &s.device {
        out.push_str(&format!("Engine device: `{d}`\n\n"));
    }
    out.push_str("| conc | spec | n | P50 s | P90 s | P95 s | P99 s | mean s | TTFT1 P50 ms | TTFT-reply P50 ms | decode tok/s | acc. len | success | ≤15 s | loops |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for g in &s.groups {
        let l = &g.latency_ms;
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1} | {} | {:.1}% | {:.1}% | {:.2} |\n",
            g.concurrency, g.spec, g.n, l.p50 / 1e3, l.p90 / 1e3, l.p95 / 1e3, l.p99 / 1e3, l.mean / 1e3,
            g.ttft_first_ms.p50, g.ttft_reply_ms.p50, g.decode_tps.mean, opt(g.acceptance_length, 2),
            g.success_rate * 100.0, g.attainment_15s * 100.0, g.mean_loops,
        ));
    }
    if !s.mtp_ratio.is_empty() {
        out.push_str("\n| conc | decode tok/s off | decode tok/s mtp | MTP ratio |\n|---|---|---|---|\n");
        for m in &s.mtp_ratio {
            out.push_str(&format!("| {} | {:.1} | {:.1} | {:.2}x |\n", m.concurrency, m.off_tps, m.mtp_tps, m.ratio));
        }
    }
    out.push_str("\n| conc | spec | prompt ms | prefill ms | decode ms | tools ms | hooks ms | other ms |\n|---|---|---|---|---|---|---|---|\n");
    for g in &s.groups {
        let st = &g.stages_mean_ms;
        out.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            g.concurrency, g.spec, st.prompt_ms, st.prefill_ms, st.decode_ms, st.tools_ms, st.hooks_ms, st.other_ms
        ));
    }
    out.push_str("\nQuality (TC tool correctness, TCO order, RC reply coverage: means where the metric applies; ungrounded / forbidden: share of cases; rules: hook retry+block per case)\n\n");
    out.push_str("| conc | spec | category | n | TC | TCO | RC | ungrounded | forbidden | rules | lang | judge AVG |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for g in &s.groups {
        let rows = std::iter::once(("ALL".to_string(), &g.quality)).chain(g.quality_by_category.iter().map(|(k, v)| (k.clone(), v)));
        for (cat, q) in rows {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {} |\n",
                g.concurrency, g.spec, cat, q.n, opt(q.tc, 2), opt(q.tco, 2), opt(q.rc, 2), q.grounding_violation_rate,
                q.forbidden_rate, q.rule_violations_per_case, opt(q.language_match, 2), opt(q.judge_avg, 3),
            ));
        }
    }
    if let Some(v) = &s.harness_variants {
        out.push_str(&super::variants::markdown(v));
    }
    out
}

/// `requests.jsonl`, `summary.json`, `summary.md`, `latency_cdf.svg`, `stages.svg` in `dir`.
pub fn write_outputs(dir: &Path, records: &[RequestRecord], summary: &Summary) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("requests.jsonl"))?);
    for r in records {
        serde_json::to_writer(&mut f, r).map_err(std::io::Error::other)?;
        f.write_all(b"\n")?;
    }
    f.flush()?;
    std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(summary).map_err(std::io::Error::other)?)?;
    std::fs::write(dir.join("summary.md"), format!("# Deployment replay\n\n{}", markdown(summary)))?;
    let curves: Vec<plot::Curve> = summary
        .groups
        .iter()
        .map(|g| plot::Curve {
            label: format!("c{} {}", g.concurrency, g.spec),
            values_ms: records.iter().filter(|r| !r.warmup && r.concurrency == g.concurrency && r.spec == g.spec).map(|r| r.latency_ms).collect(),
        })
        .collect();
    plot::latency_cdf(&dir.join("latency_cdf.svg"), &curves).map_err(std::io::Error::other)?;
    let bars: Vec<(String, Stages)> = summary.groups.iter().map(|g| (format!("c{} {}", g.concurrency, g.spec), g.stages_mean_ms.clone())).collect();
    plot::stages(&dir.join("stages.svg"), &bars).map_err(std::io::Error::other)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let p = percentiles(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]);
        assert_eq!((p.p50, p.mean), (5.5, 5.5));
        assert!((p.p90 - 9.1).abs() < 1e-9 && (p.p99 - 9.91).abs() < 1e-9);
        assert_eq!(percentiles(&[]).n, 0);
        assert_eq!(percentiles(&[3.0]).p95, 3.0);
    }
}
