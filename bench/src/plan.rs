//! `nextn-bench plan`: what one decode step, one verify, one draft step, one greedy propose and one greedy MTP
//! cycle in one call (verify, acceptance, extend, chained draft steps) do on a device, recorded from
//! the model's own forward on shapes alone (no weights, no GPU): ops per kind, bytes moved (weights,
//! activations, KV / GDN state, host transfers), FLOPs, the bandwidth floor, and buffers allocated inside
//! each step. See `nextn_engine::backend::record` for the byte model.

use std::collections::BTreeMap;
use std::path::PathBuf;

use nextn_engine::backend::record::{plan, Plan, PlanOptions, StepRecord};
use nextn_engine::ModelConfig;
use serde_json::json;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A model config (`config.json` or its directory), e.g. configs/qwen3.6-35b-a3b.json.
    #[arg(long)]
    pub config: PathBuf,
    /// MTP draft steps k (0: decode only; ignored without an MTP layer).
    #[arg(long, default_value_t = 3)]
    pub draft_steps: usize,
    /// Tokens in the cache before the step.
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Draft steps score this many LM-head rows (as `--draft-vocab N` does).
    #[arg(long, value_name = "N")]
    pub draft_vocab: Option<usize>,
    /// Memory bandwidth the floor is computed at, GB/s (H20: 4000, H200: 4800).
    #[arg(long, default_value_t = 4000.0)]
    pub bandwidth_gbs: f64,
    /// Print every op (one line each) instead of the per-kind summary.
    #[arg(long)]
    pub ops: bool,
    /// JSON (the whole plan, every op) instead of tables.
    #[arg(long)]
    pub json: bool,
}

pub fn command(a: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = ModelConfig::from_path(&a.config)?;
    if a.draft_vocab == Some(0) {
        return Err("--draft-vocab must be at least 1".into());
    }
    let opts = PlanOptions { draft_steps: a.draft_steps, context: a.context, weight_bytes: 2, act_bytes: 2, draft_vocab: a.draft_vocab };
    let p = plan(&cfg, &opts);
    if a.json {
        let cycle = cycle_summary(&p, a.bandwidth_gbs);
        crate::outln!("{}", serde_json::to_string_pretty(&json!({ "config": a.config, "bandwidth_gbs": a.bandwidth_gbs, "plan": p, "mtp_cycle": cycle }))?);
    } else {
        crate::out!("{}", render(&a, &p));
    }
    Ok(())
}

const MB: f64 = 1e6;

/// A greedy MTP cycle at full acceptance as the CUDA backend runs it, in one call (the plan's last step: verify,
/// acceptance, draft extend and chained draft steps; `null` without MTP): launches, device→host transfers, bytes
/// moved, the bandwidth floor and that floor per emitted token (k + 1 a cycle) next to a plain decode step's.
fn cycle_summary(p: &Plan, bandwidth_gbs: f64) -> serde_json::Value {
    let (Some(decode), Some(cycle)) = (p.steps.first(), p.steps.get(4)) else {
        return serde_json::Value::Null;
    };
    let sum = |f: &dyn Fn(&StepRecord) -> u64| f(&cycle.record);
    let bytes = sum(&|r| r.bytes());
    let floor_ms = bytes as f64 / (bandwidth_gbs * 1e9) * 1e3;
    let tokens = p.options.draft_steps + 1;
    json!({
        "accepted_drafts": p.options.draft_steps,
        "tokens": tokens,
        "launches": sum(&|r| r.total(|o| o.launches as u64)),
        "device_to_host_transfers": sum(&|r| r.device_to_host() as u64),
        "host_transfer_bytes": sum(&|r| r.total(|o| o.transfer_bytes)),
        "host_to_device_copies": sum(&|r| r.host_to_device() as u64),
        "metadata_upload_bytes": sum(&|r| r.total(|o| o.upload_bytes)),
        "bytes": bytes,
        "floor_ms": floor_ms,
        "floor_ms_per_token": floor_ms / tokens as f64,
        "decode_floor_ms_per_token": decode.record.bytes() as f64 / (bandwidth_gbs * 1e9) * 1e3,
    })
}

fn render(a: &PlanArgs, p: &Plan) -> String {
    let mut out = format!(
        "plan of {} at context {} (bf16 weights and activations, f32 GDN state; launches as the CUDA backend issues them; floor at {} GB/s)\n\
         workspace: {} buffers made before any step{}\n",
        a.config.display(),
        p.options.context,
        a.bandwidth_gbs,
        p.workspace_buffers,
        if p.has_mtp { "" } else { "; no MTP layer: decode only" },
    );
    for s in &p.steps {
        out += &format!("\n== {}\n", s.name);
        if a.ops {
            out += &format!("{:>4}  {:<18} {:<44} {:>10} {:>10} {:>10}\n", "#", "op", "on", "weight MB", "act MB", "cache MB");
            for (i, o) in s.record.ops.iter().enumerate() {
                out += &format!(
                    "{:>4}  {:<18} {:<44} {:>10.3} {:>10.3} {:>10.3}\n",
                    i, o.op, o.on, o.weight_bytes as f64 / MB, o.act_bytes as f64 / MB, o.cache_bytes as f64 / MB
                );
            }
        } else {
            out += &table(&s.record);
        }
        let bytes = s.record.bytes() as f64;
        let transfer = s.record.total(|o| o.transfer_bytes) as f64;
        let launches = s.record.total(|o| o.launches as u64);
        let (per_layer, outside) = launches_by_layer(&s.record);
        let span = match (per_layer.values().min(), per_layer.values().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!("{hi} in each of {} layer(s)", per_layer.len()),
            (Some(lo), Some(hi)) => format!("{lo}-{hi} per layer over {} layers", per_layer.len()),
            _ => "no layers".into(),
        };
        out += &format!(
            "launches: {launches} ({:.1} per decoder layer: {span}, {outside} outside them); device→host transfers: {}; \
             host→device copies: {} ({} B of step metadata)\n",
            launches as f64 / p.decoder_layers.max(1) as f64,
            s.record.device_to_host(),
            s.record.host_to_device(),
            s.record.total(|o| o.upload_bytes),
        );
        out += &format!(
            "total: {} ops, {:.1} MB moved ({:.1} MB weights), {:.3} GFLOP, {:.3} KB host transfers; floor {:.3} ms; \
             buffers allocated in the step: {}\n",
            s.record.ops.len(),
            bytes / MB,
            s.record.total(|o| o.weight_bytes) as f64 / MB,
            s.record.total(|o| o.flops) as f64 / 1e9,
            transfer / 1e3,
            bytes / (a.bandwidth_gbs * 1e9) * 1e3,
            s.record.allocations,
        );
    }
    let c = cycle_summary(p, a.bandwidth_gbs);
    if !c.is_null() {
        out += &format!(
            "\n== greedy MTP cycle at full acceptance (one call on the device): {} tokens, {} launches, {} device→host \
             transfers ({} B), {:.1} MB moved; floor {:.3} ms = {:.3} ms/token (plain decode {:.3} ms/token)\n",
            c["tokens"], c["launches"], c["device_to_host_transfers"], c["host_transfer_bytes"],
            c["bytes"].as_u64().unwrap_or(0) as f64 / MB, c["floor_ms"].as_f64().unwrap_or(0.0),
            c["floor_ms_per_token"].as_f64().unwrap_or(0.0), c["decode_floor_ms_per_token"].as_f64().unwrap_or(0.0),
        );
    }
    out
}

/// Launches per layer (the layer an op's weight names, `…layers.N.`, the MTP's apart; an op naming no weight
/// (or only a cache slot, `layer N`) belongs with the op before it) and the launches outside every layer
/// (embedding, final norm, LM head).
fn launches_by_layer(r: &StepRecord) -> (BTreeMap<String, u64>, u64) {
    let layer_of = |on: &str| -> Option<String> {
        let (prefix, tail) = on.split_once("layers.")?;
        let n: String = tail.chars().take_while(char::is_ascii_digit).collect();
        (!n.is_empty()).then(|| format!("{prefix}layers.{n}"))
    };
    let (mut per, mut outside, mut current) = (BTreeMap::new(), 0u64, None);
    for o in &r.ops {
        if !o.on.is_empty() && !o.on.starts_with("layer ") {
            current = layer_of(&o.on);
        }
        match &current {
            Some(l) => *per.entry(l.clone()).or_insert(0) += o.launches as u64,
            None => outside += o.launches as u64,
        }
    }
    (per, outside)
}

/// Ops of one step grouped by kind, in order of bytes moved.
fn table(r: &StepRecord) -> String {
    let mut by: BTreeMap<&str, (usize, u64, u64, u64, u64, u64)> = BTreeMap::new();
    for o in &r.ops {
        let e = by.entry(o.op).or_default();
        *e = (e.0 + 1, e.1 + o.weight_bytes, e.2 + o.act_bytes, e.3 + o.cache_bytes, e.4 + o.flops, e.5 + o.launches as u64);
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by_key(|(_, v)| std::cmp::Reverse(v.1 + v.2 + v.3));
    let mut out =
        format!("{:<18} {:>5} {:>9} {:>11} {:>9} {:>10} {:>9}\n", "op", "count", "launches", "weight MB", "act MB", "cache MB", "GFLOP");
    for (op, (n, w, act, cache, flops, launches)) in rows {
        out += &format!(
            "{:<18} {:>5} {:>9} {:>11.1} {:>9.3} {:>10.2} {:>9.3}\n",
            op, n, launches, w as f64 / MB, act as f64 / MB, cache as f64 / MB, flops as f64 / 1e9
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen36(draft_steps: usize) -> Plan {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3.6-35b-a3b.json");
        let cfg = ModelConfig::from_path(&dir).expect("bundled config");
        plan(&cfg, &PlanOptions { draft_steps, context: 4096, weight_bytes: 2, act_bytes: 2, draft_vocab: Some(32768) })
    }

    /// A greedy cycle on the device is one transfer (the verify's k + 1 ids, the accepted count, the k drafts), the
    /// verify's and the propose's work plus a few bookkeeping launches, the floor shared by k + 1 tokens; none
    /// without MTP.
    #[test]
    fn the_cycle_summary_is_one_call_with_one_transfer() {
        let p = qwen36(3);
        let c = cycle_summary(&p, 4000.0);
        assert_eq!(c["tokens"], 4);
        assert_eq!(c["device_to_host_transfers"], 1);
        assert_eq!(c["host_transfer_bytes"], 4 * 4 + 4 + 3 * 4);
        let launches = |i: usize| p.steps[i].record.total(|o| o.launches as u64);
        let apart = launches(1) + launches(3);
        let fused = c["launches"].as_u64().unwrap();
        assert!(fused > apart && fused <= apart + 12, "cycle {fused} launches, verify + propose {apart}");
        let bytes = |i: usize| p.steps[i].record.bytes();
        let fused_bytes = c["bytes"].as_u64().unwrap();
        let apart_bytes = (bytes(1) + bytes(3)) as f64;
        assert!((fused_bytes as f64 - apart_bytes).abs() < 0.001 * apart_bytes, "{c} vs {apart_bytes} bytes apart");
        assert_eq!(p.steps[4].record.allocations, 0);
        let per_token = c["floor_ms_per_token"].as_f64().unwrap();
        assert!((per_token * 4.0 - c["floor_ms"].as_f64().unwrap()).abs() < 1e-9);
        assert!(per_token < c["decode_floor_ms_per_token"].as_f64().unwrap(), "{c}");
        assert!(cycle_summary(&qwen36(0), 4000.0).is_null());
        assert!(render(&PlanArgs { config: "x".into(), draft_steps: 3, context: 4096, draft_vocab: Some(32768), bandwidth_gbs: 4000.0, ops: false, json: false }, &p)
            .contains("greedy MTP cycle at full acceptance (one call on the device)"));
    }
}
