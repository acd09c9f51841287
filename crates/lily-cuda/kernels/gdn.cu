// Gated DeltaNet: causal conv1d + SiLU with its state, and the gated delta
// recurrence. The recurrence kernel serves decode and (token by token) prefill:
// a column c of a head's state S[:, c] evolves independently of the others
// given k, q, v[c], g and beta, so each lane owns one column in registers
// (Dk = 128 floats) and a warp covers 32 columns.
#include "common.cuh"
#define DK 128

// One thread per channel. mixed: [T, C] f32 pre-conv; state: [C, W-1] f32
// (oldest first); w: [C, W] f32; out: [T, C] f32 = silu(conv).
extern "C" __global__ void conv_silu_kernel(const float* __restrict__ mixed, float* __restrict__ state,
                                            const float* __restrict__ w, float* __restrict__ out,
                                            int T, int C, int W) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float hist[8];  // W <= 8
    for (int j = 0; j < W - 1; j++) hist[j] = state[(long)c * (W - 1) + j];
    float wc[8];
    for (int j = 0; j < W; j++) wc[j] = w[(long)c * W + j];
    for (int t = 0; t < T; t++) {
        float x = mixed[(long)t * C + c];
        float acc = wc[W - 1] * x;
        for (int j = 0; j < W - 1; j++) acc += wc[j] * hist[j];
        for (int j = 0; j < W - 2; j++) hist[j] = hist[j + 1];
        if (W > 1) hist[W - 2] = x;
        out[(long)t * C + c] = siluf_(acc);
    }
    for (int j = 0; j < W - 1; j++) state[(long)c * (W - 1) + j] = hist[j];
}

// Grid (Hv, Dv / 32), block 32. conv: [T, C] = [q (Hk*DK) | k (Hk*DK) | v (Hv*Dv)];
// ba: [T, 2*Hv] = [b | a] (in_proj_b and in_proj_a outputs); S: [Hv, DK, Dv] f32;
// o: [T, Hv, Dv] f32. v head j reads q/k head j / (Hv / Hk).
extern "C" __global__ void gdn_recurrent_kernel(const float* __restrict__ conv, const float* __restrict__ ba,
                                                const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                                float* __restrict__ S, float* __restrict__ o,
                                                int T, int Hk, int Hv, int Dv) {
    __shared__ float ks[DK], qs[DK];
    int j = blockIdx.x, lane = threadIdx.x;
    int c = blockIdx.y * 32 + lane;
    int kh = j / (Hv / Hk);
    long C = 2L * Hk * DK + (long)Hv * Dv;
    float s[DK];
    float* Sj = S + (long)j * DK * Dv;
#pragma unroll
    for (int r = 0; r < DK; r++) s[r] = Sj[(long)r * Dv + c];
    float A = expf(a_log[j]), dtb = dt_bias[j];
    const float qscale = rsqrtf((float)DK);
    for (int t = 0; t < T; t++) {
        const float* row = conv + t * C;
        float kv[4], qv[4], ksq = 0.f, qsq = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            qv[i] = row[kh * DK + lane * 4 + i];
            kv[i] = row[Hk * DK + kh * DK + lane * 4 + i];
            qsq += qv[i] * qv[i];
            ksq += kv[i] * kv[i];
        }
        float kinv = rsqrtf(warp_sum(ksq) + 1e-6f), qinv = rsqrtf(warp_sum(qsq) + 1e-6f) * qscale;
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ks[lane * 4 + i] = kv[i] * kinv;
            qs[lane * 4 + i] = qv[i] * qinv;
        }
        __syncwarp();
        float beta = sigmoidf_(ba[(long)t * 2 * Hv + j]);
        float g = -A * softplusf_(ba[(long)t * 2 * Hv + Hv + j] + dtb);
        float decay = expf(g);
        float vc = row[2 * Hk * DK + (long)j * Dv + c];
        float u = 0.f;
#pragma unroll
        for (int r = 0; r < DK; r++) {
            s[r] *= decay;
            u += s[r] * ks[r];
        }
        float delta = beta * (vc - u);
        float out = 0.f;
#pragma unroll
        for (int r = 0; r < DK; r++) {
            s[r] += ks[r] * delta;
            out += s[r] * qs[r];
        }
        o[((long)t * Hv + j) * Dv + c] = out;
    }
#pragma unroll
    for (int r = 0; r < DK; r++) Sj[(long)r * Dv + c] = s[r];
}
