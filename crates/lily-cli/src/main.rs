//! `lily`: the command-line front of the engine.

mod bench;
mod chat;
mod generate;
mod logits;
mod serve;
mod synthetic;
mod text;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use lily_cli::backend::{Backend, Device, LoadOptions};
use lily_cuda::GreedyHead;
use lily_model::ModelSource;

#[derive(Parser)]
#[command(
    name = "lily",
    version,
    about = "Lily: an inference engine for Qwen3.6-35B-A3B"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer one prompt, streaming the reasoning (dimmed) and the answer.
    Generate(generate::GenerateArgs),
    /// Interactive multi-turn conversation.
    Chat(chat::ChatArgs),
    /// Text to token ids.
    Tokenize(text::TokenizeArgs),
    /// Token ids to text.
    Detokenize(text::DetokenizeArgs),
    /// Logits at every position of a token sequence (prefill, then decode).
    Logits(logits::LogitsArgs),
    /// Prefill and decode speed, median of several runs after a warm-up.
    Bench(bench::BenchArgs),
    /// Describe a synthetic model's weights (generators + config) for other engines.
    #[command(hide = true)]
    SyntheticExport(synthetic::ExportArgs),
    /// OpenAI-compatible HTTP server (chat and text completions, SSE streaming).
    Serve(serve::ServeArgs),
}

/// Which model to run: a checkpoint directory or a built-in synthetic one.
#[derive(Args, Clone, Debug)]
#[group(required = true, multiple = false)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json + safetensors)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Built-in model with seeded random weights: tiny | full (released geometry) | full4 (released sizes, 4 layers)
    #[arg(long)]
    pub synthetic: Option<String>,
}

/// A format to quantize dense weights into at load.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    Fp8,
}

/// Where the model runs, and how.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// auto (CUDA when a GPU is present), cpu or cuda
    #[arg(long, default_value = "auto")]
    pub device: Device,
    /// Longest sequence (prompt + output) the GPU preallocates state for
    #[arg(long, default_value_t = 32_768)]
    pub max_seq: usize,
    /// How a greedy CUDA decode step picks its token: `screen` bounds every
    /// row's logit from an int8 copy of the lm_head and computes only the
    /// rows that can win in bf16 (the full product's argmax, bit for bit,
    /// from about half its bytes; the copy takes vocab x hidden bytes of GPU
    /// memory), `full` runs the bf16 product
    #[arg(long, default_value = "screen")]
    pub greedy_head: GreedyHead,
    /// Most prompt tokens the GPU runs through the layers at once (longer
    /// prompts go in chunks of this many): larger chunks read the expert
    /// weights fewer times per prompt, and activation memory grows with it
    #[arg(long, default_value_t = lily_cuda::CudaOptions::default().prefill_chunk)]
    pub prefill_chunk: usize,
    /// Quantize a dense model at load: `fp8` stores the matrices Qwen's FP8
    /// releases quantize as they do (e4m3, a bf16 scale per 128x128 block)
    #[arg(long)]
    pub quantize: Option<Quantize>,
}

impl DeviceArgs {
    /// The backend's settings these flags give.
    pub fn options(&self) -> LoadOptions {
        let mut o = LoadOptions::new(self.device, self.max_seq);
        o.cuda.greedy_head = self.greedy_head;
        o.cuda.prefill_chunk = self.prefill_chunk;
        o
    }

    /// Load the model's weights and put them on the chosen device.
    pub fn load(&self, m: &ModelArgs, verbose: bool) -> Result<Backend> {
        self.load_with(m, &self.options(), verbose)
    }

    /// [`DeviceArgs::load`] with settings the caller adjusted (`lily bench`'s diagnostics).
    pub fn load_with(&self, m: &ModelArgs, o: &LoadOptions, verbose: bool) -> Result<Backend> {
        let (cfg, mut w) = m.source().load()?;
        if self.quantize == Some(Quantize::Fp8) {
            w = w.quantize_fp8()?;
        }
        Backend::load(cfg, w, o, verbose)
    }
}

impl ModelArgs {
    pub fn source(&self) -> ModelSource {
        match (&self.model, &self.synthetic) {
            (Some(p), _) => ModelSource::Dir(p.clone()),
            (None, Some(n)) => ModelSource::Synthetic(n.clone()),
            (None, None) => unreachable!("clap requires one of --model / --synthetic"),
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let res: Result<()> = match cli.cmd {
        Cmd::Generate(a) => generate::run(a),
        Cmd::Chat(a) => chat::run(a),
        Cmd::Tokenize(a) => text::tokenize(a),
        Cmd::Detokenize(a) => text::detokenize(a),
        Cmd::Logits(a) => logits::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::SyntheticExport(a) => synthetic::run(a),
        Cmd::Serve(a) => serve::run(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
