//! A canary's outcomes shared between replicas: every replica's `GET .../canary` reports, and its
//! guardrails judge, the arms as measured by every replica.
//!
//! What runs (the shadows' and the canary's specs) and how canaries ended (their records) is
//! state: it is written through the [`crate::state::Persisted`] store under the policies bucket's
//! `rollout` key and applied by [`super::watch`]. The figures are not: they change at request
//! rate, so each replica publishes its own new outcomes and decisions, per arm, as one
//! [`OutcomeBatch`] every [`EVERY`] on the core subject `kvroute.NAME.rollout` (fire and forget,
//! like the bookings), and every other replica merges them into the canary of the same id.
//!
//! Off the request path: the data path appends an outcome to the canary's own buffer (bounded:
//! past 20,000 waiting outcomes one is counted and left out); the
//! publisher, on the NATS runtime, takes the buffer at once. While the client is not connected a
//! batch is dropped and counted (`kvroute_cluster_rollout_dropped_total{reason="disconnected"}`)
//! rather than queued: the replica's own figures keep it, the others miss it.
//!
//! A replica that starts while a canary runs takes the canary up from the shared state with its
//! id and start time. So that its figures are the fleet's from the canary's start, every replica
//! also keeps everything it published of the running canary in the policies bucket, key
//! `outcomes.ID.REPLICA` (`{"seq", "batch"}`: the last message it includes, and the outcomes as
//! one batch, at most 10,000 samples per arm and figure, `kvroute_policy::rollout::SNAPSHOT_SAMPLES`), rewritten at most every
//! [`SNAPSHOT_EVERY`] while it changes and removed when the canary ends. At start, after
//! subscribing and before merging any message, a replica merges every other replica's snapshot
//! of the running canary (a replica that is gone, its own previous run included, too) and then
//! only the messages numbered after each one. What a replica published after its last snapshot
//! and before the newcomer subscribed (at most [`SNAPSHOT_EVERY`] of it) is missing there.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};

use super::Cluster;
use kvroute_policy::{OutcomeBatch, PolicyRegistry};

/// How often a replica publishes its new outcomes (when it has any).
pub const EVERY: Duration = Duration::from_millis(100);
/// How often a replica rewrites its snapshot of what it published (when it changed).
pub const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);

/// The key of `replica`'s snapshot of canary `id` in the policies bucket.
fn snapshot_key(id: u64, replica: &str) -> String {
    format!("outcomes.{id}.{replica}")
}

/// A replica's snapshot of what it published of one canary.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Snapshot {
    seq: u64,
    batch: OutcomeBatch,
}

/// One message on `kvroute.NAME.rollout`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutMessage {
    pub origin: String,
    /// Numbered from 1 per replica: a gap is counted as lost.
    pub seq: u64,
    pub batch: OutcomeBatch,
}

#[derive(Clone)]
struct Metrics {
    registry: Registry,
    published: IntCounter,
    merged: IntCounter,
    dropped: IntCounterVec,
}

/// Why outcomes were not shared or not merged (the `reason` label).
const DROP_REASONS: [&str; 5] = [
    "disconnected",
    "buffer_full",
    "unknown_canary",
    "malformed",
    "gap",
];

impl Metrics {
    fn new() -> Self {
        let registry = Registry::new();
        let published = IntCounter::new(
            "kvroute_cluster_rollout_published_total",
            "Canary outcomes this replica published to the others",
        )
        .expect("valid metric");
        let merged = IntCounter::new(
            "kvroute_cluster_rollout_merged_total",
            "Canary outcomes from other replicas merged here",
        )
        .expect("valid metric");
        let dropped = IntCounterVec::new(
            Opts::new(
                "kvroute_cluster_rollout_dropped_total",
                "Canary outcomes not shared (disconnected, buffer_full) or not merged \
                 (unknown_canary, malformed, gap: messages lost), by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        for c in [&published, &merged] {
            registry.register(Box::new(c.clone())).expect("unique");
        }
        registry
            .register(Box::new(dropped.clone()))
            .expect("unique");
        for r in DROP_REASONS {
            dropped.with_label_values(&[r]);
        }
        Self {
            registry,
            published,
            merged,
            dropped,
        }
    }
}

/// The outcome sharing of one replica.
pub struct RolloutSync {
    metrics: Metrics,
}

impl RolloutSync {
    /// Starts publishing this replica's canary outcomes and merging the others'.
    pub fn start(cluster: Arc<Cluster>, policies: Arc<PolicyRegistry>) -> Arc<Self> {
        let sync = Arc::new(Self {
            metrics: Metrics::new(),
        });
        let subject = format!("kvroute.{}.rollout", cluster.name);
        {
            let (s, c, p, subject) = (
                sync.clone(),
                cluster.clone(),
                policies.clone(),
                subject.clone(),
            );
            cluster
                .runtime
                .spawn(async move { s.publish_forever(c, p, subject).await });
        }
        let (s, me) = (sync.clone(), cluster.replica_id.clone());
        let (c, p) = (cluster.clone(), policies.clone());
        cluster.runtime.spawn(async move {
            use futures_util::StreamExt;
            let mut seqs = std::collections::HashMap::<String, u64>::new();
            let mut caught_up = false;
            loop {
                match c.client.subscribe(subject.clone()).await {
                    Ok(mut sub) => {
                        if !caught_up {
                            // Subscribed first: what is published from now on waits in the
                            // subscription while the snapshots are merged.
                            s.catch_up(&c, &p, &mut seqs).await;
                            caught_up = true;
                        }
                        while let Some(msg) = sub.next().await {
                            s.on_message(&me, &p, &mut seqs, &msg.payload);
                        }
                    }
                    Err(e) => tracing::warn!(%subject, error = %e, "cannot subscribe"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        sync
    }

    /// Merges every other replica's snapshot of the running canary (at start).
    async fn catch_up(
        &self,
        cluster: &Cluster,
        policies: &PolicyRegistry,
        seqs: &mut std::collections::HashMap<String, u64>,
    ) {
        use futures_util::StreamExt;
        let Some(id) = policies.running_canary_id() else {
            return;
        };
        let prefix = snapshot_key(id, "");
        let kv = cluster.policies.clone();
        let read = async {
            let mut keys = kv.keys().await.map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            while let Some(k) = keys.next().await {
                let k = k.map_err(|e| e.to_string())?;
                if let Some(origin) = k.strip_prefix(&prefix) {
                    if origin == cluster.replica_id {
                        continue;
                    }
                    if let Some(v) = kv.get(&k).await.map_err(|e| e.to_string())? {
                        out.push((origin.to_string(), v));
                    }
                }
            }
            Ok::<_, String>(out)
        };
        let snapshots = match tokio::time::timeout(Duration::from_secs(5), read).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot read the canary's outcomes from the other replicas: counting from now on");
                return;
            }
            Err(_) => {
                tracing::warn!("no answer reading the canary's outcomes from the other replicas: counting from now on");
                return;
            }
        };
        let mut merged = 0;
        for (origin, bytes) in snapshots {
            let Ok(snap) = serde_json::from_slice::<Snapshot>(&bytes) else {
                self.metrics.dropped.with_label_values(&["malformed"]).inc();
                continue;
            };
            let n = snap.batch.requests();
            if policies.merge_outcome_batch(&snap.batch) {
                self.metrics.merged.inc_by(n);
                merged += n;
                seqs.insert(origin, snap.seq);
            }
        }
        tracing::info!(
            canary = id,
            outcomes = merged,
            "took up the canary's outcomes so far from the other replicas"
        );
    }

    /// One message from another replica.
    fn on_message(
        &self,
        me: &str,
        policies: &PolicyRegistry,
        seqs: &mut std::collections::HashMap<String, u64>,
        payload: &[u8],
    ) {
        let s = self;
        {
            {
                let Ok(m) = serde_json::from_slice::<RolloutMessage>(payload) else {
                    s.metrics.dropped.with_label_values(&["malformed"]).inc();
                    return;
                };
                if m.origin == me {
                    return;
                }
                {
                    let last = seqs.entry(m.origin.clone()).or_insert(0);
                    if m.seq <= *last {
                        return; // Seen already.
                    }
                    if *last > 0 && m.seq > *last + 1 {
                        s.metrics
                            .dropped
                            .with_label_values(&["gap"])
                            .inc_by(m.seq - *last - 1);
                    }
                    *last = m.seq;
                }
                let n = m.batch.requests();
                if policies.merge_outcome_batch(&m.batch) {
                    s.metrics.merged.inc_by(n);
                } else {
                    s.metrics
                        .dropped
                        .with_label_values(&["unknown_canary"])
                        .inc_by(n);
                }
            }
        }
    }

    async fn publish_forever(
        self: Arc<Self>,
        cluster: Arc<Cluster>,
        policies: Arc<PolicyRegistry>,
        subject: String,
    ) {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seq = 0u64;
        let mut last_snapshot = tokio::time::Instant::now();
        // The canary whose snapshot this replica keeps in the bucket.
        let mut kept: Option<u64> = None;
        loop {
            every.tick().await;
            if last_snapshot.elapsed() >= SNAPSHOT_EVERY && cluster.connected() {
                last_snapshot = tokio::time::Instant::now();
                self.keep_snapshot(&cluster, &policies, &mut kept).await;
            }
            let Some(batch) = policies.take_outcome_batch() else {
                continue;
            };
            let n = batch.requests();
            if batch.dropped > 0 {
                self.metrics
                    .dropped
                    .with_label_values(&["buffer_full"])
                    .inc_by(batch.dropped);
            }
            if !cluster.connected() {
                self.metrics
                    .dropped
                    .with_label_values(&["disconnected"])
                    .inc_by(n);
                continue;
            }
            seq += 1;
            let message = RolloutMessage {
                origin: cluster.replica_id.clone(),
                seq,
                batch,
            };
            let Ok(bytes) = serde_json::to_vec(&message) else {
                continue;
            };
            match cluster.client.publish(subject.clone(), bytes.into()).await {
                Ok(()) => {
                    policies.note_published(seq, &message.batch);
                    self.metrics.published.inc_by(n);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot publish canary outcomes");
                    self.metrics
                        .dropped
                        .with_label_values(&["disconnected"])
                        .inc_by(n);
                }
            }
        }
    }

    /// Rewrites this replica's snapshot of the running canary if it changed; removes the one of
    /// a canary that ended. Best effort: a failure is logged and retried at the next change.
    async fn keep_snapshot(
        &self,
        cluster: &Cluster,
        policies: &PolicyRegistry,
        kept: &mut Option<u64>,
    ) {
        let running = policies.running_canary_id();
        if let Some(old) = kept.filter(|k| Some(*k) != running) {
            let key = snapshot_key(old, &cluster.replica_id);
            match cluster.policies.purge(&key).await {
                Ok(()) => *kept = None,
                Err(e) => tracing::debug!(%key, error = %e, "cannot remove a canary snapshot"),
            }
        }
        let Some((seq, batch)) = policies.published_snapshot() else {
            return;
        };
        let id = batch.canary;
        let key = snapshot_key(id, &cluster.replica_id);
        let Ok(bytes) = serde_json::to_vec(&Snapshot { seq, batch }) else {
            return;
        };
        match cluster.policies.put(&key, bytes.into()).await {
            Ok(_) => *kept = Some(id),
            Err(e) => {
                tracing::warn!(%key, error = %e, "cannot keep this replica's canary outcomes in the cluster")
            }
        }
    }

    /// The sharing's metrics, rendered at each scrape.
    pub fn renderer(self: &Arc<Self>) -> crate::http::metrics::ExtraRenderer {
        let s = self.clone();
        Arc::new(move |out: &mut String| super::render(&s.metrics.registry, out))
    }
}
