//! Learned step times: each worker's prefill time per token and decode step time, fitted online
//! from the request lifecycle the router already sees.
//!
//! A cost in milliseconds needs each worker's speed, and a fleet is rarely uniform (two GPU
//! generations, a worker sharing its GPU, a different parallelism). Nobody has to configure it:
//! - **Prefill.** From booking to `prefill_complete` is the request's time to first token (as the
//!   router sees it). It covers the prefill work queued ahead of the request on its worker (the
//!   load tracker's `active_prefill_tokens` at booking) plus the request's own uncached tokens:
//!   `ttft ≈ base + ms_per_token · uncached + queued_ms_per_token · ahead`. A decayed weighted
//!   least-squares fit gives both slopes and the intercept (a step's fixed cost, scheduling, the
//!   first decode step). The two slopes differ because work booked ahead is partly done already
//!   (or batched with the request's own), so `ahead` overstates what is left.
//! - **Decode.** After the first token, each output-progress report (and the final count at `free`)
//!   gives `Δtime / Δtokens`: the decode step time as the worker's requests experience it,
//!   interference from other requests' prefill chunks included. A decayed ratio of sums weights
//!   each report by its tokens.
//!
//! Both decay by sample (half-life [`HALF_LIFE_SAMPLES`]), so a worker that slows down or speeds up
//! is tracked within a few hundred requests, and both read 0 (unknown) until [`MIN_SAMPLES`]
//! samples. A disaggregated request is not sampled (its time to first token includes the KV
//! transfer, and its two halves run on two workers).
//!
//! Times are microseconds on the router's clock (the wall clock or a simulator's). Requests that
//! are never freed leave their pending entry until [`StepTimes::expire`] (the router's tick, at
//! the load tracker's expiry) and at most [`MAX_PENDING`] are kept.

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::candidate::WorkerId;

/// Samples after which an old sample weighs half as much as a new one.
pub const HALF_LIFE_SAMPLES: f64 = 100.0;
/// Samples before a figure is reported (0 until then).
pub const MIN_SAMPLES: u64 = 16;
/// Most requests followed at once (the oldest are forgotten past it).
pub const MAX_PENDING: usize = 1 << 20;

/// A worker's fitted figures (0 = not learned yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Learned {
    /// Milliseconds of prefill per prompt token (queued ahead or the request's own, uncached).
    pub prefill_ms_per_token: f64,
    /// The fixed part of a time to first token, in milliseconds.
    pub prefill_base_ms: f64,
    /// Milliseconds a prefill token booked ahead (not yet prefilled) adds to the time to first
    /// token: below `prefill_ms_per_token` when requests ahead are partly done or batched.
    pub queued_ms_per_token: f64,
    /// Milliseconds per output token once decoding.
    pub decode_step_ms: f64,
    /// Samples behind the prefill figures (time to first token observations).
    pub prefill_samples: u64,
    /// Samples behind the decode figure (output progress reports).
    pub decode_samples: u64,
}

/// A decayed weighted least-squares plane `y = b0 + b1·own + b2·ahead`: the request's own
/// uncached tokens and the prefill tokens booked ahead of it are separate variables, because a
/// request in progress ahead is partly done (its booked tokens overstate the work left), which
/// would bias one slope over their sum low.
#[derive(Clone, Copy, Debug, Default)]
struct Plane {
    /// Decayed sums of 1, o, a, y, o², a², o·a, o·y, a·y.
    s: [f64; 9],
    n: u64,
}

impl Plane {
    fn add(&mut self, own: f64, ahead: f64, y: f64, decay: f64) {
        let v = [
            1.0,
            own,
            ahead,
            y,
            own * own,
            ahead * ahead,
            own * ahead,
            own * y,
            ahead * y,
        ];
        for (s, v) in self.s.iter_mut().zip(v) {
            *s = *s * decay + v;
        }
        self.n += 1;
    }

    /// (base ms, ms per own token, ms per token ahead). Falls back to a line in `own` when the
    /// queue ahead never varied, and to a ratio through the origin when a line slopes down.
    fn fit(&self) -> Option<(f64, f64, f64)> {
        let [w, o, a, y, oo, aa, oa, oy, ay] = self.s;
        if self.n < MIN_SAMPLES || o <= 0.0 {
            return None;
        }
        let m = [[w, o, a], [o, oo, oa], [a, oa, aa]];
        let det = |m: [[f64; 3]; 3]| {
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        };
        let d = det(m);
        let scale = w * oo * aa.max(1.0);
        if d.abs() > 1e-9 * scale {
            let col = |k: usize| {
                let mut mk = m;
                for (row, rhs) in mk.iter_mut().zip([y, oy, ay]) {
                    row[k] = rhs;
                }
                det(mk) / d
            };
            let (b0, b1, b2) = (col(0), col(1), col(2));
            if b1 > 0.0 && b0 >= 0.0 && b2 >= 0.0 {
                return Some((b0, b1, b2));
            }
        }
        let den = w * oo - o * o;
        if den > 1e-9 * w * oo {
            let b = (w * oy - o * y) / den;
            let b0 = (y - b * o) / w;
            if b > 0.0 && b0 >= 0.0 {
                return Some((b0, b, 0.0));
            }
        }
        Some((0.0, y / (o + a), 0.0))
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct WorkerFit {
    prefill: Plane,
    decode_ms: f64,
    decode_tokens: f64,
    decode_n: u64,
}

impl WorkerFit {
    fn learned(&self) -> Learned {
        let (base, per_token, queued) = self.prefill.fit().unwrap_or((0.0, 0.0, 0.0));
        let decode = if self.decode_n >= MIN_SAMPLES && self.decode_tokens > 0.0 {
            self.decode_ms / self.decode_tokens
        } else {
            0.0
        };
        Learned {
            prefill_ms_per_token: per_token,
            prefill_base_ms: base,
            queued_ms_per_token: queued,
            decode_step_ms: decode,
            prefill_samples: self.prefill.n,
            decode_samples: self.decode_n,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    worker: WorkerId,
    booked_us: u64,
    /// Its own uncached prompt tokens, and the prefill tokens booked ahead of it on its candidate.
    own_tokens: u64,
    ahead_tokens: u64,
    /// Output tokens counted so far (1 from the first token on) and when the last came.
    tokens: u32,
    last_us: Option<u64>,
}

/// The fitted step times of every worker, and the requests being followed.
#[derive(Debug)]
pub struct StepTimes {
    decay: f64,
    workers: FxHashMap<WorkerId, WorkerFit>,
    pending: FxHashMap<String, Pending>,
}

impl Default for StepTimes {
    fn default() -> Self {
        Self {
            decay: 0.5f64.powf(1.0 / HALF_LIFE_SAMPLES),
            workers: FxHashMap::default(),
            pending: FxHashMap::default(),
        }
    }
}

impl StepTimes {
    /// A request was booked on `worker` with `own_tokens` uncached prompt tokens and
    /// `ahead_tokens` of prefill booked ahead of it.
    pub fn booked(
        &mut self,
        request_id: &str,
        worker: WorkerId,
        own_tokens: u64,
        ahead_tokens: u64,
        now_us: u64,
    ) {
        if self.pending.len() >= MAX_PENDING {
            // Forget the oldest tenth: requests never freed, or a flood.
            let mut ages: Vec<u64> = self.pending.values().map(|p| p.booked_us).collect();
            let k = ages.len() / 10;
            let (_, cut, _) = ages.select_nth_unstable(k);
            let cut = *cut;
            self.pending.retain(|_, p| p.booked_us > cut);
        }
        self.pending.insert(
            request_id.to_owned(),
            Pending {
                worker,
                booked_us: now_us,
                own_tokens,
                ahead_tokens,
                tokens: 0,
                last_us: None,
            },
        );
    }

    /// The request's first token: a time-to-first-token sample. Returns the worker whose
    /// figures it changed.
    pub fn prefill_complete(&mut self, request_id: &str, now_us: u64) -> Option<WorkerId> {
        let p = self.pending.get_mut(request_id)?;
        if p.last_us.is_some() {
            return None; // repeated
        }
        p.last_us = Some(now_us);
        p.tokens = 1;
        let ttft_ms = now_us.saturating_sub(p.booked_us) as f64 / 1000.0;
        let (worker, own, ahead) = (p.worker, p.own_tokens as f64, p.ahead_tokens as f64);
        self.workers
            .entry(worker)
            .or_default()
            .prefill
            .add(own, ahead, ttft_ms, self.decay);
        Some(worker)
    }

    /// The request's output-token total so far: a decode sample for the tokens since the last.
    /// Returns the worker whose figures it changed.
    pub fn output(&mut self, request_id: &str, total_tokens: u32, now_us: u64) -> Option<WorkerId> {
        let p = self.pending.get_mut(request_id)?;
        // No first token yet (the prefill is not over), or nothing new.
        let last = p.last_us?;
        if total_tokens <= p.tokens {
            return None;
        }
        let dt_ms = now_us.saturating_sub(last) as f64 / 1000.0;
        let dn = f64::from(total_tokens - p.tokens);
        p.tokens = total_tokens;
        p.last_us = Some(now_us);
        let w = self.workers.entry(p.worker).or_default();
        w.decode_ms = w.decode_ms * self.decay + dt_ms;
        w.decode_tokens = w.decode_tokens * self.decay + dn;
        w.decode_n += 1;
        Some(p.worker)
    }

    /// The request ended with `total_tokens` output tokens (0 when unknown).
    pub fn freed(&mut self, request_id: &str, total_tokens: u32, now_us: u64) -> Option<WorkerId> {
        let changed = self.output(request_id, total_tokens, now_us);
        self.pending.remove(request_id);
        changed
    }

    /// Forgets requests booked before `before_us` (never freed).
    pub fn expire(&mut self, before_us: u64) {
        self.pending.retain(|_, p| p.booked_us >= before_us);
    }

    /// Forgets a removed worker's figures and requests.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
        self.pending.retain(|_, p| p.worker != worker);
    }

    /// A worker's figures (zeros when nothing is learned).
    pub fn learned(&self, worker: WorkerId) -> Learned {
        self.workers
            .get(&worker)
            .map(WorkerFit::learned)
            .unwrap_or_default()
    }

    /// Requests followed now.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_line_and_decode_ratio_recover_exact_samples() {
        let mut s = StepTimes::default();
        let mut t = 0u64;
        for i in 0..200u64 {
            let id = format!("r{i}");
            let work = 500 + (i * 37) % 4000;
            let ahead = (i * 53) % 3000;
            s.booked(&id, 7, work, ahead, t);
            // ttft = 20 ms + 0.05 ms/own token + 0.03 ms/token ahead; then 30 output tokens at
            // 12 ms each, reported twice.
            let first = t + 20_000 + work * 50 + ahead * 30;
            s.prefill_complete(&id, first);
            s.output(&id, 11, first + 10 * 12_000);
            s.freed(&id, 31, first + 30 * 12_000);
            t += 1_000;
        }
        let l = s.learned(7);
        assert!((l.prefill_ms_per_token - 0.05).abs() < 1e-6, "{l:?}");
        assert!((l.prefill_base_ms - 20.0).abs() < 1e-3, "{l:?}");
        assert!((l.queued_ms_per_token - 0.03).abs() < 1e-6, "{l:?}");
        assert!((l.decode_step_ms - 12.0).abs() < 1e-9, "{l:?}");
        assert_eq!((l.prefill_samples, l.decode_samples), (200, 400));
        assert_eq!(s.pending(), 0);
        assert_eq!(s.learned(8), Learned::default());
    }

    #[test]
    fn unknown_until_enough_samples_and_decay_tracks_a_change() {
        let mut s = StepTimes::default();
        let run = |s: &mut StepTimes, from: u64, n: u64, per_token_us: u64| {
            for i in from..from + n {
                let id = format!("r{i}");
                let work = 1000 + (i % 7) * 500;
                s.booked(&id, 1, work, 0, i * 10_000_000);
                s.prefill_complete(&id, i * 10_000_000 + work * per_token_us);
                s.freed(&id, 0, i * 10_000_000 + work * per_token_us);
            }
        };
        run(&mut s, 0, MIN_SAMPLES - 1, 10);
        assert_eq!(s.learned(1).prefill_ms_per_token, 0.0);
        run(&mut s, MIN_SAMPLES, 1, 10);
        assert!((s.learned(1).prefill_ms_per_token - 0.01).abs() < 1e-9);
        // The worker becomes 3x slower: within a few hundred samples the fit follows.
        run(&mut s, 100, 500, 30);
        let l = s.learned(1);
        assert!((l.prefill_ms_per_token - 0.03).abs() < 0.003, "{l:?}");
        // No output reported: no decode figure; a repeated first token is not a second sample.
        assert_eq!(l.decode_step_ms, 0.0);
        s.booked("x", 1, 10, 0, 0);
        s.prefill_complete("x", 5);
        s.prefill_complete("x", 6);
        assert_eq!(s.learned(1).prefill_samples, MIN_SAMPLES + 501);
        s.expire(1);
        assert_eq!(s.pending(), 0);
        s.remove_worker(1);
        assert_eq!(s.learned(1), Learned::default());
    }
}
