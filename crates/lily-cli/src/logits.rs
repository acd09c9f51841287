//! `lily logits`: the logits at every position of a token sequence, the first N
//! through one prefill, the rest decoded one at a time. The acceptance checks
//! compare this against HF transformers.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_cpu::{CpuModel, Logits};

use crate::ModelArgs;

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Tokens [0, N) go through one prefill, the rest through decode (default: all prefill)
    #[arg(long)]
    pub decode_from: Option<usize>,
    /// Output file: one f32 tensor `logits` [T, vocab_size]
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: LogitsArgs) -> Result<()> {
    let t = a.tokens.len();
    let n = a.decode_from.unwrap_or(t);
    if n > t {
        bail!("--decode-from {n} is past the end of the {t} tokens");
    }
    if n == 0 {
        bail!("--decode-from must be at least 1: decode needs a token to start from");
    }
    let (cfg, w) = a.model.source().load()?;
    let v = cfg.vocab_size;
    let model = CpuModel::new(cfg, w);
    let mut state = model.new_state();
    let mut out = model.prefill(&a.tokens[..n], &mut state, Logits::All)?;
    for &tok in &a.tokens[n..] {
        out.extend(model.decode(tok, &mut state)?);
    }
    debug_assert_eq!(out.len(), t * v);
    let bytes: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![t, v], &bytes)?;
    let map: HashMap<String, _> = [("logits".to_string(), view)].into_iter().collect();
    safetensors::serialize_to_file(map, None, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}
