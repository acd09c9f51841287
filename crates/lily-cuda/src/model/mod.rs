//! The CUDA forward pass: the same layer sequence as the CPU reference, as an
//! explicit list of kernel launches into buffers allocated once. Prefill runs
//! chunks of up to `prefill_chunk` tokens through cuBLAS GEMMs; decode (one
//! token) uses Lily's matrix-vector kernels. Positions and token ids live in
//! device memory, and a decode step allocates nothing and never waits on the
//! host, so it can be captured in a CUDA graph. The step also makes its
//! greedy choice, feeds it to the next step and advances the position on the
//! device, so greedy steps can be queued back to back (`decode_greedy_run`).

mod bytes;
mod layers;
mod moe_prefill;
mod profile;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use anyhow::{bail, Context, Result};
use lily_model::{Config, LayerKind, Weights};

use self::bytes::gib;
use crate::gpu::{DevBuf, Gpu};
use crate::lm_head::HeadScreen;
use crate::sampling::{sample_into, GpuSampleParams};
use crate::weights::{upload, weight_bytes, DevWeights};

#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// KV cache length (tokens) preallocated per sequence
    pub max_seq: usize,
    /// Most tokens one prefill launch sequence handles; longer prompts go in pieces
    pub prefill_chunk: usize,
    /// Replay each sequence's decode step from a captured CUDA graph (one
    /// launch instead of ~400); off only to measure what the graph saves
    /// (`LILY_CUDA_GRAPH=0`)
    pub graphs: bool,
    /// One MoE layer's routing computed once and published by a gate/up block
    /// for the down product's blocks (moe.cu `RouteSlot`); off
    /// (`LILY_ROUTE_SLOT=0`) each down block takes the top-K itself
    pub route_slot: bool,
    /// The GDN core counts its blocks as their output is written, and the
    /// output projection starts on that count instead of the core's
    /// completion (which waits for its 2 MB of state stores). Off by default
    /// (`LILY_GDN_SIGNAL=1` turns it on): same output, and measured no faster
    /// (H100, 16th session: 0.1-0.25% slower in four same-call pairs)
    pub gdn_signal: bool,
    /// Greedy decode steps pick their token through an int8 copy of the
    /// lm_head (kernels/lm_head.cu): the same id as the full product's
    /// argmax, from half of its bytes; steps that need the logits take
    /// the full product. `LILY_HEAD_SCREEN=0` turns it off (the copy costs
    /// vocab x hidden bytes of GPU memory)
    pub head_screen: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_seq: 32_768,
            prefill_chunk: 4096,
            graphs: std::env::var("LILY_CUDA_GRAPH")
                .map(|v| v != "0")
                .unwrap_or(true),
            route_slot: std::env::var("LILY_ROUTE_SLOT")
                .map(|v| v != "0")
                .unwrap_or(true),
            gdn_signal: std::env::var("LILY_GDN_SIGNAL")
                .map(|v| v != "0")
                .unwrap_or(false),
            head_screen: std::env::var("LILY_HEAD_SCREEN")
                .map(|v| v != "0")
                .unwrap_or(true),
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
    /// last (the one `decode_greedy` feeds).
    id: u64,
    last: Option<u32>,
}

/// A captured decode step. The graph refers to this state's buffers and the
/// model's scratch; it is only launched from the thread that owns the state.
struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: a CUgraphExec may be launched from any thread as long as calls on it
// are serialised, which `&mut CudaState` guarantees.
unsafe impl Send for StepGraph {}

/// A decode layer's flags (`s.flags`), which its first kernel
/// (`gemv3_kernel`) clears, all 32 u64 words: moe.cu's `RouteSlot` in its
/// first 76 bytes, the GDN core's count of blocks done at `GDN_DONE_OFFSET`.
const FLAG_BYTES: usize = 256;
const GDN_DONE_OFFSET: u64 = 192;

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
    next: DevBuf,                      // [1] i32 sampled token: also the token a decode step feeds
    best: DevBuf, // [1] u64 the decode step's greedy choice as argmax_entry, 0 between steps
    host_next: crate::gpu::HostMapped, // [2] i32 each step's choice, in slot pos & 1, for the host
    valid: DevBuf, // [1] i32 ids below this are eligible for the in-step greedy choice
    counter: DevBuf, // [1] u32 blocks done, for kernels whose last block finishes the job
    flags: DevBuf, // [FLAG_BYTES] a decode layer's MoE route slot and GDN blocks-done count
    gdn: DevBuf,  // per-chunk records of the chunked GDN prefill
    att: DevBuf,  // split-K partials of the decode attention
    grouped: Grouped,
}

/// Prefill MoE as grouped GEMMs: the chunk's (token, slot) pairs sorted by expert.
struct Grouped {
    counts: DevBuf,  // [E] i32 pairs per expert
    offsets: DevBuf, // [E] i32 first row of each expert's block
    rowmap: DevBuf,  // [T*K] i32 row of each pair
    src: DevBuf,     // [T*K] i32 token of each row
    xs: DevBuf,      // [T*K, D] bf16 gathered inputs
    ys: DevBuf,      // [T*K, max(2F, D)] f32 gate|up products, then down products
    hs: DevBuf,      // [T*K, F] bf16 silu(gate) * up
    ysh: DevBuf,     // [T, 2Fs] f32 shared expert gate|up
    hsh: DevBuf,     // [T, Fs] bf16
    osh: DevBuf,     // [T, D] f32 shared expert output
}

/// The MoE sizes every expert launch needs: (hidden D, experts E, routed K,
/// expert width F, shared expert width Fs).
fn moe_dims(cfg: &Config) -> (usize, usize, usize, usize, usize) {
    (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
}

/// Bytes of the grouped-GEMM MoE buffers for chunks of `t` tokens.
fn grouped_bytes(cfg: &Config, t: usize) -> usize {
    let (d, e, k, f, fs) = moe_dims(cfg);
    let pairs = t * k;
    2 * e * 4
        + 2 * pairs * 4
        + pairs * d * 2
        + pairs * (2 * f).max(d) * 4
        + pairs * f * 2
        + t * 2 * fs * 4
        + t * fs * 2
        + t * d * 4
}

pub struct CudaModel {
    pub gpu: Gpu,
    pub cfg: Config,
    pub opts: CudaOptions,
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
    /// The screened greedy lm_head's buffers (`CudaOptions::head_screen`)
    screen: Option<HeadScreen>,
}

/// The decode attention's split count: `attention_decode_splits`' rule, or
/// `LILY_ATTN_SPLITS` (1..=1024) to measure another.
fn decode_splits(max_seq: usize) -> usize {
    std::env::var("LILY_ATTN_SPLITS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map(|n| n.clamp(1, crate::attention::ATTENTION_DECODE_MAX_SPLITS))
        .unwrap_or_else(|| crate::attention::attention_decode_splits(max_seq))
}

/// Device memory a model needs, in bytes: (weights, per-sequence state, activations).
pub fn memory_estimate(cfg: &Config, opts: &CudaOptions) -> (usize, usize, usize) {
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
        + cfg.vocab_size * 4
        + crate::gdn::gdn_chunked_scratch_bytes(t, hv, dv)
        + crate::attention::attention_decode_scratch_bytes(hq, dh, decode_splits(opts.max_seq))
        + grouped_bytes(cfg, t);
    (
        weight_bytes(cfg) + HeadScreen::bytes_for(cfg, opts.head_screen),
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
        let (wb, sb, ab) = memory_estimate(&cfg, &opts);
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
                "not enough GPU memory: the model needs {:.1} GiB (weights {:.1} + state {:.2} for --max-seq {} + activations {:.2}) but {:.1} GiB are free on {}; lower --max-seq, set LILY_HEAD_SCREEN=0 (the greedy lm_head's int8 copy, {:.2} GiB) or free the GPU",
                gib(wb + sb + ab),
                gib(wb),
                gib(sb),
                opts.max_seq,
                gib(ab),
                gib(free),
                gpu.name,
                gib(HeadScreen::bytes_for(&cfg, opts.head_screen))
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
        let screen = if HeadScreen::applies(&cfg, opts.head_screen) {
            Some(HeadScreen::build(&gpu, dw.lm_head.ptr, cfg.vocab_size)?)
        } else {
            None
        };
        let att_splits = decode_splits(opts.max_seq);
        Ok(CudaModel {
            gpu,
            cfg,
            opts,
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
    /// (`CudaOptions::head_screen`, kernels/lm_head.cu).
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
            gdn: gpu.alloc(crate::gdn::gdn_chunked_scratch_bytes(t, hv, dv))?,
            att: gpu.alloc(crate::attention::attention_decode_scratch_bytes(
                hq,
                dh,
                decode_splits(o.max_seq),
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
                    rowmap: gpu.alloc(pairs * 4)?,
                    src: gpu.alloc(pairs * 4)?,
                    xs: gpu.alloc(pairs * d * 2)?,
                    ys: gpu.alloc(pairs * (2 * f).max(d) * 4)?,
                    hs: gpu.alloc(pairs * f * 2)?,
                    ysh: gpu.alloc(t * 2 * fs * 4)?,
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
            let ids: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
            self.gpu.upload(self.s.ids.ptr, &ids)?;
            self.set_pos(st.pos)?;
            self.layers(st, n, self.s.ids.ptr)?;
            st.pos += n;
            after(n)?;
        }
        Ok(())
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
        let mut out = Vec::new();
        let mut last = 0;
        self.run_chunks(st, tokens, &mut |n| {
            last = n;
            if all {
                let buf = self.gpu.alloc(n * v * 4)?;
                self.head(0, n, buf.ptr)?;
                out.extend(self.gpu.download::<f32>(buf.ptr, n * v)?);
            }
            Ok(())
        })?;
        if !all && last > 0 {
            self.head(last - 1, 1, self.s.logits.ptr)?;
            out = self.gpu.download::<f32>(self.s.logits.ptr, v)?;
        }
        Ok(out)
    }

    /// Upload the position the next launches run at.
    pub(super) fn set_pos(&self, pos: usize) -> Result<()> {
        self.gpu.upload(self.s.pos.ptr, &[pos as i32])?;
        self.dev_pos.store(pos as i64, Ordering::Relaxed);
        Ok(())
    }

    /// `set_pos` unless the device already holds `pos` (the previous decode
    /// step advanced it there).
    fn ensure_pos(&self, pos: usize) -> Result<()> {
        if self.dev_pos.load(Ordering::Relaxed) != pos as i64 {
            self.set_pos(pos)?;
        }
        Ok(())
    }

    /// One decode step of the token in `s.next[0]` at position `st.pos`: every
    /// layer and the lm_head, logits into `s.logits`, the greedy choice among
    /// ids below `valid` into `s.next` and `s.pos` advanced, all on the device.
    /// Replays the state's captured graph (capturing it the first time).
    fn decode_step(&self, st: &mut CudaState, valid: usize, greedy_only: bool) -> Result<()> {
        if st.pos + 1 > self.opts.max_seq {
            bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
        }
        let s = &self.s;
        self.ensure_pos(st.pos)?;
        if self.dev_valid.load(Ordering::Relaxed) != valid as i64 {
            self.gpu.upload(s.valid.ptr, &[valid as i32])?;
            self.dev_valid.store(valid as i64, Ordering::Relaxed);
        }
        let screen = greedy_only && self.screen.is_some();
        if !self.opts.graphs {
            self.layers(st, 1, s.next.ptr)?;
            self.lm_head_decode(true, screen)?;
        } else {
            let i = screen as usize;
            if st.graphs[i].is_none() {
                st.graphs[i] = Some(StepGraph(self.capture_step(st, true, screen)?));
            }
            st.graphs[i]
                .as_ref()
                .unwrap()
                .0
                .launch()
                .map_err(|e| anyhow::anyhow!("launching the decode graph: {e:?}"))?;
        }
        st.pos += 1;
        self.next_owner.store(st.id, Ordering::Relaxed);
        // argmax_finish_kernel stops at max_seq - 1
        self.dev_pos
            .store(st.pos.min(self.opts.max_seq - 1) as i64, Ordering::Relaxed);
        Ok(())
    }

    /// Record one decode step into a graph (`advance`, `screen`: see `lm_head_decode`).
    pub(super) fn capture_step(
        &self,
        st: &mut CudaState,
        advance: bool,
        screen: bool,
    ) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = &self.gpu.stream;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow::anyhow!("starting the decode graph capture: {e:?}"))?;
        let recorded = self
            .prof
            .mark_start(stream)
            .and_then(|_| self.layers(st, 1, self.s.next.ptr))
            .and_then(|_| self.lm_head_decode(advance, screen));
        // end the capture even when recording failed, or the stream stays capturing
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded.context("recording the decode step")?;
        let graph = graph
            .map_err(|e| anyhow::anyhow!("instantiating the decode graph: {e:?}"))?
            .ok_or_else(|| anyhow::anyhow!("the decode graph capture recorded nothing"))?;
        graph
            .upload()
            .map_err(|e| anyhow::anyhow!("uploading the decode graph: {e:?}"))?;
        Ok(graph)
    }

    /// Make `s.next` hold the token `st` feeds next: it does already when
    /// `st` wrote it last (its previous step or pick).
    fn feed_last(&self, st: &CudaState) -> Result<()> {
        if self.next_owner.load(Ordering::Relaxed) != st.id {
            let Some(t) = st.last else {
                bail!("greedy decode: this state has chosen no token yet (prefill it first)");
            };
            self.check(st, &[t])?;
            self.gpu.upload(self.s.next.ptr, &[t as i32])?;
        }
        Ok(())
    }

    /// One greedy decode step fully on the device: feed the token in `s.next`
    /// (the previous step's choice), leave the argmax there, and copy only
    /// that id to the host.
    pub fn decode_greedy(&self, st: &mut CudaState) -> Result<u32> {
        self.feed_last(st)?;
        self.decode_step(st, self.cfg.vocab_size, true)?;
        let id = self.gpu.download::<i32>(self.s.next.ptr, 1)?[0] as u32;
        st.last = Some(id);
        Ok(id)
    }

    /// Make `token` the one the next greedy step of `st` feeds: a no-op when
    /// it is the state's own last choice, still in `s.next`.
    pub fn set_next_token(&self, st: &mut CudaState, token: u32) -> Result<()> {
        if st.last == Some(token) && self.next_owner.load(Ordering::Relaxed) == st.id {
            return Ok(());
        }
        self.check(st, &[token])?;
        self.gpu.upload(self.s.next.ptr, &[token as i32])?;
        st.last = Some(token);
        self.next_owner.store(st.id, Ordering::Relaxed);
        Ok(())
    }

    /// Greedy decoding (among the ids below `valid`) of up to `n` tokens with
    /// the next step queued before the current token reaches the host: step
    /// k + 1 feeds choice k straight from device memory, and choice k comes
    /// back through mapped host memory while step k + 1 runs, so the GPU
    /// never idles for the host's round trip. `on_token` sees each choice in
    /// order and says whether to go on. After an early stop the step queued
    /// ahead has consumed that last choice as well (one step spent; the state
    /// is one position further and its pending choice is that step's).
    /// Returns how many tokens `on_token` saw.
    pub fn decode_greedy_run(
        &self,
        st: &mut CudaState,
        n: usize,
        valid: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        if valid == 0 {
            bail!("greedy decode over 0 ids");
        }
        self.feed_last(st)?;
        let v = valid.min(self.cfg.vocab_size);
        let ev = [self.gpu.event()?, self.gpu.event()?];
        let record = |i: usize| {
            ev[i % 2]
                .record(&self.gpu.stream)
                .map_err(|e| anyhow::anyhow!("recording an event: {e:?}"))
        };
        let wait = |i: usize| {
            ev[i % 2]
                .synchronize()
                .map_err(|e| anyhow::anyhow!("CUDA error in a decode step: {e:?}"))
        };
        // q: the position of the oldest step in flight (its choice is in slot q & 1)
        let mut q = st.pos;
        self.decode_step(st, v, true)?;
        record(0)?;
        st.last = None;
        let mut seen = 0;
        loop {
            let ahead = seen + 1 < n && st.pos < self.opts.max_seq;
            if ahead {
                self.decode_step(st, v, true)?;
                record(seen + 1)?;
            }
            wait(seen)?;
            let id = self.s.host_next.get(q & 1) as u32;
            q += 1;
            seen += 1;
            let go = on_token(id)?;
            if ahead && go {
                continue;
            }
            if ahead {
                wait(seen)?;
                st.last = Some(self.s.host_next.get(q & 1) as u32);
            } else {
                st.last = Some(id);
                if go && seen < n {
                    bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
                }
            }
            return Ok(seen);
        }
    }

    /// Prefill, then the greedy choice for the next token (left in `s.next`).
    pub fn prefill_greedy(&self, st: &mut CudaState, tokens: &[u32]) -> Result<u32> {
        self.prefill_sample(
            st,
            tokens,
            self.cfg.vocab_size,
            &GpuSampleParams::greedy(),
            0.0,
        )
    }

    /// Prefill, then choose the next token on the device among the first
    /// `valid` ids (`u` uniform in [0, 1) drives a sampled choice).
    pub fn prefill_sample(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        valid: usize,
        p: &GpuSampleParams,
        u: f32,
    ) -> Result<u32> {
        let mut last = 0;
        self.run_chunks(st, tokens, &mut |n| {
            last = n;
            Ok(())
        })?;
        let id = self.pick_row(last.max(1) - 1, valid, p, u)?;
        st.last = Some(id);
        self.next_owner.store(st.id, Ordering::Relaxed);
        Ok(id)
    }

    /// Feed `token`, then choose the next one on the device; only its id
    /// comes back to the host.
    pub fn decode_sample(
        &self,
        st: &mut CudaState,
        token: u32,
        valid: usize,
        p: &GpuSampleParams,
        u: f32,
    ) -> Result<u32> {
        // bad input is refused before the state moves
        self.check(st, &[token])?;
        p.validate()?;
        if valid == 0 {
            bail!("sampling over 0 logits");
        }
        self.gpu.upload(self.s.next.ptr, &[token as i32])?;
        let valid = valid.min(self.cfg.vocab_size);
        // a greedy choice needs no logits: the screened step
        self.decode_step(st, valid, p.is_greedy())?;
        // the step's own greedy choice (over the same ids), or a draw, both
        // left in s.next
        let id = if p.is_greedy() {
            self.gpu.download::<i32>(self.s.next.ptr, 1)?[0] as u32
        } else {
            self.sample_logits(valid, p, u)?
        };
        st.last = Some(id);
        Ok(id)
    }

    fn pick_row(&self, row: usize, valid: usize, p: &GpuSampleParams, u: f32) -> Result<u32> {
        self.head(row, 1, self.s.logits.ptr)?;
        self.sample_logits(valid, p, u)
    }

    /// Choose a token from `s.logits` on the device; only its id comes back.
    fn sample_logits(&self, valid: usize, p: &GpuSampleParams, u: f32) -> Result<u32> {
        let s = &self.s;
        sample_into(
            &self.gpu,
            s.logits.ptr,
            valid.min(self.cfg.vocab_size),
            p,
            u,
            s.next.ptr,
        )?;
        Ok(self.gpu.download::<i32>(s.next.ptr, 1)?[0] as u32)
    }
}
