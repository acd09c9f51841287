//! Depthwise causal conv1d + SiLU over the GDN's q|k|v channels, with the
//! W-1 previous inputs carried between calls as the conv state.

use lily_model::tensor::round_to;
use lily_model::DType;

use super::silu;

/// x [T, C] pre-conv inputs; taps [C, W] (tap W-1 is the current token);
/// state [C, W-1], oldest first, zeros at sequence start. Returns silu(conv) [T, C]
/// and leaves the last W-1 inputs in `state`.
pub fn causal_conv1d_silu(
    x: &[f32],
    t: usize,
    c: usize,
    taps: &[f32],
    width: usize,
    state: &mut [f32],
    r: DType,
) -> Vec<f32> {
    let hist = width - 1;
    assert_eq!(x.len(), t * c, "conv: x is not [T, C]");
    assert_eq!(taps.len(), c * width, "conv: taps are not [C, W]");
    assert_eq!(state.len(), c * hist, "conv: state is not [C, W-1]");
    let mut y = vec![0f32; t * c];
    let mut seq = vec![0f32; hist + t];
    for ch in 0..c {
        seq[..hist].copy_from_slice(&state[ch * hist..(ch + 1) * hist]);
        for ti in 0..t {
            seq[hist + ti] = x[ti * c + ch];
        }
        let w = &taps[ch * width..(ch + 1) * width];
        for ti in 0..t {
            let mut acc = 0f32;
            for j in 0..width {
                acc += w[j] * seq[ti + j];
            }
            y[ti * c + ch] = acc;
        }
        state[ch * hist..(ch + 1) * hist].copy_from_slice(&seq[t..t + hist]);
    }
    // HF: conv output in the activation dtype, then SiLU in it.
    round_to(r, &mut y);
    y.iter_mut().for_each(|v| *v = silu(*v));
    round_to(r, &mut y);
    y
}
