// Device-side weight initialisation for `--load-format dummy` at full size (a 35B checkpoint is 70 GB:
// generating it on the host and uploading would take minutes; on the device it is bandwidth-bound).
//
// fill_uniform_bf16: x[i] = bf16(offset + scale * u(i)), u uniform in [-1, 1) from a counter-based hash of
//   (seed, i), so the values do not depend on the launch shape. Writes n*2 bytes.
// fill_uniform_f32: the same into f32 (GDN A_log / dt_bias).
//   Launch: grid-stride, block 256, grid = min(ceil(n / (256*8)), 65535*4); each thread writes 8 values.
#include "common.cuh"

__device__ __forceinline__ float hash_uniform(unsigned long long seed, unsigned long long i) {
    // splitmix64 of (seed, index): cheap, stateless, well mixed.
    unsigned long long z = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ x, unsigned long long n, unsigned long long seed,
                                             float scale, float offset) {
    PDL_ENTRY();
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x * 8;
    for (unsigned long long base = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * 8; base < n;
         base += stride) {
        if (base + 8 <= n && (((uintptr_t)(x + base)) & 15) == 0) {
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = offset + scale * hash_uniform(seed, base + k);
            store8(x + base, v);
        } else {
            for (unsigned long long i = base; i < n && i < base + 8; ++i)
                x[i] = f2bf(offset + scale * hash_uniform(seed, i));
        }
    }
}

extern "C" __global__ void fill_uniform_f32(float* __restrict__ x, unsigned long long n, unsigned long long seed,
                                            float scale, float offset) {
    PDL_ENTRY();
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = offset + scale * hash_uniform(seed, i);
}
