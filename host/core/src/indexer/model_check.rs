//! Model check of the indexer (tests only).
//!
//! A brute-force reference model (per candidate and tier: the set of held blocks, each named by its
//! full path of local hashes from the root, and the engine handles naming those paths) runs side by
//! side with [`Indexer`] over random event sequences. After every operation every answer is
//! compared: `find_matches`, `find_device_matches` and `find_matches_dense` for many probe prompts,
//! `Applied` counts, errors, per-candidate and per-tier sizes, distinct blocks, counters, slot
//! stability, and the trees' structural invariants. The model shares no code or data structure with
//! the trees.
//!
//! A second property checks approximate mode ([`ApproxIndexer`]) against a model of per-(candidate,
//! path) refresh times and the documented expiry rule, on a fake clock. A threaded test checks that
//! readers never see a torn state while writers apply chunked stores and removals.

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rustc_hash::FxHashMap;

use super::approx::{ApproxConfig, ApproxIndexer};
use super::*;
use crate::candidate::{CandidateKey, WorkerId};

/// A block, named by the local hashes of the path from the root to it (inclusive).
type Path = Vec<u64>;

/// Workers 1 and 2 have two data-parallel ranks, worker 3 has one.
const CANDIDATES: [CandidateKey; 5] = [
    CandidateKey::new(1, 0),
    CandidateKey::new(1, 1),
    CandidateKey::new(2, 0),
    CandidateKey::new(2, 1),
    CandidateKey::new(3, 0),
];
const WORKERS: [WorkerId; 3] = [1, 2, 3];
/// Engine handles of short stores (and of most removals) come from `0..SMALL_HANDLES`, so handles
/// are often reused, rebound, hit and missed.
const SMALL_HANDLES: u64 = 20;
/// Fans use local hashes `(start + 5 i) % FAN_LOCALS` (distinct: 5 and 24 are coprime).
const FAN_LOCALS: u64 = 24;
/// Long stores name their blocks `base + i` with one of these bases (two banks, so a long store can
/// hang under another long store's block without referencing itself).
const LONG_BANKS: [u64; 2] = [100, 1100];

fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into())
}

// ------------------------------------------------------------------------------------------------
// The reference model of event mode.
// ------------------------------------------------------------------------------------------------

/// Id of a path of local hashes from the root.
type PathId = u32;
/// The empty path (the root).
const EMPTY: PathId = 0;

/// Every path the model has seen, hash-consed: one id per distinct path (a bijection, so a set of
/// ids is a set of paths). Only the model's bookkeeping uses it, so that comparing and hashing a
/// path costs O(1) instead of O(length); the sets of held paths below are plain sets.
#[derive(Debug)]
struct Paths {
    ids: FxHashMap<(PathId, u64), PathId>,
    /// Per id: the path without its last block, and the path's length.
    parent: Vec<PathId>,
    len: Vec<u32>,
    last: Vec<u64>,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            ids: FxHashMap::default(),
            parent: vec![EMPTY],
            len: vec![0],
            last: vec![0],
        }
    }
}

impl Paths {
    /// `path + [local]`.
    fn push(&mut self, path: PathId, local: u64) -> PathId {
        if let Some(&id) = self.ids.get(&(path, local)) {
            return id;
        }
        let id = self.parent.len() as PathId;
        self.ids.insert((path, local), id);
        self.parent.push(path);
        self.len.push(self.len[path as usize] + 1);
        self.last.push(local);
        id
    }

    /// Whether `path` starts with `prefix` (or is it).
    fn starts_with(&self, mut path: PathId, prefix: PathId) -> bool {
        while self.len[path as usize] > self.len[prefix as usize] {
            path = self.parent[path as usize];
        }
        path == prefix
    }

    fn to_vec(&self, mut path: PathId) -> Path {
        let mut v = Vec::with_capacity(self.len[path as usize] as usize);
        while path != EMPTY {
            v.push(self.last[path as usize]);
            path = self.parent[path as usize];
        }
        v.reverse();
        v
    }
}

/// A set of path ids, as a bitmap (ids are small and dense).
#[derive(Debug, Default)]
struct IdSet {
    words: Vec<u64>,
    len: usize,
}

impl IdSet {
    fn contains(&self, id: &PathId) -> bool {
        let (w, b) = (*id as usize / 64, id % 64);
        self.words.get(w).is_some_and(|word| word >> b & 1 == 1)
    }

    /// Returns whether `id` was not in the set.
    fn insert(&mut self, id: PathId) -> bool {
        let (w, b) = (id as usize / 64, id % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        let fresh = self.words[w] >> b & 1 == 0;
        self.words[w] |= 1 << b;
        self.len += fresh as usize;
        fresh
    }

    fn iter(&self) -> impl Iterator<Item = PathId> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    i as PathId * 64 + b
                })
            })
        })
    }

    fn union_with(&mut self, other: &IdSet) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
        self.len = self.words.iter().map(|w| w.count_ones() as usize).sum();
    }

    fn retain(&mut self, keep: impl Fn(&PathId) -> bool) {
        let drop: Vec<PathId> = self.iter().filter(|id| !keep(id)).collect();
        for id in drop {
            self.words[id as usize / 64] &= !(1 << (id % 64));
            self.len -= 1;
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What one candidate holds in one tier.
#[derive(Debug, Default)]
struct Holdings {
    /// Every held block, by path. Prefix-closed.
    held: IdSet,
    /// Engine handle → the path it names. Every named path is held; a path has at most one handle.
    handles: FxHashMap<u64, PathId>,
}

impl Holdings {
    /// The largest `k` such that `query[..k]` is held, given the ids of the query's prefixes.
    /// Held sets are prefix-closed ([`Model::leaves`] checks it after every operation), so "is
    /// held" is true then false along the prefixes and a binary search finds the boundary.
    fn depth(&self, prefix_ids: &[PathId]) -> u32 {
        prefix_ids.partition_point(|id| self.held.contains(id)) as u32
    }
}

#[derive(Debug, Default)]
struct Model {
    paths: Paths,
    by: BTreeMap<(CandidateKey, usize), Holdings>,
    /// Candidates that have a slot: given by `Indexer::slot` or by an applied store of at least
    /// one block; taken by candidate or worker removal. A rejected or empty store allocates none.
    slotted: std::collections::BTreeSet<CandidateKey>,
    events_applied: u64,
    parent_block_not_found: u64,
    self_reference: u64,
    unknown_handles: u64,
}

impl Model {
    fn apply(&mut self, ev: &KvEvent) -> Result<Applied, ApplyError> {
        let r = self.apply_inner(ev);
        if let (Ok(_), KvEventData::Stored { blocks, .. }) = (&r, &ev.data) {
            if !blocks.is_empty() {
                self.slotted.insert(ev.candidate);
            }
        }
        match r {
            Ok(a) => {
                self.events_applied += 1;
                self.unknown_handles += a.unknown_handles;
            }
            Err(ApplyError::ParentBlockNotFound) => self.parent_block_not_found += 1,
            Err(ApplyError::SelfReference) => self.self_reference += 1,
        }
        self.by.retain(|_, h| !h.held.is_empty());
        r
    }

    fn apply_inner(&mut self, ev: &KvEvent) -> Result<Applied, ApplyError> {
        let key = (ev.candidate, ev.tier.index());
        let mut applied = Applied::default();
        let paths = &mut self.paths;
        match &ev.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
            } => {
                let mut named: Vec<u64> = parent_hash.iter().copied().collect();
                for b in blocks {
                    if named.contains(&b.block_hash) {
                        return Err(ApplyError::SelfReference);
                    }
                    named.push(b.block_hash);
                }
                let h = self.by.entry(key).or_default();
                let mut path = match parent_hash {
                    None => EMPTY,
                    Some(p) => *h.handles.get(p).ok_or(ApplyError::ParentBlockNotFound)?,
                };
                for b in blocks {
                    path = paths.push(path, b.tokens_hash);
                    if h.held.insert(path) {
                        applied.stored += 1;
                    }
                    // One handle per path: a path re-stored under a new handle drops the old one;
                    // a handle that named another path now names this one.
                    h.handles.retain(|_, p| *p != path);
                    h.handles.insert(b.block_hash, path);
                }
            }
            KvEventData::Removed { block_hashes } => {
                let mut empty = Holdings::default();
                let h = self.by.get_mut(&key).unwrap_or(&mut empty);
                for handle in block_hashes {
                    match h.handles.get(handle).copied() {
                        Some(p) => {
                            let before = h.held.len();
                            h.held.retain(|&q| !paths.starts_with(q, p));
                            applied.removed += (before - h.held.len()) as u64;
                            let held = &h.held;
                            h.handles.retain(|_, q| held.contains(q));
                        }
                        None => applied.unknown_handles += 1,
                    }
                }
            }
            KvEventData::Cleared => {
                if let Some(h) = self.by.remove(&key) {
                    applied.removed = h.held.len() as u64;
                }
            }
        }
        Ok(applied)
    }

    /// Drops every tier of the candidates `pick` selects; returns the blocks they held.
    fn drop_candidates(&mut self, pick: impl Fn(CandidateKey) -> bool) -> u64 {
        let mut removed = 0;
        self.by.retain(|(c, _), h| {
            if pick(*c) {
                removed += h.held.len() as u64;
                false
            } else {
                true
            }
        });
        removed
    }

    fn holds_anything(&self, key: CandidateKey) -> bool {
        self.by.keys().any(|(c, _)| *c == key)
    }

    /// Ids of `query[..1]`, `query[..2]`, ... as far as the model has ever seen those paths (a path
    /// it never saw is held by nobody).
    fn prefix_ids(&self, query: &[u64]) -> Vec<PathId> {
        let mut ids = Vec::with_capacity(query.len());
        let mut prefix = EMPTY;
        for &l in query {
            match self.paths.ids.get(&(prefix, l)) {
                Some(&id) => prefix = id,
                None => break,
            }
            ids.push(prefix);
        }
        ids
    }

    fn expected_matches(&self, query: &[u64]) -> OverlapScores {
        let prefix_ids = self.prefix_ids(query);
        let mut out = OverlapScores::default();
        let mut disk: BTreeMap<CandidateKey, u32> = BTreeMap::new();
        for (&(key, tier), h) in &self.by {
            let d = h.depth(&prefix_ids);
            if d == 0 {
                continue;
            }
            match tier {
                0 => out.device.push((key, d)),
                1 => out.host.push((key, d)),
                _ => {
                    let e = disk.entry(key).or_default();
                    *e = (*e).max(d);
                }
            }
        }
        out.disk = disk.into_iter().collect();
        out.device.sort_unstable();
        out.host.sort_unstable();
        out
    }

    /// Blocks held per tier (sum over candidates) and distinct blocks per tier.
    fn tier_sizes(&self) -> ([u64; 4], [usize; 4]) {
        let mut held = [0u64; 4];
        let mut distinct: [IdSet; 4] = Default::default();
        for (&(_, tier), h) in &self.by {
            held[tier] += h.held.len() as u64;
            distinct[tier].union_with(&h.held);
        }
        (held, distinct.map(|d| d.len()))
    }

    fn candidate_blocks(&self, key: CandidateKey) -> [u64; 4] {
        let mut out = [0; 4];
        for (t, o) in out.iter_mut().enumerate() {
            *o = self.by.get(&(key, t)).map_or(0, |h| h.held.len() as u64);
        }
        out
    }

    /// The deepest held paths (held paths that are no held path's parent), of all candidates.
    /// Also checks the model's own invariants: holdings are prefix-closed and handles name held
    /// paths.
    fn leaves(&self) -> Result<Vec<Path>, String> {
        let mut out = IdSet::default();
        for (&(key, tier), h) in &self.by {
            let mut inner = IdSet::default();
            for p in h.held.iter() {
                inner.insert(self.paths.parent[p as usize]);
            }
            if let Some(p) = inner.iter().find(|&p| p != EMPTY && !h.held.contains(&p)) {
                return Err(format!(
                    "model bug: {key} tier {tier} holds children of {:?} but not it",
                    self.paths.to_vec(p)
                ));
            }
            if let Some(p) = h.handles.values().find(|&p| !h.held.contains(p)) {
                return Err(format!(
                    "model bug: {key} tier {tier} names {:?}, not held",
                    self.paths.to_vec(*p)
                ));
            }
            for p in h.held.iter().filter(|p| !inner.contains(p)) {
                out.insert(p);
            }
        }
        let mut v: Vec<Path> = out.iter().map(|p| self.paths.to_vec(p)).collect();
        v.sort_unstable();
        Ok(v)
    }

    fn all_held(&self) -> Vec<Path> {
        let mut all = IdSet::default();
        for h in self.by.values() {
            all.union_with(&h.held);
        }
        let mut v: Vec<Path> = all.iter().map(|p| self.paths.to_vec(p)).collect();
        v.sort_unstable();
        v
    }
}

// ------------------------------------------------------------------------------------------------
// Generated operations.
// ------------------------------------------------------------------------------------------------

/// A removal handle, resolved against the model when the removal is applied.
#[derive(Clone, Debug)]
enum HandleSpec {
    /// The `i % n`-th (sorted) handle the model knows for that candidate and tier (`Raw(i % 20)`
    /// if none).
    Known(usize),
    Raw(u64),
}

/// The parent of a store, resolved against the model when the store is applied.
#[derive(Clone, Debug)]
enum ParentSpec {
    Root,
    /// The `i % n`-th (sorted) handle the model knows for that candidate and tier (root if none).
    Known(usize),
    /// Any small handle: may or may not be known.
    Raw(u64),
    /// One of the store's own handles (always a self reference).
    SelfRef(usize),
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        cand: usize,
        tier: Tier,
        parent: ParentSpec,
        /// (handle, local hash).
        blocks: Vec<(u64, u64)>,
        /// Make the handles distinct from each other and the parent (otherwise they may repeat).
        distinct: bool,
    },
    /// 65..=200 blocks: crosses the indexer's write chunks.
    LongStore {
        cand: usize,
        tier: Tier,
        parent: ParentSpec,
        len: usize,
        /// Which of a few related long paths (they share prefixes of various lengths).
        family: u64,
        /// Overwrite one local hash (a divergence at a random depth).
        mutate: Option<(usize, u64)>,
        /// Name one block by a small handle (rebinding a handle other stores use).
        reuse: Option<(usize, u64)>,
        /// Copy one handle onto another position (a self reference spanning chunks).
        dup: Option<(usize, usize)>,
        bank: usize,
    },
    Remove {
        cand: usize,
        tier: Tier,
        handles: Vec<HandleSpec>,
    },
    /// Re-store (from the root, under fresh handles `first + i`) the path the `which`-th known
    /// handle names, plus `extra` blocks: the engine re-sending a prefix it holds.
    Replay {
        cand: usize,
        tier: Tier,
        which: usize,
        first: u64,
        extra: Vec<u64>,
    },
    /// Remove, in one event, the handles of the last `len` named blocks of the path the
    /// `which`-th known handle names (its own and its ancestors'): an engine evicting a sequence.
    /// `order` 0: deepest first (tail first), 1: shallowest first, 2: deepest first but the
    /// deepest moved to the end, 3: deepest first, then all of them again.
    RemoveRun {
        cand: usize,
        tier: Tier,
        which: usize,
        len: usize,
        order: u8,
    },
    Clear {
        cand: usize,
        tier: Tier,
    },
    ClearCandidate(usize),
    RemoveCandidate(usize),
    RemoveWorker(usize),
    /// `Indexer::slot`: allocates a slot without holding anything.
    Slot(usize),
    /// `width` single-block stores under one parent, with distinct local hashes: a node with more
    /// children than the tree keeps inline.
    Fan {
        cand: usize,
        tier: Tier,
        parent: ParentSpec,
        width: usize,
        start: u64,
        first: u64,
    },
}

/// Shared prefix of the long-path families: long store `family` follows it up to `SPLITS[family]`.
const SPLITS: [usize; 4] = [usize::MAX, 64, 130, 2];

fn family_local(family: u64, i: usize) -> u64 {
    let mix = |x: u64| {
        let x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 40
    };
    if i < SPLITS[family as usize] {
        mix(i as u64 + 1) % 6
    } else {
        mix((family << 32) | i as u64) % 6
    }
}

fn tier_strategy() -> impl Strategy<Value = Tier> {
    prop_oneof![
        6 => Just(Tier::Device),
        4 => Just(Tier::Host),
        1 => Just(Tier::Disk),
        1 => Just(Tier::External),
    ]
}

fn local_strategy() -> impl Strategy<Value = u64> {
    // Mostly a tiny alphabet (shared prefixes, frequent divergence), sometimes a wider one.
    prop_oneof![8 => 0..6u64, 2 => 6..24u64]
}

fn parent_strategy() -> impl Strategy<Value = ParentSpec> {
    prop_oneof![
        3 => Just(ParentSpec::Root),
        4 => any::<u8>().prop_map(|i| ParentSpec::Known(i as usize)),
        2 => (0..SMALL_HANDLES).prop_map(ParentSpec::Raw),
        1 => any::<u8>().prop_map(|i| ParentSpec::SelfRef(i as usize)),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let cand = 0..CANDIDATES.len();
    prop_oneof![
        30 => (
            cand.clone(),
            tier_strategy(),
            parent_strategy(),
            prop_oneof![
                19 => prop::collection::vec((0..SMALL_HANDLES, local_strategy()), 1..=5),
                1 => Just(Vec::new()),
            ],
            prop::bool::weighted(0.9),
        )
            .prop_map(|(cand, tier, parent, blocks, distinct)| Op::Store {
                cand,
                tier,
                parent,
                blocks,
                distinct,
            }),
        1 => (
            (cand.clone(), tier_strategy(), parent_strategy(), 65..=200usize, 0..4u64),
            prop::option::weighted(0.3, (0..200usize, 0..6u64)),
            prop::option::weighted(0.3, (0..200usize, 0..SMALL_HANDLES)),
            prop::option::weighted(0.1, (0..200usize, 0..200usize)),
            0..2usize,
        )
            .prop_map(|((cand, tier, parent, len, family), mutate, reuse, dup, bank)| {
                Op::LongStore {
                    cand,
                    tier,
                    parent,
                    len,
                    family,
                    mutate,
                    reuse,
                    dup,
                    bank,
                }
            }),
        10 => (
            cand.clone(),
            tier_strategy(),
            prop::collection::vec(
                prop_oneof![
                    5 => any::<u8>().prop_map(|i| HandleSpec::Known(i as usize)),
                    4 => (0..SMALL_HANDLES).prop_map(HandleSpec::Raw),
                    1 => prop_oneof![100..300u64, 1100..1300u64].prop_map(HandleSpec::Raw),
                ],
                1..=3,
            ),
        )
            .prop_map(|(cand, tier, handles)| Op::Remove {
                cand,
                tier,
                handles
            }),
        6 => (
            cand.clone(),
            tier_strategy(),
            any::<u8>(),
            prop_oneof![8 => 1..=8usize, 1 => 60..=140usize],
            0..4u8,
        )
            .prop_map(|(cand, tier, which, len, order)| Op::RemoveRun {
                cand,
                tier,
                which: which as usize,
                len,
                order,
            }),
        2 => (cand.clone(), tier_strategy()).prop_map(|(cand, tier)| Op::Clear { cand, tier }),
        1 => cand.clone().prop_map(Op::ClearCandidate),
        1 => cand.clone().prop_map(Op::RemoveCandidate),
        1 => (0..WORKERS.len()).prop_map(Op::RemoveWorker),
        2 => cand.clone().prop_map(Op::Slot),
        1 => (
            cand.clone(),
            tier_strategy(),
            parent_strategy(),
            9..=14usize,
            0..FAN_LOCALS,
            0..SMALL_HANDLES,
        )
            .prop_map(|(cand, tier, parent, width, start, first)| Op::Fan {
                cand,
                tier,
                parent,
                width,
                start,
                first,
            }),
        5 => (
            cand,
            tier_strategy(),
            any::<u8>(),
            0..SMALL_HANDLES,
            prop::collection::vec(local_strategy(), 0..3),
        )
            .prop_map(|(cand, tier, which, first, extra)| Op::Replay {
                cand,
                tier,
                which: which as usize,
                first,
                extra,
            }),
    ]
}

/// An operation as applied (parents and handles resolved): what a failure report shows.
#[derive(Clone, Debug)]
enum Resolved {
    Event(KvEvent),
    ClearCandidate(CandidateKey),
    RemoveCandidate(CandidateKey),
    RemoveWorker(WorkerId),
    Slot(CandidateKey),
}

impl fmt::Display for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resolved::Event(ev) => {
                write!(f, "{} {}: ", ev.candidate, ev.tier.as_str())?;
                match &ev.data {
                    KvEventData::Stored {
                        parent_hash,
                        blocks,
                    } => {
                        write!(f, "Stored parent={parent_hash:?} [handle:local]=[")?;
                        for (i, b) in blocks.iter().enumerate() {
                            let sep = if i == 0 { "" } else { " " };
                            write!(f, "{sep}{}:{}", b.block_hash, b.tokens_hash)?;
                        }
                        write!(f, "]")
                    }
                    KvEventData::Removed { block_hashes } => write!(f, "Removed {block_hashes:?}"),
                    KvEventData::Cleared => write!(f, "Cleared"),
                }
            }
            Resolved::ClearCandidate(k) => write!(f, "clear_candidate({k})"),
            Resolved::RemoveCandidate(k) => write!(f, "remove_candidate({k})"),
            Resolved::RemoveWorker(w) => write!(f, "remove_worker({w})"),
            Resolved::Slot(k) => write!(f, "slot({k})"),
        }
    }
}

fn event(candidate: CandidateKey, tier: Tier, data: KvEventData) -> Resolved {
    Resolved::Event(KvEvent {
        candidate,
        tier,
        event_id: 0,
        data,
    })
}

fn stored(
    candidate: CandidateKey,
    tier: Tier,
    parent: Option<u64>,
    blocks: &[(u64, u64)],
) -> Resolved {
    event(
        candidate,
        tier,
        KvEventData::Stored {
            parent_hash: parent,
            blocks: blocks
                .iter()
                .map(|&(h, l)| StoredBlock {
                    block_hash: h,
                    tokens_hash: l,
                })
                .collect(),
        },
    )
}

impl Model {
    /// The `i % n`-th of the `n` handles the model knows for a candidate and tier, in order.
    fn known_handle(&self, i: usize, key: CandidateKey, tier: Tier) -> Option<u64> {
        let mut hs: Vec<u64> = self
            .by
            .get(&(key, tier.index()))
            .map(|h| h.handles.keys().copied().collect())
            .unwrap_or_default();
        hs.sort_unstable();
        (!hs.is_empty()).then(|| hs[i % hs.len()])
    }

    fn resolve_parent(&self, spec: &ParentSpec, key: CandidateKey, tier: Tier) -> Option<u64> {
        match *spec {
            ParentSpec::Root | ParentSpec::SelfRef(_) => None,
            ParentSpec::Known(i) => self.known_handle(i, key, tier),
            ParentSpec::Raw(h) => Some(h),
        }
    }

    fn resolve(&self, op: &Op) -> Resolved {
        match op {
            Op::Store {
                cand,
                tier,
                parent,
                blocks,
                distinct,
            } => {
                let key = CANDIDATES[*cand];
                let mut p = self.resolve_parent(parent, key, *tier);
                let mut blocks = blocks.clone();
                if *distinct {
                    let mut used: Vec<u64> = p.into_iter().collect();
                    for b in &mut blocks {
                        while used.contains(&b.0) {
                            b.0 = (b.0 + 1) % SMALL_HANDLES;
                        }
                        used.push(b.0);
                    }
                }
                if let ParentSpec::SelfRef(i) = parent {
                    p = blocks.get(i % blocks.len().max(1)).map(|b| b.0);
                }
                stored(key, *tier, p, &blocks)
            }
            Op::LongStore {
                cand,
                tier,
                parent,
                len,
                family,
                mutate,
                reuse,
                dup,
                bank,
            } => {
                let key = CANDIDATES[*cand];
                let mut blocks: Vec<(u64, u64)> = (0..*len)
                    .map(|i| (LONG_BANKS[*bank] + i as u64, family_local(*family, i)))
                    .collect();
                if let Some((i, l)) = *mutate {
                    blocks[i % len].1 = l;
                }
                if let Some((i, h)) = *reuse {
                    blocks[i % len].0 = h;
                }
                if let Some((a, b)) = *dup {
                    blocks[a % len].0 = blocks[b % len].0;
                }
                let p = match parent {
                    ParentSpec::SelfRef(i) => Some(blocks[i % len].0),
                    other => self.resolve_parent(other, key, *tier),
                };
                stored(key, *tier, p, &blocks)
            }
            Op::Remove {
                cand,
                tier,
                handles,
            } => {
                let key = CANDIDATES[*cand];
                let block_hashes = handles
                    .iter()
                    .map(|h| match *h {
                        HandleSpec::Known(i) => self
                            .known_handle(i, key, *tier)
                            .unwrap_or(i as u64 % SMALL_HANDLES),
                        HandleSpec::Raw(h) => h,
                    })
                    .collect();
                event(key, *tier, KvEventData::Removed { block_hashes })
            }
            Op::Replay {
                cand,
                tier,
                which,
                first,
                extra,
            } => {
                let key = CANDIDATES[*cand];
                let mut locals = self
                    .known_handle(*which, key, *tier)
                    .map(|h| self.paths.to_vec(self.by[&(key, tier.index())].handles[&h]))
                    .unwrap_or_default();
                locals.extend(extra);
                let n = locals.len() as u64;
                let blocks: Vec<(u64, u64)> = locals
                    .iter()
                    .zip(0..)
                    .map(|(&l, i)| {
                        let h = if n <= SMALL_HANDLES {
                            (first + i) % SMALL_HANDLES
                        } else {
                            2000 + i
                        };
                        (h, l)
                    })
                    .collect();
                stored(key, *tier, None, &blocks)
            }
            Op::RemoveRun {
                cand,
                tier,
                which,
                len,
                order,
            } => {
                let key = CANDIDATES[*cand];
                let mut run: Vec<(u32, u64)> = Vec::new();
                if let Some(h) = self.known_handle(*which, key, *tier) {
                    let handles = &self.by[&(key, tier.index())].handles;
                    let path = handles[&h];
                    run = handles
                        .iter()
                        .filter(|&(_, &p)| self.paths.starts_with(path, p))
                        .map(|(&h, &p)| (self.paths.len[p as usize], h))
                        .collect();
                    run.sort_unstable_by(|a, b| b.cmp(a));
                    run.truncate(*len);
                }
                let mut block_hashes: Vec<u64> = run.iter().map(|&(_, h)| h).collect();
                match order {
                    1 => block_hashes.reverse(),
                    2 if !block_hashes.is_empty() => block_hashes.rotate_left(1),
                    3 => block_hashes.extend(block_hashes.clone()),
                    _ => {}
                }
                event(key, *tier, KvEventData::Removed { block_hashes })
            }
            Op::Clear { cand, tier } => event(CANDIDATES[*cand], *tier, KvEventData::Cleared),
            Op::ClearCandidate(c) => Resolved::ClearCandidate(CANDIDATES[*c]),
            Op::RemoveCandidate(c) => Resolved::RemoveCandidate(CANDIDATES[*c]),
            Op::RemoveWorker(w) => Resolved::RemoveWorker(WORKERS[*w]),
            Op::Slot(c) => Resolved::Slot(CANDIDATES[*c]),
            Op::Fan { .. } => unreachable!("fans are applied block by block"),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Running a sequence against the indexer and the model.
// ------------------------------------------------------------------------------------------------

struct Case {
    ops: Vec<Op>,
    /// Random prompts probed after every operation.
    probes: Vec<Path>,
    /// Local hashes appended to held paths to probe one block past them.
    exts: Vec<u64>,
    /// Fill slots `0..pad_slots` with idle candidates first (two of them freed), so the tested
    /// candidates' slots straddle the first 64-bit word of the holder bitsets (65), or sit words
    /// apart, past the words a holder set keeps inline (200).
    pad_slots: u32,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("pad_slots", &self.pad_slots)
            .field("probes", &self.probes)
            .field("exts", &self.exts)
            .field("ops", &self.ops)
            .finish()
    }
}

impl Clone for Case {
    fn clone(&self) -> Self {
        Case {
            ops: self.ops.clone(),
            probes: self.probes.clone(),
            exts: self.exts.clone(),
            pad_slots: self.pad_slots,
        }
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(op_strategy(), 1..=60),
        prop::collection::vec(prop::collection::vec(0..6u64, 1..10), 3),
        prop::collection::vec(0..8u64, 4),
        prop_oneof![6 => Just(0u32), 1 => Just(65u32), 1 => Just(200u32)],
    )
        .prop_map(|(ops, probes, exts, pad_slots)| Case {
            ops,
            probes,
            exts,
            pad_slots,
        })
}

struct Runner {
    idx: Indexer,
    model: Model,
    dense: DenseOverlaps,
    /// Slots observed per candidate: they must not change until the candidate is removed.
    slots: FxHashMap<CandidateKey, Slot>,
    trace: Vec<Resolved>,
}

macro_rules! ensure_eq {
    ($got:expr, $want:expr, $($what:tt)+) => {{
        let (got, want) = (&$got, &$want);
        if got != want {
            return Err(format!(
                "{}: indexer {:?}, model {:?}",
                format_args!($($what)+),
                got,
                want
            ));
        }
    }};
}

impl Runner {
    fn new(pad_slots: u32) -> Self {
        let idx = Indexer::new();
        if pad_slots > 0 {
            for i in 0..u64::from(pad_slots) {
                idx.slot(CandidateKey::new(1000 + i, 0));
            }
            idx.remove_candidate(CandidateKey::new(1001, 0));
            idx.remove_candidate(CandidateKey::new(1003, 0));
        }
        Runner {
            idx,
            model: Model::default(),
            dense: DenseOverlaps::new(),
            slots: FxHashMap::default(),
            trace: Vec::new(),
        }
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        if let Op::Fan {
            cand,
            tier,
            parent,
            width,
            start,
            first,
        } = op
        {
            let key = CANDIDATES[*cand];
            let p = self.model.resolve_parent(parent, key, *tier);
            for i in 0..*width as u64 {
                let handle = (first + i) % SMALL_HANDLES;
                let local = (start + i * 5) % FAN_LOCALS;
                self.apply(stored(key, *tier, p, &[(handle, local)]))?;
            }
            return Ok(());
        }
        self.apply(self.model.resolve(op))
    }

    fn apply(&mut self, r: Resolved) -> Result<(), String> {
        self.trace.push(r.clone());
        match &r {
            Resolved::Event(ev) => {
                let got = self.idx.apply(ev);
                let want = self.model.apply(ev);
                ensure_eq!(got, want, "apply result");
            }
            Resolved::ClearCandidate(k) => {
                let got = self.idx.clear_candidate(*k);
                let want = self.model.drop_candidates(|c| c == *k);
                ensure_eq!(got, want, "clear_candidate result");
            }
            Resolved::RemoveCandidate(k) => {
                let got = self.idx.remove_candidate(*k);
                let want = self.model.drop_candidates(|c| c == *k);
                ensure_eq!(got, want, "remove_candidate result");
                self.slots.remove(k);
                self.model.slotted.remove(k);
            }
            Resolved::RemoveWorker(w) => {
                let got = self.idx.remove_worker(*w);
                let want = self.model.drop_candidates(|c| c.worker_id == *w);
                ensure_eq!(got, want, "remove_worker result");
                self.slots.retain(|k, _| k.worker_id != *w);
                self.model.slotted.retain(|k| k.worker_id != *w);
            }
            Resolved::Slot(k) => {
                self.model.slotted.insert(*k);
                let s = self.idx.slot(*k);
                ensure_eq!(
                    Some(s),
                    self.idx.existing_slot(*k),
                    "slot() vs existing_slot()"
                );
            }
        }
        Ok(())
    }

    /// `slots`: the slot of every candidate that has one.
    fn check_probe(&mut self, query: &[u64], slots: &[(CandidateKey, Slot)]) -> Result<(), String> {
        let slot_of = |key: CandidateKey| slots.iter().find(|e| e.0 == key).map(|e| e.1);
        let want = self.model.expected_matches(query);
        let got = self.idx.find_matches(query);
        ensure_eq!(got, want, "find_matches({query:?})");
        let mut want_dense: BTreeMap<Slot, [u32; 3]> = BTreeMap::new();
        for (col, v) in [&want.device, &want.host, &want.disk]
            .into_iter()
            .enumerate()
        {
            for &(key, d) in v {
                let Some(s) = slot_of(key) else {
                    return Err(format!("{key} matches {query:?} but has no slot"));
                };
                want_dense.entry(s).or_default()[col] = d;
            }
        }
        let mut device: Vec<(Slot, u32)> = Vec::new();
        self.idx.find_device_matches(query, &mut device);
        device.sort_unstable();
        let want_device: Vec<(Slot, u32)> = want_dense
            .iter()
            .filter(|e| e.1[0] > 0)
            .map(|(&s, v)| (s, v[0]))
            .collect();
        ensure_eq!(device, want_device, "find_device_matches({query:?})");
        self.idx.find_matches_dense(query, &mut self.dense);
        let mut touched = self.dense.touched().to_vec();
        touched.sort_unstable();
        let want_touched: Vec<Slot> = want_dense.keys().copied().collect();
        ensure_eq!(
            touched,
            want_touched,
            "find_matches_dense({query:?}) touched slots"
        );
        for &(key, s) in slots {
            {
                let want = want_dense.get(&s).copied().unwrap_or([0; 3]);
                ensure_eq!(
                    self.dense.get(s),
                    want,
                    "find_matches_dense({query:?}) of {key}"
                );
            }
        }
        Ok(())
    }

    fn check(&mut self, case: &Case, step: usize, all_paths: bool) -> Result<(), String> {
        catch_unwind(AssertUnwindSafe(|| self.idx.check_invariants()))
            .map_err(|e| format!("check_invariants: {}", panic_message(&*e)))?;

        let stats = self.idx.stats();
        let (held, distinct) = self.model.tier_sizes();
        ensure_eq!(stats.held_blocks, held, "held blocks per tier");
        ensure_eq!(stats.unique_blocks, distinct, "distinct blocks per tier");
        ensure_eq!(
            stats.events_applied,
            self.model.events_applied,
            "events applied"
        );
        ensure_eq!(
            stats.dropped_parent_block_not_found,
            self.model.parent_block_not_found,
            "parent_block_not_found"
        );
        ensure_eq!(
            stats.dropped_self_reference,
            self.model.self_reference,
            "self_reference"
        );
        ensure_eq!(
            stats.unknown_removal_handles,
            self.model.unknown_handles,
            "unknown handles"
        );

        let mut live: FxHashMap<Slot, CandidateKey> = FxHashMap::default();
        for key in CANDIDATES {
            ensure_eq!(
                self.idx.candidate_blocks(key),
                self.model.candidate_blocks(key),
                "candidate_blocks({key})"
            );
            ensure_eq!(
                self.idx.existing_slot(key).is_some(),
                self.model.slotted.contains(&key),
                "{key} has a slot"
            );
            match self.idx.existing_slot(key) {
                Some(s) => {
                    if let Some(&before) = self.slots.get(&key) {
                        ensure_eq!(s, before, "slot of {key} (must be stable)");
                    }
                    self.slots.insert(key, s);
                    if let Some(other) = live.insert(s, key) {
                        return Err(format!("{key} and {other} share slot {s}"));
                    }
                }
                None => {
                    if self.model.holds_anything(key) {
                        return Err(format!("{key} holds blocks but has no slot"));
                    }
                }
            }
        }

        // Probes: the empty prompt, the case's random prompts, and around the deepest held paths
        // (after each operation, for up to about 8 of them in rotation, one of: the path, the path
        // and one block more, a random prefix of it, in rotation; after the last operation, all
        // three for all of them, and every held path).
        let mut probes: Vec<Path> = vec![Vec::new()];
        probes.extend(case.probes.iter().cloned());
        if all_paths {
            probes.extend(self.model.all_held());
        }
        let leaves = self.model.leaves()?;
        // At most about 8 leaves per operation (in rotation) keep a debug run fast.
        let stride = leaves.len().div_ceil(8).max(1);
        for (j, leaf) in leaves.into_iter().enumerate() {
            if !all_paths && !(j + step).is_multiple_of(stride) {
                continue;
            }
            let kind = (step + j / stride) % 3;
            let cut = (step * 7 + j * 3) % leaf.len();
            if (all_paths || kind == 2) && cut > 0 {
                probes.push(leaf[..cut].to_vec());
            }
            if all_paths || kind == 1 || (kind == 2 && cut == 0) {
                let mut ext = leaf.clone();
                ext.push(case.exts[(step + j) % case.exts.len()]);
                probes.push(ext);
            }
            if all_paths || kind == 0 {
                probes.push(leaf);
            }
        }
        let slots: Vec<(CandidateKey, Slot)> = live.iter().map(|(&s, &k)| (k, s)).collect();
        for q in &probes {
            self.check_probe(q, &slots)?;
        }
        Ok(())
    }

    fn run(&mut self, case: &Case) -> Result<(), String> {
        for (i, op) in case.ops.iter().enumerate() {
            self.step(op)?;
            self.check(case, i, false)?;
        }
        self.check(case, case.ops.len(), true)
    }
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    let mut runner = Runner::new(case.pad_slots);
    let outcome = catch_unwind(AssertUnwindSafe(|| runner.run(case)))
        .unwrap_or_else(|e| Err(format!("panic: {}", panic_message(&*e))));
    outcome.map_err(|msg| {
        let mut s = format!(
            "{msg}\nafter op #{} of this sequence (as applied):\n",
            runner.trace.len()
        );
        for (i, r) in runner.trace.iter().enumerate() {
            s.push_str(&format!("  #{}: {r}\n", i + 1));
        }
        TestCaseError::fail(s)
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 10_000,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    /// Random event sequences over 5 candidates and 4 tiers: the indexer answers exactly as the
    /// brute-force model after every operation.
    #[test]
    fn indexer_matches_model(case in case_strategy()) {
        run_case(&case)?;
    }
}

/// Hand-written sequences that the random search reaches only rarely, run through the same checks.
#[test]
fn model_check_fixed_sequences() {
    use HandleSpec::Raw;
    use Op::*;
    use ParentSpec::{Raw as RawParent, Root};
    let d = Tier::Device;
    let cases: Vec<Vec<Op>> = vec![
        // Rebinding: a path re-stored under a new handle, then a handle moved to another path.
        vec![
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![(1, 1), (2, 2)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![(2, 1), (1, 2)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(1),
                blocks: vec![(3, 3)],
                distinct: true,
            },
            Remove {
                cand: 0,
                tier: d,
                handles: vec![Raw(2), Raw(2), Raw(1)],
            },
        ],
        // Two candidates on one long path, removal in the middle of a merged edge, merge back.
        vec![
            LongStore {
                cand: 0,
                tier: d,
                parent: Root,
                len: 150,
                family: 0,
                mutate: None,
                reuse: None,
                dup: None,
                bank: 0,
            },
            LongStore {
                cand: 2,
                tier: d,
                parent: Root,
                len: 130,
                family: 1,
                mutate: None,
                reuse: None,
                dup: None,
                bank: 0,
            },
            Remove {
                cand: 0,
                tier: d,
                handles: vec![Raw(163)],
            },
            Remove {
                cand: 2,
                tier: d,
                handles: vec![Raw(164)],
            },
            Store {
                cand: 2,
                tier: d,
                parent: RawParent(163),
                blocks: vec![(1, 9)],
                distinct: true,
            },
            RemoveWorker(1),
        ],
        // Stores that fail or store nothing allocate no slot; an empty store still needs its
        // parent (SPEC §3: parent not found).
        vec![
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(5),
                blocks: vec![],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(5),
                blocks: vec![(1, 1)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![(1, 1), (1, 2)],
                distinct: false,
            },
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![(1, 1)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(1),
                blocks: vec![],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(2),
                blocks: vec![],
                distinct: true,
            },
            Store {
                cand: 1,
                tier: d,
                parent: RawParent(1),
                blocks: vec![(2, 2)],
                distinct: true,
            },
        ],
        // A node only one candidate holds, with children, cut in the middle (truncated in place);
        // then the same path held by two candidates, evicted tail first in one event (one split),
        // with a repeated and an already-removed handle.
        vec![
            Store {
                cand: 0,
                tier: d,
                parent: Root,
                blocks: vec![(1, 1), (2, 2), (3, 3), (4, 4)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(4),
                blocks: vec![(5, 5)],
                distinct: true,
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(4),
                blocks: vec![(6, 0), (7, 1)],
                distinct: true,
            },
            Remove {
                cand: 0,
                tier: d,
                handles: vec![Raw(3), Raw(7), Raw(2)],
            },
            Store {
                cand: 0,
                tier: d,
                parent: RawParent(1),
                blocks: vec![(2, 2), (3, 3), (4, 4), (5, 5)],
                distinct: true,
            },
            Store {
                cand: 2,
                tier: d,
                parent: Root,
                blocks: vec![(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)],
                distinct: true,
            },
            Remove {
                cand: 0,
                tier: d,
                handles: vec![Raw(5), Raw(4), Raw(5), Raw(3), Raw(4), Raw(9)],
            },
            Remove {
                cand: 2,
                tier: d,
                handles: vec![Raw(4), Raw(5), Raw(1)],
            },
        ],
        // Self reference across chunks applies nothing.
        vec![LongStore {
            cand: 0,
            tier: d,
            parent: Root,
            len: 100,
            family: 0,
            mutate: None,
            reuse: None,
            dup: Some((90, 3)),
            bank: 0,
        }],
    ];
    for ops in cases {
        let case = Case {
            ops,
            probes: vec![vec![0, 1]],
            exts: vec![7],
            pad_slots: 0,
        };
        if let Err(e) = run_case(&case) {
            panic!("{e}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Approximate mode.
// ------------------------------------------------------------------------------------------------

/// The fake clock's unit. Every instant the test uses is `base + n * UNIT`.
const UNIT: Duration = Duration::from_millis(1);

#[derive(Clone, Debug)]
enum ApproxOp {
    /// Advance the clock by `dt` units, then record a routed prompt.
    Record {
        cand: usize,
        locals: Vec<u64>,
        dt: u64,
    },
    /// Advance the clock by `dt` units, then expire.
    Expire { dt: u64 },
    /// Advance the clock, then remove a worker from the index and from the timers.
    RemoveWorker { worker: usize, dt: u64 },
}

fn approx_op_strategy() -> impl Strategy<Value = ApproxOp> {
    let dt = prop_oneof![3 => Just(0u64), 7 => 0..=25u64];
    prop_oneof![
        5 => (0..CANDIDATES.len(), prop::collection::vec(0..4u64, 0..7), dt.clone())
            .prop_map(|(cand, locals, dt)| ApproxOp::Record { cand, locals, dt }),
        4 => dt.clone().prop_map(|dt| ApproxOp::Expire { dt }),
        1 => (0..WORKERS.len(), dt).prop_map(|(worker, dt)| ApproxOp::RemoveWorker { worker, dt }),
    ]
}

/// Model of approximate mode: the latest refresh time (in units) of every (candidate, path).
///
/// The documented rule (approx.rs): a block is re-inserted, refreshing its TTL, whenever a prompt
/// through it is recorded on that candidate; it expires "at the end of the bucket the TTL ends in
/// (never early)", i.e. an `expire(now)` removes it iff `now >= end of the bucket containing
/// (latest refresh + ttl)`, buckets being `[k * bucket, (k + 1) * bucket)` from the indexer's
/// epoch.
struct ApproxModel {
    ttl: u64,
    bucket: u64,
    refreshed: FxHashMap<(CandidateKey, Path), u64>,
}

impl ApproxModel {
    fn expires_at(&self, refreshed: u64) -> u64 {
        ((refreshed + self.ttl) / self.bucket + 1) * self.bucket
    }

    fn record(&mut self, cand: CandidateKey, locals: &[u64], now: u64) {
        for k in 1..=locals.len() {
            self.refreshed.insert((cand, locals[..k].to_vec()), now);
        }
    }

    fn expire(&mut self, now: u64) -> u64 {
        let before = self.refreshed.len();
        let (ttl, bucket) = (self.ttl, self.bucket);
        self.refreshed
            .retain(|_, &mut t| ((t + ttl) / bucket + 1) * bucket > now);
        (before - self.refreshed.len()) as u64
    }

    fn depth(&self, cand: CandidateKey, query: &[u64]) -> u32 {
        let mut k = 0;
        while k < query.len() && self.refreshed.contains_key(&(cand, query[..=k].to_vec())) {
            k += 1;
        }
        k as u32
    }
}

/// An approximate indexer and a base instant whose offset from the indexer's (private) epoch is
/// below one unit, so `bucket_of(base + n * UNIT)` is exactly `n * UNIT / bucket`.
fn approx_with_clock(config: ApproxConfig) -> (ApproxIndexer, Instant) {
    loop {
        let before = Instant::now();
        let approx = ApproxIndexer::new(config);
        let base = Instant::now();
        if base - before < UNIT / 2 {
            return (approx, base);
        }
    }
}

fn run_approx(ttl: u64, bucket: u64, ops: &[ApproxOp], probes: &[Path]) -> Result<(), String> {
    let (approx, base) = approx_with_clock(ApproxConfig {
        ttl: UNIT * ttl as u32,
        bucket: UNIT * bucket as u32,
    });
    let idx = Indexer::new();
    let mut model = ApproxModel {
        ttl,
        bucket,
        refreshed: FxHashMap::default(),
    };
    let mut clock = 0u64;
    for (i, op) in ops.iter().enumerate() {
        let at = |clock: u64| base + UNIT * clock as u32;
        let ctx = |clock: u64| format!("op #{} {op:?} at t={clock}", i + 1);
        match op {
            ApproxOp::Record { cand, locals, dt } => {
                clock += dt;
                approx.record(&idx, CANDIDATES[*cand], locals, at(clock));
                model.record(CANDIDATES[*cand], locals, clock);
            }
            ApproxOp::Expire { dt } => {
                clock += dt;
                let got = approx.expire(&idx, at(clock));
                let want = model.expire(clock);
                if got != want {
                    return Err(format!(
                        "{}: expire removed {got} blocks, model {want}",
                        ctx(clock)
                    ));
                }
            }
            ApproxOp::RemoveWorker { worker, dt } => {
                clock += dt;
                let w = WORKERS[*worker];
                idx.remove_worker(w);
                approx.remove_worker(w);
                model.refreshed.retain(|(c, _), _| c.worker_id != w);
            }
        }
        catch_unwind(AssertUnwindSafe(|| idx.check_invariants()))
            .map_err(|e| format!("{}: check_invariants: {}", ctx(clock), panic_message(&*e)))?;
        if approx.tracked() != model.refreshed.len() {
            return Err(format!(
                "{}: tracked {} blocks, model {}",
                ctx(clock),
                approx.tracked(),
                model.refreshed.len()
            ));
        }
        // The doc's premise: a block never expires before its descendants.
        for ((c, p), &t) in &model.refreshed {
            if p.len() > 1 {
                let parent = model.refreshed.get(&(*c, p[..p.len() - 1].to_vec()));
                if parent.is_none_or(|&tp| model.expires_at(tp) < model.expires_at(t)) {
                    return Err(format!("{}: {c} {p:?} outlives its parent", ctx(clock)));
                }
            }
        }
        let mut queries: Vec<Path> = probes.to_vec();
        queries.extend(model.refreshed.keys().map(|(_, p)| p.clone()));
        for q in &queries {
            let got = idx.find_matches(q);
            let mut want: Vec<(CandidateKey, u32)> = CANDIDATES
                .iter()
                .map(|&c| (c, model.depth(c, q)))
                .filter(|&(_, d)| d > 0)
                .collect();
            want.sort_unstable();
            if got.device != want || !got.host.is_empty() || !got.disk.is_empty() {
                return Err(format!(
                    "{}: find_matches({q:?}): indexer {got:?}, model device {want:?}",
                    ctx(clock)
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 4_000,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    /// Approximate mode on a fake clock: records, refreshes and bucketed expiry as documented.
    #[test]
    fn approx_matches_model(
        ttl in 1..=60u64,
        bucket in 1..=15u64,
        ops in prop::collection::vec(approx_op_strategy(), 1..=40),
        probes in prop::collection::vec(prop::collection::vec(0..4u64, 1..7), 2),
    ) {
        run_approx(ttl, bucket, &ops, &probes).map_err(TestCaseError::fail)?;
    }
}

// ------------------------------------------------------------------------------------------------
// Concurrency.
// ------------------------------------------------------------------------------------------------

/// Two writers churn their own workers' holdings — including stores and removals along the very
/// path readers query, long enough to be written in several chunks — while two readers query a
/// prompt held by workers nobody touches. Every read must see those workers at their full depth.
#[test]
fn readers_never_see_a_torn_state() {
    const ITERS: usize = 20_000;
    const LEN: usize = 150;
    let prompt: Vec<u64> = (0..LEN as u64).map(|i| (i * 7 + 3) % 5).collect();
    let full = CandidateKey::new(1, 0);
    let half = CandidateKey::new(2, 0);
    let idx = Arc::new(Indexer::new());
    let blocks = |n: usize, base: u64| -> Vec<StoredBlock> {
        (0..n)
            .map(|i| StoredBlock {
                block_hash: base + i as u64,
                tokens_hash: prompt[i],
            })
            .collect()
    };
    for (key, tier, n) in [
        (full, Tier::Device, LEN),
        (full, Tier::Host, LEN),
        (half, Tier::Device, LEN / 2),
    ] {
        idx.apply(&KvEvent {
            candidate: key,
            tier,
            event_id: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: blocks(n, 1),
            },
        })
        .unwrap();
    }
    let slot_full = idx.existing_slot(full).unwrap();
    let slot_half = idx.existing_slot(half).unwrap();
    let readers_done = Arc::new(AtomicUsize::new(0));
    let overlapped = Arc::new(AtomicUsize::new(0));

    let mut threads = Vec::new();
    for w in 0..2u64 {
        let (idx, prompt, readers_done) = (idx.clone(), prompt.clone(), readers_done.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(w);
            let worker = 10 + w;
            let mut recent: Vec<u64> = Vec::new();
            let mut i = 0usize;
            while (i < ITERS || readers_done.load(Ordering::Relaxed) < 2) && i < 20 * ITERS {
                i += 1;
                let candidate = CandidateKey::new(worker, rng.gen_range(0..2));
                let tier = if rng.gen_bool(0.7) {
                    Tier::Device
                } else {
                    Tier::Host
                };
                let base = rng.gen_range(0..1u64 << 40) << 8;
                let data = match rng.gen_range(0..100) {
                    // A prefix of the readers' prompt (often long: chunked), plus a random tail.
                    0..=34 => {
                        let n = if rng.gen_bool(0.2) {
                            rng.gen_range(65..=LEN)
                        } else {
                            rng.gen_range(1..=LEN)
                        };
                        let tail = rng.gen_range(0..3);
                        let mut bs: Vec<StoredBlock> = (0..n + tail)
                            .map(|j| StoredBlock {
                                block_hash: base + j as u64,
                                tokens_hash: if j < n {
                                    prompt[j]
                                } else {
                                    rng.gen_range(0..5)
                                },
                            })
                            .collect();
                        if rng.gen_bool(0.05) {
                            bs.reverse(); // a different path over the same alphabet
                        }
                        recent.extend(bs.iter().map(|b| b.block_hash).step_by(7));
                        KvEventData::Stored {
                            parent_hash: None,
                            blocks: bs,
                        }
                    }
                    // Under a block stored earlier (which may be gone by now).
                    35..=54 if !recent.is_empty() => {
                        let parent = recent[rng.gen_range(0..recent.len())];
                        let bs: Vec<StoredBlock> = (0..rng.gen_range(1..5))
                            .map(|j| StoredBlock {
                                block_hash: base + j as u64,
                                tokens_hash: rng.gen_range(0..5),
                            })
                            .collect();
                        recent.extend(bs.iter().map(|b| b.block_hash));
                        KvEventData::Stored {
                            parent_hash: Some(parent),
                            blocks: bs,
                        }
                    }
                    55..=89 if !recent.is_empty() => KvEventData::Removed {
                        block_hashes: (0..rng.gen_range(1..4))
                            .map(|_| recent[rng.gen_range(0..recent.len())])
                            .collect(),
                    },
                    90..=95 => KvEventData::Cleared,
                    96..=97 => {
                        idx.remove_candidate(candidate);
                        continue;
                    }
                    98..=99 => {
                        idx.remove_worker(worker);
                        continue;
                    }
                    _ => KvEventData::Cleared,
                };
                if recent.len() > 256 {
                    recent.drain(..128);
                }
                let _ = idx.apply(&KvEvent {
                    candidate,
                    tier,
                    event_id: i as u64,
                    data,
                });
            }
        }));
    }
    for r in 0..2u64 {
        let (idx, prompt, readers_done, overlapped) = (
            idx.clone(),
            prompt.clone(),
            readers_done.clone(),
            overlapped.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let mut dense = DenseOverlaps::new();
            for i in 0..ITERS {
                let s = idx.find_matches(&prompt);
                let count = |v: &[(CandidateKey, u32)], key: CandidateKey, depth: u32| {
                    v.iter().filter(|&&e| e == (key, depth)).count()
                };
                assert_eq!(
                    count(&s.device, full, LEN as u32),
                    1,
                    "reader {r} read {i}: {s:?}"
                );
                assert_eq!(
                    count(&s.device, half, LEN as u32 / 2),
                    1,
                    "reader {r} read {i}: {s:?}"
                );
                assert_eq!(
                    count(&s.host, full, LEN as u32),
                    1,
                    "reader {r} read {i}: {s:?}"
                );
                for v in [&s.device, &s.host] {
                    assert!(
                        v.windows(2).all(|p| p[0].0 < p[1].0),
                        "one entry per candidate: {s:?}"
                    );
                    assert!(
                        v.iter().all(|&(_, d)| (1..=LEN as u32).contains(&d)),
                        "{s:?}"
                    );
                }
                if s.device.len() > 2 {
                    overlapped.fetch_add(1, Ordering::Relaxed);
                }
                idx.find_matches_dense(&prompt, &mut dense);
                assert_eq!(
                    dense.get(slot_full),
                    [LEN as u32, LEN as u32, 0],
                    "reader {r} read {i}"
                );
                assert_eq!(
                    dense.get(slot_half),
                    [LEN as u32 / 2, 0, 0],
                    "reader {r} read {i}"
                );
            }
            readers_done.fetch_add(1, Ordering::Relaxed);
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    idx.check_invariants();
    let s = idx.find_matches(&prompt);
    assert!(s.device.contains(&(full, LEN as u32)) && s.device.contains(&(half, LEN as u32 / 2)));
    eprintln!(
        "readers_never_see_a_torn_state: {} of {} reads saw a writer's candidate on the prompt",
        overlapped.load(Ordering::Relaxed),
        2 * ITERS
    );
}

/// A prompt refreshed right after it became due must stay indexed, however an `expire` running at
/// the same time interleaves with the `record` (it may remove the prompt before the refresh, never
/// after it).
#[test]
fn approx_refresh_is_never_lost_to_a_concurrent_expire() {
    use std::sync::atomic::AtomicU64;
    const TTL: u64 = 5;
    const ROUNDS: u64 = 20_000;
    let (approx, base) = approx_with_clock(ApproxConfig {
        ttl: UNIT * TTL as u32,
        bucket: UNIT,
    });
    let idx = Indexer::new();
    let prompt: Vec<u64> = (1..=8).collect();
    let cand = CANDIDATES[0];
    // The fake clock, in units; only the recorder moves it.
    let clock = AtomicU64::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let lost = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let now = clock.load(Ordering::Relaxed);
                approx.expire(&idx, base + UNIT * now as u32);
            }
        });
        let mut lost = 0u64;
        for round in 0..ROUNDS {
            // Every round starts past the previous record's expiry, so the expirer finds the
            // prompt due while this round's record refreshes it.
            let now = round * (TTL + 2);
            clock.store(now, Ordering::Relaxed);
            approx.record(&idx, cand, &prompt, base + UNIT * now as u32);
            // Any expire from now on runs at `now`, before the refreshed expiry.
            if idx.find_matches(&prompt).device != vec![(cand, prompt.len() as u32)] {
                lost += 1;
            }
        }
        done.store(true, Ordering::Relaxed);
        lost
    });
    assert_eq!(lost, 0, "refreshed prompts removed by a concurrent expire");
    idx.check_invariants();
}
