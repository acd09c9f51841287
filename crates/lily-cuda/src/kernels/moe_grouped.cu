// Prefill experts as grouped GEMMs on the tensor cores: every expert's rows of
// a chunk in one launch per projection, no host round trip.
//
// The chunk's (token, slot) pairs are sorted by expert on the device
// (moe.cu: moe_count, then moe_tiles here, then moe_assign): expert e owns rows
// offsets[e] .. offsets[e] + counts[e] of the sorted order, and its rows are
// cut into tiles of GG_BM. moe_tiles_kernel lists the tiles: tiles[0] is their
// number, tiles[1 + i] = e | (tile of e) << 16. The GEMMs launch a grid sized
// for the most tiles any routing can make (pairs / GG_BM + E, rounded up) and
// the blocks past tiles[0] return at once, so nothing waits on the host.
//
// One block computes a GG_BM x GG_BN tile of C = A B^T with A [rows, K] bf16
// (row-major) and B the expert's weight [N, K] bf16 (row-major: out features
// by in features, as the checkpoint stores it), f32 accumulation:
//  - 8 warps as 2 (rows) x 4 (columns), a warp 64 x 32: 4 x 4 MMAs of
//    m16n8k16 per 16-wide k-step, its fragments from ldmatrix;
//  - K in steps of GG_BK = 64, GG_STAGES = 3 stages of cp.async in flight;
//  - shared memory rows of 64 bf16 = 8 chunks of 16 bytes, chunk c of row r
//    stored at chunk c ^ (r % 8), so the 8 rows an ldmatrix reads at one
//    chunk hit 8 different bank groups.
// Rows past the expert's count and columns past N load as zeros and are not
// stored; K must be a multiple of 8 (16-byte rows of A and B).
//
// gate/up (moe_gate_up_grouped_kernel): A row i is the normed hidden state of
// the pair's token, x[src[row]] (no gathered copy), B the expert's fused
// gate_up [2F, K]; the block's 128 B rows are 64 gate rows and the 64 up rows
// of the same features, placed so that a warp's n-tiles 0-1 are gate features
// and 2-3 the same features' up rows: each thread holds both and writes
// hs[row, f] = bf16(silu(gate) * up) directly (the CPU reference's order:
// SiLU of the f32 gate times the f32 up, rounded once). Grid (ceil(F / 64), tiles).
//
// down (moe_down_grouped_kernel): A = hs [rows, F], B the expert's down
// [D, F]; out [rows, D] f32 (moe_combine weights and sums a token's rows).
// Grid (ceil(D / 128), tiles).
//
// With tiles == NULL both run one group of `rows` rows (the shared expert):
// tile y is rows y * GG_BM .. , and src == NULL reads A's rows in order
// (down with one group is also the prefill GEMM of a block-FP8 projection).
//
// Block-FP8 B (a non-null scales pointer: e4m3 codes [N, K] with f32 scales
// [N / 128, K / 128], common.cuh; N and K multiples of 128): a thread loads
// its 4 rows' 8 codes of a k-tile into registers a tile ahead, and stores
// them into the B tile as bf16(code * scale), the layout the bf16 path's
// cp.async fills: the weights are dequantized in the main loop, rounded to
// bf16 once (transformers' FP8 fallback), and the MMAs are unchanged.
#include "common.cuh"
#define GG_BM 128
#define GG_BN 128
#define GG_BK 64
#define GG_STAGES 3
#define GG_THREADS 256
// dynamic shared memory of both GEMMs: A and B tiles of every stage
#define GG_SMEM (GG_STAGES * (GG_BM + GG_BN) * GG_BK * 2)

// One block of 256 threads, E <= 256: offsets = exclusive scan of counts, and
// the tile list above.
extern "C" __global__ void moe_tiles_kernel(const int* __restrict__ counts, int E, int* __restrict__ offsets,
                                            int* __restrict__ tiles) {
    __shared__ int c[256], off[256], first[257];
    int e = threadIdx.x;
    c[e] = e < E ? counts[e] : 0;
    __syncthreads();
    if (e == 0) {
        int o = 0, t = 0;
        for (int i = 0; i < E; i++) {
            off[i] = o;
            first[i] = t;
            o += c[i];
            t += (c[i] + GG_BM - 1) / GG_BM;
        }
        first[E] = t;
        tiles[0] = t;
    }
    __syncthreads();
    if (e < E) {
        offsets[e] = off[e];
        int n = first[e + 1] - first[e];
        for (int i = 0; i < n; i++) tiles[1 + first[e] + i] = (int)((unsigned)e | ((unsigned)i << 16));
    }
}

// element offset of 16-byte chunk `ch` of row `r` in a swizzled [rows][64] tile
__device__ __forceinline__ int gg_swz(int r, int ch) { return r * GG_BK + ((ch ^ (r & 7)) << 3); }

template <bool GATE_UP, bool FP8>
__device__ __forceinline__ void grouped_gemm(const bf16* __restrict__ a, const int* __restrict__ src,
                                             const void* __restrict__ w, const float* __restrict__ wscale,
                                             const int* __restrict__ tiles, const int* __restrict__ offsets,
                                             const int* __restrict__ counts, int rows, void* __restrict__ out,
                                             int N, int K) {
    extern __shared__ __align__(128) bf16 gg_smem[];
    int grp, r0, base, cnt;
    if (tiles) {
        if ((int)blockIdx.y >= tiles[0]) return;
        unsigned v = (unsigned)tiles[1 + blockIdx.y];
        grp = v & 0xffff;
        r0 = (int)(v >> 16) * GG_BM;
        base = offsets[grp];
        cnt = counts[grp];
    } else {
        grp = 0;
        r0 = blockIdx.y * GG_BM;
        base = 0;
        cnt = rows;
    }
    const int mrows = min(GG_BM, cnt - r0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    // gate/up: N = F, 64 features a block (their gate and up rows); down: 128 columns
    const int n0 = blockIdx.x * (GATE_UP ? GG_BN / 2 : GG_BN);
    const long wrows = (GATE_UP ? 2L : 1L) * N;  // B rows of a group
    const bf16* wg = reinterpret_cast<const bf16*>(w) + (long)grp * wrows * K;
    const unsigned char* wq = reinterpret_cast<const unsigned char*>(w) + (long)grp * wrows * K;
    const float* sg = FP8 ? wscale + (long)grp * (wrows / 128) * (K / 128) : nullptr;

    // this thread's 4 rows of each tile (row tid / 8 + 32 i, chunk tid % 8)
    const int ch = tid & 7;
    const bf16* arow[4];
    const bf16* brow[4];
    const unsigned char* bq[4];  // FP8: the row's codes
    const float* bsc[4];         // FP8: the row's scales (its row block)
    bool aok[4], bok[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = (tid >> 3) + 32 * i;
        aok[i] = r < mrows;
        long ar = aok[i] ? (long)base + r0 + r : 0;
        if (src && aok[i]) ar = src[ar];
        arow[i] = a + ar * K;
        int wr;
        if (GATE_UP) {
            // smem row r = 32 i + 16 half + j: warp column i's gate (half 0) or up rows
            int within = tid >> 3, half = within >> 4, f = n0 + 16 * i + (within & 15);
            bok[i] = f < N;
            wr = half * N + f;
        } else {
            wr = n0 + r;
            bok[i] = wr < N;
        }
        brow[i] = wg + (long)(bok[i] ? wr : 0) * K;
        if (FP8) {
            bq[i] = wq + (long)(bok[i] ? wr : 0) * K;
            bsc[i] = sg + (long)((bok[i] ? wr : 0) / 128) * (K / 128);
        }
    }
    bf16* As = gg_smem;
    bf16* Bs = gg_smem + GG_STAGES * GG_BM * GG_BK;
    const unsigned as0 = smem_addr(As), bs0 = smem_addr(Bs);
    const int ktiles = (K + GG_BK - 1) / GG_BK;
    auto load = [&](int stage, int kt) {
        int k = kt * GG_BK + ch * 8;
        bool kin = k < K;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = (tid >> 3) + 32 * i;
            unsigned off = (unsigned)(stage * GG_BM * GG_BK + gg_swz(r, ch)) * 2;
            cp_async16(as0 + off, arow[i] + (kin ? k : 0), (aok[i] && kin) ? 16 : 0);
            if (!FP8) cp_async16(bs0 + off, brow[i] + (kin ? k : 0), (bok[i] && kin) ? 16 : 0);
        }
    };
    // FP8: the thread's 4 rows' 8 codes of k-tile kt and their scales, into
    // registers; then, a tile later, into the B tile of a stage as bf16
    uint2 qv[4];
    float qs[4];
    auto load_q = [&](int kt) {
        int k = kt * GG_BK + ch * 8;
        bool kin = k < K;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bool okq = bok[i] && kin;
            qv[i] = okq ? __ldg(reinterpret_cast<const uint2*>(bq[i] + k)) : make_uint2(0u, 0u);
            qs[i] = okq ? __ldg(bsc[i] + k / 128) : 0.f;
        }
    };
    auto store_q = [&](int stage) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = (tid >> 3) + 32 * i;
            unsigned wv[2] = {qv[i].x, qv[i].y};
            unsigned o[4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float2 lo = e4m3x2_f32((unsigned short)(wv[h] & 0xffffu));
                float2 hi = e4m3x2_f32((unsigned short)(wv[h] >> 16));
                o[2 * h] = pack_bf16x2(lo.x * qs[i], lo.y * qs[i]);
                o[2 * h + 1] = pack_bf16x2(hi.x * qs[i], hi.y * qs[i]);
            }
            *reinterpret_cast<uint4*>(Bs + stage * GG_BN * GG_BK + gg_swz(r, ch)) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int x = 0; x < 4; x++) acc[i][j][x] = 0.f;

#pragma unroll
    for (int s = 0; s < GG_STAGES - 1; s++) {
        if (s < ktiles) {
            load(s, s);
            if (FP8) {
                load_q(s);
                store_q(s);
            }
        }
        cp_async_commit();
    }
    if (FP8 && GG_STAGES - 1 < ktiles) load_q(GG_STAGES - 1);
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<GG_STAGES - 2>();
        __syncthreads();
        // the stage refilled here was computed on in the previous iteration,
        // which every thread has finished (the barrier above); FP8 codes are
        // stored from the registers loaded an iteration ago, and the next
        // tile's loaded, in flight while this one is computed
        const int nxt = kt + GG_STAGES - 1;
        if (nxt < ktiles) {
            load(nxt % GG_STAGES, nxt);
            if (FP8) {
                store_q(nxt % GG_STAGES);
                if (nxt + 1 < ktiles) load_q(nxt + 1);
            }
        }
        cp_async_commit();
        const int stage = kt % GG_STAGES;
        const unsigned sa = as0 + stage * GG_BM * GG_BK * 2, sb = bs0 + stage * GG_BN * GG_BK * 2;
#pragma unroll
        for (int ks = 0; ks < GG_BK / 16; ks++) {
            unsigned af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                int r = wm * 64 + mi * 16 + (lane & 15);
                ldmatrix_x4(af[mi], sa + gg_swz(r, ks * 2 + (lane >> 4)) * 2);
            }
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
                int r = wn * 32 + nb * 16 + (lane & 7) + ((lane >> 4) << 3);
                unsigned t4[4];
                ldmatrix_x4(t4, sb + gg_swz(r, ks * 2 + ((lane >> 3) & 1)) * 2);
                bfr[2 * nb][0] = t4[0];
                bfr[2 * nb][1] = t4[1];
                bfr[2 * nb + 1][0] = t4[2];
                bfr[2 * nb + 1][1] = t4[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < 4; nj++)
                    mma_bf16(acc[mi][nj], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bfr[nj][0], bfr[nj][1]);
        }
    }
    cp_async_wait<0>();

    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int rl = wm * 64 + mi * 16 + g + 8 * hh;
            if (rl >= mrows) continue;
            long row = (long)base + r0 + rl;
            if (GATE_UP) {
#pragma unroll
                for (int nj = 0; nj < 2; nj++) {
                    int f = n0 + wn * 16 + nj * 8 + 2 * t4;
                    if (f >= N) continue;
                    float h0 = siluf_(acc[mi][nj][2 * hh]) * acc[mi][nj + 2][2 * hh];
                    float h1 = siluf_(acc[mi][nj][2 * hh + 1]) * acc[mi][nj + 2][2 * hh + 1];
                    reinterpret_cast<unsigned*>(out)[(row * N + f) >> 1] = pack_bf16x2(h0, h1);
                }
            } else {
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    int c = n0 + wn * 32 + nj * 8 + 2 * t4;
                    if (c >= N) continue;
                    *reinterpret_cast<float2*>(reinterpret_cast<float*>(out) + row * N + c) =
                        make_float2(acc[mi][nj][2 * hh], acc[mi][nj][2 * hh + 1]);
                }
            }
        }
}

// hs [rows, F] bf16 = silu(x W_gate^T) * (x W_up^T), x = h[src[row]] [K]; gate_up [E][2F][K]
// (bf16, or e4m3 codes with scales [E][2F / 128][K / 128] when `scales` is non-null).
extern "C" __global__ void __launch_bounds__(GG_THREADS) moe_gate_up_grouped_kernel(
    const bf16* __restrict__ h, const int* __restrict__ src, const void* __restrict__ gate_up,
    const float* __restrict__ scales, const int* __restrict__ tiles, const int* __restrict__ offsets,
    const int* __restrict__ counts, int rows, bf16* __restrict__ hs, int F, int K) {
    if (scales)
        grouped_gemm<true, true>(h, src, gate_up, scales, tiles, offsets, counts, rows, hs, F, K);
    else
        grouped_gemm<true, false>(h, src, gate_up, nullptr, tiles, offsets, counts, rows, hs, F, K);
}

// out [rows, D] f32 = hs W_down^T; down [E][D][F] (bf16, or e4m3 codes with
// scales [E][D / 128][F / 128] when `scales` is non-null).
extern "C" __global__ void __launch_bounds__(GG_THREADS) moe_down_grouped_kernel(
    const bf16* __restrict__ hs, const void* __restrict__ down, const float* __restrict__ scales,
    const int* __restrict__ tiles, const int* __restrict__ offsets, const int* __restrict__ counts, int rows,
    float* __restrict__ out, int D, int F) {
    if (scales)
        grouped_gemm<false, true>(hs, nullptr, down, scales, tiles, offsets, counts, rows, out, D, F);
    else
        grouped_gemm<false, false>(hs, nullptr, down, nullptr, tiles, offsets, counts, rows, out, D, F);
}
