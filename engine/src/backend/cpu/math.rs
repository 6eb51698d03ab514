//! CPU compute primitives in f32: the oracle every faster path (SIMD, CUDA) is checked against. The one home
//! of the reference math: [`crate::backend::cpu::CpuOps`] composes these functions, the transformers parity
//! tests (`tests/`) check them on real checkpoints, and the CUDA kernel tests (`kernels/tests`) compare each
//! kernel with them (adapting only layouts and bf16 rounding).
//!
//! Activations are row-major `[rows, cols]` `Vec<f32>`; weights are [`Tensor`]s in their stored dtype,
//! widened to f32 one row at a time (a weight row is read once per call, whatever the number of input rows).

use rayon::prelude::*;

use crate::backend::cpu::amx::SplitRows;
use crate::backend::cpu::vmath::{gate, Gate};

pub mod gdn;

use crate::sched::step::StepCtx;
use crate::weights::Tensor;

/// Whether a kernel may depend on how many rows a call carries (see `EngineConfig::batch_invariant`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Numerics {
    /// The fastest kernel for the row count (GEMM or a GEMV plan by `t`, tiled attention, chunked GDN): a
    /// row's result depends on its batch mates to f32 rounding.
    #[default]
    Fast,
    /// Every row computed as if it were alone (one-row GEMV, row-by-row attention, recurrent GDN): bit for
    /// bit the same whatever the batch, chunking or prefix-cache hit.
    BatchInvariant,
}

/// `y[t, o] = Σ_i x[t, i] · w[o, i]` — an `nn.Linear` without bias. `x` is `[t, in]`, `w` is `[out, in]`.
/// Few rows (decode, verify): the weight stays in its stored dtype and is streamed once for all `t` rows (SIMD,
/// see [`crate::backend::cpu::gemv`]); many rows (prefill): blocked GEMM ([`crate::backend::cpu::gemm`]).
pub fn linear(x: &[f32], w: &Tensor) -> Vec<f32> {
    let mut y = Vec::new();
    linear_into(x, w, &mut y);
    y
}

/// [`linear`] into `y` (resized to `[t, out]`), reusing its allocation: the per-step ops write into
/// workspace buffers that keep their capacity from layer to layer.
pub fn linear_into(x: &[f32], w: &Tensor, y: &mut Vec<f32>) {
    linear_into_as(x, w, y, Numerics::Fast)
}

/// [`linear`] with the given [`Numerics`].
pub fn linear_as(x: &[f32], w: &Tensor, numerics: Numerics) -> Vec<f32> {
    let mut y = Vec::new();
    linear_into_as(x, w, &mut y, numerics);
    y
}

/// [`linear_into`] with the given [`Numerics`]: batch-invariant calls run one GEMV per row (each row's sum in
/// the one-row plan's order, whatever `t`).
pub fn linear_into_as(x: &[f32], w: &Tensor, y: &mut Vec<f32>, numerics: Numerics) {
    let (out_dim, in_dim) = (w.rows(), w.row_len());
    assert!(in_dim > 0 && x.len().is_multiple_of(in_dim), "linear: input len {} vs in_dim {in_dim}", x.len());
    let t = x.len() / in_dim;
    y.resize(t * out_dim, 0.0);
    if t == 0 {
        return;
    }
    if numerics == Numerics::BatchInvariant {
        for (x, y) in x.chunks(in_dim).zip(y.chunks_mut(out_dim)) {
            crate::backend::cpu::gemv::gemv_rows_major(w.dtype(), w.bytes(), out_dim, in_dim, x, 1, y);
        }
    } else if t >= crate::backend::cpu::gemm::GEMM_MIN_T && crate::backend::cpu::gemm::enabled() {
        crate::backend::cpu::gemm::gemm(w.dtype(), w.bytes(), out_dim, in_dim, x, t, y);
    } else {
        crate::backend::cpu::gemv::gemv_rows_major(w.dtype(), w.bytes(), out_dim, in_dim, x, t, y);
    }
}

/// `linear_as(x, w, numerics)` for every `(w, x)` item, bit for bit, with the GEMVs of all items in one
/// parallel loop (one fork/join: the projections of a decode row, the experts of a step). Items with a
/// prefill's row count take their own GEMM, as `linear_as` does.
pub fn linear_many(items: &[(&Tensor, &[f32])], numerics: Numerics) -> Vec<Vec<f32>> {
    let mut outs = vec![Vec::new(); items.len()];
    linear_many_into(items, numerics, &mut outs);
    outs
}

/// [`linear_many`] into `outs` (one per item), each resized to its item's output and overwritten: a buffer
/// of the same length is reused as it is (no zero fill: a prefill's projections refill the same buffers
/// layer after layer).
pub fn linear_many_into(items: &[(&Tensor, &[f32])], numerics: Numerics, outs: &mut [Vec<f32>]) {
    use crate::backend::cpu::gemv::{GemvJob, gemv_many};
    assert_eq!(items.len(), outs.len(), "linear: {} items, {} outputs", items.len(), outs.len());
    let rows_of = |w: &Tensor, x: &[f32]| {
        assert!(w.row_len() > 0 && x.len().is_multiple_of(w.row_len()), "linear: input len {} vs in_dim {}", x.len(), w.row_len());
        x.len() / w.row_len()
    };
    let gemm = |t: usize| {
        numerics == Numerics::Fast && t >= crate::backend::cpu::gemm::GEMM_MIN_T && crate::backend::cpu::gemm::enabled()
    };
    // One-row jobs write straight into the row-major output; several rows share a job ([rows, t], transposed after).
    let per_row = |t: usize| numerics == Numerics::BatchInvariant || t == 1;
    for (out, &(w, x)) in outs.iter_mut().zip(items) {
        out.resize(rows_of(w, x) * w.rows(), 0.0);
    }
    let mut staged: Vec<Vec<f32>> = items.iter().map(|&(w, x)| {
        let t = rows_of(w, x);
        if per_row(t) || gemm(t) { Vec::new() } else { vec![0.0; t * w.rows()] }
    }).collect();
    // Prefill projections of one input that all run on AMX's streamed form: one pass for them all, which
    // packs the input once (the same numbers as one GEMM each).
    let mut shared = vec![false; items.len()];
    if numerics == Numerics::Fast {
        let streams = |&(w, x): &(&Tensor, &[f32])| crate::backend::cpu::gemm::amx_streams(w.dtype(), w.rows(), w.row_len(), rows_of(w, x));
        for i in 0..items.len() {
            let x = items[i].1;
            let group: Vec<usize> =
                (i..items.len()).filter(|&j| !shared[j] && std::ptr::eq(items[j].1, x) && items[j].0.row_len() == items[i].0.row_len() && streams(&items[j])).collect();
            if group.len() < 2 {
                continue;
            }
            let ws: Vec<&[u8]> = group.iter().map(|&j| items[j].0.bytes()).collect();
            let mut ys: Vec<&mut [f32]> = outs.iter_mut().enumerate().filter(|(j, _)| group.contains(j)).map(|(_, o)| o.as_mut_slice()).collect();
            crate::backend::cpu::amx::gemm_rows_many(&ws, items[i].0.row_len(), x, rows_of(items[i].0, x), &mut ys);
            group.iter().for_each(|&j| shared[j] = true);
        }
    }
    let mut jobs = Vec::new();
    for (((&(w, x), out), stage), _) in items.iter().zip(outs.iter_mut()).zip(staged.iter_mut()).zip(&shared).filter(|(_, s)| !**s) {
        let (t, n) = (rows_of(w, x), w.row_len());
        let job = |xs, t, out| GemvJob { dtype: w.dtype(), w: w.bytes(), rows: w.rows(), in_dim: n, xs, t, out };
        if gemm(t) {
            linear_into_as(x, w, out, numerics);
        } else if per_row(t) {
            jobs.extend(x.chunks(n).zip(out.chunks_mut(w.rows())).map(|(xs, y)| job(xs, 1, y)));
        } else {
            jobs.push(job(x, t, stage.as_mut_slice()));
        }
    }
    gemv_many(&mut jobs);
    drop(jobs);
    for ((&(w, _), out), yt) in items.iter().zip(outs.iter_mut()).zip(&staged).filter(|(_, yt)| !yt.is_empty()) {
        let rows = w.rows();
        for (o, col) in yt.chunks(out.len() / rows).enumerate() {
            for (ti, &v) in col.iter().enumerate() {
                out[ti * rows + o] = v;
            }
        }
    }
}

/// Dot product with 8 independent accumulators (vectorises; order differs from a serial sum by rounding only).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>();
    s += (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    s
}

/// RMSNorm over every `dim`-sized row of `x`, in place.
/// `zero_centred`: `x̂ · (1 + w)` (Qwen3.5 norms) else `x̂ · w` (Qwen3 / gated norm).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32, zero_centred: bool) {
    let dim = w.len();
    if x.len() >= PARALLEL_ELEMENTS {
        // Prefill: blocks of rows in parallel (each row computed as alone).
        return x.par_chunks_mut(dim * rows_per_task(dim)).for_each(|rows| rms_norm(rows, w, eps, zero_centred));
    }
    for row in x.chunks_mut(dim) {
        let inv = rms_inv(row, eps);
        for (v, &wi) in row.iter_mut().zip(w) {
            let scale = if zero_centred { 1.0 + wi } else { wi };
            *v = *v * inv * scale;
        }
    }
}

/// [`rms_norm`] of `x` written into `out` (same length), without copying `x` first: the same numbers.
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, zero_centred: bool, out: &mut [f32]) {
    let dim = w.len();
    assert_eq!(x.len(), out.len(), "rms_norm_into: {} values into {}", x.len(), out.len());
    if x.len() >= PARALLEL_ELEMENTS {
        let n = dim * rows_per_task(dim);
        return x.par_chunks(n).zip(out.par_chunks_mut(n)).for_each(|(x, o)| rms_norm_into(x, w, eps, zero_centred, o));
    }
    for (row, o) in x.chunks(dim).zip(out.chunks_mut(dim)) {
        let inv = rms_inv(row, eps);
        for ((o, &v), &wi) in o.iter_mut().zip(row).zip(w) {
            let scale = if zero_centred { 1.0 + wi } else { wi };
            *o = v * inv * scale;
        }
    }
}

/// `1 / sqrt(mean(row²) + eps)`, the sum of squares in eight partial sums (vectorised; a serial sum was one
/// dependent add per element).
fn rms_inv(row: &[f32], eps: f32) -> f32 {
    let ms = dot(row, row) / row.len() as f32;
    1.0 / (ms + eps).sqrt()
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// PyTorch's softplus (beta 1, threshold 20): `x` above the threshold, else `log(1 + e^x)`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Scale every `dim`-sized row to unit L2 norm: `x · rsqrt(Σx² + eps)` (FLA / HF `l2norm`).
pub fn l2_normalize(x: &mut [f32], dim: usize, eps: f32) {
    for row in x.chunks_mut(dim) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Gated RMSNorm (the GDN output norm, §2.6 step 6): the plain [`rms_norm`] `x̂ · w` of every `w.len()`-sized
/// row of `x`, times `silu(z)`, in place.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dim = w.len();
    if x.len() >= PARALLEL_ELEMENTS {
        let n = dim * rows_per_task(dim);
        return x.par_chunks_mut(n).zip(z.par_chunks(n)).for_each(|(x, z)| gated_rms_norm(x, z, w, eps));
    }
    rms_norm(x, w, eps, false);
    gate(x, z, Gate::MulSilu);
}

/// Elementwise and row-wise ops at least this big (a prefill chunk's rows) run in parallel blocks of rows;
/// every row is computed the same way whatever the blocks.
pub const PARALLEL_ELEMENTS: usize = 1 << 16;

/// Rows per parallel task of a row-wise op over `dim`-wide rows (about [`PARALLEL_ELEMENTS`] / 4 values).
pub fn rows_per_task(dim: usize) -> usize {
    (PARALLEL_ELEMENTS / 4 / dim.max(1)).max(1)
}

/// `acc += s · x`, elementwise.
#[inline]
pub fn add_scaled(acc: &mut [f32], s: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += s * v;
    }
}

/// `x *= σ(gate)`, elementwise (the output gate of gated attention).
pub fn mul_sigmoid(x: &mut [f32], gate_logits: &[f32]) {
    gate(x, gate_logits, Gate::MulSigmoid);
}

/// Every `cols`-sized row: `acc += σ(gate[row]) · x` (one gate logit per row: the shared expert's gated add).
pub fn add_sigmoid_gated(acc: &mut [f32], x: &[f32], gate: &[f32], cols: usize) {
    for ((a, xr), &g) in acc.chunks_mut(cols).zip(x.chunks(cols)).zip(gate) {
        add_scaled(a, sigmoid(g), xr);
    }
}

/// SwiGLU of separate halves, in place: `gate ← silu(gate) · up`, elementwise.
pub fn silu_mul(gate_rows: &mut [f32], up: &[f32]) {
    gate(gate_rows, up, Gate::SiluMul);
}

/// SwiGLU of fused rows: each `[gate (inter) | up (inter)]` row of `gate_up` gives one `inter`-sized row of `out`.
pub fn swiglu(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (row, gu) in out.chunks_mut(inter).zip(gate_up.chunks(2 * inter)) {
        row.copy_from_slice(&gu[..inter]);
        silu_mul(row, &gu[inter..]);
    }
}

/// Qwen3.5's `q_proj` rows hold per head `[query d | gate d]`: split them into `q` and `gate` (`[.., d]` per head).
pub fn split_gated_heads(qg: &[f32], head_dim: usize, q: &mut [f32], gate: &mut [f32]) {
    for ((head, qh), gh) in qg.chunks(2 * head_dim).zip(q.chunks_mut(head_dim)).zip(gate.chunks_mut(head_dim)) {
        qh.copy_from_slice(&head[..head_dim]);
        gh.copy_from_slice(&head[head_dim..]);
    }
}

/// The sparse-MoE router of one token (§2.7): `p = softmax(logits)` in f32, the `top_k` most probable experts
/// (a stable sort: on exact ties the lower expert id wins), renormalised to sum 1 if asked. Returns
/// `(expert, weight)`, most probable first.
pub fn moe_topk(logits: &[f32], top_k: usize, renormalise: bool) -> Vec<(usize, f32)> {
    // The probabilities and picks on the stack (a prefill routes thousands of rows: no allocation but the
    // result's, up to 512 experts).
    let n = logits.len();
    let (mut p_stack, mut taken_stack) = ([0.0f32; 512], [false; 512]);
    let (mut p_heap, mut taken_heap) = (Vec::new(), Vec::new());
    let (p, taken): (&mut [f32], &mut [bool]) = if n <= p_stack.len() {
        (&mut p_stack[..n], &mut taken_stack[..n])
    } else {
        p_heap.resize(n, 0.0);
        taken_heap.resize(n, false);
        (&mut p_heap, &mut taken_heap)
    };
    p.copy_from_slice(logits);
    softmax(p);
    // The top k by selection: each pick the largest left (`total_cmp`), the lowest id among equals, as the
    // stable sort of all ids it replaces.
    let mut top: Vec<(usize, f32)> = Vec::with_capacity(top_k);
    for _ in 0..top_k.min(n) {
        let mut best: Option<usize> = None;
        for (i, &v) in p.iter().enumerate() {
            if !taken[i] && best.is_none_or(|b| v.total_cmp(&p[b]).is_gt()) {
                best = Some(i);
            }
        }
        let b = best.expect("an id left");
        taken[b] = true;
        top.push((b, p[b]));
    }
    if renormalise {
        let s: f32 = top.iter().map(|(_, w)| w).sum();
        top.iter_mut().for_each(|(_, w)| *w /= s);
    }
    top
}

/// Rotate-half ("NeoX") RoPE on the first `rotary_dim` dims of each head; the rest pass through.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl Rope {
    pub fn new(head_dim: usize, rotary_dim: usize, theta: f64) -> Self {
        // As HF computes it, in f32: 1 / theta^(2i / rotary_dim).
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Rope { inv_freq, head_dim }
    }

    /// Rotate every head in `x` (`[heads, head_dim]`) for absolute position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        self.apply_all(&mut [x], pos);
    }

    /// [`Self::apply`] to each of `xs` (a row's queries and keys), the angles computed once.
    pub fn apply_all(&self, xs: &mut [&mut [f32]], pos: usize) {
        let half = self.inv_freq.len();
        // The angles depend on the position only: once for all heads (a sin_cos per head and frequency was
        // ~20 µs of serial work per decode layer with 20 heads of 128).
        let mut sin_cos = [(0.0f32, 0.0f32); 64];
        let sin_cos: &mut [(f32, f32)] = if half <= 64 { &mut sin_cos[..half] } else { &mut vec![(0.0, 0.0); half] };
        for (sc, &f) in sin_cos.iter_mut().zip(&self.inv_freq) {
            *sc = (pos as f32 * f).sin_cos();
        }
        for head in xs.iter_mut().flat_map(|x| x.chunks_mut(self.head_dim)) {
            for (i, &(sin, cos)) in sin_cos.iter().enumerate() {
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * cos - x2 * sin;
                head[i + half] = x2 * cos + x1 * sin;
            }
        }
    }
}

/// Rows of one sequence from which [`paged_attention`] gathers the sequence's keys and values once and
/// attends in query tiles (prefill chunks); fewer rows (decode, verify) attend row by row.
pub const ATTENTION_TILE_MIN_ROWS: usize = 8;
/// Query rows per tile: each key and value is loaded once per tile instead of once per row.
const ATTENTION_TILE_ROWS: usize = 16;

/// Causal GQA attention of every row of a step against the paged KV cache (the rows' own K/V already written).
///
/// `q`: `[rows, n_heads, head_dim]`; row r of sequence s at position p attends to positions `0..=p` of s,
/// found through s's block table. Query head `h` reads kv head `h / (n_heads / n_kv_heads)`.
/// Returns `[rows, n_heads, head_dim]`. With `NEXTN_GEMM=0` (or with neither AVX-512F nor AVX2) both paths compute each row
/// the same way (scores by [`dot`] in key order, [`softmax`], values summed in key order) and agree bit for
/// bit; otherwise prefill tiles run as GEMMs ([`attend_tiled_gemm`]) and agree up to f32 rounding.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    ctx: &StepCtx,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    numerics: Numerics,
) -> Vec<f32> {
    let kv_row = n_kv_heads * head_dim;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let may_tile = tiles_on() && numerics == Numerics::Fast;
    let tiled: Vec<bool> = ctx.seqs.iter().map(|s| may_tile && s.rows.len() >= ATTENTION_TILE_MIN_ROWS).collect();
    let mut out = vec![0.0f32; q.len()];
    // Decode / verify rows: one task per (block of a sequence's rows, kv head) attends the kv head's query
    // heads of every row in the block together, so each cached key and value row is read once for them all
    // (a verify's k + 1 rows read the context once, not k + 1 times). Per row the arithmetic is what the row
    // alone would do.
    let blocks = row_blocks(ctx, &tiled, n_kv_heads, crate::backend::cpu::team::threads());
    // Key offsets of each block's sequence up to its last row's position, computed once for its kv heads.
    let block_keys: Vec<Vec<usize>> = blocks
        .iter()
        .map(|rows| {
            let seq = ctx.row_seq[rows.start];
            (0..=ctx.positions[rows.end - 1]).map(|j| ctx.kv_slot(seq, j) * kv_row).collect()
        })
        .collect();
    let gd = group * head_dim;
    let mut slots: Vec<Option<&mut [f32]>> = out.chunks_mut(gd).map(Some).collect();
    let mut tasks: Vec<(usize, usize, Vec<&mut [f32]>)> = Vec::with_capacity(blocks.len() * n_kv_heads);
    for (b, rows) in blocks.iter().enumerate() {
        for g in 0..n_kv_heads {
            let outs = rows.clone().map(|r| slots[r * n_kv_heads + g].take().expect("each (row, kv head) in one block")).collect();
            tasks.push((b, g, outs));
        }
    }
    crate::backend::cpu::team::for_each_mut(&mut tasks, |_, (b, g, outs)| {
        let (rows, g) = (blocks[*b].clone(), *g);
        let at: Vec<usize> = block_keys[*b].iter().map(|&r| r + g * head_dim).collect();
        let lens: Vec<usize> = rows.clone().flat_map(|r| std::iter::repeat_n(ctx.positions[r] + 1, group)).collect();
        let qs: Vec<f32> = rows.clone().flat_map(|r| &q[(r * n_heads + g * group) * head_dim..][..gd]).copied().collect();
        let mut o = vec![0.0f32; qs.len()];
        if !crate::backend::cpu::vmath::attend_heads(&qs, &lens, k_cache, v_cache, &at, head_dim, scale, &mut o) {
            for (i, r) in rows.clone().enumerate() {
                let kv = GroupKv { k_cache, v_cache, head_dim, len: ctx.positions[r] + 1 };
                attend_group(&qs[i * gd..][..gd], &kv, &|j| at[j], scale, &mut o[i * gd..][..gd]);
            }
        }
        for (dst, src) in outs.iter_mut().zip(o.chunks_exact(gd)) {
            dst.copy_from_slice(src);
        }
    });
    let row_width = n_heads * head_dim;
    for (seq, s) in ctx.seqs.iter().enumerate().filter(|(i, _)| tiled[*i]) {
        let rows = s.rows.clone();
        let len = ctx.positions[rows.end - 1] + 1;
        let (q_rows, out_rows) = (&q[rows.start * row_width..rows.end * row_width], &mut out[rows.start * row_width..rows.end * row_width]);
        if amx_attention(head_dim) {
            let kv = split_kv(k_cache, v_cache, ctx, seq, len, n_kv_heads, head_dim);
            attend_tiled_amx(q_rows, &ctx.positions[rows], &kv, out_rows, n_heads, group, head_dim, scale);
        } else {
            let kv = gather_kv(k_cache, v_cache, ctx, seq, len, n_kv_heads, head_dim);
            attend_tiled(q_rows, &ctx.positions[rows], &kv, out_rows, n_heads, group, head_dim, scale);
        }
    }
    out
}

/// The rows [`paged_attention`] attends row-wise (sequences not tiled), cut into blocks of one sequence's
/// consecutive rows at nondecreasing positions: as few blocks as keep `threads` busy with `n_kv_heads` tasks
/// each (on 2 threads a verify's rows are one block), single rows where positions go back.
fn row_blocks(ctx: &StepCtx, tiled: &[bool], n_kv_heads: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    let seqs: Vec<&std::ops::Range<usize>> =
        ctx.seqs.iter().enumerate().filter(|(i, s)| !tiled[*i] && !s.rows.is_empty()).map(|(_, s)| &s.rows).collect();
    let per_seq = threads.div_ceil(n_kv_heads.max(1) * seqs.len().max(1)).max(1);
    let mut blocks = Vec::new();
    for rows in seqs {
        let ordered = ctx.positions[rows.clone()].windows(2).all(|w| w[0] <= w[1]);
        let size = if ordered { rows.len().div_ceil(per_seq.min(rows.len())) } else { 1 };
        let mut r = rows.start;
        while r < rows.end {
            let end = (r + size).min(rows.end);
            blocks.push(r..end);
            r = end;
        }
    }
    blocks
}

/// One sequence's cached keys and values as one kv head sees them: rows `0..len`.
struct GroupKv<'a> {
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    head_dim: usize,
    len: usize,
}

/// Attention of one row's query heads that share a kv head (`q`, `out`: `[group, d]`) over keys `0..len`
/// (`at(j)`: offset of key/value j in the caches): per head, scores by [`dot`] in key order, [`softmax`],
/// values summed in key order. The portable form ([`crate::backend::cpu::vmath::attend_heads`] where the
/// CPU has AVX-512F or AVX2 and `d % 16 == 0`; the two agree to f32 rounding, and the tiled prefill path uses the
/// same switch, so a process never mixes a portable row with a vector one).
fn attend_group(q: &[f32], kv: &GroupKv<'_>, at: &impl Fn(usize) -> usize, scale: f32, out: &mut [f32]) {
    let (d, n) = (kv.head_dim, kv.len);
    let group = q.len() / d;
    let mut scores = vec![0.0f32; group * n];
    for j in 0..n {
        let k = &kv.k_cache[at(j)..][..d];
        for (i, qh) in q.chunks_exact(d).enumerate() {
            scores[i * n + j] = dot(qh, k) * scale;
        }
    }
    scores.chunks_exact_mut(n).for_each(softmax);
    for j in 0..n {
        let v = &kv.v_cache[at(j)..][..d];
        for (i, oh) in out.chunks_exact_mut(d).enumerate() {
            add_scaled(oh, scores[i * n + j], v);
        }
    }
}

/// `NEXTN_ATTENTION_TILES=0` turns the tiled path off (side-by-side benchmarks; same numbers either way).
fn tiles_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NEXTN_ATTENTION_TILES").map_or(true, |v| v != "0"))
}

/// Keys and values of positions `0..len` of sequence `seq`, contiguous per kv head: `[kv head][pos][d]`.
struct SeqKv {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

fn gather_kv(k_cache: &[f32], v_cache: &[f32], ctx: &StepCtx, seq: usize, len: usize, n_kv_heads: usize, d: usize) -> SeqKv {
    let kv_row = n_kv_heads * d;
    let slots: Vec<usize> = (0..len).map(|j| ctx.kv_slot(seq, j) * kv_row).collect();
    // Filled in order by extending (every value is written once; no zero fill first: prefill gathers the whole
    // context each chunk).
    let (mut k, mut v) = (Vec::with_capacity(n_kv_heads * len * d), Vec::with_capacity(n_kv_heads * len * d));
    for g in 0..n_kv_heads {
        for &slot in &slots {
            k.extend_from_slice(&k_cache[slot + g * d..][..d]);
            v.extend_from_slice(&v_cache[slot + g * d..][..d]);
        }
    }
    SeqKv { k, v, len }
}

/// Causal attention of one sequence's rows (`positions`, `q`/`out`: `[rows, n_heads, d]`) over its gathered
/// keys and values, one task per (query head, tile of rows).
#[allow(clippy::too_many_arguments)] // one call site; the shapes read better spelled out
fn attend_tiled(q: &[f32], positions: &[usize], kv: &SeqKv, out: &mut [f32], n_heads: usize, group: usize, d: usize, scale: f32) {
    let rows = positions.len();
    if crate::backend::cpu::gemm::enabled() {
        return attend_tiled_gemm(q, positions, kv, out, n_heads, group, d, scale);
    }
    let tiles: Vec<(usize, usize)> =
        (0..n_heads).flat_map(|h| (0..rows).step_by(ATTENTION_TILE_ROWS).map(move |r0| (h, r0))).collect();
    let results: Vec<(usize, usize, Vec<f32>)> = tiles
        .par_iter()
        .map(|&(h, r0)| {
            let r1 = (r0 + ATTENTION_TILE_ROWS).min(rows);
            let g = h / group;
            let (keys, vals) = (&kv.k[g * kv.len * d..][..kv.len * d], &kv.v[g * kv.len * d..][..kv.len * d]);
            let last = positions[r0..r1].iter().copied().max().unwrap_or(0);
            // Scores of the tile's rows, key by key (each key read once for the whole tile).
            let mut scores: Vec<Vec<f32>> = positions[r0..r1].iter().map(|&p| Vec::with_capacity(p + 1)).collect();
            for (j, kj) in keys.chunks_exact(d).take(last + 1).enumerate() {
                for (i, s) in scores.iter_mut().enumerate() {
                    if j <= positions[r0 + i] {
                        let qi = &q[((r0 + i) * n_heads + h) * d..][..d];
                        s.push(dot(qi, kj) * scale);
                    }
                }
            }
            scores.iter_mut().for_each(|s| softmax(s));
            let mut o = vec![0.0f32; (r1 - r0) * d];
            for (j, vj) in vals.chunks_exact(d).take(last + 1).enumerate() {
                for (i, s) in scores.iter().enumerate() {
                    if let Some(&p) = s.get(j) {
                        add_scaled(&mut o[i * d..(i + 1) * d], p, vj);
                    }
                }
            }
            (h, r0, o)
        })
        .collect();
    for (h, r0, o) in results {
        for (i, oi) in o.chunks_exact(d).enumerate() {
            out[((r0 + i) * n_heads + h) * d..][..d].copy_from_slice(oi);
        }
    }
}

/// Query rows per task of [`attend_tiled_gemm`]: one 32-wide GEMM strip of scores per key.
const ATTENTION_GEMM_ROWS: usize = crate::backend::cpu::gemm::PANEL_COLS;

/// [`attend_tiled`] as two GEMMs per (query head, tile of 32 rows), for CPUs where
/// [`crate::backend::cpu::gemm`] runs its kernel: scoresᵀ `[keys][32]` = K · Q_tileᵀ (the keys stream
/// through the micro-kernel, the 32 query rows are its panel), a causal softmax down each column (16
/// lanes), then outᵀ `[d][32]` = Vᵀ · Pᵀ with the probabilities, already in panel layout, as the panel.
/// Keys past the tile's last position are never read; keys past a row's own position get probability 0.
/// Same math as the row-by-row path; sums in another order (f32 rounding).
#[allow(clippy::too_many_arguments)] // as attend_tiled
fn attend_tiled_gemm(q: &[f32], positions: &[usize], kv: &SeqKv, out: &mut [f32], n_heads: usize, group: usize, d: usize, scale: f32) {
    use crate::backend::cpu::gemm::{PANEL_COLS as W, gemm_panel_f32};
    use crate::backend::cpu::vmath::causal_softmax_columns;
    let (rows, len) = (positions.len(), kv.len);
    // Vᵀ per kv head, `[g][d][len]`: the second GEMM's streamed operand.
    let n_kv = kv.v.len() / (len * d).max(1);
    // Written in order (no zero fill first), reading each head's values down a column.
    let mut vt = Vec::with_capacity(kv.v.len());
    for g in 0..n_kv {
        let src = &kv.v[g * len * d..][..len * d];
        for c in 0..d {
            vt.extend(src.iter().skip(c).step_by(d));
        }
    }
    per_query_tile(rows, n_heads, d, ATTENTION_GEMM_ROWS, 1, out, |h, r0, tr, ot| {
        let r1 = r0 + tr;
        let g = h / group;
        let keys = positions[r0..r1].iter().copied().max().unwrap_or(0) + 1;
        // Q tile as the first GEMM's panel, `[d][32]` (columns past the tile stay 0).
        let mut qp = vec![0.0f32; d * W];
        for i in 0..tr {
            let qi = &q[((r0 + i) * n_heads + h) * d..][..d];
            for (c, &x) in qi.iter().enumerate() {
                qp[c * W + i] = x;
            }
        }
        // scoresᵀ `[keys][32]` = K · Q_tileᵀ, softmax down each column, then it is the second panel.
        let mut st = vec![0.0f32; keys * W];
        gemm_panel_f32(&qp, d, &kv.k[g * len * d..][..keys * d], d, keys, &mut st, W);
        causal_softmax_columns(&mut st, keys, &positions[r0..r1], scale);
        // outᵀ `[d][32]` = Vᵀ · Pᵀ.
        gemm_panel_f32(&st, keys, &vt[g * len * d..][..len * d], len, d, ot, W);
    });
}

/// Whether tiled attention runs on AMX tiles ([`attend_tiled_amx`]): the GEMM path is on, the CPU has
/// AMX-BF16 (and `NEXTN_AMX` is not 0), and the head dimension is whole 32-deep tile steps.
fn amx_attention(d: usize) -> bool {
    use crate::backend::cpu::{amx, gemm};
    gemm::enabled() && amx::enabled() && d.is_multiple_of(amx::DEPTH_STEP)
}

/// Per kv head of sequence `seq`'s positions `0..len`: its keys `[len][d]` and its values transposed
/// (`[d][len]`), split for AMX tiles, read straight from the paged cache (one task per kv head and operand).
fn split_kv(k_cache: &[f32], v_cache: &[f32], ctx: &StepCtx, seq: usize, len: usize, n_kv_heads: usize, d: usize) -> Vec<(SplitRows, SplitRows)> {
    let kv_row = n_kv_heads * d;
    let slots: Vec<usize> = (0..len).map(|j| ctx.kv_slot(seq, j) * kv_row).collect();
    let mut parts: Vec<SplitRows> = (0..2 * n_kv_heads)
        .into_par_iter()
        .map(|task| {
            let g = task / 2;
            if task % 2 == 0 {
                SplitRows::from_rows(len, d, d, |j| &k_cache[slots[j] + g * d..][..d])
            } else {
                let offsets: Vec<usize> = slots.iter().map(|&s| s + g * d).collect();
                SplitRows::from_columns(v_cache, &offsets, d)
            }
        })
        .collect();
    let mut heads = Vec::with_capacity(n_kv_heads);
    while !parts.is_empty() {
        let mut pair = parts.drain(..2);
        heads.push((pair.next().expect("keys"), pair.next().expect("values")));
    }
    heads
}

/// [`attend_tiled_gemm`] on AMX tiles ([`crate::backend::cpu::amx::attend_tiles`]), over each kv head's keys
/// and transposed values split into bf16 `hi + lo` ([`split_kv`]): one task per (query head, group of
/// `ATTENTION_GROUP_TILES` tiles of 32 rows). Agrees with the f32 path to about 2⁻¹⁶ relative (the split's error), as the AMX linear layers do.
#[allow(clippy::too_many_arguments)] // as attend_tiled
fn attend_tiled_amx(q: &[f32], positions: &[usize], kv: &[(SplitRows, SplitRows)], out: &mut [f32], n_heads: usize, group: usize, d: usize, scale: f32) {
    use crate::backend::cpu::amx::{attend_tiles, ATTENTION_GROUP_TILES, ATTENTION_ROWS as W};
    per_query_tile(positions.len(), n_heads, d, W, ATTENTION_GROUP_TILES, out, |h, r0, tr, ot| {
        let qt: Vec<f32> = (r0..r0 + tr).flat_map(|r| q[(r * n_heads + h) * d..][..d].iter().copied()).collect();
        let (k, vt) = &kv[h / group];
        attend_tiles(&qt, tr, d, k, vt, &positions[r0..r0 + tr], scale, ot);
    });
}

/// The tiled attention paths' shared frame: one parallel task per (query head `h`, `per_task` tiles of `w` rows
/// from `r0`, `tr` rows in all), which writes each tile's outᵀ (`[d][w]`, column `i` = row `r0 + i` of the
/// tile) one after the other into `ot`; the rows are then transposed into `out` (`[rows, n_heads, d]`).
fn per_query_tile(
    rows: usize,
    n_heads: usize,
    d: usize,
    w: usize,
    per_task: usize,
    out: &mut [f32],
    tile: impl Fn(usize, usize, usize, &mut [f32]) + Sync,
) {
    let span = w * per_task;
    assert_eq!(out.len(), rows * n_heads * d, "attention: output of {} values for {rows} rows of {n_heads} × {d}", out.len());
    let tiles: Vec<(usize, usize)> = (0..n_heads).flat_map(|h| (0..rows).step_by(span).map(move |r0| (h, r0))).collect();
    let dst = crate::backend::cpu::gemm::SendPtr(out.as_mut_ptr());
    tiles.par_iter().for_each(|&(h, r0)| {
        let tr = (rows - r0).min(span);
        let mut ot = vec![0.0f32; tr.div_ceil(w) * d * w];
        tile(h, r0, tr, &mut ot);
        // Each row's head straight into out (its transpose in ot is L1-sized).
        for (g, og) in ot.chunks_exact(d * w).enumerate() {
            for i in 0..(tr - g * w).min(w) {
                let r = r0 + g * w + i;
                // SAFETY: r < rows, so (r · n_heads + h) · d + d ≤ out.len() (asserted above); this task alone
                // writes head h of its rows r0..r0 + tr, and out outlives the tasks.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add((r * n_heads + h) * d), d) };
                o.iter_mut().zip(og.chunks_exact(w)).for_each(|(x, oc)| *x = oc[i]);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_matches_naive_for_awkward_sizes() {
        for &(t, out_dim, in_dim) in &[(1, 1, 1), (3, 17, 9), (5, 33, 70)] {
            let x: Vec<f32> = (0..t * in_dim).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
            let wv: Vec<f32> = (0..out_dim * in_dim).map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0).collect();
            let w = Tensor::from_f32(vec![out_dim, in_dim], &wv);
            let y = linear(&x, &w);
            for ti in 0..t {
                for o in 0..out_dim {
                    let naive: f64 =
                        (0..in_dim).map(|i| x[ti * in_dim + i] as f64 * wv[o * in_dim + i] as f64).sum();
                    assert!((y[ti * out_dim + o] as f64 - naive).abs() < 1e-4, "t{ti} o{o}");
                }
            }
        }
    }

    /// The router's top k by selection equals a stable sort of every id (ties: the lower id first), with the
    /// probabilities on the stack (≤ 512 experts) and past it.
    #[test]
    fn moe_topk_equals_a_stable_sort() {
        for &(n, k) in &[(8, 2), (256, 8), (600, 9)] {
            for seed in 0..20 {
                // Many ties: logits from a handful of values.
                let logits: Vec<f32> = (0..n).map(|i| ((i * 7 + seed * 13) % 5) as f32 * 0.5 - (i % 3) as f32).collect();
                for renormalise in [false, true] {
                    let mut p = logits.clone();
                    softmax(&mut p);
                    let mut idx: Vec<usize> = (0..n).collect();
                    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                    let mut want: Vec<(usize, f32)> = idx[..k].iter().map(|&i| (i, p[i])).collect();
                    if renormalise {
                        let s: f32 = want.iter().map(|(_, w)| w).sum();
                        want.iter_mut().for_each(|(_, w)| *w /= s);
                    }
                    assert_eq!(moe_topk(&logits, k, renormalise), want, "{n} experts, top {k}, seed {seed}");
                }
            }
        }
    }

    #[test]
    fn rope_is_a_rotation_and_identity_at_zero() {
        let rope = Rope::new(8, 4, 10000.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 3.5).collect();
        let mut x = orig.clone();
        rope.apply(&mut x, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 37);
        // Pass-through dims unchanged; rotated pairs keep their norm.
        for head in 0..2 {
            let (o, r) = (&orig[head * 8..][..8], &x[head * 8..][..8]);
            assert_eq!(&o[4..], &r[4..]);
            for i in 0..2 {
                let n0 = o[i].hypot(o[i + 2]);
                let n1 = r[i].hypot(r[i + 2]);
                assert!((n0 - n1).abs() < 1e-5);
            }
        }
    }

    /// The tiled path (sequences with many rows) against the row-by-row path (the same rows split into
    /// sequences of one row each, same block tables): bit-identical (up to f32 rounding on the GEMM path), with
    /// GQA, a chunk continuing a cached prefix, and a decode row in the same step.
    /// Batch-invariant `linear` gives each row exactly what a one-row call gives, at every row count (the
    /// fast one switches GEMV plans at 2 and 5 rows and takes the GEMM from `GEMM_MIN_T`).
    #[test]
    fn batch_invariant_linear_equals_one_row_calls() {
        let (out_dim, in_dim) = (70, 83);
        let val = |i: usize| (((i * 2654435761) % 1000) as f32 / 500.0) - 1.0;
        let bytes: Vec<u8> = (0..out_dim * in_dim).flat_map(|i| half::bf16::from_f32(val(i)).to_le_bytes()).collect();
        let w = Tensor::from_bytes(vec![out_dim, in_dim], crate::weights::DType::BF16, bytes);
        for t in [1, 2, 5, 8, 9, crate::backend::cpu::gemm::GEMM_MIN_T + 3] {
            let x: Vec<f32> = (0..t * in_dim).map(|i| val(i + 7)).collect();
            let alone: Vec<f32> = x.chunks(in_dim).flat_map(|row| linear(row, &w)).collect();
            assert_eq!(linear_as(&x, &w, Numerics::BatchInvariant), alone, "t = {t}");
        }
    }

    /// `linear_many` is `linear_as` of every item bit for bit, in both numerics, at decode, verify and
    /// prefill row counts, with row counts that leave partial row groups.
    #[test]
    fn linear_many_equals_one_linear_per_item() {
        let val = |i: usize| (((i * 2654435761) % 1000) as f32 / 500.0) - 1.0;
        let mat = |rows: usize, cols: usize, salt: usize| {
            let bytes: Vec<u8> = (0..rows * cols).flat_map(|i| half::bf16::from_f32(val(i + salt)).to_le_bytes()).collect();
            Tensor::from_bytes(vec![rows, cols], crate::weights::DType::BF16, bytes)
        };
        let in_dim = 96;
        let ws = [mat(70, in_dim, 1), mat(5, in_dim, 2), mat(1, in_dim, 3), mat(133, in_dim, 4)];
        for t in [1, 3, 4, crate::backend::cpu::gemm::GEMM_MIN_T + 1] {
            let xs: Vec<Vec<f32>> = (0..ws.len()).map(|k| (0..t * in_dim).map(|i| val(i * 3 + k)).collect()).collect();
            for numerics in [Numerics::Fast, Numerics::BatchInvariant] {
                let items: Vec<(&Tensor, &[f32])> = ws.iter().zip(&xs).map(|(w, x)| (w, x.as_slice())).collect();
                let many = linear_many(&items, numerics);
                for (k, ((w, x), y)) in ws.iter().zip(&xs).zip(&many).enumerate() {
                    assert_eq!(y, &linear_as(x, w, numerics), "item {k}, t = {t}, {numerics:?}");
                }
                assert_eq!(into_dirty(&items, numerics), many, "into reused buffers, t = {t}, {numerics:?}");
            }
        }
        // Prefill projections of one input (a GDN's, an attention's): on AMX hosts the streamed ones share one
        // pass (`amx::gemm_rows_many`), interleaved here with ones that do not stream (5 rows, 70 rows) and one
        // on another input; every output as its own GEMM's, bit for bit.
        let ws = [mat(64, in_dim, 5), mat(5, in_dim, 6), mat(96, in_dim, 7), mat(70, in_dim, 8), mat(32, in_dim, 9)];
        for t in [130, 300] {
            let x: Vec<f32> = (0..t * in_dim).map(|i| val(i * 7 + 1)).collect();
            let other: Vec<f32> = (0..t * in_dim).map(|i| val(i * 5 + 2)).collect();
            let inputs = [&x, &x, &x, &x, &other];
            let items: Vec<(&Tensor, &[f32])> = ws.iter().zip(inputs).map(|(w, x)| (w, x.as_slice())).collect();
            let streamed = items.iter().filter(|(w, x)| crate::backend::cpu::gemm::amx_streams(w.dtype(), w.rows(), w.row_len(), x.len() / in_dim)).count();
            let many = linear_many(&items, Numerics::Fast);
            for (k, ((w, x), y)) in items.iter().zip(&many).enumerate() {
                assert_eq!(y, &linear_as(x, w, Numerics::Fast), "item {k}, t = {t} ({streamed} streamed)");
            }
            assert_eq!(into_dirty(&items, Numerics::Fast), many, "into reused buffers, t = {t}");
        }
    }

    /// `linear_many_into` over reused buffers: NaN-filled, of the output's length (reused as they are) or
    /// shorter and longer (resized).
    fn into_dirty(items: &[(&Tensor, &[f32])], numerics: Numerics) -> Vec<Vec<f32>> {
        let mut outs: Vec<Vec<f32>> = items
            .iter()
            .enumerate()
            .map(|(k, (w, x))| vec![f32::NAN; (x.len() / w.row_len() * w.rows()).saturating_sub(3) + 6 * (k % 3) / 2])
            .collect();
        linear_many_into(items, numerics, &mut outs);
        outs
    }

    /// Verify rows (a few rows of one sequence) attend as one block per kv head, reading each key once for all
    /// of them: bit for bit what each row alone gives, on the vector kernels (d = 16, 64) and the portable form
    /// (d = 8), in both numerics, whatever blocks `row_blocks` cuts.
    #[test]
    fn verify_row_blocks_equal_row_by_row() {
        let (nh, kvh, bs) = (8, 2, 4);
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        for d in [8, 16, 64] {
            let kv_row = kvh * d;
            let k: Vec<f32> = (0..64 * bs * kv_row).map(|i| val(i, 1)).collect();
            let v: Vec<f32> = (0..64 * bs * kv_row).map(|i| val(i, 2)).collect();
            let table_a: Vec<u32> = (0..20).map(|b| (b * 3 % 61) as u32).collect();
            let table_b: Vec<u32> = (0..20).map(|b| (b * 7 % 59 + 1) as u32).collect();
            // Sequence a: 4 verify rows at 40..44; sequence b: 3 rows at 9..12; sequence c: one decode row at 0.
            let mut verify = StepCtx { block_size: bs, ..Default::default() };
            verify.push_seq(&[0; 4], 40, &table_a, 0, |_| true);
            verify.push_seq(&[0; 3], 9, &table_b, 1, |_| true);
            verify.push_seq(&[0], 0, &table_a, 2, |_| true);
            let mut rowwise = StepCtx { block_size: bs, ..Default::default() };
            for (start, table, n) in [(40, &table_a, 4), (9, &table_b, 3), (0, &table_a, 1)] {
                for i in 0..n {
                    rowwise.push_seq(&[0], start + i, table, 0, |_| true);
                }
            }
            let q: Vec<f32> = (0..8 * nh * d).map(|i| 3.0 * val(i, 3)).collect();
            for numerics in [Numerics::Fast, Numerics::BatchInvariant] {
                let a = paged_attention(&q, &k, &v, &verify, nh, kvh, d, numerics);
                let b = paged_attention(&q, &k, &v, &rowwise, nh, kvh, d, numerics);
                assert_eq!(a, b, "d {d}, {numerics:?}");
            }
        }
    }

    /// Blocks: a sequence's rows together while the threads have enough tasks, split when they would idle,
    /// single rows where positions go back; every row in exactly one block.
    #[test]
    fn row_blocks_cut_by_threads_and_order() {
        let table: Vec<u32> = (0..8).collect();
        let mut ctx = StepCtx { block_size: 4, ..Default::default() };
        ctx.push_seq(&[0; 4], 10, &table, 0, |_| true);
        ctx.push_seq(&[0], 3, &table, 1, |_| true);
        assert_eq!(row_blocks(&ctx, &[false, false], 4, 2), vec![0..4, 4..5]);
        assert_eq!(row_blocks(&ctx, &[false, false], 2, 8), vec![0..2, 2..4, 4..5]);
        assert_eq!(row_blocks(&ctx, &[false, false], 1, 64), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(row_blocks(&ctx, &[true, false], 4, 2), vec![4..5]);
        ctx.positions.swap(1, 2);
        assert_eq!(row_blocks(&ctx, &[false, false], 4, 2), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
    }

    /// d = 8 takes the f32 GEMM tiles (or the row loop); d = 64 the AMX tiles where the CPU has them.
    #[test]
    fn tiled_prefill_attention_equals_row_by_row() {
        for d in [8, 64] {
            let (nh, kvh, bs) = (4, 2, 4);
            let kv_row = kvh * d;
            let blocks = 64;
            let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
            let k: Vec<f32> = (0..blocks * bs * kv_row).map(|i| val(i, 1)).collect();
            let v: Vec<f32> = (0..blocks * bs * kv_row).map(|i| val(i, 2)).collect();
            let table_a: Vec<u32> = (0..20).map(|b| (b * 3 % 61) as u32).collect();
            let table_b: Vec<u32> = (0..20).map(|b| (b * 7 % 59 + 1) as u32).collect();
            // Sequence a: 60 rows at positions 11..71 (a cached prefix of 11; two 32-row tiles, keys across three
            // 32-key steps); sequence b: one decode row at 30.
            let n = 60;
            let mut tiled = StepCtx { block_size: bs, ..Default::default() };
            tiled.push_seq(&vec![0; n], 11, &table_a, 0, |_| false);
            tiled.push_seq(&[0], 30, &table_b, 1, |_| false);
            let mut rowwise = StepCtx { block_size: bs, ..Default::default() };
            for i in 0..n {
                rowwise.push_seq(&[0], 11 + i, &table_a, 0, |_| false);
            }
            rowwise.push_seq(&[0], 30, &table_b, 1, |_| false);
            let q: Vec<f32> = (0..(n + 1) * nh * d).map(|i| val(i, 3)).collect();
            let a = paged_attention(&q, &k, &v, &tiled, nh, kvh, d, Numerics::Fast);
            let b = paged_attention(&q, &k, &v, &rowwise, nh, kvh, d, Numerics::Fast);
            assert!(tiled.seqs[0].rows.len() >= ATTENTION_TILE_MIN_ROWS);
            // Batch-invariant: the 60-row call is the row-by-row result bit for bit.
            assert_eq!(paged_attention(&q, &k, &v, &tiled, nh, kvh, d, Numerics::BatchInvariant), b, "d {d}");
            if crate::backend::cpu::gemm::enabled() {
                // The GEMM tiles sum in another order (f32 rounding); AMX tiles multiply 16-bit splits
                // (≤ 2⁻¹⁶ relative per operand, over d-term scores).
                let amx = crate::backend::cpu::amx::enabled() && d % 32 == 0;
                let tol = if amx { 2e-4 } else { 1e-5 };
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!((x - y).abs() <= tol * (1.0 + y.abs()), "d {d} element {i}: tiled {x} vs row-by-row {y}");
                }
            } else {
                assert_eq!(a, b, "d {d}");
            }
        }
    }

    /// A context of several AMX key passes (256 keys each) whose scores grow with the position, so each pass
    /// raises every row's max and rescales what the earlier passes accumulated.
    #[test]
    fn tiled_attention_across_key_passes_equals_row_by_row() {
        let (nh, kvh, d, bs, blocks) = (2, 1, 64, 16, 48);
        let kv_row = kvh * d;
        let val = |i: usize, salt: usize| (((i * 2654435761 + salt * 97) % 1000) as f32 / 500.0) - 1.0;
        let pos_of_slot = |slot: usize| slot as f32 / 300.0;
        // Block table: block b of the sequence lives in physical block (b * 5) % 47 + 1 (all distinct).
        let table: Vec<u32> = (0..46).map(|b| ((b * 5) % 47 + 1) as u32).collect();
        let mut logical = vec![0usize; blocks * bs];
        for (b, &phys) in table.iter().enumerate() {
            for o in 0..bs {
                logical[phys as usize * bs + o] = b * bs + o;
            }
        }
        let k: Vec<f32> = (0..blocks * bs * kv_row).map(|i| 0.5 * val(i, 1) + pos_of_slot(logical[i / kv_row])).collect();
        let v: Vec<f32> = (0..blocks * bs * kv_row).map(|i| val(i, 2)).collect();
        // Two tiles of three passes each; then ten tiles (two groups) from position 0, of one or two passes.
        for (prefix, n) in [(650, 45), (0, 300)] {
            let mut tiled = StepCtx { block_size: bs, ..Default::default() };
            tiled.push_seq(&vec![0; n], prefix, &table, 0, |_| false);
            let mut rowwise = StepCtx { block_size: bs, ..Default::default() };
            for i in 0..n {
                rowwise.push_seq(&[0], prefix + i, &table, 0, |_| false);
            }
            let q: Vec<f32> = (0..n * nh * d).map(|i| 0.5 + 0.5 * val(i, 3)).collect();
            let a = paged_attention(&q, &k, &v, &tiled, nh, kvh, d, Numerics::Fast);
            let b = paged_attention(&q, &k, &v, &rowwise, nh, kvh, d, Numerics::Fast);
            let tol = if crate::backend::cpu::gemm::enabled() { 2e-4 } else { 0.0 };
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!((x - y).abs() <= tol * (1.0 + y.abs()), "prefix {prefix}, element {i}: tiled {x} vs row-by-row {y}");
            }
        }
    }

    #[test]
    fn attention_single_key_returns_its_value() {
        let (h, kvh, d) = (4, 2, 3);
        let mut ctx = StepCtx { block_size: 4, ..Default::default() };
        ctx.push_seq(&[0], 0, &[1], 0, |_| true);
        let q = vec![0.3f32; h * d];
        // Slot 4 (block 1, offset 0) holds the only key/value.
        let mut k = vec![0.0f32; 8 * kvh * d];
        let mut v = vec![0.0f32; 8 * kvh * d];
        k[4 * kvh * d..5 * kvh * d].fill(1.0);
        for i in 0..kvh * d {
            v[4 * kvh * d + i] = i as f32;
        }
        let o = paged_attention(&q, &k, &v, &ctx, h, kvh, d, Numerics::Fast);
        for head in 0..h {
            let g = head / 2;
            assert_eq!(&o[head * d..][..d], &v[4 * kvh * d + g * d..][..d]);
        }
    }
}
