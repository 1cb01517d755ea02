//! The worker-fleet simulator: a discrete-event model of vLLM-like engines (SPEC §10) driven by a
//! trace and routed by the real [`Router`].
//!
//! # One worker
//! - **KV blocks.** `num_gpu_blocks` blocks of `block_size` tokens. A *full* prompt block is
//!   identified by its chained sequence hash (vLLM's prefix-cache key) and shared between the
//!   requests that hold it (reference counted). The partial last block of a prompt, blocks of a
//!   chunk that ends mid-block, and every block of generated tokens are *private* to their request
//!   and never cached. A block whose last holder finishes becomes *idle*: still cached, evictable.
//!   Idle blocks sit in an LRU; a request releases its blocks tail first, so the end of a prompt
//!   is evicted before its beginning (vLLM's free-queue order). Eviction happens only when an
//!   allocation needs room.
//! - **Prefix hits.** When a request is admitted, its leading full blocks that the worker holds
//!   (active or idle) are reused: those tokens are not computed. At most `(len - 1) / block_size`
//!   blocks hit, so a fully cached prompt still computes its last block (an engine needs the last
//!   token's logits). A block is cached as soon as the chunk that computes it is scheduled (vLLM
//!   v1 semantics), so a request admitted in a later step reuses it.
//! - **Scheduling (one step).** Token budget `max_num_batched_tokens`. Running requests first, in
//!   admission order: each takes `min(remaining, budget)` tokens (1 when decoding); then waiting
//!   requests, first come first served, while the budget lasts and fewer than `max_num_seqs` run
//!   (chunked prefill: a long prompt takes several steps). A waiting request that cannot get its
//!   blocks stops admission (head of line). A running request that cannot get a block preempts the
//!   most recently admitted running request (possibly itself), which frees everything and goes back
//!   to the front of the waiting queue to recompute later (vLLM's recompute preemption).
//! - **Time.** A step lasts `prefill(T) + decode(u)`, divided by the speed-up: `prefill(T) =
//!   4.209989e-7·T² + 1.518344e-2·T + 16.50142` ms for the `T` prompt tokens computed in the step
//!   (only when `T > 0`), `decode(u) = max(1, -25.74·u² + 54.01·u + 5.74)` ms with `u` = blocks in
//!   use by running requests / `num_gpu_blocks` (only when some request decodes in the step). A
//!   request whose last prompt token is computed in a step gets its first token at the end of that
//!   step; each later step gives it one more token.
//! - **KV events.** Allocation emits `Removed` (evicted blocks, by sequence hash) and `Stored` (one
//!   per contiguous run of newly cached blocks: engine handle = sequence hash, `tokens_hash` = local
//!   hash, parent = the previous block's sequence hash). A step's events reach the router at the
//!   end of the step plus `kv_event_lag_ms`, in order. Reusing a cached block emits nothing, as in
//!   vLLM's default mode.
//!
//! # The router side
//! Each request is routed with [`Router::route_now`] on arrival (booked), `prefill_complete` is
//! called when its first token is stamped and `free` when its last one is. Nothing here scores
//! or picks: whatever policy the router has decides.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use rustc_hash::FxHashMap;

use crate::trace::Trace;
use kvroute_core::candidate::CandidateKey;
use kvroute_core::hashing;
use kvroute_core::indexer::{KvEvent, KvEventData, StoredBlock, Tier};
use kvroute_core::router::{RouteRequest, Router};
use kvroute_core::workers::WorkerSpec;

/// The simulated engines' settings (SPEC §10 defaults).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SimConfig {
    pub num_gpu_blocks: u32,
    pub block_size: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    /// Step times are divided by this (2.0 = engines twice as fast).
    pub speedup: f64,
    /// Simulated delay between a step's end and its KV events reaching the router.
    pub kv_event_lag_ms: f64,
    /// `prefill(T) = c0 + c1·T + c2·T²` ms.
    pub prefill_poly: [f64; 3],
    /// `decode(u) = max(1, c0 + c1·u + c2·u²)` ms.
    pub decode_poly: [f64; 3],
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            num_gpu_blocks: 16_384,
            block_size: 64,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            speedup: 1.0,
            kv_event_lag_ms: 5.0,
            prefill_poly: [16.50142, 1.518344e-2, 4.209989e-7],
            decode_poly: [5.74, 54.01, -25.74],
        }
    }
}

impl SimConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.num_gpu_blocks == 0 || self.block_size == 0 {
            return Err("num_gpu_blocks and block_size must be at least 1".into());
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err("max_num_seqs and max_num_batched_tokens must be at least 1".into());
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(format!(
                "the worker speed-up must be positive, got {}",
                self.speedup
            ));
        }
        if !(self.kv_event_lag_ms.is_finite() && self.kv_event_lag_ms >= 0.0) {
            return Err("the KV event lag must be a finite number >= 0".into());
        }
        Ok(())
    }

    /// Milliseconds to compute `t` new prompt tokens in one step.
    #[inline]
    pub fn prefill_ms(&self, t: u64) -> f64 {
        let t = t as f64;
        let [c0, c1, c2] = self.prefill_poly;
        c0 + c1 * t + c2 * t * t
    }

    /// Milliseconds of a decode step at KV utilisation `u`.
    #[inline]
    pub fn decode_ms(&self, u: f64) -> f64 {
        let [c0, c1, c2] = self.decode_poly;
        (c0 + c1 * u + c2 * u * u).max(1.0)
    }
}

/// A trace's block hashes at one block size, computed once and shared by every policy's run.
pub struct PreparedTrace<'a> {
    pub trace: &'a Trace,
    pub block_size: u32,
    offsets: Vec<usize>,
    local: Vec<u64>,
    seq: Vec<u64>,
}

impl<'a> PreparedTrace<'a> {
    pub fn new(trace: &'a Trace, block_size: u32) -> Self {
        let b = block_size.max(1) as usize;
        let total: usize = trace.requests.iter().map(|r| r.tokens.len() / b).sum();
        let mut offsets = Vec::with_capacity(trace.requests.len() + 1);
        let mut local = Vec::with_capacity(total);
        let mut seq = Vec::with_capacity(total);
        let mut buf_l = Vec::new();
        let mut buf_s = Vec::new();
        offsets.push(0);
        for r in &trace.requests {
            hashing::local_block_hashes_into(&r.tokens, b, hashing::BASE_SEED, &mut buf_l);
            hashing::sequence_hashes_into(&buf_l, &mut buf_s);
            local.extend_from_slice(&buf_l);
            seq.extend_from_slice(&buf_s);
            offsets.push(local.len());
        }
        Self {
            trace,
            block_size,
            offsets,
            local,
            seq,
        }
    }

    /// Local (content) hashes of request `i`'s full blocks.
    pub fn local(&self, i: usize) -> &[u64] {
        &self.local[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Chained sequence hashes of request `i`'s full blocks.
    pub fn seq(&self, i: usize) -> &[u64] {
        &self.seq[self.offsets[i]..self.offsets[i + 1]]
    }
}

/// What happened to one request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutcome {
    /// The worker it was routed to (`None`: the router refused it).
    pub worker: Option<u32>,
    pub arrival_ms: f64,
    /// NaN when it never got a first token.
    pub first_token_ms: f64,
    /// NaN when it never finished.
    pub done_ms: f64,
    pub prompt_tokens: u32,
    /// Prompt tokens the worker found in its prefix cache (at the admission that led to the
    /// first token).
    pub hit_tokens: u32,
    pub output_tokens: u32,
    /// Why it did not run (router error code or `exceeds_kv_capacity`).
    pub error: Option<String>,
}

/// Per-worker totals.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct WorkerStats {
    pub requests: u64,
    /// Prompt tokens the worker computed (misses, recomputation after preemption included).
    pub prefill_tokens: u64,
    pub hit_tokens: u64,
    pub steps: u64,
    pub busy_ms: f64,
    pub preemptions: u64,
    pub evicted_blocks: u64,
}

/// The result of one simulation.
#[derive(Clone, Debug, Default)]
pub struct SimOutput {
    pub requests: Vec<RequestOutcome>,
    /// Every inter-token gap (ms) of every request, in no particular order.
    pub itl_ms: Vec<f32>,
    pub workers: Vec<WorkerStats>,
    /// KV events the router refused (should be 0: the simulator keeps its chains consistent).
    pub kv_events_rejected: u64,
    pub kv_events_applied: u64,
    /// Simulated time of the last event.
    pub end_ms: f64,
}

#[derive(Clone, Copy)]
struct CachedBlock {
    refs: u32,
    /// Matches the LRU entry that is current for this block while it is idle.
    stamp: u64,
}

#[derive(Clone, Copy)]
struct Scheduled {
    req: u32,
    tokens: u32,
    prefill: bool,
}

struct Worker {
    id: u32,
    total: u32,
    cache: FxHashMap<u64, CachedBlock>,
    lru: VecDeque<(u64, u64)>,
    stamp: u64,
    /// Cached blocks nobody holds (evictable).
    idle: u32,
    /// Cached blocks held by at least one request.
    active_shared: u32,
    /// Private blocks held by requests.
    private: u32,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    busy: bool,
    sched: Vec<Scheduled>,
    /// KV events of the step being scheduled, in order.
    events: Vec<KvEventData>,
    removed: Vec<u64>,
    stats: WorkerStats,
}

struct Req {
    worker: u32,
    prompt: u32,
    output: u32,
    generated: u32,
    computed: u32,
    shared: u32,
    private: u32,
    running: bool,
    hit_tokens: u32,
    last_token_ms: f64,
}

impl Worker {
    fn new(id: u32, total: u32) -> Self {
        Self {
            id,
            total,
            cache: FxHashMap::default(),
            lru: VecDeque::new(),
            stamp: 0,
            idle: 0,
            active_shared: 0,
            private: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            busy: false,
            sched: Vec::new(),
            events: Vec::new(),
            removed: Vec::new(),
            stats: WorkerStats::default(),
        }
    }

    #[inline]
    fn free(&self) -> u32 {
        self.total - self.idle - self.active_shared - self.private
    }

    #[inline]
    fn used(&self) -> u32 {
        self.active_shared + self.private
    }

    /// Leading blocks of `seq` the worker holds.
    fn cached_prefix(&self, seq: &[u64]) -> usize {
        seq.iter()
            .take_while(|h| self.cache.contains_key(h))
            .count()
    }

    fn evict_one(&mut self) -> bool {
        while let Some((h, stamp)) = self.lru.pop_front() {
            if let Some(e) = self.cache.get(&h) {
                if e.refs == 0 && e.stamp == stamp {
                    self.cache.remove(&h);
                    self.idle -= 1;
                    self.removed.push(h);
                    self.stats.evicted_blocks += 1;
                    return true;
                }
            }
        }
        false
    }

    /// Grows request `r`'s holding to cover its first `p` tokens (allocating, reusing cached
    /// blocks, evicting idle ones as needed). `false`, with nothing changed, when the blocks
    /// cannot be had.
    fn try_grow(&mut self, r: &mut Req, seq: &[u64], local: &[u64], p: u32, b: u32) -> bool {
        let shared_t = ((p / b) as usize).min(seq.len());
        let total_t = p.div_ceil(b) as usize;
        let private_t = (total_t - shared_t) as u32;
        let s0 = r.shared as usize;
        debug_assert!(shared_t >= s0);
        let mut reuse_idle = 0u32;
        let mut created = 0u32;
        for h in &seq[s0..shared_t] {
            match self.cache.get(h) {
                Some(e) if e.refs == 0 => reuse_idle += 1,
                Some(_) => {}
                None => created += 1,
            }
        }
        let need = i64::from(created) + i64::from(private_t) - i64::from(r.private);
        let free = i64::from(self.free());
        if need > free + i64::from(self.idle - reuse_idle) {
            return false;
        }
        // Reuse what is cached first, so eviction cannot take it.
        if created as usize != shared_t - s0 {
            for h in &seq[s0..shared_t] {
                if let Some(e) = self.cache.get_mut(h) {
                    if e.refs == 0 {
                        self.idle -= 1;
                        self.active_shared += 1;
                    }
                    e.refs += 1;
                }
            }
        }
        let mut deficit = need - free;
        while deficit > 0 {
            let ok = self.evict_one();
            debug_assert!(ok, "capacity was checked");
            deficit -= 1;
        }
        if !self.removed.is_empty() {
            self.events.push(KvEventData::Removed {
                block_hashes: std::mem::take(&mut self.removed),
            });
        }
        if created > 0 {
            let mut run: Option<usize> = None;
            for k in s0..shared_t {
                let fresh = match self.cache.entry(seq[k]) {
                    std::collections::hash_map::Entry::Occupied(_) => false,
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(CachedBlock { refs: 1, stamp: 0 });
                        true
                    }
                };
                if fresh {
                    self.active_shared += 1;
                    run.get_or_insert(k);
                } else if let Some(start) = run.take() {
                    self.push_stored(seq, local, start, k);
                }
            }
            if let Some(start) = run {
                self.push_stored(seq, local, start, shared_t);
            }
        }
        self.private = self.private + private_t - r.private;
        r.private = private_t;
        r.shared = shared_t as u32;
        true
    }

    fn push_stored(&mut self, seq: &[u64], local: &[u64], start: usize, end: usize) {
        self.events.push(KvEventData::Stored {
            parent_hash: start.checked_sub(1).map(|i| seq[i]),
            blocks: (start..end)
                .map(|k| StoredBlock {
                    block_hash: seq[k],
                    tokens_hash: local[k],
                })
                .collect(),
        });
    }

    /// Releases everything request `r` holds; its cached blocks go idle, tail first.
    fn release(&mut self, r: &mut Req, seq: &[u64]) {
        for h in seq[..r.shared as usize].iter().rev() {
            let e = self.cache.get_mut(h).expect("held blocks are cached");
            e.refs -= 1;
            if e.refs == 0 {
                self.active_shared -= 1;
                self.idle += 1;
                self.stamp += 1;
                e.stamp = self.stamp;
                self.lru.push_back((*h, self.stamp));
            }
        }
        self.private -= r.private;
        r.private = 0;
        r.shared = 0;
        // Drop stale LRU entries now and then so the queue stays proportional to the idle set.
        if self.lru.len() > 4 * self.idle as usize + 4096 {
            let cache = &self.cache;
            self.lru
                .retain(|(h, s)| cache.get(h).is_some_and(|e| e.refs == 0 && e.stamp == *s));
        }
    }
}

/// Simulated time (ms), totally ordered for the event heap.
#[derive(Clone, Copy, Debug)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn request_id(i: usize) -> String {
    format!("replay-{i}")
}

/// The fleet: workers, requests and the event loop.
struct Fleet<'p, 'r> {
    cfg: &'p SimConfig,
    prepared: &'p PreparedTrace<'p>,
    router: &'r Router,
    workers: Vec<Worker>,
    reqs: Vec<Req>,
    out: SimOutput,
    /// (delivery time, worker, event), in delivery order.
    kv_fifo: VecDeque<(f64, u32, KvEventData)>,
    event_ids: Vec<u64>,
    steps: BinaryHeap<Reverse<(Time, u32)>>,
    done: u64,
}

impl Fleet<'_, '_> {
    fn deliver_until(&mut self, now: f64) {
        while self.kv_fifo.front().is_some_and(|(t, _, _)| *t <= now) {
            let (_, w, data) = self.kv_fifo.pop_front().expect("peeked");
            let id = &mut self.event_ids[w as usize];
            *id += 1;
            let ev = KvEvent {
                candidate: CandidateKey::new(u64::from(w), 0),
                tier: Tier::Device,
                event_id: *id,
                data,
            };
            match self.router.apply_event(&ev) {
                Ok(Some(_)) => self.out.kv_events_applied += 1,
                Ok(None) | Err(_) => self.out.kv_events_rejected += 1,
            }
        }
    }

    fn arrive(&mut self, i: usize, now: f64) {
        let tr = &self.prepared.trace.requests[i];
        let b = self.cfg.block_size;
        let needed = (tr.tokens.len() as u64 + u64::from(tr.output_len)).div_ceil(u64::from(b));
        let o = &mut self.out.requests[i];
        // Policies see the trace's time, so state they age (sessions) behaves as it would live.
        self.router.set_clock_ms(Some(now.max(0.0) as u64));
        let decision = self.router.route_now(RouteRequest {
            request_id: Some(request_id(i)),
            expected_output_tokens: Some(tr.output_len),
            ..RouteRequest::tokens(tr.tokens.clone())
        });
        let d = match decision {
            Ok(d) => d,
            Err(e) => {
                o.error = Some(e.code().to_string());
                self.done += 1;
                return;
            }
        };
        let w = d.candidate.worker_id as u32;
        o.worker = Some(w);
        self.workers[w as usize].stats.requests += 1;
        if needed > u64::from(self.cfg.num_gpu_blocks) {
            // It could never hold all its tokens at once: an engine would reject it.
            o.error = Some("exceeds_kv_capacity".into());
            let _ = self.router.free(&request_id(i));
            self.done += 1;
            return;
        }
        self.reqs[i].worker = w;
        self.workers[w as usize].waiting.push_back(i as u32);
        if !self.workers[w as usize].busy {
            self.start_step(w as usize, now);
        }
    }

    /// Schedules the next step of worker `w` (if it has work) and queues its end.
    fn start_step(&mut self, w: usize, now: f64) {
        let cfg = self.cfg;
        let b = cfg.block_size;
        let prepared = self.prepared;
        let worker = &mut self.workers[w];
        let reqs = &mut self.reqs;
        worker.sched.clear();
        let mut budget = cfg.max_num_batched_tokens;

        // Running requests, in admission order.
        let mut preempted = false;
        let mut i = 0;
        while i < worker.running.len() && budget > 0 {
            let idx = worker.running[i] as usize;
            let (seq, local) = (prepared.seq(idx), prepared.local(idx));
            let r = &mut reqs[idx];
            let known = r.prompt + r.generated;
            let rem = known - r.computed;
            let n = rem.min(budget);
            let prefill = rem > 1 || r.generated == 0;
            let p = r.computed + n;
            if worker.try_grow(r, seq, local, p, b) {
                r.computed = p;
                budget -= n;
                worker.sched.push(Scheduled {
                    req: idx as u32,
                    tokens: n,
                    prefill,
                });
                i += 1;
                continue;
            }
            // Out of blocks: preempt the most recently admitted request (maybe this one).
            let victim = worker.running.pop().expect("non-empty") as usize;
            let vr = &mut reqs[victim];
            worker.release(vr, prepared.seq(victim));
            vr.computed = 0;
            vr.running = false;
            worker.waiting.push_front(victim as u32);
            worker.stats.preemptions += 1;
            preempted = true;
        }

        // Waiting requests, first come first served (none in a step that had to preempt, as in
        // vLLM).
        while !preempted && budget > 0 && (worker.running.len() as u32) < cfg.max_num_seqs {
            let Some(&front) = worker.waiting.front() else {
                break;
            };
            let idx = front as usize;
            let (seq, local) = (prepared.seq(idx), prepared.local(idx));
            let r = &mut reqs[idx];
            let known = r.prompt + r.generated;
            let cap = (((known - 1) / b) as usize).min(seq.len());
            let hits = worker.cached_prefix(&seq[..cap]) as u32;
            let start = hits * b;
            let n = (known - start).min(budget);
            if !worker.try_grow(r, seq, local, start + n, b) {
                break;
            }
            worker.waiting.pop_front();
            r.computed = start + n;
            r.running = true;
            if r.generated == 0 {
                r.hit_tokens = start;
            }
            budget -= n;
            worker.running.push(front);
            worker.sched.push(Scheduled {
                req: front,
                tokens: n,
                prefill: true,
            });
        }

        if worker.sched.is_empty() {
            worker.busy = false;
            if preempted {
                // Everything that ran was preempted: admit afresh.
                return self.start_step(w, now);
            }
            if worker.running.is_empty() {
                // Nothing runs and the head cannot start: it can never fit. Refuse it.
                if let Some(idx) = worker.waiting.pop_front() {
                    let o = &mut self.out.requests[idx as usize];
                    o.error = Some("exceeds_kv_capacity".into());
                    let _ = self.router.free(&request_id(idx as usize));
                    self.done += 1;
                    if !worker.waiting.is_empty() {
                        return self.start_step(w, now);
                    }
                }
            }
            return;
        }
        let mut prefill_tokens = 0u64;
        let mut decoding = false;
        for s in &worker.sched {
            if s.prefill {
                prefill_tokens += u64::from(s.tokens);
            } else {
                decoding = true;
            }
        }
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += cfg.prefill_ms(prefill_tokens);
        }
        if decoding {
            ms += cfg.decode_ms(f64::from(worker.used()) / f64::from(worker.total));
        }
        ms /= cfg.speedup;
        worker.stats.prefill_tokens += prefill_tokens;
        worker.stats.steps += 1;
        worker.stats.busy_ms += ms;
        worker.busy = true;
        self.steps.push(Reverse((Time(now + ms), w as u32)));
    }

    fn end_step(&mut self, w: usize, now: f64) {
        let prepared = self.prepared;
        let worker = &mut self.workers[w];
        let mut any_done = false;
        let sched = std::mem::take(&mut worker.sched);
        for s in &sched {
            let idx = s.req as usize;
            let r = &mut self.reqs[idx];
            if !r.running || r.computed != r.prompt + r.generated {
                continue;
            }
            r.generated += 1;
            let o = &mut self.out.requests[idx];
            if r.generated == 1 {
                o.first_token_ms = now;
                o.hit_tokens = r.hit_tokens;
                worker.stats.hit_tokens += u64::from(r.hit_tokens);
                let _ = self.router.prefill_complete(&request_id(idx));
            } else {
                self.out.itl_ms.push((now - r.last_token_ms) as f32);
            }
            r.last_token_ms = now;
            if r.generated >= r.output {
                o.done_ms = now;
                o.output_tokens = r.generated;
                worker.release(r, prepared.seq(idx));
                r.running = false;
                any_done = true;
                let _ = self.router.free(&request_id(idx));
                self.done += 1;
            }
        }
        worker.sched = sched;
        if any_done {
            let reqs = &self.reqs;
            worker.running.retain(|&i| reqs[i as usize].running);
        }
        let deliver_at = now + self.cfg.kv_event_lag_ms;
        for ev in worker.events.drain(..) {
            self.kv_fifo.push_back((deliver_at, worker.id, ev));
        }
        worker.busy = false;
        self.start_step(w, now);
    }
}

/// Replays `prepared` on a fleet of `workers` simulated engines routed by `router`.
///
/// Registers workers `0..workers` (one rank each, with the simulated capacity) on the router,
/// which must be fresh. `progress` is called now and then with the number of requests finished
/// (completed or refused).
pub fn simulate(
    router: &Router,
    prepared: &PreparedTrace<'_>,
    workers: u32,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimOutput, String> {
    cfg.validate()?;
    if workers == 0 {
        return Err("at least one worker is needed".into());
    }
    if prepared.block_size != cfg.block_size {
        return Err("the trace was prepared for another block size".into());
    }
    if router.config().block_size != cfg.block_size {
        return Err(format!(
            "the router's block size ({}) differs from the workers' ({})",
            router.config().block_size,
            cfg.block_size
        ));
    }
    for w in 0..workers {
        router
            .upsert_worker(
                u64::from(w),
                WorkerSpec {
                    total_kv_blocks: u64::from(cfg.num_gpu_blocks),
                    max_num_batched_tokens: cfg.max_num_batched_tokens,
                    ..Default::default()
                },
            )
            .map_err(|e| format!("cannot register worker {w}: {e}"))?;
    }
    let trace = prepared.trace;
    let n = trace.requests.len();
    let mut fleet = Fleet {
        cfg,
        prepared,
        router,
        workers: (0..workers)
            .map(|w| Worker::new(w, cfg.num_gpu_blocks))
            .collect(),
        reqs: trace
            .requests
            .iter()
            .map(|r| Req {
                worker: 0,
                prompt: r.tokens.len() as u32,
                output: r.output_len.max(1),
                generated: 0,
                computed: 0,
                shared: 0,
                private: 0,
                running: false,
                hit_tokens: 0,
                last_token_ms: 0.0,
            })
            .collect(),
        out: SimOutput {
            requests: trace
                .requests
                .iter()
                .map(|r| RequestOutcome {
                    worker: None,
                    arrival_ms: r.arrival_ms,
                    first_token_ms: f64::NAN,
                    done_ms: f64::NAN,
                    prompt_tokens: r.tokens.len() as u32,
                    hit_tokens: 0,
                    output_tokens: 0,
                    error: None,
                })
                .collect(),
            itl_ms: Vec::with_capacity(
                trace
                    .requests
                    .iter()
                    .map(|r| r.output_len.saturating_sub(1) as usize)
                    .sum(),
            ),
            ..Default::default()
        },
        kv_fifo: VecDeque::new(),
        event_ids: vec![0; workers as usize],
        steps: BinaryHeap::new(),
        done: 0,
    };
    let mut next_arrival = 0usize;
    let mut reported = 0u64;
    let mut now = 0.0f64;
    loop {
        let step_t = fleet.steps.peek().map(|Reverse((t, _))| t.0);
        let arr_t = trace.requests.get(next_arrival).map(|r| r.arrival_ms);
        let step_first = match (step_t, arr_t) {
            (None, None) => break,
            (Some(s), Some(a)) => s <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if step_first {
            let Reverse((t, w)) = fleet.steps.pop().expect("peeked");
            now = t.0;
            fleet.deliver_until(now);
            fleet.end_step(w as usize, now);
        } else {
            now = arr_t.expect("some");
            fleet.deliver_until(now);
            fleet.arrive(next_arrival, now);
            next_arrival += 1;
        }
        if fleet.done >= reported + 64 {
            reported = fleet.done;
            progress(reported);
        }
    }
    fleet.deliver_until(f64::INFINITY);
    progress(fleet.done);
    debug_assert_eq!(fleet.done as usize, n);
    let mut out = fleet.out;
    out.workers = fleet.workers.into_iter().map(|w| w.stats).collect();
    out.end_ms = now;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRequest;
    use kvroute_core::router::RouterConfig;

    fn trace(reqs: Vec<(f64, Vec<u32>, u32)>) -> Trace {
        Trace::from_requests(
            "t",
            reqs.into_iter()
                .map(|(t, tokens, out)| TraceRequest {
                    arrival_ms: t,
                    tokens,
                    output_len: out,
                })
                .collect(),
        )
    }

    fn run(t: &Trace, workers: u32, cfg: &SimConfig) -> (SimOutput, Router) {
        let router = Router::new(RouterConfig {
            block_size: cfg.block_size,
            ..Default::default()
        })
        .unwrap();
        let p = PreparedTrace::new(t, cfg.block_size);
        let out = simulate(&router, &p, workers, cfg, &mut |_| {}).unwrap();
        (out, router)
    }

    #[test]
    fn one_request_timing_matches_the_model() {
        let cfg = SimConfig {
            block_size: 16,
            ..Default::default()
        };
        let t = trace(vec![(0.0, (0..100).collect(), 3)]);
        let (out, router) = run(&t, 1, &cfg);
        let o = &out.requests[0];
        let ttft = cfg.prefill_ms(100);
        assert!((o.first_token_ms - ttft).abs() < 1e-9);
        // Two decode steps at u = 7 blocks (6 full + 1 private) / 16384.
        let u = 7.0 / 16384.0;
        assert!((o.done_ms - ttft - 2.0 * cfg.decode_ms(u)).abs() < 1e-6);
        assert_eq!(out.itl_ms.len(), 2);
        assert_eq!(o.output_tokens, 3);
        // Six full blocks were stored and nothing is booked any more.
        assert_eq!(out.kv_events_rejected, 0);
        assert_eq!(router.indexer().stats().held_blocks[0], 6);
        assert_eq!(router.active_bookings(), 0);
    }

    #[test]
    fn chunked_prefill_and_prefix_hits() {
        let cfg = SimConfig {
            block_size: 16,
            max_num_batched_tokens: 64,
            ..Default::default()
        };
        let a: Vec<u32> = (0..200).collect();
        let mut b = a[..160].to_vec();
        b.extend(1000..1040);
        let t = trace(vec![(0.0, a, 1), (10_000.0, b, 1)]);
        let (out, _) = run(&t, 1, &cfg);
        // 200 tokens in chunks of 64: 4 steps (64, 64, 64, 8).
        let ttft = 3.0 * cfg.prefill_ms(64) + cfg.prefill_ms(8);
        assert!((out.requests[0].first_token_ms - ttft).abs() < 1e-6);
        assert_eq!(out.requests[0].hit_tokens, 0);
        assert_eq!(out.requests[1].hit_tokens, 160);
        assert_eq!(out.workers[0].prefill_tokens, 200 + 40);
    }

    #[test]
    fn eviction_is_lru_tail_first_and_reported() {
        // Room for 8 blocks of 16 tokens.
        let cfg = SimConfig {
            block_size: 16,
            num_gpu_blocks: 8,
            ..Default::default()
        };
        let a: Vec<u32> = (0..65).collect(); // 4 full blocks + tail
        let b: Vec<u32> = (100..165).collect(); // 4 full blocks + tail
        let c: Vec<u32> = (200..233).collect(); // 2 full blocks + tail
        let t = trace(vec![
            (0.0, a.clone(), 1),
            (1000.0, b, 1),
            (2000.0, c, 1),
            (3000.0, a, 1),
        ]);
        let (out, router) = run(&t, 1, &cfg);
        assert!(out.requests.iter().all(|o| o.error.is_none()));
        // c needs 3 blocks: a's last 3 (tail first) are evicted, a's first block survives.
        assert_eq!(out.requests[3].hit_tokens, 16);
        assert_eq!(out.kv_events_rejected, 0);
        assert!(out.workers[0].evicted_blocks >= 3);
        let _ = router;
    }

    #[test]
    fn too_long_requests_are_refused() {
        let cfg = SimConfig {
            block_size: 16,
            num_gpu_blocks: 4,
            ..Default::default()
        };
        let t = trace(vec![
            (0.0, (0..100).collect(), 1),
            (1.0, (0..10).collect(), 2),
        ]);
        let (out, router) = run(&t, 1, &cfg);
        assert_eq!(
            out.requests[0].error.as_deref(),
            Some("exceeds_kv_capacity")
        );
        assert!(out.requests[1].error.is_none());
        assert_eq!(router.active_bookings(), 0);
    }
}
