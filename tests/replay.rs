//! `kvroute replay`: sanity of the simulator and the metrics, through the library API and the real
//! binary.

use crate::support::plugins as support;

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use kvroute_core::router::{PolicyLabel, Scorer, ScorerDecision, ScorerOutcome, Stage};
use kvroute_core::workers::TaintNames;
use kvroute_core::{CandidateColumns, PolicyRequest};
use kvroute_replay as replay;
use kvroute_replay::{
    LoadOptions, PolicySpec, PreparedTrace, ReplayOptions, SimConfig, Trace, TraceRequest,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const B: usize = 64;

pub(crate) fn traces_dir() -> PathBuf {
    support::workspace_root().join("data/traces")
}

fn opts(workers: u32, sim: SimConfig) -> ReplayOptions {
    ReplayOptions {
        fleet: replay::FleetShape::Aggregated { workers },
        sim,
        ..Default::default()
    }
}

fn run_one(trace: &Trace, o: &ReplayOptions, policy: PolicySpec) -> replay::PolicyRun {
    let prepared = PreparedTrace::new(trace, o.sim.block_size);
    let name = policy.name();
    replay::run_policy(&prepared, o, &policy, &name, &mut |_| {}).expect("replay")
}

/// The fraction of prompt tokens a perfect prefix cache serves: a full block hits when the same
/// prefix (this block and everything before it) was seen in an earlier request. Computed here with
/// std's hasher over token prefixes, independently of the crate's hashing.
fn reusable_fraction(trace: &Trace) -> f64 {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit, mut all) = (0u64, 0u64);
    for r in &trace.requests {
        all += r.tokens.len() as u64;
        let mut prev = 0u64;
        for block in r.tokens.as_chunks::<B>().0 {
            let mut h = DefaultHasher::new();
            (prev, block).hash(&mut h);
            prev = h.finish();
            if !seen.insert(prev) {
                hit += B as u64;
            }
        }
    }
    hit as f64 / all as f64
}

/// Requests over a few shared documents: a random-length prefix of one document, then a unique
/// tail, never a whole number of blocks (so every full block may hit).
fn shared_document_trace(n: usize, seed: u64) -> Trace {
    let mut rng = SmallRng::seed_from_u64(seed);
    let docs: Vec<Vec<u32>> = (0..12)
        .map(|_| (0..3000).map(|_| rng.gen_range(0..50_000)).collect())
        .collect();
    let requests = (0..n)
        .map(|i| {
            let d = &docs[rng.gen_range(0..docs.len())];
            let mut tokens = d[..rng.gen_range(0..=d.len())].to_vec();
            let tail = rng.gen_range(1..300);
            tokens.extend((0..tail).map(|t| 1_000_000 + (i * 1000 + t) as u32));
            if tokens.len().is_multiple_of(B) {
                tokens.push(7);
            }
            TraceRequest {
                arrival_ms: i as f64 * 150.0,
                tokens,
                output_len: rng.gen_range(1..20),
            }
        })
        .collect();
    Trace::from_requests("shared-docs", requests)
}

#[test]
fn unlimited_cache_hit_rate_equals_the_reusable_fraction() {
    let trace = shared_document_trace(300, 1);
    let expected = reusable_fraction(&trace);
    assert!(expected > 0.3, "the trace should reuse a lot ({expected})");
    let sim = SimConfig {
        num_gpu_blocks: 1 << 22,
        ..SimConfig::default()
    };
    for policy in [PolicySpec::Default, PolicySpec::RoundRobin] {
        let run = one_worker(&trace, &sim, policy);
        let got = run.result.token_hit_rate;
        eprintln!(
            "{}: hit rate {got:.5}, expected {expected:.5}",
            run.result.name
        );
        assert!(
            (got - expected).abs() <= 0.01 * expected,
            "{}: hit rate {got} vs reusable fraction {expected}",
            run.result.name
        );
        assert_eq!(run.result.completed, 300);
        assert_eq!(run.result.evicted_blocks, 0);
        assert_eq!(run.result.kv_events_rejected, 0);
    }
}

fn one_worker(trace: &Trace, sim: &SimConfig, policy: PolicySpec) -> replay::PolicyRun {
    run_one(trace, &opts(1, sim.clone()), policy)
}

/// Pure max-overlap: cost = -device overlap.
struct MaxOverlap;

impl Scorer for MaxOverlap {
    fn decide(
        &self,
        _: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        ScorerDecision {
            outcome: ScorerOutcome::Costs(
                c.device_overlap.iter().map(|&o| -f64::from(o)).collect(),
            ),
            label: Arc::new(PolicyLabel {
                name: "max-overlap".into(),
                version: 1,
                digest: String::new(),
            }),
        }
    }
}

#[test]
fn max_overlap_piles_onto_one_worker_while_the_default_cost_spreads() {
    // Every request starts with the same block, then 1,000 tokens of its own. The first one
    // arrives alone, so its KV events reach the router before the others come (otherwise the
    // few that arrive before them tie on overlap 0 and seed more than one worker).
    let mut rng = SmallRng::seed_from_u64(2);
    let first: Vec<u32> = (0..B as u32).collect();
    let requests = (0..300)
        .map(|i| {
            let mut tokens = first.clone();
            tokens.extend((0..1000).map(|_| rng.gen_range(0..50_000u32)));
            TraceRequest {
                arrival_ms: if i == 0 { 0.0 } else { 100.0 + i as f64 * 20.0 },
                tokens,
                output_len: 32,
            }
        })
        .collect();
    let trace = Trace::from_requests("shared-first-block", requests);
    let o = opts(4, SimConfig::default());
    let pile = run_one(
        &trace,
        &o,
        PolicySpec::Custom {
            name: "max-overlap".into(),
            make: Arc::new(|| Box::new(MaxOverlap) as Box<dyn Scorer>),
        },
    );
    // Dynamo's cost (the default before latency pricing) is what this pins.
    let default = run_one(&trace, &o, PolicySpec::Dynamo);
    let (p, d) = (&pile.result, &default.result);
    eprintln!(
        "max-overlap {:?} cov {:.3} ttft p90 {:.1}; default {:?} cov {:.3} ttft p90 {:.1}",
        p.requests_per_worker,
        p.load_cov,
        p.ttft_ms.p90,
        d.requests_per_worker,
        d.load_cov,
        d.ttft_ms.p90
    );
    assert!(
        p.max_worker_share > 0.95,
        "max-overlap should collapse onto one worker: {:?}",
        p.requests_per_worker
    );
    assert!(
        d.max_worker_share < 0.5,
        "the default cost should spread: {:?}",
        d.requests_per_worker
    );
    assert!(
        p.load_cov > 3.0 * d.load_cov.max(0.05),
        "{} vs {}",
        p.load_cov,
        d.load_cov
    );
    // Piling up costs latency.
    assert!(p.ttft_ms.p90 > d.ttft_ms.p90);
}

#[test]
fn round_robin_loses_to_dynamo_s_cost_on_the_mooncake_trace() {
    let path = traces_dir().join("synthetic_trace.jsonl");
    let trace = replay::trace::load(&path, &LoadOptions::default()).expect("load");
    assert_eq!(trace.requests.len(), 3993);
    let o = opts(8, SimConfig::default());
    let runs = replay::run(
        &trace,
        std::slice::from_ref(&o),
        &[PolicySpec::RoundRobin, PolicySpec::Dynamo],
        false,
    )
    .expect("replay");
    let (rr, def) = (&runs[0].result, &runs[1].result);
    assert_eq!((rr.completed, def.completed), (3993, 3993));
    assert!(
        def.token_hit_rate > rr.token_hit_rate + 0.1,
        "hit rate: default {} vs round robin {}",
        def.token_hit_rate,
        rr.token_hit_rate
    );
    assert!(
        def.ttft_ms.p50 < rr.ttft_ms.p50,
        "TTFT p50: default {} vs round robin {}",
        def.ttft_ms.p50,
        rr.ttft_ms.p50
    );
    // Round robin spreads requests perfectly.
    assert!(rr.load_cov < 0.01);
    assert_eq!(rr.kv_events_rejected + def.kv_events_rejected, 0);
}

pub(crate) fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("run kvroute")
}

/// Every field `results.json` carries is defined in docs/SIMULATOR.md: the top level, the engine
/// configuration, the prefix synthesis, the definitions and each policy's object, keys of its
/// latency objects included.
fn assert_fields_documented(v: &serde_json::Value) {
    let doc = std::fs::read_to_string(support::workspace_root().join("docs/SIMULATOR.md")).unwrap();
    let mut keys: Vec<String> = Vec::new();
    let mut add = |o: &serde_json::Value| {
        if let Some(m) = o.as_object() {
            keys.extend(m.keys().cloned());
        }
    };
    add(v);
    add(&v["worker_config"]);
    add(&v["prefix_synthesis"]);
    add(&v["definitions"]);
    add(&v["kv_transfer"]);
    add(&v["router_disaggregation"]);
    for p in v["policies"].as_array().unwrap() {
        add(p);
        add(&p["ttft_ms"]);
        add(&p["itl_ms"]);
        add(&p["disaggregation"]);
        add(&p["disaggregation"]["transfer_ms"]);
    }
    for k in keys {
        // `key`, or a member of a `{p50, p90, p99, mean}` list.
        let forms = [
            format!("`{k}`"),
            format!("{{{k},"),
            format!(" {k},"),
            format!(" {k}}}"),
        ];
        assert!(
            forms.iter().any(|f| doc.contains(f.as_str())),
            "results.json field `{k}` is not defined in docs/SIMULATOR.md"
        );
    }
}

fn check_outputs(dir: &std::path::Path, policies: &[&str]) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("results.json")).expect("results.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("results.json is JSON");
    assert!(v["trace"].is_string());
    assert!(v["workers"].is_u64());
    let ps = v["policies"].as_array().expect("policies");
    assert_eq!(ps.len(), policies.len());
    for (p, name) in ps.iter().zip(policies) {
        assert_eq!(p["name"], *name);
        assert!(p["requests"].is_u64());
        let hit = p["token_hit_rate"].as_f64().expect("token_hit_rate");
        assert!((0.0..=1.0).contains(&hit));
        for k in ["p50", "p90", "p99"] {
            assert!(p["ttft_ms"][k].as_f64().expect("ttft") > 0.0, "ttft_ms.{k}");
        }
        for k in ["p50", "p99"] {
            assert!(p["itl_ms"][k].as_f64().expect("itl") > 0.0, "itl_ms.{k}");
        }
        assert!(p["throughput_tok_s"].as_f64().expect("throughput") > 0.0);
        assert!(p["load_cov"].as_f64().expect("load_cov") >= 0.0);
    }
    assert_fields_documented(&v);
    for f in [
        "ttft_cdf.png",
        "ttft_cdf.svg",
        "itl_cdf.png",
        "itl_cdf.svg",
        "hit_rate.png",
        "hit_rate.svg",
    ] {
        let bytes = std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(bytes.len() > 1000, "{f} is too small");
        if f.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f}");
        } else {
            let s = String::from_utf8_lossy(&bytes);
            assert!(s.contains("<svg") && s.contains("<text"), "{f}");
        }
    }
    v
}

#[test]
fn cli_replays_a_truncated_trace_and_writes_results_and_plots() {
    let out = support::temp_dir("replay-cli");
    let trace = traces_dir().join("synthetic_trace.jsonl");
    let o = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "4",
        "--policy",
        "round-robin",
        "--policy",
        "default",
        "--max-requests",
        "200",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "kvroute replay failed: {}\n{stdout}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        stdout.contains("round-robin") && stdout.contains("hit_rate"),
        "{stdout}"
    );
    let v = check_outputs(&out, &["round-robin", "default"]);
    assert_eq!(v["workers"], 4);
    assert_eq!(v["trace"], "synthetic_trace.jsonl");
    assert_eq!(v["policies"][0]["requests"], 200);

    // An Azure trace (synthesized prefixes, recorded in the results) and a token trace.
    let out = support::temp_dir("replay-cli-azure");
    let azure = traces_dir().join("AzureLLMInferenceTrace_code.csv");
    let o = kvroute(&[
        "replay",
        "--trace",
        azure.to_str().unwrap(),
        "--workers",
        "2",
        "--max-requests",
        "150",
        "--seed",
        "7",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The summary compares every policy with round robin, in words.
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("ROUND ROBIN BEATS default")
            || stdout.contains("default matches or beats round robin"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ttft_p50_ms"),
        "the table gives units: {stdout}"
    );
    let v = check_outputs(&out, &["round-robin", "default"]);
    assert_eq!(v["trace_format"], "azure");
    assert_eq!(v["prefix_synthesis"]["seed"], 7);

    let dir = support::temp_dir("replay-cli-tokens");
    let file = dir.join("t.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| {
            let tokens: Vec<u32> = (0..300)
                .map(|t| if t < 200 { t } else { t + i * 1000 })
                .collect();
            serde_json::json!({"timestamp_ms": i * 30, "tokens": tokens, "output_length": 5})
                .to_string()
        })
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let o = kvroute(&[
        "replay",
        "--trace",
        file.to_str().unwrap(),
        "--workers",
        "2",
        "--policy",
        "default",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = check_outputs(&dir, &["default"]);
    assert_eq!(v["trace_format"], "tokens");

    // Bad input is refused with a message.
    let o = kvroute(&[
        "replay",
        "--trace",
        file.to_str().unwrap(),
        "--workers",
        "2",
        "--policy",
        "no-such-policy",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown policy"));
    // Values out of range are named, negative numbers included (not taken for flags).
    for (flag, value, says) in [
        ("--max-requests", "0", "--max-requests must be at least 1"),
        ("--speedup", "-2", "--speedup must be a positive number"),
        (
            "--temperature",
            "-1",
            "--temperature must be a finite number >= 0",
        ),
        ("--workers", "0", "--workers must be at least 1"),
    ] {
        let mut args = vec![
            "replay",
            "--trace",
            file.to_str().unwrap(),
            "--workers",
            "2",
        ];
        args.extend(["--out", dir.to_str().unwrap(), flag, value]);
        if flag == "--workers" {
            args.drain(3..5);
        }
        let o = kvroute(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag} {value}");
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
    }
}

#[test]
fn cli_replays_a_wasm_policy_through_the_policy_runtime() {
    let wasm = support::build_plugin("kvroute-plugin-native-cost");
    let out = support::temp_dir("replay-wasm");
    let trace = traces_dir().join("synthetic_trace.jsonl");
    let spec = format!("{}:{{}}", wasm.display());
    let o = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--workers",
        "4",
        "--policy",
        &spec,
        "--max-requests",
        "300",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = check_outputs(&out, &["kvroute_plugin_native_cost"]);
    let p = &v["policies"][0];
    assert_eq!(p["policy_fallbacks"], 0, "the plugin decided every request");
    assert_eq!(p["completed"], 300);
}

/// `results.json` without the wall-clock figures.
pub(crate) fn numbers(dir: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("results.json")).expect("results.json");
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    for p in v["policies"].as_array_mut().expect("policies") {
        p.as_object_mut().expect("object").remove("wall_s");
    }
    v
}

#[test]
fn replays_with_the_same_seed_give_identical_results() {
    // Temperature sampling and random tie-breaks both draw from the router's generator: through
    // the native cost and through a Wasm policy (the host samples from the policy's costs).
    let wasm = support::build_plugin("kvroute-plugin-native-cost");
    let trace = traces_dir().join("synthetic_trace.jsonl");
    let spec = format!("{}:{{}}", wasm.display());
    let replay_with = |seed: &str, tag: &str| {
        let out = support::temp_dir(&format!("replay-seed-{tag}"));
        let o = kvroute(&[
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--workers",
            "4",
            "--policy",
            "default",
            "--policy",
            &spec,
            "--max-requests",
            "400",
            "--temperature",
            "0.5",
            "--seed",
            seed,
            "--no-plots",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        numbers(&out)
    };
    let a = replay_with("11", "a");
    let b = replay_with("11", "b");
    assert_eq!(a["seed"], 11);
    for p in a["policies"].as_array().unwrap() {
        assert_eq!(p["policy_fallbacks"], 0, "{}", p["name"]);
    }
    assert_eq!(a, b, "same seed, same results");
    // The seed is what decides: another one samples other workers.
    let c = replay_with("12", "c");
    assert_ne!(
        a["policies"][0]["requests_per_worker"], c["policies"][0]["requests_per_worker"],
        "a different seed should route differently at temperature 0.5"
    );
}

#[test]
fn policy_specs_parse() {
    assert!(matches!(
        PolicySpec::parse("round-robin").unwrap(),
        PolicySpec::RoundRobin
    ));
    assert!(matches!(
        PolicySpec::parse("default").unwrap(),
        PolicySpec::Default
    ));
    for dynamo in ["dynamo", "native"] {
        assert!(matches!(
            PolicySpec::parse(dynamo).unwrap(),
            PolicySpec::Dynamo
        ));
    }
    match PolicySpec::parse(r#"/x/my policy.wasm:{"a":"b:c"}"#).unwrap() {
        PolicySpec::Wasm { path, config } => {
            assert_eq!(path, PathBuf::from("/x/my policy.wasm"));
            assert_eq!(config.as_deref(), Some(r#"{"a":"b:c"}"#));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        PolicySpec::parse("/x/my policy.wasm").unwrap().name(),
        "my-policy"
    );
    assert!(PolicySpec::parse("p.wasm:{not json").is_err());
    assert!(PolicySpec::parse("fancy").is_err());
}

/// `--max-index-entries` reaches the router's index: the capped run ends at or under the cap,
/// counts its evictions, records the cap in `results.json`, and loses hit rate against the same
/// run without a cap (the router forgot blocks the engines still hold).
#[test]
fn cli_max_index_entries_caps_the_router_index_and_costs_hit_rate() {
    let trace = traces_dir().join("synthetic_trace.jsonl");
    let replay_with = |cap: Option<u64>, tag: &str| {
        let out = support::temp_dir(&format!("replay-cap-{tag}"));
        let cap_text = cap.map(|c| c.to_string());
        let mut args = vec![
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--workers",
            "4",
            "--policy",
            "default",
            "--max-requests",
            "1000",
            "--no-plots",
            "--out",
            out.to_str().unwrap(),
        ];
        if let Some(c) = &cap_text {
            args.extend(["--max-index-entries", c.as_str()]);
        }
        let o = kvroute(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        numbers(&out)
    };
    let free = replay_with(None, "none");
    assert_eq!(free["max_index_entries"], serde_json::Value::Null);
    let p = &free["policies"][0];
    assert_eq!(p["index_evicted_entries"], 0);
    let held = p["index_entries"].as_u64().expect("index_entries");
    assert!(
        held > 1000,
        "the uncapped index should hold the trace's blocks ({held})"
    );

    let cap = held / 2;
    let capped = replay_with(Some(cap), "half");
    assert_eq!(capped["max_index_entries"], cap);
    let q = &capped["policies"][0];
    let held_capped = q["index_entries"].as_u64().unwrap();
    let evicted = q["index_evicted_entries"].as_u64().unwrap();
    assert!(
        held_capped <= cap,
        "{held_capped} entries held over the cap {cap}"
    );
    assert!(evicted > 0, "a cap at half the working set evicts");
    assert_eq!(q["completed"], p["completed"]);
    let (hit_free, hit_capped) = (
        p["token_hit_rate"].as_f64().unwrap(),
        q["token_hit_rate"].as_f64().unwrap(),
    );
    assert!(
        hit_capped < hit_free,
        "forgetting half the blocks should cost hit rate: {hit_capped} vs {hit_free}"
    );
}

/// A token trace with shared prefixes and enough load that prefill interferes with decoding on an
/// aggregated fleet: 400 requests, 8 system prompts of 1,536 tokens plus a unique 512-token tail,
/// 64 output tokens, one every 40 ms.
fn write_split_trace(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("split.jsonl");
    let mut s = String::new();
    for i in 0..400u32 {
        let sys = i % 8;
        let tokens: Vec<u32> = (0..1536)
            .map(|k| 10_000 * (sys + 1) + k)
            .chain((0..512).map(|k| 1_000_000 + 1000 * i + k))
            .collect();
        s += &serde_json::json!({
            "timestamp_ms": f64::from(i) * 40.0,
            "tokens": tokens,
            "output_length": 64,
        })
        .to_string();
        s.push('\n');
    }
    std::fs::write(&path, s).unwrap();
    path
}

#[test]
fn cli_replays_disaggregated_fleets_beside_the_aggregated_one() {
    let dir = support::temp_dir("replay-split");
    let trace = write_split_trace(&dir);
    let out = dir.join("out");
    let o = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "tokens",
        "--block-size",
        "16",
        "--policy",
        "round-robin",
        "--policy",
        "default",
        "--prefill-workers",
        "2",
        "--decode-workers",
        "2",
        "--zones",
        "2",
        "--kv-transfer-topology",
        "none,required",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stderr}");
    // The aggregated fleet of the same size (4) and each split under each constraint.
    let names = [
        "round-robin @ 4",
        "default @ 4",
        "round-robin @ 2P+2D/none",
        "default @ 2P+2D/none",
        "round-robin @ 2P+2D/required",
        "default @ 2P+2D/required",
    ];
    let v = check_outputs(&out, &names);
    assert_eq!(v["workers"], 4);
    assert_eq!(v["zones"], 2);
    assert_eq!(v["kv_transfer"]["gbps_within"], 400.0);
    assert_eq!(v["router_disaggregation"]["kv_transfer_domain"], "zone");
    let ps = v["policies"].as_array().unwrap();
    for p in ps {
        assert_eq!(p["completed"], 400, "{}", p["name"]);
    }
    for p in &ps[..2] {
        assert_eq!(p["fleet"], "4");
        assert!(p["disaggregation"].is_null());
    }
    for p in &ps[2..] {
        assert_eq!(p["fleet"], "2P+2D");
        let d = &p["disaggregation"];
        assert_eq!(d["split_requests"], 400, "{}", p["name"]);
        assert!(d["transfer_ms"]["p50"].as_f64().unwrap() > 0.0);
    }
    let cross = |p: &serde_json::Value| p["disaggregation"]["cross_zone_share"].as_f64().unwrap();
    // Unconstrained, round robin's decode placement crosses zones about half the time; required
    // never does.
    assert!(cross(&ps[2]) > 0.2, "{}", cross(&ps[2]));
    assert_eq!(cross(&ps[4]), 0.0);
    assert_eq!(cross(&ps[5]), 0.0);
    assert_eq!(ps[4]["kv_transfer_topology"], "required");
    // Decode engines never prefill, so the split fleet's token gaps are steadier than the
    // aggregated one's, where 2,048-token prefills land in decode steps.
    let itl99 = |p: &serde_json::Value| p["itl_ms"]["p99"].as_f64().unwrap();
    assert!(
        itl99(&ps[3]) < itl99(&ps[1]),
        "ITL p99: split {} vs aggregated {}",
        itl99(&ps[3]),
        itl99(&ps[1])
    );
    assert!(
        stdout.contains("xfer_p50_ms") && stdout.contains("cross_zone"),
        "{stdout}"
    );

    // Flags that do not pair up, or name an unknown constraint, are refused by name.
    for (args, needle) in [
        (
            vec!["--prefill-workers", "2"],
            "--prefill-workers and --decode-workers pair up",
        ),
        (
            vec!["--prefill-workers", "2", "--decode-workers", "0"],
            "needs at least one of each",
        ),
        (
            vec![
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--kv-transfer-topology",
                "strict",
            ],
            "--kv-transfer-topology \"strict\"",
        ),
        (
            vec![
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--kv-transfer-gbps",
                "0",
            ],
            "--kv-transfer-gbps must be a positive number",
        ),
        (vec![], "--workers is required"),
    ] {
        let mut all = vec![
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        all.extend(args);
        let o = kvroute(&all);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{all:?} succeeded");
        assert!(err.contains(needle), "{all:?}: {err}");
    }
}

#[test]
fn cli_replays_router_replicas_with_a_booking_sync_lag() {
    let dir = support::temp_dir("replay-replicas");
    let trace = write_split_trace(&dir);
    let out = dir.join("out");
    let o = kvroute(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "tokens",
        "--block-size",
        "16",
        "--workers",
        "4",
        "--policy",
        "default",
        "--replicas",
        "1,2,4",
        "--sync-lag-ms",
        "0,200",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    // One router once (a lag means nothing there), then each replica count under each lag.
    let names = [
        "default @ 4",
        "default @ 4 x2r+0ms",
        "default @ 4 x2r+200ms",
        "default @ 4 x4r+0ms",
        "default @ 4 x4r+200ms",
    ];
    let v = check_outputs(&out, &names);
    let ps = v["policies"].as_array().unwrap();
    for (p, (replicas, lag)) in
        ps.iter()
            .zip([(1, 0.0), (2, 0.0), (2, 200.0), (4, 0.0), (4, 200.0)])
    {
        assert_eq!(p["completed"], 400, "{}", p["name"]);
        assert_eq!(p["replicas"], replicas, "{}", p["name"]);
        assert_eq!(p["sync_lag_ms"], lag, "{}", p["name"]);
        // Each request's booking, prefill_complete, final output count and free reach every other
        // replica, and every one of them applies (they arrive in order).
        assert_eq!(
            p["sync_messages"],
            400 * 4 * (replicas - 1),
            "{}",
            p["name"]
        );
        assert_eq!(p["sync_refused"], 0, "{}", p["name"]);
    }
    for (args, needle) in [
        (
            vec!["--replicas", "0"],
            "--replicas 0: at least one router replica",
        ),
        (
            vec!["--replicas", "2", "--sync-lag-ms", "-1"],
            "--sync-lag-ms -1",
        ),
    ] {
        let mut all = vec![
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--workers",
            "4",
            "--out",
            out.to_str().unwrap(),
        ];
        all.extend(args);
        let o = kvroute(&all);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{all:?} succeeded");
        assert!(err.contains(needle), "{all:?}: {err}");
    }
}
