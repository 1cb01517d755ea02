//! Live booking sync between replicas: every replica's load counts every replica's bookings.
//!
//! [`BookingSync::start`] installs the [`Outbox`] as the router's booking observer, and starts on
//! the NATS runtime: the publisher ([`super::outbox::publish_forever`]), the subscriber that
//! applies other replicas' booking messages to the router (as remote bookings tagged with their
//! origin), the heartbeat and the reaper that forgets replicas not heard from for
//! `replica_timeout_ms` ([`super::heartbeat`]). The connection is made with `no_echo`, so the
//! messages this replica publishes do not come back to it (a replica that did not skip its own by
//! origin would count them twice, and decoding them cost as much as the others').
//!
//! Applying is done on the NATS runtime's thread, message by message, in arrival order (NATS
//! keeps one publisher's order), so a replica's `free` never overtakes its `book`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use super::bookings::{self, SyncBatch, SyncOp};
use super::early_frees::EarlyFrees;
use super::heartbeat::{Heartbeat, Peers, SeqCheck, HEARTBEAT_EVERY};
use super::outbox::{self, Outbox, OutboxObserver};
use super::Cluster;
use crate::http::{ClusterStatus, ClusterView, PeerStatus};
use kvroute_core::router::{RemoteBookingError, Router};

/// Buckets of the sync lag, in seconds: fine below 10 ms, where it should be.
const LAG_BUCKETS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
    0.25, 1.0,
];

/// The sync's metrics (API.md §metrics).
#[derive(Clone)]
struct SyncMetrics {
    registry: Registry,
    lag: Histogram,
    published: IntCounter,
    applied: IntCounter,
    dropped: IntCounterVec,
    duplicates: IntCounter,
    replicas: IntGauge,
    replicas_lost: IntCounter,
}

impl SyncMetrics {
    fn new() -> Self {
        let registry = Registry::new();
        let lag = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_cluster_sync_lag_seconds",
                "Time from a booking event on another replica to its application here",
            )
            .buckets(LAG_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let published = IntCounter::new(
            "kvroute_cluster_sync_published_total",
            "Booking messages this replica published",
        )
        .expect("valid metric");
        let applied = IntCounter::new(
            "kvroute_cluster_sync_applied_total",
            "Booking messages from other replicas applied here",
        )
        .expect("valid metric");
        let dropped = IntCounterVec::new(
            Opts::new(
                "kvroute_cluster_sync_dropped_total",
                "Booking messages from other replicas lost or not applied, by reason",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let duplicates = IntCounter::new(
            "kvroute_cluster_sync_duplicates_total",
            "Booking messages received again (sequence number already seen), skipped",
        )
        .expect("valid metric");
        let replicas = IntGauge::new(
            "kvroute_cluster_replicas",
            "Replicas of the cluster alive as this replica sees them, itself included",
        )
        .expect("valid metric");
        let replicas_lost = IntCounter::new(
            "kvroute_cluster_replicas_lost_total",
            "Replicas forgotten after replica_timeout_ms of silence (their bookings dropped)",
        )
        .expect("valid metric");
        for c in [&published, &applied, &duplicates, &replicas_lost] {
            registry.register(Box::new(c.clone())).expect("unique");
        }
        registry.register(Box::new(lag.clone())).expect("unique");
        registry
            .register(Box::new(dropped.clone()))
            .expect("unique");
        registry
            .register(Box::new(replicas.clone()))
            .expect("unique");
        // Every reason is present from the start, at 0.
        for r in DROP_REASONS {
            dropped.with_label_values(&[r]);
        }
        replicas.set(1);
        Self {
            registry,
            lag,
            published,
            applied,
            dropped,
            duplicates,
            replicas,
            replicas_lost,
        }
    }
}

/// Why a message from another replica was not applied (the `reason` label).
const DROP_REASONS: [&str; 6] = [
    "gap",
    "freed_before_booked",
    "malformed",
    "unknown_candidate",
    "duplicate_request",
    "unknown_request",
];

/// The booking sync of one replica.
pub struct BookingSync {
    cluster: Arc<Cluster>,
    router: Arc<Router>,
    peers: Peers,
    early_frees: EarlyFrees,
    timeout: Duration,
    metrics: SyncMetrics,
}

impl BookingSync {
    /// Starts syncing `router`'s bookings with the other replicas of `cluster`.
    pub fn start(cluster: Arc<Cluster>, router: Arc<Router>, timeout: Duration) -> Arc<Self> {
        let sync = Arc::new(Self {
            cluster: cluster.clone(),
            router: router.clone(),
            peers: Peers::default(),
            early_frees: EarlyFrees::default(),
            timeout,
            metrics: SyncMetrics::new(),
        });
        let prefix = format!("kvroute.{}", cluster.name);
        let outbox = Outbox::new();
        router.set_booking_observer(Some(Box::new(OutboxObserver(outbox.clone()))));
        {
            let s = sync.clone();
            cluster.runtime.spawn(outbox::publish_forever(
                cluster.client.clone(),
                format!("{prefix}.bookings"),
                cluster.replica_id.clone(),
                outbox,
                move |n| s.metrics.published.inc_by(n),
            ));
        }
        {
            let s = sync.clone();
            let subject = format!("{prefix}.bookings");
            cluster.runtime.spawn(super::subscribe_forever(
                cluster.client.clone(),
                subject,
                move |payload| s.on_booking_message(payload),
            ));
        }
        {
            let s = sync.clone();
            let subject = format!("{prefix}.heartbeats");
            cluster.runtime.spawn(super::subscribe_forever(
                cluster.client.clone(),
                subject,
                move |payload| s.on_heartbeat(payload),
            ));
        }
        let s = sync.clone();
        let subject = format!("{prefix}.heartbeats");
        cluster
            .runtime
            .spawn(async move { s.beat_forever(subject).await });
        sync
    }

    /// Publishes a heartbeat every [`HEARTBEAT_EVERY`] and forgets silent replicas.
    async fn beat_forever(self: Arc<Self>, subject: String) {
        let mut every = tokio::time::interval(HEARTBEAT_EVERY.min(self.timeout / 4));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_beat: Option<Instant> = None;
        loop {
            every.tick().await;
            let now = Instant::now();
            if last_beat.is_none_or(|t| now.duration_since(t) >= HEARTBEAT_EVERY) {
                last_beat = Some(now);
                let hb = Heartbeat {
                    origin: self.cluster.replica_id.clone(),
                    sent_us: bookings::now_us(),
                    bookings: self.router.local_bookings() as u64,
                };
                if let Ok(bytes) = serde_json::to_vec(&hb) {
                    let _ = self
                        .cluster
                        .client
                        .publish(subject.clone(), bytes.into())
                        .await;
                }
            }
            for (id, n) in self.peers.expire(&self.router, now, self.timeout) {
                self.metrics.replicas_lost.inc();
                tracing::warn!(
                    replica_id = %id,
                    dropped_bookings = n,
                    timeout_ms = self.timeout.as_millis() as u64,
                    "a replica went silent: its bookings are dropped here"
                );
            }
            self.metrics.replicas.set(1 + self.peers.len() as i64);
        }
    }

    fn on_heartbeat(&self, payload: &[u8]) {
        let Ok(hb) = serde_json::from_slice::<Heartbeat>(payload) else {
            self.metrics.dropped.with_label_values(&["malformed"]).inc();
            return;
        };
        if hb.origin != self.cluster.replica_id {
            self.peers
                .heard(&hb.origin, Instant::now(), Some(hb.bookings));
        }
    }

    fn on_booking_message(&self, payload: &[u8]) {
        let Ok(batch) = SyncBatch::decode(payload) else {
            self.metrics.dropped.with_label_values(&["malformed"]).inc();
            return;
        };
        if batch.origin == self.cluster.replica_id || batch.events.is_empty() {
            return;
        }
        let now = Instant::now();
        self.peers.heard(&batch.origin, now, None);
        let count = batch.events.len() as u64;
        match self.peers.check_run(&batch.origin, batch.seq, count) {
            SeqCheck::InOrder => {}
            SeqCheck::Duplicate => {
                self.metrics.duplicates.inc_by(count);
                return;
            }
            SeqCheck::Gap(n) => {
                self.metrics.dropped.with_label_values(&["gap"]).inc_by(n);
            }
        }
        let now_us = bookings::now_us();
        for event in &batch.events {
            let failed = self.apply(&batch.origin, &event.op, now);
            let lag = now_us.saturating_sub(event.at_us) as f64 / 1e6;
            self.metrics.lag.observe(lag);
            match failed {
                None => self.metrics.applied.inc(),
                Some(reason) => self.metrics.dropped.with_label_values(&[reason]).inc(),
            }
        }
    }

    /// Applies one event from `origin`; the drop reason when it could not be.
    fn apply(&self, origin: &str, op: &SyncOp, now: Instant) -> Option<&'static str> {
        let r = &self.router;
        let unknown = |ok: bool| (!ok).then_some("unknown_request");
        match op {
            SyncOp::Book {
                request_id,
                whole_or_decode,
                prefill,
                block_hashes,
                local_hashes,
                session,
            } => {
                if self.early_frees.take(request_id, now) {
                    return Some("freed_before_booked");
                }
                let rec = SyncOp::record(
                    request_id,
                    *whole_or_decode,
                    *prefill,
                    block_hashes,
                    local_hashes.as_deref(),
                    session.as_ref(),
                );
                match r.apply_remote_book(origin, &rec, now) {
                    Ok(()) => None,
                    Err(RemoteBookingError::Duplicate(_)) => Some("duplicate_request"),
                    Err(RemoteBookingError::UnknownCandidate(_)) => Some("unknown_candidate"),
                }
            }
            SyncOp::PrefillComplete { request_id } => {
                unknown(r.apply_remote_prefill_complete(request_id).is_ok())
            }
            SyncOp::Output { request_id, tokens } => {
                unknown(r.apply_remote_output(request_id, *tokens).is_ok())
            }
            SyncOp::Free { request_id } => {
                let freed = r.apply_remote_free(request_id).is_ok();
                if !freed {
                    self.early_frees.note(request_id, now);
                }
                unknown(freed)
            }
        }
    }

    /// The sync's metrics, rendered at each scrape.
    pub fn renderer(self: &Arc<Self>) -> crate::http::metrics::ExtraRenderer {
        let s = self.clone();
        Arc::new(move |out: &mut String| {
            s.metrics.replicas.set(1 + s.peers.len() as i64);
            super::render(&s.metrics.registry, out);
        })
    }
}

/// `GET /v1/cluster` reads this replica's view through the HTTP API's own trait (`serve` hands
/// the sync in), so `http` knows nothing of the sync.
impl ClusterView for BookingSync {
    /// `GET /v1/cluster`: this replica and every other one heard from within the timeout.
    fn status(&self) -> ClusterStatus {
        let mut replicas = self.peers.status(Instant::now());
        replicas.push(PeerStatus {
            replica_id: self.cluster.replica_id.clone(),
            last_seen_ms: 0,
            bookings: self.router.local_bookings() as u64,
        });
        replicas.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        ClusterStatus {
            cluster_name: self.cluster.name.clone(),
            replica_id: self.cluster.replica_id.clone(),
            nats: if self.cluster.connected() {
                "connected"
            } else {
                "reconnecting"
            },
            replica_timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            replicas,
        }
    }
}
