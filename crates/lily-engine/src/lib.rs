//! Backend-agnostic engine: sampling, output parsing, the generate loop. It
//! drives any [`generate::Model`] (every `lily_model::Forward` is one); which
//! backend that is gets decided by whoever builds the model.

pub mod assets;
pub mod generate;
pub mod parse;
pub mod prompt_cache;
pub mod sampling;
pub mod sequences;
