//! An open-loop phase in time (`--timeline`): per 100 ms of send time, how many queries went
//! out, their service time and the worst send lag.
//!
//! The summary's quantiles say how large a tail was, not when it happened. A p99 made of one
//! phase that starts behind its schedule and takes a second to catch up looks the same there as
//! a stall in the middle of the window, or as a generator that never keeps up; here the three
//! look different. The sends per second of a bucket whose lag grows are what the arrangement
//! (server, generator, connections) delivers when it is behind: its capacity at that moment.

use std::time::Duration;

/// Width of one bucket.
pub const BUCKET: Duration = Duration::from_millis(100);

/// The queries sent in one bucket that were answered 200.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub sends: u64,
    pub service_sum_ns: u64,
    pub service_max_ns: u64,
    pub lag_max_ns: u64,
}

/// Buckets from the phase's start, by actual send time.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    buckets: Vec<Bucket>,
    /// The phase's start as Unix time (s), to line the buckets up with other recorders
    /// (`/proc/stat` samplers, `perf sched`); 0 if not set.
    start_unix: f64,
}

impl Timeline {
    /// An empty timeline of a phase that starts `lead` from now.
    pub fn starting_in(lead: Duration) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Timeline {
            buckets: Vec::new(),
            start_unix: (now + lead).as_secs_f64(),
        }
    }

    /// Records one answered query sent `sent` after the phase's start, answered in `service`,
    /// `lag` after its scheduled time.
    pub fn record(&mut self, sent: Duration, service: Duration, lag: Duration) {
        let i = (sent.as_nanos() / BUCKET.as_nanos()) as usize;
        if self.buckets.len() <= i {
            self.buckets.resize(i + 1, Bucket::default());
        }
        let b = &mut self.buckets[i];
        let (service, lag) = (service.as_nanos() as u64, lag.as_nanos() as u64);
        b.sends += 1;
        b.service_sum_ns += service;
        b.service_max_ns = b.service_max_ns.max(service);
        b.lag_max_ns = b.lag_max_ns.max(lag);
    }

    /// Adds another sender's timeline of the same phase.
    pub fn merge(&mut self, other: &Timeline) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), Bucket::default());
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            a.sends += b.sends;
            a.service_sum_ns += b.service_sum_ns;
            a.service_max_ns = a.service_max_ns.max(b.service_max_ns);
            a.lag_max_ns = a.lag_max_ns.max(b.lag_max_ns);
        }
    }

    #[cfg(test)]
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Prints one line per bucket; buckets that start before `warmup` are marked `w`.
    pub fn print(&self, title: &str, warmup: Duration) {
        println!(
            "# timeline of {title}, from Unix time {:.3}: per {} ms of send time (w = warm-up, not in the figures above)",
            self.start_unix,
            BUCKET.as_millis()
        );
        println!(
            "# {:>7} {:>9} {:>9} {:>9} {:>9}",
            "t_s", "sends/s", "svc_avg", "svc_max", "lag_max"
        );
        let per_s = 1e9 / BUCKET.as_nanos() as f64;
        for (i, b) in self.buckets.iter().enumerate() {
            let from = BUCKET * i as u32;
            let mark = if from < warmup { "w" } else { " " };
            let avg = b.service_sum_ns.checked_div(b.sends).unwrap_or(0);
            println!(
                "# {:>6.1}{mark} {:>9.0} {:>9.3} {:>9.3} {:>9.3}",
                from.as_secs_f64(),
                b.sends as f64 * per_s,
                avg as f64 / 1e6,
                b.service_max_ns as f64 / 1e6,
                b.lag_max_ns as f64 / 1e6,
            );
        }
    }
}

/// A latency histogram in nanoseconds (1 ns to 120 s, 3 significant digits), as every phase and
/// engine records them.
pub(crate) fn new_hist() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 120_000_000_000, 3).expect("valid bounds")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn records_by_send_time_and_merges_senders() {
        let mut a = Timeline::default();
        a.record(ms(5), ms(1), ms(0));
        a.record(ms(99), ms(3), ms(7));
        a.record(ms(250), ms(2), ms(40));
        let mut b = Timeline::default();
        b.record(ms(120), ms(4), ms(9));
        a.merge(&b);
        let ns = |x: u64| x * 1_000_000;
        assert_eq!(
            a.buckets(),
            [
                Bucket {
                    sends: 2,
                    service_sum_ns: ns(4),
                    service_max_ns: ns(3),
                    lag_max_ns: ns(7)
                },
                Bucket {
                    sends: 1,
                    service_sum_ns: ns(4),
                    service_max_ns: ns(4),
                    lag_max_ns: ns(9)
                },
                Bucket {
                    sends: 1,
                    service_sum_ns: ns(2),
                    service_max_ns: ns(2),
                    lag_max_ns: ns(40)
                },
            ]
        );
        // Merging a longer timeline into a shorter one keeps the tail.
        let mut c = Timeline::default();
        c.merge(&a);
        assert_eq!(c.buckets(), a.buckets());
    }
}
