//! A policy version's failure rate over its most recent decisions.
//!
//! Consecutive failures alone miss a policy that fails every second or third call: it never fails
//! `max_consecutive_failures` times in a row, yet falls back on a third or half of all routes for
//! ever. So the registry also keeps, per version, whether each of the last `failure_window`
//! decisions failed, and takes the version out when more than `max_failure_rate` of a full window
//! failed. One bit per decision in a ring, behind a lock held for a few instructions (an
//! uncontended `parking_lot` lock is one atomic swap each way).

use parking_lot::Mutex;

/// The outcomes of the last `size` decisions, one bit each (1 = failed).
pub(crate) struct FailureWindow {
    ring: Mutex<Ring>,
}

struct Ring {
    bits: Vec<u64>,
    size: usize,
    /// The slot the next outcome goes to.
    pos: usize,
    /// Outcomes recorded, up to `size`.
    filled: usize,
    failures: usize,
}

impl FailureWindow {
    /// A window of `size` decisions (0: disabled, nothing is recorded).
    pub(crate) fn new(size: usize) -> Self {
        Self {
            ring: Mutex::new(Ring {
                bits: vec![0; size.div_ceil(64)],
                size,
                pos: 0,
                filled: 0,
                failures: 0,
            }),
        }
    }

    /// Records one decision; returns the failures in the window and whether it is full.
    pub(crate) fn record(&self, failed: bool) -> (usize, bool) {
        let mut r = self.ring.lock();
        if r.size == 0 {
            return (0, false);
        }
        let (word, bit) = (r.pos / 64, 1u64 << (r.pos % 64));
        let was = r.bits[word] & bit != 0;
        if was != failed {
            r.bits[word] ^= bit;
            if failed {
                r.failures += 1;
            } else {
                r.failures -= 1;
            }
        }
        r.pos = (r.pos + 1) % r.size;
        r.filled = (r.filled + 1).min(r.size);
        (r.failures, r.filled == r.size)
    }

    /// Forgets every outcome (after the version was taken out).
    pub(crate) fn clear(&self) {
        let mut r = self.ring.lock();
        r.bits.iter_mut().for_each(|w| *w = 0);
        r.pos = 0;
        r.filled = 0;
        r.failures = 0;
    }

    /// The share of failed decisions among those recorded (0 when none).
    pub(crate) fn rate(&self) -> f64 {
        let r = self.ring.lock();
        if r.filled == 0 {
            0.0
        } else {
            r.failures as f64 / r.filled as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_last_size_outcomes() {
        let w = FailureWindow::new(100);
        for i in 0..100 {
            let (f, full) = w.record(i % 4 == 0);
            assert_eq!(full, i == 99, "{i}");
            assert_eq!(f, i / 4 + 1, "{i}");
        }
        assert!((w.rate() - 0.25).abs() < 1e-9);
        // 100 successes push every failure out.
        for _ in 0..99 {
            w.record(false);
        }
        assert_eq!(w.record(false), (0, true));
        w.record(true);
        w.clear();
        assert_eq!(w.rate(), 0.0);
        assert_eq!(w.record(true), (1, false));
        assert_eq!(FailureWindow::new(0).record(true), (0, false));
    }
}
