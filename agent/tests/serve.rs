//! `nextn serve` end to end: the real binary on the bundled model, driven over loopback HTTP.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A running `nextn serve`; killed on drop.
struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nextn"))
            .args(["serve", "--port", "0", "--threads", "1"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start nextn serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("nextn serve: listening on ") {
                    let url = rest.split_whitespace().next().unwrap_or_default().to_string();
                    let _ = tx.send(url);
                }
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(120)).expect("nextn serve printed its listening line");
        Server { child, base }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn reference() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/nextn-live-tiny/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The reference runs' token limit: a request for a reference reply asks for the same.
fn reference_max_tokens() -> u64 {
    reference()["max_new_tokens"].as_u64().unwrap()
}

fn case(name: &str) -> Value {
    reference()["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone()
}

/// The text before the first tool call of a reference reply, the call's function name and its arguments
/// (Qwen3.5 XML; every parameter of the bundled harness's tools is a string).
fn reference_call(c: &Value) -> (String, String, Value) {
    let text = reference_text(c);
    let (before, call) = text.split_once("<tool_call>").unwrap_or_else(|| panic!("the reference reply is not a tool call: {text:?}"));
    let name = call.split("<function=").nth(1).and_then(|r| r.split('>').next()).unwrap().to_string();
    let mut args = serde_json::Map::new();
    for part in call.split("<parameter=").skip(1) {
        let (key, rest) = part.split_once(">\n").unwrap();
        let value = rest.split("\n</parameter>").next().unwrap();
        args.insert(key.to_string(), json!(value));
    }
    (before.trim().to_string(), name, Value::Object(args))
}

/// The reference reply without its end marker.
fn reference_text(c: &Value) -> String {
    c["text"].as_str().unwrap().trim_end_matches("<|im_end|>").to_string()
}

async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = client().post(s.url(path)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

/// Every `data:` payload of an SSE body.
async fn sse(s: &Server, path: &str, body: Value) -> Vec<String> {
    let r = client().post(s.url(path)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A reference case whose greedy reply is text, not a tool call (which cases those are depends on the trained
/// model).
fn text_reply_case() -> Value {
    let cases = reference()["cases"].as_array().unwrap().clone();
    cases.into_iter().find(|c| !reference_text(c).contains("<tool_call>")).expect("a reference case with a text reply")
}

/// The reference request: its messages and, where the reference prompt was rendered with them, its tools.
fn chat_body(c: &Value, extra: Value) -> Value {
    let mut b = json!({"messages": c["messages"], "temperature": 0, "max_tokens": reference_max_tokens()});
    if !c["tools"].is_null() {
        b["tools"] = c["tools"].clone();
    }
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_reply_equals_the_reference_greedy_reply_with_spec_usage() {
    let s = Server::start(&[]);
    let c = text_reply_case();
    let (status, v) = post(&s, "/v1/chat/completions", chat_body(&c, json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], reference_text(&c));
    assert_eq!(choice["finish_reason"], "stop");
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], c["input_ids"].as_array().unwrap().len());
    assert_eq!(u["completion_tokens"], c["greedy_ids"].as_array().unwrap().len());
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());
    assert!(u["spec"]["drafted"].as_u64().unwrap() > 0, "{u}");
    assert!(u["spec"]["acceptance_length"].as_f64().unwrap() >= 1.0, "{u}");
    assert_eq!(u["spec"]["per_position"].as_array().unwrap().len(), 3);
}

/// `--prefill-chunk` / `--max-batch-tokens` reach the engine: short chunks give the same greedy reply (the
/// prompt streams in several forwards), and a zero is refused at start with the field named, exit code 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_chunk_flags_keep_the_reply_and_zero_is_refused() {
    let c = text_reply_case();
    assert!(c["input_ids"].as_array().unwrap().len() > 2 * 16, "the case's prompt spans several 16-row chunks");
    let s = Server::start(&["--prefill-chunk", "16", "--max-batch-tokens", "24"]);
    let (status, v) = post(&s, "/v1/chat/completions", chat_body(&c, json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], reference_text(&c));
    let out = Command::new(env!("CARGO_BIN_EXE_nextn")).args(["serve", "--port", "0", "--prefill-chunk", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--prefill-chunk must be at least 1"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn banned_prefixes_divert_the_reply_and_malformed_ones_are_400() {
    let c = text_reply_case();
    let reference = reference_text(&c);
    let first_word = reference.split_whitespace().next().unwrap().to_string();
    let s = Server::start(&[]);
    // A prefix the reply never begins with changes nothing; the reply's own first word must give way.
    let (status, v) = post(&s, "/v1/chat/completions", chat_body(&c, json!({"banned_prefixes": ["zq unrelated"]}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], reference);
    let (status, v) = post(&s, "/v1/chat/completions", chat_body(&c, json!({"banned_prefixes": [first_word]}))).await;
    assert_eq!(status, 200, "{v}");
    let diverted = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_ne!(diverted, reference, "banning {first_word:?}");
    for (bad, field) in [(json!("x"), "banned_prefixes"), (json!([""]), "banned_prefixes"), (json!([1]), "banned_prefixes[0]")] {
        let (status, v) = post(&s, "/v1/chat/completions", chat_body(&c, json!({"banned_prefixes": bad}))).await;
        assert_eq!(status, 400, "{bad}: {v}");
        assert!(v["error"]["param"].as_str().is_some_and(|p| p == field || p == "banned_prefixes"), "{bad}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{bad}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chat_deltas_add_up_to_the_reply_then_finish_usage_done() {
    let s = Server::start(&[]);
    let c = case("shipping");
    let events = sse(&s, "/v1/chat/completions", chat_body(&c, json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, reference_text(&c));
    assert!(chunks.len() > 4, "text arrives in several deltas: {chunks:?}");
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], c["greedy_ids"].as_array().unwrap().len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_round_trip_json_and_stream() {
    let s = Server::start(&[]);
    let c = case("tools_stock");
    let body = chat_body(&c, json!({}));
    let (status, v) = post(&s, "/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let msg = &choice["message"];
    let (want_text, want_name, want_args) = reference_call(&c);
    assert_eq!(msg["content"].as_str().unwrap_or_default(), want_text);
    let call = &msg["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], want_name.as_str());
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, want_args);
    assert!(!msg["content"].as_str().unwrap_or_default().contains("<tool_call>"));

    // The same request streamed: text deltas, then the call as deltas, then finish_reason tool_calls.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = sse(&s, "/v1/chat/completions", sbody).await;
    let chunks: Vec<Value> = events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, want_text);
    let call_deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0)).collect();
    assert_eq!(call_deltas[0]["index"], 0);
    assert_eq!(call_deltas[0]["function"]["name"], want_name.as_str());
    assert!(call_deltas[0]["id"].as_str().unwrap().starts_with("call_"));
    let streamed_args: String = call_deltas.iter().filter_map(|d| d["function"]["arguments"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&streamed_args).unwrap(), args);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

    // Second turn: the assistant's call and the tool's result go back in.
    let mut messages = c["messages"].as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]}));
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"product\": \"black power bank\", \"stock\": 3}"}));
    let (status, v2) =
        post(&s, "/v1/chat/completions", json!({"messages": messages, "tools": c["tools"], "temperature": 0, "max_tokens": 48})).await;
    assert_eq!(status, 200, "{v2}");
    assert!(v2["usage"]["prompt_tokens"].as_u64().unwrap() > v["usage"]["prompt_tokens"].as_u64().unwrap());
    let m2 = &v2["choices"][0]["message"];
    assert!(!m2["content"].as_str().unwrap_or_default().is_empty() || m2["tool_calls"].is_array(), "{v2}");

    // tool_choice none: no tools in the prompt, no call parsed.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let (status, v3) = post(&s, "/v1/chat/completions", none).await;
    assert_eq!(status, 200);
    assert!(v3["choices"][0]["message"].get("tool_calls").is_none(), "{v3}");
    assert!(v3["usage"]["prompt_tokens"].as_u64().unwrap() < v["usage"]["prompt_tokens"].as_u64().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_take_token_ids_and_text() {
    let s = Server::start(&["--spec", "off"]);
    let c = case("price_size");
    let (status, v) =
        post(&s, "/v1/completions", json!({"prompt": c["input_ids"], "temperature": 0, "max_tokens": reference_max_tokens(), "nextn": {"spec": "off"}})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], reference_text(&c));
    assert_eq!(v["usage"]["prompt_tokens"], c["input_ids"].as_array().unwrap().len());
    assert!(v["usage"].get("spec").is_none(), "no spec stats without speculation: {v}");

    let events = sse(&s, "/v1/completions", json!({"prompt": c["input_ids"], "temperature": 0, "max_tokens": reference_max_tokens(), "stream": true})).await;
    let text: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(text, reference_text(&c));

    let (status, v) = post(&s, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stop": ["zzz"]})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let s = Server::start(&["--served-model-name", "tiny"]);
    let v: Value = client().get(s.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    // The harness profile the bundled model declares (its nextn.json), for `nextn agent --llm URL`.
    let declared = v["data"][0]["nextn"]["harness"].as_str().unwrap_or_else(|| panic!("nextn.harness: {v}"));
    assert!(std::path::Path::new(declared).ends_with("harness/live-tiny"), "{v}");
    assert!(v["data"][0]["nextn"]["harness_version"].as_str().is_some_and(|h| !h.is_empty()), "{v}");
    let h = client().get(s.url("/health")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    let (status, _) = post(&s, "/v1/chat/completions", json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})).await;
    assert_eq!(status, 200);
    // The engine frees the request's slot just after the response is sent: wait for it (a leak never gets there).
    let m = wait_until_idle(&s).await;
    for name in [
        "nextn_time_to_first_token_seconds_bucket",
        "nextn_inter_token_latency_seconds_count",
        "nextn_e2e_request_latency_seconds_sum",
        "nextn_spec_acceptance_length_count 1",
        "nextn_requests_total{outcome=\"finished\"} 1",
        "nextn_prompt_tokens_total",
        "nextn_generation_tokens_total",
        "nextn_requests_running 0",
        "nextn_kv_blocks_used 0",
        "nextn_state_slots_used 0",
    ] {
        assert!(m.contains(name), "{name} missing in\n{m}");
    }
}

async fn error_of(s: &Server, path: &str, body: &str) -> (u16, Value) {
    let r = client().post(s.url(path)).header("content-type", "application/json").body(body.to_string()).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_400_naming_the_field() {
    let s = Server::start(&[]);
    let msgs = r#"[{"role": "user", "content": "hi"}]"#;
    let long: Vec<u32> = vec![100; 9000];
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        ("/v1/chat/completions", "{not json".into(), None),
        ("/v1/chat/completions", "[1, 2]".into(), None),
        ("/v1/chat/completions", "{}".into(), Some("messages")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "temperature": "hot"}}"#), Some("temperature")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "temperature": -1}}"#), Some("temperature")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "top_p": 2}}"#), Some("top_p")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "min_p": 1.5}}"#), Some("min_p")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "n": 2}}"#), Some("n")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "max_tokens": 0}}"#), Some("max_tokens")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "max_tokens": 100000}}"#), Some("max_tokens")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "stop": [1]}}"#), Some("stop[0]")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "tools": [{{"type": "x"}}]}}"#), Some("tools[0]")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "tool_choice": "sometimes"}}"#), Some("tool_choice")),
        ("/v1/chat/completions", r#"{"messages": [{"role": "robot", "content": "hi"}]}"#.into(), Some("messages[0].role")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "nextn": {{"spec": "off"}}}}"#), Some("nextn.spec")),
        ("/v1/chat/completions", format!(r#"{{"messages": {msgs}, "nextn": {{"draft_steps": 5}}}}"#), Some("nextn.draft_steps")),
        ("/v1/completions", format!(r#"{{"prompt": {}}}"#, serde_json::to_string(&long).unwrap()), Some("prompt")),
        ("/v1/completions", r#"{"prompt": [999999]}"#.into(), Some("prompt")),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#.into(), Some("prompt")),
        ("/v1/completions", r#"{"prompt": "hi", "logprobs": 3}"#.into(), Some("logprobs")),
    ];
    for (path, body, param) in cases {
        let (status, v) = error_of(&s, path, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
    }
    let (status, v) = error_of(&s, "/v1/chat/completions", &format!(r#"{{"model": "gpt-4", "messages": {msgs}}}"#)).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found");
    // The server is fine afterwards, nothing leaked.
    let (status, _) = post(&s, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})).await;
    assert_eq!(status, 200);
    let m = wait_until_idle(&s).await;
    assert!(m.contains("nextn_kv_blocks_used 0\n"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_on_v1_only() {
    let s = Server::start(&["--api-key", "sekret"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let r = client().post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let r = client().post(s.url("/v1/chat/completions")).bearer_auth("wrong").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client().get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client().post(s.url("/v1/chat/completions")).bearer_auth("sekret").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(client().get(s.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(client().get(s.url("/metrics")).send().await.unwrap().status(), 200);
}

/// Reads a metric's value from the exposition text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

async fn wait_until_idle(s: &Server) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = client().get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let idle = ["nextn_kv_blocks_used", "nextn_state_slots_used", "nextn_requests_running", "nextn_requests_waiting", "nextn_requests_admitted"]
            .iter()
            .all(|n| metric(&m, n) == Some(0.0));
        if idle || Instant::now() > deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_a_dropped_stream_frees_its_slot() {
    let s = Server::start(&["--max-running", "1", "--max-queue", "0"]);
    let long = json!({"prompt": "Hello", "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut r = client().post(s.url("/v1/completions")).json(&long).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let _first = r.chunk().await.unwrap();
    let r2 = client().post(s.url("/v1/completions")).json(&json!({"prompt": "Hi", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r2.status(), 429);
    assert_eq!(r2.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    let v: Value = r2.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    // The client goes away: the request is aborted, its blocks and slot freed, the next one admitted.
    drop(r);
    let m = wait_until_idle(&s).await;
    assert_eq!(metric(&m, "nextn_kv_blocks_used"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "nextn_state_slots_used"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "nextn_requests_total{outcome=\"aborted\"}"), Some(1.0), "{m}");
    let (status, _) = post(&s, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
    assert_eq!(status, 200);
}

const HELDOUT: &str = include_str!("../../models/nextn-live-tiny/heldout_prompts.jsonl");

/// 64 concurrent greedy streams, a third of them dropped part-way: every request completes or is cancelled,
/// every completed one equals the same request run alone, and afterwards no KV block or slot is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_64_streams_with_disconnects_match_single_runs_and_leak_nothing() {
    let s = Server::start(&[]);
    let prompts: Vec<String> =
        HELDOUT.lines().take(16).map(|l| serde_json::from_str::<Value>(l).unwrap()["prompt"].as_str().unwrap().to_string()).collect();
    let body = |p: &str, stream: bool| {
        json!({"messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 32, "stream": stream})
    };
    // Alone, one at a time.
    let mut alone = Vec::new();
    for p in &prompts {
        let (status, v) = post(&s, "/v1/chat/completions", body(p, false)).await;
        assert_eq!(status, 200, "{v}");
        alone.push(v["choices"][0]["message"]["content"].as_str().unwrap().to_string());
    }
    // Together, with deterministic pseudo-random disconnects.
    let started = Instant::now();
    let mut tasks = Vec::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..64usize {
        let url = s.url("/v1/chat/completions");
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // A third of the clients go away after 1-3 network chunks; their requests are long (ignore_eos), so
        // they are still generating when the connection drops.
        let drop_after = rng.is_multiple_of(3).then_some(1 + (rng >> 8) as usize % 3);
        let mut b = body(&prompts[i % prompts.len()], true);
        if drop_after.is_some() {
            b["max_tokens"] = json!(2000);
            b["ignore_eos"] = json!(true);
        }
        tasks.push(tokio::spawn(async move {
            let mut r = client().post(url).json(&b).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let mut buf = String::new();
            let mut chunks = 0;
            while let Some(c) = r.chunk().await.unwrap() {
                buf.push_str(std::str::from_utf8(&c).unwrap());
                chunks += 1;
                if drop_after.is_some_and(|n| chunks >= n) {
                    return None; // the client goes away
                }
            }
            let content: String = buf
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
                .collect();
            assert!(buf.trim_end().ends_with("data: [DONE]"), "{buf}");
            Some(content)
        }));
    }
    let mut completed = 0;
    let mut cancelled = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        match tokio::time::timeout(Duration::from_secs(240), t).await.expect("load test finished in time").unwrap() {
            Some(content) => {
                assert_eq!(content, alone[i % prompts.len()], "request {i} differs from its single run");
                completed += 1;
            }
            None => cancelled += 1,
        }
    }
    assert_eq!(completed + cancelled, 64);
    assert!(completed > 0 && cancelled > 0, "{completed} completed, {cancelled} cancelled");
    eprintln!("load: {completed} completed, {cancelled} cancelled in {:?}", started.elapsed());
    let m = wait_until_idle(&s).await;
    assert_eq!(metric(&m, "nextn_kv_blocks_used"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "nextn_state_slots_used"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "nextn_requests_running"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "nextn_requests_total{outcome=\"aborted\"}"), Some(cancelled as f64), "{m}");
    assert_eq!(metric(&m, "nextn_requests_total{outcome=\"finished\"}"), Some((completed + prompts.len()) as f64), "{m}");
}

/// `nextn harness perturb --llm URL` against a real endpoint (this server on the bundled model): every
/// description the templates would rewrite goes to the model; a rewrite that keeps the original's tokens is used,
/// the rest are refused and listed; the variant passes `nextn harness check`. An endpoint that is down is an error
/// naming it (exit 1), never a silent fallback.
#[test]
fn harness_perturb_rewrites_descriptions_with_an_llm_endpoint() {
    let s = Server::start(&[]);
    let dir = std::env::temp_dir().join(format!("nextn-perturb-llm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let harness = concat!(env!("CARGO_MANIFEST_DIR"), "/../harness/live-tiny");
    let out = dir.join("v");
    let llm = s.url("/v1");
    let run = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(["harness", "perturb", harness, "--seed", "3", "--dims", "skill-id,tool-def", "--strength", "1", "--json", "--llm", &llm])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run nextn harness perturb");
    assert!(run.status.success(), "exit {:?}: {}", run.status, String::from_utf8_lossy(&run.stderr));
    let v: Value = serde_json::from_slice(&run.stdout).expect("JSON manifest");
    let m = &v["manifest"];
    assert!(m["rewriter"].as_str().is_some_and(|r| r.contains(&llm)), "{m}");
    let changes = m["changes"].as_array().unwrap();
    let asked = changes.iter().filter(|c| c["kind"].as_str().is_some_and(|k| k.starts_with("rewrite_") || k == "llm_rewrite_rejected")).count();
    assert!(asked > 0, "no description went to the model: {m}");
    let check = Command::new(env!("CARGO_BIN_EXE_nextn")).args(["harness", "check"]).arg(&out).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    drop(s);

    let down = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(["harness", "perturb", harness, "--seed", "3", "--offline", "--llm", "http://127.0.0.1:9/v1"])
        .arg("--out")
        .arg(dir.join("w"))
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&down.stderr);
    assert_eq!(down.status.code(), Some(1), "{err}");
    assert!(err.contains("rewriting a") && err.contains("127.0.0.1:9"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `nextn agent --llm URL` against `nextn serve` on the bundled model runs the harness the model declares (the
/// server names it in /v1/models) and so answers as the in-process agent does; `--harness` still wins.
#[test]
fn agent_over_http_uses_the_served_models_harness() {
    let s = Server::start(&[]);
    let shop = format!("shop='{}'", common::commerce_bin().display());
    let agent = |extra: &[&str]| -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_nextn"))
            .args(["agent", "--comment", "how much are the thermal leggings?", "--mcp", &shop, "--threads", "1", "--json"])
            .args(extra)
            .output()
            .expect("run nextn agent");
        assert!(out.status.success(), "exit {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("--json output")
    };
    let local = agent(&[]);
    let url = s.url("/v1");
    let remote = agent(&["--llm", &url]);
    assert!(remote["harness"].as_str().is_some_and(|h| std::path::Path::new(h).ends_with("harness/live-tiny")), "{remote}");
    assert_eq!(remote["harness_version"], local["harness_version"], "{remote}");
    assert_eq!(remote["reply"], local["reply"], "remote {remote}\nlocal {local}");
    assert_eq!(remote["outcome"], "replied", "{remote}");
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/../harness/default");
    let flagged = agent(&["--llm", &url, "--harness", default]);
    assert_eq!(flagged["harness"], default, "{flagged}");
}
