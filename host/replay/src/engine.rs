//! One simulated vLLM-like engine: its KV blocks, prefix cache, scheduler and step times (SPEC §10).
//!
//! The replay's fleet ([`crate::sim`]) runs one per worker on simulated time, and `kvroute
//! mock-engine` runs one in real time behind an OpenAI-compatible server. Both drive it the same
//! way: [`Engine::submit`] a request, [`Engine::start_step`] to schedule a step (it answers the
//! step's duration), wait that long (simulated or real), then [`Engine::end_step`] to stamp tokens,
//! and [`Engine::drain_events`] for the KV events the step produced. The engine knows nothing of
//! the router or of time itself, which is what lets the same code serve both.
//!
//! # The model
//! - **KV blocks.** `num_gpu_blocks` blocks of `block_size` tokens. A *full* prompt block is
//!   identified by its chained sequence hash (vLLM's prefix-cache key) and shared between the
//!   requests that hold it (reference counted). The partial last block of a prompt, blocks of a
//!   chunk that ends mid-block, and every block of generated tokens are *private* to their request
//!   and never cached. A block whose last holder finishes becomes *idle*: still cached, evictable.
//!   Idle blocks sit in an LRU; a request releases its blocks tail first, so the end of a prompt
//!   is evicted before its beginning (vLLM's free-queue order). Eviction happens only when an
//!   allocation needs room.
//! - **Prefix hits.** When a request is admitted, its leading full blocks that the engine holds
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
//! - **Time.** A step lasts `prefill(T) + decode(u)`, divided by the speed-up, with `T` the prompt
//!   tokens computed in the step (only when `T > 0`) and `u` the blocks in use by running requests
//!   / `num_gpu_blocks` (only when some request decodes in the step); see [`SimConfig`]. A request
//!   whose last prompt token is computed in a step gets its first token at the end of that step;
//!   each later step gives it one more token.
//! - **KV events.** Allocation emits `Removed` (evicted blocks, by sequence hash) and `Stored` (one
//!   per contiguous run of newly cached blocks: engine handle = sequence hash, `tokens_hash` = local
//!   hash, parent = the previous block's sequence hash). Reusing a cached block emits nothing, as in
//!   vLLM's default mode.
//!
//! # Disaggregated prefill/decode
//! Two kinds of request serve a split fleet ([`Kind`]):
//! - a **prefill-only** request computes its prompt and its first token, then keeps its blocks
//!   (the KV is being read by the decode engine) until [`Engine::release`];
//! - a **transferred** request arrives with its prompt's KV already computed elsewhere: admission
//!   allocates the prompt's blocks without computing them (cached ones are reused, new full blocks
//!   are cached and reported as usual), and its first step is a 1-token decode step that produces
//!   its first token. Preempted, it recomputes its prompt locally like any request.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use kvroute_core::indexer::{KvEventData, StoredBlock};

/// The block hashes of the requests an engine serves, owned by the caller (the replay computes a
/// trace's once for every policy; the mock engine hashes each request as it arrives).
pub trait BlockHashes {
    /// Chained sequence hashes of request `id`'s full prompt blocks.
    fn seq(&self, id: u64) -> &[u64];
    /// Local (content) hashes of the same blocks.
    fn local(&self, id: u64) -> &[u64];
}

/// What a request asks of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Compute the prompt, generate `output` tokens (aggregated serving).
    Full,
    /// Compute the prompt and the first token only; keep the blocks until [`Engine::release`].
    PrefillOnly,
    /// The prompt's KV arrived by transfer: decode `output` tokens.
    Transferred,
}

/// A request handed to [`Engine::submit`].
#[derive(Clone, Copy, Debug)]
pub struct NewRequest {
    /// The caller's id ([`BlockHashes`] is asked with it).
    pub id: u64,
    pub prompt_tokens: u32,
    /// Tokens to generate (at least 1; a prefill-only request generates 1).
    pub output_tokens: u32,
    pub kind: Kind,
}

/// One token stamped by [`Engine::end_step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Token {
    pub id: u64,
    /// This is the request's `n`-th generated token (1 = its first).
    pub n: u32,
    /// Its last token: the request is finished (a prefill-only one still holds its blocks).
    pub done: bool,
    /// Prompt tokens found in the prefix cache at the admission that led to the first token
    /// (meaningful when `n == 1`).
    pub hit_tokens: u32,
}

/// Per-engine totals.
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

#[derive(Clone, Copy)]
struct CachedBlock {
    refs: u32,
    /// Matches the LRU entry that is current for this block while it is idle.
    stamp: u64,
}

#[derive(Clone, Copy)]
struct Scheduled {
    req: u64,
    tokens: u32,
    prefill: bool,
}

struct Req {
    prompt: u32,
    output: u32,
    kind: Kind,
    generated: u32,
    computed: u32,
    shared: u32,
    private: u32,
    running: bool,
    /// It lost its blocks to a preemption once (a transferred request then recomputes).
    preempted: bool,
    hit_tokens: u32,
}

/// The KV blocks and the prefix cache (apart from the request table, so a request can be grown
/// while the table is borrowed).
struct Blocks {
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
    /// KV events since the last drain, in order.
    events: Vec<KvEventData>,
    removed: Vec<u64>,
    evicted: u64,
}

/// One engine (one data-parallel rank).
pub struct Engine {
    blocks: Blocks,
    reqs: FxHashMap<u64, Req>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    busy: bool,
    sched: Vec<Scheduled>,
    stats: WorkerStats,
    /// This engine's speed factor (a heterogeneous fleet): step times are divided by it.
    speed: f64,
}

impl Engine {
    /// Makes this engine `speed` times as fast as the model (0.5: twice as slow).
    pub fn set_speed(&mut self, speed: f64) {
        self.speed = speed;
    }

    /// An empty engine with `num_gpu_blocks` KV blocks.
    pub fn new(num_gpu_blocks: u32) -> Self {
        Self {
            blocks: Blocks {
                total: num_gpu_blocks,
                cache: FxHashMap::default(),
                lru: VecDeque::new(),
                stamp: 0,
                idle: 0,
                active_shared: 0,
                private: 0,
                events: Vec::new(),
                removed: Vec::new(),
                evicted: 0,
            },
            reqs: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            busy: false,
            sched: Vec::new(),
            stats: WorkerStats::default(),
            speed: 1.0,
        }
    }

    /// The engine's totals so far.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            evicted_blocks: self.blocks.evicted,
            ..self.stats.clone()
        }
    }

    /// Blocks held by requests (shared and private).
    pub fn used_blocks(&self) -> u32 {
        self.blocks.used()
    }

    /// Blocks cached and held by nobody.
    pub fn idle_blocks(&self) -> u32 {
        self.blocks.idle
    }

    /// A step is scheduled and has not ended.
    pub fn is_busy(&self) -> bool {
        self.busy
    }

    /// Requests waiting to be admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests the engine knows (waiting, running or holding blocks after a prefill).
    pub fn requests(&self) -> usize {
        self.reqs.len()
    }

    /// Leading blocks of `seq` the engine holds (active or idle).
    pub fn cached_prefix(&self, seq: &[u64]) -> usize {
        self.blocks.cached_prefix(seq)
    }
    /// Queues a request; it is admitted by a later [`Engine::start_step`]. `false` (and nothing
    /// queued) when the id is already known, the prompt is empty, or the request could never fit
    /// in the engine's blocks.
    pub fn submit(&mut self, r: NewRequest, block_size: u32) -> bool {
        let output = match r.kind {
            Kind::PrefillOnly => 1,
            _ => r.output_tokens.max(1),
        };
        let needed =
            (u64::from(r.prompt_tokens) + u64::from(output)).div_ceil(u64::from(block_size.max(1)));
        if needed > u64::from(self.blocks.total)
            || self.reqs.contains_key(&r.id)
            || r.prompt_tokens == 0
        {
            return false;
        }
        self.reqs.insert(
            r.id,
            Req {
                prompt: r.prompt_tokens,
                output,
                kind: r.kind,
                generated: 0,
                computed: 0,
                shared: 0,
                private: 0,
                running: false,
                preempted: false,
                hit_tokens: 0,
            },
        );
        self.waiting.push_back(r.id);
        self.stats.requests += 1;
        true
    }

    /// Drops request `id` wherever it is (a client that went away, or a prefill-only request whose
    /// KV has been read): its blocks are released (cached ones go idle). Takes effect at once; a
    /// step in flight simply stamps no token for it. `false` when the id is unknown.
    pub fn release(&mut self, id: u64, h: &impl BlockHashes) -> bool {
        let Some(mut r) = self.reqs.remove(&id) else {
            return false;
        };
        self.blocks.release(&mut r, h.seq(id));
        if r.running {
            self.running.retain(|&x| x != id);
        } else {
            self.waiting.retain(|&x| x != id);
        }
        true
    }

    /// The KV events since the last call, in order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, KvEventData> {
        self.blocks.events.drain(..)
    }

    /// Schedules the next step. Returns its duration in ms (already divided by the speed-up), or
    /// `None` when there is nothing to run (the engine is then idle until the next submit).
    /// Requests that can never be admitted (nothing else runs and their blocks still do not fit)
    /// are dropped and their ids pushed to `refused`.
    pub fn start_step(
        &mut self,
        cfg: &SimConfig,
        h: &impl BlockHashes,
        refused: &mut Vec<u64>,
    ) -> Option<f64> {
        loop {
            match self.schedule(cfg, h, refused) {
                Schedule::Step(ms) => return Some(ms),
                Schedule::Idle => return None,
                Schedule::Again => continue,
            }
        }
    }

    fn schedule(
        &mut self,
        cfg: &SimConfig,
        h: &impl BlockHashes,
        refused: &mut Vec<u64>,
    ) -> Schedule {
        let b = cfg.block_size;
        let mut sched = std::mem::take(&mut self.sched);
        sched.clear();
        let mut budget = cfg.max_num_batched_tokens;

        // Running requests, in admission order.
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let r = self.reqs.get_mut(&id).expect("running requests are known");
            let known = r.prompt + r.generated;
            let rem = known - r.computed;
            let n = rem.min(budget);
            let prefill = rem > 1 || r.generated == 0;
            let p = r.computed + n;
            if self.blocks.try_grow(r, h.seq(id), h.local(id), p, b) {
                r.computed = p;
                budget -= n;
                sched.push(Scheduled {
                    req: id,
                    tokens: n,
                    prefill,
                });
                i += 1;
                continue;
            }
            // Out of blocks: preempt the most recently admitted request (maybe this one, never one
            // already scheduled in this step: those come before `i`).
            let victim = self.running.pop().expect("non-empty");
            let vr = self
                .reqs
                .get_mut(&victim)
                .expect("running requests are known");
            self.blocks.release(vr, h.seq(victim));
            vr.computed = 0;
            vr.running = false;
            vr.preempted = true;
            self.waiting.push_front(victim);
            self.stats.preemptions += 1;
            preempted = true;
        }

        // Waiting requests, first come first served (none in a step that had to preempt, as in
        // vLLM).
        while !preempted && budget > 0 && (self.running.len() as u32) < cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let (seq, local) = (h.seq(id), h.local(id));
            let r = self.reqs.get_mut(&id).expect("waiting requests are known");
            let known = r.prompt + r.generated;
            let cap = (((known - 1) / b) as usize).min(seq.len());
            let hits = self.blocks.cached_prefix(&seq[..cap]) as u32;
            // A transferred request has its prompt's KV (until a preemption loses it): it
            // allocates the whole prompt and decodes its first token (a 1-token decode step: the
            // last prompt token's logits). Anything else computes from
            // its hits on.
            let transferred = r.kind == Kind::Transferred && !r.preempted;
            let (grow_to, n, prefill) = if transferred {
                (known, 1, false)
            } else {
                let start = hits * b;
                let n = (known - start).min(budget);
                (start + n, n, true)
            };
            if !self.blocks.try_grow(r, seq, local, grow_to, b) {
                break;
            }
            self.waiting.pop_front();
            r.computed = grow_to;
            r.running = true;
            if r.generated == 0 {
                r.hit_tokens = if transferred { 0 } else { hits * b };
            }
            budget -= n;
            self.running.push(id);
            sched.push(Scheduled {
                req: id,
                tokens: n,
                prefill,
            });
        }

        if sched.is_empty() {
            self.sched = sched;
            self.busy = false;
            if preempted {
                // Everything that ran was preempted: admit afresh.
                return Schedule::Again;
            }
            if self.running.is_empty() {
                // Nothing runs and the head cannot start: it can never fit. Refuse it.
                if let Some(id) = self.waiting.pop_front() {
                    if let Some(mut r) = self.reqs.remove(&id) {
                        self.blocks.release(&mut r, h.seq(id));
                    }
                    refused.push(id);
                    if !self.waiting.is_empty() {
                        return Schedule::Again;
                    }
                }
            }
            return Schedule::Idle;
        }
        let mut prefill_tokens = 0u64;
        let mut decoding = false;
        for s in &sched {
            if s.prefill {
                prefill_tokens += u64::from(s.tokens);
            } else {
                decoding = true;
            }
        }
        self.sched = sched;
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += cfg.prefill_ms(prefill_tokens);
        }
        if decoding {
            ms += cfg.decode_ms(f64::from(self.blocks.used()) / f64::from(self.blocks.total));
        }
        ms /= cfg.speedup * self.speed;
        self.stats.prefill_tokens += prefill_tokens;
        self.stats.steps += 1;
        self.stats.busy_ms += ms;
        self.busy = true;
        Schedule::Step(ms)
    }

    /// Ends the step [`Engine::start_step`] scheduled: every request whose known tokens are all
    /// computed gets one more token, pushed to `tokens`. A finished request releases its blocks
    /// (a prefill-only one keeps them until [`Engine::release`]).
    pub fn end_step(&mut self, h: &impl BlockHashes, tokens: &mut Vec<Token>) {
        let sched = std::mem::take(&mut self.sched);
        let mut any_done = false;
        for s in &sched {
            let Some(r) = self.reqs.get_mut(&s.req) else {
                continue; // released mid-step
            };
            if !r.running || r.computed != r.prompt + r.generated {
                continue;
            }
            r.generated += 1;
            if r.generated == 1 {
                self.stats.hit_tokens += u64::from(r.hit_tokens);
            }
            let done = r.generated >= r.output;
            tokens.push(Token {
                id: s.req,
                n: r.generated,
                done,
                hit_tokens: r.hit_tokens,
            });
            if done {
                r.running = false;
                any_done = true;
                if r.kind != Kind::PrefillOnly {
                    let mut r = self.reqs.remove(&s.req).expect("present");
                    self.blocks.release(&mut r, h.seq(s.req));
                }
            }
        }
        self.sched = sched;
        if any_done {
            let reqs = &self.reqs;
            self.running
                .retain(|id| reqs.get(id).is_some_and(|r| r.running));
        }
        self.busy = false;
    }
}

enum Schedule {
    Step(f64),
    Idle,
    Again,
}

impl Blocks {
    #[inline]
    fn free(&self) -> u32 {
        self.total - self.idle - self.active_shared - self.private
    }

    #[inline]
    fn used(&self) -> u32 {
        self.active_shared + self.private
    }

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
                    self.evicted += 1;
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

/// The simulated engines' settings (SPEC §10 defaults).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SimConfig {
    pub num_gpu_blocks: u32,
    pub block_size: u32,
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    /// Step times are divided by this (2.0 = engines twice as fast).
    pub speedup: f64,
    /// A heterogeneous fleet: worker `w`'s step times are further divided by
    /// `worker_speeds[w % len]` (0.5 = twice as slow). Empty: every worker at 1.
    pub worker_speeds: Vec<f64>,
    /// Simulated delay between a step's end and its KV events reaching the router.
    pub kv_event_lag_ms: f64,
    /// `prefill(T) = c0 + c1·T + c2·T²` ms.
    pub prefill_poly: [f64; 3],
    /// `decode(u) = max(1, c0 + c1·u + c2·u²)` ms.
    pub decode_poly: [f64; 3],
    /// The clients send their session keys (an agentic workload's session and parent ids);
    /// `false` sends none, so the router has sessions only if it infers them
    /// (`--session-keys none|inferred`).
    pub send_session_keys: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            num_gpu_blocks: 16_384,
            block_size: 64,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            speedup: 1.0,
            worker_speeds: Vec::new(),
            kv_event_lag_ms: 5.0,
            prefill_poly: [16.50142, 1.518344e-2, 4.209989e-7],
            decode_poly: [5.74, 54.01, -25.74],
            send_session_keys: true,
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
        if let Some(v) = self
            .worker_speeds
            .iter()
            .find(|v| !(v.is_finite() && **v > 0.0))
        {
            return Err(format!(
                "every worker speed must be a positive number, got {v}"
            ));
        }
        if !(self.kv_event_lag_ms.is_finite() && self.kv_event_lag_ms >= 0.0) {
            return Err("the KV event lag must be a finite number >= 0".into());
        }
        Ok(())
    }

    /// Worker `w`'s own speed factor (1 unless `worker_speeds` says otherwise).
    pub fn worker_speed(&self, w: u32) -> f64 {
        match self.worker_speeds.len() {
            0 => 1.0,
            n => self.worker_speeds[w as usize % n],
        }
    }

    /// Milliseconds to compute `t` new prompt tokens in one step.
    #[inline]
    pub fn prefill_ms(&self, t: u64) -> f64 {
        let t = t as f64;
        let [c0, c1, c2] = self.prefill_poly;
        c0 + c1 * t + c2 * t * t
    }

    /// Milliseconds worker `w` needs to compute `uncached` prompt tokens with nothing else to
    /// do: chunks of at most `max_num_batched_tokens`, one step each (at least one token, as an
    /// engine recomputes the last one of a fully cached prompt). No queue order gets a request
    /// its first token sooner: the floor under its TTFT.
    pub fn prefill_alone_ms(&self, uncached: u32, w: u32) -> f64 {
        let chunk = u64::from(self.max_num_batched_tokens);
        let mut left = u64::from(uncached.max(1));
        let mut ms = 0.0;
        while left > 0 {
            let t = left.min(chunk);
            ms += self.prefill_ms(t);
            left -= t;
        }
        ms / (self.speedup * self.worker_speed(w))
    }

    /// Milliseconds of a decode step at KV utilisation `u`.
    #[inline]
    pub fn decode_ms(&self, u: f64) -> f64 {
        let [c0, c1, c2] = self.decode_poly;
        (c0 + c1 * u + c2 * u * u).max(1.0)
    }
}
