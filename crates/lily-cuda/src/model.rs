//! The CUDA forward pass: the same layer sequence as the CPU reference, as an
//! explicit list of kernel launches into buffers allocated once. Prefill runs
//! chunks of up to `prefill_chunk` tokens through cuBLAS GEMMs; decode (one
//! token) uses Lily's matrix-vector kernels. Positions and token ids live in
//! device memory, and a decode step allocates nothing and never waits on the
//! host, so it can be captured in a CUDA graph.

use anyhow::{bail, Result};
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
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            max_seq: 32_768,
            prefill_chunk: 4096,
        }
    }
}

/// Per-sequence device state: KV caches of the attention layers, conv and
/// recurrent states of the GDN layers.
pub struct CudaState {
    pub pos: usize,
    /// per layer: (k cache, v cache) [max_seq, Hkv, Dh] bf16, or (conv [C, W-1] f32, S [Hv, Dk, Dv] f32)
    layers: Vec<(DevBuf, DevBuf)>,
}

/// Activation buffers for up to `prefill_chunk` tokens.
struct Scratch {
    ids: DevBuf,    // [T] i32
    pos: DevBuf,    // [1] i32
    x: DevBuf,      // [T, D] f32 residual
    h: DevBuf,      // [T, max(D, Hq*Dh, Hv*Dv)] bf16: GEMM inputs
    big: DevBuf,    // [T, max(q rows, C)] f32: q_proj / in_proj_qkv output
    z: DevBuf,      // [T, Hv*Dv] f32
    k: DevBuf,      // [T, Hkv*Dh] f32
    v: DevBuf,      // [T, Hkv*Dh] f32
    ba: DevBuf,     // [T, 2 Hv] f32
    conv: DevBuf,   // [T, C] f32
    q: DevBuf,      // [T, max(Hq*Dh, Hv*Dv)] f32: roped q, or GDN core output
    delta: DevBuf,  // [T, D] f32 mixer output
    rl: DevBuf,     // [T, E+1] f32 router logits
    idx: DevBuf,    // [T, K] i32
    wts: DevBuf,    // [T, K+1] f32
    moe_h: DevBuf,  // [T, K+1, max(F, Fs)] bf16
    logits: DevBuf, // [V] f32
    next: DevBuf,   // [1] i32 sampled token
    gdn: DevBuf,    // per-chunk records of the chunked GDN prefill
}

pub struct CudaModel {
    pub gpu: Gpu,
    pub cfg: Config,
    pub opts: CudaOptions,
    w: DevWeights,
    s: Scratch,
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
        + t * (kk + 1) * fmax * 2
        + cfg.vocab_size * 4
        + crate::gdn::gdn_chunked_scratch_bytes(t, hv, dv);
    (weight_bytes(cfg), state, act)
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
        Ok(CudaModel {
            gpu,
            cfg,
            opts,
            w: dw,
            s,
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
            moe_h: gpu.alloc(t * (k + 1) * fmax * 2)?,
            logits: gpu.alloc(cfg.vocab_size * 4)?,
            next: gpu.alloc(4)?,
            gdn: gpu.alloc(crate::gdn::gdn_chunked_scratch_bytes(t, hv, dv))?,
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
        Ok(CudaState { pos: 0, layers })
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
        for (l, (lw, ls)) in self.w.layers.iter().zip(st.layers.iter()).enumerate() {
            self.add_norm(s.x.ptr, None, &lw.input_norm, s.h.ptr, t)?;
            match &lw.mixer {
                DevMixer::Attention(_) => self.attention(lw, ls, t)?,
                DevMixer::Gdn(_) => self.gdn(lw, ls, t)?,
            }
            self.add_norm(s.x.ptr, Some(s.delta.ptr), &lw.post_norm, s.h.ptr, t)?;
            self.moe(lw, t)
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
        self.linear(s.h.ptr, &a.q, s.big.ptr, t, cfg.q_proj_rows(), d)?;
        self.linear(s.h.ptr, &a.k, s.k.ptr, t, hkv * dh, d)?;
        self.linear(s.h.ptr, &a.v, s.v.ptr, t, hkv * dh, d)?;
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
        self.linear(s.h.ptr, &a.o, s.delta.ptr, t, d, hq * dh)
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
        self.linear(s.h.ptr, &w.qkv, s.big.ptr, t, c, d)?;
        self.linear(s.h.ptr, &w.z, s.z.ptr, t, hv * dv, d)?;
        self.linear(s.h.ptr, &w.ba, s.ba.ptr, t, 2 * hv, d)?;
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
        if t > 1 {
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
        } else {
            g.launch(
                "gdn_recurrent_kernel",
                (hv as u32, (dv / 32) as u32, 1),
                (32, 1, 1),
                0,
                &[
                    Arg::Ptr(s.conv.ptr),
                    Arg::Ptr(s.ba.ptr),
                    Arg::Ptr(w.a_log.ptr),
                    Arg::Ptr(w.dt_bias.ptr),
                    Arg::Ptr(st.1.ptr),
                    Arg::Ptr(s.q.ptr),
                    Arg::I32(t as i32),
                    Arg::I32(hk as i32),
                    Arg::I32(hv as i32),
                    Arg::I32(dv as i32),
                ],
            )?;
        }
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
        self.linear(s.h.ptr, &w.out, s.delta.ptr, t, d, hv * dv)
    }

    fn moe(&self, lw: &DevLayer, t: usize) -> Result<()> {
        let (cfg, g, s) = (&self.cfg, &self.gpu, &self.s);
        let (d, e, k, f, fs) = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
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
        let fmax = f.max(fs);
        g.launch(
            "moe_gate_up_kernel",
            (fmax.div_ceil(8) as u32, (k + 1) as u32, t as u32),
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
            ],
        )?;
        g.launch(
            "moe_down_kernel",
            (d.div_ceil(8) as u32, t as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(s.moe_h.ptr),
                Arg::Ptr(lw.down.ptr),
                Arg::Ptr(lw.shared_down.ptr),
                Arg::Ptr(s.idx.ptr),
                Arg::Ptr(s.wts.ptr),
                Arg::Ptr(s.x.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
            ],
        )
    }

    /// Logits of rows [r0, r0+n) of the residual stream into `out` ([n, V] f32).
    fn head(&self, r0: usize, n: usize, out: u64) -> Result<()> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let s = &self.s;
        self.add_norm(s.x.at(r0 * d * 4), None, &self.w.norm, s.h.ptr, n)?;
        self.linear(s.h.ptr, &self.w.lm_head, out, n, v, d)
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

    /// One greedy decode step fully on the device: feed the token in `s.next`
    /// (the previous step's choice), write the argmax to `s.next`, and copy
    /// only that id to the host.
    pub fn decode_greedy(&self, st: &mut CudaState) -> Result<u32> {
        if st.pos + 1 > self.opts.max_seq {
            bail!("sequence exceeds --max-seq {}", self.opts.max_seq);
        }
        let s = &self.s;
        self.gpu.upload(s.pos.ptr, &[st.pos as i32])?;
        // the token to feed is the one the last step chose
        self.gpu.launch(
            "copy_i32_kernel",
            (1, 1, 1),
            (32, 1, 1),
            0,
            &[Arg::Ptr(s.next.ptr), Arg::Ptr(s.ids.ptr)],
        )?;
        self.layers(st, 1)?;
        st.pos += 1;
        self.pick_row(0, self.cfg.vocab_size, &GpuSampleParams::greedy(), 0.0)
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
        self.run_chunks(st, &[token], &mut |_| Ok(()))?;
        self.pick_row(0, valid, p, u)
    }

    fn pick_row(&self, row: usize, valid: usize, p: &GpuSampleParams, u: f32) -> Result<u32> {
        let s = &self.s;
        self.head(row, 1, s.logits.ptr)?;
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
