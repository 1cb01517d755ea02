//! Plugin instances and the per-stage pool of them.
//!
//! An instance is one `Store` with one instantiated component, configured once, reused for many
//! decisions. A trap (including a deadline interrupt) poisons the whole store, and an invalid
//! answer makes the instance suspect, so either drops it; the pool is refilled off the request
//! path by the runtime's maintenance thread. A decision never waits for an instance to be made:
//! instantiating and `configure` can take as long as the setup deadline (a second), so a decision
//! that finds its stage's pool empty asks the maintenance thread for another instance, waits (at
//! most as long as a decision may run) only while another decision is using an instance, and
//! otherwise falls back at once (`instantiate`).
//!
//! Nothing a plugin hands the host is taken at its word: a `costs` list is lifted out of the guest
//! only when its length is the number of candidates (see [`RawDecision`]), and its text (log lines,
//! a `configure` error, `info`'s name and version) is bounded (see [`MAX_PLUGIN_TEXT`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use wasmtime::component::{Func, TypedFunc};
use wasmtime::{ResourceLimiter, Store, StoreContextMut, Trap, UpdateDeadline};

use super::answer::{validate, Answer, RawDecision, EXPECTED_COSTS};
use super::bindings::kvroute::policy::types::{Candidates, HostContext, LogLevel, Request};
use super::bindings::{PolicyPlugin, PolicyPluginPre};
use super::error::FallbackReason;
pub(crate) use super::failure::{Failure, FailureDetail};
use super::runtime::RuntimeShared;
use super::stats::PolicyStats;
use super::ticker::{CallGuard, GuestActivity};
use super::DecisionContext;
use kvroute_core::rng::SeededRng;

/// Longest text a plugin hands the host that is kept: a log line, a `configure` error, the last
/// error line quoted in a failure. Longer text is cut at a character boundary and says so.
pub(crate) const MAX_PLUGIN_TEXT: usize = 1024;

/// `text` cut to at most [`MAX_PLUGIN_TEXT`] bytes at a character boundary; a cut says how long
/// the original was. Control characters (a forged log line's newline) become spaces.
pub(crate) fn bounded_text(text: &str) -> String {
    let mut cut = text.len().min(MAX_PLUGIN_TEXT);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out: String = text[..cut]
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if cut < text.len() {
        out.push_str(&format!("... (cut: {} bytes in all)", text.len()));
    }
    out
}

/// What a store carries: the limits and the log bucket of one instance.
pub(crate) struct HostState {
    policy: Arc<str>,
    memory_limit: usize,
    /// Set when the limiter refused a `memory.grow`; a trap after that is a memory-limit failure.
    memory_denied: bool,
    /// The last error-level line the plugin logged during the current call, kept even when the
    /// rate limit drops it from the log: the SDK's panic hook logs the panic's message and
    /// location there just before the trap, which is what an author needs to see.
    last_error_log: Option<String>,
    log_rate: f64,
    log_burst: f64,
    /// The version's counters, which also hold its log allowance: the rate limit belongs to the
    /// policy version, not to an instance (a fresh instance after every failed call would
    /// otherwise get a fresh burst).
    stats: Arc<PolicyStats>,
    /// Thread CPU time and wall time at the start of the current grace window (`None`: the call
    /// has not reached its first deadline check).
    grace_window: Option<(std::time::Duration, Instant)>,
    grace_windows: u32,
    grace_ticks: u64,
    max_grace_windows: u32,
    /// The fixed pseudo-random stream behind `wasi:random` (see `runtime.rs`).
    pub(crate) entropy: SeededRng,
    /// The runtime's record of guest calls, whose ticker may be parked (see `ticker.rs`).
    activity: Arc<GuestActivity>,
    /// The epoch tick period.
    tick: std::time::Duration,
    /// A call that found the ticker parked keeps its own time until the ticker has ticked again.
    self_timed: Option<SelfTimed>,
}

impl HostState {
    pub(crate) fn new(policy: Arc<str>, shared: &RuntimeShared, stats: Arc<PolicyStats>) -> Self {
        let burst = f64::from(shared.config.log_burst);
        Self {
            policy,
            memory_limit: usize::try_from(shared.config.memory_limit_bytes).unwrap_or(usize::MAX),
            memory_denied: false,
            last_error_log: None,
            log_rate: f64::from(shared.config.log_lines_per_second),
            log_burst: burst,
            stats,
            entropy: SeededRng::new(0x6b76_726f_7574_6521),
            grace_window: None,
            grace_windows: 0,
            grace_ticks: shared.config.grace_ticks(),
            max_grace_windows: shared.config.max_grace_windows(),
            activity: shared.activity.clone(),
            tick: std::time::Duration::from_micros(shared.config.epoch_tick_us),
            self_timed: None,
        }
    }

    /// Arms a new call: deadline state reset, memory flag cleared.
    #[inline]
    fn arm(&mut self) {
        self.memory_denied = false;
        self.last_error_log = None;
        self.grace_window = None;
        self.grace_windows = 0;
        self.self_timed = None;
    }
}

/// The clock of a call that started while the epoch ticker was parked.
#[derive(Clone, Copy)]
struct SelfTimed {
    /// When the call started: its tick 0.
    start: Instant,
    /// The ticker's count then; a change means the ticker runs again.
    ticks_at_start: u64,
    /// The tick (counted from `start`) at which the current wait ends.
    deadline: u64,
}

/// Arms a guest call that may run for `ticks` epochs before its first deadline check. `running`
/// says whether the call found the epoch ticker parked: then the epoch stands still until the
/// ticker wakes (which takes up to a millisecond or two on a virtual machine), so the call keeps
/// its own time: its epoch deadline is due at once, and the deadline callback counts ticks of the
/// wall clock at every check (grace windows included) until the ticker has ticked, then hands the
/// rest of the current wait back to epochs. Calls that find the ticker running pay nothing for this.
pub(crate) fn arm_call(store: &mut Store<HostState>, ticks: u64, running: &CallGuard<'_>) {
    let s = store.data_mut();
    s.arm();
    if running.found_ticker_parked() {
        s.self_timed = Some(SelfTimed {
            start: Instant::now(),
            ticks_at_start: s.activity.ticks(),
            deadline: ticks,
        });
        store.set_epoch_deadline(0);
    } else {
        store.set_epoch_deadline(ticks);
    }
}

/// CPU time consumed by the calling thread (`None` where the platform has no such clock).
fn thread_cpu_time() -> Option<std::time::Duration> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant of the platform.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        if rc == 0 {
            return Some(std::time::Duration::new(
                ts.tv_sec as u64,
                ts.tv_nsec as u32,
            ));
        }
    }
    None
}

/// Called by wasmtime when a call's epoch deadline passes. The first time, it opens a grace
/// window; at the end of a window it interrupts the call if the thread ran for at least a quarter
/// of the window, and opens another window if the thread was mostly descheduled — so a short call
/// that was preempted gets to finish instead of the policy being blamed for the host's scheduling.
fn on_deadline(mut ctx: StoreContextMut<'_, HostState>) -> wasmtime::Result<UpdateDeadline> {
    let s = ctx.data_mut();
    let Some(mut timed) = s.self_timed else {
        return Ok(deadline_passed(s));
    };
    // The call started while the ticker was parked (see `arm_call`): it counts ticks of the wall
    // clock itself, checking at every opportunity, until the ticker has ticked again.
    let tick = s.tick.as_nanos().max(1);
    let elapsed_ns = timed.start.elapsed().as_nanos();
    let elapsed = u64::try_from(elapsed_ns / tick).unwrap_or(u64::MAX);
    if s.activity.ticks() != timed.ticks_at_start {
        // The ticker runs again and has just ticked: whatever is left of the current wait, in
        // whole real ticks rounded down (a running ticker's first tick also comes anywhere within
        // a period of a call's start, so a wait is never longer than its ticks).
        s.self_timed = None;
        let wait_ns = u128::from(timed.deadline) * tick;
        let left = u64::try_from(wait_ns.saturating_sub(elapsed_ns) / tick).unwrap_or(u64::MAX);
        if left > 0 {
            return Ok(UpdateDeadline::Continue(left));
        }
        return Ok(deadline_passed(s));
    }
    if elapsed < timed.deadline {
        return Ok(UpdateDeadline::Continue(0));
    }
    // A deadline passed on the call's own clock: the ordinary decision, whose next wait is again
    // counted on the call's own clock.
    Ok(match deadline_passed(s) {
        UpdateDeadline::Continue(ticks) => {
            timed.deadline = elapsed.saturating_add(ticks);
            s.self_timed = Some(timed);
            UpdateDeadline::Continue(0)
        }
        other => other,
    })
}

/// The ordinary deadline decision (see [`on_deadline`]): open a grace window, or at the end of
/// one, interrupt the call or give it another window.
fn deadline_passed(s: &mut HostState) -> UpdateDeadline {
    let now = (thread_cpu_time(), Instant::now());
    let Some(cpu_now) = now.0 else {
        return UpdateDeadline::Interrupt;
    };
    match s.grace_window {
        None => {
            s.grace_window = Some((cpu_now, now.1));
            UpdateDeadline::Continue(s.grace_ticks)
        }
        Some((cpu_start, wall_start)) => {
            let ran = cpu_now.saturating_sub(cpu_start);
            let wall = now.1.duration_since(wall_start);
            s.grace_windows += 1;
            if ran * 4 >= wall || s.grace_windows >= s.max_grace_windows {
                UpdateDeadline::Interrupt
            } else {
                s.grace_window = Some((cpu_now, now.1));
                UpdateDeadline::Continue(s.grace_ticks)
            }
        }
    }
}

impl ResourceLimiter for HostState {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_limit {
            self.memory_denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

impl super::bindings::kvroute::policy::types::Host for HostState {}

impl super::bindings::kvroute::policy::host_log::Host for HostState {
    fn log(&mut self, level: LogLevel, message: String) {
        if matches!(level, LogLevel::Error) {
            self.last_error_log = Some(bounded_text(&message));
        }
        if !self.stats.take_log_token(self.log_rate, self.log_burst) {
            self.stats.record_log_dropped();
            return;
        }
        let message = bounded_text(&message);
        let policy = &*self.policy;
        match level {
            LogLevel::Trace => {
                tracing::trace!(target: "kvroute::policy::plugin", policy, "{message}")
            }
            LogLevel::Debug => {
                tracing::debug!(target: "kvroute::policy::plugin", policy, "{message}")
            }
            LogLevel::Info => {
                tracing::info!(target: "kvroute::policy::plugin", policy, "{message}")
            }
            LogLevel::Warn => {
                tracing::warn!(target: "kvroute::policy::plugin", policy, "{message}")
            }
            LogLevel::Error => {
                tracing::error!(target: "kvroute::policy::plugin", policy, "{message}")
            }
        }
    }
}

/// Creates a store for an instance of a component: limits, deadline behaviour, log bucket.
pub(crate) fn new_store(
    shared: &RuntimeShared,
    policy: Arc<str>,
    stats: Arc<PolicyStats>,
) -> Store<HostState> {
    let mut store = Store::new(&shared.engine, HostState::new(policy, shared, stats));
    store.limiter(|s| s as &mut dyn ResourceLimiter);
    store.epoch_deadline_callback(on_deadline);
    store.set_epoch_deadline(shared.setup_ticks);
    store
}

/// What an author reads about a failed guest call: the plugin's own last error line first (a
/// panic's message and location, logged by the SDK's hook), then what the runtime saw, without
/// the wasm backtrace unless there is nothing else to go on.
pub(crate) fn describe_failure(error: &wasmtime::Error, state: &HostState) -> String {
    let cause = error.root_cause().to_string();
    let mut out = String::new();
    if state.memory_denied {
        out.push_str(&format!(
            "ran out of memory: a memory.grow past the limit of {} bytes \
             (policy_runtime.memory_limit_bytes) was refused; ",
            state.memory_limit
        ));
    }
    match &state.last_error_log {
        Some(said) => out.push_str(&format!("the plugin logged {said:?}, then: {cause}")),
        None if out.is_empty() => out.push_str(&format!("{error:#}")),
        None => out.push_str(&cause),
    }
    out
}

/// Classifies a failed call.
pub(crate) fn classify(err: &wasmtime::Error, memory_denied: bool) -> FallbackReason {
    if matches!(err.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
        FallbackReason::Deadline
    } else if memory_denied {
        FallbackReason::MemoryLimit
    } else {
        FallbackReason::Trap
    }
}

/// `decide` with the host's own lifting of its answer.
type DecideFn<'a> = TypedFunc<(Request<'a>, Candidates<'a>), (RawDecision,)>;

/// Decrements the stage's live-instance count when an instance is dropped.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// One long-lived, configured instance of a component.
pub(crate) struct PluginInstance {
    store: Store<HostState>,
    plugin: PolicyPlugin,
    /// The export `decide`, type-checked against [`DecideFn`] when the instance was made.
    decide: Func,
    /// The context (taint-table version, block size) this instance was last given (`None`:
    /// never).
    context: Option<(u64, u32)>,
    /// The runtime's record of running guest calls (keeps the epoch ticker awake). The store's
    /// state holds the same one; this copy lets a call's guard borrow it while the store is
    /// borrowed mutably for the call.
    activity: Arc<GuestActivity>,
    _live: LiveGuard,
}

/// Why making an instance failed.
#[derive(Debug)]
pub(crate) enum InstanceError {
    /// `configure` returned an error: the component's message, verbatim.
    ConfigRejected(String),
    /// Instantiation or `configure` trapped or failed.
    Failed {
        during: &'static str,
        message: String,
    },
}

impl PluginInstance {
    /// Calls `set-context` when this instance has not seen `ctx` yet (also used to prime a new
    /// instance ahead of its first decision).
    pub(crate) fn sync_context(
        &mut self,
        ctx: DecisionContext<'_>,
        ticks: u64,
    ) -> Result<(), Failure> {
        if self.context == Some(ctx.key()) {
            return Ok(());
        }
        let names: Vec<&str> = ctx.taints.names.iter().map(String::as_str).collect();
        let running = self.activity.enter();
        arm_call(&mut self.store, ticks, &running);
        let wire = HostContext {
            version: ctx.taints.version,
            block_size: ctx.block_size,
            taint_names: &names,
        };
        match self
            .plugin
            .kvroute_policy_policy()
            .call_set_context(&mut self.store, wire)
        {
            Ok(()) => {
                self.context = Some(ctx.key());
                Ok(())
            }
            Err(e) => Err(Failure::wasm("set-context", e, self.store.data())),
        }
    }

    /// One `decide` call under the deadline of `ticks` epochs.
    pub(crate) fn decide(
        &mut self,
        req: Request<'_>,
        cands: Candidates<'_>,
        ctx: DecisionContext<'_>,
        ticks: u64,
    ) -> Result<RawDecision, Failure> {
        self.sync_context(ctx, ticks)?;
        let n = super::wire::candidate_count(&cands);
        // SAFETY: `self.decide` was type-checked against `DecideFn` when the instance was made
        // (`Stage::new_instance`); lifetimes play no part in a component type.
        let decide: DecideFn<'_> = unsafe { TypedFunc::new_unchecked(self.decide) };
        let running = self.activity.enter();
        arm_call(&mut self.store, ticks, &running);
        EXPECTED_COSTS.set(n);
        decide
            .call(&mut self.store, (req, cands))
            .map(|(d,)| d)
            .map_err(|e| Failure::wasm("decide", e, self.store.data()))
    }
}

/// One stage of a loaded policy version: a compiled component, its configuration and weight, and a
/// pool of configured instances. A single-component policy is one stage.
pub(crate) struct Stage {
    pub(crate) plugin: Arc<super::runtime::CompiledPlugin>,
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
}

impl Stage {
    pub(crate) fn new(
        plugin: Arc<super::runtime::CompiledPlugin>,
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
        }
    }

    fn pre(&self) -> &PolicyPluginPre<HostState> {
        &self.plugin.pre
    }

    /// Instantiates and configures a new instance (not added to the pool). Never on the request
    /// path: this runs for up to the setup deadline.
    pub(crate) fn new_instance(&self) -> Result<PluginInstance, InstanceError> {
        let mut store = new_store(&self.shared, self.policy.clone(), self.stats.clone());
        let running = self.shared.activity.enter();
        let failed = |during, e: wasmtime::Error, store: &Store<HostState>| InstanceError::Failed {
            during,
            message: describe_failure(&e, store.data()),
        };
        let instance = self
            .pre()
            .instance_pre()
            .instantiate(&mut store)
            .map_err(|e| failed("instantiation", e, &store))?;
        let plugin = PolicyPlugin::new(&mut store, &instance)
            .map_err(|e| failed("instantiation", e, &store))?;
        let decide = instance
            .get_export_index(&mut store, None, super::runtime::POLICY_EXPORT)
            .and_then(|iface| instance.get_export_index(&mut store, Some(&iface), "decide"))
            .and_then(|f| instance.get_func(&mut store, f))
            .ok_or_else(|| InstanceError::Failed {
                during: "instantiation",
                message: "no export decide".into(),
            })?;
        decide
            .typed::<(Request<'_>, Candidates<'_>), (RawDecision,)>(&store)
            .map_err(|e| failed("instantiation", e, &store))?;
        store.data_mut().arm();
        store.set_epoch_deadline(self.shared.setup_ticks);
        match plugin
            .kvroute_policy_policy()
            .call_configure(&mut store, &self.config)
        {
            Ok(Ok(())) => {}
            Ok(Err(message)) => return Err(InstanceError::ConfigRejected(bounded_text(&message))),
            Err(e) => return Err(failed("configure", e, &store)),
        }
        drop(running);
        self.live.fetch_add(1, Relaxed);
        Ok(PluginInstance {
            store,
            plugin,
            decide,
            context: None,
            activity: self.shared.activity.clone(),
            _live: LiveGuard(self.live.clone()),
        })
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
                self.shared.grow(Arc::downgrade(self));
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
        self.shared.retire(inst, Arc::downgrade(self));
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
        req: Request<'_>,
        cands: Candidates<'_>,
        ctx: DecisionContext<'_>,
        allow_pick: bool,
        ticks: u64,
        inline: bool,
    ) -> Result<Answer, Failure> {
        let n = super::wire::candidate_count(&cands);
        let mut inst = self.take(inline)?;
        match inst
            .decide(req, cands, ctx, ticks)
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

/// A failed call into the guest, told with what the instance saw (a refused grow, the plugin's
/// last error line).
impl Failure {
    pub(crate) fn wasm(during: &'static str, error: wasmtime::Error, state: &HostState) -> Self {
        let reason = classify(&error, state.memory_denied);
        // With a line from the plugin (or a refused grow) the short form says more than the
        // backtrace; formatting it is only paid on failure.
        if state.memory_denied || state.last_error_log.is_some() {
            let message = describe_failure(&error, state);
            return Self {
                reason,
                detail: FailureDetail::Message(format!("{during}: {message}").into()),
                counts: true,
            };
        }
        Self {
            reason,
            detail: FailureDetail::Wasm { during, error },
            counts: true,
        }
    }
}
