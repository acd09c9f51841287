//! What every backend computes: the forward pass of one sequence, step by
//! step, from token ids to logits. The engine drives any [`Forward`] without
//! knowing which backend it is, so the choice of backend belongs to whoever
//! builds the model (the `lily` binary), not to the engine.

use anyhow::Result;

/// The forward pass of a backend, one sequence at a time. A sequence's state
/// (KV caches, GDN states, the position) is a value owned by the caller, so
/// one model can serve many sequences.
///
/// `prefill` and `decode` compute the same function of the tokens fed so far;
/// they differ only in how a backend may go about it (all of a prompt at once,
/// or one token at a time).
pub trait Forward {
    /// One sequence's state.
    type State;
    /// A fresh, empty sequence (fails when its memory cannot be allocated).
    fn new_state(&self) -> Result<Self::State>;
    /// Feed `tokens` after what `state` holds; the logits [V] of the last one.
    fn prefill(&self, tokens: &[u32], state: &mut Self::State) -> Result<Vec<f32>>;
    /// Feed one token after what `state` holds; its logits [V].
    fn decode(&self, token: u32, state: &mut Self::State) -> Result<Vec<f32>>;
    /// Tokens `state` holds.
    fn position(&self, state: &Self::State) -> usize;
    /// Make `state` an empty sequence again, keeping its memory.
    fn reset(&self, state: &mut Self::State) -> Result<()>;

    /// A saved copy of what a state holds (its position, KV rows and
    /// recurrent states), for the prompt cache: a state `restore`d from it
    /// continues exactly as the saved one would have.
    type Snapshot;
    /// Save what `state` holds.
    fn snapshot(&self, state: &Self::State) -> Result<Self::Snapshot>;
    /// Make `state` hold what `snap` saved, whatever it held before.
    fn restore(&self, snap: &Self::Snapshot, state: &mut Self::State) -> Result<()>;
    /// Bytes `snap` takes (the cache's budget counts these).
    fn snapshot_bytes(&self, snap: &Self::Snapshot) -> usize;
}
