//! `nextn-bench`: end-to-end benchmarks that print JSON for scripts.
//!
//! - `decode`: batch-1 decode tokens/s, weight bytes read per token, achieved GB/s and the fraction of this
//!   machine's measured memory bandwidth (the roofline of a weight-streaming decode).
//! - `spec`: acceptance metrics of MTP speculation and decode tokens/s with and without it, on a prompt file.
//! - `replay`: the deployment replay of a case set through the whole agent ([`nextn_bench::replay`]).
//! - `plan`: ops, bytes and allocations per decode / verify / draft step, recorded on a config's shapes.
//! - `gemm`: the CPU GEMV and prefill GEMM kernels on projection shapes, against the measured FMA peak.

use std::path::{Path, PathBuf};

/// Large blocks on huge pages, kept for reuse (a prefill's buffers fault in once, not per op).
#[global_allocator]
static ALLOC: nextn_engine::alloc::Retaining = nextn_engine::alloc::Retaining;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use nextn_bench::membw;
use nextn_engine::spec::{DraftVocab, SpecConfig, SpecStats};
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::weights::DType;
use nextn_engine::{Engine, EngineConfig, LoadOptions, Model, ModelConfig, SamplingParams};
use serde_json::json;

#[derive(Parser)]
#[command(name = "nextn-bench", version, about = "nextn benchmarks (JSON output for scripts)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Batch-1 decode speed against the memory-bandwidth roofline.
    Decode(DecodeArgs),
    /// MTP acceptance (length, rate, per position) and tokens/s with and without speculation.
    Spec(SpecArgs),
    /// Serving-loop timing on a backend (cpu or cuda): TTFT of a long prompt, plain decode at a context,
    /// and MTP draft/verify cycles with forced acceptance lengths. JSON lines + a table on stderr.
    Cycle(CycleArgs),
    /// Per-kernel time, GB/s and roofline fraction at Qwen3.6-35B-A3B shapes (needs `--features cuda`).
    Kernels(KernelArgs),
    /// Smoke check of a CUDA device (needs `--features cuda`): open it, run one embedded kernel, read it back;
    /// name, SMs, L2, memory and clocks as one JSON line. Exits non-zero, with the reason, when there is none.
    Device(DeviceArgs),
    /// Prefix cache: TTFT cold vs warm (same prefix, new suffix) and over agent loops; outputs identical
    /// with the cache on and off.
    Prefix(PrefixArgs),
    /// Deployment replay: a case set through the whole agent (harness, MCP, engine or URL) at each
    /// concurrency × spec mode; latency percentiles, TTFT, decode speed, 15 s attainment, quality.
    Replay(nextn_bench::replay::ReplayArgs),
    /// Harness evolution step: the same cases under harness A (current) and B (candidate); paired per-category
    /// deltas, improved / regressed case ids, new regressions, and a promote / revise / rollback recommendation
    /// by a documented rule, with both content hashes.
    Compare(nextn_bench::replay::compare::CompareArgs),
    /// Ops, bytes, FLOPs, host transfers (device→host, and the packed metadata copied host→device once per forward)
    /// and allocations of one decode step, one verify, one draft step, one greedy propose, and the greedy MTP cycle in
    /// one call as the CUDA backend runs it (one transfer), recorded from the model's forward on a config's shapes
    /// alone (no weights, no GPU).
    Plan(nextn_bench::plan::PlanArgs),
    /// CPU linear kernels side by side (GEMV vs the prefill GEMM) on projection shapes: GFLOP/s and the
    /// fraction of this machine's measured f32 FMA peak.
    Gemm(nextn_bench::cpugemm::GemmArgs),
}

#[derive(clap::Args)]
struct PrefixArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The shared prefix: a text file (tokenized as is) or JSON `{"prompt_ids": [..]}`.
    #[arg(long)]
    prompt_file: PathBuf,
    /// Tokens of each request's own suffix (and of each tool result in the agent loops).
    #[arg(long, default_value_t = 64)]
    suffix_tokens: usize,
    /// Agent loops (prompt = previous prompt + reply + tool result).
    #[arg(long, default_value_t = 4)]
    loops: usize,
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// MTP draft steps (0 = plain decoding).
    #[arg(long, default_value_t = 0)]
    draft_steps: usize,
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct KernelArgs {
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    device_index: usize,
    /// Timed launches per kernel (after 3 warm-up launches).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// JSON lines only (no table on stderr).
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct DeviceArgs {
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    device_index: usize,
}

#[derive(clap::Args)]
struct CycleArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: nextn_engine::Device,
    /// Context length decode and MTP cycles run at (the prompt is prefilled to this length first).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Prompt length whose prefill is timed as TTFT (0 = skip).
    #[arg(long, default_value_t = 8192)]
    ttft_prompt: usize,
    /// Rows per prefill chunk.
    #[arg(long, default_value_t = 2048)]
    prefill_chunk: usize,
    /// Plain decode steps to time.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// MTP draft steps k.
    #[arg(long, default_value_t = 3)]
    draft_steps: usize,
    /// Forced acceptance lengths (tokens per cycle, 1..=k+1), comma-separated.
    #[arg(long, default_value = "1,2,3,4")]
    accept_lengths: String,
    /// Reduced draft vocabulary for the draft steps' LM head: N (the first N ids of the model's
    /// draft_vocab.txt; with dummy weights and --config, ids 0..N) or a token-id file.
    #[arg(long, value_name = "FILE|N")]
    draft_vocab: Option<String>,
    /// Cycles per acceptance length.
    #[arg(long, default_value_t = 16)]
    cycles: usize,
    /// Also run N paired rounds per acceptance length (--decode-steps plain steps, then --cycles MTP cycles,
    /// back to back) and report the median, min and max over rounds of each round's MTP / decode speed ratio
    /// (`paired` in the mtp records): on a host whose bandwidth drifts, both sides of a round see the same.
    #[arg(long, default_value_t = 0)]
    paired_rounds: usize,
    /// KV block size.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Sample decode and verify rows at this temperature (keyed draws, as the engine samples sampled requests on a
    /// device: `sample_f32` after the LM head instead of the argmax); 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus mass of the sampled rows (with --temperature > 0).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Print JSON lines only (no table on stderr).
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LoadFormat {
    Auto,
    Dummy,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A config.json for --load-format dummy (instead of --model).
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    load_format: LoadFormat,
    /// CPU worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

impl ModelArgs {
    /// The checkpoint directory `--load-format auto` reads.
    fn weights_dir(&self) -> Result<&Path> {
        match (&self.model, &self.config) {
            (Some(dir), _) => Ok(dir),
            (None, Some(cfg)) => Err(format!(
                "--config {} has no weights: add --load-format dummy (random weights of that shape), or give --model DIR",
                cfg.display()
            )
            .into()),
            (None, None) => Err("--model DIR is required (or --config FILE with --load-format dummy)".into()),
        }
    }
}

#[derive(clap::Args)]
struct DecodeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length (token ids 1..) before decoding starts.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Decode tokens to time (after 2 warm-up tokens).
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Skip the memory-bandwidth measurements (they allocate 4 GiB, then 1 GiB).
    #[arg(long)]
    no_membw: bool,
    /// MiB read before each timed token for the paired bandwidth fraction (0: no pairing). On a shared host the
    /// bandwidth drifts by 2x within a second, so each token is compared with a read measured just before it.
    #[arg(long, default_value_t = 256)]
    paired_read_mib: usize,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct SpecArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompts: JSON lines with {"prompt": TEXT} (chat-templated when the model has a template) or
    /// {"prompt_ids": [..]}, or plain text lines.
    #[arg(long)]
    prompts: PathBuf,
    /// Draft steps; a comma-separated list runs each (e.g. 1,2,3,4).
    #[arg(long, default_value = "3")]
    draft_steps: String,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Decode(a) => decode(a),
        Command::Spec(a) => spec(a),
        Command::Cycle(a) => cycle(a),
        Command::Kernels(a) => kernels(a),
        Command::Device(a) => device(a),
        Command::Prefix(a) => prefix(a),
        Command::Replay(a) => nextn_bench::replay::command(a).map_err(|e| e as Box<dyn std::error::Error>),
        Command::Compare(a) => nextn_bench::replay::compare::command(a).map_err(|e| e as Box<dyn std::error::Error>),
        Command::Plan(a) => nextn_bench::plan::command(a),
        Command::Gemm(a) => nextn_bench::cpugemm::command(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn load(args: &ModelArgs) -> Result<(Model, Option<TokenizerBundle>)> {
    if args.threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global()?;
    }
    match args.load_format {
        LoadFormat::Auto => {
            let dir = args.weights_dir()?;
            let model = Model::load(dir, &LoadOptions { progress_above_bytes: Some(256 << 20) })?;
            Ok((model, TokenizerBundle::load(dir).ok()))
        }
        LoadFormat::Dummy => {
            let path: &Path = args.config.as_deref().or(args.model.as_deref()).ok_or("--config FILE or --model DIR")?;
            let cfg = ModelConfig::from_path(path)?;
            Ok((Model::load_dummy(&cfg, DType::BF16, 0)?, None))
        }
    }
}

/// Bytes of weights one decode token reads: active parameters × the stored element size.
fn weight_bytes_per_token(model: &Model) -> usize {
    let elem = match model {
        Model::Qwen3_5Moe(m) => m.lm_head.dtype().size(),
        Model::Qwen3Moe(m) => m.lm_head.dtype().size(),
    };
    model.config().param_counts().active_per_token * elem
}

/// The CPU kernels' setup, for the JSON reports: threads, SIMD level, rows a one-input GEMV streams side by
/// side, whether the prefill GEMM is on.
fn cpu_machine() -> serde_json::Value {
    use nextn_engine::backend::cpu::{gemm, gemv};
    let walk = gemv::row_walk();
    let rows = if walk == gemv::RowWalk::Single { 1 } else { 4 };
    json!({"cpu": cpu_name(), "threads": rayon::current_num_threads(), "simd": gemv::simd_level(), "gemv_rows": rows, "gemv_walk": walk.name(), "gemm": gemm::enabled()})
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| t.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}

fn decode(a: DecodeArgs) -> Result<()> {
    let t_load = Instant::now();
    let (model, _) = load(&a.model)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let cfg = model.config().clone();
    let bytes_per_token = weight_bytes_per_token(&model);
    let params = SamplingParams { max_new_tokens: a.tokens + 2, ignore_eos: true, ..SamplingParams::greedy() };
    let prompt: Vec<u32> = (0..a.prompt_len as u32).map(|i| 1 + i % (cfg.vocab_size as u32 - 1)).collect();
    let mut engine = Engine::new(model, None, Vec::new(), EngineConfig { max_num_seqs: 1, ..Default::default() })?;
    let mut times = Vec::new();
    let out = engine.generate(prompt.clone(), params.clone(), |ev| times.push(ev.at))?;
    // Steady-state decode: skip the first token (prefill) and one warm-up token.
    let timed = &times[2.min(times.len())..];
    let secs = timed.last().map_or(0.0, |&last| (last - times[1]).as_secs_f64());
    let tok_s = timed.len() as f64 / secs;
    let gbps = bytes_per_token as f64 * tok_s / 1e9;
    // Paired, in a second run of the same request: before each timed token one read pass over
    // `--paired-read-mib` on the decode team's threads, the token timed from the end of that read. The host's
    // bandwidth drifts by up to 2x within a second here, so a fraction of a bandwidth measured at another
    // moment means little. (A separate run: the reads evict the caches, which would slow a model that fits in
    // them, so the plain figures above come from a run without them.)
    let read_buf = (!a.no_membw && a.paired_read_mib > 0).then(|| membw::read_buffer(a.paired_read_mib << 20));
    let mut pairs: Vec<(f64, f64)> = Vec::new(); // (token weight GB/s, read GB/s just before it)
    if let Some(buf) = &read_buf {
        let (mut start, mut read_end, mut seen) = (None::<Instant>, Duration::ZERO, 0usize);
        let mut last_read = 0.0;
        engine.generate(prompt, params, |ev| {
            let start = *start.get_or_insert_with(|| Instant::now() - ev.at);
            seen += 1;
            if seen > 2 {
                let token_s = ev.at.saturating_sub(read_end).as_secs_f64();
                pairs.push((bytes_per_token as f64 / token_s / 1e9, last_read));
            }
            if seen >= 2 {
                last_read = membw::team_read_gbps(buf);
            }
            read_end = start.elapsed();
        })?;
    }
    drop(read_buf);
    let mut fractions: Vec<f64> = pairs.iter().map(|&(g, r)| g / r).collect();
    fractions.sort_by(f64::total_cmp);
    let mut reads: Vec<f64> = pairs.iter().map(|&(_, r)| r).collect();
    reads.sort_by(f64::total_cmp);
    let quantile = |v: &[f64], q: f64| (!v.is_empty()).then(|| v[((v.len() - 1) as f64 * q).round() as usize]);
    let bw = (!a.no_membw).then(membw::measure_default);
    let report = json!({
        "bench": "decode",
        "machine": cpu_machine(),
        "model": {"architecture": format!("{:?}", cfg.architecture), "layers": cfg.num_hidden_layers,
                  "experts": cfg.num_experts, "vocab": cfg.vocab_size,
                  "params_total": cfg.param_counts().total, "params_active_per_token": cfg.param_counts().active_per_token},
        "load_s": load_s,
        "prompt_tokens": a.prompt_len,
        "decode_tokens": timed.len(),
        "ttft_ms": out.stats.ttft_ms,
        "decode_tokens_per_s": tok_s,
        "ms_per_token": 1e3 / tok_s,
        "weight_bytes_per_token": bytes_per_token,
        "achieved_gb_per_s": gbps,
        "membw": bw,
        "fraction_of_read_bw": bw.as_ref().map(|b| gbps / b.read_gbps),
        "fraction_of_copy_bw": bw.as_ref().map(|b| gbps / b.copy_traffic_gbps),
        "paired": {"fraction_of_read_bw_median": quantile(&fractions, 0.5),
            "fraction_of_read_bw_p25": quantile(&fractions, 0.25), "fraction_of_read_bw_p75": quantile(&fractions, 0.75),
            "read_gbps_median": quantile(&reads, 0.5), "read_gbps_min": quantile(&reads, 0.0), "read_gbps_max": quantile(&reads, 1.0),
            "read_mib": a.paired_read_mib, "tokens": fractions.len(),
            "method": "a second run of the request: before each timed token one parallel sum over read_mib on the decode \
                       team's threads (membw's read kernel); the token is timed from the end of that read; fraction = \
                       the token's weight GB/s / the read GB/s just before it; quantiles over tokens"},
    });
    print_report(&report, a.json);
    Ok(())
}

fn read_prompts(path: &Path, bundle: Option<&TokenizerBundle>) -> Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let where_ = || format!("{}:{}", path.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|_| json!({"prompt": line}));
        if let Some(ids) = value.get("prompt_ids").and_then(|v| v.as_array()) {
            let ids: Option<Vec<u32>> = ids.iter().map(|v| v.as_u64().map(|x| x as u32)).collect();
            prompts.push(ids.ok_or_else(|| format!("{}: prompt_ids must be integers", where_()))?);
        } else if let Some(p) = value.get("prompt").and_then(|v| v.as_str()) {
            let bundle = bundle.ok_or_else(|| format!("{}: a text prompt needs the model's tokenizer", where_()))?;
            let ids = match bundle.chat_template() {
                Some(_) => bundle.encode_chat(&[json!({"role": "user", "content": p})], None::<&[serde_json::Value]>, true, &serde_json::Map::new())?,
                None => bundle.require_tokenizer()?.encode(p, false)?,
            };
            prompts.push(ids);
        } else {
            return Err(format!("{}: expected {{\"prompt\": ..}} or {{\"prompt_ids\": [..]}}", where_()).into());
        }
    }
    if prompts.is_empty() {
        return Err(format!("{}: no prompts", path.display()).into());
    }
    Ok(prompts)
}

/// Greedy decode of every prompt, one at a time; returns (decode tokens/s over all prompts, spec totals).
fn run_all(engine: &mut Engine, prompts: &[Vec<u32>], max_new: usize) -> Result<(f64, usize, Vec<Vec<u32>>)> {
    let mut decode_tokens = 0usize;
    let mut decode_secs = 0.0;
    let mut outputs = Vec::new();
    for p in prompts {
        let params = SamplingParams { max_new_tokens: max_new, ..SamplingParams::greedy() };
        let out = engine.generate(p.clone(), params, |_| {})?;
        if out.stats.generated_tokens > 1 && out.stats.decode_tokens_per_s > 0.0 {
            decode_tokens += out.stats.generated_tokens - 1;
            decode_secs += (out.stats.generated_tokens - 1) as f64 / out.stats.decode_tokens_per_s;
        }
        outputs.push(out.token_ids);
    }
    Ok((if decode_secs > 0.0 { decode_tokens as f64 / decode_secs } else { 0.0 }, decode_tokens, outputs))
}

fn spec(a: SpecArgs) -> Result<()> {
    let steps: Vec<usize> = a
        .draft_steps
        .split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|_| format!("--draft-steps: `{s}` is not a number")))
        .collect::<std::result::Result<_, _>>()?;
    let mut results = Vec::new();
    // One model load per engine: the engine owns its model.
    let (model, bundle) = load(&a.model)?;
    let prompts = read_prompts(&a.prompts, bundle.as_ref())?;
    let cfg = EngineConfig { max_num_seqs: 1, ..Default::default() };
    let mut plain = Engine::new(model, None, Vec::new(), cfg.clone())?;
    let (base_tps, base_tokens, base_out) = run_all(&mut plain, &prompts, a.max_new_tokens)?;
    for k in steps {
        let (model, _) = load(&ModelArgs { threads: 0, ..clone_model_args(&a.model) })?;
        let mut engine = Engine::new(model, None, Vec::new(), EngineConfig { spec: Some(SpecConfig { draft_steps: k }), ..cfg.clone() })?;
        let (tps, _, out) = run_all(&mut engine, &prompts, a.max_new_tokens)?;
        let stats: SpecStats = engine.spec_totals().cloned().unwrap_or_default();
        results.push(json!({
            "draft_steps": k,
            "spec": stats,
            "decode_tokens_per_s": tps,
            "speedup": if base_tps > 0.0 { tps / base_tps } else { 0.0 },
            "identical_to_plain_greedy": out == base_out,
        }));
    }
    let report = json!({
        "bench": "spec",
        "machine": cpu_machine(),
        "prompts": prompts.len(),
        "max_new_tokens": a.max_new_tokens,
        "plain": {"decode_tokens_per_s": base_tps, "decode_tokens": base_tokens},
        "mtp": results,
    });
    print_report(&report, a.json);
    Ok(())
}

fn prefix(a: PrefixArgs) -> Result<()> {
    let (model, bundle) = load(&a.model)?;
    let text = std::fs::read_to_string(&a.prompt_file).map_err(|e| format!("{}: {e}", a.prompt_file.display()))?;
    let prompt: Vec<u32> = match serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| v.get("prompt_ids").cloned()) {
        Some(ids) => serde_json::from_value(ids)?,
        None => bundle.as_ref().ok_or("a text prompt needs the model's tokenizer")?.require_tokenizer()?.encode(&text, false)?,
    };
    let cfg = EngineConfig {
        max_num_seqs: 1,
        prefill_chunk: a.prefill_chunk,
        max_batch_tokens: a.prefill_chunk.max(a.draft_steps + 1),
        spec: (a.draft_steps > 0).then_some(SpecConfig { draft_steps: a.draft_steps }),
        ..Default::default()
    };
    let bench = nextn_bench::prefix::PrefixBench {
        prompt,
        suffix_tokens: a.suffix_tokens,
        loops: a.loops.max(1),
        max_new_tokens: a.max_new_tokens,
        cfg,
    };
    let mut first = Some(model);
    let mut report = nextn_bench::prefix::run_prefix(&bench, |cfg| {
        let model = match first.take() {
            Some(m) => m,
            None => load(&ModelArgs { threads: 0, ..clone_model_args(&a.model) }).map_err(|e| nextn_engine::EngineError::Config(e.to_string()))?.0,
        };
        Engine::new(model, None, Vec::new(), cfg)
    })?;
    report["machine"] = json!({"cpu": cpu_name(), "threads": rayon::current_num_threads()});
    print_report(&report, a.json);
    Ok(())
}

/// HBM/DRAM bytes one plain decode token moves at context `ctx`: active weights (bf16), the KV it reads,
/// the GDN recurrent state it reads and writes.
fn decode_bytes(cfg: &ModelConfig, ctx: usize) -> (usize, usize, usize) {
    let weights = cfg.param_counts().active_per_token * 2;
    let full = cfg.layer_types.iter().filter(|t| **t == nextn_engine::LayerType::FullAttention).count();
    let kv = ctx * full * 2 * cfg.num_key_value_heads * cfg.head_dim * 2;
    let state = cfg.linear_attention.as_ref().map_or(0, |la| {
        let gdn = cfg.num_hidden_layers - full;
        gdn * la.num_value_heads * la.key_head_dim * la.value_head_dim * 4 * 2
    });
    (weights, kv, state)
}

fn cycle(a: CycleArgs) -> Result<()> {
    use nextn_bench::cycle::Seq;
    use nextn_engine::{CacheGeometry, ModelSource};
    let lengths: Vec<usize> = a
        .accept_lengths
        .split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|_| format!("--accept-lengths: `{s}` is not a number")))
        .collect::<std::result::Result<_, _>>()?;
    if let Some(bad) = lengths.iter().find(|&&l| l == 0 || l > a.draft_steps + 1) {
        return Err(format!("--accept-lengths: {bad} is outside 1..={} (draft steps + 1)", a.draft_steps + 1).into());
    }
    if a.context == 0 || a.prefill_chunk == 0 || a.block_size == 0 {
        return Err("--context, --prefill-chunk and --block-size must be > 0".into());
    }
    let sampling = (a.temperature != 0.0).then(|| SamplingParams { temperature: a.temperature, top_p: a.top_p, ..SamplingParams::greedy() });
    if let Some(p) = &sampling {
        p.validate(usize::MAX).map_err(|e| format!("--temperature / --top-p: {e}"))?;
    }
    let t_load = Instant::now();
    let source = match a.model.load_format {
        LoadFormat::Dummy => {
            let path: &Path = a.model.config.as_deref().or(a.model.model.as_deref()).ok_or("--config FILE or --model DIR")?;
            ModelSource::Dummy { cfg: ModelConfig::from_path(path)?, seed: 0 }
        }
        // CUDA uploads straight from the checkpoint's mmap; the CPU runs the host model.
        LoadFormat::Auto if a.device != nextn_engine::Device::Cpu => {
            ModelSource::open(a.model.weights_dir()?)?
        }
        LoadFormat::Auto => ModelSource::Loaded(load(&a.model)?.0),
    };
    let cfg = source.config().clone();
    let has_mtp = source.has_mtp();
    // On CUDA the decode steps and MTP cycles run twice: wall clock, then GPU time (nextn_bench::gpu_time).
    let passes = if matches!(a.device, nextn_engine::Device::Cuda(_)) { 2 } else { 1 };
    let timed = (a.decode_steps + (a.draft_steps + 1) * (a.cycles + 1) * lengths.len()) * (1 + a.paired_rounds);
    let longest = a.ttft_prompt.max(a.context + passes * timed + 8);
    if longest > cfg.max_position_embeddings {
        return Err(format!("{longest} positions exceed max_position_embeddings {}", cfg.max_position_embeddings).into());
    }
    let num_blocks = longest.div_ceil(a.block_size);
    let geo = CacheGeometry { num_blocks, block_size: a.block_size, num_slots: 1, lanes: a.draft_steps + 1 };
    let draft_vocab = match a.draft_vocab.as_deref() {
        None => None,
        Some(arg) => {
            let dir = a.model.model.as_deref().filter(|_| a.model.config.is_none());
            let n = arg.trim().parse::<usize>().ok();
            Some(match (n, dir, a.model.load_format) {
                (Some(n), None, LoadFormat::Dummy) => DraftVocab::first_ids(n, cfg.vocab_size)?,
                _ => DraftVocab::resolve(arg, dir, cfg.vocab_size)?,
            })
        }
    };
    let (mut b, gpu_timer) = nextn_bench::gpu_time::make_backend(a.device, source, geo)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let device = b.device_name();
    let bw_gbs = match b.copy_bandwidth_gbs()? {
        Some(g) => g,
        None => membw::measure_default().read_gbps,
    };
    let mut lines = Vec::new();
    let mut emit = |v: serde_json::Value| {
        nextn_bench::outln!("{v}");
        lines.push(v);
    };
    emit(json!({"bench": "cycle", "record": "setup", "device": device, "backend": b.name(),
        "model": {"architecture": format!("{:?}", cfg.architecture), "layers": cfg.num_hidden_layers,
                  "hidden": cfg.hidden_size, "experts": cfg.num_experts, "vocab": cfg.vocab_size,
                  "params_total": cfg.param_counts().total, "params_active_per_token": cfg.param_counts().active_per_token},
        "load_s": load_s, "roofline_gb_per_s": bw_gbs,
        "draft_vocab": draft_vocab.as_ref().map(|dv| json!({"size": dv.len(), "source": dv.source(),
            "reduced_head_reads": b.reduces_draft_head()})),
        "gpu": if b.name() == "cuda" { nextn_bench::gpu_info::snapshot(0) } else { serde_json::Value::Null },
        "gpu_time_method": gpu_timer.as_ref().map(|_| nextn_bench::gpu_time::METHOD),
        // How decode and verify rows pick their tokens: argmax, or keyed draws (`--temperature`).
        "sampling": match &sampling {
            None => json!("greedy"),
            Some(p) => json!({"keyed": true, "temperature": p.temperature, "top_p": p.top_p}),
        },
        // CUDA graphs for the greedy decode and verify steps (`NEXTN_CUDA_GRAPHS`: 1, eager, or off).
        "cuda_graphs": if b.name() == "cuda" { std::env::var("NEXTN_CUDA_GRAPHS").unwrap_or_else(|_| "off".into()) } else { "n/a".into() },
        // Split-K for the fused GEMVs (`NEXTN_GEMV_SPLITK=1`: on; read by `Gpu::new` the same way).
        "gemv_split_k": if b.name() == "cuda" {
            if std::env::var("NEXTN_GEMV_SPLITK").is_ok_and(|v| v == "1") { "on" } else { "off" }
        } else { "n/a" }}));
    let vocab = cfg.vocab_size;
    // TTFT: a fresh sequence prefilled to --ttft-prompt.
    if a.ttft_prompt > 0 {
        let mut seq = Seq::new(num_blocks, a.block_size, vocab);
        b.reset_slot(0);
        let (_, secs) = seq.prefill(b.as_mut(), a.ttft_prompt, a.prefill_chunk)?;
        emit(json!({"bench": "cycle", "record": "ttft", "prompt_tokens": a.ttft_prompt, "chunk": a.prefill_chunk,
            "ttft_ms": secs * 1e3, "prefill_tokens_per_s": a.ttft_prompt as f64 / secs}));
    }
    // Plain decode at --context.
    let mut seq = Seq { sampling, ..Seq::new(num_blocks, a.block_size, vocab) };
    b.reset_slot(0);
    let (hidden, _) = seq.prefill(b.as_mut(), a.context, a.prefill_chunk)?;
    seq.decode(b.as_mut(), 2)?; // warm-up
    let s_tok = seq.decode(b.as_mut(), a.decode_steps)?;
    let gpu_decode = match &gpu_timer {
        Some(t) => Some(t.measure("token", a.decode_steps, s_tok, || seq.decode(b.as_mut(), a.decode_steps))),
        None => None,
    };
    let (wb, kvb, sb) = decode_bytes(&cfg, a.context);
    let bytes = wb + kvb + sb;
    let gbs = bytes as f64 / s_tok / 1e9;
    emit(json!({"bench": "cycle", "record": "decode", "context": a.context, "steps": a.decode_steps,
        "ms_per_token": s_tok * 1e3, "tokens_per_s": 1.0 / s_tok,
        "bytes_per_token": {"weights": wb, "kv": kvb, "gdn_state": sb, "total": bytes},
        "achieved_gb_per_s": gbs, "roofline_fraction": gbs / bw_gbs,
        "roofline_tokens_per_s": bw_gbs * 1e9 / bytes as f64, "gpu_time": gpu_decode}));
    // MTP cycles with forced acceptance.
    if has_mtp {
        for &len in &lengths {
            let s_cycle = seq.mtp_cycles(b.as_mut(), &hidden, a.draft_steps, len - 1, a.cycles, draft_vocab.as_ref())?;
            let tps = len as f64 / s_cycle;
            let gpu_cycle = match &gpu_timer {
                Some(t) => Some(t.measure("cycle", a.cycles, s_cycle, || {
                    seq.mtp_cycles(b.as_mut(), &hidden, a.draft_steps, len - 1, a.cycles, draft_vocab.as_ref())
                })),
                None => None,
            };
            // Paired rounds: decode, then cycles, back to back; each round's ratio of speeds.
            let mut ratios = Vec::with_capacity(a.paired_rounds);
            for _ in 0..a.paired_rounds {
                let s_round_tok = seq.decode(b.as_mut(), a.decode_steps)?;
                let s_round_cycle = seq.mtp_cycles(b.as_mut(), &hidden, a.draft_steps, len - 1, a.cycles, draft_vocab.as_ref())?;
                ratios.push(len as f64 / s_round_cycle * s_round_tok);
            }
            ratios.sort_by(f64::total_cmp);
            let paired = (!ratios.is_empty()).then(|| {
                json!({"rounds": ratios.len(), "speedup_vs_decode_median": ratios[ratios.len() / 2],
                       "speedup_vs_decode_min": ratios[0], "speedup_vs_decode_max": ratios[ratios.len() - 1],
                       "method": "per round: --decode-steps plain steps then --cycles cycles back to back; \
                                  ratio = (accept_length / s per cycle) × s per decode step"})
            });
            emit(json!({"bench": "cycle", "record": "mtp", "context": a.context, "draft_steps": a.draft_steps,
                "accept_length": len, "cycles": a.cycles, "ms_per_cycle": s_cycle * 1e3,
                "tokens_per_s": tps, "speedup_vs_decode": tps * s_tok,
                "draft_vocab": draft_vocab.as_ref().map_or(vocab, DraftVocab::len), "gpu_time": gpu_cycle,
                "paired": paired}));
        }
    } else {
        eprintln!("note: the model has no MTP head; MTP cycles skipped");
    }
    if b.name() == "cuda" {
        emit(json!({"bench": "cycle", "record": "gpu_after", "gpu": nextn_bench::gpu_info::snapshot(0)}));
    }
    if !a.json {
        eprintln!("\n{device} ({}), context {}:", b.name(), a.context);
        // ", GPU 1.234 ms (61% busy, 612 launches)" where the record has GPU time.
        let gpu = |l: &serde_json::Value, unit: &str| match l.get("gpu_time") {
            Some(g) if g.get(format!("ms_per_{unit}")).is_some() => format!(
                "  GPU {:.3} ms ({:.0}% busy, {:.0} launches)",
                g[format!("ms_per_{unit}")].as_f64().unwrap_or(0.0),
                100.0 * g["busy_fraction"].as_f64().unwrap_or(0.0),
                g[format!("launches_per_{unit}")].as_f64().unwrap_or(0.0)
            ),
            Some(g) if g.get("error").is_some() => format!("  GPU time failed: {}", g["error"].as_str().unwrap_or("?")),
            _ => String::new(),
        };
        for l in &lines {
            match l["record"].as_str() {
                Some("ttft") => eprintln!("  TTFT {:>6} tokens        {:>9.2} ms   ({:.0} tok/s prefill)",
                    l["prompt_tokens"], l["ttft_ms"].as_f64().unwrap_or(0.0), l["prefill_tokens_per_s"].as_f64().unwrap_or(0.0)),
                Some("decode") => eprintln!("  decode (MTP off)          {:>9.3} ms/tok {:>8.1} tok/s  {:>7.1} GB/s = {:.1}% of roofline{}",
                    l["ms_per_token"].as_f64().unwrap_or(0.0), l["tokens_per_s"].as_f64().unwrap_or(0.0),
                    l["achieved_gb_per_s"].as_f64().unwrap_or(0.0), 100.0 * l["roofline_fraction"].as_f64().unwrap_or(0.0),
                    gpu(l, "token")),
                Some("mtp") => eprintln!("  MTP k={} accept length {}  {:>9.3} ms/cycle {:>7.1} tok/s  x{:.2} vs decode  (draft vocab {}){}",
                    l["draft_steps"], l["accept_length"], l["ms_per_cycle"].as_f64().unwrap_or(0.0),
                    l["tokens_per_s"].as_f64().unwrap_or(0.0), l["speedup_vs_decode"].as_f64().unwrap_or(0.0), l["draft_vocab"],
                    gpu(l, "cycle")),
                _ => {}
            }
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn kernels(a: KernelArgs) -> Result<()> {
    let records = nextn_bench::kernels::run_all(a.device_index, a.iters.max(1))?;
    if !a.json {
        eprint!("{}", nextn_bench::kernels::table(&records));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn kernels(_: KernelArgs) -> Result<()> {
    Err("nextn-bench was built without CUDA: rebuild with `--features cuda` (tools/install-cuda-toolchain.sh first)".into())
}

#[cfg(feature = "cuda")]
fn device(a: DeviceArgs) -> Result<()> {
    nextn_bench::outln!("{}", nextn_bench::kernels::device_check(a.device_index)?);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn device(_: DeviceArgs) -> Result<()> {
    Err("nextn-bench was built without CUDA: rebuild with `--features cuda` (tools/install-cuda-toolchain.sh first)".into())
}

fn clone_model_args(m: &ModelArgs) -> ModelArgs {
    ModelArgs { model: m.model.clone(), config: m.config.clone(), load_format: m.load_format, threads: m.threads }
}

fn print_report(report: &serde_json::Value, json_out: bool) {
    if json_out {
        nextn_bench::outln!("{report}");
    } else {
        nextn_bench::outln!("{}", serde_json::to_string_pretty(report).unwrap_or_default());
    }
}
