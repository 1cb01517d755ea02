//! The engine loop: one tokio task runs the replay's engine model ([`Engine`]) in real time, as
//! its module doc says to drive it: `start_step` → sleep the step's duration → `end_step` →
//! hand each stamped token to its request → publish the step's KV events. With nothing to run
//! it waits on a [`Notify`] that every submission rings.
//!
//! Why a mutex and not a channel of commands: a submission must know at once whether the engine
//! accepts it (a prompt too long for the KV capacity is a 400, not a stream that fails later), and
//! a client that goes away must release its blocks at once (the guard's `Drop`, which cannot
//! await). The lock is held only for the engine's bookkeeping, never across the step's sleep.
//!
//! Delivery never blocks the loop: each request has a bounded channel; when it is full (a slow
//! HTTP reader) the token waits in that request's own overflow queue, flushed in order at every
//! turn of the loop (and every few ms while the engine is otherwise idle), so one slow reader
//! delays nobody else.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, Notify};

use kvroute_events::publish::PubEvent;
use kvroute_replay::engine::{Engine, Kind, NewRequest, Token};
use kvroute_replay::SimConfig;

use crate::table::RequestTable;

/// How often buffered tokens are retried while the engine has no step to run.
const FLUSH_TICK: Duration = Duration::from_millis(5);

/// What a request receives from the engine, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Its `n`-th generated token (1 = the first), stamped at the end of the step that made it.
    Token {
        n: u32,
        /// The last one: the request is finished.
        done: bool,
        /// Prompt tokens found in the prefix cache when it was admitted.
        cached_tokens: u32,
    },
    /// The engine gave up on it before its first token (it can never fit).
    Refused,
}

/// Why a submission was refused at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// KV blocks the prompt and its output need.
    pub needed_blocks: u64,
    /// The engine's KV blocks.
    pub total_blocks: u32,
}

/// A point-in-time view for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    /// Blocks held by requests.
    pub used_blocks: u32,
    /// Blocks cached and held by nobody (evictable).
    pub idle_blocks: u32,
    pub total_blocks: u32,
    /// Requests accepted since start.
    pub requests_total: u64,
    /// Requests that finished with their last token.
    pub finished_total: u64,
    /// Requests released before their end (client went away).
    pub cancelled_total: u64,
    /// Requests refused (too long for the KV capacity).
    pub refused_total: u64,
    pub generated_tokens_total: u64,
    pub prompt_tokens_total: u64,
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens_total: u64,
    pub preemptions_total: u64,
    pub evicted_blocks_total: u64,
    pub steps_total: u64,
}

struct Slot {
    tx: mpsc::Sender<Delivery>,
    overflow: VecDeque<Delivery>,
}

impl Slot {
    /// Sends what waits, then `d`, as far as the channel takes them. `false` once the receiver
    /// is gone.
    fn deliver(&mut self, d: Option<Delivery>) -> bool {
        self.overflow.extend(d);
        while let Some(d) = self.overflow.pop_front() {
            match self.tx.try_send(d) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(d)) => {
                    self.overflow.push_front(d);
                    return true;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.overflow.clear();
                    return false;
                }
            }
        }
        true
    }
}

struct State {
    engine: Engine,
    table: RequestTable,
    slots: FxHashMap<u64, Slot>,
    /// Slots of finished requests whose last tokens still wait for room in their channel.
    draining: Vec<Slot>,
    /// The running step's KV events, converted while the requests they name were live.
    step_events: Vec<PubEvent>,
    next_id: u64,
    counts: Snapshot,
}

impl State {
    /// The engine's pending events in vLLM's form (called while the table names every request
    /// they come from).
    fn collect_events(&mut self) {
        let State {
            engine,
            table,
            step_events,
            ..
        } = self;
        step_events.extend(engine.drain_events().filter_map(|e| table.to_wire(e)));
    }

    fn flush(&mut self) {
        for s in self.slots.values_mut() {
            if !s.overflow.is_empty() {
                s.deliver(None);
            }
        }
        self.draining
            .retain_mut(|s| s.deliver(None) && !s.overflow.is_empty());
    }

    fn buffered(&self) -> bool {
        !self.draining.is_empty() || self.slots.values().any(|s| !s.overflow.is_empty())
    }
}

struct Shared {
    state: Mutex<State>,
    wake: Notify,
    sim: SimConfig,
    capacity: usize,
    events: Option<mpsc::UnboundedSender<Vec<PubEvent>>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn release(&self, id: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        if st.engine.release(id, &st.table) {
            st.counts.cancelled_total += 1;
            tracing::debug!(id, "request released before its end");
        }
        st.table.remove(id);
        st.slots.remove(&id);
    }
}

/// A handle on the running engine loop (cheap to clone).
#[derive(Clone)]
pub struct EngineLoop {
    shared: Arc<Shared>,
}

/// An accepted request: its deliveries, and the guard that releases it when dropped.
pub struct Submission {
    pub id: u64,
    pub deliveries: mpsc::Receiver<Delivery>,
    pub guard: ReleaseGuard,
}

/// Releases its request from the engine when dropped (a client that went away mid-stream: its
/// blocks go idle at once). Harmless after the request finished.
pub struct ReleaseGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        self.shared.release(self.id);
    }
}

impl EngineLoop {
    /// Starts the loop on the current tokio runtime. `capacity` bounds each request's channel;
    /// each step's KV events (when there are any) go to `events`.
    pub fn spawn(
        sim: SimConfig,
        capacity: usize,
        events: Option<mpsc::UnboundedSender<Vec<PubEvent>>>,
    ) -> EngineLoop {
        let state = State {
            engine: Engine::new(sim.num_gpu_blocks),
            table: RequestTable::new(sim.block_size),
            slots: FxHashMap::default(),
            draining: Vec::new(),
            step_events: Vec::new(),
            next_id: 1,
            counts: Snapshot::default(),
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            wake: Notify::new(),
            sim,
            capacity: capacity.max(1),
            events,
        });
        tokio::spawn(run(shared.clone()));
        EngineLoop { shared }
    }

    /// The engine's settings.
    pub fn sim(&self) -> &SimConfig {
        &self.shared.sim
    }

    /// Queues a request of `prompt` that generates `max_tokens` tokens.
    pub fn submit(&self, prompt: &[u32], max_tokens: u32) -> Result<Submission, Refusal> {
        let (tx, rx) = mpsc::channel(self.shared.capacity);
        let block_size = self.shared.sim.block_size;
        let mut st = self.shared.lock();
        let st = &mut *st;
        let id = st.next_id;
        st.next_id += 1;
        st.table.insert(id, prompt);
        let req = NewRequest {
            id,
            prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
            output_tokens: max_tokens.max(1),
            kind: Kind::Full,
        };
        if !st.engine.submit(req, block_size) {
            st.table.remove(id);
            st.counts.refused_total += 1;
            return Err(Refusal {
                needed_blocks: (prompt.len() as u64 + u64::from(max_tokens.max(1)))
                    .div_ceil(u64::from(block_size.max(1))),
                total_blocks: self.shared.sim.num_gpu_blocks,
            });
        }
        st.counts.requests_total += 1;
        st.counts.prompt_tokens_total += prompt.len() as u64;
        st.slots.insert(
            id,
            Slot {
                tx,
                overflow: VecDeque::new(),
            },
        );
        self.shared.wake.notify_one();
        Ok(Submission {
            id,
            deliveries: rx,
            guard: ReleaseGuard {
                shared: self.shared.clone(),
                id,
            },
        })
    }

    /// Counts and gauges for `/metrics`.
    pub fn snapshot(&self) -> Snapshot {
        let st = self.shared.lock();
        let stats = st.engine.stats();
        Snapshot {
            running: st.engine.running(),
            waiting: st.engine.waiting(),
            used_blocks: st.engine.used_blocks(),
            idle_blocks: st.engine.idle_blocks(),
            total_blocks: self.shared.sim.num_gpu_blocks,
            preemptions_total: stats.preemptions,
            evicted_blocks_total: stats.evicted_blocks,
            steps_total: stats.steps,
            ..st.counts.clone()
        }
    }
}

/// The loop; it runs as long as its runtime.
async fn run(shared: Arc<Shared>) {
    let mut tokens: Vec<Token> = Vec::new();
    let mut refused: Vec<u64> = Vec::new();
    loop {
        let (step_ms, buffered) = {
            let mut st = shared.lock();
            let st = &mut *st;
            st.flush();
            let ms = st.engine.start_step(&shared.sim, &st.table, &mut refused);
            for id in refused.drain(..) {
                st.counts.refused_total += 1;
                if let Some(mut slot) = st.slots.remove(&id) {
                    slot.deliver(Some(Delivery::Refused));
                    if !slot.overflow.is_empty() {
                        st.draining.push(slot);
                    }
                }
                st.table.remove(id);
            }
            st.collect_events();
            (ms, st.buffered())
        };
        let Some(ms) = step_ms else {
            // Idle: a submission wakes us; buffered tokens are retried meanwhile.
            let wake = shared.wake.notified();
            if buffered {
                let _ = tokio::time::timeout(FLUSH_TICK, wake).await;
            } else {
                wake.await;
            }
            continue;
        };
        tokio::time::sleep(Duration::from_secs_f64(ms.max(0.0) / 1000.0)).await;
        let batch = {
            let mut st = shared.lock();
            let st = &mut *st;
            st.engine.end_step(&st.table, &mut tokens);
            for t in tokens.drain(..) {
                st.counts.generated_tokens_total += 1;
                if t.n == 1 {
                    st.counts.cached_tokens_total += u64::from(t.hit_tokens);
                }
                let d = Delivery::Token {
                    n: t.n,
                    done: t.done,
                    cached_tokens: t.hit_tokens,
                };
                if t.done {
                    st.counts.finished_total += 1;
                    if let Some(mut slot) = st.slots.remove(&t.id) {
                        if slot.deliver(Some(d)) && !slot.overflow.is_empty() {
                            st.draining.push(slot);
                        }
                    }
                    st.table.remove(t.id);
                } else if let Some(slot) = st.slots.get_mut(&t.id) {
                    if !slot.deliver(Some(d)) {
                        // The receiver is gone; its guard releases the request.
                        slot.overflow.clear();
                    }
                }
            }
            // Released mid-step, or refused: nothing left to deliver to.
            st.collect_events();
            std::mem::take(&mut st.step_events)
        };
        if !batch.is_empty() {
            if let Some(tx) = &shared.events {
                let _ = tx.send(batch);
            }
        }
    }
}

#[cfg(test)]
mod tests;
