//! Pipelines: weighted scorer stages whose costs are summed, then an optional selector.
//!
//! ```json
//! {"stages": [{"component": "native-cost", "weight": 1.0},
//!             {"component": "plugins/spread.wasm", "config": {"alpha": 0.3}, "weight": 0.5}],
//!  "selector": {"component": "session-affinity", "config": {}}}
//! ```
//! Each scorer stage must answer costs; the pipeline's cost is `Σ weight × stage cost`. The
//! selector (optional) receives the same request and candidates with the `base-cost` column
//! replaced by that weighted sum, and answers a pick (or costs). Every stage call has the full
//! per-call deadline.
//!
//! `component` is either the name of a loaded single-component policy (its compiled code is
//! reused, and its configuration unless the stage gives one) or a path to a `.wasm` file
//! (relative paths are resolved against the pipeline file's directory when loaded from the
//! watched directory, else the working directory).

use serde::{Deserialize, Serialize};

use super::error::PolicyError;

/// Most stages a pipeline may declare.
pub const MAX_STAGES: usize = 16;

/// A pipeline declaration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    /// Scorer stages, combined by weighted sum.
    #[serde(default)]
    pub stages: Vec<StageSpec>,
    /// Final stage that picks from the combined costs.
    #[serde(default)]
    pub selector: Option<SelectorSpec>,
}

/// One scorer stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    /// Name of a loaded single-component policy, or a path to a `.wasm` file.
    pub component: String,
    /// Configuration handed to the stage's `configure` (default: the named policy's, or `{}`).
    #[serde(default)]
    pub config: Option<serde_json::Value>,
    /// Weight of this stage's costs in the sum; finite. Default 1.
    #[serde(default = "one")]
    pub weight: f64,
}

/// The selector stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectorSpec {
    /// Name of a loaded single-component policy, or a path to a `.wasm` file.
    pub component: String,
    /// Configuration handed to the selector's `configure`.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
}

fn one() -> f64 {
    1.0
}

impl PipelineSpec {
    /// Parses a pipeline from JSON; the error names the offending field.
    pub fn from_json(json: &str) -> Result<Self, PolicyError> {
        let spec: Self =
            serde_json::from_str(json).map_err(|e| PolicyError::Pipeline(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks shape and weights (components are checked when loaded).
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.stages.is_empty() && self.selector.is_none() {
            return Err(PolicyError::Pipeline(
                "declare at least one stage or a selector".into(),
            ));
        }
        if self.stages.len() > MAX_STAGES {
            return Err(PolicyError::Pipeline(format!(
                "{} stages declared, at most {MAX_STAGES} are allowed",
                self.stages.len()
            )));
        }
        for (i, s) in self.stages.iter().enumerate() {
            if !s.weight.is_finite() {
                return Err(PolicyError::Pipeline(format!(
                    "stages[{i}].weight must be finite, got {}",
                    s.weight
                )));
            }
            if s.component.is_empty() {
                return Err(PolicyError::Pipeline(format!(
                    "stages[{i}].component is empty"
                )));
            }
        }
        if let Some(sel) = &self.selector {
            if sel.component.is_empty() {
                return Err(PolicyError::Pipeline("selector.component is empty".into()));
            }
        }
        Ok(())
    }
}

/// Whether a stage's `component` names a file rather than a loaded policy.
pub(crate) fn is_path(component: &str) -> bool {
    component.ends_with(".wasm") || component.contains('/') || component.contains('\\')
}
