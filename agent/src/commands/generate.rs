//! `nextn generate`: one request through the engine, streamed as text or printed as one JSON object.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::ValueEnum;
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::{Engine, EngineConfig, ModelConfig, SamplingParams};
use serde_json::json;

use nextn_engine::{Device, ModelSource};

use super::common::{draft_vocab, model_dir, model_source, parse_ids, set_threads, spec_config, Spec};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    /// Read the safetensors checkpoint.
    Auto,
    /// Random bf16 weights from config.json alone (profiling full-size shapes without a checkpoint).
    Dummy,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer files). Default: the bundled model
    /// (models/nextn-live-tiny), or $NEXTN_MODEL.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A config.json to build a dummy model from (with --load-format dummy; instead of --model).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Prompt text (needs the model's tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_name = "IDS")]
    prompt_ids: Option<String>,
    /// Wrap --prompt as a user message in the model's chat template (with the generation prompt).
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// With --chat: let the model think first (`<think>` block). Off by default: the host avatar replies directly.
    #[arg(long, requires = "chat")]
    enable_thinking: bool,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Argmax decoding (overrides the sampling flags and generation_config.json).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k", "min_p"])]
    greedy: bool,
    /// Sampling temperature (0 = greedy). Default: generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    min_p: Option<f32>,
    /// RNG seed (default: random, reported in --json output). Sampled tokens are keyed draws: the token at
    /// position n depends on the seed, n and the logits only, so `--spec off` and `--spec mtp` give the same text
    /// (`NEXTN_KEYED_SAMPLING=0`: the host sampler's RNG stream instead; `"sampling"` in --json says which).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when the generated text contains this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Keep generating past EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = LoadFormat::Auto)]
    load_format: LoadFormat,
    /// Compute device: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// CPU worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Speculative decoding with the model's MTP head (`off` = plain decoding).
    #[arg(long, value_enum, default_value_t = Spec::Off)]
    spec: Spec,
    /// Draft tokens per speculation round (1..=8; 0 = off, as --spec off).
    #[arg(long, default_value_t = 3)]
    draft_steps: usize,
    /// Reduced draft vocabulary: MTP drafts score only these tokens, verify keeps the full vocabulary (output
    /// unchanged). N = the first N ids of the model's draft_vocab.txt (`nextn draft-vocab` makes it); else
    /// the path of a token-id file (one id per line).
    #[arg(long, value_name = "FILE|N")]
    draft_vocab: Option<String>,
    /// Batch-invariant numerics: every row computed as if alone, so a seed reproduces the same tokens
    /// whatever the prefill chunking or prefix-cache hits (CPU only; prefill ~2x slower).
    #[arg(long)]
    batch_invariant: bool,
    /// Print one JSON object {token_ids, text, finish_reason, stats} instead of streaming text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    set_threads(args.threads)?;

    // 1. Model (checkpoint or dummy) and tokenizer files.
    let (source, bundle) = match args.load_format {
        LoadFormat::Auto => {
            if args.config.is_some() {
                bail!("--config is only for --load-format dummy; with a checkpoint use --model DIR");
            }
            let dir = model_dir(args.model.clone())?;
            let source = model_source(&dir, args.device)?;
            let bundle = TokenizerBundle::load(&dir).with_context(|| format!("tokenizer files in {}", dir.display()))?;
            (source, Some(bundle))
        }
        LoadFormat::Dummy => {
            let (config_path, bundle) = match (&args.config, &args.model) {
                (Some(c), _) => (c.clone(), None),
                (None, Some(dir)) => (dir.clone(), TokenizerBundle::load(dir).ok()),
                (None, None) => bail!("--load-format dummy needs --config FILE or --model DIR (for its config.json)"),
            };
            let cfg = ModelConfig::from_path(&config_path)?;
            // On CUDA the weights are generated on the device; on the CPU, in host memory.
            (ModelSource::Dummy { cfg, seed: 0 }, bundle)
        }
    };
    let tokenizer = bundle.as_ref().and_then(|b| b.tokenizer().cloned());
    let mut eos: Vec<u32> = bundle.as_ref().map(|b| b.eos_token_ids().to_vec()).unwrap_or_default();
    for id in &source.config().eos_token_ids {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }

    // 2. Prompt ids.
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) => {
            let bundle = bundle.as_ref().context("--prompt needs a tokenizer: pass --model DIR with tokenizer.json")?;
            if args.chat {
                let mut extra = serde_json::Map::new();
                extra.insert("enable_thinking".into(), json!(args.enable_thinking));
                let messages = [json!({"role": "user", "content": text})];
                bundle.encode_chat(&messages, None::<&[serde_json::Value]>, true, &extra)?
            } else {
                bundle.require_tokenizer()?.encode(text, false)?
            }
        }
        (None, None) => bail!("give --prompt TEXT or --prompt-ids IDS"),
    };

    // 3. Sampling: flags, else generation_config.json, else greedy.
    let gen_cfg = bundle.as_ref().and_then(|b| b.generation_config());
    let mut params = SamplingParams::greedy();
    if !args.greedy {
        params.temperature = args.temperature.or(gen_cfg.and_then(|g| g.temperature)).unwrap_or(0.0);
        params.top_p = args.top_p.or(gen_cfg.and_then(|g| g.top_p)).unwrap_or(1.0);
        params.top_k = args.top_k.or(gen_cfg.and_then(|g| g.top_k).map(|k| k as usize)).unwrap_or(0);
        params.min_p = args.min_p.or(gen_cfg.and_then(|g| g.min_p)).unwrap_or(0.0);
    }
    params.seed = args.seed;
    params.max_new_tokens = args.max_new_tokens;
    params.stop_strings = args.stop.clone();
    params.ignore_eos = args.ignore_eos;

    // 4. Run, streaming text unless --json.
    let spec = spec_config(args.spec, args.draft_steps);
    let dummy = args.load_format == LoadFormat::Dummy;
    let dir = if dummy { args.config.is_none().then(|| args.model.clone()).flatten() } else { Some(model_dir(args.model.clone())?) };
    let draft_vocab = draft_vocab(args.draft_vocab.as_deref(), spec.is_some(), dir.as_deref(), source.config().vocab_size, dummy)?;
    let ecfg = EngineConfig { spec, draft_vocab, batch_invariant: args.batch_invariant, ..EngineConfig::default() };
    let mut engine = Engine::on_device(args.device, source, tokenizer, eos, ecfg)?;
    let stdout = std::io::stdout();
    let stream = !args.json && engine.tokenizer().is_some();
    // How the tokens were picked: argmax, the backend's keyed draw (on a device: on the device), or the host's sampler.
    let sampling = match (params.is_greedy(), engine.keyed_sampling()) {
        (true, _) => "greedy",
        (false, true) => "keyed",
        (false, false) => "host",
    };
    let output = engine.generate(prompt_ids, params, |ev| {
        if stream {
            let mut out = stdout.lock();
            let _ = out.write_all(ev.text.as_bytes());
            let _ = out.flush();
        }
    })?;
    if args.json {
        let mut stats = serde_json::to_value(&output.stats)?;
        if let Some(spec) = &output.spec {
            stats["spec"] = serde_json::to_value(spec)?;
            if let Some(dv) = engine.draft_vocab() {
                stats["spec"]["draft_vocab"] = json!({"size": dv.len(), "source": dv.source()});
            }
        }
        let obj = json!({
            "token_ids": output.token_ids,
            "text": output.text,
            "finish_reason": output.finish_reason,
            "seed": output.seed,
            "sampling": sampling,
            "stats": stats,
        });
        outln!("{obj}");
    } else {
        if stream {
            // The text went out as it was generated: end its line.
            outln!();
        } else {
            // No tokenizer: ids out.
            let ids: Vec<String> = output.token_ids.iter().map(u32::to_string).collect();
            outln!("{}", ids.join(","));
        }
        let s = &output.stats;
        eprintln!(
            "[{} prompt tokens, {} generated, finish: {}, ttft {:.1} ms, decode {:.2} tok/s]",
            s.prompt_tokens, s.generated_tokens, output.finish_reason, s.ttft_ms, s.decode_tokens_per_s
        );
        if let Some(sp) = &output.spec {
            eprintln!(
                "[spec: {} verify steps, acceptance length {:.2}, acceptance rate {:.2}, per position {:?}]",
                sp.verify_steps, sp.acceptance_length, sp.acceptance_rate, sp.accepted_per_position
            );
        }
    }
    Ok(())
}
