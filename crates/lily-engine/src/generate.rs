//! The generate loop: prefill the prompt, then sample and decode one token at a
//! time, streaming text out through the detokenizer and the stop-string
//! matcher, until an end-of-sequence id, a stop string or the token limit.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use lily_model::tokenizer::{StreamDecoder, Tokenizer};
use lily_model::Forward;

use crate::sampling::{Logprobs, Sampler, SamplingParams};
use crate::sequences::{Begun, CacheOptions, Sequences};

/// What the engine needs from a backend. One sequence's state is an opaque
/// value owned by the caller, so a scheduler can hold many.
///
/// Every [`Forward`] is a `Model` that chooses on the host; a type implements
/// `Model` itself to choose elsewhere (or to wrap another model).
///
/// A step either returns the logits (`prefill` / `decode`: the engine samples
/// on the host) or the chosen token (`prefill_pick` / `decode_pick`: a backend
/// that holds the logits elsewhere, on a GPU, may choose there, penalties and
/// log-probabilities included, and hand back only the id and the numbers
/// asked for). The generate loop takes the pick path unless its caller wants
/// the logits themselves ([`generate_observed`]). The pick methods default to
/// the host path, so a backend overrides them only to choose somewhere else,
/// and may still fall back to the host for a step it cannot choose on.
pub trait Model {
    type State;
    /// A fresh sequence (fails when its memory cannot be allocated).
    fn new_state(&self) -> Result<Self::State>;
    /// Feed `tokens` after what `state` holds; logits [V] of the last one.
    fn prefill(&self, tokens: &[u32], state: &mut Self::State) -> Result<Vec<f32>>;
    /// Feed one token; its logits [V].
    fn decode(&self, token: u32, state: &mut Self::State) -> Result<Vec<f32>>;
    /// Tokens the state holds.
    fn position(&self, state: &Self::State) -> usize;
    /// Make `state` an empty sequence again, keeping its memory.
    fn reset(&self, state: &mut Self::State) -> Result<()>;

    /// A saved copy of what a state holds, for the prompt cache
    /// ([`crate::sequences::Sequences`]).
    type Snapshot;
    /// Save what `state` holds.
    fn snapshot(&self, state: &Self::State) -> Result<Self::Snapshot>;
    /// Make `state` hold what `snap` saved, whatever it held before.
    fn restore(&self, snap: &Self::Snapshot, state: &mut Self::State) -> Result<()>;
    /// Bytes `snap` takes.
    fn snapshot_bytes(&self, snap: &Self::Snapshot) -> usize;

    /// [`Model::prefill`], then the next token as `sampler.sample` would
    /// choose it from the logits of the last one (penalties applied, taking
    /// [`Sampler::draw`] for a sampled choice, as `sample` does), with the
    /// step's log-probabilities when `logprobs` asks for that many
    /// alternatives ([`Logprobs::of`] the logits). Default: host logits.
    fn prefill_pick(
        &self,
        tokens: &[u32],
        state: &mut Self::State,
        sampler: &mut Sampler,
        logprobs: Option<usize>,
    ) -> Result<Picked> {
        let logits = self.prefill(tokens, state)?;
        Ok(Picked::on_host(&logits, sampler, logprobs))
    }

    /// Feed `token` (the last pick's choice), then go on picking and feeding:
    /// each choice goes to `on_token` (with the sampler, to record it), which
    /// says whether to go on; at most `n` choices. A backend may queue the
    /// step that feeds a choice before `on_token` has seen it (the CUDA
    /// backend's greedy pipeline), so after a stop the state may hold that
    /// last choice too: the caller does not extend the state afterwards.
    /// Default: [`Model::decode_pick`] one token at a time.
    fn decode_pick_run(
        &self,
        token: u32,
        state: &mut Self::State,
        sampler: &mut Sampler,
        n: usize,
        on_token: &mut dyn FnMut(u32, &mut Sampler) -> Result<bool>,
    ) -> Result<()> {
        decode_pick_each(self, token, state, sampler, n, on_token)
    }

    /// [`Model::decode`], then the next token, as in [`Model::prefill_pick`].
    fn decode_pick(
        &self,
        token: u32,
        state: &mut Self::State,
        sampler: &mut Sampler,
        logprobs: Option<usize>,
    ) -> Result<Picked> {
        let logits = self.decode(token, state)?;
        Ok(Picked::on_host(&logits, sampler, logprobs))
    }
}

/// A step's choice, and its log-probabilities when they were asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Picked {
    pub id: u32,
    pub logprobs: Option<Logprobs>,
}

impl Picked {
    /// The host's choice from `logits` (`sampler.sample`), and their
    /// log-probabilities with `logprobs` alternatives.
    pub fn on_host(logits: &[f32], sampler: &mut Sampler, logprobs: Option<usize>) -> Picked {
        let id = sampler.sample(logits);
        let logprobs =
            logprobs.map(|n| Logprobs::of(&sampler.biased(logits), sampler.valid_vocab(), id, n));
        Picked { id, logprobs }
    }
}

/// Every backend's forward pass is a [`Model`] that chooses on the host.
impl<F: Forward> Model for F {
    type State = F::State;
    fn new_state(&self) -> Result<F::State> {
        Forward::new_state(self)
    }
    fn prefill(&self, tokens: &[u32], state: &mut F::State) -> Result<Vec<f32>> {
        Forward::prefill(self, tokens, state)
    }
    fn decode(&self, token: u32, state: &mut F::State) -> Result<Vec<f32>> {
        Forward::decode(self, token, state)
    }
    fn position(&self, state: &F::State) -> usize {
        Forward::position(self, state)
    }
    fn reset(&self, state: &mut F::State) -> Result<()> {
        Forward::reset(self, state)
    }
    type Snapshot = F::Snapshot;
    fn snapshot(&self, state: &F::State) -> Result<F::Snapshot> {
        Forward::snapshot(self, state)
    }
    fn restore(&self, snap: &F::Snapshot, state: &mut F::State) -> Result<()> {
        Forward::restore(self, snap, state)
    }
    fn snapshot_bytes(&self, snap: &F::Snapshot) -> usize {
        Forward::snapshot_bytes(self, snap)
    }
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// End-of-sequence ids (from generation_config.json)
    pub stop_ids: Vec<u32>,
    /// Text that ends the generation; it is not part of the output.
    pub stop_strings: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence id or a stop string
    Stop,
    /// The token limit
    Length,
    /// The caller asked to stop
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// leading prompt tokens restored from the prompt cache, not prefilled
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub prefill: Duration,
    pub ttft: Duration,
    pub decode: Duration,
}

impl Stats {
    /// Tokens prefilled (those restored from the cache not counted) per second.
    pub fn prefill_tok_s(&self) -> f64 {
        (self.prompt_tokens - self.cached_tokens) as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Tokens after the first over the time spent decoding them.
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub text: String,
    /// Generated ids (the end-of-sequence id excluded)
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: Stats,
}

/// Holds back text that could be the start of a stop string, and cuts the
/// output at the first full match (also when it spans tokens).
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Add text; returns (text safe to emit, whether a stop string matched).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if tail.len() < s.len() && s.starts_with(tail) {
                    keep = keep.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// End of generation: the held-back text was no stop string after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// [`Model::decode_pick_run`] one [`Model::decode_pick`] at a time: the
/// default, and a backend's fallback where it has no pipeline.
pub fn decode_pick_each<M: Model + ?Sized>(
    model: &M,
    token: u32,
    state: &mut M::State,
    sampler: &mut Sampler,
    n: usize,
    on_token: &mut dyn FnMut(u32, &mut Sampler) -> Result<bool>,
) -> Result<()> {
    let mut t = token;
    for _ in 0..n {
        t = model.decode_pick(t, state, sampler, None)?.id;
        if !on_token(t, sampler)? {
            break;
        }
    }
    Ok(())
}

/// Run one request. `on_text` receives each new piece of text as soon as it
/// is certain; returning `false` cancels the generation at the next token.
/// Tokens are chosen where the backend can (on the GPU, only the id comes
/// back) unless penalties need the logits on the host. Nothing is kept for
/// a later request (see [`Sequences::generate`]).
pub fn generate<M: Model>(
    model: &M,
    tok: &Tokenizer,
    req: &GenerateRequest,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let mut seqs = Sequences::new(CacheOptions::off());
    seqs.generate(model, tok, req, &[], OnToken::Id(&mut |_| true), on_text)
}

/// [`generate`] with a per-token observer that needs no logits: `on_token(id)`
/// sees each generated token (end-of-sequence ids excluded) before its text
/// goes to `on_text`. Returning `false` cancels the generation there; that
/// token is then not part of the output. The backend may choose on the device.
pub fn generate_tokens<M: Model>(
    model: &M,
    tok: &Tokenizer,
    req: &GenerateRequest,
    on_token: &mut dyn FnMut(u32) -> bool,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let mut seqs = Sequences::new(CacheOptions::off());
    seqs.generate(model, tok, req, &[], OnToken::Id(on_token), on_text)
}

/// [`generate`] with a per-token observer: `on_token(id, logits)` sees each
/// generated token (end-of-sequence ids excluded) with the logits it was
/// sampled from (before penalties and temperature: what log-probabilities are
/// reported from), before its text goes to `on_text`. Returning `false`
/// cancels the generation there; that token is then not part of the output.
/// Every step brings its logits to the host (no choosing on the device).
pub fn generate_observed<M: Model>(
    model: &M,
    tok: &Tokenizer,
    req: &GenerateRequest,
    on_token: &mut dyn FnMut(u32, &[f32]) -> bool,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let mut seqs = Sequences::new(CacheOptions::off());
    seqs.generate(model, tok, req, &[], OnToken::WithLogits(on_token), on_text)
}

/// Who sees each generated token: the id alone, or with its
/// log-probabilities (the backend may choose on the device either way), or
/// with its logits (host logits every step). Each may cancel the generation
/// there by returning `false`; that token is then not part of the output.
pub enum OnToken<'a> {
    Id(&'a mut dyn FnMut(u32) -> bool),
    /// with this many alternatives
    WithLogprobs(usize, &'a mut dyn FnMut(u32, &Logprobs) -> bool),
    WithLogits(&'a mut dyn FnMut(u32, &[f32]) -> bool),
}

impl<St, Sn> Sequences<St, Sn> {
    /// Run one request, resuming from the longest cached prefix of its
    /// prompt and saving snapshots for later ones (at the end of the prompt,
    /// at `marks` inside it, see [`crate::sequences`], and at the end of the
    /// generation); the state is kept for the next request.
    pub fn generate<M: Model<State = St, Snapshot = Sn>>(
        &mut self,
        model: &M,
        tok: &Tokenizer,
        req: &GenerateRequest,
        marks: &[usize],
        on_token: OnToken<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        run(model, self, tok, req, marks, on_token, on_text)
    }
}

#[allow(clippy::too_many_arguments)]
fn run<M: Model>(
    model: &M,
    seqs: &mut Sequences<M::State, M::Snapshot>,
    tok: &Tokenizer,
    req: &GenerateRequest,
    marks: &[usize],
    mut on_token: OnToken<'_>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    if req.prompt.is_empty() {
        bail!("the prompt is empty");
    }
    req.sampling.validate()?;
    let t0 = Instant::now();
    let prompt = &req.prompt[..];
    let Begun { mut state, cached } = seqs.begin(model, prompt)?;
    let mut sampler = Sampler::new(req.sampling.clone(), tok.len(), prompt);
    // Prefill up to each snapshot point, saving there; the rest below.
    // `last`: the last snapshot on this request's path.
    let (mut at, mut last) = (cached, cached);
    for p in seqs.points(cached, prompt.len(), marks) {
        model.prefill(&prompt[at..p], &mut state)?;
        last = seqs.save(model, &prompt[..p], &state, last);
        at = p;
    }
    let rest = &prompt[at..];
    // Choose where the logits are, or bring them to the host and choose here.
    let pick = !matches!(on_token, OnToken::WithLogits(_));
    let lp_n = match on_token {
        OnToken::WithLogprobs(n, _) => Some(n),
        _ => None,
    };
    let mut logits = Vec::new();
    // the backend's choice (pick path)
    let mut chosen = None;
    if req.max_tokens == 0 {
        model.prefill(rest, &mut state)?;
    } else if pick {
        chosen = Some(model.prefill_pick(rest, &mut state, &mut sampler, lp_n)?);
    } else {
        logits = model.prefill(rest, &mut state)?;
    }
    last = seqs.save(model, prompt, &state, last);
    let prefill = t0.elapsed();
    let mut detok = StreamDecoder::new(true);
    let mut stops = StopMatcher::new(&req.stop_strings);
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut ttft = Duration::ZERO;
    let mut finish = FinishReason::Length;
    let mut stop_string = false;
    let mut t_first = Instant::now();
    // every choice in order, the stop id and a refused one included: the
    // state was fed a prefix of these
    let mut choices = Vec::new();
    // One chosen token through the stop ids, the observer, the detokenizer
    // and the stop strings; true: go on to the next one.
    let mut take =
        |next: u32, logits: &[f32], lp: Option<&Logprobs>, sampler: &mut Sampler| -> Result<bool> {
            choices.push(next);
            if tokens.is_empty() {
                ttft = t0.elapsed();
                t_first = Instant::now();
            }
            if req.stop_ids.contains(&next) {
                finish = FinishReason::Stop;
                return Ok(false);
            }
            let go_on = match &mut on_token {
                OnToken::Id(f) => f(next),
                OnToken::WithLogprobs(_, f) => f(next, lp.expect("logprobs picked with the token")),
                OnToken::WithLogits(f) => f(next, logits),
            };
            if !go_on {
                finish = FinishReason::Cancelled;
                return Ok(false);
            }
            sampler.accept(next);
            tokens.push(next);
            let piece = detok.push(tok, next)?;
            let (out, matched) = stops.push(&piece);
            text.push_str(&out);
            if !(out.is_empty() || on_text(&out)) {
                finish = FinishReason::Cancelled;
                return Ok(false);
            }
            if matched {
                finish = FinishReason::Stop;
                stop_string = true;
                return Ok(false);
            }
            Ok(tokens.len() < req.max_tokens)
        };
    if let Some(first) = chosen {
        // the backend chooses: after the first token it may keep steps
        // queued ahead of the host (the state then holds one more choice,
        // which the saved snapshot accounts for)
        if take(first.id, &[], first.logprobs.as_ref(), &mut sampler)? {
            if lp_n.is_none() {
                model.decode_pick_run(
                    first.id,
                    &mut state,
                    &mut sampler,
                    req.max_tokens - 1,
                    &mut |id, sampler| take(id, &[], None, sampler),
                )?;
            } else {
                let mut t = first.id;
                loop {
                    let p = model.decode_pick(t, &mut state, &mut sampler, lp_n)?;
                    if !take(p.id, &[], p.logprobs.as_ref(), &mut sampler)? {
                        break;
                    }
                    t = p.id;
                }
            }
        }
    } else if req.max_tokens > 0 {
        let mut next = sampler.sample(&logits);
        while take(next, &logits, None, &mut sampler)? {
            logits = model.decode(next, &mut state)?;
            next = sampler.sample(&logits);
        }
    }
    if !stop_string && finish != FinishReason::Cancelled {
        // Flush what the detokenizer and the stop matcher still hold: it was
        // no stop string after all.
        let tail = detok.finish(tok)?;
        let (out, _) = stops.push(&tail);
        let rest = stops.finish();
        let tail = out + &rest;
        text.push_str(&tail);
        if !tail.is_empty() {
            on_text(&tail);
        }
    }
    // The state holds the prompt and as many choices as it was fed (a
    // backend may have fed one past the stop): save exactly that.
    let fed = model.position(&state).saturating_sub(prompt.len());
    if fed > 0 && fed <= choices.len() {
        let mut held = prompt.to_vec();
        held.extend_from_slice(&choices[..fed]);
        seqs.save(model, &held, &state, last);
    }
    seqs.finish(state);
    let stats = Stats {
        cached_tokens: cached,
        prompt_tokens: req.prompt.len(),
        generated_tokens: tokens.len(),
        prefill,
        ttft,
        decode: t_first.elapsed(),
    };
    Ok(Generation {
        text,
        tokens,
        finish,
        stats,
    })
}
