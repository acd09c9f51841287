//! Sparse MoE FFN: softmax router over all E experts, top-K, renormalise,
//! SwiGLU experts run on the tokens routed to them (grouped by expert), plus
//! the always-on shared expert behind its scalar sigmoid gate.

use lily_model::tensor::round_to;
use lily_model::weights::{Ffn, MoeWeights};
use lily_model::{Config, DType};
use rayon::prelude::*;

use super::linear::{dot, linear, linear_seq};
use super::{sigmoid, silu};

/// Top-K experts of one token: (expert, renormalised weight), by weight descending.
pub fn route(logits: &[f32], k: usize, r: DType) -> Vec<(usize, f32)> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
    let sum: f32 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= sum);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Stable: equal probabilities keep the lower expert first.
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    idx.truncate(k);
    let top: f32 = idx.iter().map(|&e| p[e]).sum();
    let mut w: Vec<f32> = idx.iter().map(|&e| p[e] / top).collect();
    round_to(r, &mut w);
    idx.into_iter().zip(w).collect()
}

/// SwiGLU on n tokens x [n, D] -> [n, D] (sequential; callers parallelise).
pub fn ffn_seq(x: &[f32], n: usize, f: &Ffn, r: DType) -> Vec<f32> {
    let (fw, d) = (f.gate.rows, f.gate.cols);
    let mut g = vec![0f32; n * fw];
    let mut u = vec![0f32; n * fw];
    linear_seq(x, n, &f.gate, &mut g);
    linear_seq(x, n, &f.up, &mut u);
    round_to(r, &mut g);
    round_to(r, &mut u);
    g.iter_mut().for_each(|v| *v = silu(*v));
    round_to(r, &mut g);
    g.iter_mut().zip(&u).for_each(|(a, b)| *a *= b);
    round_to(r, &mut g);
    let mut y = vec![0f32; n * d];
    linear_seq(&g, n, &f.down, &mut y);
    round_to(r, &mut y);
    y
}

/// Router logits x Wr^T: [T, D] -> [T, E].
pub fn router_logits(x: &[f32], t: usize, w: &MoeWeights, r: DType) -> Vec<f32> {
    let mut logits = linear(x, t, &w.router);
    round_to(r, &mut logits);
    logits
}

/// x [T, D] (normed) and its router logits [T, E] -> [T, D].
pub fn moe(
    x: &[f32],
    t: usize,
    logits: &[f32],
    w: &MoeWeights,
    cfg: &Config,
    r: DType,
) -> Vec<f32> {
    let d = cfg.hidden_size;
    let e = cfg.num_experts;
    let routes: Vec<Vec<(usize, f32)>> = (0..t)
        .map(|ti| route(&logits[ti * e..(ti + 1) * e], cfg.num_experts_per_tok, r))
        .collect();

    // Group (token, slot) pairs by expert, slot = rank of the expert in the token's top-K.
    let k = cfg.num_experts_per_tok;
    let mut groups: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); e];
    for (ti, rt) in routes.iter().enumerate() {
        for (slot, &(ex, wt)) in rt.iter().enumerate() {
            groups[ex].push((ti, slot, wt));
        }
    }
    let outs: Vec<Option<Vec<f32>>> = groups
        .par_iter()
        .enumerate()
        .map(|(ex, toks)| {
            if toks.is_empty() {
                return None;
            }
            let mut xe = Vec::with_capacity(toks.len() * d);
            for &(ti, _, _) in toks {
                xe.extend_from_slice(&x[ti * d..(ti + 1) * d]);
            }
            let mut y = ffn_seq(&xe, toks.len(), &w.experts[ex], r);
            for (i, &(_, _, wt)) in toks.iter().enumerate() {
                y[i * d..(i + 1) * d].iter_mut().for_each(|v| *v *= wt);
            }
            round_to(r, &mut y);
            Some(y)
        })
        .collect();
    // Weighted expert outputs per (token, slot), then summed over the slots in
    // top-K order in f32 and rounded once, as transformers' grouped_mm path does.
    let mut slots = vec![0f32; t * k * d];
    for ex in 0..e {
        if let Some(y) = &outs[ex] {
            for (i, &(ti, slot, _)) in groups[ex].iter().enumerate() {
                slots[(ti * k + slot) * d..(ti * k + slot + 1) * d]
                    .copy_from_slice(&y[i * d..(i + 1) * d]);
            }
        }
    }
    let mut out = vec![0f32; t * d];
    for ti in 0..t {
        let o = &mut out[ti * d..(ti + 1) * d];
        for slot in 0..k {
            o.iter_mut()
                .zip(&slots[(ti * k + slot) * d..(ti * k + slot + 1) * d])
                .for_each(|(a, b)| *a += b);
        }
        round_to(r, o);
    }

    // Shared expert over all tokens, parallel over token blocks.
    let shared: Vec<f32> = x
        .par_chunks(d * 8)
        .flat_map_iter(|xb| ffn_seq(xb, xb.len() / d, &w.shared, r))
        .collect();
    for ti in 0..t {
        let xr = &x[ti * d..(ti + 1) * d];
        let mut gl = [dot(xr, &w.shared_gate)];
        round_to(r, &mut gl);
        let mut sg = [sigmoid(gl[0])];
        round_to(r, &mut sg);
        let mut s: Vec<f32> = shared[ti * d..(ti + 1) * d]
            .iter()
            .map(|v| v * sg[0])
            .collect();
        round_to(r, &mut s);
        let o = &mut out[ti * d..(ti + 1) * d];
        o.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
        round_to(r, o);
    }
    out
}
