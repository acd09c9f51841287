//! Sampling: each rule checked on logits whose right answer is known.

use lily_engine::sampling::{argmax, GenerationConfig, Sampler, SamplingParams};

fn params(t: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        seed: Some(7),
        ..SamplingParams::greedy()
    }
}

fn counts(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
    let mut c = vec![0; logits.len()];
    for _ in 0..n {
        c[s.sample(logits) as usize] += 1;
    }
    c
}

#[test]
fn greedy_and_padding_rows() {
    let mut l = vec![0.0f32; 12];
    l[3] = 5.0;
    l[11] = 100.0; // a padding row (valid vocab is 10)
    let mut s = Sampler::new(params(0.0), 10, &[]);
    assert_eq!(s.sample(&l), 3);
    let mut s = Sampler::new(params(1.0), 10, &[]);
    assert!(
        counts(&mut s, &l, 2000)[10..].iter().all(|&c| c == 0),
        "padding ids sampled"
    );
}

#[test]
fn seed_makes_runs_repeatable() {
    let l: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let run = |seed| {
        let mut s = Sampler::new(
            SamplingParams {
                seed: Some(seed),
                ..params(1.0)
            },
            50,
            &[],
        );
        (0..64).map(|_| s.sample(&l)).collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

#[test]
fn temperature_follows_softmax() {
    let l = [0.0f32, 1.0, 2.0];
    let mut s = Sampler::new(params(1.0), 3, &[]);
    let n = 60_000;
    let c = counts(&mut s, &l, n);
    let z: f64 = l.iter().map(|x| (*x as f64).exp()).sum();
    for i in 0..3 {
        let want = (l[i] as f64).exp() / z;
        let got = c[i] as f64 / n as f64;
        assert!((got - want).abs() < 0.01, "p[{i}] {got} vs {want}");
    }
    // low temperature sharpens towards the argmax
    let mut s = Sampler::new(params(0.1), 3, &[]);
    assert!(counts(&mut s, &l, 1000)[2] > 990);
}

#[test]
fn top_k_top_p_min_p_restrict_the_candidates() {
    let l = [3.0f32, 2.9, 2.8, 0.0, -1.0, 2.95];
    let mut s = Sampler::new(
        SamplingParams {
            top_k: 2,
            ..params(1.0)
        },
        6,
        &[],
    );
    let c = counts(&mut s, &l, 3000);
    assert!(c[0] > 0 && c[5] > 0 && c[0] + c[5] == 3000, "{c:?}");
    // probabilities 0.5, 0.3, 0.2 (ln-scaled): top_p 0.7 keeps the first two
    let l = [(0.5f32).ln(), (0.3f32).ln(), (0.2f32).ln()];
    let mut s = Sampler::new(
        SamplingParams {
            top_p: 0.7,
            ..params(1.0)
        },
        3,
        &[],
    );
    let c = counts(&mut s, &l, 3000);
    assert!(c[2] == 0 && c[0] > c[1] && c[1] > 0, "{c:?}");
    // min_p 0.5: tokens under half of the best (0.2 < 0.25) are dropped
    let mut s = Sampler::new(
        SamplingParams {
            min_p: 0.5,
            ..params(1.0)
        },
        3,
        &[],
    );
    let c = counts(&mut s, &l, 3000);
    assert!(c[2] == 0 && c[1] > 0, "{c:?}");
}

#[test]
fn penalties() {
    let l = vec![2.0f32, 1.0, -1.0, 0.5];
    let s = Sampler::new(
        SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        },
        4,
        &[0, 2],
    );
    assert_eq!(s.penalized(&l), vec![1.0, 1.0, -2.0, 0.5]);
    let mut s = Sampler::new(
        SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..params(0.0)
        },
        4,
        &[0],
    );
    s.accept(1);
    s.accept(1);
    s.accept(3);
    assert_eq!(
        s.penalized(&l),
        vec![2.0, 1.0 - 0.5 - 0.5, -1.0, 0.5 - 0.5 - 0.25]
    );
    // greedy follows the penalised logits
    let mut s = Sampler::new(
        SamplingParams {
            presence_penalty: 2.0,
            ..params(0.0)
        },
        4,
        &[],
    );
    s.accept(0);
    assert_eq!(s.sample(&l), 1);
}

#[test]
fn invalid_params_are_rejected() {
    for p in [
        SamplingParams {
            temperature: -1.0,
            ..params(1.0)
        },
        SamplingParams {
            top_p: 0.0,
            ..params(1.0)
        },
        SamplingParams {
            min_p: 1.5,
            ..params(1.0)
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..params(1.0)
        },
        SamplingParams {
            presence_penalty: 3.0,
            ..params(1.0)
        },
    ] {
        assert!(p.validate().is_err(), "{p:?}");
    }
}

#[test]
fn generation_config_defaults() {
    let v = serde_json::json!({"do_sample": true, "eos_token_id": [248046, 248044], "temperature": 0.6, "top_k": 20, "top_p": 0.95});
    let g = GenerationConfig::from_json(&v);
    assert_eq!(g.eos_token_ids, vec![248_046, 248_044]);
    assert_eq!(
        (g.sampling.temperature, g.sampling.top_k, g.sampling.top_p),
        (0.6, 20, 0.95)
    );
    let g = GenerationConfig::from_json(&serde_json::json!({"eos_token_id": 7}));
    assert_eq!(g.eos_token_ids, vec![7]);
    assert_eq!(g.sampling.temperature, 0.0, "do_sample false means greedy");
}

/// Greedy picks what the GPU's `argmax_kernel` picks: the lowest id holding
/// the largest logit in `total_cmp` order, never NaN (none but NaN: 0).
#[test]
fn argmax_matches_the_device() {
    assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[-0.0, 0.0, -0.0]), 1);
    assert_eq!(argmax(&[2.0, f32::INFINITY, f32::INFINITY]), 1);
    let mut s = Sampler::new(params(0.0), 4, &[]);
    assert_eq!(s.sample(&[1.0, f32::NAN, 5.0, 5.0, 9.0]), 2); // id 4 is padding
    assert!(s.is_greedy() && s.logits_only() && s.valid_vocab() == 4);
}

/// The draw a backend takes for a sampled choice is the one `sample` takes:
/// one uniform per sampled token from the seeded stream, none when greedy.
#[test]
fn draws_follow_the_seed() {
    let mut a = Sampler::new(params(1.0), 3, &[]);
    let mut b = Sampler::new(params(1.0), 3, &[]);
    let l = [0.0f32, 0.0, 0.0];
    // `sample` over three equal logits picks floor(3u): the same draws
    for _ in 0..32 {
        let u = a.draw();
        assert!((0.0..1.0).contains(&u));
        assert_eq!(b.sample(&l) as f64, (u * 3.0).floor());
    }
    assert!(!a.is_greedy());
    assert!(!Sampler::new(
        SamplingParams {
            presence_penalty: 0.1,
            ..params(1.0)
        },
        3,
        &[]
    )
    .logits_only());
    assert!(!Sampler::new(
        SamplingParams {
            repetition_penalty: 1.1,
            ..params(1.0)
        },
        3,
        &[]
    )
    .logits_only());
    assert!(Sampler::new(
        SamplingParams {
            top_k: 1,
            ..params(1.0)
        },
        3,
        &[]
    )
    .is_greedy());
}
