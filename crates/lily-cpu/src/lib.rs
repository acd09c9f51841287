//! The CPU backend: a plain, multi-threaded f32 implementation of every op and
//! of the whole forward pass. It is the reference the CUDA backend is tested
//! against, and a runnable engine on any machine.

pub mod model;
pub mod ops;

pub use model::{CpuModel, LayerState, Logits, State};
