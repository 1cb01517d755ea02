//! Bookings shared between router replicas (cluster mode, API.md "Cluster").
//!
//! Several routers in front of one fleet each book what they route. Unless every replica counts
//! every other replica's bookings, each sees only its own share of the load and they pile onto the
//! same idle worker. So the router announces each change to its own bookings as a
//! [`BookingEvent`] to an installed [`BookingObserver`] (the server publishes them to the other
//! replicas), and applies the events other replicas announce through the `apply_remote_*` methods,
//! which book with the placement already decided (no scoring) and tag the booking with its
//! origin replica, so that a replica that goes silent has its bookings dropped all at once
//! ([`Router::drop_origin`]).
//!
//! Nothing here knows of a network: the transport, its ordering, its lag and the replicas'
//! liveness are the caller's (the server over NATS; the replay simulator with a modelled lag).
//!
//! Which calls announce: the local ones — a booking made by `route`, and `prefill_complete`,
//! `output_progress` and `free` called on this router, *whoever booked the request* (a lifecycle
//! call for a request booked on another replica is applied here and announced, so the origin
//! releases it too), and a booking released because its caller went away while it waited. Remote
//! applications never announce (no echo). Expiry and worker removal do not announce either: every
//! replica expires and removes workers on its own.

use std::sync::Arc;
use std::time::Instant;

use super::booking::{self, Half};
use super::{LifecycleError, Router};
use crate::candidate::CandidateKey;
use crate::load::{Booking, LoadError};

/// One half of a booking as it was placed: the candidate and the prompt figures the load tracker
/// books with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookedHalf {
    pub candidate: CandidateKey,
    /// Prompt tokens (isl).
    pub prompt_tokens: u32,
    /// Prompt tokens the candidate had cached (a split request's decode half: all of them).
    pub cached_tokens: u32,
}

/// A booking as its origin made it: enough for another replica to book the same load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookingRecord {
    pub request_id: String,
    /// The whole request, or the decode half of a disaggregated one.
    pub whole_or_decode: BookedHalf,
    /// The prefill half of a disaggregated request.
    pub prefill: Option<BookedHalf>,
    /// Sequence (chained) hashes of the prompt's complete blocks (both halves hold the same).
    pub block_hashes: Arc<[u64]>,
    /// The prompt's local block hashes when the booking router indexes approximately (from its
    /// decisions, `RouterConfig::approx`): a receiving router in that mode records the placement
    /// in its own index as if it had decided it, so replicas without KV events agree on where a
    /// prefix is cached. `None` from a router that learns the cache from KV events (every
    /// replica subscribes to the engines, so nothing need travel).
    pub local_hashes: Option<Arc<[u64]>>,
    /// The request's session and its parent's, when it had one: a receiving router binds the
    /// session to the placed candidate as if it had decided it, so a binding made on one replica
    /// is honoured by the others and outlives the replica that made it ([`crate::sessions`]).
    pub session: Option<BookedSession>,
}

/// A booked request's session keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BookedSession {
    pub session_id: String,
    pub parent_session_id: Option<String>,
}

/// A change to this router's bookings, as announced to the [`BookingObserver`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BookingEvent {
    /// A request was booked by `route`.
    Booked(BookingRecord),
    /// `prefill_complete` was applied.
    PrefillComplete { request_id: String },
    /// `output_progress` was applied: the request's output-token total.
    Output { request_id: String, tokens: u32 },
    /// The request's booking was released (`free`, or its caller went away).
    Freed { request_id: String },
}

impl BookingEvent {
    /// The request the event is about.
    pub fn request_id(&self) -> &str {
        match self {
            BookingEvent::Booked(r) => &r.request_id,
            BookingEvent::PrefillComplete { request_id }
            | BookingEvent::Output { request_id, .. }
            | BookingEvent::Freed { request_id } => request_id,
        }
    }
}

/// Receives this router's [`BookingEvent`]s. Called on the routing path, sometimes under the
/// queue's lock: it must not block (queue the event and return).
pub trait BookingObserver: Send + Sync {
    fn on_booking(&self, event: BookingEvent);
}

/// Why a remote booking was not applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RemoteBookingError {
    /// The id is already booked here (booked locally, or an earlier copy of the same event).
    #[error("request {0:?} is already booked")]
    Duplicate(String),
    /// A half's candidate is not registered here (the worker left, or is not known yet).
    #[error("candidate {0} is not registered")]
    UnknownCandidate(CandidateKey),
}

/// The bookings another replica made that this router counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginBookings {
    pub origin: String,
    /// Requests (a disaggregated request's two halves count once).
    pub requests: usize,
}

impl Router {
    /// Installs (or with `None` removes) the observer told of every change to this router's own
    /// bookings.
    pub fn set_booking_observer(&self, observer: Option<Box<dyn BookingObserver>>) {
        self.booking_observer.store(observer.map(Arc::new));
    }

    /// Tells the observer, if any.
    pub(super) fn announce(&self, event: impl FnOnce() -> BookingEvent) {
        if let Some(o) = &*self.booking_observer.load() {
            o.on_booking(event());
        }
    }

    /// Releases a request's booking (both halves) and announces it.
    pub(super) fn release_booking(&self, request_id: &str) -> Option<Booking> {
        let b = booking::release(&mut self.load.lock(), request_id)?;
        self.announce(|| BookingEvent::Freed {
            request_id: request_id.to_owned(),
        });
        Some(b)
    }

    /// Books a request that replica `origin` placed, as it placed it: no scoring, no queue, no
    /// announcement. Both halves or nothing. The load counts it from now on;
    /// [`drop_origin`](Self::drop_origin) releases it with the rest of `origin`'s. In approximate
    /// mode, with the record's local hashes, the index learns that the placed workers now hold
    /// the prompt, as it does for this router's own decisions.
    pub fn apply_remote_book(
        &self,
        origin: &str,
        record: &BookingRecord,
        now: Instant,
    ) -> Result<(), RemoteBookingError> {
        let snap = self.registry.snapshot();
        for h in std::iter::once(&record.whole_or_decode).chain(&record.prefill) {
            if snap.candidate(h.candidate).is_none() {
                return Err(RemoteBookingError::UnknownCandidate(h.candidate));
            }
        }
        let half = |h: &BookedHalf| Half {
            candidate: h.candidate,
            cached_tokens: h.cached_tokens,
            prompt_tokens: h.prompt_tokens,
            seq: &record.block_hashes,
        };
        let id = &record.request_id;
        let mut load = self.load.lock();
        booking::book(
            &mut load,
            id,
            half(&record.whole_or_decode),
            record.prefill.as_ref().map(half),
            self.config.block_size,
            now,
        )
        .map_err(|e| match e {
            LoadError::DuplicateRequest(id) | LoadError::UnknownRequest(id) => {
                RemoteBookingError::Duplicate(id)
            }
        })?;
        load.set_origin(id, origin)
            .expect("booked under the lock just now");
        if record.prefill.is_some() {
            load.set_origin(&booking::prefill_half(id), origin)
                .expect("booked under the lock just now");
        }
        drop(load);
        if let Some(s) = &record.session {
            self.sessions.record(
                &s.session_id,
                s.parent_session_id.as_deref(),
                record.whole_or_decode.candidate,
                self.now_us(),
            );
        }
        if let (Some(a), Some(local)) = (&self.approx, &record.local_hashes) {
            for h in std::iter::once(&record.whole_or_decode).chain(&record.prefill) {
                a.record(&self.indexer, h.candidate, local, now);
            }
        }
        Ok(())
    }

    /// Applies another replica's `prefill_complete` (not announced). Returns where the request
    /// decodes; an error when nothing is booked under the id here.
    pub fn apply_remote_prefill_complete(
        &self,
        request_id: &str,
    ) -> Result<CandidateKey, LifecycleError> {
        let r = booking::prefill_complete(&mut self.load.lock(), request_id)
            .ok_or_else(|| LifecycleError::UnknownRequest(request_id.into()))?;
        self.pump();
        Ok(r)
    }

    /// Applies another replica's output progress (not announced).
    pub fn apply_remote_output(
        &self,
        request_id: &str,
        tokens: u32,
    ) -> Result<CandidateKey, LifecycleError> {
        self.load
            .lock()
            .output_progress(request_id, tokens)
            .map_err(|_| LifecycleError::UnknownRequest(request_id.into()))
    }

    /// Applies another replica's free (not announced): releases the booking here, whichever
    /// replica made it.
    pub fn apply_remote_free(&self, request_id: &str) -> Result<Booking, LifecycleError> {
        let b = booking::release(&mut self.load.lock(), request_id)
            .ok_or_else(|| LifecycleError::UnknownRequest(request_id.into()))?;
        self.pump();
        Ok(b)
    }

    /// Releases every booking replica `origin` made (it went silent, or left). Returns how many
    /// requests that was.
    pub fn drop_origin(&self, origin: &str) -> usize {
        let dropped = booking::count_requests(&self.load.lock().remove_origin(origin));
        if dropped > 0 {
            self.pump();
        }
        dropped
    }

    /// The replica that booked `request_id`, when another one did.
    pub fn booking_origin(&self, request_id: &str) -> Option<String> {
        self.load.lock().origin(request_id).map(str::to_owned)
    }

    /// Every other replica with bookings here and how many requests each holds, sorted by origin.
    pub fn remote_bookings(&self) -> Vec<OriginBookings> {
        let load = self.load.lock();
        let mut out: Vec<OriginBookings> = load
            .origins()
            .map(|(o, ids)| OriginBookings {
                origin: o.to_owned(),
                requests: ids.filter(|k| !booking::is_prefill_half(k)).count(),
            })
            .collect();
        out.sort_unstable_by(|a, b| a.origin.cmp(&b.origin));
        out
    }

    /// Requests booked by this router itself (not another replica's), halves counted once.
    pub fn local_bookings(&self) -> usize {
        let load = self.load.lock();
        load.bookings()
            .filter(|b| {
                !booking::is_prefill_half(&b.request_id) && load.origin(&b.request_id).is_none()
            })
            .count()
    }

    /// Moves a request's booking to the candidate that actually served it (an endpoint picker
    /// named fallbacks and the gateway's retry landed on one): freed where it was booked and
    /// booked on `to` with the same prompt and block hashes, `cached_tokens` of the prompt cached
    /// there (capped at the prompt), its age, prefill completion and output progress carried over.
    /// Announced as a free and a booking (then its progress), so other replicas move it too.
    /// Returns the candidate it left; moving to where it already is changes nothing.
    pub fn move_booking(
        &self,
        request_id: &str,
        to: CandidateKey,
        cached_tokens: u32,
    ) -> Result<CandidateKey, MoveBookingError> {
        if self.registry.snapshot().candidate(to).is_none() {
            return Err(MoveBookingError::UnknownCandidate(to));
        }
        let mut load = self.load.lock();
        let Some(b) = load.get(request_id).cloned() else {
            return Err(MoveBookingError::UnknownRequest(request_id.into()));
        };
        if load.get(&booking::prefill_half(request_id)).is_some() {
            return Err(MoveBookingError::Disaggregated(request_id.into()));
        }
        if b.candidate == to {
            return Ok(to);
        }
        let origin = load.origin(request_id).map(str::to_owned);
        load.free(request_id).expect("looked up under the lock");
        let cached = cached_tokens.min(b.prompt_tokens);
        load.book(
            request_id,
            to,
            b.prompt_tokens,
            cached,
            &b.block_hashes,
            b.block_size,
            b.booked_at,
        )
        .expect("freed under the lock just now");
        if b.prefill_done {
            let _ = load.prefill_complete(request_id);
        }
        if b.output_tokens > 0 {
            let _ = load.output_progress(request_id, b.output_tokens);
        }
        if let Some(o) = &origin {
            let _ = load.set_origin(request_id, o);
        }
        drop(load);
        self.announce(|| BookingEvent::Freed {
            request_id: request_id.to_owned(),
        });
        self.announce(|| {
            BookingEvent::Booked(BookingRecord {
                request_id: request_id.to_owned(),
                whole_or_decode: BookedHalf {
                    candidate: to,
                    prompt_tokens: b.prompt_tokens,
                    cached_tokens: cached,
                },
                prefill: None,
                block_hashes: Arc::from(&b.block_hashes[..]),
                local_hashes: None,
                session: None,
            })
        });
        if b.prefill_done {
            self.announce(|| BookingEvent::PrefillComplete {
                request_id: request_id.to_owned(),
            });
        }
        if b.output_tokens > 0 {
            self.announce(|| BookingEvent::Output {
                request_id: request_id.to_owned(),
                tokens: b.output_tokens,
            });
        }
        // The candidate it left has room now.
        self.pump();
        Ok(b.candidate)
    }
}

/// Why [`Router::move_booking`] did not move a booking.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MoveBookingError {
    #[error("no booked request has id {0:?}")]
    UnknownRequest(String),
    /// A disaggregated request's two halves stay where they were placed.
    #[error("request {0:?} is disaggregated: its halves are not moved")]
    Disaggregated(String),
    #[error("candidate {0} is not registered")]
    UnknownCandidate(CandidateKey),
}

#[cfg(test)]
mod tests;
