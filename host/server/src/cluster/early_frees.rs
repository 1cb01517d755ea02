//! Frees that overtook their booking.
//!
//! NATS keeps the order of one publisher's messages, not of two: when replica C frees a request
//! that replica A booked, a third replica B may receive C's `free` before A's `book` (C applied
//! A's booking before freeing it, but the two messages travel from different connections). B then
//! has nothing to free, and without this note it would count A's booking, arriving just after,
//! until expiry. So a `free` for a request not booked here is remembered for a short while, and
//! the first `book` of that id from another replica within it is not applied.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long an early free is remembered: far longer than messages take between replicas.
pub const REMEMBER: Duration = Duration::from_secs(2);

/// Most early frees remembered at once (beyond that the oldest are forgotten first).
const MAX: usize = 4096;

/// Request ids freed before this replica saw them booked, with when.
#[derive(Debug, Default)]
pub struct EarlyFrees {
    ids: Mutex<HashMap<String, Instant>>,
}

impl EarlyFrees {
    /// Remembers that `request_id` was freed at `now` while not booked here.
    pub fn note(&self, request_id: &str, now: Instant) {
        let mut ids = self.ids.lock();
        ids.retain(|_, t| now.saturating_duration_since(*t) <= REMEMBER);
        if ids.len() >= MAX {
            if let Some(oldest) = ids.iter().min_by_key(|(_, t)| **t).map(|(k, _)| k.clone()) {
                ids.remove(&oldest);
            }
        }
        ids.insert(request_id.to_owned(), now);
    }

    /// Whether a booking of `request_id` arriving at `now` was already freed: true once (the
    /// note is consumed, so a later booking of the same id counts).
    pub fn take(&self, request_id: &str, now: Instant) -> bool {
        let mut ids = self.ids.lock();
        if ids.is_empty() {
            return false;
        }
        match ids.remove(request_id) {
            Some(t) => now.saturating_duration_since(t) <= REMEMBER,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_early_free_cancels_one_booking_within_its_window() {
        let e = EarlyFrees::default();
        let t0 = Instant::now();
        assert!(!e.take("r", t0));
        e.note("r", t0);
        assert!(e.take("r", t0 + Duration::from_millis(5)));
        // Consumed: the next booking of the id counts.
        assert!(!e.take("r", t0 + Duration::from_millis(6)));
        e.note("s", t0);
        assert!(!e.take("s", t0 + REMEMBER + Duration::from_millis(1)));
    }
}
