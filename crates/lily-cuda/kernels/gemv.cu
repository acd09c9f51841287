// Decode matrix-vector product y[N] = W[N, K] x[K]: W and x bf16, y f32.
// One warp per row, 8 rows per 256-thread block; each lane holds 16-byte
// chunks of its row (K % 8 == 0), all in flight at once (decode_dot), loaded
// before the PDL wait: the weights stream while the previous kernel finishes.
#include "common.cuh"

// (At most 80 registers, three blocks an SM: the lm_head is 31,040 blocks,
// and its 2-pass staging path for K = 4096 would otherwise cost a block.)
extern "C" __global__ void __launch_bounds__(256, 3) gemv_kernel(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                       float* __restrict__ y, int N, int K) {
    TRACE(TK_GEMV);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool ok = row < N;
    float acc = decode_dot(W + (ok ? row : 0) * K, DecodeIn{x, nullptr, nullptr, 0.f}, K, ok);
    if (ok && lane == 0) y[row] = acc;
}

// f32 -> bf16 conversion of an activation buffer (inputs of the prefill GEMMs).
extern "C" __global__ void to_bf16_kernel(const float* __restrict__ x, bf16* __restrict__ out, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = f2bf(x[i]);
}

// x[i] += d[i]
extern "C" __global__ void add_kernel(float* __restrict__ x, const float* __restrict__ d, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        x[i] += d[i];
}

// Up to three decode matrix-vector products over the same input in one launch
// (q/k/v of attention, qkv/z/ba of GDN): one warp per row of the concatenated
// row ranges [0, N0) [N0, N0+N1) [N0+N1, N0+N1+N2), 8 rows per 256-thread block.
// Saves launches in the decode graph, where each costs a dependency gap.
// With w1p non-null the input is the mixer's input RMSNorm of the residual
// stream xf [K] f32, computed by each block (stage_input), and x is unused.
// Block 0 also zeroes clear[0, nclear) after its PDL wait: a decode layer's
// first kernel resets the layer's flags (the MoE's RouteSlot in moe.cu, the
// GDN core's count of blocks done) once every reader of the previous layer's
// has completed.
extern "C" __global__ void gemv3_kernel(const bf16* __restrict__ x, int K,
                                        const bf16* __restrict__ W0, float* __restrict__ y0, int N0,
                                        const bf16* __restrict__ W1, float* __restrict__ y1, int N1,
                                        const bf16* __restrict__ W2, float* __restrict__ y2, int N2,
                                        const float* __restrict__ xf, const float* __restrict__ w1p, float eps,
                                        unsigned long long* __restrict__ clear, int nclear) {
    TRACE(TK_GEMV3);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bf16* W;
    float* y;
    bool ok = true;
    if (row < N0) {
        W = W0;
        y = y0;
    } else if (row < N0 + N1) {
        row -= N0;
        W = W1;
        y = y1;
    } else {
        row -= N0 + N1;
        W = W2;
        y = y2;
        ok = row < N2;
    }
    float acc = decode_dot_k<8>(W + (ok ? row : 0) * K, DecodeIn{x, xf, w1p, eps}, K, ok);
    if (ok && lane == 0) y[row] = acc;
    // (decode_dot_k has passed the PDL wait)
    if (clear && blockIdx.x == 0 && (int)threadIdx.x < nclear) clear[threadIdx.x] = 0ull;
}

// Decode output projection of a mixer with the residual add and the
// post-attention RMSNorm fused in: delta[D] = W[D, K] h[K]; then the last
// block does x += delta, out = norm(x) (out may alias h: every block has read
// h before it counts itself done). With w1p null there is no norm: each
// warp adds its row into x itself (x[row] += delta[row]; delta, out and
// counter unused) and the kernels that read x next compute the norm
// (stage_input), so no last block runs it serially.
// `ready` (nullable), `nready`: h's producer signals it early (input_wait):
// the GDN core counts its blocks there once their output is written, so the
// product runs while the core's state stores drain; the kernel then waits for
// the core's completion before it exits.
extern "C" __global__ void gemv_add_norm_kernel(const bf16* __restrict__ W, const bf16* h, float* __restrict__ delta,
                                                int D, int K, float* __restrict__ x, const float* __restrict__ w1p,
                                                bf16* out, float eps, unsigned* __restrict__ counter,
                                                const unsigned* __restrict__ ready, unsigned nready) {
    TRACE(TK_GEMV_ADD_NORM);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool ok = row < D;
    float acc = decode_dot(W + (ok ? row : 0) * K, DecodeIn{h, nullptr, nullptr, 0.f}, K, ok, ready, nready);
    if (!w1p) {
        if (ok && lane == 0) x[row] = __ldcg(x + row) + acc;
        if (ready) pdl_wait();
        return;
    }
    if (ready) pdl_wait();
    if (ok && lane == 0) delta[row] = acc;
    last_block_add_norm(x, delta, w1p, out, D, eps, counter);
}
