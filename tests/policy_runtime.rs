//! The Wasm policy runtime against real components built from `plugins/` (deadlines and swaps
//! under load, which assert on time, are in `policy_deadlines.rs`).

use crate::support::plugins as support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::cost::native_costs;
use kvroute_core::{CandidateColumns, PolicyRequest};
use kvroute_policy::{
    FallbackReason, Outcome, PipelineSpec, PolicyError, PolicyRegistry, PolicyRuntimeConfig,
    TaintTable,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const NATIVE: &str = "kvroute-plugin-native-cost";
const MISBEHAVE: &str = "kvroute-test-misbehave";
const WRONG_WORLD: &str = "kvroute-test-wrong-world";

fn registry() -> PolicyRegistry {
    registry_with(PolicyRuntimeConfig::default())
}

fn registry_with(config: PolicyRuntimeConfig) -> PolicyRegistry {
    PolicyRegistry::new(config).expect("policy runtime")
}

fn decision(n: usize, seed: u64) -> (PolicyRequest, CandidateColumns) {
    support::random_decision(&mut SmallRng::seed_from_u64(seed), n, 4)
}

fn with_id(mut req: PolicyRequest, id: &str) -> PolicyRequest {
    req.request_id = id.to_string();
    req
}

fn assert_close(got: &[f64], want: &[f64], context: &str) {
    assert_eq!(got.len(), want.len(), "{context}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let scale = g.abs().max(w.abs());
        assert!(
            (g - w).abs() <= 1e-9 * scale || g == w,
            "{context}: candidate {i}: plugin {g} vs native {w}"
        );
    }
}

// ------------------------------------------------------------------------- refusing components

#[test]
fn configure_error_surfaces_verbatim() {
    let reg = registry();
    let bytes = support::plugin_bytes(MISBEHAVE);
    let message = "alpha must be in [0, 1], got 7 — see docs/alpha.md";
    let config = serde_json::json!({"mode": "reject", "message": message}).to_string();
    match reg.load("m", &bytes, Some(&config), true) {
        Err(PolicyError::ConfigRejected(m)) => assert_eq!(m, message),
        other => panic!("expected ConfigRejected, got {other:?}"),
    }
    assert!(reg.active().is_none());

    // The same through `configure` on a loaded policy: the old version keeps serving.
    reg.load("m", &bytes, None, true).expect("load ok config");
    let before = reg.active().expect("active").policy.clone();
    match reg.configure("m", &config) {
        Err(PolicyError::ConfigRejected(m)) => assert_eq!(m, message),
        other => panic!("expected ConfigRejected, got {other:?}"),
    }
    assert!(Arc::ptr_eq(&reg.active().expect("active").policy, &before));

    // native-cost's own message for an unknown key reaches the caller unchanged too.
    let native = support::plugin_bytes(NATIVE);
    match reg.load("n", &native, Some(r#"{"prefill_load_scal": 2}"#), false) {
        Err(PolicyError::ConfigRejected(m)) => {
            assert!(
                m.starts_with(
                    "native-cost: invalid configuration: unknown field `prefill_load_scal`"
                ),
                "{m}"
            )
        }
        other => panic!("expected ConfigRejected, got {other:?}"),
    }
    // Not JSON at all: refused by the host before the component sees it.
    assert!(matches!(
        reg.load("n", &native, Some("{nope"), false),
        Err(PolicyError::InvalidConfigJson(_))
    ));
}

#[test]
fn not_wasm_is_refused() {
    let reg = registry();
    let err = reg
        .load("x", b"#!/bin/sh\necho hi\n", None, true)
        .unwrap_err();
    assert!(matches!(err, PolicyError::NotWasm), "{err}");
    assert!(
        err.to_string().contains("not a WebAssembly binary"),
        "{err}"
    );
    assert!(matches!(
        reg.load("x", b"", None, true),
        Err(PolicyError::NotWasm)
    ));
}

#[test]
fn core_module_is_refused_as_not_a_component() {
    let reg = registry();
    // The smallest valid core module: magic + version 1.
    let err = reg.load("x", b"\0asm\x01\0\0\0", None, true).unwrap_err();
    assert!(matches!(err, PolicyError::NotAComponent), "{err}");
    assert!(err.to_string().contains("wasm32-wasip2"), "{err}");
}

#[test]
fn component_without_the_export_is_refused_as_wrong_world() {
    let reg = registry();
    // The smallest valid component: magic + component version/layer, nothing inside.
    let err = reg.load("x", b"\0asm\x0d\0\x01\0", None, true).unwrap_err();
    assert!(matches!(err, PolicyError::WrongWorld(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("missing export kvroute:policy/policy@0.10.0")
            && msg.contains("exports nothing"),
        "{msg}"
    );
}

#[test]
fn component_with_wrong_functions_is_refused_as_wrong_world() {
    let reg = registry();
    let bytes = support::plugin_bytes(WRONG_WORLD);
    let err = reg.load("x", &bytes, None, true).unwrap_err();
    assert!(matches!(err, PolicyError::WrongWorld(_)), "{err}");
    assert!(
        err.to_string().contains("info"),
        "should name the missing function: {err}"
    );
    assert!(reg.list().is_empty());
}

#[test]
fn self_test_refuses_a_component_that_always_misbehaves() {
    let reg = registry();
    let bytes = support::plugin_bytes(MISBEHAVE);
    for (mode, reason) in [
        ("nan", "non_finite"),
        ("wrong_length", "invalid_length"),
        ("trap", "trap"),
    ] {
        let config = serde_json::json!({ "mode": mode }).to_string();
        match reg.load("m", &bytes, Some(&config), true) {
            Err(PolicyError::SelfTest(m)) => assert!(m.contains(reason), "{mode}: {m}"),
            other => panic!("{mode}: expected SelfTest, got {other:?}"),
        }
    }
    assert!(reg.active().is_none());
}

#[test]
fn oversized_component_is_refused() {
    let reg = registry_with(PolicyRuntimeConfig {
        max_component_bytes: 1000,
        ..Default::default()
    });
    let bytes = support::plugin_bytes(NATIVE);
    assert!(matches!(
        reg.load("n", &bytes, None, true),
        Err(PolicyError::TooLarge { max: 1000, .. })
    ));
}

#[test]
fn slow_but_in_time_is_fine_and_pick_passes_through() {
    let reg = registry();
    let bytes = support::plugin_bytes(MISBEHAVE);
    reg.load(
        "slow",
        &bytes,
        Some(r#"{"mode":"slow","spin_iters":10000}"#),
        true,
    )
    .expect("load");
    let (req, cols) = decision(8, 1);
    let taints = support::taint_table(1, 4);
    let d = reg.decide(&req, &cols, &taints);
    match d.outcome {
        Outcome::Costs(c) => assert_eq!(c, cols.base_cost),
        other => panic!("{other:?}"),
    }
    reg.load("pick", &bytes, Some(r#"{"mode":"pick"}"#), true)
        .expect("load");
    assert_eq!(reg.decide(&req, &cols, &taints).outcome, Outcome::Pick(0));
}

#[test]
fn consecutive_failures_restore_the_previous_version() {
    let reg = registry();
    let taints = support::taint_table(1, 4);
    let (req, cols) = decision(16, 3);
    reg.load("good", &support::plugin_bytes(NATIVE), None, true)
        .expect("good");
    reg.load(
        "flaky",
        &support::plugin_bytes(MISBEHAVE),
        Some(r#"{"mode":"trap","trigger":"bad"}"#),
        true,
    )
    .expect("flaky");
    let limit = reg.config().max_consecutive_failures;
    assert_eq!(limit, 5);
    let bad = with_id(req.clone(), "bad");
    // Failed instances are replaced off the request path, and a decision that finds none ready
    // falls back at once (`instantiate`): each decision here first waits for a ready instance, so
    // that every one of them reaches the plugin.
    let ready = || {
        support::eventually("a ready instance", || {
            reg.active()
                .is_some_and(|a| a.policy.pooled_instances() > 0)
        })
    };
    // Failures interrupted by a success do not count as consecutive.
    for _ in 0..limit - 1 {
        ready();
        assert!(reg.decide(&bad, &cols, &taints).is_fallback());
    }
    ready();
    assert!(!reg.decide(&req, &cols, &taints).is_fallback());
    for i in 0..limit {
        assert_eq!(
            reg.active().expect("active").policy.name(),
            "flaky",
            "after {i} failures"
        );
        ready();
        assert_eq!(
            reg.decide(&bad, &cols, &taints).outcome,
            Outcome::Fallback(FallbackReason::Trap)
        );
    }
    assert_eq!(reg.active().expect("active").policy.name(), "good");
    assert_eq!(reg.counters().auto_restores.load(Ordering::Relaxed), 1);
    let d = reg.decide(&bad, &cols, &taints);
    assert!(matches!(d.outcome, Outcome::Costs(_)));
    assert_eq!(d.policy.expect("policy").name(), "good");

    // With nothing to restore, the policy is taken out and the native cost serves.
    let reg = registry();
    reg.load(
        "flaky",
        &support::plugin_bytes(MISBEHAVE),
        Some(r#"{"mode":"nan","trigger":"bad"}"#),
        true,
    )
    .expect("flaky");
    for _ in 0..limit {
        support::eventually("a ready instance", || {
            reg.active()
                .is_some_and(|a| a.policy.pooled_instances() > 0)
        });
        reg.decide(&bad, &cols, &taints);
    }
    assert!(reg.active().is_none());
    assert_eq!(
        reg.decide(&bad, &cols, &taints).outcome,
        Outcome::Fallback(FallbackReason::NoPolicy)
    );
}

// ------------------------------------------------------------------------- equivalence

#[test]
fn native_cost_plugin_equals_host_native_costs() {
    // Equivalence, not timing: an unoptimised (debug) host lowers 1,024-candidate columns slowly
    // enough to brush the 2 ms deadline on a loaded machine, so give it room.
    let reg = registry_with(PolicyRuntimeConfig {
        deadline_us: 100_000,
        ..Default::default()
    });
    let bytes = support::plugin_bytes(NATIVE);
    reg.load("recompute", &bytes, None, false).expect("load");
    reg.load("base", &bytes, Some(r#"{"use_base_cost": true}"#), false)
        .expect("load");
    let mut rng = SmallRng::seed_from_u64(2024);
    let mut want = Vec::new();
    for (version, name) in [(1u64, "recompute"), (2, "base")] {
        reg.activate(name).expect("activate");
        let taints = support::taint_table(version, 6);
        for round in 0..60 {
            let n = match round {
                0 => 1,
                1 => 1024,
                _ => rng.gen_range(1..=1024),
            };
            // The block size reaches the plugin through `set-context`: changing it between
            // decisions must reach every instance before its next `decide`.
            let block_size = [16, 64, 8, 32][round % 4];
            let (req, cols) = support::random_decision_with_block_size(&mut rng, n, 6, block_size);
            native_costs(&req, &cols, &mut want);
            let d = reg.decide(&req, &cols, &taints);
            let what = format!("{name} n={n} block_size={block_size}");
            match d.outcome {
                Outcome::Costs(got) => assert_close(&got, &want, &what),
                other => panic!("{what}: {other:?}"),
            }
        }
    }
}

/// `native-cost` answers the host's native costs bit for bit (not merely close) where no libm
/// function is involved, at every candidate count around its four-candidate SIMD blocks and with
/// figures at their extremes: `u64` loads past 2^53 (where `u64 as f64` rounds), overlaps near
/// `u32::MAX`, zero prefill; and with preferred taints (0 to 7 of them, repeated ids among them,
/// candidates with up to 6 taints) within 4 units in the last place.
#[test]
fn native_cost_plugin_equals_host_native_costs_bit_for_bit() {
    let reg = registry_with(PolicyRuntimeConfig {
        deadline_us: 100_000,
        ..Default::default()
    });
    let bytes = support::plugin_bytes(NATIVE);
    reg.load("recompute", &bytes, None, true).expect("load");
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let taints = support::taint_table(1, 6);
    let mut want = Vec::new();
    let sizes = (1..=13).chain([63, 64, 65, 255, 1024]);
    for (round, n) in sizes.enumerate() {
        for variant in 0..4 {
            let block_size = [16, 1, 64, 7][variant];
            let (mut req, mut cols) =
                support::random_decision_with_block_size(&mut rng, n, 6, block_size);
            let u64s = |rng: &mut SmallRng| match rng.gen_range(0..6) {
                0 => 0,
                1 => u64::MAX - rng.gen_range(0..4096),
                2 => (1 << 53) + rng.gen_range(0..4096),
                3 => rng.gen::<u64>() >> rng.gen_range(0..64),
                _ => rng.gen_range(0..65_536),
            };
            let u32s = |rng: &mut SmallRng| match rng.gen_range(0..4) {
                0 => 0,
                1 => u32::MAX - rng.gen_range(0..16),
                2 => rng.gen::<u32>(),
                _ => rng.gen_range(0..512),
            };
            if variant >= 2 {
                req.prompt_tokens = u32s(&mut rng);
                for i in 0..n {
                    cols.active_prefill_tokens[i] = u64s(&mut rng);
                    cols.active_decode_blocks[i] = u64s(&mut rng);
                    cols.device_overlap[i] = u32s(&mut rng);
                    cols.host_overlap[i] = u32s(&mut rng);
                    cols.disk_overlap[i] = u32s(&mut rng);
                    cols.active_prompt_blocks[i] = u32s(&mut rng);
                }
            }
            // Every preference count up to the per-subset limit and one past it.
            req.preferred_taints = (0..(round + variant) as u32 % 8)
                .map(|id| (id % 6, rng.gen_range(-0.99f32..0.99)))
                .collect();
            kvroute_core::cost::fill_base_costs(
                &req,
                &mut cols,
                &kvroute_core::cost::CostWeights::default(),
            );
            // Without preferences, bit for bit; with them, within a few units in the last place:
            // `tanh` and `exp` come from the guest's libm there and the host's here, which may
            // round their last bit differently (a subset's weight missed or added would be off
            // by far more).
            let prefs = std::mem::take(&mut req.preferred_taints);
            for with_prefs in [false, true] {
                if with_prefs {
                    req.preferred_taints = prefs.clone();
                }
                native_costs(&req, &cols, &mut want);
                let what = format!("n={n} variant={variant} preferences={with_prefs}");
                let got = match reg.decide(&req, &cols, &taints).outcome {
                    Outcome::Costs(got) => got,
                    other => panic!("{what}: {other:?}"),
                };
                assert_eq!(got.len(), n, "{what}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let ulps = (g.to_bits() as i64 - w.to_bits() as i64).unsigned_abs();
                    let most = if with_prefs { 4 } else { 0 };
                    assert!(
                        ulps <= most,
                        "{what}: candidate {i}: plugin {g} vs native {w}"
                    );
                }
            }
        }
    }
}

/// Interface 0.10.0: the host computes the base cost only for versions whose `configure` says
/// they read it; a version that reads it and gets columns without it asks for it (nothing run,
/// nothing counted), and one that does not answers the same costs either way.
#[test]
fn the_base_cost_is_computed_only_for_versions_that_read_it() {
    let reg = registry_with(PolicyRuntimeConfig {
        deadline_us: 100_000,
        ..Default::default()
    });
    // No policy: the native cost decides, which reads it.
    assert!(reg.reads_base_cost());
    let bytes = support::plugin_bytes(NATIVE);
    reg.load("recompute", &bytes, None, true).expect("load");
    reg.load("base", &bytes, Some(r#"{"use_base_cost": true}"#), false)
        .expect("load");
    assert!(
        !reg.reads_base_cost(),
        "native-cost recomputes the base cost"
    );
    let taints = support::taint_table(1, 4);
    for seed in 0..20 {
        let (req, cols) = decision(1 + seed as usize * 13, seed);
        let mut bare = cols.clone();
        bare.base_cost.clear();
        let (with, without) = (
            reg.decide(&req, &cols, &taints).outcome,
            reg.decide(&req, &bare, &taints).outcome,
        );
        match (with, without) {
            (Outcome::Costs(a), Outcome::Costs(b)) => assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "seed {seed}"
            ),
            other => panic!("seed {seed}: {other:?}"),
        }
    }
    let decided = reg
        .get("recompute")
        .expect("loaded")
        .stats()
        .snapshot()
        .calls;
    // A shadow that reads it makes every decision compute it.
    reg.start_shadow(
        "base",
        &kvroute_policy::ShadowSpec {
            version: None,
            sample: 1.0,
        },
    )
    .expect("shadow");
    assert!(reg.reads_base_cost());
    reg.stop_shadow("base").expect("stop");
    assert!(!reg.reads_base_cost());
    // The active version reads it: columns without it are sent back, and nothing is counted.
    reg.activate("base").expect("activate");
    assert!(reg.reads_base_cost());
    let (req, mut cols) = decision(8, 99);
    cols.base_cost.clear();
    let before = reg.get("base").expect("loaded").stats().snapshot().calls;
    assert!(matches!(
        reg.decide(&req, &cols, &taints).outcome,
        Outcome::NeedsBaseCost
    ));
    assert_eq!(
        reg.get("base").expect("loaded").stats().snapshot().calls,
        before
    );
    assert!(decided >= 40, "{decided} decisions counted for recompute");
}

// ------------------------------------------------------------------------- administration

#[test]
fn activate_rollback_remove_list() {
    let reg = registry();
    let bytes = support::plugin_bytes(NATIVE);
    let a = reg.load("a", &bytes, None, true).expect("a");
    assert_eq!((a.version, a.active), (1, true));
    assert_eq!(a.digest, kvroute_policy::sha256_hex(&bytes));
    assert_eq!(
        a.plugin.as_ref().map(|p| p.name.as_str()),
        Some("native-cost")
    );
    let b = reg.load("b", &bytes, None, false).expect("b");
    assert!(!b.active);
    assert_eq!(reg.active().expect("active").policy.name(), "a");
    reg.activate("b").expect("activate b");
    assert!(matches!(reg.remove("b"), Err(PolicyError::ActivePolicy(_))));
    let back = reg.rollback().expect("rollback");
    assert_eq!(back.name, "a");
    assert!(matches!(reg.rollback(), Err(PolicyError::NoPrevious)));
    reg.remove("b").expect("remove b");
    assert!(matches!(
        reg.remove("b"),
        Err(PolicyError::UnknownPolicy(_))
    ));
    assert!(matches!(
        reg.activate("zzz"),
        Err(PolicyError::UnknownPolicy(_))
    ));
    assert!(matches!(
        reg.load("bad name", &bytes, None, false),
        Err(PolicyError::InvalidName(_))
    ));

    // Reconfiguring the active policy swaps in a new version; rollback returns to the old one.
    let a2 = reg
        .configure("a", r#"{"use_base_cost": true}"#)
        .expect("configure");
    assert_eq!((a2.version, a2.active), (2, true));
    assert_eq!(reg.active().expect("active").policy.version(), 2);
    let list = reg.list();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].config, r#"{"use_base_cost": true}"#);
    reg.rollback().expect("rollback to v1");
    assert_eq!(reg.active().expect("active").policy.version(), 1);
    let json = serde_json::to_value(reg.list()).expect("serialize");
    assert!(json.to_string().contains("\"p99_us\""), "{json}");

    // check() validates without installing.
    let report = reg.check(&bytes, None).expect("check");
    assert_eq!(report.plugin.map(|p| p.abi_version), Some(10));
    assert_eq!(reg.list().len(), 2);
}

#[test]
fn pipeline_sums_weighted_stages_and_selector_picks() {
    let reg = registry();
    let native = support::plugin_bytes(NATIVE);
    reg.load("native", &native, None, false).expect("native");
    let spec = PipelineSpec::from_json(
        r#"{"stages": [{"component": "native", "weight": 1.0},
                       {"component": "native", "config": {"use_base_cost": true}, "weight": 0.5}]}"#,
    )
    .expect("spec");
    let info = reg
        .load_pipeline("combo", &spec, None, true)
        .expect("pipeline");
    assert_eq!(info.stages.as_ref().map(Vec::len), Some(2));
    let taints = support::taint_table(1, 4);
    let (mut req, cols) = decision(32, 5);
    req.preferred_taints.clear();
    let d = reg.decide(&req, &cols, &taints);
    let want: Vec<f64> = cols.base_cost.iter().map(|c| 1.5 * c).collect();
    match d.outcome {
        Outcome::Costs(c) => assert_close(&c, &want, "pipeline"),
        other => panic!("{other:?}"),
    }

    // A selector sees the weighted sum and picks.
    let misbehave = support::build_plugin(MISBEHAVE);
    let spec = PipelineSpec::from_json(&format!(
        r#"{{"stages": [{{"component": "native"}}],
             "selector": {{"component": {:?}, "config": {{"mode": "pick"}}}}}}"#,
        misbehave.display().to_string()
    ))
    .expect("spec");
    reg.load_pipeline("picker", &spec, None, true)
        .expect("pipeline with selector");
    assert_eq!(reg.decide(&req, &cols, &taints).outcome, Outcome::Pick(0));

    // Bad declarations are refused with the reason.
    for (json, needle) in [
        (r#"{}"#, "at least one"),
        (
            r#"{"stages": [{"component": "nope"}]}"#,
            "neither a loaded policy",
        ),
        (
            r#"{"stages": [{"component": "native", "wieght": 1}]}"#,
            "unknown field",
        ),
    ] {
        let err = PipelineSpec::from_json(json)
            .and_then(|s| reg.load_pipeline("p", &s, None, false))
            .unwrap_err();
        assert!(err.to_string().contains(needle), "{json}: {err}");
    }
}

#[test]
fn files_present_at_start_do_not_displace_an_explicit_policy() {
    use kvroute_policy::DirectoryScanner;
    let reg = Arc::new(registry());
    let native = support::plugin_bytes(NATIVE);
    reg.load("explicit", &native, None, true).expect("load");
    let dir = support::temp_dir("policy-watch-keep");
    std::fs::write(dir.join("other.wasm"), &native).expect("write");
    let mut scanner = DirectoryScanner::new(&dir).keep_active_at_start(true);
    scanner.scan(&reg);
    assert_eq!(scanner.scan(&reg).loaded, vec!["other".to_string()]);
    assert!(reg.get("other").is_some(), "loaded");
    assert_eq!(
        reg.active().expect("active").policy.name(),
        "explicit",
        "the policy chosen at start stays active"
    );
    // A change afterwards is an operator's swap: it activates.
    std::fs::write(dir.join("other.json"), r#"{"use_base_cost": true}"#).expect("write");
    scanner.scan(&reg);
    assert_eq!(scanner.scan(&reg).loaded, vec!["other".to_string()]);
    assert_eq!(reg.active().expect("active").policy.name(), "other");
    // So does a file that was not there at start.
    std::fs::write(dir.join("third.wasm"), &native).expect("write");
    scanner.scan(&reg);
    assert_eq!(scanner.scan(&reg).loaded, vec!["third".to_string()]);
    assert_eq!(reg.active().expect("active").policy.name(), "third");
}

#[test]
fn watched_directory_loads_valid_files_and_keeps_serving_on_invalid_ones() {
    use kvroute_policy::DirectoryScanner;
    let reg = Arc::new(registry());
    let dir = support::temp_dir("policy-watch");
    let native = support::plugin_bytes(NATIVE);
    let mut scanner = DirectoryScanner::new(&dir);

    std::fs::write(dir.join("alpha.wasm"), &native).expect("write");
    assert!(
        scanner.scan(&reg).loaded.is_empty(),
        "a file is loaded once it is seen unchanged twice"
    );
    assert_eq!(scanner.scan(&reg).loaded, vec!["alpha".to_string()]);
    assert_eq!(reg.active().expect("active").policy.name(), "alpha");
    assert_eq!(
        scanner.scan(&reg),
        Default::default(),
        "unchanged: nothing to do"
    );

    // An invalid file is refused; alpha keeps serving.
    std::fs::write(dir.join("beta.wasm"), b"not wasm").expect("write");
    scanner.scan(&reg);
    let report = scanner.scan(&reg);
    assert_eq!(report.rejected.len(), 1, "{report:?}");
    assert!(report.rejected[0].1.contains("not a WebAssembly binary"));
    assert_eq!(reg.active().expect("active").policy.name(), "alpha");
    assert_eq!(reg.counters().watch_rejected.load(Ordering::Relaxed), 1);
    assert_eq!(
        scanner.scan(&reg),
        Default::default(),
        "not retried until it changes"
    );

    // A config file beside it reconfigures (new version).
    std::fs::write(dir.join("alpha.json"), r#"{"use_base_cost": true}"#).expect("write");
    scanner.scan(&reg);
    assert_eq!(scanner.scan(&reg).loaded, vec!["alpha".to_string()]);
    assert_eq!(reg.active().expect("active").policy.version(), 2);

    // The background watcher does the same on its own.
    let watcher = reg
        .watch_directory(&dir, Duration::from_millis(20))
        .expect("watch");
    std::fs::write(dir.join("gamma.wasm"), &native).expect("write");
    support::eventually("gamma active", || {
        reg.active().is_some_and(|a| a.policy.name() == "gamma")
    });
    watcher.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plugin_logs_are_rate_limited() {
    let reg = registry_with(PolicyRuntimeConfig {
        log_burst: 3,
        log_lines_per_second: 1,
        instances_per_stage: 1,
        ..Default::default()
    });
    reg.load(
        "chatty",
        &support::plugin_bytes(MISBEHAVE),
        Some(r#"{"mode":"ok","log":"hello"}"#),
        true,
    )
    .expect("load");
    let (req, cols) = decision(4, 9);
    let taints = support::taint_table(1, 4);
    for _ in 0..20 {
        assert!(!reg.decide(&req, &cols, &taints).is_fallback());
    }
    let dropped = reg
        .active()
        .expect("active")
        .policy
        .stats()
        .snapshot()
        .log_dropped;
    assert!(dropped >= 15, "dropped {dropped}");
}

#[test]
fn no_policy_empty_and_inconsistent_candidates() {
    let reg = registry();
    let (req, cols) = decision(4, 1);
    let d = reg.decide(&req, &cols, &TaintTable::default());
    assert_eq!(d.outcome, Outcome::Fallback(FallbackReason::NoPolicy));
    assert!(d.policy.is_none());
    reg.load("n", &support::plugin_bytes(NATIVE), None, true)
        .expect("load");
    let d = reg.decide(&req, &CandidateColumns::default(), &TaintTable::default());
    assert_eq!(d.outcome, Outcome::Costs(vec![]));
    // Inconsistent columns are a router bug: not sent to the policy, not counted against it.
    let mut broken = cols.clone();
    broken.base_cost.pop();
    let d = reg.decide(&req, &broken, &TaintTable::default());
    assert_eq!(d.outcome, Outcome::Fallback(FallbackReason::InvalidColumns));
    assert_eq!(d.policy.expect("policy").stats().snapshot().errors, 0);
}

#[test]
fn runtime_config_is_validated() {
    let bad = PolicyRuntimeConfig {
        deadline_us: 10,
        ..Default::default()
    };
    assert!(matches!(
        PolicyRegistry::new(bad),
        Err(PolicyError::RuntimeConfig(_))
    ));
    let err = serde_json::from_str::<PolicyRuntimeConfig>(r#"{"deadline_ms": 2}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field"), "{err}");
}

// ------------------------------------------------------------------------- stateful plugins

/// The candidates `keep` of `c`, in order.
fn subset(c: &CandidateColumns, keep: &[usize]) -> CandidateColumns {
    let mut out = CandidateColumns {
        taint_offsets: vec![0],
        ..Default::default()
    };
    for &i in keep {
        out.worker_id.push(c.worker_id[i]);
        out.dp_rank.push(c.dp_rank[i]);
        out.device_overlap.push(c.device_overlap[i]);
        out.host_overlap.push(c.host_overlap[i]);
        out.disk_overlap.push(c.disk_overlap[i]);
        out.active_prefill_tokens.push(c.active_prefill_tokens[i]);
        out.active_decode_blocks.push(c.active_decode_blocks[i]);
        out.active_requests.push(c.active_requests[i]);
        out.active_prompt_blocks.push(c.active_prompt_blocks[i]);
        out.total_kv_blocks.push(c.total_kv_blocks[i]);
        out.max_num_batched_tokens.push(c.max_num_batched_tokens[i]);
        out.base_cost.push(c.base_cost[i]);
        if c.prefill_ms_per_token.len() == c.len() {
            out.prefill_ms_per_token.push(c.prefill_ms_per_token[i]);
            out.decode_step_ms.push(c.decode_step_ms[i]);
        }
        out.taint_ids.extend_from_slice(c.taints_of(i));
        out.taint_offsets.push(out.taint_ids.len() as u32);
    }
    out
}

/// `session-affinity` (stateless since interface 0.8.0: the host keeps the bindings). Across the
/// pool's several instances, a replaced instance, and a swap to a new version, every decision
/// stays valid (only current candidates), and sessions still land where they lived.
#[test]
fn session_affinity_is_safe_across_instances_and_swaps() {
    let reg = registry_with(PolicyRuntimeConfig {
        instances_per_stage: 3,
        deadline_us: 100_000,
        ..Default::default()
    });
    let bytes = support::plugin_bytes("kvroute-plugin-session-affinity");
    reg.load("sticky", &bytes, Some(r#"{"fallback": "hash"}"#), true)
        .expect("load");
    let taints = support::taint_table(1, 4);
    let (base_req, mut cols) = decision(16, 9);
    // No hard limits of the policy get in the way in this test.
    cols.total_kv_blocks.iter_mut().for_each(|k| *k = 0);
    let session_req = |s: &str, at: u64| {
        let mut r = base_req.clone();
        r.session_id = Some(s.to_string());
        r.now_ms = at;
        r
    };
    let pick = |reg: &PolicyRegistry, r: &PolicyRequest, cols: &CandidateColumns| match reg
        .decide(r, cols, &taints)
        .outcome
    {
        Outcome::Pick(i) => cols.key(i),
        other => panic!("expected a pick, got {other:?}"),
    };
    let sessions: Vec<String> = (0..40).map(|i| format!("conv-{i}")).collect();
    let t0 = 1_700_000_000_000;
    let homes: Vec<_> = sessions
        .iter()
        .map(|s| pick(&reg, &session_req(s, t0), &cols))
        .collect();

    // Concurrent callers use different instances of the pool: every one agrees.
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (reg, sessions, homes, cols) = (&reg, &sessions, &homes, &cols);
            scope.spawn(move || {
                for round in 0..20u64 {
                    for (s, home) in sessions.iter().zip(homes) {
                        assert_eq!(
                            pick(reg, &session_req(s, t0 + round * 10 + t), cols),
                            *home,
                            "{s} moved between instances"
                        );
                    }
                }
            });
        }
    });
    let live = reg
        .list()
        .into_iter()
        .find(|p| p.name == "sticky")
        .map_or(0, |p| p.instances);
    assert!(live >= 2, "several instances served ({live})");

    // A swap: fresh instances of a new version place every session where it lived.
    reg.load(
        "sticky-v2",
        &bytes,
        Some(r#"{"fallback": "hash", "max_kv_usage": 0.9}"#),
        true,
    )
    .expect("swap");
    for (s, home) in sessions.iter().zip(&homes) {
        assert_eq!(
            pick(&reg, &session_req(s, t0 + 1_000), &cols),
            *home,
            "{s} after swap"
        );
    }

    // A home that is no longer eligible is never used: its sessions move, the rest stay.
    let gone = homes[0];
    let keep: Vec<usize> = (0..cols.len()).filter(|&i| cols.key(i) != gone).collect();
    let reduced = subset(&cols, &keep);
    for (s, home) in sessions.iter().zip(&homes) {
        let now = pick(&reg, &session_req(s, t0 + 2_000), &reduced);
        assert_ne!(now, gone);
        if *home != gone {
            assert_eq!(now, *home, "{s} moved although its home stayed");
        }
    }

    // Default placement (by cost): after a swap, a session returns to the candidate holding its
    // prefix, which is what an instance without memory sees.
    reg.load("sticky-cost", &bytes, None, true)
        .expect("cost fallback");
    let mut warm = cols.clone();
    let home = pick(&reg, &session_req("chat", t0), &warm);
    let h = (0..warm.len()).find(|&i| warm.key(i) == home).unwrap();
    warm.device_overlap[h] = base_req.request_blocks;
    kvroute_core::cost::fill_base_costs(&base_req, &mut warm, &Default::default());
    reg.load("sticky-cost-v2", &bytes, None, true)
        .expect("swap");
    assert_eq!(pick(&reg, &session_req("chat", t0 + 5), &warm), home);
}
