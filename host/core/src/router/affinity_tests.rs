//! Session affinity through the router: `hard` pins a bound session while its candidate is
//! eligible and moves it (counting why) when it is not; subagents start on their parent's
//! candidate unless it is busy; `soft` only marks the column; bookings carry the binding to
//! other replicas.

use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::sessions::{BreakReason, SessionConfig, SessionMode};

fn router(mode: SessionMode, busy: Option<f64>) -> Router {
    router_with(
        SessionConfig {
            mode,
            ..Default::default()
        },
        busy,
    )
}

/// A router with `[sessions]` as given and workers 1 to 4 (1,024-token step budgets).
fn router_with(sessions: SessionConfig, busy: Option<f64>) -> Router {
    let r = Router::new(RouterConfig {
        busy_threshold: busy,
        rng_seed: Some(7),
        sessions,
        ..RouterConfig::default()
    })
    .unwrap();
    for w in 1..=4 {
        r.upsert_worker(
            w,
            WorkerSpec {
                max_num_batched_tokens: 1024,
                ..Default::default()
            },
        )
        .unwrap();
    }
    r
}

fn turn(session: &str, parent: Option<&str>, tokens: u32, salt: u32) -> RouteRequest {
    RouteRequest {
        session_id: Some(session.into()),
        parent_session_id: parent.map(Into::into),
        // Distinct prompts: nothing cached anywhere, so only load and the binding steer.
        ..RouteRequest::tokens((0..tokens).map(|t| t + salt * 100_000).collect())
    }
}

/// Records the `session-bound` column of each decision it is asked.
#[derive(Default)]
struct SeenColumn(parking_lot::Mutex<Vec<Vec<(WorkerId, u8)>>>);
impl Scorer for Arc<SeenColumn> {
    fn decide(
        &self,
        _: &PolicyRequest,
        c: &CandidateColumns,
        _: &crate::workers::TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        self.0.lock().push(
            c.worker_id
                .iter()
                .copied()
                .zip(c.session_bound.iter().copied())
                .collect(),
        );
        ScorerDecision {
            outcome: ScorerOutcome::Native,
            label: PolicyLabel::native(),
        }
    }
}

#[test]
fn hard_keeps_a_session_on_its_first_worker_while_load_would_spread_it() {
    let r = router(SessionMode::Hard, None);
    let first = r.route_now(turn("s", None, 64, 0)).unwrap().candidate;
    // Each turn stays booked: without the binding, load would send the next one elsewhere.
    for i in 1..6 {
        let d = r.route_now(turn("s", None, 64, i)).unwrap();
        assert_eq!(d.candidate, first, "turn {i}");
    }
    assert_eq!(r.sessions().counters.kept.load(Relaxed), 5);
    assert_eq!(r.sessions().get("s", r.clock_us()).unwrap().turns, 6);
    // Another session is free to go elsewhere (the least loaded worker).
    let other = r.route_now(turn("t", None, 64, 9)).unwrap().candidate;
    assert_ne!(other, first);
}

#[test]
fn hard_moves_a_session_off_a_draining_or_removed_worker_and_counts_why() {
    let r = router(SessionMode::Hard, None);
    let first = r.route_now(turn("s", None, 64, 0)).unwrap().candidate;
    r.patch_worker(first.worker_id, None, Some(true)).unwrap();
    let moved = r.route_now(turn("s", None, 64, 1)).unwrap().candidate;
    assert_ne!(moved, first);
    assert_eq!(r.sessions().counters.broken(BreakReason::Draining), 1);
    // The binding moved with it, and holds there.
    assert_eq!(
        r.route_now(turn("s", None, 64, 2)).unwrap().candidate,
        moved
    );
    assert_eq!(r.sessions().counters.kept.load(Relaxed), 1);
    r.remove_worker(moved.worker_id).unwrap();
    let again = r.route_now(turn("s", None, 64, 3)).unwrap().candidate;
    assert!(again != moved && again != first);
    assert_eq!(r.sessions().counters.broken(BreakReason::Removed), 1);
    // A request whose own constraints exclude the bound worker moves too.
    let mut q = turn("s", None, 64, 4);
    q.allowed_worker_ids = Some(vec![(1..=4)
        .find(|&w| w != again.worker_id && w != first.worker_id && w != moved.worker_id)
        .unwrap()]);
    let d = r.route_now(q).unwrap();
    assert_ne!(d.candidate, again);
    assert_eq!(r.sessions().counters.broken(BreakReason::Excluded), 1);
}

#[test]
fn hard_moves_a_session_off_a_busy_worker() {
    // Busy past half of a 1024-token budget: one 640-token prompt makes a worker busy.
    let r = router(SessionMode::Hard, Some(0.5));
    let first = r.route_now(turn("s", None, 640, 0)).unwrap().candidate;
    let d = r.route_now(turn("s", None, 64, 1)).unwrap();
    assert_ne!(d.candidate, first);
    assert_eq!(r.sessions().counters.broken(BreakReason::Busy), 1);
}

#[test]
fn a_subagent_starts_on_its_parent_s_worker_unless_it_is_busy() {
    let r = router(SessionMode::Hard, Some(0.5));
    let parent = r.route_now(turn("p", None, 64, 0)).unwrap().candidate;
    // Load elsewhere would not attract it; its parent's binding does.
    let child = r.route_now(turn("c1", Some("p"), 64, 1)).unwrap().candidate;
    assert_eq!(child, parent);
    assert_eq!(r.sessions().counters.subagent_on_parent.load(Relaxed), 1);
    let v = r.sessions().get("c1", r.clock_us()).unwrap();
    assert_eq!(v.parent_session_id.as_deref(), Some("p"));
    // The parent's worker turns busy: the next subagent starts elsewhere.
    r.route_now(turn("x", None, 640, 2)).ok();
    r.route_now(RouteRequest {
        pinned: Some(Pin {
            worker_id: parent.worker_id,
            dp_rank: None,
        }),
        ..RouteRequest::tokens((0..640).map(|t| t + 7_000_000).collect())
    })
    .unwrap();
    let child2 = r.route_now(turn("c2", Some("p"), 64, 3)).unwrap().candidate;
    assert_ne!(child2, parent);
    assert_eq!(r.sessions().counters.subagent_on_parent.load(Relaxed), 1);
}

#[test]
fn soft_marks_the_column_and_forces_nothing() {
    let r = router(SessionMode::Soft, None);
    let seen = Arc::new(SeenColumn::default());
    r.set_scorer(Some(Box::new(seen.clone())));
    let first = r.route_now(turn("s", None, 64, 0)).unwrap().candidate;
    let parent_child = r.route_now(turn("c", Some("s"), 64, 1)).unwrap();
    let second = r.route_now(turn("s", None, 64, 2)).unwrap().candidate;
    let cols = seen.0.lock().clone();
    assert!(cols[0].iter().all(|&(_, b)| b == 0), "{cols:?}");
    // The subagent's decision marks its parent's worker 2.
    assert_eq!(
        cols[1].iter().filter(|&&(_, b)| b == 2).collect::<Vec<_>>(),
        vec![&(first.worker_id, 2)]
    );
    // The session's own later turn: the bound worker is 1 (the child now bound elsewhere, or
    // there, is not this request's session).
    assert_eq!(
        cols[2].iter().filter(|&&(_, b)| b != 0).collect::<Vec<_>>(),
        vec![&(first.worker_id, 1)]
    );
    let _ = parent_child;
    // The native cost spreads by load (the bound worker holds two bookings, others none): the
    // turn went elsewhere, and that is counted as the policy's choice.
    assert_ne!(second, first);
    assert_eq!(r.sessions().counters.broken(BreakReason::Policy), 1);
    assert_eq!(r.sessions().counters.kept.load(Relaxed), 0);
}

#[test]
fn off_reads_and_records_nothing() {
    let r = router(SessionMode::Off, None);
    r.route_now(turn("s", None, 64, 0)).unwrap();
    assert!(r.sessions().is_empty());
}

#[test]
fn ask_only_decisions_bind_nothing() {
    let r = router(SessionMode::Hard, None);
    let mut q = turn("s", None, 64, 0);
    q.book = false;
    r.route_now(q).unwrap();
    assert!(r.sessions().is_empty());
}

#[test]
fn bad_session_keys_name_the_field() {
    let r = router(SessionMode::Hard, None);
    for (field, q) in [
        ("session_id", turn("", None, 64, 0)),
        ("session_id", turn(&"x".repeat(257), None, 64, 0)),
        ("parent_session_id", turn("s", Some("a\nb"), 64, 0)),
    ] {
        let e = r.route_now(q).unwrap_err();
        assert_eq!(e.field(), Some(field), "{e}");
    }
}

#[test]
fn a_binding_travels_with_the_booking_to_another_replica() {
    let a = router(SessionMode::Hard, None);
    let b = router(SessionMode::Hard, None);
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    struct Keep(Arc<parking_lot::Mutex<Vec<BookingEvent>>>);
    impl BookingObserver for Keep {
        fn on_booking(&self, e: BookingEvent) {
            self.0.lock().push(e);
        }
    }
    a.set_booking_observer(Some(Box::new(Keep(seen.clone()))));
    let first = a.route_now(turn("s", Some("p"), 64, 0)).unwrap().candidate;
    for e in seen.lock().drain(..) {
        if let BookingEvent::Booked(rec) = e {
            assert_eq!(
                rec.session.as_ref().unwrap().parent_session_id.as_deref(),
                Some("p")
            );
            b.apply_remote_book("a", &rec, Instant::now()).unwrap();
        }
    }
    // B honours it, and keeps it after A's bookings are dropped (A died).
    b.drop_origin("a");
    for i in 1..4 {
        assert_eq!(
            b.route_now(turn("s", None, 64, i)).unwrap().candidate,
            first
        );
    }
}

/// A keyless conversation's turn `k`: the same `conv`'s prompt grows by 64 tokens a turn, so each
/// turn holds the whole previous one.
fn keyless_turn(conv: u32, k: u32) -> RouteRequest {
    RouteRequest::tokens((0..64 * (k + 1)).map(|t| t + conv * 100_000).collect())
}

#[test]
fn keyless_turns_continue_the_session_their_prompt_extends_when_inferred() {
    let r = router_with(
        SessionConfig {
            mode: SessionMode::Hard,
            infer: crate::lineage::SessionInference::Prefix,
            ..Default::default()
        },
        None,
    );
    // Every turn stays booked: load alone would spread them over the four workers.
    let first = r.route_now(keyless_turn(1, 0)).unwrap().candidate;
    for k in 1..5 {
        assert_eq!(
            r.route_now(keyless_turn(1, k)).unwrap().candidate,
            first,
            "turn {k}"
        );
    }
    let s = r.sessions();
    assert_eq!(s.counters.kept.load(Relaxed), 4);
    let lineage = s.lineage().expect("inference on");
    assert_eq!(lineage.counters.started.load(Relaxed), 1);
    assert_eq!(lineage.counters.continued.load(Relaxed), 4);
    let (listed, _) = s.list(None, 10, r.clock_us());
    assert_eq!(listed.len(), 1);
    assert!(listed[0].session_id.starts_with("~lineage:"), "{listed:?}");
    assert_eq!(listed[0].turns, 5);
    // Another conversation is another session, placed by load.
    let other = r.route_now(keyless_turn(2, 0)).unwrap().candidate;
    assert_ne!(other, first);
    assert_eq!(s.len(), 2);
    // A request with a key is not inferred.
    let mut keyed = keyless_turn(1, 5);
    keyed.session_id = Some("sent".into());
    r.route_now(keyed).unwrap();
    assert_eq!(lineage.counters.continued.load(Relaxed), 4);
    assert!(s.get("sent", r.clock_us()).is_some());
}

#[test]
fn keyless_requests_have_no_session_without_inference() {
    let r = router(SessionMode::Hard, None);
    let a = r.route_now(keyless_turn(1, 0)).unwrap().candidate;
    let b = r.route_now(keyless_turn(1, 1)).unwrap().candidate;
    assert_ne!(a, b, "load spreads turns that nothing binds");
    assert!(r.sessions().is_empty());
    assert!(r.sessions().lineage().is_none());
}

#[test]
fn inference_needs_sessions_on() {
    let e = Router::new(RouterConfig {
        sessions: SessionConfig {
            mode: SessionMode::Off,
            infer: crate::lineage::SessionInference::Prefix,
            ..Default::default()
        },
        ..RouterConfig::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("sessions.infer"), "{e}");
}
