//! The worker-fleet simulator: a discrete-event model of vLLM-like engines (SPEC §10) driven by a
//! trace and routed by the real [`Router`].
//!
//! One [`Engine`] per worker (its model — KV blocks, prefix cache, scheduling, step times, KV
//! events — is described in [`crate::engine`]). A step's KV events reach the router at the end of
//! the step plus `kv_event_lag_ms`, in order.
//!
//! # The router side
//! Each request is routed with [`Router::route_now`] on arrival (booked), `prefill_complete` is
//! called when its first token is stamped and `free` when its last one is. Nothing here scores
//! or picks: whatever policy the router has decides.
//!
//! # The router's queue
//! With a busy threshold in the router's configuration ([`RouterConfig::busy_threshold`], `kvroute
//! replay --queue fcfs|wspt|fair`), requests wait in a [`PendingQueue`] as SPEC §9 has them wait in
//! `kvroute serve`: an arrival is routed at once unless others wait or every eligible worker is
//! busy (`all_overloaded`); then it queues, and every capacity change (a first token, a request's
//! end) serves the head of the queue while the router finds it a worker, strict head of line.
//! The queue is the router's data structure with the router's order (and, with `fair`, its
//! fairness settings); each routed request is charged to its tenant and session as the router
//! charges it (uncached prompt tokens plus output tokens). Nothing times out in a replay: the
//! longest wait is reported instead.
//!
//! # Agentic workloads
//! A trace with [`crate::agents::AgentFlows`] is closed loop: a request with dependencies starts
//! when the last of them has finished (completed or refused) plus its think time, and is routed
//! with its session id and tenant.
//!
//! # A disaggregated fleet ([`FleetShape::Disaggregated`])
//! Workers `0..P` have the role `prefill`, `P..P+D` the role `decode`; with `zones = Z` the i-th
//! prefill worker and the j-th decode worker sit in zones `i % Z` and `j % Z` (topology
//! `zone = "z<k>"`, so both kinds are spread over every zone). The router (whose
//! `[disaggregation]` settings the caller chose) answers each request with a prefill and a decode
//! worker, or with one worker when a bypass rule keeps the prefill on the decode worker.
//! 1. The prefill engine computes the prompt and its first token (a prefill-only request).
//! 2. The KV moves to the decode engine. It carries the prompt tokens the decode engine does not
//!    already cache (its cached prefix when the transfer starts) at `bytes_per_token` bytes each,
//!    at `gbps_within` inside a zone and `gbps_cross` across, after `latency_ms`. Transfers into
//!    one decode engine queue behind each other (one link per engine); the prefill engine holds
//!    the request's blocks until its transfer ends. The router is told `prefill_complete` then.
//! 3. The decode engine allocates the prompt's blocks without computing them and generates every
//!    output token, the first in its first (decode) step: the client's time to first token is
//!    arrival to that token. `free` when the last one is stamped.
//!
//! A bypassed request (or one the router routed aggregated) runs whole on its one worker.
//!
//! # Router replicas ([`simulate_replicated`])
//! `R` routers in front of one fleet, as `kvroute serve --cluster` runs them: request `i` arrives at
//! replica `i % R`, which routes and books it and makes its lifecycle calls (`prefill_complete`,
//! `free`), as a proxy in front of that replica would. Every replica applies every engine's KV events
//! (each subscribes to the engines itself), at the same time. Each replica announces the changes to
//! its own bookings ([`BookingObserver`]) and the others apply them `sync_lag_ms` later
//! (`apply_remote_*`), in order: until then a replica does not count the others' latest bookings
//! in its load. That lag is what a real cluster's booking sync costs (typically under a
//! millisecond on one host over NATS; more across hosts or under load), and the replay shows how
//! much hit rate and time to first token it costs. Replica `r` tie-breaks with its own random
//! generator (the router's seed plus `r`). With `R = 1` nothing is announced: the run is exactly
//! [`simulate_fleet`]'s.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::engine::{BlockHashes, Engine, Kind, NewRequest, Token};
pub use crate::engine::{SimConfig, WorkerStats};
use crate::trace::Trace;
use kvroute_core::candidate::CandidateKey;
use kvroute_core::hashing;
use kvroute_core::indexer::{KvEvent, KvEventData, Tier};
use kvroute_core::queue::{PendingQueue, QueueEntry, QueueLimits};
use kvroute_core::router::replicas::{BookingEvent, BookingObserver};
use kvroute_core::router::{RouteDecision, RouteError, RouteRequest, Router, RouterConfig};
use kvroute_core::workers::{Role, Topology, WorkerSpec};

/// A trace's block hashes at one block size, computed once and shared by every policy's run.
pub struct PreparedTrace<'a> {
    pub trace: &'a Trace,
    pub block_size: u32,
    offsets: Vec<usize>,
    local: Vec<u64>,
    seq: Vec<u64>,
}

impl<'a> PreparedTrace<'a> {
    pub fn new(trace: &'a Trace, block_size: u32) -> Self {
        let b = block_size.max(1) as usize;
        let total: usize = trace.requests.iter().map(|r| r.tokens.len() / b).sum();
        let mut offsets = Vec::with_capacity(trace.requests.len() + 1);
        let mut local = Vec::with_capacity(total);
        let mut seq = Vec::with_capacity(total);
        let mut buf_l = Vec::new();
        let mut buf_s = Vec::new();
        offsets.push(0);
        for r in &trace.requests {
            hashing::local_block_hashes_into(&r.tokens, b, hashing::BASE_SEED, &mut buf_l);
            hashing::sequence_hashes_into(&buf_l, &mut buf_s);
            local.extend_from_slice(&buf_l);
            seq.extend_from_slice(&buf_s);
            offsets.push(local.len());
        }
        Self {
            trace,
            block_size,
            offsets,
            local,
            seq,
        }
    }

    /// Local (content) hashes of request `i`'s full blocks.
    pub fn local(&self, i: usize) -> &[u64] {
        &self.local[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Chained sequence hashes of request `i`'s full blocks.
    pub fn seq(&self, i: usize) -> &[u64] {
        &self.seq[self.offsets[i]..self.offsets[i + 1]]
    }
}

impl BlockHashes for PreparedTrace<'_> {
    #[inline]
    fn seq(&self, id: u64) -> &[u64] {
        PreparedTrace::seq(self, id as usize)
    }
    #[inline]
    fn local(&self, id: u64) -> &[u64] {
        PreparedTrace::local(self, id as usize)
    }
}

/// What happened to one request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutcome {
    /// The worker it was routed to, the decode worker when split (`None`: the router refused it).
    pub worker: Option<u32>,
    /// The worker that computed its prompt, when the request was split.
    pub prefill_worker: Option<u32>,
    pub arrival_ms: f64,
    /// NaN when it never got a first token.
    pub first_token_ms: f64,
    /// NaN when it never finished.
    pub done_ms: f64,
    pub prompt_tokens: u32,
    /// Prompt tokens the computing worker found in its prefix cache (at the admission that led to
    /// the first token).
    pub hit_tokens: u32,
    pub output_tokens: u32,
    /// Split requests: from the prefill's end to the KV's arrival on the decode engine, waiting
    /// for the link included (ms; NaN otherwise).
    pub transfer_ms: f64,
    /// Split requests in a zoned fleet: the KV crossed zones.
    pub cross_zone: Option<bool>,
    /// A bypass rule kept the prefill on the decode worker.
    pub bypassed: bool,
    /// Why it did not run (router error code or `exceeds_kv_capacity`).
    pub error: Option<String>,
    /// Time it waited in the router's queue, ms (0 when routed at once).
    pub queued_ms: f64,
    /// Its TTFT's floor: the compute of its uncached prompt tokens on the worker that computed
    /// them, alone ([`SimConfig::prefill_alone_ms`]; NaN when it never got a first token).
    pub prefill_alone_ms: f64,
}

/// The result of one simulation.
#[derive(Clone, Debug, Default)]
pub struct SimOutput {
    pub requests: Vec<RequestOutcome>,
    /// Every inter-token gap (ms) of every request, in no particular order.
    pub itl_ms: Vec<f32>,
    pub workers: Vec<WorkerStats>,
    /// KV events the router refused (should be 0: the simulator keeps its chains consistent).
    pub kv_events_rejected: u64,
    pub kv_events_applied: u64,
    /// Simulated time of the last event.
    pub end_ms: f64,
    /// The fleet had prefill and decode workers.
    pub disaggregated: bool,
    /// Booking sync messages delivered between router replicas (0 with one replica).
    pub sync_messages: u64,
    /// Of those, the ones a replica could not apply (a lifecycle call for a booking it never held).
    pub sync_refused: u64,
}

/// The booking events one replica announced, waiting to be sent to the others.
#[derive(Clone, Default)]
struct Outbox(Arc<Mutex<Vec<BookingEvent>>>);

impl BookingObserver for Outbox {
    fn on_booking(&self, event: BookingEvent) {
        self.0.lock().expect("outbox lock").push(event);
    }
}

/// The origin name replica `r`'s bookings carry on the others.
fn replica_name(r: u32) -> String {
    format!("replica-{r}")
}

/// The KV transfer of a disaggregated fleet.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TransferModel {
    /// Link speed inside a zone, gigabits per second.
    pub gbps_within: f64,
    /// Link speed across zones, gigabits per second.
    pub gbps_cross: f64,
    /// KV bytes per prompt token (all layers, K and V). The default, 131,072, is an 8B model with
    /// 32 layers, 8 KV heads of 128 dimensions, 16-bit values.
    pub bytes_per_token: u64,
    /// Fixed cost of one transfer (setup, handshake), ms.
    pub latency_ms: f64,
}

impl Default for TransferModel {
    fn default() -> Self {
        Self {
            gbps_within: 400.0,
            gbps_cross: 50.0,
            bytes_per_token: 131_072,
            latency_ms: 1.0,
        }
    }
}

impl TransferModel {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("--kv-transfer-gbps", self.gbps_within),
            ("--kv-transfer-cross-gbps", self.gbps_cross),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a positive number, got {v}"));
            }
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            return Err("--kv-transfer-latency-ms must be a finite number >= 0".into());
        }
        if self.bytes_per_token == 0 {
            return Err("--kv-bytes-per-token must be at least 1".into());
        }
        Ok(())
    }

    /// Milliseconds to move `tokens` tokens' KV.
    pub fn ms(&self, tokens: u32, cross: bool) -> f64 {
        let gbps = if cross {
            self.gbps_cross
        } else {
            self.gbps_within
        };
        self.latency_ms + (tokens as f64 * self.bytes_per_token as f64 * 8.0) / (gbps * 1e6)
    }
}

/// The simulated fleet.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FleetShape {
    /// `workers` engines of role `both`.
    Aggregated { workers: u32 },
    /// `prefill` engines of role `prefill`, `decode` of role `decode`, spread over `zones` zones.
    Disaggregated {
        prefill: u32,
        decode: u32,
        zones: u32,
        transfer: TransferModel,
    },
}

impl FleetShape {
    pub fn workers(&self) -> u32 {
        match self {
            FleetShape::Aggregated { workers } => *workers,
            FleetShape::Disaggregated {
                prefill, decode, ..
            } => prefill + decode,
        }
    }

    /// `8` or `4P+4D`.
    pub fn label(&self) -> String {
        match self {
            FleetShape::Aggregated { workers } => format!("{workers}"),
            FleetShape::Disaggregated {
                prefill, decode, ..
            } => format!("{prefill}P+{decode}D"),
        }
    }

    /// Worker `w`'s role and zone.
    fn place(&self, w: u32) -> (Role, Option<u32>) {
        match self {
            FleetShape::Aggregated { .. } => (Role::Both, None),
            FleetShape::Disaggregated { prefill, zones, .. } => {
                let z = (*zones).max(1);
                if w < *prefill {
                    (Role::Prefill, Some(w % z))
                } else {
                    (Role::Decode, Some((w - prefill) % z))
                }
            }
        }
    }

    fn validate(&self) -> Result<(), String> {
        match self {
            FleetShape::Aggregated { workers } if *workers == 0 => {
                Err("at least one worker is needed".into())
            }
            FleetShape::Aggregated { .. } => Ok(()),
            FleetShape::Disaggregated {
                prefill,
                decode,
                zones,
                transfer,
            } => {
                if *prefill == 0 || *decode == 0 {
                    return Err(
                        "a disaggregated fleet needs at least one prefill and one decode worker"
                            .into(),
                    );
                }
                if *zones == 0 {
                    return Err("--zones must be at least 1".into());
                }
                transfer.validate()
            }
        }
    }
}

/// Simulated time (ms), totally ordered for the event heap.
#[derive(Clone, Copy, Debug)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// What happens at a point of simulated time (after arrivals at the same instant).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// Engine `w`'s step ends.
    StepEnd(u32),
    /// Request `i`'s KV has reached its decode engine.
    TransferDone(u32),
    /// Sync message `k` reaches its replica.
    Sync(u32),
    /// Request `i` of a closed-loop (agentic) trace starts.
    Arrive(u32),
}

/// The id request `i` of a trace is routed under (what a canary split hashes: the replay's
/// requests carry no session).
pub fn request_id(i: usize) -> String {
    format!("replay-{i}")
}

/// Where a split request is.
#[derive(Clone, Copy)]
struct Split {
    prefill: u32,
    decode: u32,
    cross: Option<bool>,
    prefill_done_ms: f64,
}

/// The fleet: engines, requests and the event loop.
struct Fleet<'p, 'r> {
    cfg: &'p SimConfig,
    shape: &'p FleetShape,
    prepared: &'p PreparedTrace<'p>,
    /// The router replicas; request `i` belongs to replica `i % len`.
    routers: &'r [&'r Router],
    /// Per replica: the booking events it announced, not yet sent to the others.
    outboxes: Vec<Outbox>,
    sync_lag_ms: f64,
    /// Sync messages: (to replica, from replica, event); `None` once delivered.
    syncs: Vec<Option<(u32, u32, BookingEvent)>>,
    engines: Vec<Engine>,
    zone: Vec<Option<u32>>,
    /// Per request: `Some` while it is split.
    split: Vec<Option<Split>>,
    last_token_ms: Vec<f64>,
    /// When each engine's inbound KV link is free again.
    link_free_ms: Vec<f64>,
    out: SimOutput,
    /// (delivery time, worker, event), in delivery order.
    kv_fifo: VecDeque<(f64, u32, KvEventData)>,
    event_ids: Vec<u64>,
    due: BinaryHeap<Reverse<(Time, Due)>>,
    tokens: Vec<Token>,
    refused: Vec<u64>,
    done: u64,
    /// The router's queue, when the router has a busy threshold (module doc).
    queue: Option<PendingQueue<usize>>,
    /// Closed-loop traces: the requests waiting for each request, and how many each still waits
    /// for.
    dependents: Vec<Vec<u32>>,
    remaining: Vec<u32>,
    /// Capacity changed while an event was handled: serve the queue once it is.
    pump_pending: bool,
}

impl<'r> Fleet<'_, 'r> {
    fn deliver_until(&mut self, now: f64) {
        while self.kv_fifo.front().is_some_and(|(t, _, _)| *t <= now) {
            let (_, w, data) = self.kv_fifo.pop_front().expect("peeked");
            let id = &mut self.event_ids[w as usize];
            *id += 1;
            let ev = KvEvent {
                candidate: CandidateKey::new(u64::from(w), 0),
                tier: Tier::Device,
                event_id: *id,
                data,
            };
            // Every replica subscribes to every engine; the first one's answer is counted.
            match self.routers[0].apply_event(&ev) {
                Ok(Some(_)) => self.out.kv_events_applied += 1,
                Ok(None) | Err(_) => self.out.kv_events_rejected += 1,
            }
            for r in &self.routers[1..] {
                let _ = r.apply_event(&ev);
            }
        }
    }

    fn refuse(&mut self, i: usize, why: &str, now: f64) {
        self.out.requests[i].error = Some(why.into());
        self.split[i] = None;
        let _ = self.router(i).free(&request_id(i));
        self.flush(i, now);
        self.finished(i, now);
        self.pump_pending = true;
    }

    /// Request `i` is over (completed or refused): the requests waiting for it may start.
    fn finished(&mut self, i: usize, now: f64) {
        self.done += 1;
        let Some(flows) = self.prepared.trace.agents.as_ref() else {
            return;
        };
        for k in 0..self.dependents.get(i).map_or(0, Vec::len) {
            let j = self.dependents[i][k] as usize;
            self.remaining[j] -= 1;
            if self.remaining[j] == 0 {
                let at = now + flows.think_ms[j];
                self.due.push(Reverse((Time(at), Due::Arrive(j as u32))));
            }
        }
    }

    /// Request `i` as the router is asked it.
    fn route_request(&self, i: usize) -> RouteRequest {
        let tr = &self.prepared.trace.requests[i];
        let flows = self.prepared.trace.agents.as_ref();
        let keys = flows.filter(|_| self.cfg.send_session_keys);
        RouteRequest {
            request_id: Some(request_id(i)),
            expected_output_tokens: Some(tr.output_len),
            session_id: keys.map(|f| f.session_id(i)),
            parent_session_id: keys.and_then(|f| f.parent_session_id(i)),
            tenant: flows.map(|f| f.tenant(i)),
            ..RouteRequest::tokens(tr.tokens.clone())
        }
    }

    /// Charges a routed request's service to its flow in the queue (as the router does).
    fn charge(&mut self, i: usize, d: &RouteDecision, now: f64) {
        let Some(q) = self.queue.as_mut() else {
            return;
        };
        let Some(flows) = self.prepared.trace.agents.as_ref() else {
            return;
        };
        let out = self.prepared.trace.requests[i].output_len;
        let tokens = u64::from(d.prompt_tokens.saturating_sub(d.cached_tokens)) + u64::from(out);
        let session = self.cfg.send_session_keys.then(|| flows.session_id(i));
        q.charge(
            Some(&flows.tenant(i)),
            session.as_deref(),
            tokens,
            now / 1000.0,
        );
    }

    /// Serves the head of the queue while the router finds it a worker (SPEC §9).
    fn pump(&mut self, now: f64) {
        loop {
            let Some(&i) = self
                .queue
                .as_ref()
                .and_then(|q| q.peek(now / 1000.0))
                .map(|e| &e.payload)
            else {
                return;
            };
            let router = self.router(i);
            router.set_clock_us(Some(sim_us(now)));
            let result = router.route_now(self.route_request(i));
            self.flush(i, now);
            if matches!(result, Err(RouteError::AllOverloaded)) {
                return;
            }
            self.queue.as_mut().expect("peeked").pop(now / 1000.0);
            self.out.requests[i].queued_ms = now - self.out.requests[i].arrival_ms;
            self.routed(i, result, now);
        }
    }

    /// The replica request `i` arrives at.
    fn replica(&self, i: usize) -> usize {
        i % self.routers.len()
    }

    fn router(&self, i: usize) -> &'r Router {
        self.routers[self.replica(i)]
    }

    /// Sends what request `i`'s replica announced to every other replica, due `sync_lag_ms` from
    /// `now`.
    fn flush(&mut self, i: usize, now: f64) {
        let from = self.replica(i);
        let Some(outbox) = self.outboxes.get(from) else {
            return;
        };
        let events = std::mem::take(&mut *outbox.0.lock().expect("outbox lock"));
        for ev in events {
            for to in (0..self.routers.len()).filter(|&to| to != from) {
                let k = self.syncs.len() as u32;
                self.syncs.push(Some((to as u32, from as u32, ev.clone())));
                self.due
                    .push(Reverse((Time(now + self.sync_lag_ms), Due::Sync(k))));
            }
        }
    }

    /// Applies sync message `k` on its replica. What a replica refuses (a free for a booking it
    /// never saw) changes nothing, as in the server.
    fn sync(&mut self, k: u32) {
        let Some((to, from, ev)) = self.syncs[k as usize].take() else {
            return;
        };
        let r = self.routers[to as usize];
        let origin = replica_name(from);
        self.out.sync_messages += 1;
        let applied = match &ev {
            BookingEvent::Booked(rec) => r.apply_remote_book(&origin, rec, Instant::now()).is_ok(),
            BookingEvent::PrefillComplete { request_id } => {
                r.apply_remote_prefill_complete(request_id).is_ok()
            }
            BookingEvent::Output { request_id, tokens } => {
                r.apply_remote_output(request_id, *tokens).is_ok()
            }
            BookingEvent::Freed { request_id } => r.apply_remote_free(request_id).is_ok(),
        };
        if !applied {
            self.out.sync_refused += 1;
        }
    }

    fn submit(&mut self, w: u32, i: usize, kind: Kind, now: f64) {
        let tr = &self.prepared.trace.requests[i];
        let ok = self.engines[w as usize].submit(
            NewRequest {
                id: i as u64,
                prompt_tokens: tr.tokens.len() as u32,
                output_tokens: tr.output_len.max(1),
                kind,
            },
            self.cfg.block_size,
        );
        if !ok {
            // It could never hold all its tokens at once: an engine would reject it.
            return self.refuse(i, "exceeds_kv_capacity", now);
        }
        if !self.engines[w as usize].is_busy() {
            self.start_step(w, now);
        }
    }

    fn arrive(&mut self, i: usize, now: f64) {
        self.out.requests[i].arrival_ms = now;
        let router = self.router(i);
        // Policies see the trace's time, so state they age (sessions) behaves as it would live.
        router.set_clock_us(Some(sim_us(now)));
        let backlog = self
            .queue
            .as_ref()
            .is_some_and(|q| q.has_backlog_at_or_above(0));
        let decision = if backlog {
            Err(RouteError::AllOverloaded)
        } else {
            let d = router.route_now(self.route_request(i));
            self.flush(i, now);
            d
        };
        if matches!(decision, Err(RouteError::AllOverloaded)) && self.queue.is_some() {
            let tr = &self.prepared.trace.requests[i];
            let flows = self.prepared.trace.agents.as_ref();
            let entry = QueueEntry {
                request_id: request_id(i),
                class: 0,
                priority_jump: 0.0,
                arrival_secs: now / 1000.0,
                prompt_tokens: tr.tokens.len() as u32,
                best_cached_tokens: 0,
                tenant: flows.map(|f| f.tenant(i)),
                session: flows
                    .filter(|_| self.cfg.send_session_keys)
                    .map(|f| f.session_id(i)),
                payload: i,
            };
            let workers = self.engines.len();
            let q = self.queue.as_mut().expect("checked");
            match q.push(entry, workers) {
                Ok(()) => return,
                Err((e, _)) => {
                    self.out.requests[i].error = Some(RouteError::QueueFull(e).code().to_string());
                    self.finished(i, now);
                    return;
                }
            }
        }
        self.routed(i, decision, now);
    }

    /// Starts a routed request on its worker(s), or records why the router refused it.
    fn routed(&mut self, i: usize, decision: Result<RouteDecision, RouteError>, now: f64) {
        let d = match decision {
            Ok(d) => d,
            Err(e) => {
                self.out.requests[i].error = Some(e.code().to_string());
                self.finished(i, now);
                return;
            }
        };
        self.charge(i, &d, now);
        let w = d.candidate.worker_id as u32;
        let o = &mut self.out.requests[i];
        o.worker = Some(w);
        o.bypassed = d.bypass.is_some();
        match d.prefill.as_ref().filter(|_| d.disaggregated) {
            Some(p) => {
                let pw = p.candidate.worker_id as u32;
                o.prefill_worker = Some(pw);
                let cross = match (self.zone[pw as usize], self.zone[w as usize]) {
                    (Some(a), Some(b)) => Some(a != b),
                    _ => None,
                };
                o.cross_zone = cross;
                self.split[i] = Some(Split {
                    prefill: pw,
                    decode: w,
                    cross,
                    prefill_done_ms: f64::NAN,
                });
                self.submit(pw, i, Kind::PrefillOnly, now);
            }
            None => self.submit(w, i, Kind::Full, now),
        }
    }

    /// Schedules engine `w`'s next step (if it has work) and queues its end.
    fn start_step(&mut self, w: u32, now: f64) {
        let mut refused = std::mem::take(&mut self.refused);
        let step = self.engines[w as usize].start_step(self.cfg, self.prepared, &mut refused);
        for id in refused.drain(..) {
            let i = id as usize;
            if let Some(s) = self.split[i] {
                if s.decode == w {
                    // Its prefill engine still holds the blocks.
                    self.engines[s.prefill as usize].release(id, self.prepared);
                }
            }
            self.refuse(i, "exceeds_kv_capacity", now);
        }
        self.refused = refused;
        if let Some(ms) = step {
            self.due.push(Reverse((Time(now + ms), Due::StepEnd(w))));
        }
    }

    fn end_step(&mut self, w: u32, now: f64) {
        let mut tokens = std::mem::take(&mut self.tokens);
        self.engines[w as usize].end_step(self.prepared, &mut tokens);
        for t in tokens.drain(..) {
            let i = t.id as usize;
            match self.split[i] {
                Some(s) if s.prefill == w => {
                    let o = &mut self.out.requests[i];
                    o.hit_tokens = t.hit_tokens;
                    o.prefill_alone_ms = self
                        .cfg
                        .prefill_alone_ms(o.prompt_tokens.saturating_sub(t.hit_tokens), w);
                    self.prefill_done(i, s, now)
                }
                _ => self.token(i, t, now),
            }
        }
        self.tokens = tokens;
        let deliver_at = now + self.cfg.kv_event_lag_ms;
        for ev in self.engines[w as usize].drain_events() {
            self.kv_fifo.push_back((deliver_at, w, ev));
        }
        self.start_step(w, now);
    }

    /// A token for the client (a whole request's, or a split request's from its decode engine).
    fn token(&mut self, i: usize, t: Token, now: f64) {
        let o = &mut self.out.requests[i];
        let mut first = false;
        if t.n == 1 {
            o.first_token_ms = now;
            if self.split[i].is_none() {
                o.hit_tokens = t.hit_tokens;
                if let Some(w) = o.worker {
                    o.prefill_alone_ms = self
                        .cfg
                        .prefill_alone_ms(o.prompt_tokens.saturating_sub(t.hit_tokens), w);
                }
                first = true;
            }
        } else {
            self.out.itl_ms.push((now - self.last_token_ms[i]) as f32);
        }
        if t.done {
            o.done_ms = now;
            o.output_tokens = t.n;
        }
        if first {
            self.router(i).set_clock_us(Some(sim_us(now)));
            let _ = self.router(i).prefill_complete(&request_id(i));
            self.flush(i, now);
            self.pump_pending = true;
        }
        self.last_token_ms[i] = now;
        if t.done {
            self.split[i] = None;
            // The final output count, as a proxy reports it, then the end (learned step times).
            let router = self.router(i);
            router.set_clock_us(Some(sim_us(now)));
            let _ = router.output_progress(&request_id(i), t.n);
            let _ = router.free(&request_id(i));
            self.flush(i, now);
            self.finished(i, now);
            self.pump_pending = true;
        }
    }

    /// A split request's prompt is computed: its KV starts for the decode engine.
    fn prefill_done(&mut self, i: usize, mut s: Split, now: f64) {
        let FleetShape::Disaggregated { transfer, .. } = self.shape else {
            unreachable!("only a disaggregated fleet splits requests");
        };
        let b = self.cfg.block_size;
        let tr = &self.prepared.trace.requests[i];
        let prompt = tr.tokens.len() as u32;
        let cached = self.engines[s.decode as usize].cached_prefix(self.prepared.seq(i)) as u32 * b;
        let tokens = prompt - cached.min(prompt);
        let start = now.max(self.link_free_ms[s.decode as usize]);
        let end = start + transfer.ms(tokens, s.cross == Some(true));
        self.link_free_ms[s.decode as usize] = end;
        s.prefill_done_ms = now;
        self.split[i] = Some(s);
        self.due
            .push(Reverse((Time(end), Due::TransferDone(i as u32))));
    }

    fn transfer_done(&mut self, i: usize, now: f64) {
        let Some(s) = self.split[i] else {
            return; // refused meanwhile
        };
        self.engines[s.prefill as usize].release(i as u64, self.prepared);
        let o = &mut self.out.requests[i];
        o.transfer_ms = now - s.prefill_done_ms;
        self.router(i).set_clock_us(Some(sim_us(now)));
        let _ = self.router(i).prefill_complete(&request_id(i));
        self.flush(i, now);
        self.pump_pending = true;
        // The prefill engine's blocks went idle: nothing to schedule there, but its events wait.
        self.submit(s.decode, i, Kind::Transferred, now);
    }
}

/// Simulated milliseconds as the router's microsecond clock.
fn sim_us(ms: f64) -> u64 {
    (ms.max(0.0) * 1000.0) as u64
}

/// Replays `prepared` on a fleet of `workers` aggregated engines routed by `router`
/// ([`simulate_fleet`] with [`FleetShape::Aggregated`]).
pub fn simulate(
    router: &Router,
    prepared: &PreparedTrace<'_>,
    workers: u32,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimOutput, String> {
    simulate_fleet(
        router,
        prepared,
        &FleetShape::Aggregated { workers },
        cfg,
        progress,
    )
}

/// Replays `prepared` on the fleet `shape` routed by `router`.
///
/// Registers the fleet's workers (one rank each, with the simulated capacity, roles and zones) on
/// the router, which must be fresh. `progress` is called now and then with the number of requests
/// finished (completed or refused).
pub fn simulate_fleet(
    router: &Router,
    prepared: &PreparedTrace<'_>,
    shape: &FleetShape,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimOutput, String> {
    simulate_replicated(&[router], 0.0, prepared, shape, cfg, progress)
}

/// Replays `prepared` on the fleet `shape` routed by the replicas `routers` (at least one), whose
/// booking changes reach each other `sync_lag_ms` after they happen (module doc, "Router
/// replicas"). Registers the fleet on every router (each must be fresh) and, with more than one,
/// installs each one's booking observer.
pub fn simulate_replicated(
    routers: &[&Router],
    sync_lag_ms: f64,
    prepared: &PreparedTrace<'_>,
    shape: &FleetShape,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimOutput, String> {
    if routers.is_empty() {
        return Err("at least one router replica".into());
    }
    if !(sync_lag_ms.is_finite() && sync_lag_ms >= 0.0) {
        return Err(format!(
            "the sync lag must be a finite number of ms >= 0, got {sync_lag_ms}"
        ));
    }
    cfg.validate()?;
    shape.validate()?;
    if prepared.block_size != cfg.block_size {
        return Err("the trace was prepared for another block size".into());
    }
    if let Some(router) = routers
        .iter()
        .find(|r| r.config().block_size != cfg.block_size)
    {
        return Err(format!(
            "the router's block size ({}) differs from the workers' ({})",
            router.config().block_size,
            cfg.block_size
        ));
    }
    let workers = shape.workers();
    let mut zone = Vec::with_capacity(workers as usize);
    for w in 0..workers {
        let (role, z) = shape.place(w);
        zone.push(z);
        let mut topology = Topology::new();
        if let Some(z) = z {
            topology.insert(ZONE_DOMAIN.to_string(), format!("z{z}"));
        }
        for router in routers {
            router
                .upsert_worker(
                    u64::from(w),
                    WorkerSpec {
                        total_kv_blocks: u64::from(cfg.num_gpu_blocks),
                        max_num_batched_tokens: cfg.max_num_batched_tokens,
                        role,
                        topology: topology.clone(),
                        ..Default::default()
                    },
                )
                .map_err(|e| format!("cannot register worker {w}: {e}"))?;
        }
    }
    let outboxes: Vec<Outbox> = if routers.len() > 1 {
        routers
            .iter()
            .map(|r| {
                let outbox = Outbox::default();
                r.set_booking_observer(Some(Box::new(outbox.clone())));
                outbox
            })
            .collect()
    } else {
        Vec::new()
    };
    let trace = prepared.trace;
    let n = trace.requests.len();
    let mut fleet = Fleet {
        cfg,
        shape,
        prepared,
        routers,
        outboxes,
        sync_lag_ms,
        syncs: Vec::new(),
        engines: (0..workers)
            .map(|w| {
                let mut e = Engine::new(cfg.num_gpu_blocks);
                e.set_speed(cfg.worker_speed(w));
                e
            })
            .collect(),
        zone,
        split: vec![None; n],
        last_token_ms: vec![0.0; n],
        link_free_ms: vec![0.0; workers as usize],
        out: SimOutput {
            requests: trace
                .requests
                .iter()
                .map(|r| RequestOutcome {
                    worker: None,
                    prefill_worker: None,
                    arrival_ms: r.arrival_ms,
                    first_token_ms: f64::NAN,
                    done_ms: f64::NAN,
                    prompt_tokens: r.tokens.len() as u32,
                    hit_tokens: 0,
                    output_tokens: 0,
                    transfer_ms: f64::NAN,
                    cross_zone: None,
                    bypassed: false,
                    error: None,
                    queued_ms: 0.0,
                    prefill_alone_ms: f64::NAN,
                })
                .collect(),
            itl_ms: Vec::with_capacity(
                trace
                    .requests
                    .iter()
                    .map(|r| r.output_len.saturating_sub(1) as usize)
                    .sum(),
            ),
            ..Default::default()
        },
        kv_fifo: VecDeque::new(),
        event_ids: vec![0; workers as usize],
        due: BinaryHeap::new(),
        tokens: Vec::new(),
        refused: Vec::new(),
        done: 0,
        queue: sim_queue(routers[0].config()),
        dependents: Vec::new(),
        remaining: Vec::new(),
        pump_pending: false,
    };
    // A closed-loop trace: only requests without dependencies arrive on their own.
    let mut next_arrival = 0usize;
    if let Some(flows) = &trace.agents {
        fleet.dependents = vec![Vec::new(); n];
        fleet.remaining = vec![0; n];
        for (j, deps) in flows.deps.iter().enumerate() {
            fleet.remaining[j] = deps.len() as u32;
            for &d in deps {
                fleet.dependents[d as usize].push(j as u32);
            }
            if deps.is_empty() {
                fleet.due.push(Reverse((
                    Time(trace.requests[j].arrival_ms),
                    Due::Arrive(j as u32),
                )));
            }
        }
        next_arrival = n;
    }
    let mut reported = 0u64;
    let mut now = 0.0f64;
    loop {
        let due_t = fleet.due.peek().map(|Reverse((t, _))| t.0);
        let arr_t = trace.requests.get(next_arrival).map(|r| r.arrival_ms);
        let due_first = match (due_t, arr_t) {
            (None, None) => break,
            (Some(s), Some(a)) => s <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if due_first {
            let Reverse((t, what)) = fleet.due.pop().expect("peeked");
            now = t.0;
            fleet.deliver_until(now);
            match what {
                Due::StepEnd(w) => fleet.end_step(w, now),
                Due::TransferDone(i) => fleet.transfer_done(i as usize, now),
                Due::Sync(k) => fleet.sync(k),
                Due::Arrive(i) => fleet.arrive(i as usize, now),
            }
            // Serve the queue once the event is handled (an engine mid-step must restart its own
            // step first); and never leave requests waiting with nothing left to happen.
            let stalled =
                fleet.due.is_empty() && fleet.queue.as_ref().is_some_and(|q| !q.is_empty());
            if fleet.pump_pending || stalled {
                fleet.pump_pending = false;
                fleet.pump(now);
            }
        } else {
            now = arr_t.expect("some");
            fleet.deliver_until(now);
            fleet.arrive(next_arrival, now);
            next_arrival += 1;
        }
        if fleet.done >= reported + 64 {
            reported = fleet.done;
            progress(reported);
        }
    }
    fleet.deliver_until(f64::INFINITY);
    progress(fleet.done);
    debug_assert_eq!(fleet.done as usize, n);
    let mut out = fleet.out;
    out.workers = fleet.engines.iter().map(Engine::stats).collect();
    out.end_ms = now;
    out.disaggregated = matches!(shape, FleetShape::Disaggregated { .. });
    for r in routers.iter().filter(|_| routers.len() > 1) {
        r.set_booking_observer(None);
    }
    Ok(out)
}

/// The router's queue as the simulator keeps it: on with a busy threshold, in the router's order
/// and fairness, with no limits (a replay reports waits instead of refusing).
fn sim_queue(config: &RouterConfig) -> Option<PendingQueue<usize>> {
    config.busy_threshold?;
    let limits = QueueLimits {
        max_requests_per_worker: usize::MAX / 1024,
        max_tokens_per_worker: u64::MAX / 1024,
    };
    Some(match &config.fairness {
        Some(f) => PendingQueue::fair(config.queue_order, limits, f.clone()),
        None => PendingQueue::new(config.queue_order, limits),
    })
}

/// The topology domain a zoned replay fleet uses.
pub const ZONE_DOMAIN: &str = "zone";

#[cfg(test)]
mod tests;
