//! Shared, deterministic inputs for the comparison benches (kvroute vs NVIDIA Dynamo's
//! `dynamo-kv-router` 1.6.1). Every input comes from a seeded `SmallRng` or a counter, so both sides
//! of every comparison see exactly the same prompts, events and loads, run after run.
//!
//! The index workload (see [`Workload`]) follows the design reference points (docs/DEVELOPMENT.md):
//! 4,096-token prompts (256 blocks at block size 16) that all start with the same 32-block prefix
//! (a shared system prompt), about 1M (worker, block) entries, and a query prompt that some
//! candidates hold to full depth, some to a partial depth and every other candidate only through the
//! shared prefix.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::Duration;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree, ThreadPoolIndexer};
use kvroute_core::hashing::{local_block_hashes, sequence_hashes, BASE_SEED};
use kvroute_core::indexer::{Indexer, KvEvent, KvEventData, StoredBlock, Tier};
use kvroute_core::CandidateKey;
use rand::{rngs::SmallRng, Rng, SeedableRng};

pub const BLOCK_SIZE: usize = 16;
pub const PROMPT_TOKENS: usize = 4096;
pub const PROMPT_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;
pub const SHARED_PREFIX_BLOCKS: usize = 32;
/// Distinct prompts ("documents") in the index; doc 0 is the query prompt.
pub const DOC_POOL: usize = 1024;
/// (worker, block) entries the prefilled index holds, at least.
pub const TARGET_ENTRIES: usize = 1 << 20;
/// Blocks per stored event (an engine storing a growing prompt 16 blocks at a time).
pub const EVENT_BLOCKS: usize = 16;
/// Manual latency loops: calls timed one by one.
pub const LATENCY_SAMPLES: usize = 20_000;

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// Token ids drawn from a 128k vocabulary.
pub fn random_tokens(rng: &mut SmallRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..128_000u32)).collect()
}

/// A 4,096-token prompt (shared system prefix + unique body), the one the hashing bench hashes.
pub fn prompt_tokens(seed: u64) -> Vec<u32> {
    let mut tokens = random_tokens(&mut rng(0x5EED_0000), SHARED_PREFIX_BLOCKS * BLOCK_SIZE);
    tokens.extend(random_tokens(
        &mut rng(0xD0C_0000 + seed),
        PROMPT_TOKENS - SHARED_PREFIX_BLOCKS * BLOCK_SIZE,
    ));
    tokens
}

/// splitmix64: fresh, collision-free-in-practice hashes from a counter.
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One prompt: its local (content) hashes and the engine's chained handles (the sequence hashes).
pub struct Doc {
    pub local: Vec<u64>,
    pub handles: Vec<u64>,
}

/// Worker `worker` holds the first `blocks` blocks of doc `doc`.
#[derive(Clone, Copy, Debug)]
pub struct Holding {
    pub worker: u64,
    pub doc: usize,
    pub blocks: usize,
}

/// A stored event, neutral form: blocks are (engine handle, local hash).
#[derive(Clone, Debug)]
pub struct StoreSpec {
    pub worker: u64,
    pub parent: Option<u64>,
    pub blocks: Vec<(u64, u64)>,
}

/// A removed event, neutral form.
#[derive(Clone, Debug)]
pub struct RemoveSpec {
    pub worker: u64,
    pub handles: Vec<u64>,
}

/// The prefilled index of one comparison.
///
/// - `DOC_POOL` prompts of 256 blocks; blocks 0..32 are the same for every prompt.
/// - Every candidate holds `ceil(TARGET_ENTRIES / (candidates * 224))` random prompts out of docs
///   1.. in full (74 prompts each at 64 candidates, 5 at 1,024), so each prompt body is held by
///   ~4.6-5 candidates and every candidate holds the shared prefix; >= 1M entries in all.
/// - The query is doc 0: candidates `w % 8 == 0` hold all 256 blocks, `w % 8 == 1` hold a random
///   prefix of 33..=255 blocks, everyone else matches only the 32 shared blocks.
pub struct Workload {
    pub candidates: usize,
    pub docs: Vec<Doc>,
    pub holdings: Vec<Holding>,
    pub query: Vec<u64>,
    pub query_dynamo: Vec<LocalBlockHash>,
    /// (worker, depth) of the query, sorted by worker.
    pub expected: Vec<(u64, u32)>,
    pub entries: usize,
}

impl Workload {
    pub fn new(candidates: usize) -> Self {
        let docs: Vec<Doc> = (0..DOC_POOL as u64)
            .map(|d| {
                let tokens = prompt_tokens(d);
                let local = local_block_hashes(&tokens, BLOCK_SIZE, BASE_SEED);
                let handles = sequence_hashes(&local);
                Doc { local, handles }
            })
            .collect();
        // The shared prefix counts once per candidate, so size by prompt bodies.
        let body = PROMPT_BLOCKS - SHARED_PREFIX_BLOCKS;
        let per_worker = TARGET_ENTRIES.div_ceil(candidates * body).max(1);
        let mut r = rng(0xC0FFEE ^ candidates as u64);
        let mut holdings = Vec::new();
        let mut expected = Vec::with_capacity(candidates);
        for w in 0..candidates as u64 {
            let mut mine: Vec<usize> = Vec::with_capacity(per_worker + 1);
            while mine.len() < per_worker {
                let d = r.gen_range(1..DOC_POOL);
                if !mine.contains(&d) {
                    mine.push(d);
                }
            }
            let depth = match w % 8 {
                0 => PROMPT_BLOCKS,
                1 => r.gen_range(SHARED_PREFIX_BLOCKS + 1..PROMPT_BLOCKS),
                _ => SHARED_PREFIX_BLOCKS,
            };
            expected.push((w, depth as u32));
            if depth > SHARED_PREFIX_BLOCKS {
                holdings.push(Holding {
                    worker: w,
                    doc: 0,
                    blocks: depth,
                });
            }
            holdings.extend(mine.into_iter().map(|doc| Holding {
                worker: w,
                doc,
                blocks: PROMPT_BLOCKS,
            }));
        }
        // Interleave workers the way a fleet's event stream would: round robin over workers, one
        // prompt at a time.
        let mut by_worker: Vec<Vec<Holding>> = vec![Vec::new(); candidates];
        for h in holdings {
            by_worker[h.worker as usize].push(h);
        }
        let mut holdings = Vec::new();
        let rounds = by_worker.iter().map(Vec::len).max().unwrap_or(0);
        for i in 0..rounds {
            for w in &by_worker {
                if let Some(&h) = w.get(i) {
                    holdings.push(h);
                }
            }
        }
        // Distinct (worker, block) pairs: the shared prefix counts once per worker.
        let mut entries = 0;
        for w in 0..candidates as u64 {
            let mine = holdings.iter().filter(|h| h.worker == w);
            let body: usize = mine
                .map(|h| h.blocks.saturating_sub(SHARED_PREFIX_BLOCKS))
                .sum();
            entries += SHARED_PREFIX_BLOCKS + body;
        }
        let query = docs[0].local.clone();
        let query_dynamo = query.iter().map(|&h| LocalBlockHash(h)).collect();
        Self {
            candidates,
            docs,
            holdings,
            query,
            query_dynamo,
            expected,
            entries,
        }
    }

    /// The prefill as stored events: every holding as chained 16-block events from the root.
    pub fn store_specs(&self) -> Vec<StoreSpec> {
        let mut out = Vec::new();
        for h in &self.holdings {
            let doc = &self.docs[h.doc];
            let mut parent = None;
            let mut start = 0;
            while start < h.blocks {
                let end = (start + EVENT_BLOCKS).min(h.blocks);
                out.push(StoreSpec {
                    worker: h.worker,
                    parent,
                    blocks: (start..end)
                        .map(|i| (doc.handles[i], doc.local[i]))
                        .collect(),
                });
                parent = Some(doc.handles[end - 1]);
                start = end;
            }
        }
        out
    }

    /// The engine handle of the last shared-prefix block (every candidate holds it).
    pub fn shared_prefix_tail(&self) -> u64 {
        self.docs[0].handles[SHARED_PREFIX_BLOCKS - 1]
    }
}

/// Steady-state event churn: every chunk stores, for `STREAMS` candidates at once, a new 256-block
/// conversation under the shared prefix as 16 chained 16-block events (interleaved across
/// candidates), and the matching removals evict those blocks again tail first (the last stored
/// event first, each event's blocks last-to-first), so the index returns to its prefilled size.
pub struct Churn {
    candidates: usize,
    prefix_tail: u64,
    counter: u64,
    chunk: u64,
}

impl Churn {
    pub const STREAMS: usize = 64;
    pub const STEPS: usize = 16;
    pub const EVENTS: usize = Self::STREAMS * Self::STEPS;
    pub const BLOCKS: usize = Self::EVENTS * EVENT_BLOCKS;

    pub fn new(w: &Workload, seed: u64) -> Self {
        Self {
            candidates: w.candidates,
            prefix_tail: w.shared_prefix_tail(),
            counter: seed << 40,
            chunk: 0,
        }
    }

    /// The worker of stream `j` in the current chunk (distinct within a chunk, rotating).
    fn worker(&self, j: usize) -> u64 {
        ((j * self.candidates / Self::STREAMS) as u64 + self.chunk) % self.candidates as u64
    }

    /// One chunk: (stores in application order, removals in application order, the first
    /// stream's worker and conversation local hashes for a sanity check).
    pub fn next_chunk(&mut self) -> (Vec<StoreSpec>, Vec<RemoveSpec>, (u64, Vec<u64>)) {
        let mut blocks: Vec<Vec<Vec<(u64, u64)>>> = Vec::with_capacity(Self::STREAMS);
        for _ in 0..Self::STREAMS {
            let mut steps = Vec::with_capacity(Self::STEPS);
            for _ in 0..Self::STEPS {
                let ev: Vec<(u64, u64)> = (0..EVENT_BLOCKS)
                    .map(|_| {
                        self.counter += 1;
                        (splitmix(2 * self.counter + 1), splitmix(2 * self.counter))
                    })
                    .collect();
                steps.push(ev);
            }
            blocks.push(steps);
        }
        let mut stores = Vec::with_capacity(Self::EVENTS);
        for s in 0..Self::STEPS {
            for (j, steps) in blocks.iter().enumerate() {
                let parent = if s == 0 {
                    self.prefix_tail
                } else {
                    steps[s - 1][EVENT_BLOCKS - 1].0
                };
                stores.push(StoreSpec {
                    worker: self.worker(j),
                    parent: Some(parent),
                    blocks: steps[s].clone(),
                });
            }
        }
        let mut removes = Vec::with_capacity(Self::EVENTS);
        for s in (0..Self::STEPS).rev() {
            for (j, steps) in blocks.iter().enumerate() {
                removes.push(RemoveSpec {
                    worker: self.worker(j),
                    handles: steps[s].iter().rev().map(|&(h, _)| h).collect(),
                });
            }
        }
        let check = (
            self.worker(0),
            blocks[0].iter().flatten().map(|&(_, l)| l).collect(),
        );
        self.chunk += 1;
        (stores, removes, check)
    }
}

// ---- Conversions to each side's event type -------------------------------------------------

pub fn kv_store(s: &StoreSpec, event_id: u64) -> KvEvent {
    KvEvent {
        candidate: CandidateKey::new(s.worker, 0),
        tier: Tier::Device,
        event_id,
        data: KvEventData::Stored {
            parent_hash: s.parent,
            blocks: s
                .blocks
                .iter()
                .map(|&(block_hash, tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
        },
    }
}

pub fn kv_remove(s: &RemoveSpec, event_id: u64) -> KvEvent {
    KvEvent {
        candidate: CandidateKey::new(s.worker, 0),
        tier: Tier::Device,
        event_id,
        data: KvEventData::Removed {
            block_hashes: s.handles.clone(),
        },
    }
}

pub fn dyn_store(s: &StoreSpec, event_id: u64) -> RouterEvent {
    RouterEvent::new(
        s.worker,
        KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: s.parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: s
                    .blocks
                    .iter()
                    .map(|&(h, l)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash: LocalBlockHash(l),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        },
    )
}

pub fn dyn_remove(s: &RemoveSpec, event_id: u64) -> RouterEvent {
    RouterEvent::new(
        s.worker,
        KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: s
                    .handles
                    .iter()
                    .map(|&h| ExternalSequenceBlockHash(h))
                    .collect(),
            }),
        },
    )
}

// ---- Building the three indexes from the same events ----------------------------------------

pub fn build_kvroute(w: &Workload) -> Indexer {
    let idx = Indexer::new();
    for (i, s) in w.store_specs().iter().enumerate() {
        idx.apply(&kv_store(s, i as u64)).expect("prefill store");
    }
    let held = idx.stats().held_blocks[0];
    assert_eq!(
        held as usize, w.entries,
        "kvroute holds the expected entries"
    );
    idx
}

pub fn build_radix(w: &Workload) -> RadixTree {
    let mut t = RadixTree::new();
    for (i, s) in w.store_specs().iter().enumerate() {
        t.apply_event(dyn_store(s, i as u64))
            .expect("prefill store");
    }
    t
}

/// Dynamo's concurrent compressed tree behind its `ThreadPoolIndexer`, one event thread (one
/// writer). Events are enqueued and the call waits for the thread to drain them.
pub fn build_thread_pool(w: &Workload) -> ThreadPoolIndexer<ConcurrentRadixTreeCompressed> {
    let tp = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BLOCK_SIZE as u32);
    for (i, s) in w.store_specs().iter().enumerate() {
        tp.enqueue_event(dyn_store(s, i as u64)).expect("enqueue");
    }
    block_on(tp.flush_and_wait()).expect("flush");
    tp
}

// ---- Result normalisation -----------------------------------------------------------------

pub fn ours_sorted(idx: &Indexer, q: &[u64]) -> Vec<(u64, u32)> {
    let mut v: Vec<(u64, u32)> = idx
        .find_matches(q)
        .device
        .into_iter()
        .map(|(k, d)| (k.worker_id, d))
        .collect();
    v.sort_unstable();
    v
}

pub fn dynamo_sorted(s: &OverlapScores) -> Vec<(u64, u32)> {
    let mut v: Vec<(u64, u32)> = s.scores.iter().map(|(k, &d)| (k.worker_id, d)).collect();
    v.sort_unstable();
    v
}

// ---- A minimal executor for Dynamo's async flush barriers (tokio oneshot needs no runtime) ---

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let waker = Arc::new(ThreadWaker(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    loop {
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}

// ---- Latency percentiles --------------------------------------------------------------------

/// (p50, p99, max) of nanosecond samples, in microseconds.
pub fn percentiles(samples: &mut [u64]) -> (f64, f64, f64) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize] as f64 / 1e3;
    (at(0.50), at(0.99), at(1.0))
}

/// Times `f` `n` times one call at a time; returns (p50, p99, max) in µs.
pub fn latency<S, T>(
    n: usize,
    mut setup: impl FnMut() -> S,
    mut f: impl FnMut(S) -> T,
) -> (f64, f64, f64) {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n.min(2_000) {
        std::hint::black_box(f(setup()));
    }
    for _ in 0..n {
        let input = setup();
        let t = std::time::Instant::now();
        let out = f(input);
        let ns = t.elapsed().as_nanos() as u64;
        std::hint::black_box(out);
        samples.push(ns);
    }
    percentiles(&mut samples)
}

/// Like [`latency`], but spreads the `n` calls evenly over `span` (busy-waiting in between), so
/// the samples interleave with whatever another thread is doing during that whole time.
pub fn paced_latency<T>(n: usize, span: Duration, mut f: impl FnMut() -> T) -> (f64, f64, f64) {
    for _ in 0..n.min(2_000) {
        std::hint::black_box(f());
    }
    let mut samples = Vec::with_capacity(n);
    let start = std::time::Instant::now();
    for i in 0..n {
        let due = start + span.mul_f64(i as f64 / n as f64);
        while std::time::Instant::now() < due {
            std::hint::spin_loop();
        }
        let t = std::time::Instant::now();
        let out = f();
        let ns = t.elapsed().as_nanos() as u64;
        std::hint::black_box(out);
        samples.push(ns);
    }
    percentiles(&mut samples)
}

pub fn print_latency(label: &str, (p50, p99, max): (f64, f64, f64)) {
    println!(
        "LATENCY {label}: p50 {p50:.3} µs  p99 {p99:.3} µs  max {max:.1} µs  (N={LATENCY_SAMPLES})"
    );
}

pub fn short() -> Duration {
    Duration::from_secs(1)
}

// ---- Selection inputs -------------------------------------------------------------------------

/// Per-candidate facts of one routing decision, for both selectors.
pub struct SelectionInput {
    pub isl: u32,
    pub device_overlap: Vec<u32>,
    pub active_prefill_tokens: Vec<u64>,
    pub active_decode_blocks: Vec<u64>,
    pub active_requests: Vec<u32>,
    pub active_prompt_blocks: Vec<u32>,
}

impl SelectionInput {
    /// A 4,096-token request over `n` candidates with mixed cache overlaps and loads: 20% hold
    /// nothing, 50% only the 32-block shared prefix, 15% the whole prompt, 15% a random depth;
    /// prefill backlog 0..16k tokens, decode 0..8k blocks, 0..64 requests; a few candidates already
    /// have part of this prompt active.
    pub fn new(n: usize, seed: u64) -> Self {
        let mut r = rng(0x5E1EC7 ^ seed ^ n as u64);
        let blocks = PROMPT_BLOCKS as u32;
        let mut s = Self {
            isl: PROMPT_TOKENS as u32,
            device_overlap: Vec::with_capacity(n),
            active_prefill_tokens: Vec::with_capacity(n),
            active_decode_blocks: Vec::with_capacity(n),
            active_requests: Vec::with_capacity(n),
            active_prompt_blocks: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let p: f64 = r.gen();
            let overlap = if p < 0.2 {
                0
            } else if p < 0.7 {
                SHARED_PREFIX_BLOCKS as u32
            } else if p < 0.85 {
                blocks
            } else {
                r.gen_range(1..blocks)
            };
            s.device_overlap.push(overlap);
            s.active_prefill_tokens.push(r.gen_range(0..16_384));
            s.active_decode_blocks.push(r.gen_range(0..8_192));
            s.active_requests.push(r.gen_range(0..64));
            let active = if r.gen_bool(0.1) {
                r.gen_range(0..=overlap)
            } else {
                0
            };
            s.active_prompt_blocks.push(active);
        }
        s
    }

    pub fn len(&self) -> usize {
        self.device_overlap.len()
    }
}
