// Row-wise elementwise ops of the forward that no neighbouring kernel fuses yet (docs/qwen3_5_moe.md §2.5,
// §3.2). Memory-bound: one read of each input, one write; fp32 math, bf16 storage.
//
// silu_mul_bf16: out[r, c] = silu(gate[r*ld + c]) * up[r*ld + c] for c < cols. With gate and up two views of
//   one fused [gate | up] row (ld = 2*cols, up = gate + cols) this is the SwiGLU of a fused projection; with
//   separate buffers ld = cols. Bytes: reads 2*rows*cols*2, writes rows*cols*2.
// add_sigmoid_gated_bf16: acc[r, c] += sigmoid(gate[r]) * x[r, c] (the shared expert; gate f32, one per row).
//   Bytes: reads 2*rows*cols*2 + rows*4, writes rows*cols*2.
// concat_bf16: out[r] = [a[r] (ca columns) | b[r] (cb columns)]. Bytes: reads and writes rows*(ca+cb)*2.
//
// Launch (all three): grid-stride over rows*cols elements, block 256, grid = min(ceil(n/256), 65535*8).
#include "common.cuh"

struct SiluMulParams {
    const bf16* gate;
    const bf16* up;
    bf16* out;
    long long rows;
    int cols;
    int ld;
};

extern "C" __global__ void silu_mul_bf16(SiluMulParams p) {
    PDL_ENTRY();
    const long long n = p.rows * p.cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / p.cols, c = i % p.cols;
        const long long at = r * p.ld + c;
        p.out[i] = f2bf(silu(bf2f(p.gate[at])) * bf2f(p.up[at]));
    }
}

struct GatedAddParams {
    bf16* acc;
    const bf16* x;
    const float* gate;
    long long rows;
    int cols;
};

extern "C" __global__ void add_sigmoid_gated_bf16(GatedAddParams p) {
    PDL_ENTRY();
    const long long n = p.rows * p.cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / p.cols;
        p.acc[i] = f2bf(bf2f(p.acc[i]) + sigmoid(p.gate[r]) * bf2f(p.x[i]));
    }
}

struct ConcatParams {
    const bf16* a;
    const bf16* b;
    bf16* out;
    long long rows;
    int ca;
    int cb;
};

extern "C" __global__ void concat_bf16(ConcatParams p) {
    PDL_ENTRY();
    const int w = p.ca + p.cb;
    const long long n = p.rows * w;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / w;
        const int c = (int)(i % w);
        p.out[i] = c < p.ca ? p.a[r * p.ca + c] : p.b[r * p.cb + (c - p.ca)];
    }
}
