//! Launchers of kernels/norm.cu: the RMSNorms of a prefill chunk (a decode
//! step computes its norms inside the kernels that read them).

use anyhow::{bail, Result};

use super::Kernel;
use crate::gpu::{Arg, Gpu};

/// Per row t of `t` rows: x[t] += delta[t] (when `delta` is given), then
/// out[t] = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * w1p) (`add_rmsnorm_kernel`).
/// `x`, `delta` [t, d] f32, `w1p` [d] f32 (1 + w), `out` [t, d] bf16.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm(
    gpu: &Gpu,
    x: u64,
    delta: Option<u64>,
    w1p: u64,
    out: u64,
    t: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    if t == 0 || t > u32::MAX as usize || d == 0 || d > i32::MAX as usize {
        bail!("add_rmsnorm: {t} rows of {d}");
    }
    gpu.launch(
        Kernel::AddRmsnorm,
        (t as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::Ptr(delta.unwrap_or(0)),
            Arg::Ptr(w1p),
            Arg::Ptr(out),
            Arg::I32(d as i32),
            Arg::F32(eps),
        ],
    )
}

/// The GDN output norm of `rows` heads of `dv` values (`gated_rmsnorm_kernel`):
/// out = bf16(w * (o * rsqrt(mean(o^2) + eps)) * silu(z)) per head.
/// `o`, `z` [rows, dv] f32, `w` [dv] f32 (plain weight), `out` [rows, dv] bf16.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm(
    gpu: &Gpu,
    o: u64,
    z: u64,
    w: u64,
    out: u64,
    rows: usize,
    dv: usize,
    eps: f32,
) -> Result<()> {
    // one thread per value: a block of dv threads, a multiple of 32
    if rows == 0 || rows > u32::MAX as usize || dv == 0 || dv > 1024 || !dv.is_multiple_of(32) {
        bail!("gated_rmsnorm: {rows} heads of {dv} (a multiple of 32 up to 1024)");
    }
    gpu.launch(
        Kernel::GatedRmsnorm,
        (rows as u32, 1, 1),
        (dv as u32, 1, 1),
        0,
        &[
            Arg::Ptr(o),
            Arg::Ptr(z),
            Arg::Ptr(w),
            Arg::Ptr(out),
            Arg::I32(dv as i32),
            Arg::F32(eps),
        ],
    )
}
