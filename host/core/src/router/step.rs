//! One step of a decision: filter the candidates (eligible, and excluded with the rule that kept
//! each out) → fill the candidate columns → the stage's native cost → score (ask the policy) →
//! pick → explain. An aggregated decision is one step; a disaggregated one is two
//! ([`super::disagg`]). A step books nothing. When nobody is eligible, the refusal says why,
//! naming the required taints each excluded worker lacks.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashSet;

use super::explain::{self, Excluded};
use super::request::Prepared;
use super::{ExcludedRow, ExplainRow, Pin, PolicyLabel, RouteError, Router, ScorerOutcome, Stage};
use crate::candidate::{CandidateColumns, CandidateKey, PolicyRequest};
use crate::cost;
use crate::eligibility::{self, Constraints, Ineligible, PinError, RoleNeed};
use crate::feeds::DeadFeedRule;
use crate::indexer::DenseOverlaps;
use crate::load::CandidateLoad;
use crate::workers::{CandidateEntry, RegistrySnapshot};

/// Per-thread buffers reused across decisions.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) dense: DenseOverlaps,
    /// Predict-on-route's device overlaps of the prompt, sparse by candidate (sorted).
    pub(super) predicted: Vec<(CandidateKey, u32)>,
    /// The predicted overlap of each eligible candidate, beside the columns (explain's
    /// `predicted_overlap_blocks`).
    predicted_col: Vec<u32>,
    cols: CandidateColumns,
    costs: Vec<f64>,
    depths: Vec<(CandidateKey, u32)>,
    /// The eligible candidates' loads, beside `eligible`.
    loads: Vec<CandidateLoad>,
    /// Pool indexes of the eligible candidates, in pool (= key) order.
    eligible: Vec<u32>,
    /// With `explain`: the excluded candidates.
    excluded: Vec<Excluded>,
    /// The eligible candidates' device overlaps before the reuse cap (whether the index holds
    /// the whole prompt).
    uncapped_device: Vec<u32>,
    /// The request's session bindings (the `session-bound` column).
    pub(super) affinity: crate::sessions::Affinity,
}

/// Why the filter kept candidates out: the error's material when nobody is left.
#[derive(Default)]
struct Exclusions {
    /// Candidates excluded, by `Ineligible` reason.
    by_reason: [u32; 6],
    /// The first excluded candidate's reason.
    first: Option<Ineligible>,
}

/// The chosen candidate (index into the columns) and how it was chosen.
struct Pick {
    chosen: usize,
    fallback_reason: Option<&'static str>,
    /// What the policy answered (`costs`, `pick`), or `native` (explain's `answer`).
    answer: &'static str,
}

/// What one step is asked: the stage, the candidates in play, the hard constraints and the soft
/// ones.
pub(super) struct StepInput<'a> {
    pub(super) stage: Stage,
    pub(super) pool: &'a [CandidateEntry],
    pub(super) constraints: &'a Constraints,
    /// The names of the step's required taints (the request's, plus a merged transfer domain).
    pub(super) required: &'a [String],
    pub(super) preferred: &'a [(String, f32)],
    /// The pin the pool came from: its errors are the pin's.
    pub(super) pinned: Option<Pin>,
}

/// One step's choice and how it was made.
pub(super) struct Step {
    pub(super) candidate: CandidateKey,
    pub(super) overlap: u32,
    /// The event index alone (no prediction) holds every complete block of the prompt on the
    /// candidate: predicting them there would add nothing (predict-on-route skips it).
    pub(super) indexed_whole: bool,
    pub(super) cached_tokens: u32,
    /// The chosen candidate's load before this request.
    pub(super) load: CandidateLoad,
    pub(super) max_num_batched_tokens: u32,
    pub(super) label: Arc<PolicyLabel>,
    pub(super) fallback_reason: Option<&'static str>,
    pub(super) answer: &'static str,
    pub(super) policy_time: Duration,
    /// With `explain`: the eligible candidates' rows and the excluded ones.
    pub(super) explained: Option<(Vec<ExplainRow>, Vec<ExcludedRow>)>,
}

impl Router {
    /// One step: filter the pool, fill the columns, compute the stage's native cost, ask the
    /// policy, pick, explain. Books nothing.
    pub(super) fn step(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        input: &StepInput<'_>,
        s: &mut Scratch,
    ) -> Result<Step, RouteError> {
        self.filter(p, snap, input, s)?;
        s.fill_columns(
            input.pool,
            self.config.block_size,
            crate::cost::reusable_blocks(p.prompt_tokens, self.config.block_size),
            &self.learned_cols.read(),
            &self.feeds.untrusted(),
        );
        if self.config.feeds.dead_feed == DeadFeedRule::Unknown {
            s.forget_dead_overlaps(input.pool, &self.feeds.dead());
        }
        let preq = self.policy_request(p, snap, input.preferred);
        // The native cost, only when something reads it: the policy (most Wasm policies price
        // candidates themselves), `explain`, or the pick when the policy gives no usable costs.
        let scorer = self.scorer.load();
        if p.req.explain || scorer.as_deref().is_none_or(|s| s.reads_base_cost()) {
            self.fill_stage_costs(&preq, &mut s.cols, input.stage);
        } else {
            s.cols.base_cost.clear();
        }
        drop(scorer);
        let tp = Instant::now();
        let (mut label, mut outcome) = self.score(&preq, &s.cols, snap, input.stage);
        if matches!(outcome, ScorerOutcome::NeedsBaseCost) {
            self.fill_stage_costs(&preq, &mut s.cols, input.stage);
            (label, outcome) = self.score(&preq, &s.cols, snap, input.stage);
        }
        let usable = matches!(&outcome, ScorerOutcome::Costs(c) if usable_costs(c, s.cols.len()));
        if !usable && s.cols.base_cost.len() != s.cols.len() {
            self.fill_stage_costs(&preq, &mut s.cols, input.stage);
        }
        let pick = self.pick(outcome, &preq, p.temperature, &s.cols, &mut s.costs);
        let policy_time = tp.elapsed();
        let chosen = pick.chosen;
        // What the index (and predictions) hold; the columns carry it capped at what the
        // engine reuses, and so does `cached_tokens`.
        let overlap = s.uncapped_device[chosen];
        Ok(Step {
            candidate: s.cols.key(chosen),
            overlap,
            // The combined overlap is the index's when the prediction is shallower.
            indexed_whole: s.uncapped_device[chosen] as usize == p.seq.len()
                && s.predicted_col[chosen] < s.uncapped_device[chosen],
            cached_tokens: crate::cost::cached_tokens(
                s.cols.device_overlap[chosen],
                p.prompt_tokens,
                self.config.block_size,
            ),
            load: s.loads[chosen],
            max_num_batched_tokens: s.cols.max_num_batched_tokens[chosen],
            label,
            fallback_reason: pick.fallback_reason,
            answer: pick.answer,
            policy_time,
            explained: p.req.explain.then(|| {
                (
                    explain::candidate_rows(&s.cols, &s.predicted_col, &s.costs, chosen, snap),
                    explain::excluded_rows(input.pool, &s.excluded, &s.dense, input.required, snap),
                )
            }),
        })
    }

    /// Fills `cols.base_cost` with the stage's native cost.
    fn fill_stage_costs(&self, preq: &PolicyRequest, cols: &mut CandidateColumns, stage: Stage) {
        match stage {
            Stage::Decode => cost::fill_decode_costs(preq, cols, &self.config.cost),
            _ => cost::fill_base_costs(preq, cols, &self.config.cost),
        }
    }

    /// The hard constraints of a step, resolved against the registry's taint names.
    pub(super) fn resolve_constraints(
        &self,
        required_taints: &[String],
        allowed: Option<&[crate::candidate::WorkerId]>,
        role: RoleNeed,
        snap: &RegistrySnapshot,
    ) -> Constraints {
        let mut c = Constraints {
            allowed: allowed.map(|ids| ids.iter().copied().collect::<FxHashSet<_>>()),
            role,
            ..Default::default()
        };
        for t in required_taints {
            match snap.taint_id(t) {
                Some(id) => c.required_taints.push(id),
                None => c.unsatisfiable = Some(t.clone()),
            }
        }
        if self.config.feeds.dead_feed == DeadFeedRule::Drain {
            let dead = self.feeds.dead();
            if !dead.is_empty() {
                c.dead_feeds = Some(dead);
            }
        }
        c
    }

    /// Filter: the candidates of the pool that pass the hard rules ([`eligibility::check`]), with
    /// their loads, and (with `explain`) the ones that do not and why. Loads, eligibility and the
    /// active prefix depths are read under one short lock of the load tracker. Nobody eligible is
    /// the request's error.
    fn filter(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        input: &StepInput<'_>,
        s: &mut Scratch,
    ) -> Result<(), RouteError> {
        let (pool, constraints) = (input.pool, input.constraints);
        s.eligible.clear();
        s.loads.clear();
        s.excluded.clear();
        let mut out = Exclusions::default();
        {
            let load = self.load.lock();
            for (i, c) in pool.iter().enumerate() {
                let l = load.load(c.key);
                match eligibility::check(c, &l, constraints, &self.busy) {
                    Ok(()) => {
                        s.eligible.push(i as u32);
                        s.loads.push(l);
                    }
                    Err(why) => {
                        if p.req.explain {
                            s.excluded.push(Excluded {
                                index: i as u32,
                                reason: why,
                                active_prefill_tokens: l.active_prefill_tokens,
                            });
                        }
                        out.by_reason[why as usize] += 1;
                        out.first.get_or_insert(why);
                    }
                }
            }
            // A decode step assumes no reuse (Dynamo's `assume_kv_reuse = false`): the prompt
            // arrives by transfer, so its blocks already active there count as new.
            if !s.eligible.is_empty() && input.stage != Stage::Decode {
                load.active_prefix_depths(&p.seq, &mut s.depths);
            } else {
                s.depths.clear();
            }
        }
        if s.eligible.is_empty() {
            return Err(nobody_eligible(input, snap, &out));
        }
        Ok(())
    }

    /// What the policy is told about the request. Preferred taints no worker has are dropped.
    fn policy_request(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        preferred: &[(String, f32)],
    ) -> PolicyRequest {
        PolicyRequest {
            request_id: p.request_id.clone(),
            prompt_tokens: p.prompt_tokens,
            request_blocks: p.local.len() as u32,
            block_size: self.config.block_size,
            preferred_taints: preferred
                .iter()
                .filter_map(|(name, w)| snap.taint_id(name).map(|id| (id, *w)))
                .collect(),
            priority: p.req.priority,
            expected_output_tokens: p.req.expected_output_tokens,
            temperature: p.temperature,
            session_id: p.req.session_id.clone(),
            now_ms: self.clock_ms(),
            ask_only: !p.req.book,
        }
    }

    /// Score: the active policy's answer, or [`ScorerOutcome::Native`] when none is installed.
    fn score(
        &self,
        preq: &PolicyRequest,
        cols: &CandidateColumns,
        snap: &RegistrySnapshot,
        stage: Stage,
    ) -> (Arc<PolicyLabel>, ScorerOutcome) {
        match self.scorer.load().as_deref() {
            Some(s) => {
                let d = s.decide(preq, cols, &snap.taints, stage);
                (d.label, d.outcome)
            }
            None => (self.native_label.clone(), ScorerOutcome::Native),
        }
    }

    /// Pick: from the policy's costs (sampled at the request's temperature) or its pick; on no
    /// policy, or an answer that failed or does not fit the candidates, from the native cost
    /// (counted as a fallback unless no policy is installed). `costs` ends up holding the costs
    /// the pick was made from.
    fn pick(
        &self,
        outcome: ScorerOutcome,
        preq: &PolicyRequest,
        temperature: f64,
        cols: &CandidateColumns,
        costs: &mut Vec<f64>,
    ) -> Pick {
        let n = cols.len();
        let pick = self.with_rng(|rng| match outcome {
            ScorerOutcome::Costs(c) if usable_costs(&c, n) => {
                let chosen = cost::pick(&c, temperature, rng).expect("n > 0");
                *costs = c;
                Pick {
                    chosen,
                    fallback_reason: None,
                    answer: "costs",
                }
            }
            ScorerOutcome::Pick(chosen) if chosen < n => {
                cost::native_costs(preq, cols, costs);
                Pick {
                    chosen,
                    fallback_reason: None,
                    answer: "pick",
                }
            }
            other => {
                cost::native_costs(preq, cols, costs);
                let fallback_reason = match other {
                    ScorerOutcome::Native => None,
                    ScorerOutcome::Fallback(r) => Some(r),
                    ScorerOutcome::Costs(_) => Some("invalid_answer"),
                    // Asked again with the column filled; a scorer that still says so gave
                    // no answer.
                    ScorerOutcome::NeedsBaseCost => Some("invalid_answer"),
                    ScorerOutcome::Pick(_) => Some("pick_out_of_range"),
                };
                Pick {
                    chosen: cost::pick(costs, temperature, rng).expect("n > 0"),
                    fallback_reason,
                    answer: "native",
                }
            }
        });
        if pick.fallback_reason.is_some() {
            self.counters.fallbacks.fetch_add(1, Relaxed);
        }
        pick
    }
}

/// Costs the router can pick from: one finite cost per candidate.
fn usable_costs(c: &[f64], n: usize) -> bool {
    c.len() == n && c.iter().all(|x| x.is_finite())
}

impl Scratch {
    /// The `unknown` dead-feed rule: the overlaps of candidates whose feed is dead are unknown, so
    /// they count as 0 in every tier (the pick, the policy and `cached_tokens` all see 0).
    fn forget_dead_overlaps(&mut self, pool: &[CandidateEntry], dead: &FxHashSet<CandidateKey>) {
        if dead.is_empty() {
            return;
        }
        for (j, &i) in self.eligible.iter().enumerate() {
            if dead.contains(&pool[i as usize].key) {
                // The router's own predictions stand: they do not come from the dead feed.
                self.cols.device_overlap[j] =
                    self.predicted_col[j].min(self.cols.device_overlap[j]);
                self.uncapped_device[j] = self.predicted_col[j];
                self.cols.host_overlap[j] = 0;
                self.cols.disk_overlap[j] = 0;
            }
        }
    }

    /// Fill the candidate columns with the eligible candidates' figures (overlaps, loads, budget,
    /// taints), in the layout policies read.
    fn fill_columns(
        &mut self,
        pool: &[CandidateEntry],
        block_size: u32,
        reusable: u32,
        learned: &rustc_hash::FxHashMap<crate::candidate::WorkerId, [f64; 2]>,
        untrusted: &rustc_hash::FxHashMap<CandidateKey, crate::feeds::Trust>,
    ) {
        let Scratch {
            dense,
            predicted,
            predicted_col,
            cols,
            depths,
            loads,
            eligible,
            uncapped_device,
            affinity,
            ..
        } = self;
        cols.clear();
        predicted_col.clear();
        predicted_col.resize(eligible.len(), 0);
        uncapped_device.clear();
        cols.taint_offsets.push(0);
        for (&i, l) in eligible.iter().zip(loads.iter()) {
            let c = &pool[i as usize];
            let [d, h, k] = dense.get(c.slot);
            cols.worker_id.push(c.key.worker_id);
            cols.dp_rank.push(c.key.dp_rank);
            // The engine reuses at most `reusable` blocks of this prompt, whatever it holds.
            uncapped_device.push(d);
            cols.device_overlap.push(d.min(reusable));
            cols.host_overlap.push(h.min(reusable));
            cols.disk_overlap.push(k.min(reusable));
            cols.active_prefill_tokens.push(l.active_prefill_tokens);
            cols.active_decode_blocks.push(l.active_decode_blocks);
            cols.active_requests.push(l.active_requests);
            cols.active_prompt_blocks.push(0);
            cols.total_kv_blocks.push(c.total_kv_blocks);
            cols.max_num_batched_tokens.push(c.max_num_batched_tokens);
            cols.kv_feed_trust
                .push(untrusted.get(&c.key).map_or(0, |t| t.code()));
            cols.session_bound
                .push(super::affinity::session_bound(affinity, c.key));
            let [p, d] = learned.get(&c.key.worker_id).copied().unwrap_or_default();
            cols.prefill_ms_per_token.push(p);
            cols.decode_step_ms.push(d);
            cols.taint_ids.extend_from_slice(&c.taint_ids);
            cols.taint_offsets.push(cols.taint_ids.len() as u32);
        }
        // Prompt blocks already active: few candidates have any; find each by binary search over
        // the (sorted) eligible keys.
        for &(key, depth) in depths.iter() {
            if let Ok(j) = eligible.binary_search_by_key(&key, |&i| pool[i as usize].key) {
                cols.active_prompt_blocks[j] = depth;
            }
        }
        // Predicted overlaps (predict-on-route): max-combined with the event index's device
        // overlap; few candidates have any. The predicted blocks no event has confirmed yet are
        // being computed there for a request booked moments ago: their tokens are in the
        // candidate's active prefill tokens, yet they are this request's own prefix, computed
        // once for both. They leave the prefill tokens counted ahead of it (at most all of them),
        // so a burst sharing a new prefix stays together instead of every later request seeing
        // the first one's prefill as a queue.
        for &(key, depth) in predicted.iter() {
            if let Ok(j) = eligible.binary_search_by_key(&key, |&i| pool[i as usize].key) {
                predicted_col[j] = depth;
                uncapped_device[j] = uncapped_device[j].max(depth);
                let depth = depth.min(reusable);
                let event = cols.device_overlap[j];
                if depth > event {
                    cols.device_overlap[j] = depth;
                    let in_flight = u64::from(depth - event) * u64::from(block_size);
                    let a = &mut cols.active_prefill_tokens[j];
                    *a -= in_flight.min(*a);
                }
            }
        }
    }
}

/// The most workers a refusal's message names one by one (its `missing_taints` lists them all).
const NAMED_WORKERS: usize = 8;

/// The error when the filter left nobody. A pinned request gets its pin's own error, with the most
/// actionable reason (busy, else the first); otherwise anyone merely busy makes it
/// `all_overloaded` (retryable), and else every reason is named with its count.
fn nobody_eligible(input: &StepInput<'_>, snap: &RegistrySnapshot, out: &Exclusions) -> RouteError {
    let (pool, constraints, required) = (input.pool, input.constraints, input.required);
    let busy = out.by_reason[Ineligible::Busy as usize];
    if let Some(pin) = input.pinned {
        let why = if busy > 0 {
            Ineligible::Busy
        } else {
            out.first.unwrap_or(Ineligible::Draining)
        };
        let mut e = PinError::from((why, pin.worker_id));
        if let (PinError::MissingTaints(w), Some(c)) = (&mut e, pool.first()) {
            w.missing = eligibility::missing_taints(c, required, snap);
        }
        return e.into();
    }
    if busy > 0 {
        return RouteError::AllOverloaded;
    }
    let missing_taints = if out.by_reason[Ineligible::MissingTaints as usize] > 0 {
        workers_missing_taints(pool, constraints, required, snap)
    } else {
        Vec::new()
    };
    // Every reason with its count: the first candidate's reason alone can name
    // allowed_worker_ids when the allowed workers were all draining.
    let why: Vec<String> = [
        (Ineligible::Role, "whose role does not take this step"),
        (Ineligible::NotAllowed, "not in allowed_worker_ids"),
        (Ineligible::MissingTaints, "without the required_taints"),
        (Ineligible::Draining, "draining"),
        (Ineligible::FeedDead, "with a dead KV event feed"),
    ]
    .iter()
    .filter(|(r, _)| out.by_reason[*r as usize] > 0)
    .map(|(r, what)| {
        let n = out.by_reason[*r as usize];
        if *r == Ineligible::MissingTaints {
            format!(
                "{n} {what} ({})",
                taints_detail(&missing_taints, required, snap)
            )
        } else {
            format!("{n} {what}")
        }
    })
    .collect();
    RouteError::AllFiltered {
        reasons: why.join(", "),
        missing_taints,
    }
}

/// The allowed workers of the pool that lack a required taint, and which, in worker order.
fn workers_missing_taints(
    pool: &[CandidateEntry],
    constraints: &Constraints,
    required: &[String],
    snap: &RegistrySnapshot,
) -> Vec<eligibility::WorkerMissingTaints> {
    let mut out: Vec<eligibility::WorkerMissingTaints> = Vec::new();
    for c in pool {
        let w = c.key.worker_id;
        // Taints are per worker: its other ranks lack the same.
        if out.last().is_some_and(|m| m.worker_id == w)
            || constraints
                .allowed
                .as_ref()
                .is_some_and(|a| !a.contains(&w))
        {
            continue;
        }
        let missing = eligibility::missing_taints(c, required, snap);
        if !missing.is_empty() {
            out.push(eligibility::WorkerMissingTaints {
                worker_id: w,
                missing,
            });
        }
    }
    out
}

/// "no worker has zone=mars; worker 1 lacks gpu=h100; …": the required taints no registered
/// worker has, then what else each excluded worker lacks (the first [`NAMED_WORKERS`] of those
/// that lack something else).
fn taints_detail(
    missing: &[eligibility::WorkerMissingTaints],
    required: &[String],
    snap: &RegistrySnapshot,
) -> String {
    let mut parts = Vec::new();
    let nobody: Vec<&str> = required
        .iter()
        .filter(|name| {
            snap.taint_id(name)
                .is_none_or(|id| !snap.candidates.iter().any(|c| c.has_taint(id)))
        })
        .map(String::as_str)
        .collect();
    if !nobody.is_empty() {
        parts.push(format!("no worker has {}", nobody.join(", ")));
    }
    // What a worker lacks beyond the taints nobody has (those were just named).
    let mut named = 0;
    let mut more = 0;
    for m in missing {
        let own: Vec<&str> = m
            .missing
            .iter()
            .map(String::as_str)
            .filter(|t| !nobody.contains(t))
            .collect();
        if own.is_empty() {
            continue;
        }
        if named == NAMED_WORKERS {
            more += 1;
            continue;
        }
        named += 1;
        parts.push(format!("worker {} lacks {}", m.worker_id, own.join(", ")));
    }
    if more > 0 {
        parts.push(format!("{more} more workers in missing_taints"));
    }
    parts.join("; ")
}
