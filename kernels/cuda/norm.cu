// RMSNorm family (docs/qwen3_5_moe.md §2.2).
//
// rmsnorm_bf16: optional fused residual add, then zero-centred ("1 + w") or plain RMSNorm per row.
//   residual != nullptr:  residual[r] = x[r] + residual[r] (stored bf16, the residual stream), y = norm(residual[r])
//   residual == nullptr:  y = norm(x[r])
//   Bytes: reads rows*dim*2 (x) [+ rows*dim*2 residual] + dim*2 (w), writes rows*dim*2 [+ residual].
//   Launch: grid = rows, block = 256 (any multiple of 32 up to 1024); each thread keeps its slice of the row
//   in registers (dim <= 8 * 8 * block when dim % 8 == 0, else a strided scalar loop re-reading x).
//
// rmsnorm_gated_bf16 (GDN output norm): per head vector o (head_dim), n = o * rsqrt(mean(o^2) + eps),
//   y = (w * bf16(n)) * silu(z). w is plain (not zero-centred), shared by all heads.
//   Bytes: reads 2 * rows*heads*hd*2 (o, z) + hd*2, writes rows*heads*hd*2.
//   Launch: grid = (rows * heads), block = 128; requires head_dim % 8 == 0 and head_dim <= 8 * 128.
#include "common.cuh"

#define MAX_CHUNKS 8  // 8 vectors of 8 elements per thread: dim <= 64 * blockDim

extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, bf16* __restrict__ residual,
                                        const bf16* __restrict__ w, bf16* __restrict__ y, int dim, float eps,
                                        int zero_centred) {
    PDL_ENTRY();
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * dim;
    bf16* rr = residual ? residual + row * dim : nullptr;
    bf16* yr = y + row * dim;
    const float w_off = zero_centred ? 1.f : 0.f;

    if ((dim & 7) == 0 && dim <= MAX_CHUNKS * 8 * (int)blockDim.x) {
        float v[MAX_CHUNKS][8];
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < MAX_CHUNKS; ++c) {
            const int i = (c * blockDim.x + threadIdx.x) * 8;
            if (i < dim) {
                load8(xr + i, v[c]);
                if (rr) {
                    float r[8];
                    load8(rr + i, r);
#pragma unroll
                    for (int k = 0; k < 8; ++k) v[c][k] = bf2f(f2bf(v[c][k] + r[k]));  // residual is bf16
                    store8(rr + i, v[c]);
                }
#pragma unroll
                for (int k = 0; k < 8; ++k) ss += v[c][k] * v[c][k];
            }
        }
        const float inv = rsqrtf(block_sum(ss) / dim + eps);
#pragma unroll
        for (int c = 0; c < MAX_CHUNKS; ++c) {
            const int i = (c * blockDim.x + threadIdx.x) * 8;
            if (i < dim) {
                float wv[8], o[8];
                load8(w + i, wv);
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = v[c][k] * inv * (w_off + wv[k]);
                store8(yr + i, o);
            }
        }
        return;
    }
    // Awkward sizes: scalar, two passes over global memory.
    float ss = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = bf2f(xr[i]);
        if (rr) {
            v = bf2f(f2bf(v + bf2f(rr[i])));
            rr[i] = f2bf(v);
        }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss) / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = rr ? bf2f(rr[i]) : bf2f(xr[i]);
        yr[i] = f2bf(v * inv * (w_off + bf2f(w[i])));
    }
}

extern "C" __global__ void rmsnorm_gated_bf16(const bf16* __restrict__ o, const bf16* __restrict__ z,
                                              const bf16* __restrict__ w, bf16* __restrict__ y, int head_dim,
                                              float eps) {
    PDL_ENTRY();
    const size_t base = (size_t)blockIdx.x * head_dim;  // one (row, head) vector per block
    const int i = threadIdx.x * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float ss = 0.f;
    if (i < head_dim) {
        load8(o + base + i, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss += v[k] * v[k];
    }
    const float inv = rsqrtf(block_sum(ss) / head_dim + eps);
    if (i < head_dim) {
        float zv[8], wv[8], out[8];
        load8(z + base + i, zv);
        load8(w + i, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = wv[k] * bf2f(f2bf(v[k] * inv)) * silu(zv[k]);
        store8(y + base + i, out);
    }
}
