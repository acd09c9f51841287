//! Split-K ("flash decoding") attention for one query token
//! (kernels/attention.cu, `attention_decode_*`): the same function as
//! `attention_kernel` at T = 1 (same inputs, same bf16 output), with the key
//! range split `splits` ways so that a long cache is read by many blocks at
//! once instead of by one block per query head.
//!
//! Two kernels on the Gpu's stream:
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

use crate::gpu::{Arg, Gpu};

/// The largest split count `attention_decode` takes (kernels/attention.cu,
/// ATTD_MAX_SPLITS): past 264 the merge reads the rest split by split, so
/// more splits only cost time; the split rule never goes past 264.
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

/// Check the shapes the decode kernels support: hq a positive multiple of
/// hkv, dh a multiple of 32 in 32..=256, splits in 1..=ATTENTION_DECODE_MAX_SPLITS.
pub fn attention_decode_check(hq: usize, hkv: usize, dh: usize, splits: usize) -> Result<()> {
    if hkv == 0 || hq == 0 || !hq.is_multiple_of(hkv) {
        bail!(
            "attention_decode: query heads ({hq}) must be a positive multiple of KV heads ({hkv})"
        );
    }
    if dh == 0 || dh > 256 || !dh.is_multiple_of(32) {
        bail!("attention_decode: head dim must be a multiple of 32 in 32..=256, got {dh}");
    }
    if splits == 0 || splits > ATTENTION_DECODE_MAX_SPLITS {
        bail!(
            "attention_decode: splits must be in 1..={ATTENTION_DECODE_MAX_SPLITS}, got {splits}"
        );
    }
    let blocks = hkv * (hq / hkv).div_ceil(HEADS_PER_BLOCK);
    if blocks > i32::MAX as usize {
        bail!("attention_decode: too many heads ({hq}) for the grid");
    }
    Ok(())
}

/// Gated attention of one query token over the first pos[0] + 1 rows of the
/// KV cache, on the Gpu's stream; writes what `attention_kernel` writes at
/// T = 1.
///
/// Device pointers:
/// - `q` [hq, dh] f32: the query, normed and rotated (`qk_prep_kernel`'s q_out);
/// - `kcache`, `vcache` [max_seq, hkv, dh] bf16;
/// - `qg` [hq, 2 * dh] f32 per head [query | gate] when `gated` (only the
///   gate half is read); unused otherwise;
/// - `pos` one i32: the tokens cached before this one (n = pos[0] + 1 keys,
///   n <= max_seq);
/// - `out` [hq * dh] bf16 = softmax(q k^T * scale) v * sigmoid(gate);
/// - `scratch`: at least `attention_decode_scratch_bytes(hq, dh, splits)`
///   bytes, 16-byte aligned, owned by this call until it completes on the
///   stream (no initialisation needed).
///
/// `q`, `kcache` and `vcache` must be 16-byte aligned. `splits` is usually
/// `attention_decode_splits(max_seq)`; any value in range gives the same
/// result up to f32 rounding.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    gpu: &Gpu,
    q: u64,
    kcache: u64,
    vcache: u64,
    qg: u64,
    pos: u64,
    out: u64,
    scratch: u64,
    splits: usize,
    hq: usize,
    hkv: usize,
    dh: usize,
    scale: f32,
    gated: bool,
) -> Result<()> {
    attention_decode_check(hq, hkv, dh, splits)?;
    if !(q | kcache | vcache | scratch).is_multiple_of(16) {
        bail!("attention_decode: q, kcache, vcache and scratch must be 16-byte aligned");
    }
    let blocks = hkv * (hq / hkv).div_ceil(HEADS_PER_BLOCK);
    gpu.launch(
        "attention_decode_partial_kernel",
        (blocks as u32, splits as u32, 1),
        (PARTIAL_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(q),
            Arg::Ptr(kcache),
            Arg::Ptr(vcache),
            Arg::Ptr(pos),
            Arg::Ptr(scratch),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::I32(splits as i32),
            Arg::F32(scale),
        ],
    )?;
    gpu.launch(
        "attention_decode_merge_kernel",
        (hq as u32, dh.div_ceil(32) as u32, 1),
        (MERGE_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(scratch),
            Arg::Ptr(qg),
            Arg::Ptr(out),
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
        assert!(attention_decode_check(16, 2, 256, 264).is_ok());
        assert!(attention_decode_check(16, 3, 256, 1).is_err());
        assert!(attention_decode_check(16, 2, 260, 1).is_err());
        assert!(attention_decode_check(16, 2, 12, 1).is_err());
        assert!(attention_decode_check(16, 2, 48, 1).is_err());
        assert!(attention_decode_check(4, 2, 64, 7).is_ok());
        assert!(attention_decode_check(16, 2, 256, 0).is_err());
        assert!(attention_decode_check(16, 2, 256, ATTENTION_DECODE_MAX_SPLITS + 1).is_err());
        assert_eq!(
            attention_decode_scratch_bytes(16, 256, 264),
            16 * 264 * 258 * 4
        );
    }
}
