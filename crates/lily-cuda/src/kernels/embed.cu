// Embedding lookup and procedural (synthetic) weight generation.
#include "common.cuh"

// x[t, :] = table[ids[t], :] widened to f32. Grid: T blocks.
extern "C" __global__ void embed_kernel(const bf16* __restrict__ table, const int* __restrict__ ids,
                                        float* __restrict__ x, int D) {
    TRACE(embed_kernel);
    pdl_wait();
    pdl_trigger();
    long t = blockIdx.x;
    long row = __ldcg(ids + t);
    for (int i = threadIdx.x; i < D; i += blockDim.x) x[t * D + i] = bf2f(table[row * D + i]);
}

// The synthetic models' weights, bit-identical to lily_model::tensor::Procedural::value:
// splitmix64 of (seed, index), top 24 bits to a unit-variance uniform, rounded to bf16.
// Explicit _rn intrinsics keep the compiler from fusing into FMAs the CPU does not use.
// Elements start..start+n of the tensor go to out[0..n).
__device__ __forceinline__ u64 splitmix(u64 seed, u64 i) {
    u64 z = seed ^ (i * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float procedural_value(u64 seed, u64 i, float mean, float std_) {
    u64 z = splitmix(seed, i);
    float u = __fmul_rn((float)(z >> 40), 1.0f / 16777216.0f);
    float c = __fsub_rn(__fmul_rn(u, 2.0f), 1.0f);
    return __fadd_rn(mean, __fmul_rn(__fmul_rn(std_, c), 1.7320508f));
}

extern "C" __global__ void procedural_fill_kernel(bf16* __restrict__ out, u64 n, u64 start, u64 seed, float mean, float std_) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f2bf(procedural_value(seed, i + start, mean, std_));
}

// Row-scaled variant (lily_model::tensor::Procedural::value_rows): each row of
// `cols` elements is multiplied by 2^k, k = popcount(16 hashed bits) - 11; a
// power of two keeps the bf16 value exact.
#define ROW_SALT 0x5851F42D4C957F2Dull
extern "C" __global__ void procedural_rows_fill_kernel(bf16* __restrict__ out, u64 n, u64 start, u64 seed, float mean,
                                                       float std_, u64 cols) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 g = i + start;
        int k = __popcll(splitmix(seed ^ ROW_SALT, g / cols) & 0xffffull) - 11;
        out[i] = f2bf(__fmul_rn(bf2f(f2bf(procedural_value(seed, g, mean, std_))), exp2f((float)k)));
    }
}
