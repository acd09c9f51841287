//! Each CUDA kernel against the CPU reference op it implements, at the
//! released sizes, on fresh random inputs (never zeros), through the typed
//! launchers of `lily_cuda::kernels` (the ones the model calls). Every test
//! needs a GPU and is ignored unless asked for (`--include-ignored`); then a
//! missing GPU is a failure.
//!
//! The GDN recurrence is checked in gdn_gpu.rs (the fused decode step and the
//! chunked prefill, both against the CPU reference), the products of one
//! decode token (gemv3, gemv_add, router_decode) in model_gpu.rs.

mod support;

use std::sync::Arc;

use lily_cpu::ops::conv::causal_conv1d_silu;
use lily_cpu::ops::moe::{ffn_seq, route};
use lily_cpu::ops::norm::{gated_rmsnorm, rmsnorm1p};
use lily_cpu::ops::rope;
use lily_cuda::gpu::{DevMat, Gpu};
use lily_cuda::kernels::attention::{attention, qk_prep, Attend, Heads, QkPrep, Rope};
use lily_cuda::kernels::embed::procedural_fill;
use lily_cuda::kernels::gdn::conv_silu;
use lily_cuda::kernels::moe::{
    moe_assign, moe_combine, moe_count, moe_down_norm, moe_gate_up, DownNorm, GateUp, MoeDims,
    ROUTE_SLOT_BYTES,
};
use lily_cuda::kernels::moe_grouped::{
    moe_down_grouped, moe_gate_up_grouped, moe_tiles, tile_list_len, Groups, TILE_ROWS,
};
use lily_cuda::kernels::norm;
use lily_cuda::kernels::sampling::{greedy_finish, greedy_lm_head};
use lily_cuda::weights::upload_mat;
use lily_model::quant::quantize_fp8_block;
use lily_model::tensor::{Procedural, Tensor};
use lily_model::weights::Ffn;
use lily_model::{DType, Mat};
use support::{bf16_bits, from_bf16_bits, gpu, random_mixed as random, round_bf16};

/// Kernels that compute in f32 as the CPU does, only summing in another order.
const TOL_F32_REORDER: f64 = 1e-5;
/// Kernels that write bf16: a rounding step is 2^-9 relative, ~4e-3 RMS over
/// random data, plus the f32 reordering.
const TOL_BF16_OUT: f64 = 8e-3;
/// Element-wise f32 the GPU and the CPU compute with the same operations
/// (the residual add, the conv history): equal up to the last bit.
const TOL_SAME_F32: f64 = 1e-7;
/// The MoE experts: the GPU rounds the SwiGLU activations to bf16 before the
/// down product (a wrong expert or weight is an O(1) error).
const TOL_MOE: f64 = 8e-3;
/// Two runs of the same top-K and the same sums (the down product from the
/// published routing vs its own): equal up to the last bits.
const TOL_MOE_SAME_ROUTING: f64 = 1e-6;
/// A routing weight the GPU publishes vs the CPU's (absolute; f32 softmax
/// in another order).
const TOL_ROUTE_WEIGHT: f32 = 1e-6;
/// The lm_head's logits against an f64 product of the same bf16 values:
/// f32 sums reordered.
const TOL_LOGITS: f64 = 1e-5;

/// [`support::rel_l2`], refusing an all-zero reference.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let e = support::rel_l2(a, b);
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    assert!(den > 0.0, "reference is all zeros");
    e
}

/// bf16 values on the device as f32.
fn download_bf16(g: &Gpu, ptr: u64, n: usize) -> Vec<f32> {
    from_bf16_bits(&g.download::<u16>(ptr, n).unwrap())
}

/// The residual add and RMSNorm of a prefill chunk (`add_rmsnorm_kernel`),
/// with a delta and then without one (the first norm of a chunk).
#[test]
#[ignore = "needs a CUDA GPU"]
fn add_rmsnorm() {
    let g = gpu();
    let (t, d, eps) = (33, 2048, 1e-6);
    let x = random(t * d, 1, 0.0, 2.0);
    let delta = random(t * d, 2, 0.0, 1.0);
    let w = random(d, 3, 0.0, 0.2);
    let w1p: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
    let (xb, db, wb, ob) = (
        g.upload_new(&x).unwrap(),
        g.upload_new(&delta).unwrap(),
        g.upload_new(&w1p).unwrap(),
        g.alloc(t * d * 2).unwrap(),
    );
    norm::add_rmsnorm(&g, xb.ptr, Some(db.ptr), wb.ptr, ob.ptr, t, d, eps).unwrap();
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    let want = rmsnorm1p(&sum, &w, eps, DType::F32);
    let e = rel_l2(&g.download::<f32>(xb.ptr, t * d).unwrap(), &sum);
    assert!(e < TOL_SAME_F32, "residual add: {e}");
    let e = rel_l2(&download_bf16(&g, ob.ptr, t * d), &want);
    assert!(e < TOL_BF16_OUT, "add_rmsnorm: {e}");

    // no delta: x is left as it is, out = norm(x) (of the sum now in x)
    g.upload(ob.ptr, &vec![0u16; t * d]).unwrap();
    norm::add_rmsnorm(&g, xb.ptr, None, wb.ptr, ob.ptr, t, d, eps).unwrap();
    let e = rel_l2(&g.download::<f32>(xb.ptr, t * d).unwrap(), &sum);
    assert!(e < TOL_SAME_F32, "x without a delta: {e}");
    let e = rel_l2(&download_bf16(&g, ob.ptr, t * d), &want);
    assert!(e < TOL_BF16_OUT, "rmsnorm without a delta: {e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gated_rmsnorm_kernel() {
    let g = gpu();
    let (t, hv, dv, eps) = (17, 32, 128, 1e-6);
    let o = random(t * hv * dv, 4, 0.0, 1.0);
    let z = random(t * hv * dv, 5, 0.0, 2.0);
    let w = random(dv, 6, 1.0, 0.2);
    let (ob, zb, wb, out) = (
        g.upload_new(&o).unwrap(),
        g.upload_new(&z).unwrap(),
        g.upload_new(&w).unwrap(),
        g.alloc(t * hv * dv * 2).unwrap(),
    );
    norm::gated_rmsnorm(&g, ob.ptr, zb.ptr, wb.ptr, out.ptr, t * hv, dv, eps).unwrap();
    let want = gated_rmsnorm(&o, &z, &w, eps, DType::F32);
    let e = rel_l2(&download_bf16(&g, out.ptr, t * hv * dv), &want);
    assert!(e < TOL_BF16_OUT, "gated_rmsnorm: {e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn causal_conv1d_silu_kernel() {
    let g = gpu();
    let (c, w) = (8192, 4);
    let taps = random(c * w, 7, 0.0, 0.5);
    let state0 = random(c * (w - 1), 8, 0.0, 1.0);
    let (tb, sb) = (g.upload_new(&taps).unwrap(), g.upload_new(&state0).unwrap());
    let mut cpu_state = state0.clone();
    // prefills of 70 tokens (strips of 16 and a ragged one), 2 (fewer than
    // the history), 1 and 300, each continuing the state
    for (step, t) in [(0u64, 70usize), (1, 2), (2, 1), (3, 300)] {
        let x = random(t * c, 9 + step, 0.0, 1.0);
        let (xb, ob) = (g.upload_new(&x).unwrap(), g.alloc(t * c * 4).unwrap());
        conv_silu(&g, xb.ptr, sb.ptr, tb.ptr, ob.ptr, t, c, w).unwrap();
        let want = causal_conv1d_silu(&x, t, c, &taps, w, &mut cpu_state, DType::F32);
        let e = rel_l2(&g.download::<f32>(ob.ptr, t * c).unwrap(), &want);
        assert!(e < TOL_F32_REORDER, "conv T={t}: {e}");
        let e = rel_l2(&g.download::<f32>(sb.ptr, c * (w - 1)).unwrap(), &cpu_state);
        assert!(e < TOL_SAME_F32, "conv state after T={t}: {e}");
    }
}

/// q/k norms + RoPE + cache append (`qk_prep`), then attention over a long
/// cache (`attention`: a causal prefill block after 4000 cached positions),
/// against the CPU's norms and RoPE and an f64 softmax oracle.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_prep_and_attention() {
    let g = gpu();
    let (hq, hkv, dh, rot, theta, eps) = (16usize, 2usize, 256usize, 64usize, 1e7f64, 1e-6);
    let heads = Heads { hq, hkv, dh };
    let max_seq = 4200;
    let (kc, vc) = (
        g.alloc(max_seq * hkv * dh * 2).unwrap(),
        g.alloc(max_seq * hkv * dh * 2).unwrap(),
    );
    // fill the cache for positions 0..pos0 with random bf16 keys/values
    let pos0 = 4000usize;
    let k_hist = random(pos0 * hkv * dh, 20, 0.0, 1.0);
    let v_hist = random(pos0 * hkv * dh, 21, 0.0, 1.0);
    g.upload(kc.ptr, &bf16_bits(&k_hist)).unwrap();
    g.upload(vc.ptr, &bf16_bits(&v_hist)).unwrap();
    let t = 9; // rows pos0..pos0+9: causal within the block
    let qg = random(t * hq * 2 * dh, 22, 0.0, 1.0);
    let k = random(t * hkv * dh, 23, 0.0, 1.0);
    let v = random(t * hkv * dh, 24, 0.0, 1.0);
    let qn = random(dh, 25, 0.0, 0.2);
    let kn = random(dh, 26, 0.0, 0.2);
    let qn1p: Vec<f32> = qn.iter().map(|x| 1.0 + x).collect();
    let kn1p: Vec<f32> = kn.iter().map(|x| 1.0 + x).collect();
    let b: Vec<_> = [&qg, &k, &v, &qn1p, &kn1p]
        .iter()
        .map(|x| g.upload_new(x).unwrap())
        .collect();
    let pos = g.upload_new(&[pos0 as i32]).unwrap();
    let qout = g.alloc(t * hq * dh * 4).unwrap();
    let out = g.alloc(t * hq * dh * 2).unwrap();
    qk_prep(
        &g,
        &QkPrep {
            qg: b[0].ptr,
            k: b[1].ptr,
            v: b[2].ptr,
            q_norm: b[3].ptr,
            k_norm: b[4].ptr,
            pos: pos.ptr,
            q_out: qout.ptr,
            kcache: kc.ptr,
            vcache: vc.ptr,
        },
        heads,
        Rope {
            rotary_dim: rot,
            theta: theta as f32,
            eps,
        },
        true,
        t,
    )
    .unwrap();
    let scale = (dh as f32).powf(-0.5);
    attention(
        &g,
        &Attend {
            q: qout.ptr,
            kcache: kc.ptr,
            vcache: vc.ptr,
            qg: b[0].ptr,
            pos: pos.ptr,
            out: out.ptr,
        },
        heads,
        scale,
        true,
        t,
    )
    .unwrap();
    // CPU: the same prep with the reference ops
    let mut q = vec![0f32; t * hq * dh];
    for i in 0..t * hq {
        q[i * dh..(i + 1) * dh].copy_from_slice(&qg[i * 2 * dh..i * 2 * dh + dh]);
    }
    let mut q = rmsnorm1p(&q, &qn, eps, DType::F32);
    let mut kk = rmsnorm1p(&k, &kn, eps, DType::F32);
    for ti in 0..t {
        let (c, s) = rope::cos_sin(pos0 + ti, rot, theta);
        for h in 0..hq {
            rope::apply(&mut q[(ti * hq + h) * dh..(ti * hq + h) * dh + rot], &c, &s);
        }
        for h in 0..hkv {
            rope::apply(
                &mut kk[(ti * hkv + h) * dh..(ti * hkv + h) * dh + rot],
                &c,
                &s,
            );
        }
    }
    let gq: Vec<f32> = g.download(qout.ptr, t * hq * dh).unwrap();
    let e = rel_l2(&gq, &q);
    assert!(e < TOL_F32_REORDER, "q prep: {e}");
    let cache_k = download_bf16(&g, kc.ptr, (pos0 + t) * hkv * dh);
    let cache_v = download_bf16(&g, vc.ptr, (pos0 + t) * hkv * dh);
    let e = rel_l2(&cache_k[pos0 * hkv * dh..], &kk);
    assert!(e < TOL_BF16_OUT, "k prep into the cache: {e}");
    // v is appended as it is (bf16-rounded), and rows before pos0 are untouched
    assert!(
        cache_v[pos0 * hkv * dh..] == round_bf16(&v)[..],
        "v appended to the cache"
    );
    assert!(
        cache_k[..pos0 * hkv * dh] == round_bf16(&k_hist)[..]
            && cache_v[..pos0 * hkv * dh] == round_bf16(&v_hist)[..],
        "cached rows before pos0 changed"
    );
    // f64 oracle of gated attention over the GPU's own cache
    let mut want = vec![0f32; t * hq * dh];
    for ti in 0..t {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            let qv = &gq[(ti * hq + h) * dh..(ti * hq + h + 1) * dh];
            let n = pos0 + ti + 1;
            let sc: Vec<f64> = (0..n)
                .map(|j| {
                    (0..dh)
                        .map(|d| qv[d] as f64 * cache_k[(j * hkv + kh) * dh + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
            for d in 0..dh {
                let o: f64 = (0..n)
                    .map(|j| (sc[j] - m).exp() / z * cache_v[(j * hkv + kh) * dh + d] as f64)
                    .sum();
                let gate = qg[(ti * hq + h) * 2 * dh + dh + d] as f64;
                want[(ti * hq + h) * dh + d] = (o / (1.0 + (-gate).exp())) as f32;
            }
        }
    }
    let e = rel_l2(&download_bf16(&g, out.ptr, t * hq * dh), &want);
    assert!(e < TOL_BF16_OUT, "attention over {pos0}+ positions: {e}");
}

/// The MoE sizes of the released model.
const MOE: MoeDims = MoeDims {
    d: 2048,
    e: 256,
    k: 8,
    f: 512,
    fs: 512,
};

/// One MoE layer's expert weights: procedural streams filled on the device,
/// and the same streams as CPU matrices; or (`Experts::fp8`) those streams
/// quantized to block FP8 on the host, the codes and scales uploaded and the
/// CPU reading the quantized matrices (exactly dequantized).
struct Experts {
    /// [e, 2f, d], [e, d, f], [2fs, d], [d, fs]
    gate_up: DevMat,
    down: DevMat,
    shared_gate_up: DevMat,
    shared_down: DevMat,
    cpu_gate_up: Mat,
    cpu_down: Mat,
    cpu_shared: Ffn,
}

impl Experts {
    fn new(g: &Gpu) -> Experts {
        let MoeDims { d, e, f, fs, .. } = MOE;
        let p = |seed: u64, std: f32| Procedural {
            seed,
            mean: 0.0,
            std,
        };
        let (pgu, pdn, psgu, psdn) = (p(31, 0.022), p(32, 0.044), p(33, 0.022), p(34, 0.044));
        let fill = |p: Procedural, n: usize| {
            let b = g.alloc(n * 2).unwrap();
            procedural_fill(g, b.ptr, p, 0, n, None).unwrap();
            DevMat::bf16(b)
        };
        let mat =
            |p: Procedural, shape: Vec<usize>| Mat::whole(Arc::new(Tensor::procedural(shape, p)));
        let sgu = mat(psgu, vec![2 * fs, d]);
        Experts {
            gate_up: fill(pgu, e * 2 * f * d),
            down: fill(pdn, e * d * f),
            shared_gate_up: fill(psgu, 2 * fs * d),
            shared_down: fill(psdn, d * fs),
            cpu_gate_up: mat(pgu, vec![e, 2 * f, d]),
            cpu_down: mat(pdn, vec![e, d, f]),
            cpu_shared: Ffn {
                gate: sgu.rows(0, fs),
                up: sgu.rows(fs, fs),
                down: mat(psdn, vec![d, fs]),
            },
        }
    }

    /// The same streams as block FP8 (the rule of Qwen's releases,
    /// `quantize_fp8_block`): each stacked matrix quantized whole, which for
    /// sizes that are multiples of 128 is each expert's own blocks.
    fn fp8(g: &Gpu) -> Experts {
        let MoeDims { d, e, f, fs, .. } = MOE;
        let p = |seed: u64, std: f32| Procedural {
            seed,
            mean: 0.0,
            std,
        };
        let q = |p: Procedural, rows: usize, cols: usize| {
            let m = Mat::whole(Arc::new(Tensor::procedural(vec![rows, cols], p)));
            Mat::whole(Arc::new(quantize_fp8_block(rows, cols, &|r, out| {
                m.row_f32(r, out)
            })))
        };
        let (gu, dn) = (q(p(31, 0.022), e * 2 * f, d), q(p(32, 0.044), e * d, f));
        let (sgu, sdn) = (q(p(33, 0.022), 2 * fs, d), q(p(34, 0.044), d, fs));
        let up = |m: &Mat| {
            let dm = upload_mat(g, &[m]).unwrap();
            assert!(dm.is_fp8(), "uploaded as block FP8");
            dm
        };
        Experts {
            gate_up: up(&gu),
            down: up(&dn),
            shared_gate_up: up(&sgu),
            shared_down: up(&sdn),
            cpu_shared: Ffn {
                gate: sgu.rows(0, fs),
                up: sgu.rows(fs, fs),
                down: sdn,
            },
            cpu_gate_up: gu,
            cpu_down: dn,
        }
    }

    /// The CPU's expert in a slot: routed expert `ex`, or the shared one (None).
    fn ffn(&self, ex: Option<usize>) -> Ffn {
        let MoeDims { d, f, .. } = MOE;
        match ex {
            None => self.cpu_shared.clone(),
            Some(ex) => Ffn {
                gate: self.cpu_gate_up.rows(ex * 2 * f, f),
                up: self.cpu_gate_up.rows(ex * 2 * f + f, f),
                down: self.cpu_down.rows(ex * d, d),
            },
        }
    }

    /// The CPU's weighted sum of the experts of one token x [d]: sum over
    /// (expert or shared, weight) of weight * SwiGLU(x).
    fn mix(&self, x: &[f32], slots: impl Iterator<Item = (Option<usize>, f32)>) -> Vec<f32> {
        let mut out = vec![0f32; MOE.d];
        for (ex, wt) in slots {
            let y = ffn_seq(x, 1, &self.ffn(ex), DType::F32);
            for (o, y) in out.iter_mut().zip(&y) {
                *o += wt * y;
            }
        }
        out
    }
}

/// One decode token's experts (`moe_gate_up`: gate/up with SiLU, routed from
/// the router's logits by every block; `moe_down_norm`: down with the routing
/// weights and the residual add, and the final norm) against the CPU's
/// routing and SwiGLU, and the route slot gate/up publishes for the down
/// product.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_experts() {
    let g = gpu();
    moe_experts_with(&g, &Experts::new(&g));
}

/// `moe_experts` with block-FP8 experts: the decode kernels dequantize
/// exactly (codes widened, each 16-code chunk's sum scaled in f32), so the
/// same tolerances hold against the CPU reading the same quantized matrices.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_experts_fp8() {
    let g = gpu();
    moe_experts_with(&g, &Experts::fp8(&g));
}

fn moe_experts_with(g: &Gpu, experts: &Experts) {
    let MoeDims { d, e, k, f, fs } = MOE;
    let x = round_bf16(&random(d, 35, 0.0, 1.0));
    let resid = random(d, 36, 0.0, 1.0);
    // The logits are rounded to halves, so the top 8 hold exact ties, which
    // must go to the lower expert id as on the CPU.
    let logits: Vec<f32> = random(e + 1, 38, 0.0, 2.0)
        .iter()
        .map(|v| (v * 2.0).round() / 2.0)
        .collect();
    let (xb, lb, hb, rb, counter) = (
        g.upload_new(&bf16_bits(&x)).unwrap(),
        g.upload_new(&logits).unwrap(),
        g.alloc((k + 1) * f.max(fs) * 2).unwrap(),
        g.alloc(d * 4).unwrap(), // the residual, filled by each down product
        g.alloc(4).unwrap(),
    );
    g.zero(counter.ptr, 4).unwrap();
    // gate/up, publishing the routing into `route` when given
    let gate_up = |route: Option<u64>| {
        moe_gate_up(
            g,
            MOE,
            &GateUp {
                x: xb.ptr,
                gate_up: &experts.gate_up,
                shared_gate_up: &experts.shared_gate_up,
                logits: lb.ptr,
                h: hb.ptr,
                route,
                // the L2 prefetch ahead (no effect on the output)
                ahead: &experts.shared_down,
            },
        )
        .unwrap()
    };
    // the down product into a fresh copy of the residual; with `route` it
    // takes the routing from that slot when published
    let down = |route: Option<u64>, final_norm: Option<(u64, u64, f32)>| {
        g.upload(rb.ptr, &resid).unwrap();
        moe_down_norm(
            g,
            MOE,
            &DownNorm {
                h: hb.ptr,
                down: &experts.down,
                shared_down: &experts.shared_down,
                logits: lb.ptr,
                x: rb.ptr,
                final_norm,
                counter: counter.ptr,
                route,
            },
        )
        .unwrap();
        let got = g.download::<f32>(rb.ptr, d).unwrap();
        assert_eq!(
            g.download::<u32>(counter.ptr, 1).unwrap()[0],
            0,
            "the down product's block counter is left zeroed"
        );
        got
    };

    gate_up(None);
    let got1 = down(None, None);
    let routing = route(&logits[..e], k, DType::F32);
    let sg = 1.0 / (1.0 + (-logits[e]).exp());
    let slots = routing
        .iter()
        .map(|&(ex, wt)| (Some(ex), wt))
        .chain([(None, sg)]);
    let want1 = experts.mix(&x, slots);
    let delta1: Vec<f32> = got1.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let e1 = rel_l2(&delta1, &want1);
    // a wrong expert (a tie broken the other way) would give an O(1) error
    assert!(e1 < TOL_MOE, "moe experts, decode form: {e1}");

    // The final norm after the last layer: out = bf16(norm(x) * (1 + w)) of
    // the updated residual, x as without it.
    let (eps, w) = (1e-6f32, random(d, 39, 0.0, 0.2));
    let w1p: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
    let (wb, nb) = (g.upload_new(&w1p).unwrap(), g.alloc(d * 2).unwrap());
    let got_n = down(None, Some((wb.ptr, nb.ptr, eps)));
    let e = rel_l2(&got_n, &got1);
    assert!(e < TOL_MOE_SAME_ROUTING, "x with the final norm: {e}");
    let want_n = rmsnorm1p(&got_n, &w, eps, DType::F32);
    let e = rel_l2(&download_bf16(g, nb.ptr, d), &want_n);
    assert!(e < TOL_BF16_OUT, "the down product's final norm: {e}");

    // The route slot (moe.cu RouteSlot as u32 words: flag, pad, idx [8] from
    // word 2, wts [9] from word 10): one gate/up block publishes the routing
    // it computed; it must be the CPU's (ids in order, weights), and the down
    // product taking it must give the same sums as its own top-K.
    let words_n = ROUTE_SLOT_BYTES / 4;
    assert_eq!(words_n, 10 + MOE.k + 1, "the route slot's layout");
    let slot = g.alloc(ROUTE_SLOT_BYTES).unwrap();
    g.zero(slot.ptr, ROUTE_SLOT_BYTES).unwrap();
    gate_up(Some(slot.ptr));
    let words: Vec<u32> = g.download(slot.ptr, words_n).unwrap();
    assert_eq!(words[0], 1, "route slot flag");
    for (i, &(ex, wt)) in routing.iter().enumerate() {
        assert_eq!(words[2 + i] as usize, ex, "published expert {i}");
        let w = f32::from_bits(words[10 + i]);
        assert!(
            (w - wt).abs() < TOL_ROUTE_WEIGHT,
            "published weight {i}: {w} vs {wt}"
        );
    }
    let w = f32::from_bits(words[10 + k]);
    assert!(
        (w - sg).abs() < TOL_ROUTE_WEIGHT,
        "published shared gate: {w} vs {sg}"
    );
    let close = |a: &[f32], what: &str| {
        let e = rel_l2(a, &got1);
        assert!(e < TOL_MOE_SAME_ROUTING, "{what}: {e}");
    };
    close(
        &down(Some(slot.ptr), None),
        "down product from the published routing vs its own top-K",
    );
    // an unpublished slot (flag 0): the down product falls back to its own top-K
    g.zero(slot.ptr, 8).unwrap();
    close(&down(Some(slot.ptr), None), "down product's fallback");
    // a published slot is obeyed: its weights doubled double the experts' sum
    let mut doubled = words.clone();
    for i in 0..=k {
        doubled[10 + i] = (2.0 * f32::from_bits(words[10 + i])).to_bits();
    }
    g.upload(slot.ptr, &doubled).unwrap();
    let got2 = down(Some(slot.ptr), None);
    let delta2: Vec<f32> = got2.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let twice: Vec<f32> = delta1.iter().map(|v| 2.0 * v).collect();
    let e2 = rel_l2(&delta2, &twice);
    assert!(
        e2 < TOL_F32_REORDER,
        "down product with the slot's doubled weights: {e2}"
    );
}

/// Tokens of `moe_grouped_prefill`'s chunk: 2,400 (token, slot) pairs.
const GROUPED_TOKENS: usize = 300;
/// The grouped GEMMs' products against an f64 product of the same bf16
/// values: f32 accumulation in another order, then (gate/up) one bf16
/// rounding of the output, ~2^-9 relative, 4e-3 RMS at most.
const TOL_GROUPED_BF16: f64 = 8e-3;

/// Experts of `moe_grouped_prefill` and their routing: slot 0 sends every
/// token to expert 7 (300 rows: three tiles, the last partial), slot 1 the
/// first 129 tokens to expert 8 (a full tile and a tile of one row), token 200
/// alone to expert 3 and token 250 alone to expert 255 (the last); the other
/// slots spread over experts 9..199, so experts 0-2, 4-6 and 200-254 get no
/// rows at all.
fn grouped_routing(t: usize, k: usize) -> Vec<i32> {
    let spread = |ti: usize, s: usize| (9 + (ti * 37 + s * 53) % 191) as i32;
    (0..t * k)
        .map(|i| {
            let (ti, s) = (i / k, i % k);
            match s {
                0 => 7,
                1 if ti < 129 => 8,
                1 if ti == 200 => 3,
                1 if ti == 250 => 255,
                _ => spread(ti, s),
            }
        })
        .collect()
}

/// A prefill chunk's experts as the model runs them (model/moe_prefill.rs),
/// on the tensor cores: `moe_count`, `moe_tiles` and `moe_assign` sort the
/// (token, slot) pairs by expert and list the GEMM tiles on the device,
/// `moe_gate_up_grouped` (SiLU fused) and `moe_down_grouped` run every
/// expert's rows in one launch each, the shared expert through the same
/// kernels as one group of all tokens, and `moe_combine` adds the weighted sum
/// into the residual. Checked: the counts, offsets and tile list exactly; each
/// pair's row; the gate/up activations of every row of experts 7, 8, 3 and 255
/// (multi-tile, a one-row tile, single rows, the last expert) and the shared
/// expert's against f64 products of the same bf16 values; the whole block
/// against the CPU's SwiGLU per token on 30 tokens.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_grouped_prefill() {
    let g = gpu();
    moe_grouped_prefill_with(&g, &Experts::new(&g));
}

/// `moe_grouped_prefill` with block-FP8 experts: the grouped GEMMs
/// dequantize each code to bf16(code x scale) in their main loop, a bf16
/// rounding of every weight (2^-9 relative), within TOL_GROUPED_BF16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_grouped_prefill_fp8() {
    let g = gpu();
    moe_grouped_prefill_with(&g, &Experts::fp8(&g));
}

fn moe_grouped_prefill_with(g: &Gpu, experts: &Experts) {
    let MoeDims { d, e, k, f, fs } = MOE;
    let t = GROUPED_TOKENS;
    let pairs = t * k;
    let x = round_bf16(&random(t * d, 40, 0.0, 1.0));
    let resid = random(t * d, 41, 0.0, 1.0);
    let idx = grouped_routing(t, k);
    for ti in 0..t {
        let row = &idx[ti * k..(ti + 1) * k];
        assert!(
            (0..k).all(|s| !row[..s].contains(&row[s])),
            "token {ti}: distinct experts"
        );
    }
    let wts = random(t * (k + 1), 37, 0.5, 0.2);
    let alloc = |bytes: usize| g.alloc(bytes).unwrap();
    let (xb, ib, wb, rb) = (
        g.upload_new(&bf16_bits(&x)).unwrap(),
        g.upload_new(&idx).unwrap(),
        g.upload_new(&wts).unwrap(),
        g.upload_new(&resid).unwrap(),
    );
    let (counts, offsets, rowmap, src) = (
        alloc(e * 4),
        alloc(e * 4),
        alloc(pairs * 4),
        alloc(pairs * 4),
    );
    let tiles = alloc(tile_list_len(pairs, e) * 4);
    let (hs, os, hsh, osh) = (
        alloc(pairs * f * 2),
        alloc(pairs * d * 4),
        alloc(t * fs * 2),
        alloc(t * d * 4),
    );

    // the sort: counts per expert, offsets and tiles, each pair's row
    g.zero(counts.ptr, e * 4).unwrap();
    moe_count(g, ib.ptr, pairs, counts.ptr).unwrap();
    moe_tiles(g, counts.ptr, pairs, e, offsets.ptr, &tiles).unwrap();
    let got_counts: Vec<i32> = g.download(counts.ptr, e).unwrap();
    let mut want_counts = vec![0i32; e];
    for &i in &idx {
        want_counts[i as usize] += 1;
    }
    assert_eq!(got_counts, want_counts, "moe_count");
    assert_eq!(
        (
            want_counts[7],
            want_counts[8],
            want_counts[3],
            want_counts[255],
            want_counts[0]
        ),
        (300, 129, 1, 1, 0),
        "the routing's ragged counts"
    );
    let off: Vec<i32> = want_counts
        .iter()
        .scan(0, |acc, &c| {
            let o = *acc;
            *acc += c;
            Some(o)
        })
        .collect();
    assert_eq!(
        g.download::<i32>(offsets.ptr, e).unwrap(),
        off,
        "moe_tiles: offsets"
    );
    let mut want_tiles = vec![0i32];
    for (ei, &c) in want_counts.iter().enumerate() {
        for tile in 0..(c as usize).div_ceil(TILE_ROWS) {
            want_tiles.push(ei as i32 | (tile as i32) << 16);
        }
    }
    want_tiles[0] = want_tiles.len() as i32 - 1;
    let got_tiles: Vec<i32> = g.download(tiles.ptr, want_tiles.len()).unwrap();
    assert_eq!(got_tiles, want_tiles, "moe_tiles: the tile list");
    moe_assign(g, ib.ptr, pairs, k, e, offsets.ptr, rowmap.ptr, src.ptr).unwrap();
    let rm: Vec<i32> = g.download(rowmap.ptr, pairs).unwrap();
    let sr: Vec<i32> = g.download(src.ptr, pairs).unwrap();
    // each expert's pairs take its rows in pair (token) order
    let mut next = off.clone();
    for (i, &ei) in idx.iter().enumerate() {
        let ei = ei as usize;
        assert_eq!(rm[i], next[ei], "moe_assign: pair {i}'s row");
        next[ei] += 1;
        assert_eq!(
            sr[rm[i] as usize] as usize,
            i / k,
            "moe_assign: row {}'s token",
            rm[i]
        );
    }

    let groups = Groups::Experts {
        pairs,
        e,
        tiles: &tiles,
        offsets: offsets.ptr,
        counts: counts.ptr,
    };
    // the activation rows start as NaN: every row of a routed expert must be written
    g.upload(hs.ptr, &vec![0x7fc0u16; pairs * f]).unwrap();
    moe_gate_up_grouped(
        g,
        &groups,
        xb.ptr,
        Some(src.ptr),
        &experts.gate_up,
        hs.ptr,
        f,
        d,
    )
    .unwrap();
    moe_down_grouped(g, &groups, hs.ptr, &experts.down, os.ptr, d, f).unwrap();
    let one = Groups::One { rows: t };
    moe_gate_up_grouped(
        g,
        &one,
        xb.ptr,
        None,
        &experts.shared_gate_up,
        hsh.ptr,
        fs,
        d,
    )
    .unwrap();
    moe_down_grouped(g, &one, hsh.ptr, &experts.shared_down, osh.ptr, d, fs).unwrap();

    // gate/up activations: rows of expert `ex` (None: the shared expert over all tokens)
    let got_hs = from_bf16_bits(&g.download::<u16>(hs.ptr, pairs * f).unwrap());
    let got_hsh = from_bf16_bits(&g.download::<u16>(hsh.ptr, t * fs).unwrap());
    assert!(
        got_hs.iter().all(|v| v.is_finite()),
        "an activation row left unwritten"
    );
    let swiglu = |w: &Mat, r0: usize, width: usize, xr: &[f32]| -> Vec<f32> {
        let mut row = vec![0f32; d];
        let dot = |r: usize, row: &mut Vec<f32>| {
            w.row_f32(r, row);
            row.iter()
                .zip(xr)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
        };
        (0..width)
            .map(|j| {
                let (gt, up) = (dot(r0 + j, &mut row), dot(r0 + width + j, &mut row));
                (gt / (1.0 + (-gt).exp()) * up) as f32
            })
            .collect()
    };
    for ex in [7usize, 8, 3, 255] {
        let (o, c) = (off[ex] as usize, want_counts[ex] as usize);
        let mut want = Vec::new();
        for &ti in &sr[o..o + c] {
            let ti = ti as usize;
            want.extend(swiglu(
                &experts.cpu_gate_up,
                ex * 2 * f,
                f,
                &x[ti * d..(ti + 1) * d],
            ));
        }
        let err = rel_l2(&got_hs[o * f..(o + c) * f], &want);
        assert!(
            err < TOL_GROUPED_BF16,
            "gate/up of expert {ex} ({c} rows): {err}"
        );
    }
    // (the shared gate and up rows are one matrix, [2fs, d])
    let sgu = Mat::whole(experts.cpu_shared.gate.t.clone());
    let mut want = Vec::new();
    for ti in 0..t {
        want.extend(swiglu(&sgu, 0, fs, &x[ti * d..(ti + 1) * d]));
    }
    let err = rel_l2(&got_hsh, &want);
    assert!(
        err < TOL_GROUPED_BF16,
        "gate/up of the shared expert: {err}"
    );

    moe_combine(g, os.ptr, osh.ptr, rowmap.ptr, wb.ptr, rb.ptr, t, d, k).unwrap();
    let got: Vec<f32> = g.download(rb.ptr, t * d).unwrap();
    let checked: Vec<usize> = (0..t).step_by(10).chain([129, 200, 250, 299]).collect();
    let (mut delta_got, mut delta_want) = (Vec::new(), Vec::new());
    for &ti in &checked {
        let slots = (0..=k).map(|s| {
            let ex = (s < k).then(|| idx[ti * k + s] as usize);
            (ex, wts[ti * (k + 1) + s])
        });
        delta_want.extend(experts.mix(&x[ti * d..(ti + 1) * d], slots));
        delta_got.extend((0..d).map(|i| got[ti * d + i] - resid[ti * d + i]));
    }
    let e2 = rel_l2(&delta_got, &delta_want);
    assert!(e2 < TOL_MOE, "moe experts, grouped prefill: {e2}");
}

/// The decode step's lm_head and greedy choice (`greedy_lm_head`: gemv_kernel
/// and argmax_blocks_kernel; `greedy_finish`: argmax_finish_kernel) against
/// the host: the logits against an f64
/// product of the same bf16 values (TOL_LOGITS), the id
/// exactly the host argmax of the kernel's own logits over the ids below
/// `valid` (largest, lowest id on a tie, NaN never), the position advanced
/// and held at `max_pos`, and the running maximum cleared for the next step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_lm_head_and_finish() {
    let g = gpu();
    // N not a multiple of 8: the last block is partial
    let (n, k) = (40_003usize, 2048usize);
    let best = g.alloc(8).unwrap();
    g.zero(best.ptr, 8).unwrap();
    let (next, pos, valid_buf) = (
        g.alloc(4).unwrap(),
        g.alloc(4).unwrap(),
        g.alloc(4).unwrap(),
    );
    g.upload(pos.ptr, &[5i32]).unwrap();
    let host_ids = g.alloc_mapped(2).unwrap();
    // round 0: two identical strongest rows (the lower id must win), every
    // id valid; round 1: a NaN logit, and rows past `valid` far above the rest
    for (round, seed) in [(0usize, 101u64), (1, 102)] {
        let mut w = random(n * k, seed, 0.0, 1.0);
        let x = random(k, seed + 50, 0.0, 1.0);
        let (a, b) = (5_000 + 977 * round, 20_000 + 1_311 * round);
        let strong: Vec<f32> = w[a * k..(a + 1) * k].iter().map(|v| v * 4.0).collect();
        let valid = if round == 0 { n } else { n - 40 };
        // make row a (and b) the largest by aligning it with x, exactly in bf16
        for (i, v) in strong.iter().enumerate() {
            let s = v.abs() * x[i].signum();
            w[a * k + i] = s;
            w[b * k + i] = s;
        }
        if round == 1 {
            w[a * k + 3] = f32::NAN; // row a is NaN now: row b must win
            for r in valid..n {
                for i in 0..k {
                    w[r * k + i] = w[b * k + i] * 8.0;
                }
            }
        }
        let wb = g.upload_new(&bf16_bits(&w)).unwrap();
        let xb = g.upload_new(&bf16_bits(&x)).unwrap();
        let y = g.alloc(n * 4).unwrap();
        g.upload(valid_buf.ptr, &[valid as i32]).unwrap();
        greedy_lm_head(&g, &wb, xb.ptr, y.ptr, n, k, valid_buf.ptr, best.ptr).unwrap();
        greedy_finish(&g, best.ptr, next.ptr, pos.ptr, 6, host_ids.dev, 0).unwrap();
        let yl = g.download::<f32>(y.ptr, n).unwrap();
        let want: Vec<f32> = (0..n)
            .map(|r| {
                (0..k)
                    .map(|i| w[r * k + i] as f64 * x[i] as f64)
                    .sum::<f64>() as f32
            })
            .collect();
        let real: Vec<usize> = (0..n).filter(|&r| !want[r].is_nan()).collect();
        assert_eq!(real.len(), n - round, "round {round}: NaN rows");
        assert!(
            yl[a].is_nan() == (round == 1),
            "round {round}: row {a} {}",
            yl[a]
        );
        let e = rel_l2(
            &real.iter().map(|&r| yl[r]).collect::<Vec<_>>(),
            &real.iter().map(|&r| want[r]).collect::<Vec<_>>(),
        );
        assert!(e < TOL_LOGITS, "round {round}: logits rel L2 {e:.3e}");
        let mut host: Option<usize> = None;
        for (r, &v) in yl[..valid].iter().enumerate() {
            if !v.is_nan() && host.is_none_or(|h| v > yl[h]) {
                host = Some(r);
            }
        }
        let host = host.unwrap();
        assert_eq!(
            host,
            if round == 0 { a } else { b },
            "round {round}: planted maximum"
        );
        let got = g.download::<i32>(next.ptr, 1).unwrap()[0];
        assert_eq!(got as usize, host, "round {round}: chosen id");
        // the step at position 5 (round 0), then 6 (round 1): slot pos & 1
        assert_eq!(
            host_ids.get(1 - round),
            got,
            "round {round}: mapped host copy"
        );
        assert_eq!(
            g.download::<u64>(best.ptr, 1).unwrap()[0],
            0,
            "round {round}: best cleared"
        );
        // 5 -> 6, then held at max_pos 6
        assert_eq!(
            g.download::<i32>(pos.ptr, 1).unwrap()[0],
            6,
            "round {round}: position"
        );
    }
}
