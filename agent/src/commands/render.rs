//! `nextn harness render`: exactly what `nextn agent` sends the model, for scripted conversations.
//!
//! Each case runs through the real agent loop — input hooks, the room (from `room_status` when the case has
//! none), the harness prompt, the real MCP tools, `after_tool` / `before_reply` hooks and their retry
//! messages — with a scripted model that answers with the case's `turns`. Every model request is rendered
//! with the model directory's chat template, so a trainer consumes byte-identical prompts.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nextn_agent::agent::{Agent, AgentRequest};
use nextn_agent::llm::{render_prompt_text, ScriptedClient};
use nextn_agent::mcp::McpPool;
use nextn_agent::trace::TraceEvent;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_harness::{Harness, RoomFile};
use serde::Deserialize;
use serde_json::{json, Value};

use super::agent::{default_mcp, harness_dir, read_history, read_room};
use super::common::model_dir;

#[derive(clap::Args)]
pub struct RenderArgs {
    /// One comment to render (the first request the agent sends, or the whole conversation with --reply).
    #[arg(long, conflicts_with = "cases")]
    comment: Option<String>,
    /// Scripted model outputs for --comment, in order (tool calls in the Qwen XML format, or a reply).
    #[arg(long = "reply")]
    replies: Vec<String>,
    /// Earlier turns for --comment: a JSON file holding a list of {"role", "content"}, or that list itself.
    #[arg(long, value_name = "FILE|JSON")]
    history: Option<String>,
    /// Live-room state for --comment: a JSON file holding {"room": {...}, "products": [...]}, or that object itself.
    #[arg(long, value_name = "FILE|JSON")]
    room: Option<String>,
    /// JSON lines, one case each: {"id", "comment", "history"?: [{role, content}], "room"?: {room, products},
    /// "turns": [model output, ...]}.
    #[arg(long)]
    cases: Option<PathBuf>,
    /// Harness directory. Default: the harness profile the model directory (--model, or the bundled model)
    /// declares in its nextn.json (the bundled model: harness/live-tiny); for a model that declares none, the
    /// bundled harness/default. Each line reports the directory used as `harness`.
    #[arg(long)]
    harness: Option<PathBuf>,
    /// MCP servers (as `nextn agent --mcp`). Default: the bundled commerce server.
    #[arg(long = "mcp")]
    mcp: Vec<String>,
    /// Model directory whose chat template (and, with --ids, tokenizer) renders the prompts. Default: the
    /// bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Also print each prompt's token ids under this model's tokenizer.
    #[arg(long)]
    ids: bool,
}

#[derive(Deserialize)]
struct Case {
    #[serde(default)]
    id: String,
    comment: String,
    #[serde(default)]
    history: Vec<Turn>,
    #[serde(default)]
    room: Option<RoomFile>,
    #[serde(default)]
    turns: Vec<String>,
}

#[derive(Deserialize)]
struct Turn {
    role: String,
    content: String,
}

/// Renders every case and prints one JSON line per case:
/// `{"id", "harness", "harness_version", "outcome", "reply", "loops", "requests": [{"prompt", "prompt_ids"?,
/// "completion", "messages", "tools", "temperature", "seed", "banned_prefixes"}], "unused_turns", "events": [tool
/// calls, hooks, faults, notices]}` (`messages` / `tools` / `temperature` / `seed` / `banned_prefixes`: the chat
/// request as the agent built it; `prompt` is their rendering).
/// `completion` is the scripted output that answered the request (`null` when the script ran out).
pub fn render(args: RenderArgs) -> anyhow::Result<()> {
    let model = model_dir(args.model.clone())?;
    let dir = harness_dir(args.harness.as_deref(), Some(&model))?;
    let harness = Harness::load(&dir).with_context(|| format!("harness {}", dir.display()))?;
    let used = HarnessUsed { dir: dir.display().to_string(), version: harness.version().to_string() };
    let bundle = TokenizerBundle::load(&model).with_context(|| format!("tokenizer files in {}", model.display()))?;
    if bundle.chat_template().is_none() {
        bail!("{} has no chat template", model.display());
    }
    let cases = read_cases(&args)?;
    let specs = if args.mcp.is_empty() { vec![default_mcp()?] } else { args.mcp.clone() };
    let per_server = Duration::from_millis(harness.constraints().tool_timeout_ms);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = runtime.block_on(async {
        let (pool, failures) = McpPool::connect_each(specs.iter().map(String::as_str), per_server, Instant::now() + Duration::from_secs(30)).await;
        if let Some(f) = failures.first() {
            bail!("MCP server {} did not start: {}", f.spec, f.error);
        }
        let mut agent = Agent::new(harness, Box::new(ScriptedClient::new(Vec::<String>::new())), pool)?;
        let mut out = std::io::stdout().lock();
        for case in cases {
            let line = render_case(&mut agent, &bundle, &used, case, args.ids).await?;
            writeln!(out, "{line}")?;
        }
        out.flush()?;
        agent.close().await;
        anyhow::Ok(())
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

fn read_cases(args: &RenderArgs) -> anyhow::Result<Vec<Case>> {
    if let Some(comment) = &args.comment {
        let history = match &args.history {
            Some(p) => read_history(p)?.into_iter().map(|(role, content)| Turn { role, content }).collect(),
            None => Vec::new(),
        };
        let room = args.room.as_deref().map(read_room).transpose()?;
        return Ok(vec![Case { id: "comment".into(), comment: comment.clone(), history, room, turns: args.replies.clone() }]);
    }
    let Some(path) = &args.cases else { bail!("give --comment TEXT or --cases FILE.jsonl") };
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut cases = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let mut case: Case = serde_json::from_str(&line).with_context(|| format!("{}:{}: not a render case", path.display(), i + 1))?;
        if case.id.is_empty() {
            case.id = format!("line-{}", i + 1);
        }
        cases.push(case);
    }
    Ok(cases)
}

/// The harness the cases render with, for every output line.
struct HarnessUsed {
    dir: String,
    version: String,
}

async fn render_case(agent: &mut Agent, bundle: &TokenizerBundle, harness: &HarnessUsed, case: Case, ids: bool) -> anyhow::Result<Value> {
    let turns = case.turns.clone();
    let client = ScriptedClient::new(turns.iter().cloned());
    let recorded = client.requests();
    agent.replace_llm(Box::new(client));
    let mut request = AgentRequest {
        comment: case.comment,
        history: case.history.into_iter().map(|t| (t.role, t.content)).collect(),
        received: Some(Instant::now()),
        ..Default::default()
    };
    if let Some(room) = case.room {
        request.room = room.room;
        request.products = room.products;
    }
    let reply = agent.handle(request).await;
    let recorded = recorded.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut requests = Vec::new();
    for (i, req) in recorded.iter().enumerate() {
        let prompt = render_prompt_text(bundle, req).with_context(|| format!("case {}: rendering request {i}", case.id))?;
        let mut r = json!({"prompt": prompt, "completion": turns.get(i), "messages": req.messages, "tools": req.tools,
            "temperature": req.temperature, "seed": req.seed, "banned_prefixes": req.banned_prefixes});
        if ids {
            let tokenizer = bundle.require_tokenizer()?;
            r["prompt_ids"] = json!(tokenizer.encode(&prompt, false)?);
        }
        requests.push(r);
    }
    let events: Vec<Value> = reply
        .trace
        .events()
        .filter(|e| matches!(e, TraceEvent::ToolCall { .. } | TraceEvent::Hook { .. } | TraceEvent::Fault { .. } | TraceEvent::Notice { .. }))
        .filter_map(|e| serde_json::to_value(e).ok())
        .collect();
    Ok(json!({
        "id": case.id,
        "harness": harness.dir,
        "harness_version": harness.version,
        "outcome": reply.outcome.as_str(),
        "reply": reply.reply,
        "actions": reply.actions,
        "loops": reply.loops,
        "requests": requests,
        "unused_turns": turns.len().saturating_sub(recorded.len()),
        "events": events,
    }))
}
