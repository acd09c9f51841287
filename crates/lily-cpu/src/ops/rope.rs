//! Partial rotary embedding, NeoX halves, on the first Dr dims of each head.

/// The rotation angles' cos and sin for position `pos`, [Dr/2] each, computed in
/// f32 exactly as HF does (f32 inverse frequencies times an f32 position).
pub fn cos_sin(pos: usize, rotary_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = rotary_dim / 2;
    let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
    for j in 0..half {
        let inv_freq = 1.0f32 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32);
        let a = inv_freq * pos as f32;
        c[j] = a.cos();
        s[j] = a.sin();
    }
    (c, s)
}

/// Rotate one head vector in place. `cos`/`sin` are [Dr/2].
pub fn apply(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}
