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

use lily_cpu::ops::gdn::{prepare, GdnForm};
use lily_cuda::gpu::{Gpu, GpuOptions};
use lily_model::tensor::Procedural;
use lily_model::DType;

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

/// The GDN core's heads and head dimensions: lily-cpu's, so the tests and the
/// reference speak of one shape type.
pub use lily_cpu::ops::gdn::GdnDims;

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

/// The CPU reference: lily-cpu's own preparation of the core's inputs
/// ([`prepare`], f32 throughout, as `lily_cpu::ops::gdn::gdn` calls it) and
/// its recurrent core: (o [t, Hv, Dv], final state).
pub fn gdn_cpu_reference(d: GdnDims, x: &GdnInputs) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(x.ba.len(), x.t * 2 * d.hv, "ba is not [t, 2 Hv]");
    let b: Vec<f32> =
        x.ba.chunks(2 * d.hv)
            .flat_map(|r| &r[..d.hv])
            .copied()
            .collect();
    let a: Vec<f32> =
        x.ba.chunks(2 * d.hv)
            .flat_map(|r| &r[d.hv..])
            .copied()
            .collect();
    let p = prepare(d, &x.conv, &b, &a, &x.a_log, &x.dt_bias, DType::F32);
    let mut s = x.s0.clone();
    let o = p.core().run(&mut s, GdnForm::Recurrent);
    (o, s)
}
