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
//! # Limits
//!
//! [`QueueLimits`] are per worker and scale with the number of registered workers (at least one
//! worker's worth): at most `max_requests_per_worker × workers` requests and
//! `max_tokens_per_worker × workers` queued prompt tokens. A push past either is rejected at once
//! ([`QueueError::Full`], naming the limit) so the router can answer a retryable 429/503 instead of
//! letting latency grow without bound.
//!
//! The queue is a plain data structure: the router owns it behind a lock and does the waiting (one
//! oneshot channel per entry, carried in the payload). Push, pop and cancel are O(log n).

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

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

/// Position of an entry: class descending, key descending, insertion sequence ascending.
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

/// Requests waiting for capacity, in serving order. See the module docs.
#[derive(Debug)]
pub struct PendingQueue<T> {
    order: QueueOrder,
    limits: QueueLimits,
    /// Serving order: the first entry is the next to serve.
    entries: BTreeMap<Slot, QueueEntry<T>>,
    index: FxHashMap<String, Slot>,
    tokens: u64,
    next_seq: u64,
    /// Set by [`Self::close`]: nothing is served any more, so nothing may join.
    closed: bool,
}

impl<T> PendingQueue<T> {
    pub fn new(order: QueueOrder, limits: QueueLimits) -> Self {
        Self {
            order,
            limits,
            entries: BTreeMap::new(),
            index: FxHashMap::default(),
            tokens: 0,
            next_seq: 0,
            closed: false,
        }
    }

    pub fn order(&self) -> QueueOrder {
        self.order
    }

    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// New limits apply to later pushes; nothing already waiting is dropped.
    pub fn set_limits(&mut self, limits: QueueLimits) {
        self.limits = limits;
    }

    /// Queues `entry`. `workers` = number of registered workers now (limits scale with it, at least
    /// one worker's worth). Rejects at once, giving the entry back, if the request id is already
    /// queued or admitting it would pass a limit (requests checked before tokens).
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
        if self.entries.len() >= max_requests {
            let err = QueueError::Full {
                limit: QueueLimitKind::Requests,
                current: self.entries.len() as u64,
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
        let slot = Slot {
            class: entry.class,
            key: self.order.key(&entry),
            seq: self.next_seq,
        };
        self.next_seq += 1;
        self.tokens += u64::from(entry.prompt_tokens);
        self.index.insert(entry.request_id.clone(), slot);
        self.entries.insert(slot, entry);
        Ok(())
    }

    /// The next request to serve.
    pub fn peek(&self) -> Option<&QueueEntry<T>> {
        self.entries.first_key_value().map(|(_, e)| e)
    }

    /// Removes and returns the next request to serve.
    pub fn pop(&mut self) -> Option<QueueEntry<T>> {
        let (_, entry) = self.entries.pop_first()?;
        self.index.remove(&entry.request_id);
        self.tokens -= u64::from(entry.prompt_tokens);
        Some(entry)
    }

    /// Removes a waiting request (client gone, deadline passed). O(log n).
    pub fn cancel(&mut self, request_id: &str) -> Option<QueueEntry<T>> {
        let slot = self.index.remove(request_id)?;
        let entry = self
            .entries
            .remove(&slot)
            .expect("every indexed request is queued");
        self.tokens -= u64::from(entry.prompt_tokens);
        Some(entry)
    }

    /// Whether anyone of `class` or a higher class is waiting: a new arrival of `class` must then
    /// queue behind them instead of being routed at once.
    pub fn has_backlog_at_or_above(&self, class: i32) -> bool {
        self.entries
            .first_key_value()
            .is_some_and(|(slot, _)| slot.class >= class)
    }

    pub fn contains(&self, request_id: &str) -> bool {
        self.index.contains_key(request_id)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sum of the prompt tokens of the waiting requests.
    pub fn queued_tokens(&self) -> u64 {
        self.tokens
    }

    /// Waiting requests in serving order.
    pub fn iter(&self) -> impl Iterator<Item = &QueueEntry<T>> + '_ {
        self.entries.values()
    }

    /// Switches the within-class order and re-sorts what is waiting. Ties keep falling to the
    /// original insertion order.
    pub fn set_order(&mut self, order: QueueOrder) {
        if order == self.order {
            return;
        }
        self.order = order;
        let old = std::mem::take(&mut self.entries);
        for (slot, entry) in old {
            let slot = Slot {
                key: order.key(&entry),
                ..slot
            };
            *self
                .index
                .get_mut(&entry.request_id)
                .expect("every queued request is indexed") = slot;
            self.entries.insert(slot, entry);
        }
    }

    /// Empties the queue for good (shutdown), returning everything in serving order. Later
    /// callers check [`Self::is_closed`] before waiting.
    pub fn close(&mut self) -> Vec<QueueEntry<T>> {
        self.closed = true;
        self.drain()
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Empties the queue, returning everything in serving order.
    pub fn drain(&mut self) -> Vec<QueueEntry<T>> {
        self.index.clear();
        self.tokens = 0;
        std::mem::take(&mut self.entries).into_values().collect()
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
        std::iter::from_fn(|| q.pop())
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
        assert_eq!(q.peek().unwrap().request_id, "jumper");
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
        q.pop().unwrap();
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
        assert_eq!(q.peek().unwrap().class, 0);
        // once gone, the id may come back
        q.pop().unwrap();
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
        assert!(q.pop().is_none());
        assert!(q.peek().is_none());
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
        assert_eq!(q.iter().next().unwrap().request_id, "vip");
        q.set_order(QueueOrder::Wspt);
        assert_eq!(q.order(), QueueOrder::Wspt);
        let order: Vec<_> = q.iter().map(|e| e.request_id.as_str()).collect();
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
        let all: Vec<_> = q.drain().into_iter().map(|e| e.request_id).collect();
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
                payload: NotClone,
            },
            1,
        )
        .map_err(|(e, _)| e)
        .unwrap();
        assert!(matches!(q.pop().map(|e| e.payload), Some(NotClone)));
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
                    let got = q.pop();
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
            prop_assert!(same(q.peek(), sorted.first().copied()));
            let got: Vec<&str> = q.iter().map(|e| e.request_id.as_str()).collect();
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
        let got: Vec<usize> = q.drain().into_iter().map(|e| e.payload).collect();
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
