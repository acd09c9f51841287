//! CUDA kernels and the CUDA forward against the CPU reference, at the
//! released sizes, on fresh random inputs. Without a GPU every test prints
//! that it skips and passes.
//!
//! Tolerances: the GPU feeds bf16 activations into its matrix products and
//! keeps the residual stream in f32; the CPU oracle here keeps everything in
//! f32 (`with_f32_activations`). Single products then differ by bf16 input
//! rounding (relative L2 ~3e-3); whole-model logits by the accumulation of
//! that over the layers.

mod support;

use lily_cpu::ops::linear::linear;
use lily_cpu::{CpuModel, Logits};
use lily_cuda::gpu::Arg;
use lily_cuda::{CudaModel, CudaOptions};
use lily_model::tensor::{Procedural, Tensor};
use lily_model::{Mat, ModelSource};
use std::sync::Arc;
use support::{bf16_bits, from_bf16_bits, gpu, procedural_fill, random, rel_l2, round_bf16};

fn procedural_mat(rows: usize, cols: usize, seed: u64, std: f32) -> Mat {
    Mat::whole(Arc::new(Tensor::procedural(
        vec![rows, cols],
        Procedural {
            seed,
            mean: 0.01,
            std,
        },
    )))
}

#[test]
fn procedural_weights_are_bit_identical_to_the_cpu() {
    let Some(g) = gpu() else { return };
    let m = procedural_mat(1000, 4096, 0xABCDEF, 0.02);
    let buf = g.alloc(1000 * 4096 * 2).unwrap();
    let (start, n) = (4096 * 17, 4096 * 900);
    let proc_ = match &m.t.storage {
        lily_model::tensor::Storage::Procedural(p) => *p,
        _ => unreachable!(),
    };
    procedural_fill(&g, buf.ptr, proc_, start, n);
    let got: Vec<u16> = g.download(buf.ptr, n).unwrap();
    let mut want = vec![0f32; n];
    m.t.read_f32(start, &mut want);
    let mismatches = got
        .iter()
        .zip(bf16_bits(&want))
        .filter(|(a, b)| **a != *b)
        .count();
    assert_eq!(
        mismatches, 0,
        "GPU generator differs from the CPU on {mismatches} of {n} values"
    );
}

#[test]
fn gemv_and_gemm_match_the_cpu() {
    let Some(g) = gpu() else { return };
    for (n, k) in [
        (8192usize, 2048usize),
        (2048, 4096),
        (248_320, 2048),
        (2048, 512),
        (257, 2048),
    ] {
        let w = procedural_mat(n, k, n as u64 * 31 + k as u64, 1.0 / (k as f32).sqrt());
        let wbuf = g.alloc(n * k * 2).unwrap();
        let p = match &w.t.storage {
            lily_model::tensor::Storage::Procedural(p) => *p,
            _ => unreachable!(),
        };
        procedural_fill(&g, wbuf.ptr, p, 0, n * k);
        for t in [1usize, 37] {
            // inputs rounded to bf16 first, so the oracle sees what the GPU sees
            let x = round_bf16(&random(t * k, 7 + t as u64, 0.0, 1.0));
            let xbuf = g.upload_new(&bf16_bits(&x)).unwrap();
            let ybuf = g.alloc(t * n * 4).unwrap();
            if t == 1 {
                g.launch(
                    "gemv_kernel",
                    (n.div_ceil(8) as u32, 1, 1),
                    (256, 1, 1),
                    0,
                    &[
                        Arg::Ptr(wbuf.ptr),
                        Arg::Ptr(xbuf.ptr),
                        Arg::Ptr(ybuf.ptr),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                    ],
                )
                .unwrap();
            } else {
                g.gemm_bf16_f32(xbuf.ptr, wbuf.ptr, ybuf.ptr, t, n, k)
                    .unwrap();
            }
            let got: Vec<f32> = g.download(ybuf.ptr, t * n).unwrap();
            let want = linear(&x, t, &w);
            let e = rel_l2(&got, &want);
            // same bf16 inputs, f32 accumulation in another order: ~1e-6
            assert!(e < 1e-4, "linear {t}x{n}x{k}: relative L2 {e}");
        }
    }
}

#[test]
fn router_topk_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (t, e, k) = (300usize, 256usize, 8usize);
    // Ties, broken toward the lower expert id as the CPU's stable sort does:
    // tokens 1 mod 3 round the logits to integers (a few ties in the top 8),
    // 2 mod 3 to multiples of 4 (dozens tie at the top, more candidates than a
    // warp has lanes), token 4 is all zeros (all 256 tie).
    let logits: Vec<f32> = random(t * (e + 1), 99, 0.0, 3.0)
        .iter()
        .enumerate()
        .map(|(i, v)| match (i / (e + 1), i % (e + 1) == e) {
            (4, false) => 0.0,
            (ti, _) if ti % 3 == 1 => v.round(),
            (ti, _) if ti % 3 == 2 => (v / 4.0).round() * 4.0,
            _ => *v,
        })
        .collect();
    let lb = g.upload_new(&logits).unwrap();
    let idx = g.alloc(t * k * 4).unwrap();
    let wts = g.alloc(t * (k + 1) * 4).unwrap();
    g.launch(
        "router_topk_kernel",
        (t.div_ceil(8) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(lb.ptr),
            Arg::I32(t as i32),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
            Arg::Ptr(idx.ptr),
            Arg::Ptr(wts.ptr),
        ],
    )
    .unwrap();
    let gi: Vec<i32> = g.download(idx.ptr, t * k).unwrap();
    let gw: Vec<f32> = g.download(wts.ptr, t * (k + 1)).unwrap();
    for ti in 0..t {
        let want = lily_cpu::ops::moe::route(
            &logits[ti * (e + 1)..ti * (e + 1) + e],
            k,
            lily_model::DType::F32,
        );
        for (s, (ex, w)) in want.iter().enumerate() {
            assert_eq!(gi[ti * k + s] as usize, *ex, "token {ti} slot {s}");
            assert!(
                (gw[ti * (k + 1) + s] - w).abs() < 1e-5,
                "token {ti} slot {s}: {} vs {w}",
                gw[ti * (k + 1) + s]
            );
        }
        let sg = 1.0 / (1.0 + (-logits[ti * (e + 1) + e]).exp());
        assert!((gw[ti * (k + 1) + k] - sg).abs() < 1e-6);
    }
}

/// The released geometry, 4 layers (3 GDN + 1 attention): every kernel at its
/// real shapes. Prefill of a prompt longer than a GDN chunk, then decode.
#[test]
fn full4_forward_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (cfg, w) = ModelSource::Synthetic("full4".into())
        .load_procedural()
        .unwrap();
    let v = cfg.vocab_size;
    let toks: Vec<u32> = (0..150u64)
        .map(|i| ((i * 2_654_435_761 + 977) % 248_077) as u32)
        .collect();
    let n = 140;
    let cpu = CpuModel::new(cfg.clone(), w.clone()).with_f32_activations();
    let mut cs = cpu.new_state();
    let mut want = cpu.prefill(&toks[..n], &mut cs, Logits::All).unwrap();
    for &t in &toks[n..] {
        want.extend(cpu.decode(t, &mut cs).unwrap());
    }
    let opts = CudaOptions {
        max_seq: 4096,
        prefill_chunk: 64, // several prefill chunks
        graphs: true,
        ..CudaOptions::default()
    };
    let mut m = CudaModel::load(g, cfg, &w, opts, false).unwrap();
    let mut st = m.new_state().unwrap();
    let mut got = m.forward(&mut st, &toks[..n], true).unwrap();
    for &t in &toks[n..] {
        got.extend(m.forward(&mut st, &[t], true).unwrap());
    }
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|x| x.is_finite()));
    let e = rel_l2(&got, &want);
    let agree = (0..toks.len())
        .filter(|&i| {
            lily_engine_argmax(&got[i * v..(i + 1) * v])
                == lily_engine_argmax(&want[i * v..(i + 1) * v])
        })
        .count();
    eprintln!(
        "full4: logits relative L2 {e:.3e}, top-1 {agree}/{}",
        toks.len()
    );
    // bf16 activations into every product vs an all-f32 oracle, 4 layers deep
    assert!(e < 3e-2, "logits relative L2 {e}");
    assert!(
        agree as f64 >= 0.95 * toks.len() as f64,
        "top-1 agreement {agree}/{}",
        toks.len()
    );
    // the greedy on-device path agrees with the logits path
    let mut st2 = m.new_state().unwrap();
    let first = m.prefill_greedy(&mut st2, &toks[..n]).unwrap();
    assert_eq!(first as usize, lily_engine_argmax(&got[(n - 1) * v..n * v]));
    // decode replayed from the captured graph is the same computation as
    // decode launched kernel by kernel: bit for bit
    let decode_eager = |m: &CudaModel| {
        let mut st = m.new_state().unwrap();
        m.forward(&mut st, &toks[..n], false).unwrap();
        let mut out = Vec::new();
        for &t in &toks[n..] {
            out.extend(m.forward(&mut st, &[t], true).unwrap());
        }
        out
    };
    m.opts.graphs = false;
    let eager = decode_eager(&m);
    assert!(
        eager == got[n * v..],
        "decode logits differ between the CUDA graph and direct launches"
    );
    // the GDN output projection started on the core's count (LILY_GDN_SIGNAL=1)
    // or on its completion (the default): the same arithmetic, bit for bit
    m.opts.gdn_signal = !m.opts.gdn_signal;
    assert!(
        decode_eager(&m) == eager,
        "decode logits differ between the GDN output projection on the core's count and on its completion"
    );
}

/// The pipelined greedy decode (each step queued before the previous choice
/// reaches the host) chooses exactly what single greedy steps choose; two
/// states decoded in turn each feed their own choice (the model's `s.next`
/// is shared); an early stop leaves the state one step further, its pending
/// choice that step's, and the position held on the device agrees with the
/// host's after every kind of step.
#[test]
fn greedy_pipeline_matches_single_steps() {
    let Some(g) = gpu() else { return };
    let (cfg, w) = ModelSource::Synthetic("full4".into())
        .load_procedural()
        .unwrap();
    let opts = CudaOptions {
        max_seq: 256,
        ..CudaOptions::default()
    };
    let m = CudaModel::load(g, cfg, &w, opts, false).unwrap();
    let prompt: Vec<u32> = (0..40u64)
        .map(|i| ((i * 2_654_435_761 + 131) % 248_077) as u32)
        .collect();
    let steps = 24;
    // reference: one step at a time, states A and B interleaved
    let (mut a, mut b) = (m.new_state().unwrap(), m.new_state().unwrap());
    let mut want = vec![m.prefill_greedy(&mut a, &prompt).unwrap()];
    let b0 = m.prefill_greedy(&mut b, &prompt[..20]).unwrap();
    let mut want_b = vec![b0];
    for _ in 0..steps {
        want.push(m.decode_greedy(&mut a).unwrap());
        want_b.push(m.decode_greedy(&mut b).unwrap());
    }
    assert!(
        want.windows(2).any(|p| p[0] != p[1]),
        "a constant sequence tests little: {want:?}"
    );
    // greedy steps pick through the screened lm_head (its int8 copy) unless
    // LILY_HEAD_SCREEN=0: the same ids as the full product's logits' argmax
    if std::env::var("LILY_HEAD_SCREEN").as_deref() != Ok("0") {
        assert!(
            m.head_screened(),
            "full4 should hold the lm_head's int8 copy"
        );
    }
    let mut e = m.new_state().unwrap();
    assert_eq!(m.prefill_greedy(&mut e, &prompt).unwrap(), want[0]);
    for (i, &t) in want[..steps].iter().enumerate() {
        let logits = m.forward(&mut e, &[t], false).unwrap();
        assert_eq!(
            lily_engine_argmax(&logits) as u32,
            want[i + 1],
            "step {i}: the greedy step against the full logits' argmax"
        );
    }
    // the pipeline over the whole run
    let mut c = m.new_state().unwrap();
    assert_eq!(m.prefill_greedy(&mut c, &prompt).unwrap(), want[0]);
    let mut got = vec![want[0]];
    let seen = m
        .decode_greedy_run(&mut c, steps, m.cfg.vocab_size, &mut |t| {
            got.push(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!(seen, steps);
    assert_eq!(got, want, "pipelined greedy differs from single steps");
    assert_eq!(c.pos, prompt.len() + steps);
    // B again, after C wrote the shared s.next: B feeds its own last choice
    let next_b = m.decode_greedy(&mut b).unwrap();
    let mut b2 = m.new_state().unwrap();
    assert_eq!(m.prefill_greedy(&mut b2, &prompt[..20]).unwrap(), want_b[0]);
    let mut last = 0;
    for _ in 0..=steps {
        last = m.decode_greedy(&mut b2).unwrap();
    }
    assert_eq!(next_b, last, "state B fed another state's choice");
    // an early stop after 5 choices: the step queued ahead has fed the 5th
    let mut d = m.new_state().unwrap();
    m.prefill_greedy(&mut d, &prompt).unwrap();
    let mut first = Vec::new();
    let seen = m
        .decode_greedy_run(&mut d, steps, m.cfg.vocab_size, &mut |t| {
            first.push(t);
            Ok(first.len() < 5)
        })
        .unwrap();
    assert_eq!(seen, 5);
    assert_eq!(first, want[1..6]);
    assert_eq!(d.pos, prompt.len() + 6, "one step queued ahead of the stop");
    // the pending choice is that extra step's: the next step yields want[7]
    assert_eq!(m.decode_greedy(&mut d).unwrap(), want[7]);
    // and a run resumed after a single step continues the same sequence
    let mut more = Vec::new();
    m.decode_greedy_run(&mut d, 3, m.cfg.vocab_size, &mut |t| {
        more.push(t);
        Ok(true)
    })
    .unwrap();
    assert_eq!(more, want[8..11]);
    assert_eq!(d.pos, prompt.len() + 10);
}

fn lily_engine_argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

#[test]
fn refuses_geometries_the_kernels_do_not_cover() {
    let Some(g) = gpu() else { return };
    let (cfg, w) = ModelSource::Synthetic("tiny".into())
        .load_procedural()
        .unwrap();
    let err = CudaModel::load(g, cfg, &w, CudaOptions::default(), false)
        .err()
        .expect("tiny has Dk 32");
    assert!(
        format!("{err:#}").contains("linear_key_head_dim"),
        "{err:#}"
    );
}

/// The decode router's matrix-vector product against the CPU's linear, three
/// calls with new inputs; call 1 in the decode form (the kernel norms the f32
/// residual stream itself and hands the normed input on in xn). The top-K is
/// run by the expert kernels (ops_gpu's moe_experts, decode form).
#[test]
fn router_decode_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (d, e) = (2048usize, 256usize);
    let logits = g.alloc((e + 1) * 4).unwrap();
    let xn = g.alloc(d * 2).unwrap();
    for call in 0..3u64 {
        let normed = call == 1;
        let w = procedural_mat(e + 1, d, 500 + call, 4.0 / (d as f32).sqrt());
        let wbits = bf16_bits(&w.t.to_f32_vec());
        let (eps, xf, w1p) = (
            1e-6f32,
            random(d, 600 + call, 0.2, 1.5),
            random(d, 610 + call, 1.0, 0.2),
        );
        let x = if normed {
            normed_input(&xf, &w1p, eps)
        } else {
            round_bf16(&xf)
        };
        let wb = g.upload_new(&wbits).unwrap();
        let xb = g.upload_new(&bf16_bits(&x)).unwrap();
        let (xfb, wpb) = (g.upload_new(&xf).unwrap(), g.upload_new(&w1p).unwrap());
        g.launch(
            "router_decode_kernel",
            ((e + 1).div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(wb.ptr),
                Arg::Ptr(xb.ptr),
                Arg::Ptr(logits.ptr),
                Arg::I32(d as i32),
                Arg::I32(e as i32),
                Arg::Ptr(xfb.ptr),
                Arg::Ptr(if normed { wpb.ptr } else { 0 }), // 0: input x as given
                Arg::F32(eps),
                Arg::Ptr(xn.ptr),
            ],
        )
        .unwrap();
        // xn: the kernel's input as the gate/up products get it; the norm in
        // f32 may round an element to the neighbouring bf16
        let got_x = from_bf16_bits(&g.download::<u16>(xn.ptr, d).unwrap());
        let ex = rel_l2(&got_x, &x);
        assert!(
            ex < if normed { 4e-3 } else { 1e-7 },
            "call {call}: xn relative L2 {ex}"
        );
        // the logits of the kernel's own input: f32 sums in another order, ~1e-6
        let got: Vec<f32> = g.download(logits.ptr, e + 1).unwrap();
        let el = rel_l2(&got, &linear(&got_x, 1, &w));
        assert!(el < 1e-4, "call {call}: logits relative L2 {el}");
    }
}

/// The decode kernels' normed input, bf16(rmsnorm(xf) * w1p), in f64.
fn normed_input(xf: &[f32], w1p: &[f32], eps: f32) -> Vec<f32> {
    let ms = xf.iter().map(|v| (v * v) as f64).sum::<f64>() / xf.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    round_bf16(
        &xf.iter()
            .zip(w1p)
            .map(|(v, w)| (*v as f64 * inv * *w as f64) as f32)
            .collect::<Vec<_>>(),
    )
}

/// Three projections of one input in one launch (gemv3_kernel) against the
/// CPU's three linears, at the GDN input sizes (8192, 4096 and 64 rows): once
/// on a bf16 input, once on the RMSNorm of an f32 residual stream that each
/// block computes itself (the decode path).
#[test]
fn gemv3_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (k, eps) = (2048usize, 1e-6f32);
    let ns = [8192usize, 4096, 64];
    let ws: Vec<Mat> = ns
        .iter()
        .enumerate()
        .map(|(i, &n)| procedural_mat(n, k, 710 + i as u64, 1.0 / (k as f32).sqrt()))
        .collect();
    let wbs: Vec<_> = ws
        .iter()
        .map(|w| g.upload_new(&bf16_bits(&w.t.to_f32_vec())).unwrap())
        .collect();
    let ys: Vec<_> = ns.iter().map(|n| g.alloc(n * 4).unwrap()).collect();
    for normed in [false, true] {
        let xf = random(k, 700, 0.3, 2.0);
        let w1p: Vec<f32> = random(k, 701, 1.0, 0.2);
        // the CPU's input: bf16 x, or bf16(norm(xf) * w1p)
        let x = if normed {
            normed_input(&xf, &w1p, eps)
        } else {
            round_bf16(&xf)
        };
        let xb = g.upload_new(&bf16_bits(&x)).unwrap();
        let xfb = g.upload_new(&xf).unwrap();
        let wpb = g.upload_new(&w1p).unwrap();
        let mut args = vec![
            Arg::Ptr(if normed { 0 } else { xb.ptr }),
            Arg::I32(k as i32),
        ];
        for i in 0..3 {
            args.extend([
                Arg::Ptr(wbs[i].ptr),
                Arg::Ptr(ys[i].ptr),
                Arg::I32(ns[i] as i32),
            ]);
        }
        // a decode layer's first kernel also zeroes the layer's flags (the
        // MoE route slot, the GDN core's count; block 0, after its wait): 30
        // of 32 words of ones here
        let slot = g.upload_new(&[u64::MAX; 32]).unwrap();
        args.extend([
            Arg::Ptr(xfb.ptr),
            Arg::Ptr(if normed { wpb.ptr } else { 0 }),
            Arg::F32(eps),
            Arg::Ptr(if normed { slot.ptr } else { 0 }),
            Arg::I32(30),
        ]);
        let rows: usize = ns.iter().sum();
        g.launch(
            "gemv3_kernel",
            (rows.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            0,
            &args,
        )
        .unwrap();
        let words: Vec<u64> = g.download(slot.ptr, 32).unwrap();
        let cleared: Vec<u64> = (0..32)
            .map(|i| if normed && i < 30 { 0 } else { u64::MAX })
            .collect();
        assert_eq!(words, cleared, "route slot clear (normed: {normed})");
        for i in 0..3 {
            let got: Vec<f32> = g.download(ys[i].ptr, ns[i]).unwrap();
            let want = linear(&x, 1, &ws[i]);
            let e = rel_l2(&got, &want);
            // same bf16 inputs, f32 accumulation in another order: ~1e-6; the
            // normed input may round an element to the neighbouring bf16
            // (f32 vs f64 norm): ~1e-3
            let tol = if normed { 4e-3 } else { 1e-4 };
            assert!(
                e < tol,
                "normed {normed}, projection {i} ({} rows): relative L2 {e}",
                ns[i]
            );
        }
    }
}

/// The decode output projection with the residual add and the RMSNorm fused
/// into its last block (gemv_add_norm_kernel) against the CPU's linear, add
/// and norm; three calls in a row, so the block counter must reset itself.
#[test]
fn gemv_add_norm_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    let (d, k, eps) = (2048usize, 4096usize, 1e-6f32);
    let counter = g.alloc(4).unwrap();
    g.zero(counter.ptr, 4).unwrap();
    let delta = g.alloc(d * 4).unwrap();
    for call in 0..3u64 {
        let w = procedural_mat(d, k, 800 + call, 1.0 / (k as f32).sqrt());
        let h = round_bf16(&random(k, 810 + call, 0.0, 1.0));
        let x0 = random(d, 820 + call, 0.0, 1.0);
        let w1p: Vec<f32> = random(d, 830 + call, 0.0, 0.1)
            .iter()
            .map(|v| 1.0 + v)
            .collect();
        let wb = g.upload_new(&bf16_bits(&w.t.to_f32_vec())).unwrap();
        let hb = g.upload_new(&bf16_bits(&h)).unwrap();
        let xb = g.upload_new(&x0).unwrap();
        let nb = g.upload_new(&w1p).unwrap();
        // (w1p, out, counter): the fused norm, or none (w1p = 0); (ready,
        // nready): the early signal of h's producer (input_wait), or none
        let launch_ready = |w1p: u64, out: u64, counter: u64, ready: u64, nready: u32| {
            g.launch(
                "gemv_add_norm_kernel",
                (d.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(wb.ptr),
                    Arg::Ptr(hb.ptr),
                    Arg::Ptr(delta.ptr),
                    Arg::I32(d as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(xb.ptr),
                    Arg::Ptr(w1p),
                    Arg::Ptr(out),
                    Arg::F32(eps),
                    Arg::Ptr(counter),
                    Arg::Ptr(ready),
                    Arg::I32(nready as i32),
                ],
            )
            .unwrap()
        };
        let launch = |w1p: u64, out: u64, counter: u64| launch_ready(w1p, out, counter, 0, 0);
        // the output overwrites the input, as in the model
        launch(nb.ptr, hb.ptr, counter.ptr);
        let got_x: Vec<f32> = g.download(xb.ptr, d).unwrap();
        let got_out: Vec<u16> = g.download(hb.ptr, d).unwrap();
        let c: Vec<u32> = g.download(counter.ptr, 1).unwrap();
        assert_eq!(c[0], 0, "call {call}: the block counter did not reset");
        let dl = linear(&h, 1, &w);
        let want_x: Vec<f32> = x0.iter().zip(&dl).map(|(a, b)| a + b).collect();
        let ms = want_x.iter().map(|v| (v * v) as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        let want_out: Vec<f32> = want_x
            .iter()
            .zip(&w1p)
            .map(|(v, w)| (*v as f64 * inv * *w as f64) as f32)
            .collect();
        let got_out = from_bf16_bits(&got_out);
        // x: f32 sums in another order (~1e-6); out: bf16 rounding of the
        // result (relative L2 ~1e-3, at most 2^-8 per element)
        let ex = rel_l2(&got_x, &want_x);
        let eo = rel_l2(&got_out, &want_out);
        assert!(ex < 1e-5, "call {call}: residual relative L2 {ex}");
        assert!(eo < 4e-3, "call {call}: normed output relative L2 {eo}");
        // the decode form: no norm, each warp adds its row into x (x += W h)
        g.upload(xb.ptr, &x0).unwrap();
        let h2 = round_bf16(&random(k, 840 + call, 0.0, 1.0));
        g.upload(hb.ptr, &bf16_bits(&h2)).unwrap();
        launch(0, 0, 0);
        let got_x: Vec<f32> = g.download(xb.ptr, d).unwrap();
        let want_x: Vec<f32> = x0
            .iter()
            .zip(&linear(&h2, 1, &w))
            .map(|(a, b)| a + b)
            .collect();
        let ex = rel_l2(&got_x, &want_x);
        assert!(
            ex < 1e-5,
            "call {call}: residual (no norm) relative L2 {ex}"
        );
        // the same with h's early signal: the count reached (the path the
        // GDN core's output projection takes), and never reached (the
        // fallback to the PDL wait after the polls); neither changes a bit.
        // (No producer runs here: this checks the path's arithmetic and that
        // the fallback ends; full4_forward_matches_the_cpu checks the
        // signalled decode against the waiting one.)
        let ready = g.upload_new(&[128u32]).unwrap();
        for (count, what) in [(128u32, "reached"), (127, "not reached")] {
            g.upload(ready.ptr, &[count]).unwrap();
            g.upload(xb.ptr, &x0).unwrap();
            launch_ready(0, 0, 0, ready.ptr, 128);
            let again: Vec<f32> = g.download(xb.ptr, d).unwrap();
            assert!(
                again
                    .iter()
                    .zip(&got_x)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "call {call}: early signal {what}: the residual differs"
            );
        }
    }
}
