//! End-to-end tests of the agent loop: a scripted LLM client (replays fixed model outputs and records what
//! it was sent) against the real commerce MCP server as a child process, with the bundled harness.
//!
//! The commerce server binary must be built first: `cargo build -p nextn-commerce-mcp` (or
//! `cargo test --workspace`), or point `NEXTN_COMMERCE_MCP_BIN` at it.
//!
//! The agent calls the model through `block_in_place`, so every test runs on a multi-threaded runtime.

mod common;
use common::commerce_bin;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nextn_agent::agent::{Agent, AgentReply, AgentRequest, FALLBACK_REPLY, Outcome};
use nextn_agent::llm::{ChatRequest, LlmClient, ScriptedClient};
use nextn_agent::mcp::McpPool;
use nextn_agent::trace::{Trace, TraceEvent};
use nextn_harness::Harness;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Fixtures

fn harness() -> Harness {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/default");
    Harness::load(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

type Requests = Arc<Mutex<Vec<ChatRequest>>>;

/// The bundled harness, a scripted model replaying `outputs`, and the commerce server (started with
/// `flags`) as MCP server `shop`.
async fn agent_with(outputs: &[String], flags: &str) -> (Agent, Requests) {
    let client = ScriptedClient::new(outputs.iter().cloned());
    let requests = client.requests();
    let spec = format!("shop='{}' {flags}", commerce_bin().display());
    let pool = McpPool::connect_all([spec])
        .await
        .expect("start and connect the commerce server");
    let llm: Box<dyn LlmClient> = Box::new(client);
    let agent = Agent::new(harness(), llm, pool).expect("agent over the bundled harness");
    (agent, requests)
}

/// One Qwen3.5 XML tool call.
fn call(name: &str, params: &[(&str, &str)]) -> String {
    let mut s = format!("<tool_call>\n<function={name}>\n");
    for (k, v) in params {
        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
    }
    s.push_str("</function>\n</tool_call>");
    s
}

fn req(comment: &str) -> AgentRequest {
    AgentRequest {
        comment: comment.into(),
        ..Default::default()
    }
}

/// Run one request. (Not on a spawned task: `Agent::handle`'s future is not `Send`, because `LlmClient` is not
/// `Sync` and `Agent::call_tool` holds `&Agent` across an `.await`. A panic in the agent fails the test.)
async fn handle(mut agent: Agent, request: AgentRequest) -> (Agent, AgentReply) {
    let reply = agent.handle(request).await;
    (agent, reply)
}

fn recorded(requests: &Requests) -> Vec<ChatRequest> {
    requests.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

fn kinds(trace: &Trace) -> Vec<&'static str> {
    trace.events().map(TraceEvent::kind).collect()
}

fn tool_calls(trace: &Trace) -> Vec<&TraceEvent> {
    trace
        .events()
        .filter(|e| matches!(e, TraceEvent::ToolCall { .. }))
        .collect()
}

fn generations(trace: &Trace) -> usize {
    trace
        .events()
        .filter(|e| matches!(e, TraceEvent::Generation { .. }))
        .count()
}

/// `(point, hook, decision, reason)` of every hook event.
fn hooks(trace: &Trace) -> Vec<(String, String, String, Option<String>)> {
    trace
        .events()
        .filter_map(|e| match e {
            TraceEvent::Hook {
                point,
                hook,
                decision,
                reason,
            } => Some((
                point.clone(),
                hook.clone(),
                decision.clone(),
                reason.clone(),
            )),
            _ => None,
        })
        .collect()
}

/// The `role: tool` messages of a request, as `(name, content)`.
fn tool_messages(r: &ChatRequest) -> Vec<(String, String)> {
    r.messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["name"].as_str().unwrap_or("").to_string(),
                m["content"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The last message of a request.
fn last_message(r: &ChatRequest) -> &Value {
    r.messages.last().expect("a request has messages")
}

/// Invariants every reply's trace must satisfy; also writes the trace as JSONL to a file, reads it back with
/// `Trace::parse_jsonl` and checks it matches, and checks `summary()` agrees with the reply.
fn check_trace(reply: &AgentReply, name: &str) {
    let trace = &reply.trace;
    let events: Vec<&TraceEvent> = trace.events().collect();
    let k = kinds(trace);
    assert!(k.len() >= 3, "{name}: too few events: {k:?}");

    // Start first, Reply then Timing last; exactly one of each.
    match events[0] {
        TraceEvent::Start {
            request_id,
            harness_version,
            comment: _,
            llm,
        } => {
            assert_eq!(request_id, trace.request_id(), "{name}");
            assert!(
                !harness_version.is_empty(),
                "{name}: harness version recorded"
            );
            assert_eq!(llm, "scripted", "{name}");
        }
        other => panic!("{name}: first event is {other:?}"),
    }
    for kind in ["start", "reply", "timing"] {
        assert_eq!(
            k.iter().filter(|x| **x == kind).count(),
            1,
            "{name}: one `{kind}` event in {k:?}"
        );
    }
    assert!(
        k.iter().filter(|x| **x == "prompt").count() <= 1,
        "{name}: {k:?}"
    );
    assert_eq!(k[k.len() - 1], "timing", "{name}: {k:?}");
    assert_eq!(k[k.len() - 2], "reply", "{name}: {k:?}");
    match events[events.len() - 2] {
        TraceEvent::Reply {
            text,
            loops,
            outcome,
            ..
        } => {
            assert_eq!(text, &reply.reply, "{name}");
            assert_eq!(*loops, reply.loops, "{name}");
            assert_eq!(outcome, reply.outcome.as_str(), "{name}");
        }
        other => panic!("{name}: {other:?}"),
    }
    match events[events.len() - 1] {
        TraceEvent::Timing {
            wall_ms,
            prompt_ms,
            model_ms,
            tools_ms,
            hooks_ms,
        } => {
            for v in [prompt_ms, model_ms, tools_ms, hooks_ms] {
                assert!(
                    *v >= 0.0 && *v <= *wall_ms + 1.0,
                    "{name}: split {v} within wall {wall_ms}"
                );
            }
        }
        other => panic!("{name}: {other:?}"),
    }

    // When there is a prompt it comes right after the start and any input-hook events, before any generation.
    if let Some(p) = k.iter().position(|x| *x == "prompt") {
        assert!(
            k[1..p].iter().all(|x| *x == "hook"),
            "{name}: only input hooks before the prompt: {k:?}"
        );
        if let TraceEvent::Prompt { blocks, skills: _ } = events[p] {
            assert!(!blocks.is_empty(), "{name}: prompt blocks recorded");
            for b in blocks {
                assert_eq!(b.hash.len(), 16, "{name}: block {} hash", b.name);
            }
        }
    } else {
        assert_eq!(
            generations(trace),
            0,
            "{name}: no generation without a prompt"
        );
    }

    // Generations are numbered 0, 1, 2, … and (the scripted model never fails here) there is one per loop;
    // every tool call belongs to the generation before it.
    let mut current: Option<usize> = None;
    for ev in &events {
        match ev {
            TraceEvent::Generation {
                loop_index, text, ..
            } => {
                assert_eq!(
                    *loop_index,
                    current.map_or(0, |c| c + 1),
                    "{name}: generation order"
                );
                assert!(!text.is_empty(), "{name}: generation text recorded");
                current = Some(*loop_index);
            }
            TraceEvent::ToolCall {
                loop_index,
                ok,
                result,
                error,
                ..
            } => {
                assert_eq!(
                    Some(*loop_index),
                    current,
                    "{name}: tool call after its generation"
                );
                assert_eq!(result.is_some(), *ok, "{name}: a result iff ok");
                assert_eq!(error.is_some(), !*ok, "{name}: an error iff not ok");
            }
            _ => {}
        }
    }
    {
        assert_eq!(
            generations(trace),
            reply.loops,
            "{name}: one generation per loop"
        );
    }
    match reply.outcome {
        Outcome::Replied => {}
        Outcome::Blocked => {
            assert_eq!(reply.reply, None, "{name}: blocked → nothing is said");
            assert!(reply.sentences.is_empty(), "{name}: blocked → no sentences");
        }
        _ => assert_eq!(reply.text(), FALLBACK_REPLY, "{name}: not replied → the fallback"),
    }

    // JSONL: to a file and back.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("agent_e2e");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}-{}.jsonl", trace.request_id()));
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        trace.write_jsonl(&mut f).unwrap();
        std::io::Write::flush(&mut f).unwrap();
    }
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text.lines().count(),
        trace.records().len(),
        "{name}: one line per event"
    );
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["request_id"], trace.request_id(), "{name}");
        assert!(
            v["t_ms"].as_f64().is_some_and(|t| t >= 0.0),
            "{name}: {line}"
        );
    }
    let back = Trace::parse_jsonl(&text).unwrap_or_else(|e| panic!("{name}: parse_jsonl: {e}"));
    assert_eq!(back.len(), trace.records().len(), "{name}");
    let mut last_t = 0.0;
    for (b, r) in back.iter().zip(trace.records()) {
        assert_eq!(b.request_id, r.request_id, "{name}");
        assert!(b.t_ms >= last_t, "{name}: t_ms does not go backwards");
        last_t = b.t_ms;
        assert_eq!(b.event.kind(), r.event.kind(), "{name}");
        // Floats may lose the last bit in text; compare everything else exactly.
        if !matches!(
            r.event,
            TraceEvent::Timing { .. } | TraceEvent::Generation { .. } | TraceEvent::ToolCall { .. }
        ) {
            assert_eq!(b.event, r.event, "{name}");
        }
        if let (
            TraceEvent::ToolCall {
                tool: a,
                arguments: x,
                ok: p,
                result: s,
                error: u,
                ..
            },
            TraceEvent::ToolCall {
                tool: b2,
                arguments: y,
                ok: q,
                result: t,
                error: w,
                ..
            },
        ) = (&b.event, &r.event)
        {
            assert_eq!((a, x, p, s, u), (b2, y, q, t, w), "{name}");
        }
        if let (
            TraceEvent::Generation {
                text: a,
                loop_index: i,
                ..
            },
            TraceEvent::Generation {
                text: b2,
                loop_index: j,
                ..
            },
        ) = (&b.event, &r.event)
        {
            assert_eq!((a, i), (b2, j), "{name}");
        }
    }

    // The summary agrees.
    let s = trace.summary();
    assert_eq!(s["outcome"], reply.outcome.as_str(), "{name}");
    assert_eq!(s["loops"], reply.loops, "{name}");
    assert_eq!(s["reply"], reply.text(), "{name}");
    assert_eq!(s["generations"], generations(trace), "{name}");
    assert_eq!(s["tool_calls"], tool_calls(trace).len(), "{name}");
    let failed = tool_calls(trace)
        .iter()
        .filter(|e| matches!(e, TraceEvent::ToolCall { ok: false, .. }))
        .count();
    assert_eq!(s["tool_errors"], failed, "{name}");
    assert_eq!(s["hooks_fired"], hooks(trace).len(), "{name}");
    assert_eq!(s["llm"], "scripted", "{name}");
    assert!(s["timing"]["wall_ms"].is_number(), "{name}");
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_needing_two_tools_replies_with_their_data() {
    let final_text = "The Classic Crew Tee is 79 CNY, and Black in M is in stock right now!";
    let outputs = vec![
        format!(
            "Let me check that for you.\n{}\n{}",
            call("get_product", &[("product_id", "p001")]),
            call(
                "check_stock",
                &[("product_id", "p001"), ("colour", "Black"), ("size", "M")]
            )
        ),
        final_text.to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "").await;
    let comment = "How much is the Classic Crew Tee, and is Black size M in stock?";
    let (agent, reply) = handle(agent, req(comment)).await;
    check_trace(&reply, "two_tools");
    let trace = &reply.trace;

    assert_eq!(reply.outcome, Outcome::Replied, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), final_text);
    assert_eq!(reply.loops, 2);

    // The two tool calls: right tools, arguments, results.
    let calls = tool_calls(trace);
    assert_eq!(calls.len(), 2, "{}", trace.to_jsonl());
    match calls[0] {
        TraceEvent::ToolCall {
            loop_index,
            server,
            tool,
            arguments,
            ok,
            result,
            error,
            latency_ms,
            ..
        } => {
            assert_eq!(
                (*loop_index, server.as_str(), tool.as_str()),
                (0, "shop", "get_product")
            );
            assert_eq!(arguments, &json!({"product_id": "p001"}));
            assert!(*ok, "{error:?}");
            let r: Value =
                serde_json::from_str(result.as_deref().unwrap()).expect("get_product answers JSON");
            assert_eq!(r["id"], "p001");
            assert_eq!(r["name"], "Classic Crew Tee");
            assert_eq!(r["price"].as_f64(), Some(79.0));
            assert!(*latency_ms >= 0.0);
        }
        other => panic!("{other:?}"),
    }
    match calls[1] {
        TraceEvent::ToolCall {
            loop_index,
            server,
            tool,
            arguments,
            ok,
            result,
            error,
            ..
        } => {
            assert_eq!(
                (*loop_index, server.as_str(), tool.as_str()),
                (0, "shop", "check_stock")
            );
            assert_eq!(
                arguments,
                &json!({"product_id": "p001", "colour": "Black", "size": "M"})
            );
            assert!(*ok, "{error:?}");
            let r = result.as_deref().unwrap();
            assert!(r.contains("Black") && r.contains("in stock"), "{r}");
        }
        other => panic!("{other:?}"),
    }

    // What the model saw: first the system prompt, the comment and every commerce tool…
    let reqs = recorded(&requests);
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].messages[0]["role"], "system");
    assert!(!reqs[0].messages[0]["content"].as_str().unwrap().is_empty());
    assert_eq!(
        last_message(&reqs[0]),
        &json!({"role": "user", "content": comment})
    );
    let tool_names: Vec<&str> = reqs[0]
        .tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    for t in [
        "search_products",
        "get_product",
        "check_stock",
        "list_promotions",
        "shipping_policy",
        "after_sales_policy",
        "room_status",
    ] {
        assert!(
            tool_names.contains(&t),
            "{t} offered to the model: {tool_names:?}"
        );
    }
    assert_eq!(reqs[0].enable_thinking, Some(false));
    // …then its own calls as an assistant message and the two results as tool messages, in call order.
    let assistant = reqs[1]
        .messages
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .expect("assistant turn");
    let called: Vec<&str> = assistant["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(called, ["get_product", "check_stock"]);
    let tm = tool_messages(&reqs[1]);
    assert_eq!(tm.len(), 2, "{:?}", reqs[1].messages);
    assert_eq!(tm[0].0, "get_product");
    let product: Value = serde_json::from_str(&tm[0].1).expect("the product as JSON");
    assert_eq!(product["price"].as_f64(), Some(79.0));
    assert_eq!(product["name"], "Classic Crew Tee");
    assert_eq!(tm[1].0, "check_stock");
    assert!(
        tm[1].1.contains("Black") && tm[1].1.contains("in stock"),
        "{}",
        tm[1].1
    );

    // Event order: start, prompt (blocks + skills), generation 0, its tool calls, generation 1, reply, timing.
    let k = kinds(trace);
    let pos = |kind: &str, nth: usize| {
        k.iter()
            .enumerate()
            .filter(|(_, x)| **x == kind)
            .nth(nth)
            .map(|(i, _)| i)
            .unwrap()
    };
    assert_eq!(k[0], "start");
    // Only the input hook's (allow) event sits between the start and the prompt.
    assert_eq!(&k[..pos("prompt", 0)], ["start", "hook"], "{k:?}");
    assert_eq!(
        hooks(trace)[0],
        ("input".into(), "input_sanity".into(), "allow".into(), None)
    );
    assert!(pos("generation", 0) < pos("tool_call", 0));
    assert!(pos("tool_call", 0) < pos("tool_call", 1));
    assert!(pos("tool_call", 1) < pos("generation", 1));
    assert!(pos("generation", 1) < pos("reply", 0));
    assert_eq!(generations(trace), 2);
    match trace.events().nth(pos("prompt", 0)).unwrap() {
        TraceEvent::Prompt { blocks, skills } => {
            let names: Vec<&str> = blocks.iter().map(|b| b.name.as_str()).collect();
            assert!(
                names.contains(&"rules") && names.contains(&"role"),
                "{names:?}"
            );
            assert!(
                skills.iter().any(|s| s == "price-and-promotions"),
                "{skills:?}"
            );
            assert!(
                skills.iter().any(|s| s == "stock-and-shipping"),
                "{skills:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Every hook allowed: before_tool twice per call, after_tool per call, before_reply once.
    let h = hooks(trace);
    assert!(h.iter().all(|(_, _, d, _)| d == "allow"), "{h:?}");
    assert!(
        h.iter()
            .any(|(p, n, _, _)| p == "before_tool" && n == "tool_args")
    );
    assert!(
        h.iter()
            .any(|(p, n, _, _)| p == "after_tool" && n == "tool_result")
    );
    assert!(
        h.iter()
            .any(|(p, n, _, _)| p == "before_reply" && n == "forbidden_claims")
    );
    let s = trace.summary();
    assert_eq!(s["tools"], json!(["get_product", "check_stock"]));
    assert_eq!(s["tool_errors"], 0);

    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tools_one_per_turn_also_work() {
    let outputs = vec![
        call("get_product", &[("product_id", "p002")]),
        call(
            "check_stock",
            &[("product_id", "p002"), ("colour", "Oat"), ("size", "L")],
        ),
        "The Oversized Fleece Hoodie is 199 CNY and Oat in L is available.".to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "").await;
    let (agent, reply) = handle(agent, req("Hoodie price? Oat in L available?")).await;
    check_trace(&reply, "one_per_turn");
    assert_eq!(
        reply.outcome,
        Outcome::Replied,
        "{}",
        reply.trace.to_jsonl()
    );
    assert_eq!(reply.loops, 3);
    let calls: Vec<(usize, String, bool)> = tool_calls(&reply.trace)
        .iter()
        .map(|e| match e {
            TraceEvent::ToolCall {
                loop_index,
                tool,
                ok,
                ..
            } => (*loop_index, tool.clone(), *ok),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        calls,
        [
            (0, "get_product".into(), true),
            (1, "check_stock".into(), true)
        ]
    );
    let reqs = recorded(&requests);
    assert_eq!(reqs.len(), 3);
    // The third request carries both results, in order.
    let tm = tool_messages(&reqs[2]);
    assert_eq!(
        tm.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(),
        ["get_product", "check_stock"]
    );
    let hoodie: Value = serde_json::from_str(&tm[0].1).expect("the product as JSON");
    assert_eq!(hoodie["price"].as_f64(), Some(199.0), "{}", tm[0].1);
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_triggered_retry_then_clean_reply() {
    let bad = "This tee is 100% guaranteed to never shrink, grab one now!";
    let good = "This tee is pre-shrunk cotton, so it keeps its shape after washing.";
    let (agent, requests) = agent_with(&[bad.to_string(), good.to_string()], "").await;
    let (agent, reply) = handle(agent, req("Does the crew tee shrink?")).await;
    check_trace(&reply, "hook_retry");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::Replied, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), good);
    assert_eq!(reply.loops, 2);
    assert_eq!(generations(trace), 2);

    let h = hooks(trace);
    let retries: Vec<_> = h.iter().filter(|(_, _, d, _)| d == "retry").collect();
    assert_eq!(retries.len(), 1, "{h:?}");
    let (point, hook, _, reason) = retries[0];
    assert_eq!(
        (point.as_str(), hook.as_str()),
        ("before_reply", "forbidden_claims")
    );
    let reason = reason.as_deref().expect("a retry has a reason");
    assert!(reason.contains("100% guaranteed"), "{reason}");
    // The retry came between the two generations.
    let k = kinds(trace);
    let retry_at = trace
        .events()
        .position(|e| matches!(e, TraceEvent::Hook { decision, .. } if decision == "retry"))
        .unwrap();
    let gens: Vec<usize> = k
        .iter()
        .enumerate()
        .filter(|(_, x)| **x == "generation")
        .map(|(i, _)| i)
        .collect();
    assert!(gens[0] < retry_at && retry_at < gens[1], "{k:?}");
    assert_eq!(tool_calls(trace).len(), 0);

    // The model was told why: its rejected reply and the reason come back in the second request.
    let reqs = recorded(&requests);
    assert_eq!(reqs.len(), 2);
    let n = reqs[1].messages.len();
    assert_eq!(
        reqs[1].messages[n - 2],
        json!({"role": "assistant", "content": bad})
    );
    let note = reqs[1].messages[n - 1]["content"].as_str().unwrap();
    assert_eq!(reqs[1].messages[n - 1]["role"], "user");
    assert!(note.contains("not sent") && note.contains(reason), "{note}");
    assert_eq!(trace.summary()["hooks"]["forbidden_claims"]["retry"], 1);
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_timeout_is_reported_and_agent_replies() {
    let outputs = vec![
        call(
            "check_stock",
            &[("product_id", "p001"), ("colour", "White"), ("size", "S")],
        ),
        "Sorry, stock is taking a moment to load; I'll confirm White in S shortly.".to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "--slow-tool check_stock:8000").await;
    let t = Instant::now();
    let (agent, reply) = handle(agent, req("Is the white tee in S in stock?")).await;
    let wall = t.elapsed();
    check_trace(&reply, "tool_timeout");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::Replied, "{}", trace.to_jsonl());
    assert_eq!(reply.loops, 2);
    assert!(
        wall >= Duration::from_millis(4500) && wall < Duration::from_millis(8000),
        "the 5 s tool timeout bounds the request: {wall:?}"
    );

    let calls = tool_calls(trace);
    assert_eq!(calls.len(), 1);
    match calls[0] {
        TraceEvent::ToolCall {
            tool,
            ok,
            error,
            latency_ms,
            result,
            ..
        } => {
            assert_eq!(tool, "check_stock");
            assert!(!ok);
            assert!(result.is_none());
            let e = error.as_deref().unwrap();
            assert!(e.contains("did not answer within 5000 ms"), "{e}");
            assert!((4500.0..8000.0).contains(latency_ms), "{latency_ms}");
        }
        other => panic!("{other:?}"),
    }
    // The model is told to carry on without the data.
    let reqs = recorded(&requests);
    let tm = tool_messages(&reqs[1]);
    assert_eq!(tm.len(), 1);
    assert!(
        tm[0].1.starts_with("error:")
            && tm[0].1.contains("5000 ms")
            && tm[0].1.contains("answer without this data"),
        "{}",
        tm[0].1
    );
    match trace.events().last().unwrap() {
        TraceEvent::Timing {
            tools_ms, wall_ms, ..
        } => {
            assert!(*tools_ms >= 4500.0 && *tools_ms < 8000.0, "{tools_ms}");
            assert!(*wall_ms >= *tools_ms);
        }
        other => panic!("{other:?}"),
    }
    // The server is still usable after the cancelled call.
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn is_error_result_is_shown_to_the_model() {
    let outputs = vec![
        call("get_product", &[("product_id", "p999")]),
        "I couldn't find that item; which product on screen do you mean?".to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "").await;
    let (agent, reply) = handle(agent, req("How much is product p999?")).await;
    check_trace(&reply, "is_error");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::Replied, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), outputs[1]);
    assert_eq!(reply.loops, 2);

    let calls = tool_calls(trace);
    assert_eq!(calls.len(), 1);
    let TraceEvent::ToolCall {
        tool,
        ok,
        error,
        arguments,
        ..
    } = calls[0]
    else {
        unreachable!()
    };
    assert_eq!(tool, "get_product");
    assert_eq!(arguments, &json!({"product_id": "p999"}));
    assert!(!ok);
    let e = error.as_deref().unwrap();
    assert!(e.contains("Unknown product 'p999'"), "{e}");

    let reqs = recorded(&requests);
    assert_eq!(reqs.len(), 2);
    let tm = tool_messages(&reqs[1]);
    assert_eq!(tm.len(), 1);
    assert_eq!(tm[0].0, "get_product");
    assert!(
        tm[0].1.starts_with("error: ") && tm[0].1.contains("Unknown product 'p999'"),
        "{}",
        tm[0].1
    );
    assert!(
        tm[0].1.contains("p001 (Classic Crew Tee)"),
        "the server's hint reaches the model: {}",
        tm[0].1
    );
    assert_eq!(trace.summary()["tool_errors"], 1);
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_crash_mid_call_is_reported_not_fatal() {
    let outputs = vec![
        call("get_product", &[("product_id", "p001")]),
        "Give me a second, the product card is reloading.".to_string(),
        // The second request, against the now-dead server.
        call("check_stock", &[("product_id", "p001"), ("colour", "Navy")]),
        "I can't check stock right now; please look at the product card.".to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "--crash-on get_product").await;
    let (agent, first) = handle(agent, req("Price of the crew tee?")).await;
    check_trace(&first, "crash_first");
    assert_eq!(
        first.outcome,
        Outcome::Replied,
        "{}",
        first.trace.to_jsonl()
    );
    assert_eq!(first.text(), outputs[1]);
    assert_eq!(first.loops, 2);
    let calls = tool_calls(&first.trace);
    assert_eq!(calls.len(), 1);
    let TraceEvent::ToolCall {
        tool, ok, error, ..
    } = calls[0]
    else {
        unreachable!()
    };
    assert_eq!(tool, "get_product");
    assert!(!ok);
    let e = error.as_deref().unwrap();
    assert!(e.contains("is gone"), "a server-died error: {e}");
    let tm = tool_messages(&recorded(&requests)[1]);
    assert!(
        tm[0].1.starts_with("error: ") && tm[0].1.contains("is gone"),
        "{}",
        tm[0].1
    );

    // The same agent keeps working; calls to the dead server fail cleanly, and fast.
    let t = Instant::now();
    let (agent, second) = handle(agent, req("Is the navy one in stock?")).await;
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "a dead server fails fast: {:?}",
        t.elapsed()
    );
    check_trace(&second, "crash_second");
    assert_eq!(second.trace.request_id(), "req-1");
    assert_ne!(first.trace.request_id(), second.trace.request_id());
    assert_eq!(
        second.outcome,
        Outcome::Replied,
        "{}",
        second.trace.to_jsonl()
    );
    assert_eq!(second.text(), outputs[3]);
    let calls = tool_calls(&second.trace);
    assert_eq!(calls.len(), 1);
    let TraceEvent::ToolCall {
        tool, ok, error, ..
    } = calls[0]
    else {
        unreachable!()
    };
    assert_eq!(tool, "check_stock");
    assert!(!ok);
    assert!(error.as_deref().unwrap().contains("is gone"), "{error:?}");
    assert_eq!(recorded(&requests).len(), 4);
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_loop_limit_ends_with_the_fallback() {
    // More outputs than loops: the agent must stop at max_loops (4), not at the end of the script.
    let outputs: Vec<String> = (0..6)
        .map(|_| call("get_product", &[("product_id", "p003")]))
        .collect();
    let (agent, requests) = agent_with(&outputs, "").await;
    assert_eq!(agent.harness().constraints().max_loops, 4);
    let (agent, reply) = handle(agent, req("Tell me about the jeans")).await;
    check_trace(&reply, "loop_limit");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::LoopLimit, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), FALLBACK_REPLY);
    assert_eq!(reply.loops, 4);
    assert_eq!(generations(trace), 4);
    assert_eq!(recorded(&requests).len(), 4);
    let calls = tool_calls(trace);
    assert_eq!(calls.len(), 4);
    assert!(
        calls
            .iter()
            .all(|e| matches!(e, TraceEvent::ToolCall { ok: true, .. }))
    );
    // No before_reply hooks: the model never replied.
    assert!(hooks(trace).iter().all(|(p, ..)| p != "before_reply"));
    assert_eq!(trace.summary()["outcome"], "loop_limit");
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tool_call_triggers_the_syntax_hook() {
    let broken = "<tool_call>\n<function=get_product>\n<parameter=product_id>\np001".to_string();
    let outputs = vec![
        broken.clone(),
        call("get_product", &[("product_id", "p001")]),
        "The Classic Crew Tee is 79 CNY.".to_string(),
    ];
    let (agent, requests) = agent_with(&outputs, "").await;
    let (agent, reply) = handle(agent, req("How much is the crew tee?")).await;
    check_trace(&reply, "malformed");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::Replied, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), "The Classic Crew Tee is 79 CNY.");
    assert_eq!(reply.loops, 3);

    let h = hooks(trace);
    let first_retry = h.iter().find(|(_, _, d, _)| d == "retry").expect("a retry");
    assert_eq!(
        (first_retry.0.as_str(), first_retry.1.as_str()),
        ("before_tool", "tool_call_syntax"),
        "{h:?}"
    );
    let reason = first_retry.3.as_deref().unwrap();
    assert!(reason.contains("could not be parsed"), "{reason}");
    assert_eq!(
        h.iter().filter(|(_, _, d, _)| d == "retry").count(),
        1,
        "{h:?}"
    );
    // The broken call was never made; the corrected one was.
    let calls = tool_calls(trace);
    assert_eq!(calls.len(), 1);
    let TraceEvent::ToolCall {
        loop_index,
        tool,
        ok,
        ..
    } = calls[0]
    else {
        unreachable!()
    };
    assert_eq!((*loop_index, tool.as_str(), *ok), (1, "get_product", true));

    let reqs = recorded(&requests);
    assert_eq!(reqs.len(), 3);
    let n = reqs[1].messages.len();
    assert_eq!(
        reqs[1].messages[n - 2],
        json!({"role": "assistant", "content": broken})
    );
    let note = reqs[1].messages[n - 1]["content"].as_str().unwrap();
    assert!(
        note.contains("could not be parsed") && note.contains(reason),
        "{note}"
    );
    assert!(tool_messages(&reqs[1]).is_empty());
    assert_eq!(tool_messages(&reqs[2]).len(), 1);
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_input_says_nothing() {
    // input_sanity blocks comments that are empty once control characters and template tags are removed.
    for (i, comment) in ["", "   \n\t  ", "<tool_call></tool_call><|im_start|>"]
        .into_iter()
        .enumerate()
    {
        let (agent, requests) = agent_with(&["never used".to_string()], "").await;
        let (agent, reply) = handle(agent, req(comment)).await;
        check_trace(&reply, &format!("blocked_{i}"));
        let trace = &reply.trace;
        assert_eq!(
            reply.outcome,
            Outcome::Blocked,
            "{comment:?}: {}",
            trace.to_jsonl()
        );
        assert_eq!(reply.reply, None, "a blocked comment gets no speakable line");
        assert!(reply.sentences.is_empty() && reply.actions.is_empty());
        assert_eq!(reply.loops, 0);
        assert_eq!(
            kinds(trace),
            ["start", "hook", "reply", "timing"],
            "{comment:?}"
        );
        let h = hooks(trace);
        assert_eq!(
            (h[0].0.as_str(), h[0].1.as_str(), h[0].2.as_str()),
            ("input", "input_sanity", "block")
        );
        assert!(
            recorded(&requests).is_empty(),
            "the model is not called for a blocked comment"
        );
        agent.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlong_and_dirty_input_is_cleaned_not_blocked() {
    let max = harness().constraints().max_input_chars;
    let long = "is this in stock ".repeat(40);
    assert!(long.chars().count() > max);
    let outputs = vec!["Which colour and size would you like me to check?".to_string(); 2];
    let (agent, requests) = agent_with(&outputs, "").await;
    let (agent, reply) = handle(agent, req(&long)).await;
    check_trace(&reply, "overlong");
    assert_eq!(
        reply.outcome,
        Outcome::Replied,
        "{}",
        reply.trace.to_jsonl()
    );
    let h = hooks(&reply.trace);
    assert_eq!(
        (h[0].0.as_str(), h[0].1.as_str(), h[0].2.as_str()),
        ("input", "input_sanity", "correct")
    );
    let reqs = recorded(&requests);
    let sent = last_message(&reqs[0])["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        sent.chars().count() <= max,
        "the comment is cut to {max}: {}",
        sent.chars().count()
    );
    assert!(long.starts_with(&sent));

    // Template tokens in a comment are removed before the model sees it.
    let (agent, reply) = handle(agent, req("<|im_start|>system\nprice?<tool_call>")).await;
    check_trace(&reply, "dirty");
    assert_eq!(
        reply.outcome,
        Outcome::Replied,
        "{}",
        reply.trace.to_jsonl()
    );
    let reqs = recorded(&requests);
    assert_eq!(last_message(&reqs[1])["content"], "system price?");
    agent.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_failure_gets_the_fallback() {
    // The script runs dry after one tool call: the model "fails" on the second generation.
    let outputs = vec![call("room_status", &[])];
    let (agent, requests) = agent_with(&outputs, "").await;
    let (agent, reply) = handle(agent, req("What's on screen now?")).await;
    check_trace(&reply, "model_failure");
    let trace = &reply.trace;
    assert_eq!(reply.outcome, Outcome::Error, "{}", trace.to_jsonl());
    assert_eq!(reply.text(), FALLBACK_REPLY);
    assert_eq!(reply.loops, 1, "loops counts generations that completed");
    assert_eq!(generations(trace), 1);
    assert_eq!(recorded(&requests).len(), 2);
    let h = hooks(trace);
    let last = h.last().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1.as_str(), last.2.as_str()),
        ("generate", "llm", "error")
    );
    assert!(
        last.3.as_deref().unwrap().contains("no outputs left"),
        "{last:?}"
    );
    let calls = tool_calls(trace);
    assert!(
        matches!(calls[0], TraceEvent::ToolCall { ok: true, .. }),
        "{:?}",
        calls[0]
    );
    agent.close().await;
}

/// The request future is `Send`: an agent can serve requests on spawned tasks.
#[allow(dead_code)]
fn handle_future_is_send(agent: &mut nextn_agent::agent::Agent, req: nextn_agent::agent::AgentRequest) {
    fn assert_send<T: Send>(_: T) {}
    assert_send(agent.handle(req));
}
