//! KV event ingestion from vLLM and SGLang over ZMQ (SPEC §3, §4).
//!
//! An engine publishes what its KV cache stores and evicts on a ZMQ PUB socket, one MessagePack
//! batch per message `[topic, seq, payload]`, and keeps recent messages in a replay buffer behind
//! a ROUTER socket. For every worker registered with `kv_events` the host subscribes to it and
//! applies what arrives to the index through [`Router::apply_event`] (so events of a worker that
//! is no longer registered are dropped there).
//!
//! # Pieces
//! - [`decode`]: MessagePack payload → index events, with every SPEC §4 shape accepted and every
//!   drop counted by reason; nothing in a payload can panic it or make it allocate beyond the
//!   payload's size. The wire is read by `rmp-serde` through the serde model in `wire/`;
//!   `nesting.rs` caps payloads nested past rmp-serde's depth limit.
//! - [`publish`]: the other direction, batches encoded as vLLM publishes them (for `kvroute
//!   mock-engine`), checked against the decoder.
//! - [`subscriber`]: one subscription = one SUB socket on one engine rank; sequence tracking per
//!   (worker, rank); gap replay over a DEALER socket; reconnection with exponential backoff.
//! - [`EventIngestion`] (here): the manager. It reconciles subscriptions with the registry when a
//!   worker is registered, replaced or removed (the HTTP layer calls it through
//!   `AppState::on_worker_change`), and exposes its counters for `/metrics`.
//!
//! # Where it runs
//! All subscriptions run on one dedicated thread (`kvroute-kv-events`) with its own single-thread
//! tokio runtime, never on the HTTP runtime and never on a route: decoding and applying only take
//! the index's write lock in bounded chunks (see `indexer`), which is what a route can wait on.
//! `benches/events.rs` measures route latency with and without 100k blocks/s of ingestion.
//!
//! # Sequence numbers and replay
//! Per subscription we expect `seq` to be the last one + 1:
//! - the next one: apply;
//! - higher: messages were lost (PUB drops on slow subscribers, reconnects). Ask the engine's
//!   replay socket for `[last+1 ..]` (DEALER sends `["", start_seq]`; replies `["", topic, seq,
//!   payload]` or `["", seq, payload]`, ended by seq `-1` with an empty payload), apply the
//!   replayed `last+1 .. seq-1`, then the live message. Replayed messages at or past the live one
//!   are ignored: they arrive live.
//! - the first message of a subscription with `seq > 0` (we joined a running engine) is treated
//!   as a gap from 0: the replay buffer, if it reaches back that far, rebuilds the engine's state.
//! - not higher than the last one: the engine restarted (its sequence starts at 0 per process).
//!   Clear the ranks this subscription feeds, forget the sequence, and handle the message as a
//!   first one.
//!
//! Whenever events are lost for good — no replay endpoint, the replay starts past the asked
//! sequence (buffer rolled over), it ends before the live message, or it fails or times out — the
//! subscription's ranks are cleared (`Indexer::clear_candidate`) before anything else is applied:
//! a lost removal would otherwise leave the router believing in blocks the engine evicted, which
//! is worse than forgetting blocks it still holds (those come back with its next stores).
//!
//! # Endpoints and data-parallel ranks
//! `kv_events.endpoint` is the engine's configured endpoint, as given to vLLM or SGLang; rank `r`
//! publishes on `port + r` and its replay socket on `replay_port + r` (SPEC §4: the engines offset
//! both ports by the global data-parallel rank, so a worker with `dp_start` 2 publishes rank 2 on
//! `port + 2`). One subscription per rank. A `*` host (`tcp://*:5557`, as engines
//! are configured) is connected as `127.0.0.1`. Only `tcp://` endpoints are supported. The topic
//! is a ZMQ prefix filter; `""` receives everything. A non-nil `data_parallel_rank` in a batch
//! overrides the subscription's rank.
//!
//! A subscription lives while its worker is registered with the same `kv_events` and ranks. A
//! re-registration that changes them (or drops `kv_events`) stops the old subscriptions and
//! clears the worker's ranks (what they indexed can no longer be kept up to date); a removal stops
//! them (the router already dropped the worker from the index).
//!
//! # Why the pure-Rust `zeromq` crate
//! We use `zeromq` 0.7 (zmq.rs, the ZeroMQ organisation's native Rust implementation, tokio based)
//! rather than `zmq` 0.10 (bindings to libzmq):
//! - it speaks ZMTP 3 with libzmq/pyzmq: SUB with topic filters, DEALER ↔ ROUTER replay, and SUB
//!   auto-reconnect with re-subscription after the publisher restarts are all exercised against
//!   pyzmq 27.3 / libzmq 4.3.5 in `tests/zmq_ingestion.rs`;
//! - no C++ build: `zmq` 0.10 always compiles a vendored libzmq 4.3.4 with `cc`, which took about
//!   2 minutes on this 2-core machine, versus under a minute for `zeromq` and its dependencies;
//! - it is async on tokio, so a subscription is a task, not a blocked thread per socket;
//! - `zmq` (erickt/rust-zmq) has had no release since 2022; zmq.rs is released and maintained.
//!
//! zmq.rs re-connects and re-subscribes a connected SUB socket by itself when the publisher goes
//! away and comes back (an engine restart); its first connect gives up after a timeout, so the
//! subscription loop retries that (and any receive error) with exponential backoff
//! (`IngestConfig::backoff_*`).

mod batch;
pub mod decode;
mod emit;
mod identity;
mod nesting;
pub mod publish;
pub mod subscriber;
mod wire;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use decode::DropReason;
use kvroute_core::candidate::{CandidateKey, DpRank, WorkerId};
use kvroute_core::feeds::FeedCell;
use kvroute_core::router::Router;
use kvroute_core::workers::{rank_endpoints, EndpointError, Worker, WorkerChange};
use subscriber::PayloadOutcome;

/// How often the feeds' dead flags are re-evaluated (`kvroute_core::feeds::Feeds::refresh`).
const FEED_TICK: Duration = Duration::from_millis(100);

/// Timing of connections and replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// Longest one connection attempt may take.
    pub connect_timeout: Duration,
    /// Longest wait for each replay step (connect, send, each reply).
    pub replay_timeout: Duration,
    /// First wait after a failed connection; doubled after each failure up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
        }
    }
}

/// Where one subscription connects: one engine rank of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionSpec {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
}

/// The subscriptions a worker needs: one per rank, or none without `kv_events`.
pub fn subscriptions_for(worker: &Worker) -> Result<Vec<SubscriptionSpec>, EndpointError> {
    let Some(kv) = &worker.kv_events else {
        return Ok(Vec::new());
    };
    worker
        .ranks()
        .map(|rank| {
            let (endpoint, replay_endpoint) = rank_endpoints(kv, rank).map_err(|(_, e)| e)?;
            Ok(SubscriptionSpec {
                worker_id: worker.worker_id,
                dp_rank: rank,
                endpoint,
                replay_endpoint,
                topic: kv.topic.clone(),
            })
        })
        .collect()
}

/// Counters of the ingestion (monotonic).
#[derive(Debug, Default)]
pub struct IngestStats {
    /// Messages received on SUB sockets.
    pub messages: AtomicU64,
    /// Payloads decoded and applied (live and replayed).
    pub batches: AtomicU64,
    pub events_applied: AtomicU64,
    /// Events the router or index refused (unregistered worker/rank, unknown parent, self
    /// reference; the index and router count those by reason).
    pub events_refused: AtomicU64,
    pub blocks_applied: AtomicU64,
    dropped: [AtomicU64; DropReason::COUNT],
    pub gaps: AtomicU64,
    pub catch_ups: AtomicU64,
    pub replays: AtomicU64,
    pub replayed_messages: AtomicU64,
    pub replay_failed: AtomicU64,
    pub replay_rolled_over: AtomicU64,
    pub replay_incomplete: AtomicU64,
    /// Gaps on a subscription without a replay endpoint.
    pub gap_unrecoverable: AtomicU64,
    pub restarts: AtomicU64,
    /// Messages with the sequence number of the last one seen, dropped (SPEC §4: only a lower
    /// one means a restart).
    pub duplicates: AtomicU64,
    pub clears: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub socket_errors: AtomicU64,
    /// Registrations whose `kv_events` endpoint could not be subscribed to.
    pub bad_endpoints: AtomicU64,
}

impl IngestStats {
    pub fn dropped(&self, reason: DropReason, n: u64) {
        self.dropped[reason as usize].fetch_add(n, Relaxed);
    }

    pub fn dropped_count(&self, reason: DropReason) -> u64 {
        self.dropped[reason as usize].load(Relaxed)
    }

    fn batch(&self, o: &PayloadOutcome) {
        self.batches.fetch_add(1, Relaxed);
        if o.applied > 0 {
            self.events_applied.fetch_add(u64::from(o.applied), Relaxed);
            self.blocks_applied.fetch_add(o.blocks, Relaxed);
        }
        if o.refused > 0 {
            self.events_refused.fetch_add(u64::from(o.refused), Relaxed);
        }
    }

    /// Writes the counters in the Prometheus text format.
    pub fn render(&self, subscriptions: usize, out: &mut String) {
        let c = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let _ = writeln!(
            out,
            "# HELP kvroute_kv_subscriptions ZMQ KV event subscriptions running (one per worker rank).\n# TYPE kvroute_kv_subscriptions gauge\nkvroute_kv_subscriptions {subscriptions}"
        );
        c(
            out,
            "kvroute_kv_messages_total",
            "Messages received from engines' KV event sockets.",
            self.messages.load(Relaxed),
        );
        c(
            out,
            "kvroute_kv_batches_total",
            "KV event payloads decoded and applied (live and replayed).",
            self.batches.load(Relaxed),
        );
        c(
            out,
            "kvroute_kv_events_applied_total",
            "KV events from ZMQ applied to the index.",
            self.events_applied.load(Relaxed),
        );
        c(out, "kvroute_kv_events_refused_total", "KV events from ZMQ the router or index refused (unregistered worker or rank, unknown parent, self reference).", self.events_refused.load(Relaxed));
        c(
            out,
            "kvroute_kv_blocks_applied_total",
            "Blocks in stored KV events from ZMQ applied to the index.",
            self.blocks_applied.load(Relaxed),
        );
        let _ = writeln!(
            out,
            "# HELP kvroute_kv_dropped_total KV event messages or events dropped while decoding, by reason.\n# TYPE kvroute_kv_dropped_total counter"
        );
        for r in DropReason::ALL {
            let _ = writeln!(
                out,
                "kvroute_kv_dropped_total{{reason=\"{}\"}} {}",
                r.code(),
                self.dropped_count(r)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvroute_kv_sequence_total KV event sequence handling, by what happened.\n# TYPE kvroute_kv_sequence_total counter"
        );
        for (kind, v) in [
            ("gap", &self.gaps),
            ("catch_up", &self.catch_ups),
            ("replay", &self.replays),
            ("replayed_message", &self.replayed_messages),
            ("replay_failed", &self.replay_failed),
            ("replay_rolled_over", &self.replay_rolled_over),
            ("replay_incomplete", &self.replay_incomplete),
            ("gap_unrecoverable", &self.gap_unrecoverable),
            ("engine_restart", &self.restarts),
            ("duplicate", &self.duplicates),
            ("clear", &self.clears),
        ] {
            let _ = writeln!(
                out,
                "kvroute_kv_sequence_total{{kind=\"{kind}\"}} {}",
                v.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvroute_kv_connections_total KV event socket connection outcomes.\n# TYPE kvroute_kv_connections_total counter"
        );
        for (outcome, v) in [
            ("connected", &self.connects),
            ("failed", &self.connect_failures),
            ("receive_error", &self.socket_errors),
            ("bad_endpoint", &self.bad_endpoints),
        ] {
            let _ = writeln!(
                out,
                "kvroute_kv_connections_total{{outcome=\"{outcome}\"}} {}",
                v.load(Relaxed)
            );
        }
    }
}

struct Running {
    spec: SubscriptionSpec,
    stop: Arc<AtomicBool>,
    /// The rank's feed in the router: connected, last event, dead (`kvroute_core::feeds`).
    feed: Arc<FeedCell>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn stop(self, router: &Router) {
        self.stop.store(true, Relaxed);
        self.task.abort();
        router.feeds().close(
            CandidateKey::new(self.spec.worker_id, self.spec.dp_rank),
            &self.feed,
        );
    }
}

struct RuntimeThread {
    handle: tokio::runtime::Handle,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Inner {
    router: Arc<Router>,
    config: IngestConfig,
    stats: Arc<IngestStats>,
    runtime: Mutex<Option<RuntimeThread>>,
    subs: Mutex<HashMap<WorkerId, Vec<Running>>>,
}

/// The ingestion manager: one subscription per registered worker rank with `kv_events`.
/// Cheap to clone (shared state).
#[derive(Clone)]
pub struct EventIngestion {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EventIngestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventIngestion")
            .field("subscriptions", &self.subscription_count())
            .finish_non_exhaustive()
    }
}

impl EventIngestion {
    /// Starts the ingestion thread. Subscribes nothing until [`Self::sync_all`] or a worker change.
    pub fn start(router: Arc<Router>, config: IngestConfig) -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("kvroute-kv-events")
            .build()?;
        let handle = rt.handle().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvroute-kv-events".into())
            .spawn({
                let router = router.clone();
                move || {
                    rt.block_on(async move {
                        // Which feeds are dead is a matter of time: re-evaluated on a short tick.
                        let tick = tokio::spawn(async move {
                            let mut every = tokio::time::interval(FEED_TICK);
                            loop {
                                every.tick().await;
                                router.feeds().refresh();
                            }
                        });
                        let _ = rx.await;
                        tick.abort();
                    });
                    // Dropping the runtime cancels every task still there (sockets close).
                    drop(rt);
                }
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                router,
                config,
                stats: Arc::new(IngestStats::default()),
                runtime: Mutex::new(Some(RuntimeThread {
                    handle,
                    shutdown: Some(tx),
                    thread: Some(thread),
                })),
                subs: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Follows the router's registry: every later registration, patch or removal, whoever makes
    /// it, subscribes or unsubscribes the worker's ranks. The follower holds the ingestion weakly
    /// (the ingestion holds the router), so dropping the ingestion ends it.
    pub fn follow_registry(&self) {
        let inner = Arc::downgrade(&self.inner);
        self.inner
            .router
            .registry()
            .on_change(Arc::new(move |change: &WorkerChange| {
                if let Some(inner) = inner.upgrade() {
                    EventIngestion { inner }.on_worker_change(change);
                }
            }));
    }

    pub fn on_worker_change(&self, change: &WorkerChange) {
        match change {
            WorkerChange::Upserted(w) => self.reconcile(w.worker_id),
            WorkerChange::Removed(id) => self.reconcile(*id),
        }
    }

    /// Subscribes every registered worker (at start-up).
    pub fn sync_all(&self) {
        let ids: Vec<WorkerId> = self
            .inner
            .router
            .registry()
            .snapshot()
            .workers
            .keys()
            .copied()
            .collect();
        for id in ids {
            self.reconcile(id);
        }
        let registered = self.inner.router.registry().snapshot();
        let stale: Vec<WorkerId> = self
            .inner
            .subs
            .lock()
            .keys()
            .filter(|id| !registered.workers.contains_key(id))
            .copied()
            .collect();
        for id in stale {
            self.reconcile(id);
        }
    }

    /// Brings one worker's subscriptions in line with the registry as it is now (not as the
    /// change that triggered the call said: two quick changes may be reported out of order).
    pub fn reconcile(&self, worker_id: WorkerId) {
        let inner = &self.inner;
        let snapshot = inner.router.registry().snapshot();
        let worker = snapshot.workers.get(&worker_id);
        let desired = match worker.map(subscriptions_for) {
            None => Vec::new(),
            Some(Ok(specs)) => specs,
            Some(Err(e)) => {
                inner.stats.bad_endpoints.fetch_add(1, Relaxed);
                tracing::error!(worker_id, error = %e, "not subscribing to the worker's KV events");
                Vec::new()
            }
        };
        let mut subs = inner.subs.lock();
        let current: Vec<&SubscriptionSpec> = subs
            .get(&worker_id)
            .map(|r| r.iter().map(|r| &r.spec).collect())
            .unwrap_or_default();
        if current.len() == desired.len() && current.iter().zip(&desired).all(|(a, b)| *a == b) {
            return;
        }
        if let Some(old) = subs.remove(&worker_id) {
            for r in old {
                r.stop(&inner.router);
            }
            // Still registered (re-registered differently): what the old subscriptions indexed
            // can no longer be kept current.
            if let Some(w) = worker {
                for rank in w.ranks() {
                    inner
                        .router
                        .indexer()
                        .clear_candidate(CandidateKey::new(worker_id, rank));
                }
            }
            tracing::info!(worker_id, "KV event subscriptions stopped");
        }
        if desired.is_empty() {
            return;
        }
        let runtime = inner.runtime.lock();
        let Some(rt) = runtime.as_ref() else {
            return; // shut down
        };
        let running = desired
            .into_iter()
            .map(|spec| {
                let stop = Arc::new(AtomicBool::new(false));
                let feed = inner
                    .router
                    .feeds()
                    .open(CandidateKey::new(spec.worker_id, spec.dp_rank));
                let task = rt.handle.spawn(subscriber::run_subscription(
                    spec.clone(),
                    inner.router.clone(),
                    inner.stats.clone(),
                    inner.config,
                    stop.clone(),
                    feed.clone(),
                ));
                Running {
                    spec,
                    stop,
                    feed,
                    task,
                }
            })
            .collect();
        subs.insert(worker_id, running);
    }

    /// The subscriptions running now.
    pub fn subscriptions(&self) -> Vec<SubscriptionSpec> {
        let subs = self.inner.subs.lock();
        let mut out: Vec<SubscriptionSpec> = subs
            .values()
            .flat_map(|r| r.iter().map(|r| r.spec.clone()))
            .collect();
        out.sort_by_key(|s| (s.worker_id, s.dp_rank));
        out
    }

    pub fn subscription_count(&self) -> usize {
        self.inner.subs.lock().values().map(Vec::len).sum()
    }

    pub fn stats(&self) -> &Arc<IngestStats> {
        &self.inner.stats
    }

    /// Appends the ingestion's metrics (Prometheus text format) to `out`.
    pub fn render_metrics(&self, out: &mut String) {
        self.inner.stats.render(self.subscription_count(), out);
        // One series per subscribed rank; a removed worker's series go with it.
        let mut ups: Vec<(WorkerId, u32, kvroute_core::feeds::FeedStatus)> = self
            .inner
            .subs
            .lock()
            .values()
            .flatten()
            .map(|r| (r.spec.worker_id, r.spec.dp_rank, r.feed.status()))
            .collect();
        ups.sort_unstable_by_key(|(w, r, _)| (*w, *r));
        out.push_str(
            "# HELP kvroute_kv_subscription_up 1 while the rank's KV event subscription is \
             connected and subscribed, 0 while it is (re)connecting.\n\
             # TYPE kvroute_kv_subscription_up gauge\n",
        );
        for (w, r, f) in &ups {
            let _ = writeln!(
                out,
                "kvroute_kv_subscription_up{{worker_id=\"{w}\",dp_rank=\"{r}\"}} {}",
                u8::from(f.connected)
            );
        }
        out.push_str(
            "# HELP kvroute_kv_feed_dead 1 while the rank's KV event feed is dead (its subscription \
             down for routing.dead_feed_after_ms); routing.dead_feed says what routing does then.\n\
             # TYPE kvroute_kv_feed_dead gauge\n",
        );
        for (w, r, f) in &ups {
            let _ = writeln!(
                out,
                "kvroute_kv_feed_dead{{worker_id=\"{w}\",dp_rank=\"{r}\"}} {}",
                u8::from(f.dead)
            );
        }
        out.push_str(
            "# HELP kvroute_kv_feed_trust How far the rank's index can be trusted to be the \
             engine's cache: 0 exact, 1 recovering (joining, reconnecting or replaying a gap), 2 \
             degraded (events lost for good; the index holds only what was stored since).\n\
             # TYPE kvroute_kv_feed_trust gauge\n",
        );
        for (w, r, f) in &ups {
            let _ = writeln!(
                out,
                "kvroute_kv_feed_trust{{worker_id=\"{w}\",dp_rank=\"{r}\"}} {}",
                f.trust.code()
            );
        }
        out.push_str(
            "# HELP kvroute_kv_last_event_age_seconds Seconds since the rank's last KV event message \
             (absent until the first).\n# TYPE kvroute_kv_last_event_age_seconds gauge\n",
        );
        for (w, r, f) in &ups {
            if let Some(ms) = f.last_event_age_ms {
                let _ = writeln!(
                    out,
                    "kvroute_kv_last_event_age_seconds{{worker_id=\"{w}\",dp_rank=\"{r}\"}} {}",
                    ms as f64 / 1000.0
                );
            }
        }
    }

    /// Stops every subscription and the ingestion thread. Idempotent; later worker changes
    /// subscribe nothing.
    pub fn shutdown(&self) {
        let rt = self.inner.runtime.lock().take();
        for (_, running) in self.inner.subs.lock().drain() {
            for r in running {
                r.stop(&self.inner.router);
            }
        }
        if let Some(mut rt) = rt {
            if let Some(tx) = rt.shutdown.take() {
                let _ = tx.send(());
            }
            if let Some(t) = rt.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests;
