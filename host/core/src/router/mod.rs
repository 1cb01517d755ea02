//! The router: the one entry point callers use — `route(request) → decision | error`.
//!
//! A decision runs, in order: validate and hash the prompt ([`crate::hashing`], in [`request`]);
//! take a registry snapshot ([`crate::workers`]); resolve the hard constraints and the pin
//! ([`crate::eligibility`]); read every candidate's overlaps from the index ([`crate::indexer`])
//! and load from the tracker ([`crate::load`]); build the candidate columns of the eligible ones;
//! compute the native base cost ([`crate::cost`]); ask the active policy ([`Scorer`]) for costs or a
//! pick, falling back to the native cost on any failure; pick; book ([`decide`] has these steps).
//! When a busy threshold is set and every eligible candidate is busy, the request waits in the
//! [`crate::queue`] and is scored afresh when capacity frees up ([`admission`]). In a
//! disaggregated fleet a decision is two such steps, a prefill worker then a decode worker, with the
//! KV transfer's constraint merged in between ([`disagg`]); one request id then holds two bookings
//! ([`booking`]).
//!
//! The router holds no lock across the policy call: the registry is a lock-free snapshot, the index
//! is read under its read lock only while matching, and the load tracker's mutex is taken once to
//! read loads and once to book. Per-thread scratch buffers make a decision allocation-light.
//!
//! Errors carry stable codes ([`RouteError::code`]) and the field at fault; what they mean in HTTP
//! (status, `Retry-After`) is the server's business, not the core's.

mod admission;
mod affinity;
#[cfg(test)]
mod affinity_tests;
mod booking;
mod decide;
pub mod disagg;
mod explain;
pub mod overlap_source;
#[cfg(test)]
mod predict_tests;
pub mod replicas;
mod request;
mod step;
pub mod tenants;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

pub use disagg::config::{BypassRule, DisaggConfig, KvTransferEnforcement};
pub use disagg::rules::TopologyConstraints;
pub use explain::{ExcludedRow, ExplainRow};
pub use overlap_source::{
    CandidateOverlap, OverlapFuture, OverlapOrigin, OverlapSource, OverlapSourceError,
};
pub use replicas::{
    BookedHalf, BookedSession, BookingEvent, BookingObserver, BookingRecord, MoveBookingError,
    OriginBookings, RemoteBookingError,
};
pub use request::{preferred_taint_weight, DisaggMode, Pin, Prompt, RouteRequest};

use crate::budget::{Budgets, OverBudget, TenantBudget};
use crate::candidate::{CandidateColumns, CandidateKey, PolicyRequest, WorkerId};
use crate::cost::CostWeights;
use crate::eligibility::{BusyRule, PinError, WorkerMissingTaints};
use crate::feeds::{FeedConfig, Feeds};
use crate::indexer::approx::{ApproxConfig, ApproxIndexer};
use crate::indexer::{Applied, ApplyError, Indexer, KvEvent, KvEventData, OverlapScores};
use crate::learn::{Learned, StepTimes};
use crate::load::{Booking, CandidateLoad, LoadConfig, LoadTracker};
use crate::predict::{PredictConfig, PredictStats, Predictions};
use crate::queue::{FairConfig, PendingQueue, QueueError, QueueLimits, QueueOrder};
use crate::rng::{SeededRef, SeededRng};
use crate::sessions::{SessionConfig, Sessions};
pub use crate::stage::Stage;
use crate::workers::{
    Registry, RegistryLimits, SpecError, TaintNames, Worker, WorkerPatch, WorkerSpec,
};

use admission::Waiter;

/// Settings of the routing core.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Tokens per KV block; must match the engines'.
    pub block_size: u32,
    /// Busy threshold as a fraction of `max_num_batched_tokens`; `None` = queueing off.
    pub busy_threshold: Option<f64>,
    pub queue_order: QueueOrder,
    pub queue_limits: QueueLimits,
    /// Fair queueing (`[fairness] queue = true`): each class served least attained service first,
    /// by tenant then session ([`crate::queue`], "Fairness"). `None`: the plain order.
    pub fairness: Option<FairConfig>,
    /// Per-tenant budgets ([`crate::budget`]).
    pub budgets: rustc_hash::FxHashMap<String, TenantBudget>,
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
    /// What a dead KV event feed means for routing, and when a feed is dead ([`crate::feeds`]).
    pub feeds: FeedConfig,
    /// Disaggregated prefill/decode routing (`[disaggregation]`).
    pub disagg: DisaggConfig,
    /// Predict-on-route ([`crate::predict`]): a booked prompt counts as cached on its candidate
    /// for a TTL, max-combined with the event index. `None`: off.
    pub predict: Option<PredictConfig>,
    /// Session bindings ([`crate::sessions`], `[sessions]`).
    pub sessions: SessionConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            busy_threshold: None,
            queue_order: QueueOrder::Fcfs,
            queue_limits: QueueLimits::default(),
            fairness: None,
            budgets: Default::default(),
            queue_timeout: Duration::from_secs(30),
            load: LoadConfig::default(),
            approx: None,
            cost: CostWeights::default(),
            default_temperature: 0.0,
            max_prompt_tokens: 1 << 20,
            registry: RegistryLimits::default(),
            rng_seed: None,
            feeds: FeedConfig::default(),
            disagg: DisaggConfig::default(),
            predict: None,
            sessions: SessionConfig::default(),
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
    /// The policy that would decide reads the `base_cost` column, which the router left empty
    /// (it asked [`Scorer::reads_base_cost`] before a policy that reads it took over): nothing
    /// ran and nothing was counted; fill the column and ask again.
    NeedsBaseCost,
}

/// A policy's answer and the version that gave it.
#[derive(Clone, Debug)]
pub struct ScorerDecision {
    pub outcome: ScorerOutcome,
    pub label: Arc<PolicyLabel>,
}

/// Soft scoring: what the router asks of the active policy. The Wasm policy runtime implements it;
/// tests implement it natively. `stage` says which decision it is: a disaggregated request asks
/// once for its prefill worker and once for its decode worker.
pub trait Scorer: Send + Sync {
    /// Ranks `candidates` for `request` at `stage` (which half of the decision is asked about:
    /// [`Stage::Aggregated`] for a one-step decision).
    fn decide(
        &self,
        request: &PolicyRequest,
        candidates: &CandidateColumns,
        taints: &TaintNames,
        stage: Stage,
    ) -> ScorerDecision;

    /// Whether the next decision needs `candidates.base_cost` filled (the host's native cost,
    /// about 4–5 ns per candidate). A scorer that ranks candidates on its own figures answers
    /// false, and the router leaves the column empty; one whose answer may change between this
    /// call and [`Scorer::decide`] answers [`ScorerOutcome::NeedsBaseCost`] there when it finds
    /// the column empty.
    fn reads_base_cost(&self) -> bool {
        true
    }
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
    /// Where the overlaps came from: the router's own index, a remote one, or nowhere (the
    /// remote indexer failed; every candidate had zero overlap).
    pub overlap_source: OverlapOrigin,
    pub cached_tokens: u32,
    /// The prompt's length in tokens (`cached_tokens` of it are cached on the candidate).
    pub prompt_tokens: u32,
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
    /// The request was split: `prefill` computes the prompt, `candidate` decodes.
    pub disaggregated: bool,
    /// The prefill half, when disaggregated.
    pub prefill: Option<PrefillPlacement>,
    /// The bypass rule that kept the prefill on the decode worker (`isl_bounding`,
    /// `prefill_load`), when one did.
    pub bypass: Option<&'static str>,
    /// The decode step's constraints from the KV transfer, as merged (when disaggregated).
    pub topology_constraints: Option<TopologyConstraints>,
    /// Disaggregated with a transfer domain configured: whether the decode worker is outside the
    /// prefill worker's domain (`None`: not disaggregated, or no domain to compare).
    pub cross_domain: Option<bool>,
}

/// Where a disaggregated request's prompt is computed, and how that step was decided.
#[derive(Clone, Debug)]
pub struct PrefillPlacement {
    pub candidate: CandidateKey,
    pub overlap_blocks: u32,
    pub cached_tokens: u32,
    pub policy: Arc<PolicyLabel>,
    pub fallback_reason: Option<&'static str>,
    /// With `explain`, as for the decode step.
    pub answer: Option<&'static str>,
    pub candidates: Option<Vec<ExplainRow>>,
    pub excluded: Option<Vec<ExcludedRow>>,
}

/// Why a request was not routed. Each variant has a stable code; the server maps it to an HTTP
/// status.
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
    /// Nobody passed the hard rules: `reasons` counts the candidates by rule (naming, for the
    /// required taints, which taints each worker lacks); `missing_taints` is that last part as data.
    #[error("no candidate is eligible: {reasons}")]
    AllFiltered {
        reasons: String,
        missing_taints: Vec<WorkerMissingTaints>,
    },
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
    /// The request's tenant is over a budget ([`crate::budget`]): retry after
    /// `retry_after_secs`.
    #[error(transparent)]
    OverBudget(OverBudget),
    /// Disaggregation was required (by the request or `[disaggregation] enforce`) and no worker
    /// may take the prefill step.
    #[error("no prefill worker is eligible ({0}) and disaggregation is required")]
    NoPrefillWorker(String),
    /// The KV transfer requires a domain no eligible decode worker is in. Nothing was booked.
    #[error("no decode worker is eligible in the prefill worker's domain: none has the required taint {taint:?}")]
    NoDecodeWorkerInDomain { taint: String },
    /// The chosen prefill worker has no value for the transfer domain whose enforcement is
    /// `required`: the decode worker's domain cannot be derived, so the request fails closed.
    #[error("prefill worker {worker_id} has no topology value for the required kv_transfer_domain {domain:?}")]
    KvTransferDomainUnknown { worker_id: WorkerId, domain: String },
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
                PinError::FeedDead(_) => "pinned_worker_feed_dead",
                PinError::Overloaded(_) => "pinned_worker_overloaded",
                PinError::WrongRole(_) => "pinned_worker_wrong_role",
            },
            RouteError::NoWorkers => "no_workers",
            RouteError::AllFiltered { .. } => "all_filtered_by_constraints",
            RouteError::AllOverloaded => "all_overloaded",
            RouteError::QueueFull(QueueError::Full { limit, .. }) => limit.as_str(),
            RouteError::QueueFull(QueueError::DuplicateRequest(_)) => "duplicate_request_id",
            RouteError::QueueTimeout(_) => "queue_timeout",
            RouteError::Cancelled => "request_cancelled",
            RouteError::ShuttingDown => "shutting_down",
            RouteError::OverBudget(_) => "budget_exceeded",
            RouteError::NoPrefillWorker(_) => "no_prefill_worker",
            RouteError::NoDecodeWorkerInDomain { .. } => "no_decode_worker_in_domain",
            RouteError::KvTransferDomainUnknown { .. } => "kv_transfer_domain_unknown",
        }
    }

    /// Whether retrying the same request later may succeed: the fleet was busy, the queue full, or
    /// this router shutting down (the server answers these with `Retry-After`).
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            RouteError::AllOverloaded
                | RouteError::QueueFull(QueueError::Full { .. })
                | RouteError::QueueTimeout(_)
                | RouteError::ShuttingDown
                | RouteError::OverBudget(_)
                | RouteError::Pin(PinError::Overloaded(_))
        )
    }

    /// The workers the request's required taints kept out and the taints each lacks, when that is
    /// (part of) why it was refused.
    pub fn missing_taints(&self) -> &[WorkerMissingTaints] {
        match self {
            RouteError::AllFiltered { missing_taints, .. } => missing_taints,
            RouteError::Pin(PinError::MissingTaints(w)) => std::slice::from_ref(w),
            _ => &[],
        }
    }

    /// The request field at fault, when one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            RouteError::Invalid { field, .. } => Some(field),
            RouteError::DuplicateRequest(_) => Some("request_id"),
            RouteError::Pin(_) => Some("pinned_worker"),
            RouteError::OverBudget(_) => Some("tenant"),
            _ => None,
        }
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

impl LifecycleError {
    /// The stable snake_case code (API.md error body).
    pub fn code(&self) -> &'static str {
        match self {
            LifecycleError::UnknownRequest(_) => "unknown_request",
            LifecycleError::Queued(_) => "request_queued",
        }
    }
}

thread_local! {
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
    budgets: Mutex<Budgets>,
    scorer: ArcSwapOption<Box<dyn Scorer>>,
    native_label: Arc<PolicyLabel>,
    /// `Some` when `config.rng_seed` is set; otherwise the per-thread OS-seeded `RNG`.
    seeded_rng: Option<SeededRng>,
    epoch: Instant,
    /// Predictions of routed prompts (`config.predict`).
    predictions: Option<Predictions>,
    /// Each worker's learned step times ([`crate::learn`]).
    step_times: Mutex<StepTimes>,
    /// The learned figures decisions read (`[prefill ms per token, decode step ms]` per worker),
    /// republished by a lifecycle call that changes a worker's fit: decisions take only its read
    /// lock, never the fit's mutex.
    learned_cols: parking_lot::RwLock<rustc_hash::FxHashMap<WorkerId, [f64; 2]>>,
    /// The router's own clock in microseconds when a simulator sets it (`u64::MAX`: the
    /// monotonic wall clock since `epoch`): what predictions expire and step times are timed by.
    clock_us: AtomicU64,
    /// The clock policies see (`request.now-ms`): `u64::MAX` = the wall clock; anything else is a
    /// time set by [`Router::set_clock_ms`] (the replay simulator's time).
    clock_ms: AtomicU64,
    feeds: Feeds,
    /// Where `route` reads overlaps when not from `indexer` (`kvroute serve --remote-indexer`).
    overlap_source: ArcSwapOption<Arc<dyn OverlapSource>>,
    /// Told of every change to this router's own bookings (cluster mode: [`replicas`]).
    booking_observer: ArcSwapOption<Box<dyn BookingObserver>>,
    /// Session bindings: host state, so they outlive any policy swap.
    sessions: Sessions,
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
        self.set_clock_us(ms.map(|m| m.saturating_mul(1000)));
    }

    /// [`Router::set_clock_ms`] to the microsecond (a simulator's time): policies see it in whole
    /// milliseconds; predictions and learned step times run on it.
    pub fn set_clock_us(&self, us: Option<u64>) {
        self.clock_ms.store(
            us.map_or(u64::MAX, |u| (u / 1000).min(u64::MAX - 1)),
            Relaxed,
        );
        self.clock_us
            .store(us.map_or(u64::MAX, |u| u.min(u64::MAX - 1)), Relaxed);
    }

    /// The router's own clock in microseconds: the simulator's when set, else monotonic time
    /// since the router started.
    pub(crate) fn now_us(&self) -> u64 {
        match self.clock_us.load(Relaxed) {
            u64::MAX => self.epoch.elapsed().as_micros() as u64,
            us => us,
        }
    }

    /// The router's clock in seconds (what budgets and fair queueing's service run on).
    pub(crate) fn clock_secs(&self) -> f64 {
        self.now_us() as f64 / 1e6
    }

    /// Republishes a worker's learned figures for decisions after its fit changed.
    fn publish_learned(&self, st: &StepTimes, changed: Option<WorkerId>) {
        let Some(w) = changed else {
            return;
        };
        let l = st.learned(w);
        let figures = [l.prefill_ms_per_token, l.decode_step_ms];
        if figures != [0.0, 0.0] {
            self.learned_cols.write().insert(w, figures);
        }
    }

    /// A worker's learned step times (zeros until learned).
    pub fn learned(&self, worker_id: WorkerId) -> Learned {
        self.step_times.lock().learned(worker_id)
    }

    /// Predict-on-route's statistics (`None` when it is off).
    pub fn prediction_stats(&self) -> Option<PredictStats> {
        self.predictions.as_ref().map(Predictions::stats)
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
        config
            .disagg
            .validate()
            .map_err(|e| format!("disaggregation.{e}"))?;
        if let Some(f) = &config.fairness {
            f.validate()?;
        }
        let mut names: Vec<&String> = config.budgets.keys().collect();
        names.sort();
        for name in names {
            let b = config.budgets[name];
            for (key, v) in [
                ("requests_per_minute", b.requests_per_minute),
                ("tokens_per_minute", b.tokens_per_minute),
            ] {
                if v == Some(0) {
                    return Err(format!(
                        "fairness.tenants.{name}.{key} must be at least 1 (leave it out for no limit)"
                    ));
                }
            }
        }
        let queue = match &config.fairness {
            Some(f) => PendingQueue::fair(config.queue_order, config.queue_limits, f.clone()),
            None => PendingQueue::new(config.queue_order, config.queue_limits),
        };
        config.sessions.validate()?;
        Ok(Self {
            busy: BusyRule {
                threshold_frac: config.busy_threshold,
            },
            indexer: Arc::new(Indexer::new()),
            approx: config.approx.map(ApproxIndexer::new),
            registry: Registry::new(config.registry),
            load: Mutex::new(LoadTracker::new(config.load)),
            queue: Mutex::new(queue),
            budgets: Mutex::new(Budgets::new(config.budgets.clone())),
            scorer: ArcSwapOption::empty(),
            native_label: PolicyLabel::native(),
            seeded_rng: config.rng_seed.map(SeededRng::new),
            epoch: Instant::now(),
            predictions: config.predict.map(Predictions::new),
            step_times: Mutex::new(StepTimes::default()),
            learned_cols: Default::default(),
            clock_us: AtomicU64::new(u64::MAX),
            clock_ms: AtomicU64::new(u64::MAX),
            feeds: Feeds::new(config.feeds),
            overlap_source: ArcSwapOption::empty(),
            booking_observer: ArcSwapOption::empty(),
            sessions: Sessions::new(config.sessions),
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

    /// The session bindings ([`crate::sessions`]).
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The router's clock in microseconds (what session bindings are aged by).
    pub fn clock_us(&self) -> u64 {
        self.now_us()
    }

    /// The KV event feeds' health (written by the event ingestion).
    pub fn feeds(&self) -> &Feeds {
        &self.feeds
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
                if let Some(p) = &self.predictions {
                    p.remove_candidate(k);
                }
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

    /// Applies a [`WorkerPatch`] (taints, draining, role, topology), all or nothing. `Ok(None)`
    /// for an unknown worker.
    pub fn patch_worker_with(
        &self,
        worker_id: WorkerId,
        patch: WorkerPatch,
    ) -> Result<Option<Worker>, SpecError> {
        let w = self.registry.patch_with(worker_id, patch, &self.indexer)?;
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
        if let Some(p) = &self.predictions {
            p.remove_worker(worker_id);
        }
        self.step_times.lock().remove_worker(worker_id);
        self.learned_cols.write().remove(&worker_id);
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
        if let Some(p) = &self.predictions {
            self.check_predictions(p, event);
        }
        let applied = self.indexer.apply_to_known(event)?;
        if applied.is_none() {
            // Removed since the snapshot above was taken.
            self.counters.events_unknown_worker.fetch_add(1, Relaxed);
        }
        Ok(applied)
    }

    /// What a device-tier event says of the predictions on its candidate: stored blocks confirm,
    /// removed ones contradict (looked up before the event takes them out of the index), a clear
    /// drops them all.
    fn check_predictions(&self, p: &Predictions, event: &KvEvent) {
        if event.tier != crate::indexer::Tier::Device && event.data != KvEventData::Cleared {
            return;
        }
        match &event.data {
            KvEventData::Cleared => p.remove_candidate(event.candidate),
            KvEventData::Stored { blocks, .. } => {
                p.confirm(
                    event.candidate,
                    blocks.iter().map(|b| b.tokens_hash),
                    self.now_us(),
                );
            }
            KvEventData::Removed { block_hashes } => {
                if p.holds_any(event.candidate) {
                    let locals = self.indexer.device_locals_of(event.candidate, block_hashes);
                    p.contradict(event.candidate, &locals);
                }
            }
        }
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

    // ---- request lifecycle -----------------------------------------------------------------------

    /// The request's first token arrived: its prompt no longer loads the candidate. A
    /// disaggregated request's KV cache has reached its decode worker: the prefill worker's half is
    /// released. Returns where the request decodes.
    pub fn prefill_complete(&self, request_id: &str) -> Result<CandidateKey, LifecycleError> {
        // The load lock is released before `not_booked` takes the queue's.
        let r = booking::prefill_complete(&mut self.load.lock(), request_id);
        let r = r.ok_or_else(|| self.not_booked(request_id))?;
        self.announce(|| BookingEvent::PrefillComplete {
            request_id: request_id.to_owned(),
        });
        let mut st = self.step_times.lock();
        let changed = st.prefill_complete(request_id, self.now_us());
        self.publish_learned(&st, changed);
        drop(st);
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
        let r = r.map_err(|_| self.not_booked(request_id))?;
        self.announce(|| BookingEvent::Output {
            request_id: request_id.to_owned(),
            tokens,
        });
        let mut st = self.step_times.lock();
        let changed = st.output(request_id, tokens, self.now_us());
        self.publish_learned(&st, changed);
        Ok(r)
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
            .release_booking(request_id)
            .ok_or_else(|| LifecycleError::UnknownRequest(request_id.into()))?;
        let mut st = self.step_times.lock();
        let changed = st.freed(request_id, b.output_tokens, self.now_us());
        self.publish_learned(&st, changed);
        drop(st);
        self.pump();
        Ok(Some(b))
    }

    /// Periodic maintenance: expires stale bookings and approximate blocks, then serves the queue.
    /// Call every few seconds (the server does).
    pub fn tick(&self, now: Instant) -> (usize, u64) {
        // A disaggregated request's two halves expire together and count once.
        let expired = booking::count_requests(&self.load.lock().expire(now));
        let horizon = self.config.load.expiry.as_micros() as u64;
        let before = self.now_us().saturating_sub(horizon);
        self.step_times.lock().expire(before);
        let blocks = self
            .approx
            .as_ref()
            .map_or(0, |a| a.expire(&self.indexer, now));
        let secs = self.clock_secs();
        self.queue.lock().forget_idle(secs);
        self.pump();
        (expired, blocks)
    }

    /// Answers every waiting request with a retryable `shutting_down` error (graceful shutdown:
    /// waiting requests must not hold the process for the queue timeout).
    pub fn shutdown_queue(&self) -> usize {
        let drained = self.queue.lock().close(self.clock_secs());
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

    /// Requests booked now (a disaggregated request's two halves count once).
    pub fn active_bookings(&self) -> usize {
        let load = self.load.lock();
        load.bookings()
            .filter(|b| !booking::is_prefill_half(&b.request_id))
            .count()
    }
}
