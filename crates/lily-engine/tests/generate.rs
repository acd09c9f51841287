//! The generate loop on a scripted model (stop ids, stop strings split across
//! tokens, the token limit, cancellation, when the backend chooses the token
//! and when the host does) and on the synthetic model (a seed makes a sampled
//! run repeatable end to end, on either path).

use std::cell::Cell;

use anyhow::Result;
use lily_engine::generate::{
    generate, generate_observed, generate_tokens, FinishReason, GenerateRequest, Model, OnToken,
    Picked, StopMatcher,
};
use lily_engine::sampling::{Logprobs, Sampler, SamplingParams};
use lily_engine::sequences::{CacheOptions, Sequences};
use lily_model::tokenizer::Tokenizer;

/// Emits a fixed token sequence: one-hot logits for script[position - prompt].
struct Scripted {
    script: Vec<u32>,
    vocab: usize,
}

impl Model for Scripted {
    type State = (usize, usize); // (prompt len, pos)
    fn new_state(&self) -> Result<(usize, usize)> {
        Ok((0, 0))
    }
    fn prefill(&self, tokens: &[u32], st: &mut (usize, usize)) -> Result<Vec<f32>> {
        let p = st.1 + tokens.len();
        *st = (p, p);
        Ok(self.logits(0))
    }
    fn decode(&self, _t: u32, st: &mut (usize, usize)) -> Result<Vec<f32>> {
        st.1 += 1;
        Ok(self.logits(st.1 - st.0))
    }
    fn position(&self, st: &(usize, usize)) -> usize {
        st.1
    }
    fn reset(&self, st: &mut (usize, usize)) -> Result<()> {
        *st = (0, 0);
        Ok(())
    }
    type Snapshot = (usize, usize);
    fn snapshot(&self, st: &(usize, usize)) -> Result<(usize, usize)> {
        Ok(*st)
    }
    fn restore(&self, snap: &(usize, usize), st: &mut (usize, usize)) -> Result<()> {
        *st = *snap;
        Ok(())
    }
    fn snapshot_bytes(&self, _: &(usize, usize)) -> usize {
        16
    }
}

impl Scripted {
    fn logits(&self, i: usize) -> Vec<f32> {
        let mut l = vec![0.0; self.vocab];
        l[self.script[i.min(self.script.len() - 1)] as usize] = 10.0;
        l
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_ids: vec![248_046],
        stop_strings: vec![],
    }
}

#[test]
fn stops_on_eos_and_at_the_limit() {
    let tok = Tokenizer::builtin();
    let mut script = tok.encode("Hello there, friend").unwrap();
    script.push(248_046);
    let m = Scripted {
        script: script.clone(),
        vocab: 248_320,
    };
    let mut streamed = String::new();
    let g = generate(&m, &tok, &request(vec![1, 2, 3], 100), &mut |s| {
        streamed.push_str(s);
        true
    })
    .unwrap();
    assert_eq!(g.finish, FinishReason::Stop);
    assert_eq!(g.text, "Hello there, friend");
    assert_eq!(streamed, g.text);
    assert_eq!(g.tokens, script[..script.len() - 1]);
    let g = generate(&m, &tok, &request(vec![1], 2), &mut |_| true).unwrap();
    assert_eq!((g.finish, g.tokens.len()), (FinishReason::Length, 2));
    assert_eq!(g.text, tok.decode(&script[..2], true).unwrap());
}

#[test]
fn stop_string_split_across_tokens() {
    let tok = Tokenizer::builtin();
    let text = "alpha beta STOP gamma";
    let script = tok.encode(text).unwrap();
    let m = Scripted {
        script,
        vocab: 248_320,
    };
    let mut req = request(vec![5], 100);
    req.stop_strings = vec!["ST".into(), "nope".into(), " STOP g".into()];
    let mut streamed = String::new();
    let g = generate(&m, &tok, &req, &mut |s| {
        streamed.push_str(s);
        true
    })
    .unwrap();
    assert_eq!(g.finish, FinishReason::Stop);
    assert_eq!(g.text, "alpha beta ");
    assert_eq!(streamed, "alpha beta ");
}

#[test]
fn stop_matcher_holds_back_only_possible_prefixes() {
    let mut m = StopMatcher::new(&["</end>".to_string()]);
    assert_eq!(m.push("abc</e"), ("abc".to_string(), false));
    assert_eq!(m.push("x"), ("</ex".to_string(), false));
    assert_eq!(m.push("y</en"), ("y".to_string(), false));
    assert_eq!(m.push("d>tail"), (String::new(), true));
    let mut m = StopMatcher::new(&["</end>".to_string()]);
    m.push("a</en");
    assert_eq!(m.finish(), "</en");
}

#[test]
fn cancellation_stops_at_the_next_token() {
    let tok = Tokenizer::builtin();
    let script = tok.encode("one two three four five six").unwrap();
    let m = Scripted {
        script,
        vocab: 248_320,
    };
    let mut calls = 0;
    let g = generate(&m, &tok, &request(vec![1], 100), &mut |_| {
        calls += 1;
        calls < 2
    })
    .unwrap();
    assert_eq!(g.finish, FinishReason::Cancelled);
    assert_eq!(g.tokens.len(), 2);
}

#[test]
fn seeded_sampling_repeats_on_the_synthetic_model() {
    let (cfg, w) = lily_model::ModelSource::Synthetic("tiny".into())
        .load()
        .unwrap();
    let m = lily_cpu::CpuModel::new(cfg, w);
    let tok = Tokenizer::builtin();
    let prompt = tok
        .encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let run = |seed| {
        let mut req = request(prompt.clone(), 12);
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.9,
            seed: Some(seed),
            ..SamplingParams::greedy()
        };
        generate(&m, &tok, &req, &mut |_| true).unwrap()
    };
    let (a, b, c) = (run(3), run(3), run(4));
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.text, b.text);
    assert_ne!(a.tokens, c.tokens);
    assert!(
        a.tokens.iter().all(|&t| (t as usize) < tok.len()),
        "padding id sampled"
    );
}

/// A backend that chooses tokens itself (as the GPU does): its logits say
/// `host`, its own choice says `device`, so the output shows which path ran.
struct Chooser {
    host: Scripted,
    device: Vec<u32>,
    /// (steps that returned logits, steps that returned a chosen id, draws taken)
    calls: Cell<(usize, usize, usize)>,
}

impl Chooser {
    fn new(host: &str, device: &str) -> Chooser {
        let tok = Tokenizer::builtin();
        Chooser {
            host: Scripted {
                script: tok.encode(host).unwrap(),
                vocab: 248_320,
            },
            device: tok.encode(device).unwrap(),
            calls: Cell::new((0, 0, 0)),
        }
    }
    fn count(&self, logits: usize, picks: usize) {
        let (l, p, d) = self.calls.get();
        self.calls.set((l + logits, p + picks, d));
    }
    /// The device's choice, with one-hot log-probabilities when asked.
    fn picked(&self, st: &(usize, usize), sampler: &mut Sampler, lp: Option<usize>) -> Picked {
        let id = self.choose(st, sampler);
        Picked {
            id,
            logprobs: lp.map(|n| Logprobs::forced(id, 248_320, n)),
        }
    }

    fn choose(&self, st: &(usize, usize), sampler: &mut Sampler) -> u32 {
        self.count(0, 1);
        if !sampler.is_greedy() {
            let u = sampler.draw();
            assert!((0.0..1.0).contains(&u));
            let (l, p, d) = self.calls.get();
            self.calls.set((l, p, d + 1));
        }
        self.device[(st.1 - st.0).min(self.device.len() - 1)]
    }
}

impl Model for Chooser {
    type State = (usize, usize);
    fn new_state(&self) -> Result<(usize, usize)> {
        self.host.new_state()
    }
    fn prefill(&self, tokens: &[u32], st: &mut (usize, usize)) -> Result<Vec<f32>> {
        self.count(1, 0);
        self.host.prefill(tokens, st)
    }
    fn decode(&self, t: u32, st: &mut (usize, usize)) -> Result<Vec<f32>> {
        self.count(1, 0);
        self.host.decode(t, st)
    }
    fn position(&self, st: &(usize, usize)) -> usize {
        st.1
    }
    fn reset(&self, st: &mut (usize, usize)) -> Result<()> {
        self.host.reset(st)
    }
    type Snapshot = (usize, usize);
    fn snapshot(&self, st: &(usize, usize)) -> Result<(usize, usize)> {
        self.host.snapshot(st)
    }
    fn restore(&self, snap: &(usize, usize), st: &mut (usize, usize)) -> Result<()> {
        self.host.restore(snap, st)
    }
    fn snapshot_bytes(&self, snap: &(usize, usize)) -> usize {
        self.host.snapshot_bytes(snap)
    }
    fn prefill_pick(
        &self,
        tokens: &[u32],
        st: &mut (usize, usize),
        sampler: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        let p = st.1 + tokens.len();
        *st = (p, p);
        Ok(self.picked(st, sampler, lp))
    }
    fn decode_pick(
        &self,
        _t: u32,
        st: &mut (usize, usize),
        sampler: &mut Sampler,
        lp: Option<usize>,
    ) -> Result<Picked> {
        st.1 += 1;
        Ok(self.picked(st, sampler, lp))
    }
}

#[test]
fn the_backend_chooses_when_nothing_needs_the_logits() {
    let tok = Tokenizer::builtin();
    let n = tok.encode(" one two three").unwrap().len();
    // greedy and sampled: every step is the backend's choice, no logits come back
    for sampling in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(1),
            ..SamplingParams::greedy()
        },
    ] {
        let m = Chooser::new(" a b c", " one two three");
        let req = GenerateRequest {
            sampling: sampling.clone(),
            ..request(vec![1, 2], n)
        };
        let g = generate(&m, &tok, &req, &mut |_| true).unwrap();
        assert_eq!(g.text, " one two three");
        let draws = if sampling.temperature > 0.0 { n } else { 0 };
        assert_eq!(m.calls.get(), (0, n, draws), "{sampling:?}");
    }
    // an observer of ids alone keeps the pick path
    let m = Chooser::new(" a b c", " one two three");
    let mut seen = Vec::new();
    let g = generate_tokens(
        &m,
        &tok,
        &request(vec![1], n),
        &mut |id| {
            seen.push(id);
            true
        },
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(
        (g.text.as_str(), seen),
        (" one two three", g.tokens.clone())
    );
    assert_eq!(m.calls.get(), (0, n, 0));
}

#[test]
fn logprobs_and_penalties_bring_the_logits_to_the_host() {
    let tok = Tokenizer::builtin();
    let n = tok.encode(" a b c").unwrap().len();
    // an observer of the logits (log-probabilities): host logits every step
    let m = Chooser::new(" a b c", " one two three");
    let mut observed = 0;
    let g = generate_observed(
        &m,
        &tok,
        &request(vec![1], n),
        &mut |id, logits| {
            observed += 1;
            assert_eq!(lily_engine::sampling::argmax(logits), id);
            true
        },
        &mut |_| true,
    )
    .unwrap();
    assert_eq!((g.text.as_str(), observed), (" a b c", n));
    assert_eq!(m.calls.get(), (n, 0, 0));
    // penalties and a logit bias are the backend's to apply: it still chooses
    for sampling in [
        SamplingParams {
            repetition_penalty: 1.1,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            frequency_penalty: 0.5,
            temperature: 0.7,
            top_k: 5,
            seed: Some(3),
            ..SamplingParams::greedy()
        },
        SamplingParams {
            logit_bias: vec![(5, 2.0)],
            ..SamplingParams::greedy()
        },
    ] {
        let m = Chooser::new(" a b c", " one two three");
        let k = tok.encode(" one two three").unwrap().len();
        let req = GenerateRequest {
            sampling: sampling.clone(),
            ..request(vec![1], k)
        };
        let g = generate(&m, &tok, &req, &mut |_| true).unwrap();
        assert_eq!(g.text, " one two three", "{sampling:?}");
        let draws = if sampling.temperature > 0.0 { k } else { 0 };
        assert_eq!(m.calls.get(), (0, k, draws), "{sampling:?}");
    }
    // log-probabilities come with the backend's choice
    let m = Chooser::new(" a b c", " one two three");
    let k = tok.encode(" one two three").unwrap().len();
    let mut seqs = Sequences::new(CacheOptions::off());
    let mut got = Vec::new();
    let g = seqs
        .generate(
            &m,
            &tok,
            &request(vec![1], k),
            &[],
            OnToken::WithLogprobs(3, &mut |id, lp| {
                got.push((id, lp.clone()));
                true
            }),
            &mut |_| true,
        )
        .unwrap();
    assert_eq!(g.text, " one two three");
    assert_eq!(m.calls.get(), (0, k, 0));
    assert_eq!(got.len(), k);
    for (id, lp) in got {
        assert_eq!(lp, Logprobs::forced(id, 248_320, 3));
    }
}

/// Without a backend of its own, the pick path is the host path: the same
/// tokens, and the same seeded draws, with or without an observer of logits.
#[test]
fn the_default_pick_is_the_host_sampler() {
    let (cfg, w) = lily_model::ModelSource::Synthetic("tiny".into())
        .load()
        .unwrap();
    let m = lily_cpu::CpuModel::new(cfg, w);
    let tok = Tokenizer::builtin();
    let prompt = tok
        .encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    for sampling in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.9,
            min_p: 0.01,
            seed: Some(5),
            ..SamplingParams::greedy()
        },
    ] {
        let req = GenerateRequest {
            sampling,
            ..request(prompt.clone(), 10)
        };
        let picked = generate(&m, &tok, &req, &mut |_| true).unwrap();
        let hosted = generate_observed(&m, &tok, &req, &mut |_, _| true, &mut |_| true).unwrap();
        assert_eq!(picked.tokens, hosted.tokens);
        assert_eq!(picked.tokens.len(), 10);
    }
}

/// A sequence that cannot be allocated fails the request with the backend's error.
#[test]
fn a_state_that_cannot_be_allocated_fails_the_request() {
    struct NoMemory;
    impl Model for NoMemory {
        type State = ();
        fn new_state(&self) -> Result<()> {
            anyhow::bail!("out of device memory")
        }
        fn prefill(&self, _: &[u32], _: &mut ()) -> Result<Vec<f32>> {
            unreachable!()
        }
        fn decode(&self, _: u32, _: &mut ()) -> Result<Vec<f32>> {
            unreachable!()
        }
        fn position(&self, _: &()) -> usize {
            0
        }
        fn reset(&self, _: &mut ()) -> Result<()> {
            unreachable!()
        }
        type Snapshot = ();
        fn snapshot(&self, _: &()) -> Result<()> {
            unreachable!()
        }
        fn restore(&self, _: &(), _: &mut ()) -> Result<()> {
            unreachable!()
        }
        fn snapshot_bytes(&self, _: &()) -> usize {
            0
        }
    }
    let e = generate(
        &NoMemory,
        &Tokenizer::builtin(),
        &request(vec![1], 4),
        &mut |_| true,
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("out of device memory"), "{e:#}");
}
