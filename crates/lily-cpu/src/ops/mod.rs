//! One file per op family; each implements a contract of `lily_model::ops`
//! plainly, in f32, as the reference every faster backend is tested against.

pub mod attention;
pub mod conv;
pub mod gdn;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod rope;

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// log(1 + e^x) without overflow (PyTorch's threshold of 20 included).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
