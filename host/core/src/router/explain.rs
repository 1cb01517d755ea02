//! Explained decisions: with `explain`, a decision lists every eligible candidate's figures and
//! cost ([`ExplainRow`]) and every candidate a hard rule kept out, with the rule
//! ([`ExcludedRow`]), so an operator sees why a worker was or was not chosen. Built only when asked
//! for, from the decision's scratch columns, after the pick.

use serde::Serialize;

use crate::candidate::{CandidateColumns, DpRank, WorkerId};
use crate::eligibility::{self, Ineligible};
use crate::indexer::DenseOverlaps;
use crate::workers::{CandidateEntry, RegistrySnapshot};

/// One candidate's figures in an explained decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExplainRow {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Device blocks counted for the candidate: the deeper of the event index's and the
    /// predicted overlap.
    pub overlap_blocks: u32,
    /// Device blocks predict-on-route assumes the candidate holds (routed there within the TTL,
    /// not yet confirmed or contradicted by its KV events); 0 when off.
    pub predicted_overlap_blocks: u32,
    pub host_overlap_blocks: u32,
    pub disk_overlap_blocks: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u32,
    /// How far the candidate's overlaps can be trusted: its KV event feed's state (`exact`,
    /// `recovering`, `degraded`; `exact` without a feed), the policy column `kv-feed-trust`.
    pub kv_feed_trust: crate::feeds::Trust,
    /// The policy column `session-bound`: 1 the candidate holds the request's session binding,
    /// 2 its parent session's, 0 neither ([`crate::sessions`]).
    pub session_bound: u8,
    pub taints: Vec<String>,
    pub base_cost: f64,
    /// The cost the pick was made from: the policy's when it answered costs, else the native
    /// cost (it picked, or the decision fell back).
    pub cost: f64,
    /// The candidate the decision chose.
    pub chosen: bool,
}

/// A candidate a hard rule kept out of an explained decision, and which rule (the first that
/// failed, in SPEC §6's order).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExcludedRow {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// `not_allowed`, `missing_required_taints`, `draining` or `busy`.
    pub reason: &'static str,
    /// With `missing_required_taints`: the required taints it lacks (absent otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub missing_taints: Vec<String>,
    pub overlap_blocks: u32,
    pub active_prefill_tokens: u64,
}

/// A candidate the filter kept out, noted (with `explain` only) while the load lock is held.
#[derive(Clone, Copy, Debug)]
pub(super) struct Excluded {
    /// Index in the decision's pool of candidates.
    pub(super) index: u32,
    pub(super) reason: Ineligible,
    pub(super) active_prefill_tokens: u64,
}

/// The rows of the eligible candidates: their columns, the cost the pick was made from, and which
/// one was chosen.
pub(super) fn candidate_rows(
    cols: &CandidateColumns,
    predicted: &[u32],
    costs: &[f64],
    chosen: usize,
    snap: &RegistrySnapshot,
) -> Vec<ExplainRow> {
    (0..cols.len())
        .map(|i| ExplainRow {
            worker_id: cols.worker_id[i],
            dp_rank: cols.dp_rank[i],
            overlap_blocks: cols.device_overlap[i],
            predicted_overlap_blocks: predicted.get(i).copied().unwrap_or(0),
            host_overlap_blocks: cols.host_overlap[i],
            disk_overlap_blocks: cols.disk_overlap[i],
            active_prefill_tokens: cols.active_prefill_tokens[i],
            active_decode_blocks: cols.active_decode_blocks[i],
            active_requests: cols.active_requests[i],
            kv_feed_trust: crate::feeds::Trust::from_code(
                cols.kv_feed_trust.get(i).copied().unwrap_or(0),
            ),
            session_bound: cols.session_bound.get(i).copied().unwrap_or(0),
            taints: cols
                .taints_of(i)
                .iter()
                .filter_map(|&t| snap.taint_name(t).map(str::to_string))
                .collect(),
            base_cost: cols.base_cost[i],
            cost: costs[i],
            chosen: i == chosen,
        })
        .collect()
}

/// The rows of the excluded candidates, in pool order, naming the required taints each lacks.
pub(super) fn excluded_rows(
    pool: &[CandidateEntry],
    excluded: &[Excluded],
    dense: &DenseOverlaps,
    required_taints: &[String],
    snap: &RegistrySnapshot,
) -> Vec<ExcludedRow> {
    excluded
        .iter()
        .map(|e| {
            let c = &pool[e.index as usize];
            ExcludedRow {
                worker_id: c.key.worker_id,
                dp_rank: c.key.dp_rank,
                reason: e.reason.code(),
                missing_taints: if e.reason == Ineligible::MissingTaints {
                    eligibility::missing_taints(c, required_taints, snap)
                } else {
                    Vec::new()
                },
                overlap_blocks: dense.get(c.slot)[0],
                active_prefill_tokens: e.active_prefill_tokens,
            }
        })
        .collect()
}
