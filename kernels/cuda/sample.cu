// On-device token selection for the decode loop. logits f32 [R, V] row-major, V up to ~400k (vocab 248320).
//
// A row is 1 MB at V = 248320: one SM alone reads it in ~8 us (per-SM L2 bandwidth), so argmax_f32 and
// sample_f32 give each row a thread-block cluster of SAMPLE_CLUSTER = 8 CTAs on 8 SMs (compile-time
// __cluster_dims__, so a plain cuLaunchKernel launches it): CTA r of the cluster owns the contiguous chunk
// [r*chunk, min(V, (r+1)*chunk)) and the CTAs combine their partial results through distributed shared
// memory, always in rank order (deterministic). grid = R * 8 CTAs, block = 512; chunk = ceil(V/8) rounded up
// to a multiple of 4 (the launcher computes it).
//
// argmax_f32: out[r] = index of the max of row r; ties -> lowest index; NaN counts as -inf.
//   Bytes: R*V*4 read once (float4 loads when V % 4 == 0), R*4 written.
//
// sample_f32: per row, with SampleRow {seed, counter, temperature, top_p, top_k, min_p}
// (engine/src/sample/keyed.rs is its host reference):
//   temperature <= 0, top_k == 1 or a non-finite max -> exactly argmax_f32. Otherwise:
//   1. m = max logit; t_i = (m - z_i) / temperature (>= 0); p_i ∝ exp(-t_i).
//      Tokens with t_i >= 27.5 (p_i < 1.2e-12 * p_max) are dropped up front.
//   2. Key q_i = floor(t_i * 2^27) (u32; 0 for the max; smaller = more probable) and integer weight
//      W_i = round(exp(-q_i / 2^27) * 2^40) (u64, >= 1 for every kept token): every sum below is an integer
//      sum, so the result does not depend on summation order (bit-reproducible).
//   3. top-k (0 < k < V): qk = the k-th smallest key (radix select, 4 rounds of 8 bits over a 256-bin count
//      histogram); keep q <= qk. Ties at the k-th key are all kept (can keep more than k tokens).
//   4. top-p (top_p < 1): over the kept set, qp = the smallest key such that the tokens with q <= qp carry
//      >= top_p of the kept mass (radix select over a 256-bin mass histogram); keep q <= qp. This is the
//      smallest set of highest-probability tokens reaching top_p, ties at the boundary all kept.
//   5. min-p (min_p > 0): keep t <= -ln(min_p), i.e. p >= min_p * p_max.
//   6. Draw: r = mulhi64(splitmix64(splitmix64(seed) ^ counter), M) in [0, M), M = kept mass; the token is
//      the first kept index (in vocabulary order) whose inclusive prefix mass exceeds r.
//   No sort: each radix round is one pass over the row held in shared memory (the CTA's chunk, 124 KB at
//   V = 248320) plus one cluster barrier. Bytes: R*V*4 read once from global memory.
//   The RNG depends on (seed, counter) only, not on the row index: the caller derives a per-request seed and
//   passes e.g. the token position as counter, so a request samples the same tokens in any batch.
//
// spec_accept_greedy_i32: speculative greedy acceptance for S sequences with k drafts each:
//   accepted[s] = m = length of the longest prefix with drafts[s][j] == target[s][j]; next[s] = target[s][m].
//   Bytes: <= S*(2k+1)*4 read, S*8 written. Launch: grid = ceil(S/128), block = 128 (one thread per sequence).
#include <cfloat>
#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

#define SAMPLE_CLUSTER 8
#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define Q_INVALID 0xFFFFFFFFu  // dropped token (t >= T_CUT or -inf)
#define Q_ALL 0xFFFFFFFEu      // "keep every valid token"
#define T_CUT 27.5f

struct SampleRow {
    unsigned long long seed;
    unsigned long long counter;
    float temperature;
    float top_p;
    int top_k;
    float min_p;
};

struct SampleParams {
    const float* logits;    // [rows, v]
    const SampleRow* rows;  // [rows]
    int* out;               // [rows]
    int v;
    int chunk;  // elements per CTA, multiple of 4
    int vec;    // v % 4 == 0 and 16-byte aligned logits: float4 loads
};

__device__ __forceinline__ float sanitize(float z) { return isnan(z) ? -INFINITY : z; }

// (v, i) beats (bv, bi): larger value, or equal value and lower index. Total order -> deterministic reduce.
__device__ __forceinline__ void argmax_merge(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_merge(v, i, ov, oi);
    }
}

// Block-wide argmax; the result is valid in thread 0.
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
        i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
        warp_argmax(v, i);
    }
}

// Scan this CTA's chunk [lo, hi) of row z for its argmax; optionally copy the (sanitised) values to smem.
template <bool STAGE>
__device__ __forceinline__ void chunk_argmax(const float* __restrict__ z, int lo, int n, int vec, float* zs, float& bv,
                                             int& bi) {
    bv = -INFINITY;
    bi = 0x7fffffff;
    if (vec) {  // lo % 4 == 0 and n % 4 == 0
        const float4* z4 = reinterpret_cast<const float4*>(z + lo);
        const int n4 = n >> 2;
        int i = threadIdx.x;
        for (; i + 3 * SAMPLE_THREADS < n4; i += 4 * SAMPLE_THREADS) {  // 4 loads in flight per thread
            float4 a[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) a[u] = __ldg(z4 + i + u * SAMPLE_THREADS);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int e = 4 * (i + u * SAMPLE_THREADS);
                const float4 s = make_float4(sanitize(a[u].x), sanitize(a[u].y), sanitize(a[u].z), sanitize(a[u].w));
                if (STAGE) reinterpret_cast<float4*>(zs)[i + u * SAMPLE_THREADS] = s;
                argmax_merge(bv, bi, s.x, lo + e);
                argmax_merge(bv, bi, s.y, lo + e + 1);
                argmax_merge(bv, bi, s.z, lo + e + 2);
                argmax_merge(bv, bi, s.w, lo + e + 3);
            }
        }
        for (; i < n4; i += SAMPLE_THREADS) {
            const float4 a = __ldg(z4 + i);
            const float4 s = make_float4(sanitize(a.x), sanitize(a.y), sanitize(a.z), sanitize(a.w));
            if (STAGE) reinterpret_cast<float4*>(zs)[i] = s;
            argmax_merge(bv, bi, s.x, lo + 4 * i);
            argmax_merge(bv, bi, s.y, lo + 4 * i + 1);
            argmax_merge(bv, bi, s.z, lo + 4 * i + 2);
            argmax_merge(bv, bi, s.w, lo + 4 * i + 3);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            const float s = sanitize(__ldg(z + lo + i));
            if (STAGE) zs[i] = s;
            argmax_merge(bv, bi, s, lo + i);
        }
    }
}

extern "C" __global__ void __cluster_dims__(SAMPLE_CLUSTER, 1, 1) __launch_bounds__(SAMPLE_THREADS)
    argmax_f32(const float* __restrict__ logits, int* __restrict__ out, int v, int chunk, int vec) {
    PDL_ENTRY();
    __shared__ float c_val;
    __shared__ int c_idx;
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const size_t row = blockIdx.x / SAMPLE_CLUSTER;
    const int lo = rank * chunk;
    const int n = max(0, min(v, lo + chunk) - lo);
    float bv;
    int bi;
    chunk_argmax<false>(logits + row * v, lo, n, vec, nullptr, bv, bi);
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        c_val = bv;
        c_idx = bi;
    }
    cluster.sync();
    if (rank == 0 && threadIdx.x == 0) {
        float gv = -INFINITY;
        int gi = 0x7fffffff;
        for (int r = 0; r < SAMPLE_CLUSTER; ++r)
            argmax_merge(gv, gi, *cluster.map_shared_rank(&c_val, r), *cluster.map_shared_rank(&c_idx, r));
        out[row] = gi;  // every element took part, so gi < v
    }
    cluster.sync();  // keep this CTA's shared memory alive until rank 0 has read it
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Integer weight of key q: round(exp(-q / 2^27) * 2^40). A pure function of q (same value in every pass).
__device__ __forceinline__ unsigned long long q_weight(unsigned q) {
    const float t = (float)q * (1.f / 134217728.f);
    return __float2ull_rn(exp2f(t * -1.4426950408889634f) * 1099511627776.f);
}

__device__ __forceinline__ unsigned long long warp_incl_scan_u64(unsigned long long v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

struct SelectState {
    unsigned digit;
    unsigned long long before;
    unsigned long long target;
};

// Cluster-wide radix select over the keys q of the CTAs' chunks: the smallest key q* such that the weight
// (MASS: W(q), else 1) of the tokens with q <= q* reaches the target. Tokens take part iff q <= bound.
// target = clamp(MASS ? ceil(top_p * total) : top_k, 1, total), total = weight of the taking-part tokens.
// 4 rounds of 8 bits, MSB first; each round: local 256-bin histogram, cluster barrier, bins summed over the
// 8 CTAs in rank order, warp 0 finds the bin where the running sum crosses the target.
// Only 32-bit integer shared atomics are native (64-bit and float adds are CAS loops), so a mass W < 2^41 is
// added as three 16/16/9-bit limbs into three u32 histograms (a CTA holds < 2^16 tokens: no limb overflows);
// counts use limb 0 alone. Integer sums: the result is independent of the order of the atomics.
// hist is double-buffered by round parity, so one cluster barrier per round suffices: a CTA clears buffer b
// only after the barrier that every other CTA reached after its last read of b.
template <bool MASS>
__device__ unsigned radix_select(cg::cluster_group& cluster, const unsigned* qs, int n, unsigned bound, int top_k,
                                 float top_p, unsigned (*hist)[3][256], unsigned long long* hsum, SelectState* st) {
    unsigned prefix = 0;
    unsigned long long before = 0, target = 0;
#pragma unroll 1
    for (int r = 0; r < 4; ++r) {
        const int shift = 24 - 8 * r;
        const unsigned hmask = r == 0 ? 0u : (0xFFFFFFFFu << (shift + 8));
        unsigned(*h)[256] = hist[r & 1];
        for (int i = threadIdx.x; i < 3 * 256; i += SAMPLE_THREADS) h[i >> 8][i & 255] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            const unsigned q = qs[i];
            if (q <= bound && (q & hmask) == prefix) {
                const unsigned bin = (q >> shift) & 255u;
                if (MASS) {
                    const unsigned long long w = q_weight(q);
                    atomicAdd(&h[0][bin], (unsigned)w & 0xFFFFu);
                    atomicAdd(&h[1][bin], (unsigned)(w >> 16) & 0xFFFFu);
                    atomicAdd(&h[2][bin], (unsigned)(w >> 32));
                } else {
                    atomicAdd(&h[0][bin], 1u);
                }
            }
        }
        cluster.sync();
        for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) {
            unsigned long long s = 0;
#pragma unroll
            for (int rk = 0; rk < SAMPLE_CLUSTER; ++rk) {
                unsigned(*rh)[256] = cluster.map_shared_rank(h, rk);
                s += (unsigned long long)rh[0][b];
                if (MASS) s += ((unsigned long long)rh[1][b] << 16) + ((unsigned long long)rh[2][b] << 32);
            }
            hsum[b] = s;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            unsigned long long loc[8], mine = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                loc[j] = hsum[8 * lane + j];
                mine += loc[j];
            }
            const unsigned long long incl = warp_incl_scan_u64(mine);
            if (r == 0) {
                const unsigned long long total = __shfl_sync(0xffffffffu, incl, 31);
                unsigned long long tg;
                if (MASS) {
                    const double want = ceil((double)top_p * (double)total);
                    tg = want >= (double)total ? total : (unsigned long long)fmax(want, 0.0);
                } else {
                    tg = (unsigned long long)top_k;
                }
                target = tg < 1 ? 1 : (tg > total ? total : tg);
            }
            const unsigned long long excl = incl - mine;
            if (before + excl < target && before + incl >= target) {  // exactly one lane
                unsigned long long c = before + excl;
                bool found = false;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (!found && c + loc[j] >= target) {
                        found = true;
                        st->digit = 8 * lane + j;
                        st->before = c;
                    }
                    c += loc[j];
                }
            }
            if (lane == 0) st->target = target;
        }
        __syncthreads();
        prefix |= st->digit << shift;
        before = st->before;
        target = st->target;
    }
    return prefix;
}

// Exclusive scan of one u64 per thread over the block; *total gets the block sum (all threads).
__device__ __forceinline__ unsigned long long block_excl_scan_u64(unsigned long long v, unsigned long long* total) {
    __shared__ unsigned long long wsum[SAMPLE_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned long long incl = warp_incl_scan_u64(v);
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    unsigned long long base = 0, all = 0;
#pragma unroll
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const unsigned long long s = wsum[w];
        base += w < warp ? s : 0ull;
        all += s;
    }
    *total = all;
    return base + incl - v;
}

extern "C" __global__ void __cluster_dims__(SAMPLE_CLUSTER, 1, 1) __launch_bounds__(SAMPLE_THREADS)
    sample_f32(const SampleParams p) {
    PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char sample_smem[];
    float* zs = reinterpret_cast<float*>(sample_smem);        // this CTA's logits ...
    unsigned* qs = reinterpret_cast<unsigned*>(sample_smem);  // ... replaced in place by their keys
    __shared__ unsigned hist[2][3][256];
    __shared__ unsigned long long hsum[256];
    __shared__ SelectState st;
    __shared__ float c_val;
    __shared__ int c_idx;
    __shared__ unsigned long long c_mass;
    __shared__ float s_max;
    __shared__ int s_arg;
    __shared__ unsigned long long s_base, s_total;

    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank();
    const size_t row = blockIdx.x / SAMPLE_CLUSTER;
    const int lo = rank * p.chunk;
    const int n = max(0, min(p.v, lo + p.chunk) - lo);
    const SampleRow rp = p.rows[row];

    // 1. Stage the chunk in shared memory; cluster-wide max (and argmax for the greedy case).
    float bv;
    int bi;
    chunk_argmax<true>(p.logits + row * p.v, lo, n, p.vec, zs, bv, bi);
    block_argmax(bv, bi);
    if (threadIdx.x == 0) {
        c_val = bv;
        c_idx = bi;
    }
    cluster.sync();
    if (threadIdx.x == 0) {
        float gv = -INFINITY;
        int gi = 0x7fffffff;
        for (int r = 0; r < SAMPLE_CLUSTER; ++r)
            argmax_merge(gv, gi, *cluster.map_shared_rank(&c_val, r), *cluster.map_shared_rank(&c_idx, r));
        s_max = gv;
        s_arg = gi;
    }
    __syncthreads();
    const float m = s_max;
    // Cluster-uniform decision: every CTA takes the same branch, so the cluster barriers below match up.
    // A temperature below FLT_MIN (0, or subnormal: 1 / T overflows) is the argmax, as on the host.
    if (!(rp.temperature >= FLT_MIN) || rp.top_k == 1 || !isfinite(m)) {
        if (rank == 0 && threadIdx.x == 0) p.out[row] = s_arg;
        cluster.sync();
        return;
    }

    // 2. Keys in place: q = floor(t * 2^27), t = (m - z) / T; dropped tokens get Q_INVALID.
    // Correctly rounded, as the host's `1.0 / T` (under --use_fast_math `1.f / T` is an approximate reciprocal).
    const float inv_t = __frcp_rn(rp.temperature);
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        const float t = (m - zs[i]) * inv_t;
        qs[i] = t < T_CUT ? __float2uint_rz(t * 134217728.f) : Q_INVALID;
    }
    __syncthreads();

    // 3./4. Thresholds.
    unsigned qk = Q_ALL;
    if (rp.top_k > 0 && rp.top_k < p.v) qk = radix_select<false>(cluster, qs, n, Q_ALL, rp.top_k, 1.f, hist, hsum, &st);
    unsigned qf = qk;
    if (rp.top_p < 1.f) qf = radix_select<true>(cluster, qs, n, qk, 0, rp.top_p, hist, hsum, &st);
    // 5. min-p: a key bound of its own (p_max is the max token's, q = 0, always kept).
    if (rp.min_p > 0.f) {
        // In double, as the host: fast math makes logf approximate; log is not.
        const float t_max = (float)-log((double)rp.min_p);
        if (t_max < T_CUT) qf = min(qf, __float2uint_rz(t_max * 134217728.f));
    }

    // 6. Draw. Each thread owns a contiguous run of the chunk, so prefix masses follow vocabulary order.
    const int per = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int a = min(n, (int)threadIdx.x * per), b = min(n, a + per);
    unsigned long long mine = 0;
    for (int i = a; i < b; ++i) {
        const unsigned q = qs[i];
        if (q <= qf) mine += q_weight(q);
    }
    unsigned long long cta_total;
    const unsigned long long excl = block_excl_scan_u64(mine, &cta_total);
    if (threadIdx.x == 0) c_mass = cta_total;
    cluster.sync();
    if (threadIdx.x == 0) {
        unsigned long long base = 0, total = 0;
        for (int r = 0; r < SAMPLE_CLUSTER; ++r) {
            const unsigned long long s = *cluster.map_shared_rank(&c_mass, r);
            base += r < rank ? s : 0ull;
            total += s;
        }
        s_base = base;
        s_total = total;
    }
    __syncthreads();
    // total >= 2^40: the max token (q = 0) is always kept.
    const unsigned long long draw = __umul64hi(splitmix64(splitmix64(rp.seed) ^ rp.counter), s_total);
    unsigned long long c = s_base + excl;
    if (mine > 0 && c <= draw && draw < c + mine) {  // exactly one thread of the cluster
        for (int i = a; i < b; ++i) {
            const unsigned q = qs[i];
            if (q > qf) continue;
            c += q_weight(q);
            if (draw < c) {
                p.out[row] = lo + i;
                break;
            }
        }
    }
    cluster.sync();  // keep shared memory alive until every CTA has read c_mass
}

extern "C" __global__ void __launch_bounds__(128) spec_accept_greedy_i32(const int* __restrict__ target,
                                                                        const int* __restrict__ drafts,
                                                                        int* __restrict__ accepted,
                                                                        int* __restrict__ next, int seqs, int k) {
    PDL_ENTRY();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= seqs) return;
    const int* tg = target + (size_t)s * (k + 1);
    const int* dr = drafts + (size_t)s * k;
    int m = 0;
    while (m < k && dr[m] == tg[m]) ++m;
    accepted[s] = m;
    next[s] = tg[m];
}

// take_i32: out[i] = table[idx[i]] for i < n (a draft head's argmax positions → the draft vocabulary's token ids,
// so a chained draft step reads its token without a host round trip). An index outside [0, len) gives -1.
// Launch: grid = ceil(n / 128), block = 128.
extern "C" __global__ void __launch_bounds__(128) take_i32(const int* __restrict__ idx, const int* __restrict__ table,
                                                          int* __restrict__ out, int n, int len) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int j = idx[i];
    out[i] = (j >= 0 && j < len) ? table[j] : -1;
}

// spec_cycle_accept: greedy acceptance inside a greedy MTP cycle, the drafts read from the verify's own input
// tokens. Sequence s verifies rows s*(k+1) .. s*(k+1)+k: tokens[row 0] its last token, tokens[rows 1..k] its drafts,
// target[row i] the target's argmax after row i. accepted[s] = the longest prefix of drafts the target repeats;
// pick[s] = s*(k+1) + accepted[s], the draft extend's row whose MTP hidden drafts the next d1.
// Launch: grid = ceil(seqs / 128), block = 128.
extern "C" __global__ void __launch_bounds__(128) spec_cycle_accept(const int* __restrict__ target,
                                                                   const int* __restrict__ tokens,
                                                                   int* __restrict__ accepted, int* __restrict__ pick,
                                                                   int seqs, int k) {
    PDL_ENTRY();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= seqs) return;
    const int row0 = s * (k + 1);
    int m = 0;
    while (m < k && tokens[row0 + 1 + m] == target[row0 + m]) ++m;
    accepted[s] = m;
    pick[s] = row0 + m;
}

// spec_cycle_step_rows: one chained draft step's rows after the device's acceptance. The host uploaded position
// p + step for sequence s (p: its verify's first position, as if nothing was accepted); this moves the row to
// p + accepted[s] + step and rewrites its context length (position + 1) and KV slot from the block table
// (slot -1, which the KV write skips, past the table: the host reserves the blocks, so that never happens).
// Launch: grid = ceil(seqs / 128), block = 128.
extern "C" __global__ void __launch_bounds__(128) spec_cycle_step_rows(const int* __restrict__ accepted,
                                                                      int* __restrict__ positions,
                                                                      int* __restrict__ ctx_len,
                                                                      long long* __restrict__ slot_mapping,
                                                                      const int* __restrict__ block_tables,
                                                                      int max_blocks, int block_size, int seqs) {
    PDL_ENTRY();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= seqs) return;
    const int pos = positions[s] + accepted[s];
    positions[s] = pos;
    ctx_len[s] = pos + 1;
    const int b = pos / block_size;
    slot_mapping[s] = b < max_blocks ? (long long)block_tables[s * max_blocks + b] * block_size + pos % block_size : -1;
}
