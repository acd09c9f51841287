//! Sequence states across requests: an idle state kept for the next request
//! (its KV cache allocated and its decode graphs captured once, not per
//! request) and the prompt cache, snapshots of states found by the longest
//! token prefix of a new prompt ([`PrefixIndex`]).
//!
//! Where snapshots are taken, and why there:
//! - the end of every prompt: the next turn of a conversation starts with it;
//! - the end of every generation, holding exactly the tokens the state was
//!   fed (a backend may have fed one choice past the stop: it is counted,
//!   not guessed);
//! - marks the caller names inside the prompt (chat-message boundaries, see
//!   [`chat_marks`]): a regenerated turn or a shared system prompt resumes there;
//! - every `interval` tokens of a long prompt, so a prompt that shares a long
//!   document with an earlier one resumes near where they part.
//!
//! A point less than [`MIN_GAP`] tokens past where prefill resumed is
//! skipped: resuming a few tokens earlier costs less than another snapshot.

use anyhow::Result;

use crate::generate::Model;
use crate::prompt_cache::{CacheStats, PrefixIndex};

/// Snapshot points closer than this to the resume point are not taken.
pub const MIN_GAP: usize = 64;

/// How much the prompt cache may hold, and how often it saves inside a long prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    /// bytes of snapshots held at most (0: no prompt cache)
    pub budget: usize,
    /// a snapshot every this many tokens inside a prompt (0: none)
    pub interval: usize,
}

impl CacheOptions {
    /// No prompt cache (states are still reused).
    pub fn off() -> CacheOptions {
        CacheOptions {
            budget: 0,
            interval: 0,
        }
    }

    /// A cache of `mib` MiB with snapshots every 8,192 tokens of a prompt.
    pub fn mib(mib: usize) -> CacheOptions {
        CacheOptions {
            budget: mib << 20,
            interval: 8192,
        }
    }
}

/// Where a request's prefill starts: a state holding the first `cached`
/// tokens of its prompt.
pub struct Begun<St> {
    pub state: St,
    pub cached: usize,
}

pub struct Sequences<St, Sn> {
    idle: Option<St>,
    index: PrefixIndex<Sn>,
    opts: CacheOptions,
    /// snapshots that could not be taken (out of device memory): the cache
    /// was emptied to give the memory back
    failed: u64,
}

impl<St, Sn> Sequences<St, Sn> {
    pub fn new(opts: CacheOptions) -> Sequences<St, Sn> {
        Sequences {
            idle: None,
            index: PrefixIndex::new(opts.budget),
            opts,
            failed: 0,
        }
    }

    pub fn options(&self) -> CacheOptions {
        self.opts
    }

    pub fn stats(&self) -> CacheStats {
        self.index.stats()
    }

    /// Snapshots that failed (each emptied the cache).
    pub fn failed(&self) -> u64 {
        self.failed
    }

    /// Drop every snapshot (the idle state stays).
    pub fn clear(&mut self) {
        self.index.clear();
    }

    /// Drop every snapshot and the idle state (after a failure that may have
    /// left either half written); the counts go on.
    pub fn drop_all(&mut self) {
        self.index.clear();
        self.idle = None;
    }

    /// A state for `prompt`: the idle one (or a new one), holding the longest
    /// cached prefix of it, at most `prompt.len() - 1` tokens so that one is
    /// left to prefill for the next logits.
    pub fn begin<M>(&mut self, model: &M, prompt: &[u32]) -> Result<Begun<St>>
    where
        M: Model<State = St, Snapshot = Sn> + ?Sized,
    {
        let mut state = match self.idle.take() {
            Some(s) => s,
            None => model.new_state()?,
        };
        let hit = if self.opts.budget > 0 && prompt.len() > 1 {
            self.index.lookup(prompt, prompt.len() - 1)
        } else {
            None
        };
        let cached = match hit {
            Some(h) => {
                model.restore(h.snapshot, &mut state)?;
                h.len
            }
            None => {
                model.reset(&mut state)?;
                0
            }
        };
        debug_assert_eq!(model.position(&state), cached);
        Ok(Begun { state, cached })
    }

    /// Where to stop inside `prompt[from..len]` to take a snapshot: `marks`
    /// and multiples of the interval, ascending, each at least [`MIN_GAP`]
    /// past the one before (and past `from`), strictly inside the prompt.
    pub fn points(&self, from: usize, len: usize, marks: &[usize]) -> Vec<usize> {
        if self.opts.budget == 0 {
            return Vec::new();
        }
        let mut p: Vec<usize> = marks.to_vec();
        if self.opts.interval > 0 {
            p.extend(
                (1..)
                    .map(|k| k * self.opts.interval)
                    .take_while(|&x| x < len),
            );
        }
        p.sort_unstable();
        let mut out: Vec<usize> = Vec::new();
        let mut last = from;
        for x in p {
            if x < len && x >= last + MIN_GAP {
                out.push(x);
                last = x;
            }
        }
        out
    }

    /// Save `state` as holding exactly `tokens` (its position must be
    /// `tokens.len()`), unless that prefix is held already. A snapshot that
    /// cannot be taken (device memory) empties the cache instead of failing
    /// the request.
    pub fn save<M>(&mut self, model: &M, tokens: &[u32], state: &St)
    where
        M: Model<State = St, Snapshot = Sn> + ?Sized,
    {
        if self.opts.budget == 0 || tokens.is_empty() || model.position(state) != tokens.len() {
            return;
        }
        if self.index.holds(tokens) {
            return;
        }
        match model.snapshot(state) {
            Ok(snap) => {
                let bytes = model.snapshot_bytes(&snap);
                self.index.insert(tokens, snap, bytes);
            }
            Err(_) => {
                self.failed += 1;
                self.index.clear();
            }
        }
    }

    /// `state` is done with: keep it for the next request.
    pub fn finish(&mut self, state: St) {
        self.idle = Some(state);
    }
}

/// The chat-message boundaries worth a snapshot in a rendered chat prompt:
/// the end of the first message (a system prompt other conversations share)
/// and the start of the last message before the one the prompt opens for
/// the answer (where a regenerated turn with another message parts). A
/// message starts at a `start` token (`<|im_start|>`).
pub fn chat_marks(prompt: &[u32], start: u32) -> Vec<usize> {
    let at: Vec<usize> = prompt
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t == start)
        .map(|(i, _)| i)
        .collect();
    let mut marks = Vec::new();
    if let Some(&second) = at.get(1) {
        marks.push(second);
    }
    if at.len() >= 3 {
        marks.push(at[at.len() - 2]);
    }
    marks.dedup();
    marks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_keep_their_distance() {
        let s: Sequences<(), ()> = Sequences::new(CacheOptions {
            budget: 1,
            interval: 1000,
        });
        assert_eq!(
            s.points(0, 2500, &[10, 500, 530, 1020]),
            vec![500, 1000, 2000]
        );
        assert_eq!(
            s.points(990, 2500, &[]),
            vec![2000],
            "1000 is too close to 990"
        );
        assert_eq!(
            s.points(0, 1000, &[999, 1000]),
            vec![999],
            "the end is saved anyway"
        );
        let off: Sequences<(), ()> = Sequences::new(CacheOptions::off());
        assert!(off.points(0, 100_000, &[500]).is_empty());
    }

    #[test]
    fn chat_marks_find_the_first_and_the_last_message() {
        let s = 7;
        // system, user, assistant, user, assistant header
        let p = [s, 1, 1, s, 2, 2, s, 3, 3, s, 4, 4, s, 5];
        assert_eq!(chat_marks(&p, s), vec![3, 9]);
        assert_eq!(chat_marks(&[s, 1, s, 2], s), vec![2]);
        assert!(chat_marks(&[1, 2, 3], s).is_empty());
    }
}
