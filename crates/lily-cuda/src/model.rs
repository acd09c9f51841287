//! The CUDA forward pass: the same layer sequence as the CPU reference, as an
//! explicit list of kernel launches into buffers allocated once. Prefill runs
//! chunks of up to `prefill_chunk` tokens through cuBLAS GEMMs; decode (one
//! token) uses Lily's matrix-vector kernels. Positions and token ids live in
//! device memory, and a decode step allocates nothing and never waits on the
//! host, so it can be captured in a CUDA graph.

use anyhow::{bail, Context, Result};
use lily_model::{Config, LayerKind, Weights};

use crate::gpu::{Arg, DevBuf, Gpu};
use crate::sampling::{sample_into, GpuSampleParams};
use crate::weights::{upload, weight_bytes, DevLayer, DevMixer, DevWeights};

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
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_seq: 32_768,
            prefill_chunk: 4096,
            graphs: std::env::var("LILY_CUDA_GRAPH")
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
    /// The decode step (layers + lm_head into the logits buffer) captured on
    /// this state's buffers at its first decode, replayed after.
    graph: Option<StepGraph>,
}

/// A captured decode step. The graph refers to this state's buffers and the
/// model's scratch; it is only launched from the thread that owns the state.
struct StepGraph(cudarc::driver::CudaGraph);
// SAFETY: a CUgraphExec may be launched from any thread as long as calls on it
// are serialised, which `&mut CudaState` guarantees.
unsafe impl Send for StepGraph {}

/// Activation buffers for up to `prefill_chunk` tokens.
struct Scratch {
    ids: DevBuf,     // [T] i32
    pos: DevBuf,     // [1] i32
    x: DevBuf,       // [T, D] f32 residual
    h: DevBuf,       // [T, max(D, Hq*Dh, Hv*Dv)] bf16: GEMM inputs
    big: DevBuf,     // [T, max(q rows, C)] f32: q_proj / in_proj_qkv output
    z: DevBuf,       // [T, Hv*Dv] f32
    k: DevBuf,       // [T, Hkv*Dh] f32
    v: DevBuf,       // [T, Hkv*Dh] f32
    ba: DevBuf,      // [T, 2 Hv] f32
    conv: DevBuf,    // [T, C] f32
    q: DevBuf,       // [T, max(Hq*Dh, Hv*Dv)] f32: roped q, or GDN core output
    delta: DevBuf,   // [T, D] f32 mixer output
    rl: DevBuf,      // [T, E+1] f32 router logits
    idx: DevBuf,     // [T, K] i32
    wts: DevBuf,     // [T, K+1] f32
    moe_h: DevBuf,   // [K+1, max(F, Fs)] bf16 (decode; prefill runs grouped)
    logits: DevBuf,  // [V] f32
    next: DevBuf,    // [1] i32 sampled token
    counter: DevBuf, // [1] u32 blocks done, for kernels whose last block finishes the job
    gdn: DevBuf,     // per-chunk records of the chunked GDN prefill
    att: DevBuf,     // split-K partials of the decode attention
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

/// Bytes of the grouped-GEMM MoE buffers for chunks of `t` tokens.
fn grouped_bytes(cfg: &Config, t: usize) -> usize {
    let (d, e, k, f, fs) = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    );
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
        + crate::attention::attention_decode_scratch_bytes(
            hq,
            dh,
            crate::attention::attention_decode_splits(opts.max_seq),
        )
        + grouped_bytes(cfg, t);
    (weight_bytes(cfg), state, act)
}

/// Bytes the attention core of one decode step moves at `context` cached
/// tokens: K and V rows read (bf16), q / gate in, the new K/V row and the output.
/// The query/key preparation's share of `attention_core_bytes`: the q, gate,
/// k and v rows it reads.
fn attention_prep_bytes(cfg: &Config) -> u64 {
    cfg.q_proj_rows() as u64 * 4 + 2 * (cfg.num_key_value_heads * cfg.head_dim) as u64 * 4
}

fn attention_core_bytes(cfg: &Config, context: usize) -> u64 {
    let (hq, hkv, dh) = (
        cfg.num_attention_heads as u64,
        cfg.num_key_value_heads as u64,
        cfg.head_dim as u64,
    );
    2 * (context as u64 + 1) * hkv * dh * 2
        + cfg.q_proj_rows() as u64 * 4
        + 2 * hkv * dh * 4
        + hq * dh * 2
}

/// Bytes the GDN core of one decode step moves: the conv (`gdn_conv_bytes`)
/// and the f32 recurrent state read and written.
fn gdn_core_bytes(cfg: &Config) -> u64 {
    let s = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        as u64
        * 4;
    gdn_conv_bytes(cfg) + 2 * s
}

/// The conv's share: its state read and written, its weights, input and output.
fn gdn_conv_bytes(cfg: &Config) -> u64 {
    let (c, w) = (cfg.conv_dim() as u64, cfg.linear_conv_kernel_dim as u64);
    2 * c * (w - 1) * 4 + c * w * 4 + c * 4 * 2
}

/// Weight bytes of the experts one token reads in one MoE layer: K routed and the shared one.
fn moe_expert_bytes(cfg: &Config) -> u64 {
    let d = cfg.hidden_size as u64;
    let (k, f, fs) = (
        cfg.num_experts_per_tok as u64,
        cfg.moe_intermediate_size as u64,
        cfg.shared_expert_intermediate_size as u64,
    );
    k * 3 * f * d * 2 + 3 * fs * d * 2
}

/// The gate|up rows of the routed and the shared experts: two thirds of
/// `moe_expert_bytes`.
fn moe_gate_up_bytes(cfg: &Config) -> u64 {
    let d = cfg.hidden_size as u64;
    let (k, f, fs) = (
        cfg.num_experts_per_tok as u64,
        cfg.moe_intermediate_size as u64,
        cfg.shared_expert_intermediate_size as u64,
    );
    k * 2 * f * d * 2 + 2 * fs * d * 2
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
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
                "not enough GPU memory: the model needs {:.1} GiB (weights {:.1} + state {:.2} for --max-seq {} + activations {:.2}) but {:.1} GiB are free on {}; lower --max-seq or free the GPU",
                gib(wb + sb + ab),
                gib(wb),
                gib(sb),
                opts.max_seq,
                gib(ab),
                gib(free),
                gpu.name
            );
        }
        let t0 = std::time::Instant::now();
        let progress = |i: usize, n: usize| {
            if verbose && (i == n || i % 10 == 0) {
                eprintln!(
                    "lily: uploaded layer {i}/{n} ({:.1}s)",
                    t0.elapsed().as_secs_f64()
                );
            }
        };
        let dw = upload(&gpu, &cfg, w, &progress)?;
        let s = Self::scratch(&gpu, &cfg, &opts)?;
        let att_splits = crate::attention::attention_decode_splits(opts.max_seq);
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
        })
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
            counter: {
                let c = gpu.alloc(4)?;
                gpu.zero(c.ptr, 4)?;
                c
            },
            gdn: gpu.alloc(crate::gdn::gdn_chunked_scratch_bytes(t, hv, dv))?,
            att: gpu.alloc(crate::attention::attention_decode_scratch_bytes(
                hq,
                dh,
                crate::attention::attention_decode_splits(o.max_seq),
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
            graph: None,
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

    /// y[T, N] f32 = x[T, K] bf16 . W[N, K]^T: Lily's GEMV for one token, cuBLAS otherwise.
    fn linear(&self, x: u64, w: &DevBuf, y: u64, t: usize, n: usize, k: usize) -> Result<()> {
        debug_assert_eq!(w.bytes, n * k * 2);
        if t == 1 {
            self.gpu.launch(
                "gemv_kernel",
                (n.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(w.ptr),
                    Arg::Ptr(x),
                    Arg::Ptr(y),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                ],
            )
        } else {
            self.gpu.gemm_bf16_f32(x, w.ptr, y, t, n, k)
        }
    }

    /// Three projections of the same input x[T, K]: one launch for a decode
    /// token, three GEMMs for prefill. Each entry is (weight [N, K], y [T, N], N).
    /// A decode token's input is `norm` of the residual stream, computed by
    /// the kernel itself (`x` unused); prefill's is `x`, normed before.
    fn linear3(
        &self,
        x: u64,
        t: usize,
        k: usize,
        p: [(&DevBuf, u64, usize); 3],
        norm: &DevBuf,
    ) -> Result<()> {
        if t > 1 {
            for (w, y, n) in p {
                self.linear(x, w, y, t, n, k)?;
            }
            return Ok(());
        }
        let rows: usize = p.iter().map(|e| e.2).sum();
        let mut args = vec![Arg::Ptr(x), Arg::I32(k as i32)];
        for (w, y, n) in p {
            debug_assert_eq!(w.bytes, n * k * 2);
            args.extend([Arg::Ptr(w.ptr), Arg::Ptr(y), Arg::I32(n as i32)]);
        }
        args.extend([
            Arg::Ptr(self.s.x.ptr),
            Arg::Ptr(norm.ptr),
            Arg::F32(self.cfg.rms_norm_eps),
        ]);
        self.gpu.launch(
            "gemv3_kernel",
            (rows.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &args,
        )
    }

    fn add_norm(&self, x: u64, delta: Option<u64>, w: &DevBuf, out: u64, t: usize) -> Result<()> {
        let d = self.cfg.hidden_size;
        self.gpu.launch(
            "add_rmsnorm_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(delta.unwrap_or(0)),
                Arg::Ptr(w.ptr),
                Arg::Ptr(out),
                Arg::I32(d as i32),
                Arg::F32(self.cfg.rms_norm_eps),
            ],
        )
    }

    /// Run `tokens` (already in `s.ids`, T of them, starting at `st.pos` which is
    /// in `s.pos`) through every layer; leaves the residual stream in `s.x`.
    fn layers(&self, st: &mut CudaState, t: usize) -> Result<()> {
        let cfg = &self.cfg;
        let g = &self.gpu;
        let s = &self.s;
        let d = cfg.hidden_size;
        g.launch(
            "embed_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.w.embed.ptr),
                Arg::Ptr(s.ids.ptr),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
            ],
        )?;
        let norm_bytes = (d * 4 * 3 + d * 2) as u64;
        self.mark("embed", (d * 2 + d * 4) as u64)?;
        // One decode token: each RMSNorm is computed by the blocks of the
        // kernels that read it (the mixer's input projections and the router,
        // which passes its copy on to the experts) from the residual stream, which the output
        // projections and the down product update in place; only the final
        // norm runs in the last block of the last down product, leaving the
        // final-normed hidden state in `s.h` for the lm_head.
        let fused = t == 1;
        for (l, (lw, ls)) in self.w.layers.iter().zip(st.layers.iter()).enumerate() {
            if !fused {
                self.add_norm(s.x.ptr, None, &lw.input_norm, s.h.ptr, t)?;
                self.mark("norms", norm_bytes)?;
            }
            match &lw.mixer {
                DevMixer::Attention(_) => self.attention(lw, ls, t)?,
                DevMixer::Gdn(_) => self.gdn(lw, ls, t)?,
            }
            if !fused {
                self.add_norm(s.x.ptr, Some(s.delta.ptr), &lw.post_norm, s.h.ptr, t)?;
                self.mark("norms", norm_bytes)?;
            }
            // the final norm, after the last layer (decode: in the down product's last block)
            let final_norm = (l + 1 == self.w.layers.len()).then_some(&self.w.norm);
            self.moe(lw, t, final_norm)
                .map_err(|e| e.context(format!("layer {l} moe")))?;
        }
        Ok(())
    }

    fn attention(&self, lw: &DevLayer, kv: &(DevBuf, DevBuf), t: usize) -> Result<()> {
        let DevMixer::Attention(a) = &lw.mixer else {
            unreachable!()
        };
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, hq, hkv, dh) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        self.linear3(
            s.h.ptr,
            t,
            d,
            [
                (&a.q, s.big.ptr, cfg.q_proj_rows()),
                (&a.k, s.k.ptr, hkv * dh),
                (&a.v, s.v.ptr, hkv * dh),
            ],
            &lw.input_norm,
        )?;
        self.mark("attn qkv proj", (a.q.bytes + a.k.bytes + a.v.bytes) as u64)?;
        let gated = cfg.attn_output_gate as i32;
        g.launch(
            "qk_prep_kernel",
            (t as u32, (hq + hkv) as u32, 1),
            (dh as u32, 1, 1),
            0,
            &[
                Arg::Ptr(s.big.ptr),
                Arg::Ptr(s.k.ptr),
                Arg::Ptr(s.v.ptr),
                Arg::Ptr(a.q_norm.ptr),
                Arg::Ptr(a.k_norm.ptr),
                Arg::Ptr(s.pos.ptr),
                Arg::Ptr(s.q.ptr),
                Arg::Ptr(kv.0.ptr),
                Arg::Ptr(kv.1.ptr),
                Arg::I32(hq as i32),
                Arg::I32(hkv as i32),
                Arg::I32(dh as i32),
                Arg::I32(cfg.rotary_dim as i32),
                Arg::F32(cfg.rope_theta as f32),
                Arg::F32(cfg.rms_norm_eps),
                Arg::I32(gated),
            ],
        )?;
        self.mark("attn qk prep", attention_prep_bytes(cfg))?;
        if t == 1 {
            // decode: split-K over the cache (flash decoding), then a merge
            crate::attention::attention_decode(
                g,
                s.q.ptr,
                kv.0.ptr,
                kv.1.ptr,
                s.big.ptr,
                s.pos.ptr,
                s.h.ptr,
                s.att.ptr,
                self.att_splits,
                hq,
                hkv,
                dh,
                (dh as f32).powf(-0.5),
                gated != 0,
            )?;
        } else {
            g.launch(
                "attention_kernel",
                (t as u32, hq as u32, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(s.q.ptr),
                    Arg::Ptr(kv.0.ptr),
                    Arg::Ptr(kv.1.ptr),
                    Arg::Ptr(s.big.ptr),
                    Arg::Ptr(s.pos.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::I32(hq as i32),
                    Arg::I32(hkv as i32),
                    Arg::I32(dh as i32),
                    Arg::F32((dh as f32).powf(-0.5)),
                    Arg::I32(gated),
                ],
            )?;
        }
        self.mark(
            "attn core",
            attention_core_bytes(cfg, self.prof_pos()) - attention_prep_bytes(cfg),
        )?;
        self.out_proj(&a.o, hq * dh, t)?;
        self.mark("attn o proj", a.o.bytes as u64)
    }

    fn gdn(&self, lw: &DevLayer, st: &(DevBuf, DevBuf), t: usize) -> Result<()> {
        let DevMixer::Gdn(w) = &lw.mixer else {
            unreachable!()
        };
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, c, hk, hv, dv, wd) = (
            cfg.hidden_size,
            cfg.conv_dim(),
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        );
        self.linear3(
            s.h.ptr,
            t,
            d,
            [
                (&w.qkv, s.big.ptr, c),
                (&w.z, s.z.ptr, hv * dv),
                (&w.ba, s.ba.ptr, 2 * hv),
            ],
            &lw.input_norm,
        )?;
        self.mark("gdn in proj", (w.qkv.bytes + w.z.bytes + w.ba.bytes) as u64)?;
        if t == 1 {
            // decode: conv, recurrence step and gated norm in one kernel
            crate::gdn::gdn_decode(
                g,
                s.big.ptr,
                st.0.ptr,
                w.conv.ptr,
                s.ba.ptr,
                w.a_log.ptr,
                w.dt_bias.ptr,
                s.z.ptr,
                w.norm.ptr,
                st.1.ptr,
                s.h.ptr,
                hk,
                hv,
                dv,
                cfg.rms_norm_eps,
            )?;
        } else {
            g.launch(
                "conv_silu_kernel",
                (c.div_ceil(128) as u32, 1, 1),
                (128, 1, 1),
                0,
                &[
                    Arg::Ptr(s.big.ptr),
                    Arg::Ptr(st.0.ptr),
                    Arg::Ptr(w.conv.ptr),
                    Arg::Ptr(s.conv.ptr),
                    Arg::I32(t as i32),
                    Arg::I32(c as i32),
                    Arg::I32(wd as i32),
                ],
            )?;
            self.mark("gdn conv", gdn_conv_bytes(cfg))?;
            // prefill: the chunked (UT-transform) form, parallel over chunks
            crate::gdn::gdn_chunked_prefill(
                g,
                Some(&s.gdn),
                s.conv.ptr,
                s.ba.ptr,
                w.a_log.ptr,
                w.dt_bias.ptr,
                st.1.ptr,
                s.q.ptr,
                t,
                hk,
                hv,
                dv,
            )?;
            g.launch(
                "gated_rmsnorm_kernel",
                ((t * hv) as u32, 1, 1),
                (dv as u32, 1, 1),
                0,
                &[
                    Arg::Ptr(s.q.ptr),
                    Arg::Ptr(s.z.ptr),
                    Arg::Ptr(w.norm.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::I32(dv as i32),
                    Arg::F32(cfg.rms_norm_eps),
                ],
            )?;
        }
        // (decode: the conv runs inside the core kernel)
        let conv = if t == 1 { 0 } else { gdn_conv_bytes(cfg) };
        self.mark("gdn core", gdn_core_bytes(cfg) - conv)?;
        self.out_proj(&w.out, hv * dv, t)?;
        self.mark("gdn out proj", w.out.bytes as u64)
    }

    /// Prefill experts: sort the chunk's (token, slot) pairs by expert, run
    /// each expert's rows through cuBLAS (gate|up, SiLU, down), the shared
    /// expert over all tokens, then add the weighted sum into the residual.
    /// Each expert's weights are read once per chunk instead of once per token.
    fn moe_grouped(&self, lw: &DevLayer, t: usize) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let gr = &s.grouped;
        let (d, e, k, f, fs) = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let pairs = t * k;
        g.zero(gr.counts.ptr, e * 4)?;
        g.launch(
            "moe_count_kernel",
            (pairs.div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.idx.ptr),
                Arg::I32(pairs as i32),
                Arg::Ptr(gr.counts.ptr),
            ],
        )?;
        // the GEMM sizes are needed on the host: one sync per layer of a prefill chunk
        let counts: Vec<i32> = g.download(gr.counts.ptr, e)?;
        let mut offsets = Vec::with_capacity(e);
        let mut acc = 0i32;
        for c in &counts {
            offsets.push(acc);
            acc += c;
        }
        g.upload(gr.offsets.ptr, &offsets)?;
        g.launch(
            "moe_assign_kernel",
            (e as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.idx.ptr),
                Arg::I32(pairs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(gr.offsets.ptr),
                Arg::Ptr(gr.rowmap.ptr),
                Arg::Ptr(gr.src.ptr),
            ],
        )?;
        g.launch(
            "moe_gather_kernel",
            (pairs as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(gr.src.ptr),
                Arg::Ptr(gr.xs.ptr),
                Arg::I32(d as i32),
            ],
        )?;
        for (x, (&c, &o)) in counts.iter().zip(&offsets).enumerate() {
            if c == 0 {
                continue;
            }
            let (c, o) = (c as usize, o as usize);
            g.gemm_bf16_f32(
                gr.xs.at(o * d * 2),
                lw.gate_up.at(x * 2 * f * d * 2),
                gr.ys.at(o * 2 * f * 4),
                c,
                2 * f,
                d,
            )?;
        }
        self.silu_mul(gr.ys.ptr, gr.hs.ptr, pairs, f)?;
        for (x, (&c, &o)) in counts.iter().zip(&offsets).enumerate() {
            if c == 0 {
                continue;
            }
            let (c, o) = (c as usize, o as usize);
            g.gemm_bf16_f32(
                gr.hs.at(o * f * 2),
                lw.down.at(x * d * f * 2),
                gr.ys.at(o * d * 4),
                c,
                d,
                f,
            )?;
        }
        g.gemm_bf16_f32(s.h.ptr, lw.shared_gate_up.ptr, gr.ysh.ptr, t, 2 * fs, d)?;
        self.silu_mul(gr.ysh.ptr, gr.hsh.ptr, t, fs)?;
        g.gemm_bf16_f32(gr.hsh.ptr, lw.shared_down.ptr, gr.osh.ptr, t, d, fs)?;
        g.launch(
            "moe_combine_kernel",
            (t as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(gr.ys.ptr),
                Arg::Ptr(gr.osh.ptr),
                Arg::Ptr(gr.rowmap.ptr),
                Arg::Ptr(s.wts.ptr),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
                Arg::I32(k as i32),
            ],
        )
    }

    fn silu_mul(&self, y: u64, out: u64, rows: usize, f: usize) -> Result<()> {
        self.gpu.launch(
            "moe_silu_mul_kernel",
            (((rows * f).div_ceil(256)).min(65_535) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(out),
                Arg::U64(rows as u64),
                Arg::I32(f as i32),
            ],
        )
    }

    /// A mixer's output projection h[T, k] -> delta[T, D]; for one decode
    /// token with the residual add fused in (x += W h; the router and the
    /// experts norm x themselves), which prefill runs as its own kernel.
    fn out_proj(&self, w: &DevBuf, k: usize, t: usize) -> Result<()> {
        let (d, s) = (self.cfg.hidden_size, &self.s);
        if t > 1 {
            return self.linear(s.h.ptr, w, s.delta.ptr, t, d, k);
        }
        self.gpu.launch(
            "gemv_add_norm_kernel",
            (d.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(w.ptr),
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(s.delta.ptr),
                Arg::I32(d as i32),
                Arg::I32(k as i32),
                Arg::Ptr(s.x.ptr),
                Arg::Ptr(0), // no norm: x += W h
                Arg::Ptr(s.h.ptr),
                Arg::F32(self.cfg.rms_norm_eps),
                Arg::Ptr(s.counter.ptr),
            ],
        )
    }

    /// The MoE block. A decode token's router norms the residual stream
    /// itself (`post_norm`, every block) and writes the normed input to `s.h`
    /// for the gate/up products; each block of the expert kernels takes the
    /// top-K of the router's logits itself; `final_norm` (after the last
    /// layer) runs in the down product's last block, into `s.h`.
    fn moe(&self, lw: &DevLayer, t: usize, final_norm: Option<&DevBuf>) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, e, k, f, fs) = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        if t == 1 {
            g.launch(
                "router_decode_kernel",
                ((e + 1).div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(lw.router.ptr),
                    Arg::Ptr(s.h.ptr),
                    Arg::Ptr(s.rl.ptr),
                    Arg::I32(d as i32),
                    Arg::I32(e as i32),
                    Arg::Ptr(s.x.ptr),
                    Arg::Ptr(lw.post_norm.ptr),
                    Arg::F32(cfg.rms_norm_eps),
                    Arg::Ptr(s.h.ptr), // the normed input, for the gate/up products
                ],
            )?;
        } else {
            self.linear(s.h.ptr, &lw.router, s.rl.ptr, t, e + 1, d)?;
            g.launch(
                "router_topk_kernel",
                (t.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(s.rl.ptr),
                    Arg::I32(t as i32),
                    Arg::I32(e as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(s.idx.ptr),
                    Arg::Ptr(s.wts.ptr),
                ],
            )?;
        }
        self.mark("moe router", lw.router.bytes as u64)?;
        if t > 1 {
            self.moe_grouped(lw, t)?;
            return self.mark("moe experts", moe_expert_bytes(cfg));
        }
        let fmax = f.max(fs);
        g.launch(
            "moe_gate_up_kernel",
            (fmax.div_ceil(8) as u32, (k + 1) as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.h.ptr),
                Arg::Ptr(lw.gate_up.ptr),
                Arg::Ptr(lw.shared_gate_up.ptr),
                Arg::Ptr(s.idx.ptr),
                Arg::Ptr(s.moe_h.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(s.rl.ptr), // each block routes from the logits
                Arg::I32(e as i32),
            ],
        )?;
        self.mark("moe gate/up", moe_gate_up_bytes(cfg))?;
        // one decode token: the final RMSNorm fused into the last down product
        g.launch(
            "moe_down_norm_kernel",
            (d.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.moe_h.ptr),
                Arg::Ptr(lw.down.ptr),
                Arg::Ptr(lw.shared_down.ptr),
                Arg::Ptr(s.rl.ptr),
                Arg::I32(e as i32),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(final_norm.map_or(0, |n| n.ptr)),
                Arg::Ptr(s.h.ptr),
                Arg::F32(cfg.rms_norm_eps),
                Arg::Ptr(s.counter.ptr),
            ],
        )?;
        self.mark("moe down", moe_expert_bytes(cfg) - moe_gate_up_bytes(cfg))
    }

    /// Logits of rows [r0, r0+n) of the residual stream into `out` ([n, V] f32).
    fn head(&self, r0: usize, n: usize, out: u64) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let s = &self.s;
        self.add_norm(s.x.at(r0 * d * 4), None, &self.w.norm, s.h.ptr, n)?;
        self.linear(s.h.ptr, &self.w.lm_head, out, n, v, d)?;
        self.mark("lm_head", (self.w.lm_head.bytes + v * 4) as u64)
    }

    /// Decode logits into `s.logits`: `layers(_, 1)` left the final-normed
    /// hidden state in `s.h`.
    fn lm_head_decode(&self) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        self.linear(self.s.h.ptr, &self.w.lm_head, self.s.logits.ptr, 1, v, d)?;
        self.mark("lm_head", (self.w.lm_head.bytes + v * 4) as u64)
    }

    fn mark(&self, name: &'static str, bytes: u64) -> Result<()> {
        self.prof.mark(&self.gpu.stream, name, bytes)?;
        if let Some(a) = self.ablate.lock().unwrap().as_mut() {
            self.gpu.set_skip(a.passed(name));
        }
        Ok(())
    }

    /// The position a profiled step runs at (for the KV bytes it reads).
    fn prof_pos(&self) -> usize {
        self.prof_pos.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes one decode step at `context` cached tokens must move: the
    /// weights it reads (the 8 routed experts and the shared one of each MoE
    /// layer, not all 256), the KV cache it scans, the recurrent state it
    /// reads and writes. Over the device bandwidth it is the step's floor.
    pub fn decode_step_bytes(&self, context: usize) -> u64 {
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let mut b = (self.w.lm_head.bytes as u64) + d * 6;
        for lw in &self.w.layers {
            b += lw.router.bytes as u64 + moe_expert_bytes(cfg) + 2 * (d * 4 * 3 + d * 2);
            b += match &lw.mixer {
                DevMixer::Attention(a) => {
                    (a.q.bytes + a.k.bytes + a.v.bytes + a.o.bytes) as u64
                        + attention_core_bytes(cfg, context)
                }
                DevMixer::Gdn(w) => {
                    (w.qkv.bytes + w.z.bytes + w.ba.bytes + w.out.bytes) as u64
                        + gdn_core_bytes(cfg)
                }
            };
        }
        b
    }

    /// Time each kernel group of one decode step at the state's position:
    /// the step launched kernel by kernel with an event after each group
    /// (events recorded inside a captured graph cannot be timed), `runs`
    /// times, the median per group. Groups shorter than a launch (~3 us) read
    /// as the launch gap. The step runs for real: it rewrites the KV row at
    /// `st.pos` and advances the recurrent states, so profile a throwaway state.
    pub fn profile_decode(
        &self,
        st: &mut CudaState,
        runs: usize,
    ) -> Result<Vec<crate::profile::Section>> {
        self.check(st, &[0])?;
        self.gpu.upload(self.s.pos.ptr, &[st.pos as i32])?;
        self.prof_pos
            .store(st.pos, std::sync::atomic::Ordering::Relaxed);
        let mut all: Vec<Vec<crate::profile::Section>> = Vec::new();
        for _ in 0..runs.max(1) {
            self.gpu.sync()?;
            self.prof.begin(8 * self.cfg.layer_kinds.len() + 8)?;
            let r = self
                .prof
                .mark_start(&self.gpu.stream)
                .and_then(|_| self.layers(st, 1))
                .and_then(|_| self.lm_head_decode());
            let marks = self.prof.take().context("profile marks")?;
            r?;
            self.gpu.sync()?;
            all.push(marks.sections()?);
        }
        let mut out = all[0].clone();
        for (i, sec) in out.iter_mut().enumerate() {
            let mut v: Vec<f64> = all.iter().map(|r| r[i].us).collect();
            v.sort_by(f64::total_cmp);
            sec.us = v[v.len() / 2];
        }
        Ok(out)
    }

    /// Each kernel group's cost inside the captured decode step, by ablation:
    /// the step is captured once whole and once without each group's launches
    /// (the skipped kernels' outputs are stale but their successors do the
    /// same work), every graph replayed `reps` times; a group's cost is the
    /// whole step's time minus the step's time without it. Unlike events
    /// between launches this keeps the graph's launch path and the
    /// programmatic overlap between kernels. Returns (whole step us, [(group,
    /// us)]) in step order. Replays advance the state: profile a throwaway one.
    pub fn profile_decode_graph(
        &self,
        st: &mut CudaState,
        reps: usize,
    ) -> Result<(f64, Vec<(&'static str, f64)>)> {
        use crate::profile::Ablation;
        self.check(st, &[0])?;
        self.gpu.upload(self.s.pos.ptr, &[st.pos as i32])?;
        // the groups in step order: one pass with every launch skipped
        *self.ablate.lock().unwrap() = Some(Ablation::learn());
        self.gpu.set_skip(true);
        let r = self.layers(st, 1).and_then(|_| self.lm_head_decode());
        self.gpu.set_skip(false);
        let order = self
            .ablate
            .lock()
            .unwrap()
            .take()
            .map(|a| a.order)
            .unwrap_or_default();
        r?;
        let mut groups: Vec<&'static str> = Vec::new();
        for g in &order {
            if !groups.contains(g) {
                groups.push(g);
            }
        }
        let mut time = |target: Option<&'static str>| -> Result<f64> {
            if let Some(t) = target {
                let a = Ablation::skip(order.clone(), t);
                self.gpu.set_skip(a.skip_first());
                *self.ablate.lock().unwrap() = Some(a);
            }
            let graph = self.capture_step(st);
            *self.ablate.lock().unwrap() = None;
            self.gpu.set_skip(false);
            crate::profile::time_graph(&self.gpu.stream, &graph?, reps)
        };
        let whole = time(None)?;
        let mut out = Vec::new();
        for g in groups {
            out.push((g, whole - time(Some(g))?));
        }
        Ok((whole, out))
    }

    fn check(&self, st: &CudaState, tokens: &[u32]) -> Result<()> {
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
            self.gpu.upload(self.s.pos.ptr, &[st.pos as i32])?;
            self.layers(st, n)?;
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
            self.gpu.upload(self.s.ids.ptr, &[tokens[0] as i32])?;
            self.decode_step(st)?;
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

    /// One decode step of the token already in `s.ids[0]` at position
    /// `st.pos`: every layer and the lm_head, logits into `s.logits`. Replays
    /// the state's captured graph (capturing it the first time).
    fn decode_step(&self, st: &mut CudaState) -> Result<()> {
        if st.pos + 1 > self.opts.max_seq {
            bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
        }
        let s = &self.s;
        self.gpu.upload(s.pos.ptr, &[st.pos as i32])?;
        if !self.opts.graphs {
            self.layers(st, 1)?;
            self.lm_head_decode()?;
        } else {
            if st.graph.is_none() {
                st.graph = Some(StepGraph(self.capture_step(st)?));
            }
            let g = st.graph.as_ref().unwrap();
            g.0.launch()
                .map_err(|e| anyhow::anyhow!("launching the decode graph: {e:?}"))?;
        }
        st.pos += 1;
        Ok(())
    }

    fn capture_step(&self, st: &mut CudaState) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = &self.gpu.stream;
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow::anyhow!("starting the decode graph capture: {e:?}"))?;
        let recorded = self
            .prof
            .mark_start(stream)
            .and_then(|_| self.layers(st, 1))
            .and_then(|_| self.lm_head_decode());
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

    /// One greedy decode step fully on the device: feed the token in `s.next`
    /// (the previous step's choice), write the argmax to `s.next`, and copy
    /// only that id to the host.
    pub fn decode_greedy(&self, st: &mut CudaState) -> Result<u32> {
        let s = &self.s;
        // the token to feed is the one the last step chose
        self.gpu.launch(
            "copy_i32_kernel",
            (1, 1, 1),
            (32, 1, 1),
            0,
            &[Arg::Ptr(s.next.ptr), Arg::Ptr(s.ids.ptr)],
        )?;
        self.decode_step(st)?;
        self.sample_logits(self.cfg.vocab_size, &GpuSampleParams::greedy(), 0.0)
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
        self.pick_row(last.max(1) - 1, valid, p, u)
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
        self.check(st, &[token])?;
        self.gpu.upload(self.s.ids.ptr, &[token as i32])?;
        self.decode_step(st)?;
        self.sample_logits(valid, p, u)
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
