//! Next-token selection on the GPU (kernels/sampling.cu): greedy or sampled
//! with temperature, top-k, top-p and min-p, so only the chosen id (4 bytes)
//! leaves the device. Semantics follow `lily_model::sampling` (the choice the
//! engine's sampler makes on the host). Penalties and logit bias
//! (`penalize`, `logit_bias`, with token counts kept on the device by
//! `penalty_feed`) and log-probabilities (`logprobs`) follow the engine's
//! `Sampler::penalized` and `Logprobs::of`.
//!
//! The random draw is a uniform `u` in [0, 1) from the caller's seeded
//! generator, so a run is repeatable: the kernels are deterministic (all
//! probability sums are 64-bit fixed point, order-free), the same logits,
//! parameters and `u` give the same id.
//!
//! `sample_kernel` runs as one block of 1024 threads. Usually (top_k <= 1024
//! with a window of at most 4096 tokens, or a peaked distribution) it sorts the
//! candidates exactly as the CPU sampler does and draws the same token for the
//! same `u`, up to rounding. When the candidate window is wider (top_k > 1024,
//! or no top-k over a flat distribution) it finds the thresholds by bisection
//! over the logits in global memory: a tie at a top-k or top-p threshold then
//! keeps every tied token, and the draw walks tokens in id order: the same
//! distribution, but not the CPU's token for a given `u`.

use anyhow::{bail, Result};

use super::gemv::gemv;
use super::Kernel;
use crate::gpu::{Arg, DevBuf, Gpu};

/// Threads of the one block both sampling kernels run as (sample_kernel
/// requires exactly this many).
pub const SAMPLE_THREADS: u32 = 1024;

/// The largest f32 below 1.
const ONE_BELOW: f32 = 1.0 - f32::EPSILON / 2.0;

/// Sampling settings as the kernels take them. `temperature == 0` (or
/// `top_k == 1`) is greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSampleParams {
    pub temperature: f32,
    /// 0 = off
    pub top_k: usize,
    /// in (0, 1]; 1 = off
    pub top_p: f32,
    /// in [0, 1]; 0 = off: drop tokens below `min_p * p(best)`
    pub min_p: f32,
}

impl GpuSampleParams {
    pub fn greedy() -> GpuSampleParams {
        GpuSampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        lily_model::sampling::is_greedy(self.temperature, self.top_k)
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        Ok(())
    }
}

/// A host uniform in [0, 1) (e.g. `Rng::uniform()`) as the f32 the kernel
/// takes, kept below 1 (a plain `as f32` can round up to 1.0).
pub fn uniform_f32(u: f64) -> f32 {
    below_one(u as f32)
}

/// `u` clamped into [0, 1) (0 for a NaN or an infinity).
fn below_one(u: f32) -> f32 {
    if u.is_finite() {
        u.clamp(0.0, ONE_BELOW)
    } else {
        0.0
    }
}

/// Launch argmax (`temperature == 0` or `top_k == 1`) or `sample_kernel` on
/// the GPU's stream over `logits` (device f32 [>= valid]; ids >= `valid` are
/// padding and ignored); writes the chosen id to `out` (device pointer to one
/// i32). No sync, no copy. `u` is a uniform in [0, 1) (clamped into it).
pub fn sample_into(
    gpu: &Gpu,
    logits: u64,
    valid: usize,
    p: &GpuSampleParams,
    u: f32,
    out: u64,
) -> Result<()> {
    p.validate()?;
    if valid == 0 || valid > (i32::MAX / 2) as usize {
        bail!("sampling over {valid} logits: must be in 1..=2^30");
    }
    let block = (SAMPLE_THREADS, 1, 1);
    if p.is_greedy() {
        return gpu.launch(
            Kernel::Argmax,
            (1, 1, 1),
            block,
            0,
            &[Arg::Ptr(logits), Arg::I32(valid as i32), Arg::Ptr(out)],
        );
    }
    let u = below_one(u);
    gpu.launch(
        Kernel::Sample,
        (1, 1, 1),
        block,
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(valid as i32),
            Arg::F32(p.temperature),
            Arg::I32(p.top_k.min(i32::MAX as usize) as i32),
            Arg::F32(p.top_p),
            Arg::F32(p.min_p),
            Arg::F32(u),
            Arg::Ptr(out),
        ],
    )
}

/// The decode step's lm_head and its greedy choice: `y[n] = W[n, k] x`
/// (bf16 W and x, f32 y; `gemv`), then the largest of `y[..*valid]`
/// (lowest id on a tie, NaN never) folded into the u64 at `best`
/// (`argmax_blocks_kernel`, one block per 256 x 4 logits up to 264 blocks),
/// which must hold 0 before (`greedy_finish` clears it). `valid` is a device
/// i32 the host sets (no kernel of the step writes it), at most n.
#[allow(clippy::too_many_arguments)]
pub fn greedy_lm_head(
    gpu: &Gpu,
    w: &DevBuf,
    x: u64,
    y: u64,
    n: usize,
    k: usize,
    valid: u64,
    best: u64,
) -> Result<()> {
    if !y.is_multiple_of(16) {
        bail!("greedy lm_head: the logits must be 16-byte aligned");
    }
    gemv(gpu, w, x, y, n, k)?;
    gpu.launch(
        Kernel::ArgmaxBlocks,
        (n.div_ceil(1024).min(264) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(y), Arg::Ptr(valid), Arg::Ptr(best)],
    )
}

/// After `greedy_lm_head` (`argmax_finish_kernel`): the chosen id into
/// `next[0]` and, when `host` is non-zero (mapped host memory, two i32), into
/// `host[p & 1]` for the step at position p = `pos[0]`; the position advanced
/// to at most `max_pos`; `best` cleared, and the u32 at `clear` when non-zero
/// (the screened lm_head's threshold).
pub fn greedy_finish(
    gpu: &Gpu,
    best: u64,
    next: u64,
    pos: u64,
    max_pos: usize,
    host: u64,
    clear: u64,
) -> Result<()> {
    gpu.launch(
        Kernel::ArgmaxFinish,
        (1, 1, 1),
        (32, 1, 1),
        0,
        &[
            Arg::Ptr(best),
            Arg::Ptr(next),
            Arg::Ptr(pos),
            Arg::I32(max_pos.min(i32::MAX as usize) as i32),
            Arg::Ptr(host),
            Arg::Ptr(clear),
        ],
    )
}

/// Most alternatives `logprobs_finish` reports (OpenAI's `top_logprobs` limit).
pub const LOGPROBS_MAX_N: usize = 20;
/// Ids a `logprobs_partial_kernel` block takes (LP_THREADS x LP_PER).
const LOGPROBS_CHUNK: usize = 256 * 8;
/// Candidates `logprobs_finish_kernel` can hold (LP_THREADS x LP_FIN_PER).
const LOGPROBS_FIN_CAP: usize = 256 * 10;

/// Blocks `logprobs_partial` runs over `valid` logits.
pub fn logprobs_blocks(valid: usize) -> usize {
    valid.div_ceil(LOGPROBS_CHUNK).max(1)
}

/// Bytes of `logprobs_partial`'s scratch for `valid` logits and `n` alternatives.
pub fn logprobs_scratch_bytes(valid: usize, n: usize) -> usize {
    logprobs_blocks(valid) * (2 + n) * 8
}

/// i32 slots `logprobs_finish` writes: the id, its logprob, then (id, logprob) x n.
pub fn logprobs_out_len(n: usize) -> usize {
    2 + 2 * n
}

/// A generated token is fed: its count and its `seen` bit (device u32 [valid]
/// and u32 [valid / 32 rounded up]).
pub fn penalty_feed(gpu: &Gpu, token: u32, valid: usize, counts: u64, seen: u64) -> Result<()> {
    gpu.launch(
        Kernel::PenaltyFeed,
        (1, 1, 1),
        (32, 1, 1),
        0,
        &[
            Arg::I32(token.min(i32::MAX as u32) as i32),
            Arg::I32(valid as i32),
            Arg::Ptr(counts),
            Arg::Ptr(seen),
        ],
    )
}

/// `logits[i] += bias[i]` over `valid` ids, in place (dense f32 bias).
pub fn logit_bias(gpu: &Gpu, logits: u64, valid: usize, bias: u64) -> Result<()> {
    gpu.launch(
        Kernel::LogitBias,
        (valid.div_ceil(256).min(1024) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(logits), Arg::I32(valid as i32), Arg::Ptr(bias)],
    )
}

/// The penalized `logits` into `out` over `valid` ids (the host sampler's
/// `Sampler::penalized`): repetition on the tokens in `seen`, then presence
/// and frequency by `counts`.
#[allow(clippy::too_many_arguments)]
pub fn penalize(
    gpu: &Gpu,
    logits: u64,
    valid: usize,
    counts: u64,
    seen: u64,
    presence: f32,
    frequency: f32,
    repetition: f32,
    out: u64,
) -> Result<()> {
    gpu.launch(
        Kernel::Penalize,
        (valid.div_ceil(256).min(1024) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(valid as i32),
            Arg::Ptr(counts),
            Arg::Ptr(seen),
            Arg::F32(presence),
            Arg::F32(frequency),
            Arg::F32(repetition),
            Arg::Ptr(out),
        ],
    )
}

/// Log-probabilities of the choice in `next[0]` and the `n` most likely ids
/// over `logits[..valid]` (`Logprobs::of` in lily-engine), into `out`
/// (`logprobs_out_len(n)` i32: see `logprobs_finish_kernel`), with `part`
/// (`logprobs_scratch_bytes`) as scratch. Launch after the choice.
pub fn logprobs(
    gpu: &Gpu,
    logits: u64,
    valid: usize,
    n: usize,
    part: u64,
    next: u64,
    out: u64,
) -> Result<()> {
    if n > LOGPROBS_MAX_N {
        bail!("at most {LOGPROBS_MAX_N} top log-probabilities, got {n}");
    }
    if valid == 0 || valid > i32::MAX as usize {
        bail!("log-probabilities over {valid} logits");
    }
    let blocks = logprobs_blocks(valid);
    if blocks * n > LOGPROBS_FIN_CAP {
        bail!("log-probabilities: {blocks} blocks x {n} candidates exceed {LOGPROBS_FIN_CAP}");
    }
    gpu.launch(
        Kernel::LogprobsPartial,
        (blocks as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(valid as i32),
            Arg::I32(LOGPROBS_CHUNK as i32),
            Arg::I32(n as i32),
            Arg::Ptr(part),
        ],
    )?;
    gpu.launch(
        Kernel::LogprobsFinish,
        (1, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(logits),
            Arg::I32(valid as i32),
            Arg::Ptr(part),
            Arg::I32(blocks as i32),
            Arg::I32(n as i32),
            Arg::Ptr(next),
            Arg::Ptr(out),
        ],
    )
}

/// `logprobs`' output as (the chosen id, its logprob, the alternatives).
pub fn logprobs_decode(out: &[i32], n: usize) -> (u32, f32, Vec<(u32, f32)>) {
    let f = |i: usize| f32::from_bits(out[i] as u32);
    let top = (0..n)
        .filter(|&j| out[2 + 2 * j] >= 0)
        .map(|j| (out[2 + 2 * j] as u32, f(3 + 2 * j)))
        .collect();
    (out[0] as u32, f(1), top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_stays_below_one() {
        assert!(uniform_f32(0.999_999_999_9) < 1.0);
        assert_eq!(uniform_f32(0.0), 0.0);
        assert_eq!(uniform_f32(f64::NAN), 0.0);
        assert_eq!(uniform_f32(0.5), 0.5);
    }

    #[test]
    fn params_are_checked() {
        assert!(GpuSampleParams::greedy().validate().is_ok());
        let ok = GpuSampleParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.05,
        };
        assert!(ok.validate().is_ok());
        assert!(GpuSampleParams {
            temperature: -1.0,
            ..ok
        }
        .validate()
        .is_err());
        assert!(GpuSampleParams {
            temperature: f32::NAN,
            ..ok
        }
        .validate()
        .is_err());
        assert!(GpuSampleParams { top_p: 0.0, ..ok }.validate().is_err());
        assert!(GpuSampleParams { min_p: 1.5, ..ok }.validate().is_err());
        assert!(GpuSampleParams { top_k: 1, ..ok }.is_greedy());
    }
}
