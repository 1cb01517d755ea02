//! Where a request goes: one aggregated step, or the two steps of disaggregated prefill/decode.
//!
//! Disaggregated, in order (API.md, "Disaggregated prefill/decode"; Dynamo's `PrefillRouter` is
//! the seed):
//! 1. **Prefill step**, KV-aware, among the workers that can prefill, under the request's own
//!    constraints (its pin is the decode worker's, so this step is unpinned).
//! 2. **Transfer constraint**: the chosen prefill worker's value for `kv_transfer_domain` becomes a
//!    required or preferred taint ([`rules::transfer_constraints`]), merged into the request's
//!    constraints ([`rules::merge_decode_topology_constraints`]).
//! 3. **Decode step**, load only (no overlap credit: the prompt arrives by transfer), among the
//!    workers that can decode, under the merged constraints.
//!
//! A bypass rule ([`config::BypassRule`]) may keep the prefill on the decode worker instead: the
//! decision is then an ordinary aggregated one among the workers that can decode. With no eligible
//! prefill worker the request routes aggregated, unless disaggregation is required (by the request
//! or `enforce`). Nothing is booked here: the caller books both halves after both steps succeeded,
//! so a failed decode step leaves nothing on the prefill worker. Each step applies the busy rule to
//! its own workers, so a busy prefill pool or a busy decode pool queues the request.

pub mod config;
pub mod rules;
#[cfg(test)]
mod tests;

use std::time::Duration;

use super::request::{invalid, Prepared};
use super::step::{Scratch, Step, StepInput};
use super::{
    DisaggMode, PrefillPlacement, RouteDecision, RouteError, Router, Stage, Timings,
    TopologyConstraints,
};
use crate::eligibility::{PinError, RoleNeed};
use crate::workers::{CandidateEntry, RegistrySnapshot};
use config::BypassRule;

/// Where a request goes, before booking.
pub(super) struct Placement {
    /// Where it decodes (the whole request when not split).
    pub(super) decode: Step,
    /// Where its prompt is computed, when split.
    pub(super) prefill: Option<Step>,
    pub(super) bypass: Option<&'static str>,
    pub(super) merged: Option<TopologyConstraints>,
    pub(super) cross_domain: Option<bool>,
}

impl Placement {
    fn whole(step: Step, bypass: Option<&'static str>) -> Self {
        Self {
            decode: step,
            prefill: None,
            bypass,
            merged: None,
            cross_domain: None,
        }
    }

    pub(super) fn into_decision(
        self,
        p: &Prepared,
        queued: Duration,
        timings: Timings,
    ) -> RouteDecision {
        let d = self.decode;
        let (candidates, excluded) = d
            .explained
            .map_or((None, None), |(c, e)| (Some(c), Some(e)));
        let prefill = self.prefill.map(|s| {
            let (candidates, excluded) = s
                .explained
                .map_or((None, None), |(c, e)| (Some(c), Some(e)));
            PrefillPlacement {
                candidate: s.candidate,
                overlap_blocks: s.overlap,
                cached_tokens: s.cached_tokens,
                policy: s.label,
                fallback_reason: s.fallback_reason,
                answer: p.req.explain.then_some(s.answer),
                candidates,
                excluded,
            }
        });
        RouteDecision {
            request_id: p.request_id.clone(),
            candidate: d.candidate,
            overlap_blocks: d.overlap,
            overlap_source: p
                .external
                .as_ref()
                .map_or(super::OverlapOrigin::Local, |e| e.origin),
            cached_tokens: d.cached_tokens,
            prompt_tokens: p.prompt_tokens,
            policy: d.label,
            fallback: d.fallback_reason.is_some(),
            fallback_reason: d.fallback_reason,
            queued,
            booked: p.req.book,
            candidates,
            excluded,
            answer: p.req.explain.then_some(d.answer),
            timings,
            disaggregated: prefill.is_some(),
            prefill,
            bypass: self.bypass,
            topology_constraints: self.merged,
            cross_domain: self.cross_domain,
        }
    }
}

impl Router {
    /// Whether this request is split: `off` never (refused when `enforce` is on), `required`
    /// always, `auto` when the fleet has prefill-role workers or `enforce` is on.
    fn splits(&self, p: &Prepared, snap: &RegistrySnapshot) -> Result<bool, RouteError> {
        let enforce = self.config.disagg.enforce;
        match p.req.disaggregation {
            DisaggMode::Off if enforce => Err(invalid(
                "disaggregation",
                "this router enforces disaggregation ([disaggregation] enforce = true): a \
                 request cannot turn it off",
            )),
            DisaggMode::Off => Ok(false),
            DisaggMode::Required => Ok(true),
            DisaggMode::Auto => Ok(enforce || snap.prefill_role_workers > 0),
        }
    }

    /// The aggregated step: KV-aware, among the workers that can decode, under the request's own
    /// constraints and pin.
    fn aggregated(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        pool: &[CandidateEntry],
        s: &mut Scratch,
    ) -> Result<Step, RouteError> {
        let constraints = self.resolve_constraints(
            &p.req.required_taints,
            p.req.allowed_worker_ids.as_deref(),
            RoleNeed::Decode,
            snap,
        );
        let input = StepInput {
            stage: Stage::Aggregated,
            pool,
            constraints: &constraints,
            required: &p.req.required_taints,
            preferred: &p.req.preferred_taints,
            pinned: p.req.pinned,
        };
        self.step(p, snap, &input, s)
    }

    /// Places a request: see the module docs. `pool` is the pinned worker's ranks when pinned.
    pub(super) fn place(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        pool: &[CandidateEntry],
        s: &mut Scratch,
    ) -> Result<Placement, RouteError> {
        if !self.splits(p, snap)? {
            return Ok(Placement::whole(self.aggregated(p, snap, pool, s)?, None));
        }
        let cfg = &self.config.disagg;
        let required = cfg.enforce || p.req.disaggregation == DisaggMode::Required;
        // isl_bounding looks at the decode worker an aggregated decision would choose: how much of
        // the prompt it lacks. That decision is also the answer when the rule holds.
        let mut agg = None;
        if cfg.bypass.uses_isl() {
            let step = self.aggregated(p, snap, pool, s)?;
            if rules::isl_bounding_holds(
                p.prompt_tokens,
                step.cached_tokens,
                cfg.bypass_max_uncached_tokens,
                cfg.bypass_max_uncached_ratio,
            ) {
                return Ok(Placement::whole(
                    step,
                    Some(BypassRule::IslBounding.as_str()),
                ));
            }
            agg = Some(step);
        }
        // 1. The prefill step.
        let constraints = self.resolve_constraints(
            &p.req.required_taints,
            p.req.allowed_worker_ids.as_deref(),
            RoleNeed::Prefill,
            snap,
        );
        let input = StepInput {
            stage: Stage::Prefill,
            pool: &snap.candidates,
            constraints: &constraints,
            required: &p.req.required_taints,
            preferred: &p.req.preferred_taints,
            pinned: None,
        };
        let prefill = match self.step(p, snap, &input, s) {
            Ok(step) => step,
            // Every prefill worker busy: loaded past any bypass line.
            Err(RouteError::AllOverloaded) if cfg.bypass.uses_load() => {
                return self.bypassed(p, snap, pool, s, agg, BypassRule::PrefillLoad);
            }
            Err(RouteError::AllFiltered { reasons, .. }) if required => {
                return Err(RouteError::NoPrefillWorker(reasons));
            }
            Err(RouteError::AllFiltered { .. }) => {
                let step = match agg {
                    Some(step) => step,
                    None => self.aggregated(p, snap, pool, s)?,
                };
                return Ok(Placement::whole(step, None));
            }
            Err(e) => return Err(e),
        };
        if let Some(max_load) = cfg
            .bypass_max_prefill_load
            .filter(|_| cfg.bypass.uses_load())
        {
            let loaded = rules::prefill_loaded(
                prefill.load.active_prefill_tokens,
                prefill.max_num_batched_tokens,
                max_load,
            );
            if loaded == Some(true) {
                return self.bypassed(p, snap, pool, s, agg, BypassRule::PrefillLoad);
            }
        }
        // 2. The transfer constraint, merged into the request's.
        let prefill_worker = &snap.workers[&prefill.candidate.worker_id];
        let transfer = rules::transfer_constraints(cfg, &prefill_worker.topology).map_err(|m| {
            RouteError::KvTransferDomainUnknown {
                worker_id: prefill.candidate.worker_id,
                domain: m.domain,
            }
        })?;
        let mut merged = TopologyConstraints {
            required_taints: p.req.required_taints.clone(),
            preferred_taints: p.req.preferred_taints.clone(),
        };
        rules::merge_decode_topology_constraints(&mut merged, &transfer);
        // 3. The decode step: load only.
        let constraints = self.resolve_constraints(
            &merged.required_taints,
            p.req.allowed_worker_ids.as_deref(),
            RoleNeed::Decode,
            snap,
        );
        let input = StepInput {
            stage: Stage::Decode,
            pool,
            constraints: &constraints,
            required: &merged.required_taints,
            preferred: &merged.preferred_taints,
            pinned: p.req.pinned,
        };
        let decode = self
            .step(p, snap, &input, s)
            .map_err(|e| self.in_domain_error(e, &transfer, snap, pool))?;
        let cross_domain = cfg.kv_transfer_domain.as_deref().and_then(|domain| {
            let from = prefill_worker.topology.get(domain)?;
            let to = snap.workers[&decode.candidate.worker_id]
                .topology
                .get(domain);
            Some(to != Some(from))
        });
        Ok(Placement {
            decode,
            prefill: Some(prefill),
            bypass: None,
            merged: Some(transfer),
            cross_domain,
        })
    }

    /// A bypass: the aggregated decision (already made, or made now) is the answer.
    fn bypassed(
        &self,
        p: &Prepared,
        snap: &RegistrySnapshot,
        pool: &[CandidateEntry],
        s: &mut Scratch,
        agg: Option<Step>,
        rule: BypassRule,
    ) -> Result<Placement, RouteError> {
        let step = match agg {
            Some(step) => step,
            None => self.aggregated(p, snap, pool, s)?,
        };
        Ok(Placement::whole(step, Some(rule.as_str())))
    }

    /// A decode step that found nobody because the transfer requires a domain no worker that can
    /// decode (in the pool) is in: `no_decode_worker_in_domain`, naming the taint. Other failures
    /// pass through.
    fn in_domain_error(
        &self,
        e: RouteError,
        transfer: &TopologyConstraints,
        snap: &RegistrySnapshot,
        pool: &[CandidateEntry],
    ) -> RouteError {
        if !matches!(
            e,
            RouteError::AllFiltered { .. } | RouteError::Pin(PinError::MissingTaints(_))
        ) {
            return e;
        }
        for taint in &transfer.required_taints {
            let id = snap.taint_id(taint);
            let anyone = pool
                .iter()
                .any(|c| c.role.can_decode() && id.is_some_and(|id| c.has_taint(id)));
            if !anyone {
                return RouteError::NoDecodeWorkerInDomain {
                    taint: taint.clone(),
                };
            }
        }
        e
    }
}
