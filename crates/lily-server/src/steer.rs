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

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Result;
use lily_engine::generate::Model;

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
    /// OpenAI `logit_bias`: added to the model's logits at every free step.
    pub bias: Vec<(u32, f32)>,
    /// Test hook: sleep this long before each step (a slow model).
    pub delay: Duration,
}

pub struct Steered<'a, M: Model> {
    pub inner: &'a M,
    pub plan: &'a Steering,
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
    fn steer(&self, st: &mut SteerState<M::State>, mut logits: Vec<f32>) -> Vec<f32> {
        let forced = match &self.plan.script {
            Some(script) => script.get(st.generated).copied().or_else(|| self.plan.eos.first().copied()),
            None => st.queue.front().copied(),
        };
        if let Some(t) = forced {
            if (t as usize) < logits.len() {
                logits.fill(f32::NEG_INFINITY);
                logits[t as usize] = 0.0;
            }
            return logits;
        }
        for &(t, b) in &self.plan.bias {
            if let Some(x) = logits.get_mut(t as usize) {
                *x += b;
            }
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

    fn start_answer(&self, st: &mut SteerState<M::State>) {
        if st.owed {
            if let Some(p) = &self.plan.answer_prefix {
                st.queue.extend(p.iter().copied());
            }
            st.owed = false;
        }
    }
}

impl<M: Model> Model for Steered<'_, M> {
    type State = SteerState<M::State>;

    fn new_state(&self) -> Self::State {
        SteerState {
            inner: self.inner.new_state(),
            generated: 0,
            in_reasoning: self.plan.in_reasoning,
            owed: self.plan.answer_prefix.is_some(),
            queue: VecDeque::new(),
        }
    }

    fn prefill(&self, tokens: &[u32], st: &mut Self::State) -> Result<Vec<f32>> {
        if !self.plan.delay.is_zero() {
            std::thread::sleep(self.plan.delay);
        }
        let logits = self.inner.prefill(tokens, &mut st.inner)?;
        if !st.in_reasoning {
            self.start_answer(st);
        }
        Ok(self.steer(st, logits))
    }

    fn decode(&self, token: u32, st: &mut Self::State) -> Result<Vec<f32>> {
        if !self.plan.delay.is_zero() {
            std::thread::sleep(self.plan.delay);
        }
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
        let logits = self.inner.decode(token, &mut st.inner)?;
        Ok(self.steer(st, logits))
    }

    fn position(&self, st: &Self::State) -> usize {
        self.inner.position(&st.inner)
    }
}
