//! Session affinity in a decision: read the request's session binding (and its parent's) before
//! the candidates are filtered, apply the `hard` rule, mark the `session-bound` column, and record
//! the outcome once the decision is booked ([`crate::sessions`] is the store).
//!
//! `hard`: a request whose session (or, for a new subagent session, whose parent) is bound goes
//! to the bound candidate while that candidate passes the hard rules for this request
//! ([`crate::eligibility::check`]); when it does not (draining, removed, busy, dead feed, excluded
//! by the request's constraints or pin) the request is placed as any other and the move is counted
//! with that reason. `soft`: nothing is forced; the policy sees the binding as a column, and a
//! turn it sends elsewhere is counted as moved by `policy` (or by the rule that kept the bound
//! candidate out). `off`: nothing is read or recorded.
//!
//! A request that sends no session key may have one inferred from its prompt's lineage when it is
//! prepared (`[sessions] infer = "prefix"`, [`crate::lineage`]); here it is a key like a sent one,
//! and a booked turn of an inferred session also leaves its tip.

use super::request::Prepared;
use super::Router;
use crate::candidate::CandidateKey;
use crate::eligibility::{self, RoleNeed};
use crate::sessions::{Affinity, BreakReason, Recorded, SessionMode};
use crate::workers::RegistrySnapshot;

/// What a decision knows of its session before placing.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SessionPlan {
    pub(super) affinity: Affinity,
    /// The bound (or parent's) candidate's index in the snapshot, when it passes the hard rules.
    pub(super) target: Option<usize>,
    /// Why the bound (or parent's) candidate cannot take the request, when it cannot.
    pub(super) unavailable: Option<BreakReason>,
}

impl Router {
    /// Reads the request's bindings and checks the candidate they name against the hard rules.
    pub(super) fn session_plan(&self, p: &Prepared, snap: &RegistrySnapshot) -> SessionPlan {
        let sessions = &self.sessions;
        if sessions.mode() == SessionMode::Off {
            return SessionPlan::default();
        }
        let affinity = sessions.lookup(
            p.req.session_id.as_deref(),
            p.req.parent_session_id.as_deref(),
            self.now_us(),
        );
        let Some(key) = affinity.target() else {
            return SessionPlan::default();
        };
        let mut plan = SessionPlan {
            affinity,
            ..Default::default()
        };
        match self.bound_candidate(p, snap, key) {
            Ok(i) => plan.target = Some(i),
            Err(r) => plan.unavailable = Some(r),
        }
        plan
    }

    /// The bound candidate's index in the snapshot when it may take this request (aggregated, or
    /// as a split request's decode worker), or why not.
    fn bound_candidate(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        key: CandidateKey,
    ) -> Result<usize, BreakReason> {
        let i = snap
            .candidates
            .binary_search_by_key(&key, |c| c.key)
            .map_err(|_| BreakReason::Removed)?;
        if let Some(pin) = p.req.pinned {
            if pin.worker_id != key.worker_id || pin.dp_rank.is_some_and(|r| r != key.dp_rank) {
                return Err(BreakReason::Excluded);
            }
        }
        let constraints = self.resolve_constraints(
            &p.req.required_taints,
            p.req.allowed_worker_ids.as_deref(),
            RoleNeed::Decode,
            snap,
        );
        let c = &snap.candidates[i];
        let load = self.load.lock().load(c.key);
        eligibility::check(c, &load, &constraints, &self.busy).map_err(BreakReason::of)?;
        Ok(i)
    }

    /// After a booked decision on `chosen`: binds, refreshes or moves the session, and counts
    /// a bound session's turn as kept or broken (with its reason).
    pub(super) fn session_booked(&self, p: &Prepared, plan: &SessionPlan, chosen: CandidateKey) {
        let Some(session) = p.req.session_id.as_deref() else {
            return;
        };
        let now = self.now_us();
        let recorded =
            self.sessions
                .record(session, p.req.parent_session_id.as_deref(), chosen, now);
        if p.inferred_session {
            self.sessions.record_tip(session, &p.seq, now);
        }
        match recorded {
            Some(Recorded::Kept) => self.sessions.count(None),
            Some(Recorded::Moved) => self.sessions.count(Some(plan.unavailable.unwrap_or(
                match self.sessions.mode() {
                    // The bound candidate was eligible, yet the request went elsewhere: only
                    // its own constraints (a split request's transfer domain) can do that.
                    SessionMode::Hard => BreakReason::Excluded,
                    _ => BreakReason::Policy,
                },
            ))),
            Some(Recorded::New { .. }) | None => {}
        }
    }
}

/// The `session-bound` code of candidate `key`: 1 it holds the request's own session binding, 2
/// its parent's, 0 neither.
#[inline]
pub(super) fn session_bound(affinity: &Affinity, key: CandidateKey) -> u8 {
    if affinity.own == Some(key) {
        1
    } else if affinity.parent == Some(key) {
        2
    } else {
        0
    }
}
