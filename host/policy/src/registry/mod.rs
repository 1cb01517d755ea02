//! Loaded policy versions, the active pointer, and the decision entry point.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};
use kvroute_core::Stage;

use super::answer::Answer;
use super::config::PolicyRuntimeConfig;
use super::error::{FallbackReason, PolicyError};
use super::instance::Failure;
use super::pipeline::PipelineSpec;
use super::plugin::CompiledPlugin;
use super::rollout::{
    Arm, Canary, CanaryImage, CanaryRecord, CanaryReport, CanarySpec, OutcomeBatch, RequestOutcome,
    Rollout, RolloutCounters, RolloutImage, ShadowReport, ShadowSpec, Verdict,
};
use super::runtime::PolicyRuntime;
use super::wire::with_wit_decision;
use super::{DecisionContext, TaintTable};

mod image;
mod load;
mod rollout;
pub(crate) mod version;

pub use image::{Checkpoint, RegistryImage, VersionImage};
use version::Source;
pub use version::{ActivePolicy, Outcome, PolicyDecision, PolicyInfo, PolicyVersion, StageInfo};

/// Why a policy was taken out.
#[derive(Clone, Copy, Debug)]
enum Cause {
    /// This many failed decisions in a row.
    Consecutive(u32),
    /// `failed` of the last `window` decisions failed.
    Rate { failed: usize, window: usize },
}

/// Registry-wide counters.
#[derive(Debug, Default)]
pub struct RegistryCounters {
    /// Times the active policy was taken out after too many failures (either rule).
    pub auto_restores: AtomicU64,
    /// Of those, the times for its failure rate over the window (`max_failure_rate`).
    pub auto_restores_failure_rate: AtomicU64,
    /// Successful swaps of the active pointer (any cause).
    pub activations: AtomicU64,
    /// Files from the watched directory loaded.
    pub watch_loaded: AtomicU64,
    /// Files from the watched directory refused (the current policy kept serving).
    pub watch_rejected: AtomicU64,
}

struct State {
    policies: BTreeMap<String, Arc<PolicyVersion>>,
    /// Previously active versions, most recent last.
    history: Vec<Arc<PolicyVersion>>,
    versions: HashMap<String, u64>,
    next_activation: u64,
}

/// The set of loaded policies and the active one; the router's entry point is [`Self::decide`].
///
/// All administrative operations (load, configure, activate, rollback, remove) are serialised and
/// run on the caller's thread, off the request path; `decide` never waits for them.
pub struct PolicyRegistry {
    runtime: PolicyRuntime,
    active: ArcSwapOption<ActivePolicy>,
    state: Mutex<State>,
    /// Serialises administrative operations (held while compiling and self-testing).
    admin: Mutex<()>,
    /// The last taint table seen by `decide`, to prime new instances with it.
    last_taints: ArcSwapOption<TaintTable>,
    /// The block size of the last decision, for the same purpose.
    last_block_size: AtomicU32,
    /// Compiled components by digest, so the same bytes are compiled once while any version uses them.
    compiled: Mutex<HashMap<String, std::sync::Weak<CompiledPlugin>>>,
    counters: RegistryCounters,
    /// Shadows and the canary (`rollout.rs`).
    rollout: Rollout,
}

/// Checks a policy name: 1 to 64 of `[A-Za-z0-9_.-]`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<(), PolicyError> {
    // `rollback` would be shadowed by `POST /v1/policies/rollback` in the HTTP API: such a
    // policy could be loaded from a file but never updated or removed over HTTP.
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name != "rollback"
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(PolicyError::InvalidName(name.to_string()))
    }
}

/// Validates configuration JSON; `None` becomes `{}`.
fn normalize_config(config: Option<&str>) -> Result<String, PolicyError> {
    match config {
        None => Ok("{}".to_string()),
        Some(s) if s.trim().is_empty() => Ok("{}".to_string()),
        Some(s) => {
            serde_json::from_str::<serde_json::Value>(s)
                .map_err(|e| PolicyError::InvalidConfigJson(e.to_string()))?;
            Ok(s.to_string())
        }
    }
}

/// How a new version is built.
enum Build {
    Component {
        plugin: Arc<CompiledPlugin>,
        config: String,
    },
    Pipeline {
        spec: PipelineSpec,
        base_dir: Option<PathBuf>,
    },
}

impl PolicyRegistry {
    /// A registry with its own engine, epoch ticker and maintenance thread (stopped on drop).
    pub fn new(config: PolicyRuntimeConfig) -> Result<Self, PolicyError> {
        Ok(Self {
            runtime: PolicyRuntime::new(config)?,
            active: ArcSwapOption::empty(),
            state: Mutex::new(State {
                policies: BTreeMap::new(),
                history: Vec::new(),
                versions: HashMap::new(),
                next_activation: 0,
            }),
            admin: Mutex::new(()),
            last_taints: ArcSwapOption::empty(),
            last_block_size: AtomicU32::new(16),
            compiled: Mutex::new(HashMap::new()),
            counters: RegistryCounters::default(),
            rollout: Rollout::default(),
        })
    }

    /// The runtime configuration in force.
    pub fn config(&self) -> &PolicyRuntimeConfig {
        &self.runtime.shared.config
    }

    pub fn counters(&self) -> &RegistryCounters {
        &self.counters
    }

    // ---------------------------------------------------------------- request path

    /// Whether the next decision needs the columns' `base_cost` (the host's native cost): the
    /// active version, a running canary's candidate or a shadow reads it (as their instances'
    /// `configure` answered, interface 0.10.0), or no policy is active (the native cost decides).
    /// A decision whose columns come without it answers [`Outcome::NeedsBaseCost`] if a version
    /// that reads it took over meanwhile.
    pub fn reads_base_cost(&self) -> bool {
        let active = self.active.load();
        let Some(active) = active.as_ref() else {
            return true;
        };
        active.policy.reads_base_cost()
            || self
                .rollout
                .canary
                .load()
                .as_ref()
                .is_some_and(|c| c.candidate.reads_base_cost())
            || self
                .rollout
                .shadows
                .load()
                .iter()
                .any(|s| s.version().reads_base_cost())
    }

    /// Asks the active policy to rank `cols` (base costs filled by the router when
    /// [`PolicyRegistry::reads_base_cost`] says so) for an aggregated (one-step) decision:
    /// [`PolicyRegistry::decide_at`] at [`Stage::Aggregated`].
    pub fn decide(
        &self,
        req: &PolicyRequest,
        cols: &CandidateColumns,
        taints: &TaintTable,
    ) -> PolicyDecision {
        self.decide_at(req, cols, taints, Stage::Aggregated)
    }

    /// Asks the active policy to rank `cols` at `stage` (which half of a disaggregated decision,
    /// or an aggregated one; the policy reads it in the request's flags).
    ///
    /// Never fails: any problem is an [`Outcome::Fallback`], and the router uses the native cost.
    /// Loads the active pointer once, so the whole decision runs on one version.
    pub fn decide_at(
        &self,
        req: &PolicyRequest,
        cols: &CandidateColumns,
        taints: &TaintTable,
        stage: Stage,
    ) -> PolicyDecision {
        let Some(active) = self.active.load_full() else {
            return PolicyDecision {
                outcome: Outcome::Fallback(FallbackReason::NoPolicy),
                policy: None,
                activation: 0,
            };
        };
        if cols.is_empty() {
            return PolicyDecision {
                outcome: Outcome::Costs(Vec::new()),
                policy: Some(active.policy.clone()),
                activation: active.activation,
            };
        }
        if !columns_consistent(cols) {
            tracing::error!(
                candidates = cols.len(),
                "candidate columns of different lengths passed to the policy runtime (a router bug)"
            );
            return PolicyDecision {
                outcome: Outcome::Fallback(FallbackReason::InvalidColumns),
                policy: Some(active.policy.clone()),
                activation: active.activation,
            };
        }
        self.remember_taints(taints);
        if self.last_block_size.load(Relaxed) != req.block_size {
            self.last_block_size.store(req.block_size, Relaxed);
        }
        // A running canary whose control is the active version sends its arm's decisions to
        // the candidate.
        let canary_guard = self.rollout.canary.load();
        let canary: Option<&Arc<Canary>> = (*canary_guard)
            .as_ref()
            .filter(|c| Arc::ptr_eq(&c.control, &active.policy) && !Rollout::is_ended(c));
        let arm = canary.map(|c| c.arm_of(req));
        let policy = match (canary, arm) {
            (Some(c), Some(Arm::Candidate)) => &c.candidate,
            _ => &active.policy,
        };
        if cols.base_cost.is_empty() && policy.reads_base_cost() {
            return PolicyDecision {
                outcome: Outcome::NeedsBaseCost,
                policy: Some(policy.clone()),
                activation: active.activation,
            };
        }
        let ctx = DecisionContext {
            taints,
            block_size: req.block_size,
        };
        let ticks = self.runtime.shared.deadline_ticks;
        let has_base_cost = cols.base_cost.len() == cols.len();
        // The shadows are offered the decision in the wire form the policy was called with,
        // while it is still in the calling thread's buffer (and cache).
        let outcome = with_wit_decision(req, cols, stage, |wreq, wcands| {
            let start = Instant::now();
            let result = policy.run(wreq, wcands, ctx, ticks, false);
            let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let outcome = self.account(&active, policy, canary, arm, result, nanos);
            self.rollout.offer(
                policy,
                wreq,
                wcands,
                has_base_cost,
                &self.last_taints,
                taints,
                req.block_size,
                &outcome,
                ticks,
            );
            outcome
        });
        let outcome = match outcome {
            Ok(Answer::Costs(c)) => Outcome::Costs(c),
            Ok(Answer::Pick(i)) => Outcome::Pick(i),
            Err(reason) => Outcome::Fallback(reason),
        };
        PolicyDecision {
            outcome,
            policy: Some(policy.clone()),
            activation: active.activation,
        }
    }

    /// Counts a decision's result against `policy` (and the canary's arm): its latency, the
    /// failure streak and rate that take a policy out, the canary's decisions and fallbacks.
    fn account(
        &self,
        active: &Arc<ActivePolicy>,
        policy: &Arc<PolicyVersion>,
        canary: Option<&Arc<Canary>>,
        arm: Option<Arm>,
        result: Result<Answer, Failure>,
        nanos: u64,
    ) -> Result<Answer, FallbackReason> {
        match result {
            Ok(answer) => {
                policy.stats.record_ok(nanos);
                if policy.consecutive_failures.load(Relaxed) != 0 {
                    policy.consecutive_failures.store(0, Relaxed);
                }
                policy.recent.record(false);
                if let (Some(c), Some(arm)) = (canary, arm) {
                    c.count_decision(arm, false);
                    if arm == Arm::Candidate && c.consecutive.load(Relaxed) != 0 {
                        c.consecutive.store(0, Relaxed);
                    }
                }
                Ok(answer)
            }
            Err(failure) => {
                policy.stats.record_failure(failure.reason, nanos);
                tracing::debug!(
                    policy = policy.name(),
                    version = policy.version,
                    reason = failure.reason.as_str(),
                    detail = %failure.detail,
                    "policy decision fell back to the native cost"
                );
                // One line (no backtrace): this runs on the request path of every fallback.
                let last = format!("{}: {}", failure.reason.as_str(), failure.detail.short());
                *policy.last_failure.lock() = Some(last);
                match (canary, arm) {
                    // The candidate's failures are the canary's business: its guardrails roll it
                    // back; they never take the active version out.
                    (Some(c), Some(Arm::Candidate)) => {
                        self.candidate_failed(c, failure.counts);
                    }
                    (c, _) => {
                        if let Some(c) = c {
                            c.count_decision(Arm::Control, true);
                        }
                        if failure.counts {
                            let n = policy.consecutive_failures.fetch_add(1, Relaxed) + 1;
                            let (failed, full) = policy.recent.record(true);
                            let config = self.config();
                            let window = config.failure_window as usize;
                            if n >= config.max_consecutive_failures {
                                self.auto_restore(active, failure.reason, Cause::Consecutive(n));
                            } else if full
                                && failed as f64 > config.max_failure_rate * window as f64
                            {
                                self.auto_restore(
                                    active,
                                    failure.reason,
                                    Cause::Rate { failed, window },
                                );
                            }
                        }
                    }
                }
                Err(failure.reason)
            }
        }
    }

    /// A candidate decision of the canary `c` fell back: counted, and judged by the fallback-rate
    /// guardrail and by `max_consecutive_failures`.
    fn candidate_failed(&self, c: &Arc<Canary>, counts: bool) {
        let (decisions, fallbacks) = c.count_decision(Arm::Candidate, true);
        let mut verdict = c.decision_verdict(decisions, fallbacks);
        if counts {
            let n = c.consecutive.fetch_add(1, Relaxed) + 1;
            if verdict.is_none() && n >= self.config().max_consecutive_failures {
                verdict = Some(Verdict::RollBack(
                    "consecutive_failures",
                    format!("the candidate failed {n} decisions in a row"),
                ));
            }
        }
        if let Some(Verdict::RollBack(rule, reason)) = verdict {
            self.roll_back_canary(c, rule, reason, None);
        }
    }

    /// Ends the canary `c` by a guardrail: every decision goes to the active version again.
    fn roll_back_canary(
        &self,
        c: &Arc<Canary>,
        rule: &'static str,
        reason: String,
        evidence: Option<CanaryReport>,
    ) {
        if self
            .rollout
            .end(c, "rolled_back", rule, reason.clone(), evidence)
            .is_some()
        {
            self.rollout.counters.rollbacks.fetch_add(1, Relaxed);
            tracing::warn!(
                policy = c.candidate().name(),
                version = c.candidate().version(),
                control = c.control().name(),
                control_version = c.control().version(),
                rule,
                reason,
                "canary rolled back by a guardrail: the active version serves every decision"
            );
        }
    }

    fn remember_taints(&self, taints: &TaintTable) {
        let known = self.last_taints.load();
        if known.as_ref().map(|t| t.version) != Some(taints.version) {
            self.last_taints.store(Some(Arc::new(taints.clone())));
        }
    }

    /// Takes `failed` out after too many failures, restoring the previous version.
    fn auto_restore(&self, failed: &Arc<ActivePolicy>, reason: FallbackReason, cause: Cause) {
        let mut state = self.state.lock();
        let still_active = self
            .active
            .load()
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(a, failed));
        if !still_active {
            return; // Another thread restored it already, or an operator swapped.
        }
        failed.policy.consecutive_failures.store(0, Relaxed);
        failed.policy.recent.clear();
        self.counters.auto_restores.fetch_add(1, Relaxed);
        let why = match cause {
            Cause::Consecutive(n) => format!("{n} failed decisions in a row"),
            Cause::Rate { failed, window } => {
                self.counters
                    .auto_restores_failure_rate
                    .fetch_add(1, Relaxed);
                format!(
                    "{failed} of the last {window} decisions failed, over max_failure_rate {}",
                    self.config().max_failure_rate
                )
            }
        };
        let previous = state.history.pop();
        match &previous {
            Some(prev) => tracing::warn!(
                policy = failed.policy.name(),
                version = failed.policy.version,
                cause = why,
                last_reason = reason.as_str(),
                last_failure = failed.policy.last_failure().unwrap_or_default(),
                restored = prev.name(),
                restored_version = prev.version,
                "policy failed too many decisions: restored the previously active version"
            ),
            None => tracing::warn!(
                policy = failed.policy.name(),
                version = failed.policy.version,
                cause = why,
                last_reason = reason.as_str(),
                last_failure = failed.policy.last_failure().unwrap_or_default(),
                "policy failed too many decisions: deactivated; the native cost serves"
            ),
        }
        self.set_active(&mut state, previous, false);
    }

    // ---------------------------------------------------------------- administration

    /// Reconfigures `name`: a new version with the same code and `config_json` (for a pipeline:
    /// a new [`PipelineSpec`] as JSON), swapped in atomically if `name` is active. A configuration
    /// the component rejects leaves everything as it was ([`PolicyError::ConfigRejected`] carries
    /// the component's message verbatim).
    pub fn configure(&self, name: &str, config_json: &str) -> Result<PolicyInfo, PolicyError> {
        let _admin = self.admin.lock();
        let current = self
            .get(name)
            .ok_or_else(|| PolicyError::UnknownPolicy(name.to_string()))?;
        let build = match &current.source {
            Source::Component { plugin } => Build::Component {
                plugin: plugin.clone(),
                config: normalize_config(Some(config_json))?,
            },
            Source::Pipeline { base_dir, .. } => Build::Pipeline {
                spec: PipelineSpec::from_json(config_json)?,
                base_dir: base_dir.clone(),
            },
        };
        self.install(name, build, false)
    }

    /// Makes the current version of `name` active (the previously active one can be rolled back to).
    pub fn activate(&self, name: &str) -> Result<PolicyInfo, PolicyError> {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        let version = state
            .policies
            .get(name)
            .cloned()
            .ok_or_else(|| PolicyError::UnknownPolicy(name.to_string()))?;
        let already = self
            .active
            .load()
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(&a.policy, &version));
        if !already {
            self.set_active(&mut state, Some(version.clone()), true);
            tracing::info!(policy = name, version = version.version, "policy activated");
        }
        Ok(version.info(true))
    }

    /// Restores the previously active version (repeatable, up to `rollback_depth` back).
    pub fn rollback(&self) -> Result<PolicyInfo, PolicyError> {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        let previous = state.history.pop().ok_or(PolicyError::NoPrevious)?;
        self.set_active(&mut state, Some(previous.clone()), false);
        tracing::info!(
            policy = previous.name(),
            version = previous.version,
            "policy rolled back: the previously active version serves"
        );
        Ok(previous.info(true))
    }

    /// Deactivates any policy: the native cost serves (the active one can be rolled back to).
    pub fn deactivate(&self) {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        if self.active.load().is_some() {
            self.set_active(&mut state, None, true);
        }
    }

    /// Unloads `name` (every version of it). Refused for the active policy.
    pub fn remove(&self, name: &str) -> Result<(), PolicyError> {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        if self
            .active
            .load()
            .as_ref()
            .is_some_and(|a| &*a.policy.name == name)
        {
            return Err(PolicyError::ActivePolicy(name.to_string()));
        }
        if state.policies.remove(name).is_none() {
            return Err(PolicyError::UnknownPolicy(name.to_string()));
        }
        state.history.retain(|p| &*p.name != name);
        tracing::info!(policy = name, "policy removed");
        Ok(())
    }

    /// The loaded policies (current version of each name, plus the active version if it is an
    /// older version of its name), by name.
    pub fn list(&self) -> Vec<PolicyInfo> {
        let state = self.state.lock();
        let active = self.active.load_full();
        let is_active =
            |p: &Arc<PolicyVersion>| active.as_ref().is_some_and(|a| Arc::ptr_eq(&a.policy, p));
        let mut out: Vec<PolicyInfo> = state
            .policies
            .values()
            .map(|p| p.info(is_active(p)))
            .collect();
        if let Some(a) = &active {
            if !state.policies.values().any(|p| Arc::ptr_eq(p, &a.policy)) {
                out.push(a.policy.info(true));
            }
        }
        out
    }

    /// The version [`Self::rollback`] would restore now (the most recently replaced active one).
    pub fn rollback_target(&self) -> Option<Arc<PolicyVersion>> {
        self.state.lock().history.last().cloned()
    }

    /// Every loaded version of `name` (its current one, the active one and the ones rollback can
    /// restore), by version; empty when none is loaded.
    pub fn versions(&self, name: &str) -> Vec<Arc<PolicyVersion>> {
        let state = self.state.lock();
        let active = self.active.load_full().map(|a| a.policy.clone());
        let mut out: Vec<Arc<PolicyVersion>> = state
            .policies
            .get(name)
            .cloned()
            .into_iter()
            .chain(active)
            .chain(state.history.iter().cloned())
            .filter(|p| &*p.name == name)
            .collect();
        out.sort_by_key(|p| p.version);
        out.dedup_by_key(|p| p.version);
        out
    }

    /// Whether the epoch ticker is parked: no guest call has run for a while (see
    /// `policy/ticker.rs`). For operators' diagnostics and the runtime's tests.
    pub fn epoch_ticker_parked(&self) -> bool {
        self.runtime.shared.activity.is_parked()
    }

    /// The active version and its activation number.
    pub fn active(&self) -> Option<Arc<ActivePolicy>> {
        self.active.load_full()
    }

    /// The active version's description.
    pub fn active_info(&self) -> Option<PolicyInfo> {
        self.active.load_full().map(|a| a.policy.info(true))
    }

    /// The current version of `name`.
    pub fn get(&self, name: &str) -> Option<Arc<PolicyVersion>> {
        self.state.lock().policies.get(name).cloned()
    }

    /// Swaps the active pointer (caller holds the state lock).
    fn set_active(
        &self,
        state: &mut State,
        policy: Option<Arc<PolicyVersion>>,
        push_history: bool,
    ) {
        state.next_activation += 1;
        let new = policy.map(|policy| {
            Arc::new(ActivePolicy {
                policy,
                activation: state.next_activation,
            })
        });
        // A canary compares against the version active when it started: another activation ends it.
        if let Some(c) = self.rollout.canary.load_full() {
            let same = new
                .as_ref()
                .is_some_and(|n| Arc::ptr_eq(&n.policy, c.control()));
            if !same {
                self.rollout.end(
                    &c,
                    "superseded",
                    "activation",
                    "another version was activated while the canary ran".into(),
                    None,
                );
            }
        }
        let old = self.active.swap(new);
        self.counters.activations.fetch_add(1, Relaxed);
        if push_history {
            if let Some(old) = old {
                state.history.push(old.policy.clone());
                let depth = self.config().rollback_depth;
                if state.history.len() > depth {
                    let excess = state.history.len() - depth;
                    state.history.drain(..excess);
                }
            }
        }
    }
}

/// Whether every column has one entry per candidate and the taint offsets frame `taint_ids`.
/// (Offsets are not checked for monotonicity: that is O(n), and a guest slicing with bad offsets
/// traps, which falls back.)
fn columns_consistent(c: &CandidateColumns) -> bool {
    let n = c.len();
    [
        c.dp_rank.len(),
        c.device_overlap.len(),
        c.host_overlap.len(),
        c.disk_overlap.len(),
        c.active_prefill_tokens.len(),
        c.active_decode_blocks.len(),
        c.active_requests.len(),
        c.active_prompt_blocks.len(),
        c.total_kv_blocks.len(),
        c.max_num_batched_tokens.len(),
    ]
    .iter()
    .all(|&l| l == n)
        // Left empty when nothing reads it (`reads_base_cost`).
        && (c.base_cost.len() == n || c.base_cost.is_empty())
        && c.taint_offsets.len() == n + 1
        && c.taint_offsets.first() == Some(&0)
        && c.taint_offsets.last().map(|&l| l as usize) == Some(c.taint_ids.len())
}

#[cfg(test)]
mod tests;
