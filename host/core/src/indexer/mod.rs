//! The indexer: which candidate holds which prompt blocks, per storage tier (SPEC §3, §5).
//!
//! KV events from engines (stored, removed, cleared) are applied to one [`tree::Tree`] per storage
//! tier; a route asks [`Indexer::find_matches`] how many leading blocks of its prompt each candidate
//! holds. Candidates are numbered densely (slots) so the trees can keep holder sets as bitsets and
//! the router can read overlaps from a flat array ([`DenseOverlaps`]).
//!
//! # Concurrency
//! Route queries and event writes share one `parking_lot::RwLock` around all tiers. Reads are short
//! (a compressed-tree walk: about a microsecond for a 256-block prompt) and run in parallel with
//! each other. Writes take the lock for a *bounded* amount of work: a stored event is applied in
//! chunks of at most [`WRITE_CHUNK_BLOCKS`] blocks and a removal in chunks of as many handles, and the
//! lock is released between chunks. parking_lot's lock is task-fair (a waiting writer stops new
//! readers, a waiting reader is served before the next writer chunk), so a burst of events can delay
//! a route by at most one chunk — a few microseconds — and never starves either side. A reader sees
//! a chunked store half applied; that is a valid state (every candidate's holdings stay
//! prefix-closed), just an older one. Clearing a worker is the one write whose cost grows with what
//! the worker holds (one tree walk over its nodes); engines clear rarely (restarts).
//!
//! We chose this over a lock-free or double-buffered (left-right) index because the hot read is
//! already microseconds, a chunked write bounds the wait to the same order, and a second copy of a
//! million-block index would double memory and write cost for no gain on two cores.
//!
//! # Approximate mode
//! Engines that publish no events are indexed from the router's own decisions: see [`approx`]. Its
//! writers take its timer lock first and then this index's write lock (never the other way round),
//! so recording and expiring are atomic with respect to each other; reads are unaffected.

pub mod approx;
#[cfg(test)]
mod model_check;
pub mod slots;
pub mod tree;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::candidate::{CandidateKey, WorkerId};
pub use slots::{Slot, SlotSet};
pub use tree::TreeMemory;
use tree::{StoreError, Tree};

/// Most blocks (or removal handles) applied under one write-lock acquisition.
pub const WRITE_CHUNK_BLOCKS: usize = 64;

/// Where a block lives on the engine (SPEC §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    #[default]
    Device,
    Host,
    Disk,
    External,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::External];

    /// Parses an engine's medium name (`GPU`, `CPU_PINNED`, `NVME`, ...); `None` for an unknown one,
    /// whose event must be dropped.
    pub fn from_medium(medium: &str) -> Option<Tier> {
        Some(match medium.to_ascii_uppercase().as_str() {
            "GPU" | "DEVICE" => Tier::Device,
            "CPU" | "CPU_PINNED" | "HOST" => Tier::Host,
            "DISK" | "STORAGE" | "NVME" => Tier::Disk,
            "EXTERNAL" | "REMOTE" | "SHARED" => Tier::External,
            _ => return None,
        })
    }

    fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }
}

/// One block of a stored event: the engine's opaque handle and the router's local hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    pub block_hash: u64,
    pub tokens_hash: u64,
}

/// What happened on an engine (SPEC §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEventData {
    Stored {
        parent_hash: Option<u64>,
        blocks: Vec<StoredBlock>,
    },
    Removed {
        block_hashes: Vec<u64>,
    },
    Cleared,
}

/// The tiers an event with `data`, sent for `tier`, applies to. A clear means "the worker (and
/// rank) holds nothing" (SPEC §3): every tier, whatever tier the event names. Both ingestion paths
/// (HTTP `POST /v1/events` and the ZMQ decoder) expand an event through this one function.
pub fn event_tiers(data: &KvEventData, tier: Tier) -> &'static [Tier] {
    match data {
        KvEventData::Cleared => &Tier::ALL,
        _ => match tier {
            Tier::Device => &[Tier::Device],
            Tier::Host => &[Tier::Host],
            Tier::Disk => &[Tier::Disk],
            Tier::External => &[Tier::External],
        },
    }
}

/// An event for one candidate and tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    pub candidate: CandidateKey,
    pub tier: Tier,
    pub event_id: u64,
    pub data: KvEventData,
}

/// Why an event was not applied, for the drop counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("parent block not found for this worker: the engine stored under a block the router never saw (events were lost or arrived out of order)")]
    ParentBlockNotFound,
    #[error("stored blocks repeat a block hash or their parent's hash; the event would corrupt the tree")]
    SelfReference,
}

impl ApplyError {
    /// The stable counter / error code name.
    pub fn code(self) -> &'static str {
        match self {
            ApplyError::ParentBlockNotFound => "parent_block_not_found",
            ApplyError::SelfReference => "self_reference",
        }
    }
}

/// What an applied event changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks the candidate newly holds (stores).
    pub stored: u64,
    /// Blocks the candidate stopped holding (removals, clears).
    pub removed: u64,
    /// Removal handles the candidate did not hold (not an error: the router may never have seen them).
    pub unknown_handles: u64,
}

/// Per-candidate overlaps of one query, sparse, by tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub device: Vec<(CandidateKey, u32)>,
    pub host: Vec<(CandidateKey, u32)>,
    /// Disk and external tiers (the deeper of the two).
    pub disk: Vec<(CandidateKey, u32)>,
}

/// Per-slot overlaps of one query, dense, for the router's hot path. Reused across queries: only
/// the slots a query touched are reset.
#[derive(Clone, Debug, Default)]
pub struct DenseOverlaps {
    /// `[device, host, disk]` per slot.
    values: Vec<[u32; 3]>,
    touched: Vec<Slot>,
}

impl DenseOverlaps {
    pub fn new() -> Self {
        Self::default()
    }

    fn reset(&mut self) {
        for &s in &self.touched {
            self.values[s as usize] = [0; 3];
        }
        self.touched.clear();
    }

    #[inline]
    fn record(&mut self, slot: Slot, tier: usize, depth: u32) {
        let i = slot as usize;
        if self.values.len() <= i {
            self.values.resize(i + 1, [0; 3]);
        }
        let v = &mut self.values[i];
        if *v == [0; 3] {
            self.touched.push(slot);
        }
        v[tier] = v[tier].max(depth);
    }

    /// `[device, host, disk]` blocks of a slot (zeros when it holds none of the prompt).
    #[inline]
    pub fn get(&self, slot: Slot) -> [u32; 3] {
        self.values.get(slot as usize).copied().unwrap_or([0; 3])
    }

    /// Replaces the overlaps with `values` (`[device, host, disk]` by slot): what another
    /// source (a served indexer) said, in the layout the router's steps read.
    pub fn fill(&mut self, values: impl IntoIterator<Item = (Slot, [u32; 3])>) {
        self.reset();
        for (slot, v) in values {
            for (tier, &depth) in v.iter().enumerate() {
                if depth > 0 {
                    self.record(slot, tier, depth);
                }
            }
        }
    }

    /// Slots with a non-zero overlap in some tier.
    pub fn touched(&self) -> &[Slot] {
        &self.touched
    }
}

/// Counters of the indexer (monotonic).
#[derive(Debug, Default)]
struct Counters {
    events_applied: AtomicU64,
    parent_block_not_found: AtomicU64,
    self_reference: AtomicU64,
    unknown_handles: AtomicU64,
    evicted: AtomicU64,
}

/// A snapshot of the indexer's size and counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    pub candidates: usize,
    /// (candidate, block) pairs per tier: device, host, disk, external.
    pub held_blocks: [u64; 4],
    /// Distinct blocks per tier.
    pub unique_blocks: [usize; 4],
    pub nodes: [usize; 4],
    pub events_applied: u64,
    pub dropped_parent_block_not_found: u64,
    pub dropped_self_reference: u64,
    pub unknown_removal_handles: u64,
    /// (candidate, block) entries evicted to keep the index under its cap.
    pub evicted_entries: u64,
}

#[derive(Debug, Default)]
struct State {
    slot_of: FxHashMap<CandidateKey, Slot>,
    key_of: Vec<Option<CandidateKey>>,
    free_slots: Vec<Slot>,
    trees: [Tree; 4],
}

impl State {
    fn slot(&mut self, key: CandidateKey) -> Slot {
        if let Some(&s) = self.slot_of.get(&key) {
            return s;
        }
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.key_of[s as usize] = Some(key);
                s
            }
            None => {
                self.key_of.push(Some(key));
                (self.key_of.len() - 1) as Slot
            }
        };
        self.slot_of.insert(key, s);
        s
    }

    fn release(&mut self, key: CandidateKey) -> u64 {
        let Some(s) = self.slot_of.remove(&key) else {
            return 0;
        };
        let removed = self.trees.iter_mut().map(|t| t.clear(s)).sum();
        self.key_of[s as usize] = None;
        self.free_slots.push(s);
        removed
    }
}

/// The KV index. `Send + Sync`; share it behind an `Arc`.
#[derive(Debug, Default)]
pub struct Indexer {
    state: RwLock<State>,
    counters: Counters,
    /// Most (candidate, block) entries over all tiers; 0 = no cap.
    max_entries: AtomicU64,
}

impl Indexer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps the (candidate, block) entries over all tiers (`None`: no cap). A store that takes
    /// the index over the cap is applied, then entries are evicted until the index is 1/64 below
    /// the cap (so eviction runs once per that many stored entries, not on every store): each step
    /// takes, from the candidate and tier holding the most blocks, its least recently matched
    /// leaf edge. Each step takes the write lock once, so readers wait at most one step.
    pub fn set_max_entries(&self, max: Option<u64>) {
        self.max_entries.store(max.unwrap_or(0), Relaxed);
    }

    fn enforce_cap(&self) {
        let cap = self.max_entries.load(Relaxed);
        if cap == 0 {
            return;
        }
        let held = |s: &State| s.trees.iter().map(Tree::held_blocks).sum::<u64>();
        if held(&self.state.read()) <= cap {
            return;
        }
        let target = cap - cap / 64;
        loop {
            let mut state = self.state.write();
            if held(&state) <= target {
                return;
            }
            // The largest holder: most blocks in one tier.
            let mut largest: Option<(usize, Slot, u64)> = None;
            for (t, tree) in state.trees.iter().enumerate() {
                for &s in state.slot_of.values() {
                    let n = tree.slot_blocks(s);
                    if n > largest.map_or(0, |l| l.2) {
                        largest = Some((t, s, n));
                    }
                }
            }
            let Some((t, s, _)) = largest else {
                return;
            };
            let n = state.trees[t].evict_least_recent(s);
            if n == 0 {
                return;
            }
            self.counters.evicted.fetch_add(n, Relaxed);
        }
    }

    /// The slot of a candidate, allocating one if it has none. Slots stay valid until the
    /// candidate (or its worker) is removed, so the router may cache them.
    pub fn slot(&self, key: CandidateKey) -> Slot {
        if let Some(&s) = self.state.read().slot_of.get(&key) {
            return s;
        }
        self.state.write().slot(key)
    }

    /// The slot of a candidate, if it has one.
    pub fn existing_slot(&self, key: CandidateKey) -> Option<Slot> {
        self.state.read().slot_of.get(&key).copied()
    }

    /// Applies one event; a store for a candidate the index does not know gives it a slot.
    /// Errors are also counted by reason.
    pub fn apply(&self, event: &KvEvent) -> Result<Applied, ApplyError> {
        self.apply_counted(event, true)
            .map(|a| a.expect("a slot is created when missing"))
    }

    /// Applies one event only if its candidate already has a slot (the router gives every
    /// registered candidate one); `Ok(None)` otherwise, and nothing changes. The router checks
    /// its registry before applying, but a worker removed between that check and this call has
    /// already had its slots released: creating one again here would leave blocks of a removed
    /// worker in the index, found again if the same id registers later.
    pub fn apply_to_known(&self, event: &KvEvent) -> Result<Option<Applied>, ApplyError> {
        self.apply_counted(event, false)
    }

    fn apply_counted(&self, event: &KvEvent, create: bool) -> Result<Option<Applied>, ApplyError> {
        let result = self.apply_inner(event, create);
        match result {
            Ok(None) => {}
            Ok(Some(a)) => {
                self.counters.events_applied.fetch_add(1, Relaxed);
                if a.unknown_handles > 0 {
                    self.counters
                        .unknown_handles
                        .fetch_add(a.unknown_handles, Relaxed);
                }
            }
            Err(ApplyError::ParentBlockNotFound) => {
                self.counters.parent_block_not_found.fetch_add(1, Relaxed);
            }
            Err(ApplyError::SelfReference) => {
                self.counters.self_reference.fetch_add(1, Relaxed);
            }
        }
        result
    }

    fn apply_inner(&self, event: &KvEvent, create: bool) -> Result<Option<Applied>, ApplyError> {
        let tier = event.tier.index();
        let mut applied = Applied::default();
        match &event.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                // Validate the whole event before applying any chunk of it.
                tree::check_whole_event(*parent_hash, blocks).map_err(store_error)?;
                let mut parent = *parent_hash;
                let mut chunks = blocks.chunks(WRITE_CHUNK_BLOCKS);
                let mut state = self.state.write();
                // A store that fails or stores nothing allocates no slot.
                let slot = match state.slot_of.get(&event.candidate) {
                    Some(&s) => s,
                    None if !create => return Ok(None),
                    None if parent.is_some() => return Err(ApplyError::ParentBlockNotFound),
                    None if blocks.is_empty() => return Ok(Some(applied)),
                    None => state.slot(event.candidate),
                };
                if blocks.is_empty() {
                    // Nothing to store, but the parent must still be known (SPEC §3).
                    return match parent {
                        Some(p) if !state.trees[tier].has_handle(slot, p) => {
                            Err(ApplyError::ParentBlockNotFound)
                        }
                        _ => Ok(Some(applied)),
                    };
                }
                let first = chunks.next().expect("non-empty");
                applied.stored += u64::from(
                    state.trees[tier]
                        .store_validated(slot, parent, first)
                        .map_err(store_error)?,
                );
                parent = first.last().map(|b| b.block_hash);
                drop(state);
                for chunk in chunks {
                    let mut state = self.state.write();
                    // The candidate may have been removed between chunks: its parent is gone.
                    let Some(&slot) = state.slot_of.get(&event.candidate) else {
                        return Err(ApplyError::ParentBlockNotFound);
                    };
                    applied.stored += u64::from(
                        state.trees[tier]
                            .store_validated(slot, parent, chunk)
                            .map_err(store_error)?,
                    );
                    parent = chunk.last().map(|b| b.block_hash);
                }
                self.enforce_cap();
            }
            KvEventData::Removed { block_hashes } => {
                for chunk in block_hashes.chunks(WRITE_CHUNK_BLOCKS) {
                    let mut state = self.state.write();
                    let Some(&slot) = state.slot_of.get(&event.candidate) else {
                        applied.unknown_handles += chunk.len() as u64;
                        continue;
                    };
                    let (removed, unknown) = state.trees[tier].remove_many(slot, chunk);
                    applied.removed += removed;
                    applied.unknown_handles += unknown;
                }
            }
            KvEventData::Cleared => {
                let mut state = self.state.write();
                if let Some(&slot) = state.slot_of.get(&event.candidate) {
                    applied.removed += state.trees[tier].clear(slot);
                }
            }
        }
        Ok(Some(applied))
    }

    /// Removes a candidate from every tier and frees its slot. Returns the blocks it held.
    pub fn remove_candidate(&self, key: CandidateKey) -> u64 {
        self.state.write().release(key)
    }

    /// Removes every rank of a worker from every tier. Returns the blocks they held.
    pub fn remove_worker(&self, worker_id: WorkerId) -> u64 {
        let mut state = self.state.write();
        let keys: Vec<CandidateKey> = state
            .slot_of
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        keys.into_iter().map(|k| state.release(k)).sum()
    }

    /// Empties one candidate in every tier, keeping its slot (an engine restart).
    pub fn clear_candidate(&self, key: CandidateKey) -> u64 {
        let mut state = self.state.write();
        let Some(&slot) = state.slot_of.get(&key) else {
            return 0;
        };
        state.trees.iter_mut().map(|t| t.clear(slot)).sum()
    }

    /// Per-candidate overlaps of a prompt given by its local block hashes, by tier.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        let state = self.state.read();
        let mut out = OverlapScores::default();
        let key = |s: Slot| state.key_of[s as usize].expect("slot in a tree has a key");
        state.trees[Tier::Device.index()]
            .find_matches(local_hashes, |s, d| out.device.push((key(s), d)));
        state.trees[Tier::Host.index()]
            .find_matches(local_hashes, |s, d| out.host.push((key(s), d)));
        let mut disk: FxHashMap<CandidateKey, u32> = FxHashMap::default();
        for t in [Tier::Disk, Tier::External] {
            state.trees[t.index()].find_matches(local_hashes, |s, d| {
                let e = disk.entry(key(s)).or_default();
                *e = (*e).max(d);
            });
        }
        out.disk = disk.into_iter().collect();
        out.device.sort_unstable();
        out.host.sort_unstable();
        out.disk.sort_unstable();
        out
    }

    /// The router's hot path: overlaps by slot into a reusable buffer.
    #[inline]
    pub fn find_matches_dense(&self, local_hashes: &[u64], out: &mut DenseOverlaps) {
        out.reset();
        let state = self.state.read();
        state.trees[0].find_matches(local_hashes, |s, d| out.record(s, 0, d));
        for (tier, column) in [(1, 1), (2, 2), (3, 2)] {
            let t = &state.trees[tier];
            if t.held_blocks() > 0 {
                t.find_matches(local_hashes, |s, d| out.record(s, column, d));
            }
        }
    }

    /// Device-tier overlaps only, sparse by slot (benchmarks compare this with other indexers).
    pub fn find_device_matches(&self, local_hashes: &[u64], out: &mut Vec<(Slot, u32)>) {
        out.clear();
        self.state.read().trees[0].find_matches(local_hashes, |s, d| out.push((s, d)));
    }

    /// The local hashes of the device-tier blocks `key` names by `handles` (handles it does not
    /// hold are skipped): what predict-on-route needs to know which predictions a removal
    /// contradicts.
    pub fn device_locals_of(&self, key: CandidateKey, handles: &[u64]) -> Vec<u64> {
        let state = self.state.read();
        let Some(&s) = state.slot_of.get(&key) else {
            return Vec::new();
        };
        let tree = &state.trees[Tier::Device.index()];
        handles
            .iter()
            .filter_map(|&h| tree.local_of(s, h))
            .collect()
    }

    /// Blocks a candidate holds per tier (device, host, disk, external).
    pub fn candidate_blocks(&self, key: CandidateKey) -> [u64; 4] {
        let state = self.state.read();
        let Some(&s) = state.slot_of.get(&key) else {
            return [0; 4];
        };
        [0, 1, 2, 3].map(|t| state.trees[t].slot_blocks(s))
    }

    pub fn stats(&self) -> IndexStats {
        let state = self.state.read();
        IndexStats {
            candidates: state.slot_of.len(),
            held_blocks: [0, 1, 2, 3].map(|t| state.trees[t].held_blocks()),
            unique_blocks: [0, 1, 2, 3].map(|t| state.trees[t].unique_blocks()),
            nodes: [0, 1, 2, 3].map(|t| state.trees[t].nodes()),
            events_applied: self.counters.events_applied.load(Relaxed),
            dropped_parent_block_not_found: self.counters.parent_block_not_found.load(Relaxed),
            dropped_self_reference: self.counters.self_reference.load(Relaxed),
            unknown_removal_handles: self.counters.unknown_handles.load(Relaxed),
            evicted_entries: self.counters.evicted.load(Relaxed),
        }
    }

    /// Heap bytes of the index by part, all tiers summed, plus the candidate tables (in
    /// `slot_handles`). Computed from capacities: see [`TreeMemory`].
    pub fn memory(&self) -> TreeMemory {
        let state = self.state.read();
        let mut m = TreeMemory::default();
        for t in &state.trees {
            m.add(&t.memory());
        }
        m.slot_handles += tree::memory::map_bytes::<(CandidateKey, Slot)>(state.slot_of.capacity())
            + state.key_of.capacity() * std::mem::size_of::<Option<CandidateKey>>()
            + state.free_slots.capacity() * std::mem::size_of::<Slot>();
        m
    }

    /// Checks every tree's structural invariants (tests only).
    #[cfg(any(test, feature = "invariants"))]
    pub fn check_invariants(&self) {
        for t in &self.state.read().trees {
            t.check_invariants();
        }
    }
}

fn store_error(e: StoreError) -> ApplyError {
    match e {
        StoreError::ParentNotFound => ApplyError::ParentBlockNotFound,
        StoreError::SelfReference => ApplyError::SelfReference,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(w: u64, parent: Option<u64>, hs: &[u64]) -> KvEvent {
        KvEvent {
            candidate: CandidateKey::new(w, 0),
            tier: Tier::Device,
            event_id: 0,
            data: KvEventData::Stored {
                parent_hash: parent,
                blocks: hs
                    .iter()
                    .map(|&h| StoredBlock {
                        block_hash: h + 1_000_000,
                        tokens_hash: h,
                    })
                    .collect(),
            },
        }
    }

    #[test]
    fn a_clear_expands_to_every_tier_other_events_to_their_own() {
        for t in Tier::ALL {
            assert_eq!(event_tiers(&KvEventData::Cleared, t), &Tier::ALL);
            let removed = KvEventData::Removed {
                block_hashes: vec![1],
            };
            assert_eq!(event_tiers(&removed, t), &[t]);
        }
    }

    /// Prompt `p` of 40 blocks: 8 shared blocks, then 32 of its own (local hashes; handles are
    /// local + 1,000,000 as in `stored`).
    fn prompt(p: u64) -> Vec<u64> {
        (0..40)
            .map(|i| if i < 8 { i + 1 } else { p * 1000 + i })
            .collect()
    }

    #[test]
    fn the_cap_holds_evicts_the_largest_least_recent_and_routing_stays_right() {
        let idx = Indexer::new();
        idx.set_max_entries(Some(640));
        let hot = prompt(1);
        idx.apply(&stored(1, None, &hot)).unwrap();
        let mut stored_entries = 40u64;
        for p in 2..60u64 {
            // Worker 1 stores two of every three prompts: it is the largest holder.
            let w = if p % 3 == 0 { 2 } else { 1 };
            let got = idx.apply(&stored(w, None, &prompt(p))).unwrap().stored;
            stored_entries += got;
            // The hot prompt is matched between stores.
            let m = idx.find_matches(&hot);
            assert!(
                m.device.contains(&(CandidateKey::new(1, 0), 40)),
                "hot prompt kept: {m:?}"
            );
            let st = idx.stats();
            let held: u64 = st.held_blocks.iter().sum();
            assert!(held <= 640, "cap holds: {held}");
            assert_eq!(
                stored_entries - held,
                st.evicted_entries,
                "evictions counted"
            );
            idx.check_invariants();
        }
        let st = idx.stats();
        assert!(st.evicted_entries > 1000, "{st:?}");
        // Routing is right for what remains: each worker's overlaps over all prompts add up to
        // exactly the blocks it holds (8 shared blocks once, then each prompt's own).
        for w in [1, 2] {
            let key = CandidateKey::new(w, 0);
            let mut sum = 0u64;
            for p in 1..60u64 {
                let d = idx
                    .find_matches(&prompt(p))
                    .device
                    .iter()
                    .find(|e| e.0 == key)
                    .map_or(0, |e| u64::from(e.1));
                sum += d.saturating_sub(8);
            }
            let held = idx.candidate_blocks(key)[0];
            assert!(held >= 8, "the shared prefix is the last to go: {held}");
            assert_eq!(sum + 8, held, "worker {w}");
        }
        // The smaller holder kept more of its own share than an even split would give it.
        assert!(idx.candidate_blocks(CandidateKey::new(2, 0))[0] > 200);
    }

    #[test]
    fn no_cap_evicts_nothing() {
        let idx = Indexer::new();
        for p in 1..40u64 {
            idx.apply(&stored(1, None, &prompt(p))).unwrap();
        }
        assert_eq!(idx.stats().evicted_entries, 0);
        assert_eq!(
            idx.candidate_blocks(CandidateKey::new(1, 0))[0],
            8 + 39 * 32
        );
    }

    #[test]
    fn media_parse_and_unknown_is_none() {
        assert_eq!(Tier::from_medium("GPU"), Some(Tier::Device));
        assert_eq!(Tier::from_medium("cpu_pinned"), Some(Tier::Host));
        assert_eq!(Tier::from_medium("NVME"), Some(Tier::Disk));
        assert_eq!(Tier::from_medium("REMOTE"), Some(Tier::External));
        assert_eq!(Tier::from_medium("TAPE"), None);
    }

    #[test]
    fn chunked_store_equals_one_store_and_errors_are_counted() {
        let idx = Indexer::new();
        let long: Vec<u64> = (1..=1000).collect();
        assert_eq!(idx.apply(&stored(1, None, &long)).unwrap().stored, 1000);
        let s = idx.find_matches(&long);
        assert_eq!(s.device, vec![(CandidateKey::new(1, 0), 1000)]);
        assert_eq!(
            idx.apply(&stored(1, Some(42), &[5])),
            Err(ApplyError::ParentBlockNotFound)
        );
        let mut dup = long.clone();
        dup.push(1);
        assert_eq!(
            idx.apply(&stored(2, None, &dup)),
            Err(ApplyError::SelfReference)
        );
        assert_eq!(
            idx.candidate_blocks(CandidateKey::new(2, 0)),
            [0; 4],
            "a rejected long event applies no chunk"
        );
        let st = idx.stats();
        assert_eq!(st.dropped_parent_block_not_found, 1);
        assert_eq!(st.dropped_self_reference, 1);
        assert_eq!(st.events_applied, 1);
        idx.check_invariants();
    }

    #[test]
    fn tiers_are_independent_and_dense_overlaps_match() {
        let idx = Indexer::new();
        idx.apply(&stored(1, None, &[1, 2, 3])).unwrap();
        let mut host = stored(1, None, &[1, 2, 3, 4]);
        host.tier = Tier::Host;
        idx.apply(&host).unwrap();
        let mut ext = stored(2, None, &[1]);
        ext.tier = Tier::External;
        idx.apply(&ext).unwrap();
        let s = idx.find_matches(&[1, 2, 3, 4]);
        let k1 = CandidateKey::new(1, 0);
        let k2 = CandidateKey::new(2, 0);
        assert_eq!(s.device, vec![(k1, 3)]);
        assert_eq!(s.host, vec![(k1, 4)]);
        assert_eq!(s.disk, vec![(k2, 1)]);
        let mut dense = DenseOverlaps::new();
        idx.find_matches_dense(&[1, 2, 3, 4], &mut dense);
        assert_eq!(dense.get(idx.slot(k1)), [3, 4, 0]);
        assert_eq!(dense.get(idx.slot(k2)), [0, 0, 1]);
        idx.find_matches_dense(&[9], &mut dense);
        assert_eq!(dense.get(idx.slot(k1)), [0, 0, 0], "reset between queries");
    }

    #[test]
    fn worker_removal_and_clear() {
        let idx = Indexer::new();
        idx.apply(&stored(1, None, &[1, 2])).unwrap();
        let mut r1 = stored(1, None, &[1, 2, 3]);
        r1.candidate.dp_rank = 1;
        idx.apply(&r1).unwrap();
        idx.apply(&stored(2, None, &[1])).unwrap();
        assert_eq!(idx.remove_worker(1), 5);
        assert_eq!(
            idx.find_matches(&[1, 2]).device,
            vec![(CandidateKey::new(2, 0), 1)]
        );
        let clear = KvEvent {
            candidate: CandidateKey::new(2, 0),
            tier: Tier::Device,
            event_id: 1,
            data: KvEventData::Cleared,
        };
        assert_eq!(idx.apply(&clear).unwrap().removed, 1);
        assert!(idx.find_matches(&[1]).device.is_empty());
        assert_eq!(idx.stats().unique_blocks[0], 0);
        idx.check_invariants();
    }
}
