//! Launchers of kernels/gemv.cu: the decode step's matrix-vector products
//! (one warp a row, the row's weights in flight before the PDL wait).

use anyhow::{bail, Result};

use super::Kernel;
use crate::gpu::{Arg, DevBuf, DevMat, Gpu};

/// The largest input a decode product stages in shared memory
/// (common.cuh XS_MAX); a normed input must fit.
pub const STAGED_MAX: usize = 9216;

/// Rows one 256-thread block covers (a warp a row).
const ROWS_PER_BLOCK: usize = 8;

fn check_k(what: &str, k: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(8) || k > i32::MAX as usize {
        bail!("{what}: the input width must be a positive multiple of 8, got {k}");
    }
    Ok(())
}

fn check_weight(what: &str, w: &DevBuf, rows: usize, k: usize) -> Result<()> {
    if rows == 0 || rows > i32::MAX as usize || w.bytes < rows * k * 2 {
        bail!(
            "{what}: a weight of {} bytes for {rows} rows of {k} bf16",
            w.bytes
        );
    }
    Ok(())
}

/// A bf16 or block-FP8 weight of `rows` x `k`: its bytes, and for FP8 the
/// shapes the kernels index by (multiples of 128, a staged input) and the
/// scales' bytes.
pub fn check_mat(what: &str, w: &DevMat, rows: usize, k: usize) -> Result<()> {
    if !w.is_fp8() {
        return check_weight(what, w, rows, k);
    }
    if rows == 0 || !rows.is_multiple_of(128) || !k.is_multiple_of(128) || k > STAGED_MAX {
        bail!("{what}: a block-FP8 weight of {rows} x {k}: the kernels take multiples of 128 up to {STAGED_MAX} wide");
    }
    let sb = w.scales.as_ref().map_or(0, |s| s.bytes);
    if w.bytes < rows * k || sb < (rows / 128) * (k / 128) * 4 {
        bail!(
            "{what}: {} bytes of codes and {sb} of scales for {rows} x {k} block FP8",
            w.bytes
        );
    }
    Ok(())
}

/// y[n] = W[n, k] x[k] (`gemv_kernel`): `w` bf16 [n, k], `x` bf16 [k] (16-byte
/// aligned), `y` f32 [n]. One token's linear layer; the decode lm_head.
pub fn gemv(gpu: &Gpu, w: &DevBuf, x: u64, y: u64, n: usize, k: usize) -> Result<()> {
    check_k("gemv", k)?;
    check_weight("gemv", w, n, k)?;
    gpu.launch(
        Kernel::Gemv,
        (n.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(w.ptr),
            Arg::Ptr(x),
            Arg::Ptr(y),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
        ],
    )
}

/// One of `gemv3`'s products: y [rows] f32 = w [rows, k] . input.
pub struct Projection<'a> {
    pub w: &'a DevMat,
    pub y: u64,
    pub rows: usize,
}

/// The RMSNorm a decode product's blocks compute from the residual stream:
/// bf16(x * rsqrt(mean(x^2) + eps) * w1p), `x` f32 [k], `w1p` f32 [k] (1 + w).
#[derive(Clone, Copy, Debug)]
pub struct Normed {
    pub x: u64,
    pub w1p: u64,
    pub eps: f32,
}

/// A decode mixer's three input projections over the same input in one
/// launch (`gemv3_kernel`: q/k/v of attention, qkv/z/ba of GDN), the input
/// being the mixer's input norm of the residual stream, which every block
/// computes for itself. `clear` (address, u64 words, at most 256): zeroed by
/// block 0 after its PDL wait (the decode layer's flags, moe.cu RouteSlot).
pub fn gemv3(
    gpu: &Gpu,
    input: Normed,
    k: usize,
    p: [Projection; 3],
    clear: (u64, usize),
) -> Result<()> {
    check_k("gemv3", k)?;
    if k > STAGED_MAX {
        bail!("gemv3: a normed input of {k} is wider than {STAGED_MAX}");
    }
    let mut rows = 0usize;
    let mut args = vec![Arg::I32(k as i32)];
    for (i, e) in p.iter().enumerate() {
        check_mat("gemv3", e.w, e.rows, k)?;
        // a block's 8 rows read one format (the two paths hold barriers)
        if i < 2
            && p[i + 1].w.is_fp8() != e.w.is_fp8()
            && !(rows + e.rows).is_multiple_of(ROWS_PER_BLOCK)
        {
            bail!(
                "gemv3: bf16 and FP8 products meet at row {}, not a multiple of {ROWS_PER_BLOCK}",
                rows + e.rows
            );
        }
        rows += e.rows;
        args.extend([
            Arg::Ptr(e.w.ptr),
            Arg::Ptr(e.w.scales_ptr()),
            Arg::Ptr(e.y),
            Arg::I32(e.rows as i32),
        ]);
    }
    let (clear, words) = clear;
    if words > 256 {
        bail!("gemv3: {words} words to clear (block 0 clears one a thread, 256 at most)");
    }
    args.extend([
        Arg::Ptr(input.x),
        Arg::Ptr(input.w1p),
        Arg::F32(input.eps),
        Arg::Ptr(clear),
        Arg::I32(words as i32),
    ]);
    gpu.launch(
        Kernel::Gemv3,
        (rows.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        (256, 1, 1),
        0,
        &args,
    )
}

/// A decode mixer's output projection with the residual add fused in
/// (`gemv_add_kernel`): x[d] += W[d, k] h[k], `w` bf16 or block FP8 [d, k],
/// `h` bf16 [k], `x` f32 [d]. The kernels that read x next norm it themselves.
pub fn gemv_add(gpu: &Gpu, w: &DevMat, h: u64, x: u64, d: usize, k: usize) -> Result<()> {
    check_k("gemv_add", k)?;
    check_mat("gemv_add", w, d, k)?;
    gpu.launch(
        Kernel::GemvAdd,
        (d.div_ceil(ROWS_PER_BLOCK) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(w.ptr),
            Arg::Ptr(w.scales_ptr()),
            Arg::Ptr(h),
            Arg::I32(d as i32),
            Arg::I32(k as i32),
            Arg::Ptr(x),
        ],
    )
}
