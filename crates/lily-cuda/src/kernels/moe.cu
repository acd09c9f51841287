// Mixture of experts. Router rows are [E routed | 1 shared-expert gate], so
// one matrix product gives both. Experts are stored fused per layer:
// gate_up [E, 2F, D] (F gate rows, then F up rows) and down [E, D, F]; the
// shared expert sits in "slot K" with its own pointers and width Fs.
#include "common.cuh"

// Top-K selection order: the larger logit first, ties to the lower id.
__device__ __forceinline__ bool topk_before(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

// Order entries i < j of a lane's candidate list (v, id).
__device__ __forceinline__ void topk_cas(float* v, int* id, int i, int j) {
    if (topk_before(v[j], id[j], v[i], id[i])) {
        float tv = v[i];
        v[i] = v[j];
        v[j] = tv;
        int ti = id[i];
        id[i] = id[j];
        id[j] = ti;
    }
}

// The warp's top 8 of its 256 candidates (8 a lane), sorted, left in every
// lane's (v, id): each lane sorts its 8 (a 19-comparator network), then five
// butterfly rounds merge a lane's list with its xor partner's: c[i] =
// max(a[i], b[7 - i]) keeps the top 8 of both as a bitonic sequence, which
// three rounds of compare-exchange sort. Both partners end with the same list
// (the keys are distinct: ids break ties), so after the last round every
// lane holds the answer. 5 rounds of 16 independent shuffles, instead of K
// rounds of a 5-deep dependent argmax reduction (~4x fewer dependent steps).
__device__ __forceinline__ void topk8_warp(float* v, int* id) {
    topk_cas(v, id, 0, 2), topk_cas(v, id, 1, 3), topk_cas(v, id, 4, 6), topk_cas(v, id, 5, 7);
    topk_cas(v, id, 0, 4), topk_cas(v, id, 1, 5), topk_cas(v, id, 2, 6), topk_cas(v, id, 3, 7);
    topk_cas(v, id, 0, 1), topk_cas(v, id, 2, 3), topk_cas(v, id, 4, 5), topk_cas(v, id, 6, 7);
    topk_cas(v, id, 2, 4), topk_cas(v, id, 3, 5);
    topk_cas(v, id, 1, 4), topk_cas(v, id, 3, 6);
    topk_cas(v, id, 1, 2), topk_cas(v, id, 3, 4), topk_cas(v, id, 5, 6);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float bv[8];
        int bi[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            bv[i] = __shfl_xor_sync(0xffffffffu, v[i], o);
            bi[i] = __shfl_xor_sync(0xffffffffu, id[i], o);
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (topk_before(bv[7 - i], bi[7 - i], v[i], id[i])) {
                v[i] = bv[7 - i];
                id[i] = bi[7 - i];
            }
#pragma unroll
        for (int d = 4; d > 0; d >>= 1)
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (!(i & d)) topk_cas(v, id, i, i + d);
    }
}

// Softmax over the E routed logits of one token, top-K (ties to the lower id),
// renormalised; slot K carries the shared expert's gate sigmoid(l[E]); with
// wts null only the ids. Run by one warp; E <= 256, K <= 8 (the CUDA model
// checks both at load). Logits are
// read through L2 (__ldcg): in the fused decode kernel other blocks wrote
// them, and an SM's L1 may still hold last step's lines.
__device__ void topk_warp(const float* __restrict__ l, int E, int K, int* __restrict__ idx,
                          float* __restrict__ wts) {
    int lane = threadIdx.x & 31;
    // each lane's experts lane, lane + 32, ... read once, kept in registers
    float v[8];
    int ids[8];
#pragma unroll
    for (int s = 0; s < 8; s++) {
        ids[s] = lane + 32 * s;
        v[s] = ids[s] < E ? __ldcg(l + ids[s]) : -LILY_INF;
    }
    if (!wts) {  // the ids alone (the gate/up products need no weights)
        topk8_warp(v, ids);
        if (lane < K) {
            int e = ids[0];
#pragma unroll
            for (int k = 1; k < 8; k++)
                if (lane == k) e = ids[k];
            idx[lane] = e;
        }
        return;
    }
    float m = -LILY_INF;
#pragma unroll
    for (int s = 0; s < 8; s++) m = fmaxf(m, v[s]);
    m = warp_max(m);
    float z = 0.f;
#pragma unroll
    for (int s = 0; s < 8; s++) z += ids[s] < E ? expf(v[s] - m) : 0.f;
    z = warp_sum(z);
    topk8_warp(v, ids);
    float taken_sum = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        v[k] = expf(v[k] - m) / z;
        if (k < K) taken_sum += v[k];
    }
    if (lane < K) {
        float p = v[0];
        int e = ids[0];
#pragma unroll
        for (int k = 1; k < 8; k++)
            if (lane == k) {
                p = v[k];
                e = ids[k];
            }
        idx[lane] = e;
        wts[lane] = p / taken_sum;
    }
    if (lane == 0) wts[K] = sigmoidf_(__ldcg(l + E));
}

// One warp per token. logits: [T, E + 1]; idx: [T, K] int, wts: [T, K + 1] f32.
extern "C" __global__ void router_topk_kernel(const float* __restrict__ logits, int T, int E, int K,
                                              int* __restrict__ idx, float* __restrict__ wts) {
    int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;
    topk_warp(logits + (long)t * (E + 1), E, K, idx + (long)t * K, wts + (long)t * (K + 1));
}

// Decode: the router's matrix-vector product, logits [E + 1] (a warp per
// row of W [E + 1, D], 8 rows per 256-thread block, each row's weights in
// flight at once before the PDL wait). The top-K is not here: every block of
// the two expert kernels that follow runs it from the logits itself
// (topk_warp, ~a microsecond), which costs less than a last block here would
// (a fence, an atomic and one warp's top-K in series with the next kernel).
// The input is the post-attention RMSNorm of the residual stream xf, w1p =
// 1 + w (stage_input); block 0 also writes the normed input to xn (if
// non-null, D <= XS_MAX) for the experts' gate/up products, which run after
// this kernel has completed, so 576 blocks there stage a bf16 copy instead of
// each computing the norm again.
extern "C" __global__ void router_decode_kernel(const bf16* __restrict__ W,
                                                float* __restrict__ logits, int D, int E,
                                                const float* __restrict__ xf, const float* __restrict__ w1p,
                                                float eps, bf16* __restrict__ xn) {
    TRACE(router_decode_kernel);
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    bool ok = row <= E;
    float acc = decode_dot_k<8>(W + (long)(ok ? row : 0) * D, DecodeIn{nullptr, xf, w1p, eps}, D, ok);
    TRACE_MARK(11);  // (phase marks of the trace diagnostic, common.cuh)
    if (ok && lane == 0) logits[row] = acc;
    if (xn && blockIdx.x == 0) {
        const bf16* xs = decode_xs();  // staged by decode_dot, followed by a barrier
        for (int i = threadIdx.x * 8; i < D; i += blockDim.x * 8)
            *reinterpret_cast<uint4*>(xn + i) = *reinterpret_cast<const uint4*>(xs + i);
    }
}

// The routing of one decode token, computed by warp 0 of the calling block from
// the router's logits [E + 1] into shared memory: expert ids [K] and, with
// `weights`, their weights [K + 1] (slot K: the shared expert's gate). Every
// thread of the block calls it; it ends with a barrier.
struct Routing {
    int idx[8];
    float wts[9];
};

// One MoE layer's routing, published once in global memory (decode, D = 2048):
// gate/up block (0, 1) computes it with weights after its PDL wait, and its
// warp 0 publishes it right after the top-K, before the block's barrier (a
// first-wave block, ~1 us after the router completes); by the time the down
// product's blocks run it is (almost always) there, and they skip their own
// top-K, which is in the step's chain: their 126-register blocks become
// resident only as gate/up's leave (gate/up triggers before its top-K, so
// down may launch first: a block that does not see the flag within its spins
// runs the top-K itself). `flag` is stored with release semantics after the
// rest; readers acquire it. The layer's first kernel (gemv3_kernel, after its PDL wait:
// every reader of the previous layer has completed) zeroes the layer's flags,
// this slot among them. (kernels/moe.rs ROUTE_SLOT_BYTES mirrors its size)
struct RouteSlot {
    unsigned flag;
    unsigned pad;
    int idx[8];
    float wts[9];
};
#define ROUTE_SLOT_SPINS 32

__device__ __forceinline__ void st_release_u32(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Warp 0 of the block that has just computed r (after a __syncwarp): lane i
// stores value i, then lane 0 the flag with release semantics (the warp
// barrier orders the other lanes' stores before it).
__device__ __forceinline__ void route_publish(RouteSlot* __restrict__ slot, const Routing& r, int K) {
    const int lane = threadIdx.x & 31;
    if (lane < K) slot->idx[lane] = r.idx[lane];
    if (lane <= K) slot->wts[lane] = r.wts[lane];
    __syncwarp();
    if (lane == 0) st_release_u32(&slot->flag, 1u);
}

// Warp 0: the published routing into r if its flag is seen within the spins
// (every lane acquires it itself), else false.
__device__ __forceinline__ bool route_take(const RouteSlot* __restrict__ slot, Routing& r, int K) {
    const int lane = threadIdx.x & 31;
    bool seen = false;
    for (int i = 0; i < ROUTE_SLOT_SPINS; i++) {
        seen = __all_sync(0xffffffffu, ld_acquire_u32(&slot->flag) != 0u);
        if (seen) break;
        __nanosleep(64);
    }
    if (!seen) return false;
    if (lane < K) r.idx[lane] = __ldcg(slot->idx + lane);
    if (lane <= K) r.wts[lane] = __ldcg(slot->wts + lane);
    return true;
}

// `weights`: the down product's call (gate/up needs only the ids); `slot`:
// take the published routing from it when there (down); `publish`: publish
// the routing (with weights) there, before the barrier (gate/up).
__device__ __forceinline__ const Routing& route_block(const float* __restrict__ logits, int E, int K, bool weights,
                                                      const RouteSlot* __restrict__ slot = nullptr,
                                                      RouteSlot* __restrict__ publish = nullptr) {
    __shared__ Routing r;
    if (threadIdx.x < 32) {
        if (!(slot && route_take(slot, r, K))) topk_warp(logits, E, K, r.idx, weights || publish ? r.wts : nullptr);
        if (publish) {
            __syncwarp();
            route_publish(publish, r, K);
        }
    }
    __syncthreads();
    return r;
}

// h[slot, f] = bf16(silu(gate . x) * (up . x)) for one decode token's K experts
// and the shared one. Grid (ceil(max(F, Fs) / 8), K + 1), block 256 (a warp per
// f); blockIdx.y 0 is the shared expert (slot K), 1.. the routed slots 0..: the
// scheduler dispatches blocks in index order, so the shared expert's rows,
// which need no routing, stream while the router runs.
// Both rows of a warp (NCH 16-byte chunks per lane each) are loaded at once,
// before x is staged: the shared expert's before the PDL wait; a routed
// expert's id is known only after it (the router is the kernel before), so
// its rows are requested right after reading the id, and staging x overlaps
// them. (One decode token's x is the post-attention norm the router wrote.)
template <int NCH>
__device__ __forceinline__ void gate_up_dots(const bf16* __restrict__ g, const bf16* __restrict__ u,
                                             const bf16* x, bool ok, float& ag, float& au) {
    const int lane = threadIdx.x & 31;
    uint4 rg[NCH], ru[NCH];
    if (ok) {
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            rg[c] = ld_weight16(g + lane * 8 + 256 * c);
            ru[c] = ld_weight16(u + lane * 8 + 256 * c);
        }
    }
    pdl_wait();  // (a no-op for a routed expert: its kernel waited for the id)
    pdl_trigger();
    const bf16* xr = stage_xs(x, 256 * NCH);
    ag = au = 0.f;
    if (!ok) return;
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        float a[8], b[8], x8[8];
        unpack8(rg[c], a);
        unpack8(ru[c], b);
        load8(xr + lane * 8 + 256 * c, x8);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ag += a[i] * x8[i];
            au += b[i] * x8[i];
        }
    }
}

// gate_up_dots for block-FP8 rows of D = 512 * NCH codes (gs, us: the
// scales of the gate and up rows' row blocks): the lane's chunks and their
// scales in flight before x is staged.
template <int NCH>
__device__ __forceinline__ void gate_up_dots_fp8(const unsigned char* __restrict__ g,
                                                 const unsigned char* __restrict__ u, const float* __restrict__ gs,
                                                 const float* __restrict__ us, const bf16* x, bool ok, float& ag,
                                                 float& au) {
    const int lane = threadIdx.x & 31;
    uint4 rg[NCH], ru[NCH];
    float sg[NCH], su[NCH];
    if (ok) {
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            rg[c] = ld_weight16(g + lane * 16 + 512 * c);
            ru[c] = ld_weight16(u + lane * 16 + 512 * c);
            sg[c] = __ldg(gs + (lane >> 3) + 4 * c);
            su[c] = __ldg(us + (lane >> 3) + 4 * c);
        }
    }
    pdl_wait();  // (a no-op for a routed expert: its kernel waited for the id)
    pdl_trigger();
    const bf16* xr = stage_xs(x, 512 * NCH);
    ag = au = 0.f;
    if (!ok) return;
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        float xv[16];
        load16(xr + lane * 16 + 512 * c, xv);
        ag += sg[c] * dot16_e4m3(rg[c], xv);
        au += su[c] * dot16_e4m3(ru[c], xv);
    }
}

// One decode token: each block of a routed slot runs the top-K of the
// router's logits itself after the wait (route_block, ids only).
// (At most 80 registers: three 256-thread blocks an SM, 576 blocks in 1.45
// waves instead of 2.2. No L2 prefetch of the routed experts' down matrices
// here: it lengthens this kernel's DRAM stream by more than the down product
// gains; benchmarks/LEDGER.md.)
// gu_s, sgu_s: block-FP8 experts (gate_up and shared_gate_up e4m3 codes,
// their scales [E][2F / 128][D / 128] and [2Fs / 128][D / 128]); both null: bf16.
extern "C" __global__ void __launch_bounds__(256, 3)
    moe_gate_up_kernel(const bf16* __restrict__ x, const void* __restrict__ gate_up,
                       const void* __restrict__ shared_gate_up, bf16* __restrict__ h,
                       int D, int F, int Fs, int K, const float* __restrict__ logits, int E,
                       RouteSlot* __restrict__ route, const char* __restrict__ ahead, unsigned long long n_ahead,
                       const float* __restrict__ gu_s, const float* __restrict__ sgu_s) {
    TRACE(moe_gate_up_kernel);
    int lane = threadIdx.x & 31;
    int f = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int slot = blockIdx.y == 0 ? K : (int)blockIdx.y - 1;
    bool shared = slot == K;
    // `ahead` (nullable; n_ahead bytes): the shared expert's down matrix,
    // asked into L2 by the shared expert's blocks (dispatched first, before
    // the router completes) while the router and the routed blocks' top-K
    // leave the DRAM mostly idle, so the down product, whose blocks become
    // resident only as this kernel's leave, finds those 2 MB in L2. The
    // weight streams in between are read evict-first (ld_weight16), so the
    // lines stay (with evict-normal streams the prefetch gains nothing).
    if (shared && threadIdx.x == 0) l2_prefetch_share(ahead, n_ahead);
    int width = shared ? Fs : F;
    bool ok = f < width;
    const bf16* xr = x;
    float ag, au;
    if (D == 2048) {
        // the routed expert's id is known only after the wait
        const char* base = reinterpret_cast<const char*>(shared_gate_up);
        const float* sbase = sgu_s;
        if (!shared) {
            pdl_wait();
            // let the down product launch now, before this block's top-K: the
            // last gate/up block's trigger then no longer waits for its top-K,
            // and down's blocks take the SMs the second wave leaves sooner.
            // Safe: down still waits for this grid's completion before it
            // reads h.
            pdl_trigger();
            // block (0, 1) publishes the routing (with weights) for the down product
            const bool publish = route && blockIdx.x == 0 && slot == 0;
            const long e = route_block(logits, E, K, false, nullptr, publish ? route : nullptr).idx[slot];
            base = reinterpret_cast<const char*>(gate_up) + e * 2 * F * D * (gu_s ? 1 : 2);
            sbase = gu_s ? gu_s + e * (2 * F / 128) * (D / 128) : nullptr;
            TRACE_MARK(21);  // (phase marks of the trace diagnostic, common.cuh)
        }
        const long fr = ok ? f : 0;
        if (sbase) {
            const unsigned char* g = reinterpret_cast<const unsigned char*>(base) + fr * D;
            gate_up_dots_fp8<4>(g, g + (long)width * D, sbase + (fr / 128) * (D / 128),
                                sbase + ((width + fr) / 128) * (D / 128), xr, ok, ag, au);
        } else {
            const bf16* g = reinterpret_cast<const bf16*>(base) + fr * D;
            gate_up_dots<8>(g, g + (long)width * D, xr, ok, ag, au);
        }
        TRACE_MARK(22);
    } else {
        pdl_wait();
        pdl_trigger();
        const long e = shared ? 0 : route_block(logits, E, K, false).idx[slot];
        if (!ok) return;
        ag = au = 0.f;
        if (gu_s) {
            const unsigned char* base = shared ? reinterpret_cast<const unsigned char*>(shared_gate_up)
                                               : reinterpret_cast<const unsigned char*>(gate_up) + e * 2 * F * D;
            const float* sb = shared ? sgu_s : gu_s + e * (2 * F / 128) * (D / 128);
            const unsigned char* g = base + (long)f * D;
            const unsigned char* u = base + (long)(width + f) * D;
            const float* gs = sb + (f / 128) * (D / 128);
            const float* us = sb + ((width + f) / 128) * (D / 128);
            for (int k = lane * 16; k < D; k += 512) {
                float xv[16];
                load16_cg(xr + k, xv);
                ag += __ldg(gs + k / 128) * dot16_e4m3(ld_weight16(g + k), xv);
                au += __ldg(us + k / 128) * dot16_e4m3(ld_weight16(u + k), xv);
            }
        } else {
            const bf16* base = shared ? reinterpret_cast<const bf16*>(shared_gate_up)
                                      : reinterpret_cast<const bf16*>(gate_up) + e * 2 * F * D;
            const bf16* g = base + (long)f * D;
            const bf16* u = base + (long)(width + f) * D;
            for (int k = lane * 8; k < D; k += 256) {
                float a[8], b[8], c[8];
                load8(g + k, a);
                load8(u + k, b);
                load8_cg(xr + k, c);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    ag += a[i] * c[i];
                    au += b[i] * c[i];
                }
            }
        }
    }
    if (!ok) return;
    ag = warp_sum(ag);
    au = warp_sum(au);
    int hw = F > Fs ? F : Fs;
    if (lane == 0) h[slot * hw + f] = f2bf(siluf_(ag) * au);
}

// One warp's sum_slot w[slot] * down_slot[d, :] . h[slot, :] for output d
// of one decode token (any F, Fs). idx/wts are read with plain loads: the
// kernel's routing in shared memory. down_s null: bf16 weights; else
// block-FP8 codes with the scales of down [E][D / 128][F / 128] and of
// shared_down [D / 128][Fs / 128] (sdown_s).
__device__ __forceinline__ float moe_down_row(const bf16* __restrict__ h, const void* __restrict__ down,
                                              const void* __restrict__ shared_down, const float* __restrict__ down_s,
                                              const float* __restrict__ sdown_s, const int* __restrict__ idx,
                                              const float* __restrict__ wts, int D, int F, int Fs, int K, int d) {
    int lane = threadIdx.x & 31;
    int hw = F > Fs ? F : Fs;
    float total = 0.f;
    for (int slot = 0; slot <= K; slot++) {
        bool shared = slot == K;
        int width = shared ? Fs : F;
        const long row = shared ? (long)d * Fs : ((long)idx[slot] * D + d) * F;
        const bf16* hr = h + (long)slot * hw;
        float acc = 0.f;
        if (down_s) {
            const unsigned char* w = reinterpret_cast<const unsigned char*>(shared ? shared_down : down) + row;
            const float* sr = shared ? sdown_s + (long)(d / 128) * (Fs / 128)
                                     : down_s + ((long)idx[slot] * (D / 128) + d / 128) * (F / 128);
            for (int k = lane * 16; k < width; k += 512) {
                float xv[16];
                load16_cg(hr + k, xv);
                acc += __ldg(sr + k / 128) * dot16_e4m3(ld_weight16(w + k), xv);
            }
        } else {
            const bf16* w = reinterpret_cast<const bf16*>(shared ? shared_down : down) + row;
            for (int k = lane * 8; k < width; k += 256) {
                float a[8], b[8];
                load8(w + k, a);
                load8_cg(hr + k, b);
#pragma unroll
                for (int i = 0; i < 8; i++) acc += a[i] * b[i];
            }
        }
        total += wts[slot] * warp_sum(acc);
    }
    return total;
}

// Decode (one token): x[d] += sum_slot w[slot] * down_slot[d, :] . h[slot, :]
// (the residual add fused in), grid ceil(D / 8), block 256 (a warp per output
// d), with the RMSNorm that feeds the next layer's mixer (or the lm_head)
// fused into its last block: out = norm(x) * w1p.
// The routing is taken from `route` (RouteSlot, D = 2048) where gate/up
// published it, else computed by the block from the router's logits [E + 1]
// (route_block); the router completed before the previous kernel (gate/up)
// passed its own wait, and so before this kernel could launch, so this runs
// before the PDL wait. F = Fs = 512 (the released geometry; other widths
// take moe_down_row after the wait): a lane's 2 chunks of each of the 9 rows
// are all in flight before the PDL wait. With w1p null there is no norm (out
// and counter unused): the next kernels norm x themselves.
// down_s, sdown_s: block-FP8 experts (down and shared_down e4m3 codes, their
// scales [E][D / 128][F / 128] and [D / 128][Fs / 128]); both null: bf16. An
// FP8 row of 512 is one 16-byte chunk a lane (r[slot][0], scale sc[slot]).
extern "C" __global__ void moe_down_norm_kernel(const bf16* __restrict__ h, const void* __restrict__ down_w,
                                                const void* __restrict__ shared_down_w,
                                                const float* __restrict__ logits, int E, float* __restrict__ x,
                                                int D, int F, int Fs, int K, const float* __restrict__ w1p,
                                                bf16* __restrict__ out, float eps, unsigned* __restrict__ counter,
                                                const RouteSlot* __restrict__ route,
                                                const float* __restrict__ down_s, const float* __restrict__ sdown_s) {
    TRACE(moe_down_norm_kernel);
    int d = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    bool ok = d < D;
    const bool fixed = F == 512 && Fs == 512 && K == 8;
    const bool q8 = down_s != nullptr;
    const bf16* down = reinterpret_cast<const bf16*>(down_w);
    const bf16* shared_down = reinterpret_cast<const bf16*>(shared_down_w);
    const unsigned char* down8 = reinterpret_cast<const unsigned char*>(down_w);
    const unsigned char* shared_down8 = reinterpret_cast<const unsigned char*>(shared_down_w);
    uint4 r[9][2];
    float sc[9];
    // the shared expert's rows need no routing: in flight during the top-K
    if (fixed && ok) {
        if (q8) {
            r[8][0] = ld_weight16(shared_down8 + (long)d * 512 + lane * 16);
            sc[8] = __ldg(sdown_s + (d / 128) * 4 + (lane >> 3));
        } else {
            r[8][0] = ld_weight16(shared_down + (long)d * 512 + lane * 8);
            r[8][1] = ld_weight16(shared_down + (long)d * 512 + lane * 8 + 256);
        }
    }
    // (gate/up publishes only on its D = 2048 path)
    const Routing& rt = route_block(logits, E, K, true, D == 2048 ? route : nullptr);
    if (fixed) {
        if (ok) {
#pragma unroll
            for (int slot = 0; slot < 8; slot++) {
                if (q8) {
                    const long e = rt.idx[slot];
                    r[slot][0] = ld_weight16(down8 + (e * D + d) * 512 + lane * 16);
                    sc[slot] = __ldg(down_s + (e * (D / 128) + d / 128) * 4 + (lane >> 3));
                } else {
                    const bf16* row = down + ((long)rt.idx[slot] * D + d) * 512;
                    r[slot][0] = ld_weight16(row + lane * 8);
                    r[slot][1] = ld_weight16(row + lane * 8 + 256);
                }
            }
        }
        pdl_wait();
        pdl_trigger();
        const bf16* hs = stage_xs_p<3>(h, 9 * 512);
        if (ok) {
            float total = 0.f;
#pragma unroll
            for (int slot = 0; slot < 9; slot++) {
                const bf16* hr = hs + slot * 512;
                float acc = 0.f;
                if (q8) {
                    float xv[16];
                    load16(hr + lane * 16, xv);
                    acc = sc[slot] * dot16_e4m3(r[slot][0], xv);
                } else {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        float a[8], b[8];
                        unpack8(r[slot][c], a);
                        load8(hr + lane * 8 + 256 * c, b);
#pragma unroll
                        for (int i = 0; i < 8; i++) acc += a[i] * b[i];
                    }
                }
                total += rt.wts[slot] * warp_sum(acc);
            }
            if (lane == 0) x[d] = __ldcg(x + d) + total;
        }
    } else {
        pdl_wait();
        pdl_trigger();
        if (ok) {
            float total = moe_down_row(h, down_w, shared_down_w, down_s, sdown_s, rt.idx, rt.wts, D, F, Fs, K, d);
            if (lane == 0) x[d] = __ldcg(x + d) + total;
        }
    }
    if (w1p) last_block_norm(x, w1p, out, D, eps, counter);
}

// ---- Prefill: experts as grouped GEMMs ----
// A chunk of T tokens makes T*K (token, slot) pairs. They are sorted by expert
// (stable: in token order), each expert's rows are gathered into one block of
// a matrix, and cuBLAS multiplies each block by its expert's weights once,
// instead of every token re-reading its experts' weights.

// counts[e] += pairs routed to e. Grid ceil(T*K / 256), block 256; counts zeroed first.
extern "C" __global__ void moe_count_kernel(const int* __restrict__ idx, int n, int* __restrict__ counts) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(counts + idx[i], 1);
}

// One block (256 threads) per expert e: walk the pairs in order and give each
// pair routed to e the next row of e's block, starting at offsets[e].
// rowmap[pair] = row; src[row] = token.
extern "C" __global__ void moe_assign_kernel(const int* __restrict__ idx, int n, int K,
                                             const int* __restrict__ offsets, int* __restrict__ rowmap,
                                             int* __restrict__ src) {
    __shared__ int warp_counts[8];
    int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int base = offsets[e];
    for (int start = 0; start < n; start += blockDim.x) {
        int i = start + threadIdx.x;
        bool mine = i < n && idx[i] == e;
        unsigned ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) warp_counts[w] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int j = 0; j < (int)(blockDim.x >> 5); j++) {
            if (j < w) before += warp_counts[j];
            total += warp_counts[j];
        }
        if (mine) {
            int row = base + before + __popc(ballot & ((1u << lane) - 1u));
            rowmap[i] = row;
            src[row] = i / K;
        }
        base += total;
        __syncthreads();
    }
}

// x[t, d] += sum_slot wts[t, slot] * os[rowmap[t, slot], d] + wts[t, K] * osh[t, d],
// the slots summed in order as moe_down_row does. Grid T, block 256.
extern "C" __global__ void moe_combine_kernel(const float* __restrict__ os, const float* __restrict__ osh,
                                              const int* __restrict__ rowmap, const float* __restrict__ wts,
                                              float* __restrict__ x, int D, int K) {
    long t = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float total = 0.f;
        for (int s = 0; s < K; s++) total += wts[t * (K + 1) + s] * os[(long)rowmap[t * K + s] * D + d];
        total += wts[t * (K + 1) + K] * osh[t * D + d];
        x[t * D + d] += total;
    }
}
