//! `kvroute serve --state-dir`: workers and policies survive a restart; a state directory the
//! store cannot account for refuses the start; a change the store cannot persist is refused and
//! undone.

use crate::support;

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use support::{run_to_exit, Server};

const WASM: &[u8] = kvroute_server::serve::DEFAULT_POLICY_WASM;

fn start(dir: &Path) -> Server {
    Server::start(&["--state-dir", dir.to_str().unwrap()])
}

fn upload(s: &Server, name: &str, query: &str) -> support::Resp {
    s.raw(
        "PUT",
        &format!("/v1/policies/{name}{query}"),
        &[("content-type", "application/wasm")],
        WASM,
    )
}

/// `GET /v1/policies` without what counts traffic (stats, live instances).
fn policies(s: &Server) -> Value {
    let mut v = s.get("/v1/policies").body().clone();
    for p in v["policies"].as_array_mut().unwrap() {
        let o = p.as_object_mut().unwrap();
        o.remove("stats");
        o.remove("instances");
    }
    v
}

/// `GET /v1/workers` without the KV event feeds' live status (a subscription's state is not
/// registry state: it is re-established after a restart).
fn workers(s: &Server) -> Value {
    let r = s.get("/v1/workers");
    r.expect(200);
    let mut v = r.body().clone();
    for w in v["workers"].as_array_mut().unwrap() {
        for rank in w["ranks"].as_array_mut().unwrap() {
            rank.as_object_mut().unwrap().remove("kv_feed");
        }
    }
    v
}

/// Registers workers of every kind and loads policies with a history, so a restart has something
/// of each to keep.
fn populate(s: &Server) {
    s.put_worker(
        1,
        &json!({"dp_size": 2, "taints": ["gpu=h100", "tier=gold"], "role": "decode",
                "topology": {"zone": "a", "rack": "r1"}, "endpoint": "http://127.0.0.1:9",
                "total_kv_blocks": 1000, "max_num_batched_tokens": 2048}),
    );
    s.put_worker(
        2,
        &json!({"role": "prefill", "topology": {"zone": "b"}, "model": "m",
                "kv_events": {"endpoint": "tcp://127.0.0.1:1", "topic": "kv"}}),
    );
    s.put_worker(3, &json!({}));
    s.delete("/v1/workers/3").expect(204);
    s.patch(
        "/v1/workers/2",
        &json!({"draining": true, "taints": ["spare"]}),
    )
    .expect(200);
    upload(
        s,
        "tuned",
        "?activate=true&config=%7B%22work_weight%22%3A2%7D",
    )
    .expect(201);
    s.req(
        "PUT",
        "/v1/policies/tuned/config",
        Some(&json!({"work_weight": 3})),
        None,
    )
    .expect(200);
    upload(s, "other", "?activate=true").expect(201);
    upload(s, "spare", "").expect(201);
    s.raw("POST", "/v1/policies/rollback", &[], b"");
}

#[test]
fn a_restart_keeps_workers_policy_versions_the_active_one_and_its_config() {
    let dir = support::temp_dir("state-restart");
    let mut s = start(&dir);
    populate(&s);
    // Rolled back to tuned v2 (the configured one); `other` is loaded, `spare` too.
    let before_policies = policies(&s);
    assert_eq!(before_policies["active"], "tuned", "{before_policies}");
    let before_workers = workers(&s);
    assert_eq!(before_workers["workers"].as_array().unwrap().len(), 2);
    let routed = s.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
    assert_eq!(s.terminate(Duration::from_secs(20)).code(), Some(0));

    let mut s = start(&dir);
    assert_eq!(workers(&s), before_workers, "the workers as they were");
    assert_eq!(policies(&s), before_policies, "the policies as they were");
    let detail = s.get("/v1/policies/tuned").body().clone();
    let v2 = detail["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["version"] == 2)
        .unwrap_or_else(|| panic!("tuned v2 is kept: {detail}"));
    assert_eq!(v2["active"], true, "{detail}");
    assert!(v2["config"].as_str().unwrap().contains("3"), "{detail}");
    let again = s.route_ok(&json!({"tokens": vec![1u32; 32], "book": false}));
    assert_eq!(
        again["policy"], routed["policy"],
        "the same version decides"
    );
    assert_eq!(s.get("/readyz").body()["policy"]["version"], 2);
    // The history came back too: a rollback restores the target named before the restart.
    let target = &before_policies["rollback_target"];
    assert!(target.is_object(), "{before_policies}");
    let r = s.raw("POST", "/v1/policies/rollback", &[], b"");
    r.expect(200);
    assert_eq!(
        (&r.body()["name"], &r.body()["version"]),
        (&target["name"], &target["version"]),
        "{r}"
    );
    // Numbering continues where it was.
    let r = upload(&s, "tuned", "");
    r.expect(201);
    assert_eq!(r.body()["version"], 3, "{r}");
    let after_change = policies(&s);
    // A later restart keeps the changes made after the first one.
    assert_eq!(s.terminate(Duration::from_secs(20)).code(), Some(0));
    let s = start(&dir);
    assert_eq!(policies(&s), after_change);
    assert_eq!(workers(&s), before_workers);
}

#[test]
fn the_configuration_file_applies_on_top_of_the_stored_state() {
    let dir = support::temp_dir("state-config");
    let mut s = start(&dir);
    s.put_worker(5, &json!({"taints": ["from-api"]}));
    s.put_worker(6, &json!({"taints": ["kept"]}));
    upload(&s, "tuned", "?activate=true").expect(201);
    s.terminate(Duration::from_secs(20));
    let config = support::temp_file(
        "kvroute.toml",
        &format!(
            "state_dir = {:?}\n[workers.5]\ntaints = [\"from-file\"]\n",
            dir.to_str().unwrap()
        ),
    );
    let s = Server::start(&["--config", config.to_str().unwrap()]);
    let w = s.workers();
    assert_eq!(w[&5]["taints"], json!(["from-file"]), "the file wins");
    assert_eq!(w[&6]["taints"], json!(["kept"]));
    assert_eq!(s.get("/v1/policies").body()["active"], "tuned");
    drop(s);
    // --policy wins over the stored active policy.
    let wasm = dir.with_extension("wasm");
    std::fs::write(&wasm, WASM).unwrap();
    let s = Server::start(&[
        "--state-dir",
        dir.to_str().unwrap(),
        "--policy",
        wasm.to_str().unwrap(),
        "--policy-name",
        "cli",
    ]);
    let listed = s.get("/v1/policies").body().clone();
    assert_eq!(listed["active"], "cli", "{listed}");
    assert!(listed.to_string().contains("\"tuned\""), "{listed}");
}

#[test]
fn a_state_directory_with_a_corrupt_or_unknown_file_refuses_to_start_naming_it() {
    let dir = support::temp_dir("state-corrupt");
    let mut s = start(&dir);
    s.put_worker(1, &json!({}));
    s.terminate(Duration::from_secs(20));
    let args = |dir: &Path| {
        vec![
            "serve".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--state-dir".into(),
            dir.to_str().unwrap().to_string(),
        ]
    };
    let run = |dir: &Path| {
        let a = args(dir);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run_to_exit(&a, &[], Duration::from_secs(20))
    };
    std::fs::write(
        dir.join("workers.json"),
        b"{\"format\": 1, \"workers\": {\"1\": [}",
    )
    .unwrap();
    let (status, _, err) = run(&dir);
    assert!(!status.success());
    assert!(
        err.contains("workers.json") && err.contains("state_dir"),
        "the error names the file: {err}"
    );
    std::fs::remove_file(dir.join("workers.json")).unwrap();
    std::fs::write(dir.join("stray.bin"), b"?").unwrap();
    let (status, _, err) = run(&dir);
    assert!(!status.success());
    assert!(err.contains("stray.bin"), "{err}");
}

#[test]
fn a_change_that_cannot_be_persisted_is_refused_and_undone() {
    let dir = support::temp_dir("state-fail");
    let mut s = start(&dir);
    s.put_worker(1, &json!({"taints": ["a"]}));
    upload(&s, "tuned", "?activate=true").expect(201);
    let workers_before = workers(&s);
    let policies_before = policies(&s);
    // A directory where the store writes its temporary files: every write fails (as root too,
    // where a read-only directory would not stop anything).
    std::fs::create_dir(dir.join(".workers.json.tmp")).unwrap();
    std::fs::create_dir(dir.join(".policies.json.tmp")).unwrap();
    for r in [
        s.put("/v1/workers/2", &json!({})),
        s.put("/v1/workers/1", &json!({"taints": ["b"], "dp_size": 3})),
        s.patch("/v1/workers/1", &json!({"draining": true})),
        s.delete("/v1/workers/1"),
        upload(&s, "other", "?activate=true"),
        upload(&s, "tuned", ""),
        s.req(
            "PUT",
            "/v1/policies/tuned/config",
            Some(&json!({"work_weight": 2})),
            None,
        ),
        s.raw("POST", "/v1/policies/rollback", &[], b""),
    ] {
        r.expect_error(503, "state_unavailable");
    }
    assert_eq!(workers(&s), workers_before, "no worker change stayed");
    assert_eq!(policies(&s), policies_before, "no policy change stayed");
    // Routing goes on with what was there.
    let d = s.route_ok(&json!({"tokens": vec![3u32; 32], "book": false}));
    assert_eq!(d["worker_id"], 1);
    assert_eq!(d["policy"]["name"], "tuned");
    // Once the store is writable again, changes go through and survive a restart.
    std::fs::remove_dir(dir.join(".workers.json.tmp")).unwrap();
    std::fs::remove_dir(dir.join(".policies.json.tmp")).unwrap();
    s.put_worker(2, &json!({}));
    upload(&s, "other", "?activate=true").expect(201);
    let after = (workers(&s), policies(&s));
    s.terminate(Duration::from_secs(20));
    let s = start(&dir);
    assert_eq!((workers(&s), policies(&s)), after);
}
