//! Hard eligibility: the one predicate that decides whether a candidate may receive a request
//! (SPEC §6). Queue admission, selection and every cost estimate call [`check`], so the rules can
//! never drift apart, and policies only ever see candidates that passed it.
//!
//! A candidate is eligible when, in this order: its role takes the step being decided (a
//! prefill-only worker never decodes, a decode-only worker never takes a prefill step); it is among
//! the allowed worker ids (when given); it has every required taint; it is not draining; its KV
//! event feed is not dead (only under the `drain` dead-feed rule, see [`crate::feeds`]); it is not
//! busy. A pinned request checks its one
//! candidate the same way and turns the first failure into its own error (see [`PinError`]).

use rustc_hash::FxHashSet;

use crate::candidate::{DpRank, WorkerId};
use crate::load::CandidateLoad;
use crate::workers::{CandidateEntry, RegistrySnapshot, Role};

/// Which roles a step takes: a prefill step takes workers that can prefill, a decode step (and an
/// aggregated decision, which decodes where it prefills) workers that can decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoleNeed {
    /// Every role (library callers that predate roles).
    #[default]
    Any,
    Prefill,
    Decode,
}

impl RoleNeed {
    #[inline]
    pub fn admits(self, role: Role) -> bool {
        match self {
            RoleNeed::Any => true,
            RoleNeed::Prefill => role.can_prefill(),
            RoleNeed::Decode => role.can_decode(),
        }
    }
}

/// The busy rule (SPEC §9): a candidate is busy when its not-yet-prefilled tokens exceed
/// `threshold_frac × max_num_batched_tokens`. Off when `threshold_frac` is `None`; a candidate whose
/// budget is unknown (0) is never busy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyRule {
    pub threshold_frac: Option<f64>,
}

impl BusyRule {
    #[inline]
    pub fn is_busy(&self, c: &CandidateEntry, load: &CandidateLoad) -> bool {
        match self.threshold_frac {
            Some(frac) if c.max_num_batched_tokens > 0 => {
                load.active_prefill_tokens as f64 > frac * f64::from(c.max_num_batched_tokens)
            }
            _ => false,
        }
    }
}

/// The hard constraints of one request, resolved against the registry.
#[derive(Clone, Debug, Default)]
pub struct Constraints {
    /// `None` = every worker allowed.
    pub allowed: Option<FxHashSet<WorkerId>>,
    /// Required taint ids. A required name no worker has makes this `Err` at resolution: see
    /// [`Constraints::unsatisfiable`].
    pub required_taints: Vec<u32>,
    /// A required taint name that no worker has ever had: nobody is eligible.
    pub unsatisfiable: Option<String>,
    /// Under the `drain` dead-feed rule: the candidates whose KV event feed is dead.
    pub dead_feeds: Option<std::sync::Arc<FxHashSet<crate::candidate::CandidateKey>>>,
    /// The roles the step takes.
    pub role: RoleNeed,
}

/// Why a candidate is not eligible, in check order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ineligible {
    Role,
    NotAllowed,
    MissingTaints,
    Draining,
    FeedDead,
    Busy,
}

impl Ineligible {
    /// Stable snake_case name (the `reason` of an explained decision's excluded candidates).
    pub fn code(self) -> &'static str {
        match self {
            Ineligible::Role => "role",
            Ineligible::NotAllowed => "not_allowed",
            Ineligible::MissingTaints => "missing_required_taints",
            Ineligible::Draining => "draining",
            Ineligible::FeedDead => "kv_feed_dead",
            Ineligible::Busy => "busy",
        }
    }
}

/// The predicate. Cheap: no allocation, a hash probe at most.
#[inline]
pub fn check(
    c: &CandidateEntry,
    load: &CandidateLoad,
    constraints: &Constraints,
    busy: &BusyRule,
) -> Result<(), Ineligible> {
    if !constraints.role.admits(c.role) {
        return Err(Ineligible::Role);
    }
    if let Some(allowed) = &constraints.allowed {
        if !allowed.contains(&c.key.worker_id) {
            return Err(Ineligible::NotAllowed);
        }
    }
    if constraints.unsatisfiable.is_some()
        || !constraints.required_taints.iter().all(|&t| c.has_taint(t))
    {
        return Err(Ineligible::MissingTaints);
    }
    if c.draining {
        return Err(Ineligible::Draining);
    }
    if constraints
        .dead_feeds
        .as_ref()
        .is_some_and(|d| d.contains(&c.key))
    {
        return Err(Ineligible::FeedDead);
    }
    if busy.is_busy(c, load) {
        return Err(Ineligible::Busy);
    }
    Ok(())
}

/// The required taints a candidate lacks, by name, in the request's order. A name no worker has
/// ever had is lacked by everyone. Called on refusals and explained decisions only.
pub fn missing_taints(
    c: &CandidateEntry,
    required: &[String],
    snap: &RegistrySnapshot,
) -> Vec<String> {
    required
        .iter()
        .filter(|name| snap.taint_id(name).is_none_or(|id| !c.has_taint(id)))
        .cloned()
        .collect()
}

/// A worker the required taints kept out, and the ones it lacks (taints are per worker, so its
/// ranks all lack the same). The structured half of a refusal's message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct WorkerMissingTaints {
    pub worker_id: WorkerId,
    pub missing: Vec<String>,
}

/// Why a pinned request cannot go to its pinned candidate. Each has its own status and code.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PinError {
    #[error("pinned worker {0} is not in allowed_worker_ids")]
    NotAllowed(WorkerId),
    #[error("pinned worker {0} is not registered")]
    UnknownWorker(WorkerId),
    #[error("pinned worker {worker_id} has no dp_rank {dp_rank}")]
    UnknownRank {
        worker_id: WorkerId,
        dp_rank: DpRank,
    },
    #[error("pinned worker {} lacks the required taints {}", .0.worker_id, .0.missing.join(", "))]
    MissingTaints(WorkerMissingTaints),
    #[error("pinned worker {0} is draining")]
    Draining(WorkerId),
    #[error("pinned worker {0}'s KV event feed is dead (routing.dead_feed = \"drain\")")]
    FeedDead(WorkerId),
    #[error("pinned worker {0} is overloaded")]
    Overloaded(WorkerId),
    #[error(
        "pinned worker {0}'s role does not take this step (a prefill-only worker never decodes)"
    )]
    WrongRole(WorkerId),
}

impl From<(Ineligible, WorkerId)> for PinError {
    /// The pin's error for a rule; `MissingTaints` names no taint (the caller fills them in).
    fn from((why, w): (Ineligible, WorkerId)) -> Self {
        match why {
            Ineligible::Role => PinError::WrongRole(w),
            Ineligible::NotAllowed => PinError::NotAllowed(w),
            Ineligible::MissingTaints => PinError::MissingTaints(WorkerMissingTaints {
                worker_id: w,
                missing: Vec::new(),
            }),
            Ineligible::Draining => PinError::Draining(w),
            Ineligible::FeedDead => PinError::FeedDead(w),
            Ineligible::Busy => PinError::Overloaded(w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::CandidateKey;

    fn entry(w: u64, taints: &[u32], draining: bool) -> CandidateEntry {
        CandidateEntry {
            key: CandidateKey::new(w, 0),
            slot: 0,
            taint_ids: taints.iter().copied().collect(),
            draining,
            total_kv_blocks: 0,
            max_num_batched_tokens: 1000,
            role: Role::Both,
        }
    }

    #[test]
    fn check_order_and_each_rule() {
        let busy = BusyRule {
            threshold_frac: Some(0.5),
        };
        let idle = CandidateLoad::default();
        let loaded = CandidateLoad {
            active_prefill_tokens: 501,
            ..Default::default()
        };
        let mut c = Constraints {
            allowed: Some([1].into_iter().collect()),
            required_taints: vec![7],
            unsatisfiable: None,
            dead_feeds: None,
            role: RoleNeed::Decode,
        };
        // The role comes first.
        let mut prefill_only = entry(2, &[], true);
        prefill_only.role = Role::Prefill;
        assert_eq!(
            check(&prefill_only, &loaded, &c, &busy),
            Err(Ineligible::Role)
        );
        // Not allowed wins over everything else.
        assert_eq!(
            check(&entry(2, &[], true), &loaded, &c, &busy),
            Err(Ineligible::NotAllowed)
        );
        assert_eq!(
            check(&entry(1, &[], true), &loaded, &c, &busy),
            Err(Ineligible::MissingTaints)
        );
        assert_eq!(
            check(&entry(1, &[7], true), &loaded, &c, &busy),
            Err(Ineligible::Draining)
        );
        assert_eq!(
            check(&entry(1, &[3, 7], false), &loaded, &c, &busy),
            Err(Ineligible::Busy)
        );
        assert_eq!(check(&entry(1, &[7], false), &idle, &c, &busy), Ok(()));
        c.dead_feeds = Some(std::sync::Arc::new(
            [CandidateKey::new(1, 0)].into_iter().collect(),
        ));
        assert_eq!(
            check(&entry(1, &[7], true), &loaded, &c, &busy),
            Err(Ineligible::Draining),
            "draining before a dead feed"
        );
        assert_eq!(
            check(&entry(1, &[7], false), &loaded, &c, &busy),
            Err(Ineligible::FeedDead),
            "a dead feed before busy"
        );
        c.dead_feeds = None;
        c.unsatisfiable = Some("zone=mars".into());
        assert_eq!(
            check(&entry(1, &[7], false), &idle, &c, &busy),
            Err(Ineligible::MissingTaints)
        );
        // Busy off, or unknown budget: never busy.
        let off = BusyRule::default();
        assert!(!off.is_busy(&entry(1, &[], false), &loaded));
        let mut unknown = entry(1, &[], false);
        unknown.max_num_batched_tokens = 0;
        assert!(!busy.is_busy(&unknown, &loaded));
    }
}
