//! Per-policy counters and a lock-free latency histogram.
//!
//! Everything here is written on the request path, so it is plain atomics: a call is two
//! `fetch_add`s (the call counter and one histogram bucket). Percentiles are computed on read.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

use super::error::FallbackReason;

/// Log-bucketed histogram of durations in nanoseconds: 8 sub-buckets per power of two, so every
/// bucket is within 12.5% of its values (HDR-style, 3 significant bits). Values below 8 ns are exact.
pub struct LatencyHistogram {
    buckets: Box<[AtomicU64]>,
}

const SUB_BITS: u32 = 3;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = (SUB as usize) + (64 - SUB_BITS as usize) * SUB as usize;

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl LatencyHistogram {
    #[inline]
    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let e = 63 - v.leading_zeros(); // >= SUB_BITS
        let mantissa = (v >> (e - SUB_BITS)) & (SUB - 1);
        (SUB + u64::from(e - SUB_BITS) * SUB + mantissa) as usize
    }

    /// Smallest value that falls in bucket `i`.
    fn lower_bound(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let e = (i - SUB) / SUB + u64::from(SUB_BITS);
        let mantissa = (i - SUB) % SUB;
        (SUB + mantissa) << (e - u64::from(SUB_BITS))
    }

    /// Records one duration in nanoseconds.
    #[inline]
    pub fn record(&self, nanos: u64) {
        self.buckets[Self::index(nanos)].fetch_add(1, Relaxed);
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Relaxed)).sum()
    }

    /// The `q`-quantile (0..=1) in nanoseconds, as the midpoint of its bucket; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let lo = Self::lower_bound(i);
                let hi = if i + 1 < BUCKETS {
                    Self::lower_bound(i + 1)
                } else {
                    u64::MAX
                };
                return lo + (hi - lo) / 2;
            }
        }
        u64::MAX
    }
}

/// Counters of one loaded policy version.
#[derive(Default)]
pub struct PolicyStats {
    calls: AtomicU64,
    fallbacks: AtomicU64,
    errors: [AtomicU64; FallbackReason::ALL.len()],
    log_dropped: AtomicU64,
    latency: LatencyHistogram,
    /// The version's log allowance (token bucket: tokens, last refill; `None` until the first
    /// line). Shared by every instance of every stage of the version.
    log_bucket: parking_lot::Mutex<Option<(f64, std::time::Instant)>>,
}

impl PolicyStats {
    #[inline]
    pub(crate) fn record_ok(&self, nanos: u64) {
        self.calls.fetch_add(1, Relaxed);
        self.latency.record(nanos);
    }

    #[inline]
    pub(crate) fn record_failure(&self, reason: FallbackReason, nanos: u64) {
        self.calls.fetch_add(1, Relaxed);
        self.fallbacks.fetch_add(1, Relaxed);
        self.errors[reason.index()].fetch_add(1, Relaxed);
        self.latency.record(nanos);
    }

    /// Takes one line from the version's log allowance (`rate` lines a second, bursts of
    /// `burst`); false when it is used up.
    pub(crate) fn take_log_token(&self, rate: f64, burst: f64) -> bool {
        let now = std::time::Instant::now();
        let mut bucket = self.log_bucket.lock();
        let (tokens, last) = bucket.get_or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(burst);
        *last = now;
        if *tokens < 1.0 {
            return false;
        }
        *tokens -= 1.0;
        true
    }

    pub(crate) fn record_log_dropped(&self) {
        self.log_dropped.fetch_add(1, Relaxed);
    }

    /// Failures of one kind so far.
    pub fn errors_of(&self, reason: FallbackReason) -> u64 {
        self.errors[reason.index()].load(Relaxed)
    }

    /// A consistent-enough copy of the counters (each counter is read once, without a lock).
    pub fn snapshot(&self) -> StatsSnapshot {
        let by_kind: Vec<(FallbackReason, u64)> = FallbackReason::ALL
            .iter()
            .map(|&r| (r, self.errors[r.index()].load(Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect();
        StatsSnapshot {
            calls: self.calls.load(Relaxed),
            errors: by_kind.iter().map(|&(_, n)| n).sum(),
            fallbacks: self.fallbacks.load(Relaxed),
            errors_by_kind: by_kind.into_iter().map(|(r, n)| (r.as_str(), n)).collect(),
            log_dropped: self.log_dropped.load(Relaxed),
            p50_us: self.latency.quantile(0.50) as f64 / 1000.0,
            p99_us: self.latency.quantile(0.99) as f64 / 1000.0,
            recent_failure_rate: 0.0,
        }
    }
}

/// Counters of one policy version as reported by `list()` and `GET /v1/policies`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatsSnapshot {
    /// Decisions this version was asked for.
    pub calls: u64,
    /// Failed decisions (trap, deadline, invalid answer, ...), all kinds together.
    pub errors: u64,
    /// Decisions answered with the native cost because of a failure.
    pub fallbacks: u64,
    /// Failures by kind (`trap`, `deadline`, `memory_limit`, `invalid_length`, `non_finite`,
    /// `pick_out_of_range`, `unexpected_pick`, `instantiate`); kinds with zero are left out.
    pub errors_by_kind: std::collections::BTreeMap<&'static str, u64>,
    /// Plugin log lines dropped by the rate limiter.
    pub log_dropped: u64,
    /// Median decision latency through the policy, in microseconds (bucket midpoint).
    pub p50_us: f64,
    /// 99th percentile decision latency, in microseconds (bucket midpoint).
    pub p99_us: f64,
    /// Share of failed decisions among the last `failure_window` (fewer while the window fills).
    pub recent_failure_rate: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        let mut last = 0;
        for v in (0..100_000u64).chain([1 << 40, u64::MAX]) {
            let i = LatencyHistogram::index(v);
            assert!(i >= last, "{v}");
            last = i;
            let lo = LatencyHistogram::lower_bound(i);
            assert!(lo <= v, "{v} {lo}");
            if i + 1 < BUCKETS {
                let hi = LatencyHistogram::lower_bound(i + 1);
                assert!(v < hi, "{v} {hi}");
                assert!((hi - lo) as f64 <= (lo as f64 / 8.0).max(1.0));
            }
        }
    }

    #[test]
    fn quantiles() {
        let h = LatencyHistogram::default();
        for v in 1..=1000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.07, "{p50}");
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.07, "{p99}");
        assert_eq!(LatencyHistogram::default().quantile(0.5), 0);
    }
}
