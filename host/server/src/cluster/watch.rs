//! Applying the changes other replicas make: one watch per bucket, on the NATS runtime, and a
//! reconcile each time the connection comes back.
//!
//! A watch starts with the last value of every key (so nothing written between the start-up load
//! and the watch is missed) and then delivers every change in order. Records this replica wrote
//! (`origin` is its id) are skipped: they are already applied here, and applying them again could
//! undo a later local change. Other records are applied through [`Persisted`]'s write lock and
//! never written back (no echo), and only if newer (by revision) than what this replica last
//! wrote or applied for that key: two replicas writing one key at once both end with the record
//! the bucket kept last. Applying is idempotent: a record equal to what the replica already
//! serves changes nothing.
//!
//! NATS going away: the replica serves its local view (routing never waits on NATS) and writes
//! fail at once (see [`super::store`]). A supervisor polls the client's connection every 100 ms;
//! when it is back (after a disconnection, or a new connection such as a restarted nats-server on
//! the same address, whose JetStream store on disk still holds the buckets), it stops the watches
//! (their consumers may have died with the server), makes the replica what the buckets hold
//! ([`Persisted::reconcile`]: changes other replicas made meanwhile, and a write of this replica
//! that the client had queued and sent after all), and opens the watches again.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{Operation, Store};
use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::store::{ImageRecord, RolloutRecord, WorkerRecord, IMAGE_KEY, ROLLOUT_KEY};
use super::Cluster;
use crate::state::Persisted;
use kvroute_core::router::Router;
use kvroute_policy::PolicyRegistry;

/// How often the supervisor looks at the connection.
const POLL: Duration = Duration::from_millis(100);

/// What the watches apply to.
#[derive(Clone)]
struct Target {
    me: String,
    persisted: Arc<Persisted>,
    router: Arc<Router>,
    policies: Arc<PolicyRegistry>,
}

/// Starts watching the cluster's buckets for the life of the process.
pub fn start(
    cluster: Arc<Cluster>,
    persisted: Arc<Persisted>,
    router: Arc<Router>,
    policies: Arc<PolicyRegistry>,
) {
    let target = Target {
        me: cluster.replica_id.clone(),
        persisted,
        router,
        policies,
    };
    let runtime = cluster.runtime.clone();
    runtime.spawn(supervise(cluster, target));
}

/// Keeps the watches running and reconciles after every reconnection.
async fn supervise(cluster: Arc<Cluster>, target: Target) {
    let connects = || cluster.client.statistics().connects.load(Ordering::Relaxed);
    let mut seen = connects();
    let mut watches = open_watches(&cluster, &target);
    let mut behind = false;
    loop {
        tokio::time::sleep(POLL).await;
        if !cluster.connected() {
            if !behind {
                tracing::warn!(
                    "lost the cluster's NATS server: serving the local view, refusing writes \
                     (503 cluster_unavailable) until it is back"
                );
            }
            behind = true;
            continue;
        }
        let now = connects();
        if now != seen {
            // Reconnected between two polls.
            seen = now;
            behind = true;
        }
        if !behind {
            continue;
        }
        for w in watches.drain(..) {
            w.abort();
        }
        let t = target.clone();
        let done =
            tokio::task::spawn_blocking(move || t.persisted.reconcile(&t.router, &t.policies))
                .await;
        match done {
            Ok(Ok(r)) => {
                tracing::info!(
                    workers_changed = r.workers,
                    policies_changed = r.policies,
                    "back on the cluster's NATS server: reconciled with its state, watching again"
                );
                behind = false;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot reconcile with the cluster's state yet; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => tracing::error!(error = %e, "the reconcile task failed; retrying"),
        }
        // Watching again either way: a reconcile that failed is retried, and the watches
        // deliver the latest records meanwhile (older ones than those held are skipped).
        watches = open_watches(&cluster, &target);
    }
}

/// Opens one watch per bucket.
fn open_watches(cluster: &Cluster, target: &Target) -> Vec<JoinHandle<()>> {
    let workers = {
        let (kv, t) = (cluster.workers.clone(), target.clone());
        cluster.runtime.spawn(async move {
            watch_forever(kv, "workers", move |key, value, revision| {
                let id: u64 = key.parse().map_err(|_| format!("key {key:?}"))?;
                let record: WorkerRecord = match value {
                    Some(v) => serde_json::from_slice(&v).map_err(|e| e.to_string())?,
                    // A KV delete (not written by kvroute, which writes tombstones): removed.
                    None => WorkerRecord {
                        origin: String::new(),
                        worker: None,
                    },
                };
                if record.origin == t.me {
                    return Ok(None);
                }
                let t = t.clone();
                Ok(Some(apply(move || {
                    if t.persisted.apply_remote_worker(
                        &t.router,
                        id,
                        record.worker.as_ref(),
                        revision,
                    ) {
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
        })
    };
    let policies = {
        let (kv, t) = (cluster.policies.clone(), target.clone());
        cluster.runtime.spawn(async move {
            watch_forever(kv, "policies", move |key, value, revision| {
                if key == ROLLOUT_KEY {
                    let Some(v) = value else {
                        return Ok(None);
                    };
                    let record: RolloutRecord =
                        serde_json::from_slice(&v).map_err(|e| e.to_string())?;
                    if record.origin == t.me {
                        return Ok(None);
                    }
                    let t = t.clone();
                    return Ok(Some(apply(move || {
                        if t.persisted
                            .apply_remote_rollout(&t.policies, &record.rollout, revision)
                        {
                            tracing::info!(
                                origin = %record.origin,
                                shadows = record.rollout.shadows.len(),
                                canary = record.rollout.canary.as_ref().map(|c| c.id),
                                records = record.rollout.records.len(),
                                "rollout change from another replica applied"
                            );
                        }
                    })));
                }
                let Some(v) = value.filter(|_| key == IMAGE_KEY) else {
                    return Ok(None);
                };
                let record: ImageRecord = serde_json::from_slice(&v).map_err(|e| e.to_string())?;
                if record.origin == t.me {
                    return Ok(None);
                }
                let t = t.clone();
                Ok(Some(apply(move || {
                    match t
                        .persisted
                        .apply_remote_policies(&t.policies, &record.image, revision)
                    {
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
        })
    };
    vec![workers, policies]
}

/// Runs `f` on the blocking pool (applying may compile components, and reading component bytes
/// waits for this very runtime).
fn apply(f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    tokio::task::spawn_blocking(f)
}

/// Watches every key of `kv`, calling `on_entry(key, value, revision)` (`None`: deleted) in order
/// and waiting for each application before the next; reopens the watch when it ends.
async fn watch_forever(
    kv: Store,
    what: &'static str,
    on_entry: impl Fn(String, Option<bytes::Bytes>, u64) -> Result<Option<JoinHandle<()>>, String>,
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
                    match on_entry(entry.key.clone(), value, entry.revision) {
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
