// Gated attention: q/k head norms + partial NeoX RoPE + KV-cache append, then
// causal attention over the cache with the sigmoid output gate fused in.
// Positions come from device memory (pos_ptr[0] = tokens already cached), so
// a decode step can be captured in a CUDA graph and replayed.
#include "common.cuh"

// Grid (T, Hq + Hkv), block Dh threads (Dh <= 1024, multiple of 32).
// qg: [T, Hq, (1 + gated) * Dh] f32 from q_proj, per head [query | gate];
// k, v: [T, Hkv, Dh] f32. q_out: [T, Hq, Dh] f32 (normed, rotated);
// kcache/vcache: [max_seq, Hkv, Dh] bf16, rows pos0..pos0+T written.
extern "C" __global__ void qk_prep_kernel(const float* __restrict__ qg, const float* __restrict__ k,
                                          const float* __restrict__ v, const float* __restrict__ qn1p,
                                          const float* __restrict__ kn1p, const int* __restrict__ pos_ptr,
                                          float* __restrict__ q_out, bf16* __restrict__ kcache,
                                          bf16* __restrict__ vcache, int Hq, int Hkv, int Dh, int rot,
                                          float theta, float eps, int gated) {
    __shared__ float buf[1024];
    int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    long pos = (long)pos_ptr[0] + t;
    bool is_q = h < Hq;
    int kh = h - Hq;
    float val = is_q ? qg[((long)t * Hq + h) * (gated ? 2 * Dh : Dh) + i] : k[((long)t * Hkv + kh) * Dh + i];
    float inv = rsqrtf(block_sum(val * val) / Dh + eps);
    float xn = val * inv * (is_q ? qn1p[i] : kn1p[i]);
    buf[i] = xn;
    __syncthreads();
    int half = rot / 2;
    float out = xn;
    if (i < rot) {
        int j = i < half ? i : i - half;
        float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)rot);
        float a = inv_freq * (float)pos;
        float c = cosf(a), s = sinf(a);
        out = i < half ? xn * c - buf[i + half] * s : xn * c + buf[i - half] * s;
    }
    if (is_q) {
        q_out[((long)t * Hq + h) * Dh + i] = out;
    } else {
        long row = (pos * Hkv + kh) * Dh + i;
        kcache[row] = f2bf(out);
        vcache[row] = f2bf(v[((long)t * Hkv + kh) * Dh + i]);
    }
}

// Causal attention for query rows pos0..pos0+T over cache rows 0..pos0+t.
// Grid (T, Hq), block 256 = 8 warps. Each warp takes every 8th key with its
// own online softmax; lanes hold Dh/32 dims (Dh <= 256, Dh % 32 == 0); the
// warps merge at the end. out: [T, Hq * Dh] bf16 = attn * sigmoid(gate).
#define ATT_WARPS 8
extern "C" __global__ void attention_kernel(const float* __restrict__ q, const bf16* __restrict__ kcache,
                                            const bf16* __restrict__ vcache, const float* __restrict__ qg,
                                            const int* __restrict__ pos_ptr, bf16* __restrict__ out,
                                            int Hq, int Hkv, int Dh, float scale, int gated) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][256];
    int t = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int per = Dh / 32;  // dims per lane, <= 8
    int kh = h / (Hq / Hkv);
    long n = (long)pos_ptr[0] + t + 1;
    float qv[8], acc[8];
    const float* qr = q + ((long)t * Hq + h) * Dh + lane * per;
    for (int d = 0; d < 8; d++) {
        qv[d] = d < per ? qr[d] * scale : 0.f;
        acc[d] = 0.f;
    }
    float m = -LILY_INF, l = 0.f;
    for (long j = w; j < n; j += ATT_WARPS) {
        const bf16* kr = kcache + (j * Hkv + kh) * Dh + lane * per;
        float s = 0.f;
        for (int d = 0; d < per; d++) s += qv[d] * bf2f(kr[d]);
        s = warp_sum(s);
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        const bf16* vr = vcache + (j * Hkv + kh) * Dh + lane * per;
        for (int d = 0; d < per; d++) acc[d] = acc[d] * corr + p * bf2f(vr[d]);
        m = mn;
    }
    if (lane == 0) {
        sm_m[w] = m;
        sm_l[w] = l;
    }
    for (int d = 0; d < per; d++) sm_acc[w][lane * per + d] = acc[d];
    __syncthreads();
    float M = -LILY_INF;
    for (int i = 0; i < ATT_WARPS; i++) M = fmaxf(M, sm_m[i]);
    float L = 0.f;
    for (int i = 0; i < ATT_WARPS; i++) L += sm_m[i] == -LILY_INF ? 0.f : sm_l[i] * expf(sm_m[i] - M);
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
        float o = 0.f;
        for (int i = 0; i < ATT_WARPS; i++)
            if (sm_m[i] != -LILY_INF) o += sm_acc[i][d] * expf(sm_m[i] - M);
        o /= L;
        if (gated) o *= sigmoidf_(qg[((long)t * Hq + h) * 2 * Dh + Dh + d]);
        out[((long)t * Hq + h) * Dh + d] = f2bf(o);
    }
}
