//! Gated DeltaNet: the mixer of 3 layers in 4. The core recurrence exists twice,
//! as the obvious per-token loop (decode, and the truth) and in the chunked
//! UT-transform form (prefill); a test checks that they agree.

use lily_model::tensor::round_to;
use lily_model::weights::GdnWeights;
use lily_model::{Config, DType};
use rayon::prelude::*;

use super::conv::causal_conv1d_silu;
use super::linear::{dot, linear};
use super::norm::gated_rmsnorm;
use super::{sigmoid, softplus};

/// Chunk length of the chunked form (as HF and fla use).
pub const CHUNK: usize = 64;

/// Per-sequence state of one GDN layer.
#[derive(Clone)]
pub struct GdnState {
    /// [C, W-1] previous pre-conv inputs
    pub conv: Vec<f32>,
    /// [Hv, Dk, Dv] recurrent state, f32
    pub s: Vec<f32>,
}

impl GdnState {
    pub fn new(cfg: &Config) -> GdnState {
        GdnState {
            conv: vec![0.0; cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1)],
            s: vec![
                0.0;
                cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            ],
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    Recurrent,
    Chunked,
}

/// Inputs of the core recurrence, already normalised: q, k L2-normed per head
/// and q scaled by Dk^-1/2.
pub struct GdnCore<'a> {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    /// [T, Hk, Dk]
    pub q: &'a [f32],
    /// [T, Hk, Dk]
    pub k: &'a [f32],
    /// [T, Hv, Dv]
    pub v: &'a [f32],
    /// [T, Hv] log-decay (<= 0)
    pub g: &'a [f32],
    /// [T, Hv]
    pub beta: &'a [f32],
}

impl GdnCore<'_> {
    /// q/k rows of token `ti` for v head `j`: k head j / (Hv/Hk), as HF's repeat_interleave.
    fn qk(&self, ti: usize, j: usize) -> std::ops::Range<usize> {
        let kh = j / (self.hv / self.hk);
        (ti * self.hk + kh) * self.dk..(ti * self.hk + kh + 1) * self.dk
    }
    fn vr(&self, ti: usize, j: usize) -> std::ops::Range<usize> {
        (ti * self.hv + j) * self.dv..(ti * self.hv + j + 1) * self.dv
    }

    /// Run the recurrence over all T tokens; `s` is [Hv, Dk, Dv], updated.
    /// Returns o [T, Hv, Dv].
    pub fn run(&self, s: &mut [f32], form: GdnForm) -> Vec<f32> {
        let (t, hv, dk, dv) = (self.t, self.hv, self.dk, self.dv);
        assert_eq!(s.len(), hv * dk * dv, "gdn: state is not [Hv, Dk, Dv]");
        let per_head: Vec<Vec<f32>> = s
            .par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(j, sj)| match form {
                GdnForm::Recurrent => self.head_recurrent(j, sj),
                GdnForm::Chunked => self.head_chunked(j, sj),
            })
            .collect();
        let mut o = vec![0f32; t * hv * dv];
        for (j, oj) in per_head.iter().enumerate() {
            for ti in 0..t {
                o[self.vr(ti, j)].copy_from_slice(&oj[ti * dv..(ti + 1) * dv]);
            }
        }
        o
    }

    /// `S = exp(g) S; u = S^T k; S += k (beta (v - u))^T; o = S^T q`, token by token.
    fn head_recurrent(&self, j: usize, s: &mut [f32]) -> Vec<f32> {
        let (dk, dv) = (self.dk, self.dv);
        let mut out = vec![0f32; self.t * dv];
        let mut u = vec![0f32; dv];
        for ti in 0..self.t {
            let q = &self.q[self.qk(ti, j)];
            let k = &self.k[self.qk(ti, j)];
            let v = &self.v[self.vr(ti, j)];
            let decay = self.g[ti * self.hv + j].exp();
            let beta = self.beta[ti * self.hv + j];
            s.iter_mut().for_each(|x| *x *= decay);
            u.fill(0.0);
            for r in 0..dk {
                let row = &s[r * dv..(r + 1) * dv];
                for c in 0..dv {
                    u[c] += row[c] * k[r];
                }
            }
            for c in 0..dv {
                u[c] = beta * (v[c] - u[c]);
            }
            for r in 0..dk {
                let row = &mut s[r * dv..(r + 1) * dv];
                for c in 0..dv {
                    row[c] += k[r] * u[c];
                }
            }
            let o = &mut out[ti * dv..(ti + 1) * dv];
            for r in 0..dk {
                let row = &s[r * dv..(r + 1) * dv];
                for c in 0..dv {
                    o[c] += row[c] * q[r];
                }
            }
        }
        out
    }

    /// Chunked form: within a chunk of n tokens with cumulative log-decay gam,
    /// A[i,j] = (beta_i k_i . k_j) exp(gam_i - gam_j) (j < i); solve (I + A) U = beta v
    /// and (I + A) Wm = beta k exp(gam) by forward substitution; then
    /// v' = U - Wm S, o_i = exp(gam_i) q_i S + sum_{j<=i} (q_i . k_j) exp(gam_i - gam_j) v'_j,
    /// S = exp(gam_n) S + sum_i exp(gam_n - gam_i) k_i v'_i^T.
    fn head_chunked(&self, j: usize, s: &mut [f32]) -> Vec<f32> {
        let (dk, dv) = (self.dk, self.dv);
        let mut out = vec![0f32; self.t * dv];
        let mut c0 = 0;
        while c0 < self.t {
            let n = CHUNK.min(self.t - c0);
            let q: Vec<&[f32]> = (0..n).map(|i| &self.q[self.qk(c0 + i, j)]).collect();
            let k: Vec<&[f32]> = (0..n).map(|i| &self.k[self.qk(c0 + i, j)]).collect();
            let v: Vec<&[f32]> = (0..n).map(|i| &self.v[self.vr(c0 + i, j)]).collect();
            let beta: Vec<f32> = (0..n).map(|i| self.beta[(c0 + i) * self.hv + j]).collect();
            let mut gam = vec![0f32; n];
            let mut acc = 0f32;
            for i in 0..n {
                acc += self.g[(c0 + i) * self.hv + j];
                gam[i] = acc;
            }
            // A (strictly lower) and the two triangular solves.
            let mut a = vec![0f32; n * n];
            for i in 0..n {
                for jj in 0..i {
                    a[i * n + jj] = beta[i] * dot(k[i], k[jj]) * (gam[i] - gam[jj]).exp();
                }
            }
            let mut u = vec![0f32; n * dv];
            let mut wm = vec![0f32; n * dk];
            for i in 0..n {
                for c in 0..dv {
                    u[i * dv + c] = beta[i] * v[i][c];
                }
                let e = gam[i].exp();
                for r in 0..dk {
                    wm[i * dk + r] = beta[i] * k[i][r] * e;
                }
                for jj in 0..i {
                    let aij = a[i * n + jj];
                    let (done, cur) = u.split_at_mut(i * dv);
                    for c in 0..dv {
                        cur[c] -= aij * done[jj * dv + c];
                    }
                    let (done, cur) = wm.split_at_mut(i * dk);
                    for r in 0..dk {
                        cur[r] -= aij * done[jj * dk + r];
                    }
                }
            }
            // v' = U - Wm S
            let mut vp = u;
            for i in 0..n {
                let row = &mut vp[i * dv..(i + 1) * dv];
                for r in 0..dk {
                    let w = wm[i * dk + r];
                    let srow = &s[r * dv..(r + 1) * dv];
                    for c in 0..dv {
                        row[c] -= w * srow[c];
                    }
                }
            }
            for i in 0..n {
                let o = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
                let e = gam[i].exp();
                for r in 0..dk {
                    let w = q[i][r] * e;
                    let srow = &s[r * dv..(r + 1) * dv];
                    for c in 0..dv {
                        o[c] += w * srow[c];
                    }
                }
                for jj in 0..=i {
                    let p = dot(q[i], k[jj]) * (gam[i] - gam[jj]).exp();
                    for c in 0..dv {
                        o[c] += p * vp[jj * dv + c];
                    }
                }
            }
            let last = gam[n - 1];
            let el = last.exp();
            s.iter_mut().for_each(|x| *x *= el);
            for i in 0..n {
                let e = (last - gam[i]).exp();
                for r in 0..dk {
                    let w = k[i][r] * e;
                    let srow = &mut s[r * dv..(r + 1) * dv];
                    for c in 0..dv {
                        srow[c] += w * vp[i * dv + c];
                    }
                }
            }
            c0 += n;
        }
        out
    }
}

/// `x * rsqrt(sum x^2 + 1e-6)` per row of `n` values (fla's l2norm), times `scale`.
pub fn l2norm_rows(x: &mut [f32], n: usize, scale: f32) {
    for row in x.chunks_exact_mut(n) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        row.iter_mut().for_each(|v| *v *= inv * scale);
    }
}

/// The heads and head dimensions of a GDN layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    /// q/k heads
    pub hk: usize,
    /// v heads (a multiple of `hk`)
    pub hv: usize,
    /// q/k head dim
    pub dk: usize,
    /// v head dim
    pub dv: usize,
}

impl GdnDims {
    /// The config's `linear_*` heads and head dims.
    pub fn of(cfg: &Config) -> GdnDims {
        GdnDims {
            hk: cfg.linear_num_key_heads,
            hv: cfg.linear_num_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
        }
    }

    /// Width of a post-conv row: q | k | v.
    pub fn conv_width(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }
}

/// The core recurrence's inputs for `t` tokens, as [`prepare`] builds them.
pub struct GdnPrepared {
    pub t: usize,
    pub dims: GdnDims,
    /// [T, Hk, Dk] L2-normalised, scaled by Dk^-1/2
    pub q: Vec<f32>,
    /// [T, Hk, Dk] L2-normalised
    pub k: Vec<f32>,
    /// [T, Hv, Dv]
    pub v: Vec<f32>,
    /// [T, Hv] log-decay `-exp(A_log) * softplus(a + dt_bias)`
    pub g: Vec<f32>,
    /// [T, Hv] `sigmoid(b)`
    pub beta: Vec<f32>,
}

impl GdnPrepared {
    /// The core recurrence over these inputs.
    pub fn core(&self) -> GdnCore<'_> {
        let GdnDims { hk, hv, dk, dv } = self.dims;
        GdnCore {
            t: self.t,
            hk,
            hv,
            dk,
            dv,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

/// Everything between the causal conv and the core recurrence (the
/// `gdn_gates` contract and the q/k normalisation of `lily_model::ops`):
/// `beta = sigmoid(b)` (rounded to `r`, where HF materialises it),
/// `g = -exp(A_log) * softplus(a + dt_bias)`, and the post-conv rows `conv`
/// [T, C] split into q | k | v with q and k L2-normalised per head and q
/// scaled by Dk^-1/2. `b` and `a` are the [T, Hv] outputs of `in_proj_b` and
/// `in_proj_a`; `a_log` and `dt_bias` are [Hv]. T is `b.len() / Hv`.
///
/// It is the reference for a backend that fuses these steps into its
/// kernels: the GPU tests build the core's inputs with it, as [`gdn`] does.
pub fn prepare(
    d: GdnDims,
    conv: &[f32],
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    r: DType,
) -> GdnPrepared {
    let GdnDims { hk, hv, dk, dv } = d;
    let (c, t) = (d.conv_width(), b.len() / hv);
    assert_eq!(b.len(), t * hv, "gdn: b is not [T, Hv]");
    assert_eq!(a.len(), t * hv, "gdn: a is not [T, Hv]");
    assert_eq!(conv.len(), t * c, "gdn: the conv rows are not [T, C]");
    assert!(
        a_log.len() == hv && dt_bias.len() == hv,
        "gdn: A_log and dt_bias are not [Hv]"
    );
    let mut beta: Vec<f32> = b.iter().map(|x| sigmoid(*x)).collect();
    round_to(r, &mut beta);
    let g: Vec<f32> = a
        .iter()
        .enumerate()
        .map(|(i, ai)| {
            let j = i % hv;
            -a_log[j].exp() * softplus(ai + dt_bias[j])
        })
        .collect();

    let (kd, vd) = (hk * dk, hv * dv);
    let mut q = vec![0f32; t * kd];
    let mut k = vec![0f32; t * kd];
    let mut v = vec![0f32; t * vd];
    for ti in 0..t {
        let row = &conv[ti * c..(ti + 1) * c];
        q[ti * kd..(ti + 1) * kd].copy_from_slice(&row[..kd]);
        k[ti * kd..(ti + 1) * kd].copy_from_slice(&row[kd..2 * kd]);
        v[ti * vd..(ti + 1) * vd].copy_from_slice(&row[2 * kd..]);
    }
    l2norm_rows(&mut q, dk, (dk as f32).powf(-0.5));
    l2norm_rows(&mut k, dk, 1.0);
    GdnPrepared {
        t,
        dims: d,
        q,
        k,
        v,
        g,
        beta,
    }
}

/// The GDN mixer: x [T, D] (normed) -> [T, D], advancing `state` by T tokens.
pub fn gdn(
    x: &[f32],
    t: usize,
    w: &GdnWeights,
    cfg: &Config,
    state: &mut GdnState,
    r: DType,
    form: GdnForm,
) -> Vec<f32> {
    let d = GdnDims::of(cfg);
    let c = cfg.conv_dim();
    let mut mixed = linear(x, t, &w.in_proj_qkv); // [T, C]
    round_to(r, &mut mixed);
    let mut z = linear(x, t, &w.in_proj_z); // [T, Hv*Dv]
    round_to(r, &mut z);
    let mut b = linear(x, t, &w.in_proj_b); // [T, Hv]
    round_to(r, &mut b);
    let mut a = linear(x, t, &w.in_proj_a); // [T, Hv]
    round_to(r, &mut a);

    let conv = causal_conv1d_silu(
        &mixed,
        t,
        c,
        &w.conv1d,
        cfg.linear_conv_kernel_dim,
        &mut state.conv,
        r,
    );
    let p = prepare(d, &conv, &b, &a, &w.a_log, &w.dt_bias, r);
    let mut o = p.core().run(&mut state.s, form);
    round_to(r, &mut o);
    let normed = gated_rmsnorm(&o, &z, &w.norm, cfg.rms_norm_eps, r);
    let mut y = linear(&normed, t, &w.out_proj);
    round_to(r, &mut y);
    y
}
