//! KV events posted over HTTP to one replica, applied by every replica.
//!
//! Engines that publish over ZMQ need nothing of this: every replica subscribes to them itself
//! (docs/API.md, "The KV index"). An engine or a gateway that posts `POST /v1/events` reaches one
//! replica behind a load balancer, and the others' indexes would never learn what it said. So the
//! replica that takes a post relays the events it applied, as the same JSON the endpoint takes,
//! on the core subject `kvroute.NAME.kv_events`, and every other replica applies them as if they
//! had been posted to it. Events it refused (malformed, unknown worker) are not relayed: the
//! poster was told.
//!
//! Like the bookings, the relay is fire and forget on core NATS (an index misses what an outage
//! loses, until the engine stores the blocks again), the handler only queues the message (it
//! never waits for NATS), and a replica does not hear its own relays (the connection is
//! `no_echo`). The applying itself is the HTTP endpoint's (`http::events::apply_relayed`), given
//! to [`EventRelay::start`] as a function, so this module knows nothing of the event format.

use std::sync::Arc;

use prometheus::{IntCounter, Registry};
use tokio::sync::mpsc;

use super::Cluster;

/// What applying a relayed message did: events applied, events dropped.
pub type Applied = (u64, u64);

/// Relays this replica's posted events and applies the others'.
pub struct EventRelay {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    registry: Registry,
    published: IntCounter,
}

impl EventRelay {
    /// Starts relaying on `cluster`; `apply` applies a message from another replica (a JSON
    /// array of events as `POST /v1/events` takes them) to this replica's index.
    pub fn start(
        cluster: &Cluster,
        apply: impl Fn(&[u8]) -> Applied + Send + 'static,
    ) -> Arc<Self> {
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let published = counter(
            "kvroute_cluster_kv_events_published_total",
            "KV events posted to this replica and relayed to the others",
        );
        let applied = counter(
            "kvroute_cluster_kv_events_applied_total",
            "KV events posted to another replica and applied here",
        );
        let dropped = counter(
            "kvroute_cluster_kv_events_dropped_total",
            "KV events posted to another replica that could not be applied here",
        );
        let registry = Registry::new();
        for c in [&published, &applied, &dropped] {
            registry.register(Box::new(c.clone())).expect("unique");
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let subject = format!("kvroute.{}.kv_events", cluster.name);
        let client = cluster.client.clone();
        let out_subject = subject.clone();
        cluster.runtime.spawn(async move {
            while let Some(payload) = rx.recv().await {
                if let Err(e) = client.publish(out_subject.clone(), payload.into()).await {
                    tracing::warn!(error = %e, "cannot relay KV events");
                }
            }
        });
        cluster.runtime.spawn(super::subscribe_forever(
            cluster.client.clone(),
            subject,
            move |payload| {
                let (ok, failed) = apply(payload);
                applied.inc_by(ok);
                dropped.inc_by(failed);
            },
        ));
        Arc::new(Self {
            tx,
            registry,
            published,
        })
    }

    /// The relay's metrics, rendered at each scrape.
    pub fn renderer(self: &Arc<Self>) -> crate::http::metrics::ExtraRenderer {
        let s = self.clone();
        Arc::new(move |out: &mut String| super::render(&s.registry, out))
    }
}

/// `POST /v1/events` hands what it applied to the HTTP API's own trait (`serve` hands the relay
/// in), so `http` knows nothing of cluster mode.
impl crate::http::EventRelay for EventRelay {
    /// Queues `payload` (a JSON array of `events` events) for the other replicas; never waits.
    fn relay(&self, payload: Vec<u8>, events: u64) {
        if self.tx.send(payload).is_ok() {
            self.published.inc_by(events);
        }
    }
}
