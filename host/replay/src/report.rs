//! Results of a replay: per-policy metrics, `results.json`, the stdout table and the plots.

use serde::Serialize;
use std::fmt::Write as _;

use crate::sim::{SimConfig, SimOutput};
use crate::trace::{PrefixSynthesis, Trace};

/// p50 / p90 / p99 and the mean, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Nearest-rank percentile of sorted values (NaN when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The [`Latency`] of the finite values among `values` (NaN marks "did not happen").
fn latency_of(values: impl Iterator<Item = f64>) -> Latency {
    let mut v: Vec<f64> = values.filter(|t| t.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    latency(&v)
}

fn latency(sorted: &[f64]) -> Latency {
    Latency {
        p50: percentile(sorted, 50.0),
        p90: percentile(sorted, 90.0),
        p99: percentile(sorted, 99.0),
        mean: if sorted.is_empty() {
            f64::NAN
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        },
    }
}

/// Coefficient of variation (population standard deviation / mean); 0 for a constant or empty
/// series.
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// One policy's figures, as written to `results.json`.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub name: String,
    /// The fleet this run simulated: `8` (aggregated workers) or `4P+4D` (prefill + decode
    /// workers, with `, 2 zones` when zoned).
    pub fleet: String,
    /// Disaggregated fleets: how the KV transfer constrained the decode worker (`none`,
    /// `preferred`, `required`).
    pub kv_transfer_topology: Option<String>,
    /// Router replicas that shared the fleet (`--replicas`; 1: one router).
    pub replicas: u32,
    /// With several replicas: the simulated booking sync lag between them, ms.
    pub sync_lag_ms: f64,
    /// Booking sync messages delivered between the replicas, and the ones a replica could not
    /// apply (0 with one replica).
    pub sync_messages: u64,
    pub sync_refused: u64,
    /// What was asked for on the command line (`round-robin`, `default`, a path...).
    pub spec: String,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests that got their last token.
    pub completed: usize,
    /// Requests the router or the worker refused (see `errors`).
    pub refused: usize,
    /// Prompt tokens served from the worker's prefix cache / prompt tokens, over the requests
    /// that got a first token.
    pub token_hit_rate: f64,
    /// Arrival to first token.
    pub ttft_ms: Latency,
    /// Gap between consecutive output tokens of a request, over every gap of every request.
    pub itl_ms: Latency,
    /// Output tokens of completed requests per simulated second (first arrival to last token).
    pub throughput_tok_s: f64,
    /// Coefficient of variation of the number of requests routed to each worker.
    pub load_cov: f64,
    /// Coefficient of variation of the prompt tokens each worker computed (cache misses).
    pub prefill_tokens_cov: f64,
    /// Largest share of the requests any one worker received.
    pub max_worker_share: f64,
    pub requests_per_worker: Vec<u64>,
    pub prefill_tokens_per_worker: Vec<u64>,
    pub preemptions: u64,
    pub evicted_blocks: u64,
    /// Decisions where the policy failed and the router used its native cost.
    pub policy_fallbacks: u64,
    pub kv_events_applied: u64,
    pub kv_events_rejected: u64,
    /// (worker, block) entries the router's index held when the run ended.
    pub index_entries: u64,
    /// Entries the index evicted to stay under `--max-index-entries` (0 without a cap).
    pub index_evicted_entries: u64,
    /// Router or worker refusals by code.
    pub errors: std::collections::BTreeMap<String, u64>,
    /// Disaggregated fleets: the split requests and their KV transfers.
    pub disaggregation: Option<DisaggFigures>,
    /// Simulated time from the first arrival to the last event.
    pub simulated_s: f64,
    /// Wall-clock time of this policy's simulation.
    pub wall_s: f64,
    /// Each worker's step times as the router learned them by the end of the run (worker order).
    pub learned: Vec<kvroute_core::learn::Learned>,
    /// Predict-on-route's statistics (`--predict-on-route true`).
    pub predictions: Option<PredictionFigures>,
    /// A canary split (`--canary`): the two arms' figures and the confidence intervals of their
    /// differences, as `GET /v1/policies/{name}/canary` reports a live canary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanarySplit>,
    /// Time requests waited in the router's queue (`--queue`), ms; zeros without one.
    pub queued_ms: Latency,
    /// The floor under `ttft_ms`: each request's uncached prompt tokens computed alone on the
    /// worker that computed them, over the requests that got a first token. No queue order
    /// brings a TTFT percentile below this one (for the same cache hits).
    pub prefill_alone_ms: Latency,
    /// An agentic workload's sessions (`--workload agents`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<SessionFigures>,
    /// Sessions the router inferred from prefix lineage (`--session-keys inferred`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inferred_sessions: Option<InferredSessions>,
}

/// What prefix-lineage inference made of a keyless workload (`results.json`
/// `inferred_sessions`), beside what the workload really was.
#[derive(Clone, Debug, Serialize)]
pub struct InferredSessions {
    /// Keyless requests that started an inferred session.
    pub started: u64,
    /// Keyless requests found to continue one.
    pub continued: u64,
    /// The workload's sessions (subagents included): the `started` of a perfect inference,
    /// subagents aside (a subagent forked from its parent's prompt continues the parent's).
    pub true_sessions: usize,
    /// The workload's top-level sessions.
    pub true_top_level: usize,
}

/// One agent session's figures.
#[derive(Clone, Debug, Serialize)]
pub struct SessionRow {
    pub session: u32,
    pub parent: Option<u32>,
    pub tenant: u32,
    pub turns: usize,
    /// Mean time to first token over its turns.
    pub ttft_ms: f64,
    /// The longest any of its turns waited for its first token (its starvation).
    pub longest_wait_ms: f64,
    /// Its first turn's arrival to its last turn's last token.
    pub completion_ms: f64,
}

/// An agentic workload's per-session figures (`results.json` `sessions`).
#[derive(Clone, Debug, Serialize)]
pub struct SessionFigures {
    pub count: usize,
    /// Over sessions: each session's mean TTFT.
    pub session_ttft_ms: Latency,
    /// Over sessions: first arrival to last token.
    pub completion_ms: Latency,
    /// Over sessions: each one's longest wait for a first token.
    pub longest_wait_ms: Latency,
    /// The longest wait of any request of the run (the starvation bound observed).
    pub max_wait_ms: f64,
    /// One row per tenant, in tenant order: what fair queueing is for is visible here (a light
    /// tenant's tail against the heavy one's), where the run's own percentiles mix them.
    pub per_tenant: Vec<TenantRow>,
    pub per_session: Vec<SessionRow>,
}

/// One tenant's figures over its requests (`results.json` `sessions.per_tenant`).
#[derive(Clone, Debug, Serialize)]
pub struct TenantRow {
    pub tenant: u32,
    /// Its sessions, subagents included.
    pub sessions: usize,
    /// Its requests that got a first token.
    pub requests: usize,
    /// Over those requests: time to first token.
    pub ttft_ms: Latency,
    /// Over those requests: the time each waited in the router's queue.
    pub queued_ms: Latency,
    /// Over those requests: the floor under their TTFT (the run's `prefill_alone_ms`, per
    /// tenant), below which no queue order brings this tenant's percentiles.
    pub prefill_alone_ms: Latency,
}

impl SessionFigures {
    pub fn from_output(out: &SimOutput, flows: &crate::agents::AgentFlows) -> Self {
        let mut rows = Vec::with_capacity(flows.sessions.len());
        for (k, s) in flows.sessions.iter().enumerate() {
            let reqs: Vec<&crate::sim::RequestOutcome> = s
                .requests
                .iter()
                .map(|&i| &out.requests[i as usize])
                .collect();
            let waits: Vec<f64> = reqs
                .iter()
                .filter(|o| o.first_token_ms.is_finite())
                .map(|o| o.first_token_ms - o.arrival_ms)
                .collect();
            let start = reqs.first().map_or(f64::NAN, |o| o.arrival_ms);
            let end = reqs.last().map_or(f64::NAN, |o| o.done_ms);
            rows.push(SessionRow {
                session: k as u32,
                parent: s.parent,
                tenant: s.tenant,
                turns: s.requests.len(),
                ttft_ms: if waits.is_empty() {
                    f64::NAN
                } else {
                    waits.iter().sum::<f64>() / waits.len() as f64
                },
                longest_wait_ms: waits.iter().copied().fold(f64::NAN, f64::max),
                completion_ms: end - start,
            });
        }
        let sorted = |f: fn(&SessionRow) -> f64| {
            let mut v: Vec<f64> = rows.iter().map(f).filter(|x| x.is_finite()).collect();
            v.sort_by(f64::total_cmp);
            latency(&v)
        };
        let max_wait_ms = rows
            .iter()
            .map(|r| r.longest_wait_ms)
            .filter(|x| x.is_finite())
            .fold(0.0, f64::max);
        let tenants = flows
            .sessions
            .iter()
            .map(|s| s.tenant + 1)
            .max()
            .unwrap_or(0);
        let per_tenant = (0..tenants)
            .map(|t| {
                let sessions: Vec<_> = flows.sessions.iter().filter(|s| s.tenant == t).collect();
                let served: Vec<&crate::sim::RequestOutcome> = sessions
                    .iter()
                    .flat_map(|s| s.requests.iter().map(|&i| &out.requests[i as usize]))
                    .filter(|o| o.first_token_ms.is_finite())
                    .collect();
                TenantRow {
                    tenant: t,
                    sessions: sessions.len(),
                    requests: served.len(),
                    ttft_ms: latency_of(served.iter().map(|o| o.first_token_ms - o.arrival_ms)),
                    queued_ms: latency_of(served.iter().map(|o| o.queued_ms)),
                    prefill_alone_ms: latency_of(served.iter().map(|o| o.prefill_alone_ms)),
                }
            })
            .collect();
        Self {
            count: rows.len(),
            session_ttft_ms: sorted(|r| r.ttft_ms),
            completion_ms: sorted(|r| r.completion_ms),
            longest_wait_ms: sorted(|r| r.longest_wait_ms),
            max_wait_ms,
            per_tenant,
            per_session: rows,
        }
    }
}

/// One arm of a replayed canary split.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CanaryArm {
    /// Requests assigned to the arm.
    pub requests: usize,
    pub completed: usize,
    pub refused: usize,
    pub token_hit_rate: f64,
    pub ttft_ms: kvroute_policy::rollout::Summary,
    /// Per request: (last token − first token) / (output tokens − 1).
    pub itl_ms: kvroute_policy::rollout::Summary,
}

/// A replayed canary: what `kvroute serve` would measure with the same split on this trace.
#[derive(Clone, Debug, Serialize)]
pub struct CanarySplit {
    pub candidate: String,
    pub fraction: f64,
    /// What the arm was hashed from (`request_id`: trace requests have no session).
    pub key: &'static str,
    pub control: CanaryArm,
    #[serde(rename = "candidate_arm")]
    pub candidate_arm: CanaryArm,
    /// Candidate − control, with 95% intervals (the live canary's methods).
    pub ttft_mean_ms: Option<kvroute_policy::rollout::Difference>,
    pub ttft_p90_ms: Option<kvroute_policy::rollout::Difference>,
    pub itl_mean_ms: Option<kvroute_policy::rollout::Difference>,
    pub refusal_rate: Option<kvroute_policy::rollout::Difference>,
}

impl CanarySplit {
    /// Splits a run's requests by `arm_of(i)` (request `i`'s arm).
    pub fn from_output(
        out: &SimOutput,
        candidate: &str,
        fraction: f64,
        arm_of: impl Fn(usize) -> kvroute_policy::Arm,
    ) -> Self {
        use kvroute_policy::rollout::{stats, Samples};
        #[derive(Default)]
        struct Acc {
            arm: CanaryArm,
            ttft: Samples,
            itl: Samples,
            prompt: u64,
            hit: u64,
        }
        let mut acc = [Acc::default(), Acc::default()];
        for (i, o) in out.requests.iter().enumerate() {
            let a = &mut acc[usize::from(arm_of(i) == kvroute_policy::Arm::Candidate)];
            a.arm.requests += 1;
            if o.error.is_some() {
                a.arm.refused += 1;
            }
            if o.first_token_ms.is_finite() {
                a.ttft.push(o.first_token_ms - o.arrival_ms);
                a.prompt += u64::from(o.prompt_tokens);
                a.hit += u64::from(o.hit_tokens);
            }
            if o.done_ms.is_finite() {
                a.arm.completed += 1;
                if o.output_tokens >= 2 && o.first_token_ms.is_finite() {
                    a.itl
                        .push((o.done_ms - o.first_token_ms) / f64::from(o.output_tokens - 1));
                }
            }
        }
        for a in &mut acc {
            a.arm.ttft_ms = a.ttft.summary();
            a.arm.itl_ms = a.itl.summary();
            a.arm.token_hit_rate = if a.prompt == 0 {
                0.0
            } else {
                a.hit as f64 / a.prompt as f64
            };
        }
        let [k, c] = acc;
        CanarySplit {
            candidate: candidate.to_string(),
            fraction,
            key: "request_id",
            ttft_mean_ms: stats::mean_difference(&c.ttft, &k.ttft),
            ttft_p90_ms: stats::p90_difference(&c.ttft, &k.ttft),
            itl_mean_ms: stats::mean_difference(&c.itl, &k.itl),
            refusal_rate: stats::rate_difference(
                c.arm.refused as u64,
                c.arm.requests as u64,
                k.arm.refused as u64,
                k.arm.requests as u64,
            ),
            control: k.arm,
            candidate_arm: c.arm,
        }
    }

    /// Lines for stdout.
    pub fn describe(&self, name: &str) -> String {
        let mut s = format!(
            "{name}: canary of {} at {:.0}% (arms by request id hash): control {} requests, candidate {}\n",
            self.candidate,
            self.fraction * 100.0,
            self.control.requests,
            self.candidate_arm.requests
        );
        for (what, d) in [
            ("TTFT mean", &self.ttft_mean_ms),
            ("TTFT p90", &self.ttft_p90_ms),
            ("ITL mean", &self.itl_mean_ms),
        ] {
            if let Some(d) = d {
                let _ = writeln!(
                    s,
                    "  {what}: candidate − control {:+.2} ms ({:+.1}%), 95% interval [{:+.2}, {:+.2}] ms{}",
                    d.difference,
                    d.relative * 100.0,
                    d.ci95[0],
                    d.ci95[1],
                    if d.significant { ", significant" } else { "" }
                );
            }
        }
        s
    }
}

/// What predict-on-route did over a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PredictionFigures {
    pub recorded: u64,
    pub confirmed: u64,
    pub contradicted: u64,
    pub expired: u64,
}

/// What the split requests of a disaggregated fleet did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DisaggFigures {
    /// Requests computed on a prefill worker and decoded on another.
    pub split_requests: usize,
    /// Requests a bypass rule kept whole on their decode worker.
    pub bypassed_requests: usize,
    /// Requests the router routed whole for another reason (no prefill worker eligible).
    pub aggregated_requests: usize,
    /// Prefill end to the KV's arrival on the decode engine (waiting for the link included),
    /// over split requests that got that far.
    pub transfer_ms: Latency,
    /// Split requests whose KV crossed zones / split requests.
    pub cross_zone_share: f64,
    pub cross_zone_transfers: usize,
}

/// A policy's result plus the series the plots need.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    pub result: PolicyResult,
    /// Sorted TTFTs (ms).
    pub ttft_sorted: Vec<f64>,
    /// Sorted inter-token gaps (ms), thinned to at most [`ITL_SAMPLE`] evenly ranked points.
    pub itl_sorted: Vec<f64>,
    /// (bucket centre in s, token hit rate of requests arriving in the bucket).
    pub hit_rate_series: Vec<(f64, f64)>,
}

/// Points kept of the ITL distribution for the plots (results.json has the exact percentiles).
pub const ITL_SAMPLE: usize = 4001;

/// Buckets of the hit-rate-over-time plot.
pub const HIT_RATE_BUCKETS: usize = 50;

impl PolicyRun {
    pub fn from_output(
        name: String,
        spec: String,
        out: &SimOutput,
        policy_fallbacks: u64,
        wall_s: f64,
    ) -> Self {
        let mut prompt = 0u64;
        let mut hit = 0u64;
        let mut ttft = Vec::with_capacity(out.requests.len());
        let mut completed = 0usize;
        let mut output_tokens = 0u64;
        let mut errors = std::collections::BTreeMap::new();
        for o in &out.requests {
            if let Some(e) = &o.error {
                *errors.entry(e.clone()).or_insert(0u64) += 1;
            }
            if o.first_token_ms.is_finite() {
                prompt += u64::from(o.prompt_tokens);
                hit += u64::from(o.hit_tokens);
                ttft.push(o.first_token_ms - o.arrival_ms);
            }
            if o.done_ms.is_finite() {
                completed += 1;
                output_tokens += u64::from(o.output_tokens);
            }
        }
        ttft.sort_by(f64::total_cmp);
        let mut itl: Vec<f64> = out.itl_ms.iter().map(|&x| f64::from(x)).collect();
        itl.sort_by(f64::total_cmp);
        let per_worker: Vec<u64> = out.workers.iter().map(|w| w.requests).collect();
        let prefill: Vec<u64> = out.workers.iter().map(|w| w.prefill_tokens).collect();
        let routed: u64 = per_worker.iter().sum();
        let as_f = |v: &[u64]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let span_s = out.end_ms / 1000.0;

        // Hit rate over time, by arrival.
        let last = out
            .requests
            .iter()
            .map(|o| o.arrival_ms)
            .fold(0.0f64, f64::max);
        let width = (last / HIT_RATE_BUCKETS as f64).max(1e-9);
        let mut buckets = vec![(0u64, 0u64); HIT_RATE_BUCKETS];
        for o in out.requests.iter().filter(|o| o.first_token_ms.is_finite()) {
            let b = ((o.arrival_ms / width) as usize).min(HIT_RATE_BUCKETS - 1);
            buckets[b].0 += u64::from(o.hit_tokens);
            buckets[b].1 += u64::from(o.prompt_tokens);
        }
        let hit_rate_series = buckets
            .iter()
            .enumerate()
            .filter(|(_, (_, p))| *p > 0)
            .map(|(i, (h, p))| ((i as f64 + 0.5) * width / 1000.0, *h as f64 / *p as f64))
            .collect();

        let split = out
            .requests
            .iter()
            .filter(|o| o.prefill_worker.is_some())
            .count();
        let cross = out
            .requests
            .iter()
            .filter(|o| o.cross_zone == Some(true))
            .count();
        let disaggregation = out.disaggregated.then(|| DisaggFigures {
            split_requests: split,
            bypassed_requests: out.requests.iter().filter(|o| o.bypassed).count(),
            aggregated_requests: out
                .requests
                .iter()
                .filter(|o| o.worker.is_some() && o.prefill_worker.is_none() && !o.bypassed)
                .count(),
            transfer_ms: latency_of(out.requests.iter().map(|o| o.transfer_ms)),
            cross_zone_share: if split == 0 {
                0.0
            } else {
                cross as f64 / split as f64
            },
            cross_zone_transfers: cross,
        });
        let itl_sorted = if itl.len() <= ITL_SAMPLE {
            itl.clone()
        } else {
            (0..ITL_SAMPLE)
                .map(|k| itl[k * (itl.len() - 1) / (ITL_SAMPLE - 1)])
                .collect()
        };

        let result = PolicyResult {
            name,
            fleet: String::new(),
            kv_transfer_topology: None,
            replicas: 1,
            sync_lag_ms: 0.0,
            sync_messages: out.sync_messages,
            sync_refused: out.sync_refused,
            spec,
            requests: out.requests.len(),
            completed,
            refused: out.requests.iter().filter(|o| o.error.is_some()).count(),
            token_hit_rate: if prompt == 0 {
                0.0
            } else {
                hit as f64 / prompt as f64
            },
            ttft_ms: latency(&ttft),
            itl_ms: latency(&itl),
            throughput_tok_s: if span_s > 0.0 {
                output_tokens as f64 / span_s
            } else {
                0.0
            },
            load_cov: coefficient_of_variation(&as_f(&per_worker)),
            prefill_tokens_cov: coefficient_of_variation(&as_f(&prefill)),
            max_worker_share: if routed == 0 {
                0.0
            } else {
                per_worker.iter().copied().max().unwrap_or(0) as f64 / routed as f64
            },
            requests_per_worker: per_worker,
            prefill_tokens_per_worker: prefill,
            preemptions: out.workers.iter().map(|w| w.preemptions).sum(),
            evicted_blocks: out.workers.iter().map(|w| w.evicted_blocks).sum(),
            policy_fallbacks,
            kv_events_applied: out.kv_events_applied,
            kv_events_rejected: out.kv_events_rejected,
            index_entries: 0,
            index_evicted_entries: 0,
            errors,
            disaggregation,
            simulated_s: span_s,
            wall_s,
            learned: Vec::new(),
            predictions: None,
            canary: None,
            inferred_sessions: None,
            queued_ms: latency_of(out.requests.iter().map(|o| o.queued_ms)),
            prefill_alone_ms: latency_of(out.requests.iter().map(|o| o.prefill_alone_ms)),
            sessions: None,
        };
        Self {
            result,
            ttft_sorted: ttft,
            itl_sorted,
            hit_rate_series,
        }
    }
}

/// `results.json`.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    pub trace: String,
    pub trace_format: String,
    pub trace_requests: usize,
    pub trace_prompt_tokens: u64,
    pub workers: u32,
    /// The simulated engines.
    pub worker_config: SimConfig,
    /// Arrival compression applied when loading.
    pub speedup: f64,
    pub max_requests: Option<usize>,
    /// The router index's entry cap (`--max-index-entries`), or none.
    pub max_index_entries: Option<u64>,
    /// Seed of the router's random tie-break and sampling (`--seed`).
    pub seed: u64,
    /// Prefix-sharing parameters, for traces whose prompts were synthesized (Azure).
    pub prefix_synthesis: Option<PrefixSynthesis>,
    /// Disaggregated fleets: zones the workers were spread over.
    pub zones: Option<u32>,
    /// Disaggregated fleets: the KV transfer model.
    pub kv_transfer: Option<crate::sim::TransferModel>,
    /// Disaggregated fleets: the router's `[disaggregation]` settings (the transfer constraint
    /// varies by run: each run's `kv_transfer_topology`).
    pub router_disaggregation: Option<kvroute_core::router::DisaggConfig>,
    /// How each figure is defined.
    pub definitions: Definitions,
    pub policies: Vec<PolicyResult>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Definitions {
    pub token_hit_rate: &'static str,
    pub load_cov: &'static str,
    pub throughput_tok_s: &'static str,
    pub ttft_ms: &'static str,
    pub itl_ms: &'static str,
}

impl Default for Definitions {
    fn default() -> Self {
        Self {
            token_hit_rate: "prompt tokens the chosen worker served from its prefix cache / all prompt tokens (requests that got a first token)",
            load_cov: "coefficient of variation (population std / mean) of the number of requests routed to each worker",
            throughput_tok_s: "output tokens of completed requests / simulated seconds from the first arrival to the last event",
            ttft_ms: "arrival to the end of the engine step that computed the last prompt token; nearest-rank percentiles",
            itl_ms: "time between consecutive output tokens, over all gaps of all requests; nearest-rank percentiles",
        }
    }
}

impl Results {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        trace: &Trace,
        workers: u32,
        sim: &SimConfig,
        speedup: f64,
        max_requests: Option<usize>,
        seed: u64,
        runs: &[PolicyRun],
    ) -> Self {
        Self {
            trace: trace.name.clone(),
            trace_format: trace.format.as_str().to_string(),
            trace_requests: trace.requests.len(),
            trace_prompt_tokens: trace.prompt_tokens(),
            workers,
            worker_config: sim.clone(),
            speedup,
            max_requests,
            max_index_entries: None,
            seed,
            prefix_synthesis: trace.synthesis,
            zones: None,
            kv_transfer: None,
            router_disaggregation: None,
            definitions: Definitions::default(),
            policies: runs.iter().map(|r| r.result.clone()).collect(),
        }
    }
}

/// The results as a fixed-width table; every column says its unit. Runs on a disaggregated fleet
/// add the KV transfer's median and the share of transfers that crossed zones.
pub fn table(runs: &[PolicyRun]) -> String {
    let mut s = String::new();
    let w = runs
        .iter()
        .map(|r| r.result.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(12);
    let split = runs.iter().any(|r| r.result.disaggregation.is_some());
    let _ = write!(
        s,
        "{:<w$} {:>9} {:>8} {:>12} {:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>8} {:>7}",
        "policy",
        "completed",
        "hit_rate",
        "ttft_mean_ms",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tok/s",
        "load_cov",
        "wall_s"
    );
    if split {
        let _ = write!(s, " {:>11} {:>10}", "xfer_p50_ms", "cross_zone");
    }
    s.push('\n');
    for r in runs {
        let r = &r.result;
        let _ = write!(
            s,
            "{:<w$} {:>9} {:>7.1}% {:>12.1} {:>11.1} {:>11.1} {:>11.1} {:>10.2} {:>10.2} {:>10.1} {:>8.3} {:>7.2}",
            r.name,
            r.completed,
            r.token_hit_rate * 100.0,
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
            r.throughput_tok_s,
            r.load_cov,
            r.wall_s
        );
        if split {
            match &r.disaggregation {
                Some(d) => {
                    let _ = write!(
                        s,
                        " {:>11.1} {:>9.1}%",
                        d.transfer_ms.p50,
                        d.cross_zone_share * 100.0
                    );
                }
                None => {
                    let _ = write!(s, " {:>11} {:>10}", "-", "-");
                }
            }
        }
        s.push('\n');
    }
    s
}

/// What the table means for round robin, in words: for every other policy, whether round robin
/// beat it on TTFT (p50, p90, p99), so a result where cache-aware routing does not pay is said, not
/// left to be read off the columns. On an Azure trace it recalls that the prefix sharing was
/// synthesized (the trace has lengths only). Empty without a round-robin run.
pub fn summary(runs: &[PolicyRun], trace_format: &str) -> String {
    let mut s = String::new();
    let mut lost = false;
    // Each run is compared with round robin on the same fleet (and KV transfer constraint).
    for r in runs.iter().map(|r| &r.result) {
        let Some(rr) = runs.iter().map(|r| &r.result).find(|x| {
            x.spec == "round-robin"
                && x.fleet == r.fleet
                && x.kv_transfer_topology == r.kv_transfer_topology
                && x.replicas == r.replicas
                && x.sync_lag_ms == r.sync_lag_ms
        }) else {
            continue;
        };
        if rr.name == r.name {
            continue;
        }
        let pairs = [
            ("p50", rr.ttft_ms.p50, r.ttft_ms.p50),
            ("p90", rr.ttft_ms.p90, r.ttft_ms.p90),
            ("p99", rr.ttft_ms.p99, r.ttft_ms.p99),
        ];
        let beaten: Vec<String> = pairs
            .iter()
            .filter(|(_, a, b)| a < b)
            .map(|(p, a, b)| format!("{p} {a:.1} vs {b:.1} ms"))
            .collect();
        if beaten.is_empty() {
            let _ = writeln!(
                s,
                "{} matches or beats round robin on TTFT p50, p90 and p99.",
                r.name
            );
        } else {
            lost = true;
            let _ = writeln!(
                s,
                "ROUND ROBIN BEATS {} on TTFT {} (round robin vs {}).",
                r.name,
                beaten.join(", "),
                r.name
            );
        }
    }
    if lost && trace_format == "azure" {
        let _ = writeln!(
            s,
            "This Azure trace has prompt lengths only: its prefix sharing is synthesized \
             (--azure-prompts, --azure-zipf, --azure-shared-frac), so cache hits are what those \
             settings make them, not what the original traffic had."
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn cov_of_equal_loads_is_zero() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        let c = coefficient_of_variation(&[0.0, 0.0, 0.0, 8.0]);
        assert!((c - 3f64.sqrt()).abs() < 1e-12);
    }

    fn run(name: &str, spec: &str, ttft: [f64; 3]) -> PolicyRun {
        let mut r = PolicyRun::from_output(name.into(), spec.into(), &SimOutput::default(), 0, 0.0);
        r.result.ttft_ms = Latency {
            p50: ttft[0],
            p90: ttft[1],
            p99: ttft[2],
            mean: 0.0,
        };
        r
    }

    #[test]
    fn the_summary_says_when_round_robin_wins() {
        let runs = [
            run("round-robin", "round-robin", [32.9, 73.6, 127.5]),
            run("default", "default", [33.2, 75.4, 123.2]),
            run("mine", "mine.wasm", [30.0, 70.0, 120.0]),
        ];
        let s = summary(&runs, "azure");
        assert!(
            s.contains(
                "ROUND ROBIN BEATS default on TTFT p50 32.9 vs 33.2 ms, p90 73.6 vs 75.4 ms"
            ),
            "{s}"
        );
        assert!(!s.contains("p99 127.5"), "{s}");
        assert!(s.contains("mine matches or beats round robin"), "{s}");
        assert!(s.contains("synthesized"), "{s}");
        assert!(!summary(&runs, "mooncake").contains("synthesized"));
        assert_eq!(summary(&runs[1..], "azure"), "");
    }

    #[test]
    fn the_table_gives_units() {
        let t = table(&[run("default", "default", [1.0, 2.0, 3.0])]);
        let header = t.lines().next().unwrap();
        for col in ["ttft_p50_ms", "itl_p99_ms", "tok/s", "wall_s", "hit_rate"] {
            assert!(header.contains(col), "{header}");
        }
    }
}
