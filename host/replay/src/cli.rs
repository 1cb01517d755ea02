//! `kvroute replay`'s command line: flags, their checks, and the run from trace to `results.json`,
//! plots and the table. The library ([`crate::run`]) knows nothing of flags.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use kvroute_core::router::{BypassRule, DisaggConfig, KvTransferEnforcement, RouterConfig};

use crate::sim::ZONE_DOMAIN;
use crate::{
    plot, report, run, trace, FleetShape, LoadOptions, PolicySpec, PrefixSynthesis, ReplayOptions,
    Results, SimConfig, TraceFormat, TransferModel,
};

/// `kvroute replay` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Trace file: Mooncake JSONL, Azure CSV, or token JSONL (or --workload agents instead).
    #[arg(long, required_unless_present = "workload")]
    pub trace: Option<PathBuf>,
    /// A generated workload instead of a trace: `agents` (closed-loop agent sessions with
    /// subagents; docs/SIMULATOR.md, "Agentic workload"), seeded with --seed.
    #[arg(long, conflicts_with = "trace")]
    pub workload: Option<String>,
    /// Agents: sessions running at once.
    #[arg(long, default_value_t = 250)]
    pub sessions: u32,
    /// Agents: top-level sessions in all [default: 2 x --sessions].
    #[arg(long)]
    pub session_count: Option<u32>,
    /// Agents: tenants the sessions belong to (tenant t with probability ∝ 1/(t+1)).
    #[arg(long, default_value_t = 4)]
    pub tenants: u32,
    /// Agents: mean tool-result tokens added per turn (log-normal, σ = 1).
    #[arg(long, default_value_t = 1500.0, allow_negative_numbers = true)]
    pub agent_tool_tokens: f64,
    /// Agents: mean output tokens per turn (exponential).
    #[arg(long, default_value_t = 150.0, allow_negative_numbers = true)]
    pub agent_output_tokens: f64,
    /// Agents: mean think time between turns, ms (exponential).
    #[arg(long, default_value_t = 1000.0, allow_negative_numbers = true)]
    pub agent_think_ms: f64,
    /// Agents: probability that a turn forks subagents.
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub agent_subagent_prob: f64,
    /// Agents: a session ends before its prompt passes this many tokens.
    #[arg(long, default_value_t = 40_000)]
    pub agent_max_context: u32,
    /// The router's queue (docs/SPEC.md §9): none (requests go to the engines at once, which
    /// queue them), fcfs, wspt, or fair (fcfs inside least-attained-service tenants and sessions);
    /// comma-separated to compare, one run each.
    #[arg(long, value_delimiter = ',', default_value = "none")]
    pub queue: Vec<String>,
    /// With --queue: the router's busy threshold (fraction of max_num_batched_tokens of booked
    /// prefill tokens past which a worker is busy).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub busy_threshold: f64,
    /// Agents: what the clients send: `sent` (each request's session and parent ids, as agent
    /// harnesses send them), `none` (no key: the router has no sessions), `inferred` (no key, and
    /// the router infers sessions from prefix lineage: `[sessions] infer = "prefix"`).
    #[arg(long, default_value = "sent")]
    pub session_keys: String,
    /// With --queue fair: the half-life of attained service, seconds.
    #[arg(long, default_value_t = 60.0, allow_negative_numbers = true)]
    pub fair_half_life_secs: f64,
    /// With --queue fair: the starvation bound, seconds (`[fairness] max_wait_secs`; 0: none);
    /// comma-separated to compare, one fair run each.
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [kvroute_core::queue::DEFAULT_MAX_WAIT_SECS],
        allow_negative_numbers = true
    )]
    pub fair_max_wait_secs: Vec<f64>,
    /// Trace format.
    #[arg(long, value_enum, default_value = "auto")]
    pub format: TraceFormat,
    /// Simulated workers of the aggregated fleet, one data-parallel rank each [default with
    /// --prefill-workers: the prefill and decode workers' total, so both fleets compare].
    #[arg(long)]
    pub workers: Option<u32>,
    /// A disaggregated fleet: this many prefill workers (pairs with --decode-workers; repeat
    /// both to compare several splits, e.g. 4+4 and 2+6).
    #[arg(long = "prefill-workers")]
    pub prefill_workers: Vec<u32>,
    /// A disaggregated fleet: this many decode workers (pairs with --prefill-workers).
    #[arg(long = "decode-workers")]
    pub decode_workers: Vec<u32>,
    /// Disaggregated fleets: how the prefill worker's zone constrains the decode worker, one run
    /// each: none, preferred, required (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "none")]
    pub kv_transfer_topology: Vec<String>,
    /// Disaggregated fleets: zones the workers are spread over (prefill and decode workers each
    /// round-robin).
    #[arg(long, default_value_t = 1)]
    pub zones: u32,
    /// KV transfer speed inside a zone, gigabits per second.
    #[arg(long, default_value_t = 400.0, allow_negative_numbers = true)]
    pub kv_transfer_gbps: f64,
    /// KV transfer speed across zones, gigabits per second.
    #[arg(long, default_value_t = 50.0, allow_negative_numbers = true)]
    pub kv_transfer_cross_gbps: f64,
    /// KV bytes per prompt token (default: an 8B model, 32 layers x 8 KV heads x 128 x 2 x 2 B).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// Fixed cost of one KV transfer, ms.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub kv_transfer_latency_ms: f64,
    /// Disaggregated fleets: the bypass rule that keeps a prefill on its decode worker (never,
    /// isl_bounding, prefill_load, isl_or_load; Dynamo's thresholds).
    #[arg(long, default_value = "never")]
    pub disagg_bypass: String,
    /// Router replicas sharing the fleet, as `kvroute serve --cluster` runs them (requests arrive
    /// at them in turn; each books its own and learns the others' bookings --sync-lag-ms later).
    /// Comma-separated to compare, e.g. 1,2,4: one run per count and lag.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub replicas: Vec<u32>,
    /// With --replicas above 1: how long a booking change takes to reach the other replicas, ms
    /// (comma-separated to compare).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0",
        allow_negative_numbers = true
    )]
    pub sync_lag_ms: Vec<f64>,
    /// With --prefill-workers: do not replay the aggregated fleet beside the disaggregated ones.
    #[arg(long)]
    pub no_aggregated: bool,
    /// round-robin | default | dynamo | llm-d | sglang | FILE.wasm[:CONFIG_JSON]; repeat to compare
    /// [default: round-robin and default].
    #[arg(long = "policy")]
    pub policies: Vec<String>,
    /// A candidate policy (same forms as --policy) replayed as a live canary would run: each
    /// --policy is the control, and --canary-fraction of the requests (by request id hash, as
    /// `kvroute serve` assigns arms) go to the candidate. Reported per arm, with 95% intervals.
    #[arg(long)]
    pub canary: Option<String>,
    /// The candidate's share of a --canary split, in (0, 1).
    #[arg(long, default_value_t = 0.2, allow_negative_numbers = true)]
    pub canary_fraction: f64,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Divide arrival times by this (compress the trace).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub speedup: f64,
    /// Keep only the first N requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Tokens per KV block (engines and router).
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Seed of the router's random tie-break and sampling (and, unless --azure-seed is given, of
    /// the synthesized prefix sharing of Azure traces). Same seed, same results.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Router temperature: 0 picks the lowest cost (random among ties); T > 0 samples with
    /// `p ∝ exp(-(cost - min) / ((max - min) T))` (docs/SPEC.md §7).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f64,
    /// Azure traces: seed of the synthesized prefix sharing [default: --seed].
    #[arg(long)]
    pub azure_seed: Option<u64>,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks: u32,
    /// Most requests a worker runs at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Token budget of one engine step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: u32,
    /// Divide engine step times by this (faster engines).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub worker_speedup: f64,
    /// A heterogeneous fleet: each worker's own speed factor, comma-separated, repeated over the
    /// workers (`1,0.5` = every other worker twice as slow; step times are divided by it).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub worker_speed: Vec<f64>,
    /// Simulated delay of KV events from an engine to the router, in ms.
    #[arg(long, default_value_t = 5.0, allow_negative_numbers = true)]
    pub kv_event_lag_ms: f64,
    /// Azure traces: number of system prompts to draw from.
    #[arg(long, default_value_t = 64)]
    pub azure_prompts: u32,
    /// Azure traces: Zipf exponent of the system-prompt draw.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub azure_zipf: f64,
    /// Azure traces: fraction of each prompt taken from its system prompt.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    pub azure_shared_frac: f64,
    /// Skip the plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Cap the router's index at this many (worker, block) entries, as `limits.max_index_entries`
    /// does for `kvroute serve` (least recently matched blocks of the largest holders go first).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_index_entries: Option<u64>,
    /// Predict-on-route, as `routing.predict_on_route` does for `kvroute serve`: a booked prompt
    /// counts as cached on its worker for `--predict-ttl-ms` until KV events confirm or
    /// contradict it (`true` | `false`).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub predict_on_route: bool,
    /// How long a prediction lasts without an event, in (simulated) ms.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub predict_ttl_ms: u64,
}

/// The end of the plots' titles: the trace, the fleet and how both were sped up.
pub fn plot_label(trace: &str, workers: u32, sim: &SimConfig, speedup: f64) -> String {
    let mut s = format!(
        "{trace}, {workers} workers × {} KV blocks, arrivals ×{speedup}",
        sim.num_gpu_blocks
    );
    if sim.speedup != 1.0 {
        s += &format!(", engines ×{}", sim.speedup);
    }
    if !sim.worker_speeds.is_empty() {
        let speeds: Vec<String> = sim.worker_speeds.iter().map(|v| v.to_string()).collect();
        s += &format!(", worker speeds {}", speeds.join("/"));
    }
    s
}

/// Entry point of `kvroute replay`.
pub fn cli_main(args: ReplayArgs) -> ExitCode {
    match cli_run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn cli_run(args: ReplayArgs) -> Result<()> {
    let policies: Vec<PolicySpec> = if args.policies.is_empty() {
        vec![PolicySpec::RoundRobin, PolicySpec::Default]
    } else {
        args.policies
            .iter()
            .map(|s| PolicySpec::parse(s))
            .collect::<Result<_>>()?
    };
    let policies = match &args.canary {
        None => policies,
        Some(c) => {
            if !(args.canary_fraction > 0.0 && args.canary_fraction < 1.0) {
                bail!(
                    "--canary-fraction {}: a fraction in (0, 1)",
                    args.canary_fraction
                );
            }
            let candidate = PolicySpec::parse(c)?;
            policies
                .into_iter()
                .map(|control| PolicySpec::Canary {
                    control: Box::new(control),
                    candidate: Box::new(candidate.clone()),
                    fraction: args.canary_fraction,
                })
                .collect()
        }
    };
    let (send_session_keys, infer) = match args.session_keys.as_str() {
        "sent" => (true, kvroute_core::lineage::SessionInference::Off),
        "none" => (false, kvroute_core::lineage::SessionInference::Off),
        "inferred" => (false, kvroute_core::lineage::SessionInference::Prefix),
        other => bail!("--session-keys {other:?}: expected sent, none or inferred"),
    };
    let base_router = RouterConfig {
        sessions: kvroute_core::sessions::SessionConfig {
            infer,
            ..Default::default()
        },
        rng_seed: Some(args.seed),
        default_temperature: args.temperature,
        predict: args
            .predict_on_route
            .then(|| kvroute_core::predict::PredictConfig {
                ttl: std::time::Duration::from_millis(args.predict_ttl_ms),
                ..Default::default()
            }),
        ..RouterConfig::default()
    };
    let configs = with_queues(configurations(&args, &base_router)?, &args)?;
    let workers = configs.iter().map(|c| c.fleet.workers()).max().unwrap_or(0);
    if args.max_requests == Some(0) {
        bail!("--max-requests must be at least 1 (leave it out to replay the whole trace)");
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!("--temperature must be a finite number >= 0");
    }
    let sim = SimConfig {
        num_gpu_blocks: args.num_gpu_blocks,
        block_size: args.block_size,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        speedup: args.worker_speedup,
        worker_speeds: args.worker_speed.clone(),
        kv_event_lag_ms: args.kv_event_lag_ms,
        send_session_keys,
        ..SimConfig::default()
    };
    sim.validate().map_err(|e| anyhow!(e))?;
    let load = LoadOptions {
        format: args.format,
        max_requests: args.max_requests,
        speedup: args.speedup,
        synthesis: PrefixSynthesis {
            prompts: args.azure_prompts,
            zipf_s: args.azure_zipf,
            shared_frac: args.azure_shared_frac,
            seed: args.azure_seed.unwrap_or(args.seed),
            ..PrefixSynthesis::default()
        },
    };
    let t0 = Instant::now();
    let trace = match (&args.trace, args.workload.as_deref()) {
        (_, Some("agents")) => crate::agents::generate(&crate::agents::AgentOptions {
            concurrency: args.sessions,
            sessions: args
                .session_count
                .unwrap_or(args.sessions.saturating_mul(2)),
            seed: args.seed,
            tenants: args.tenants,
            tool_tokens_mean: args.agent_tool_tokens,
            output_tokens_mean: args.agent_output_tokens,
            think_ms_mean: args.agent_think_ms,
            subagent_prob: args.agent_subagent_prob,
            max_context: args.agent_max_context,
            ..crate::agents::AgentOptions::default()
        })
        .map_err(|e| anyhow!(e))?,
        (_, Some(other)) => bail!("--workload {other:?}: expected agents"),
        (Some(path), None) => trace::load(path, &load)?,
        (None, None) => bail!("--trace or --workload is required"),
    };
    if trace.format == TraceFormat::Mooncake && 512 % args.block_size != 0 {
        eprintln!(
            "warning: --block-size {} does not divide Mooncake's 512-token blocks; blocks straddle hash ids",
            args.block_size
        );
    }
    eprintln!(
        "loaded {} ({}): {} requests, {} prompt tokens in {:.2}s",
        trace.name,
        trace.format.as_str(),
        trace.requests.len(),
        trace.prompt_tokens(),
        t0.elapsed().as_secs_f64()
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let configs: Vec<ReplayOptions> = configs
        .into_iter()
        .map(|c| ReplayOptions {
            sim: sim.clone(),
            max_index_entries: args.max_index_entries,
            ..c
        })
        .collect();
    let runs = run(&trace, &configs, &policies, true)?;
    for r in &runs {
        eprintln!(
            "{}: simulated {:.1}s in {:.2}s wall",
            r.result.name, r.result.simulated_s, r.result.wall_s
        );
    }
    let mut results = Results::new(
        &trace,
        workers,
        &sim,
        args.speedup,
        args.max_requests,
        args.seed,
        &runs,
    );
    results.max_index_entries = args.max_index_entries;
    if let Some(c) = configs
        .iter()
        .find(|c| matches!(c.fleet, FleetShape::Disaggregated { .. }))
    {
        if let FleetShape::Disaggregated {
            zones, transfer, ..
        } = &c.fleet
        {
            results.zones = Some(*zones);
            results.kv_transfer = Some(transfer.clone());
        }
        results.router_disaggregation = Some(c.router.disagg.clone());
    }
    let path = args.out.join("results.json");
    let json = serde_json::to_string_pretty(&results)?;
    std::fs::write(&path, json + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    if !args.no_plots {
        let label = plot_label(&trace.name, workers, &sim, args.speedup);
        plot::write_plots(&args.out, &runs, &label).map_err(|e| anyhow!("plots: {e}"))?;
    }
    print!("{}", report::table(&runs));
    print!("{}", report::summary(&runs, trace.format.as_str()));
    for r in &runs {
        if let Some(c) = &r.result.canary {
            print!("{}", c.describe(&r.result.name));
        }
    }
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// The fleets and router settings one command replays: the aggregated fleet (unless
/// `--no-aggregated`), then each prefill/decode split under each KV transfer constraint.
fn configurations(args: &ReplayArgs, base: &RouterConfig) -> Result<Vec<ReplayOptions>> {
    if args.prefill_workers.len() != args.decode_workers.len() {
        bail!(
            "--prefill-workers and --decode-workers pair up: got {} of the first and {} of the second",
            args.prefill_workers.len(),
            args.decode_workers.len()
        );
    }
    let splits: Vec<(u32, u32)> = args
        .prefill_workers
        .iter()
        .copied()
        .zip(args.decode_workers.iter().copied())
        .collect();
    if let Some((p, d)) = splits.iter().find(|(p, d)| *p == 0 || *d == 0) {
        bail!("--prefill-workers {p} --decode-workers {d}: a disaggregated fleet needs at least one of each");
    }
    if args.zones == 0 {
        bail!("--zones must be at least 1");
    }
    let transfer = TransferModel {
        gbps_within: args.kv_transfer_gbps,
        gbps_cross: args.kv_transfer_cross_gbps,
        bytes_per_token: args.kv_bytes_per_token,
        latency_ms: args.kv_transfer_latency_ms,
    };
    let bypass = match args.disagg_bypass.as_str() {
        "never" => BypassRule::Never,
        "isl_bounding" => BypassRule::IslBounding,
        "prefill_load" => BypassRule::PrefillLoad,
        "isl_or_load" => BypassRule::IslOrLoad,
        other => bail!(
            "--disagg-bypass {other:?}: expected never, isl_bounding, prefill_load or isl_or_load"
        ),
    };
    let mut modes = Vec::new();
    for m in &args.kv_transfer_topology {
        let m = match m.trim() {
            "none" => KvTransferEnforcement::None,
            "preferred" => KvTransferEnforcement::Preferred,
            "required" => KvTransferEnforcement::Required,
            other => {
                bail!("--kv-transfer-topology {other:?}: expected none, preferred or required")
            }
        };
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    let mut configs = Vec::new();
    let aggregated = match (args.workers, splits.first()) {
        (Some(0), _) => bail!("--workers must be at least 1"),
        (Some(w), _) => Some(w),
        (None, Some((p, d))) => Some(p + d),
        (None, None) => bail!("--workers is required (or --prefill-workers with --decode-workers)"),
    };
    if splits.is_empty() || !args.no_aggregated {
        if let Some(workers) = aggregated {
            configs.push(ReplayOptions {
                fleet: FleetShape::Aggregated { workers },
                router: base.clone(),
                ..ReplayOptions::default()
            });
        }
    }
    for (prefill, decode) in splits {
        for &mode in &modes {
            let fleet = FleetShape::Disaggregated {
                prefill,
                decode,
                zones: args.zones,
                transfer: transfer.clone(),
            };
            let disagg = DisaggConfig {
                kv_transfer_domain: Some(ZONE_DOMAIN.to_string()),
                kv_transfer_enforcement: mode,
                bypass,
                ..DisaggConfig::default()
            };
            disagg
                .validate()
                .map_err(|e| anyhow!("disaggregation settings: {e}"))?;
            configs.push(ReplayOptions {
                fleet,
                router: RouterConfig {
                    disagg,
                    ..base.clone()
                },
                ..ReplayOptions::default()
            });
        }
    }
    for c in &configs {
        if let FleetShape::Disaggregated { transfer, .. } = &c.fleet {
            transfer.validate().map_err(|e| anyhow!(e))?;
        }
    }
    with_replicas(configs, &args.replicas, &args.sync_lag_ms)
}

/// Each configuration once per `--queue` mode.
fn with_queues(configs: Vec<ReplayOptions>, args: &ReplayArgs) -> Result<Vec<ReplayOptions>> {
    if !(args.busy_threshold.is_finite() && args.busy_threshold > 0.0) {
        bail!("--busy-threshold must be a positive number");
    }
    let fair = kvroute_core::queue::FairConfig {
        half_life_secs: args.fair_half_life_secs,
        ..Default::default()
    };
    fair.validate()
        .map_err(|e| anyhow!("--fair-half-life-secs: {e}"))?;
    let mut fairs = Vec::new();
    for &w in &args.fair_max_wait_secs {
        if !(w.is_finite() && w >= 0.0) {
            bail!("--fair-max-wait-secs {w}: 0 (no bound) or a positive number of seconds");
        }
        let f = kvroute_core::queue::FairConfig {
            max_wait_secs: (w != 0.0).then_some(w),
            ..fair.clone()
        };
        f.validate()
            .map_err(|e| anyhow!("--fair-max-wait-secs: {e}"))?;
        if !fairs.contains(&f) {
            fairs.push(f);
        }
    }
    let mut out = Vec::new();
    for mode in &args.queue {
        if mode.trim() == "fair" {
            for f in &fairs {
                for c in &configs {
                    let mut c = c.clone();
                    c.router.busy_threshold = Some(args.busy_threshold);
                    c.router.queue_order = kvroute_core::queue::QueueOrder::Fcfs;
                    c.router.fairness = Some(f.clone());
                    out.push(c);
                }
            }
            continue;
        }
        let (busy, order, fairness) = match mode.trim() {
            "none" => (None, kvroute_core::queue::QueueOrder::Fcfs, None),
            "fcfs" => (
                Some(args.busy_threshold),
                kvroute_core::queue::QueueOrder::Fcfs,
                None,
            ),
            "wspt" => (
                Some(args.busy_threshold),
                kvroute_core::queue::QueueOrder::Wspt,
                None,
            ),
            other => bail!("--queue {other:?}: expected none, fcfs, wspt or fair"),
        };
        for c in &configs {
            let mut c = c.clone();
            c.router.busy_threshold = busy;
            c.router.queue_order = order;
            c.router.fairness = fairness.clone();
            out.push(c);
        }
    }
    Ok(out)
}

/// Each configuration once per replica count and sync lag (one router: once, lag 0).
fn with_replicas(
    configs: Vec<ReplayOptions>,
    replicas: &[u32],
    lags: &[f64],
) -> Result<Vec<ReplayOptions>> {
    if let Some(r) = replicas.iter().find(|&&r| r == 0) {
        bail!("--replicas {r}: at least one router replica");
    }
    if let Some(l) = lags.iter().find(|l| !(l.is_finite() && **l >= 0.0)) {
        bail!("--sync-lag-ms {l}: a lag is a finite number of milliseconds, 0 or more");
    }
    let mut out = Vec::new();
    for c in configs {
        for &r in replicas {
            let lags: &[f64] = if r == 1 { &[0.0] } else { lags };
            for &sync_lag_ms in lags {
                let run = ReplayOptions {
                    replicas: r,
                    sync_lag_ms,
                    ..c.clone()
                };
                if !out.iter().any(|o: &ReplayOptions| {
                    o.fleet == run.fleet
                        && o.router.disagg.kv_transfer_enforcement
                            == run.router.disagg.kv_transfer_enforcement
                        && o.replicas == r
                        && o.sync_lag_ms == sync_lag_ms
                }) {
                    out.push(run);
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ReplayArgs,
    }

    fn queues(flags: &[&str]) -> Result<Vec<ReplayOptions>> {
        let mut argv = vec!["replay", "--workload", "agents", "--out", "/nonexistent"];
        argv.extend_from_slice(flags);
        let cmd = Cmd::try_parse_from(argv).expect("flags parse");
        with_queues(vec![ReplayOptions::default()], &cmd.args)
    }

    #[test]
    fn one_fair_run_per_starvation_bound() {
        let runs = queues(&[
            "--queue",
            "fcfs,fair",
            "--fair-max-wait-secs",
            "0,10,2.5,10",
        ])
        .unwrap();
        let bounds: Vec<_> = runs
            .iter()
            .map(|r| r.router.fairness.as_ref().map(|f| f.max_wait_secs))
            .collect();
        assert_eq!(
            bounds,
            [None, Some(None), Some(Some(10.0)), Some(Some(2.5))]
        );
        // by default, the default bound
        let runs = queues(&["--queue", "fair"]).unwrap();
        assert_eq!(
            runs[0].router.fairness.as_ref().unwrap().max_wait_secs,
            Some(kvroute_core::queue::DEFAULT_MAX_WAIT_SECS)
        );
        for bad in ["-1", "nan", "inf"] {
            let e = queues(&["--queue", "fair", "--fair-max-wait-secs", bad]).unwrap_err();
            assert!(e.to_string().contains("--fair-max-wait-secs"), "{bad}: {e}");
        }
    }
}
