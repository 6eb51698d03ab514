//! `nextn-bench replay` end to end against a scripted OpenAI-compatible endpoint (a raw tokio HTTP server
//! returning known tool calls, then replies) and the commerce MCP server served in process: the quality
//! numbers are exactly those the script implies, concurrency 2 overlaps requests, warm-up is excluded,
//! and the judge's verdicts come back through `harness/judge`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nextn_bench::replay::cases::parse_cases;
use nextn_bench::replay::judge::Judge;
use nextn_bench::replay::run::{self, LlmTarget, ReplayConfig, SpecMode};
use nextn_bench::replay::{compare, judge_records, report, variants};
use nextn_commerce_mcp::{Catalog, CommerceServer, Faults, default_data_path};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// What the scripted model does for one comment: these tool calls first (one turn), then this reply.
struct Script {
    calls: Vec<(&'static str, Value)>,
    reply: &'static str,
}

/// The cases: one warm-up, then four measured ones whose scores the scripts decide.
const CASES: &str = r#"
{"id":"w","category":"greeting","comment":"hi all","expect":{"language":"en","no_tool":true}}
{"id":"price","category":"product_facts","comment":"how much is the crew tee?","expect":{"tools":[{"name":"get_product","args":{"product_id":["p001","Classic Crew Tee"]}}],"facts":[79],"language":"en"}}
{"id":"stock","category":"stock_size","comment":"charcoal hoodie in L?","expect":{"tools":[{"name":"check_stock","args":{"product_id":"p002","colour":"Charcoal","size":"L"}}],"facts":[5],"language":"en"}}
{"id":"multi","category":"multi_intent","comment":"check white sneakers 37 then the coupon","expect":{"tools":[{"name":"check_stock","args":{"product_id":"p009","size":"37"}},{"name":"list_promotions","args":{}}],"tool_order":true,"facts":[4],"language":"en"}}
{"id":"hello","category":"greeting","comment":"hello host!","expect":{"language":"en","no_tool":true}}
{"id":"deal","category":"promotions","comment":"any deal on the puffer?","expect":{"tools":[{"name":"list_promotions","args":{}}],"facts":[20],"language":"en"}}
"#;

fn scripts() -> HashMap<&'static str, Script> {
    HashMap::from([
        ("hi all", Script { calls: vec![], reply: "Hi, welcome to the room!" }),
        // TC 1, RC 1, grounded.
        ("how much is the crew tee?", Script { calls: vec![("get_product", json!({"product_id": "p001"}))], reply: "The Classic Crew Tee is ¥79.00 today." }),
        // Wrong size: TC 0; 21 is what the tool said for M, so grounded, but the fact 5 is missing: RC 0.
        ("charcoal hoodie in L?", Script {
            calls: vec![("check_stock", json!({"product_id": "p002", "colour": "Charcoal", "size": "M"}))],
            reply: "We have 21 of those left!",
        }),
        // Both tools but in the wrong order: TC 1, TCO 0; RC 1; 87 is invented: a grounding violation.
        ("check white sneakers 37 then the coupon", Script {
            calls: vec![("list_promotions", json!({})), ("check_stock", json!({"product_id": "p009", "colour": "White", "size": "37"}))],
            reply: "Only 4 left in white 37, and it ships within 87 hours!",
        }),
        // An invented discount: the invented_discount hook retries, then blocks (a deliberate fallback, so
        // still a success); TC 1, RC 0 (the fallback has no 20).
        ("any deal on the puffer?", Script { calls: vec![("list_promotions", json!({"product_id": "p007"}))], reply: "Take 87% off tonight!" }),
        // A no-tool case that calls a tool: TC 0.
        ("hello host!", Script { calls: vec![("room_status", json!({}))], reply: "Hello and welcome!" }),
    ])
}

fn completion(message: Value) -> Value {
    json!({
        "id": "cmpl-1", "object": "chat.completion", "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
    })
}

/// Names a perturbed harness shows for a real tool (real name → names), filled by the variant test: the
/// scripted model follows the *current* harness's tool list, as a model that reads its prompt would.
static RENAMES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// The name under which the request's tool list offers the real tool `real`.
fn shown_name(body: &Value, real: &str) -> String {
    let offered: Vec<&str> = body["tools"].as_array().into_iter().flatten().filter_map(|t| t["function"]["name"].as_str()).collect();
    let renames = RENAMES.lock().unwrap_or_else(|p| p.into_inner());
    offered
        .iter()
        .find(|n| **n == real || renames.iter().any(|(r, s)| r == real && s == *n))
        .map_or_else(|| real.to_string(), |n| n.to_string())
}

/// The scripted model's answer to one chat-completions body.
fn answer(body: &Value, scripts: &HashMap<&'static str, Script>) -> Value {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    let system = messages.first().and_then(|m| m["content"].as_str()).unwrap_or("");
    let last = messages.last().cloned().unwrap_or(Value::Null);
    if system.contains("quality judge") {
        // The judge: an invented discount is inaccurate and half effective; everything else scores 1/1.
        let input = last["content"].as_str().unwrap_or("");
        let verdict = if input.contains("87 hours") {
            r#"{"accuracy": 0, "effectiveness": 0.5, "reason": "invented discount"}"#
        } else {
            r#"```json
{"accuracy": 1, "effectiveness": 1, "reason": "ok"}
```"#
        };
        return completion(json!({"role": "assistant", "content": verdict}));
    }
    // The viewer's comment is the first user message (later ones are hook feedback).
    let comment = messages.iter().find(|m| m["role"] == "user").and_then(|m| m["content"].as_str()).unwrap_or("");
    let Some(script) = scripts.get(comment) else {
        return completion(json!({"role": "assistant", "content": format!("no script for {comment:?}")}));
    };
    let called = messages.iter().any(|m| m["role"] == "tool");
    if !called && !script.calls.is_empty() {
        let calls: Vec<Value> = script
            .calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| json!({"id": format!("c{i}"), "type": "function", "function": {"name": shown_name(body, name), "arguments": args.to_string()}}))
            .collect();
        return completion(json!({"role": "assistant", "content": "", "tool_calls": calls}));
    }
    completion(json!({"role": "assistant", "content": script.reply}))
}

/// A minimal HTTP/1.1 server: POST bodies in, `answer` out after `delay` (so concurrent requests overlap).
async fn scripted_endpoint(delay: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let scripts = Arc::new(scripts());
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else { return };
            let scripts = Arc::clone(&scripts);
            tokio::spawn(async move {
                let (read, mut write) = sock.into_split();
                let mut reader = BufReader::new(read);
                loop {
                    let mut len = 0usize;
                    let mut line = String::new();
                    // Request line and headers.
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let l = line.trim_end();
                        if l.is_empty() {
                            break;
                        }
                        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0u8; len];
                    if reader.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    tokio::time::sleep(delay).await;
                    let out = answer(&req, &scripts).to_string();
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", out.len());
                    if write.write_all(head.as_bytes()).await.is_err() || write.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

struct Servers {
    runtime: tokio::runtime::Runtime,
    llm: String,
    mcp: String,
}

fn servers(delay: Duration) -> Servers {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (llm, mcp) = runtime.block_on(async {
        let llm = scripted_endpoint(delay).await;
        let catalog = Catalog::load(&default_data_path()).unwrap();
        let http = nextn_commerce_mcp::http::serve_http(CommerceServer::new(catalog, Faults::default()), "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let url = http.url();
        std::mem::forget(http); // serves until the runtime drops
        (format!("http://{llm}"), url)
    });
    Servers { runtime, llm, mcp }
}

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// The bundled harness with the agent's `grounding` hook off, so the invented figure in the "multi" script
/// reaches the reply and the replay's own grounding metric has something to find.
fn harness_without_grounding() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dst = std::env::temp_dir().join(format!("nextn-replay-harness-{}-{n}", std::process::id()));
    copy_dir(&repo("harness/default"), &dst);
    let path = dst.join("hooks.json");
    let mut hooks: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    hooks["builtins"]["grounding"]["enabled"] = json!(false);
    std::fs::write(&path, hooks.to_string()).unwrap();
    dst
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}

fn config(s: &Servers, concurrency: Vec<usize>) -> ReplayConfig {
    ReplayConfig {
        cases: parse_cases(CASES, Path::new("test")).unwrap(),
        concurrency,
        spec: vec![SpecMode::Off, SpecMode::Mtp],
        draft_steps: 3,
        draft_vocab: None,
        warmup: 1,
        llm: LlmTarget::Url { base_url: s.llm.clone(), model: "scripted".into() },
        harness_dir: harness_without_grounding(),
        mcp: vec![format!("commerce={}", s.mcp)],
        seed: 0,
        temperature: 1.0,
        top_p: 0.95,
        max_tokens: 64,
    }
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nextn-replay-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn scripted_replay_gives_exactly_the_expected_quality_and_excludes_warmup() {
    let s = servers(Duration::from_millis(5));
    let cfg = config(&s, vec![1]);
    let records = run::replay(&cfg, |_| {}).unwrap();
    assert_eq!(records.len(), 6);
    assert!(records.iter().all(|r| r.success && r.spec == "remote"), "{records:#?}");
    assert!(records.iter().all(|r| (r.outcome == "replied") == (r.id != "deal")), "{records:#?}");
    let by_id = |id: &str| records.iter().find(|r| r.id == id).unwrap();
    let q = |id: &str| by_id(id).quality.clone();
    assert_eq!((q("price").tc, q("price").rc, q("price").grounding_violations.len()), (Some(1.0), Some(1.0), 0));
    assert_eq!((q("stock").tc, q("stock").rc), (Some(0.0), Some(0.0)));
    assert!(q("stock").grounding_violations.is_empty(), "21 came from the tool: {:?}", q("stock"));
    assert_eq!((q("multi").tc, q("multi").tco, q("multi").rc), (Some(1.0), Some(0.0), Some(1.0)));
    assert_eq!(q("multi").grounding_violations, vec!["87".to_string()]);
    assert_eq!((q("hello").tc, q("hello").rc), (Some(0.0), None));
    assert_eq!((q("deal").tc, q("deal").rc), (Some(1.0), Some(0.0)));
    assert!(q("deal").rule_violations.get("invented_discount").is_some_and(|&n| n >= 1), "{:?}", q("deal"));
    assert_eq!(by_id("deal").outcome, "fallback", "the invented discount never goes out: the fallback does");
    assert_eq!(by_id("multi").loops, 2);
    assert_eq!(by_id("multi").tool_calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["list_promotions", "check_stock"]);
    assert!(by_id("w").warmup && !by_id("price").warmup);

    let summary = report::summarize(&records);
    assert_eq!(summary.warmup_excluded, 1);
    let g = &summary.groups[0];
    assert_eq!((g.concurrency, g.spec.as_str(), g.n), (1, "remote", 5));
    assert_eq!(g.quality.tc, Some(0.6));
    assert_eq!(g.quality.tco, Some(0.0));
    assert_eq!(g.quality.rc, Some(0.5));
    assert_eq!(g.quality.grounding_violation_rate, 0.2);
    assert!(g.quality.rule_violations_per_case > 0.0);
    assert_eq!(g.quality.language_match, Some(1.0));
    assert_eq!((g.success_rate, g.attainment_15s), (1.0, 1.0));
    assert_eq!(g.quality_by_category["greeting"].n, 1, "the warm-up greeting is not counted");
    assert!(g.latency_ms.p50 > 0.0 && g.latency_ms.p99 >= g.latency_ms.p50);

    // The judge over the same endpoint: the invented delivery time scores (0 + 0.5) / 2, the rest 1.
    let mut judge = Judge::new(&repo("harness/judge"), &s.llm, "scripted").unwrap();
    let mut records = records;
    let errors = judge_records(&mut judge, &cfg, &mut records);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(records.iter().find(|r| r.id == "w").unwrap().judge.is_none(), "warm-up is not judged");
    assert_eq!(records.iter().find(|r| r.id == "multi").unwrap().judge.as_ref().unwrap().avg, 0.25);
    let summary = report::summarize(&records);
    assert_eq!(summary.groups[0].quality.judge_avg, Some((0.25 + 4.0) / 5.0));
    drop(s.runtime);
}

#[test]
fn concurrency_two_overlaps_requests_in_the_json_lines() {
    let s = servers(Duration::from_millis(150));
    let cfg = config(&s, vec![1, 2]);
    let records = run::replay(&cfg, |_| {}).unwrap();
    let dir = out_dir("overlap");
    let summary = report::summarize(&records);
    report::write_outputs(&dir, &records, &summary).unwrap();
    for f in ["requests.jsonl", "summary.json", "summary.md", "latency_cdf.svg", "stages.svg"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    assert!(std::fs::read_to_string(dir.join("latency_cdf.svg")).unwrap().contains("<svg"));
    let lines: Vec<Value> = std::fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12);
    let spans = |c: u64| -> Vec<(f64, f64)> {
        lines
            .iter()
            .filter(|l| l["concurrency"] == c && l["warmup"] == false)
            .map(|l| (l["start_ms"].as_f64().unwrap(), l["end_ms"].as_f64().unwrap()))
            .collect()
    };
    let overlapping = |v: &[(f64, f64)]| {
        let mut n = 0;
        for i in 0..v.len() {
            for j in i + 1..v.len() {
                if v[i].0 < v[j].1 && v[j].0 < v[i].1 {
                    n += 1;
                }
            }
        }
        n
    };
    assert_eq!(overlapping(&spans(1)), 0, "concurrency 1 runs one at a time: {:?}", spans(1));
    assert!(overlapping(&spans(2)) >= 2, "concurrency 2 keeps two in flight: {:?}", spans(2));
    let g2 = summary.groups.iter().find(|g| g.concurrency == 2).unwrap();
    assert_eq!(g2.n, 5);
    let _ = std::fs::remove_dir_all(&dir);
    drop(s.runtime);
}

#[derive(clap::Parser)]
struct ReplayCli {
    #[command(flatten)]
    replay: nextn_bench::replay::ReplayArgs,
}

/// `nextn-bench replay` arguments on the bundled cases and model, with an MCP spec that is never started.
fn replay_config(extra: &[&str]) -> ReplayConfig {
    use clap::Parser;
    let (cases, model) = (repo("bench/data/live_cases.jsonl"), repo("models/nextn-live-tiny"));
    let mut argv = vec!["replay", "--cases", cases.to_str().unwrap(), "--model", model.to_str().unwrap(), "--mcp", "unused"];
    argv.extend(extra);
    nextn_bench::replay::config(&ReplayCli::parse_from(argv).replay).unwrap()
}

#[test]
fn harness_is_the_local_models_profile_unless_given_or_remote() {
    let local = replay_config(&[]);
    assert!(local.harness_dir.ends_with("harness/live-tiny"), "the bundled model's nextn.json: {}", local.harness_dir.display());
    let remote = replay_config(&["--llm", "http://127.0.0.1:9/v1"]);
    assert!(remote.harness_dir.ends_with("harness/default"), "an endpoint declares nothing: {}", remote.harness_dir.display());
    let default = repo("harness/default");
    let given = replay_config(&["--harness", default.to_str().unwrap()]);
    assert_eq!(given.harness_dir, default, "--harness wins");

    // The summary records the harness it ran with.
    let mut summary = report::summarize(&[]);
    summary.harness = Some(report::ReplayHarness { dir: local.harness_dir.display().to_string(), version: "0123456789abcdef".into() });
    let json = serde_json::to_value(&summary).unwrap();
    assert_eq!(json["harness"]["dir"], local.harness_dir.display().to_string());
    assert!(report::markdown(&summary).contains("0123456789abcdef"));
}

/// `--device`: the local engine's device reaches the config (cpu by default), an endpoint refuses one (it picks its
/// own), and the summary names it.
#[test]
fn device_reaches_the_local_engine_and_the_summary() {
    use nextn_engine::Device;
    let device_of = |cfg: ReplayConfig| match cfg.llm {
        LlmTarget::Local { device, .. } => device,
        LlmTarget::Url { .. } => panic!("a local replay"),
    };
    assert_eq!(device_of(replay_config(&[])), Device::Cpu);
    assert_eq!(device_of(replay_config(&["--device", "cuda:1"])), Device::Cuda(1));
    use clap::Parser;
    let cases = repo("bench/data/live_cases.jsonl");
    let argv = ["replay", "--cases", cases.to_str().unwrap(), "--llm", "http://127.0.0.1:9/v1", "--device", "cuda", "--mcp", "unused"];
    let err = nextn_bench::replay::config(&ReplayCli::parse_from(argv).replay).unwrap_err().to_string();
    assert!(err.contains("--device cuda:0") && err.contains("--llm local"), "{err}");
    assert!(ReplayCli::try_parse_from(["replay", "--device", "gpu"]).is_err(), "an unknown device is refused");

    let mut summary = report::summarize(&[]);
    assert!(serde_json::to_value(&summary).unwrap().get("device").is_none(), "no device is named for an endpoint");
    summary.device = Some("cuda:0".into());
    assert_eq!(serde_json::to_value(&summary).unwrap()["device"], "cuda:0");
    assert!(report::markdown(&summary).contains("Engine device: `cuda:0`"));
}

/// `--harness-variants`: with a model that follows the current tool names, every variant — all dimensions, and
/// each dimension alone — scores the same tool correctness, order, coverage and language as the original (the
/// calls are judged by the real tool they resolved to), so every one of those gaps is 0; the variants are real
/// (they pass check, renamed tools the cases need, and changed content hashes).
#[test]
fn harness_variants_keep_the_task_for_a_model_that_follows_the_current_names() {
    let s = servers(Duration::from_millis(1));
    let cfg = config(&s, vec![1]);
    let version = nextn_harness::content_hash(&cfg.harness_dir).unwrap();
    let tools = variants::discover_tools(&cfg).unwrap();
    assert!(tools.iter().any(|t| t.name == "get_product"), "{tools:?}");
    let root = out_dir("variants");
    let plan = variants::plan(2, 7, 0.5);
    let made = variants::generate(&cfg.harness_dir, &root, &plan, &tools).unwrap();
    let mut renamed_needed = Vec::new();
    for (v, dir, changes) in &made {
        assert!(*changes > 0, "{}", v.label);
        assert!(!nextn_harness::has_errors(&nextn_harness::check(dir)), "{} fails check", v.label);
        let h = nextn_harness::Harness::load(dir).unwrap();
        for (key, o) in h.tools_config().entries() {
            if let Some(new) = o.rename {
                if ["get_product", "check_stock", "list_promotions"].contains(&key.as_str()) {
                    renamed_needed.push(format!("{}: {key} → {new}", v.label));
                }
                RENAMES.lock().unwrap().push((key, new));
            }
        }
    }
    assert!(!renamed_needed.is_empty(), "no variant renamed a tool the cases need: the test would not test renames");

    let records = run::replay(&cfg, |_| {}).unwrap();
    let summary = variants::evaluate(&cfg, &records, &version, &made, |_, _| {}, |_, _| {}).unwrap();
    let labels: Vec<&str> = summary.harnesses.iter().map(|h| h.label.as_str()).collect();
    assert_eq!(labels, ["original", "all-1", "all-2", "skill-id", "skill-content", "tool-def", "prompt", "hook"]);
    let base = &summary.harnesses[0];
    assert_eq!((base.version.as_str(), base.quality.n, base.quality.tc), (version.as_str(), 5, Some(0.6)));
    for h in &summary.harnesses[1..] {
        assert_ne!(h.version, base.version, "{}", h.label);
        let (q, b) = (&h.quality, &base.quality);
        assert_eq!((q.n, q.tc, q.tco, q.rc, q.language_match), (b.n, b.tc, b.tco, b.rc, b.language_match), "{}: {renamed_needed:?}", h.label);
        assert_eq!(h.quality_by_category.keys().collect::<Vec<_>>(), base.quality_by_category.keys().collect::<Vec<_>>());
    }
    assert_eq!((summary.gap.tc, summary.gap.tco, summary.gap.rc), (Some(0.0), Some(0.0), Some(0.0)));
    let dims: Vec<&str> = summary.per_dimension.iter().map(|d| d.dimension.name()).collect();
    assert_eq!(dims, ["skill-id", "skill-content", "tool-def", "prompt", "hook"]);
    assert!(summary.per_dimension.iter().all(|d| d.gap.tc == Some(0.0)));

    let mut s2 = report::summarize(&records);
    s2.harness_variants = Some(summary);
    let md = report::markdown(&s2);
    assert!(md.contains("Original − variant") && md.contains("| tool-def |"), "{md}");
    let json = serde_json::to_value(&s2).unwrap();
    assert_eq!(json["harness_variants"]["harnesses"].as_array().unwrap().len(), 8);
    RENAMES.lock().unwrap().clear();
    let _ = std::fs::remove_dir_all(&root);
    drop(s.runtime);
}

#[derive(clap::Parser)]
struct CompareCli {
    #[command(flatten)]
    compare: compare::CompareArgs,
}

/// `nextn-bench compare`: the same harness twice changes nothing (revise); turning the invented-discount hook
/// off lets "Take 87% off" through on the deal case (an ungrounded figure: that case's score drops), so B vs A
/// is a rollback listing that case as regressed, and A vs B the mirror image, a promote. Both hashes recorded.
#[test]
fn compare_pairs_cases_and_recommends_by_the_rule() {
    use clap::Parser;
    let s = servers(Duration::from_millis(1));
    let mut cfg = config(&s, vec![1]);
    cfg.warmup = 0;
    let a = cfg.harness_dir.clone();
    let b = harness_without_grounding();
    let path = b.join("hooks.json");
    let mut hooks: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    hooks["builtins"]["invented_discount"]["enabled"] = json!(false);
    std::fs::write(&path, hooks.to_string()).unwrap();
    let args = |x: &Path, y: &Path| {
        CompareCli::parse_from(["compare", x.to_str().unwrap(), y.to_str().unwrap(), "--quiet"]).compare
    };

    let same = compare::run_compare(&args(&a, &a), &cfg).unwrap();
    assert_eq!((same.delta, same.recommendation), (0.0, compare::Recommendation::Revise));
    assert!(same.new_regressions.is_empty() && same.changed.is_empty());
    assert_eq!(same.a.version, nextn_harness::content_hash(&a).unwrap());
    assert_eq!(same.cases, 6);

    let worse = compare::run_compare(&args(&a, &b), &cfg).unwrap();
    assert_eq!(worse.b.version, nextn_harness::content_hash(&b).unwrap());
    assert_ne!(worse.a.version, worse.b.version);
    assert!(worse.delta < 0.0, "{worse:#?}");
    assert_eq!(worse.recommendation, compare::Recommendation::Rollback);
    let changed: Vec<&str> = worse.changed.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(changed, ["deal"], "{worse:#?}");
    let promos = worse.categories.iter().find(|c| c.category == "promotions").unwrap();
    assert_eq!((promos.regressed.clone(), promos.improved.len()), (vec!["deal".to_string()], 0));
    assert!(worse.categories.iter().filter(|c| c.category != "promotions").all(|c| c.delta == 0.0));

    let better = compare::run_compare(&args(&b, &a), &cfg).unwrap();
    assert_eq!(better.recommendation, compare::Recommendation::Promote, "{better:#?}");
    assert!((better.delta + worse.delta).abs() < 1e-12);
    let promos = better.categories.iter().find(|c| c.category == "promotions").unwrap();
    assert_eq!(promos.improved, vec!["deal".to_string()]);
    let text = compare::markdown(&better);
    assert!(text.contains("recommendation: promote") && text.contains(&better.a.version), "{text}");
    drop(s.runtime);
}
