//! `nextn harness perturb`: a task-preserving variant of a harness directory (Harness-State Augmentation).
//! The logic is `nextn_harness::perturb`; this file discovers the servers' tools and prints the result.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use nextn_agent::llm::{ChatRequest, LlmClient, OpenAiClient};
use nextn_agent::mcp::McpPool;
use nextn_harness::{Dimension, PerturbOptions, Rewriter, ToolSpec};
use serde_json::json;

use super::agent::default_mcp;

#[derive(clap::Args)]
#[command(after_help = "Dimensions (applied in this order):
  skill-id       rename skills, rewrite descriptions, add synthetic and noise skills, mask non-essential skills
  skill-content  paraphrase, reorder and mask non-essential skill rules
  tool-def       rename tools (tools.json `rename`: the registry maps the new name to the real MCP tool),
                 rewrite tool and parameter descriptions, update backticked mentions
  prompt         reorder prompt blocks and rules.md / faq.jsonl items; move max_reply_chars and max_loops
                 inside their valid ranges
  hook           retry budgets, feedback wording and structure, length truncate <-> retry, result cut

Essential (never masked or paraphrased): rules.md rules; skill rules listed in the front matter
`essential: [ID, ...]` or naming a tool (`backticked_name`), an action marker or a figure; skills in
router.always or with `essential: true`.

Output: DIR2 with every file of the variant and perturbation.json listing each change (dimension, kind,
target, file, before, after). The same DIR, seed, dims and strength give a byte-identical DIR2. The variant
is checked like `nextn harness check` before this command succeeds.

--llm URL: skill, tool and parameter descriptions the templates would rewrite are rewritten by that model
(OpenAI-compatible chat endpoint, temperature 0, seeded) instead; a rewrite that drops a backticked name, a
[marker] or a figure of the original, or is not one line of prose, is refused and recorded as
llm_rewrite_rejected (the template text stands). An endpoint error stops the command (exit 1).")]
pub struct PerturbArgs {
    /// The harness directory to perturb (it must pass `nextn harness check`).
    dir: PathBuf,
    /// Where to write the variant (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// Seed of every random choice.
    #[arg(long)]
    seed: u64,
    /// Comma-separated dimensions (default: all five).
    #[arg(long, default_value = "skill-id,skill-content,tool-def,prompt,hook")]
    dims: String,
    /// 0..1: the share of candidates each dimension touches (each dimension makes at least one change).
    #[arg(long, default_value_t = 0.5)]
    strength: f64,
    /// MCP servers whose tools may be renamed and redescribed (default: the bundled commerce server). Without
    /// any (`--offline`), only tools that tools.json names are perturbed.
    #[arg(long = "mcp")]
    mcp: Vec<String>,
    /// Start no MCP server.
    #[arg(long)]
    offline: bool,
    /// Print the manifest as JSON (with the variant's content hash) instead of a summary.
    #[arg(long)]
    json: bool,
    /// An OpenAI-compatible base URL (`http://host:port/v1`) whose model rewrites descriptions (see below).
    #[arg(long)]
    llm: Option<String>,
    /// Model name sent to the `--llm` endpoint.
    #[arg(long, default_value = "default")]
    llm_model: String,
    /// Bearer token for the `--llm` endpoint (default: $NEXTN_LLM_API_KEY).
    #[arg(long)]
    llm_api_key: Option<String>,
}

/// Descriptions rewritten by a chat model (`--llm`).
struct LlmRewriter {
    client: OpenAiClient,
    seed: u64,
}

impl Rewriter for LlmRewriter {
    fn name(&self) -> String {
        self.client.name()
    }
    fn rewrite(&mut self, what: &str, text: &str) -> Result<String, String> {
        let system = "You rewrite short descriptions in a shop assistant's configuration. Reply with the rewritten \
                      text only: one line, the same meaning in different words. Keep every `backticked` name, every \
                      [bracketed] marker and every number exactly as written.";
        let mut req = ChatRequest::new(vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": format!("Rewrite this {what}:\n{text}")}),
        ]);
        req.max_tokens = 160;
        req.seed = Some(self.seed);
        req.enable_thinking = Some(false);
        self.client.generate(&req).map(|g| g.text).map_err(|e| e.to_string())
    }
}

/// The tools the servers list (`specs`: `--mcp` values); servers that fail to start are warnings.
pub(crate) fn discover_tools(specs: &[String]) -> anyhow::Result<Vec<ToolSpec>> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (pool, failures) =
            McpPool::connect_each(specs.iter().map(String::as_str), Duration::from_secs(5), deadline).await;
        for f in &failures {
            eprintln!("warning: {}: {}", f.spec, f.error);
        }
        let tools: Vec<ToolSpec> = pool.harness_tool_specs();
        pool.close().await;
        tools
    }))
}

pub fn run(args: PerturbArgs) -> anyhow::Result<()> {
    let dims = Dimension::parse_list(&args.dims)?;
    let opts = PerturbOptions { seed: args.seed, dims, strength: args.strength };
    let tools = if args.offline {
        Vec::new()
    } else {
        let specs = if args.mcp.is_empty() { vec![default_mcp()?] } else { args.mcp.clone() };
        discover_tools(&specs)?
    };
    let mut rewriter = match &args.llm {
        Some(url) => {
            let mut client = OpenAiClient::new(url.clone(), args.llm_model.clone())?;
            if let Some(key) = args.llm_api_key.clone().or_else(|| std::env::var("NEXTN_LLM_API_KEY").ok()) {
                client = client.with_api_key(key);
            }
            Some(LlmRewriter { client, seed: args.seed })
        }
        None => None,
    };
    let manifest = nextn_harness::perturb_with(
        &args.dir,
        &args.out,
        &opts,
        &tools,
        rewriter.as_mut().map(|r| r as &mut dyn Rewriter),
    )?;
    let version = nextn_harness::content_hash(&args.out).with_context(|| format!("hashing {}", args.out.display()))?;
    if args.json {
        outln!("{}", json!({"out": args.out, "version": version, "manifest": manifest}));
        return Ok(());
    }
    outln!("{} ({}) -> {} ({})", args.dir.display(), manifest.source_version, args.out.display(), version);
    for (dim, n) in manifest.counts() {
        outln!("  {dim}: {n} changes");
    }
    if let Some(r) = &manifest.rewriter {
        let refused = manifest.changes.iter().filter(|c| c.kind == "llm_rewrite_rejected").count();
        outln!("  descriptions rewritten by {r}; {refused} rewrites refused (template text kept)");
    }
    for c in &manifest.changes {
        let arrow = match (c.before.is_empty(), c.after.is_empty()) {
            (true, _) => format!("+ {}", c.after),
            (_, true) => format!("- {}", c.before),
            _ => format!("{} -> {}", c.before, c.after),
        };
        outln!("  [{}] {} {} ({}): {}", c.dimension, c.kind, c.target, c.file, arrow.replace('\n', "\\n"));
    }
    outln!("manifest: {}", args.out.join(nextn_harness::MANIFEST).display());
    Ok(())
}
