//! The chunked GDN prefill kernels (kernels/gdn_chunked.cu through
//! `lily_cuda::kernels::gdn_chunked::gdn_chunked_prefill`) against the CPU
//! reference (`support::gdn_cpu_reference`: lily-cpu's `prepare` and its
//! `GdnCore` in the recurrent form), at the released sizes (Hk 16, Hv 32,
//! Dk = Dv = 128), across chunk boundaries and passes, from a non-zero
//! initial state. Every GPU test is ignored without `--include-ignored`
//! (support's module comment says why).
//!
//! Tolerances (`TOL_O`, `TOL_S`): the chunked kernels compute on the tensor
//! cores with bf16 operands and f32 accumulation, as fla's chunk kernels do:
//! the normalised q and k, T = (I + A)^-1, the right-hand sides, U, W, the
//! decayed q and k, P, the state and v' are each rounded to bf16 (2^-9
//! relative) before a product. `tools/gdn_bf16_noise.py` emulates exactly
//! these roundings against an f64 recurrence on this file's input
//! distribution: at most 4.5e-3 relative L2 for o and 3.9e-3 for the final
//! state (levelling off by T ~ 300: decays <= 1 forget older roundings); the
//! all-f32 emulation 3e-7. Most mistakes it tries (a wrong decay, a dropped
//! beta, a head mapping, P without its diagonal) move o or S by 1.5e-2 to 1 at
//! T >= 65. Hence 1.4e-2 and 1.2e-2, about 3x the noise.
//! With decays of 0.5..0.999 a 64-token chunk forgets the carried state
//! (~e^-19), so `chunked_slow_decay_carries_the_state` also runs decays of
//! 0.995 with 0.5 on each chunk's last token, where decaying S by the wrong
//! token's gate moves o by 5e-2 or more.
//!
//! The fused decode kernel (`lily_cuda::kernels::gdn::gdn_decode`: the conv,
//! the T = 1 step and the gated RMSNorm in one launch) is checked step after
//! step against the CPU composition (`causal_conv1d_silu`, the reference core,
//! `gated_rmsnorm`); its tolerances are at `TOL_DEC_*`.

mod support;

use lily_cpu::ops::conv::causal_conv1d_silu;
use lily_cpu::ops::norm::gated_rmsnorm;
use lily_cuda::gpu::Gpu;
use lily_cuda::kernels::gdn::{
    gdn_decode, gdn_decode_check, GdnDecode, GDN_DECODE_CONV, GDN_DECODE_DV,
};
use lily_cuda::kernels::gdn_chunked::{
    gdn_chunk_record_bytes, gdn_chunked_check, gdn_chunked_prefill, gdn_chunked_scratch_bytes,
    GDN_CHUNK, GDN_DK,
};
use lily_model::DType;
use support::{from_bf16_bits, gdn_cpu_reference, gpu, random_nonzero, rel_l2, GdnDims, GdnInputs};

const HK: usize = 16;
const HV: usize = 32;
const DK: usize = 128;
const DV: usize = 128;
const C: usize = 2 * HK * DK + HV * DV;
const DIMS: GdnDims = GdnDims {
    hk: HK,
    hv: HV,
    dk: DK,
    dv: DV,
};
/// bf16 operands, f32 sums: <= 4.5e-3 emulated (tools/gdn_bf16_noise.py).
const TOL_O: f64 = 1.4e-2;
/// The final state: <= 3.9e-3 emulated.
const TOL_S: f64 = 1.2e-2;
/// Not a degenerate test: the reference's largest |o| is at least this.
const MIN_O: f32 = 0.01;
/// Outputs of a different initial state differ by at least this (the negative tests).
const MIN_STATE_EFFECT: f64 = 1e-2;

/// Random inputs of `t` tokens: unit-variance conv rows, beta = sigmoid(b) in
/// 0.1 .. 0.9, per-token decays in 0.5 .. 0.999, a random initial state.
fn inputs(t: usize, seed: u64) -> GdnInputs {
    let conv = random_nonzero(t * C, seed, 0.0, 1.0);
    let a_log = random_nonzero(HV, seed + 1, 0.0, 0.3);
    let dt_bias = random_nonzero(HV, seed + 2, 0.0, 0.6);
    // beta = sigmoid(b) uniform in 0.1 .. 0.9
    let beta = random_nonzero(t * HV, seed + 3, 0.5, 0.8 / 12f32.sqrt());
    // per-token decay exp(g) uniform in 0.5 .. 0.999, through a = softplus^-1(-ln(decay) / exp(a_log)) - dt_bias
    let decay = random_nonzero(t * HV, seed + 4, 0.7495, 0.499 / 12f32.sqrt());
    let mut ba = vec![0f32; t * 2 * HV];
    for ti in 0..t {
        for j in 0..HV {
            let bt = beta[ti * HV + j].clamp(0.1, 0.9) as f64;
            ba[ti * 2 * HV + j] = (bt / (1.0 - bt)).ln() as f32;
            let d = decay[ti * HV + j].clamp(0.5, 0.999) as f64;
            let sp = -d.ln() / (a_log[j] as f64).exp();
            ba[ti * 2 * HV + HV + j] = (sp.exp_m1().ln() - dt_bias[j] as f64) as f32;
        }
    }
    let s0 = random_nonzero(HV * DK * DV, seed + 5, 0.0, 0.5);
    GdnInputs {
        t,
        conv,
        ba,
        a_log,
        dt_bias,
        s0,
    }
}

/// How the chunked launcher gets its scratch.
#[derive(Clone, Copy, Debug)]
enum Scratch {
    /// a buffer of `gdn_chunked_scratch_bytes(t, ..)`
    Sized,
    /// a buffer of this many chunks: several passes
    Chunks(usize),
}

/// (o, final state) of the chunked kernels.
fn run_gpu(g: &Gpu, x: &GdnInputs, how: Scratch) -> (Vec<f32>, Vec<f32>) {
    let t = x.t;
    let conv = g.upload_new(&x.conv).unwrap();
    let ba = g.upload_new(&x.ba).unwrap();
    let a_log = g.upload_new(&x.a_log).unwrap();
    let dt_bias = g.upload_new(&x.dt_bias).unwrap();
    let s = g.upload_new(&x.s0).unwrap();
    let o = g.upload_new(&vec![f32::NAN; t * HV * DV]).unwrap();
    let buf = match how {
        Scratch::Sized => g.alloc(gdn_chunked_scratch_bytes(t, HV, DV)).unwrap(),
        Scratch::Chunks(n) => g.alloc(n * HV * gdn_chunk_record_bytes(DV)).unwrap(),
    };
    gdn_chunked_prefill(
        g,
        &buf,
        conv.ptr,
        ba.ptr,
        a_log.ptr,
        dt_bias.ptr,
        s.ptr,
        o.ptr,
        t,
        HK,
        HV,
        DV,
    )
    .unwrap();
    g.sync().unwrap();
    (
        g.download(o.ptr, t * HV * DV).unwrap(),
        g.download(s.ptr, HV * DK * DV).unwrap(),
    )
}

fn check(g: &Gpu, t: usize, seed: u64, how: Scratch) {
    check_inputs(g, &inputs(t, seed), how);
}

fn check_inputs(g: &Gpu, x: &GdnInputs, how: Scratch) {
    let t = x.t;
    let (o_cpu, s_cpu) = gdn_cpu_reference(DIMS, x);
    let (o_chk, s_chk) = run_gpu(g, x, how);
    assert!(
        o_chk.iter().chain(&s_chk).all(|v| v.is_finite()),
        "T={t}: non-finite output or state"
    );
    let max_o = o_cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        max_o > MIN_O,
        "degenerate test: outputs near zero (max |o| {max_o})"
    );
    let (eo, es) = (rel_l2(&o_chk, &o_cpu), rel_l2(&s_chk, &s_cpu));
    eprintln!("T={t} ({how:?}): chunked vs CPU: o {eo:.2e}, S {es:.2e}");
    assert!(
        eo < TOL_O,
        "T={t} ({how:?}): output vs CPU, rel L2 {eo:.3e}"
    );
    assert!(es < TOL_S, "T={t} ({how:?}): state vs CPU, rel L2 {es:.3e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_matches_cpu_at_released_sizes() {
    let g = gpu();
    assert_eq!((GDN_DK, GDN_CHUNK), (DK, 64));
    for (i, (t, how)) in [
        (1, Scratch::Sized),
        (63, Scratch::Sized),
        (64, Scratch::Sized),
        (65, Scratch::Sized),
        (1000, Scratch::Sized),
    ]
    .into_iter()
    .enumerate()
    {
        check(&g, t, 0x6D17 + 16 * i as u64, how);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_passes_carry_the_state() {
    // A scratch buffer of 3 chunks: T = 1000 runs as 6 passes (3+3+3+3+3+1 chunks).
    let g = gpu();
    check(&g, 1000, 0xC0FFEE, Scratch::Chunks(3));
}

/// Slow decays (0.995) with a fast one (0.5) on each chunk's last token: the
/// carried state matters across chunks, and only the last token's gate
/// decays it by the right amount.
#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_slow_decay_carries_the_state() {
    let g = gpu();
    for t in [130, 1000] {
        let mut x = inputs(t, 0x510E + t as u64);
        for ti in 0..t {
            let d: f64 = if ti % GDN_CHUNK == GDN_CHUNK - 1 {
                0.5
            } else {
                0.995
            };
            for j in 0..HV {
                let sp = -d.ln() / (x.a_log[j] as f64).exp();
                x.ba[ti * 2 * HV + HV + j] = (sp.exp_m1().ln() - x.dt_bias[j] as f64) as f32;
            }
        }
        check_inputs(&g, &x, Scratch::Sized);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_detects_a_wrong_state() {
    // The comparison can fail: a different initial state gives another output.
    let g = gpu();
    let x = inputs(65, 7);
    let mut y = inputs(65, 7);
    y.s0 = random_nonzero(HV * DK * DV, 8, 0.0, 0.5);
    let (o_x, _) = run_gpu(&g, &x, Scratch::Sized);
    let (o_y, _) = run_gpu(&g, &y, Scratch::Sized);
    let e = rel_l2(&o_y, &o_x);
    assert!(e > MIN_STATE_EFFECT, "another state moved o by {e:.2e}");
}

#[test]
fn chunked_rejects_unsupported_shapes() {
    // no GPU needed: the launcher checks shapes before it launches
    assert!(gdn_chunked_check(HK, HV, DK, DV).is_ok());
    assert!(gdn_chunked_check(HK, HV, DK, 64).is_ok());
    assert!(gdn_chunked_check(HV, HV, DK, DV).is_ok());
    assert!(gdn_chunked_check(HK, HV, 64, DV).is_err());
    assert!(gdn_chunked_check(HK, HV, DK, 0).is_err());
    assert!(gdn_chunked_check(HK, HV, DK, 48).is_err());
    assert!(gdn_chunked_check(0, HV, DK, DV).is_err());
    assert!(gdn_chunked_check(HK, 0, DK, DV).is_err());
    assert!(gdn_chunked_check(12, HV, DK, DV).is_err());
    // more v heads than the grid's y dimension holds
    assert!(gdn_chunked_check(1, 70_000, DK, DV).is_err());
}

// ---------------------------------------------------------------------------
// Fused decode (T = 1): `gdn_decode` = the causal conv + SiLU, the gated delta
// step and the gated RMSNorm in one launch (the conv checked bit for bit
// through its history, and through the outputs, whose CPU reference starts
// from the CPU's conv rows).
//
// Tolerances. The output is bf16 (the input of out_proj); the reference is
// the CPU in f32 (`gated_rmsnorm` with DType::F32: no intermediate rounding,
// as the GPU kernel): the kernel's own f32 result agrees with it to ~1e-6, so
// the difference is the final bf16 rounding, at most 2^-9 = 2e-3 relative per
// element and ~1.1e-3 rel L2 over uniformly spread mantissas. 4e-3 allows that
// with margin; a wrong head, column, gate or norm gives 1e-2 or more.
// The state is f32 on both sides, the same terms summed in a different order:
// ~1e-7 rel L2 per step, and it does not grow over steps (every decay <= 1);
// 1e-5 leaves 100x margin while a wrong update (missing decay, beta, a
// column) is off by 1e-2 or more.

/// bf16 output vs the f32 CPU: the final rounding (~1.1e-3 rel L2) with margin.
const TOL_DEC_OUT: f64 = 4e-3;
/// f32 state vs the CPU, summed in another order: ~1e-7 per step, no growth.
const TOL_DEC_S: f64 = 1e-5;
/// Not a degenerate test: the largest |out| of a step is at least this.
const MIN_DEC_OUT: f32 = 0.1;
/// Not a degenerate test: each step moves the state by at least this (rel L2).
const MIN_DEC_STATE_MOVE: f64 = 1e-2;
const EPS: f32 = 1e-6;
const STEPS: usize = 6;

/// Inputs of `steps` decode steps: the conv's (per-step rows before the conv,
/// its taps and initial history), the core's (b | a, a random non-zero
/// initial state; its conv rows are the CPU conv of the mixed rows) plus the
/// output gate z [steps, Hv*Dv] and the gated-norm weight [Dv].
struct DecodeInputs {
    x: GdnInputs,
    z: Vec<f32>,
    norm_w: Vec<f32>,
    /// [steps, C] the in projection's output, before the conv
    mixed: Vec<f32>,
    /// [C, CONV] taps, [C, CONV - 1] initial history
    taps: Vec<f32>,
    conv0: Vec<f32>,
    /// the CPU's conv history after each step
    conv_states: Vec<Vec<f32>>,
}

const CONV: usize = 4;

fn decode_inputs(steps: usize, seed: u64) -> DecodeInputs {
    let mut x = inputs(steps, seed);
    let mixed = random_nonzero(steps * C, seed + 8, 0.0, 1.0);
    let taps = random_nonzero(C * CONV, seed + 9, 0.0, 0.5);
    let conv0 = random_nonzero(C * (CONV - 1), seed + 10, 0.0, 1.0);
    let mut hist = conv0.clone();
    let mut conv_states = Vec::new();
    x.conv.clear();
    for t in 0..steps {
        let row = &mixed[t * C..(t + 1) * C];
        x.conv.extend(causal_conv1d_silu(
            row,
            1,
            C,
            &taps,
            CONV,
            &mut hist,
            DType::F32,
        ));
        conv_states.push(hist.clone());
    }
    DecodeInputs {
        x,
        z: random_nonzero(steps * HV * DV, seed + 6, 0.0, 1.5),
        norm_w: random_nonzero(DV, seed + 7, 1.0, 0.3),
        mixed,
        taps,
        conv0,
        conv_states,
    }
}

/// The CPU composition, step by step: per step (out [Hv*Dv] in f32, state after it).
fn cpu_decode(d: &DecodeInputs) -> Vec<(Vec<f32>, Vec<f32>)> {
    let x = &d.x;
    let mut s = x.s0.clone();
    let mut steps = Vec::new();
    for t in 0..x.t {
        let one = GdnInputs {
            t: 1,
            conv: x.conv[t * C..(t + 1) * C].to_vec(),
            ba: x.ba[t * 2 * HV..(t + 1) * 2 * HV].to_vec(),
            a_log: x.a_log.clone(),
            dt_bias: x.dt_bias.clone(),
            s0: s,
        };
        let (o, s1) = gdn_cpu_reference(DIMS, &one);
        let z = &d.z[t * HV * DV..(t + 1) * HV * DV];
        let out = gated_rmsnorm(&o, z, &d.norm_w, EPS, DType::F32);
        steps.push((out, s1.clone()));
        s = s1;
    }
    steps
}

/// The GPU, step by step, with the launch's arguments fixed across steps (as
/// a captured graph replays them: each step's inputs are copied into the same
/// buffers): `gdn_decode` from the rows before the conv; its conv history must
/// match the CPU's bit for bit after every step. Per step: (out as f32 from
/// bf16, state after it).
fn gpu_decode(g: &Gpu, d: &DecodeInputs) -> Vec<(Vec<f32>, Vec<f32>)> {
    let x = &d.x;
    let mixed = g.alloc(C * 4).unwrap();
    let taps = g.upload_new(&d.taps).unwrap();
    let hist = g.upload_new(&d.conv0).unwrap();
    let ba = g.alloc(2 * HV * 4).unwrap();
    let z = g.alloc(HV * DV * 4).unwrap();
    let a_log = g.upload_new(&x.a_log).unwrap();
    let dt_bias = g.upload_new(&x.dt_bias).unwrap();
    let norm_w = g.upload_new(&d.norm_w).unwrap();
    let s = g.upload_new(&x.s0).unwrap();
    // bf16 NaN everywhere: an element the kernel does not write fails the finite check
    let out = g.upload_new(&vec![0xFFFFu16; HV * DV]).unwrap();
    let args = GdnDecode {
        mixed: mixed.ptr,
        conv_state: hist.ptr,
        conv_w: taps.ptr,
        ba: ba.ptr,
        a_log: a_log.ptr,
        dt_bias: dt_bias.ptr,
        z: z.ptr,
        norm_w: norm_w.ptr,
        state: s.ptr,
        out: out.ptr,
    };
    let mut steps = Vec::new();
    for t in 0..x.t {
        g.upload(mixed.ptr, &d.mixed[t * C..(t + 1) * C]).unwrap();
        g.upload(ba.ptr, &x.ba[t * 2 * HV..(t + 1) * 2 * HV])
            .unwrap();
        g.upload(z.ptr, &d.z[t * HV * DV..(t + 1) * HV * DV])
            .unwrap();
        gdn_decode(g, &args, HK, HV, DV, EPS).unwrap();
        g.sync().unwrap();
        let h: Vec<f32> = g.download(hist.ptr, C * (CONV - 1)).unwrap();
        let bad = h
            .iter()
            .zip(&d.conv_states[t])
            .filter(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            bad.count(),
            0,
            "step {t}: conv history differs from the CPU's"
        );
        let o16: Vec<u16> = g.download(out.ptr, HV * DV).unwrap();
        steps.push((
            from_bf16_bits(&o16),
            g.download(s.ptr, HV * DK * DV).unwrap(),
        ));
    }
    steps
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_matches_cpu() {
    let g = gpu();
    assert_eq!((GDN_DK, GDN_DECODE_DV, GDN_DECODE_CONV), (DK, DV, CONV));
    for seed in [0xDEC0DE_u64, 0x5EED] {
        let d = decode_inputs(STEPS, seed);
        let cpu = cpu_decode(&d);
        let fused = gpu_decode(&g, &d);
        assert_eq!(fused.len(), STEPS);
        let mut prev = d.x.s0.clone();
        for (t, (c, f)) in cpu.iter().zip(&fused).enumerate() {
            assert!(
                f.0.iter().chain(&f.1).all(|v| v.is_finite()),
                "seed {seed:#x} step {t}: non-finite output or state"
            );
            // not a degenerate test: outputs of size, a state that moves each step
            let max_out = c.0.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                max_out > MIN_DEC_OUT,
                "degenerate test: max |out| {max_out}"
            );
            let moved = rel_l2(&c.1, &prev);
            assert!(
                moved > MIN_DEC_STATE_MOVE,
                "degenerate test: the state moved by {moved:.2e}"
            );
            prev.clone_from(&c.1);

            let (eo, es) = (rel_l2(&f.0, &c.0), rel_l2(&f.1, &c.1));
            eprintln!("seed {seed:#x} step {t}: gdn_decode vs CPU: out {eo:.2e}, S {es:.2e}");
            assert!(
                eo < TOL_DEC_OUT,
                "seed {seed:#x} step {t}: out vs CPU, rel L2 {eo:.3e}"
            );
            assert!(
                es < TOL_DEC_S,
                "seed {seed:#x} step {t}: state vs CPU, rel L2 {es:.3e}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_output_depends_on_the_state() {
    // The comparison can fail: from another initial state the output differs.
    let g = gpu();
    let d = decode_inputs(1, 11);
    let mut e = decode_inputs(1, 11);
    e.x.s0 = random_nonzero(HV * DK * DV, 12, 0.0, 0.5);
    let (a, b) = (gpu_decode(&g, &d), gpu_decode(&g, &e));
    let diff = rel_l2(&b[0].0, &a[0].0);
    assert!(
        diff > MIN_STATE_EFFECT,
        "another state moved out by {diff:.2e}"
    );
}

#[test]
fn decode_rejects_unsupported_shapes() {
    // no GPU needed: the launcher checks shapes before it launches
    assert!(gdn_decode_check(HK, HV, DK, DV, CONV).is_ok());
    assert!(gdn_decode_check(HV, HV, DK, DV, CONV).is_ok());
    assert!(gdn_decode_check(HK, HV, 64, DV, CONV).is_err());
    assert!(gdn_decode_check(HK, HV, DK, 64, CONV).is_err());
    assert!(gdn_decode_check(HK, HV, DK, 256, CONV).is_err());
    assert!(gdn_decode_check(HK, HV, DK, DV, 3).is_err());
    assert!(gdn_decode_check(0, HV, DK, DV, CONV).is_err());
    assert!(gdn_decode_check(HK, 0, DK, DV, CONV).is_err());
    assert!(gdn_decode_check(12, HV, DK, DV, CONV).is_err());
    // a key head read by 4 v heads would span two clusters
    assert!(gdn_decode_check(8, HV, DK, DV, CONV).is_err());
    // an odd head count leaves a cluster half empty
    assert!(gdn_decode_check(3, 3, DK, DV, CONV).is_err());
}
