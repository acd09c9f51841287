//! Snapshots of a sequence's state for the prompt cache: what a state holds
//! at one position, copied out on the device so a later request that starts
//! with the same tokens resumes from there instead of prefilling them again.
//!
//! A GDN layer's conv and recurrent states are fixed-size and are copied
//! whole; an attention layer's K and V caches are copied only up to the
//! position (rows `0..pos` are contiguous in the `[max_seq, Hkv, Dh]`
//! layout), so a snapshot costs the recurrent states (about 63 MiB on the
//! full model) plus the KV rows it covers. Copies are queued on the model's
//! stream, in order with the kernels that wrote the state and with those
//! that will read it.

use std::sync::atomic::Ordering;

use anyhow::{bail, Result};
use lily_model::LayerKind;

use super::{CudaModel, CudaState};
use crate::gpu::DevBuf;

/// What a [`CudaState`] held at `pos`, in device memory of its own.
pub struct CudaSnapshot {
    pos: usize,
    /// per layer: attention, K rows `0..pos` then V rows `0..pos`; GDN, the
    /// conv state then the recurrent state
    layers: Vec<DevBuf>,
}

impl CudaSnapshot {
    /// Tokens the snapshot holds.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Device bytes it takes.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|b| b.bytes).sum()
    }
}

impl CudaModel {
    /// The prompt cache's default budget: half of the device memory still
    /// free once a sequence state is allocated, keeping 1 GiB for the
    /// driver, cuBLAS and transient buffers; at most 16 GiB.
    pub fn prompt_cache_default(&self) -> Result<usize> {
        let (free, _) = self.gpu.free_memory()?;
        let (_, state, _) = super::memory_estimate(&self.cfg, &self.opts, self.format);
        Ok((free.saturating_sub(state + (1 << 30)) / 2).min(16 << 30))
    }

    /// Bytes of one K (or V) row: all KV heads of one position.
    fn kv_row_bytes(&self) -> usize {
        self.cfg.num_key_value_heads * self.cfg.head_dim * 2
    }

    /// Copy what `st` holds into a new snapshot.
    pub fn snapshot(&self, st: &CudaState) -> Result<CudaSnapshot> {
        let row = self.kv_row_bytes();
        let mut layers = Vec::with_capacity(st.layers.len());
        for (kind, (a, b)) in self.cfg.layer_kinds.iter().zip(&st.layers) {
            let buf = match kind {
                LayerKind::Attention => {
                    let n = st.pos * row;
                    let buf = self.gpu.alloc(2 * n)?;
                    self.gpu.copy(buf.ptr, a.ptr, n)?;
                    self.gpu.copy(buf.at(n), b.ptr, n)?;
                    buf
                }
                LayerKind::Gdn => {
                    let buf = self.gpu.alloc(a.bytes + b.bytes)?;
                    self.gpu.copy(buf.ptr, a.ptr, a.bytes)?;
                    self.gpu.copy(buf.at(a.bytes), b.ptr, b.bytes)?;
                    buf
                }
            };
            layers.push(buf);
        }
        Ok(CudaSnapshot {
            pos: st.pos,
            layers,
        })
    }

    /// Make `st` hold what `snap` saved, whatever it held before. Its K/V rows
    /// past the snapshot's position keep stale values, which nothing reads:
    /// attention reads rows `0..pos` only.
    pub fn restore(&self, snap: &CudaSnapshot, st: &mut CudaState) -> Result<()> {
        if snap.pos > self.opts.max_seq {
            bail!(
                "a snapshot of {} tokens does not fit --max-seq {}",
                snap.pos,
                self.opts.max_seq
            );
        }
        let row = self.kv_row_bytes();
        for ((kind, (a, b)), buf) in self
            .cfg
            .layer_kinds
            .iter()
            .zip(&st.layers)
            .zip(&snap.layers)
        {
            match kind {
                LayerKind::Attention => {
                    let n = snap.pos * row;
                    self.gpu.copy(a.ptr, buf.ptr, n)?;
                    self.gpu.copy(b.ptr, buf.at(n), n)?;
                }
                LayerKind::Gdn => {
                    self.gpu.copy(a.ptr, buf.ptr, a.bytes)?;
                    self.gpu.copy(b.ptr, buf.at(a.bytes), b.bytes)?;
                }
            }
        }
        self.moved(st, snap.pos);
        Ok(())
    }

    /// Empty `st` for a new sequence, keeping its buffers (and its captured
    /// decode graphs): the recurrent states are zeroed, the KV rows need not
    /// be (see `restore`).
    pub fn reset(&self, st: &mut CudaState) -> Result<()> {
        for (kind, (a, b)) in self.cfg.layer_kinds.iter().zip(&st.layers) {
            if *kind == LayerKind::Gdn {
                self.gpu.zero(a.ptr, a.bytes)?;
                self.gpu.zero(b.ptr, b.bytes)?;
            }
        }
        self.moved(st, 0);
        Ok(())
    }

    /// `st` now holds `pos` tokens and has chosen none: a token the device
    /// holds for it (`s.next`) is no longer its to feed.
    fn moved(&self, st: &mut CudaState, pos: usize) {
        st.pos = pos;
        st.last = None;
        let _ = self
            .next_owner
            .compare_exchange(st.id, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}
