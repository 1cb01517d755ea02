//! The registry's rollout operations: shadows, the canary, promotion and the data path's outcomes.

use super::*;

impl PolicyRegistry {
    /// The version `version` of `name` (default: its current one) among those loaded.
    fn rollout_version(
        &self,
        name: &str,
        version: Option<u64>,
    ) -> Result<Arc<PolicyVersion>, PolicyError> {
        validate_name(name)?;
        let versions = self.versions(name);
        if versions.is_empty() {
            return Err(PolicyError::UnknownPolicy(name.to_string()));
        }
        match version {
            None => self
                .get(name)
                .ok_or_else(|| PolicyError::UnknownPolicy(name.to_string())),
            Some(v) => versions
                .into_iter()
                .find(|p| p.version == v)
                .ok_or_else(|| PolicyError::InvalidRollout {
                    field: "version".into(),
                    message: format!(
                        "policy {name:?} has no loaded version {v} (GET /v1/policies/{name} lists them)"
                    ),
                }),
        }
    }

    fn is_active(&self, v: &Arc<PolicyVersion>) -> bool {
        self.active
            .load()
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(&a.policy, v))
    }

    /// Starts (or replaces) the shadow of `name`: a loaded, non-active version evaluated beside
    /// the active one on a sample of decisions, off the request path.
    pub fn start_shadow(&self, name: &str, spec: &ShadowSpec) -> Result<ShadowReport, PolicyError> {
        spec.validate()?;
        let _admin = self.admin.lock();
        let version = self.rollout_version(name, spec.version)?;
        if self.is_active(&version) {
            return Err(PolicyError::InvalidRollout {
                field: "version".into(),
                message: format!(
                    "version {} of {name:?} is the active version: a shadow runs a version that is not active",
                    version.version
                ),
            });
        }
        let shadow = self.rollout.new_shadow(version.clone(), spec.sample);
        let report = shadow.report();
        self.rollout.held_shadows.lock().retain(|s| s.name != name);
        self.rollout.shadows.rcu(|list| {
            let mut list: Vec<_> = list
                .iter()
                .filter(|s| s.version().name() != name)
                .cloned()
                .collect();
            list.push(shadow.clone());
            list
        });
        tracing::info!(
            policy = name,
            version = version.version,
            sample = spec.sample,
            "shadow started"
        );
        Ok(report)
    }

    /// Stops the shadow of `name`; its last figures.
    pub fn stop_shadow(&self, name: &str) -> Result<ShadowReport, PolicyError> {
        let _admin = self.admin.lock();
        let mut found = None;
        self.rollout.shadows.rcu(|list| {
            found = list.iter().find(|s| s.version().name() == name).cloned();
            list.iter()
                .filter(|s| s.version().name() != name)
                .cloned()
                .collect::<Vec<_>>()
        });
        let shadow = found.ok_or_else(|| PolicyError::NoRollout {
            name: name.to_string(),
            what: "shadow",
        })?;
        self.rollout.forget_shadows();
        tracing::info!(
            policy = name,
            version = shadow.version().version,
            "shadow stopped"
        );
        Ok(shadow.report())
    }

    /// The figures of the shadow of `name`, if one runs.
    pub fn shadow_report(&self, name: &str) -> Option<ShadowReport> {
        self.rollout
            .shadows
            .load()
            .iter()
            .find(|s| s.version().name() == name)
            .map(|s| s.report())
    }

    /// Every running shadow's figures.
    pub fn shadow_reports(&self) -> Vec<ShadowReport> {
        self.rollout
            .shadows
            .load()
            .iter()
            .map(|s| s.report())
            .collect()
    }

    /// Starts a canary of `name` against the active version. One canary at a time.
    pub fn start_canary(&self, name: &str, spec: &CanarySpec) -> Result<CanaryReport, PolicyError> {
        spec.validate()?;
        let _admin = self.admin.lock();
        let candidate = self.rollout_version(name, spec.version)?;
        let _state = self.state.lock();
        let active = self.active.load_full().ok_or_else(|| {
            PolicyError::RolloutConflict(
                "no policy is active: a canary compares a candidate with the active version; activate one first"
                    .into(),
            )
        })?;
        if Arc::ptr_eq(&active.policy, &candidate) {
            return Err(PolicyError::InvalidRollout {
                field: "version".into(),
                message: format!(
                    "version {} of {name:?} is the active version: a canary runs a version that is not active",
                    candidate.version
                ),
            });
        }
        if let Some(c) = self.rollout.canary.load_full() {
            return Err(PolicyError::RolloutConflict(format!(
                "a canary of {:?} version {} is running: stop it (DELETE /v1/policies/{}/canary) or promote it first",
                c.candidate().name(),
                c.candidate().version,
                c.candidate().name()
            )));
        }
        let canary =
            self.rollout
                .new_canary(candidate.clone(), active.policy.clone(), spec.clone());
        let report = canary.report();
        self.rollout.canary.store(Some(canary));
        self.rollout.counters.canaries_started.fetch_add(1, Relaxed);
        tracing::info!(
            policy = name,
            version = candidate.version,
            control = active.policy.name(),
            control_version = active.policy.version,
            fraction = spec.fraction,
            "canary started"
        );
        Ok(report)
    }

    fn running_canary(&self, name: &str) -> Result<Arc<Canary>, PolicyError> {
        self.rollout
            .canary
            .load_full()
            .filter(|c| c.candidate().name() == name)
            .ok_or_else(|| PolicyError::NoRollout {
                name: name.to_string(),
                what: "canary",
            })
    }

    /// Stops the canary of `name` by hand (the active version takes every decision again).
    pub fn stop_canary(&self, name: &str) -> Result<CanaryRecord, PolicyError> {
        let _admin = self.admin.lock();
        let c = self.running_canary(name)?;
        let record = self
            .rollout
            .end(
                &c,
                "stopped",
                "manual",
                "stopped by an operator".into(),
                None,
            )
            .ok_or_else(|| PolicyError::NoRollout {
                name: name.to_string(),
                what: "canary",
            })?;
        tracing::info!(
            policy = name,
            version = c.candidate().version,
            "canary stopped"
        );
        Ok(record)
    }

    /// Promotes the canary of `name`: its candidate becomes the active version (the previous one
    /// can be rolled back to).
    pub fn promote(&self, name: &str) -> Result<PolicyInfo, PolicyError> {
        let _admin = self.admin.lock();
        let c = self.running_canary(name)?;
        self.promote_canary(&c, "manual", "promoted by an operator".into(), None)
            .ok_or_else(|| PolicyError::NoRollout {
                name: name.to_string(),
                what: "canary",
            })
    }

    fn promote_canary(
        &self,
        c: &Arc<Canary>,
        rule: &'static str,
        reason: String,
        evidence: Option<CanaryReport>,
    ) -> Option<PolicyInfo> {
        let mut state = self.state.lock();
        if !self.is_active(c.control()) {
            return None;
        }
        self.rollout
            .end(c, "promoted", rule, reason.clone(), evidence)?;
        self.set_active(&mut state, Some(c.candidate().clone()), true);
        self.rollout.counters.promotions.fetch_add(1, Relaxed);
        if rule != "manual" {
            self.rollout.counters.auto_promotions.fetch_add(1, Relaxed);
        }
        tracing::info!(
            policy = c.candidate().name(),
            version = c.candidate().version,
            replaced = c.control().name(),
            replaced_version = c.control().version,
            rule,
            reason,
            "canary promoted: the candidate is the active version"
        );
        Some(c.candidate().info(true))
    }

    /// The running canary of `name` (if any) and the records of its ended ones, oldest first.
    pub fn canary_report(&self, name: &str) -> (Option<CanaryReport>, Vec<CanaryRecord>) {
        let live = self
            .rollout
            .canary
            .load_full()
            .filter(|c| c.candidate().name() == name)
            .map(|c| c.report());
        let records = self
            .rollout
            .records
            .lock()
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .collect();
        (live, records)
    }

    /// The running canary's report, whichever policy it is of.
    pub fn running_canary_report(&self) -> Option<CanaryReport> {
        self.rollout.canary.load_full().map(|c| c.report())
    }

    pub fn rollout_counters(&self) -> &RolloutCounters {
        &self.rollout.counters
    }

    /// Cluster mode: canaries started from now on keep their outcomes for
    /// [`Self::take_outcome_batch`] (the other replicas merge them).
    pub fn set_shared_rollout(&self, on: bool) {
        self.rollout.share.store(on, Relaxed);
    }

    /// The rollout state as a state store keeps it: the shadows' and the canary's specs, and the
    /// ended canaries' records.
    pub fn rollout_image(&self) -> RolloutImage {
        self.rollout.image()
    }

    /// Makes the rollout state what `image` says (at start, from a state store, or another
    /// replica's change): shadows started or stopped, the canary started with its stored id and
    /// start time (a running one with the same id keeps its figures) or ended, the records
    /// replaced. A shadow or canary whose versions are not loaded here (or whose control is not
    /// the active version) is logged and not run; the canary is kept in the image all the same,
    /// so this replica does not end it for the others. Returns whether anything changed.
    pub fn set_rollout(&self, image: &RolloutImage) -> bool {
        let _admin = self.admin.lock();
        let before = self.rollout.image();
        if before == *image {
            return false;
        }
        // Shadows: the same (name, version, sample) keeps running with its figures.
        let current = self.rollout.shadows.load_full();
        let mut shadows = Vec::new();
        let mut held = Vec::new();
        for si in &image.shadows {
            let same = current.iter().find(|s| {
                s.version().name() == si.name
                    && s.version().version() == si.version
                    && s.report().sample == si.sample
            });
            match same {
                Some(s) => shadows.push(s.clone()),
                None => match self.rollout_version(&si.name, Some(si.version)) {
                    Ok(v) => shadows.push(self.rollout.new_shadow_at(
                        v,
                        si.sample,
                        std::time::SystemTime::UNIX_EPOCH
                            + std::time::Duration::from_millis(si.started_at_ms),
                    )),
                    Err(e) => {
                        tracing::warn!(
                            policy = %si.name,
                            version = si.version,
                            error = %e,
                            "a shared shadow is not loaded here: not run on this replica"
                        );
                        held.push(si.clone());
                    }
                },
            }
        }
        self.rollout.shadows.store(Arc::new(shadows));
        *self.rollout.held_shadows.lock() = held;
        self.rollout.forget_shadows();
        // The canary.
        let running = self.rollout.canary.load_full();
        let keep = matches!((&running, &image.canary), (Some(r), Some(ci)) if r.id() == ci.id);
        if !keep {
            if let Some(r) = &running {
                // Ended elsewhere (its record comes with the image) or replaced.
                if !Rollout::is_ended(r) {
                    self.rollout.end_quietly(r);
                }
            }
            *self.rollout.held.lock() = None;
            if let Some(ci) = &image.canary {
                match self.canary_of(ci) {
                    Ok((candidate, control)) => {
                        let c = self.rollout.canary_with(
                            ci.id,
                            candidate,
                            control,
                            ci.spec.clone(),
                            std::time::SystemTime::UNIX_EPOCH
                                + std::time::Duration::from_millis(ci.started_at_ms),
                        );
                        self.rollout.canary.store(Some(c));
                        tracing::info!(
                            policy = %ci.name,
                            version = ci.version,
                            id = ci.id,
                            fraction = ci.spec.fraction,
                            "canary taken up from the shared state"
                        );
                    }
                    Err(e) => {
                        tracing::error!(
                            policy = %ci.name,
                            version = ci.version,
                            error = %e,
                            "the shared canary cannot run on this replica: its sessions are routed by the active version here"
                        );
                        *self.rollout.held.lock() = Some(ci.clone());
                    }
                }
            }
        }
        {
            let mut records = self.rollout.records.lock();
            *records = image
                .records
                .iter()
                .map(|r| (r.evidence.policy.clone(), r.clone()))
                .collect();
            if let Some(max) = image.records.iter().map(|r| r.evidence.id).max() {
                self.rollout.next_id.fetch_max(max + 1, Relaxed);
            }
        }
        true
    }

    /// The candidate and control versions of a stored canary, if this replica holds them and the
    /// control is the active version.
    fn canary_of(
        &self,
        ci: &CanaryImage,
    ) -> Result<(Arc<PolicyVersion>, Arc<PolicyVersion>), PolicyError> {
        let candidate = self.rollout_version(&ci.name, Some(ci.version))?;
        let active = self.active.load_full();
        match active {
            Some(a)
                if a.policy.name() == ci.control && a.policy.version() == ci.control_version =>
            {
                Ok((candidate, a.policy.clone()))
            }
            _ => Err(PolicyError::RolloutConflict(format!(
                "its control {} v{} is not the active version here",
                ci.control, ci.control_version
            ))),
        }
    }

    /// Undoes this replica's promotion recorded by `record` when the shared state says the canary
    /// ended otherwise (another replica's rollback was written first): the control is active
    /// again, as it is everywhere else.
    pub fn undo_promotion(&self, record: &CanaryRecord) {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        let ev = &record.evidence;
        let active = self.active.load_full();
        let promoted = active
            .as_ref()
            .is_some_and(|a| a.policy.name() == ev.policy && a.policy.version() == ev.version);
        let control = state
            .history
            .last()
            .cloned()
            .filter(|c| c.name() == ev.control.policy && c.version() == ev.control.version);
        if let (true, Some(control)) = (promoted, control) {
            state.history.pop();
            self.set_active(&mut state, Some(control), false);
            tracing::warn!(
                policy = %ev.policy,
                version = ev.version,
                "this replica's promotion lost to another replica's decision on the same canary: undone"
            );
        }
    }

    /// This replica's new outcomes of the running canary since the last call (cluster mode), for
    /// the other replicas.
    pub fn take_outcome_batch(&self) -> Option<OutcomeBatch> {
        let c = self.rollout.canary.load_full()?;
        if Rollout::is_ended(&c) {
            return None;
        }
        c.take_batch()
    }

    /// Notes that this replica's outcome message `seq` carried `batch` (it is then part of
    /// [`Self::published_snapshot`]).
    pub fn note_published(&self, seq: u64, batch: &OutcomeBatch) {
        if let Some(c) = self.rollout.canary.load_full() {
            if c.id() == batch.canary {
                c.note_published(seq, batch);
            }
        }
    }

    /// The running canary's outcomes this replica published so far, whole, with the last
    /// message's number, if they changed since the last call: what a replica that takes the
    /// canary up later merges first.
    pub fn published_snapshot(&self) -> Option<(u64, OutcomeBatch)> {
        let c = self.rollout.canary.load_full()?;
        if Rollout::is_ended(&c) {
            return None;
        }
        c.published_snapshot()
    }

    /// The running canary's id.
    pub fn running_canary_id(&self) -> Option<u64> {
        self.rollout
            .canary
            .load_full()
            .filter(|c| !Rollout::is_ended(c))
            .map(|c| c.id())
    }

    /// Merges another replica's outcome batch into the running canary (same id) and judges its
    /// guardrails on every replica's figures, which may roll it back or promote it here. False
    /// when no canary of that id runs here.
    pub fn merge_outcome_batch(&self, batch: &OutcomeBatch) -> bool {
        let Some(c) = self.rollout.canary.load_full() else {
            return false;
        };
        if c.id() != batch.canary || Rollout::is_ended(&c) {
            return false;
        }
        if let Some((verdict, evidence)) = c.merge(batch) {
            self.act_on(&c, verdict, evidence);
        }
        true
    }

    fn act_on(&self, canary: &Arc<Canary>, verdict: Verdict, evidence: CanaryReport) {
        match verdict {
            Verdict::RollBack(rule, reason) => {
                self.roll_back_canary(canary, rule, reason, Some(evidence))
            }
            Verdict::Promote(reason) => {
                self.promote_canary(canary, "auto_promote", reason, Some(evidence));
            }
        }
    }

    /// What the data path learned about a request routed by `policy` version `version`: counted
    /// in the running canary's arm of that version (if any), and judged by its guardrails, which
    /// may roll it back or promote it here. Cheap when no canary runs.
    pub fn record_outcome(&self, policy: &str, version: u64, outcome: &RequestOutcome) {
        let Some((canary, verdict, evidence)) = self.rollout.record(policy, version, outcome)
        else {
            return;
        };
        self.act_on(&canary, verdict, evidence);
    }
}
