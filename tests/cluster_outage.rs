//! `kvroute serve --cluster` when NATS goes away and comes back, and when two replicas write one
//! key at once: routing never waits on NATS, writes that must persist answer 503
//! `cluster_unavailable` at once and change nothing, a restarted nats-server (same port and
//! store) or a replica cut off and reconnected is picked up without restarting any replica, and
//! concurrent writes end with every replica holding what the bucket holds (last writer wins).

use crate::cluster::{active, replica, upload, within};
use crate::support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::nats::Nats;
use support::Server;

/// `kvroute_cluster_nats_connected` of a replica.
fn connected(s: &Server) -> Option<f64> {
    support::metric(&s.metrics(), "kvroute_cluster_nats_connected")
}

fn taints(s: &Server, id: u64) -> Value {
    s.workers()
        .get(&id)
        .map(|w| w["taints"].clone())
        .unwrap_or(Value::Null)
}

/// Routes against every replica until `stop`, counting the routes that succeeded and keeping
/// every failure (status and body, or transport error).
fn route_continuously(
    replicas: &[&Server],
    stop: &AtomicBool,
    routed: &AtomicU64,
    failures: &Mutex<Vec<String>>,
) {
    let body = serde_json::to_vec(&json!({"tokens": vec![1u32; 64], "book": false})).unwrap();
    while !stop.load(Relaxed) {
        for s in replicas {
            match s.try_raw(
                "POST",
                "/v1/route",
                &[("content-type", "application/json")],
                &body,
            ) {
                Ok(r) if r.status == 200 => {
                    routed.fetch_add(1, Relaxed);
                }
                Ok(r) => failures.lock().unwrap().push(format!("{}: {r}", s.addr)),
                Err(e) => failures.lock().unwrap().push(format!("{}: {e}", s.addr)),
            }
        }
    }
}

#[test]
fn nats_killed_mid_traffic_routing_goes_on_writes_answer_503_and_a_restart_is_picked_up() {
    let mut nats = Nats::start();
    let (a, b, c) = (
        replica(&nats, "outage"),
        replica(&nats, "outage"),
        replica(&nats, "outage"),
    );
    a.put_worker(1, &json!({"taints": ["zone=a"]}));
    for s in [&b, &c] {
        within(
            Duration::from_secs(1),
            "worker 1 on another replica",
            || s.workers().contains_key(&1),
        );
    }
    let (stop, routed, failures) = (
        AtomicBool::new(false),
        AtomicU64::new(0),
        Mutex::new(Vec::new()),
    );
    let mut during_outage = 0;
    std::thread::scope(|scope| {
        scope.spawn(|| route_continuously(&[&a, &b, &c], &stop, &routed, &failures));
        std::thread::sleep(Duration::from_millis(300));

        nats.kill();
        let at_kill = routed.load(Relaxed);
        for s in [&a, &b, &c] {
            within(Duration::from_secs(5), "the replica sees NATS gone", || {
                connected(s) == Some(0.0)
            });
        }
        // A registration answers 503 cluster_unavailable at once and is not applied.
        let t = Instant::now();
        let r = a.put("/v1/workers/2", &json!({"taints": ["zone=lost"]}));
        let took = t.elapsed();
        r.expect_error(503, "cluster_unavailable");
        assert_eq!(r.header("retry-after"), Some("1"), "{r}");
        assert!(took < Duration::from_secs(1), "the 503 took {took:?}");
        assert!(!a.workers().contains_key(&2), "{:?}", a.workers());
        // So do a patch and a policy upload, on other replicas.
        b.patch("/v1/workers/1", &json!({"taints": ["zone=lost"]}))
            .expect_error(503, "cluster_unavailable");
        assert_eq!(taints(&b, 1), json!(["zone=a"]));
        upload(&c, "lost", "?activate=true").expect_error(503, "cluster_unavailable");
        assert_eq!(active(&c).0, "default");
        c.get("/v1/policies/lost").expect(404);
        std::thread::sleep(Duration::from_millis(300));
        during_outage = routed.load(Relaxed) - at_kill;

        nats.restart();
        for s in [&a, &b, &c] {
            within(Duration::from_secs(15), "the replica reconnects", || {
                connected(s) == Some(1.0)
            });
        }
        // A registration on A right after the restart routes on B and C within a second.
        a.put_worker(3, &json!({"taints": ["zone=new"]}));
        let mut waited = Vec::new();
        for s in [&b, &c] {
            waited.push(within(
                Duration::from_secs(1),
                "worker 3 on another replica after the restart",
                || s.workers().contains_key(&3),
            ));
            let d = s.route_ok(&json!({"tokens": vec![2u32; 32], "book": false,
                                       "routing_constraints": {"required_taints": ["zone=new"]}}));
            assert_eq!(d["worker_id"], 3, "{d}");
        }
        eprintln!("registration after the restart seen elsewhere after {waited:?}");
        // And a change made on A is seen on B and C.
        a.patch("/v1/workers/1", &json!({"taints": ["zone=after"]}))
            .expect(200);
        for s in [&b, &c] {
            within(
                Duration::from_secs(1),
                "the patch after the restart",
                || taints(s, 1) == json!(["zone=after"]),
            );
        }
        stop.store(true, Relaxed);
    });
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "routes failed: {failures:?}");
    assert!(
        during_outage > 0,
        "no route was made while NATS was down ({} in all)",
        routed.load(Relaxed)
    );
    // Nothing refused during the outage reached the cluster.
    for s in [&a, &b, &c] {
        assert!(!s.workers().contains_key(&2));
        assert_eq!(active(s).0, "default");
    }
    eprintln!(
        "{} routes, {during_outage} while NATS was down, none failed",
        routed.load(Relaxed)
    );
}

/// A TCP relay between one replica and nats-server that can cut the replica off (its
/// connections closed, new ones refused) and let it back.
struct Relay {
    port: u16,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(upstream: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let port = listener.local_addr().unwrap().port();
        let (open, conns) = (
            Arc::new(AtomicBool::new(true)),
            Arc::new(Mutex::new(Vec::new())),
        );
        let (o, cs) = (open.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if !o.load(Relaxed) {
                    continue; // dropped: closed at once
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let mut all = cs.lock().unwrap();
                all.push(client.try_clone().unwrap());
                all.push(server.try_clone().unwrap());
                drop(all);
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        Relay { port, open, conns }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn cut(&self) {
        self.open.store(false, Relaxed);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn mend(&self) {
        self.open.store(true, Relaxed);
    }
}

/// Copies `from` to `to` on a thread of its own until either side closes.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

#[test]
fn a_replica_cut_off_from_nats_takes_the_changes_made_meanwhile_when_it_returns() {
    let nats = Nats::start();
    let relay = Relay::start(nats.port);
    let (a, b) = (replica(&nats, "cutoff"), replica(&nats, "cutoff"));
    let c = Server::start(&["--cluster", &relay.url(), "--cluster-name", "cutoff"]);
    a.put_worker(1, &json!({"taints": ["zone=a"]}));
    a.put_worker(2, &json!({}));
    within(Duration::from_secs(1), "workers 1 and 2 on C", || {
        c.workers().len() == 2
    });

    relay.cut();
    within(Duration::from_secs(5), "C sees NATS gone", || {
        connected(&c) == Some(0.0)
    });
    assert_eq!(connected(&a), Some(1.0));
    // The others go on changing the shared state; C serves its local view and refuses writes.
    a.patch("/v1/workers/1", &json!({"taints": ["zone=x"]}))
        .expect(200);
    b.delete("/v1/workers/2").expect(204);
    b.put_worker(4, &json!({"taints": ["zone=four"]}));
    upload(&a, "meanwhile", "?activate=true").expect(201);
    c.put("/v1/workers/5", &json!({}))
        .expect_error(503, "cluster_unavailable");
    assert_eq!(c.workers().len(), 2);
    assert_eq!(taints(&c, 1), json!(["zone=a"]));
    c.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
    std::thread::sleep(Duration::from_millis(500));

    relay.mend();
    within(Duration::from_secs(10), "C reconnects", || {
        connected(&c) == Some(1.0)
    });
    let expected = a.workers();
    let ids = |w: &std::collections::HashMap<u64, Value>| {
        let mut v: Vec<u64> = w.keys().copied().collect();
        v.sort();
        v
    };
    assert_eq!(ids(&expected), vec![1, 4]);
    let waited = within(Duration::from_secs(1), "C takes the changes", || {
        let now = c.workers();
        ids(&now) == ids(&expected) && now[&1]["taints"] == json!(["zone=x"])
    });
    eprintln!("C reconciled {waited:?} after it reconnected");
    within(
        Duration::from_secs(1),
        "the policy activated meanwhile on C",
        || active(&c).0 == "meanwhile",
    );
    let d = c.route_ok(&json!({"tokens": vec![3u32; 32], "book": false,
                               "routing_constraints": {"required_taints": ["zone=four"]}}));
    assert_eq!(d["worker_id"], 4, "{d}");
    // And C writes again, seen by the others.
    c.put_worker(6, &json!({}));
    within(Duration::from_secs(1), "C's registration on A", || {
        a.workers().contains_key(&6)
    });
}

#[test]
fn two_replicas_patching_one_worker_at_once_converge_on_what_the_bucket_holds() {
    const N: usize = 30;
    let nats = Nats::start();
    let (a, b, c) = (
        replica(&nats, "lww"),
        replica(&nats, "lww"),
        replica(&nats, "lww"),
    );
    a.put_worker(9, &json!({"taints": ["start"]}));
    for s in [&b, &c] {
        within(
            Duration::from_secs(1),
            "worker 9 on another replica",
            || s.workers().contains_key(&9),
        );
    }
    // Each round, A and B patch worker 9 at the same moment; then every replica must hold the
    // same one of the two (a replica applying the other's older write after its own newer one
    // would keep it for good).
    let mut waited = Duration::ZERO;
    let mut last = Value::Null;
    for i in 0..N {
        let start = std::sync::Barrier::new(2);
        std::thread::scope(|scope| {
            for (s, tag) in [(&a, "a"), (&b, "b")] {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    s.patch("/v1/workers/9", &json!({"taints": [format!("{tag}{i}")]}))
                        .expect(200);
                });
            }
        });
        waited = waited.max(within(
            Duration::from_secs(2),
            &format!("round {i}: every replica holds one value"),
            || {
                let t = taints(&a, 9);
                taints(&b, 9) == t && taints(&c, 9) == t
            },
        ));
        last = taints(&a, 9);
        let ends = [json!([format!("a{i}")]), json!([format!("b{i}")])];
        assert!(ends.contains(&last), "round {i}: {last}");
    }
    // Still equal a moment later (no late stale change undoes it).
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(taints(&a, 9), last);
    assert_eq!(taints(&b, 9), last);
    assert_eq!(taints(&c, 9), last);
    // ...and what the bucket holds: a replica started now loads it from there.
    let d = replica(&nats, "lww");
    assert_eq!(taints(&d, 9), last);
    eprintln!("{N} rounds converged, at worst {waited:?} after the two patches; last {last}");
}
