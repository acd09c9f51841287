//! The sampling oracle on logits whose kept set and draws are known.

use lily_model::sampling::{argmax, kept, pick, pick_in_order, sample};

/// Equal up to the f32 rounding of the logits.
fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-7)
}

#[test]
fn kept_orders_by_logit_then_id_and_skips_nan() {
    let l = [1.0f32, 2.0, f32::NAN, 2.0, 0.0];
    let (ids, probs) = kept(&l, 1.0, 0, 1.0, 0.0);
    assert_eq!(ids, [1, 3, 0, 4]);
    let e = |x: f64| x.exp();
    let z = 2.0 * e(2.0) + e(1.0) + e(0.0);
    assert!(close(
        &probs,
        &[e(2.0) / z, e(2.0) / z, e(1.0) / z, e(0.0) / z]
    ));
    // top-k 2 keeps the tie at the top, renormalised
    assert_eq!(kept(&l, 1.0, 2, 1.0, 0.0), (vec![1, 3], vec![0.5, 0.5]));
}

#[test]
fn kept_cuts_by_top_p_and_min_p_and_renormalises() {
    // probabilities 0.5, 0.3, 0.2
    let l = [(0.5f32).ln(), (0.3f32).ln(), (0.2f32).ln()];
    let (ids, probs) = kept(&l, 1.0, 0, 0.7, 0.0);
    assert_eq!(ids, [0, 1]);
    assert!(close(&probs, &[0.625, 0.375]), "{probs:?}");
    // min_p 0.5: 0.2 is under half of 0.5
    let (ids, probs) = kept(&l, 1.0, 0, 1.0, 0.5);
    assert_eq!(ids, [0, 1]);
    assert!(close(&probs, &[0.625, 0.375]), "{probs:?}");
    // min_p 1: the best alone
    assert_eq!(kept(&l, 1.0, 0, 1.0, 1.0), (vec![0], vec![1.0]));
}

#[test]
fn greedy_settings_keep_the_argmax() {
    let l = [0.5f32, f32::NAN, 3.0, 3.0];
    assert_eq!(kept(&l, 0.0, 0, 1.0, 0.0), (vec![2], vec![1.0]));
    assert_eq!(kept(&l, 0.8, 1, 1.0, 0.0), (vec![2], vec![1.0]));
    assert_eq!(argmax(&l), 2);
    let none = [f32::NAN; 3];
    assert_eq!(kept(&none, 0.0, 0, 1.0, 0.0), (vec![], vec![]));
    assert_eq!(kept(&none, 1.0, 0, 1.0, 0.0), (vec![], vec![]));
}

#[test]
fn pick_walks_best_first_and_pick_in_order_as_given() {
    let k = (vec![7, 2, 9], vec![0.5, 0.3, 0.2]);
    assert_eq!(pick(&k, 0.0), 7);
    assert_eq!(pick(&k, 0.49), 7);
    assert_eq!(pick(&k, 0.51), 2);
    assert_eq!(pick(&k, 0.81), 9);
    // rounding past the end: the last kept token
    assert_eq!(pick(&k, 1.0), 9);
    assert_eq!(pick(&(vec![], vec![]), 0.5), 0);
    // the same set by id: 2 (0.3), 7 (0.5), 9 (0.2)
    let by_id = [(2, 0.3), (7, 0.5), (9, 0.2)];
    assert_eq!(pick_in_order(by_id, 0.1), 2);
    assert_eq!(pick_in_order(by_id, 0.5), 7);
    assert_eq!(pick_in_order(by_id, 0.9), 9);
}

#[test]
fn sample_draws_only_when_it_chooses_among_candidates() {
    let l = [0.0f32, 1.0, 2.0];
    let no_draw = || -> f64 { panic!("a greedy choice takes no draw") };
    assert_eq!(sample(&l, 0.0, 0, 1.0, 0.0, no_draw), 2);
    assert_eq!(sample(&l, 1.0, 1, 1.0, 0.0, no_draw), 2);
    assert_eq!(sample(&[f32::NAN; 2], 1.0, 0, 1.0, 0.0, no_draw), 0);
    // away from the boundaries, the draw is the kept set's for the same u
    let k = kept(&l, 1.0, 0, 0.9, 0.0);
    let mut acc = 0.0;
    for q in &k.1 {
        for u in [acc + 0.01 * q, acc + 0.99 * q] {
            assert_eq!(sample(&l, 1.0, 0, 0.9, 0.0, || u), pick(&k, u));
        }
        acc += q;
    }
}
