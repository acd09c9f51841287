//! Each CUDA kernel against the CPU reference op it implements, at the
//! released sizes, on fresh random inputs (never zeros). Skips, saying so,
//! where there is no CUDA.
//!
//! Tolerances (relative L2 unless stated): kernels that only reorder f32 sums
//! get 1e-5; kernels that write bf16 get 8e-3 (bf16 keeps 8 bits: a rounding
//! step is 2^-9 relative, ~4e-3 RMS over random data plus the f32 reordering).

mod support;

use lily_cpu::ops::conv::causal_conv1d_silu;
use lily_cpu::ops::norm::{gated_rmsnorm, rmsnorm1p};
use lily_cpu::ops::rope;
use lily_cuda::gpu::Arg;
use lily_cuda::sampling::{greedy_finish, greedy_lm_head};
use lily_model::tensor::Procedural;
use lily_model::DType;
use support::{
    bf16_bits, from_bf16_bits, gdn_cpu_reference, gpu, launch_gdn_recurrent, procedural_fill,
    random_mixed as random, round_bf16, GdnDims, GdnInputs,
};

/// [`support::rel_l2`], refusing an all-zero reference.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let e = support::rel_l2(a, b);
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    assert!(den > 0.0, "reference is all zeros");
    e
}

#[test]
fn add_rmsnorm() {
    let Some(g) = gpu() else { return };
    let (t, d) = (33, 2048);
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
    g.launch(
        "add_rmsnorm_kernel",
        (t as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(xb.ptr),
            Arg::Ptr(db.ptr),
            Arg::Ptr(wb.ptr),
            Arg::Ptr(ob.ptr),
            Arg::I32(d as i32),
            Arg::F32(1e-6),
        ],
    )
    .unwrap();
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    let want = rmsnorm1p(&sum, &w, 1e-6, DType::F32);
    assert!(
        rel_l2(&g.download::<f32>(xb.ptr, t * d).unwrap(), &sum) < 1e-7,
        "residual add"
    );
    let e = rel_l2(
        &from_bf16_bits(&g.download::<u16>(ob.ptr, t * d).unwrap()),
        &want,
    );
    assert!(e < 8e-3, "add_rmsnorm: {e}");
}

#[test]
fn gated_rmsnorm_kernel() {
    let Some(g) = gpu() else { return };
    let (t, hv, dv) = (17, 32, 128);
    let o = random(t * hv * dv, 4, 0.0, 1.0);
    let z = random(t * hv * dv, 5, 0.0, 2.0);
    let w = random(dv, 6, 1.0, 0.2);
    let (ob, zb, wb, out) = (
        g.upload_new(&o).unwrap(),
        g.upload_new(&z).unwrap(),
        g.upload_new(&w).unwrap(),
        g.alloc(t * hv * dv * 2).unwrap(),
    );
    g.launch(
        "gated_rmsnorm_kernel",
        ((t * hv) as u32, 1, 1),
        (dv as u32, 1, 1),
        0,
        &[
            Arg::Ptr(ob.ptr),
            Arg::Ptr(zb.ptr),
            Arg::Ptr(wb.ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(dv as i32),
            Arg::F32(1e-6),
        ],
    )
    .unwrap();
    let want = gated_rmsnorm(&o, &z, &w, 1e-6, DType::F32);
    let e = rel_l2(
        &from_bf16_bits(&g.download::<u16>(out.ptr, t * hv * dv).unwrap()),
        &want,
    );
    assert!(e < 8e-3, "gated_rmsnorm: {e}");
}

#[test]
fn causal_conv1d_silu_kernel() {
    let Some(g) = gpu() else { return };
    let (c, w) = (8192, 4);
    let taps = random(c * w, 7, 0.0, 0.5);
    let state0 = random(c * (w - 1), 8, 0.0, 1.0);
    let (tb, sb) = (g.upload_new(&taps).unwrap(), g.upload_new(&state0).unwrap());
    let mut cpu_state = state0.clone();
    // a prefill of 70 tokens, then one decode token, continuing the state
    for (step, t) in [(0u64, 70usize), (1, 1)] {
        let x = random(t * c, 9 + step, 0.0, 1.0);
        let (xb, ob) = (g.upload_new(&x).unwrap(), g.alloc(t * c * 4).unwrap());
        g.launch(
            "conv_silu_kernel",
            (c.div_ceil(128) as u32, 1, 1),
            (128, 1, 1),
            0,
            &[
                Arg::Ptr(xb.ptr),
                Arg::Ptr(sb.ptr),
                Arg::Ptr(tb.ptr),
                Arg::Ptr(ob.ptr),
                Arg::I32(t as i32),
                Arg::I32(c as i32),
                Arg::I32(w as i32),
            ],
        )
        .unwrap();
        let want = causal_conv1d_silu(&x, t, c, &taps, w, &mut cpu_state, DType::F32);
        let e = rel_l2(&g.download::<f32>(ob.ptr, t * c).unwrap(), &want);
        assert!(e < 1e-5, "conv T={t}: {e}");
        assert!(
            rel_l2(&g.download::<f32>(sb.ptr, c * (w - 1)).unwrap(), &cpu_state) < 1e-7,
            "conv state"
        );
    }
}

#[test]
fn gdn_recurrence_kernel() {
    let Some(g) = gpu() else { return };
    let (hk, hv, dk, dv) = (16usize, 32usize, 128usize, 128usize);
    let dims = GdnDims { hk, hv, dk, dv };
    let c = dims.conv_width();
    for t in [1usize, 100] {
        let x = GdnInputs {
            t,
            conv: random(t * c, 10 + t as u64, 0.0, 1.0),
            ba: random(t * 2 * hv, 11 + t as u64, 0.0, 1.0),
            a_log: random(hv, 12, 0.0, 0.7),
            dt_bias: random(hv, 13, -1.0, 0.5),
            s0: random(hv * dk * dv, 14, 0.0, 0.1),
        };
        let bufs: Vec<_> = [&x.conv, &x.ba, &x.a_log, &x.dt_bias, &x.s0]
            .iter()
            .map(|v| g.upload_new(v).unwrap())
            .collect();
        let ob = g.alloc(t * hv * dv * 4).unwrap();
        launch_gdn_recurrent(
            &g,
            dims,
            t,
            [
                bufs[0].ptr,
                bufs[1].ptr,
                bufs[2].ptr,
                bufs[3].ptr,
                bufs[4].ptr,
                ob.ptr,
            ],
        );
        // the CPU reference, with its inputs built as lily_cpu::ops::gdn::gdn builds them
        let (want, s) = gdn_cpu_reference(dims, &x);
        let e = rel_l2(&g.download::<f32>(ob.ptr, t * hv * dv).unwrap(), &want);
        let es = rel_l2(&g.download::<f32>(bufs[4].ptr, hv * dk * dv).unwrap(), &s);
        // f32 both sides; sums reordered over 128 terms, T steps deep
        assert!(e < 1e-4 && es < 1e-4, "gdn T={t}: output {e}, state {es}");
    }
}

/// q/k norms + RoPE + cache append, then attention over a long cache (decode
/// at 4096 and a causal prefill block), against an f64 softmax oracle.
#[test]
fn attention_prep_and_attention() {
    let Some(g) = gpu() else { return };
    let (hq, hkv, dh, rot, theta) = (16usize, 2usize, 256usize, 64usize, 1e7f64);
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
    g.launch(
        "qk_prep_kernel",
        (t as u32, (hq + hkv) as u32, 1),
        (dh as u32, 1, 1),
        0,
        &[
            Arg::Ptr(b[0].ptr),
            Arg::Ptr(b[1].ptr),
            Arg::Ptr(b[2].ptr),
            Arg::Ptr(b[3].ptr),
            Arg::Ptr(b[4].ptr),
            Arg::Ptr(pos.ptr),
            Arg::Ptr(qout.ptr),
            Arg::Ptr(kc.ptr),
            Arg::Ptr(vc.ptr),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::I32(rot as i32),
            Arg::F32(theta as f32),
            Arg::F32(1e-6),
            Arg::I32(1),
        ],
    )
    .unwrap();
    let scale = (dh as f32).powf(-0.5);
    g.launch(
        "attention_kernel",
        (t as u32, hq as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(qout.ptr),
            Arg::Ptr(kc.ptr),
            Arg::Ptr(vc.ptr),
            Arg::Ptr(b[0].ptr),
            Arg::Ptr(pos.ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(hq as i32),
            Arg::I32(hkv as i32),
            Arg::I32(dh as i32),
            Arg::F32(scale),
            Arg::I32(1),
        ],
    )
    .unwrap();
    // CPU: the same prep with the reference ops
    let mut q = vec![0f32; t * hq * dh];
    for i in 0..t * hq {
        q[i * dh..(i + 1) * dh].copy_from_slice(&qg[i * 2 * dh..i * 2 * dh + dh]);
    }
    let mut q = rmsnorm1p(&q, &qn, 1e-6, DType::F32);
    let mut kk = rmsnorm1p(&k, &kn, 1e-6, DType::F32);
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
    assert!(e < 1e-5, "q prep: {e}");
    let cache_k = from_bf16_bits(&g.download::<u16>(kc.ptr, (pos0 + t) * hkv * dh).unwrap());
    let cache_v = from_bf16_bits(&g.download::<u16>(vc.ptr, (pos0 + t) * hkv * dh).unwrap());
    let e = rel_l2(&cache_k[pos0 * hkv * dh..], &kk);
    assert!(e < 8e-3, "k prep into the cache: {e}");
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
    let e = rel_l2(
        &from_bf16_bits(&g.download::<u16>(out.ptr, t * hq * dh).unwrap()),
        &want,
    );
    assert!(e < 8e-3, "attention over {pos0}+ positions: {e}");
}

/// The routed experts and the shared expert (gate/up with SiLU, then down
/// with the routing weights and the residual add), against the CPU SwiGLU.
#[test]
fn moe_experts() {
    use lily_model::tensor::Tensor;
    use lily_model::weights::Ffn;
    use lily_model::Mat;
    use std::sync::Arc;
    let Some(g) = gpu() else { return };
    let (e, f, fs, d, k, t) = (256usize, 512usize, 512usize, 2048usize, 8usize, 3usize);
    let proc_ = |seed: u64, std: f32| Procedural {
        seed,
        mean: 0.0,
        std,
    };
    let (pgu, pdn, psgu, psdn) = (
        proc_(31, 0.022),
        proc_(32, 0.044),
        proc_(33, 0.022),
        proc_(34, 0.044),
    );
    let fill = |p: Procedural, n: usize| {
        let b = g.alloc(n * 2).unwrap();
        procedural_fill(&g, b.ptr, p, 0, n);
        b
    };
    let (gu, dn, sgu, sdn) = (
        fill(pgu, e * 2 * f * d),
        fill(pdn, e * d * f),
        fill(psgu, 2 * fs * d),
        fill(psdn, d * fs),
    );
    let x = round_bf16(&random(t * d, 35, 0.0, 1.0));
    let resid = random(t * d, 36, 0.0, 1.0);
    let idx: Vec<i32> = (0..t * k).map(|i| ((i * 37 + 11) % e) as i32).collect();
    let wts: Vec<f32> = random(t * (k + 1), 37, 0.5, 0.2);
    let (xb, ib, wb, rb, hb) = (
        g.upload_new(&bf16_bits(&x)).unwrap(),
        g.upload_new(&idx).unwrap(),
        g.upload_new(&wts).unwrap(),
        g.upload_new(&resid).unwrap(),
        g.alloc(t * (k + 1) * f.max(fs) * 2).unwrap(),
    );
    // gate/up for `tokens` rows of x, routed by idx, or (one token) by the
    // router's logits when `logits` is non-zero, publishing the routing into
    // the route slot `route` when that is non-zero
    let gate_up = |tokens: usize, idx: u64, logits: u64, route: u64| {
        g.launch(
            "moe_gate_up_kernel",
            (f.max(fs).div_ceil(8) as u32, (k + 1) as u32, tokens as u32),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(xb.ptr),
                Arg::Ptr(gu.ptr),
                Arg::Ptr(sgu.ptr),
                Arg::Ptr(idx),
                Arg::Ptr(hb.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(logits),
                Arg::I32(e as i32),
                Arg::Ptr(route),
                // the L2 prefetch ahead (no effect on the output): the shared down matrix
                Arg::Ptr(sdn.ptr),
                Arg::U64((d * fs * 2) as u64),
            ],
        )
        .unwrap()
    };
    gate_up(t, ib.ptr, 0, 0);
    g.launch(
        "moe_down_kernel",
        (d.div_ceil(8) as u32, t as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(hb.ptr),
            Arg::Ptr(dn.ptr),
            Arg::Ptr(sdn.ptr),
            Arg::Ptr(ib.ptr),
            Arg::Ptr(wb.ptr),
            Arg::Ptr(rb.ptr),
            Arg::I32(d as i32),
            Arg::I32(f as i32),
            Arg::I32(fs as i32),
            Arg::I32(k as i32),
        ],
    )
    .unwrap();
    let got: Vec<f32> = g.download(rb.ptr, t * d).unwrap();
    // CPU: the same weights through views of procedural tensors
    let mat = |p: Procedural, shape: Vec<usize>| Mat::whole(Arc::new(Tensor::procedural(shape, p)));
    let (mgu, mdn) = (mat(pgu, vec![e, 2 * f, d]), mat(pdn, vec![e, d, f]));
    let shared = {
        let s = mat(psgu, vec![2 * fs, d]);
        Ffn {
            gate: s.rows(0, fs),
            up: s.rows(fs, fs),
            down: mat(psdn, vec![d, fs]),
        }
    };
    // the expert in a slot: routed expert `ex`, or the shared one (None)
    let ffn_of = |ex: Option<usize>| match ex {
        None => shared.clone(),
        Some(ex) => Ffn {
            gate: mgu.rows(ex * 2 * f, f),
            up: mgu.rows(ex * 2 * f + f, f),
            down: mdn.rows(ex * d, d),
        },
    };
    let mut want = resid.clone();
    for ti in 0..t {
        let xr = &x[ti * d..(ti + 1) * d];
        for slot in 0..=k {
            let ex = (slot < k).then(|| idx[ti * k + slot] as usize);
            let y = lily_cpu::ops::moe::ffn_seq(xr, 1, &ffn_of(ex), DType::F32);
            for i in 0..d {
                want[ti * d + i] += wts[ti * (k + 1) + slot] * y[i];
            }
        }
    }
    let delta_got: Vec<f32> = got.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let delta_want: Vec<f32> = want.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let e2 = rel_l2(&delta_got, &delta_want);
    // the GPU rounds the SwiGLU activations to bf16 before the down product
    assert!(e2 < 8e-3, "moe experts: {e2}");

    // The decode form (one token): every block of both kernels routes from the
    // router's logits itself (softmax, top-8, renormalise, shared gate). The
    // logits are rounded to halves, so the top 8 hold exact ties, which must
    // go to the lower expert id as on the CPU.
    let logits: Vec<f32> = random(e + 1, 38, 0.0, 2.0)
        .iter()
        .map(|v| (v * 2.0).round() / 2.0)
        .collect();
    let (lb, r1, counter) = (
        g.upload_new(&logits).unwrap(),
        g.alloc(d * 4).unwrap(), // the residual, filled by each down1
        g.alloc(4).unwrap(),
    );
    g.zero(counter.ptr, 4).unwrap();
    // the down product of the decode form into a fresh copy of the residual;
    // with `route` non-zero it takes the routing from that slot when published
    let down1 = |route: u64| {
        g.upload(r1.ptr, &resid[..d]).unwrap();
        g.launch(
            "moe_down_norm_kernel",
            (d.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(hb.ptr),
                Arg::Ptr(dn.ptr),
                Arg::Ptr(sdn.ptr),
                Arg::Ptr(lb.ptr),
                Arg::I32(e as i32),
                Arg::Ptr(r1.ptr),
                Arg::I32(d as i32),
                Arg::I32(f as i32),
                Arg::I32(fs as i32),
                Arg::I32(k as i32),
                Arg::Ptr(0), // no norm: x += the experts' sum
                Arg::Ptr(0),
                Arg::F32(1e-6),
                Arg::Ptr(counter.ptr),
                Arg::Ptr(route),
            ],
        )
        .unwrap();
        g.download::<f32>(r1.ptr, d).unwrap()
    };
    gate_up(1, 0, lb.ptr, 0); // no idx: routing from the logits
    let got1 = down1(0);
    let route = lily_cpu::ops::moe::route(&logits[..e], k, DType::F32);
    let sg = 1.0 / (1.0 + (-logits[e]).exp());
    let mut want1 = vec![0f32; d];
    let slots = route
        .iter()
        .map(|&(ex, wt)| (Some(ex), wt))
        .chain([(None, sg)]);
    for (ex, wt) in slots {
        let y = lily_cpu::ops::moe::ffn_seq(&x[..d], 1, &ffn_of(ex), DType::F32);
        for i in 0..d {
            want1[i] += wt * y[i];
        }
    }
    let delta1: Vec<f32> = got1.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let e1 = rel_l2(&delta1, &want1);
    // a wrong expert (a tie broken the other way) would give an O(1) error
    assert!(e1 < 8e-3, "moe experts, decode form: {e1}");

    // The route slot (moe.cu RouteSlot, 128 bytes as u32 words: flag, pad,
    // idx [8] from word 2, wts [9] from word 10): gate/up's block (0, 1)
    // publishes the routing it computed; it must be the CPU's (ids in order,
    // weights), and the down product taking it must give the same sums as its
    // own top-K.
    let slot = g.alloc(128).unwrap();
    g.zero(slot.ptr, 128).unwrap();
    gate_up(1, 0, lb.ptr, slot.ptr);
    let words: Vec<u32> = g.download(slot.ptr, 32).unwrap();
    assert_eq!(words[0], 1, "route slot flag");
    for (i, &(ex, wt)) in route.iter().enumerate() {
        assert_eq!(words[2 + i] as usize, ex, "published expert {i}");
        let w = f32::from_bits(words[10 + i]);
        assert!((w - wt).abs() < 1e-6, "published weight {i}: {w} vs {wt}");
    }
    let w = f32::from_bits(words[10 + k]);
    assert!((w - sg).abs() < 1e-6, "published shared gate: {w} vs {sg}");
    // (the same top-K code in both kernels: equal up to the last bits)
    let close = |a: &[f32], what: &str| {
        let e = rel_l2(a, &got1);
        assert!(e < 1e-6, "{what}: {e}");
    };
    close(
        &down1(slot.ptr),
        "down product from the published routing vs its own top-K",
    );
    // an unpublished slot (flag 0): the down product falls back to its own top-K
    g.zero(slot.ptr, 8).unwrap();
    close(&down1(slot.ptr), "down product's fallback");
    // a published slot is obeyed: its weights doubled double the experts' sum
    let mut doubled = words.clone();
    for i in 0..=k {
        doubled[10 + i] = (2.0 * f32::from_bits(words[10 + i])).to_bits();
    }
    g.upload(slot.ptr, &doubled).unwrap();
    let got2 = down1(slot.ptr);
    let delta2: Vec<f32> = got2.iter().zip(&resid).map(|(a, b)| a - b).collect();
    let twice: Vec<f32> = delta1.iter().map(|v| 2.0 * v).collect();
    let e2 = rel_l2(&delta2, &twice);
    assert!(
        e2 < 1e-5,
        "down product with the slot's doubled weights: {e2}"
    );
}

/// The decode step's lm_head and greedy choice (`greedy_lm_head`: gemv_kernel
/// and argmax_blocks_kernel; `greedy_finish`: argmax_finish_kernel) against
/// the host: the logits against an f64
/// product of the same bf16 values (rel L2 1e-5: f32 sums reordered), the id
/// exactly the host argmax of the kernel's own logits over the ids below
/// `valid` (largest, lowest id on a tie, NaN never), the position advanced
/// and held at `max_pos`, and the running maximum cleared for the next step.
#[test]
fn greedy_lm_head_and_finish() {
    let Some(g) = gpu() else { return };
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
        greedy_lm_head(&g, wb.ptr, xb.ptr, y.ptr, n, k, valid_buf.ptr, best.ptr).unwrap();
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
        assert!(e < 1e-5, "round {round}: logits rel L2 {e:.3e}");
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
