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
    TRACE(qk_prep_kernel);
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

// Causal attention of a prefill chunk on the tensor cores (flash attention,
// the FlashAttention-2 schedule): query rows pos0..pos0+T-1 over cache rows
// 0..pos0+t for query t, the keys of earlier chunks included, so a long
// prompt goes through in chunks with memory bounded by the chunk.
//
// Grid (ceil(T / 64), Hq), block 128 = 4 warps; the query tiles run last
// first (the longest key ranges start first). A block holds 64 queries of
// one head as bf16 in shared memory and walks its key range 64 keys at a
// time; warp w owns query rows 16w..16w+15:
//  - S = Q K^T: m16n8k16 MMAs, A from the Q tile and B from the K tile by
//    ldmatrix (K rows are keys by dims: the MMA's column-major B as stored);
//  - online softmax in registers, in log2 units (exp2f): lane (g, t) holds
//    rows g and g + 8, keys 2t, 2t + 1 of each 8-key n-tile; row maxima over
//    the 4 lanes of a row by shuffles; the row sums stay per lane until the end;
//  - O += P V: the score tile's C fragments are, pair for pair, the A
//    fragments of P (rounded to bf16), so P never leaves registers; V's B
//    fragments by ldmatrix.trans (V rows are keys by dims);
//  - cp.async: V of a tile loads while its scores are computed, K of the next
//    tile while P V is; Q, K and V tiles in dynamic shared memory (3 x 64 x
//    Dh bf16: 96 KiB at Dh 256, two blocks an SM), rows of Dh / 8 16-byte
//    chunks, chunk c of row r stored at c ^ (r % 8): the 8 rows one ldmatrix
//    reads hit 8 bank groups.
// Only key tiles that cross a query's diagonal are masked. Queries enter as
// bf16 (FlashAttention's precision: the scores of K rows that are bf16
// already, accumulated in f32); O is f32 until the end, divided by the row
// sum, times sigmoid(gate), stored bf16. Dh 64, 128 or 256
// (O's accumulators are sized for 256; smaller heads skip the unused tiles).
// q: [T, Hq, Dh] f32 (qk_prep's); kcache/vcache [max_seq, Hkv, Dh] bf16;
// qg [T, Hq, 2 Dh] f32 (gate half read when gated); out [T, Hq * Dh] bf16.
#define FA_BQ 64
#define FA_BK 64
#define FA_DMAX 256
#define FA_THREADS 128
#define FA_LOG2E 1.4426950408889634f

// element offset of 16-byte chunk `ch` of row `r` in a swizzled [rows][dh] tile
__device__ __forceinline__ int fa_swz(int r, int ch, int dh) { return r * dh + ((ch ^ (r & 7)) << 3); }

extern "C" __global__ void __launch_bounds__(FA_THREADS, 2)
    attention_prefill_kernel(const float* __restrict__ q, const bf16* __restrict__ kcache,
                             const bf16* __restrict__ vcache, const float* __restrict__ qg,
                             const int* __restrict__ pos_ptr, bf16* __restrict__ out, int T, int Hq, int Hkv,
                             int Dh, float scale, int gated) {
    extern __shared__ __align__(128) bf16 fa_smem[];
    const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y;
    const int kh = h / (Hq / Hkv);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int pos0 = pos_ptr[0];
    const int q0 = qt * FA_BQ;
    const int qn = min(FA_BQ, T - q0);
    const int nch = Dh >> 3, lg = __ffs(nch) - 1;  // 16-byte chunks a row (a power of two)
    bf16* Qs = fa_smem;
    bf16* Ks = Qs + FA_BQ * Dh;
    bf16* Vs = Ks + FA_BK * Dh;
    const unsigned qs0 = smem_addr(Qs), ks0 = smem_addr(Ks), vs0 = smem_addr(Vs);
    // keys 0 .. nk - 1 serve this block; the last query sees all of them
    const int nk = pos0 + q0 + qn;
    const int ntiles = (nk + FA_BK - 1) / FA_BK;
    const long kstride = (long)Hkv * Dh;
    const bf16* kbase = kcache + (long)kh * Dh;
    const bf16* vbase = vcache + (long)kh * Dh;
    auto load_kv = [&](unsigned dst, const bf16* base, int kt) {
        for (int i = tid; i < FA_BK * nch; i += FA_THREADS) {
            int r = i >> lg, c = i & (nch - 1), key = kt * FA_BK + r;
            bool ok = key < nk;
            cp_async16(dst + fa_swz(r, c, Dh) * 2, base + (ok ? key : 0) * kstride + c * 8, ok ? 16 : 0);
        }
    };
    load_kv(ks0, kbase, 0);
    cp_async_commit();
    // Q: f32 -> bf16, zero rows past T
    for (int i = tid; i < FA_BQ * nch; i += FA_THREADS) {
        int r = i >> lg, c = i & (nch - 1);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < qn) {
            const float4* p = reinterpret_cast<const float4*>(q + ((long)(q0 + r) * Hq + h) * Dh + c * 8);
            float4 a = p[0], b = p[1];
            v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                           pack_bf16x2(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(Qs + fa_swz(r, c, Dh)) = v;
    }

    float o[FA_DMAX / 8][4];
#pragma unroll
    for (int j = 0; j < FA_DMAX / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {-LILY_INF, -LILY_INF}, l[2] = {0.f, 0.f};
    const float sl2 = scale * FA_LOG2E;
    // absolute positions of this lane's two query rows
    const int qa0 = pos0 + q0 + warp * 16 + g, qa1 = qa0 + 8;
    const int qrow = warp * 16 + (lane & 15);

    for (int kt = 0; kt < ntiles; kt++) {
        load_kv(vs0, vbase, kt);
        cp_async_commit();
        cp_async_wait<1>();  // K of this tile (and Q's stores) visible
        __syncthreads();
        float s[FA_BK / 8][4];
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < FA_DMAX / 16; ks++) {
            if (ks * 16 >= Dh) break;
            unsigned a[4];
            ldmatrix_x4(a, qs0 + fa_swz(qrow, ks * 2 + (lane >> 4), Dh) * 2);
#pragma unroll
            for (int nb = 0; nb < FA_BK / 16; nb++) {
                unsigned b[4];
                int r = nb * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(b, ks0 + fa_swz(r, ks * 2 + ((lane >> 3) & 1), Dh) * 2);
                mma_bf16(s[2 * nb], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16(s[2 * nb + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with K
        if (kt + 1 < ntiles) load_kv(ks0, kbase, kt + 1);
        cp_async_commit();

        // scores -> log2 units, the causal mask where the tile crosses a diagonal
        const bool diag = (kt + 1) * FA_BK - 1 > pos0 + q0;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                float v = s[j][x] * sl2;
                if (diag) {
                    int key = kt * FA_BK + j * 8 + 2 * t4 + (x & 1);
                    if (key > (x < 2 ? qa0 : qa1)) v = -LILY_INF;
                }
                s[j][x] = v;
                mx[x >> 1] = fmaxf(mx[x >> 1], v);
            }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            // key 0 is in every query's range and in the first tile: mx is finite
            corr[r] = exp2f(m[r] - mx[r]);
            m[r] = mx[r];
            l[r] *= corr[r];
        }
#pragma unroll
        for (int j = 0; j < FA_DMAX / 8; j++) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
        unsigned p[FA_BK / 16][4];
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) {
            float p0 = exp2f(s[j][0] - m[0]), p1 = exp2f(s[j][1] - m[0]);
            float p2 = exp2f(s[j][2] - m[1]), p3 = exp2f(s[j][3] - m[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            // n-tile j is keys 8j..8j+7: the low (even j) or high half of k-step j / 2
            p[j >> 1][(j & 1) * 2] = pack_bf16x2(p0, p1);
            p[j >> 1][(j & 1) * 2 + 1] = pack_bf16x2(p2, p3);
        }

        cp_async_wait<1>();  // V of this tile
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; kk++) {
            int r = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
            for (int nd = 0; nd < FA_DMAX / 16; nd++) {
                if (nd * 16 >= Dh) break;
                unsigned b[4];
                ldmatrix_x4_trans(b, vs0 + fa_swz(r, nd * 2 + (lane >> 4), Dh) * 2);
                mma_bf16(o[2 * nd], p[kk][0], p[kk][1], p[kk][2], p[kk][3], b[0], b[1]);
                mma_bf16(o[2 * nd + 1], p[kk][0], p[kk][1], p[kk][2], p[kk][3], b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with V before the next tile's load
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = warp * 16 + g + 8 * r;
        if (row >= qn) continue;
        long base = ((long)(q0 + row) * Hq + h) * Dh;
        const float* gate = qg + ((long)(q0 + row) * Hq + h) * 2 * Dh + Dh;
        float inv = 1.f / l[r];
#pragma unroll
        for (int j = 0; j < FA_DMAX / 8; j++) {
            int d = j * 8 + 2 * t4;
            if (d >= Dh) break;
            float v0 = o[j][2 * r] * inv, v1 = o[j][2 * r + 1] * inv;
            if (gated) {
                float2 gg = *reinterpret_cast<const float2*>(gate + d);
                v0 *= sigmoidf_(gg.x);
                v1 *= sigmoidf_(gg.y);
            }
            reinterpret_cast<unsigned*>(out)[(base + d) >> 1] = pack_bf16x2(v0, v1);
        }
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
// Within a block, warp w takes a contiguous share (a multiple of ATTD_BATCH =
// 16 keys) of the block's range and runs its own online softmax over it, a
// batch of 16 keys at a time, on the tensor cores (mma.sync m16n8k16, bf16 in,
// f32 accumulate). The FMA form (one lane per 8 dims, a shuffle reduction per
// key) spent ~1,600 instructions a warp on 8 keys and was issue-bound; this
// form spends ~560 on 16 keys (benchmarks/LEDGER.md has the figures).
//  - Scores: an MMA tile is [q_hi; q_lo] K^T, 16 rows x 8 keys, over Dh / 16
//    k-steps of 16 dims. q is f32: rows 0-7 hold its 8 heads rounded to bf16 (q_hi),
//    rows 8-15 what rounding left (q_lo = q - q_hi, also bf16), so a head's
//    score is the sum of its two rows, to 16 bits of mantissa in q. K is bf16
//    already; everything accumulates in f32. The dot product does not care
//    which dims a k-step takes, so k-steps 2u and 2u + 1 take dims
//    32u..32u + 31 in the order that lets lane (g, t) = (lane / 4, lane % 4)
//    feed its B fragment (key g of the tile) straight from one 16-byte load
//    of dims 32u + 8t..32u + 8t + 7: words x, y for k-step 2u, z, w for
//    2u + 1. Its A fragment (head g) holds the query at the same dims.
//  - p in [0, 1] enters as p_hi + p_lo as well (two MMAs). Each product is
//    then good to ~2^-16 relative (not f32's 2^-24): a score's error is
//    ~2^-16 sum |q_d k_d|, 3-9e-6 relative L2 on the test's data, below the
//    bf16 output rounding (2^-9) for scores of this model's size.
//  - A score tile's C fragment (S: heads x keys) gives lane (g, t) head g's scores of keys 2t,
//    2t + 1: exactly the B fragment (P^T, keys x heads) of O^T [dims x heads]
//    = V^T P^T for the batch's two tiles, so p never leaves registers.
//  - O^T's A fragment (V^T, dims x keys) pairs two keys of one dim in a word.
//    Lane (g, t) owns dims 64v + 8g..+7 (v = 0..3) of keys 2t, 2t + 1,
//    2t + 8, 2t + 9 (16 loads of 16 bytes; a row's 8 lanes read 128
//    contiguous bytes a load) and pairs them with byte permutes: m-tile i's
//    row g is dim 64 (i / 8) + 8g + i % 8, its row g + 8 that dim + 128. Its
//    C fragment holds heads 2t, 2t + 1 of those dims: 64 accumulators.
// The warps merge through shared memory at the end in C-fragment order (no
// bank conflicts), then through a skewed [head][dim] tile for coalesced
// stores. Needs Dh % 32 == 0 and Dh <= 256.
#define ATTD_WARPS 4
#define ATTD_HEADS 8
#define ATTD_BATCH 16
#define ATTD_MERGE_WARPS 8
#define ATTD_LOG2E 1.4426950408889634f
// Row stride of the [head][dim] output tile: dim d sits at d + d / 8. A
// fragment register's lanes hold heads 2t (+1) and dims 8g apart, i.e. words
// 8t + 9g apart mod 32 (2 * 292 = 8 mod 32): 32 lanes, 32 banks.
#define ATTD_OUT_STRIDE 292

// A 16-byte global load through L2 only (.cg: a cache row rewritten after a
// rewind must not be served from a stale L1 line; common.cuh, pdl_wait),
// kept in PTX where it is written (see mma_bf16).
__device__ __forceinline__ uint4 ld_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Asks L2 for one K or V row: `lines` 128-byte lines (at most 4: Dh <= 256).
__device__ __forceinline__ void attd_prefetch_row(const bf16* p, int lines) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (i < lines) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i * 64));
}

// (x, y) -> bf16 pair hi (x in the low half) and the pair of what rounding
// left, lo, so that x = hi.x + lo.x to 16 bits of mantissa.
__device__ __forceinline__ void split_bf16x2(float x, float y, unsigned& hi, unsigned& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(y), "f"(x));
    const float rx = x - __uint_as_float(hi << 16), ry = y - __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(ry), "f"(rx));
}

// q: [Hq, Dh] f32 (normed, rotated); kcache/vcache: [max_seq, Hkv, Dh] bf16;
// part: see above. scale: the softmax scale (Dh^-1/2).
extern "C" __global__ void __launch_bounds__(ATTD_WARPS * 32, 2)
    attention_decode_partial_kernel(const float* __restrict__ q, const bf16* __restrict__ kcache,
                                    const bf16* __restrict__ vcache, const int* __restrict__ pos_ptr,
                                    float* __restrict__ part, int Hq, int Hkv, int Dh, int splits, float scale) {
    TRACE(attention_decode_partial_kernel);
    __shared__ __align__(16) float sm_frag[ATTD_WARPS][64][32];
    // The query fragments (8 KB, read in the batch loop) and the output tile
    // (written after the warps have left it) share one buffer.
    __shared__ __align__(16) float sm_out[ATTD_HEADS * ATTD_OUT_STRIDE];
    uint4(*sm_q)[2][32] = reinterpret_cast<uint4(*)[2][32]>(sm_out);
    __shared__ float sm_m[ATTD_WARPS][ATTD_HEADS], sm_l[ATTD_WARPS][ATTD_HEADS], sm_f[ATTD_WARPS][ATTD_HEADS];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
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
    const long rs = (long)Hkv * Dh;
    const int lines = (Dh + 63) >> 6;  // 128-byte lines a row, rounded up
    // The warp's first two batches of K and V rows (lane l: row a + l),
    // prefetched into L2 while the kernel before (the q/k preparation)
    // finishes: at 4k context that is the warp's whole share, and its DRAM
    // latency is then paid in that kernel's shadow. (Row n - 1, which that
    // kernel writes, is coherent in L2; nothing is read into registers or L1
    // before the wait.)
    if (a + lane < b) {
        const long off = (a + lane) * rs + (long)kh * Dh;
        attd_prefetch_row(kcache + off, lines);
        attd_prefetch_row(vcache + off, lines);
    }
    pdl_wait();
    pdl_trigger();
    // K and V rows are requested one batch ahead (software pipelining): the
    // first batch's before the query is staged, the next batch's K once this
    // batch's scores are out, its V once this batch's V products are issued.
    // A short last batch re-reads row b - 1 for its missing keys; their
    // scores are -inf, so their weights are 0.
    // K: key j0 + 8T + g of tile T, dims 32u + 8t..+7.
    const bf16* kb = kcache + (long)kh * Dh + 8 * t;
    uint4 kraw[2][8];
    auto load_k = [&](long j0) {
#pragma unroll
        for (int T = 0; T < 2; T++) {
            const bf16* kr = kb + min(j0 + 8 * T + g, b - 1) * rs;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (32 * u < Dh) kraw[T][u] = __ldcg(reinterpret_cast<const uint4*>(kr + 32 * u));
        }
    };
    // V chunk v of this lane: dims 64v + 8g..+7 of a row, so the 8 lanes of a
    // row read 128 contiguous bytes a load. Chunks past Dh (Dh < 256) read
    // dims 0..7 instead: their accumulators never reach the partials.
    const bf16* vb = vcache + (long)kh * Dh;
    int voff[4];
#pragma unroll
    for (int v = 0; v < 4; v++) voff[v] = 64 * v + 8 * g < Dh ? 64 * v + 8 * g : 0;
    // V: keys 2t, 2t + 1, 2t + 8, 2t + 9, chunks v = 0..3, as two halves
    // (chunks 0 and 2, then 1 and 3), each feeding 8 m-tiles: m-tile i's row
    // g is dim 64 (i / 8) + 8g + i % 8 (chunk i / 8), its row g + 8 that dim
    // + 128 (chunk i / 8 + 2); the odd dim of a word is its high half.
    auto load_v = [&](uint4(&vraw)[4][2], int hv, long j0) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const long key = j0 + 2 * t + (k & 1) + 8 * (k >> 1);
            const bf16* vr = vb + min(key, b - 1) * rs;
            vraw[k][0] = ld_v4(vr + voff[hv]);
            vraw[k][1] = ld_v4(vr + voff[hv + 2]);
        }
    };
    uint4 v0[4][2], v1[4][2];
    if (a < b) {
        load_k(a);
        load_v(v0, 0, a);
        load_v(v1, 1, a);
    }

    // Query fragments, shared by the block's warps (registers are short):
    // sm_q[u][i][lane] is the A fragment of k-step 2u + i for lane (g, t),
    // rows 0-7 q_hi, rows 8-15 q_lo of the same 8 heads, so one MMA yields
    // both halves' scores (C rows g and g + 8, summed). Head g's query at
    // dims 32u + 8t..+7, pre-scaled into log2 units; zero past Dh and for
    // heads past nh.
    const float qs = scale * ATTD_LOG2E;
    for (int it = threadIdx.x; it < 8 * 32; it += blockDim.x) {
        const int u = it >> 5, gg = (it & 31) >> 2, tt = it & 3;
        float4 x = {0.f, 0.f, 0.f, 0.f}, y = {0.f, 0.f, 0.f, 0.f};
        if (gg < nh && 32 * u < Dh) {
            const float4* qr = reinterpret_cast<const float4*>(q + (long)(h0 + gg) * Dh + 32 * u + 8 * tt);
            x = __ldcg(qr);
            y = __ldcg(qr + 1);
        }
        uint4 f0, f1;  // {a0, a1, a2, a3} = {hi k 2t, lo k 2t, hi k 2t + 8, lo k 2t + 8}
        split_bf16x2(x.x * qs, x.y * qs, f0.x, f0.y);
        split_bf16x2(x.z * qs, x.w * qs, f0.z, f0.w);
        split_bf16x2(y.x * qs, y.y * qs, f1.x, f1.y);
        split_bf16x2(y.z * qs, y.w * qs, f1.z, f1.w);
        sm_q[u][0][it & 31] = f0;
        sm_q[u][1][it & 31] = f1;
    }
    __syncthreads();
    float acc[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    // Softmax state of head g (log2 units): m is the same in its four lanes,
    // l is this lane's share (its keys), summed over the four at the end.
    float m = -LILY_INF, l = 0.f;
    unsigned ph0, pl0, ph1, pl1;  // B fragments: keys 2t, 2t + 1 and 2t + 8, 2t + 9 of head g
    auto pv = [&](const uint4(&vraw)[4][2], int hv) {
#pragma unroll
        for (int ii = 0; ii < 8; ii++) {
            const int i = 8 * hv + ii, e = ii >> 1;
            const unsigned sel = (ii & 1) ? 0x7632u : 0x5410u;
            const unsigned* w0 = reinterpret_cast<const unsigned*>(&vraw[0][0]);
            const unsigned* w1 = reinterpret_cast<const unsigned*>(&vraw[1][0]);
            const unsigned* w2 = reinterpret_cast<const unsigned*>(&vraw[2][0]);
            const unsigned* w3 = reinterpret_cast<const unsigned*>(&vraw[3][0]);
            const unsigned* x0 = reinterpret_cast<const unsigned*>(&vraw[0][1]);
            const unsigned* x1 = reinterpret_cast<const unsigned*>(&vraw[1][1]);
            const unsigned* x2 = reinterpret_cast<const unsigned*>(&vraw[2][1]);
            const unsigned* x3 = reinterpret_cast<const unsigned*>(&vraw[3][1]);
            const unsigned a0 = __byte_perm(w0[e], w1[e], sel);  // row g, keys 2t, 2t + 1
            const unsigned a1 = __byte_perm(x0[e], x1[e], sel);  // row g + 8, keys 2t, 2t + 1
            const unsigned a2 = __byte_perm(w2[e], w3[e], sel);  // row g, keys 2t + 8, 2t + 9
            const unsigned a3 = __byte_perm(x2[e], x3[e], sel);  // row g + 8, keys 2t + 8, 2t + 9
            mma_bf16(acc[i], a0, a1, a2, a3, ph0, ph1);
            mma_bf16(acc[i], a0, a1, a2, a3, pl0, pl1);
        }
    };
    for (long j0 = a; j0 < b; j0 += ATTD_BATCH) {
        // L2 prefetch two batches ahead (lane l: row j0 + 32 + l % 16, K or V).
        const long r = j0 + 2 * ATTD_BATCH + (lane & 15);
        if (r < b) attd_prefetch_row((lane < 16 ? kcache : vcache) + r * rs + (long)kh * Dh, lines);
        // Scores: tile T holds keys j0 + 8T..j0 + 8T + 7 (kraw: key g).
        // Four accumulator chains (tile x k-step parity): an MMA's result
        // is not waited for by the next one issued.
        float sq[2][2][4] = {};
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (32 * u < Dh) {
                const uint4 f0 = sm_q[u][0][lane], f1 = sm_q[u][1][lane];
#pragma unroll
                for (int T = 0; T < 2; T++) {
                    mma_bf16(sq[T][0], f0.x, f0.y, f0.z, f0.w, kraw[T][u].x, kraw[T][u].y);
                    mma_bf16(sq[T][1], f1.x, f1.y, f1.z, f1.w, kraw[T][u].z, kraw[T][u].w);
                }
            }
        }
        // head g, keys j0 + 8T + 2t, + 1: the q_hi rows plus the q_lo rows
        float sc[4];
#pragma unroll
        for (int T = 0; T < 2; T++) {
            const long key = j0 + 8 * T + 2 * t;
            const float s0 = (sq[T][0][0] + sq[T][0][2]) + (sq[T][1][0] + sq[T][1][2]);
            const float s1 = (sq[T][0][1] + sq[T][0][3]) + (sq[T][1][1] + sq[T][1][3]);
            sc[2 * T] = key < b ? s0 : -LILY_INF;
            sc[2 * T + 1] = key + 1 < b ? s1 : -LILY_INF;
        }
        if (j0 + ATTD_BATCH < b) load_k(j0 + ATTD_BATCH);
        float bm = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 1));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 2));
        const float mn = fmaxf(m, bm);  // finite: the batch has a key
        const float corr = exp2f(m - mn);
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; i++) p[i] = exp2f(sc[i] - mn);
        l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
        const bool grow = mn > m;
        m = mn;
        // Rescale heads 2t, 2t + 1 (this lane's accumulators) by their
        // corrections, held by lanes 8t and 8t + 4.
        const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t), c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
        if (__any_sync(0xffffffffu, grow)) {  // else every corr is exactly 1
#pragma unroll
            for (int i = 0; i < 16; i++) {
                acc[i][0] *= c0;
                acc[i][1] *= c1;
                acc[i][2] *= c0;
                acc[i][3] *= c1;
            }
        }
        split_bf16x2(p[0], p[1], ph0, pl0);
        split_bf16x2(p[2], p[3], ph1, pl1);
        pv(v0, 0);
        pv(v1, 1);
        if (j0 + ATTD_BATCH < b) {
            load_v(v0, 0, j0 + ATTD_BATCH);
            load_v(v1, 1, j0 + ATTD_BATCH);
        }
    }

    // Merge the warps: per head, M = max of the warps' m, weights 2^(m_w - M).
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
        sm_m[w][g] = m;
        sm_l[w][g] = l;
    }
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int k = 0; k < 4; k++) sm_frag[w][4 * i + k][lane] = acc[i][k];
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
    // Warp w combines fragment registers 16w..16w + 15 of every warp (head
    // 2t + k % 2, dim 64 (i / 8) + 128 (k / 2) + 8g + i % 8 for register
    // 4i + k) into the tile.
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int r = 16 * w + j, i = r >> 2, k = r & 3;
        const int h = 2 * t + (k & 1), d = 64 * (i >> 3) + 128 * (k >> 1) + 8 * g + (i & 7);
        float o = 0.f;
#pragma unroll
        for (int x = 0; x < ATTD_WARPS; x++) o += sm_frag[x][r][lane] * sm_f[x][h];
        sm_out[h * ATTD_OUT_STRIDE + d + (d >> 3)] = o;
    }
    __syncthreads();
    const int q4 = Dh >> 2;
    for (int e = threadIdx.x; e < nh * q4; e += blockDim.x) {
        const int h = e / q4, d = (e - h * q4) * 4;
        const float* src = sm_out + h * ATTD_OUT_STRIDE + d + (d >> 3);
        *reinterpret_cast<float4*>(part + ((long)(h0 + h) * splits + s) * Dh + d) =
            make_float4(src[0], src[1], src[2], src[3]);
    }
}

// Grid (Hq, ceil(Dh / 32)), block ATTD_MERGE_WARPS * 32: block (h, y) merges
// dims 32y..32y+31 of head h, warp w the splits w, w + 8, .... Every load of
// the common case (splits <= ATTD_MERGE_WARPS * ATTD_MERGE_UNROLL = 264: each
// warp's splits' m, l and partial sums, every split's m for the maximum, and
// the output gate) is issued right after the wait, before the weights that
// scale them are known, so the merge costs one L2 round trip instead of one
// per dependent step. Every warp finds the maximum M itself (a warp
// reduction, no barrier), so the block meets once, to add its warps' sums.
// Empty splits hold m = -inf, l = 0, acc = 0 and are skipped.
// Past 264 splits the rest are read split by split (any count works; the
// host caps it at ATTENTION_DECODE_MAX_SPLITS, kernels/attention.rs). part: as written by
// attention_decode_partial_kernel; qg: [Hq, (1 + gated) * Dh] f32, per head [query | gate];
// out: [Hq * Dh] bf16 = attn * sigmoid(gate).
#define ATTD_MERGE_UNROLL 33
#define ATTD_MERGE_MPER 9  // every split's m: 9 a lane covers 288 >= 264 splits
extern "C" __global__ void attention_decode_merge_kernel(const float* __restrict__ part, const float* __restrict__ qg,
                                                         bf16* __restrict__ out, int Hq, int Dh, int splits,
                                                         int gated) {
    TRACE(attention_decode_merge_kernel);
    __shared__ float sm_o[ATTD_MERGE_WARPS][32];
    __shared__ float sm_l[ATTD_MERGE_WARPS];
    pdl_wait();
    pdl_trigger();
    const int h = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const long pbase = (long)Hq * splits * Dh;
    const float* pm = part + pbase + (long)h * splits;
    const float* pl = part + pbase + (long)Hq * splits + (long)h * splits;
    const int d = blockIdx.y * 32 + lane;
    const bool act = d < Dh;
    const float* pa = part + (long)h * splits * Dh + (act ? d : 0);
    // The gate was written by the input projection, two kernels back: it is
    // requested with the partials, not after them.
    const float gate = gated && w == 0 && act ? __ldcg(qg + (long)h * 2 * Dh + Dh + d) : 0.f;
    float x[ATTD_MERGE_UNROLL], ms[ATTD_MERGE_UNROLL], ls[ATTD_MERGE_UNROLL], mv[ATTD_MERGE_MPER];
#pragma unroll
    for (int u = 0; u < ATTD_MERGE_UNROLL; u++) {
        const int s = w + u * ATTD_MERGE_WARPS;
        const bool in = s < splits;
        x[u] = in ? __ldcg(pa + (long)s * Dh) : 0.f;
        ms[u] = in ? __ldcg(pm + s) : -LILY_INF;
        ls[u] = in ? __ldcg(pl + s) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < ATTD_MERGE_MPER; i++) {
        const int s = lane + 32 * i;
        mv[i] = s < splits ? __ldcg(pm + s) : -LILY_INF;
    }
    float mx = mv[0];
#pragma unroll
    for (int i = 1; i < ATTD_MERGE_MPER; i++) mx = fmaxf(mx, mv[i]);
    for (int s = lane + 32 * ATTD_MERGE_MPER; s < splits; s += 32) mx = fmaxf(mx, __ldcg(pm + s));
    const float M = warp_max(mx);  // finite: n >= 1, so split 0 has a key
    float o = 0.f, lw = 0.f;
#pragma unroll
    for (int u = 0; u < ATTD_MERGE_UNROLL; u++) {
        if (ms[u] != -LILY_INF) {
            const float f = exp2f(ms[u] - M);
            o = fmaf(f, x[u], o);
            lw = fmaf(f, ls[u], lw);
        }
    }
    for (int s = w + ATTD_MERGE_UNROLL * ATTD_MERGE_WARPS; s < splits; s += ATTD_MERGE_WARPS) {
        const float m = __ldcg(pm + s);
        if (m != -LILY_INF) {
            const float f = exp2f(m - M);
            o = fmaf(f, __ldcg(pa + (long)s * Dh), o);
            lw = fmaf(f, __ldcg(pl + s), lw);
        }
    }
    sm_o[w][lane] = o;
    if (lane == 0) sm_l[w] = lw;
    __syncthreads();
    if (w == 0 && act) {
        float v = 0.f, L = 0.f;
#pragma unroll
        for (int i = 0; i < ATTD_MERGE_WARPS; i++) {
            v += sm_o[i][lane];
            L += sm_l[i];
        }
        v /= L;
        if (gated) v *= sigmoidf_(gate);
        out[(long)h * Dh + d] = f2bf(v);
    }
}
