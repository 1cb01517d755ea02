//! Sessions as a host fact (SPEC §12): the real binary binds a session to the worker of its first
//! turn, keeps it there in `hard` mode while load would spread it, moves it (counting why) when
//! that worker drains, keeps the binding across a policy swap, drops it after the idle TTL, reads
//! the session from the agent harnesses' headers, and shares it between cluster replicas so that
//! it outlives the replica that made it.

use crate::cluster::within;
use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::nats::Nats;
use support::{metric, temp_file, Server};

fn tokens(n: u32, salt: u32) -> Vec<u32> {
    (0..n)
        .map(|i| salt.wrapping_mul(1_000_003).wrapping_add(i * 7 + 1))
        .collect()
}

/// A server with `[sessions]` as given and workers 1 to 3.
fn server(sessions: &str, extra: &[&str]) -> Server {
    let cfg = temp_file("sessions.toml", &format!("[sessions]\n{sessions}\n"));
    let mut args = vec!["--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let s = Server::start(&args);
    for w in 1..=3 {
        s.put_worker(w, &json!({"max_num_batched_tokens": 8192}));
    }
    s
}

/// A booked turn of `session` (distinct prompt per `salt`: only load and the binding steer);
/// returns the worker.
#[track_caller]
fn turn(s: &Server, session: &str, salt: u32) -> u64 {
    let d = s.route_ok(&json!({"tokens": tokens(256, salt), "session_id": session}));
    d["worker_id"].as_u64().unwrap()
}

/// Uploads a policy component under `name` and activates it.
#[track_caller]
fn upload(s: &Server, name: &str, wasm: &[u8]) {
    s.raw(
        "PUT",
        &format!("/v1/policies/{name}?activate=true"),
        &[("content-type", "application/wasm")],
        wasm,
    )
    .expect(201);
}

#[track_caller]
fn session(s: &Server, id: &str) -> Value {
    let r = s.get(&format!("/v1/sessions/{id}"));
    r.expect(200);
    r.body().clone()
}

fn affinity(s: &Server, outcome: &str, reason: &str) -> f64 {
    metric(
        &s.metrics(),
        &format!("kvroute_session_affinity_total{{outcome=\"{outcome}\",reason=\"{reason}\"}}"),
    )
    .unwrap_or_else(|| panic!("no {outcome}/{reason} series"))
}

#[test]
fn hard_mode_keeps_a_session_s_turns_on_one_worker_and_moves_it_off_a_draining_one() {
    let s = server("mode = \"hard\"", &[]);
    let first = turn(&s, "agent-1", 0);
    // Every turn stays booked, so load alone would spread them over the three workers.
    for i in 1..6 {
        assert_eq!(turn(&s, "agent-1", i), first, "turn {i}");
    }
    let v = session(&s, "agent-1");
    assert_eq!(
        (v["worker_id"].as_u64(), v["dp_rank"].as_u64()),
        (Some(first), Some(0))
    );
    assert_eq!(v["turns"], 6);
    assert_eq!(affinity(&s, "kept", ""), 5.0);
    // Another session goes to a less loaded worker.
    assert_ne!(turn(&s, "agent-2", 50), first);
    // The bound worker drains: the session moves, and the reason is counted.
    s.patch(&format!("/v1/workers/{first}"), &json!({"draining": true}))
        .expect(200);
    let moved = turn(&s, "agent-1", 6);
    assert_ne!(moved, first);
    assert_eq!(affinity(&s, "broken", "draining"), 1.0);
    let v = session(&s, "agent-1");
    assert_eq!(
        (v["worker_id"].as_u64(), v["moves"].as_u64()),
        (Some(moved), Some(1))
    );
    // It stays on its new worker.
    assert_eq!(turn(&s, "agent-1", 7), moved);
    let m = s.metrics();
    assert_eq!(metric(&m, "kvroute_sessions_live"), Some(2.0));
    assert_eq!(
        metric(&m, "kvroute_sessions_total{event=\"bound\"}"),
        Some(2.0)
    );
}

#[test]
fn a_binding_survives_a_policy_swap() {
    let s = server("mode = \"hard\"", &[]);
    let first = turn(&s, "swap", 0);
    turn(&s, "swap", 1);
    // Swap the active policy (a new policy, fresh instances): the binding is host state, not the
    // policy's.
    upload(&s, "swapped", kvroute_server::serve::DEFAULT_POLICY_WASM);
    assert_eq!(s.get("/readyz").body()["policy"]["name"], "swapped");
    for i in 2..5 {
        assert_eq!(turn(&s, "swap", i), first, "turn {i} after the swap");
    }
    assert_eq!(session(&s, "swap")["turns"], 5);
    assert_eq!(affinity(&s, "broken", "policy"), 0.0);
}

#[test]
fn a_binding_expires_after_the_idle_ttl() {
    let s = server("mode = \"hard\"\nttl_ms = 300", &[]);
    let first = turn(&s, "brief", 0);
    assert_eq!(turn(&s, "brief", 1), first);
    // Within the TTL it is listed; idle past it, it is gone.
    let list = s.get("/v1/sessions");
    list.expect(200);
    assert_eq!(list.body()["mode"], "hard");
    assert_eq!(list.body()["sessions"][0]["session_id"], "brief");
    std::thread::sleep(Duration::from_millis(400));
    s.get("/v1/sessions/brief")
        .expect_error(404, "unknown_session");
    // The next turn binds afresh, to the least loaded worker (the old one holds two bookings).
    let again = turn(&s, "brief", 2);
    assert_ne!(again, first);
    assert_eq!(session(&s, "brief")["turns"], 1);
    let m = s.metrics();
    assert!(
        metric(&m, "kvroute_sessions_total{event=\"expired\"}").unwrap() >= 1.0,
        "{m}"
    );
    assert_eq!(affinity(&s, "kept", ""), 1.0);
}

#[test]
fn the_session_comes_from_the_agent_headers_and_a_subagent_starts_on_its_parent_s_worker() {
    let s = server("mode = \"hard\"", &[]);
    let route = |headers: &[(&str, &str)], salt: u32| -> u64 {
        let mut h = vec![("content-type", "application/json")];
        h.extend_from_slice(headers);
        let body = serde_json::to_vec(&json!({"tokens": tokens(256, salt)})).unwrap();
        let r = s.raw("POST", "/v1/route", &h, &body);
        r.expect(200);
        r.body()["worker_id"].as_u64().unwrap()
    };
    let parent = route(&[("X-Dynamo-Session-ID", "root")], 0);
    assert_eq!(route(&[("x-session-id", "root")], 1), parent);
    assert_eq!(route(&[("X-SMG-Routing-Key", "root")], 2), parent);
    // kvroute's own header wins over a harness's.
    let other = route(
        &[
            ("x-kvroute-session-id", "mine"),
            ("x-dynamo-session-id", "root"),
        ],
        3,
    );
    assert_ne!(other, parent);
    assert_eq!(session(&s, "root")["turns"], 3);
    // A subagent: new session, parent given. Load would send it elsewhere (the parent's worker
    // holds three bookings); the parent's binding brings it there.
    let child = route(
        &[
            ("X-Dynamo-Session-ID", "root:sub"),
            ("X-Dynamo-Parent-Session-ID", "root"),
        ],
        4,
    );
    assert_eq!(child, parent);
    assert_eq!(session(&s, "root:sub")["parent_session_id"], "root");
    let m = s.metrics();
    assert_eq!(
        metric(&m, "kvroute_sessions_total{event=\"subagent_on_parent\"}"),
        Some(1.0)
    );
    // The body's field is read the same way.
    let d = s.route_ok(&json!({"tokens": tokens(256, 5), "session_id": "root:sub2",
        "parent_session_id": "root"}));
    assert_eq!(d["worker_id"].as_u64(), Some(parent));
}

#[test]
fn bad_session_values_are_a_400_naming_the_field() {
    let s = server("mode = \"soft\"", &[]);
    for (body, field) in [
        (json!({"tokens": [1, 2, 3], "session_id": ""}), "session_id"),
        (
            json!({"tokens": [1, 2, 3], "session_id": "x".repeat(257)}),
            "session_id",
        ),
        (
            json!({"tokens": [1, 2, 3], "session_id": "s", "parent_session_id": "a\tb"}),
            "parent_session_id",
        ),
        (
            json!({"tokens": [1, 2, 3], "parent_session_id": 7}),
            "parent_session_id",
        ),
    ] {
        let r = s.post("/v1/route", &body);
        r.expect_error(400, "invalid_request");
        assert_eq!(r.body()["error"]["field"], field, "{}", r.text);
    }
    for (query, field) in [
        ("?limit=0", "limit"),
        ("?limit=1001", "limit"),
        ("?limit=x", "limit"),
    ] {
        let r = s.get(&format!("/v1/sessions{query}"));
        r.expect_error(400, "invalid_request");
        assert_eq!(r.body()["error"]["field"], field, "{query}: {}", r.text);
    }
    let r = s.get("/v1/sessions?page=2");
    r.expect_error(400, "invalid_request");
    assert!(r.text.contains("page"), "{}", r.text);
    // Paging: two sessions, one a page.
    turn(&s, "a", 0);
    turn(&s, "b", 1);
    let p1 = s.get("/v1/sessions?limit=1");
    assert_eq!(p1.body()["sessions"][0]["session_id"], "a");
    assert_eq!(p1.body()["next_after"], "a");
    let p2 = s.get("/v1/sessions?limit=1&after=a");
    assert_eq!(p2.body()["sessions"][0]["session_id"], "b");
    assert_eq!(p2.body()["next_after"], Value::Null);
}

#[test]
fn a_binding_made_on_one_replica_is_honoured_by_another_and_outlives_it() {
    let nats = Nats::start();
    let cfg = temp_file("sessions.toml", "[sessions]\nmode = \"hard\"\n");
    let replica = || {
        Server::start(&[
            "--config",
            cfg.to_str().unwrap(),
            "--cluster",
            &nats.url(),
            "--cluster-name",
            "sessions",
            "--replica-timeout-ms",
            "1000",
        ])
    };
    let (a, b) = (replica(), replica());
    for w in 1..=3 {
        a.put_worker(w, &json!({"max_num_batched_tokens": 8192}));
    }
    within(Duration::from_secs(2), "the workers on B", || {
        b.workers().len() == 3
    });
    let first = turn(&a, "shared", 0);
    within(Duration::from_secs(2), "the binding on B", || {
        b.get("/v1/sessions/shared").status == 200
    });
    // B honours it although load says otherwise (A's booking counts on B too).
    for i in 1..3 {
        assert_eq!(turn(&b, "shared", i), first, "turn {i} on B");
    }
    // A dies; once B has dropped A's bookings, the binding is still there and still honoured.
    let status = std::process::Command::new("kill")
        .args(["-KILL", &a.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    within(Duration::from_secs(4), "A forgotten by B", || {
        metric(&b.metrics(), "kvroute_cluster_replicas_lost_total") == Some(1.0)
    });
    assert_eq!(session(&b, "shared")["worker_id"].as_u64(), Some(first));
    assert_eq!(turn(&b, "shared", 3), first);
}

#[test]
fn in_soft_mode_the_binding_reaches_a_wasm_policy_as_the_session_bound_column() {
    let s = server("mode = \"soft\"", &[]);
    // The session-affinity example decides by the column alone (it keeps no state).
    upload(
        &s,
        "sticky",
        &support::plugin_bytes("kvroute-plugin-session-affinity"),
    );
    let first = turn(&s, "soft", 0);
    // Later turns: the bound worker holds every booking, yet the policy keeps the session there
    // because the host tells it where the session is bound.
    for i in 1..4 {
        let d = s.route_ok(&json!({"tokens": tokens(256, i), "session_id": "soft",
            "explain": true}));
        assert_eq!(d["worker_id"].as_u64(), Some(first), "turn {i}: {d}");
        assert_eq!(d["answer"], "pick", "{d}");
        for c in d["candidates"].as_array().unwrap() {
            let bound = if c["worker_id"].as_u64() == Some(first) {
                1
            } else {
                0
            };
            assert_eq!(c["session_bound"], bound, "{c}");
        }
    }
    // A subagent of it: its parent's worker is marked 2, and the policy starts it there.
    let d = s.route_ok(&json!({"tokens": tokens(256, 9), "session_id": "soft:sub",
        "parent_session_id": "soft", "explain": true}));
    assert_eq!(d["worker_id"].as_u64(), Some(first), "{d}");
    let marked: Vec<_> = d["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["session_bound"] != 0)
        .map(|c| {
            (
                c["worker_id"].as_u64().unwrap(),
                c["session_bound"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(marked, vec![(first, 2)]);
    // Under the default policy (a modest credit for the binding), the bound worker's four
    // bookings outweigh it: the next turn goes to an idle worker, counted as the policy's call.
    upload(&s, "plain", kvroute_server::serve::DEFAULT_POLICY_WASM);
    assert_ne!(turn(&s, "soft", 10), first);
    assert_eq!(affinity(&s, "broken", "policy"), 1.0);
    assert_eq!(affinity(&s, "kept", ""), 3.0);
}

#[test]
fn bad_session_settings_stop_the_start_naming_the_field() {
    for (text, needle) in [
        ("ttl_ms = 0", "sessions.ttl_ms"),
        ("max_sessions = 0", "sessions.max_sessions"),
        ("mode = \"sticky\"", "sticky"),
        ("tll_ms = 5", "tll_ms"),
    ] {
        let cfg = temp_file("bad-sessions.toml", &format!("[sessions]\n{text}\n"));
        let (status, _, stderr) = support::run_to_exit(
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--config",
                cfg.to_str().unwrap(),
            ],
            &[],
            Duration::from_secs(30),
        );
        assert!(!status.success(), "{text}: started");
        assert!(stderr.contains(needle), "{text}: {stderr}");
    }
}

/// `[sessions] infer = "prefix"`: keyless turns of a conversation, each holding the whole previous
/// prompt, are one inferred session held on one worker while load would spread them; another
/// conversation is another session; the metrics count both; a config asking for inference with
/// sessions off is refused naming the field.
#[test]
fn keyless_turns_are_one_inferred_session_when_inference_is_on() {
    let s = server("mode = \"hard\"\ninfer = \"prefix\"", &[]);
    let conversation = |salt: u32, turn: u32| tokens(256 * (turn + 1), salt);
    let route = |t: Vec<u32>| {
        s.route_ok(&json!({"tokens": t}))["worker_id"]
            .as_u64()
            .unwrap()
    };
    let first = route(conversation(1, 0));
    for k in 1..5 {
        assert_eq!(route(conversation(1, k)), first, "turn {k}");
    }
    let list = s.get("/v1/sessions");
    list.expect(200);
    let sessions = list.body()["sessions"].as_array().unwrap().clone();
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    let id = sessions[0]["session_id"].as_str().unwrap().to_string();
    assert!(id.starts_with("~lineage:"), "{id}");
    assert_eq!(sessions[0]["turns"], 5);
    assert_ne!(
        route(conversation(2, 0)),
        first,
        "another conversation, by load"
    );
    let m = s.metrics();
    assert_eq!(
        metric(&m, "kvroute_sessions_total{event=\"inferred_started\"}"),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "kvroute_sessions_total{event=\"inferred_continued\"}"),
        Some(4.0)
    );
    assert_eq!(affinity(&s, "kept", ""), 4.0);

    let cfg = temp_file(
        "sessions-bad.toml",
        "[sessions]\nmode = \"off\"\ninfer = \"prefix\"\n",
    );
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("sessions.infer"), "{err}");
}
