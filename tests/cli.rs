//! End-to-end tests of the plugin author's tools: `kvroute policy check` on every shipped plugin
//! (it must pass) and on broken components (it must fail, saying what is wrong), and
//! `kvroute policy new` (the scaffold must build and pass the check as created).
//!
//! Everything runs the real binary on real components built from `plugins/`.

use crate::support;

use std::process::Output;

use support::{build_plugin, command, workspace_root};

/// Every plugin the repository ships, with the configurations its documentation shows.
const SHIPPED: &[(&str, &[&str])] = &[
    ("kvroute-plugin-default", &["{}", r#"{"work_weight": 4.0}"#]),
    ("kvroute-plugin-dynamo", &["{}"]),
    (
        "kvroute-plugin-native-cost",
        &["{}", r#"{"use_base_cost": true}"#],
    ),
    (
        "kvroute-plugin-cache-balanced",
        &["{}", r#"{"cache_threshold": 0.3}"#],
    ),
    ("kvroute-plugin-preferred-taints", &["{}"]),
    (
        "kvroute-plugin-session-affinity",
        &["{}", r#"{"fallback": "hash", "max_kv_usage": 0.9}"#],
    ),
    (
        "kvroute-plugin-ttft-aware",
        &["{}", r#"{"work_weight": 0}"#],
    ),
];

/// A per-call deadline for checks that are about behaviour, not speed: the other tests of this
/// file build components with cargo at the same time, and on a 2-core machine a 1,024-candidate
/// call can then miss the 2 ms default for want of CPU. Deadlines themselves are tested with the
/// `misbehave` builds (which use the default) and in `host/tests/policy_deadlines.rs`.
const FUNCTIONAL_DEADLINE: [&str; 2] = ["--deadline-us", "50000"];

fn check(wasm: &std::path::Path, extra: &[&str]) -> (Output, String) {
    let mut args = vec!["policy", "check", wasm.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = command(&args, &[])
        .output()
        .expect("running kvroute policy check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

#[test]
fn policy_check_passes_every_shipped_plugin() {
    for (package, configs) in SHIPPED {
        let wasm = build_plugin(package);
        for config in *configs {
            let args = [&["--config", *config][..], &FUNCTIONAL_DEADLINE].concat();
            let (out, text) = check(&wasm, &args);
            assert!(
                out.status.success(),
                "{package} with {config} should pass `policy check`:\n{text}"
            );
            assert!(!text.contains("[FAIL]"), "{package} {config}:\n{text}");
            assert!(
                text.contains("1024 candidates"),
                "the suite covers 1,024 candidates: {text}"
            );
            for stage in ["aggregated", "prefill", "decode"] {
                assert!(
                    text.contains(&format!("1024 candidates, {stage:<10}:")),
                    "the suite covers the {stage} stage: {text}"
                );
            }
            assert!(
                text.contains("stages: whole prompt cached vs idle"),
                "the report says what the plugin prefers at each stage: {text}"
            );
            assert!(text.contains("latency at 64 candidates"), "{text}");
        }
    }
}

#[test]
fn policy_check_takes_any_deadline_in_its_range() {
    let wasm = build_plugin("kvroute-plugin-default");
    // A short deadline gets a clock and grace window that fit inside it: the suite runs (whether
    // every scenario meets 300 us on a busy machine is not the point here).
    let (_, text) = check(&wasm, &["--deadline-us", "300"]);
    assert!(
        !text.contains("invalid policy runtime configuration"),
        "{text}"
    );
    assert!(text.contains("latency at 64 candidates"), "{text}");
    assert!(
        text.contains("deadline 300"),
        "the report names the deadline: {text}"
    );
    // Outside the range: a usage error naming the flag.
    let (out, text) = check(&wasm, &["--deadline-us", "50"]);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("--deadline-us"), "{text}");
}

#[test]
fn policy_check_fails_broken_plugins_and_says_why() {
    let wasm = build_plugin("kvroute-test-misbehave");
    // `trigger` makes the plugin behave during the load-time self-test (whose request ids never
    // contain "check-64") and misbehave in the suite's 64-candidate scenarios.
    let cases: &[(&str, &str)] = &[
        (
            r#"{"mode": "wrong_length", "trigger": "check-64"}"#,
            "invalid_length",
        ),
        (r#"{"mode": "nan", "trigger": "check-64"}"#, "non_finite"),
        (r#"{"mode": "trap", "trigger": "check-64"}"#, "trap"),
        (
            r#"{"mode": "pick_out_of_range", "trigger": "check-64"}"#,
            "pick_out_of_range",
        ),
        (r#"{"mode": "loop", "trigger": "check-64"}"#, "deadline"),
    ];
    for (config, reason) in cases {
        let (out, text) = check(&wasm, &["--config", config]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{config} must fail the check:\n{text}"
        );
        let failing: Vec<&str> = text.lines().filter(|l| l.contains("[FAIL]")).collect();
        assert!(
            failing
                .iter()
                .any(|l| l.contains("64 candidates") && l.contains(reason)),
            "{config}: expected a failing 64-candidate line naming {reason}:\n{text}"
        );
        assert!(
            !failing.iter().any(|l| l.contains("   8 candidates")),
            "{config}: 8-candidate scenarios behave and must pass:\n{text}"
        );
        assert!(
            text.contains("FAIL:"),
            "a summary line says it failed: {text}"
        );
    }

    // Says it does not read the base cost, and answers exactly that: every scenario fails,
    // naming the misdeclaration (the host would send NaN there).
    let (out, text) = check(&wasm, &["--config", r#"{"no_base_cost": true}"#]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let failing: Vec<&str> = text.lines().filter(|l| l.contains("[FAIL]")).collect();
    assert!(
        failing.iter().any(|l| l.contains("64 candidates")
            && l.contains("does not read base-cost")
            && l.contains("host-columns.base-cost")),
        "expected failing lines naming the misdeclared base cost:\n{text}"
    );

    // Slow but correct: fails only the latency check, against a deadline the operator chose.
    let (out, text) = check(
        &wasm,
        &[
            "--config",
            r#"{"mode": "slow", "spin_iters": 3000000}"#,
            "--deadline-us",
            "100000",
        ],
    );
    assert!(out.status.success(), "slow within 100 ms passes:\n{text}");
    let (out, text) = check(
        &wasm,
        &[
            "--config",
            r#"{"mode": "slow", "spin_iters": 3000000, "trigger": "check-64"}"#,
            "--deadline-us",
            "200",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "slow past 200 µs fails:\n{text}"
    );
    assert!(text.contains("deadline"), "{text}");

    // Slow on every call (tens of ms against 500 µs): it could never serve, so it is refused at
    // load, saying so.
    let (out, text) = check(
        &wasm,
        &[
            "--config",
            r#"{"mode": "slow", "spin_iters": 60000000}"#,
            "--deadline-us",
            "500",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("serving deadline of 500 µs") && text.contains("policy_runtime.deadline_us"),
        "{text}"
    );

    // Misbehaving from the first call: refused at load, with the reason.
    let (out, text) = check(&wasm, &["--config", r#"{"mode": "nan"}"#]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("self-test"), "{text}");
    // A configuration the plugin rejects: its message verbatim.
    let (out, text) = check(
        &wasm,
        &[
            "--config",
            r#"{"mode": "reject", "message": "no such knob: x"}"#,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("no such knob: x"), "{text}");
    // Not a component at all.
    let bogus = support::temp_dir("check-bogus").join("bogus.wasm");
    std::fs::write(&bogus, b"\0asm\x01\0\0\0").unwrap();
    let (out, text) = check(&bogus, &[]);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("component"), "{text}");
}

#[test]
fn policy_new_scaffold_builds_and_passes_check() {
    let dir = support::temp_dir("scaffold");
    let out = command(&["policy", "new", "fresh-policy"], &[])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "policy new: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let krate = dir.join("fresh-policy");
    assert!(krate.join("Cargo.toml").is_file() && krate.join("src/lib.rs").is_file());
    // Scaffolding over an existing directory is refused, leaving it untouched.
    let again = command(&["policy", "new", "fresh-policy"], &[])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let bad = command(&["policy", "new", "Bad Name"], &[])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a plugin name"));

    // Share the plugins' target directory: the crate's dependencies are the same ones.
    let target = workspace_root().join("target").join("wasm-plugins");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let build = || {
        std::process::Command::new(&cargo)
            .current_dir(&krate)
            .args(["build", "--release", "--target", "wasm32-wasip2"])
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .output()
            .unwrap()
    };
    let built = build();
    assert!(
        built.status.success(),
        "the scaffold must build as created:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let wasm = target.join("wasm32-wasip2/release/fresh_policy.wasm");
    let (out, text) = check(&wasm, &FUNCTIONAL_DEADLINE);
    assert!(
        out.status.success(),
        "the scaffold passes the check:\n{text}"
    );
    let args = [
        &["--config", r#"{"cache_weight": 0.5}"#][..],
        &FUNCTIONAL_DEADLINE,
    ]
    .concat();
    let (out, text) = check(&wasm, &args);
    assert!(out.status.success(), "with its documented config:\n{text}");
    let (out, text) = check(&wasm, &["--config", r#"{"cache_wieght": 0.5}"#]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "a misspelt key is refused:\n{text}"
    );
    assert!(text.contains("cache_wieght"), "{text}");

    // A panic reaches the author as its message and location (the SDK's hook logs it through
    // the host before the trap), not as a missing stderr import.
    let lib = krate.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).unwrap();
    let marker = "        Decision::Costs(";
    assert!(
        source.contains(marker),
        "the scaffold's decide changed:\n{source}"
    );
    // The scaffold with `code` inserted at the top of decide, built and checked.
    let variant = |code: &str, args: &[&str]| {
        let changed = source.replacen(marker, &format!("{code}\n{marker}"), 1);
        std::fs::write(&lib, changed).unwrap();
        let built = build();
        assert!(
            built.status.success(),
            "{}",
            String::from_utf8_lossy(&built.stderr)
        );
        let (out, text) = check(&wasm, args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{code} must fail the check:\n{text}"
        );
        text
    };
    let text = variant(
        "        if !c.is_empty() { panic!(\"gave up on {} candidates\", c.count()); }",
        &[],
    );
    assert!(
        text.contains("panicked at src/lib.rs") && text.contains("gave up on"),
        "the panic's location and message are shown:\n{text}"
    );
    assert!(!text.contains("get-stderr"), "{text}");

    // A policy that only fails on a prompt shorter than a block (request_blocks = 0) loads, and
    // the check still finds it, naming the scenario and the panic.
    let text = variant(
        "        std::hint::black_box(1000 / req.request_blocks);",
        &FUNCTIONAL_DEADLINE,
    );
    let failing: Vec<&str> = text.lines().filter(|l| l.contains("[FAIL]")).collect();
    assert!(!failing.is_empty(), "{text}");
    assert!(
        failing
            .iter()
            .all(|l| l.contains("0 complete blocks") && l.contains("divide by zero")),
        "only the short prompt fails, and says why:\n{text}"
    );

    // A scorer (the scaffold's declared kind) that answers a pick is told to declare its kind.
    let text = variant(
        "        #[allow(unreachable_code)]\n        return Decision::Pick(0);",
        &FUNCTIONAL_DEADLINE,
    );
    assert!(text.contains("declares a scorer"), "{text}");
}

/// The SDK generates its bindings from its own copy of the interface (sdk/wit, inside the published
/// package); it must be the interface the host implements.
#[test]
fn the_sdk_packages_the_hosts_wit() {
    let root = workspace_root();
    let host = std::fs::read_to_string(root.join("wit/policy.wit")).unwrap();
    let sdk = std::fs::read_to_string(root.join("sdk/wit/policy.wit")).unwrap();
    assert!(
        host == sdk,
        "sdk/wit/policy.wit differs from wit/policy.wit: copy wit/policy.wit to sdk/wit/"
    );
}
