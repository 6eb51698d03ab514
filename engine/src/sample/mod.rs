//! Sampling: one row of logits → one token id, and deciding when a request is finished.
//!
//! [`probs`] computes the exact distribution a [`Sampler`] draws from, so speculative sampling can
//! reuse it as the target distribution. The filters apply in this order (the same as vLLM):
//!
//! 1. temperature: `logits / T` (`T = 0` is greedy: argmax, lowest index on ties, no RNG used);
//! 2. top-k: keep the `k` largest logits (ties broken by lower token id), mask the rest;
//! 3. softmax over the survivors;
//! 4. top-p: keep the smallest set of highest-probability tokens whose cumulative mass ≥ `top_p`
//!    (ties by lower token id; never empty);
//! 5. min-p: drop tokens with `p < min_p · p_max`;
//! 6. renormalise.
//!
//! Cost: O(V) for temperature/min-p, O(V) expected for top-k (`select_nth_unstable`), top-p sorts
//! only the tokens with `p ≥ p_max · 10⁻²` (widening the cut only when their mass is below `top_p`),
//! so O(V log V) at worst. A [`Sampler`] keeps its scratch buffers, so steady-state sampling does not
//! allocate. NaN logits are treated as `-inf`; `+inf` logits share all the mass.
//!
//! A row longer than [`PAR_CHUNK`] (Qwen3.6's 248 320 ids: ~2.7 ms of `exp` alone on one core, paid per sampled
//! token whenever the logits come back to the host) is processed in chunks of it on the rayon pool. Every
//! elementwise pass gives the same bits as one thread; sums run chunk by chunk and add the chunk sums in order,
//! so the result does not depend on the thread count, and a row of at most one chunk is summed exactly as a
//! single loop over it.
//!
//! [`StopChecker`] decides [`FinishReason`] per generated token; see its docs for the precedence.

use serde::{Deserialize, Serialize};

pub mod keyed;
mod stop;

pub use stop::{FinishReason, StopChecker, StopMatch};

/// `max_new_tokens` when a request does not say.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 256;

/// Per-request sampling parameters. Missing fields deserialize to the [`Default`] (greedy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens below `min_p · p_max`, in [0, 1); 0 = off.
    pub min_p: f32,
    /// RNG seed; `None` seeds from entropy (the seed used is still recorded, see [`Sampler::seed`]).
    pub seed: Option<u64>,
    /// Generate at most this many tokens (≥ 1).
    pub max_new_tokens: usize,
    /// Finish when the generated text contains any of these (non-empty) strings.
    pub stop_strings: Vec<String>,
    /// Keep generating past EOS tokens (stop strings and limits still apply).
    pub ignore_eos: bool,
    /// The output may not begin with any of these token sequences: the last id of each is masked out at the
    /// position where the output so far equals the rest of it ([`ban_prefixes`]). A retry uses it so that it
    /// cannot repeat a refused reply up to the clause the refusal named.
    pub banned_prefixes: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding, [`DEFAULT_MAX_NEW_TOKENS`], no stop strings.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            stop_strings: Vec::new(),
            ignore_eos: false,
            banned_prefixes: Vec::new(),
        }
    }

    /// Temperature 0, or below `f32::MIN_POSITIVE` (subnormal: `1 / T` overflows), is the argmax.
    pub fn is_greedy(&self) -> bool {
        !(self.temperature >= f32::MIN_POSITIVE)
    }

    /// Checks every parameter against its allowed range; call once when a request is admitted.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplingError::Temperature(t));
        }
        if self.top_k > vocab_size {
            return Err(SamplingError::TopK {
                top_k: self.top_k,
                vocab_size,
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if self.max_new_tokens == 0 {
            return Err(SamplingError::MaxNewTokens);
        }
        if let Some(index) = self.stop_strings.iter().position(|s| s.is_empty()) {
            return Err(SamplingError::EmptyStopString { index });
        }
        for (index, prefix) in self.banned_prefixes.iter().enumerate() {
            if prefix.is_empty() {
                return Err(SamplingError::EmptyBannedPrefix { index });
            }
            if let Some(&token) = prefix.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(SamplingError::BannedToken { index, token, vocab_size });
            }
        }
        Ok(())
    }
}

/// A sampling parameter outside its allowed range. The message names the parameter and the range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("sampling parameter `temperature` must be a finite number >= 0 (0 = greedy), got {0}")]
    Temperature(f32),
    #[error(
        "sampling parameter `top_k` must be in [0, {vocab_size}] (0 = off; {vocab_size} = vocab size), got {top_k}"
    )]
    TopK { top_k: usize, vocab_size: usize },
    #[error("sampling parameter `top_p` must be in (0, 1] (1 = off), got {0}")]
    TopP(f32),
    #[error("sampling parameter `min_p` must be in [0, 1) (0 = off), got {0}")]
    MinP(f32),
    #[error("sampling parameter `max_new_tokens` must be >= 1, got 0")]
    MaxNewTokens,
    #[error("sampling parameter `stop_strings[{index}]` is empty (it would match at once); remove it")]
    EmptyStopString { index: usize },
    #[error("sampling parameter `banned_prefixes[{index}]` is empty (it would ban nothing); remove it")]
    EmptyBannedPrefix { index: usize },
    #[error("sampling parameter `banned_prefixes[{index}]` holds token {token}, outside the vocabulary of {vocab_size}")]
    BannedToken { index: usize, token: u32, vocab_size: usize },
}

impl SamplingError {
    /// The offending parameter's name, as in [`SamplingParams`].
    pub fn parameter(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopK { .. } => "top_k",
            Self::TopP(_) => "top_p",
            Self::MinP(_) => "min_p",
            Self::MaxNewTokens => "max_new_tokens",
            Self::EmptyStopString { .. } => "stop_strings",
            Self::EmptyBannedPrefix { .. } | Self::BannedToken { .. } => "banned_prefixes",
        }
    }
}

/// Masks out (−∞) the logit that would make the output begin with one of `banned`, in each of `rows`
/// consecutive rows of `vocab` logits: row `i` continues `output` followed by `drafts[..i]` (a verify's rows;
/// one row with no drafts for a plain step). A prefix is banned at the row whose output so far equals all of it
/// but its last id.
pub fn ban_prefixes(logits: &mut [f32], vocab: usize, output: &[u32], drafts: &[u32], banned: &[Vec<u32>]) {
    let rows = logits.len() / vocab;
    for (i, row) in logits.chunks_exact_mut(vocab).enumerate().take(rows.min(drafts.len() + 1)) {
        let len = output.len() + i;
        for prefix in banned.iter().filter(|p| p.len() == len + 1) {
            let (head, last) = prefix.split_at(len);
            let (from_output, from_drafts) = head.split_at(output.len());
            if from_output == output && from_drafts == &drafts[..i] {
                row[last[0] as usize] = f32::NEG_INFINITY;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The distribution.
// ---------------------------------------------------------------------------------------------

/// Ordering key of a logit: NaN → -inf, -0 → +0, so ties and NaNs are handled one way everywhere.
#[inline]
fn key(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x + 0.0 }
}

/// Index of the largest value, lowest index on ties; NaN never wins (index 0 if all are NaN/-inf).
pub fn argmax(values: &[f32]) -> u32 {
    assert!(!values.is_empty(), "argmax of an empty row");
    let (mut best, mut best_key) = (0, key(values[0]));
    for (i, &x) in values.iter().enumerate().skip(1) {
        if key(x) > best_key {
            (best, best_key) = (i, key(x));
        }
    }
    best as u32
}

/// The distribution [`Sampler::sample`] draws from: a length-`V` vector summing to 1, zero on every
/// filtered token. Greedy params give the one-hot vector at [`argmax`].
pub fn probs(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    probs_into(logits, params, &mut out, &mut scratch);
    out
}

/// [`probs`] into caller-owned buffers (`out` is resized to `V`; `scratch` holds sort keys).
pub fn probs_into(logits: &[f32], params: &SamplingParams, out: &mut Vec<f32>, scratch: &mut Vec<u64>) {
    let v = logits.len();
    assert!(v > 0, "probs of an empty logits row");
    out.clear();
    out.resize(v, 0.0);
    if params.is_greedy() {
        out[argmax(logits) as usize] = 1.0;
        return;
    }

    // 1–3. Temperature, top-k, softmax. Top-k is chosen on the raw logits (same order as logits / T).
    let k = if params.top_k == 0 { v } else { params.top_k.min(v) };
    if k < v {
        top_k_keys(logits, k, scratch);
        softmax_over(logits, scratch.iter().map(|&sk| key_index(sk)), params.temperature, out);
    } else {
        softmax_all(logits, params.temperature, out);
    }

    // 4. Top-p.
    if params.top_p < 1.0 {
        top_p_mask(out, params.top_p, scratch);
    }

    // 5. Min-p (p_max is unchanged by top-p, which always keeps the most likely token).
    if params.min_p > 0.0 {
        let threshold = params.min_p * max_of(out, |&p| p, 0.0);
        each_mut(out, |_, p| {
            if *p < threshold {
                *p = 0.0;
            }
        });
    }

    // 6. Renormalise.
    normalise(out);
}

/// Sort key of `(values[i], i)`: ascending `u64` order is descending value (NaN as -inf), then
/// ascending index — a total order, so every cut is deterministic, and sorting plain `u64`s is fast.
#[inline]
fn desc_key(x: f32, i: usize) -> u64 {
    let b = key(x).to_bits();
    // Map f32 to u32 preserving order (negatives flip all bits, positives set the sign bit).
    let ordered = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (u64::from(!ordered) << 32) | i as u64
}

#[inline]
fn key_index(sort_key: u64) -> usize {
    (sort_key & 0xFFFF_FFFF) as usize
}

// ---------------------------------------------------------------------------------------------
// Passes over a row, chunked on the rayon pool past PAR_CHUNK.
// ---------------------------------------------------------------------------------------------

/// Rows longer than this run their passes in chunks of this many ids on the rayon pool (see the module docs).
pub const PAR_CHUNK: usize = 32 * 1024;

/// `f(i, &mut row[i])` for every `i` (any order; each element's result is the same bits as in one loop).
fn each_mut(row: &mut [f32], f: impl Fn(usize, &mut f32) + Sync) {
    use rayon::prelude::*;
    if row.len() <= PAR_CHUNK {
        row.iter_mut().enumerate().for_each(|(i, x)| f(i, x));
    } else {
        row.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, chunk)| {
            chunk.iter_mut().enumerate().for_each(|(j, x)| f(c * PAR_CHUNK + j, x));
        });
    }
}

/// The largest `f(x)` over `row` and `init` (max is exact in any order).
fn max_of(row: &[f32], f: impl Fn(&f32) -> f32 + Sync, init: f32) -> f32 {
    use rayon::prelude::*;
    if row.len() <= PAR_CHUNK {
        row.iter().map(f).fold(init, f32::max)
    } else {
        row.par_chunks(PAR_CHUNK).map(|c| c.iter().map(&f).fold(init, f32::max)).reduce(|| init, f32::max)
    }
}

/// `Σ row` in f64 over the positive entries, chunk by chunk in order (one chunk: a single loop).
fn positive_sum(row: &[f32]) -> f64 {
    use rayon::prelude::*;
    let sum = |c: &[f32]| c.iter().map(|&x| x.max(0.0) as f64).sum::<f64>();
    if row.len() <= PAR_CHUNK {
        return sum(row);
    }
    let parts: Vec<f64> = row.par_chunks(PAR_CHUNK).map(sum).collect();
    parts.iter().sum()
}

/// The sort keys ([`desc_key`]) of the `k < V` largest logits into `scratch`, in no particular order: per chunk
/// its own k largest, then the k largest of those (the same set as one selection over the row: keys are unique).
fn top_k_keys(logits: &[f32], k: usize, scratch: &mut Vec<u64>) {
    use rayon::prelude::*;
    let keys_of = |c: usize, chunk: &[f32], into: &mut Vec<u64>| {
        into.extend(chunk.iter().enumerate().map(|(j, &x)| desc_key(x, c * PAR_CHUNK + j)));
        if into.len() > k {
            into.select_nth_unstable(k - 1);
            into.truncate(k);
        }
    };
    scratch.clear();
    if logits.len() <= PAR_CHUNK {
        keys_of(0, logits, scratch);
    } else {
        let parts: Vec<Vec<u64>> = logits
            .par_chunks(PAR_CHUNK)
            .enumerate()
            .map(|(c, chunk)| {
                let mut keys = Vec::with_capacity(chunk.len());
                keys_of(c, chunk, &mut keys);
                keys
            })
            .collect();
        parts.iter().for_each(|p| scratch.extend_from_slice(p));
        scratch.select_nth_unstable(k - 1);
        scratch.truncate(k);
    }
}

/// [`softmax_over`] every id, in chunked passes.
fn softmax_all(logits: &[f32], t: f32, out: &mut [f32]) {
    let max = max_of(logits, |&x| key(x), f32::NEG_INFINITY);
    if max == f32::NEG_INFINITY {
        out[0] = 1.0;
        return;
    }
    each_mut(out, |i, o| {
        let x = key(logits[i]);
        *o = if max == f32::INFINITY { (x == f32::INFINITY) as u8 as f32 } else { ((x - max) / t).exp() };
    });
    normalise(out);
}

/// `out[i] = softmax(logits[idx] / t)[i]` for `i` in `idx`; `out` is zero elsewhere on entry.
fn softmax_over(logits: &[f32], idx: impl Iterator<Item = usize> + Clone, t: f32, out: &mut [f32]) {
    let max = idx.clone().map(|i| key(logits[i])).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        // Everything masked: fall back to the lowest surviving index.
        out[idx.min().unwrap_or(0)] = 1.0;
        return;
    }
    for i in idx {
        let x = key(logits[i]);
        out[i] = if max == f32::INFINITY {
            (x == f32::INFINITY) as u8 as f32
        } else {
            // (x - max) / t ≤ 0, so no overflow however small t is.
            ((x - max) / t).exp()
        };
    }
    normalise(out);
}

fn normalise(p: &mut [f32]) {
    // Entries are ≥ 0 here, so the positive sum is the sum.
    let sum = positive_sum(p);
    if sum > 0.0 {
        let inv = 1.0 / sum;
        each_mut(p, |_, x| *x = (*x as f64 * inv) as f32);
    }
}

/// Zeroes everything outside the nucleus of the normalised distribution `p`.
fn top_p_mask(p: &mut [f32], top_p: f32, scratch: &mut Vec<u64>) {
    use rayon::prelude::*;
    let p_max = max_of(p, |&x| x, 0.0);
    // The tokens with p ≥ τ are a prefix of the sorted order; if their mass reaches top_p the nucleus
    // lies inside them and sorting them alone gives the same cut as sorting everything.
    for factor in [1e-2f32, 1e-4, 1e-6, 0.0] {
        let tau = p_max * factor;
        let keep = |&(_, &x): &(usize, &f32)| x > 0.0 && x >= tau;
        scratch.clear();
        if p.len() <= PAR_CHUNK {
            scratch.extend(p.iter().enumerate().filter(keep).map(|(i, &x)| desc_key(x, i)));
        } else {
            scratch.par_extend(p.par_iter().enumerate().filter(keep).map(|(i, &x)| desc_key(x, i)));
        }
        // A flat row can put most of its ids in here (10⁵ keys: ~8 ms on one core); keys are unique, so the
        // parallel sort gives the same order.
        if scratch.len() > PAR_CHUNK {
            scratch.par_sort_unstable();
        } else {
            scratch.sort_unstable();
        }
        let mut cum = 0.0f64;
        let cut = scratch.iter().position(|&sk| {
            cum += p[key_index(sk)] as f64;
            cum >= top_p as f64
        });
        if let Some(n) = cut {
            let ic = key_index(scratch[n]);
            let pc = p[ic];
            each_mut(p, |i, x| {
                if *x < pc || (*x == pc && i > ic) {
                    *x = 0.0;
                }
            });
            return;
        }
    }
    // Rounding left the total mass just under top_p: keep everything.
}

/// Inverse-CDF draw from `probs` (need not be normalised) with `u ∈ [0, 1)`. Never returns a zero-
/// probability token; if all are zero, returns [`argmax`] (index 0).
pub fn draw(probs: &[f32], u: f64) -> u32 {
    use rayon::prelude::*;
    // Past one chunk the running sum restarts at each chunk from the ordered sum of the chunks before it (the
    // same sums [`positive_sum`] adds), so the scan reads only the chunk the target falls in.
    let parts: Vec<f64> = if probs.len() <= PAR_CHUNK {
        vec![positive_sum(probs)]
    } else {
        probs.par_chunks(PAR_CHUNK).map(positive_sum).collect()
    };
    let target = u * parts.iter().sum::<f64>();
    let mut base = 0.0f64;
    let mut last = None;
    for (c, &part) in parts.iter().enumerate() {
        let lo = c * PAR_CHUNK;
        let chunk = &probs[lo..probs.len().min(lo + PAR_CHUNK)];
        if part > 0.0 && base + part > target {
            let (mut cum, mut last_here) = (base, 0);
            for (j, &p) in chunk.iter().enumerate() {
                if p > 0.0 {
                    cum += p as f64;
                    if cum > target {
                        return (lo + j) as u32;
                    }
                    last_here = j;
                }
            }
            // Rounding kept the running sum at or under the target: the chunk's last token, as a single loop
            // ending under the target takes the row's last.
            return (lo + last_here) as u32;
        }
        base += part;
        if let Some(j) = chunk.iter().rposition(|&p| p > 0.0) {
            last = Some((lo + j) as u32);
        }
    }
    last.unwrap_or_else(|| argmax(probs))
}

// ---------------------------------------------------------------------------------------------
// RNG and the per-request sampler.
// ---------------------------------------------------------------------------------------------

/// xoshiro256** seeded through splitmix64: small, fast, reproducible across platforms.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn from_seed(seed: u64) -> Self {
        let mut sm = seed;
        Self {
            s: std::array::from_fn(|_| splitmix64(&mut sm)),
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A seed from the clock, the process's hash keys and a counter (distinct for back-to-back calls).
fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(nanos);
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// One per request: its params, its seeded RNG and scratch buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: Rng,
    probs: Vec<f32>,
    scratch: Vec<u64>,
}

impl Sampler {
    /// Params are expected to have passed [`SamplingParams::validate`]. Out-of-range values do not
    /// panic here (top_k > V acts as off), but their meaning is unspecified.
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Self {
            params,
            seed,
            rng: Rng::from_seed(seed),
            probs: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The seed actually in use; `SamplingParams { seed: Some(sampler.seed()), .. }` reproduces the run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Next token: argmax when greedy, else one draw from [`probs`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        probs_into(logits, &self.params, &mut self.probs, &mut self.scratch);
        let u = self.rng.next_f64();
        draw(&self.probs, u)
    }

    /// The filtered distribution for `logits` (see [`probs`]), in the sampler's own buffer.
    pub fn probs(&mut self, logits: &[f32]) -> &[f32] {
        probs_into(logits, &self.params, &mut self.probs, &mut self.scratch);
        &self.probs
    }

    /// One draw from an arbitrary distribution (e.g. a speculative residual) with this RNG.
    pub fn sample_from(&mut self, probs: &[f32]) -> u32 {
        let u = self.rng.next_f64();
        draw(probs, u)
    }

    /// One uniform in [0, 1) from this RNG (e.g. a speculative accept test).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;
    use super::*;
    use proptest::prelude::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(7),
            ..SamplingParams::greedy()
        }
    }

    fn kept(p: &[f32]) -> Vec<usize> {
        (0..p.len()).filter(|&i| p[i] > 0.0).collect()
    }

    /// softmax(logits / t) in f64, the test's independent reference.
    fn softmax64(logits: &[f32], t: f64) -> Vec<f64> {
        let m = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// Pearson's statistic of `counts` against `expected_p` over the cells with expected_p > 0.
    fn chi_square(counts: &[usize], expected_p: &[f64], n: usize) -> f64 {
        counts
            .iter()
            .zip(expected_p)
            .filter(|(_, p)| **p > 0.0)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// χ² critical values at significance 0.001 for 1..=7 degrees of freedom.
    const CHI2_CRIT_0_001: [f64; 7] = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322];

    const LOGITS8: [f32; 8] = [1.0, -1.5, 2.0, 0.0, -0.5, 1.5, -1.0, 0.5];

    fn ln(ps: &[f64]) -> Vec<f32> {
        ps.iter().map(|p| p.ln() as f32).collect()
    }

    /// A row of `n` logits like an LM head's: a wide body, a few strong candidates (seeded).
    fn long_row(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::from_seed(seed);
        let mut row: Vec<f32> = (0..n).map(|_| (rng.next_f64() * 12.0 - 6.0) as f32).collect();
        for _ in 0..8 {
            let i = (rng.next_u64() % n as u64) as usize;
            row[i] = 9.0 + rng.next_f64() as f32;
        }
        row
    }

    /// Rows past one chunk (Qwen3.6's vocabulary size, and an odd length) are filtered in chunks on the rayon pool:
    /// the same bits with 1 thread as with 4, a distribution within 5e-6 (relative; f32 `exp`) of the exact one, top-k keeping exactly
    /// the k largest, a top-p nucleus that is minimal, and draws that are the inverse CDF of an f64 scan.
    #[test]
    fn long_rows_are_exact_and_independent_of_the_thread_count() {
        let pool = |threads| rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let (one, four) = (pool(1), pool(4));
        for (n, seed) in [(248_320usize, 1u64), (3 * PAR_CHUNK + 123, 2)] {
            let row = long_row(n, seed);
            for prm in [params(1.0, 0, 1.0, 0.0), params(1.0, 0, 0.95, 0.0), params(0.7, 20, 0.95, 0.0), params(1.0, 0, 0.9, 0.05)] {
                let p1 = one.install(|| probs(&row, &prm));
                let p4 = four.install(|| probs(&row, &prm));
                assert!(p1.iter().zip(&p4).all(|(a, b)| a.to_bits() == b.to_bits()), "{n} {prm:?}: thread count changed bits");
                // Against an f64 reference of the same filters.
                let mut exact = softmax64(&row, prm.temperature as f64);
                if prm.top_k > 0 {
                    let mut order: Vec<usize> = (0..n).collect();
                    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
                    let keep: std::collections::HashSet<usize> = order[..prm.top_k].iter().copied().collect();
                    assert_eq!(kept(&p1).into_iter().filter(|i| !keep.contains(i)).count(), 0, "top-k kept another id");
                    let z: f64 = keep.iter().map(|&i| exact[i]).sum();
                    exact.iter_mut().enumerate().for_each(|(i, e)| *e = if keep.contains(&i) { *e / z } else { 0.0 });
                }
                let kept_ids = kept(&p1);
                let mass: f64 = kept_ids.iter().map(|&i| exact[i]).sum();
                if prm.top_p < 1.0 && prm.min_p == 0.0 {
                    // Minimal: the kept set reaches top_p, and without its least likely member it would not.
                    let least = kept_ids.iter().map(|&i| exact[i]).fold(f64::INFINITY, f64::min);
                    assert!(mass >= prm.top_p as f64 - 1e-5 && mass - least < prm.top_p as f64 + 1e-5, "{n} {prm:?}: nucleus mass {mass}");
                }
                for &i in kept_ids.iter().take(2000) {
                    let want = exact[i] / mass;
                    if prm.min_p == 0.0 {
                        assert!((p1[i] as f64 - want).abs() <= 5e-6 * want, "{n} {prm:?}: p[{i}] {} vs {want}", p1[i]);
                    }
                }
                // Draws: the first id whose f64 running sum exceeds u · total.
                let total: f64 = p1.iter().map(|&x| x as f64).sum();
                let mut rng = Rng::from_seed(seed + 10);
                for _ in 0..200 {
                    let u = rng.next_f64();
                    let mut cum = 0.0;
                    let want = p1.iter().position(|&x| {
                        cum += x as f64;
                        x > 0.0 && cum > u * total
                    });
                    let got = one.install(|| draw(&p1, u));
                    assert_eq!(Some(got as usize), want, "{n} {prm:?} u={u}");
                    assert_eq!(got, four.install(|| draw(&p1, u)));
                }
            }
        }
    }

    #[test]
    fn rng_matches_reference_xoshiro256starstar_and_splitmix64() {
        let mut sm = 0u64;
        assert_eq!(splitmix64(&mut sm), 0xE220_A839_7B1D_CDAF);
        let mut r = Rng { s: [1, 2, 3, 4] };
        assert_eq!([r.next_u64(), r.next_u64(), r.next_u64()], [11520, 0, 1509978240]);
        let mut r = Rng::from_seed(1);
        assert!((0..10_000).map(|_| r.next_f64()).all(|u| (0.0..1.0).contains(&u)));
    }

    #[test]
    fn banned_prefixes_mask_only_where_the_output_so_far_matches() {
        let vocab = 4;
        let banned = vec![vec![1, 2, 3], vec![0], vec![1, 3]];
        // Output [1], a verify of drafts [2, 3]: row 0 continues [1] ([1, 3] bans 3), row 1 continues [1, 2]
        // ([1, 2, 3] bans 3), row 2 continues [1, 2, 3] (nothing); [0] applies only to an empty output.
        let mut rows = vec![0.5f32; 3 * vocab];
        ban_prefixes(&mut rows, vocab, &[1], &[2, 3], &banned);
        let masked: Vec<usize> = (0..rows.len()).filter(|&i| rows[i] == f32::NEG_INFINITY).collect();
        assert_eq!(masked, vec![3, vocab + 3]);
        // Empty output, one row: the one-token ban.
        let mut row = vec![0.5f32; vocab];
        ban_prefixes(&mut row, vocab, &[], &[], &banned);
        assert_eq!(row, vec![f32::NEG_INFINITY, 0.5, 0.5, 0.5]);
        // A draft that leaves the banned path: the later rows are free.
        let mut rows = vec![0.5f32; 2 * vocab];
        ban_prefixes(&mut rows, vocab, &[1], &[0], &banned);
        assert_eq!(rows.iter().filter(|x| x.is_infinite()).count(), 1);
        assert!(SamplingParams { banned_prefixes: vec![vec![]], ..SamplingParams::greedy() }.validate(4).is_err());
        let e = SamplingParams { banned_prefixes: vec![vec![1, 9]], ..SamplingParams::greedy() }.validate(4).unwrap_err();
        assert_eq!(e.parameter(), "banned_prefixes");
        assert!(e.to_string().contains("token 9"), "{e}");
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let logits = [0.5, 3.0, -1.0, 3.0, f32::NAN, 2.9];
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&logits), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        let p = probs(&logits, &SamplingParams::greedy());
        assert_eq!(kept(&p), vec![1]);
        assert_eq!(p[1], 1.0);
    }

    #[test]
    fn top_k_keeps_exactly_k_breaking_ties_by_lower_index() {
        let logits = [1.0, 3.0, 3.0, 3.0, 0.0, 2.0];
        assert_eq!(kept(&probs(&logits, &params(1.0, 2, 1.0, 0.0))), vec![1, 2]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 4, 1.0, 0.0))), vec![1, 2, 3, 5]);
        let p = probs(&logits, &params(1.0, 3, 1.0, 0.0));
        assert_eq!(kept(&p), vec![1, 2, 3]);
        assert!(p[1..4].iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-6));
        // top_k = V is the same as off.
        assert_eq!(
            probs(&logits, &params(1.0, 6, 1.0, 0.0)),
            probs(&logits, &params(1.0, 0, 1.0, 0.0))
        );
    }

    #[test]
    fn top_p_keeps_the_minimal_nucleus() {
        let logits = ln(&[0.15, 0.5, 0.05, 0.3]);
        let keep = |top_p| kept(&probs(&logits, &params(1.0, 0, top_p, 0.0)));
        assert_eq!(keep(0.4), vec![1]);
        assert_eq!(keep(0.75), vec![1, 3]);
        assert_eq!(keep(0.81), vec![0, 1, 3]);
        assert_eq!(keep(0.96), vec![0, 1, 2, 3]);
        assert_eq!(keep(1e-6), vec![1], "always at least one token");
        let p = probs(&logits, &params(1.0, 0, 0.75, 0.0));
        assert!(
            (p[1] - 0.625).abs() < 1e-6 && (p[3] - 0.375).abs() < 1e-6,
            "renormalised: {p:?}"
        );
    }

    #[test]
    fn top_p_over_a_large_flat_tail_widens_the_cut_and_stays_minimal() {
        // p_0 ≈ 0.18 and 99 999 tail tokens of ≈ 8e-6 each: the first candidate cuts are too narrow.
        let v = 100_000;
        let mut logits = vec![0.0f32; v];
        logits[0] = 10.0;
        let top_p = 0.5;
        let p = probs(&logits, &params(1.0, 0, top_p, 0.0));
        let k = kept(&p);
        assert_eq!(k, (0..k.len()).collect::<Vec<_>>(), "tail ties break by lower index");
        let full = softmax64(&logits, 1.0);
        let mass: f64 = k.iter().map(|&i| full[i]).sum();
        assert!(
            mass >= top_p as f64 - 1e-4 && mass - full[1] < top_p as f64 + 1e-4,
            "mass {mass}, kept {}",
            k.len()
        );
    }

    #[test]
    fn min_p_drops_tokens_below_min_p_times_p_max() {
        let logits = ln(&[0.15, 0.5, 0.05, 0.3]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 0, 1.0, 0.2))), vec![0, 1, 3]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 0, 1.0, 0.5))), vec![1, 3]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 0, 1.0, 0.99))), vec![1]);
    }

    #[test]
    fn filters_apply_in_documented_order_top_k_then_top_p_on_renormalised_mass() {
        // After top-k = 2 the masses are 4/7 and 3/7, so top_p = 0.5 keeps one token; without
        // top-k the first token holds only 0.4 and top_p = 0.5 keeps two.
        let logits = ln(&[0.4, 0.3, 0.2, 0.1]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 2, 0.5, 0.0))), vec![0]);
        assert_eq!(kept(&probs(&logits, &params(1.0, 0, 0.5, 0.0))), vec![0, 1]);
        // Temperature before top-p: T = 0.5 sharpens [0.4, 0.3, ...] so 0.5 is reached by one token.
        assert_eq!(kept(&probs(&logits, &params(0.5, 0, 0.5, 0.0))), vec![0]);
    }

    #[test]
    fn temperature_to_zero_approaches_argmax_without_nans() {
        for t in [1e-3f32, 1e-6, 1e-30] {
            let p = probs(&LOGITS8, &params(t, 0, 1.0, 0.0));
            assert!(p.iter().all(|x| x.is_finite()));
            assert!(p[2] > 0.999_999, "T = {t}: {p:?}");
            let mut s = Sampler::new(params(t, 0, 1.0, 0.0));
            assert!((0..200).all(|_| s.sample(&LOGITS8) == 2));
        }
    }

    #[test]
    fn non_finite_logits_are_handled() {
        let p = probs(&[f32::NAN, 0.0, f32::NEG_INFINITY, 0.0], &params(1.0, 0, 1.0, 0.0));
        assert_eq!(p, vec![0.0, 0.5, 0.0, 0.5]);
        let p = probs(&[0.0, f32::INFINITY, 5.0], &params(1.0, 0, 1.0, 0.0));
        assert_eq!(p, vec![0.0, 1.0, 0.0]);
        let p = probs(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 0.9, 0.1));
        assert_eq!(p, vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn same_seed_same_sequence_different_seed_different_sequence() {
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed: Some(seed),
                ..params(1.0, 0, 1.0, 0.0)
            });
            (0..200).map(|_| s.sample(&LOGITS8)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn unseeded_sampler_records_a_seed_that_reproduces_the_run() {
        let p = SamplingParams {
            seed: None,
            ..params(1.0, 0, 1.0, 0.0)
        };
        let mut a = Sampler::new(p.clone());
        let mut b = Sampler::new(SamplingParams {
            seed: Some(a.seed()),
            ..p.clone()
        });
        assert_eq!(
            (0..100).map(|_| a.sample(&LOGITS8)).collect::<Vec<_>>(),
            (0..100).map(|_| b.sample(&LOGITS8)).collect::<Vec<_>>()
        );
        assert_ne!(
            Sampler::new(p.clone()).seed(),
            Sampler::new(p).seed(),
            "entropy seeds differ"
        );
    }

    #[test]
    fn temperature_sampling_fits_softmax_chi_square_at_0_001() {
        let (n, t) = (20_000, 0.7);
        let mut s = Sampler::new(SamplingParams {
            seed: Some(2024),
            ..params(t, 0, 1.0, 0.0)
        });
        let mut counts = [0usize; 8];
        (0..n).for_each(|_| counts[s.sample(&LOGITS8) as usize] += 1);
        let expected = softmax64(&LOGITS8, t as f64);
        assert!(
            expected.iter().all(|p| p * n as f64 >= 5.0),
            "every cell needs ≥ 5 expected draws"
        );
        let chi2 = chi_square(&counts, &expected, n);
        assert!(
            chi2 < CHI2_CRIT_0_001[6],
            "χ² = {chi2:.2} ≥ 24.32 (7 dof); counts {counts:?}"
        );
    }

    #[test]
    fn top_p_sampling_fits_renormalised_nucleus_chi_square_at_0_001() {
        let (n, t, top_p) = (20_000, 0.7, 0.95);
        // Reference nucleus: sort softmax(logits / T) descending, keep until the mass reaches top_p.
        let full = softmax64(&LOGITS8, t as f64);
        let mut order: Vec<usize> = (0..8).collect();
        order.sort_by(|&a, &b| full[b].total_cmp(&full[a]));
        let mut cum = 0.0;
        let size = order
            .iter()
            .position(|&i| {
                cum += full[i];
                cum >= top_p as f64
            })
            .unwrap()
            + 1;
        assert_eq!(size, 5, "the chosen top_p cuts inside the distribution");
        let mass: f64 = order[..size].iter().map(|&i| full[i]).sum();
        let mut expected = vec![0.0; 8];
        order[..size].iter().for_each(|&i| expected[i] = full[i] / mass);

        let mut s = Sampler::new(SamplingParams {
            seed: Some(99),
            ..params(t, 0, top_p, 0.0)
        });
        let mut counts = [0usize; 8];
        (0..n).for_each(|_| counts[s.sample(&LOGITS8) as usize] += 1);
        assert!(
            order[size..].iter().all(|&i| counts[i] == 0),
            "drew outside the nucleus: {counts:?}"
        );
        let chi2 = chi_square(&counts, &expected, n);
        assert!(
            chi2 < CHI2_CRIT_0_001[size - 2],
            "χ² = {chi2:.2} ({} dof); counts {counts:?}",
            size - 1
        );
    }

    #[test]
    fn each_invalid_parameter_is_rejected_naming_it() {
        let ok = SamplingParams {
            stop_strings: vec!["\n\n".into()],
            ..params(0.7, 50, 0.9, 0.05)
        };
        assert_eq!(ok.validate(100), Ok(()));
        assert_eq!(SamplingParams::default().validate(1), Ok(()));
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_k: 101,
                    ..ok.clone()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.01,
                    ..ok.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: 1.0,
                    ..ok.clone()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    max_new_tokens: 0,
                    ..ok.clone()
                },
                "max_new_tokens",
            ),
            (
                SamplingParams {
                    stop_strings: vec!["x".into(), String::new()],
                    ..ok.clone()
                },
                "stop_strings[1]",
            ),
        ];
        for (p, name) in cases {
            let err = p.validate(100).expect_err(name);
            let msg = err.to_string();
            assert!(msg.contains(&format!("`{name}`")), "{msg}");
            assert!(name.starts_with(err.parameter()));
        }
        let msg = SamplingParams {
            top_p: 2.0,
            ..ok.clone()
        }
        .validate(100)
        .unwrap_err()
        .to_string();
        assert!(msg.contains("(0, 1]"), "{msg}");
    }

    #[test]
    fn params_serde_defaults_to_greedy_and_finish_reason_is_lowercase() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.8, "stop_strings": ["</s>"]}"#).unwrap();
        assert_eq!(
            p,
            SamplingParams {
                temperature: 0.8,
                stop_strings: vec!["</s>".into()],
                ..SamplingParams::greedy()
            }
        );
        let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        for (r, s) in [
            (FinishReason::Stop, "stop"),
            (FinishReason::Length, "length"),
            (FinishReason::Context, "context"),
        ] {
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<FinishReason>(&format!("\"{s}\"")).unwrap(), r);
            assert_eq!(r.to_string(), s);
        }
    }

    // --- properties ---

    fn arb_logits() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(
            prop_oneof![8 => -20.0f32..20.0, 1 => Just(0.0f32), 1 => Just(f32::NEG_INFINITY)],
            1..64,
        )
    }

    proptest! {
        #[test]
        fn probs_is_a_distribution_that_keeps_argmax_and_a_logit_prefix(
            logits in arb_logits(),
            t in 0.05f32..3.0,
            top_k in 0usize..70,
            top_p in 0.01f32..=1.0,
            min_p in 0.0f32..0.99,
        ) {
            let p = probs(&logits, &params(t, top_k, top_p, min_p));
            prop_assert_eq!(p.len(), logits.len());
            prop_assert!(p.iter().all(|&x| x >= 0.0 && x.is_finite()));
            let sum: f64 = p.iter().map(|&x| x as f64).sum();
            prop_assert!((sum - 1.0).abs() < 1e-5, "sum {}", sum);
            prop_assert!(p[argmax(&logits) as usize] > 0.0);
            let k = kept(&p);
            if top_k > 0 { prop_assert!(k.len() <= top_k); }
            // Kept tokens are the top of the (logit desc, index asc) order.
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| key(logits[b]).total_cmp(&key(logits[a])).then(a.cmp(&b)));
            prop_assert!(order[..k.len()].iter().all(|&i| p[i] > 0.0), "{:?} {:?}", logits, p);
        }

        #[test]
        fn top_p_alone_keeps_a_minimal_set_reaching_top_p(logits in arb_logits(), top_p in 0.01f32..0.999) {
            prop_assume!(logits.iter().any(|x| x.is_finite()));
            let p = probs(&logits, &params(1.0, 0, top_p, 0.0));
            let full = softmax64(&logits, 1.0);
            let k = kept(&p);
            let mass: f64 = k.iter().map(|&i| full[i]).sum();
            let smallest = k.iter().map(|&i| full[i]).fold(f64::INFINITY, f64::min);
            prop_assert!(mass >= top_p as f64 - 1e-5, "mass {} < top_p", mass);
            prop_assert!(mass - smallest < top_p as f64 + 1e-5, "not minimal: {} without smallest", mass - smallest);
        }

        #[test]
        fn desc_key_orders_by_value_desc_then_index(a in any::<f32>(), b in any::<f32>(), i in 0usize..9, j in 0usize..9) {
            let expected = key(b).partial_cmp(&key(a)).unwrap().then(i.cmp(&j));
            prop_assert_eq!(desc_key(a, i).cmp(&desc_key(b, j)), expected);
        }

        #[test]
        fn draws_never_pick_a_filtered_token(logits in arb_logits(), seed in any::<u64>(), top_k in 0usize..5) {
            let par = SamplingParams { seed: Some(seed), ..params(1.0, top_k, 0.8, 0.1) };
            let p = probs(&logits, &par);
            let mut s = Sampler::new(par);
            for _ in 0..20 {
                prop_assert!(p[s.sample(&logits) as usize] > 0.0);
            }
        }
    }
}
