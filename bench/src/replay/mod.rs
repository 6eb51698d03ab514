//! `nextn-bench replay`: the deployment replay — a fixed case set through the complete agent (harness, real
//! MCP servers, the engine or an OpenAI-compatible endpoint) at several concurrencies, with and without MTP,
//! measured end to end (latency percentiles, TTFT, decode speed, 15 s attainment) and scored without a judge
//! (tool correctness and order, reply coverage, grounding, rule violations, language), optionally with one.
//!
//! * [`cases`]: the case file (`bench/data/live_cases.jsonl`, schema in `bench/data/README.md`).
//! * [`run`]: agents, the request queue, per-request records; the LLM adapter ([`run::LlmSource`]).
//! * [`metrics`]: the judge-free quality metrics, pure functions.
//! * [`report`]: the summary per concurrency × spec, tables, output files.
//! * [`plot`]: the latency CDF and per-stage SVGs.
//! * [`judge`]: the optional judge over an OpenAI-compatible endpoint, through `harness/judge/`.
//! * [`variants`]: `--harness-variants N`: the cases under perturbed harnesses, the original-vs-variant gap.
//! * [`compare`]: `nextn-bench compare A B`: two harness versions, paired per-category deltas, a verdict.

pub mod cases;
pub mod compare;
pub mod judge;
pub mod metrics;
pub mod plot;
pub mod report;
pub mod run;
pub mod variants;

use std::path::{Path, PathBuf};
use std::time::Instant;

use run::{LlmTarget, ReplayConfig, RequestRecord, SpecMode};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Case file (JSON lines; see bench/data/README.md).
    #[arg(long, default_value = "bench/data/live_cases.jsonl")]
    pub cases: PathBuf,
    /// Requests in flight at once; a comma-separated list runs each.
    #[arg(long, default_value = "1")]
    pub concurrency: String,
    /// `off`, `mtp` or both (`off,mtp`); ignored with `--llm URL` (the endpoint decides).
    #[arg(long, default_value = "off,mtp")]
    pub spec: String,
    /// MTP draft steps.
    #[arg(long, default_value_t = 3)]
    pub draft_steps: usize,
    /// Reduced draft vocabulary for `--llm local` with MTP: N (the first N ids of the model's
    /// draft_vocab.txt) or a token-id file. Replies are unchanged; the acceptance length may drop.
    #[arg(long, value_name = "FILE|N")]
    pub draft_vocab: Option<String>,
    /// The first N cases warm each group up and are left out of the summary.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// `local` (in-process engine on --model) or an OpenAI-compatible base URL.
    #[arg(long, default_value = "local")]
    pub llm: String,
    /// Model name sent to an OpenAI-compatible endpoint.
    #[arg(long, default_value = "default")]
    pub llm_model: String,
    /// Model directory for `--llm local` (default: $NEXTN_MODEL, else the bundled models/nextn-live-tiny).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute device of `--llm local`: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`). The
    /// summary records it (`device`).
    #[arg(long, default_value = "cpu")]
    pub device: nextn_engine::Device,
    /// Harness directory. Default: with `--llm local`, the harness profile the model directory declares in its
    /// nextn.json (the bundled model: harness/live-tiny); with `--llm URL`, the one the served model declares when
    /// the endpoint is `nextn serve` and that directory is on this machine; otherwise the bundled harness/default.
    /// The summary records the directory used (`harness`).
    #[arg(long)]
    pub harness: Option<PathBuf>,
    /// MCP servers (`cmd args` or a Streamable HTTP URL, optionally `name=`); repeatable. Default: the
    /// nextn-commerce-mcp binary next to this executable. Each agent connects its own.
    #[arg(long = "mcp")]
    pub mcp: Vec<String>,
    /// Request i samples with seed S + i.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Only the first N cases (warm-up included).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Write requests.jsonl, summary.json, summary.md, latency_cdf.svg and stages.svg here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the summary as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Score every measured reply with a judge at this OpenAI-compatible base URL.
    #[arg(long)]
    pub judge: Option<String>,
    /// Model name sent to the judge endpoint.
    #[arg(long, default_value = "default")]
    pub judge_model: String,
    /// Judge harness directory (default: the bundled harness/judge).
    #[arg(long)]
    pub judge_harness: Option<PathBuf>,
    /// No per-request progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Also run the cases under N perturbed harnesses (every HSA dimension, seeds S+1..S+N) and five more with
    /// one dimension each (seed S), in the first concurrency × spec group; report each harness's quality, the
    /// original-vs-variant gap and the per-dimension gap. Variants are written to <out>/harness-variants/.
    #[arg(long, default_value_t = 0)]
    pub harness_variants: usize,
    /// S for --harness-variants.
    #[arg(long, default_value_t = 0)]
    pub variant_seed: u64,
    /// Perturbation strength (0..1) of the variants.
    #[arg(long, default_value_t = 0.5)]
    pub variant_strength: f64,
}

/// A bundled directory: in the source tree this binary was built from, else relative to the current directory.
pub fn bundled(rel: &str) -> Option<PathBuf> {
    [Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel), PathBuf::from(rel)].into_iter().find(|p| p.exists())
}

/// The bundled commerce MCP server: the binary built next to this one.
pub(crate) fn default_mcp() -> Result<String, Error> {
    let exe = std::env::current_exe()?;
    let bin = exe.parent().ok_or("executable has no directory")?.join(format!("nextn-commerce-mcp{}", std::env::consts::EXE_SUFFIX));
    if !bin.is_file() {
        return Err(format!(
            "no --mcp given and the bundled commerce server was not found at {} (build it: cargo build --release -p nextn-commerce-mcp)",
            bin.display()
        )
        .into());
    }
    Ok(format!("commerce={}", bin.display()))
}

fn parse_list<T>(what: &str, s: &str, f: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, Error> {
    let v: Vec<T> = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| f(t).ok_or_else(|| format!("{what}: `{t}` is not valid")))
        .collect::<Result<_, _>>()?;
    if v.is_empty() {
        return Err(format!("{what}: empty list").into());
    }
    Ok(v)
}

/// The [`ReplayConfig`] an argument set describes (cases loaded, defaults resolved).
pub fn config(args: &ReplayArgs) -> Result<ReplayConfig, Error> {
    let mut cases = cases::load_cases(&args.cases)?;
    if let Some(n) = args.limit {
        cases.truncate(n);
    }
    let llm = if args.llm == "local" {
        let dir = match (&args.model, std::env::var_os("NEXTN_MODEL")) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => PathBuf::from(m),
            (None, None) => bundled("models/nextn-live-tiny").ok_or("no --model given and models/nextn-live-tiny was not found")?,
        };
        LlmTarget::Local { model_dir: dir, device: args.device }
    } else if args.device != nextn_engine::Device::Cpu {
        return Err(format!("--device {} runs the in-process engine (--llm local); the endpoint {} decides its own device", args.device, args.llm).into());
    } else {
        LlmTarget::Url { base_url: args.llm.clone(), model: args.llm_model.clone() }
    };
    let local_model = match &llm {
        LlmTarget::Local { model_dir, .. } => Some(model_dir.as_path()),
        LlmTarget::Url { .. } => None,
    };
    // Over HTTP without --harness: the harness the served model declares, when `nextn serve` reports one.
    let served = match (&llm, &args.harness) {
        (LlmTarget::Url { base_url, model }, None) => {
            nextn_agent::llm::served_harness(base_url, model, std::env::var("NEXTN_LLM_API_KEY").ok())
        }
        _ => None,
    };
    let harness_dir = match served {
        Some((dir, _)) => dir,
        None => nextn_harness::choose_harness(args.harness.as_deref(), local_model, || bundled("harness/default"))?,
    };
    let mcp = if args.mcp.is_empty() { vec![default_mcp()?] } else { args.mcp.clone() };
    Ok(ReplayConfig {
        cases,
        concurrency: parse_list("--concurrency", &args.concurrency, |t| t.parse::<usize>().ok().filter(|&c| c > 0))?,
        spec: parse_list("--spec", &args.spec, SpecMode::parse)?,
        draft_steps: args.draft_steps,
        draft_vocab: args.draft_vocab.clone(),
        warmup: args.warmup,
        llm,
        harness_dir,
        mcp,
        seed: args.seed,
        temperature: args.temperature,
        top_p: args.top_p,
        max_tokens: args.max_tokens,
    })
}

/// Score every measured record with the judge (sequentially, after the replay: judging is not timed).
pub fn judge_records(j: &mut judge::Judge, cfg: &ReplayConfig, records: &mut [RequestRecord]) -> Vec<String> {
    let mut errors = Vec::new();
    for r in records.iter_mut().filter(|r| !r.warmup) {
        let Some(case) = cfg.cases.iter().find(|c| c.id == r.id) else { continue };
        match j.judge(case, &r.evidence, &r.reply) {
            Ok(v) => r.judge = Some(v),
            Err(e) => errors.push(format!("{} (c{} {}): {e}", r.id, r.concurrency, r.spec)),
        }
    }
    errors
}

/// `nextn-bench replay`: run, print the summary, write the outputs.
pub fn command(args: ReplayArgs) -> Result<(), Error> {
    let cfg = config(&args)?;
    let harness = nextn_harness::Harness::load(&cfg.harness_dir)?;
    let limits = harness.constraints();
    let setup = format!(
        "harness {} ({}): at most {} loops, {} ms tool timeout; MCP: {}",
        cfg.harness_dir.display(),
        harness.version(),
        limits.max_loops,
        limits.tool_timeout_ms,
        cfg.mcp.join(" ")
    );
    eprintln!("{setup}");
    let started = Instant::now();
    let total = cfg.cases.len() * run::groups(&cfg).len();
    let mut done = 0usize;
    let quiet = args.quiet;
    let mut records = run::replay(&cfg, |r| {
        done += 1;
        if !quiet {
            eprintln!(
                "[{done}/{total}] c{} {} {}{} {:.0} ms, {} loops, {}",
                r.concurrency, r.spec, r.id, if r.warmup { " (warm-up)" } else { "" }, r.latency_ms, r.loops, r.outcome
            );
        }
    })?;
    let mut judge = match &args.judge {
        Some(url) => {
            let dir = match &args.judge_harness {
                Some(d) => d.clone(),
                None => bundled("harness/judge").ok_or("no --judge-harness given and harness/judge was not found")?,
            };
            Some(judge::Judge::new(&dir, url, &args.judge_model)?)
        }
        None => None,
    };
    if let Some(j) = &mut judge {
        for e in judge_records(j, &cfg, &mut records) {
            eprintln!("judge: {e}");
        }
    }
    let mut summary = report::summarize(&records);
    if args.harness_variants > 0 {
        let root = match &args.out {
            Some(out) => out.join("harness-variants"),
            None => std::env::temp_dir().join(format!("nextn-harness-variants-{}", std::process::id())),
        };
        let tools = variants::discover_tools(&cfg)?;
        let plan = variants::plan(args.harness_variants, args.variant_seed, args.variant_strength);
        let made = variants::generate(&cfg.harness_dir, &root, &plan, &tools)?;
        eprintln!("harness variants: {} under {}", made.len(), root.display());
        let judge_variant = |vcfg: &run::ReplayConfig, rs: &mut [RequestRecord]| {
            if let Some(j) = &mut judge {
                for e in judge_records(j, vcfg, rs) {
                    eprintln!("judge: {e}");
                }
            }
        };
        let progress = |label: &str, r: &RequestRecord| {
            if !quiet {
                eprintln!("[variant {label}] {} {:.0} ms, {} loops, {}", r.id, r.latency_ms, r.loops, r.outcome);
            }
        };
        summary.harness_variants =
            Some(variants::evaluate(&cfg, &records, harness.version(), &made, judge_variant, progress)?);
    }
    summary.draft_vocab = args.draft_vocab.clone();
    summary.device = match &cfg.llm {
        LlmTarget::Local { device, .. } => Some(device.to_string()),
        LlmTarget::Url { .. } => None,
    };
    summary.harness = Some(report::ReplayHarness { dir: cfg.harness_dir.display().to_string(), version: harness.version().to_string() });
    let wall_s = started.elapsed().as_secs_f64();
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        crate::outln!("{}", report::markdown(&summary));
        crate::outln!("{setup}");
        crate::outln!(
            "{} cases × {} groups ({} warm-up requests excluded) in {:.1} s",
            cfg.cases.len(),
            run::groups(&cfg).len(),
            summary.warmup_excluded,
            wall_s
        );
    }
    if let Some(dir) = &args.out {
        report::write_outputs(dir, &records, &summary)?;
        eprintln!("wrote {}/{{requests.jsonl,summary.json,summary.md,latency_cdf.svg,stages.svg}}", dir.display());
    }
    Ok(())
}
