//! Load tracking: the work the router has booked on each candidate (SPEC §8).
//!
//! Engines report what they have *cached* (KV events), but not what they are *doing*. Between the
//! moment the router picks a candidate and the moment the engine's own metrics would show it, many
//! more requests can arrive; without a local account of booked work every one of them would see the
//! same idle candidate and pile onto it. So the router books each request it routes and the cost
//! function reads the booked load back ([`LoadTracker::load`]).
//!
//! # What is counted, per candidate
//!
//! - `active_prefill_tokens`: the uncached prompt tokens (`prompt_tokens - cached_tokens`) of every
//!   booked request whose prefill has not finished. [`LoadTracker::prefill_complete`] (the first
//!   output token) removes a request's share; so does [`LoadTracker::free`].
//! - `active_decode_blocks`: the KV blocks the candidate's active requests occupy. A request's prompt
//!   blocks are named by their *sequence* (chained) hashes, and a block shared by several active
//!   requests on the same candidate (a common system prompt, a multi-turn conversation) occupies the
//!   engine's memory once, so it counts **once**: the tracker keeps a reference count per
//!   (candidate, sequence hash) and the candidate's count of distinct active blocks moves only when
//!   a count goes 0 → 1 or 1 → 0. A prompt occupies `ceil(isl/B)` blocks (SPEC §8): the blocks no
//!   hash names — the partial tail block of a prompt whose length is not a multiple of `B` — are
//!   private to the request and counted for it alone ([`Booking::private_prompt_blocks`]). On top
//!   of that come the blocks each request's output has grown into
//!   ([`LoadTracker::output_progress`]): `ceil((isl + out)/B) - ceil(isl/B)`, never shared.
//! - `active_requests`: the number of bookings on the candidate.
//!
//! [`LoadTracker::free`] (request finished or cancelled) releases everything the request added.
//!
//! # Why expiry
//!
//! A booking is released by a call that the router makes when a response ends. A lost client, a
//! crashed stream, or a bug on any of those paths would leave the booking live for ever, and the
//! candidate would look busier and busier until nothing is routed to it. So every booking older than
//! [`LoadConfig::expiry`] (300 s by default, as in Dynamo) is released by [`LoadTracker::expire`],
//! which the router calls every few seconds; load can leak for at most that long.
//!
//! # Cost of the operations
//!
//! [`LoadTracker::load`] is O(1): per-candidate aggregates are maintained incrementally, never
//! recomputed from the bookings. Booking and freeing cost O(prompt blocks · log k) where k is the
//! number of candidates that hold a given block active. Expiry walks bookings in `booked_at` order
//! and stops at the first young one. [`LoadTracker::active_prefix_depths`] walks the prompt's hashes
//! once over a global `hash -> [(candidate, refcount)]` map; it never loops over candidates per
//! prompt block, which matters when it runs on every route over up to ~1,024 candidates.
//!
//! The tracker is a plain data structure with an `&mut self` API; the router owns it behind a lock.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::{FxHashMap, FxHashSet};

use crate::candidate::{CandidateKey, WorkerId};

/// Settings of a [`LoadTracker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadConfig {
    /// A booking older than this is released by [`LoadTracker::expire`] (default 300 s).
    pub expiry: Duration,
}

impl LoadConfig {
    /// Dynamo's expiry of never-freed bookings.
    pub const DEFAULT_EXPIRY: Duration = Duration::from_secs(300);
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            expiry: Self::DEFAULT_EXPIRY,
        }
    }
}

/// The booked load of one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateLoad {
    /// Uncached prompt tokens of requests whose prefill has not completed.
    pub active_prefill_tokens: u64,
    /// Distinct active prompt blocks plus the output growth blocks of the active requests.
    pub active_decode_blocks: u64,
    /// Bookings on the candidate.
    pub active_requests: u32,
}

impl CandidateLoad {
    /// True when nothing is booked.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// One booked request, as given to [`LoadTracker::book`] and updated since.
#[derive(Clone, Debug)]
pub struct Booking {
    pub request_id: String,
    pub candidate: CandidateKey,
    /// Prompt tokens (isl).
    pub prompt_tokens: u32,
    /// Prompt tokens the candidate already had cached when the request was booked.
    pub cached_tokens: u32,
    /// Sequence (chained) hashes of the request's complete prompt blocks.
    pub block_hashes: Vec<u64>,
    /// Whether [`LoadTracker::prefill_complete`] has been called.
    pub prefill_done: bool,
    /// Highest output-token total reported by [`LoadTracker::output_progress`].
    pub output_tokens: u32,
    pub booked_at: Instant,
    /// Block size of the candidate, for output growth.
    pub block_size: u32,
}

impl Booking {
    /// The prompt tokens this request adds to `active_prefill_tokens` while its prefill runs.
    pub fn uncached_prompt_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens.saturating_sub(self.cached_tokens))
    }

    /// The blocks its output has grown into so far (see [`decode_growth_blocks`]).
    pub fn decode_growth_blocks(&self) -> u64 {
        decode_growth_blocks(self.prompt_tokens, self.output_tokens, self.block_size)
    }

    /// The prompt blocks no hash names: `ceil(isl/B) - hashes`, at least 0. With one hash per
    /// complete block (as the router books) that is the partial tail block, 1 when `isl` is not a
    /// multiple of `B`. Nobody else can hold them, so they count for this request alone.
    pub fn private_prompt_blocks(&self) -> u64 {
        private_prompt_blocks(self.prompt_tokens, self.block_hashes.len(), self.block_size)
    }
}

/// Blocks of a prompt of `prompt_tokens` that none of its `hashed` blocks names:
/// `ceil(isl/B) - hashed`, at least 0. A block size of 0 is taken as 1.
pub fn private_prompt_blocks(prompt_tokens: u32, hashed: usize, block_size: u32) -> u64 {
    let blocks = u64::from(prompt_tokens).div_ceil(u64::from(block_size.max(1)));
    blocks.saturating_sub(hashed as u64)
}

/// Blocks that `output_tokens` add after a prompt of `prompt_tokens`:
/// `ceil((isl + out)/B) - ceil(isl/B)`. A block size of 0 is taken as 1.
pub fn decode_growth_blocks(prompt_tokens: u32, output_tokens: u32, block_size: u32) -> u64 {
    let b = u64::from(block_size.max(1));
    let isl = u64::from(prompt_tokens);
    (isl + u64::from(output_tokens)).div_ceil(b) - isl.div_ceil(b)
}

/// Errors of [`LoadTracker`] operations.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    #[error("request {0:?} is already booked")]
    DuplicateRequest(String),
    #[error("no booking for request {0:?}")]
    UnknownRequest(String),
}

/// A live booking and its key in the age index.
#[derive(Debug)]
struct Live {
    booking: Booking,
    /// Booking sequence number: makes `(booked_at, seq)` unique in [`LoadTracker::by_age`].
    seq: u64,
}

/// Running aggregates of one candidate. Present only while it has bookings.
#[derive(Debug, Default)]
struct CandState {
    prefill_tokens: u64,
    /// Sequence hashes with a non-zero reference count on this candidate.
    distinct_blocks: u64,
    /// Prompt blocks no hash names (partial tails), summed over the bookings.
    private_blocks: u64,
    growth_blocks: u64,
    requests: FxHashSet<Arc<str>>,
}

impl CandState {
    fn load(&self) -> CandidateLoad {
        CandidateLoad {
            active_prefill_tokens: self.prefill_tokens,
            active_decode_blocks: self.distinct_blocks + self.private_blocks + self.growth_blocks,
            active_requests: u32::try_from(self.requests.len()).unwrap_or(u32::MAX),
        }
    }
}

/// Holders of one active block: `(candidate, refcount)`, sorted by candidate, counts > 0.
type Holders = Vec<(CandidateKey, u32)>;

/// Booked work per candidate. See the module docs.
#[derive(Debug)]
pub struct LoadTracker {
    cfg: LoadConfig,
    bookings: FxHashMap<Arc<str>, Live>,
    candidates: FxHashMap<CandidateKey, CandState>,
    /// Sequence hash -> the candidates on which it is active, with reference counts.
    blocks: FxHashMap<u64, Holders>,
    /// Live bookings by age, for expiry. Entries are removed when a booking is released.
    by_age: BTreeMap<(Instant, u64), Arc<str>>,
    next_seq: u64,
    /// Bookings made by another router replica (cluster mode): request id -> origin replica.
    origin_of: FxHashMap<Arc<str>, Arc<str>>,
    /// Origin replica -> its live bookings here. Present only while it has some.
    by_origin: FxHashMap<Arc<str>, FxHashSet<Arc<str>>>,
}

impl Default for LoadTracker {
    fn default() -> Self {
        Self::new(LoadConfig::default())
    }
}

impl LoadTracker {
    pub fn new(cfg: LoadConfig) -> Self {
        Self {
            cfg,
            bookings: FxHashMap::default(),
            candidates: FxHashMap::default(),
            blocks: FxHashMap::default(),
            by_age: BTreeMap::new(),
            next_seq: 0,
            origin_of: FxHashMap::default(),
            by_origin: FxHashMap::default(),
        }
    }

    pub fn config(&self) -> &LoadConfig {
        &self.cfg
    }

    /// Books `request_id` on `candidate`.
    ///
    /// `prompt_tokens` = isl; `cached_tokens` = tokens the candidate already has cached
    /// (overlap × block_size, capped at isl; a larger value is treated as isl); `block_hashes` = the
    /// request's *sequence* (chained) hashes, one per complete prompt block; `block_size` is used for
    /// decode growth. Request ids are unique across all candidates.
    #[allow(clippy::too_many_arguments)]
    pub fn book(
        &mut self,
        request_id: &str,
        candidate: CandidateKey,
        prompt_tokens: u32,
        cached_tokens: u32,
        block_hashes: &[u64],
        block_size: u32,
        now: Instant,
    ) -> Result<(), LoadError> {
        if self.bookings.contains_key(request_id) {
            return Err(LoadError::DuplicateRequest(request_id.to_owned()));
        }
        let booking = Booking {
            request_id: request_id.to_owned(),
            candidate,
            prompt_tokens,
            cached_tokens,
            block_hashes: block_hashes.to_vec(),
            prefill_done: false,
            output_tokens: 0,
            booked_at: now,
            block_size,
        };
        let id: Arc<str> = Arc::from(request_id);
        let seq = self.next_seq;
        self.next_seq += 1;

        let cand = self.candidates.entry(candidate).or_default();
        cand.prefill_tokens += booking.uncached_prompt_tokens();
        cand.private_blocks += booking.private_prompt_blocks();
        cand.requests.insert(Arc::clone(&id));
        for &h in block_hashes {
            let holders = self.blocks.entry(h).or_default();
            match holders.binary_search_by(|(c, _)| c.cmp(&candidate)) {
                Ok(i) => holders[i].1 += 1,
                Err(i) => {
                    holders.insert(i, (candidate, 1));
                    cand.distinct_blocks += 1;
                }
            }
        }
        self.by_age.insert((now, seq), Arc::clone(&id));
        self.bookings.insert(id, Live { booking, seq });
        Ok(())
    }

    /// Marks the request's prefill as done (first token out): its uncached prompt tokens leave
    /// `active_prefill_tokens`. Idempotent: a second call is `Ok` and changes nothing.
    pub fn prefill_complete(&mut self, request_id: &str) -> Result<CandidateKey, LoadError> {
        let live = self
            .bookings
            .get_mut(request_id)
            .ok_or_else(|| LoadError::UnknownRequest(request_id.to_owned()))?;
        let b = &mut live.booking;
        if !b.prefill_done {
            b.prefill_done = true;
            let cand = self
                .candidates
                .get_mut(&b.candidate)
                .expect("a live booking's candidate has state");
            cand.prefill_tokens -= b.uncached_prompt_tokens();
        }
        Ok(b.candidate)
    }

    /// Reports the request's output-token *total* so far (not a delta). Its decode growth becomes
    /// `ceil((isl + total)/B) - ceil(isl/B)` blocks. Monotonic: a total smaller than one already
    /// reported is ignored (`Ok`). Does not complete the prefill; call
    /// [`prefill_complete`](Self::prefill_complete) for that.
    pub fn output_progress(
        &mut self,
        request_id: &str,
        total_output_tokens: u32,
    ) -> Result<CandidateKey, LoadError> {
        let live = self
            .bookings
            .get_mut(request_id)
            .ok_or_else(|| LoadError::UnknownRequest(request_id.to_owned()))?;
        let b = &mut live.booking;
        if total_output_tokens > b.output_tokens {
            let before = b.decode_growth_blocks();
            b.output_tokens = total_output_tokens;
            let after = b.decode_growth_blocks();
            let cand = self
                .candidates
                .get_mut(&b.candidate)
                .expect("a live booking's candidate has state");
            cand.growth_blocks += after - before;
        }
        Ok(b.candidate)
    }

    /// Releases everything the request added and returns its booking.
    pub fn free(&mut self, request_id: &str) -> Result<Booking, LoadError> {
        self.release(request_id)
            .ok_or_else(|| LoadError::UnknownRequest(request_id.to_owned()))
    }

    /// Frees every booking older than [`LoadConfig::expiry`] (`now - booked_at > expiry`) and
    /// returns them, oldest first.
    pub fn expire(&mut self, now: Instant) -> Vec<Booking> {
        let mut expired = Vec::new();
        while let Some((&(booked_at, _), _)) = self.by_age.first_key_value() {
            if now.saturating_duration_since(booked_at) <= self.cfg.expiry {
                break;
            }
            let (_, id) = self.by_age.pop_first().expect("just seen");
            expired.push(
                self.release(&id)
                    .expect("the age index holds only live bookings"),
            );
        }
        expired
    }

    /// The booked load of `c`; zero for a candidate with no bookings. O(1).
    pub fn load(&self, c: CandidateKey) -> CandidateLoad {
        self.candidates
            .get(&c)
            .map(CandState::load)
            .unwrap_or_default()
    }

    /// Frees the bookings of every rank of `worker_id` (e.g. the worker left); returns them in
    /// booking order.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<Booking> {
        let ranks: Vec<CandidateKey> = self
            .candidates
            .keys()
            .filter(|c| c.worker_id == worker_id)
            .copied()
            .collect();
        let mut ids = Vec::new();
        for c in ranks {
            ids.extend(self.candidates[&c].requests.iter().cloned());
        }
        self.release_all(ids)
    }

    /// Frees the bookings of one candidate; returns them in booking order.
    pub fn remove_candidate(&mut self, c: CandidateKey) -> Vec<Booking> {
        let ids: Vec<Arc<str>> = match self.candidates.get(&c) {
            Some(state) => state.requests.iter().cloned().collect(),
            None => return Vec::new(),
        };
        self.release_all(ids)
    }

    /// For each candidate that has at least the first block of `seq_hashes` active, how many
    /// leading blocks of `seq_hashes` are active on it: the index of the first block it does not
    /// have active. Written into `out` (cleared first, in no particular order); candidates with
    /// depth 0 are absent.
    ///
    /// Walks the prompt once, stopping at the first hash no candidate has active; the work is
    /// bounded by the sum of the depths found, never by (candidates × prompt blocks).
    pub fn active_prefix_depths(&self, seq_hashes: &[u64], out: &mut Vec<(CandidateKey, u32)>) {
        out.clear();
        let Some((first, rest)) = seq_hashes.split_first() else {
            return;
        };
        let Some(holders) = self.blocks.get(first) else {
            return;
        };
        out.extend(holders.iter().map(|&(c, _)| (c, 1)));
        // `out[..alive]` holds the candidates that had every block so far, sorted by candidate
        // (holder lists are sorted too), so each step is a merge of two sorted lists. Survivors are
        // swapped to the front in order, which keeps that prefix sorted.
        let mut alive = out.len();
        for (i, h) in rest.iter().enumerate() {
            let Some(holders) = self.blocks.get(h) else {
                break;
            };
            let depth = u32::try_from(i + 2).unwrap_or(u32::MAX);
            let mut kept = 0;
            let mut j = 0;
            for r in 0..alive {
                let c = out[r].0;
                while j < holders.len() && holders[j].0 < c {
                    j += 1;
                }
                if j == holders.len() {
                    break;
                }
                if holders[j].0 == c {
                    out[r].1 = depth;
                    out.swap(kept, r);
                    kept += 1;
                    j += 1;
                }
            }
            alive = kept;
            if alive == 0 {
                break;
            }
        }
    }

    /// Number of live bookings.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }

    pub fn get(&self, request_id: &str) -> Option<&Booking> {
        self.bookings.get(request_id).map(|l| &l.booking)
    }

    /// Every candidate with any booking, with its load, in no particular order.
    pub fn candidates(&self) -> impl Iterator<Item = (CandidateKey, CandidateLoad)> + '_ {
        self.candidates.iter().map(|(&c, s)| (c, s.load()))
    }

    /// Live bookings, in no particular order.
    pub fn bookings(&self) -> impl Iterator<Item = &Booking> + '_ {
        self.bookings.values().map(|l| &l.booking)
    }

    /// Marks a live booking as made by another router replica, `origin` (cluster mode), so that
    /// [`remove_origin`](Self::remove_origin) can drop it with the rest of that replica's. Its load
    /// counts like any other booking. Re-tagging moves it to the new origin.
    pub fn set_origin(&mut self, request_id: &str, origin: &str) -> Result<(), LoadError> {
        let Some((id, _)) = self.bookings.get_key_value(request_id) else {
            return Err(LoadError::UnknownRequest(request_id.to_owned()));
        };
        let id = Arc::clone(id);
        self.untag(&id);
        let origin: Arc<str> = match self.by_origin.get_key_value(origin) {
            Some((o, _)) => Arc::clone(o),
            None => Arc::from(origin),
        };
        self.by_origin
            .entry(Arc::clone(&origin))
            .or_default()
            .insert(Arc::clone(&id));
        self.origin_of.insert(id, origin);
        Ok(())
    }

    /// The replica that made the booking, when another one did (`None`: booked here, or unknown).
    pub fn origin(&self, request_id: &str) -> Option<&str> {
        self.origin_of.get(request_id).map(|o| &**o)
    }

    /// Frees every booking made by replica `origin`; returns them in booking order.
    pub fn remove_origin(&mut self, origin: &str) -> Vec<Booking> {
        let ids: Vec<Arc<str>> = match self.by_origin.get(origin) {
            Some(set) => set.iter().cloned().collect(),
            None => return Vec::new(),
        };
        self.release_all(ids)
    }

    /// Every origin replica with live bookings here, with its bookings' keys, in no particular
    /// order.
    pub fn origins(&self) -> impl Iterator<Item = (&str, impl Iterator<Item = &str>)> + '_ {
        self.by_origin
            .iter()
            .map(|(o, ids)| (&**o, ids.iter().map(|i| &**i)))
    }

    /// Forgets the origin of `id` (it is released, or re-tagged).
    fn untag(&mut self, id: &str) {
        if let Some(o) = self.origin_of.remove(id) {
            if let Some(set) = self.by_origin.get_mut(&o) {
                set.remove(id);
                if set.is_empty() {
                    self.by_origin.remove(&o);
                }
            }
        }
    }

    fn release_all(&mut self, ids: Vec<Arc<str>>) -> Vec<Booking> {
        let mut freed: Vec<(u64, Booking)> = ids
            .iter()
            .map(|id| {
                let seq = self.bookings[&**id].seq;
                (seq, self.release(id).expect("listed bookings are live"))
            })
            .collect();
        freed.sort_unstable_by_key(|(seq, _)| *seq);
        freed.into_iter().map(|(_, b)| b).collect()
    }

    /// Removes a booking and undoes everything it added. `None` if it is not live.
    fn release(&mut self, request_id: &str) -> Option<Booking> {
        let Live { booking, seq } = self.bookings.remove(request_id)?;
        self.untag(request_id);
        let c = booking.candidate;
        self.by_age.remove(&(booking.booked_at, seq));
        let cand = self
            .candidates
            .get_mut(&c)
            .expect("a live booking's candidate has state");
        if !booking.prefill_done {
            cand.prefill_tokens -= booking.uncached_prompt_tokens();
        }
        cand.growth_blocks -= booking.decode_growth_blocks();
        cand.private_blocks -= booking.private_prompt_blocks();
        cand.requests.remove(request_id);
        for &h in &booking.block_hashes {
            let Entry::Occupied(mut entry) = self.blocks.entry(h) else {
                unreachable!("an active block of a live booking has holders");
            };
            let holders = entry.get_mut();
            let i = holders
                .binary_search_by(|(k, _)| k.cmp(&c))
                .expect("a live booking's candidate holds its blocks");
            holders[i].1 -= 1;
            if holders[i].1 == 0 {
                holders.remove(i);
                cand.distinct_blocks -= 1;
                if holders.is_empty() {
                    entry.remove();
                }
            }
        }
        if cand.requests.is_empty() {
            debug_assert!(cand.load().is_zero(), "load left on an empty candidate");
            self.candidates.remove(&c);
        }
        Some(booking)
    }

    /// Sizes of the internal indexes: (bookings, candidates, active hashes, age entries).
    #[cfg(test)]
    fn internal_sizes(&self) -> (usize, usize, usize, usize) {
        (
            self.bookings.len(),
            self.candidates.len(),
            self.blocks.len(),
            self.by_age.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: CandidateKey = CandidateKey::new(1, 0);
    const A1: CandidateKey = CandidateKey::new(1, 1);
    const B: CandidateKey = CandidateKey::new(2, 0);

    fn tracker() -> LoadTracker {
        LoadTracker::new(LoadConfig::default())
    }

    fn load(p: u64, d: u64, r: u32) -> CandidateLoad {
        CandidateLoad {
            active_prefill_tokens: p,
            active_decode_blocks: d,
            active_requests: r,
        }
    }

    fn depths(t: &LoadTracker, hashes: &[u64]) -> Vec<(CandidateKey, u32)> {
        let mut out = vec![(CandidateKey::new(99, 99), 7)]; // must be cleared
        t.active_prefix_depths(hashes, &mut out);
        out.sort();
        out
    }

    #[test]
    fn default_config_is_300s() {
        assert_eq!(LoadConfig::default().expiry, Duration::from_secs(300));
        assert_eq!(tracker().config().expiry, Duration::from_secs(300));
    }

    #[test]
    fn book_adds_uncached_prefill_blocks_and_request() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 100, 32, &[1, 2, 3], 16, now).unwrap();
        // ceil(100/16) = 7 blocks: the 3 hashed ones and 4 no hash names
        assert_eq!(t.load(A), load(68, 7, 1));
        assert_eq!(t.load(B), CandidateLoad::default());
        assert_eq!(t.len(), 1);
        assert!(!t.is_empty());
        let b = t.get("r1").unwrap();
        assert_eq!(b.candidate, A);
        assert_eq!(b.block_hashes, vec![1, 2, 3]);
        assert!(!b.prefill_done);
        assert_eq!(b.booked_at, now);
        assert!(t.get("r2").is_none());
    }

    #[test]
    fn cached_beyond_prompt_saturates() {
        let mut t = tracker();
        t.book("r1", A, 10, 50, &[1], 4, Instant::now()).unwrap();
        assert_eq!(t.load(A), load(0, 3, 1));
        t.prefill_complete("r1").unwrap();
        assert_eq!(t.load(A), load(0, 3, 1));
    }

    #[test]
    fn shared_blocks_count_once_per_candidate() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 48, 0, &[1, 2, 3], 16, now).unwrap();
        t.book("r2", A, 64, 0, &[1, 2, 4, 5], 16, now).unwrap();
        // distinct {1,2,3,4,5}
        assert_eq!(t.load(A), load(112, 5, 2));
        // another candidate holding the same blocks counts them for itself
        t.book("r3", B, 32, 0, &[1, 2], 16, now).unwrap();
        assert_eq!(t.load(B), load(32, 2, 1));
        assert_eq!(t.load(A), load(112, 5, 2));

        t.free("r1").unwrap();
        // 1 and 2 are still held by r2; 3 is gone
        assert_eq!(t.load(A), load(64, 4, 1));
        t.free("r2").unwrap();
        assert_eq!(t.load(A), CandidateLoad::default());
        assert_eq!(t.load(B), load(32, 2, 1));
    }

    #[test]
    fn repeated_hash_within_one_booking_counts_once() {
        let mut t = tracker();
        t.book("r1", A, 48, 0, &[7, 7, 8], 16, Instant::now())
            .unwrap();
        assert_eq!(t.load(A), load(48, 2, 1));
        t.free("r1").unwrap();
        assert_eq!(t.internal_sizes(), (0, 0, 0, 0));
    }

    #[test]
    fn prefill_complete_removes_prompt_load_and_is_idempotent() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 100, 20, &[1], 16, now).unwrap();
        t.book("r2", A, 50, 0, &[2], 16, now).unwrap();
        assert_eq!(t.load(A).active_prefill_tokens, 130);
        // r1: ceil(100/16) = 7 blocks (1 hashed); r2: ceil(50/16) = 4 (1 hashed)
        assert_eq!(t.prefill_complete("r1"), Ok(A));
        assert_eq!(t.load(A), load(50, 11, 2));
        assert_eq!(t.prefill_complete("r1"), Ok(A));
        assert_eq!(t.load(A), load(50, 11, 2));
        assert!(t.get("r1").unwrap().prefill_done);
        // freeing after prefill does not subtract the prompt load twice
        t.free("r1").unwrap();
        assert_eq!(t.load(A), load(50, 4, 1));
    }

    #[test]
    fn growth_formula() {
        // isl 6, B 4: ceil(6/4) = 2 blocks for the prompt
        assert_eq!(decode_growth_blocks(6, 0, 4), 0);
        assert_eq!(decode_growth_blocks(6, 2, 4), 0); // 8 tokens, 2 blocks
        assert_eq!(decode_growth_blocks(6, 3, 4), 1); // 9 tokens, 3 blocks
        assert_eq!(decode_growth_blocks(6, 10, 4), 2); // 16 tokens, 4 blocks
        assert_eq!(decode_growth_blocks(8, 1, 4), 1);
        assert_eq!(decode_growth_blocks(0, 5, 4), 2);
        assert_eq!(decode_growth_blocks(3, 4, 0), 4); // block size 0 taken as 1
        assert_eq!(
            decode_growth_blocks(u32::MAX, u32::MAX, 1),
            u64::from(u32::MAX)
        );
    }

    #[test]
    fn private_prompt_blocks_formula() {
        assert_eq!(private_prompt_blocks(32, 2, 16), 0); // whole blocks, all hashed
        assert_eq!(private_prompt_blocks(33, 2, 16), 1); // one token into a third block
        assert_eq!(private_prompt_blocks(47, 2, 16), 1);
        assert_eq!(private_prompt_blocks(5, 0, 16), 1); // shorter than a block
        assert_eq!(private_prompt_blocks(0, 0, 16), 0);
        assert_eq!(private_prompt_blocks(10, 1, 4), 2); // hashes short of the complete blocks
        assert_eq!(private_prompt_blocks(4, 3, 4), 0); // more hashes than blocks: none
        assert_eq!(private_prompt_blocks(3, 0, 0), 3); // block size 0 taken as 1
    }

    #[test]
    fn partial_tail_blocks_are_each_requests_own() {
        // SPEC §8: a prompt occupies ceil(isl/B) blocks. Two prompts that share their two
        // complete blocks share those once, but each has its own partial tail block.
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 40, 0, &[1, 2], 16, now).unwrap();
        assert_eq!(t.load(A), load(40, 3, 1));
        t.book("r2", A, 35, 0, &[1, 2], 16, now).unwrap();
        assert_eq!(t.load(A), load(75, 4, 2));
        // a prompt of whole blocks has no tail
        t.book("r3", A, 48, 0, &[1, 2, 3], 16, now).unwrap();
        assert_eq!(t.load(A), load(123, 5, 3));
        // the tail leaves with its request, not before
        t.prefill_complete("r1").unwrap();
        assert_eq!(t.load(A).active_decode_blocks, 5);
        t.free("r1").unwrap();
        assert_eq!(t.load(A), load(83, 4, 2));
        t.free("r2").unwrap();
        assert_eq!(t.load(A), load(48, 3, 1));
        t.free("r3").unwrap();
        assert_eq!(t.internal_sizes(), (0, 0, 0, 0));
    }

    #[test]
    fn output_progress_grows_decode_blocks_monotonically() {
        let mut t = tracker();
        // 6 tokens at B 4: one complete block and the partial tail, which the output fills
        t.book("r1", A, 6, 0, &[1], 4, Instant::now()).unwrap();
        assert_eq!(t.load(A).active_decode_blocks, 2);
        assert_eq!(t.output_progress("r1", 2), Ok(A));
        assert_eq!(t.load(A).active_decode_blocks, 2);
        t.output_progress("r1", 3).unwrap();
        assert_eq!(t.load(A).active_decode_blocks, 3);
        t.output_progress("r1", 10).unwrap();
        assert_eq!(t.load(A).active_decode_blocks, 4);
        // a smaller total is ignored
        assert_eq!(t.output_progress("r1", 4), Ok(A));
        assert_eq!(t.load(A).active_decode_blocks, 4);
        assert_eq!(t.get("r1").unwrap().output_tokens, 10);
        // progress does not complete the prefill
        assert_eq!(t.load(A).active_prefill_tokens, 6);
        let b = t.free("r1").unwrap();
        assert_eq!(b.output_tokens, 10);
        assert_eq!(t.load(A), CandidateLoad::default());
    }

    #[test]
    fn free_releases_everything_and_returns_the_booking() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 40, 8, &[1, 2], 16, now).unwrap();
        t.output_progress("r1", 100).unwrap();
        let b = t.free("r1").unwrap();
        assert_eq!(b.request_id, "r1");
        assert_eq!(b.candidate, A);
        assert_eq!(
            (b.prompt_tokens, b.cached_tokens, b.block_size),
            (40, 8, 16)
        );
        assert_eq!(t.load(A), CandidateLoad::default());
        assert!(t.is_empty());
        assert_eq!(t.candidates().count(), 0);
        assert_eq!(t.internal_sizes(), (0, 0, 0, 0));
        // the id can be booked again
        t.book("r1", B, 1, 0, &[], 16, now).unwrap();
        assert_eq!(t.load(B), load(1, 1, 1));
    }

    #[test]
    fn errors() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("r1", A, 10, 0, &[1], 4, now).unwrap();
        assert_eq!(
            t.book("r1", B, 10, 0, &[1], 4, now),
            Err(LoadError::DuplicateRequest("r1".into()))
        );
        // the failed booking changed nothing
        assert_eq!(t.load(B), CandidateLoad::default());
        assert_eq!(t.load(A), load(10, 3, 1));
        let unknown = LoadError::UnknownRequest("nope".into());
        assert_eq!(t.prefill_complete("nope"), Err(unknown.clone()));
        assert_eq!(t.output_progress("nope", 5), Err(unknown.clone()));
        assert_eq!(t.free("nope").unwrap_err(), unknown);
        t.free("r1").unwrap();
        assert!(matches!(t.free("r1"), Err(LoadError::UnknownRequest(id)) if id == "r1"));
        assert_eq!(
            LoadError::DuplicateRequest("x".into()).to_string(),
            "request \"x\" is already booked"
        );
        assert_eq!(
            LoadError::UnknownRequest("x".into()).to_string(),
            "no booking for request \"x\""
        );
    }

    #[test]
    fn expire_frees_only_old_bookings() {
        let mut t = LoadTracker::new(LoadConfig {
            expiry: Duration::from_secs(10),
        });
        let t0 = Instant::now();
        let s = Duration::from_secs;
        t.book("old", A, 10, 0, &[1], 4, t0).unwrap();
        t.book("freed", A, 10, 0, &[2], 4, t0).unwrap();
        t.book("mid", B, 10, 0, &[1], 4, t0 + s(5)).unwrap();
        t.book("young", A, 10, 0, &[1], 4, t0 + s(9)).unwrap();
        t.free("freed").unwrap();
        // exactly at the expiry age: not older yet
        assert!(t.expire(t0 + s(10)).is_empty());
        let gone = t.expire(t0 + s(10) + Duration::from_millis(1));
        assert_eq!(
            gone.iter()
                .map(|b| b.request_id.as_str())
                .collect::<Vec<_>>(),
            ["old"]
        );
        assert_eq!(t.load(A), load(10, 3, 1));
        let gone = t.expire(t0 + s(100));
        assert_eq!(
            gone.iter()
                .map(|b| b.request_id.as_str())
                .collect::<Vec<_>>(),
            ["mid", "young"]
        );
        assert!(t.is_empty());
        assert_eq!(t.internal_sizes(), (0, 0, 0, 0));
        // a clock before the booking (non-monotonic caller) expires nothing
        t.book("x", A, 1, 0, &[], 4, t0 + s(50)).unwrap();
        assert!(t.expire(t0).is_empty());
    }

    #[test]
    fn origins_tag_bookings_and_remove_origin_frees_only_theirs() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("local", A, 10, 0, &[1], 4, now).unwrap();
        t.book("r1", A, 10, 0, &[1, 2], 4, now).unwrap();
        t.book("r2", B, 10, 0, &[1], 4, now).unwrap();
        t.book("s1", B, 10, 0, &[3], 4, now).unwrap();
        t.set_origin("r1", "rep-a").unwrap();
        t.set_origin("r2", "rep-a").unwrap();
        t.set_origin("s1", "rep-b").unwrap();
        assert_eq!(
            t.set_origin("nope", "rep-a"),
            Err(LoadError::UnknownRequest("nope".into()))
        );
        assert_eq!(t.origin("r1"), Some("rep-a"));
        assert_eq!(t.origin("local"), None);
        // A remote booking freed by id leaves its origin's set.
        t.free("s1").unwrap();
        assert_eq!(t.origin("s1"), None);
        assert!(t.remove_origin("rep-b").is_empty());
        let mut origins: Vec<_> = t
            .origins()
            .map(|(o, ids)| (o.to_owned(), ids.count()))
            .collect();
        origins.sort();
        assert_eq!(origins, [("rep-a".to_owned(), 2)]);
        // Dropping an origin frees its bookings, in booking order, and nothing else.
        let gone = t.remove_origin("rep-a");
        assert_eq!(
            gone.iter()
                .map(|b| b.request_id.as_str())
                .collect::<Vec<_>>(),
            ["r1", "r2"]
        );
        assert_eq!(t.load(A), load(10, 3, 1));
        assert!(t.load(B).is_zero());
        assert_eq!(t.origins().count(), 0);
        // Expiry untags too: a later booking under the same id is local.
        t.book("r3", B, 10, 0, &[], 4, now).unwrap();
        t.set_origin("r3", "rep-c").unwrap();
        t.expire(now + LoadConfig::DEFAULT_EXPIRY + Duration::from_secs(1));
        assert!(t.is_empty() && t.origins().count() == 0);
        t.book("r3", B, 10, 0, &[], 4, now).unwrap();
        assert_eq!(t.origin("r3"), None);
    }

    #[test]
    fn remove_worker_frees_all_ranks_and_remove_candidate_one() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("a0", A, 10, 0, &[1], 4, now).unwrap();
        t.book("a1", A1, 10, 0, &[1], 4, now).unwrap();
        t.book("a1b", A1, 10, 0, &[1, 2], 4, now).unwrap();
        t.book("b0", B, 10, 0, &[1], 4, now).unwrap();

        let gone = t.remove_candidate(A1);
        assert_eq!(
            gone.iter()
                .map(|b| b.request_id.as_str())
                .collect::<Vec<_>>(),
            ["a1", "a1b"]
        );
        assert_eq!(t.load(A1), CandidateLoad::default());
        assert_eq!(t.load(A), load(10, 3, 1));
        assert!(t.remove_candidate(A1).is_empty());

        t.book("a1c", A1, 10, 0, &[3], 4, now).unwrap();
        let gone = t.remove_worker(1);
        let mut ids: Vec<_> = gone.iter().map(|b| b.request_id.as_str()).collect();
        ids.sort();
        assert_eq!(ids, ["a0", "a1c"]);
        assert_eq!(t.load(A), CandidateLoad::default());
        assert_eq!(t.load(A1), CandidateLoad::default());
        assert_eq!(t.load(B), load(10, 3, 1));
        assert!(t.remove_worker(1).is_empty());
        assert!(t.remove_worker(42).is_empty());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn active_prefix_depths_walks_the_prompt() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("a", A, 64, 0, &[10, 11, 12, 13], 16, now).unwrap();
        t.book("a1", A1, 32, 0, &[10, 11], 16, now).unwrap();
        t.book("b", B, 64, 0, &[10, 11, 12, 99], 16, now).unwrap();
        t.book("c", CandidateKey::new(3, 0), 16, 0, &[20], 16, now)
            .unwrap();

        assert_eq!(
            depths(&t, &[10, 11, 12, 13, 14]),
            vec![(A, 4), (A1, 2), (B, 3)]
        );
        assert_eq!(depths(&t, &[10]), vec![(A, 1), (A1, 1), (B, 1)]);
        assert_eq!(depths(&t, &[10, 11, 12, 99]), vec![(A, 3), (A1, 2), (B, 4)]);
        assert_eq!(depths(&t, &[20, 21]), vec![(CandidateKey::new(3, 0), 1)]);
        assert!(depths(&t, &[]).is_empty());
        // (depths are by hash: a probe that starts mid-prompt matches what it names)
        assert_eq!(depths(&t, &[11, 12]), vec![(A, 2), (A1, 1), (B, 2)]);
        assert!(depths(&t, &[5, 10, 11]).is_empty());

        t.free("a").unwrap();
        assert_eq!(depths(&t, &[10, 11, 12, 13]), vec![(A1, 2), (B, 3)]);
    }

    #[test]
    fn active_prefix_depths_is_first_absent_index_even_without_prefix_closure() {
        // Not chained hashes: candidate A has blocks 1 and 3 but not 2.
        let mut t = tracker();
        let now = Instant::now();
        t.book("a", A, 0, 0, &[1, 3], 16, now).unwrap();
        t.book("b", B, 0, 0, &[1, 2, 3], 16, now).unwrap();
        t.book("c", A1, 0, 0, &[2, 3], 16, now).unwrap();
        assert_eq!(depths(&t, &[1, 2, 3]), vec![(A, 1), (B, 3)]);
        assert_eq!(depths(&t, &[2, 3]), vec![(A1, 2), (B, 2)]);
        assert_eq!(depths(&t, &[3, 1]), vec![(A, 2), (A1, 1), (B, 2)]);
    }

    #[test]
    fn candidates_lists_only_loaded_ones() {
        let mut t = tracker();
        let now = Instant::now();
        t.book("a", A, 5, 0, &[1], 16, now).unwrap();
        t.book("b", B, 0, 0, &[], 16, now).unwrap();
        let mut cs: Vec<_> = t.candidates().collect();
        cs.sort_by_key(|(c, _)| *c);
        assert_eq!(cs, vec![(A, load(5, 1, 1)), (B, load(0, 0, 1))]);
        assert_eq!(t.bookings().count(), 2);
        t.free("a").unwrap();
        assert_eq!(t.candidates().map(|(c, _)| c).collect::<Vec<_>>(), vec![B]);
    }
}

/// Model check: random operation sequences against a brute-force reference that recomputes every
/// aggregate from the list of live bookings.
#[cfg(test)]
mod model_check {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const CANDS: [CandidateKey; 4] = [
        CandidateKey::new(1, 0),
        CandidateKey::new(1, 1),
        CandidateKey::new(2, 0),
        CandidateKey::new(3, 0),
    ];
    const IDS: usize = 6;
    const EXPIRY_SECS: u64 = 10;

    fn id(i: usize) -> String {
        format!("r{i}")
    }

    /// Chained hashes of a prompt over a small alphabet: like sequence hashes, a value names a
    /// symbol together with its whole prefix, so prompts with a common prefix share hashes.
    fn chain(syms: &[u8]) -> Vec<u64> {
        let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
        syms.iter()
            .map(|&s| {
                h = (h ^ u64::from(s).wrapping_add(1))
                    .wrapping_mul(0xff51_afd7_ed55_8ccd)
                    .rotate_left(29);
                h
            })
            .collect()
    }

    #[derive(Clone, Debug)]
    enum Op {
        Book {
            id: usize,
            cand: usize,
            hashes: Vec<u64>,
            extra_tokens: u32,
            cached_tokens: u32,
            block_size: u32,
        },
        Prefill(usize),
        Output(usize, u32),
        Free(usize),
        Advance(u64),
        Expire,
        RemoveWorker(u64),
        RemoveCandidate(usize),
    }

    /// `raw`: hashes drawn independently from a tiny set (not prefix-closed, repeats inside one
    /// booking) instead of chains over a small alphabet.
    fn op(raw: bool) -> impl Strategy<Value = Op> {
        let hashes = if raw {
            prop::collection::vec(1u64..6, 0..6).boxed()
        } else {
            prop::collection::vec(0u8..3, 0..6)
                .prop_map(|s| chain(&s))
                .boxed()
        };
        let book = (
            0..IDS,
            0..CANDS.len(),
            hashes,
            0u32..4,
            0u32..80,
            prop::sample::select(vec![0u32, 1, 4, 16]),
        )
            .prop_map(
                |(id, cand, hashes, extra_tokens, cached_tokens, block_size)| Op::Book {
                    id,
                    cand,
                    hashes,
                    extra_tokens,
                    cached_tokens,
                    block_size,
                },
            );
        prop_oneof![
            6 => book,
            2 => (0..IDS).prop_map(Op::Prefill),
            2 => (0..IDS, 0u32..70).prop_map(|(i, n)| Op::Output(i, n)),
            3 => (0..IDS).prop_map(Op::Free),
            2 => (0u64..7).prop_map(Op::Advance),
            1 => Just(Op::Expire),
            1 => (1u64..4).prop_map(Op::RemoveWorker),
            1 => (0..CANDS.len()).prop_map(Op::RemoveCandidate),
        ]
    }

    #[derive(Clone, Debug)]
    struct RefBooking {
        b: Booking,
        seq: u64,
    }

    /// The reference: a list of live bookings; every answer is recomputed from it.
    struct Model {
        live: Vec<RefBooking>,
        expiry: Duration,
        seq: u64,
    }

    impl Model {
        fn find(&mut self, rid: &str) -> Result<&mut Booking, LoadError> {
            self.live
                .iter_mut()
                .map(|r| &mut r.b)
                .find(|b| b.request_id == rid)
                .ok_or_else(|| LoadError::UnknownRequest(rid.to_owned()))
        }

        fn take(&mut self, keep: impl Fn(&Booking) -> bool) -> Vec<Booking> {
            let (gone, kept): (Vec<_>, Vec<_>) = self.live.drain(..).partition(|r| !keep(&r.b));
            self.live = kept;
            gone.into_iter().map(|r| r.b).collect() // booking order, as `live` is
        }

        fn load(&self, c: CandidateKey) -> CandidateLoad {
            let mine: Vec<&Booking> = self
                .live
                .iter()
                .map(|r| &r.b)
                .filter(|b| b.candidate == c)
                .collect();
            let distinct: BTreeSet<u64> = mine
                .iter()
                .flat_map(|b| b.block_hashes.iter().copied())
                .collect();
            let growth: u64 = mine
                .iter()
                .map(|b| {
                    let bs = u64::from(b.block_size.max(1));
                    let isl = u64::from(b.prompt_tokens);
                    (isl + u64::from(b.output_tokens)).div_ceil(bs) - isl.div_ceil(bs)
                })
                .sum();
            // the prompt's blocks past its hashed ones, each booking's own
            let private: u64 = mine
                .iter()
                .map(|b| {
                    let blocks =
                        u64::from(b.prompt_tokens).div_ceil(u64::from(b.block_size.max(1)));
                    blocks.saturating_sub(b.block_hashes.len() as u64)
                })
                .sum();
            CandidateLoad {
                active_prefill_tokens: mine
                    .iter()
                    .filter(|b| !b.prefill_done)
                    .map(|b| u64::from(b.prompt_tokens.saturating_sub(b.cached_tokens)))
                    .sum(),
                active_decode_blocks: distinct.len() as u64 + private + growth,
                active_requests: mine.len() as u32,
            }
        }

        fn depths(&self, probe: &[u64]) -> Vec<(CandidateKey, u32)> {
            let mut out = Vec::new();
            for c in CANDS {
                let active: BTreeSet<u64> = self
                    .live
                    .iter()
                    .filter(|r| r.b.candidate == c)
                    .flat_map(|r| r.b.block_hashes.iter().copied())
                    .collect();
                let d = probe.iter().take_while(|h| active.contains(h)).count();
                if d > 0 {
                    out.push((c, d as u32));
                }
            }
            out
        }
    }

    fn same_booking(a: &Booking, b: &Booking) -> bool {
        a.request_id == b.request_id
            && a.candidate == b.candidate
            && a.prompt_tokens == b.prompt_tokens
            && a.cached_tokens == b.cached_tokens
            && a.block_hashes == b.block_hashes
            && a.prefill_done == b.prefill_done
            && a.output_tokens == b.output_tokens
            && a.booked_at == b.booked_at
            && a.block_size == b.block_size
    }

    fn same_bookings(got: &[Booking], want: &[Booking], sort: bool) -> bool {
        let mut got: Vec<&Booking> = got.iter().collect();
        let mut want: Vec<&Booking> = want.iter().collect();
        if sort {
            got.sort_by(|a, b| a.request_id.cmp(&b.request_id));
            want.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        }
        got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| same_booking(a, b))
    }

    fn check_state(
        t: &LoadTracker,
        m: &Model,
        probes: &[Vec<u64>],
        scratch: &mut Vec<(CandidateKey, u32)>,
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(t.len(), m.live.len());
        prop_assert_eq!(t.is_empty(), m.live.is_empty());
        for c in CANDS {
            prop_assert_eq!(t.load(c), m.load(c), "load of {}", c);
        }
        let mut listed: Vec<_> = t.candidates().collect();
        listed.sort_by_key(|(c, _)| *c);
        let want: Vec<_> = CANDS
            .iter()
            .map(|&c| (c, m.load(c)))
            .filter(|(_, l)| !l.is_zero())
            .collect();
        prop_assert_eq!(listed, want);
        for p in probes {
            t.active_prefix_depths(p, scratch);
            scratch.sort();
            prop_assert_eq!(&*scratch, &m.depths(p)[..], "depths of {:?}", p);
        }
        for i in 0..IDS {
            let rid = id(i);
            let want = m.live.iter().find(|r| r.b.request_id == rid).map(|r| &r.b);
            match (t.get(&rid), want) {
                (None, None) => {}
                (Some(a), Some(b)) => prop_assert!(same_booking(a, b), "{:?} vs {:?}", a, b),
                (a, b) => prop_assert!(false, "get({}) = {:?}, model {:?}", rid, a, b),
            }
        }
        let (bookings, cands, _blocks, ages) = t.internal_sizes();
        prop_assert_eq!(bookings, m.live.len());
        prop_assert_eq!(ages, m.live.len());
        prop_assert_eq!(cands, want_len(m));
        Ok(())
    }

    fn want_len(m: &Model) -> usize {
        m.live
            .iter()
            .map(|r| r.b.candidate)
            .collect::<BTreeSet<_>>()
            .len()
    }

    fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
        let expiry = Duration::from_secs(EXPIRY_SECS);
        let mut t = LoadTracker::new(LoadConfig { expiry });
        let mut m = Model {
            live: Vec::new(),
            expiry,
            seq: 0,
        };
        let t0 = Instant::now();
        let mut now = t0;
        let mut probes: Vec<Vec<u64>> = vec![
            chain(&[0, 0, 0, 0, 0, 0]),
            chain(&[0, 1, 2, 0, 1]),
            chain(&[1, 1, 1]),
            chain(&[2, 0]),
            vec![1, 2, 3, 4, 5],
            vec![3, 1, 4, 1, 5],
        ];
        let fixed_probes = probes.len();
        let mut scratch = Vec::new();

        for op in ops {
            match op {
                Op::Book {
                    id: i,
                    cand,
                    hashes,
                    extra_tokens,
                    cached_tokens,
                    block_size,
                } => {
                    let rid = id(i);
                    let c = CANDS[cand];
                    let prompt = hashes.len() as u32 * block_size.max(1) + extra_tokens;
                    let got = t.book(&rid, c, prompt, cached_tokens, &hashes, block_size, now);
                    let want = if m.live.iter().any(|r| r.b.request_id == rid) {
                        Err(LoadError::DuplicateRequest(rid.clone()))
                    } else {
                        m.live.push(RefBooking {
                            b: Booking {
                                request_id: rid.clone(),
                                candidate: c,
                                prompt_tokens: prompt,
                                cached_tokens,
                                block_hashes: hashes.clone(),
                                prefill_done: false,
                                output_tokens: 0,
                                booked_at: now,
                                block_size,
                            },
                            seq: m.seq,
                        });
                        m.seq += 1;
                        Ok(())
                    };
                    prop_assert_eq!(got, want);
                    probes.truncate(fixed_probes);
                    probes.push(hashes);
                }
                Op::Prefill(i) => {
                    let rid = id(i);
                    let want = m.find(&rid).map(|b| {
                        b.prefill_done = true;
                        b.candidate
                    });
                    prop_assert_eq!(t.prefill_complete(&rid), want);
                }
                Op::Output(i, n) => {
                    let rid = id(i);
                    let want = m.find(&rid).map(|b| {
                        b.output_tokens = b.output_tokens.max(n);
                        b.candidate
                    });
                    prop_assert_eq!(t.output_progress(&rid, n), want);
                }
                Op::Free(i) => {
                    let rid = id(i);
                    let want = m.find(&rid).map(|_| ());
                    let gone = m.take(|b| b.request_id != rid);
                    match (t.free(&rid), want) {
                        (Ok(b), Ok(())) => {
                            prop_assert!(same_booking(&b, &gone[0]), "{:?} vs {:?}", b, gone)
                        }
                        (Err(e), Err(w)) => prop_assert_eq!(e, w),
                        (g, w) => prop_assert!(false, "free: {:?} vs {:?}", g, w),
                    }
                }
                Op::Advance(secs) => now += Duration::from_secs(secs),
                Op::Expire => {
                    let got = t.expire(now);
                    // oldest first: by booked_at, then booking order
                    m.live.sort_by_key(|r| (r.b.booked_at, r.seq));
                    let exp = m.expiry;
                    let want = m.take(|b| now.saturating_duration_since(b.booked_at) <= exp);
                    m.live.sort_by_key(|r| r.seq);
                    prop_assert!(same_bookings(&got, &want, false), "{:?} vs {:?}", got, want);
                }
                Op::RemoveWorker(w) => {
                    let got = t.remove_worker(w);
                    let want = m.take(|b| b.candidate.worker_id != w);
                    prop_assert!(same_bookings(&got, &want, false), "{:?} vs {:?}", got, want);
                }
                Op::RemoveCandidate(ci) => {
                    let c = CANDS[ci];
                    let got = t.remove_candidate(c);
                    let want = m.take(|b| b.candidate != c);
                    prop_assert!(same_bookings(&got, &want, false), "{:?} vs {:?}", got, want);
                }
            }
            check_state(&t, &m, &probes, &mut scratch)?;
        }

        // Freeing everything leaves nothing behind.
        let ids: Vec<String> = m.live.iter().map(|r| r.b.request_id.clone()).collect();
        for rid in ids {
            prop_assert!(t.free(&rid).is_ok());
        }
        m.live.clear();
        check_state(&t, &m, &probes, &mut scratch)?;
        prop_assert_eq!(t.internal_sizes(), (0, 0, 0, 0));
        for c in CANDS {
            prop_assert!(t.load(c).is_zero());
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(6_000))]

        /// Chained hashes over a small alphabet: the realistic, prefix-closed case.
        #[test]
        fn tracker_matches_model_with_chained_hashes(ops in prop::collection::vec(op(false), 0..40)) {
            run(ops)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4_000))]

        /// Arbitrary hash lists from a tiny set: heavy sharing, repeats within a booking, and active
        /// sets that are not prefix-closed.
        #[test]
        fn tracker_matches_model_with_raw_hashes(ops in prop::collection::vec(op(true), 0..40)) {
            run(ops)?;
        }
    }
}
