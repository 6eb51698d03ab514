//! `nextn agent`: answer one viewer comment with the harness, MCP tools and a model; `nextn harness check`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use nextn_agent::agent::{Agent, AgentRequest};
use nextn_agent::llm::{EngineClient, LlmClient, OpenAiClient};
use nextn_agent::mcp::McpPool;
use nextn_engine::spec::SpecConfig;
use nextn_harness::{Harness, RoomFile};
use serde_json::json;

use super::common::{model_dir, set_threads};

#[derive(clap::Args)]
pub struct Args {
    /// The viewer comment to answer.
    #[arg(long)]
    comment: String,
    /// Earlier turns: a JSON list of {"role": "user"|"assistant", "content": ...}.
    #[arg(long)]
    history: Option<PathBuf>,
    /// Live-room state: JSON {"room": {...}, "products": [...]}.
    #[arg(long)]
    room: Option<PathBuf>,
    /// Harness directory (skills, rules, FAQ, hooks). Default: the bundled harness/default.
    #[arg(long)]
    harness: Option<PathBuf>,
    /// MCP servers: a command line ("cmd args", stdio) or a Streamable HTTP URL; `name=...` names it.
    /// Repeatable. Default: the bundled commerce server.
    #[arg(long = "mcp")]
    mcp: Vec<String>,
    /// `local` (in-process engine on --model, default the bundled model) or an OpenAI-compatible base URL.
    #[arg(long, default_value = "local")]
    llm: String,
    /// Model name sent to an OpenAI-compatible endpoint.
    #[arg(long, default_value = "default")]
    llm_model: String,
    /// Model directory for `--llm local`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// MTP speculation for `--llm local` (draft steps; 0 = off). Used only when the model has an MTP head.
    #[arg(long, default_value_t = 3)]
    draft_steps: usize,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Append the request's trace (JSON lines) to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// CPU worker threads for the local engine (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print {"reply", "outcome", "loops", "harness_version", "trace_summary"} instead of the reply text.
    #[arg(long)]
    json: bool,
}

fn bundled(rel: &str) -> Option<PathBuf> {
    [Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel), PathBuf::from(rel)].into_iter().find(|p| p.exists())
}

/// The bundled commerce MCP server: the binary built next to this one.
fn default_mcp() -> anyhow::Result<String> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let dir = exe.parent().context("executable has no directory")?;
    let bin = dir.join(format!("nextn-commerce-mcp{}", std::env::consts::EXE_SUFFIX));
    if !bin.is_file() {
        bail!(
            "no --mcp given and the bundled commerce server was not found at {} (build it: cargo build --release -p nextn-commerce-mcp)",
            bin.display()
        );
    }
    Ok(format!("commerce={}", bin.display()))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    set_threads(args.threads)?;
    let harness_dir = match &args.harness {
        Some(d) => d.clone(),
        None => bundled("harness/default").context("no --harness given and harness/default was not found")?,
    };
    let harness = Harness::load(&harness_dir).with_context(|| format!("harness {}", harness_dir.display()))?;
    let mut request = AgentRequest { comment: args.comment.clone(), ..Default::default() };
    if let Some(path) = &args.history {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let turns: Vec<serde_json::Value> =
            serde_json::from_str(&text).with_context(|| format!("{}: expected a JSON list of messages", path.display()))?;
        for (i, t) in turns.iter().enumerate() {
            let (Some(role), Some(content)) = (t["role"].as_str(), t["content"].as_str()) else {
                bail!("{}: message {i} needs string `role` and `content`", path.display());
            };
            request.history.push((role.to_string(), content.to_string()));
        }
    }
    if let Some(path) = &args.room {
        let room = RoomFile::load(path)?;
        request.room = room.room;
        request.products = room.products;
    }
    let llm: Box<dyn LlmClient> = if args.llm == "local" {
        let dir = model_dir(args.model.clone())?;
        let probe = nextn_engine::ModelConfig::from_path(&dir)?;
        let spec = (args.draft_steps > 0 && probe.mtp_num_hidden_layers > 0).then_some(SpecConfig { draft_steps: args.draft_steps });
        match EngineClient::load(&dir, spec) {
            Ok(c) => Box::new(c),
            // A checkpoint without mtp.* tensors: run without speculation rather than refuse.
            Err(e) if spec.is_some() && e.to_string().contains("MTP") => Box::new(EngineClient::load(&dir, None)?),
            Err(e) => return Err(e.into()),
        }
    } else {
        Box::new(OpenAiClient::new(args.llm.clone(), args.llm_model.clone())?)
    };
    let specs = if args.mcp.is_empty() { vec![default_mcp()?] } else { args.mcp.clone() };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let reply = runtime.block_on(async {
        let pool = McpPool::connect_all(specs.iter().map(String::as_str)).await?;
        let mut agent = Agent::new(harness, llm, pool)?;
        agent.settings.max_tokens = args.max_tokens;
        agent.settings.temperature = args.temperature;
        agent.settings.seed = args.seed;
        let reply = agent.handle(request).await;
        let version = agent.harness().version().to_string();
        agent.close().await;
        anyhow::Ok((reply, version))
    })?;
    let (reply, version) = reply;
    if let Some(path) = &args.trace {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        reply.trace.write_jsonl(&mut f)?;
    }
    if args.json {
        let obj = json!({
            "reply": reply.reply,
            "outcome": reply.outcome.as_str(),
            "loops": reply.loops,
            "harness_version": version,
            "trace_summary": reply.trace.summary(),
        });
        println!("{obj}");
    } else {
        println!("{}", reply.reply);
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// Harness directory to validate.
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

/// `nextn harness check DIR`: exit 1 when any finding is an error.
pub fn check(args: CheckArgs) -> anyhow::Result<()> {
    let findings = nextn_harness::check(&args.dir);
    if args.json {
        let list: Vec<serde_json::Value> = findings.iter().map(|f| json!({"finding": f.to_string()})).collect();
        println!("{}", json!({"dir": args.dir, "findings": list, "ok": !nextn_harness::has_errors(&findings)}));
    } else {
        for f in &findings {
            println!("{f}");
        }
        if findings.is_empty() {
            println!("{}: ok", args.dir.display());
        }
    }
    if nextn_harness::has_errors(&findings) {
        bail!("{}: the harness has errors", args.dir.display());
    }
    Ok(())
}
