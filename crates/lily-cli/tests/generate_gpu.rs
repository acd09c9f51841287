//! The generate loop on the CUDA backend: tokens chosen on the device (only the
//! id comes back) against tokens chosen on the host from downloaded logits.
//! Every test needs a CUDA GPU: ignored elsewhere, run by the GPU script with
//! `--include-ignored`.

use lily_cli::backend::{Backend, Device, LoadOptions};
use lily_engine::generate::{
    generate, generate_observed, FinishReason, GenerateRequest, Generation, OnToken,
};
use lily_engine::sampling::{Logprobs, Sampler, SamplingParams};
use lily_engine::sequences::{chat_marks, CacheOptions, Sequences};
use lily_model::tokenizer::Tokenizer;
use lily_model::ModelSource;

/// `model` on the GPU with the product's settings.
fn cuda(model: &str) -> Backend {
    let (cfg, w) = ModelSource::Synthetic(model.into())
        .load_procedural()
        .unwrap();
    let b = Backend::load(cfg, w, &LoadOptions::new(Device::Cuda, 4096), false)
        .unwrap_or_else(|e| panic!("no usable CUDA GPU: {e:#}"));
    assert!(matches!(b, Backend::Cuda(_)));
    b
}

fn request(prompt: &[u32], sampling: SamplingParams, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        sampling,
        max_tokens,
        stop_ids: vec![],
        stop_strings: vec![],
    }
}

/// The device path (`generate`: nothing needs the logits).
fn on_device(b: &Backend, tok: &Tokenizer, req: &GenerateRequest) -> Generation {
    generate(b, tok, req, &mut |_| true).unwrap()
}

/// The host path: an observer of the logits (what log-probabilities need)
/// makes every step download them and the host sampler choose.
fn on_host(b: &Backend, tok: &Tokenizer, req: &GenerateRequest) -> Generation {
    let mut steps = 0;
    let g = generate_observed(
        b,
        tok,
        req,
        &mut |_, logits| {
            assert_eq!(logits.len(), b.cfg().vocab_size);
            steps += 1;
            true
        },
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(steps, g.tokens.len());
    g
}

fn prompt(tok: &Tokenizer) -> Vec<u32> {
    tok.encode("<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n")
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn greedy_on_the_device_equals_greedy_on_the_host() {
    let tok = Tokenizer::builtin();
    let model = "full4";
    let b = cuda(model);
    let p = prompt(&tok);
    for (prompt, n) in [(&p[..], 48), (&p[..1], 16)] {
        let req = request(prompt, SamplingParams::greedy(), n);
        let (dev, host) = (on_device(&b, &tok, &req), on_host(&b, &tok, &req));
        assert_eq!(dev.tokens.len(), n);
        assert_eq!(
            dev.tokens, host.tokens,
            "{model}: greedy differs between device and host choice"
        );
        assert_eq!(dev.text, host.text);
        // a stop id part-way: the device pipeline has queued the step
        // after it, yet the output ends where the host's does
        let stop = host.tokens[n / 3];
        let cut = host.tokens.iter().position(|&t| t == stop).unwrap();
        let mut req_stop = req.clone();
        req_stop.stop_ids = vec![stop];
        let d = on_device(&b, &tok, &req_stop);
        assert_eq!(d.tokens, host.tokens[..cut], "{model}: stop id {stop}");
        assert_eq!(d.finish, FinishReason::Stop);
        // cancelled by the text observer after the first non-empty piece
        let mut pieces = 0;
        let d = generate(&b, &tok, &req, &mut |_| {
            pieces += 1;
            false
        })
        .unwrap();
        assert_eq!(d.finish, FinishReason::Cancelled);
        assert_eq!(pieces, 1);
        assert_eq!(d.tokens, host.tokens[..d.tokens.len()]);
        // top_k = 1 is greedy too
        let req = request(
            prompt,
            SamplingParams {
                temperature: 0.7,
                top_k: 1,
                seed: Some(3),
                ..SamplingParams::greedy()
            },
            n,
        );
        assert_eq!(
            on_device(&b, &tok, &req).tokens,
            host.tokens,
            "{model}: top_k = 1"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn seeded_sampling_on_the_device_repeats() {
    let tok = Tokenizer::builtin();
    let model = "full4";
    let b = cuda(model);
    let p = prompt(&tok);
    let sampling = |seed| SamplingParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.01,
        seed: Some(seed),
        ..SamplingParams::greedy()
    };
    let n = 32;
    let run = |seed| on_device(&b, &tok, &request(&p, sampling(seed), n));
    let a = run(7);
    assert_eq!(a.tokens.len(), n);
    assert_eq!(
        a.tokens,
        run(7).tokens,
        "{model}: the same seed gave another run"
    );
    assert!(
        (8..12).any(|seed| run(seed).tokens != a.tokens),
        "{model}: every seed gave the same run"
    );
    assert!(
        a.tokens.iter().all(|&t| (t as usize) < tok.len()),
        "{model}: padding id sampled"
    );
    // Without top-k the candidate window can be wide (the device's bisection path).
    let wide = SamplingParams {
        temperature: 1.5,
        seed: Some(9),
        ..SamplingParams::greedy()
    };
    let (w1, w2) = (
        on_device(&b, &tok, &request(&p, wide.clone(), n)),
        on_device(&b, &tok, &request(&p, wide, n)),
    );
    assert_eq!(w1.tokens, w2.tokens, "{model}: wide window not repeatable");
    assert!(
        w1.tokens.iter().all(|&t| (t as usize) < tok.len()),
        "{model}: padding id sampled"
    );
    // The device draws the host's uniforms: with top-k 50 it usually makes
    // the host's choice too (up to rounding), so the runs agree for a while.
    let h = on_host(&b, &tok, &request(&p, sampling(7), n));
    let same = a
        .tokens
        .iter()
        .zip(&h.tokens)
        .take_while(|(x, y)| x == y)
        .count();
    eprintln!("{model}: device and host sampling agree on the first {same} of {n} tokens");
}

/// Logits of a turn resumed from the prompt cache against a cold prefill of
/// the same tokens, both on the GPU (relative L2): the resumed prefill runs
/// the prompt in other chunks, so bf16 roundings land elsewhere (the CPU
/// reference's test of the same path is exact to 1e-4).
const CACHED_VS_COLD_TOL: f64 = 2e-2;

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// A conversation through the prompt cache on the GPU: each turn resumes
/// after the previous turn's prompt and answer (the device pipeline's
/// overshoot accounted for), its first logits match a cold prefill's, and
/// the device's greedy path resumes the same way.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_prompt_cache_resumes_conversations_on_the_device() {
    let tok = Tokenizer::builtin();
    let b = cuda("full4");
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let mut seqs = Sequences::new(CacheOptions::mib(2048));
    let mut text =
        "<|im_start|>system\nYou are a careful assistant who answers briefly.<|im_end|>\n"
            .to_string();
    let mut prev_end = 0;
    for turn in 0..3 {
        text += &format!("<|im_start|>user\nQuestion number {turn}: what is {turn} plus {turn}?<|im_end|>\n<|im_start|>assistant\n");
        let p = tok.encode(&text).unwrap();
        let req = request(&p, SamplingParams::greedy(), 12);
        let marks = chat_marks(&p, im_start);
        // the host path, to compare the first logits
        let mut first = Vec::new();
        let g = seqs
            .generate(
                &b,
                &tok,
                &req,
                &marks,
                OnToken::WithLogits(&mut |_, l| {
                    if first.is_empty() {
                        first = l.to_vec();
                    }
                    true
                }),
                &mut |_| true,
            )
            .unwrap();
        let mut cold = Vec::new();
        generate_observed(
            &b,
            &tok,
            &req,
            &mut |_, l| {
                if cold.is_empty() {
                    cold = l.to_vec();
                }
                true
            },
            &mut |_| true,
        )
        .unwrap();
        let e = rel_l2(&first, &cold);
        eprintln!(
            "turn {turn}: {} cached of {}, logits rel L2 {e:.2e}",
            g.stats.cached_tokens,
            p.len()
        );
        assert!(
            e < CACHED_VS_COLD_TOL,
            "turn {turn}: logits relative L2 {e}"
        );
        if turn > 0 {
            // at least from the last turn's answer header (a chat mark): the
            // history renders that answer without the generation prompt's tail
            assert!(
                g.stats.cached_tokens + 8 >= prev_end,
                "turn {turn}: {} cached, the last turn ended at {prev_end}",
                g.stats.cached_tokens
            );
        }
        // the same request again on the device path: resumes from the same
        // prefix (the prompt's own snapshot is never all of it)
        let d = seqs
            .generate(
                &b,
                &tok,
                &req,
                &marks,
                OnToken::Id(&mut |_| true),
                &mut |_| true,
            )
            .unwrap();
        assert!(d.stats.cached_tokens > 0 && d.stats.cached_tokens < p.len());
        assert_eq!(
            d.tokens[0], g.tokens[0],
            "turn {turn}: first token, device vs host path"
        );
        text += &tok.decode(&d.tokens, false).unwrap();
        text += "<|im_end|>\n";
        prev_end = p.len();
    }
    assert_eq!(seqs.failed(), 0);
}

/// Log-probabilities on the device against the host's from the same logits.
const DEVICE_LOGPROB_TOL: f32 = 1e-4;

/// Penalties, a logit bias and log-probabilities chosen on the device give
/// what the host sampler gives from the downloaded logits: the same greedy
/// tokens (the penalty arithmetic is the host's, rounding for rounding), and
/// log-probabilities within `DEVICE_LOGPROB_TOL` with the same top ids.
#[test]
#[ignore = "needs a CUDA GPU"]
fn penalties_bias_and_logprobs_on_the_device_match_the_host() {
    let tok = Tokenizer::builtin();
    let b = cuda("full4");
    let p = prompt(&tok);
    let n = 40;
    let the = tok.encode(" the").unwrap()[0];
    for sampling in [
        SamplingParams {
            presence_penalty: 1.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.4,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(the, 6.0), (11, -100.0)],
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        },
    ] {
        let req = request(&p, sampling.clone(), n);
        let host = on_host(&b, &tok, &req);
        let dev = on_device(&b, &tok, &req);
        assert_eq!(dev.tokens.len(), n);
        assert_eq!(dev.tokens, host.tokens, "{sampling:?}");
        // with log-probabilities, against the host's from its logits
        let mut want = Vec::new();
        generate_observed(
            &b,
            &tok,
            &req,
            &mut |id, l| {
                let s = Sampler::new(sampling.clone(), tok.len(), &p);
                want.push(Logprobs::of(&s.biased(l), tok.len(), id, 5));
                true
            },
            &mut |_| true,
        )
        .unwrap();
        let mut seqs = Sequences::new(CacheOptions::off());
        let mut got = Vec::new();
        let g = seqs
            .generate(
                &b,
                &tok,
                &req,
                &[],
                OnToken::WithLogprobs(5, &mut |id, lp| {
                    got.push((id, lp.clone()));
                    true
                }),
                &mut |_| true,
            )
            .unwrap();
        assert_eq!(g.tokens, host.tokens, "{sampling:?} with logprobs");
        for (i, ((id, g), w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g.chosen - w.chosen).abs() < DEVICE_LOGPROB_TOL,
                "step {i} token {id}: {} vs {}",
                g.chosen,
                w.chosen
            );
            let ids = |l: &Logprobs| l.top.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(w), "step {i}: top ids");
            for (a, b) in g.top.iter().zip(&w.top) {
                assert!(
                    (a.1 - b.1).abs() < DEVICE_LOGPROB_TOL,
                    "step {i}: {a:?} vs {b:?}"
                );
            }
        }
    }
    // sampled with penalties: a seed repeats the run on the device
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        presence_penalty: 1.5,
        seed: Some(5),
        ..SamplingParams::greedy()
    };
    let req = request(&p, sampled, n);
    assert_eq!(
        on_device(&b, &tok, &req).tokens,
        on_device(&b, &tok, &req).tokens
    );
}
