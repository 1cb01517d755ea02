//! `kvroute policy check`: the conformance suite a plugin author runs before deploying.
//!
//! It loads the component exactly as the server would (world and ABI version, `configure`, the
//! runtime's self-test), then calls it on generated candidate sets the host can produce — 1 to
//! 1,024 candidates, no taints, many taints, zero costs, huge loads, preferences, sessions — at
//! each stage of a decision (aggregated, and the prefill and decode steps of a disaggregated one)
//! and checks each answer the way the router does: the right number of costs, all finite, a pick
//! in range; the same answer twice when the plugin declares itself deterministic; and per-call
//! latency against the deadline. The report says what failed and what to do.
//!
//! It also reports, without judging, what the plugin prefers at each stage between a candidate
//! holding the whole prompt and an idle one: ranking decode candidates by load rather than
//! overlap is the interface's advice (`wit/policy.wit`, flag `decode`), not a rule the host
//! enforces, so a plugin that keeps overlap at the decode step (a session's worker, say) passes.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::{Outcome, PolicyRegistry, PolicyRuntimeConfig, TaintTable};
use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::cost::{fill_base_costs, CostWeights};
use kvroute_core::Stage;

/// The stages every scenario runs at, in this order.
const STAGES: [Stage; 3] = [Stage::Aggregated, Stage::Prefill, Stage::Decode];

/// One named check and its verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckResult {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

/// The whole report.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub plugin: String,
    pub results: Vec<CheckResult>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub deadline_us: u64,
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.results.is_empty() && self.results.iter().all(|r| r.passed)
    }

    /// The report as a person reads it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "kvroute policy check: {}", self.plugin);
        let width = self
            .results
            .iter()
            .map(|r| r.name.chars().count())
            .max()
            .unwrap_or(0);
        for r in &self.results {
            let mark = if r.passed { "ok  " } else { "FAIL" };
            let _ = writeln!(out, "  [{mark}] {:<width$}  {}", r.name, r.detail);
        }
        let _ = writeln!(
            out,
            "  latency at 64 candidates: p50 {:.2} µs, p99 {:.2} µs (deadline {} µs)",
            self.p50_us, self.p99_us, self.deadline_us
        );
        let failed = self.results.iter().filter(|r| !r.passed).count();
        if failed == 0 {
            let _ = writeln!(out, "PASS: {} checks", self.results.len());
        } else {
            let _ = writeln!(
                out,
                "FAIL: {failed} of {} checks failed; fix them before loading this policy (the host \
                 would fall back to its native cost on each failing decision)",
                self.results.len()
            );
        }
        out
    }
}

/// A generated scenario.
#[derive(Clone, Copy, Debug)]
enum Scenario {
    Idle,
    RandomLoad,
    ManyTaints,
    ZeroCosts,
    HugeLoads,
    Preferences,
    ShortPrompt,
    EveryField,
}

impl Scenario {
    const ALL: [Scenario; 8] = [
        Scenario::Idle,
        Scenario::RandomLoad,
        Scenario::ManyTaints,
        Scenario::ZeroCosts,
        Scenario::HugeLoads,
        Scenario::Preferences,
        Scenario::ShortPrompt,
        Scenario::EveryField,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Idle => "idle, nothing cached, no taints",
            Scenario::RandomLoad => "random loads and overlaps",
            Scenario::ManyTaints => "64 taints per candidate",
            Scenario::ZeroCosts => "every base cost 0",
            Scenario::HugeLoads => "huge loads (1e15 tokens)",
            Scenario::Preferences => "preferred taints and a session",
            Scenario::ShortPrompt => "3-token prompt (0 complete blocks)",
            Scenario::EveryField => "every tier, ranks, active blocks, temperature",
        }
    }
}

const TAINTS: usize = 96;

fn taint_table() -> TaintTable {
    TaintTable::new(
        1,
        (0..TAINTS)
            .map(|i| format!("check.taint-{i}"))
            .collect::<Vec<_>>(),
    )
}

/// Fills the base costs as the host does at `stage`: the native cost, with no overlap credit at
/// the decode step (the decode worker receives the KV cache and computes no prompt).
fn fill_stage_base_costs(req: &PolicyRequest, c: &mut CandidateColumns, stage: Stage) {
    if stage != Stage::Decode {
        fill_base_costs(req, c, &CostWeights::default());
        return;
    }
    let mut uncredited = CandidateColumns {
        device_overlap: vec![0; c.len()],
        host_overlap: vec![0; c.len()],
        disk_overlap: vec![0; c.len()],
        ..c.clone()
    };
    fill_base_costs(req, &mut uncredited, &CostWeights::default());
    c.base_cost = uncredited.base_cost;
}

/// Builds a request and candidate columns for a scenario at a stage, like the router would.
fn generate(
    n: usize,
    s: Scenario,
    stage: Stage,
    rng: &mut SmallRng,
) -> (PolicyRequest, CandidateColumns) {
    let block_size = 16;
    // A prompt shorter than a block is common (chat turns, health probes): `request_blocks` is
    // then 0, and a policy dividing by it traps.
    let prompt_tokens = if matches!(s, Scenario::ShortPrompt) {
        3
    } else {
        4096
    };
    let mut req = PolicyRequest {
        request_id: format!("check-{n}-{stage}-{}", s.name().len()),
        prompt_tokens,
        request_blocks: prompt_tokens / block_size,
        block_size,
        temperature: 0.0,
        now_ms: 1_700_000_000_000 + rng.gen_range(0..86_400_000),
        ..Default::default()
    };
    let mut c = CandidateColumns {
        taint_offsets: vec![0],
        ..Default::default()
    };
    for i in 0..n {
        c.worker_id.push(i as u64 + 1);
        c.dp_rank.push(if matches!(s, Scenario::EveryField) {
            (i % 4) as u32
        } else {
            0
        });
        let (dev, prefill, decode, reqs) = match s {
            Scenario::ShortPrompt => (0, rng.gen_range(0..20_000), rng.gen_range(0..16_384), 1),
            Scenario::Idle | Scenario::ZeroCosts => (0, 0, 0, 0),
            Scenario::HugeLoads => (0, 1_000_000_000_000_000u64, 1u64 << 50, u32::MAX / 2),
            _ => (
                rng.gen_range(0..=256),
                rng.gen_range(0..20_000),
                rng.gen_range(0..16_384),
                rng.gen_range(0..256),
            ),
        };
        c.device_overlap.push(dev);
        c.host_overlap.push(
            if matches!(s, Scenario::RandomLoad | Scenario::EveryField) {
                rng.gen_range(0..=256)
            } else {
                0
            },
        );
        c.disk_overlap.push(if matches!(s, Scenario::EveryField) {
            rng.gen_range(0..=256)
        } else {
            0
        });
        c.active_prefill_tokens.push(prefill);
        c.active_decode_blocks.push(decode);
        c.active_requests.push(reqs);
        c.active_prompt_blocks
            .push(if matches!(s, Scenario::EveryField) {
                dev.min(rng.gen_range(0..=32))
            } else {
                0
            });
        c.total_kv_blocks.push(16_384);
        c.max_num_batched_tokens.push(8_192);
        // Session binding: the request's session on one candidate, its parent's on another, and
        // a reserved code a policy must read as none.
        c.session_bound.push(
            if matches!(s, Scenario::Preferences | Scenario::EveryField) {
                [1, 0, 2, 0, 9, 0][i % 6]
            } else {
                0
            },
        );
        // Feed trust: every state, and a reserved code a policy must read as degraded.
        c.kv_feed_trust.push(
            if matches!(s, Scenario::RandomLoad | Scenario::EveryField) {
                [0, 0, 1, 2, 7][i % 5]
            } else {
                0
            },
        );
        // Learned step times: some workers learned (a heterogeneous fleet), some not yet (0).
        let learned = matches!(s, Scenario::RandomLoad | Scenario::EveryField) && i % 3 != 0;
        c.prefill_ms_per_token.push(if learned {
            rng.gen_range(0.005..0.1)
        } else {
            0.0
        });
        c.decode_step_ms.push(if learned {
            rng.gen_range(5.0..60.0)
        } else {
            0.0
        });
        match s {
            Scenario::ManyTaints => c
                .taint_ids
                .extend((0..64).map(|t| ((t + i) % TAINTS) as u32)),
            Scenario::Preferences | Scenario::RandomLoad => c.taint_ids.push((i % 4) as u32),
            _ => {}
        }
        c.taint_offsets.push(c.taint_ids.len() as u32);
    }
    if matches!(s, Scenario::EveryField) {
        req.temperature = 0.5;
        req.priority = 2.0;
        req.expected_output_tokens = Some(1024);
    }
    if matches!(s, Scenario::Preferences) {
        req.preferred_taints = vec![(0, 0.5), (1, -0.5), (2, 0.25)];
        req.session_id = Some("check-session".into());
        req.expected_output_tokens = Some(256);
    }
    fill_stage_base_costs(&req, &mut c, stage);
    if matches!(s, Scenario::ZeroCosts) {
        c.base_cost.iter_mut().for_each(|x| *x = 0.0);
    }
    (req, c)
}

/// Loads and checks a component. `Err` only when it cannot even be loaded (the message says why).
pub fn check(
    bytes: &[u8],
    config: Option<&str>,
    deadline_us: Option<u64>,
) -> Result<Report, String> {
    let mut rc = PolicyRuntimeConfig {
        // The checker wants every failure reported, never the automatic restore (by either
        // rule: a plugin failing one scenario at every stage fails more than a tenth of a window).
        max_consecutive_failures: u32::MAX,
        failure_window: 0,
        instances_per_stage: 1,
        ..PolicyRuntimeConfig::default()
    };
    if let Some(d) = deadline_us {
        rc.deadline_us = d;
        // A deadline shorter than the server's needs a finer clock and a shorter grace window
        // (both must fit inside it); the server's default deadline keeps the server's values.
        rc.epoch_tick_us = rc.epoch_tick_us.min((d / 8).max(50));
        rc.preemption_grace_us = rc.preemption_grace_us.min(d / 4).max(rc.epoch_tick_us);
    }
    let deadline = rc.deadline_us;
    let registry = Arc::new(PolicyRegistry::new(rc).map_err(|e| e.to_string())?);
    let info = registry
        .load("check", bytes, config, true)
        .map_err(|e| format!("the component cannot be loaded: {e}"))?;
    let plugin = info.plugin.clone();
    let mut report = Report {
        plugin: match &plugin {
            Some(p) => format!(
                "{} {} (abi {}, {:?}, {})",
                p.name,
                p.version,
                p.abi_version,
                p.kind,
                if p.deterministic {
                    "deterministic"
                } else {
                    "not deterministic"
                }
            ),
            None => info.name.clone(),
        },
        deadline_us: deadline,
        ..Default::default()
    };
    let deterministic = plugin.as_ref().is_some_and(|p| p.deterministic);
    let declares_scorer = plugin
        .as_ref()
        .is_some_and(|p| p.kind == crate::PluginKind::Scorer);
    report.results.push(CheckResult {
        name: "loads: world, abi version, configure, self-test".into(),
        passed: true,
        detail: format!("digest {}", &info.digest[..16.min(info.digest.len())]),
    });
    if !info.trapping_imports.is_empty() {
        // Not a failure (a `std` Rust guest imports WASI it never calls), but named, so an
        // import the author did not expect stands out.
        let names = &info.trapping_imports;
        let foreign: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| !n.starts_with("wasi:"))
            .collect();
        let mut detail = format!(
            "note: {} linked as traps (calling one fails the decision): {}",
            names.len(),
            names.join(", ")
        );
        if !foreign.is_empty() {
            detail.push_str(&format!(
                "; warning: not WASI, nothing provides these: {}",
                foreign.join(", ")
            ));
        }
        report.results.push(CheckResult {
            name: "imports besides host-log".into(),
            passed: true,
            detail,
        });
    }
    let taints = taint_table();
    // One stream per stage from the same seed: each stage sees the same candidate sets (only the
    // decode step's base costs differ), and the aggregated ones are those of earlier releases.
    let mut rngs = STAGES.map(|_| SmallRng::seed_from_u64(0x6b76_726f));
    for n in [1usize, 2, 8, 64, 256, 1024] {
        let runs = STAGES.into_iter().enumerate();
        for (k, stage, s) in runs.flat_map(|(k, stage)| Scenario::ALL.map(|s| (k, stage, s))) {
            let (req, cols) = generate(n, s, stage, &mut rngs[k]);
            await_instance(&registry);
            let decision = registry.decide_at(&req, &cols, &taints, stage);
            let first = decision.outcome.clone();
            // What the runtime or the plugin said about a failure (a panic's message).
            let said = |d: &crate::PolicyDecision| {
                d.policy
                    .as_ref()
                    .and_then(|p| p.last_failure())
                    .map(|f| format!(": {f}"))
                    .unwrap_or_default()
            };
            let name = format!("{n:>4} candidates, {stage:<10}: {}", s.name());
            let (mut passed, mut detail) = match &first {
                Outcome::Costs(c) => (
                    true,
                    format!(
                        "costs, min {:.3}",
                        c.iter().cloned().fold(f64::INFINITY, f64::min)
                    ),
                ),
                Outcome::Pick(i) if declares_scorer => (
                    false,
                    format!(
                        "pick {i}, but info() declares a scorer: a pipeline would refuse this \
                         answer (unexpected_pick); declare kind selector or mixed"
                    ),
                ),
                Outcome::Pick(i) => (true, format!("pick {i}")),
                // The columns here always carry the base cost.
                Outcome::NeedsBaseCost => (
                    false,
                    "asked for the base cost although it was given (a host bug)".to_string(),
                ),
                Outcome::Fallback(r) => (
                    false,
                    format!(
                        "the host would fall back: {}{}",
                        explain(r.as_str()),
                        said(&decision)
                    ),
                ),
            };
            if passed && deterministic {
                await_instance(&registry);
                let second = registry.decide_at(&req, &cols, &taints, stage);
                match &second.outcome {
                    // A failure the second time is that failure, not nondeterminism.
                    Outcome::Fallback(r) => {
                        passed = false;
                        detail = format!(
                            "answered once, then the host would fall back: {}{}",
                            explain(r.as_str()),
                            said(&second)
                        );
                    }
                    again if *again != first => {
                        passed = false;
                        detail = "declares itself deterministic but answered differently for \
                                  the same input"
                            .into();
                    }
                    _ => {}
                }
            }
            // Said in `configure` that it does not read `base-cost` (interface 0.10.0): the host
            // will send NaN there, so the answer must not depend on it.
            if passed && !registry.reads_base_cost() {
                let mut bare = cols.clone();
                bare.base_cost.clear();
                await_instance(&registry);
                let third = registry.decide_at(&req, &bare, &taints, stage);
                match &third.outcome {
                    Outcome::Fallback(r) => {
                        passed = false;
                        detail = format!(
                            "configure says it does not read base-cost, but without it (NaN) the \
                             host would fall back: {}{}; answer host-columns.base-cost",
                            explain(r.as_str()),
                            said(&third)
                        );
                    }
                    again if deterministic && *again != first => {
                        passed = false;
                        detail = "configure says it does not read base-cost, but it answers \
                                  differently without it: answer host-columns.base-cost"
                            .into();
                    }
                    _ => {}
                }
            }
            report.results.push(CheckResult {
                name,
                passed,
                detail,
            });
        }
    }
    report.results.push(stage_preferences(&registry, &taints));
    // Latency at 64 candidates, after a warm-up.
    let (req, cols) = generate(64, Scenario::RandomLoad, Stage::Aggregated, &mut rngs[0]);
    for _ in 0..50 {
        registry.decide(&req, &cols, &taints);
    }
    let mut times: Vec<Duration> = (0..500)
        .map(|_| {
            let t = Instant::now();
            registry.decide(&req, &cols, &taints);
            t.elapsed()
        })
        .collect();
    times.sort();
    report.p50_us = times[times.len() / 2].as_secs_f64() * 1e6;
    report.p99_us = times[times.len() * 99 / 100].as_secs_f64() * 1e6;
    let p99 = report.p99_us;
    let d = deadline as f64;
    let (passed, detail) = if p99 < 0.5 * d {
        (true, format!("{p99:.1} µs"))
    } else if p99 < d {
        (
            true,
            format!("warning: {p99:.1} µs is over half the {deadline} µs deadline; a busy host may cut calls off"),
        )
    } else {
        (
            false,
            format!(
                "{p99:.1} µs exceeds the {deadline} µs deadline: such decisions are cut off and fall \
                 back; do less work per call or precompute in configure"
            ),
        )
    };
    report.results.push(CheckResult {
        name: "latency p99 within the deadline".into(),
        passed,
        detail,
    });
    Ok(report)
}

/// What the plugin picks at each stage between worker 1, which holds the whole prompt and decodes
/// a little more, and worker 2, idle with nothing cached: the host's native cost picks worker 1
/// to compute the prompt (aggregated, prefill) and worker 2 to receive the KV cache (decode).
/// Reported, not judged (see the module documentation), except that a failed answer fails.
fn stage_preferences(registry: &PolicyRegistry, taints: &TaintTable) -> CheckResult {
    let block_size = 16;
    let req = PolicyRequest {
        request_id: "check-stages".into(),
        prompt_tokens: 4096,
        request_blocks: 4096 / block_size,
        block_size,
        now_ms: 1_700_000_000_000,
        ..Default::default()
    };
    let cols = CandidateColumns {
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
        session_bound: vec![1, 0],
        base_cost: Vec::new(),
        prefill_ms_per_token: vec![0.02, 0.0],
        decode_step_ms: vec![12.0, 0.0],
        taint_offsets: vec![0, 0, 0],
        taint_ids: Vec::new(),
    };
    let mut said = Vec::new();
    let mut failed = None;
    for stage in STAGES {
        let mut c = cols.clone();
        fill_stage_base_costs(&req, &mut c, stage);
        await_instance(registry);
        let choice = match registry.decide_at(&req, &c, taints, stage).outcome {
            Outcome::Costs(costs) if costs.len() == 2 && costs[0] < costs[1] => "the cached one",
            Outcome::Costs(costs) if costs.len() == 2 && costs[1] < costs[0] => "the idle one",
            Outcome::Costs(_) => "neither (a tie)",
            Outcome::Pick(0) => "the cached one",
            Outcome::Pick(_) => "the idle one",
            Outcome::NeedsBaseCost => {
                failed.get_or_insert(format!(
                    "{stage}: asked for the base cost although it was given (a host bug)"
                ));
                "no answer"
            }
            Outcome::Fallback(r) => {
                failed.get_or_insert(format!(
                    "{stage}: the host would fall back: {}",
                    explain(r.as_str())
                ));
                "a fallback"
            }
        };
        said.push(format!("{stage}: {choice}"));
    }
    let passed = failed.is_none();
    let detail = match failed {
        Some(f) => f,
        None => format!(
            "{} (the native cost: the cached one to compute the prompt, the idle one at decode, \
             where overlap earns no credit; advice, not a rule)",
            said.join(", ")
        ),
    };
    CheckResult {
        name: "stages: whole prompt cached vs idle".into(),
        passed,
        detail,
    }
}

/// Waits (up to 5 s) until the active policy has a configured instance ready. A decision that
/// finds none falls back at once (instances are never made on the request path), and after a
/// trap the failed instance is replaced off the path: the check waits for the replacement, so
/// that every scenario reaches the plugin instead of reporting the previous one's failure.
fn await_instance(registry: &PolicyRegistry) {
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until
        && registry
            .active()
            .is_some_and(|a| a.policy.pooled_instances() == 0)
    {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn explain(reason: &str) -> String {
    let hint = match reason {
        "trap" => "the plugin trapped (a panic, unreachable, or a call to a WASI function)",
        "deadline" => "the call ran past the deadline",
        "memory_limit" => "the plugin grew its memory past the cap",
        "invalid_length" => "the number of costs differs from the number of candidates",
        "non_finite" => "a cost was NaN or infinite",
        "pick_out_of_range" => "the pick is not a candidate index",
        "unexpected_pick" => "a scorer stage picked instead of returning costs",
        "instantiate" => "no instance could be made",
        other => other,
    };
    format!("{reason} ({hint})")
}
