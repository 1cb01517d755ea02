//! A plugin instance: one `Store` with one instantiated component, configured once, reused for
//! many decisions, and what the store carries (limits, deadline state, the log allowance).
//!
//! A trap (including a deadline interrupt) poisons the whole store, and an invalid answer makes
//! the instance suspect, so the stage drops either (`stage.rs`). Nothing a plugin hands the host is
//! taken at its word: a `costs` list is lifted out of the guest only when its length is the number
//! of candidates (see [`RawDecision`]), and its text (log lines, a `configure` error, `info`'s name
//! and version) is bounded (see `text.rs`; a log line before it is lifted).

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use wasmtime::component::{Func, HasSelf, Linker, TypedFunc};
use wasmtime::{ResourceLimiter, Store, StoreContextMut, StoreHookState, Trap, UpdateDeadline};

use super::answer::{RawDecision, EXPECTED_COSTS};
use super::bindings::kvroute::policy::types::{HostColumns, HostContext, LogLevel, Request};
use super::bindings::{PolicyPlugin, PolicyPluginPre, POLICY_EXPORT};
use super::error::FallbackReason;
pub(crate) use super::failure::{Failure, FailureDetail};
use super::shared::RuntimeShared;
use super::stats::PolicyStats;
pub(crate) use super::text::bounded_text;
use super::text::BoundedText;
use super::ticker::{CallGuard, GuestActivity};
use super::wire::Data;
use super::DecisionContext;
use kvroute_core::rng::SeededRng;

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
    /// The fixed pseudo-random stream behind `wasi:random` (see `plugin.rs`).
    pub(crate) entropy: SeededRng,
    /// The runtime's record of guest calls, whose ticker may be parked (see `ticker.rs`).
    activity: Arc<GuestActivity>,
    /// The epoch tick period.
    tick: std::time::Duration,
    /// A call that found the ticker parked keeps its own time until the ticker has ticked again.
    self_timed: Option<SelfTimed>,
    /// When the current call started, and the ticks to its first deadline check: the ticker may
    /// add several ticks at once (`ticker::run`), so a first check that comes early is measured
    /// against the call's own start (`on_deadline`).
    call_start: Instant,
    first_check_ticks: u64,
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
            call_start: Instant::now(),
            first_check_ticks: 0,
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
    /// The ticker's count then; a change means the ticker runs again.
    ticks_at_start: u64,
    /// The tick (counted from the call's start, `HostState::call_start`) at which the current wait ends.
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
    s.call_start = Instant::now();
    s.first_check_ticks = ticks;
    if running.found_ticker_parked() {
        s.self_timed = Some(SelfTimed {
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
fn on_deadline(mut ctx: StoreHookState<'_, HostState>) -> wasmtime::Result<UpdateDeadline> {
    let s = ctx.data_mut();
    let Some(mut timed) = s.self_timed else {
        if s.grace_window.is_none() {
            // The first check. The ticker adds the periods it slept through at once, so this can
            // come before the call has run its ticks (minus one: a running ticker's next tick
            // comes anywhere within a period of a call's start): then wait out the rest.
            if let Some(left) = early_check(s.call_start.elapsed(), s.tick, s.first_check_ticks) {
                return Ok(UpdateDeadline::Continue(left));
            }
        }
        return Ok(deadline_passed(s));
    };
    // The call started while the ticker was parked (see `arm_call`): it counts ticks of the wall
    // clock itself, checking at every opportunity, until the ticker has ticked again.
    let tick = s.tick.as_nanos().max(1);
    let elapsed_ns = s.call_start.elapsed().as_nanos(); // tick 0: the call's start
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

/// Whether a call's first deadline check came before the call ran its ticks (less one: a running
/// ticker's next tick comes anywhere within a period of a call's start), and if so the ticks left
/// to wait: `ran` of wall time against `first_check` ticks of `tick`.
fn early_check(
    ran: std::time::Duration,
    tick: std::time::Duration,
    first_check: u64,
) -> Option<u64> {
    let ran = u64::try_from(ran.as_nanos() / tick.as_nanos().max(1)).unwrap_or(u64::MAX);
    (ran.saturating_add(1) < first_check).then(|| first_check - 1 - ran)
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

impl HostState {
    /// `host-log`: a line already bounded while it was lifted (see [`BoundedText`]), written to
    /// the server's log within the version's allowance.
    fn log(&mut self, level: LogLevel, message: String) {
        if matches!(level, LogLevel::Error) {
            self.last_error_log = Some(message.clone());
        }
        if !self.stats.take_log_token(self.log_rate, self.log_burst) {
            self.stats.record_log_dropped();
            return;
        }
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

/// Links the world's imports: the `types` interface, and `host-log` with its line lifted as a
/// [`BoundedText`] (the bindings would copy the whole line out of the guest first).
pub(crate) fn link_host(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    super::bindings::kvroute::policy::types::add_to_linker::<HostState, HasSelf<HostState>>(
        linker,
        |s| s,
    )?;
    linker.instance(HOST_LOG)?.func_wrap(
        "log",
        |mut store: StoreContextMut<'_, HostState>, (level, message): (LogLevel, BoundedText)| {
            store.data_mut().log(level, message.0);
            Ok(())
        },
    )
}

/// The one import a policy gets.
const HOST_LOG: &str = "kvroute:policy/host-log@0.10.0";

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
type DecideFn<'a> = TypedFunc<(Request, Data<'a>), (RawDecision,)>;

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
    /// What `configure` answered: this configuration reads the host's `base-cost` column.
    pub(crate) reads_base_cost: bool,
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
    /// Instantiates `pre` and configures it with `config`, counted in `live` while it lives.
    /// Never on the request path: this runs for up to the setup deadline.
    pub(crate) fn new(
        shared: &RuntimeShared,
        pre: &PolicyPluginPre<HostState>,
        config: &str,
        policy: Arc<str>,
        stats: Arc<PolicyStats>,
        live: &Arc<AtomicUsize>,
    ) -> Result<Self, InstanceError> {
        let mut store = new_store(shared, policy, stats);
        let running = shared.activity.enter();
        let failed = |during, e: wasmtime::Error, store: &Store<HostState>| InstanceError::Failed {
            during,
            message: describe_failure(&e, store.data()),
        };
        let instance = pre
            .instance_pre()
            .instantiate(&mut store)
            .map_err(|e| failed("instantiation", e, &store))?;
        let plugin = PolicyPlugin::new(&mut store, &instance)
            .map_err(|e| failed("instantiation", e, &store))?;
        let decide = instance
            .get_export_index(&mut store, None, POLICY_EXPORT)
            .and_then(|iface| instance.get_export_index(&mut store, Some(&iface), "decide"))
            .and_then(|f| instance.get_func(&mut store, f))
            .ok_or_else(|| InstanceError::Failed {
                during: "instantiation",
                message: "no export decide".into(),
            })?;
        decide
            .typed::<(Request, Data<'_>), (RawDecision,)>(&store)
            .map_err(|e| failed("instantiation", e, &store))?;
        store.data_mut().arm();
        store.set_epoch_deadline(shared.setup_ticks);
        let reads = match plugin
            .kvroute_policy_policy()
            .call_configure(&mut store, config)
        {
            Ok(Ok(reads)) => reads,
            Ok(Err(message)) => return Err(InstanceError::ConfigRejected(bounded_text(&message))),
            Err(e) => return Err(failed("configure", e, &store)),
        };
        drop(running);
        live.fetch_add(1, Relaxed);
        Ok(PluginInstance {
            store,
            plugin,
            decide,
            context: None,
            reads_base_cost: reads.contains(HostColumns::BASE_COST),
            activity: shared.activity.clone(),
            _live: LiveGuard(live.clone()),
        })
    }

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
        req: Request,
        data: Data<'_>,
        ctx: DecisionContext<'_>,
        ticks: u64,
    ) -> Result<RawDecision, Failure> {
        self.sync_context(ctx, ticks)?;
        let n = super::wire::candidate_count(data);
        // SAFETY: `self.decide` was type-checked against `DecideFn` when the instance was made
        // (`Stage::new_instance`); lifetimes play no part in a component type.
        let decide: DecideFn<'_> = unsafe { TypedFunc::new_unchecked(self.decide) };
        let running = self.activity.enter();
        arm_call(&mut self.store, ticks, &running);
        EXPECTED_COSTS.set(n);
        decide
            .call(&mut self.store, (req, data))
            .map(|(d,)| d)
            .map_err(|e| Failure::wasm("decide", e, self.store.data()))
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

#[cfg(test)]
mod tests {
    use super::early_check;
    use std::time::Duration;

    #[test]
    fn an_early_first_check_waits_out_the_rest_of_the_call_s_ticks() {
        let tick = Duration::from_micros(250);
        // Six ticks to the first check (a 2 ms deadline less a 500 µs grace window).
        // The ticker caught up four ticks 0.3 ms into the call: wait four more.
        assert_eq!(early_check(Duration::from_micros(300), tick, 6), Some(4));
        assert_eq!(early_check(Duration::ZERO, tick, 6), Some(5));
        // Within a tick of the check, or past it: the check stands.
        assert_eq!(early_check(Duration::from_micros(1_250), tick, 6), None);
        assert_eq!(early_check(Duration::from_micros(1_499), tick, 6), None);
        assert_eq!(early_check(Duration::from_millis(40), tick, 6), None);
        // A one-tick deadline is never early.
        assert_eq!(early_check(Duration::ZERO, tick, 1), None);
    }
}
