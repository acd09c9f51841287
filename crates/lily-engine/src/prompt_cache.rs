//! The prompt cache's index: which token prefixes have a saved sequence
//! state (a snapshot of the KV cache's extent and the recurrent states), found
//! by longest prefix, under a byte budget with least-recently-used eviction.
//!
//! Most of this model's layers are Gated DeltaNet, whose recurrent state
//! cannot be cut back to a prefix the way a KV cache can: a conversation can
//! only resume from a point where its whole state was saved. So the index
//! keys snapshots by the exact token prefix they hold, and a lookup returns
//! the longest saved prefix of a new prompt (never past `max_len`, so that
//! the caller always has a token left to prefill for the next logits).
//!
//! The tree is a radix tree over token ids: each node holds the run of tokens
//! on the edge into it and, maybe, a snapshot of the state after the tokens
//! from the root to its end. It is generic over the snapshot, so the CPU and
//! CUDA backends store their own kinds.

use std::collections::HashMap;

/// What the cache has done, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// lookups that found a saved prefix / that found none
    pub hits: u64,
    pub misses: u64,
    /// prompt tokens the hits covered (not prefilled again)
    pub hit_tokens: u64,
    /// snapshots dropped to stay under the budget
    pub evictions: u64,
    /// bytes the held snapshots take, and how many there are
    pub bytes: usize,
    pub entries: usize,
}

struct Entry<S> {
    snapshot: S,
    bytes: usize,
    /// the lookup or insert that last touched it (larger: more recent)
    used: u64,
}

struct Node<S> {
    /// tokens on the edge from the parent into this node
    edge: Vec<u32>,
    parent: usize,
    /// children by the first token of their edge
    children: HashMap<u32, usize>,
    entry: Option<Entry<S>>,
}

/// Longest-prefix index of snapshots, bounded by `budget` bytes.
pub struct PrefixIndex<S> {
    /// node 0 is the root (empty edge, never an entry); freed slots are reused
    nodes: Vec<Option<Node<S>>>,
    free: Vec<usize>,
    budget: usize,
    clock: u64,
    stats: CacheStats,
}

/// A lookup's result: how many leading tokens the snapshot holds, and it.
pub struct Hit<'a, S> {
    pub len: usize,
    pub snapshot: &'a S,
}

impl<S> PrefixIndex<S> {
    /// An empty index that holds at most `budget` bytes of snapshots.
    pub fn new(budget: usize) -> PrefixIndex<S> {
        PrefixIndex {
            nodes: vec![Some(Node {
                edge: Vec::new(),
                parent: 0,
                children: HashMap::new(),
                entry: None,
            })],
            free: Vec::new(),
            budget,
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    fn node(&self, i: usize) -> &Node<S> {
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<S> {
        self.nodes[i].as_mut().expect("a live node")
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest prefix of `tokens` of at most `max_len` tokens that holds
    /// a snapshot, marked as just used; counts a hit or a miss.
    pub fn lookup(&mut self, tokens: &[u32], max_len: usize) -> Option<Hit<'_, S>> {
        let tokens = &tokens[..tokens.len().min(max_len)];
        let (mut at, mut depth) = (0usize, 0usize);
        let mut best: Option<(usize, usize)> = None;
        loop {
            if depth > 0 && self.node(at).entry.is_some() {
                best = Some((at, depth));
            }
            let Some(&next) = tokens
                .get(depth)
                .and_then(|t| self.node(at).children.get(t))
            else {
                break;
            };
            let edge = &self.node(next).edge;
            if tokens.len() - depth < edge.len() || tokens[depth..depth + edge.len()] != edge[..] {
                break;
            }
            depth += edge.len();
            at = next;
        }
        let Some((node, len)) = best else {
            self.stats.misses += 1;
            return None;
        };
        let now = self.tick();
        self.stats.hits += 1;
        self.stats.hit_tokens += len as u64;
        let e = self.node_mut(node).entry.as_mut().expect("an entry");
        e.used = now;
        Some(Hit {
            len,
            snapshot: &e.snapshot,
        })
    }

    /// Whether a snapshot of exactly `tokens` is held (marked as just used if so).
    pub fn holds(&mut self, tokens: &[u32]) -> bool {
        let (mut at, mut depth) = (0usize, 0usize);
        while depth < tokens.len() {
            let Some(&next) = self.node(at).children.get(&tokens[depth]) else {
                return false;
            };
            let edge = &self.node(next).edge;
            if tokens.len() - depth < edge.len() || tokens[depth..depth + edge.len()] != edge[..] {
                return false;
            }
            depth += edge.len();
            at = next;
        }
        let now = self.tick();
        match self.node_mut(at).entry.as_mut() {
            Some(e) if at != 0 => {
                e.used = now;
                true
            }
            _ => false,
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Save `snapshot` (taking `bytes`) as the state after `tokens`, replacing
    /// one saved there before; then evict the least recently used others
    /// while over the budget. A snapshot larger than the whole budget is not
    /// kept. Returns whether it is held.
    pub fn insert(&mut self, tokens: &[u32], snapshot: S, bytes: usize) -> bool {
        if tokens.is_empty() || bytes > self.budget {
            return false;
        }
        let node = self.node_for(tokens);
        let used = self.tick();
        let old = self.node_mut(node).entry.replace(Entry {
            snapshot,
            bytes,
            used,
        });
        match old {
            Some(o) => self.stats.bytes -= o.bytes,
            None => self.stats.entries += 1,
        }
        self.stats.bytes += bytes;
        while self.stats.bytes > self.budget {
            let victim = self
                .least_recent(node)
                .expect("over budget with no other entry");
            self.remove_entry(victim);
            self.stats.evictions += 1;
        }
        true
    }

    /// The node whose path from the root is exactly `tokens`, splitting an
    /// edge or adding a leaf as needed.
    fn node_for(&mut self, tokens: &[u32]) -> usize {
        let (mut at, mut depth) = (0usize, 0usize);
        while depth < tokens.len() {
            let first = tokens[depth];
            let Some(&next) = self.node(at).children.get(&first) else {
                let leaf = self.alloc(Node {
                    edge: tokens[depth..].to_vec(),
                    parent: at,
                    children: HashMap::new(),
                    entry: None,
                });
                self.node_mut(at).children.insert(first, leaf);
                return leaf;
            };
            let edge = &self.node(next).edge;
            let common = edge
                .iter()
                .zip(&tokens[depth..])
                .take_while(|(a, b)| a == b)
                .count();
            if common == edge.len() {
                depth += common;
                at = next;
                continue;
            }
            // split next's edge after `common` tokens: a middle node takes the shared part
            let rest = self.node(next).edge[common..].to_vec();
            let mid = self.alloc(Node {
                edge: tokens[depth..depth + common].to_vec(),
                parent: at,
                children: HashMap::from([(rest[0], next)]),
                entry: None,
            });
            let n = self.node_mut(next);
            n.edge = rest;
            n.parent = mid;
            self.node_mut(at).children.insert(first, mid);
            depth += common;
            at = mid;
        }
        at
    }

    fn alloc(&mut self, n: Node<S>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// The entry least recently used, other than `keep`'s.
    fn least_recent(&self, keep: usize) -> Option<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != keep)
            .filter_map(|(i, n)| Some((i, n.as_ref()?.entry.as_ref()?.used)))
            .min_by_key(|&(_, used)| used)
            .map(|(i, _)| i)
    }

    /// Drop node `i`'s snapshot, then the nodes that no longer lead to one: a
    /// leaf without an entry goes, and a node left with one child and no
    /// entry merges into that child.
    fn remove_entry(&mut self, i: usize) {
        if let Some(e) = self.node_mut(i).entry.take() {
            self.stats.bytes -= e.bytes;
            self.stats.entries -= 1;
        }
        let mut at = i;
        while at != 0 {
            let n = self.node(at);
            if n.entry.is_some() {
                break;
            }
            let parent = n.parent;
            match n.children.len() {
                0 => {
                    let first = n.edge[0];
                    self.node_mut(parent).children.remove(&first);
                    self.nodes[at] = None;
                    self.free.push(at);
                    at = parent;
                }
                1 => {
                    let child = *n.children.values().next().expect("one child");
                    let node = self.nodes[at].take().expect("a live node");
                    self.free.push(at);
                    let c = self.node_mut(child);
                    let mut edge = node.edge;
                    edge.extend_from_slice(&c.edge);
                    c.edge = edge;
                    c.parent = parent;
                    let first = c.edge[0];
                    self.node_mut(parent).children.insert(first, child);
                    break;
                }
                _ => break,
            }
        }
    }

    /// Drop every snapshot.
    pub fn clear(&mut self) {
        let budget = self.budget;
        let stats = self.stats;
        *self = PrefixIndex::new(budget);
        self.stats = CacheStats {
            bytes: 0,
            entries: 0,
            ..stats
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(a: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| a * 1000 + i).collect()
    }

    #[test]
    fn a_growing_conversation_resumes_from_its_last_turn() {
        let mut c = PrefixIndex::new(1 << 20);
        let turn1 = seq(1, 50);
        assert!(c.lookup(&turn1, turn1.len() - 1).is_none());
        c.insert(&turn1, "after turn 1", 10);
        // the next prompt holds turn 1, the answer and a new message
        let mut turn2 = turn1.clone();
        turn2.extend(seq(2, 30));
        let h = c.lookup(&turn2, turn2.len() - 1).unwrap();
        assert_eq!((h.len, *h.snapshot), (50, "after turn 1"));
        c.insert(&turn2, "after turn 2", 10);
        let mut turn3 = turn2.clone();
        turn3.extend(seq(3, 5));
        let h = c.lookup(&turn3, turn3.len() - 1).unwrap();
        assert_eq!((h.len, *h.snapshot), (80, "after turn 2"));
        let s = c.stats();
        assert_eq!(
            (s.hits, s.misses, s.hit_tokens, s.entries, s.bytes),
            (2, 1, 130, 2, 20)
        );
    }

    #[test]
    fn holds_finds_exact_entries_only() {
        let mut c = PrefixIndex::new(1 << 20);
        let p = seq(1, 20);
        c.insert(&p[..10], 1, 1);
        assert!(c.holds(&p[..10]));
        assert!(!c.holds(&p[..9]) && !c.holds(&p) && !c.holds(&[]));
        c.insert(&p, 2, 1);
        assert!(c.holds(&p));
        assert_eq!(c.stats().hits + c.stats().misses, 0, "holds is no lookup");
    }

    #[test]
    fn a_lookup_leaves_a_token_to_prefill() {
        let mut c = PrefixIndex::new(1 << 20);
        let p = seq(1, 20);
        c.insert(&p, 1, 1);
        c.insert(&p[..10], 2, 1);
        // the same prompt again: the whole-prompt snapshot would leave nothing to prefill
        let h = c.lookup(&p, p.len() - 1).unwrap();
        assert_eq!((h.len, *h.snapshot), (10, 2));
        assert_eq!(c.lookup(&p, p.len()).unwrap().len, 20);
    }

    #[test]
    fn a_regenerated_turn_branches_from_the_shared_history() {
        let mut c = PrefixIndex::new(1 << 20);
        let history = seq(1, 40);
        c.insert(&history, "history", 1);
        let mut a = history.clone();
        a.extend(seq(2, 10));
        c.insert(&a, "answer a", 1);
        // the last message replaced: a different continuation of the history
        let mut b = history.clone();
        b.extend(seq(3, 12));
        let h = c.lookup(&b, b.len() - 1).unwrap();
        assert_eq!((h.len, *h.snapshot), (40, "history"));
        c.insert(&b, "answer b", 1);
        // both branches stay findable
        a.push(7);
        b.push(7);
        assert_eq!(*c.lookup(&a, a.len() - 1).unwrap().snapshot, "answer a");
        assert_eq!(*c.lookup(&b, b.len() - 1).unwrap().snapshot, "answer b");
    }

    #[test]
    fn conversations_sharing_a_system_prompt_never_see_each_other() {
        let mut c = PrefixIndex::new(1 << 20);
        let system = seq(9, 100);
        c.insert(&system, "system", 1);
        let mut x = system.clone();
        x.extend(seq(1, 20));
        let mut y = system.clone();
        y.extend(seq(2, 20));
        c.insert(&x, "x", 1);
        // y shares only the system prompt with x: it gets the system snapshot
        let h = c.lookup(&y, y.len() - 1).unwrap();
        assert_eq!((h.len, *h.snapshot), (100, "system"));
        // a prompt that diverges inside the system prompt gets nothing
        let mut z = system[..60].to_vec();
        z.extend(seq(3, 50));
        assert!(c.lookup(&z, z.len() - 1).is_none());
        // a snapshot inside an edge is not found past where the prompt diverges
        c.insert(&system[..30], "inside", 1);
        assert_eq!(c.lookup(&z, z.len() - 1).unwrap().len, 30);
    }

    #[test]
    fn eviction_drops_the_least_recently_used_under_a_tiny_budget() {
        let mut c = PrefixIndex::new(30);
        let (a, b, d) = (seq(1, 10), seq(2, 10), seq(3, 10));
        c.insert(&a, "a", 10);
        c.insert(&b, "b", 10);
        c.insert(&d, "d", 10);
        // a is used again: b is now the oldest
        let mut a2 = a.clone();
        a2.push(5);
        assert!(c.lookup(&a2, 10).is_some());
        c.insert(&seq(4, 10), "e", 10);
        let mut b2 = b.clone();
        b2.push(5);
        assert!(c.lookup(&b2, 10).is_none(), "b was the least recently used");
        assert!(c.lookup(&a2, 10).is_some());
        let s = c.stats();
        assert_eq!((s.evictions, s.entries, s.bytes), (1, 3, 30));
        // larger than the whole budget: not kept, nothing evicted for it
        assert!(!c.insert(&seq(5, 10), "huge", 31));
        assert_eq!(c.stats().evictions, 1);
        // one that needs two evictions
        c.insert(&seq(6, 10), "big", 25);
        let s = c.stats();
        assert_eq!((s.evictions, s.entries, s.bytes), (4, 1, 25));
    }

    #[test]
    fn snapshots_inside_a_long_prompt_and_replacement() {
        let mut c = PrefixIndex::new(1 << 20);
        let long = seq(1, 10_000);
        for cut in [4096, 8192] {
            c.insert(&long[..cut], cut, 1);
        }
        c.insert(&long, 10_000, 1);
        let mut other = long[..9000].to_vec();
        other.extend(seq(2, 100));
        assert_eq!(*c.lookup(&other, other.len() - 1).unwrap().snapshot, 8192);
        // the same prefix saved again replaces the snapshot, bytes counted once
        c.insert(&long[..8192], 1, 5);
        assert_eq!(*c.lookup(&other, other.len() - 1).unwrap().snapshot, 1);
        assert_eq!((c.stats().entries, c.stats().bytes), (3, 7));
    }

    #[test]
    fn evicted_branches_are_pruned_and_merged() {
        let mut c = PrefixIndex::new(2);
        let base = seq(1, 10);
        let mut x = base.clone();
        x.extend(seq(2, 5));
        let mut y = base.clone();
        y.extend(seq(3, 5));
        c.insert(&x, "x", 1);
        c.insert(&y, "y", 1); // splits x's edge at 10
        c.insert(&seq(4, 3), "z", 1); // evicts x: its leaf goes, the split merges back
        let live = c.nodes.iter().filter(|n| n.is_some()).count();
        assert_eq!(live, 3, "root, y's merged path, z");
        let mut y2 = y.clone();
        y2.push(1);
        assert_eq!(*c.lookup(&y2, y2.len() - 1).unwrap().snapshot, "y");
        let mut x2 = x.clone();
        x2.push(1);
        assert!(c.lookup(&x2, x2.len() - 1).is_none());
        c.clear();
        assert_eq!((c.stats().entries, c.stats().bytes), (0, 0));
        assert!(c.lookup(&y2, y2.len() - 1).is_none());
    }
}
