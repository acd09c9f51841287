//! GPU sampling (kernels/sampling.cu through
//! `lily_cuda::kernels::sampling::sample_into`) against the one definition of
//! the sampler's math, `lily_model::sampling` (`argmax`, `kept`, `pick`,
//! `pick_in_order`), which the engine's CPU sampler uses too. Every GPU test is
//! ignored without `--include-ignored` (support's module comment says why).

mod support;

use lily_cuda::gpu::{DevBuf, Gpu};
use lily_cuda::kernels::sampling::{sample_into, uniform_f32, GpuSampleParams};
use lily_model::sampling::{argmax, kept, pick, pick_in_order};
use support::gpu;

const V: usize = 248_320;
const VALID: usize = 248_077;

/// Draws that may differ from the oracle's draw for the same u: one in 200
/// (f32 GPU sums against f64 host sums flip a draw sitting on a boundary).
const MAX_DIFFER_PER: usize = 200;
/// Frequency tolerance: this many standard deviations of a binomial count
/// (two-sided, a false alarm about once in 1.7 million buckets) ...
const FREQ_SIGMAS: f64 = 5.0;
/// ... plus this many draws, for the rounding of a small count.
const FREQ_SLACK_DRAWS: f64 = 2.0;
/// How far below the min-p floor a kept logit may sit: f32 logits against
/// the f64 floor `12 + ln(min_p)`.
const MIN_P_FLOOR_SLACK: f32 = 1e-4;

/// splitmix64: test data and draws, repeatable.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let (a, b) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
    }
}

/// Random LLM-like logits: a normal bulk (never exactly zero), a few dozen
/// strong tokens, and padding rows (ids >= VALID) far above everything.
fn llm_logits(seed: u64, sigma: f32, peaks: usize) -> Vec<f32> {
    let mut r = Rng(seed);
    let mut l: Vec<f32> = (0..V)
        .map(|_| {
            let x = sigma * r.normal();
            if x == 0.0 {
                1e-3
            } else {
                x
            }
        })
        .collect();
    for j in 0..peaks {
        let i = (r.next() % VALID as u64) as usize;
        l[i] = 8.0 + 10.0 * r.uniform() as f32 + j as f32 * 0.01;
    }
    for x in &mut l[VALID..] {
        *x = 1.0e4;
    }
    l
}

/// The oracle's kept set over the real tokens (ids < VALID): ids best first
/// (logit desc, id asc) and their probabilities, normalised over the kept ones.
fn kept_real(l: &[f32], p: &GpuSampleParams) -> (Vec<u32>, Vec<f64>) {
    kept(&l[..VALID], p.temperature, p.top_k, p.top_p, p.min_p)
}

struct Dev {
    gpu: Gpu,
    logits: DevBuf,
    out: DevBuf,
    valid: usize,
}

impl Dev {
    fn new(gpu: Gpu, logits: &[f32]) -> Dev {
        let buf = gpu.upload_new(logits).unwrap();
        let out = gpu.alloc(4).unwrap();
        Dev {
            gpu,
            logits: buf,
            out,
            valid: VALID,
        }
    }
    fn set(&mut self, logits: &[f32]) {
        assert!(logits.len() * 4 <= self.logits.bytes);
        self.gpu.upload(self.logits.ptr, logits).unwrap();
    }
    fn pick(&self, p: &GpuSampleParams, u: f32) -> u32 {
        self.gpu.upload(self.out.ptr, &[-1i32]).unwrap();
        sample_into(&self.gpu, self.logits.ptr, self.valid, p, u, self.out.ptr).unwrap();
        let id = self.gpu.download::<i32>(self.out.ptr, 1).unwrap()[0];
        assert!(
            id >= 0 && (id as usize) < self.valid,
            "id {id} out of range (valid {})",
            self.valid
        );
        id as u32
    }
}

/// `n` draws with u from a seeded generator; returns (u as the kernel saw it, id).
fn draws(dev: &Dev, p: &GpuSampleParams, n: usize, seed: u64) -> Vec<(f32, u32)> {
    let mut r = Rng(seed);
    (0..n)
        .map(|_| {
            let u = uniform_f32(r.uniform());
            (u, dev.pick(p, u))
        })
        .collect()
}

/// Empirical frequencies against the oracle's probabilities. Each kept token
/// (or, for many kept tokens, each run of consecutive kept ids holding about
/// 5% of the mass) must be within `FREQ_SIGMAS` standard deviations +
/// `FREQ_SLACK_DRAWS` / n of its probability.
fn check_frequencies(what: &str, picks: &[(f32, u32)], kept: &(Vec<u32>, Vec<f64>)) {
    let n = picks.len() as f64;
    let mut pairs: Vec<(u32, f64)> = kept.0.iter().copied().zip(kept.1.iter().copied()).collect();
    pairs.sort_by_key(|x| x.0);
    let mut buckets: Vec<(u32, u32, f64)> = Vec::new(); // (first id, last id, probability)
    for (id, q) in pairs {
        match buckets.last_mut() {
            Some(b) if kept.0.len() > 64 && b.2 < 0.05 => {
                b.1 = id;
                b.2 += q;
            }
            _ => buckets.push((id, id, q)),
        }
    }
    for (lo, hi, q) in &buckets {
        let c = picks.iter().filter(|(_, id)| id >= lo && id <= hi).count() as f64;
        let tol = FREQ_SIGMAS * (q * (1.0 - q) / n).sqrt() + FREQ_SLACK_DRAWS / n;
        assert!(
            (c / n - q).abs() <= tol,
            "{what}: ids {lo}..={hi} drawn {:.4}, expected {:.4} (tolerance {:.4})",
            c / n,
            q,
            tol
        );
    }
}

/// Draws must all be kept tokens, each the oracle's draw for the same u (best
/// first, or by id on the wide path: `id_order`) but for at most one in
/// `MAX_DIFFER_PER` (rounding flips at a boundary), at the oracle's frequencies.
fn check_draws(what: &str, picks: &[(f32, u32)], kept: &(Vec<u32>, Vec<f64>), id_order: bool) {
    let set: std::collections::HashSet<u32> = kept.0.iter().copied().collect();
    let mut by_id: Vec<(u32, f64)> = kept.0.iter().copied().zip(kept.1.iter().copied()).collect();
    by_id.sort_by_key(|x| x.0);
    let mut differ = 0;
    for &(u, id) in picks {
        assert!(
            set.contains(&id),
            "{what}: drew {id} (u = {u}), not among the {} kept tokens",
            set.len()
        );
        let want = if id_order {
            pick_in_order(by_id.iter().copied(), u as f64)
        } else {
            pick(kept, u as f64)
        };
        if want != id {
            differ += 1;
        }
    }
    assert!(
        differ <= picks.len() / MAX_DIFFER_PER,
        "{what}: {differ} of {} draws differ from the host's draw for the same u",
        picks.len()
    );
    check_frequencies(what, picks, kept);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_and_top_k_1_match_host_argmax() {
    let gpu = gpu();
    let mut dev = Dev::new(gpu, &llm_logits(1, 2.0, 30));
    for seed in 1..6u64 {
        let mut l = llm_logits(seed, 2.0 + seed as f32, if seed % 2 == 0 { 0 } else { 30 });
        l[(seed as usize * 7919) % VALID] = f32::NAN;
        dev.set(&l);
        let want = argmax(&l[..VALID]);
        assert_eq!(
            dev.pick(&GpuSampleParams::greedy(), 0.3),
            want,
            "greedy, seed {seed}"
        );
        let p = GpuSampleParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
        };
        assert_eq!(dev.pick(&p, 0.99), want, "top_k = 1, seed {seed}");
        // a tiny temperature is greedy in all but name
        let p = GpuSampleParams {
            temperature: 1e-4,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        };
        assert_eq!(dev.pick(&p, 0.5), want, "T = 1e-4, seed {seed}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_k_20_stays_in_the_host_top_20() {
    let gpu = gpu();
    let l = llm_logits(11, 2.5, 40);
    let mut dev = Dev::new(gpu, &l);
    for (t, top_p) in [(1.0f32, 1.0f32), (0.7, 0.95), (1.3, 0.8)] {
        let p = GpuSampleParams {
            temperature: t,
            top_k: 20,
            top_p,
            min_p: 0.0,
        };
        let kept = kept_real(&l, &p);
        assert!(kept.0.len() <= 20);
        let picks = draws(&dev, &p, 2000, 100 + (t * 10.0) as u64);
        check_draws(
            &format!("top_k 20, T {t}, top_p {top_p}"),
            &picks,
            &kept,
            false,
        );
    }
    // Qwen's thinking-mode defaults over fresh logits
    for seed in 20..24u64 {
        let l = llm_logits(seed, 3.0, 20);
        dev.set(&l);
        let p = GpuSampleParams {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
        };
        let kept = kept_real(&l, &p);
        let picks = draws(&dev, &p, 500, seed);
        let top20: std::collections::HashSet<u32> =
            kept_real(&l, &GpuSampleParams { top_p: 1.0, ..p })
                .0
                .into_iter()
                .collect();
        assert!(
            picks.iter().all(|(_, id)| top20.contains(id)),
            "seed {seed}: drew outside the top 20"
        );
        check_draws(&format!("qwen defaults, seed {seed}"), &picks, &kept, false);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn strong_tokens_crowded_on_one_thread() {
    let gpu = gpu();
    // The kernel first tries each thread's own best four tokens; thread 0
    // reads ids 0..4 + 4096 m: put a dozen of the best tokens there so that
    // shortcut cannot hold the top k and the full compaction pass runs.
    let mut l = llm_logits(67, 2.0, 10);
    for m in 0..3 {
        for c in 0..4 {
            l[4096 * m + c] = 15.0 + (m * 4 + c) as f32 * 0.3;
        }
    }
    let dev = Dev::new(gpu, &l);
    for p in [
        GpuSampleParams {
            temperature: 1.0,
            top_k: 20,
            top_p: 1.0,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
        },
    ] {
        let kept = kept_real(&l, &p);
        let picks = draws(&dev, &p, 1000, 71);
        // without top-k the window may be too wide to sort: then ids are walked in order
        let id_order = picks.iter().any(|&(u, id)| id != pick(&kept, u as f64));
        check_draws(&format!("crowded, {p:?}"), &picks, &kept, id_order);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_p_keeps_only_the_nucleus() {
    let gpu = gpu();
    // Three strong tokens with about 0.30, 0.15 and 0.10 of the mass over a
    // bulk holding 0.45: top_p = 0.5 keeps exactly those three.
    let mut r = Rng(5);
    let mut l: Vec<f32> = (0..V).map(|_| 0.5 * r.normal() + 0.01).collect();
    let bulk: f64 = l[..VALID].iter().map(|&x| (x as f64).exp()).sum();
    let strong = [(1234usize, 0.30f64), (200_000, 0.15), (77, 0.10)];
    for (i, q) in strong {
        l[i] = ((q / 0.45) * bulk).ln() as f32;
    }
    for x in &mut l[VALID..] {
        *x = 50.0;
    }
    let dev = Dev::new(gpu, &l);
    let p = GpuSampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.5,
        min_p: 0.0,
    };
    let kept = kept_real(&l, &p);
    assert_eq!(kept.0, vec![1234, 200_000, 77]);
    let picks = draws(&dev, &p, 2000, 7);
    check_draws("nucleus of 3", &picks, &kept, false);
    // with top-k on as well
    let p = GpuSampleParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.5,
        min_p: 0.0,
    };
    let picks = draws(&dev, &p, 500, 8);
    check_draws("nucleus of 3, top_k 50", &picks, &kept_real(&l, &p), false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_p_over_a_flat_distribution_uses_the_wide_path() {
    let gpu = gpu();
    // A nucleus of tens of thousands of tokens: thresholds found in global
    // memory, draws walk ids in order.
    let mut r = Rng(9);
    let mut l: Vec<f32> = (0..V).map(|_| r.normal() + 1e-3).collect();
    for x in &mut l[VALID..] {
        *x = f32::INFINITY;
    }
    let dev = Dev::new(gpu, &l);
    for (t, top_p) in [(1.0f32, 0.5f32), (0.8, 0.9), (1.0, 1.0)] {
        let p = GpuSampleParams {
            temperature: t,
            top_k: 0,
            top_p,
            min_p: 0.0,
        };
        let kept = kept_real(&l, &p);
        assert!(
            kept.0.len() > 4096,
            "the nucleus should not fit the fast path"
        );
        let picks = draws(&dev, &p, 2000, 31);
        check_draws(&format!("flat, T {t}, top_p {top_p}"), &picks, &kept, true);
        // the draw walks ids in order: a larger u never gives a smaller id
        let mut sorted = picks.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            sorted.windows(2).all(|w| w[0].1 <= w[1].1),
            "ids not monotone in u"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn large_top_k_uses_the_wide_path() {
    let gpu = gpu();
    let l = llm_logits(17, 1.5, 10);
    let dev = Dev::new(gpu, &l);
    for (k, top_p) in [(3000usize, 1.0f32), (5000, 0.9), (1024, 1.0), (1500, 0.7)] {
        let p = GpuSampleParams {
            temperature: 1.0,
            top_k: k,
            top_p,
            min_p: 0.0,
        };
        let kept = kept_real(&l, &p);
        let picks = draws(&dev, &p, 2000, k as u64);
        let topk: std::collections::HashSet<u32> =
            kept_real(&l, &GpuSampleParams { top_p: 1.0, ..p })
                .0
                .into_iter()
                .collect();
        assert!(
            picks.iter().all(|(_, id)| topk.contains(id)),
            "top_k {k}: drew outside the top k"
        );
        // k <= 1024 with a window that fits sorts like the CPU; otherwise id order
        let id_order = picks.iter().any(|&(u, id)| id != pick(&kept, u as f64));
        check_draws(
            &format!("top_k {k}, top_p {top_p}"),
            &picks,
            &kept,
            id_order,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn min_p_excludes_low_tokens() {
    let gpu = gpu();
    let mut l = llm_logits(23, 2.0, 0);
    // a handful of tokens near the top, spaced by 0.7 in logit
    for j in 0..8 {
        l[1000 + 31 * j] = 12.0 - 0.7 * j as f32;
    }
    let mut dev = Dev::new(gpu, &l);
    for (min_p, top_k) in [(0.1f32, 0usize), (0.3, 0), (0.1, 20), (1.0, 0)] {
        let p = GpuSampleParams {
            temperature: 1.0,
            top_k,
            top_p: 1.0,
            min_p,
        };
        let kept = kept_real(&l, &p);
        let floor = 12.0 + min_p.ln();
        assert!(kept
            .0
            .iter()
            .all(|&i| l[i as usize] >= floor - MIN_P_FLOOR_SLACK));
        let picks = draws(&dev, &p, 2000, 3);
        assert!(
            picks
                .iter()
                .all(|&(_, id)| l[id as usize] >= floor - MIN_P_FLOOR_SLACK),
            "min_p {min_p}: drew below the floor"
        );
        check_draws(
            &format!("min_p {min_p}, top_k {top_k}"),
            &picks,
            &kept,
            false,
        );
    }
    // all three together, fresh logits
    let l = llm_logits(29, 3.0, 40);
    dev.set(&l);
    let p = GpuSampleParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.05,
    };
    let picks = draws(&dev, &p, 2000, 4);
    check_draws(
        "T 0.8, top_k 50, top_p 0.9, min_p 0.05",
        &picks,
        &kept_real(&l, &p),
        false,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn padding_and_nan_are_never_chosen() {
    let gpu = gpu();
    let mut l = llm_logits(37, 1.0, 0);
    for x in &mut l[VALID..] {
        *x = 1.0e30;
    }
    // NaN on the would-be best tokens
    for j in 0..16 {
        l[5000 + j * 1001] = f32::NAN;
    }
    let dev = Dev::new(gpu, &l);
    for p in [
        GpuSampleParams::greedy(),
        GpuSampleParams {
            temperature: 1.0,
            top_k: 20,
            top_p: 1.0,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 2.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 4000,
            top_p: 1.0,
            min_p: 0.0,
        },
    ] {
        for (u, id) in draws(&dev, &p, 300, 41) {
            assert!(
                (id as usize) < VALID && !l[id as usize].is_nan(),
                "{p:?}: drew {id} at u = {u}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn same_u_gives_the_same_id() {
    let gpu = gpu();
    let l = llm_logits(43, 2.0, 25);
    let dev = Dev::new(gpu, &l);
    for p in [
        GpuSampleParams {
            temperature: 1.0,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 0.9,
            top_k: 2000,
            top_p: 0.8,
            min_p: 0.01,
        },
    ] {
        for (u, id) in draws(&dev, &p, 40, 47) {
            for _ in 0..5 {
                assert_eq!(dev.pick(&p, u), id, "{p:?} at u = {u}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn small_and_degenerate_vocabularies() {
    let gpu = gpu();
    let mut dev = Dev::new(gpu, &vec![0.5f32; V]);
    // fewer real tokens than threads
    let mut r = Rng(53);
    let mut l: Vec<f32> = (0..64).map(|_| 2.0 * r.normal()).collect();
    l[40..].iter_mut().for_each(|x| *x = 1e9);
    dev.valid = 37;
    dev.set(&l);
    let p = GpuSampleParams {
        temperature: 1.0,
        top_k: 5,
        top_p: 0.9,
        min_p: 0.0,
    };
    let kept37 = kept(&l[..37], p.temperature, p.top_k, p.top_p, p.min_p);
    check_draws(
        "37 tokens, top_k 5",
        &draws(&dev, &p, 2000, 59),
        &kept37,
        false,
    );
    // all NaN: 0; one +inf: that token; -inf everywhere but NaN: the first real one
    dev.valid = 100;
    let mut l = vec![f32::NAN; 128];
    dev.set(&l);
    let p = GpuSampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };
    assert_eq!(dev.pick(&p, 0.5), 0);
    l[17] = f32::INFINITY;
    l[3] = 1.0;
    dev.set(&l);
    assert_eq!(dev.pick(&p, 0.9), 17);
    let mut l = vec![f32::NEG_INFINITY; 128];
    l[0] = f32::NAN;
    dev.set(&l);
    assert_eq!(dev.pick(&p, 0.9), 1);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn queued_draws_match_single_draws() {
    // As the decode loop launches them: many draws queued on the stream with
    // no sync between them, each into its own slot, must each give the id a
    // lone draw gives for the same u. (Also prints the time per queued draw.)
    let gpu = gpu();
    let l = llm_logits(61, 3.0, 30);
    let dev = Dev::new(gpu, &l);
    let n = 200;
    let outs = dev.gpu.alloc(n * 4).unwrap();
    for p in [
        GpuSampleParams::greedy(),
        GpuSampleParams {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.05,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        },
        GpuSampleParams {
            temperature: 1.0,
            top_k: 3000,
            top_p: 0.9,
            min_p: 0.0,
        },
    ] {
        let u = |i: usize| (i as f32 + 0.5) / n as f32;
        dev.gpu.upload(outs.ptr, &vec![-1i32; n]).unwrap();
        dev.pick(&p, 0.5); // warm-up
        let t0 = std::time::Instant::now();
        for i in 0..n {
            sample_into(&dev.gpu, dev.logits.ptr, VALID, &p, u(i), outs.at(4 * i)).unwrap();
        }
        dev.gpu.sync().unwrap();
        println!(
            "{p:?}: {:.1} us per queued draw",
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        );
        let ids: Vec<i32> = dev.gpu.download(outs.ptr, n).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(
                id,
                dev.pick(&p, u(i)) as i32,
                "{p:?}: queued draw {i} (u = {})",
                u(i)
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_are_rejected_before_launch() {
    let gpu = gpu();
    let dev = Dev::new(gpu, &llm_logits(71, 2.0, 10));
    let ok = GpuSampleParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        min_p: 0.05,
    };
    let bad = [
        GpuSampleParams {
            temperature: -1.0,
            ..ok
        },
        GpuSampleParams {
            temperature: f32::NAN,
            ..ok
        },
        GpuSampleParams {
            temperature: f32::INFINITY,
            ..ok
        },
        GpuSampleParams { top_p: 0.0, ..ok },
        GpuSampleParams { top_p: 1.5, ..ok },
        GpuSampleParams {
            top_p: f32::NAN,
            ..ok
        },
        GpuSampleParams { min_p: -0.1, ..ok },
        GpuSampleParams { min_p: 1.5, ..ok },
        // greedy settings are checked as well
        GpuSampleParams {
            top_p: 0.0,
            ..GpuSampleParams::greedy()
        },
    ];
    dev.gpu.upload(dev.out.ptr, &[-1i32]).unwrap();
    for p in &bad {
        assert!(
            sample_into(&dev.gpu, dev.logits.ptr, VALID, p, 0.5, dev.out.ptr).is_err(),
            "{p:?} accepted"
        );
    }
    for valid in [0, (i32::MAX / 2) as usize + 1] {
        for p in [ok, GpuSampleParams::greedy()] {
            assert!(
                sample_into(&dev.gpu, dev.logits.ptr, valid, &p, 0.5, dev.out.ptr).is_err(),
                "{valid} logits accepted ({p:?})"
            );
        }
    }
    dev.gpu.sync().unwrap();
    // nothing was launched: the output is untouched
    assert_eq!(dev.gpu.download::<i32>(dev.out.ptr, 1).unwrap()[0], -1);
    // and the settings accepted still draw
    assert!(kept_real(&llm_logits(71, 2.0, 10), &ok)
        .0
        .contains(&dev.pick(&ok, 0.5)));
}
