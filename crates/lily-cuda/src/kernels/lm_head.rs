//! The greedy decode step's lm_head screened through an int8 copy of its
//! weights (kernels/lm_head.cu): every row's logit is bounded from the copy
//! (half the bf16 head's bytes), and only the rows that can hold the
//! largest logit are computed exactly, in the full product's own order. The
//! chosen id is the full product's argmax, bit for bit; the logits are not
//! produced, so only greedy steps that return nothing but the id use it.

use anyhow::{bail, Result};
use lily_model::Config;

use super::Kernel;
use crate::gpu::{Arg, DevBuf, Gpu};

/// The hidden size the screen kernels are written for (the released model's).
pub const SCREEN_HIDDEN: usize = 2048;
/// Rows a screen block covers (8 warps x HEAD_SCREEN_ROWS) and a pick block scans.
const SCREEN_BLOCK_ROWS: usize = 16;
const PICK_TILE: usize = 1024;

/// The bf16 head the screen reads: [v, SCREEN_HIDDEN].
fn check_head(w: &DevBuf, v: usize) -> Result<()> {
    if w.bytes < v * SCREEN_HIDDEN * 2 {
        bail!(
            "lm_head screen: a head of {} bytes for {v} rows of {SCREEN_HIDDEN} bf16",
            w.bytes
        );
    }
    Ok(())
}

/// The int8 copy of a [V, SCREEN_HIDDEN] bf16 head and the screen's scratch.
pub struct HeadScreen {
    q: DevBuf,
    scale: DevBuf,
    err: DevBuf,
    hi: DevBuf,
    lo: DevBuf,
    v: usize,
}

impl HeadScreen {
    /// Whether a model of `cfg` gets the screen when asked for (`on`:
    /// `GreedyHead::Screen`): the kernels are written for the released hidden size.
    pub fn applies(cfg: &Config, on: bool) -> bool {
        on && cfg.hidden_size == SCREEN_HIDDEN
    }

    /// Device bytes for `cfg`'s vocabulary: the int8 copy, the per-row scale
    /// and bound, and the scratch (hi [V] f32, the threshold); 0 where the
    /// screen does not apply.
    pub fn bytes_for(cfg: &Config, on: bool) -> usize {
        let v = cfg.vocab_size;
        if Self::applies(cfg, on) {
            v * SCREEN_HIDDEN + 3 * v * 4 + 16
        } else {
            0
        }
    }

    /// Quantize the bf16 head `w` [v, SCREEN_HIDDEN] (head_quantize_kernel, once).
    pub fn build(gpu: &Gpu, w: &DevBuf, v: usize) -> Result<HeadScreen> {
        if v == 0 || v > i32::MAX as usize / 2 {
            bail!("lm_head screen: {v} rows");
        }
        check_head(w, v)?;
        let hs = HeadScreen {
            q: gpu.alloc(v * SCREEN_HIDDEN)?,
            scale: gpu.alloc(v * 4)?,
            err: gpu.alloc(v * 4)?,
            hi: gpu.alloc(v * 4)?,
            lo: gpu.alloc(16)?,
            v,
        };
        gpu.zero(hs.lo.ptr, 16)?;
        gpu.launch(
            Kernel::HeadQuantize,
            (v.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(w.ptr),
                Arg::I32(v as i32),
                Arg::I32(SCREEN_HIDDEN as i32),
                Arg::Ptr(hs.q.ptr),
                Arg::Ptr(hs.scale.ptr),
                Arg::Ptr(hs.err.ptr),
            ],
        )?;
        gpu.sync()?;
        Ok(hs)
    }

    /// The greedy choice among ids below `valid[0]` (device i32) for the
    /// bf16 input `x` [SCREEN_HIDDEN], folded into `best` (argmax_entry form,
    /// 0 before) as `greedy_lm_head` does; `greedy_finish` with `clear` =
    /// `self.threshold()` then takes it. `w` is the bf16 head the copy was built from.
    pub fn launch(&self, gpu: &Gpu, w: &DevBuf, x: u64, valid: u64, best: u64) -> Result<()> {
        check_head(w, self.v)?;
        gpu.launch(
            Kernel::HeadScreen,
            (self.v.div_ceil(SCREEN_BLOCK_ROWS) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.q.ptr),
                Arg::Ptr(self.scale.ptr),
                Arg::Ptr(self.err.ptr),
                Arg::Ptr(x),
                Arg::I32(self.v as i32),
                Arg::Ptr(valid),
                Arg::Ptr(self.hi.ptr),
                Arg::Ptr(self.lo.ptr),
            ],
        )?;
        gpu.launch(
            Kernel::HeadPick,
            (self.v.div_ceil(PICK_TILE) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.hi.ptr),
                Arg::Ptr(self.lo.ptr),
                Arg::Ptr(valid),
                Arg::Ptr(w.ptr),
                Arg::Ptr(x),
                Arg::I32(self.v as i32),
                Arg::Ptr(best),
            ],
        )
    }

    /// The screen's output hi [V] f32 (each row's upper bound; tests).
    pub fn hi_ptr(&self) -> u64 {
        self.hi.ptr
    }

    /// The screen's threshold, which `argmax_finish_kernel` clears each step.
    pub fn threshold(&self) -> u64 {
        self.lo.ptr
    }

    /// Bytes one screened step must move: the int8 copy, its scale and bound,
    /// hi written and read back.
    pub fn step_bytes(&self) -> u64 {
        (self.v * SCREEN_HIDDEN + 4 * self.v * 4) as u64
    }
}
