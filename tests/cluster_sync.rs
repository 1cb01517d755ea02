//! `kvroute serve --cluster`: bookings shared live between replicas (separate processes) over a
//! real nats-server's core subjects. A booking on one replica loads the others within
//! milliseconds, a lifecycle call works on any replica, and a killed replica's bookings are
//! dropped by the others after `replica_timeout_ms`, not before.

use crate::cluster::within;
use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::nats::Nats;
use support::Server;

fn replica(nats: &Nats, name: &str, timeout_ms: u64) -> Server {
    Server::start(&[
        "--cluster",
        &nats.url(),
        "--cluster-name",
        name,
        "--replica-timeout-ms",
        &timeout_ms.to_string(),
    ])
}

/// Three replicas of cluster `name`, as separate processes.
fn trio(nats: &Nats, name: &str, timeout_ms: u64) -> (Server, Server, Server) {
    (
        replica(nats, name, timeout_ms),
        replica(nats, name, timeout_ms),
        replica(nats, name, timeout_ms),
    )
}

/// Registers `workers` (with `spec`) on `a` and waits until every one of `others` serves them.
fn workers_everywhere(a: &Server, others: &[&Server], workers: &[u64], spec: &Value) {
    for &w in workers {
        a.put_worker(w, spec);
    }
    within(
        Duration::from_secs(2),
        "the workers on the other replicas",
        || others.iter().all(|s| s.workers().len() == workers.len()),
    );
}

/// One rank's load: ((worker, rank), (prefill tokens, decode blocks, requests)).
type RankLoad = ((u64, u64), (u64, u64, u64));

/// Every rank's load, by worker and rank.
fn loads(s: &Server) -> Vec<RankLoad> {
    let mut out = Vec::new();
    let mut workers: Vec<_> = s.workers().into_iter().collect();
    workers.sort_by_key(|(id, _)| *id);
    for (id, w) in workers {
        for r in w["ranks"].as_array().expect("ranks") {
            let n = |k: &str| r[k].as_u64().expect(k);
            out.push((
                (id, n("dp_rank")),
                (
                    n("active_prefill_tokens"),
                    n("active_decode_blocks"),
                    n("active_requests"),
                ),
            ));
        }
    }
    out
}

/// Bookings counted in a replica's load, over every rank.
fn booked(s: &Server) -> u64 {
    loads(s).iter().map(|(_, l)| l.2).sum()
}

/// The replicas `GET /v1/cluster` lists: id -> its entry.
fn listed(s: &Server) -> Vec<Value> {
    let r = s.get("/v1/cluster");
    r.expect(200);
    r.body()["replicas"].as_array().expect("replicas").clone()
}

/// A cumulative histogram as scraped: (upper bound, count) in increasing order, `+Inf` last.
fn histogram(metrics: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, value) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, value.parse().ok()?))
        })
        .collect()
}

/// The upper bound of the bucket holding quantile `q` of the observations between two scrapes.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let total = after.last().unwrap().1 - before.last().unwrap().1;
    let rank = (q * total).ceil();
    for ((le, a), (_, b)) in after.iter().zip(before) {
        if a - b >= rank {
            return *le;
        }
    }
    f64::INFINITY
}

fn route(s: &Server, id: &str, tokens: Vec<u32>) -> Value {
    s.route_ok(&json!({"request_id": id, "tokens": tokens}))
}

#[test]
fn a_booking_on_one_replica_is_in_the_others_load_within_10_ms_p99() {
    let nats = Nats::start();
    let (a, b, c) = trio(&nats, "sync", 3000);
    workers_everywhere(
        &a,
        &[&b, &c],
        &[1, 2, 3],
        &json!({"total_kv_blocks": 100000}),
    );
    const LAG: &str = "kvroute_cluster_sync_lag_seconds";
    let before = histogram(&b.metrics(), LAG);
    assert!(!before.is_empty(), "B exposes {LAG}");
    const N: u64 = 1000;
    let t0 = Instant::now();
    for i in 0..N {
        // Different prompts, so the bookings spread over the workers with their own blocks.
        let tokens: Vec<u32> = (0..48).map(|t| (i as u32) * 1000 + t).collect();
        route(&a, &format!("r{i}"), tokens);
    }
    let routed = t0.elapsed();
    for s in [&b, &c] {
        within(Duration::from_secs(2), "every booking on B and C", || {
            booked(s) == N
        });
    }
    // Every replica counts the same load on every rank as the one that booked.
    assert_eq!(loads(&b), loads(&a));
    assert_eq!(loads(&c), loads(&a));
    let metrics = b.metrics();
    let after = histogram(&metrics, LAG);
    let count = after.last().unwrap().1 - before.last().unwrap().1;
    assert_eq!(count, N as f64, "one lag sample per booking");
    let (p50, p99) = (
        quantile(&before, &after, 0.50),
        quantile(&before, &after, 0.99),
    );
    let mean = (support::metric(&metrics, &format!("{LAG}_sum")).unwrap()) / count;
    eprintln!(
        "booking propagation A -> B over {N} bookings (routed in {routed:?}): \
         p50 <= {:.2} ms, p99 <= {:.2} ms (histogram bucket bounds), mean {:.3} ms",
        p50 * 1e3,
        p99 * 1e3,
        mean * 1e3
    );
    assert!(p99 <= 0.010, "p99 sync lag {p99} s is over 10 ms");
    assert_eq!(
        support::metric(&metrics, "kvroute_cluster_sync_applied_total"),
        Some(N as f64)
    );
    for reason in ["gap", "duplicate_request", "unknown_candidate"] {
        assert_eq!(
            support::metric(
                &metrics,
                &format!("kvroute_cluster_sync_dropped_total{{reason=\"{reason}\"}}")
            ),
            Some(0.0),
            "{reason}"
        );
    }
    assert_eq!(
        support::metric(&metrics, "kvroute_cluster_sync_duplicates_total"),
        Some(0.0)
    );
    assert_eq!(
        support::metric(&a.metrics(), "kvroute_cluster_sync_published_total"),
        Some(N as f64)
    );
    // B's own decisions see A's load: a request whose id A booked is refused on B.
    b.post(
        "/v1/route",
        &json!({"request_id": "r7", "tokens": vec![1u32; 48]}),
    )
    .expect_error(409, "duplicate_request_id");
}

#[test]
fn a_lifecycle_call_on_any_replica_applies_everywhere() {
    let nats = Nats::start();
    let (a, b, c) = trio(&nats, "life", 3000);
    workers_everywhere(&a, &[&b, &c], &[1], &json!({}));
    route(&a, "req-1", vec![5; 100]);
    let all = [&a, &b, &c];
    for s in all {
        within(Duration::from_secs(1), "the booking everywhere", || {
            booked(s) == 1
        });
    }
    let prefill = |s: &Server| loads(s)[0].1 .0;
    assert_eq!(prefill(&a), 100);
    // prefill_complete and output on B (it did not book the request) reach A and C.
    b.raw("POST", "/v1/requests/req-1/prefill_complete", &[], b"")
        .expect(200);
    b.post("/v1/requests/req-1/output", &json!({"tokens": 64}))
        .expect(200);
    let want = loads(&b);
    assert_eq!(want[0].1 .0, 0, "{want:?}");
    for s in [&a, &c] {
        within(
            Duration::from_secs(1),
            "B's lifecycle calls elsewhere",
            || loads(s) == want,
        );
    }
    // Free on C releases it on A (the origin), B and C.
    c.delete("/v1/requests/req-1").expect(200);
    for s in all {
        within(Duration::from_secs(1), "the free everywhere", || {
            booked(s) == 0
        });
        assert!(loads(s).iter().all(|(_, l)| *l == (0, 0, 0)));
    }
    // The id is free everywhere: booking it again on B works, and frees on A.
    route(&b, "req-1", vec![5; 100]);
    within(Duration::from_secs(1), "the new booking on A", || {
        booked(&a) == 1
    });
    a.delete("/v1/requests/req-1").expect(200);
    for s in all {
        within(Duration::from_secs(1), "the second free everywhere", || {
            booked(s) == 0
        });
    }
    // Every replica lists the three, itself included, with its own id.
    for s in all {
        let r = s.get("/v1/cluster");
        r.expect(200);
        let v = r.body();
        assert_eq!(v["cluster_name"], "life");
        assert_eq!(v["nats"], "connected");
        let ids: Vec<&str> = v["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["replica_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids.len(), 3, "{v}");
        assert!(ids.contains(&v["replica_id"].as_str().unwrap()));
    }
}

#[test]
fn a_killed_replica_s_bookings_are_dropped_after_the_timeout_and_not_before() {
    let nats = Nats::start();
    const TIMEOUT_MS: u64 = 1000;
    let (a, b, c) = trio(&nats, "kill", TIMEOUT_MS);
    workers_everywhere(&a, &[&b, &c], &[1, 2], &json!({}));
    for i in 0..5u32 {
        route(&b, &format!("b{i}"), vec![i; 64]);
    }
    route(&a, "a0", vec![99; 64]);
    let b_id = b.get("/v1/cluster").body()["replica_id"]
        .as_str()
        .unwrap()
        .to_owned();
    for s in [&a, &c] {
        within(Duration::from_secs(1), "B's bookings on A and C", || {
            booked(s) == 6
        });
        within(Duration::from_secs(1), "B's heartbeat", || {
            listed(s)
                .iter()
                .any(|r| r["replica_id"] == b_id.as_str() && r["bookings"] == 5)
        });
    }
    let killed = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &b.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    // Half the timeout later, B is still counted and listed.
    std::thread::sleep(Duration::from_millis(TIMEOUT_MS / 2));
    for s in [&a, &c] {
        assert_eq!(booked(s), 6, "B's bookings dropped before the timeout");
        assert!(listed(s).iter().any(|r| r["replica_id"] == b_id.as_str()));
    }
    // After the timeout (its last heartbeat was at most 200 ms before the kill), they go.
    for s in [&a, &c] {
        within(Duration::from_secs(3), "B's bookings dropped", || {
            booked(s) == 1
        });
    }
    let dropped_after = killed.elapsed();
    eprintln!("B's bookings dropped {dropped_after:?} after SIGKILL (timeout {TIMEOUT_MS} ms)");
    assert!(
        dropped_after >= Duration::from_millis(TIMEOUT_MS - 250),
        "{dropped_after:?}"
    );
    for s in [&a, &c] {
        let ids: Vec<Value> = listed(s).iter().map(|r| r["replica_id"].clone()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(!ids.contains(&json!(b_id)));
        let m = s.metrics();
        assert_eq!(support::metric(&m, "kvroute_cluster_replicas"), Some(2.0));
        assert_eq!(
            support::metric(&m, "kvroute_cluster_replicas_lost_total"),
            Some(1.0)
        );
    }
    // A's own booking is untouched and still freed everywhere from C.
    c.delete("/v1/requests/a0").expect(200);
    within(Duration::from_secs(1), "a0 freed on A", || booked(&a) == 0);
}

#[test]
fn cluster_status_and_replica_timeout_outside_a_cluster_are_refused_clearly() {
    let s = Server::start(&[]);
    let r = s.get("/v1/cluster");
    r.expect_error(404, "not_in_cluster");
    support::assert_error_shape(&r);
    let (status, _, err) = support::run_to_exit(
        &[
            "serve",
            "--cluster",
            "nats://127.0.0.1:1",
            "--replica-timeout-ms",
            "10",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert!(!status.success());
    assert!(err.contains("replica_timeout_ms"), "{err}");
}

#[test]
fn approximate_replicas_send_a_prefix_where_another_replica_placed_it() {
    // Without KV events each replica indexes from routing decisions: the booking messages carry
    // the prompt's local hashes, so a placement made on A is in B's index too.
    let nats = Nats::start();
    let start = || {
        Server::start(&[
            "--cluster",
            &nats.url(),
            "--cluster-name",
            "approx",
            "--approximate",
        ])
    };
    let (a, b) = (start(), start());
    workers_everywhere(&a, &[&b], &[1, 2, 3, 4], &json!({}));
    let ask = |s: &Server, tokens: &[u32]| {
        let d = s.route_ok(&json!({"tokens": tokens, "book": false}));
        (
            d["worker_id"].as_u64().unwrap(),
            d["overlap_blocks"].as_u64().unwrap(),
        )
    };
    for i in 0..4u32 {
        let prompt: Vec<u32> = (0..256).map(|t| t + 1000 * i).collect();
        assert_eq!(ask(&b, &prompt).1, 0, "B knows nothing of prompt {i} yet");
        let placed = route(&a, &format!("p{i}"), prompt.clone());
        let worker = placed["worker_id"].as_u64().unwrap();
        a.delete(&format!("/v1/requests/p{i}")).expect(200);
        within(Duration::from_secs(1), "A's placement in B's index", || {
            ask(&b, &prompt) == (worker, 16)
        });
    }
}

#[test]
fn kv_events_posted_to_one_replica_are_applied_by_every_replica() {
    let nats = Nats::start();
    let (a, b, c) = trio(&nats, "kvrelay", 3000);
    workers_everywhere(&a, &[&b, &c], &[1, 2, 3], &json!({}));
    let ask = |s: &Server, tokens: &[u32]| {
        let d = s.route_ok(&json!({"tokens": tokens, "book": false}));
        (
            d["worker_id"].as_u64().unwrap(),
            d["overlap_blocks"].as_u64().unwrap(),
        )
    };
    // One prompt's blocks on worker 2 posted to B; an event for an unregistered worker (refused
    // on B) in the same post.
    let prompt: Vec<u32> = (0..256).collect();
    let local = support::local_hashes(&prompt, 16, support::BASE_SEED);
    let r = b.post(
        "/v1/events",
        &json!([
            support::stored_event(2, 0, 1, &local),
            support::stored_event(9, 0, 1, &local)
        ]),
    );
    r.expect(200);
    assert_eq!(
        (r.body()["applied"].clone(), r.body()["dropped"].clone()),
        (json!(1), json!(1))
    );
    for s in [&a, &b, &c] {
        within(
            Duration::from_secs(1),
            "the posted blocks everywhere",
            || ask(s, &prompt) == (2, 16),
        );
    }
    // Only what B applied was relayed: A and C applied 1 and dropped none.
    let m = |s: &Server, name: &str| support::metric(&s.metrics(), name).unwrap_or(-1.0);
    assert_eq!(m(&b, "kvroute_cluster_kv_events_published_total"), 1.0);
    for s in [&a, &c] {
        assert_eq!(m(s, "kvroute_cluster_kv_events_applied_total"), 1.0);
        assert_eq!(m(s, "kvroute_cluster_kv_events_dropped_total"), 0.0);
        assert_eq!(m(s, "kvroute_cluster_kv_events_published_total"), 0.0);
    }
    // A removal posted to C reaches A and B.
    let removed = json!([{"worker_id": 2, "event": {"event_id": 2, "dp_rank": 0,
        "data": {"removed": {"block_hashes": [support::engine_hash(support::sequence_hashes(&local)[0])]}}}}]);
    c.post("/v1/events", &removed).expect(200);
    for s in [&a, &b, &c] {
        within(Duration::from_secs(1), "the removal everywhere", || {
            ask(s, &prompt).1 == 0
        });
    }
}
