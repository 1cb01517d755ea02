//! End to end: per-tenant budgets (429 with `Retry-After`, never a silent drop, while other
//! tenants are served) through `POST /v1/route` and the OpenAI-compatible proxy, and the
//! `[fairness]` configuration's errors naming the key, and `GET /v1/tenants` (docs/SPEC.md §9,
//! "Fairness", "Budgets"; API.md §3.13a).

use std::time::Duration;

use serde_json::json;

use crate::proxy::Fleet;
use crate::support::{self, Server};

fn route(s: &Server, tenant: Option<&str>) -> support::Resp {
    let mut body = json!({"tokens": (0..40).collect::<Vec<u32>>(), "expected_output_tokens": 10});
    if let Some(t) = tenant {
        body["tenant"] = json!(t);
    }
    s.post("/v1/route", &body)
}

/// The seconds of a 429's `Retry-After`, checked to lie within the budget's window.
fn retry_after(r: &support::Resp) -> u64 {
    let secs: u64 = r
        .header("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After: {:?}", r.body()))
        .parse()
        .unwrap();
    assert!((1..=60).contains(&secs), "Retry-After {secs}");
    secs
}

#[test]
fn a_tenant_over_its_budget_gets_429_with_retry_after_while_others_are_served() {
    let cfg = support::temp_file(
        "budgets.toml",
        "[fairness]\nqueue = true\n\n[fairness.tenants.acme]\nrequests_per_minute = 2\nweight = 2.0\n\n\
         [fairness.tenants.bulk]\ntokens_per_minute = 100\n",
    );
    let s = Server::start(&["--config", cfg.to_str().unwrap()]);
    s.put_worker(1, &json!({}));
    // two requests fit acme's budget
    for _ in 0..2 {
        route(&s, Some("acme")).expect(200);
    }
    let r = route(&s, Some("acme"));
    r.expect_error(429, "budget_exceeded");
    support::assert_error_shape(&r);
    assert_eq!(r.field(), Some("tenant"));
    let msg = r.body()["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("fairness.tenants.acme.requests_per_minute = 2"),
        "{msg}"
    );
    let secs = retry_after(&r);
    assert!(msg.contains(&format!("retry in {secs} s")), "{msg}");
    // others are served meanwhile: another tenant, no tenant at all, and acme asking only
    for _ in 0..5 {
        route(&s, Some("other")).expect(200);
        route(&s, None).expect(200);
    }
    s.post(
        "/v1/route",
        &json!({"tokens": [1, 2, 3], "tenant": "acme", "book": false}),
    )
    .expect(200);
    // a token budget: 40 prompt + 10 expected output tokens per request, 100 per minute
    route(&s, Some("bulk")).expect(200);
    route(&s, Some("bulk")).expect(200);
    let r = route(&s, Some("bulk"));
    r.expect_error(429, "budget_exceeded");
    retry_after(&r);
    assert!(r.body()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tokens_per_minute"));
    // counted, by tenant and budget, and as a route error
    let m = s.metrics();
    assert_eq!(
        support::metric(
            &m,
            "kvroute_budget_refusals_total{budget=\"requests_per_minute\",tenant=\"acme\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        support::metric(
            &m,
            "kvroute_budget_refusals_total{budget=\"tokens_per_minute\",tenant=\"bulk\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        support::metric(&m, "kvroute_route_errors_total{code=\"budget_exceeded\"}"),
        Some(2.0)
    );
    // a tenant that is not a valid name is a 400 naming the field
    let r = s.post("/v1/route", &json!({"tokens": [1], "tenant": ""}));
    r.expect_error(400, "invalid_request");
    assert_eq!(r.field(), Some("tenant"));
    tenants_show_weights_service_and_budgets(&s);
}

/// `GET /v1/tenants` after the test above: configured tenants and served ones in name order, each
/// budget's use counting admitted requests only (not the refusals, not the ask), service charged
/// as prompt tokens to compute plus expected output, and a page at a time.
fn tenants_show_weights_service_and_budgets(s: &Server) {
    let r = s.get("/v1/tenants");
    r.expect(200);
    let v = r.body();
    assert_eq!(v["fair_queue"], true);
    assert!(v["next_after"].is_null());
    let all = v["tenants"].as_array().unwrap();
    let names: Vec<&str> = all.iter().map(|t| t["tenant"].as_str().unwrap()).collect();
    assert_eq!(names, ["acme", "bulk", "default", "other"], "{v}");
    let by = |n: &str| all.iter().find(|t| t["tenant"] == n).unwrap().clone();
    let acme = by("acme");
    assert_eq!(acme["weight"], 2.0);
    assert_eq!(
        acme["budget"],
        json!({"requests_per_minute": 2, "tokens_per_minute": null,
               "used_requests": 2, "used_tokens": 100})
    );
    assert_eq!(
        by("bulk")["budget"],
        json!({"requests_per_minute": null, "tokens_per_minute": 100,
               "used_requests": 2, "used_tokens": 100})
    );
    assert!(by("other")["budget"].is_null());
    assert_eq!(by("other")["weight"], 1.0);
    // a booked request is charged its uncached prompt tokens plus its expected output (the
    // same 40-token prompt: the first costs 50, later ones find its blocks on the worker)
    for (name, booked) in [
        ("acme", 2.0),
        ("bulk", 2.0),
        ("other", 5.0),
        ("default", 5.0),
    ] {
        let a = by(name)["attained_tokens"].as_f64().unwrap();
        assert!(a > 0.0 && a <= booked * 50.0, "{name}: {a}");
        assert_eq!(by(name)["waiting_requests"], 0);
    }
    // exactly: a fresh tenant's requests with the cached tokens each decision reports, decayed
    // over the few seconds since (60 s half-life)
    let mut charged = 0.0;
    for k in 0..3u32 {
        let tokens: Vec<u32> = (0..64).map(|i| 5_000 + 100 * k + i % 2).collect();
        let r = s.post(
            "/v1/route",
            &json!({"tokens": tokens, "tenant": "fresh", "expected_output_tokens": 7}),
        );
        r.expect(200);
        charged += (64 - r.body()["cached_tokens"].as_u64().unwrap() + 7) as f64;
    }
    let fresh = s.get("/v1/tenants/fresh");
    let a = fresh.body()["attained_tokens"].as_f64().unwrap();
    assert!(a <= charged && a > charged * 0.95, "{a} of {charged}");
    assert!(
        charged > 3.0 * 7.0,
        "some prompt tokens were computed: {charged}"
    );
    // pages
    let p1 = s.get("/v1/tenants?limit=3");
    p1.expect(200);
    assert_eq!(p1.body()["tenants"].as_array().unwrap().len(), 3);
    assert_eq!(p1.body()["next_after"], "default");
    let p2 = s.get("/v1/tenants?after=default&limit=3");
    let rest: Vec<&str> = p2.body()["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(rest, ["fresh", "other"]);
    assert!(p2.body()["next_after"].is_null());
    // one tenant, met or not
    let one = s.get("/v1/tenants/acme");
    one.expect(200);
    assert_eq!(one.body()["budget"], acme["budget"]);
    let nobody = s.get("/v1/tenants/nobody");
    nobody.expect(200);
    assert_eq!(
        nobody.body(),
        &json!({"tenant": "nobody", "weight": 1.0, "attained_tokens": 0.0,
                "waiting_requests": 0, "waiting_prompt_tokens": 0, "budget": null})
    );
    // bad input names the field
    for (path, field) in [
        ("/v1/tenants?limit=0", "limit"),
        ("/v1/tenants?limit=1001", "limit"),
        ("/v1/tenants?page=2", "query"),
    ] {
        let r = s.get(path);
        r.expect_error(400, "invalid_request");
        assert_eq!(r.field(), Some(field), "{path}");
    }
    let long = format!("/v1/tenants/{}", "t".repeat(129));
    let r = s.get(&long);
    r.expect_error(400, "invalid_request");
    assert_eq!(r.field(), Some("tenant"));
    // the configured tenants' figures as metrics; the others only here (no label per client name)
    let m = s.metrics();
    for (series, want) in [
        ("kvroute_tenant_waiting_requests{tenant=\"acme\"}", 0.0),
        (
            "kvroute_tenant_budget_used{budget=\"requests_per_minute\",tenant=\"acme\"}",
            2.0,
        ),
        (
            "kvroute_tenant_budget_limit{budget=\"requests_per_minute\",tenant=\"acme\"}",
            2.0,
        ),
        (
            "kvroute_tenant_budget_used{budget=\"tokens_per_minute\",tenant=\"bulk\"}",
            100.0,
        ),
        (
            "kvroute_tenant_budget_limit{budget=\"tokens_per_minute\",tenant=\"bulk\"}",
            100.0,
        ),
    ] {
        assert_eq!(support::metric(&m, series), Some(want), "{series}\n{m}");
    }
    let attained = support::metric(&m, "kvroute_tenant_attained_tokens{tenant=\"acme\"}");
    assert!(attained.is_some_and(|a| a > 0.0), "{m}");
    assert!(
        support::metric(
            &m,
            "kvroute_tenant_budget_used{budget=\"tokens_per_minute\",tenant=\"acme\"}"
        )
        .is_none(),
        "acme has no token budget"
    );
    for name in ["other", "fresh", "default"] {
        assert!(
            !m.contains(&format!("tenant=\"{name}\"}}")),
            "{name} is not configured: {m}"
        );
    }
}

#[test]
fn the_proxy_answers_a_tenant_over_budget_429_in_openai_shape_and_serves_the_others() {
    let fleet = Fleet::start(
        1,
        &["--speed", "50"],
        "\n[fairness.tenants.acme]\nrequests_per_minute = 1\n",
    );
    let chat = |tenant: &str| {
        let body = json!({"model": support::engines::MODEL,
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2});
        fleet.server.raw(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("x-kvroute-tenant", tenant),
            ],
            &serde_json::to_vec(&body).unwrap(),
        )
    };
    chat("acme").expect(200);
    let r = chat("acme");
    assert_eq!(r.status, 429, "{:?}", r.body());
    retry_after(&r);
    let e = &r.body()["error"];
    assert_eq!(e["code"], "budget_exceeded", "{e}");
    assert_eq!(e["param"], "tenant", "{e}");
    assert!(e["type"].is_string(), "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("fairness.tenants.acme.requests_per_minute"),
        "{e}"
    );
    // the other tenants are served
    chat("beta").expect(200);
    chat("gamma").expect(200);
    // the kvroute extension object names the tenant too
    let body = json!({"model": support::engines::MODEL,
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "kvroute": {"tenant": "acme"}});
    let r = fleet.server.raw(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        &serde_json::to_vec(&body).unwrap(),
    );
    assert_eq!(r.status, 429, "{:?}", r.body());
    fleet.no_bookings("refused and served requests");
}

#[test]
fn fairness_configuration_errors_name_the_key() {
    for (toml, key) in [
        (
            "[fairness]\nhalf_life_secs = 0\n",
            "fairness.half_life_secs",
        ),
        (
            "[fairness]\ndefault_weight = -1\n",
            "fairness.default_weight",
        ),
        ("[fairness]\nmax_wait_secs = -1\n", "fairness.max_wait_secs"),
        (
            "[fairness]\nmax_wait_secs = nan\n",
            "fairness.max_wait_secs",
        ),
        (
            "[fairness]\nmax_wait_secs = inf\n",
            "fairness.max_wait_secs",
        ),
        (
            "[fairness.tenants.acme]\nweight = 0\n",
            "fairness.tenants.acme.weight",
        ),
        (
            "[fairness.tenants.acme]\ntokens_per_minute = 0\n",
            "fairness.tenants.acme.tokens_per_minute",
        ),
        ("[fairness]\nqueue = \"yes\"\n", "queue"),
        ("[fairness.tenants.acme]\nburst = 3\n", "burst"),
    ] {
        let cfg = support::temp_file("bad-fairness.toml", toml);
        let (status, _, err) = support::run_to_exit(
            &["serve", "--config", cfg.to_str().unwrap()],
            &[],
            Duration::from_secs(20),
        );
        assert!(!status.success(), "{toml}");
        assert!(err.contains(key), "{toml}: {err}");
    }
}

/// `kvroute replay --workload agents`: closed-loop sessions with subagents, through the router's
/// queue (FCFS and fair) and the peer policies; every request runs, per-session figures are
/// written, and the same seed gives the same workload.
#[test]
fn replay_runs_agent_sessions_through_both_queues_and_the_peer_policies() {
    let dir = support::temp_dir("replay-agents");
    let out = dir.join("agents");
    let o = crate::replay::kvroute(&[
        "replay",
        "--workload",
        "agents",
        "--sessions",
        "12",
        "--session-count",
        "16",
        "--agent-max-context",
        "12000",
        "--workers",
        "2",
        "--worker-speedup",
        "0.5",
        "--busy-threshold",
        "0.1",
        "--queue",
        "fcfs,fair",
        "--policy",
        "llm-d",
        "--policy",
        "sglang",
        "--seed",
        "3",
        "--no-plots",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let names: Vec<&str> = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "llm-d @ 2 q=fcfs",
            "sglang @ 2 q=fcfs",
            "llm-d @ 2 q=fair",
            "sglang @ 2 q=fair"
        ]
    );
    for p in v["policies"].as_array().unwrap() {
        assert_eq!(p["completed"], p["requests"], "{}", p["name"]);
        let s = &p["sessions"];
        let rows = s["per_session"].as_array().unwrap();
        assert!(
            rows.len() > 16,
            "subagents are sessions too: {}",
            rows.len()
        );
        assert_eq!(s["count"], rows.len());
        assert!(rows.iter().any(|r| !r["parent"].is_null()), "a subagent");
        let max = s["max_wait_ms"].as_f64().unwrap();
        for r in rows {
            assert!(r["longest_wait_ms"].as_f64().unwrap() <= max);
            assert!(r["completion_ms"].as_f64().unwrap() > 0.0);
        }
        assert!(p["queued_ms"]["p99"].as_f64().unwrap() >= 0.0);
        // per tenant: every session and every served request counted once, in tenant order,
        // and no tenant's figures outside the run's
        let tenants = s["per_tenant"].as_array().unwrap();
        assert!(tenants.len() >= 2, "{tenants:?}");
        for (t, r) in tenants.iter().enumerate() {
            assert_eq!(r["tenant"], t);
            let n = rows.iter().filter(|s| s["tenant"] == t).count();
            assert_eq!(r["sessions"], n, "tenant {t}");
            if n > 0 {
                let ttft = &r["ttft_ms"];
                assert!(ttft["p50"].as_f64().unwrap() <= ttft["p99"].as_f64().unwrap());
                assert!(ttft["p99"].as_f64().unwrap() <= max, "tenant {t}: {ttft}");
                assert!(r["queued_ms"]["p50"].as_f64().unwrap() >= 0.0);
                // the floor is under the tenant's TTFT at every percentile (to rounding: a
                // request that never waited has its floor as its TTFT, summed another way)
                for q in ["p50", "p99"] {
                    let floor = r["prefill_alone_ms"][q].as_f64().unwrap();
                    assert!(
                        floor > 0.0 && floor <= ttft[q].as_f64().unwrap() * (1.0 + 1e-9),
                        "tenant {t} {q}: {r}"
                    );
                }
            }
        }
        let served: u64 = tenants
            .iter()
            .map(|r| r["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(served, p["completed"].as_u64().unwrap());
        // the tenants' means, weighted by their requests, are the run's
        let weighted = |key: &str| -> f64 {
            tenants
                .iter()
                .filter(|r| r["requests"].as_u64().unwrap() > 0)
                .map(|r| r["requests"].as_f64().unwrap() * r[key]["mean"].as_f64().unwrap())
                .sum::<f64>()
                / served as f64
        };
        for key in ["ttft_ms", "queued_ms", "prefill_alone_ms"] {
            let run = p[key]["mean"].as_f64().unwrap();
            assert!(
                (weighted(key) - run).abs() <= 1e-6 * run.max(1.0),
                "{key}: {run}"
            );
        }
    }
    // every workload run sees the same requests
    let requests: Vec<&serde_json::Value> = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["requests"])
        .collect();
    assert!(requests.windows(2).all(|w| w[0] == w[1]));
    // bad flags name themselves
    let o = crate::replay::kvroute(&[
        "replay",
        "--workload",
        "agents",
        "--workers",
        "2",
        "--queue",
        "lifo",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--queue \"lifo\""));
}

/// `kvroute replay --session-keys inferred`: the clients send no session key and the router
/// infers sessions from prefix lineage. Every top-level session is found once (its subagents,
/// forked from its prompt, continue it), every later turn continues one, and `none` keeps nothing.
#[test]
fn replay_infers_agent_sessions_from_prefix_lineage() {
    let dir = support::temp_dir("replay-lineage");
    let run = |keys: &str| -> serde_json::Value {
        let out = dir.join(keys);
        let o = crate::replay::kvroute(&[
            "replay",
            "--workload",
            "agents",
            "--sessions",
            "8",
            "--session-count",
            "12",
            "--agent-max-context",
            "12000",
            "--workers",
            "2",
            "--worker-speedup",
            "0.5",
            "--policy",
            "default",
            "--session-keys",
            keys,
            "--seed",
            "5",
            "--no-plots",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
        v["policies"][0].clone()
    };
    let p = run("inferred");
    let inf = &p["inferred_sessions"];
    let requests = p["requests"].as_u64().unwrap();
    let top = inf["true_top_level"].as_u64().unwrap();
    assert_eq!(top, 12, "{inf}");
    assert_eq!(inf["started"].as_u64().unwrap(), top, "{inf}");
    assert_eq!(
        inf["started"].as_u64().unwrap() + inf["continued"].as_u64().unwrap(),
        requests,
        "every request is inferred once: {inf}"
    );
    assert!(inf["true_sessions"].as_u64().unwrap() >= top);
    assert!(run("none")["inferred_sessions"].is_null());
    let o = crate::replay::kvroute(&[
        "replay",
        "--workload",
        "agents",
        "--workers",
        "2",
        "--session-keys",
        "guessed",
        "--out",
        dir.join("bad").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--session-keys \"guessed\""));
}

/// `GET /v1/tenants` while requests wait: each waiting request under its tenant with its prompt
/// tokens (as metrics too, for a configured tenant), the busy tenant's service already charged,
/// and both served once the worker frees up.
#[test]
fn tenants_show_their_waiting_requests_while_the_fleet_is_busy() {
    let cfg = support::temp_file(
        "fair-wait.toml",
        "[routing]\nqueue_timeout_ms = 20000\n\n[fairness]\nqueue = true\n\n\
         [fairness.tenants.acme]\nweight = 1.0\n",
    );
    let s = Server::start(&["--config", cfg.to_str().unwrap(), "--busy-threshold", "0.5"]);
    s.put_worker(1, &json!({"max_num_batched_tokens": 100}));
    let prompt = |n: u32, salt: u32| -> Vec<u32> { (0..n).map(|i| salt * 1_000 + i).collect() };
    // 64 uncached prompt tokens > 0.5 × 100: the only worker is busy after this one
    let hog = s.post(
        "/v1/route",
        &json!({"request_id": "hog", "tokens": prompt(64, 1), "tenant": "acme"}),
    );
    hog.expect(200);
    let standing = |name: &str| s.get(&format!("/v1/tenants/{name}")).body().clone();
    std::thread::scope(|scope| {
        let wait = |id: &'static str, tenant: &'static str, n: u32, salt: u32| {
            let url = s.url("/v1/route");
            scope.spawn(move || {
                let body = serde_json::to_vec(
                    &json!({"request_id": id, "tokens": prompt(n, salt), "tenant": tenant}),
                )
                .unwrap();
                support::send(
                    &support::client(),
                    &url,
                    "POST",
                    &[("content-type", "application/json")],
                    &body,
                )
                .expect("transport")
            })
        };
        let a = wait("acme-2", "acme", 32, 2);
        let b = wait("beta-1", "beta", 24, 3);
        support::plugins::eventually("both to wait", || {
            support::metric(&s.metrics(), "kvroute_queue_depth") == Some(2.0)
        });
        let acme = standing("acme");
        assert_eq!(
            (&acme["waiting_requests"], &acme["waiting_prompt_tokens"]),
            (&json!(1), &json!(32)),
            "{acme}"
        );
        let served = acme["attained_tokens"].as_f64().unwrap();
        assert!(served > 60.0 && served <= 64.0, "the hog's 64: {acme}");
        let beta = standing("beta");
        assert_eq!(
            (&beta["waiting_requests"], &beta["waiting_prompt_tokens"]),
            (&json!(1), &json!(24)),
            "{beta}"
        );
        assert!(beta["attained_tokens"].as_f64().unwrap() <= 1.0, "{beta}");
        let listed: Vec<String> = s.get("/v1/tenants").body()["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["tenant"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(listed, ["acme", "beta"]);
        assert_eq!(
            support::metric(
                &s.metrics(),
                "kvroute_tenant_waiting_requests{tenant=\"acme\"}"
            ),
            Some(1.0)
        );
        // the hog's prefill ends: both are served, and nothing waits
        s.post("/v1/requests/hog/prefill_complete", &json!({}))
            .expect(200);
        for h in [a, b] {
            h.join().expect("client thread").expect(200);
        }
    });
    for name in ["acme", "beta"] {
        assert_eq!(standing(name)["waiting_requests"], 0, "{name}");
    }
    assert!(standing("beta")["attained_tokens"].as_f64().unwrap() > 20.0);
}
