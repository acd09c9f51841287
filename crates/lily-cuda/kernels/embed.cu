// Embedding lookup and procedural (synthetic) weight generation.
#include "common.cuh"

// x[t, :] = table[ids[t], :] widened to f32. Grid: T blocks.
extern "C" __global__ void embed_kernel(const bf16* __restrict__ table, const int* __restrict__ ids,
                                        float* __restrict__ x, int D) {
    long t = blockIdx.x;
    long row = ids[t];
    for (int i = threadIdx.x; i < D; i += blockDim.x) x[t * D + i] = bf2f(table[row * D + i]);
}

// The synthetic models' weights, bit-identical to lily_model::tensor::Procedural::value:
// splitmix64 of (seed, index), top 24 bits to a unit-variance uniform, rounded to bf16.
// Explicit _rn intrinsics keep the compiler from fusing into FMAs the CPU does not use.
// Elements start..start+n of the tensor go to out[0..n).
extern "C" __global__ void procedural_fill_kernel(bf16* __restrict__ out, u64 n, u64 start, u64 seed, float mean, float std_) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = seed ^ ((i + start) * 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = __fmul_rn((float)(z >> 40), 1.0f / 16777216.0f);
        float c = __fsub_rn(__fmul_rn(u, 2.0f), 1.0f);
        float v = __fadd_rn(mean, __fmul_rn(__fmul_rn(std_, c), 1.7320508f));
        out[i] = f2bf(v);
    }
}

// dst[0] = src[0]: feeds the token a decode step chose into the next step
// without a trip through the host.
extern "C" __global__ void copy_i32_kernel(const int* __restrict__ src, int* __restrict__ dst) {
    if (threadIdx.x == 0) dst[0] = src[0];
}
