//! RMSNorm in its two forms: zero-centred `(1 + w)` for the residual stream and
//! the q/k heads, and the plain-weight gated form closing each GDN head.

use lily_model::{tensor::round_to, DType};

use super::silu;

/// `x * rsqrt(mean(x^2) + eps) * (1 + w)` over each row of `w.len()` values.
pub fn rmsnorm1p(x: &[f32], w: &[f32], eps: f32, r: DType) -> Vec<f32> {
    let n = w.len();
    let mut y = vec![0f32; x.len()];
    for (xr, yr) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..n {
            yr[i] = xr[i] * inv * (1.0 + w[i]);
        }
    }
    round_to(r, &mut y);
    y
}

/// GDN output norm, per head of `w.len()` values:
/// `w * round(o * rsqrt(mean(o^2) + eps)) * silu(z)`; HF rounds the normalised
/// value to the activation dtype before the weight multiplies it.
pub fn gated_rmsnorm(o: &[f32], z: &[f32], w: &[f32], eps: f32, r: DType) -> Vec<f32> {
    let n = w.len();
    let mut y = vec![0f32; o.len()];
    let mut tmp = vec![0f32; n];
    for ((orow, zrow), yrow) in o
        .chunks_exact(n)
        .zip(z.chunks_exact(n))
        .zip(y.chunks_exact_mut(n))
    {
        let ms = orow.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for i in 0..n {
            tmp[i] = orow[i] * inv;
        }
        round_to(r, &mut tmp);
        for i in 0..n {
            tmp[i] *= w[i];
        }
        round_to(r, &mut tmp);
        for i in 0..n {
            yrow[i] = tmp[i] * silu(zrow[i]);
        }
    }
    round_to(r, &mut y);
    y
}
