//! Backend-agnostic engine: sampling, output parsing, the generate loop.

pub mod assets;
pub mod backend;
pub mod generate;
pub mod parse;
pub mod sampling;
