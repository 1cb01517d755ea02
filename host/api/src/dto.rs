//! Request and response bodies of API v1, exactly as API.md spells them.
//!
//! Requests deny unknown fields. Conversion into the core's types happens here, so handlers stay
//! thin and every field-level check names its JSON path.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::ApiError;
use kvroute_core::candidate::{DpRank, WorkerId};
use kvroute_core::indexer::{KvEventData, StoredBlock, Tier};
use kvroute_core::router::{
    preferred_taint_weight, DisaggMode, ExplainRow, Pin, PrefillPlacement, Prompt, RouteDecision,
    RouteRequest, TopologyConstraints,
};
use kvroute_core::workers::{Role, Topology, Worker};

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RoutingConstraints {
    #[serde(default)]
    pub required_taints: Vec<String>,
    #[serde(default)]
    pub preferred_taints: BTreeMap<String, f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinnedWorker {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RouteBody {
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<u64>>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub session_id: Option<String>,
    /// Fair queueing's tenant and the budget the request counts against.
    #[serde(default)]
    pub tenant: Option<String>,
    /// A subagent's parent session (API.md "Sessions").
    #[serde(default)]
    pub parent_session_id: Option<String>,
    #[serde(default)]
    pub routing_constraints: Option<RoutingConstraints>,
    #[serde(default)]
    pub allowed_worker_ids: Option<Vec<WorkerId>>,
    #[serde(default)]
    pub pinned_worker: Option<PinnedWorker>,
    #[serde(default)]
    pub priority: Option<f64>,
    /// Extension: strict priority class for the queue (higher first).
    #[serde(default)]
    pub priority_class: Option<i32>,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub book: Option<bool>,
    #[serde(default)]
    pub explain: Option<bool>,
    /// `auto` (default), `off` or `required`.
    #[serde(default)]
    pub disaggregation: Option<DisaggMode>,
}

/// Limits the HTTP layer checks before the core sees a request.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_allowed_worker_ids: usize,
    pub max_request_taints: usize,
}

fn prompt_of(tokens: Option<Vec<u32>>, block_hashes: Option<Vec<u64>>) -> Result<Prompt, ApiError> {
    match (tokens, block_hashes) {
        (Some(t), None) => Ok(Prompt::Tokens(t)),
        (None, Some(h)) => Ok(Prompt::BlockHashes(h)),
        (Some(_), Some(_)) => Err(ApiError::invalid_field(
            "tokens",
            "give either tokens or block_hashes, not both",
        )),
        (None, None) => Err(ApiError::invalid_field(
            "tokens",
            "give the prompt as tokens or as block_hashes",
        )),
    }
}

impl super::prompt_json::PromptBody for RouteBody {
    fn tokens_mut(&mut self) -> &mut Option<Vec<u32>> {
        &mut self.tokens
    }
    fn block_hashes_mut(&mut self) -> &mut Option<Vec<u64>> {
        &mut self.block_hashes
    }
}

impl RouteBody {
    pub fn into_request(self, limits: &BodyLimits) -> Result<RouteRequest, ApiError> {
        let prompt = prompt_of(self.tokens, self.block_hashes)?;
        let constraints = self.routing_constraints.unwrap_or_default();
        if constraints.required_taints.len() > limits.max_request_taints {
            return Err(ApiError::invalid_field(
                "routing_constraints.required_taints",
                format!("at most {} taints", limits.max_request_taints),
            ));
        }
        if constraints.preferred_taints.len() > limits.max_request_taints {
            return Err(ApiError::invalid_field(
                "routing_constraints.preferred_taints",
                format!("at most {} taints", limits.max_request_taints),
            ));
        }
        let mut preferred = Vec::with_capacity(constraints.preferred_taints.len());
        for (name, w) in constraints.preferred_taints {
            // The core's rule, checked on the number as sent (an f64): it names the field.
            let w = preferred_taint_weight(&name, w)?;
            preferred.push((name, w));
        }
        if let Some(ids) = &self.allowed_worker_ids {
            if ids.len() > limits.max_allowed_worker_ids {
                return Err(ApiError::invalid_field(
                    "allowed_worker_ids",
                    format!("at most {} ids", limits.max_allowed_worker_ids),
                ));
            }
        }
        Ok(RouteRequest {
            request_id: self.request_id,
            prompt,
            lora_name: self.lora_name,
            cache_salt: self.cache_salt,
            session_id: self.session_id,
            tenant: self.tenant,
            parent_session_id: self.parent_session_id,
            required_taints: constraints.required_taints,
            preferred_taints: preferred,
            allowed_worker_ids: self.allowed_worker_ids,
            pinned: self.pinned_worker.map(|p| Pin {
                worker_id: p.worker_id,
                dp_rank: p.dp_rank,
            }),
            priority: self.priority.unwrap_or(0.0),
            priority_class: self.priority_class.unwrap_or(0),
            expected_output_tokens: self.expected_output_tokens,
            temperature: self.temperature,
            book: self.book.unwrap_or(true),
            explain: self.explain.unwrap_or(false),
            disaggregation: self.disaggregation.unwrap_or_default(),
        })
    }
}

#[derive(Debug, Serialize)]
pub struct PolicyRef {
    pub name: String,
    /// The same number as `version` in `GET /v1/policies`.
    pub version: u64,
    pub digest: String,
}

#[derive(Debug, Serialize)]
pub struct CandidateOut {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    /// Predict-on-route's overlap (0 when off); `overlap_blocks` is the deeper of it and the
    /// index's.
    pub predicted_overlap_blocks: u32,
    pub host_overlap_blocks: u32,
    pub disk_overlap_blocks: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u32,
    /// The candidate's KV feed trust state (`exact` without a feed), as policies see it.
    pub kv_feed_trust: kvroute_core::feeds::Trust,
    /// 1: holds the request's session binding; 2: its parent session's; 0: neither.
    pub session_bound: u8,
    pub taints: Vec<String>,
    pub base_cost: f64,
    /// What the pick was made from: the policy's cost when it answered costs, else the native.
    pub cost: f64,
    pub chosen: bool,
}

impl From<ExplainRow> for CandidateOut {
    fn from(r: ExplainRow) -> Self {
        Self {
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
            overlap_blocks: r.overlap_blocks,
            predicted_overlap_blocks: r.predicted_overlap_blocks,
            host_overlap_blocks: r.host_overlap_blocks,
            disk_overlap_blocks: r.disk_overlap_blocks,
            active_prefill_tokens: r.active_prefill_tokens,
            active_decode_blocks: r.active_decode_blocks,
            active_requests: r.active_requests,
            kv_feed_trust: r.kv_feed_trust,
            session_bound: r.session_bound,
            taints: r.taints,
            base_cost: finite_or_max(r.base_cost),
            cost: finite_or_max(r.cost),
            chosen: r.chosen,
        }
    }
}

fn finite_or_max(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        f64::MAX
    }
}

#[derive(Debug, Serialize)]
pub struct RouteResponse {
    pub request_id: String,
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    /// Where the overlaps came from: `local` (this router's index), `remote` (the remote
    /// indexer), `none` (the remote indexer failed: every candidate had zero overlap).
    pub overlap_source: &'static str,
    pub cached_tokens: u32,
    pub policy: PolicyRef,
    pub fallback: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<&'static str>,
    pub queued_ms: u64,
    /// With `explain`: `costs` or `pick` (what the policy answered), or `native`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Vec<CandidateOut>>,
    /// With `explain`: the candidates a hard rule kept out, each with the rule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub excluded: Option<Vec<kvroute_core::router::ExcludedRow>>,
    /// Whether the request was split into a prefill and a decode half.
    pub disaggregated: bool,
    /// The prefill half, when split (`worker_id`/`dp_rank` above are where it decodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillOut>,
    /// The bypass rule that kept the prefill on the decode worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bypass: Option<&'static str>,
    /// The KV transfer's constraints merged into the decode step's, when split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology_constraints: Option<ConstraintsOut>,
}

/// Constraints in the request's own shape (`routing_constraints`).
#[derive(Debug, Serialize)]
pub struct ConstraintsOut {
    pub required_taints: Vec<String>,
    pub preferred_taints: BTreeMap<String, f64>,
}

impl From<TopologyConstraints> for ConstraintsOut {
    fn from(c: TopologyConstraints) -> Self {
        Self {
            required_taints: c.required_taints,
            preferred_taints: c
                .preferred_taints
                .into_iter()
                // The weight as written (0.9), not as its f32 widens (0.8999999761581421).
                .map(|(n, w)| (n, w.to_string().parse().unwrap_or(f64::from(w))))
                .collect(),
        }
    }
}

/// Where a split request's prompt is computed, and (with `explain`) how that step was decided.
#[derive(Debug, Serialize)]
pub struct PrefillOut {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub overlap_blocks: u32,
    pub cached_tokens: u32,
    pub policy: PolicyRef,
    pub fallback: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answer: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Vec<CandidateOut>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub excluded: Option<Vec<kvroute_core::router::ExcludedRow>>,
}

impl From<PrefillPlacement> for PrefillOut {
    fn from(p: PrefillPlacement) -> Self {
        Self {
            worker_id: p.candidate.worker_id,
            dp_rank: p.candidate.dp_rank,
            overlap_blocks: p.overlap_blocks,
            cached_tokens: p.cached_tokens,
            policy: PolicyRef {
                name: p.policy.name.clone(),
                version: p.policy.version,
                digest: p.policy.digest.clone(),
            },
            fallback: p.fallback_reason.is_some(),
            fallback_reason: p.fallback_reason,
            answer: p.answer,
            candidates: p
                .candidates
                .map(|rows| rows.into_iter().map(CandidateOut::from).collect()),
            excluded: p.excluded,
        }
    }
}

impl From<RouteDecision> for RouteResponse {
    fn from(d: RouteDecision) -> Self {
        Self {
            request_id: d.request_id,
            worker_id: d.candidate.worker_id,
            dp_rank: d.candidate.dp_rank,
            overlap_blocks: d.overlap_blocks,
            overlap_source: d.overlap_source.as_str(),
            cached_tokens: d.cached_tokens,
            policy: PolicyRef {
                name: d.policy.name.clone(),
                version: d.policy.version,
                digest: d.policy.digest.clone(),
            },
            fallback: d.fallback,
            fallback_reason: d.fallback_reason,
            queued_ms: d.queued.as_millis() as u64,
            answer: d.answer,
            candidates: d
                .candidates
                .map(|rows| rows.into_iter().map(CandidateOut::from).collect()),
            excluded: d.excluded,
            disaggregated: d.disaggregated,
            prefill: d.prefill.map(PrefillOut::from),
            bypass: d.bypass,
            topology_constraints: d.topology_constraints.map(ConstraintsOut::from),
        }
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct PatchWorkerBody {
    #[serde(default)]
    pub taints: Option<Vec<String>>,
    #[serde(default)]
    pub draining: Option<bool>,
    #[serde(default)]
    pub role: Option<Role>,
    #[serde(default)]
    pub topology: Option<Topology>,
}

#[derive(Debug, Serialize)]
pub struct RankOut {
    pub dp_rank: DpRank,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u32,
    pub cached_blocks: u64,
    pub host_cached_blocks: u64,
    pub disk_cached_blocks: u64,
    /// With `kv_events`: the rank's subscription (connected, last event age and sequence, dead).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_feed: Option<kvroute_core::feeds::FeedStatus>,
}

/// What `GET /v1/workers` shows of a worker's health.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HealthOut {
    /// `ok` or `failing` (skipped by the proxy until a probe succeeds).
    pub state: &'static str,
    pub consecutive_failures: u32,
    /// Milliseconds since the last failure (null: none).
    pub last_failure_ms_ago: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct WorkerOut {
    pub worker_id: WorkerId,
    pub dp_start: DpRank,
    pub dp_size: u32,
    pub taints: Vec<String>,
    pub draining: bool,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<kvroute_core::workers::KvEventsSpec>,
    pub role: Role,
    pub topology: Topology,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// With `serve --proxy`: the worker's circuit breaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthOut>,
    /// The worker's step times as the router learned them (zeros until learned).
    pub learned: kvroute_core::learn::Learned,
    pub ranks: Vec<RankOut>,
}

impl WorkerOut {
    pub fn new(w: Worker, ranks: Vec<RankOut>) -> Self {
        Self {
            worker_id: w.worker_id,
            dp_start: w.dp_start,
            dp_size: w.dp_size,
            taints: w.taints,
            draining: w.draining,
            total_kv_blocks: w.total_kv_blocks,
            max_num_batched_tokens: w.max_num_batched_tokens,
            kv_events: w.kv_events,
            role: w.role,
            topology: w.topology,
            endpoint: w.endpoint,
            model: w.model,
            health: None,
            learned: Default::default(),
            ranks,
        }
    }
}

// ---- events ------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventEnvelope {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub storage_tier: Option<String>,
    pub event: EventBody,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    pub event_id: u64,
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
    pub data: EventData,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum EventData {
    Stored(StoredData),
    Removed(RemovedData),
    Cleared,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredData {
    #[serde(default)]
    pub parent_hash: Option<u64>,
    pub blocks: Vec<StoredBlockBody>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredBlockBody {
    pub block_hash: u64,
    pub tokens_hash: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemovedData {
    pub block_hashes: Vec<u64>,
}

impl EventEnvelope {
    /// One item of a `POST /v1/events` array read as the handler reads it: the envelope and its
    /// tier, or the drop code (`invalid_event`, `unknown_storage_tier`) and a message that names the
    /// field. Public for the fuzz target `events_json`.
    pub fn read_item(
        item: &serde_json::value::RawValue,
    ) -> Result<(Self, Tier), (&'static str, String)> {
        let env = parse_event(item).map_err(|m| ("invalid_event", m))?;
        match env.tier() {
            Ok(tier) => Ok((env, tier)),
            Err((field, message)) => Err(("unknown_storage_tier", format!("{field}: {message}"))),
        }
    }

    /// The tier and the core event data; errors name the field.
    pub fn tier(&self) -> Result<Tier, (String, String)> {
        match self.storage_tier.as_deref() {
            None => Ok(Tier::Device),
            Some(t) => match t.to_ascii_lowercase().as_str() {
                "device" => Ok(Tier::Device),
                "host" => Ok(Tier::Host),
                "disk" => Ok(Tier::Disk),
                "external" => Ok(Tier::External),
                other => Tier::from_medium(other).ok_or_else(|| {
                    (
                        "storage_tier".to_string(),
                        format!("unknown storage tier {t:?}; use device, host, disk or external"),
                    )
                }),
            },
        }
    }

    pub fn into_data(self) -> KvEventData {
        match self.event.data {
            EventData::Stored(s) => KvEventData::Stored {
                parent_hash: s.parent_hash,
                blocks: s
                    .blocks
                    .into_iter()
                    .map(|b| StoredBlock {
                        block_hash: b.block_hash,
                        tokens_hash: b.tokens_hash,
                    })
                    .collect(),
            },
            EventData::Removed(r) => KvEventData::Removed {
                block_hashes: r.block_hashes,
            },
            EventData::Cleared => KvEventData::Cleared,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EventErrorOut {
    pub index: usize,
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Serialize)]
pub struct EventsResponse {
    pub applied: usize,
    pub dropped: usize,
    pub errors: Vec<EventErrorOut>,
}

// ---- lifecycle, overlap --------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputBody {
    pub tokens: u32,
}

#[derive(Debug, Serialize)]
pub struct LifecycleResponse {
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<WorkerId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<DpRank>,
    pub status: &'static str,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlapBody {
    #[serde(default)]
    pub tokens: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<u64>>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub cache_salt: Option<String>,
}

impl super::prompt_json::PromptBody for OverlapBody {
    fn tokens_mut(&mut self) -> &mut Option<Vec<u32>> {
        &mut self.tokens
    }
    fn block_hashes_mut(&mut self) -> &mut Option<Vec<u64>> {
        &mut self.block_hashes
    }
}

impl OverlapBody {
    pub fn prompt(&mut self) -> Result<Prompt, ApiError> {
        prompt_of(self.tokens.take(), self.block_hashes.take())
    }
}

#[derive(Debug, Serialize)]
pub struct OverlapWorker {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub device_blocks: u32,
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

#[derive(Debug, Serialize)]
pub struct OverlapResponse {
    pub block_size: u32,
    pub num_blocks: u32,
    pub workers: Vec<OverlapWorker>,
}

/// One event, typed straight from its text. The message is `"{path}: {reason}"`, the reason
/// without serde_json's `at line L column C` suffix (positions inside one event's slice would
/// mislead; the index and path locate it).
pub fn parse_event(raw: &serde_json::value::RawValue) -> Result<EventEnvelope, String> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        format!("{path}: {}", without_position(&inner))
    })
}

fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    if e.line() == 0 {
        return text;
    }
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(t) => t.to_string(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, .. ProptestConfig::default() })]

        /// What the fuzz target `events_json` asserts of one `POST /v1/events` item: read, it
        /// keeps its blocks in order and its tier; refused, it has a drop code and a message that
        /// names the field.
        #[test]
        fn event_items_are_read_whole_or_refused_naming_the_field(
            tier in proptest::option::of(proptest::sample::select(
                vec!["device", "HOST", "cpu", "disk", "external", "tape", ""])),
            kind in 0u8..4,
            blocks in proptest::collection::vec((any::<u64>(), any::<u64>()), 0..4),
            extra_field in any::<bool>(),
            negative in any::<bool>(),
        ) {
            let list: Vec<String> = blocks
                .iter()
                .map(|(b, t)| format!(r#"{{"block_hash":{b},"tokens_hash":{t}}}"#))
                .collect();
            let data = match kind {
                0 => format!(r#"{{"stored":{{"parent_hash":null,"blocks":[{}]}}}}"#, list.join(",")),
                1 => r#"{"removed":{"block_hashes":[1,2]}}"#.to_string(),
                2 => r#""cleared""#.to_string(),
                _ => r#"{"evicted":{}}"#.to_string(),
            };
            let tier_field = tier.map(|t| format!(r#""storage_tier":"{t}","#)).unwrap_or_default();
            let worker = if negative { "-1" } else { "3" };
            let extra = if extra_field { r#","surprise":1"# } else { "" };
            let text = format!(
                r#"{{"worker_id":{worker},{tier_field}"event":{{"event_id":9,"data":{data}}}{extra}}}"#
            );
            let item: &serde_json::value::RawValue = serde_json::from_str(&text).unwrap();
            let known_tier = tier.is_none_or(|t| {
                ["device", "host", "disk", "external"].contains(&t.to_ascii_lowercase().as_str())
                    || Tier::from_medium(&t.to_ascii_lowercase()).is_some()
            });
            match EventEnvelope::read_item(item) {
                Ok((env, _tier)) => {
                    prop_assert!(kind < 3 && !negative && !extra_field && known_tier, "{}", text);
                    if let KvEventData::Stored { blocks: got, .. } = env.into_data() {
                        let got: Vec<(u64, u64)> =
                            got.iter().map(|b| (b.block_hash, b.tokens_hash)).collect();
                        prop_assert_eq!(got, blocks);
                    }
                }
                Err((code, message)) => {
                    if kind < 3 && !negative && !extra_field {
                        prop_assert_eq!(code, "unknown_storage_tier");
                        prop_assert!(message.starts_with("storage_tier: "), "{}", message);
                    } else {
                        prop_assert_eq!(code, "invalid_event");
                        prop_assert!(!message.is_empty());
                    }
                }
            }
        }
    }
}
