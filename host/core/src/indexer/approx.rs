//! Approximate mode: indexing engines that publish no KV events (SPEC §3).
//!
//! Without events the router still knows one thing: where it sent each prompt. After every booked
//! decision the request's blocks are inserted for the chosen candidate as if the engine had stored
//! them, and they expire after a TTL (default 120 s) unless a later request on the same candidate
//! re-inserts them, which refreshes the TTL. Expiry is bucketed (default 100 ms) so a timer wheel of
//! a few thousand buckets covers the TTL and expiring costs nothing per untouched block.
//!
//! The handles of approximate blocks are the router's own chained sequence hashes (they name a block
//! together with its prefix, exactly what an engine handle does), so the same [`Indexer`] and tree
//! serve both modes. A block's expiry is never earlier than any of its descendants' — every refresh
//! of a path refreshes its whole prefix — so removing an expired block (which takes its subtree) only
//! ever takes blocks that have expired too.
//!
//! # Concurrency
//! `record` and `expire` each hold the timer lock while they change the index (lock order: timers,
//! then the index's write lock; nothing takes them the other way round). Deciding that a block is
//! due and removing it is therefore atomic with respect to refreshes: a `record` can never land
//! between the two and see its refreshed blocks removed. Route reads only take the index's read
//! lock and are not delayed by the timer lock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::{Indexer, KvEvent, KvEventData, StoredBlock, Tier};
use crate::candidate::{CandidateKey, WorkerId};
use crate::hashing;

/// Settings of approximate mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApproxConfig {
    pub ttl: Duration,
    pub bucket: Duration,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            bucket: Duration::from_millis(100),
        }
    }
}

#[derive(Debug, Default)]
struct Timers {
    /// (candidate, sequence hash) → expiry bucket.
    expiry: FxHashMap<(CandidateKey, u64), u64>,
    /// Expiry bucket → keys that were set to expire in it (stale entries skipped when fired).
    buckets: BTreeMap<u64, Vec<(CandidateKey, u64)>>,
}

/// Inserts routed prompts into an [`Indexer`] and expires them.
#[derive(Debug)]
pub struct ApproxIndexer {
    config: ApproxConfig,
    epoch: Instant,
    timers: Mutex<Timers>,
}

impl ApproxIndexer {
    pub fn new(config: ApproxConfig) -> Self {
        Self {
            config,
            epoch: Instant::now(),
            timers: Mutex::new(Timers::default()),
        }
    }

    fn bucket_of(&self, t: Instant) -> u64 {
        let b = self.config.bucket.as_nanos().max(1);
        (t.saturating_duration_since(self.epoch).as_nanos() / b) as u64
    }

    /// Records that `candidate` now holds the prompt with these local hashes (as of `now`).
    pub fn record(
        &self,
        index: &Indexer,
        candidate: CandidateKey,
        local_hashes: &[u64],
        now: Instant,
    ) {
        if local_hashes.is_empty() {
            return;
        }
        let seq = hashing::sequence_hashes(local_hashes);
        let blocks = seq
            .iter()
            .zip(local_hashes)
            .map(|(&s, &l)| StoredBlock {
                block_hash: s,
                tokens_hash: l,
            })
            .collect();
        // Under the timer lock: an `expire` cannot decide these blocks are due (from an older
        // timer) and remove them after this store refreshed them.
        let mut timers = self.timers.lock();
        // Sequence hashes are distinct along a path unless XXH3 collides; a rejected store only
        // means this prompt is not indexed.
        let _ = index.apply(&KvEvent {
            candidate,
            tier: Tier::Device,
            event_id: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks,
            },
        });
        // Expire at the end of the bucket the TTL ends in (never early).
        let bucket = self.bucket_of(now + self.config.ttl) + 1;
        let Timers { expiry, buckets } = &mut *timers;
        let keys = buckets.entry(bucket).or_default();
        for s in seq {
            expiry.insert((candidate, s), bucket);
            keys.push((candidate, s));
        }
    }

    /// Removes every block whose TTL has passed by `now`. Returns how many blocks left the index.
    pub fn expire(&self, index: &Indexer, now: Instant) -> u64 {
        let current = self.bucket_of(now);
        let mut due: FxHashMap<CandidateKey, Vec<u64>> = FxHashMap::default();
        // Held until the due blocks are out of the index (see the module docs).
        let mut timers = self.timers.lock();
        let Timers { expiry, buckets } = &mut *timers;
        while let Some(entry) = buckets.first_entry() {
            if *entry.key() > current {
                break;
            }
            let (bucket, keys) = entry.remove_entry();
            for key in keys {
                if expiry.get(&key) == Some(&bucket) {
                    expiry.remove(&key);
                    due.entry(key.0).or_default().push(key.1);
                }
            }
        }
        let mut removed = 0;
        for (candidate, handles) in due {
            if let Ok(a) = index.apply(&KvEvent {
                candidate,
                tier: Tier::Device,
                event_id: 0,
                data: KvEventData::Removed {
                    block_hashes: handles,
                },
            }) {
                removed += a.removed;
            }
        }
        drop(timers);
        removed
    }

    /// Forgets the timers of a removed worker (its blocks leave the index with the worker).
    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.timers
            .lock()
            .expiry
            .retain(|(c, _), _| c.worker_id != worker_id);
    }

    /// Blocks with a pending expiry.
    pub fn tracked(&self) -> usize {
        self.timers.lock().expiry.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_expire_and_refresh() {
        let idx = Indexer::new();
        let approx = ApproxIndexer::new(ApproxConfig {
            ttl: Duration::from_secs(10),
            bucket: Duration::from_millis(100),
        });
        let t0 = Instant::now();
        let c = CandidateKey::new(3, 0);
        approx.record(&idx, c, &[1, 2, 3], t0);
        assert_eq!(idx.find_matches(&[1, 2, 3]).device, vec![(c, 3)]);
        // Refresh the first two blocks later.
        approx.record(&idx, c, &[1, 2], t0 + Duration::from_secs(5));
        assert_eq!(approx.expire(&idx, t0 + Duration::from_secs(9)), 0);
        // Block 3 expires after 10 s; blocks 1, 2 live until 15 s.
        assert_eq!(approx.expire(&idx, t0 + Duration::from_millis(10_300)), 1);
        assert_eq!(idx.find_matches(&[1, 2, 3]).device, vec![(c, 2)]);
        assert_eq!(approx.expire(&idx, t0 + Duration::from_millis(15_300)), 2);
        assert!(idx.find_matches(&[1, 2, 3]).device.is_empty());
        assert_eq!(approx.tracked(), 0);
        idx.check_invariants();
    }
}
