//! Predict-on-route: a routed prompt's blocks are assumed cached on its candidate for a short TTL.
//!
//! An engine reports what it cached only after it has computed it: a KV event arrives some tens or
//! hundreds of milliseconds after the router booked the request. In that window the event index
//! still says the candidate holds nothing of the prompt, so a burst of requests sharing a new
//! prefix is spread over the fleet, each computing the prefix again. Dynamo and llm-d close the
//! window the same way: when a request is booked, the router records that its candidate will hold
//! the prompt's blocks, for `ttl` (default 2 s). A decision reads these predictions beside the
//! event index and takes, per candidate, the deeper of the two device overlaps (max-combine).
//!
//! What the engine's events say wins as soon as they say it:
//! - a **stored** block confirms its prediction: the event index now holds it, and max-combine
//!   gives the same overlap whether or not the prediction is still there, so it simply lapses at
//!   its TTL (the count of confirmed blocks is kept as a statistic);
//! - a **removed** block contradicts it: the prediction of that block on that candidate is dropped
//!   at once (matching stops there, so the blocks after it on the path stop counting too);
//! - a **cleared** candidate, or a removed worker, loses all its predictions.
//!
//! # Mispredictions: the tell-tale of a parity bug
//! Predict-on-route assumes the router's tokens (and hashes) are the engine's. When they are not
//! (a chat template rendered differently, a salt or adapter the router hashed otherwise), the
//! engine stores the request's blocks under other local hashes: its events keep storing blocks on
//! the candidate, yet never the predicted ones. A prediction that reaches its TTL unconfirmed
//! while its candidate's engine stored other blocks after it was recorded is counted as
//! **mispredicted**; when, over a window of at least [`MISPREDICT_MIN_SAMPLES`] expiries, more than
//! [`MISPREDICT_THRESHOLD`] of them were, a warning is logged (at most once a minute).
//!
//! # Memory and cost
//! Entries are (candidate, sequence hash) pairs. Every entry expires after the TTL; expired entries
//! are purged (oldest first, from a queue in expiry order) whenever a prediction is recorded, and
//! at most `max_entries` are kept (the oldest go first past it). Matching walks the prompt's
//! sequence hashes from the first block, keeping the set of candidates still predicted, and stops
//! when the set is empty: with no predictions it costs one hash probe, and a prompt matched on
//! `k` candidates costs one probe per block with a `k`-long scan.
//!
//! # Time
//! Times are microseconds on the router's clock (the wall clock, or a simulator's), given by the
//! caller, so the replay's simulated fleet expires predictions on simulated time.
//!
//! # Concurrency
//! One `parking_lot::RwLock`: decisions match under the read lock (in parallel), bookings and
//! events write under the write lock for work bounded by one prompt's or one event's blocks.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::candidate::{CandidateKey, WorkerId};

/// Share of expired predictions mispredicted (see the module doc) above which a warning is logged.
pub const MISPREDICT_THRESHOLD: f64 = 0.5;
/// Fewest expiries in a window before the share is judged.
pub const MISPREDICT_MIN_SAMPLES: u64 = 32;
/// The window over which the share is judged, and the least time between two warnings.
const MISPREDICT_WINDOW_US: u64 = 10_000_000;
const MISPREDICT_WARN_EVERY_US: u64 = 60_000_000;

/// Settings of predict-on-route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PredictConfig {
    /// How long a routed prompt is assumed cached on its candidate without an event saying so.
    pub ttl: Duration,
    /// Most (candidate, block) predictions kept; the oldest are dropped past it.
    pub max_entries: usize,
}

impl Default for PredictConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_millis(2000),
            max_entries: 1 << 20,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Sequence hash → the candidates predicted to hold that block (and its prefix), with the
    /// microsecond their prediction expires.
    holders: FxHashMap<u64, SmallVec<[(CandidateKey, u64); 2]>>,
    /// (candidate, local hash) → the sequence hashes predicted on the candidate with that local
    /// hash: how an event's block (named by its local hash) finds its predictions.
    by_local: FxHashMap<(CandidateKey, u64), SmallVec<[u64; 1]>>,
    /// (expiry, candidate, sequence hash, local hash) in the order recorded (= expiry order, the
    /// TTL being one); entries refreshed since are stale and skipped.
    queue: VecDeque<(u64, CandidateKey, u64, u64)>,
    /// Live (candidate, block) entries.
    live: usize,
    /// (candidate, sequence hash) entries a stored event confirmed.
    confirmed: rustc_hash::FxHashSet<(CandidateKey, u64)>,
    /// When each candidate's engine last stored blocks on device (router clock, µs).
    last_store_us: FxHashMap<CandidateKey, u64>,
    /// The current misprediction window: its start, expiries and mispredictions in it.
    window: (u64, u64, u64),
    last_warn_us: Option<u64>,
}

impl State {
    /// Drops the entry (candidate, seq) if it still expires at `expiry` (`None`: whatever its
    /// expiry). Returns whether it was dropped.
    fn drop_entry(&mut self, c: CandidateKey, seq: u64, local: u64, expiry: Option<u64>) -> bool {
        let Some(h) = self.holders.get_mut(&seq) else {
            return false;
        };
        let Some(i) = h
            .iter()
            .position(|&(k, e)| k == c && expiry.is_none_or(|x| x == e))
        else {
            return false;
        };
        h.swap_remove(i);
        if h.is_empty() {
            self.holders.remove(&seq);
        }
        self.confirmed.remove(&(c, seq));
        if let Some(s) = self.by_local.get_mut(&(c, local)) {
            s.retain(|x| *x != seq);
            if s.is_empty() {
                self.by_local.remove(&(c, local));
            }
        }
        self.live -= 1;
        true
    }

    /// Pops queue entries while `pop` says so, dropping the ones still current. Returns how many
    /// entries were dropped.
    fn pop_while(&mut self, mut pop: impl FnMut(&Self, u64) -> bool) -> u64 {
        let mut n = 0;
        while let Some(&(e, c, s, l)) = self.queue.front() {
            if !pop(self, e) {
                break;
            }
            self.queue.pop_front();
            n += u64::from(self.drop_entry(c, s, l, Some(e)));
        }
        n
    }

    /// Drops every entry of the candidates `which` selects.
    fn drop_where(&mut self, which: impl Fn(CandidateKey) -> bool) -> u64 {
        let mut n = 0u64;
        self.holders.retain(|_, h| {
            let before = h.len();
            h.retain(|(k, _)| !which(*k));
            n += (before - h.len()) as u64;
            !h.is_empty()
        });
        self.by_local.retain(|(k, _), _| !which(*k));
        self.confirmed.retain(|(k, _)| !which(*k));
        self.last_store_us.retain(|k, _| !which(*k));
        self.live -= n as usize;
        n
    }
}

/// Statistics of the predictions (monotonic counters and the live count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PredictStats {
    /// (candidate, block) predictions held now.
    pub live: u64,
    /// Predictions recorded (a refresh counts again).
    pub recorded: u64,
    /// Stored blocks of KV events that had been predicted on their candidate.
    pub confirmed: u64,
    /// Predictions dropped because the engine removed the block.
    pub contradicted: u64,
    /// Predictions dropped at their TTL or past the cap.
    pub expired: u64,
    /// Predictions that expired unconfirmed while their candidate's engine stored other blocks
    /// (counted in `expired` too): the tell-tale of a parity bug.
    pub mispredicted: u64,
}

#[derive(Debug, Default)]
struct Counters {
    recorded: AtomicU64,
    confirmed: AtomicU64,
    contradicted: AtomicU64,
    expired: AtomicU64,
    mispredicted: AtomicU64,
}

/// The predicted holdings of routed prompts. `Send + Sync`.
#[derive(Debug)]
pub struct Predictions {
    config: PredictConfig,
    state: RwLock<State>,
    counters: Counters,
}

impl Predictions {
    pub fn new(config: PredictConfig) -> Self {
        Self {
            config,
            state: RwLock::new(State::default()),
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &PredictConfig {
        &self.config
    }

    /// Records that `candidate` will hold the prompt with these local and sequence hashes (as of
    /// `now_us`), until `now_us + ttl`. Purges what has expired by then.
    pub fn record(&self, candidate: CandidateKey, local: &[u64], seq: &[u64], now_us: u64) {
        if seq.is_empty() {
            return;
        }
        let expiry = now_us.saturating_add(self.config.ttl.as_micros() as u64);
        let mut st = self.state.write();
        let ttl = self.config.ttl.as_micros() as u64;
        let mut mispredicted = 0u64;
        let mut gone = 0u64;
        while let Some(&(e, c, sq, l)) = st.queue.front() {
            if e > now_us {
                break;
            }
            st.queue.pop_front();
            let confirmed = st.confirmed.contains(&(c, sq));
            if st.drop_entry(c, sq, l, Some(e)) {
                gone += 1;
                let recorded_at = e.saturating_sub(ttl);
                if !confirmed && st.last_store_us.get(&c).is_some_and(|&t| t > recorded_at) {
                    mispredicted += 1;
                }
            }
        }
        self.judge(&mut st, gone, mispredicted, now_us);
        for (&s, &l) in seq.iter().zip(local) {
            let h = st.holders.entry(s).or_default();
            match h.iter_mut().find(|(k, _)| *k == candidate) {
                Some(entry) => entry.1 = expiry,
                None => {
                    h.push((candidate, expiry));
                    st.live += 1;
                    let seqs = st.by_local.entry((candidate, l)).or_default();
                    if !seqs.contains(&s) {
                        seqs.push(s);
                    }
                }
            }
            st.queue.push_back((expiry, candidate, s, l));
        }
        let cap = self.config.max_entries.max(1);
        gone += st.pop_while(|st, _| st.queue.len() > cap);
        self.counters.recorded.fetch_add(seq.len() as u64, Relaxed);
        if gone > 0 {
            self.counters.expired.fetch_add(gone, Relaxed);
        }
    }

    /// The predicted device overlap of a prompt (its sequence hashes) per candidate, as of
    /// `now_us`: the leading blocks predicted on it and not expired. Sparse, sorted by candidate,
    /// into `out` (cleared first).
    pub fn matches(&self, seq: &[u64], now_us: u64, out: &mut Vec<(CandidateKey, u32)>) {
        out.clear();
        let Some(first) = seq.first() else {
            return;
        };
        let st = self.state.read();
        let Some(h) = st.holders.get(first) else {
            return;
        };
        let mut cur: SmallVec<[CandidateKey; 8]> = h
            .iter()
            .filter(|(_, e)| *e > now_us)
            .map(|(k, _)| *k)
            .collect();
        for (depth, s) in seq.iter().enumerate().skip(1) {
            if cur.is_empty() {
                break;
            }
            let h = st.holders.get(s);
            cur.retain(|c| {
                let held = h.is_some_and(|h| h.iter().any(|(k, e)| k == c && *e > now_us));
                if !held {
                    out.push((*c, depth as u32));
                }
                held
            });
        }
        out.extend(cur.iter().map(|c| (*c, seq.len() as u32)));
        out.sort_unstable();
    }

    /// A stored event's blocks (by local hash) on `candidate`, at `now_us`: counts and marks those
    /// predicted there.
    pub fn confirm(
        &self,
        candidate: CandidateKey,
        stored_locals: impl Iterator<Item = u64>,
        now_us: u64,
    ) {
        if self.state.read().live == 0 {
            return;
        }
        let mut st = self.state.write();
        st.last_store_us.insert(candidate, now_us);
        let mut n = 0u64;
        for l in stored_locals {
            let Some(seqs) = st.by_local.get(&(candidate, l)).cloned() else {
                continue;
            };
            n += 1;
            for sq in seqs {
                st.confirmed.insert((candidate, sq));
            }
        }
        if n > 0 {
            self.counters.confirmed.fetch_add(n, Relaxed);
        }
    }

    /// Counts the expiries and mispredictions of a purge, and warns when the window's share of
    /// mispredictions is past [`MISPREDICT_THRESHOLD`].
    fn judge(&self, st: &mut State, expired: u64, mispredicted: u64, now_us: u64) {
        if mispredicted > 0 {
            self.counters.mispredicted.fetch_add(mispredicted, Relaxed);
        }
        let (start, n, bad) = &mut st.window;
        if now_us.saturating_sub(*start) > MISPREDICT_WINDOW_US {
            *start = now_us;
            *n = 0;
            *bad = 0;
        }
        *n += expired;
        *bad += mispredicted;
        let (n, bad) = (*n, *bad);
        if n >= MISPREDICT_MIN_SAMPLES
            && bad as f64 > MISPREDICT_THRESHOLD * n as f64
            && st
                .last_warn_us
                .is_none_or(|t| now_us.saturating_sub(t) >= MISPREDICT_WARN_EVERY_US)
        {
            st.last_warn_us = Some(now_us);
            tracing::warn!(
                expired = n,
                mispredicted = bad,
                "predict-on-route: {bad} of {n} predicted blocks expired unconfirmed while their engines stored other blocks: the engines' block hashes differ from the router's (tokenization, chat template, cache_salt or LoRA parity); see kvroute_predictions_total{{outcome=\"mispredicted\"}}"
            );
        }
    }

    /// The engine removed these blocks (by local hash) from `candidate`: their predictions there
    /// are dropped.
    pub fn contradict(&self, candidate: CandidateKey, removed_locals: &[u64]) {
        let mut st = self.state.write();
        let mut n = 0u64;
        for &l in removed_locals {
            let Some(seqs) = st.by_local.get(&(candidate, l)).cloned() else {
                continue;
            };
            for s in seqs {
                n += u64::from(st.drop_entry(candidate, s, l, None));
            }
        }
        if n > 0 {
            self.counters.contradicted.fetch_add(n, Relaxed);
        }
    }

    /// Whether any prediction is held for `candidate` (events of the others need no look-up).
    pub fn holds_any(&self, candidate: CandidateKey) -> bool {
        let st = self.state.read();
        st.live > 0 && st.by_local.keys().any(|(k, _)| *k == candidate)
    }

    /// Whether no prediction is held at all.
    pub fn is_empty(&self) -> bool {
        self.state.read().live == 0
    }

    /// Drops every prediction of a candidate (its engine cleared its cache, or the rank is gone).
    pub fn remove_candidate(&self, candidate: CandidateKey) {
        self.state.write().drop_where(|k| k == candidate);
    }

    /// Drops every prediction of a worker's ranks.
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.state.write().drop_where(|k| k.worker_id == worker_id);
    }

    pub fn stats(&self) -> PredictStats {
        PredictStats {
            live: self.state.read().live as u64,
            recorded: self.counters.recorded.load(Relaxed),
            confirmed: self.counters.confirmed.load(Relaxed),
            contradicted: self.counters.contradicted.load(Relaxed),
            expired: self.counters.expired.load(Relaxed),
            mispredicted: self.counters.mispredicted.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing;

    fn preds(ttl_ms: u64, max_entries: usize) -> Predictions {
        Predictions::new(PredictConfig {
            ttl: Duration::from_millis(ttl_ms),
            max_entries,
        })
    }

    fn prompt(locals: &[u64]) -> (Vec<u64>, Vec<u64>) {
        (locals.to_vec(), hashing::sequence_hashes(locals))
    }

    fn matches(p: &Predictions, seq: &[u64], now_us: u64) -> Vec<(CandidateKey, u32)> {
        let mut out = Vec::new();
        p.matches(seq, now_us, &mut out);
        out
    }

    const A: CandidateKey = CandidateKey::new(1, 0);
    const B: CandidateKey = CandidateKey::new(2, 0);

    #[test]
    fn predictions_the_engine_never_stores_while_storing_others_are_mispredicted() {
        let p = preds(2000, 1 << 20);
        // 40 one-block prompts predicted on A at t = 1 s.
        for i in 0..40u64 {
            let (l, s) = prompt(&[1000 + i]);
            p.record(A, &l, &s, 1_000_000);
        }
        // A's engine confirms 10 of them, and stores blocks the router never predicted.
        p.confirm(A, (1000..1010u64).chain([5, 6]), 1_500_000);
        // Predictions on B, whose engine stores nothing: expired, not mispredicted (a slow or
        // idle engine is no parity bug).
        let (l, s) = prompt(&[7]);
        p.record(B, &l, &s, 1_000_000);
        // Past the TTL a new record purges them all.
        let (l, s) = prompt(&[8]);
        p.record(B, &l, &s, 3_100_000);
        let st = p.stats();
        assert_eq!(st.expired, 41);
        assert_eq!(st.mispredicted, 30);
        assert_eq!(st.confirmed, 10);
    }

    #[test]
    fn a_prediction_matches_its_prefix_until_its_ttl() {
        let p = preds(2000, 1 << 20);
        let (l, s) = prompt(&[1, 2, 3, 4]);
        p.record(A, &l, &s, 1_000_000);
        // The whole prompt, and a longer prompt sharing its first three blocks.
        assert_eq!(matches(&p, &s, 1_000_001), vec![(A, 4)]);
        let (_, other) = prompt(&[1, 2, 3, 9, 9]);
        assert_eq!(matches(&p, &other, 1_000_001), vec![(A, 3)]);
        // A prompt with another first block matches nothing.
        let (_, none) = prompt(&[2, 3]);
        assert!(matches(&p, &none, 1_000_001).is_empty());
        // 2 s later it has expired (matching is exact to the microsecond).
        assert_eq!(matches(&p, &s, 2_999_999), vec![(A, 4)]);
        assert!(matches(&p, &s, 3_000_000).is_empty());
        // The next record purges it.
        let (l2, s2) = prompt(&[7]);
        p.record(B, &l2, &s2, 3_000_000);
        let st = p.stats();
        assert_eq!((st.live, st.expired, st.recorded), (1, 4, 5));
    }

    #[test]
    fn a_refresh_extends_the_ttl_and_the_stale_timer_drops_nothing() {
        let p = preds(2000, 1 << 20);
        let (l, s) = prompt(&[1, 2, 3]);
        p.record(A, &l, &s, 0);
        p.record(A, &l[..2], &s[..2], 1_500_000);
        // At 2.5 s the first record's timers fire: block 3 goes, blocks 1-2 were refreshed.
        p.record(B, &[50], &[hashing::sequence_hashes(&[50])[0]], 2_500_000);
        assert_eq!(matches(&p, &s, 2_500_000), vec![(A, 2)]);
        assert_eq!(p.stats().live, 3);
        assert!(matches(&p, &s, 3_500_000).is_empty());
    }

    #[test]
    fn removed_blocks_contradict_and_stored_ones_confirm() {
        let p = preds(2000, 1 << 20);
        let (l, s) = prompt(&[1, 2, 3, 4]);
        p.record(A, &l, &s, 0);
        p.record(B, &l, &s, 0);
        p.confirm(A, [1u64, 2, 77].into_iter(), 1_000_000);
        assert_eq!(p.stats().confirmed, 2);
        assert_eq!(matches(&p, &s, 10), vec![(A, 4), (B, 4)]);
        // A evicts block 3: its prediction stops at 2; B's is untouched.
        p.contradict(A, &[3]);
        assert_eq!(matches(&p, &s, 10), vec![(A, 2), (B, 4)]);
        assert_eq!(p.stats().contradicted, 1);
        assert!(p.holds_any(A));
        p.remove_candidate(B);
        assert_eq!(matches(&p, &s, 10), vec![(A, 2)]);
        p.remove_worker(1);
        assert!(matches(&p, &s, 10).is_empty());
        assert!(p.is_empty() && !p.holds_any(A));
    }

    #[test]
    fn the_cap_drops_the_oldest_predictions() {
        let p = preds(60_000, 6);
        let (l1, s1) = prompt(&[1, 2, 3, 4]);
        let (l2, s2) = prompt(&[5, 6, 7, 8]);
        p.record(A, &l1, &s1, 0);
        p.record(B, &l2, &s2, 1);
        assert_eq!(p.stats().live, 6);
        // The oldest two blocks of the first prompt went: its prediction now matches nothing
        // from the start (matching needs the first block).
        assert!(matches(&p, &s1, 2).is_empty());
        assert_eq!(matches(&p, &s2, 2), vec![(B, 4)]);
        assert_eq!(p.stats().expired, 2);
    }
}
