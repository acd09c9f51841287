//! The CUDA backend for Hopper: hand-written kernels (`kernels`: one `.cu`
//! file per family, compiled at start-up by NVRTC, each launched through its
//! typed Rust function), cuBLAS for prefill GEMMs, and the whole forward pass
//! on the GPU (`model`).

pub mod gpu;
pub mod kernels;
pub mod model;
pub mod profile;
pub mod trace;
pub mod weights;

pub use gpu::GpuOptions;
pub use model::{
    Choice, CudaModel, CudaOptions, CudaSnapshot, CudaState, DeviceChoice, GreedyHead, Penalties,
};
