//! `kvroute serve --remote-indexer URL`: a router that keeps no index asks a served indexer
//! (`--serve-indexer`) for each request's overlaps, and decides as a router with the same index of
//! its own would, predict-on-route included (predictions are the router's own, not the indexer's);
//! when the indexer is down or slow it routes with zero overlap, says so (`overlap_source: none`)
//! and counts the failure.

use crate::support;

use std::collections::BTreeMap;

use serde_json::{json, Value};
use support::{local_hashes, metric, stored_event, Server, BASE_SEED};

fn prompt(blocks: usize, family: u32) -> Vec<u32> {
    (0..(blocks * 16) as u32)
        .map(|i| family.wrapping_mul(7_919).wrapping_add(i * 13 + 5))
        .collect()
}

/// The candidate (worker, rank) a decision chose, or an `explain` row stands for.
fn chosen(d: &Value) -> (u64, u64) {
    (
        d["worker_id"].as_u64().unwrap(),
        d["dp_rank"].as_u64().unwrap(),
    )
}

/// The rows of an `explain` answer.
fn rows(d: &Value) -> &Vec<Value> {
    d["candidates"]
        .as_array()
        .unwrap_or_else(|| panic!("explain rows: {d}"))
}

/// A figure of each candidate in an `explain` answer: (worker, rank) → its figure.
fn per_candidate<T>(d: &Value, figure: impl Fn(&Value) -> T) -> BTreeMap<(u64, u64), T> {
    rows(d).iter().map(|c| (chosen(c), figure(c))).collect()
}

/// Each candidate's overlaps in an `explain` answer: (worker, rank) → [device, host, disk].
fn explained(d: &Value) -> BTreeMap<(u64, u64), [u64; 3]> {
    per_candidate(d, |c| {
        [
            "overlap_blocks",
            "host_overlap_blocks",
            "disk_overlap_blocks",
        ]
        .map(|k| c[k].as_u64().unwrap())
    })
}

/// Each candidate's predicted overlap in an `explain` answer: (worker, rank) → blocks.
fn predicted(d: &Value) -> BTreeMap<(u64, u64), u64> {
    per_candidate(d, |c| c["predicted_overlap_blocks"].as_u64().unwrap())
}

/// The candidates of an `explain` answer with the lowest cost.
fn lowest_cost(d: &Value) -> Vec<(u64, u64)> {
    let cost = |c: &Value| c["cost"].as_f64().unwrap();
    let min = rows(d).iter().map(cost).fold(f64::INFINITY, f64::min);
    rows(d)
        .iter()
        .filter(|c| cost(c) == min)
        .map(chosen)
        .collect()
}

fn register(s: &Server) {
    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({"dp_size": 2}));
    s.put_worker(3, &json!({"taints": ["big"]}));
    s.put_worker(4, &json!({}));
}

/// A served indexer, a router with its own index and a router reading the indexer, each with
/// the same workers registered.
fn indexer_local_remote() -> (Server, Server, Server) {
    let indexer = Server::start(&["--serve-indexer"]);
    let local = Server::start(&[]);
    let remote = Server::start(&["--remote-indexer", &indexer.url("")]);
    for s in [&indexer, &local, &remote] {
        register(s);
    }
    (indexer, local, remote)
}

#[test]
fn a_remote_indexer_router_decides_as_a_local_index_one_on_the_same_events() {
    let (indexer, local, remote) = indexer_local_remote();
    // The same events to the indexer and to the local-index router: prompt families of different
    // depths on different candidates, some shared (a longer and a shorter holder).
    let candidates = [(1, 0), (2, 0), (2, 1), (3, 0), (4, 0)];
    let mut events = Vec::new();
    let mut id = 0;
    for family in 0..20u32 {
        let (w, r) = candidates[family as usize % candidates.len()];
        let full = local_hashes(&prompt(12, family), 16, BASE_SEED);
        let depth = 3 + (family as usize * 5) % 9;
        id += 1;
        events.push(stored_event(w, r, id, &full[..depth]));
        // A second holder of a shorter prefix of the same prompt.
        let (w2, r2) = candidates[(family as usize + 2) % candidates.len()];
        id += 1;
        events.push(stored_event(w2, r2, id, &full[..depth / 2]));
    }
    for s in [&indexer, &local] {
        s.post("/v1/events", &json!(events)).expect(200);
    }
    let (mut compared, mut unique) = (0, 0);
    for family in 0..20u32 {
        for blocks in [2usize, 6, 12] {
            let body = json!({"tokens": prompt(blocks, family), "book": false, "explain": true});
            let a = local.route_ok(&body);
            let b = remote.route_ok(&body);
            assert_eq!(a["overlap_source"], "local", "{a}");
            assert_eq!(b["overlap_source"], "remote", "{b}");
            assert_eq!(
                explained(&a),
                explained(&b),
                "family {family}, {blocks} blocks: every candidate's overlaps"
            );
            // The same choice; among equal costs the tie-break is random, so a tie allows any
            // of the tied candidates (the default prices a prompt's last block as computed
            // whatever the overlap, so candidates holding 1 or 2 blocks of a 2-block prompt tie).
            let best = lowest_cost(&a);
            assert!(
                best.contains(&chosen(&b)),
                "family {family}, {blocks} blocks: the same choice\n{a}\n{b}"
            );
            if chosen(&a) == chosen(&b) {
                assert_eq!(a["overlap_blocks"], b["overlap_blocks"]);
            }
            if best.len() == 1 {
                unique += 1;
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 60);
    assert!(
        unique >= 20,
        "only {unique} decisions had one best candidate"
    );
    // Precomputed block hashes are asked about the same way.
    let hashes = local_hashes(&prompt(8, 3), 16, BASE_SEED);
    let body = json!({"block_hashes": hashes, "book": false});
    assert_eq!(
        local.route_ok(&body)["worker_id"],
        remote.route_ok(&body)["worker_id"]
    );
    // Events posted to the remote router would feed an index no decision reads: refused.
    remote
        .post("/v1/events", &json!(events))
        .expect_error(409, "no_local_index");
    // The remote router subscribes to no engine and counted no failure.
    let text = remote.metrics();
    assert_eq!(
        metric(&text, "kvroute_kv_subscriptions"),
        None,
        "no ingestion"
    );
    assert_eq!(
        metric(
            &text,
            "kvroute_remote_indexer_failures_total{reason=\"timeout\"}"
        ),
        Some(0.0)
    );
    assert!(metric(&text, "kvroute_remote_indexer_duration_seconds_count").unwrap() >= 61.0);
}

/// Predict-on-route (on by default) is the router's own: a remote-indexer router records the
/// prompts it books and max-combines them with the indexer's overlaps, as a local-index router does
/// with its index, so after booking the same request both see the same overlaps and decide alike
/// before any KV event arrives.
#[test]
fn a_remote_indexer_router_predicts_its_booked_prompts_as_a_local_index_one() {
    let (indexer, local, remote) = indexer_local_remote();
    // 3 of the prompt's 128 blocks (2,048 tokens) cached on (4, 0) alone: the one best candidate
    // for it. Long enough that, once the whole prompt is predicted there, its cache outweighs the
    // decode interference of the request booked on it.
    const BLOCKS: usize = 128;
    let p = prompt(BLOCKS, 77);
    let full = local_hashes(&p, 16, BASE_SEED);
    for s in [&indexer, &local] {
        s.post("/v1/events", &json!([stored_event(4, 0, 1, &full[..3])]))
            .expect(200);
    }
    let first = json!({"tokens": p, "request_id": "first", "explain": true});
    for d in [local.route_ok(&first), remote.route_ok(&first)] {
        assert_eq!(chosen(&d), (4, 0), "{d}");
        assert!(
            predicted(&d).values().all(|&v| v == 0),
            "nothing predicted before the first booking: {d}"
        );
    }
    // The same prompt again, with no KV event since: both predict its 128 blocks on (4, 0), see
    // the same overlaps on every candidate and choose it.
    let again = json!({"tokens": p, "book": false, "explain": true});
    let (a, b) = (local.route_ok(&again), remote.route_ok(&again));
    assert_eq!(a["overlap_source"], "local", "{a}");
    assert_eq!(b["overlap_source"], "remote", "{b}");
    assert_eq!(predicted(&a)[&(4, 0)], BLOCKS as u64, "{a}");
    assert_eq!(predicted(&a), predicted(&b), "predicted overlaps");
    // Explain's overlap is what the engine reuses of this block-aligned prompt: all but its
    // last block (SPEC §5); the prediction itself covers all of them.
    assert_eq!(explained(&b)[&(4, 0)], [BLOCKS as u64 - 1, 0, 0], "{b}");
    assert_eq!(explained(&a), explained(&b), "every candidate's overlaps");
    assert_eq!(lowest_cost(&a), vec![(4, 0)], "{a}");
    assert_eq!(lowest_cost(&b), vec![(4, 0)], "{b}");
    assert_eq!((chosen(&a), chosen(&b)), ((4, 0), (4, 0)));
    assert_eq!(
        metric(
            &remote.metrics(),
            "kvroute_predictions_total{outcome=\"recorded\"}"
        ),
        Some(BLOCKS as f64)
    );
}

#[test]
fn with_the_indexer_down_or_slow_decisions_are_answered_with_zero_overlap_and_counted() {
    let indexer = Server::start(&["--serve-indexer"]);
    let remote = Server::start(&["--remote-indexer", &indexer.url("")]);
    for s in [&indexer, &remote] {
        register(s);
    }
    let p = prompt(6, 1);
    let full = local_hashes(&p, 16, BASE_SEED);
    indexer
        .post("/v1/events", &json!([stored_event(3, 0, 1, &full)]))
        .expect(200);
    let d = remote.route_ok(&json!({"tokens": p, "book": false}));
    assert_eq!(
        (d["overlap_source"].as_str(), d["worker_id"].as_u64()),
        (Some("remote"), Some(3))
    );
    assert_eq!(d["overlap_blocks"], 6);
    drop(indexer);
    for i in 0..5 {
        let d = remote.route_ok(&json!({"tokens": p, "request_id": format!("down-{i}")}));
        assert_eq!(d["overlap_source"], "none", "{d}");
        assert_eq!(d["overlap_blocks"], 0, "{d}");
    }
    let text = remote.metrics();
    assert_eq!(
        metric(
            &text,
            "kvroute_remote_indexer_failures_total{reason=\"connect\"}"
        ),
        Some(5.0),
        "{text}"
    );

    // An indexer that accepts connections and never answers: the timeout (50 ms by default).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let slow = Server::start(&["--remote-indexer", &url]);
    slow.put_worker(1, &json!({}));
    let started = std::time::Instant::now();
    let d = slow.route_ok(&json!({"tokens": p, "book": false}));
    assert!(started.elapsed() < std::time::Duration::from_secs(2));
    assert_eq!(d["overlap_source"], "none", "{d}");
    assert_eq!(
        metric(
            &slow.metrics(),
            "kvroute_remote_indexer_failures_total{reason=\"timeout\"}"
        ),
        Some(1.0)
    );
}

#[test]
fn remote_indexer_settings_are_checked_at_start() {
    for (args, needle) in [
        (vec!["--remote-indexer", "ftp://x:1"], "remote_indexer"),
        (
            vec!["--remote-indexer", "http://127.0.0.1:1", "--serve-indexer"],
            "serve_indexer",
        ),
        (
            vec!["--remote-indexer", "http://127.0.0.1:1", "--approximate"],
            "approximate",
        ),
    ] {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
        all.extend(args);
        let (status, _, err) = support::run_to_exit(&all, &[], std::time::Duration::from_secs(20));
        assert_eq!(status.code(), Some(2), "{err}");
        assert!(err.contains(needle), "{needle}: {err}");
    }
}
