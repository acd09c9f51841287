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

/// Weight bytes of the experts one token reads in one MoE layer: K routed and the shared one.
pub(super) fn moe_expert_bytes(cfg: &Config) -> u64 {
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
pub(super) fn moe_gate_up_bytes(cfg: &Config) -> u64 {
    let d = cfg.hidden_size as u64;
    let (k, f, fs) = (
        cfg.num_experts_per_tok as u64,
        cfg.moe_intermediate_size as u64,
        cfg.shared_expert_intermediate_size as u64,
    );
    k * 2 * f * d * 2 + 2 * fs * d * 2
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
}
