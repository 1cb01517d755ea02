//! The policy interface is language-neutral: a plugin written in Python (`plugins/python-native-cost`,
//! built here with `componentize-py` from PyPI) loads into the same runtime as the Rust plugins
//! and answers exactly the host's native costs.
//!
//! `componentize-py` comes from the tests' own Python environment (`support::python`).

use crate::support::plugins as support;

use std::path::PathBuf;
use std::process::Command;

use kvroute_core::cost::{fill_base_costs, native_costs, CostWeights};
use kvroute_policy::{Outcome, PolicyRegistry, PolicyRuntimeConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Builds the Python plugin (once per process; again only when its sources changed).
fn python_plugin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = support::workspace_root();
            let src = root.join("plugins/python-native-cost");
            let out_dir = root.join("target/wasm-plugins");
            std::fs::create_dir_all(&out_dir).unwrap();
            let out = out_dir.join("python-native-cost.wasm");
            let newest_input = [src.join("app.py"), root.join("wit/policy.wit")]
                .iter()
                .filter_map(|p| p.metadata().and_then(|m| m.modified()).ok())
                .max()
                .unwrap();
            let fresh = out
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > newest_input);
            if !fresh {
                let result = Command::new(crate::support::python::bin("componentize-py"))
                    .current_dir(&root)
                    .args([
                        "-d",
                        "wit",
                        "-w",
                        "policy-plugin",
                        "componentize",
                        "app",
                        "-p",
                    ])
                    .arg(&src)
                    .arg("-o")
                    .arg(&out)
                    .output()
                    .unwrap_or_else(|e| panic!("could not run componentize-py: {e}"));
                assert!(
                    result.status.success(),
                    "componentize-py failed:\n{}{}",
                    String::from_utf8_lossy(&result.stdout),
                    String::from_utf8_lossy(&result.stderr)
                );
            }
            out
        })
        .clone()
}

#[test]
fn python_plugin_answers_the_native_costs() {
    // Equivalence, not speed: Python needs far longer than the default 2 ms for big sets (its
    // latency is measured in BENCHMARKS.md), so this registry allows a second per call.
    let reg = PolicyRegistry::new(PolicyRuntimeConfig {
        deadline_us: 1_000_000,
        setup_deadline_ms: 10_000,
        ..Default::default()
    })
    .unwrap();
    let bytes = std::fs::read(python_plugin()).unwrap();
    let loaded = reg
        .load("py", &bytes, None, true)
        .expect("the Python component loads");
    assert_eq!(
        loaded.plugin.as_ref().map(|p| p.name.as_str()),
        Some("python-native-cost")
    );
    let mut rng = SmallRng::seed_from_u64(77);
    let mut want = Vec::new();
    let taints = support::taint_table(1, 6);
    for round in 0..25 {
        let n = match round {
            0 => 1,
            1 => 256,
            _ => rng.gen_range(1..=64),
        };
        // Block sizes change between decisions: they reach the plugin through `set-context`.
        let block_size = [16, 64, 8][round % 3];
        let (req, cols) = support::random_decision_with_block_size(&mut rng, n, 6, block_size);
        native_costs(&req, &cols, &mut want);
        match reg.decide(&req, &cols, &taints).outcome {
            Outcome::Costs(got) => {
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-9 * g.abs().max(w.abs()) || g == w,
                        "n={n} block_size={block_size} candidate {i}: python {g} vs native {w}"
                    );
                }
            }
            other => panic!("n={n}: {other:?}"),
        }
    }

    // Its configuration takes effect: other weights give the host's costs under those weights.
    let weights = CostWeights {
        prefill_load_scale: 2.5,
        host_tier_weight: 0.5,
        disk_tier_weight: 0.125,
    };
    reg.load(
        "py-weighted",
        &bytes,
        Some(r#"{"prefill_load_scale": 2.5, "host_tier_weight": 0.5, "disk_tier_weight": 0.125}"#),
        true,
    )
    .expect("the configured Python component loads");
    for round in 0..6 {
        let n = 1 + round * 7;
        let (req, mut cols) = support::random_decision(&mut rng, n, 6);
        fill_base_costs(&req, &mut cols, &weights);
        native_costs(&req, &cols, &mut want);
        match reg.decide(&req, &cols, &taints).outcome {
            Outcome::Costs(got) => {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-9 * g.abs().max(w.abs()) || g == w,
                        "configured, n={n} candidate {i}: python {g} vs native {w}"
                    );
                }
            }
            other => panic!("configured, n={n}: {other:?}"),
        }
    }

    // Its configuration errors reach the operator verbatim.
    let err = reg
        .load(
            "py-bad",
            &bytes,
            Some(r#"{"prefill_load_scale": -1}"#),
            false,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("prefill_load_scale must be a finite number >= 0"),
        "{err}"
    );
    let err = reg
        .load("py-bad", &bytes, Some(r#"{"cache": 1}"#), false)
        .unwrap_err();
    assert!(err.to_string().contains("unknown key 'cache'"), "{err}");
}

#[test]
fn python_plugin_passes_policy_check_with_a_python_sized_deadline() {
    let wasm = python_plugin();
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["policy", "check"])
        .arg(&wasm)
        .args(["--deadline-us", "200000"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("python-native-cost"), "{text}");
    assert!(text.contains("1024 candidates"), "{text}");
}
