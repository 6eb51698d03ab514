//! Load benchmark for a running `nextn serve`: throughput and TTFT / inter-token latency percentiles at
//! several concurrency levels, printed as one JSON object.
//!
//! ```text
//! nextn serve --port 8000 &
//! cargo run --release -p nextn-agent --example serve_load -- --url http://127.0.0.1:8000 \
//!     --concurrency 1,4,16,64 --requests-per-level 64 --max-tokens 64
//! ```
//!
//! Each level keeps `c` streaming `/v1/completions` requests in flight (greedy, `ignore_eos`, fixed
//! `max_tokens`, prompts from the bundled model's held-out comments in its chat template) until
//! `--requests-per-level` have finished. TTFT is measured at the client from sending the request to the first
//! non-empty text chunk; ITL is the gap between consecutive network reads that carried text (with speculation one
//! step delivers several tokens at once, so ITL is per step, not per token); TPOT is a request's time from first
//! to last text over its tokens after the first. Throughput = completion tokens (from `usage`) / wall time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::Semaphore;

const HELDOUT: &str = include_str!("../../models/nextn-live-tiny/heldout_prompts.jsonl");

struct Opts {
    url: String,
    levels: Vec<usize>,
    requests: usize,
    max_tokens: usize,
    api_key: Option<String>,
}

fn opts() -> Opts {
    let mut o = Opts {
        url: "http://127.0.0.1:8000".into(),
        levels: vec![1, 4, 16, 64],
        requests: 64,
        max_tokens: 64,
        api_key: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--url" => o.url = v.trim_end_matches('/').to_string(),
            "--concurrency" => o.levels = v.split(',').filter_map(|c| c.trim().parse().ok()).collect(),
            "--requests-per-level" => o.requests = v.parse().expect("--requests-per-level N"),
            "--max-tokens" => o.max_tokens = v.parse().expect("--max-tokens N"),
            "--api-key" => o.api_key = Some(v),
            other => panic!("unknown argument {other}; see the example's doc comment"),
        }
        i += 2;
    }
    o
}

/// One request's client-side timings.
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    completion_tokens: u64,
    /// First text to last text.
    decode: Duration,
}

async fn one(http: &reqwest::Client, o: &Opts, prompt: &str) -> Result<Sample, String> {
    let body = json!({
        "prompt": prompt, "max_tokens": o.max_tokens, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut rb = http.post(format!("{}/v1/completions", o.url)).json(&body);
    if let Some(k) = &o.api_key {
        rb = rb.bearer_auth(k);
    }
    let mut r = rb.send().await.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("HTTP {}: {}", r.status(), r.text().await.unwrap_or_default()));
    }
    let (mut first, mut last, mut gaps, mut tokens) = (None, None, Vec::new(), 0);
    let mut buf = String::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| e.to_string())? {
        let now = Instant::now();
        let mut text_seen = false;
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(nl) = buf.find("\n\n") {
            let event: String = buf.drain(..nl + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n;
            }
            text_seen |= v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty());
        }
        // One network read may carry several tokens (one speculation step): one arrival.
        if text_seen {
            if first.is_none() {
                first = Some(now - start);
            }
            if let Some(prev) = last {
                gaps.push(now - prev);
            }
            last = Some(now);
        }
    }
    let ttft = first.unwrap_or_else(|| start.elapsed());
    let decode = last.map_or(Duration::ZERO, |l| l - start - ttft);
    Ok(Sample { ttft, gaps, completion_tokens: tokens, decode })
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = Arc::new(opts());
    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build().unwrap();
    // Chat-formatted prompts, rendered here the way the server's template does (enable_thinking off).
    let prompts: Arc<Vec<String>> = Arc::new(
        HELDOUT
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["prompt"].as_str().map(str::to_string))
            .map(|p| format!("<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"))
            .collect(),
    );
    let mut levels = Vec::new();
    for &c in &o.levels {
        let sem = Arc::new(Semaphore::new(c));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..o.requests.max(c) {
            let permit = Arc::clone(&sem).acquire_owned().await.unwrap();
            let (http, o, prompts) = (http.clone(), Arc::clone(&o), Arc::clone(&prompts));
            tasks.push(tokio::spawn(async move {
                let r = one(&http, &o, &prompts[i % prompts.len()]).await;
                drop(permit);
                r
            }));
        }
        let mut samples = Vec::new();
        let mut errors = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(s) => samples.push(s),
                Err(e) => errors.push(e),
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
        let mut itl: Vec<Duration> = samples.iter().flat_map(|s| s.gaps.iter().copied()).collect();
        ttft.sort();
        itl.sort();
        let tokens: u64 = samples.iter().map(|s| s.completion_tokens).sum();
        // Time per output token after the first, per request.
        let mut tpot: Vec<Duration> = samples
            .iter()
            .filter(|s| s.completion_tokens > 1)
            .map(|s| s.decode / (s.completion_tokens - 1) as u32)
            .collect();
        tpot.sort();
        let level = json!({
            "concurrency": c,
            "requests": samples.len(),
            "errors": errors.len(),
            "wall_s": wall,
            "output_tokens_per_s": tokens as f64 / wall,
            "requests_per_s": samples.len() as f64 / wall,
            "ttft_ms": {"p50": pct(&ttft, 0.5), "p99": pct(&ttft, 0.99)},
            "itl_ms": {"p50": pct(&itl, 0.5), "p99": pct(&itl, 0.99)},
            "tpot_ms": {"p50": pct(&tpot, 0.5), "p99": pct(&tpot, 0.99)},
        });
        eprintln!("{level}");
        if let Some(e) = errors.first() {
            eprintln!("first error: {e}");
        }
        levels.push(level);
    }
    let out = json!({"url": o.url, "max_tokens": o.max_tokens, "levels": levels});
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
}
