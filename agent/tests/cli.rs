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

/// `nextn agent --device`: the local engine on a device this build or machine cannot use is one clear error (exit
/// 1), and an endpoint refuses a device (it picks its own).
#[test]
fn agent_device_errors_are_clean() {
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["agent", "--device", "cuda", "--comment", "Amy: how much is the fleece hoodie?"], "CUDA"),
        (vec!["agent", "--device", "cuda:1", "--llm", "http://127.0.0.1:9/v1", "--comment", "hi"], "--llm local"),
        (vec!["agent", "--device", "gpu", "--comment", "hi"], "expected cpu, cuda or cuda:N"),
    ];
    for (args, needle) in cases {
        let out = nextn(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

const ALL_FIXTURES: [&str; 7] = [
    "qwen3_5_moe",
    "qwen3_5_moe_per_expert",
    "qwen3_moe",
    "qwen3_5_moe_bf16",
    "qwen3_5_moe_per_expert_bf16",
    "qwen3_moe_bf16",
    "qwen3_moe_f16",
];

#[test]
fn generate_json_reproduces_reference_continuation_on_every_fixture() {
    for name in ALL_FIXTURES {
        let dir = fixture(name);
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        for case in reference["cases"].as_array().unwrap() {
            let ids: Vec<String> = case["input_ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
            let want = case["greedy_ids"].as_array().unwrap();
            let n = want.len().to_string();
            let out = nextn(&[
                "generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids.join(","), "--max-new-tokens", &n,
                "--greedy", "--json",
            ]);
            assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
            let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
            assert_eq!(got["token_ids"].as_array().unwrap(), want, "{name}");
            assert_eq!(got["finish_reason"], "length");
            let stats = &got["stats"];
            assert_eq!(stats["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
            assert_eq!(stats["generated_tokens"].as_u64().unwrap() as usize, want.len());
            assert!(stats["ttft_ms"].as_f64().unwrap() > 0.0 && stats["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn generate_rejects_bad_parameters_cleanly() {
    let dir = fixture("qwen3_moe");
    let d = dir.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--temperature=-1"], "temperature"),
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--temperature", "1", "--top-p", "1.5"], "top_p"),
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "0"], "max_new_tokens"),
        (vec!["generate", "--model", d, "--prompt", "hello"], "tokenizer"),
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--draft-vocab", "8"], "--spec mtp"),
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--spec", "mtp", "--draft-vocab", "8"], "nextn draft-vocab"),
        (vec!["generate", "--model", d, "--prompt-ids", "1,2", "--spec", "mtp", "--draft-vocab", "/nonexistent/dv.txt"], "/nonexistent/dv.txt"),
    ];
    for (args, needle) in cases {
        let out = nextn(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn generate_dummy_runs_from_a_config_alone() {
    let cfg = fixture("qwen3_5_moe").join("config.json");
    let out = nextn(&[
        "generate", "--config", cfg.to_str().unwrap(), "--load-format", "dummy", "--prompt-ids", "1,2,3",
        "--max-new-tokens", "4", "--greedy", "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["token_ids"].as_array().unwrap().len(), 4);
}

#[test]
fn generate_spec_mtp_reports_acceptance_and_matches_spec_off() {
    let dir = fixture("qwen3_5_moe");
    let d = dir.to_str().unwrap();
    let base = ["generate", "--model", d, "--prompt-ids", "5,17,99,3,42", "--max-new-tokens", "40", "--greedy", "--json"];
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        let out = nextn(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let off = run(&["--spec", "off"]);
    assert!(off["stats"].get("spec").is_none());
    for k in ["1", "3", "4"] {
        let on = run(&["--spec", "mtp", "--draft-steps", k]);
        assert_eq!(on["token_ids"], off["token_ids"], "k={k}");
        let spec = &on["stats"]["spec"];
        for field in ["verify_steps", "drafted", "accepted", "acceptance_length", "acceptance_rate", "accepted_per_position"] {
            assert!(spec.get(field).is_some(), "stats.spec.{field} missing: {spec}");
        }
        assert_eq!(spec["accepted_per_position"].as_array().unwrap().len(), k.parse::<usize>().unwrap());
    }
    // A model without an MTP head refuses --spec mtp with a clear error.
    let per_expert = fixture("qwen3_5_moe_per_expert");
    let out = nextn(&["generate", "--model", per_expert.to_str().unwrap(), "--prompt-ids", "1,2", "--spec", "mtp"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MTP"));
}

fn bundled_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nextn-live-tiny")
}

#[test]
fn draft_vocab_file_from_a_corpus_leaves_generation_unchanged() {
    let tmp = std::env::temp_dir().join(format!("nextn-cli-draft-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let corpus = tmp.join("corpus.jsonl");
    let lines = [
        r#"{"examples": [{"prompt": "ignored", "completion": "The Oversized Fleece Hoodie is 199 yuan."}]}"#,
        r#"{"examples": [{"prompt": "ignored", "completion": "Yes, 12 left in Black size M."}]}"#,
    ];
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let file = tmp.join("dv.txt");
    let model = bundled_model();
    let (m, c, f) = (model.to_str().unwrap(), corpus.to_str().unwrap(), file.to_str().unwrap());
    let out = nextn(&["draft-vocab", "--model", m, "--corpus", c, "--field", "completion", "--out", f, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let written = summary["written"].as_u64().unwrap();
    assert!(written > 5 && summary["tokens_counted"].as_u64().unwrap() >= written - 2, "{summary}");
    // End-of-turn ids come first, so a draft can propose stopping.
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let eos: Vec<u64> = config["text_config"]["eos_token_id"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let ids: Vec<u64> = std::fs::read_to_string(&file).unwrap().lines().filter(|l| !l.starts_with('#')).map(|l| l.parse().unwrap()).collect();
    assert_eq!(ids.len() as u64, written);
    assert!(eos.contains(&ids[0]), "first id {} is not an end-of-turn id {eos:?}", ids[0]);

    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "--model", m, "--chat", "--prompt", "how much is the hoodie?", "--max-new-tokens", "24",
            "--spec", "mtp", "--json"];
        args.extend_from_slice(extra);
        let out = nextn(&args);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let plain = generate(&[]);
    let reduced = generate(&["--draft-vocab", f]);
    assert_eq!(plain["token_ids"], reduced["token_ids"], "a draft vocabulary changed the output");
    assert_eq!(reduced["stats"]["spec"]["draft_vocab"]["size"].as_u64(), Some(written));
    assert!(plain["stats"]["spec"].get("draft_vocab").is_none());
    std::fs::remove_dir_all(&tmp).ok();
}
