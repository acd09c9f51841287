//! Gated softmax attention (the 1-in-4 full-attention layers): per-head q/k
//! norms, partial RoPE, GQA over a KV cache, sigmoid output gate.

use lily_model::tensor::round_to;
use lily_model::weights::AttentionWeights;
use lily_model::{Config, DType};
use rayon::prelude::*;

use super::linear::{dot, linear};
use super::norm::rmsnorm1p;
use super::{rope, sigmoid};

/// Keys and values of every position so far, post-norm and post-RoPE.
#[derive(Clone, Default)]
pub struct KvCache {
    /// [P, Hkv, Dh]
    pub k: Vec<f32>,
    /// [P, Hkv, Dh]
    pub v: Vec<f32>,
}

impl KvCache {
    pub fn len(&self, cfg: &Config) -> usize {
        self.k.len() / (cfg.num_key_value_heads * cfg.head_dim)
    }
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
}

/// x [T, D] (normed) at positions pos0..pos0+T -> [T, D]; appends T rows to `cache`.
pub fn gated_attention(
    x: &[f32],
    t: usize,
    pos0: usize,
    w: &AttentionWeights,
    cfg: &Config,
    cache: &mut KvCache,
    r: DType,
) -> Vec<f32> {
    let (hq, hkv, dh) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let gated = cfg.attn_output_gate;
    let qw = if gated { 2 * dh } else { dh };
    let mut qg = linear(x, t, &w.q_proj); // [T, Hq, Dh (+ Dh gate)]
    round_to(r, &mut qg);
    let mut k = linear(x, t, &w.k_proj); // [T, Hkv, Dh]
    round_to(r, &mut k);
    let mut v = linear(x, t, &w.v_proj);
    round_to(r, &mut v);

    let mut q = vec![0f32; t * hq * dh];
    let mut gate = vec![0f32; if gated { t * hq * dh } else { 0 }];
    for i in 0..t * hq {
        q[i * dh..(i + 1) * dh].copy_from_slice(&qg[i * qw..i * qw + dh]);
        if gated {
            gate[i * dh..(i + 1) * dh].copy_from_slice(&qg[i * qw + dh..(i + 1) * qw]);
        }
    }
    let mut q = rmsnorm1p(&q, &w.q_norm, cfg.rms_norm_eps, r);
    let mut k = rmsnorm1p(&k, &w.k_norm, cfg.rms_norm_eps, r);

    let dr = cfg.rotary_dim;
    for ti in 0..t {
        let (mut c, mut s) = rope::cos_sin(pos0 + ti, dr, cfg.rope_theta);
        // HF casts cos/sin to the activation dtype and multiplies in it.
        round_to(r, &mut c);
        round_to(r, &mut s);
        for (heads, x) in [(hq, &mut q), (hkv, &mut k)] {
            for h in 0..heads {
                let head = &mut x[(ti * heads + h) * dh..(ti * heads + h) * dh + dr];
                rope_rounded(head, &c, &s, r);
            }
        }
    }

    cache.k.extend_from_slice(&k);
    cache.v.extend_from_slice(&v);
    let kv = &*cache;
    let group = hq / hkv;
    let scale = (dh as f32).powf(-0.5);
    let mut out = vec![0f32; t * hq * dh];
    out.par_chunks_mut(dh).enumerate().for_each(|(i, o)| {
        let (ti, h) = (i / hq, i % hq);
        let kh = h / group;
        let qv = &q[i * dh..(i + 1) * dh];
        let n = pos0 + ti + 1; // causal: keys 0..=P
        let mut p: Vec<f32> = (0..n)
            .map(|j| dot(qv, &kv.k[(j * hkv + kh) * dh..(j * hkv + kh + 1) * dh]))
            .collect();
        round_to(r, &mut p);
        p.iter_mut().for_each(|x| *x *= scale);
        round_to(r, &mut p);
        let m = p.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in p.iter_mut() {
            *x = (*x - m).exp();
            sum += *x;
        }
        p.iter_mut().for_each(|x| *x /= sum);
        round_to(r, &mut p);
        for (j, pj) in p.iter().enumerate() {
            let vr = &kv.v[(j * hkv + kh) * dh..(j * hkv + kh + 1) * dh];
            for d in 0..dh {
                o[d] += pj * vr[d];
            }
        }
    });
    round_to(r, &mut out);
    if gated {
        let mut sg: Vec<f32> = gate.iter().map(|g| sigmoid(*g)).collect();
        round_to(r, &mut sg);
        out.iter_mut().zip(&sg).for_each(|(o, s)| *o *= s);
        round_to(r, &mut out);
    }
    let mut y = linear(&out, t, &w.o_proj);
    round_to(r, &mut y);
    y
}

/// RoPE on one head's first Dr dims, rounding each product as HF's bf16 ops do.
fn rope_rounded(x: &mut [f32], c: &[f32], s: &[f32], r: DType) {
    if r == DType::F32 {
        return rope::apply(x, c, s);
    }
    let half = c.len();
    let rd = |v: f32| {
        let mut a = [v];
        round_to(r, &mut a);
        a[0]
    };
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = rd(rd(a * c[i]) + rd(-b * s[i]));
        x[i + half] = rd(rd(b * c[i]) + rd(a * s[i]));
    }
}
