//! The generate loop on a scripted model (stop ids, stop strings split across
//! tokens, the token limit, cancellation) and on the synthetic model (a seed
//! makes a sampled run repeatable end to end).

use anyhow::Result;
use lily_engine::generate::{generate, FinishReason, GenerateRequest, Model, StopMatcher};
use lily_engine::sampling::SamplingParams;
use lily_model::tokenizer::Tokenizer;

/// Emits a fixed token sequence: one-hot logits for script[position - prompt].
struct Scripted {
    script: Vec<u32>,
    vocab: usize,
}

impl Model for Scripted {
    type State = (usize, usize); // (prompt len, pos)
    fn new_state(&self) -> (usize, usize) {
        (0, 0)
    }
    fn prefill(&self, tokens: &[u32], st: &mut (usize, usize)) -> Result<Vec<f32>> {
        *st = (tokens.len(), tokens.len());
        Ok(self.logits(0))
    }
    fn decode(&self, _t: u32, st: &mut (usize, usize)) -> Result<Vec<f32>> {
        st.1 += 1;
        Ok(self.logits(st.1 - st.0))
    }
    fn position(&self, st: &(usize, usize)) -> usize {
        st.1
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
    GenerateRequest { prompt, sampling: SamplingParams::greedy(), max_tokens, stop_ids: vec![248_046], stop_strings: vec![] }
}

#[test]
fn stops_on_eos_and_at_the_limit() {
    let tok = Tokenizer::builtin();
    let mut script = tok.encode("Hello there, friend").unwrap();
    script.push(248_046);
    let m = Scripted { script: script.clone(), vocab: 248_320 };
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
    let m = Scripted { script, vocab: 248_320 };
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
    let m = Scripted { script, vocab: 248_320 };
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
    let (cfg, w) = lily_model::ModelSource::Synthetic("tiny".into()).load().unwrap();
    let m = lily_cpu::CpuModel::new(cfg, w);
    let tok = Tokenizer::builtin();
    let prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").unwrap();
    let run = |seed| {
        let mut req = request(prompt.clone(), 12);
        req.sampling = SamplingParams { temperature: 1.0, top_k: 50, top_p: 0.9, seed: Some(seed), ..SamplingParams::greedy() };
        generate(&m, &tok, &req, &mut |_| true).unwrap()
    };
    let (a, b, c) = (run(3), run(3), run(4));
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.text, b.text);
    assert_ne!(a.tokens, c.tokens);
    assert!(a.tokens.iter().all(|&t| (t as usize) < tok.len()), "padding id sampled");
}
