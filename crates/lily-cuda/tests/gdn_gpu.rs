//! The chunked GDN prefill kernels (kernels/gdn_chunked.cu through
//! `lily_cuda::gdn::gdn_chunked_prefill`) against (a) the CPU reference
//! `lily_cpu::ops::gdn::GdnCore` in its recurrent form and (b) the GPU's own
//! `gdn_recurrent_kernel`, at the released sizes (Hk 16, Hv 32, Dk = Dv = 128),
//! across chunk boundaries, from a non-zero initial state. Without a GPU every
//! test prints that it skips and passes.
//!
//! Tolerances: everything is f32 on both sides; the chunked form sums the same
//! terms as the recurrence in another order (the UT transform, per-chunk
//! matrix products, decays as exp of cumulative sums instead of running
//! products). A host emulation of these kernels gave relative L2 errors of
//! ~5e-7 for o and S; an algebraic mistake (a wrong decay, a chunk boundary, a
//! head mapping) gives 1e-2 or more. Hence 1e-4 for the output. The final
//! state gets the same 1e-4: it is an f32 sum over the same terms as the
//! recurrent state, with every decay factor <= 1, so rounding does not grow
//! with T (decays of at most 0.999 forget an error within a few thousand
//! tokens); it is compared relative to the whole state's L2 norm, which the
//! random initial state keeps well away from zero.
//!
//! The fused decode kernel (`lily_cuda::gdn::gdn_decode`: the T = 1 step and
//! the gated RMSNorm in one launch) is checked step after step against the CPU
//! composition (`GdnCore` recurrent + `gated_rmsnorm`) and against the GPU's
//! `gdn_recurrent_kernel` + `gated_rmsnorm_kernel`; its tolerances are at
//! `TOL_DEC_*`.

mod support;

use lily_cpu::ops::conv::causal_conv1d_silu;
use lily_cpu::ops::norm::gated_rmsnorm;
use lily_cuda::gdn::{
    gdn_chunk_record_floats, gdn_chunked_prefill, gdn_chunked_scratch_bytes, gdn_decode,
    gdn_decode_blocks, gdn_decode_check, GDN_DECODE_DV, GDN_DK,
};
use lily_cuda::gpu::{Arg, Gpu};
use lily_model::DType;
use support::{
    from_bf16_bits, gdn_cpu_reference, gpu, launch_gdn_recurrent, random_nonzero, rel_l2, GdnDims,
    GdnInputs,
};

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
const TOL_O: f64 = 1e-4;
const TOL_S: f64 = 1e-4;

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
    /// None: the launcher allocates it
    Own,
    /// a buffer of `gdn_chunked_scratch_bytes(t, ..)`
    Sized,
    /// a buffer of this many chunks: several passes
    Chunks(usize),
}

/// (o, final state) of the chunked kernels, or of `gdn_recurrent_kernel`.
fn run_gpu(g: &Gpu, x: &GdnInputs, chunked: Option<Scratch>) -> (Vec<f32>, Vec<f32>) {
    let t = x.t;
    let conv = g.upload_new(&x.conv).unwrap();
    let ba = g.upload_new(&x.ba).unwrap();
    let a_log = g.upload_new(&x.a_log).unwrap();
    let dt_bias = g.upload_new(&x.dt_bias).unwrap();
    let s = g.upload_new(&x.s0).unwrap();
    let o = g.upload_new(&vec![f32::NAN; t * HV * DV]).unwrap();
    match chunked {
        Some(how) => {
            let buf = match how {
                Scratch::Own => None,
                Scratch::Sized => Some(g.alloc(gdn_chunked_scratch_bytes(t, HV, DV)).unwrap()),
                Scratch::Chunks(n) => {
                    Some(g.alloc(n * HV * gdn_chunk_record_floats(DV) * 4).unwrap())
                }
            };
            gdn_chunked_prefill(
                g,
                buf.as_ref(),
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
        }
        None => {
            launch_gdn_recurrent(
                g,
                DIMS,
                t,
                [conv.ptr, ba.ptr, a_log.ptr, dt_bias.ptr, s.ptr, o.ptr],
            );
            g.sync().unwrap();
        }
    }
    (
        g.download(o.ptr, t * HV * DV).unwrap(),
        g.download(s.ptr, HV * DK * DV).unwrap(),
    )
}

fn check(g: &Gpu, t: usize, seed: u64, how: Scratch) {
    let x = inputs(t, seed);
    let (o_cpu, s_cpu) = gdn_cpu_reference(DIMS, &x);
    let (o_rec, s_rec) = run_gpu(g, &x, None);
    let (o_chk, s_chk) = run_gpu(g, &x, Some(how));
    assert!(
        o_chk.iter().chain(&s_chk).all(|v| v.is_finite()),
        "T={t}: non-finite output or state"
    );
    let max_o = o_cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        max_o > 0.01,
        "degenerate test: outputs near zero (max |o| {max_o})"
    );
    let (eo_cpu, es_cpu) = (rel_l2(&o_chk, &o_cpu), rel_l2(&s_chk, &s_cpu));
    let (eo_rec, es_rec) = (rel_l2(&o_chk, &o_rec), rel_l2(&s_chk, &s_rec));
    eprintln!(
        "T={t} ({how:?}): chunked vs CPU: o {eo_cpu:.2e}, S {es_cpu:.2e}; vs gdn_recurrent_kernel: o {eo_rec:.2e}, S {es_rec:.2e}"
    );
    assert!(eo_cpu < TOL_O, "T={t}: output vs CPU, rel L2 {eo_cpu:.3e}");
    assert!(es_cpu < TOL_S, "T={t}: state vs CPU, rel L2 {es_cpu:.3e}");
    assert!(
        eo_rec < TOL_O,
        "T={t}: output vs gdn_recurrent_kernel, rel L2 {eo_rec:.3e}"
    );
    assert!(
        es_rec < TOL_S,
        "T={t}: state vs gdn_recurrent_kernel, rel L2 {es_rec:.3e}"
    );
}

#[test]
fn chunked_matches_recurrent_at_released_sizes() {
    let Some(g) = gpu() else { return };
    assert_eq!(GDN_DK, DK);
    for (i, (t, how)) in [
        (1, Scratch::Own),
        (63, Scratch::Sized),
        (64, Scratch::Own),
        (65, Scratch::Sized),
        (1000, Scratch::Own),
    ]
    .into_iter()
    .enumerate()
    {
        check(&g, t, 0x6D17 + 16 * i as u64, how);
    }
}

#[test]
fn chunked_passes_carry_the_state() {
    // A scratch buffer of 3 chunks: T = 1000 runs as 6 passes (3+3+3+3+3+1 chunks).
    let Some(g) = gpu() else { return };
    check(&g, 1000, 0xC0FFEE, Scratch::Chunks(3));
}

#[test]
fn chunked_detects_a_wrong_state() {
    // The comparison can fail: a different initial state gives another output.
    let Some(g) = gpu() else { return };
    let x = inputs(65, 7);
    let mut y = inputs(65, 7);
    y.s0 = random_nonzero(HV * DK * DV, 8, 0.0, 0.5);
    let (o_x, _) = run_gpu(&g, &x, Some(Scratch::Own));
    let (o_y, _) = run_gpu(&g, &y, Some(Scratch::Own));
    assert!(rel_l2(&o_y, &o_x) > 1e-2);
}

// ---------------------------------------------------------------------------
// Fused decode (T = 1): `gdn_decode` = conv_silu_kernel + gdn_recurrent_kernel +
// gated_rmsnorm_kernel (the conv checked bit for bit through its history, and
// through the outputs, which use the CPU's conv rows on the reference paths).
//
// Tolerances. The output is bf16 (the input of out_proj); the references are:
// - the CPU in f32 (`gated_rmsnorm` with DType::F32: no intermediate rounding,
//   as the GPU kernels): the kernel's own f32 result agrees with it to ~1e-6,
//   so the difference is the final bf16 rounding, at most 2^-9 = 2e-3 relative
//   per element and ~1.1e-3 rel L2 over uniformly spread mantissas. 4e-3 allows
//   that with margin; a wrong head, column, gate or norm gives 1e-2 or more;
// - the GPU's two-kernel path, also bf16: the two f32 results differ by ~1e-6
//   relative (the fused kernel computes o = Sd^T q + delta (k . q) and sums rows
//   in another order), so they round to the same bf16 except where a value
//   sits on a rounding boundary (one ulp, 2^-8 relative, on a tiny fraction of
//   the elements): rel L2 ~1e-5 expected, 1e-3 allowed.
// The state is f32 on every side, the same terms summed in a different order:
// ~1e-7 rel L2 per step, and it does not grow over steps (every decay <= 1);
// 1e-5 leaves 100x margin while a wrong update (missing decay, beta, a
// column) is off by 1e-2 or more.
const TOL_DEC_OUT_CPU: f64 = 4e-3;
const TOL_DEC_OUT_GPU: f64 = 1e-3;
const TOL_DEC_S: f64 = 1e-5;
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

/// The GPU, step by step, with every launch's arguments fixed across steps (as
/// a captured graph replays them: each step's inputs are copied into the same
/// buffers). `fused`: `gdn_decode` from the rows before the conv (its conv
/// history must then match the CPU's bit for bit after every step); else
/// gdn_recurrent_kernel (T = 1) + gated_rmsnorm_kernel from the CPU's conv
/// rows. Per step: (out as f32 from bf16, state after it).
/// `counted`: the fused kernel also counts its blocks done (the output
/// projection's early signal, which moves warp 0's state stores after it).
fn gpu_decode(g: &Gpu, d: &DecodeInputs, fused: bool, counted: bool) -> Vec<(Vec<f32>, Vec<f32>)> {
    let x = &d.x;
    let conv = g.alloc(C * 4).unwrap();
    let mixed = g.alloc(C * 4).unwrap();
    let taps = g.upload_new(&d.taps).unwrap();
    let hist = g.upload_new(&d.conv0).unwrap();
    let ba = g.alloc(2 * HV * 4).unwrap();
    let z = g.alloc(HV * DV * 4).unwrap();
    let a_log = g.upload_new(&x.a_log).unwrap();
    let dt_bias = g.upload_new(&x.dt_bias).unwrap();
    let norm_w = g.upload_new(&d.norm_w).unwrap();
    let s = g.upload_new(&x.s0).unwrap();
    let o = g.upload_new(&vec![f32::NAN; HV * DV]).unwrap();
    // bf16 NaN everywhere: an element the kernel does not write fails the finite check
    let out = g.upload_new(&vec![0xFFFFu16; HV * DV]).unwrap();
    // the fused kernel's blocks-done count (the output projection's early
    // signal): every block adds 1 each step
    let done = g.upload_new(&[0u32]).unwrap();
    let mut steps = Vec::new();
    for t in 0..x.t {
        g.upload(conv.ptr, &x.conv[t * C..(t + 1) * C]).unwrap();
        g.upload(mixed.ptr, &d.mixed[t * C..(t + 1) * C]).unwrap();
        g.upload(ba.ptr, &x.ba[t * 2 * HV..(t + 1) * 2 * HV])
            .unwrap();
        g.upload(z.ptr, &d.z[t * HV * DV..(t + 1) * HV * DV])
            .unwrap();
        if fused {
            gdn_decode(
                g,
                mixed.ptr,
                hist.ptr,
                taps.ptr,
                ba.ptr,
                a_log.ptr,
                dt_bias.ptr,
                z.ptr,
                norm_w.ptr,
                s.ptr,
                out.ptr,
                HK,
                HV,
                DV,
                EPS,
                if counted { done.ptr } else { 0 },
            )
            .unwrap();
        } else {
            launch_gdn_recurrent(
                g,
                DIMS,
                1,
                [conv.ptr, ba.ptr, a_log.ptr, dt_bias.ptr, s.ptr, o.ptr],
            );
            g.launch(
                "gated_rmsnorm_kernel",
                (HV as u32, 1, 1),
                (DV as u32, 1, 1),
                0,
                &[
                    Arg::Ptr(o.ptr),
                    Arg::Ptr(z.ptr),
                    Arg::Ptr(norm_w.ptr),
                    Arg::Ptr(out.ptr),
                    Arg::I32(DV as i32),
                    Arg::F32(EPS),
                ],
            )
            .unwrap();
        }
        g.sync().unwrap();
        if fused {
            let n: Vec<u32> = g.download(done.ptr, 1).unwrap();
            let want = if counted {
                (t as u32 + 1) * gdn_decode_blocks(HV)
            } else {
                0
            };
            assert_eq!(n[0], want, "step {t}: blocks-done count");
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
        }
        let o16: Vec<u16> = g.download(out.ptr, HV * DV).unwrap();
        steps.push((
            from_bf16_bits(&o16),
            g.download(s.ptr, HV * DK * DV).unwrap(),
        ));
    }
    steps
}

#[test]
fn decode_matches_cpu_and_two_kernel_path() {
    let Some(g) = gpu() else { return };
    assert_eq!((GDN_DK, GDN_DECODE_DV), (DK, DV));
    for seed in [0xDEC0DE_u64, 0x5EED] {
        let d = decode_inputs(STEPS, seed);
        let cpu = cpu_decode(&d);
        let two = gpu_decode(&g, &d, false, false);
        let fused = gpu_decode(&g, &d, true, true);
        // without the count (warp 0 stores its state with the others): the same bits
        let uncounted = gpu_decode(&g, &d, true, false);
        for (t, (a, b)) in fused.iter().zip(&uncounted).enumerate() {
            let same =
                |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same(&a.0, &b.0) && same(&a.1, &b.1),
                "seed {seed:#x} step {t}: counted and uncounted decode differ"
            );
        }
        let mut prev = d.x.s0.clone();
        for (t, ((c, r), f)) in cpu.iter().zip(&two).zip(&fused).enumerate() {
            assert!(
                f.0.iter().chain(&f.1).all(|v| v.is_finite()),
                "seed {seed:#x} step {t}: non-finite output or state"
            );
            // not a degenerate test: outputs of size, a state that moves each step
            let max_out = c.0.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(max_out > 0.1, "degenerate test: max |out| {max_out}");
            let moved = rel_l2(&c.1, &prev);
            assert!(
                moved > 1e-2,
                "degenerate test: the state moved by {moved:.2e}"
            );
            prev.clone_from(&c.1);

            let (eo_cpu, es_cpu) = (rel_l2(&f.0, &c.0), rel_l2(&f.1, &c.1));
            let (eo_gpu, es_gpu) = (rel_l2(&f.0, &r.0), rel_l2(&f.1, &r.1));
            eprintln!(
                "seed {seed:#x} step {t}: gdn_decode vs CPU: out {eo_cpu:.2e}, S {es_cpu:.2e}; \
                 vs recurrent + gated_rmsnorm kernels: out {eo_gpu:.2e}, S {es_gpu:.2e}"
            );
            assert!(
                eo_cpu < TOL_DEC_OUT_CPU,
                "step {t}: out vs CPU, rel L2 {eo_cpu:.3e}"
            );
            assert!(
                es_cpu < TOL_DEC_S,
                "step {t}: state vs CPU, rel L2 {es_cpu:.3e}"
            );
            assert!(
                eo_gpu < TOL_DEC_OUT_GPU,
                "step {t}: out vs the two-kernel path, rel L2 {eo_gpu:.3e}"
            );
            assert!(
                es_gpu < TOL_DEC_S,
                "step {t}: state vs the two-kernel path, rel L2 {es_gpu:.3e}"
            );
        }
    }
}

#[test]
fn decode_output_depends_on_the_state() {
    // The comparison can fail: from another initial state the output differs.
    let Some(g) = gpu() else { return };
    let d = decode_inputs(1, 11);
    let mut e = decode_inputs(1, 11);
    e.x.s0 = random_nonzero(HV * DK * DV, 12, 0.0, 0.5);
    let (a, b) = (
        gpu_decode(&g, &d, true, true),
        gpu_decode(&g, &e, true, true),
    );
    assert!(rel_l2(&b[0].0, &a[0].0) > 1e-2);
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
