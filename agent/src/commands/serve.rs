//! `nextn serve`: load the model, start one engine worker, serve the OpenAI-compatible API.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use nextn_agent::serve::{self, ServeConfig, State};
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::{Device, Engine, EngineConfig, EngineService};

use super::common::{draft_vocab, model_dir, model_source, set_threads, spec_config, Spec};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json, *.safetensors, tokenizer files, chat template). Default: the bundled
    /// model (models/nextn-live-tiny), or $NEXTN_MODEL.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the listening line on stderr says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Compute device: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Speculative decoding with the model's MTP head for every request (`off` = plain decoding). Set per
    /// server: a request may restate it (`"nextn": {"spec": ...}`) but not change it.
    #[arg(long, value_enum, default_value_t = Spec::Mtp)]
    spec: Spec,
    /// Draft tokens per speculation round (1..=8; 0 = off, as --spec off), with --spec mtp.
    #[arg(long, default_value_t = 3)]
    draft_steps: usize,
    /// Reduced draft vocabulary (outputs unchanged; see `nextn generate --help`): N = the first N ids of the
    /// model's draft_vocab.txt, else a token-id file.
    #[arg(long, value_name = "FILE|N")]
    draft_vocab: Option<String>,
    /// Batch-invariant numerics: a request's tokens (seeded sampling included) do not depend on the requests
    /// batched with it nor on prefix-cache hits (CPU only; prefill ~2x slower).
    #[arg(long)]
    batch_invariant: bool,
    /// Requests the engine decodes together in one continuous batch (its sequence slots).
    #[arg(long, default_value_t = 16)]
    max_running: usize,
    /// Requests accepted beyond --max-running that wait for a slot; past running + queued the server answers
    /// 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise); /health and /metrics stay open.
    #[arg(long)]
    api_key: Option<String>,
    /// CPU worker threads for the forward (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// The model id in /v1/models and in requests' `model` field. Default: the model directory's name.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Bytes of KV cache (default 1 GiB; never more than --max-running sequences at the full context need), as the
    /// device stores it: f32 on the CPU, bf16 (the MTP layer's included) on CUDA.
    #[arg(long)]
    kv_cache_bytes: Option<usize>,
    /// Most prompt rows of one request in one forward (chunked prefill; default 2048). Shorter chunks let the
    /// running requests' decode rows in sooner while a long prompt streams in, at a slower prefill.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Most rows in one forward: decode, verify and prefill rows of every running request together (default 2048).
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Let the model think first (`<think>` block) unless a request sets `chat_template_kwargs.enable_thinking`.
    /// Off by default: chats render the template with `enable_thinking: false` (an empty think block), as the
    /// bundled model was trained.
    #[arg(long)]
    enable_thinking: bool,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10)]
    shutdown_grace: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    for (flag, value) in [("--prefill-chunk", args.prefill_chunk), ("--max-batch-tokens", args.max_batch_tokens)] {
        anyhow::ensure!(value != Some(0), "{flag} must be at least 1 (rows per forward)");
    }
    set_threads(args.threads)?;
    anyhow::ensure!(args.max_running > 0, "--max-running must be at least 1");

    // 1. Model and tokenizer files.
    let dir = model_dir(args.model.clone())?;
    let source = model_source(&dir, args.device)?;
    let bundle = TokenizerBundle::load(&dir).with_context(|| format!("tokenizer files in {}", dir.display()))?;
    // The harness profile the model declares, for `/v1/models` (a declared one that does not load is an error,
    // as it is for `nextn agent` on this model).
    let harness = match nextn_harness::profile::profile_of_model(&dir)? {
        Some(h) => {
            let version = nextn_harness::Harness::load(&h).with_context(|| format!("harness {}", h.display()))?.version().to_string();
            Some((h, version))
        }
        None => None,
    };
    let tokenizer = bundle.tokenizer().cloned();
    let mut eos = bundle.eos_token_ids().to_vec();
    for id in &source.config().eos_token_ids {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }

    // 2. One engine worker for every request.
    let spec = spec_config(args.spec, args.draft_steps);
    let draft_vocab = draft_vocab(args.draft_vocab.as_deref(), spec.is_some(), Some(&dir), source.config().vocab_size, false)?;
    let spec_label = match (&spec, &draft_vocab) {
        (None, _) => "off".to_string(),
        (Some(s), None) => format!("mtp, {} draft steps", s.draft_steps),
        (Some(s), Some(dv)) => format!("mtp, {} draft steps, draft vocabulary {}", s.draft_steps, dv.len()),
    };
    let mut ecfg = EngineConfig {
        spec,
        draft_vocab,
        max_num_seqs: args.max_running,
        batch_invariant: args.batch_invariant,
        ..EngineConfig::default()
    };
    if let Some(b) = args.kv_cache_bytes {
        ecfg.kv_cache_bytes = b;
    }
    if let Some(n) = args.prefill_chunk {
        ecfg.prefill_chunk = n;
    }
    if let Some(n) = args.max_batch_tokens {
        ecfg.max_batch_tokens = n;
    }
    anyhow::ensure!(
        ecfg.spec.is_none() || source.has_mtp(),
        "--spec mtp needs a model with an MTP head (mtp.* tensors), and {} has none; try --spec off",
        dir.display()
    );
    let device = args.device;
    let service =
        EngineService::spawn(move || Engine::on_device(device, source, tokenizer, eos, ecfg)).context("starting the engine")?;

    // 3. Serve until a signal.
    let served_model_name = args.served_model_name.clone().unwrap_or_else(|| {
        dir.file_name().map_or_else(|| "nextn".to_string(), |n| n.to_string_lossy().into_owned())
    });
    let cfg = ServeConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        served_model_name,
        max_running: args.max_running,
        max_queue: args.max_queue,
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        enable_thinking: args.enable_thinking,
        model_label: dir.display().to_string(),
        spec_label,
        harness,
    };
    let state = State::new(service.handle(), bundle, &cfg);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("nextn-http")
        .build()
        .context("starting the HTTP runtime")?;
    let result = runtime.block_on(serve::run(state, &cfg));
    runtime.shutdown_timeout(Duration::from_secs(1));
    service.shutdown();
    result
}
