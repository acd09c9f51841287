//! Choosing the next token from logits: a request's settings, penalties, and
//! a seeded generator so a run can be repeated exactly. Temperature, top-k,
//! top-p and min-p are `lily_model::sampling`'s math.

use std::path::Path;

use anyhow::{bail, Context, Result};
use lily_model::sampling;
use serde_json::Value;

pub use lily_model::sampling::argmax;

/// Sampling settings of one request. `temperature == 0` is greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = off
    pub top_k: usize,
    /// 1 = off
    pub top_p: f32,
    /// 0 = off: drop tokens below `min_p * p(best)`
    pub min_p: f32,
    /// OpenAI-style, over generated tokens: `logit -= presence * [count > 0]`
    pub presence_penalty: f32,
    /// OpenAI-style, over generated tokens: `logit -= frequency * count`
    pub frequency_penalty: f32,
    /// HF/vLLM-style, over prompt and generated tokens: positive logits are
    /// divided by it, negative ones multiplied. 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI-style: (token id, bias added to its logit before the penalties)
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature must be >= 0, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            );
        }
        if let Some(&(t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            bail!("logit_bias of token {t} must be in [-100, 100], got {b}");
        }
        for (k, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{k} must be in [-2, 2], got {v}");
            }
        }
        Ok(())
    }
}

/// Per-request changes to the sampling defaults (CLI flags, API fields):
/// anything `None` keeps the default; the seed is always the request's own.
#[derive(Clone, Debug, Default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// `defaults` with these overrides applied, validated.
    pub fn apply(&self, defaults: &SamplingParams) -> Result<SamplingParams> {
        let mut p = defaults.clone();
        for (dst, v) in [
            (&mut p.temperature, self.temperature),
            (&mut p.top_p, self.top_p),
            (&mut p.min_p, self.min_p),
            (&mut p.presence_penalty, self.presence_penalty),
            (&mut p.frequency_penalty, self.frequency_penalty),
            (&mut p.repetition_penalty, self.repetition_penalty),
        ] {
            if let Some(v) = v {
                *dst = v;
            }
        }
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        p.seed = self.seed;
        p.validate()?;
        Ok(p)
    }
}

/// What a checkpoint's `generation_config.json` says: sampling defaults and
/// the end-of-sequence ids.
#[derive(Clone, Debug)]
pub struct GenerationConfig {
    pub sampling: SamplingParams,
    pub eos_token_ids: Vec<u32>,
}

impl GenerationConfig {
    /// Qwen3.6's published `generation_config.json` (MODEL.md 1.4), used when a
    /// checkpoint has none.
    pub fn qwen_default() -> GenerationConfig {
        GenerationConfig {
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 20,
                top_p: 0.95,
                ..SamplingParams::greedy()
            },
            eos_token_ids: vec![248_046, 248_044],
        }
    }

    pub fn from_dir(dir: &Path) -> Result<Option<GenerationConfig>> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Ok(Some(GenerationConfig::from_json(&v)))
    }

    pub fn from_json(v: &Value) -> GenerationConfig {
        let f = |k: &str, d: f32| {
            v.get(k)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .unwrap_or(d)
        };
        let do_sample = v.get("do_sample").and_then(Value::as_bool).unwrap_or(false);
        let mut s = SamplingParams {
            temperature: f("temperature", 1.0),
            top_k: v.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize,
            top_p: f("top_p", 1.0),
            min_p: f("min_p", 0.0),
            presence_penalty: f("presence_penalty", 0.0),
            frequency_penalty: f("frequency_penalty", 0.0),
            repetition_penalty: f("repetition_penalty", 1.0),
            logit_bias: Vec::new(),
            seed: None,
        };
        if !do_sample {
            s.temperature = 0.0;
        }
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect(),
            _ => vec![],
        };
        GenerationConfig {
            sampling: s,
            eos_token_ids,
        }
    }
}

/// PCG32: small, fast, seedable; the stream of a seed never changes.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut r = Rng {
            state: seed.wrapping_add(0x853C_49E6_748F_EA9B),
        };
        r.next_u32();
        r
    }
    pub fn next_u32(&mut self) -> u32 {
        let old = self.state;
        self.state = old
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        xorshifted.rotate_right(rot)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        let hi = (self.next_u32() >> 5) as u64;
        let lo = (self.next_u32() >> 6) as u64;
        ((hi << 26) | lo) as f64 / (1u64 << 53) as f64
    }
}

/// Log-probabilities of one step (a log-softmax over the real tokens'
/// logits, before penalties and temperature): of the chosen token, and of
/// the `n` most likely, most likely first (the lower id first on a tie).
/// `-inf` where a token is impossible.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logprobs {
    pub chosen: f32,
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    /// `log_softmax(logits[..valid])` at `id`, and its `n` largest entries;
    /// NaN logits are not tokens.
    pub fn of(logits: &[f32], valid: usize, id: u32, n: usize) -> Logprobs {
        let l = &logits[..valid.min(logits.len())];
        let m = l
            .iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = if m.is_finite() {
            m as f64
                + l.iter()
                    .filter(|x| !x.is_nan())
                    .map(|&x| ((x - m) as f64).exp())
                    .sum::<f64>()
                    .ln()
        } else {
            0.0
        };
        let lp = |x: f32| (x as f64 - lse) as f32;
        let mut top = Vec::new();
        if n > 0 {
            let mut idx: Vec<u32> = (0..l.len() as u32)
                .filter(|&i| !l[i as usize].is_nan())
                .collect();
            let by = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
            if n < idx.len() {
                idx.select_nth_unstable_by(n - 1, by);
                idx.truncate(n);
            }
            idx.sort_unstable_by(by);
            top = idx.into_iter().map(|i| (i, lp(l[i as usize]))).collect();
        }
        let x = l.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
        Logprobs { chosen: lp(x), top }
    }

    /// A step forced to `id`: what [`Logprobs::of`] gives for logits that
    /// allow only it (among `valid` ids).
    pub fn forced(id: u32, valid: usize, n: usize) -> Logprobs {
        let mut top = Vec::new();
        if n > 0 {
            top.push((id, 0.0));
            top.extend(
                (0..valid as u32)
                    .filter(|&i| i != id)
                    .take(n - 1)
                    .map(|i| (i, f32::NEG_INFINITY)),
            );
        }
        Logprobs { chosen: 0.0, top }
    }
}

/// Per-request sampler: holds the generator and the token counts the
/// penalties need.
pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
    /// Real token ids are below this; the rest of the model's rows are padding.
    valid: usize,
    /// counts of generated tokens (presence / frequency penalties)
    counts: std::collections::HashMap<u32, u32>,
    /// every token seen, prompt included (repetition penalty)
    seen: std::collections::HashSet<u32>,
    /// tokens accepted so far
    generated: usize,
    /// this sampler among all (a backend keeping penalty state tells requests apart by it)
    id: u64,
}

static SAMPLER_IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Sampler {
    pub fn new(params: SamplingParams, valid_vocab: usize, prompt: &[u32]) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
        });
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            Default::default()
        };
        Sampler {
            params,
            rng: Rng::new(seed),
            valid: valid_vocab,
            counts: Default::default(),
            seen,
            generated: 0,
            id: SAMPLER_IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// This sampler's id, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Tokens accepted so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Record a token that was emitted (it feeds the penalties).
    pub fn accept(&mut self, tok: u32) {
        self.generated += 1;
        *self.counts.entry(tok).or_default() += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(tok);
        }
    }

    /// Ids below this are real tokens; the rest of the model's rows are padding.
    pub fn valid_vocab(&self) -> usize {
        self.valid
    }

    /// Greedy: the choice is the argmax and draws nothing.
    pub fn is_greedy(&self) -> bool {
        sampling::is_greedy(self.params.temperature, self.params.top_k)
    }

    /// Whether the choice depends on nothing but the logits (and, when
    /// sampled, one uniform draw): no penalty is set. A backend may then make
    /// it where the logits are (`Model::prefill_pick` / `decode_pick`).
    pub fn logits_only(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logit_bias.is_empty()
    }

    /// The logits with the logit bias added (what log-probabilities are
    /// reported from), restricted to real tokens.
    pub fn biased<'a>(&self, logits: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        let l = &logits[..self.valid.min(logits.len())];
        if self.params.logit_bias.is_empty() {
            return std::borrow::Cow::Borrowed(l);
        }
        let mut l = l.to_vec();
        for &(t, b) in &self.params.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += b;
            }
        }
        std::borrow::Cow::Owned(l)
    }

    /// The uniform in [0, 1) that a sampled choice made elsewhere (on the
    /// device) consumes: the draw [`Sampler::sample`] would make, from the
    /// same seeded stream, so a seed repeats a run either way. Take it only
    /// for a sampled choice (`!is_greedy()`), as `sample` does.
    pub fn draw(&mut self) -> f64 {
        self.rng.uniform()
    }

    /// Tokens the repetition penalty applies to (prompt and generated; empty
    /// when it is off), and the counts of generated tokens the presence and
    /// frequency penalties use: what a backend that applies the penalties
    /// itself starts a request from.
    pub fn penalty_tokens(&self) -> (Vec<u32>, Vec<(u32, u32)>) {
        (
            self.seen.iter().copied().collect(),
            self.counts.iter().map(|(&t, &c)| (t, c)).collect(),
        )
    }

    /// The logits after the logit bias and the penalties, restricted to real tokens.
    pub fn penalized(&self, logits: &[f32]) -> Vec<f32> {
        let p = &self.params;
        let mut l = self.biased(logits).into_owned();
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        l
    }

    /// Pick the next token: penalties, then [`lily_model::sampling::sample`]
    /// with this request's settings, drawing from its seeded stream.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let l = self.penalized(logits);
        let p = &self.params;
        let rng = &mut self.rng;
        sampling::sample(&l, p.temperature, p.top_k, p.top_p, p.min_p, || {
            rng.uniform()
        })
    }
}
