//! Checkpoint tensors mapped once from their HF names into typed per-layer
//! structs. Everything is checked (presence, shape, dtype, bytes in range)
//! before any compute; errors name the tensor and the file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::config::{Config, LayerKind};
use crate::quant::{self, TensorMap, WeightFormat};
use crate::tensor::{DType, Mat, Procedural, Storage, Tensor};

/// One SwiGLU FFN: `down(silu(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Ffn {
    /// [F, D]
    pub gate: Mat,
    /// [F, D]
    pub up: Mat,
    /// [D, F]
    pub down: Mat,
}

#[derive(Clone, Debug)]
pub struct AttentionWeights {
    /// [Hq * Dh * 2, D]: per head, Dh query rows then Dh gate rows
    pub q_proj: Mat,
    /// [Hkv * Dh, D]
    pub k_proj: Mat,
    /// [Hkv * Dh, D]
    pub v_proj: Mat,
    /// [D, Hq * Dh]
    pub o_proj: Mat,
    /// [Dh], zero-centred (1 + w)
    pub q_norm: Vec<f32>,
    /// [Dh], zero-centred (1 + w)
    pub k_norm: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct GdnWeights {
    /// [C, D]: rows q (Hk*Dk), k (Hk*Dk), v (Hv*Dv)
    pub in_proj_qkv: Mat,
    /// [Hv * Dv, D]
    pub in_proj_z: Mat,
    /// [Hv, D]
    pub in_proj_b: Mat,
    /// [Hv, D]
    pub in_proj_a: Mat,
    /// [C, W] depthwise taps; tap W-1 multiplies the current token
    pub conv1d: Vec<f32>,
    /// [Hv]
    pub dt_bias: Vec<f32>,
    /// [Hv]
    pub a_log: Vec<f32>,
    /// [Dv], plain weight (not 1 + w), shared by all heads
    pub norm: Vec<f32>,
    /// [D, Hv * Dv]
    pub out_proj: Mat,
}

#[derive(Clone, Debug)]
pub enum MixerWeights {
    Attention(AttentionWeights),
    Gdn(GdnWeights),
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// [E, D]
    pub router: Mat,
    /// E experts
    pub experts: Vec<Ffn>,
    pub shared: Ffn,
    /// [D]: the shared expert's scalar sigmoid gate
    pub shared_gate: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// [D], 1 + w
    pub input_norm: Vec<f32>,
    /// [D], 1 + w
    pub post_norm: Vec<f32>,
    pub mixer: MixerWeights,
    pub moe: MoeWeights,
}

#[derive(Clone, Debug)]
pub struct Weights {
    /// [V, D]
    pub embed: Mat,
    /// [D], 1 + w
    pub norm: Vec<f32>,
    /// [V, D]
    pub lm_head: Mat,
    pub layers: Vec<LayerWeights>,
    /// dtype of the dense weights (the embeddings'); activations are rounded
    /// to it between ops, as HF runs the model in this dtype.
    pub dtype: DType,
    /// How the checkpoint stores its linear weights (config.json).
    pub format: WeightFormat,
}

/// The tensors of a checkpoint directory, opened and header-checked, by name.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub format: WeightFormat,
    tensors: TensorMap,
    /// "model.language_model." (released) or "model." (text-only)
    prefix: String,
}

impl Checkpoint {
    /// Map every shard of `dir` and join quantized weights with their scales
    /// (`format`: what config.json declares).
    pub fn open(dir: &Path, format: WeightFormat) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .with_context(|| format!("reading {}", index.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no \"weight_map\" object", index.display()))?;
            let mut shards: BTreeMap<String, String> = BTreeMap::new();
            for (name, f) in map {
                let f = f.as_str().with_context(|| {
                    format!("{}: weight_map[{name}] is not a string", index.display())
                })?;
                shards.entry(f.to_string()).or_insert_with(|| name.clone());
            }
            let mut out = Vec::new();
            for (f, example) in shards {
                let p = dir.join(&f);
                if !p.exists() {
                    bail!(
                        "{} maps tensors (e.g. {example}) to shard {f}, which does not exist in {}",
                        index.display(),
                        dir.display()
                    );
                }
                out.push(p);
            }
            out
        } else {
            let single = dir.join("model.safetensors");
            if single.exists() {
                vec![single]
            } else {
                let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                    .with_context(|| format!("reading checkpoint directory {}", dir.display()))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .collect();
                v.sort();
                if v.is_empty() {
                    bail!(
                        "no model.safetensors, model.safetensors.index.json or *.safetensors in {}",
                        dir.display()
                    );
                }
                v
            }
        };

        let big = files
            .iter()
            .filter_map(|f| f.metadata().ok())
            .map(|m| m.len())
            .sum::<u64>()
            > (1 << 30);
        let bar = if big && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let b = indicatif::ProgressBar::new(files.len() as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading {bar:40} {pos}/{len} shards {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut tensors = HashMap::new();
        for f in &files {
            bar.set_message(
                f.file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            );
            open_shard(f, &mut tensors)?;
            bar.inc(1);
        }
        bar.finish_and_clear();
        let mut errs = Vec::new();
        quant::pair(format, &mut tensors, dir, &mut errs);
        if !errs.is_empty() {
            bail!(
                "checkpoint {} ({}): {}",
                dir.display(),
                format.describe(),
                problems(errs)
            );
        }
        let prefix = if tensors
            .keys()
            .any(|k| k.starts_with("model.language_model."))
        {
            "model.language_model."
        } else {
            "model."
        };
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            format,
            tensors,
            prefix: prefix.to_string(),
        })
    }

    fn where_(&self) -> String {
        self.dir.display().to_string()
    }

    fn get(&self, name: &str, shape: &[usize], errs: &mut Vec<String>) -> Option<Arc<Tensor>> {
        match self.tensors.get(name) {
            None => {
                errs.push(format!(
                    "missing tensor {name} (not in any safetensors file of {})",
                    self.where_()
                ));
                None
            }
            Some((t, file)) if t.shape != shape => {
                errs.push(format!(
                    "tensor {name} in {} has shape {:?}, expected {:?}",
                    file.display(),
                    t.shape,
                    shape
                ));
                None
            }
            Some((t, _)) => Some(t.clone()),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Map and check every tensor the config needs.
    pub fn weights(&self, cfg: &Config) -> Result<Weights> {
        let mut errs = Vec::new();
        let p = self.prefix.clone();
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let mat = |name: &str, shape: &[usize], errs: &mut Vec<String>| {
            self.get(name, shape, errs).map(Mat::whole)
        };
        let embed = mat(&format!("{p}embed_tokens.weight"), &[v, d], &mut errs);
        let lm_head = if cfg.tie_word_embeddings && !self.has("lm_head.weight") {
            embed.clone()
        } else {
            mat("lm_head.weight", &[v, d], &mut errs)
        };
        let vec_ = |name: &str, n: usize, errs: &mut Vec<String>| {
            self.get(name, &[n], errs).map(|t| t.to_f32_vec())
        };
        let norm = vec_(&format!("{p}norm.weight"), d, &mut errs);

        let mut layers = Vec::new();
        for (l, kind) in cfg.layer_kinds.iter().enumerate() {
            let lp = format!("{p}layers.{l}.");
            let input_norm = vec_(&format!("{lp}input_layernorm.weight"), d, &mut errs);
            let post_norm = vec_(
                &format!("{lp}post_attention_layernorm.weight"),
                d,
                &mut errs,
            );
            let mixer = match kind {
                LayerKind::Attention => {
                    let a = format!("{lp}self_attn.");
                    let (hq, hkv, dh) = (
                        cfg.num_attention_heads,
                        cfg.num_key_value_heads,
                        cfg.head_dim,
                    );
                    let q = mat(
                        &format!("{a}q_proj.weight"),
                        &[cfg.q_proj_rows(), d],
                        &mut errs,
                    );
                    let k = mat(&format!("{a}k_proj.weight"), &[hkv * dh, d], &mut errs);
                    let vv = mat(&format!("{a}v_proj.weight"), &[hkv * dh, d], &mut errs);
                    let o = mat(&format!("{a}o_proj.weight"), &[d, hq * dh], &mut errs);
                    let qn = vec_(&format!("{a}q_norm.weight"), dh, &mut errs);
                    let kn = vec_(&format!("{a}k_norm.weight"), dh, &mut errs);
                    match (q, k, vv, o, qn, kn) {
                        (
                            Some(q_proj),
                            Some(k_proj),
                            Some(v_proj),
                            Some(o_proj),
                            Some(q_norm),
                            Some(k_norm),
                        ) => Some(MixerWeights::Attention(AttentionWeights {
                            q_proj,
                            k_proj,
                            v_proj,
                            o_proj,
                            q_norm,
                            k_norm,
                        })),
                        _ => None,
                    }
                }
                LayerKind::Gdn => {
                    let g = format!("{lp}linear_attn.");
                    let (c, hv, dv, w) = (
                        cfg.conv_dim(),
                        cfg.linear_num_value_heads,
                        cfg.linear_value_head_dim,
                        cfg.linear_conv_kernel_dim,
                    );
                    let qkv = mat(&format!("{g}in_proj_qkv.weight"), &[c, d], &mut errs);
                    let z = mat(&format!("{g}in_proj_z.weight"), &[hv * dv, d], &mut errs);
                    let b = mat(&format!("{g}in_proj_b.weight"), &[hv, d], &mut errs);
                    let a = mat(&format!("{g}in_proj_a.weight"), &[hv, d], &mut errs);
                    let conv = self
                        .get(&format!("{g}conv1d.weight"), &[c, 1, w], &mut errs)
                        .map(|t| t.to_f32_vec());
                    let dt = vec_(&format!("{g}dt_bias"), hv, &mut errs);
                    let al = vec_(&format!("{g}A_log"), hv, &mut errs);
                    let nw = vec_(&format!("{g}norm.weight"), dv, &mut errs);
                    let out = mat(&format!("{g}out_proj.weight"), &[d, hv * dv], &mut errs);
                    match (qkv, z, b, a, conv, dt, al, nw, out) {
                        (
                            Some(in_proj_qkv),
                            Some(in_proj_z),
                            Some(in_proj_b),
                            Some(in_proj_a),
                            Some(conv1d),
                            Some(dt_bias),
                            Some(a_log),
                            Some(norm),
                            Some(out_proj),
                        ) => Some(MixerWeights::Gdn(GdnWeights {
                            in_proj_qkv,
                            in_proj_z,
                            in_proj_b,
                            in_proj_a,
                            conv1d,
                            dt_bias,
                            a_log,
                            norm,
                            out_proj,
                        })),
                        _ => None,
                    }
                }
            };
            let moe = self.moe(cfg, &format!("{lp}mlp."), &mut errs);
            if let (Some(input_norm), Some(post_norm), Some(mixer), Some(moe)) =
                (input_norm, post_norm, mixer, moe)
            {
                layers.push(LayerWeights {
                    input_norm,
                    post_norm,
                    mixer,
                    moe,
                });
            }
        }
        if !errs.is_empty() {
            bail!(
                "checkpoint {} does not match its config: {}",
                self.where_(),
                problems(errs)
            );
        }
        let (embed, lm_head, norm) = (embed.unwrap(), lm_head.unwrap(), norm.unwrap());
        // the activations' dtype: the dense embeddings' (HF runs an FP8
        // checkpoint in the dtype of its unquantized tensors)
        let dtype = [&embed, &lm_head]
            .into_iter()
            .map(|m| m.t.dtype)
            .find(|d| *d != DType::F8E4M3)
            .unwrap_or(DType::BF16);
        Ok(Weights {
            embed,
            norm,
            lm_head,
            layers,
            dtype,
            format: self.format,
        })
    }

    fn moe(&self, cfg: &Config, m: &str, errs: &mut Vec<String>) -> Option<MoeWeights> {
        let (d, e, f, fs) = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let n0 = errs.len();
        let router = self
            .get(&format!("{m}gate.weight"), &[e, d], errs)
            .map(Mat::whole);
        let ffn = |pre: &str, f: usize, errs: &mut Vec<String>| -> Option<Ffn> {
            let g = self.get(&format!("{pre}gate_proj.weight"), &[f, d], errs);
            let u = self.get(&format!("{pre}up_proj.weight"), &[f, d], errs);
            let dn = self.get(&format!("{pre}down_proj.weight"), &[d, f], errs);
            Some(Ffn {
                gate: Mat::whole(g?),
                up: Mat::whole(u?),
                down: Mat::whole(dn?),
            })
        };
        let experts: Option<Vec<Ffn>> = if self.has(&format!("{m}experts.gate_up_proj")) {
            // Fused (transformers v5 in-memory layout): gate rows first, then up.
            let gu = self
                .get(&format!("{m}experts.gate_up_proj"), &[e, 2 * f, d], errs)
                .map(Mat::whole);
            let dn = self
                .get(&format!("{m}experts.down_proj"), &[e, d, f], errs)
                .map(Mat::whole);
            match (gu, dn) {
                (Some(gu), Some(dn)) => Some(
                    (0..e)
                        .map(|x| Ffn {
                            gate: gu.rows(x * 2 * f, f),
                            up: gu.rows(x * 2 * f + f, f),
                            down: dn.rows(x * d, d),
                        })
                        .collect(),
                ),
                _ => None,
            }
        } else {
            (0..e)
                .map(|x| ffn(&format!("{m}experts.{x}."), f, errs))
                .collect()
        };
        let shared = ffn(&format!("{m}shared_expert."), fs, errs);
        let sg = self
            .get(&format!("{m}shared_expert_gate.weight"), &[1, d], errs)
            .map(|t| t.to_f32_vec());
        if errs.len() > n0 {
            return None;
        }
        Some(MoeWeights {
            router: router?,
            experts: experts?,
            shared: shared?,
            shared_gate: sg?,
        })
    }
}

/// Open one safetensors file: memory-map it, check its header and that every
/// tensor's bytes lie inside the file, and register the tensors we may use.
fn open_shard(path: &Path, out: &mut TensorMap) -> Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the checkpoint is read-only for the engine's lifetime; a file
    // truncated underneath a running process is outside what we defend against.
    let mmap = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("memory-mapping {}", path.display()))?;
    let mmap: Arc<memmap2::Mmap> = Arc::new(mmap);
    let st = safetensors::SafeTensors::deserialize(&mmap[..]).map_err(|e| {
        anyhow::anyhow!(
            "{}: corrupt or truncated safetensors file: {e}",
            path.display()
        )
    })?;
    let base = mmap.as_ptr() as usize;
    let mut found: Vec<(String, Arc<Tensor>)> = Vec::new();
    for (name, view) in st.iter() {
        // The vision tower and the MTP head are not part of the text model.
        if name.starts_with("model.visual.")
            || name.starts_with("mtp.")
            || name.starts_with("visual.")
        {
            continue;
        }
        let dtype = DType::from_safetensors(view.dtype())
            .with_context(|| format!("tensor {name} in {}", path.display()))?;
        let data = view.data();
        let offset = data.as_ptr() as usize - base;
        let numel: usize = view.shape().iter().product();
        if data.len() != numel * dtype.size() {
            bail!(
                "tensor {name} in {}: {} bytes for shape {:?} {}",
                path.display(),
                data.len(),
                view.shape(),
                dtype.name()
            );
        }
        let buf: Arc<dyn AsRef<[u8]> + Send + Sync> = mmap.clone();
        let t = Tensor {
            dtype,
            shape: view.shape().to_vec(),
            storage: Storage::Bytes {
                buf,
                offset,
                len: data.len(),
            },
        };
        found.push((name.to_string(), Arc::new(t)));
    }
    for (name, t) in found {
        if let Some((_, other)) = out.get(&name) {
            bail!(
                "tensor {name} appears in both {} and {}",
                other.display(),
                path.display()
            );
        }
        out.insert(name, (t, path.to_path_buf()));
    }
    Ok(())
}

/// Seeded random weights for a config, procedural (no host memory needed),
/// with statistics that keep activations finite through every layer:
/// projections scaled by 1/sqrt(fan_in), outputs into the residual stream
/// scaled down further, norms near their neutral values, decays in the range
/// trained models use.
pub fn synthetic(cfg: &Config, seed: u64) -> Weights {
    // Outputs into the residual stream are scaled by 0.4 / sqrt(layers) (0.2
    // at 4 layers, 0.063 at 40): the layers' total share of the residual
    // stream is then the same at any depth, and 40 random layers stay a
    // gentle, non-chaotic map, as trained models are. Two correct bf16
    // engines then agree closely at full depth and a comparison finds bugs,
    // not amplified rounding (benchmarks/LEDGER.md, row 3).
    let branch = 0.4 / (cfg.layer_kinds.len().max(1) as f32).sqrt();
    let counter = std::cell::Cell::new(0u64);
    let next = |shape: Vec<usize>, mean: f32, std: f32| -> Arc<Tensor> {
        counter.set(counter.get() + 1);
        let s = seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
            ^ counter.get().wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Arc::new(Tensor::procedural(shape, Procedural { seed: s, mean, std }))
    };
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let lin = |n: usize| 1.0 / (n as f32).sqrt();
    let m = |rows: usize, cols: usize, std: f32| Mat::whole(next(vec![rows, cols], 0.0, std));
    let embed = m(v, d, 1.0);
    // Output rows with a log-normal-like spread of norms (2^k, k in -4..=4),
    // as trained heads have: the top logit then usually stands clear of the
    // runner-up, where equal-norm random rows give near ties that bf16
    // rounding of the logits alone flips.
    counter.set(counter.get() + 1);
    let head_seed = seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
        ^ counter.get().wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let lm_head = Mat::whole(Arc::new(Tensor::procedural_rows(
        vec![v, d],
        Procedural {
            seed: head_seed,
            mean: 0.0,
            std: lin(d),
        },
    )));
    let small = |n: usize, mean: f32, std: f32| next(vec![n], mean, std).to_f32_vec();
    let norm = small(d, 0.0, 0.1);
    let mut layers = Vec::new();
    for kind in &cfg.layer_kinds {
        let input_norm = small(d, 0.0, 0.1);
        let post_norm = small(d, 0.0, 0.1);
        let mixer = match kind {
            LayerKind::Attention => {
                let (hq, hkv, dh) = (
                    cfg.num_attention_heads,
                    cfg.num_key_value_heads,
                    cfg.head_dim,
                );
                MixerWeights::Attention(AttentionWeights {
                    q_proj: m(cfg.q_proj_rows(), d, lin(d)),
                    k_proj: m(hkv * dh, d, lin(d)),
                    v_proj: m(hkv * dh, d, lin(d)),
                    o_proj: m(d, hq * dh, branch * lin(hq * dh)),
                    q_norm: small(dh, 0.0, 0.1),
                    k_norm: small(dh, 0.0, 0.1),
                })
            }
            LayerKind::Gdn => {
                let (c, hv, dv, w) = (
                    cfg.conv_dim(),
                    cfg.linear_num_value_heads,
                    cfg.linear_value_head_dim,
                    cfg.linear_conv_kernel_dim,
                );
                MixerWeights::Gdn(GdnWeights {
                    in_proj_qkv: m(c, d, lin(d)),
                    in_proj_z: m(hv * dv, d, lin(d)),
                    in_proj_b: m(hv, d, lin(d)),
                    in_proj_a: m(hv, d, lin(d)),
                    conv1d: small(c * w, 0.0, lin(w)),
                    // softplus(a + dt_bias) ~ 0.01..0.1 and exp(A_log) ~ 1..16, as trained GDNs have
                    dt_bias: small(hv, -3.5, 0.8),
                    a_log: small(hv, 1.4, 0.7),
                    norm: small(dv, 1.0, 0.1),
                    out_proj: m(d, hv * dv, branch * lin(hv * dv)),
                })
            }
        };
        let (e, f, fs) = (
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let ffn = |f: usize| Ffn {
            gate: m(f, d, lin(d)),
            up: m(f, d, lin(d)),
            down: m(d, f, branch * lin(f)),
        };
        let experts = (0..e).map(|_| ffn(f)).collect();
        let shared = ffn(fs);
        // A router with logits of std 4, peaked like a trained one: decisive top-K
        // choices, so bf16 noise rarely flips an expert.
        let moe = MoeWeights {
            router: m(e, d, 4.0 * lin(d)),
            experts,
            shared,
            shared_gate: small(d, 0.0, lin(d)),
        };
        layers.push(LayerWeights {
            input_norm,
            post_norm,
            mixer,
            moe,
        });
    }
    Weights {
        embed,
        norm,
        lm_head,
        layers,
        dtype: DType::BF16,
        format: WeightFormat::Dense,
    }
}

/// Problems as one message: the count, then the first 20, one a line.
fn problems(mut errs: Vec<String>) -> String {
    let n = errs.len();
    errs.truncate(20);
    let more = if n > 20 {
        format!("\n  ... and {} more", n - 20)
    } else {
        String::new()
    };
    format!("{n} problem(s):\n  - {}{more}", errs.join("\n  - "))
}

impl Weights {
    /// The matrices Qwen's FP8 releases store as block FP8, quantized here
    /// with the releases' rule (`quant::quantize_fp8_block`): the attention
    /// projections, the GDN's in_proj_qkv, in_proj_z and out_proj, every
    /// expert and the shared expert. The embeddings, the lm_head, the router,
    /// the shared expert's gate, the GDN's in_proj_a/b and the vectors stay
    /// as they are, as in the releases.
    pub fn quantize_fp8(mut self) -> Result<Weights> {
        if self.format != WeightFormat::Dense {
            bail!("the weights are {} already", self.format.describe());
        }
        let mut mats: Vec<&mut Mat> = Vec::new();
        for l in &mut self.layers {
            match &mut l.mixer {
                MixerWeights::Attention(a) => {
                    mats.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj])
                }
                MixerWeights::Gdn(g) => {
                    mats.extend([&mut g.in_proj_qkv, &mut g.in_proj_z, &mut g.out_proj])
                }
            }
            for x in l
                .moe
                .experts
                .iter_mut()
                .chain(std::iter::once(&mut l.moe.shared))
            {
                mats.extend([&mut x.gate, &mut x.up, &mut x.down]);
            }
        }
        {
            use rayon::prelude::*;
            mats.par_iter_mut().for_each(|m| {
                let t = quant::quantize_fp8_block(m.rows, m.cols, &|r, out| m.row_f32(r, out));
                **m = Mat::whole(Arc::new(t));
            });
        }
        self.format = WeightFormat::Fp8Block {
            block: quant::FP8_BLOCK,
        };
        Ok(self)
    }

    /// Materialise procedural tensors into bf16 bytes when the whole model is
    /// small enough that reading memory beats regenerating values.
    pub fn materialize_small(self, max_bytes: usize) -> Weights {
        let mut seen: HashMap<usize, Arc<Tensor>> = HashMap::new();
        let mut total = 0usize;
        self.for_each_mat(&mut |m| {
            seen.entry(Arc::as_ptr(&m.t) as usize).or_insert_with(|| {
                total += m.t.numel() * 2;
                m.t.clone()
            });
        });
        if total > max_bytes {
            return self;
        }
        let done: HashMap<usize, Arc<Tensor>> = {
            use rayon::prelude::*;
            seen.into_par_iter()
                .map(|(k, t)| (k, Arc::new(t.materialize())))
                .collect()
        };
        let mut w = self;
        w.for_each_mat_mut(&mut |m| m.t = done[&(Arc::as_ptr(&m.t) as usize)].clone());
        w
    }

    fn for_each_mat(&self, f: &mut dyn FnMut(&Mat)) {
        let mut w = self.clone();
        w.for_each_mat_mut(&mut |m| f(m));
    }

    pub fn for_each_mat_mut(&mut self, f: &mut dyn FnMut(&mut Mat)) {
        f(&mut self.embed);
        f(&mut self.lm_head);
        for l in &mut self.layers {
            match &mut l.mixer {
                MixerWeights::Attention(a) => {
                    [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]
                        .into_iter()
                        .for_each(&mut *f)
                }
                MixerWeights::Gdn(g) => [
                    &mut g.in_proj_qkv,
                    &mut g.in_proj_z,
                    &mut g.in_proj_b,
                    &mut g.in_proj_a,
                    &mut g.out_proj,
                ]
                .into_iter()
                .for_each(&mut *f),
            }
            f(&mut l.moe.router);
            for x in l
                .moe
                .experts
                .iter_mut()
                .chain(std::iter::once(&mut l.moe.shared))
            {
                f(&mut x.gate);
                f(&mut x.up);
                f(&mut x.down);
            }
        }
    }
}
