//! `nextn-bench` as scripts call it (on the tiny fixture: the numbers are not meaningful, the contract is).

use std::process::Command;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

#[test]
fn spec_bench_reports_acceptance_and_losslessness() {
    let prompts = std::env::temp_dir().join(format!("nextn-bench-prompts-{}.jsonl", std::process::id()));
    std::fs::write(&prompts, "{\"prompt_ids\": [5, 17, 99, 3]}\n{\"prompt_ids\": [200, 1, 64, 64, 7, 9]}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
        .args(["spec", "--model", fixture("qwen3_5_moe").to_str().unwrap(), "--prompts", prompts.to_str().unwrap()])
        .args(["--draft-steps", "1,3", "--max-new-tokens", "24", "--json"])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&prompts);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompts"], 2);
    assert!(v["plain"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    let runs = v["mtp"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert_eq!(r["identical_to_plain_greedy"], true);
        let s = &r["spec"];
        assert!(s["verify_steps"].as_u64().unwrap() > 0);
        assert!(s["acceptance_length"].as_f64().unwrap() >= 1.0);
    }
}

/// `cycle --paired-rounds N` adds, per acceptance length, the rounds' ratio spread; without it `paired` is null.
#[test]
fn cycle_bench_reports_paired_rounds() {
    let run = |extra: &[&str]| -> Vec<serde_json::Value> {
        let out = Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
            .args(["cycle", "--model", fixture("qwen3_5_moe").to_str().unwrap(), "--context", "16", "--ttft-prompt", "0"])
            .args(["--decode-steps", "2", "--cycles", "2", "--draft-steps", "2", "--accept-lengths", "1,3", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let lines = String::from_utf8(out.stdout).unwrap();
        let records: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        records.into_iter().filter(|r| r["record"] == "mtp").collect()
    };
    let paired = run(&["--paired-rounds", "3"]);
    assert_eq!(paired.len(), 2);
    for r in &paired {
        let p = &r["paired"];
        assert_eq!(p["rounds"], 3, "{r}");
        let (lo, mid, hi) = (
            p["speedup_vs_decode_min"].as_f64().unwrap(),
            p["speedup_vs_decode_median"].as_f64().unwrap(),
            p["speedup_vs_decode_max"].as_f64().unwrap(),
        );
        assert!(0.0 < lo && lo <= mid && mid <= hi && hi.is_finite(), "{r}");
    }
    let plain = run(&[]);
    assert_eq!(plain.len(), 2);
    assert!(plain.iter().all(|r| r["paired"].is_null() && r["speedup_vs_decode"].as_f64().unwrap() > 0.0));
}

/// `cycle --temperature T --top-p P` draws decode and verify rows with the keyed sampler and says so in its setup
/// record; a bad temperature is a one-line error, never a panic.
#[test]
fn cycle_bench_samples_with_keyed_draws() {
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
            .args(["cycle", "--model", fixture("qwen3_5_moe").to_str().unwrap(), "--context", "16", "--ttft-prompt", "0"])
            .args(["--decode-steps", "2", "--cycles", "2", "--draft-steps", "2", "--accept-lengths", "1,3", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--temperature", "1", "--top-p", "0.9"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<serde_json::Value> = String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let setup = records.iter().find(|r| r["record"] == "setup").unwrap();
    assert_eq!(setup["sampling"]["keyed"], true, "{setup}");
    assert_eq!(setup["sampling"]["temperature"], 1.0, "{setup}");
    assert!(records.iter().any(|r| r["record"] == "decode" && r["ms_per_token"].as_f64().unwrap() > 0.0));
    assert_eq!(records.iter().filter(|r| r["record"] == "mtp").count(), 2);
    let greedy = run(&[]);
    assert!(String::from_utf8(greedy.stdout).unwrap().contains("\"sampling\":\"greedy\""));
    let bad = run(&["--temperature=-1"]);
    assert_eq!(bad.status.code(), Some(1), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("temperature"));
}

#[test]
fn decode_bench_reports_the_roofline_fields() {
    let out = Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
        .args(["decode", "--model", fixture("qwen3_moe").to_str().unwrap(), "--tokens", "4", "--no-membw", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["weight_bytes_per_token"].as_u64().unwrap() > 0);
    assert!(v["achieved_gb_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn gemm_bench_reports_both_kernels_against_the_fma_peak_and_rejects_bad_shapes() {
    let out = Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
        .args(["gemm", "--shapes", "96x64,33x40", "--rows", "1,20", "--iters", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["record"], "setup");
    assert!(lines[0]["fma_peak_gflops"].as_f64().unwrap() > 0.0);
    let shapes: Vec<&serde_json::Value> = lines.iter().filter(|l| l["record"] == "shape").collect();
    assert_eq!(shapes.len(), 4, "2 shapes x 2 row counts");
    for s in shapes {
        for k in ["gemv_gflops", "gemm_gflops", "gemv_peak_fraction", "gemm_peak_fraction", "gemm_vs_gemv"] {
            assert!(s[k].as_f64().unwrap() > 0.0, "{k} in {s}");
        }
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_nextn-bench")).args(["gemm", "--shapes", "96by64"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("96by64"), "{}", String::from_utf8_lossy(&bad.stderr));
}

/// A config without `--load-format dummy`, or no model at all, is the caller's mistake: exit 1 with the fix.
#[test]
fn a_config_without_dummy_weights_says_how_to_run_it() {
    let config = fixture("qwen3_5_moe").join("config.json");
    for (args, want) in [
        (vec!["cycle", "--config", config.to_str().unwrap()], "has no weights: add --load-format dummy"),
        (vec!["decode", "--config", config.to_str().unwrap()], "has no weights: add --load-format dummy"),
        (vec!["decode"], "--model DIR is required (or --config FILE with --load-format dummy)"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_nextn-bench")).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(want), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// A reader that closes stdout early (`nextn-bench plan ... | head -2`) ends the run with exit 0 and no panic
/// (before: "failed printing to stdout: Broken pipe", exit 101).
#[test]
fn a_closed_stdout_is_a_quiet_success() {
    let config = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3.6-35b-a3b.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_nextn-bench"))
        .args(["plan", "--config", config.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
}
