//! Harness-State Augmentation preserves the task: a scripted model that follows the *current* harness's tool
//! names (it reads them from the registry the variant builds, and checks they are in the tool list it was
//! sent) makes the same real MCP calls with the same arguments, and gets the same replies out, on the bundled
//! harness and on every variant — each dimension alone and all together, against the real commerce server.
//! A hook retry on a variant reaches the model in the variant's own feedback wording.
//!
//! Needs the commerce server binary (`cargo build -p nextn-commerce-mcp`, or `NEXTN_COMMERCE_MCP_BIN`).

mod common;
use common::commerce_bin;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nextn_agent::agent::{Agent, AgentRequest, Outcome};
use nextn_agent::llm::{ChatRequest, Generation, LlmClient, LlmError};
use nextn_agent::mcp::McpPool;
use nextn_agent::trace::TraceEvent;
use nextn_harness::{Dimension, Harness, PerturbOptions, ToolRegistry, ToolSpec};
use serde_json::Value;

/// One model turn, in terms of real tools: the client writes them under the names the harness shows.
#[derive(Clone)]
enum Step {
    Calls(Vec<(&'static str, Vec<(&'static str, &'static str)>)>),
    Reply(&'static str),
}

struct Following {
    steps: VecDeque<Step>,
    registry: ToolRegistry,
    requests: Arc<Mutex<Vec<ChatRequest>>>,
}

impl LlmClient for Following {
    fn name(&self) -> String {
        "scripted-following".into()
    }

    fn generate(&mut self, req: &ChatRequest) -> Result<Generation, LlmError> {
        self.requests.lock().unwrap().push(req.clone());
        let text = match self.steps.pop_front().ok_or(LlmError::Exhausted)? {
            Step::Reply(t) => t.to_string(),
            Step::Calls(calls) => {
                let offered: Vec<&str> = req.tools.iter().filter_map(|t| t["function"]["name"].as_str()).collect();
                let mut s = String::new();
                for (real, args) in calls {
                    let shown = self
                        .registry
                        .tools()
                        .iter()
                        .find(|t| t.real_name == real)
                        .map(|t| t.name.clone())
                        .ok_or_else(|| LlmError::InvalidRequest(format!("no tool for {real}")))?;
                    if !offered.contains(&shown.as_str()) {
                        return Err(LlmError::InvalidRequest(format!("`{shown}` is not in the tool list {offered:?}")));
                    }
                    s.push_str(&format!("<tool_call>\n<function={shown}>\n"));
                    for (k, v) in args {
                        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
                    }
                    s.push_str("</function>\n</tool_call>\n");
                }
                s
            }
        };
        Ok(Generation {
            prompt_tokens: 1,
            completion_tokens: 1,
            ttft_ms: 0.0,
            decode_tokens_per_s: 0.0,
            wall_ms: 0.0,
            finish_reason: "stop".into(),
            spec: None,
            text,
        })
    }
}

fn server_spec() -> String {
    format!("shop='{}'", commerce_bin().display())
}

/// What one run did: the real calls (server, tool, arguments, ok), outcome, reply, and the requests sent.
struct Run {
    calls: Vec<(String, String, Value, bool)>,
    outcome: Outcome,
    reply: String,
    requests: Vec<ChatRequest>,
}

async fn run(dir: &Path, steps: &[Step], comment: &str) -> Run {
    let harness = Harness::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let pool = McpPool::connect_all([server_spec()]).await.expect("commerce server");
    let registry = harness.tool_registry(specs_of(&pool)).unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let client = Following { steps: steps.iter().cloned().collect(), registry, requests: Arc::clone(&requests) };
    let mut agent = Agent::new(harness, Box::new(client), pool).unwrap();
    let reply = agent.handle(AgentRequest { comment: comment.into(), ..Default::default() }).await;
    agent.close().await;
    let calls = reply
        .trace
        .events()
        .filter_map(|e| match e {
            TraceEvent::ToolCall { server, tool, arguments, ok, .. } => {
                Some((server.clone(), tool.clone(), arguments.clone(), *ok))
            }
            _ => None,
        })
        .collect();
    let requests = requests.lock().unwrap().clone();
    Run { calls, outcome: reply.outcome, reply: reply.text().to_string(), requests }
}

/// The pool's tools as the harness types them.
fn specs_of(pool: &McpPool) -> Vec<ToolSpec> {
    pool.harness_tool_specs()
}

async fn tools() -> Vec<ToolSpec> {
    let pool = McpPool::connect_all([server_spec()]).await.expect("commerce server");
    let tools = specs_of(&pool);
    pool.close().await;
    tools
}

fn bundled() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harness/default")
}

const TWO_TOOLS: &str = "The Classic Crew Tee is 79 CNY, and Black in M is in stock right now!";

fn two_tools() -> Vec<Step> {
    vec![
        Step::Calls(vec![
            ("get_product", vec![("product_id", "p001")]),
            ("check_stock", vec![("product_id", "p001"), ("colour", "Black"), ("size", "M")]),
        ]),
        Step::Reply(TWO_TOOLS),
    ]
}

/// A promotion lookup, a reply with an invented discount (a hook asks again), then a clean reply.
fn retried() -> Vec<Step> {
    vec![
        Step::Calls(vec![("list_promotions", vec![("product_id", "p001")])]),
        Step::Reply("Take 87% off the tee today only!"),
        Step::Reply("Let me show you the tee's coupons right below."),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_variant_makes_the_same_real_calls_for_a_model_that_follows_its_names() {
    let specs = tools().await;
    let base_two = run(&bundled(), &two_tools(), "How much is the Classic Crew Tee, and is Black M in stock?").await;
    assert_eq!(base_two.outcome, Outcome::Replied);
    assert_eq!(base_two.reply, TWO_TOOLS);
    assert_eq!(base_two.calls.len(), 2);
    assert!(base_two.calls.iter().all(|c| c.3), "{:?}", base_two.calls);
    let base_retry = run(&bundled(), &retried(), "any coupon for the tee?").await;
    assert_eq!(base_retry.outcome, Outcome::Replied);
    assert_eq!(base_retry.requests.len(), 3, "the invented discount was sent back once");

    let tmp = std::env::temp_dir().join(format!("nextn-agent-perturb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut sets: Vec<Vec<Dimension>> = Dimension::ALL.iter().map(|d| vec![*d]).collect();
    sets.push(Dimension::ALL.to_vec());
    let mut renamed_somewhere = false;
    for dims in &sets {
        for (seed, strength) in [(11u64, 1.0), (12, 0.5)] {
            let out = tmp.join(format!("{}-{seed}", dims.iter().map(|d| d.name()).collect::<Vec<_>>().join("+")));
            let opts = PerturbOptions { seed, dims: dims.clone(), strength };
            let m = nextn_harness::perturb(&bundled(), &out, &opts, &specs).unwrap_or_else(|e| panic!("{opts:?}: {e}"));
            renamed_somewhere |= m.changes.iter().any(|c| c.kind == "rename_tool");
            let what = format!("{opts:?}");
            // The tool texts the model reads never name a tool by a name it no longer has.
            let reg = Harness::load(&out).unwrap().tool_registry(specs.clone()).unwrap();
            for c in m.changes.iter().filter(|c| c.kind == "rename_tool") {
                for t in reg.tools() {
                    let text = format!("{} {}", t.description, t.input_schema);
                    let stale = text.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).any(|w| w == c.before);
                    assert!(!stale, "{what}: {} still mentions `{}`: {text}", t.name, c.before);
                }
            }

            let v = run(&out, &two_tools(), "How much is the Classic Crew Tee, and is Black M in stock?").await;
            assert_eq!(v.calls, base_two.calls, "{what}: different real calls");
            assert_eq!((v.outcome, v.reply.as_str()), (Outcome::Replied, TWO_TOOLS), "{what}");

            let v = run(&out, &retried(), "any coupon for the tee?").await;
            assert_eq!(v.calls, base_retry.calls, "{what}: different real calls");
            assert_eq!(v.outcome, Outcome::Replied, "{what}: {}", v.reply);
            // The retry reached the model in this variant's feedback wording.
            let h = Harness::load(&out).unwrap();
            let template = &h.hooks_config().feedback.reply_retry;
            let (head, tail) = template.split_once("{reason}").unwrap();
            let last = v.requests[2].messages.last().unwrap()["content"].as_str().unwrap().to_string();
            assert!(last.starts_with(head) && last.ends_with(tail), "{what}: feedback `{last}` vs template `{template}`");
        }
    }
    assert!(renamed_somewhere, "no variant renamed a tool: the test would not test tool renames");
    let _ = std::fs::remove_dir_all(&tmp);
}
