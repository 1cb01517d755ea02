//! The stage of a decision (aggregated, or the prefill and decode steps of a disaggregated one)
//! across the policy interface (the stage since `kvroute:policy@0.5.0`): it reaches real components through the
//! request's flags, the shipped policies rank the decode step by load, `kvroute policy check`
//! runs every scenario at every stage, and a component built against the previous interface
//! (0.7.0, abi 7) is refused by name.

use crate::support;
use crate::support::plugins::plugin_bytes;

use serde_json::json;

use kvroute_core::router::{Scorer, ScorerOutcome};
use kvroute_core::{CandidateColumns, PolicyRequest, Stage};
use kvroute_policy::{
    conformance, Outcome, PolicyError, PolicyRegistry, PolicyRuntimeConfig, RegistryScorer,
    TaintTable,
};

const STAGES: [Stage; 3] = [Stage::Aggregated, Stage::Prefill, Stage::Decode];

fn registry() -> PolicyRegistry {
    PolicyRegistry::new(PolicyRuntimeConfig {
        // Behaviour, not speed: room for a loaded test machine.
        deadline_us: 100_000,
        ..Default::default()
    })
    .expect("policy runtime")
}

/// 4,096 tokens (256 blocks of 16). Worker 1 holds all of them and decodes 128 blocks for 4
/// requests; worker 2 is idle with nothing cached. The base costs are the aggregated native
/// cost at every stage (worker 1: 384, worker 2: 512), so a policy that follows them, or that
/// never learns the stage, picks worker 1 every time. Both workers learned the same step times
/// (a uniform fleet: a policy scaling by learned figures keeps its model as it is), so the stage
/// alone separates them.
fn cached_vs_idle() -> (PolicyRequest, CandidateColumns) {
    let req = PolicyRequest {
        request_id: "stages".into(),
        prompt_tokens: 4096,
        request_blocks: 256,
        block_size: 16,
        now_ms: 1_700_000_000_000,
        ..Default::default()
    };
    let mut cols = CandidateColumns {
        worker_id: vec![1, 2],
        dp_rank: vec![0, 0],
        device_overlap: vec![256, 0],
        host_overlap: vec![0, 0],
        disk_overlap: vec![0, 0],
        active_prefill_tokens: vec![0, 0],
        active_decode_blocks: vec![128, 0],
        active_requests: vec![4, 0],
        active_prompt_blocks: vec![0, 0],
        total_kv_blocks: vec![16_384, 16_384],
        max_num_batched_tokens: vec![8_192, 8_192],
        kv_feed_trust: vec![0, 0],
        session_bound: vec![0, 0],
        base_cost: Vec::new(),
        prefill_ms_per_token: vec![0.02, 0.02],
        decode_step_ms: vec![10.0, 10.0],
        taint_offsets: vec![0, 0, 0],
        taint_ids: Vec::new(),
    };
    kvroute_core::cost::fill_base_costs(&req, &mut cols, &Default::default());
    assert_eq!(cols.base_cost, vec![384.0, 512.0]);
    (req, cols)
}

/// The worker a costs answer routes to (temperature 0; the test sets have no ties).
fn chosen(outcome: &Outcome, cols: &CandidateColumns) -> u64 {
    match outcome {
        Outcome::Costs(c) => {
            assert!(c[0] != c[1], "a tie: {c:?}");
            cols.worker_id[if c[0] < c[1] { 0 } else { 1 }]
        }
        Outcome::Pick(i) => cols.worker_id[*i],
        Outcome::Fallback(r) => panic!("fell back: {}", r.as_str()),
        Outcome::NeedsBaseCost => panic!("asked for the base cost, which the test fills"),
    }
}

/// The worker the active policy routes to at each of [`STAGES`].
fn picks_at_every_stage(
    reg: &PolicyRegistry,
    req: &PolicyRequest,
    cols: &CandidateColumns,
) -> Vec<u64> {
    let taints = TaintTable::default();
    STAGES
        .iter()
        .map(|&stage| chosen(&reg.decide_at(req, cols, &taints, stage).outcome, cols))
        .collect()
}

#[test]
fn the_stage_reaches_the_component_and_the_shipped_policies_rank_decode_by_load() {
    let (req, cols) = cached_vs_idle();
    let taints = TaintTable::default();
    for package in ["kvroute-plugin-default", "kvroute-plugin-ttft-aware"] {
        let reg = registry();
        reg.load("p", &plugin_bytes(package), None, true)
            .unwrap_or_else(|e| panic!("{package}: {e}"));
        let picks = picks_at_every_stage(&reg, &req, &cols);
        // Computing the prompt: the cache wins. Receiving the KV cache: the idle worker wins,
        // which the component can only know from the decode flag (the base costs favour worker
        // 1 at every stage here).
        assert_eq!(picks, [1, 1, 2], "{package} at aggregated, prefill, decode");
        // `decide` is the aggregated decision.
        assert_eq!(
            chosen(&reg.decide(&req, &cols, &taints).outcome, &cols),
            1,
            "{package}"
        );
    }
}

/// The learned step-time columns reach a real component through the host's packing: with worker 2
/// learned three times as slow as worker 1 (prefill and decode), `ttft-aware` prices the idle
/// worker's decode step (6.6 ms on the model) at √1.5 of it (8.1 ms) and the busy one's (10.1 ms
/// with the residual of its current step) at √0.5 (7.1 ms), so the fast worker wins the decode
/// step it loses on a uniform fleet;
/// with `learned_step_times` off (the default) the fixed model ranks as before.
#[test]
fn ttft_aware_prices_the_decode_step_by_the_learned_step_times() {
    let (req, mut cols) = cached_vs_idle();
    cols.prefill_ms_per_token = vec![0.02, 0.06];
    cols.decode_step_ms = vec![10.0, 30.0];
    for (config, want) in [
        (Some(r#"{"learned_step_times": true}"#), [1, 1, 1]),
        (Some(r#"{"learned_step_times": false}"#), [1, 1, 2]),
        (None, [1, 1, 2]),
    ] {
        let reg = registry();
        reg.load(
            "p",
            &plugin_bytes("kvroute-plugin-ttft-aware"),
            config,
            true,
        )
        .expect("load ttft-aware");
        let picks = picks_at_every_stage(&reg, &req, &cols);
        assert_eq!(
            picks, want,
            "config {config:?}: aggregated, prefill, decode"
        );
    }
}

#[test]
fn the_router_s_scorer_hands_its_stage_to_the_policy() {
    let reg = std::sync::Arc::new(registry());
    reg.load(
        "default",
        &plugin_bytes("kvroute-plugin-default"),
        None,
        true,
    )
    .expect("load");
    let scorer = RegistryScorer::new(reg);
    let (req, cols) = cached_vs_idle();
    let taints = TaintTable::default();
    let cheapest = |stage| match scorer.decide(&req, &cols, &taints, stage).outcome {
        ScorerOutcome::Costs(c) => cols.worker_id[if c[0] < c[1] { 0 } else { 1 }],
        other => panic!("{stage}: {other:?}"),
    };
    assert_eq!(cheapest(Stage::Aggregated), 1);
    assert_eq!(cheapest(Stage::Prefill), 1);
    assert_eq!(cheapest(Stage::Decode), 2);
}

#[test]
fn a_component_built_against_0_7_0_is_refused_naming_both_versions() {
    let reg = registry();
    let bytes = plugin_bytes("kvroute-test-old-interface");
    let err = reg.load("old", &bytes, None, true).unwrap_err();
    assert!(matches!(err, PolicyError::WrongWorld(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("kvroute:policy/policy@0.10.0")
            && msg.contains("it exports kvroute:policy/policy@0.7.0")
            && msg.contains("rebuild it against this host's wit/policy.wit"),
        "{msg}"
    );
    assert!(reg.list().is_empty(), "nothing was loaded");
    assert_eq!(err.code(), "wrong_world");
}

#[test]
fn uploading_a_0_7_0_component_is_a_400_naming_the_version_and_changes_nothing() {
    let s = support::Server::start(&[]);
    let before = s.get("/v1/policies").expect(200).body().clone();
    let wasm = plugin_bytes("kvroute-test-old-interface");
    let r = s.raw(
        "PUT",
        "/v1/policies/old?activate=true",
        &[("content-type", "application/wasm")],
        &wasm,
    );
    r.expect_error(400, "wrong_world");
    let message = r.body()["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("kvroute:policy/policy@0.10.0")
            && message.contains("kvroute:policy/policy@0.7.0"),
        "{}",
        r.text
    );
    let after = s.get("/v1/policies").expect(200).body().clone();
    assert_eq!(
        before, after,
        "the refused upload left the policies as they were"
    );
}

/// The report's lines for one stage (`  64 candidates, decode    : ...`).
fn stage_lines<'a>(
    report: &'a conformance::Report,
    stage: &str,
) -> Vec<&'a conformance::CheckResult> {
    report
        .results
        .iter()
        .filter(|r| r.name.contains(&format!(", {stage:<10}:")))
        .collect()
}

#[test]
fn policy_check_runs_every_scenario_at_every_stage_and_reports_preferences() {
    let report = |package: &str| {
        conformance::check(&plugin_bytes(package), None, Some(100_000))
            .unwrap_or_else(|e| panic!("{package}: {e}"))
    };
    let default = report("kvroute-plugin-default");
    assert!(default.passed(), "{}", default.render());
    let per_stage: Vec<usize> = ["aggregated", "prefill", "decode"]
        .iter()
        .map(|s| stage_lines(&default, s).len())
        .collect();
    // 6 sizes x 8 scenarios at each stage.
    assert_eq!(per_stage, [48, 48, 48], "{}", default.render());
    assert!(stage_lines(&default, "decode")
        .iter()
        .any(|r| r.name.starts_with("1024 candidates")));
    let prefers = |r: &conformance::Report| {
        r.results
            .iter()
            .find(|c| c.name.starts_with("stages:"))
            .unwrap_or_else(|| panic!("no stage line:\n{}", r.render()))
            .clone()
    };
    let line = prefers(&default);
    assert!(line.passed);
    assert!(
        line.detail.starts_with(
            "aggregated: the cached one, prefill: the cached one, decode: the idle one"
        ),
        "{}",
        line.detail
    );
    // native-cost recomputes the aggregated native cost at every stage: it keeps preferring the
    // cached worker at decode. That is reported, not failed: it is advice, not a rule.
    let native = report("kvroute-plugin-native-cost");
    assert!(native.passed(), "{}", native.render());
    let line = prefers(&native);
    assert!(
        line.passed && line.detail.contains("decode: the cached one"),
        "{}",
        line.detail
    );
}

#[test]
fn a_plugin_failing_only_at_one_stage_fails_the_check_at_that_stage() {
    // `trigger` makes the plugin misbehave on decisions whose request id starts with it: the
    // check's ids name the size and the stage.
    let config = json!({"mode": "nan", "trigger": "check-8-decode"}).to_string();
    let report = conformance::check(
        &plugin_bytes("kvroute-test-misbehave"),
        Some(&config),
        Some(100_000),
    )
    .expect("loads: the self-test's ids do not match the trigger");
    assert!(!report.passed());
    let failing: Vec<&str> = report
        .results
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.name.as_str())
        .collect();
    assert!(!failing.is_empty());
    assert!(
        failing
            .iter()
            .all(|n| n.starts_with("   8 candidates, decode")),
        "only the 8-candidate decode scenarios fail: {failing:?}"
    );
    assert_eq!(failing.len(), 8, "{failing:?}");
}
