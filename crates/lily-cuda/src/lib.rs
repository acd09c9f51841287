//! The CUDA backend for Hopper: hand-written kernels (kernels/*.cu, compiled
//! at start-up by NVRTC), cuBLAS for prefill GEMMs, and the whole forward pass
//! on the GPU.

pub mod attention;
pub mod gdn;
pub mod gpu;
pub mod lm_head;
pub mod model;
pub mod profile;
pub mod sampling;
pub mod trace;
pub mod weights;

pub use model::{CudaModel, CudaOptions, CudaState};
