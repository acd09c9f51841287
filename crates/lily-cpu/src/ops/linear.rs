//! `linear`: y[T, out] = x[T, in] . W[out, in]^T, weights widened to f32 a
//! block of rows at a time, rows split across threads.

use lily_model::Mat;
use rayon::prelude::*;

/// Rows per work item: their widened f32 copies (ROWS x in) stay in L2
/// while every token of the step streams past them.
const ROWS: usize = 16;

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    // 16 independent accumulators so the compiler vectorises and pipelines.
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0f32;
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    let mut tree = [0f32; 8];
    for i in 0..8 {
        tree[i] = acc[i] + acc[i + 8];
    }
    (tree[0] + tree[4]) + (tree[1] + tree[5]) + (tree[2] + tree[6]) + (tree[3] + tree[7]) + s
}

/// y[T, w.rows] = x[T, w.cols] . W^T
pub fn linear(x: &[f32], t: usize, w: &Mat) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), t * cols, "linear: x is not [T={t}, {cols}]");
    let mut yt = vec![0f32; rows * t]; // [rows, T], transposed below
    yt.par_chunks_mut(ROWS * t)
        .enumerate()
        .for_each(|(blk, out)| {
            let r0 = blk * ROWS;
            let n = out.len() / t;
            let mut wb = vec![0f32; n * cols];
            for i in 0..n {
                w.row_f32(r0 + i, &mut wb[i * cols..(i + 1) * cols]);
            }
            for tok in 0..t {
                let xr = &x[tok * cols..(tok + 1) * cols];
                for i in 0..n {
                    out[i * t + tok] = dot(&wb[i * cols..(i + 1) * cols], xr);
                }
            }
        });
    if t == 1 {
        return yt;
    }
    let mut y = vec![0f32; t * rows];
    for r in 0..rows {
        for tok in 0..t {
            y[tok * rows + r] = yt[r * t + tok];
        }
    }
    y
}

/// Sequential `linear` for use inside an outer parallel loop (experts, heads).
pub fn linear_seq(x: &[f32], t: usize, w: &Mat, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), t * cols);
    assert_eq!(y.len(), t * rows);
    let mut wr = vec![0f32; cols];
    for r in 0..rows {
        w.row_f32(r, &mut wr);
        for tok in 0..t {
            y[tok * rows + r] = dot(&wr, &x[tok * cols..(tok + 1) * cols]);
        }
    }
}
