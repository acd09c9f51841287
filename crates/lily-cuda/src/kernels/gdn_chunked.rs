//! Chunked Gated DeltaNet prefill (kernels/gdn_chunked.cu): the gated delta
//! recurrence of lily-cpu's `GdnCore` (same inputs, same state in and out,
//! same output), computed 64 tokens at a time in its UT-transform form
//! (`GdnCore::head_chunked`), on the tensor cores.
//!
//! Two kernels per pass, on the Gpu's stream:
//! 1. `gdn_chunk_prep_kernel`, grid (chunks in the pass, Hv), block 128: per
//!    (chunk, v head), in parallel, the state-independent part: gates, the
//!    cumulative log-decay, A, T = (I + A)^-1, U = T beta v, W = T beta k e^gam,
//!    the decayed q and k and the masked decayed Q K^T, into a bf16 scratch record.
//! 2. `gdn_chunk_scan_kernel`, grid (Hv, Dv / 32), block 128: per (v head, 32
//!    state columns), sequentially over the pass's chunks: v' = U - W S, the
//!    output, and the state update, with S[:, cols] in registers.
//!
//! A pass covers at most as many chunks as the scratch buffer holds records
//! for; passes run back to back on the stream, the state carrying over, so any
//! T works with a bounded scratch buffer.

use anyhow::{bail, Result};

use super::Kernel;
use crate::gpu::{Arg, DevBuf, Gpu};

/// Tokens per chunk (as the CPU reference, HF and fla).
pub const GDN_CHUNK: usize = 64;
/// The key head dimension the kernels are compiled for.
pub const GDN_DK: usize = 128;
/// Chunks per pass that `gdn_chunked_scratch_bytes` sizes for: 4096 tokens,
/// 2048 prep blocks at Hv = 32, 151 MB of scratch at Hv = 32, Dv = 128.
pub const GDN_MAX_PASS_CHUNKS: usize = 64;
/// Threads per block of both kernels (the kernels assume exactly this).
const THREADS: u32 = 128;

/// Bytes of one (chunk, head) scratch record: W, Qg, Kd [64][128],
/// U [64][Dv], P [64][64] bf16, gam_last f32 + 3 padding
/// (kernels/gdn_chunked.cu, GDN_CHUNK_ELEMS).
pub fn gdn_chunk_record_bytes(dv: usize) -> usize {
    2 * (GDN_CHUNK * (3 * GDN_DK + dv) + GDN_CHUNK * GDN_CHUNK + 8)
}

/// The kernels' dynamic shared memory (gdn_chunked.cu gdn_prep_smem,
/// GDN_SCAN_SMEM).
fn prep_smem(dv: usize) -> u32 {
    let (ch, dk) = (GDN_CHUNK, GDN_DK);
    (2 * ch * dk * 2 + 2 * ch * 65 * 4 + 3 * 256 * 4 + ch * ch * 2 + ch * (dv + dk) * 2) as u32
}
fn scan_smem() -> u32 {
    let (ch, dk) = (GDN_CHUNK, GDN_DK);
    let stage = 3 * ch * dk + ch * ch + ch * 32;
    ((2 * stage + dk * 32 + ch * 32) * 2) as u32
}

/// Bytes of scratch `gdn_chunked_prefill` uses for `t` tokens: one record per (chunk, v head) for
/// min(ceil(t / 64), GDN_MAX_PASS_CHUNKS) chunks. A buffer of this size serves
/// every t' <= t, and in fact any t (more passes).
pub fn gdn_chunked_scratch_bytes(t: usize, hv: usize, dv: usize) -> usize {
    t.div_ceil(GDN_CHUNK).min(GDN_MAX_PASS_CHUNKS) * hv * gdn_chunk_record_bytes(dv)
}

/// The shapes the chunked kernels support: Dk = 128, Dv 64 or 128, Hv a
/// positive multiple of Hk.
pub fn gdn_chunked_check(hk: usize, hv: usize, dk: usize, dv: usize) -> Result<()> {
    if dk != GDN_DK {
        bail!("gdn_chunked: key head dim must be {GDN_DK}, got {dk}");
    }
    if dv != 64 && dv != 128 {
        bail!("gdn_chunked: value head dim must be 64 or 128, got {dv}");
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
/// Device pointers, all f32:
/// - `conv` [t, C], C = 2*hk*128 + hv*dv: per token q | k | v after conv + SiLU,
///   not normalised (the kernel L2-normalises q and k per head and scales q by
///   128^-1/2);
/// - `ba` [t, 2*hv]: b (beta = sigmoid(b)) then a (g = -exp(a_log) softplus(a + dt_bias));
/// - `a_log`, `dt_bias` [hv];
/// - `s` [hv, 128, dv]: the initial state, overwritten with the final state;
/// - `o` [t, hv, dv]: the output (must not overlap `conv`).
///
/// `scratch`: a buffer of at least `gdn_chunk_record_bytes(dv) * hv`
/// bytes (one chunk; 16-byte aligned): a pass covers as many chunks as it
/// holds (`gdn_chunked_scratch_bytes(t, hv, dv)` covers up to
/// `GDN_MAX_PASS_CHUNKS`).
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked_prefill(
    gpu: &Gpu,
    scratch: &DevBuf,
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
    let per_chunk = hv * gdn_chunk_record_bytes(dv);
    let cap = scratch.bytes / per_chunk;
    if cap == 0 {
        bail!(
            "gdn_chunked: scratch of {} bytes is below one chunk's {per_chunk}",
            scratch.bytes
        );
    }
    if !scratch.ptr.is_multiple_of(16) {
        bail!("gdn_chunked: scratch must be 16-byte aligned");
    }
    let (buf, pass_chunks) = (scratch.ptr, cap.min(chunks));
    let (hk_i, hv_i, dv_i) = (hk as i32, hv as i32, dv as i32);
    let mut c = 0;
    while c < chunks {
        let np = pass_chunks.min(chunks - c);
        let t0 = c * GDN_CHUNK;
        let t1 = t.min((c + np) * GDN_CHUNK);
        gpu.launch(
            Kernel::GdnChunkPrep,
            (np as u32, hv as u32, 1),
            (THREADS, 1, 1),
            prep_smem(dv),
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
            Kernel::GdnChunkScan,
            (hv as u32, (dv / 32) as u32, 1),
            (THREADS, 1, 1),
            scan_smem(),
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
    Ok(())
}
