//! The registry's persistent image: what a state store keeps so a restarted server serves the same
//! policies (`kvroute serve --state-dir`). It is the part of the registry `GET /v1/policies` shows
//! and `POST /v1/policies/rollback` needs — each kept version's name, number, digest and
//! configuration, the active one and the rollback history — with the component bytes by digest.
//!
//! Restoring goes through the normal load path (compile, configure, self-test, warm), so a stored
//! component is validated exactly as an upload is; only the numbers and load times are the stored
//! ones. Pipelines are not part of the image: they are declared in files (`policy_dir`), which load
//! them again at start. A [`Checkpoint`] is the in-memory counterpart: it lets a caller undo an
//! administrative operation whose effect could not be persisted.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::version::Source;
use super::{ActivePolicy, Build, PolicyRegistry, PolicyVersion};
use crate::error::PolicyError;
use crate::plugin::sha256_hex;

/// One kept version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionImage {
    pub name: String,
    pub version: u64,
    /// sha256 of the component, hex: the name of its bytes in the store.
    pub digest: String,
    /// Configuration JSON.
    pub config: String,
    /// When the version was first loaded (seconds since the Unix epoch).
    pub loaded_at_secs: u64,
}

/// What the registry keeps across restarts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryImage {
    /// The current version of each name (what configure and activate by name act on).
    pub current: Vec<VersionImage>,
    /// The active version (it may be an older version of its name); `None`: the native cost.
    pub active: Option<VersionImage>,
    /// Previously active versions, oldest first (the last one is the rollback target).
    pub history: Vec<VersionImage>,
    /// The last version number given to each name, so numbering continues after a restart.
    pub last_versions: BTreeMap<String, u64>,
}

impl RegistryImage {
    /// Every distinct version the image names (current, active, history), by (name, number).
    pub fn versions(&self) -> Vec<&VersionImage> {
        let mut all: Vec<&VersionImage> = self
            .current
            .iter()
            .chain(self.active.iter())
            .chain(self.history.iter())
            .collect();
        all.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        all.dedup_by(|a, b| a.name == b.name && a.version == b.version);
        all
    }

    /// The digests of the components the image needs.
    pub fn digests(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.versions().iter().map(|v| v.digest.as_str()).collect();
        d.sort_unstable();
        d.dedup();
        d
    }
}

/// The registry's state at one moment, to undo the operations after it ([`PolicyRegistry::revert`]).
pub struct Checkpoint {
    policies: BTreeMap<String, Arc<PolicyVersion>>,
    history: Vec<Arc<PolicyVersion>>,
    versions: HashMap<String, u64>,
    active: Option<Arc<ActivePolicy>>,
    rollout: crate::rollout::RolloutCheckpoint,
}

fn image_of(v: &PolicyVersion) -> Option<VersionImage> {
    matches!(v.source, Source::Component { .. }).then(|| VersionImage {
        name: v.name.to_string(),
        version: v.version,
        digest: v.digest.clone(),
        config: v.config.clone(),
        loaded_at_secs: v
            .loaded_at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    })
}

impl PolicyRegistry {
    /// The persistent image of the registry now (pipelines left out).
    pub fn image(&self) -> RegistryImage {
        let state = self.state.lock();
        let active = self.active.load_full();
        RegistryImage {
            current: state
                .policies
                .values()
                .filter_map(|v| image_of(v))
                .collect(),
            active: active.as_ref().and_then(|a| image_of(&a.policy)),
            history: state.history.iter().filter_map(|v| image_of(v)).collect(),
            last_versions: state
                .versions
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
        }
    }

    /// The bytes of a loaded component (any version still holding it), by digest.
    pub fn component_bytes(&self, digest: &str) -> Option<Arc<[u8]>> {
        self.held_versions().iter().find_map(|v| match &v.source {
            Source::Component { plugin } if plugin.digest == digest => Some(plugin.bytes.clone()),
            _ => None,
        })
    }

    /// Replaces the registry's contents with `image`: every version is compiled, configured,
    /// self-tested and warmed as a load would, keeping its stored number and load time; then the
    /// current versions, the history and the active pointer are set. `bytes` gives a component by
    /// digest; bytes whose sha256 is not their digest are refused. On any error nothing changes.
    /// Versions the registry already holds unchanged are kept as they are (not compiled again).
    pub fn restore(
        &self,
        image: &RegistryImage,
        bytes: impl Fn(&str) -> Result<Vec<u8>, PolicyError>,
    ) -> Result<(), PolicyError> {
        let _admin = self.admin.lock();
        let mut built: HashMap<(String, u64), Arc<PolicyVersion>> = HashMap::new();
        let held = self.held_versions();
        for v in image.versions() {
            super::validate_name(&v.name)?;
            // A version this registry already runs (same name, number, bytes and configuration:
            // a cluster replica applying another's change) is kept, not built again.
            if let Some(same) = held.iter().find(|h| image_of(h).as_ref() == Some(v)) {
                built.insert((v.name.clone(), v.version), same.clone());
                continue;
            }
            let component = bytes(&v.digest)?;
            let actual = sha256_hex(&component);
            if actual != v.digest {
                return Err(PolicyError::Io {
                    path: format!("component {}", v.digest),
                    message: format!("its bytes have the digest {actual}"),
                });
            }
            let plugin = self.compile(&component)?;
            let config = super::normalize_config(Some(&v.config))?;
            let mut version = self
                .build(&v.name, v.version, Build::Component { plugin, config })
                .map_err(|e| restore_error(v, e))?;
            version.loaded_at = SystemTime::UNIX_EPOCH + Duration::from_secs(v.loaded_at_secs);
            built.insert((v.name.clone(), v.version), Arc::new(version));
        }
        let get = |v: &VersionImage| built[&(v.name.clone(), v.version)].clone();
        let mut state = self.state.lock();
        state.policies = image
            .current
            .iter()
            .map(|v| (v.name.clone(), get(v)))
            .collect();
        state.history = image.history.iter().map(get).collect();
        state.versions = image
            .last_versions
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for v in image.versions() {
            let last = state.versions.entry(v.name.clone()).or_default();
            *last = (*last).max(v.version);
        }
        let active = image.active.as_ref().map(get);
        self.set_active(&mut state, active, false);
        Ok(())
    }

    /// Every version the registry holds now (current, history, active).
    fn held_versions(&self) -> Vec<Arc<PolicyVersion>> {
        let state = self.state.lock();
        let active = self.active.load_full();
        state
            .policies
            .values()
            .chain(state.history.iter())
            .chain(active.as_ref().map(|a| &a.policy))
            .cloned()
            .collect()
    }

    /// The registry's state now, for [`Self::revert`].
    pub fn checkpoint(&self) -> Checkpoint {
        let _admin = self.admin.lock();
        let state = self.state.lock();
        Checkpoint {
            policies: state.policies.clone(),
            history: state.history.clone(),
            versions: state.versions.clone(),
            active: self.active.load_full(),
            rollout: self.rollout.checkpoint(),
        }
    }

    /// Puts the registry back as it was at `checkpoint`: the same versions (the same instances),
    /// the same history and the same active pointer, and the same shadows, canary and records.
    pub fn revert(&self, checkpoint: Checkpoint) {
        let _admin = self.admin.lock();
        let mut state = self.state.lock();
        state.policies = checkpoint.policies;
        state.history = checkpoint.history;
        state.versions = checkpoint.versions;
        self.active.store(checkpoint.active);
        self.rollout.revert(checkpoint.rollout);
    }
}

/// A stored version the runtime refuses now (another runtime configuration, a changed host):
/// the error names it.
fn restore_error(v: &VersionImage, e: PolicyError) -> PolicyError {
    match e {
        PolicyError::SelfTest(m) => {
            PolicyError::SelfTest(format!("stored version {} v{}: {m}", v.name, v.version))
        }
        PolicyError::ConfigRejected(m) => {
            PolicyError::ConfigRejected(format!("stored version {} v{}: {m}", v.name, v.version))
        }
        other => other,
    }
}
