//! A token chosen on the device with everything a request may set: sampling,
//! logit bias, presence / frequency / repetition penalties, and
//! log-probabilities, so only the choice and the numbers asked for come back
//! to the host (a few bytes, not the 1 MB of logits).
//!
//! A request's penalty state lives with its sequence state: the counts of the
//! tokens it generated, a bitset of the tokens the repetition penalty covers
//! (prompt and generated), and its bias as a dense row. The caller loads it
//! from its host sampler once (`load_penalties`, tagged with the request and
//! how many tokens that sampler has counted) and then only says which
//! generated token each step feeds (`penalty_feed`, one thread). A step taken
//! elsewhere (on the host) leaves the tag behind, and the caller loads again.
//!
//! Per step, on the logits of the fed token's step: the bias is added in
//! place (log-probabilities are reported from these logits, before the
//! penalties, as the host sampler does), the penalties write `s.pen`, the
//! sampler or argmax chooses from that, and the log-probabilities of the
//! choice and of the most likely ids follow.

use std::sync::atomic::Ordering;

use anyhow::{bail, Result};

use super::{CudaModel, CudaState};
use crate::gpu::DevBuf;
use crate::kernels::sampling::{
    logit_bias, logprobs, logprobs_decode, logprobs_out_len, penalize, penalty_feed, sample_into,
    GpuSampleParams, LOGPROBS_MAX_N,
};

/// A request's penalties and bias (the host sampler's settings).
#[derive(Clone, Copy, Debug)]
pub struct Penalties<'a> {
    pub presence: f32,
    pub frequency: f32,
    /// 1 = off
    pub repetition: f32,
    pub bias: &'a [(u32, f32)],
}

impl Penalties<'_> {
    /// Whether any penalty changes a logit (the bias aside).
    fn penalizes(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

/// How one step chooses.
#[derive(Clone, Copy, Debug)]
pub struct DeviceChoice<'a> {
    /// ids below this are real tokens
    pub valid: usize,
    pub params: GpuSampleParams,
    /// the draw of a sampled choice, in [0, 1)
    pub u: f32,
    /// set when the request has penalties or a bias: its state must be loaded
    pub penalties: Option<Penalties<'a>>,
    /// report log-probabilities with this many alternatives
    pub logprobs: Option<usize>,
}

/// A step's choice, with its log-probability and the most likely ids' when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub id: u32,
    pub logprobs: Option<(f32, Vec<(u32, f32)>)>,
}

/// The device side of a request's penalties (see the module docs).
pub(super) struct ChoiceState {
    counts: DevBuf, // [V] u32 generated-token counts
    seen: DevBuf,   // [V / 32] u32 repetition-penalty bitset
    bias: DevBuf,   // [V] f32
    has_bias: bool,
    /// (the caller's request, tokens its sampler had counted) when loaded,
    /// advanced by each `penalty_feed`
    tag: Option<(u64, usize)>,
}

impl CudaModel {
    /// What `st`'s penalty state holds: the tag of its last load, advanced by
    /// every fed token since (None: never loaded).
    pub fn penalties_tag(&self, st: &CudaState) -> Option<(u64, usize)> {
        st.choice.as_ref().and_then(|c| c.tag)
    }

    /// Load a request's penalty state into `st`: the tokens the repetition
    /// penalty covers, the counts of generated tokens, the bias; tagged `tag`.
    pub fn load_penalties(
        &self,
        st: &mut CudaState,
        tag: (u64, usize),
        seen: &[u32],
        counts: &[(u32, u32)],
        bias: &[(u32, f32)],
    ) -> Result<()> {
        let v = self.cfg.vocab_size;
        if st.choice.is_none() {
            st.choice = Some(ChoiceState {
                counts: self.gpu.alloc(v * 4)?,
                seen: self.gpu.alloc(v.div_ceil(32) * 4)?,
                bias: self.gpu.alloc(v * 4)?,
                has_bias: false,
                tag: None,
            });
        }
        let c = st.choice.as_mut().expect("allocated above");
        let mut dense = vec![0u32; v];
        for &(t, n) in counts {
            if let Some(x) = dense.get_mut(t as usize) {
                *x = n;
            }
        }
        self.gpu.upload(c.counts.ptr, &dense)?;
        let mut bits = vec![0u32; v.div_ceil(32)];
        for &t in seen {
            if (t as usize) < v {
                bits[t as usize / 32] |= 1 << (t % 32);
            }
        }
        self.gpu.upload(c.seen.ptr, &bits)?;
        c.has_bias = !bias.is_empty();
        if c.has_bias {
            let mut row = vec![0f32; v];
            for &(t, b) in bias {
                if let Some(x) = row.get_mut(t as usize) {
                    *x += b;
                }
            }
            self.gpu.upload(c.bias.ptr, &row)?;
        }
        c.tag = Some(tag);
        Ok(())
    }

    /// Prefill `tokens`, then choose the next token on the device as `d` says.
    pub fn prefill_choose(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        d: &DeviceChoice,
    ) -> Result<Choice> {
        self.check_choice(st, d)?;
        let mut last = 0;
        self.run_chunks(st, tokens, &mut |n| {
            last = n;
            Ok(())
        })?;
        self.head(last.max(1) - 1, 1, self.s.logits.ptr)?;
        let c = self.choose(st, d)?;
        self.next_owner.store(st.id, Ordering::Relaxed);
        Ok(c)
    }

    /// Feed `token`, then choose the next one on the device as `d` says.
    /// `generated`: `token` is a generated token the penalties count (it is
    /// counted on the device, and the state's tag advances).
    pub fn decode_choose(
        &self,
        st: &mut CudaState,
        token: u32,
        generated: bool,
        d: &DeviceChoice,
    ) -> Result<Choice> {
        // bad input is refused before the state moves
        self.check(st, &[token])?;
        self.check_choice(st, d)?;
        if generated && d.penalties.is_some() {
            let c = st.choice.as_mut().expect("checked: loaded");
            penalty_feed(
                &self.gpu,
                token,
                self.cfg.vocab_size,
                c.counts.ptr,
                c.seen.ptr,
            )?;
            if let Some(t) = c.tag.as_mut() {
                t.1 += 1;
            }
        }
        self.gpu.upload(self.s.next.ptr, &[token as i32])?;
        // the full logits (no screened greedy step: they are changed or reported)
        let valid = d.valid.min(self.cfg.vocab_size);
        let plain = d.penalties.is_none() && d.logprobs.is_none();
        self.decode_step(st, valid, plain && d.params.is_greedy())?;
        if plain && d.params.is_greedy() {
            let id = self.gpu.download::<i32>(self.s.next.ptr, 1)?[0] as u32;
            st.last = Some(id);
            return Ok(Choice { id, logprobs: None });
        }
        self.choose(st, d)
    }

    fn check_choice(&self, st: &CudaState, d: &DeviceChoice) -> Result<()> {
        d.params.validate()?;
        if d.valid == 0 {
            bail!("choosing among 0 tokens");
        }
        if let Some(n) = d.logprobs {
            if n > LOGPROBS_MAX_N {
                bail!("at most {LOGPROBS_MAX_N} top log-probabilities, got {n}");
            }
        }
        if d.penalties.is_some() && self.penalties_tag(st).is_none() {
            bail!("penalties on the device: load the request's penalty state first");
        }
        Ok(())
    }

    /// The choice from `s.logits` (the last step's), as `d` says; only the
    /// id and the log-probabilities asked for come back.
    fn choose(&self, st: &mut CudaState, d: &DeviceChoice) -> Result<Choice> {
        let s = &self.s;
        let valid = d.valid.min(self.cfg.vocab_size);
        let mut from = s.logits.ptr;
        if let Some(p) = d.penalties {
            let c = st.choice.as_ref().expect("checked: loaded");
            if c.has_bias {
                logit_bias(&self.gpu, s.logits.ptr, valid, c.bias.ptr)?;
            }
            if p.penalizes() {
                penalize(
                    &self.gpu,
                    s.logits.ptr,
                    valid,
                    c.counts.ptr,
                    c.seen.ptr,
                    p.presence,
                    p.frequency,
                    p.repetition,
                    s.pen.ptr,
                )?;
                from = s.pen.ptr;
            }
        }
        sample_into(&self.gpu, from, valid, &d.params, d.u, s.next.ptr)?;
        let choice = match d.logprobs {
            Some(n) => {
                logprobs(
                    &self.gpu,
                    s.logits.ptr,
                    valid,
                    n,
                    s.lp_part.ptr,
                    s.next.ptr,
                    s.lp_out.ptr,
                )?;
                let out = self
                    .gpu
                    .download::<i32>(s.lp_out.ptr, logprobs_out_len(n))?;
                let (id, lp, top) = logprobs_decode(&out, n);
                Choice {
                    id,
                    logprobs: Some((lp, top)),
                }
            }
            None => Choice {
                id: self.gpu.download::<i32>(s.next.ptr, 1)?[0] as u32,
                logprobs: None,
            },
        };
        st.last = Some(choice.id);
        Ok(choice)
    }
}
