//! The built-in policies: `default` (latency-priced) and `dynamo` (Dynamo 1.6's cost), both
//! embedded in the binary, both registered at start, named by `serve --policy NAME` and activated
//! by name through the API.

use serde_json::{json, Value};

use crate::replay::{kvroute, numbers, traces_dir};
use crate::support::{self, Server};

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| salt.wrapping_mul(1_000_003).wrapping_add(i * 7 + 1))
        .collect()
}

/// Two workers where Dynamo's cost and the latency estimate disagree: worker 1 has 2,048 prompt
/// tokens queued (not yet prefilled), worker 2 holds three computed 2,000-token prompts (375 KV
/// blocks, nothing queued). In blocks, worker 1 is cheaper (384 vs 503); in milliseconds, queued
/// prefill costs far more than decoding blocks, so worker 2 is. Returns the prompt (64 blocks).
fn fixed_case(s: &Server) -> Vec<u32> {
    s.put_worker(1, &json!({"taints": ["zone=a"]}));
    s.put_worker(2, &json!({"taints": ["zone=b"]}));
    let booked = [
        ("a", 2048, 1),
        ("b", 2000, 2),
        ("c", 2000, 2),
        ("d", 2000, 2),
    ];
    for (id, n, worker) in booked {
        s.route_ok(
            &json!({"request_id": id, "tokens": tokens(n, n as u32 + u32::from(id.as_bytes()[0])),
                           "pinned_worker": {"worker_id": worker}}),
        );
    }
    // Worker 2's prompts are computed: their KV blocks stay, their prefill work is done.
    for id in ["b", "c", "d"] {
        s.post(&format!("/v1/requests/{id}/prefill_complete"), &json!({}))
            .expect(200);
    }
    tokens(1024, 7)
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
    assert_eq!(rows.len(), 2, "{d}");
    for &(w, base, cost) in &rows {
        assert_eq!(cost.to_bits(), base.to_bits(), "worker {w}: {d}");
    }
    // Dynamo's pick: the lowest native cost (worker 1, the queue, fewer blocks).
    let lowest = rows.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
    assert_eq!((d["worker_id"].as_u64(), lowest), (Some(1), 1), "{d}");

    // Preferences: base cost × exp(-tanh(s)), no floor.
    let (d, rows) = explained(
        &s,
        json!({"tokens": p, "book": false, "explain": true,
               "routing_constraints": {"preferred_taints": {"zone=b": 0.5, "zone=a": -0.25}}}),
    );
    for &(w, base, cost) in &rows {
        let s_w: f64 = if w == 1 { -0.25 } else { 0.5 };
        let want = base * (-s_w.tanh()).exp();
        assert!(
            (cost - want).abs() <= want.abs() * f64::EPSILON,
            "worker {w}: {cost} vs {want}: {d}"
        );
    }

    // Activate the default by name: it prices the same candidates in milliseconds and decides
    // differently on this case (worker 1's queued prefill costs more than worker 2's blocks).
    s.post("/v1/policies/default/activate", &json!({}))
        .expect(200);
    let (d, rows) = explained(&s, json!({"tokens": p, "book": false, "explain": true}));
    assert_eq!(d["policy"]["name"], "default", "{d}");
    assert!(rows.iter().any(|r| r.2 != r.1), "latency-priced: {d}");
    assert_eq!(d["worker_id"], 2, "{d}");
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

#[test]
fn dynamo_runs_natively_exactly_as_its_embedded_component() {
    // `replay --policy dynamo` uses the router's native cost; `serve` runs the embedded `dynamo`
    // component. Same costs bit for bit, same random draws: the same replay, request for request.
    let wasm = support::build_plugin("kvroute-plugin-dynamo");
    let out = support::temp_dir("replay-dynamo");
    let trace = traces_dir().join("synthetic_trace.jsonl");
    let o = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "4",
        "--policy",
        "dynamo",
        "--policy",
        wasm.to_str().unwrap(),
        "--policy",
        "default",
        "--max-requests",
        "600",
        "--no-plots",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = numbers(&out);
    let ps = v["policies"].as_array().expect("policies");
    let names: Vec<&str> = ps.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["dynamo", "kvroute_plugin_dynamo", "default"]);
    for p in ps {
        assert_eq!(p["completed"], 600, "{}", p["name"]);
        assert_eq!(p["policy_fallbacks"], 0, "{}", p["name"]);
    }
    for key in ["requests_per_worker", "ttft_ms", "itl_ms", "token_hit_rate"] {
        assert_eq!(ps[0][key], ps[1][key], "{key}");
    }
}
