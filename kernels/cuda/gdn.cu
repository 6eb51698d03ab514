// Gated DeltaNet (GDN) linear attention, the Qwen3.5 un-fused variant (docs/qwen3_5_moe.md §2.6, §2.10, §2.11).
//
// Shapes (production: H = 16 q/k heads, HV = 32 v-heads, d_k = d_v = 128, K = 4, conv_dim = 8192):
//   mixed / c  bf16 [T, conv_dim]              channels q (H*d_k) | k (H*d_k) | v (HV*d_v), head-major
//   conv_state bf16 [num_slots, conv_dim, K-1] the last K-1 RAW (pre-conv) inputs per channel, oldest first
//   state      f32  [num_slots, HV, d_k, d_v]  S[k][v] (HF/FLA layout), one per v-head
//   lanes      f32  [num_seqs, max_lanes, HV, d_k, d_v]  per-row snapshots of a verify pass
// A batch of T rows is grouped by sequence: rows seq_row_start[s]..seq_row_start[s+1] (in token order) use
// state slot seq_slot[s]. seq_row_start[0] = 0, seq_row_start[num_seqs] = T, non-decreasing; slots distinct.
//
// gdn_conv_bf16: out[t, ch] = silu(Σ_j w[ch, j] * x[t-K+1+j, ch]), inputs before the sequence's first row in
//   the batch taken from conv_state[slot] (zeros when the slot is out of range). Never writes the state, so a
//   verify pass can be rolled back.
//   Bytes: reads T*conv_dim*2 (x; the K-1 earlier rows come from L1/L2) + conv_dim*K*2 (w) + per first rows
//   num_seqs*conv_dim*(K-1)*2 (state); writes T*conv_dim*2. Decode: 16 + 64 + 48 + 16 KiB.
//   Launch: grid (T, ceil(conv_dim / (8*128))), block 128; 8 channels per thread with 16-byte accesses when
//   conv_dim % 8 == 0, else grid (T, ceil(conv_dim / 128)), one channel per thread.
//
// gdn_conv_commit_bf16: conv_state[slot_s] = last K-1 of (conv_state[slot_s] ++ x[rows of s][0..accepted[s]])
//   (accepted clamped to 0..=rows of s; decode passes 1, prefill all rows, verify m + 1).
//   Bytes: ≤ num_seqs*conv_dim*(K-1)*2 read + the same read from x + the same written.
//   Launch: grid (ceil(conv_dim / (8*128)), num_seqs), block 128 (scalar: ceil(conv_dim / 128)).
//
// gdn_conv_step_bf16 (decode / verify: a few rows per sequence): gdn_conv_bf16 and gdn_conv_commit_bf16 in one
//   launch. One thread owns 8 channels of one sequence: it reads the window of seq_slot[s] once, slides it over
//   the sequence's rows in order (outputs equal gdn_conv_bf16's bit for bit: same taps, same fma order) and,
//   after the first accepted[s] rows, writes that window back when commit_slot[s] == seq_slot[s] (-1: no
//   commit). A channel's window is read and written by the same thread, which is what makes one launch safe
//   (the two-kernel form exists because prefill's rows run in parallel). Rows of a sequence run one after
//   another here, so the launcher takes it only for ≤ GDN_STEP_MAX_ROWS rows per sequence.
//   With keep != nullptr, a sequence with keep_row[s] >= 0 (a verifying one) also copies its raw rows to
//   keep[keep_row[s] + r] (what the deferred commit shifts into its window once acceptance is known), which
//   saves the verify a copy per GDN layer.
//   Bytes: x once + w + 2 * num_seqs*conv_dim*(K-1)*2 (window in and out) + out (+ kept rows). Decode: 16 + 64 +
//   96 + 16 KiB.
//   Launch: grid (ceil(conv_dim / (8*64)), num_seqs), block 64; requires conv_dim % 8 == 0.
//
// gdn_recurrent_bf16: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), q and k l2-normalised per
//   head (fp32, eps 1e-6), q *= 1/sqrt(d_k); then per row, in order, for every v-head j (q/k head j / (HV/H)):
//     S = exp(g) S;  m = Sᵀk;  u = beta (v - m);  S += k uᵀ;  o = Sᵀq
//   computed as one reduction pass per row: with raw q, k and S the state before the row,
//     m = e^g rk (Sᵀk_raw),  p = e^g rq (Sᵀq_raw),  u = beta (v - m),  o = p + u (k·q),  S = e^g S + k uᵀ
//   where rk, rq are the l2 (and 1/sqrt(d_k)) scales and k·q uses the normalised vectors: the norms and both
//   dot products are reduced together, so a row costs one warp-shuffle reduction and no __syncthreads.
//   Modes: lanes == nullptr: in place, the final state is written back to state[slot] (decode, prefill);
//          lanes != nullptr: state[slot] is only read and the state after row r of sequence s is written to
//          lanes[s][r - seq_row_start[s]] (rows past max_lanes are not written) (speculative verify);
//          lanes and snap_slot != nullptr: per sequence, in place into seq_slot[s] when that is a slot, else
//          lanes from snap_slot[s] (a verify batch that also advances sequences in place, in one launch).
//   Work split: one CTA per (v-head, 32-column d_v slice, sequence), 4 warps of 8 d_v columns each; a warp's
//   lane = (k-group 0..15, column-group 0..1) holds S[k-group*KPT .. +KPT][4 columns] in registers (KPT =
//   d_k/16 rounded up to 2, 4 or 8: d_k ≤ 128), for all rows of the sequence. Warps are independent.
//   Bytes per call: reads + writes HV*d_k*d_v*4 per sequence (2 MiB each way per layer in production) plus
//   T*(conv_dim + 2*HV)*2 of inputs and T*HV*d_v*2 of output; lane mode writes rows*2 MiB instead of 2 MiB.
//   Batch-1 decode: 32 heads x 4 slices = 128 CTAs of 128 threads over the 132 SMs; each thread issues its
//   8 16-byte state loads at once, so the whole 2 MiB is in flight together.
//   Launch: grid (HV * ceil(d_v / 32), num_seqs), block 128. Vector path (16-byte state, 8-byte v/o,
//   16-byte q/k accesses) when d_k % 8 == 0 and d_v % 8 == 0, else a scalar masked path.
//   Gated-norm tail (y != nullptr; decode / verify batches): the layer's output norm, y = (w * bf16(n)) * silu(z)
//   with n = o * rsqrt(mean(o^2) + eps) per (row, v-head) as rmsnorm_gated_bf16 computes it (its f32 sum
//   runs in another order), in the same launch. A head's d_v columns are spread over its CTAs, so the last
//   one to finish normalises the head's rows: every CTA fences its o stores and counts itself in
//   arrivals[s * HV + j] (u32, zero between launches); the CTA that brings the count to the number of
//   slices resets it to zero and reads the head's o rows back (L2) to write y, one warp per row. Costs
//   rows*HV*d_v*2 read twice from L2 + z + y; saves a launch per GDN layer.
//   Prefill cost model (sequential path; estimated, not yet measured): a sequence's rows run one after
//   another in every warp, with the inputs of the next GDN_PREFETCH = 2 rows in flight while a row is
//   computed. A row costs the chain of ~8 FMAs per dot (8 columns in parallel), a 4-level shuffle
//   butterfly of 11 values and the 32-FMA rank-1 update: ~300-500 cycles ≈ 0.2-0.3 µs per token per layer,
//   independent of the head count (all 128 CTAs of a sequence run at once, 1 per SM), and ~5 % of HBM
//   bandwidth. An 8K-token prompt costs ≈ 2 ms per GDN layer, ≈ 60 ms over the 30 GDN layers; several
//   sequences in one batch run side by side at no extra latency until the SMs fill (~2 CTAs per SM at 194
//   registers). The chunked form (docs/qwen3_5_moe.md §2.6 step 7, chunk 64, tensor cores) is the next step if
//   prefill time matters; the interface (seq_row_start / seq_slot / in-place state) would not change.
//
// gdn_commit_layers: a verify's deferred commit in every GDN layer at once (a launch per cycle instead of two
//   per layer): for each entry e (a verifying sequence) and layer l, the state of slot[e] becomes
//   lanes[l][lane seq[e]][lane[e]] (as gdn_commit_lane_f32) and its conv window shifts in the first lane[e] + 1
//   of the kept raw rows keep[l][keep row[e] ..] (as gdn_conv_commit_bf16). Entries with a lane or slot out
//   of range keep their state. Bytes: as the two kernels, summed over the layers.
//   Launch: grid (copy_blocks + conv blocks, num_entries, layers), block 256; copy_blocks as gdn_commit_lane_f32's
//   grid.x, conv blocks ceil(conv_dim / (8*256)) (scalar: ceil(conv_dim / 256)).
//
// gdn_commit_lane_f32: state[seq_slot[s]] = lanes[s][lane[s]] (lane < 0 or ≥ max_lanes: keep the state).
//   Bytes: 2 * HV*d_k*d_v*4 per committed sequence (2 MiB read + 2 MiB written per layer in production).
//   Launch: grid (ceil(state_len / 4 / 1024), num_seqs), block 256, 4 16-byte copies per thread (all loads
//   issued before the stores); scalar when state_len % 4 != 0.
#include "common.cuh"

#define GDN_K 4                 // causal conv kernel width (linear_conv_kernel_dim)
#define GDN_KM1 (GDN_K - 1)     // raw inputs kept in the conv state
#define GDN_THREADS 128
#define GDN_COLS_PER_CTA 32     // 4 warps x 8 d_v columns
#define GDN_COPY_THREADS 256
#define GDN_COPY_UNROLL 4

// 8 bf16 at p (16-byte aligned) into v[0..8) of a register array (v is a constant offset into it).
__device__ __forceinline__ void gdn_load8(const bf16* p, float* v) {
    bf16x8 u = *reinterpret_cast<const bf16x8*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(u.h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void gdn_store8(bf16* p, const float* v) {
    bf16x8 u;
#pragma unroll
    for (int i = 0; i < 4; ++i) u.h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<bf16x8*>(p) = u;
}

// The sequence holding batch row `row`: the last s with seq_row_start[s] <= row (binary search).
__device__ __forceinline__ int gdn_find_seq(const int* __restrict__ starts, int num_seqs, int row) {
    int lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(starts + mid) <= row) lo = mid;
        else hi = mid;
    }
    return lo;
}

// ---------------------------------------------------------------------------------------------------------
// Causal depthwise conv + SiLU (reads the conv state, never writes it).

struct GdnConvParams {
    const bf16* x;              // [rows, conv_dim] raw projection output
    const bf16* w;              // [conv_dim, K]
    const bf16* conv_state;     // [num_slots, conv_dim, K-1]
    const int* seq_row_start;   // [num_seqs + 1]
    const int* seq_slot;        // [num_seqs]
    bf16* out;                  // [rows, conv_dim]
    int rows;
    int conv_dim;
    int num_seqs;
    int num_slots;
};

extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_conv_bf16(const GdnConvParams p) {
    PDL_ENTRY();
    const int row = blockIdx.x;
    const int s = gdn_find_seq(p.seq_row_start, p.num_seqs, row);
    const int d = row - __ldg(p.seq_row_start + s);  // earlier rows of this sequence in the batch
    const int slot = __ldg(p.seq_slot + s);
    const bool have_state = slot >= 0 && slot < p.num_slots;
    const size_t cd = (size_t)p.conv_dim;

    if ((p.conv_dim & 7) == 0) {
        const int ch = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
        if (ch >= p.conv_dim) return;
        float win[GDN_K][8];  // win[j][c]: input of tap j (j = K-1 is the current row) for channel ch + c
#pragma unroll
        for (int j = 0; j < GDN_K; ++j) {
            const int back = GDN_K - 1 - j;
            if (back <= d) {
                gdn_load8(p.x + (size_t)(row - back) * cd + ch, win[j]);
            } else {
#pragma unroll
                for (int c = 0; c < 8; ++c) win[j][c] = 0.f;
            }
        }
        if (d < GDN_KM1 && have_state) {
            // 8 channels x K-1 columns = 24 contiguous bf16, 16-byte aligned since ch % 8 == 0.
            float st[GDN_KM1 * 8];
            const bf16* sp = p.conv_state + ((size_t)slot * cd + ch) * GDN_KM1;
#pragma unroll
            for (int i = 0; i < GDN_KM1; ++i) gdn_load8(sp + 8 * i, st + 8 * i);
            // Tap j reaches back past the sequence start when j + d < K-1; it reads state column j + d.
            // (Branch per d so every register index is a compile-time constant.)
#pragma unroll
            for (int dd = 0; dd < GDN_KM1; ++dd) {
                if (d == dd) {
#pragma unroll
                    for (int j = 0; j + dd < GDN_KM1; ++j)
#pragma unroll
                        for (int c = 0; c < 8; ++c) win[j][c] = st[c * GDN_KM1 + j + dd];
                }
            }
        }
        float wv[GDN_K * 8];
#pragma unroll
        for (int i = 0; i < GDN_K; ++i) gdn_load8(p.w + (size_t)ch * GDN_K + 8 * i, wv + 8 * i);
        float o[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < GDN_K; ++j) acc = fmaf(wv[c * GDN_K + j], win[j][c], acc);
            o[c] = silu(acc);
        }
        gdn_store8(p.out + (size_t)row * cd + ch, o);
        return;
    }
    // Awkward conv_dim: one channel per thread.
    const int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= p.conv_dim) return;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < GDN_K; ++j) {
        const int back = GDN_K - 1 - j;
        float xv = 0.f;
        if (back <= d) xv = bf2f(p.x[(size_t)(row - back) * cd + ch]);
        else if (have_state) xv = bf2f(p.conv_state[((size_t)slot * cd + ch) * GDN_KM1 + j + d]);
        acc = fmaf(bf2f(p.w[(size_t)ch * GDN_K + j]), xv, acc);
    }
    p.out[(size_t)row * cd + ch] = f2bf(silu(acc));
}

// ---------------------------------------------------------------------------------------------------------
// Conv state commit: shift the first accepted[s] raw rows of each sequence into its conv state.

struct GdnConvCommitParams {
    const bf16* x;              // [rows, conv_dim] raw projection output (the rows given to gdn_conv_bf16)
    bf16* conv_state;           // [num_slots, conv_dim, K-1]
    const int* seq_row_start;   // [num_seqs + 1]
    const int* seq_slot;        // [num_seqs]
    const int* accepted;        // [num_seqs]
    int rows;
    int conv_dim;
    int num_seqs;
    int num_slots;
};

// Shift raw rows x[start .. start + n) (n ≥ 1) into the conv window of `slot`: the channels of block `bx`
// (8 per thread when conv_dim % 8 == 0, else 1).
__device__ __forceinline__ void gdn_conv_shift(const bf16* __restrict__ x, bf16* conv_state, int conv_dim, int slot,
                                               int start, int n, int bx) {
    const size_t cd = (size_t)conv_dim;
    // New column i is element n + i of (old state ++ accepted rows).
    if ((conv_dim & 7) == 0) {
        const int ch = (bx * blockDim.x + threadIdx.x) * 8;
        if (ch >= conv_dim) return;
        bf16* sp = conv_state + ((size_t)slot * cd + ch) * GDN_KM1;
        float old[GDN_KM1 * 8];
        if (n < GDN_KM1) {
#pragma unroll
            for (int i = 0; i < GDN_KM1; ++i) gdn_load8(sp + 8 * i, old + 8 * i);
        }
        float nw[GDN_KM1][8];
#pragma unroll
        for (int i = 0; i < GDN_KM1; ++i) {
            const int idx = n + i;
            if (idx >= GDN_KM1) {
                gdn_load8(x + (size_t)(start + idx - GDN_KM1) * cd + ch, nw[i]);
            } else {
#pragma unroll
                for (int q = 0; q < GDN_KM1; ++q)
                    if (idx == q) {
#pragma unroll
                        for (int c = 0; c < 8; ++c) nw[i][c] = old[c * GDN_KM1 + q];
                    }
            }
        }
        float flat[GDN_KM1 * 8];  // [channel][column], the state layout
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int i = 0; i < GDN_KM1; ++i) flat[c * GDN_KM1 + i] = nw[i][c];
#pragma unroll
        for (int i = 0; i < GDN_KM1; ++i) gdn_store8(sp + 8 * i, flat + 8 * i);
        return;
    }
    const int ch = bx * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    bf16* sp = conv_state + ((size_t)slot * cd + ch) * GDN_KM1;
    bf16 nw[GDN_KM1];
#pragma unroll
    for (int i = 0; i < GDN_KM1; ++i) {
        const int idx = n + i;
        nw[i] = idx >= GDN_KM1 ? x[(size_t)(start + idx - GDN_KM1) * cd + ch] : sp[idx];
    }
#pragma unroll
    for (int i = 0; i < GDN_KM1; ++i) sp[i] = nw[i];
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_conv_commit_bf16(const GdnConvCommitParams p) {
    PDL_ENTRY();
    const int s = blockIdx.y;
    const int start = __ldg(p.seq_row_start + s);
    const int end = min(__ldg(p.seq_row_start + s + 1), p.rows);
    const int slot = __ldg(p.seq_slot + s);
    if (slot < 0 || slot >= p.num_slots) return;
    const int n = max(0, min(__ldg(p.accepted + s), end - start));
    if (n == 0) return;
    gdn_conv_shift(p.x, p.conv_state, p.conv_dim, slot, start, n, blockIdx.x);
}

// ---------------------------------------------------------------------------------------------------------
// Conv + commit in one launch for short sequences (decode, verify).

#define GDN_STEP_THREADS 64

struct GdnConvStepParams {
    const bf16* x;              // [rows, conv_dim] raw projection output
    const bf16* w;              // [conv_dim, K]
    bf16* conv_state;           // [num_slots, conv_dim, K-1]
    const int* seq_row_start;   // [num_seqs + 1]
    const int* seq_slot;        // [num_seqs]: the window each sequence reads
    const int* commit_slot;     // [num_seqs]: seq_slot[s] to commit, -1 not to
    const int* accepted;        // [num_seqs]: rows to shift in (clamped to the sequence's rows)
    bf16* out;                  // [rows, conv_dim]
    int rows;
    int conv_dim;
    int num_seqs;
    int num_slots;
    bf16* keep;                 // nullptr, or [kept rows, conv_dim]: raw rows of the verifying sequences
    const int* keep_row;        // [num_seqs]: first keep row of sequence s, -1 not to keep (keep != nullptr)
};

extern "C" __global__ void __launch_bounds__(GDN_STEP_THREADS) gdn_conv_step_bf16(const GdnConvStepParams p) {
    PDL_ENTRY();
    const int s = blockIdx.y;
    const int ch = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (ch >= p.conv_dim) return;
    const int start = __ldg(p.seq_row_start + s);
    const int end = min(__ldg(p.seq_row_start + s + 1), p.rows);
    const int slot = __ldg(p.seq_slot + s);
    const bool have_state = slot >= 0 && slot < p.num_slots;
    const int n_commit = (have_state && __ldg(p.commit_slot + s) == slot)
                             ? max(0, min(__ldg(p.accepted + s), end - start)) : 0;
    const size_t cd = (size_t)p.conv_dim;
    bf16* sp = p.conv_state + ((size_t)(have_state ? slot : 0) * cd + ch) * GDN_KM1;
    const int keep_at = p.keep != nullptr ? __ldg(p.keep_row + s) : -1;

    // win[j][c]: the K-1 inputs before the next row, oldest first (zeros without a state).
    float win[GDN_KM1][8];
    if (have_state) {
        float st[GDN_KM1 * 8];  // [channel][column], the state layout
#pragma unroll
        for (int i = 0; i < GDN_KM1; ++i) gdn_load8(sp + 8 * i, st + 8 * i);
#pragma unroll
        for (int j = 0; j < GDN_KM1; ++j)
#pragma unroll
            for (int c = 0; c < 8; ++c) win[j][c] = st[c * GDN_KM1 + j];
    } else {
#pragma unroll
        for (int j = 0; j < GDN_KM1; ++j)
#pragma unroll
            for (int c = 0; c < 8; ++c) win[j][c] = 0.f;
    }
    float wv[GDN_K * 8];
#pragma unroll
    for (int i = 0; i < GDN_K; ++i) gdn_load8(p.w + (size_t)ch * GDN_K + 8 * i, wv + 8 * i);

    for (int t = start; t < end; ++t) {
        const bf16x8 raw = *reinterpret_cast<const bf16x8*>(p.x + (size_t)t * cd + ch);
        if (keep_at >= 0) *reinterpret_cast<bf16x8*>(p.keep + (size_t)(keep_at + t - start) * cd + ch) = raw;
        float xt[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(raw.h[i]);
            xt[2 * i] = f.x;
            xt[2 * i + 1] = f.y;
        }
        float o[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < GDN_KM1; ++j) acc = fmaf(wv[c * GDN_K + j], win[j][c], acc);
            acc = fmaf(wv[c * GDN_K + GDN_KM1], xt[c], acc);
            o[c] = silu(acc);
        }
        gdn_store8(p.out + (size_t)t * cd + ch, o);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
#pragma unroll
            for (int j = 0; j + 1 < GDN_KM1; ++j) win[j][c] = win[j + 1][c];
            win[GDN_KM1 - 1][c] = xt[c];
        }
        if (t - start + 1 == n_commit) {
            float flat[GDN_KM1 * 8];
#pragma unroll
            for (int c = 0; c < 8; ++c)
#pragma unroll
                for (int i = 0; i < GDN_KM1; ++i) flat[c * GDN_KM1 + i] = win[i][c];
#pragma unroll
            for (int i = 0; i < GDN_KM1; ++i) gdn_store8(sp + 8 * i, flat + 8 * i);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The gated delta rule recurrence, state in registers across all rows of a sequence.

struct GdnRecurrentParams {
    const bf16* c;              // [rows, conv_dim] conv output: q | k | v
    const bf16* b;              // [rows, hv] beta logits
    const bf16* a;              // [rows, hv] decay input
    const float* a_log;         // [hv]
    const float* dt_bias;       // [hv]
    float* state;               // [num_slots, hv, dk, dv]
    float* lanes;               // nullptr (in place) or [num_seqs, max_lanes, hv, dk, dv]
    const int* seq_row_start;   // [num_seqs + 1]
    const int* seq_slot;        // [num_seqs]
    bf16* o;                    // [rows, hv * dv]
    int rows;
    int num_seqs;
    int num_slots;
    int h;
    int hv;
    int dk;
    int dv;
    int max_lanes;
    float q_scale;              // 1 / sqrt(dk)
    float eps;                  // gated-norm tail
    const bf16* z;              // [rows, hv * dv] gate of the output norm (y != nullptr)
    const bf16* norm_w;         // [dv]
    bf16* y;                    // [rows, hv * dv] normed output, or nullptr: no tail
    unsigned* arrivals;         // [num_seqs, hv], zero between launches
    const int* snap_slot;       // nullptr, or [num_seqs]: the slot a sequence without seq_slot snapshots from
};

// The slot sequence s starts from, and whether its states go to its lanes (else back in place); see Modes.
__device__ __forceinline__ int gdn_seq_slot(const GdnRecurrentParams& p, int s, bool& to_lanes) {
    int slot = __ldg(p.seq_slot + s);
    to_lanes = p.lanes != nullptr;
    if (p.snap_slot != nullptr) {
        to_lanes = slot < 0 || slot >= p.num_slots;
        if (to_lanes) slot = __ldg(p.snap_slot + s);
    }
    return slot;
}

#define GDN_PREFETCH 2  // rows of inputs in flight ahead of the row being computed

// One row's inputs as this lane needs them: q, k at rows k0..k0+KPT of head kh, v at columns c0..c0+4.
template <int KPT>
struct GdnRowIn {
    float q[KPT], k[KPT], v[4], b, a;
};

template <int KPT, bool VEC>
__device__ __forceinline__ void gdn_load_row(const GdnRecurrentParams& p, const bf16* qp, const bf16* kp,
                                             const bf16* vp, int k0, int c0, int j, int t, GdnRowIn<KPT>& in) {
    const size_t row_off = (size_t)t * ((size_t)2 * p.h * p.dk + (size_t)p.hv * p.dv);
    float* q = in.q;
    float* k = in.k;
    float* v = in.v;
    if constexpr (VEC && KPT % 8 == 0) {
        // d_k % 8 == 0: a chunk of 8 rows is either all inside the head or all outside.
#pragma unroll
        for (int i = 0; i < KPT; i += 8) {
            if (k0 + i < p.dk) {
                gdn_load8(qp + row_off + i, q + i);
                gdn_load8(kp + row_off + i, k + i);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) q[i + e] = k[i + e] = 0.f;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
            const bool inside = k0 + i < p.dk;
            q[i] = inside ? bf2f(qp[row_off + i]) : 0.f;
            k[i] = inside ? bf2f(kp[row_off + i]) : 0.f;
        }
    }
    if constexpr (VEC) {
        // 4 bf16 = 8 bytes, aligned: every term of the offset is a multiple of 4 elements.
        const uint2 raw = *reinterpret_cast<const uint2*>(vp + row_off);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
        v[0] = lo.x;
        v[1] = lo.y;
        v[2] = hi.x;
        v[3] = hi.y;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = c0 + e < p.dv ? bf2f(vp[row_off + e]) : 0.f;
    }
    in.b = bf2f(p.b[(size_t)t * p.hv + j]);
    in.a = bf2f(p.a[(size_t)t * p.hv + j]);
}

template <int KPT, bool VEC>
__device__ __forceinline__ void gdn_recurrent_body(const GdnRecurrentParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cg = lane & 1, kg = lane >> 1;
    const int slices = (p.dv + GDN_COLS_PER_CTA - 1) / GDN_COLS_PER_CTA;
    const int j = blockIdx.x / slices, slice = blockIdx.x % slices;
    const int s = blockIdx.y;
    const int warp_c0 = slice * GDN_COLS_PER_CTA + warp * 8;
    if (warp_c0 >= p.dv) return;  // warp-uniform: this warp's columns are all past d_v
    const int c0 = warp_c0 + cg * 4, k0 = kg * KPT;
    const int start = __ldg(p.seq_row_start + s);
    const int end = min(__ldg(p.seq_row_start + s + 1), p.rows);
    bool to_lanes;
    const int slot = gdn_seq_slot(p, s, to_lanes);
    if (slot < 0 || slot >= p.num_slots || end <= start) return;  // CTA-uniform

    const int kh = j / (p.hv / p.h);
    const size_t head_elems = (size_t)p.dk * p.dv;
    float* sp = p.state + ((size_t)slot * p.hv + j) * head_elems;

    // 1. The state slice into registers: S[i][e] = S[k0 + i][c0 + e] (zero outside d_k x d_v).
    float S[KPT][4];
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
        const int k = k0 + i;
        if constexpr (VEC) {
            float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
            if (k < p.dk) t = *reinterpret_cast<const float4*>(sp + (size_t)k * p.dv + c0);
            S[i][0] = t.x;
            S[i][1] = t.y;
            S[i][2] = t.z;
            S[i][3] = t.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                S[i][e] = (k < p.dk && c0 + e < p.dv) ? sp[(size_t)k * p.dv + c0 + e] : 0.f;
        }
    }

    const bf16* qp = p.c + (size_t)kh * p.dk + k0;
    const bf16* kp = p.c + (size_t)(p.h + kh) * p.dk + k0;
    const bf16* vp = p.c + (size_t)2 * p.h * p.dk + (size_t)j * p.dv + c0;
    const float neg_a = -__expf(__ldg(p.a_log + j));
    const float dtb = __ldg(p.dt_bias + j);

    // in[0] is the row being computed, in[1..] the next rows, already requested (past the end: the last
    // row again).
    GdnRowIn<KPT> in[GDN_PREFETCH + 1];
#pragma unroll
    for (int f = 0; f < GDN_PREFETCH; ++f)
        gdn_load_row<KPT, VEC>(p, qp, kp, vp, k0, c0, j, min(start + f, end - 1), in[f]);

    for (int t = start; t < end; ++t) {
        // 2. Request row t + GDN_PREFETCH while this one is computed (hides the load latency in prefill).
        gdn_load_row<KPT, VEC>(p, qp, kp, vp, k0, c0, j, min(t + GDN_PREFETCH, end - 1), in[GDN_PREFETCH]);
        const float* q = in[0].q;
        const float* k = in[0].k;
        const float* v = in[0].v;
        const float bb = in[0].b, aa = in[0].a;

        // 3. Partial Sᵀk, Sᵀq over this lane's rows, and the q/k norms, then one butterfly over the 16
        //    k-groups (lane bits 1..4); the two column groups (bit 0) stay apart.
        float red[11];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float mk = 0.f, mq = 0.f;
#pragma unroll
            for (int i = 0; i < KPT; ++i) {
                mk = fmaf(S[i][e], k[i], mk);
                mq = fmaf(S[i][e], q[i], mq);
            }
            red[e] = mk;
            red[4 + e] = mq;
        }
        float kk = 0.f, qq = 0.f, kq = 0.f;
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
            kk = fmaf(k[i], k[i], kk);
            qq = fmaf(q[i], q[i], qq);
            kq = fmaf(k[i], q[i], kq);
        }
        red[8] = kk;
        red[9] = qq;
        red[10] = kq;
#pragma unroll
        for (int off = 2; off < 32; off <<= 1)
#pragma unroll
            for (int r = 0; r < 11; ++r) red[r] += __shfl_xor_sync(0xffffffffu, red[r], off);

        // 4. Gates and scales (fp32), then u and o for this lane's 4 columns.
        const float rk = rsqrtf(red[8] + 1e-6f);
        const float rq = rsqrtf(red[9] + 1e-6f) * p.q_scale;
        const float eg = __expf(neg_a * softplus(aa + dtb));
        const float beta = sigmoid(bb);
        const float kqn = rk * rq * red[10];
        float u[4], out[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            u[e] = beta * (v[e] - eg * rk * red[e]);
            out[e] = fmaf(u[e], kqn, eg * rq * red[4 + e]);
        }
        if (kg == 0) {
            bf16* op = p.o + (size_t)t * p.hv * p.dv + (size_t)j * p.dv + c0;
            if constexpr (VEC) {
                __nv_bfloat162 lo = __floats2bfloat162_rn(out[0], out[1]);
                __nv_bfloat162 hi = __floats2bfloat162_rn(out[2], out[3]);
                uint2 raw;
                raw.x = *reinterpret_cast<uint32_t*>(&lo);
                raw.y = *reinterpret_cast<uint32_t*>(&hi);
                *reinterpret_cast<uint2*>(op) = raw;
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (c0 + e < p.dv) op[e] = f2bf(out[e]);
            }
        }

        // 5. S = e^g S + k uᵀ with the normalised k.
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
            const float kni = rk * k[i];
#pragma unroll
            for (int e = 0; e < 4; ++e) S[i][e] = fmaf(kni, u[e], eg * S[i][e]);
        }

        // 6. Verify: snapshot the state after this row into its lane.
        const int r = t - start;
        if (to_lanes && r < p.max_lanes) {
            float* lp = p.lanes + (((size_t)s * p.max_lanes + r) * p.hv + j) * head_elems;
#pragma unroll
            for (int i = 0; i < KPT; ++i) {
                const int kr = k0 + i;
                if constexpr (VEC) {
                    if (kr < p.dk)
                        *reinterpret_cast<float4*>(lp + (size_t)kr * p.dv + c0) =
                            make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (kr < p.dk && c0 + e < p.dv) lp[(size_t)kr * p.dv + c0 + e] = S[i][e];
                }
            }
        }

#pragma unroll
        for (int f = 0; f < GDN_PREFETCH; ++f) in[f] = in[f + 1];
    }

    // 7. In place: the final state back to its slot.
    if (!to_lanes) {
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
            const int kr = k0 + i;
            if constexpr (VEC) {
                if (kr < p.dk)
                    *reinterpret_cast<float4*>(sp + (size_t)kr * p.dv + c0) =
                        make_float4(S[i][0], S[i][1], S[i][2], S[i][3]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (kr < p.dk && c0 + e < p.dv) sp[(size_t)kr * p.dv + c0 + e] = S[i][e];
            }
        }
    }
}

// The gated-norm tail (see the header): after the body, the last of a head's CTAs normalises its rows.
__device__ __forceinline__ void gdn_norm_tail(const GdnRecurrentParams& p) {
    const int slices = (p.dv + GDN_COLS_PER_CTA - 1) / GDN_COLS_PER_CTA;
    const int j = blockIdx.x / slices, s = blockIdx.y;
    const int start = __ldg(p.seq_row_start + s);
    const int end = min(__ldg(p.seq_row_start + s + 1), p.rows);
    bool to_lanes;
    const int slot = gdn_seq_slot(p, s, to_lanes);
    if (slot < 0 || slot >= p.num_slots || end <= start) return;  // CTA-uniform, as in the body
    __shared__ int last;
    __threadfence();  // this thread's o stores, visible device-wide before the count
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* count = p.arrivals + (size_t)s * p.hv + j;
        last = atomicAdd(count, 1u) == (unsigned)(slices - 1);
        if (last) *count = 0u;  // every other CTA of the head has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = start + warp; t < end; t += GDN_THREADS / 32) {
        const size_t base = (size_t)t * p.hv * p.dv + (size_t)j * p.dv;
        float ss = 0.f;
        for (int e = lane; e < p.dv; e += 32) {
            const float v = bf2f(__ldcg(p.o + base + e));
            ss = fmaf(v, v, ss);
        }
        const float inv = rsqrtf(warp_sum(ss) / p.dv + p.eps);
        for (int e = lane; e < p.dv; e += 32) {
            const float v = bf2f(__ldcg(p.o + base + e));
            p.y[base + e] = f2bf(bf2f(p.norm_w[e]) * bf2f(f2bf(v * inv)) * silu(bf2f(p.z[base + e])));
        }
    }
}

__device__ __forceinline__ void gdn_recurrent(const GdnRecurrentParams& p) {
    const bool vec = (p.dk % 8 == 0) && (p.dv % 8 == 0);
    if (p.dk <= 32) {
        if (vec) gdn_recurrent_body<2, true>(p);
        else gdn_recurrent_body<2, false>(p);
    } else if (p.dk <= 64) {
        if (vec) gdn_recurrent_body<4, true>(p);
        else gdn_recurrent_body<4, false>(p);
    } else {
        if (vec) gdn_recurrent_body<8, true>(p);
        else gdn_recurrent_body<8, false>(p);
    }
}

extern "C" __global__ void __launch_bounds__(GDN_THREADS) gdn_recurrent_bf16(const GdnRecurrentParams p) {
    PDL_ENTRY();
    gdn_recurrent(p);
    if (p.y != nullptr) gdn_norm_tail(p);
}

// ---------------------------------------------------------------------------------------------------------
// Commit a verify snapshot lane into the state slot.

struct GdnCommitLaneParams {
    const float* lanes;         // [num_seqs, max_lanes, state_len]
    float* state;               // [num_slots, state_len]
    const int* seq_slot;        // [num_seqs]
    const int* lane;            // [num_seqs]
    long long state_len;        // hv * dk * dv
    int num_seqs;
    int num_slots;
    int max_lanes;
};

// dst[0..n) = src[0..n): the part of block `bx` (GDN_COPY_THREADS threads, GDN_COPY_UNROLL copies each, of
// 16 bytes when n % 4 == 0).
__device__ __forceinline__ void gdn_copy_state(const float* __restrict__ src, float* __restrict__ dst, size_t n, int bx) {
    const size_t base = (size_t)bx * GDN_COPY_THREADS * GDN_COPY_UNROLL + threadIdx.x;
    if ((n & 3) == 0) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        const size_t n4 = n / 4;
        float4 v[GDN_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < GDN_COPY_UNROLL; ++u) {
            const size_t i = base + (size_t)u * GDN_COPY_THREADS;
            if (i < n4) v[u] = __ldcs(s4 + i);
        }
#pragma unroll
        for (int u = 0; u < GDN_COPY_UNROLL; ++u) {
            const size_t i = base + (size_t)u * GDN_COPY_THREADS;
            if (i < n4) d4[i] = v[u];
        }
        return;
    }
    float v[GDN_COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < GDN_COPY_UNROLL; ++u) {
        const size_t i = base + (size_t)u * GDN_COPY_THREADS;
        if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < GDN_COPY_UNROLL; ++u) {
        const size_t i = base + (size_t)u * GDN_COPY_THREADS;
        if (i < n) dst[i] = v[u];
    }
}

extern "C" __global__ void __launch_bounds__(GDN_COPY_THREADS) gdn_commit_lane_f32(const GdnCommitLaneParams p) {
    PDL_ENTRY();
    const int s = blockIdx.y;
    const int l = __ldg(p.lane + s), slot = __ldg(p.seq_slot + s);
    if (l < 0 || l >= p.max_lanes || slot < 0 || slot >= p.num_slots) return;
    const size_t n = (size_t)p.state_len;
    gdn_copy_state(p.lanes + ((size_t)s * p.max_lanes + l) * n, p.state + (size_t)slot * n, n, blockIdx.x);
}

// ---------------------------------------------------------------------------------------------------------
// A verify's deferred commit, every GDN layer in one launch.

struct GdnCommitLayersParams {
    const unsigned long long* conv_state;  // [layers]: bf16 [num_slots, conv_dim, K-1]
    const unsigned long long* keep;        // [layers]: bf16 [kept rows, conv_dim], the verify's raw rows
    const unsigned long long* state;       // [layers]: f32 [num_slots, state_len]
    const unsigned long long* lanes;       // [layers]: f32 [lane_seqs, max_lanes, state_len]
    const int* entry;                      // [5, num_entries]: slot, lane seq, lane, first keep row, kept rows
    long long state_len;
    int conv_dim;
    int num_entries;
    int num_slots;
    int max_lanes;
    int lane_seqs;
    int copy_blocks;                       // blocks of the state copy; the rest of grid.x shift the conv window
};

extern "C" __global__ void __launch_bounds__(GDN_COPY_THREADS) gdn_commit_layers(const GdnCommitLayersParams p) {
    PDL_ENTRY();
    const int e = blockIdx.y, layer = blockIdx.z, ne = p.num_entries;
    const int slot = __ldg(p.entry + e), seq = __ldg(p.entry + ne + e), lane = __ldg(p.entry + 2 * ne + e);
    const int keep_row = __ldg(p.entry + 3 * ne + e), kept = __ldg(p.entry + 4 * ne + e);
    if (slot < 0 || slot >= p.num_slots || seq < 0 || seq >= p.lane_seqs || lane < 0 || lane >= p.max_lanes) return;
    if ((int)blockIdx.x < p.copy_blocks) {
        const size_t n = (size_t)p.state_len;
        const float* lanes = reinterpret_cast<const float*>(p.lanes[layer]);
        float* state = reinterpret_cast<float*>(p.state[layer]);
        gdn_copy_state(lanes + ((size_t)seq * p.max_lanes + lane) * n, state + (size_t)slot * n, n, blockIdx.x);
        return;
    }
    // Rows 0..lane of the verify were accepted: they shift into the window (as gdn_conv_commit_bf16).
    const int n = min(lane + 1, kept);
    if (n <= 0) return;
    const bf16* keep = reinterpret_cast<const bf16*>(p.keep[layer]);
    bf16* conv = reinterpret_cast<bf16*>(p.conv_state[layer]);
    gdn_conv_shift(keep, conv, p.conv_dim, slot, keep_row, n, blockIdx.x - p.copy_blocks);
}
