//! Peer routers' default policies as [`Scorer`]s, so every replay table compares kvroute against
//! them on the same fleet, trace and router (eligibility, booking and the queue are the host's,
//! as for every policy).
//!
//! # `llm-d`: llm-d's inference scheduler, default scorer set
//! The scheduling profile of llm-d's well-lit "intelligent inference scheduling" path (its
//! `EndpointPickerConfig`'s `default` profile, llm-d/llm-d-inference-scheduler and the Gateway API
//! Inference Extension's scorers): three scorers, each in [0, 1], summed with their weights, and
//! the `max-score-picker` (highest total; ties at random, here the router's seeded picker):
//!
//! | scorer | weight | score of a candidate, here |
//! |---|---|---|
//! | `prefix-cache-scorer` (precise, fed by KV events) | 3 | cached prompt blocks on its device / prompt blocks |
//! | `kv-cache-utilization-scorer` | 2 | `1 − KV usage`, usage = `active_decode_blocks / total_kv_blocks` (capped at 1) |
//! | `queue-scorer` | 2 | min-max normalized waiting work: `(max − q) / (max − min)`, 1 when all are equal |
//!
//! The queue scorer reads the engines' waiting-queue length; the router's nearest fact is each
//! candidate's booked requests whose prefill has not completed, whose token count
//! (`active_prefill_tokens`) is what is normalized here. The prefix scorer is given the router's
//! KV-event index, as llm-d's precise variant has (the estimating variant can only do worse).
//!
//! # `sglang`: SGLang router's `cache_aware` policy (sgl-model-gateway)
//! Parameters at SGLang's defaults: `cache_threshold` 0.3, `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5. Load is each worker's in-flight requests (`active_requests`).
//! 1. The fleet is **imbalanced** when `max_load − min_load > balance_abs_threshold` **and**
//!    `max_load > balance_rel_threshold × min_load`: then the least-loaded worker (shortest queue).
//! 2. Otherwise the prefix match: the worker with the longest match of the prompt, if that match is
//!    at least `cache_threshold` of the prompt; else the worker whose tree is smallest (the most
//!    room left).
//!
//! SGLang's match comes from an approximate radix tree of the prompts it routed to each worker;
//! here the match is the KV-event index's device overlap (exact, which only helps it), and the
//! tree size is the tokens of the prompts routed to the worker that it did not already hold (the
//! text the approximate tree would add; SGLang's default tree cap, 67M characters, is never reached
//! in a replay, so nothing is evicted from it).

use rustc_hash::FxHashMap;
use std::sync::{Arc, Mutex};

use kvroute_core::candidate::{CandidateColumns, PolicyRequest, WorkerId};
use kvroute_core::router::{PolicyLabel, Scorer, ScorerDecision, ScorerOutcome, Stage};
use kvroute_core::workers::TaintNames;

fn label(name: &str) -> Arc<PolicyLabel> {
    Arc::new(PolicyLabel {
        name: name.into(),
        version: 0,
        digest: String::new(),
    })
}

/// llm-d's default scorer set (module doc).
pub struct LlmdScorer {
    pub prefix_weight: f64,
    pub kv_utilization_weight: f64,
    pub queue_weight: f64,
    label: Arc<PolicyLabel>,
}

impl Default for LlmdScorer {
    fn default() -> Self {
        Self {
            prefix_weight: 3.0,
            kv_utilization_weight: 2.0,
            queue_weight: 2.0,
            label: label("llm-d"),
        }
    }
}

impl Scorer for LlmdScorer {
    fn decide(
        &self,
        req: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        let n = c.len();
        let blocks = f64::from(req.request_blocks.max(1));
        let q = &c.active_prefill_tokens;
        let (qmin, qmax) = q
            .iter()
            .fold((u64::MAX, 0u64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let costs = (0..n)
            .map(|i| {
                let prefix = (f64::from(c.device_overlap[i]) / blocks).min(1.0);
                let usage = if c.total_kv_blocks[i] == 0 {
                    0.0
                } else {
                    (c.active_decode_blocks[i] as f64 / c.total_kv_blocks[i] as f64).min(1.0)
                };
                let queue = if qmax == qmin {
                    1.0
                } else {
                    (qmax - q[i]) as f64 / (qmax - qmin) as f64
                };
                let score = self.prefix_weight * prefix
                    + self.kv_utilization_weight * (1.0 - usage)
                    + self.queue_weight * queue;
                // the router picks the lowest cost: the highest score
                -score
            })
            .collect();
        ScorerDecision {
            outcome: ScorerOutcome::Costs(costs),
            label: self.label.clone(),
        }
    }
}

/// SGLang's `cache_aware` policy (module doc).
pub struct SglangScorer {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u32,
    pub balance_rel_threshold: f64,
    /// Tokens each worker's approximate tree holds.
    tree: Mutex<FxHashMap<WorkerId, u64>>,
    label: Arc<PolicyLabel>,
}

impl Default for SglangScorer {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            tree: Mutex::new(FxHashMap::default()),
            label: label("sglang"),
        }
    }
}

impl Scorer for SglangScorer {
    fn decide(
        &self,
        req: &PolicyRequest,
        c: &CandidateColumns,
        _: &TaintNames,
        _: Stage,
    ) -> ScorerDecision {
        let n = c.len();
        let load = &c.active_requests;
        let (min, max) = load
            .iter()
            .fold((u32::MAX, 0u32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let imbalanced = n > 0
            && max - min > self.balance_abs_threshold
            && f64::from(max) > self.balance_rel_threshold * f64::from(min);
        let mut tree = self.tree.lock().unwrap_or_else(|e| e.into_inner());
        let pick = if imbalanced {
            (0..n).min_by_key(|&i| (load[i], i)).unwrap_or(0)
        } else {
            let best = (0..n)
                .max_by_key(|&i| (c.device_overlap[i], std::cmp::Reverse(i)))
                .unwrap_or(0);
            let matched = f64::from(c.device_overlap.get(best).copied().unwrap_or(0))
                * f64::from(req.block_size);
            let rate = matched / f64::from(req.prompt_tokens.max(1));
            if rate > self.cache_threshold {
                best
            } else {
                (0..n)
                    .min_by_key(|&i| (tree.get(&c.worker_id[i]).copied().unwrap_or(0), i))
                    .unwrap_or(0)
            }
        };
        if let (Some(&w), false) = (c.worker_id.get(pick), req.ask_only) {
            let held = u64::from(c.device_overlap[pick]) * u64::from(req.block_size);
            *tree.entry(w).or_insert(0) += u64::from(req.prompt_tokens).saturating_sub(held);
        }
        ScorerDecision {
            outcome: ScorerOutcome::Pick(pick),
            label: self.label.clone(),
        }
    }
}
