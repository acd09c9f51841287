//! `lily serve`: the OpenAI-compatible HTTP server (crate `lily-server`).

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use lily_engine::sequences::CacheOptions;
use lily_model::ModelSource;
use lily_server::ServerConfig;

use crate::generate::Runner;
use crate::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// auto (CUDA when a GPU is present), cpu or cuda
    #[arg(long, default_value = "auto")]
    pub device: lily_cli::backend::Device,
    /// How a greedy CUDA decode step picks its token: `screen` (through an
    /// int8 copy of the lm_head: the same ids from about half its bytes) or
    /// `full` (the bf16 product)
    #[arg(long, default_value = "screen")]
    pub greedy_head: lily_cuda::GreedyHead,
    /// Most prompt tokens the GPU runs through the layers at once (longer
    /// prompts go in chunks): larger chunks prefill faster and take more
    /// activation memory
    #[arg(long, default_value_t = lily_cuda::CudaOptions::default().prefill_chunk)]
    pub prefill_chunk: usize,
    /// Quantize a dense model at load (`fp8`: as Qwen's FP8 releases)
    #[arg(long)]
    pub quantize: Option<crate::Quantize>,
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server to the network)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the one taken is printed)
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 routes (also read from LILY_API_KEY)
    #[arg(long)]
    pub api_key: Option<String>,
    /// Most tokens of one sequence, prompt and completion together [default: the model's max_position_embeddings]
    #[arg(long)]
    pub max_seq: Option<usize>,
    /// Most requests that may wait for the engine; more are refused with 429
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub queue: u32,
    /// The model name clients use [default: the checkpoint directory's name, or synthetic-NAME]
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Thinking off unless a request turns it on (chat_template_kwargs.enable_thinking)
    #[arg(long)]
    pub no_think: bool,
    /// On SIGINT/SIGTERM, seconds running requests may go on before they are cancelled
    #[arg(long, default_value_t = 10)]
    pub shutdown_timeout: u64,
    /// Largest request body, in MiB
    #[arg(long, default_value_t = 32)]
    pub max_body_mib: usize,
    /// Memory the prompt cache may hold, in MiB (0 turns it off) [default:
    /// on a GPU, half of the device memory left free, at most 16 GiB; 2 GiB of host memory on the CPU]
    #[arg(long)]
    pub prompt_cache_mib: Option<usize>,
    /// TEST ONLY: honour the request fields `lily_test_script` (force the output text) and
    /// `lily_test_delay_ms` (a slow model), used by the client tests in tests/server
    #[arg(long, hide = true)]
    pub test_hooks: bool,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let source = a.model.source();
    let (served, alias) = match &source {
        ModelSource::Dir(d) => {
            let name = d
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| d.display().to_string());
            (name, d.display().to_string())
        }
        ModelSource::Synthetic(n) => (format!("synthetic-{n}"), format!("synthetic:{n}")),
    };
    let served = a.served_model_name.clone().unwrap_or(served);
    let api_key = a
        .api_key
        .clone()
        .or_else(|| std::env::var("LILY_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let limit = match a.model.source() {
        lily_model::ModelSource::Dir(d) => {
            lily_model::Config::from_file(&d.join("config.json"))?.max_position_embeddings
        }
        lily_model::ModelSource::Synthetic(n) => {
            lily_model::Config::synthetic(&n)?.max_position_embeddings
        }
    };
    let max_seq = a.max_seq.unwrap_or(limit);
    if max_seq < 2 || max_seq > limit {
        bail!("--max-seq must be between 2 and the model's {limit} positions, got {max_seq}");
    }
    // the GPU preallocates state for max_seq tokens; keep its default modest
    let gpu_seq = a.max_seq.unwrap_or(limit.min(32_768));
    let r = Runner::load(
        &a.model,
        &DeviceArgs {
            device: a.device,
            max_seq: gpu_seq,
            greedy_head: a.greedy_head,
            prefill_chunk: a.prefill_chunk,
            quantize: a.quantize,
        },
    )?;
    let cache_mib = match a.prompt_cache_mib {
        Some(m) => m,
        None => r.model.prompt_cache_default_mib()?,
    };
    eprintln!("lily serve: prompt cache of {cache_mib} MiB");
    let cfg = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        api_key,
        max_seq,
        queue: a.queue as usize,
        model_aliases: vec![alias].into_iter().filter(|x| *x != served).collect(),
        served_model_name: served,
        default_thinking: !a.no_think,
        test_hooks: a.test_hooks,
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout),
        max_body_bytes: a.max_body_mib.max(1) << 20,
        prompt_cache: CacheOptions::mib(cache_mib),
    };
    if a.test_hooks {
        eprintln!("lily serve: TEST HOOKS ON (requests may force the output); never use this in production");
    }
    let Runner { model, assets } = r;
    lily_server::serve(move || Ok(model), assets, cfg)
}
