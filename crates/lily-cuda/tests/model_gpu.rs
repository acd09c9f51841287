//! CUDA kernels and the CUDA forward against the CPU reference, at the
//! released sizes, on fresh random inputs. Every kernel is launched through
//! its typed launcher in `lily_cuda::kernels` (the one the model calls).
//! Every test here needs a GPU: it is ignored without one, never passed.
//!
//! Tolerances: the GPU feeds bf16 activations into its matrix products and
//! keeps the residual stream in f32; the CPU oracle here keeps everything in
//! f32 (`with_f32_activations`). Single products then differ by bf16 input
//! rounding (relative L2 ~3e-3); whole-model logits by the accumulation of
//! that over the layers.

mod support;

use lily_cpu::ops::linear::linear;
use lily_cpu::ops::norm::rmsnorm1p;
use lily_cpu::{CpuModel, Logits};
use lily_cuda::gpu::DevMat;
use lily_cuda::kernels::embed::procedural_fill;
use lily_cuda::kernels::gemv::{gemv, gemv3, gemv_add, Normed, Projection};
use lily_cuda::kernels::moe::{router_decode, router_topk};
use lily_cuda::weights::upload_mat;
use lily_cuda::{CudaModel, CudaOptions, CudaState, GreedyHead};
use lily_model::quant::quantize_fp8_block;
use lily_model::sampling::argmax;
use lily_model::tensor::{Procedural, Storage, Tensor};
use lily_model::{DType, Mat, ModelSource};
use std::sync::Arc;
use support::{bf16_bits, from_bf16_bits, gpu, random, rel_l2, round_bf16};

/// A matrix product of bf16 inputs against the CPU's on the same (bf16-rounded)
/// inputs: f32 accumulation in another order, ~1e-6.
const PRODUCT_TOL: f64 = 1e-4;
/// A normed input the kernel computes itself (bf16(rmsnorm(x) * (1 + w))):
/// its f32 norm, summed in another order than the CPU's, may round an element
/// to the neighbouring bf16 (relative L2 ~1e-3).
const NORMED_INPUT_TOL: f64 = 4e-3;
/// The residual add x + W h in f32: the product's f32 sums in another order, ~1e-6.
const RESIDUAL_TOL: f64 = 1e-5;
/// A router weight (softmax over the top-K, renormalised) in f32: absolute.
const ROUTE_WEIGHT_TOL: f32 = 1e-5;
/// The shared expert's gate, sigmoid of one logit in f32: absolute.
const SHARED_GATE_TOL: f32 = 1e-6;
/// full4's logits: bf16 activations into every product vs an all-f32 oracle,
/// 4 layers deep (relative L2).
const FULL4_LOGITS_TOL: f64 = 3e-2;
/// full4's top-1 agreement with the all-f32 oracle: near ties of random
/// weights may flip under bf16 activations, a few percent at most.
const FULL4_TOP1_AGREEMENT: f64 = 0.95;

fn procedural(seed: u64, std: f32) -> Procedural {
    Procedural {
        seed,
        mean: 0.01,
        std,
    }
}

fn procedural_mat(rows: usize, cols: usize, seed: u64, std: f32) -> Mat {
    Mat::whole(Arc::new(Tensor::procedural(
        vec![rows, cols],
        procedural(seed, std),
    )))
}

/// The generator of a procedural matrix.
fn generator(m: &Mat) -> Procedural {
    match &m.t.storage {
        Storage::Procedural(p) | Storage::ProceduralRows(p) => *p,
        Storage::Bytes { .. } | Storage::Quantized(_) => unreachable!("a procedural matrix"),
    }
}

/// The GPU's generator of synthetic weights (`procedural_fill`, both forms:
/// plain and row-scaled) against the CPU's (`Tensor::read_f32`): the same
/// bf16 bits, over a range that starts and ends inside a row.
#[test]
#[ignore = "needs a CUDA GPU"]
fn procedural_weights_are_bit_identical_to_the_cpu() {
    let g = gpu();
    let (rows, cols) = (1000usize, 4096usize);
    let buf = g.alloc(rows * cols * 2).unwrap();
    let (start, n) = (cols * 17 + 5, cols * 900 + 3);
    let p = procedural(0xABCDEF, 0.02);
    for (t, rows_of) in [
        (Tensor::procedural(vec![rows, cols], p), None),
        (Tensor::procedural_rows(vec![rows, cols], p), Some(cols)),
    ] {
        procedural_fill(&g, buf.ptr, p, start, n, rows_of).unwrap();
        let got: Vec<u16> = g.download(buf.ptr, n).unwrap();
        let mut want = vec![0f32; n];
        t.read_f32(start, &mut want);
        let mismatches = got
            .iter()
            .zip(bf16_bits(&want))
            .filter(|(a, b)| **a != *b)
            .count();
        assert_eq!(
            mismatches, 0,
            "GPU generator (rows of {rows_of:?}) differs from the CPU on {mismatches} of {n} values"
        );
    }
}

/// One token's linear layer (`gemv`) and a prompt's (cuBLAS) against the
/// CPU's linear, at the released model's product shapes and an odd row count.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_and_gemm_match_the_cpu() {
    let g = gpu();
    for (n, k) in [
        (8192usize, 2048usize),
        (2048, 4096),
        (248_320, 2048),
        (2048, 512),
        (257, 2048),
    ] {
        let w = procedural_mat(n, k, n as u64 * 31 + k as u64, 1.0 / (k as f32).sqrt());
        let wbuf = g.alloc(n * k * 2).unwrap();
        procedural_fill(&g, wbuf.ptr, generator(&w), 0, n * k, None).unwrap();
        for t in [1usize, 37] {
            // inputs rounded to bf16 first, so the oracle sees what the GPU sees
            let x = round_bf16(&random(t * k, 7 + t as u64, 0.0, 1.0));
            let xbuf = g.upload_new(&bf16_bits(&x)).unwrap();
            let ybuf = g.alloc(t * n * 4).unwrap();
            if t == 1 {
                gemv(&g, &wbuf, xbuf.ptr, ybuf.ptr, n, k).unwrap();
            } else {
                g.gemm_bf16_f32(xbuf.ptr, wbuf.ptr, ybuf.ptr, t, n, k)
                    .unwrap();
            }
            let got: Vec<f32> = g.download(ybuf.ptr, t * n).unwrap();
            let want = linear(&x, t, &w);
            let e = rel_l2(&got, &want);
            assert!(e < PRODUCT_TOL, "linear {t}x{n}x{k}: relative L2 {e}");
        }
    }
}

/// Prefill's top-K routing (`router_topk`) against the CPU's `route`: the
/// same experts in the same order, the same weights, the shared gate.
#[test]
#[ignore = "needs a CUDA GPU"]
fn router_topk_matches_the_cpu() {
    let g = gpu();
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
    router_topk(&g, lb.ptr, t, e, k, idx.ptr, wts.ptr).unwrap();
    let gi: Vec<i32> = g.download(idx.ptr, t * k).unwrap();
    let gw: Vec<f32> = g.download(wts.ptr, t * (k + 1)).unwrap();
    for ti in 0..t {
        let want =
            lily_cpu::ops::moe::route(&logits[ti * (e + 1)..ti * (e + 1) + e], k, DType::F32);
        assert_eq!(want.len(), k);
        for (s, (ex, w)) in want.iter().enumerate() {
            assert_eq!(gi[ti * k + s] as usize, *ex, "token {ti} slot {s}");
            assert!(
                (gw[ti * (k + 1) + s] - w).abs() < ROUTE_WEIGHT_TOL,
                "token {ti} slot {s}: {} vs {w}",
                gw[ti * (k + 1) + s]
            );
        }
        let sg = 1.0 / (1.0 + (-logits[ti * (e + 1) + e]).exp());
        assert!(
            (gw[ti * (k + 1) + k] - sg).abs() < SHARED_GATE_TOL,
            "token {ti}: shared gate {} vs {sg}",
            gw[ti * (k + 1) + k]
        );
    }
}

/// The released geometry, 4 layers (3 GDN + 1 attention): every kernel at its
/// real shapes. Prefill of a prompt longer than a GDN chunk, then decode,
/// against the all-f32 CPU oracle; the on-device greedy choice against the
/// logits; decode from the captured graph against direct launches.
#[test]
#[ignore = "needs a CUDA GPU"]
fn full4_forward_matches_the_cpu() {
    full4_forward(false);
}

/// `full4_forward_matches_the_cpu` with the weights quantized to block FP8
/// as Qwen's FP8 releases are (`Weights::quantize_fp8`: the mixers'
/// projections and every expert): decode reads the codes exactly, prefill
/// rounds each dequantized weight to bf16, both within the bf16 tolerances
/// of the CPU on the same quantized weights.
#[test]
#[ignore = "needs a CUDA GPU"]
fn full4_fp8_forward_matches_the_cpu() {
    full4_forward(true);
}

fn full4_forward(fp8: bool) {
    // (`gpu()`: Gpu::new(0, &GpuOptions::default()), the product's setting)
    let g = gpu();
    let (cfg, w) = ModelSource::Synthetic("full4".into())
        .load_procedural()
        .unwrap();
    let w = if fp8 { w.quantize_fp8().unwrap() } else { w };
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
        greedy_head: GreedyHead::Screen,
        graphs: true,
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
        .filter(|&i| argmax(&got[i * v..(i + 1) * v]) == argmax(&want[i * v..(i + 1) * v]))
        .count();
    eprintln!(
        "full4 (fp8 {fp8}): logits relative L2 {e:.3e}, top-1 {agree}/{}",
        toks.len()
    );
    assert!(e < FULL4_LOGITS_TOL, "logits relative L2 {e}");
    assert!(
        agree as f64 >= FULL4_TOP1_AGREEMENT * toks.len() as f64,
        "top-1 agreement {agree}/{}",
        toks.len()
    );
    // the greedy on-device path agrees with the logits path
    let mut st2 = m.new_state().unwrap();
    let first = m.prefill_greedy(&mut st2, &toks[..n]).unwrap();
    assert_eq!(first, argmax(&got[(n - 1) * v..n * v]));
    // decode replayed from the captured graph is the same computation as
    // decode launched kernel by kernel: bit for bit
    m.opts.graphs = false;
    let mut st3 = m.new_state().unwrap();
    m.forward(&mut st3, &toks[..n], false).unwrap();
    let mut eager = Vec::new();
    for &t in &toks[n..] {
        eager.extend(m.forward(&mut st3, &[t], true).unwrap());
    }
    assert!(
        eager == got[n * v..],
        "decode logits differ between the CUDA graph and direct launches"
    );
}

/// For each greedy head (the screened lm_head and the full product): the
/// greedy steps choose exactly the full logits' argmax; the pipelined greedy
/// decode (each step queued before the previous choice reaches the host)
/// chooses exactly what single greedy steps choose; two states decoded in
/// turn each feed their own choice (the model's `s.next` is shared); an early
/// stop leaves the state one step further, its pending choice that step's,
/// and the position held on the device agrees with the host's after every
/// kind of step. Both heads choose the same ids.
#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_pipeline_matches_single_steps() {
    let screened = greedy_pipeline(GreedyHead::Screen);
    let full = greedy_pipeline(GreedyHead::Full);
    assert_eq!(
        screened, full,
        "the screened and the full greedy head choose different ids"
    );
}

/// One greedy decode step of `st` on its own (a run of one: nothing queued
/// ahead), its choice back on the host.
fn one_greedy_step(m: &CudaModel, st: &mut CudaState) -> u32 {
    let mut id = None;
    let seen = m
        .decode_greedy_run(st, 1, m.cfg.vocab_size, &mut |t| {
            id = Some(t);
            Ok(true)
        })
        .unwrap();
    assert_eq!(seen, 1);
    id.unwrap()
}

/// [`greedy_pipeline_matches_single_steps`] with one greedy head (a model of
/// its own); returns the single steps' choices.
fn greedy_pipeline(head: GreedyHead) -> Vec<u32> {
    // (`gpu()`: Gpu::new(0, &GpuOptions::default()), the product's setting)
    let g = gpu();
    let (cfg, w) = ModelSource::Synthetic("full4".into())
        .load_procedural()
        .unwrap();
    let opts = CudaOptions {
        max_seq: 256,
        prefill_chunk: 4096,
        greedy_head: head,
        graphs: true,
    };
    let m = CudaModel::load(g, cfg, &w, opts, false).unwrap();
    // full4 has the released hidden size: the screen applies when asked for
    assert_eq!(
        m.head_screened(),
        head == GreedyHead::Screen,
        "{head:?}: whether the lm_head's int8 copy is held"
    );
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
        want.push(one_greedy_step(&m, &mut a));
        want_b.push(one_greedy_step(&m, &mut b));
    }
    assert!(
        want.windows(2).any(|p| p[0] != p[1]),
        "{head:?}: a constant sequence tests little: {want:?}"
    );
    // each greedy step's id is the full product's logits' argmax, bit for bit
    let mut e = m.new_state().unwrap();
    assert_eq!(m.prefill_greedy(&mut e, &prompt).unwrap(), want[0]);
    for (i, &t) in want[..steps].iter().enumerate() {
        let logits = m.forward(&mut e, &[t], false).unwrap();
        assert_eq!(
            argmax(&logits),
            want[i + 1],
            "{head:?}, step {i}: the greedy step against the full logits' argmax"
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
    assert_eq!(
        got, want,
        "{head:?}: pipelined greedy differs from single steps"
    );
    assert_eq!(c.pos, prompt.len() + steps);
    // B again, after C wrote the shared s.next: B feeds its own last choice
    let next_b = one_greedy_step(&m, &mut b);
    let mut b2 = m.new_state().unwrap();
    assert_eq!(m.prefill_greedy(&mut b2, &prompt[..20]).unwrap(), want_b[0]);
    let mut last = 0;
    for _ in 0..=steps {
        last = one_greedy_step(&m, &mut b2);
    }
    assert_eq!(next_b, last, "{head:?}: state B fed another state's choice");
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
    assert_eq!(one_greedy_step(&m, &mut d), want[7]);
    // and a run resumed after a single step continues the same sequence
    let mut more = Vec::new();
    m.decode_greedy_run(&mut d, 3, m.cfg.vocab_size, &mut |t| {
        more.push(t);
        Ok(true)
    })
    .unwrap();
    assert_eq!(more, want[8..11]);
    assert_eq!(d.pos, prompt.len() + 10);
    want
}

/// A model whose GDN key head dimension the kernels are not written for is
/// refused at load, naming the setting.
#[test]
#[ignore = "needs a CUDA GPU"]
fn refuses_geometries_the_kernels_do_not_cover() {
    // (`gpu()`: Gpu::new(0, &GpuOptions::default()), the product's setting)
    let g = gpu();
    let (cfg, w) = ModelSource::Synthetic("tiny".into())
        .load_procedural()
        .unwrap();
    let opts = CudaOptions {
        max_seq: 256,
        prefill_chunk: 64,
        greedy_head: GreedyHead::Screen,
        graphs: true,
    };
    let err = CudaModel::load(g, cfg, &w, opts, false)
        .err()
        .expect("tiny has Dk 32");
    assert!(
        format!("{err:#}").contains("linear_key_head_dim"),
        "{err:#}"
    );
}

/// A norm weight `w` (near 0) and the `1 + w` the decode kernels take.
fn norm_weight(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let w = random(n, seed, 0.0, 0.2);
    let w1p = w.iter().map(|v| 1.0 + v).collect();
    (w, w1p)
}

/// The decode router (`router_decode`: the post-attention norm of the f32
/// residual stream computed by the kernel itself, its matrix-vector product,
/// the normed input handed on in xn) against the CPU's rmsnorm1p and linear,
/// three calls with new inputs. The top-K is run by the expert kernels
/// (ops_gpu's moe_experts, decode form).
#[test]
#[ignore = "needs a CUDA GPU"]
fn router_decode_matches_the_cpu() {
    let g = gpu();
    let (d, e, eps) = (2048usize, 256usize, 1e-6f32);
    let logits = g.alloc((e + 1) * 4).unwrap();
    let xn = g.alloc(d * 2).unwrap();
    for call in 0..3u64 {
        let w = procedural_mat(e + 1, d, 500 + call, 4.0 / (d as f32).sqrt());
        let wb = g.upload_new(&bf16_bits(&w.t.to_f32_vec())).unwrap();
        let xf = random(d, 600 + call, 0.2, 1.5);
        let (nw, w1p) = norm_weight(d, 610 + call);
        let (xfb, wpb) = (g.upload_new(&xf).unwrap(), g.upload_new(&w1p).unwrap());
        let input = Normed {
            x: xfb.ptr,
            w1p: wpb.ptr,
            eps,
        };
        router_decode(&g, &wb, input, logits.ptr, d, e, xn.ptr).unwrap();
        // xn: the kernel's input as the gate/up products get it
        let got_x = from_bf16_bits(&g.download::<u16>(xn.ptr, d).unwrap());
        let ex = rel_l2(&got_x, &rmsnorm1p(&xf, &nw, eps, DType::BF16));
        assert!(ex < NORMED_INPUT_TOL, "call {call}: xn relative L2 {ex}");
        // the logits of the kernel's own input
        let got: Vec<f32> = g.download(logits.ptr, e + 1).unwrap();
        let el = rel_l2(&got, &linear(&got_x, 1, &w));
        assert!(el < PRODUCT_TOL, "call {call}: logits relative L2 {el}");
    }
}

/// Three projections of one input in one launch (`gemv3`) against the CPU's
/// rmsnorm1p and three linears, at the GDN input sizes (8192, 4096 and 64
/// rows): the input is the RMSNorm of an f32 residual stream that each block
/// computes itself. A decode layer's first kernel also zeroes the layer's
/// flags (block 0, after its wait): 30 of 32 words of ones here, then none.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv3_matches_the_cpu() {
    gemv3_check(false);
}

/// `gemv3` as an FP8 checkpoint's GDN runs it: in_proj_qkv and in_proj_z
/// block FP8, in_proj_ba bf16, in one launch. The FP8 rows are dequantized
/// exactly, so the bf16 tolerance holds against the CPU reading the same
/// quantized matrices.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv3_fp8_matches_the_cpu() {
    gemv3_check(true);
}

/// A matrix for the products' tests: procedural, or quantized from it (block FP8).
fn test_mat(rows: usize, cols: usize, seed: u64, fp8: bool) -> Mat {
    let m = procedural_mat(rows, cols, seed, 1.0 / (cols as f32).sqrt());
    if !fp8 {
        return m;
    }
    Mat::whole(Arc::new(quantize_fp8_block(rows, cols, &|r, out| {
        m.row_f32(r, out)
    })))
}

fn gemv3_check(fp8: bool) {
    let g = gpu();
    let (k, eps) = (2048usize, 1e-6f32);
    let ns = [8192usize, 4096, 64];
    let ws: Vec<Mat> = ns
        .iter()
        .enumerate()
        .map(|(i, &n)| test_mat(n, k, 710 + i as u64, fp8 && i < 2))
        .collect();
    let wbs: Vec<DevMat> = ws.iter().map(|w| upload_mat(&g, &[w]).unwrap()).collect();
    assert_eq!(wbs[0].is_fp8(), fp8);
    let ys: Vec<_> = ns.iter().map(|n| g.alloc(n * 4).unwrap()).collect();
    let slot = g.alloc(32 * 8).unwrap();
    for (call, clear) in [(0u64, 30usize), (1, 0)] {
        let xf = random(k, 700 + 10 * call, 0.3, 2.0);
        let (nw, w1p) = norm_weight(k, 701 + 10 * call);
        // the CPU's input: bf16(norm(xf) * (1 + w))
        let x = rmsnorm1p(&xf, &nw, eps, DType::BF16);
        let xfb = g.upload_new(&xf).unwrap();
        let wpb = g.upload_new(&w1p).unwrap();
        g.upload(slot.ptr, &[u64::MAX; 32]).unwrap();
        let p: [Projection; 3] = std::array::from_fn(|i| Projection {
            w: &wbs[i],
            y: ys[i].ptr,
            rows: ns[i],
        });
        let input = Normed {
            x: xfb.ptr,
            w1p: wpb.ptr,
            eps,
        };
        gemv3(&g, input, k, p, (slot.ptr, clear)).unwrap();
        let words: Vec<u64> = g.download(slot.ptr, 32).unwrap();
        let cleared: Vec<u64> = (0..32)
            .map(|i| if i < clear { 0 } else { u64::MAX })
            .collect();
        assert_eq!(words, cleared, "call {call}: flags cleared ({clear} words)");
        for i in 0..3 {
            let got: Vec<f32> = g.download(ys[i].ptr, ns[i]).unwrap();
            let want = linear(&x, 1, &ws[i]);
            let e = rel_l2(&got, &want);
            // the products of one input to the kernel's own norm, which may
            // round an element to the neighbouring bf16 of the CPU's
            assert!(
                e < NORMED_INPUT_TOL,
                "call {call}, projection {i} ({} rows): relative L2 {e}",
                ns[i]
            );
        }
    }
}

/// A decode mixer's output projection with the residual add fused in
/// (`gemv_add`: x += W h) against the CPU's linear and add; three calls in a
/// row with new weights and inputs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_add_matches_the_cpu() {
    gemv_add_check(false);
}

/// `gemv_add` with a block-FP8 weight (an FP8 checkpoint's out_proj / o_proj).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_add_fp8_matches_the_cpu() {
    gemv_add_check(true);
}

fn gemv_add_check(fp8: bool) {
    let g = gpu();
    let (d, k) = (2048usize, 4096usize);
    for call in 0..3u64 {
        let w = test_mat(d, k, 800 + call, fp8);
        let h = round_bf16(&random(k, 810 + call, 0.0, 1.0));
        let x0 = random(d, 820 + call, 0.0, 1.0);
        let wb = upload_mat(&g, &[&w]).unwrap();
        assert_eq!(wb.is_fp8(), fp8);
        let hb = g.upload_new(&bf16_bits(&h)).unwrap();
        let xb = g.upload_new(&x0).unwrap();
        gemv_add(&g, &wb, hb.ptr, xb.ptr, d, k).unwrap();
        let got_x: Vec<f32> = g.download(xb.ptr, d).unwrap();
        let want_x: Vec<f32> = x0
            .iter()
            .zip(&linear(&h, 1, &w))
            .map(|(a, b)| a + b)
            .collect();
        let ex = rel_l2(&got_x, &want_x);
        assert!(ex < RESIDUAL_TOL, "call {call}: residual relative L2 {ex}");
    }
}

/// Prompt-cache snapshots: a state restored from a snapshot (into a state
/// that held another sequence) continues bit for bit as the state it was
/// taken from (the same kernels on the same bytes), a snapshot is its own
/// memory (the source going on does not change it), and a reset state
/// prefills as a new one does.
#[test]
#[ignore = "needs a CUDA GPU"]
fn snapshots_restore_what_the_state_held() {
    let g = gpu();
    let (cfg, w) = ModelSource::Synthetic("full4".into())
        .load_procedural()
        .unwrap();
    let toks: Vec<u32> = (0..130u64)
        .map(|i| ((i * 2_654_435_761 + 31) % 248_077) as u32)
        .collect();
    let other: Vec<u32> = (0..300u64)
        .map(|i| ((i * 40_503 + 7) % 248_077) as u32)
        .collect();
    let opts = CudaOptions {
        max_seq: 4096,
        prefill_chunk: 64,
        greedy_head: GreedyHead::Screen,
        graphs: true,
    };
    let row = cfg.num_key_value_heads * cfg.head_dim * 2;
    let m = CudaModel::load(g, cfg.clone(), &w, opts, false).unwrap();
    let decode_all = |st: &mut CudaState, t: &[u32]| -> Vec<f32> {
        t.iter()
            .flat_map(|&x| m.forward(st, &[x], true).unwrap())
            .collect()
    };
    let mut a = m.new_state().unwrap();
    m.forward(&mut a, &toks[..100], false).unwrap();
    let snap = m.snapshot(&a).unwrap();
    assert_eq!(snap.pos(), 100);
    let gdn_bytes = cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1) * 4
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4;
    let want_bytes: usize = cfg
        .layer_kinds
        .iter()
        .map(|k| match k {
            lily_model::LayerKind::Attention => 2 * 100 * row,
            lily_model::LayerKind::Gdn => gdn_bytes,
        })
        .sum();
    assert_eq!(snap.bytes(), want_bytes);
    let want = decode_all(&mut a, &toks[100..]);
    // a state that held something else, longer: restored, it goes on as `a` did
    let mut b = m.new_state().unwrap();
    m.forward(&mut b, &other, false).unwrap();
    decode_all(&mut b, &other[..3]);
    m.restore(&snap, &mut b).unwrap();
    assert_eq!(b.pos, 100);
    let got = decode_all(&mut b, &toks[100..]);
    assert!(
        got == want,
        "decode after restore differs from the source state's"
    );
    // again, after both states went on: the snapshot did not move
    m.restore(&snap, &mut b).unwrap();
    let got = decode_all(&mut b, &toks[100..]);
    assert!(got == want, "a second restore of the same snapshot differs");
    // the greedy pipeline after a restore: as a state that prefilled the tokens
    m.restore(&snap, &mut b).unwrap();
    let mut c = m.new_state().unwrap();
    m.forward(&mut c, &toks[..100], false).unwrap();
    m.set_next_token(&mut b, toks[100]).unwrap();
    m.set_next_token(&mut c, toks[100]).unwrap();
    let run = |st: &mut CudaState| {
        let mut ids = Vec::new();
        m.decode_greedy_run(st, 8, cfg.vocab_size, &mut |id| {
            ids.push(id);
            Ok(true)
        })
        .unwrap();
        ids
    };
    assert_eq!(run(&mut b), run(&mut c), "greedy after restore");
    // reset: a used state prefills as a new one
    m.reset(&mut b).unwrap();
    assert_eq!(b.pos, 0);
    let mut fresh = m.new_state().unwrap();
    let l1 = m.forward(&mut b, &toks[..100], false).unwrap();
    let l2 = m.forward(&mut fresh, &toks[..100], false).unwrap();
    assert!(l1 == l2, "prefill after reset differs from a new state's");
}
