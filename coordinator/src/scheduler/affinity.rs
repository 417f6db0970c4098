//! Prefix affinity: which nodes last ran a prompt's prefix, so placement can
//! send the next turn of a conversation (or the next job with the same
//! system prompt) to a node whose prefix cache already holds it.
//!
//! The idea is the one maintained routers use (SGLang's cache-aware router
//! keeps, per worker, an approximate tree of the text it sent there and
//! prefers the longest match while load is balanced). Here the tree is a
//! bounded map from hash-chain keys of input prefixes to the nodes that
//! last ran them; [`super::fleet`] credits a node holding a match with the
//! prefill of the matched bytes (it prefills only the rest), and orders the
//! candidates within its near-best band by the longest match.
//!
//! # Keys
//! A job's input is cut into segments: each chat message (role and
//! content), or each full [`CHUNK_BYTES`] of a raw prompt (a partial last
//! chunk is left out). Segment `i` is named by a chain `key_i =
//! SHA-256(key_{i-1} || segment_i)` whose first link is the model's digest,
//! so a key names the whole input up to the end of its segment, for one
//! model (a node keeps one prefix cache per model). A key's depth is the
//! input bytes it covers: the weight of a match. Bytes, not tokens: the
//! coordinator does not tokenize, and only the order of matches matters.
//!
//! # Trust
//! Affinity comes only from the coordinator's own placements
//! ([`Affinity::record`]); nothing a node says adds any. A node's reports
//! (its heartbeat's cumulative prompt and prefix-hit counters,
//! [`Report`]) can only take affinity away:
//! - a new session, or counters that went backwards: the node reconnected
//!   or restarted (its cache is likely gone); all its affinity is dropped.
//! - a job placed on it where it held a match ([`Affinity::expect_hit`]),
//!   ended, and [`JUDGE_BEATS`] heartbeats later its hit counter has not
//!   moved since before the placement: no job hit the cache meanwhile, so
//!   that one did not either (evicted, or a node that never hits). The
//!   job's keys are forgotten on that node.
//!
//! A node that lies the other way (hits it never had) keeps only affinity
//! it earned by running the job, and affinity is worth at most the
//! prefill of the matched bytes, so no report makes a node win that is
//! clearly slower or busier at the rest of the job. Nothing here is used
//! for money.
//!
//! # Invariants
//! - At most `capacity` keys are held: least recently recorded first out;
//!   within one job's chain the deeper keys are recorded first, so they
//!   go first and a surviving key's parents survive with it. A key costs
//!   about 300 bytes, so 65,536 keys hold about 20 MB.
//! - At most [`MAX_HOLDERS`] nodes per key (the most recent), at most
//!   [`MAX_KEYS_PER_JOB`] keys per job, at most [`MAX_CHECKS`] pending
//!   checks per node.
//!
//! # Failure
//! Nothing fails: an unknown prefix matches nothing.

use std::collections::{BTreeMap, HashMap, VecDeque};

use mlxnet_proto::{
    ids::NodeId,
    v1::{job_input, JobInput},
};
use sha2::{Digest, Sha256};

/// Bytes of a raw prompt per key.
pub const CHUNK_BYTES: usize = 256;
/// Keys taken from one job's input (the deepest prefixes beyond are not
/// tracked: 64 KiB of raw prompt, or 256 chat messages).
pub const MAX_KEYS_PER_JOB: usize = 256;
/// Nodes remembered per key.
pub const MAX_HOLDERS: usize = 4;
/// Pending hit checks per node; the oldest is dropped beyond it.
pub const MAX_CHECKS: usize = 64;
/// Heartbeats after a job's end before its check is judged: the first may
/// have been composed before the node admitted the job.
pub const JUDGE_BEATS: u64 = 2;

/// Names an input prefix of one model.
pub type PrefixKey = [u8; 32];

/// One key of a job's input with the bytes it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub key: PrefixKey,
    pub depth: u64,
}

/// The chain keys of `input` for the model with digest `model`, shallowest
/// first (see the module's Keys).
pub fn prefixes(model: &[u8; 32], input: &JobInput) -> Vec<Prefix> {
    let mut out = Vec::new();
    let mut prev: PrefixKey = *model;
    let mut depth = 0u64;
    let mut link = |parts: &[&[u8]], out: &mut Vec<Prefix>| {
        let mut h = Sha256::new();
        h.update(prev);
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
            depth += p.len() as u64;
        }
        prev = h.finalize().into();
        out.push(Prefix { key: prev, depth });
    };
    match &input.kind {
        Some(job_input::Kind::Prompt(p)) => {
            for chunk in p
                .as_bytes()
                .chunks_exact(CHUNK_BYTES)
                .take(MAX_KEYS_PER_JOB)
            {
                link(&[chunk], &mut out);
            }
        }
        Some(job_input::Kind::Chat(c)) => {
            for m in c.messages.iter().take(MAX_KEYS_PER_JOB) {
                link(&[m.role.as_bytes(), m.content.as_bytes()], &mut out);
            }
        }
        None => {}
    }
    out
}

/// What a node's heartbeats said, as its session keeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The session's serial (a new one: the node reconnected).
    pub session: u64,
    /// Heartbeats received in this session.
    pub beats: u64,
    /// Cumulative prompt tokens the node admitted, and of them served
    /// from its prefix cache (since it started).
    pub prompt_tokens: u64,
    pub hit_tokens: u64,
}

/// What a [`Report`] took away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// The node reconnected or restarted: all its affinity went.
    pub reset: bool,
    /// Jobs placed for a match that did not hit: their keys went.
    pub missed: usize,
}

/// Names a pending hit check ([`Affinity::expect_hit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckId(u64);

#[derive(Clone, Debug)]
struct Entry {
    depth: u64,
    /// Most recent last.
    holders: Vec<NodeId>,
    used: u64,
}

#[derive(Clone, Debug)]
struct Check {
    id: u64,
    keys: Vec<PrefixKey>,
    /// The hit counter before the job was placed (None: no report yet).
    hits_before: Option<u64>,
    /// The heartbeat count when the job ended.
    ended_at: Option<u64>,
}

#[derive(Clone, Debug, Default)]
struct Track {
    last: Option<Report>,
    checks: VecDeque<Check>,
}

/// The bounded map of prefixes to the nodes that last ran them.
#[derive(Clone, Debug)]
pub struct Affinity {
    capacity: usize,
    entries: HashMap<PrefixKey, Entry>,
    /// Keys by last record, oldest first.
    by_age: BTreeMap<u64, PrefixKey>,
    tick: u64,
    nodes: HashMap<NodeId, Track>,
    next_check: u64,
}

impl Affinity {
    /// An empty map holding at most `capacity` keys.
    pub fn new(capacity: usize) -> Affinity {
        Affinity {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            by_age: BTreeMap::new(),
            tick: 0,
            nodes: HashMap::new(),
            next_check: 0,
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `node` was given a job with these prefixes: it holds them now.
    pub fn record(&mut self, node: NodeId, prefixes: &[Prefix]) {
        // Deepest first, so a chain's parents are the younger entries.
        for p in prefixes.iter().rev() {
            self.tick += 1;
            let tick = self.tick;
            let e = self.entries.entry(p.key).or_insert_with(|| Entry {
                depth: p.depth,
                holders: Vec::new(),
                used: tick,
            });
            self.by_age.remove(&e.used);
            e.used = tick;
            self.by_age.insert(tick, p.key);
            e.holders.retain(|h| *h != node);
            e.holders.push(node);
            if e.holders.len() > MAX_HOLDERS {
                e.holders.remove(0);
            }
        }
        while self.entries.len() > self.capacity {
            let Some((_, key)) = self.by_age.pop_first() else {
                break;
            };
            self.entries.remove(&key);
        }
    }

    /// Each node holding some prefix of `prefixes`, with the bytes of its
    /// longest one; longest first (ties: node id order).
    pub fn matches(&self, prefixes: &[Prefix]) -> Vec<(NodeId, u64)> {
        let mut best: HashMap<NodeId, u64> = HashMap::new();
        for p in prefixes {
            if let Some(e) = self.entries.get(&p.key) {
                for h in &e.holders {
                    let d = best.entry(*h).or_default();
                    *d = (*d).max(e.depth);
                }
            }
        }
        let mut out: Vec<(NodeId, u64)> = best.into_iter().collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        out
    }

    /// `node` no longer holds these prefixes.
    pub fn forget(&mut self, node: &NodeId, keys: &[PrefixKey]) {
        for k in keys {
            let gone = match self.entries.get_mut(k) {
                Some(e) => {
                    e.holders.retain(|h| h != node);
                    e.holders.is_empty()
                }
                None => false,
            };
            if gone {
                if let Some(e) = self.entries.remove(k) {
                    self.by_age.remove(&e.used);
                }
            }
        }
    }

    /// `node` holds nothing any more (scans every key). Returns how many
    /// keys it held.
    pub fn forget_node(&mut self, node: &NodeId) -> usize {
        let mut held = 0;
        let mut gone = Vec::new();
        for (k, e) in &mut self.entries {
            let before = e.holders.len();
            e.holders.retain(|h| h != node);
            held += before - e.holders.len();
            if e.holders.is_empty() {
                gone.push((*k, e.used));
            }
        }
        for (k, used) in gone {
            self.entries.remove(&k);
            self.by_age.remove(&used);
        }
        if let Some(t) = self.nodes.get_mut(node) {
            t.checks.clear();
        }
        held
    }

    /// Takes in what `node`'s heartbeats said (the same report may come
    /// many times: only a change is news). A node seen for the first time
    /// (or again after [`Affinity::retain_nodes`] dropped it) starts with
    /// no affinity.
    pub fn report(&mut self, node: NodeId, r: Report) -> Dropped {
        let mut dropped = Dropped::default();
        let reset = match self.nodes.get(&node).and_then(|t| t.last) {
            None => true,
            Some(last) => {
                r.session != last.session
                    || r.beats < last.beats
                    || r.prompt_tokens < last.prompt_tokens
                    || r.hit_tokens < last.hit_tokens
            }
        };
        if reset {
            let tracked = self.nodes.contains_key(&node);
            dropped.reset = self.forget_node(&node) > 0 || tracked;
        }
        let track = self.nodes.entry(node).or_default();
        track.last = Some(r);
        let mut missed = Vec::new();
        track.checks.retain(|c| match c.ended_at {
            Some(end) if r.beats >= end.saturating_add(JUDGE_BEATS) => {
                if c.hits_before == Some(r.hit_tokens) {
                    missed.push(c.keys.clone());
                }
                false
            }
            _ => true,
        });
        dropped.missed = missed.len();
        for keys in missed {
            self.forget(&node, &keys);
        }
        dropped
    }

    /// A job with `prefixes` was placed on `node` where it held a match:
    /// the check judged once the job ended ([`Affinity::ended`]).
    pub fn expect_hit(&mut self, node: NodeId, prefixes: &[Prefix]) -> CheckId {
        self.next_check += 1;
        let id = self.next_check;
        let track = self.nodes.entry(node).or_default();
        let hits_before = track.last.map(|r| r.hit_tokens);
        track.checks.push_back(Check {
            id,
            keys: prefixes.iter().map(|p| p.key).collect(),
            hits_before,
            ended_at: None,
        });
        if track.checks.len() > MAX_CHECKS {
            track.checks.pop_front();
        }
        CheckId(id)
    }

    /// The job of check `id` on `node` ended (its prefill is done).
    pub fn ended(&mut self, node: &NodeId, id: CheckId) {
        if let Some(t) = self.nodes.get_mut(node) {
            let beats = t.last.map_or(0, |r| r.beats);
            if let Some(c) = t.checks.iter_mut().find(|c| c.id == id.0) {
                c.ended_at = Some(beats);
            }
        }
    }

    /// Drops what is tracked of nodes `online` rejects (their keys stay
    /// until evicted, and are dropped if the node comes back: see
    /// [`Affinity::report`]).
    pub fn retain_nodes(&mut self, mut online: impl FnMut(&NodeId) -> bool) {
        self.nodes.retain(|id, _| online(id));
    }
}

#[cfg(test)]
mod tests {
    use mlxnet_proto::v1::{ChatMessage, ChatMessages};

    use super::*;

    fn node(n: u8) -> NodeId {
        let key = ed25519_dalek::SigningKey::from_bytes(&[n; 32]);
        NodeId::from_key(&key.verifying_key())
    }

    fn chat(turns: &[(&str, &str)]) -> JobInput {
        JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: turns
                    .iter()
                    .map(|(role, content)| ChatMessage {
                        role: (*role).into(),
                        content: (*content).into(),
                    })
                    .collect(),
            })),
        }
    }

    fn prompt(text: &str) -> JobInput {
        JobInput {
            kind: Some(job_input::Kind::Prompt(text.into())),
        }
    }

    const MODEL: [u8; 32] = [7; 32];

    fn report(session: u64, beats: u64, hits: u64) -> Report {
        Report {
            session,
            beats,
            prompt_tokens: 1000 * beats,
            hit_tokens: hits,
        }
    }

    #[test]
    fn keys_name_whole_prefixes_of_one_model() {
        let one = prefixes(&MODEL, &chat(&[("system", "be brief"), ("user", "hi")]));
        let two = prefixes(
            &MODEL,
            &chat(&[
                ("system", "be brief"),
                ("user", "hi"),
                ("assistant", "hello"),
                ("user", "bye"),
            ]),
        );
        assert_eq!(one.len(), 2);
        assert_eq!(one[..], two[..2], "a later turn extends the chain");
        assert_eq!(two[3].depth, (6 + 8 + 4 + 2 + 9 + 5 + 4 + 3) as u64);
        // The same text as another role, or for another model, is another key.
        let other_role = prefixes(&MODEL, &chat(&[("user", "be brief")]));
        assert_ne!(other_role[0], one[0]);
        let other_model = prefixes(&[8; 32], &chat(&[("system", "be brief")]));
        assert_ne!(other_model[0], one[0]);
        // A raw prompt: full chunks only.
        let text = "x".repeat(CHUNK_BYTES * 3 + 10);
        let p = prefixes(&MODEL, &prompt(&text));
        assert_eq!(p.len(), 3);
        assert_eq!(p[2].depth, 3 * CHUNK_BYTES as u64);
        let longer = prefixes(&MODEL, &prompt(&format!("{text}{}", "y".repeat(400))));
        assert_eq!(longer[..3], p[..]);
        assert!(prefixes(&MODEL, &prompt("short")).is_empty());
    }

    #[test]
    fn the_longest_prefix_wins() {
        let mut a = Affinity::new(100);
        let system = ("system", "You are a careful assistant.");
        let first = prefixes(&MODEL, &chat(&[system, ("user", "one")]));
        let other = prefixes(&MODEL, &chat(&[system, ("user", "two")]));
        a.record(node(1), &first);
        a.record(node(2), &other);
        let next = prefixes(
            &MODEL,
            &chat(&[
                system,
                ("user", "one"),
                ("assistant", "1"),
                ("user", "three"),
            ]),
        );
        let m = a.matches(&next);
        // Node 1 holds the whole first turn; node 2 only the system prompt.
        assert_eq!(
            m,
            vec![(node(1), first[1].depth), (node(2), first[0].depth)]
        );
        assert!(a.matches(&prefixes(&[9; 32], &chat(&[system]))).is_empty());
    }

    #[test]
    fn the_map_is_bounded_and_evicts_the_least_recent_deepest_first() {
        let mut a = Affinity::new(5);
        let long = prefixes(
            &MODEL,
            &chat(&[
                ("system", "s"),
                ("user", "a"),
                ("assistant", "b"),
                ("user", "c"),
            ]),
        );
        a.record(node(1), &long);
        assert_eq!(a.len(), 4);
        let other = prefixes(&MODEL, &chat(&[("system", "other"), ("user", "x")]));
        a.record(node(2), &other);
        assert_eq!(a.len(), 5, "bounded");
        // The oldest entry was the long chain's deepest key; its parents
        // still match.
        assert_eq!(a.matches(&long), vec![(node(1), long[2].depth)]);
        for i in 0..50u32 {
            let p = prefixes(&MODEL, &chat(&[("user", &i.to_string())]));
            a.record(node(3), &p);
            assert!(a.len() <= 5);
        }
        assert!(a.matches(&long).is_empty(), "evicted by newer prefixes");
        // Holders per key are bounded too.
        let shared = prefixes(&MODEL, &chat(&[("system", "shared")]));
        for n in 1..=6 {
            a.record(node(n), &shared);
        }
        let holders: Vec<NodeId> = a.matches(&shared).into_iter().map(|(n, _)| n).collect();
        assert_eq!(holders.len(), MAX_HOLDERS);
        assert!(!holders.contains(&node(1)) && holders.contains(&node(6)));
    }

    #[test]
    fn a_miss_after_a_match_or_a_restart_takes_the_affinity_away() {
        let turn = prefixes(&MODEL, &chat(&[("system", "s"), ("user", "one")]));
        let mut a = Affinity::new(100);
        assert_eq!(a.report(node(1), report(1, 1, 0)), Dropped::default());
        assert_eq!(a.report(node(2), report(1, 1, 0)), Dropped::default());
        a.record(node(1), &turn);

        // A placement for the match whose job hit: the counter moved.
        let c = a.expect_hit(node(1), &turn);
        a.report(node(1), report(1, 2, 0));
        a.ended(&node(1), c);
        // Not judged until two heartbeats after the end.
        assert_eq!(a.report(node(1), report(1, 3, 32)).missed, 0);
        assert_eq!(a.report(node(1), report(1, 4, 32)).missed, 0);
        assert_eq!(a.matches(&turn).len(), 1, "a hit keeps the affinity");

        // Another whose job did not hit: the counter stayed at 32.
        let c = a.expect_hit(node(1), &turn);
        a.ended(&node(1), c);
        assert_eq!(a.report(node(1), report(1, 5, 32)).missed, 0);
        assert_eq!(a.report(node(1), report(1, 6, 32)).missed, 1);
        assert!(a.matches(&turn).is_empty(), "the miss took it away");

        // A reconnection (new session) drops everything the node had.
        a.record(node(1), &turn);
        a.record(node(2), &turn);
        let d = a.report(node(1), report(2, 1, 0));
        assert!(d.reset);
        assert_eq!(a.matches(&turn), vec![(node(2), turn[1].depth)]);
        // So do counters that went backwards (a restart within a session
        // cannot happen, but a report cannot be trusted to say so).
        assert!(!a.report(node(2), report(1, 5, 100)).reset);
        assert_eq!(a.matches(&turn).len(), 1);
        let d = a.report(node(2), report(1, 6, 50));
        assert!(d.reset);
        assert!(a.matches(&turn).is_empty());
        // A node forgotten while offline starts again from nothing.
        a.record(node(3), &turn);
        a.retain_nodes(|n| *n != node(3));
        assert!(a.report(node(3), report(1, 1, 0)).reset);
        assert!(a.matches(&turn).is_empty());
    }
}
