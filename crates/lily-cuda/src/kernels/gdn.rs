//! Launchers of kernels/gdn.cu: a prefill chunk's causal conv + SiLU, and the
//! fused decode step of a GDN layer (conv, gated delta step, gated norm).

use anyhow::{bail, Result};

use super::gdn_chunked::GDN_DK;
use super::Kernel;
use crate::gpu::{Arg, Gpu};

/// Tokens a `conv_silu_kernel` thread computes (CONV_STRIP in gdn.cu).
const CONV_STRIP: usize = 16;

/// The causal conv1d + SiLU of `t` tokens over `c` channels of width `w`
/// (`conv_silu_kernel`): out[t, c] = silu(sum_j taps[c, j] x[t - w + 1 + j, c]),
/// the history [c, w - 1] f32 (oldest first) before the first token and
/// updated to the last w - 1 inputs. `mixed`, `out` [t, c] f32, `taps` [c, w] f32.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu(
    gpu: &Gpu,
    mixed: u64,
    history: u64,
    taps: u64,
    out: u64,
    t: usize,
    c: usize,
    w: usize,
) -> Result<()> {
    // the kernel keeps a channel's history and taps in registers: w <= 8
    if w == 0 || w > 8 || c == 0 || c > i32::MAX as usize || t > i32::MAX as usize {
        bail!("conv_silu: {t} tokens of {c} channels, width {w} (at most 8)");
    }
    gpu.launch(
        Kernel::ConvSilu,
        (
            c.div_ceil(128) as u32,
            t.div_ceil(CONV_STRIP).max(1) as u32,
            1,
        ),
        (128, 1, 1),
        0,
        &[
            Arg::Ptr(mixed),
            Arg::Ptr(history),
            Arg::Ptr(taps),
            Arg::Ptr(out),
            Arg::I32(t as i32),
            Arg::I32(c as i32),
            Arg::I32(w as i32),
        ],
    )
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

/// A GDN layer's decode step, its device pointers (f32 unless said):
pub struct GdnDecode {
    /// [C] q | k | v before the conv (the in projection's output), C = 2 hk 128 + hv dv
    pub mixed: u64,
    /// [C, 3] the conv history (oldest first), updated in place
    pub conv_state: u64,
    /// [C, 4] the conv taps
    pub conv_w: u64,
    /// [2 hv]: b (beta = sigmoid(b)) then a (g = -exp(a_log) softplus(a + dt_bias))
    pub ba: u64,
    /// [hv] each
    pub a_log: u64,
    pub dt_bias: u64,
    /// [hv dv] the output gate
    pub z: u64,
    /// [dv] the gated-norm weight (plain, not 1 + w)
    pub norm_w: u64,
    /// [hv, 128, dv] the recurrent state, updated in place (16-byte aligned)
    pub state: u64,
    /// out: [hv dv] bf16 `w * (o * rsqrt(mean(o^2) + eps)) * silu(z)` per
    /// head, the input of the output projection
    pub out: u64,
}

/// One decode step (T = 1) of a GDN layer's conv, core and output norm, fused
/// (`gdn_decode_kernel`): the prefill path's `conv_silu`, the recurrence at
/// T = 1 and `gated_rmsnorm` in one launch, with no per-step arguments, so it
/// can be captured in a CUDA graph.
///
/// Geometry: grid hv*4 blocks of 256 threads in clusters of 8 (4 blocks per v
/// head, one per 32 state columns; each thread holds a 4x4 tile of the state
/// in registers).
pub fn gdn_decode(
    gpu: &Gpu,
    a: &GdnDecode,
    hk: usize,
    hv: usize,
    dv: usize,
    eps: f32,
) -> Result<()> {
    gdn_decode_check(hk, hv, GDN_DK, dv, GDN_DECODE_CONV)?;
    if !a.state.is_multiple_of(16) {
        bail!("gdn_decode: the state must be 16-byte aligned");
    }
    gpu.launch(
        Kernel::GdnDecode,
        ((hv * DECODE_HEAD_BLOCKS) as u32, 1, 1),
        (DECODE_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(a.mixed),
            Arg::Ptr(a.conv_state),
            Arg::Ptr(a.conv_w),
            Arg::Ptr(a.ba),
            Arg::Ptr(a.a_log),
            Arg::Ptr(a.dt_bias),
            Arg::Ptr(a.z),
            Arg::Ptr(a.norm_w),
            Arg::Ptr(a.state),
            Arg::Ptr(a.out),
            Arg::I32(hk as i32),
            Arg::I32(hv as i32),
            Arg::F32(eps),
        ],
    )
}
