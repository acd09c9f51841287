//! Launchers of kernels/moe_grouped.cu: a prefill chunk's experts as grouped
//! GEMMs on the tensor cores (gate|up with SiLU, then down), every expert in
//! one launch a projection, sized on the device (`moe_tiles`), so a chunk's
//! MoE never waits on the host. The shared expert runs through the same two
//! kernels as one group.

use anyhow::{bail, Result};

use super::moe::check_routing;
use super::Kernel;
use crate::gpu::{Arg, DevBuf, DevMat, Gpu};

/// Rows of a tile (GG_BM), the tile width of down (GG_BN) and of gate/up's
/// output features (GG_BN / 2), threads a block, and the dynamic shared
/// memory both GEMMs take (GG_SMEM): moe_grouped.cu's constants.
pub const TILE_ROWS: usize = 128;
const TILE_COLS: usize = 128;
const THREADS: u32 = 256;
const SMEM: u32 = 3 * (128 + 128) * 64 * 2;

/// Entries of the tile list for `pairs` sorted rows over `e` experts: its
/// count, then one entry a tile (at most pairs / TILE_ROWS + e tiles).
pub fn tile_list_len(pairs: usize, e: usize) -> usize {
    1 + max_tiles(pairs, e)
}

/// The most tiles `pairs` rows can make over `e` groups (each group's last
/// tile may be partial): the GEMMs' grid height.
fn max_tiles(pairs: usize, e: usize) -> usize {
    pairs.div_ceil(TILE_ROWS) + e.min(pairs)
}

/// offsets [e] = exclusive scan of counts [e] (i32) of `pairs` rows, and the
/// tile list (`moe_tiles_kernel`): tiles[0] their number, tiles[1 + i] =
/// expert | tile << 16. One block: e <= 256.
pub fn moe_tiles(
    gpu: &Gpu,
    counts: u64,
    pairs: usize,
    e: usize,
    offsets: u64,
    tiles: &DevBuf,
) -> Result<()> {
    check_routing(e, 1)?;
    // an expert's tile index is 16 bits of an entry
    if pairs == 0 || pairs.div_ceil(TILE_ROWS) >= 1 << 16 {
        bail!("moe_tiles: {pairs} rows");
    }
    if tiles.bytes < tile_list_len(pairs, e) * 4 {
        bail!(
            "moe_tiles: a tile list of {} bytes for {pairs} rows over {e} experts",
            tiles.bytes
        );
    }
    gpu.launch(
        Kernel::MoeTiles,
        (1, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(counts),
            Arg::I32(e as i32),
            Arg::Ptr(offsets),
            Arg::Ptr(tiles.ptr),
        ],
    )
}

/// How a grouped GEMM finds its rows.
pub enum Groups<'a> {
    /// Experts: `pairs` sorted rows, expert e's at offsets[e] .. + counts[e],
    /// the tiles listed by `moe_tiles` (built for this `pairs` and `e`).
    Experts {
        pairs: usize,
        e: usize,
        tiles: &'a DevBuf,
        offsets: u64,
        counts: u64,
    },
    /// One group of `rows` rows in order (the shared expert).
    One { rows: usize },
}

impl Groups<'_> {
    fn check(&self, what: &str) -> Result<()> {
        if self.args().1 > 65_535 {
            bail!(
                "{what}: {} row tiles is more than a grid holds",
                self.args().1
            );
        }
        match *self {
            Groups::Experts {
                pairs, e, tiles, ..
            } => {
                check_routing(e, 1)?;
                if pairs == 0 || pairs > i32::MAX as usize {
                    bail!("{what}: {pairs} rows");
                }
                if tiles.bytes < tile_list_len(pairs, e) * 4 {
                    bail!(
                        "{what}: a tile list of {} bytes for {pairs} rows over {e} experts",
                        tiles.bytes
                    );
                }
            }
            Groups::One { rows } => {
                if rows == 0 || rows > i32::MAX as usize {
                    bail!("{what}: {rows} rows");
                }
            }
        }
        Ok(())
    }

    /// (tiles, offsets, counts, rows) arguments and the grid height.
    fn args(&self) -> ([Arg; 4], u32) {
        match *self {
            Groups::Experts {
                pairs,
                e,
                tiles,
                offsets,
                counts,
            } => (
                [
                    Arg::Ptr(tiles.ptr),
                    Arg::Ptr(offsets),
                    Arg::Ptr(counts),
                    Arg::I32(pairs as i32),
                ],
                max_tiles(pairs, e) as u32,
            ),
            Groups::One { rows } => (
                [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I32(rows as i32)],
                rows.div_ceil(TILE_ROWS) as u32,
            ),
        }
    }

    fn groups(&self) -> usize {
        match *self {
            Groups::Experts { e, .. } => e,
            Groups::One { .. } => 1,
        }
    }
}

fn check_k(what: &str, k: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(8) || k > i32::MAX as usize {
        bail!("{what}: inner size {k} must be a positive multiple of 8");
    }
    Ok(())
}

/// A grouped weight of `groups` x [rows, k]: bf16, or block FP8 with both
/// sizes multiples of 128 (the scales' blocks) and their scales.
fn check_weights(what: &str, w: &DevMat, groups: usize, rows: usize, k: usize) -> Result<()> {
    let n = groups * rows * k;
    if w.is_fp8() {
        let sb = w.scales.as_ref().map_or(0, |s| s.bytes);
        if !rows.is_multiple_of(128) || !k.is_multiple_of(128) {
            bail!("{what}: block-FP8 weights of [{rows}, {k}]: the kernels take multiples of 128");
        }
        if w.bytes < n || sb < n / (128 * 128) * 4 {
            bail!(
                "{what}: {} bytes of codes and {sb} of scales for {groups} groups of [{rows}, {k}]",
                w.bytes
            );
        }
    } else if w.bytes < n * 2 {
        bail!(
            "{what}: weights of {} bytes for {groups} groups of [{rows}, {k}]",
            w.bytes
        );
    }
    Ok(())
}

/// hs [rows, f] bf16 = silu(x W_gate^T) * (x W_up^T) for each row's group
/// (`moe_gate_up_grouped_kernel`): x = h[src[row]] [d] bf16 for experts (the
/// token of each sorted pair), h[row] for one group; `gate_up` [groups, 2f, d]
/// bf16 or block FP8 (each group's f gate rows, then its f up rows).
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up_grouped(
    gpu: &Gpu,
    groups: &Groups,
    h: u64,
    src: Option<u64>,
    gate_up: &DevMat,
    hs: u64,
    f: usize,
    d: usize,
) -> Result<()> {
    const WHAT: &str = "moe_gate_up_grouped";
    groups.check(WHAT)?;
    check_k(WHAT, d)?;
    if f == 0 || !f.is_multiple_of(2) || f > i32::MAX as usize {
        bail!("{WHAT}: expert width {f} must be a positive even number");
    }
    // (FP8: f a multiple of 128 puts the up rows at a scale block's start)
    check_weights(WHAT, gate_up, groups.groups(), 2 * f, d)?;
    if gate_up.is_fp8() && !f.is_multiple_of(128) {
        bail!("{WHAT}: block-FP8 experts {f} wide: the kernels take multiples of 128");
    }
    if matches!(groups, Groups::Experts { .. }) != src.is_some() {
        bail!("{WHAT}: experts read their rows through src, one group in order");
    }
    let ([tiles, offsets, counts, rows], height) = groups.args();
    gpu.launch(
        Kernel::MoeGateUpGrouped,
        (f.div_ceil(TILE_COLS / 2) as u32, height, 1),
        (THREADS, 1, 1),
        SMEM,
        &[
            Arg::Ptr(h),
            Arg::Ptr(src.unwrap_or(0)),
            Arg::Ptr(gate_up.ptr),
            Arg::Ptr(gate_up.scales_ptr()),
            tiles,
            offsets,
            counts,
            rows,
            Arg::Ptr(hs),
            Arg::I32(f as i32),
            Arg::I32(d as i32),
        ],
    )
}

/// out [rows, d] f32 = hs W_down^T for each row's group
/// (`moe_down_grouped_kernel`): hs [rows, f] bf16 in the sorted order, `down`
/// [groups, d, f] bf16 or block FP8. With one group, any product
/// out [rows, d] = A [rows, f] W [d, f]^T (a block-FP8 projection's prefill).
pub fn moe_down_grouped(
    gpu: &Gpu,
    groups: &Groups,
    hs: u64,
    down: &DevMat,
    out: u64,
    d: usize,
    f: usize,
) -> Result<()> {
    const WHAT: &str = "moe_down_grouped";
    groups.check(WHAT)?;
    check_k(WHAT, f)?;
    if d == 0 || !d.is_multiple_of(2) || d > i32::MAX as usize {
        bail!("{WHAT}: hidden size {d} must be a positive even number");
    }
    check_weights(WHAT, down, groups.groups(), d, f)?;
    let ([tiles, offsets, counts, rows], height) = groups.args();
    gpu.launch(
        Kernel::MoeDownGrouped,
        (d.div_ceil(TILE_COLS) as u32, height, 1),
        (THREADS, 1, 1),
        SMEM,
        &[
            Arg::Ptr(hs),
            Arg::Ptr(down.ptr),
            Arg::Ptr(down.scales_ptr()),
            tiles,
            offsets,
            counts,
            rows,
            Arg::Ptr(out),
            Arg::I32(d as i32),
            Arg::I32(f as i32),
        ],
    )
}
