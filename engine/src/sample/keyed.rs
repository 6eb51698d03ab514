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
//! Temperature 0 (or top-k 1, or no finite logit) is the argmax, lowest index on ties, as [`super::argmax`].
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
    /// ≤ 0: the argmax.
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

    /// The 64-bit uniform of this draw: `splitmix64(splitmix64(seed) ^ counter)` (sample.cu's).
    pub fn hash(&self) -> u64 {
        splitmix64(splitmix64(self.seed) ^ self.counter)
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `round(2^40 · exp(−q / 2^27))`, in f32 as the device computes it.
fn weight(q: u32) -> u64 {
    let t = q as f32 * (1.0 / KEY_SCALE);
    ((t * -std::f32::consts::LOG2_E).exp2() * 1_099_511_627_776.0).round_ties_even() as u64
}

fn sanitize(z: f32) -> f32 {
    if z.is_nan() { f32::NEG_INFINITY } else { z }
}

/// The token `draw` picks from `logits` (one row). See the module docs for the exact semantics.
pub fn sample(logits: &[f32], draw: &KeyedDraw) -> u32 {
    assert!(!logits.is_empty(), "keyed sample of an empty row");
    let (mut m, mut arg) = (f32::NEG_INFINITY, 0usize);
    let mut any = false;
    for (i, &z) in logits.iter().enumerate() {
        let z = sanitize(z);
        if !any || z > m {
            (m, arg, any) = (z, i, true);
        }
    }
    if !(draw.temperature > 0.0) || draw.top_k == 1 || !m.is_finite() {
        return arg as u32;
    }
    // 1. Keys (None = dropped).
    let inv_t = 1.0 / draw.temperature;
    let keys: Vec<Option<u32>> = logits
        .iter()
        .map(|&z| {
            let t = (m - sanitize(z)) * inv_t;
            (t < T_CUT).then(|| (t * KEY_SCALE) as u32)
        })
        .collect();
    // 2. top-k: the k-th smallest key (a selection, no sort). 3. top-p: over the keys still kept, in order, the
    // smallest whose cumulative weight reaches the target. Neither: every key stays, nothing to order.
    let v = logits.len();
    let top_k = draw.top_k > 0 && (draw.top_k as usize) < v;
    let mut bound = u32::MAX;
    if top_k || draw.top_p < 1.0 {
        let mut kept: Vec<u32> = keys.iter().flatten().copied().collect();
        if top_k {
            let k = (draw.top_k as usize).clamp(1, kept.len());
            bound = *kept.select_nth_unstable(k - 1).1;
            kept.retain(|&q| q <= bound);
        }
        if draw.top_p < 1.0 {
            kept.sort_unstable();
            let total: u64 = kept.iter().map(|&q| weight(q)).sum();
            let want = (draw.top_p as f64 * total as f64).ceil();
            let target = if want >= total as f64 { total } else { want.max(0.0) as u64 }.clamp(1, total);
            let mut c = 0;
            for &q in &kept {
                c += weight(q);
                if c >= target {
                    bound = q;
                    break;
                }
            }
        }
    }
    // 4. min-p: t ≤ −ln(min_p).
    if draw.min_p > 0.0 {
        let t_max = -draw.min_p.ln();
        if t_max < T_CUT {
            bound = bound.min((t_max * KEY_SCALE) as u32);
        }
    }
    // 5. Draw.
    let w = |i: usize| keys[i].filter(|&q| q <= bound).map_or(0, weight);
    let total: u64 = (0..v).map(w).sum();
    let r = ((draw.hash() as u128 * total as u128) >> 64) as u64;
    let mut c = 0;
    for i in 0..v {
        c += w(i);
        if r < c {
            return i as u32;
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
