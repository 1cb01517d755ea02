//! Applying the changes other replicas make: one watch per bucket, on the NATS runtime.
//!
//! A watch starts with the last value of every key (so nothing written between the start-up load
//! and the watch is missed) and then delivers every change in order. Records this replica wrote
//! (`origin` is its id) are skipped: they are already applied here, and applying them again could
//! undo a later local change. Other records are applied through [`Persisted`]'s write lock and
//! never written back (no echo). Applying is idempotent: a record equal to what the replica
//! already serves changes nothing. A watch that ends (NATS went away) is opened again every
//! second; the replica serves its local view meanwhile.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{Operation, Store};
use futures_util::StreamExt;

use super::store::{ImageRecord, WorkerRecord, IMAGE_KEY};
use super::Cluster;
use crate::state::Persisted;
use kvroute_core::router::Router;
use kvroute_policy::PolicyRegistry;

/// Starts watching the cluster's buckets for the life of the process.
pub fn start(
    cluster: Arc<Cluster>,
    persisted: Arc<Persisted>,
    router: Arc<Router>,
    policies: Arc<PolicyRegistry>,
) {
    let me = cluster.replica_id.clone();
    {
        let (kv, me, persisted) = (cluster.workers.clone(), me.clone(), persisted.clone());
        cluster.runtime.spawn(async move {
            watch_forever(kv, "workers", move |key, value| {
                let id: u64 = key.parse().map_err(|_| format!("key {key:?}"))?;
                let record: WorkerRecord = match value {
                    Some(v) => serde_json::from_slice(&v).map_err(|e| e.to_string())?,
                    // A KV delete (not written by kvroute, which writes tombstones): removed.
                    None => WorkerRecord {
                        origin: String::new(),
                        worker: None,
                    },
                };
                if record.origin == me {
                    return Ok(None);
                }
                let (persisted, router) = (persisted.clone(), router.clone());
                Ok(Some(apply(move || {
                    if persisted.apply_remote_worker(&router, id, record.worker.as_ref()) {
                        tracing::info!(
                            worker_id = id,
                            origin = %record.origin,
                            removed = record.worker.is_none(),
                            "worker change from another replica applied"
                        );
                    }
                })))
            })
            .await
        });
    }
    {
        let kv = cluster.policies.clone();
        cluster.runtime.spawn(async move {
            watch_forever(kv, "policies", move |key, value| {
                let Some(v) = value.filter(|_| key == IMAGE_KEY) else {
                    return Ok(None);
                };
                let record: ImageRecord = serde_json::from_slice(&v).map_err(|e| e.to_string())?;
                if record.origin == me {
                    return Ok(None);
                }
                let (persisted, policies) = (persisted.clone(), policies.clone());
                Ok(Some(apply(move || {
                    match persisted.apply_remote_policies(&policies, &record.image) {
                        Ok(true) => tracing::info!(
                            origin = %record.origin,
                            active = record
                                .image
                                .active
                                .as_ref()
                                .map(|a| format!("{} v{}", a.name, a.version)),
                            "policy change from another replica applied"
                        ),
                        Ok(false) => {}
                        Err(e) => tracing::error!(
                            origin = %record.origin,
                            error = %e,
                            "a policy change from another replica is refused by this replica's \
                             runtime: this replica keeps its policies as they were"
                        ),
                    }
                })))
            })
            .await
        });
    }
}

/// Runs `f` on the blocking pool (applying may compile components, and reading component bytes
/// waits for this very runtime).
fn apply(f: impl FnOnce() + Send + 'static) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(f)
}

/// Watches every key of `kv`, calling `on_entry(key, value)` (`None`: deleted) in order and
/// waiting for each application before the next; reopens the watch when it ends.
async fn watch_forever(
    kv: Store,
    what: &'static str,
    on_entry: impl Fn(
        String,
        Option<bytes::Bytes>,
    ) -> Result<Option<tokio::task::JoinHandle<()>>, String>,
) {
    loop {
        match kv.watch_with_history(">").await {
            Ok(mut entries) => {
                while let Some(entry) = entries.next().await {
                    let entry = match entry {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(bucket = what, error = %e, "cluster watch error");
                            break;
                        }
                    };
                    let value = match entry.operation {
                        Operation::Put => Some(entry.value),
                        Operation::Delete | Operation::Purge => None,
                    };
                    match on_entry(entry.key.clone(), value) {
                        Ok(Some(done)) => {
                            let _ = done.await;
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(
                            bucket = what,
                            key = %entry.key,
                            error = %e,
                            "a record of the cluster's state that this replica cannot read: skipped"
                        ),
                    }
                }
            }
            Err(e) => tracing::warn!(bucket = what, error = %e, "cannot watch the cluster's state"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
