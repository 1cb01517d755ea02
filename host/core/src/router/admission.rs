//! Queue admission: when queueing is on (a busy threshold is set) and every eligible candidate is
//! busy, a booked request waits in the [`crate::queue`] and is scored afresh whenever capacity
//! may have freed ([`Router::pump`], called by every call that frees load or changes workers).
//!
//! Lock order: `pump` holds the queue's lock while it decides, and deciding takes the load
//! tracker's; so nothing here takes the queue's lock while holding the load's.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::request::Prepared;
use super::{RouteDecision, RouteError, RouteRequest, Router};
use crate::queue::{PendingQueue, QueueEntry, QueueOrder, DEFAULT_TENANT};

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
                    let _ = self.router.release_booking(&decision.request_id);
                }
            }
        }
    }
}

/// A queued request: what is scored when it reaches the head, and where its answer goes.
pub(super) struct Waiter {
    prepared: Arc<Prepared>,
    enqueued: Instant,
    pub(super) tx: tokio::sync::oneshot::Sender<Result<RouteDecision, RouteError>>,
}

impl Router {
    /// Routes a request. With queueing on, waits (asynchronously) while every eligible candidate
    /// is busy, up to the queue timeout.
    pub async fn route(&self, req: RouteRequest) -> Result<RouteDecision, RouteError> {
        let mut prepared = self.prepare(req)?;
        if self.overlap_source.load().is_some() {
            prepared.external = self.external_overlaps(&prepared.local).await;
        }
        let prepared = Arc::new(prepared);
        self.admit_budget(&prepared)?;
        if self.busy.threshold_frac.is_none() || !prepared.req.book {
            let d = self.decide(&prepared, Duration::ZERO);
            return self.charged(&prepared, d);
        }
        let class = prepared.req.priority_class;
        let backlog = self.queue.lock().has_backlog_at_or_above(class);
        if !backlog {
            match self.decide(&prepared, Duration::ZERO) {
                Err(RouteError::AllOverloaded) => {}
                other => return self.charged(&prepared, other),
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let entry = QueueEntry {
            request_id: prepared.request_id.clone(),
            class,
            priority_jump: prepared.req.priority,
            arrival_secs: self.clock_secs(),
            prompt_tokens: prepared.prompt_tokens,
            best_cached_tokens: self.best_cached_tokens(&prepared),
            tenant: prepared.req.tenant.clone(),
            session: prepared.req.session_id.clone(),
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
        crate::cost::cached_tokens(best, p.prompt_tokens, self.config.block_size)
    }

    /// Routes without waiting: a busy fleet is an immediate retryable error. For callers without an
    /// async runtime (benchmarks, replay).
    pub fn route_now(&self, req: RouteRequest) -> Result<RouteDecision, RouteError> {
        let prepared = self.prepare(req)?;
        self.admit_budget(&prepared)?;
        let d = self.decide(&prepared, Duration::ZERO);
        self.charged(&prepared, d)
    }

    /// Checks and counts the request against its tenant's budget (booked requests only).
    fn admit_budget(&self, p: &Prepared) -> Result<(), RouteError> {
        if !p.req.book {
            return Ok(());
        }
        let mut budgets = self.budgets.lock();
        if budgets.is_empty() {
            return Ok(());
        }
        let tenant = p.req.tenant.as_deref().unwrap_or(DEFAULT_TENANT);
        let tokens =
            u64::from(p.prompt_tokens) + u64::from(p.req.expected_output_tokens.unwrap_or(0));
        budgets
            .admit(tenant, tokens, self.clock_secs() as u64)
            .map_err(RouteError::OverBudget)
    }

    /// Charges a booked decision's service to its tenant and session (fair queueing), then hands
    /// the result back.
    fn charged(
        &self,
        p: &Prepared,
        result: Result<RouteDecision, RouteError>,
    ) -> Result<RouteDecision, RouteError> {
        if let Ok(d) = &result {
            self.charge(&mut self.queue.lock(), p, d);
        }
        result
    }

    /// What a decision serves (SPEC §9, "Fairness"): the prompt tokens the chosen worker computes
    /// plus the output tokens the request expects.
    fn charge(&self, queue: &mut PendingQueue<Waiter>, p: &Prepared, d: &RouteDecision) {
        if !d.booked || queue.fairness().is_none() {
            return;
        }
        let tokens = u64::from(d.prompt_tokens.saturating_sub(d.cached_tokens))
            + u64::from(p.req.expected_output_tokens.unwrap_or(0));
        queue.charge(
            p.req.tenant.as_deref(),
            p.req.session_id.as_deref(),
            tokens,
            self.clock_secs(),
        );
    }

    /// Serves waiting requests, in queue order, while capacity allows. The order is taken at
    /// the time of the call (a fair queue's starvation bound: who is overdue by now).
    pub fn pump(&self) {
        let now = self.clock_secs();
        let mut queue = self.queue.lock();
        while let Some(entry) = queue.peek(now) {
            if entry.payload.tx.is_closed() {
                queue.pop(now);
                continue;
            }
            let waited = entry.payload.enqueued.elapsed();
            let result = self.decide(&entry.payload.prepared, waited);
            if matches!(result, Err(RouteError::AllOverloaded)) {
                break;
            }
            let entry = queue.pop(now).expect("peeked");
            if let Ok(d) = &result {
                self.charge(&mut queue, &entry.payload.prepared, d);
            }
            if let Err(Ok(decision)) = entry.payload.tx.send(result) {
                if decision.booked {
                    let _ = self.release_booking(&decision.request_id);
                }
            }
        }
    }
}
