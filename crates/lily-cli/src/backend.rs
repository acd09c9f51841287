//! Which compute backend runs the model: the CPU reference or the CUDA
//! backend, chosen by `--device auto|cpu|cuda`. The engine knows neither; it
//! drives a [`Backend`] through `Model`, whose pick methods let the CUDA
//! backend choose tokens on the device.

use anyhow::{bail, Context, Result};
use lily_cpu::CpuModel;
use lily_cuda::kernels::sampling::{uniform_f32, GpuSampleParams};
use lily_cuda::{Choice, DeviceChoice, Penalties};
use lily_cuda::{CudaModel, CudaOptions, CudaSnapshot, CudaState, GpuOptions};
use lily_engine::generate::{decode_pick_each, Model, Picked};
use lily_engine::sampling::{Logprobs, Sampler};
use lily_model::{Config, Forward, Weights};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a GPU is present, else the CPU
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Device> {
        Ok(match s {
            "auto" => Device::Auto,
            "cpu" => Device::Cpu,
            "cuda" | "gpu" => Device::Cuda,
            other => bail!("unknown device {other:?} (auto, cpu or cuda)"),
        })
    }
}

/// How a backend is built: the device, and the CUDA backend's settings
/// (plain data: the product settings come from flags every model command
/// takes, the diagnostics from `lily bench`'s).
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub device: Device,
    /// the CUDA model's settings (unused on the CPU)
    pub cuda: CudaOptions,
    /// programmatic dependent launch and the kernels' build
    pub gpu: GpuOptions,
}

impl LoadOptions {
    /// The product settings on `device`, with GPU state for `max_seq` tokens.
    pub fn new(device: Device, max_seq: usize) -> LoadOptions {
        LoadOptions {
            device,
            cuda: CudaOptions {
                max_seq,
                ..CudaOptions::default()
            },
            gpu: GpuOptions::default(),
        }
    }
}

#[allow(clippy::large_enum_variant)] // one per process: boxing the CPU model would buy nothing
pub enum Backend {
    Cpu(CpuModel),
    Cuda(Box<CudaModel>),
}

pub enum BackendState {
    Cpu(lily_cpu::State),
    Cuda(CudaState),
}

pub enum BackendSnapshot {
    Cpu(lily_cpu::State),
    Cuda(CudaSnapshot),
}

impl Backend {
    /// Build the model on `o.device`. `verbose` prints the memory estimate
    /// and upload progress of the CUDA backend to stderr.
    pub fn load(cfg: Config, w: Weights, o: &LoadOptions, verbose: bool) -> Result<Backend> {
        let device = o.device;
        let want_cuda = match device {
            Device::Cpu => false,
            Device::Cuda => true,
            Device::Auto => lily_cuda::gpu::cuda_available().is_ok(),
        };
        if !want_cuda {
            return Ok(Backend::Cpu(CpuModel::new(cfg, w)));
        }
        let gpu = match lily_cuda::gpu::Gpu::new(0, &o.gpu) {
            Ok(g) => g,
            Err(e) if device == Device::Auto => {
                if verbose {
                    eprintln!("lily: no usable GPU ({e:#}); running on the CPU");
                }
                return Ok(Backend::Cpu(CpuModel::new(cfg, w)));
            }
            Err(e) => return Err(e.context("--device cuda")),
        };
        Ok(Backend::Cuda(Box::new(CudaModel::load(
            gpu,
            cfg,
            &w,
            o.cuda.clone(),
            verbose,
        )?)))
    }

    pub fn cfg(&self) -> &Config {
        match self {
            Backend::Cpu(m) => &m.cfg,
            Backend::Cuda(m) => &m.cfg,
        }
    }

    /// The prompt cache's default budget in MiB: on CUDA, what the device
    /// has to spare (`CudaModel::prompt_cache_default`); 2 GiB of host
    /// memory on the CPU.
    pub fn prompt_cache_default_mib(&self) -> Result<usize> {
        Ok(match self {
            Backend::Cpu(_) => 2048,
            Backend::Cuda(m) => m.prompt_cache_default()? >> 20,
        })
    }

    /// How the model's linear weights are stored (dense, or block FP8).
    pub fn weight_format(&self) -> lily_model::WeightFormat {
        match self {
            Backend::Cpu(m) => m.w.format,
            Backend::Cuda(m) => m.format,
        }
    }

    pub fn device_name(&self) -> String {
        match self {
            Backend::Cpu(_) => format!("cpu ({} threads)", rayon_threads()),
            Backend::Cuda(m) => format!("cuda ({})", m.gpu.name),
        }
    }

    /// Logits at every position of `tokens` (all prefill) on the host [T, V].
    pub fn logits_all(&self, st: &mut BackendState, tokens: &[u32]) -> Result<Vec<f32>> {
        match (self, st) {
            (Backend::Cpu(m), BackendState::Cpu(s)) => m.prefill(tokens, s, lily_cpu::Logits::All),
            (Backend::Cuda(m), BackendState::Cuda(s)) => m.forward(s, tokens, true),
            _ => bail!("state belongs to another backend"),
        }
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// How the device chooses for `sampler`'s request this step: its settings,
/// its draw (a uniform for a sampled choice, taken from the request's seeded
/// stream where the host sampler would take it; none for a greedy one), its
/// penalties and bias, and the log-probabilities asked for.
fn device_choice(sampler: &mut Sampler, logprobs: Option<usize>) -> DeviceChoice<'_> {
    let u = if sampler.is_greedy() {
        0.0
    } else {
        uniform_f32(sampler.draw())
    };
    let p = &sampler.params;
    DeviceChoice {
        valid: sampler.valid_vocab(),
        params: GpuSampleParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
        },
        u,
        penalties: (!sampler.logits_only()).then_some(Penalties {
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            repetition: p.repetition_penalty,
            bias: &p.logit_bias,
        }),
        logprobs,
    }
}

/// Make the device's penalty state for `s` agree with `sampler` before a
/// step; `feeding`: the step feeds a token the sampler has just accepted.
/// Returns whether the device should count that token itself (its state is
/// one token behind); otherwise the state was loaded whole from the sampler
/// (a new request, or steps taken on the host since).
fn sync_penalties(
    m: &CudaModel,
    s: &mut CudaState,
    sampler: &Sampler,
    feeding: bool,
) -> Result<bool> {
    if sampler.logits_only() {
        return Ok(false);
    }
    let want = (sampler.id(), sampler.generated());
    if feeding && m.penalties_tag(s) == Some((want.0, want.1.wrapping_sub(1))) {
        return Ok(true);
    }
    let (seen, counts) = sampler.penalty_tokens();
    m.load_penalties(s, want, &seen, &counts, &sampler.params.logit_bias)?;
    Ok(false)
}

fn picked(c: Choice) -> Picked {
    Picked {
        id: c.id,
        logprobs: c.logprobs.map(|(chosen, top)| Logprobs { chosen, top }),
    }
}

impl Model for Backend {
    type State = BackendState;

    fn new_state(&self) -> Result<BackendState> {
        Ok(match self {
            Backend::Cpu(m) => BackendState::Cpu(m.new_state()),
            Backend::Cuda(m) => BackendState::Cuda(
                m.new_state().context("allocating the sequence state on the GPU (out of GPU memory? a smaller --max-seq needs less)")?,
            ),
        })
    }

    fn prefill(&self, tokens: &[u32], st: &mut BackendState) -> Result<Vec<f32>> {
        match (self, st) {
            (Backend::Cpu(m), BackendState::Cpu(s)) => m.prefill(tokens, s, lily_cpu::Logits::Last),
            (Backend::Cuda(m), BackendState::Cuda(s)) => m.forward(s, tokens, false),
            _ => bail!("state belongs to another backend"),
        }
    }

    fn decode(&self, token: u32, st: &mut BackendState) -> Result<Vec<f32>> {
        match (self, st) {
            (Backend::Cpu(m), BackendState::Cpu(s)) => m.decode(token, s),
            (Backend::Cuda(m), BackendState::Cuda(s)) => m.forward(s, &[token], false),
            _ => bail!("state belongs to another backend"),
        }
    }

    fn position(&self, st: &BackendState) -> usize {
        match st {
            BackendState::Cpu(s) => s.pos,
            BackendState::Cuda(s) => s.pos,
        }
    }

    fn reset(&self, st: &mut BackendState) -> Result<()> {
        match (self, st) {
            (Backend::Cpu(m), BackendState::Cpu(s)) => Forward::reset(m, s),
            (Backend::Cuda(m), BackendState::Cuda(s)) => m.reset(s),
            _ => bail!("state belongs to another backend"),
        }
    }

    type Snapshot = BackendSnapshot;

    fn snapshot(&self, st: &BackendState) -> Result<BackendSnapshot> {
        Ok(match (self, st) {
            (Backend::Cpu(m), BackendState::Cpu(s)) => {
                BackendSnapshot::Cpu(Forward::snapshot(m, s)?)
            }
            (Backend::Cuda(m), BackendState::Cuda(s)) => BackendSnapshot::Cuda(m.snapshot(s)?),
            _ => bail!("state belongs to another backend"),
        })
    }

    fn restore(&self, snap: &BackendSnapshot, st: &mut BackendState) -> Result<()> {
        match (self, snap, st) {
            (Backend::Cpu(m), BackendSnapshot::Cpu(n), BackendState::Cpu(s)) => {
                Forward::restore(m, n, s)
            }
            (Backend::Cuda(m), BackendSnapshot::Cuda(n), BackendState::Cuda(s)) => m.restore(n, s),
            _ => bail!("snapshot or state belongs to another backend"),
        }
    }

    fn snapshot_bytes(&self, snap: &BackendSnapshot) -> usize {
        match (self, snap) {
            (Backend::Cpu(m), BackendSnapshot::Cpu(n)) => Forward::snapshot_bytes(m, n),
            (_, BackendSnapshot::Cuda(n)) => n.bytes(),
            // a CPU snapshot exists only beside a CPU model
            (Backend::Cuda(_), BackendSnapshot::Cpu(_)) => 0,
        }
    }

    /// On CUDA the choice is made on the device (model/choose.rs), penalties,
    /// bias and log-probabilities included: only the id and the numbers
    /// asked for leave the GPU. The CPU samples its logits as usual.
    fn prefill_pick(
        &self,
        tokens: &[u32],
        st: &mut BackendState,
        sampler: &mut Sampler,
        logprobs: Option<usize>,
    ) -> Result<Picked> {
        match (self, st) {
            (Backend::Cuda(m), BackendState::Cuda(s)) => {
                sync_penalties(m, s, sampler, false)?;
                let d = device_choice(sampler, logprobs);
                Ok(picked(m.prefill_choose(s, tokens, &d)?))
            }
            (_, st) => {
                let logits = self.prefill(tokens, st)?;
                Ok(Picked::on_host(&logits, sampler, logprobs))
            }
        }
    }

    /// Greedy on CUDA: the device pipeline (`CudaModel::decode_greedy_run`),
    /// each step queued before the previous choice reaches the host.
    fn decode_pick_run(
        &self,
        token: u32,
        st: &mut BackendState,
        sampler: &mut Sampler,
        n: usize,
        on_token: &mut dyn FnMut(u32, &mut Sampler) -> Result<bool>,
    ) -> Result<()> {
        match (self, st) {
            (Backend::Cuda(m), BackendState::Cuda(s))
                if sampler.logits_only() && sampler.is_greedy() =>
            {
                m.set_next_token(s, token)?;
                let valid = sampler.valid_vocab();
                m.decode_greedy_run(s, n, valid, &mut |id| on_token(id, sampler))?;
                Ok(())
            }
            (_, st) => decode_pick_each(self, token, st, sampler, n, on_token),
        }
    }

    fn decode_pick(
        &self,
        token: u32,
        st: &mut BackendState,
        sampler: &mut Sampler,
        logprobs: Option<usize>,
    ) -> Result<Picked> {
        match (self, st) {
            (Backend::Cuda(m), BackendState::Cuda(s)) => {
                let count = sync_penalties(m, s, sampler, true)?;
                let d = device_choice(sampler, logprobs);
                Ok(picked(m.decode_choose(s, token, count, &d)?))
            }
            (_, st) => {
                let logits = self.decode(token, st)?;
                Ok(Picked::on_host(&logits, sampler, logprobs))
            }
        }
    }
}
