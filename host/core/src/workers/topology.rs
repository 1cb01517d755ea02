//! A worker's role in a disaggregated fleet and where it sits (its topology).
//!
//! Disaggregated serving splits a request in two: a *prefill* worker computes the prompt's KV cache
//! and a *decode* worker generates from it after the cache has travelled there. A worker's
//! [`Role`] says which half it may take (`both`, the default, takes either, and is what every
//! worker of an aggregated fleet is). Its topology (`zone = "us-east-1a"`, `rack = "r7"`) says
//! where it sits; the KV transfer is cheap inside a domain and dear across, so the router turns the
//! chosen prefill worker's domain into a constraint on the decode worker (`router::disagg`).
//!
//! Why derived taints: constraints already speak taints (required, preferred, eligibility, explain,
//! policies), so a topology entry becomes one taint, `topology/<domain>=<value>`, that the host
//! derives and owns. A client cannot set a taint in that namespace, so a topology taint always
//! means what the registry says.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{spec_error, RegistryLimits, SpecError};

/// Taints starting with this prefix are derived from a worker's topology by the host.
pub const TOPOLOGY_TAINT_PREFIX: &str = "topology/";

/// Which half of a disaggregated request a worker may take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes prompts only: its KV cache is transferred to a decode worker.
    Prefill,
    /// Generates only, from a KV cache computed elsewhere (or prefilled locally when a bypass rule
    /// keeps a request on it).
    Decode,
    /// Either half, or a whole request (an aggregated worker).
    #[default]
    Both,
}

impl Role {
    /// Whether the worker may take a request's prefill half.
    #[inline]
    pub fn can_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether the worker may take a request's decode half (or a whole request).
    #[inline]
    pub fn can_decode(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// Where a worker sits: domain (`zone`, `rack`, ...) → value (`us-east-1a`, `r7`).
pub type Topology = BTreeMap<String, String>;

/// The taint the host derives from one topology entry.
pub fn topology_taint(domain: &str, value: &str) -> String {
    format!("{TOPOLOGY_TAINT_PREFIX}{domain}={value}")
}

/// The derived taints of a topology, in domain order.
pub fn topology_taints(topology: &Topology) -> impl Iterator<Item = String> + '_ {
    topology.iter().map(|(d, v)| topology_taint(d, v))
}

/// Checks a topology: every domain and value non-empty, without control characters; a domain
/// without `=` (the derived taint would be ambiguous); the derived taint within the taint length
/// limit; and the client's taints plus the derived ones within the per-worker limit. Errors name
/// `topology.<domain>`.
pub(super) fn validate_topology(
    topology: &Topology,
    client_taints: usize,
    limits: &RegistryLimits,
) -> Result<(), SpecError> {
    if client_taints + topology.len() > limits.max_taints_per_worker {
        return Err(spec_error(
            "topology",
            format!(
                "{client_taints} taints and {} topology entries; at most {} per worker together \
                 (each entry is a taint)",
                topology.len(),
                limits.max_taints_per_worker
            ),
        ));
    }
    for (domain, value) in topology {
        let field = format!("topology.{domain}");
        if domain.is_empty() {
            return Err(spec_error("topology", "a domain cannot be empty"));
        }
        if domain.contains('=') {
            return Err(spec_error(field, "a domain cannot contain `=`"));
        }
        if value.is_empty() {
            return Err(spec_error(field, "a value cannot be empty"));
        }
        if domain.chars().chain(value.chars()).any(char::is_control) {
            return Err(spec_error(field, "control characters are not allowed"));
        }
        let len = TOPOLOGY_TAINT_PREFIX.len() + domain.len() + 1 + value.len();
        if len > limits.max_taint_len {
            return Err(spec_error(
                field,
                format!(
                    "the derived taint `{}` is longer than {} bytes",
                    topology_taint(domain, value),
                    limits.max_taint_len
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_say_which_half_they_take() {
        assert!(Role::Prefill.can_prefill() && !Role::Prefill.can_decode());
        assert!(!Role::Decode.can_prefill() && Role::Decode.can_decode());
        assert!(Role::Both.can_prefill() && Role::Both.can_decode());
        assert_eq!(Role::default(), Role::Both);
        let r: Role = serde_json::from_str("\"prefill\"").unwrap();
        assert_eq!((r, r.as_str()), (Role::Prefill, "prefill"));
        assert!(serde_json::from_str::<Role>("\"mixed\"").is_err());
    }

    #[test]
    fn topology_entries_become_taints_and_bad_ones_name_the_domain() {
        let t: Topology = [("zone", "us-east-1a"), ("rack", "r7")]
            .iter()
            .map(|(d, v)| (d.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            topology_taints(&t).collect::<Vec<_>>(),
            vec!["topology/rack=r7", "topology/zone=us-east-1a"]
        );
        let limits = RegistryLimits::default();
        assert_eq!(validate_topology(&t, 0, &limits), Ok(()));
        let one = |d: &str, v: &str| -> Topology { [(d.to_string(), v.to_string())].into() };
        let field = |t: &Topology| validate_topology(t, 0, &limits).unwrap_err().field;
        assert_eq!(field(&one("", "a")), "topology");
        assert_eq!(field(&one("zo=ne", "a")), "topology.zo=ne");
        assert_eq!(field(&one("zone", "")), "topology.zone");
        assert_eq!(field(&one("zone", "a\n")), "topology.zone");
        assert_eq!(field(&one("zone", &"x".repeat(300))), "topology.zone");
        // Topology entries count against the per-worker taint limit.
        let e = validate_topology(&t, limits.max_taints_per_worker - 1, &limits).unwrap_err();
        assert_eq!(e.field, "topology");
    }
}
