//! The worker registry: which workers exist, their ranks, taints, capacity and draining state.
//!
//! Every route reads the registry and writes are rare (a worker joins, leaves, changes taints), so
//! the registry is an immutable [`RegistrySnapshot`] behind an `ArcSwap`: a route loads it without
//! a lock, and a write builds the next snapshot under a mutex and swaps it in. A snapshot carries the
//! flattened candidate list (one entry per data-parallel rank) that eligibility filters, with taints
//! already interned to small ids — what policies receive, so no string is touched per candidate on
//! the route path.

use std::collections::BTreeMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::candidate::{CandidateKey, DpRank, WorkerId};
use crate::indexer::{Indexer, Slot};

pub mod topology;
pub use topology::{topology_taint, Role, Topology, TOPOLOGY_TAINT_PREFIX};

/// Taints starting with this prefix are derived by the host and cannot be set by a client.
pub const RESERVED_TAINT_PREFIX: &str = "kvroute.";

/// Where the host subscribes to a worker's KV events (ZMQ).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct KvEventsSpec {
    pub endpoint: String,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default)]
    pub topic: String,
}

/// What a client says about a worker when registering it (API.md `PUT /v1/workers/{id}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSpec {
    pub dp_start: DpRank,
    pub dp_size: u32,
    pub taints: Vec<String>,
    /// KV capacity in blocks; 0 = unknown.
    pub total_kv_blocks: u64,
    /// Prefill token budget per step; 0 = unknown (the worker is then never considered busy).
    pub max_num_batched_tokens: u32,
    pub kv_events: Option<KvEventsSpec>,
    /// Which half of a disaggregated request the worker takes (default `both`).
    pub role: Role,
    /// Where the worker sits (domain → value); each entry is the derived taint
    /// `topology/<domain>=<value>`.
    pub topology: Topology,
    /// The engine's OpenAI-compatible server (`http://HOST:PORT`), where `kvroute serve --proxy`
    /// forwards the requests routed to this worker. The routing core never reads it.
    pub endpoint: Option<String>,
    /// The model the worker serves (a `[models.NAME]` of the proxy); the proxy routes a request
    /// for model M among the workers serving M.
    pub model: Option<String>,
}

impl Default for WorkerSpec {
    fn default() -> Self {
        Self {
            dp_start: 0,
            dp_size: 1,
            taints: Vec::new(),
            total_kv_blocks: 0,
            max_num_batched_tokens: 0,
            kv_events: None,
            role: Role::Both,
            topology: Topology::new(),
            endpoint: None,
            model: None,
        }
    }
}

/// Limits on what a registration may contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryLimits {
    pub max_dp_size: u32,
    pub max_taints_per_worker: usize,
    pub max_taint_len: usize,
    /// Distinct taint names ever seen (ids are never reused).
    pub max_distinct_taints: usize,
    pub max_workers: usize,
}

impl Default for RegistryLimits {
    fn default() -> Self {
        Self {
            max_dp_size: 1024,
            max_taints_per_worker: 64,
            max_taint_len: 256,
            max_distinct_taints: 65_536,
            max_workers: 16_384,
        }
    }
}

/// A registration the registry refused, naming the field at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    pub field: String,
    pub message: String,
}

fn spec_error(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        message: message.into(),
    }
}

/// Longest model name a worker may declare.
pub const MAX_MODEL_NAME_LEN: usize = 256;

/// A worker's `endpoint`: `http://HOST:PORT` with an optional path prefix (the proxy appends
/// `/v1/...`). Plain HTTP only: engines sit on a private network next to the router.
fn validate_endpoint(endpoint: Option<&str>) -> Result<(), SpecError> {
    let Some(e) = endpoint else {
        return Ok(());
    };
    let bad = |why: &str| Err(spec_error("endpoint", why.to_string()));
    if e.len() > 2048 {
        return bad("at most 2048 bytes");
    }
    let Some(rest) = e.strip_prefix("http://") else {
        return bad("must start with http:// (the proxy speaks plain HTTP/1.1 to engines)");
    };
    let authority = rest.split('/').next().unwrap_or("");
    let Some((host, port)) = authority.rsplit_once(':') else {
        return bad("must name a port: http://HOST:PORT");
    };
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '@') {
        return bad("must name a host: http://HOST:PORT");
    }
    if port.parse::<u16>().map_or(true, |p| p == 0) {
        return bad("the port must be a number from 1 to 65535");
    }
    if e.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return bad("cannot contain spaces or control characters");
    }
    Ok(())
}

/// A registered worker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Worker {
    pub worker_id: WorkerId,
    pub dp_start: DpRank,
    pub dp_size: u32,
    pub taints: Vec<String>,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u32,
    pub draining: bool,
    pub kv_events: Option<KvEventsSpec>,
    pub role: Role,
    pub topology: Topology,
    pub endpoint: Option<String>,
    pub model: Option<String>,
}

/// A change to a registered worker (`PATCH /v1/workers/{id}`): each field given replaces the
/// worker's; absent fields stay as they are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerPatch {
    pub taints: Option<Vec<String>>,
    pub draining: Option<bool>,
    pub role: Option<Role>,
    pub topology: Option<Topology>,
}

impl Worker {
    pub fn ranks(&self) -> impl Iterator<Item = DpRank> {
        self.dp_start..self.dp_start + self.dp_size
    }

    /// Every taint the worker has: the client's, then the ones derived from its topology.
    pub fn all_taints(&self) -> impl Iterator<Item = std::borrow::Cow<'_, str>> + '_ {
        self.taints
            .iter()
            .map(|t| std::borrow::Cow::Borrowed(t.as_str()))
            .chain(topology::topology_taints(&self.topology).map(std::borrow::Cow::Owned))
    }
}

/// The taint name table: id `i` is `names[i]`. Grow-only, so `version` (the length) identifies it.
/// The same type the policy runtime sends to plugins, so a decision passes it through unchanged.
pub use crate::candidate::TaintTable as TaintNames;

/// One routing candidate as eligibility and the router see it.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateEntry {
    pub key: CandidateKey,
    /// Its slot in the indexer (stable while the worker is registered).
    pub slot: Slot,
    /// Interned taints, sorted.
    pub taint_ids: SmallVec<[u32; 8]>,
    pub draining: bool,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u32,
    pub role: Role,
}

impl CandidateEntry {
    #[inline]
    pub fn has_taint(&self, id: u32) -> bool {
        self.taint_ids.binary_search(&id).is_ok()
    }
}

/// An immutable view of the registry.
#[derive(Clone, Debug, Default)]
pub struct RegistrySnapshot {
    pub workers: BTreeMap<WorkerId, Worker>,
    /// All candidates, ordered by (worker_id, dp_rank).
    pub candidates: Vec<CandidateEntry>,
    /// Workers whose role is `prefill`: with none, `disaggregation: auto` routes aggregated.
    pub prefill_role_workers: usize,
    pub taints: TaintNames,
    taint_ids: FxHashMap<String, u32>,
    /// Every subscribed endpoint (after the per-rank port offset) and who uses it, so a
    /// registration that would share a socket with another worker is refused.
    endpoints: FxHashMap<String, EndpointUse>,
}

impl RegistrySnapshot {
    /// The id of a taint name, if any worker ever had it.
    pub fn taint_id(&self, name: &str) -> Option<u32> {
        self.taint_ids.get(name).copied()
    }

    pub fn taint_name(&self, id: u32) -> Option<&str> {
        self.taints.names.get(id as usize).map(String::as_str)
    }

    /// Candidate entry of a key (binary search: candidates are sorted).
    pub fn candidate(&self, key: CandidateKey) -> Option<&CandidateEntry> {
        self.candidates
            .binary_search_by_key(&key, |c| c.key)
            .ok()
            .map(|i| &self.candidates[i])
    }

    /// Refuses endpoints another worker already uses (two subscriptions on one socket would each
    /// attribute the other engine's events to their own worker).
    fn check_endpoints_free(
        &self,
        worker_id: WorkerId,
        endpoints: &[(String, EndpointUse)],
    ) -> Result<(), SpecError> {
        for (ep, mine) in endpoints {
            if let Some(theirs) = self.endpoints.get(ep).filter(|u| u.worker != worker_id) {
                return Err(spec_error(
                    mine.field(),
                    format!(
                        "rank {}'s {} endpoint {ep} is already worker {}'s rank {} {} endpoint; \
                         each engine needs its own ports",
                        mine.rank,
                        mine.kind(),
                        theirs.worker,
                        theirs.rank,
                        theirs.kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn rebuild_candidates(&mut self, indexer: &Indexer) {
        let mut out = Vec::with_capacity(self.candidates.len());
        for w in self.workers.values() {
            let mut ids: SmallVec<[u32; 8]> =
                w.all_taints().map(|t| self.taint_ids[t.as_ref()]).collect();
            ids.sort_unstable();
            ids.dedup();
            for r in w.ranks() {
                let key = CandidateKey::new(w.worker_id, r);
                out.push(CandidateEntry {
                    key,
                    slot: indexer.slot(key),
                    taint_ids: ids.clone(),
                    draining: w.draining,
                    total_kv_blocks: w.total_kv_blocks,
                    max_num_batched_tokens: w.max_num_batched_tokens,
                    role: w.role,
                });
            }
        }
        self.candidates = out;
        self.prefill_role_workers = self
            .workers
            .values()
            .filter(|w| w.role == Role::Prefill)
            .count();
    }

    fn intern(&mut self, taints: &[String], limits: &RegistryLimits) -> Result<(), SpecError> {
        let new: Vec<&String> = taints
            .iter()
            .filter(|t| !self.taint_ids.contains_key(t.as_str()))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        if self.taint_ids.len() + new.len() > limits.max_distinct_taints {
            return Err(spec_error(
                "taints",
                format!(
                    "the fleet would have more than {} distinct taints; reuse taint names",
                    limits.max_distinct_taints
                ),
            ));
        }
        let mut names: Vec<String> = self.taints.names.to_vec();
        for t in new {
            if !self.taint_ids.contains_key(t.as_str()) {
                self.taint_ids.insert(t.clone(), names.len() as u32);
                names.push(t.clone());
            }
        }
        self.taints = TaintNames {
            version: names.len() as u64,
            names: names.into(),
        };
        Ok(())
    }
}

/// A change to the registry, told to whoever follows it ([`Registry::on_change`]): the KV event
/// ingestion subscribes and unsubscribes ranks from these, whoever made the change (the HTTP API,
/// the configuration file, a library caller).
#[derive(Clone, Debug)]
pub enum WorkerChange {
    /// Registered, replaced or patched: the worker as it now is.
    Upserted(Worker),
    /// Removed.
    Removed(WorkerId),
}

/// A follower of registry changes. Called while the registry's write lock is held, so followers
/// see changes in the order they were made; it must not write to the registry.
pub type WorkerChangeHook = Arc<dyn Fn(&WorkerChange) + Send + Sync>;

/// The registry. Reads are lock-free snapshots; writes are serialized.
pub struct Registry {
    current: ArcSwap<RegistrySnapshot>,
    write: Mutex<()>,
    limits: RegistryLimits,
    followers: Mutex<Vec<WorkerChangeHook>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("current", &self.current)
            .field("limits", &self.limits)
            .field("followers", &self.followers.lock().len())
            .finish()
    }
}

impl Registry {
    pub fn new(limits: RegistryLimits) -> Self {
        Self {
            current: ArcSwap::from_pointee(RegistrySnapshot::default()),
            write: Mutex::new(()),
            limits,
            followers: Mutex::new(Vec::new()),
        }
    }

    /// Adds a follower: it is called after every later registration, patch and removal.
    pub fn on_change(&self, hook: WorkerChangeHook) {
        self.followers.lock().push(hook);
    }

    fn notify(&self, change: &WorkerChange) {
        let followers = self.followers.lock().clone();
        for f in &followers {
            f(change);
        }
    }

    /// The current snapshot.
    #[inline]
    pub fn snapshot(&self) -> Arc<RegistrySnapshot> {
        self.current.load_full()
    }

    pub fn limits(&self) -> &RegistryLimits {
        &self.limits
    }

    fn validate_taints(&self, taints: &[String]) -> Result<(), SpecError> {
        if taints.len() > self.limits.max_taints_per_worker {
            return Err(spec_error(
                "taints",
                format!(
                    "{} taints given; at most {} per worker",
                    taints.len(),
                    self.limits.max_taints_per_worker
                ),
            ));
        }
        for (i, t) in taints.iter().enumerate() {
            let field = format!("taints[{i}]");
            if t.is_empty() {
                return Err(spec_error(field, "a taint cannot be empty"));
            }
            if t.len() > self.limits.max_taint_len {
                return Err(spec_error(
                    field,
                    format!("longer than {} bytes", self.limits.max_taint_len),
                ));
            }
            for reserved in [RESERVED_TAINT_PREFIX, TOPOLOGY_TAINT_PREFIX] {
                if t.starts_with(reserved) {
                    return Err(spec_error(
                        field,
                        format!(
                            "taints starting with `{reserved}` are reserved for the host (set \
                             `topology` for topology taints)"
                        ),
                    ));
                }
            }
            if t.chars().any(char::is_control) {
                return Err(spec_error(field, "control characters are not allowed"));
            }
        }
        Ok(())
    }

    fn validate(&self, spec: &WorkerSpec) -> Result<(), SpecError> {
        if spec.dp_size == 0 {
            return Err(spec_error("dp_size", "must be at least 1"));
        }
        if spec.dp_size > self.limits.max_dp_size {
            return Err(spec_error(
                "dp_size",
                format!("at most {}", self.limits.max_dp_size),
            ));
        }
        if spec.dp_start.checked_add(spec.dp_size).is_none() {
            return Err(spec_error("dp_start", "dp_start + dp_size overflows"));
        }
        self.validate_taints(&spec.taints)?;
        validate_endpoint(spec.endpoint.as_deref())?;
        if let Some(m) = &spec.model {
            if m.is_empty() || m.len() > MAX_MODEL_NAME_LEN || m.chars().any(char::is_control) {
                return Err(spec_error(
                    "model",
                    format!("must be 1 to {MAX_MODEL_NAME_LEN} bytes without control characters"),
                ));
            }
        }
        topology::validate_topology(&spec.topology, spec.taints.len(), &self.limits)
    }

    /// Registers or replaces a worker. Ranks that the new spec drops are removed from the index
    /// (returned so the caller can drop their load too). Returns the worker and the dropped ranks.
    pub fn upsert(
        &self,
        worker_id: WorkerId,
        spec: WorkerSpec,
        indexer: &Indexer,
    ) -> Result<(Worker, Vec<CandidateKey>), SpecError> {
        self.validate(&spec)?;
        // After `validate`: the rank range is known not to overflow.
        let endpoints = worker_endpoints(&spec, worker_id)?;
        let _w = self.write.lock();
        let mut next = (*self.current.load_full()).clone();
        next.check_endpoints_free(worker_id, &endpoints)?;
        if !next.workers.contains_key(&worker_id) && next.workers.len() >= self.limits.max_workers {
            return Err(spec_error(
                "worker_id",
                format!(
                    "the registry already holds {} workers",
                    self.limits.max_workers
                ),
            ));
        }
        next.intern(&spec.taints, &self.limits)?;
        next.intern(
            &topology::topology_taints(&spec.topology).collect::<Vec<_>>(),
            &self.limits,
        )?;
        let draining = next.workers.get(&worker_id).is_some_and(|w| w.draining);
        let worker = Worker {
            worker_id,
            dp_start: spec.dp_start,
            dp_size: spec.dp_size,
            taints: dedup(spec.taints),
            total_kv_blocks: spec.total_kv_blocks,
            max_num_batched_tokens: spec.max_num_batched_tokens,
            draining,
            kv_events: spec.kv_events,
            role: spec.role,
            topology: spec.topology,
            endpoint: spec.endpoint,
            model: spec.model,
        };
        let dropped: Vec<CandidateKey> = next
            .workers
            .get(&worker_id)
            .map(|old| {
                old.ranks()
                    .filter(|r| !worker.ranks().any(|n| n == *r))
                    .map(|r| CandidateKey::new(worker_id, r))
                    .collect()
            })
            .unwrap_or_default();
        for &k in &dropped {
            indexer.remove_candidate(k);
        }
        next.workers.insert(worker_id, worker.clone());
        next.endpoints.retain(|_, u| u.worker != worker_id);
        next.endpoints.extend(endpoints);
        next.rebuild_candidates(indexer);
        self.current.store(Arc::new(next));
        self.notify(&WorkerChange::Upserted(worker.clone()));
        Ok((worker, dropped))
    }

    /// Replaces a worker's taints and/or draining flag. `None` if the worker is unknown.
    pub fn patch(
        &self,
        worker_id: WorkerId,
        taints: Option<Vec<String>>,
        draining: Option<bool>,
        indexer: &Indexer,
    ) -> Result<Option<Worker>, SpecError> {
        let patch = WorkerPatch {
            taints,
            draining,
            ..Default::default()
        };
        self.patch_with(worker_id, patch, indexer)
    }

    /// Applies a [`WorkerPatch`]: the fields given replace the worker's, all or nothing. `None`
    /// if the worker is unknown.
    pub fn patch_with(
        &self,
        worker_id: WorkerId,
        patch: WorkerPatch,
        indexer: &Indexer,
    ) -> Result<Option<Worker>, SpecError> {
        if let Some(t) = &patch.taints {
            self.validate_taints(t)?;
        }
        let _w = self.write.lock();
        let mut next = (*self.current.load_full()).clone();
        let Some(old) = next.workers.get(&worker_id) else {
            return Ok(None);
        };
        let client_taints = patch.taints.as_ref().map_or(old.taints.len(), Vec::len);
        let topology = patch.topology.as_ref().unwrap_or(&old.topology);
        topology::validate_topology(topology, client_taints, &self.limits)?;
        if let Some(t) = &patch.taints {
            next.intern(t, &self.limits)?;
        }
        if let Some(t) = &patch.topology {
            next.intern(
                &topology::topology_taints(t).collect::<Vec<_>>(),
                &self.limits,
            )?;
        }
        let w = next.workers.get_mut(&worker_id).expect("checked above");
        if let Some(t) = patch.taints {
            w.taints = dedup(t);
        }
        if let Some(d) = patch.draining {
            w.draining = d;
        }
        if let Some(r) = patch.role {
            w.role = r;
        }
        if let Some(t) = patch.topology {
            w.topology = t;
        }
        let worker = w.clone();
        next.rebuild_candidates(indexer);
        self.current.store(Arc::new(next));
        self.notify(&WorkerChange::Upserted(worker.clone()));
        Ok(Some(worker))
    }

    /// Removes a worker from the registry and the index. `None` if it was unknown.
    pub fn remove(&self, worker_id: WorkerId, indexer: &Indexer) -> Option<Worker> {
        let _w = self.write.lock();
        let mut next = (*self.current.load_full()).clone();
        let worker = next.workers.remove(&worker_id)?;
        next.endpoints.retain(|_, u| u.worker != worker_id);
        indexer.remove_worker(worker_id);
        next.rebuild_candidates(indexer);
        self.current.store(Arc::new(next));
        self.notify(&WorkerChange::Removed(worker_id));
        Some(worker)
    }
}

fn dedup(mut taints: Vec<String>) -> Vec<String> {
    let mut seen = rustc_hash::FxHashSet::default();
    taints.retain(|t| seen.insert(t.clone()));
    taints
}

/// Who subscribes on an endpoint: a worker's rank, on its publisher or its replay socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct EndpointUse {
    worker: WorkerId,
    rank: DpRank,
    replay: bool,
}

impl EndpointUse {
    fn kind(&self) -> &'static str {
        if self.replay {
            "replay"
        } else {
            "publisher"
        }
    }

    fn field(&self) -> &'static str {
        if self.replay {
            "kv_events.replay_endpoint"
        } else {
            "kv_events.endpoint"
        }
    }
}

/// Every endpoint a registration subscribes on, one publisher (and replay) per rank, refusing a
/// registration whose ranks would share one: rank `r` uses `PORT + r` (SPEC §4.1), so a replay
/// port less than `dp_size` above the publisher port lands on another rank's publisher — the
/// README once shipped exactly that.
fn worker_endpoints(
    spec: &WorkerSpec,
    worker: WorkerId,
) -> Result<Vec<(String, EndpointUse)>, SpecError> {
    let Some(ev) = &spec.kv_events else {
        return Ok(Vec::new());
    };
    if ev.endpoint.is_empty() {
        return Err(spec_error("kv_events.endpoint", "cannot be empty"));
    }
    let mut out = Vec::with_capacity(2 * spec.dp_size as usize);
    let mut seen: FxHashMap<String, EndpointUse> = FxHashMap::default();
    for rank in spec.dp_start..spec.dp_start + spec.dp_size {
        let (publisher, replay) = rank_endpoints(ev, rank).map_err(|(field, e)| {
            spec_error(
                field,
                format!("{:?}: {} (e.g. tcp://10.0.0.5:5557)", e.endpoint, e.reason),
            )
        })?;
        let uses = [(publisher, false)]
            .into_iter()
            .chain(replay.map(|r| (r, true)));
        for (ep, replay) in uses {
            let mine = EndpointUse {
                worker,
                rank,
                replay,
            };
            if let Some(other) = seen.insert(ep.clone(), mine) {
                // Publisher ports differ from each other, and so do replay ports: a clash is
                // always one rank's replay endpoint on a rank's publisher endpoint.
                let (rep, publ) = if mine.replay {
                    (mine, other)
                } else {
                    (other, mine)
                };
                return Err(spec_error(
                    "kv_events.replay_endpoint",
                    format!(
                        "rank {}'s replay endpoint {ep} is rank {}'s publisher endpoint; ranks \
                         use port + rank, so leave a gap of dp_size ({}) between endpoint and \
                         replay_endpoint",
                        rep.rank, publ.rank, spec.dp_size
                    ),
                ));
            }
            out.push((ep, mine));
        }
    }
    Ok(out)
}

/// A `kv_events` endpoint we cannot subscribe to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kv_events endpoint {endpoint:?}: {reason}")]
pub struct EndpointError {
    pub endpoint: String,
    pub reason: &'static str,
}

/// `endpoint` with its port moved up by `offset`, and a `*` host made connectable.
pub fn offset_endpoint(endpoint: &str, offset: u32) -> Result<String, EndpointError> {
    let err = |reason| EndpointError {
        endpoint: endpoint.to_string(),
        reason,
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| err("only tcp:// endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| err("expected tcp://HOST:PORT"))?;
    if host.is_empty() {
        return Err(err("expected tcp://HOST:PORT"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| err("port is not a number in 1..=65535"))?;
    if port == 0 {
        return Err(err("port is not a number in 1..=65535"));
    }
    let port = u32::from(port)
        .checked_add(offset)
        .filter(|&p| p <= u32::from(u16::MAX))
        .ok_or_else(|| err("port + data-parallel rank offset exceeds 65535"))?;
    let host = if host == "*" { "127.0.0.1" } else { host };
    Ok(format!("tcp://{host}:{port}"))
}

/// Rank `rank`'s publisher and replay endpoints (an empty replay endpoint is none). The error
/// names the field at fault: the registry checks a registration with this, for every rank, so
/// what it accepts can be subscribed.
pub fn rank_endpoints(
    kv: &KvEventsSpec,
    rank: DpRank,
) -> Result<(String, Option<String>), (&'static str, EndpointError)> {
    let endpoint = offset_endpoint(&kv.endpoint, rank).map_err(|e| ("kv_events.endpoint", e))?;
    let replay = match kv.replay_endpoint.as_deref() {
        None | Some("") => None,
        Some(ep) => Some(offset_endpoint(ep, rank).map_err(|e| ("kv_events.replay_endpoint", e))?),
    };
    Ok((endpoint, replay))
}

#[cfg(test)]
mod tests;
