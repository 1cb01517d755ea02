//! `kvroute serve --cluster`: replicas (separate processes) that share their workers and policies
//! through a real nats-server's JetStream; a change made through one replica is served by the
//! others within a second, and the state outlives every replica.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::nats::Nats;
use support::Server;

const WASM: &[u8] = kvroute_server::serve::DEFAULT_POLICY_WASM;

pub(crate) fn replica(nats: &Nats, name: &str) -> Server {
    Server::start(&["--cluster", &nats.url(), "--cluster-name", name])
}

/// Polls `probe` until it holds; returns how long that took, or panics after `limit`.
#[track_caller]
pub(crate) fn within(limit: Duration, what: &str, mut probe: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if probe() {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn upload(s: &Server, name: &str, query: &str) -> support::Resp {
    s.raw(
        "PUT",
        &format!("/v1/policies/{name}{query}"),
        &[("content-type", "application/wasm")],
        WASM,
    )
}

/// The active policy's (name, version) per `GET /readyz`.
pub(crate) fn active(s: &Server) -> (Value, Value) {
    let v = s.get("/readyz").body().clone();
    (v["policy"]["name"].clone(), v["policy"]["version"].clone())
}

#[test]
fn a_worker_registered_on_one_replica_routes_on_the_others_within_a_second() {
    let nats = Nats::start();
    let (a, b, c) = (
        replica(&nats, "workers"),
        replica(&nats, "workers"),
        replica(&nats, "workers"),
    );
    a.put_worker(7, &json!({"taints": ["zone=a"], "total_kv_blocks": 500}));
    let mut waited = Vec::new();
    for s in [&b, &c] {
        waited.push(within(
            Duration::from_secs(1),
            "worker 7 on another replica",
            || s.workers().contains_key(&7),
        ));
        let d = s.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
        assert_eq!(d["worker_id"], 7, "{d}");
        assert_eq!(s.workers()[&7]["taints"], json!(["zone=a"]));
    }
    eprintln!("registration seen elsewhere after {waited:?}");
    assert_eq!(
        support::metric(&b.metrics(), "kvroute_cluster_nats_connected"),
        Some(1.0)
    );
    // A patch through B and a removal through C reach every replica too.
    b.patch("/v1/workers/7", &json!({"taints": ["zone=b"]}))
        .expect(200);
    for s in [&a, &c] {
        within(
            Duration::from_secs(1),
            "the patch on another replica",
            || s.workers()[&7]["taints"] == json!(["zone=b"]),
        );
        let d = s.route_ok(&json!({"tokens": vec![2u32; 32], "book": false,
                                   "routing_constraints": {"required_taints": ["zone=b"]}}));
        assert_eq!(d["worker_id"], 7, "{d}");
    }
    c.delete("/v1/workers/7").expect(204);
    for s in [&a, &b] {
        within(
            Duration::from_secs(1),
            "the removal on another replica",
            || s.workers().is_empty(),
        );
    }
    // A replica does not undo its own later change when its earlier one comes back to it.
    a.put_worker(7, &json!({"taints": ["zone=c"]}));
    within(Duration::from_secs(1), "the new registration on C", || {
        c.workers()
            .get(&7)
            .is_some_and(|w| w["taints"] == json!(["zone=c"]))
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(a.workers()[&7]["taints"], json!(["zone=c"]));
}

#[test]
fn a_policy_uploaded_and_activated_on_one_replica_is_active_on_the_others() {
    let nats = Nats::start();
    let (a, b, c) = (
        replica(&nats, "policies"),
        replica(&nats, "policies"),
        replica(&nats, "policies"),
    );
    a.put_worker(1, &json!({}));
    within(Duration::from_secs(1), "worker 1 on C", || {
        c.workers().contains_key(&1)
    });
    let r = upload(
        &b,
        "tuned",
        "?activate=true&config=%7B%22work_weight%22%3A2%7D",
    );
    r.expect(201);
    let version = r.body()["version"].clone();
    let mut waited = Vec::new();
    for s in [&a, &c] {
        waited.push(within(
            Duration::from_secs(1),
            "tuned active on another replica",
            || active(s) == (json!("tuned"), version.clone()),
        ));
        let detail = s.get("/v1/policies/tuned").body().clone();
        assert!(
            detail.to_string().contains("work_weight"),
            "the configuration came along: {detail}"
        );
        let d = s.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
        assert_eq!(d["policy"]["name"], "tuned", "{d}");
    }
    eprintln!("activation seen elsewhere after {waited:?}");
    // A rollback through C (back to the embedded default) reaches A and B.
    c.raw("POST", "/v1/policies/rollback", &[], b"").expect(200);
    for s in [&a, &b] {
        within(
            Duration::from_secs(1),
            "the rollback on another replica",
            || active(s).0 == "default",
        );
    }
}

#[test]
fn stopping_every_replica_and_starting_one_restores_workers_and_the_active_policy() {
    let nats = Nats::start();
    let mut a = replica(&nats, "restart");
    let mut b = replica(&nats, "restart");
    a.put_worker(3, &json!({"role": "prefill", "topology": {"zone": "x"}}));
    a.put_worker(4, &json!({}));
    upload(&b, "kept", "?activate=true").expect(201);
    within(Duration::from_secs(1), "kept active on A", || {
        active(&a).0 == "kept"
    });
    let before = a.workers();
    let before_active = active(&a);
    assert_eq!(a.terminate(Duration::from_secs(20)).code(), Some(0));
    assert_eq!(b.terminate(Duration::from_secs(20)).code(), Some(0));

    let c = replica(&nats, "restart");
    // Loaded before it listened: no waiting.
    let after = c.workers();
    assert_eq!(after.len(), 2, "{after:?}");
    for (id, w) in &before {
        assert_eq!(after[id]["role"], w["role"]);
        assert_eq!(after[id]["topology"], w["topology"]);
    }
    assert_eq!(active(&c), before_active);
    let d = c.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
    assert_eq!(d["policy"]["name"], "kept", "{d}");
    // Another cluster name on the same NATS shares nothing.
    let other = replica(&nats, "elsewhere");
    assert!(other.workers().is_empty());
    assert_eq!(active(&other).0, "default");
}
