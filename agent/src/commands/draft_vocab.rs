//! `nextn draft-vocab`: rank a model's tokens by how often a corpus uses them and write the draft vocabulary
//! file (`draft_vocab.txt`) that `--draft-vocab N` reads beside the model.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use nextn_engine::spec::{rank_by_frequency, DRAFT_VOCAB_FILE};
use nextn_engine::text::tokenizer::TokenizerBundle;
use nextn_engine::ModelConfig;
use serde_json::json;

use super::common::model_dir;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory: its tokenizer counts the corpus and the file is written beside it. Default: the
    /// bundled model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Text the drafts should predict well, e.g. the model's own outputs (repeatable). A `.jsonl` file with
    /// --field counts that field of every line; anything else is tokenized whole.
    #[arg(long = "corpus", required = true)]
    corpus: Vec<PathBuf>,
    /// For `.jsonl` corpora: count every string stored under this key, at any depth of each line's JSON
    /// (e.g. `completion`).
    #[arg(long)]
    field: Option<String>,
    /// Keep only the N most frequent ids (default: every id the corpus uses).
    #[arg(long)]
    size: Option<usize>,
    /// Output file (default: MODEL/draft_vocab.txt).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// Every string under `key` at any depth of `v`.
fn strings_under<'a>(v: &'a serde_json::Value, key: &str, out: &mut Vec<&'a str>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                if k == key {
                    collect_strings(x, out);
                } else {
                    strings_under(x, key, out);
                }
            }
        }
        serde_json::Value::Array(xs) => xs.iter().for_each(|x| strings_under(x, key, out)),
        _ => {}
    }
}

fn collect_strings<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a str>) {
    match v {
        serde_json::Value::String(s) => out.push(s),
        serde_json::Value::Array(xs) => xs.iter().for_each(|x| collect_strings(x, out)),
        serde_json::Value::Object(m) => m.values().for_each(|x| collect_strings(x, out)),
        _ => {}
    }
}

/// The texts of one corpus file.
fn texts(path: &Path, field: Option<&str>) -> anyhow::Result<Vec<String>> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let Some(key) = field.filter(|_| path.extension().is_some_and(|e| e == "jsonl")) else {
        return Ok(vec![raw]);
    };
    let mut out = Vec::new();
    for (i, line) in raw.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}: not a JSON line", path.display(), i + 1))?;
        let mut found = Vec::new();
        strings_under(&v, key, &mut found);
        out.extend(found.into_iter().map(str::to_string));
    }
    if out.is_empty() {
        bail!("{}: no string under `{key}` in any line", path.display());
    }
    Ok(out)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let dir = model_dir(args.model.clone())?;
    let cfg = ModelConfig::from_path(&dir)?;
    let bundle = TokenizerBundle::load(&dir).with_context(|| format!("tokenizer files in {}", dir.display()))?;
    let tok = bundle.require_tokenizer()?;
    let mut counts: HashMap<u32, u64> = HashMap::new();
    let mut total = 0u64;
    for path in &args.corpus {
        for text in texts(path, args.field.as_deref())? {
            for id in tok.encode(&text, false)? {
                *counts.entry(id).or_default() += 1;
                total += 1;
            }
        }
    }
    if total == 0 {
        bail!("the corpus has no tokens");
    }
    // End-of-turn ids first: a draft must be able to propose stopping.
    let mut always: Vec<u32> = bundle.eos_token_ids().to_vec();
    always.extend(cfg.eos_token_ids.iter().copied().filter(|id| !bundle.eos_token_ids().contains(id)));
    always.retain(|&id| (id as usize) < cfg.vocab_size);
    let mut ranked = rank_by_frequency(&counts, &always);
    if let Some(n) = args.size {
        if n == 0 {
            bail!("--size must be > 0");
        }
        ranked.truncate(n);
    }
    // Share of the corpus's tokens the first N ids cover (what a draft over them can propose at all).
    let coverage: Vec<(usize, f64)> = [64usize, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
        .into_iter()
        .filter(|&n| n < ranked.len())
        .chain([ranked.len()])
        .map(|n| (n, ranked[..n].iter().map(|id| counts.get(id).copied().unwrap_or(0)).sum::<u64>() as f64 / total as f64))
        .collect();
    let out_path = args.out.clone().unwrap_or_else(|| dir.join(DRAFT_VOCAB_FILE));
    let names: Vec<String> = args.corpus.iter().map(|p| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())).collect();
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&out_path).with_context(|| format!("creating {}", out_path.display()))?,
    );
    writeln!(f, "# nextn draft vocabulary: token ids, end-of-turn ids first, then by frequency ({total} tokens of {}{}).",
        names.join(", "), args.field.as_ref().map_or(String::new(), |k| format!(", field `{k}`")))?;
    writeln!(f, "# `--draft-vocab N` drafts over the first N ids; written by `nextn draft-vocab`.")?;
    for id in &ranked {
        writeln!(f, "{id}")?;
    }
    f.flush().with_context(|| format!("writing {}", out_path.display()))?;
    let summary = json!({
        "out": out_path.display().to_string(),
        "tokens_counted": total,
        "distinct_tokens": counts.len(),
        "written": ranked.len(),
        "vocab_size": cfg.vocab_size,
        "coverage": coverage.iter().map(|&(n, c)| json!({"size": n, "fraction": c})).collect::<Vec<_>>(),
    });
    if args.json {
        outln!("{summary}");
    } else {
        outln!("wrote {} ids to {} ({total} corpus tokens, {} distinct, vocabulary {})", ranked.len(), out_path.display(), counts.len(), cfg.vocab_size);
        for (n, c) in &coverage {
            outln!("  first {n:>6} ids cover {:>6.2}% of the corpus tokens", c * 100.0);
        }
    }
    Ok(())
}
