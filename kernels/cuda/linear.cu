// Small-M linear layer: y[m, n] = sum_k x[m, k] * W[n, k]  (torch Linear, W bf16 [N, K] row-major, no bias),
// for M = 1..8 rows of x (decode, speculative verify). Larger M goes to cuBLAS (see src/linear.rs).
//
// Design (why tensor cores in a GEMV): at M = 8 a CUDA-core dot product costs ~140 instructions per 16 bytes
// of W (bf16->f32 converts + 8 FMAs per x row), more than the SM can issue at HBM speed. One
// mma.sync.m16n8k16 instead multiplies 16 W rows by all 8 x rows: ~1 instruction per 16 bytes of W, so the
// kernel stays memory-bound for every M <= 8 (rows M..7 of the mma are zero and cost nothing).
//
// gemv_bf16_bf16out / gemv_bf16_f32out (fast path: K % 8 == 0, 16-byte aligned x and W):
//   * A block (8 warps) owns a tile of 16 output rows at a time and splits K over its warps: warp w takes the
//     32-wide k-steps w, w+8, w+16, ...; per step each lane loads 16 bytes of W row (tile*16 + g) and 16 bytes of
//     row (tile*16 + g + 8) at k = 32*step + 8*t (g = lane/4, t = lane%4), GEMV_U steps in flight before any
//     mma. For K = 2048 a warp issues all its loads at once (16 x 16 B per lane).
//   * The k order inside an mma is a free permutation as long as A (W) and B (x) agree: the 8 contiguous
//     values a lane loads are fed as k-pairs {0,1},{2,3} to mma #0 and {4,5},{6,7} to mma #1, and the x
//     fragment is the matching 16 bytes of x row g read from shared memory, so no shuffles or ldmatrix.
//   * x (M rows) is staged once per block in shared memory (row stride padded to 32 mod 64 elements so the
//     8 rows of a quarter-warp hit disjoint banks); the grid is persistent (<= 2 blocks per SM), blocks
//     stride over tiles, so the lm_head (15520 tiles) stages x 264 times, not 15520 times.
//   * The 8 warps' partial 16x8 fp32 tiles are summed through shared memory (double-buffered: one
//     __syncthreads per tile) and 128 threads write y; each warp issues the next tile's first loads before
//     that barrier. fp32 accumulation throughout.
//   * W is streamed with ld.global.nc.L1::no_allocate (read once, do not pollute L1).
//   Bytes: N*K*2 (W, once) + M*K*2 per block (x, from L2) + M*N*(2|4) (y).
//   Launch: grid = min(ceil(N/16), SMs * blocks_per_SM), block = 256, dynamic smem = M * kp * 2 bytes.
//
// gemv_multi (the projections that read the same x: GDN qkv/z/b/a, attention q/k/v, router + shared-expert
// gate + shared gate/up): the fast kernel over up to GEMV_MAX_SEGS matrices in one launch. Their 16-row tiles
// are numbered one after another (segment s owns tiles tile0[s] ..), the persistent grid strides over all of
// them, and each tile stores into its own segment's output, bf16 or f32. One launch instead of one per
// matrix, and small matrices (b, a: 32 rows) share the grid with big ones instead of leaving SMs idle.
// The single-matrix fast kernels are this kernel with one segment. Two fusions remove the RMSNorm launches of
// a decoder layer:
//   * norm prologue (norm = 1): x is the residual stream; every block normalises the staged rows in shared
//     memory (row m: x * rsqrt(mean(x^2) + eps) * (w or 1 + w), rounded to bf16 as rmsnorm_bf16 stores it)
//     before its tiles, and block 0 also writes them to `normed` for the ops that read the normed rows later
//     (the routed experts). x is only read, so blocks never race.
//   * SwiGLU prologue (swiglu = 1): x is the gate rows and x_up the up rows; the staged rows are
//     bf16(silu(gate) * up), as silu_mul_bf16 stores them (the shared expert's down projection).
//   * residual epilogue (segment residual = 1, bf16 out): y[m, n] += the dot product instead of y = it (a
//     block's output projection added to the residual stream; each element has one writer).
//
// Split-K (gemv_multi, ksplit > 1): a launch with fewer 16-row tiles than resident blocks (an output projection:
// N = 2048 is 128 tiles for 132 SMs x 2 blocks) leaves SMs idle and each warp walking its k-steps in several
// round trips. Then K is cut into ksplit parts of part_steps k-steps: work item = (tile, part), items = tiles x
// ksplit over the same persistent grid. A part's block writes its 16x8 sums to partial[item], fences, and counts
// itself in counter[tile]; the block that counts last sums the ksplit parts in part order (the same bits whatever
// order the blocks finish in), runs the tile's epilogue (store / residual add) and sets the counter back to zero
// for the next launch. Everything after the weights' first loads waits for the previous kernel (PDL_ENTRY), so
// consecutive launches never share the counters.
//
// gemv_scalar_bf16_bf16out / gemv_scalar_bf16_f32out (any K, any alignment; slower):
//   one warp per output row, lanes stride over k with scalar loads, M fp32 accumulators, warp reduce.
//   Launch: grid = min(ceil(N/8), SMs * 8), block = 256.
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_THREADS (GEMV_WARPS * 32)
#define GEMV_U 8      // k-steps (2 x 16 B of W per lane each) in flight per warp
#define GEMV_MAX_M 8  // the mma's N dimension

struct GemvParams {
    const bf16* x;  // [m, k]
    const bf16* w;  // [n, k]
    void* y;        // [m, n], bf16 or f32
    int m, n, k;
    int kp;  // fast path: padded shared-memory row stride of x, in elements
};

#define GEMV_MAX_SEGS 4

// One matrix of a multi-GEMV: y [m, n] (bf16, or f32 when f32out) = x [m, k] * w [n, k]^T.
struct GemvSeg {
    const bf16* w;
    void* y;
    int n;
    int tile0;   // first tile of this segment in the launch's tile numbering
    int f32out;
    int residual;  // bf16 out only: y += x * w^T
};

struct GemvMultiParams {
    const bf16* x;       // [m, k], shared by every segment
    const bf16* x_up;    // [m, k] (swiglu = 1): the up rows
    const bf16* norm_w;  // [k] (norm = 1)
    bf16* normed;        // [m, k] (norm = 1): the normalised rows, written by block 0
    GemvSeg seg[GEMV_MAX_SEGS];
    int nseg, m, k, kp;
    int tiles;  // total over the segments
    int norm, zero_centred, swiglu;
    float eps;
    int ksplit;      // parts K is cut into (1: none)
    int part_steps;  // 32-wide k-steps per part, a multiple of GEMV_WARPS (ksplit = 1: all of them)
    int pad_;
    float* partial;  // [tiles * ksplit][128] (ksplit > 1): each part's 16x8 sums
    int* counter;    // [tiles] (ksplit > 1): parts finished; zero between launches
};

// The segment owning `tile` (an unrolled compare chain: no dynamic indexing into the parameter array).
__device__ __forceinline__ GemvSeg seg_of(const GemvMultiParams& p, int tile) {
    GemvSeg s = p.seg[0];
#pragma unroll
    for (int i = 1; i < GEMV_MAX_SEGS; ++i)
        if (i < p.nseg && tile >= p.seg[i].tile0) s = p.seg[i];
    return s;
}

__device__ __forceinline__ uint4 ld_stream16(const bf16* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// d += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate. Fragment layout (PTX ISA, m16n8k16):
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]; d0,d1 = D[g][2t..2t+1], d2,d3 = D[g+8][2t..2t+1].
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void store_out(bf16* y, size_t i, float v) { y[i] = f2bf(v); }
__device__ __forceinline__ void store_out(float* y, size_t i, float v) { y[i] = v; }

// The norm prologue: warp m sums row m's squares, then every thread scales its 8-element slices in place.
__device__ __forceinline__ void normalise_rows(const GemvMultiParams& p, bf16* xs) {
    __shared__ float inv[GEMV_MAX_M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int M = p.m, K = p.k, KP = p.kp, KV = K >> 3;
    if (warp < M) {
        float ss = 0.f;
        for (int v = lane; v < KV; v += 32) {
            float x[8];
            load8(xs + warp * KP + v * 8, x);
#pragma unroll
            for (int q = 0; q < 8; ++q) ss += x[q] * x[q];
        }
        ss = warp_sum(ss);
        if (lane == 0) inv[warp] = rsqrtf(ss / K + p.eps);
    }
    __syncthreads();
    const float w_off = p.zero_centred ? 1.f : 0.f;
    for (int i = threadIdx.x; i < M * KV; i += GEMV_THREADS) {
        const int m = i / KV, v = i - m * KV;
        float x[8], w[8];
        load8(xs + m * KP + v * 8, x);
        load8(p.norm_w + v * 8, w);
#pragma unroll
        for (int q = 0; q < 8; ++q) x[q] = x[q] * inv[m] * (w_off + w[q]);
        store8(xs + m * KP + v * 8, x);
        if (blockIdx.x == 0) store8(p.normed + (size_t)m * K + v * 8, x);
    }
    __syncthreads();
}

__device__ __forceinline__ void gemv_tc(const GemvMultiParams& p) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    __shared__ __align__(16) float red[2][GEMV_WARPS][128];
    __shared__ int last_part;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int M = p.m, K = p.k, KP = p.kp;
    const int KV = K >> 3;            // 16-byte vectors per row
    const int steps = (KV + 3) >> 2;  // 32-wide k-steps per row
    const int S = p.ksplit;
    const int items = p.tiles * S;    // item = tile * S + part

    // An item's first k-step and this warp's share of the part's steps (warp-uniform).
    auto part_of = [&](int item, int& s0) -> int {
        s0 = (item % S) * p.part_steps;
        const int len = min(steps, s0 + p.part_steps) - s0;
        return len > warp ? (len - warp + GEMV_WARPS - 1) / GEMV_WARPS : 0;
    };

    uint4 wa[GEMV_U], wb[GEMV_U];  // W rows g and g + 8 of the tile, GEMV_U k-steps
    auto load_chunk = [&](int item, int j0, int s0, int mine) {
        const int tile = item / S;
        const GemvSeg sg = seg_of(p, tile);
        const int N = sg.n;
        const int r0 = (tile - sg.tile0) * 16 + g, r1 = r0 + 8;
        const bf16* w0 = sg.w + (size_t)r0 * K;
        const bf16* w1 = sg.w + (size_t)r1 * K;
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int v = 4 * (s0 + warp + GEMV_WARPS * (j0 + u)) + t;
            const bool ok = j0 + u < mine && v < KV;
            wa[u] = (ok && r0 < N) ? ld_stream16(w0 + (size_t)v * 8) : make_uint4(0, 0, 0, 0);
            wb[u] = (ok && r1 < N) ? ld_stream16(w1 + (size_t)v * 8) : make_uint4(0, 0, 0, 0);
        }
    };
    // Thread i (< 128) of the tile's sums: its output element, stored, added or as f32.
    auto store_tile = [&](int tile, int i, float s) {
        const GemvSeg sg = seg_of(p, tile);
        const int N = sg.n;
        const int ln = i >> 2, c = i & 3;
        const int n = (tile - sg.tile0) * 16 + (ln >> 2) + ((c & 2) ? 8 : 0);
        const int m = 2 * (ln & 3) + (c & 1);
        if (n < N && m < M) {
            const size_t at = (size_t)m * N + n;
            if (sg.f32out) store_out(reinterpret_cast<float*>(sg.y), at, s);
            else if (sg.residual) store_out(reinterpret_cast<bf16*>(sg.y), at, bf2f(reinterpret_cast<bf16*>(sg.y)[at]) + s);
            else store_out(reinterpret_cast<bf16*>(sg.y), at, s);
        }
    };

    int item = blockIdx.x;
    int s0 = 0, mine = 0;
    if (item < items) mine = part_of(item, s0);
    // The first k-chunk of an item is loaded ahead: the first item's before x is staged, the next item's
    // before the cross-warp reduction, so the barriers never leave the warp without loads in flight.
    bool preloaded = false;
    if (item < items && mine > 0) {
        load_chunk(item, 0, s0, mine);
        preloaded = true;
    }
    // Weights stream in above while the previous kernel drains; x (and y, for the residual epilogue, and the
    // split-K counters) are its outputs or shared with it (common.cuh).
    PDL_ENTRY();
    for (int i = threadIdx.x; i < M * KV; i += GEMV_THREADS) {
        const int m = i / KV, v = i - m * KV;
        if (p.swiglu) {
            float g[8], u[8];
            load8(p.x + (size_t)m * K + v * 8, g);
            load8(p.x_up + (size_t)m * K + v * 8, u);
#pragma unroll
            for (int q = 0; q < 8; ++q) g[q] = silu(g[q]) * u[q];
            store8(xs + m * KP + v * 8, g);
        } else {
            *reinterpret_cast<uint4*>(xs + m * KP + v * 8) = __ldg(reinterpret_cast<const uint4*>(p.x + (size_t)m * K) + v);
        }
    }
    __syncthreads();
    if (p.norm) normalise_rows(p, xs);

    int parity = 0;
    for (; item < items; item += gridDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j0 = 0; j0 < mine; j0 += GEMV_U) {
            if (j0 > 0 || !preloaded) load_chunk(item, j0, s0, mine);
#pragma unroll
            for (int u = 0; u < GEMV_U; ++u) {
                if (j0 + u < mine) {  // warp-uniform: every lane takes part in the mma
                    const int v = 4 * (s0 + warp + GEMV_WARPS * (j0 + u)) + t;
                    uint4 xb = make_uint4(0, 0, 0, 0);
                    if (g < M && v < KV) xb = *reinterpret_cast<const uint4*>(xs + g * KP + v * 8);
                    mma_16816(acc, wa[u].x, wb[u].x, wa[u].y, wb[u].y, xb.x, xb.y);
                    mma_16816(acc, wa[u].z, wb[u].z, wa[u].w, wb[u].w, xb.z, xb.w);
                }
            }
        }
        preloaded = false;
        const int next = item + gridDim.x;
        int next_s0 = 0, next_mine = 0;
        if (next < items) next_mine = part_of(next, next_s0);
        if (next < items && next_mine > 0) {
            load_chunk(next, 0, next_s0, next_mine);
            preloaded = true;
        }
        *reinterpret_cast<float4*>(&red[parity][warp][lane * 4]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        const int tile = item / S;
        float s = 0.f;
        if (threadIdx.x < 128) {  // = lane' * 4 + c of the accumulator fragment
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; ++w) s += red[parity][w][threadIdx.x];
        }
        if (S == 1) {
            if (threadIdx.x < 128) store_tile(tile, threadIdx.x, s);
        } else {
            if (threadIdx.x < 128) {
                p.partial[(size_t)item * 128 + threadIdx.x] = s;
                __threadfence();  // this part's sums visible before it is counted
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                last_part = atomicAdd(p.counter + tile, 1) == S - 1;
                __threadfence();  // the other parts' sums, counted before, are read after this
            }
            __syncthreads();
            if (last_part && threadIdx.x < 128) {
                float sum = 0.f;
                for (int q = 0; q < S; ++q) sum += __ldcg(p.partial + ((size_t)tile * S + q) * 128 + threadIdx.x);
                store_tile(tile, threadIdx.x, sum);
                if (threadIdx.x == 0) p.counter[tile] = 0;
            }
        }
        s0 = next_s0;
        mine = next_mine;
        parity ^= 1;  // the other buffer is free: its readers passed this item's barrier
    }
}

template <typename OutT>
__device__ __forceinline__ void gemv_scalar(const GemvParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int M = p.m, N = p.n, K = p.k;
    OutT* y = reinterpret_cast<OutT*>(p.y);
    for (int n = blockIdx.x * GEMV_WARPS + warp; n < N; n += gridDim.x * GEMV_WARPS) {
        const bf16* wr = p.w + (size_t)n * K;
        float acc[GEMV_MAX_M];
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; ++m) acc[m] = 0.f;
        for (int k = lane; k < K; k += 32) {
            const float wv = bf2f(wr[k]);
#pragma unroll
            for (int m = 0; m < GEMV_MAX_M; ++m)
                if (m < M) acc[m] += wv * bf2f(p.x[(size_t)m * K + k]);
        }
#pragma unroll
        for (int m = 0; m < GEMV_MAX_M; ++m) {
            if (m < M) {  // warp-uniform
                const float s = warp_sum(acc[m]);
                if (lane == 0) store_out(y, (size_t)m * N + n, s);
            }
        }
    }
}

// One matrix as a one-segment multi-GEMV.
__device__ __forceinline__ GemvMultiParams one_segment(const GemvParams& p, int f32out) {
    GemvMultiParams q;
    q.x = p.x;
    q.x_up = nullptr;
    q.norm_w = nullptr;
    q.normed = nullptr;
#pragma unroll
    for (int i = 0; i < GEMV_MAX_SEGS; ++i) q.seg[i] = GemvSeg{p.w, p.y, p.n, 0, f32out, 0};
    q.nseg = 1;
    q.m = p.m;
    q.k = p.k;
    q.kp = p.kp;
    q.tiles = (p.n + 15) >> 4;
    q.norm = 0;
    q.zero_centred = 0;
    q.swiglu = 0;
    q.eps = 0.f;
    q.ksplit = 1;
    q.part_steps = ((p.k >> 3) + 3) >> 2;
    q.pad_ = 0;
    q.partial = nullptr;
    q.counter = nullptr;
    return q;
}

extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) gemv_bf16_bf16out(const GemvParams p) {
    gemv_tc(one_segment(p, 0));
}
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) gemv_bf16_f32out(const GemvParams p) {
    gemv_tc(one_segment(p, 1));
}
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) gemv_multi(const GemvMultiParams p) {
    gemv_tc(p);
}
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_scalar_bf16_bf16out(const GemvParams p) {
    PDL_ENTRY();
    gemv_scalar<bf16>(p);
}
extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_scalar_bf16_f32out(const GemvParams p) {
    PDL_ENTRY();
    gemv_scalar<float>(p);
}
