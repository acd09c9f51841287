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
    TRACE(TK_QK_PREP);
    __shared__ float buf[1024];
    pdl_wait();
    pdl_trigger();
    int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    long pos = (long)__ldcg(pos_ptr) + t;
    bool is_q = h < Hq;
    int kh = h - Hq;
    float val = is_q ? __ldcg(qg + ((long)t * Hq + h) * (gated ? 2 * Dh : Dh) + i) : __ldcg(k + ((long)t * Hkv + kh) * Dh + i);
    // (v requested with q/k: one L2 round trip for every input, not two)
    const float vv = is_q ? 0.f : __ldcg(v + ((long)t * Hkv + kh) * Dh + i);
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
        vcache[row] = f2bf(vv);
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

// ---------------------------------------------------------------------------
// Split-K ("flash decoding") attention for one query token (decode), two
// kernels on the stream:
//  1. attention_decode_partial_kernel, grid (Hkv * ceil(G / 8), splits), block
//     ATTD_WARPS * 32 threads, G = Hq / Hkv: each block takes up to 8 query
//     heads of one KV head (the whole GQA group of the released model) and one
//     contiguous key range, reads every K and V row of that range once for all
//     its heads, and writes an unnormalised partial (m, l, acc[Dh]) per head.
//  2. attention_decode_merge_kernel, grid (Hq, ceil(Dh / 32)), block
//     ATTD_MERGE_WARPS * 32: merges a head's splits, divides by l, applies the
//     output gate and writes bf16 out[Hq * Dh], exactly as attention_kernel
//     does for T = 1.
// The number of keys n = pos_ptr[0] + 1 is read from device memory and split
// `splits` ways in-kernel (ceil(n / splits) keys each), so grid and arguments
// do not depend on the position and the pair can be captured in a CUDA graph;
// a split whose range is empty writes the neutral partial (m = -inf, l = 0,
// acc = 0), which the merge skips.
//
// Partials (f32), `part`: acc [Hq, splits, Dh], then m [Hq, splits], then
// l [Hq, splits]. m is in log2 units (scores are pre-multiplied by log2 e so
// the exponentials are exp2f); the merge uses the same units.
//
// Within a block, warp w takes a contiguous share (a multiple of ATTD_BATCH
// keys) of the block's range and runs its own online softmax over it, in
// batches of ATTD_BATCH keys: the batch's K rows are loaded together (16 bytes
// per lane per row, lane l holding dims 8l..8l+7, so a row is one coalesced
// 512-byte warp load), scores for all 8 heads come from one transposing
// shuffle reduction (9 shuffles per key instead of 40), then the batch's
// softmax weights go through shared memory to every lane and the V rows of the
// batch are loaded together and accumulated. The warps merge through shared
// memory at the end. Needs Dh % 8 == 0 and Dh <= 256. ptxas (sm_90a): 255
// registers, no spills, 34 KB static shared memory: 2 blocks (8 warps) an SM.
#define ATTD_WARPS 4
#define ATTD_HEADS 8
#define ATTD_BATCH 8
#define ATTD_MERGE_WARPS 8
#define ATTD_MAX_SPLITS 1024
#define ATTD_LOG2E 1.4426950408889634f

// p[i], i < 8: one lane's partial dot products for the heads i ^ ((lane >> 2) & 7)
// (each lane keeps its q heads in that order). Returns the sum over the warp
// of the lane's head (lane >> 2) & 7, i.e. of p[0]: at xor step 16 a lane's
// p[i + 4] is its partner's p[i] head, so p[i] += partner's p[i + 4] (i < 4)
// sums that head over both lanes; likewise at 8 (i < 2) and 4 (i = 0); xor 2
// and 1 pair lanes of the same head. 9 shuffles and no selects for 8 heads.
__device__ __forceinline__ float attd_reduce8(float* p) {
#pragma unroll
    for (int i = 0; i < 4; i++) p[i] += __shfl_xor_sync(0xffffffffu, p[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; i++) p[i] += __shfl_xor_sync(0xffffffffu, p[i + 2], 8);
    float s = p[0] + __shfl_xor_sync(0xffffffffu, p[1], 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s;
}

// q: [Hq, Dh] f32 (normed, rotated); kcache/vcache: [max_seq, Hkv, Dh] bf16;
// part: see above. scale: the softmax scale (Dh^-1/2).
extern "C" __global__ void attention_decode_partial_kernel(const float* __restrict__ q,
                                                           const bf16* __restrict__ kcache,
                                                           const bf16* __restrict__ vcache,
                                                           const int* __restrict__ pos_ptr, float* __restrict__ part,
                                                           int Hq, int Hkv, int Dh, int splits, float scale) {
    TRACE(TK_ATTN_PARTIAL);
    __shared__ __align__(16) float sm_p[ATTD_WARPS][ATTD_BATCH][ATTD_HEADS];
    __shared__ __align__(16) float sm_c[ATTD_WARPS][ATTD_HEADS];
    __shared__ __align__(16) float sm_acc[ATTD_WARPS][ATTD_HEADS][256];
    __shared__ float sm_m[ATTD_WARPS][ATTD_HEADS], sm_l[ATTD_WARPS][ATTD_HEADS], sm_f[ATTD_WARPS][ATTD_HEADS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int G = Hq / Hkv, cpg = (G + ATTD_HEADS - 1) / ATTD_HEADS;
    const int kh = blockIdx.x / cpg, c = blockIdx.x % cpg;
    const int h0 = kh * G + c * ATTD_HEADS, nh = min(ATTD_HEADS, G - c * ATTD_HEADS);
    const int s = blockIdx.y;
    // This split's keys [k0, k1), then this warp's share [a, b). The
    // position was set before the step (by the host, or the previous step's
    // last kernel), so it is read before the PDL wait.
    const long n = (long)__ldcg(pos_ptr) + 1;
    const long chunk = (n + splits - 1) / splits;
    const long k0 = min((long)s * chunk, n), k1 = min(k0 + chunk, n);
    const long per = ((k1 - k0 + ATTD_WARPS - 1) / ATTD_WARPS + ATTD_BATCH - 1) / ATTD_BATCH * ATTD_BATCH;
    const long a = min(k0 + w * per, k1), b = min(a + per, k1);
    // The warp's first two batches of K and V rows, prefetched into L2 while
    // the kernel before (the q/k preparation) finishes: at 4k context that is
    // the warp's whole share, and its DRAM latency is then paid in that
    // kernel's shadow. (Row n - 1, which that kernel writes, is coherent in
    // L2; nothing is read into registers or L1 before the wait.)
#pragma unroll
    for (int bt = 0; bt < 2; bt++) {
        const int j = lane >> 2, part = lane & 3;  // 8 rows x 4 lines of 128 bytes
        const long r = a + bt * ATTD_BATCH + j;
        if (r < b && part * 64 < Dh) {
            const long off = (r * Hkv + kh) * (long)Dh + part * 64;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kcache + off));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vcache + off));
        }
    }
    pdl_wait();
    pdl_trigger();
    const int d0 = lane * 8;
    const bool act = d0 < Dh;  // lanes past Dh read dims 0..7 with q = 0 and store nothing
    const int hl = lane >> 2;  // the head attd_reduce8 leaves in this lane

    // qv[i]: head i ^ hl (attd_reduce8's order), pre-scaled into log2 units.
    float qv[ATTD_HEADS][8], acc[ATTD_HEADS][8];
    const float qs = scale * ATTD_LOG2E;
#pragma unroll
    for (int i = 0; i < ATTD_HEADS; i++) {
        const int h = i ^ hl;
        float4 x = {0.f, 0.f, 0.f, 0.f}, y = {0.f, 0.f, 0.f, 0.f};
        if (h < nh && act) {
            const float4* qr = reinterpret_cast<const float4*>(q + (long)(h0 + h) * Dh + d0);
            x = __ldcg(qr);
            y = __ldcg(qr + 1);
        }
        qv[i][0] = x.x * qs, qv[i][1] = x.y * qs, qv[i][2] = x.z * qs, qv[i][3] = x.w * qs;
        qv[i][4] = y.x * qs, qv[i][5] = y.y * qs, qv[i][6] = y.z * qs, qv[i][7] = y.w * qs;
#pragma unroll
        for (int d = 0; d < 8; d++) acc[i][d] = 0.f;
    }
    // Softmax state (log2 units) of head hl; the 4 lanes of a head hold
    // identical copies.
    float m = -LILY_INF, l = 0.f;
    const long rs = (long)Hkv * Dh;
    const bf16* kb = kcache + (long)kh * Dh + (act ? d0 : 0);
    const bf16* vb = vcache + (long)kh * Dh + (act ? d0 : 0);
    for (long j0 = a; j0 < b; j0 += ATTD_BATCH) {
        // A short last batch re-reads row b - 1 (cached) for its missing
        // keys; their scores are masked to -inf, so their weights are 0.
        const int nb = (int)min((long)ATTD_BATCH, b - j0);
        uint4 raw[ATTD_BATCH];
#pragma unroll
        for (int j = 0; j < ATTD_BATCH; j++)
            raw[j] = __ldcg(reinterpret_cast<const uint4*>(kb + (j0 + min(j, nb - 1)) * rs));
        float sc[ATTD_BATCH];
#pragma unroll
        for (int j = 0; j < ATTD_BATCH; j++) {
            float kf[8], pr[ATTD_HEADS];
            unpack8(raw[j], kf);
#pragma unroll
            for (int h = 0; h < ATTD_HEADS; h++) {
                float t = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) t = fmaf(qv[h][i], kf[i], t);
                pr[h] = t;
            }
            const float sj = attd_reduce8(pr);
            sc[j] = j < nb ? sj : -LILY_INF;
        }
        float bm = sc[0];
#pragma unroll
        for (int j = 1; j < ATTD_BATCH; j++) bm = fmaxf(bm, sc[j]);
        const float mn = fmaxf(m, bm);  // finite: the batch has a key
        const float corr = exp2f(m - mn);
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < ATTD_BATCH; j++) {
            sc[j] = exp2f(sc[j] - mn);
            ps += sc[j];
        }
        l = l * corr + ps;
        const bool grow = mn > m;
        m = mn;
        if ((lane & 3) == 0) {
#pragma unroll
            for (int j = 0; j < ATTD_BATCH; j++) sm_p[w][j][hl] = sc[j];
            sm_c[w][hl] = corr;
        }
        __syncwarp();
        if (__any_sync(0xffffffffu, grow)) {  // else every corr is exactly 1
            const float4* cp = reinterpret_cast<const float4*>(sm_c[w]);
            const float4 c0 = cp[0], c1 = cp[1];
            const float cf[ATTD_HEADS] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
            for (int h = 0; h < ATTD_HEADS; h++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] *= cf[h];
        }
#pragma unroll
        for (int j = 0; j < ATTD_BATCH; j++)
            raw[j] = __ldcg(reinterpret_cast<const uint4*>(vb + (j0 + min(j, nb - 1)) * rs));
#pragma unroll
        for (int j = 0; j < ATTD_BATCH; j++) {
            float vf[8];
            unpack8(raw[j], vf);
            const float4* pp = reinterpret_cast<const float4*>(sm_p[w][j]);
            const float4 p0 = pp[0], p1 = pp[1];
            const float pj[ATTD_HEADS] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
            for (int h = 0; h < ATTD_HEADS; h++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] = fmaf(pj[h], vf[i], acc[h][i]);
        }
        __syncwarp();  // sm_p / sm_c are rewritten by the next batch
    }

    // Merge the warps: per head, M = max of the warps' m, weights 2^(m_w - M).
    if ((lane & 3) == 0) {
        sm_m[w][hl] = m;
        sm_l[w][hl] = l;
    }
    if (act) {
#pragma unroll
        for (int h = 0; h < ATTD_HEADS; h++) {
            float4* dst = reinterpret_cast<float4*>(&sm_acc[w][h][d0]);
            dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
        }
    }
    __syncthreads();
    const long pbase = (long)Hq * splits * Dh;  // m, then l, follow acc
    if (threadIdx.x < ATTD_HEADS) {
        const int h = threadIdx.x;
        float M = -LILY_INF, L = 0.f;
        for (int i = 0; i < ATTD_WARPS; i++) M = fmaxf(M, sm_m[i][h]);
        for (int i = 0; i < ATTD_WARPS; i++) {
            const float f = sm_m[i][h] == -LILY_INF ? 0.f : exp2f(sm_m[i][h] - M);
            sm_f[i][h] = f;
            L += sm_l[i][h] * f;
        }
        if (h < nh) {
            const long r = (long)(h0 + h) * splits + s;
            part[pbase + r] = M;
            part[pbase + (long)Hq * splits + r] = L;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nh * Dh; e += blockDim.x) {
        const int h = e / Dh, d = e - h * Dh;
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < ATTD_WARPS; i++) o += sm_acc[i][h][d] * sm_f[i][h];
        part[((long)(h0 + h) * splits + s) * Dh + d] = o;
    }
}

// Grid (Hq, ceil(Dh / 32)), block ATTD_MERGE_WARPS * 32: block (h, y) merges
// dims 32y..32y+31 of head h, warp w the splits w, w + 8, .... Every load of
// the common case (splits <= ATTD_MERGE_WARPS * ATTD_MERGE_UNROLL = 264:
// the split's m and l, the warp's ATTD_MERGE_UNROLL partial sums) is issued
// right after the wait, before the weights that scale them are known, so the
// merge costs one L2 round trip instead of one per dependent step. Empty
// splits hold m = -inf, l = 0, acc = 0: weight 0, and their zeros add nothing.
// part: as written by attention_decode_partial_kernel (splits <=
// ATTD_MAX_SPLITS); qg: [Hq, (1 + gated) * Dh] f32, per head [query | gate];
// out: [Hq * Dh] bf16 = attn * sigmoid(gate).
#define ATTD_MERGE_UNROLL 33
extern "C" __global__ void attention_decode_merge_kernel(const float* __restrict__ part, const float* __restrict__ qg,
                                                         bf16* __restrict__ out, int Hq, int Dh, int splits,
                                                         int gated) {
    TRACE(TK_ATTN_MERGE);
    __shared__ float sm_w[ATTD_MAX_SPLITS];
    __shared__ float sm_o[ATTD_MERGE_WARPS][32];
    __shared__ float sm_red[ATTD_MERGE_WARPS];
    pdl_wait();
    pdl_trigger();
    const int h = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const long pbase = (long)Hq * splits * Dh;
    const float* pm = part + pbase + (long)h * splits;
    const float* pl = part + pbase + (long)Hq * splits + (long)h * splits;
    const int d = blockIdx.y * 32 + lane;
    const bool act = d < Dh;
    const float* pa = part + (long)h * splits * Dh + (act ? d : 0);
    float x[ATTD_MERGE_UNROLL];
#pragma unroll
    for (int u = 0; u < ATTD_MERGE_UNROLL; u++) {
        const int s = w + u * ATTD_MERGE_WARPS;
        x[u] = s < splits ? __ldcg(pa + (long)s * Dh) : 0.f;
    }
    constexpr int PER = ATTD_MAX_SPLITS / (ATTD_MERGE_WARPS * 32);
    float mv[PER], lv[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int s = threadIdx.x + i * ATTD_MERGE_WARPS * 32;
        mv[i] = s < splits ? __ldcg(pm + s) : -LILY_INF;
        lv[i] = s < splits ? __ldcg(pl + s) : 0.f;
    }
    float mx = mv[0];
#pragma unroll
    for (int i = 1; i < PER; i++) mx = fmaxf(mx, mv[i]);
    mx = warp_max(mx);
    if (lane == 0) sm_red[w] = mx;
    __syncthreads();
    float M = -LILY_INF;
    for (int i = 0; i < ATTD_MERGE_WARPS; i++) M = fmaxf(M, sm_red[i]);
    // M is finite: n >= 1, so split 0 has a key.
    float lsum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int s = threadIdx.x + i * ATTD_MERGE_WARPS * 32;
        const float f = mv[i] == -LILY_INF ? 0.f : exp2f(mv[i] - M);
        if (s < splits) sm_w[s] = f;
        lsum += lv[i] * f;
    }
    const float L = block_sum(lsum);  // its barriers also publish sm_w
    float o = 0.f;
#pragma unroll
    for (int u = 0; u < ATTD_MERGE_UNROLL; u++) {
        const int s = w + u * ATTD_MERGE_WARPS;
        if (s < splits) o = fmaf(sm_w[s], x[u], o);
    }
    for (int s = w + ATTD_MERGE_UNROLL * ATTD_MERGE_WARPS; s < splits; s += ATTD_MERGE_WARPS)
        o = fmaf(sm_w[s], __ldcg(pa + (long)s * Dh), o);
    sm_o[w][lane] = o;
    __syncthreads();
    if (w == 0 && act) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < ATTD_MERGE_WARPS; i++) v += sm_o[i][lane];
        v /= L;
        if (gated) v *= sigmoidf_(__ldcg(qg + (long)h * 2 * Dh + Dh + d));
        out[(long)h * Dh + d] = f2bf(v);
    }
}
