//! Predict-on-route and learned step times, end to end: the real `kvroute serve` over HTTP.

use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::Server;

/// A prompt: a 4096-token prefix shared by the burst, then 64 tokens of its own.
fn burst_prompt(own: u32) -> Vec<u32> {
    (0..4096u32)
        .map(|t| 7 + t * 3)
        .chain((0..64).map(|t| 9_000_000 + own * 1000 + t))
        .collect()
}

/// 64 requests sharing a new 4k-token prefix, sent together (no KV events yet) to 8 workers; the
/// distinct workers they land on, and the time the burst took to send.
fn burst(s: &Server) -> (usize, Duration) {
    for w in 1..=8 {
        s.put_worker(w, &json!({}));
    }
    let start = Arc::new(Barrier::new(64));
    let t0 = Instant::now();
    let picks: Vec<u64> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..64u32)
            .map(|i| {
                let start = start.clone();
                sc.spawn(move || {
                    let body = json!({"request_id": format!("b-{i}"), "tokens": burst_prompt(i)});
                    start.wait();
                    s.route_ok(&body)["worker_id"].as_u64().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t0.elapsed();
    (picks.into_iter().collect::<BTreeSet<_>>().len(), took)
}

/// With predict-on-route (the default) and the default policy the burst lands on at most 2 workers
/// (all on one when the first request is booked before the second is decided; two when the two
/// serving threads decide the first two at once, before either is booked); with it off, every
/// request after the first sees the first one's prefill as a queue and the burst spreads.
#[test]
fn a_burst_sharing_a_new_prefix_lands_together_only_with_predict_on_route() {
    // Two serving threads, as on a 2-core machine, whatever this one has: at most two decisions
    // are made before the first booking.
    let on = Server::start(&["--http-threads", "2"]);
    let (used_on, took) = burst(&on);
    // explain shows the prediction on a worker the burst used, and none elsewhere.
    let d = on.route_ok(&json!({"tokens": burst_prompt(999), "book": false, "explain": true}));
    let rows = d["candidates"].as_array().unwrap();
    let predicted: Vec<u64> = rows
        .iter()
        .map(|r| r["predicted_overlap_blocks"].as_u64().unwrap())
        .collect();
    assert!(predicted.contains(&256), "{rows:?}");
    for r in rows {
        assert!(r["overlap_blocks"].as_u64() >= r["predicted_overlap_blocks"].as_u64());
    }
    assert!(on
        .metrics()
        .contains("kvroute_predictions_total{outcome=\"recorded\"}"));

    let off = Server::start(&["--predict-on-route=false"]);
    let (used_off, _) = burst(&off);
    let d = off.route_ok(&json!({"tokens": burst_prompt(999), "book": false, "explain": true}));
    assert!(d["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["predicted_overlap_blocks"] == 0));
    assert!(
        used_on <= 2 && used_off >= 6,
        "workers used: {used_on} with predict-on-route, {used_off} without (burst sent in {took:?})"
    );
}

/// The lifecycle calls time each worker: after 20 requests through route, prefill_complete,
/// output and free, `GET /v1/workers` and the metrics show what was learned.
#[test]
fn learned_step_times_show_in_workers_and_metrics() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({}));
    s.put_worker(2, &json!({}));
    let w = &s.workers()[&1];
    assert_eq!(w["learned"]["prefill_ms_per_token"], 0.0);
    assert_eq!(w["learned"]["prefill_samples"], 0);
    for i in 0..20u32 {
        let id = format!("l-{i}");
        let tokens: Vec<u32> = (0..256 + 64 * (i % 4)).map(|t| i * 10_000 + t).collect();
        s.route_ok(&json!({"request_id": id, "tokens": tokens, "pinned_worker": {"worker_id": 1}}));
        std::thread::sleep(Duration::from_millis(3));
        s.post(&format!("/v1/requests/{id}/prefill_complete"), &json!({}))
            .expect(200);
        std::thread::sleep(Duration::from_millis(4));
        s.post(&format!("/v1/requests/{id}/output"), &json!({"tokens": 5}))
            .expect(200);
        s.delete(&format!("/v1/requests/{id}")).expect(200);
    }
    let workers = s.workers();
    let l: &Value = &workers[&1]["learned"];
    assert_eq!(l["prefill_samples"], 20, "{l}");
    assert_eq!(l["decode_samples"], 20, "{l}");
    assert!(l["prefill_ms_per_token"].as_f64().unwrap() > 0.0, "{l}");
    // 4 tokens after the first in at least 4 ms: at least 1 ms per token.
    assert!(l["decode_step_ms"].as_f64().unwrap() >= 1.0, "{l}");
    assert_eq!(workers[&2]["learned"]["prefill_samples"], 0);
    let m = s.metrics();
    let line = m
        .lines()
        .find(|l| l.starts_with("kvroute_worker_learned_decode_step_ms{worker_id=\"1\"}"))
        .unwrap_or_else(|| panic!("no learned metric in\n{m}"));
    let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(v >= 1.0, "{line}");
}
