//! `nextn agent` as a user runs it: the real binary, `--llm` against an in-process scripted OpenAI-compatible
//! server, the real commerce MCP server; the output contract (`--json`, `--stream`), and the fault matrix:
//! every tool-side or LLM-side fault ends with exit 0, a reply or the fallback, a trace, within the budget.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{commerce_bin, copy_dir};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// A scripted OpenAI-compatible endpoint

enum Canned {
    /// HTTP 200 with this JSON body.
    Json(Value),
    /// HTTP 200 with an SSE stream of these chunks (then `[DONE]`).
    Sse(Vec<Value>),
    /// HTTP 200 with a body that is not JSON.
    Garbage,
    /// Read the request, then never answer.
    Stall,
}

/// Serve `responses` to consecutive POSTs; returns the base URL (`.../v1`) and the request bodies. A GET (the
/// agent asking `/v1/models` which harness the served model declares) gets a 404, as from an OpenAI-compatible
/// server that is not `nextn serve`, and takes no canned response.
fn serve(responses: Vec<Canned>) -> (String, mpsc::Receiver<Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut responses = responses.into_iter();
        loop {
            let Ok((mut stream, _)) = listener.accept() else { return };
            let Some((get, body)) = read_request(&mut stream) else { continue };
            if get {
                let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                continue;
            }
            let Some(canned) = responses.next() else { return };
            let Some(body) = body else { continue };
            let _ = tx.send(body);
            let (ctype, payload) = match canned {
                Canned::Json(v) => ("application/json", v.to_string()),
                Canned::Sse(chunks) => {
                    let mut s: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
                    s.push_str("data: [DONE]\n\n");
                    ("text/event-stream", s)
                }
                Canned::Garbage => ("application/json", "<html>502 upstream exploded</html>".to_string()),
                Canned::Stall => {
                    std::thread::sleep(Duration::from_secs(60));
                    continue;
                }
            };
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                payload.len()
            );
            let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(payload.as_bytes()));
        }
    });
    (url, rx)
}

/// A request's method (whether it is a GET) and its JSON body, if any.
fn read_request(stream: &mut TcpStream) -> Option<(bool, Option<Value>)> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let end = loop {
        let n = stream.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
    let get = head.starts_with("get ");
    let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    while buf.len() < end + len {
        let n = stream.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some((get, serde_json::from_slice(&buf[end..end + len]).ok()))
}

fn completion(content: &str) -> Value {
    json!({
        "id": "cmpl-1", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 20, "total_tokens": 920}
    })
}

fn tool_call(name: &str, args: Value) -> Value {
    json!({
        "id": "cmpl-0", "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": args.to_string()}}]}}],
        "usage": {"prompt_tokens": 900, "completion_tokens": 12, "total_tokens": 912}
    })
}

// ---------------------------------------------------------------------------------------------
// Running the binary

struct Run {
    out: Output,
    wall: Duration,
    trace: Vec<Value>,
}

impl Run {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
    fn json(&self) -> Value {
        serde_json::from_str(self.stdout().trim()).unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}\nstderr: {}", self.stdout(), self.stderr()))
    }
    fn events(&self, kind: &str) -> Vec<&Value> {
        self.trace.iter().filter(|e| e["event"] == kind).collect()
    }
}

fn tmp(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("agent_cli");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

fn nextn(args: &[&str], trace_name: &str) -> Run {
    let trace = tmp(trace_name);
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .arg("--trace")
        .arg(&trace)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run nextn");
    let wall = start.elapsed();
    let trace = std::fs::read_to_string(&trace)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("trace lines are JSON"))
        .collect();
    Run { out, wall, trace }
}

fn shop(flags: &str) -> String {
    format!("shop='{}' {flags}", commerce_bin().display())
}

/// A copy of the bundled harness with a shorter request budget and tool timeout, so stalls end quickly.
fn quick_harness(budget_ms: u64, tool_timeout_ms: u64) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/default");
    let dst = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("harness-{budget_ms}-{tool_timeout_ms}"));
    copy_dir(&src, &dst);
    let path = dst.join("harness.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["request_budget_ms"] = json!(budget_ms);
    cfg["tool_timeout_ms"] = json!(tool_timeout_ms);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    dst
}

const PUFFER_REPLY: &str = "The Quilted Lightweight Puffer Jacket is 459 yuan. It's on screen right now! [show_product:p007]";

// ---------------------------------------------------------------------------------------------
// End to end

#[test]
fn llm_url_tool_call_round_trip_with_actions() {
    let (url, seen) = serve(vec![Canned::Json(tool_call("get_product", json!({"product_id": "p007"}))), Canned::Json(completion(PUFFER_REPLY))]);
    let run = nextn(&["agent", "--comment", "how much is the puffer jacket?", "--llm", &url, "--mcp", &shop(""), "--json"], "round_trip.jsonl");
    assert!(run.out.status.success(), "exit {:?}\n{}", run.out.status, run.stderr());
    let v = run.json();
    assert_eq!(v["outcome"], "replied", "{v}");
    assert_eq!(v["reply"], "The Quilted Lightweight Puffer Jacket is 459 yuan. It's on screen right now!");
    assert_eq!(v["sentences"], json!(["The Quilted Lightweight Puffer Jacket is 459 yuan.", "It's on screen right now!"]));
    assert_eq!(v["actions"][0]["type"], "show_product");
    assert_eq!(v["actions"][0]["product_id"], "p007");
    assert!(v["actions"][0]["link_id"].is_string(), "the product card carries its action link: {v}");
    assert_eq!(v["loops"], 2);
    // The tool ran on the real server and its result went back to the model.
    let calls = run.events("tool_call");
    assert_eq!(calls.len(), 1, "{:?}", run.trace);
    assert_eq!((calls[0]["tool"].as_str(), calls[0]["ok"].as_bool()), (Some("get_product"), Some(true)));
    let first: Value = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    let second: Value = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(first["tools"].as_array().is_some_and(|t| t.iter().any(|t| t["function"]["name"] == "get_product")));
    let tool_msg = second["messages"].as_array().unwrap().iter().find(|m| m["role"] == "tool").expect("a tool message");
    assert!(tool_msg["content"].as_str().unwrap().contains("459"), "{tool_msg}");
    // The room block came from the server's room_status tool.
    assert_eq!(run.events("room").len(), 1);
    assert!(first["messages"][0]["content"].as_str().unwrap().contains("Autumn Layers Live"));
}

#[test]
fn stream_prints_sentences_before_actions_and_summary() {
    let chunks: Vec<Value> = ["The Quilted Lightweight Puffer", " Jacket is 459 yuan.", " It's on screen", " right now! [show_product:p007]"]
        .iter()
        .map(|c| json!({"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": null}]}))
        .chain([json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})])
        .collect();
    let (url, _seen) = serve(vec![Canned::Json(tool_call("get_product", json!({"product_id": "p007"}))), Canned::Sse(chunks)]);
    let run = nextn(&["agent", "--comment", "price of the puffer?", "--llm", &url, "--mcp", &shop(""), "--stream"], "stream.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let lines: Vec<Value> = run.stdout().lines().map(|l| serde_json::from_str(l).expect("JSON lines")).collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[0]["sentence"], "The Quilted Lightweight Puffer Jacket is 459 yuan.");
    assert_eq!(lines[1]["sentence"], "It's on screen right now!");
    assert_eq!(lines[2]["actions"][0]["product_id"], "p007");
    assert_eq!(lines[3]["summary"]["outcome"], "replied");
    assert!(lines[3]["summary"]["time_to_first_sentence_ms"].is_number());
    // The first sentence was released while the reply was still being generated.
    let sentence_t = run.events("sentence")[0]["t_ms"].as_f64().unwrap();
    let generation_end = run.events("generation")[1]["t_ms"].as_f64().unwrap();
    assert!(sentence_t <= generation_end, "first sentence at {sentence_t} ms, generation recorded at {generation_end} ms");
}

#[test]
fn invented_figures_are_retried_then_fall_back() {
    // The model quotes a price no tool returned, twice: retry with feedback naming it, then the fallback.
    let invented = "The puffer is just $27.99 today, down from $24.99!";
    let (url, seen) = serve(vec![Canned::Json(completion(invented)), Canned::Json(completion(invented)), Canned::Json(completion(invented))]);
    let run = nextn(&["agent", "--comment", "how much is the puffer?", "--llm", &url, "--mcp", &shop(""), "--json"], "invented.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let v = run.json();
    assert_ne!(v["reply"], invented, "an invented price never goes out: {v}");
    assert_eq!(v["outcome"], "fallback", "{v}");
    assert!(v["reply"].as_str().is_some_and(|r| !r.is_empty()), "the fallback line is said: {v}");
    let retries: Vec<&Value> = run.events("hook").into_iter().filter(|h| h["hook"] == "grounding").collect();
    assert!(!retries.is_empty(), "the grounding hook fired: {:?}", run.trace);
    let _ = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    let second = seen.recv_timeout(Duration::from_secs(5)).expect("a retry");
    let feedback = second["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_string();
    assert!(feedback.contains("27.99"), "the feedback names the figure: {feedback}");
}

#[test]
fn invented_codes_are_retried_and_a_chinese_viewer_gets_the_chinese_fallback() {
    // A size label no tool listed ("4XL"): retried with feedback naming it, then the fallback, in the language the
    // viewer wrote in.
    let invented = "这款有Black、Heather Grey 4XL码。";
    let (url, seen) = serve(vec![Canned::Json(completion(invented)), Canned::Json(completion(invented)), Canned::Json(completion(invented))]);
    let run = nextn(&["agent", "--comment", "这件羽绒服有什么尺码", "--llm", &url, "--mcp", &shop(""), "--json"], "invented-code.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let v = run.json();
    assert_eq!(v["outcome"], "fallback", "{v}");
    assert_eq!(v["reply"], nextn_agent::agent::FALLBACK_REPLY_ZH, "{v}");
    let _ = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    let second = seen.recv_timeout(Duration::from_secs(5)).expect("a retry");
    let feedback = second["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_string();
    assert!(feedback.contains("\"4XL\""), "the feedback names the code: {feedback}");
}

#[test]
fn the_harness_limits_are_no_evidence_for_a_figure() {
    // harness/live-tiny's Limits block says "Reply in at most 120 characters"; a fee of 120 that no tool
    // returned must still be retried (it once went out: the limit's number counted as evidence).
    let live_tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/live-tiny");
    let invented = "Tonight you can use LIVE20, and shipping to International is 120 yuan.";
    let (url, seen) = serve(vec![
        Canned::Json(tool_call("list_promotions", json!({}))),
        Canned::Json(completion(invented)),
        Canned::Json(completion(invented)),
        Canned::Json(completion(invented)),
    ]);
    let args = ["agent", "--comment", "any codes tonight?", "--llm", &url, "--mcp", &shop(""), "--harness", live_tiny.to_str().unwrap(), "--json"];
    let run = nextn(&args, "limits-evidence.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let v = run.json();
    assert_ne!(v["reply"], invented, "an invented fee never goes out: {v}");
    let first: Value = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    let system = first["messages"][0]["content"].as_str().unwrap();
    assert!(system.contains("at most 120 characters"), "the limit is in the prompt: {system}");
    let retried = run.events("hook").into_iter().any(|h| h["hook"] == "grounding" && h["decision"] == "retry");
    assert!(retried, "the grounding hook retried the fee: {:?}", run.trace);
}

#[test]
fn grounded_reply_passes_unchanged() {
    let (url, _seen) = serve(vec![Canned::Json(tool_call("get_product", json!({"product_id": "p007"}))), Canned::Json(completion(PUFFER_REPLY))]);
    let run = nextn(&["agent", "--comment", "puffer price?", "--llm", &url, "--mcp", &shop(""), "--json"], "grounded.jsonl");
    let v = run.json();
    assert_eq!(v["outcome"], "replied");
    assert_eq!(v["loops"], 2, "no retry: {:?}", run.trace);
    assert!(run.events("hook").iter().all(|h| h["decision"] != "retry"), "{:?}", run.trace);
}

// ---------------------------------------------------------------------------------------------
// Fault matrix

struct Case {
    name: &'static str,
    mcp: String,
    llm: Vec<Canned>,
    /// `None`: the URL points at a closed port.
    refused: bool,
    outcome: &'static str,
    fault_stage: &'static str,
}

#[test]
fn fault_matrix_degrades_never_dies() {
    const BUDGET_MS: u64 = 4000;
    let harness = quick_harness(BUDGET_MS, 1000);
    let closed_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let ask = || vec![Canned::Json(tool_call("get_product", json!({"product_id": "p007"}))), Canned::Json(completion("Let me check that and come right back to you."))];
    let cases = vec![
        Case { name: "server won't start", mcp: "shop=/nonexistent/commerce-server".into(), llm: vec![Canned::Json(completion("Hi there, welcome to the stream!"))], refused: false, outcome: "replied", fault_stage: "mcp_connect" },
        Case { name: "handshake hangs", mcp: "shop=sleep 30".into(), llm: vec![Canned::Json(completion("Hi there, welcome to the stream!"))], refused: false, outcome: "replied", fault_stage: "mcp_connect" },
        Case { name: "slow tool", mcp: shop("--slow-tool get_product:3000"), llm: ask(), refused: false, outcome: "replied", fault_stage: "tool" },
        Case { name: "crash mid-call", mcp: shop("--crash-on get_product"), llm: ask(), refused: false, outcome: "replied", fault_stage: "tool" },
        Case { name: "isError", mcp: shop("--error-on get_product"), llm: ask(), refused: false, outcome: "replied", fault_stage: "tool" },
        Case { name: "malformed result", mcp: shop("--malformed-on get_product"), llm: ask(), refused: false, outcome: "replied", fault_stage: "tool" },
        Case { name: "LLM refused", mcp: shop(""), llm: vec![], refused: true, outcome: "error", fault_stage: "llm" },
        Case { name: "LLM stalls", mcp: shop(""), llm: vec![Canned::Stall], refused: false, outcome: "timeout", fault_stage: "llm" },
        Case { name: "LLM garbage", mcp: shop(""), llm: vec![Canned::Garbage], refused: false, outcome: "error", fault_stage: "llm" },
    ];
    let mut table = vec![format!("| fault | exit | outcome | wall (ms) | fault recorded |"), "|---|---|---|---|---|".to_string()];
    for case in cases {
        let url = if case.refused { format!("http://127.0.0.1:{closed_port}/v1") } else { serve(case.llm).0 };
        let run = nextn(
            &["agent", "--comment", "how much is the puffer?", "--llm", &url, "--mcp", &case.mcp, "--harness", harness.to_str().unwrap(), "--json"],
            &format!("fault-{}.jsonl", case.name.replace(' ', "_")),
        );
        let name = case.name;
        assert_eq!(run.out.status.code(), Some(0), "{name}: {}", run.stderr());
        assert!(!run.stderr().contains("panicked"), "{name}: {}", run.stderr());
        let v = run.json();
        assert_eq!(v["outcome"], case.outcome, "{name}: {v}");
        assert!(v["reply"].as_str().is_some_and(|r| !r.is_empty()), "{name}: a reply or the fallback: {v}");
        let kinds: Vec<&str> = run.trace.iter().filter_map(|e| e["event"].as_str()).collect();
        assert!(kinds.first() == Some(&"start") && kinds.ends_with(&["reply", "timing"]), "{name}: a whole trace: {kinds:?}");
        let faults = run.events("fault");
        let recorded = faults.iter().find(|f| f["stage"] == case.fault_stage);
        assert!(recorded.is_some(), "{name}: a `{}` fault in the trace: {faults:?}", case.fault_stage);
        if case.fault_stage == "llm" {
            assert!(recorded.unwrap()["error"].as_str().unwrap().contains("127.0.0.1"), "{name}: the error names the URL: {faults:?}");
        }
        let limit = Duration::from_millis(BUDGET_MS + 1000);
        assert!(run.wall <= limit, "{name}: {} ms > budget + 1 s", run.wall.as_millis());
        table.push(format!("| {name} | 0 | {} | {} | {} |", case.outcome, run.wall.as_millis(), case.fault_stage));
    }
    eprintln!("{}", table.join("\n"));
}

/// A reader that closes stdout early (`| head -c 10`) ends the run quietly: exit 0, no panic.
#[test]
fn a_closed_stdout_is_not_a_panic() {
    let (url, _) = serve(vec![Canned::Json(completion("Hi there, welcome to the stream!"))]);
    let (code, err) = nextn_into_a_closed_pipe(&["agent", "--comment", "hi", "--llm", &url, "--mcp", &shop(""), "--json"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Runs `nextn args` with its stdout closed before it writes: its exit code and stderr.
fn nextn_into_a_closed_pipe(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `nextn logits` streams its JSON through a buffered writer (not `outln!`): a closed pipe there too is exit 0
/// with nothing on stderr, not "error: Broken pipe" and exit 1.
#[test]
fn logits_into_a_closed_pipe_is_a_quiet_success() {
    let (code, err) = nextn_into_a_closed_pipe(&["logits", "--prompt-ids", "1,2,3,4,5,6,7,8", "--threads", "1"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("error") && !err.contains("panicked"), "{err}");
}

/// Without `--json`, stdout is the reply alone; when that reply is the fallback line, stderr says which outcome
/// sent it and the first fault, so a wrong `--llm` URL is not a silent success.
#[test]
fn a_fallback_in_plain_mode_says_why_on_stderr() {
    let closed_port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{closed_port}/v1");
    let run = nextn(&["agent", "--comment", "how much is the puffer?", "--llm", &url, "--mcp", &shop("")], "plain-fallback.jsonl");
    assert_eq!(run.out.status.code(), Some(0), "{}", run.stderr());
    let stdout = String::from_utf8_lossy(&run.out.stdout);
    assert_eq!(stdout.trim(), "Thanks for asking! Let me double-check that for you and come right back.");
    let err = run.stderr();
    assert!(err.contains("(error: the harness fallback line was sent: cannot reach the LLM server at http://127.0.0.1:"), "{err}");
    // A reply that is not the fallback: nothing on stderr.
    let (url, _) = serve(vec![Canned::Json(completion("Hi there, welcome to the stream!"))]);
    let run = nextn(&["agent", "--comment", "hi", "--llm", &url, "--mcp", &shop("")], "plain-replied.jsonl");
    assert_eq!(String::from_utf8_lossy(&run.out.stdout).trim(), "Hi there, welcome to the stream!");
    assert!(run.stderr().trim().is_empty(), "{}", run.stderr());
}

// ---------------------------------------------------------------------------------------------
// Which harness

/// The bundled model runs with the profile it declares (models/nextn-live-tiny/nextn.json → harness/live-tiny)
/// unless --harness says otherwise; `--json` names the directory used.
#[test]
fn bundled_model_uses_its_declared_harness_unless_harness_is_given() {
    let base = ["agent", "--comment", "hi there!", "--mcp", &shop(""), "--max-tokens", "8", "--json"];
    let run = nextn(&base, "profile.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let v = run.json();
    let used = v["harness"].as_str().unwrap_or_else(|| panic!("`harness` in --json: {v}"));
    assert!(Path::new(used).ends_with("harness/live-tiny"), "{v}");
    assert!(v["harness_version"].is_string(), "{v}");

    let default = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/default");
    let mut args = base.to_vec();
    args.extend(["--harness", default.to_str().unwrap()]);
    let run = nextn(&args, "profile-flag.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let w = run.json();
    assert_eq!(w["harness"], default.to_str().unwrap(), "--harness wins: {w}");
    assert_ne!(w["harness_version"], v["harness_version"], "another harness, another version");
}

#[test]
fn llm_url_defaults_to_harness_default() {
    let (url, _seen) = serve(vec![Canned::Json(completion("Hi there, welcome to the stream!"))]);
    let run = nextn(&["agent", "--comment", "hi", "--llm", &url, "--mcp", &shop(""), "--json"], "profile-url.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let v = run.json();
    assert!(v["harness"].as_str().is_some_and(|h| Path::new(h).ends_with("harness/default")), "{v}");
}

#[test]
fn caller_mistakes_exit_1() {
    let run = nextn(&["agent", "--comment", "hi", "--harness", "/nonexistent/harness", "--llm", "http://127.0.0.1:9/v1"], "mistake1.jsonl");
    assert_eq!(run.out.status.code(), Some(1), "{}", run.stderr());
    assert!(run.stderr().contains("/nonexistent/harness"), "{}", run.stderr());
    let run = nextn(&["agent", "--comment", "hi", "--no-such-flag"], "mistake2.jsonl");
    assert_eq!(run.out.status.code(), Some(1), "{}", run.stderr());
}

#[test]
fn history_and_room_take_a_file_or_inline_json() {
    let history = r#"[{"role": "user", "content": "do you sell the puffer?"}, {"role": "assistant", "content": "Yes, the puffer is on screen."}]"#;
    let room = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/tests/fixtures/room.json")).unwrap();
    let history_file = tmp("history.json");
    std::fs::write(&history_file, history).unwrap();
    let room_file = tmp("room.json");
    std::fs::write(&room_file, &room).unwrap();
    for (h, r) in [(history.to_string(), room.clone()), (history_file.display().to_string(), room_file.display().to_string())] {
        let (url, seen) = serve(vec![Canned::Json(completion("Yes!"))]);
        let run = nextn(&["agent", "--comment", "and in red?", "--history", &h, "--room", &r, "--llm", &url, "--mcp", &shop(""), "--json"], "inline.jsonl");
        assert!(run.out.status.success(), "{}", run.stderr());
        let sent: Value = seen.recv_timeout(Duration::from_secs(5)).unwrap();
        let messages = sent["messages"].as_array().unwrap();
        assert!(messages.iter().any(|m| m["content"] == "do you sell the puffer?"), "{messages:?}");
        // The room block came from the argument, not from the server's room_status tool.
        let system = messages[0]["content"].as_str().unwrap();
        assert!(system.contains("Summer linen week") && !system.contains("Autumn Layers Live"), "{system}");
    }
    // A missing file or bad JSON is the caller's mistake: exit 1, naming the flag.
    let mistakes = [
        (["--room", "/nonexistent/room.json"], "--room: reading /nonexistent/room.json"),
        (["--room", "{\"room\": oops}"], "--room (inline JSON)"),
        (["--history", "[{\"role\": \"user\"}]"], "--history (inline JSON): message 0 needs string `role` and `content`"),
    ];
    for (flags, want) in mistakes {
        let mut args = vec!["agent", "--comment", "hi", "--llm", "http://127.0.0.1:9/v1"];
        args.extend(flags);
        let run = nextn(&args, "mistake3.jsonl");
        assert_eq!(run.out.status.code(), Some(1), "{}", run.stderr());
        assert!(run.stderr().contains(want), "{flags:?}: {}", run.stderr());
        assert!(!run.stderr().contains("harness directory"), "{}", run.stderr());
    }
}

#[test]
fn blocked_comment_has_null_reply_and_no_sentences() {
    let (url, _seen) = serve(vec![]);
    let run = nextn(&["agent", "--comment", "   ", "--llm", &url, "--mcp", &shop(""), "--stream"], "blocked.jsonl");
    assert!(run.out.status.success(), "{}", run.stderr());
    let lines: Vec<Value> = run.stdout().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "no sentence lines: {lines:?}");
    assert_eq!(lines[0]["actions"], json!([]));
    assert_eq!(lines[1]["summary"]["outcome"], "blocked");
    assert_eq!(lines[1]["summary"]["reply"], Value::Null);
}

#[test]
fn harness_check_and_the_agent_agree_on_every_broken_fixture() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/tests/fixtures/broken");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&fixtures).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "{dirs:?}");
    let (url, _seen) = serve((0..dirs.len()).map(|_| Canned::Json(completion("Hi there, welcome to the stream!"))).collect());
    for dir in dirs {
        let d = dir.to_str().unwrap();
        let check = Command::new(env!("CARGO_BIN_EXE_nextn")).args(["harness", "check", d, "--offline"]).output().unwrap();
        let run = nextn(&["agent", "--comment", "hi", "--harness", d, "--llm", &url, "--mcp", &shop(""), "--json"], "broken.jsonl");
        let (check_ok, agent_ok) = (check.status.success(), run.out.status.success());
        assert_eq!(check_ok, agent_ok, "{d}: check {:?} vs agent {:?}\ncheck: {}\nagent: {}", check.status, run.out.status, String::from_utf8_lossy(&check.stdout), run.stderr());
        if !agent_ok {
            assert_eq!(run.out.status.code(), Some(1), "{d}: a broken harness is the caller's mistake");
        }
    }
}
