//! The built-in policies: `default` (latency-priced) and `dynamo` (Dynamo 1.6's cost), both
//! embedded in the binary, both registered at start, named by `serve --policy NAME` and activated
//! by name through the API.

use serde_json::{json, Value};

use crate::support::{local_hashes, stored_event, Server, BASE_SEED};

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| salt.wrapping_mul(1_000_003).wrapping_add(i * 7 + 1))
        .collect()
}

/// Three workers where Dynamo's cost and the latency estimate disagree: worker 1 caches 48 of
/// the prompt's 64 blocks but has 1,600 prompt tokens booked ahead; worker 2 has two long
/// requests booked (many KV blocks, little queued prefill once they complete); worker 3 is idle.
/// Returns the prompt.
fn fixed_case(s: &Server) -> Vec<u32> {
    s.put_worker(1, &json!({"taints": ["zone=a"]}));
    s.put_worker(2, &json!({"taints": ["zone=b"]}));
    s.put_worker(3, &json!({}));
    let p = tokens(1024, 7);
    let r = s.post(
        "/v1/events",
        &json!([stored_event(
            1,
            0,
            1,
            &local_hashes(&p, 16, BASE_SEED)[..48]
        )]),
    );
    r.expect(200);
    for (id, n, worker) in [("a", 800, 1), ("b", 800, 1), ("c", 3000, 2), ("d", 3000, 2)] {
        s.route_ok(&json!({"request_id": id, "tokens": tokens(n, n as u32 + 1),
                           "pinned_worker": {"worker_id": worker}}));
    }
    // Worker 2's prompts are computed: their KV blocks stay, their prefill work is done.
    for id in ["c", "d"] {
        s.post(&format!("/v1/requests/{id}/prefill_complete"), &json!({}))
            .expect(200);
    }
    p
}

/// `(worker_id, base_cost, cost)` of every candidate of an explained, ask-only decision.
fn explained(s: &Server, body: Value) -> (Value, Vec<(u64, f64, f64)>) {
    let d = s.route_ok(&body);
    let rows = d["candidates"]
        .as_array()
        .expect("explain")
        .iter()
        .map(|c| {
            (
                c["worker_id"].as_u64().unwrap(),
                c["base_cost"].as_f64().unwrap(),
                c["cost"].as_f64().unwrap(),
            )
        })
        .collect();
    (d, rows)
}

fn listed_names(s: &Server) -> (Value, Vec<String>) {
    let list = s.get("/v1/policies");
    list.expect(200);
    let body = list.body().clone();
    let mut names: Vec<String> = body["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    (body["active"].clone(), names)
}

#[test]
fn serve_policy_dynamo_routes_as_the_native_cost_and_both_built_ins_are_listed() {
    let s = Server::start(&["--policy", "dynamo"]);
    let (active, names) = listed_names(&s);
    assert_eq!(active, "dynamo");
    assert_eq!(names, ["default", "dynamo"]);
    let p = fixed_case(&s);

    // No preference: the cost of every candidate is the native one, bit for bit.
    let (d, rows) = explained(&s, json!({"tokens": p, "book": false, "explain": true}));
    assert_eq!(d["policy"]["name"], "dynamo", "{d}");
    assert_eq!(
        (&d["answer"], &d["fallback"]),
        (&json!("costs"), &json!(false))
    );
    assert_eq!(rows.len(), 3, "{d}");
    for &(w, base, cost) in &rows {
        assert_eq!(cost.to_bits(), base.to_bits(), "worker {w}: {d}");
    }
    // Dynamo's pick: the lowest native cost (worker 1, the cache, despite its queue).
    let lowest = rows.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_eq!((d["worker_id"].as_u64(), lowest), (Some(1), 1), "{d}");

    // Preferences: base cost × exp(-tanh(s)), no floor.
    let (d, rows) = explained(
        &s,
        json!({"tokens": p, "book": false, "explain": true,
               "routing_constraints": {"preferred_taints": {"zone=b": 0.5, "zone=a": -0.25}}}),
    );
    for &(w, base, cost) in &rows {
        let s_w: f64 = match w {
            1 => -0.25,
            2 => 0.5,
            _ => 0.0,
        };
        let want = if s_w == 0.0 {
            base
        } else {
            base * (-s_w.tanh()).exp()
        };
        assert!(
            (cost - want).abs() <= want.abs() * f64::EPSILON,
            "worker {w}: {cost} vs {want}: {d}"
        );
    }

    // Activate the default by name: it prices the same candidates in milliseconds and decides
    // differently on this case (worker 1's queue ahead costs more than its cache saves).
    s.post("/v1/policies/default/activate", &json!({}))
        .expect(200);
    let (d, rows) = explained(&s, json!({"tokens": p, "book": false, "explain": true}));
    assert_eq!(d["policy"]["name"], "default", "{d}");
    assert!(rows.iter().any(|r| r.2 != r.1), "latency-priced: {d}");
    assert_ne!(d["worker_id"], 1, "{d}");
    // And back to Dynamo's cost by name.
    s.post("/v1/policies/dynamo/activate", &json!({}))
        .expect(200);
    let d = s.route_ok(&json!({"tokens": p, "book": false}));
    assert_eq!(
        (&d["policy"]["name"], &d["worker_id"]),
        (&json!("dynamo"), &json!(1))
    );
}

#[test]
fn the_default_serves_with_dynamo_beside_it_and_built_in_names_are_checked() {
    let s = Server::start(&[]);
    let (active, names) = listed_names(&s);
    assert_eq!(active, "default");
    assert_eq!(names, ["default", "dynamo"]);
    let d = s.get("/v1/policies/dynamo");
    d.expect(200);
    // `--policy default` is the same start, configured through --policy-config.
    drop(s);
    let s = Server::start(&[
        "--policy",
        "default",
        "--policy-config",
        r#"{"work_weight": 2}"#,
    ]);
    let (active, names) = listed_names(&s);
    assert_eq!(
        (active, names),
        (
            json!("default"),
            vec!["default".to_string(), "dynamo".into()]
        )
    );
    let detail = s.get("/v1/policies/default").body().to_string();
    assert!(detail.contains("work_weight"), "{detail}");
    drop(s);
    // A configuration the built-in refuses, and a name a built-in keeps, stop the start.
    for (args, needle) in [
        (
            vec![
                "--policy",
                "dynamo",
                "--policy-config",
                r#"{"work_weight": 2}"#,
            ],
            "work_weight",
        ),
        (
            vec!["--policy", "dynamo", "--policy-name", "mine"],
            "built-in",
        ),
    ] {
        let out = crate::support::command(
            &[&["serve", "--listen", "127.0.0.1:0"][..], &args[..]].concat(),
            &[],
        )
        .output()
        .expect("run kvroute");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {text}");
        assert!(text.contains(needle), "{args:?}: {text}");
    }
}
