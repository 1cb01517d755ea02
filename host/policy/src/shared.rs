//! What every stage, instance and store needs from the runtime: the engine, the configuration in
//! ticks, the record of guest calls, and a way to hand work to the maintenance thread. No threads
//! of its own (those are `runtime.rs`'s): dropping it joins nothing.

use std::sync::Arc;

use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::config::PolicyRuntimeConfig;
use super::ticker::GuestActivity;
use super::worker::WorkerHandle;

/// What every stage and store needs from the runtime (no threads: dropping it joins nothing).
pub(crate) struct RuntimeShared {
    pub(crate) engine: Engine,
    pub(crate) config: PolicyRuntimeConfig,
    pub(crate) deadline_ticks: u64,
    pub(crate) setup_ticks: u64,
    pub(crate) instances_per_stage: usize,
    /// Guest calls in progress, for the epoch ticker (which parks when there are none).
    pub(crate) activity: Arc<GuestActivity>,
    /// The maintenance thread, which makes and replaces instances off the request path.
    pub(crate) maintenance: WorkerHandle,
}

/// The wasmtime configuration of the policy engine: the component model without its
/// concurrency support (which triples the cost of a call), epoch interruption for deadlines, and
/// the pooling allocator sized for `config`'s instances and memory cap. Public so that benchmarks
/// measure exactly this engine.
pub fn engine_config(config: &PolicyRuntimeConfig) -> Config {
    let mut pool = PoolingAllocationConfig::default();
    let slots = config.max_instances();
    pool.total_component_instances(slots)
        .total_core_instances(slots.saturating_mul(8))
        .total_memories(slots.saturating_mul(2))
        .total_tables(slots.saturating_mul(8))
        .max_memory_size(usize::try_from(config.memory_limit_bytes).unwrap_or(usize::MAX));
    let mut wasm = Config::new();
    wasm.wasm_component_model(true)
        .concurrency_support(false)
        .epoch_interruption(true)
        // One compile may not take every core: the runtime compiles on one niced thread
        // (`worker.rs`), and wasmtime's compile threads would run at the routers' priority.
        .parallel_compilation(false)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    wasm
}
