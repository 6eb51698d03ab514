//! `nextn agent`: answer one viewer comment with the harness, MCP tools and a model; `nextn harness check`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nextn_agent::agent::{Agent, AgentReply, AgentRequest, Outcome, StartupFault};
use nextn_agent::llm::{served_harness, LlmClient, LlmError, LocalEngine, OpenAiClient};
use nextn_agent::mcp::McpPool;
use nextn_engine::{Device, EngineConfig, ModelConfig};
use nextn_harness::{Harness, RoomFile};
use serde_json::json;

use super::common::{draft_vocab, model_dir, set_threads, spec_config, Spec};

#[derive(clap::Args)]
pub struct Args {
    /// The viewer comment to answer.
    #[arg(long)]
    comment: String,
    /// Earlier turns: a JSON file holding a list of {"role": "user"|"assistant", "content": ...}, or that list
    /// itself (an argument starting with `[`).
    #[arg(long, value_name = "FILE|JSON")]
    history: Option<String>,
    /// Live-room state: a JSON file holding {"room": {...}, "products": [...]}, or that object itself (an
    /// argument starting with `{`). Without it, a connected server's `room_status` tool fills the room block.
    #[arg(long, value_name = "FILE|JSON")]
    room: Option<String>,
    /// Harness directory (skills, rules, FAQ, hooks, limits). Default: with `--llm local`, the harness profile
    /// the model directory declares in its nextn.json (the bundled model: harness/live-tiny, the compact
    /// profile it was trained on); with `--llm URL`, the one the served model declares when the endpoint is
    /// `nextn serve` (its /v1/models says which) and that directory is on this machine; otherwise the bundled
    /// harness/default. `--json` reports the directory used as `harness`.
    #[arg(long)]
    harness: Option<PathBuf>,
    /// MCP servers: a command line ("cmd args", stdio) or a Streamable HTTP URL; `name=...` names it.
    /// Repeatable. Default: the bundled commerce server. A server that does not start is recorded in the
    /// trace and the agent answers without its tools.
    #[arg(long = "mcp")]
    mcp: Vec<String>,
    /// `local` (in-process engine on --model, default the bundled model) or an OpenAI-compatible base URL
    /// (`http://host:port/v1`). Endpoint failures end in the harness fallback with a trace, exit 0.
    #[arg(long, default_value = "local")]
    llm: String,
    /// Model name sent to an OpenAI-compatible endpoint.
    #[arg(long, default_value = "default")]
    llm_model: String,
    /// Bearer token for the OpenAI-compatible endpoint (default: $NEXTN_LLM_API_KEY).
    #[arg(long)]
    llm_api_key: Option<String>,
    /// Model directory for `--llm local`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute device of `--llm local`: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Speculative decoding for `--llm local`: `mtp` (the model's MTP head drafts) or `off`.
    #[arg(long, value_enum, default_value_t = Spec::Mtp)]
    spec: Spec,
    /// Draft tokens per speculation round (1..=8; 0 = off, as --spec off).
    #[arg(long, default_value_t = 3)]
    draft_steps: usize,
    /// Reduced draft vocabulary for `--llm local` (replies unchanged; see `nextn generate --help`): N = the
    /// first N ids of the model's draft_vocab.txt, else a token-id file.
    #[arg(long, value_name = "FILE|N")]
    draft_vocab: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Append the request's trace (JSON lines) to this file (written for every outcome).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// CPU worker threads for the local engine (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print {"reply", "sentences", "actions", "outcome", "loops", "harness", "harness_version", "trace_summary"}
    /// instead of the reply text.
    #[arg(long, conflicts_with = "stream")]
    json: bool,
    /// Print JSON lines for the avatar: {"sentence": ...} as each sentence of the reply is ready, then
    /// {"actions": [...]}, then {"summary": {...}}.
    #[arg(long)]
    stream: bool,
}

fn bundled(rel: &str) -> Option<PathBuf> {
    [Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel), PathBuf::from(rel)].into_iter().find(|p| p.exists())
}

/// The bundled commerce MCP server: the binary built next to this one.
pub(crate) fn default_mcp() -> anyhow::Result<String> {
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

/// The harness directory: `--harness`, else the profile the in-process model (`local_model`) declares in its
/// nextn.json, else the bundled harness/default ([`nextn_harness::choose_harness`]).
pub(crate) fn harness_dir(flag: Option<&Path>, local_model: Option<&Path>) -> anyhow::Result<PathBuf> {
    Ok(nextn_harness::choose_harness(flag, local_model, || bundled("harness/default"))?)
}

fn api_key(args: &Args) -> Option<String> {
    args.llm_api_key.clone().or_else(|| std::env::var("NEXTN_LLM_API_KEY").ok())
}

/// The LLM client for `--llm`: the in-process engine on `local_model` (`--llm local`), else the endpoint.
/// Caller mistakes (a model directory that does not load) are errors here.
fn llm_client(args: &Args, local_model: Option<&Path>) -> anyhow::Result<Box<dyn LlmClient>> {
    let Some(dir) = local_model else {
        let mut client = OpenAiClient::new(args.llm.clone(), args.llm_model.clone())?;
        if let Some(key) = api_key(args) {
            client = client.with_api_key(key);
        }
        return Ok(Box::new(client));
    };
    let spec = spec_config(args.spec, args.draft_steps);
    let vocab = ModelConfig::from_path(dir).with_context(|| format!("{}", dir.display()))?.vocab_size;
    let draft_vocab = draft_vocab(args.draft_vocab.as_deref(), spec.is_some(), Some(dir), vocab, false)?;
    match LocalEngine::load_on(dir, args.device, EngineConfig { spec, draft_vocab, ..EngineConfig::default() }) {
        Ok(engine) => Ok(Box::new(engine.client())),
        Err(LlmError::NoMtpHead(d)) => {
            eprintln!("note: {d} has no MTP head; running without speculation");
            Ok(Box::new(LocalEngine::load_on(dir, args.device, EngineConfig::default())?.client()))
        }
        Err(e) => Err(e.into()),
    }
}

/// The JSON a `--history` / `--room` argument gives, with what to call it in errors: the file it names, or the
/// argument itself when it starts with `open` (`[` or `{`) and is no file.
pub(crate) fn json_arg(flag: &str, arg: &str, open: char) -> anyhow::Result<(String, String)> {
    let path = Path::new(arg);
    if !path.exists() && arg.trim_start().starts_with(open) {
        return Ok((arg.to_string(), format!("{flag} (inline JSON)")));
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{flag}: reading {arg} (a JSON file, or JSON starting with `{open}`)"))?;
    Ok((text, arg.to_string()))
}

/// `--history`: a file or inline JSON list of `{"role", "content"}` messages.
pub(crate) fn read_history(arg: &str) -> anyhow::Result<Vec<(String, String)>> {
    let (text, source) = json_arg("--history", arg, '[')?;
    let turns: Vec<serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("{source}: expected a JSON list of messages"))?;
    let mut out = Vec::new();
    for (i, t) in turns.iter().enumerate() {
        let (Some(role), Some(content)) = (t["role"].as_str(), t["content"].as_str()) else {
            bail!("{source}: message {i} needs string `role` and `content`");
        };
        out.push((role.to_string(), content.to_string()));
    }
    Ok(out)
}

/// `--room`: a file or inline JSON `{"room": ..., "products": [...]}`.
pub(crate) fn read_room(arg: &str) -> anyhow::Result<RoomFile> {
    let (text, source) = json_arg("--room", arg, '{')?;
    Ok(RoomFile::parse(Path::new(&source), &text)?)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    set_threads(args.threads)?;
    // 1. The caller's own inputs: any problem here is exit 1.
    if args.llm != "local" && args.device != Device::Cpu {
        bail!("--device {} runs the in-process engine (--llm local); the endpoint {} decides its own device", args.device, args.llm);
    }
    let local_model = if args.llm == "local" { Some(model_dir(args.model.clone())?) } else { None };
    let served = match args.harness.is_none() && local_model.is_none() {
        true => served_harness(&args.llm, &args.llm_model, api_key(&args)),
        false => None,
    };
    let dir = match &served {
        Some((dir, _)) => dir.clone(),
        None => harness_dir(args.harness.as_deref(), local_model.as_deref())?,
    };
    let harness = Harness::load(&dir).with_context(|| format!("harness {}", dir.display()))?;
    if let Some((_, version)) = &served
        && harness.version() != version
    {
        eprintln!(
            "note: harness {} here is version {}, the server reports {version} (edited since the server started?)",
            dir.display(),
            harness.version()
        );
    }
    let mut request = AgentRequest { comment: args.comment.clone(), ..Default::default() };
    if let Some(arg) = &args.history {
        request.history = read_history(arg)?;
    }
    if let Some(arg) = &args.room {
        let room = read_room(arg)?;
        request.room = room.room;
        request.products = room.products;
    }
    let llm = llm_client(&args, local_model.as_deref())?;
    let specs = if args.mcp.is_empty() { vec![default_mcp()?] } else { args.mcp.clone() };

    // 2. The request: its budget covers MCP start-up and handshakes, every model call, tool call and hook.
    let received = Instant::now();
    request.received = Some(received);
    let budget = Duration::from_millis(harness.constraints().request_budget_ms);
    let per_server = Duration::from_millis(harness.constraints().tool_timeout_ms);
    let version = harness.version().to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let stream = args.stream;
    let reply: AgentReply = runtime.block_on(async {
        let (pool, failures) = McpPool::connect_each(specs.iter().map(String::as_str), per_server, received + budget).await;
        let mut agent = Agent::new(harness, llm, pool)?;
        agent.add_startup_faults(failures.into_iter().map(|f| StartupFault {
            stage: "mcp_connect".into(),
            target: f.spec,
            error: f.error.to_string(),
        }));
        agent.settings.max_tokens = args.max_tokens;
        agent.settings.temperature = args.temperature;
        agent.settings.top_p = args.top_p;
        agent.settings.seed = args.seed;
        let mut print_sentence = |s: &str| {
            if stream {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", json!({"sentence": s}));
                let _ = out.flush();
            }
        };
        let reply = agent.handle_streaming(request, &mut print_sentence).await;
        agent.close().await;
        anyhow::Ok(reply)
    })?;
    // The LLM client is dropped inside the runtime's future above; the runtime itself goes here, off it.
    runtime.shutdown_timeout(Duration::from_secs(2));

    if let Some(path) = &args.trace {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).with_context(|| format!("opening {}", path.display()))?;
        reply.trace.write_jsonl(&mut f)?;
    }
    let actions = serde_json::to_value(&reply.actions)?;
    if args.stream {
        outln!("{}", json!({"actions": actions}));
        outln!("{}", json!({"summary": summary(&reply, &dir, &version)}));
    } else if args.json {
        let mut obj = summary(&reply, &dir, &version);
        obj["trace_summary"] = reply.trace.summary();
        outln!("{obj}");
    } else if let Some(text) = &reply.reply {
        outln!("{text}");
        if reply.outcome != Outcome::Replied {
            // The fallback line went out: say why on stderr (stdout stays the reply, the exit code 0).
            let t = reply.trace.summary();
            let why = t["faults"].as_array().and_then(|f| f.first()).and_then(|f| f["error"].as_str()).map(|e| format!(": {e}"));
            eprintln!("({}: the harness fallback line was sent{}; see --json or --trace)", reply.outcome.as_str(), why.unwrap_or_default());
        }
    } else {
        eprintln!("(blocked: nothing is said; see --json or --trace for why)");
    }
    Ok(())
}

/// The output contract shared by `--json` and the `--stream` summary line.
fn summary(reply: &AgentReply, harness: &Path, version: &str) -> serde_json::Value {
    let t = reply.trace.summary();
    json!({
        "reply": reply.reply,
        "sentences": reply.sentences,
        "actions": reply.actions,
        "outcome": reply.outcome.as_str(),
        "loops": reply.loops,
        "harness": harness.display().to_string(),
        "harness_version": version,
        "wall_ms": t["timing"]["wall_ms"],
        "time_to_first_sentence_ms": t["time_to_first_sentence_ms"],
        "faults": t["faults"],
    })
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// Harness directory to validate.
    dir: PathBuf,
    /// MCP servers whose tools the harness may name (default: the bundled commerce server, when built);
    /// tools named by skills or tools.json that none of them offers are warnings.
    #[arg(long = "mcp")]
    mcp: Vec<String>,
    /// Do not start any MCP server (skip the tool-reference check).
    #[arg(long)]
    offline: bool,
    #[arg(long)]
    json: bool,
}

/// Tool names the servers offer, for the tool-reference check; `None` when no server was asked.
fn offered_tools(args: &CheckArgs) -> anyhow::Result<Option<Vec<String>>> {
    if args.offline {
        return Ok(None);
    }
    let specs = if args.mcp.is_empty() {
        match default_mcp() {
            Ok(s) => vec![s],
            Err(_) => return Ok(None),
        }
    } else {
        args.mcp.clone()
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let names = runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (pool, failures) = McpPool::connect_each(specs.iter().map(String::as_str), Duration::from_secs(5), deadline).await;
        for f in &failures {
            eprintln!("warning: {}: {}", f.spec, f.error);
        }
        let names: Vec<String> = pool.tools().iter().map(|t| t.name.clone()).collect();
        pool.close().await;
        names
    });
    Ok(Some(names))
}

/// `nextn harness check DIR`: exit 1 when any finding is an error. The same validation runs when the agent
/// loads a harness, so what check refuses the runtime refuses.
pub fn check(args: CheckArgs) -> anyhow::Result<()> {
    let mut findings = nextn_harness::check(&args.dir);
    if !nextn_harness::has_errors(&findings)
        && let Some(offered) = offered_tools(&args)?
        && let Ok(h) = Harness::load(&args.dir)
    {
        findings.extend(nextn_harness::check_tool_references(&h.tool_references(), &offered));
    }
    if args.json {
        let list: Vec<serde_json::Value> = findings.iter().map(|f| json!({"finding": f.to_string(), "severity": f.severity})).collect();
        outln!("{}", json!({"dir": args.dir, "findings": list, "ok": !nextn_harness::has_errors(&findings)}));
    } else {
        for f in &findings {
            outln!("{f}");
        }
        if findings.is_empty() {
            outln!("{}: ok", args.dir.display());
        }
    }
    if nextn_harness::has_errors(&findings) {
        bail!("{}: the harness has errors", args.dir.display());
    }
    Ok(())
}
