//! Two routers joined by hand: one's announced events are applied to the other, as the server
//! does over NATS, with no network in between.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::*;
use crate::router::{RouteRequest, RouterConfig};
use crate::workers::WorkerSpec;

/// Collects announced events.
#[derive(Default, Clone)]
struct Outbox(Arc<Mutex<Vec<BookingEvent>>>);

impl BookingObserver for Outbox {
    fn on_booking(&self, event: BookingEvent) {
        self.0.lock().push(event);
    }
}

impl Outbox {
    fn take(&self) -> Vec<BookingEvent> {
        std::mem::take(&mut *self.0.lock())
    }
}

/// A router with workers 1 and 2 (one rank each) and an outbox.
fn replica() -> (Router, Outbox) {
    let r = Router::new(RouterConfig::default()).unwrap();
    for w in [1, 2] {
        r.upsert_worker(w, WorkerSpec::default()).unwrap();
    }
    let out = Outbox::default();
    r.set_booking_observer(Some(Box::new(out.clone())));
    (r, out)
}

/// A router indexing approximately (no KV events) with workers 1 to 4, and an outbox.
fn approx_replica() -> (Router, Outbox) {
    let r = Router::new(RouterConfig {
        approx: Some(crate::indexer::approx::ApproxConfig::default()),
        ..Default::default()
    })
    .unwrap();
    for w in 1..=4 {
        r.upsert_worker(w, WorkerSpec::default()).unwrap();
    }
    let out = Outbox::default();
    r.set_booking_observer(Some(Box::new(out.clone())));
    (r, out)
}

/// Applies `events` announced by `origin` to `to`, as the server's subscriber does.
fn deliver(origin: &str, events: Vec<BookingEvent>, to: &Router) {
    for e in events {
        match e {
            BookingEvent::Booked(rec) => {
                to.apply_remote_book(origin, &rec, Instant::now()).unwrap()
            }
            BookingEvent::PrefillComplete { request_id } => {
                to.apply_remote_prefill_complete(&request_id).unwrap();
            }
            BookingEvent::Output { request_id, tokens } => {
                to.apply_remote_output(&request_id, tokens).unwrap();
            }
            BookingEvent::Freed { request_id } => {
                to.apply_remote_free(&request_id).unwrap();
            }
        }
    }
}

fn book(r: &Router, id: &str, tokens: u32) -> CandidateKey {
    let req = RouteRequest {
        request_id: Some(id.into()),
        ..RouteRequest::tokens((0..tokens).collect())
    };
    r.route_now(req).unwrap().candidate
}

#[test]
fn a_booking_announced_by_one_replica_loads_the_other_and_steers_its_decisions() {
    let (a, a_out) = replica();
    let (b, b_out) = replica();
    let c = book(&a, "r1", 64);
    let events = a_out.take();
    assert!(
        matches!(&events[..], [BookingEvent::Booked(rec)] if rec.request_id == "r1"
        && rec.whole_or_decode.candidate == c && rec.block_hashes.len() == 4)
    );
    deliver("a", events, &b);
    // B counts A's booking exactly as A does, tagged with its origin.
    assert_eq!(b.load_of(c), a.load_of(c));
    assert!(!b.load_of(c).is_zero());
    assert_eq!(b.booking_origin("r1").as_deref(), Some("a"));
    assert_eq!(a.booking_origin("r1"), None);
    assert_eq!(
        b.remote_bookings(),
        [OriginBookings {
            origin: "a".into(),
            requests: 1
        }]
    );
    assert_eq!((b.local_bookings(), b.active_bookings()), (0, 1));
    // Applying a remote booking announces nothing (no echo).
    assert!(b_out.take().is_empty());
    // B's next uncached request goes to the other, idle worker.
    let other = book(&b, "r2", 64);
    assert_ne!(other, c);
    // The id is taken cluster-wide: B refuses to book it again, remote or local.
    assert!(b
        .route_now(RouteRequest {
            request_id: Some("r1".into()),
            ..RouteRequest::tokens((0..64).collect())
        })
        .is_err());
}

#[test]
fn a_lifecycle_call_on_any_replica_is_applied_there_and_by_the_origin() {
    let (a, a_out) = replica();
    let (b, b_out) = replica();
    let c = book(&a, "r1", 64);
    deliver("a", a_out.take(), &b);
    let booked = a.load_of(c);
    // Output progress and prefill_complete called on B for A's request.
    b.output_progress("r1", 40).unwrap();
    assert_eq!(b.prefill_complete("r1").unwrap(), c);
    let events = b_out.take();
    assert_eq!(events.len(), 2);
    deliver("b", events, &a);
    assert_eq!(a.load_of(c), b.load_of(c));
    assert_eq!(a.load_of(c).active_prefill_tokens, 0);
    assert!(a.load_of(c).active_decode_blocks > booked.active_decode_blocks);
    // Free on B releases it on B and, once delivered, on A; A announces nothing back.
    assert!(b.free("r1").unwrap().is_some());
    assert!(b.load_of(c).is_zero());
    deliver("b", b_out.take(), &a);
    assert!(a.load_of(c).is_zero() && a.active_bookings() == 0);
    assert!(a_out.take().is_empty());
    // Remote calls for unknown ids are errors and change nothing.
    assert!(a.apply_remote_free("r1").is_err());
    assert!(a.apply_remote_prefill_complete("r1").is_err());
    assert!(a.apply_remote_output("r1", 3).is_err());
}

#[test]
fn drop_origin_releases_that_replicas_bookings_and_nothing_else() {
    let (a, _) = replica();
    let k1 = CandidateKey::new(1, 0);
    let k2 = CandidateKey::new(2, 0);
    let rec = |id: &str, prefill: bool| BookingRecord {
        request_id: id.into(),
        whole_or_decode: BookedHalf {
            candidate: k2,
            prompt_tokens: 40,
            cached_tokens: if prefill { 40 } else { 16 },
        },
        prefill: prefill.then_some(BookedHalf {
            candidate: k1,
            prompt_tokens: 40,
            cached_tokens: 0,
        }),
        block_hashes: Arc::from(&[7u64, 8][..]),
        local_hashes: None,
        session: None,
    };
    let now = Instant::now();
    // A's own booking first: what is left when every other replica's is dropped.
    book(&a, "mine", 64);
    let (own1, own2) = (a.load_of(k1), a.load_of(k2));
    // A disaggregated booking from "b": both halves load their workers.
    a.apply_remote_book("b", &rec("split", true), now).unwrap();
    assert_eq!(
        a.load_of(k1).active_prefill_tokens,
        own1.active_prefill_tokens + 40
    );
    assert_eq!(
        a.load_of(k2).active_prefill_tokens,
        own2.active_prefill_tokens
    );
    assert_eq!(a.load_of(k2).active_requests, own2.active_requests + 1);
    a.apply_remote_book("c", &rec("from-c", false), now)
        .unwrap();
    // The same event twice, or a candidate unknown here: refused, nothing half-applied.
    assert_eq!(
        a.apply_remote_book("b", &rec("split", true), now),
        Err(RemoteBookingError::Duplicate("split".into()))
    );
    let mut unknown = rec("u", true);
    unknown.prefill.as_mut().unwrap().candidate = CandidateKey::new(9, 0);
    assert_eq!(
        a.apply_remote_book("b", &unknown, now),
        Err(RemoteBookingError::UnknownCandidate(CandidateKey::new(
            9, 0
        )))
    );
    assert_eq!(a.active_bookings(), 3);
    assert_eq!(
        a.remote_bookings()
            .iter()
            .map(|o| (o.origin.as_str(), o.requests))
            .collect::<Vec<_>>(),
        [("b", 1), ("c", 1)]
    );
    // "b" goes silent: its request (both halves) goes, "c"'s and A's own stay.
    assert_eq!(a.drop_origin("b"), 1);
    assert_eq!(a.drop_origin("b"), 0);
    assert_eq!(a.load_of(k1), own1);
    assert_eq!(a.load_of(k2).active_requests, own2.active_requests + 1);
    assert_eq!(a.booking_origin("split"), None);
    assert_eq!(a.booking_origin("from-c").as_deref(), Some("c"));
    assert_eq!((a.local_bookings(), a.active_bookings()), (1, 2));
    // prefill_complete of a remote split request releases its prefill half.
    a.apply_remote_book("b", &rec("split2", true), now).unwrap();
    assert_eq!(a.apply_remote_prefill_complete("split2").unwrap(), k2);
    assert_eq!(a.drop_origin("b"), 1);
    assert_eq!(a.drop_origin("c"), 1);
    assert_eq!((a.load_of(k1), a.load_of(k2)), (own1, own2));
    assert_eq!((a.local_bookings(), a.active_bookings()), (1, 1));
}

#[test]
fn approximate_replicas_learn_each_others_placements_and_event_fed_ones_send_no_local_hashes() {
    let (a, a_out) = approx_replica();
    let (b, _) = approx_replica();
    let prompt: Vec<u32> = (0..512).collect();
    let placed = a.route_now(RouteRequest::tokens(prompt.clone())).unwrap();
    assert_eq!(placed.overlap_blocks, 0);
    // Before the booking reaches B, B knows nothing of the prompt.
    let ask = |r: &Router| {
        r.route_now(RouteRequest {
            book: false,
            ..RouteRequest::tokens(prompt.clone())
        })
        .unwrap()
    };
    assert_eq!(ask(&b).overlap_blocks, 0);
    let events = a_out.take();
    let BookingEvent::Booked(rec) = &events[0] else {
        panic!("a booking first");
    };
    assert_eq!(rec.local_hashes.as_ref().map(|l| l.len()), Some(32));
    deliver("a", events, &b);
    assert_eq!(b.active_bookings(), 1);
    // Once it is done (so no queue weighs against its worker), B sends the prompt where A placed
    // it, with every block cached there.
    a.free(&placed.request_id).unwrap();
    deliver("a", a_out.take(), &b);
    assert_eq!(b.active_bookings(), 0);
    let again = ask(&b);
    assert_eq!(
        (again.candidate, again.overlap_blocks),
        (placed.candidate, 32)
    );
    // A router fed by KV events sends no local hashes (every replica reads the engines).
    let (c, c_out) = replica();
    c.route_now(RouteRequest::tokens(prompt)).unwrap();
    let BookingEvent::Booked(rec) = &c_out.take()[0] else {
        panic!("a booking");
    };
    assert!(rec.local_hashes.is_none());
}

#[test]
fn a_moved_booking_leaves_its_candidate_with_its_progress_and_the_other_replica_follows() {
    let (a, a_out) = replica();
    let (b, _b_out) = replica();
    let from = book(&a, "r1", 64);
    let to = CandidateKey::new(if from.worker_id == 1 { 2 } else { 1 }, 0);
    a.prefill_complete("r1").unwrap();
    a.output_progress("r1", 40).unwrap();
    deliver("a", a_out.take(), &b);
    let booked = a.load_of(from);
    assert!(a.load_of(to).is_zero());
    // Served by the other worker, which had 16 of the 64 prompt tokens cached.
    assert_eq!(a.move_booking("r1", to, 16), Ok(from));
    assert!(a.load_of(from).is_zero(), "{:?}", a.load_of(from));
    // Prefill done and 40 output tokens carried over: the same decode load, now on `to`.
    assert_eq!(a.load_of(to), booked);
    assert_eq!(a.active_bookings(), 1);
    let events = a_out.take();
    assert!(
        matches!(&events[..], [BookingEvent::Freed { .. }, BookingEvent::Booked(rec),
            BookingEvent::PrefillComplete { .. }, BookingEvent::Output { tokens: 40, .. }]
            if rec.whole_or_decode.candidate == to && rec.whole_or_decode.cached_tokens == 16),
        "{events:?}"
    );
    deliver("a", events, &b);
    assert_eq!(b.load_of(to), a.load_of(to));
    assert!(b.load_of(from).is_zero());
    // Moving to where it is changes nothing; unknown ids and candidates are named.
    assert_eq!(a.move_booking("r1", to, 0), Ok(to));
    assert!(a_out.take().is_empty());
    assert_eq!(
        a.move_booking("nope", to, 0),
        Err(MoveBookingError::UnknownRequest("nope".into()))
    );
    assert_eq!(
        a.move_booking("r1", CandidateKey::new(9, 0), 0),
        Err(MoveBookingError::UnknownCandidate(CandidateKey::new(9, 0)))
    );
    a.free("r1").unwrap();
    assert!(a.load_of(to).is_zero() && a.active_bookings() == 0);
}

#[test]
fn a_moved_uncompleted_prefill_loads_the_new_candidate_by_its_own_cache() {
    let (a, _out) = replica();
    let from = book(&a, "r1", 64);
    let to = CandidateKey::new(if from.worker_id == 1 { 2 } else { 1 }, 0);
    a.move_booking("r1", to, 16).unwrap();
    assert_eq!(a.load_of(to).active_prefill_tokens, 48);
    assert!(a.load_of(from).is_zero());
}
