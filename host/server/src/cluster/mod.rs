//! Cluster mode (`kvroute serve --cluster nats://HOST:PORT [--cluster-name NAME]`): replicas that
//! serve the same workers and policies because they keep them in one NATS server's JetStream.
//!
//! Why NATS: it is the shared medium Dynamo's router replicas use; JetStream keeps what must
//! persist (key-value buckets, an object store for component bytes) and its watches tell every
//! replica about every change, so no consensus or gossip of our own is needed.
//!
//! [`Cluster`] is the connection and the buckets; [`store::ClusterStore`] is the
//! [`crate::state::StateStore`] over them (the same write-through with undo as `--state-dir`);
//! [`watch`] applies the changes other replicas make. NATS calls run on a runtime of their own
//! (one thread, `kvroute-nats`), so the synchronous store calls made from the serving threads or
//! the blocking pool never block a runtime that the NATS client itself needs.
//!
//! Layout (NAME is the cluster name):
//! ```text
//! KV bucket  kvroute-NAME-workers     key: worker id   value: {"origin": REPLICA, "worker": {spec, draining}}
//! KV bucket  kvroute-NAME-policies    key: image       value: {"origin": REPLICA, "image": {...}}
//!                                     key: rollout     value: {"origin": REPLICA, "rollout":
//!                                                        {shadows, canary, records}} (written by
//!                                                        compare-and-set on its revision)
//!                                     key: outcomes.ID.REPLICA  value: {"seq", "batch"}: what
//!                                                        REPLICA published of canary ID, for
//!                                                        replicas that start later ([`rollout`])
//! objects    kvroute-NAME-components  name: sha256 hex of a component, its bytes
//! subject    kvroute.NAME.bookings    booking events, MessagePack batches ([`bookings`], [`outbox`])
//! subject    kvroute.NAME.heartbeats  {"origin", "sent_us", "bookings"} every 200 ms ([`heartbeat`])
//! subject    kvroute.NAME.kv_events   KV events posted over HTTP, relayed ([`kv_events`])
//! subject    kvroute.NAME.rollout     a canary's new outcomes, JSON batches every 100 ms ([`rollout`])
//! ```
//!
//! The rollout (docs/POLICIES.md, "Shared between cluster replicas"): what runs (shadow and canary
//! specs) and how canaries ended (records) is state, in the `rollout` key, so a change on any
//! replica, and a guardrail's verdict on any replica, takes effect on all; a canary's figures are
//! merged from every replica's [`rollout`] batches, so every replica reports and judges the fleet's.

pub mod bookings;
pub mod early_frees;
pub mod heartbeat;
pub mod kv_events;
pub mod outbox;
pub mod rollout;
pub mod store;
pub mod sync;
pub mod watch;

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store};

use crate::state::StateError;

/// How long one store call may take before it is answered as failed (503, nothing changed).
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting at start may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks a cluster URL: `nats://HOST:PORT`.
pub fn parse_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("nats://")
        .ok_or_else(|| format!("{url:?} is not nats://HOST:PORT"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("{url:?} has no port (nats://HOST:PORT)"))?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!("{url:?} is not nats://HOST:PORT"));
    }
    Ok(())
}

/// Checks a cluster name: 1 to 64 of `A-Z a-z 0-9 _ -` (it is part of bucket names).
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'"
        ))
    }
}

/// A replica's connection to its cluster.
pub struct Cluster {
    pub name: String,
    /// This replica's id (random at each start): the origin tag of its writes.
    pub replica_id: String,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) client: async_nats::Client,
    pub(crate) workers: kv::Store,
    pub(crate) policies: kv::Store,
    pub(crate) components: object_store::ObjectStore,
}

impl Cluster {
    /// Connects to `url` and opens (creating them if missing) the cluster's buckets.
    pub fn connect(url: &str, name: &str) -> Result<Self, String> {
        let runtime = start_runtime()?;
        let replica_id = format!("{:016x}", rand::random::<u64>());
        let (url, bucket) = (url.to_string(), format!("kvroute-{name}"));
        let opened = run_on(&runtime, CONNECT_TIMEOUT, async move {
            let client = async_nats::ConnectOptions::new()
                .name("kvroute")
                // Our own booking messages and heartbeats need not come back (sync.rs);
                // JetStream deliveries, the buckets' watches included, are not affected.
                .no_echo()
                .retry_on_initial_connect()
                .connect(url.as_str())
                .await
                .map_err(|e| format!("cannot connect to {url}: {e}"))?;
            let js = jetstream::new(client.clone());
            let workers = open_kv(&js, &format!("{bucket}-workers")).await?;
            let policies = open_kv(&js, &format!("{bucket}-policies")).await?;
            let components = match js.get_object_store(format!("{bucket}-components")).await {
                Ok(s) => s,
                Err(_) => {
                    js.create_object_store(object_store::Config {
                        bucket: format!("{bucket}-components"),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| format!("cannot open the object store {bucket}-components: {e}"))?
                }
            };
            Ok::<_, String>((client, workers, policies, components))
        })
        .map_err(|e| e.to_string())??;
        let (client, workers, policies, components) = opened;
        Ok(Self {
            name: name.to_string(),
            replica_id,
            runtime,
            client,
            workers,
            policies,
            components,
        })
    }

    /// Runs `fut` on the NATS runtime and waits for it (from any thread, async or not).
    pub(crate) fn run<T: Send + 'static>(
        &self,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, StateError> {
        run_on(&self.runtime, OP_TIMEOUT, fut).map_err(|e| StateError::Io {
            path: self.describe(),
            message: e,
        })
    }

    /// Where the state is, for logs and errors.
    pub fn describe(&self) -> String {
        format!("NATS cluster {}", self.name)
    }

    /// The cluster's metrics: `kvroute_cluster_nats_connected`, read at each scrape.
    pub fn renderer(self: &std::sync::Arc<Self>) -> crate::http::metrics::ExtraRenderer {
        let c = self.clone();
        std::sync::Arc::new(move |out: &mut String| {
            out.push_str(
                "# HELP kvroute_cluster_nats_connected 1 while this replica is connected to the \
                 cluster's NATS server, 0 while it is reconnecting\n\
                 # TYPE kvroute_cluster_nats_connected gauge\n",
            );
            out.push_str(&format!(
                "kvroute_cluster_nats_connected {}\n",
                u8::from(c.connected())
            ));
        })
    }

    /// Whether the client is connected to NATS now.
    pub fn connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }
}

/// Subscribes to core subject `subject` and hands every message's payload to `on`; subscribes
/// again if the subscription ends (the client itself resubscribes across reconnects).
pub(crate) async fn subscribe_forever(
    client: async_nats::Client,
    subject: String,
    mut on: impl FnMut(&[u8]),
) {
    use futures_util::StreamExt;
    loop {
        match client.subscribe(subject.clone()).await {
            Ok(mut sub) => {
                while let Some(msg) = sub.next().await {
                    on(&msg.payload);
                }
            }
            Err(e) => tracing::warn!(%subject, error = %e, "cannot subscribe"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Appends `registry`'s metrics to a scrape, in the text format.
pub(crate) fn render(registry: &prometheus::Registry, out: &mut String) {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    if prometheus::TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .is_ok()
    {
        out.push_str(&String::from_utf8_lossy(&buf));
    }
}

/// Opens a key-value bucket, creating it (one value per key) if missing.
async fn open_kv(js: &jetstream::Context, bucket: &str) -> Result<kv::Store, String> {
    if let Ok(s) = js.get_key_value(bucket).await {
        return Ok(s);
    }
    let created = js
        .create_key_value(kv::Config {
            bucket: bucket.to_string(),
            history: 1,
            num_replicas: 1,
            ..Default::default()
        })
        .await;
    match created {
        Ok(store) => Ok(store),
        // Another replica may have created it in the meantime: open it.
        Err(c) => js.get_key_value(bucket).await.map_err(|e| {
            format!("cannot open the key-value bucket {bucket}: {e} (creating it: {c})")
        }),
    }
}

/// A current-thread runtime on a thread of its own, kept for the process's life.
fn start_runtime() -> Result<tokio::runtime::Handle, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the NATS runtime: {e}"))?;
    let handle = rt.handle().clone();
    std::thread::Builder::new()
        .name("kvroute-nats".into())
        .spawn(move || rt.block_on(std::future::pending::<()>()))
        .map_err(|e| format!("cannot start the NATS thread: {e}"))?;
    Ok(handle)
}

/// Spawns `fut` on `runtime` and waits for it at most `timeout`.
fn run_on<T: Send + 'static>(
    runtime: &tokio::runtime::Handle,
    timeout: Duration,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = tx.send(tokio::time::timeout(timeout, fut).await);
    });
    match rx.recv() {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(format!("no answer from NATS within {timeout:?}")),
        Err(_) => Err("the NATS runtime stopped".into()),
    }
}
