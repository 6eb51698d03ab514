// Paged GQA attention over the bf16 KV cache: decode (1 row per sequence), causal verify (k + 1 rows per
// sequence) and prefill (many rows of one sequence) through one tensor-core kernel (docs/qwen3_5_moe.md §2.4 step 5-6).
//
// Inputs per query row r (rows of one sequence contiguous and in position order):
//   q [T, qh * D] bf16 (normed + roped), seq_row_start i32 [num_seqs + 1] (rows of sequence s are
//   seq_row_start[s] .. seq_row_start[s + 1]), row_ctx_len i32 [T] (row r attends to KV positions
//   0 .. row_ctx_len[r]: its own position + 1, its K/V already in the cache), block_tables i32
//   [num_seqs, max_blocks_per_seq], k_cache / v_cache bf16 [num_blocks, block_size, kvh, D], optional
//   gate [T, qh * D] (out = attn * sigmoid(gate)).
//   out[r, h] = softmax_j(q[r, h] . K[j, h / G] * scale) . V[j, h / G], fp32 softmax, G = qh / kvh.
//
// attn_paged_d{D}_wm{WM}_bf16 — flash-attention with mma.sync m16n8k16 (bf16 in, fp32 accumulate).
//   The M dimension of a CTA is "query vectors" = (row, head-in-group) pairs of one (sequence, kv head):
//   vector v = row_local * G + g, so decode (G = 8) packs the 8 q heads of a kv head into one m16 tile and
//   verify (4 rows x 8 heads) fills two. Each KV tile is read from the cache ONCE per CTA for all its
//   vectors. 4 warps per CTA: WM warps split the m16 tiles, WK = 4 / WM warps split the 64 tokens of each KV
//   tile (16, 32 or 64 tokens per warp) and are merged through shared memory at the end.
//   Split-KV (flash-decoding): blockIdx.y = split covers positions [split * chunk, (split + 1) * chunk) (the
//   last split runs to the end);
//   with splits > 1 the CTA writes unnormalised (acc, max, sum) to an f32 workspace and attn_combine_bf16
//   merges them; with splits == 1 it writes the gated bf16 output directly.
//   Shared memory (dynamic): Q [16 WM][D] + 2 stages x (K, V) [64][D] bf16, XOR-swizzled 16-byte chunks
//   (conflict-free ldmatrix); cp.async double buffering; the epilogue reuses the KV stages.
//   Bytes: every (sequence, kv head) reads ctx * D * 4 bytes of K + V once (+ q, out, workspace).
//   Launch: grid = (num_seqs * kvh * m_groups, splits), block = 128, dynamic smem = 32 * WM * D + 512 * D
//   bytes (160 KiB at D = 256, WM = 4: one CTA per SM; 20 KiB at D = 32). Registers (ptxas): 255 at
//   D = 256 / WM = 4, 127 at D = 32 / WM = 4.
//   Requires block_size a power of two, D in {32, 64, 128, 256} (32: the tiny test checkpoints).
//
//   Merge in the same launch (arrivals != nullptr, splits > 1): each CTA fences its partials and counts itself
//   in arrivals[blockIdx.x]; the CTA that brings the count to the number of splits holding keys for its rows
//   resets it and merges its query vectors' splits as attn_combine_bf16 does (same formula, its sums in another
//   order), reading the partials back from L2. One launch instead of two for decode and verify.
//
// attn_combine_bf16 — merges the splits of one (row, head): M = max m_s, L = sum exp2(m_s - M) l_s,
//   out = sum exp2(m_s - M) acc_s / L (* sigmoid(gate)). Reads splits * (D + 2) * 4 bytes per (row, head)
//   (L2-resident). Launch: grid = T * qh, block = 256 = (D / 4 float4 columns) x (split groups).
#include "common.cuh"

#define ATT_THREADS 128
#define ATT_WARPS 4
#define KV_TILE 64
#define ATT_MAX_SPLITS 128

struct AttnParams {
    const bf16* q;
    const bf16* gate;  // nullptr: no output gate
    const bf16* k_cache;
    const bf16* v_cache;
    const int* block_tables;
    const int* seq_row_start;
    const int* row_ctx_len;
    bf16* out;
    float* ws_acc;  // [splits, T, qh, D]
    float* ws_ml;   // [splits, T, qh, 2] (max in log2 units, sum)
    int rows;
    int q_heads;
    int kv_heads;
    int group;
    int num_blocks;
    int block_shift;  // log2(block_size)
    int max_blocks_per_seq;
    int m_groups;
    int splits;
    int chunk;
    float scale_log2;  // scale * log2(e)
    int head_dim;
    unsigned* arrivals;  // [CTAs along x], zero between launches; nullptr: attn_combine_bf16 merges the splits
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// out[at .. at + 4] = bf16(res · sigmoid(gate[at .. at + 4])) (no gate: bf16(res)); `at` a multiple of 4.
__device__ __forceinline__ void store_gated4(const AttnParams& p, size_t at, float (&res)[4]) {
    if (p.gate) {
        const uint2 gu = *reinterpret_cast<const uint2*>(p.gate + at);
        const float2 ga = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gu.x));
        const float2 gb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gu.y));
        res[0] *= sigmoid(ga.x);
        res[1] *= sigmoid(ga.y);
        res[2] *= sigmoid(gb.x);
        res[3] *= sigmoid(gb.y);
    }
    __nv_bfloat162 h0 = __floats2bfloat162_rn(res[0], res[1]), h1 = __floats2bfloat162_rn(res[2], res[3]);
    uint2 ou;
    ou.x = *reinterpret_cast<uint32_t*>(&h0);
    ou.y = *reinterpret_cast<uint32_t*>(&h1);
    *reinterpret_cast<uint2*>(p.out + at) = ou;
}

// 16-byte async copy global -> shared; zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// d += a (16x16, row) * b (16x8, col), bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// Element offset of 16-byte chunk `ch` of row `r` in a swizzled [rows][D] bf16 tile. The 8 rows of one
// ldmatrix phase (r0 .. r0 + 7, r0 a multiple of 8) must land on the 8 distinct 16-byte bank groups of a
// 128-byte line. D >= 64 (8+ chunks per row): XOR the chunk with r & 7. D = 32 (4 chunks, two rows per
// line): row parity picks the line half, so XOR with (r >> 1) & 3, which stays inside the row's 4 chunks.
template <int D>
__device__ __forceinline__ int swz(int r, int ch) {
    if constexpr (D == 32) {
        return r * D + ((ch ^ ((r >> 1) & 3)) << 3);
    } else {
        return r * D + ((ch ^ (r & 7)) << 3);
    }
}

template <int D, int WM>
__device__ __forceinline__ void attn_paged(const AttnParams& p) {
    constexpr int WK = ATT_WARPS / WM;  // warps sharing an m16 tile, splitting the KV tile
    constexpr int TPW = KV_TILE / WK;   // tokens per warp per tile
    constexpr int NT = TPW / 8;         // S n8-tiles per warp
    constexpr int DT = D / 8;           // O n8-tiles
    constexpr int CPR = D / 8;          // 16-byte chunks per row
    constexpr int MV = WM * 16;         // query vectors per CTA
    constexpr int SO = D + 8;           // padded f32 row of the epilogue buffer
    static_assert(D == 32 || D == 64 || D == 128 || D == 256, "head_dim");
    static_assert(ATT_THREADS % CPR == 0 && KV_TILE % (ATT_THREADS / CPR) == 0, "tile load shape");
    static_assert(ATT_WARPS * 16 * SO * 4 <= 2 * 2 * KV_TILE * D * 2, "epilogue buffer fits in the KV stages");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [MV][D]
    bf16* sKV = sQ + MV * D;                        // [stage][K | V][KV_TILE][D]
    float* sO = reinterpret_cast<float*>(sKV);      // epilogue: [ATT_WARPS][16][SO]
    __shared__ int s_ctx[MV];
    __shared__ int s_max_ctx;
    __shared__ float s_m[ATT_WARPS][16], s_l[ATT_WARPS][16];
    __shared__ float s_fin_m[MV], s_fin_l[MV];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int split = blockIdx.y;
    int y = blockIdx.x;
    const int mg = p.m_groups - 1 - y % p.m_groups;  // longest causal ranges first (prefill balance)
    y /= p.m_groups;
    const int kvh = y % p.kv_heads;
    const int seq = y / p.kv_heads;
    const int row0 = p.seq_row_start[seq];
    const int nrows = p.seq_row_start[seq + 1] - row0;
    const int G = p.group;
    const int v0 = mg * MV;  // first query vector of this CTA within its (sequence, kv head)
    if (v0 >= nrows * G) return;

    // 1. Context length of every query vector; the CTA's KV range is this split ∩ [0, max ctx).
    const int table_ctx = p.max_blocks_per_seq << p.block_shift;
    if (tid == 0) s_max_ctx = 0;
    __syncthreads();
    if (tid < MV) {
        const int r = (v0 + tid) / G;
        const int c = r < nrows ? min(max(p.row_ctx_len[row0 + r], 0), table_ctx) : 0;
        s_ctx[tid] = c;
        atomicMax(&s_max_ctx, c);
    }
    __syncthreads();
    const int kv_begin = split * p.chunk;
    // The last split is open-ended, so a row longer than the planned max context is still complete.
    const int kv_end = split == p.splits - 1 ? s_max_ctx : min(kv_begin + p.chunk, s_max_ctx);
    if (kv_begin >= kv_end) return;  // nothing here for any row (the combine skips this split)

    // 2. Q tile (zero rows past the sequence's last row) and the first KV tile, async.
    const size_t q_row = (size_t)p.q_heads * D;
    for (int c = tid; c < MV * CPR; c += ATT_THREADS) {
        const int vr = c / CPR, ch = c % CPR;
        const int v = v0 + vr, r = v / G, g = v - r * G;
        const bool ok = r < nrows;
        const bf16* src = ok ? p.q + (size_t)(row0 + r) * q_row + (size_t)(kvh * G + g) * D + ch * 8 : p.q;
        cp_async16(smem_u32(sQ + swz<D>(vr, ch)), src, ok);
    }
    const int* bt = p.block_tables + (size_t)seq * p.max_blocks_per_seq;
    const int bmask = (1 << p.block_shift) - 1;
    auto load_tile = [&](int start, int stage) {
        constexpr int RPP = ATT_THREADS / CPR;  // rows per pass
        const uint32_t sK = smem_u32(sKV + stage * 2 * KV_TILE * D);
        const uint32_t sV = sK + KV_TILE * D * 2;
        const int ch = tid % CPR;
#pragma unroll
        for (int i = 0; i < KV_TILE / RPP; ++i) {
            const int r = tid / CPR + i * RPP;
            const int pos = start + r;
            bool ok = pos < kv_end;
            size_t off = 0;
            if (ok) {
                const int blk = bt[pos >> p.block_shift];
                ok = blk >= 0 && blk < p.num_blocks;
                const size_t slot = ((size_t)blk << p.block_shift) + (pos & bmask);
                off = (slot * p.kv_heads + kvh) * D + ch * 8;
            }
            const uint32_t dst = swz<D>(r, ch) * 2;
            cp_async16(sK + dst, ok ? p.k_cache + off : p.k_cache, ok);
            cp_async16(sV + dst, ok ? p.v_cache + off : p.v_cache, ok);
        }
    };
    const int ntiles = (kv_end - kv_begin + KV_TILE - 1) / KV_TILE;
    load_tile(kv_begin, 0);
    cp_async_commit();

    // 3. Main loop: online softmax over KV tiles. This warp: m16 tile mi, tokens [ki * TPW, +TPW) of a tile.
    const int mi = warp % WM, ki = warp / WM;
    const int gq = lane >> 2, tq = lane & 3;  // mma fragment row group / thread-in-quad
    const int lim0 = min(s_ctx[mi * 16 + gq], kv_end), lim1 = min(s_ctx[mi * 16 + gq + 8], kv_end);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int it = 0; it < ntiles; ++it) {
        const int start = kv_begin + it * KV_TILE;
        if (it + 1 < ntiles) {
            load_tile(start + KV_TILE, (it + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const bf16* sK = sKV + (it & 1) * 2 * KV_TILE * D;
        const bf16* sV = sK + KV_TILE * D;

        // S = Q K^T (16 vectors x TPW tokens).
        float s[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            uint32_t a[4];
            ldmatrix_x4(a, smem_u32(sQ + swz<D>(mi * 16 + (lane & 15), kc * 2 + (lane >> 4))));
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                uint32_t b[4];
                const int r = ki * TPW + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(b, smem_u32(sK + swz<D>(r, kc * 2 + ((lane >> 3) & 1))));
                mma_bf16(s[2 * np], a, b[0], b[1]);
                mma_bf16(s[2 * np + 1], a, b[2], b[3]);
            }
        }

        // Mask (causal per row, split end), scale to log2 units, online softmax update.
        const int tok0 = start + ki * TPW + tq * 2;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int pos = tok0 + nt * 8 + e;
                s[nt][e] = pos < lim0 ? s[nt][e] * p.scale_log2 : -INFINITY;
                s[nt][2 + e] = pos < lim1 ? s[nt][2 + e] * p.scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == -INFINITY ? 0.f : mn0, b1 = mn1 == -INFINITY ? 0.f : mn1;
        const float al0 = exp2f(m0 - b0), al1 = exp2f(m1 - b1);
        m0 = mn0;
        m1 = mn1;
        uint32_t pa[NT][2];  // P as bf16 pairs: [nt][0] row gq, [nt][1] row gq + 8
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float p00 = exp2f(s[nt][0] - b0), p01 = exp2f(s[nt][1] - b0);
            const float p10 = exp2f(s[nt][2] - b1), p11 = exp2f(s[nt][3] - b1);
            rs0 += p00 + p01;
            rs1 += p10 + p11;
            pa[nt][0] = pack_bf16(p00, p01);
            pa[nt][1] = pack_bf16(p10, p11);
        }
        l0 = l0 * al0 + rs0;
        l1 = l1 * al1 + rs1;
#pragma unroll
        for (int i = 0; i < DT; ++i) {
            o[i][0] *= al0;
            o[i][1] *= al0;
            o[i][2] *= al1;
            o[i][3] *= al1;
        }

        // O += P V.
#pragma unroll
        for (int kc = 0; kc < TPW / 16; ++kc) {
            const uint32_t a[4] = {pa[2 * kc][0], pa[2 * kc][1], pa[2 * kc + 1][0], pa[2 * kc + 1][1]};
            const int r = ki * TPW + kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, smem_u32(sV + swz<D>(r, dp * 2 + (lane >> 4))));
                mma_bf16(o[2 * dp], a, b[0], b[1]);
                mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
    }

    // 4. Merge the WK warps of each m16 tile through shared memory (the KV stages are free now).
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (tq == 0) {
        s_m[warp][gq] = m0;
        s_m[warp][gq + 8] = m1;
        s_l[warp][gq] = l0;
        s_l[warp][gq + 8] = l1;
    }
    __syncthreads();
    float M0 = -INFINITY, M1 = -INFINITY;
#pragma unroll
    for (int kk = 0; kk < WK; ++kk) {
        M0 = fmaxf(M0, s_m[kk * WM + mi][gq]);
        M1 = fmaxf(M1, s_m[kk * WM + mi][gq + 8]);
    }
    const float B0 = M0 == -INFINITY ? 0.f : M0, B1 = M1 == -INFINITY ? 0.f : M1;
    const float f0 = exp2f(m0 - B0), f1 = exp2f(m1 - B1);
    float* so = sO + warp * 16 * SO;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        *reinterpret_cast<float2*>(so + gq * SO + i * 8 + tq * 2) = make_float2(o[i][0] * f0, o[i][1] * f0);
        *reinterpret_cast<float2*>(so + (gq + 8) * SO + i * 8 + tq * 2) = make_float2(o[i][2] * f1, o[i][3] * f1);
    }
    if (ki == 0 && tq == 0) {
        float L0 = 0.f, L1 = 0.f;
#pragma unroll
        for (int kk = 0; kk < WK; ++kk) {
            L0 += s_l[kk * WM + mi][gq] * exp2f(s_m[kk * WM + mi][gq] - B0);
            L1 += s_l[kk * WM + mi][gq + 8] * exp2f(s_m[kk * WM + mi][gq + 8] - B1);
        }
        s_fin_m[mi * 16 + gq] = M0;
        s_fin_l[mi * 16 + gq] = L0;
        s_fin_m[mi * 16 + gq + 8] = M1;
        s_fin_l[mi * 16 + gq + 8] = L1;
    }
    __syncthreads();

    // 5. Write: final gated bf16 output (one split) or the split's partial (acc, max, sum).
    constexpr int D4 = D / 4;
    for (int idx = tid; idx < MV * D4; idx += ATT_THREADS) {
        const int vr = idx / D4, d = (idx % D4) * 4;
        const int v = v0 + vr, r = v / G;
        if (r >= nrows) continue;
        const int g = v - r * G;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int kk = 0; kk < WK; ++kk) {
            const float4 t = *reinterpret_cast<const float4*>(sO + ((kk * WM + vr / 16) * 16 + vr % 16) * SO + d);
            acc.x += t.x;
            acc.y += t.y;
            acc.z += t.z;
            acc.w += t.w;
        }
        const size_t vi = (size_t)(row0 + r) * p.q_heads + kvh * G + g;  // (row, head)
        if (p.splits == 1) {
            const float L = s_fin_l[vr], inv = L > 0.f ? 1.f / L : 0.f;
            float res[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
            store_gated4(p, vi * D + d, res);
        } else {
            const size_t wi = (size_t)split * p.rows * p.q_heads + vi;
            *reinterpret_cast<float4*>(p.ws_acc + wi * D + d) = acc;
            if (d == 0) *reinterpret_cast<float2*>(p.ws_ml + wi * 2) = make_float2(s_fin_m[vr], s_fin_l[vr]);
        }
    }
    if (p.splits == 1 || p.arrivals == nullptr) return;

    // 6. The last split of this CTA's vectors to finish merges them (see the header).
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int n_work = min(p.splits, (s_max_ctx + p.chunk - 1) / p.chunk);  // splits that did not exit early
        unsigned* count = p.arrivals + blockIdx.x;
        s_last = atomicAdd(count, 1u) == (unsigned)(n_work - 1);
        if (s_last) *count = 0u;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const size_t vstride = (size_t)p.rows * p.q_heads;
    for (int idx = tid; idx < MV * D4; idx += ATT_THREADS) {
        const int vr = idx / D4, d = (idx % D4) * 4;
        const int v = v0 + vr, r = v / G;
        if (r >= nrows) continue;
        const int g = v - r * G;
        const size_t vi = (size_t)(row0 + r) * p.q_heads + kvh * G + g;
        const int ns = max(1, min(p.splits, (s_ctx[vr] + p.chunk - 1) / p.chunk));
        float mx = -INFINITY;
        for (int sp = 0; sp < ns; ++sp) mx = fmaxf(mx, __ldcg(p.ws_ml + (sp * vstride + vi) * 2));
        const float base = mx == -INFINITY ? 0.f : mx;
        float l = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int sp = 0; sp < ns; ++sp) {
            const size_t wi = sp * vstride + vi;
            const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.ws_ml + wi * 2));
            const float e = exp2f(ml.x - base);
            l += e * ml.y;
            const float4 a = __ldcg(reinterpret_cast<const float4*>(p.ws_acc + wi * D + d));
            acc.x += e * a.x;
            acc.y += e * a.y;
            acc.z += e * a.z;
            acc.w += e * a.w;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        float res[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
        store_gated4(p, vi * D + d, res);
    }
}

#define ATTN_KERNEL(D, WM)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 1) attn_paged_d##D##_wm##WM##_bf16(const AttnParams p) { PDL_ENTRY(); \
        attn_paged<D, WM>(p);                                                                                  \
    }
ATTN_KERNEL(32, 1)
ATTN_KERNEL(32, 2)
ATTN_KERNEL(32, 4)
ATTN_KERNEL(64, 1)
ATTN_KERNEL(64, 2)
ATTN_KERNEL(64, 4)
ATTN_KERNEL(128, 1)
ATTN_KERNEL(128, 2)
ATTN_KERNEL(128, 4)
ATTN_KERNEL(256, 1)
ATTN_KERNEL(256, 2)
ATTN_KERNEL(256, 4)

#define COMBINE_THREADS 256

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) attn_combine_bf16(const AttnParams p) {
    PDL_ENTRY();
    __shared__ float w[ATT_MAX_SPLITS];
    __shared__ float4 part[COMBINE_THREADS];
    const int D = p.head_dim, tid = threadIdx.x;
    const int row = blockIdx.x / p.q_heads;
    const size_t vi = blockIdx.x;  // row * qh + head
    const size_t vstride = (size_t)p.rows * p.q_heads;
    const int ctx = min(max(p.row_ctx_len[row], 0), p.max_blocks_per_seq << p.block_shift);
    const int ns = max(1, min(p.splits, (ctx + p.chunk - 1) / p.chunk));  // splits that hold this row's keys

    // 1. Global max and the weight of every split.
    float mx = -INFINITY;
    for (int s = tid; s < ns; s += COMBINE_THREADS) mx = fmaxf(mx, p.ws_ml[(s * vstride + vi) * 2]);
    mx = block_max(mx);
    const float base = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    for (int s = tid; s < ns; s += COMBINE_THREADS) {
        const float2 ml = *reinterpret_cast<const float2*>(p.ws_ml + (s * vstride + vi) * 2);
        const float e = exp2f(ml.x - base);
        w[s] = e;
        l += e * ml.y;
    }
    l = block_sum(l);  // its barriers also publish w[]
    const float inv = l > 0.f ? 1.f / l : 0.f;

    // 2. Weighted sum of the partial accumulators: thread = (float4 column, split group).
    const int d4 = D / 4, groups = COMBINE_THREADS / d4;  // D <= 1024
    const int col = tid % d4, sg = tid / d4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sg < groups) {
#pragma unroll 4
        for (int s = sg; s < ns; s += groups) {
            const float4 a = *reinterpret_cast<const float4*>(p.ws_acc + (s * vstride + vi) * D + col * 4);
            const float ws = w[s];
            acc.x += ws * a.x;
            acc.y += ws * a.y;
            acc.z += ws * a.z;
            acc.w += ws * a.w;
        }
    }
    part[tid] = acc;
    __syncthreads();
    if (tid >= d4) return;
    for (int g = 1; g < groups; ++g) {
        const float4 a = part[g * d4 + col];
        acc.x += a.x;
        acc.y += a.y;
        acc.z += a.z;
        acc.w += a.w;
    }
    const int d = col * 4;
    float res[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
    store_gated4(p, vi * D + d, res);
}
