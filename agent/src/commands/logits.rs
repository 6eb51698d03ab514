//! `nextn logits`: logits at every prompt position, as one JSON object on stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

use nextn_engine::Device;

use super::common::{load_model, model_dir, model_source, parse_ids, set_threads};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (HF layout: config.json + *.safetensors). Default: the bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Comma-separated prompt token ids, e.g. 1,2,3.
    #[arg(long, value_name = "IDS")]
    prompt_ids: String,
    /// Compute device: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// CPU worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    set_threads(args.threads)?;
    let ids = parse_ids(&args.prompt_ids)?;
    let dir = model_dir(args.model)?;
    let logits = match args.device {
        Device::Cpu => load_model(&dir)?.logits(&ids)?,
        device => {
            let source = model_source(&dir, device)?;
            let vocab = source.config().vocab_size;
            if let Some((i, &id)) = ids.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
                anyhow::bail!("token id {id} at index {i} is out of range (vocab_size = {vocab})");
            }
            nextn_engine::backend::select::logits_on(device, source, &ids)?
        }
    };
    // Stream the JSON: a real vocabulary makes this tens of MB. f32 values print in shortest round-trip form.
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    write!(out, "{{\"logits\":[")?;
    for (i, row) in logits.iter().enumerate() {
        if i > 0 {
            write!(out, ",")?;
        }
        serde_json::to_writer(&mut out, row)?;
    }
    writeln!(out, "]}}")?;
    out.flush().context("writing logits to stdout")?;
    Ok(())
}
