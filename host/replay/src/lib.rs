//! `kvroute replay`: evaluate routing policies on request traces before they meet traffic.
//!
//! A discrete-event simulation of a fleet of vLLM-like engines ([`sim`], SPEC §10) is driven by a
//! trace ([`trace`]) and routed by **the same routing core `kvroute serve` runs**: a fresh
//! [`Router`] per policy, fed by the simulated engines' KV events (with a lag), booking each
//! request on arrival, told `prefill_complete` at the first token and `free` at the last. Only
//! the soft scoring differs between policies:
//!
//! | `--policy` | What decides |
//! |---|---|
//! | `round-robin` | a trivial [`Scorer`] that picks candidates in turn (eligibility and booking still go through the router) |
//! | `default` | the built-in default policy: its embedded component (the one `kvroute serve` runs), through the policy runtime |
//! | `dynamo` (alias `native`) | Dynamo 1.6's default cost, bit-exact: the router's native cost (SPEC §7), no scorer (the built-in `dynamo` component returns the same costs) |
//! | `llm-d` | llm-d's default scorer set: prefix-cache 3, kv-cache-utilization 2, queue 2, max-score picker ([`peers`]) |
//! | `sglang` | SGLang router's `cache_aware` policy at its defaults: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5 ([`peers`]) |
//! | `FILE.wasm[:CONFIG_JSON]` | the Wasm policy runtime: [`PolicyRegistry::load`] + [`RegistryScorer`], exactly as `serve --policy` |
//!
//! Every policy sees the same trace and fleet. A replay is repeatable: the router's random
//! tie-break (temperature 0) and sampling (temperature > 0) draw from a per-router generator
//! seeded with `--seed` (default 0; [`RouterConfig::rng_seed`]), the simulation is single-threaded
//! and uses simulated time only, and Wasm policies get a generous per-call deadline
//! ([`REPLAY_POLICY_DEADLINE_US`]) so a descheduled call on a busy machine does not fall back to the
//! native cost. Same trace, options and seed → the same `results.json` figures (except `wall_s`).
//!
//! # Traces
//! - **Mooncake** JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`). Each hash id
//!   stands for 512 tokens; token `pos` of id `h` is `xxh3_64((h, pos)) % 50,000`
//!   ([`trace::mooncake_token`]), so equal ids give equal blocks and the 64-token blocks inside an
//!   id differ from each other. `input_length` decides how many tokens the last id contributes.
//!   The default block size, 64, divides 512: each id becomes 8 blocks.
//! - **Azure** LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`; cite Splitwise,
//!   ISCA 2024). It has arrival times and lengths only, so prefix sharing is synthesized
//!   ([`trace::PrefixSynthesis`], recorded in `results.json`): request `i` draws a system prompt
//!   `p` from a pool of `--azure-prompts` (default 64) with a Zipf law of exponent `--azure-zipf`
//!   (default 1.0), its first `floor(--azure-shared-frac × ContextTokens)` tokens (default 0.5)
//!   are that system prompt's tokens, the rest are unique to the request. Draws use a `SmallRng`
//!   seeded with `--azure-seed` (default: `--seed`); tokens are `xxh3` of (owner, position)
//!   modulo 50,000.
//! - **Token** JSONL: `{"timestamp_ms": 0.0, "tokens": [1, 2, ...], "output_length": 16}`.
//!
//! `--speedup X` divides arrival times (X× the request rate), `--max-requests N` keeps the
//! first N requests of the file, `--block-size` sets the engines' (and router's) block size.
//!
//! # Output
//! `DIR/results.json` (`{"trace", "workers", "policies": [{"name", "requests", "token_hit_rate",
//! "ttft_ms": {"p50", "p90", "p99"}, "itl_ms": {"p50", "p99"}, "throughput_tok_s", "load_cov",
//! ...}]}` plus the configuration and a `definitions` object), `DIR/ttft_cdf.{png,svg}`,
//! `DIR/hit_rate.{png,svg}` and a table on stdout. Definitions:
//! - `token_hit_rate`: prompt tokens the chosen worker served from its prefix cache (as the
//!   simulated engine saw it at admission) / all prompt tokens.
//! - `load_cov`: coefficient of variation (population std / mean) of the **number of requests**
//!   each worker received (`prefill_tokens_cov` is the same over computed prompt tokens).
//! - `throughput_tok_s`: output tokens per simulated second, first arrival to last event.
//!
//! The plots' text uses an embedded font (Noto Sans), so no system font or fontconfig is needed.

pub mod agents;
mod cli;
pub mod engine;
pub mod flows;
pub mod peers;
pub mod plot;
pub mod report;
pub mod sim;
pub mod trace;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::router::{
    KvTransferEnforcement, PolicyLabel, Router, RouterConfig, Scorer, ScorerDecision,
    ScorerOutcome, Stage,
};
use kvroute_core::workers::TaintNames;
use kvroute_policy::RegistryScorer;
use kvroute_policy::{PolicyRegistry, PolicyRuntimeConfig, DEFAULT_POLICY_WASM};

pub use cli::{cli_main, plot_label, ReplayArgs};
pub use report::{PolicyResult, PolicyRun, Results};
pub use sim::{FleetShape, PreparedTrace, SimConfig, SimOutput, TransferModel};
pub use trace::{LoadOptions, PrefixSynthesis, Trace, TraceFormat, TraceRequest};

/// Makes a fresh scorer for one policy run.
pub type ScorerFactory = Arc<dyn Fn() -> Box<dyn Scorer> + Send + Sync>;

/// A policy to replay.
#[derive(Clone)]
pub enum PolicySpec {
    /// Candidates in turn.
    RoundRobin,
    /// The built-in `default` policy: its embedded component, run through the policy runtime
    /// exactly as `kvroute serve` runs it.
    Default,
    /// Dynamo 1.6's default cost, bit-exact, whatever `default` becomes: the reference every
    /// comparison can name.
    Dynamo,
    /// llm-d's default scorer set ([`peers::LlmdScorer`]).
    LlmD,
    /// SGLang router's `cache_aware` policy ([`peers::SglangScorer`]).
    Sglang,
    /// A Wasm policy component and its optional JSON configuration.
    Wasm {
        path: PathBuf,
        config: Option<String>,
    },
    /// Any scorer (library users, tests).
    Custom { name: String, make: ScorerFactory },
    /// A canary split (`--canary`): `fraction` of the requests routed by `candidate`, the rest by
    /// `control`, the arm chosen exactly as `kvroute serve` chooses it
    /// ([`kvroute_policy::canary_arm`] of the session id, or the request id when there is none).
    Canary {
        control: Box<PolicySpec>,
        candidate: Box<PolicySpec>,
        fraction: f64,
    },
}

impl std::fmt::Debug for PolicySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicySpec::RoundRobin => f.write_str("RoundRobin"),
            PolicySpec::Default => f.write_str("Default"),
            PolicySpec::Dynamo => f.write_str("Dynamo"),
            PolicySpec::LlmD => f.write_str("LlmD"),
            PolicySpec::Sglang => f.write_str("Sglang"),
            PolicySpec::Wasm { path, config } => f
                .debug_struct("Wasm")
                .field("path", path)
                .field("config", config)
                .finish(),
            PolicySpec::Custom { name, .. } => {
                f.debug_struct("Custom").field("name", name).finish()
            }
            PolicySpec::Canary {
                control,
                candidate,
                fraction,
            } => f
                .debug_struct("Canary")
                .field("control", control)
                .field("candidate", candidate)
                .field("fraction", fraction)
                .finish(),
        }
    }
}

impl PolicySpec {
    /// Parses `round-robin`, `default`, `dynamo` (alias `native`) or `FILE.wasm[:CONFIG_JSON]`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "round-robin" | "round_robin" | "rr" => return Ok(PolicySpec::RoundRobin),
            "default" => return Ok(PolicySpec::Default),
            "dynamo" | "native" => return Ok(PolicySpec::Dynamo),
            "llm-d" | "llmd" => return Ok(PolicySpec::LlmD),
            "sglang" => return Ok(PolicySpec::Sglang),
            _ => {}
        }
        if let Some(i) = s.find(".wasm:") {
            let config = s[i + ".wasm:".len()..].to_string();
            serde_json::from_str::<serde_json::Value>(&config).with_context(|| {
                format!("--policy {s}: the configuration after `.wasm:` is not JSON")
            })?;
            return Ok(PolicySpec::Wasm {
                path: PathBuf::from(&s[..i + ".wasm".len()]),
                config: Some(config),
            });
        }
        if s.ends_with(".wasm") {
            return Ok(PolicySpec::Wasm {
                path: PathBuf::from(s),
                config: None,
            });
        }
        bail!("unknown policy {s:?}: expected round-robin, default, dynamo, llm-d, sglang or FILE.wasm[:CONFIG_JSON]")
    }

    /// The name results are reported under.
    pub fn name(&self) -> String {
        match self {
            PolicySpec::RoundRobin => "round-robin".into(),
            PolicySpec::Default => "default".into(),
            PolicySpec::Dynamo => "dynamo".into(),
            PolicySpec::LlmD => "llm-d".into(),
            PolicySpec::Sglang => "sglang".into(),
            PolicySpec::Wasm { path, .. } => {
                let stem = path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "policy".into());
                let clean: String = stem
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                            c
                        } else {
                            '-'
                        }
                    })
                    .take(64)
                    .collect();
                if clean.is_empty() || clean.starts_with('.') {
                    format!("policy{clean}")
                } else {
                    clean
                }
            }
            PolicySpec::Custom { name, .. } => name.clone(),
            PolicySpec::Canary {
                control,
                candidate,
                fraction,
            } => format!("{}+canary:{}@{fraction}", control.name(), candidate.name()),
        }
    }

    fn describe(&self) -> String {
        match self {
            PolicySpec::Wasm { path, config } => match config {
                Some(c) => format!("{}:{c}", path.display()),
                None => path.display().to_string(),
            },
            PolicySpec::Canary {
                control,
                candidate,
                fraction,
            } => format!(
                "{} with a canary of {} at {fraction}",
                control.describe(),
                candidate.describe()
            ),
            other => other.name(),
        }
    }
}

/// Round robin as a [`Scorer`]: picks eligible candidates in turn.
pub struct RoundRobinScorer {
    next: AtomicUsize,
    label: Arc<PolicyLabel>,
}

impl Default for RoundRobinScorer {
    fn default() -> Self {
        Self {
            next: AtomicUsize::new(0),
            label: Arc::new(PolicyLabel {
                name: "round-robin".into(),
                version: 0,
                digest: String::new(),
            }),
        }
    }
}

impl Scorer for RoundRobinScorer {
    fn decide(
        &self,
        _: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        let n = c.len().max(1);
        ScorerDecision {
            outcome: ScorerOutcome::Pick(self.next.fetch_add(1, Relaxed) % n),
            label: self.label.clone(),
        }
    }
}

/// Per-call deadline of Wasm policies in a replay, in microseconds (the server's is 2,000). The
/// simulation runs on simulated time, so a slow call costs nothing but wall time, while a call that
/// misses a deadline because the machine descheduled it would fall back to the native cost and
/// make the replay unrepeatable.
pub const REPLAY_POLICY_DEADLINE_US: u64 = 100_000;

/// What every policy run of one configuration shares.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The simulated fleet (aggregated workers, or prefill + decode workers).
    pub fleet: FleetShape,
    pub sim: SimConfig,
    /// Settings of the router; its block size is forced to the workers'. Its `rng_seed` is
    /// `Some(0)` by default here (repeatable); `None` gives an OS-seeded generator.
    pub router: RouterConfig,
    /// A cap on the router's index entries (`limits.max_index_entries` of `kvroute serve`): what
    /// routing quality a cap below the working set costs.
    pub max_index_entries: Option<u64>,
    /// Router replicas sharing the fleet (`kvroute serve --cluster`); requests arrive at them in
    /// turn (sim module doc, "Router replicas").
    pub replicas: u32,
    /// How long one replica's booking change takes to reach the others, ms.
    pub sync_lag_ms: f64,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            fleet: FleetShape::Aggregated { workers: 8 },
            sim: SimConfig::default(),
            router: RouterConfig {
                rng_seed: Some(0),
                ..RouterConfig::default()
            },
            max_index_entries: None,
            replicas: 1,
            sync_lag_ms: 0.0,
        }
    }
}

/// Runs one policy on a fresh router and fleet.
pub fn run_policy(
    prepared: &PreparedTrace<'_>,
    opts: &ReplayOptions,
    policy: &PolicySpec,
    name: &str,
    progress: &mut dyn FnMut(u64),
) -> Result<PolicyRun> {
    if opts.replicas == 0 {
        bail!("at least one router replica");
    }
    // Replica r tie-breaks with its own generator (seed + r): replicas of one cluster do not share
    // their random draws. Replica 0 is the single router of a run without replicas.
    let routers = (0..u64::from(opts.replicas))
        .map(|r| {
            Router::new(RouterConfig {
                block_size: opts.sim.block_size,
                rng_seed: opts.router.rng_seed.map(|s| s.wrapping_add(r)),
                ..opts.router.clone()
            })
            .map_err(|e| anyhow!("router: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let router = &routers[0];
    // Keep the registries alive for the whole run (their maintenance threads serve the scorers);
    // one registry for every replica (each replica's scorer calls it), loaded once.
    let source = scorer_source(policy)?;
    for router in &routers {
        router.indexer().set_max_entries(opts.max_index_entries);
        router.set_scorer((source.make)());
    }
    let t0 = Instant::now();
    let replicas: Vec<&Router> = routers.iter().collect();
    let out = sim::simulate_replicated(
        &replicas,
        opts.sync_lag_ms,
        prepared,
        &opts.fleet,
        &opts.sim,
        progress,
    )
    .map_err(|e| anyhow!(e))?;
    let wall = t0.elapsed().as_secs_f64();
    let fallbacks = routers
        .iter()
        .map(|r| r.counters.fallbacks.load(Relaxed))
        .sum();
    let index = router.indexer().stats();
    let mut run =
        PolicyRun::from_output(name.to_string(), policy.describe(), &out, fallbacks, wall);
    if let PolicySpec::Canary {
        candidate,
        fraction,
        ..
    } = policy
    {
        run.result.canary = Some(report::CanarySplit::from_output(
            &out,
            &candidate.name(),
            *fraction,
            |i| kvroute_policy::canary_arm(&sim::request_id(i), *fraction),
        ));
    }
    if let Some(flows) = &prepared.trace.agents {
        run.result.sessions = Some(report::SessionFigures::from_output(&out, flows));
        run.result.inferred_sessions =
            router
                .sessions()
                .lineage()
                .map(|l| report::InferredSessions {
                    started: l.counters.started.load(Relaxed),
                    continued: l.counters.continued.load(Relaxed),
                    true_sessions: flows.sessions.len(),
                    true_top_level: flows.sessions.iter().filter(|s| s.parent.is_none()).count(),
                });
    }
    run.result.index_entries = index.held_blocks.iter().sum();
    run.result.fleet = opts.fleet.label();
    run.result.replicas = opts.replicas;
    run.result.sync_lag_ms = opts.sync_lag_ms;
    if let FleetShape::Disaggregated { .. } = opts.fleet {
        run.result.kv_transfer_topology =
            Some(enforcement_name(opts.router.disagg.kv_transfer_enforcement).to_string());
    }
    run.result.index_evicted_entries = index.evicted_entries;
    run.result.learned = (0..opts.fleet.workers())
        .map(|w| router.learned(u64::from(w)))
        .collect();
    run.result.predictions = router
        .prediction_stats()
        .map(|p| report::PredictionFigures {
            recorded: p.recorded,
            confirmed: p.confirmed,
            contradicted: p.contradicted,
            expired: p.expired,
        });
    Ok(run)
}

/// Makes one policy's scorer for each router of a run (`None`: the router's native cost), keeping
/// what they call alive.
struct ScorerSource {
    make: Box<dyn Fn() -> Option<Box<dyn Scorer>>>,
}

fn scorer_source(policy: &PolicySpec) -> Result<ScorerSource> {
    let registry_source = |registry: Arc<PolicyRegistry>| ScorerSource {
        make: Box::new(move || {
            Some(Box::new(RegistryScorer::new(registry.clone())) as Box<dyn Scorer>)
        }),
    };
    Ok(match policy {
        PolicySpec::RoundRobin => ScorerSource {
            make: Box::new(|| Some(Box::new(RoundRobinScorer::default()) as Box<dyn Scorer>)),
        },
        // Dynamo 1.6's cost is the router's native one: run natively (the embedded `dynamo`
        // component returns the same costs, bit for bit, so the picks are the same).
        PolicySpec::Dynamo => ScorerSource {
            make: Box::new(|| None),
        },
        PolicySpec::LlmD => ScorerSource {
            make: Box::new(|| Some(Box::new(peers::LlmdScorer::default()) as Box<dyn Scorer>)),
        },
        PolicySpec::Sglang => ScorerSource {
            make: Box::new(|| Some(Box::new(peers::SglangScorer::default()) as Box<dyn Scorer>)),
        },
        PolicySpec::Custom { make, .. } => {
            let make = make.clone();
            ScorerSource {
                make: Box::new(move || Some(make())),
            }
        }
        PolicySpec::Default => registry_source(
            load_component("default", DEFAULT_POLICY_WASM, None)
                .map_err(|e| anyhow!("the embedded default policy: {e}"))?,
        ),
        PolicySpec::Wasm { path, config } => {
            let bytes =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            registry_source(
                load_component(&policy.name(), &bytes, config.as_deref())
                    .map_err(|e| anyhow!("{}: {e}", path.display()))?,
            )
        }
        PolicySpec::Canary {
            control,
            candidate,
            fraction,
        } => {
            if !(*fraction > 0.0 && *fraction < 1.0) {
                bail!("--canary-fraction {fraction}: a fraction in (0, 1)");
            }
            let control = scorer_source(control)?;
            let candidate = scorer_source(candidate)?;
            let fraction = *fraction;
            ScorerSource {
                make: Box::new(move || {
                    Some(Box::new(SplitScorer {
                        control: (control.make)(),
                        candidate: (candidate.make)(),
                        fraction,
                        native: PolicyLabel::native(),
                    }) as Box<dyn Scorer>)
                }),
            }
        }
    })
}

/// A canary's split as a [`Scorer`]: each decision goes to the arm of its session (or request)
/// id's hash, as a live canary's would.
struct SplitScorer {
    control: Option<Box<dyn Scorer>>,
    candidate: Option<Box<dyn Scorer>>,
    fraction: f64,
    native: Arc<PolicyLabel>,
}

impl Scorer for SplitScorer {
    fn decide(
        &self,
        request: &PolicyRequest,
        candidates: &CandidateColumns,
        taints: &TaintNames,
        stage: Stage,
    ) -> ScorerDecision {
        let arm =
            kvroute_policy::canary_arm(kvroute_policy::rollout::arm_key(request), self.fraction);
        let scorer = match arm {
            kvroute_policy::Arm::Candidate => &self.candidate,
            kvroute_policy::Arm::Control => &self.control,
        };
        match scorer {
            Some(s) => s.decide(request, candidates, taints, stage),
            None => ScorerDecision {
                outcome: ScorerOutcome::Native,
                label: self.native.clone(),
            },
        }
    }
}

/// Loads a policy component into a fresh registry (replay deadline), whose scorer every replica of
/// the run calls; the registry must live as long as the run.
fn load_component(name: &str, bytes: &[u8], config: Option<&str>) -> Result<Arc<PolicyRegistry>> {
    let registry = Arc::new(
        PolicyRegistry::new(PolicyRuntimeConfig {
            deadline_us: REPLAY_POLICY_DEADLINE_US,
            ..PolicyRuntimeConfig::default()
        })
        .map_err(|e| anyhow!("policy runtime: {e}"))?,
    );
    registry
        .load(name, bytes, config, true)
        .map_err(|e| anyhow!("{e}"))?;
    Ok(registry)
}

/// How long a policy's run goes before its progress bar appears.
const BAR_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

fn enforcement_name(e: KvTransferEnforcement) -> &'static str {
    match e {
        KvTransferEnforcement::None => "none",
        KvTransferEnforcement::Preferred => "preferred",
        KvTransferEnforcement::Required => "required",
    }
}

/// What a configuration adds to a run's name when a command replays several: `@ 8` or
/// `@ 4P+4D/required`.
fn config_suffix(o: &ReplayOptions) -> String {
    let fleet = match o.fleet {
        FleetShape::Aggregated { .. } => format!(" @ {}", o.fleet.label()),
        FleetShape::Disaggregated { .. } => format!(
            " @ {}/{}",
            o.fleet.label(),
            enforcement_name(o.router.disagg.kv_transfer_enforcement)
        ),
    };
    let fleet = match (o.router.busy_threshold, &o.router.fairness) {
        (None, _) => fleet,
        (Some(_), Some(f)) => match f.max_wait_secs {
            Some(w) if w == kvroute_core::queue::DEFAULT_MAX_WAIT_SECS => format!("{fleet} q=fair"),
            Some(w) => format!("{fleet} q=fair/max-wait={w}s"),
            None => format!("{fleet} q=fair/no-bound"),
        },
        (Some(_), None) => format!("{fleet} q={}", queue_name(o.router.queue_order)),
    };
    if o.replicas > 1 {
        format!("{fleet} x{}r+{}ms", o.replicas, o.sync_lag_ms)
    } else {
        fleet
    }
}

fn queue_name(q: kvroute_core::queue::QueueOrder) -> &'static str {
    match q {
        kvroute_core::queue::QueueOrder::Fcfs => "fcfs",
        kvroute_core::queue::QueueOrder::Wspt => "wspt",
    }
}

/// Runs every policy on the same trace, once per configuration (fleet shape and router settings).
/// With several configurations, each run's name says its configuration (`default @ 4P+4D/required`,
/// `default @ 8 x4r+5ms`: four router replicas with a 5 ms sync lag).
/// `show_progress` draws a bar on stderr (only when stderr is a terminal, and only for a run that
/// has taken [`BAR_AFTER`]).
pub fn run(
    trace: &Trace,
    configs: &[ReplayOptions],
    policies: &[PolicySpec],
    show_progress: bool,
) -> Result<Vec<PolicyRun>> {
    let Some(first) = configs.first() else {
        bail!("no configuration to replay");
    };
    if configs
        .iter()
        .any(|c| c.sim.block_size != first.sim.block_size)
    {
        bail!("every configuration of one replay uses the same block size");
    }
    let prepared = PreparedTrace::new(trace, first.sim.block_size);
    let mut names: Vec<String> = Vec::new();
    let mut runs = Vec::with_capacity(policies.len() * configs.len());
    for opts in configs {
        for p in policies {
            let base = if configs.len() > 1 {
                format!("{}{}", p.name(), config_suffix(opts))
            } else {
                p.name()
            };
            let mut name = base.clone();
            let mut k = 2;
            while names.contains(&name) {
                name = format!("{base}-{k}");
                k += 1;
            }
            names.push(name.clone());
            // The bar appears only once a run has taken a second: a short replay prints no bar that
            // flashes and vanishes, a long one shows its progress and time left.
            let bar = if show_progress && std::io::stderr().is_terminal() {
                let bar = ProgressBar::with_draw_target(
                    Some(trace.requests.len() as u64),
                    ProgressDrawTarget::hidden(),
                );
                bar.set_style(
                ProgressStyle::with_template(
                    "{prefix:>16} [{elapsed_precise}] {wide_bar} {pos}/{len} requests, eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
                bar.set_prefix(name.clone());
                Some(bar)
            } else {
                None
            };
            let started = Instant::now();
            let mut shown = false;
            let run = run_policy(&prepared, opts, p, &name, &mut |done| {
                if let Some(bar) = &bar {
                    if !shown && started.elapsed() >= BAR_AFTER {
                        bar.set_draw_target(ProgressDrawTarget::stderr());
                        shown = true;
                    }
                    bar.set_position(done);
                }
            })?;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            runs.push(run);
        }
    }
    Ok(runs)
}
