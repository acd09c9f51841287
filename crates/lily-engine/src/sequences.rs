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
//! A point is saved only `min_gap` tokens or more past the last snapshot on
//! the request's path (where it resumed, or the last point it saved): a
//! snapshot holds the recurrent states, about 63 MiB on the full model, and
//! the KV rows up to it, and resuming a few tokens earlier costs less.

use anyhow::Result;

use crate::generate::Model;
use crate::prompt_cache::{CacheStats, PrefixIndex};

/// How much the prompt cache may hold, and where it saves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    /// bytes of snapshots held at most (0: no prompt cache)
    pub budget: usize,
    /// a snapshot every this many tokens inside a prompt (0: none)
    pub interval: usize,
    /// tokens a snapshot must be past the last one on its path
    pub min_gap: usize,
}

impl CacheOptions {
    /// No prompt cache (states are still reused).
    pub fn off() -> CacheOptions {
        CacheOptions {
            budget: 0,
            interval: 0,
            min_gap: 0,
        }
    }

    /// A cache of `mib` MiB, saving every 8,192 tokens of a prompt, no two
    /// snapshots of one path closer than 32 tokens.
    pub fn mib(mib: usize) -> CacheOptions {
        CacheOptions {
            budget: mib << 20,
            interval: 8192,
            min_gap: 32,
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
    /// and multiples of the interval, ascending, strictly inside the prompt,
    /// each `min_gap` past the one before (`from` the first).
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
            if x < len && x >= last + self.opts.min_gap.max(1) {
                out.push(x);
                last = x;
            }
        }
        out
    }

    /// Save `state` as holding exactly `tokens` (its position must be
    /// `tokens.len()`) if that is `min_gap` past `since`, the last snapshot
    /// on its path, and not held already. Returns the new last snapshot on
    /// the path. A snapshot that cannot be taken (device memory) empties the
    /// cache instead of failing the request.
    pub fn save<M>(&mut self, model: &M, tokens: &[u32], state: &St, since: usize) -> usize
    where
        M: Model<State = St, Snapshot = Sn> + ?Sized,
    {
        let n = tokens.len();
        if self.opts.budget == 0
            || n < since + self.opts.min_gap.max(1)
            || model.position(state) != n
        {
            return since;
        }
        if self.index.holds(tokens) {
            return n;
        }
        match model.snapshot(state) {
            Ok(snap) => {
                let bytes = model.snapshot_bytes(&snap);
                if self.index.insert(tokens, snap, bytes) {
                    return n;
                }
            }
            Err(_) => {
                self.failed += 1;
                self.index.clear();
            }
        }
        since
    }

    /// `state` is done with: keep it for the next request.
    pub fn finish(&mut self, state: St) {
        self.idle = Some(state);
    }
}

/// The chat-message boundaries worth a snapshot in a rendered chat prompt
/// (a message starts at a `start` token, `<|im_start|>`):
/// - the end of the first message: a system prompt other conversations share;
/// - the start of the answer's header: the next turn parts there when the
///   template renders this answer without the generation prompt's tail (an
///   empty or stripped think block), as Qwen's does for past turns.
///
/// Not the start of the last message: every mark splits the prefill into one
/// more segment (each reads the expert weights), and a turn regenerated with
/// another message still resumes at the previous answer's header.
pub fn chat_marks(prompt: &[u32], start: u32) -> Vec<usize> {
    let at: Vec<usize> = prompt
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t == start)
        .map(|(i, _)| i)
        .collect();
    let mut marks = Vec::new();
    if at.len() >= 2 {
        marks.extend([at[1], at[at.len() - 1]]);
    }
    marks.retain(|&m| m > 0);
    marks.sort_unstable();
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
            min_gap: 64,
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
        assert_eq!(chat_marks(&p, s), vec![3, 12]);
        assert_eq!(chat_marks(&[s, 1, s, 2], s), vec![2]);
        assert!(chat_marks(&[1, 2, 3], s).is_empty());
        assert!(chat_marks(&[s, 1, 2], s).is_empty());
    }
}
