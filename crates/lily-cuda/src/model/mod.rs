//! The CUDA forward pass: the same layer sequence as the CPU reference, as an
//! explicit list of kernel launches into buffers allocated once. Prefill runs
//! chunks of up to `prefill_chunk` tokens through GEMMs on the tensor cores
//! (cuBLAS for the dense projections, Lily's grouped GEMMs for the experts)
//! and flash attention; decode (one
//! token) uses Lily's matrix-vector kernels. Positions and token ids live in
//! device memory, and a decode step allocates nothing and never waits on the
//! host, so it can be captured in a CUDA graph. The step also makes its
//! greedy choice, feeds it to the next step and advances the position on the
//! device, so greedy steps can be queued back to back (`decode_greedy_run`).

mod bytes;
mod choose;
mod decode;
mod layers;
mod moe_prefill;
mod profile;
mod snapshot;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use anyhow::{bail, Result};
use lily_model::{Config, LayerKind, Weights};

use self::bytes::gib;
pub use self::bytes::prefill_group_flops;
pub use self::choose::{Choice, DeviceChoice, Penalties};
use self::decode::StepGraph;
pub use self::snapshot::CudaSnapshot;
use crate::gpu::{DevBuf, Gpu};
use crate::kernels::attention::{attention_decode_scratch_bytes, attention_decode_splits};
use crate::kernels::gdn_chunked::gdn_chunked_scratch_bytes;
use crate::kernels::lm_head::HeadScreen;
use crate::kernels::moe::MoeDims;
use crate::kernels::moe_grouped::tile_list_len;
use crate::kernels::sampling::{logprobs_out_len, logprobs_scratch_bytes, LOGPROBS_MAX_N};
use crate::weights::{moe_dims, upload, weight_bytes, DevWeights};

/// How a greedy decode step picks its token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GreedyHead {
    /// Through an int8 copy of the lm_head (kernels/lm_head.cu): the same id
    /// as the full product's argmax, bit for bit, from half of its bytes;
    /// the copy costs vocab x hidden bytes of GPU memory. Models whose hidden
    /// size the screen kernels are not written for take the full product.
    #[default]
    Screen,
    /// The full bf16 product, then its argmax.
    Full,
}

impl std::str::FromStr for GreedyHead {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<GreedyHead> {
        Ok(match s {
            "screen" => GreedyHead::Screen,
            "full" => GreedyHead::Full,
            other => bail!("unknown greedy head {other:?} (screen or full)"),
        })
    }
}

/// The CUDA model's settings: plain data, built by the caller (the CLI from
/// its flags, tests explicitly); `Default` is the product setting.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// KV cache length (tokens) preallocated per sequence
    pub max_seq: usize,
    /// Most tokens one prefill launch sequence handles; longer prompts go in pieces
    pub prefill_chunk: usize,
    /// How greedy decode steps pick their token; steps that need the logits
    /// (sampling, log-probabilities) always run the full product
    pub greedy_head: GreedyHead,
    /// Replay each sequence's decode step from a captured CUDA graph (one
    /// launch instead of one a kernel); off only to measure what the graph saves
    /// (`lily bench --eager`)
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_seq: 32_768,
            prefill_chunk: 4096,
            greedy_head: GreedyHead::Screen,
            graphs: true,
        }
    }
}

/// Per-sequence device state: KV caches of the attention layers, conv and
/// recurrent states of the GDN layers.
pub struct CudaState {
    pub pos: usize,
    /// per layer: (k cache, v cache) [max_seq, Hkv, Dh] bf16, or (conv [C, W-1] f32, S [Hv, Dk, Dv] f32)
    layers: Vec<(DevBuf, DevBuf)>,
    /// The decode step captured on this state's buffers at its first decode,
    /// replayed after: [0] layers + lm_head into the logits buffer, [1] the
    /// greedy-only step (the screened lm_head, no logits).
    graphs: [Option<StepGraph>; 2],
    /// Which state this is (`CudaModel::next_owner`), and the token it chose
    /// last (the one a greedy run feeds).
    id: u64,
    last: Option<u32>,
    /// the request's penalty state on the device (model/choose.rs)
    choice: Option<choose::ChoiceState>,
}

/// A decode layer's flags (`s.flags`), which its first kernel (`gemv3`)
/// clears: moe.cu's `RouteSlot`, rounded up to whole u64 words.
const FLAG_BYTES: usize = crate::kernels::moe::ROUTE_SLOT_BYTES.next_multiple_of(8);

/// Activation buffers for up to `prefill_chunk` tokens.
struct Scratch {
    ids: DevBuf,                       // [T] i32
    pos: DevBuf,                       // [1] i32
    x: DevBuf,                         // [T, D] f32 residual
    h: DevBuf,                         // [T, max(D, Hq*Dh, Hv*Dv)] bf16: GEMM inputs
    big: DevBuf,                       // [T, max(q rows, C)] f32: q_proj / in_proj_qkv output
    z: DevBuf,                         // [T, Hv*Dv] f32
    k: DevBuf,                         // [T, Hkv*Dh] f32
    v: DevBuf,                         // [T, Hkv*Dh] f32
    ba: DevBuf,                        // [T, 2 Hv] f32
    conv: DevBuf,                      // [T, C] f32
    q: DevBuf,                         // [T, max(Hq*Dh, Hv*Dv)] f32: roped q, or GDN core output
    delta: DevBuf,                     // [T, D] f32 mixer output
    rl: DevBuf,                        // [T, E+1] f32 router logits
    idx: DevBuf,                       // [T, K] i32
    wts: DevBuf,                       // [T, K+1] f32
    moe_h: DevBuf,                     // [K+1, max(F, Fs)] bf16 (decode; prefill runs grouped)
    logits: DevBuf,                    // [V] f32
    pen: DevBuf,                       // [V] f32 penalized logits (model/choose.rs)
    lp_part: DevBuf,                   // logprobs_partial's scratch
    lp_out: DevBuf,                    // [logprobs_out_len(LOGPROBS_MAX_N)] i32
    next: DevBuf,                      // [1] i32 sampled token: also the token a decode step feeds
    best: DevBuf, // [1] u64 the decode step's greedy choice as argmax_entry, 0 between steps
    host_next: crate::gpu::HostMapped, // [2] i32 each step's choice, in slot pos & 1, for the host
    valid: DevBuf, // [1] i32 ids below this are eligible for the in-step greedy choice
    counter: DevBuf, // [1] u32 blocks done, for kernels whose last block finishes the job
    flags: DevBuf, // [FLAG_BYTES] a decode layer's MoE route slot
    gdn: DevBuf,  // per-chunk records of the chunked GDN prefill
    att: DevBuf,  // split-K partials of the decode attention
    grouped: Grouped,
}

/// Prefill MoE as grouped GEMMs: the chunk's (token, slot) pairs sorted by expert.
struct Grouped {
    counts: DevBuf,  // [E] i32 pairs per expert
    offsets: DevBuf, // [E] i32 first row of each expert's block
    tiles: DevBuf,   // the GEMMs' tile list (moe_grouped::tile_list_len entries, i32)
    rowmap: DevBuf,  // [T*K] i32 row of each pair
    src: DevBuf,     // [T*K] i32 token of each row
    hs: DevBuf,      // [T*K, F] bf16 silu(gate) * up, rows sorted by expert
    ys: DevBuf,      // [T*K, D] f32 down products
    hsh: DevBuf,     // [T, Fs] bf16 the shared expert's silu(gate) * up
    osh: DevBuf,     // [T, D] f32 shared expert output
}

/// Bytes of the grouped-GEMM MoE buffers for chunks of `t` tokens.
fn grouped_bytes(cfg: &Config, t: usize) -> usize {
    let MoeDims { d, e, k, f, fs } = moe_dims(cfg);
    let pairs = t * k;
    2 * e * 4
        + tile_list_len(pairs, e) * 4
        + 2 * pairs * 4
        + pairs * f * 2
        + pairs * d * 4
        + t * fs * 2
        + t * d * 4
}

pub struct CudaModel {
    pub gpu: Gpu,
    pub cfg: Config,
    pub opts: CudaOptions,
    /// How the checkpoint stores its linear weights (the FP8 ones stay FP8
    /// on the device where a kernel reads them so).
    pub format: lily_model::WeightFormat,
    w: DevWeights,
    s: Scratch,
    prof: crate::profile::Recorder,
    prof_pos: std::sync::atomic::AtomicUsize,
    ablate: std::sync::Mutex<Option<crate::profile::Ablation>>,
    /// key-range splits of the decode attention (fixed by max_seq, so the graph holds)
    att_splits: usize,
    /// What `s.pos` and `s.valid` hold on the device (-1: unknown). A decode
    /// step advances `s.pos` itself, so consecutive steps upload nothing.
    dev_pos: AtomicI64,
    dev_valid: AtomicI64,
    /// The state whose last choice `s.next` holds (0: none), so a greedy step
    /// feeds it from there without an upload; `state_ids` numbers the states from 1.
    next_owner: AtomicU64,
    state_ids: AtomicU64,
    /// Whether the current layer's first decode launch (which clears its
    /// flags) was recorded, i.e. not dropped by an ablation capture.
    flags_cleared: std::sync::atomic::AtomicBool,
    /// The screened greedy lm_head's buffers (`GreedyHead::Screen`)
    screen: Option<HeadScreen>,
}

/// Device memory a model needs, in bytes: (weights, per-sequence state,
/// activations); `format`: how the checkpoint stores its linear weights.
pub fn memory_estimate(
    cfg: &Config,
    opts: &CudaOptions,
    format: lily_model::WeightFormat,
) -> (usize, usize, usize) {
    let t = opts.prefill_chunk;
    let (d, hq, hkv, dh) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let (c, hv, dk, dv, w) = (
        cfg.conv_dim(),
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel_dim,
    );
    let mut state = 0;
    for k in &cfg.layer_kinds {
        state += match k {
            LayerKind::Attention => 2 * opts.max_seq * hkv * dh * 2,
            LayerKind::Gdn => c * (w - 1) * 4 + hv * dk * dv * 4,
        };
    }
    let (e, kk) = (cfg.num_experts, cfg.num_experts_per_tok);
    let fmax = cfg
        .moe_intermediate_size
        .max(cfg.shared_expert_intermediate_size);
    let wide = d.max(hq * dh).max(hv * dv);
    let act = t * 4
        + t * d * 4 * 2
        + t * wide * 2
        + t * cfg.q_proj_rows().max(c) * 4
        + t * hv * dv * 4
        + 2 * t * hkv * dh * 4
        + t * 2 * hv * 4
        + t * c * 4
        + t * wide * 4
        + t * (e + 1) * 4
        + t * kk * 4
        + t * (kk + 1) * 4
        + (kk + 1) * fmax * 2
        + cfg.vocab_size * 4 * 2
        + logprobs_scratch_bytes(cfg.vocab_size, LOGPROBS_MAX_N)
        + logprobs_out_len(LOGPROBS_MAX_N) * 4
        + gdn_chunked_scratch_bytes(t, hv, dv)
        + attention_decode_scratch_bytes(hq, dh, attention_decode_splits(opts.max_seq))
        + grouped_bytes(cfg, t);
    (
        weight_bytes(cfg, format != lily_model::WeightFormat::Dense)
            + HeadScreen::bytes_for(cfg, opts.greedy_head == GreedyHead::Screen),
        state,
        act,
    )
}

impl CudaModel {
    pub fn load(
        gpu: Gpu,
        cfg: Config,
        w: &Weights,
        opts: CudaOptions,
        verbose: bool,
    ) -> Result<CudaModel> {
        if opts.max_seq == 0 || opts.max_seq > 262_144 {
            bail!("--max-seq must be in 1..=262144, got {}", opts.max_seq);
        }
        if opts.prefill_chunk == 0 || opts.prefill_chunk > 65_536 {
            bail!(
                "--prefill-chunk must be in 1..=65536, got {}",
                opts.prefill_chunk
            );
        }
        let (wb, sb, ab) = memory_estimate(&cfg, &opts, w.format);
        let (free, total) = gpu.free_memory()?;
        if verbose {
            eprintln!(
                "lily: {} | weights {:.1} GiB + state {:.2} GiB (max-seq {}) + activations {:.2} GiB; {:.1} of {:.1} GiB free",
                gpu.name,
                gib(wb),
                gib(sb),
                opts.max_seq,
                gib(ab),
                gib(free),
                gib(total)
            );
        }
        // keep 512 MiB for cuBLAS workspaces and the driver
        if wb + sb + ab + (512 << 20) > free {
            bail!(
                "not enough GPU memory: the model needs {:.1} GiB (weights {:.1} + state {:.2} for --max-seq {} + activations {:.2}) but {:.1} GiB are free on {}; lower --max-seq, use --greedy-head full (no int8 copy of the lm_head, {:.2} GiB) or free the GPU",
                gib(wb + sb + ab),
                gib(wb),
                gib(sb),
                opts.max_seq,
                gib(ab),
                gib(free),
                gpu.name,
                gib(HeadScreen::bytes_for(&cfg, opts.greedy_head == GreedyHead::Screen))
            );
        }
        let t0 = std::time::Instant::now();
        let progress = |i: usize, n: usize| {
            if verbose && (i == n || i.is_multiple_of(10)) {
                eprintln!(
                    "lily: uploaded layer {i}/{n} ({:.1}s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        };
        let dw = upload(&gpu, &cfg, w, &progress)?;
        let s = Self::scratch(&gpu, &cfg, &opts)?;
        let screen = if HeadScreen::applies(&cfg, opts.greedy_head == GreedyHead::Screen) {
            Some(HeadScreen::build(&gpu, &dw.lm_head, cfg.vocab_size)?)
        } else {
            None
        };
        let att_splits = attention_decode_splits(opts.max_seq);
        Ok(CudaModel {
            gpu,
            cfg,
            opts,
            format: w.format,
            w: dw,
            s,
            prof: crate::profile::Recorder::new(),
            prof_pos: std::sync::atomic::AtomicUsize::new(0),
            ablate: std::sync::Mutex::new(None),
            att_splits,
            dev_pos: AtomicI64::new(-1),
            dev_valid: AtomicI64::new(-1),
            next_owner: AtomicU64::new(0),
            state_ids: AtomicU64::new(1),
            flags_cleared: Default::default(),
            screen,
        })
    }

    /// Whether greedy decode steps pick through the screened lm_head
    /// (`GreedyHead::Screen` on a model the screen kernels cover).
    pub fn head_screened(&self) -> bool {
        self.screen.is_some()
    }

    fn scratch(gpu: &Gpu, cfg: &Config, o: &CudaOptions) -> Result<Scratch> {
        let t = o.prefill_chunk;
        let (d, hq, hkv, dh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (c, hv, dv) = (
            cfg.conv_dim(),
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
        );
        let (e, k) = (cfg.num_experts, cfg.num_experts_per_tok);
        let fmax = cfg
            .moe_intermediate_size
            .max(cfg.shared_expert_intermediate_size);
        let wide = d.max(hq * dh).max(hv * dv);
        Ok(Scratch {
            ids: gpu.alloc(t * 4)?,
            pos: gpu.alloc(4)?,
            x: gpu.alloc(t * d * 4)?,
            h: gpu.alloc(t * wide * 2)?,
            big: gpu.alloc(t * cfg.q_proj_rows().max(c) * 4)?,
            z: gpu.alloc(t * hv * dv * 4)?,
            k: gpu.alloc(t * hkv * dh * 4)?,
            v: gpu.alloc(t * hkv * dh * 4)?,
            ba: gpu.alloc(t * 2 * hv * 4)?,
            conv: gpu.alloc(t * c * 4)?,
            q: gpu.alloc(t * wide * 4)?,
            delta: gpu.alloc(t * d * 4)?,
            rl: gpu.alloc(t * (e + 1) * 4)?,
            idx: gpu.alloc(t * k * 4)?,
            wts: gpu.alloc(t * (k + 1) * 4)?,
            moe_h: gpu.alloc((k + 1) * fmax * 2)?,
            logits: gpu.alloc(cfg.vocab_size * 4)?,
            pen: gpu.alloc(cfg.vocab_size * 4)?,
            lp_part: gpu.alloc(logprobs_scratch_bytes(cfg.vocab_size, LOGPROBS_MAX_N))?,
            lp_out: gpu.alloc(logprobs_out_len(LOGPROBS_MAX_N) * 4)?,
            next: gpu.alloc(4)?,
            best: {
                let b = gpu.alloc(8)?;
                gpu.zero(b.ptr, 8)?;
                b
            },
            valid: gpu.alloc(4)?,
            host_next: gpu.alloc_mapped(2)?,
            counter: {
                let c = gpu.alloc(4)?;
                gpu.zero(c.ptr, 4)?;
                c
            },
            flags: {
                let r = gpu.alloc(FLAG_BYTES)?;
                gpu.zero(r.ptr, FLAG_BYTES)?;
                r
            },
            gdn: gpu.alloc(gdn_chunked_scratch_bytes(t, hv, dv))?,
            att: gpu.alloc(attention_decode_scratch_bytes(
                hq,
                dh,
                attention_decode_splits(o.max_seq),
            ))?,
            grouped: {
                let (f, fs) = (
                    cfg.moe_intermediate_size,
                    cfg.shared_expert_intermediate_size,
                );
                let pairs = t * k;
                Grouped {
                    counts: gpu.alloc(e * 4)?,
                    offsets: gpu.alloc(e * 4)?,
                    tiles: gpu.alloc(tile_list_len(pairs, e) * 4)?,
                    rowmap: gpu.alloc(pairs * 4)?,
                    src: gpu.alloc(pairs * 4)?,
                    hs: gpu.alloc(pairs * f * 2)?,
                    ys: gpu.alloc(pairs * d * 4)?,
                    hsh: gpu.alloc(t * fs * 2)?,
                    osh: gpu.alloc(t * d * 4)?,
                }
            },
        })
    }

    pub fn new_state(&self) -> Result<CudaState> {
        let cfg = &self.cfg;
        let mut layers = Vec::new();
        for k in &cfg.layer_kinds {
            let pair = match k {
                LayerKind::Attention => {
                    let n = self.opts.max_seq * cfg.num_key_value_heads * cfg.head_dim * 2;
                    (self.gpu.alloc(n)?, self.gpu.alloc(n)?)
                }
                LayerKind::Gdn => {
                    let conv = cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1) * 4;
                    let s = cfg.linear_num_value_heads
                        * cfg.linear_key_head_dim
                        * cfg.linear_value_head_dim
                        * 4;
                    let (a, b) = (self.gpu.alloc(conv)?, self.gpu.alloc(s)?);
                    self.gpu.zero(a.ptr, conv)?;
                    self.gpu.zero(b.ptr, s)?;
                    (a, b)
                }
            };
            layers.push(pair);
        }
        Ok(CudaState {
            pos: 0,
            layers,
            graphs: [None, None],
            id: self.state_ids.fetch_add(1, Ordering::Relaxed),
            last: None,
            choice: None,
        })
    }

    /// Move `st` forward `n` positions without running them: the K/V rows
    /// there are zeroed, the recurrent states stay as they are. For a decode
    /// benchmark at long context (`lily bench --fill zeros`): a decode step's
    /// work depends on its position, not on what fills the cache, and a
    /// 131k-token prefill costs minutes. Not a way to feed tokens.
    pub fn advance_unfilled(&self, st: &mut CudaState, n: usize) -> Result<()> {
        let cfg = &self.cfg;
        if st.pos + n > self.opts.max_seq {
            bail!(
                "advancing to {} exceeds --max-seq {}",
                st.pos + n,
                self.opts.max_seq
            );
        }
        let row = cfg.num_key_value_heads * cfg.head_dim * 2;
        for (k, (a, b)) in cfg.layer_kinds.iter().zip(&st.layers) {
            if *k == LayerKind::Attention {
                self.gpu.zero(a.at(st.pos * row), n * row)?;
                self.gpu.zero(b.at(st.pos * row), n * row)?;
            }
        }
        st.pos += n;
        Ok(())
    }

    pub(super) fn check(&self, st: &CudaState, tokens: &[u32]) -> Result<()> {
        let v = self.cfg.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&x| x as usize >= v) {
            bail!("token id {bad} is out of range: the model has {v} vocabulary rows");
        }
        if st.pos + tokens.len() > self.opts.max_seq {
            bail!(
                "sequence of {} tokens exceeds --max-seq {}",
                st.pos + tokens.len(),
                self.opts.max_seq
            );
        }
        Ok(())
    }

    /// Feed tokens in chunks of at most `prefill_chunk`; `after(n)` runs after
    /// each chunk of n tokens, while its residual stream is still in `s.x`.
    fn run_chunks(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        after: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        self.check(st, tokens)?;
        for chunk in tokens.chunks(self.opts.prefill_chunk) {
            let n = chunk.len();
            self.stage_chunk(st, chunk)?;
            self.layers(st, n, self.s.ids.ptr)?;
            st.pos += n;
            after(n)?;
        }
        Ok(())
    }

    /// Upload a prefill chunk's ids to `s.ids` and the state's position to
    /// `s.pos`, where its `layers` launches read them.
    pub(super) fn stage_chunk(&self, st: &CudaState, chunk: &[u32]) -> Result<()> {
        let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
        self.gpu.upload(self.s.ids.ptr, &ids)?;
        self.set_pos(st.pos)
    }

    /// Feed tokens; returns the logits of every position when `all`, else of
    /// the last one, on the host.
    pub fn forward(&self, st: &mut CudaState, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        let v = self.cfg.vocab_size;
        if tokens.len() == 1 {
            self.check(st, tokens)?;
            self.gpu.upload(self.s.next.ptr, &[tokens[0] as i32])?;
            self.decode_step(st, v, false)?;
            // the caller chooses from the logits: no greedy choice to feed
            st.last = None;
            self.next_owner.store(0, Ordering::Relaxed);
            return self.gpu.download::<f32>(self.s.logits.ptr, v);
        }
        if all {
            return self.forward_rows(st, tokens, 0);
        }
        let mut last = 0;
        self.run_chunks(st, tokens, &mut |n| {
            last = n;
            Ok(())
        })?;
        if last == 0 {
            return Ok(Vec::new());
        }
        self.head(last - 1, 1, self.s.logits.ptr)?;
        self.gpu.download::<f32>(self.s.logits.ptr, v)
    }

    /// Prefill `tokens` (chunked as any prefill); returns the logits of
    /// positions `from..` of them, [tokens.len() - from, vocab] on the host
    /// (a long prompt's last rows without the whole prompt's logits).
    pub fn forward_rows(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        from: usize,
    ) -> Result<Vec<f32>> {
        let v = self.cfg.vocab_size;
        if from > tokens.len() {
            bail!("rows from {from} of {} tokens", tokens.len());
        }
        let mut out = Vec::new();
        let mut start = 0;
        self.run_chunks(st, tokens, &mut |n| {
            let r0 = from.saturating_sub(start).min(n);
            start += n;
            if r0 < n {
                let buf = self.gpu.alloc((n - r0) * v * 4)?;
                self.head(r0, n - r0, buf.ptr)?;
                out.extend(self.gpu.download::<f32>(buf.ptr, (n - r0) * v)?);
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Upload the position the next launches run at.
    pub(super) fn set_pos(&self, pos: usize) -> Result<()> {
        self.gpu.upload(self.s.pos.ptr, &[pos as i32])?;
        self.dev_pos.store(pos as i64, Ordering::Relaxed);
        Ok(())
    }
}
