// Stream hold for kernel timing (`Gpu::time_kernels`, kernels/src/timing.rs), nothing the model runs.
//
// hold_cycles: one thread spins (sleeping 1 us between reads of the SM cycle counter) until `cycles` SM clock
//   cycles have passed, then exits. Queued first on an idle stream, it keeps the GPU busy while the host queues
//   the launches that follow, so each launch's pair of timing events brackets the kernel alone rather than the
//   host's launch latency. It always ends: the bound is a cycle count, not a flag anyone must set.
//   Memory traffic: none. Launch shape: 1 block of 1 thread.
#include "common.cuh"

extern "C" __global__ void hold_cycles(long long cycles) {
    PDL_ENTRY();
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) __nanosleep(1000);
}
