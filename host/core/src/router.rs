//! The router: the one entry point callers use — `route(request) → decision | error`.
//!
//! A decision runs, in order: validate and hash the prompt ([`crate::hashing`]); take a registry
//! snapshot ([`crate::workers`]); resolve the hard constraints and the pin ([`crate::eligibility`]);
//! read every candidate's overlaps from the index ([`crate::indexer`]) and load from the tracker
//! ([`crate::load`]); build the candidate columns of the eligible ones; compute the native base
//! cost ([`crate::cost`]); ask the active policy ([`Scorer`]) for costs or a pick, falling back to
//! the native cost on any failure; pick; book. When a busy threshold is set and every eligible
//! candidate is busy, the request waits in the [`crate::queue`] and is scored afresh when capacity
//! frees up.
//!
//! The router holds no lock across the policy call: the registry is a lock-free snapshot, the index
//! is read under its read lock only while matching, and the load tracker's mutex is taken once to
//! read loads and once to book. Per-thread scratch buffers make a decision allocation-light.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use rustc_hash::FxHashSet;
use serde::Serialize;

use crate::candidate::{CandidateColumns, CandidateKey, DpRank, PolicyRequest, WorkerId};
use crate::cost::{self, CostWeights};
use crate::eligibility::{self, BusyRule, Constraints, Ineligible, PinError};
use crate::hashing;
use crate::indexer::approx::{ApproxConfig, ApproxIndexer};
use crate::indexer::{Applied, ApplyError, DenseOverlaps, Indexer, KvEvent, OverlapScores};
use crate::load::{Booking, CandidateLoad, LoadConfig, LoadError, LoadTracker};
use crate::queue::{PendingQueue, QueueEntry, QueueError, QueueLimits, QueueOrder};
use crate::rng::{SeededRef, SeededRng};
use crate::workers::{
    Registry, RegistryLimits, RegistrySnapshot, SpecError, TaintNames, Worker, WorkerSpec,
};

/// Settings of the routing core.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Tokens per KV block; must match the engines'.
    pub block_size: u32,
    /// Busy threshold as a fraction of `max_num_batched_tokens`; `None` = queueing off.
    pub busy_threshold: Option<f64>,
    pub queue_order: QueueOrder,
    pub queue_limits: QueueLimits,
    /// Longest a request may wait in the queue before a retryable error.
    pub queue_timeout: Duration,
    pub load: LoadConfig,
    /// Approximate mode (index from routing decisions) when `Some`.
    pub approx: Option<ApproxConfig>,
    pub cost: CostWeights,
    /// Temperature when a request gives none.
    pub default_temperature: f64,
    /// Longest prompt accepted, in tokens (or blocks × block size).
    pub max_prompt_tokens: usize,
    pub registry: RegistryLimits,
    /// Seed of the random tie-break and temperature sampling (and of generated request ids).
    /// `None` (what `kvroute serve` uses): a per-thread generator seeded by the OS. `Some(seed)`:
    /// one lock-free generator per router ([`SeededRng`]), so a single-threaded caller — `kvroute
    /// replay` — gets the same decisions on every run.
    pub rng_seed: Option<u64>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            busy_threshold: None,
            queue_order: QueueOrder::Fcfs,
            queue_limits: QueueLimits::default(),
            queue_timeout: Duration::from_secs(30),
            load: LoadConfig::default(),
            approx: None,
            cost: CostWeights::default(),
            default_temperature: 0.0,
            max_prompt_tokens: 1 << 20,
            registry: RegistryLimits::default(),
            rng_seed: None,
        }
    }
}

/// A prompt: tokens, or local block hashes the caller already computed.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    BlockHashes(Vec<u64>),
}

/// Where a request must go (a worker, and optionally one of its ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

/// A routing request (API.md `POST /v1/route`, already parsed).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRequest {
    pub request_id: Option<String>,
    pub prompt: Prompt,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    pub session_id: Option<String>,
    pub required_taints: Vec<String>,
    /// Soft preferences: taint name → weight in (-1, 1).
    pub preferred_taints: Vec<(String, f32)>,
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    pub pinned: Option<Pin>,
    /// Within-class priority boost (>= 0).
    pub priority: f64,
    /// Strict priority class for the queue (higher first).
    pub priority_class: i32,
    pub expected_output_tokens: Option<u32>,
    pub temperature: Option<f64>,
    /// `false` = ask only: nothing is booked and no state changes.
    pub book: bool,
    /// Include every candidate's figures and cost in the decision.
    pub explain: bool,
}

impl RouteRequest {
    /// A request for a token prompt with every option at its default (booked, no constraints).
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Self {
            request_id: None,
            prompt: Prompt::Tokens(tokens),
            lora_name: None,
            cache_salt: None,
            session_id: None,
            required_taints: Vec::new(),
            preferred_taints: Vec::new(),
            allowed_worker_ids: None,
            pinned: None,
            priority: 0.0,
            priority_class: 0,
            expected_output_tokens: None,
            temperature: None,
            book: true,
            explain: false,
        }
    }
}

/// Name, version and digest of the policy that decided.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyLabel {
    pub name: String,
    /// The loaded version's number (`GET /v1/policies`); 0 for the host's built-in policies
    /// (`host-native`, the replay's `round-robin`), which are not loaded versions.
    pub version: u64,
    pub digest: String,
}

impl PolicyLabel {
    /// The label of decisions made by the host's native cost with no policy configured.
    pub fn native() -> Arc<PolicyLabel> {
        Arc::new(PolicyLabel {
            name: "host-native".into(),
            version: 0,
            digest: String::new(),
        })
    }
}

/// What a policy answered for one decision.
#[derive(Clone, Debug, PartialEq)]
pub enum ScorerOutcome {
    /// One cost per candidate; the host picks with the request's temperature.
    Costs(Vec<f64>),
    /// The policy picked this candidate index.
    Pick(usize),
    /// The policy failed (reason code); the host used its native cost.
    Fallback(&'static str),
    /// No policy is active: the native cost decides, and that is not a failure.
    Native,
}

/// A policy's answer and the version that gave it.
#[derive(Clone, Debug)]
pub struct ScorerDecision {
    pub outcome: ScorerOutcome,
    pub label: Arc<PolicyLabel>,
}

/// Soft scoring: what the router asks of the active policy. The Wasm policy runtime implements it;
/// tests implement it natively.
pub trait Scorer: Send + Sync {
    fn decide(
        &self,
        request: &PolicyRequest,
        candidates: &CandidateColumns,
        taints: &TaintNames,
    ) -> ScorerDecision;
}

/// One candidate's figures in an explained decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExplainRow {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub host_overlap_blocks: u32,
    pub disk_overlap_blocks: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u32,
    pub taints: Vec<String>,
    pub base_cost: f64,
    /// The cost the pick was made from: the policy's when it answered costs, else the native
    /// cost (it picked, or the decision fell back).
    pub cost: f64,
    /// The candidate the decision chose.
    pub chosen: bool,
}

/// A candidate a hard rule kept out of an explained decision, and which rule (the first that
/// failed, in SPEC §6's order).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExcludedRow {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// `not_allowed`, `missing_required_taints`, `draining` or `busy`.
    pub reason: &'static str,
    pub overlap_blocks: u32,
    pub active_prefill_tokens: u64,
}

/// Time spent in each phase of a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub hash: Duration,
    pub matching: Duration,
    pub policy: Duration,
    pub total: Duration,
}

/// A routing decision.
#[derive(Clone, Debug)]
pub struct RouteDecision {
    pub request_id: String,
    pub candidate: CandidateKey,
    /// Device blocks of the prompt the chosen candidate holds.
    pub overlap_blocks: u32,
    pub cached_tokens: u32,
    pub policy: Arc<PolicyLabel>,
    pub fallback: bool,
    pub fallback_reason: Option<&'static str>,
    pub queued: Duration,
    pub booked: bool,
    pub candidates: Option<Vec<ExplainRow>>,
    /// With `explain`: the candidates considered (the pinned worker's ranks when pinned) that a
    /// hard rule excluded, so nobody has to guess why a worker was not chosen.
    pub excluded: Option<Vec<ExcludedRow>>,
    /// With `explain`: what the policy answered (`costs`, `pick`), or `native` when the native
    /// cost decided (no policy, or a fallback).
    pub answer: Option<&'static str>,
    pub timings: Timings,
}

/// Why a request was not routed. Each variant has a stable code and an HTTP status.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("request id {0:?} is already booked or queued; free it first or use a new id")]
    DuplicateRequest(String),
    #[error(transparent)]
    Pin(#[from] PinError),
    #[error("no workers are registered")]
    NoWorkers,
    #[error("no candidate is eligible: {0}")]
    AllFiltered(String),
    #[error("every eligible worker is overloaded; retry shortly")]
    AllOverloaded,
    #[error("{0}; retry shortly")]
    QueueFull(QueueError),
    #[error("waited {0:?} in the queue without capacity freeing up; retry shortly")]
    QueueTimeout(Duration),
    #[error("the request was cancelled while waiting")]
    Cancelled,
    #[error("the router is shutting down; retry on another instance")]
    ShuttingDown,
}

impl RouteError {
    /// The stable snake_case code (API.md error body).
    pub fn code(&self) -> &'static str {
        match self {
            RouteError::Invalid { .. } => "invalid_request",
            RouteError::DuplicateRequest(_) => "duplicate_request_id",
            RouteError::Pin(p) => match p {
                PinError::NotAllowed(_) => "pinned_worker_not_allowed",
                PinError::UnknownWorker(_) => "pinned_worker_not_found",
                PinError::UnknownRank { .. } => "pinned_rank_not_found",
                PinError::MissingTaints(_) => "pinned_worker_missing_taints",
                PinError::Draining(_) => "pinned_worker_draining",
                PinError::Overloaded(_) => "pinned_worker_overloaded",
            },
            RouteError::NoWorkers => "no_workers",
            RouteError::AllFiltered(_) => "all_filtered_by_constraints",
            RouteError::AllOverloaded => "all_overloaded",
            RouteError::QueueFull(QueueError::Full { limit, .. }) => limit.as_str(),
            RouteError::QueueFull(QueueError::DuplicateRequest(_)) => "duplicate_request_id",
            RouteError::QueueTimeout(_) => "queue_timeout",
            RouteError::Cancelled => "request_cancelled",
            RouteError::ShuttingDown => "shutting_down",
        }
    }

    /// HTTP status (SPEC §6, API.md).
    pub fn status(&self) -> u16 {
        match self {
            RouteError::Invalid { .. } => 400,
            RouteError::DuplicateRequest(_) => 409,
            RouteError::Pin(p) => match p {
                PinError::NotAllowed(_) | PinError::UnknownRank { .. } => 400,
                PinError::UnknownWorker(_) => 404,
                PinError::MissingTaints(_) | PinError::Draining(_) => 409,
                PinError::Overloaded(_) => 429,
            },
            RouteError::NoWorkers | RouteError::AllFiltered(_) => 503,
            // API.md: overloaded → 429 (SPEC §6 lists it among the 503 reasons; the HTTP contract
            // is what clients program against).
            RouteError::AllOverloaded => 429,
            RouteError::QueueFull(QueueError::DuplicateRequest(_)) => 409,
            // Waited its limit and no capacity freed: overloaded, as API.md counts it.
            RouteError::QueueFull(_) | RouteError::QueueTimeout(_) => 429,
            RouteError::Cancelled => 409,
            RouteError::ShuttingDown => 503,
        }
    }

    /// Whether retrying the same request later may succeed (`Retry-After` is sent).
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            RouteError::AllOverloaded
                | RouteError::QueueFull(QueueError::Full { .. })
                | RouteError::QueueTimeout(_)
                | RouteError::ShuttingDown
                | RouteError::Pin(PinError::Overloaded(_))
        )
    }

    /// The request field at fault, when one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            RouteError::Invalid { field, .. } => Some(field),
            RouteError::DuplicateRequest(_) => Some("request_id"),
            RouteError::Pin(_) => Some("pinned_worker"),
            _ => None,
        }
    }
}

fn invalid(field: &str, message: impl Into<String>) -> RouteError {
    RouteError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Errors of lifecycle calls on a request id.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    #[error("no booked or queued request has id {0:?}")]
    UnknownRequest(String),
    /// Prefill or output progress for a request still waiting in the queue: it has no worker.
    #[error("request {0:?} is still queued: it has no worker yet (free it to cancel it)")]
    Queued(String),
}

/// A validated, hashed request, ready to be scored (maybe several times, if it waits).
#[derive(Debug)]
struct Prepared {
    request_id: String,
    local: Vec<u64>,
    seq: Vec<u64>,
    prompt_tokens: u32,
    req: RouteRequest,
    temperature: f64,
    hash_time: Duration,
}

/// A queued request's side of the wait. If the caller goes away before the answer (an HTTP
/// client disconnects and its handler future is dropped), dropping this takes the request out of
/// the queue at once, instead of it holding its place, its queued tokens and its id until it
/// reaches the head; and a decision made for it just before is freed instead of keeping its
/// booking until expiry.
struct Waiting<'a> {
    router: &'a Router,
    request_id: &'a str,
    rx: tokio::sync::oneshot::Receiver<Result<RouteDecision, RouteError>>,
    /// The wait ended normally: the caller handles the outcome.
    settled: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // `pump` decides and sends under the queue lock: once we hold it, the request is either
        // still queued or its answer is in the channel.
        let removed = self.router.queue.lock().cancel(self.request_id);
        if removed.is_none() {
            if let Ok(Ok(decision)) = self.rx.try_recv() {
                if decision.booked {
                    let _ = self.router.load.lock().free(&decision.request_id);
                }
            }
        }
    }
}

struct Waiter {
    prepared: Arc<Prepared>,
    enqueued: Instant,
    tx: tokio::sync::oneshot::Sender<Result<RouteDecision, RouteError>>,
}

/// Per-thread buffers reused across decisions.
#[derive(Default)]
struct Scratch {
    dense: DenseOverlaps,
    cols: CandidateColumns,
    costs: Vec<f64>,
    depths: Vec<(CandidateKey, u32)>,
    loads: Vec<CandidateLoad>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    static RNG: RefCell<SmallRng> = RefCell::new(SmallRng::from_entropy());
}

/// Counters of the router (monotonic).
#[derive(Debug, Default)]
pub struct RouterCounters {
    pub decisions: AtomicU64,
    pub fallbacks: AtomicU64,
    pub queued: AtomicU64,
    pub rejected: AtomicU64,
    pub events_unknown_worker: AtomicU64,
}

/// The routing core. `Send + Sync`; share it behind an `Arc`.
pub struct Router {
    config: RouterConfig,
    busy: BusyRule,
    indexer: Arc<Indexer>,
    approx: Option<ApproxIndexer>,
    registry: Registry,
    load: Mutex<LoadTracker>,
    queue: Mutex<PendingQueue<Waiter>>,
    scorer: ArcSwapOption<Box<dyn Scorer>>,
    native_label: Arc<PolicyLabel>,
    /// `Some` when `config.rng_seed` is set; otherwise the per-thread OS-seeded `RNG`.
    seeded_rng: Option<SeededRng>,
    epoch: Instant,
    /// The clock policies see (`request.now-ms`): `u64::MAX` = the wall clock; anything else is a
    /// time set by [`Router::set_clock_ms`] (the replay simulator's time).
    clock_ms: AtomicU64,
    pub counters: RouterCounters,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// Sets the time policies see as `now-ms` (milliseconds since the Unix epoch): `Some` pins it
    /// (a simulator advancing its own clock), `None` returns to the wall clock.
    pub fn set_clock_ms(&self, ms: Option<u64>) {
        self.clock_ms
            .store(ms.map_or(u64::MAX, |m| m.min(u64::MAX - 1)), Relaxed);
    }

    /// The time policies see, in milliseconds since the Unix epoch.
    pub fn clock_ms(&self) -> u64 {
        match self.clock_ms.load(Relaxed) {
            u64::MAX => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX - 1)),
            ms => ms,
        }
    }

    /// A router with its own index. Fails on an unusable configuration.
    pub fn new(config: RouterConfig) -> Result<Self, String> {
        if config.block_size == 0 {
            return Err("block_size must be at least 1".into());
        }
        if let Some(t) = config.busy_threshold {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!("busy_threshold must be a positive number, got {t}"));
            }
        }
        if !(config.default_temperature.is_finite() && config.default_temperature >= 0.0) {
            return Err("default_temperature must be finite and >= 0".into());
        }
        Ok(Self {
            busy: BusyRule {
                threshold_frac: config.busy_threshold,
            },
            indexer: Arc::new(Indexer::new()),
            approx: config.approx.map(ApproxIndexer::new),
            registry: Registry::new(config.registry),
            load: Mutex::new(LoadTracker::new(config.load)),
            queue: Mutex::new(PendingQueue::new(config.queue_order, config.queue_limits)),
            scorer: ArcSwapOption::empty(),
            native_label: PolicyLabel::native(),
            seeded_rng: config.rng_seed.map(SeededRng::new),
            epoch: Instant::now(),
            clock_ms: AtomicU64::new(u64::MAX),
            config,
            counters: RouterCounters::default(),
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Runs `f` with the router's random generator: the seeded one, or this thread's.
    #[inline]
    fn with_rng<T>(&self, f: impl FnOnce(&mut dyn RngCore) -> T) -> T {
        match &self.seeded_rng {
            Some(s) => f(&mut SeededRef(s)),
            None => RNG.with(|r| f(&mut *r.borrow_mut())),
        }
    }

    pub fn indexer(&self) -> &Arc<Indexer> {
        &self.indexer
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Installs (or with `None` removes) the policy consulted for soft scoring.
    pub fn set_scorer(&self, scorer: Option<Box<dyn Scorer>>) {
        self.scorer.store(scorer.map(Arc::new));
    }

    // ---- workers -------------------------------------------------------------------------------

    /// Registers or replaces a worker. Ranks it no longer has lose their index and load.
    pub fn upsert_worker(
        &self,
        worker_id: WorkerId,
        spec: WorkerSpec,
    ) -> Result<Worker, SpecError> {
        let (worker, dropped) = self.registry.upsert(worker_id, spec, &self.indexer)?;
        {
            let mut load = self.load.lock();
            for k in dropped {
                load.remove_candidate(k);
            }
        }
        self.pump();
        Ok(worker)
    }

    /// Replaces taints and/or the draining flag. `Ok(None)` for an unknown worker.
    pub fn patch_worker(
        &self,
        worker_id: WorkerId,
        taints: Option<Vec<String>>,
        draining: Option<bool>,
    ) -> Result<Option<Worker>, SpecError> {
        let w = self
            .registry
            .patch(worker_id, taints, draining, &self.indexer)?;
        self.pump();
        Ok(w)
    }

    /// Removes a worker everywhere: registry, index (all tiers, all ranks), load, approximate timers.
    pub fn remove_worker(&self, worker_id: WorkerId) -> Option<Worker> {
        let w = self.registry.remove(worker_id, &self.indexer)?;
        self.load.lock().remove_worker(worker_id);
        if let Some(a) = &self.approx {
            a.remove_worker(worker_id);
        }
        self.pump();
        Some(w)
    }

    /// Current load of a candidate.
    pub fn load_of(&self, key: CandidateKey) -> CandidateLoad {
        self.load.lock().load(key)
    }

    // ---- events --------------------------------------------------------------------------------

    /// Applies a KV event from a registered worker. Events of unknown workers are dropped
    /// (`Ok(None)`), as are ranks the worker does not have.
    pub fn apply_event(&self, event: &KvEvent) -> Result<Option<Applied>, ApplyError> {
        let snap = self.registry.snapshot();
        if snap.candidate(event.candidate).is_none() {
            self.counters.events_unknown_worker.fetch_add(1, Relaxed);
            return Ok(None);
        }
        let applied = self.indexer.apply_to_known(event)?;
        if applied.is_none() {
            // Removed since the snapshot above was taken.
            self.counters.events_unknown_worker.fetch_add(1, Relaxed);
        }
        Ok(applied)
    }

    /// Overlaps of a prompt (API.md `POST /v1/overlap`).
    pub fn overlap(
        &self,
        prompt: &Prompt,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<(u32, OverlapScores), RouteError> {
        let local = self.local_hashes(prompt, lora_name, cache_salt)?;
        Ok((local.len() as u32, self.indexer.find_matches(&local)))
    }

    fn local_hashes(
        &self,
        prompt: &Prompt,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, RouteError> {
        let b = self.config.block_size as usize;
        match prompt {
            Prompt::Tokens(t) => {
                if t.is_empty() {
                    return Err(invalid("tokens", "the prompt is empty"));
                }
                if t.len() > self.config.max_prompt_tokens {
                    return Err(invalid(
                        "tokens",
                        format!(
                            "{} tokens; at most {} are accepted",
                            t.len(),
                            self.config.max_prompt_tokens
                        ),
                    ));
                }
                let seed = hashing::request_seed(lora_name, cache_salt);
                Ok(hashing::local_block_hashes(t, b, seed))
            }
            Prompt::BlockHashes(h) => {
                if h.is_empty() {
                    return Err(invalid("block_hashes", "the prompt is empty"));
                }
                if h.len().saturating_mul(b) > self.config.max_prompt_tokens {
                    return Err(invalid(
                        "block_hashes",
                        format!(
                            "{} blocks; at most {} tokens are accepted",
                            h.len(),
                            self.config.max_prompt_tokens
                        ),
                    ));
                }
                if lora_name.is_some_and(|s| !s.is_empty())
                    || cache_salt.is_some_and(|s| !s.is_empty())
                {
                    return Err(invalid(
                        "block_hashes",
                        "lora_name and cache_salt only apply to tokens: precomputed block hashes already include them",
                    ));
                }
                Ok(h.clone())
            }
        }
    }

    // ---- routing -------------------------------------------------------------------------------

    fn prepare(&self, req: RouteRequest) -> Result<Prepared, RouteError> {
        let t0 = Instant::now();
        for (i, (name, w)) in req.preferred_taints.iter().enumerate() {
            if !(w.is_finite() && *w > -1.0 && *w < 1.0) {
                return Err(invalid(
                    &format!("routing_constraints.preferred_taints.{name}"),
                    format!("weight {w} must be finite and strictly between -1 and 1"),
                ));
            }
            if name.is_empty() {
                return Err(invalid(
                    &format!("routing_constraints.preferred_taints[{i}]"),
                    "a taint name cannot be empty",
                ));
            }
        }
        if !(req.priority.is_finite() && req.priority >= 0.0) {
            return Err(invalid("priority", "must be a finite number >= 0"));
        }
        let temperature = match req.temperature {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid("temperature", "must be a finite number >= 0"))
            }
            Some(t) => t,
            None => self.config.default_temperature,
        };
        if let Some(id) = &req.request_id {
            if id.is_empty() || id.len() > 256 || id.chars().any(char::is_control) {
                return Err(invalid(
                    "request_id",
                    "must be 1 to 256 characters with no control characters",
                ));
            }
        }
        let local = self.local_hashes(
            &req.prompt,
            req.lora_name.as_deref(),
            req.cache_salt.as_deref(),
        )?;
        let prompt_tokens = match &req.prompt {
            Prompt::Tokens(t) => t.len() as u32,
            Prompt::BlockHashes(h) => (h.len() as u32).saturating_mul(self.config.block_size),
        };
        let seq = hashing::sequence_hashes(&local);
        let request_id = req
            .request_id
            .clone()
            .unwrap_or_else(|| self.with_rng(|r| format!("kvr-{:016x}", r.gen::<u64>())));
        // One lock at a time: `pump` takes the queue's lock and then the load's, so holding the
        // load's guard (a temporary of the `||`) while taking the queue's could deadlock.
        if req.book {
            let booked = self.load.lock().get(&request_id).is_some();
            if booked || self.queue.lock().contains(&request_id) {
                return Err(RouteError::DuplicateRequest(request_id));
            }
        }
        Ok(Prepared {
            request_id,
            local,
            seq,
            prompt_tokens,
            req,
            temperature,
            hash_time: t0.elapsed(),
        })
    }

    /// Routes a request. With queueing on, waits (asynchronously) while every eligible candidate
    /// is busy, up to the queue timeout.
    pub async fn route(&self, req: RouteRequest) -> Result<RouteDecision, RouteError> {
        let prepared = Arc::new(self.prepare(req)?);
        if self.busy.threshold_frac.is_none() || !prepared.req.book {
            return self.decide(&prepared, Duration::ZERO);
        }
        let class = prepared.req.priority_class;
        let backlog = self.queue.lock().has_backlog_at_or_above(class);
        if !backlog {
            match self.decide(&prepared, Duration::ZERO) {
                Err(RouteError::AllOverloaded) => {}
                other => return other,
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let entry = QueueEntry {
            request_id: prepared.request_id.clone(),
            class,
            priority_jump: prepared.req.priority,
            arrival_secs: self.epoch.elapsed().as_secs_f64(),
            prompt_tokens: prepared.prompt_tokens,
            best_cached_tokens: self.best_cached_tokens(&prepared),
            payload: Waiter {
                prepared: prepared.clone(),
                enqueued: Instant::now(),
                tx,
            },
        };
        let workers = self.registry.snapshot().workers.len();
        {
            let mut queue = self.queue.lock();
            // After `shutdown_queue` nobody will serve the queue: refuse rather than wait for
            // a timeout that the shutdown grace period may cut short.
            if queue.is_closed() {
                return Err(RouteError::ShuttingDown);
            }
            if let Err((e, _)) = queue.push(entry, workers) {
                self.counters.rejected.fetch_add(1, Relaxed);
                return Err(RouteError::QueueFull(e));
            }
        }
        self.counters.queued.fetch_add(1, Relaxed);
        let mut waiting = Waiting {
            router: self,
            request_id: &prepared.request_id,
            rx,
            settled: false,
        };
        // Capacity may have freed between the failed attempt and the push.
        self.pump();
        match tokio::time::timeout(self.config.queue_timeout, &mut waiting.rx).await {
            Ok(answer) => {
                waiting.settled = true;
                answer.unwrap_or(Err(RouteError::Cancelled))
            }
            // Leaving takes the request out of the queue, or frees a decision made for it at the
            // last moment (`Waiting`'s drop).
            Err(_) => Err(RouteError::QueueTimeout(self.config.queue_timeout)),
        }
    }

    /// SPEC §9's `best_cached_tokens` for the WSPT order: the most of the prompt any worker the
    /// request may go to holds on its device. An estimate for ordering the queue (the other
    /// filters are applied when the request is scored), computed only under WSPT.
    fn best_cached_tokens(&self, p: &Prepared) -> u32 {
        if self.config.queue_order != QueueOrder::Wspt {
            return 0;
        }
        let scores = self.indexer.find_matches(&p.local);
        let allowed = p.req.allowed_worker_ids.as_deref();
        let pinned = p.req.pinned.map(|pin| pin.worker_id);
        let best = scores
            .device
            .iter()
            .filter(|(k, _)| allowed.is_none_or(|a| a.contains(&k.worker_id)))
            .filter(|(k, _)| pinned.is_none_or(|w| w == k.worker_id))
            .map(|&(_, blocks)| blocks)
            .max()
            .unwrap_or(0);
        let tokens = u64::from(best) * u64::from(self.config.block_size);
        tokens.min(u64::from(p.prompt_tokens)) as u32
    }

    /// Routes without waiting: a busy fleet is an immediate retryable error. For callers without an
    /// async runtime (benchmarks, replay).
    pub fn route_now(&self, req: RouteRequest) -> Result<RouteDecision, RouteError> {
        let prepared = self.prepare(req)?;
        self.decide(&prepared, Duration::ZERO)
    }

    /// Serves waiting requests, in queue order, while capacity allows.
    pub fn pump(&self) {
        let mut queue = self.queue.lock();
        while let Some(entry) = queue.peek() {
            if entry.payload.tx.is_closed() {
                queue.pop();
                continue;
            }
            let waited = entry.payload.enqueued.elapsed();
            let result = self.decide(&entry.payload.prepared, waited);
            if matches!(result, Err(RouteError::AllOverloaded)) {
                break;
            }
            let entry = queue.pop().expect("peeked");
            if let Err(Ok(decision)) = entry.payload.tx.send(result) {
                if decision.booked {
                    let _ = self.load.lock().free(&decision.request_id);
                }
            }
        }
    }

    fn resolve_constraints(&self, req: &RouteRequest, snap: &RegistrySnapshot) -> Constraints {
        let mut c = Constraints {
            allowed: req
                .allowed_worker_ids
                .as_ref()
                .map(|ids| ids.iter().copied().collect::<FxHashSet<_>>()),
            ..Default::default()
        };
        for t in &req.required_taints {
            match snap.taint_id(t) {
                Some(id) => c.required_taints.push(id),
                None => c.unsatisfiable = Some(t.clone()),
            }
        }
        c
    }

    /// One scoring attempt: eligibility, overlaps, loads, costs, policy, pick, book.
    fn decide(&self, p: &Prepared, queued: Duration) -> Result<RouteDecision, RouteError> {
        let t0 = Instant::now();
        let snap = self.registry.snapshot();
        // A pin names its worker: with none registered, that worker is unknown (404), not
        // merely unavailable.
        if snap.candidates.is_empty() && p.req.pinned.is_none() {
            self.counters.rejected.fetch_add(1, Relaxed);
            return Err(RouteError::NoWorkers);
        }
        let constraints = self.resolve_constraints(&p.req, &snap);
        // The candidates in play: the pinned worker's ranks, or everyone.
        let pool: &[crate::workers::CandidateEntry] = match p.req.pinned {
            None => &snap.candidates,
            Some(pin) => {
                if let Some(allowed) = &constraints.allowed {
                    if !allowed.contains(&pin.worker_id) {
                        return Err(PinError::NotAllowed(pin.worker_id).into());
                    }
                }
                let start = snap
                    .candidates
                    .partition_point(|c| c.key.worker_id < pin.worker_id);
                let end = snap
                    .candidates
                    .partition_point(|c| c.key.worker_id <= pin.worker_id);
                if start == end {
                    return Err(PinError::UnknownWorker(pin.worker_id).into());
                }
                match pin.dp_rank {
                    None => &snap.candidates[start..end],
                    Some(r) => {
                        let Some(i) = snap.candidates[start..end]
                            .iter()
                            .position(|c| c.key.dp_rank == r)
                        else {
                            return Err(PinError::UnknownRank {
                                worker_id: pin.worker_id,
                                dp_rank: r,
                            }
                            .into());
                        };
                        &snap.candidates[start + i..start + i + 1]
                    }
                }
            }
        };

        SCRATCH.with(|scratch| {
            let mut s = scratch.borrow_mut();
            let Scratch {
                dense,
                cols,
                costs,
                depths,
                loads,
            } = &mut *s;
            let tm = Instant::now();
            self.indexer.find_matches_dense(&p.local, dense);
            let matching = tm.elapsed();

            // Loads and eligibility under one short lock.
            cols.clear();
            cols.taint_offsets.push(0);
            loads.clear();
            let mut first_failure: Option<Ineligible> = None;
            // Candidates excluded, by `Ineligible` reason (for the error's message).
            let mut excluded_by = [0u32; 4];
            let mut eligible_idx: Vec<u32> = Vec::with_capacity(pool.len().min(1024));
            // With `explain`: (pool index, reason, prefill load) of every excluded candidate.
            let mut excluded_rows: Vec<(u32, Ineligible, u64)> = Vec::new();
            {
                let load = self.load.lock();
                for (i, c) in pool.iter().enumerate() {
                    let l = load.load(c.key);
                    match eligibility::check(c, &l, &constraints, &self.busy) {
                        Ok(()) => {
                            eligible_idx.push(i as u32);
                            loads.push(l);
                        }
                        Err(why) => {
                            if p.req.explain {
                                excluded_rows.push((i as u32, why, l.active_prefill_tokens));
                            }
                            excluded_by[why as usize] += 1;
                            first_failure.get_or_insert(why);
                        }
                    }
                }
                if !eligible_idx.is_empty() {
                    load.active_prefix_depths(&p.seq, depths);
                } else {
                    depths.clear();
                }
            }
            if eligible_idx.is_empty() {
                self.counters.rejected.fetch_add(1, Relaxed);
                let busy = excluded_by[Ineligible::Busy as usize];
                if let Some(pin) = p.req.pinned {
                    // A pinned rank-less request: report the most actionable reason.
                    let why = if busy > 0 {
                        Ineligible::Busy
                    } else {
                        first_failure.unwrap_or(Ineligible::Draining)
                    };
                    return Err(PinError::from((why, pin.worker_id)).into());
                }
                return Err(if busy > 0 {
                    RouteError::AllOverloaded
                } else {
                    // Every reason with its count: the first candidate's reason alone can
                    // name allowed_worker_ids when the allowed workers were all draining.
                    let why: Vec<String> = [
                        (Ineligible::NotAllowed, "not in allowed_worker_ids"),
                        (Ineligible::MissingTaints, "without the required_taints"),
                        (Ineligible::Draining, "draining"),
                    ]
                    .iter()
                    .filter(|(r, _)| excluded_by[*r as usize] > 0)
                    .map(|(r, what)| format!("{} {what}", excluded_by[*r as usize]))
                    .collect();
                    RouteError::AllFiltered(why.join(", "))
                });
            }
            for (&i, l) in eligible_idx.iter().zip(loads.iter()) {
                let c = &pool[i as usize];
                let [d, h, k] = dense.get(c.slot);
                cols.worker_id.push(c.key.worker_id);
                cols.dp_rank.push(c.key.dp_rank);
                cols.device_overlap.push(d);
                cols.host_overlap.push(h);
                cols.disk_overlap.push(k);
                cols.active_prefill_tokens.push(l.active_prefill_tokens);
                cols.active_decode_blocks.push(l.active_decode_blocks);
                cols.active_requests.push(l.active_requests);
                cols.active_prompt_blocks.push(0);
                cols.total_kv_blocks.push(c.total_kv_blocks);
                cols.max_num_batched_tokens.push(c.max_num_batched_tokens);
                cols.taint_ids.extend_from_slice(&c.taint_ids);
                cols.taint_offsets.push(cols.taint_ids.len() as u32);
            }
            // Prompt blocks already active: few candidates have any; find each by binary search
            // over the (sorted) eligible keys.
            for &(key, depth) in depths.iter() {
                if let Ok(j) = eligible_idx.binary_search_by_key(&key, |&i| pool[i as usize].key) {
                    cols.active_prompt_blocks[j] = depth;
                }
            }

            let preq = PolicyRequest {
                request_id: p.request_id.clone(),
                prompt_tokens: p.prompt_tokens,
                request_blocks: p.local.len() as u32,
                block_size: self.config.block_size,
                preferred_taints: p
                    .req
                    .preferred_taints
                    .iter()
                    .filter_map(|(name, w)| snap.taint_id(name).map(|id| (id, *w)))
                    .collect(),
                priority: p.req.priority,
                expected_output_tokens: p.req.expected_output_tokens,
                temperature: p.temperature,
                session_id: p.req.session_id.clone(),
                now_ms: self.clock_ms(),
                ask_only: !p.req.book,
            };
            cost::fill_base_costs(&preq, cols, &self.config.cost);

            let tp = Instant::now();
            let scorer = self.scorer.load();
            let (label, outcome) = match scorer.as_deref() {
                Some(s) => {
                    let d = s.decide(&preq, cols, &snap.taints);
                    (d.label, d.outcome)
                }
                None => (self.native_label.clone(), ScorerOutcome::Native),
            };
            let n = cols.len();
            let mut answer = "native";
            let (chosen, fallback_reason) = self.with_rng(|rng| match outcome {
                ScorerOutcome::Costs(c) if c.len() == n && c.iter().all(|x| x.is_finite()) => {
                    let i = cost::pick(&c, p.temperature, rng).expect("n > 0");
                    *costs = c;
                    answer = "costs";
                    (i, None)
                }
                ScorerOutcome::Pick(i) if i < n => {
                    cost::native_costs(&preq, cols, costs);
                    answer = "pick";
                    (i, None)
                }
                other => {
                    cost::native_costs(&preq, cols, costs);
                    let reason = match other {
                        ScorerOutcome::Native => None,
                        ScorerOutcome::Fallback(r) => Some(r),
                        ScorerOutcome::Costs(_) => Some("invalid_answer"),
                        ScorerOutcome::Pick(_) => Some("pick_out_of_range"),
                    };
                    (
                        cost::pick(costs, p.temperature, rng).expect("n > 0"),
                        reason,
                    )
                }
            });
            let policy = tp.elapsed();
            if fallback_reason.is_some() {
                self.counters.fallbacks.fetch_add(1, Relaxed);
            }

            let candidate = cols.key(chosen);
            let overlap = cols.device_overlap[chosen];
            let cached_tokens =
                (overlap.saturating_mul(self.config.block_size)).min(p.prompt_tokens);
            if p.req.book {
                self.load
                    .lock()
                    .book(
                        &p.request_id,
                        candidate,
                        p.prompt_tokens,
                        cached_tokens,
                        &p.seq,
                        self.config.block_size,
                        Instant::now(),
                    )
                    .map_err(|e| match e {
                        LoadError::DuplicateRequest(id) | LoadError::UnknownRequest(id) => {
                            RouteError::DuplicateRequest(id)
                        }
                    })?;
                if let Some(a) = &self.approx {
                    a.record(&self.indexer, candidate, &p.local, Instant::now());
                }
            }
            let explain = p.req.explain.then(|| {
                (0..n)
                    .map(|i| ExplainRow {
                        worker_id: cols.worker_id[i],
                        dp_rank: cols.dp_rank[i],
                        overlap_blocks: cols.device_overlap[i],
                        host_overlap_blocks: cols.host_overlap[i],
                        disk_overlap_blocks: cols.disk_overlap[i],
                        active_prefill_tokens: cols.active_prefill_tokens[i],
                        active_decode_blocks: cols.active_decode_blocks[i],
                        active_requests: cols.active_requests[i],
                        taints: cols
                            .taints_of(i)
                            .iter()
                            .filter_map(|&t| snap.taint_name(t).map(str::to_string))
                            .collect(),
                        base_cost: cols.base_cost[i],
                        cost: costs[i],
                        chosen: i == chosen,
                    })
                    .collect()
            });
            let excluded = p.req.explain.then(|| {
                excluded_rows
                    .iter()
                    .map(|&(i, why, prefill)| {
                        let c = &pool[i as usize];
                        ExcludedRow {
                            worker_id: c.key.worker_id,
                            dp_rank: c.key.dp_rank,
                            reason: why.code(),
                            overlap_blocks: dense.get(c.slot)[0],
                            active_prefill_tokens: prefill,
                        }
                    })
                    .collect()
            });
            self.counters.decisions.fetch_add(1, Relaxed);
            Ok(RouteDecision {
                request_id: p.request_id.clone(),
                candidate,
                overlap_blocks: overlap,
                cached_tokens,
                policy: label,
                fallback: fallback_reason.is_some(),
                fallback_reason,
                queued,
                booked: p.req.book,
                answer: p.req.explain.then_some(answer),
                candidates: explain,
                excluded,
                timings: Timings {
                    hash: p.hash_time,
                    matching,
                    policy,
                    total: p.hash_time + t0.elapsed(),
                },
            })
        })
    }

    // ---- request lifecycle -----------------------------------------------------------------------

    /// The request's first token arrived: its prompt no longer loads the candidate.
    pub fn prefill_complete(&self, request_id: &str) -> Result<CandidateKey, LifecycleError> {
        // The load lock is released before `not_booked` takes the queue's.
        let r = self.load.lock().prefill_complete(request_id);
        let r = r.map_err(|_| self.not_booked(request_id))?;
        self.pump();
        Ok(r)
    }

    /// Output progress: total output tokens so far.
    pub fn output_progress(
        &self,
        request_id: &str,
        tokens: u32,
    ) -> Result<CandidateKey, LifecycleError> {
        let r = self.load.lock().output_progress(request_id, tokens);
        r.map_err(|_| self.not_booked(request_id))
    }

    /// Why a lifecycle call found no booking for `request_id`: queued, or unknown.
    fn not_booked(&self, request_id: &str) -> LifecycleError {
        if self.queue.lock().contains(request_id) {
            LifecycleError::Queued(request_id.into())
        } else {
            LifecycleError::UnknownRequest(request_id.into())
        }
    }

    /// The request is done or cancelled: release its booking, or take it out of the queue.
    pub fn free(&self, request_id: &str) -> Result<Option<Booking>, LifecycleError> {
        if let Some(entry) = self.queue.lock().cancel(request_id) {
            let _ = entry.payload.tx.send(Err(RouteError::Cancelled));
            return Ok(None);
        }
        let b = self
            .load
            .lock()
            .free(request_id)
            .map_err(|_| LifecycleError::UnknownRequest(request_id.into()))?;
        self.pump();
        Ok(Some(b))
    }

    /// Periodic maintenance: expires stale bookings and approximate blocks, then serves the queue.
    /// Call every few seconds (the server does).
    pub fn tick(&self, now: Instant) -> (usize, u64) {
        let expired = self.load.lock().expire(now).len();
        let blocks = self
            .approx
            .as_ref()
            .map_or(0, |a| a.expire(&self.indexer, now));
        self.pump();
        (expired, blocks)
    }

    /// Answers every waiting request with a retryable `shutting_down` error (graceful shutdown:
    /// waiting requests must not hold the process for the queue timeout).
    pub fn shutdown_queue(&self) -> usize {
        let drained = self.queue.lock().close();
        let n = drained.len();
        for e in drained {
            let _ = e.payload.tx.send(Err(RouteError::ShuttingDown));
        }
        n
    }

    /// Requests waiting and their prompt tokens.
    pub fn queue_depth(&self) -> (usize, u64) {
        let q = self.queue.lock();
        (q.len(), q.queued_tokens())
    }

    /// Bookings live now.
    pub fn active_bookings(&self) -> usize {
        self.load.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexer::{KvEventData, StoredBlock, Tier};

    fn router(cfg: RouterConfig) -> Router {
        Router::new(cfg).unwrap()
    }

    fn worker(taints: &[&str], mnbt: u32) -> WorkerSpec {
        WorkerSpec {
            taints: taints.iter().map(|s| s.to_string()).collect(),
            max_num_batched_tokens: mnbt,
            ..Default::default()
        }
    }

    fn prompt(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    /// Stores the first `blocks` blocks of `tokens` on a worker, as an engine would.
    fn store(r: &Router, w: WorkerId, tokens: &[u32], blocks: usize) {
        let local =
            hashing::local_block_hashes(tokens, r.config().block_size as usize, hashing::BASE_SEED);
        let ev = KvEvent {
            candidate: CandidateKey::new(w, 0),
            tier: Tier::Device,
            event_id: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: local[..blocks]
                    .iter()
                    .map(|&l| StoredBlock {
                        block_hash: l ^ 0xabc,
                        tokens_hash: l,
                    })
                    .collect(),
            },
        };
        r.apply_event(&ev).unwrap().unwrap();
    }

    fn ask(tokens: Vec<u32>) -> RouteRequest {
        RouteRequest {
            book: false,
            ..RouteRequest::tokens(tokens)
        }
    }

    #[test]
    fn a_seeded_router_breaks_ties_the_same_way_every_time() {
        // Eight idle workers tie on every unbooked decision: the pick is the random tie-break.
        let picks = |seed: Option<u64>| {
            let r = router(RouterConfig {
                rng_seed: seed,
                ..RouterConfig::default()
            });
            for w in 1..=8 {
                r.upsert_worker(w, worker(&[], 0)).unwrap();
            }
            (0..64)
                .map(|_| r.route_now(ask(prompt(64))).unwrap().candidate.worker_id)
                .collect::<Vec<_>>()
        };
        let a = picks(Some(42));
        assert_eq!(a, picks(Some(42)));
        assert_ne!(a, picks(Some(43)));
        // Ties are still spread: every worker is picked at least once in 64 draws.
        let distinct: FxHashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), 8, "{a:?}");
        // The OS-seeded default differs between routers (64 draws of 8: equal by chance ~8^-64).
        assert_ne!(picks(None), picks(None));
    }

    #[test]
    fn seeded_rng_is_splitmix64() {
        // Reference values of SplitMix64 (Vigna) from seed 0.
        let g = SeededRng::new(0);
        assert_eq!(g.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(g.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn routes_to_the_cached_worker_and_books_load() {
        let r = router(RouterConfig::default());
        for w in 1..=4 {
            r.upsert_worker(w, worker(&[], 0)).unwrap();
        }
        let p = prompt(256);
        store(&r, 3, &p, 16);
        let d = r.route_now(RouteRequest::tokens(p.clone())).unwrap();
        assert_eq!(d.candidate, CandidateKey::new(3, 0));
        assert_eq!(d.overlap_blocks, 16);
        assert_eq!(d.cached_tokens, 256);
        assert!(!d.fallback);
        assert_eq!(d.policy.name, "host-native");
        let l = r.load_of(CandidateKey::new(3, 0));
        assert_eq!(l.active_requests, 1);
        assert_eq!(l.active_decode_blocks, 16);
        assert_eq!(l.active_prefill_tokens, 0);
        // Lifecycle.
        r.prefill_complete(&d.request_id).unwrap();
        assert!(r.free(&d.request_id).unwrap().is_some());
        assert_eq!(
            r.free(&d.request_id).unwrap_err(),
            LifecycleError::UnknownRequest(d.request_id.clone())
        );
        assert_eq!(r.load_of(CandidateKey::new(3, 0)), CandidateLoad::default());
    }

    #[test]
    fn booked_load_spreads_uncached_requests() {
        let r = router(RouterConfig::default());
        for w in 1..=4 {
            r.upsert_worker(w, worker(&[], 0)).unwrap();
        }
        let mut seen = FxHashSet::default();
        for i in 0..4u32 {
            let tokens: Vec<u32> = (0..64).map(|t| t + i * 1000).collect();
            seen.insert(r.route_now(RouteRequest::tokens(tokens)).unwrap().candidate);
        }
        assert_eq!(
            seen.len(),
            4,
            "each idle worker gets one of four equal requests"
        );
    }

    #[test]
    fn ask_only_changes_nothing() {
        let r = router(RouterConfig::default());
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        let d = r
            .route_now(RouteRequest {
                request_id: Some("q".into()),
                ..ask(prompt(64))
            })
            .unwrap();
        assert!(!d.booked);
        assert_eq!(r.active_bookings(), 0);
        assert_eq!(r.load_of(d.candidate), CandidateLoad::default());
    }

    #[test]
    fn hard_constraints_filter_and_explain() {
        let r = router(RouterConfig::default());
        r.upsert_worker(1, worker(&["zone=a"], 0)).unwrap();
        r.upsert_worker(2, worker(&["zone=b", "gpu=h100"], 0))
            .unwrap();
        r.upsert_worker(3, worker(&["zone=b"], 0)).unwrap();
        let d = r
            .route_now(RouteRequest {
                required_taints: vec!["zone=b".into(), "gpu=h100".into()],
                explain: true,
                ..ask(prompt(32))
            })
            .unwrap();
        assert_eq!(d.candidate.worker_id, 2);
        let rows = d.candidates.unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(
            rows[0].taints,
            vec!["zone=b".to_string(), "gpu=h100".to_string()]
        );
        let d = r
            .route_now(RouteRequest {
                allowed_worker_ids: Some(vec![1, 3]),
                required_taints: vec!["zone=b".into()],
                ..ask(prompt(32))
            })
            .unwrap();
        assert_eq!(d.candidate.worker_id, 3);
        let e = r
            .route_now(RouteRequest {
                required_taints: vec!["zone=mars".into()],
                ..ask(prompt(32))
            })
            .unwrap_err();
        assert_eq!(e.code(), "all_filtered_by_constraints");
        assert_eq!(e.status(), 503);
        let e = r
            .route_now(RouteRequest {
                allowed_worker_ids: Some(vec![99]),
                ..ask(prompt(32))
            })
            .unwrap_err();
        assert_eq!(e.code(), "all_filtered_by_constraints");
        r.patch_worker(1, None, Some(true)).unwrap();
        let d = r
            .route_now(RouteRequest {
                allowed_worker_ids: Some(vec![1, 2]),
                required_taints: vec![],
                explain: true,
                ..ask(prompt(32))
            })
            .unwrap();
        assert_eq!(d.candidate.worker_id, 2, "draining worker 1 is skipped");
    }

    #[test]
    fn explain_names_each_excluded_candidate_and_the_rule() {
        let r = router(RouterConfig {
            busy_threshold: Some(0.5),
            ..Default::default()
        });
        r.upsert_worker(1, worker(&["zone=a"], 100)).unwrap();
        r.upsert_worker(2, worker(&["zone=b"], 100)).unwrap();
        r.upsert_worker(3, worker(&["zone=b"], 100)).unwrap();
        r.upsert_worker(4, worker(&["zone=b"], 100)).unwrap();
        r.patch_worker(4, None, Some(true)).unwrap();
        // 80 uncached prompt tokens on worker 3: over half of its 100 batched tokens.
        r.route_now(RouteRequest {
            pinned: Some(Pin {
                worker_id: 3,
                dp_rank: None,
            }),
            ..RouteRequest::tokens(prompt(80))
        })
        .unwrap();
        let d = r
            .route_now(RouteRequest {
                allowed_worker_ids: Some(vec![2, 3, 4]),
                required_taints: vec!["zone=b".into()],
                explain: true,
                ..ask(prompt(32))
            })
            .unwrap();
        assert_eq!(d.candidate.worker_id, 2);
        let row = |w, reason, prefill| ExcludedRow {
            worker_id: w,
            dp_rank: 0,
            reason,
            overlap_blocks: 0,
            active_prefill_tokens: prefill,
        };
        assert_eq!(
            d.excluded.unwrap(),
            [
                row(1, "not_allowed", 0),
                row(3, "busy", 80),
                row(4, "draining", 0)
            ]
        );
        // Without explain nothing is collected.
        let d = r.route_now(ask(prompt(32))).unwrap();
        assert!(d.excluded.is_none() && d.candidates.is_none());
    }

    #[test]
    fn pin_errors_in_spec_order() {
        let r = router(RouterConfig {
            busy_threshold: Some(0.5),
            ..Default::default()
        });
        r.upsert_worker(1, worker(&["zone=a"], 100)).unwrap();
        r.upsert_worker(
            2,
            WorkerSpec {
                dp_size: 2,
                ..worker(&["zone=b"], 100)
            },
        )
        .unwrap();
        let pin = |w, rank| RouteRequest {
            pinned: Some(Pin {
                worker_id: w,
                dp_rank: rank,
            }),
            ..ask(prompt(32))
        };
        let code = |req: RouteRequest| {
            let e = r.route_now(req).unwrap_err();
            (e.status(), e.code())
        };
        assert_eq!(
            code(RouteRequest {
                allowed_worker_ids: Some(vec![2]),
                ..pin(1, None)
            }),
            (400, "pinned_worker_not_allowed")
        );
        assert_eq!(code(pin(9, None)), (404, "pinned_worker_not_found"));
        assert_eq!(code(pin(2, Some(5))), (400, "pinned_rank_not_found"));
        assert_eq!(
            code(RouteRequest {
                required_taints: vec!["zone=a".into()],
                ..pin(2, None)
            }),
            (409, "pinned_worker_missing_taints")
        );
        let d = r.route_now(pin(2, Some(1))).unwrap();
        assert_eq!(d.candidate, CandidateKey::new(2, 1));
        // Overload worker 1 (book 80 uncached tokens > 0.5 × 100).
        r.route_now(RouteRequest {
            request_id: Some("big".into()),
            ..RouteRequest {
                book: true,
                ..pin(1, None)
            }
        })
        .unwrap();
        let r80 = r.route_now(RouteRequest {
            request_id: Some("big2".into()),
            prompt: Prompt::Tokens((1000..1080).collect()),
            ..RouteRequest {
                book: true,
                ..pin(1, None)
            }
        });
        assert!(r80.is_ok());
        let e = r.route_now(pin(1, None)).unwrap_err();
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (429, "pinned_worker_overloaded", true)
        );
    }

    #[test]
    fn no_workers_and_bad_input() {
        let r = router(RouterConfig::default());
        assert_eq!(
            r.route_now(ask(prompt(16))).unwrap_err().code(),
            "no_workers"
        );
        // A pin to a worker that does not exist is 404 even when none does (API.md).
        let e = r
            .route_now(RouteRequest {
                pinned: Some(Pin {
                    worker_id: 3,
                    dp_rank: None,
                }),
                ..ask(prompt(16))
            })
            .unwrap_err();
        assert_eq!((e.status(), e.code()), (404, "pinned_worker_not_found"));
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        let bad = |req: RouteRequest| r.route_now(req).unwrap_err();
        let e = bad(ask(vec![]));
        assert_eq!((e.status(), e.field()), (400, Some("tokens")));
        let e = bad(RouteRequest {
            preferred_taints: vec![("fast".into(), 1.0)],
            ..ask(prompt(16))
        });
        assert_eq!(e.field(), Some("routing_constraints.preferred_taints.fast"));
        let e = bad(RouteRequest {
            preferred_taints: vec![("fast".into(), f32::NAN)],
            ..ask(prompt(16))
        });
        assert_eq!(e.status(), 400);
        let e = bad(RouteRequest {
            temperature: Some(-1.0),
            ..ask(prompt(16))
        });
        assert_eq!(e.field(), Some("temperature"));
        let e = bad(RouteRequest {
            prompt: Prompt::BlockHashes(vec![]),
            ..ask(vec![])
        });
        assert_eq!(e.field(), Some("block_hashes"));
        // Duplicate ids while booked.
        let d = r
            .route_now(RouteRequest {
                request_id: Some("dup".into()),
                ..RouteRequest::tokens(prompt(16))
            })
            .unwrap();
        let e = bad(RouteRequest {
            request_id: Some("dup".into()),
            ..RouteRequest::tokens(prompt(16))
        });
        assert_eq!((e.status(), e.code()), (409, "duplicate_request_id"));
        r.free(&d.request_id).unwrap();
    }

    #[test]
    fn block_hash_prompts_match_token_prompts() {
        let r = router(RouterConfig::default());
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        r.upsert_worker(2, worker(&[], 0)).unwrap();
        let p = prompt(160);
        store(&r, 2, &p, 10);
        let local = hashing::local_block_hashes(&p, 16, hashing::BASE_SEED);
        let d = r
            .route_now(RouteRequest {
                prompt: Prompt::BlockHashes(local),
                ..ask(vec![])
            })
            .unwrap();
        assert_eq!((d.candidate.worker_id, d.overlap_blocks), (2, 10));
        let (blocks, o) = r.overlap(&Prompt::Tokens(p), None, None).unwrap();
        assert_eq!(blocks, 10);
        assert_eq!(o.device, vec![(CandidateKey::new(2, 0), 10)]);
    }

    struct FixedScorer(ScorerOutcome);
    impl Scorer for FixedScorer {
        fn decide(
            &self,
            _: &PolicyRequest,
            _: &CandidateColumns,
            _: &TaintNames,
        ) -> ScorerDecision {
            ScorerDecision {
                outcome: self.0.clone(),
                label: Arc::new(PolicyLabel {
                    name: "fixed".into(),
                    version: 1,
                    digest: "d".into(),
                }),
            }
        }
    }

    #[test]
    fn scorer_answers_are_used_or_fall_back() {
        let r = router(RouterConfig::default());
        for w in 1..=3 {
            r.upsert_worker(w, worker(&[], 0)).unwrap();
        }
        r.set_scorer(Some(Box::new(FixedScorer(ScorerOutcome::Costs(vec![
            5.0, 1.0, 3.0,
        ])))));
        let d = r.route_now(ask(prompt(32))).unwrap();
        assert_eq!(
            (d.candidate.worker_id, d.fallback, d.policy.name.as_str()),
            (2, false, "fixed")
        );
        r.set_scorer(Some(Box::new(FixedScorer(ScorerOutcome::Pick(2)))));
        assert_eq!(r.route_now(ask(prompt(32))).unwrap().candidate.worker_id, 3);
        for bad in [
            ScorerOutcome::Costs(vec![1.0]),
            ScorerOutcome::Costs(vec![1.0, f64::NAN, 2.0]),
            ScorerOutcome::Pick(7),
            ScorerOutcome::Fallback("trap"),
        ] {
            r.set_scorer(Some(Box::new(FixedScorer(bad))));
            let d = r.route_now(ask(prompt(32))).unwrap();
            assert!(d.fallback);
        }
        assert_eq!(r.counters.fallbacks.load(Relaxed), 4);
    }

    #[test]
    fn approximate_mode_indexes_its_own_decisions() {
        let r = router(RouterConfig {
            approx: Some(ApproxConfig::default()),
            ..Default::default()
        });
        for w in 1..=4 {
            r.upsert_worker(w, worker(&[], 0)).unwrap();
        }
        let p = prompt(512);
        let first = r.route_now(RouteRequest::tokens(p.clone())).unwrap();
        r.free(&first.request_id).unwrap();
        let again = r.route_now(ask(p)).unwrap();
        assert_eq!(again.candidate, first.candidate);
        assert_eq!(again.overlap_blocks, 32);
        r.remove_worker(first.candidate.worker_id).unwrap();
        assert_eq!(r.indexer().stats().held_blocks[0], 0);
    }

    /// A router with queueing on and its one worker made busy by a booked 96-token "hog"
    /// (96 > 0.5 × 100).
    async fn busy_fleet(
        order: QueueOrder,
        queue_timeout: Duration,
    ) -> (Arc<Router>, RouteDecision) {
        let r = Arc::new(router(RouterConfig {
            busy_threshold: Some(0.5),
            queue_order: order,
            queue_timeout,
            ..Default::default()
        }));
        r.upsert_worker(1, worker(&[], 100)).unwrap();
        let hog = r
            .route(RouteRequest {
                request_id: Some("hog".into()),
                ..RouteRequest::tokens(prompt(96))
            })
            .await
            .unwrap();
        (r, hog)
    }

    /// Routes `tokens` as `id` on a task of its own and returns once the request is queued
    /// (the queue then holds `depth` requests).
    async fn spawn_queued(
        r: &Arc<Router>,
        id: &str,
        tokens: Vec<u32>,
        depth: usize,
    ) -> tokio::task::JoinHandle<Result<RouteDecision, RouteError>> {
        let r2 = r.clone();
        let id = id.to_string();
        let task = tokio::spawn(async move {
            r2.route(RouteRequest {
                request_id: Some(id),
                ..RouteRequest::tokens(tokens)
            })
            .await
        });
        while r.queue_depth().0 < depth {
            tokio::task::yield_now().await;
        }
        task
    }

    #[tokio::test]
    async fn busy_fleet_queues_and_wakes_on_capacity() {
        let (r, hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(5)).await;
        // The worker is now busy (96 > 50): the next two wait, in order.
        // Each enqueues before the next arrives (FCFS).
        let mut waiters = vec![];
        for i in 0..2u32 {
            let tokens = (0..16).map(|t| t + 100 * i).collect();
            waiters.push(spawn_queued(&r, &format!("w{i}"), tokens, i as usize + 1).await);
        }
        assert_eq!(r.queue_depth(), (2, 32));
        // Ask-only requests never wait: they see the overload.
        assert_eq!(
            r.route(ask(prompt(16))).await.unwrap_err().code(),
            "all_overloaded"
        );
        r.prefill_complete(&hog.request_id).unwrap();
        let a = waiters.remove(0).await.unwrap().unwrap();
        let b = waiters.remove(0).await.unwrap().unwrap();
        assert_eq!((a.request_id.as_str(), b.request_id.as_str()), ("w0", "w1"));
        assert!(a.queued > Duration::ZERO);
        assert_eq!(r.queue_depth(), (0, 0));
    }

    #[tokio::test]
    async fn after_shutdown_the_queue_refuses_instead_of_holding_requests() {
        let (r, _hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(30)).await;
        let waiter = spawn_queued(&r, "early", prompt(16), 1).await;
        assert_eq!(r.shutdown_queue(), 1);
        assert_eq!(waiter.await.unwrap().unwrap_err().code(), "shutting_down");
        // A request that arrives after the drain (its body was still coming in) is refused at
        // once: nobody would ever serve the queue again.
        let late = tokio::time::timeout(
            Duration::from_secs(5),
            r.route(RouteRequest::tokens(prompt(16))),
        )
        .await
        .expect("answered at once, not after the queue timeout");
        assert_eq!(late.unwrap_err().code(), "shutting_down");
        assert_eq!(r.queue_depth().0, 0);
    }

    #[tokio::test]
    async fn wspt_serves_the_waiter_with_the_most_cached_first() {
        let (r, hog) = busy_fleet(QueueOrder::Wspt, Duration::from_secs(5)).await;
        let b = r.config().block_size;
        let uncached: Vec<u32> = (0..8 * b).map(|t| 1000 + t).collect();
        let cached: Vec<u32> = (0..8 * b).map(|t| 2000 + t).collect();
        store(&r, 1, &cached, 3);
        // Same length, same priority; the uncached one arrives first.
        let mut waiters = vec![spawn_queued(&r, "uncached", uncached, 1).await];
        waiters.push(spawn_queued(&r, "cached", cached, 2).await);
        // Each one served keeps the worker busy (128 - 48 and 128 uncached tokens > 50): one at a
        // time.
        r.prefill_complete(&hog.request_id).unwrap();
        let second = waiters.remove(0);
        let first = waiters.remove(0).await.unwrap().unwrap();
        assert_eq!(first.request_id, "cached", "1/(128-48) beats 1/128");
        assert_eq!(r.queue_depth().0, 1, "the uncached one still waits");
        r.prefill_complete(&first.request_id).unwrap();
        assert_eq!(second.await.unwrap().unwrap().request_id, "uncached");
    }

    #[tokio::test]
    async fn a_waiter_whose_caller_goes_away_leaves_the_queue_at_once() {
        let (r, hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(30)).await;
        let waiter = spawn_queued(&r, "gone", prompt(16), 1).await;
        // The caller goes away (an HTTP client disconnecting drops its handler the same way).
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        assert_eq!(r.queue_depth(), (0, 0), "out of the queue at once");
        // Its id is free: the same id routes once there is room, with nothing else booked.
        r.prefill_complete(&hog.request_id).unwrap();
        let again = r
            .route(RouteRequest {
                request_id: Some("gone".into()),
                ..RouteRequest::tokens(prompt(16))
            })
            .await
            .unwrap();
        assert_eq!(again.request_id, "gone");
        assert_eq!(r.active_bookings(), 2);
    }

    #[tokio::test]
    async fn queue_limits_cancellation_and_timeout() {
        let r = Arc::new(router(RouterConfig {
            busy_threshold: Some(0.5),
            queue_limits: QueueLimits {
                max_requests_per_worker: 1,
                max_tokens_per_worker: 1000,
            },
            queue_timeout: Duration::from_millis(200),
            ..Default::default()
        }));
        r.upsert_worker(1, worker(&[], 100)).unwrap();
        r.route(RouteRequest::tokens(prompt(96))).await.unwrap();
        let waiting = spawn_queued(&r, "wait", prompt(16), 1).await;
        let full = r.route(RouteRequest::tokens(prompt(16))).await.unwrap_err();
        assert_eq!(
            (full.status(), full.code(), full.retryable()),
            (429, "queue_requests", true)
        );
        // Cancel the waiting one.
        assert!(r.free("wait").unwrap().is_none());
        assert_eq!(
            waiting.await.unwrap().unwrap_err().code(),
            "request_cancelled"
        );
        // A lone waiter times out and leaves the queue.
        let e = r.route(RouteRequest::tokens(prompt(16))).await.unwrap_err();
        assert_eq!(
            (e.status(), e.code(), e.retryable()),
            (429, "queue_timeout", true)
        );
        assert_eq!(r.queue_depth().0, 0);
    }

    #[test]
    fn removing_a_worker_removes_its_load_and_index() {
        let r = router(RouterConfig::default());
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        let p = prompt(64);
        store(&r, 1, &p, 4);
        let d = r.route_now(RouteRequest::tokens(p)).unwrap();
        r.remove_worker(1).unwrap();
        assert_eq!(r.active_bookings(), 0);
        assert!(r.free(&d.request_id).is_err());
        assert_eq!(r.indexer().stats().held_blocks[0], 0);
        // Events of unknown workers are dropped and counted.
        let ev = KvEvent {
            candidate: CandidateKey::new(1, 0),
            tier: Tier::Device,
            event_id: 0,
            data: KvEventData::Cleared,
        };
        assert_eq!(r.apply_event(&ev), Ok(None));
        assert_eq!(r.counters.events_unknown_worker.load(Relaxed), 1);
    }

    #[test]
    fn an_event_that_lost_the_race_with_a_removal_leaves_nothing_behind() {
        let r = router(RouterConfig::default());
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        let p = prompt(64);
        let local =
            hashing::local_block_hashes(&p, r.config().block_size as usize, hashing::BASE_SEED);
        let root_store = KvEvent {
            candidate: CandidateKey::new(1, 0),
            tier: Tier::Device,
            event_id: 0,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: 7,
                    tokens_hash: local[0],
                }],
            },
        };
        // The router checked its registry (worker 1 present), then the worker was removed before
        // the event reached the index: what `apply_event` does after its check.
        r.remove_worker(1).unwrap();
        assert_eq!(r.indexer().apply_to_known(&root_store), Ok(None));
        assert_eq!(r.indexer().existing_slot(CandidateKey::new(1, 0)), None);
        // The same id registered again starts empty.
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        assert!(r
            .overlap(&Prompt::Tokens(p), None, None)
            .unwrap()
            .1
            .device
            .is_empty());
    }
}
