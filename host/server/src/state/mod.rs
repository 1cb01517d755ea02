//! State that survives restarts (`kvroute serve --state-dir`): the worker registry (every spec as
//! registered, with its draining flag) and the policy store (the registry's [`RegistryImage`] and
//! the component bytes by digest).
//!
//! [`StateStore`] is the persistence seam: [`local::LocalDirStore`] keeps the state in a local
//! directory (atomic writes); a shared backend (a key-value bucket and an object store) fits the
//! same calls. [`Persisted`] is the write-through layer the HTTP handlers call: a change is
//! applied in memory, persisted, and undone in memory when it could not be persisted, so the
//! answer is either the change made and kept or an error with nothing changed.

pub mod local;
mod persisted;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use kvroute_core::workers::{Worker, WorkerSpec};
use kvroute_policy::{RegistryImage, RolloutImage};

pub use persisted::{Persisted, Reconciled};

/// Why the store could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file that is not what the store wrote (or a file the store does not know): the store
    /// refuses to start rather than guess. `path` names it.
    #[error("state file {path}: {message}")]
    Corrupt { path: String, message: String },
    /// The medium failed (disk full, permissions, a read-only directory).
    #[error("state store {path}: {message}")]
    Io { path: String, message: String },
    /// The shared store of a cluster cannot be reached (the NATS server is down or does not
    /// answer): the replica serves its local view and refuses writes until it is back.
    #[error("{path}: {message}")]
    Unavailable { path: String, message: String },
    /// A compare-and-set write found the record changed since the revision the writer last saw
    /// (another replica wrote it meanwhile): nothing was written.
    #[error("{path}: {message}")]
    Conflict { path: String, message: String },
}

/// A store's version number of one record, increasing with every write of the store (JetStream's
/// stream sequence); 0 from a store that does not number its writes (`--state-dir`). A replica
/// applies another replica's record only if it is newer than the one it holds, so concurrent
/// writes of one key end with every replica holding the last one written (last writer wins).
pub type Revision = u64;

/// One record of a store, as far as revisions go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Record {
    Worker(u64),
    Policies,
    /// The rollout state (shadows, canary, records).
    Rollout,
}

/// A worker as kept: what `PUT /v1/workers/{id}` registered (taints, role, topology, kv_events,
/// endpoint, model...) and what `PATCH` changed since, with the draining flag.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredWorker {
    pub spec: WorkerSpec,
    pub draining: bool,
}

impl StoredWorker {
    /// The record of a registered worker.
    pub fn of(w: &Worker) -> Self {
        Self {
            spec: WorkerSpec {
                dp_start: w.dp_start,
                dp_size: w.dp_size,
                taints: w.taints.clone(),
                total_kv_blocks: w.total_kv_blocks,
                max_num_batched_tokens: w.max_num_batched_tokens,
                kv_events: w.kv_events.clone(),
                role: w.role,
                topology: w.topology.clone(),
                endpoint: w.endpoint.clone(),
                model: w.model.clone(),
            },
            draining: w.draining,
        }
    }
}

/// Everything a store holds, as loaded at start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredState {
    pub workers: BTreeMap<u64, StoredWorker>,
    /// `None`: no policy state was ever written (a fresh store).
    pub policies: Option<RegistryImage>,
    /// `None`: no rollout state was ever written.
    pub rollout: Option<RolloutImage>,
    /// The revision of every record read (empty from a store without revisions).
    pub revisions: BTreeMap<Record, Revision>,
}

/// Where the state is kept. Every write is durable when it returns `Ok` (a crash right after
/// loses nothing), and atomic (a crash during it leaves the previous value).
pub trait StateStore: Send + Sync {
    /// Reads everything; refuses anything it cannot account for.
    fn load(&self) -> Result<StoredState, StateError>;
    /// Records a worker (registered, replaced or patched); returns the record's revision.
    fn put_worker(&self, worker_id: u64, worker: &StoredWorker) -> Result<Revision, StateError>;
    /// Forgets a worker; returns the revision of the removal.
    fn delete_worker(&self, worker_id: u64) -> Result<Revision, StateError>;
    /// Whether the bytes of a component are kept.
    fn has_policy_bytes(&self, digest: &str) -> bool;
    /// Keeps a component's bytes under its digest (sha256, hex).
    fn put_policy_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), StateError>;
    /// A kept component's bytes.
    fn policy_bytes(&self, digest: &str) -> Result<Vec<u8>, StateError>;
    /// Records the policy registry's image (versions, active pointer, history); returns its
    /// revision.
    fn put_policies(&self, image: &RegistryImage) -> Result<Revision, StateError>;
    /// Records the rollout state (shadows, canary, ended canaries' records) if the record is
    /// still at `expected` (the revision the caller last wrote or read of it; `None`: it was never
    /// written), else refuses with [`StateError::Conflict`] and writes nothing (a store without
    /// revisions has one writer and does not check). Returns the new revision.
    fn put_rollout(
        &self,
        image: &RolloutImage,
        expected: Option<Revision>,
    ) -> Result<Revision, StateError>;
    /// The rollout state as the store holds it now, with its revision.
    fn rollout(&self) -> Result<Option<(RolloutImage, Revision)>, StateError>;
    /// Drops the components no kept version uses any more (best effort).
    fn retain_policy_bytes(&self, keep: &[&str]) -> Result<(), StateError>;
    /// Where the state is, for logs.
    fn describe(&self) -> String;
}
