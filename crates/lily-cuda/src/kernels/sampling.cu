// Next-token selection on the GPU; only the chosen id leaves the device.
#include "common.cuh"

// ---------------------------------------------------------------------------
// Sampling: temperature, top-k, top-p, min-p, then one draw with a host-given
// uniform u in [0, 1). Same semantics as lily-engine's `Sampler::sample`
// (penalties are the caller's business: apply them to the logits first).
//
// One block of exactly 1024 threads (SMP_THREADS). All probability mass is
// carried as 64-bit fixed point, mass(l) = floor(exp((l - M) / T) * 2^S) with
// M the max logit and S = 62 - ceil(log2(#real logits)), so every sum is an
// integer sum: order-free, hence the result is a pure function of the inputs.
// Tokens with exp((l - M) / T) < 2^-S (about 6e-14 at this vocabulary) weigh 0
// and are never drawn. NaN logits and ids >= valid are never candidates.
//
// 1. One pass over the logits: the max key, the number of real logits, and
//    each thread's best four tokens (a register list; its best is its "best").
// 2. A window [W, inf) of keys that provably holds every token that can be
//    drawn: for top-k (k <= 1024) W = the k-th best of the 1024 per-thread
//    bests (so >= k tokens lie above it); without top-k, W = max(the zero-mass
//    bound, the min-p bound, and for top-p a point above which the per-thread
//    top-4 lists (step 3) already hold top_p * Z, Z from one more pass).
// 3. The window goes to shared memory: from per-thread top-4 lists kept in
//    step 1 when no thread can have dropped a window token, else by one more
//    pass. If it holds at most
//    SMP_CAP tokens (the usual case: top_k = 20, or peaked distributions), the
//    window is bitonic-sorted by (logit desc, id asc), exactly the CPU order,
//    and top-k / top-p / min-p / the draw are done as the CPU does them: the
//    same u gives the same token as the CPU sampler (up to rounding).
// 4. Otherwise (a wide window: top_k > 1024, or no top-k and a flat
//    distribution) the thresholds are found on the logits in global memory by
//    bisection on the key, counting (top-k) or summing mass (top-p); a tie at a
//    threshold keeps every tied token, and the draw walks tokens in id order
//    (same distribution as the CPU, but not the same token for a given u).
//    Each bisection step is one more pass over the logits (up to ~65 passes).
// Degenerate input: no real logit -> 0; max logit +-inf, or T <= 0 / NaN, or
// top_k == 1 -> the lowest id holding the max (what the CPU sampler returns).
// ---------------------------------------------------------------------------

#define SMP_THREADS 1024
#define SMP_CAP 4096
#define SMP_FULL 0xffffffffu
#define SMP_UNROLL 4
#define SMP_NONE 0x7fffffff

__device__ __forceinline__ float smp_unkey(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ float smp_nan() { return __uint_as_float(0x7fc00000u); }

struct SmpMass {
    float M, T, scale;  // scale = 2^S
    __device__ __forceinline__ u64 operator()(unsigned key) const {
        const float d = smp_unkey(key) - M;  // <= 0, or -inf
        const float p = d == 0.f ? 1.f : expf(d / T);
        return (u64)(p * scale);
    }
};

__device__ __forceinline__ u64 smp_shfl_xor(u64 v, int o) {
    const unsigned lo = __shfl_xor_sync(SMP_FULL, (unsigned)v, o);
    const unsigned hi = __shfl_xor_sync(SMP_FULL, (unsigned)(v >> 32), o);
    return ((u64)hi << 32) | lo;
}
__device__ __forceinline__ u64 smp_shfl_up(u64 v, int o) {
    const unsigned lo = __shfl_up_sync(SMP_FULL, (unsigned)v, o);
    const unsigned hi = __shfl_up_sync(SMP_FULL, (unsigned)(v >> 32), o);
    return ((u64)hi << 32) | lo;
}

// Block reductions (every thread gets the result; every thread must call).
__device__ __noinline__ u64 smp_sum(u64 v) {
    __shared__ u64 part[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += smp_shfl_xor(v, o);
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    u64 t = lane < nw ? part[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) t += smp_shfl_xor(t, o);
    return t;
}
__device__ __noinline__ unsigned smp_max_u32(unsigned v) {
    __shared__ unsigned part[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(SMP_FULL, v, o));
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    unsigned t = lane < nw ? part[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) t = max(t, __shfl_xor_sync(SMP_FULL, t, o));
    return t;
}
__device__ __noinline__ u64 smp_max_u64(u64 v) {
    __shared__ u64 part[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) { const u64 t = smp_shfl_xor(v, o); v = t > v ? t : v; }
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    u64 t = lane < nw ? part[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) { const u64 n = smp_shfl_xor(t, o); t = n > t ? n : t; }
    return t;
}
__device__ __noinline__ int smp_min_i32(int v) {
    __shared__ int part[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(SMP_FULL, v, o));
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    int t = lane < nw ? part[lane] : SMP_NONE;
    for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(SMP_FULL, t, o));
    return t;
}
// Inclusive prefix sum over threads in thread order; *total = the block's sum.
__device__ __noinline__ u64 smp_scan(u64 v, u64* total) {
    __shared__ u64 ws[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = smp_shfl_up(v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();
    if (lane == 31) ws[w] = v;
    __syncthreads();
    if (w == 0) {
        u64 s = lane < nw ? ws[lane] : 0ull;
        for (int o = 1; o < 32; o <<= 1) {
            const u64 n = smp_shfl_up(s, o);
            if (lane >= o) s += n;
        }
        ws[lane] = s;
    }
    __syncthreads();
    *total = ws[nw - 1];
    return v + (w > 0 ? ws[w - 1] : 0ull);
}

// ceil(f * z) clamped to [1, z], and floor(u * z) clamped to [0, z - 1] (z >= 1).
__device__ __forceinline__ u64 smp_ceil_frac(float f, u64 z) {
    const double x = (double)f * (double)z;
    u64 t = (u64)x;
    if ((double)t < x) t++;
    if (t > z) t = z;
    return t < 1ull ? 1ull : t;
}
__device__ __forceinline__ u64 smp_floor_frac(float u, u64 z) {
    const double x = (double)u * (double)z;
    u64 t = x > 0.0 ? (u64)x : 0ull;
    return t >= z ? z - 1ull : t;
}

// f(i, l) for every i < valid (l is NaN for the filler calls). 16-byte loads,
// SMP_UNROLL of them in flight per thread; a scalar round before the first
// 16-byte boundary and one after the last. Every thread makes the same number
// of calls, so f may use warp votes.
template <class F>
__device__ __forceinline__ void smp_each(const float* __restrict__ x, int valid, F f) {
    const int nt = blockDim.x, tid = threadIdx.x;
    int head = (int)(((16u - ((unsigned)(unsigned long long)x & 15u)) & 15u) >> 2);  // x is 4-byte aligned
    if (head > valid) head = valid;
    f(tid, tid < head ? x[tid] : smp_nan());
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    const int n4 = (valid - head) >> 2;
    for (int base = 0; base < n4; base += SMP_UNROLL * nt) {
        float4 v[SMP_UNROLL];
#pragma unroll
        for (int q = 0; q < SMP_UNROLL; q++) {
            const int j = base + q * nt + tid;
            v[q] = j < n4 ? x4[j] : make_float4(smp_nan(), smp_nan(), smp_nan(), smp_nan());
        }
#pragma unroll
        for (int q = 0; q < SMP_UNROLL; q++) {
            const int i = head + 4 * (base + q * nt + tid);
            f(i, v[q].x);
            f(i + 1, v[q].y);
            f(i + 2, v[q].z);
            f(i + 3, v[q].w);
        }
    }
    const int tail = head + 4 * n4 + tid;
    f(tail, tail < valid ? x[tail] : smp_nan());
}

// (count, mass) of real logits with key >= t.
__device__ __noinline__ void smp_count_mass(const float* __restrict__ x, int valid, unsigned t, const SmpMass& mass,
                                            u64* count, u64* msum) {
    u64 c = 0, m = 0;
    smp_each(x, valid, [&](int, float l) {
        if (l == l) {
            const unsigned k = order_key(l);
            if (k >= t) { c++; m += mass(k); }
        }
    });
    *count = smp_sum(c);
    *msum = smp_sum(m);
}

// Fast path: the c <= SMP_CAP window tokens sit in buf as (key << 32 | ~id).
__device__ __noinline__ int smp_sorted_pick(u64* buf, int c, int k, bool use_p, float top_p, u64 z_all, unsigned tmin,
                                            const SmpMass& mass, float u) {
    const int tid = threadIdx.x, nt = blockDim.x;
    int N = 1;
    while (N < c) N <<= 1;
    for (int j = c + tid; j < N; j += nt) buf[j] = 0ull;
    __syncthreads();
    // Bitonic sort, descending: (logit desc, id asc), the CPU sampler's order.
    for (int size = 2; size <= N; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = tid; t < (N >> 1); t += nt) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const u64 a = buf[i], b = buf[j];
                if ((a < b) == ((i & size) == 0)) { buf[i] = b; buf[j] = a; }
            }
            __syncthreads();
        }
    }
    const int kk = (k > 0 && k < c) ? k : c;  // exact top-k, ties broken by id as on the CPU
    const int per = N > nt ? N / nt : 1;      // <= SMP_CAP / SMP_THREADS = 4
    const int j0 = tid * per;
    unsigned key[4];
    int id[4];
    u64 m[4], local = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int j = j0 + q;
        const bool own = q < per && j < kk;
        const u64 e = own ? buf[j] : 0ull;
        key[q] = (unsigned)(e >> 32);
        id[q] = (int)(0xffffffffu - (unsigned)e);
        m[q] = own ? mass(key[q]) : 0ull;
        local += m[q];
    }
    u64 total;
    const u64 before = smp_scan(local, &total) - local;  // mass of sorted positions < j0
    u64 cum[4];
    {
        u64 run = before;
#pragma unroll
        for (int q = 0; q < 4; q++) { run += m[q]; cum[q] = run; }
    }
    int keep = kk;
    if (use_p) {  // the shortest prefix whose mass reaches top_p of the top-k mass
        const u64 target = smp_ceil_frac(top_p, k > 0 ? total : z_all);
        int first = SMP_NONE;
        u64 prev = before;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int j = j0 + q;
            if (q < per && j < kk && cum[q] >= target && prev < target) first = min(first, j);
            prev = cum[q];
        }
        first = smp_min_i32(first);
        if (first != SMP_NONE && first + 1 < keep) keep = first + 1;
    }
    if (tmin != 0u) {  // min-p: a prefix too, as keys are sorted; never empties (the max passes)
        int first = SMP_NONE;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int j = j0 + q;
            if (q < per && j < kk && key[q] < tmin) first = min(first, j);
        }
        first = smp_min_i32(first);
        if (first < keep) keep = first;
    }
    if (keep < 1) keep = 1;
    u64 zk = 0;
#pragma unroll
    for (int q = 0; q < 4; q++)
        if (q < per && j0 + q == keep - 1) zk = cum[q];
    const u64 z = smp_sum(zk);
    const u64 r = smp_floor_frac(u, z);
    int pick = SMP_NONE;
    {
        u64 prev = before;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int j = j0 + q;
            if (q < per && j < keep && cum[q] > r && prev <= r) pick = min(pick, id[q]);
            prev = cum[q];
        }
    }
    pick = smp_min_i32(pick);
    return pick == SMP_NONE ? (int)(0xffffffffu - (unsigned)buf[0]) : pick;
}

// The lowest id holding the largest real logit (NaN never wins; none -> 0),
// as (key << 32 | ~id) maximised over the block.
__device__ __noinline__ int smp_argmax(const float* __restrict__ x, int valid) {
    u64 best = 0;
    smp_each(x, valid, [&](int i, float l) {
        const u64 e = argmax_entry(l, (unsigned)i);
        best = e > best ? e : best;
    });
    return argmax_id(smp_max_u64(best));
}

// Greedy: out[0] = the lowest id holding the largest of logits[0..V), NaN
// never chosen (all NaN -> 0). One block of 1024 threads.
extern "C" __global__ void argmax_kernel(const float* __restrict__ logits, int V, int* __restrict__ out) {
    const int id = smp_argmax(logits, V);
    if (threadIdx.x == 0) out[0] = id;
}

// The greedy choice of a decode step over the logits the lm_head just wrote
// (still in L2), spread over the grid: each thread folds a few float4 of
// logits[0..*valid) into argmax_entry form, each block its maximum into *best
// with one atomicMax nobody waits for (*best holds 0 before;
// argmax_finish_kernel reads and clears it). One L2 round trip on every SM
// instead of one block streaming the 1 MB of logits. Block 256 threads, any
// grid. *valid is set by the host, so it is read before the PDL wait.
extern "C" __global__ void argmax_blocks_kernel(const float* __restrict__ logits, const int* __restrict__ valid,
                                                u64* __restrict__ best) {
    TRACE(argmax_blocks_kernel);
    const int nv = *valid;
    pdl_wait();
    pdl_trigger();
    const long nt = (long)gridDim.x * blockDim.x, tid = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int n4 = nv >> 2;
    u64 m = 0ull;
    for (long j = tid; j < n4; j += nt) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(logits) + j);
        const unsigned i = (unsigned)(4 * j);
        u64 e = argmax_entry(v.x, i);
        const u64 e1 = argmax_entry(v.y, i + 1), e2 = argmax_entry(v.z, i + 2), e3 = argmax_entry(v.w, i + 3);
        e = e1 > e ? e1 : e;
        e = e2 > e ? e2 : e;
        e = e3 > e ? e3 : e;
        m = e > m ? e : m;
    }
    for (long i = 4L * n4 + tid; i < nv; i += nt) {  // the last nv % 4
        const u64 e = argmax_entry(__ldcg(logits + i), (unsigned)i);
        m = e > m ? e : m;
    }
    m = smp_max_u64(m);
    if (threadIdx.x == 0 && m) atomicMax(best, m);
}

// The end of a greedy decode step, after argmax_blocks_kernel has folded every
// logit into *best: the chosen id goes to next[0] (the token the
// next step feeds) and, when `host` is given (page-locked host memory mapped
// for the device), to host[p & 1] for the step at position p, where the host
// reads it while the next step already runs; the position advances by one (at
// most to max_pos, so a replayed graph never writes past the KV cache) and
// *best is cleared for the next step, and *clear (nullable: the screened
// lm_head's threshold, lm_head.cu) too. On the device, so consecutive steps
// need nothing from the host.
extern "C" __global__ void argmax_finish_kernel(u64* __restrict__ best, int* __restrict__ next,
                                                int* __restrict__ pos, int max_pos, volatile int* host,
                                                unsigned* __restrict__ clear) {
    TRACE(argmax_finish_kernel);
    pdl_wait();
    pdl_trigger();
    if (threadIdx.x != 0) return;
    const int id = argmax_id(__ldcg(best));
    next[0] = id;
    *best = 0ull;
    if (clear) *clear = 0u;
    const int p = __ldcg(pos);
    if (host) host[p & 1] = id;
    if (p < max_pos) *pos = p + 1;
}

// The draw in id order among real ids with key >= thr: the smallest id whose
// mass prefix exceeds r = floor(u * total). Ids are cut into <= SMP_THREADS
// tiles of ts ids (a multiple of 32): one pass sums each tile (a warp a tile),
// a block scan finds the tile, a second scan over the tile finds the id.
// Integer sums: exact, so the two levels agree.
__device__ __noinline__ int smp_draw_in_id_order(const float* __restrict__ x, int valid, unsigned thr, const SmpMass& mass,
                                                 float u, u64* tiles) {
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, w = tid >> 5, nw = nt >> 5;
    const int per = (valid + nt * 32 - 1) / (nt * 32);
    const int ts = 32 * per, ntile = (valid + ts - 1) / ts;  // ntile <= nt
    for (int t = w; t < ntile; t += nw) {
        u64 acc = 0;
        const int t0 = t * ts;
        for (int b = 0; b < per; b += 8) {
            float v[8];
#pragma unroll
            for (int q = 0; q < 8; q++) {
                const int i = t0 + (b + q) * 32 + lane;
                v[q] = (b + q < per && i < valid) ? x[i] : smp_nan();
            }
#pragma unroll
            for (int q = 0; q < 8; q++)
                if (v[q] == v[q]) {
                    const unsigned key = order_key(v[q]);
                    if (key >= thr) acc += mass(key);
                }
        }
        for (int o = 16; o > 0; o >>= 1) acc += smp_shfl_xor(acc, o);
        if (lane == 0) tiles[t] = acc;
    }
    __syncthreads();
    u64 total;
    const u64 mine = tid < ntile ? tiles[tid] : 0ull;
    const u64 incl = smp_scan(mine, &total);  // total >= mass of the max token > 0
    const u64 r = smp_floor_frac(u, total);
    int tile = smp_min_i32(incl > r && incl - mine <= r ? tid : SMP_NONE);
    if (tile == SMP_NONE) tile = ntile - 1;  // unreachable: r < total, and the sums are exact
    // every thread reads the chosen tile's prefix from the owner's scan result
    const u64 base = smp_sum(tid == tile ? incl - mine : 0ull);
    // within the tile: thread t owns ids [t0 + t*ch, t0 + (t+1)*ch)
    const int ch = (ts + nt - 1) / nt, t0 = tile * ts + tid * ch;
    u64 part = 0;
    for (int c = 0; c < ch; c++) {
        const int i = t0 + c;
        if (i < valid && i < (tile + 1) * ts) {
            const float l = x[i];
            if (l == l) {
                const unsigned key = order_key(l);
                if (key >= thr) part += mass(key);
            }
        }
    }
    u64 tt;
    const u64 pincl = smp_scan(part, &tt);
    int pick = SMP_NONE;
    u64 run = base + pincl - part;
    if (run <= r && base + pincl > r) {
        for (int c = 0; c < ch && pick == SMP_NONE; c++) {
            const int i = t0 + c;
            if (i < valid && i < (tile + 1) * ts) {
                const float l = x[i];
                if (l == l) {
                    const unsigned key = order_key(l);
                    if (key >= thr) {
                        run += mass(key);
                        if (run > r) pick = i;
                    }
                }
            }
        }
    }
    return smp_min_i32(pick);
}

// Wide path: thresholds by bisection on the key over the logits in global
// memory (only keys >= w can matter; a tie at a threshold keeps all tied
// tokens), then the draw in id order. `tiles` is SMP_THREADS u64 of scratch.
__device__ __noinline__ int smp_global_pick(const float* __restrict__ x, int valid, unsigned w, unsigned kmax, int k, bool use_p,
                                            float top_p, u64 z_all, unsigned tmin, const SmpMass& mass, float u, u64* tiles) {
    unsigned tk = w;
    if (k > 0) {  // the largest t with count(key >= t) >= k; count(>= w) >= k holds
        unsigned lo = w, hi = kmax + 1u;
        while (hi - lo > 1u) {
            const unsigned mid = lo + ((hi - lo) >> 1);
            u64 c = 0;
            smp_each(x, valid, [&](int, float l) {
                if (l == l && order_key(l) >= mid) c++;
            });
            c = smp_sum(c);
            if (c >= (u64)k) {
                lo = mid;
                if (c == (u64)k) break;  // exactly the top k: no higher threshold changes the set
            } else {
                hi = mid;
            }
        }
        tk = lo;
    }
    unsigned thr = tk;
    if (use_p) {  // the largest t >= tk with mass(key >= t) >= target
        u64 c_lo, m_lo, c_hi = 0;
        smp_count_mass(x, valid, tk, mass, &c_lo, &m_lo);
        const u64 target = smp_ceil_frac(top_p, k > 0 ? m_lo : z_all);
        unsigned lo = tk, hi = kmax + 1u;
        if (m_lo >= target) {
            while (hi - lo > 1u && c_lo - c_hi > 1ull) {  // one token left in [lo, hi): lo is exact
                const unsigned mid = lo + ((hi - lo) >> 1);
                u64 c, m;
                smp_count_mass(x, valid, mid, mass, &c, &m);
                if (m >= target) { lo = mid; c_lo = c; } else { hi = mid; c_hi = c; }
            }
        }
        thr = lo;
    }
    if (tmin > thr) thr = tmin;  // thr <= kmax: the max token always stays
    return smp_draw_in_id_order(x, valid, thr, mass, u, tiles);
}

// Launch with grid (1,1,1), block (SMP_THREADS,1,1), no dynamic shared memory.
// logits: f32 [>= valid]; temperature > 0; top_k 0 = off; top_p in (0, 1],
// 1 = off; min_p in [0, 1], 0 = off; u in [0, 1). Writes the id to out[0].
// (__launch_bounds__: 64 registers at 1024 threads.)
extern "C" __global__ __launch_bounds__(SMP_THREADS) void sample_kernel(const float* __restrict__ logits, int valid,
                                                                      float temperature, int top_k, float top_p,
                                                                      float min_p, float u, int* __restrict__ out) {
    __shared__ u64 s_buf[SMP_CAP];
    __shared__ int s_cnt;
    const int tid = threadIdx.x, lane = tid & 31;
    if (valid <= 0) {
        if (tid == 0) out[0] = 0;
        return;
    }
    // 1. max key, number of real logits, and this thread's best four tokens
    //    as (key << 32 | ~id), e0 > e1 > e2 > e3 (0 = none)
    u64 n = 0, e0 = 0, e1 = 0, e2 = 0, e3 = 0;
    smp_each(logits, valid, [&](int i, float l) {
        if (l == l) {
            n++;
            const u64 e = argmax_entry(l, (unsigned)i);
            if (e > e3) {
                if (e > e1) {
                    e3 = e2;
                    e2 = e1;
                    if (e > e0) { e1 = e0; e0 = e; } else { e1 = e; }
                } else if (e > e2) {
                    e3 = e2;
                    e2 = e;
                } else {
                    e3 = e;
                }
            }
        }
    });
    const unsigned mine = (unsigned)(e0 >> 32);  // this thread's best key (0 = none)
    const unsigned kmax = smp_max_u32(mine);
    const u64 n_ok = smp_sum(n);
    if (n_ok == 0ull) {
        if (tid == 0) out[0] = 0;
        return;
    }
    const float M = smp_unkey(kmax), T = temperature;
    if (!(M - M == 0.f) || !(T > 0.f) || top_k == 1) {  // the lowest id holding the max
        const int best = smp_argmax(logits, valid);
        if (tid == 0) out[0] = best;
        return;
    }
    const int S = 62 - (n_ok > 1ull ? 64 - __clzll((long long)(n_ok - 1ull)) : 0);
    const SmpMass mass{M, T, __uint_as_float((unsigned)(127 + S) << 23)};
    const int k = (top_k > 0 && (u64)top_k < n_ok) ? top_k : 0;
    const bool use_p = top_p < 1.f;
    const unsigned tmin = min_p > 0.f ? order_key(M + T * logf(min_p)) : 0u;

    // 2. the window [W, inf)
    unsigned W = 0;
    u64 z_all = 0;
    if (k > 0) {
        if (k <= (int)blockDim.x) {  // the k-th best of the per-thread bests
            unsigned lo = 0, hi = kmax + 1u;
            while (hi - lo > 1u) {
                const unsigned mid = lo + ((hi - lo) >> 1);
                if (__syncthreads_count(mine >= mid) >= k) lo = mid; else hi = mid;
            }
            W = lo;
        }
    } else {
        W = order_key(M - T * ((float)S * 0.6931472f + 2.f));  // below it every mass is 0
        if (use_p) {
            const unsigned w0 = W;
            u64 z = 0;
            smp_each(logits, valid, [&](int, float l) {
                if (l == l) {
                    const unsigned key = order_key(l);
                    if (key >= w0) z += mass(key);
                }
            });
            z_all = smp_sum(z);
            const u64 target = smp_ceil_frac(top_p, z_all);
            // the per-thread lists (4096 distinct tokens) alone reach top_p: the nucleus starts above
            const unsigned q0 = (unsigned)(e0 >> 32), q1 = (unsigned)(e1 >> 32), q2 = (unsigned)(e2 >> 32),
                           q3 = (unsigned)(e3 >> 32);
            const u64 m0 = q0 >= w0 ? mass(q0) : 0ull, m1 = q1 >= w0 ? mass(q1) : 0ull,
                      m2 = q2 >= w0 ? mass(q2) : 0ull, m3 = q3 >= w0 ? mass(q3) : 0ull;
            if (smp_sum(m0 + m1 + m2 + m3) >= target) {
                unsigned lo = w0, hi = kmax + 1u;
                while (hi - lo > 1u) {
                    const unsigned mid = lo + ((hi - lo) >> 1);
                    const u64 my = (q0 >= mid ? m0 : 0ull) + (q1 >= mid ? m1 : 0ull) + (q2 >= mid ? m2 : 0ull) +
                                   (q3 >= mid ? m3 : 0ull);
                    if (smp_sum(my) >= target) lo = mid; else hi = mid;
                }
                W = lo;
            }
        }
        if (tmin > W) W = tmin;
    }

    // 3. the window's tokens into shared memory (any order; sorted later):
    //    straight from the per-thread lists when they provably hold all of it
    //    (no thread dropped a token with key >= W), else by one more pass.
    int c;
    const bool lists_hold_it = W != 0u && !__syncthreads_or(n > 4ull && (unsigned)(e3 >> 32) >= W);
    if (lists_hold_it) {
        const u64 e[4] = {e0, e1, e2, e3};
        int cnt = 0;
#pragma unroll
        for (int q = 0; q < 4; q++) cnt += (unsigned)(e[q] >> 32) >= W ? 1 : 0;  // W > 0: "none" never counts
        u64 total;
        const int at = (int)(smp_scan((u64)cnt, &total) - (u64)cnt);
        c = (int)total;
        if (c <= SMP_CAP) {
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (q < cnt) s_buf[at + q] = e[q];  // e0..e3 descend, so the first cnt are the ones >= W
        }
        __syncthreads();
    } else {
        if (tid == 0) s_cnt = 0;
        __syncthreads();
        const unsigned wc = W;
        smp_each(logits, valid, [&](int i, float l) {
            const bool q = l == l && order_key(l) >= wc;
            const unsigned b = __ballot_sync(SMP_FULL, q);
            if (b) {
                int base = 0;
                if (lane == 0) base = atomicAdd(&s_cnt, __popc(b));
                base = __shfl_sync(SMP_FULL, base, 0);
                const int slot = base + __popc(b & ((1u << lane) - 1u));
                if (q && slot < SMP_CAP) s_buf[slot] = ((u64)order_key(l) << 32) | (u64)(0xffffffffu - (unsigned)i);
            }
        });
        __syncthreads();
        c = s_cnt;
    }
    const int pick = c <= SMP_CAP ? smp_sorted_pick(s_buf, c, k, use_p, top_p, z_all, tmin, mass, u)
                                  : smp_global_pick(logits, valid, W, kmax, k, use_p, top_p, z_all, tmin, mass, u, s_buf);
    if (tid == 0) out[0] = pick;
}

// ---------------------------------------------------------------------------
// Penalties, logit bias and log-probabilities on the device, so a request
// that sets them still sends only its choice (and the numbers it asked for)
// to the host. Same arithmetic, in the same order, as lily-engine's host
// sampler (`Sampler::penalized`, `Logprobs::of`); the _rn intrinsics keep
// nvcc from fusing what the host rounds twice.
// ---------------------------------------------------------------------------

// A generated token is fed: its count (presence / frequency penalties) and
// its bit in `seen` (the repetition penalty: prompt and generated tokens).
// One thread. Ids outside [0, valid) change nothing.
extern "C" __global__ void penalty_feed_kernel(int token, int valid, unsigned* __restrict__ counts,
                                               unsigned* __restrict__ seen) {
    if (threadIdx.x != 0 || token < 0 || token >= valid) return;
    counts[token] += 1u;
    seen[token >> 5] |= 1u << (token & 31);
}

// logits[i] += bias[i] for i < valid where the bias is non-zero (OpenAI's
// logit_bias, dense). Any grid of 256 threads.
extern "C" __global__ void logit_bias_kernel(float* __restrict__ logits, int valid, const float* __restrict__ bias) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < valid; i += gridDim.x * blockDim.x) {
        const float b = bias[i];
        if (b != 0.f) logits[i] = __fadd_rn(logits[i], b);
    }
}

// out[i] = the penalized logits[i] for i < valid: on a token in `seen` (a
// bitset) the repetition penalty r != 1 divides a positive logit by r and
// multiplies any other; a token generated c > 0 times loses
// presence + frequency * c. Any grid of 256 threads.
extern "C" __global__ void penalize_kernel(const float* __restrict__ logits, int valid,
                                           const unsigned* __restrict__ counts, const unsigned* __restrict__ seen,
                                           float presence, float frequency, float repetition, float* __restrict__ out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < valid; i += gridDim.x * blockDim.x) {
        float x = logits[i];
        if (repetition != 1.f && ((seen[i >> 5] >> (i & 31)) & 1u))
            x = x > 0.f ? __fdiv_rn(x, repetition) : __fmul_rn(x, repetition);
        const unsigned c = counts[i];
        if (c) x = __fsub_rn(x, __fadd_rn(presence, __fmul_rn(frequency, (float)c)));
        out[i] = x;
    }
}

// Log-probabilities, step 1 of 2. Block b (LP_THREADS threads) takes ids
// [b*chunk, (b+1)*chunk) of [0, valid): its largest real logit m_b, the sum
// of exp(l - m_b) over its real logits (f64), and its n best entries
// (argmax_entry order: logit desc, id asc; 0 = none). part: per block,
// LP_PART(n) u64: [0] m_b as f32 bits, [1] the sum as f64 bits, [2..2+n) the
// entries. chunk <= LP_THREADS * LP_PER.
#define LP_THREADS 256
#define LP_PER 8
#define LP_MAX_N 20
#define LP_PART(n) (2 + (n))

// Candidates a thread of logprobs_finish_kernel holds (blocks * n of them in all).
#define LP_FIN_PER 10

// The block's largest u64 below `below` among every thread's `e[P]`.
template <int P>
__device__ __forceinline__ u64 lp_next_below(const u64 (&e)[P], u64 below) {
    u64 m = 0ull;
#pragma unroll
    for (int q = 0; q < P; q++)
        if (e[q] < below && e[q] > m) m = e[q];
    return smp_max_u64(m);
}

extern "C" __global__ __launch_bounds__(LP_THREADS) void logprobs_partial_kernel(const float* __restrict__ logits,
                                                                               int valid, int chunk, int n,
                                                                               u64* __restrict__ part) {
    const int b0 = blockIdx.x * chunk, b1 = min(valid, b0 + chunk);
    u64 e[LP_PER];
    float m = -LILY_INF;
#pragma unroll
    for (int q = 0; q < LP_PER; q++) {
        const int i = b0 + q * LP_THREADS + threadIdx.x;
        const float l = i < b1 ? logits[i] : smp_nan();
        e[q] = argmax_entry(l, (unsigned)i);
        if (l == l) m = fmaxf(m, l);
    }
    const unsigned mk = smp_max_u32(order_key(m));
    const float bm = smp_unkey(mk);  // -inf when nothing is real
    double s = 0.0;
    if (bm - bm == 0.f) {  // finite
#pragma unroll
        for (int q = 0; q < LP_PER; q++) {
            const int i = b0 + q * LP_THREADS + threadIdx.x;
            if (i < b1) {
                const float l = logits[i];
                if (l == l) s += exp((double)(l - bm));
            }
        }
    }
    // the block sum of f64 s, through the u64 reduction's shared memory pattern
    __shared__ double ps[LP_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(SMP_FULL, s, o);
    if ((threadIdx.x & 31) == 0) ps[threadIdx.x >> 5] = s;
    __syncthreads();
    u64* out = part + (long)blockIdx.x * LP_PART(n);
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < LP_THREADS / 32; w++) t += ps[w];
        out[0] = (u64)__float_as_uint(bm);
        out[1] = (u64)__double_as_longlong(t);
    }
    u64 below = ~0ull;
    for (int j = 0; j < n; j++) {
        below = lp_next_below(e, below);
        if (threadIdx.x == 0) out[2 + j] = below;
        if (below == 0ull) {
            for (int k = j + 1; k < n; k++)
                if (threadIdx.x == 0) out[2 + k] = 0ull;
            break;
        }
    }
}

// Log-probabilities, step 2 of 2 (one block of LP_THREADS threads), after the
// choice is in next[0]: lse = M + log(sum_b s_b exp(m_b - M)) with M the
// largest m_b, then out[0] = the chosen id, out[1] = logits[id] - lse (f32
// bits; -inf for an id outside [0, valid) or a NaN logit), and for j < n:
// out[2 + 2j] = the j-th most likely id (-1: none), out[3 + 2j] its logprob.
// Needs blocks * n <= LP_THREADS * LP_FIN_PER.
extern "C" __global__ __launch_bounds__(LP_THREADS) void logprobs_finish_kernel(const float* __restrict__ logits,
                                                                              int valid, const u64* __restrict__ part,
                                                                              int blocks, int n,
                                                                              const int* __restrict__ next,
                                                                              int* __restrict__ out) {
    __shared__ double s_lse;
    if (threadIdx.x == 0) {
        float M = -LILY_INF;
        for (int b = 0; b < blocks; b++) M = fmaxf(M, __uint_as_float((unsigned)part[(long)b * LP_PART(n)]));
        double z = 0.0;
        if (M - M == 0.f) {
            for (int b = 0; b < blocks; b++) {
                const u64* p = part + (long)b * LP_PART(n);
                const float mb = __uint_as_float((unsigned)p[0]);
                if (mb - mb == 0.f) z += __longlong_as_double((long long)p[1]) * exp((double)mb - (double)M);
            }
            s_lse = (double)M + log(z);
        } else {
            s_lse = 0.0;  // no finite logit: the host's lse is 0 then too
        }
    }
    __syncthreads();
    const double lse = s_lse;
    u64 e[LP_FIN_PER];
#pragma unroll
    for (int q = 0; q < LP_FIN_PER; q++) {
        const int c = q * LP_THREADS + threadIdx.x;  // candidate c: block c / n, rank c % n
        e[q] = c < blocks * n ? part[(long)(c / n) * LP_PART(n) + 2 + c % n] : 0ull;
    }
    u64 below = ~0ull;
    for (int j = 0; j < n; j++) {
        below = lp_next_below(e, below);
        if (threadIdx.x == 0) {
            if (below == 0ull) {
                out[2 + 2 * j] = -1;
                out[3 + 2 * j] = __float_as_int(-LILY_INF);
            } else {
                const int id = argmax_id(below);
                out[2 + 2 * j] = id;
                out[3 + 2 * j] = __float_as_int((float)((double)logits[id] - lse));
            }
        }
    }
    if (threadIdx.x == 0) {
        const int id = next[0];
        const float l = (id >= 0 && id < valid) ? logits[id] : smp_nan();
        out[0] = id;
        out[1] = __float_as_int(l == l ? (float)((double)l - lse) : -LILY_INF);
    }
}
