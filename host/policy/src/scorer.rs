//! The adapter that makes the policy registry the router's scorer: `kvroute-core` defines the
//! [`Scorer`] trait and knows nothing of Wasm; this crate implements it beside the runtime, so the
//! server and the replay simulator install the same adapter.

use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;
use kvroute_core::candidate::{CandidateColumns, PolicyRequest, TaintTable};
use kvroute_core::router::{PolicyLabel, Scorer, ScorerDecision, ScorerOutcome};
use kvroute_core::Stage;

use crate::{Outcome, PolicyRegistry, PolicyVersion};

/// Bridges the policy registry into the router's [`Scorer`] hook, caching one label per version so
/// a decision allocates no strings.
pub struct RegistryScorer {
    registry: Arc<PolicyRegistry>,
    /// The version the label was made for. A `Weak` keeps that version's allocation (not the
    /// version) alive, so no later version can reuse its address and be taken for it.
    label: ArcSwap<(Weak<PolicyVersion>, Arc<PolicyLabel>)>,
}

impl RegistryScorer {
    pub fn new(registry: Arc<PolicyRegistry>) -> Self {
        Self {
            registry,
            label: ArcSwap::from_pointee((Weak::new(), PolicyLabel::native())),
        }
    }

    fn label_of(&self, v: &Arc<PolicyVersion>) -> Arc<PolicyLabel> {
        let cached = self.label.load();
        if std::ptr::eq(cached.0.as_ptr(), Arc::as_ptr(v)) {
            return cached.1.clone();
        }
        let label = Arc::new(PolicyLabel {
            name: v.name().to_string(),
            version: v.version(),
            digest: v.digest().to_string(),
        });
        self.label
            .store(Arc::new((Arc::downgrade(v), label.clone())));
        label
    }
}

impl Scorer for RegistryScorer {
    fn decide(
        &self,
        request: &PolicyRequest,
        candidates: &CandidateColumns,
        taints: &TaintTable,
        stage: Stage,
    ) -> ScorerDecision {
        let d = self.registry.decide_at(request, candidates, taints, stage);
        let label = match &d.policy {
            Some(v) => self.label_of(v),
            None => PolicyLabel::native(),
        };
        let outcome = match d.outcome {
            Outcome::Costs(c) => ScorerOutcome::Costs(c),
            Outcome::Pick(i) => ScorerOutcome::Pick(i),
            Outcome::Fallback(_) if d.policy.is_none() => ScorerOutcome::Native,
            Outcome::Fallback(r) => ScorerOutcome::Fallback(r.as_str()),
            Outcome::NeedsBaseCost => ScorerOutcome::NeedsBaseCost,
        };
        ScorerDecision { outcome, label }
    }

    fn reads_base_cost(&self) -> bool {
        self.registry.reads_base_cost()
    }
}
