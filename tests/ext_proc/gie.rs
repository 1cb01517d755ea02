//! The Gateway API Inference Extension's endpoint picker protocol (v1.0) beyond the single
//! destination: the ordered fallback list (`[ext_proc] fallbacks`), the served endpoint the
//! gateway reports on the response path (the booking moves to a fallback that served), the
//! conformance suite's hooks (`[ext_proc] conformance_hooks`), the gRPC health services'
//! readiness rule, and data-parallel ranks as target ports (`[ext_proc] dp_rank_ports`).

use serde_json::{json, Value};

use super::{address, completion, completion_tokens, Picker, SSE};
use crate::support::engines::{eventually, prose};
use crate::support::{self};

const WORKER: &str = "total_kv_blocks = 16384\nmax_num_batched_tokens = 8192";

impl Picker {
    /// `rank` of `worker` holds the complete blocks of `tokens`.
    fn cache_rank(&self, worker: u64, rank: u32, event_id: u64, tokens: &[u32]) {
        let local =
            support::local_hashes(tokens, crate::support::engines::BLOCK, support::BASE_SEED);
        let r = self.server.post(
            "/v1/events",
            &json!([support::stored_event(worker, rank, event_id, &local)]),
        );
        r.expect(200);
        assert_eq!(r.body()["applied"], 1, "{r}");
    }

    /// `GET /v1/workers`: a rank's `active_requests` and `active_prefill_tokens`.
    fn rank_load(&self, worker: u64, rank: u32) -> (u64, u64) {
        let w = &self.server.workers()[&worker];
        let r = w["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["dp_rank"] == rank)
            .unwrap_or_else(|| panic!("no rank {rank} in {w}"));
        (
            r["active_requests"].as_u64().unwrap(),
            r["active_prefill_tokens"].as_u64().unwrap(),
        )
    }
}

fn list(workers: &[usize]) -> String {
    workers
        .iter()
        .map(|&w| address(w))
        .collect::<Vec<_>>()
        .join(",")
}

/// Worker 1 holds the whole prompt, worker 2 its first half, worker 0 nothing.
fn ranked_prompt(p: &Picker) -> (String, usize) {
    let a = prose(0, 150);
    let tokens = completion_tokens(&a);
    p.cache(1, 1, &tokens);
    p.cache(2, 2, &tokens[..tokens.len() / 2]);
    (a, tokens.len())
}

#[test]
fn the_destination_is_an_ordered_fallback_list_in_the_header_and_the_metadata() {
    let p = Picker::start(3, WORKER, "[ext_proc]\nfallbacks = 2");
    let mut envoy = p.envoy();
    let (a, _) = ranked_prompt(&p);
    for (id, mode) in [("duplex", "duplex"), ("buffered", "buffered")] {
        let r = envoy.picked(
            id,
            json!({"path": "/v1/completions", "body": completion(&a, true), "mode": mode}),
        );
        // The whole prefix first, then half of it, then none: the policy's ranking.
        assert_eq!(r["destination"], list(&[1, 2, 0]), "{mode}: {r}");
        assert_eq!(
            r["metadata"]["envoy.lb"]["x-gateway-destination-endpoint"],
            list(&[1, 2, 0]),
            "{mode}: the header and the metadata agree: {r}"
        );
        assert_eq!(r["set_headers"]["x-kvroute-worker"], "1/0", "{r}");
        envoy.respond(id, &SSE, true);
    }
    p.wait_bookings(0.0, "the listed requests");
    // The subset hint bounds the fallbacks too.
    let r = envoy.picked(
        "subset",
        json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex",
               "subset": [address(0), address(2)]}),
    );
    assert_eq!(r["destination"], list(&[2, 0]), "{r}");
    envoy.respond("subset", &SSE, true);

    // Bounded by the configuration: one fallback.
    let p1 = Picker::start(3, WORKER, "[ext_proc]\nfallbacks = 1");
    let (a, _) = ranked_prompt(&p1);
    let mut envoy = p1.envoy();
    let r = envoy.picked(
        "one",
        json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex"}),
    );
    assert_eq!(r["destination"], list(&[1, 2]), "{r}");
    assert_eq!(
        r["metadata"]["envoy.lb"]["x-gateway-destination-endpoint"],
        list(&[1, 2])
    );
    envoy.respond("one", &SSE, true);
    p1.wait_bookings(0.0, "the request");
}

#[test]
fn a_fallback_that_served_takes_the_booking_from_the_primary() {
    let p = Picker::start(3, WORKER, "[ext_proc]\nfallbacks = 2");
    let mut envoy = p.envoy();
    let (a, n) = ranked_prompt(&p);
    let half_blocks = (n / 2) / crate::support::engines::BLOCK;
    let pick = |envoy: &mut super::Envoy, id: &str, extra: Value| {
        let mut req =
            json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex"});
        if let Value::Object(m) = extra {
            req.as_object_mut().unwrap().extend(m);
        }
        envoy.picked(id, req)
    };

    // Served by the primary: nothing moves.
    let r = pick(&mut envoy, "p", json!({}));
    assert_eq!(r["destination"], list(&[1, 2, 0]));
    assert_eq!(p.rank_load(1, 0).0, 1);
    envoy.call(json!({"op": "respond_headers", "id": "p", "served": address(1)}));
    assert_eq!(p.rank_load(1, 0).0, 1);
    assert_eq!(
        p.metric("kvroute_ext_proc_served_total{by=\"primary\"}"),
        1.0
    );
    envoy.body("p", &SSE, true);
    p.wait_bookings(0.0, "the primary's answer");

    // The primary failed and the gateway retried the first fallback: the booking follows it,
    // counted with the prompt tokens worker 2 had cached (half the prompt's blocks).
    let r = pick(&mut envoy, "f", json!({}));
    assert_eq!(r["destination"], list(&[1, 2, 0]));
    let (requests, prefill) = p.rank_load(1, 0);
    assert_eq!(requests, 1);
    assert_eq!(p.rank_load(2, 0), (0, 0));
    envoy.call(json!({"op": "respond_headers", "id": "f", "served": address(2)}));
    assert_eq!(p.rank_load(1, 0), (0, 0), "the primary is released");
    let (requests2, prefill2) = p.rank_load(2, 0);
    assert_eq!(requests2, 1, "the fallback is booked");
    let uncached = (n - half_blocks * crate::support::engines::BLOCK) as u64;
    assert_eq!(
        prefill2, uncached,
        "its own cache counts: {prefill} on the primary"
    );
    assert!(prefill2 > prefill);
    assert_eq!(p.bookings(), 1.0);
    assert_eq!(
        p.metric("kvroute_ext_proc_served_total{by=\"fallback\"}"),
        1.0
    );
    assert_eq!(
        p.metric("kvroute_ext_proc_bookings_moved_total{by=\"fallback\"}"),
        1.0
    );
    // The rest of the response goes on against the fallback's booking; its end frees it.
    let e = envoy.body("f", &SSE[..1], false);
    assert_eq!(e["echoed"], json!(&SSE[..1]));
    assert_eq!(
        p.rank_load(2, 0),
        (1, 0),
        "prefill complete on the fallback"
    );
    envoy.body("f", &SSE[1..], true);
    p.wait_bookings(0.0, "the fallback's answer");
    assert_eq!(p.rank_load(2, 0), (0, 0));

    // A gateway that went outside the list (here: the subset kept worker 0 out of it) still
    // gets its booking where it served, with nothing counted as cached there.
    let r = pick(&mut envoy, "u", json!({"subset": [address(1), address(2)]}));
    assert_eq!(r["destination"], list(&[1, 2]));
    envoy.call(json!({"op": "respond_headers", "id": "u", "served": address(0)}));
    assert_eq!(p.rank_load(1, 0), (0, 0));
    assert_eq!(p.rank_load(0, 0), (1, n as u64));
    assert_eq!(
        p.metric("kvroute_ext_proc_served_total{by=\"unlisted\"}"),
        1.0
    );
    envoy.call(json!({"op": "reset", "id": "u"}));
    p.wait_bookings(0.0, "a reset after the move");
    assert_eq!(p.rank_load(0, 0), (0, 0));
}

#[test]
fn the_conformance_hooks_steer_and_report_only_when_configured() {
    let p = Picker::start(3, WORKER, "[ext_proc]\nconformance_hooks = true");
    let mut envoy = p.envoy();
    let a = prose(100, 150);
    p.cache(1, 1, &completion_tokens(&a));
    let req = |sel: &str| {
        json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex",
               "headers": {"test-epp-endpoint-selection": sel}})
    };
    // The suite names the pod to route to, against the cache's preference.
    let r = envoy.picked("sel", req(&address(0)));
    assert_eq!(r["destination"], address(0), "{r}");
    // The response carries what the gateway reported as served.
    let e = envoy.respond_served("sel", &address(0));
    assert_eq!(
        e["response_set_headers"]["x-conformance-test-served-endpoint"],
        address(0),
        "{e}"
    );
    // By IP (every port of the host), a list of them: all three share the IP, so the cache
    // decides (another prompt: the steered one is now predicted on worker 0 too).
    let b = prose(400, 150);
    p.cache(2, 2, &completion_tokens(&b));
    let mut by_ip = req("10.1.1.1, 127.0.0.1");
    by_ip["body"] = completion(&b, true);
    let r = envoy.picked("ip", by_ip);
    assert_eq!(r["destination"], address(2), "{r}");
    // Not reported by the gateway: said so, as the suite's reference picker does.
    let e = envoy.respond("ip", &SSE, true);
    assert_eq!(
        e["response_set_headers"]["x-conformance-test-served-endpoint"],
        "fail: missing destination endpoint served metadata"
    );
    // Nobody there: 503, naming the header.
    let r = envoy.open("none", req("10.9.9.9"));
    assert_eq!(r["immediate"]["status"], 503, "{r}");
    assert_eq!(
        r["immediate"]["body"]["error"]["param"],
        "test-epp-endpoint-selection"
    );
    p.wait_bookings(0.0, "the steered requests");

    // Off (the default): the header steers nothing and the response is not annotated.
    let off = Picker::start(3, WORKER, "");
    off.cache(1, 1, &completion_tokens(&a));
    let mut envoy = off.envoy();
    let r = envoy.picked("sel", req(&address(0)));
    assert_eq!(r["destination"], address(1), "{r}");
    let e = envoy.respond_served("sel", &address(1));
    assert!(
        e["response_set_headers"]
            .get("x-conformance-test-served-endpoint")
            .is_none(),
        "{e}"
    );
    off.wait_bookings(0.0, "the unsteered request");
}

#[test]
fn readiness_waits_for_a_worker_and_liveness_does_not() {
    let p = Picker::start(0, "", "");
    let mut envoy = p.envoy();
    let status = |envoy: &mut super::Envoy, s: &str| envoy.health(s);
    assert_eq!(status(&mut envoy, "liveness"), "SERVING");
    assert_eq!(status(&mut envoy, ""), "SERVING");
    assert_eq!(status(&mut envoy, "readiness"), "NOT_SERVING");
    assert_eq!(
        status(&mut envoy, "envoy.service.ext_proc.v3.ExternalProcessor"),
        "NOT_SERVING"
    );
    assert_eq!(status(&mut envoy, "no.such.Service"), "NOT_FOUND");
    // A worker without an endpoint cannot be a destination: still not ready.
    p.server.put_worker(7, &json!({"model": super::MODEL}));
    std::thread::sleep(std::time::Duration::from_millis(1200));
    assert_eq!(status(&mut envoy, "readiness"), "NOT_SERVING");
    p.server.put_worker(
        7,
        &json!({"model": super::MODEL, "endpoint": "http://127.0.0.1:18007"}),
    );
    eventually("readiness with a worker", || {
        (status(&mut envoy, "readiness") == "SERVING").then_some(())
    });
    assert_eq!(
        status(&mut envoy, "envoy.service.ext_proc.v3.ExternalProcessor"),
        "SERVING"
    );
    let r = envoy.picked(
        "a",
        json!({"path": "/v1/completions", "body": completion(&prose(0, 20), false),
               "mode": "buffered"}),
    );
    assert_eq!(r["destination"], "127.0.0.1:18007");
    envoy.respond("a", &["{}"], true);
    p.wait_bookings(0.0, "the answer");
    // The last worker leaves: not ready again; alive throughout.
    p.server.delete("/v1/workers/7").expect(204);
    eventually("not ready without workers", || {
        (status(&mut envoy, "readiness") == "NOT_SERVING").then_some(())
    });
    assert_eq!(
        status(&mut envoy, "envoy.service.ext_proc.v3.ExternalProcessor"),
        "NOT_SERVING"
    );
    assert_eq!(status(&mut envoy, "liveness"), "SERVING");
}

#[test]
fn data_parallel_ranks_are_targets_on_ports_of_their_own() {
    // One engine with four ranks, each serving on its own port from 18000.
    let p = Picker::start(
        0,
        "",
        &format!(
            "[ext_proc]\nfallbacks = 3\ndp_rank_ports = true\n\n[workers.0]\nendpoint = \"http://127.0.0.1:18000/v1\"\nmodel = {:?}\ndp_size = 4\n{WORKER}\n",
            super::MODEL
        ),
    );
    let mut envoy = p.envoy();
    let a = prose(200, 150);
    let tokens = completion_tokens(&a);
    p.cache_rank(0, 2, 1, &tokens);
    p.cache_rank(0, 1, 2, &tokens[..tokens.len() / 2]);
    let req = |subset: Value| {
        json!({"path": "/v1/completions", "body": completion(&a, true), "mode": "duplex",
               "subset": subset})
    };
    let r = envoy.picked("a", req(Value::Null));
    let dest: Vec<&str> = r["destination"].as_str().unwrap().split(',').collect();
    // The rank that holds the prompt, then the one holding half, then the idle two.
    assert_eq!(&dest[..2], ["127.0.0.1:18002", "127.0.0.1:18001"], "{r}");
    let mut rest = dest[2..].to_vec();
    rest.sort_unstable();
    assert_eq!(rest, ["127.0.0.1:18000", "127.0.0.1:18003"], "{r}");
    assert_eq!(
        r["metadata"]["envoy.lb"]["x-gateway-destination-endpoint"],
        r["destination"]
    );
    assert_eq!(r["set_headers"]["x-kvroute-worker"], "0/2", "{r}");
    assert!(
        r["set_headers"].get("x-data-parallel-rank").is_none(),
        "the port names the rank: {r}"
    );
    assert_eq!(p.rank_load(0, 2).0, 1);
    // Served by rank 1's port: the booking moves to rank 1.
    envoy.call(json!({"op": "respond_headers", "id": "a", "served": "127.0.0.1:18001"}));
    assert_eq!(p.rank_load(0, 2).0, 0);
    assert_eq!(p.rank_load(0, 1).0, 1);
    envoy.body("a", &SSE, true);
    p.wait_bookings(0.0, "the answer");

    // The subset hint names ranks by port: one of them is the destination.
    let r = envoy.picked("one", req(json!(["127.0.0.1:18003"])));
    assert_eq!(r["destination"], "127.0.0.1:18003", "{r}");
    assert_eq!(r["set_headers"]["x-kvroute-worker"], "0/3", "{r}");
    envoy.respond("one", &SSE, true);
    // Two of them, neither the cached rank: the list holds those two and nothing else.
    let r = envoy.picked("two", req(json!(["127.0.0.1:18000", "127.0.0.1:18003"])));
    let mut dest: Vec<&str> = r["destination"].as_str().unwrap().split(',').collect();
    dest.sort_unstable();
    assert_eq!(dest, ["127.0.0.1:18000", "127.0.0.1:18003"], "{r}");
    envoy.respond("two", &SSE, true);
    p.wait_bookings(0.0, "the hinted requests");
}
