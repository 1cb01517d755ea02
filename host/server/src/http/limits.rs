//! `[limits]`: the input limits the API enforces (body sizes, events per post, request taints),
//! and the registry's and the index's caps beside them, in one section of `kvroute serve`'s
//! configuration.
//!
//! Why here rather than in `config.rs`: the handlers read it ([`super::AppState::limits`]) and
//! `http` imports nothing above it; `config` reads the section from the file and hands the rest of
//! it to the router and the registry.

use kvroute_core::workers::RegistryLimits;
use serde::{Deserialize, Serialize};

/// Input limits. Each rejection is a clear 4xx naming the limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    pub max_body_bytes: usize,
    pub max_prompt_tokens: usize,
    pub max_events_per_request: usize,
    pub max_policy_bytes: usize,
    pub max_workers: usize,
    pub max_dp_size: u32,
    pub max_taints_per_worker: usize,
    pub max_taint_len: usize,
    pub max_allowed_worker_ids: usize,
    pub max_request_taints: usize,
    /// Most (candidate, block) entries the KV index holds over all tiers; past it, the least
    /// recently matched blocks of the largest holders are evicted (`None`: no cap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_index_entries: Option<u64>,
}

impl Default for LimitsSection {
    fn default() -> Self {
        let r = RegistryLimits::default();
        Self {
            max_body_bytes: 16 << 20,
            max_prompt_tokens: 1 << 20,
            max_events_per_request: 10_000,
            max_policy_bytes: 32 << 20,
            max_workers: r.max_workers,
            max_dp_size: r.max_dp_size,
            max_taints_per_worker: r.max_taints_per_worker,
            max_taint_len: r.max_taint_len,
            max_allowed_worker_ids: 16_384,
            max_request_taints: 256,
            max_index_entries: None,
        }
    }
}
