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
//! id and start time, and from then on merges the others' new outcomes: what they measured
//! before it started is not replayed to it (its figures are the fleet's since it joined).

use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};

use super::Cluster;
use kvroute_policy::{OutcomeBatch, PolicyRegistry};

/// How often a replica publishes its new outcomes (when it has any).
pub const EVERY: Duration = Duration::from_millis(100);

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
        let mut seqs = std::collections::HashMap::<String, u64>::new();
        cluster.runtime.spawn(super::subscribe_forever(
            cluster.client.clone(),
            subject,
            move |payload| {
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
            },
        ));
        sync
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
        loop {
            every.tick().await;
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
                Ok(()) => self.metrics.published.inc_by(n),
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

    /// The sharing's metrics, rendered at each scrape.
    pub fn renderer(self: &Arc<Self>) -> crate::http::metrics::ExtraRenderer {
        let s = self.clone();
        Arc::new(move |out: &mut String| super::render(&s.metrics.registry, out))
    }
}
