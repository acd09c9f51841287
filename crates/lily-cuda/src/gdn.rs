//! Chunked Gated DeltaNet prefill (kernels/gdn_chunked.cu): the same function
//! as `gdn_recurrent_kernel` (same inputs, same state in and out, same output),
//! computed 64 tokens at a time in the UT-transform form of lily-cpu's
//! `GdnCore::head_chunked`.
//!
//! Two kernels per pass, on the Gpu's stream:
//! 1. `gdn_chunk_prep_kernel`, grid (chunks in the pass, Hv), block 256: per
//!    (chunk, v head), in parallel, the state-independent part: gates, the
//!    cumulative log-decay, A, T = (I + A)^-1, U = T beta v, W = T beta k e^gam,
//!    the decayed q and k and the masked decayed Q K^T, into a scratch record.
//! 2. `gdn_chunk_scan_kernel`, grid (Hv, Dv / 32), block 256: per (v head, 32
//!    state columns), sequentially over the pass's chunks: v' = U - W S, the
//!    output, and the state update, with S[:, cols] in shared memory.
//!
//! A pass covers at most as many chunks as the scratch buffer holds records
//! for; passes run back to back on the stream, the state carrying over, so any
//! T works with a bounded scratch buffer.
//!
//! Decode (T = 1) has its own fused kernel, `gdn_decode` (kernels/gdn.cu,
//! `gdn_decode_kernel`): the recurrent step and the gated RMSNorm in one
//! bandwidth-bound launch.

use anyhow::{bail, Result};

use crate::gpu::{Arg, DevBuf, Gpu};

/// Tokens per chunk (as the CPU reference, HF and fla).
pub const GDN_CHUNK: usize = 64;
/// The key head dimension the kernels are compiled for.
pub const GDN_DK: usize = 128;
/// Chunks per pass when the launcher allocates the scratch itself (and what
/// `gdn_chunked_scratch_bytes` sizes for): 2048 tokens, 1024 prep blocks at
/// Hv = 32, 151 MB of scratch at Hv = 32, Dv = 128.
pub const GDN_MAX_PASS_CHUNKS: usize = 32;
/// Threads per block of both kernels (the kernels assume exactly this).
const THREADS: u32 = 256;

/// f32 values of one (chunk, head) scratch record: W, Qg, Kd [64][128],
/// U [64][Dv], P [64][64], gam_last + 3 padding (kernels/gdn_chunked.cu,
/// GDN_CHUNK_FLOATS).
pub fn gdn_chunk_record_floats(dv: usize) -> usize {
    GDN_CHUNK * (3 * GDN_DK + dv) + GDN_CHUNK * GDN_CHUNK + 4
}

/// Bytes of scratch `gdn_chunked_prefill` uses (and allocates itself when
/// given none) for `t` tokens: one record per (chunk, v head) for
/// min(ceil(t / 64), GDN_MAX_PASS_CHUNKS) chunks. A buffer of this size serves
/// every t' <= t, and in fact any t (more passes).
pub fn gdn_chunked_scratch_bytes(t: usize, hv: usize, dv: usize) -> usize {
    t.div_ceil(GDN_CHUNK).min(GDN_MAX_PASS_CHUNKS) * hv * gdn_chunk_record_floats(dv) * 4
}

/// The shapes the chunked kernels support: Dk = 128, Dv a positive multiple
/// of 32, Hv a positive multiple of Hk.
pub fn gdn_chunked_check(hk: usize, hv: usize, dk: usize, dv: usize) -> Result<()> {
    if dk != GDN_DK {
        bail!("gdn_chunked: key head dim must be {GDN_DK}, got {dk}");
    }
    if dv == 0 || !dv.is_multiple_of(32) {
        bail!("gdn_chunked: value head dim must be a positive multiple of 32, got {dv}");
    }
    if hk == 0 || hv == 0 || !hv.is_multiple_of(hk) {
        bail!("gdn_chunked: value heads ({hv}) must be a positive multiple of key heads ({hk})");
    }
    if hv > 65_535 || dv / 32 > 65_535 {
        bail!("gdn_chunked: too many heads or columns for the grid (Hv {hv}, Dv {dv})");
    }
    Ok(())
}

/// Run the GDN core over `t` tokens in the chunked form, on the Gpu's stream.
///
/// Device pointers, all f32, as `gdn_recurrent_kernel`:
/// - `conv` [t, C], C = 2*hk*128 + hv*dv: per token q | k | v after conv + SiLU,
///   not normalised (the kernel L2-normalises q and k per head and scales q by
///   128^-1/2);
/// - `ba` [t, 2*hv]: b (beta = sigmoid(b)) then a (g = -exp(a_log) softplus(a + dt_bias));
/// - `a_log`, `dt_bias` [hv];
/// - `s` [hv, 128, dv]: the initial state, overwritten with the final state;
/// - `o` [t, hv, dv]: the output (must not overlap `conv`).
///
/// `scratch`: a buffer of at least `gdn_chunk_record_floats(dv) * hv * 4`
/// bytes (one chunk; 16-byte aligned) — a pass covers as many chunks as it
/// holds — or None: the launcher allocates `gdn_chunked_scratch_bytes(t, hv, dv)`
/// bytes, and synchronises the stream before freeing them.
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked_prefill(
    gpu: &Gpu,
    scratch: Option<&DevBuf>,
    conv: u64,
    ba: u64,
    a_log: u64,
    dt_bias: u64,
    s: u64,
    o: u64,
    t: usize,
    hk: usize,
    hv: usize,
    dv: usize,
) -> Result<()> {
    gdn_chunked_check(hk, hv, GDN_DK, dv)?;
    if t == 0 {
        return Ok(());
    }
    if t > i32::MAX as usize - GDN_CHUNK {
        bail!("gdn_chunked: {t} tokens is too many");
    }
    let chunks = t.div_ceil(GDN_CHUNK);
    let per_chunk = hv * gdn_chunk_record_floats(dv) * 4;
    let owned;
    let (buf, pass_chunks) = match scratch {
        Some(b) => {
            let cap = b.bytes / per_chunk;
            if cap == 0 {
                bail!(
                    "gdn_chunked: scratch of {} bytes is below one chunk's {per_chunk}",
                    b.bytes
                );
            }
            if b.ptr % 16 != 0 {
                bail!("gdn_chunked: scratch must be 16-byte aligned");
            }
            (b.ptr, cap.min(chunks))
        }
        None => {
            owned = gpu.alloc(gdn_chunked_scratch_bytes(t, hv, dv))?;
            (owned.ptr, chunks.min(GDN_MAX_PASS_CHUNKS))
        }
    };
    let (hk_i, hv_i, dv_i) = (hk as i32, hv as i32, dv as i32);
    let mut c = 0;
    while c < chunks {
        let np = pass_chunks.min(chunks - c);
        let t0 = c * GDN_CHUNK;
        let t1 = t.min((c + np) * GDN_CHUNK);
        gpu.launch(
            "gdn_chunk_prep_kernel",
            (np as u32, hv as u32, 1),
            (THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(conv),
                Arg::Ptr(ba),
                Arg::Ptr(a_log),
                Arg::Ptr(dt_bias),
                Arg::Ptr(buf),
                Arg::I32(t0 as i32),
                Arg::I32(t1 as i32),
                Arg::I32(hk_i),
                Arg::I32(hv_i),
                Arg::I32(dv_i),
            ],
        )?;
        gpu.launch(
            "gdn_chunk_scan_kernel",
            (hv as u32, (dv / 32) as u32, 1),
            (THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(buf),
                Arg::Ptr(s),
                Arg::Ptr(o),
                Arg::I32(t0 as i32),
                Arg::I32(t1 as i32),
                Arg::I32(hv_i),
                Arg::I32(dv_i),
            ],
        )?;
        c += np;
    }
    if scratch.is_none() {
        // The kernels must finish before `owned` is freed.
        gpu.sync()?;
    }
    Ok(())
}

/// The value head dimension `gdn_decode_kernel` is compiled for (4 blocks of
/// 32 state columns cover one head).
pub const GDN_DECODE_DV: usize = 128;
/// The conv width `gdn_decode_kernel` is compiled for.
pub const GDN_DECODE_CONV: usize = 4;
/// Blocks per v head, blocks per cluster (two v heads, compile-time) and
/// threads per block.
const DECODE_HEAD_BLOCKS: usize = 4;
const DECODE_CLUSTER: usize = 8;
const DECODE_THREADS: u32 = 256;

/// The shapes `gdn_decode` supports: Dk = Dv = 128, conv width 4, Hv even and
/// Hv / Hk 1 or 2 (every block that reads a key head's q/k channels must sit
/// in one cluster of two v heads: see kernels/gdn.cu).
pub fn gdn_decode_check(hk: usize, hv: usize, dk: usize, dv: usize, conv: usize) -> Result<()> {
    if dk != GDN_DK {
        bail!("gdn_decode: key head dim must be {GDN_DK}, got {dk}");
    }
    if dv != GDN_DECODE_DV {
        bail!("gdn_decode: value head dim must be {GDN_DECODE_DV}, got {dv}");
    }
    if conv != GDN_DECODE_CONV {
        bail!("gdn_decode: conv width must be {GDN_DECODE_CONV}, got {conv}");
    }
    if hk == 0
        || hv == 0
        || !(hv == hk || hv == 2 * hk)
        || !(hv * DECODE_HEAD_BLOCKS).is_multiple_of(DECODE_CLUSTER)
    {
        bail!("gdn_decode: value heads ({hv}) must be even and 1 or 2 times the key heads ({hk})");
    }
    if hv * DECODE_HEAD_BLOCKS > i32::MAX as usize {
        bail!("gdn_decode: too many heads ({hv})");
    }
    Ok(())
}

/// One decode step (T = 1) of a GDN layer's conv, core and output norm, fused
/// (`gdn_decode_kernel`): exactly `conv_silu_kernel`, `gdn_recurrent_kernel`
/// at T = 1 and `gated_rmsnorm_kernel`, in one launch on the Gpu's stream. No
/// host synchronisation and no per-step arguments, so it can be captured in a
/// CUDA graph.
///
/// Device pointers:
/// - `mixed` [C] f32, C = 2*hk*128 + hv*dv: q | k | v before the conv (the
///   in projection's output);
/// - `conv_state` [C, 3] f32 (oldest first), updated in place; `conv_w` [C, 4];
/// - `ba` [2*hv] f32: b (beta = sigmoid(b)) then a (g = -exp(a_log) softplus(a + dt_bias));
/// - `a_log`, `dt_bias` [hv] f32;
/// - `z` [hv*dv] f32: the output gate;
/// - `norm_w` [dv] f32: the gated-norm weight (plain, not 1 + w);
/// - `s` [hv, 128, dv] f32: the state, updated in place (16-byte aligned);
/// - `out` [hv*dv] bf16: `w * (o * rsqrt(mean(o^2) + eps)) * silu(z)` per head,
///   the input of out_proj.
/// - `done` (0: none) [1] u32: each block adds 1 once its share of `out` is
///   written (after a fence), so `done` grows by `gdn_decode_blocks(hv)`: the
///   output projection starts on that count instead of the kernel's completion.
///
/// Geometry: grid hv*4 blocks of 256 threads in clusters of 8 (4 blocks per v
/// head, one per 32 state columns; each thread holds a 4x4 tile of the state
/// in registers).
#[allow(clippy::too_many_arguments)]
pub fn gdn_decode(
    gpu: &Gpu,
    mixed: u64,
    conv_state: u64,
    conv_w: u64,
    ba: u64,
    a_log: u64,
    dt_bias: u64,
    z: u64,
    norm_w: u64,
    s: u64,
    out: u64,
    hk: usize,
    hv: usize,
    dv: usize,
    eps: f32,
    done: u64,
) -> Result<()> {
    gdn_decode_check(hk, hv, GDN_DK, dv, GDN_DECODE_CONV)?;
    if !s.is_multiple_of(16) {
        bail!("gdn_decode: the state must be 16-byte aligned");
    }
    gpu.launch(
        "gdn_decode_kernel",
        (gdn_decode_blocks(hv), 1, 1),
        (DECODE_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(mixed),
            Arg::Ptr(conv_state),
            Arg::Ptr(conv_w),
            Arg::Ptr(ba),
            Arg::Ptr(a_log),
            Arg::Ptr(dt_bias),
            Arg::Ptr(z),
            Arg::Ptr(norm_w),
            Arg::Ptr(s),
            Arg::Ptr(out),
            Arg::I32(hk as i32),
            Arg::I32(hv as i32),
            Arg::F32(eps),
            Arg::Ptr(done),
        ],
    )
}

/// gdn_decode's grid: the count its blocks add to `done`.
pub fn gdn_decode_blocks(hv: usize) -> u32 {
    (hv * DECODE_HEAD_BLOCKS) as u32
}
