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
            m.restore(hit.snapshot, &mut st).unwrap();
            hit.len
        }
        None => 0,
    };
    assert_eq!(m.position(&st), from);
    let logits = Forward::prefill(m, &prompt[from..], &mut st).unwrap();
    let snap = m.snapshot(&st).unwrap();
    let bytes = m.snapshot_bytes(&snap);
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
            m.snapshot(&st).unwrap()
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
