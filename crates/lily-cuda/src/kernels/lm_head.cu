// The greedy decode step's lm_head, screened through an int8 copy of its
// weights. The greedy choice needs only the largest logit, and every row's
// logit is known to within a bound from a copy half the size of the bf16
// matrix: per row r, q_r = round(W_r / s_r) (int8, s_r = max |W_r| / 127) and
//   |W_r . x - s_r (q_r . x)| <= ||W_r - s_r q_r||_2 ||x||_2   (Cauchy-Schwarz),
// plus the f32 rounding of both sums (<= 2 D 2^-24 ||W_r||_2 ||x||_2 for D
// terms). So with lq_r = s_r (q_r . x), b_r that bound, and T the largest
// lq_r - b_r, the row holding the largest logit has lq_r + b_r >= T. The
// screen reads the int8 copy (half the bytes of the 1 GB bf16 head
// at this vocabulary) and writes hi_r = lq_r + b_r and T; the pick then
// computes the exact logit, in the bf16 product's own order (gemv_kernel's
// chunk_dot, common.cuh), of each row with hi_r >= T only (tens of rows for random
// weights, fewer for a trained head) and takes their argmax_entry maximum.
// The choice is therefore the same id, bit for bit, as the full product's
// argmax: an exact shortcut for greedy decoding, not an approximation. Steps
// that need the logits (sampling, logprobs, `lily logits`) take the full
// product.
#include "common.cuh"

// The int8 copy, run once at load: a warp per row of W [V, D] (D % 256 == 0).
// q: [V, D] int8; scale[r] = s_r; err[r] = (||W_r - s_r q_r||_2 + (2 D 2^-24 +
// 1e-6) ||W_r||_2) * 1.001, the bound's factor of ||x||_2 (the slack covers
// the rounding of the bound's own sums). A row whose largest weight is below
// 2^-40 (but not 0) gets err = inf, i.e. no bound: there the plain f32 sums of
// squares and products may underflow, and the rounding terms are no longer
// relative (such a row is always a candidate; a trained head has none).
#define HEAD_TINY 9.094947e-13f  // 2^-40
extern "C" __global__ void head_quantize_kernel(const bf16* __restrict__ W, int V, int D,
                                                signed char* __restrict__ q, float* __restrict__ scale,
                                                float* __restrict__ err) {
    const int lane = threadIdx.x & 31;
    const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= V) return;
    const bf16* w = W + r * D;
    float m = 0.f;
    for (int k = lane * 8; k < D; k += 256) {
        float a[8];
        load8(w + k, a);
#pragma unroll
        for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(a[i]));
    }
    m = warp_max(m);
    const float s = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
    float dd = 0.f, ww = 0.f;
    for (int k = lane * 8; k < D; k += 256) {
        float a[8];
        load8(w + k, a);
        unsigned packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float qi = fminf(fmaxf(rintf(a[i] * inv), -127.f), 127.f);
            const float d = a[i] - s * qi;
            dd += d * d;
            ww += a[i] * a[i];
            packed[i >> 2] |= ((unsigned)(int)qi & 0xffu) << (8 * (i & 3));
        }
        *reinterpret_cast<uint2*>(q + r * D + k) = make_uint2(packed[0], packed[1]);
    }
    dd = warp_sum(dd);
    ww = warp_sum(ww);
    if (lane == 0) {
        scale[r] = s;
        err[r] = m > 0.f && m < HEAD_TINY ? LILY_INF
                                          : (sqrtf(dd) + (2.f * (float)D * 5.9604645e-8f + 1e-6f) * sqrtf(ww)) * 1.001f;
    }
}

// The four int8 values of a word as exact floats: each byte, offset to
// unsigned, becomes the low mantissa byte of 2^23 (one byte permute), and the
// subtraction of 2^23 + 128 is exact.
__device__ __forceinline__ void int8x4_to_float(unsigned w, float* f) {
    const unsigned u = w ^ 0x80808080u;
#pragma unroll
    for (int k = 0; k < 4; k++) f[k] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | k)) - 8388736.f;
}

// The inverse of order_key (common.cuh) for a real float's key.
__device__ __forceinline__ float order_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

#define HEAD_SCREEN_ROWS 2  // rows a warp: 16 a block, 32 KB of int8 in flight
// The screen: hi[r] = lq_r + b_r for rows below *valid (+inf where the bound
// is not finite), and *lo (an order_key; 0 before, cleared by
// argmax_finish_kernel) raised to the largest finite lq_r - b_r. D = 2048
// (the released hidden size; the model checks it): 256 threads stage x, 8
// elements each. Block 256 threads, grid ceil(V / 16). A lane's 16-byte chunks of its
// rows (lane * 16 + 512 c) are requested before the PDL wait.
extern "C" __global__ void __launch_bounds__(256) head_screen_kernel(const signed char* __restrict__ q,
                                                                    const float* __restrict__ scale,
                                                                    const float* __restrict__ err,
                                                                    const bf16* __restrict__ x, int V,
                                                                    const int* __restrict__ valid,
                                                                    float* __restrict__ hi, unsigned* __restrict__ lo) {
    TRACE(head_screen_kernel);
    constexpr int D = 2048, NCH = D / 512;
    __shared__ unsigned block_lo[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long r0 = ((long)blockIdx.x * 8 + warp) * HEAD_SCREEN_ROWS;
    const int nv = min(*valid, V);
    uint4 c[HEAD_SCREEN_ROWS][NCH];
    float s[HEAD_SCREEN_ROWS], e[HEAD_SCREEN_ROWS];
#pragma unroll
    for (int j = 0; j < HEAD_SCREEN_ROWS; j++) {
        const long r = r0 + j;
        const bool ok = r < nv;
#pragma unroll
        for (int k = 0; k < NCH; k++)
            c[j][k] = ok ? ld_weight16(q + r * D + lane * 16 + 512 * k) : make_uint4(0u, 0u, 0u, 0u);
        s[j] = ok ? scale[r] : 0.f;
        e[j] = ok ? err[r] : 0.f;
    }
    pdl_wait();
    pdl_trigger();
    // x into shared memory, and ||x||_2 and max |x| with it: each thread's 8
    // elements, a warp's sums by shuffles, the 8 warps' through shared memory
    // after the staging barrier (D = 256 threads x 8)
    __shared__ float xsum[8], xmax[8];
    bf16* xs = decode_xs();
    {
        const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x) + threadIdx.x);
        *reinterpret_cast<uint4*>(xs + threadIdx.x * 8) = raw;
        float b[8], xx = 0.f, xm = 0.f;
        unpack8(raw, b);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            xx += b[i] * b[i];
            xm = fmaxf(xm, fabsf(b[i]));
        }
        xx = warp_sum(xx);
        xm = warp_max(xm);
        if (lane == 0) {
            xsum[warp] = xx;
            xmax[warp] = xm;
        }
    }
    __syncthreads();
    float xx = 0.f, xm = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) {
        xx += xsum[w];
        xm = fmaxf(xm, xmax[w]);
    }
    // as for a row: no bound (inf) for an x whose largest element is below
    // 2^-40 but not 0
    const float xn = xm > 0.f && xm < HEAD_TINY ? LILY_INF : sqrtf(xx);
    unsigned best = 0u;
    // x's 16 elements of chunk k are the same for both rows: loaded once
    float acc[HEAD_SCREEN_ROWS];
#pragma unroll
    for (int j = 0; j < HEAD_SCREEN_ROWS; j++) acc[j] = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; k++) {
        float b[16];
        load8(xs + lane * 16 + 512 * k, b);
        load8(xs + lane * 16 + 512 * k + 8, b + 8);
#pragma unroll
        for (int j = 0; j < HEAD_SCREEN_ROWS; j++) {
            float a[16];
            int8x4_to_float(c[j][k].x, a);
            int8x4_to_float(c[j][k].y, a + 4);
            int8x4_to_float(c[j][k].z, a + 8);
            int8x4_to_float(c[j][k].w, a + 12);
#pragma unroll
            for (int i = 0; i < 16; i++) acc[j] += a[i] * b[i];
        }
    }
#pragma unroll
    for (int j = 0; j < HEAD_SCREEN_ROWS; j++) {
        const float lq = warp_sum(acc[j]) * s[j], b = e[j] * xn;
        const long r = r0 + j;
        if (r < nv) {
            // a row without a finite bound (an inf or NaN weight or input)
            // is always a candidate: the exact product decides
            const bool finite = fabsf(lq) < LILY_INF && b < LILY_INF;
            if (lane == 0) hi[r] = finite ? lq + b : LILY_INF;
            if (finite) best = max(best, order_key(lq - b));
        }
    }
    if (lane == 0) block_lo[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < 8; w++) best = max(best, block_lo[w]);
        // most blocks find the maximum already above theirs: one read, no atomic
        if (best > __ldcg(lo)) atomicMax(lo, best);
    }
}

#define HEAD_PICK_TILE 1024  // rows a block scans: 256 threads x one float4
// The pick: each block scans HEAD_PICK_TILE rows of hi, lists those below
// *valid with hi >= T (T = order_value(*lo); -inf when no row had a finite
// bound, so every row), computes their exact logits a warp a row
// (chunk_dot, the full product's own sum: bit for bit gemv_kernel's), and folds
// argmax_entry of each into *best (argmax_finish_kernel reads and clears it).
// Grid ceil(V / HEAD_PICK_TILE), block 256; W [V, 2048] bf16.
extern "C" __global__ void __launch_bounds__(256) head_pick_kernel(const float* __restrict__ hi,
                                                                  const unsigned* __restrict__ lo,
                                                                  const int* __restrict__ valid,
                                                                  const bf16* __restrict__ W,
                                                                  const bf16* __restrict__ x, int V,
                                                                  u64* __restrict__ best) {
    TRACE(head_pick_kernel);
    constexpr int D = 2048, NCH = D / 256;
    __shared__ int rows[HEAD_PICK_TILE];
    __shared__ int nrows;
    __shared__ u64 warp_best[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nv = min(*valid, V);
    if (threadIdx.x == 0) nrows = 0;
    pdl_wait();
    pdl_trigger();
    const unsigned lk = __ldcg(lo);
    const float t = lk ? order_value(lk) : -LILY_INF;
    const long base = (long)blockIdx.x * HEAD_PICK_TILE + threadIdx.x * 4;
    float4 h = make_float4(0.f, 0.f, 0.f, 0.f);
    if (base + 3 < nv) {
        h = __ldcg(reinterpret_cast<const float4*>(hi + base));
    } else {
        if (base < nv) h.x = __ldcg(hi + base);
        if (base + 1 < nv) h.y = __ldcg(hi + base + 1);
        if (base + 2 < nv) h.z = __ldcg(hi + base + 2);
    }
    const bf16* xs = stage_xs(x, D);  // (its barrier also publishes nrows = 0)
    const float hv[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (base + i < nv && hv[i] >= t) rows[atomicAdd(&nrows, 1)] = (int)(base + i);
    __syncthreads();
    const int n = nrows;
    u64 m = 0ull;
    for (int i = warp; i < n; i += 8) {
        const long r = rows[i];
        const bf16* w = W + r * D;
        uint4 c[NCH];
#pragma unroll
        for (int k = 0; k < NCH; k++) c[k] = ld_weight16(w + lane * 8 + 256 * k);
        const u64 en = argmax_entry(chunk_dot<NCH>(c, xs), (unsigned)r);
        m = en > m ? en : m;
    }
    if (lane == 0) warp_best[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < 8; w++) m = warp_best[w] > m ? warp_best[w] : m;
        if (m) atomicMax(best, m);
    }
}
