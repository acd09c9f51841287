//! Helpers shared by the GPU test files (each says `mod support;`): the GPU
//! itself, seeded test data, the relative L2 error the tolerances are stated
//! in, bf16 conversions, and the GDN core's CPU reference that more than one
//! file checks kernels against. One copy here, so the files cannot drift
//! apart in how they build inputs or measure errors.
//!
//! Every GPU test is `#[ignore = "needs a CUDA GPU"]`: on a machine without
//! one (CI) it shows as ignored, never as passed; the GPU script runs them
//! with `--include-ignored`, where a missing or unusable GPU is a failure.
//!
//! Every test file is a crate of its own and uses only some of these.
#![allow(dead_code)]

use lily_cpu::ops::gdn::{l2norm_rows, GdnCore, GdnForm};
use lily_cpu::ops::{sigmoid, softplus};
use lily_cuda::gpu::{Gpu, GpuOptions};
use lily_model::tensor::Procedural;

/// The GPU with the product's options (a test that runs at all must have one).
pub fn gpu() -> Gpu {
    Gpu::new(0, &GpuOptions::default()).unwrap_or_else(|e| panic!("no usable CUDA GPU: {e:#}"))
}

/// `n` values of the procedural stream `seed`: uniform in
/// [mean - std*sqrt3, mean + std*sqrt3), bf16-rounded.
pub fn random(n: usize, seed: u64, mean: f32, std: f32) -> Vec<f32> {
    let p = Procedural { seed, mean, std };
    (0..n as u64).map(|i| p.value(i)).collect()
}

/// [`random`] of a mixed seed, for files whose seeds are small integers.
pub fn random_mixed(n: usize, seed: u64, mean: f32, std: f32) -> Vec<f32> {
    random(
        n,
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5A5A,
        mean,
        std,
    )
}

/// [`random`] with an exact zero nudged away (to 1e-3).
pub fn random_nonzero(n: usize, seed: u64, mean: f32, std: f32) -> Vec<f32> {
    random(n, seed, mean, std)
        .into_iter()
        .map(|x| if x == 0.0 { 1e-3 } else { x })
        .collect()
}

/// Relative L2 error of `a` against the reference `b`: |a - b| / |b|, in f64.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// f32 values as bf16 bits (round to nearest even), as the GPU takes them.
pub fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_bits())
        .collect()
}

/// bf16 bits widened to f32.
pub fn from_bf16_bits(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_bits(*x).to_f32())
        .collect()
}

/// f32 values rounded to bf16 and back: what the GPU sees of them.
pub fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

// ------------------------------------------------------------------ GDN core

/// The GDN core's heads and head dimensions.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnDims {
    /// Width of a post-conv row: q | k | v.
    pub fn conv_width(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
}

/// Inputs of one GDN layer's core for `t` tokens, as the kernels take them.
pub struct GdnInputs {
    pub t: usize,
    /// [t, 2*Hk*Dk + Hv*Dv] post-conv q | k | v
    pub conv: Vec<f32>,
    /// [t, 2*Hv] b | a
    pub ba: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// [Hv, Dk, Dv]
    pub s0: Vec<f32>,
}

/// The CPU reference, its inputs built exactly as `lily_cpu::ops::gdn::gdn`
/// builds them (f32 throughout): (o [t, Hv, Dv], final state).
pub fn gdn_cpu_reference(d: GdnDims, x: &GdnInputs) -> (Vec<f32>, Vec<f32>) {
    let GdnDims { hk, hv, dk, dv } = d;
    let (t, c) = (x.t, d.conv_width());
    let beta: Vec<f32> = (0..t * hv)
        .map(|i| sigmoid(x.ba[(i / hv) * 2 * hv + i % hv]))
        .collect();
    let g: Vec<f32> = (0..t * hv)
        .map(|i| {
            let j = i % hv;
            -x.a_log[j].exp() * softplus(x.ba[(i / hv) * 2 * hv + hv + j] + x.dt_bias[j])
        })
        .collect();
    let (kd, vd) = (hk * dk, hv * dv);
    let mut q = vec![0f32; t * kd];
    let mut k = vec![0f32; t * kd];
    let mut v = vec![0f32; t * vd];
    for ti in 0..t {
        let row = &x.conv[ti * c..(ti + 1) * c];
        q[ti * kd..(ti + 1) * kd].copy_from_slice(&row[..kd]);
        k[ti * kd..(ti + 1) * kd].copy_from_slice(&row[kd..2 * kd]);
        v[ti * vd..(ti + 1) * vd].copy_from_slice(&row[2 * kd..]);
    }
    l2norm_rows(&mut q, dk, (dk as f32).powf(-0.5));
    l2norm_rows(&mut k, dk, 1.0);
    let core = GdnCore {
        t,
        hk,
        hv,
        dk,
        dv,
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
    };
    let mut s = x.s0.clone();
    let o = core.run(&mut s, GdnForm::Recurrent);
    (o, s)
}
