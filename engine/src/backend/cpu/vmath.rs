//! Vectorised elementwise math for prefill's hot loops: the causal softmax of attention scores, where a
//! scalar `expf` per score cost as much as the two attention GEMMs together (3.5K-token prompt: 25 M
//! exponentials per attention layer).
//!
//! The exponential is Cephes' `expf` in 16 lanes (range reduction by ln 2 in two parts, a degree-6
//! polynomial, `scalef` by 2ⁿ): relative error ≈ 1e-7 against the libm value, so softmax rows agree with
//! [`super::math::softmax`] to a few f32 ulps. CPUs without AVX-512F use `super::math::softmax` itself.

use super::math::softmax;

/// Causal softmax down the columns of scoresᵀ: `st` is `[keys][32]`, column `i < positions.len()` holds the
/// raw scores of the query at `positions[i]` against keys `0..keys`. In place, column `i` becomes
/// `softmax(scale · st[0..=positions[i], i])` with 0 for keys past `positions[i]` (and for columns past
/// `positions.len()`), ready to be the panel of `gemm::gemm_panel_f32`. Every `positions[i] < keys`.
pub fn causal_softmax_columns(st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
    const W: usize = 32;
    assert!(positions.len() <= W && st.len() >= keys * W, "causal_softmax_columns: {} columns, {} values", positions.len(), st.len());
    assert!(positions.iter().all(|&p| p < keys), "causal_softmax_columns: a position past the {keys} keys");
    #[cfg(target_arch = "x86_64")]
    if super::gemm::available() {
        // SAFETY: `gemm::available` means this process runs the AVX-512F kernels, so the CPU has AVX-512F;
        // shapes checked above.
        unsafe { x86::causal_softmax_columns_avx512(st, keys, positions, scale) };
        return;
    }
    let mut col = Vec::with_capacity(keys);
    for i in 0..W {
        let own = positions.get(i).map_or(0, |&p| p + 1);
        col.clear();
        col.extend((0..own).map(|j| st[j * W + i] * scale));
        softmax(&mut col);
        for j in 0..keys {
            st[j * W + i] = if j < own { col[j] } else { 0.0 };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::incompatible_msrv)]
mod x86 {
    use std::arch::x86_64::*;

    /// `e^x` in 16 lanes; lanes below −87.3 (including −∞) give 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.7));
        // n = round(x / ln 2); r = x − n·ln 2 (ln 2 split so n·C1 is exact).
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        // e^r ≈ 1 + r + r²·p(r)
        let er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(r, r), p, r), _mm512_set1_ps(1.0));
        _mm512_maskz_mov_ps(!tiny, _mm512_scalef_ps(er, n))
    }

    /// # Safety
    /// The CPU has AVX-512F; `st` holds `keys · 32` values; `positions` (≤ 32) are each `< keys`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn causal_softmax_columns_avx512(st: &mut [f32], keys: usize, positions: &[usize], scale: f32) {
        // Per half (16 columns): the last key each column sees (−1: an absent column sees none).
        let last = |h: usize| {
            let mut l = [-1i32; 16];
            for (c, &p) in positions.iter().enumerate().skip(h * 16).take(16) {
                l[c - h * 16] = p as i32;
            }
            l
        };
        let lasts = [last(0), last(1)];
        let p = st.as_mut_ptr();
        let sc = _mm512_set1_ps(scale);
        // SAFETY: every access is a 16-lane load/store of row j < keys, half h < 2: inside `st`.
        unsafe {
            for (h, l) in lasts.iter().enumerate() {
                let lv = _mm512_loadu_si512(l.as_ptr() as *const __m512i);
                let seen = |j: usize| _mm512_cmp_epi32_mask::<_MM_CMPINT_LE>(_mm512_set1_epi32(j as i32), lv);
                let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
                for j in 0..keys {
                    let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(j * 32 + h * 16)), sc);
                    m = _mm512_mask_max_ps(m, seen(j), m, v);
                }
                // Absent columns keep −∞: make their exponent argument finite (the mask zeroes them anyway).
                let m = _mm512_max_ps(m, _mm512_set1_ps(f32::MIN));
                let mut sum = _mm512_setzero_ps();
                for j in 0..keys {
                    let at = p.add(j * 32 + h * 16);
                    let e = _mm512_maskz_mov_ps(seen(j), exp16(_mm512_fmsub_ps(_mm512_loadu_ps(at), sc, m)));
                    _mm512_storeu_ps(at, e);
                    sum = _mm512_add_ps(sum, e);
                }
                let inv = _mm512_div_ps(_mm512_set1_ps(1.0), _mm512_max_ps(sum, _mm512_set1_ps(f32::MIN_POSITIVE)));
                for j in 0..keys {
                    let at = p.add(j * 32 + h * 16);
                    _mm512_storeu_ps(at, _mm512_mul_ps(_mm512_loadu_ps(at), inv));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_scores_give_zero_not_nan() {
        // One column: a score 200 below the max underflows to 0 (not NaN), the rest sums to 1.
        let mut st = vec![0.0f32; 3 * 32];
        st[0] = 0.0;
        st[32] = -200.0;
        st[64] = 80.0;
        causal_softmax_columns(&mut st, 3, &[2], 1.0);
        assert_eq!(st[32], 0.0);
        assert!((st[0] + st[64] - 1.0).abs() < 1e-6 && st[64] > 0.999_999);
        assert!(st.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn causal_softmax_columns_matches_per_column_softmax() {
        let keys = 45;
        let positions: Vec<usize> = (20..43).collect(); // 23 columns: both halves, one partly empty
        let st0: Vec<f32> = (0..keys * 32).map(|i| ((i * 7919 % 613) as f32 - 300.0) / 37.0).collect();
        let mut st = st0.clone();
        causal_softmax_columns(&mut st, keys, &positions, 0.125);
        for c in 0..32 {
            let own = positions.get(c).map_or(0, |&p| p + 1);
            let mut want: Vec<f32> = (0..own).map(|j| st0[j * 32 + c] * 0.125).collect();
            softmax(&mut want);
            for j in 0..keys {
                let (got, w) = (st[j * 32 + c], if j < own { want[j] } else { 0.0 });
                assert!((got - w).abs() <= 1e-6 * w.abs() + 1e-30, "column {c} key {j}: {got} vs {w}");
            }
        }
    }
}
