//! Feed health and what watches it, end to end with a real publisher: a dead feed in
//! `GET /v1/workers`, `/metrics` and routing (docs/SPEC.md §4.4), the hit-rate counters, and the
//! Grafana dashboard (docs/grafana/kvroute.json) checked against a running server's scrape.

use super::*;

/// The feed of (worker, rank) in `GET /v1/workers` (`null` when it has none).
fn kv_feed(server: &Server, worker: u64, rank: u64) -> Value {
    let v = server.json("GET", "/v1/workers", None);
    let w = v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == worker)
        .unwrap_or_else(|| panic!("worker {worker} not listed: {v}"))
        .clone();
    w["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["dp_rank"] == rank)
        .unwrap()
        .get("kv_feed")
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn a_dead_feed_is_shown_counted_and_routed_by_the_configured_rule() {
    for rule in ["drain", "unknown", "keep"] {
        let config = std::env::temp_dir().join(format!(
            "kvroute-dead-feed-{rule}-{}.toml",
            std::process::id()
        ));
        std::fs::write(
            &config,
            format!("[routing]\ndead_feed = \"{rule}\"\ndead_feed_after_ms = 300\n"),
        )
        .unwrap();
        let server = Server::start_with(&["--config", config.to_str().unwrap()]);
        let mut p = Publisher::spawn("vllm_publisher.py", &[]);
        server.register_with_events(1, &p, json!({}));
        server.register(2, json!({}));
        p.wait_sub();
        let a = tokens(1, 12);
        p.store(&a, None, json!({}));
        p.store(&tokens(300, 4), None, json!({}));
        server.wait_overlap(&a, None, 1, 0, 3);

        // Live: connected, the last sequence (the second message, 1), a fresh age, not dead.
        let f = eventually("the feed to show seq 1", || {
            let f = kv_feed(&server, 1, 0);
            (f["last_seq"] == 1).then_some(f)
        });
        assert_eq!(
            (&f["connected"], &f["dead"]),
            (&json!(true), &json!(false)),
            "{f}"
        );
        assert!(f["last_event_age_ms"].as_u64().unwrap() < 10_000, "{f}");
        assert_eq!(kv_feed(&server, 2, 0), Value::Null, "no kv_events, no feed");
        let dead = r#"kvroute_kv_feed_dead{worker_id="1",dp_rank="0"}"#;
        assert_eq!(server.metric(dead), 0.0);
        assert!(
            server.metric(r#"kvroute_kv_last_event_age_seconds{worker_id="1",dp_rank="0"}"#) >= 0.0
        );
        let r = server.route(&a, None);
        assert_eq!(
            (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
            (Some(1), Some(3)),
            "{r}"
        );

        // The engine goes away for 3 s (sockets closed, then bound again on the same ports).
        p.send_cmd(json!({"cmd": "restart", "down_secs": 3}));
        let f = eventually("the feed to be dead", || {
            let f = kv_feed(&server, 1, 0);
            (f["dead"] == true).then_some(f)
        });
        assert_eq!(f["connected"], false, "{f}");
        assert_eq!(f["last_seq"], 1, "{f}");
        assert_eq!(server.metric(dead), 1.0, "{rule}");
        let r = server.json(
            "POST",
            "/v1/route",
            Some(json!({"tokens": a, "book": false, "explain": true})),
        );
        match rule {
            "drain" => {
                assert_eq!(r["worker_id"], 2, "{r}");
                assert_eq!(r["excluded"][0]["worker_id"], 1, "{r}");
                assert_eq!(r["excluded"][0]["reason"], "kv_feed_dead", "{r}");
            }
            "unknown" => {
                let c1 = r["candidates"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["worker_id"] == 1)
                    .cloned()
                    .unwrap();
                assert_eq!(c1["overlap_blocks"], 0, "its overlap is unknown: {r}");
                assert_eq!(r["overlap_blocks"], 0, "{r}");
            }
            _ => assert_eq!(
                (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
                (Some(1), Some(3)),
                "keep routes on the stale index: {r}"
            ),
        }

        // Back: connected again, not dead, the rule no longer applies.
        p.reply();
        p.wait_sub();
        let f = eventually("the feed to be alive again", || {
            let f = kv_feed(&server, 1, 0);
            (f["connected"] == true && f["dead"] == false).then_some(f)
        });
        assert_eq!(server.metric(dead), 0.0, "{f}");
        let b = tokens(7000, 8);
        p.store(&b, None, json!({}));
        server.wait_overlap(&b, None, 1, 0, 2);
        let r = server.route(&b, None);
        assert_eq!(
            (r["worker_id"].as_u64(), r["overlap_blocks"].as_u64()),
            (Some(1), Some(2)),
            "{r}"
        );
        let _ = std::fs::remove_file(&config);
    }
}

/// Every series of a scrape, by name (histograms as `_bucket`, `_sum`, `_count`).
fn series_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or("").to_string())
        .collect()
}

/// The `kvroute_*` metric names a PromQL expression reads.
fn metrics_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvroute_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn hit_rate_counters_and_the_grafana_dashboard_match_a_running_server() {
    // A configured tenant with a budget, so the dashboard's tenant panels have series.
    let config =
        std::env::temp_dir().join(format!("kvroute-dashboard-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[fairness]\nqueue = true\n\n[fairness.tenants.acme]\nrequests_per_minute = 1\n",
    )
    .unwrap();
    let server = Server::start_with(&["--config", config.to_str().unwrap()]);
    let mut p = Publisher::spawn("vllm_publisher.py", &[]);
    server.register_with_events(1, &p, json!({}));
    server.register(2, json!({}));
    p.wait_sub();
    let a = tokens(1, 12);
    p.store(&a, None, json!({}));
    server.wait_overlap(&a, None, 1, 0, 3);

    // 12 prompt tokens, all cached on worker 1 (the engine reuses 8: the last block of a
    // block-aligned prompt is recomputed, SPEC §5); then 8 tokens nobody holds.
    let r = server.route(&a, None);
    assert_eq!(
        (r["worker_id"].as_u64(), r["cached_tokens"].as_u64()),
        (Some(1), Some(8)),
        "{r}"
    );
    let r = server.route(&tokens(5000, 8), None);
    let w = r["worker_id"].as_u64().unwrap();
    let (_, text) = server.send("GET", "/metrics", None);
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(sum("kvroute_routed_prompt_tokens_total"), 20.0, "{text}");
    assert_eq!(sum("kvroute_routed_cached_tokens_total"), 8.0, "{text}");
    let one =
        |name: &str, w: u64| server.metric(&format!("{name}{{dp_rank=\"0\",worker_id=\"{w}\"}}"));
    let expected_prompt_1 = if w == 1 { 20.0 } else { 12.0 };
    assert_eq!(
        one("kvroute_routed_prompt_tokens_total", 1),
        expected_prompt_1
    );
    assert_eq!(one("kvroute_routed_cached_tokens_total", 1), 8.0);
    // A refused route, so the error series exists too.
    let (status, _) = server.send(
        "POST",
        "/v1/route",
        Some(json!({"tokens": a, "pinned_worker": {"worker_id": 99}})),
    );
    assert_eq!(status, 404);
    // A tenant over its budget, so its refusal series exists.
    for want in [200, 429] {
        let (status, _) = server.send(
            "POST",
            "/v1/route",
            Some(json!({"tokens": tokens(7000, 8), "tenant": "acme"})),
        );
        assert_eq!(status, want);
    }

    // Every query of the dashboard names only series this server exports.
    let path = crate::support::workspace_root().join("docs/grafana/kvroute.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, text) = server.send("GET", "/metrics", None);
    let exported = series_names(&text);
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut queried = std::collections::BTreeSet::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{panel}");
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            let names = metrics_in(expr);
            assert!(
                !names.is_empty(),
                "a query without a kvroute metric: {expr}"
            );
            for n in names {
                assert!(
                    exported.contains(&n),
                    "panel {:?} queries {n}, which the server does not export:\n{text}",
                    panel["title"]
                );
                queried.insert(n);
            }
        }
    }
    for must in [
        "kvroute_routed_prompt_tokens_total",
        "kvroute_routed_cached_tokens_total",
        "kvroute_kv_feed_dead",
        "kvroute_kv_last_event_age_seconds",
        "kvroute_tenant_waiting_requests",
        "kvroute_tenant_budget_used",
    ] {
        assert!(queried.contains(must), "the dashboard shows no {must}");
    }
}
