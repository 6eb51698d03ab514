// Shared device helpers for nextn kernels (sm_90). Header-only; every .cu includes it.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

// Programmatic dependent launch (sm_90; Gpu::pdl in src/gpu.rs): every kernel is launched allowed to start
// while the previous kernel of the stream drains. pdl_wait() returns once that kernel has completed and its
// writes are visible; every block calls it, unconditionally, before it reads anything another kernel wrote
// and before it writes anything (a block that skipped it could let the grid finish early and break the
// chain: the next kernel waits only for this one). pdl_launch_dependents() then lets the next kernel's blocks
// be scheduled, so at most two grids overlap. The GEMVs stream their first weight tiles (which no kernel
// writes) before waiting. Both are no-ops when the launch did not ask for it.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#define PDL_ENTRY()              \
    do {                         \
        pdl_wait();              \
        pdl_launch_dependents(); \
    } while (0)

typedef __nv_bfloat16 bf16;

// 8 bf16 = 16 bytes: the unit of a coalesced vector load.
struct __align__(16) bf16x8 { __nv_bfloat162 h[4]; };

__device__ __forceinline__ float bf2f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 f2bf(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
    bf16x8 u = *reinterpret_cast<const bf16x8*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(u.h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(bf16* p, const float (&v)[8]) {
    bf16x8 u;
#pragma unroll
    for (int i = 0; i < 4; ++i) u.h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<bf16x8*>(p) = u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). All threads get the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : -INFINITY;
    return warp_max(v);
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }
