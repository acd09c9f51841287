//! Bytes each part of a decode step must move: the profiler's marks and
//! `lily bench`'s bandwidth floor both measure a step against these.

use lily_model::Config;

use super::CudaModel;
use crate::weights::DevMixer;

/// The query/key preparation's share of `attention_core_bytes`: the q, gate,
/// k and v rows it reads.
pub(super) fn attention_prep_bytes(cfg: &Config) -> u64 {
    cfg.q_proj_rows() as u64 * 4 + 2 * (cfg.num_key_value_heads * cfg.head_dim) as u64 * 4
}

/// Bytes the attention core of one decode step moves at `context` cached
/// tokens: K and V rows read (bf16), q / gate in, the new K/V row and the output.
pub(super) fn attention_core_bytes(cfg: &Config, context: usize) -> u64 {
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
pub(super) fn gdn_core_bytes(cfg: &Config) -> u64 {
    let s = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim)
        as u64
        * 4;
    gdn_conv_bytes(cfg) + 2 * s
}

/// The conv's share: its state read and written, its weights, input and output.
pub(super) fn gdn_conv_bytes(cfg: &Config) -> u64 {
    let (c, w) = (cfg.conv_dim() as u64, cfg.linear_conv_kernel_dim as u64);
    2 * c * (w - 1) * 4 + c * w * 4 + c * 4 * 2
}

/// Bytes `n` weights take: bf16, or block FP8 (a byte each and an f32
/// scale per 128 x 128 block).
fn weights_bytes(n: u64, fp8: bool) -> u64 {
    if fp8 {
        n + n / (128 * 128) * 4
    } else {
        n * 2
    }
}

/// Weight bytes of the experts one token reads in one MoE layer: K routed and the shared one.
pub(super) fn moe_expert_bytes(cfg: &Config, fp8: bool) -> u64 {
    let d = cfg.hidden_size as u64;
    let (k, f, fs) = (
        cfg.num_experts_per_tok as u64,
        cfg.moe_intermediate_size as u64,
        cfg.shared_expert_intermediate_size as u64,
    );
    weights_bytes(k * 3 * f * d + 3 * fs * d, fp8)
}

/// The gate|up rows of the routed and the shared experts: two thirds of
/// `moe_expert_bytes`.
pub(super) fn moe_gate_up_bytes(cfg: &Config, fp8: bool) -> u64 {
    let d = cfg.hidden_size as u64;
    let (k, f, fs) = (
        cfg.num_experts_per_tok as u64,
        cfg.moe_intermediate_size as u64,
        cfg.shared_expert_intermediate_size as u64,
    );
    weights_bytes(k * 2 * f * d + 2 * fs * d, fp8)
}

pub(super) fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl CudaModel {
    /// Bytes one decode step at `context` cached tokens must move: the
    /// weights it reads (the 8 routed experts and the shared one of each MoE
    /// layer, not all 256), the KV cache it scans, the recurrent state it
    /// reads and writes. Over the device bandwidth it is the step's floor.
    /// A greedy step with the screened lm_head (`head_screened`) reads its
    /// int8 copy instead of the bf16 head (the few rows it then computes
    /// exactly are not counted).
    pub fn decode_step_bytes(&self, context: usize) -> u64 {
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let head = match &self.screen {
            Some(hs) => hs.step_bytes(),
            None => self.w.lm_head.bytes as u64,
        };
        let mut b = head + d * 6;
        for lw in &self.w.layers {
            b += lw.router.bytes as u64
                + moe_expert_bytes(cfg, lw.gate_up.is_fp8())
                + 2 * (d * 4 * 3 + d * 2);
            b += match &lw.mixer {
                DevMixer::Attention(a) => {
                    (a.q.total_bytes() + a.k.total_bytes() + a.v.total_bytes() + a.o.total_bytes())
                        as u64
                        + attention_core_bytes(cfg, context)
                }
                DevMixer::Gdn(w) => {
                    (w.qkv.total_bytes()
                        + w.z.total_bytes()
                        + w.ba.total_bytes()
                        + w.out.total_bytes()) as u64
                        + gdn_core_bytes(cfg)
                }
            };
        }
        b
    }
}

/// Tokens a chunk of the chunked GDN holds (gdn_chunked.cu CH): its FLOP count's.
const GDN_CHUNK: f64 = 64.0;

/// Floating-point operations (a multiply-add is two) of one occurrence of a
/// prefill group (a layer's, as `layers` marks it) for a chunk of `t` tokens
/// after `pos` cached ones: the prefill roofline's column. Groups that only
/// move data (norms, sorts, the KV append, the combine) count none. The
/// chunked GDN counts its form's products per token and value head: the two
/// 64-wide Gram rows (q k^T, k k^T), the UT transform's right-hand sides, the
/// state's three products (W S, q S, its update) and P v'.
pub fn prefill_group_flops(cfg: &Config, group: &str, t: usize, pos: usize) -> f64 {
    let (t, pos) = (t as f64, pos as f64);
    let f = |x: usize| x as f64;
    let d = f(cfg.hidden_size);
    let (hq, hkv, dh) = (
        f(cfg.num_attention_heads),
        f(cfg.num_key_value_heads),
        f(cfg.head_dim),
    );
    let (hv, dk, dv) = (
        f(cfg.linear_num_value_heads),
        f(cfg.linear_key_head_dim),
        f(cfg.linear_value_head_dim),
    );
    let (e, k, fe, fs) = (
        f(cfg.num_experts),
        f(cfg.num_experts_per_tok),
        f(cfg.moe_intermediate_size),
        f(cfg.shared_expert_intermediate_size),
    );
    match group {
        "attn qkv proj" => 2.0 * t * d * (f(cfg.q_proj_rows()) + 2.0 * hkv * dh),
        "attn core" => 4.0 * dh * hq * (t * pos + t * (t + 1.0) / 2.0),
        "attn o proj" => 2.0 * t * hq * dh * d,
        "gdn in proj" => 2.0 * t * d * (f(cfg.conv_dim()) + hv * dv + 2.0 * hv),
        "gdn conv" => 2.0 * t * f(cfg.conv_dim()) * f(cfg.linear_conv_kernel_dim),
        "gdn core" => {
            let c = GDN_CHUNK;
            t * hv * (4.0 * c * dk + 2.0 * c * (dk + dv) + 6.0 * dk * dv + 2.0 * c * dv)
        }
        "gdn out proj" => 2.0 * t * hv * dv * d,
        "moe router" => 2.0 * t * d * (e + 1.0),
        "moe gate/up" => 2.0 * t * k * d * 2.0 * fe,
        "moe down" => 2.0 * t * k * fe * d,
        "moe shared" => 2.0 * t * 3.0 * d * fs,
        "lm_head" => 2.0 * d * f(cfg.vocab_size),
        _ => 0.0,
    }
}
