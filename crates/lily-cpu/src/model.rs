//! The CPU forward pass, written out plainly: embed, then per layer
//! `x += mixer(norm(x)); x += moe(norm(x))`, then the final norm and lm_head.
//! One function serves prefill (T tokens, chunked GDN) and decode (T = 1,
//! recurrent GDN); both continue from whatever the state already holds.

use anyhow::{bail, Result};
use lily_model::tensor::round_to;
use lily_model::weights::MixerWeights;
use lily_model::{Config, DType, Forward, LayerKind, Weights};

use crate::ops::attention::{gated_attention, KvCache};
use crate::ops::gdn::{gdn, GdnForm, GdnState};
use crate::ops::linear::linear;
use crate::ops::moe::{moe, router_logits};
use crate::ops::norm::rmsnorm1p;

/// Per-sequence state of every layer, plus the number of tokens consumed.
#[derive(Clone)]
pub struct State {
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

#[derive(Clone)]
pub enum LayerState {
    Attention(KvCache),
    Gdn(GdnState),
}

/// Which positions' logits a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

pub struct CpuModel {
    pub cfg: Config,
    pub w: Weights,
    /// Activation dtype: values are rounded to it where HF materialises them.
    /// Defaults to the weights' dtype (HF runs a bf16 checkpoint in bf16);
    /// `F32` keeps every activation in f32, the exact reference for kernels.
    pub act: DType,
}

impl CpuModel {
    pub fn new(cfg: Config, w: Weights) -> CpuModel {
        let act = w.dtype;
        CpuModel { cfg, w, act }
    }

    pub fn with_f32_activations(mut self) -> CpuModel {
        self.act = DType::F32;
        self
    }

    pub fn new_state(&self) -> State {
        let layers = self
            .cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attention(KvCache::default()),
                LayerKind::Gdn => LayerState::Gdn(GdnState::new(&self.cfg)),
            })
            .collect();
        State { pos: 0, layers }
    }

    /// Prefill T tokens (chunked GDN) after whatever `state` holds.
    pub fn prefill(&self, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        self.forward(tokens, state, which, GdnForm::Chunked, &mut |_, _| {})
    }

    /// Decode one token (recurrent GDN); returns its logits [V].
    pub fn decode(&self, token: u32, state: &mut State) -> Result<Vec<f32>> {
        self.forward(
            &[token],
            state,
            Logits::Last,
            GdnForm::Recurrent,
            &mut |_, _| {},
        )
    }

    /// The whole forward. `tap(name, x)` sees the residual stream after each
    /// mixer (`blk.{l}.mixer_out`) and layer (`blk.{l}.out`), the router logits
    /// (`blk.{l}.moe.router_logits`, [T, E]) and the final norm (`final_norm`).
    pub fn forward(
        &self,
        tokens: &[u32],
        state: &mut State,
        which: Logits,
        form: GdnForm,
        tap: &mut dyn FnMut(&str, &[f32]),
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (t, d, v) = (tokens.len(), cfg.hidden_size, cfg.vocab_size);
        if t == 0 {
            return Ok(Vec::new());
        }
        if let Some(bad) = tokens.iter().find(|&&x| x as usize >= v) {
            bail!("token id {bad} is out of range: the model has {v} vocabulary rows");
        }
        if state.layers.len() != cfg.num_layers() {
            bail!(
                "state has {} layers, the model {}",
                state.layers.len(),
                cfg.num_layers()
            );
        }
        let r = self.act;
        let eps = cfg.rms_norm_eps;
        let mut x = vec![0f32; t * d]; // [T, D] residual stream
        for (i, &tok) in tokens.iter().enumerate() {
            self.w
                .embed
                .row_f32(tok as usize, &mut x[i * d..(i + 1) * d]);
        }
        for (l, (lw, ls)) in self
            .w
            .layers
            .iter()
            .zip(state.layers.iter_mut())
            .enumerate()
        {
            let h = rmsnorm1p(&x, &lw.input_norm, eps, r);
            let m = match (&lw.mixer, ls) {
                (MixerWeights::Attention(a), LayerState::Attention(kv)) => {
                    gated_attention(&h, t, state.pos, a, cfg, kv, r)
                }
                (MixerWeights::Gdn(g), LayerState::Gdn(gs)) => gdn(&h, t, g, cfg, gs, r, form),
                _ => bail!("layer {l}: state kind does not match the layer's mixer"),
            };
            add_round(&mut x, &m, r);
            tap(&format!("blk.{l}.mixer_out"), &x);
            let h = rmsnorm1p(&x, &lw.post_norm, eps, r);
            let rl = router_logits(&h, t, &lw.moe, r);
            tap(&format!("blk.{l}.moe.router_logits"), &rl);
            let f = moe(&h, t, &rl, &lw.moe, cfg, r);
            add_round(&mut x, &f, r);
            tap(&format!("blk.{l}.out"), &x);
        }
        state.pos += t;
        let rows: &[f32] = match which {
            Logits::None => return Ok(Vec::new()),
            Logits::All => &x,
            Logits::Last => &x[(t - 1) * d..],
        };
        let n = rows.len() / d;
        let h = rmsnorm1p(rows, &self.w.norm, eps, r);
        tap("final_norm", &h);
        let mut logits = linear(&h, n, &self.w.lm_head);
        round_to(r, &mut logits);
        Ok(logits)
    }
}

/// The engine's view of the CPU model: prefill with chunked GDN returning the
/// last token's logits, decode with recurrent GDN.
impl Forward for CpuModel {
    type State = State;
    fn new_state(&self) -> Result<State> {
        Ok(CpuModel::new_state(self))
    }
    fn prefill(&self, tokens: &[u32], state: &mut State) -> Result<Vec<f32>> {
        CpuModel::prefill(self, tokens, state, Logits::Last)
    }
    fn decode(&self, token: u32, state: &mut State) -> Result<Vec<f32>> {
        CpuModel::decode(self, token, state)
    }
    fn position(&self, state: &State) -> usize {
        state.pos
    }
    fn reset(&self, state: &mut State) -> Result<()> {
        *state = CpuModel::new_state(self);
        Ok(())
    }

    /// The CPU's snapshot is a copy of the state: its KV caches hold exactly
    /// the rows of its position, its GDN states are fixed-size.
    type Snapshot = State;
    fn snapshot(&self, state: &State) -> Result<State> {
        Ok(state.clone())
    }
    fn restore(&self, snap: &State, state: &mut State) -> Result<()> {
        state.clone_from(snap);
        Ok(())
    }
    fn snapshot_bytes(&self, snap: &State) -> usize {
        let floats: usize = snap
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Attention(kv) => kv.k.len() + kv.v.len(),
                LayerState::Gdn(g) => g.conv.len() + g.s.len(),
            })
            .sum();
        floats * 4
    }
}

fn add_round(x: &mut [f32], y: &[f32], r: DType) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    round_to(r, x);
}
