// Gated DeltaNet prefill in the chunked (UT-transform) form: the gated delta
// recurrence of lily-cpu's `GdnCore` (same inputs, same state, same output),
// computed chunk by chunk as its `head_chunked`.
//
// Within a chunk of n <= 64 tokens (v head j, its q/k head j / (Hv/Hk)), with
// q, k L2-normalised (q also scaled by Dk^-1/2), beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias) and gam = cumsum(g):
//   A[i,l] = beta_i (k_i . k_l) exp(gam_i - gam_l)            (l < i)
//   (I + A) U = beta v,  (I + A) W = beta k exp(gam)          (T = (I + A)^-1, U = T beta v, ...)
//   v' = U - W S
//   o_i = exp(gam_i) q_i S + sum_{l<=i} (q_i . k_l) exp(gam_i - gam_l) v'_l
//   S  <- exp(gam_{n-1}) S + sum_i exp(gam_{n-1} - gam_i) k_i v'_i^T
// Every exponent above is <= 0, so nothing overflows.
//
// Two kernels (the fla split), launched by kernels/gdn_chunked.rs gdn_chunked_prefill
// once per pass of at most a few dozen chunks (the scratch buffer bounds a pass;
// passes start on chunk boundaries, so only the sequence's last chunk is partial):
//
// 1. gdn_chunk_prep_kernel: grid (chunks in the pass, Hv), block 256. One block
//    per (chunk, v head), all independent. Computes everything that does not
//    depend on the state and writes it to the scratch record of (chunk, head):
//      W  [64][128]  solution of (I + A) W = beta k exp(gam)
//      Qg [64][128]  exp(gam_i) q_i
//      Kd [64][128]  exp(gam_{n-1} - gam_i) k_i
//      U  [64][Dv]   solution of (I + A) U = beta v
//      P  [64][64]   (q_i . k_l) exp(gam_i - gam_l) for l <= i, else 0
//      gl [4]        gam_{n-1} (3 floats of padding)
//    Rows i >= n (the padding of a partial last chunk) are all zero, so the
//    scan needs no masking except for the output rows it stores.
//    Record of (chunk c, head j) at scratch + (c * Hv + j) * GDN_CHUNK_FLOATS(Dv)
//    floats, where GDN_CHUNK_FLOATS(Dv) = 64 * (3 * 128 + Dv) + 64 * 64 + 4 (a
//    multiple of 4, so every row is 16-byte aligned for float4 loads).
//    Thread mapping: norms one warp per row; the two 64x64 Gram matrices (K K^T
//    and Q K^T) over 32-dim tiles of k and q in shared memory, thread
//    (ty = tid / 16, tx = tid % 16) owning rows ty + 16a and columns tx + 16b
//    (a, b < 4); T = (I + A)^-1 by forward substitution on the identity, one
//    row per step (63 barriers), 4 threads per column (partial sums over l mod 4,
//    combined by shuffles); then [U | W] = T [beta v | beta k exp(gam)] as a
//    64x64 by 64x(Dv + 128) product, 32 columns at a time: the right-hand side
//    tile in shared memory, warp w computing rows 8w .. 8w+7, lane = column.
//    Static shared memory 34,816 bytes (k/q tiles reused for T, A for the
//    right-hand side tile); 80 registers, no spills (nvcc 13.0, sm_90a).
//
// 2. gdn_chunk_scan_kernel: grid (Hv, Dv / 32), block 256 (8 warps). Block
//    (j, y) owns columns y*32 .. y*32+31 of head j's state, S[:, cols] (128 x 32
//    f32, 16 KB) in shared memory, lane = column, and walks the pass's chunks
//    in order. Per chunk: warp w computes v' and the state part of o for rows
//    i = 8w .. 8w+7 (W and Qg rows are warp-uniform float4 loads, S from shared
//    memory), stores v' in shared memory (64 x 32, 8 KB); after a barrier adds
//    P v' to o and stores o; then updates state rows r = 16w .. 16w+15 from Kd
//    (warp-uniform float4 loads) and v'. Static shared memory 24,576 bytes;
//    56 registers, no spills.
//
// conv: [T, C] f32, C = 2*Hk*128 + Hv*Dv, per token q (Hk*128) | k (Hk*128) |
// v (Hv*Dv), conv+SiLU'd, not normalised. ba: [T, 2*Hv] f32 = [b | a].
// a_log, dt_bias: [Hv] f32. S: [Hv, 128, Dv] f32, read and overwritten.
// o: [T, Hv, Dv] f32 (must not overlap conv). Tokens t0 .. t1-1 are this pass
// (t0 a multiple of 64); the scratch record index is relative to t0.
#include "common.cuh"
#define DK 128
#define CH 64
#define NTHR 256  // both kernels: exactly 256 threads (8 warps) per block
#define GDN_CHUNK_FLOATS(Dv) ((long)CH * (3 * DK + (Dv)) + CH * CH + 4)

extern "C" __global__ void gdn_chunk_prep_kernel(const float* __restrict__ conv, const float* __restrict__ ba,
                                                 const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                                 float* __restrict__ scratch, int t0, int t1, int Hk, int Hv,
                                                 int Dv) {
    // sm1: 32-dim tiles of raw k and q (kt, qt [64][33]), later T = (I + A)^-1 [64][64].
    // As: A [64][64] (strictly lower), later the right-hand-side tile [64][32].
    __shared__ __align__(16) float sm1[2 * CH * 33];
    __shared__ __align__(16) float As[CH][CH];
    float(*kt)[33] = reinterpret_cast<float(*)[33]>(sm1);
    float(*qt)[33] = reinterpret_cast<float(*)[33]>(sm1 + CH * 33);
    __shared__ float gam[CH], beta[CH], kinv[CH], qinv[CH], eg[CH], ed[CH];
    const int cb = blockIdx.x, j = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c0 = t0 + cb * CH, n = min(CH, t1 - c0);
    const int kh = j / (Hv / Hk);
    const long C = 2L * Hk * DK + (long)Hv * Dv;
    const float* qb = conv + (long)c0 * C + (long)kh * DK;
    const float* kb = qb + (long)Hk * DK;
    const float* vb = conv + (long)c0 * C + 2L * Hk * DK + (long)j * Dv;
    float* W = scratch + ((long)cb * Hv + j) * GDN_CHUNK_FLOATS(Dv);
    float* Qg = W + CH * DK;
    float* Kd = Qg + CH * DK;
    float* U = Kd + CH * DK;
    float* P = U + (long)CH * Dv;
    float* gl = P + CH * CH;

    // Inverse norms (q's with the Dk^-1/2 scale), as the CPU's prepare; 0 on padding rows.
    for (int i = warp; i < CH; i += (NTHR / 32)) {
        float qs = 0.f, ks = 0.f;
        if (i < n) {
            for (int r = lane; r < DK; r += 32) {
                float qv = qb[(long)i * C + r], kv = kb[(long)i * C + r];
                qs += qv * qv;
                ks += kv * kv;
            }
        }
        qs = warp_sum(qs);
        ks = warp_sum(ks);
        if (lane == 0) {
            qinv[i] = i < n ? rsqrtf(qs + 1e-6f) * rsqrtf((float)DK) : 0.f;
            kinv[i] = i < n ? rsqrtf(ks + 1e-6f) : 0.f;
        }
    }
    // Gates; padding rows get g = 0 (gam stays at gam_{n-1}) and beta = 0.
    if (tid < CH) {
        float g = 0.f, b = 0.f;
        if (tid < n) {
            const float* row = ba + (long)(c0 + tid) * 2 * Hv;
            b = sigmoidf_(row[j]);
            g = -expf(a_log[j]) * softplusf_(row[Hv + j] + dt_bias[j]);
        }
        gam[tid] = g;
        beta[tid] = b;
    }
    __syncthreads();
    if (tid == 0) {  // sequential, in the CPU reference's order
        float acc = 0.f;
        for (int i = 0; i < CH; i++) {
            acc += gam[i];
            gam[i] = acc;
        }
        gl[0] = gam[n - 1];
        gl[1] = 0.f;
        gl[2] = 0.f;
        gl[3] = 0.f;
    }
    __syncthreads();
    const float glast = gam[n - 1];
    if (tid < CH) {
        eg[tid] = tid < n ? expf(gam[tid]) : 0.f;
        ed[tid] = tid < n ? expf(glast - gam[tid]) : 0.f;
    }

    // Raw Gram matrices K K^T and Q K^T over 32-dim tiles.
    const int ty = tid >> 4, tx = tid & 15;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) kk[a][b] = qk[a][b] = 0.f;
    for (int d0 = 0; d0 < DK; d0 += 32) {
        __syncthreads();
        for (int e = tid; e < CH * 32; e += NTHR) {
            int i = e >> 5, d = e & 31;
            float kv = 0.f, qv = 0.f;
            if (i < n) {
                kv = kb[(long)i * C + d0 + d];
                qv = qb[(long)i * C + d0 + d];
            }
            kt[i][d] = kv;
            qt[i][d] = qv;
        }
        __syncthreads();
        {
#pragma unroll 4
            for (int d = 0; d < 32; d++) {
                float ka[4], qa[4], kc[4];
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    ka[a] = kt[ty + 16 * a][d];
                    qa[a] = qt[ty + 16 * a][d];
                    kc[a] = kt[tx + 16 * a][d];
                }
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        kk[a][b] += ka[a] * kc[b];
                        qk[a][b] += qa[a] * kc[b];
                    }
            }
        }
    }
    {
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                int i = ty + 16 * a, l = tx + 16 * b;
                float av = 0.f, pv = 0.f;
                if (i < n) {
                    float e = l <= i ? expf(gam[i] - gam[l]) : 0.f;
                    if (l < i) av = beta[i] * (kk[a][b] * kinv[i] * kinv[l]) * e;
                    if (l <= i) pv = (qk[a][b] * qinv[i] * kinv[l]) * e;
                }
                As[i][l] = av;
                P[i * CH + l] = pv;
            }
    }
    __syncthreads();

    // T = (I + A)^-1 by forward substitution on the identity, row by row:
    // T[i][c] = -sum_{l<i} A[i][l] T[l][c] for c < i (T[l][c] = 0 for l < c).
    // Thread tid: column c = tid / 4, partial sum over l = tid % 4 (mod 4).
    float* T = sm1;  // the k/q tiles are dead
    for (int e = tid; e < CH * CH; e += NTHR) T[e] = (e >> 6) == (e & (CH - 1)) ? 1.f : 0.f;
    __syncthreads();
    {
        const int c = tid >> 2, part = tid & 3;
        for (int i = 1; i < CH; i++) {
            float acc = 0.f;
            for (int l = part; l < i; l += 4) acc += As[i][l] * T[l * CH + c];
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            if (part == 0 && c < i) T[i * CH + c] = -acc;
            __syncthreads();
        }
    }

    // [U | W] = T [beta v | beta k exp(gam)], 32 columns at a time: the right-hand
    // side tile B [64][32] in shared memory (A is dead), warp w computing rows
    // 8w .. 8w+7 (T rows warp-uniform), lane = column.
    float* B = &As[0][0];
    const int i0 = warp * 8;
    for (int c0t = 0; c0t < Dv + DK; c0t += 32) {
        const int col = c0t + lane;
        const bool isU = col < Dv;
        const int r = col - Dv;
        for (int l = warp; l < CH; l += (NTHR / 32)) {
            float rhs = 0.f;
            if (l < n) rhs = isU ? beta[l] * vb[(long)l * C + col] : beta[l] * (kb[(long)l * C + r] * kinv[l]) * eg[l];
            B[l * 32 + lane] = rhs;
        }
        __syncthreads();
        float acc[8];
#pragma unroll
        for (int m = 0; m < 8; m++) acc[m] = 0.f;
        for (int l = 0; l < i0 + 8; l += 4) {
            float b0 = B[l * 32 + lane], b1 = B[(l + 1) * 32 + lane], b2 = B[(l + 2) * 32 + lane],
                  b3 = B[(l + 3) * 32 + lane];
#pragma unroll
            for (int m = 0; m < 8; m++) {
                float4 t = *reinterpret_cast<const float4*>(T + (i0 + m) * CH + l);
                acc[m] += t.x * b0;
                acc[m] += t.y * b1;
                acc[m] += t.z * b2;
                acc[m] += t.w * b3;
            }
        }
#pragma unroll
        for (int m = 0; m < 8; m++) {
            if (isU)
                U[(long)(i0 + m) * Dv + col] = acc[m];
            else
                W[(i0 + m) * DK + r] = acc[m];
        }
        __syncthreads();  // B is rewritten next
    }

    // Decayed q and k.
    for (int e = tid; e < CH * DK; e += NTHR) {
        int i = e >> 7, r = e & (DK - 1);
        float qv = 0.f, kv = 0.f;
        if (i < n) {
            qv = (qb[(long)i * C + r] * qinv[i]) * eg[i];
            kv = (kb[(long)i * C + r] * kinv[i]) * ed[i];
        }
        Qg[e] = qv;
        Kd[e] = kv;
    }
}

extern "C" __global__ void gdn_chunk_scan_kernel(const float* __restrict__ scratch, float* __restrict__ S,
                                                 float* __restrict__ o, int t0, int t1, int Hv, int Dv) {
    __shared__ float Ss[DK][32];  // S[:, cols]
    __shared__ float Vp[CH][32];  // v'[:, cols]
    const int j = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.y * 32 + lane;
    float* Sj = S + (long)j * DK * Dv;
    for (int r = warp; r < DK; r += 8) Ss[r][lane] = Sj[(long)r * Dv + col];
    __syncthreads();
    const int nc = (t1 - t0 + CH - 1) / CH;
    const int i0 = warp * 8, r0 = warp * 16;
    for (int cb = 0; cb < nc; cb++) {
        const int c0 = t0 + cb * CH, n = min(CH, t1 - c0);
        const float* W = scratch + ((long)cb * Hv + j) * GDN_CHUNK_FLOATS(Dv);
        const float* Qg = W + CH * DK;
        const float* Kd = Qg + CH * DK;
        const float* U = Kd + CH * DK;
        const float* P = U + (long)CH * Dv;
        const float* gl = P + CH * CH;

        // v' = U - W S and o = Qg S for rows i0 .. i0+7.
        float va[8], oa[8];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            va[m] = U[(long)(i0 + m) * Dv + col];
            oa[m] = 0.f;
        }
        for (int r = 0; r < DK; r += 4) {
            float s0 = Ss[r][lane], s1 = Ss[r + 1][lane], s2 = Ss[r + 2][lane], s3 = Ss[r + 3][lane];
#pragma unroll
            for (int m = 0; m < 8; m++) {
                float4 w = *reinterpret_cast<const float4*>(W + (i0 + m) * DK + r);
                float4 q = *reinterpret_cast<const float4*>(Qg + (i0 + m) * DK + r);
                va[m] -= w.x * s0;
                va[m] -= w.y * s1;
                va[m] -= w.z * s2;
                va[m] -= w.w * s3;
                oa[m] += q.x * s0;
                oa[m] += q.y * s1;
                oa[m] += q.z * s2;
                oa[m] += q.w * s3;
            }
        }
#pragma unroll
        for (int m = 0; m < 8; m++) Vp[i0 + m][lane] = va[m];
        __syncthreads();  // v' complete; every read of Ss for this chunk is done

        // o += P v' (P is 0 above the diagonal, so l runs to the warp's last row).
        for (int l = 0; l < i0 + 8; l += 4) {
            float v0 = Vp[l][lane], v1 = Vp[l + 1][lane], v2 = Vp[l + 2][lane], v3 = Vp[l + 3][lane];
#pragma unroll
            for (int m = 0; m < 8; m++) {
                float4 p = *reinterpret_cast<const float4*>(P + (i0 + m) * CH + l);
                oa[m] += p.x * v0;
                oa[m] += p.y * v1;
                oa[m] += p.z * v2;
                oa[m] += p.w * v3;
            }
        }
#pragma unroll
        for (int m = 0; m < 8; m++)
            if (i0 + m < n) o[((long)(c0 + i0 + m) * Hv + j) * Dv + col] = oa[m];

        // S rows r0 .. r0+15: exp(gam_{n-1}) S + sum_i Kd_i v'_i.
        const float el = expf(gl[0]);
        float sa[16];
#pragma unroll
        for (int m = 0; m < 16; m++) sa[m] = el * Ss[r0 + m][lane];
        for (int i = 0; i < n; i++) {
            float v = Vp[i][lane];
#pragma unroll
            for (int q4 = 0; q4 < 4; q4++) {
                float4 k = *reinterpret_cast<const float4*>(Kd + i * DK + r0 + 4 * q4);
                sa[4 * q4] += k.x * v;
                sa[4 * q4 + 1] += k.y * v;
                sa[4 * q4 + 2] += k.z * v;
                sa[4 * q4 + 3] += k.w * v;
            }
        }
#pragma unroll
        for (int m = 0; m < 16; m++) Ss[r0 + m][lane] = sa[m];
        __syncthreads();  // next chunk reads all of Ss and rewrites Vp
    }
    for (int r = warp; r < DK; r += 8) Sj[(long)r * Dv + col] = Ss[r][lane];
}
