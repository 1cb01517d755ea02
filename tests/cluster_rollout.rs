//! Policy rollout in cluster mode (issue 37): the shadows' and the canary's specs and the ended
//! canaries' records are shared state, and a canary's outcomes are shared between replicas.
//!
//! Real `kvroute serve --cluster --proxy` replicas (separate processes) on a real nats-server, in
//! front of real `kvroute mock-engine`s: a canary started on one replica routes the same sessions
//! by the candidate on every replica, each replica's `GET .../canary` counts every replica's
//! requests, a stop through one ends it on all with one record, a random-placement candidate is
//! rolled back on the fleet's measured TTFT with the same record on both and neither routes by it
//! afterwards, a replica started mid-canary takes it up (and its promotion there is the active
//! version everywhere), and a NATS outage refuses rollout
//! changes (503, nothing half-applied). With `--state-dir` the rollout survives a restart.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster::within;
use crate::rollout::{
    assert_one_arm_per_session, canary_state, drive, load_misbehave, turn, FLEET_BLOCKS, SESSIONS,
};
use crate::support::engines::{eventually, model_dir, MockEngine, MODEL};
use crate::support::nats::Nats;
use crate::support::{self, Server};
use kvroute_policy::{canary_arm, Arm};

/// `n` mock engines and a configuration file that puts them behind a proxy.
fn engines(n: usize) -> (Vec<MockEngine>, std::path::PathBuf) {
    let blocks = FLEET_BLOCKS.to_string();
    let engines: Vec<MockEngine> = (0..n)
        .map(|_| MockEngine::start(&["--num-gpu-blocks", &blocks, "--speed", "0.5"]))
        .collect();
    let mut toml = format!(
        "block_size = 16\n\n[proxy]\nenabled = true\n\n[models.{MODEL}]\ntokenizer = {:?}\n",
        model_dir().join("tokenizer.json")
    );
    for (i, e) in engines.iter().enumerate() {
        toml += &format!(
            "\n[workers.{i}]\nendpoint = {:?}\nmodel = {MODEL:?}\ntotal_kv_blocks = {FLEET_BLOCKS}\nmax_num_batched_tokens = 8192\nkv_events = {{ endpoint = {:?}, replay_endpoint = {:?} }}\n",
            e.base, e.kv_events, e.replay
        );
    }
    (engines, support::temp_file("cluster-rollout.toml", &toml))
}

/// A proxying replica of cluster `name` with `config`, once it follows every engine's KV events.
fn replica(nats: &Nats, name: &str, config: &std::path::Path, n: usize) -> Server {
    let s = Server::start(&[
        "--config",
        config.to_str().unwrap(),
        "--cluster",
        &nats.url(),
        "--cluster-name",
        name,
    ]);
    eventually("every engine's KV events subscribed", || {
        let m = s.metrics();
        (support::metric(&m, "kvroute_kv_subscriptions")? >= n as f64).then_some(())
    });
    s
}

/// Requests the running canary's arms counted (every replica's, as this replica sees them).
fn requests(s: &Server, name: &str) -> (u64, u64) {
    let c = &canary_state(s, name)["canary"];
    (
        c["control"]["requests"].as_u64().unwrap_or(0),
        c["candidate"]["requests"].as_u64().unwrap_or(0),
    )
}

/// The proxy's answer header for session `s`'s turn `k` through `server`.
fn turns(
    servers: &[&Server],
    sessions: std::ops::Range<usize>,
    k0: usize,
) -> BTreeMap<String, Vec<String>> {
    let agent = support::client();
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, server) in servers.iter().enumerate() {
        for s in sessions.clone() {
            let by = turn(server, &agent, s, k0 + k);
            seen.entry(format!("sess-{s}")).or_default().push(by);
        }
    }
    seen
}

#[test]
fn e2e_a_canary_on_one_replica_routes_counts_and_ends_on_every_replica() {
    let nats = Nats::start();
    let (_engines, config) = engines(4);
    let a = replica(&nats, "canary", &config, 4);
    let b = replica(&nats, "canary", &config, 4);
    load_misbehave(&a, "random", "random", false);
    within(Duration::from_secs(5), "random loaded on B", || {
        b.get("/v1/policies/random").status == 200
    });

    // 1. A canary started on A runs on B: same id, same spec, same arms.
    let r = a.post(
        "/v1/policies/random/canary",
        &json!({"fraction": 0.5, "guardrails": {"min_sample": 100000, "min_decisions": 100000}}),
    );
    r.expect(200);
    let id = r.body()["canary"]["id"].clone();
    let took = within(Duration::from_secs(2), "the canary on B", || {
        canary_state(&b, "random")["canary"]["id"] == id
    });
    eprintln!("canary start seen on the other replica after {took:?}");
    let on_b = canary_state(&b, "random")["canary"].clone();
    assert_eq!(on_b["fraction"], 0.5, "{on_b}");
    assert_eq!(on_b["control"]["policy"], "default", "{on_b}");
    assert_eq!(
        on_b["started_at"],
        r.body()["canary"]["started_at"],
        "{on_b}"
    );
    // Starting another one on B is refused: one canary at a time, cluster-wide.
    b.post("/v1/policies/random/canary", &json!({"fraction": 0.1}))
        .expect_error(409, "rollout_conflict");
    // 20 sessions, one turn through A, then one through B: each session is routed by the arm its
    // id hashes to, on both replicas.
    let seen = turns(&[&a, &b], 0..20, 1);
    let mut candidates = 0;
    for (session, by) in &seen {
        let expected = match canary_arm(session, 0.5) {
            Arm::Candidate => "random@1",
            Arm::Control => "default@1",
        };
        candidates += usize::from(expected == "random@1");
        assert_eq!(by, &vec![expected.to_string(); 2], "{session}");
    }
    assert!((3..=17).contains(&candidates), "{candidates} of 20");
    // 2. The counts are the fleet's: each replica's GET counts both replicas' 40 requests.
    let took = within(
        Duration::from_secs(2),
        "every request counted on both",
        || {
            let (ka, ca) = requests(&a, "random");
            let (kb, cb) = requests(&b, "random");
            ka + ca == 40 && kb + cb == 40
        },
    );
    eprintln!("outcomes merged on both replicas within {took:?}");
    let (ca, cb) = (
        canary_state(&a, "random")["canary"].clone(),
        canary_state(&b, "random")["canary"].clone(),
    );
    for arm in ["control", "candidate"] {
        assert_eq!(ca[arm]["requests"], cb[arm]["requests"], "{ca}\n{cb}");
        assert_eq!(ca[arm]["decisions"], cb[arm]["decisions"], "{ca}\n{cb}");
        assert_eq!(
            ca[arm]["ttft_ms"]["n"], cb[arm]["ttft_ms"]["n"],
            "{ca}\n{cb}"
        );
    }
    assert_eq!(
        ca["candidate"]["requests"].as_u64(),
        Some(2 * candidates as u64),
        "{ca}"
    );
    for s in [&a, &b] {
        let m = s.metrics();
        assert_eq!(
            support::metric(&m, "kvroute_cluster_rollout_merged_total"),
            Some(20.0),
            "each replica merged the other's 20 outcomes"
        );
    }
    // The shadow spec is shared too; its figures are each replica's own, and say so.
    a.post("/v1/policies/dynamo/shadow", &json!({"sample": 1.0}))
        .expect(200);
    within(Duration::from_secs(2), "the shadow on B", || {
        !b.get("/v1/policies/dynamo/shadow").body()["shadow"].is_null()
    });
    let (sa, sb) = (
        a.get("/v1/policies/dynamo/shadow").body()["shadow"].clone(),
        b.get("/v1/policies/dynamo/shadow").body()["shadow"].clone(),
    );
    assert!(
        sa["replica"].is_string() && sa["replica"] != sb["replica"],
        "{sa}\n{sb}"
    );
    assert_eq!(sa["started_at"], sb["started_at"]);
    b.delete("/v1/policies/dynamo/shadow").expect(200);
    within(Duration::from_secs(2), "the shadow stopped on A", || {
        a.get("/v1/policies/dynamo/shadow").body()["shadow"].is_null()
    });

    // 3. A stop through B ends it on A, with the same record.
    let stopped = b.delete("/v1/policies/random/canary");
    stopped.expect(200);
    let record = stopped.body()["record"].clone();
    assert_eq!(record["outcome"], "stopped");
    assert_eq!(record["evidence"]["id"], id);
    within(Duration::from_secs(2), "the stop on A", || {
        canary_state(&a, "random")["canary"].is_null()
    });
    assert_eq!(canary_state(&a, "random")["records"], json!([record]));
    assert_eq!(canary_state(&b, "random")["records"], json!([record]));

    // 4. A random-placement candidate is rolled back on the fleet's TTFT: the same record on
    // both, and neither routes by it any more.
    let r = a.post(
        "/v1/policies/random/canary",
        &json!({"fraction": 0.2, "guardrails": {"min_sample": 20, "ttft_mean_max_increase": 0.1,
                "ttft_p90_max_increase": 0.1}}),
    );
    r.expect(200);
    let id2 = r.body()["canary"]["id"].clone();
    assert_ne!(id2, id, "a new canary, a new id");
    within(Duration::from_secs(2), "the second canary on B", || {
        canary_state(&b, "random")["canary"]["id"] == id2
    });
    let started = Instant::now();
    let (seen, sent) = drive(&[&a, &b], SESSIONS, 4, 1200, || {
        canary_state(&a, "random")["canary"].is_null()
            && canary_state(&b, "random")["canary"].is_null()
    });
    let took = within(Duration::from_secs(3), "rolled back on both", || {
        canary_state(&a, "random")["canary"].is_null()
            && canary_state(&b, "random")["canary"].is_null()
    });
    // Both may have decided from their own (merged) figures at about the same moment: the first
    // end written is the one both hold, once the other's compare-and-set is refused.
    let converged = within(Duration::from_secs(2), "the same records on both", || {
        canary_state(&a, "random")["records"] == canary_state(&b, "random")["records"]
    });
    let (ra, rb) = (
        canary_state(&a, "random")["records"].clone(),
        canary_state(&b, "random")["records"].clone(),
    );
    assert_eq!(ra, rb, "the same records on both replicas");
    assert_eq!(
        ra.as_array().unwrap().len(),
        2,
        "one record per canary: {ra}"
    );
    // And they stay so (no replica writes its own record over the winner's later).
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(canary_state(&a, "random")["records"], ra);
    assert_eq!(canary_state(&b, "random")["records"], ra);
    let rec = ra.as_array().unwrap().last().unwrap().clone();
    assert_eq!(rec["evidence"]["id"], id2, "{rec}");
    assert_eq!(
        rec["outcome"], "rolled_back",
        "after {sent} requests: {rec}"
    );
    let rule = rec["rule"].as_str().unwrap();
    assert!(rule == "ttft_mean" || rule == "ttft_p90", "{rec}");
    // The evidence is the fleet's: more requests than either replica served alone (sessions
    // alternate between them, so each served about half).
    let ev = &rec["evidence"];
    let judged =
        ev["control"]["requests"].as_u64().unwrap() + ev["candidate"]["requests"].as_u64().unwrap();
    eprintln!(
        "rolled back after {sent} requests ({:?}; ended on both {took:?} and the same record on both {converged:?} after the drive), judged on {judged}: {}",
        started.elapsed(),
        rec["reason"]
    );
    assert!(
        judged as f64 > 0.6 * (sent as f64),
        "judged on {judged} of {sent} requests: {rec}"
    );
    assert_one_arm_per_session(&seen, 0.2, "default@1", "random@1");
    // Neither replica routes a candidate-arm session by the candidate now.
    let after = turns(&[&a, &b], 0..SESSIONS, 10_000);
    for (session, by) in &after {
        assert!(by.iter().all(|p| p == "default@1"), "{session}: {by:?}");
    }
    assert_eq!(a.get("/v1/policies").body()["active"], "default");
    assert_eq!(b.get("/v1/policies").body()["active"], "default");
}

#[test]
fn e2e_a_replica_started_mid_canary_takes_it_up() {
    let nats = Nats::start();
    let (_engines, config) = engines(2);
    let a = replica(&nats, "restart", &config, 2);
    let mut b = replica(&nats, "restart", &config, 2);
    load_misbehave(&a, "random", "random", false);
    within(Duration::from_secs(5), "random loaded on B", || {
        b.get("/v1/policies/random").status == 200
    });
    let r = a.post(
        "/v1/policies/random/canary",
        &json!({"fraction": 0.5, "guardrails": {"min_sample": 100000, "min_decisions": 100000}}),
    );
    r.expect(200);
    let id = r.body()["canary"]["id"].clone();
    within(Duration::from_secs(2), "the canary on B", || {
        canary_state(&b, "random")["canary"]["id"] == id
    });
    let before = turns(&[&b], 0..12, 1);
    turns(&[&a], 0..12, 50);
    within(
        Duration::from_secs(2),
        "24 requests counted on both",
        || {
            let ((ka, ca), (kb, cb)) = (requests(&a, "random"), requests(&b, "random"));
            ka + ca == 24 && kb + cb == 24
        },
    );
    // Each replica keeps what it published in the cluster at most a second later.
    std::thread::sleep(Duration::from_millis(1500));
    let on_a = canary_state(&a, "random")["canary"].clone();
    b.terminate(Duration::from_secs(10));
    drop(b);
    // B comes back (a new process, a new replica id) while the canary runs.
    let b = replica(&nats, "restart", &config, 2);
    let c = canary_state(&b, "random")["canary"].clone();
    assert_eq!(c["id"], id, "the canary taken up at start: {c}");
    assert_eq!(c["started_at"], r.body()["canary"]["started_at"], "{c}");
    // With the outcomes measured before it started, its own previous run's included: the same
    // figures as A's.
    let took = within(
        Duration::from_secs(2),
        "the earlier outcomes on the new B",
        || {
            let (k, c) = requests(&b, "random");
            k + c == 24
        },
    );
    eprintln!("a restarted replica held the canary's earlier outcomes {took:?} after it listened");
    let c = canary_state(&b, "random")["canary"].clone();
    for arm in ["control", "candidate"] {
        for k in ["requests", "decisions"] {
            assert_eq!(c[arm][k], on_a[arm][k], "{arm}.{k}\n{c}\n{on_a}");
        }
        for figure in ["ttft_ms", "itl_ms", "cached_tokens"] {
            let (x, y) = (&c[arm][figure], &on_a[arm][figure]);
            assert_eq!(
                (&x["n"], &x["p50"], &x["p90"]),
                (&y["n"], &y["p50"], &y["p90"])
            );
            // Summed in another order: equal but for rounding.
            let (mx, my) = (x["mean"].as_f64().unwrap(), y["mean"].as_f64().unwrap());
            assert!(
                (mx - my).abs() <= 1e-9 * my.abs().max(1.0),
                "{arm}.{figure}: {x} {y}"
            );
        }
    }
    // The same sessions in the same arms as before the restart, and as on A.
    let again = turns(&[&b, &a], 0..12, 100);
    for (session, by) in &again {
        let first = &before[session][0];
        assert!(
            by.iter().all(|p| p == first),
            "{session}: {first} then {by:?}"
        );
    }
    // And from then on every replica's, on both.
    within(
        Duration::from_secs(2),
        "48 requests counted on both",
        || {
            let ((ka, ca), (kb, cb)) = (requests(&a, "random"), requests(&b, "random"));
            ka + ca == 48 && kb + cb == 48
        },
    );
    // Promoted through the new replica: the candidate is active on A too, with the same record.
    b.raw("POST", "/v1/policies/random/promote", &[], b"")
        .expect(200);
    within(Duration::from_secs(2), "the promotion on A", || {
        canary_state(&a, "random")["canary"].is_null()
            && a.get("/v1/policies").body()["active"] == "random"
    });
    let records = canary_state(&a, "random")["records"].clone();
    assert_eq!(records, canary_state(&b, "random")["records"]);
    assert_eq!(records[0]["outcome"], "promoted", "{records}");
    assert_eq!(records[0]["evidence"]["id"], id, "{records}");
    // Every session is routed by the promoted version on both.
    for (session, by) in turns(&[&a, &b], 0..12, 1000) {
        assert!(by.iter().all(|p| p == "random@1"), "{session}: {by:?}");
    }
}

#[test]
fn a_nats_outage_refuses_rollout_changes_and_loses_nothing() {
    let mut nats = Nats::start();
    let a = crate::cluster::replica(&nats, "outage-rollout");
    let b = crate::cluster::replica(&nats, "outage-rollout");
    crate::cluster::upload(&a, "cand", "").expect(201);
    within(Duration::from_secs(5), "cand on B", || {
        b.get("/v1/policies/cand").status == 200
    });
    a.post("/v1/policies/cand/canary", &json!({"fraction": 0.3}))
        .expect(200);
    within(Duration::from_secs(2), "the canary on B", || {
        !canary_state(&b, "cand")["canary"].is_null()
    });
    // Bad input names the field, changes nothing, on any replica.
    let r = b.post(
        "/v1/policies/cand/canary",
        &json!({"fraction": 0.3, "guardrails": {"max_error_rate": 2}}),
    );
    r.expect_error(400, "invalid_request");
    assert_eq!(r.field(), Some("guardrails.max_error_rate"), "{r}");
    nats.kill();
    within(Duration::from_secs(5), "A sees NATS gone", || {
        support::metric(&a.metrics(), "kvroute_cluster_nats_connected") == Some(0.0)
    });
    // Stopping, promoting or a new shadow cannot be shared now: 503, and nothing changed.
    a.delete("/v1/policies/cand/canary")
        .expect_error(503, "cluster_unavailable");
    a.raw("POST", "/v1/policies/cand/promote", &[], b"")
        .expect_error(503, "cluster_unavailable");
    a.post("/v1/policies/dynamo/shadow", &json!({}))
        .expect_error(503, "cluster_unavailable");
    let c = canary_state(&a, "cand");
    assert!(!c["canary"].is_null() && c["records"] == json!([]), "{c}");
    assert!(a.get("/v1/policies/dynamo/shadow").body()["shadow"].is_null());
    assert_eq!(a.get("/v1/policies").body()["active"], "default");
    // Back: the canary still runs everywhere, and a stop now reaches both.
    nats.restart();
    within(Duration::from_secs(10), "A reconnected", || {
        a.delete("/v1/policies/cand/canary").status == 200
    });
    within(Duration::from_secs(2), "the stop on B", || {
        canary_state(&b, "cand")["canary"].is_null()
    });
    assert_eq!(
        canary_state(&a, "cand")["records"],
        canary_state(&b, "cand")["records"]
    );
}

#[test]
fn with_a_state_dir_the_rollout_survives_a_restart() {
    let dir = support::temp_dir("rollout-state");
    let start = || Server::start(&["--state-dir", dir.to_str().unwrap()]);
    let mut s = start();
    crate::cluster::upload(&s, "cand", "").expect(201);
    let r = s.post(
        "/v1/policies/cand/canary",
        &json!({"fraction": 0.25, "guardrails": {"min_sample": 40}}),
    );
    r.expect(200);
    s.post("/v1/policies/dynamo/shadow", &json!({"sample": 0.5}))
        .expect(200);
    let canary: Value = r.body()["canary"].clone();
    s.terminate(Duration::from_secs(10));
    drop(s);
    let mut s = start();
    let c = canary_state(&s, "cand")["canary"].clone();
    for k in ["id", "fraction", "started_at", "guardrails", "version"] {
        assert_eq!(c[k], canary[k], "{k}: {c}");
    }
    let sh = s.get("/v1/policies/dynamo/shadow").body()["shadow"].clone();
    assert_eq!(sh["sample"], 0.5, "{sh}");
    // Ended: the record survives too, and nothing runs after the next restart.
    let record = s.delete("/v1/policies/cand/canary").body()["record"].clone();
    s.terminate(Duration::from_secs(10));
    drop(s);
    let s = start();
    let state = canary_state(&s, "cand");
    assert!(state["canary"].is_null(), "{state}");
    assert_eq!(state["records"], json!([record]));
}
