// Shared helpers for every Lily kernel. No CUDA headers: bf16 is carried as
// its 16 raw bits, so NVRTC needs no include paths and CI's nvcc check is
// the same source the GPU compiles at start-up.
#pragma once
typedef unsigned short bf16;
typedef unsigned long long u64;
// NVRTC has no <math.h>: no INFINITY macro.
#define LILY_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

// Round to nearest even, as torch and the `half` crate do; NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// Monotone map float -> u32 (total order as Rust's f32::total_cmp for non-NaN):
// a < b  <=>  order_key(a) < order_key(b). Every real float maps to >= 0x007fffff,
// so 0 is "below everything".
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// Greedy choice as one integer maximum: (order_key(logit) << 32 | ~id), so the
// largest logit wins and, among equal ones, the lowest id; NaN maps to 0 and
// never wins. argmax_id(0) (nothing real) is id 0.
__device__ __forceinline__ u64 argmax_entry(float l, unsigned id) {
    return l == l ? ((u64)order_key(l) << 32) | (u64)(0xffffffffu - id) : 0ull;
}
__device__ __forceinline__ int argmax_id(u64 best) { return best == 0ull ? 0 : (int)(0xffffffffu - (unsigned)best); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    float t = lane < nw ? part[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---------------------------------------------------------------------------
// Tensor-core helpers (mma.sync, ldmatrix, cp.async): the decode attention and
// the prefill GEMM and attention kernels.

// d += a * b: m16n8k16, A row-major 16 x 16, B column-major 16 x 8, bf16 pairs
// (lower index in the low half), f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    // volatile, as ld_v4: NVVM keeps the two in program order. ptxas still
    // schedules freely (it sank a batch's own V loads below the batch's score
    // products), which is why attention.cu's decode partial kernel asks for V a batch ahead.
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8; register i of every lane holds its pair of matrix i
// (lane l: row l / 4, columns 2 (l % 4), +1). `_trans` hands out the
// transposed matrices (lane l: column l / 4, rows 2 (l % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared without passing through registers; `bytes` < 16
// fills the rest with zeros (0: all zeros, `src` is not read).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Two floats as a bf16 pair, the first in the low half (an MMA operand word).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// 8 bf16 held in a uint4 (16 bytes), widened to f32.
__device__ __forceinline__ void unpack8(uint4 v, float* out) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load8(const bf16* p, float* out) { unpack8(*reinterpret_cast<const uint4*>(p), out); }

// A 16-byte load of a weight: read once a step, never written, so through the
// non-coherent path and not kept in L1 (nothing reads it again), and first
// out of L2 (evict-first), which keeps what gate/up asks into L2 ahead (moe.cu:
// the shared expert's down matrix) from being evicted by the expert weights
// streaming past.
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    uint4 v;
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}

// This block's share (of gridDim.x) of the n bytes at p (16-byte aligned)
// asked into L2 by one bulk prefetch: no registers, no shared memory, nothing
// waits for it. Called by one thread; p null or n 0: nothing. (A bulk
// prefetch takes whole 16-byte units: a tail past the last one is left out,
// which a hint may do.)
__device__ __forceinline__ void l2_prefetch_share(const char* p, unsigned long long n) {
    n &= ~15ull;
    if (!p || n == 0) return;
    const unsigned long long share = ((n + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
    const unsigned long long off = share * blockIdx.x;
    if (off >= n) return;
    const unsigned bytes = (unsigned)(n - off < share ? n - off : share);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(bytes) : "memory");
}

// load8 through L2 only (ld.global.cg): for data an earlier kernel of the
// decode step wrote (see pdl_wait below).
__device__ __forceinline__ void load8_cg(const bf16* p, float* out) {
    unpack8(__ldcg(reinterpret_cast<const uint4*>(p)), out);
}

// One warp's dot product of a bf16 row with a bf16 vector (K % 8 == 0): each
// lane streams 16-byte chunks, so the warp reads 512 contiguous bytes a step.
// x is read through L2 (x_l2: written by an earlier kernel of the step) or
// plainly (x in shared memory). Every lane gets the sum.
__device__ __forceinline__ float warp_dot_bf16(const bf16* __restrict__ w, const bf16* __restrict__ x, int K,
                                               bool x_l2) {
    int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        float a[8], b[8];
        load8(w + k, a);
        if (x_l2)
            load8_cg(x + k, b);
        else
            load8(x + k, b);
#pragma unroll
        for (int i = 0; i < 8; i++) acc += a[i] * b[i];
    }
    return warp_sum(acc);
}

// The last block to finish of a decode kernel (one whose blocks each wrote a
// slice of x): out = bf16(x * rsqrt(mean(x^2) + eps) * w1p), the RMSNorm that
// feeds the next projection. Values other blocks wrote this launch are read
// through L2 (__ldcg). Resets `counter` so a captured graph can replay the
// kernel. Returns false in every block but the last.
__device__ __forceinline__ bool last_block_norm(const float* __restrict__ x, const float* __restrict__ w1p,
                                                bf16* __restrict__ out, int D, float eps,
                                                unsigned* __restrict__ counter) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = __ldcg(x + i);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) out[i] = f2bf(__ldcg(x + i) * inv * w1p[i]);
    if (threadIdx.x == 0) *counter = 0;
    return true;
}

// Decode-step timeline (LILY_TRACE, a timing diagnostic: defined only in the
// build `lily bench --trace` asks for, read back by crate::trace). Each block
// of a traced kernel (TRACE(its own name) at its top; the kernel table in
// kernels/mod.rs gives its id as LILY_TK_<name>) records, from thread 0, the global
// timer (ns) at its start, after its first PDL wait and at its exit (the
// scope's destructor, whichever return it takes), with the kernel id and its
// block index. Every module shares one ticket counter and one ring (device
// buffers whose addresses the host writes into each module's constants at
// load): a block takes its ticket at its start, so tickets order all traced
// blocks as they started (a launch's blocks all start before the next
// launch's first one), however coarse the timer. The ticket's atomic is
// issued at the start and its result first used at the exit (the empty asm
// keeps the compiler from moving that use up), so no block waits on it; the
// record is written by plain stores at the exit.
//
// A kernel may also mark one point inside its blocks (TRACE_MARK(n), kept
// where LILY_TRACE_MARK=n is defined with LILY_TRACE, `--trace-mark n`): thread 0 records the
// time it passes it (t3; 0 where no mark), which splits a block's time after
// its wait into phases, one phase boundary a traced run.
#ifndef LILY_TRACE_MARK
#define LILY_TRACE_MARK 0
#endif
#if defined(LILY_TRACE) && LILY_TRACE
struct TraceRec {
    u64 t0, t1, t2, t3;
    unsigned kid, block;
};
__constant__ unsigned* lily_trace_ticket;
__constant__ TraceRec* lily_trace_ring;
__constant__ unsigned lily_trace_mask;  // ring length - 1 (a power of two)
__shared__ u64 lily_trace_waited, lily_trace_marked;
__device__ __forceinline__ u64 trace_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// (x only: every traced kernel has 1D blocks, and a test ptxas can see is
// one lane keeps the ticket's atomic a plain one, not a warp-wide one that
// hands its result to the other lanes at once)
__device__ __forceinline__ bool trace_thread() { return threadIdx.x == 0; }
struct TraceScope {
    u64 t0;
    unsigned kid, slot;
    __device__ __forceinline__ explicit TraceScope(unsigned id) : t0(0), kid(id), slot(0) {
        if (trace_thread()) {
            t0 = trace_now();
            lily_trace_waited = 0;
            lily_trace_marked = 0;
            slot = atomicAdd(lily_trace_ticket, 1u);
        }
        asm volatile("" : "+r"(slot));
    }
    __device__ __forceinline__ ~TraceScope() {
        if (trace_thread()) {
            TraceRec r;
            r.t0 = t0;
            r.t1 = lily_trace_waited;
            r.t2 = trace_now();
            r.t3 = lily_trace_marked;
            r.kid = kid;
            r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
            lily_trace_ring[slot & lily_trace_mask] = r;
        }
    }
};
#define TRACE(kernel) TraceScope lily_trace_scope_(LILY_TK_##kernel)
__device__ __forceinline__ void trace_waited() {
    if (trace_thread() && lily_trace_waited == 0) lily_trace_waited = trace_now();
}
#define TRACE_MARK(n)                                                       \
    do {                                                                    \
        if ((n) == LILY_TRACE_MARK && trace_thread()) lily_trace_marked = trace_now(); \
    } while (0)
#else
#define TRACE(kernel)
__device__ __forceinline__ void trace_waited() {}
#define TRACE_MARK(n) \
    do {              \
    } while (0)
#endif

// Programmatic dependent launch (sm_90). Every kernel the kernel table
// (kernels/mod.rs) marks `pdl` calls pdl_wait() and is launched with
// programmatic stream serialization, so its blocks
// may be scheduled while the kernel before it is still finishing: the launch
// gap and its first loads overlap the previous kernel's tail. Before
// pdl_wait() such a kernel may only read what no earlier kernel of the step
// writes (weights, its own layer's recurrent state) and must write nothing;
// pdl_wait() blocks until every earlier kernel has completed and its writes
// are visible. pdl_trigger() (after the wait, so at most one kernel runs
// ahead) lets the next kernel launch early. Without the launch attribute
// both are no-ops. After
// the wait, whatever an earlier kernel wrote is read
// through L2 (__ldcg, load8_cg): a block launched early shares its SM's L1
// with the previous kernel's blocks, which may have cached the old contents
// of a buffer that kernel then rewrote (gemv_add reads h, then the router
// writes it), and no launch boundary invalidates those lines.
__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    trace_waited();
}
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The block's copy of a decode activation vector in shared memory (up to
// XS_MAX bf16): read once per block through L2 after the PDL wait, instead of
// once per warp (which, for the lm_head, would read as many bytes from L2 as
// the weights it streams). One static allocation per kernel that uses it.
#define XS_MAX 9216
__device__ __forceinline__ bf16* decode_xs() {
    __shared__ __align__(16) bf16 xs[XS_MAX];
    return xs;
}

// Copy n bf16 (n % 8 == 0, n <= XS_MAX) from global memory (through L2) into
// decode_xs(); every thread of the block calls it (it ends with a barrier).
// The first P passes of blockDim * 8 elements have all their loads issued
// before the first store (a load-store loop costs one L2 round trip per pass:
// three for the MoE down product's 4,608 elements at 256 threads); P is a
// template constant so a caller pays registers only for the passes it needs.
template <int P>
__device__ __forceinline__ const bf16* stage_xs_p(const bf16* __restrict__ x, int n) {
    bf16* xs = decode_xs();
    uint4 r[P];
#pragma unroll
    for (int c = 0; c < P; c++) {
        const int i = (threadIdx.x + c * blockDim.x) * 8;
        if (i < n) r[c] = __ldcg(reinterpret_cast<const uint4*>(x + i));
    }
#pragma unroll
    for (int c = 0; c < P; c++) {
        const int i = (threadIdx.x + c * blockDim.x) * 8;
        if (i < n) *reinterpret_cast<uint4*>(xs + i) = r[c];
    }
    for (int i = (threadIdx.x + P * blockDim.x) * 8; i < n; i += blockDim.x * 8)
        *reinterpret_cast<uint4*>(xs + i) = __ldcg(reinterpret_cast<const uint4*>(x + i));
    __syncthreads();
    return xs;
}

__device__ __forceinline__ const bf16* stage_xs(const bf16* __restrict__ x, int n) { return stage_xs_p<1>(x, n); }

// The input of a decode product: a bf16 vector x, or the RMSNorm of the f32
// residual stream xf, bf16(xf * rsqrt(mean(xf^2) + eps) * w1p) (w1p non-null),
// which every block of the consuming kernel computes for itself in
// stage_input: the same sums in the same order as last_block_norm
// (blockDim 256), so the bits match, but without a producer whose last block
// runs the norm serially while the whole GPU waits.
struct DecodeIn {
    const bf16* x;
    const float* xf;
    const float* w1p;
    float eps;
};

// Stage the input (n elements, n % 8 == 0, n <= XS_MAX) in decode_xs(); every
// thread of the block calls it, after the PDL wait. Generic n: a strided loop
// (one dependent L2 round trip per element a thread handles); the decode
// kernels of this model use stage_input_pre below.
__device__ __forceinline__ const bf16* stage_input(DecodeIn in, int n) {
    if (!in.w1p) return stage_xs(in.x, n);
    bf16* xs = decode_xs();
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = __ldcg(in.xf + i);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / n + in.eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = f2bf(__ldcg(in.xf + i) * inv * in.w1p[i]);
    __syncthreads();
    return xs;
}

// stage_input for n = 256 * PER with blockDim 256, in two parts: the norm
// weights (constants) are loaded before the PDL wait (norm_weights_pre), and
// after it each thread issues all PER loads of the residual stream at once and
// keeps them in registers, so the staging costs one L2 round trip and one
// block reduction instead of 2 * PER round trips (the strided loop above made
// every block of the input projections ~20 us slower per layer). Same
// elements per thread, same order, same bits as stage_input.
template <int PER>
__device__ __forceinline__ void norm_weights_pre(DecodeIn in, float (&w)[PER]) {
    if (!in.w1p) return;
#pragma unroll
    for (int c = 0; c < PER; c++) w[c] = __ldg(in.w1p + threadIdx.x + 256 * c);
}

template <int PER>
__device__ __forceinline__ const bf16* stage_input_pre(DecodeIn in, const float (&w)[PER]) {
    if (!in.w1p) return stage_xs_p<(PER + 7) / 8>(in.x, 256 * PER);
    bf16* xs = decode_xs();
    float v[PER];
#pragma unroll
    for (int c = 0; c < PER; c++) v[c] = __ldcg(in.xf + threadIdx.x + 256 * c);
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < PER; c++) ss += v[c] * v[c];
    float inv = rsqrtf(block_sum(ss) / (256 * PER) + in.eps);
#pragma unroll
    for (int c = 0; c < PER; c++) xs[threadIdx.x + 256 * c] = f2bf(v[c] * inv * w[c]);
    __syncthreads();
    return xs;
}

// The warp's dot product of a row with the staged x (K = 256 * NCH) from the
// lane's NCH 16-byte chunks of the row (lane * 8 + 256 c), in warp_dot_bf16's
// order: the decode GEMVs' sum, which the screened lm_head's exact rows
// (lm_head.cu) repeat bit for bit by calling it too.
template <int NCH>
__device__ __forceinline__ float chunk_dot(const uint4 (&r)[NCH], const bf16* xs) {
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        float a[8], b[8];
        unpack8(r[c], a);
        load8(xs + lane * 8 + 256 * c, b);
#pragma unroll
        for (int i = 0; i < 8; i++) acc += a[i] * b[i];
    }
    return warp_sum(acc);
}

// A warp's dot product of a weight row with x, K = 256 * NCH: the lane's NCH
// 16-byte chunks of the row (lane * 8 + 256 c) are all loaded into registers
// before pdl_wait(), so the whole row is in flight at once (a loop that loads
// a chunk and uses it keeps one 512-byte request per warp in flight, which
// leaves a decode GEMV latency-bound), and x is staged in shared memory after
// the wait. The sum runs in warp_dot_bf16's order. `ok` false (a warp past
// the last row): no loads, returns 0; the wait, trigger and staging still run.
template <int NCH>
__device__ __forceinline__ float prefetched_dot(const bf16* __restrict__ w, DecodeIn x, bool ok) {
    const int lane = threadIdx.x & 31;
    uint4 r[NCH];
    if (ok) {
#pragma unroll
        for (int c = 0; c < NCH; c++) r[c] = ld_weight16(w + lane * 8 + 256 * c);
    }
    float nw[NCH];
    norm_weights_pre(x, nw);
    pdl_wait();
    pdl_trigger();
    const bf16* xs = stage_input_pre(x, nw);
    if (!ok) return 0.f;
    return chunk_dot<NCH>(r, xs);
}

// prefetched_dot for the K of this model's decode GEMVs (512, 1024, 2048,
// 4096), warp_dot_bf16 after the wait for any other K (K % 8 == 0). Every
// thread of the block must call it (it holds the PDL wait and a barrier).
__device__ __forceinline__ float unprefetched_dot(const bf16* __restrict__ w, DecodeIn x, int K, bool ok) {
    pdl_wait();
    pdl_trigger();
    if (K > XS_MAX) return ok ? warp_dot_bf16(w, x.x, K, true) : 0.f;  // (a normed input needs K <= XS_MAX)
    const bf16* xs = stage_input(x, K);
    return ok ? warp_dot_bf16(w, xs, K, false) : 0.f;
}

__device__ __forceinline__ float decode_dot(const bf16* __restrict__ w, DecodeIn x, int K, bool ok) {
    switch (K) {
        case 512: return prefetched_dot<2>(w, x, ok);
        case 1024: return prefetched_dot<4>(w, x, ok);
        case 2048: return prefetched_dot<8>(w, x, ok);
        case 4096: return prefetched_dot<16>(w, x, ok);
        default: return unprefetched_dot(w, x, K, ok);
    }
}

// ---- Block FP8 weights (W8A16) ----
// A block-FP8 matrix [N, K] (quant.rs of lily-model: Qwen's -FP8 releases) is
// N x K e4m3 codes, a byte each, row-major, and an f32 scale per 128 x 128
// block, [N / 128, K / 128] row-major (N and K multiples of 128 on the GPU):
// w[n][k] = e4m3(code) * scale[n / 128][k / 128]. A decode lane holds 16-byte
// chunks of 16 codes at columns lane * 16 + 512 c, so its chunk c lies in the
// scale column lane / 8 + 4 c. The codes widen exactly (e4m3 -> f16 -> f32),
// each chunk's 16 products sum in f32 and the chunk's sum is scaled once:
// the weights are never rounded to bf16.

// Two e4m3 codes (the first in the low byte), widened exactly.
__device__ __forceinline__ float2 e4m3x2_f32(unsigned short v) {
    unsigned h;
    float lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    asm("{\n\t.reg .f16 fl, fh;\n\tmov.b32 {fl, fh}, %2;\n\tcvt.f32.f16 %0, fl;\n\tcvt.f32.f16 %1, fh;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(h));
    return make_float2(lo, hi);
}

// sum_i e4m3(w_i) x_i over the 16 codes of a chunk, in index order.
__device__ __forceinline__ float dot16_e4m3(uint4 w, const float (&x)[16]) {
    unsigned ww[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        float2 a = e4m3x2_f32((unsigned short)(ww[q] & 0xffffu));
        float2 b = e4m3x2_f32((unsigned short)(ww[q] >> 16));
        acc += a.x * x[4 * q];
        acc += a.y * x[4 * q + 1];
        acc += b.x * x[4 * q + 2];
        acc += b.y * x[4 * q + 3];
    }
    return acc;
}

// 16 bf16 of shared memory (16-byte aligned) widened.
__device__ __forceinline__ void load16(const bf16* p, float (&x)[16]) {
    load8(p, x);
    load8(p + 8, x + 8);
}
// 16 bf16 an earlier kernel of the step wrote, through L2.
__device__ __forceinline__ void load16_cg(const bf16* p, float (&x)[16]) {
    load8_cg(p, x);
    load8_cg(p + 8, x + 8);
}

// The lane's chunk c of an FP8 row against the staged x, scaled.
__device__ __forceinline__ float chunk_dot_fp8(uint4 r, float s, const bf16* xs, int c) {
    float x[16];
    load16(xs + (threadIdx.x & 31) * 16 + 512 * c, x);
    return s * dot16_e4m3(r, x);
}

// prefetched_dot for an FP8 row of K = 512 * NCH codes (srow: the scales of
// its row block): the codes and their scales in flight before the PDL wait.
template <int NCH>
__device__ __forceinline__ float prefetched_dot_fp8(const unsigned char* __restrict__ w,
                                                    const float* __restrict__ srow, DecodeIn x, bool ok) {
    const int lane = threadIdx.x & 31;
    uint4 r[NCH];
    float s[NCH];
    if (ok) {
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            r[c] = ld_weight16(w + lane * 16 + 512 * c);
            s[c] = __ldg(srow + (lane >> 3) + 4 * c);
        }
    }
    float nw[2 * NCH];
    norm_weights_pre(x, nw);
    pdl_wait();
    pdl_trigger();
    const bf16* xs = stage_input_pre(x, nw);
    if (!ok) return 0.f;
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < NCH; c++) acc += chunk_dot_fp8(r[c], s[c], xs, c);
    return warp_sum(acc);
}

// An FP8 row of any K (a multiple of 128 up to XS_MAX) after the wait.
__device__ __forceinline__ float unprefetched_dot_fp8(const unsigned char* __restrict__ w,
                                                      const float* __restrict__ srow, DecodeIn x, int K, bool ok) {
    pdl_wait();
    pdl_trigger();
    const bf16* xs = stage_input(x, K);
    if (!ok) return 0.f;
    const int lane = threadIdx.x & 31;
    float acc = 0.f;
    for (int k = lane * 16; k < K; k += 512) {
        float xv[16];
        load16(xs + k, xv);
        acc += __ldg(srow + k / 128) * dot16_e4m3(ld_weight16(w + k), xv);
    }
    return warp_sum(acc);
}

// decode_dot for an FP8 row.
__device__ __forceinline__ float decode_dot_fp8(const unsigned char* __restrict__ w, const float* __restrict__ srow,
                                                DecodeIn x, int K, bool ok) {
    switch (K) {
        case 512: return prefetched_dot_fp8<1>(w, srow, x, ok);
        case 1024: return prefetched_dot_fp8<2>(w, srow, x, ok);
        case 2048: return prefetched_dot_fp8<4>(w, srow, x, ok);
        case 4096: return prefetched_dot_fp8<8>(w, srow, x, ok);
        default: return unprefetched_dot_fp8(w, srow, x, K, ok);
    }
}

// decode_dot for a kernel whose K is almost always 256 * NCH (the hidden
// size): a kernel's register count is that of its largest path, and the
// 16-chunk path (115 registers) would cap a 2048-wide product at two blocks
// per SM.
template <int NCH>
__device__ __forceinline__ float decode_dot_k(const bf16* __restrict__ w, DecodeIn x, int K, bool ok) {
    return K == 256 * NCH ? prefetched_dot<NCH>(w, x, ok) : unprefetched_dot(w, x, K, ok);
}

// decode_dot_k for a row that is bf16 (scales null) or block FP8 (scales: the
// matrix's, [N / 128, K / 128]); the format must be the same for every warp
// of the block (both paths hold barriers). NCH as decode_dot_k's (bf16
// chunks): the FP8 path of the same K holds half as many.
template <int NCH>
__device__ __forceinline__ float decode_dot_row(const void* __restrict__ w, const float* __restrict__ scales,
                                                long row, DecodeIn x, int K, bool ok) {
    if (!scales) return decode_dot_k<NCH>(reinterpret_cast<const bf16*>(w) + row * K, x, K, ok);
    const unsigned char* wr = reinterpret_cast<const unsigned char*>(w) + row * K;
    const float* srow = scales + (row / 128) * (K / 128);
    return K == 256 * NCH ? prefetched_dot_fp8<NCH / 2>(wr, srow, x, ok) : unprefetched_dot_fp8(wr, srow, x, K, ok);
}
