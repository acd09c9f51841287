//! Profiling for `lily bench --profile`: a decode step or a prefill's last
//! chunk, run for real on a throwaway state, so it stays out of the serving path.

use anyhow::{Context, Result};

use super::{CudaModel, CudaState};

impl CudaModel {
    /// Time each kernel group of one decode step at the state's position:
    /// the step launched kernel by kernel with an event after each group
    /// (events recorded inside a captured graph cannot be timed), `runs`
    /// times, the median per group. Groups shorter than a launch (~3 us) read
    /// as the launch gap. The step runs for real: it rewrites the KV row at
    /// `st.pos` and advances the recurrent states, so profile a throwaway state.
    pub fn profile_decode(
        &self,
        st: &mut CudaState,
        runs: usize,
    ) -> Result<Vec<crate::profile::Section>> {
        self.check(st, &[0])?;
        self.set_pos(st.pos)?;
        self.prof_pos
            .store(st.pos, std::sync::atomic::Ordering::Relaxed);
        let mut all: Vec<Vec<crate::profile::Section>> = Vec::new();
        for _ in 0..runs.max(1) {
            self.gpu.sync()?;
            self.prof.begin(8 * self.cfg.layer_kinds.len() + 8)?;
            let r = self
                .prof
                .mark_start(&self.gpu.stream)
                .and_then(|_| self.layers(st, 1, self.s.next.ptr))
                .and_then(|_| self.lm_head_decode(false, self.screen.is_some()));
            let marks = self.prof.take().context("profile marks")?;
            r?;
            self.gpu.sync()?;
            all.push(marks.sections()?);
        }
        // s.next now holds the profiled step's choice, no state's own
        self.next_owner
            .store(0, std::sync::atomic::Ordering::Relaxed);
        let mut out = all[0].clone();
        for (i, sec) in out.iter_mut().enumerate() {
            let mut v: Vec<f64> = all.iter().map(|r| r[i].us).collect();
            v.sort_by(f64::total_cmp);
            sec.us = v[v.len() / 2];
        }
        Ok(out)
    }

    /// Each kernel group's cost inside the captured decode step, by ablation:
    /// the step is captured once whole and once without each group's launches
    /// (the skipped kernels' outputs are stale but their successors do the
    /// same work), every graph replayed `reps` times; a group's cost is the
    /// whole step's time minus the step's time without it. Unlike events
    /// between launches this keeps the graph's launch path and the
    /// programmatic overlap between kernels. Returns (whole step us, [(group,
    /// us)]) in step order. Replays advance the state: profile a throwaway one.
    pub fn profile_decode_graph(
        &self,
        st: &mut CudaState,
        reps: usize,
    ) -> Result<(f64, Vec<(&'static str, f64)>)> {
        use crate::profile::Ablation;
        self.check(st, &[0])?;
        self.set_pos(st.pos)?;
        // the groups in step order: one pass with every launch skipped
        *self.ablate.lock().unwrap() = Some(Ablation::learn());
        self.gpu.set_skip(true);
        let r = self
            .layers(st, 1, self.s.next.ptr)
            .and_then(|_| self.lm_head_decode(false, self.screen.is_some()));
        self.gpu.set_skip(false);
        let order = self
            .ablate
            .lock()
            .unwrap()
            .take()
            .map(|a| a.order)
            .unwrap_or_default();
        r?;
        let mut groups: Vec<&'static str> = Vec::new();
        for g in &order {
            if !groups.contains(g) {
                groups.push(g);
            }
        }
        let mut time = |target: Option<&'static str>| -> Result<f64> {
            if let Some(t) = target {
                let a = Ablation::skip(order.clone(), t);
                self.gpu.set_skip(a.skip_first());
                *self.ablate.lock().unwrap() = Some(a);
            }
            let graph = self.capture_step(st, false, self.screen.is_some());
            *self.ablate.lock().unwrap() = None;
            self.gpu.set_skip(false);
            crate::profile::time_graph(&self.gpu.stream, &graph?, reps)
        };
        self.next_owner
            .store(0, std::sync::atomic::Ordering::Relaxed);
        let whole = time(None)?;
        let mut out = Vec::new();
        for g in groups {
            out.push((g, whole - time(Some(g))?));
        }
        Ok((whole, out))
    }

    /// Time each kernel group of the last chunk of a prefill of `tokens`:
    /// the chunks before it run as usual, the last with an event after each
    /// group, then the last row's lm_head. Returns (the chunk's first
    /// position, its tokens, the groups summed over the layers). The state
    /// holds the prompt afterwards.
    pub fn profile_prefill(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
    ) -> Result<(usize, usize, Vec<crate::profile::Section>)> {
        self.check(st, tokens)?;
        if tokens.is_empty() {
            anyhow::bail!("profile_prefill: no tokens");
        }
        let chunk = self.opts.prefill_chunk;
        let last = (tokens.len() - 1) / chunk * chunk;
        self.run_chunks(st, &tokens[..last], &mut |_| Ok(()))?;
        let (pos, n) = (st.pos, tokens.len() - last);
        self.stage_chunk(st, &tokens[last..])?;
        self.gpu.sync()?;
        self.prof.begin(16 * self.cfg.layer_kinds.len() + 8)?;
        let r = self
            .prof
            .mark_start(&self.gpu.stream)
            .and_then(|_| self.layers(st, n, self.s.ids.ptr))
            .and_then(|_| self.head(n - 1, 1, self.s.logits.ptr));
        let marks = self.prof.take().context("profile marks")?;
        r?;
        self.gpu.sync()?;
        st.pos += n;
        Ok((pos, n, marks.sections()?))
    }
}
