// Decode matrix-vector product y[N] = W[N, K] x[K]: W and x bf16, y f32.
// One warp per row, 8 rows per 256-thread block; each lane holds 16-byte
// chunks of its row (K % 8 == 0), all in flight at once (decode_dot), loaded
// before the PDL wait: the weights stream while the previous kernel finishes.
// The mixers' products (gemv3, gemv_add) also take block-FP8 weights: a
// matrix's scales pointer non-null means its W is e4m3 codes with those
// block scales (common.cuh, W8A16), null means bf16.
#include "common.cuh"

// (At most 80 registers, three blocks an SM: the lm_head is 31,040 blocks,
// and its 2-pass staging path for K = 4096 would otherwise cost a block.)
extern "C" __global__ void __launch_bounds__(256, 3) gemv_kernel(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                       float* __restrict__ y, int N, int K) {
    TRACE(gemv_kernel);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool ok = row < N;
    float acc = decode_dot(W + (ok ? row : 0) * K, DecodeIn{x, nullptr, nullptr, 0.f}, K, ok);
    if (ok && lane == 0) y[row] = acc;
}

// Up to three decode matrix-vector products over the same input in one launch
// (q/k/v of attention, qkv/z/ba of GDN): one warp per row of the concatenated
// row ranges [0, N0) [N0, N0+N1) [N0+N1, N0+N1+N2), 8 rows per 256-thread block.
// Saves launches in the decode graph, where each costs a dependency gap.
// The input is the mixer's input RMSNorm of the residual stream xf [K] f32,
// w1p = 1 + w, computed by each block (stage_input_pre).
// Block 0 also zeroes clear[0, nclear) (nullable) after its PDL wait: a decode
// layer's first kernel resets the layer's flags (the MoE's RouteSlot in
// moe.cu) once every reader of the previous layer's has completed.
// S0..S2: each matrix's block scales, null for bf16 (the launcher keeps a
// block's rows in one matrix where formats differ).
extern "C" __global__ void gemv3_kernel(int K,
                                        const void* __restrict__ W0, const float* __restrict__ S0,
                                        float* __restrict__ y0, int N0,
                                        const void* __restrict__ W1, const float* __restrict__ S1,
                                        float* __restrict__ y1, int N1,
                                        const void* __restrict__ W2, const float* __restrict__ S2,
                                        float* __restrict__ y2, int N2,
                                        const float* __restrict__ xf, const float* __restrict__ w1p, float eps,
                                        unsigned long long* __restrict__ clear, int nclear) {
    TRACE(gemv3_kernel);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const void* W;
    const float* S;
    float* y;
    bool ok = true;
    if (row < N0) {
        W = W0;
        S = S0;
        y = y0;
    } else if (row < N0 + N1) {
        row -= N0;
        W = W1;
        S = S1;
        y = y1;
    } else {
        row -= N0 + N1;
        W = W2;
        S = S2;
        y = y2;
        ok = row < N2;
    }
    float acc = decode_dot_row<8>(W, S, ok ? row : 0, DecodeIn{nullptr, xf, w1p, eps}, K, ok);
    if (ok && lane == 0) y[row] = acc;
    // (decode_dot_k has passed the PDL wait)
    if (clear && blockIdx.x == 0 && (int)threadIdx.x < nclear) clear[threadIdx.x] = 0ull;
}

// Decode output projection of a mixer with the residual add fused in:
// x[row] += W[row, :] . h for the D rows, one warp a row (the kernels that
// read x next compute the norm that follows themselves, stage_input, so no
// last block runs it serially).
// S: W's block scales (W then e4m3 codes), null for bf16.
extern "C" __global__ void gemv_add_kernel(const void* __restrict__ W, const float* __restrict__ S, const bf16* h,
                                           int D, int K, float* __restrict__ x) {
    TRACE(gemv_add_kernel);
    int lane = threadIdx.x & 31;
    long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool ok = row < D;
    const long r = ok ? row : 0;
    const DecodeIn in{h, nullptr, nullptr, 0.f};
    float acc = S ? decode_dot_fp8(reinterpret_cast<const unsigned char*>(W) + r * K, S + (r / 128) * (K / 128), in, K, ok)
                  : decode_dot(reinterpret_cast<const bf16*>(W) + r * K, in, K, ok);
    if (ok && lane == 0) x[row] = __ldcg(x + row) + acc;
}
