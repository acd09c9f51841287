// RMSNorm kernels. Grid: one block per row, blockDim multiple of 32.
#include "common.cuh"

// Residual add fused with the zero-centred norm that follows it:
// if delta: x[t] += delta[t]; out[t] = bf16(x[t] * rsqrt(mean(x^2) + eps) * w1p), w1p = 1 + w (f32).
extern "C" __global__ void add_rmsnorm_kernel(float* __restrict__ x, const float* __restrict__ delta,
                                              const float* __restrict__ w1p, bf16* __restrict__ out,
                                              int D, float eps) {
    pdl_wait();
    pdl_trigger();
    long t = blockIdx.x;
    float* xr = x + t * D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = __ldcg(xr + i);
        if (delta) {
            v += __ldcg(delta + t * D + i);
            xr[i] = v;
        }
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) out[t * D + i] = f2bf(__ldcg(xr + i) * inv * w1p[i]);
}

// GDN output norm per head: out = bf16(w * (o * rsqrt(mean(o^2) + eps)) * silu(z)).
// Grid: T*Hv blocks of Dv threads. o, z: [T, Hv, Dv] f32.
extern "C" __global__ void gated_rmsnorm_kernel(const float* __restrict__ o, const float* __restrict__ z,
                                                const float* __restrict__ w, bf16* __restrict__ out,
                                                int Dv, float eps) {
    long row = blockIdx.x;
    int i = threadIdx.x;
    float v = o[row * Dv + i];
    float inv = rsqrtf(block_sum(v * v) / Dv + eps);
    out[row * Dv + i] = f2bf(w[i] * (v * inv) * siluf_(z[row * Dv + i]));
}
