// A step's metadata in one upload. The host packs every small buffer a step reads (tokens, positions, KV slots,
// block tables, state slots, ...) into one page-locked array; one asynchronous copy brings it to `src` on the
// device, and this kernel copies each section into its own buffer. The buffers keep their addresses from step to
// step (CUDA graphs replay against them), and the step costs one copy and one launch instead of a pageable copy
// per buffer (each of which the driver stages through a bounce buffer and may wait on the stream for).
//
// scatter_words: section s is the 32-bit words [off[s], off[s + 1]) of src, copied to dst[s][0 ..]. An i64
//   buffer is a section of two words per element (little-endian halves, as the host packed them).
//   Bytes: 2 · 4 · off[n] (read src, write the sections).
//   Launch: grid-stride over off[n] words, block 256, grid = min(ceil(off[n] / 256), 64).
#include "common.cuh"

#define SCATTER_MAX 16

struct ScatterParams {
    unsigned int* dst[SCATTER_MAX];
    int off[SCATTER_MAX + 1];  // off[0] = 0, nondecreasing
    int n;                     // sections, 1..SCATTER_MAX
};

// The sections are buffers the previous step's kernels read: written only after those finished (PDL_ENTRY).
extern "C" __global__ void scatter_words(const unsigned int* __restrict__ src, const ScatterParams p) {
    PDL_ENTRY();
    const int total = p.off[p.n];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        // The section holding word i (an unrolled compare chain: no dynamic indexing into the parameters).
        unsigned int* d = p.dst[0];
        int base = 0;
#pragma unroll
        for (int s = 1; s < SCATTER_MAX; ++s) {
            if (s < p.n && i >= p.off[s]) {
                d = p.dst[s];
                base = p.off[s];
            }
        }
        d[i - base] = src[i];
    }
}
