//! Each worker's health as the proxy sees it: a circuit breaker over consecutive failures.
//!
//! A failure is a connection that could not be made or broke before the answer's first byte, a
//! 5xx answer, or a stream the engine cut short. `failure_threshold` failures in a row mark the
//! worker *failing*: the proxy leaves it out of its routes (as if not in `allowed_worker_ids`)
//! and a probe (`GET {endpoint}/health`) every `probe_interval_ms` brings it back on its first
//! success. Any success resets the count. Why a breaker and not only the retry: without it, every
//! request routed to a dead engine would pay a failed connection before its retry, and a KV-aware
//! router keeps choosing the engine that holds the prefix, dead or not.
//!
//! The table is keyed by worker id; entries of removed workers are dropped by the probe loop.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use kvroute_core::candidate::WorkerId;

use kvroute_api::dto::HealthOut;

/// One worker's breaker.
#[derive(Clone, Copy, Debug, Default)]
struct Breaker {
    consecutive_failures: u32,
    failing_since: Option<Instant>,
    last_failure: Option<Instant>,
}

/// The breakers of every worker the proxy has talked to.
#[derive(Debug)]
pub struct Health {
    threshold: u32,
    breakers: Mutex<FxHashMap<WorkerId, Breaker>>,
}

impl Health {
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: threshold.max(1),
            breakers: Mutex::new(FxHashMap::default()),
        }
    }

    /// Counts a failure; `true` when it makes the worker failing.
    pub fn failure(&self, w: WorkerId) -> bool {
        let mut b = self.breakers.lock();
        let e = b.entry(w).or_default();
        e.consecutive_failures = e.consecutive_failures.saturating_add(1);
        e.last_failure = Some(Instant::now());
        if e.failing_since.is_none() && e.consecutive_failures >= self.threshold {
            e.failing_since = Some(Instant::now());
            return true;
        }
        false
    }

    /// A success: the count restarts and a failing worker is back. `true` when it was failing.
    pub fn success(&self, w: WorkerId) -> bool {
        let mut b = self.breakers.lock();
        match b.get_mut(&w) {
            Some(e) => {
                let was = e.failing_since.is_some();
                e.consecutive_failures = 0;
                e.failing_since = None;
                was
            }
            None => false,
        }
    }

    pub fn is_failing(&self, w: WorkerId) -> bool {
        self.breakers
            .lock()
            .get(&w)
            .is_some_and(|e| e.failing_since.is_some())
    }

    /// The failing workers, for the probe loop and the route filter.
    pub fn failing(&self) -> Vec<WorkerId> {
        let mut v: Vec<WorkerId> = self
            .breakers
            .lock()
            .iter()
            .filter(|(_, e)| e.failing_since.is_some())
            .map(|(w, _)| *w)
            .collect();
        v.sort_unstable();
        v
    }

    pub fn status(&self, w: WorkerId) -> HealthOut {
        let e = self.breakers.lock().get(&w).copied().unwrap_or_default();
        HealthOut {
            state: if e.failing_since.is_some() {
                "failing"
            } else {
                "ok"
            },
            consecutive_failures: e.consecutive_failures,
            last_failure_ms_ago: e.last_failure.map(|t| t.elapsed().as_millis() as u64),
        }
    }

    /// Forgets workers that are no longer registered.
    pub fn retain(&self, keep: impl Fn(WorkerId) -> bool) {
        self.breakers.lock().retain(|w, _| keep(*w));
    }
}

/// How long a probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_after_the_threshold_and_closes_on_success() {
        let h = Health::new(3);
        assert!(!h.failure(7));
        assert!(!h.failure(7));
        assert!(!h.is_failing(7));
        assert!(h.failure(7), "the third failure in a row opens it");
        assert!(h.is_failing(7));
        assert_eq!(h.failing(), vec![7]);
        assert_eq!(h.status(7).state, "failing");
        assert_eq!(h.status(7).consecutive_failures, 3);
        assert!(!h.failure(7), "already failing: not newly failing");
        assert!(h.success(7));
        assert!(!h.is_failing(7));
        assert_eq!(h.status(7).consecutive_failures, 0);
        // A success between failures restarts the count.
        h.failure(7);
        h.failure(7);
        h.success(7);
        h.failure(7);
        assert!(!h.is_failing(7));
        assert_eq!(h.status(8).state, "ok");
        h.retain(|w| w != 7);
        assert_eq!(h.status(7).consecutive_failures, 0);
    }
}
