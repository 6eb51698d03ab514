// Sparse-MoE family (docs/qwen3_5_moe.md §2.7): router top-k, token→expert grouping, expert SwiGLU (GEMV for
// decode/verify, tensor-core grouped GEMM for prefill), weighted combine with the gated shared expert.
//
// Layouts (checkpoint layout, y = x · Wᵀ):
//   gate_up [E, 2I, H] bf16: rows 0..I of expert e are the gate projection, rows I..2I the up projection.
//   down    [E, H, I]  bf16.
//   An "assignment" is a = t*k + j (token t, its j-th choice); h and expert_out are indexed by a.
//
// Pipeline per MoE layer (T tokens, k = top_k):
//   moe_topk_f32          logits f32 [T, ld>=E] → topk_ids i32 [T*k], topk_w f32 [T*k]
//   moe_group_i32         topk_ids → counts [E], offsets [E+1], assign_sorted [T*k], active [E],
//                         meta [2] = {active experts, GEMM tiles}, tiles [2*max_tiles] = (expert, first row)
//   experts, small T:     moe_gate_up_gemv_* → h bf16 [T*k, I];  moe_down_gemv_* → expert_out bf16 [T*k, H]
//   experts, large T:     moe_gate_up_gemm_bf16, moe_down_gemm_bf16 (same outputs, mma.sync m16n8k16)
//   moe_combine_bf16      out[t] (+)= Σ_j w[t,j]·expert_out[t*k+j] + σ(gate_logit[t])·shared[t]
//
// Everything launched after the router reads the routing from device memory (meta, active, tiles), so
// the host never synchronises; grids are sized by host-known upper bounds and surplus blocks exit.
#include "common.cuh"

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------------
// Small device helpers (local to this family).

// 16-byte global load that does not allocate in L1 (weights are streamed once; L2 still caches them).
__device__ __forceinline__ uint4 ldg_stream(const bf16* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
    const bf16x8 b = *reinterpret_cast<const bf16x8*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(b.h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ float dot8(const float (&a)[8], const float (&b)[8]) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = fmaf(a[i], b[i], s);
    return s;
}

// Sum N (a power of two ≤ 32) per-lane values across the warp with N - 1 + (5 - log2 N) shuffles
// (instead of 5 N): a butterfly reduce-scatter. Afterwards v[0] of lane L holds the warp-wide sum of
// entry scatter_index<N>(L); lanes with scatter_canonical<N>(L) hold each entry exactly once.
template <int N, int S>
struct ReduceScatterStep {
    static __device__ __forceinline__ void run(float (&v)[N], int lane) {
        constexpr int o = 16 >> S, half = (N >> S) >> 1;
        if constexpr (half >= 1) {
            const bool hi = (lane & o) != 0;
#pragma unroll
            for (int i = 0; i < half; ++i) {
                const float send = hi ? v[i] : v[i + half];
                const float keep = hi ? v[i + half] : v[i];
                v[i] = keep + __shfl_xor_sync(FULL_MASK, send, o);
            }
        } else {
            v[0] += __shfl_xor_sync(FULL_MASK, v[0], o);
        }
        if constexpr (S < 4) ReduceScatterStep<N, S + 1>::run(v, lane);
    }
};

template <int N>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[N], int lane) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N must be a power of two <= 32");
    ReduceScatterStep<N, 0>::run(v, lane);
}

template <int N>
__device__ __forceinline__ int scatter_index(int lane) {
    int idx = 0;
#pragma unroll
    for (int s = 0; s < 5; ++s) {
        const int half = (N >> s) >> 1;
        if (half >= 1 && (lane & (16 >> s))) idx += half;
    }
    return idx;
}

template <int N>
__device__ __forceinline__ bool scatter_canonical(int lane) {
    return (lane & (32 / N - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------------
// 1. moe_topk_f32: per token row, p = softmax(logits[0..E)) in fp32, pick the k largest (ties: lower
//    expert index first; selection is on the logits, which orders exactly like p), output sorted by
//    descending p. renorm: w_j = p_j / Σ_sel p (qwen3_5_moe always; qwen3_moe when norm_topk_prob).
//    The logits row stride `ld` ≥ E lets the caller fuse the shared-expert gate as an extra column.
//    Bytes: reads T*E*4, writes T*k*8. Launch: grid = ceil(T/4), block = 128 (one warp per row).
//    Limits: E ≤ 512, k ≤ min(16, E).

#define TOPK_MAX_PER_LANE 16  // E ≤ 32 * 16 = 512

struct TopkParams {
    const float* logits;  // [T, ld]
    int* ids;             // [T, k]
    float* weights;       // [T, k]
    int tokens, experts, k, ld, renorm;
};

// One token row's top-k, by one whole warp.
__device__ __forceinline__ void topk_row(const TopkParams& p, int row) {
    const int lane = threadIdx.x & 31;
    const float* lr = p.logits + (size_t)row * p.ld;
    const int E = p.experts;

    float v[TOPK_MAX_PER_LANE];
    unsigned taken = 0;  // bit c: entry c*32+lane is unavailable (chosen, or past E)
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < TOPK_MAX_PER_LANE; ++c) {
        const int e = c * 32 + lane;
        v[c] = e < E ? lr[e] : -INFINITY;
        if (e >= E) taken |= 1u << c;
        mx = fmaxf(mx, v[c]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < TOPK_MAX_PER_LANE; ++c)
        if (c * 32 + lane < E) sum += __expf(v[c] - mx);
    sum = warp_sum(sum);

    int my_id = 0;
    float my_logit = -INFINITY;
    for (int j = 0; j < p.k; ++j) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
#pragma unroll
        for (int c = 0; c < TOPK_MAX_PER_LANE; ++c) {
            // Ascending c = ascending index: a strict '>' keeps the lower index on a tie.
            if (!((taken >> c) & 1u) && (bi == 0x7fffffff || v[c] > bv)) {
                bv = v[c];
                bi = c * 32 + lane;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == (bi & 31)) taken |= 1u << (bi >> 5);
        if (lane == j) {
            my_id = bi;
            my_logit = bv;
        }
    }
    float w = lane < p.k ? __expf(my_logit - mx) / sum : 0.f;
    if (p.renorm) w = w / warp_sum(w);
    if (lane < p.k) {
        p.ids[(size_t)row * p.k + lane] = my_id;
        p.weights[(size_t)row * p.k + lane] = w;
    }
}

extern "C" __global__ void __launch_bounds__(128) moe_topk_f32(TopkParams p) {
    PDL_ENTRY();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= p.tokens) return;  // whole warp exits together
    topk_row(p, row);
}

// ---------------------------------------------------------------------------------------------------
// 2. moe_group_i32: stable counting sort of the n = T*k assignments by expert, in one block.
//    Each of W warps owns a contiguous segment of assignments: pass A builds per-warp histograms in
//    shared memory; warp 0 scans them into expert offsets (plus the active-expert list and the GEMM
//    tile list); pass B places each assignment at offsets[e] + (earlier warps' count for e) + (its
//    rank among equal experts in this warp step, via __match_any_sync), so the order within an
//    expert is increasing assignment index (hence increasing token).
//    Outputs: counts [E], offsets [E+1], assign_sorted [n], active [E] (expert ids with count > 0 in
//    increasing order, then -1), meta[0] = active count, meta[1] = tile count, tiles[2i..2i+1] =
//    (expert, first sorted row) of GEMM row tile i (tile_m rows, never crossing experts).
//    Ids outside [0, E) are dropped (not counted, not placed).
//    Bytes: reads n*4 twice, writes n*4 + O(E). Launch: grid = 1, block = 32*W with
//    W = min(32, ceil(n/32), (12288 - E - 1) / E) ≥ 1, dynamic smem (W*E + E + 1) * 4 bytes.

struct GroupParams {
    const int* ids;  // [n]
    int* counts;     // [E]
    int* offsets;    // [E+1]
    int* assign_sorted;
    int* active;  // [E]
    int* meta;    // [2]
    int* tiles;   // [2*max_tiles]
    int n, experts, tile_m, max_tiles;
};

__device__ __forceinline__ void group_block(const GroupParams& p) {
    extern __shared__ int gsm[];
    const int E = p.experts, W = blockDim.x >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* hist = gsm;          // [W][E]: per-warp counts, then per-warp write cursors
    int* off = gsm + W * E;   // [E+1]: totals, then exclusive offsets

    for (int i = threadIdx.x; i < W * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();

    const int seg = (p.n + W - 1) / W;
    const int beg = min(p.n, warp * seg), end = min(p.n, beg + seg);
    int* my_hist = hist + warp * E;

    // Pass A: per-warp histograms (4 loads in flight per lane).
    for (int i0 = beg; i0 < end; i0 += 128) {
        int ev[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 32 + lane;
            ev[u] = i < end ? p.ids[i] : -1;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (ev[u] >= 0 && ev[u] < E) atomicAdd(&my_hist[ev[u]], 1);
    }
    __syncthreads();

    // Per expert: total, and each warp's exclusive prefix over earlier warps.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int s = 0;
        for (int w = 0; w < W; ++w) {
            const int c = hist[w * E + e];
            hist[w * E + e] = s;
            s += c;
        }
        off[e] = s;
    }
    __syncthreads();

    // Warp 0: exclusive scans over experts of (count, active flag, GEMM tiles); write the small outputs.
    if (warp == 0) {
        const int chunk = (E + 31) / 32;
        const int lo = min(E, lane * chunk), hi = min(E, lo + chunk);
        int sc = 0, sa = 0, st = 0;
        for (int e = lo; e < hi; ++e) {
            const int c = off[e];
            sc += c;
            sa += c > 0;
            st += (c + p.tile_m - 1) / p.tile_m;
        }
        int ic = sc, ia = sa, it = st;  // inclusive scans
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(FULL_MASK, ic, o);
            const int b = __shfl_up_sync(FULL_MASK, ia, o);
            const int c = __shfl_up_sync(FULL_MASK, it, o);
            if (lane >= o) {
                ic += a;
                ia += b;
                it += c;
            }
        }
        int rc = ic - sc, ra = ia - sa, rt = it - st;  // exclusive starts of this lane's experts
        for (int e = lo; e < hi; ++e) {
            const int c = off[e];
            p.counts[e] = c;
            p.offsets[e] = rc;
            off[e] = rc;
            if (c > 0) p.active[ra++] = e;
            for (int r = 0; r < c; r += p.tile_m) {
                if (rt < p.max_tiles) {
                    p.tiles[2 * rt] = e;
                    p.tiles[2 * rt + 1] = rc + r;
                }
                ++rt;
            }
            rc += c;
        }
        const int total = __shfl_sync(FULL_MASK, ic, 31);
        const int n_active = __shfl_sync(FULL_MASK, ia, 31);
        const int n_tiles = __shfl_sync(FULL_MASK, it, 31);
        for (int s = n_active + lane; s < E; s += 32) p.active[s] = -1;
        if (lane == 0) {
            p.offsets[E] = total;
            p.meta[0] = n_active;
            p.meta[1] = min(n_tiles, p.max_tiles);
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < W * E; i += blockDim.x) hist[i] += off[i % E];
    __syncthreads();

    // Pass B: stable placement. my_hist[e] is this warp's next free slot for expert e.
    const unsigned lt_mask = (1u << lane) - 1u;
    for (int i0 = beg; i0 < end; i0 += 128) {
        int ev[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * 32 + lane;
            const int e = i < end ? p.ids[i] : -1;
            ev[u] = (e >= 0 && e < E) ? e : -1;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int e = ev[u];
            const unsigned same = __match_any_sync(FULL_MASK, e);
            const int rank = __popc(same & lt_mask);
            int base = 0;
            if (e >= 0) base = my_hist[e];
            __syncwarp();
            if (e >= 0) {
                p.assign_sorted[base + rank] = i0 + u * 32 + lane;
                if (rank == 0) my_hist[e] = base + __popc(same);
            }
            __syncwarp();
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) moe_group_i32(GroupParams p) {
    PDL_ENTRY();
    group_block(p);
}

// 3. moe_route_i32: 1 and 2 in one launch for decode and verify (tokens ≤ ROUTE_FUSED_MAX_TOKENS): one block
//    of moe_group_i32's shape; its warps take the token rows' top-k in turn (as moe_topk_f32 computes them),
//    then, after the barrier that makes the block's global writes visible to it, group them as
//    moe_group_i32 does. Same outputs bit for bit; one launch instead of two.
extern "C" __global__ void __launch_bounds__(1024) moe_route_i32(TopkParams tp, GroupParams gp) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    for (int row = warp; row < tp.tokens; row += W) topk_row(tp, row);
    __syncthreads();
    group_block(gp);
}

// ---------------------------------------------------------------------------------------------------
// 3. Expert SwiGLU for small token counts (decode / verify): weight-streaming GEMV.
//
// moe_gate_up_gemv_m{1,2,4,8}_bf16: block (row tile, active expert slot). The block stages the x rows
//    of up to MT tokens routed to its expert in shared memory (tokens > MT: further passes, the weight
//    tile then comes from L2), then each warp streams one gate row i and the matching up row I+i
//    (16-byte non-L1-allocating loads, 2*U vectors per lane in flight, double-buffered) and produces
//    h[a, i] = silu(x_a·Wg[i]) * (x_a·Wu[i]) for every assignment a of the expert.
//    Bytes: every active expert's gate_up once (2*I*H*2) + x per block from L2 + h writes (n*I*2).
//    Decode at the real shape: 8 experts x 1024 x 2048 x 2 B = 32 MiB per layer.
//    Launch: grid = (ceil(I/8), min(E, n)), block = 256 (8 warps, one (gate, up) row pair each),
//    dynamic smem MT*H*2 bytes. Requires H % 8 == 0 (the _scalar_ variant takes any H).
// moe_down_gemv_m{1,2,4,8}_bf16: same scheme over down[e] [H, I]: the block stages h rows of its
//    expert's assignments, each warp streams R = 4 output rows, expert_out[a, r] = h_a · down[e][r].
//    Bytes: active experts x H*I*2 (decode: 8 x 2048 x 512 x 2 B = 16 MiB) + n*H*2 writes.
//    Launch: grid = (ceil(H/32), min(E, n)), block = 256, dynamic smem MT*I*2. Requires I % 8 == 0.

struct GemvParams {
    const bf16* act;  // gate_up: x [T, K]; down: h [n, K]
    const bf16* w;    // gate_up: [E, 2*N, K]; down: [E, N, K]
    bf16* out;        // gate_up: h [n, N]; down: expert_out [n, N]
    const int* assign_sorted;
    const int* offsets;
    const int* active;
    const int* meta;
    int K;       // reduction length (gate_up: H; down: I)
    int N;       // output columns (gate_up: I; down: H)
    int act_div; // act row = assignment / act_div (gate_up: top_k; down: 1)
};

#define GEMV_WARPS 8
#define GU_U 4   // gate_up: vectors per lane per row per step
#define DN_R 4   // down: rows per warp
#define DN_U 2   // down: vectors per lane per row per step

// Stage the act rows of assignments [first, first+mt) of this expert as MT rows of K in shared memory,
// zero rows past mt. K % 8 == 0.
template <int MT>
__device__ __forceinline__ void stage_rows_vec(bf16* xs, const GemvParams& p, int first, int mt) {
    const int nv = p.K >> 3;
    for (int idx = threadIdx.x; idx < MT * nv; idx += blockDim.x) {
        const int t = idx / nv, v = idx - t * nv;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (t < mt) {
            const int row = p.assign_sorted[first + t] / p.act_div;
            val = *reinterpret_cast<const uint4*>(p.act + (size_t)row * p.K + v * 8);
        }
        *reinterpret_cast<uint4*>(xs + t * p.K + v * 8) = val;
    }
}

template <int MT>
__device__ __forceinline__ void gate_up_gemv(const GemvParams& p) {
    if ((int)blockIdx.y >= p.meta[0]) return;
    const int e = p.active[blockIdx.y];
    const int beg = p.offsets[e], cnt = p.offsets[e + 1] - beg;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int i = blockIdx.x * GEMV_WARPS + warp;  // intermediate index (gate row i, up row N+i)
    const bool row_ok = i < p.N;
    const int K = p.K, nv = K >> 3;
    const bf16* wg = p.w + ((size_t)e * 2 * p.N + (row_ok ? i : 0)) * K;
    const bf16* wu = wg + (size_t)p.N * K;
    extern __shared__ uint4 gemv_smem[];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);

    for (int pass = 0; pass < cnt; pass += MT) {
        const int mt = min(MT, cnt - pass);
        uint4 g[GU_U], u[GU_U];
        // First weight vectors go out before the activation staging so both latencies overlap.
#pragma unroll
        for (int j = 0; j < GU_U; ++j) {
            const int v = lane + 32 * j;
            const bool ok = row_ok && v < nv;
            g[j] = ok ? ldg_stream(wg + v * 8) : make_uint4(0, 0, 0, 0);
            u[j] = ok ? ldg_stream(wu + v * 8) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();  // the previous pass is done reading xs
        stage_rows_vec<MT>(xs, p, beg + pass, mt);
        __syncthreads();
        if (!row_ok) continue;

        float acc[2 * MT];  // [gate t=0..MT-1, up t=0..MT-1]
#pragma unroll
        for (int t = 0; t < 2 * MT; ++t) acc[t] = 0.f;
        for (int v0 = lane; v0 < nv; v0 += 32 * GU_U) {
            uint4 gn[GU_U], un[GU_U];
#pragma unroll
            for (int j = 0; j < GU_U; ++j) {
                const int v = v0 + 32 * (GU_U + j);
                const bool ok = v < nv;
                gn[j] = ok ? ldg_stream(wg + v * 8) : make_uint4(0, 0, 0, 0);
                un[j] = ok ? ldg_stream(wu + v * 8) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int j = 0; j < GU_U; ++j) {
                const int v = v0 + 32 * j;
                if (v < nv) {
                    float gf[8], uf[8];
                    unpack8(g[j], gf);
                    unpack8(u[j], uf);
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        float xf[8];
                        unpack8(*reinterpret_cast<const uint4*>(xs + t * K + v * 8), xf);
                        acc[t] += dot8(gf, xf);
                        acc[MT + t] += dot8(uf, xf);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < GU_U; ++j) {
                g[j] = gn[j];
                u[j] = un[j];
            }
        }
        warp_reduce_scatter<2 * MT>(acc, lane);
        const float partner = __shfl_xor_sync(FULL_MASK, acc[0], 16);  // lane^16 holds up for the same t
        const int t = scatter_index<2 * MT>(lane);
        if (!(lane & 16) && scatter_canonical<2 * MT>(lane) && t < mt) {
            const int a = p.assign_sorted[beg + pass + t];
            p.out[(size_t)a * p.N + i] = f2bf(silu(acc[0]) * partner);
        }
    }
}

template <int MT>
__device__ __forceinline__ void down_gemv(const GemvParams& p) {
    if ((int)blockIdx.y >= p.meta[0]) return;
    const int e = p.active[blockIdx.y];
    const int beg = p.offsets[e], cnt = p.offsets[e + 1] - beg;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * DN_R;  // first output row of this warp
    const int K = p.K, nv = K >> 3;
    const bf16* wr[DN_R];
    bool rok[DN_R];
#pragma unroll
    for (int r = 0; r < DN_R; ++r) {
        rok[r] = r0 + r < p.N;
        wr[r] = p.w + ((size_t)e * p.N + (rok[r] ? r0 + r : 0)) * K;
    }
    extern __shared__ uint4 gemv_smem[];
    bf16* hs = reinterpret_cast<bf16*>(gemv_smem);

    for (int pass = 0; pass < cnt; pass += MT) {
        const int mt = min(MT, cnt - pass);
        uint4 wv[DN_R][DN_U];
#pragma unroll
        for (int r = 0; r < DN_R; ++r)
#pragma unroll
            for (int j = 0; j < DN_U; ++j) {
                const int v = lane + 32 * j;
                wv[r][j] = (rok[r] && v < nv) ? ldg_stream(wr[r] + v * 8) : make_uint4(0, 0, 0, 0);
            }
        __syncthreads();
        stage_rows_vec<MT>(hs, p, beg + pass, mt);
        __syncthreads();
        if (!rok[0]) continue;

        float acc[DN_R * MT];  // [row r][token t]
#pragma unroll
        for (int q = 0; q < DN_R * MT; ++q) acc[q] = 0.f;
        for (int v0 = lane; v0 < nv; v0 += 32 * DN_U) {
            uint4 wn[DN_R][DN_U];
#pragma unroll
            for (int r = 0; r < DN_R; ++r)
#pragma unroll
                for (int j = 0; j < DN_U; ++j) {
                    const int v = v0 + 32 * (DN_U + j);
                    wn[r][j] = (rok[r] && v < nv) ? ldg_stream(wr[r] + v * 8) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int j = 0; j < DN_U; ++j) {
                const int v = v0 + 32 * j;
                if (v < nv) {
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        float hf[8];
                        unpack8(*reinterpret_cast<const uint4*>(hs + t * K + v * 8), hf);
#pragma unroll
                        for (int r = 0; r < DN_R; ++r) {
                            float wf[8];
                            unpack8(wv[r][j], wf);
                            acc[r * MT + t] += dot8(wf, hf);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < DN_R; ++r)
#pragma unroll
                for (int j = 0; j < DN_U; ++j) wv[r][j] = wn[r][j];
        }
        warp_reduce_scatter<DN_R * MT>(acc, lane);
        const int q = scatter_index<DN_R * MT>(lane);
        const int r = q / MT, t = q - r * MT;
        if (scatter_canonical<DN_R * MT>(lane) && t < mt && r0 + r < p.N) {
            const int a = p.assign_sorted[beg + pass + t];
            p.out[(size_t)a * p.N + r0 + r] = f2bf(acc[0]);
        }
    }
}

#define GEMV_ENTRY(MT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_gemv_m##MT##_bf16(GemvParams p) { PDL_ENTRY();     \
        gate_up_gemv<MT>(p);                                                                            \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) moe_down_gemv_m##MT##_bf16(GemvParams p) { PDL_ENTRY();        \
        down_gemv<MT>(p);                                                                               \
    }
GEMV_ENTRY(1)
GEMV_ENTRY(2)
GEMV_ENTRY(4)
GEMV_ENTRY(8)

// moe_route_gate_up_gemv_m{1,2,4,8}_bf16 (T ≤ RG_MAX_TOKENS tokens, K % 8 == 0): moe_route_i32 and the gate/up
//    GEMV in one launch. Every block routes the T rows itself: warp t takes row t's top-k (topk_row, as
//    moe_topk_f32), then the T*k choices are grouped by expert in shared memory (counts, their prefix sum, the
//    active experts in increasing order, assignments by increasing index within an expert: moe_group_i32's
//    order), and the block runs gate_up_gemv on that grouping. Block (0, 0) also stores topk_ids / topk_w,
//    which moe_down_combine_bf16 reads; the grouping arrays in global memory are not written. h equals
//    moe_route_i32 + moe_gate_up_gemv_m*_bf16's bit for bit. Extra cost per block: T router rows from L2
//    (T*E*4 bytes) and a few hundred cycles of grouping, instead of a launch.
//    Launch: as moe_gate_up_gemv_m*_bf16 (grid (ceil(I/8), min(E, T*k)), block 256, smem MT*H*2);
//    E ≤ RG_MAX_EXPERTS, k ≤ 16.
#define RG_MAX_TOKENS 8
#define RG_MAX_EXPERTS 512
#define RG_MAX_ASSIGN (RG_MAX_TOKENS * 16)

template <int MT>
__device__ __forceinline__ void route_gate_up_gemv(GemvParams p, TopkParams tp) {
    __shared__ int s_ids[RG_MAX_ASSIGN];
    __shared__ float s_w[RG_MAX_ASSIGN];
    __shared__ int s_off[RG_MAX_EXPERTS + 1];
    __shared__ int s_active[RG_MAX_EXPERTS];
    __shared__ int s_sorted[RG_MAX_ASSIGN];
    __shared__ int s_meta[2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int E = tp.experts, n = tp.tokens * tp.k;

    // 1. Top-k of each token row into shared memory.
    TopkParams lp = tp;
    lp.ids = s_ids;
    lp.weights = s_w;
    if (warp < tp.tokens) topk_row(lp, warp);
    for (int e = threadIdx.x; e <= E; e += blockDim.x) s_off[e] = 0;
    __syncthreads();
    // 2. Counts per expert (in s_off[e + 1]), then their prefix sum and the active list by one warp.
    if ((int)threadIdx.x < n) atomicAdd(&s_off[s_ids[threadIdx.x] + 1], 1);
    __syncthreads();
    if (warp == 0) {
        int total = 0, actives = 0;
        for (int c = 0; c < E; c += 32) {
            const int e = c + lane;
            const int cnt = e < E ? s_off[e + 1] : 0;
            int incl = cnt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int up = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += up;
            }
            if (e < E) s_off[e + 1] = total + incl;
            const unsigned has = __ballot_sync(FULL_MASK, cnt > 0);
            if (cnt > 0) s_active[actives + __popc(has & ((1u << lane) - 1u))] = e;
            total += __shfl_sync(FULL_MASK, incl, 31);
            actives += __popc(has);
        }
        if (lane == 0) {
            s_meta[0] = actives;
            s_meta[1] = 0;
        }
    }
    __syncthreads();
    // 3. Each assignment's place: its expert's offset + the earlier assignments of that expert.
    if ((int)threadIdx.x < n) {
        const int a = threadIdx.x, e = s_ids[a];
        int rank = 0;
        for (int b = 0; b < a; ++b) rank += s_ids[b] == e;
        s_sorted[s_off[e] + rank] = a;
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && (int)threadIdx.x < n) {
        tp.ids[threadIdx.x] = s_ids[threadIdx.x];
        tp.weights[threadIdx.x] = s_w[threadIdx.x];
    }
    __syncthreads();
    GemvParams q = p;
    q.assign_sorted = s_sorted;
    q.offsets = s_off;
    q.active = s_active;
    q.meta = s_meta;
    gate_up_gemv<MT>(q);
}

#define ROUTE_GEMV_ENTRY(MT)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) moe_route_gate_up_gemv_m##MT##_bf16(GemvParams p, TopkParams tp) { PDL_ENTRY(); \
        route_gate_up_gemv<MT>(p, tp);                                                                            \
    }
ROUTE_GEMV_ENTRY(1)
ROUTE_GEMV_ENTRY(2)
ROUTE_GEMV_ENTRY(4)
ROUTE_GEMV_ENTRY(8)

// Any K (no alignment): scalar loads, 4 tokens per pass, plain warp sums. Same grids and outputs as
// the vector variants (gate_up: one row pair per warp; down: DN_R rows per warp), smem 4*K*2 bytes.
#define SCALAR_MT 4

__device__ __forceinline__ void stage_rows_scalar(bf16* xs, const GemvParams& p, int first, int mt) {
    for (int idx = threadIdx.x; idx < SCALAR_MT * p.K; idx += blockDim.x) {
        const int t = idx / p.K, c = idx - t * p.K;
        bf16 val = f2bf(0.f);
        if (t < mt) val = p.act[(size_t)(p.assign_sorted[first + t] / p.act_div) * p.K + c];
        xs[idx] = val;
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_gate_up_gemv_scalar_bf16(GemvParams p) {
    PDL_ENTRY();
    if ((int)blockIdx.y >= p.meta[0]) return;
    const int e = p.active[blockIdx.y];
    const int beg = p.offsets[e], cnt = p.offsets[e + 1] - beg;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int i = blockIdx.x * GEMV_WARPS + warp;
    const bool row_ok = i < p.N;
    const bf16* wg = p.w + ((size_t)e * 2 * p.N + (row_ok ? i : 0)) * p.K;
    const bf16* wu = wg + (size_t)p.N * p.K;
    extern __shared__ uint4 gemv_smem[];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    for (int pass = 0; pass < cnt; pass += SCALAR_MT) {
        const int mt = min(SCALAR_MT, cnt - pass);
        __syncthreads();
        stage_rows_scalar(xs, p, beg + pass, mt);
        __syncthreads();
        if (!row_ok) continue;
        float ag[SCALAR_MT] = {0.f, 0.f, 0.f, 0.f}, au[SCALAR_MT] = {0.f, 0.f, 0.f, 0.f};
        for (int c = lane; c < p.K; c += 32) {
            const float gw = bf2f(wg[c]), uw = bf2f(wu[c]);
#pragma unroll
            for (int t = 0; t < SCALAR_MT; ++t) {
                const float xv = bf2f(xs[t * p.K + c]);
                ag[t] = fmaf(gw, xv, ag[t]);
                au[t] = fmaf(uw, xv, au[t]);
            }
        }
#pragma unroll
        for (int t = 0; t < SCALAR_MT; ++t) {
            const float gs = warp_sum(ag[t]), us = warp_sum(au[t]);
            if (lane == 0 && t < mt) {
                const int a = p.assign_sorted[beg + pass + t];
                p.out[(size_t)a * p.N + i] = f2bf(silu(gs) * us);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down_gemv_scalar_bf16(GemvParams p) {
    PDL_ENTRY();
    if ((int)blockIdx.y >= p.meta[0]) return;
    const int e = p.active[blockIdx.y];
    const int beg = p.offsets[e], cnt = p.offsets[e + 1] - beg;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * GEMV_WARPS + warp) * DN_R;
    extern __shared__ uint4 gemv_smem[];
    bf16* hs = reinterpret_cast<bf16*>(gemv_smem);
    for (int pass = 0; pass < cnt; pass += SCALAR_MT) {
        const int mt = min(SCALAR_MT, cnt - pass);
        __syncthreads();
        stage_rows_scalar(hs, p, beg + pass, mt);
        __syncthreads();
        for (int r = 0; r < DN_R; ++r) {
            const int row = r0 + r;
            if (row >= p.N) break;  // warp-uniform
            const bf16* wr = p.w + ((size_t)e * p.N + row) * p.K;
            float acc[SCALAR_MT] = {0.f, 0.f, 0.f, 0.f};
            for (int c = lane; c < p.K; c += 32) {
                const float wv = bf2f(wr[c]);
#pragma unroll
                for (int t = 0; t < SCALAR_MT; ++t) acc[t] = fmaf(wv, bf2f(hs[t * p.K + c]), acc[t]);
            }
#pragma unroll
            for (int t = 0; t < SCALAR_MT; ++t) {
                const float s = warp_sum(acc[t]);
                if (lane == 0 && t < mt) {
                    const int a = p.assign_sorted[beg + pass + t];
                    p.out[(size_t)a * p.N + row] = f2bf(s);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// 4. Grouped GEMM for prefill (mma.sync m16n8k16 bf16 → fp32, ldmatrix, 3-stage cp.async pipeline).
//
// One block per (output column tile, row tile of the group list). Row tile i (from moe_group_i32,
// GM_BM = 64 sorted rows of one expert e) gathers its A rows (gate_up: x[assign/k]; down: h[assign]),
// multiplies by expert e's weight rows and writes rows assign of the output.
// moe_gate_up_gemm_bf16: B tile = 64 gate rows n0.. and the 64 matching up rows N+n0..; the epilogue
//    writes h[a, n0..n0+64) = silu(gate) * up. grid = (ceil(I/64), max_tiles).
// moe_down_gemm_bf16: B tile = 128 rows of down[e]; writes expert_out[a, n0..n0+128). grid =
//    (ceil(H/128), max_tiles).
// Block = 128 threads (2x2 warps, each 32 rows x 64 B-rows: 2 m16 x 8 n8 mma tiles), BK = 32,
// smem rows padded to 40 elements (80 B: ldmatrix conflict-free), 45 KiB static smem.
// FLOPs: 2 * rows * K * N_total. Requires K % 8 == 0 and N % 8 == 0 (16-byte cp.async).
// Blocks whose tile index ≥ meta[1] exit.

#define GM_BM 64
#define GM_BN 128
#define GM_BK 32
#define GM_LDS 40
#define GM_STAGES 3

struct GemmParams {
    const bf16* act;  // gate_up: x [T, K]; down: h [n, K]
    const bf16* w;    // gate_up: [E, 2N, K]; down: [E, N, K]
    bf16* out;        // [n, N]
    const int* assign_sorted;
    const int* offsets;
    const int* tiles;
    const int* meta;
    int K, N, act_div;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool GATED>
__device__ __forceinline__ void grouped_gemm(const GemmParams& p) {
    if ((int)blockIdx.y >= p.meta[1]) return;
    const int e = p.tiles[2 * blockIdx.y], r0 = p.tiles[2 * blockIdx.y + 1];
    const int rows = min(GM_BM, p.offsets[e + 1] - r0);
    const int n0 = blockIdx.x * (GATED ? GM_BN / 2 : GM_BN);  // first output column
    const int K = p.K, N = p.N;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1;

    __shared__ __align__(16) bf16 As[GM_STAGES][GM_BM][GM_LDS];
    __shared__ __align__(16) bf16 Bs[GM_STAGES][GM_BN][GM_LDS];

    // Loader assignment: 16-byte chunk c → row c/4, k offset (c%4)*8. A: 2 chunks/thread, B: 4.
    const int kc = (tid & 3) * 8;
    const bf16* a_src[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = (tid >> 2) + 32 * j;
        a_src[j] = row < rows ? p.act + (size_t)(p.assign_sorted[r0 + row] / p.act_div) * K : nullptr;
    }
    const bf16* b_src[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int row = (tid >> 2) + 32 * j;  // 0..127
        int col, wrow;
        if (GATED) {
            col = n0 + (row & 63);
            wrow = row < 64 ? col : N + col;
        } else {
            col = n0 + row;
            wrow = col;
        }
        const size_t rows_per_expert = GATED ? 2 * (size_t)N : (size_t)N;
        b_src[j] = col < N ? p.w + ((size_t)e * rows_per_expert + wrow) * K : nullptr;
    }
    auto load_stage = [&](int s, int k0) {
        const int k = k0 + kc;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool ok = a_src[j] != nullptr && k < K;
            cp_async16(&As[s][(tid >> 2) + 32 * j][kc], ok ? a_src[j] + k : p.act, ok ? 16 : 0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool ok = b_src[j] != nullptr && k < K;
            cp_async16(&Bs[s][(tid >> 2) + 32 * j][kc], ok ? b_src[j] + k : p.w, ok ? 16 : 0);
        }
    };

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;

    const int nk = (K + GM_BK - 1) / GM_BK;
#pragma unroll
    for (int s = 0; s < GM_STAGES - 1; ++s) {
        if (s < nk) load_stage(s, s * GM_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<GM_STAGES - 2>();
        __syncthreads();
        const int nxt = kt + GM_STAGES - 1;
        if (nxt < nk) load_stage(nxt % GM_STAGES, nxt * GM_BK);
        cp_async_commit();

        const int s = kt % GM_STAGES;
#pragma unroll
        for (int kk = 0; kk < GM_BK; kk += 16) {
            unsigned af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                ldmatrix_x4(af[mi], &As[s][wm * 32 + mi * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
            unsigned bf[8][2];
#pragma unroll
            for (int pr = 0; pr < 4; ++pr) {
                // B rows of n8-tile pair pr: gated → gate rows wn*32 + pr*16 (pr<2) / up rows 64 + ...;
                // plain → wn*64 + pr*16.
                const int brow = GATED ? (pr < 2 ? wn * 32 + pr * 16 : 64 + wn * 32 + (pr - 2) * 16)
                                       : wn * 64 + pr * 16;
                unsigned r[4];
                ldmatrix_x4(r, &Bs[s][brow + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
                bf[2 * pr][0] = r[0];
                bf[2 * pr][1] = r[1];
                bf[2 * pr + 1][0] = r[2];
                bf[2 * pr + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
        }
    }
    cp_async_wait<0>();

    // Epilogue. Accumulator (mi, ni, q): row wm*32 + mi*16 + lane/4 + 8*(q/2), B-col 8*ni + 2*(lane%4) + q%2.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int row = wm * 32 + mi * 16 + (lane >> 2) + 8 * hf;
            if (row >= rows) continue;
            const int a = p.assign_sorted[r0 + row];
            bf16* orow = p.out + (size_t)a * N;
            if (GATED) {
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
                    if (col < N) {
                        const float h0 = silu(acc[mi][ni][2 * hf]) * acc[mi][ni + 4][2 * hf];
                        const float h1 = silu(acc[mi][ni][2 * hf + 1]) * acc[mi][ni + 4][2 * hf + 1];
                        *reinterpret_cast<__nv_bfloat162*>(orow + col) = __floats2bfloat162_rn(h0, h1);
                    }
                }
            } else {
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) {
                    const int col = n0 + wn * 64 + ni * 8 + (lane & 3) * 2;
                    if (col < N)
                        *reinterpret_cast<__nv_bfloat162*>(orow + col) =
                            __floats2bfloat162_rn(acc[mi][ni][2 * hf], acc[mi][ni][2 * hf + 1]);
                }
            }
        }
}

extern "C" __global__ void __launch_bounds__(128) moe_gate_up_gemm_bf16(GemmParams p) {
    PDL_ENTRY();
    grouped_gemm<true>(p);
}
extern "C" __global__ void __launch_bounds__(128) moe_down_gemm_bf16(GemmParams p) {
    PDL_ENTRY();
    grouped_gemm<false>(p);
}

// ---------------------------------------------------------------------------------------------------
// 5. moe_combine_bf16: out[t] = Σ_j w[t*k+j] * expert_out[t*k+j] (+ sigmoid(gate[t*gate_ld]) * shared[t])
//    in fp32, bf16 out. The shared-expert gate logit is f32 (it can be the extra column E of an
//    [T, E+1] f32 router GEMM: pass gate = logits + E, gate_ld = E+1). shared == nullptr: no shared
//    expert (qwen3_moe). Bytes: reads T*(k+1)*H*2 + T*k*4, writes T*H*2.
//    Launch: grid = (ceil(H/8 / 128), T), block = 128; H % 8 == 0 uses 16-byte vectors, else scalar.

struct CombineParams {
    const bf16* expert_out;  // [T*k, H]
    const float* weights;    // [T*k]
    const bf16* shared;      // [T, H] or null
    const float* gate;       // gate logit of token t at gate[t * gate_ld] (unused when shared is null)
    bf16* out;               // [T, H]
    int H, k, gate_ld;
    int accumulate;          // out += the sum (the residual stream) instead of out = it
};

extern "C" __global__ void __launch_bounds__(128) moe_combine_bf16(CombineParams p) {
    PDL_ENTRY();
    const int t = blockIdx.y;
    const float* wt = p.weights + (size_t)t * p.k;
    const bf16* eo = p.expert_out + (size_t)t * p.k * p.H;
    const float g = p.shared ? sigmoid(p.gate[(size_t)t * p.gate_ld]) : 0.f;
    if ((p.H & 7) == 0) {
        const int v = blockIdx.x * blockDim.x + threadIdx.x;
        if (v * 8 >= p.H) return;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        float base[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (p.accumulate) load8(p.out + (size_t)t * p.H + v * 8, base);
#pragma unroll 4
        for (int j = 0; j < p.k; ++j) {
            float x[8];
            load8(eo + (size_t)j * p.H + v * 8, x);
            const float w = wt[j];
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = fmaf(w, x[q], acc[q]);
        }
        if (p.shared) {
            float s[8];
            load8(p.shared + (size_t)t * p.H + v * 8, s);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = fmaf(g, s[q], acc[q]);
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] += base[q];
        store8(p.out + (size_t)t * p.H + v * 8, acc);
        return;
    }
    // Awkward H: each thread covers 8 consecutive columns with scalar accesses.
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    for (int c = c0; c < min(c0 + 8, p.H); ++c) {
        float acc = 0.f;
        for (int j = 0; j < p.k; ++j) acc = fmaf(wt[j], bf2f(eo[(size_t)j * p.H + c]), acc);
        if (p.shared) acc = fmaf(g, bf2f(p.shared[(size_t)t * p.H + c]), acc);
        if (p.accumulate) acc += bf2f(p.out[(size_t)t * p.H + c]);
        p.out[(size_t)t * p.H + c] = f2bf(acc);
    }
}

// ---------------------------------------------------------------------------------------------------
// 6. moe_down_combine_bf16 (decode / verify: T ≤ 8 tokens): the routed experts' down projections, the shared
//    expert's SwiGLU and down projection, the weighted combine and the residual add, in one launch:
//      out[t, r] += Σ_j w[t,j] · bf16(h[t*k+j] · down[e_tj][r]) + σ(g_t) · bf16(s_t · shared_down[r]),
//      s_t = bf16(silu(gate_t) · up_t)  (as silu_mul_bf16 stores it)
//    summed in moe_combine_bf16's order (fp32: the k experts in order, then the shared term, then the
//    residual), so it equals moe_down_gemv + silu_mul + GEMV + moe_combine up to the order of each dot
//    product's own sum. One warp per output row r: per token it streams the k chosen experts' row r
//    (4 experts' loads in flight per lane) and the shared expert's, dots them with h / s (from L1/L2), and
//    adds the token's sum into out[t, r] (one writer per element). The k+1 down matrices are read once per
//    token (a token's experts are distinct; verify tokens sharing an expert re-read its rows from L2).
//    Bytes (decode): (k+1)*H*I*2 weights (Qwen3.6: 9 x 2 MiB) + T*(k*I + 2*Is)*2 + T*H*4.
//    Launch: grid = ceil(H / 8), block = 256 (8 warps, one row each). Requires I % 8 == 0, Is % 8 == 0,
//    I, Is ≤ 32 * 8 * DC_CHUNKS.

#define DC_CHUNKS 4     // 16-byte chunks per lane and row: rows up to 32 * 4 * 8 = 1024 wide
#define DC_GROUP 4      // experts whose loads a lane issues together
#define DC_MAX_TOKENS 8

struct DownCombineParams {
    const bf16* h;          // [T*k, I] routed SwiGLU rows (assignment t*k + j)
    const bf16* down;       // [E, H, I]
    const int* topk_ids;    // [T*k]
    const float* topk_w;    // [T*k]
    const bf16* s_gate;     // [T, Is] shared expert gate rows, or nullptr: no shared expert
    const bf16* s_up;       // [T, Is]
    const bf16* s_down;     // [H, Is]
    const float* s_logit;   // [T] shared expert gate logits
    bf16* out;              // [T, H] the residual stream (+=)
    int T, H, I, Is, k, E;
};

// One lane's share of row · vec over n (n % 8 == 0) elements: chunks lane, lane + 32, ...
__device__ __forceinline__ float dc_partial(const uint4 (&w)[DC_CHUNKS], const bf16* vec, int n, int lane) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < DC_CHUNKS; ++c) {
        const int v = lane + 32 * c;
        if (v * 8 < n) {
            float a[8], b[8];
            unpack8(w[c], a);
            unpack8(__ldg(reinterpret_cast<const uint4*>(vec) + v), b);
            s += dot8(a, b);
        }
    }
    return s;
}

__device__ __forceinline__ void dc_load_row(uint4 (&w)[DC_CHUNKS], const bf16* row, int n, int lane) {
#pragma unroll
    for (int c = 0; c < DC_CHUNKS; ++c) {
        const int v = lane + 32 * c;
        w[c] = v * 8 < n ? ldg_stream(row + (size_t)v * 8) : make_uint4(0, 0, 0, 0);
    }
}

extern "C" __global__ void __launch_bounds__(256) moe_down_combine_bf16(DownCombineParams p) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * 8 + warp;
    if (r >= p.H) return;  // warp-uniform
    const size_t I = (size_t)p.I;
    for (int t = 0; t < p.T; ++t) {
        float acc = 0.f;
        for (int j0 = 0; j0 < p.k; j0 += DC_GROUP) {
            uint4 w[DC_GROUP][DC_CHUNKS];
            int e[DC_GROUP];
#pragma unroll
            for (int q = 0; q < DC_GROUP; ++q) {
                e[q] = j0 + q < p.k ? __ldg(p.topk_ids + t * p.k + j0 + q) : -1;
                if (e[q] >= 0 && e[q] < p.E) dc_load_row(w[q], p.down + ((size_t)e[q] * p.H + r) * I, p.I, lane);
            }
#pragma unroll
            for (int q = 0; q < DC_GROUP; ++q) {
                if (j0 + q >= p.k) break;  // uniform
                float d = 0.f;
                if (e[q] >= 0 && e[q] < p.E) d = warp_sum(dc_partial(w[q], p.h + (size_t)(t * p.k + j0 + q) * I, p.I, lane));
                acc = fmaf(__ldg(p.topk_w + t * p.k + j0 + q), bf2f(f2bf(d)), acc);
            }
        }
        if (p.s_gate != nullptr) {
            uint4 w[DC_CHUNKS];
            dc_load_row(w, p.s_down + (size_t)r * p.Is, p.Is, lane);
            // The shared expert's activations, formed per chunk as silu_mul_bf16 stores them.
            float s = 0.f;
#pragma unroll
            for (int c = 0; c < DC_CHUNKS; ++c) {
                const int v = lane + 32 * c;
                if (v * 8 < p.Is) {
                    float a[8], g[8], u[8];
                    unpack8(w[c], a);
                    unpack8(__ldg(reinterpret_cast<const uint4*>(p.s_gate + (size_t)t * p.Is) + v), g);
                    unpack8(__ldg(reinterpret_cast<const uint4*>(p.s_up + (size_t)t * p.Is) + v), u);
#pragma unroll
                    for (int q = 0; q < 8; ++q) g[q] = bf2f(f2bf(silu(g[q]) * u[q]));
                    s += dot8(a, g);
                }
            }
            const float d = warp_sum(s);
            acc = fmaf(sigmoid(__ldg(p.s_logit + t)), bf2f(f2bf(d)), acc);
        }
        if (lane == 0) {
            const size_t at = (size_t)t * p.H + r;
            p.out[at] = f2bf(acc + bf2f(p.out[at]));
        }
    }
}
