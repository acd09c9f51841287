//! Launchers of kernels/attention.cu: the q/k norms, RoPE and KV-cache append
//! (`qk_prep`), causal attention of a prefill chunk on the tensor cores (`attention`), and
//! split-K ("flash decoding") attention for one query token
//! (`attention_decode`): the same function as `attention` at T = 1 (same
//! inputs, same bf16 output), with the key range split `splits` ways so that
//! a long cache is read by many blocks at once instead of by one block per
//! query head.
//!
//! The decode form is two kernels on the Gpu's stream:
//! 1. `attention_decode_partial_kernel`, grid (Hkv * ceil(G / 8), splits),
//!    block 128 (G = Hq / Hkv): one block per (KV head, key range) serves up to
//!    8 query heads of the KV head's group, reading each K and V row of its
//!    range once for all of them (16 keys at a time on the tensor cores, f32
//!    online softmax), and writes an unnormalised partial (m, l, acc[Dh]) per
//!    (query head, split).
//! 2. `attention_decode_merge_kernel`, grid (Hq, ceil(Dh / 32)), block 256:
//!    per (query head, 32 dims), merges the splits' partials (8 warps, every
//!    load of up to 264 splits issued at once), divides by l, applies
//!    sigmoid(gate) and writes bf16.
//!
//! The number of keys, n = pos[0] + 1, is read from device memory and divided
//! in-kernel (ceil(n / splits) keys per split; splits past the end write a
//! neutral partial), so neither the grid nor any argument depends on the
//! position: the pair can be captured in a CUDA graph and replayed at every
//! step of a decode.

use anyhow::{bail, Result};

use super::Kernel;
use crate::gpu::{Arg, DevBuf, Gpu};

/// The attention layer's sizes: query heads, KV heads, head dim.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub hq: usize,
    pub hkv: usize,
    pub dh: usize,
}

impl Heads {
    /// hq a positive multiple of hkv; dh a multiple of 32 in 32..=256 (a lane
    /// holds dh / 32 dims, at most 8).
    pub fn check(&self, what: &str) -> Result<()> {
        let Heads { hq, hkv, dh } = *self;
        if hkv == 0 || hq == 0 || !hq.is_multiple_of(hkv) || hq + hkv > 65_535 {
            bail!("{what}: query heads ({hq}) must be a positive multiple of KV heads ({hkv})");
        }
        if dh == 0 || dh > 256 || !dh.is_multiple_of(32) {
            bail!("{what}: head dim must be a multiple of 32 in 32..=256, got {dh}");
        }
        Ok(())
    }
}

/// The RoPE and norm settings of `qk_prep`.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    /// rotated dims of each head (the first `rotary_dim`, NeoX halves)
    pub rotary_dim: usize,
    pub theta: f32,
    /// the head norms' epsilon
    pub eps: f32,
}

/// `qk_prep`'s device pointers (f32 unless said).
pub struct QkPrep {
    /// [t, hq, (1 + gated) dh] q_proj's output, per head [query | gate]
    pub qg: u64,
    /// [t, hkv, dh] each
    pub k: u64,
    pub v: u64,
    /// [dh] the q and k head norms' weights, 1 + w
    pub q_norm: u64,
    pub k_norm: u64,
    /// one i32: the tokens cached before the first of these
    pub pos: u64,
    /// out: [t, hq, dh] the normed, rotated queries
    pub q_out: u64,
    /// [max_seq, hkv, dh] bf16 each: rows pos .. pos + t written (normed,
    /// rotated k; v as it is)
    pub kcache: u64,
    pub vcache: u64,
}

/// The q and k head norms, partial NeoX RoPE at positions pos .. pos + t and
/// the KV-cache append of `t` tokens (`qk_prep_kernel`).
pub fn qk_prep(
    gpu: &Gpu,
    a: &QkPrep,
    heads: Heads,
    rope: Rope,
    gated: bool,
    t: usize,
) -> Result<()> {
    heads.check("qk_prep")?;
    if t == 0
        || t > u32::MAX as usize
        || rope.rotary_dim > heads.dh
        || !rope.rotary_dim.is_multiple_of(2)
    {
        bail!(
            "qk_prep: {t} tokens, rotary dims {} of {}",
            rope.rotary_dim,
            heads.dh
        );
    }
    let Heads { hq, hkv, dh } = heads;
    gpu.launch(
        Kernel::QkPrep,
        (t as u32, (hq + hkv) as u32, 1),
        (dh as u32, 1, 1),
        0,
        &[
            Arg::Ptr(a.qg),
            Arg::Ptr(a.k),
            Arg::Ptr(a.v),
            Arg::Ptr(a.q_norm),
            Arg::Ptr(a.k_norm),
            Arg::Ptr(a.pos),
            Arg::Ptr(a.q_out),
            Arg::Ptr(a.kcache),
            Arg::Ptr(a.vcache),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::I32(rope.rotary_dim as i32),
            Arg::F32(rope.theta),
            Arg::F32(rope.eps),
            Arg::I32(gated as i32),
        ],
    )
}

/// Attention's device pointers, prefill and decode alike.
pub struct Attend {
    /// [t, hq, dh] f32 the queries (`qk_prep`'s q_out)
    pub q: u64,
    /// [max_seq, hkv, dh] bf16 each
    pub kcache: u64,
    pub vcache: u64,
    /// [t, hq, 2 dh] f32 per head [query | gate] when gated (the gate half is
    /// read); unused otherwise
    pub qg: u64,
    /// one i32: the tokens cached before the first query (its keys are
    /// rows 0 ..= pos + i for query i)
    pub pos: u64,
    /// out: [t, hq dh] bf16 = softmax(q k^T scale) v * sigmoid(gate)
    pub out: u64,
}

/// Query rows (and keys) a block of the prefill attention takes at a time,
/// its threads, and the head dims it is written for (attention.cu FA_*).
const PREFILL_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;
pub const PREFILL_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The heads the prefill kernel takes: `Heads::check`'s, with head dim 64,
/// 128 or 256.
pub fn attention_prefill_check(heads: Heads) -> Result<()> {
    heads.check("attention")?;
    if !PREFILL_HEAD_DIMS.contains(&heads.dh) {
        bail!(
            "attention: the prefill kernel takes head dims {PREFILL_HEAD_DIMS:?}, got {}",
            heads.dh
        );
    }
    Ok(())
}

/// Causal gated attention of `t` queries over the cache on the tensor cores
/// (`attention_prefill_kernel`, flash attention): query i at position pos + i
/// attends to cache rows 0 ..= pos + i, the rows of earlier chunks included.
/// Head dims 64, 128 and 256.
pub fn attention(
    gpu: &Gpu,
    a: &Attend,
    heads: Heads,
    scale: f32,
    gated: bool,
    t: usize,
) -> Result<()> {
    attention_prefill_check(heads)?;
    let Heads { hq, hkv, dh } = heads;
    if t == 0 || t > i32::MAX as usize {
        bail!("attention: {t} queries");
    }
    // Q, K and V tiles of 64 rows
    let smem = (3 * PREFILL_ROWS * dh * 2) as u32;
    gpu.launch(
        Kernel::AttentionPrefill,
        (t.div_ceil(PREFILL_ROWS) as u32, hq as u32, 1),
        (PREFILL_THREADS, 1, 1),
        smem,
        &[
            Arg::Ptr(a.q),
            Arg::Ptr(a.kcache),
            Arg::Ptr(a.vcache),
            Arg::Ptr(a.qg),
            Arg::Ptr(a.pos),
            Arg::Ptr(a.out),
            Arg::I32(t as i32),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::F32(scale),
            Arg::I32(gated as i32),
        ],
    )
}

/// The largest split count `attention_decode` takes: past 264 the merge
/// kernel reads the rest split by split, so more splits only cost time; the
/// split rule never goes past 264 (the GPU tests check the kernels up to this).
pub const ATTENTION_DECODE_MAX_SPLITS: usize = 1024;
/// Keys per split at `max_seq` below which `attention_decode_splits` uses fewer
/// splits.
pub const ATTENTION_DECODE_MIN_KEYS: usize = 128;
/// Threads per block of the partial kernel (ATTD_WARPS * 32) and of the merge
/// kernel (ATTD_MERGE_WARPS * 32); the kernels assume exactly these.
const PARTIAL_THREADS: u32 = 128;
const MERGE_THREADS: u32 = 256;
/// Query heads one partial block serves (ATTD_HEADS).
const HEADS_PER_BLOCK: usize = 8;

/// The split count for a cache of `max_seq` rows, fixed for the model's life
/// (a captured graph keeps its grid).
///
/// The rule, for the released model (Hkv = 2) on an H200 (132 SMs):
/// - one split per `ATTENTION_DECODE_MIN_KEYS` (128) rows of the cache, so a
///   split has at least 128 keys once the context fills the cache: 32 keys a
///   warp, 2 batches of 16, against a fixed cost per block of loading 8 query
///   heads and writing 8 partials of Dh floats (8 KiB at Dh = 256, 1/16 of
///   the 128 KiB of K and V the block reads at 128 keys);
/// - then rounded down to 132 or 264 splits once there are that many: the
///   partial kernel uses 254 registers a thread, so 2 of its 128-thread blocks
///   fit an SM, and Hkv * splits = 264 or 528 blocks are exactly 1 or 2 full
///   waves of 264 (with equal work per block once n >= splits, a partial last
///   wave would leave SMs idle; with 1 block an SM they are 2 or 4 full waves);
/// - at most 264: past that, more splits only add partials (at 262,144 rows,
///   264 splits of ~993 keys).
///
/// Below 132 splits (`max_seq` < 16,896) the grid is under one wave; such a
/// cache is read in a few microseconds either way. Other head counts and GPUs
/// get correct results from any split count; this rule just is not tuned for
/// them.
pub fn attention_decode_splits(max_seq: usize) -> usize {
    let s = (max_seq / ATTENTION_DECODE_MIN_KEYS).max(1);
    if s >= 264 {
        264
    } else if s >= 132 {
        132
    } else {
        s
    }
}

/// Bytes of the f32 partials buffer `attention_decode` needs: acc [hq, splits,
/// dh], then m [hq, splits], then l [hq, splits].
pub fn attention_decode_scratch_bytes(hq: usize, dh: usize, splits: usize) -> usize {
    hq * splits * (dh + 2) * 4
}

/// Check the shapes the decode kernels support: `Heads::check`, and splits
/// in 1..=ATTENTION_DECODE_MAX_SPLITS.
pub fn attention_decode_check(heads: Heads, splits: usize) -> Result<()> {
    heads.check("attention_decode")?;
    if splits == 0 || splits > ATTENTION_DECODE_MAX_SPLITS {
        bail!(
            "attention_decode: splits must be in 1..={ATTENTION_DECODE_MAX_SPLITS}, got {splits}"
        );
    }
    Ok(())
}

/// Gated attention of one query token over the first pos[0] + 1 rows of the
/// KV cache (`a`, with t = 1; n = pos[0] + 1 keys, n <= max_seq), on the
/// Gpu's stream; writes what `attention` writes at t = 1.
///
/// `scratch`: at least `attention_decode_scratch_bytes(hq, dh, splits)` bytes,
/// owned by this call until it completes on the stream (no initialisation
/// needed). `q`, `kcache` and `vcache` must be 16-byte aligned.
/// `splits` is usually `attention_decode_splits(max_seq)`; any value in range
/// gives the same result up to f32 rounding.
pub fn attention_decode(
    gpu: &Gpu,
    a: &Attend,
    heads: Heads,
    scale: f32,
    gated: bool,
    scratch: &DevBuf,
    splits: usize,
) -> Result<()> {
    attention_decode_check(heads, splits)?;
    let need = attention_decode_scratch_bytes(heads.hq, heads.dh, splits);
    if scratch.bytes < need {
        bail!(
            "attention_decode: a scratch of {} bytes for the {need} of {splits} splits",
            scratch.bytes
        );
    }
    let scratch = scratch.ptr;
    if !(a.q | a.kcache | a.vcache | scratch).is_multiple_of(16) {
        bail!("attention_decode: q, kcache, vcache and scratch must be 16-byte aligned");
    }
    let Heads { hq, hkv, dh } = heads;
    let blocks = hkv * (hq / hkv).div_ceil(HEADS_PER_BLOCK);
    gpu.launch(
        Kernel::AttentionDecodePartial,
        (blocks as u32, splits as u32, 1),
        (PARTIAL_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(a.q),
            Arg::Ptr(a.kcache),
            Arg::Ptr(a.vcache),
            Arg::Ptr(a.pos),
            Arg::Ptr(scratch),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::I32(splits as i32),
            Arg::F32(scale),
        ],
    )?;
    gpu.launch(
        Kernel::AttentionDecodeMerge,
        (hq as u32, dh.div_ceil(32) as u32, 1),
        (MERGE_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(scratch),
            Arg::Ptr(a.qg),
            Arg::Ptr(a.out),
            Arg::I32(hq as i32),
            Arg::I32(dh as i32),
            Arg::I32(splits as i32),
            Arg::I32(gated as i32),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rule() {
        assert_eq!(attention_decode_splits(0), 1);
        assert_eq!(attention_decode_splits(1), 1);
        assert_eq!(attention_decode_splits(4096), 32);
        assert_eq!(attention_decode_splits(16_895), 131);
        assert_eq!(attention_decode_splits(16_896), 132);
        assert_eq!(attention_decode_splits(32_768), 132);
        assert_eq!(attention_decode_splits(262_144), 264);
        for max_seq in [1, 100, 5000, 20_000, 40_000, 262_144] {
            let s = attention_decode_splits(max_seq);
            assert!((1..=ATTENTION_DECODE_MAX_SPLITS).contains(&s));
            assert!(s == 1 || max_seq / s >= ATTENTION_DECODE_MIN_KEYS);
        }
    }

    #[test]
    fn shape_checks() {
        let h = |hq, hkv, dh| Heads { hq, hkv, dh };
        assert!(attention_decode_check(h(16, 2, 256), 264).is_ok());
        assert!(attention_decode_check(h(16, 3, 256), 1).is_err());
        assert!(attention_decode_check(h(16, 2, 260), 1).is_err());
        assert!(attention_decode_check(h(16, 2, 12), 1).is_err());
        assert!(attention_decode_check(h(16, 2, 48), 1).is_err());
        assert!(attention_decode_check(h(4, 2, 64), 7).is_ok());
        assert!(attention_decode_check(h(16, 2, 256), 0).is_err());
        assert!(attention_decode_check(h(16, 2, 256), ATTENTION_DECODE_MAX_SPLITS + 1).is_err());
        assert_eq!(
            attention_decode_scratch_bytes(16, 256, 264),
            16 * 264 * 258 * 4
        );
    }
}
