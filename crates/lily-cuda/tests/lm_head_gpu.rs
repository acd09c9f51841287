//! The screened greedy lm_head (kernels/lm_head.cu, `lily_cuda::kernels::lm_head`)
//! against the full bf16 product's greedy choice (`greedy_lm_head`), on fresh
//! random heads and inputs. The contract is exact: the same id, bit for bit,
//! so there is no tolerance. Needs a GPU: ignored without one, never passed.

mod support;

use lily_cuda::kernels::lm_head::{HeadScreen, SCREEN_HIDDEN};
use lily_cuda::kernels::sampling::{greedy_finish, greedy_lm_head};
use support::{bf16_bits, gpu, random_mixed as random};

/// The most candidates (rows whose bound reaches the threshold) the screen
/// may leave, as a fraction of the rows: for random inputs a real screen
/// leaves a handful, so 1% already means it screens almost nothing.
const MAX_CANDIDATE_FRACTION: f64 = 0.01;

/// The screened greedy lm_head (`lily_cuda::kernels::lm_head::HeadScreen`: an int8
/// copy bounds every logit, only the rows that can hold the maximum are
/// computed exactly) against the full product's choice (`greedy_lm_head`):
/// the same id on fresh random heads and inputs; an exact tie (the strongest
/// row copied to a higher and a lower id: the lowest wins); a near tie (the
/// copy one bf16 step weaker in one weight, at a lower id); inputs scaled by
/// 1e-3 and 1e3; `valid` below the vocabulary; a NaN weight and an infinite
/// one (rows without a finite bound are always candidates). The screen's
/// threshold must be set by the step (a real screen, not every row) and
/// cleared by `greedy_finish`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn screened_greedy_matches_the_full_argmax() {
    let g = gpu();
    // not a multiple of the screen's 16 rows nor of the pick's 1024
    let (n, k) = (20_011usize, SCREEN_HIDDEN);
    let (best, next, pos, valid_buf) = (
        g.alloc(8).unwrap(),
        g.alloc(4).unwrap(),
        g.alloc(4).unwrap(),
        g.alloc(4).unwrap(),
    );
    g.zero(best.ptr, 8).unwrap();
    g.upload(pos.ptr, &[0i32]).unwrap();
    // (full id, screened id, the threshold as the screen left it); the
    // screen must have left few candidates (hi >= the threshold) for random x
    let choose = |w: &[f32], x: &[f32], valid: usize| -> (i32, i32, u32) {
        let wb = g.upload_new(&bf16_bits(w)).unwrap();
        let xb = g.upload_new(&bf16_bits(x)).unwrap();
        let y = g.alloc(n * 4).unwrap();
        g.upload(valid_buf.ptr, &[valid as i32]).unwrap();
        greedy_lm_head(&g, &wb, xb.ptr, y.ptr, n, k, valid_buf.ptr, best.ptr).unwrap();
        greedy_finish(&g, best.ptr, next.ptr, pos.ptr, 0, 0, 0).unwrap();
        let full = g.download::<i32>(next.ptr, 1).unwrap()[0];
        let hs = HeadScreen::build(&g, &wb, n).unwrap();
        g.upload(next.ptr, &[-1i32]).unwrap();
        hs.launch(&g, &wb, xb.ptr, valid_buf.ptr, best.ptr).unwrap();
        let thr = g.download::<u32>(hs.threshold(), 1).unwrap()[0];
        if thr != 0 {
            // the threshold back as a float (order_key's inverse)
            let t = f32::from_bits(if thr & 0x8000_0000 != 0 {
                thr & 0x7fff_ffff
            } else {
                !thr
            });
            let hi = g.download::<f32>(hs.hi_ptr(), valid.min(n)).unwrap();
            let cands = hi.iter().filter(|&&h| h >= t).count();
            let most = (MAX_CANDIDATE_FRACTION * n as f64) as usize;
            assert!(
                (1..=most).contains(&cands),
                "{cands} candidates of {valid} (at most {most})"
            );
        }
        greedy_finish(&g, best.ptr, next.ptr, pos.ptr, 0, 0, hs.threshold()).unwrap();
        let screened = g.download::<i32>(next.ptr, 1).unwrap()[0];
        assert_eq!(
            g.download::<u32>(hs.threshold(), 1).unwrap()[0],
            0,
            "threshold cleared"
        );
        assert_eq!(
            g.download::<u64>(best.ptr, 1).unwrap()[0],
            0,
            "best cleared"
        );
        (full, screened, thr)
    };
    for trial in 0..4u64 {
        let mut w = random(n * k, 700 + trial, 0.0, 0.02);
        let x = random(k, 800 + trial, 0.0, 1.0);
        let (full, screened, thr) = choose(&w, &x, n);
        assert_eq!(screened, full, "trial {trial}: random head");
        assert_ne!(thr, 0, "trial {trial}: no threshold");
        let top = full as usize;
        for scale in [1e-3f32, 1e3] {
            let xs: Vec<f32> = x.iter().map(|v| v * scale).collect();
            let (full, screened, _) = choose(&w, &xs, n);
            assert_eq!(screened, full, "trial {trial}: x scaled by {scale}");
        }
        let valid = n - 3_000 - 97 * trial as usize;
        let (below, screened, _) = choose(&w, &x, valid);
        assert!((below as usize) < valid);
        assert_eq!(screened, below, "trial {trial}: valid {valid}");
        // ties: the strongest row copied to a lower and a higher id
        let row: Vec<f32> = w[top * k..(top + 1) * k].to_vec();
        let (lower, higher) = ((top + 7_919) % n, (top + 11_113) % n);
        let (lower, higher) = (lower.min(higher), lower.max(higher));
        for r in [lower, higher] {
            w[r * k..(r + 1) * k].copy_from_slice(&row);
        }
        let (full, screened, _) = choose(&w, &x, n);
        assert_eq!(
            full as usize,
            lower.min(top),
            "trial {trial}: tie to the lowest id"
        );
        assert_eq!(screened, full, "trial {trial}: exact tie");
        // a near tie: the lowest copy one bf16 step weaker where x is largest
        let i = (0..k)
            .max_by(|&a, &b| x[a].abs().total_cmp(&x[b].abs()))
            .unwrap();
        let r = lower.min(top);
        let v = w[r * k + i];
        let bits = bf16_bits(&[v])[0];
        let step = if (v > 0.0) == (x[i] > 0.0) {
            bits.wrapping_sub(1)
        } else {
            bits.wrapping_add(1)
        };
        w[r * k + i] = f32::from_bits((step as u32) << 16);
        let (full, screened, _) = choose(&w, &x, n);
        assert_eq!(screened, full, "trial {trial}: near tie");
        // a NaN weight in the winner, an infinite one elsewhere
        if trial == 3 {
            let winner = full as usize;
            w[winner * k + 5] = f32::NAN;
            let (full2, screened2, _) = choose(&w, &x, n);
            assert_ne!(full2 as usize, winner, "a NaN row never wins");
            assert_eq!(screened2, full2, "NaN row");
            let r = (winner + 3) % n;
            w[r * k + 9] = if x[9] > 0.0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            };
            let (full3, screened3, _) = choose(&w, &x, n);
            assert_eq!(full3 as usize, r, "the infinite logit wins");
            assert_eq!(screened3, full3, "infinite weight");
        }
    }
}
