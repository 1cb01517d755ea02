//! One routing attempt, as a sequence of named steps: resolve the pin → place (one step, or two
//! for a disaggregated request: [`super::disagg`]) → book → answer. A step (filter, fill the
//! columns, score, pick, explain) is [`super::step`]. A queued request goes through it again each
//! time capacity may have freed.
//!
//! The hot path: no lock is held across the policy call. The registry is a lock-free snapshot,
//! the index is read under its read lock only while matching (once per decision, whatever the
//! steps), and the load tracker's mutex is taken once per step to filter (loads, eligibility and
//! active prefix depths together) and once to book. Every buffer a decision fills lives in the
//! per-thread [`Scratch`], so a decision allocates only what it hands back (and the policy
//! request's few owned fields).

use std::cell::RefCell;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::booking::{self, Half};
use super::disagg::Placement;
use super::replicas::{BookedHalf, BookedSession, BookingEvent, BookingRecord};
use super::request::Prepared;
use super::step::Scratch;
use super::{RouteDecision, RouteError, Router, Timings};
use crate::eligibility::PinError;
use crate::load::LoadError;
use crate::workers::{CandidateEntry, RegistrySnapshot};

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Router {
    /// One scoring attempt: resolve the pin, match the prompt against the index, place (one step
    /// or two), book, answer.
    pub(super) fn decide(
        &self,
        p: &Prepared,
        queued: Duration,
    ) -> Result<RouteDecision, RouteError> {
        let t0 = Instant::now();
        let snap = self.registry.snapshot();
        let pool = self.resolve_pin(p, &snap)?;
        SCRATCH.with(|scratch| {
            let s = &mut *scratch.borrow_mut();
            let tm = Instant::now();
            match &p.external {
                None => self.indexer.find_matches_dense(&p.local, &mut s.dense),
                Some(ext) => self.fill_external(ext, &mut s.dense),
            }
            match &self.predictions {
                Some(pr) => pr.matches(&p.seq, self.now_us(), &mut s.predicted),
                None => s.predicted.clear(),
            }
            let matching = tm.elapsed();

            // Session affinity: the bound candidate alone when `hard` and it may take the
            // request; the whole pool otherwise (and the column marks it for the policy).
            let mut plan = self.session_plan(p, &snap);
            s.affinity = plan.affinity;
            let hard = self.sessions.mode() == crate::sessions::SessionMode::Hard;
            let placed = match plan.target.filter(|_| hard) {
                Some(i) => match self.place(p, &snap, &snap.candidates[i..i + 1], s) {
                    Ok(placed) => Ok(placed),
                    Err(_) => {
                        plan.unavailable = Some(crate::sessions::BreakReason::Excluded);
                        self.place(p, &snap, pool, s)
                    }
                },
                None => self.place(p, &snap, pool, s),
            };
            let placed = placed.inspect_err(|_| {
                self.counters.rejected.fetch_add(1, Relaxed);
            })?;
            if p.req.book {
                self.book(p, &placed)?;
                self.session_booked(p, &plan, placed.decode.candidate);
            }
            self.counters.decisions.fetch_add(1, Relaxed);
            let policy = placed.decode.policy_time
                + placed
                    .prefill
                    .as_ref()
                    .map_or(Duration::ZERO, |s| s.policy_time);
            Ok(placed.into_decision(
                p,
                queued,
                Timings {
                    hash: p.hash_time,
                    matching,
                    policy,
                    total: p.hash_time + t0.elapsed(),
                },
            ))
        })
    }

    /// Resolve the pin: the candidates in play are the pinned worker's ranks (its one rank, when
    /// the pin names one), or everyone. A pin to a worker or rank that is not registered, or not
    /// allowed, is the request's error.
    fn resolve_pin<'s>(
        &self,
        p: &Prepared,
        snap: &'s RegistrySnapshot,
    ) -> Result<&'s [CandidateEntry], RouteError> {
        // A pin names its worker: with none registered, that worker is unknown
        // (`pinned_worker_not_found`), not merely unavailable.
        if snap.candidates.is_empty() && p.req.pinned.is_none() {
            self.counters.rejected.fetch_add(1, Relaxed);
            return Err(RouteError::NoWorkers);
        }
        let Some(pin) = p.req.pinned else {
            return Ok(&snap.candidates);
        };
        if let Some(allowed) = &p.req.allowed_worker_ids {
            if !allowed.contains(&pin.worker_id) {
                return Err(PinError::NotAllowed(pin.worker_id).into());
            }
        }
        let start = snap
            .candidates
            .partition_point(|c| c.key.worker_id < pin.worker_id);
        let end = snap
            .candidates
            .partition_point(|c| c.key.worker_id <= pin.worker_id);
        if start == end {
            return Err(PinError::UnknownWorker(pin.worker_id).into());
        }
        let ranks = &snap.candidates[start..end];
        let Some(r) = pin.dp_rank else {
            return Ok(ranks);
        };
        match ranks.iter().position(|c| c.key.dp_rank == r) {
            Some(i) => Ok(&ranks[i..i + 1]),
            None => Err(PinError::UnknownRank {
                worker_id: pin.worker_id,
                dp_rank: r,
            }
            .into()),
        }
    }

    /// Book: the load tracker records the request on its worker, or its two halves (one short
    /// lock), and in approximate mode the index learns that each worker now holds the prompt.
    fn book(&self, p: &Prepared, placed: &Placement) -> Result<(), RouteError> {
        let d = &placed.decode;
        let whole_or_decode = Half {
            candidate: d.candidate,
            // The decode worker of a split request prefills nothing: the KV cache arrives whole.
            cached_tokens: if placed.prefill.is_some() {
                p.prompt_tokens
            } else {
                d.cached_tokens
            },
            prompt_tokens: p.prompt_tokens,
            seq: &p.seq,
        };
        let prefill = placed.prefill.as_ref().map(|s| Half {
            candidate: s.candidate,
            cached_tokens: s.cached_tokens,
            prompt_tokens: p.prompt_tokens,
            seq: &p.seq,
        });
        let now = Instant::now();
        let now_us = self.now_us();
        booking::book(
            &mut self.load.lock(),
            &p.request_id,
            whole_or_decode,
            prefill,
            self.config.block_size,
            now,
        )
        .map_err(|e| match e {
            LoadError::DuplicateRequest(id) | LoadError::UnknownRequest(id) => {
                RouteError::DuplicateRequest(id)
            }
        })?;
        self.announce(|| {
            let half = |h: &Half<'_>| BookedHalf {
                candidate: h.candidate,
                prompt_tokens: h.prompt_tokens,
                cached_tokens: h.cached_tokens,
            };
            BookingEvent::Booked(BookingRecord {
                request_id: p.request_id.clone(),
                whole_or_decode: half(&whole_or_decode),
                prefill: prefill.as_ref().map(half),
                block_hashes: Arc::from(&p.seq[..]),
                local_hashes: self.approx.as_ref().map(|_| Arc::from(&p.local[..])),
                session: p.req.session_id.as_ref().map(|id| BookedSession {
                    session_id: id.clone(),
                    parent_session_id: p.req.parent_session_id.clone(),
                }),
            })
        });
        if let Some(a) = &self.approx {
            a.record(&self.indexer, d.candidate, &p.local, now);
            if let Some(s) = &placed.prefill {
                a.record(&self.indexer, s.candidate, &p.local, now);
            }
        }
        if let Some(pr) = &self.predictions {
            // Where the prompt is computed (the prefill worker of a split request) will cache
            // it; a split request's decode worker receives it by transfer and caches it too.
            // Not where the event index already holds the whole prompt (the common case of a
            // hot prefix): the max-combine would give the same overlap, the removal event that
            // drops the index's blocks would drop the prediction too, and recording costs a few
            // hash operations per block (measured: a third of a booked route's CPU at 256
            // blocks, BENCHMARKS.md).
            for step in std::iter::once(d).chain(&placed.prefill) {
                if !step.indexed_whole {
                    pr.record(step.candidate, &p.local, &p.seq, now_us);
                }
            }
        }
        if placed.prefill.is_none() {
            // Prefill work ahead of the request on its worker, and its own.
            let own = u64::from(p.prompt_tokens.saturating_sub(d.cached_tokens));
            let ahead = d.load.active_prefill_tokens;
            self.step_times
                .lock()
                .booked(&p.request_id, d.candidate.worker_id, own, ahead, now_us);
        }
        Ok(())
    }
}
