//! [`ClusterStore`]: the [`StateStore`] of a cluster replica, in the cluster's JetStream buckets.
//!
//! Every record carries the replica that wrote it (`origin`), so [`super::watch`] can tell its
//! own writes from the other replicas' and never applies (or writes back) its own; every write
//! returns the record's revision (the bucket stream's sequence), which orders concurrent writes
//! of one key (last writer wins, see [`crate::state::Persisted`]).
//!
//! While the client is not connected, every call fails at once with
//! [`StateError::Unavailable`] (503 `cluster_unavailable`) instead of waiting for the timeout:
//! nothing is published (so nothing is queued in the client to go out after the change was
//! undone here), and the replica keeps serving its local view.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream::kv;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use super::Cluster;
use crate::state::{Record, Revision, StateError, StateStore, StoredState, StoredWorker};
use kvroute_policy::{sha256_hex, RegistryImage, RolloutImage};

/// The key of the policy registry's image in the policies bucket.
pub(crate) const IMAGE_KEY: &str = "image";
/// The key of the rollout state (shadows, canary, records) in the policies bucket: in the same
/// bucket as the image, so one watch delivers both in the order they were written (a canary's
/// versions are loaded before the canary is applied).
pub(crate) const ROLLOUT_KEY: &str = "rollout";

/// A worker record in the workers bucket. A removed worker stays as a tombstone (`worker`
/// null) rather than a KV delete, so the removal carries its origin too (a replica that removes
/// and registers a worker again must not apply its own removal when the watch delivers it).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WorkerRecord {
    pub origin: String,
    pub worker: Option<StoredWorker>,
}

/// The policy image record in the policies bucket.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ImageRecord {
    pub origin: String,
    pub image: RegistryImage,
}

/// The rollout record in the policies bucket.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RolloutRecord {
    pub origin: String,
    pub rollout: RolloutImage,
}

/// The cluster's state store (cheap to clone: the connection is shared).
#[derive(Clone)]
pub struct ClusterStore {
    pub(crate) cluster: Arc<Cluster>,
}

impl ClusterStore {
    pub fn new(cluster: Arc<Cluster>) -> Self {
        Self { cluster }
    }

    fn write_worker(
        &self,
        worker_id: u64,
        worker: Option<StoredWorker>,
    ) -> Result<Revision, StateError> {
        let record = WorkerRecord {
            origin: self.cluster.replica_id.clone(),
            worker,
        };
        let bytes = serde_json::to_vec(&record).map_err(|e| self.io(e))?;
        let kv = self.cluster.workers.clone();
        self.run(async move { kv.put(worker_id.to_string(), bytes.into()).await })?
            .map_err(|e| self.io(e))
    }

    /// Runs a NATS call, failing at once if the client is not connected now (a call made while
    /// it reconnects would wait out the timeout and its publish could go out later).
    fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, StateError> {
        if !self.cluster.connected() {
            return Err(self.io("not connected to the NATS server (reconnecting)"));
        }
        self.cluster.run(fut).map_err(|e| match e {
            StateError::Io { message, .. } => self.io(message),
            other => other,
        })
    }

    fn io(&self, e: impl std::fmt::Display) -> StateError {
        StateError::Unavailable {
            path: self.cluster.describe(),
            message: e.to_string(),
        }
    }

    fn corrupt(&self, what: &str, e: impl std::fmt::Display) -> StateError {
        StateError::Corrupt {
            path: format!("{} {what}", self.cluster.describe()),
            message: e.to_string(),
        }
    }
}

impl StateStore for ClusterStore {
    fn load(&self) -> Result<StoredState, StateError> {
        let (workers, policies) = (self.cluster.workers.clone(), self.cluster.policies.clone());
        let (raw_workers, raw_image) = self
            .run(async move {
                let mut out = Vec::new();
                let mut keys = workers.keys().await.map_err(|e| e.to_string())?;
                let mut names = Vec::new();
                while let Some(k) = keys.next().await {
                    names.push(k.map_err(|e| e.to_string())?);
                }
                for k in names {
                    if let Some(e) = workers.entry(k.as_str()).await.map_err(|e| e.to_string())? {
                        out.push((k, e));
                    }
                }
                let image = policies.entry(IMAGE_KEY).await.map_err(|e| e.to_string())?;
                let rollout = policies
                    .entry(ROLLOUT_KEY)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>((out, (image, rollout)))
            })?
            .map_err(|e| self.io(e))?;
        let (raw_image, raw_rollout) = raw_image;
        let mut workers = BTreeMap::new();
        let mut revisions = BTreeMap::new();
        for (key, entry) in raw_workers {
            let id: u64 = key
                .parse()
                .map_err(|_| self.corrupt(&format!("workers key {key:?}"), "not a worker id"))?;
            revisions.insert(Record::Worker(id), entry.revision);
            if entry.operation != kv::Operation::Put {
                continue;
            }
            let record: WorkerRecord = serde_json::from_slice(&entry.value)
                .map_err(|e| self.corrupt(&format!("worker {id}"), e))?;
            if let Some(w) = record.worker {
                workers.insert(id, w);
            }
        }
        let policies = match raw_image.filter(|e| e.operation == kv::Operation::Put) {
            None => None,
            Some(e) => {
                revisions.insert(Record::Policies, e.revision);
                Some(
                    serde_json::from_slice::<ImageRecord>(&e.value)
                        .map_err(|e| self.corrupt("policy image", e))?
                        .image,
                )
            }
        };
        let rollout = match raw_rollout.filter(|e| e.operation == kv::Operation::Put) {
            None => None,
            Some(e) => {
                revisions.insert(Record::Rollout, e.revision);
                Some(
                    serde_json::from_slice::<RolloutRecord>(&e.value)
                        .map_err(|e| self.corrupt("rollout state", e))?
                        .rollout,
                )
            }
        };
        Ok(StoredState {
            workers,
            policies,
            rollout,
            revisions,
        })
    }

    fn put_worker(&self, worker_id: u64, worker: &StoredWorker) -> Result<Revision, StateError> {
        self.write_worker(worker_id, Some(worker.clone()))
    }

    fn delete_worker(&self, worker_id: u64) -> Result<Revision, StateError> {
        self.write_worker(worker_id, None)
    }

    fn has_policy_bytes(&self, digest: &str) -> bool {
        let (store, digest) = (self.cluster.components.clone(), digest.to_string());
        matches!(
            self.run(async move { store.info(digest.as_str()).await.map(|i| !i.deleted) }),
            Ok(Ok(true))
        )
    }

    fn put_policy_bytes(&self, digest: &str, bytes: &[u8]) -> Result<(), StateError> {
        if sha256_hex(bytes) != digest {
            return Err(self.corrupt(
                &format!("component {digest}"),
                "the bytes do not match the digest",
            ));
        }
        let (store, digest, bytes) = (
            self.cluster.components.clone(),
            digest.to_string(),
            bytes.to_vec(),
        );
        self.run(async move { store.put(digest.as_str(), &mut bytes.as_slice()).await })?
            .map(|_| ())
            .map_err(|e| self.io(e))
    }

    fn policy_bytes(&self, digest: &str) -> Result<Vec<u8>, StateError> {
        let (store, name) = (self.cluster.components.clone(), digest.to_string());
        let bytes = self
            .run(async move {
                let mut object = store.get(name.as_str()).await.map_err(|e| e.to_string())?;
                let mut out = Vec::new();
                object
                    .read_to_end(&mut out)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(out)
            })?
            .map_err(|e| self.io(format!("component {digest}: {e}")))?;
        if sha256_hex(&bytes) != digest {
            return Err(self.corrupt(
                &format!("component {digest}"),
                "its bytes do not match its digest",
            ));
        }
        Ok(bytes)
    }

    fn put_policies(&self, image: &RegistryImage) -> Result<Revision, StateError> {
        let record = ImageRecord {
            origin: self.cluster.replica_id.clone(),
            image: image.clone(),
        };
        let bytes = serde_json::to_vec(&record).map_err(|e| self.io(e))?;
        let kv = self.cluster.policies.clone();
        self.run(async move { kv.put(IMAGE_KEY, bytes.into()).await })?
            .map_err(|e| self.io(e))
    }

    fn put_rollout(
        &self,
        image: &RolloutImage,
        expected: Option<Revision>,
    ) -> Result<Revision, StateError> {
        let record = RolloutRecord {
            origin: self.cluster.replica_id.clone(),
            rollout: image.clone(),
        };
        let bytes = serde_json::to_vec(&record).map_err(|e| self.io(e))?;
        let kv = self.cluster.policies.clone();
        let written = self.run(async move {
            use kv::{CreateErrorKind, UpdateErrorKind};
            match expected {
                // Never written (as far as this replica knows): only if it still is not.
                None => kv
                    .create(ROLLOUT_KEY, bytes.into())
                    .await
                    .map_err(|e| (e.kind() == CreateErrorKind::AlreadyExists, e.to_string())),
                Some(revision) => kv
                    .update(ROLLOUT_KEY, bytes.into(), revision)
                    .await
                    .map_err(|e| {
                        (
                            e.kind() == UpdateErrorKind::WrongLastRevision,
                            e.to_string(),
                        )
                    }),
            }
        })?;
        written.map_err(|(conflict, e)| {
            if conflict {
                StateError::Conflict {
                    path: self.cluster.describe(),
                    message: format!(
                        "another replica changed the rollout state meanwhile ({e}): nothing was written"
                    ),
                }
            } else {
                self.io(e)
            }
        })
    }

    fn rollout(&self) -> Result<Option<(RolloutImage, Revision)>, StateError> {
        let kv = self.cluster.policies.clone();
        let entry = self
            .run(async move { kv.entry(ROLLOUT_KEY).await })?
            .map_err(|e| self.io(e))?;
        match entry.filter(|e| e.operation == kv::Operation::Put) {
            None => Ok(None),
            Some(e) => Ok(Some((
                serde_json::from_slice::<RolloutRecord>(&e.value)
                    .map_err(|err| self.corrupt("rollout state", err))?
                    .rollout,
                e.revision,
            ))),
        }
    }

    fn retain_policy_bytes(&self, _keep: &[&str]) -> Result<(), StateError> {
        // Another replica may be about to use a component this one no longer needs (an upload
        // in flight): components are kept; they are addressed by digest, so a kept one is
        // never wrong.
        Ok(())
    }

    fn describe(&self) -> String {
        self.cluster.describe()
    }
}
