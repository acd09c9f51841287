//! The chunked GDN (prefill) and the recurrent GDN (decode) compute the same
//! recurrence: checked on random inputs, across chunk boundaries, from a
//! non-zero initial state, with Hv/Hk > 1 and Dk != Dv.

use lily_cpu::ops::gdn::{l2norm_rows, GdnCore, GdnForm, CHUNK};

/// Small deterministic generator (xorshift) so the test needs no crate.
struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn check(t: usize, hk: usize, hv: usize, dk: usize, dv: usize, seed: u64) {
    let mut rng = Rng(seed);
    let mut q = rng.vec(t * hk * dk, 1.0);
    let mut k = rng.vec(t * hk * dk, 1.0);
    l2norm_rows(&mut q, dk, (dk as f32).powf(-0.5));
    l2norm_rows(&mut k, dk, 1.0);
    let v = rng.vec(t * hv * dv, 1.0);
    // log-decays spanning slow (-0.01) to fast (-3) forgetting
    let g: Vec<f32> = (0..t * hv).map(|_| -0.01 - 1.5 * (rng.f() + 1.0)).collect();
    let beta: Vec<f32> = (0..t * hv).map(|_| 0.5 + 0.5 * rng.f()).collect();
    let s0 = rng.vec(hv * dk * dv, 0.5);
    let core = GdnCore {
        t,
        hk,
        hv,
        dk,
        dv,
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
    };
    let (mut s_rec, mut s_chk) = (s0.clone(), s0.clone());
    let o_rec = core.run(&mut s_rec, GdnForm::Recurrent);
    let o_chk = core.run(&mut s_chk, GdnForm::Chunked);
    let max_o = o_rec.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff_o = o_rec
        .iter()
        .zip(&o_chk)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let max_s = s_rec.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff_s = s_rec
        .iter()
        .zip(&s_chk)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_o > 0.05, "degenerate test: outputs near zero");
    // f32 in both forms; the UT solve reorders sums. 1e-4 relative is ~100x the
    // observed difference and ~1000x below any algebraic mistake.
    assert!(
        diff_o <= 1e-4 * max_o.max(1.0),
        "output: max diff {diff_o} (max |o| {max_o}) T={t}"
    );
    assert!(
        diff_s <= 1e-4 * max_s.max(1.0),
        "state: max diff {diff_s} (max |S| {max_s}) T={t}"
    );
}

#[test]
fn chunked_equals_recurrent_across_chunks() {
    for (i, t) in [1, 7, CHUNK, CHUNK + 1, 2 * CHUNK + 37]
        .into_iter()
        .enumerate()
    {
        check(t, 2, 4, 16, 24, 17 + i as u64);
    }
}

#[test]
fn chunked_equals_recurrent_head_ratios() {
    check(150, 3, 3, 8, 8, 5);
    check(150, 2, 6, 12, 20, 6);
}

#[test]
fn chunked_detects_a_wrong_state() {
    // The comparison must be able to fail: a different initial state gives
    // different outputs.
    let (t, hk, hv, dk, dv) = (70, 1, 2, 8, 8);
    let mut rng = Rng(99);
    let mut q = rng.vec(t * hk * dk, 1.0);
    let mut k = rng.vec(t * hk * dk, 1.0);
    l2norm_rows(&mut q, dk, (dk as f32).powf(-0.5));
    l2norm_rows(&mut k, dk, 1.0);
    let v = rng.vec(t * hv * dv, 1.0);
    let g = vec![-0.05f32; t * hv];
    let beta = vec![0.7f32; t * hv];
    let core = GdnCore {
        t,
        hk,
        hv,
        dk,
        dv,
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
    };
    let mut a = vec![0f32; hv * dk * dv];
    let mut b = rng.vec(hv * dk * dv, 1.0);
    let oa = core.run(&mut a, GdnForm::Chunked);
    let ob = core.run(&mut b, GdnForm::Recurrent);
    let diff = oa
        .iter()
        .zip(&ob)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff > 1e-2);
}
