//! The pending queue: requests waiting for a candidate to stop being busy (SPEC §9).
//!
//! # When it is used
//!
//! Queueing is on only when a busy threshold is configured: a candidate is busy when its
//! `active_prefill_tokens > threshold_frac * max_num_batched_tokens`. A request waits here only when
//! every candidate eligible for it is busy, and a new arrival never jumps an existing backlog of its
//! class: if [`PendingQueue::has_backlog_at_or_above`] its class, it queues behind them even if a
//! candidate happens to be free at that instant. Capacity changes (prefill complete, free, worker
//! added) make the router look at [`PendingQueue::peek`] again; a dequeued request is scored afresh
//! against the load of that moment.
//!
//! # Order
//!
//! Strict priority `class` first (higher served first). Within a class, by the configured
//! [`QueueOrder`], larger key first:
//! - [`QueueOrder::Fcfs`]: `priority_jump - arrival_secs`, i.e. first come first served, where a
//!   jump of `j` seconds lets a request overtake those that arrived less than `j` seconds before it;
//! - [`QueueOrder::Wspt`] (weighted shortest processing time):
//!   `(1 + priority_jump) / max(1, prompt_tokens - best_cached_tokens)`, i.e. the cheapest prefill
//!   (weighted by the jump) first, which minimises mean waiting time.
//!
//! Exact ties go to the earlier insertion. Keys are compared with [`f64::total_cmp`], so a NaN (the
//! router validates inputs, but the queue must not panic) sorts at one end rather than breaking the
//! order.
//!
//! # Fairness
//!
//! A queue made with [`PendingQueue::fair`] serves each class's requests least attained service
//! first, in two levels, and by the order above only inside one flow:
//! 1. the **tenant** ([`QueueEntry::tenant`]; none is [`DEFAULT_TENANT`]) whose attained service
//!    divided by its weight ([`FairConfig::weight`]) is smallest;
//! 2. within it, the **session** ([`QueueEntry::session`]; the tenant's requests without one share
//!    a flow) whose attained service is smallest;
//! 3. within it, the [`QueueOrder`] key.
//!
//! Equal service goes to the flow that became backlogged first, then to the smaller name. A flow
//! that becomes backlogged starts with no less than one token of service counted at that moment
//! (its account is raised to that floor): otherwise a stream of brand-new flows, each at 0, would
//! starve every flow that has ever been served.
//! Attained service is what [`PendingQueue::charge`] counted (the router charges each booked
//! decision with the prompt tokens the chosen worker must compute plus the output tokens the
//! request expects), **decayed exponentially** with a half-life of
//! [`FairConfig::half_life_secs`]: service counted `h` half-lives ago weighs `2^-h`. So a heavy
//! flow that stops is forgiven, and a heavy flow that keeps waiting behind a stream of newcomers
//! (who start at the floor) regains its turn once its decayed service falls to one token's: a
//! flow with service `S` waits behind newcomers at most about `half_life × log2(S)` (20 half-lives
//! for a million tokens), never for ever, but far longer than any client waits; the starvation
//! bound (below) is what caps the wait. Service is stored scaled by
//! `2^(t / half_life)` (a charge at `t` adds `tokens × 2^(t / half_life)`), so decay never
//! touches an account and comparisons stay exact; the origin of `t` moves every 64 half-lives.
//! Accounts of flows with nothing waiting whose decayed service falls below one token are
//! forgotten ([`PendingQueue::forget_idle`]).
//!
//! # Starvation bound
//!
//! Least attained service alone moves the most-served flows to the back for as long as lighter
//! ones keep arriving: on the agentic replay at 500 sessions it lowers the median TTFT by a third
//! but lets a heavy tenant's turns wait 39–47 s, past the router's 30 s queue timeout
//! (BENCHMARKS.md, "Agent sessions"). So a fair queue has a bound, [`FairConfig::max_wait_secs`]
//! (default [`DEFAULT_MAX_WAIT_SECS`]): a request of the top class that has waited that long
//! (`now - arrival_secs >= max_wait_secs`, the time given to [`PendingQueue::peek`] and
//! [`PendingQueue::pop`]) is **overdue** and is served before the fair order, the oldest overdue
//! first (by arrival, then insertion). Fairness thus reorders only within the bound. Priority
//! classes stay strict: the bound acts inside a class. It bounds the order, not the capacity:
//! with one request served at a time, a request waits at most the bound, plus what first come
//! first served would have kept it waiting, plus one service (from its bound on, every serve goes
//! to a request that arrived no later than it); where FCFS keeps up, no request waits past the
//! bound plus one service. When every request is overdue the queue is plain FCFS. A NaN arrival
//! is never overdue. Without a bound (`None`) the order is the fair one alone. The default, 5 s,
//! keeps the fair order's p99 at FCFS's on that replay with most of its median gain; a larger
//! bound keeps light tenants' tails shorter at the cost of the fleet's p99.
//!
//! # Limits
//!
//! [`QueueLimits`] are per worker and scale with the number of registered workers (at least one
//! worker's worth): at most `max_requests_per_worker × workers` requests and
//! `max_tokens_per_worker × workers` queued prompt tokens. A push past either is rejected at once
//! ([`QueueError::Full`], naming the limit) so the router can answer a retryable 429/503 instead of
//! letting latency grow without bound.
//!
//! The queue is a plain data structure: the router owns it behind a lock and does the waiting (one
//! oneshot channel per entry, carried in the payload). Push, pop and cancel are O(log n); a charge
//! is O(classes × log n): each level keeps its backlogged flows in an ordered set, re-keyed when
//! that flow is charged; with a starvation bound each class also keeps its requests by arrival.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

/// How requests of one priority class are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrder {
    /// First come first served, shifted by `priority_jump` seconds.
    #[default]
    Fcfs,
    /// Weighted shortest (uncached) prompt first.
    Wspt,
}

impl QueueOrder {
    /// The within-class key of `entry` under this order; larger is served first.
    pub fn key<T>(self, entry: &QueueEntry<T>) -> f64 {
        let k = match self {
            QueueOrder::Fcfs => entry.priority_jump - entry.arrival_secs,
            QueueOrder::Wspt => {
                (1.0 + entry.priority_jump) / f64::from(entry.uncached_prompt_tokens().max(1))
            }
        };
        // total_cmp tells -0.0 from 0.0; make them one key so such ties fall to insertion order.
        if k == 0.0 {
            0.0
        } else {
            k
        }
    }
}

/// Queue limits, per registered worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLimits {
    /// Default 64.
    pub max_requests_per_worker: usize,
    /// Queued prompt tokens; default 262,144.
    pub max_tokens_per_worker: u64,
}

impl Default for QueueLimits {
    fn default() -> Self {
        Self {
            max_requests_per_worker: 64,
            max_tokens_per_worker: 262_144,
        }
    }
}

impl QueueLimits {
    /// Most requests that may wait with `workers` registered workers (at least one worker's worth).
    pub fn max_requests(&self, workers: usize) -> usize {
        self.max_requests_per_worker.saturating_mul(workers.max(1))
    }

    /// Most queued prompt tokens with `workers` registered workers (at least one worker's worth).
    pub fn max_tokens(&self, workers: usize) -> u64 {
        self.max_tokens_per_worker
            .saturating_mul(u64::try_from(workers.max(1)).unwrap_or(u64::MAX))
    }
}

/// A waiting request.
#[derive(Clone, Debug)]
pub struct QueueEntry<T> {
    pub request_id: String,
    /// Strict priority class; higher is served first.
    pub class: i32,
    /// Within-class boost, >= 0 (seconds under FCFS, a weight under WSPT).
    pub priority_jump: f64,
    /// Arrival time, seconds since the queue's epoch.
    pub arrival_secs: f64,
    /// Prompt tokens (isl); what counts against the token limit.
    pub prompt_tokens: u32,
    /// Most prompt tokens any eligible candidate had cached when the request was queued.
    pub best_cached_tokens: u32,
    /// Its tenant (fair queueing's outer flow; `None`: [`DEFAULT_TENANT`]).
    pub tenant: Option<String>,
    /// Its session (the inner flow; `None`: the tenant's requests without a session share one).
    pub session: Option<String>,
    pub payload: T,
}

impl<T> QueueEntry<T> {
    /// `prompt_tokens - best_cached_tokens`, saturating.
    pub fn uncached_prompt_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.best_cached_tokens)
    }
}

/// Which queue limit was hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueLimitKind {
    Requests,
    Tokens,
}

impl QueueLimitKind {
    /// The limit's name in errors and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueLimitKind::Requests => "queue_requests",
            QueueLimitKind::Tokens => "queue_tokens",
        }
    }
}

impl fmt::Display for QueueLimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a push was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum QueueError {
    /// Admitting the request would pass a limit. `current` is what is queued now (requests or
    /// prompt tokens), `max` the limit at the current number of workers.
    #[error("queue full: {limit} limit reached ({current} queued, max {max})")]
    Full {
        limit: QueueLimitKind,
        current: u64,
        max: u64,
    },
    #[error("request {0:?} is already queued")]
    DuplicateRequest(String),
}

/// Position of an entry inside its flow: class descending, key descending, insertion sequence
/// ascending.
#[derive(Clone, Copy, Debug)]
struct Slot {
    class: i32,
    key: f64,
    seq: u64,
}

impl Ord for Slot {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .class
            .cmp(&self.class)
            .then_with(|| other.key.total_cmp(&self.key))
            .then_with(|| self.seq.cmp(&other.seq))
    }
}

impl PartialOrd for Slot {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Slot {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Slot {}

/// Fair queueing's settings (SPEC §9, "Fairness").
#[derive(Clone, Debug, PartialEq)]
pub struct FairConfig {
    /// Attained service halves every `half_life_secs` (default 60): an old heavy flow catches up
    /// with newcomers instead of waiting behind them for ever.
    pub half_life_secs: f64,
    /// Weight of each named tenant (> 0); a tenant not listed weighs `default_weight`.
    pub tenant_weights: FxHashMap<String, f64>,
    /// Default 1.
    pub default_weight: f64,
    /// The starvation bound (default [`DEFAULT_MAX_WAIT_SECS`]; `None`: none): a request that has
    /// waited this long is served before the fair order, oldest first (module docs, "Starvation
    /// bound").
    pub max_wait_secs: Option<f64>,
}

/// The default starvation bound of the fair order, seconds (docs/SPEC.md §9, "Fairness"). Chosen
/// on the agentic replay at 500 sessions (BENCHMARKS.md, "Agent sessions"): the largest of 2, 5,
/// 7.5, 10, 20 s at which the fair order's p99 TTFT stays at FCFS's (−3% to +3% on three seeds)
/// while its median stays 28–30% lower; 10 s keeps the light tenants' lower tail but puts p99
/// at 1.5× FCFS's. Well below the router's 30 s queue timeout.
pub const DEFAULT_MAX_WAIT_SECS: f64 = 5.0;

impl Default for FairConfig {
    fn default() -> Self {
        Self {
            half_life_secs: 60.0,
            tenant_weights: FxHashMap::default(),
            default_weight: 1.0,
            max_wait_secs: Some(DEFAULT_MAX_WAIT_SECS),
        }
    }
}

impl FairConfig {
    /// Checks every value, naming the field at fault (`fairness.…`).
    pub fn validate(&self) -> Result<(), String> {
        if !(self.half_life_secs.is_finite() && self.half_life_secs > 0.0) {
            return Err(format!(
                "fairness.half_life_secs must be a positive number of seconds, got {}",
                self.half_life_secs
            ));
        }
        if !(self.default_weight.is_finite() && self.default_weight > 0.0) {
            return Err(format!(
                "fairness.default_weight must be a positive number, got {}",
                self.default_weight
            ));
        }
        if let Some(w) = self.max_wait_secs {
            if !(w.is_finite() && w > 0.0) {
                return Err(format!(
                    "fairness.max_wait_secs must be a positive number of seconds, got {w}"
                ));
            }
        }
        let mut names: Vec<&String> = self.tenant_weights.keys().collect();
        names.sort();
        for name in names {
            let w = self.tenant_weights[name];
            if !(w.is_finite() && w > 0.0) {
                return Err(format!(
                    "fairness.tenants.{name}.weight must be a positive number, got {w}"
                ));
            }
        }
        Ok(())
    }

    /// The weight of `tenant`.
    pub fn weight(&self, tenant: &str) -> f64 {
        self.tenant_weights
            .get(tenant)
            .copied()
            .unwrap_or(self.default_weight)
    }
}

/// One tenant's standing in the queue ([`PendingQueue::tenants`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantStanding {
    /// Its decayed attained service, tokens (uncached prompt plus output tokens of its booked
    /// requests, halving every `half_life_secs`); 0 without fairness or once forgotten.
    pub attained_tokens: f64,
    /// Its requests waiting in the queue.
    pub waiting_requests: usize,
    /// Their prompt tokens.
    pub waiting_prompt_tokens: u64,
}

impl TenantStanding {
    fn add_waiting<T>(&mut self, e: &QueueEntry<T>) {
        self.waiting_requests += 1;
        self.waiting_prompt_tokens += u64::from(e.prompt_tokens);
    }
}

/// The name requests without a tenant are accounted under.
pub const DEFAULT_TENANT: &str = "default";

/// The longest tenant name a request may carry, in bytes.
pub const MAX_TENANT_LEN: usize = 128;

/// Whether `tenant` is a name a request may carry: 1 to [`MAX_TENANT_LEN`] bytes, no control
/// characters. The error is the reason, for the caller to put beside its field.
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > MAX_TENANT_LEN || tenant.chars().any(char::is_control) {
        return Err(format!(
            "must be 1 to {MAX_TENANT_LEN} bytes with no control characters"
        ));
    }
    Ok(())
}

/// Attained service is kept scaled by `2^((t - origin) / half_life)` so that decaying every
/// flow at once never touches any of them; past this exponent the origin moves to now (one
/// O(n log n) re-keying every 64 half-lives).
const MAX_EXPONENT: f64 = 64.0;

/// A flow's place among its siblings: attained service (scaled, divided by the tenant's weight for
/// tenants), then the insertion sequence at which the flow last became backlogged (equal service:
/// first come first served), then its name.
type FlowKey = (Key, u64, Arc<str>);

/// An f64 ordered by [`f64::total_cmp`].
#[derive(Clone, Copy, Debug)]
struct Key(f64);

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Key {}

/// One session's (or, without fairness, the class's only) waiting requests.
#[derive(Debug)]
struct SessionQueue<T> {
    key: FlowKey,
    entries: BTreeMap<Slot, QueueEntry<T>>,
}

/// One tenant's backlogged sessions in one class.
#[derive(Debug)]
struct TenantQueue<T> {
    key: FlowKey,
    order: BTreeSet<FlowKey>,
    sessions: FxHashMap<Arc<str>, SessionQueue<T>>,
}

/// One priority class: its backlogged tenants.
#[derive(Debug)]
struct ClassQueue<T> {
    order: BTreeSet<FlowKey>,
    tenants: FxHashMap<Arc<str>, TenantQueue<T>>,
    /// With a starvation bound: the class's requests by arrival ([`age_key`], then insertion
    /// sequence), to find the oldest overdue one. Empty without a bound.
    by_age: BTreeMap<(Key, u64), String>,
}

impl<T> Default for ClassQueue<T> {
    fn default() -> Self {
        Self {
            order: BTreeSet::new(),
            tenants: FxHashMap::default(),
            by_age: BTreeMap::new(),
        }
    }
}

/// Where an arrival sorts by age: a NaN arrival (the router validates inputs) sorts last and is
/// never overdue, so it cannot hide an overdue request behind it.
fn age_key(arrival_secs: f64) -> Key {
    Key(if arrival_secs.is_nan() {
        f64::INFINITY
    } else {
        arrival_secs
    })
}

/// Whether a request that arrived at `arrival_secs` has waited `max_wait_secs` by `now_secs`.
fn overdue(arrival_secs: f64, max_wait_secs: f64, now_secs: f64) -> bool {
    now_secs - arrival_secs >= max_wait_secs
}

/// Where a queued request is.
#[derive(Clone, Debug)]
struct Loc {
    tenant: Arc<str>,
    session: Arc<str>,
    slot: Slot,
}

/// Attained service per tenant and per (tenant, session), scaled (see [`MAX_EXPONENT`]).
#[derive(Debug)]
struct Service {
    config: FairConfig,
    origin_secs: f64,
    tenants: FxHashMap<Arc<str>, f64>,
    sessions: FxHashMap<(Arc<str>, Arc<str>), f64>,
}

impl Service {
    fn tenant_key(&self, tenant: &Arc<str>) -> f64 {
        self.tenants.get(tenant).copied().unwrap_or(0.0) / self.config.weight(tenant)
    }

    fn session_key(&self, tenant: &Arc<str>, session: &Arc<str>) -> f64 {
        self.sessions
            .get(&(tenant.clone(), session.clone()))
            .copied()
            .unwrap_or(0.0)
    }

    /// `2^((now - origin) / half_life)`.
    fn scale(&self, now_secs: f64) -> f64 {
        ((now_secs - self.origin_secs) / self.config.half_life_secs).exp2()
    }
}

/// Requests waiting for capacity, in serving order. See the module docs.
#[derive(Debug)]
pub struct PendingQueue<T> {
    order: QueueOrder,
    limits: QueueLimits,
    /// `None`: one flow per class (the plain order).
    service: Option<Service>,
    classes: BTreeMap<Reverse<i32>, ClassQueue<T>>,
    index: FxHashMap<String, Loc>,
    len: usize,
    tokens: u64,
    next_seq: u64,
    /// Set by [`Self::close`]: nothing is served any more, so nothing may join.
    closed: bool,
    /// The one name every request has without fairness.
    anonymous: Arc<str>,
}

impl<T> PendingQueue<T> {
    pub fn new(order: QueueOrder, limits: QueueLimits) -> Self {
        Self {
            order,
            limits,
            service: None,
            classes: BTreeMap::new(),
            index: FxHashMap::default(),
            len: 0,
            tokens: 0,
            next_seq: 0,
            closed: false,
            anonymous: Arc::from(""),
        }
    }

    /// A queue that serves each class's flows least attained service first (module docs,
    /// "Fairness"). The configuration must be valid ([`FairConfig::validate`]).
    pub fn fair(order: QueueOrder, limits: QueueLimits, config: FairConfig) -> Self {
        let mut q = Self::new(order, limits);
        q.service = Some(Service {
            config,
            origin_secs: 0.0,
            tenants: FxHashMap::default(),
            sessions: FxHashMap::default(),
        });
        q
    }

    pub fn order(&self) -> QueueOrder {
        self.order
    }

    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// The fairness settings, when the queue is fair.
    pub fn fairness(&self) -> Option<&FairConfig> {
        self.service.as_ref().map(|s| &s.config)
    }

    /// New limits apply to later pushes; nothing already waiting is dropped.
    pub fn set_limits(&mut self, limits: QueueLimits) {
        self.limits = limits;
    }

    /// The flow names of `entry`: (tenant, session), or one anonymous flow without fairness.
    fn flow_of(&self, entry: &QueueEntry<T>) -> (Arc<str>, Arc<str>) {
        if self.service.is_none() {
            return (self.anonymous.clone(), self.anonymous.clone());
        }
        let tenant = entry.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        let session = entry.session.as_deref().unwrap_or("");
        (Arc::from(tenant), Arc::from(session))
    }

    fn tenant_key(&self, tenant: &Arc<str>) -> Key {
        Key(self.service.as_ref().map_or(0.0, |s| s.tenant_key(tenant)))
    }

    fn session_key(&self, tenant: &Arc<str>, session: &Arc<str>) -> Key {
        Key(self
            .service
            .as_ref()
            .map_or(0.0, |s| s.session_key(tenant, session)))
    }

    /// Queues `entry`. `workers` = number of registered workers now (limits scale with it, at least
    /// one worker's worth). Rejects at once, giving the entry back, if the request id is already
    /// queued or admitting it would pass a limit (requests checked before tokens). The entry comes
    /// back by value (its payload is the caller's: a waiter's channel), hence the large error.
    #[allow(clippy::result_large_err)]
    pub fn push(
        &mut self,
        entry: QueueEntry<T>,
        workers: usize,
    ) -> Result<(), (QueueError, QueueEntry<T>)> {
        if self.index.contains_key(&entry.request_id) {
            let err = QueueError::DuplicateRequest(entry.request_id.clone());
            return Err((err, entry));
        }
        let max_requests = self.limits.max_requests(workers);
        if self.len >= max_requests {
            let err = QueueError::Full {
                limit: QueueLimitKind::Requests,
                current: self.len as u64,
                max: max_requests as u64,
            };
            return Err((err, entry));
        }
        let max_tokens = self.limits.max_tokens(workers);
        if self.tokens + u64::from(entry.prompt_tokens) > max_tokens {
            let err = QueueError::Full {
                limit: QueueLimitKind::Tokens,
                current: self.tokens,
                max: max_tokens,
            };
            return Err((err, entry));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let slot = Slot {
            class: entry.class,
            key: self.order.key(&entry),
            seq,
        };
        let (tenant, session) = self.flow_of(&entry);
        self.raise_to_floor(entry.class, &tenant, &session, entry.arrival_secs);
        let tkey = self.tenant_key(&tenant);
        let skey = self.session_key(&tenant, &session);
        self.tokens += u64::from(entry.prompt_tokens);
        self.len += 1;
        self.index.insert(
            entry.request_id.clone(),
            Loc {
                tenant: tenant.clone(),
                session: session.clone(),
                slot,
            },
        );
        let by_age = self.max_wait_secs().is_some();
        let class = self.classes.entry(Reverse(entry.class)).or_default();
        let tq = class.tenants.entry(tenant.clone()).or_insert_with(|| {
            let key = (tkey, seq, tenant.clone());
            class.order.insert(key.clone());
            TenantQueue {
                key,
                order: BTreeSet::new(),
                sessions: FxHashMap::default(),
            }
        });
        let sq = tq.sessions.entry(session.clone()).or_insert_with(|| {
            let key = (skey, seq, session.clone());
            tq.order.insert(key.clone());
            SessionQueue {
                key,
                entries: BTreeMap::new(),
            }
        });
        if by_age {
            class
                .by_age
                .insert((age_key(entry.arrival_secs), seq), entry.request_id.clone());
        }
        sq.entries.insert(slot, entry);
        Ok(())
    }

    /// The starvation bound, when the queue is fair and has one.
    fn max_wait_secs(&self) -> Option<f64> {
        self.service.as_ref().and_then(|s| s.config.max_wait_secs)
    }

    /// The queued request `request_id`.
    fn entry(&self, request_id: &str) -> &QueueEntry<T> {
        let loc = &self.index[request_id];
        &self.classes[&Reverse(loc.slot.class)].tenants[&loc.tenant].sessions[&loc.session].entries
            [&loc.slot]
    }

    /// The next request to serve at `now_secs` (seconds on the entries' arrival clock): the
    /// top class's oldest overdue request if there is one (a fair queue with a starvation bound),
    /// else the head of the top class's order.
    pub fn peek(&self, now_secs: f64) -> Option<&QueueEntry<T>> {
        let class = self.classes.values().next()?;
        if let Some(max_wait) = self.max_wait_secs() {
            if let Some(((arrival, _), id)) = class.by_age.first_key_value() {
                if overdue(arrival.0, max_wait, now_secs) {
                    return Some(self.entry(id));
                }
            }
        }
        let (_, _, tenant) = class.order.first()?;
        let tq = &class.tenants[tenant];
        let (_, _, session) = tq.order.first()?;
        tq.sessions[session].entries.values().next()
    }

    /// Removes and returns the next request to serve at `now_secs` ([`Self::peek`]).
    pub fn pop(&mut self, now_secs: f64) -> Option<QueueEntry<T>> {
        let id = self.peek(now_secs)?.request_id.clone();
        self.cancel(&id)
    }

    /// Removes a waiting request (client gone, deadline passed). O(log n).
    pub fn cancel(&mut self, request_id: &str) -> Option<QueueEntry<T>> {
        let loc = self.index.remove(request_id)?;
        let class_key = Reverse(loc.slot.class);
        let class = self
            .classes
            .get_mut(&class_key)
            .expect("every indexed request's class is queued");
        let tq = class
            .tenants
            .get_mut(&loc.tenant)
            .expect("every indexed request's tenant is queued");
        let sq = tq
            .sessions
            .get_mut(&loc.session)
            .expect("every indexed request's session is queued");
        let entry = sq
            .entries
            .remove(&loc.slot)
            .expect("every indexed request is queued");
        class
            .by_age
            .remove(&(age_key(entry.arrival_secs), loc.slot.seq));
        if sq.entries.is_empty() {
            tq.order.remove(&sq.key);
            tq.sessions.remove(&loc.session);
        }
        if tq.sessions.is_empty() {
            class.order.remove(&tq.key);
            class.tenants.remove(&loc.tenant);
        }
        if class.tenants.is_empty() {
            self.classes.remove(&class_key);
        }
        self.len -= 1;
        self.tokens -= u64::from(entry.prompt_tokens);
        Some(entry)
    }

    /// Counts `tokens` of service to `tenant`'s `session` at `now_secs` (seconds on the same clock
    /// as the entries' arrivals): the flows' places among the waiting ones move at once. The
    /// router charges every booked decision, queued or not. Nothing happens without fairness.
    /// O(classes × log n).
    pub fn charge(
        &mut self,
        tenant: Option<&str>,
        session: Option<&str>,
        tokens: u64,
        now_secs: f64,
    ) {
        let Some(service) = self.service.as_mut() else {
            return;
        };
        if tokens == 0 || !now_secs.is_finite() {
            return;
        }
        if (now_secs - service.origin_secs) / service.config.half_life_secs > MAX_EXPONENT {
            self.rebase(now_secs);
        }
        let service = self.service.as_mut().expect("checked");
        let amount = tokens as f64 * service.scale(now_secs);
        let tenant: Arc<str> = Arc::from(tenant.unwrap_or(DEFAULT_TENANT));
        let session: Arc<str> = Arc::from(session.unwrap_or(""));
        *service.tenants.entry(tenant.clone()).or_insert(0.0) += amount;
        *service
            .sessions
            .entry((tenant.clone(), session.clone()))
            .or_insert(0.0) += amount;
        self.rekey_flow(&tenant, &session);
    }

    /// A flow that becomes backlogged at `now_secs` starts with no less than one token served at
    /// `now_secs` (its account is raised to that floor). Without it a stream of brand-new flows
    /// (service 0) would starve every flow that has ever been served; the floor doubles against
    /// older service every half-life, which bounds how long any flow waits behind newcomers.
    fn raise_to_floor(&mut self, class: i32, tenant: &Arc<str>, session: &Arc<str>, now_secs: f64) {
        let Some(service) = self.service.as_mut() else {
            return;
        };
        if !now_secs.is_finite() {
            return;
        }
        if (now_secs - service.origin_secs) / service.config.half_life_secs > MAX_EXPONENT {
            self.rebase(now_secs);
        }
        let service = self.service.as_mut().expect("checked");
        let base = service.scale(now_secs);
        let tq = self
            .classes
            .get(&Reverse(class))
            .and_then(|c| c.tenants.get(tenant));
        let mut changed = false;
        if tq.is_none() {
            let raised = base * service.config.weight(tenant);
            let own = service.tenants.entry(tenant.clone()).or_insert(0.0);
            if *own < raised {
                *own = raised;
                changed = true;
            }
        }
        if tq.is_none_or(|t| !t.sessions.contains_key(session)) {
            let own = service
                .sessions
                .entry((tenant.clone(), session.clone()))
                .or_insert(0.0);
            if *own < base {
                *own = base;
                changed = true;
            }
        }
        if changed {
            self.rekey_flow(tenant, session);
        }
    }

    /// Re-keys `tenant` (and its `session`) wherever they wait, after their accounts changed.
    fn rekey_flow(&mut self, tenant: &Arc<str>, session: &Arc<str>) {
        let Some(service) = self.service.as_ref() else {
            return;
        };
        let tkey = Key(service.tenant_key(tenant));
        let skey = Key(service.session_key(tenant, session));
        for class in self.classes.values_mut() {
            let Some(tq) = class.tenants.get_mut(tenant) else {
                continue;
            };
            class.order.remove(&tq.key);
            tq.key.0 = tkey;
            class.order.insert(tq.key.clone());
            if let Some(sq) = tq.sessions.get_mut(session) {
                tq.order.remove(&sq.key);
                sq.key.0 = skey;
                tq.order.insert(sq.key.clone());
            }
        }
    }

    /// Moves the service origin to `now_secs` (every scaled figure shrinks by the same factor, so
    /// no order changes) and re-keys the backlogged flows.
    fn rebase(&mut self, now_secs: f64) {
        let Some(service) = self.service.as_mut() else {
            return;
        };
        let f = service.scale(now_secs).recip();
        service.origin_secs = now_secs;
        service.tenants.values_mut().for_each(|v| *v *= f);
        service.sessions.values_mut().for_each(|v| *v *= f);
        self.rekey_all();
    }

    fn rekey_all(&mut self) {
        let Some(service) = self.service.as_ref() else {
            return;
        };
        for class in self.classes.values_mut() {
            class.order.clear();
            for (tenant, tq) in class.tenants.iter_mut() {
                tq.key.0 = Key(service.tenant_key(tenant));
                class.order.insert(tq.key.clone());
                tq.order.clear();
                for (session, sq) in tq.sessions.iter_mut() {
                    sq.key.0 = Key(service.session_key(tenant, session));
                    tq.order.insert(sq.key.clone());
                }
            }
        }
    }

    /// Forgets the service of flows with nothing waiting whose decayed service is below one token
    /// (what keeps the accounts bounded); returns how many were forgotten. The router calls it
    /// from its one-second maintenance tick. O(flows × classes).
    pub fn forget_idle(&mut self, now_secs: f64) -> usize {
        let Some(service) = self.service.as_mut() else {
            return 0;
        };
        let threshold = service.scale(now_secs);
        let classes = &self.classes;
        let waiting_tenant = |t: &Arc<str>| classes.values().any(|c| c.tenants.contains_key(t));
        let waiting_session = |t: &Arc<str>, s: &Arc<str>| {
            classes.values().any(|c| {
                c.tenants
                    .get(t)
                    .is_some_and(|tq| tq.sessions.contains_key(s))
            })
        };
        let before = service.tenants.len() + service.sessions.len();
        service
            .sessions
            .retain(|(t, s), v| *v >= threshold || waiting_session(t, s));
        service
            .tenants
            .retain(|t, v| *v >= threshold || waiting_tenant(t));
        before - service.tenants.len() - service.sessions.len()
    }

    /// The decayed attained service of `tenant` at `now_secs` (0 without fairness or when
    /// forgotten), in tokens.
    pub fn tenant_service(&self, tenant: &str, now_secs: f64) -> f64 {
        self.service.as_ref().map_or(0.0, |s| {
            s.tenants.get(tenant).copied().unwrap_or(0.0) / s.scale(now_secs)
        })
    }

    /// Every tenant with a service account or a waiting request, by name: its decayed attained
    /// service at `now_secs` (tokens; 0 without fairness) and what it has waiting. O(flows +
    /// waiting requests): an operator's read (`GET /v1/tenants`), never the serving path.
    pub fn tenants(&self, now_secs: f64) -> BTreeMap<String, TenantStanding> {
        let mut out: BTreeMap<String, TenantStanding> = BTreeMap::new();
        if let Some(s) = &self.service {
            let scale = s.scale(now_secs);
            for (t, v) in &s.tenants {
                out.entry(t.to_string()).or_default().attained_tokens = v / scale;
            }
        }
        for e in self.waiting() {
            let t = e.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
            out.entry(t.to_string()).or_default().add_waiting(e);
        }
        out
    }

    /// [`Self::tenants`]' figures of one tenant (all zero for one it has never seen).
    /// O(waiting requests).
    pub fn tenant(&self, tenant: &str, now_secs: f64) -> TenantStanding {
        let mut st = TenantStanding {
            attained_tokens: self.tenant_service(tenant, now_secs),
            ..TenantStanding::default()
        };
        for e in self.waiting() {
            if e.tenant.as_deref().unwrap_or(DEFAULT_TENANT) == tenant {
                st.add_waiting(e);
            }
        }
        st
    }

    /// Every waiting request, in no particular order.
    fn waiting(&self) -> impl Iterator<Item = &QueueEntry<T>> + '_ {
        self.classes
            .values()
            .flat_map(|c| c.tenants.values())
            .flat_map(|t| t.sessions.values())
            .flat_map(|s| s.entries.values())
    }

    /// How many flows (tenants and sessions) have a service account.
    pub fn accounted_flows(&self) -> usize {
        self.service
            .as_ref()
            .map_or(0, |s| s.tenants.len() + s.sessions.len())
    }

    /// Whether anyone of `class` or a higher class is waiting: a new arrival of `class` must then
    /// queue behind them instead of being routed at once.
    pub fn has_backlog_at_or_above(&self, class: i32) -> bool {
        self.classes.keys().next().is_some_and(|c| c.0 >= class)
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.index.contains_key(request_id)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sum of the prompt tokens of the waiting requests.
    pub fn queued_tokens(&self) -> u64 {
        self.tokens
    }

    /// Waiting requests in serving order at `now_secs` (were nothing charged meanwhile and the
    /// clock stopped): per class, its overdue requests oldest first, then the others in order.
    pub fn iter(&self, now_secs: f64) -> impl Iterator<Item = &QueueEntry<T>> + '_ {
        let max_wait = self.max_wait_secs();
        let late = move |arrival: f64| max_wait.is_some_and(|m| overdue(arrival, m, now_secs));
        self.classes.values().flat_map(move |class| {
            let overdue = class
                .by_age
                .iter()
                .take_while(move |((arrival, _), _)| late(arrival.0))
                .map(|(_, id)| self.entry(id));
            let rest = class.order.iter().flat_map(move |(_, _, tenant)| {
                let tq = &class.tenants[tenant];
                tq.order
                    .iter()
                    .flat_map(move |(_, _, session)| tq.sessions[session].entries.values())
            });
            overdue.chain(rest.filter(move |e| !late(age_key(e.arrival_secs).0)))
        })
    }

    /// Switches the within-flow order and re-sorts what is waiting. Ties keep falling to the
    /// original insertion order.
    pub fn set_order(&mut self, order: QueueOrder) {
        if order == self.order {
            return;
        }
        self.order = order;
        for class in self.classes.values_mut() {
            for tq in class.tenants.values_mut() {
                for sq in tq.sessions.values_mut() {
                    let old = std::mem::take(&mut sq.entries);
                    for (slot, entry) in old {
                        let slot = Slot {
                            key: order.key(&entry),
                            ..slot
                        };
                        self.index
                            .get_mut(&entry.request_id)
                            .expect("every queued request is indexed")
                            .slot = slot;
                        sq.entries.insert(slot, entry);
                    }
                }
            }
        }
    }

    /// Empties the queue for good (shutdown), returning everything in serving order at
    /// `now_secs`. Later callers check [`Self::is_closed`] before waiting.
    pub fn close(&mut self, now_secs: f64) -> Vec<QueueEntry<T>> {
        self.closed = true;
        self.drain(now_secs)
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Empties the queue, returning everything in serving order at `now_secs`.
    pub fn drain(&mut self, now_secs: f64) -> Vec<QueueEntry<T>> {
        let mut out = Vec::with_capacity(self.len);
        while let Some(e) = self.pop(now_secs) {
            out.push(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        id: &str,
        class: i32,
        jump: f64,
        arrival: f64,
        prompt: u32,
        cached: u32,
    ) -> QueueEntry<u32> {
        QueueEntry {
            request_id: id.to_owned(),
            class,
            priority_jump: jump,
            arrival_secs: arrival,
            prompt_tokens: prompt,
            best_cached_tokens: cached,
            tenant: None,
            session: None,
            payload: 0,
        }
    }

    fn big() -> QueueLimits {
        QueueLimits {
            max_requests_per_worker: 1_000,
            max_tokens_per_worker: 1_000_000,
        }
    }

    fn ids<T>(q: &mut PendingQueue<T>) -> Vec<String> {
        std::iter::from_fn(|| q.pop(0.0))
            .map(|e| e.request_id)
            .collect()
    }

    #[test]
    fn defaults_and_names() {
        let l = QueueLimits::default();
        assert_eq!(l.max_requests_per_worker, 64);
        assert_eq!(l.max_tokens_per_worker, 262_144);
        assert_eq!(QueueOrder::default(), QueueOrder::Fcfs);
        assert_eq!(QueueLimitKind::Requests.as_str(), "queue_requests");
        assert_eq!(QueueLimitKind::Tokens.as_str(), "queue_tokens");
        assert_eq!(
            serde_json::to_string(&QueueOrder::Wspt).unwrap(),
            "\"wspt\""
        );
        assert_eq!(
            serde_json::from_str::<QueueOrder>("\"fcfs\"").unwrap(),
            QueueOrder::Fcfs
        );
        let e = QueueError::Full {
            limit: QueueLimitKind::Tokens,
            current: 10,
            max: 12,
        };
        assert_eq!(
            e.to_string(),
            "queue full: queue_tokens limit reached (10 queued, max 12)"
        );
        assert_eq!(
            QueueError::DuplicateRequest("a".into()).to_string(),
            "request \"a\" is already queued"
        );
    }

    #[test]
    fn fcfs_orders_by_arrival_shifted_by_jump() {
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        q.push(entry("late", 0, 0.0, 5.0, 10, 0), 1).unwrap();
        q.push(entry("early", 0, 0.0, 1.0, 10, 0), 1).unwrap();
        // arrived at 4 but jumps 3.5 s: key 3.5 - 4 = -0.5 beats early's -1
        q.push(entry("jumper", 0, 3.5, 4.0, 10, 0), 1).unwrap();
        q.push(entry("mid", 0, 0.0, 3.0, 10, 0), 1).unwrap();
        assert_eq!(q.peek(0.0).unwrap().request_id, "jumper");
        assert_eq!(ids(&mut q), ["jumper", "early", "mid", "late"]);
    }

    #[test]
    fn wspt_orders_by_weighted_uncached_prompt() {
        let mut q = PendingQueue::new(QueueOrder::Wspt, big());
        q.push(entry("long", 0, 0.0, 0.0, 1000, 0), 1).unwrap(); // 1/1000
        q.push(entry("cached", 0, 0.0, 1.0, 1000, 900), 1).unwrap(); // 1/100
        q.push(entry("short", 0, 0.0, 2.0, 50, 0), 1).unwrap(); // 1/50
        q.push(entry("weighted", 0, 9.0, 3.0, 400, 0), 1).unwrap(); // 10/400 = 1/40
        q.push(entry("all_cached", 0, 0.0, 4.0, 64, 200), 1)
            .unwrap(); // 1/max(1,0) = 1
        assert_eq!(
            ids(&mut q),
            ["all_cached", "weighted", "short", "cached", "long"]
        );
    }

    #[test]
    fn class_is_strict() {
        for order in [QueueOrder::Fcfs, QueueOrder::Wspt] {
            let mut q = PendingQueue::new(order, big());
            q.push(entry("low_first", -1, 100.0, 0.0, 1, 0), 1).unwrap();
            q.push(entry("mid", 0, 0.0, 1.0, 100_000, 0), 1).unwrap();
            q.push(entry("high", 2, 0.0, 9.0, 100_000, 0), 1).unwrap();
            q.push(entry("mid2", 0, 0.0, 2.0, 100_000, 0), 1).unwrap();
            assert_eq!(
                ids(&mut q),
                ["high", "mid", "mid2", "low_first"],
                "{order:?}"
            );
        }
    }

    #[test]
    fn exact_ties_go_to_insertion_order() {
        for order in [QueueOrder::Fcfs, QueueOrder::Wspt] {
            let mut q = PendingQueue::new(order, big());
            for id in ["a", "b", "c", "d"] {
                q.push(entry(id, 0, 0.0, 1.0, 10, 0), 1).unwrap();
            }
            assert_eq!(ids(&mut q), ["a", "b", "c", "d"]);
        }
        // -0.0 and 0.0 are one key
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        q.push(entry("pos", 0, 0.0, 0.0, 1, 0), 1).unwrap();
        q.push(entry("neg", 0, -0.0, 0.0, 1, 0), 1).unwrap();
        assert_eq!(ids(&mut q), ["pos", "neg"]);
    }

    #[test]
    fn nan_and_infinities_do_not_panic() {
        for order in [QueueOrder::Fcfs, QueueOrder::Wspt] {
            let mut q = PendingQueue::new(order, big());
            q.push(entry("nan", 0, f64::NAN, 0.0, 1, 0), 1).unwrap();
            q.push(entry("inf", 0, f64::INFINITY, 0.0, 1, 0), 1)
                .unwrap();
            q.push(entry("ninf", 0, 0.0, f64::INFINITY, 1, 0), 1)
                .unwrap();
            q.push(entry("plain", 0, 0.0, 1.0, 1, 0), 1).unwrap();
            q.push(entry("nan2", 0, 0.0, f64::NAN, 1, 0), 1).unwrap();
            assert!(q.cancel("nan").is_some());
            assert_eq!(q.len(), 4);
            q.set_order(match order {
                QueueOrder::Fcfs => QueueOrder::Wspt,
                QueueOrder::Wspt => QueueOrder::Fcfs,
            });
            let mut got = ids(&mut q);
            got.sort();
            assert_eq!(got, ["inf", "nan2", "ninf", "plain"]);
        }
    }

    #[test]
    fn request_limit_scales_with_workers() {
        let limits = QueueLimits {
            max_requests_per_worker: 2,
            max_tokens_per_worker: 1_000_000,
        };
        let mut q = PendingQueue::new(QueueOrder::Fcfs, limits);
        q.push(entry("a", 0, 0.0, 0.0, 1, 0), 0).unwrap(); // 0 workers: one worker's worth
        q.push(entry("b", 0, 0.0, 0.0, 1, 0), 0).unwrap();
        let (err, back) = q.push(entry("c", 0, 0.0, 0.0, 1, 0), 1).unwrap_err();
        assert_eq!(
            err,
            QueueError::Full {
                limit: QueueLimitKind::Requests,
                current: 2,
                max: 2
            }
        );
        assert_eq!(back.request_id, "c");
        assert_eq!(q.len(), 2);
        // three workers: six requests
        for id in ["c", "d", "e", "f"] {
            q.push(entry(id, 0, 0.0, 0.0, 1, 0), 3).unwrap();
        }
        let (err, _) = q.push(entry("g", 0, 0.0, 0.0, 1, 0), 3).unwrap_err();
        assert_eq!(
            err,
            QueueError::Full {
                limit: QueueLimitKind::Requests,
                current: 6,
                max: 6
            }
        );
        // fewer workers later: nothing dropped, pushes refused until it drains below the limit
        let (err, _) = q.push(entry("g", 0, 0.0, 0.0, 1, 0), 1).unwrap_err();
        assert!(matches!(
            err,
            QueueError::Full {
                max: 2,
                current: 6,
                ..
            }
        ));
        assert_eq!(q.len(), 6);
    }

    #[test]
    fn token_limit_scales_with_workers() {
        let limits = QueueLimits {
            max_requests_per_worker: 100,
            max_tokens_per_worker: 100,
        };
        let mut q = PendingQueue::new(QueueOrder::Fcfs, limits);
        q.push(entry("a", 0, 0.0, 0.0, 60, 50), 1).unwrap(); // counts prompt tokens, not uncached
        q.push(entry("b", 0, 0.0, 0.0, 40, 0), 1).unwrap(); // exactly at the limit is fine
        assert_eq!(q.queued_tokens(), 100);
        let (err, back) = q.push(entry("c", 0, 0.0, 0.0, 1, 0), 1).unwrap_err();
        assert_eq!(
            err,
            QueueError::Full {
                limit: QueueLimitKind::Tokens,
                current: 100,
                max: 100
            }
        );
        assert_eq!(back.prompt_tokens, 1);
        q.push(entry("c", 0, 0.0, 0.0, 100, 0), 2).unwrap();
        assert_eq!(q.queued_tokens(), 200);
        // a single prompt larger than the whole limit is refused even on an empty queue
        let mut q2: PendingQueue<u32> = PendingQueue::new(QueueOrder::Fcfs, limits);
        let (err, _) = q2.push(entry("huge", 0, 0.0, 0.0, 101, 0), 1).unwrap_err();
        assert!(matches!(
            err,
            QueueError::Full {
                limit: QueueLimitKind::Tokens,
                current: 0,
                max: 100
            }
        ));
        // tokens are released by pop and cancel
        q.cancel("a").unwrap();
        assert_eq!(q.queued_tokens(), 140);
        q.pop(0.0).unwrap();
        assert_eq!(q.queued_tokens(), 100);
    }

    #[test]
    fn zero_limits_refuse_everything() {
        let mut q = PendingQueue::new(
            QueueOrder::Fcfs,
            QueueLimits {
                max_requests_per_worker: 0,
                max_tokens_per_worker: 0,
            },
        );
        let (err, _) = q.push(entry("a", 0, 0.0, 0.0, 0, 0), 8).unwrap_err();
        assert!(matches!(
            err,
            QueueError::Full {
                limit: QueueLimitKind::Requests,
                ..
            }
        ));
    }

    #[test]
    fn duplicates_are_refused_before_limits() {
        let limits = QueueLimits {
            max_requests_per_worker: 1,
            max_tokens_per_worker: 10,
        };
        let mut q = PendingQueue::new(QueueOrder::Fcfs, limits);
        q.push(entry("a", 0, 0.0, 0.0, 5, 0), 1).unwrap();
        let (err, back) = q.push(entry("a", 3, 0.0, 0.0, 5, 0), 1).unwrap_err();
        assert_eq!(err, QueueError::DuplicateRequest("a".into()));
        assert_eq!(back.class, 3);
        assert_eq!(q.len(), 1);
        assert_eq!(q.peek(0.0).unwrap().class, 0);
        // once gone, the id may come back
        q.pop(0.0).unwrap();
        q.push(entry("a", 0, 0.0, 0.0, 5, 0), 1).unwrap();
    }

    #[test]
    fn cancel_removes_only_that_request() {
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            q.push(entry(id, 0, 0.0, i as f64, 10, 0), 1).unwrap();
        }
        assert!(q.contains("b"));
        let e = q.cancel("b").unwrap();
        assert_eq!(e.request_id, "b");
        assert!(!q.contains("b"));
        assert!(q.cancel("b").is_none());
        assert!(q.cancel("zzz").is_none());
        assert_eq!(q.cancel("a").unwrap().request_id, "a");
        assert_eq!(q.len(), 2);
        assert_eq!(q.queued_tokens(), 20);
        assert_eq!(ids(&mut q), ["c", "d"]);
        assert!(q.is_empty());
        assert!(q.pop(0.0).is_none());
        assert!(q.peek(0.0).is_none());
    }

    #[test]
    fn backlog_by_class() {
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        assert!(!q.has_backlog_at_or_above(i32::MIN));
        q.push(entry("a", 1, 0.0, 0.0, 10, 0), 1).unwrap();
        assert!(q.has_backlog_at_or_above(0));
        assert!(q.has_backlog_at_or_above(1));
        assert!(!q.has_backlog_at_or_above(2));
        q.push(entry("b", -3, 0.0, 0.0, 10, 0), 1).unwrap();
        assert!(!q.has_backlog_at_or_above(2));
        q.cancel("a");
        assert!(!q.has_backlog_at_or_above(0));
        assert!(q.has_backlog_at_or_above(-3));
        assert!(q.has_backlog_at_or_above(-5));
    }

    #[test]
    fn set_order_resorts_waiting_requests() {
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        q.push(entry("old_long", 0, 0.0, 0.0, 1000, 0), 1).unwrap();
        q.push(entry("tie1", 0, 0.0, 1.0, 100, 0), 1).unwrap();
        q.push(entry("new_short", 0, 0.0, 2.0, 10, 0), 1).unwrap();
        q.push(entry("tie2", 0, 0.0, 3.0, 100, 0), 1).unwrap();
        q.push(entry("vip", 1, 0.0, 4.0, 5000, 0), 1).unwrap();
        assert_eq!(q.iter(0.0).next().unwrap().request_id, "vip");
        q.set_order(QueueOrder::Wspt);
        assert_eq!(q.order(), QueueOrder::Wspt);
        let order: Vec<_> = q.iter(0.0).map(|e| e.request_id.as_str()).collect();
        assert_eq!(order, ["vip", "new_short", "tie1", "tie2", "old_long"]);
        // cancel still finds entries after re-keying
        assert!(q.cancel("tie1").is_some());
        q.set_order(QueueOrder::Fcfs);
        assert_eq!(ids(&mut q), ["vip", "old_long", "new_short", "tie2"]);
    }

    #[test]
    fn drain_returns_serving_order_and_empties() {
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        q.push(entry("b", 0, 0.0, 2.0, 10, 0), 1).unwrap();
        q.push(entry("a", 0, 0.0, 1.0, 10, 0), 1).unwrap();
        q.push(entry("h", 5, 0.0, 3.0, 10, 0), 1).unwrap();
        let all: Vec<_> = q.drain(0.0).into_iter().map(|e| e.request_id).collect();
        assert_eq!(all, ["h", "a", "b"]);
        assert!(q.is_empty());
        assert_eq!(q.queued_tokens(), 0);
        assert!(!q.contains("a"));
        q.push(entry("a", 0, 0.0, 1.0, 10, 0), 1).unwrap();
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn payload_need_not_be_clone() {
        struct NotClone;
        let mut q = PendingQueue::new(QueueOrder::Fcfs, big());
        q.push(
            QueueEntry {
                request_id: "a".into(),
                class: 0,
                priority_jump: 0.0,
                arrival_secs: 0.0,
                prompt_tokens: 1,
                best_cached_tokens: 0,
                tenant: None,
                session: None,
                payload: NotClone,
            },
            1,
        )
        .map_err(|(e, _)| e)
        .unwrap();
        assert!(matches!(q.pop(0.0).map(|e| e.payload), Some(NotClone)));
    }
}

/// Model check: pop order and every answer against a brute-force sort.
#[cfg(test)]
mod model_check {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Push {
            id: usize,
            class: i32,
            jump: f64,
            arrival: f64,
            prompt: u32,
            cached: u32,
            workers: usize,
        },
        Pop,
        Cancel(usize),
        SetOrder(bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        let push = (
            0usize..12,
            -1i32..2,
            prop::sample::select(vec![0.0, 0.5, 1.0, 3.0]),
            prop::sample::select(vec![0.0, 0.5, 1.0, 2.0, 2.5, 4.0]),
            prop::sample::select(vec![0u32, 1, 2, 10, 20, 40]),
            prop::sample::select(vec![0u32, 1, 10, 30]),
            0usize..4,
        )
            .prop_map(
                |(id, class, jump, arrival, prompt, cached, workers)| Op::Push {
                    id,
                    class,
                    jump,
                    arrival,
                    prompt,
                    cached,
                    workers,
                },
            );
        prop_oneof![
            5 => push,
            3 => Just(Op::Pop),
            2 => (0usize..12).prop_map(Op::Cancel),
            1 => any::<bool>().prop_map(Op::SetOrder),
        ]
    }

    /// The reference: entries in insertion order; the next to serve is found by a full sort.
    struct Model {
        order: QueueOrder,
        limits: QueueLimits,
        live: Vec<(u64, QueueEntry<usize>)>,
        seq: u64,
    }

    impl Model {
        fn sorted(&self) -> Vec<&QueueEntry<usize>> {
            let mut v: Vec<&(u64, QueueEntry<usize>)> = self.live.iter().collect();
            v.sort_by(|(sa, a), (sb, b)| {
                b.class
                    .cmp(&a.class)
                    .then(self.order.key(b).total_cmp(&self.order.key(a)))
                    .then(sa.cmp(sb))
            });
            v.into_iter().map(|(_, e)| e).collect()
        }

        fn push(&mut self, e: QueueEntry<usize>, workers: usize) -> Result<(), QueueError> {
            if self.live.iter().any(|(_, x)| x.request_id == e.request_id) {
                return Err(QueueError::DuplicateRequest(e.request_id));
            }
            let w = workers.max(1);
            let max_r = self.limits.max_requests_per_worker * w;
            if self.live.len() >= max_r {
                return Err(QueueError::Full {
                    limit: QueueLimitKind::Requests,
                    current: self.live.len() as u64,
                    max: max_r as u64,
                });
            }
            let tokens = self.tokens();
            let max_t = self.limits.max_tokens_per_worker * w as u64;
            if tokens + u64::from(e.prompt_tokens) > max_t {
                return Err(QueueError::Full {
                    limit: QueueLimitKind::Tokens,
                    current: tokens,
                    max: max_t,
                });
            }
            self.live.push((self.seq, e));
            self.seq += 1;
            Ok(())
        }

        fn remove(&mut self, id: &str) -> Option<QueueEntry<usize>> {
            let i = self.live.iter().position(|(_, e)| e.request_id == id)?;
            Some(self.live.remove(i).1)
        }

        fn tokens(&self) -> u64 {
            self.live
                .iter()
                .map(|(_, e)| u64::from(e.prompt_tokens))
                .sum()
        }
    }

    fn same(a: Option<&QueueEntry<usize>>, b: Option<&QueueEntry<usize>>) -> bool {
        match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => a.request_id == b.request_id && a.payload == b.payload,
            _ => false,
        }
    }

    fn run(start: QueueOrder, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let limits = QueueLimits {
            max_requests_per_worker: 3,
            max_tokens_per_worker: 60,
        };
        let mut q = PendingQueue::new(start, limits);
        let mut m = Model {
            order: start,
            limits,
            live: Vec::new(),
            seq: 0,
        };
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Push {
                    id,
                    class,
                    jump,
                    arrival,
                    prompt,
                    cached,
                    workers,
                } => {
                    let e = QueueEntry {
                        request_id: format!("q{id}"),
                        class,
                        priority_jump: jump,
                        arrival_secs: arrival,
                        prompt_tokens: prompt,
                        best_cached_tokens: cached,
                        tenant: None,
                        session: None,
                        payload: step,
                    };
                    let want = m.push(e.clone(), workers);
                    let got = q.push(e, workers);
                    match (got, want) {
                        (Ok(()), Ok(())) => {}
                        (Err((g, back)), Err(w)) => {
                            prop_assert_eq!(g, w);
                            prop_assert_eq!(back.payload, step);
                        }
                        (g, w) => prop_assert!(false, "push: {:?} vs {:?}", g.map_err(|e| e.0), w),
                    }
                }
                Op::Pop => {
                    let want = m.sorted().first().map(|e| e.request_id.clone());
                    let want = want.and_then(|id| m.remove(&id));
                    let got = q.pop(0.0);
                    prop_assert!(
                        same(got.as_ref(), want.as_ref()),
                        "pop {:?} vs {:?}",
                        got,
                        want
                    );
                }
                Op::Cancel(id) => {
                    let id = format!("q{id}");
                    let want = m.remove(&id);
                    let got = q.cancel(&id);
                    prop_assert!(
                        same(got.as_ref(), want.as_ref()),
                        "cancel {:?} vs {:?}",
                        got,
                        want
                    );
                }
                Op::SetOrder(wspt) => {
                    let o = if wspt {
                        QueueOrder::Wspt
                    } else {
                        QueueOrder::Fcfs
                    };
                    q.set_order(o);
                    m.order = o;
                }
            }
            prop_assert_eq!(q.len(), m.live.len());
            prop_assert_eq!(q.is_empty(), m.live.is_empty());
            prop_assert_eq!(q.queued_tokens(), m.tokens());
            let sorted = m.sorted();
            prop_assert!(same(q.peek(0.0), sorted.first().copied()));
            let got: Vec<&str> = q.iter(0.0).map(|e| e.request_id.as_str()).collect();
            let want: Vec<&str> = sorted.iter().map(|e| e.request_id.as_str()).collect();
            prop_assert_eq!(got, want);
            for class in -2..3 {
                prop_assert_eq!(
                    q.has_backlog_at_or_above(class),
                    m.live.iter().any(|(_, e)| e.class >= class)
                );
            }
        }
        let want: Vec<usize> = m.sorted().iter().map(|e| e.payload).collect();
        let got: Vec<usize> = q.drain(0.0).into_iter().map(|e| e.payload).collect();
        prop_assert_eq!(got, want);
        prop_assert!(q.is_empty());
        prop_assert_eq!(q.queued_tokens(), 0);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3_000))]

        #[test]
        fn queue_matches_sorted_model(wspt in any::<bool>(), ops in prop::collection::vec(op(), 0..50)) {
            run(if wspt { QueueOrder::Wspt } else { QueueOrder::Fcfs }, ops)?;
        }
    }
}

/// Fair queueing: unit tests, a model check against a brute-force sort, and long-run properties.
#[cfg(test)]
mod fair_tests {
    use super::*;
    use proptest::prelude::*;

    fn big() -> QueueLimits {
        QueueLimits {
            max_requests_per_worker: 100_000,
            max_tokens_per_worker: u64::MAX / 4,
        }
    }

    fn e(id: &str, class: i32, arrival: f64, tenant: &str, session: &str) -> QueueEntry<u32> {
        QueueEntry {
            request_id: id.to_owned(),
            class,
            priority_jump: 0.0,
            arrival_secs: arrival,
            prompt_tokens: 10,
            best_cached_tokens: 0,
            tenant: (!tenant.is_empty()).then(|| tenant.to_owned()),
            session: (!session.is_empty()).then(|| session.to_owned()),
            payload: 0,
        }
    }

    fn fair(weights: &[(&str, f64)]) -> PendingQueue<u32> {
        PendingQueue::fair(
            QueueOrder::Fcfs,
            big(),
            FairConfig {
                tenant_weights: weights.iter().map(|(n, w)| (n.to_string(), *w)).collect(),
                ..FairConfig::default()
            },
        )
    }

    /// What `q` serves at `now`, in order (nothing charged meanwhile).
    fn ids(q: &mut PendingQueue<u32>, now: f64) -> Vec<String> {
        std::iter::from_fn(|| q.pop(now))
            .map(|e| e.request_id)
            .collect()
    }

    #[test]
    fn least_served_tenant_goes_first() {
        let mut q = fair(&[]);
        q.charge(Some("heavy"), None, 1_000, 0.0);
        q.push(e("h1", 0, 0.0, "heavy", ""), 1).unwrap();
        q.push(e("h2", 0, 1.0, "heavy", ""), 1).unwrap();
        q.push(e("l1", 0, 2.0, "light", ""), 1).unwrap();
        q.push(e("l2", 0, 3.0, "light", ""), 1).unwrap();
        // nothing charged while popping: light's whole backlog, then heavy's, each FCFS inside
        assert_eq!(ids(&mut q, 3.0), ["l1", "l2", "h1", "h2"]);
        // without fairness the same pushes are plain FCFS
        let mut plain = PendingQueue::new(QueueOrder::Fcfs, big());
        plain.charge(Some("heavy"), None, 1_000, 0.0);
        for (id, a, t) in [
            ("h1", 0.0, "heavy"),
            ("l1", 2.0, "light"),
            ("h2", 1.0, "heavy"),
        ] {
            plain.push(e(id, 0, a, t, ""), 1).unwrap();
        }
        assert_eq!(ids(&mut plain, 3.0), ["h1", "h2", "l1"]);
    }

    #[test]
    fn charging_a_waiting_flow_moves_it() {
        let mut q = fair(&[]);
        q.push(e("a1", 0, 0.0, "a", ""), 1).unwrap();
        q.push(e("a2", 0, 1.0, "a", ""), 1).unwrap();
        q.push(e("b1", 0, 2.0, "b", ""), 1).unwrap();
        q.push(e("b2", 0, 3.0, "b", ""), 1).unwrap();
        // equal service: the flow backlogged first
        assert_eq!(q.peek(3.0).unwrap().request_id, "a1");
        let mut served = Vec::new();
        while let Some(x) = q.pop(3.0) {
            q.charge(x.tenant.as_deref(), x.session.as_deref(), 10, 0.0);
            served.push(x.request_id);
        }
        assert_eq!(served, ["a1", "b1", "a2", "b2"]);
    }

    #[test]
    fn weights_divide_service() {
        let mut q = fair(&[("gold", 2.0)]);
        q.charge(Some("gold"), None, 1_000, 0.0); // 1000 / 2 = 500
        q.charge(Some("bronze"), None, 600, 0.0); // 600 / 1
        q.push(e("b", 0, 0.0, "bronze", ""), 1).unwrap();
        q.push(e("g", 0, 1.0, "gold", ""), 1).unwrap();
        assert_eq!(ids(&mut q, 1.0), ["g", "b"]);
        assert_eq!(q.fairness().unwrap().weight("gold"), 2.0);
        assert_eq!(q.fairness().unwrap().weight("other"), 1.0);
    }

    #[test]
    fn sessions_share_their_tenant_by_service() {
        let mut q = fair(&[]);
        q.charge(Some("t"), Some("long"), 500, 0.0);
        q.push(e("long1", 0, 0.0, "t", "long"), 1).unwrap();
        q.push(e("long2", 0, 0.5, "t", "long"), 1).unwrap();
        q.push(e("new1", 0, 1.0, "t", "new"), 1).unwrap();
        q.push(e("nosess", 0, 2.0, "t", ""), 1).unwrap();
        // the tenant level first: another tenant with less service goes before all of t's
        q.push(e("other", 0, 3.0, "u", "x"), 1).unwrap();
        let order: Vec<_> = q.iter(3.0).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["other", "new1", "nosess", "long1", "long2"]);
        assert_eq!(ids(&mut q, 3.0), order);
    }

    #[test]
    fn classes_stay_strict() {
        let mut q = fair(&[]);
        q.charge(Some("vip"), None, 1_000_000, 0.0);
        q.push(e("low", -1, 0.0, "fresh", ""), 1).unwrap();
        q.push(e("mid", 0, 1.0, "fresh", ""), 1).unwrap();
        q.push(e("high", 1, 2.0, "vip", ""), 1).unwrap();
        assert!(q.has_backlog_at_or_above(1));
        assert!(!q.has_backlog_at_or_above(2));
        assert_eq!(ids(&mut q, 2.0), ["high", "mid", "low"]);
    }

    #[test]
    fn decay_forgives_an_old_heavy_flow() {
        let mut q = fair(&[]);
        q.charge(Some("old"), None, 3_200, 0.0);
        // five half-lives later the old service counts 3200 / 32 = 100
        q.charge(Some("new"), None, 101, 300.0);
        q.push(e("n", 0, 300.0, "new", ""), 1).unwrap();
        q.push(e("o", 0, 300.0, "old", ""), 1).unwrap();
        assert_eq!(q.peek(300.0).unwrap().request_id, "o");
        assert!((q.tenant_service("old", 300.0) - 100.0).abs() < 1e-9);
        assert!((q.tenant_service("new", 300.0) - 101.0).abs() < 1e-9);
        assert!((q.tenant_service("new", 360.0) - 50.5).abs() < 1e-9);
    }

    #[test]
    fn a_far_clock_rebases_without_losing_order() {
        // the fair order alone (with a bound both would be overdue long before the end)
        let mut q = PendingQueue::fair(
            QueueOrder::Fcfs,
            big(),
            FairConfig {
                max_wait_secs: None,
                ..FairConfig::default()
            },
        );
        q.push(e("a", 0, 0.0, "a", ""), 1).unwrap();
        q.push(e("b", 0, 0.0, "b", ""), 1).unwrap();
        // 2^1000 would overflow nothing here, 2^(1e6/60) would: the origin moves
        for k in 0..100 {
            let t = f64::from(k) * 10_000.0;
            q.charge(Some("a"), None, 20, t);
            q.charge(Some("b"), None, 10, t);
            let s = q.tenant_service("a", t);
            assert!(s.is_finite() && s > 0.0, "{k}: {s}");
        }
        assert_eq!(q.peek(990_000.0).unwrap().request_id, "b");
        q.charge(Some("b"), None, 100, 990_000.0);
        assert_eq!(q.peek(990_000.0).unwrap().request_id, "a");
    }

    #[test]
    fn idle_accounts_are_forgotten_waiting_ones_kept() {
        let mut q = fair(&[]);
        q.charge(Some("idle"), Some("s"), 1_000, 0.0);
        q.charge(Some("busy"), Some("s"), 1_000, 0.0);
        q.push(e("w", 0, 0.0, "busy", "s"), 1).unwrap();
        assert_eq!(q.accounted_flows(), 4);
        assert_eq!(q.forget_idle(60.0), 0); // 500 tokens left
                                            // 1000 / 2^11 < 1: idle's two accounts go; busy's stay while it waits
        assert_eq!(q.forget_idle(660.0), 2);
        assert_eq!(q.accounted_flows(), 2);
        q.pop(660.0).unwrap();
        assert_eq!(q.forget_idle(660.0), 2);
        assert_eq!(q.accounted_flows(), 0);
        // plain queues keep no accounts
        let mut plain: PendingQueue<u32> = PendingQueue::new(QueueOrder::Fcfs, big());
        plain.charge(Some("a"), None, 5, 0.0);
        assert_eq!(plain.accounted_flows(), 0);
        assert_eq!(plain.forget_idle(0.0), 0);
    }

    #[test]
    fn config_errors_name_the_field() {
        let bad = |c: FairConfig| c.validate().unwrap_err();
        assert!(bad(FairConfig {
            half_life_secs: 0.0,
            ..FairConfig::default()
        })
        .starts_with("fairness.half_life_secs"));
        assert!(bad(FairConfig {
            default_weight: f64::NAN,
            ..FairConfig::default()
        })
        .starts_with("fairness.default_weight"));
        let mut w = FxHashMap::default();
        w.insert("acme".to_string(), -1.0);
        assert!(bad(FairConfig {
            tenant_weights: w,
            ..FairConfig::default()
        })
        .starts_with("fairness.tenants.acme.weight"));
        for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(bad(FairConfig {
                max_wait_secs: Some(w),
                ..FairConfig::default()
            })
            .starts_with("fairness.max_wait_secs"));
        }
        FairConfig::default().validate().unwrap();
        FairConfig {
            max_wait_secs: None,
            ..FairConfig::default()
        }
        .validate()
        .unwrap();
        assert_eq!(
            FairConfig::default().max_wait_secs,
            Some(DEFAULT_MAX_WAIT_SECS)
        );
    }

    #[test]
    fn tenants_show_decayed_service_and_what_waits() {
        let mut q = fair(&[("heavy", 2.0)]);
        q.charge(Some("heavy"), Some("s"), 1_000, 0.0);
        q.charge(None, None, 40, 0.0);
        q.push(e("h1", 0, 0.0, "heavy", "s"), 1).unwrap();
        q.push(e("h2", 1, 0.0, "heavy", "z"), 1).unwrap();
        q.push(e("l1", 0, 0.0, "light", ""), 1).unwrap();
        // one half-life later every account has halved; waiting requests in every class count
        let t = q.tenants(60.0);
        let names: Vec<&str> = t.keys().map(String::as_str).collect();
        assert_eq!(names, [DEFAULT_TENANT, "heavy", "light"]);
        assert_eq!(t["heavy"].attained_tokens, 500.0);
        assert_eq!(
            (
                t["heavy"].waiting_requests,
                t["heavy"].waiting_prompt_tokens
            ),
            (2, 20)
        );
        assert_eq!(t[DEFAULT_TENANT].attained_tokens, 20.0);
        assert_eq!(t[DEFAULT_TENANT].waiting_requests, 0);
        for (name, st) in &t {
            assert_eq!(&q.tenant(name, 60.0), st, "{name}");
        }
        assert_eq!(q.tenant("nobody", 60.0), TenantStanding::default());
        // a newcomer starts at the floor, one token's service at its arrival, decayed since
        assert_eq!(
            t["light"],
            TenantStanding {
                attained_tokens: 0.5,
                waiting_requests: 1,
                waiting_prompt_tokens: 10,
            }
        );
        // served requests leave the waiting counts; the service stays until forgotten
        assert_eq!(ids(&mut q, 60.0).len(), 3);
        // forgotten below one token: light's tenant and session, and heavy's session z (it
        // had only the floor); heavy's tenant and session s keep theirs
        assert_eq!(q.forget_idle(60.0), 3);
        let t = q.tenants(60.0);
        assert_eq!(t["heavy"].waiting_requests, 0);
        assert_eq!(t["heavy"].attained_tokens, 500.0);
        assert!(!t.contains_key("light"), "no account, nothing waiting");
        // without fairness: no service, only what waits, under the request's tenant
        let mut plain = PendingQueue::new(QueueOrder::Fcfs, big());
        plain.charge(Some("heavy"), None, 1_000, 0.0);
        plain.push(e("p1", 0, 0.0, "", ""), 1).unwrap();
        let t = plain.tenants(0.0);
        assert_eq!(t.len(), 1);
        assert_eq!(t[DEFAULT_TENANT].waiting_requests, 1);
        assert_eq!(t[DEFAULT_TENANT].attained_tokens, 0.0);
    }

    #[test]
    fn set_order_and_cancel_work_inside_flows() {
        let mut q = PendingQueue::fair(QueueOrder::Fcfs, big(), FairConfig::default());
        let mut long = e("long", 0, 0.0, "t", "s");
        long.prompt_tokens = 1_000;
        q.push(long, 1).unwrap();
        q.push(e("short", 0, 1.0, "t", "s"), 1).unwrap();
        q.push(e("other", 0, 2.0, "t", "z"), 1).unwrap();
        q.set_order(QueueOrder::Wspt);
        let order: Vec<_> = q.iter(2.0).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["short", "long", "other"]);
        assert!(q.cancel("short").is_some());
        assert_eq!(q.queued_tokens(), 1_010);
        let all: Vec<_> = q.drain(2.0).into_iter().map(|x| x.request_id).collect();
        assert_eq!(all, ["long", "other"]);
        assert!(q.is_empty());
    }

    fn bounded(max_wait: Option<f64>) -> PendingQueue<u32> {
        PendingQueue::fair(
            QueueOrder::Fcfs,
            big(),
            FairConfig {
                max_wait_secs: max_wait,
                ..FairConfig::default()
            },
        )
    }

    #[test]
    fn an_overdue_request_goes_before_the_fair_order() {
        let mut q = bounded(Some(10.0));
        q.charge(Some("heavy"), Some("long"), 1_000_000, 0.0);
        q.push(e("h1", 0, 0.0, "heavy", "long"), 1).unwrap();
        q.push(e("h2", 0, 1.0, "heavy", "long"), 1).unwrap();
        q.push(e("l1", 0, 5.0, "light", "s"), 1).unwrap();
        q.push(e("l2", 0, 9.5, "light", "t"), 1).unwrap();
        // within the bound: the fair order (light first)
        assert_eq!(q.peek(9.99).unwrap().request_id, "l1");
        let order: Vec<_> = q.iter(9.99).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["l1", "l2", "h1", "h2"]);
        // h1 has waited 10 s: it goes before the light flow's newer requests; h2 not yet
        assert_eq!(q.peek(10.0).unwrap().request_id, "h1");
        let order: Vec<_> = q.iter(10.0).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["h1", "l1", "l2", "h2"]);
        // at 16 s: h1, h2 and l1 are overdue, oldest first, then l2 by the fair order
        let order: Vec<_> = q.iter(16.0).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["h1", "h2", "l1", "l2"]);
        assert_eq!(ids(&mut q, 16.0), order);
        // without a bound the heavy flow stays behind
        let mut u = bounded(None);
        u.charge(Some("heavy"), Some("long"), 1_000_000, 0.0);
        u.push(e("h1", 0, 0.0, "heavy", "long"), 1).unwrap();
        u.push(e("l1", 0, 5.0, "light", "s"), 1).unwrap();
        assert_eq!(ids(&mut u, 1_000.0), ["l1", "h1"]);
        // a plain queue ignores the time
        let mut plain = PendingQueue::new(QueueOrder::Wspt, big());
        let mut long = e("long", 0, 0.0, "", "");
        long.prompt_tokens = 1_000;
        plain.push(long, 1).unwrap();
        plain.push(e("short", 0, 50.0, "", ""), 1).unwrap();
        assert_eq!(ids(&mut plain, 100.0), ["short", "long"]);
    }

    #[test]
    fn the_bound_keeps_classes_strict_and_follows_cancels() {
        let mut q = bounded(Some(1.0));
        q.charge(Some("heavy"), None, 1_000, 0.0);
        q.push(e("old-low", -1, 0.0, "light", ""), 1).unwrap();
        q.push(e("h", 0, 1.0, "heavy", ""), 1).unwrap();
        q.push(e("l", 0, 2.0, "light", ""), 1).unwrap();
        q.push(e("new-high", 1, 9.0, "heavy", ""), 1).unwrap();
        // overdue or not, the higher class goes first; inside class 0, h is overdue at 2.5
        let order: Vec<_> = q.iter(2.5).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["new-high", "h", "l", "old-low"]);
        // a cancelled overdue request leaves the age order too
        assert!(q.cancel("h").is_some());
        assert_eq!(q.pop(2.5).unwrap().request_id, "new-high");
        assert_eq!(q.pop(2.5).unwrap().request_id, "l");
        assert_eq!(q.pop(2.5).unwrap().request_id, "old-low");
        assert!(q.is_empty() && q.pop(2.5).is_none());
        // NaN and infinite times neither panic nor hide an overdue request
        let mut q = bounded(Some(1.0));
        q.charge(Some("heavy"), None, 1_000, 0.0);
        q.push(e("nan", 0, f64::NAN, "light", ""), 1).unwrap();
        q.push(e("h", 0, 0.0, "heavy", ""), 1).unwrap();
        q.push(e("past", 0, f64::NEG_INFINITY, "light", "x"), 1)
            .unwrap();
        assert_eq!(q.peek(f64::NAN).unwrap().request_id, "nan");
        let order: Vec<_> = q.iter(5.0).map(|x| x.request_id.clone()).collect();
        assert_eq!(order, ["past", "h", "nan"]);
        assert_eq!(ids(&mut q, 5.0), order);
    }

    /// A heavy session's turn, queued behind one brand-new light session's turn per service (the
    /// fleet serves one request every `dt` and keeps up with arrivals: under FCFS nothing waits
    /// more than one service): without a bound it waits until its service decays (minutes); with
    /// one, at most the bound plus one service.
    #[test]
    fn a_heavy_turn_waits_at_most_the_bound_plus_one_service() {
        let dt = 0.25;
        let wait_of_heavy = |max_wait: Option<f64>| {
            let mut q = bounded(max_wait);
            q.charge(Some("heavy"), Some("long"), 1_000_000, 0.0);
            q.push(e("heavy-turn", 0, 0.0, "heavy", "long"), 1).unwrap();
            for k in 0..100_000 {
                let now = f64::from(k) * dt;
                q.push(e(&format!("n{k}"), 0, now, "light", &format!("s{k}")), 1)
                    .unwrap();
                let x = q.pop(now).unwrap();
                q.charge(x.tenant.as_deref(), x.session.as_deref(), 10, now);
                if x.request_id == "heavy-turn" {
                    return now;
                }
            }
            f64::INFINITY
        };
        let unbounded = wait_of_heavy(None);
        assert!(unbounded > 300.0, "{unbounded}");
        for bound in [0.5, 2.0, 10.0, 30.0] {
            let w = wait_of_heavy(Some(bound));
            assert!(w >= bound && w <= bound + dt, "bound {bound}: waited {w}");
        }
    }

    // ---- model check ----

    #[derive(Clone, Debug)]
    enum Op {
        Push {
            id: usize,
            class: i32,
            arrival: f64,
            prompt: u32,
            tenant: usize,
            session: usize,
        },
        /// Pop and charge the popped request its prompt at time `t`.
        Pop(u8),
        Cancel(usize),
        Charge {
            tenant: usize,
            session: usize,
            tokens: u64,
            t: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let push = (0usize..12, -1i32..2, 0u8..6, 1u32..40, 0usize..3, 0usize..3).prop_map(
            |(id, class, arrival, prompt, tenant, session)| Op::Push {
                id,
                class,
                arrival: f64::from(arrival),
                prompt,
                tenant,
                session,
            },
        );
        prop_oneof![
            5 => push,
            3 => (0u8..8).prop_map(Op::Pop),
            1 => (0usize..12).prop_map(Op::Cancel),
            2 => (0usize..3, 0usize..3, 0u64..50, 0u8..8)
                .prop_map(|(tenant, session, tokens, t)| Op::Charge { tenant, session, tokens, t }),
        ]
    }

    const TENANTS: [&str; 3] = ["a", "b", "c"];
    const SESSIONS: [&str; 3] = ["", "s1", "s2"];

    /// Brute force: live entries with their sequence; service per flow (half-life 1 s, integer
    /// times: exact powers of two); the sequence at which each flow last became backlogged.
    #[derive(Default)]
    struct Model {
        live: Vec<(u64, QueueEntry<usize>)>,
        seq: u64,
        tenant_service: FxHashMap<String, f64>,
        session_service: FxHashMap<(String, String), f64>,
        tenant_enter: FxHashMap<(i32, String), u64>,
        session_enter: FxHashMap<(i32, String, String), u64>,
    }

    fn tenant_of(e: &QueueEntry<usize>) -> String {
        e.tenant.clone().unwrap_or_else(|| DEFAULT_TENANT.into())
    }
    fn session_of(e: &QueueEntry<usize>) -> String {
        e.session.clone().unwrap_or_default()
    }

    impl Model {
        fn weight(t: &str) -> f64 {
            if t == "b" {
                3.0
            } else {
                1.0
            }
        }
        /// Serving order at `now`: per class, with a bound, the requests that have waited
        /// `bound` by `now` by arrival, then the rest by attained service.
        fn sorted(&self, now: f64, bound: Option<f64>) -> Vec<&QueueEntry<usize>> {
            let mut v: Vec<&(u64, QueueEntry<usize>)> = self.live.iter().collect();
            let key = |(seq, e): &(u64, QueueEntry<usize>)| {
                let late = bound.is_some_and(|b| now - e.arrival_secs >= b);
                let age = if late {
                    (false, Key(e.arrival_secs), *seq)
                } else {
                    (true, Key(0.0), 0)
                };
                let t = tenant_of(e);
                let s = session_of(e);
                let ts = self.tenant_service.get(&t).copied().unwrap_or(0.0) / Self::weight(&t);
                let ss = self
                    .session_service
                    .get(&(t.clone(), s.clone()))
                    .copied()
                    .unwrap_or(0.0);
                (
                    std::cmp::Reverse(e.class),
                    age,
                    Key(ts),
                    self.tenant_enter[&(e.class, t.clone())],
                    t.clone(),
                    Key(ss),
                    self.session_enter[&(e.class, t, s.clone())],
                    s,
                    Key(-QueueOrder::Fcfs.key(e)),
                    *seq,
                )
            };
            v.sort_by_key(|x| key(x));
            v.into_iter().map(|(_, e)| e).collect()
        }

        fn push(&mut self, e: QueueEntry<usize>) {
            let (t, s) = (tenant_of(&e), session_of(&e));
            let base = e.arrival_secs.exp2();
            let class_live: Vec<&QueueEntry<usize>> = self
                .live
                .iter()
                .map(|(_, x)| x)
                .filter(|x| x.class == e.class)
                .collect();
            if !class_live.iter().any(|x| tenant_of(x) == t) {
                let raised = base * Self::weight(&t);
                let own = self.tenant_service.entry(t.clone()).or_insert(0.0);
                if *own < raised {
                    *own = raised;
                }
            }
            if !class_live
                .iter()
                .any(|x| tenant_of(x) == t && session_of(x) == s)
            {
                let own = self
                    .session_service
                    .entry((t.clone(), s.clone()))
                    .or_insert(0.0);
                if *own < base {
                    *own = base;
                }
            }
            self.tenant_enter
                .entry((e.class, t.clone()))
                .or_insert(self.seq);
            self.session_enter
                .entry((e.class, t, s))
                .or_insert(self.seq);
            self.live.push((self.seq, e));
            self.seq += 1;
        }

        fn remove(&mut self, id: &str) -> Option<QueueEntry<usize>> {
            let i = self.live.iter().position(|(_, e)| e.request_id == id)?;
            let e = self.live.remove(i).1;
            let (t, s) = (tenant_of(&e), session_of(&e));
            if !self
                .live
                .iter()
                .any(|(_, x)| x.class == e.class && tenant_of(x) == t)
            {
                self.tenant_enter.remove(&(e.class, t.clone()));
            }
            if !self
                .live
                .iter()
                .any(|(_, x)| x.class == e.class && tenant_of(x) == t && session_of(x) == s)
            {
                self.session_enter.remove(&(e.class, t, s));
            }
            Some(e)
        }

        fn charge(&mut self, t: &str, s: &str, tokens: u64, at: u8) {
            if tokens == 0 {
                return;
            }
            let amount = tokens as f64 * f64::from(at).exp2();
            *self.tenant_service.entry(t.into()).or_insert(0.0) += amount;
            *self
                .session_service
                .entry((t.into(), s.into()))
                .or_insert(0.0) += amount;
        }
    }

    /// Runs `ops` on the queue and the model; `bound`: the starvation bound. The clock is the
    /// time of the latest pop or charge (0 at first; it may go back, which the queue allows).
    fn run(ops: Vec<Op>, bound: Option<f64>) -> Result<(), TestCaseError> {
        let mut weights = FxHashMap::default();
        weights.insert("b".to_string(), 3.0);
        let mut q = PendingQueue::fair(
            QueueOrder::Fcfs,
            big(),
            FairConfig {
                half_life_secs: 1.0,
                tenant_weights: weights,
                default_weight: 1.0,
                max_wait_secs: bound,
            },
        );
        let mut m = Model::default();
        let mut now = 0.0;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Push {
                    id,
                    class,
                    arrival,
                    prompt,
                    tenant,
                    session,
                } => {
                    let e = QueueEntry {
                        request_id: format!("q{id}"),
                        class,
                        priority_jump: 0.0,
                        arrival_secs: arrival,
                        prompt_tokens: prompt,
                        best_cached_tokens: 0,
                        // tenant "c" is sent as no tenant: the default tenant's flow
                        tenant: (tenant != 2).then(|| TENANTS[tenant].to_string()),
                        session: (session != 0).then(|| SESSIONS[session].to_string()),
                        payload: step,
                    };
                    let dup = m.live.iter().any(|(_, x)| x.request_id == e.request_id);
                    let got = q.push(e.clone(), 1);
                    prop_assert_eq!(got.is_err(), dup);
                    if !dup {
                        m.push(e);
                    }
                }
                Op::Pop(t) => {
                    now = f64::from(t);
                    let want = m.sorted(now, bound).first().map(|e| e.request_id.clone());
                    let got = q.pop(now);
                    prop_assert_eq!(got.as_ref().map(|e| e.request_id.clone()), want.clone());
                    if let Some(e) = got {
                        m.remove(&e.request_id);
                        q.charge(
                            e.tenant.as_deref(),
                            e.session.as_deref(),
                            e.prompt_tokens.into(),
                            f64::from(t),
                        );
                        m.charge(&tenant_of(&e), &session_of(&e), e.prompt_tokens.into(), t);
                    }
                }
                Op::Cancel(id) => {
                    let id = format!("q{id}");
                    let want = m.remove(&id).map(|e| e.payload);
                    prop_assert_eq!(q.cancel(&id).map(|e| e.payload), want);
                }
                Op::Charge {
                    tenant,
                    session,
                    tokens,
                    t,
                } => {
                    now = f64::from(t);
                    let name = if tenant == 2 {
                        DEFAULT_TENANT
                    } else {
                        TENANTS[tenant]
                    };
                    q.charge(
                        (tenant != 2).then_some(TENANTS[tenant]),
                        (session != 0).then_some(SESSIONS[session]),
                        tokens,
                        f64::from(t),
                    );
                    m.charge(name, SESSIONS[session], tokens, t);
                }
            }
            prop_assert_eq!(q.len(), m.live.len());
            let want: Vec<String> = m
                .sorted(now, bound)
                .iter()
                .map(|e| e.request_id.clone())
                .collect();
            let got: Vec<String> = q.iter(now).map(|e| e.request_id.clone()).collect();
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(
                q.peek(now).map(|e| e.request_id.clone()),
                want.first().cloned()
            );
            prop_assert_eq!(
                q.queued_tokens(),
                m.live
                    .iter()
                    .map(|(_, e)| u64::from(e.prompt_tokens))
                    .sum::<u64>()
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn fair_queue_matches_sorted_model(ops in prop::collection::vec(op(), 0..60)) {
            run(ops, None)?;
        }

        /// The same with a starvation bound (arrivals 0–5 s, clock 0–7 s: some are overdue).
        #[test]
        fn bounded_fair_queue_matches_sorted_model(
            bound in prop_oneof![Just(1.0), Just(2.5), Just(4.0)],
            ops in prop::collection::vec(op(), 0..60),
        ) {
            run(ops, Some(bound))?;
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Two always-backlogged tenants: in the long run each is served in proportion to its
        /// weight (within 5% of the total served), whatever the request sizes.
        #[test]
        fn weights_are_respected_in_the_long_run(
            w_a in 1.0f64..4.0,
            w_b in 1.0f64..4.0,
            sizes in prop::collection::vec(1u32..200, 64),
        ) {
            let mut weights = FxHashMap::default();
            weights.insert("a".to_string(), w_a);
            weights.insert("b".to_string(), w_b);
            let mut q = PendingQueue::fair(QueueOrder::Fcfs, big(), FairConfig {
                tenant_weights: weights,
                ..FairConfig::default()
            });
            let mut served = [0u64; 2];
            let mut k = 0usize;
            let push = |q: &mut PendingQueue<u32>, t: usize, k: &mut usize| {
                let mut x = e(&format!("r{k}"), 0, *k as f64, ["a", "b"][t], "");
                x.prompt_tokens = sizes[*k % sizes.len()];
                x.payload = t as u32;
                q.push(x, 1).unwrap();
                *k += 1;
            };
            for _ in 0..4 {
                push(&mut q, 0, &mut k);
                push(&mut q, 1, &mut k);
            }
            // a millisecond per serve: the 60 s half-life barely decays over the run
            for step in 0..4_000 {
                let x = q.pop(step as f64 * 1e-3).unwrap();
                let t = x.payload as usize;
                served[t] += u64::from(x.prompt_tokens);
                q.charge(x.tenant.as_deref(), None, x.prompt_tokens.into(), step as f64 * 1e-3);
                push(&mut q, t, &mut k);
            }
            let total = (served[0] + served[1]) as f64;
            let want_a = w_a / (w_a + w_b);
            let got_a = served[0] as f64 / total;
            prop_assert!((got_a - want_a).abs() < 0.05, "a got {got_a}, weight share {want_a}");
        }

        /// No flow starves: a session with a large service waits behind a stream of brand-new
        /// sessions (as many as are served: the fleet keeps up) only until the newcomers' floor (one token now, doubling every half-life) passes its
        /// decayed service: about `half_life × log2(service)`.
        #[test]
        fn no_flow_starves_behind_newcomers(
            heavy in 1_000u64..10_000_000,
            per_newcomer in 1u32..100,
        ) {
            let half_life = 10.0;
            // the fair order alone: the decay is what must end the wait
            let mut q = PendingQueue::fair(QueueOrder::Fcfs, big(), FairConfig {
                half_life_secs: half_life,
                max_wait_secs: None,
                ..FairConfig::default()
            });
            q.charge(Some("t"), Some("old"), heavy, 0.0);
            q.push(e("old-turn", 0, 0.0, "t", "old"), 1).unwrap();
            let dt = 0.1; // one serve every 100 ms
            let bound = (half_life / dt * ((heavy as f64).log2() + 2.0)).ceil() as usize;
            let mut served_old = None;
            for k in 0..=bound {
                let now = k as f64 * dt;
                let mut x = e(&format!("n{k}"), 0, now, "t", &format!("new{k}"));
                x.prompt_tokens = per_newcomer;
                q.push(x, 1).unwrap();
                let got = q.pop(now).unwrap();
                q.charge(got.tenant.as_deref(), got.session.as_deref(), got.prompt_tokens.into(), now);
                if got.request_id == "old-turn" {
                    served_old = Some(k);
                    break;
                }
            }
            prop_assert!(served_old.is_some(), "not served within {bound} serves");
        }

        /// The starvation bound against a brute-force FCFS run of the same arrivals: a server
        /// takes the queue's head every `dt` (one service each), any flows, heavy charges, long
        /// half-life. Every request is served within the bound plus the wait FCFS would have given
        /// it plus one service (from its bound on, every serve goes to a request that arrived no
        /// later than it, as FCFS's do); where FCFS has no wait, that is the bound plus one
        /// service.
        #[test]
        fn no_request_waits_past_the_bound_plus_its_fcfs_wait_and_one_service(
            bound in 0.1f64..5.0,
            arrivals in prop::collection::vec(
                (0u32..400, 0usize..3, 0usize..4, 0u64..5_000),
                1..120,
            ),
            heavy in prop::collection::vec(0u64..1_000_000, 3),
        ) {
            let dt = 0.1;
            // arrivals in 10 ms steps over 4 s, sorted: push order is arrival order
            let mut arrivals = arrivals;
            arrivals.sort_by_key(|a| a.0);
            let reqs: Vec<(f64, String, String, u64)> = arrivals
                .iter()
                .map(|&(at, t, s, tokens)| {
                    let tenant = ["a", "b", "c"][t].to_string();
                    (f64::from(at) * 0.01, tenant, format!("s{t}{s}"), tokens)
                })
                .collect();
            // brute-force FCFS: served in arrival order, one per tick when any is waiting
            let mut fcfs_wait = vec![0.0; reqs.len()];
            let mut tick = 0u64;
            for (i, r) in reqs.iter().enumerate() {
                while (tick as f64) * dt < r.0 {
                    tick += 1;
                }
                fcfs_wait[i] = tick as f64 * dt - r.0;
                tick += 1;
            }
            let mut q: PendingQueue<u32> = PendingQueue::fair(QueueOrder::Fcfs, big(), FairConfig {
                half_life_secs: 600.0,
                max_wait_secs: Some(bound),
                ..FairConfig::default()
            });
            // each tenant, and its first session, with a past of its own
            for (i, (t, h)) in ["a", "b", "c"].iter().zip(&heavy).enumerate() {
                q.charge(Some(*t), Some(format!("s{i}0").as_str()), *h, 0.0);
            }
            let mut next = 0;
            let mut served = 0;
            let mut k = 0u64;
            while served < reqs.len() {
                let now = k as f64 * dt;
                while next < reqs.len() && reqs[next].0 <= now {
                    let (at, t, s, _) = &reqs[next];
                    let mut x = e(&format!("r{next}"), 0, *at, t, s);
                    x.payload = next as u32;
                    q.push(x, 1).unwrap();
                    next += 1;
                }
                if let Some(x) = q.pop(now) {
                    let i = x.payload as usize;
                    let waited = now - reqs[i].0;
                    prop_assert!(
                        waited <= bound + fcfs_wait[i] + dt + 1e-9,
                        "r{i} waited {waited} s: bound {bound}, FCFS wait {}", fcfs_wait[i]
                    );
                    q.charge(x.tenant.as_deref(), x.session.as_deref(), reqs[i].3, now);
                    served += 1;
                }
                k += 1;
            }
        }
    }
}
