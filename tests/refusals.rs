//! End-to-end tests of what a refused route says (docs/API.md §2, SPEC §6): a request that required
//! taints nobody eligible has is told which taints each worker lacks, in the error body and in an
//! explained decision, so an operator never has to diff taint lists by hand.

use crate::support::{self, Server};

use serde_json::{json, Value};

#[test]
fn a_required_taint_refusal_names_what_each_worker_lacks() {
    let s = Server::start(&[]);
    s.put_worker(1, &json!({"taints": ["zone=a"]}));
    s.put_worker(2, &json!({"dp_size": 2, "taints": ["zone=b"]}));
    s.put_worker(3, &json!({"taints": ["zone=b", "gpu=h100"]}));
    s.patch("/v1/workers/3", &json!({"draining": true}))
        .expect(200);
    let route = |extra: Value| {
        let mut body = json!({"tokens": (1..=64).collect::<Vec<u32>>(), "book": false});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        s.post("/v1/route", &body)
    };

    let r = route(json!({"routing_constraints":
        {"required_taints": ["zone=b", "gpu=h100", "zone=mars"]}}));
    r.expect_error(503, "all_filtered_by_constraints");
    support::assert_error_shape(&r);
    let e = &r.body()["error"];
    assert_eq!(
        e["missing_taints"],
        json!([{"worker_id": 1, "missing": ["zone=b", "gpu=h100", "zone=mars"]},
               {"worker_id": 2, "missing": ["gpu=h100", "zone=mars"]},
               {"worker_id": 3, "missing": ["zone=mars"]}]),
        "{r}"
    );
    let msg = e["message"].as_str().unwrap();
    for part in [
        "4 without the required_taints",
        "no worker has zone=mars",
        "worker 1 lacks zone=b, gpu=h100;",
        "worker 2 lacks gpu=h100)",
    ] {
        assert!(msg.contains(part), "message lacks {part:?}: {msg}");
    }
    // The taint nobody has is named once, not again for every worker.
    assert_eq!(msg.matches("zone=mars").count(), 1, "{msg}");
    assert!(
        !msg.contains("worker 3"),
        "worker 3 lacks only zone=mars: {msg}"
    );

    // A worker that has them all but is draining is counted as draining, and named nowhere else.
    let r = route(json!({"routing_constraints": {"required_taints": ["gpu=h100"]}}));
    r.expect_error(503, "all_filtered_by_constraints");
    let e = &r.body()["error"];
    assert_eq!(
        e["missing_taints"],
        json!([{"worker_id": 1, "missing": ["gpu=h100"]},
               {"worker_id": 2, "missing": ["gpu=h100"]}]),
        "{r}"
    );
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("1 draining"), "{msg}");
    assert!(!msg.contains("no worker has"), "gpu=h100 is held: {msg}");

    // A refusal for another rule carries no missing_taints.
    let r = route(json!({"allowed_worker_ids": [3]}));
    r.expect_error(503, "all_filtered_by_constraints");
    assert!(r.body()["error"].get("missing_taints").is_none(), "{r}");

    // A pin says what its worker lacks.
    let r = route(json!({"pinned_worker": {"worker_id": 2},
        "routing_constraints": {"required_taints": ["zone=b", "gpu=h100"]}}));
    r.expect_error(409, "pinned_worker_missing_taints");
    assert_eq!(r.field(), Some("pinned_worker"));
    assert_eq!(
        r.body()["error"]["missing_taints"],
        json!([{"worker_id": 2, "missing": ["gpu=h100"]}]),
        "{r}"
    );
    assert_eq!(
        r.body()["error"]["message"],
        "pinned worker 2 lacks the required taints gpu=h100"
    );

    // Explain names them on each excluded rank (and only on taint exclusions).
    let d = s.route_ok(&json!({"tokens": [1, 2, 3], "book": false, "explain": true,
        "allowed_worker_ids": [1, 2, 3],
        "routing_constraints": {"required_taints": ["zone=a"]}}));
    assert_eq!(d["worker_id"], 1, "{d}");
    let rows: Vec<Value> = d["excluded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            json!([
                e["worker_id"],
                e["dp_rank"],
                e["reason"],
                e.get("missing_taints")
            ])
        })
        .collect();
    assert_eq!(
        rows,
        [
            json!([2, 0, "missing_required_taints", ["zone=a"]]),
            json!([2, 1, "missing_required_taints", ["zone=a"]]),
            json!([3, 0, "missing_required_taints", ["zone=a"]]),
        ],
        "{d}"
    );
    let d = s.route_ok(&json!({"tokens": [1, 2, 3], "book": false, "explain": true}));
    let draining = &d["excluded"][0];
    assert_eq!(draining["reason"], "draining", "{d}");
    assert!(draining.get("missing_taints").is_none(), "{d}");
}
