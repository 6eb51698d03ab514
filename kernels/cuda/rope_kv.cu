// Per-head QK RMSNorm + partial NeoX RoPE + paged KV-cache write for gated full attention
// (docs/qwen3_5_moe.md §2.4 steps 1-4, §2.5; RMSNorm §2.2).
//
// qk_norm_rope_kv_bf16: for each token t (T rows):
//   q head h:  x = qg[t, h*hd*(gated?2:1) + 0..hd)          (gated: Qwen3.5 per-head [query hd | gate hd])
//              y = bf16(rmsnorm(x) * (zero_centred ? 1 + q_norm : q_norm))
//              y[0..rd) = rope(y[0..rd), positions[t]);     q_out[t, h*hd..] = y
//              gated: gate_out[t, h*hd..] = qg[t, h*2*hd + hd ..]   (copied, pre-sigmoid)
//   kv head j: k normed with k_norm and roped the same way, written to k_cache[slot, j, :];
//              v copied unchanged to v_cache[slot, j, :]; slot = slot_mapping[t] (skipped when < 0 or
//              >= num_slots). Cache layout [num_blocks * block_size (= slots), kv_heads, hd].
//   RoPE (NeoX rotate-half on the first rd dims, half = rd / 2, f = i mod half):
//              inv_freq[f] = 1 / theta^(2f / rd) (fp32), angle = fp32(pos * inv_freq[f]),
//              y[i] = x[i] cos - x[i + half] sin   (i < half);   y[i] = x[i] cos + x[i - half] sin   (half <= i < rd)
//              the fp32 angle is reduced mod 2 pi in double before the fp32 sin/cos (positions reach
//              262144, where fast-math __sinf of the raw angle is useless).
//   Bytes per token: reads (qh * hd * (gated ? 2 : 1) + 2 * kvh * hd) * 2, writes (qh * hd * (gated ? 2 : 1)
//              + 2 * kvh * hd) * 2, i.e. ~36 KiB in + out at the real shape: latency-bound at decode.
//   Launch: grid = (T, ceil((qh + 2 * kvh) / 4)), block = 128: one warp per (token, head task); lane l owns
//              elements [8l, 8l + 8) of the head. Requires hd % 8 == 0, hd <= 256, rd even, rd <= hd.
#include "common.cuh"

struct RopeKvParams {
    const bf16* qg;
    const bf16* k;
    const bf16* v;
    const bf16* q_norm;
    const bf16* k_norm;
    const int* positions;
    const long long* slot_mapping;
    bf16* q_out;
    bf16* gate_out;  // only read when gated
    bf16* k_cache;
    bf16* v_cache;
    long long num_slots;
    int tokens;
    int q_heads;
    int kv_heads;
    int head_dim;
    int rotary_dim;
    int gated;
    int zero_centred;
    float eps;
    float theta;
};

#define ROPE_WARPS 4
#define ROPE_MAX_HD 256

extern "C" __global__ void __launch_bounds__(128) qk_norm_rope_kv_bf16(const RopeKvParams p) {
    PDL_ENTRY();
    __shared__ float cs_cos[ROPE_MAX_HD / 2];
    __shared__ float cs_sin[ROPE_MAX_HD / 2];
    __shared__ float buf[ROPE_WARPS][ROPE_MAX_HD];

    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = p.head_dim, half = p.rotary_dim >> 1;

    // cos/sin of this token's position, shared by every head task of the block.
    const float pos = (float)p.positions[t];
    for (int f = threadIdx.x; f < half; f += blockDim.x) {
        const float e = __fdiv_rn((float)(2 * f), (float)p.rotary_dim);
        const float inv_freq = __fdiv_rn(1.f, (float)pow((double)p.theta, (double)e));
        const float angle = __fmul_rn(pos, inv_freq);
        // Exact-enough range reduction in double (|angle| <= 2^18 for any position the model supports),
        // then the fast fp32 sin/cos on [-pi, pi] (abs error ~4e-7).
        const double k = rint((double)angle * 0.15915494309189535);
        const float r = (float)fma(-k, 6.283185307179586, (double)angle);
        float s, c;
        __sincosf(r, &s, &c);
        cs_cos[f] = c;
        cs_sin[f] = s;
    }
    __syncthreads();

    const int task = blockIdx.y * ROPE_WARPS + warp;
    const int qh = p.q_heads, kvh = p.kv_heads;
    if (task >= qh + 2 * kvh) return;
    const int i0 = lane * 8;
    const bool active = i0 < hd;

    long long slot = -1;
    if (task >= qh) {
        slot = p.slot_mapping[t];
        if (slot >= p.num_slots) slot = -1;
        if (slot < 0) return;  // nothing of this task is written
    }

    if (task >= qh + kvh) {  // v head: raw copy into the cache
        const int j = task - qh - kvh;
        if (active) {
            const bf16* src = p.v + ((size_t)t * kvh + j) * hd + i0;
            bf16* dst = p.v_cache + ((size_t)slot * kvh + j) * hd + i0;
            *reinterpret_cast<bf16x8*>(dst) = *reinterpret_cast<const bf16x8*>(src);
        }
        return;
    }

    const bool is_q = task < qh;
    const int h = is_q ? task : task - qh;
    const bf16* src = is_q ? p.qg + (size_t)t * qh * hd * (p.gated ? 2 : 1) + (size_t)h * hd * (p.gated ? 2 : 1)
                           : p.k + ((size_t)t * kvh + h) * hd;
    const bf16* w = is_q ? p.q_norm : p.k_norm;

    // 1. RMSNorm over the head, rounded to bf16 (the reference casts the norm output to the input dtype).
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float ss = 0.f;
    if (active) {
        load8(src + i0, x);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss += x[k] * x[k];
    }
    const float inv = rsqrtf(warp_sum(ss) / hd + p.eps);
    if (active) {
        float wv[8];
        load8(w + i0, wv);
        const float w_off = p.zero_centred ? 1.f : 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            x[k] = bf2f(f2bf(x[k] * inv * (w_off + wv[k])));
            buf[warp][i0 + k] = x[k];
        }
    }
    __syncwarp();

    // 2. NeoX RoPE on the first rotary_dim elements.
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int i = i0 + k;
        y[k] = x[k];
        if (active && i < 2 * half) {
            const int f = i < half ? i : i - half;
            const float c = cs_cos[f], s = cs_sin[f];
            y[k] = i < half ? x[k] * c - buf[warp][i + half] * s : x[k] * c + buf[warp][i - half] * s;
        }
    }
    if (!active) return;

    if (is_q) {
        store8(p.q_out + ((size_t)t * qh + h) * hd + i0, y);
        if (p.gated) {
            const bf16* g = src + hd + i0;
            *reinterpret_cast<bf16x8*>(p.gate_out + ((size_t)t * qh + h) * hd + i0) =
                *reinterpret_cast<const bf16x8*>(g);
        }
    } else {
        store8(p.k_cache + ((size_t)slot * kvh + h) * hd + i0, y);
    }
}
