//! `config.json` of a Qwen3.5/3.6-MoE checkpoint, in either form: the released
//! `Qwen3_5MoeForConditionalGeneration` (sizes under `text_config`) or the
//! text-only `Qwen3_5MoeForCausalLM` that transformers' `save_pretrained` writes.
//! Every size the engine uses is read here and checked once.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated softmax attention with a KV cache.
    Attention,
    /// Gated DeltaNet (linear attention) with a conv state and a recurrent state.
    Gdn,
}

/// The text model's geometry. Symbols follow the legend in `ops.rs`.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// D
    pub hidden_size: usize,
    /// V (rows of embed_tokens / lm_head; may exceed the tokenizer's length)
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub layer_kinds: Vec<LayerKind>,
    pub tie_word_embeddings: bool,
    // gated attention
    /// Hq
    pub num_attention_heads: usize,
    /// Hkv
    pub num_key_value_heads: usize,
    /// Dh
    pub head_dim: usize,
    /// Dr: rotated dims at the start of each q/k head (NeoX halves)
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub attn_output_gate: bool,
    // gated deltanet
    /// Hk
    pub linear_num_key_heads: usize,
    /// Hv
    pub linear_num_value_heads: usize,
    /// Dk
    pub linear_key_head_dim: usize,
    /// Dv
    pub linear_value_head_dim: usize,
    /// W
    pub linear_conv_kernel_dim: usize,
    // moe
    /// E
    pub num_experts: usize,
    /// K
    pub num_experts_per_tok: usize,
    /// F
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// config.json as JSON.
pub fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {} as JSON", path.display()))
}

impl Config {
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }
    /// C: conv channels = q, k and v of the GDN, convolved together.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Rows of q_proj: query (and gate, interleaved per head).
    pub fn q_proj_rows(&self) -> usize {
        self.num_attention_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }

    pub fn from_file(path: &Path) -> Result<Config> {
        let v = read_json(path)?;
        Config::from_json(&v).with_context(|| format!("invalid config {}", path.display()))
    }

    pub fn from_json(root: &Value) -> Result<Config> {
        let root_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        // Released form nests the text model; the text-only form is flat.
        let (tc, ty) = match root.get("text_config") {
            Some(tc) if tc.is_object() => (
                tc,
                tc.get("model_type")
                    .and_then(Value::as_str)
                    .unwrap_or(root_type),
            ),
            _ => (root, root_type),
        };
        let supported = ["qwen3_5_moe", "qwen3_5_moe_text"];
        if !supported.contains(&root_type) && !supported.contains(&ty) {
            bail!(
                "unsupported model_type {:?}: Lily runs Qwen3.5/3.6-MoE checkpoints (model_type \"qwen3_5_moe\")",
                if root_type.is_empty() { ty } else { root_type }
            );
        }
        let mut errs: Vec<String> = Vec::new();
        let r = Reader { v: tc, root };
        // Missing keys take transformers 5.17's Qwen3_5MoeTextConfig defaults,
        // as `from_pretrained` would.
        let mut num = |k: &str, default: usize| -> usize {
            match r.opt_usize(k) {
                Ok(x) => x.unwrap_or(default),
                Err(e) => {
                    errs.push(e.to_string());
                    0
                }
            }
        };
        let hidden_size = num("hidden_size", 2048);
        let num_layers = num("num_hidden_layers", 40);
        let vocab_size = num("vocab_size", 248320);
        let num_attention_heads = num("num_attention_heads", 16);
        let num_key_value_heads = num("num_key_value_heads", 2);
        let linear_num_key_heads = num("linear_num_key_heads", 16);
        let linear_num_value_heads = num("linear_num_value_heads", 32);
        let linear_key_head_dim = num("linear_key_head_dim", 128);
        let linear_value_head_dim = num("linear_value_head_dim", 128);
        let linear_conv_kernel_dim = num("linear_conv_kernel_dim", 4);
        let num_experts = num("num_experts", 256);
        let num_experts_per_tok = num("num_experts_per_tok", 8);
        let moe_intermediate_size = num("moe_intermediate_size", 512);
        let shared_expert_intermediate_size = num("shared_expert_intermediate_size", 512);
        // head_dim is NOT hidden/heads in this model (256 vs 128); the HF default is 256.
        let head_dim = match r.opt_usize("head_dim") {
            Ok(Some(h)) => h,
            Ok(None) => 256,
            Err(e) => {
                errs.push(e.to_string());
                0
            }
        };
        let rms_norm_eps = r.f64("rms_norm_eps").unwrap_or(1e-6) as f32;
        let rope = tc
            .get("rope_parameters")
            .or_else(|| tc.get("rope_scaling"))
            .filter(|v| v.is_object());
        let rope_get = |k: &str| rope.and_then(|o| o.get(k)).or_else(|| tc.get(k));
        let rope_theta = rope_get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let partial = rope_get("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        let rope_type = rope
            .and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            errs.push(format!(
                "rope_type {rope_type:?} is not supported (only \"default\")"
            ));
        }
        // int(head_dim * partial_rotary_factor), as HF truncates
        let rotary_dim = (head_dim as f64 * partial) as usize;

        let layer_kinds = match tc.get("layer_types").filter(|v| !v.is_null()) {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("full_attention") => LayerKind::Attention,
                    Some("linear_attention") => LayerKind::Gdn,
                    _ => {
                        errs.push(format!("layer_types[{i}] = {t}: expected \"full_attention\" or \"linear_attention\""));
                        LayerKind::Gdn
                    }
                })
                .collect(),
            Some(other) => {
                errs.push(format!("layer_types must be a list, got {other}"));
                vec![]
            }
            None => {
                let interval = r.opt_usize("full_attention_interval").ok().flatten().unwrap_or(4).max(1);
                (0..num_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::Gdn })
                    .collect()
            }
        };
        let tie_word_embeddings = tc
            .get("tie_word_embeddings")
            .or_else(|| root.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let attn_output_gate = tc
            .get("attn_output_gate")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let max_position_embeddings = r
            .opt_usize("max_position_embeddings")
            .ok()
            .flatten()
            .unwrap_or(32_768);
        let ids = |k: &str| -> Vec<u32> {
            match tc.get(k).or_else(|| root.get(k)) {
                Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect(),
                _ => vec![],
            }
        };
        let bos_token_id = ids("bos_token_id").first().copied();
        let eos_token_ids = ids("eos_token_id");

        let cfg = Config {
            hidden_size,
            vocab_size,
            rms_norm_eps,
            layer_kinds,
            tie_word_embeddings,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
            linear_conv_kernel_dim,
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            shared_expert_intermediate_size,
            max_position_embeddings,
            bos_token_id,
            eos_token_ids,
        };
        if errs.is_empty() {
            errs = cfg.consistency_errors(num_layers);
        }
        if !errs.is_empty() {
            bail!(
                "{} problem(s) in config:\n  - {}",
                errs.len(),
                errs.join("\n  - ")
            );
        }
        Ok(cfg)
    }

    /// Every inconsistency at once, so a user fixes the config in one pass.
    fn consistency_errors(&self, num_hidden_layers: usize) -> Vec<String> {
        let mut e = Vec::new();
        let positive = [
            ("hidden_size", self.hidden_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ];
        for (k, v) in positive {
            if v == 0 {
                e.push(format!("{k} must be > 0"));
            }
        }
        if self.layer_kinds.len() != num_hidden_layers {
            e.push(format!(
                "layer_types has {} entries but num_hidden_layers is {num_hidden_layers}",
                self.layer_kinds.len()
            ));
        }
        if self.num_key_value_heads > 0
            && !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            e.push(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.linear_num_key_heads > 0
            && !self
                .linear_num_value_heads
                .is_multiple_of(self.linear_num_key_heads)
        {
            e.push(format!(
                "linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                self.linear_num_value_heads, self.linear_num_key_heads
            ));
        }
        if self.num_experts_per_tok > self.num_experts {
            e.push(format!(
                "num_experts_per_tok ({}) exceeds num_experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            e.push(format!(
                "rotary dims ({} = head_dim x partial_rotary_factor) must be even and at most head_dim ({})",
                self.rotary_dim, self.head_dim
            ));
        }
        if !(self.rms_norm_eps > 0.0) {
            e.push("rms_norm_eps must be > 0".into());
        }
        if !(self.rope_theta > 0.0) {
            e.push("rope_theta must be > 0".into());
        }
        e
    }
}

struct Reader<'a> {
    v: &'a Value,
    root: &'a Value,
}

impl Reader<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.v
            .get(k)
            .or_else(|| self.root.get(k))
            .filter(|x| !x.is_null())
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| anyhow!("{k} must be a non-negative integer, got {x}")),
        }
    }
    fn f64(&self, k: &str) -> Option<f64> {
        self.get(k).and_then(Value::as_f64)
    }
}

/// Geometries of the built-in synthetic models (`--synthetic NAME`).
pub const SYNTHETIC_NAMES: &[&str] = &["tiny", "full", "full4"];

impl Config {
    /// `full`: the released Qwen3.6-35B-A3B text geometry; `full4`: the same, 4
    /// layers deep. `tiny`: the same
    /// structure (3 GDN : 1 attention, GQA, Hv = 2 Hk, partial RoPE, top-k MoE)
    /// at sizes a laptop runs instantly. Both use the real 248,320-row vocabulary.
    pub fn synthetic(name: &str) -> Result<Config> {
        let full = Config {
            hidden_size: 2048,
            vocab_size: 248_320,
            rms_norm_eps: 1e-6,
            layer_kinds: (0..40)
                .map(|i| {
                    if i % 4 == 3 {
                        LayerKind::Attention
                    } else {
                        LayerKind::Gdn
                    }
                })
                .collect(),
            tie_word_embeddings: false,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 10_000_000.0,
            attn_output_gate: true,
            linear_num_key_heads: 16,
            linear_num_value_heads: 32,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
            max_position_embeddings: 262_144,
            bos_token_id: Some(248_044),
            eos_token_ids: vec![248_046, 248_044],
        };
        match name {
            "full" => Ok(full),
            // every size of the released model, 4 layers deep (3 GDN + 1 attention):
            // the kernel shapes of the real thing in a tenth of the memory
            "full4" => Ok(Config {
                layer_kinds: full.layer_kinds[..4].to_vec(),
                ..full
            }),
            "tiny" => Ok(Config {
                hidden_size: 128,
                layer_kinds: (0..8)
                    .map(|i| {
                        if i % 4 == 3 {
                            LayerKind::Attention
                        } else {
                            LayerKind::Gdn
                        }
                    })
                    .collect(),
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 64,
                rotary_dim: 16,
                linear_num_key_heads: 2,
                linear_num_value_heads: 4,
                linear_key_head_dim: 32,
                linear_value_head_dim: 32,
                num_experts: 16,
                num_experts_per_tok: 4,
                moe_intermediate_size: 64,
                shared_expert_intermediate_size: 64,
                ..full
            }),
            other => bail!(
                "unknown synthetic model {other:?} (choose from {})",
                SYNTHETIC_NAMES.join(", ")
            ),
        }
    }
}
