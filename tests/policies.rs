//! End-to-end tests of what the policy endpoints say (docs/API.md §3.9): the listing shows every
//! loaded version of each name, which one is active and which one a rollback would restore; the
//! detail endpoint carries what the listing leaves out; every refusal names the policy; one naming
//! rule holds for the API and `kvroute policy new`.

use crate::support::{self, command, Server};

use serde_json::{json, Value};

const NATIVE_PLUGIN: &str = "kvroute-plugin-native-cost";

fn put_policy(s: &Server, name: &str, wasm: &[u8], query: &str) -> support::Resp {
    s.raw(
        "PUT",
        &format!("/v1/policies/{name}{query}"),
        &[("content-type", "application/wasm")],
        wasm,
    )
}

/// (version, active, current, rollback_target) of each listed version of `name`.
fn listed_versions(list: &Value, name: &str) -> Vec<(u64, bool, bool, bool)> {
    let entry = list["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {list}"));
    entry["versions"]
        .as_array()
        .unwrap_or_else(|| panic!("no versions: {entry}"))
        .iter()
        .map(|v| {
            (
                v["version"].as_u64().unwrap(),
                v["active"].as_bool().unwrap(),
                v["current"].as_bool().unwrap(),
                v["rollback_target"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_listing_shows_every_version_the_active_one_and_the_rollback_target() {
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    let s = Server::start(&[]);
    let list = s.get("/v1/policies").body().clone();
    let first = list["active"]
        .as_str()
        .expect("a default policy serves")
        .to_string();
    assert_eq!(list["rollback_target"], Value::Null, "{list}");

    put_policy(&s, "native", &wasm, "?activate=true").expect(201);
    // A new configuration of the active policy is a new version that serves at once.
    s.put("/v1/policies/native/config", &json!({})).expect(200);
    let list = s.get("/v1/policies").body().clone();
    assert_eq!(list["active"], "native");
    assert_eq!(
        listed_versions(&list, "native"),
        [(1, false, false, true), (2, true, true, false)],
        "{list}"
    );
    assert_eq!(
        list["rollback_target"],
        json!({"name": "native", "version": 1})
    );
    // The list leaves the trapping imports to the detail endpoint.
    for p in list["policies"].as_array().unwrap() {
        assert!(p.get("trapping_imports").is_none(), "{p}");
    }
    // What the listing says rollback restores is what it restores.
    let back = s.post("/v1/policies/rollback", &json!({}));
    back.expect(200);
    assert_eq!(
        (&back.body()["name"], &back.body()["version"]),
        (&json!("native"), &json!(1))
    );
    let list = s.get("/v1/policies").body().clone();
    assert_eq!(
        listed_versions(&list, "native"),
        [(1, true, false, false), (2, false, true, false)],
        "the current version stays loaded beside the active older one: {list}"
    );
    let target = list["rollback_target"].clone();
    assert_eq!(target, json!({"name": first, "version": 1}), "{list}");
    let back = s.post("/v1/policies/rollback", &json!({}));
    back.expect(200);
    assert_eq!(back.body()["name"], target["name"]);
    // Version 1 was loaded only as the active one: no longer active, it is gone.
    let list = s.get("/v1/policies").body().clone();
    assert_eq!(
        listed_versions(&list, "native"),
        [(2, false, true, false)],
        "{list}"
    );

    // The detail: every version in full, with the trapping imports.
    s.post("/v1/policies/native/activate", &json!({}))
        .expect(200);
    s.put("/v1/policies/native/config", &json!({})).expect(200);
    let d = s.get("/v1/policies/native");
    d.expect(200);
    let versions = d.body()["versions"].as_array().unwrap().clone();
    assert_eq!(
        versions
            .iter()
            .map(|v| v["version"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [2, 3],
        "{d}"
    );
    for v in &versions {
        assert_eq!(v["name"], "native", "{v}");
        let traps = v["trapping_imports"].as_array().expect("trapping_imports");
        assert!(traps.iter().all(Value::is_string), "{v}");
        for k in [
            "digest",
            "loaded_at",
            "config",
            "stats",
            "current",
            "rollback_target",
        ] {
            assert!(v.get(k).is_some(), "detail lacks {k}: {v}");
        }
    }
    assert_eq!(
        versions
            .iter()
            .map(|v| v["current"] == true)
            .collect::<Vec<_>>(),
        [false, true]
    );
    s.get("/v1/policies/nope")
        .expect_error(404, "unknown_policy");
    s.get("/v1/policies/.hidden")
        .expect_error(400, "invalid_policy_name");
}

#[test]
fn every_policy_refusal_names_the_policy() {
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    let s = Server::start(&[]);
    let message = |r: &support::Resp| r.body()["error"]["message"].as_str().unwrap().to_string();

    let r = put_policy(&s, "junk", b"not wasm at all", "");
    r.expect_error(400, "not_wasm");
    assert!(message(&r).starts_with("policy \"junk\": "), "{r}");
    let r = put_policy(
        &s,
        "cfg",
        &wasm,
        "?config=%7B%22prefill_load_scale%22%3A-1%7D",
    );
    r.expect_error(400, "config_rejected");
    assert!(message(&r).starts_with("policy \"cfg\": "), "{r}");
    put_policy(&s, "native", &wasm, "").expect(201);
    let r = s.put(
        "/v1/policies/native/config",
        &json!({"prefill_load_scale": -1}),
    );
    r.expect_error(400, "config_rejected");
    assert!(message(&r).starts_with("policy \"native\": "), "{r}");
    // Messages that already name it are not prefixed twice.
    let r = s.post("/v1/policies/ghost/activate", &json!({}));
    r.expect_error(404, "unknown_policy");
    assert_eq!(message(&r).matches("\"ghost\"").count(), 1, "{r}");
    s.post("/v1/policies/native/activate", &json!({}))
        .expect(200);
    let r = s.delete("/v1/policies/native");
    r.expect_error(409, "policy_active");
    assert_eq!(message(&r).matches("\"native\"").count(), 1, "{r}");
}

#[test]
fn one_naming_rule_for_the_api_and_policy_new() {
    let s = Server::start(&[]);
    let wasm = support::plugin_bytes(NATIVE_PLUGIN);
    let dir = support::temp_dir("policy-names");
    let new = |name: &str| {
        command(&["policy", "new", name], &[])
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    // Names the API refuses, `policy new` refuses with the API's own words.
    for bad in ["rollback", ".hidden", "a/b"] {
        let api = put_policy(&s, bad, &wasm, "");
        let cli = new(bad);
        assert!(!cli.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&cli.stderr).to_string();
        if api.status == 400 {
            api.expect_error(400, "invalid_policy_name");
            let api_msg = api.body()["error"]["message"].as_str().unwrap().to_string();
            // The API's message (after its "policy NAME: " prefix, if any) is in the CLI's.
            let rule = api_msg.split("is invalid: ").nth(1).unwrap();
            assert!(err.contains(rule), "{bad}: {err} vs {api_msg}");
        }
    }
    // A valid policy name that cannot name a crate is explained, not just refused.
    let cli = new("Tuned.v2");
    assert!(!cli.status.success());
    let err = String::from_utf8_lossy(&cli.stderr);
    assert!(err.contains("valid policy name"), "{err}");
    put_policy(&s, "Tuned.v2", &wasm, "").expect(201);
    // A name both take: the crate's README serves it under that name.
    let out = new("same-name");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let readme = std::fs::read_to_string(dir.join("same-name/README.md")).unwrap();
    assert!(readme.contains("--policy-name same-name"), "{readme}");
    put_policy(&s, "same-name", &wasm, "").expect(201);
}
