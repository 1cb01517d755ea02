//! End-to-end tests of HTTP API v1 (docs/API.md, docs/SPEC.md §6): each test starts the
//! real `kvroute` binary on a loopback port and drives it over real HTTP.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{
    assert_error_shape, local_hashes, metric, run_to_exit, sequence_hashes, stored_event,
    temp_file, Server, BASE_SEED,
};

const NATIVE_PLUGIN: &str = "kvroute-plugin-native-cost";

/// Environment variables for a child process.
type EnvVars = Vec<(&'static str, &'static str)>;
/// Request headers with owned values.
type OwnedHeaders = Vec<(&'static str, String)>;

/// `n` tokens, distinct for each `salt`.
fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| salt.wrapping_mul(1_000_003).wrapping_add(i * 7 + 1))
        .collect()
}

/// Waits (up to `timeout`) until `f` holds.
#[track_caller]
fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn rank(worker: &Value, dp_rank: u64) -> &Value {
    worker["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .find(|r| r["dp_rank"] == dp_rank)
        .unwrap_or_else(|| panic!("no rank {dp_rank} in {worker}"))
}

fn post_events(s: &Server, events: &Value) -> Value {
    let r = s.post("/v1/events", events);
    r.expect(200);
    r.body().clone()
}

/// `POST /v1/overlap` rows as (worker_id, dp_rank) → [device, host, disk].
fn overlap(s: &Server, body: &Value) -> (Value, BTreeMap<(u64, u64), [u64; 3]>) {
    let r = s.post("/v1/overlap", body);
    r.expect(200);
    let b = r.body().clone();
    let rows = b["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .map(|w| {
            (
                (
                    w["worker_id"].as_u64().unwrap(),
                    w["dp_rank"].as_u64().unwrap(),
                ),
                [
                    w["device_blocks"].as_u64().unwrap(),
                    w["host_blocks"].as_u64().unwrap(),
                    w["disk_blocks"].as_u64().unwrap(),
                ],
            )
        })
        .collect();
    (b, rows)
}

// ------------------------------------------------------------------------------------- hashing

#[test]
fn spec_hash_vectors_hold_for_the_test_helpers() {
    // The tests compute SPEC §2 hashes on their own; check that against the spec's vectors first.
    let l = local_hashes(&(1..=12).collect::<Vec<u32>>(), 4, BASE_SEED);
    assert_eq!(
        l,
        vec![
            14643705804678351452,
            16777012769546811212,
            483935686894639516
        ]
    );
    let s = sequence_hashes(&l);
    assert_eq!(s[1], 4945711292740353085);
    assert_eq!(s[2], 12583592247330656132);
    let lora = lora_seed("my-lora");
    assert_eq!(lora, 12827409268353072861);
    assert_eq!(
        local_hashes(&[1, 2, 3, 4], 4, lora)[0],
        15671544057904749233
    );
}

fn lora_seed(lora: &str) -> u64 {
    BASE_SEED.wrapping_add(xxhash_rust::xxh3::xxh3_64_with_seed(lora.as_bytes(), 0))
}

// ------------------------------------------------------------------------------------- workers

#[test]
fn workers_register_patch_drain_delete() {
    let s = Server::start(&[]);
    let w = s.put_worker(
        10,
        &json!({"dp_start": 4, "dp_size": 3, "taints": ["zone=a", "gpu=h100"],
                "total_kv_blocks": 1000, "max_num_batched_tokens": 2048}),
    );
    assert_eq!(w["worker_id"], 10);
    assert_eq!(w["dp_start"], 4);
    assert_eq!(w["dp_size"], 3);
    assert_eq!(w["taints"], json!(["zone=a", "gpu=h100"]));
    assert_eq!(w["draining"], false);
    let ranks: Vec<u64> = w["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["dp_rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, vec![4, 5, 6]);
    s.put_worker(11, &json!({"taints": ["zone=b"]}));

    let all = s.workers();
    assert_eq!(all.len(), 2);
    for k in [
        "worker_id",
        "dp_start",
        "dp_size",
        "taints",
        "draining",
        "ranks",
    ] {
        assert!(
            all[&10].get(k).is_some(),
            "GET /v1/workers lacks {k}: {}",
            all[&10]
        );
    }
    for k in [
        "dp_rank",
        "active_prefill_tokens",
        "active_decode_blocks",
        "active_requests",
        "cached_blocks",
    ] {
        assert!(rank(&all[&10], 5).get(k).is_some(), "rank lacks {k}");
    }

    // Per-rank load: a booked request pinned to rank 5 shows on rank 5 only.
    let d = s.route_ok(&json!({"request_id": "w-1", "tokens": tokens(40, 1),
                               "pinned_worker": {"worker_id": 10, "dp_rank": 5}}));
    assert_eq!(
        (d["worker_id"].as_u64(), d["dp_rank"].as_u64()),
        (Some(10), Some(5))
    );
    let all = s.workers();
    let r5 = rank(&all[&10], 5);
    assert_eq!(r5["active_requests"], 1, "{r5}");
    assert_eq!(r5["active_prefill_tokens"], 40, "{r5}");
    assert!(r5["active_decode_blocks"].as_u64().unwrap() >= 2, "{r5}");
    assert_eq!(rank(&all[&10], 4)["active_requests"], 0);
    s.delete("/v1/requests/w-1").expect(200);

    // Taints are replaced, not merged.
    let p = s.patch("/v1/workers/10", &json!({"taints": ["zone=c"]}));
    p.expect(200);
    assert_eq!(p.body()["taints"], json!(["zone=c"]));
    assert_eq!(s.workers()[&10]["taints"], json!(["zone=c"]));
    s.post(
        "/v1/route",
        &json!({"tokens": tokens(32, 2), "book": false,
                "routing_constraints": {"required_taints": ["zone=a"]}}),
    )
    .expect_error(503, "all_filtered_by_constraints");
    let d = s.route_ok(&json!({"tokens": tokens(32, 2), "book": false,
                               "routing_constraints": {"required_taints": ["zone=c"]}}));
    assert_eq!(d["worker_id"], 10);

    // Draining stops new routes (and is shown); undraining restores them.
    let p = s.patch("/v1/workers/10", &json!({"draining": true}));
    p.expect(200);
    assert_eq!(p.body()["draining"], true);
    assert_eq!(s.workers()[&10]["draining"], true);
    for i in 0..20 {
        let d = s.route_ok(&json!({"tokens": tokens(64, 100 + i), "book": false}));
        assert_eq!(d["worker_id"], 11, "a draining worker got a new route");
    }
    s.post(
        "/v1/route",
        &json!({"tokens": tokens(32, 3), "book": false,
                "routing_constraints": {"required_taints": ["zone=c"]}}),
    )
    .expect_error(503, "all_filtered_by_constraints");
    s.post(
        "/v1/route",
        &json!({"tokens": tokens(32, 3), "pinned_worker": {"worker_id": 10}}),
    )
    .expect_error(409, "pinned_worker_draining");
    s.patch("/v1/workers/10", &json!({"draining": false}))
        .expect(200);
    let d = s.route_ok(&json!({"tokens": tokens(32, 3), "book": false,
                               "routing_constraints": {"required_taints": ["zone=c"]}}));
    assert_eq!(d["worker_id"], 10);

    // Replace: fewer ranks.
    let w = s.put_worker(10, &json!({"dp_size": 1}));
    assert_eq!(w["ranks"].as_array().unwrap().len(), 1);
    assert_eq!(w["taints"], json!([]));

    // Delete: 204, then 404 for everything about it.
    let r = s.delete("/v1/workers/10");
    r.expect(204);
    assert!(r.text.is_empty(), "204 has no body: {r}");
    assert!(!s.workers().contains_key(&10));
    s.delete("/v1/workers/10")
        .expect_error(404, "unknown_worker");
    s.patch("/v1/workers/10", &json!({"draining": true}))
        .expect_error(404, "unknown_worker");
    s.post(
        "/v1/route",
        &json!({"tokens": tokens(32, 4), "pinned_worker": {"worker_id": 10}}),
    )
    .expect_error(404, "pinned_worker_not_found");
    s.delete("/v1/workers/11").expect(204);
    s.post("/v1/route", &json!({"tokens": tokens(32, 4)}))
        .expect_error(503, "no_workers");
}

// -------------------------------------------------------------------------------------- events

#[test]
fn events_stored_removed_cleared_and_bad_beside_good() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({"dp_start": 0, "dp_size": 2}));
    let p = tokens(3 * 16 + 7, 11);
    let local = local_hashes(&p, 16, BASE_SEED);
    let seq = sequence_hashes(&local);
    assert_eq!(local.len(), 3);

    let mut host = stored_event(1, 0, 2, &local[..2]);
    host["storage_tier"] = json!("host");
    let out = post_events(
        &s,
        &json!([
            stored_event(1, 1, 1, &local),
            {"worker_id": 1, "event": {"event_id": 9, "data": {"bogus": {}}}},
            host,
            stored_event(99, 0, 3, &local),
        ]),
    );
    assert_eq!(out["applied"], 2, "{out}");
    assert_eq!(out["dropped"], 2, "{out}");
    let errors = out["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 2, "{out}");
    assert_eq!(errors[0]["index"], 1);
    assert_eq!(errors[0]["code"], "invalid_event");
    assert!(errors[0]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(errors[1]["index"], 3);
    assert_eq!(errors[1]["code"], "unknown_worker");

    let w = &s.workers()[&1];
    assert_eq!(rank(w, 1)["cached_blocks"], 3, "{w}");
    assert_eq!(
        rank(w, 0)["cached_blocks"],
        0,
        "host-tier blocks are not device blocks: {w}"
    );
    let (b, rows) = overlap(&s, &json!({"tokens": p}));
    assert_eq!(b["block_size"], 16);
    assert_eq!(b["num_blocks"], 3);
    assert_eq!(rows[&(1, 1)], [3, 0, 0]);
    assert_eq!(rows[&(1, 0)], [0, 2, 0]);
    let m = s.metrics();
    assert_eq!(
        metric(&m, "kvroute_index_blocks{tier=\"device\"}"),
        Some(3.0)
    );
    assert_eq!(metric(&m, "kvroute_index_blocks{tier=\"host\"}"), Some(2.0));

    // Removing block 1 removes everything below it on that rank.
    let out = post_events(
        &s,
        &json!([{"worker_id": 1, "event": {"event_id": 4, "dp_rank": 1,
                  "data": {"removed": {"block_hashes": [support::engine_hash(seq[1])]}}}}]),
    );
    assert_eq!(out["applied"], 1, "{out}");
    assert_eq!(overlap(&s, &json!({"tokens": p})).1[&(1, 1)], [1, 0, 0]);
    assert_eq!(rank(&s.workers()[&1], 1)["cached_blocks"], 1);

    // A store under a parent: blocks 1 and 2 hang under block 0 again.
    let tail: Vec<Value> = (1..3)
        .map(|i| json!({"block_hash": support::engine_hash(seq[i]), "tokens_hash": local[i]}))
        .collect();
    let out = post_events(
        &s,
        &json!([
            {"worker_id": 1, "event": {"event_id": 5, "dp_rank": 1, "data": {"stored": {
                "parent_hash": support::engine_hash(seq[0]), "blocks": tail}}}},
            {"worker_id": 1, "event": {"event_id": 6, "dp_rank": 1, "data": {"stored": {
                "parent_hash": 12345, "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}}}
        ]),
    );
    assert_eq!(out["applied"], 1, "{out}");
    assert_eq!(out["errors"][0]["index"], 1, "{out}");
    assert_eq!(out["errors"][0]["code"], "parent_block_not_found", "{out}");
    assert_eq!(overlap(&s, &json!({"tokens": p})).1[&(1, 1)], [3, 0, 0]);

    // Cleared: the rank holds nothing, in any tier, whatever tier the event names (SPEC §3); the
    // other rank keeps its host blocks.
    let mut host1 = stored_event(1, 1, 7, &local[..1]);
    host1["storage_tier"] = json!("host");
    assert_eq!(post_events(&s, &json!([host1]))["applied"], 1);
    assert_eq!(overlap(&s, &json!({"tokens": p})).1[&(1, 1)], [3, 1, 0]);
    let out = post_events(
        &s,
        &json!([{"worker_id": 1, "storage_tier": "disk",
                 "event": {"event_id": 8, "dp_rank": 1, "data": "cleared"}}]),
    );
    assert_eq!(out["applied"], 1, "{out}");
    let rows = overlap(&s, &json!({"tokens": p})).1;
    assert!(!rows.contains_key(&(1, 1)), "{rows:?}");
    assert_eq!(rows[&(1, 0)], [0, 2, 0]);
    assert_eq!(rank(&s.workers()[&1], 1)["cached_blocks"], 0);
    assert_eq!(
        metric(&s.metrics(), "kvroute_index_blocks{tier=\"host\"}"),
        Some(2.0)
    );

    // Deleting the worker drops its blocks from the index.
    s.delete("/v1/workers/1").expect(204);
    assert!(overlap(&s, &json!({"tokens": p})).1.is_empty());
    let m = s.metrics();
    assert_eq!(metric(&m, "kvroute_index_blocks{tier=\"host\"}"), Some(0.0));
}

// ------------------------------------------------------------------------------------- routing

#[test]
fn route_follows_real_block_hashes() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({"dp_size": 2}));
    s.put_worker(2, &json!({}));
    s.put_worker(3, &json!({}));
    let p = tokens(4 * 16 + 5, 21);
    let local = local_hashes(&p, 16, BASE_SEED);
    let out = post_events(&s, &json!([stored_event(2, 0, 1, &local)]));
    assert_eq!(out["applied"], 1, "{out}");

    for _ in 0..5 {
        let d = s.route_ok(&json!({"tokens": p, "book": false}));
        assert_eq!(d["worker_id"], 2, "{d}");
        assert_eq!(d["dp_rank"], 0);
        assert_eq!(d["overlap_blocks"], 4);
        assert_eq!(d["cached_tokens"], 64);
        assert_eq!(d["fallback"], false);
        assert_eq!(d["queued_ms"], 0);
        for k in ["request_id", "policy"] {
            assert!(d.get(k).is_some(), "decision lacks {k}: {d}");
        }
        assert!(
            d.get("candidates").is_none(),
            "candidates only with explain: {d}"
        );
    }
    // The block_hashes form of the same prompt.
    // Block hashes alone say the prompt is 4 whole blocks (64 tokens) long, and the engine reuses
    // at most prompt - 1 tokens rounded down to a block (SPEC §5): 3 blocks are cached.
    let d = s.route_ok(&json!({"block_hashes": local, "book": false}));
    assert_eq!(d["worker_id"], 2, "{d}");
    assert_eq!(d["overlap_blocks"], 4);
    assert_eq!(d["cached_tokens"], 48);
    // A prompt sharing the first two blocks only.
    let mut q = p[..32].to_vec();
    q.extend(tokens(48, 22));
    let d = s.route_ok(&json!({"tokens": q, "book": false}));
    assert_eq!(
        (d["worker_id"].as_u64(), d["overlap_blocks"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(d["cached_tokens"], 32);
    // Another lora is another cache.
    let (_, rows) = overlap(&s, &json!({"tokens": p, "lora_name": "my-lora"}));
    assert!(rows.is_empty(), "{rows:?}");
    let lora_local = local_hashes(&p, 16, lora_seed("my-lora"));
    post_events(&s, &json!([stored_event(3, 0, 2, &lora_local[..3])]));
    let d = s.route_ok(&json!({"tokens": p, "lora_name": "my-lora", "book": false}));
    assert_eq!(
        (d["worker_id"].as_u64(), d["overlap_blocks"].as_u64()),
        (Some(3), Some(3))
    );
    let (_, rows) = overlap(&s, &json!({"tokens": p}));
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), vec![(2, 0)]);
    assert_eq!(rows[&(2, 0)], [4, 0, 0]);

    // Booked: the load shows on the chosen rank; uncached tokens are the prefill load.
    let d = s.route_ok(&json!({"request_id": "cached-1", "tokens": p}));
    assert_eq!(d["request_id"], "cached-1");
    assert_eq!(d["worker_id"], 2);
    let w = &s.workers()[&2];
    assert_eq!(rank(w, 0)["active_requests"], 1, "{w}");
    assert_eq!(rank(w, 0)["active_prefill_tokens"], 5, "{w}");
    assert_eq!(rank(w, 0)["cached_blocks"], 4, "{w}");
}

#[test]
fn route_constraints_and_pin_errors() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({"taints": ["zone=a"]}));
    s.put_worker(2, &json!({"taints": ["zone=b", "gpu=h100"]}));
    s.put_worker(3, &json!({"taints": ["zone=b"]}));
    let p = tokens(64, 31);
    let route = |extra: Value| {
        let mut body = json!({"tokens": p, "book": false});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s.post("/v1/route", &body)
    };
    let pick = |extra: Value| {
        let r = route(extra);
        r.expect(200);
        r.body()["worker_id"].as_u64().unwrap()
    };

    for _ in 0..5 {
        assert_eq!(
            pick(json!({"routing_constraints": {"required_taints": ["zone=b", "gpu=h100"]}})),
            2
        );
        let w = pick(json!({"routing_constraints": {"required_taints": ["zone=b"]}}));
        assert!(w == 2 || w == 3);
        assert_eq!(pick(json!({"allowed_worker_ids": [3]})), 3);
        assert_eq!(
            pick(json!({"allowed_worker_ids": [1, 3],
                               "routing_constraints": {"required_taints": ["zone=b"]}})),
            3
        );
        assert_eq!(pick(json!({"pinned_worker": {"worker_id": 1}})), 1);
        assert_eq!(
            pick(json!({"pinned_worker": {"worker_id": 1, "dp_rank": 0}})),
            1
        );
    }
    // Preferred taints are accepted (soft; idle ties need not follow them).
    pick(json!({"routing_constraints": {"preferred_taints": {"gpu=h100": 0.5, "zone=a": -0.5}}}));

    route(json!({"routing_constraints": {"required_taints": ["zone=z"]}}))
        .expect_error(503, "all_filtered_by_constraints");
    route(json!({"allowed_worker_ids": [42]})).expect_error(503, "all_filtered_by_constraints");
    route(json!({"allowed_worker_ids": []})).expect_error(503, "all_filtered_by_constraints");

    // The pin checks, in SPEC §6 order, each with its own status.
    let r = route(json!({"pinned_worker": {"worker_id": 1}, "allowed_worker_ids": [2]}));
    r.expect_error(400, "pinned_worker_not_allowed");
    assert_eq!(r.field(), Some("pinned_worker"));
    route(json!({"pinned_worker": {"worker_id": 42}, "allowed_worker_ids": [2]}))
        .expect_error(400, "pinned_worker_not_allowed");
    let r = route(json!({"pinned_worker": {"worker_id": 42}}));
    r.expect_error(404, "pinned_worker_not_found");
    assert_eq!(r.field(), Some("pinned_worker"));
    route(json!({"pinned_worker": {"worker_id": 1, "dp_rank": 3}}))
        .expect_error(400, "pinned_rank_not_found");
    route(json!({"pinned_worker": {"worker_id": 1},
                 "routing_constraints": {"required_taints": ["zone=b"]}}))
    .expect_error(409, "pinned_worker_missing_taints");
    s.patch("/v1/workers/1", &json!({"draining": true}))
        .expect(200);
    route(json!({"pinned_worker": {"worker_id": 1}})).expect_error(409, "pinned_worker_draining");
    route(json!({"allowed_worker_ids": [1]})).expect_error(503, "all_filtered_by_constraints");

    for id in 1..=3 {
        s.delete(&format!("/v1/workers/{id}")).expect(204);
    }
    route(json!({})).expect_error(503, "no_workers");
}

#[test]
fn route_ask_only_and_explain() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({"taints": ["zone=a"]}));
    s.put_worker(2, &json!({"dp_size": 2, "taints": ["zone=b"]}));
    let p = tokens(80, 41);
    post_events(
        &s,
        &json!([stored_event(2, 1, 1, &local_hashes(&p, 16, BASE_SEED)[..2])]),
    );
    // Some booked load first, so "unchanged" is not trivially zero.
    s.route_ok(&json!({"request_id": "base", "tokens": tokens(50, 42),
                       "pinned_worker": {"worker_id": 1}}));
    let before = s.get("/v1/workers").body().clone();
    let bookings = metric(&s.metrics(), "kvroute_active_bookings");
    assert_eq!(bookings, Some(1.0));

    let d = s.route_ok(&json!({"request_id": "ask", "tokens": p, "book": false, "explain": true}));
    assert_eq!(d["request_id"], "ask");
    assert_eq!(
        (d["worker_id"].as_u64(), d["dp_rank"].as_u64()),
        (Some(2), Some(1))
    );
    let cands = d["candidates"]
        .as_array()
        .expect("explain returns candidates");
    assert_eq!(cands.len(), 3, "one row per eligible rank: {d}");
    for c in cands {
        for k in [
            "worker_id",
            "dp_rank",
            "overlap_blocks",
            "active_prefill_tokens",
            "active_decode_blocks",
            "taints",
            "cost",
        ] {
            assert!(c.get(k).is_some(), "candidate lacks {k}: {c}");
        }
        assert!(c["cost"].as_f64().unwrap().is_finite());
    }
    let chosen = cands
        .iter()
        .find(|c| c["worker_id"] == 2 && c["dp_rank"] == 1)
        .unwrap();
    assert_eq!(chosen["overlap_blocks"], 2);
    assert_eq!(chosen["taints"], json!(["zone=b"]));
    // The row of the decision is marked, and the answer says how the embedded default decided.
    assert_eq!(chosen["chosen"], true, "{d}");
    assert_eq!(
        cands.iter().filter(|c| c["chosen"] == true).count(),
        1,
        "{d}"
    );
    assert_eq!(d["answer"], "costs", "{d}");
    let min = cands
        .iter()
        .map(|c| c["cost"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    assert_eq!(
        chosen["cost"].as_f64().unwrap(),
        min,
        "temperature 0 picks the lowest cost"
    );

    // Ask-only changed nothing; its id was never booked.
    assert_eq!(s.get("/v1/workers").body(), &before);
    assert_eq!(metric(&s.metrics(), "kvroute_active_bookings"), bookings);
    s.delete("/v1/requests/ask")
        .expect_error(404, "unknown_request");
    // An ask-only request may reuse a booked id: it books nothing.
    s.route_ok(&json!({"request_id": "base", "tokens": p, "book": false}));
    // With explain off there are no candidates.
    let d = s.route_ok(&json!({"tokens": p, "book": false, "explain": false}));
    assert!(d.get("candidates").is_none());
    assert!(d.get("answer").is_none());
    assert!(d.get("excluded").is_none());

    // Explain also names the candidates a hard rule kept out, each with the rule.
    let d = s.route_ok(&json!({"tokens": p, "book": false, "explain": true}));
    assert_eq!(d["excluded"], json!([]), "nothing excluded: {d}");
    let d = s.route_ok(&json!({"tokens": p, "book": false, "explain": true,
        "routing_constraints": {"required_taints": ["zone=b"]}}));
    assert_eq!(
        d["excluded"],
        json!([{"worker_id": 1, "dp_rank": 0, "reason": "missing_required_taints",
                "missing_taints": ["zone=b"], "overlap_blocks": 0, "active_prefill_tokens": 50}]),
        "{d}"
    );
    assert_eq!(d["candidates"].as_array().unwrap().len(), 2, "{d}");
    s.patch("/v1/workers/2", &json!({"draining": true}))
        .expect(200);
    let d = s.route_ok(&json!({"tokens": p, "book": false, "explain": true,
        "allowed_worker_ids": [1, 2]}));
    assert_eq!(d["worker_id"], 1, "{d}");
    assert_eq!(
        d["excluded"],
        json!([{"worker_id": 2, "dp_rank": 0, "reason": "draining",
                "overlap_blocks": 0, "active_prefill_tokens": 0},
               {"worker_id": 2, "dp_rank": 1, "reason": "draining",
                "overlap_blocks": 2, "active_prefill_tokens": 0}]),
        "{d}"
    );
    let d = s.route_ok(&json!({"tokens": p, "book": false, "explain": true,
        "allowed_worker_ids": [1]}));
    let reasons: Vec<(u64, &str)> = d["excluded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["worker_id"].as_u64().unwrap(),
                e["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(reasons, [(2, "not_allowed"), (2, "not_allowed")], "{d}");
}

#[test]
fn request_lifecycle_and_duplicates() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({}));
    let p = tokens(100, 51);
    let d = s.route_ok(&json!({"request_id": "life-1", "tokens": p}));
    assert_eq!(d["worker_id"], 1);
    let r0 = rank(&s.workers()[&1], 0).clone();
    assert_eq!(r0["active_requests"], 1);
    assert_eq!(r0["active_prefill_tokens"], 100);

    // The same id again while booked.
    let r = s.post("/v1/route", &json!({"request_id": "life-1", "tokens": p}));
    r.expect_error(409, "duplicate_request_id");
    assert_eq!(r.field(), Some("request_id"));

    let r = s.post("/v1/requests/life-1/prefill_complete", &json!({}));
    r.expect(200);
    assert_eq!(r.body()["request_id"], "life-1");
    assert!(r.body()["status"].is_string());
    assert_eq!(rank(&s.workers()[&1], 0)["active_prefill_tokens"], 0);
    let before_decode = rank(&s.workers()[&1], 0)["active_decode_blocks"]
        .as_u64()
        .unwrap();
    let r = s.post("/v1/requests/life-1/output", &json!({"tokens": 64}));
    r.expect(200);
    assert_eq!(r.body()["request_id"], "life-1");
    let after_decode = rank(&s.workers()[&1], 0)["active_decode_blocks"]
        .as_u64()
        .unwrap();
    assert!(
        after_decode >= before_decode,
        "{before_decode} -> {after_decode}"
    );

    let r = s.delete("/v1/requests/life-1");
    r.expect(200);
    assert_eq!(r.body()["request_id"], "life-1");
    let r0 = rank(&s.workers()[&1], 0).clone();
    assert_eq!(r0["active_requests"], 0, "{r0}");
    assert_eq!(r0["active_prefill_tokens"], 0, "{r0}");
    assert_eq!(r0["active_decode_blocks"], 0, "{r0}");

    // Done: every lifecycle call is a 404 now.
    s.post("/v1/requests/life-1/prefill_complete", &json!({}))
        .expect_error(404, "unknown_request");
    s.post("/v1/requests/life-1/output", &json!({"tokens": 1}))
        .expect_error(404, "unknown_request");
    s.delete("/v1/requests/life-1")
        .expect_error(404, "unknown_request");
    // Prefill-complete needs no body at all.
    let d = s.route_ok(&json!({"request_id": "life-1", "tokens": p}));
    assert_eq!(d["request_id"], "life-1");
    s.raw("POST", "/v1/requests/life-1/prefill_complete", &[], b"")
        .expect(200);
    // A generated id works the same way.
    let d = s.route_ok(&json!({"tokens": p}));
    let id = d["request_id"].as_str().unwrap().to_string();
    assert!(!id.is_empty());
    s.delete(&format!("/v1/requests/{id}")).expect(200);
    s.delete("/v1/requests/life-1").expect(200);
    assert_eq!(metric(&s.metrics(), "kvroute_active_bookings"), Some(0.0));
}

// --------------------------------------------------------------------------------------- queue

#[test]
fn busy_threshold_queue_waits_then_429_when_full() {
    let cfg = temp_file(
        "queue.toml",
        "[routing]\nqueue_max_requests_per_worker = 1\nqueue_timeout_ms = 20000\n",
    );
    let s = Server::start(&["--config", cfg.to_str().unwrap(), "--busy-threshold", "0.5"]);
    s.put_worker(1, &json!({"max_num_batched_tokens": 100}));
    // 64 uncached prompt tokens > 0.5 × 100: the only worker is busy after this one.
    let hog = s.route_ok(&json!({"request_id": "hog", "tokens": tokens(64, 61)}));
    assert_eq!(hog["queued_ms"], 0);

    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let agent = support::client();
            let body =
                serde_json::to_vec(&json!({"request_id": "waiter", "tokens": tokens(32, 62)}))
                    .unwrap();
            let started = Instant::now();
            let r = support::send(
                &agent,
                &s.url("/v1/route"),
                "POST",
                &[("content-type", "application/json")],
                &body,
            )
            .expect("waiter transport");
            (r, started.elapsed())
        });
        eventually("the waiter to queue", Duration::from_secs(10), || {
            metric(&s.metrics(), "kvroute_queue_depth") == Some(1.0)
        });
        assert!(
            !waiter.is_finished(),
            "the waiter must wait while the worker is busy"
        );

        // The queue holds one request per worker: the next one is refused at once, retryably.
        let r = s.post(
            "/v1/route",
            &json!({"request_id": "third", "tokens": tokens(32, 63)}),
        );
        assert_eq!(r.status, 429, "queue full: {r}");
        assert_error_shape(&r);
        assert!(
            r.header("retry-after").is_some(),
            "429 needs Retry-After: {r:?}"
        );
        // Ask-only and pinned requests do not wait: they are refused as overloaded, retryably.
        let r = s.post(
            "/v1/route",
            &json!({"tokens": tokens(32, 64), "book": false, "pinned_worker": {"worker_id": 1}}),
        );
        r.expect_error(429, "pinned_worker_overloaded");
        assert!(r.header("retry-after").is_some(), "{r:?}");
        let r = s.post(
            "/v1/route",
            &json!({"tokens": tokens(32, 64), "book": false}),
        );
        assert!(r.status == 429 || r.status == 503, "all overloaded: {r}");
        assert_eq!(r.code(), Some("all_overloaded"));
        assert!(r.header("retry-after").is_some(), "{r:?}");
        // Progress on a queued request is a conflict (it has no worker yet), not "unknown".
        s.post("/v1/requests/waiter/prefill_complete", &json!({}))
            .expect_error(409, "request_queued");
        s.post("/v1/requests/waiter/output", &json!({"tokens": 3}))
            .expect_error(409, "request_queued");
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiter.is_finished());

        // The hog's prefill completes: the waiter is served.
        s.post("/v1/requests/hog/prefill_complete", &json!({}))
            .expect(200);
        let (r, waited) = waiter.join().expect("waiter thread");
        r.expect(200);
        assert_eq!(r.body()["request_id"], "waiter");
        assert_eq!(r.body()["worker_id"], 1);
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(
            r.body()["queued_ms"].as_u64().unwrap() >= 150,
            "queued_ms reports the wait: {r}"
        );
    });
    assert_eq!(metric(&s.metrics(), "kvroute_queue_depth"), Some(0.0));
    assert_eq!(metric(&s.metrics(), "kvroute_active_bookings"), Some(2.0));
}

#[test]
fn request_details_clients_rely_on() {
    let s = Server::start(&[]);
    // A body may repeat the path's worker id.
    s.put(
        "/v1/workers/7",
        &json!({"worker_id": 7, "dp_start": 3, "dp_size": 2}),
    )
    .expect(200);
    // Media types compare case-insensitively, parameters aside.
    let r = s.raw(
        "PUT",
        "/v1/workers/8",
        &[("content-type", "Application/JSON; charset=UTF-8")],
        b"{}",
    );
    r.expect(200);
    // An event without dp_rank is for the worker's first rank (dp_start), not rank 0.
    let t = tokens(32, 91);
    let local = local_hashes(&t, 16, BASE_SEED);
    let mut ev = stored_event(7, 0, 1, &local);
    ev["event"].as_object_mut().unwrap().remove("dp_rank");
    let r = post_events(&s, &json!([ev]));
    assert_eq!(r["applied"], 1, "{r}");
    let (_, by_rank) = overlap(&s, &json!({"tokens": t}));
    assert_eq!(by_rank.get(&(7, 3)).map(|b| b[0]), Some(2), "{by_rank:?}");
    // A weight just inside (-1, 1) stays inside once rounded to the f32 it travels as.
    let d = s.route_ok(&json!({"tokens": t, "book": false,
        "routing_constraints": {"preferred_taints": {"fast": 0.99999999, "slow": -0.99999999}}}));
    assert_eq!(d["worker_id"], 7, "{d}");
    // Every worker draining: the message says so, with counts, whatever else filtered.
    for id in [7, 8] {
        s.patch(&format!("/v1/workers/{id}"), &json!({"draining": true}))
            .expect(200);
    }
    let r = s.post(
        "/v1/route",
        &json!({"tokens": t, "allowed_worker_ids": [7]}),
    );
    r.expect_error(503, "all_filtered_by_constraints");
    let msg = r.body()["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("2 draining") && msg.contains("1 not in allowed_worker_ids"),
        "{r}"
    );
}

#[test]
fn a_dual_stack_listener_treats_ipv4_loopback_as_loopback() {
    if std::net::TcpListener::bind("[::]:0").is_err() {
        eprintln!("skipped: no IPv6 on this machine");
        return;
    }
    // With bindv6only, [::] takes no IPv4 clients at all: nothing to test.
    if std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "1") {
        eprintln!("skipped: net.ipv6.bindv6only = 1");
        return;
    }
    let s = Server::start(&["--listen", "[::]:0"]);
    let port = s
        .url("/")
        .rsplit_once(':')
        .unwrap()
        .1
        .trim_end_matches('/')
        .to_string();
    // Without a token, admin endpoints answer loopback clients: 127.0.0.1 arrives here as
    // ::ffff:127.0.0.1 and must count as loopback.
    let r = support::send(
        &support::client(),
        &format!("http://127.0.0.1:{port}/v1/events"),
        "POST",
        &[("content-type", "application/json")],
        b"[]",
    )
    .expect("transport");
    r.expect(200);
}

#[test]
fn a_queue_timeout_is_429_and_counts_its_wait() {
    let cfg = temp_file("qt.toml", "[routing]\nqueue_timeout_ms = 300\n");
    let s = Server::start(&["--config", cfg.to_str().unwrap(), "--busy-threshold", "0.5"]);
    s.put_worker(1, &json!({"max_num_batched_tokens": 100}));
    s.route_ok(&json!({"request_id": "hog", "tokens": tokens(64, 61)}));
    let r = s.post("/v1/route", &json!({"tokens": tokens(32, 62)}));
    r.expect_error(429, "queue_timeout");
    assert!(r.header("retry-after").is_some(), "{r:?}");
    let text = s.metrics();
    assert_eq!(
        metric(&text, "kvroute_queue_wait_seconds_count"),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "kvroute_queue_wait_seconds_sum").is_some_and(|w| w >= 0.3),
        "{text}"
    );
}

// ---------------------------------------------------------------------------------- operations

#[test]
fn health_ready_and_metrics() {
    let s = Server::start(&[]);
    let h = s.get("/healthz");
    h.expect(200);
    let ready = s.get("/readyz");
    let policies = s.get("/v1/policies");
    policies.expect(200);
    let active = &policies.body()["active"];
    if active.is_null() {
        ready.expect_error(503, "no_policy");
    } else {
        ready.expect(200);
    }

    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({"dp_size": 2}));
    let p = tokens(64, 71);
    post_events(
        &s,
        &json!([stored_event(1, 0, 1, &local_hashes(&p, 16, BASE_SEED))]),
    );
    for i in 0..3 {
        s.route_ok(&json!({"request_id": format!("m-{i}"), "tokens": p}));
    }
    s.route_ok(&json!({"tokens": p, "book": false}));
    s.post(
        "/v1/route",
        &json!({"tokens": p, "pinned_worker": {"worker_id": 9}}),
    )
    .expect(404);

    let r = s.get("/metrics");
    r.expect(200);
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("text/plain"),
        "{:?}",
        r.headers
    );
    let m = &r.text;
    for phase in ["hash", "match", "policy", "total"] {
        let count = metric(
            m,
            &format!("kvroute_route_duration_seconds_count{{phase=\"{phase}\"}}"),
        );
        assert_eq!(count, Some(4.0), "phase {phase}:\n{m}");
        assert!(m.contains(&format!(
            "kvroute_route_duration_seconds_bucket{{phase=\"{phase}\",le="
        )));
    }
    let decisions: f64 = m
        .lines()
        .filter(|l| l.starts_with("kvroute_decisions_total{"))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert_eq!(decisions, 4.0, "{m}");
    assert!(m.contains("kvroute_decisions_total{"), "{m}");
    assert!(m.contains("worker_id=\"1\""), "{m}");
    assert_eq!(
        metric(m, "kvroute_index_blocks{tier=\"device\"}"),
        Some(4.0)
    );
    assert_eq!(metric(m, "kvroute_queue_depth"), Some(0.0));
    assert_eq!(metric(m, "kvroute_active_bookings"), Some(3.0));
    for name in [
        "kvroute_index_blocks",
        "kvroute_queue_depth",
        "kvroute_active_bookings",
    ] {
        assert!(m.contains(&format!("# TYPE {name} gauge")), "{name}");
    }
}

#[test]
fn admin_token_guards_writes_only() {
    const TOKEN: &str = "s3cret-admin-token";
    let s = Server::start(&["--admin-token", TOKEN]);
    let wasm = b"\0asm\x01\0\0\0".to_vec();
    // (method, path, body, content type)
    let writes: Vec<(&str, &str, Vec<u8>, &str)> = vec![
        (
            "PUT",
            "/v1/workers/1",
            br#"{"dp_size": 1}"#.to_vec(),
            "application/json",
        ),
        (
            "PATCH",
            "/v1/workers/1",
            br#"{"draining": false}"#.to_vec(),
            "application/json",
        ),
        ("POST", "/v1/events", b"[]".to_vec(), "application/json"),
        ("PUT", "/v1/policies/p", wasm.clone(), "application/wasm"),
        (
            "PUT",
            "/v1/policies/p/config",
            b"{}".to_vec(),
            "application/json",
        ),
        (
            "POST",
            "/v1/policies/p/activate",
            Vec::new(),
            "application/json",
        ),
        (
            "POST",
            "/v1/policies/rollback",
            Vec::new(),
            "application/json",
        ),
        ("DELETE", "/v1/policies/p", Vec::new(), "application/json"),
        ("DELETE", "/v1/workers/1", Vec::new(), "application/json"),
    ];
    for (method, path, body, ct) in &writes {
        // No bearer credential (no header, another scheme, no token): 401 with the challenge.
        for missing in [
            None,
            Some(format!("Basic {TOKEN}")),
            Some("Bearer".into()),
            Some("Bearer   ".into()),
            Some(TOKEN.into()),
        ] {
            let mut headers = vec![("content-type", *ct)];
            if let Some(m) = &missing {
                headers.push(("authorization", m));
            }
            let r = s.raw(method, path, &headers, body);
            r.expect_error(401, "unauthorized");
            assert!(
                r.header("www-authenticate")
                    .is_some_and(|h| h.starts_with("Bearer")),
                "{method} {path} with {missing:?}: {r}"
            );
        }
        // A bearer token that is not the configured one: 403.
        for bad in [
            "Bearer wrong-token-123".to_string(),
            format!("Bearer {TOKEN}x"),
            format!("Bearer {}", &TOKEN[1..]),
        ] {
            let r = s.raw(
                method,
                path,
                &[("content-type", ct), ("authorization", &bad)],
                body,
            );
            assert_eq!(r.status, 403, "{method} {path} with {bad:?}: {r}");
            assert_error_shape(&r);
        }
    }
    assert!(s.workers().is_empty(), "refused writes changed nothing");

    let auth = format!("Bearer {TOKEN}");
    for (method, path, body, ct) in &writes {
        let r = s.raw(
            method,
            path,
            &[("content-type", ct), ("authorization", &auth)],
            body,
        );
        let expected: &[u16] = match (*method, *path) {
            ("PUT", "/v1/workers/1") | ("PATCH", "/v1/workers/1") | ("POST", "/v1/events") => {
                &[200]
            }
            ("DELETE", "/v1/workers/1") => &[204],
            // No real component here: the domain answer proves the token was accepted.
            ("PUT", "/v1/policies/p") => &[400],
            ("POST", "/v1/policies/rollback") => &[409],
            _ => &[404],
        };
        assert!(
            expected.contains(&r.status),
            "{method} {path} with the right token: {r}"
        );
    }

    // The scheme is case-insensitive and may be followed by several spaces (RFC 9110 §11.4).
    for (method, auth, status) in [
        ("PUT", format!("bearer  {TOKEN}"), 200),
        ("DELETE", format!("BEARER {TOKEN}"), 204),
    ] {
        let r = s.raw(
            method,
            "/v1/workers/3",
            &[
                ("content-type", "application/json"),
                ("authorization", &auth),
            ],
            b"{}",
        );
        assert_eq!(r.status, status, "{method} with {auth:?}: {r}");
    }

    // Reads, routing and lifecycle need no token.
    s.req("PUT", "/v1/workers/2", Some(&json!({})), Some(TOKEN))
        .expect(200);
    for path in [
        "/v1/workers",
        "/v1/policies",
        "/healthz",
        "/metrics",
        "/openapi.json",
    ] {
        s.get(path).expect(200);
    }
    let d = s.route_ok(&json!({"request_id": "open", "tokens": tokens(40, 81)}));
    assert_eq!(d["worker_id"], 2);
    let r = s.post("/v1/overlap", &json!({"tokens": tokens(40, 81)}));
    r.expect(200);
    s.post("/v1/requests/open/prefill_complete", &json!({}))
        .expect(200);
    s.delete("/v1/requests/open").expect(200);
    let r = s.get("/readyz");
    assert!(r.status == 200 || r.status == 503, "{r}");
}

// -------------------------------------------------------------------------------------- config

fn served_block_size(s: &Server) -> u64 {
    let r = s.post("/v1/overlap", &json!({"tokens": tokens(128, 91)}));
    r.expect(200);
    let bs = r.body()["block_size"].as_u64().unwrap();
    assert_eq!(r.body()["num_blocks"].as_u64().unwrap(), 128 / bs);
    bs
}

#[test]
fn workers_in_the_config_file_are_registered_at_start() {
    let cfg = temp_file(
        "workers.toml",
        "[workers.4]\ndp_size = 2\ntaints = [\"zone=a\"]\n\n[workers.9]\n",
    );
    let s = Server::start(&["--config", cfg.to_str().unwrap()]);
    let workers = s.workers();
    assert_eq!(workers.len(), 2, "{workers:?}");
    assert_eq!(workers[&4]["dp_size"], 2);
    assert_eq!(workers[&4]["taints"], json!(["zone=a"]));
    assert_eq!(workers[&9]["dp_size"], 1);
    // They route like any other, and the API can change them.
    let d = s.route_ok(&json!({"tokens": tokens(32, 5),
        "routing_constraints": {"required_taints": ["zone=a"]}}));
    assert_eq!(d["worker_id"], 4, "{d}");
    s.delete("/v1/workers/9").expect(204);
}

/// A worker whose ranks' endpoints overlap (the README's example once did: `dp_size = 2`, endpoint
/// :5557, replay :5558, so rank 0 replayed from rank 1's publisher), or that uses another worker's
/// endpoint, is refused with the field and both owners named.
#[test]
fn overlapping_kv_event_endpoints_are_refused() {
    let s = Server::start(&[]);
    let r = s.put(
        "/v1/workers/1",
        &json!({"dp_size": 2, "kv_events": {"endpoint": "tcp://127.0.0.1:45557",
                "replay_endpoint": "tcp://127.0.0.1:45558"}}),
    );
    r.expect(400);
    assert_eq!(r.field(), Some("kv_events.replay_endpoint"), "{r}");
    let msg = r.body()["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("rank 0's replay endpoint tcp://127.0.0.1:45558 is rank 1's publisher"),
        "{r}"
    );
    assert!(s.workers().is_empty());
    s.put_worker(
        1,
        &json!({"dp_size": 2, "kv_events": {"endpoint": "tcp://127.0.0.1:45557",
                "replay_endpoint": "tcp://127.0.0.1:45559"}}),
    );
    let r = s.put(
        "/v1/workers/2",
        &json!({"kv_events": {"endpoint": "tcp://127.0.0.1:45558"}}),
    );
    r.expect(400);
    assert_eq!(r.field(), Some("kv_events.endpoint"), "{r}");
    let msg = r.body()["error"]["message"].as_str().unwrap();
    assert!(msg.contains("worker 1's rank 1 publisher endpoint"), "{r}");

    // The same at start from the configuration file: a row of
    // config_errors_exit_nonzero_with_a_clear_message.
}

/// The address is printed first on stderr as well as on stdout (where scripts read it), and the
/// settings line reads like the config file, not like Rust debug output; `serve --help` says so.
#[test]
fn start_up_lines_read_like_the_config() {
    let s = Server::start(&[]);
    eventually("the settings line", Duration::from_secs(10), || {
        s.stderr().contains("queue_order=")
    });
    let err = s.stderr();
    // On stderr as a plain line, before the start-up log record that repeats it.
    let plain = err
        .find(&format!("kvroute listening on {}\n", s.base))
        .unwrap_or_else(|| panic!("no address line on stderr: {err}"));
    let record = err.find("queue_order=").unwrap();
    assert!(plain < record, "{err}");
    assert!(
        err.contains("busy_threshold=off queue_order=fcfs approximate=false"),
        "{err}"
    );
    assert!(!err.contains("Fcfs") && !err.contains("None"), "{err}");
    let help = support::command(&["serve", "--help"], &[])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("is printed on stdout") && help.contains("also printed on stderr"),
        "{help}"
    );
}

/// `POST /v1/hash` gives the SPEC §2 vectors (block size 4), as u64 JSON integers.
#[test]
fn hash_endpoint_matches_the_spec_vectors() {
    let s = Server::start(&["--block-size", "4"]);
    let r = s.post(
        "/v1/hash",
        &json!({"tokens": (1..=14).collect::<Vec<u32>>()}),
    );
    r.expect(200);
    let b = r.body();
    assert_eq!(b["block_size"], 4);
    assert_eq!(b["seed"], 1337);
    assert_eq!(b["num_blocks"], 3, "the 2-token tail is not hashed: {b}");
    assert_eq!(
        b["local_hashes"],
        json!([
            14643705804678351452u64,
            16777012769546811212u64,
            483935686894639516u64
        ])
    );
    assert_eq!(
        b["sequence_hashes"],
        json!([
            14643705804678351452u64,
            4945711292740353085u64,
            12583592247330656132u64
        ])
    );
    // The exact digits are on the wire (no float rounding of values above 2^53).
    assert!(r.text.contains("16777012769546811212"), "{r}");
    let lora = s.post(
        "/v1/hash",
        &json!({"tokens": [1, 2, 3, 4], "lora_name": "my-lora"}),
    );
    assert_eq!(lora.body()["seed"], 12827409268353072861u64);
    assert_eq!(
        lora.body()["local_hashes"],
        json!([15671544057904749233u64])
    );
    let salt = s.post(
        "/v1/hash",
        &json!({"tokens": [1, 2, 3, 4], "cache_salt": "tenant-a"}),
    );
    assert_eq!(salt.body()["seed"], 1948188790972764086u64);
    assert_eq!(salt.body()["local_hashes"], json!([5738685477468498325u64]));
    let empty = s.post(
        "/v1/hash",
        &json!({"tokens": [1, 2, 3, 4], "lora_name": "", "cache_salt": ""}),
    );
    assert_eq!(empty.body()["seed"], 1337);
    assert_eq!(
        empty.body()["local_hashes"],
        json!([14643705804678351452u64])
    );
    let short = s.post("/v1/hash", &json!({"tokens": [1, 2, 3]}));
    assert_eq!(short.body()["local_hashes"], json!([]), "{short}");
    // Bad input names the field.
    let r = s.post("/v1/hash", &json!({"tokens": []}));
    r.expect_error(400, "invalid_request");
    assert_eq!(r.field(), Some("tokens"), "{r}");
    let r = s.post("/v1/hash", &json!({"lora_name": "x"}));
    r.expect(400);
    assert!(r.to_string().contains("tokens"), "{r}");
    let r = s.post("/v1/hash", &json!({"tokens": [1], "block_size": 4}));
    r.expect(400);
    assert!(r.to_string().contains("block_size"), "{r}");
}

#[test]
fn config_precedence_file_then_env_then_flag() {
    let cfg = temp_file("bs.toml", "block_size = 32\n");
    let cfg = cfg.to_str().unwrap();
    assert_eq!(served_block_size(&Server::start(&[])), 16, "the default");
    assert_eq!(served_block_size(&Server::start(&["--config", cfg])), 32);
    assert_eq!(
        served_block_size(&Server::start_env(
            &["--config", cfg],
            &[("KVROUTE_BLOCK_SIZE", "64")]
        )),
        64,
        "the environment overrides the file"
    );
    assert_eq!(
        served_block_size(&Server::start_env(
            &["--config", cfg, "--block-size", "16"],
            &[("KVROUTE_BLOCK_SIZE", "64")]
        )),
        16,
        "a flag overrides the environment"
    );
    assert_eq!(
        served_block_size(&Server::start_env(&[], &[("KVROUTE_CONFIG", cfg)])),
        32,
        "KVROUTE_CONFIG names the file"
    );
}

#[test]
fn config_errors_exit_nonzero_with_a_clear_message() {
    let unknown = temp_file("unknown.toml", "block_size = 16\nbogus_key = 1\n");
    let nested = temp_file("nested.toml", "[limits]\nmax_prompt_tokenz = 5\n");
    let bad_type = temp_file("type.toml", "block_size = \"big\"\n");
    let zero = temp_file("zero.toml", "block_size = 0\n");
    let worker_key = temp_file("wkey.toml", "[workers.x]\ndp_size = 1\n");
    let worker_spec = temp_file("wspec.toml", "[workers.3]\ndp_size = 0\n");
    let worker_field = temp_file("wfield.toml", "[workers.3]\ndp_sise = 2\n");
    let overlap = temp_file(
        "overlap.toml",
        "[workers.1]\ndp_size = 2\nkv_events = { endpoint = \"tcp://127.0.0.1:45557\", \
         replay_endpoint = \"tcp://127.0.0.1:45558\" }\n",
    );
    // The name check comes before the file is read: any bytes do.
    let bad_name = temp_file("My Policy.wasm", "not wasm");
    let rollback = temp_file("rollback.wasm", "not wasm");
    let no_port = temp_file("no_port.toml", "listen = \"localhost\"\n");
    let p = |f: &std::path::PathBuf| f.to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, EnvVars, &[&str])> = vec![
        (vec!["--config".into(), p(&unknown)], vec![], &["bogus_key"]),
        (
            vec!["--config".into(), p(&nested)],
            vec![],
            &["max_prompt_tokenz"],
        ),
        (
            vec!["--config".into(), p(&bad_type)],
            vec![],
            &["block_size"],
        ),
        (vec!["--config".into(), p(&zero)], vec![], &["block_size"]),
        (
            vec!["--config".into(), p(&worker_key)],
            vec![],
            &["workers.x", "id"],
        ),
        (
            vec!["--config".into(), p(&worker_spec)],
            vec![],
            &["workers.3.dp_size"],
        ),
        (
            vec!["--config".into(), p(&worker_field)],
            vec![],
            &["dp_sise"],
        ),
        (
            vec!["--config".into(), p(&overlap)],
            vec![],
            &[
                "workers.1.kv_events.replay_endpoint",
                "rank 0's replay endpoint tcp://127.0.0.1:45558 is rank 1's publisher endpoint",
            ],
        ),
        (
            vec!["--config".into(), "/nonexistent/kvroute.toml".into()],
            vec![],
            &["/nonexistent/kvroute.toml"],
        ),
        (
            vec!["--block-size".into(), "abc".into()],
            vec![],
            &["--block-size"],
        ),
        (
            vec!["--block-size".into(), "0".into()],
            vec![],
            &["block_size"],
        ),
        (vec!["--block-size".into(), "-4".into()], vec![], &["-4"]),
        (
            vec!["--busy-threshold=-0.5".into()],
            vec![],
            &["busy_threshold"],
        ),
        (
            vec!["--busy-threshold".into(), "NaN".into()],
            vec![],
            &["busy_threshold"],
        ),
        (
            vec!["--listen".into(), "not-an-address".into()],
            vec![],
            &["--listen", "not-an-address", "HOST:PORT"],
        ),
        (
            vec!["--admin-token".into(), "short".into()],
            vec![],
            &["admin_token"],
        ),
        (
            vec!["--policy-config".into(), "{nope".into()],
            vec![],
            &["policy_config"],
        ),
        (
            vec!["--log-format".into(), "yaml".into()],
            vec![],
            &["--log-format"],
        ),
        (
            vec!["--approximate".into(), "maybe".into()],
            vec![],
            &["--approximate"],
        ),
        (
            vec!["--policy".into(), "/nonexistent/policy.wasm".into()],
            vec![],
            &["/nonexistent/policy.wasm"],
        ),
        (
            vec!["--http-threads".into(), "5000".into()],
            vec![],
            &["http_threads", "5000"],
        ),
        (vec![], vec![("KVROUTE_HTTP_THREADS", "-2")], &["-2"]),
        (vec!["--no-such-flag".into()], vec![], &["--no-such-flag"]),
        (
            vec![],
            vec![("KVROUTE_BLOCK_SIZE", "zero")],
            &["zero", "environment variable KVROUTE_BLOCK_SIZE"],
        ),
        // A negative number is a value to judge, not an unknown flag.
        (
            vec!["--busy-threshold".into(), "-1".into()],
            vec![],
            &["busy_threshold", "-1"],
        ),
        (
            vec!["--config".into(), p(&no_port)],
            vec![],
            &["listen", "HOST:PORT"],
        ),
        (
            vec!["--policy".into(), p(&bad_name)],
            vec![],
            &["My Policy", "--policy-name"],
        ),
        (
            vec!["--policy-name".into(), "mine".into()],
            vec![],
            &["policy_name"],
        ),
        (
            vec![
                "--policy".into(),
                p(&rollback),
                "--policy-name".into(),
                "rollback".into(),
            ],
            vec![],
            &["policy_name", "rollback"],
        ),
    ];
    for (args, env, needles) in cases {
        let mut all = vec!["serve"];
        if !args.iter().any(|a| a == "--listen") {
            all.extend(["--listen", "127.0.0.1:0"]);
        }
        all.extend(args.iter().map(String::as_str));
        let (status, stdout, stderr) = run_to_exit(&all, &env, Duration::from_secs(30));
        assert!(
            !stderr.contains("cannot be used multiple times"),
            "{args:?}: the case must test its value, not a repeated flag: {stderr}"
        );
        assert!(
            !status.success(),
            "{args:?} {env:?} must fail; stdout {stdout:?}, stderr {stderr:?}"
        );
        assert!(
            !stdout.contains("listening"),
            "{args:?} {env:?} must not listen: {stdout}"
        );
        for n in needles {
            assert!(
                stderr.contains(n),
                "{args:?} {env:?}: stderr should name {n:?}: {stderr}"
            );
        }
        assert!(stderr.len() < 4000, "a short message, not a dump: {stderr}");
    }
}

#[test]
fn serve_takes_a_host_name_a_bare_approximate_flag_and_a_policy_name() {
    let wasm = temp_file("file name with spaces.wasm", "");
    std::fs::write(&wasm, kvroute_server::serve::DEFAULT_POLICY_WASM).unwrap();
    let mut s = Server::start(&[
        "--listen",
        "localhost:0",
        "--approximate",
        "--policy",
        wasm.to_str().unwrap(),
        "--policy-name",
        "mine",
    ]);
    let active = s.get("/v1/policies").expect(200).body().clone();
    assert_eq!(active["active"], "mine", "{active}");
    // `--approximate` alone turned approximate indexing on: with no KV events at all, a routed
    // (booked) prompt is indexed on the worker it went to.
    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({}));
    let tokens: Vec<u32> = (0..64).collect();
    let d = s.route_ok(&json!({"tokens": tokens}));
    let again = s
        .post("/v1/overlap", &json!({"tokens": tokens}))
        .expect(200)
        .body()
        .clone();
    let chosen = d["worker_id"].as_u64().unwrap();
    let scores = again.to_string();
    assert!(
        again["workers"].as_array().is_some_and(|w| w
            .iter()
            .any(|x| x["worker_id"] == chosen && x["device_blocks"] == 4)),
        "worker {chosen} holds the routed prompt's 4 blocks: {scores}"
    );
    assert!(s.terminate(Duration::from_secs(10)).success());
}

// ------------------------------------------------------------------------------ serving threads

#[test]
fn serves_concurrent_connections_with_any_number_of_http_threads() {
    for threads in ["1", "3"] {
        let s = Server::start(&["--http-threads", threads]);
        s.put_worker(1, &json!({}));
        s.put_worker(2, &json!({}));
        let url = s.url("/v1/route");
        let clients: Vec<_> = (0..6u32)
            .map(|c| {
                let url = url.clone();
                std::thread::spawn(move || {
                    // Each thread its own client: its own connection, dealt to a serving thread.
                    let agent = support::client();
                    (0..20u32)
                        .map(|i| {
                            let body = serde_json::to_vec(
                                &json!({"tokens": tokens(48, 1000 + c * 100 + i), "book": false}),
                            )
                            .unwrap();
                            support::send(
                                &agent,
                                &url,
                                "POST",
                                &[("content-type", "application/json")],
                                &body,
                            )
                            .map(|r| r.status)
                            .unwrap_or(0)
                        })
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        for c in clients {
            let statuses = c.join().unwrap();
            assert!(
                statuses.iter().all(|&st| st == 200),
                "--http-threads {threads}: {statuses:?}"
            );
        }
    }
}

#[test]
fn serving_threads_that_cannot_start_fail_the_start_with_a_clear_message() {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    let mut cmd = support::command(
        &["serve", "--listen", "127.0.0.1:0", "--http-threads", "64"],
        &[],
    );
    // 64 file descriptors: enough to start, not for 64 serving runtimes.
    // SAFETY: setrlimit is async-signal-safe and touches only the child being started.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 64,
                rlim_max: 64,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("kvroute kept running without the descriptors for its serving threads");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(!status.success(), "stdout {stdout:?}, stderr {stderr:?}");
    assert!(
        !stdout.contains("listening"),
        "said it was listening before its threads were up: {stdout}"
    );
    assert!(
        stderr.contains("serving thread") && stderr.contains("open files"),
        "the error names the serving thread and the cause: {stderr}"
    );
}

// ------------------------------------------------------------------------------------ shutdown

#[test]
fn a_client_stalled_mid_request_does_not_hold_up_shutdown() {
    use std::io::Write;
    let cfg = temp_file("grace.toml", "shutdown_grace_secs = 1\n");
    let mut s = Server::start(&["--config", cfg.to_str().unwrap()]);
    // Half a request header, then nothing: the connection is in flight for ever.
    let mut stalled = std::net::TcpStream::connect(s.addr.as_str()).unwrap();
    stalled
        .write_all(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let status = s.terminate(Duration::from_secs(15));
    assert!(status.success(), "{status:?}\n{}", s.stderr());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "exited after the 1 s grace period, not when the client left: {:?}",
        started.elapsed()
    );
    assert!(s.stderr().contains("grace period"), "{}", s.stderr());
    drop(stalled);
}

#[test]
fn sigterm_lets_a_queued_request_finish_and_exits_zero() {
    let cfg = temp_file("shutdown.toml", "[routing]\nqueue_timeout_ms = 3000\n");
    let mut s = Server::start(&["--config", cfg.to_str().unwrap(), "--busy-threshold", "0.5"]);
    s.put_worker(1, &json!({"max_num_batched_tokens": 100}));
    s.route_ok(&json!({"request_id": "hog", "tokens": tokens(64, 101)}));
    let url = s.url("/v1/route");
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let agent = support::client();
        let body =
            serde_json::to_vec(&json!({"request_id": "slow", "tokens": tokens(32, 102)})).unwrap();
        let r = support::send(
            &agent,
            &url,
            "POST",
            &[("content-type", "application/json")],
            &body,
        );
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    eventually("the slow request to queue", Duration::from_secs(10), || {
        metric(&s.metrics(), "kvroute_queue_depth") == Some(1.0)
    });
    let sent = Instant::now();
    let status = s.terminate(Duration::from_secs(30));
    let r = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the in-flight request got an answer")
        .unwrap_or_else(|e| panic!("the in-flight request failed at transport level: {e}"));
    waiter.join().unwrap();
    eprintln!("the queued request's answer after SIGTERM: {r}");
    if r.status == 200 {
        assert_eq!(r.body()["request_id"], "slow");
    } else {
        assert_error_shape(&r);
        assert!(
            r.status == 503 || r.status == 429,
            "a clean retryable error: {r}"
        );
    }
    assert!(
        status.success(),
        "exit status {status:?} after SIGTERM\n{}",
        s.stderr()
    );
    assert!(sent.elapsed() < Duration::from_secs(30));
    // The listener is gone.
    assert!(std::net::TcpStream::connect(&s.addr).is_err());
}

// ------------------------------------------------------------------------------------- openapi

/// Checks `value` against an OpenAPI schema: `$ref`, `type`, `required`, `properties` (and no
/// property the schema does not declare), `items`, `enum`, `oneOf` (enough for this document).
fn check_schema(doc: &Value, value: &Value, schema: &Value, at: &str, errors: &mut Vec<String>) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("unsupported $ref {r}"));
        let target = doc
            .pointer(&format!("/components/schemas/{name}"))
            .unwrap_or_else(|| panic!("dangling $ref {r}"));
        return check_schema(doc, value, target, at, errors);
    }
    if let Some(branches) = schema.get("oneOf").and_then(Value::as_array) {
        let ok = branches.iter().any(|b| {
            let mut e = Vec::new();
            check_schema(doc, value, b, at, &mut e);
            e.is_empty()
        });
        if !ok {
            errors.push(format!("{at}: matches no oneOf branch: {value}"));
        }
        return;
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let fits = |ty: &str| match ty {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            "number" => value.is_number(),
            "integer" => value.is_u64() || value.is_i64(),
            _ => true,
        };
        if !types.is_empty() && !types.iter().any(|ty| fits(ty)) {
            errors.push(format!("{at}: expected {types:?}, got {value}"));
            return;
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(value) {
            errors.push(format!("{at}: {value} not in {e:?}"));
        }
    }
    if let (Some(obj), Some(req)) = (
        value.as_object(),
        schema.get("required").and_then(Value::as_array),
    ) {
        for k in req.iter().filter_map(Value::as_str) {
            if !obj.contains_key(k) {
                errors.push(format!("{at}: missing required property {k:?}"));
            }
        }
    }
    if let (Some(obj), Some(props)) = (
        value.as_object(),
        schema.get("properties").and_then(Value::as_object),
    ) {
        for (k, s) in props {
            if let Some(v) = obj.get(k) {
                check_schema(doc, v, s, &format!("{at}.{k}"), errors);
            }
        }
        // A served field the document does not declare (and so does not describe) is drift.
        if schema.get("additionalProperties").is_none() {
            for k in obj.keys().filter(|k| !props.contains_key(*k)) {
                errors.push(format!("{at}: property {k:?} is not in the document"));
            }
        }
    }
    if let (Some(arr), Some(items)) = (value.as_array(), schema.get("items")) {
        for (i, v) in arr.iter().enumerate().take(64) {
            check_schema(doc, v, items, &format!("{at}[{i}]"), errors);
        }
    }
}

#[test]
fn openapi_document_matches_served_behaviour() {
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    let s = Server::start(&[]);
    let r = s.get("/openapi.json");
    r.expect(200);
    let doc = r.body().clone();
    assert!(
        doc["openapi"].as_str().unwrap_or("").starts_with("3."),
        "{doc}"
    );
    let paths = doc["paths"].as_object().expect("paths");

    // Setup: a worker and a booked request for the path parameters to point at.
    s.put_worker(7, &json!({}));
    s.route_ok(&json!({"request_id": "oa-1", "tokens": tokens(48, 111),
                       "pinned_worker": {"worker_id": 7}}));
    // A second worker, kept out of the sample route so that its `excluded` rows are checked too.
    s.put_worker(8, &json!({}));
    let p = tokens(48, 112);
    let sample_bodies: BTreeMap<&str, Value> = [
        ("WorkerSpec", json!({"dp_size": 1, "taints": ["zone=a"]})),
        ("WorkerPatch", json!({"taints": ["zone=b"]})),
        (
            "RouteRequest",
            json!({"tokens": p, "book": false, "explain": true, "allowed_worker_ids": [7]}),
        ),
        ("Output", json!({"tokens": 5})),
        ("OverlapRequest", json!({"tokens": p})),
        ("HashRequest", json!({"tokens": p})),
    ]
    .into_iter()
    .collect();

    const METHODS: [&str; 5] = ["put", "patch", "post", "get", "delete"];
    let mut ops: Vec<(usize, String, String)> = Vec::new();
    for (path, item) in paths {
        for (i, m) in METHODS.iter().enumerate() {
            if item.get(*m).is_some() {
                ops.push((i, path.clone(), m.to_string()));
            }
        }
    }
    ops.sort();
    assert!(
        ops.len() >= 20,
        "the document lists every operation: {ops:?}"
    );

    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for (_, path, method) in &ops {
        let op = &paths[path][method.as_str()];
        let concrete = path
            .replace("{worker_id}", "7")
            .replace("{request_id}", "oa-1")
            .replace("{name}", "native")
            .replace("{tenant}", "acme");
        let (ct, body): (&str, Vec<u8>) = match op.pointer("/requestBody/content") {
            None => ("application/json", Vec::new()),
            Some(c) if c.get("application/wasm").is_some() => ("application/wasm", wasm.clone()),
            Some(c) => {
                let schema = &c["application/json"]["schema"];
                let body = match schema.get("$ref").and_then(Value::as_str) {
                    Some(r) => sample_bodies
                        .get(r.trim_start_matches("#/components/schemas/"))
                        .cloned()
                        .unwrap_or_else(|| panic!("no sample body for {r}")),
                    None if schema.get("type") == Some(&json!("array")) => {
                        json!([stored_event(7, 0, 1, &local_hashes(&p, 16, BASE_SEED))])
                    }
                    None => json!({}),
                };
                ("application/json", serde_json::to_vec(&body).unwrap())
            }
        };
        let upper = method.to_ascii_uppercase();
        let headers: Vec<(&str, &str)> = if body.is_empty() {
            vec![]
        } else {
            vec![("content-type", ct)]
        };
        let r = s.raw(&upper, &concrete, &headers, &body);
        seen.push(format!("{upper} {concrete} -> {}", r.status));
        let responses = op["responses"].as_object().expect("responses");
        let Some(documented) = responses.get(&r.status.to_string()) else {
            problems.push(format!(
                "{upper} {path}: status {} is not documented ({:?}): {r}",
                r.status,
                responses.keys().collect::<Vec<_>>()
            ));
            continue;
        };
        if let Some(schema) = documented.pointer("/content/application~1json/schema") {
            match &r.json {
                None => problems.push(format!("{upper} {path}: documented JSON, got {r}")),
                Some(v) => {
                    let mut errs = Vec::new();
                    check_schema(&doc, v, schema, "$", &mut errs);
                    for e in errs {
                        problems.push(format!("{upper} {path} ({}): {e}", r.status));
                    }
                }
            }
        }
        if r.status >= 400 {
            if r.json.is_some() {
                assert_error_shape(&r);
            } else {
                problems.push(format!("{upper} {path}: error without a JSON body: {r}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n\nexchanges:\n{}",
        problems.join("\n"),
        seen.join("\n")
    );

    // The walk exercised the success answers (not just errors).
    let ok: BTreeSet<&str> = seen
        .iter()
        .filter(|l| l.ends_with("-> 200") || l.ends_with("-> 201") || l.ends_with("-> 204"))
        .map(String::as_str)
        .collect();
    for needle in [
        "PUT /v1/workers/7 ",
        "PATCH /v1/workers/7 ",
        "DELETE /v1/workers/7 ",
        "POST /v1/events ",
        "POST /v1/route ",
        "POST /v1/overlap ",
        "POST /v1/requests/oa-1/prefill_complete ",
        "POST /v1/requests/oa-1/output ",
        "DELETE /v1/requests/oa-1 ",
        "PUT /v1/policies/native ",
        "PUT /v1/policies/native/config ",
        "POST /v1/policies/native/activate ",
        "GET /v1/policies ",
        "GET /v1/policies/native ",
        "GET /v1/tenants ",
        "GET /v1/tenants/acme ",
        "GET /healthz ",
        "GET /readyz ",
        "GET /metrics ",
        "GET /openapi.json ",
    ] {
        assert!(
            ok.iter().any(|l| l.starts_with(needle)),
            "{needle} did not succeed:\n{}",
            seen.join("\n")
        );
    }

    // Nothing is served that the document lacks: other methods on documented paths are 405s...
    for (path, item) in paths {
        let concrete = path
            .replace("{worker_id}", "7")
            .replace("{request_id}", "oa-1")
            .replace("{name}", "native");
        for m in METHODS {
            if item.get(m).is_none() {
                let upper = m.to_ascii_uppercase();
                let r = s.raw(
                    &upper,
                    &concrete,
                    &[("content-type", "application/json")],
                    b"{}",
                );
                assert_eq!(r.status, 405, "{upper} {path} is not documented: {r}");
                assert_eq!(r.code(), Some("method_not_allowed"), "{r}");
            }
        }
    }
    // ...and undocumented paths are 404 `not_found`.
    for path in [
        "/",
        "/v1",
        "/v1/worker",
        "/v1/workers/7/ranks",
        "/v1/workers/",
        "/v2/route",
        "/v1/requests",
        "/v1/requests/oa-1/cancel",
        "/v1/policies/native/stats",
        "/v1/policies/a/b/c",
        "/v1/events/replay",
        "/v1/admin",
        "/debug/pprof",
        "/openapi.yaml",
        "/metrics/extra",
    ] {
        for method in ["GET", "POST"] {
            let r = s.raw(method, path, &[("content-type", "application/json")], b"{}");
            r.expect_error(404, "not_found");
        }
    }
}

/// The error answers the server gives to unauthenticated, mistyped and oversized requests are
/// documented too: a client generated from the document must know them.
#[test]
fn openapi_documents_the_error_statuses_served() {
    const TOKEN: &str = "openapi-admin-token";
    let cfg = temp_file(
        "limits.toml",
        "[limits]\nmax_body_bytes = 65536\nmax_policy_bytes = 100000\n",
    );
    let s = Server::start(&["--admin-token", TOKEN, "--config", cfg.to_str().unwrap()]);
    let doc = s.get("/openapi.json").body().clone();
    let auth = format!("Bearer {TOKEN}");
    let mut problems = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        let concrete = path
            .replace("{worker_id}", "7")
            .replace("{request_id}", "oa-1")
            .replace("{name}", "native");
        for method in ["get", "put", "post", "patch", "delete"] {
            let Some(op) = item.get(method) else { continue };
            let upper = method.to_ascii_uppercase();
            let documented: Vec<&String> = op["responses"].as_object().unwrap().keys().collect();
            let body_ct = op
                .pointer("/requestBody/content")
                .and_then(Value::as_object)
                .and_then(|c| c.keys().next().cloned());
            let ct = body_ct.clone().unwrap_or_else(|| "application/json".into());
            let mut tries: Vec<(&str, OwnedHeaders, Vec<u8>)> = Vec::new();
            if op.get("security").is_some() {
                tries.push((
                    "without a token",
                    vec![("content-type", ct.clone())],
                    b"{}".to_vec(),
                ));
                tries.push((
                    "with a wrong token",
                    vec![
                        ("content-type", ct.clone()),
                        ("authorization", "Bearer wrong-token".into()),
                    ],
                    b"{}".to_vec(),
                ));
            }
            if body_ct.is_none() && method != "get" {
                tries.push((
                    "with a body field where none is taken",
                    vec![
                        ("content-type", "application/json".into()),
                        ("authorization", auth.clone()),
                    ],
                    br#"{"bogus": 1}"#.to_vec(),
                ));
            }
            if let Some(ct) = &body_ct {
                let wrong = if ct == "application/json" {
                    "text/plain"
                } else {
                    "application/json"
                };
                tries.push((
                    "with the wrong content type",
                    vec![
                        ("content-type", wrong.into()),
                        ("authorization", auth.clone()),
                    ],
                    b"{}".to_vec(),
                ));
                tries.push((
                    "with an oversized body",
                    vec![
                        ("content-type", ct.clone()),
                        ("authorization", auth.clone()),
                    ],
                    vec![b' '; 200_000],
                ));
            }
            for (what, headers, body) in tries {
                let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                // A server may answer a rejected request (413 on the declared length) and close
                // before the client has written the whole body; the client then sees a broken
                // pipe instead of the answer. That race is TCP's, not the contract's: try again.
                let r = (0..4)
                    .find_map(|_| s.try_raw(&upper, &concrete, &h, &body).ok())
                    .unwrap_or_else(|| s.raw(&upper, &concrete, &h, &body));
                if !documented.iter().any(|d| **d == r.status.to_string()) {
                    problems.push(format!(
                        "{upper} {path} {what}: {} is not documented (documented: {documented:?})",
                        r.status
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ------------------------------------------------------------------------------------ policies

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn policy_upload_takes_its_configuration_in_the_same_step() {
    let s = Server::start(&[]);
    let wasm = kvroute_server::serve::DEFAULT_POLICY_WASM;
    let up = |query: &str| {
        s.raw(
            "PUT",
            &format!("/v1/policies/tuned{query}"),
            &[("content-type", "Application/Wasm")],
            wasm,
        )
    };
    // The component's own refusal, and JSON that is not JSON, load nothing.
    let r = up("?config=%7B%22no_such_key%22%3A1%7D");
    r.expect_error(400, "config_rejected");
    assert!(
        r.body()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no_such_key"),
        "{r}"
    );
    up("?config=%7Bnope").expect_error(400, "invalid_json");
    let listed = s.get("/v1/policies").body().clone();
    assert!(
        !listed.to_string().contains("tuned"),
        "a refused upload is not loaded: {listed}"
    );
    // `{"work_weight": 2}`, URL-encoded, activated in the same request.
    let r = up("?activate=true&config=%7B%22work_weight%22%3A%202%7D");
    r.expect(201);
    assert_eq!(s.get("/v1/policies").body()["active"], "tuned");
    assert!(
        r.body().to_string().contains("work_weight"),
        "the answer shows the configuration: {r}"
    );
}

#[test]
fn an_ask_only_route_changes_nothing_even_in_a_policy_with_memory() {
    let s = Server::start(&[]);
    let wasm = support::plugin_bytes("kvroute-plugin-session-affinity");
    put_policy(&s, "sessions", &wasm, true);
    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({}));
    // Worker 2 holds the conversation's prefix: the default cost places the session there.
    let prompt = tokens(64, 71);
    let local = local_hashes(&prompt, 16, BASE_SEED);
    post_events(&s, &json!([stored_event(2, 0, 1, &local)]));
    // A probe that may only answer worker 1 gets worker 1...
    let probe = s.route_ok(
        &json!({"tokens": prompt, "session_id": "conv-1", "book": false,
        "allowed_worker_ids": [1], "explain": true}),
    );
    assert_eq!(probe["worker_id"], 1, "{probe}");
    // session-affinity answers a pick; explain says so (its costs column is the native one).
    assert_eq!(probe["answer"], "pick", "{probe}");
    assert_eq!(probe["candidates"][0]["chosen"], true, "{probe}");
    // ...and leaves no trace: the booked turn goes where it would have gone without it.
    for turn in 0..3 {
        let d = s.route_ok(&json!({"tokens": prompt, "session_id": "conv-1",
            "request_id": format!("turn-{turn}")}));
        assert_eq!(d["worker_id"], 2, "turn {turn}: {d}");
        s.delete(&format!("/v1/requests/turn-{turn}")).expect(200);
    }
}

#[test]
fn a_policy_directory_is_loaded_before_the_server_answers() {
    let dir = support::temp_dir("policy-dir");
    std::fs::write(
        dir.join("from-dir.wasm"),
        kvroute_server::serve::DEFAULT_POLICY_WASM,
    )
    .unwrap();
    std::fs::write(dir.join("from-dir.json"), r#"{"work_weight": 1}"#).unwrap();
    // The very first answer already has the directory's policy active.
    let s = Server::start(&["--policy-dir", dir.to_str().unwrap()]);
    let listed = s.get("/v1/policies").body().clone();
    assert_eq!(listed["active"], "from-dir", "{listed}");
    assert!(listed.to_string().contains("work_weight"), "{listed}");
    // With --policy too, the explicit one serves and the directory's is loaded beside it.
    let own = support::temp_dir("own-policy").join("explicit.wasm");
    std::fs::write(&own, kvroute_server::serve::DEFAULT_POLICY_WASM).unwrap();
    let s = Server::start(&[
        "--policy-dir",
        dir.to_str().unwrap(),
        "--policy",
        own.to_str().unwrap(),
    ]);
    let listed = s.get("/v1/policies").body().clone();
    assert_eq!(listed["active"], "explicit", "{listed}");
    assert!(listed.to_string().contains("from-dir"), "{listed}");
}

fn put_policy(s: &Server, name: &str, wasm: &[u8], activate: bool) -> Value {
    let q = if activate { "?activate=true" } else { "" };
    let r = s.raw(
        "PUT",
        &format!("/v1/policies/{name}{q}"),
        &[("content-type", "application/wasm")],
        wasm,
    );
    r.expect(201);
    r.body().clone()
}

#[test]
fn policy_upload_decides_routes() {
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    let s = Server::start(&[]);
    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({}));
    let p = tokens(64, 121);
    post_events(
        &s,
        &json!([stored_event(2, 0, 1, &local_hashes(&p, 16, BASE_SEED))]),
    );

    let info = put_policy(&s, "native", &wasm, true);
    assert_eq!(info["name"], "native");
    let digest = sha256_hex(&wasm);
    assert_eq!(
        info["digest"],
        digest.as_str(),
        "digest is the component's sha256"
    );
    let list = s.get("/v1/policies");
    list.expect(200);
    assert_eq!(list.body()["active"], "native");
    // The embedded default is listed too; find the uploaded one by name.
    let listed = list.body()["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "native")
        .expect("the uploaded policy is listed")
        .clone();
    let listed = &listed;
    for k in ["name", "version", "digest", "loaded_at", "stats"] {
        assert!(listed.get(k).is_some(), "policy lacks {k}: {listed}");
    }
    for k in ["calls", "errors", "fallbacks", "p50_us", "p99_us"] {
        assert!(listed["stats"].get(k).is_some(), "stats lack {k}: {listed}");
    }
    let ready = s.get("/readyz");
    ready.expect(200);

    for _ in 0..10 {
        let d = s.route_ok(&json!({"tokens": p, "book": false}));
        assert_eq!(d["policy"]["name"], "native", "{d}");
        assert_eq!(d["policy"]["digest"], digest.as_str(), "{d}");
        assert!(listed["version"].is_u64(), "{listed}");
        assert_eq!(
            d["policy"]["version"], listed["version"],
            "the decision's version is the listed one, as the same type: {d}"
        );
        assert_eq!(d["fallback"], false, "{d}");
        assert_eq!(
            d["worker_id"], 2,
            "the plugin's cost still follows the cache: {d}"
        );
        assert_eq!(d["overlap_blocks"], 4);
    }
    let list = s.get("/v1/policies");
    let calls = list.body()["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "native")
        .and_then(|p| p["stats"]["calls"].as_u64())
        .unwrap();
    assert!(calls >= 10, "{}", list.text);
    let version = listed["version"].as_u64().unwrap();
    let text = s.metrics();
    assert!(
        metric(
            &text,
            &format!("kvroute_policy_calls_total{{policy=\"native\",version=\"{version}\"}}")
        )
        .is_some_and(|n| n >= 10.0),
        "{text}"
    );

    // The active one cannot be deleted; config rejected by the component is a 400 with its words.
    s.delete("/v1/policies/native")
        .expect_error(409, "policy_active");
    let r = s.put(
        "/v1/policies/native/config",
        &json!({"prefill_load_scale": -1}),
    );
    assert_eq!(r.status, 400, "{r}");
    assert_error_shape(&r);
    assert!(
        r.text.contains("prefill_load_scale"),
        "the component's message: {r}"
    );
    assert_eq!(
        s.route_ok(&json!({"tokens": p, "book": false}))["policy"]["digest"],
        digest.as_str(),
        "a rejected config keeps the old version serving"
    );

    // A new configuration is a new version; rolling back leaves two versions of the name
    // loaded. Every series stays unique (Prometheus refuses a scrape with duplicates) and says
    // which version serves.
    let r = s.put("/v1/policies/native/config", &json!({}));
    r.expect(200);
    assert_eq!(
        r.body()["version"].as_u64(),
        Some(version + 1),
        "the rejected configuration used no version number: {r}"
    );
    s.route_ok(&json!({"tokens": p, "book": false}));
    s.post("/v1/policies/rollback", &json!({})).expect(200);
    let text = s.metrics();
    let mut seen = BTreeSet::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let series = line.rsplit_once(' ').map_or(line, |(name, _)| name);
        assert!(
            seen.insert(series.to_string()),
            "duplicate series {series}:\n{text}"
        );
    }
    let active: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kvroute_policy_active{") && l.ends_with(" 1"))
        .collect();
    assert_eq!(active.len(), 1, "{text}");
    assert!(
        active[0].contains(&format!("version=\"{version}\"")),
        "the rollback restored version {version}: {text}"
    );
}

#[test]
fn policy_hot_swap_over_http_under_traffic() {
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    // This test is about swaps, not latency: a generous per-call deadline keeps a starved debug
    // build on a busy 2-core machine from turning CPU scheduling into deadline fallbacks.
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-swap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("swap.toml");
    std::fs::write(&cfg, "[policy_runtime]\ndeadline_us = 200000\n").unwrap();
    let s = Server::start(&["--config", cfg.to_str().unwrap()]);
    for id in 1..=4 {
        s.put_worker(id, &json!({"dp_size": 2}));
    }
    put_policy(&s, "a", &wasm, true);
    put_policy(&s, "b", &wasm, false);

    let stop = AtomicBool::new(false);
    let routed = AtomicU64::new(0);
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let names: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (s, stop, routed, failures, names) = (&s, &stop, &routed, &failures, &names);
            scope.spawn(move || {
                let agent = support::client();
                let url = s.url("/v1/route");
                let mut i = 0u32;
                let deadline = Instant::now() + Duration::from_secs(60);
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    i += 1;
                    let body = serde_json::to_vec(&json!({
                        "tokens": tokens(64 + (i % 5) as usize * 16, t * 10_000 + i % 50),
                        "book": false
                    }))
                    .unwrap();
                    match support::send(
                        &agent,
                        &url,
                        "POST",
                        &[("content-type", "application/json")],
                        &body,
                    ) {
                        Ok(r) if r.status == 200 => {
                            routed.fetch_add(1, Ordering::Relaxed);
                            let d = r.body();
                            if d["fallback"] != false {
                                failures.lock().unwrap().push(format!("fallback: {d}"));
                            }
                            if let Some(n) = d["policy"]["name"].as_str() {
                                names.lock().unwrap().insert(n.to_string());
                            }
                        }
                        Ok(r) => failures.lock().unwrap().push(r.to_string()),
                        Err(e) => failures.lock().unwrap().push(format!("transport: {e}")),
                    }
                }
            });
        }
        let mut last = routed.load(Ordering::Relaxed);
        for i in 0..20 {
            let r = if i % 2 == 0 {
                let name = if i % 4 == 0 { "a" } else { "b" };
                s.put(
                    &format!("/v1/policies/{name}/config"),
                    &json!({"prefill_load_scale": 1.0 + f64::from(i) / 10.0}),
                )
            } else {
                let name = if i % 4 == 1 { "b" } else { "a" };
                s.post(&format!("/v1/policies/{name}/activate"), &json!({}))
            };
            assert_eq!(r.status, 200, "swap {i}: {r}");
            // Let traffic flow between swaps.
            eventually("routes between swaps", Duration::from_secs(10), || {
                routed.load(Ordering::Relaxed) >= last + 5
            });
            last = routed.load(Ordering::Relaxed);
        }
        stop.store(true, Ordering::Relaxed);
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} non-200 or fallback routes during swaps; first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let names = names.into_inner().unwrap();
    assert!(routed.load(Ordering::Relaxed) >= 100);
    assert_eq!(
        names,
        ["a", "b"].into_iter().map(String::from).collect(),
        "both policies decided"
    );
    assert_eq!(s.get("/v1/policies").body()["active"], "a");
}

// ---------------------------------------------------------------------------------------- logs

#[test]
fn logs_to_a_pipe_are_plain_text() {
    let s = Server::start(&[]);
    s.get("/healthz").expect(200);
    let err = s.stderr();
    assert!(err.contains("kvroute listening"), "{err}");
    assert!(
        !err.contains('\u{1b}'),
        "colour codes in a log that is not a terminal: {err:?}"
    );
}
