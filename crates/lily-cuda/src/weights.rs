//! Weights on the device, uploaded once and re-laid for the kernels: experts
//! fused per layer ([E, 2F, D] gate|up, [E, D, F] down), the router extended
//! by the shared-expert gate row, in_proj_b and in_proj_a stacked, norm
//! weights stored as f32 `1 + w`. Matrices are bf16, or block FP8 where the
//! checkpoint stores them so and a kernel reads FP8 (`DevMat`: the mixers'
//! projections and the experts; codes as stored, scales widened to f32);
//! a quantized matrix anywhere else is dequantized to bf16 at upload.

use anyhow::{bail, Result};
use lily_model::quant::{Scheme, FP8_BLOCK};
use lily_model::tensor::{widen, Storage};
use lily_model::weights::{Ffn, MixerWeights};
use lily_model::{Config, Mat, Weights};

use crate::gpu::{DevBuf, DevMat, Gpu};
use crate::kernels::attention::{attention_prefill_check, Heads};
use crate::kernels::gdn::gdn_decode_check;
use crate::kernels::gdn_chunked::{gdn_chunked_check, GDN_DK};
use crate::kernels::moe::MoeDims;

pub struct DevAttention {
    /// [Hq * Dh * 2, D]
    pub q: DevMat,
    /// [Hkv * Dh, D]
    pub k: DevMat,
    pub v: DevMat,
    /// [D, Hq * Dh]
    pub o: DevMat,
    /// [Dh] f32, 1 + w
    pub q_norm: DevBuf,
    pub k_norm: DevBuf,
}

pub struct DevGdn {
    /// [C, D]
    pub qkv: DevMat,
    /// [Hv * Dv, D]
    pub z: DevMat,
    /// [2 Hv, D]: in_proj_b rows, then in_proj_a rows (bf16)
    pub ba: DevMat,
    /// [C, W] f32
    pub conv: DevBuf,
    /// [Hv] f32
    pub a_log: DevBuf,
    pub dt_bias: DevBuf,
    /// [Dv] f32 (plain weight)
    pub norm: DevBuf,
    /// [D, Hv * Dv]
    pub out: DevMat,
}

pub enum DevMixer {
    Attention(DevAttention),
    Gdn(DevGdn),
}

pub struct DevLayer {
    /// [D] f32, 1 + w
    pub input_norm: DevBuf,
    pub post_norm: DevBuf,
    pub mixer: DevMixer,
    /// [E + 1, D]: the router, then the shared expert's gate row
    pub router: DevBuf,
    /// [E, 2F, D]
    pub gate_up: DevMat,
    /// [E, D, F]
    pub down: DevMat,
    /// [2 Fs, D]
    pub shared_gate_up: DevMat,
    /// [D, Fs]
    pub shared_down: DevMat,
}

pub struct DevWeights {
    /// [V, D]
    pub embed: DevBuf,
    /// [V, D]
    pub lm_head: DevBuf,
    /// [D] f32, 1 + w
    pub norm: DevBuf,
    pub layers: Vec<DevLayer>,
}

/// Bytes the device copy of the weights takes; `fp8`: the matrices the FP8
/// kernels read (the mixers' projections but ba, the experts) as codes and
/// f32 block scales, the rest bf16.
pub fn weight_bytes(cfg: &Config, fp8: bool) -> usize {
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    // bytes of n weights of a matrix the FP8 kernels read
    let q = |n: usize| if fp8 { n + n / (128 * 128) * 4 } else { n * 2 };
    let mut n = 2 * v * d * 2 + d * 4;
    for k in &cfg.layer_kinds {
        n += 2 * d * 4;
        n += match k {
            lily_model::LayerKind::Attention => {
                let (hq, hkv, dh) = (
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                );
                q(cfg.q_proj_rows() * d + 2 * hkv * dh * d + d * hq * dh) + 2 * dh * 4
            }
            lily_model::LayerKind::Gdn => {
                let (c, hv, dv, w) = (
                    cfg.conv_dim(),
                    cfg.linear_num_value_heads,
                    cfg.linear_value_head_dim,
                    cfg.linear_conv_kernel_dim,
                );
                q(c * d + hv * dv * d + d * hv * dv) + 2 * hv * d * 2 + (c * w + 2 * hv + dv) * 4
            }
        };
        let (e, f, fs) = (
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        n += (e + 1) * d * 2 + q(e * 3 * f * d + 3 * fs * d);
    }
    n
}

struct Uploader<'a> {
    gpu: &'a Gpu,
    /// host staging for converted rows
    stage: Vec<u16>,
}

impl Uploader<'_> {
    /// `mats` stacked into one matrix: block FP8 when every one is (e4m3 in
    /// 128 x 128 blocks, both sizes multiples of 128: the kernels' layout),
    /// else bf16.
    fn mat(&mut self, mats: &[&Mat]) -> Result<DevMat> {
        let fp8 = mats.iter().all(|m| {
            m.t.quantized().is_some_and(|q| {
                q.scheme == Scheme::Fp8Block { block: FP8_BLOCK }
                    && m.row0 == 0
                    && m.rows * m.cols == m.t.numel()
                    && m.rows.is_multiple_of(128)
                    && m.cols.is_multiple_of(128)
            })
        });
        if !fp8 {
            return Ok(DevMat::bf16(self.mats(mats)?));
        }
        let codes: usize = mats.iter().map(|m| m.rows * m.cols).sum();
        let data = self.gpu.alloc(codes)?;
        let scales = self.gpu.alloc(codes / (128 * 128) * 4)?;
        let (mut off, mut soff) = (0usize, 0usize);
        for m in mats {
            let q = m.t.quantized().expect("checked above");
            let bytes = q.codes.bytes().expect("FP8 codes are bytes");
            for (i, chunk) in bytes.chunks(1 << 26).enumerate() {
                self.gpu.upload(data.at(off + (i << 26)), chunk)?;
                self.gpu.sync()?;
            }
            self.gpu.upload(scales.at(soff), &q.scale_f32)?;
            off += bytes.len();
            soff += q.scale_f32.len() * 4;
        }
        self.gpu.sync()?;
        Ok(DevMat {
            data,
            scales: Some(scales),
        })
    }

    /// Write `mats` one after the other (rows stacked) into a new bf16 buffer.
    fn mats(&mut self, mats: &[&Mat]) -> Result<DevBuf> {
        let total: usize = mats.iter().map(|m| m.rows * m.cols).sum();
        let buf = self.gpu.alloc(total * 2)?;
        let mut off = 0usize;
        for m in mats {
            self.mat_into(m, buf.at(off * 2))?;
            off += m.rows * m.cols;
        }
        Ok(buf)
    }

    fn mat_into(&mut self, m: &Mat, dst: u64) -> Result<()> {
        let n = m.rows * m.cols;
        let start = m.row0 * m.cols;
        match &m.t.storage {
            Storage::Procedural(p) | Storage::ProceduralRows(p) => {
                let rows_of = matches!(m.t.storage, Storage::ProceduralRows(_)).then_some(m.cols);
                crate::kernels::embed::procedural_fill(self.gpu, dst, *p, start, n, rows_of)
            }
            Storage::Quantized(_) => {
                // where no kernel reads this matrix quantized: dequantized
                // on the host, rounded to bf16 (as transformers does without
                // FP8 kernels)
                let per = 1 << 22;
                let mut f = vec![0f32; per];
                let mut i0 = 0;
                while i0 < n {
                    let k = per.min(n - i0);
                    m.t.read_f32(start + i0, &mut f[..k]);
                    self.stage.clear();
                    self.stage
                        .extend(f[..k].iter().map(|x| half::bf16::from_f32(*x).to_bits()));
                    self.gpu.upload(dst + (i0 * 2) as u64, &self.stage)?;
                    self.gpu.sync()?;
                    i0 += k;
                }
                Ok(())
            }
            Storage::Bytes { .. } => {
                let bytes = m.t.bytes().unwrap();
                let sz = m.t.dtype.size();
                let src = &bytes[start * sz..(start + n) * sz];
                if m.t.dtype == lily_model::DType::BF16 {
                    // bf16 on disk: straight copy (the mmap pages stream through)
                    for (i, chunk) in src.chunks(1 << 26).enumerate() {
                        self.gpu.upload(dst + (i << 26) as u64, chunk)?;
                        self.gpu.sync()?;
                    }
                    return Ok(());
                }
                // f32 / f16: convert to bf16 on the host in slices
                let per = 1 << 22;
                let mut f = vec![0f32; per];
                for (i, chunk) in src.chunks(per * sz).enumerate() {
                    let k = chunk.len() / sz;
                    widen(m.t.dtype, chunk, &mut f[..k]);
                    self.stage.clear();
                    self.stage
                        .extend(f[..k].iter().map(|x| half::bf16::from_f32(*x).to_bits()));
                    self.gpu.upload(dst + (i * per * 2) as u64, &self.stage)?;
                    self.gpu.sync()?;
                }
                Ok(())
            }
        }
    }

    fn f32s(&self, v: &[f32]) -> Result<DevBuf> {
        self.gpu.upload_new(v)
    }

    fn one_plus(&self, v: &[f32]) -> Result<DevBuf> {
        let w: Vec<f32> = v.iter().map(|x| 1.0 + x).collect();
        self.gpu.upload_new(&w)
    }

    fn experts(&mut self, ex: &[Ffn], f: usize, d: usize) -> Result<(DevMat, DevMat)> {
        let gate_up: Vec<&Mat> = ex.iter().flat_map(|x| [&x.gate, &x.up]).collect();
        let down: Vec<&Mat> = ex.iter().map(|x| &x.down).collect();
        if gate_up
            .iter()
            .chain(&down)
            .all(|m| m.t.quantized().is_some())
        {
            return Ok((self.mat(&gate_up)?, self.mat(&down)?));
        }
        let e = ex.len();
        let gu = self.gpu.alloc(e * 2 * f * d * 2)?;
        let dn = self.gpu.alloc(e * d * f * 2)?;
        for (i, x) in ex.iter().enumerate() {
            self.mat_into(&x.gate, gu.at(i * 2 * f * d * 2))?;
            self.mat_into(&x.up, gu.at((i * 2 * f * d + f * d) * 2))?;
            self.mat_into(&x.down, dn.at(i * d * f * 2))?;
        }
        Ok((DevMat::bf16(gu), DevMat::bf16(dn)))
    }
}

/// The checkpoint's shapes against every kernel's, before anything is
/// uploaded: the typed launchers' own checks, so a geometry the kernels do not
/// cover fails at load, naming the size, not at the first step.
pub fn check_geometry(cfg: &Config) -> Result<()> {
    if cfg.linear_key_head_dim != GDN_DK {
        bail!(
            "the CUDA GDN kernels are built for linear_key_head_dim {GDN_DK}, the checkpoint has {}",
            cfg.linear_key_head_dim
        );
    }
    let heads = Heads {
        hq: cfg.num_attention_heads,
        hkv: cfg.num_key_value_heads,
        dh: cfg.head_dim,
    };
    heads.check("the CUDA attention kernels")?;
    attention_prefill_check(heads)?;
    if cfg.rotary_dim > cfg.head_dim || !cfg.rotary_dim.is_multiple_of(2) {
        bail!(
            "the CUDA RoPE needs an even rotary_dim <= head_dim, got {} of {}",
            cfg.rotary_dim,
            cfg.head_dim
        );
    }
    let (hk, hv, dk, dv) = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    gdn_decode_check(hk, hv, dk, dv, cfg.linear_conv_kernel_dim)?;
    gdn_chunked_check(hk, hv, dk, dv)?;
    moe_dims(cfg).check("the CUDA MoE kernels")
}

/// The MoE sizes every expert launch needs, from the config.
pub(crate) fn moe_dims(cfg: &Config) -> MoeDims {
    MoeDims {
        d: cfg.hidden_size,
        e: cfg.num_experts,
        k: cfg.num_experts_per_tok,
        f: cfg.moe_intermediate_size,
        fs: cfg.shared_expert_intermediate_size,
    }
}

/// `mats` stacked into one device matrix as `upload` lays a projection out:
/// block FP8 when every one is (codes as stored, f32 scales), else bf16.
pub fn upload_mat(gpu: &Gpu, mats: &[&Mat]) -> Result<DevMat> {
    let mut up = Uploader {
        gpu,
        stage: Vec::new(),
    };
    up.mat(mats)
}

pub fn upload(
    gpu: &Gpu,
    cfg: &Config,
    w: &Weights,
    progress: &dyn Fn(usize, usize),
) -> Result<DevWeights> {
    check_geometry(cfg)?;
    let (d, f) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let mut up = Uploader {
        gpu,
        stage: Vec::new(),
    };
    let embed = up.mats(&[&w.embed])?;
    let lm_head = up.mats(&[&w.lm_head])?;
    let norm = up.one_plus(&w.norm)?;
    let mut layers = Vec::new();
    let n = w.layers.len();
    for (i, l) in w.layers.iter().enumerate() {
        let mixer = match &l.mixer {
            MixerWeights::Attention(a) => DevMixer::Attention(DevAttention {
                q: up.mat(&[&a.q_proj])?,
                k: up.mat(&[&a.k_proj])?,
                v: up.mat(&[&a.v_proj])?,
                o: up.mat(&[&a.o_proj])?,
                q_norm: up.one_plus(&a.q_norm)?,
                k_norm: up.one_plus(&a.k_norm)?,
            }),
            MixerWeights::Gdn(g) => DevMixer::Gdn(DevGdn {
                qkv: up.mat(&[&g.in_proj_qkv])?,
                z: up.mat(&[&g.in_proj_z])?,
                ba: DevMat::bf16(up.mats(&[&g.in_proj_b, &g.in_proj_a])?),
                conv: up.f32s(&g.conv1d)?,
                a_log: up.f32s(&g.a_log)?,
                dt_bias: up.f32s(&g.dt_bias)?,
                norm: up.f32s(&g.norm)?,
                out: up.mat(&[&g.out_proj])?,
            }),
        };
        // router rows, then the shared-expert gate as row E
        let router = gpu.alloc((cfg.num_experts + 1) * d * 2)?;
        up.mat_into(&l.moe.router, router.ptr)?;
        let sg: Vec<u16> = l
            .moe
            .shared_gate
            .iter()
            .map(|x| half::bf16::from_f32(*x).to_bits())
            .collect();
        gpu.upload(router.at(cfg.num_experts * d * 2), &sg)?;
        let (gate_up, down) = up.experts(&l.moe.experts, f, d)?;
        let shared_gate_up = up.mat(&[&l.moe.shared.gate, &l.moe.shared.up])?;
        let shared_down = up.mat(&[&l.moe.shared.down])?;
        layers.push(DevLayer {
            input_norm: up.one_plus(&l.input_norm)?,
            post_norm: up.one_plus(&l.post_norm)?,
            mixer,
            router,
            gate_up,
            down,
            shared_gate_up,
            shared_down,
        });
        gpu.sync()?;
        progress(i + 1, n);
    }
    gpu.sync()?;
    Ok(DevWeights {
        embed,
        lm_head,
        norm,
        layers,
    })
}
