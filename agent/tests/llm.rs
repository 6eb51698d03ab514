//! LLM clients: the in-process engine (a dummy model + the fixture tokenizer), an OpenAI-compatible server
//! (a canned local HTTP server), and the scripted client.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use nextn_agent::llm::{ChatRequest, EngineClient, LlmClient, LlmError, OpenAiClient, ScriptedClient};
use nextn_agent::toolcall::parse_reply;
use nextn_engine::spec::SpecConfig;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::weights::DType;
use nextn_engine::{EngineConfig, Model, ModelConfig};
use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(name)
}

fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {
        "name": "get_price",
        "description": "Price of a product",
        "parameters": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku"]},
    }})]
}

fn messages() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "你是直播间主播。"}),
        json!({"role": "user", "content": "A1 多少钱？"}),
        json!({"role": "assistant", "content": "我查一下。", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_price", "arguments": "{\"sku\": \"A1\", \"qty\": 2}"}}
        ]}),
        json!({"role": "tool", "tool_call_id": "call_0", "content": "{\"price\": 99}"}),
    ]
}

// ------------------------------------------------------------------------------------------------
// EngineClient

/// The tiny qwen3_5_moe fixture config with dummy weights, its vocabulary widened to the fixture
/// tokenizer's 609 ids, and the fixture tokenizer / chat template.
fn engine_client(spec: Option<SpecConfig>) -> EngineClient {
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_5_moe").join("config.json")).unwrap()).unwrap();
    let bundle = TokenizerBundle::load(fixture("tokenizer")).unwrap();
    let vocab = bundle.tokenizer().unwrap().vocab_size();
    assert_eq!(vocab, 609);
    cfg["text_config"]["vocab_size"] = json!(vocab);
    cfg["text_config"]["max_position_embeddings"] = json!(4096);
    let mcfg = ModelConfig::from_json(&cfg, Path::new("config.json")).unwrap();
    let model = Model::load_dummy(&mcfg, DType::F32, 0).unwrap();
    let ecfg = EngineConfig { spec, max_model_len: Some(4096), kv_cache_bytes: 64 << 20, ..EngineConfig::default() };
    EngineClient::from_parts(model, bundle, ecfg).unwrap()
}

#[test]
fn engine_client_generates_with_tools_and_reports_stats() {
    let mut client = engine_client(None);
    assert!(client.name().starts_with("engine:"));
    let req = ChatRequest { messages: messages(), tools: tools(), max_tokens: 8, seed: Some(1), ..Default::default() };
    let prompt = client.render_prompt(&req).unwrap();
    let tok = client.bundle().tokenizer().unwrap();
    let prompt_text = tok.decode(&prompt, false).unwrap();
    assert!(prompt_text.contains("# Tools") && prompt_text.contains("\"get_price\""), "{prompt_text}");
    // String arguments of the history's tool call were turned into an object the template iterates.
    assert!(prompt_text.contains("<function=get_price>\n<parameter=sku>\nA1\n</parameter>\n<parameter=qty>\n2\n</parameter>"), "{prompt_text}");
    assert!(prompt_text.contains("<tool_response>\n{\"price\": 99}\n</tool_response>"));
    assert!(prompt_text.ends_with("<|im_start|>assistant\n<think>\n"));

    let g = client.generate(&req).unwrap();
    assert_eq!(g.prompt_tokens, prompt.len());
    assert!((1..=8).contains(&g.completion_tokens), "{g:?}");
    assert!(g.ttft_ms > 0.0 && g.wall_ms >= g.ttft_ms, "{g:?}");
    assert!(g.decode_tokens_per_s >= 0.0);
    assert!(["stop", "length"].contains(&g.finish_reason.as_str()));
    assert!(g.spec.is_none());
    assert!(!g.text.ends_with("<|im_end|>") && !g.text.ends_with("<|endoftext|>"));
    // Same seed, same request → same text (greedy anyway).
    let again = client.generate(&req).unwrap();
    assert_eq!(again.text, g.text);
    assert_eq!(again.completion_tokens, g.completion_tokens);
}

#[test]
fn engine_client_thinking_switch_and_sampling() {
    let mut client = engine_client(None);
    let req = ChatRequest {
        messages: vec![json!({"role": "user", "content": "你好"})],
        enable_thinking: Some(false),
        max_tokens: 4,
        temperature: 0.7,
        top_p: 0.9,
        seed: Some(7),
        ..Default::default()
    };
    let prompt = client.render_prompt(&req).unwrap();
    let text = client.bundle().tokenizer().unwrap().decode(&prompt, false).unwrap();
    assert!(text.ends_with("<think>\n\n</think>\n\n"), "{text:?}");
    assert!(!text.contains("# Tools"));
    let a = client.generate(&req).unwrap();
    let b = client.generate(&req).unwrap();
    assert_eq!(a.text, b.text, "seeded sampling is reproducible");
    assert!(a.completion_tokens <= 4);
}

#[test]
fn engine_client_with_mtp_reports_acceptance() {
    let mut client = engine_client(Some(SpecConfig { draft_steps: 2 }));
    let req = ChatRequest { messages: vec![json!({"role": "user", "content": "hi"})], max_tokens: 12, ..Default::default() };
    let g = client.generate(&req).unwrap();
    let spec = g.spec.expect("speculating reports spec stats");
    assert!(spec.get("drafted").is_some() && spec.get("acceptance_rate").is_some(), "{spec}");
}

#[test]
fn engine_client_rejects_zero_max_tokens() {
    let mut client = engine_client(None);
    let req = ChatRequest { messages: vec![json!({"role": "user", "content": "hi"})], max_tokens: 0, ..Default::default() };
    assert!(matches!(client.generate(&req), Err(LlmError::InvalidRequest(_))));
}

#[test]
fn engine_client_needs_tokenizer_and_template() {
    let cfg = ModelConfig::from_path(&fixture("qwen3_5_moe")).unwrap();
    let model = Model::load_dummy(&cfg, DType::F32, 0).unwrap();
    let bundle = TokenizerBundle::load(fixture("qwen3_5_moe")).unwrap();
    assert!(matches!(EngineClient::from_parts(model, bundle, EngineConfig::default()), Err(LlmError::Load(_))));
}

// ------------------------------------------------------------------------------------------------
// OpenAiClient against a canned local server

struct Canned {
    status: u16,
    content_type: &'static str,
    /// Written one after another, with `gap` between them.
    chunks: Vec<String>,
    gap: Duration,
    /// Wait this long before answering at all.
    delay: Duration,
}

impl Canned {
    fn json(status: u16, body: Value) -> Self {
        Canned { status, content_type: "application/json", chunks: vec![body.to_string()], gap: Duration::ZERO, delay: Duration::ZERO }
    }
}

/// A request as the server saw it: request line + headers (lower-cased), and the JSON body.
struct Seen {
    head: String,
    body: Value,
}

fn read_request(stream: &mut TcpStream) -> Seen {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let header_end = loop {
        let n = stream.read(&mut tmp).unwrap();
        assert!(n > 0, "client closed before sending headers");
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0);
    while buf.len() < header_end + len {
        let n = stream.read(&mut tmp).unwrap();
        assert!(n > 0);
        buf.extend_from_slice(&tmp[..n]);
    }
    let body = serde_json::from_slice(&buf[header_end..header_end + len]).unwrap_or(Value::Null);
    Seen { head, body }
}

/// Serve `responses` to consecutive connections on 127.0.0.1:0; returns the base URL and the requests.
fn serve(responses: Vec<Canned>) -> (String, mpsc::Receiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for canned in responses {
            let Ok((mut stream, _)) = listener.accept() else { return };
            let seen = read_request(&mut stream);
            let _ = tx.send(seen);
            std::thread::sleep(canned.delay);
            let length = if canned.content_type == "text/event-stream" {
                String::new()
            } else {
                format!("Content-Length: {}\r\n", canned.chunks.iter().map(String::len).sum::<usize>())
            };
            let head = format!(
                "HTTP/1.1 {} X\r\nContent-Type: {}\r\n{length}Connection: close\r\n\r\n",
                canned.status, canned.content_type
            );
            if stream.write_all(head.as_bytes()).is_err() {
                continue;
            }
            for chunk in &canned.chunks {
                if stream.write_all(chunk.as_bytes()).and_then(|_| stream.flush()).is_err() {
                    break;
                }
                std::thread::sleep(canned.gap);
            }
        }
    });
    (url, rx)
}

fn sse(events: &[Value]) -> Vec<String> {
    let mut chunks: Vec<String> = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    chunks.push("data: [DONE]\n\n".into());
    chunks
}

#[test]
fn openai_client_sends_the_request_and_rerenders_tool_calls() {
    let reply = json!({
        "id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant",
            "content": "我查一下。",
            "reasoning_content": "用户问价格。",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_price", "arguments": "{\"sku\": \"A1\", \"qty\": 2}"}}],
        }}],
        "usage": {"prompt_tokens": 321, "completion_tokens": 17, "total_tokens": 338},
    });
    let (url, seen) = serve(vec![Canned::json(200, reply)]);
    let mut client = OpenAiClient::new(format!("{url}/v1/"), "qwen3.5").unwrap().with_api_key("sk-test").with_stream(false);
    assert_eq!(client.url(), format!("{url}/v1/chat/completions"));
    let mut msgs = messages();
    // History arguments given as an object go over the wire as a JSON string.
    msgs[2]["tool_calls"][0]["function"]["arguments"] = json!({"sku": "A1", "qty": 2});
    let req = ChatRequest {
        messages: msgs,
        tools: tools(),
        max_tokens: 64,
        temperature: 0.6,
        top_p: 0.95,
        seed: Some(3),
        enable_thinking: Some(true),
        stop: vec!["<|im_end|>".into()],
        banned_prefixes: vec!["Sure, the".into()],
        deadline: None,
    };
    let g = client.generate(&req).unwrap();

    let s = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(s.head.starts_with("post /v1/chat/completions "), "{}", s.head);
    assert!(s.head.contains("authorization: bearer sk-test"));
    let b = &s.body;
    assert_eq!(b["model"], "qwen3.5");
    assert_eq!(b["messages"].as_array().unwrap().len(), 4);
    assert_eq!(b["banned_prefixes"], json!(["Sure, the"]));
    assert_eq!(b["messages"][1]["content"], "A1 多少钱？");
    assert_eq!(b["messages"][2]["tool_calls"][0]["function"]["arguments"], "{\"sku\":\"A1\",\"qty\":2}");
    assert_eq!(b["messages"][3]["role"], "tool");
    assert_eq!(b["tools"], json!(tools()));
    assert_eq!(b["max_tokens"], 64);
    assert!((b["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6);
    assert_eq!(b["seed"], 3);
    assert_eq!(b["stop"], json!(["<|im_end|>"]));
    assert_eq!(b["stream"], false);
    assert_eq!(b["chat_template_kwargs"]["enable_thinking"], true);

    assert_eq!(
        g.text,
        "<think>\n用户问价格。\n</think>\n\n我查一下。\n\n<tool_call>\n<function=get_price>\n<parameter=sku>\nA1\n</parameter>\n\
         <parameter=qty>\n2\n</parameter>\n</function>\n</tool_call>"
    );
    assert_eq!((g.prompt_tokens, g.completion_tokens), (321, 17));
    assert_eq!(g.finish_reason, "tool_calls");
    assert!(g.wall_ms > 0.0);
    let parsed = parse_reply(&g.text, &tools());
    assert_eq!(parsed.text, "我查一下。");
    assert_eq!(parsed.reasoning.as_deref(), Some("用户问价格。"));
    assert_eq!(parsed.calls[0].arguments["qty"], 2);
    assert!(parsed.errors.is_empty());
}

#[test]
fn openai_client_streams_and_measures_ttft() {
    let chunk = |delta: Value, finish: Value| json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let events = vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": "好的"}), Value::Null),
        chunk(json!({"content": "，稍等"}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "get_price", "arguments": ""}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"sku\": "}}]}), Value::Null),
        chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"B2\"}"}}]}), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        json!({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 6}}),
    ];
    let canned = Canned {
        status: 200,
        content_type: "text/event-stream",
        chunks: sse(&events),
        gap: Duration::from_millis(15),
        delay: Duration::from_millis(30),
    };
    let (url, seen) = serve(vec![canned]);
    let mut client = OpenAiClient::new(url, "m").unwrap();
    let req = ChatRequest { messages: vec![json!({"role": "user", "content": "B2?"})], tools: tools(), ..Default::default() };
    let g = client.generate(&req).unwrap();
    let s = seen.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(s.body["stream"], true);
    assert_eq!(s.body["stream_options"]["include_usage"], true);
    assert!(s.body.get("seed").is_none() && s.body.get("stop").is_none() && s.body.get("chat_template_kwargs").is_none());
    assert_eq!(
        g.text,
        "好的，稍等\n\n<tool_call>\n<function=get_price>\n<parameter=sku>\nB2\n</parameter>\n</function>\n</tool_call>"
    );
    assert_eq!((g.prompt_tokens, g.completion_tokens), (50, 6));
    assert_eq!(g.finish_reason, "tool_calls");
    assert!(g.ttft_ms >= 25.0, "{g:?}");
    assert!(g.wall_ms > g.ttft_ms && g.decode_tokens_per_s > 0.0, "{g:?}");
}

#[test]
fn openai_client_http_error_timeout_and_connect_error() {
    let (url, _seen) = serve(vec![
        Canned::json(500, json!({"error": {"message": "boom"}})),
        Canned { delay: Duration::from_secs(3), ..Canned::json(200, json!({})) },
        Canned::json(200, json!({"unexpected": true})),
    ]);
    let req = ChatRequest { messages: vec![json!({"role": "user", "content": "x"})], ..Default::default() };
    let mut client = OpenAiClient::new(url.clone(), "m").unwrap().with_stream(false);
    match client.generate(&req) {
        Err(LlmError::Http { status, message: body, .. }) => {
            assert_eq!(status, 500);
            assert!(body.contains("boom"));
        }
        other => panic!("expected HTTP 500, got {other:?}"),
    }
    let mut slow = OpenAiClient::new(url.clone(), "m").unwrap().with_timeout(Duration::from_millis(300)).unwrap();
    assert!(matches!(slow.generate(&req), Err(LlmError::Timeout { .. })));
    assert!(matches!(client.generate(&req), Err(LlmError::Protocol { .. })));

    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut nobody = OpenAiClient::new(format!("http://127.0.0.1:{port}"), "m").unwrap();
    let err = nobody.generate(&req).unwrap_err();
    assert!(matches!(err, LlmError::Connect { .. }), "{err:?}");
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "the error names the URL: {err}");
    // A deadline that has passed fails at once, naming the URL.
    let past = ChatRequest { deadline: Some(std::time::Instant::now()), ..req.clone() };
    assert!(matches!(nobody.generate(&past), Err(LlmError::Timeout { after_ms: 0, .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_can_be_dropped_inside_async_code() {
    // Used to panic: "Cannot drop a runtime in a context where blocking is not allowed".
    let client = OpenAiClient::new("http://127.0.0.1:9/v1", "m").unwrap();
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_works_when_called_on_a_runtime_thread() {
    let reply = json!({"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}]});
    let (url, _seen) = serve(vec![Canned::json(200, reply.clone()), Canned::json(200, reply)]);
    let mut client = OpenAiClient::new(url, "m").unwrap();
    let req = ChatRequest { messages: vec![json!({"role": "user", "content": "x"})], ..Default::default() };
    // Directly on a runtime worker (the client detects it and uses a helper thread)...
    let g = client.generate(&req).unwrap();
    assert_eq!(g.text, "hi");
    assert_eq!(g.finish_reason, "stop");
    // ...and the recommended way.
    let g = tokio::task::spawn_blocking(move || client.generate(&req)).await.unwrap().unwrap();
    assert_eq!(g.text, "hi");
}

// ------------------------------------------------------------------------------------------------
// ScriptedClient

#[test]
fn scripted_client_replays_records_and_exhausts() {
    let mut client = ScriptedClient::new(["first <tool_call>", "second"]);
    client.push_error(LlmError::Timeout { url: "scripted".into(), after_ms: 0 });
    client.push("fourth STOP tail");
    let log = client.requests();
    let mut boxed: Box<dyn LlmClient> = Box::new(client);
    assert_eq!(boxed.name(), "scripted");
    let mut req = ChatRequest::new(vec![json!({"role": "user", "content": "q1"})]);
    assert_eq!(boxed.generate(&req).unwrap().text, "first <tool_call>");
    req.messages.push(json!({"role": "assistant", "content": "first"}));
    let g = boxed.generate(&req).unwrap();
    assert_eq!(g.text, "second");
    assert!(g.completion_tokens > 0 && g.prompt_tokens > 0);
    assert!(matches!(boxed.generate(&req), Err(LlmError::Timeout { .. })));
    req.stop = vec![" STOP".into()];
    assert_eq!(boxed.generate(&req).unwrap().text, "fourth");
    assert!(matches!(boxed.generate(&req), Err(LlmError::Exhausted)));
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 5);
    assert_eq!(log[0].messages.len(), 1);
    assert_eq!(log[1].messages.len(), 2);
}

#[test]
fn chat_request_defaults() {
    let r = ChatRequest::default();
    assert_eq!((r.max_tokens, r.temperature, r.top_p), (512, 0.0, 1.0));
    assert!(r.tools.is_empty() && r.stop.is_empty() && r.seed.is_none() && r.enable_thinking.is_none());
}
