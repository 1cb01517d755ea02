//! The two-step decision on a real router: roles, the transfer constraint, enforce, the bypass
//! rules at their thresholds, booking both halves, and the stage each policy call is told.

use std::sync::Arc;

use parking_lot::Mutex;

use super::super::*;
use crate::router::tests::store;
use crate::workers::{Role, Topology};

const PREFILL_A: WorkerId = 1;
const PREFILL_B: WorkerId = 2;
const DECODE_A: WorkerId = 11;
const DECODE_B: WorkerId = 12;

fn spec(role: Role, zone: Option<&str>, mnbt: u32) -> WorkerSpec {
    WorkerSpec {
        role,
        topology: zone
            .map(|z| Topology::from([("zone".to_string(), z.to_string())]))
            .unwrap_or_default(),
        max_num_batched_tokens: mnbt,
        ..Default::default()
    }
}

/// Two prefill and two decode workers, one of each in zones a and b.
fn fleet(disagg: DisaggConfig) -> Router {
    let r = Router::new(RouterConfig {
        disagg,
        ..RouterConfig::default()
    })
    .unwrap();
    for (w, role, zone) in [
        (PREFILL_A, Role::Prefill, "a"),
        (PREFILL_B, Role::Prefill, "b"),
        (DECODE_A, Role::Decode, "a"),
        (DECODE_B, Role::Decode, "b"),
    ] {
        r.upsert_worker(w, spec(role, Some(zone), 1000)).unwrap();
    }
    r
}

fn zone_required() -> DisaggConfig {
    DisaggConfig {
        kv_transfer_domain: Some("zone".into()),
        kv_transfer_enforcement: KvTransferEnforcement::Required,
        ..Default::default()
    }
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// A prompt that shares no block with `prompt` (nor with another `start`).
fn other(start: u32, n: u32) -> Vec<u32> {
    (start * 100_000..start * 100_000 + n).collect()
}

fn req(id: &str, tokens: Vec<u32>) -> RouteRequest {
    RouteRequest {
        request_id: Some(id.into()),
        ..RouteRequest::tokens(tokens)
    }
}

fn load(r: &Router, w: WorkerId) -> crate::load::CandidateLoad {
    r.load_of(CandidateKey::new(w, 0))
}

#[test]
fn prefill_is_kv_aware_and_decode_follows_the_prefill_workers_zone() {
    let r = fleet(zone_required());
    let tokens = prompt(128);
    // Prefill B holds the prompt: it prefills; the transfer keeps the decode in zone b.
    store(&r, PREFILL_B, &tokens, 8);
    let d = r.route_now(req("r1", tokens.clone())).unwrap();
    let p = d.prefill.as_ref().unwrap();
    assert!(d.disaggregated);
    assert_eq!(
        (p.candidate.worker_id, p.overlap_blocks, p.cached_tokens),
        (PREFILL_B, 8, 112),
        "the last block of a block-aligned prompt is recomputed"
    );
    assert_eq!(d.candidate.worker_id, DECODE_B);
    assert_eq!(
        d.topology_constraints,
        Some(TopologyConstraints {
            required_taints: vec!["topology/zone=b".into()],
            preferred_taints: vec![],
        })
    );
    assert_eq!(d.cross_domain, Some(false));
    // Both halves booked: the prefill worker carries the (cached) prompt's blocks and no
    // unprefilled tokens here; the decode worker the blocks and no prefill tokens.
    assert_eq!(load(&r, PREFILL_B).active_requests, 1);
    assert_eq!(load(&r, DECODE_B).active_prefill_tokens, 0);
    assert_eq!(load(&r, DECODE_B).active_decode_blocks, 8);
    assert_eq!(r.active_bookings(), 1);
}

#[test]
fn an_aggregated_fleet_is_unchanged_and_off_routes_aggregated() {
    // No prefill-role workers: auto routes aggregated, as before roles existed.
    let r = Router::new(RouterConfig::default()).unwrap();
    for w in 1..=3 {
        r.upsert_worker(w, spec(Role::Both, None, 0)).unwrap();
    }
    let d = r.route_now(req("a", prompt(64))).unwrap();
    assert!(!d.disaggregated && d.prefill.is_none() && d.bypass.is_none());
    // A disaggregated fleet with `off`: aggregated, never on a prefill-only worker.
    let r = fleet(DisaggConfig::default());
    for i in 0..8 {
        let d = r
            .route_now(RouteRequest {
                disaggregation: DisaggMode::Off,
                book: false,
                ..RouteRequest::tokens(prompt(64 + i))
            })
            .unwrap();
        assert!(!d.disaggregated);
        assert!([DECODE_A, DECODE_B].contains(&d.candidate.worker_id));
    }
    // `required` splits even a fleet of `both` workers.
    let r = Router::new(RouterConfig::default()).unwrap();
    r.upsert_worker(1, spec(Role::Both, None, 0)).unwrap();
    let d = r
        .route_now(RouteRequest {
            disaggregation: DisaggMode::Required,
            ..RouteRequest::tokens(prompt(64))
        })
        .unwrap();
    assert!(d.disaggregated);
}

#[test]
fn enforce_on_and_off_with_and_without_prefill_workers() {
    let decode_only = |enforce| {
        let r = Router::new(RouterConfig {
            disagg: DisaggConfig {
                enforce,
                ..Default::default()
            },
            ..RouterConfig::default()
        })
        .unwrap();
        r.upsert_worker(DECODE_A, spec(Role::Decode, None, 0))
            .unwrap();
        r
    };
    // Off, no prefill workers: aggregated.
    let d = decode_only(false).route_now(req("x", prompt(64))).unwrap();
    assert!(!d.disaggregated);
    // On, no prefill workers: refused, nothing booked.
    let r = decode_only(true);
    let e = r.route_now(req("x", prompt(64))).unwrap_err();
    assert_eq!(e.code(), "no_prefill_worker");
    assert_eq!(r.active_bookings(), 0);
    // On: `off` is refused naming the field.
    let e = r
        .route_now(RouteRequest {
            disaggregation: DisaggMode::Off,
            ..RouteRequest::tokens(prompt(64))
        })
        .unwrap_err();
    assert_eq!(
        (e.code(), e.field()),
        ("invalid_request", Some("disaggregation"))
    );
    // With prefill workers, either way: disaggregated.
    for enforce in [false, true] {
        let r = fleet(DisaggConfig {
            enforce,
            ..Default::default()
        });
        assert!(r.route_now(req("y", prompt(64))).unwrap().disaggregated);
        // Every prefill worker draining: off falls back to aggregated, on refuses.
        for w in [PREFILL_A, PREFILL_B] {
            r.patch_worker(w, None, Some(true)).unwrap();
        }
        let got = r.route_now(req("z", prompt(64)));
        if enforce {
            assert_eq!(got.unwrap_err().code(), "no_prefill_worker");
        } else {
            let d = got.unwrap();
            assert!(!d.disaggregated && d.candidate.worker_id >= DECODE_A);
        }
    }
}

#[test]
fn a_required_domain_without_decode_workers_refuses_and_books_nothing() {
    let r = fleet(zone_required());
    r.remove_worker(DECODE_B);
    let tokens = prompt(64);
    store(&r, PREFILL_B, &tokens, 4);
    let e = r.route_now(req("r", tokens)).unwrap_err();
    assert_eq!(
        e,
        RouteError::NoDecodeWorkerInDomain {
            taint: "topology/zone=b".into()
        }
    );
    assert_eq!(e.code(), "no_decode_worker_in_domain");
    assert!(load(&r, PREFILL_B).is_zero() && r.active_bookings() == 0);
    assert!(matches!(
        r.free("r"),
        Err(LifecycleError::UnknownRequest(_))
    ));
}

#[test]
fn preferred_enforcement_merges_a_preferred_taint_and_counts_cross_domain_placements() {
    let r = fleet(DisaggConfig {
        kv_transfer_domain: Some("zone".into()),
        kv_transfer_enforcement: KvTransferEnforcement::Preferred,
        kv_transfer_preferred_weight: 0.9,
        ..Default::default()
    });
    let tokens = prompt(64);
    store(&r, PREFILL_A, &tokens, 4);
    // The request's own constraints are kept beside the transfer's.
    let d = r
        .route_now(RouteRequest {
            preferred_taints: vec![("gpu=h100".into(), 0.25)],
            book: false,
            ..RouteRequest::tokens(tokens.clone())
        })
        .unwrap();
    let merged = d.topology_constraints.unwrap();
    assert!(merged.required_taints.is_empty());
    assert_eq!(
        merged.preferred_taints,
        vec![("topology/zone=a".to_string(), 0.9)]
    );
    assert_eq!(
        (d.candidate.worker_id, d.cross_domain),
        (DECODE_A, Some(false))
    );
    // Zone a's decode worker draining: a preference, not a rule; the placement crosses zones.
    r.patch_worker(DECODE_A, None, Some(true)).unwrap();
    let d = r.route_now(req("x", tokens)).unwrap();
    assert_eq!(
        (d.candidate.worker_id, d.cross_domain),
        (DECODE_B, Some(true))
    );
}

#[test]
fn a_prefill_worker_without_the_required_domain_fails_closed() {
    let r = Router::new(RouterConfig {
        disagg: zone_required(),
        ..RouterConfig::default()
    })
    .unwrap();
    r.upsert_worker(PREFILL_A, spec(Role::Prefill, None, 0))
        .unwrap();
    r.upsert_worker(DECODE_A, spec(Role::Decode, Some("a"), 0))
        .unwrap();
    let e = r.route_now(req("r", prompt(64))).unwrap_err();
    assert_eq!(e.code(), "kv_transfer_domain_unknown");
    assert_eq!(r.active_bookings(), 0);
}

#[test]
fn lifecycle_releases_each_half() {
    let r = fleet(zone_required());
    let tokens = prompt(100);
    store(&r, PREFILL_A, &tokens, 2);
    let d = r.route_now(req("r", tokens)).unwrap();
    assert_eq!(
        (
            d.prefill.as_ref().unwrap().candidate.worker_id,
            d.candidate.worker_id
        ),
        (PREFILL_A, DECODE_A)
    );
    // 100 tokens, 32 cached: 68 to prefill on A; 7 blocks (6 hashed + a partial tail) on both.
    assert_eq!(load(&r, PREFILL_A).active_prefill_tokens, 68);
    assert_eq!(load(&r, PREFILL_A).active_decode_blocks, 7);
    assert_eq!(load(&r, DECODE_A).active_decode_blocks, 7);
    assert_eq!(r.prefill_complete("r"), Ok(CandidateKey::new(DECODE_A, 0)));
    assert!(load(&r, PREFILL_A).is_zero());
    r.output_progress("r", 20).unwrap();
    assert_eq!(load(&r, DECODE_A).active_decode_blocks, 8);
    assert_eq!(r.free("r").unwrap().unwrap().candidate.worker_id, DECODE_A);
    assert!(load(&r, DECODE_A).is_zero());
    // Expiry covers both halves, and counts the request once.
    let d = r.route_now(req("s", prompt(64))).unwrap();
    assert!(d.disaggregated);
    let later = std::time::Instant::now() + LoadConfig::DEFAULT_EXPIRY * 2;
    assert_eq!(r.tick(later).0, 1);
    assert_eq!(r.active_bookings(), 0);
    for w in [PREFILL_A, PREFILL_B, DECODE_A, DECODE_B] {
        assert!(load(&r, w).is_zero());
    }
}

/// A fleet with Dynamo's isl_bounding bounds (the ratio 0.7 on; kvroute's default has none).
fn bypass_fleet(rule: BypassRule, max_load: Option<f64>) -> Router {
    fleet(DisaggConfig {
        bypass: rule,
        bypass_max_prefill_load: max_load,
        bypass_max_uncached_ratio: Some(
            crate::router::disagg::config::DYNAMO_BYPASS_MAX_UNCACHED_RATIO,
        ),
        ..Default::default()
    })
}

#[test]
fn isl_bounding_without_a_ratio_keeps_a_fresh_short_prompt_local() {
    let r = fleet(DisaggConfig {
        bypass: BypassRule::IslBounding,
        ..Default::default()
    });
    // Nothing cached anywhere: 64 uncached tokens < 2,048, and no ratio bound by default.
    let d = r.route_now(req("short", prompt(64))).unwrap();
    assert_eq!(d.bypass, Some("isl_bounding"));
    assert!(!d.disaggregated && d.prefill.is_none());
    // A long uncached prompt still goes to a prefill worker.
    let d = r.route_now(req("long", other(5, 3000))).unwrap();
    assert!(d.disaggregated && d.bypass.is_none());
}

#[test]
fn isl_bounding_bypasses_at_its_thresholds() {
    // 1,000-token prompts, 16-token blocks; decode A holds some of it. Bypass when uncached <
    // 2,048 (always here) and uncached / 1,000 < 0.7, i.e. more than 300 tokens cached.
    for (blocks, bypass) in [(18, false), (19, true), (0, false)] {
        let r = bypass_fleet(BypassRule::IslBounding, None);
        let tokens = prompt(1000);
        if blocks > 0 {
            store(&r, DECODE_A, &tokens, blocks);
        }
        // 18 blocks = 288 cached: 712 uncached (0.712). 19 = 304: 696 (0.696).
        let d = r.route_now(req("r", tokens)).unwrap();
        assert_eq!(d.bypass.is_some(), bypass, "{blocks} blocks");
        if bypass {
            assert_eq!(d.bypass, Some("isl_bounding"));
            assert!(!d.disaggregated && d.prefill.is_none());
            assert_eq!(d.candidate.worker_id, DECODE_A);
            // Prefilled locally: the decode worker carries the uncached prompt.
            assert_eq!(load(&r, DECODE_A).active_prefill_tokens, 696);
            assert!(load(&r, PREFILL_A).is_zero() && load(&r, PREFILL_B).is_zero());
        } else {
            assert!(d.disaggregated);
        }
    }
    // The absolute bound: 3,000 tokens with 2,000 cached is 1,000 uncached (ratio 0.33) and
    // bypasses; with the bound at 1,000 it does not.
    for (max, bypass) in [(1001, true), (1000, false)] {
        let r = fleet(DisaggConfig {
            bypass: BypassRule::IslBounding,
            bypass_max_uncached_tokens: max,
            ..Default::default()
        });
        let tokens = prompt(3000);
        store(&r, DECODE_B, &tokens, 125);
        let d = r.route_now(req("r", tokens)).unwrap();
        assert_eq!(d.bypass.is_some(), bypass, "max {max}");
    }
}

#[test]
fn prefill_load_bypasses_past_its_threshold() {
    // Line at 0.5 of 1,000 tokens: a prefill worker with 500 unprefilled tokens is not past it,
    // 501 is. Two split requests load the two prefill workers (each takes the least loaded).
    for (uncached, bypass) in [(500, false), (501, true)] {
        let r = bypass_fleet(BypassRule::PrefillLoad, Some(0.5));
        for i in 0..2 {
            let d = r
                .route_now(req(&format!("load{i}"), other(i + 1, uncached)))
                .unwrap();
            assert!(d.disaggregated && d.bypass.is_none());
        }
        assert_eq!(load(&r, PREFILL_A).active_prefill_tokens, uncached as u64);
        assert_eq!(load(&r, PREFILL_B).active_prefill_tokens, uncached as u64);
        let d = r.route_now(req("r", other(9, 2000))).unwrap();
        assert_eq!(d.bypass, if bypass { Some("prefill_load") } else { None });
        assert_eq!(d.disaggregated, !bypass);
    }
}

#[test]
fn isl_or_load_bypasses_on_either() {
    let r = bypass_fleet(BypassRule::IslOrLoad, Some(0.5));
    // Mostly cached on a decode worker: isl_bounding holds.
    let tokens = prompt(1000);
    store(&r, DECODE_B, &tokens, 60);
    assert_eq!(
        r.route_now(req("a", tokens)).unwrap().bypass,
        Some("isl_bounding")
    );
    // Nothing cached, prefill workers loaded past the line: prefill_load holds.
    r.route_now(req("l1", other(1, 600))).unwrap();
    r.route_now(req("l2", other(2, 600))).unwrap();
    assert_eq!(
        r.route_now(req("b", other(3, 900))).unwrap().bypass,
        Some("prefill_load")
    );
    // Neither: split.
    r.free("l1").unwrap();
    r.free("l2").unwrap();
    let d = r.route_now(req("c", other(4, 900))).unwrap();
    assert!(d.disaggregated && d.bypass.is_none());
}

/// Each policy call's stage and candidate workers.
type Calls = Arc<Mutex<Vec<(Stage, Vec<WorkerId>)>>>;

/// Records the stage of every policy call and picks the first candidate.
struct StageLog(Calls);

impl Scorer for StageLog {
    fn decide(
        &self,
        _: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        stage: Stage,
    ) -> ScorerDecision {
        self.0.lock().push((stage, c.worker_id.clone()));
        ScorerDecision {
            outcome: ScorerOutcome::Pick(0),
            label: PolicyLabel::native(),
        }
    }
}

#[test]
fn the_policy_is_asked_once_per_step_with_its_stage_and_workers() {
    let r = fleet(zone_required());
    let log = Arc::new(Mutex::new(Vec::new()));
    r.set_scorer(Some(Box::new(StageLog(log.clone()))));
    let d = r
        .route_now(RouteRequest {
            explain: true,
            ..req("r", prompt(64))
        })
        .unwrap();
    assert_eq!(
        *log.lock(),
        vec![
            (Stage::Prefill, vec![PREFILL_A, PREFILL_B]),
            (Stage::Decode, vec![DECODE_A]),
        ]
    );
    // Explain shows both steps: the prefill step kept the decode workers out by role, the decode
    // step kept zone b out by the transfer's taint (and the prefill workers by role).
    let p = d.prefill.unwrap();
    let rows = |e: &Option<Vec<ExcludedRow>>| -> Vec<(WorkerId, &'static str)> {
        e.as_ref()
            .unwrap()
            .iter()
            .map(|x| (x.worker_id, x.reason))
            .collect()
    };
    assert_eq!(
        rows(&p.excluded),
        vec![(DECODE_A, "role"), (DECODE_B, "role")]
    );
    assert_eq!(
        rows(&d.excluded),
        vec![
            (PREFILL_A, "role"),
            (PREFILL_B, "role"),
            (DECODE_B, "missing_required_taints")
        ]
    );
    let taints = &d.candidates.as_ref().unwrap()[0].taints;
    assert_eq!(taints, &vec!["topology/zone=a".to_string()]);
    assert_eq!(p.candidates.unwrap().len(), 2);
    // Aggregated fleets ask once, as `aggregated`.
    log.lock().clear();
    r.route_now(RouteRequest {
        disaggregation: DisaggMode::Off,
        book: false,
        ..RouteRequest::tokens(prompt(64))
    })
    .unwrap();
    assert_eq!(log.lock()[0].0, Stage::Aggregated);
    assert_eq!(log.lock().len(), 1);
}

#[test]
fn a_busy_pool_queues_per_step() {
    // Busy line 0.5 of 1,000: the prefill pool is busy once each prefill worker carries > 500
    // tokens; the decode pool, which prefills nothing, is not.
    let r = Router::new(RouterConfig {
        busy_threshold: Some(0.5),
        ..RouterConfig::default()
    })
    .unwrap();
    r.upsert_worker(PREFILL_A, spec(Role::Prefill, None, 1000))
        .unwrap();
    r.upsert_worker(DECODE_A, spec(Role::Decode, None, 1000))
        .unwrap();
    r.route_now(req("a", prompt(600))).unwrap();
    assert_eq!(
        r.route_now(req("b", prompt(64))).unwrap_err(),
        RouteError::AllOverloaded
    );
    assert_eq!(load(&r, DECODE_A).active_requests, 1);
    r.prefill_complete("a").unwrap();
    assert!(r.route_now(req("b", prompt(64))).unwrap().disaggregated);
}

#[test]
fn a_pin_names_the_decode_worker() {
    let r = fleet(DisaggConfig::default());
    let pinned = |w, mode| RouteRequest {
        pinned: Some(Pin {
            worker_id: w,
            dp_rank: None,
        }),
        disaggregation: mode,
        book: false,
        ..RouteRequest::tokens(prompt(64))
    };
    // The prefill step is unpinned; the request decodes where it is pinned.
    for _ in 0..4 {
        let d = r.route_now(pinned(DECODE_B, DisaggMode::Auto)).unwrap();
        assert!(d.disaggregated && d.candidate.worker_id == DECODE_B);
    }
    // A prefill-only worker never decodes, split or not.
    for mode in [DisaggMode::Auto, DisaggMode::Off] {
        let e = r.route_now(pinned(PREFILL_A, mode)).unwrap_err();
        assert_eq!(e, RouteError::Pin(PinError::WrongRole(PREFILL_A)));
        assert_eq!(e.code(), "pinned_worker_wrong_role");
    }
}
