// Gated DeltaNet: the causal conv1d + SiLU of a prefill chunk with its state,
// and gdn_decode_kernel, the T = 1 step of the gated delta recurrence fused
// with the conv and the gated RMSNorm, laid out for bandwidth (the chunked
// prefill form is gdn_chunked.cu).
#include "common.cuh"
#define DK 128

// The causal conv of a prefill chunk: mixed: [T, C] f32 pre-conv; state:
// [C, W-1] f32 (oldest first), updated to the chunk's last W-1 inputs; w:
// [C, W] f32; out: [T, C] f32 = silu(conv). Grid (ceil(C / blockDim.x),
// ceil(T / CONV_STRIP)): thread (c, s) computes tokens [s, s + 1) * CONV_STRIP
// of channel c, reading the W-1 inputs before its strip from `mixed`, so every
// token of the chunk runs at once (one thread a channel walking all T tokens
// left the GPU nearly idle). Only strip 0 reads the old state (W-1 <=
// CONV_STRIP) and only it writes the new one: no thread reads a state another
// writes. The sum is in gdn_decode_kernel's order (conv4_silu), so the bits
// match the decode step's.
#define CONV_STRIP 16
extern "C" __global__ void conv_silu_kernel(const float* __restrict__ mixed, float* __restrict__ state,
                                            const float* __restrict__ w, float* __restrict__ out,
                                            int T, int C, int W) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_STRIP;
    // the layer's conv state and weights before the PDL wait (no earlier kernel of the step writes them)
    float hist[8];  // W <= 8
    float wc[8];
    if (c < C) {
        if (t0 == 0)
            for (int j = 0; j < W - 1; j++) hist[j] = __ldcg(state + (long)c * (W - 1) + j);
        for (int j = 0; j < W; j++) wc[j] = w[(long)c * W + j];
    }
    pdl_wait();
    pdl_trigger();
    if (c >= C) return;
    if (t0 > 0)  // t0 >= CONV_STRIP >= W - 1: the inputs before the strip are the chunk's
        for (int j = 0; j < W - 1; j++) hist[j] = __ldcg(mixed + (long)(t0 - (W - 1) + j) * C + c);
    const int t1 = min(T, t0 + CONV_STRIP);
    for (int t = t0; t < t1; t++) {
        float x = __ldcg(mixed + (long)t * C + c);
        float acc = wc[W - 1] * x;
        for (int j = 0; j < W - 1; j++) acc += wc[j] * hist[j];
        for (int j = 0; j < W - 2; j++) hist[j] = hist[j + 1];
        if (W > 1) hist[W - 2] = x;
        out[(long)t * C + c] = siluf_(acc);
    }
    if (t0 != 0) return;
    if (T > CONV_STRIP)  // the chunk's last W-1 inputs (T - W + 1 > 0)
        for (int j = 0; j < W - 1; j++) hist[j] = __ldcg(mixed + (long)(T - (W - 1) + j) * C + c);
    for (int j = 0; j < W - 1; j++) state[(long)c * (W - 1) + j] = hist[j];
}

// ---------------------------------------------------------------------------
// Decode (T = 1): the conv, the gated delta step and the gated RMSNorm, fused.
//
// The step reads and writes every head's f32 state once (Hv * 64 KiB = 2 MiB at
// Hv = 32) and does ~4 flops per state element, so it is a pure bandwidth
// problem: the goal is the whole state in flight at once, spread over as many
// SMs as possible, with coalesced 16-byte accesses and no register spills.
//
// Geometry: 4 blocks per v head (grid Hv * 4) in clusters of 8 (cluster dims
// fixed at compile time, so a plain cuLaunchKernel launches it); block r of a
// head owns its state columns [32 r, 32 r + 32). Block: 256
// threads = 8 warps; lane = 8 * rs + cg: cg (0..7) picks 4 adjacent columns
// (a float4), rs (0..3) a row; warp w and i (0..3) give the thread's rows
// r = 32 i + 4 w + rs. So a thread holds a 4 x 4 tile of S (16 registers),
// and each of a warp's 4 load/store instructions moves 4 full 128-byte row
// segments. 128 blocks x 16 KiB: every byte of the state is requested before
// any arithmetic waits on it.
//
// Algebra: with Sd = exp(g) S, u = Sd^T k, delta = beta (v - u), the new state
// is Sd + k delta^T and o = (Sd + k delta^T)^T q = Sd^T q + delta (k . q). So u
// and Sd^T q come out of ONE reduction over rows (shuffles over rs, then shared
// memory over the 8 warps), and the new state can be stored as soon as delta
// is known. The output norm needs mean(o^2) over the head's 128 columns, i.e.
// over the head's 4 blocks: each block's sum of squares is exchanged through
// distributed shared memory (mapa + cluster barriers), no global scratch and
// no atomics, so the launch is graph-capturable with fixed args.
//
// The causal conv + SiLU (width 4) is fused in: each block computes the 256
// q/k channels of its key head and its own 32 v channels from the in
// projection's output (its conv history and taps loaded before the PDL wait,
// like the state), instead of a conv kernel writing them to memory first.
// A cluster is 8 blocks, two v heads: at Hv = 2 Hk (or Hv = Hk) every block
// that reads a key head's q/k channels is in one cluster, so the one block
// that writes their new history can do it after a cluster barrier, once all
// of them have read the old one.
#define GDN_DEC_DV 128
#define GDN_DEC_HEAD_BLOCKS 4
#define GDN_DEC_CLUSTER 8
#define GDN_DEC_COLS (GDN_DEC_DV / GDN_DEC_HEAD_BLOCKS)
#define GDN_DEC_THREADS 256

__device__ __forceinline__ unsigned cluster_ctarank_() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Every thread of the cluster: arrive (release) and wait (acquire).
__device__ __forceinline__ void cluster_sync_() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A split cluster barrier: arrive early (no ordering), wait later. Distributed
// shared memory of a block may be written only once that block is running,
// which the wait guarantees when every block arrived at its start.
__device__ __forceinline__ void cluster_arrive_relaxed_() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// The two halves of cluster_sync_, for warps that do other work in between.
__device__ __forceinline__ void cluster_arrive_release_() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire_() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The generic address of `p`'s counterpart in the shared memory of cluster block `rank`.
__device__ __forceinline__ float* cluster_map_(float* p, unsigned rank) {
    unsigned long long out;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
    return reinterpret_cast<float*>(out);
}

// Conv (width 4) of one channel: taps w[0..3], history h[0..2] (oldest
// first), input x; the sum in conv_silu_kernel's order, so the bits match.
__device__ __forceinline__ float conv4_silu(const float* w, const float* h, float x) {
    float acc = w[3] * x;
#pragma unroll
    for (int i = 0; i < 3; i++) acc += w[i] * h[i];
    return siluf_(acc);
}

// Grid (Hv * 4), block 256, cluster 8 (Hv even, Hv / Hk 1 or 2). Dk = Dv = 128.
// mixed: [C] = [q (Hk*128) | k (Hk*128) | v (Hv*128)] f32, the in projection's
// output before the conv; conv_state: [C, 3] f32 (oldest first), updated in
// place; conv_w: [C, 4]; ba: [2*Hv] = [b | a]; a_log, dt_bias: [Hv];
// z: [Hv*128]; w: [128] (gated-norm weight); S: [Hv, 128, 128] f32, 16-byte
// aligned, updated in place; out: [Hv*128] bf16 =
// bf16(w * (o * rsqrt(mean(o^2) + eps)) * silu(z)) per head.
extern "C" __global__ void __cluster_dims__(GDN_DEC_CLUSTER, 1, 1) __launch_bounds__(GDN_DEC_THREADS)
    gdn_decode_kernel(const float* __restrict__ mixed, float* __restrict__ conv_state,
                      const float* __restrict__ conv_w, const float* __restrict__ ba,
                      const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                      const float* __restrict__ z, const float* __restrict__ w,
                      float* __restrict__ S, bf16* __restrict__ out, int Hk, int Hv, float eps) {
    TRACE(gdn_decode_kernel);
    __shared__ float4 red_u[8][GDN_DEC_COLS / 4], red_q[8][GDN_DEC_COLS / 4];
    // the head's 4 blocks' sums of o^2, each pushed here by its block
    __shared__ float parts[GDN_DEC_HEAD_BLOCKS];
    __shared__ __align__(16) float qk_s[2 * DK];  // q | k of the key head, after conv + SiLU
    __shared__ __align__(16) float v_s[GDN_DEC_COLS];  // this block's v columns, likewise
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rs = lane >> 3, cg = lane & 7;
    const unsigned rank = cluster_ctarank_();
    const unsigned hrank = rank % GDN_DEC_HEAD_BLOCKS;  // column block within the head
    const int j = blockIdx.x / GDN_DEC_HEAD_BLOCKS;
    const int col0 = (int)hrank * GDN_DEC_COLS;  // first column of this block
    const int kh = j / (Hv / Hk);
    cluster_arrive_relaxed_();  // "this block runs": waited for before the push in step 6

    // 1. The state tile first: 4 rows x float4, all loads in flight together;
    //    then the conv history and taps of the block's channels: thread tid
    //    has q/k channel tid of the key head, warp 0 also v column col0 + lane.
    float* Sj = S + (long)j * DK * GDN_DEC_DV + col0 + cg * 4;
    // the thread's float4 of state row 32 i + 4 warp + rs (read here, written back in 4-6)
    auto tile = [&](int i) { return reinterpret_cast<float4*>(Sj + (long)(32 * i + 4 * warp + rs) * GDN_DEC_DV); };
    float4 s[4];
#pragma unroll
    for (int i = 0; i < 4; i++) s[i] = __ldcg(tile(i));
    const long cqk = tid < DK ? (long)kh * DK + tid : (long)Hk * DK + (long)kh * DK + (tid - DK);
    const long cv = 2L * Hk * DK + (long)j * GDN_DEC_DV + col0 + lane;
    float hqk[3], wqk[4], hv[3] = {0.f, 0.f, 0.f}, wv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 3; i++) hqk[i] = __ldcg(conv_state + cqk * 3 + i);
#pragma unroll
    for (int i = 0; i < 4; i++) wqk[i] = conv_w[cqk * 4 + i];
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 3; i++) hv[i] = __ldcg(conv_state + cv * 3 + i);
#pragma unroll
        for (int i = 0; i < 4; i++) wv[i] = conv_w[cv * 4 + i];
    }
    // the head's gate constants and the norm weight: constants, so before the
    // wait too (after it they were one more round trip before the decay)
    const float alog = a_log[j], dtb = dt_bias[j];
    const float wcol = warp == 0 ? w[col0 + lane] : 0.f;
    // (the layer's own state and conv history: no earlier kernel of the step
    // writes them, so they stream in before the PDL wait, while the previous
    // kernel finishes)
    pdl_wait();
    pdl_trigger();

    // 2. The conv of the block's channels into shared memory (with every other
    //    input an earlier kernel wrote requested at once: z, b, a).
    const float xqk = __ldcg(mixed + cqk);
    float xv = 0.f, zraw = 0.f;
    if (warp == 0) {
        xv = __ldcg(mixed + cv);
        zraw = __ldcg(z + (long)j * GDN_DEC_DV + col0 + lane);
    }
    const float braw = __ldcg(ba + j), araw = __ldcg(ba + Hv + j);
    qk_s[tid] = conv4_silu(wqk, hqk, xqk);
    if (warp == 0) v_s[lane] = conv4_silu(wv, hv, xv);
    __syncthreads();
    TRACE_MARK(1);  // (phase marks of the trace diagnostic, common.cuh)

    // 3. q, k of the key head: every warp computes the norms and k . q itself
    //    (lane holds elements 4 lane .. 4 lane + 3).
    const float* qg = qk_s;
    const float* kg = qk_s + DK;
    float4 q4 = *reinterpret_cast<const float4*>(qg + lane * 4);
    float4 k4 = *reinterpret_cast<const float4*>(kg + lane * 4);
    float4 v4 = *reinterpret_cast<const float4*>(v_s + cg * 4);
    float kr[4], qr[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = 32 * i + 4 * warp + rs;
        kr[i] = kg[r];
        qr[i] = qg[r];
    }
    // warp 0 finishes the block's columns (lane = column): its v, w, z
    float vc = 0.f, wc = 0.f, zc = 0.f;
    if (warp == 0) {
        vc = v_s[lane];
        wc = wcol;
        zc = siluf_(zraw);
    }
    float beta = sigmoidf_(braw);
    float decay = expf(-expf(alog) * softplusf_(araw + dtb));
    float ksq = warp_sum(k4.x * k4.x + k4.y * k4.y + k4.z * k4.z + k4.w * k4.w);
    float qsq = warp_sum(q4.x * q4.x + q4.y * q4.y + q4.z * q4.z + q4.w * q4.w);
    float kq = warp_sum(k4.x * q4.x + k4.y * q4.y + k4.z * q4.z + k4.w * q4.w);
    float kinv = rsqrtf(ksq + 1e-6f), qinv = rsqrtf(qsq + 1e-6f) * rsqrtf((float)DK);
    kq *= kinv * qinv;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        kr[i] *= kinv;
        qr[i] *= qinv;
    }

    // 3. Decay, then per column the partial sums of Sd^T k and Sd^T q over the thread's rows.
    float4 pu = make_float4(0.f, 0.f, 0.f, 0.f), pq = pu;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s[i].x *= decay;
        s[i].y *= decay;
        s[i].z *= decay;
        s[i].w *= decay;
        pu.x += s[i].x * kr[i];
        pu.y += s[i].y * kr[i];
        pu.z += s[i].z * kr[i];
        pu.w += s[i].w * kr[i];
        pq.x += s[i].x * qr[i];
        pq.y += s[i].y * qr[i];
        pq.z += s[i].z * qr[i];
        pq.w += s[i].w * qr[i];
    }
    // over rs (lane bits 3 and 4), then over the 8 warps through shared memory
#pragma unroll
    for (int o = 8; o < 32; o <<= 1) {
        pu.x += __shfl_xor_sync(0xffffffffu, pu.x, o);
        pu.y += __shfl_xor_sync(0xffffffffu, pu.y, o);
        pu.z += __shfl_xor_sync(0xffffffffu, pu.z, o);
        pu.w += __shfl_xor_sync(0xffffffffu, pu.w, o);
        pq.x += __shfl_xor_sync(0xffffffffu, pq.x, o);
        pq.y += __shfl_xor_sync(0xffffffffu, pq.y, o);
        pq.z += __shfl_xor_sync(0xffffffffu, pq.z, o);
        pq.w += __shfl_xor_sync(0xffffffffu, pq.w, o);
    }
    if (rs == 0) {
        red_u[warp][cg] = pu;
        red_q[warp][cg] = pq;
    }
    __syncthreads();
    TRACE_MARK(2);
    float4 u = red_u[0][cg];
#pragma unroll
    for (int w8 = 1; w8 < 8; w8++) {
        float4 t = red_u[w8][cg];
        u.x += t.x;
        u.y += t.y;
        u.z += t.z;
        u.w += t.w;
    }
    float4 d = make_float4(beta * (v4.x - u.x), beta * (v4.y - u.y), beta * (v4.z - u.z), beta * (v4.w - u.w));

    // 4. S = Sd + k delta^T, in registers; stored below, off the output's
    //    path, through L2 only (st.global.cg: plain stores of the 2 MB a
    //    layer cost more of the step). The cluster barrier that exchanges the
    //    sums of o^2 waits only for the warp 0s: warps 1-7 arrive before they
    //    store their tiles, warp 0 stores its own after the output. With
    //    every store before the arrival, each block's output would wait for
    //    the slowest block's 16 KB to issue.
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s[i].x += kr[i] * d.x;
        s[i].y += kr[i] * d.y;
        s[i].z += kr[i] * d.z;
        s[i].w += kr[i] * d.w;
    }
    auto store_state = [&] {
#pragma unroll
        for (int i = 0; i < 4; i++)
            __stcg(tile(i), s[i]);
    };
    TRACE_MARK(3);
    cluster_wait_();  // the barrier every block arrived at on entry (long met)
    TRACE_MARK(4);
    if (warp != 0) {
        cluster_arrive_release_();
        store_state();
        cluster_wait_acquire_();
    } else {
        const float* ru = reinterpret_cast<const float*>(&red_u[0][0]);
        const float* rq = reinterpret_cast<const float*>(&red_q[0][0]);
        float uc = ru[lane], oc = rq[lane];
#pragma unroll
        for (int w8 = 1; w8 < 8; w8++) {
            uc += ru[w8 * GDN_DEC_COLS + lane];
            oc += rq[w8 * GDN_DEC_COLS + lane];
        }
        // 5. o = Sd^T q + delta (k . q) for the block's 32 columns (lane =
        //    column; its delta is the same sum in the same order as the
        //    stored state's), and 6. this block's sum of o^2 pushed into every
        //    block of the head (lane r to block r): after the barrier each
        //    block reads its own copies, so none reads another's shared memory
        //    late and none has to wait at a second barrier before it exits.
        const float o = oc + beta * (vc - uc) * kq;
        float ss = warp_sum(o * o);
        if (lane < GDN_DEC_HEAD_BLOCKS)
            *cluster_map_(&parts[hrank], rank - hrank + lane) = ss;
        cluster_sync_();
        TRACE_MARK(5);
        ss = 0.f;
#pragma unroll
        for (unsigned r = 0; r < GDN_DEC_HEAD_BLOCKS; r++) ss += parts[r];
        float inv = rsqrtf(ss / GDN_DEC_DV + eps);
        out[(long)j * GDN_DEC_DV + col0 + lane] = f2bf(wc * (o * inv) * zc);
        TRACE_MARK(6);
        store_state();
    }
    // 7. The conv history: the v columns by their block; the q/k channels by
    //    one block of the key head (column block 0 of its first v head), now
    //    that every block of the cluster, so every reader, is past the barrier.
    if (warp == 0) {
        conv_state[cv * 3 + 0] = hv[1];
        conv_state[cv * 3 + 1] = hv[2];
        conv_state[cv * 3 + 2] = xv;
    }
    if (hrank == 0 && j % (Hv / Hk) == 0) {
        conv_state[cqk * 3 + 0] = hqk[1];
        conv_state[cqk * 3 + 1] = hqk[2];
        conv_state[cqk * 3 + 2] = xqk;
    }
}
