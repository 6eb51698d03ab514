//! `nextn harness render` as the training pipeline runs it: the real binary, the real commerce MCP server, the
//! bundled harnesses and model directory. What it prints must be exactly what the agent sends the model.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use common::{commerce_bin, copy_dir};
use serde_json::{Value, json};

fn repo(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn render(args: &[&str], stdin: Option<&str>) -> Output {
    let mcp = format!("commerce={}", commerce_bin().display());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nextn"));
    cmd.args(["harness", "render", "--mcp", &mcp]).args(args);
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(text) = stdin {
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn lines(out: &Output) -> Vec<Value> {
    assert!(out.status.success(), "exit {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

const GET_BAG: &str = "<tool_call>\n<function=get_product>\n<parameter=product_id>\np010\n</parameter>\n</function>\n</tool_call>";

#[test]
fn a_scripted_conversation_renders_every_request_with_the_real_tool_result() {
    let harness = repo("harness/live-tiny");
    let out = render(
        &["--harness", harness.to_str().unwrap(), "--comment", "how much is the crossbody bag?", "--reply", GET_BAG, "--reply",
            "The Leather Crossbody Bag is 399 yuan. [show_product:p010]", "--ids"],
        None,
    );
    let v = &lines(&out)[0];
    assert_eq!(v["outcome"], "replied", "{v}");
    assert_eq!(v["reply"], "The Leather Crossbody Bag is 399 yuan.");
    assert_eq!(v["unused_turns"], 0);
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 2);
    let (first, second) = (reqs[0]["prompt"].as_str().unwrap(), reqs[1]["prompt"].as_str().unwrap());
    // The compact profile's prompt: its tools, its rules, the comment, the generation prompt.
    assert!(first.starts_with("<|im_start|>system\n# Tools"), "{first}");
    assert!(first.contains("\"description\": \"Price, colours, sizes, material.\""));
    assert!(first.contains("<|im_start|>user\nhow much is the crossbody bag?<|im_end|>"));
    assert!(first.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    // The second request carries the call and the commerce server's own answer.
    assert!(second.contains("<function=get_product>"));
    assert!(second.contains("<tool_response>\n{\"id\":\"p010\""), "{second}");
    assert!(second.contains("\"price\":399.0"));
    assert_eq!(reqs[0]["completion"], GET_BAG);
    // The chat request as the agent built it, and ids under the model's tokenizer.
    assert_eq!(reqs[1]["messages"][1], json!({"role": "user", "content": "how much is the crossbody bag?"}));
    assert_eq!(reqs[1]["messages"].as_array().unwrap().len(), 4);
    assert!(reqs[0]["tools"].as_array().unwrap().iter().any(|t| t["function"]["name"] == "check_stock"));
    let ids = reqs[0]["prompt_ids"].as_array().unwrap();
    assert!(ids.len() > 100 && ids.len() < first.len(), "{} ids for {} chars", ids.len(), first.len());
    assert!(v["events"].as_array().unwrap().iter().any(|e| e["event"] == "tool_call" && e["ok"] == true));
}

#[test]
fn a_reply_the_hooks_reject_puts_the_feedback_in_the_next_prompt() {
    let case = json!({"id": "retry", "comment": "what is the bag made of?",
        "turns": [GET_BAG, "100% guaranteed, it never breaks! The bag is leather.", "The bag is full-grain cow leather."]});
    let harness = repo("harness/live-tiny");
    let out = render(&["--harness", harness.to_str().unwrap(), "--cases", "/dev/stdin"], Some(&format!("{case}\n")));
    let v = &lines(&out)[0];
    assert_eq!(v["id"], "retry");
    assert_eq!(v["outcome"], "replied", "{v}");
    assert_eq!(v["reply"], "The bag is full-grain cow leather.");
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3);
    let last = reqs[2]["prompt"].as_str().unwrap();
    assert!(last.contains("(system) Your reply was not sent:"), "{last}");
    assert!(v["events"].as_array().unwrap().iter().any(|e| e["hook"] == "forbidden_claims" && e["decision"] == "retry"));
}

#[test]
fn a_retry_is_decoded_at_the_harness_retry_temperature_with_a_seed_from_the_conversation() {
    let case = json!({"id": "retry", "comment": "what is the bag made of?",
        "turns": [GET_BAG, "100% guaranteed, it never breaks! The bag is leather.", "The bag is full-grain cow leather."]});
    let stdin = format!("{case}\n");
    let run = |harness: &std::path::Path| {
        let out = render(&["--harness", harness.to_str().unwrap(), "--cases", "/dev/stdin"], Some(&stdin));
        let v = lines(&out)[0].clone();
        assert_eq!(v["outcome"], "replied", "{v}");
        v["requests"].as_array().unwrap().iter().map(|r| (r["temperature"].clone(), r["seed"].clone())).collect::<Vec<_>>()
    };
    // The bundled harness: every call at the request's settings (temperature 0, no seed).
    let bundled = run(&repo("harness/live-tiny"));
    assert_eq!(bundled, vec![(json!(0.0), Value::Null); 3]);
    // With feedback.retry_temperature the call after the retry message (only that one) samples, seeded.
    let dir = std::env::temp_dir().join(format!("nextn-render-retry-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&repo("harness/live-tiny"), &dir);
    let hooks_path = dir.join("hooks.json");
    let mut hooks: Value = serde_json::from_str(&std::fs::read_to_string(&hooks_path).unwrap()).unwrap();
    hooks["feedback"] = json!({"retry_temperature": 1.0});
    std::fs::write(&hooks_path, hooks.to_string()).unwrap();
    let warm = run(&dir);
    assert_eq!(warm[..2], bundled[..2]);
    assert_eq!(warm[2].0, json!(1.0));
    assert!(warm[2].1.is_u64(), "{:?}", warm[2]);
    // The seed is a function of the conversation: the same request retries the same way.
    assert_eq!(run(&dir), warm);
    // Out of range: a typed harness error naming the field.
    std::fs::write(&hooks_path, "{\"feedback\": {\"retry_temperature\": 5}}").unwrap();
    let out = render(&["--harness", dir.to_str().unwrap(), "--comment", "hi"], None);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hooks.json") && err.contains("feedback.retry_temperature"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn with_ban_refused_clause_the_retry_may_not_begin_with_the_refused_clause() {
    const LIST: &str = "<tool_call>\n<function=list_promotions>\n</function>\n</tool_call>";
    let refused = "Tonight you can use LIVE20, WELCOME30, and shipping to International is 120 yuan.";
    let case = json!({"id": "ban", "comment": "what codes can I use today",
        "turns": [LIST, refused, "Tonight you can use LIVE20, WELCOME30, KNIT2 and SCARF50."]});
    let stdin = format!("{case}\n");
    let run = |harness: &std::path::Path| {
        let out = render(&["--harness", harness.to_str().unwrap(), "--cases", "/dev/stdin"], Some(&stdin));
        lines(&out)[0].clone()
    };
    // The bundled harness: no bans.
    let bundled = run(&repo("harness/live-tiny"));
    assert_eq!(bundled["outcome"], "replied", "{bundled}");
    assert!(bundled["requests"].as_array().unwrap().iter().all(|r| r["banned_prefixes"] == json!([])), "{bundled}");
    // With the option: the call after the grounding retry may not begin with the refused reply up to the first
    // word of its unsupported clause, and the trace says so.
    let dir = std::env::temp_dir().join(format!("nextn-render-ban-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&repo("harness/live-tiny"), &dir);
    let hooks_path = dir.join("hooks.json");
    let mut hooks: Value = serde_json::from_str(&std::fs::read_to_string(&hooks_path).unwrap()).unwrap();
    hooks["feedback"] = json!({"ban_refused_clause": true});
    std::fs::write(&hooks_path, hooks.to_string()).unwrap();
    let v = run(&dir);
    assert_eq!(v["outcome"], "replied", "{v}");
    assert_eq!(v["reply"], "Tonight you can use LIVE20, WELCOME30, KNIT2 and SCARF50.");
    let bans: Vec<Value> = v["requests"].as_array().unwrap().iter().map(|r| r["banned_prefixes"].clone()).collect();
    assert_eq!(bans, vec![json!([]), json!([]), json!(["Tonight you can use LIVE20, WELCOME30, and"])]);
    assert!(v["events"].as_array().unwrap().iter().any(|e| e["kind"] == "retry_ban"), "{v}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn without_a_reply_the_first_request_is_rendered_and_the_script_runs_out() {
    let out = render(&["--harness", repo("harness/default").to_str().unwrap(), "--comment", "hi"], None);
    let v = &lines(&out)[0];
    assert_eq!(v["requests"].as_array().unwrap().len(), 1);
    assert!(v["requests"][0]["completion"].is_null());
    assert_eq!(v["outcome"], "error");
    // The full harness has the blocks the compact one leaves out.
    assert!(v["requests"][0]["prompt"].as_str().unwrap().contains("## Skills"));
}

#[test]
fn a_bad_cases_file_is_an_error_naming_the_line() {
    let out = render(&["--cases", "/dev/stdin"], Some("{\"id\": \"a\", \"comment\": \"hi\"}\nnot json\n"));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/dev/stdin:2") && err.contains("not a render case"), "{err}");
    let none = render(&[], None);
    assert_eq!(none.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&none.stderr).contains("--comment TEXT or --cases FILE"));
}
