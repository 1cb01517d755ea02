//! `kvroute serve`: wires the routing core, the policy registry and the HTTP API together, runs the
//! maintenance ticker, and shuts down gracefully (in-flight requests finish; new ones are refused).
//!
//! The one file that knows every part: it builds the data plane (`kvroute-dataplane`'s proxy and
//! endpoint picker) and cluster mode, and hands them to the HTTP API through `http`'s own traits
//! (`ClusterView`, `EventRelay`, `WorkerHealth`) and routes, and the router's metrics to the data
//! plane through its trait (`RouteMetrics`). Cluster mode implements `http`'s traits itself; the
//! impls between the HTTP API and the data plane, which know neither, live at the bottom of this
//! file.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ServeConfig;
use crate::http::{self, AppState, Metrics};
use crate::state::Persisted;
use kvroute_core::router::Router;
use kvroute_events::{EventIngestion, IngestConfig};
use kvroute_policy::PolicyRegistry;
use kvroute_policy::RegistryScorer;

/// A running server's handles, for embedding (tests, tools).
pub struct Server {
    pub router: Arc<Router>,
    pub policies: Arc<PolicyRegistry>,
    pub local_addr: SocketAddr,
}

pub use kvroute_policy::DEFAULT_POLICY_WASM;

/// Builds the core from a configuration and loads the start-up policy: `--policy` when given (a
/// component file, or a built-in's name), else the embedded default; the built-ins (`default`,
/// `dynamo`) are registered either way.
pub fn build(config: &ServeConfig) -> Result<(Arc<Router>, Arc<PolicyRegistry>), String> {
    build_with_state(config, None)
}

/// [`build`] with a state store (`--state-dir`): what it holds is restored first — its workers
/// registered, its policy versions loaded (validated as uploads are) with their numbers, the
/// history and the active one — then the configuration file's `[workers.ID]` and `--policy` are
/// applied on top (they win), and the result is written back.
pub fn build_with_state(
    config: &ServeConfig,
    state: Option<&Persisted>,
) -> Result<(Arc<Router>, Arc<PolicyRegistry>), String> {
    config.validate()?;
    let router = Arc::new(Router::new(config.router_config())?);
    router
        .indexer()
        .set_max_entries(config.limits.max_index_entries);
    let what = if config.cluster.is_some() {
        "cluster (--cluster)"
    } else {
        "state_dir (--state-dir)"
    };
    let stored = match state {
        Some(p) => Some(p.load().map_err(|e| format!("{what}: {e}"))?),
        None => None,
    };
    if let Some(stored) = &stored {
        for (&id, w) in &stored.workers {
            router
                .upsert_worker(id, w.spec.clone())
                .map_err(|e| format!("{what}: stored worker {id} is refused: {e}"))?;
            if w.draining {
                let _ = router.patch_worker_with(
                    id,
                    kvroute_core::workers::WorkerPatch {
                        draining: Some(true),
                        ..Default::default()
                    },
                );
            }
        }
        tracing::info!(
            workers = stored.workers.len(),
            from = what,
            "workers restored"
        );
    }
    for w in config.register_workers(&router)? {
        tracing::info!(
            worker_id = w.worker_id,
            dp_start = w.dp_start,
            dp_size = w.dp_size,
            kv_events = w.kv_events.as_ref().map(|k| k.endpoint.as_str()),
            "worker registered from the configuration"
        );
    }
    let policies =
        Arc::new(PolicyRegistry::new(config.policy_runtime.clone()).map_err(|e| e.to_string())?);
    // Cluster mode: canaries keep their outcomes for the other replicas (cluster/rollout.rs).
    policies.set_shared_rollout(config.cluster.is_some());
    let image = stored.as_ref().and_then(|s| s.policies.as_ref());
    if let (Some(image), Some(p)) = (image, state) {
        policies
            .restore(image, |digest| {
                p.store()
                    .policy_bytes(digest)
                    .map_err(|e| kvroute_policy::PolicyError::Io {
                        path: format!("component {digest}"),
                        message: e.to_string(),
                    })
            })
            .map_err(|e| format!("{what}: a stored policy is refused: {e}"))?;
        tracing::info!(
            versions = image.versions().len(),
            active = image
                .active
                .as_ref()
                .map(|a| format!("{} v{}", a.name, a.version)),
            from = what,
            "policies restored"
        );
    }
    match (&config.policy, config.builtin_policy()) {
        (_, Some(name)) => {
            let bytes = kvroute_policy::builtin_policy(name).unwrap_or_default();
            policies
                .load(name, bytes, config.policy_config.as_deref(), true)
                .map_err(|e| format!("--policy {name} (built-in): {e}"))?;
        }
        (Some(path), None) => {
            let bytes = std::fs::read(path)
                .map_err(|e| format!("cannot read the policy component {}: {e}", path.display()))?;
            let name = config.start_policy_name().unwrap_or_default();
            policies
                .load(&name, &bytes, config.policy_config.as_deref(), true)
                .map_err(|e| format!("--policy {}: {e}", path.display()))?;
        }
        (None, None) if image.is_none() => {
            policies
                .load(
                    "default",
                    DEFAULT_POLICY_WASM,
                    config.policy_config.as_deref(),
                    true,
                )
                .map_err(|e| format!("the embedded default policy: {e}"))?;
        }
        (None, None) => {}
    }
    // Every server names both built-ins (`dynamo` beside `default`), so any comparison can
    // activate either by name: those neither the start-up policy nor the stored state brought are
    // registered here, inactive, with their default configuration.
    for (name, bytes) in kvroute_policy::BUILTIN_POLICIES {
        if policies.get(name).is_none() {
            policies
                .load(name, bytes, None, false)
                .map_err(|e| format!("the embedded {name} policy: {e}"))?;
        }
    }
    router.set_scorer(Some(Box::new(RegistryScorer::new(policies.clone()))));
    // The shadows and the canary that ran, once the versions they name are loaded.
    if let Some(rollout) = stored.as_ref().and_then(|s| s.rollout.as_ref()) {
        policies.set_rollout(rollout);
        tracing::info!(
            shadows = rollout.shadows.len(),
            canary = rollout
                .canary
                .as_ref()
                .map(|c| format!("{} v{} (id {})", c.name, c.version, c.id)),
            from = what,
            "rollout restored"
        );
    }
    if let Some(p) = state {
        let persist = |e: crate::state::StateError| format!("{what}: {e}");
        p.put_all_workers(&router).map_err(persist)?;
        p.policy_write(&policies, || Ok::<(), ()>(()))
            .map_err(persist)?
            .ok();
    }
    Ok((router, policies))
}

/// Runs the server until `shutdown` resolves. Calls `on_listening` with the bound address (useful
/// with port 0).
pub async fn run(
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    crate::trim::configure();
    let cluster = match &config.cluster {
        Some(url) => {
            let c = crate::cluster::Cluster::connect(url, &config.cluster_name)
                .map_err(|e| format!("cluster (--cluster): {e}"))?;
            tracing::info!(
                cluster = %config.cluster_name,
                replica_id = %c.replica_id,
                url = %url,
                "joined the cluster"
            );
            Some(Arc::new(c))
        }
        None => None,
    };
    let persisted = match (&cluster, &config.state_dir) {
        (Some(c), _) => Some(Persisted::new(Box::new(
            crate::cluster::store::ClusterStore::new(c.clone()),
        ))),
        (None, Some(dir)) => {
            let store = crate::state::local::LocalDirStore::open(dir)
                .map_err(|e| format!("state_dir (--state-dir): {e}"))?;
            Some(Persisted::new(Box::new(store)))
        }
        (None, None) => None,
    };
    let (router, policies) = build_with_state(&config, persisted.as_deref())?;
    // Other replicas' changes, from the state just loaded on (before /readyz turns ready).
    if let (Some(c), Some(p)) = (&cluster, &persisted) {
        crate::cluster::watch::start(c.clone(), p.clone(), router.clone(), policies.clone());
    }
    let remote = match &config.remote_indexer {
        Some(url) => {
            let r = Arc::new(crate::remote_indexer::RemoteIndexer::new(
                url,
                Duration::from_millis(config.remote_indexer_timeout_ms),
                config.block_size,
            )?);
            router.set_overlap_source(Some(r.clone()));
            tracing::info!(url = %url, "remote indexer: this router keeps no index and subscribes to no engine");
            Some(r)
        }
        None => None,
    };
    let _watcher = match &config.policy_dir {
        // What the directory holds is loaded before the server listens, so /readyz never
        // reports ready with a policy the directory is about to replace.
        Some(dir) => Some(
            policies
                .load_and_watch_directory(
                    kvroute_policy::DirectoryScanner::new(dir.clone()).keep_active_at_start(
                        config.policy.is_some()
                            || persisted.as_ref().is_some_and(|p| p.restored_policies()),
                    ),
                    Duration::from_millis(500),
                )
                .map_err(|e| {
                    format!(
                        "cannot watch policy_dir (--policy-dir) {}: {e}",
                        dir.display()
                    )
                })?,
        ),
        None => None,
    };
    if config.serve_indexer {
        tracing::info!("serving this router's index to remote routers: POST /v1/overlap");
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let local_addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    if config.admin_token.is_none() && !local_addr.ip().is_loopback() {
        tracing::warn!(
            %local_addr,
            "no admin token: admin endpoints answer loopback clients only"
        );
    }
    let ready = Arc::new(AtomicBool::new(true));
    let metrics = Metrics::new();
    // Bookings shared with the other replicas, from before the server listens.
    let sync = cluster.as_ref().map(|c| {
        crate::cluster::sync::BookingSync::start(
            c.clone(),
            router.clone(),
            Duration::from_millis(config.replica_timeout_ms),
        )
    });
    if let Some(c) = &cluster {
        metrics.add_renderer(c.renderer());
    }
    if let Some(s) = &sync {
        metrics.add_renderer(s.renderer());
    }
    // A canary's outcomes shared with the other replicas (its spec and records are state).
    if let Some(c) = &cluster {
        let r = crate::cluster::rollout::RolloutSync::start(c.clone(), policies.clone());
        metrics.add_renderer(r.renderer());
    }
    // KV events posted to this replica are applied by the others too, and theirs here.
    let event_relay = cluster.as_ref().map(|c| {
        let router = router.clone();
        let relay = crate::cluster::kv_events::EventRelay::start(c, move |payload| {
            crate::http::apply_relayed(&router, payload)
        });
        metrics.add_renderer(relay.renderer());
        relay
    });
    // ZMQ KV event ingestion: subscribes workers registered with `kv_events` (on its own thread).
    // A router with a remote indexer keeps no index: it subscribes to no engine.
    let ingestion = match &remote {
        Some(r) => {
            metrics.add_renderer(r.renderer());
            None
        }
        None => {
            let ingestion = EventIngestion::start(router.clone(), IngestConfig::default())
                .map_err(|e| format!("cannot start the KV event ingestion thread: {e}"))?;
            // Follow first, then subscribe what is already registered: no change falls between.
            ingestion.follow_registry();
            ingestion.sync_all();
            {
                let ingestion = ingestion.clone();
                metrics.add_renderer(Arc::new(move |out: &mut String| {
                    ingestion.render_metrics(out)
                }));
            }
            Some(ingestion)
        }
    };
    let limits = crate::http::dto::BodyLimits {
        max_allowed_worker_ids: config.limits.max_allowed_worker_ids,
        max_request_taints: config.limits.max_request_taints,
    };
    // The proxy and the endpoint picker share the loaded tokenizers.
    let models = if config.proxy.enabled || config.ext_proc.listen.is_some() {
        Some(
            kvroute_tokenize::ModelRegistry::load_all(&config.models)
                .map_err(|e| format!("cannot load the models ([models.NAME]): {e}"))?,
        )
    } else {
        None
    };
    if let Some(models) = &models {
        let models = models.clone();
        metrics.add_renderer(Arc::new(move |out: &mut String| {
            crate::http::metrics::render_tokenizer_caches(out, &models)
        }));
    }
    let proxy = match (&models, config.proxy.enabled) {
        (Some(models), true) => {
            let proxy = Arc::new(kvroute_dataplane::proxy::Proxy::new(
                router.clone(),
                models.clone(),
                config.proxy.clone(),
                limits,
                Arc::new(metrics.clone()),
                Some(policies.clone()),
            ));
            let p = proxy.clone();
            metrics.add_renderer(Arc::new(move |out: &mut String| {
                p.metrics.render(&p.health, out);
                p.render.render_metrics(out);
            }));
            Some(proxy)
        }
        _ => None,
    };
    // Envoy's endpoint picker: its own gRPC server on this (the main) runtime.
    let (stop_ext_proc, ext_proc_stopped) = tokio::sync::watch::channel(false);
    let ext_proc = match (&models, config.ext_proc.listen) {
        (Some(models), Some(addr)) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr} (ext_proc.listen): {e}"))?;
            let bound = listener
                .local_addr()
                .map_err(|e| format!("cannot read the ext_proc address: {e}"))?;
            let ext = Arc::new(
                kvroute_dataplane::extproc::ExtProc::new(
                    router.clone(),
                    models.clone(),
                    limits,
                    config.limits.max_body_bytes,
                    Arc::new(metrics.clone()),
                    config.ext_proc.clone(),
                )
                .with_policies(policies.clone())
                .with_render(match &proxy {
                    Some(p) => p.render.clone(),
                    None => Arc::new(kvroute_dataplane::proxy::render::EngineRender::new(
                        router.clone(),
                        models.clone(),
                        kvroute_dataplane::proxy::upstream::Upstream::new(&config.proxy),
                        None,
                    )),
                }),
            );
            {
                let e = ext.clone();
                let own_render = proxy.is_none();
                metrics.add_renderer(Arc::new(move |out: &mut String| {
                    e.metrics.render(out);
                    if own_render {
                        e.render_metrics(out);
                    }
                }));
            }
            tracing::info!(ext_proc = %bound, "kvroute ext_proc listening (Envoy endpoint picker, gRPC)");
            let mut stopped = ext_proc_stopped.clone();
            Some(tokio::spawn(kvroute_dataplane::extproc::serve(
                ext,
                listener,
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            )))
        }
        _ => None,
    };
    let prober = proxy.clone().map(|p| tokio::spawn(p.probe_loop()));
    let adapter_poller = proxy.clone().map(|p| tokio::spawn(p.adapter_loop()));
    let state = AppState {
        worker_health: proxy
            .as_ref()
            .map(|p| p.health.clone() as Arc<dyn http::WorkerHealth>),
        router: router.clone(),
        policies: policies.clone(),
        metrics,
        admin_token: config.admin_token.as_deref().map(Arc::from),
        limits: config.limits.clone(),
        ready: ready.clone(),
        state: persisted.clone(),
        cluster: sync.clone().map(|s| s as Arc<dyn http::ClusterView>),
        event_relay: event_relay.map(|r| r as Arc<dyn http::EventRelay>),
    };
    // A guardrail's verdict (a rollback or promotion decided here) is written within 100 ms, not
    // at the next maintenance tick: in a cluster, the sooner it is written the sooner every
    // replica holds it, and the sooner a replica whose own verdict lost takes the winner's up.
    let rollout_writer = persisted.clone().map(|p| {
        let policies = policies.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(100));
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if p.rollout_dirty(&policies) {
                    let (p, policies) = (p.clone(), policies.clone());
                    let _ = tokio::task::spawn_blocking(move || p.sync_policies(&policies)).await;
                }
            }
        })
    });
    let ticker = {
        let router = router.clone();
        let policies = policies.clone();
        let persisted = persisted.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(1));
            let mut trimmer = crate::trim::Trimmer::default();
            loop {
                every.tick().await;
                let (expired, blocks) = router.tick(Instant::now());
                if expired > 0 || blocks > 0 {
                    tracing::debug!(expired, blocks, "maintenance");
                }
                let entries: u64 = router.indexer().stats().held_blocks.iter().sum();
                if trimmer.tick(entries) {
                    let _ = tokio::task::spawn_blocking(crate::trim::trim).await;
                }
                // Policy changes made outside the API (automatic restore, policy_dir).
                if let Some(p) = &persisted {
                    let (p, policies) = (p.clone(), policies.clone());
                    let _ = tokio::task::spawn_blocking(move || p.sync_policies(&policies)).await;
                }
            }
        })
    };
    // The proxy's routes are mounted with or without `--proxy`, so other methods are 405 like
    // every documented path; without it the handlers answer 404 `not_found`.
    let app = http::app(state, kvroute_dataplane::proxy::routes(proxy));
    let block_size = config.block_size;
    let summary = settings_line(&config, router.registry().snapshot().workers.len());
    let active = policies
        .active_info()
        .map(|i| format!("{} v{}", i.name, i.version))
        .unwrap_or_else(|| "none".into());
    let threads = config.http_threads();
    let ready_to_serve = move || {
        on_listening(local_addr);
        tracing::info!(
            %local_addr,
            version = env!("CARGO_PKG_VERSION"),
            block_size,
            http_threads = threads,
            policy = %active,
            settings = %summary,
            "kvroute listening"
        );
    };
    let ready_flag = ready.clone();
    let draining_router = router.clone();
    let grace = Duration::from_secs(config.shutdown_grace_secs);
    let result = http::serving::serve(
        listener,
        app,
        threads,
        ready_to_serve,
        async move {
            shutdown.await;
            ready_flag.store(false, Ordering::Release);
            let _ = stop_ext_proc.send(true);
            let queued = draining_router.shutdown_queue();
            tracing::info!(
                queued_refused = queued,
                grace_secs = grace.as_secs(),
                "shutting down: queued requests get 503 shutting_down; requests in flight finish"
            );
        },
        grace,
    )
    .await
    .map_err(|e| format!("server error: {e}"));
    ticker.abort();
    if let Some(w) = rollout_writer {
        w.abort();
    }
    if let Some(task) = ext_proc {
        // Open streams (requests Envoy is still processing) get what is left of the grace.
        let abort = task.abort_handle();
        match tokio::time::timeout(grace, task).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "ext_proc server"),
            Err(_) => abort.abort(),
            _ => {}
        }
    }
    if let Some(p) = prober {
        p.abort();
    }
    if let Some(p) = adapter_poller {
        p.abort();
    }
    if let Some(i) = ingestion {
        i.shutdown();
    }
    result
}

/// The start-up settings as an operator writes them in the config file (`busy_threshold=off
/// queue_order=fcfs ...`), not as Rust prints its values (`None`, `Fcfs`, `Some("dir")`).
pub fn settings_line(config: &ServeConfig, workers: usize) -> String {
    let busy = config
        .routing
        .busy_threshold
        .map_or_else(|| "off".to_string(), |t| t.to_string());
    let order = match config.routing.queue_order {
        kvroute_core::queue::QueueOrder::Fcfs => "fcfs",
        kvroute_core::queue::QueueOrder::Wspt => "wspt",
    };
    let admin = if config.admin_token.is_some() {
        "set"
    } else {
        "none (admin from loopback only)"
    };
    let policy_dir = config
        .policy_dir
        .as_ref()
        .map_or_else(|| "none".to_string(), |d| d.display().to_string());
    format!(
        "busy_threshold={busy} queue_order={order} approximate={} dead_feed={} \
         dead_feed_after_ms={} admin_token={admin} policy_dir={policy_dir} workers={workers}",
        config.routing.approximate,
        config.routing.dead_feed.as_str(),
        config.routing.dead_feed_after_ms
    )
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `GET /v1/workers` shows the proxy's circuit breakers through the HTTP API's own trait.
impl http::WorkerHealth for kvroute_dataplane::proxy::Health {
    fn health(&self, worker: kvroute_core::candidate::WorkerId) -> http::dto::HealthOut {
        self.status(worker)
    }
}

/// The data plane records its routes in the router's own metrics, exactly as `POST /v1/route`
/// does; the data plane names what it needs ([`kvroute_dataplane::RouteMetrics`]) and the wiring
/// implements it here, so neither `http` nor the data plane knows the other.
impl kvroute_dataplane::RouteMetrics for Metrics {
    fn decision(&self, d: &kvroute_core::router::RouteDecision) {
        self.record_decision(d);
    }

    fn refusal(&self, e: &kvroute_core::router::RouteError) {
        self.record_route_error(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_printed_as_written_in_the_config_file() {
        let mut c = ServeConfig::default();
        let line = settings_line(&c, 0);
        assert!(
            line.starts_with("busy_threshold=off queue_order=fcfs approximate=false "),
            "{line}"
        );
        assert!(line.ends_with("policy_dir=none workers=0"), "{line}");
        c.routing.busy_threshold = Some(0.8);
        c.routing.queue_order = kvroute_core::queue::QueueOrder::Wspt;
        c.policy_dir = Some("/etc/kvroute/policies".into());
        let line = settings_line(&c, 3);
        assert!(
            line.starts_with("busy_threshold=0.8 queue_order=wspt "),
            "{line}"
        );
        assert!(
            line.ends_with("policy_dir=/etc/kvroute/policies workers=3"),
            "{line}"
        );
        assert!(!line.contains("Some") && !line.contains('"'), "{line}");
    }
}
