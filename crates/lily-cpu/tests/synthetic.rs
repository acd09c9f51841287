//! The built-in synthetic models: activations stay finite through every layer,
//! and the state carries a sequence across calls (prefill in pieces, decode)
//! to the same result as one prefill.

use lily_cpu::ops::gdn::GdnForm;
use lily_cpu::{CpuModel, Logits};
use lily_model::ModelSource;

fn model(name: &str) -> CpuModel {
    let (cfg, w) = ModelSource::Synthetic(name.into()).load().unwrap();
    CpuModel::new(cfg, w)
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + 12345) % vocab as u64) as u32)
        .collect()
}

/// Every tapped activation finite and of sane size; returns the last layer's RMS.
fn check_finite(m: &CpuModel, toks: &[u32]) -> f32 {
    let mut st = m.new_state();
    let mut worst = 0f32;
    let mut bad = Vec::new();
    let logits = m
        .forward(
            toks,
            &mut st,
            Logits::All,
            GdnForm::Chunked,
            &mut |name, x| {
                let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
                if !rms.is_finite() || x.iter().any(|v| !v.is_finite()) {
                    bad.push(name.to_string());
                }
                if name.ends_with(".out") {
                    worst = worst.max(rms);
                }
            },
        )
        .unwrap();
    assert!(bad.is_empty(), "non-finite activations at {bad:?}");
    assert!(logits.iter().all(|v| v.is_finite()));
    let spread = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        spread > 0.1 && spread < 1e3,
        "logits degenerate: max |logit| {spread}"
    );
    worst
}

#[test]
fn tiny_activations_finite() {
    let m = model("tiny");
    let rms = check_finite(&m, &tokens(200, m.cfg.vocab_size));
    assert!(rms < 100.0, "residual stream grows too fast: rms {rms}");
}

#[test]
fn full_geometry_activations_finite_through_40_layers() {
    let m = model("full");
    assert_eq!(m.cfg.num_layers(), 40);
    let rms = check_finite(&m, &tokens(2, m.cfg.vocab_size));
    assert!(rms < 100.0, "residual stream grows too fast: rms {rms}");
}

#[test]
fn state_continues_across_calls() {
    // f32 activations: the pieces must agree to rounding, not to bf16 chaos.
    let m = model("tiny").with_f32_activations();
    let toks = tokens(150, m.cfg.vocab_size);
    let v = m.cfg.vocab_size;
    let mut st = m.new_state();
    let whole = m.prefill(&toks, &mut st, Logits::All).unwrap();
    // the same sequence as three prefills (cut mid-chunk) and two decodes
    let mut st = m.new_state();
    let mut parts = m.prefill(&toks[..37], &mut st, Logits::All).unwrap();
    parts.extend(m.prefill(&toks[37..140], &mut st, Logits::All).unwrap());
    parts.extend(m.prefill(&toks[140..148], &mut st, Logits::All).unwrap());
    for &t in &toks[148..] {
        parts.extend(m.decode(t, &mut st).unwrap());
    }
    assert_eq!(st.pos, 150);
    assert_eq!(parts.len(), whole.len());
    let max = whole.iter().fold(0f32, |a, x| a.max(x.abs()));
    let mut agree = 0;
    for i in 0..toks.len() {
        let (a, b) = (&whole[i * v..(i + 1) * v], &parts[i * v..(i + 1) * v]);
        let am = (0..v).fold(0, |m, j| if a[j] > a[m] { j } else { m });
        let bm = (0..v).fold(0, |m, j| if b[j] > b[m] { j } else { m });
        agree += (am == bm) as usize;
    }
    let diff = whole
        .iter()
        .zip(&parts)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(diff <= 1e-4 * max, "max diff {diff} vs max |logit| {max}");
    assert_eq!(agree, toks.len(), "top-1 agreement {agree}/{}", toks.len());
}
