//! `nextn-bench prefix`: what the prefix cache saves on agent-like traffic.
//!
//! One long prompt (system prompt + tool schemas in real traffic) is sent three ways on an engine with the
//! prefix cache on: **cold** (empty cache), **warm** (same prefix, a different suffix), and as an **agent
//! loop** on a second engine whose cache starts empty (each loop's prompt = the previous prompt + its reply +
//! a tool result). Every request is also run
//! on an engine with the cache off, and the outputs must be identical.

use std::time::Instant;

use nextn_engine::{Engine, EngineConfig, EngineError, Output, SamplingParams};
use serde_json::{json, Value};

/// What to run.
pub struct PrefixBench {
    pub prompt: Vec<u32>,
    /// Tokens of each suffix / tool result.
    pub suffix_tokens: usize,
    /// Agent loops (the first one is cold).
    pub loops: usize,
    pub max_new_tokens: usize,
    pub cfg: EngineConfig,
}

/// A suffix of `n` in-vocabulary ids drawn from the prompt itself (`salt` picks which).
fn suffix(prompt: &[u32], n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| prompt[(i * 7919 + salt * 104_729) % prompt.len()]).collect()
}

fn run(engine: &mut Engine, prompt: Vec<u32>, max_new: usize) -> Result<(Output, f64), EngineError> {
    let params = SamplingParams { max_new_tokens: max_new, ignore_eos: true, ..SamplingParams::greedy() };
    let t = Instant::now();
    let out = engine.generate(prompt, params, |_| {})?;
    Ok((out, t.elapsed().as_secs_f64() * 1e3))
}

/// The request stream: cold then warm on `engine`, then `loops` agent loops on `fresh` (an empty cache, so
/// the first loop is cold). Returns (prompt, output) pairs.
fn stream(b: &PrefixBench, engine: &mut Engine, fresh: &mut Engine) -> Result<Vec<(Vec<u32>, Output)>, EngineError> {
    let mut done = Vec::new();
    let with = |s: Vec<u32>| b.prompt.iter().copied().chain(s).collect::<Vec<u32>>();
    for (i, p) in [with(suffix(&b.prompt, b.suffix_tokens, 1)), with(suffix(&b.prompt, b.suffix_tokens, 2))].into_iter().enumerate() {
        let (out, _) = run(engine, p.clone(), b.max_new_tokens)?;
        note(&format!("{} ttft {:.1} ms, cached {}", ["cold", "warm"][i], out.stats.ttft_ms, out.stats.cached_prompt_tokens));
        done.push((p, out));
    }
    let engine = fresh;
    let mut p = with(suffix(&b.prompt, b.suffix_tokens, 3));
    for round in 0..b.loops {
        let (out, _) = run(engine, p.clone(), b.max_new_tokens)?;
        note(&format!("loop {} ttft {:.1} ms, cached {}", round + 1, out.stats.ttft_ms, out.stats.cached_prompt_tokens));
        let next: Vec<u32> =
            p.iter().copied().chain(out.token_ids.iter().copied()).chain(suffix(&b.prompt, b.suffix_tokens, 4 + round)).collect();
        done.push((p, out));
        p = next;
    }
    Ok(done)
}

/// Progress on stderr (the report goes to stdout).
fn note(line: &str) {
    eprintln!("prefix: {line}");
}

/// Run the benchmark; `make` builds a fresh engine for a config. The first engine (cache on) is the timed
/// one; the same stream then runs with the cache off for the identity check (and its cold TTFTs).
pub fn run_prefix(b: &PrefixBench, mut make: impl FnMut(EngineConfig) -> Result<Engine, EngineError>) -> Result<Value, EngineError> {
    let pc = b.cfg.prefix_cache.unwrap_or_default();
    let on_cfg = EngineConfig { prefix_cache: Some(pc), ..b.cfg.clone() };
    let (mut on, mut on_loops) = (make(on_cfg.clone())?, make(on_cfg)?);
    let cached = stream(b, &mut on, &mut on_loops)?;
    let mut off = make(EngineConfig { prefix_cache: None, ..b.cfg.clone() })?;
    note("the same stream with the cache off");
    let plain = stream(b, &mut off, &mut make(EngineConfig { prefix_cache: None, ..b.cfg.clone() })?)?;
    let identical = cached.iter().zip(&plain).all(|((pa, a), (pb, b))| pa == pb && a.token_ids == b.token_ids);
    let ttft = |o: &Output| o.stats.ttft_ms;
    let (cold, warm) = (ttft(&cached[0].1), ttft(&cached[1].1));
    let loops: Vec<Value> = cached[2..]
        .iter()
        .zip(&plain[2..])
        .map(|((p, o), (_, po))| {
            json!({"prompt_tokens": p.len(), "cached_prompt_tokens": o.stats.cached_prompt_tokens,
                   "ttft_ms": ttft(o), "ttft_ms_cache_off": ttft(po)})
        })
        .collect();
    let first_loop = ttft(&cached[2].1);
    let later: Vec<f64> = cached[3..].iter().map(|(_, o)| ttft(o) / first_loop).collect();
    Ok(json!({
        "bench": "prefix",
        "prompt_tokens": b.prompt.len(),
        "suffix_tokens": b.suffix_tokens,
        "block_size": b.cfg.block_size,
        "checkpoint_every_blocks": pc.checkpoint_every_blocks,
        "mtp_draft_steps": b.cfg.spec.map(|s| s.draft_steps),
        "cold": {"ttft_ms": cold, "cached_prompt_tokens": cached[0].1.stats.cached_prompt_tokens},
        "warm": {"ttft_ms": warm, "cached_prompt_tokens": cached[1].1.stats.cached_prompt_tokens},
        "warm_over_cold": warm / cold,
        "cache_off_ttft_ms": [ttft(&plain[0].1), ttft(&plain[1].1)],
        "agent_loops": loops,
        "later_loops_over_first": later,
        "identical_with_cache_off": identical,
        "prefix_cache": on.prefix_cache_stats(),
    }))
}
