//! `lily synthetic-export`: describe a synthetic model so another engine can
//! build the identical weights without a 70 GB file: the HF text config, each
//! large tensor as procedural generator segments (seed, mean, std; the
//! generator is `Procedural::value`), and the small vectors as values.
//! `tools/hf_compare.py` uses it to run transformers on the same weights.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use lily_model::tensor::Storage;
use lily_model::weights::MixerWeights;
use lily_model::{Config, LayerKind, Mat, ModelSource};
use serde_json::{json, Value};

#[derive(Args)]
pub struct ExportArgs {
    /// Synthetic model name: tiny | full | full4
    #[arg(long)]
    pub synthetic: String,
    /// Output directory (config.json, procedural.json, small.safetensors)
    #[arg(long)]
    pub out: PathBuf,
}

/// The transformers 5.17 `Qwen3_5MoeTextConfig` for `cfg`.
pub fn hf_config(cfg: &Config) -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers(),
        "layer_types": cfg.layer_kinds.iter().map(|k| match k { LayerKind::Attention => "full_attention", LayerKind::Gdn => "linear_attention" }).collect::<Vec<_>>(),
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "attn_output_gate": cfg.attn_output_gate,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_dim as f64 / cfg.head_dim as f64},
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    })
}

fn segment(m: &Mat, offset: usize) -> Result<Value> {
    let (p, rows) = match &m.t.storage {
        Storage::Procedural(p) => (p, false),
        Storage::ProceduralRows(p) => (p, true),
        _ => bail!("not a procedural tensor"),
    };
    // f32 values go out through f64, which JSON carries exactly
    let cols = if rows {
        m.t.shape.last().copied().unwrap_or(1)
    } else {
        0
    };
    Ok(
        json!({"offset": offset, "start": m.row0 * m.cols, "n": m.rows * m.cols, "seed": p.seed.to_string(), "mean": p.mean as f64, "std": p.std as f64, "row_cols": cols}),
    )
}

pub fn run(a: ExportArgs) -> Result<()> {
    let (cfg, w) = ModelSource::Synthetic(a.synthetic.clone()).load_procedural()?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut big: Vec<Value> = Vec::new();
    let mut small: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    fn one(big: &mut Vec<Value>, name: String, m: &Mat) -> Result<()> {
        big.push(json!({"name": name, "shape": [m.rows, m.cols], "parts": [segment(m, 0)?]}));
        Ok(())
    }
    one(&mut big, "model.embed_tokens.weight".into(), &w.embed)?;
    one(&mut big, "lm_head.weight".into(), &w.lm_head)?;
    small.push((
        "model.norm.weight".into(),
        vec![cfg.hidden_size],
        w.norm.clone(),
    ));
    let (d, f) = (cfg.hidden_size, cfg.moe_intermediate_size);
    for (l, lw) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        small.push((
            format!("{p}input_layernorm.weight"),
            vec![d],
            lw.input_norm.clone(),
        ));
        small.push((
            format!("{p}post_attention_layernorm.weight"),
            vec![d],
            lw.post_norm.clone(),
        ));
        match &lw.mixer {
            MixerWeights::Attention(at) => {
                for (n, m) in [
                    ("q_proj", &at.q_proj),
                    ("k_proj", &at.k_proj),
                    ("v_proj", &at.v_proj),
                    ("o_proj", &at.o_proj),
                ] {
                    one(&mut big, format!("{p}self_attn.{n}.weight"), m)?;
                }
                small.push((
                    format!("{p}self_attn.q_norm.weight"),
                    vec![cfg.head_dim],
                    at.q_norm.clone(),
                ));
                small.push((
                    format!("{p}self_attn.k_norm.weight"),
                    vec![cfg.head_dim],
                    at.k_norm.clone(),
                ));
            }
            MixerWeights::Gdn(g) => {
                for (n, m) in [
                    ("in_proj_qkv", &g.in_proj_qkv),
                    ("in_proj_z", &g.in_proj_z),
                    ("in_proj_b", &g.in_proj_b),
                    ("in_proj_a", &g.in_proj_a),
                    ("out_proj", &g.out_proj),
                ] {
                    one(&mut big, format!("{p}linear_attn.{n}.weight"), m)?;
                }
                let (c, wd) = (cfg.conv_dim(), cfg.linear_conv_kernel_dim);
                small.push((
                    format!("{p}linear_attn.conv1d.weight"),
                    vec![c, 1, wd],
                    g.conv1d.clone(),
                ));
                small.push((
                    format!("{p}linear_attn.dt_bias"),
                    vec![g.dt_bias.len()],
                    g.dt_bias.clone(),
                ));
                small.push((
                    format!("{p}linear_attn.A_log"),
                    vec![g.a_log.len()],
                    g.a_log.clone(),
                ));
                small.push((
                    format!("{p}linear_attn.norm.weight"),
                    vec![g.norm.len()],
                    g.norm.clone(),
                ));
            }
        }
        one(&mut big, format!("{p}mlp.gate.weight"), &lw.moe.router)?;
        // transformers holds the experts fused: gate_up [E, 2F, D] (gate rows first), down [E, D, F]
        let e = lw.moe.experts.len();
        let mut gu = Vec::new();
        let mut dn = Vec::new();
        for (i, x) in lw.moe.experts.iter().enumerate() {
            gu.push(segment(&x.gate, i * 2 * f * d)?);
            gu.push(segment(&x.up, i * 2 * f * d + f * d)?);
            dn.push(segment(&x.down, i * d * f)?);
        }
        big.push(json!({"name": format!("{p}mlp.experts.gate_up_proj"), "shape": [e, 2 * f, d], "parts": gu}));
        big.push(
            json!({"name": format!("{p}mlp.experts.down_proj"), "shape": [e, d, f], "parts": dn}),
        );
        for (n, m) in [
            ("gate_proj", &lw.moe.shared.gate),
            ("up_proj", &lw.moe.shared.up),
            ("down_proj", &lw.moe.shared.down),
        ] {
            one(&mut big, format!("{p}mlp.shared_expert.{n}.weight"), m)?;
        }
        small.push((
            format!("{p}mlp.shared_expert_gate.weight"),
            vec![1, d],
            lw.moe.shared_gate.clone(),
        ));
    }
    std::fs::write(
        a.out.join("config.json"),
        serde_json::to_string_pretty(&hf_config(&cfg))?,
    )?;
    std::fs::write(
        a.out.join("procedural.json"),
        serde_json::to_string(
            &json!({"generator": "lily Procedural::value v2 (row_cols: value_rows)", "tensors": big}),
        )?,
    )?;
    crate::logits::write_f32(&a.out.join("small.safetensors"), &small)?;
    eprintln!(
        "wrote {} procedural tensors and {} small ones to {}",
        big.len(),
        small.len(),
        a.out.display()
    );
    Ok(())
}
