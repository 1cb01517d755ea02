//! Loaded policy versions, the active pointer, and the decision entry point.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use serde::Serialize;

use kvroute_core::candidate::{CandidateColumns, PolicyRequest};

use super::answer::Answer;
use super::bindings::kvroute::policy::types::{Candidates, Request};
use super::config::PolicyRuntimeConfig;
use super::error::{FallbackReason, PolicyError};
use super::health::FailureWindow;
use super::instance::{Failure, InstanceError, Stage};
use super::pipeline::{is_path, PipelineSpec};
use super::runtime::{sha256_hex, CompiledPlugin, PluginDescription, PluginKind, PolicyRuntime};
use super::selftest;
use super::stats::{PolicyStats, StatsSnapshot};
use super::wire::{candidate_count, with_wit_decision};
use super::{DecisionContext, TaintTable};

/// What a decision through the policy produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// One finite cost per candidate (lower is better): pick with the request temperature.
    Costs(Vec<f64>),
    /// The policy chose this candidate (an index into the columns).
    Pick(usize),
    /// Use the native cost (`cost::native_costs`); the reason says why.
    Fallback(FallbackReason),
}

/// The answer of [`PolicyRegistry::decide`], with the version that produced it.
#[derive(Clone, Debug)]
pub struct PolicyDecision {
    pub outcome: Outcome,
    /// The version the decision ran on (`None` when no policy was active).
    pub policy: Option<Arc<PolicyVersion>>,
    /// The activation sequence number of that version (see [`ActivePolicy::activation`]); 0 when none.
    pub activation: u64,
}

impl PolicyDecision {
    /// Whether the router must use the native cost.
    pub fn is_fallback(&self) -> bool {
        matches!(self.outcome, Outcome::Fallback(_))
    }
}

/// The active version and the sequence number of the activation that made it active. Every swap
/// (activate, rollback, automatic restore, load with activation) gets a new, larger number.
#[derive(Debug)]
pub struct ActivePolicy {
    pub policy: Arc<PolicyVersion>,
    pub activation: u64,
}

/// Where a version's stages came from (to rebuild it with a new configuration).
#[derive(Clone, Debug)]
enum Source {
    Component {
        plugin: Arc<CompiledPlugin>,
    },
    Pipeline {
        spec: PipelineSpec,
        base_dir: Option<PathBuf>,
    },
}

/// One loaded, configured, self-tested version of a policy. Immutable: a new configuration is a
/// new version.
pub struct PolicyVersion {
    name: Arc<str>,
    version: u64,
    digest: String,
    loaded_at: SystemTime,
    config: String,
    source: Source,
    scorers: Vec<Arc<Stage>>,
    selector: Option<Arc<Stage>>,
    stats: Arc<PolicyStats>,
    consecutive_failures: AtomicU32,
    /// Whether each of the last `failure_window` decisions failed.
    recent: FailureWindow,
    /// The reason and detail of the latest failed decision (formatted on failure only).
    last_failure: parking_lot::Mutex<Option<String>>,
}

impl std::fmt::Debug for PolicyVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyVersion")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("digest", &self.digest)
            .finish_non_exhaustive()
    }
}

impl PolicyVersion {
    /// The name it was loaded under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The latest failed decision of this version: its reason and what the runtime (or the
    /// plugin, through its last error log line) said. `kvroute policy check` prints it.
    pub fn last_failure(&self) -> Option<String> {
        self.last_failure.lock().clone()
    }

    /// Per-name version number: 1 for the first load, +1 for every reload or reconfiguration.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// sha256 of the component (hex); for a pipeline, of its stages' digests, weights and configs.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    pub fn loaded_at(&self) -> SystemTime {
        self.loaded_at
    }

    /// The configuration JSON (for a pipeline: its spec).
    pub fn config(&self) -> &str {
        &self.config
    }

    pub fn stats(&self) -> &PolicyStats {
        &self.stats
    }

    /// Whether this version is a pipeline (several stages or a selector).
    pub fn is_pipeline(&self) -> bool {
        matches!(self.source, Source::Pipeline { .. })
    }

    /// The pipeline declaration, for pipelines.
    pub fn pipeline_spec(&self) -> Option<&PipelineSpec> {
        match &self.source {
            Source::Pipeline { spec, .. } => Some(spec),
            Source::Component { .. } => None,
        }
    }

    /// Instances alive across all stages.
    pub fn live_instances(&self) -> usize {
        self.stages().map(|s| s.live()).sum()
    }

    /// Instances idle in the pools across all stages.
    pub fn pooled_instances(&self) -> usize {
        self.stages().map(|s| s.pooled()).sum()
    }

    fn stages(&self) -> impl Iterator<Item = &Arc<Stage>> {
        self.scorers.iter().chain(self.selector.iter())
    }

    fn single(&self) -> bool {
        !self.is_pipeline()
    }

    /// Runs the stages on one decision.
    fn run(
        &self,
        req: Request<'_>,
        cands: Candidates<'_>,
        ctx: DecisionContext<'_>,
        ticks: u64,
        inline: bool,
    ) -> Result<Answer, Failure> {
        if self.single() {
            return self.scorers[0].decide(req, cands, ctx, true, ticks, inline);
        }
        let n = candidate_count(&cands);
        let mut combined = None;
        if !self.scorers.is_empty() {
            let mut sum = vec![0.0; n];
            for stage in &self.scorers {
                match stage.decide(req.clone(), cands.clone(), ctx, false, ticks, inline)? {
                    Answer::Costs(c) => {
                        for (s, c) in sum.iter_mut().zip(c) {
                            *s += stage.weight * c;
                        }
                    }
                    Answer::Pick(_) => {
                        return Err(Failure::new(
                            FallbackReason::UnexpectedPick,
                            "scorer stage answered a pick",
                        ))
                    }
                }
            }
            if let Some(i) = sum.iter().position(|c| !c.is_finite()) {
                return Err(Failure::new(
                    FallbackReason::NonFinite,
                    format!("weighted sum of candidate {i} is {}", sum[i]),
                ));
            }
            combined = Some(sum);
        }
        match &self.selector {
            Some(sel) => {
                // The selector's base costs are the weighted sum; the preferred-taint weights
                // after them stay.
                let mut f64s;
                let mut c = cands;
                if let Some(sum) = combined {
                    f64s = sum;
                    f64s.extend_from_slice(c.columns_f64.get(n..).unwrap_or(&[]));
                    c.columns_f64 = &f64s;
                }
                sel.decide(req, c, ctx, true, ticks, inline)
            }
            None => Ok(Answer::Costs(combined.unwrap_or_default())),
        }
    }

    /// A description for listings.
    pub fn info(&self, active: bool) -> PolicyInfo {
        let stage_info = |role: &'static str, s: &Stage, weight: Option<f64>| StageInfo {
            role,
            digest: s.plugin.digest.clone(),
            plugin: s.plugin.info.clone(),
            weight,
            config: s.config.clone(),
        };
        let stages = self.is_pipeline().then(|| {
            self.scorers
                .iter()
                .map(|s| stage_info("scorer", s, Some(s.weight)))
                .chain(
                    self.selector
                        .iter()
                        .map(|s| stage_info("selector", s, None)),
                )
                .collect()
        });
        let plugin = self.single().then(|| self.scorers[0].plugin.info.clone());
        let mut trapping_imports: Vec<String> = self
            .stages()
            .flat_map(|s| s.plugin.trapping_imports.iter().cloned())
            .collect();
        trapping_imports.sort();
        trapping_imports.dedup();
        PolicyInfo {
            name: self.name.to_string(),
            version: self.version,
            digest: self.digest.clone(),
            loaded_at: rfc3339(self.loaded_at),
            active,
            config: self.config.clone(),
            plugin,
            stages,
            trapping_imports,
            instances: self.live_instances(),
            stats: {
                let mut stats = self.stats.snapshot();
                stats.recent_failure_rate = self.recent.rate();
                stats
            },
        }
    }
}

/// A policy version as listed (`GET /v1/policies`).
#[derive(Clone, Debug, Serialize)]
pub struct PolicyInfo {
    pub name: String,
    pub version: u64,
    /// sha256 of the component, hex.
    pub digest: String,
    /// RFC 3339, UTC.
    pub loaded_at: String,
    pub active: bool,
    /// Configuration JSON (a pipeline's spec for pipelines).
    pub config: String,
    /// The component's own description (single-component policies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginDescription>,
    /// The stages (pipelines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<StageInfo>>,
    /// Imports linked as traps (WASI and the like): calling them fails the decision.
    pub trapping_imports: Vec<String>,
    /// Instances alive.
    pub instances: usize,
    pub stats: StatsSnapshot,
}

/// One stage of a pipeline as listed.
#[derive(Clone, Debug, Serialize)]
pub struct StageInfo {
    /// `scorer` or `selector`.
    pub role: &'static str,
    pub digest: String,
    pub plugin: PluginDescription,
    /// Weight of a scorer stage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    pub config: String,
}

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

    /// Asks the active policy to rank `cols` (base costs already filled by the router).
    ///
    /// Never fails: any problem is an [`Outcome::Fallback`], and the router uses the native cost.
    /// Loads the active pointer once, so the whole decision runs on one version.
    pub fn decide(
        &self,
        req: &PolicyRequest,
        cols: &CandidateColumns,
        taints: &TaintTable,
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
        let policy = &active.policy;
        let start = Instant::now();
        let ctx = DecisionContext {
            taints,
            block_size: req.block_size,
        };
        let result = with_wit_decision(req, cols, |wreq, wcands| {
            policy.run(wreq, wcands, ctx, self.runtime.shared.deadline_ticks, false)
        });
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let outcome = match result {
            Ok(answer) => {
                policy.stats.record_ok(nanos);
                if policy.consecutive_failures.load(Relaxed) != 0 {
                    policy.consecutive_failures.store(0, Relaxed);
                }
                policy.recent.record(false);
                match answer {
                    Answer::Costs(c) => Outcome::Costs(c),
                    Answer::Pick(i) => Outcome::Pick(i),
                }
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
                if failure.counts {
                    let n = policy.consecutive_failures.fetch_add(1, Relaxed) + 1;
                    let (failed, full) = policy.recent.record(true);
                    let config = self.config();
                    let window = config.failure_window as usize;
                    if n >= config.max_consecutive_failures {
                        self.auto_restore(&active, failure.reason, Cause::Consecutive(n));
                    } else if full && failed as f64 > config.max_failure_rate * window as f64 {
                        self.auto_restore(&active, failure.reason, Cause::Rate { failed, window });
                    }
                }
                Outcome::Fallback(failure.reason)
            }
        };
        PolicyDecision {
            outcome,
            policy: Some(active.policy.clone()),
            activation: active.activation,
        }
    }

    fn remember_taints(&self, taints: &TaintTable) {
        let known = self.last_taints.load();
        if known.as_ref().map(|t| t.version) != Some(taints.version)
            && taints.version != TaintTable::SELF_TEST_VERSION
        {
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

    /// Compiles `bytes`, or reuses the compiled component of identical bytes still in use.
    fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledPlugin>, PolicyError> {
        let digest = sha256_hex(bytes);
        if let Some(plugin) = self
            .compiled
            .lock()
            .get(&digest)
            .and_then(std::sync::Weak::upgrade)
        {
            return Ok(plugin);
        }
        let plugin = self.runtime.compile(bytes)?;
        let mut cache = self.compiled.lock();
        cache.retain(|_, p| p.strong_count() > 0);
        cache.insert(digest, Arc::downgrade(&plugin));
        Ok(plugin)
    }

    /// Loads a component under `name` (a new version if the name exists): checks it is a policy
    /// component, compiles it, configures it with `config` (`{}` when `None`), self-tests it on
    /// synthetic decisions of 1, 8 and 64 candidates, warms its instances, and — when `activate`,
    /// or when `name` is the active policy — makes it active with one atomic swap.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config: Option<&str>,
        activate: bool,
    ) -> Result<PolicyInfo, PolicyError> {
        validate_name(name)?;
        let config = normalize_config(config)?;
        let _admin = self.admin.lock();
        let plugin = self.compile(bytes)?;
        self.install(name, Build::Component { plugin, config }, activate)
    }

    /// Loads a pipeline under `name` (see [`PipelineSpec`]); relative `.wasm` paths are resolved
    /// against `base_dir` (default: the working directory).
    pub fn load_pipeline(
        &self,
        name: &str,
        spec: &PipelineSpec,
        base_dir: Option<&Path>,
        activate: bool,
    ) -> Result<PolicyInfo, PolicyError> {
        validate_name(name)?;
        spec.validate()?;
        let _admin = self.admin.lock();
        self.install(
            name,
            Build::Pipeline {
                spec: spec.clone(),
                base_dir: base_dir.map(Path::to_path_buf),
            },
            activate,
        )
    }

    /// Checks a component as `load` would (compile, configure, self-test) without keeping it.
    pub fn check(&self, bytes: &[u8], config: Option<&str>) -> Result<PolicyInfo, PolicyError> {
        let config = normalize_config(config)?;
        let plugin = self.compile(bytes)?;
        let version = self.build("check", 0, Build::Component { plugin, config })?;
        Ok(version.info(false))
    }

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

    /// Builds a version and records it under `name`; activates it when asked or when `name` is the
    /// active policy. Caller holds the admin lock.
    fn install(&self, name: &str, build: Build, activate: bool) -> Result<PolicyInfo, PolicyError> {
        // The number is taken only when the version is installed, so a refused version leaves no
        // trace, its number included (the admin lock is held: no other install runs meanwhile).
        let number = self.state.lock().versions.get(name).map_or(1, |v| v + 1);
        let version = match self.build(name, number, build) {
            Ok(v) => Arc::new(v),
            Err(e) => {
                tracing::warn!(policy = name, code = e.code(), error = %e, "policy refused; nothing changed");
                return Err(e);
            }
        };
        let mut state = self.state.lock();
        state.versions.insert(name.to_string(), number);
        let name_active = self
            .active
            .load()
            .as_ref()
            .is_some_and(|a| &*a.policy.name == name);
        state.policies.insert(name.to_string(), version.clone());
        let now_active = activate || name_active;
        if now_active {
            self.set_active(&mut state, Some(version.clone()), true);
        }
        tracing::info!(
            policy = name,
            version = number,
            digest = version.digest(),
            active = now_active,
            "policy loaded"
        );
        Ok(version.info(now_active))
    }

    /// Resolves a pipeline stage's component: a loaded single-component policy or a file.
    fn resolve(
        &self,
        component: &str,
        base_dir: Option<&Path>,
    ) -> Result<(Arc<CompiledPlugin>, String), PolicyError> {
        if is_path(component) {
            let path = match base_dir {
                Some(dir) if Path::new(component).is_relative() => dir.join(component),
                _ => PathBuf::from(component),
            };
            let bytes = std::fs::read(&path).map_err(|e| PolicyError::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            let plugin = self
                .compile(&bytes)
                .map_err(|e| PolicyError::Pipeline(format!("component {}: {e}", path.display())))?;
            return Ok((plugin, "{}".to_string()));
        }
        let version = self.get(component).ok_or_else(|| {
            PolicyError::Pipeline(format!(
                "stage component {component:?} is neither a loaded policy nor a .wasm path"
            ))
        })?;
        match &version.source {
            Source::Component { plugin } => Ok((plugin.clone(), version.config.clone())),
            Source::Pipeline { .. } => Err(PolicyError::Pipeline(format!(
                "stage component {component:?} is itself a pipeline; stages must be components"
            ))),
        }
    }

    /// Configures the stages, self-tests, and warms the instances of a new version.
    fn build(&self, name: &str, number: u64, build: Build) -> Result<PolicyVersion, PolicyError> {
        let shared = self.runtime.shared.clone();
        let policy_name: Arc<str> = Arc::from(name);
        let stats = Arc::new(PolicyStats::default());
        let new_stage = |plugin: Arc<CompiledPlugin>, config: String, weight: f64| {
            Arc::new(Stage::new(
                plugin,
                config,
                weight,
                policy_name.clone(),
                shared.clone(),
                stats.clone(),
            ))
        };
        let (source, config, scorers, selector, digest) = match build {
            Build::Component { plugin, config } => {
                let digest = plugin.digest.clone();
                let stage = new_stage(plugin.clone(), config.clone(), 1.0);
                (
                    Source::Component { plugin },
                    config,
                    vec![stage],
                    None,
                    digest,
                )
            }
            Build::Pipeline { spec, base_dir } => {
                let mut canonical = String::from("kvroute-pipeline-v1\n");
                let mut scorers = Vec::new();
                for (i, s) in spec.stages.iter().enumerate() {
                    let (plugin, default_config) =
                        self.resolve(&s.component, base_dir.as_deref())?;
                    if plugin.info.kind == PluginKind::Selector {
                        return Err(PolicyError::Pipeline(format!(
                            "stages[{i}] ({}) is a selector plugin: put it in `selector`",
                            s.component
                        )));
                    }
                    let config = s.config.as_ref().map_or(default_config, |v| v.to_string());
                    canonical.push_str(&format!(
                        "scorer {} {} {}\n",
                        plugin.digest, s.weight, config
                    ));
                    scorers.push(new_stage(plugin, config, s.weight));
                }
                let selector = match &spec.selector {
                    Some(sel) => {
                        let (plugin, default_config) =
                            self.resolve(&sel.component, base_dir.as_deref())?;
                        let config = sel
                            .config
                            .as_ref()
                            .map_or(default_config, |v| v.to_string());
                        canonical.push_str(&format!("selector {} {}\n", plugin.digest, config));
                        Some(new_stage(plugin, config, 1.0))
                    }
                    None => None,
                };
                let config = serde_json::to_string(&spec).unwrap_or_default();
                let digest = sha256_hex(canonical.as_bytes());
                (
                    Source::Pipeline { spec, base_dir },
                    config,
                    scorers,
                    selector,
                    digest,
                )
            }
        };
        let version = PolicyVersion {
            name: policy_name.clone(),
            version: number,
            digest,
            loaded_at: SystemTime::now(),
            config,
            source,
            scorers,
            selector,
            stats,
            consecutive_failures: AtomicU32::new(0),
            recent: FailureWindow::new(self.config().failure_window as usize),
            last_failure: parking_lot::Mutex::new(None),
        };

        // Configure one instance per stage: a rejected configuration surfaces verbatim.
        for stage in version.stages() {
            let inst = stage.new_instance().map_err(|e| match e {
                InstanceError::ConfigRejected(m) => PolicyError::ConfigRejected(m),
                InstanceError::Failed { during, message } => {
                    PolicyError::Trapped { during, message }
                }
            })?;
            stage.put(inst);
        }
        // Self-test on synthetic decisions.
        let table = selftest::taint_table();
        let ticks = shared.setup_ticks;
        for n in selftest::SELF_TEST_SIZES {
            let (req, cols) = selftest::decision(n);
            let ctx = DecisionContext {
                taints: &table,
                block_size: req.block_size,
            };
            with_wit_decision(&req, &cols, |wreq, wc| {
                version.run(wreq, wc, ctx, ticks, true)
            })
            .map_err(|f| {
                PolicyError::SelfTest(format!("{n} candidates: {} ({})", f.reason, f.detail))
            })?;
        }
        // The serving deadline: a policy that cannot answer an 8-candidate decision in time
        // even once in three tries would fall back on every decision, and be taken out by the
        // automatic restore after a few. Refusing it here says why at once. Each try first
        // warms its instance without a deadline (a missed deadline replaces the instance, and a
        // first call is slow), so three tries are three warm calls. This runs before the warm-up
        // below, which leaves every pooled instance synced to the router's context.
        {
            let (req, cols) = selftest::decision(8);
            let ctx = DecisionContext {
                taints: &table,
                block_size: req.block_size,
            };
            let mut in_time = false;
            for _ in 0..3 {
                with_wit_decision(&req, &cols, |wreq, wc| {
                    version.run(wreq, wc, ctx, ticks, true)
                })
                .map_err(|f| {
                    PolicyError::SelfTest(format!("8 candidates: {} ({})", f.reason, f.detail))
                })?;
                match with_wit_decision(&req, &cols, |wreq, wc| {
                    version.run(wreq, wc, ctx, shared.deadline_ticks, true)
                }) {
                    Ok(_) => {
                        in_time = true;
                        break;
                    }
                    Err(f) if f.reason == FallbackReason::Deadline => {}
                    Err(f) => {
                        return Err(PolicyError::SelfTest(format!(
                            "8 candidates, serving deadline: {} ({})",
                            f.reason, f.detail
                        )))
                    }
                }
            }
            if !in_time {
                return Err(PolicyError::SelfTest(format!(
                    "8 candidates: no answer within the serving deadline of {} µs \
                     (policy_runtime.deadline_us) in 3 warm tries; every decision would fall \
                     back. Make decide faster, or raise the deadline",
                    shared.config.deadline_us
                )));
            }
        }
        // Warm: make the pool's instances and run one decision on each (first calls are slow),
        // then hand them the router's current taint table.
        let target = shared.instances_per_stage;
        let (req, cols) = selftest::decision(8);
        let router_taints = self.last_taints.load_full();
        for stage in version.stages() {
            stage.refill(target);
            let mut warmed = Vec::new();
            while let Some(inst) = stage.take_pooled() {
                warmed.push(inst);
            }
            for inst in &mut warmed {
                let ctx = DecisionContext {
                    taints: &table,
                    block_size: req.block_size,
                };
                with_wit_decision(&req, &cols, |wreq, wc| inst.decide(wreq, wc, ctx, ticks))
                    .map_err(|f| {
                        PolicyError::SelfTest(format!("warm-up: {} ({})", f.reason, f.detail))
                    })?;
                if let Some(t) = &router_taints {
                    let ctx = DecisionContext {
                        taints: t,
                        block_size: self.last_block_size.load(Relaxed),
                    };
                    inst.sync_context(ctx, ticks).map_err(|f| {
                        PolicyError::SelfTest(format!("set-context: {} ({})", f.reason, f.detail))
                    })?;
                }
            }
            for inst in warmed {
                stage.put(inst);
            }
        }
        Ok(version)
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
        c.base_cost.len(),
    ]
    .iter()
    .all(|&l| l == n)
        && c.taint_offsets.len() == n + 1
        && c.taint_offsets.first() == Some(&0)
        && c.taint_offsets.last().map(|&l| l as usize) == Some(c.taint_ids.len())
}

/// RFC 3339 (UTC, seconds) of a system time.
fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_points() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20Z");
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn names() {
        assert!(validate_name("native-cost_v1.2").is_ok());
        for bad in ["", ".hidden", "a/b", "sp ace", "rollback", &"x".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
