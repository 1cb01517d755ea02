//! Sessions inferred from prefix lineage (`[sessions] infer = "prefix"`, off by default): a
//! request that sends no session key but extends an earlier request's whole prompt continues that
//! request's session (SPEC §12, "Inferred sessions").
//!
//! What: a map from a booked request's *tip* (the sequence hash of its prompt's last full block)
//! to the session the request belonged to. A sequence hash commits to every token before it, so a
//! later prompt whose own chain holds that hash starts with the whole earlier prompt, block for
//! block: in an agent's conversation that is the next turn (the history, the answer, the tool's
//! output), or a fork of it. The deepest tip found names the session. A request that continues
//! nothing starts a session named after its own tip, `~lineage:` and 16 hex digits (a client key
//! never needs that form). A prompt shorter than one block has no tip and gets no session.
//!
//! Who calls it: the router ([`crate::router::Router`]) asks [`Lineage::infer`] once per decision
//! of a keyless request, before the bindings are read, and tells [`Lineage::record`] the booked
//! request's tip afterwards. The inferred session then binds, keeps and moves like a sent one
//! ([`crate::sessions`]), in the configured mode.
//!
//! Concurrency: a read-write lock. `infer` probes the request's sequence hashes deepest first under
//! the read lock and stops at the first tip: a continued conversation is found within its last few
//! blocks; a new one probes every block (~5 ns each: 30 µs for a 100k-token prompt, against the
//! ~100 ms of tokenizing it). `record` takes the write lock for a few map updates and expires a
//! bounded number of idle tips ([`EXPIRE_PER_CALL`]).
//!
//! Memory: a tip per booked request of an inferred session (a retried turn finds its own tip, a
//! subagent forked from a parent's prompt finds the parent's, and the parent's next turn still
//! finds the parent's own), at most `max_tips` of them (4 × `max_sessions`: the least recently
//! recorded go first), idle ones expiring with the bindings' TTL: ~80 bytes a tip.
//!
//! Limits, by construction: two conversations whose first turns fall entirely inside a prefix they
//! share (a system prompt and a few-token question ending within the same block) cannot be told
//! apart, and the second continues the first; a client that rewrites its history (summarises,
//! drops tool output) starts a new session. Both only weaken affinity, which is a routing
//! preference; clients that can send a key should (the headers of API.md §3.13).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// Most idle tips one `record` removes.
pub const EXPIRE_PER_CALL: usize = 8;

/// How sessions of requests that send no key are found (`[sessions] infer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionInference {
    /// A request without a key has no session.
    #[default]
    Off,
    /// A request without a key continues the session whose last prompt it extends.
    Prefix,
}

impl SessionInference {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionInference::Off => "off",
            SessionInference::Prefix => "prefix",
        }
    }
}

/// What [`Lineage::infer`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inferred {
    /// The request extends the last prompt of this session.
    Continued(Arc<str>),
    /// The request continues nothing: a new session with this key.
    New(Arc<str>),
}

impl Inferred {
    pub fn key(&self) -> &Arc<str> {
        match self {
            Inferred::Continued(k) | Inferred::New(k) => k,
        }
    }
}

/// Monotonic counters.
#[derive(Debug, Default)]
pub struct LineageCounters {
    /// Keyless requests found to continue a session.
    pub continued: AtomicU64,
    /// Keyless requests that started a session.
    pub started: AtomicU64,
}

struct Tip {
    session: Arc<str>,
    last_us: u64,
    /// Tie-break of the recency order.
    tick: u64,
}

#[derive(Default)]
struct Inner {
    tips: FxHashMap<u64, Tip>,
    /// Recency order: (last recorded, tick) → tip. The first entry is the least recent.
    order: BTreeMap<(u64, u64), u64>,
    tick: u64,
}

impl Inner {
    fn remove(&mut self, tip: u64) {
        if let Some(t) = self.tips.remove(&tip) {
            self.order.remove(&(t.last_us, t.tick));
        }
    }
}

/// The tip map. `Send + Sync`.
pub struct Lineage {
    ttl_us: u64,
    max_tips: usize,
    inner: RwLock<Inner>,
    pub counters: LineageCounters,
}

impl std::fmt::Debug for Lineage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lineage")
            .field("ttl_us", &self.ttl_us)
            .field("max_tips", &self.max_tips)
            .finish_non_exhaustive()
    }
}

/// The session key of a conversation first seen with tip `tip`.
pub fn inferred_key(tip: u64) -> String {
    format!("~lineage:{tip:016x}")
}

impl Lineage {
    /// A map keeping tips idle for less than `ttl_us`, at most `max_tips` (at least 1) of them.
    pub fn new(ttl_us: u64, max_tips: usize) -> Self {
        Self {
            ttl_us,
            max_tips: max_tips.max(1),
            inner: RwLock::new(Inner::default()),
            counters: LineageCounters::default(),
        }
    }

    /// The session of a keyless request whose prompt has sequence hashes `seq` (one per full
    /// block), at `now_us`: the session whose tip is deepest in `seq`, else a new one named after
    /// the request's own tip. `None` when the prompt has no full block.
    pub fn infer(&self, seq: &[u64], now_us: u64) -> Option<Inferred> {
        let own_tip = *seq.last()?;
        {
            let inner = self.inner.read();
            if !inner.tips.is_empty() {
                for h in seq.iter().rev() {
                    if let Some(t) = inner.tips.get(h) {
                        if now_us.saturating_sub(t.last_us) < self.ttl_us {
                            self.counters.continued.fetch_add(1, Relaxed);
                            return Some(Inferred::Continued(t.session.clone()));
                        }
                    }
                }
            }
        }
        self.counters.started.fetch_add(1, Relaxed);
        Some(Inferred::New(Arc::from(inferred_key(own_tip))))
    }

    /// Records that a booked request of `session` had tip `tip` (its prompt's last sequence hash)
    /// at `now_us`. A tip another session held now names this one (the latest request wins).
    pub fn record(&self, session: &Arc<str>, tip: u64, now_us: u64) {
        let mut inner = self.inner.write();
        // Expire a bounded number of idle tips.
        for _ in 0..EXPIRE_PER_CALL {
            let Some((&(last_us, _), &old)) = inner.order.first_key_value() else {
                break;
            };
            if now_us.saturating_sub(last_us) < self.ttl_us {
                break;
            }
            inner.remove(old);
        }
        inner.remove(tip);
        while inner.tips.len() >= self.max_tips {
            let Some((_, &oldest)) = inner.order.first_key_value() else {
                break;
            };
            inner.remove(oldest);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.tips.insert(
            tip,
            Tip {
                session: session.clone(),
                last_us: now_us,
                tick,
            },
        );
        inner.order.insert((now_us, tick), tip);
    }

    /// Tips held.
    pub fn len(&self) -> usize {
        self.inner.read().tips.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    /// A chain of `n` made-up sequence hashes sharing `base` as their start.
    fn chain(base: &[u64], more: &[u64]) -> Vec<u64> {
        base.iter().chain(more).copied().collect()
    }

    #[test]
    fn a_turn_that_extends_the_last_prompt_continues_its_session() {
        let l = Lineage::new(1000 * MS, 100);
        let t1 = chain(&[1, 2, 3], &[10]);
        let Some(Inferred::New(a)) = l.infer(&t1, 0) else {
            panic!("a first turn starts a session");
        };
        assert_eq!(&*a, "~lineage:000000000000000a");
        l.record(&a, 10, 0);
        // Turn 2 holds turn 1's whole prompt, then more.
        let t2 = chain(&t1, &[11, 12]);
        assert_eq!(l.infer(&t2, MS), Some(Inferred::Continued(a.clone())));
        l.record(&a, 12, MS);
        // Turn 3 extends turn 2; a retry of turn 2 finds turn 2's own tip.
        assert_eq!(
            l.infer(&chain(&t2, &[13]), 2 * MS),
            Some(Inferred::Continued(a.clone()))
        );
        assert_eq!(l.infer(&t2, 2 * MS), Some(Inferred::Continued(a.clone())));
        assert_eq!(l.len(), 2, "a tip per booked turn");
        assert_eq!(l.counters.continued.load(Relaxed), 3);
        assert_eq!(l.counters.started.load(Relaxed), 1);
    }

    #[test]
    fn conversations_sharing_only_a_system_prompt_stay_apart() {
        let l = Lineage::new(1000 * MS, 100);
        // Both start with the same system prompt (blocks 1, 2) and differ from block 3 on.
        let a1 = chain(&[1, 2], &[30]);
        let b1 = chain(&[1, 2], &[40]);
        let a = l.infer(&a1, 0).unwrap();
        l.record(a.key(), 30, 0);
        let b = l.infer(&b1, 0).unwrap();
        assert!(matches!(b, Inferred::New(_)), "{b:?}");
        assert_ne!(a.key(), b.key());
        l.record(b.key(), 40, 0);
        assert_eq!(
            l.infer(&chain(&b1, &[41]), MS),
            Some(Inferred::Continued(b.key().clone()))
        );
        assert_eq!(
            l.infer(&chain(&a1, &[31]), MS),
            Some(Inferred::Continued(a.key().clone()))
        );
        // A prompt shorter than a block has no tip and no session.
        assert_eq!(l.infer(&[], MS), None);
    }

    #[test]
    fn a_fork_does_not_hide_its_parent_s_tip() {
        let l = Lineage::new(1000 * MS, 100);
        let p1 = chain(&[1, 2], &[3]);
        let p = l.infer(&p1, 0).unwrap();
        l.record(p.key(), 3, 0);
        // A subagent forks from the parent's prompt: it continues the parent's session here.
        let fork = chain(&p1, &[70, 71]);
        assert_eq!(
            l.infer(&fork, MS),
            Some(Inferred::Continued(p.key().clone()))
        );
        l.record(p.key(), 71, MS);
        // The parent's own next turn still finds the parent's prompt.
        assert_eq!(
            l.infer(&chain(&p1, &[4]), 2 * MS),
            Some(Inferred::Continued(p.key().clone()))
        );
    }

    #[test]
    fn tips_expire_after_the_ttl_and_the_cap_evicts_the_least_recent() {
        let l = Lineage::new(100 * MS, 2);
        let a: Arc<str> = Arc::from("a");
        let b: Arc<str> = Arc::from("b");
        let c: Arc<str> = Arc::from("c");
        l.record(&a, 1, 0);
        l.record(&b, 2, 10 * MS);
        // Idle past the TTL: gone to `infer` at once, swept by a later `record`.
        assert!(matches!(l.infer(&[1, 5], 100 * MS), Some(Inferred::New(_))));
        assert_eq!(
            l.infer(&[2, 5], 100 * MS),
            Some(Inferred::Continued(b.clone()))
        );
        l.record(&c, 3, 105 * MS);
        assert_eq!(l.len(), 2, "a's tip expired, b's and c's stay");
        // The cap: a fourth tip evicts the least recent (b's).
        let d: Arc<str> = Arc::from("d");
        l.record(&d, 4, 106 * MS);
        assert_eq!(l.len(), 2);
        assert!(matches!(l.infer(&[2, 9], 107 * MS), Some(Inferred::New(_))));
        assert_eq!(
            l.infer(&[3, 9], 107 * MS),
            Some(Inferred::Continued(c.clone()))
        );
        // A tip recorded by another session now names that one.
        l.record(&d, 3, 108 * MS);
        assert_eq!(
            l.infer(&[3, 9], 109 * MS),
            Some(Inferred::Continued(d.clone()))
        );
        assert_eq!(l.len(), 2);
    }
}
