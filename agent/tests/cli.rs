//! The `nextn` binary as scripts call it.

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

fn nextn(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nextn")).args(args).output().expect("run nextn")
}

#[test]
fn logits_command_matches_reference_on_every_fixture() {
    for name in ["qwen3_5_moe", "qwen3_moe", "qwen3_5_moe_bf16"] {
        let dir = fixture(name);
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let case = &reference["cases"][0];
        let ids: Vec<String> = case["input_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
        let out = nextn(&["logits", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids.join(","), "--device", "cpu"]);
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
        let got = got["logits"].as_array().unwrap();
        let want = case["logits"].as_array().unwrap();
        assert_eq!(got.len(), want.len());
        let tol = if name.ends_with("bf16") { 2e-3 } else { 1e-4 };
        let mut err = 0.0f64;
        let mut scale = 0.0f64;
        for (g, w) in got.iter().zip(want) {
            for (a, b) in g.as_array().unwrap().iter().zip(w.as_array().unwrap()) {
                err = err.max((a.as_f64().unwrap() - b.as_f64().unwrap()).abs());
                scale = scale.max(b.as_f64().unwrap().abs());
            }
        }
        assert!(err <= tol * scale, "{name}: {err} vs {}", tol * scale);
    }
}

#[test]
fn logits_command_fails_cleanly_on_bad_input() {
    let dir = fixture("qwen3_moe");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["logits", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,x,3"], "item 1"),
        (vec!["logits", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,99999"], "out of range"),
        (vec!["logits", "--model", "/nonexistent/model", "--prompt-ids", "1"], "no such model directory"),
        (vec!["logits", "--model", dir.to_str().unwrap(), "--prompt-ids", "1", "--device", "cuda"], "CUDA"),
    ];
    for (args, needle) in cases {
        let out = nextn(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
