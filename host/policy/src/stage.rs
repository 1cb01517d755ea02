//! One stage of a loaded policy version and its pool of configured instances.
//!
//! A decision takes an instance from the pool, calls it and puts it back; an instance that failed
//! is poisoned and handed to the maintenance thread, which drops it and makes a replacement. A
//! decision never waits for an instance to be made: instantiating and `configure` can take as
//! long as the setup deadline (a second), so a decision that finds its stage's pool empty asks the
//! maintenance thread for another instance, waits (at most as long as a decision may run) only
//! while another decision is using an instance, and otherwise falls back at once (`instantiate`).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::answer::{validate, Answer};
use super::bindings::kvroute::policy::types::Request;
use super::error::FallbackReason;
use super::failure::Failure;
use super::instance::{InstanceError, PluginInstance};
use super::plugin::CompiledPlugin;
use super::shared::RuntimeShared;
use super::stats::PolicyStats;
use super::wire::Data;
use super::DecisionContext;

/// Most instances of one stage the maintenance thread makes on demand, in multiples of the warm
/// pool size (decisions on more threads at once than that fall back while they wait).
const GROW_CAP_FACTOR: usize = 4;

/// One stage of a loaded policy version: a compiled component, its configuration and weight, and a
/// pool of configured instances. A single-component policy is one stage.
pub(crate) struct Stage {
    pub(crate) plugin: Arc<CompiledPlugin>,
    pub(crate) config: String,
    pub(crate) weight: f64,
    policy: Arc<str>,
    shared: Arc<RuntimeShared>,
    stats: Arc<PolicyStats>,
    pool: Mutex<Vec<PluginInstance>>,
    live: Arc<AtomicUsize>,
    /// A request for another instance is with the maintenance thread.
    growing: AtomicBool,
    /// Signalled when an instance is put back in the pool or a taken one is retired.
    returned: parking_lot::Condvar,
    /// Instances taken by decisions and not yet given back.
    busy: AtomicUsize,
    /// Whether this stage's configuration reads the host's `base-cost` column, as its instances'
    /// `configure` answered: [`READS_UNKNOWN`] until one has, then [`READS_NO`] or [`READS_YES`].
    /// One instance answering yes makes it yes for good, so an unknown or mixed answer always
    /// gets the column computed.
    reads_base_cost: AtomicU8,
}

const READS_UNKNOWN: u8 = 0;
const READS_NO: u8 = 1;
const READS_YES: u8 = 2;

impl Stage {
    pub(crate) fn new(
        plugin: Arc<CompiledPlugin>,
        config: String,
        weight: f64,
        policy: Arc<str>,
        shared: Arc<RuntimeShared>,
        stats: Arc<PolicyStats>,
    ) -> Self {
        Self {
            plugin,
            config,
            weight,
            policy,
            shared,
            stats,
            pool: Mutex::new(Vec::new()),
            live: Arc::new(AtomicUsize::new(0)),
            growing: AtomicBool::new(false),
            returned: parking_lot::Condvar::new(),
            busy: AtomicUsize::new(0),
            reads_base_cost: AtomicU8::new(READS_UNKNOWN),
        }
    }

    /// True unless every instance made so far said its configuration does not read `base-cost`
    /// (so before any instance exists, true).
    pub(crate) fn reads_base_cost(&self) -> bool {
        self.reads_base_cost.load(Relaxed) != READS_NO
    }

    /// Instantiates and configures a new instance (not added to the pool). Never on the request
    /// path: this runs for up to the setup deadline.
    pub(crate) fn new_instance(&self) -> Result<PluginInstance, InstanceError> {
        let inst = PluginInstance::new(
            &self.shared,
            &self.plugin.pre,
            &self.config,
            self.policy.clone(),
            self.stats.clone(),
            &self.live,
        )?;
        if inst.reads_base_cost {
            self.reads_base_cost.store(READS_YES, Relaxed);
        } else {
            // Only an unknown becomes a no: a yes stays.
            let _ =
                self.reads_base_cost
                    .compare_exchange(READS_UNKNOWN, READS_NO, Relaxed, Relaxed);
        }
        Ok(inst)
    }

    /// Takes an instance from the pool. When the pool is empty, `inline` (load time only) makes
    /// one here; on the request path the decision falls back at once and the maintenance thread
    /// is asked for another instance.
    fn take(self: &Arc<Self>, inline: bool) -> Result<PluginInstance, Failure> {
        // `busy` changes only under the pool's lock (here and in `give_back`), so a decision that
        // finds the pool empty and nothing in use knows no instance is about to come back.
        {
            let mut pool = self.pool.lock();
            if let Some(inst) = pool.pop() {
                self.busy.fetch_add(1, Relaxed);
                return Ok(inst);
            }
        }
        if !inline {
            if !self.growing.swap(true, Relaxed) {
                let stage = Arc::downgrade(self);
                let cap = self.shared.instances_per_stage * GROW_CAP_FACTOR;
                self.shared.maintenance.submit(move || {
                    if let Some(stage) = stage.upgrade() {
                        stage.grow(cap);
                    }
                });
            }
            // None pooled but some in use by other decisions: wait for one to come back, at most
            // as long as a decision may run (the deadline and its grace windows, 10 × deadline)
            // — a wait for another decision, never for instantiation.
            // Checked again under the lock: one may have come back since the pop above.
            {
                let mut pool = self.pool.lock();
                let until = Instant::now() + self.shared.config.deadline() * 10;
                while pool.is_empty() && self.busy.load(Relaxed) > 0 {
                    if self.returned.wait_until(&mut pool, until).timed_out() {
                        break;
                    }
                }
                if let Some(inst) = pool.pop() {
                    self.busy.fetch_add(1, Relaxed);
                    return Ok(inst);
                }
            }
            // With instances alive (busy in other decisions, or being replaced) the miss is the
            // host's: it is not held against the policy. With none alive, every replacement
            // failed, and it is.
            let counts = self.live() == 0;
            let mut failure = Failure::new(
                FallbackReason::Instantiate,
                "no ready instance (a replacement is being made off the request path)",
            );
            failure.counts = counts;
            return Err(failure);
        }
        self.busy.fetch_add(1, Relaxed);
        self.new_instance().map_err(|e| {
            self.busy.fetch_sub(1, Relaxed);
            let detail = match e {
                InstanceError::ConfigRejected(m) => format!("configure rejected: {m}"),
                InstanceError::Failed { during, message } => format!("{during}: {message}"),
            };
            Failure::new(FallbackReason::Instantiate, detail)
        })
    }

    /// For the maintenance thread, after a decision found the pool empty: one more instance,
    /// unless one has come back meanwhile or `cap` are alive.
    pub(crate) fn grow(&self, cap: usize) {
        if self.pooled() == 0 && self.live() < cap {
            match self.new_instance() {
                Ok(inst) => self.put(inst),
                Err(e) => {
                    tracing::warn!(policy = &*self.policy, error = ?e, "could not add a policy instance")
                }
            }
        }
        self.growing.store(false, Relaxed);
    }

    /// Takes an instance from the pool, if any is there.
    pub(crate) fn take_pooled(&self) -> Option<PluginInstance> {
        self.pool.lock().pop()
    }

    /// Returns an instance to the pool (and wakes a decision waiting for one).
    pub(crate) fn put(&self, inst: PluginInstance) {
        self.pool.lock().push(inst);
        self.returned.notify_one();
    }

    /// Returns an instance a decision took: to the pool, or (`poisoned`) to the maintenance
    /// thread, which drops it and makes a replacement. Either wakes decisions waiting for one.
    fn give_back(self: &Arc<Self>, inst: PluginInstance, poisoned: bool) {
        {
            let mut pool = self.pool.lock();
            self.busy.fetch_sub(1, Relaxed);
            if !poisoned {
                pool.push(inst);
                drop(pool);
                self.returned.notify_one();
                return;
            }
        }
        // Dropped (and replaced) on the maintenance thread; if the runtime is being dropped, the
        // job is dropped unrun and the instance with it.
        let stage = Arc::downgrade(self);
        let target = self.shared.instances_per_stage;
        self.shared.maintenance.submit(move || {
            drop(inst);
            if let Some(stage) = stage.upgrade() {
                stage.refill(target);
            }
        });
        // Waiters re-check: with nothing in use any more, they fall back at once.
        self.returned.notify_all();
    }

    /// Instances alive (pooled or in use).
    pub(crate) fn live(&self) -> usize {
        self.live.load(Relaxed)
    }

    /// Instances waiting in the pool.
    pub(crate) fn pooled(&self) -> usize {
        self.pool.lock().len()
    }

    /// Makes instances until `target` are alive; stops at the first failure.
    pub(crate) fn refill(&self, target: usize) {
        while self.live() < target {
            match self.new_instance() {
                Ok(inst) => self.put(inst),
                Err(e) => {
                    tracing::warn!(policy = &*self.policy, error = ?e, "could not refill the policy instance pool");
                    return;
                }
            }
        }
    }

    /// One decision on this stage: take an instance, call, validate, and return the instance to
    /// the pool, or drop it (poisoned) and ask for a replacement. `inline`: make an instance here
    /// if the pool is empty (load time only, see [`Stage::take`]).
    pub(crate) fn decide(
        self: &Arc<Self>,
        req: Request,
        data: Data<'_>,
        ctx: DecisionContext<'_>,
        allow_pick: bool,
        ticks: u64,
        inline: bool,
    ) -> Result<Answer, Failure> {
        let n = super::wire::candidate_count(data);
        let mut inst = self.take(inline)?;
        match inst
            .decide(req, data, ctx, ticks)
            .and_then(|d| validate(d, n, allow_pick))
        {
            Ok(answer) => {
                self.give_back(inst, false);
                Ok(answer)
            }
            Err(failure) => {
                // Poisoned: dropped (and replaced) by the maintenance thread, off the request path.
                self.give_back(inst, true);
                Err(failure)
            }
        }
    }
}
