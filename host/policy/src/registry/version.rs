//! One loaded policy version and what is said of it: its stages, its description and
//! counters ([`PolicyVersion`], [`PolicyInfo`]), the active pointer's target ([`ActivePolicy`]) and
//! a decision's outcome ([`PolicyDecision`]).

use crate::answer::Answer;
use crate::bindings::kvroute::policy::types::Request;
use crate::error::FallbackReason;
use crate::failure::Failure;
use crate::health::FailureWindow;
use crate::pipeline::PipelineSpec;
use crate::plugin::{CompiledPlugin, PluginDescription};
use crate::stage::Stage;
use crate::stats::{PolicyStats, StatsSnapshot};
use crate::wire::{candidate_count, with_base_costs, Data};
use crate::DecisionContext;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::SystemTime;

use crate::time::rfc3339;

/// What a decision through the policy produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// One finite cost per candidate (lower is better): pick with the request temperature.
    Costs(Vec<f64>),
    /// The policy chose this candidate (an index into the columns).
    Pick(usize),
    /// Use the native cost (`cost::native_costs`); the reason says why.
    Fallback(FallbackReason),
    /// The version that would decide reads `base_cost` (its `configure` said so, interface
    /// 0.10.0) and the columns came without it: nothing ran and nothing was counted. Fill the
    /// column ([`PolicyRegistry::reads_base_cost`] says when to) and ask again.
    NeedsBaseCost,
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
pub(crate) enum Source {
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
    pub(super) name: Arc<str>,
    pub(super) version: u64,
    pub(super) digest: String,
    pub(super) loaded_at: SystemTime,
    pub(super) config: String,
    pub(super) source: Source,
    pub(super) scorers: Vec<Arc<Stage>>,
    pub(super) selector: Option<Arc<Stage>>,
    pub(super) stats: Arc<PolicyStats>,
    pub(super) consecutive_failures: AtomicU32,
    /// Whether each of the last `failure_window` decisions failed.
    pub(super) recent: FailureWindow,
    /// The reason and detail of the latest failed decision (formatted on failure only).
    pub(super) last_failure: parking_lot::Mutex<Option<String>>,
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

    pub(super) fn stages(&self) -> impl Iterator<Item = &Arc<Stage>> {
        self.scorers.iter().chain(self.selector.iter())
    }

    pub(super) fn single(&self) -> bool {
        !self.is_pipeline()
    }

    /// Whether a decision of this version reads the host's `base-cost` column (interface 0.10.0:
    /// as its instances' `configure` answered). In a pipeline with scorers, the selector is given
    /// their weighted sum there instead, so only the scorers count.
    pub fn reads_base_cost(&self) -> bool {
        if self.scorers.is_empty() {
            self.selector.iter().any(|s| s.reads_base_cost())
        } else {
            self.scorers.iter().any(|s| s.reads_base_cost())
        }
    }

    /// Runs the stages on one decision.
    pub(crate) fn run(
        &self,
        req: Request,
        data: Data<'_>,
        ctx: DecisionContext<'_>,
        ticks: u64,
        inline: bool,
    ) -> Result<Answer, Failure> {
        if self.single() {
            return self.scorers[0].decide(req, data, ctx, true, ticks, inline);
        }
        let n = candidate_count(data);
        let mut combined = None;
        if !self.scorers.is_empty() {
            let mut sum = vec![0.0; n];
            for stage in &self.scorers {
                match stage.decide(req, data, ctx, false, ticks, inline)? {
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
                // The selector's base costs are the weighted sum; the learned step-time columns
                // and the preferred-taint weights after them stay.
                match combined {
                    Some(sum) => {
                        let words = with_base_costs(data, &sum);
                        sel.decide(req, &words, ctx, true, ticks, inline)
                    }
                    None => sel.decide(req, data, ctx, true, ticks, inline),
                }
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
