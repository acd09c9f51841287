//! Steering a model's output by forcing tokens: a [`Model`] wrapper that
//! replaces the logits of some steps with a one-hot of the token it wants.
//!
//! Two users:
//! - `tool_choice` `required` or a named function: when the answer starts (at
//!   once when thinking is off, right after `</think>` when it is on) the
//!   tokens of `<tool_call>\n<function=NAME>\n` (named) or
//!   `<tool_call>\n<function=` (required) are forced, and until then the
//!   end-of-sequence ids are banned, so the model cannot end without calling.
//!   What follows (the parameters) is the model's own. This is a forced prefix,
//!   not grammar-constrained decoding: a model that then writes a malformed
//!   call gets its text back as content.
//! - the test hook (`lily serve --test-hooks`, request field
//!   `lily_test_script`): the whole output is forced, then an end-of-sequence
//!   id. The real model still runs every step (so timing, memory and
//!   cancellation behave as in a real request); only its choice is replaced.
//!   Test-only: it exists so that client tests can drive tool calls and
//!   reasoning end to end with a model whose weights are random.
//!
//! On the pick path (`Model::prefill_pick` / `decode_pick`: the backend
//! chooses the token, on the GPU only the id comes back) a free step keeps the
//! backend's choice and a forced step replaces it (the model still runs); a
//! step whose logits must change (end-of-sequence ids banned)
//! brings the logits to the host and samples them there.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Result;
use lily_engine::generate::{Model, Picked};
use lily_engine::sampling::{Logprobs, Sampler};

#[derive(Clone, Debug, Default)]
pub struct Steering {
    /// Test hook: the whole output, then `eos[0]`.
    pub script: Option<Vec<u32>>,
    /// Tokens forced at the start of the answer.
    pub answer_prefix: Option<Vec<u32>>,
    /// The prompt ends inside `<think>`: the answer starts after `think_end`.
    pub in_reasoning: bool,
    pub think_end: Option<u32>,
    /// `<tool_call>`: a call the model opens itself settles what is owed.
    pub tool_call_open: Option<u32>,
    pub eos: Vec<u32>,
    /// Test hook: sleep this long before each step (a slow model).
    pub delay: Duration,
}

pub struct Steered<'a, M: Model> {
    pub inner: &'a M,
    pub plan: &'a Steering,
}

/// A step of the pick path (see [`Model::prefill_pick`]).
enum Pick {
    /// The model's own choice, made where the model makes it.
    Own,
    /// This token; the model still runs (and takes its draw), its choice is dropped.
    Forced(u32),
    /// The logits must be changed first (banned end-of-sequence
    /// ids, a forced id outside the real tokens): host logits and sampler.
    Logits,
}

pub struct SteerState<S> {
    inner: S,
    generated: usize,
    in_reasoning: bool,
    /// The answer prefix is still to be forced.
    owed: bool,
    queue: VecDeque<u32>,
}

impl<M: Model> Steered<'_, M> {
    /// The token this step is forced to, if any.
    fn forced(&self, st: &SteerState<M::State>) -> Option<u32> {
        match &self.plan.script {
            Some(script) => script
                .get(st.generated)
                .copied()
                .or_else(|| self.plan.eos.first().copied()),
            None => st.queue.front().copied(),
        }
    }

    fn steer(&self, st: &mut SteerState<M::State>, mut logits: Vec<f32>) -> Vec<f32> {
        if let Some(t) = self.forced(st) {
            if (t as usize) < logits.len() {
                logits.fill(f32::NEG_INFINITY);
                logits[t as usize] = 0.0;
            }
            return logits;
        }
        if st.owed {
            for &e in &self.plan.eos {
                if let Some(x) = logits.get_mut(e as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        logits
    }

    /// How this step's token can be chosen once the model has run.
    fn pick_plan(&self, st: &SteerState<M::State>, sampler: &Sampler) -> Pick {
        match self.forced(st) {
            Some(t) if (t as usize) < sampler.valid_vocab() => Pick::Forced(t),
            Some(_) => Pick::Logits,
            None if !st.owed => Pick::Own,
            None => Pick::Logits,
        }
    }

    /// Run the model's step (`logits` or `pick`, as the plan allows) and
    /// choose; a forced step's log-probabilities are those of logits that
    /// allow only its token (what the host path reports).
    fn pick(
        &self,
        st: &mut SteerState<M::State>,
        sampler: &mut Sampler,
        lp: Option<usize>,
        logits: impl FnOnce(&M, &mut M::State) -> Result<Vec<f32>>,
        pick: impl FnOnce(&M, &mut M::State, &mut Sampler, Option<usize>) -> Result<Picked>,
    ) -> Result<Picked> {
        match self.pick_plan(st, sampler) {
            Pick::Own => pick(self.inner, &mut st.inner, sampler, lp),
            Pick::Forced(t) => {
                pick(self.inner, &mut st.inner, sampler, None)?;
                Ok(Picked {
                    id: t,
                    logprobs: lp.map(|n| Logprobs::forced(t, sampler.valid_vocab(), n)),
                })
            }
            Pick::Logits => {
                let l = logits(self.inner, &mut st.inner)?;
                Ok(Picked::on_host(&self.steer(st, l), sampler, lp))
            }
        }
    }

    fn fresh(&self, inner: M::State) -> SteerState<M::State> {
        SteerState {
            inner,
            generated: 0,
            in_reasoning: self.plan.in_reasoning,
            owed: self.plan.answer_prefix.is_some(),
            queue: VecDeque::new(),
        }
    }

    /// This plan's bookkeeping from its start, for a state that held another sequence.
    fn restart(&self, st: &mut SteerState<M::State>) {
        st.generated = 0;
        st.in_reasoning = self.plan.in_reasoning;
        st.owed = self.plan.answer_prefix.is_some();
        st.queue.clear();
    }

    fn start_answer(&self, st: &mut SteerState<M::State>) {
        if st.owed {
            if let Some(p) = &self.plan.answer_prefix {
                st.queue.extend(p.iter().copied());
            }
            st.owed = false;
        }
    }

    fn wait(&self) {
        if !self.plan.delay.is_zero() {
            std::thread::sleep(self.plan.delay);
        }
    }

    /// What feeding `token` changes in the plan (before the model runs).
    fn advance(&self, token: u32, st: &mut SteerState<M::State>) {
        st.generated += 1;
        if st.queue.front() == Some(&token) {
            st.queue.pop_front();
        }
        if Some(token) == self.plan.tool_call_open && st.queue.is_empty() {
            st.owed = false; // the model opened a call itself
        }
        if st.in_reasoning && Some(token) == self.plan.think_end {
            st.in_reasoning = false;
            self.start_answer(st);
        }
    }
}

impl<M: Model> Model for Steered<'_, M> {
    type State = SteerState<M::State>;

    fn new_state(&self) -> Result<Self::State> {
        Ok(self.fresh(self.inner.new_state()?))
    }

    fn prefill(&self, tokens: &[u32], st: &mut Self::State) -> Result<Vec<f32>> {
        self.wait();
        let logits = self.inner.prefill(tokens, &mut st.inner)?;
        if !st.in_reasoning {
            self.start_answer(st);
        }
        Ok(self.steer(st, logits))
    }

    fn decode(&self, token: u32, st: &mut Self::State) -> Result<Vec<f32>> {
        self.wait();
        self.advance(token, st);
        let logits = self.inner.decode(token, &mut st.inner)?;
        Ok(self.steer(st, logits))
    }

    fn position(&self, st: &Self::State) -> usize {
        self.inner.position(&st.inner)
    }

    /// The plan's bookkeeping starts again with the sequence (a pooled state
    /// comes from another request, with another plan).
    fn reset(&self, st: &mut Self::State) -> Result<()> {
        self.inner.reset(&mut st.inner)?;
        self.restart(st);
        Ok(())
    }

    /// Steering changes only which tokens are chosen, never how the model
    /// computes, so the model's own snapshot is the whole of it.
    type Snapshot = M::Snapshot;
    fn snapshot(&self, st: &Self::State) -> Result<M::Snapshot> {
        self.inner.snapshot(&st.inner)
    }
    fn restore(&self, snap: &M::Snapshot, st: &mut Self::State) -> Result<()> {
        self.inner.restore(snap, &mut st.inner)?;
        self.restart(st);
        Ok(())
    }
    fn snapshot_bytes(&self, snap: &M::Snapshot) -> usize {
        self.inner.snapshot_bytes(snap)
    }

    /// A free step (nothing banned) is the inner model's own choice,
    /// made where it makes it (on the GPU); a forced step still runs the model
    /// (and takes the draw a sampled step takes) and replaces its choice.
    fn prefill_pick(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        sampler: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        self.wait();
        if !st.in_reasoning {
            self.start_answer(st);
        }
        self.pick(
            st,
            sampler,
            lp,
            |inner, s| inner.prefill(tokens, s),
            |inner, s, sampler, lp| inner.prefill_pick(tokens, s, sampler, lp),
        )
    }

    fn decode_pick(
        &self,
        token: u32,
        st: &mut Self::State,
        sampler: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        self.wait();
        self.advance(token, st);
        self.pick(
            st,
            sampler,
            lp,
            |inner, s| inner.decode(token, s),
            |inner, s, sampler, lp| inner.decode_pick(token, s, sampler, lp),
        )
    }
}
