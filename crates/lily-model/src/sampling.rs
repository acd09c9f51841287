//! The math of choosing a token from logits, defined once: the greedy choice,
//! the set a sampled choice keeps (top-k, temperature, top-p, min-p) and the
//! draw from it. The engine's sampler chooses with these functions, and a
//! backend that chooses elsewhere (the GPU's sampling kernels) is tested
//! against them, so every path means the same thing by a choice.
//!
//! Ids index `logits`; a caller passes only the real tokens' rows (the
//! model's padding rows excluded).

/// The lowest id holding the largest logit. NaN never wins (none but NaN, or
/// no logits: 0); logits are ordered as `f32::total_cmp` orders them (so
/// `+0.0` beats `-0.0`): exactly the GPU's `argmax_kernel`, so a greedy run
/// gives the same tokens whether the host or the device chooses.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v.total_cmp(&x[b]).is_gt()) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Whether these settings make the choice greedy: the argmax, no draw.
pub fn is_greedy(temperature: f32, top_k: usize) -> bool {
    temperature == 0.0 || top_k == 1
}

/// The tokens a sampled choice may take and their probabilities: ids best
/// first (logit descending, then id ascending; NaN logits are never
/// candidates), cut to the `top_k` best (0 = off), softmax at `temperature`
/// (in f64), then cut to the shortest prefix holding `top_p` of the mass
/// (1 = off) and to the tokens at least `min_p` times as likely as the best
/// (0 = off; the best always stays). The probabilities are normalised over
/// the kept tokens. Greedy settings ([`is_greedy`]) keep the argmax alone;
/// no candidate at all keeps nothing.
pub fn kept(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> (Vec<u32>, Vec<f64>) {
    if is_greedy(temperature, top_k) {
        if logits.iter().all(|x| x.is_nan()) {
            return (Vec::new(), Vec::new());
        }
        return (vec![argmax(logits)], vec![1.0]);
    }
    let (ids, mut probs) = truncated(logits, temperature, top_k, top_p, min_p);
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    (ids, probs)
}

/// The draw from a kept set ([`kept`]) for a uniform `u` in [0, 1): the kept
/// tokens walked best first, the first whose probability exceeds what is left
/// of `u`.
pub fn pick(kept: &(Vec<u32>, Vec<f64>), u: f64) -> u32 {
    let (ids, probs) = kept;
    pick_in_order(ids.iter().copied().zip(probs.iter().copied()), u)
}

/// The draw for `u` walking `(id, probability)` pairs in the order given:
/// the first token whose probability exceeds what is left of `u`. Where
/// rounding leaves some of `u` after the last token, the last token; no
/// tokens: 0. [`pick`] walks best first; a backend that walks the same set in
/// another order (by id) draws differently for the same `u`, with the same
/// probabilities.
pub fn pick_in_order(kept: impl IntoIterator<Item = (u32, f64)>, u: f64) -> u32 {
    let mut u = u;
    let mut last = 0;
    for (id, q) in kept {
        if u < q {
            return id;
        }
        u -= q;
        last = id;
    }
    last
}

/// The whole choice: the argmax for greedy settings, else a draw from the
/// kept set, with the uniform in [0, 1) that `draw` gives, taken only for a
/// sampled choice among at least one candidate (so a seeded stream of
/// uniforms advances exactly when a choice consumes one).
///
/// The draw is `u * total` walked over the kept probabilities as normalised
/// over the top-k candidates, `total` their sum: [`pick`] on [`kept`] for the
/// same `u` up to rounding, and the arithmetic that fixes which token a
/// seed gives.
pub fn sample(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    draw: impl FnOnce() -> f64,
) -> u32 {
    if is_greedy(temperature, top_k) {
        return argmax(logits);
    }
    let (ids, probs) = truncated(logits, temperature, top_k, top_p, min_p);
    if ids.is_empty() {
        return 0;
    }
    let total: f64 = probs.iter().sum();
    pick_in_order(ids.into_iter().zip(probs), draw() * total)
}

/// The kept set of [`kept`] before its renormalisation: the probabilities
/// are those of the softmax over the top-k candidates.
fn truncated(
    l: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> (Vec<u32>, Vec<f64>) {
    let mut idx: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| !l[i as usize].is_nan())
        .collect();
    if idx.is_empty() {
        return (idx, Vec::new());
    }
    let by_logit = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
    if top_k > 0 && top_k < idx.len() {
        idx.select_nth_unstable_by(top_k - 1, by_logit);
        idx.truncate(top_k);
    }
    idx.sort_unstable_by(by_logit);
    let t = temperature as f64;
    let m = l[idx[0] as usize] as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| ((l[i as usize] as f64 - m) / t).exp())
        .collect();
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= z);
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (i, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let floor = min_p as f64 * probs[0];
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    idx.truncate(keep);
    probs.truncate(keep);
    (idx, probs)
}
