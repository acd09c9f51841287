//! Backend-agnostic engine: sampling, output parsing, the generate loop.

pub mod assets;
pub mod generate;
pub mod parse;
pub mod sampling;
