//! The split-K decode attention (kernels/attention.cu `attention_decode_*`,
//! through `lily_cuda::kernels::attention::attention_decode`) at the released
//! sizes (Hq 16, Hkv 2, Dh 256, gated) against a host reference of the
//! attention math in f64, for contexts n in {1, 2, 37, 1000, 4096, 33000} in a
//! cache of MAX_SEQ = 40,000 rows, at several split counts: the rule's (264
//! here, so at n = 1, 37, 1000, 4096 some splits are empty), 1, 7, 132 and the
//! largest the launcher takes (1024); the prefill kernel
//! (`kernels::attention::attention`, flash attention on the tensor cores) at
//! T = 1 on the same queries. `decode_other_shapes` checks the same at the
//! other sizes the launcher takes (OTHER_SHAPES: the repo's tiny synthetic
//! model, head dims that are not multiples of 64, fewer than 8 query heads in
//! a block, two blocks per KV head, one KV head), for n in {1, 37, 1000} in a
//! cache of OTHER_MAX_SEQ = 2048 rows, at 1, 7 and the rule's 16 splits.
//! `prefill_released` and `prefill_other_head_dims` run whole prefill chunks
//! (many queries, causal, after earlier chunks' rows) through the prefill kernel.
//! Every test that needs a GPU is ignored unless asked for (`--include-ignored`),
//! and then fails without one; `boundary_keys_are_in_range` runs on the host.
//!
//! The reference is computed here rather than by lily_cpu's
//! `gated_attention`, which takes the layer's input and weights (projections,
//! norms, RoPE, its own cache) instead of a prepared q and cache: per query
//! head h (KV head h / G, G = Hq / Hkv: 8 at the released sizes), s_j =
//! q . k_j * Dh^-1/2 over the n cached rows, softmax, o = sum_j p_j v_j,
//! times sigmoid(gate), all in f64 from the very f32 / bf16 values uploaded.
//!
//! Inputs: a seeded splitmix64 generator, values uniform with no exact zero.
//! K and V rows 0..n are random (as bf16); rows n..max_seq hold NaN, so a
//! kernel that reads past the n keys fails. Most query heads are "needles":
//! q_h = beta k_{j_h} + 0.5 r, with beta chosen so that key j_h gets about
//! half of the softmax weight, and j_h on a boundary the kernels care about
//! (first / last key, split and batch edges, the last split's start): losing
//! that key, or counting it twice, moves the output by tens of percent (a
//! needle head past the list of boundary keys, at Hq > 15, takes a random
//! key). The other heads get a plain random q (scores with std ~2, weight
//! spread over many keys). The scratch buffer starts as NaN and is reused
//! across runs: the kernels must write every partial they read.
//!
//! Tolerances. Every output is bf16: rounding to nearest costs at most half an
//! ulp, 2^-8 of the value, and about 2^-8 / sqrt(12) relative L2 on random
//! data (~1.1e-3). The arithmetic before it adds far less: the split-K
//! partial kernel's tensor-core products take q and p as bf16 pairs (hi +
//! lo, ~2^-16 relative each), accumulate in f32, and then come exp2f's 2 ulp
//! and sums of up to 33,000 terms divided by their own weight total: ~1e-5
//! relative at most. So:
//! - relative L2 error <= 1e-2 (the bf16 bound is 3.9e-3; a lost key or a
//!   wrong head is 1e-1 or more);
//! - every element: |gpu - ref| <= 2^-7 |ref| + 1e-4 max|ref|: twice the
//!   rounding bound, plus an absolute floor for elements near zero;
//! - the prefill kernel rounds q and the softmax weights to bf16 for its
//!   tensor-core products (as FlashAttention does): the same relative L2
//!   bound, and a larger absolute floor per element (TOL_PREFILL_ABS_FRAC).
mod support;

use half::bf16;
use lily_cuda::gpu::{DevBuf, Gpu};
use lily_cuda::kernels::attention::{
    attention, attention_decode, attention_decode_check, attention_decode_scratch_bytes,
    attention_decode_splits, Attend, Heads, ATTENTION_DECODE_MAX_SPLITS, PREFILL_HEAD_DIMS,
};
use support::{from_bf16_bits, gpu};

/// Query heads, KV heads and head dim of the attention under test.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    hq: usize,
    hkv: usize,
    dh: usize,
}

impl Shape {
    const fn new(hq: usize, hkv: usize, dh: usize) -> Shape {
        Shape { hq, hkv, dh }
    }

    /// G: query heads per KV head.
    fn group(self) -> usize {
        self.hq / self.hkv
    }

    /// The launchers' form of the shape.
    fn heads(self) -> Heads {
        Heads {
            hq: self.hq,
            hkv: self.hkv,
            dh: self.dh,
        }
    }

    /// The softmax scale, Dh^-1/2.
    fn scale(self) -> f32 {
        (self.dh as f32).powf(-0.5)
    }

    /// 0 for the released sizes (so their seeds are what they always were),
    /// distinct for every other shape.
    fn seed_offset(self) -> u64 {
        if self == RELEASED {
            0
        } else {
            ((self.hq << 20 | self.hkv << 12 | self.dh) as u64) << 32
        }
    }
}

/// The released model's sizes.
const RELEASED: Shape = Shape::new(16, 2, 256);
const MAX_SEQ: usize = 40_000;

/// Other sizes the launcher takes (Hq a multiple of Hkv, Dh a multiple of 32
/// up to 256) and what the partial kernel does differently at them. A block
/// serves up to 8 query heads of one KV head, ceil(G / 8) blocks per KV head;
/// a lane's k-steps 2u, 2u + 1 cover dims 32u..32u + 31 (those at 32u >= Dh
/// skipped, as at every Dh < 256 here) and its V chunks dims 64v + 8g..+7
/// (those past Dh read dims 0..7 instead and are never stored):
/// - (4, 2, 64): the repo's tiny synthetic model; G = 2 heads a block; only
///   V chunk 0 in range;
/// - (24, 2, 96): G = 12: two blocks per KV head, the second with 4 heads;
///   V chunk 1 cut at dim 96 (in range for lanes g < 4 only);
/// - (32, 2, 160): G = 16: two full blocks per KV head; V chunk 2 cut at 160;
/// - (6, 2, 32): the smallest Dh (one k-step pair, V chunk 0 cut at 32); G = 3;
/// - (16, 1, 128): G = 16 with a single KV head: 2 blocks per split;
/// - (20, 4, 224): G = 5 over 4 KV heads; V chunk 3 cut at 224.
const OTHER_SHAPES: [Shape; 6] = [
    Shape::new(4, 2, 64),
    Shape::new(24, 2, 96),
    Shape::new(32, 2, 160),
    Shape::new(6, 2, 32),
    Shape::new(16, 1, 128),
    Shape::new(20, 4, 224),
];
/// The cache of `decode_other_shapes`: small, so the test stays quick; its
/// split rule gives 16.
const OTHER_MAX_SEQ: usize = 2048;
const OTHER_CONTEXTS: [usize; 3] = [1, 37, 1000];

/// Relative L2 error: bf16 output rounding alone is ~1.1e-3 (bound 3.9e-3);
/// a lost key or a wrong head is 1e-1 or more.
const TOL_REL_L2: f64 = 1e-2;
/// Per element, relative: 2^-7, twice bf16's half-ulp rounding bound.
const TOL_ELEM_REL: f64 = 1.0 / 128.0;
/// Per element, an absolute floor (a fraction of max|ref|) for elements near zero.
const TOL_ELEM_ABS_FRAC: f64 = 1e-4;
/// The prefill kernel's floor: it multiplies P (in [0, 1]) by V as bf16, as
/// FlashAttention does, so an output element may be off by up to 2^-9 of
/// sum_j p_j |v_jd| / l, which an element that cancels to near zero does not
/// shrink; with needle weights ~1/2 that is ~2^-9 of max|ref|, and q rounded
/// to bf16 moves each score by ~2^-9 of its size: 2^-7 of max|ref| bounds both.
const TOL_PREFILL_ABS_FRAC: f64 = 1.0 / 128.0;
/// The least softmax weight a needle head's key may keep in
/// `decode_other_shapes`' inputs (~10-90% as drawn): below it a lost key
/// would hardly move the output.
const MIN_NEEDLE_WEIGHT: f64 = 0.05;

/// splitmix64: seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-std * sqrt3, std * sqrt3) (variance std^2), never 0.
    fn sym(&mut self, std: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / 16_777_216.0;
        let x = (2.0 * u - 1.0) * 1.732_050_8 * std;
        if x == 0.0 {
            1e-3 * std
        } else {
            x
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// One context: the caches as uploaded (bf16 bits, [max_seq, Hkv, Dh], rows
/// >= n NaN) and their first n rows widened to f32 for the host.
struct Cache {
    s: Shape,
    n: usize,
    k: Vec<u16>,
    v: Vec<u16>,
    kf: Vec<f32>,
    vf: Vec<f32>,
}

fn cache(s: Shape, max_seq: usize, n: usize, seed: u64) -> Cache {
    assert!((1..=max_seq).contains(&n));
    let mut rng = Rng(seed);
    let row = s.hkv * s.dh;
    let nan = bf16::NAN.to_bits();
    let mut k = vec![nan; max_seq * row];
    let mut v = vec![nan; max_seq * row];
    for x in &mut k[..n * row] {
        *x = bf16::from_f32(rng.sym(1.0)).to_bits();
    }
    for x in &mut v[..n * row] {
        *x = bf16::from_f32(rng.sym(1.0)).to_bits();
    }
    let (kf, vf) = (from_bf16_bits(&k[..n * row]), from_bf16_bits(&v[..n * row]));
    Cache { s, n, k, v, kf, vf }
}

/// Row j of KV head kh, f32.
fn krow(c: &Cache, j: usize, kh: usize) -> &[f32] {
    let (hkv, dh) = (c.s.hkv, c.s.dh);
    &c.kf[(j * hkv + kh) * dh..(j * hkv + kh + 1) * dh]
}

fn vrow(c: &Cache, j: usize, kh: usize) -> &[f32] {
    let (hkv, dh) = (c.s.hkv, c.s.dh);
    &c.vf[(j * hkv + kh) * dh..(j * hkv + kh + 1) * dh]
}

/// Keys whose loss or double count a split-K kernel could get wrong with
/// `splits` splits: the ends, the first split's edge, the last split's start,
/// the edges of 8-key tiles and 16-key batches, and this split count's
/// per-warp share (4 warps).
fn boundary_keys(n: usize, splits: usize) -> Vec<usize> {
    let chunk = n.div_ceil(splits);
    let last = (n - 1) / chunk * chunk;
    let per_warp = chunk.div_ceil(4).div_ceil(16) * 16;
    // Entries 3, 7 and 11 go to heads that get a plain random q (h % 4 == 3),
    // the other twelve to needle heads. 7 | 8 is the edge of the partial
    // kernel's two 8-key MMA tiles, 15 the end of its first 16-key batch;
    // per_warp and chunk + per_warp are the first keys of split 0's and split
    // 1's second warp.
    [
        0,
        n - 1,
        chunk - 1,
        n / 2,
        chunk,
        last,
        last.saturating_sub(1),
        16,
        7,
        8,
        15,
        n / 3,
        per_warp - 1,
        per_warp,
        chunk + per_warp,
    ]
    .into_iter()
    .map(|j| j.min(n - 1))
    .collect()
}

/// q [Hq, Dh] and qg [Hq, 2 Dh] (query | gate; the query half, unused by the
/// kernels, random) for a context of n keys.
fn queries(c: &Cache, splits: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let (n, Shape { hq, dh, .. }) = (c.n, c.s);
    let group = c.s.group();
    let mut rng = Rng(seed);
    // Needle weight about 1/2: sqrt(Dh) beta (its score; 16 beta at Dh 256)
    // ~ ln(n - 1) + (beta^2 + gamma^2) / 2 (log of the other keys' total
    // weight; their scores have variance beta^2 + gamma^2 for unit-variance k).
    let gamma = 0.5f64;
    let mut beta = 0.5f64;
    for _ in 0..20 {
        beta = (((n.max(2) - 1) as f64).ln() + (beta * beta + gamma * gamma) / 2.0)
            / (dh as f64).sqrt();
    }
    let keys = boundary_keys(n, splits);
    let mut q = vec![0f32; hq * dh];
    for h in 0..hq {
        let kh = h / group;
        let row = &mut q[h * dh..(h + 1) * dh];
        if h % 4 == 3 {
            for x in row.iter_mut() {
                *x = rng.sym(2.0);
            }
        } else {
            let j = if h < keys.len() {
                keys[h]
            } else {
                rng.below(n)
            };
            for (x, k) in row.iter_mut().zip(krow(c, j, kh)) {
                *x = (beta * *k as f64 + gamma * rng.sym(1.0) as f64) as f32;
            }
        }
    }
    let mut qg = vec![0f32; hq * 2 * dh];
    for x in &mut qg {
        *x = rng.sym(1.5);
    }
    (q, qg)
}

/// Query head h's unnormalised softmax weights over the n keys, exp(s_j - max
/// s), and their total, in f64 (s_j = q . k_j * Dh^-1/2).
fn softmax_weights(c: &Cache, q: &[f32], h: usize) -> (Vec<f64>, f64) {
    let dh = c.s.dh;
    let kh = h / c.s.group();
    let scale = (dh as f64).powf(-0.5);
    let qh = &q[h * dh..(h + 1) * dh];
    let s: Vec<f64> = (0..c.n)
        .map(|j| {
            let dot: f64 = qh
                .iter()
                .zip(krow(c, j, kh))
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            dot * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let total = w.iter().sum();
    (w, total)
}

/// f64 attention: [Hq * Dh].
fn reference(c: &Cache, q: &[f32], qg: &[f32], gated: bool) -> Vec<f64> {
    let Shape { hq, dh, .. } = c.s;
    let mut out = vec![0f64; hq * dh];
    for h in 0..hq {
        let kh = h / c.s.group();
        let (w, total) = softmax_weights(c, q, h);
        let o = &mut out[h * dh..(h + 1) * dh];
        for (j, wj) in w.iter().enumerate() {
            for (od, vd) in o.iter_mut().zip(vrow(c, j, kh)) {
                *od += wj * *vd as f64;
            }
        }
        for (d, od) in o.iter_mut().enumerate() {
            *od /= total;
            if gated {
                let g = qg[h * 2 * dh + dh + d] as f64;
                *od /= 1.0 + (-g).exp();
            }
        }
    }
    out
}

/// Device buffers of one context; `scratch` starts as NaN and is reused.
struct Dev {
    s: Shape,
    k: DevBuf,
    v: DevBuf,
    q: DevBuf,
    qg: DevBuf,
    pos: DevBuf,
    out: DevBuf,
    scratch: DevBuf,
}

fn device(g: &Gpu, c: &Cache) -> Dev {
    let Shape { hq, dh, .. } = c.s;
    let alloc_up = |data: &[u16]| {
        let b = g.alloc(std::mem::size_of_val(data)).unwrap();
        g.upload(b.ptr, data).unwrap();
        b
    };
    let scratch_bytes = attention_decode_scratch_bytes(hq, dh, ATTENTION_DECODE_MAX_SPLITS);
    let scratch = g.alloc(scratch_bytes).unwrap();
    g.upload(scratch.ptr, &vec![f32::NAN; scratch_bytes / 4])
        .unwrap();
    let pos = g.alloc(4).unwrap();
    g.upload(pos.ptr, &[(c.n - 1) as i32]).unwrap();
    Dev {
        s: c.s,
        k: alloc_up(&c.k),
        v: alloc_up(&c.v),
        q: g.alloc(hq * dh * 4).unwrap(),
        qg: g.alloc(hq * 2 * dh * 4).unwrap(),
        pos,
        out: g.alloc(hq * dh * 2).unwrap(),
        scratch,
    }
}

fn download_bf16(g: &Gpu, d: &Dev) -> Vec<f32> {
    from_bf16_bits(&g.download::<u16>(d.out.ptr, d.s.hq * d.s.dh).unwrap())
}

/// The launchers' pointers of one context (one query).
fn attend(d: &Dev) -> Attend {
    Attend {
        q: d.q.ptr,
        kcache: d.k.ptr,
        vcache: d.v.ptr,
        qg: d.qg.ptr,
        pos: d.pos.ptr,
        out: d.out.ptr,
    }
}

fn run_decode(g: &Gpu, d: &Dev, splits: usize, gated: bool) -> Vec<f32> {
    attention_decode(
        g,
        &attend(d),
        d.s.heads(),
        d.s.scale(),
        gated,
        &d.scratch,
        splits,
    )
    .unwrap();
    download_bf16(g, d)
}

/// The prefill kernel (`attention`) at t = 1.
fn run_attention_kernel(g: &Gpu, d: &Dev, gated: bool) -> Vec<f32> {
    attention(g, &attend(d), d.s.heads(), d.s.scale(), gated, 1).unwrap();
    download_bf16(g, d)
}

/// (relative L2 error, worst element error / its bound) of `got` against
/// `want`; `bound(i)` is element i's allowed error.
fn errors(got: &[f32], want: &[f64], bound: impl Fn(usize) -> f64) -> (f64, f64) {
    let (mut num, mut den, mut worst) = (0f64, 0f64, 0f64);
    for (i, (&x, &y)) in got.iter().zip(want).enumerate() {
        let e = (x as f64 - y).abs();
        num += e * e;
        den += y * y;
        // NaN (a read past n, an unwritten partial) makes the ratio NaN and fails below.
        let r = e / bound(i);
        worst = if r.is_nan() { f64::NAN } else { worst.max(r) };
    }
    ((num / den).sqrt(), worst)
}

/// `got` against the f64 reference: relative L2 within TOL_REL_L2, every
/// element within TOL_ELEM_REL of its value plus `floor_frac` of max|ref|.
fn check(what: &str, got: &[f32], want: &[f64], floor_frac: f64) {
    let amax = want.iter().fold(0f64, |a, y| a.max(y.abs()));
    let floor = floor_frac * amax;
    let (rel, worst) = errors(got, want, |i| TOL_ELEM_REL * want[i].abs() + floor);
    eprintln!("{what}: rel L2 {rel:.2e}, worst element at {worst:.2} of its bound");
    assert!(
        rel <= TOL_REL_L2,
        "{what}: relative L2 error {rel:.3e} > {TOL_REL_L2:e}"
    );
    assert!(
        worst <= 1.0,
        "{what}: an element's error is {worst:.3} times its bound (or NaN)"
    );
}

/// One split count on one uploaded context: a query drawn for this split
/// count's boundary keys (seed `seed`), then decode against the f64
/// reference, and the prefill kernel at T = 1 (where it takes the head dim)
/// against it at the prefill tolerance.
fn check_splits(g: &Gpu, c: &Cache, d: &Dev, splits: usize, seed: u64, gated: bool) {
    let (q, qg) = queries(c, splits, seed);
    g.upload(d.q.ptr, &q).unwrap();
    g.upload(d.qg.ptr, &qg).unwrap();
    let want = reference(c, &q, &qg, gated);
    let new = run_decode(g, d, splits, gated);
    let Shape { hq, hkv, dh } = c.s;
    let what = format!(
        "Hq {hq}, Hkv {hkv}, Dh {dh}, n {}, splits {splits}, gated {gated}",
        c.n
    );
    check(
        &format!("{what}: decode vs f64"),
        &new,
        &want,
        TOL_ELEM_ABS_FRAC,
    );
    if PREFILL_HEAD_DIMS.contains(&dh) {
        let pre = run_attention_kernel(g, d, gated);
        check(
            &format!("{what}: prefill kernel vs f64"),
            &pre,
            &want,
            TOL_PREFILL_ABS_FRAC,
        );
    }
}

fn check_context(n: usize, gated: bool) {
    let g = gpu();
    let c = cache(RELEASED, MAX_SEQ, n, 0xA77E_0000 + n as u64);
    let d = device(&g, &c);
    let rule = attention_decode_splits(MAX_SEQ);
    assert_eq!(rule, 264);
    for (i, splits) in [rule, 1, 7, 132, ATTENTION_DECODE_MAX_SPLITS]
        .into_iter()
        .enumerate()
    {
        let seed = 0x5EED_0000 + 16 * n as u64 + i as u64;
        check_splits(&g, &c, &d, splits, seed, gated);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n1() {
    check_context(1, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n2() {
    check_context(2, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n37() {
    check_context(37, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n1000() {
    check_context(1000, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n4096() {
    check_context(4096, true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_n33000() {
    check_context(33_000, true);
}

/// The ungated path (out = attention alone), as for a model without the gate.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_ungated_n1000() {
    check_context(1000, false);
}

/// `decode_other_shapes`' context of n keys at shape s, and the seed of its
/// query for its i-th split count (`check_context`'s seeds, offset per shape).
fn other_cache(s: Shape, n: usize) -> Cache {
    cache(
        s,
        OTHER_MAX_SEQ,
        n,
        0xA77E_0000 + n as u64 + s.seed_offset(),
    )
}

fn other_query_seed(s: Shape, n: usize, i: usize) -> u64 {
    0x5EED_0000 + 16 * n as u64 + i as u64 + s.seed_offset()
}

/// Every shape of OTHER_SHAPES, every n of OTHER_CONTEXTS (in a cache of
/// OTHER_MAX_SEQ rows), at 1, 7 and the rule's splits (16): 54 runs of both
/// kernels, checked as `check_context` checks them. n = 37 runs ungated, the
/// others gated.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_other_shapes() {
    let g = gpu();
    let rule = attention_decode_splits(OTHER_MAX_SEQ);
    assert_eq!(rule, 16);
    for s in OTHER_SHAPES {
        for n in OTHER_CONTEXTS {
            let c = other_cache(s, n);
            let d = device(&g, &c);
            let gated = n != 37;
            for (i, splits) in [1, 7, rule].into_iter().enumerate() {
                let seed = other_query_seed(s, n, i);
                check_splits(&g, &c, &d, splits, seed, gated);
            }
        }
    }
}

/// The smallest softmax weight a needle head (h % 4 != 3, h below the
/// number of boundary keys) gives its boundary key, from q as `queries`
/// draws it (f64, as `reference`).
fn least_needle_weight(c: &Cache, q: &[f32], splits: usize) -> f64 {
    let keys = boundary_keys(c.n, splits);
    let mut least = 1f64;
    for h in (0..c.s.hq.min(keys.len())).filter(|h| h % 4 != 3) {
        let (w, total) = softmax_weights(c, q, h);
        least = least.min(w[keys[h]] / total);
    }
    least
}

/// Host-side checks that need no GPU: the rule's split counts, the needle
/// keys the tests place, that the launcher takes OTHER_SHAPES, which between
/// them reach the paths listed there, and that `decode_other_shapes`' inputs
/// still make its needles count at those head dims (the needle key keeps at
/// least 5% of its head's weight; ~10-90% as drawn, as at the released
/// sizes), its reference finite.
#[test]
fn boundary_keys_are_in_range() {
    for n in [1, 2, 37, 1000, 4096, 33_000] {
        for splits in [1, 7, 132, 264, 1024] {
            assert!(boundary_keys(n, splits).iter().all(|&j| j < n));
        }
    }
    assert_eq!(attention_decode_splits(MAX_SEQ), 264);

    let rule = attention_decode_splits(OTHER_MAX_SEQ);
    assert_eq!(rule, 16);
    for n in OTHER_CONTEXTS {
        assert!(n <= OTHER_MAX_SEQ);
        for splits in [1, 7, rule] {
            assert!(boundary_keys(n, splits).iter().all(|&j| j < n));
        }
    }
    for s in OTHER_SHAPES {
        assert_ne!(s, RELEASED);
        for splits in [1, 7, rule] {
            attention_decode_check(s.heads(), splits).unwrap();
        }
    }
    let any = |f: fn(Shape) -> bool| OTHER_SHAPES.into_iter().any(f);
    assert!(any(|s| s.group() < 8), "a block of fewer than 8 heads");
    assert!(
        any(|s| s.group() > 8 && s.group() % 8 == 0),
        "two full blocks per KV head"
    );
    assert!(
        any(|s| s.group() > 8 && s.group() % 8 != 0),
        "a short second block"
    );
    assert!(any(|s| s.hkv == 1), "one KV head");
    assert!(any(|s| s.dh % 64 == 32), "a V chunk cut mid-way");
    assert!(any(|s| s.dh == 32), "the smallest head dim");
    // Seeds: one set per shape.
    for (i, a) in OTHER_SHAPES.into_iter().enumerate() {
        assert_ne!(a.seed_offset(), 0);
        for b in &OTHER_SHAPES[..i] {
            assert_ne!(a.seed_offset(), b.seed_offset());
        }
    }
    // decode_other_shapes' inputs, as it draws them.
    for s in OTHER_SHAPES {
        for n in OTHER_CONTEXTS {
            let c = other_cache(s, n);
            for (i, splits) in [1, 7, rule].into_iter().enumerate() {
                let seed = other_query_seed(s, n, i);
                let (q, qg) = queries(&c, splits, seed);
                let w = least_needle_weight(&c, &q, splits);
                assert!(
                    w >= MIN_NEEDLE_WEIGHT,
                    "{s:?}, n {n}, splits {splits}: a needle has weight {w:.3}"
                );
                assert!(reference(&c, &q, &qg, n != 37)
                    .iter()
                    .all(|x| x.is_finite()));
            }
        }
    }
}

/// Prefill chunks through the tensor-core kernel (`attention`): `t` queries
/// at positions pos0 .. pos0 + t over a cache of pos0 + t rows (rows past it
/// NaN). Query i's heads: h % 4 == 0 a needle on its own key (the diagonal,
/// the last it may see), h % 4 == 1 a needle on the key just past it (masked:
/// a kernel that lets it through moves the output by half), h % 4 == 2 a
/// needle on a random visible key, h % 4 == 3 a plain random q. Checked
/// against the f64 reference on the rows at the tile edges and a few others.
fn check_prefill_chunk(s: Shape, pos0: usize, t: usize, gated: bool) {
    let g = gpu();
    let n = pos0 + t;
    let c = cache(s, n + 64, n, 0xF1A5_0000 + n as u64 + s.seed_offset());
    let Shape { hq, dh, .. } = s;
    let group = s.group();
    let mut rng = Rng(0xF1A5_1000 + pos0 as u64 * 7 + t as u64 + s.seed_offset());
    let mut q = vec![0f32; t * hq * dh];
    for i in 0..t {
        let seen = pos0 + i + 1;
        // needle weight about 1/2 among `seen` keys (as `queries`)
        let gamma = 0.5f64;
        let mut beta = 0.5f64;
        for _ in 0..20 {
            beta = (((seen.max(2) - 1) as f64).ln() + (beta * beta + gamma * gamma) / 2.0)
                / (dh as f64).sqrt();
        }
        for h in 0..hq {
            let row = &mut q[(i * hq + h) * dh..(i * hq + h + 1) * dh];
            let target = match h % 4 {
                0 => Some(seen - 1),
                1 => Some(seen.min(n - 1)),
                2 => Some(rng.below(seen)),
                _ => None,
            };
            match target {
                Some(j) => {
                    for (x, k) in row.iter_mut().zip(krow(&c, j, h / group)) {
                        *x = (beta * *k as f64 + gamma * rng.sym(1.0) as f64) as f32;
                    }
                }
                None => row.iter_mut().for_each(|x| *x = rng.sym(2.0)),
            }
        }
    }
    let qg: Vec<f32> = (0..t * hq * 2 * dh).map(|_| rng.sym(1.5)).collect();
    let alloc_up = |data: &[u16]| {
        let b = g.alloc(std::mem::size_of_val(data)).unwrap();
        g.upload(b.ptr, data).unwrap();
        b
    };
    let (kb, vb) = (alloc_up(&c.k), alloc_up(&c.v));
    let (qb, qgb, pos) = (
        g.upload_new(&q).unwrap(),
        g.upload_new(&qg).unwrap(),
        g.upload_new(&[pos0 as i32]).unwrap(),
    );
    let out = g.alloc(t * hq * dh * 2).unwrap();
    g.upload(out.ptr, &vec![bf16::NAN.to_bits(); t * hq * dh])
        .unwrap();
    let at = Attend {
        q: qb.ptr,
        kcache: kb.ptr,
        vcache: vb.ptr,
        qg: qgb.ptr,
        pos: pos.ptr,
        out: out.ptr,
    };
    attention(&g, &at, s.heads(), s.scale(), gated, t).unwrap();
    let got = from_bf16_bits(&g.download::<u16>(out.ptr, t * hq * dh).unwrap());
    assert!(
        got.iter().all(|x| x.is_finite()),
        "pos0 {pos0}, t {t}: an output left unwritten or NaN"
    );
    let mut rows: Vec<usize> = [0, 1, 15, 16, 63, 64, 65, 127, 128, t / 2, t - 2, t - 1]
        .into_iter()
        .filter(|&i| i < t)
        .collect();
    rows.push(rng.below(t));
    rows.sort_unstable();
    rows.dedup();
    for i in rows {
        // the reference over the keys query i sees
        let seen = Cache {
            s,
            n: pos0 + i + 1,
            k: Vec::new(),
            v: Vec::new(),
            kf: c.kf[..(pos0 + i + 1) * s.hkv * dh].to_vec(),
            vf: c.vf[..(pos0 + i + 1) * s.hkv * dh].to_vec(),
        };
        let qi = &q[i * hq * dh..(i + 1) * hq * dh];
        let gi = &qg[i * hq * 2 * dh..(i + 1) * hq * 2 * dh];
        let want = reference(&seen, qi, gi, gated);
        check(
            &format!(
                "Hq {hq}, Hkv {}, Dh {dh}, pos0 {pos0}, t {t}, query {i}",
                s.hkv
            ),
            &got[i * hq * dh..(i + 1) * hq * dh],
            &want,
            TOL_PREFILL_ABS_FRAC,
        );
    }
}

/// The released sizes: a first chunk, one that is not a multiple of the
/// 64-row tile, one of exactly a tile after 1,000 cached rows, and a chunk
/// after 4,000 (the keys of earlier chunks).
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_released() {
    for (pos0, t, gated) in [
        (0, 1, true),
        (0, 300, true),
        (1000, 64, false),
        (4000, 300, true),
    ] {
        check_prefill_chunk(RELEASED, pos0, t, gated);
    }
}

/// The other head dims the prefill kernel takes: the tiny model's 64 and 128
/// with one KV head.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_other_head_dims() {
    for s in [Shape::new(4, 2, 64), Shape::new(16, 1, 128)] {
        for (pos0, t) in [(0, 130), (500, 77)] {
            check_prefill_chunk(s, pos0, t, true);
        }
    }
}
