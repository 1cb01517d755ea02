//! The policy runtime: the Wasm engine and its three helper threads — the epoch ticker
//! (deadlines), the maintenance thread (instances made and replaced off the request path) and the
//! compile thread (niced, one component at a time).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::Engine;

use super::config::PolicyRuntimeConfig;
use super::error::PolicyError;
use super::plugin::{self, CompiledPlugin};
use super::shared::{engine_config, RuntimeShared};
use super::ticker::{self, GuestActivity};
use super::worker::{Worker, COMPILE_NICE};

/// The maintenance thread's name (what `top -H` and `/proc/PID/task/*/comm` show; Linux keeps 15
/// bytes of a thread name, so both names fit whole).
pub const MAINTENANCE_THREAD: &str = "policy-maint";
/// The compile thread's name: it runs at [`COMPILE_NICE`] below the process's priority.
pub const COMPILE_THREAD: &str = "policy-compile";

/// The engine and its three helper threads: the epoch ticker (deadlines), the maintenance thread
/// (replacing poisoned instances off the request path) and the compile thread (niced, one compile
/// at a time). Dropping it stops all three.
pub(crate) struct PolicyRuntime {
    pub(crate) shared: Arc<RuntimeShared>,
    ticker: Option<JoinHandle<()>>,
    /// Fed through `shared.maintenance`; held here so that dropping the runtime stops it.
    _maintenance: Worker,
    compiler: Worker,
}

impl PolicyRuntime {
    pub(crate) fn new(config: PolicyRuntimeConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        let engine = Engine::new(&engine_config(&config))
            .map_err(|e| PolicyError::Engine(format!("{e:#}")))?;

        let activity = Arc::new(GuestActivity::default());
        let ticker = {
            let engine = engine.clone();
            let activity = activity.clone();
            let period = Duration::from_micros(config.epoch_tick_us);
            let coarse = ticker::coarse_ticks(config.deadline_ticks());
            std::thread::Builder::new()
                .name("kvroute-policy-epoch".into())
                .spawn(move || {
                    ticker::run(engine, period, coarse, ticker::idle_ticks(period), activity)
                })
                .map_err(|e| {
                    PolicyError::Engine(format!("could not start the epoch ticker thread: {e}"))
                })?
        };
        let maintenance = Worker::spawn(MAINTENANCE_THREAD, 0).map_err(|e| {
            PolicyError::Engine(format!("could not start the maintenance thread: {e}"))
        })?;
        let shared = Arc::new(RuntimeShared {
            engine,
            deadline_ticks: config.deadline_ticks(),
            setup_ticks: config.setup_ticks(),
            instances_per_stage: config.instances_per_stage(),
            config,
            activity,
            maintenance: maintenance.handle(),
        });
        let compiler = Worker::spawn(COMPILE_THREAD, COMPILE_NICE)
            .map_err(|e| PolicyError::Engine(format!("could not start the compile thread: {e}")))?;
        Ok(Self {
            shared,
            ticker: Some(ticker),
            _maintenance: maintenance,
            compiler,
        })
    }

    /// Checks that `bytes` is a policy component, compiles it, and asks it for its `info`.
    /// Never called on the request path: compiling takes tens of milliseconds (seconds for a
    /// Python component), so it runs on the compile thread, below the routers' priority, one
    /// component at a time; the caller waits for it.
    pub(crate) fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledPlugin>, PolicyError> {
        plugin::check_header(&self.shared.config, bytes)?;
        let shared = self.shared.clone();
        let bytes = bytes.to_vec();
        self.compiler
            .run(move || plugin::compile(&shared, &bytes))
            .unwrap_or_else(|| Err(PolicyError::Engine("the compile thread has stopped".into())))
    }
}

impl Drop for PolicyRuntime {
    /// Stops the ticker here; the maintenance and compile threads stop as their `Worker`s drop,
    /// after the jobs queued before.
    fn drop(&mut self) {
        self.shared.activity.stop();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}
