//! The decode step and the token choice: one step captured in a CUDA graph
//! and replayed, greedy runs with the next step queued before the current
//! token reaches the host, and sampled choices made on the device.

use std::sync::atomic::Ordering;

use anyhow::{bail, Context, Result};

use super::{CudaModel, CudaState};
use crate::kernels::sampling::{sample_into, GpuSampleParams};

/// A captured decode step. The graph refers to this state's buffers and the
/// model's scratch; it is only launched from the thread that owns the state.
pub(super) struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: a CUgraphExec may be launched from any thread as long as calls on it
// are serialised, which `&mut CudaState` guarantees.
unsafe impl Send for StepGraph {}

impl CudaModel {
    /// `set_pos` unless the device already holds `pos` (the previous decode
    /// step advanced it there).
    fn ensure_pos(&self, pos: usize) -> Result<()> {
        if self.dev_pos.load(Ordering::Relaxed) != pos as i64 {
            self.set_pos(pos)?;
        }
        Ok(())
    }

    /// One decode step of the token in `s.next[0]` at position `st.pos`: every
    /// layer and the lm_head, logits into `s.logits`, the greedy choice among
    /// ids below `valid` into `s.next` and `s.pos` advanced, all on the device.
    /// Replays the state's captured graph (capturing it the first time).
    pub(super) fn decode_step(
        &self,
        st: &mut CudaState,
        valid: usize,
        greedy_only: bool,
    ) -> Result<()> {
        if st.pos + 1 > self.opts.max_seq {
            bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
        }
        let s = &self.s;
        self.ensure_pos(st.pos)?;
        if self.dev_valid.load(Ordering::Relaxed) != valid as i64 {
            self.gpu.upload(s.valid.ptr, &[valid as i32])?;
            self.dev_valid.store(valid as i64, Ordering::Relaxed);
        }
        let screen = greedy_only && self.screen.is_some();
        if !self.opts.graphs {
            self.layers(st, 1, s.next.ptr)?;
            self.lm_head_decode(true, screen)?;
        } else {
            let i = screen as usize;
            if st.graphs[i].is_none() {
                st.graphs[i] = Some(StepGraph(self.capture_step(st, true, screen)?));
            }
            st.graphs[i]
                .as_ref()
                .unwrap()
                .0
                .launch()
                .map_err(|e| anyhow::anyhow!("launching the decode graph: {e:?}"))?;
        }
        st.pos += 1;
        self.next_owner.store(st.id, Ordering::Relaxed);
        // argmax_finish_kernel stops at max_seq - 1
        self.dev_pos
            .store(st.pos.min(self.opts.max_seq - 1) as i64, Ordering::Relaxed);
        Ok(())
    }

    /// Record one decode step into a graph (`advance`, `screen`: see `lm_head_decode`).
    pub(super) fn capture_step(
        &self,
        st: &mut CudaState,
        advance: bool,
        screen: bool,
    ) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = &self.gpu.stream;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow::anyhow!("starting the decode graph capture: {e:?}"))?;
        let recorded = self
            .prof
            .mark_start(stream)
            .and_then(|_| self.layers(st, 1, self.s.next.ptr))
            .and_then(|_| self.lm_head_decode(advance, screen));
        // end the capture even when recording failed, or the stream stays capturing
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded.context("recording the decode step")?;
        let graph = graph
            .map_err(|e| anyhow::anyhow!("instantiating the decode graph: {e:?}"))?
            .ok_or_else(|| anyhow::anyhow!("the decode graph capture recorded nothing"))?;
        graph
            .upload()
            .map_err(|e| anyhow::anyhow!("uploading the decode graph: {e:?}"))?;
        Ok(graph)
    }

    /// Make `s.next` hold the token `st` feeds next: it does already when
    /// `st` wrote it last (its previous step or pick).
    fn feed_last(&self, st: &CudaState) -> Result<()> {
        if self.next_owner.load(Ordering::Relaxed) != st.id {
            let Some(t) = st.last else {
                bail!("greedy decode: this state has chosen no token yet (prefill it first)");
            };
            self.check(st, &[t])?;
            self.gpu.upload(self.s.next.ptr, &[t as i32])?;
        }
        Ok(())
    }

    /// Make `token` the one the next greedy step of `st` feeds: a no-op when
    /// it is the state's own last choice, still in `s.next`.
    pub fn set_next_token(&self, st: &mut CudaState, token: u32) -> Result<()> {
        if st.last == Some(token) && self.next_owner.load(Ordering::Relaxed) == st.id {
            return Ok(());
        }
        self.check(st, &[token])?;
        self.gpu.upload(self.s.next.ptr, &[token as i32])?;
        st.last = Some(token);
        self.next_owner.store(st.id, Ordering::Relaxed);
        Ok(())
    }

    /// Greedy decoding (among the ids below `valid`) of up to `n` tokens with
    /// the next step queued before the current token reaches the host: step
    /// k + 1 feeds choice k straight from device memory, and choice k comes
    /// back through mapped host memory while step k + 1 runs, so the GPU
    /// never idles for the host's round trip. `on_token` sees each choice in
    /// order and says whether to go on. After an early stop the step queued
    /// ahead has consumed that last choice as well (one step spent; the state
    /// is one position further and its pending choice is that step's).
    /// Returns how many tokens `on_token` saw.
    pub fn decode_greedy_run(
        &self,
        st: &mut CudaState,
        n: usize,
        valid: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        if valid == 0 {
            bail!("greedy decode over 0 ids");
        }
        self.feed_last(st)?;
        let v = valid.min(self.cfg.vocab_size);
        let ev = [self.gpu.event()?, self.gpu.event()?];
        let record = |i: usize| {
            ev[i % 2]
                .record(&self.gpu.stream)
                .map_err(|e| anyhow::anyhow!("recording an event: {e:?}"))
        };
        let wait = |i: usize| {
            ev[i % 2]
                .synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA error in a decode step: {e:?}"))
        };
        // q: the position of the oldest step in flight (its choice is in slot q & 1)
        let mut q = st.pos;
        self.decode_step(st, v, true)?;
        record(0)?;
        st.last = None;
        let mut seen = 0;
        loop {
            let ahead = seen + 1 < n && st.pos < self.opts.max_seq;
            if ahead {
                self.decode_step(st, v, true)?;
                record(seen + 1)?;
            }
            wait(seen)?;
            let id = self.s.host_next.get(q & 1) as u32;
            q += 1;
            seen += 1;
            let go = on_token(id)?;
            if ahead && go {
                continue;
            }
            if ahead {
                wait(seen)?;
                st.last = Some(self.s.host_next.get(q & 1) as u32);
            } else {
                st.last = Some(id);
                if go && seen < n {
                    bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
                }
            }
            return Ok(seen);
        }
    }

    /// Prefill, then the greedy choice for the next token (left in `s.next`).
    pub fn prefill_greedy(&self, st: &mut CudaState, tokens: &[u32]) -> Result<u32> {
        self.prefill_sample(
            st,
            tokens,
            self.cfg.vocab_size,
            &GpuSampleParams::greedy(),
            0.0,
        )
    }

    /// Prefill, then choose the next token on the device among the first
    /// `valid` ids (`u` uniform in [0, 1) drives a sampled choice).
    pub fn prefill_sample(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        valid: usize,
        p: &GpuSampleParams,
        u: f32,
    ) -> Result<u32> {
        let mut last = 0;
        self.run_chunks(st, tokens, &mut |n| {
            last = n;
            Ok(())
        })?;
        let id = self.pick_row(last.max(1) - 1, valid, p, u)?;
        st.last = Some(id);
        self.next_owner.store(st.id, Ordering::Relaxed);
        Ok(id)
    }

    /// Feed `token`, then choose the next one on the device; only its id
    /// comes back to the host.
    pub fn decode_sample(
        &self,
        st: &mut CudaState,
        token: u32,
        valid: usize,
        p: &GpuSampleParams,
        u: f32,
    ) -> Result<u32> {
        // bad input is refused before the state moves
        self.check(st, &[token])?;
        p.validate()?;
        if valid == 0 {
            bail!("sampling over 0 logits");
        }
        self.gpu.upload(self.s.next.ptr, &[token as i32])?;
        let valid = valid.min(self.cfg.vocab_size);
        // a greedy choice needs no logits: the screened step
        self.decode_step(st, valid, p.is_greedy())?;
        // the step's own greedy choice (over the same ids), or a draw, both
        // left in s.next
        let id = if p.is_greedy() {
            self.gpu.download::<i32>(self.s.next.ptr, 1)?[0] as u32
        } else {
            self.sample_logits(valid, p, u)?
        };
        st.last = Some(id);
        Ok(id)
    }

    fn pick_row(&self, row: usize, valid: usize, p: &GpuSampleParams, u: f32) -> Result<u32> {
        self.head(row, 1, self.s.logits.ptr)?;
        self.sample_logits(valid, p, u)
    }

    /// Choose a token from `s.logits` on the device; only its id comes back.
    fn sample_logits(&self, valid: usize, p: &GpuSampleParams, u: f32) -> Result<u32> {
        let s = &self.s;
        sample_into(
            &self.gpu,
            s.logits.ptr,
            valid.min(self.cfg.vocab_size),
            p,
            u,
            s.next.ptr,
        )?;
        Ok(self.gpu.download::<i32>(s.next.ptr, 1)?[0] as u32)
    }
}
