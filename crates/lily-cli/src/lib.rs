//! The composition root of the `lily` binary: where a backend is chosen and
//! built. The engine and the server are generic over `Model`; only this crate
//! depends on the CPU and CUDA backends.

pub mod backend;
