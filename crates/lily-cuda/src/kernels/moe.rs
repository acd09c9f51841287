//! Launchers of kernels/moe.cu: the router and the experts of one decode
//! token (the router's product, gate/up with SiLU, down with the residual
//! add and the next norm), and the sort and combine kernels around a
//! prefill chunk's grouped GEMMs (moe_grouped.rs).

use anyhow::{bail, Result};

use super::gemv::{Normed, STAGED_MAX};
use super::Kernel;
use crate::gpu::{Arg, DevBuf, DevMat, Gpu};

/// Bytes of moe.cu's `RouteSlot` (flag, pad, idx[8], wts[9]): one MoE layer's
/// routing, published by gate/up for the down product, at the front of the
/// decode layer's flags (which `gemv3` clears).
pub const ROUTE_SLOT_BYTES: usize = 4 + 4 + 8 * 4 + 9 * 4;
/// The largest expert count and top-K the routing kernels take (`topk_warp`:
/// 8 candidates a lane of one warp; the top 8).
pub const MAX_EXPERTS: usize = 256;
pub const MAX_TOP_K: usize = 8;
/// The hidden size of gate/up's prefetched path and of the route slot (the
/// released model's); other sizes take the generic path.
pub const PREFETCHED_HIDDEN: usize = 2048;

/// Rows (or tokens) one 256-thread block covers: a warp each.
const WARPS: usize = 8;

/// The routing sizes the kernels take: E in 1..=256, K in 1..=min(8, E).
pub fn check_routing(e: usize, k: usize) -> Result<()> {
    if e == 0 || e > MAX_EXPERTS || k == 0 || k > MAX_TOP_K || k > e {
        bail!("moe: {e} experts, top {k} (the kernels take up to {MAX_EXPERTS} experts, top-K up to {MAX_TOP_K})");
    }
    Ok(())
}

/// A width a decode product stages in shared memory: a positive multiple of 8
/// up to `STAGED_MAX`.
fn check_width(what: &str, name: &str, v: usize) -> Result<()> {
    if v == 0 || !v.is_multiple_of(8) || v > STAGED_MAX {
        bail!("{what}: {name} {v} must be a positive multiple of 8 up to {STAGED_MAX}");
    }
    Ok(())
}

/// Top-K routing of `t` tokens' router logits [t, e + 1] f32 (the last
/// column: the shared expert's gate) into idx [t, k] i32 and wts [t, k + 1]
/// f32: softmax over the e routed logits, top-K (ties to the lower id),
/// renormalised; wts[k] = sigmoid(shared gate) (`router_topk_kernel`).
pub fn router_topk(
    gpu: &Gpu,
    logits: u64,
    t: usize,
    e: usize,
    k: usize,
    idx: u64,
    wts: u64,
) -> Result<()> {
    check_routing(e, k)?;
    if t == 0 || t > i32::MAX as usize {
        bail!("router_topk: {t} tokens");
    }
    gpu.launch(
        Kernel::RouterTopk,
        (t.div_ceil(WARPS) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(t as i32),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
            Arg::Ptr(idx),
            Arg::Ptr(wts),
        ],
    )
}

/// One decode token's router (`router_decode_kernel`): logits [e + 1] f32 =
/// `router` [e + 1, d] . norm(input), the post-attention norm every block
/// computes from the residual stream; block 0 also writes that normed input
/// as bf16 [d] to `xn`, the input of gate/up.
pub fn router_decode(
    gpu: &Gpu,
    router: &DevBuf,
    input: Normed,
    logits: u64,
    d: usize,
    e: usize,
    xn: u64,
) -> Result<()> {
    check_routing(e, 1)?;
    check_width("router_decode", "hidden", d)?;
    if router.bytes < (e + 1) * d * 2 {
        bail!(
            "router_decode: a router of {} bytes for {} rows of {d}",
            router.bytes,
            e + 1
        );
    }
    gpu.launch(
        Kernel::RouterDecode,
        ((e + 1).div_ceil(WARPS) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(router.ptr),
            Arg::Ptr(logits),
            Arg::I32(d as i32),
            Arg::I32(e as i32),
            Arg::Ptr(input.x),
            Arg::Ptr(input.w1p),
            Arg::F32(input.eps),
            Arg::Ptr(xn),
        ],
    )
}

/// The MoE sizes of a layer: hidden d, experts e, top-K k, expert width f,
/// shared expert width fs.
#[derive(Clone, Copy, Debug)]
pub struct MoeDims {
    pub d: usize,
    pub e: usize,
    pub k: usize,
    pub f: usize,
    pub fs: usize,
}

impl MoeDims {
    /// The sizes the decode expert kernels take: the routing's, a hidden
    /// size gate/up can stage, expert widths in whole 16-byte chunks.
    pub fn check(&self, what: &str) -> Result<()> {
        check_routing(self.e, self.k)?;
        check_width(what, "hidden", self.d)?;
        for (name, v) in [("expert width", self.f), ("shared width", self.fs)] {
            if v == 0 || !v.is_multiple_of(8) || v > i32::MAX as usize {
                bail!("{what}: {name} {v} must be a positive multiple of 8");
            }
        }
        Ok(())
    }

    /// Elements a row of gate/up's output h has: max(f, fs).
    pub fn h_width(&self) -> usize {
        self.f.max(self.fs)
    }
}

/// One decode token's gate/up products (`moe_gate_up_kernel`).
pub struct GateUp<'a> {
    /// the normed input [d] bf16 (`router_decode`'s `xn`)
    pub x: u64,
    /// [e, 2f, d] bf16 or block FP8: each expert's f gate rows, then its f up rows
    pub gate_up: &'a DevMat,
    /// [2fs, d], the same format as `gate_up`
    pub shared_gate_up: &'a DevMat,
    /// the router's logits [e + 1] f32: every routed block takes the top-K itself
    pub logits: u64,
    /// out: h [k + 1, max(f, fs)] bf16, slot k the shared expert's
    pub h: u64,
    /// where one block publishes the routing for the down product
    /// (`ROUTE_SLOT_BYTES`, zeroed before; d = 2048 only)
    pub route: Option<u64>,
    /// asked into L2 by the shared expert's blocks (the shared down matrix,
    /// which the down product reads next)
    pub ahead: &'a DevBuf,
}

/// The experts' two weights of one decode kernel: the same format, and for
/// block FP8 the sizes its scales index by (d, f, fs multiples of 128).
fn check_experts(
    what: &str,
    dims: MoeDims,
    w: &DevMat,
    shared: &DevMat,
    rows: [usize; 2],
    cols: [usize; 2],
) -> Result<()> {
    let MoeDims { d, f, fs, .. } = dims;
    let sz = w.elem_bytes();
    if w.is_fp8() != shared.is_fp8() {
        bail!("{what}: the routed and the shared expert in different formats");
    }
    if w.bytes < rows[0] * cols[0] * sz || shared.bytes < rows[1] * cols[1] * sz {
        bail!(
            "{what}: expert weights smaller than [{}, {}] and [{}, {}]",
            rows[0],
            cols[0],
            rows[1],
            cols[1]
        );
    }
    if w.is_fp8() {
        if !(d.is_multiple_of(128) && f.is_multiple_of(128) && fs.is_multiple_of(128)) {
            bail!(
                "{what}: block-FP8 experts need d, f and fs multiples of 128 (got {d}, {f}, {fs})"
            );
        }
        let sb = |m: &DevMat| m.scales.as_ref().map_or(0, |s| s.bytes);
        if sb(w) < rows[0] * cols[0] / (128 * 128) * 4
            || sb(shared) < rows[1] * cols[1] / (128 * 128) * 4
        {
            bail!("{what}: block-FP8 experts with too few scales");
        }
    }
    Ok(())
}

pub fn moe_gate_up(gpu: &Gpu, dims: MoeDims, a: &GateUp) -> Result<()> {
    let MoeDims { d, e, k, f, fs } = dims;
    dims.check("moe_gate_up")?;
    check_experts(
        "moe_gate_up",
        dims,
        a.gate_up,
        a.shared_gate_up,
        [e * 2 * f, 2 * fs],
        [d, d],
    )?;
    if a.route.is_some() && d != PREFETCHED_HIDDEN {
        bail!("moe_gate_up: the route slot is published on the d = {PREFETCHED_HIDDEN} path only");
    }
    gpu.launch(
        Kernel::MoeGateUp,
        (dims.h_width().div_ceil(WARPS) as u32, (k + 1) as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(a.x),
            Arg::Ptr(a.gate_up.ptr),
            Arg::Ptr(a.shared_gate_up.ptr),
            Arg::Ptr(a.h),
            Arg::I32(d as i32),
            Arg::I32(f as i32),
            Arg::I32(fs as i32),
            Arg::I32(k as i32),
            Arg::Ptr(a.logits),
            Arg::I32(e as i32),
            Arg::Ptr(a.route.unwrap_or(0)),
            Arg::Ptr(a.ahead.ptr),
            Arg::U64(a.ahead.bytes as u64),
            Arg::Ptr(a.gate_up.scales_ptr()),
            Arg::Ptr(a.shared_gate_up.scales_ptr()),
        ],
    )
}

/// One decode token's down product (`moe_down_norm_kernel`).
pub struct DownNorm<'a> {
    /// gate/up's output [k + 1, max(f, fs)] bf16
    pub h: u64,
    /// [e, d, f] bf16 or block FP8
    pub down: &'a DevMat,
    /// [d, fs], the same format as `down`
    pub shared_down: &'a DevMat,
    /// the router's logits [e + 1] f32 (each block routes from them when the
    /// route slot holds nothing)
    pub logits: u64,
    /// the residual stream [d] f32: x += the weighted sum of the k + 1 experts
    pub x: u64,
    /// after the last layer, the final norm, run by the last block:
    /// out [d] bf16 = norm(x) * w1p (w1p f32 [d], 1 + w)
    pub final_norm: Option<(u64, u64, f32)>,
    /// a zeroed u32 the last block counts on (left zeroed)
    pub counter: u64,
    /// the routing gate/up published (d = 2048 only)
    pub route: Option<u64>,
}

pub fn moe_down_norm(gpu: &Gpu, dims: MoeDims, a: &DownNorm) -> Result<()> {
    let MoeDims { d, e, k, f, fs } = dims;
    dims.check("moe_down_norm")?;
    check_experts(
        "moe_down_norm",
        dims,
        a.down,
        a.shared_down,
        [e * d, d],
        [f, fs],
    )?;
    if a.route.is_some() && d != PREFETCHED_HIDDEN {
        bail!("moe_down_norm: the route slot is read on the d = {PREFETCHED_HIDDEN} path only");
    }
    let (w1p, out, eps) = a.final_norm.unwrap_or((0, 0, 0.0));
    gpu.launch(
        Kernel::MoeDownNorm,
        (d.div_ceil(WARPS) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(a.h),
            Arg::Ptr(a.down.ptr),
            Arg::Ptr(a.shared_down.ptr),
            Arg::Ptr(a.logits),
            Arg::I32(e as i32),
            Arg::Ptr(a.x),
            Arg::I32(d as i32),
            Arg::I32(f as i32),
            Arg::I32(fs as i32),
            Arg::I32(k as i32),
            Arg::Ptr(w1p),
            Arg::Ptr(out),
            Arg::F32(eps),
            Arg::Ptr(a.counter),
            Arg::Ptr(a.route.unwrap_or(0)),
            Arg::Ptr(a.down.scales_ptr()),
            Arg::Ptr(a.shared_down.scales_ptr()),
        ],
    )
}

/// counts[e] += the pairs of idx [n] i32 routed to e (`moe_count_kernel`;
/// counts zeroed before).
pub fn moe_count(gpu: &Gpu, idx: u64, n: usize, counts: u64) -> Result<()> {
    if n == 0 || n > i32::MAX as usize {
        bail!("moe_count: {n} pairs");
    }
    gpu.launch(
        Kernel::MoeCount,
        (n.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(idx), Arg::I32(n as i32), Arg::Ptr(counts)],
    )
}

/// Each pair of idx [n] (n = tokens x k) gets the next row of its expert's
/// block, which starts at offsets[e]: rowmap [n] = its row, src [row] = its
/// token, in token order within an expert (`moe_assign_kernel`).
#[allow(clippy::too_many_arguments)]
pub fn moe_assign(
    gpu: &Gpu,
    idx: u64,
    n: usize,
    k: usize,
    e: usize,
    offsets: u64,
    rowmap: u64,
    src: u64,
) -> Result<()> {
    check_routing(e, k)?;
    if n == 0 || n > i32::MAX as usize || !n.is_multiple_of(k) {
        bail!("moe_assign: {n} pairs of top-{k}");
    }
    gpu.launch(
        Kernel::MoeAssign,
        (e as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(idx),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::Ptr(offsets),
            Arg::Ptr(rowmap),
            Arg::Ptr(src),
        ],
    )
}

/// x[t, :] += sum_s wts[t, s] * os[rowmap[t, s], :] + wts[t, k] * osh[t, :]
/// for `t` tokens (`moe_combine_kernel`): the routed experts' rows `os`
/// [t k, d] f32 and the shared expert's `osh` [t, d] f32, weighted.
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    os: u64,
    osh: u64,
    rowmap: u64,
    wts: u64,
    x: u64,
    t: usize,
    d: usize,
    k: usize,
) -> Result<()> {
    if t == 0 || t > u32::MAX as usize || d == 0 || d > i32::MAX as usize || k == 0 || k > MAX_TOP_K
    {
        bail!("moe_combine: {t} tokens of {d}, top-{k}");
    }
    gpu.launch(
        Kernel::MoeCombine,
        (t as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(os),
            Arg::Ptr(osh),
            Arg::Ptr(rowmap),
            Arg::Ptr(wts),
            Arg::Ptr(x),
            Arg::I32(d as i32),
            Arg::I32(k as i32),
        ],
    )
}
