//! `kvroute serve` configuration: a TOML file, then `KVROUTE_*` environment variables, then flags.
//!
//! Each later source overrides the earlier one field by field, so a fleet-wide file can be adjusted
//! per host with an environment variable and per run with a flag. Unknown keys in the file are an
//! error that names the key: a typo never passes silently.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use kvroute_core::cost::CostWeights;
use kvroute_core::indexer::approx::ApproxConfig;
use kvroute_core::load::LoadConfig;
use kvroute_core::predict::PredictConfig;
use kvroute_core::queue::{QueueLimits, QueueOrder};
use kvroute_core::router::{DisaggConfig, RouterConfig};
use kvroute_core::workers::RegistryLimits;

use crate::http::LimitsSection;

/// Everything `kvroute serve` can be told.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Address of the HTTP server: `IP:PORT` or `HOST:PORT` (resolved once, at start; the first
    /// address the name resolves to is used).
    #[serde(deserialize_with = "deserialize_listen")]
    pub listen: SocketAddr,
    /// Tokens per KV block; must match the engines'.
    pub block_size: u32,
    /// Bearer token for admin endpoints. Without one, admin endpoints answer loopback clients only.
    pub admin_token: Option<String>,
    /// A policy component to load and activate at start (instead of the embedded default), or the
    /// name of a built-in policy (`default`, `dynamo`; see [`Self::builtin_policy`]).
    pub policy: Option<PathBuf>,
    /// The name `policy` is registered under [default: the file name without `.wasm`].
    pub policy_name: Option<String>,
    /// JSON configuration handed to that policy's `configure`.
    pub policy_config: Option<String>,
    /// A directory watched for `NAME.wasm` policies (with optional `NAME.json` configs).
    pub policy_dir: Option<PathBuf>,
    /// `text` or `json` logs.
    pub log_format: LogFormat,
    /// Threads serving HTTP connections (each connection stays on one); 0 = one per CPU.
    pub http_threads: usize,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish before the process
    /// exits anyway (a client stalled mid-request would otherwise hold it up).
    pub shutdown_grace_secs: u64,
    pub routing: RoutingSection,
    /// Fair queueing and per-tenant budgets (`[fairness]`; docs/SPEC.md §9).
    pub fairness: FairnessSection,
    pub limits: LimitsSection,
    pub cost: CostWeights,
    /// Limits of the Wasm policy runtime (memory cap, per-call deadline, failures before restore).
    pub policy_runtime: kvroute_policy::PolicyRuntimeConfig,
    /// Disaggregated prefill/decode routing (API.md, "Disaggregated prefill/decode").
    pub disaggregation: DisaggConfig,
    /// Workers registered at start, by id (`[workers.7]` in TOML), each as the body of
    /// `PUT /v1/workers/{id}` would give it (`kv_events` subscribes at start). The API can
    /// change or remove them later; the file is read once.
    pub workers: std::collections::BTreeMap<String, kvroute_core::workers::WorkerSpec>,
    /// The models the proxy serves (`[models.NAME]`: tokenizer, chat template, block size).
    pub models: std::collections::BTreeMap<String, kvroute_tokenize::ModelSpec>,
    /// `kvroute serve --proxy` (`[proxy]`): the OpenAI-compatible endpoints.
    pub proxy: kvroute_dataplane::proxy::ProxySection,
    /// Where the worker registry and the policy store are kept across restarts (`--state-dir`);
    /// none: they live in memory only.
    pub state_dir: Option<PathBuf>,
    /// This server's index is served to other routers (`--serve-indexer`): `POST /v1/overlap`.
    pub serve_indexer: bool,
    /// A served indexer's base URL (`--remote-indexer`): this router keeps no index, subscribes
    /// to no engine, and asks the URL's `POST /v1/overlap` for each request.
    pub remote_indexer: Option<String>,
    /// How long a remote indexer may take to answer before the request is routed with zero
    /// overlap (`overlap_source: none`).
    pub remote_indexer_timeout_ms: u64,
    /// `kvroute serve --ext-proc` (`[ext_proc]`): Envoy's endpoint picker over gRPC.
    pub ext_proc: kvroute_dataplane::extproc::ExtProcSection,
    /// The NATS server of a cluster of replicas (`--cluster nats://HOST:PORT`): the worker
    /// registry and the policy store are kept in its JetStream buckets and shared by every
    /// replica of `cluster_name`; none: this server is alone.
    pub cluster: Option<String>,
    /// The cluster's name (`--cluster-name`): replicas of one name share their state; the name
    /// is part of the JetStream bucket names.
    pub cluster_name: String,
    /// With `cluster`: a replica not heard from for this long (no heartbeat, no booking message)
    /// is forgotten and its bookings are dropped by the others.
    pub replica_timeout_ms: u64,
    /// Session bindings (`[sessions]`: mode, idle TTL, cap; SPEC §12).
    pub sessions: SessionsSection,
}

/// `[sessions]`: how client sessions are bound to workers ([`kvroute_core::sessions`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsSection {
    /// `hard` (a bound session goes to its worker while it is eligible), `soft` (policies see the
    /// binding as the `session-bound` column) or `off`.
    pub mode: kvroute_core::sessions::SessionMode,
    /// A binding with no turn for this long is dropped (1 to 86,400,000).
    pub ttl_ms: u64,
    /// Most live bindings (1 to 10,000,000); the least recently seen is evicted to make room.
    pub max_sessions: usize,
    /// `prefix`: a request that sends no session key continues the session whose last prompt it
    /// extends (SPEC §12); `off` (default): it has no session.
    pub infer: kvroute_core::sessions::SessionInference,
}

impl Default for SessionsSection {
    fn default() -> Self {
        let d = kvroute_core::sessions::SessionConfig::default();
        Self {
            mode: d.mode,
            ttl_ms: d.ttl.as_millis() as u64,
            max_sessions: d.max_sessions,
            infer: d.infer,
        }
    }
}

impl SessionsSection {
    pub fn config(&self) -> kvroute_core::sessions::SessionConfig {
        kvroute_core::sessions::SessionConfig {
            mode: self.mode,
            ttl: Duration::from_millis(self.ttl_ms),
            max_sessions: self.max_sessions,
            infer: self.infer,
        }
    }
}

use kvroute_api::listen::deserialize_listen;
pub use kvroute_api::listen::parse_listen;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            block_size: 16,
            admin_token: None,
            policy: None,
            policy_name: None,
            policy_config: None,
            policy_dir: None,
            log_format: LogFormat::Text,
            http_threads: 0,
            shutdown_grace_secs: 30,
            routing: RoutingSection::default(),
            fairness: FairnessSection::default(),
            limits: LimitsSection::default(),
            cost: CostWeights::default(),
            policy_runtime: kvroute_policy::PolicyRuntimeConfig::default(),
            disaggregation: DisaggConfig::default(),
            workers: Default::default(),
            models: Default::default(),
            proxy: Default::default(),
            state_dir: None,
            serve_indexer: false,
            remote_indexer: None,
            remote_indexer_timeout_ms: 50,
            ext_proc: Default::default(),
            cluster: None,
            cluster_name: "kvroute".into(),
            replica_timeout_ms: 3000,
            sessions: SessionsSection::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `[fairness]`: fair queueing and per-tenant budgets (docs/SPEC.md §9, "Fairness", "Budgets").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FairnessSection {
    /// Serve each priority class of the queue least attained service first: tenant (by weight),
    /// then session, then `routing.queue_order`. Off: the plain order.
    pub queue: bool,
    /// Attained service halves every this many seconds.
    pub half_life_secs: f64,
    /// The fair order's starvation bound: a request that has waited this many seconds is served
    /// before the fair order, oldest first. 0: no bound.
    pub max_wait_secs: f64,
    /// The weight of a tenant not listed.
    pub default_weight: f64,
    /// `[fairness.tenants.NAME]`: weight and budgets (requests without a tenant are `default`).
    pub tenants: std::collections::BTreeMap<String, TenantSection>,
}

impl Default for FairnessSection {
    fn default() -> Self {
        Self {
            queue: false,
            half_life_secs: 60.0,
            max_wait_secs: kvroute_core::queue::DEFAULT_MAX_WAIT_SECS,
            default_weight: 1.0,
            tenants: Default::default(),
        }
    }
}

/// `[fairness.tenants.NAME]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantSection {
    /// Its share of the queue against other tenants (> 0).
    pub weight: Option<f64>,
    /// Requests admitted per 60 s at most (none: unlimited).
    pub requests_per_minute: Option<u64>,
    /// Prompt plus expected output tokens admitted per 60 s at most (none: unlimited).
    pub tokens_per_minute: Option<u64>,
}

impl FairnessSection {
    /// The queue's fairness settings (with `queue` on).
    pub fn fair_config(&self) -> kvroute_core::queue::FairConfig {
        kvroute_core::queue::FairConfig {
            half_life_secs: self.half_life_secs,
            max_wait_secs: (self.max_wait_secs != 0.0).then_some(self.max_wait_secs),
            default_weight: self.default_weight,
            tenant_weights: self
                .tenants
                .iter()
                .filter_map(|(n, t)| t.weight.map(|w| (n.clone(), w)))
                .collect(),
        }
    }

    /// The tenants' budgets.
    pub fn budgets(&self) -> rustc_hash::FxHashMap<String, kvroute_core::budget::TenantBudget> {
        self.tenants
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    kvroute_core::budget::TenantBudget {
                        requests_per_minute: t.requests_per_minute,
                        tokens_per_minute: t.tokens_per_minute,
                    },
                )
            })
            .collect()
    }

    /// Every value checked, naming the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.max_wait_secs.is_finite() && self.max_wait_secs >= 0.0) {
            return Err(format!(
                "fairness.max_wait_secs must be 0 (no bound) or a positive number of seconds, got {}",
                self.max_wait_secs
            ));
        }
        self.fair_config().validate()?;
        for (name, t) in &self.tenants {
            if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
                return Err(format!(
                    "fairness.tenants.{name:?}: a tenant name is 1 to 128 bytes with no control characters"
                ));
            }
            for (key, v) in [
                ("requests_per_minute", t.requests_per_minute),
                ("tokens_per_minute", t.tokens_per_minute),
            ] {
                if v == Some(0) {
                    return Err(format!(
                        "fairness.tenants.{name}.{key} must be at least 1 (leave it out for no limit)"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Routing behaviour.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingSection {
    /// Busy threshold as a fraction of `max_num_batched_tokens`; absent = no queue.
    pub busy_threshold: Option<f64>,
    pub queue_order: QueueOrder,
    pub queue_max_requests_per_worker: usize,
    pub queue_max_tokens_per_worker: u64,
    pub queue_timeout_ms: u64,
    /// Bookings never freed expire after this many seconds.
    pub load_expiry_secs: u64,
    /// Index from routing decisions (engines that publish no KV events).
    pub approximate: bool,
    pub approximate_ttl_secs: u64,
    /// Predict-on-route: a booked prompt counts as cached on its worker for `predict_ttl_ms`
    /// until the engine's KV events confirm or contradict it (max-combined with the index).
    pub predict_on_route: bool,
    pub predict_ttl_ms: u64,
    pub default_temperature: f64,
    /// What routing does with a rank whose KV event feed is dead: `keep` routing on its (possibly
    /// stale) index, treat its overlap as `unknown` (0), or `drain` it.
    pub dead_feed: kvroute_core::feeds::DeadFeedRule,
    /// A feed is dead once its subscription has been down this long.
    pub dead_feed_after_ms: u64,
}

impl Default for RoutingSection {
    fn default() -> Self {
        let q = QueueLimits::default();
        Self {
            busy_threshold: None,
            queue_order: QueueOrder::Fcfs,
            queue_max_requests_per_worker: q.max_requests_per_worker,
            queue_max_tokens_per_worker: q.max_tokens_per_worker,
            queue_timeout_ms: 30_000,
            load_expiry_secs: 300,
            approximate: false,
            approximate_ttl_secs: 120,
            predict_on_route: true,
            predict_ttl_ms: PredictConfig::default().ttl.as_millis() as u64,
            default_temperature: 0.0,
            dead_feed: kvroute_core::feeds::DeadFeedRule::default(),
            dead_feed_after_ms: kvroute_core::feeds::FeedConfig::default()
                .dead_after
                .as_millis() as u64,
        }
    }
}

/// The largest block size accepted: engines use 16 to a few hundred tokens per KV block.
pub const MAX_BLOCK_SIZE: u32 = 65_536;

impl ServeConfig {
    /// Reads a TOML file. Errors name the file and the offending key. Relative `policy`,
    /// `policy_dir` and `state_dir` paths are taken from the file's directory, not from wherever `kvroute` was
    /// started, so a config file and the components next to it move together.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        Self::from_toml_str(&text, path.parent().unwrap_or(Path::new("")))
            .map_err(|e| format!("config file {}: {e}", path.display()))
    }

    /// Parses the text of a config file as [`Self::from_file`] does, with relative `policy`,
    /// `policy_dir` and `models.NAME.tokenizer` / `chat_template` paths taken from `base` (the
    /// file's directory). Nothing is validated: that is
    /// [`Self::validate`], as `kvroute serve --config` runs it after the overrides.
    pub fn from_toml_str(text: &str, base: &Path) -> Result<Self, String> {
        let mut c: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        let builtin = c.builtin_policy().is_some();
        let policy = c.policy.as_mut().filter(|_| !builtin);
        for p in [policy, c.policy_dir.as_mut(), c.state_dir.as_mut()]
            .into_iter()
            .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        for m in c.models.values_mut() {
            for p in std::iter::once(&mut m.tokenizer).chain(m.chat_template.as_mut()) {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        Ok(c)
    }

    /// The built-in policy `policy` names: `default` or `dynamo` written alone (no directory, no
    /// extension), which start the embedded component of that name instead of reading a file. A
    /// file called `default` in the working directory is still reachable as `./default`.
    pub fn builtin_policy(&self) -> Option<&'static str> {
        let p = self.policy.as_deref()?.to_str()?;
        kvroute_policy::BUILTIN_POLICIES
            .iter()
            .map(|(n, _)| *n)
            .find(|n| *n == p)
    }

    /// The name the start-up policy (`policy`) is registered under: `policy_name`, else the
    /// file's name without its extension. `None` when there is no start-up policy file.
    pub fn start_policy_name(&self) -> Option<String> {
        let path = self.policy.as_ref()?;
        Some(self.policy_name.clone().unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        }))
    }

    /// Registers the `[workers.ID]` entries on `router` as `PUT /v1/workers/{id}` would. Errors
    /// name the entry and field. [`Self::validate`] runs this on a scratch router, so a
    /// configuration it accepts registers in full.
    pub fn register_workers(
        &self,
        router: &kvroute_core::router::Router,
    ) -> Result<Vec<kvroute_core::workers::Worker>, String> {
        let mut out = Vec::with_capacity(self.workers.len());
        for (key, spec) in &self.workers {
            let id: u64 = key
                .parse()
                .ok()
                .filter(|id: &u64| id.to_string() == *key)
                .ok_or_else(|| {
                    format!(
                        "workers.{key}: a worker's key is its id, written as a plain integer \
                         from 0 to 2^64-1 (no sign, no leading zeros)"
                    )
                })?;
            let worker = router
                .upsert_worker(id, spec.clone())
                .map_err(|e| format!("workers.{key}.{}: {}", e.field, e.message))?;
            out.push(worker);
        }
        Ok(out)
    }

    /// Checks values that parse but make no sense.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(format!(
                "block_size must be between 1 and {MAX_BLOCK_SIZE} tokens, got {}",
                self.block_size
            ));
        }
        if let Some(t) = self.routing.busy_threshold {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!("routing.busy_threshold must be > 0, got {t}"));
            }
        }
        if !(self.routing.default_temperature.is_finite()
            && self.routing.default_temperature >= 0.0)
        {
            return Err("routing.default_temperature must be finite and >= 0".into());
        }
        if !(1..=3600).contains(&self.shutdown_grace_secs) {
            return Err(format!(
                "shutdown_grace_secs must be between 1 and 3600, got {}",
                self.shutdown_grace_secs
            ));
        }
        if !(1..=600_000).contains(&self.routing.predict_ttl_ms) {
            return Err(format!(
                "routing.predict_ttl_ms must be between 1 and 600000, got {}",
                self.routing.predict_ttl_ms
            ));
        }
        self.sessions.config().validate()?;
        if self.routing.queue_timeout_ms == 0 {
            return Err("routing.queue_timeout_ms must be at least 1".into());
        }
        self.fairness.validate()?;
        if self.http_threads > 1024 {
            return Err(format!(
                "http_threads must be at most 1024 (0 = one per CPU), got {}",
                self.http_threads
            ));
        }
        if let Some(url) = &self.remote_indexer {
            crate::remote_indexer::parse_base_url(url)
                .map_err(|e| format!("remote_indexer: {e}"))?;
            if self.serve_indexer {
                return Err(
                    "remote_indexer: a router with a remote indexer has no index to \
                            serve; drop serve_indexer (--serve-indexer)"
                        .into(),
                );
            }
            if self.routing.approximate {
                return Err(
                    "remote_indexer: routing.approximate indexes this router's own \
                            decisions, and a router with a remote indexer keeps no index"
                        .into(),
                );
            }
        }
        if let Some(url) = &self.cluster {
            crate::cluster::parse_url(url).map_err(|e| format!("cluster: {e}"))?;
            if self.state_dir.is_some() {
                return Err(
                    "cluster: a cluster keeps its state in NATS; drop state_dir \
                            (--state-dir)"
                        .into(),
                );
            }
        }
        crate::cluster::validate_name(&self.cluster_name)
            .map_err(|e| format!("cluster_name: {e}"))?;
        if !(500..=600_000).contains(&self.replica_timeout_ms) {
            return Err(format!(
                "replica_timeout_ms must be between 500 and 600000 (heartbeats go every 200 ms), \
                 got {}",
                self.replica_timeout_ms
            ));
        }
        if !(1..=60_000).contains(&self.remote_indexer_timeout_ms) {
            return Err(format!(
                "remote_indexer_timeout_ms must be between 1 and 60000, got {}",
                self.remote_indexer_timeout_ms
            ));
        }
        if let Some(t) = &self.admin_token {
            if t.len() < 8 {
                return Err("admin_token must be at least 8 characters".into());
            }
        }
        if let Some(name) = self.start_policy_name() {
            kvroute_policy::validate_name(&name).map_err(|e| match &self.policy_name {
                Some(_) => format!("policy_name: {e}"),
                None => format!(
                    "policy {}: {e} (the name comes from the file name: rename the file or \
                     set policy_name, --policy-name)",
                    self.policy.as_deref().unwrap_or(Path::new("")).display()
                ),
            })?;
        }
        if let (Some(b), Some(_)) = (self.builtin_policy(), &self.policy_name) {
            return Err(format!(
                "policy_name: the built-in policy {b:?} is always registered under its own name; \
                 policy_name only names a component file"
            ));
        }
        if self.policy_name.is_some() && self.policy.is_none() {
            return Err("policy_name is set but policy is not: name the component to load".into());
        }
        if let Some(c) = &self.policy_config {
            serde_json::from_str::<serde_json::Value>(c)
                .map_err(|e| format!("policy_config is not valid JSON: {e}"))?;
        }
        // The native cost is every policy's fallback and base cost: a weight that is not a finite
        // number >= 0 makes every decision a fallback, and the active policy is taken out.
        for (key, w) in [
            ("cost.prefill_load_scale", self.cost.prefill_load_scale),
            ("cost.host_tier_weight", self.cost.host_tier_weight),
            ("cost.disk_tier_weight", self.cost.disk_tier_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(format!("{key} must be a finite number >= 0, got {w}"));
            }
        }
        // Limits of 0 would refuse every request of their kind.
        let l = &self.limits;
        for (key, v) in [
            ("limits.max_body_bytes", l.max_body_bytes),
            ("limits.max_prompt_tokens", l.max_prompt_tokens),
            ("limits.max_events_per_request", l.max_events_per_request),
            ("limits.max_policy_bytes", l.max_policy_bytes),
            ("limits.max_workers", l.max_workers),
            ("limits.max_dp_size", l.max_dp_size as usize),
            ("limits.max_taint_len", l.max_taint_len),
        ] {
            if v == 0 {
                return Err(format!("{key} must be at least 1"));
            }
        }
        if l.max_index_entries == Some(0) {
            return Err("limits.max_index_entries must be at least 1 (omit it for no cap)".into());
        }
        self.policy_runtime
            .validate()
            .map_err(|e| format!("policy_runtime: {e}"))?;
        self.disaggregation
            .validate()
            .map_err(|e| format!("disaggregation.{e}"))?;
        self.proxy.validate()?;
        self.ext_proc.validate()?;
        if self.proxy.enabled && self.models.is_empty() {
            return Err(
                "the proxy (--proxy / proxy.enabled) needs at least one [models.NAME] with a tokenizer"
                    .into(),
            );
        }
        if let Some(addr) = self.ext_proc.listen {
            if self.models.is_empty() {
                return Err(
                    "the endpoint picker (--ext-proc / ext_proc.listen) needs at least one [models.NAME] with a tokenizer"
                        .into(),
                );
            }
            if addr == self.listen && addr.port() != 0 {
                return Err(format!(
                    "ext_proc.listen ({addr}) is the HTTP listen address: give the gRPC server its own port"
                ));
            }
        }
        for (name, m) in &self.models {
            if let Some(b) = m.block_size {
                if b != self.block_size {
                    return Err(format!(
                        "models.{name}.block_size ({b}) differs from block_size ({}): one router indexes one block size",
                        self.block_size
                    ));
                }
            }
        }
        if !self.workers.is_empty() {
            self.register_workers(&kvroute_core::router::Router::new(self.router_config())?)?;
        }
        Ok(())
    }

    /// Serving threads to start: `http_threads`, or one per CPU when it is 0.
    pub fn http_threads(&self) -> usize {
        match self.http_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }

    /// The routing core's configuration.
    pub fn router_config(&self) -> RouterConfig {
        RouterConfig {
            block_size: self.block_size,
            busy_threshold: self.routing.busy_threshold,
            queue_order: self.routing.queue_order,
            queue_limits: QueueLimits {
                max_requests_per_worker: self.routing.queue_max_requests_per_worker,
                max_tokens_per_worker: self.routing.queue_max_tokens_per_worker,
            },
            queue_timeout: Duration::from_millis(self.routing.queue_timeout_ms),
            load: LoadConfig {
                expiry: Duration::from_secs(self.routing.load_expiry_secs),
            },
            approx: self.routing.approximate.then(|| ApproxConfig {
                ttl: Duration::from_secs(self.routing.approximate_ttl_secs),
                ..Default::default()
            }),
            predict: self.routing.predict_on_route.then(|| PredictConfig {
                ttl: Duration::from_millis(self.routing.predict_ttl_ms),
                ..Default::default()
            }),
            cost: self.cost,
            default_temperature: self.routing.default_temperature,
            max_prompt_tokens: self.limits.max_prompt_tokens,
            registry: RegistryLimits {
                max_dp_size: self.limits.max_dp_size,
                max_taints_per_worker: self.limits.max_taints_per_worker,
                max_taint_len: self.limits.max_taint_len,
                max_workers: self.limits.max_workers,
                ..Default::default()
            },
            // A server's tie-breaks stay unpredictable: a per-thread, OS-seeded generator.
            rng_seed: None,
            feeds: kvroute_core::feeds::FeedConfig {
                dead_feed: self.routing.dead_feed,
                dead_after: Duration::from_millis(self.routing.dead_feed_after_ms),
            },
            disagg: self.disaggregation.clone(),
            fairness: self.fairness.queue.then(|| self.fairness.fair_config()),
            budgets: self.fairness.budgets(),
            sessions: self.sessions.config(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_addresses_and_host_names() {
        assert_eq!(
            parse_listen("127.0.0.1:9000").unwrap(),
            SocketAddr::from(([127, 0, 0, 1], 9000))
        );
        assert_eq!(parse_listen("[::1]:80").unwrap().port(), 80);
        let local = parse_listen("localhost:7000").unwrap();
        assert!(local.ip().is_loopback() && local.port() == 7000, "{local}");
        for bad in [
            "localhost",
            ":80",
            "127.0.0.1",
            "127.0.0.1:99999",
            "host:port",
            "",
        ] {
            let e = parse_listen(bad).unwrap_err();
            assert!(e.contains("HOST:PORT"), "{bad:?}: {e}");
        }
        let c: ServeConfig = toml::from_str("listen = \"localhost:7001\"\n").unwrap();
        assert_eq!(c.listen.port(), 7001);
        let e = toml::from_str::<ServeConfig>("listen = \"nowhere\"\n").unwrap_err();
        assert!(e.to_string().contains("listen"), "{e}");
    }

    #[test]
    fn the_start_policy_is_named_by_policy_name_or_its_file() {
        let mut c = ServeConfig::default();
        assert_eq!(c.start_policy_name(), None);
        c.policy = Some("/p/cache-first.v2.wasm".into());
        assert_eq!(c.start_policy_name().as_deref(), Some("cache-first.v2"));
        c.validate().unwrap();
        c.policy = Some("/p/my policy.wasm".into());
        let e = c.validate().unwrap_err();
        assert!(
            e.contains("my policy") && e.contains("--policy-name"),
            "{e}"
        );
        c.policy_name = Some("mine".into());
        assert_eq!(c.start_policy_name().as_deref(), Some("mine"));
        c.validate().unwrap();
        c.policy_name = Some("rollback".into());
        assert!(c.validate().unwrap_err().starts_with("policy_name"));
        c.policy_name = Some("mine".into());
        c.policy = Some("dynamo".into());
        let e = c.validate().unwrap_err();
        assert!(e.contains("built-in"), "{e}");
        c.policy_name = None;
        assert_eq!((c.builtin_policy(), c.validate()), (Some("dynamo"), Ok(())));
        let f = ServeConfig::from_toml_str("policy = \"default\"", Path::new("/etc")).unwrap();
        assert_eq!(f.builtin_policy(), Some("default"));
        c.policy = Some("./dynamo".into());
        assert_eq!(c.builtin_policy(), None);
        c.policy = None;
        c.policy_name = Some("mine".into());
        assert!(c.validate().unwrap_err().contains("policy is not"));
    }

    #[test]
    fn the_sessions_section_reaches_the_router_and_bad_values_name_the_field() {
        let c: ServeConfig =
            toml::from_str("[sessions]\nmode = \"hard\"\nttl_ms = 250\nmax_sessions = 9\n")
                .unwrap();
        assert_eq!(c.validate(), Ok(()));
        let s = c.router_config().sessions;
        assert_eq!(s.mode, kvroute_core::sessions::SessionMode::Hard);
        assert_eq!((s.ttl, s.max_sessions), (Duration::from_millis(250), 9));
        for (text, field) in [
            ("ttl_ms = 0", "sessions.ttl_ms"),
            ("max_sessions = 0", "sessions.max_sessions"),
        ] {
            let c: ServeConfig = toml::from_str(&format!("[sessions]\n{text}\n")).unwrap();
            assert!(c.validate().unwrap_err().starts_with(field), "{text}");
        }
        let e = toml::from_str::<ServeConfig>("[sessions]\nmode = \"sticky\"\n").unwrap_err();
        assert!(
            e.to_string().contains("sticky") && e.to_string().contains("mode"),
            "{e}"
        );
    }

    #[test]
    fn the_fair_queue_starvation_bound_reaches_the_router_and_bad_values_name_the_field() {
        let bound = |text: &str| {
            let c: ServeConfig =
                toml::from_str(&format!("[fairness]\nqueue = true\n{text}")).unwrap();
            assert_eq!(c.validate(), Ok(()), "{text}");
            c.router_config().fairness.unwrap().max_wait_secs
        };
        assert_eq!(bound(""), Some(kvroute_core::queue::DEFAULT_MAX_WAIT_SECS));
        assert_eq!(bound("max_wait_secs = 2.5\n"), Some(2.5));
        assert_eq!(bound("max_wait_secs = 0\n"), None);
        for v in ["-1", "-0.5", "nan", "inf"] {
            let c: ServeConfig =
                toml::from_str(&format!("[fairness]\nmax_wait_secs = {v}\n")).unwrap();
            let e = c.validate().unwrap_err();
            assert!(e.starts_with("fairness.max_wait_secs"), "{v}: {e}");
        }
    }

    #[test]
    fn file_parses_and_unknown_keys_are_named() {
        let c: ServeConfig = toml::from_str(
            "listen = \"127.0.0.1:9000\"\nblock_size = 64\n[routing]\nbusy_threshold = 0.8\nqueue_order = \"wspt\"\n",
        )
        .unwrap();
        assert_eq!(c.block_size, 64);
        assert_eq!(c.routing.queue_order, QueueOrder::Wspt);
        assert_eq!(c.router_config().busy_threshold, Some(0.8));
        let e = toml::from_str::<ServeConfig>("blocksize = 3").unwrap_err();
        assert!(e.to_string().contains("blocksize"), "{e}");
        let bad = ServeConfig {
            block_size: 0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("block_size"));
    }

    #[test]
    fn http_threads_default_to_one_per_cpu_and_are_bounded() {
        let c: ServeConfig = toml::from_str("http_threads = 3").unwrap();
        assert_eq!(c.http_threads(), 3);
        assert!(ServeConfig::default().http_threads() >= 1);
        let e = toml::from_str::<ServeConfig>("http_threads = -1").unwrap_err();
        assert!(e.to_string().contains("http_threads"), "{e}");
        let huge = ServeConfig {
            http_threads: 5000,
            ..Default::default()
        };
        assert!(huge.validate().unwrap_err().contains("http_threads"));
        let huge_blocks = ServeConfig {
            block_size: u32::MAX,
            ..Default::default()
        };
        assert!(huge_blocks.validate().unwrap_err().contains("block_size"));
    }

    /// The README's example configuration is a valid one.
    #[test]
    fn the_readme_example_parses_and_validates() {
        let readme = include_str!("../../../README.md");
        let start = readme.find("```toml\n").expect("a toml block") + "```toml\n".len();
        let len = readme[start..].find("```").expect("closed");
        let c: ServeConfig = toml::from_str(&readme[start..start + len]).unwrap();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.cost, CostWeights::default());
    }

    #[test]
    fn relative_policy_paths_are_taken_from_the_config_file() {
        let dir = std::env::temp_dir().join(format!("kvroute-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("kvroute.toml");
        std::fs::write(
            &file,
            "policy = \"p.wasm\"\npolicy_dir = \"/abs/policies\"\n",
        )
        .unwrap();
        let c = ServeConfig::from_file(&file).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(c.policy, Some(dir.join("p.wasm")));
        assert_eq!(c.policy_dir, Some(PathBuf::from("/abs/policies")));
    }

    /// Values that parse but would break a running server are refused at start, naming the key.
    #[test]
    fn cost_weights_limits_and_runtime_are_checked() {
        let refused = |toml_text: &str, key: &str| {
            let c: ServeConfig = toml::from_str(toml_text).unwrap();
            let e = c.validate().unwrap_err();
            assert!(e.contains(key), "{toml_text:?}: {e}");
        };
        refused(
            "[cost]\nprefill_load_scale = nan\n",
            "cost.prefill_load_scale",
        );
        refused("[cost]\nhost_tier_weight = -5.0\n", "cost.host_tier_weight");
        refused("[cost]\ndisk_tier_weight = inf\n", "cost.disk_tier_weight");
        refused("[limits]\nmax_body_bytes = 0\n", "limits.max_body_bytes");
        refused("[limits]\nmax_workers = 0\n", "limits.max_workers");
        refused(
            "[limits]\nmax_prompt_tokens = 0\n",
            "limits.max_prompt_tokens",
        );
        refused("[policy_runtime]\ndeadline_us = 10\n", "policy_runtime");
        refused(
            "[disaggregation]\nkv_transfer_enforcement = \"required\"\n",
            "disaggregation.kv_transfer_enforcement",
        );
        refused(
            "[disaggregation]\nbypass = \"prefill_load\"\n",
            "disaggregation.bypass",
        );
        let ok: ServeConfig = toml::from_str(
            "[disaggregation]\nkv_transfer_domain = \"zone\"\nkv_transfer_enforcement = \"preferred\"\n\
             bypass = \"isl_bounding\"\n[workers.1]\nrole = \"prefill\"\n[workers.1.topology]\nzone = \"a\"\n",
        )
        .unwrap();
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.router_config().disagg, ok.disaggregation);
        let e = toml::from_str::<ServeConfig>("[workers.1]\nrole = \"mixed\"\n").unwrap_err();
        assert!(e.to_string().contains("mixed"), "{e}");
        let ok: ServeConfig =
            toml::from_str("[cost]\nprefill_load_scale = 0.0\nhost_tier_weight = 1.5\n").unwrap();
        assert_eq!(ok.validate(), Ok(()));
    }

    /// Keys of a serve config, each with values that pass and values `validate` refuses.
    const TOP: [(&str, &[&str]); 7] = [
        ("block_size", &["0", "1", "16", "65536", "65537"]),
        ("http_threads", &["0", "4", "1025"]),
        ("shutdown_grace_secs", &["0", "1", "3600", "3601"]),
        ("admin_token", &["\"short\"", "\"long-enough\""]),
        ("policy", &["\"p/a.wasm\"", "\"bad name!.wasm\""]),
        ("policy_name", &["\"ok\"", "\"bad/name\""]),
        ("policy_config", &["\"{}\"", "\"{bad\""]),
    ];
    const ROUTING: [(&str, &[&str]); 6] = [
        ("busy_threshold", &["0.5", "0.0", "-1.0", "nan", "inf"]),
        ("default_temperature", &["0.0", "2.5", "-0.1", "inf"]),
        ("queue_timeout_ms", &["0", "5"]),
        ("approximate", &["true", "false"]),
        ("predict_on_route", &["true", "false"]),
        ("predict_ttl_ms", &["0", "1", "2000", "600000", "600001"]),
    ];
    const COST: [(&str, &[&str]); 2] = [
        ("prefill_load_scale", &["1.0", "-1.0", "nan"]),
        ("host_tier_weight", &["0.0", "inf"]),
    ];
    const SESSIONS: [(&str, &[&str]); 3] = [
        ("mode", &["\"hard\"", "\"soft\"", "\"off\""]),
        ("ttl_ms", &["0", "1", "300000", "86400000", "86400001"]),
        ("max_sessions", &["0", "1", "100000", "10000001"]),
    ];
    const WORKER: [(&str, &[&str]); 3] = [
        ("dp_size", &["0", "1", "2", "100000"]),
        ("dp_start", &["0", "4294967295"]),
        ("taints", &["[]", "[\"gpu\"]", "[\"\"]"]),
    ];
    const WORKER_KEYS: [&str; 4] = ["7", "07", "18446744073709551616", "x"];

    fn section(
        out: &mut String,
        header: &str,
        keys: &[(&str, &[&str])],
        picks: &[Option<proptest::sample::Index>],
    ) {
        out.push_str(header);
        for ((key, values), pick) in keys.iter().zip(picks) {
            if let Some(p) = pick {
                out.push_str(&format!("{key} = {}\n", values[p.index(values.len())]));
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 300,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// What the fuzz target `serve_config` asserts, on generated files: a configuration
        /// `validate` accepts builds a router and registers every worker, and reads back the same
        /// from its TOML; one it refuses says why.
        #[test]
        fn generated_configs_are_accepted_whole_or_refused_with_a_reason(
            picks in proptest::collection::vec(
                proptest::option::of(proptest::prelude::any::<proptest::sample::Index>()), 18),
            workers in proptest::collection::vec(
                (proptest::prelude::any::<proptest::sample::Index>(),
                 proptest::collection::vec(
                     proptest::option::of(proptest::prelude::any::<proptest::sample::Index>()), 3)),
                0..3),
        ) {
            let mut text = String::new();
            section(&mut text, "", &TOP, &picks[0..7]);
            section(&mut text, "[routing]\n", &ROUTING, &picks[7..13]);
            section(&mut text, "[cost]\n", &COST, &picks[13..15]);
            section(&mut text, "[sessions]\n", &SESSIONS, &picks[15..18]);
            for (key, fields) in &workers {
                let header = format!("[workers.\"{}\"]\n", WORKER_KEYS[key.index(WORKER_KEYS.len())]);
                section(&mut text, &header, &WORKER, fields);
            }
            let config = match ServeConfig::from_toml_str(&text, Path::new("")) {
                Ok(c) => c,
                Err(e) => {
                    // Only a worker key repeated (or a NaN/inf spelling TOML refuses) fails here.
                    proptest::prop_assert!(!e.is_empty());
                    return Ok(());
                }
            };
            match config.validate() {
                Ok(()) => {
                    let router = kvroute_core::router::Router::new(config.router_config()).unwrap();
                    let registered = config.register_workers(&router).unwrap();
                    proptest::prop_assert_eq!(registered.len(), config.workers.len());
                    // (TOML has no integers above i64::MAX: such a value cannot be written.)
                    if let Ok(back) = toml::to_string(&config) {
                        let again = ServeConfig::from_toml_str(&back, Path::new("")).unwrap();
                        proptest::prop_assert_eq!(again, config, "{}", back);
                    }
                }
                Err(e) => proptest::prop_assert!(!e.is_empty(), "{}", text),
            }
        }
    }

    #[test]
    fn the_picker_needs_a_model_and_a_port_of_its_own() {
        let mut c = crate::config::ServeConfig::default();
        c.ext_proc.listen = Some(SocketAddr::from(([127, 0, 0, 1], 9002)));
        let e = c.validate().unwrap_err();
        assert!(
            e.contains("ext_proc.listen") && e.contains("[models.NAME]"),
            "{e}"
        );
        c.models.insert(
            "m".into(),
            kvroute_tokenize::ModelSpec::new(std::path::PathBuf::from("tokenizer.json")),
        );
        c.ext_proc.listen = Some(c.listen);
        let e = c.validate().unwrap_err();
        assert!(e.contains("its own port"), "{e}");
    }
}
