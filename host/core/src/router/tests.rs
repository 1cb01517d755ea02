//! Unit tests of the router. HTTP statuses are the server's (its `http::error` tests map every
//! error); these check the codes, fields and retryability the core owns.

use super::*;
use crate::candidate::DpRank;
use crate::hashing;
use crate::indexer::{KvEventData, StoredBlock, Tier};
use rustc_hash::FxHashSet;

fn router(cfg: RouterConfig) -> Router {
    Router::new(cfg).unwrap()
}

fn worker(taints: &[&str], mnbt: u32) -> WorkerSpec {
    WorkerSpec {
        taints: taints.iter().map(|s| s.to_string()).collect(),
        max_num_batched_tokens: mnbt,
        ..Default::default()
    }
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// Stores the first `blocks` blocks of `tokens` on a worker, as an engine would (handles are the
/// local hashes ^ 0xabc). Shared by the router's other test modules.
pub(super) fn store(r: &Router, w: WorkerId, tokens: &[u32], blocks: usize) {
    let local =
        hashing::local_block_hashes(tokens, r.config().block_size as usize, hashing::BASE_SEED);
    let ev = KvEvent {
        candidate: CandidateKey::new(w, 0),
        tier: Tier::Device,
        event_id: 0,
        data: KvEventData::Stored {
            parent_hash: None,
            blocks: local[..blocks]
                .iter()
                .map(|&l| StoredBlock {
                    block_hash: l ^ 0xabc,
                    tokens_hash: l,
                })
                .collect(),
        },
    };
    r.apply_event(&ev).unwrap().unwrap();
}

fn ask(tokens: Vec<u32>) -> RouteRequest {
    RouteRequest {
        book: false,
        ..RouteRequest::tokens(tokens)
    }
}

#[test]
fn a_seeded_router_breaks_ties_the_same_way_every_time() {
    // Eight idle workers tie on every unbooked decision: the pick is the random tie-break.
    let picks = |seed: Option<u64>| {
        let r = router(RouterConfig {
            rng_seed: seed,
            ..RouterConfig::default()
        });
        for w in 1..=8 {
            r.upsert_worker(w, worker(&[], 0)).unwrap();
        }
        (0..64)
            .map(|_| r.route_now(ask(prompt(64))).unwrap().candidate.worker_id)
            .collect::<Vec<_>>()
    };
    let a = picks(Some(42));
    assert_eq!(a, picks(Some(42)));
    assert_ne!(a, picks(Some(43)));
    // Ties are still spread: every worker is picked at least once in 64 draws.
    let distinct: FxHashSet<_> = a.iter().collect();
    assert_eq!(distinct.len(), 8, "{a:?}");
    // The OS-seeded default differs between routers (64 draws of 8: equal by chance ~8^-64).
    assert_ne!(picks(None), picks(None));
}

#[test]
fn seeded_rng_is_splitmix64() {
    // Reference values of SplitMix64 (Vigna) from seed 0.
    let g = SeededRng::new(0);
    assert_eq!(g.next_u64(), 0xe220_a839_7b1d_cdaf);
    assert_eq!(g.next_u64(), 0x6e78_9e6a_a1b9_65f4);
}

#[test]
fn cached_tokens_never_exceed_what_the_engine_reuses() {
    use crate::cost::{cached_tokens, reusable_blocks};
    // vLLM: at most prompt - 1 tokens, rounded down to a block.
    assert_eq!(reusable_blocks(256, 16), 15);
    assert_eq!(reusable_blocks(257, 16), 16);
    assert_eq!(reusable_blocks(16, 16), 0);
    assert_eq!(reusable_blocks(1, 16), 0);
    assert_eq!(reusable_blocks(0, 16), 0);
    assert_eq!(cached_tokens(16, 256, 16), 240);
    assert_eq!(cached_tokens(16, 260, 16), 256);
    assert_eq!(cached_tokens(3, 260, 16), 48);
    // Through a decision: a 17-token prompt whose first block is cached is credited 16 tokens,
    // a 16-token one nothing, and its native cost counts the whole prompt as prefill.
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    r.upsert_worker(2, worker(&[], 0)).unwrap();
    let p17: Vec<u32> = (1..=17).collect();
    store(&r, 1, &p17, 1);
    let route = |t: &[u32]| {
        let mut q = RouteRequest::tokens(t.to_vec());
        q.book = false;
        q.explain = true;
        r.route_now(q).unwrap()
    };
    let d = route(&p17);
    assert_eq!((d.candidate.worker_id, d.cached_tokens), (1, 16));
    let d = route(&p17[..16]);
    assert_eq!(d.cached_tokens, 0);
    assert_eq!(
        d.overlap_blocks,
        if d.candidate.worker_id == 1 { 1 } else { 0 }
    );
    let rows = d.candidates.as_ref().unwrap();
    assert!(rows.iter().all(|row| row.overlap_blocks == 0), "{rows:?}");
    let costs: Vec<f64> = rows.iter().map(|row| row.base_cost).collect();
    assert_eq!(
        costs[0], costs[1],
        "no credit for a block the engine recomputes"
    );
}

#[test]
fn routes_to_the_cached_worker_and_books_load() {
    let r = router(RouterConfig::default());
    for w in 1..=4 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    let p = prompt(256);
    store(&r, 3, &p, 16);
    let d = r.route_now(RouteRequest::tokens(p.clone())).unwrap();
    assert_eq!(d.candidate, CandidateKey::new(3, 0));
    assert_eq!(d.overlap_blocks, 16);
    // The engine reuses at most prompt - 1 tokens rounded down to a block: the last block of this
    // block-aligned prompt is recomputed (SPEC §5), and booked as prefill.
    assert_eq!(d.cached_tokens, 240);
    assert!(!d.fallback);
    assert_eq!(d.policy.name, "host-native");
    let l = r.load_of(CandidateKey::new(3, 0));
    assert_eq!(l.active_requests, 1);
    assert_eq!(l.active_decode_blocks, 16);
    assert_eq!(l.active_prefill_tokens, 16);
    // Lifecycle.
    r.prefill_complete(&d.request_id).unwrap();
    assert!(r.free(&d.request_id).unwrap().is_some());
    assert_eq!(
        r.free(&d.request_id).unwrap_err(),
        LifecycleError::UnknownRequest(d.request_id.clone())
    );
    assert_eq!(r.load_of(CandidateKey::new(3, 0)), CandidateLoad::default());
}

#[test]
fn booked_load_spreads_uncached_requests() {
    let r = router(RouterConfig::default());
    for w in 1..=4 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    let mut seen = FxHashSet::default();
    for i in 0..4u32 {
        let tokens: Vec<u32> = (0..64).map(|t| t + i * 1000).collect();
        seen.insert(r.route_now(RouteRequest::tokens(tokens)).unwrap().candidate);
    }
    assert_eq!(
        seen.len(),
        4,
        "each idle worker gets one of four equal requests"
    );
}

#[test]
fn ask_only_changes_nothing() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    let d = r
        .route_now(RouteRequest {
            request_id: Some("q".into()),
            ..ask(prompt(64))
        })
        .unwrap();
    assert!(!d.booked);
    assert_eq!(r.active_bookings(), 0);
    assert_eq!(r.load_of(d.candidate), CandidateLoad::default());
}

#[test]
fn hard_constraints_filter_and_explain() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&["zone=a"], 0)).unwrap();
    r.upsert_worker(2, worker(&["zone=b", "gpu=h100"], 0))
        .unwrap();
    r.upsert_worker(3, worker(&["zone=b"], 0)).unwrap();
    let d = r
        .route_now(RouteRequest {
            required_taints: vec!["zone=b".into(), "gpu=h100".into()],
            explain: true,
            ..ask(prompt(32))
        })
        .unwrap();
    assert_eq!(d.candidate.worker_id, 2);
    let rows = d.candidates.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].taints,
        vec!["zone=b".to_string(), "gpu=h100".to_string()]
    );
    let d = r
        .route_now(RouteRequest {
            allowed_worker_ids: Some(vec![1, 3]),
            required_taints: vec!["zone=b".into()],
            ..ask(prompt(32))
        })
        .unwrap();
    assert_eq!(d.candidate.worker_id, 3);
    let e = r
        .route_now(RouteRequest {
            required_taints: vec!["zone=mars".into()],
            ..ask(prompt(32))
        })
        .unwrap_err();
    assert_eq!(e.code(), "all_filtered_by_constraints");
    let e = r
        .route_now(RouteRequest {
            allowed_worker_ids: Some(vec![99]),
            ..ask(prompt(32))
        })
        .unwrap_err();
    assert_eq!(e.code(), "all_filtered_by_constraints");
    r.patch_worker(1, None, Some(true)).unwrap();
    let d = r
        .route_now(RouteRequest {
            allowed_worker_ids: Some(vec![1, 2]),
            required_taints: vec![],
            explain: true,
            ..ask(prompt(32))
        })
        .unwrap();
    assert_eq!(d.candidate.worker_id, 2, "draining worker 1 is skipped");
}

#[test]
fn a_required_taint_refusal_names_the_taints_each_worker_lacks() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&["zone=a"], 0)).unwrap();
    r.upsert_worker(
        2,
        WorkerSpec {
            dp_size: 2,
            ..worker(&["zone=b"], 0)
        },
    )
    .unwrap();
    r.upsert_worker(3, worker(&["zone=b", "gpu=h100"], 0))
        .unwrap();
    r.patch_worker(3, None, Some(true)).unwrap();
    let refuse = |req: RouteRequest| r.route_now(req).unwrap_err();
    let lacks = |w, m: &[&str]| WorkerMissingTaints {
        worker_id: w,
        missing: m.iter().map(|s| s.to_string()).collect(),
    };

    // Worker 3 has both but is draining; 1 and 2 (two ranks) lack some; nobody has zone=mars.
    let e = refuse(RouteRequest {
        required_taints: vec!["zone=b".into(), "gpu=h100".into(), "zone=mars".into()],
        ..ask(prompt(32))
    });
    assert_eq!(e.code(), "all_filtered_by_constraints");
    assert_eq!(
        e.missing_taints(),
        [
            lacks(1, &["zone=b", "gpu=h100", "zone=mars"]),
            lacks(2, &["gpu=h100", "zone=mars"]),
            lacks(3, &["zone=mars"]),
        ]
    );
    assert_eq!(
        e.to_string(),
        "no candidate is eligible: 4 without the required_taints (no worker has zone=mars; \
         worker 1 lacks zone=b, gpu=h100; worker 2 lacks gpu=h100)"
    );
    // Allowed ids first: a worker kept out by them is not said to lack anything.
    let e = refuse(RouteRequest {
        allowed_worker_ids: Some(vec![2, 3]),
        required_taints: vec!["gpu=h100".into()],
        ..ask(prompt(32))
    });
    assert_eq!(e.missing_taints(), [lacks(2, &["gpu=h100"])]);
    assert_eq!(
        e.to_string(),
        "no candidate is eligible: 1 not in allowed_worker_ids, \
         2 without the required_taints (worker 2 lacks gpu=h100), 1 draining"
    );
    // Other refusals name no taint.
    let e = refuse(RouteRequest {
        allowed_worker_ids: Some(vec![3]),
        required_taints: vec!["gpu=h100".into()],
        ..ask(prompt(32))
    });
    assert!(e.missing_taints().is_empty(), "{e}");
    // A pin names what its worker lacks.
    let e = refuse(RouteRequest {
        pinned: Some(Pin {
            worker_id: 2,
            dp_rank: None,
        }),
        required_taints: vec!["zone=b".into(), "gpu=h100".into()],
        ..ask(prompt(32))
    });
    assert_eq!(e.code(), "pinned_worker_missing_taints");
    assert_eq!(e.missing_taints(), [lacks(2, &["gpu=h100"])]);
    assert_eq!(
        e.to_string(),
        "pinned worker 2 lacks the required taints gpu=h100"
    );
    // Explain names them per excluded rank.
    let d = r
        .route_now(RouteRequest {
            required_taints: vec!["zone=a".into()],
            explain: true,
            ..ask(prompt(32))
        })
        .unwrap();
    let rows: Vec<(WorkerId, DpRank, &str, Vec<String>)> = d
        .excluded
        .as_ref()
        .unwrap()
        .iter()
        .map(|e| (e.worker_id, e.dp_rank, e.reason, e.missing_taints.clone()))
        .collect();
    let z = vec!["zone=a".to_string()];
    assert_eq!(
        rows,
        [
            (2, 0, "missing_required_taints", z.clone()),
            (2, 1, "missing_required_taints", z.clone()),
            (3, 0, "missing_required_taints", z),
        ]
    );
}

#[test]
fn a_dead_feed_is_kept_forgotten_or_drained_as_configured() {
    use crate::feeds::{DeadFeedRule, FeedConfig};
    let p = prompt(64);
    let decide = |rule: DeadFeedRule| {
        let r = router(RouterConfig {
            feeds: FeedConfig {
                dead_feed: rule,
                dead_after: Duration::ZERO,
            },
            ..Default::default()
        });
        r.upsert_worker(1, worker(&[], 0)).unwrap();
        r.upsert_worker(2, worker(&[], 0)).unwrap();
        store(&r, 1, &p, 4);
        // Worker 1's feed: opened, never connected, dead at once (dead_after 0).
        let _cell = r.feeds().open(CandidateKey::new(1, 0));
        r.feeds().refresh();
        let d = r.route_now(RouteRequest {
            explain: true,
            ..ask(p.clone())
        });
        let pin = r.route_now(RouteRequest {
            pinned: Some(Pin {
                worker_id: 1,
                dp_rank: None,
            }),
            ..ask(p.clone())
        });
        (
            d.unwrap(),
            pin.map(|d| d.candidate.worker_id).map_err(|e| e.code()),
        )
    };
    // keep: the (stale) overlap still steers.
    let (d, pin) = decide(DeadFeedRule::Keep);
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (1, 4));
    assert_eq!(pin, Ok(1));
    // unknown: worker 1 is still a candidate, with overlap 0.
    let (d, pin) = decide(DeadFeedRule::Unknown);
    let rows = d.candidates.unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.overlap_blocks == 0), "{rows:?}");
    assert_eq!(d.overlap_blocks, 0);
    assert_eq!(pin, Ok(1));
    // drain: worker 1 is kept out, named with the rule.
    let (d, pin) = decide(DeadFeedRule::Drain);
    assert_eq!(d.candidate.worker_id, 2);
    let ex = d.excluded.unwrap();
    assert_eq!(
        ex.iter()
            .map(|e| (e.worker_id, e.reason))
            .collect::<Vec<_>>(),
        [(1, "kv_feed_dead")]
    );
    assert_eq!(pin, Err("pinned_worker_feed_dead"));
}

#[test]
fn explain_names_each_excluded_candidate_and_the_rule() {
    let r = router(RouterConfig {
        busy_threshold: Some(0.5),
        ..Default::default()
    });
    r.upsert_worker(1, worker(&["zone=a"], 100)).unwrap();
    r.upsert_worker(2, worker(&["zone=b"], 100)).unwrap();
    r.upsert_worker(3, worker(&["zone=b"], 100)).unwrap();
    r.upsert_worker(4, worker(&["zone=b"], 100)).unwrap();
    r.patch_worker(4, None, Some(true)).unwrap();
    // 80 uncached prompt tokens on worker 3: over half of its 100 batched tokens.
    r.route_now(RouteRequest {
        pinned: Some(Pin {
            worker_id: 3,
            dp_rank: None,
        }),
        ..RouteRequest::tokens(prompt(80))
    })
    .unwrap();
    let d = r
        .route_now(RouteRequest {
            allowed_worker_ids: Some(vec![2, 3, 4]),
            required_taints: vec!["zone=b".into()],
            explain: true,
            ..ask(prompt(32))
        })
        .unwrap();
    assert_eq!(d.candidate.worker_id, 2);
    let row = |w, reason, prefill| ExcludedRow {
        worker_id: w,
        dp_rank: 0,
        reason,
        missing_taints: vec![],
        overlap_blocks: 0,
        active_prefill_tokens: prefill,
    };
    assert_eq!(
        d.excluded.unwrap(),
        [
            row(1, "not_allowed", 0),
            row(3, "busy", 80),
            row(4, "draining", 0)
        ]
    );
    // Without explain nothing is collected.
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert!(d.excluded.is_none() && d.candidates.is_none());
}

#[test]
fn pin_errors_in_spec_order() {
    let r = router(RouterConfig {
        busy_threshold: Some(0.5),
        ..Default::default()
    });
    r.upsert_worker(1, worker(&["zone=a"], 100)).unwrap();
    r.upsert_worker(
        2,
        WorkerSpec {
            dp_size: 2,
            ..worker(&["zone=b"], 100)
        },
    )
    .unwrap();
    let pin = |w, rank| RouteRequest {
        pinned: Some(Pin {
            worker_id: w,
            dp_rank: rank,
        }),
        ..ask(prompt(32))
    };
    let code = |req: RouteRequest| {
        let e = r.route_now(req).unwrap_err();
        e.code()
    };
    assert_eq!(
        code(RouteRequest {
            allowed_worker_ids: Some(vec![2]),
            ..pin(1, None)
        }),
        "pinned_worker_not_allowed"
    );
    assert_eq!(code(pin(9, None)), "pinned_worker_not_found");
    assert_eq!(code(pin(2, Some(5))), "pinned_rank_not_found");
    assert_eq!(
        code(RouteRequest {
            required_taints: vec!["zone=a".into()],
            ..pin(2, None)
        }),
        "pinned_worker_missing_taints"
    );
    let d = r.route_now(pin(2, Some(1))).unwrap();
    assert_eq!(d.candidate, CandidateKey::new(2, 1));
    // Overload worker 1 (book 80 uncached tokens > 0.5 × 100).
    r.route_now(RouteRequest {
        request_id: Some("big".into()),
        ..RouteRequest {
            book: true,
            ..pin(1, None)
        }
    })
    .unwrap();
    let r80 = r.route_now(RouteRequest {
        request_id: Some("big2".into()),
        prompt: Prompt::Tokens((1000..1080).collect()),
        ..RouteRequest {
            book: true,
            ..pin(1, None)
        }
    });
    assert!(r80.is_ok());
    let e = r.route_now(pin(1, None)).unwrap_err();
    assert_eq!(
        (e.code(), e.retryable()),
        ("pinned_worker_overloaded", true)
    );
}

#[test]
fn no_workers_and_bad_input() {
    let r = router(RouterConfig::default());
    assert_eq!(
        r.route_now(ask(prompt(16))).unwrap_err().code(),
        "no_workers"
    );
    // A pin to a worker that does not exist is 404 even when none does (API.md).
    let e = r
        .route_now(RouteRequest {
            pinned: Some(Pin {
                worker_id: 3,
                dp_rank: None,
            }),
            ..ask(prompt(16))
        })
        .unwrap_err();
    assert_eq!(e.code(), "pinned_worker_not_found");
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    let bad = |req: RouteRequest| r.route_now(req).unwrap_err();
    let e = bad(ask(vec![]));
    assert_eq!((e.code(), e.field()), ("invalid_request", Some("tokens")));
    let e = bad(RouteRequest {
        preferred_taints: vec![("fast".into(), 1.0)],
        ..ask(prompt(16))
    });
    assert_eq!(e.field(), Some("routing_constraints.preferred_taints.fast"));
    let e = bad(RouteRequest {
        preferred_taints: vec![("fast".into(), f32::NAN)],
        ..ask(prompt(16))
    });
    assert_eq!(e.code(), "invalid_request");
    let e = bad(RouteRequest {
        temperature: Some(-1.0),
        ..ask(prompt(16))
    });
    assert_eq!(e.field(), Some("temperature"));
    let e = bad(RouteRequest {
        prompt: Prompt::BlockHashes(vec![]),
        ..ask(vec![])
    });
    assert_eq!(e.field(), Some("block_hashes"));
    // Duplicate ids while booked.
    let d = r
        .route_now(RouteRequest {
            request_id: Some("dup".into()),
            ..RouteRequest::tokens(prompt(16))
        })
        .unwrap();
    let e = bad(RouteRequest {
        request_id: Some("dup".into()),
        ..RouteRequest::tokens(prompt(16))
    });
    assert_eq!(e.code(), "duplicate_request_id");
    r.free(&d.request_id).unwrap();
}

#[test]
fn block_hash_prompts_match_token_prompts() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    r.upsert_worker(2, worker(&[], 0)).unwrap();
    let p = prompt(160);
    store(&r, 2, &p, 10);
    let local = hashing::local_block_hashes(&p, 16, hashing::BASE_SEED);
    let d = r
        .route_now(RouteRequest {
            prompt: Prompt::BlockHashes(local),
            ..ask(vec![])
        })
        .unwrap();
    assert_eq!((d.candidate.worker_id, d.overlap_blocks), (2, 10));
    let (blocks, o) = r.overlap(&Prompt::Tokens(p), None, None).unwrap();
    assert_eq!(blocks, 10);
    assert_eq!(o.device, vec![(CandidateKey::new(2, 0), 10)]);
}

/// Version 1 of a test scorer called `name`.
fn test_label(name: &str) -> Arc<PolicyLabel> {
    Arc::new(PolicyLabel {
        name: name.into(),
        version: 1,
        digest: "d".into(),
    })
}

struct FixedScorer(ScorerOutcome);
impl Scorer for FixedScorer {
    fn decide(
        &self,
        _: &PolicyRequest,
        _: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        ScorerDecision {
            outcome: self.0.clone(),
            label: test_label("fixed"),
        }
    }
}

#[test]
fn scorer_answers_are_used_or_fall_back() {
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    r.set_scorer(Some(Box::new(FixedScorer(ScorerOutcome::Costs(vec![
        5.0, 1.0, 3.0,
    ])))));
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert_eq!(
        (d.candidate.worker_id, d.fallback, d.policy.name.as_str()),
        (2, false, "fixed")
    );
    r.set_scorer(Some(Box::new(FixedScorer(ScorerOutcome::Pick(2)))));
    assert_eq!(r.route_now(ask(prompt(32))).unwrap().candidate.worker_id, 3);
    for bad in [
        ScorerOutcome::Costs(vec![1.0]),
        ScorerOutcome::Costs(vec![1.0, f64::NAN, 2.0]),
        ScorerOutcome::Pick(7),
        ScorerOutcome::Fallback("trap"),
    ] {
        r.set_scorer(Some(Box::new(FixedScorer(bad))));
        let d = r.route_now(ask(prompt(32))).unwrap();
        assert!(d.fallback);
    }
    assert_eq!(r.counters.fallbacks.load(Relaxed), 4);
}

/// A scorer that says whether it reads the base cost, records the base-cost column of every
/// call, and answers `answers` in turn (the last one again once they run out).
struct BaseCostScorer {
    reads: bool,
    answers: Vec<ScorerOutcome>,
    seen: parking_lot::Mutex<Vec<Vec<f64>>>,
}

impl Scorer for BaseCostScorer {
    fn decide(
        &self,
        _: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        let mut seen = self.seen.lock();
        seen.push(c.base_cost.clone());
        let i = (seen.len() - 1).min(self.answers.len() - 1);
        ScorerDecision {
            outcome: self.answers[i].clone(),
            label: test_label("base-cost"),
        }
    }

    fn reads_base_cost(&self) -> bool {
        self.reads
    }
}

#[test]
fn the_base_cost_is_computed_only_when_something_reads_it() {
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    let scorer = |reads: bool, answers: Vec<ScorerOutcome>| BaseCostScorer {
        reads,
        answers,
        seen: Default::default(),
    };
    let install = |s: BaseCostScorer| -> Arc<BaseCostScorer> {
        let s = Arc::new(s);
        struct Shared(Arc<BaseCostScorer>);
        impl Scorer for Shared {
            fn decide(
                &self,
                q: &PolicyRequest,
                c: &CandidateColumns,
                t: &TaintNames,
                st: Stage,
            ) -> ScorerDecision {
                self.0.decide(q, c, t, st)
            }
            fn reads_base_cost(&self) -> bool {
                self.0.reads_base_cost()
            }
        }
        r.set_scorer(Some(Box::new(Shared(s.clone()))));
        s
    };
    let costs = ScorerOutcome::Costs(vec![5.0, 1.0, 3.0]);
    // A scorer that reads it gets it; one that does not gets an empty column, and its answer
    // is used as is.
    let s = install(scorer(true, vec![costs.clone()]));
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert_eq!((d.candidate.worker_id, d.fallback), (2, false));
    assert_eq!(s.seen.lock()[0].len(), 3);
    let s = install(scorer(false, vec![costs.clone()]));
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert_eq!((d.candidate.worker_id, d.fallback), (2, false));
    assert_eq!(*s.seen.lock(), vec![Vec::<f64>::new()]);
    // `explain` shows the base cost whoever reads it.
    let mut q = ask(prompt(32));
    q.explain = true;
    let d = r.route_now(q).unwrap();
    assert_eq!(s.seen.lock()[1].len(), 3);
    let rows = d.candidates.expect("explained");
    assert!(rows
        .iter()
        .all(|row| row.base_cost.is_finite() && row.base_cost > 0.0));
    // A policy that reads it took over between the question and the decision: asked again
    // with the column filled, and that answer is used.
    let s = install(scorer(
        false,
        vec![ScorerOutcome::NeedsBaseCost, costs.clone()],
    ));
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert_eq!((d.candidate.worker_id, d.fallback), (2, false));
    let seen = s.seen.lock().clone();
    assert_eq!((seen.len(), seen[0].len(), seen[1].len()), (2, 0, 3));
    // A fallback or a pick without the column: the router computes it for the native cost
    // (which would index an empty column otherwise).
    for (answer, worker, fell_back) in [
        (ScorerOutcome::Fallback("trap"), None, true),
        (ScorerOutcome::Pick(2), Some(3), false),
    ] {
        let s = install(scorer(false, vec![answer]));
        let d = r.route_now(ask(prompt(32))).unwrap();
        assert_eq!(d.fallback, fell_back);
        assert!(worker.is_none_or(|w| w == d.candidate.worker_id));
        assert_eq!(s.seen.lock()[0].len(), 0);
    }
    // A scorer that asks again even with the column filled gave no answer: a fallback.
    install(scorer(false, vec![ScorerOutcome::NeedsBaseCost]));
    let d = r.route_now(ask(prompt(32))).unwrap();
    assert!(d.fallback);
}

#[test]
fn approximate_mode_indexes_its_own_decisions() {
    let r = router(RouterConfig {
        approx: Some(ApproxConfig::default()),
        ..Default::default()
    });
    for w in 1..=4 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    let p = prompt(512);
    let first = r.route_now(RouteRequest::tokens(p.clone())).unwrap();
    r.free(&first.request_id).unwrap();
    let again = r.route_now(ask(p)).unwrap();
    assert_eq!(again.candidate, first.candidate);
    assert_eq!(again.overlap_blocks, 32);
    r.remove_worker(first.candidate.worker_id).unwrap();
    assert_eq!(r.indexer().stats().held_blocks[0], 0);
}

/// A router with queueing on and its one worker made busy by a booked 96-token "hog"
/// (96 > 0.5 × 100).
async fn busy_fleet(order: QueueOrder, queue_timeout: Duration) -> (Arc<Router>, RouteDecision) {
    let r = Arc::new(router(RouterConfig {
        busy_threshold: Some(0.5),
        queue_order: order,
        queue_timeout,
        ..Default::default()
    }));
    r.upsert_worker(1, worker(&[], 100)).unwrap();
    let hog = r
        .route(RouteRequest {
            request_id: Some("hog".into()),
            ..RouteRequest::tokens(prompt(96))
        })
        .await
        .unwrap();
    (r, hog)
}

/// Routes `tokens` as `id` on a task of its own and returns once the request is queued
/// (the queue then holds `depth` requests).
async fn spawn_queued(
    r: &Arc<Router>,
    id: &str,
    tokens: Vec<u32>,
    depth: usize,
) -> tokio::task::JoinHandle<Result<RouteDecision, RouteError>> {
    let r2 = r.clone();
    let id = id.to_string();
    let task = tokio::spawn(async move {
        r2.route(RouteRequest {
            request_id: Some(id),
            ..RouteRequest::tokens(tokens)
        })
        .await
    });
    while r.queue_depth().0 < depth {
        tokio::task::yield_now().await;
    }
    task
}

#[tokio::test]
async fn busy_fleet_queues_and_wakes_on_capacity() {
    let (r, hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(5)).await;
    // The worker is now busy (96 > 50): the next two wait, in order.
    // Each enqueues before the next arrives (FCFS).
    let mut waiters = vec![];
    for i in 0..2u32 {
        let tokens = (0..16).map(|t| t + 100 * i).collect();
        waiters.push(spawn_queued(&r, &format!("w{i}"), tokens, i as usize + 1).await);
    }
    assert_eq!(r.queue_depth(), (2, 32));
    // Ask-only requests never wait: they see the overload.
    assert_eq!(
        r.route(ask(prompt(16))).await.unwrap_err().code(),
        "all_overloaded"
    );
    r.prefill_complete(&hog.request_id).unwrap();
    let a = waiters.remove(0).await.unwrap().unwrap();
    let b = waiters.remove(0).await.unwrap().unwrap();
    assert_eq!((a.request_id.as_str(), b.request_id.as_str()), ("w0", "w1"));
    assert!(a.queued > Duration::ZERO);
    assert_eq!(r.queue_depth(), (0, 0));
}

#[tokio::test]
async fn after_shutdown_the_queue_refuses_instead_of_holding_requests() {
    let (r, _hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(30)).await;
    let waiter = spawn_queued(&r, "early", prompt(16), 1).await;
    assert_eq!(r.shutdown_queue(), 1);
    assert_eq!(waiter.await.unwrap().unwrap_err().code(), "shutting_down");
    // A request that arrives after the drain (its body was still coming in) is refused at
    // once: nobody would ever serve the queue again.
    let late = tokio::time::timeout(
        Duration::from_secs(5),
        r.route(RouteRequest::tokens(prompt(16))),
    )
    .await
    .expect("answered at once, not after the queue timeout");
    assert_eq!(late.unwrap_err().code(), "shutting_down");
    assert_eq!(r.queue_depth().0, 0);
}

#[tokio::test]
async fn wspt_serves_the_waiter_with_the_most_cached_first() {
    let (r, hog) = busy_fleet(QueueOrder::Wspt, Duration::from_secs(5)).await;
    let b = r.config().block_size;
    let uncached: Vec<u32> = (0..8 * b).map(|t| 1000 + t).collect();
    let cached: Vec<u32> = (0..8 * b).map(|t| 2000 + t).collect();
    store(&r, 1, &cached, 3);
    // Same length, same priority; the uncached one arrives first.
    let mut waiters = vec![spawn_queued(&r, "uncached", uncached, 1).await];
    waiters.push(spawn_queued(&r, "cached", cached, 2).await);
    // Each one served keeps the worker busy (128 - 48 and 128 uncached tokens > 50): one at a
    // time.
    r.prefill_complete(&hog.request_id).unwrap();
    let second = waiters.remove(0);
    let first = waiters.remove(0).await.unwrap().unwrap();
    assert_eq!(first.request_id, "cached", "1/(128-48) beats 1/128");
    assert_eq!(r.queue_depth().0, 1, "the uncached one still waits");
    r.prefill_complete(&first.request_id).unwrap();
    assert_eq!(second.await.unwrap().unwrap().request_id, "uncached");
}

#[tokio::test]
async fn a_waiter_whose_caller_goes_away_leaves_the_queue_at_once() {
    let (r, hog) = busy_fleet(QueueOrder::Fcfs, Duration::from_secs(30)).await;
    let waiter = spawn_queued(&r, "gone", prompt(16), 1).await;
    // The caller goes away (an HTTP client disconnecting drops its handler the same way).
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert_eq!(r.queue_depth(), (0, 0), "out of the queue at once");
    // Its id is free: the same id routes once there is room, with nothing else booked.
    r.prefill_complete(&hog.request_id).unwrap();
    let again = r
        .route(RouteRequest {
            request_id: Some("gone".into()),
            ..RouteRequest::tokens(prompt(16))
        })
        .await
        .unwrap();
    assert_eq!(again.request_id, "gone");
    assert_eq!(r.active_bookings(), 2);
}

#[tokio::test]
async fn queue_limits_cancellation_and_timeout() {
    let r = Arc::new(router(RouterConfig {
        busy_threshold: Some(0.5),
        queue_limits: QueueLimits {
            max_requests_per_worker: 1,
            max_tokens_per_worker: 1000,
        },
        queue_timeout: Duration::from_millis(200),
        ..Default::default()
    }));
    r.upsert_worker(1, worker(&[], 100)).unwrap();
    r.route(RouteRequest::tokens(prompt(96))).await.unwrap();
    let waiting = spawn_queued(&r, "wait", prompt(16), 1).await;
    let full = r.route(RouteRequest::tokens(prompt(16))).await.unwrap_err();
    assert_eq!((full.code(), full.retryable()), ("queue_requests", true));
    // Cancel the waiting one.
    assert!(r.free("wait").unwrap().is_none());
    assert_eq!(
        waiting.await.unwrap().unwrap_err().code(),
        "request_cancelled"
    );
    // A lone waiter times out and leaves the queue.
    let e = r.route(RouteRequest::tokens(prompt(16))).await.unwrap_err();
    assert_eq!((e.code(), e.retryable()), ("queue_timeout", true));
    assert_eq!(r.queue_depth().0, 0);
}

#[test]
fn removing_a_worker_removes_its_load_and_index() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    let p = prompt(64);
    store(&r, 1, &p, 4);
    let d = r.route_now(RouteRequest::tokens(p)).unwrap();
    r.remove_worker(1).unwrap();
    assert_eq!(r.active_bookings(), 0);
    assert!(r.free(&d.request_id).is_err());
    assert_eq!(r.indexer().stats().held_blocks[0], 0);
    // Events of unknown workers are dropped and counted.
    let ev = KvEvent {
        candidate: CandidateKey::new(1, 0),
        tier: Tier::Device,
        event_id: 0,
        data: KvEventData::Cleared,
    };
    assert_eq!(r.apply_event(&ev), Ok(None));
    assert_eq!(r.counters.events_unknown_worker.load(Relaxed), 1);
}

#[test]
fn an_event_that_lost_the_race_with_a_removal_leaves_nothing_behind() {
    let r = router(RouterConfig::default());
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    let p = prompt(64);
    let local = hashing::local_block_hashes(&p, r.config().block_size as usize, hashing::BASE_SEED);
    let root_store = KvEvent {
        candidate: CandidateKey::new(1, 0),
        tier: Tier::Device,
        event_id: 0,
        data: KvEventData::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: 7,
                tokens_hash: local[0],
            }],
        },
    };
    // The router checked its registry (worker 1 present), then the worker was removed before
    // the event reached the index: what `apply_event` does after its check.
    r.remove_worker(1).unwrap();
    assert_eq!(r.indexer().apply_to_known(&root_store), Ok(None));
    assert_eq!(r.indexer().existing_slot(CandidateKey::new(1, 0)), None);
    // The same id registered again starts empty.
    r.upsert_worker(1, worker(&[], 0)).unwrap();
    assert!(r
        .overlap(&Prompt::Tokens(p), None, None)
        .unwrap()
        .1
        .device
        .is_empty());
}

#[test]
fn explain_shows_each_candidates_feed_trust() {
    use crate::feeds::Trust;
    let r = router(RouterConfig::default());
    for w in 1..=3 {
        r.upsert_worker(w, worker(&[], 0)).unwrap();
    }
    // Worker 1's feed just opened (recovering until its first sync); worker 2's lost events for
    // good; worker 3 has no feed.
    let _c1 = r.feeds().open(CandidateKey::new(1, 0));
    let c2 = r.feeds().open(CandidateKey::new(2, 0));
    c2.set_trust(Trust::Degraded);
    let trusts = |r: &Router| {
        let d = r
            .route_now(RouteRequest {
                explain: true,
                ..ask(prompt(64))
            })
            .unwrap();
        let mut rows: Vec<_> = d
            .candidates
            .unwrap()
            .iter()
            .map(|c| (c.worker_id, c.kv_feed_trust))
            .collect();
        rows.sort_by_key(|(w, _)| *w);
        rows
    };
    assert_eq!(
        trusts(&r),
        [
            (1, Trust::Recovering),
            (2, Trust::Degraded),
            (3, Trust::Exact)
        ]
    );
    c2.set_trust(Trust::Exact);
    assert_eq!(
        trusts(&r),
        [(1, Trust::Recovering), (2, Trust::Exact), (3, Trust::Exact)]
    );
}
