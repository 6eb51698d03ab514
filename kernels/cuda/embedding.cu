// Token embedding gather (docs/qwen3_5_moe.md §2.1): out[t] = table[ids[t]], no scaling.
//
// embedding_gather_bf16: ids i32 [T], table bf16 [V, H] row-major, out bf16 [T, H].
//   An id outside [0, V) zero-fills its output row and adds 1 to err[0] (one atomic per bad row; err may be
//   null: zero-fill only). The kernel never clears err: the caller zeroes it once, reads it when it synchronises anyway, and re-zeroes it after a
//   non-zero read. That keeps the launch free of host work (CUDA-graph friendly).
//   Bytes: reads T*4 (ids) + T*H*2 (rows), writes T*H*2.
//   Launch: grid = T (one block per token), block = 256. vec != 0 (H % 8 == 0, 16-byte aligned buffers): each
//   thread copies 16-byte vectors, a 2048-wide row is one vector per thread; else a strided scalar copy.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) embedding_gather_bf16(const int* __restrict__ ids,
                                                                       const bf16* __restrict__ table,
                                                                       bf16* __restrict__ out, int* __restrict__ err,
                                                                       int vocab, int hidden, int vec) {
    PDL_ENTRY();
    const size_t t = blockIdx.x;
    const int id = ids[t];
    const bool ok = id >= 0 && id < vocab;
    if (!ok && err != nullptr && threadIdx.x == 0) atomicAdd(err, 1);
    const bf16* src = table + (size_t)(ok ? id : 0) * hidden;
    bf16* dst = out + t * hidden;
    if (vec) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < (hidden >> 3); i += blockDim.x) d[i] = ok ? __ldg(s + i) : make_uint4(0, 0, 0, 0);
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = ok ? src[i] : f2bf(0.f);
    }
}
