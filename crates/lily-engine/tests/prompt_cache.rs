//! The prompt cache on the CPU reference: a conversation resumed from a
//! snapshot the index finds gives the logits a cold prefill of the same
//! tokens gives (to the tolerance `lily-cpu`'s state-continuation test uses:
//! f32 activations, max |diff| <= 1e-4 of max |logit|), and a conversation
//! that shares only a system prompt with another resumes from the system
//! prompt's snapshot, not from the other's.

use lily_cpu::CpuModel;
use lily_engine::prompt_cache::PrefixIndex;
use lily_model::Forward;

fn model() -> CpuModel {
    let (cfg, w) = lily_model::ModelSource::Synthetic("tiny".into())
        .load()
        .unwrap();
    CpuModel::new(cfg, w).with_f32_activations()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 5000)
        .collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    let max = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-4 * max,
        "{what}: max diff {diff} vs max |logit| {max}"
    );
}

/// Prefill `prompt` through the cache: restore the longest saved prefix (a
/// token always left to prefill), prefill the rest, save the prompt's end.
/// Returns (the logits, tokens reused).
fn prefill_cached(
    m: &CpuModel,
    cache: &mut PrefixIndex<<CpuModel as Forward>::Snapshot>,
    prompt: &[u32],
) -> (Vec<f32>, usize) {
    let mut st = Forward::new_state(m).unwrap();
    let from = match cache.lookup(prompt, prompt.len() - 1) {
        Some(hit) => {
            Forward::restore(m, hit.snapshot, &mut st).unwrap();
            hit.len
        }
        None => 0,
    };
    assert_eq!(Forward::position(m, &st), from);
    let logits = Forward::prefill(m, &prompt[from..], &mut st).unwrap();
    let snap = Forward::snapshot(m, &st).unwrap();
    let bytes = Forward::snapshot_bytes(m, &snap);
    cache.insert(prompt, snap, bytes);
    (logits, from)
}

fn cold(m: &CpuModel, prompt: &[u32]) -> Vec<f32> {
    let mut st = Forward::new_state(m).unwrap();
    Forward::prefill(m, prompt, &mut st).unwrap()
}

#[test]
fn turns_resume_from_snapshots_with_the_cold_logits() {
    let m = model();
    let mut cache = PrefixIndex::new(1 << 30);
    let system = tokens(1, 70);
    let mut a = system.clone();
    a.extend(tokens(2, 45));
    // turn 1: nothing cached
    let (l, reused) = prefill_cached(&m, &mut cache, &a);
    assert_eq!(reused, 0);
    close(&l, &cold(&m, &a), "turn 1");
    // turn 2: turn 1's prompt, an answer and a new message
    let mut a2 = a.clone();
    a2.extend(tokens(3, 30));
    let (l, reused) = prefill_cached(&m, &mut cache, &a2);
    assert_eq!(reused, a.len());
    close(&l, &cold(&m, &a2), "turn 2 from turn 1's snapshot");
    // the same turn 2 again (regenerate): resumes from turn 1, not from itself
    let (l, reused) = prefill_cached(&m, &mut cache, &a2);
    assert_eq!(reused, a.len());
    close(&l, &cold(&m, &a2), "turn 2 regenerated");
    // another conversation with the same system prompt: only that is shared
    cache.insert(
        &system,
        {
            let mut st = Forward::new_state(&m).unwrap();
            Forward::prefill(&m, &system, &mut st).unwrap();
            Forward::snapshot(&m, &st).unwrap()
        },
        1,
    );
    let mut b = system.clone();
    b.extend(tokens(4, 20));
    let (l, reused) = prefill_cached(&m, &mut cache, &b);
    assert_eq!(reused, system.len());
    close(
        &l,
        &cold(&m, &b),
        "another conversation from the system prompt",
    );
    let s = cache.stats();
    assert_eq!((s.hits, s.misses), (3, 1));
}

// ---- the whole request path: `Sequences::generate` against fresh generation ----

use lily_engine::generate::{generate_tokens, GenerateRequest, Generation, Model, OnToken};
use lily_engine::sampling::{Sampler, SamplingParams};
use lily_engine::sequences::{chat_marks, CacheOptions, Sequences};
use lily_model::tokenizer::Tokenizer;

const IM_START: u32 = 248_045;
const IM_END: u32 = 248_046;

fn request(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop_ids: vec![IM_END],
        stop_strings: vec![],
    }
}

/// A chat-shaped prompt: messages opened by `<|im_start|>`, closed by `<|im_end|>`.
fn chat(messages: &[Vec<u32>]) -> Vec<u32> {
    let mut p = Vec::new();
    for m in messages {
        p.push(IM_START);
        p.extend_from_slice(m);
        p.push(IM_END);
    }
    p.push(IM_START);
    p
}

fn cached<M: Model>(
    m: &M,
    seqs: &mut Sequences<M::State, M::Snapshot>,
    prompt: &[u32],
    max_tokens: usize,
) -> Generation {
    let tok = Tokenizer::builtin();
    let marks = chat_marks(prompt, IM_START);
    seqs.generate(
        m,
        &tok,
        &request(prompt, max_tokens),
        &marks,
        OnToken::Id(&mut |_| true),
        &mut |_| true,
    )
    .unwrap()
}

fn fresh<M: Model>(m: &M, prompt: &[u32], max_tokens: usize) -> Generation {
    let tok = Tokenizer::builtin();
    generate_tokens(
        m,
        &tok,
        &request(prompt, max_tokens),
        &mut |_| true,
        &mut |_| true,
    )
    .unwrap()
}

/// A conversation of several turns, a regenerated turn and a second
/// conversation with the same system prompt: each request reports the
/// history it resumed from and answers as a fresh run does.
#[test]
fn conversations_resume_and_answer_as_fresh_runs() {
    // answers long enough to be saved (`min_gap` past the answer's header)
    const N: usize = 40;
    let m = model();
    let mut seqs = Sequences::new(CacheOptions::mib(1024));
    let system = tokens(1, 90);
    let mut history = vec![system.clone(), tokens(2, 40)];
    let mut prev_len = 0;
    for turn in 0..3 {
        let prompt = chat(&history);
        let g = cached(&m, &mut seqs, &prompt, N);
        assert_eq!(g.tokens, fresh(&m, &prompt, N).tokens, "turn {turn}");
        if turn == 0 {
            assert_eq!(g.stats.cached_tokens, 0);
        } else {
            // the last turn's prompt and all but its last token (never fed)
            assert_eq!(g.stats.cached_tokens, prev_len, "turn {turn}");
        }
        prev_len = prompt.len() + g.tokens.len() - 1;
        history.push(g.tokens.clone());
        history.push(tokens(10 + turn, 25));
        // the next prompt carries the answer as generated
        let mut next = prompt.clone();
        next.extend(&g.tokens);
        assert_eq!(chat(&history)[..next.len()], next[..]);
    }
    // regenerate the last turn with another message: the history up to it is reused
    let n = history.len();
    history[n - 1] = tokens(50, 33);
    let prompt = chat(&history);
    let g = cached(&m, &mut seqs, &prompt, N);
    assert_eq!(g.stats.cached_tokens, prev_len);
    assert_eq!(g.tokens, fresh(&m, &prompt, N).tokens, "regenerated turn");
    // another conversation on the same system prompt resumes at its end (a chat mark)
    let other = chat(&[system.clone(), tokens(60, 70)]);
    let g = cached(&m, &mut seqs, &other, N);
    assert_eq!(g.stats.cached_tokens, system.len() + 2);
    assert_eq!(g.tokens, fresh(&m, &other, N).tokens, "other conversation");
    let s = seqs.stats();
    assert_eq!((s.hits, s.misses), (4, 1));
    assert_eq!(seqs.failed(), 0);
}

/// Snapshots every `interval` tokens inside a long prompt: a prompt that
/// shares most of it resumes at the last one before they part.
#[test]
fn a_long_prompt_is_saved_along_the_way() {
    let m = model();
    let mut seqs = Sequences::new(CacheOptions {
        budget: 1 << 30,
        interval: 100,
        min_gap: 32,
    });
    let long = tokens(7, 350);
    let g = cached(&m, &mut seqs, &long, 3);
    assert_eq!(g.stats.cached_tokens, 0);
    let mut other = long[..260].to_vec();
    other.extend(tokens(8, 30));
    let g = cached(&m, &mut seqs, &other, 4);
    assert_eq!(g.stats.cached_tokens, 200);
    assert_eq!(g.tokens, fresh(&m, &other, 4).tokens);
}

/// A budget too small for any snapshot: nothing is reused, answers are the same.
#[test]
fn a_tiny_budget_caches_nothing() {
    let m = model();
    let mut seqs = Sequences::new(CacheOptions {
        budget: 1000,
        interval: 0,
        min_gap: 1,
    });
    let p = chat(&[tokens(1, 80), tokens(2, 20)]);
    for _ in 0..2 {
        let g = cached(&m, &mut seqs, &p, 4);
        assert_eq!(g.stats.cached_tokens, 0);
        assert_eq!(g.tokens, fresh(&m, &p, 4).tokens);
    }
    assert_eq!(seqs.stats().entries, 0);
}

/// The CPU model with a device-style pipeline: each choice is fed before
/// the host has seen it, so after a stop the state holds that choice too.
struct Ahead(CpuModel);

impl Model for Ahead {
    type State = <CpuModel as Forward>::State;
    fn new_state(&self) -> anyhow::Result<Self::State> {
        Forward::new_state(&self.0)
    }
    fn prefill(&self, t: &[u32], st: &mut Self::State) -> anyhow::Result<Vec<f32>> {
        Forward::prefill(&self.0, t, st)
    }
    fn decode(&self, t: u32, st: &mut Self::State) -> anyhow::Result<Vec<f32>> {
        Forward::decode(&self.0, t, st)
    }
    fn position(&self, st: &Self::State) -> usize {
        Forward::position(&self.0, st)
    }
    fn reset(&self, st: &mut Self::State) -> anyhow::Result<()> {
        Forward::reset(&self.0, st)
    }
    type Snapshot = <CpuModel as Forward>::Snapshot;
    fn snapshot(&self, st: &Self::State) -> anyhow::Result<Self::Snapshot> {
        Forward::snapshot(&self.0, st)
    }
    fn restore(&self, s: &Self::Snapshot, st: &mut Self::State) -> anyhow::Result<()> {
        Forward::restore(&self.0, s, st)
    }
    fn snapshot_bytes(&self, s: &Self::Snapshot) -> usize {
        Forward::snapshot_bytes(&self.0, s)
    }
    fn decode_pick_run(
        &self,
        token: u32,
        st: &mut Self::State,
        sampler: &mut Sampler,
        n: usize,
        on_token: &mut dyn FnMut(u32, &mut Sampler) -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        let mut logits = self.decode(token, st)?;
        for i in 0..n {
            let next = sampler.sample(&logits);
            if i + 1 < n {
                logits = self.decode(next, st)?;
            }
            if !on_token(next, sampler)? {
                break;
            }
        }
        Ok(())
    }
}

/// The state of a request that stopped on an end-of-sequence id holds that id
/// (fed ahead): it is saved as holding it, and the next turn, whose prompt
/// carries the answer and that id, resumes after it.
#[test]
fn a_choice_fed_past_the_stop_is_accounted_for() {
    let m = Ahead(model());
    let p = chat(&[tokens(1, 60), tokens(2, 20)]);
    // make the model's 3rd choice the stop: find its first three greedy choices
    let free = fresh(&m, &p, 3).tokens;
    assert_eq!(free.len(), 3);
    let mut req = request(&p, 10);
    req.stop_ids = vec![free[2]];
    let tok = Tokenizer::builtin();
    let mut seqs = Sequences::new(CacheOptions {
        min_gap: 1,
        ..CacheOptions::mib(1024)
    });
    let g = seqs
        .generate(&m, &tok, &req, &[], OnToken::Id(&mut |_| true), &mut |_| {
            true
        })
        .unwrap();
    assert_eq!(g.tokens, free[..2]);
    // the state was fed p, the two tokens and the stop id
    let mut next = p.clone();
    next.extend(&free);
    next.extend(tokens(3, 20));
    let g2 = seqs
        .generate(
            &m,
            &tok,
            &request(&next, 4),
            &[],
            OnToken::Id(&mut |_| true),
            &mut |_| true,
        )
        .unwrap();
    assert_eq!(g2.stats.cached_tokens, p.len() + 3);
    assert_eq!(g2.tokens, fresh(&m, &next, 4).tokens);
}
