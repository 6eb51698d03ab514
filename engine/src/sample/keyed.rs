//! Keyed sampling: the host reference of the device sampler (`sample_f32` in kernels/cuda/sample.cu), so a
//! backend can draw a request's tokens where its logits are and only the ids come back.
//!
//! A draw depends on the row's logits and on a [`KeyedDraw`]: the request's parameters, its seed and a counter
//! (the row's position), never on the batch around it nor on earlier draws. The filters are [`super::probs`]'s
//! (temperature, top-k, top-p, min-p), computed on integer keys so that every sum is exact:
//!
//! 1. `m` = the largest logit (NaN as -inf); `t_i = (m − z_i) / T`; a token with `t_i ≥ 27.5` (`p_i < 1.2e-12 ·
//!    p_max`) is dropped. Key `q_i = ⌊t_i · 2^27⌋` (0 for the max), integer weight `W_i = round(2^40 ·
//!    exp(−q_i / 2^27))` (≥ 1 for every kept token).
//! 2. top-k: keep keys ≤ the k-th smallest key (ties at it all kept).
//! 3. top-p: keep keys ≤ the smallest key whose cumulative weight reaches `⌈top_p · Σ W⌉`.
//! 4. min-p: keep `t_i ≤ −ln(min_p)` (`p_i ≥ min_p · p_max`).
//! 5. Draw `r = ⌊hash(seed, counter) · M / 2^64⌋` over the kept mass `M`: the first kept token (in vocabulary
//!    order) whose inclusive prefix weight exceeds `r`.
//!
//! Speculative verification of a deterministic draft `d` (an MTP argmax) is this draw at the verify row, then a
//! comparison: the id equals `d` with probability `p(d)` (accept), and when it differs it is a draw from `p`
//! without `d`, which is exactly the residual `norm(max(p − onehot(d), 0))`. So acceptance is the greedy rule on
//! drawn ids, and since the counter is the drawn token's position, a request's tokens do not depend on whether,
//! or what, it speculated (given the same logits).
//!
//! Temperature 0 or subnormal (or top-k 1, or no finite logit) is the argmax, lowest index on ties, as [`super::argmax`].
//! The device computes `exp2f` to within 2 ulp of this reference, so its weights, and rarely a draw within a
//! few parts in 10⁷ of a boundary, can differ; every other step is the same integer arithmetic.

use super::SamplingParams;

/// Keys per unit of `t` (2^27).
const KEY_SCALE: f32 = 134_217_728.0;
/// Tokens with `t ≥ T_CUT` are dropped up front.
const T_CUT: f32 = 27.5;

/// One keyed draw: the sampling parameters of a row, its request's seed and its counter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyedDraw {
    pub seed: u64,
    /// Distinct per draw of a request: the position of the row whose logits are drawn from.
    pub counter: u64,
    /// Below `f32::MIN_POSITIVE` (0, or subnormal): the argmax.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
}

impl KeyedDraw {
    pub fn new(params: &SamplingParams, seed: u64, counter: u64) -> KeyedDraw {
        KeyedDraw {
            seed,
            counter,
            temperature: params.temperature,
            top_k: params.top_k.min(u32::MAX as usize) as u32,
            top_p: params.top_p,
            min_p: params.min_p,
        }
    }

    /// The argmax: a temperature below `f32::MIN_POSITIVE` (0, or subnormal, whose `1 / T` overflows).
    pub fn is_greedy(&self) -> bool {
        !(self.temperature >= f32::MIN_POSITIVE)
    }

    /// The 64-bit uniform of this draw: `splitmix64(splitmix64(seed) ^ counter)` (sample.cu's).
    pub fn hash(&self) -> u64 {
        splitmix64(splitmix64(self.seed) ^ self.counter)
    }
}

/// min-p's cut on `t`, `−ln(min_p)`, in f64 rounded once (the device's libm `logf` differs; its `log` agrees).
fn min_p_cut(min_p: f32) -> f32 {
    -(min_p as f64).ln() as f32
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `round(2^40 · exp(−q / 2^27))`: `2^x` in f32 at `x = (q / 2^27) · (−log2 e)` (as the device computes it), times
/// 2^40 (exact), rounded to the nearest integer (ties to even).
#[inline(always)]
fn weight(q: u32) -> u64 {
    let t = q as f32 * (1.0 / KEY_SCALE);
    let e = exp2(t * -std::f32::consts::LOG2_E) as f64 * 1_099_511_627_776.0;
    // e < 2^52: adding 2^52 rounds it to an integer (ties to even), which is then the mantissa's bits.
    (e + 4_503_599_627_370_496.0).to_bits() - 4_503_599_627_370_496f64.to_bits()
}

/// `2^x` for `x` in [−64, 0], correctly rounded to f32 (none of 754 720 keys tested is off): `2^round(x)` times
/// a degree-10 polynomial in `x − round(x)` (relative error < 3·10⁻¹³), in f64 adds and multiplies only.
/// Not libm's `exp2f`: that differs between libm builds (and FMA variants), this gives the same bits on every
/// machine, and the loop over a row vectorises. The device's `exp2f` is within 2 ulp of it.
#[inline(always)]
fn exp2(x: f32) -> f32 {
    // 1.5 · 2^52: adding it rounds x to an integer n (ties to even), held in the low bits of the sum.
    const SHIFT: f64 = 6_755_399_441_055_744.0;
    // ln2^k / k!: 2^r = exp(r ln 2).
    const C: [f64; 11] = [
        1.0,
        0.693_147_180_559_945_3,
        0.240_226_506_959_100_7,
        0.055_504_108_664_821_58,
        0.009_618_129_107_628_477,
        0.001_333_355_814_642_844_3,
        0.000_154_035_303_933_816_1,
        1.525_273_380_405_984e-5,
        1.321_548_679_014_431e-6,
        1.017_808_600_923_969_6e-7,
        7.054_911_620_801_121e-9,
    ];
    let x = x as f64;
    let kd = x + SHIFT;
    let r = x - (kd - SHIFT);
    let p = C.iter().rev().fold(0.0, |acc, &c| acc * r + c);
    // 2^n: n + 1023 in the exponent field (the low 12 bits of the sum's bits hold n mod 2^12).
    let scale = f64::from_bits(kd.to_bits().wrapping_add(1023) << 52);
    (p * scale) as f32
}

#[inline(always)]
fn sanitize(z: f32) -> f32 {
    if z.is_nan() { f32::NEG_INFINITY } else { z }
}

/// Each id's key and weight (a dropped id: `DROPPED`, 0) at max `m` and `1 / T = inv_t`: the `exp2` of every
/// token, the bulk of a draw.
#[inline(always)]
fn keys_and_weights(logits: &[f32], m: f32, inv_t: f32, keys: &mut [u32], weights: &mut [u64]) {
    for ((&z, key), w) in logits.iter().zip(keys.iter_mut()).zip(weights.iter_mut()) {
        let t = (m - sanitize(z)) * inv_t;
        let kept = t < T_CUT;
        let q = if kept { key_of(t) } else { DROPPED };
        *key = q;
        *w = if kept { weight(q) } else { 0 };
    }
}

/// The largest value (NaN never wins; -inf for a row of NaN / -inf): 16 running maxima, so the loop vectorises.
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let tail = row.chunks_exact(16);
    let rest = tail.remainder();
    for c in tail {
        for (m, &z) in lanes.iter_mut().zip(c) {
            *m = if z > *m { z } else { *m };
        }
    }
    rest.iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &z| if z > m { z } else { m })
}

/// `Σ weights[i]` over the ids whose key is at most `bound` (a dropped id weighs 0 anyway).
#[inline(always)]
fn kept_mass(keys: &[u32], weights: &[u64], bound: u32) -> u64 {
    keys.iter().zip(weights).map(|(&q, &w)| if q <= bound { w } else { 0 }).sum()
}

/// `fn $name(args) -> R`: `$portable(args)` compiled for the widest vector extension this CPU has. Its loops
/// vectorise to that width and give the same bits on every path (Rust never contracts a multiply and an add into an
/// FMA; integer sums are exact).
macro_rules! widest {
    ($name:ident = $portable:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $portable($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $portable($($arg),*)
                }
                // SAFETY: each path runs only on a CPU that has its features.
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    return unsafe { avx2($($arg),*) };
                }
            }
            $portable($($arg),*)
        }
    };
}

widest!(keys_and_weights_wide = keys_and_weights(logits: &[f32], m: f32, inv_t: f32, keys: &mut [u32], weights: &mut [u64]) -> ());
widest!(max_of_wide = max_of(row: &[f32]) -> f32);
widest!(kept_mass_wide = kept_mass(keys: &[u32], weights: &[u64], bound: u32) -> u64);

/// `⌊t · 2^27⌋` for `t` in [0, T_CUT): `(t * KEY_SCALE) as u32`, from the f32's bits (a float → u32 conversion does
/// not vectorise below AVX-512; these shifts do).
#[inline(always)]
fn key_of(t: f32) -> u32 {
    // Without the sign: t is −0.0 for a +0.0 logit when the max is −0.0, and its key is 0 (as `as u32` gives).
    let bits = (t * KEY_SCALE).to_bits() & 0x7FFF_FFFF;
    let e = (bits >> 23) as i32 - 127;
    let mantissa = (bits & 0x7F_FFFF) | 0x80_0000;
    if e < 0 {
        0
    } else if e <= 23 {
        mantissa >> (23 - e)
    } else {
        mantissa << (e - 23).min(8)
    }
}

/// The key of a dropped token (larger than every kept key: those are below `T_CUT · 2^27 < 2^32 − 1`).
const DROPPED: u32 = u32::MAX;
/// Kept keys are counted and weighed in buckets of their top bits (2^20 keys = 1/128 of a unit of `t` each); the
/// last bucket holds no kept key (`T_CUT · 2^27 < 4095 · 2^20`).
const BUCKET_SHIFT: u32 = 20;
const BUCKETS: usize = 1 << (32 - BUCKET_SHIFT);

fn bucket(q: u32) -> usize {
    (q >> BUCKET_SHIFT) as usize
}

/// The keys and weights of ids `start..start + keys.len()` (a dropped id: key `DROPPED`, weight 0).
struct Chunk {
    start: usize,
    keys: Vec<u32>,
    weights: Vec<u64>,
}

/// `f` of each chunk of `0..v` ([`super::PAR_CHUNK`] ids each), in order; on the rayon pool when there are several.
fn per_chunk<T: Send>(v: usize, f: impl Fn(std::ops::Range<usize>) -> T + Sync) -> Vec<T> {
    use rayon::prelude::*;
    let n = v.div_ceil(super::PAR_CHUNK);
    let range = |c: usize| c * super::PAR_CHUNK..((c + 1) * super::PAR_CHUNK).min(v);
    if n <= 1 { vec![f(0..v)] } else { (0..n).into_par_iter().map(|c| f(range(c))).collect() }
}

/// `f` of each chunk, in order; on the rayon pool when there are several.
fn each_chunk<T: Send>(chunks: &[Chunk], f: impl Fn(&Chunk) -> T + Sync) -> Vec<T> {
    use rayon::prelude::*;
    if chunks.len() > 1 { chunks.par_iter().map(&f).collect() } else { chunks.iter().map(f).collect() }
}

/// The number and the total weight of the kept keys in each bucket.
struct Histogram {
    count: Vec<u32>,
    weight: Vec<u64>,
}

impl Histogram {
    fn of(chunks: &[Chunk]) -> Histogram {
        let parts = each_chunk(chunks, |c| {
            let mut h = Histogram { count: vec![0; BUCKETS], weight: vec![0; BUCKETS] };
            // Dropped ids land in the last bucket, which holds no kept key (no branch: half the ids of a row can be
            // dropped, in no order).
            for (&q, &w) in c.keys.iter().zip(&c.weights) {
                h.count[bucket(q)] += 1;
                h.weight[bucket(q)] += w;
            }
            h.count[bucket(DROPPED)] = 0;
            h
        });
        let mut sum = Histogram { count: vec![0; BUCKETS], weight: vec![0; BUCKETS] };
        for p in &parts {
            for b in 0..BUCKETS {
                sum.count[b] += p.count[b];
                sum.weight[b] += p.weight[b];
            }
        }
        sum
    }
}

/// The kept keys of bucket `b` that are at most `bound`, sorted. Blocks of 64 ids with none of them (almost all)
/// are passed over by a test that vectorises.
fn keys_in_bucket(chunks: &[Chunk], b: usize, bound: u32) -> Vec<u32> {
    let lo = (b as u32) << BUCKET_SHIFT;
    let hi = (lo | ((1 << BUCKET_SHIFT) - 1)).min(bound).min(DROPPED - 1);
    let inside = |q: u32| q.wrapping_sub(lo) <= hi.wrapping_sub(lo);
    let mut keys = Vec::new();
    for block in chunks.iter().flat_map(|c| c.keys.chunks(64)) {
        if block.iter().fold(false, |any, &q| any | inside(q)) {
            keys.extend(block.iter().copied().filter(|&q| inside(q)));
        }
    }
    keys.sort_unstable();
    keys
}

/// The k-th smallest kept key (k clamped to 1..=kept): the bucket that holds it by the counts, then within it.
fn kth_smallest_key(chunks: &[Chunk], hist: &Histogram, k: usize) -> u32 {
    let kept: usize = hist.count.iter().map(|&n| n as usize).sum();
    let k = k.clamp(1, kept);
    let mut below = 0;
    for (b, &n) in hist.count.iter().enumerate() {
        if below + n as usize >= k {
            return keys_in_bucket(chunks, b, DROPPED)[k - below - 1];
        }
        below += n as usize;
    }
    unreachable!("k ≤ the kept keys, which always hold the max token")
}

/// top-p over the kept keys at most `bound`: the smallest key whose cumulative weight (keys in order) reaches
/// `⌈top_p · Σ W⌉`. The buckets' weights find the bucket where the sum crosses the target; only its keys are sorted.
fn nucleus_bound(chunks: &[Chunk], hist: &Histogram, bound: u32, top_p: f32) -> u32 {
    // Buckets wholly at most `bound` count in full; the bucket of `bound` in part (unless it is whole too).
    let last = bucket(bound);
    let whole = |b: usize| ((b as u64 + 1) << BUCKET_SHIFT) - 1 <= bound as u64;
    let partial: Vec<u32> = if whole(last) { Vec::new() } else { keys_in_bucket(chunks, last, bound) };
    let partial_weight: u64 = partial.iter().map(|&q| weight(q)).sum();
    let weight_of = |b: usize| if whole(b) { hist.weight[b] } else { partial_weight };
    let total: u64 = (0..=last).map(weight_of).sum();
    let want = (top_p as f64 * total as f64).ceil();
    let target = if want >= total as f64 { total } else { want.max(0.0) as u64 }.clamp(1, total);
    let mut c = 0;
    for b in 0..=last {
        let w = weight_of(b);
        if c + w < target {
            c += w;
            continue;
        }
        let keys = if whole(b) { keys_in_bucket(chunks, b, bound) } else { partial };
        for q in keys {
            c += weight(q);
            if c >= target {
                return q;
            }
        }
        unreachable!("the bucket's keys reach the target");
    }
    unreachable!("the target is at most the total")
}

/// The token `draw` picks from `logits` (one row). See the module docs for the exact semantics.
///
/// Cost: one pass for the max, one for the keys and weights (an `exp2` per token: the bulk), a histogram of the keys
/// when top-k or top-p is on (then only the keys of one or two buckets are sorted), one pass for the draw; each pass
/// runs in chunks on the rayon pool for a row longer than [`super::PAR_CHUNK`]. Integer sums, so the draw does not
/// depend on the thread count.
pub fn sample(logits: &[f32], draw: &KeyedDraw) -> u32 {
    assert!(!logits.is_empty(), "keyed sample of an empty row");
    let v = logits.len();
    if draw.is_greedy() || draw.top_k == 1 {
        return super::argmax(logits);
    }
    let m = per_chunk(v, |r| max_of_wide(&logits[r])).into_iter().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return super::argmax(logits);
    }
    // 1. Keys and weights.
    let inv_t = 1.0 / draw.temperature;
    let chunks = per_chunk(v, |r| {
        let (mut keys, mut weights) = (vec![0; r.len()], vec![0; r.len()]);
        keys_and_weights_wide(&logits[r.clone()], m, inv_t, &mut keys, &mut weights);
        Chunk { start: r.start, keys, weights }
    });
    // 2. top-k: the k-th smallest key. 3. top-p: over the keys still kept, in order, the smallest whose cumulative
    // weight reaches the target. Neither: every key stays, nothing to count.
    let top_k = draw.top_k > 0 && (draw.top_k as usize) < v;
    let mut bound = DROPPED;
    if top_k || draw.top_p < 1.0 {
        let hist = Histogram::of(&chunks);
        if top_k {
            bound = kth_smallest_key(&chunks, &hist, draw.top_k as usize);
        }
        if draw.top_p < 1.0 {
            bound = nucleus_bound(&chunks, &hist, bound, draw.top_p);
        }
    }
    // 4. min-p: t ≤ −ln(min_p).
    if draw.min_p > 0.0 {
        let t_max = min_p_cut(draw.min_p);
        if t_max < T_CUT {
            bound = bound.min((t_max * KEY_SCALE) as u32);
        }
    }
    // 5. Draw: the kept mass chunk by chunk, then the first id in the chunk where the prefix passes r. A dropped id
    // weighs 0, so `q <= bound` needs no other test.
    let masses = each_chunk(&chunks, |c| kept_mass_wide(&c.keys, &c.weights, bound));
    let total: u64 = masses.iter().sum();
    let mut r = ((draw.hash() as u128 * total as u128) >> 64) as u64;
    for (c, mass) in chunks.iter().zip(masses) {
        if r >= mass {
            r -= mass;
            continue;
        }
        let mut acc = 0;
        for (i, (&q, &w)) in c.keys.iter().zip(&c.weights).enumerate() {
            acc += if q <= bound { w } else { 0 };
            if r < acc {
                return (c.start + i) as u32;
            }
        }
    }
    unreachable!("r < the kept mass, which always holds the max token")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::probs;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::greedy() }
    }

    /// χ² of `counts` (n draws) against `p`, over the cells with expected count ≥ 5 (the rest pooled).
    fn chi2(counts: &[usize], p: &[f64], n: usize) -> (f64, usize) {
        let (mut x, mut cells, mut pooled_o, mut pooled_e) = (0.0, 0usize, 0.0, 0.0);
        for (&o, &pi) in counts.iter().zip(p) {
            let e = pi * n as f64;
            if e >= 5.0 {
                x += (o as f64 - e).powi(2) / e;
                cells += 1;
            } else {
                pooled_o += o as f64;
                pooled_e += e;
            }
        }
        if pooled_e > 0.0 {
            x += (pooled_o - pooled_e).powi(2) / pooled_e.max(1e-9);
            cells += 1;
        }
        (x, cells.saturating_sub(1))
    }

    fn logits(v: usize, salt: u32) -> Vec<f32> {
        (0..v).map(|i| (((i as u32).wrapping_mul(2654435761) ^ salt) % 1000) as f32 / 180.0).collect()
    }

    /// The definition, written plainly (every kept key sorted): what [`sample`] computes with its histogram.
    fn sample_by_sorting(logits: &[f32], draw: &KeyedDraw) -> u32 {
        let (mut m, mut arg) = (f32::NEG_INFINITY, 0usize);
        for (i, &z) in logits.iter().enumerate() {
            if sanitize(z) > m {
                (m, arg) = (sanitize(z), i);
            }
        }
        if draw.is_greedy() || draw.top_k == 1 || !m.is_finite() {
            return arg as u32;
        }
        let keys: Vec<Option<u32>> = logits
            .iter()
            .map(|&z| {
                let t = (m - sanitize(z)) / draw.temperature;
                (t < T_CUT).then(|| (t * KEY_SCALE) as u32)
            })
            .collect();
        let mut kept: Vec<u32> = keys.iter().flatten().copied().collect();
        kept.sort_unstable();
        let mut bound = u32::MAX;
        if draw.top_k > 0 && (draw.top_k as usize) < logits.len() {
            bound = kept[(draw.top_k as usize).clamp(1, kept.len()) - 1];
            kept.retain(|&q| q <= bound);
        }
        if draw.top_p < 1.0 {
            let total: u64 = kept.iter().map(|&q| weight(q)).sum();
            let want = (draw.top_p as f64 * total as f64).ceil();
            let target = if want >= total as f64 { total } else { want.max(0.0) as u64 }.clamp(1, total);
            let mut c = 0;
            bound = *kept.iter().find(|&&q| {
                c += weight(q);
                c >= target
            }).unwrap();
        }
        if draw.min_p > 0.0 && min_p_cut(draw.min_p) < T_CUT {
            bound = bound.min((min_p_cut(draw.min_p) * KEY_SCALE) as u32);
        }
        let w = |i: usize| keys[i].filter(|&q| q <= bound).map_or(0, weight);
        let total: u64 = (0..logits.len()).map(w).sum();
        let r = ((draw.hash() as u128 * total as u128) >> 64) as u64;
        let mut c = 0;
        (0..logits.len()).find(|&i| {
            c += w(i);
            r < c
        }).unwrap() as u32
    }

    #[test]
    fn the_histogram_draw_equals_the_sorted_definition() {
        // Rows of one chunk and of several (the chunked passes), with ties, a flat run of equal logits (one bucket
        // holds most keys), NaN and -inf, under every filter and their combinations.
        let mut rows = vec![logits(300, 7), logits(5000, 2)];
        let mut big = logits(3 * crate::sample::PAR_CHUNK + 123, 9);
        big[70_000] = 9.0;
        big[1] = f32::NAN;
        big[2] = f32::NEG_INFINITY;
        rows.push(big);
        let mut flat = vec![1.0f32; 2 * crate::sample::PAR_CHUNK + 5];
        flat[40_000] = 1.5;
        flat[7] = 1.25;
        rows.push(flat);
        let filters = [
            params(1.0, 0, 1.0, 0.0),
            params(1.0, 0, 0.95, 0.0),
            params(0.7, 20, 0.95, 0.0),
            params(0.6, 300, 1.0, 0.0),
            params(1.3, 0, 0.5, 0.1),
            params(1.0, 3, 1.0, 0.05),
            params(0.01, 0, 0.9, 0.0),
            params(4.0, 1000, 0.99, 0.0),
        ];
        for (n, z) in rows.iter().enumerate() {
            for p in &filters {
                for c in 0..40 {
                    let d = KeyedDraw::new(p, 3, c);
                    assert_eq!(sample(z, &d), sample_by_sorting(z, &d), "row {n} (len {}), {p:?}, counter {c}", z.len());
                }
            }
        }
    }

    #[test]
    fn exp2_is_the_correctly_rounded_power_of_two_and_weights_round_to_nearest() {
        // Every key's exponent from 0 to T_CUT · log2 e, in steps that cover each binade densely.
        let (mut off, mut n) = (0, 0);
        let mut q = 0u32;
        while q < (T_CUT * KEY_SCALE) as u32 {
            let x = q as f32 * (1.0 / KEY_SCALE) * -std::f32::consts::LOG2_E;
            let want = (x as f64).exp2() as f32;
            let got = exp2(x);
            assert!((got.to_bits() as i64 - want.to_bits() as i64).abs() <= 1, "2^{x}: {got:e} vs {want:e}");
            off += (got != want) as usize;
            n += 1;
            let w = weight(q);
            let exact = (got as f64 * 1_099_511_627_776.0).round_ties_even() as u64;
            assert_eq!(w, exact, "weight of key {q}");
            q += 1 + q / 65_536;
        }
        assert!(off * 100_000 <= n, "{off} of {n} powers off by an ulp");
        assert_eq!((exp2(0.0), exp2(-1.0), exp2(-39.0)), (1.0, 0.5, 2f32.powi(-39)));
        assert_eq!(weight(0), 1 << 40);
    }

    #[test]
    fn the_wide_passes_give_the_portable_bits() {
        // This CPU's widest path (AVX-512 or AVX2 where it has them) against the same loops compiled for the baseline.
        let mut z = logits(10_000, 5);
        z[17] = f32::NAN;
        z[18] = f32::NEG_INFINITY;
        let m = max_of(&z);
        assert_eq!(max_of_wide(&z).to_bits(), m.to_bits());
        for inv_t in [1.0, 1.0 / 0.7, 1.0 / 0.05] {
            let (mut k1, mut w1, mut k2, mut w2) = (vec![0; z.len()], vec![0; z.len()], vec![0; z.len()], vec![0; z.len()]);
            keys_and_weights(&z, m, inv_t, &mut k1, &mut w1);
            keys_and_weights_wide(&z, m, inv_t, &mut k2, &mut w2);
            assert_eq!((&k1, &w1), (&k2, &w2), "1/T = {inv_t}");
            for bound in [0, 1 << 27, 3 << 27, DROPPED] {
                assert_eq!(kept_mass(&k1, &w1, bound), kept_mass_wide(&k1, &w1, bound));
            }
        }
    }

    #[test]
    fn keys_are_the_truncated_scaled_exponent() {
        let mut t = 0.0f32;
        while t < T_CUT {
            assert_eq!(key_of(t), (t * KEY_SCALE) as u32, "t = {t:e}");
            t = if t == 0.0 { 1e-12 } else { f32::from_bits(t.to_bits() + 997) };
        }
        assert_eq!((key_of(0.0), key_of(1.0), key_of(27.49)), (0, 1 << 27, (27.49f32 * KEY_SCALE) as u32));
        assert_eq!(key_of(-0.0), 0, "−0.0 (a +0.0 logit under a −0.0 max) is the max's key");
    }

    #[test]
    fn signed_zeros_are_the_same_logit() {
        // A −0.0 max makes t = −0.0 for +0.0 logits: they must weigh as the max (p = 1 / (2 + e^-1) each).
        let z = [-0.0, 0.0, -1.0];
        let p = params(1.0, 0, 1.0, 0.0);
        let mut counts = [0; 3];
        for c in 0..3000 {
            let d = KeyedDraw::new(&p, 3, c);
            let t = sample(&z, &d);
            assert_eq!(t, sample_by_sorting(&z, &d), "counter {c}");
            counts[t as usize] += 1;
        }
        assert!(counts[0] > 1100 && counts[1] > 1100, "draws of [−0, +0, −1]: {counts:?}");
    }

    #[test]
    fn subnormal_temperatures_are_the_argmax() {
        // 1 / T overflows below f32::MIN_POSITIVE: such a temperature is greedy, as on the device.
        let z = [0.5, 3.0, 1.0];
        for t in [1e-40f32, f32::MIN_POSITIVE / 2.0, 0.0] {
            for (top_k, top_p, min_p) in [(0, 1.0, 0.0), (2, 0.9, 0.1)] {
                let p = params(t, top_k, top_p, min_p);
                assert!(p.is_greedy(), "{p:?}");
                assert_eq!(sample(&z, &KeyedDraw::new(&p, 1, 2)), 1, "{p:?}");
            }
        }
        assert!(!params(f32::MIN_POSITIVE, 0, 1.0, 0.0).is_greedy());
    }

    #[test]
    fn greedy_rows_are_the_argmax() {
        let z = vec![0.5, 3.0, f32::NAN, 3.0, -1.0];
        for p in [params(0.0, 0, 1.0, 0.0), params(0.7, 1, 1.0, 0.0)] {
            for counter in [0, 4, 9] {
                assert_eq!(sample(&z, &KeyedDraw::new(&p, 9, counter)), 1);
            }
        }
        assert_eq!(sample(&[f32::NAN, f32::NEG_INFINITY], &KeyedDraw::new(&params(1.0, 0, 1.0, 0.0), 1, 1)), 0);
    }

    #[test]
    fn kept_sets_are_the_host_filters() {
        // Away from ties and boundaries, every draw lands in the support of probs() and covers it.
        let z = logits(300, 7);
        for p in [params(1.0, 0, 0.9, 0.0), params(0.6, 20, 1.0, 0.0), params(1.3, 50, 0.8, 0.0), params(1.0, 0, 1.0, 0.2)] {
            let support: Vec<bool> = probs(&z, &p).iter().map(|&x| x > 0.0).collect();
            let mut seen = vec![false; z.len()];
            for c in 0..20_000 {
                let t = sample(&z, &KeyedDraw::new(&p, 5, c)) as usize;
                assert!(support[t], "{p:?}: drew {t} outside the host's support");
                seen[t] = true;
            }
            let n_support = support.iter().filter(|&&s| s).count();
            let n_seen = seen.iter().filter(|&&s| s).count();
            assert!(n_seen * 10 >= n_support * 9, "{p:?}: {n_seen} of {n_support} supported tokens drawn");
        }
    }

    #[test]
    fn draws_follow_the_target_distribution() {
        let z = logits(64, 3);
        for p in [params(1.0, 0, 1.0, 0.0), params(0.8, 10, 0.95, 0.0), params(1.0, 0, 0.9, 0.05)] {
            let want: Vec<f64> = probs(&z, &p).iter().map(|&x| x as f64).collect();
            let n = 40_000;
            let mut counts = vec![0; z.len()];
            for c in 0..n {
                counts[sample(&z, &KeyedDraw::new(&p, 11, c as u64)) as usize] += 1;
            }
            let (x, df) = chi2(&counts, &want, n);
            // 99.9 % quantile of χ²(df) ≈ df + 3.1·√(2·df) + 10 for the df here.
            assert!(x < df as f64 + 3.1 * (2.0 * df as f64).sqrt() + 10.0, "{p:?}: χ² {x:.1} over {df} df");
        }
    }

    #[test]
    fn the_draw_is_keyed_by_seed_and_counter_only() {
        let z = logits(500, 1);
        let p = params(1.0, 0, 1.0, 0.0);
        let a: Vec<u32> = (0..200).map(|c| sample(&z, &KeyedDraw::new(&p, 42, c))).collect();
        let b: Vec<u32> = (0..200).map(|c| sample(&z, &KeyedDraw::new(&p, 42, c))).collect();
        let other: Vec<u32> = (0..200).map(|c| sample(&z, &KeyedDraw::new(&p, 43, c))).collect();
        assert_eq!(a, b);
        assert!(a.iter().zip(&other).filter(|(x, y)| x != y).count() > 100, "another seed draws other tokens");
        assert_eq!(KeyedDraw::new(&p, 0, 0).hash(), splitmix64(splitmix64(0)));
    }
}
