//! Identities of routing candidates (SPEC §1).
//!
//! A worker with `dp_size` data-parallel ranks is that many candidates; each is indexed, loaded and
//! scored on its own, so almost everything in the host is keyed by [`CandidateKey`].

use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A worker's id as the fleet names it.
pub type WorkerId = u64;
/// A data-parallel rank inside a worker.
pub type DpRank = u32;

/// One routing candidate: a worker and one of its data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CandidateKey {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl CandidateKey {
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl std::fmt::Display for CandidateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// The eligible candidates of one routing decision, as columns (struct of arrays).
///
/// This is the shape the Wasm policy interface uses (`wit/policy.wit`, record `candidates`): one
/// list per figure, never a list of records and never a string per candidate, because lowering a
/// few primitive lists into a component is several times cheaper than lowering records field by
/// field. The router fills it once per decision; the native cost reads it; a policy receives it.
///
/// Every column has one entry per candidate, in the same order, except `taint_ids`, which holds the
/// taints of all candidates back to back: candidate `i` has `taint_ids[taint_offsets[i] as usize ..
/// taint_offsets[i + 1] as usize]` (so `taint_offsets` has `len() + 1` entries, starting at 0).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CandidateColumns {
    pub worker_id: Vec<WorkerId>,
    pub dp_rank: Vec<DpRank>,
    /// Consecutive prompt blocks, from the first, that the candidate holds on its device (GPU).
    pub device_overlap: Vec<u32>,
    /// The same on host memory (CPU offload tier); counted independently of the device tier.
    pub host_overlap: Vec<u32>,
    /// The same on disk / external storage tiers.
    pub disk_overlap: Vec<u32>,
    /// Prompt tokens booked on the candidate that are not yet prefilled.
    pub active_prefill_tokens: Vec<u64>,
    /// KV blocks in use by the candidate's active requests (shared blocks once).
    pub active_decode_blocks: Vec<u64>,
    /// Requests booked on the candidate.
    pub active_requests: Vec<u32>,
    /// Leading blocks of this prompt already active on the candidate (they add no decode blocks).
    pub active_prompt_blocks: Vec<u32>,
    /// The candidate's KV capacity in blocks (`total_kv_blocks`; 0 when unknown).
    pub total_kv_blocks: Vec<u64>,
    /// The candidate's prefill budget per step (`max_num_batched_tokens`; 0 when unknown).
    pub max_num_batched_tokens: Vec<u32>,
    /// How far the candidate's overlaps can be trusted: its KV event feed's
    /// [`Trust`](crate::feeds::Trust) code (0 exact, 1 recovering, 2 degraded; exact without a
    /// feed). Callers that leave it empty mean every candidate exact.
    pub kv_feed_trust: Vec<u8>,
    /// Whether the candidate holds the request's session binding ([`crate::sessions`]): 1 its
    /// own session's, 2 its parent session's (a subagent's first turn), 0 neither. Callers that
    /// leave it empty mean 0 everywhere.
    pub session_bound: Vec<u8>,
    /// The host's native cost (SPEC §7, without preferred taints); lower is better.
    pub base_cost: Vec<f64>,
    /// The candidate's worker's learned prefill milliseconds per uncached prompt token
    /// ([`crate::learn`]); 0 when not learned yet.
    pub prefill_ms_per_token: Vec<f64>,
    /// Its learned milliseconds per output token once decoding; 0 when not learned yet.
    pub decode_step_ms: Vec<f64>,
    pub taint_offsets: Vec<u32>,
    pub taint_ids: Vec<u32>,
}

impl CandidateColumns {
    /// Number of candidates.
    pub fn len(&self) -> usize {
        self.worker_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.worker_id.is_empty()
    }

    /// Empties every column, keeping allocations for the next decision.
    pub fn clear(&mut self) {
        self.worker_id.clear();
        self.dp_rank.clear();
        self.device_overlap.clear();
        self.host_overlap.clear();
        self.disk_overlap.clear();
        self.active_prefill_tokens.clear();
        self.active_decode_blocks.clear();
        self.active_requests.clear();
        self.active_prompt_blocks.clear();
        self.total_kv_blocks.clear();
        self.max_num_batched_tokens.clear();
        self.kv_feed_trust.clear();
        self.session_bound.clear();
        self.base_cost.clear();
        self.prefill_ms_per_token.clear();
        self.decode_step_ms.clear();
        self.taint_offsets.clear();
        self.taint_ids.clear();
    }

    /// The taint ids of candidate `i`.
    pub fn taints_of(&self, i: usize) -> &[u32] {
        &self.taint_ids[self.taint_offsets[i] as usize..self.taint_offsets[i + 1] as usize]
    }

    /// The key of candidate `i`.
    pub fn key(&self, i: usize) -> CandidateKey {
        CandidateKey::new(self.worker_id[i], self.dp_rank[i])
    }
}

pub use crate::stage::Stage;

/// What a policy learns about the request being routed (WIT record `request`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyRequest {
    pub request_id: String,
    /// Prompt length in tokens (`isl`).
    pub prompt_tokens: u32,
    /// Complete blocks in the prompt (what the index can match).
    pub request_blocks: u32,
    pub block_size: u32,
    /// Soft preferences: taint id (in the taint table) and a weight in (-1, 1); positive = preferred.
    pub preferred_taints: Vec<(u32, f32)>,
    pub priority: f64,
    pub expected_output_tokens: Option<u32>,
    /// 0 = pick the lowest cost; > 0 = sample (SPEC §7).
    pub temperature: f64,
    pub session_id: Option<String>,
    /// The router's clock at the decision, in milliseconds since the Unix epoch (WIT `now-ms`).
    pub now_ms: u64,
    /// The client only asks (`"book": false`): a policy must remember nothing from this
    /// decision (WIT `request-flags.ask-only`).
    pub ask_only: bool,
}

/// The taint-name table that candidate taint ids refer to: `names[id]` is taint `id`.
///
/// The router owns one and bumps `version` whenever the names change; an instance is sent the
/// names only when the version differs from the last one it saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaintTable {
    pub version: u64,
    pub names: Arc<[String]>,
}

impl TaintTable {
    pub fn new(version: u64, names: impl Into<Arc<[String]>>) -> Self {
        Self {
            version,
            names: names.into(),
        }
    }
}
