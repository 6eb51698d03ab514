//! Options and helpers shared by several subcommands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use nextn_engine::spec::{DraftVocab, SpecConfig};
use nextn_engine::{Device, LoadOptions, Model, ModelSource};

/// Where the forward runs.
/// Parse `1,2,3` (spaces allowed) into token ids.
pub fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(i, t)| t.parse::<u32>().with_context(|| format!("--prompt-ids: item {i} (`{t}`) is not a token id")))
        .collect::<anyhow::Result<Vec<u32>>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: no token ids given");
    }
    Ok(ids)
}

/// Size the rayon pool (0 = one thread per core).
pub fn set_threads(threads: usize) -> anyhow::Result<()> {
    if threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("--threads")?;
    }
    Ok(())
}

/// What `device` runs: on the CPU the model loaded on the host (progress bar for large checkpoints); on
/// CUDA the checkpoint opened, for the backend to upload tensor by tensor without a host copy.
pub fn model_source(dir: &Path, device: Device) -> anyhow::Result<ModelSource> {
    let what = if device == Device::Cpu { "loading model from" } else { "opening model" };
    ModelSource::for_device(dir, device, &LOAD_OPTIONS).with_context(|| format!("{what} {}", dir.display()))
}

/// Loading with a progress bar for large checkpoints.
pub const LOAD_OPTIONS: LoadOptions = LoadOptions { progress_above_bytes: Some(256 << 20) };

/// Load a model directory with a progress bar for large checkpoints.
pub fn load_model(dir: &Path) -> anyhow::Result<Model> {
    Model::load(dir, &LOAD_OPTIONS).with_context(|| format!("loading model from {}", dir.display()))
}

/// The bundled default model, shipped in the repository.
pub const DEFAULT_MODEL: &str = "models/nextn-live-tiny";

/// `--model`, else `$NEXTN_MODEL`, else the bundled default model (looked up in the source tree this binary
/// was built from, then relative to the current directory).
pub fn model_dir(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(m) = model {
        return Ok(m);
    }
    if let Some(m) = std::env::var_os("NEXTN_MODEL") {
        return Ok(PathBuf::from(m));
    }
    let candidates = [
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(DEFAULT_MODEL),
        PathBuf::from(DEFAULT_MODEL),
    ];
    candidates
        .iter()
        .find(|p| p.join("config.json").is_file())
        .cloned()
        .with_context(|| format!("no --model given and the bundled default model ({DEFAULT_MODEL}) was not found; pass --model DIR"))
}

/// `--draft-vocab FILE|N` (see [`DraftVocab::resolve`]): a number takes the first N ids of the model's
/// `draft_vocab.txt`, anything else is a token-id file. `dummy`: the weights are random, so with no model
/// directory a number means ids 0..N. Asking for one without MTP speculation is an error, not ignored.
pub fn draft_vocab(
    arg: Option<&str>,
    spec_on: bool,
    model_dir: Option<&Path>,
    vocab: usize,
    dummy: bool,
) -> anyhow::Result<Option<DraftVocab>> {
    let Some(arg) = arg else { return Ok(None) };
    if !spec_on {
        bail!("--draft-vocab only applies to MTP drafts: add --spec mtp (and --draft-steps K > 0)");
    }
    if dummy && model_dir.is_none() {
        if let Ok(n) = arg.trim().parse::<usize>() {
            return Ok(Some(DraftVocab::first_ids(n, vocab)?));
        }
    }
    Ok(Some(DraftVocab::resolve(arg, model_dir, vocab)?))
}

/// `--spec`: speculative decoding on every command that runs the engine (generate, agent, serve, replay).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Spec {
    /// EAGLE-style chain drafting with the MTP layer, verified in one target forward.
    Mtp,
    Off,
}

/// The engine's speculation settings from `--spec` and `--draft-steps` (one convention on every command:
/// `--spec mtp --draft-steps K`, K in 1..=8; `--spec off` or K = 0 decode plainly).
pub fn spec_config(spec: Spec, draft_steps: usize) -> Option<SpecConfig> {
    (spec == Spec::Mtp && draft_steps > 0).then_some(SpecConfig { draft_steps })
}
