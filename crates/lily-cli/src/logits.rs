//! `lily logits`: the logits at every position of a token sequence, the first N
//! through one prefill, the rest decoded one at a time. The acceptance checks
//! compare this against HF transformers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_cli::backend::Backend;
use lily_cpu::ops::gdn::GdnForm;
use lily_cpu::{CpuModel, Logits};

use crate::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Comma-separated token ids
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Tokens [0, N) go through one prefill, the rest through decode (default: all prefill)
    #[arg(long)]
    pub decode_from: Option<usize>,
    /// Output file: one f32 tensor `logits` [T - R, vocab_size] (R: --rows-from)
    #[arg(long)]
    pub out: PathBuf,
    /// Write the logits of positions R.. only (a long prompt's last rows and
    /// the decoded ones, without a prompt's worth of vocabulary rows)
    #[arg(long, default_value_t = 0)]
    pub rows_from: usize,
    /// Also write the residual stream after every layer of the prefill
    /// (`blk.{l}.out`, [N, D]) and after the final norm, for layer-by-layer diffs
    #[arg(long)]
    pub taps: Option<PathBuf>,
    /// Keep activations in f32 (default: round them to the weights' dtype where
    /// HF transformers does, to match it running the checkpoint in bf16)
    #[arg(long)]
    pub f32_activations: bool,
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
    let r = a.rows_from;
    if r >= t {
        bail!("--rows-from {r} leaves none of the {t} positions");
    }
    let backend = a.device.load(&a.model, true)?;
    let v = backend.cfg().vocab_size;
    let mut taps: Vec<(String, Vec<f32>)> = Vec::new();
    let mut out = match &backend {
        Backend::Cpu(m) => {
            let mut model = CpuModel::new(m.cfg.clone(), m.w.clone());
            if a.f32_activations {
                model = model.with_f32_activations();
            }
            let mut state = model.new_state();
            let mut out = model.forward(
                &a.tokens[..n],
                &mut state,
                Logits::All,
                GdnForm::Chunked,
                &mut |name, x| {
                    if a.taps.is_some() {
                        taps.push((name.to_string(), x.to_vec()));
                    }
                },
            )?;
            for &tok in &a.tokens[n..] {
                out.extend(model.decode(tok, &mut state)?);
            }
            out.drain(..r * v);
            out
        }
        Backend::Cuda(m) => {
            if a.taps.is_some() || a.f32_activations {
                bail!("--taps and --f32-activations are CPU-only");
            }
            let mut st = m.new_state()?;
            let mut out = m.forward_rows(&mut st, &a.tokens[..n], r.min(n))?;
            for (i, &tok) in a.tokens.iter().enumerate().skip(n) {
                let row = m.forward(&mut st, &[tok], true)?;
                if i >= r {
                    out.extend(row);
                }
            }
            out
        }
    };
    out.truncate((t - r) * v);
    debug_assert_eq!(out.len(), (t - r) * v);
    write_f32(&a.out, &[("logits".to_string(), vec![t - r, v], out)])?;
    if let Some(path) = &a.taps {
        let named: Vec<_> = taps
            .into_iter()
            .map(|(k, x)| (k, vec![n, x.len() / n], x))
            .collect();
        write_f32(path, &named)?;
    }
    Ok(())
}

/// Write f32 tensors (name, shape, data) to a safetensors file.
pub fn write_f32(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, x)| x.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut map = HashMap::new();
    for ((name, shape, _), b) in tensors.iter().zip(&bytes) {
        map.insert(
            name.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)?,
        );
    }
    safetensors::serialize_to_file(map, None, path)
        .with_context(|| format!("writing {}", path.display()))
}
