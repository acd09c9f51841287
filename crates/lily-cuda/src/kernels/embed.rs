//! Launchers of kernels/embed.cu: the embedding lookup, and the generators of
//! the synthetic models' weights on the device.

use anyhow::{bail, Result};
use lily_model::tensor::Procedural;

use super::Kernel;
use crate::gpu::{Arg, Gpu};

/// x[t, :] = table[ids[t], :] widened to f32 for `t` tokens (`embed_kernel`).
/// `table` [V, d] bf16, `ids` [t] i32 on the device (a decode step's id is
/// the previous step's choice, which the host never sees), `x` [t, d] f32.
pub fn embed(gpu: &Gpu, table: u64, ids: u64, x: u64, t: usize, d: usize) -> Result<()> {
    if t == 0 || t > u32::MAX as usize || d == 0 || d > i32::MAX as usize {
        bail!("embed: {t} tokens of width {d}");
    }
    gpu.launch(
        Kernel::Embed,
        (t as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(table),
            Arg::Ptr(ids),
            Arg::Ptr(x),
            Arg::I32(d as i32),
        ],
    )
}

/// Values `start .. start + n` of the procedural stream `p` as bf16 at `out`
/// (`procedural_fill_kernel`), bit-identical to [`Procedural::value`]; with
/// `rows_of` = Some(cols), the row-scaled form of [`Procedural::value_rows`]
/// for rows of `cols` elements (`procedural_rows_fill_kernel`).
pub fn procedural_fill(
    gpu: &Gpu,
    out: u64,
    p: Procedural,
    start: usize,
    n: usize,
    rows_of: Option<usize>,
) -> Result<()> {
    let mut args = vec![
        Arg::Ptr(out),
        Arg::U64(n as u64),
        Arg::U64(start as u64),
        Arg::U64(p.seed),
        Arg::F32(p.mean),
        Arg::F32(p.std),
    ];
    let kernel = match rows_of {
        Some(0) => bail!("procedural fill: rows of 0 elements"),
        Some(cols) => {
            args.push(Arg::U64(cols as u64));
            Kernel::ProceduralRowsFill
        }
        None => Kernel::ProceduralFill,
    };
    // a grid-stride loop: any n
    gpu.launch(kernel, (1024, 1, 1), (256, 1, 1), 0, &args)
}
