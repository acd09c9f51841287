//! What the model is: its config, its weights, the contracts of its ops, the
//! forward interface every backend implements ([`Forward`]) and the math of
//! choosing a token ([`sampling`]). No compute backend lives here; CPU and
//! CUDA both build on this crate.

pub mod chat_template;
pub mod config;
pub mod forward;
pub mod ops;
pub mod quant;
pub mod sampling;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

use std::path::Path;

use anyhow::{Context, Result};

pub use config::{Config, LayerKind};
pub use forward::Forward;
pub use quant::WeightFormat;
pub use tensor::{DType, Mat, Tensor};
pub use weights::Weights;

/// Seed of the built-in synthetic models: fixed, so every run and every backend
/// sees the same weights.
pub const SYNTHETIC_SEED: u64 = 0x5157_454E_3336; // "QWEN36"

/// Where a model comes from: a checkpoint directory or a built-in synthetic geometry.
#[derive(Clone, Debug)]
pub enum ModelSource {
    Dir(std::path::PathBuf),
    Synthetic(String),
}

impl ModelSource {
    pub fn describe(&self) -> String {
        match self {
            ModelSource::Dir(p) => p.display().to_string(),
            ModelSource::Synthetic(n) => format!("synthetic:{n}"),
        }
    }

    /// Read the config and map (or generate) the weights, all checked.
    /// The synthetic weights as generators, never materialised (for export and
    /// for backends that generate them on the device).
    pub fn load_procedural(&self) -> Result<(Config, Weights)> {
        match self {
            ModelSource::Synthetic(name) => {
                let cfg = Config::synthetic(name)?;
                let w = weights::synthetic(&cfg, SYNTHETIC_SEED);
                Ok((cfg, w))
            }
            ModelSource::Dir(_) => self.load(),
        }
    }

    pub fn load(&self) -> Result<(Config, Weights)> {
        match self {
            ModelSource::Dir(dir) => load_dir(dir),
            ModelSource::Synthetic(name) => {
                let cfg = Config::synthetic(name)?;
                // The tiny model is ~70 MB as bf16: materialise it so the CPU
                // reads memory instead of hashing on every access.
                let w = weights::synthetic(&cfg, SYNTHETIC_SEED).materialize_small(1 << 30);
                Ok((cfg, w))
            }
        }
    }
}

pub fn load_dir(dir: &Path) -> Result<(Config, Weights)> {
    if !dir.is_dir() {
        anyhow::bail!("model directory {} does not exist", dir.display());
    }
    let path = dir.join("config.json");
    let cfg = Config::from_file(&path)?;
    let format = config::read_json(&path)
        .and_then(|v| WeightFormat::from_config(&v))
        .with_context(|| format!("invalid config {}", path.display()))?;
    let ck = weights::Checkpoint::open(dir, format)?;
    let w = ck.weights(&cfg)?;
    Ok((cfg, w))
}
