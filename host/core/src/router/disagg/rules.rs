//! The pure rules of a disaggregated decision, kept apart from the router so each can be tested on
//! its own: the KV-transfer constraint derived from the chosen prefill worker, its merge into the
//! request's constraints for the decode step (exactly as Dynamo's
//! `merge_decode_topology_constraints`), and the bypass rules (Dynamo's conditional
//! disaggregation: `isl_bounding`, `prefill_load`, `isl_or_load`).

use serde::Serialize;

use super::config::{DisaggConfig, KvTransferEnforcement};
use crate::workers::{topology_taint, Topology};

/// Constraints on the decode worker: the transfer's, or those merged into the request's.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TopologyConstraints {
    pub required_taints: Vec<String>,
    /// Taint name → weight, in the order added.
    pub preferred_taints: Vec<(String, f32)>,
}

impl TopologyConstraints {
    pub fn is_empty(&self) -> bool {
        self.required_taints.is_empty() && self.preferred_taints.is_empty()
    }
}

/// The chosen prefill worker has no value for the transfer domain that must be enforced: the
/// decode worker's domain cannot be derived, so the request fails closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingDomain {
    pub domain: String,
}

/// The constraint the KV transfer puts on the decode worker, derived from the prefill worker's
/// value for `kv_transfer_domain`: a required taint, a preferred one with
/// `kv_transfer_preferred_weight`, or nothing (enforcement `none`, or no domain configured). A
/// prefill worker without that domain gives nothing under `preferred` and fails closed under
/// `required`.
pub fn transfer_constraints(
    cfg: &DisaggConfig,
    prefill_topology: &Topology,
) -> Result<TopologyConstraints, MissingDomain> {
    let mut out = TopologyConstraints::default();
    let Some(domain) = cfg.kv_transfer_domain.as_deref() else {
        return Ok(out);
    };
    if cfg.kv_transfer_enforcement == KvTransferEnforcement::None {
        return Ok(out);
    }
    let Some(value) = prefill_topology.get(domain) else {
        return match cfg.kv_transfer_enforcement {
            KvTransferEnforcement::Required => Err(MissingDomain {
                domain: domain.to_string(),
            }),
            _ => Ok(out),
        };
    };
    let taint = topology_taint(domain, value);
    match cfg.kv_transfer_enforcement {
        KvTransferEnforcement::Required => out.required_taints.push(taint),
        KvTransferEnforcement::Preferred => out
            .preferred_taints
            .push((taint, cfg.kv_transfer_preferred_weight as f32)),
        KvTransferEnforcement::None => {}
    }
    Ok(out)
}

/// Merges the transfer's constraints into the request's, for the decode step: required taints are
/// added (a set: one already required stays once), preferred taints are added by name (the
/// transfer's weight replaces the request's for the same name, as extending Dynamo's map does).
/// The request's other entries are kept.
pub fn merge_decode_topology_constraints(
    request: &mut TopologyConstraints,
    transfer: &TopologyConstraints,
) {
    if transfer.is_empty() {
        return;
    }
    for t in &transfer.required_taints {
        if !request.required_taints.contains(t) {
            request.required_taints.push(t.clone());
        }
    }
    for (name, w) in &transfer.preferred_taints {
        match request.preferred_taints.iter_mut().find(|(n, _)| n == name) {
            Some(entry) => entry.1 = *w,
            None => request.preferred_taints.push((name.clone(), *w)),
        }
    }
}

/// isl_bounding: bypass when the prompt tokens the decode worker lacks (`prompt - cached`, the
/// "effective ISL") are below `max_uncached_tokens` *and*, when a ratio is set, below
/// `max_uncached_ratio` of the prompt. Both bounds are strict. Without a ratio (the default) a
/// short prompt prefills where it decodes however little of it is cached.
pub fn isl_bounding_holds(
    prompt_tokens: u32,
    decode_cached_tokens: u32,
    max_uncached_tokens: u32,
    max_uncached_ratio: Option<f64>,
) -> bool {
    let uncached = prompt_tokens.saturating_sub(decode_cached_tokens.min(prompt_tokens));
    if uncached >= max_uncached_tokens {
        return false;
    }
    let Some(max_ratio) = max_uncached_ratio else {
        return true;
    };
    let ratio = f64::from(uncached) / f64::from(prompt_tokens.max(1));
    ratio < max_ratio
}

/// prefill_load's signal: whether a prefill worker is loaded, i.e. its unprefilled tokens exceed
/// `max_load` × its `max_num_batched_tokens` (strictly). `None` when its budget is unknown (0):
/// then the rule does not bypass, as Dynamo's does not on a missing signal.
pub fn prefill_loaded(
    active_prefill_tokens: u64,
    max_num_batched_tokens: u32,
    max_load: f64,
) -> Option<bool> {
    (max_num_batched_tokens > 0)
        .then(|| active_prefill_tokens as f64 > max_load * f64::from(max_num_batched_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn constraints(required: &[&str], preferred: &[(&str, f32)]) -> TopologyConstraints {
        TopologyConstraints {
            required_taints: required.iter().map(|s| s.to_string()).collect(),
            preferred_taints: preferred.iter().map(|(n, w)| (n.to_string(), *w)).collect(),
        }
    }

    #[test]
    fn merge_creates_and_preserves_constraints() {
        let transfer = constraints(
            &["topology/zone=us-east-1a"],
            &[("topology/rack=rack-7", 0.85)],
        );
        // Without the request's own constraints: the transfer's are created.
        let mut none = TopologyConstraints::default();
        merge_decode_topology_constraints(&mut none, &transfer);
        assert_eq!(none, transfer);
        // With them: both are kept.
        let mut own = constraints(&["user.required"], &[("user.preferred", 0.25)]);
        merge_decode_topology_constraints(&mut own, &transfer);
        assert_eq!(
            own,
            constraints(
                &["user.required", "topology/zone=us-east-1a"],
                &[("user.preferred", 0.25), ("topology/rack=rack-7", 0.85)]
            )
        );
        // A taint the request already requires stays once; the transfer's weight wins by name.
        let mut overlap = constraints(
            &["topology/zone=us-east-1a"],
            &[("topology/rack=rack-7", -0.5)],
        );
        merge_decode_topology_constraints(&mut overlap, &transfer);
        assert_eq!(overlap, transfer);
        // Nothing to merge changes nothing.
        let mut own = constraints(&["a"], &[]);
        merge_decode_topology_constraints(&mut own, &TopologyConstraints::default());
        assert_eq!(own, constraints(&["a"], &[]));
    }

    fn zone(v: &str) -> Topology {
        [("zone".to_string(), v.to_string())].into()
    }

    #[test]
    fn transfer_constraints_build_required_and_preferred_and_fail_closed() {
        let cfg = |e| DisaggConfig {
            kv_transfer_domain: Some("zone".into()),
            kv_transfer_enforcement: e,
            kv_transfer_preferred_weight: 0.85,
            ..Default::default()
        };
        assert_eq!(
            transfer_constraints(&cfg(KvTransferEnforcement::Required), &zone("us-east-1a")),
            Ok(constraints(&["topology/zone=us-east-1a"], &[]))
        );
        assert_eq!(
            transfer_constraints(&cfg(KvTransferEnforcement::Preferred), &zone("us-east-1a")),
            Ok(constraints(&[], &[("topology/zone=us-east-1a", 0.85)]))
        );
        assert_eq!(
            transfer_constraints(&cfg(KvTransferEnforcement::None), &zone("a")),
            Ok(TopologyConstraints::default())
        );
        assert_eq!(
            transfer_constraints(&DisaggConfig::default(), &zone("a")),
            Ok(TopologyConstraints::default())
        );
        // A prefill worker without the domain: required fails closed, preferred constrains nothing.
        let rack: Topology = [("rack".to_string(), "r1".to_string())].into();
        assert_eq!(
            transfer_constraints(&cfg(KvTransferEnforcement::Required), &rack),
            Err(MissingDomain {
                domain: "zone".into()
            })
        );
        assert_eq!(
            transfer_constraints(&cfg(KvTransferEnforcement::Preferred), &rack),
            Ok(TopologyConstraints::default())
        );
    }

    #[test]
    fn isl_bounding_at_its_thresholds() {
        // Dynamo's cases, with 64-token blocks: 1000 tokens, 14 blocks cached -> 104 uncached.
        assert!(isl_bounding_holds(1000, 14 * 64, 2048, Some(0.7)));
        // A large uncached part does not bypass even with a low ratio.
        assert!(!isl_bounding_holds(100_000, 1000 * 64, 2048, Some(0.99)));
        // Small but nothing cached: the ratio (1.0) is at or above the bound.
        assert!(!isl_bounding_holds(200, 0, 2048, Some(0.7)));
        // Exactly at the absolute bound: no bypass; one token below: bypass.
        assert!(!isl_bounding_holds(2048, 0, 2048, Some(0.99 + 0.02)));
        assert!(isl_bounding_holds(2047, 0, 2048, Some(1.01)));
        // Exactly at the ratio bound: 70 of 100 uncached is not below 0.7; 69 is.
        assert!(!isl_bounding_holds(100, 30, 2048, Some(0.7)));
        assert!(isl_bounding_holds(100, 31, 2048, Some(0.7)));
        // Cached beyond the prompt clamps to 0 uncached; an empty prompt does not divide by 0.
        assert!(isl_bounding_holds(500, 640, 2048, Some(0.7)));
        assert!(isl_bounding_holds(0, 0, 2048, Some(0.7)));
        // Without a ratio (the default): a fresh 64-token prompt stays where it decodes, a long
        // uncached one does not.
        assert!(isl_bounding_holds(64, 0, 2048, None));
        assert!(isl_bounding_holds(2047, 0, 2048, None));
        assert!(!isl_bounding_holds(2048, 0, 2048, None));
        assert!(!isl_bounding_holds(100_000, 1000 * 64, 2048, None));
    }

    #[test]
    fn prefill_load_at_its_threshold() {
        // 0.8 of 1000: 800 is not over the line, 801 is.
        assert_eq!(prefill_loaded(800, 1000, 0.8), Some(false));
        assert_eq!(prefill_loaded(801, 1000, 0.8), Some(true));
        // Unknown budget: no signal.
        assert_eq!(prefill_loaded(1 << 20, 0, 0.8), None);
    }
}
