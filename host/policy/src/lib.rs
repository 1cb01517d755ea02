//! The Wasm policy runtime: routing policies as hot-swappable WebAssembly components.
//!
//! A policy is a component implementing `wit/policy.wit` (world `kvroute:policy/policy-plugin`).
//! The router calls [`PolicyRegistry::decide`] once per routing decision with the eligible
//! candidates; the active policy answers one cost per candidate (the router picks with the
//! request's temperature) or one pick. The host stays in charge of every guarantee:
//!
//! - **Columns, not records, in one list.** Candidates cross the boundary as columns of primitives
//!   packed, with the preferred taints and the request's ids, into one `list<u64>` (`wire.rs`
//!   packs [`CandidateColumns`] into a per-thread buffer), lowered with one allocator call into
//!   the guest and one `memcpy`: each further list or string argument cost one more allocator
//!   call, which is why interface 0.9.0 folded five into one. Lowering a list of records costs
//!   ~3× more, and a string per
//!   candidate costs microseconds; taints are therefore ids into a [`TaintTable`] that an instance
//!   receives (with the block size, through `set-context`) only when its version changes.
//!   `decide`'s arguments flatten to 16 values so that they travel in registers: past 16 the
//!   canonical ABI stores every field into guest memory one by one, which measured as ~30% of a
//!   small decision.
//! - **Long-lived instances.** Instantiating costs 3–11 µs and the first call on a fresh instance
//!   0.1–0.3 ms, so each stage keeps a pool of configured instances; a decision takes one, calls it
//!   and puts it back. Several router threads decide at once, each on its own instance.
//! - **ArcSwap flips.** Loading (compile, configure, self-test, warm-up) happens off the request
//!   path (compiling on a niced thread of its own, one component at a time: `worker.rs`); the new
//!   version becomes active with one atomic pointer swap. A decision loads the
//!   active pointer once, so it finishes on the version it started with, and the old version's
//!   instances are freed when its last in-flight decision ends. Rollback is the same swap.
//! - **Fallbacks.** A trap, a missed deadline (epoch interruption, [`PolicyRuntimeConfig::deadline_us`]),
//!   a memory-limit hit, or an invalid answer (wrong length, non-finite cost, pick out of range)
//!   makes the decision [`Outcome::Fallback`] with a [`FallbackReason`]; the router then uses the
//!   native cost. Reasons are counted per policy version.
//! - **Poisoned instances.** After a trap the instance's store is unusable (its stack was unwound
//!   mid-call, its memory may be half-written), and an instance that answered nonsense is not
//!   trusted either: it is dropped ("poisoned"), and the runtime's maintenance thread makes a fresh
//!   one off the request path. After [`PolicyRuntimeConfig::max_consecutive_failures`] failed
//!   decisions in a row, the active version is taken out and the previously active one restored
//!   (or none: native cost).
//! - **Deadlines.** An epoch ticker thread (every `epoch_tick_us`) bounds each call's wall time;
//!   it parks after 5 ms without a guest call (a tick is a ~25 µs wake-up: sparse traffic does not
//!   pay for hundreds of them per request)
//!   and the next call wakes it, keeping its own time until the first tick (`ticker.rs`). Between
//!   calls it sleeps four ticks at once and catches the epoch up on waking; it wakes every tick
//!   only while a call runs.
//!   Wall time also runs while a router thread is descheduled, so a call reaching its deadline gets
//!   a short grace window: if its thread spent most of that window off the CPU (an oversubscribed
//!   machine), it gets another one; if it kept running, it is interrupted. A runaway guest is
//!   stopped at the deadline; a short call that was merely preempted is not blamed for it.
//! - **Zero capabilities.** The only real import is `host-log` (lines bounded before they are
//!   lifted, rate-limited per version). Other
//!   imports — the WASI interfaces a `std` Rust guest pulls in — link as functions that trap.
//!   Two answer without granting anything, because language runtimes such as CPython call them
//!   before they can run: `wasi:cli/environment` (empty) and `wasi:random` (a fixed pseudo-random
//!   stream per instance: not entropy, and it keeps answers reproducible). No file, clock, network
//!   or stdio.
//!
//! Entry points: [`PolicyRegistry`], and [`RegistryScorer`], which installs it as the router's scorer.
//! Also [`DEFAULT_POLICY_WASM`] and [`DYNAMO_POLICY_WASM`] (the embedded built-ins, [`builtin_policy`]) and [`conformance`] (`kvroute policy check`).
//!
//! Also: pipelines ([`PipelineSpec`]: weighted scorer stages and
//! an optional selector) and a polled directory ([`PolicyRegistry::watch_directory`]).

mod answer;
mod bindings;
mod config;
pub mod conformance;
mod error;
mod failure;
mod health;
mod instance;
mod pipeline;
mod plugin;
mod registry;
pub mod rollout;
mod runtime;
mod scorer;
mod selftest;
mod shared;
mod stage;
mod stats;
mod text;
mod ticker;
mod time;
mod watch;
mod wire;
mod worker;

pub use answer::{check_answer, RawAnswer};
pub use bindings::{ABI_VERSION, POLICY_EXPORT};
pub use config::PolicyRuntimeConfig;
pub use error::{FallbackReason, PolicyError};
pub use pipeline::{PipelineSpec, SelectorSpec, StageSpec};
pub use plugin::{sha256_hex, PluginDescription, PluginKind};
pub use registry::{
    validate_name, ActivePolicy, Checkpoint, Outcome, PolicyDecision, PolicyInfo, PolicyRegistry,
    PolicyVersion, RegistryCounters, RegistryImage, StageInfo, VersionImage,
};
pub use rollout::{
    canary_arm, merge_rollout, Arm, ArmDelta, CanaryImage, CanaryRecord, CanaryReport, CanarySpec,
    OutcomeBatch, RequestOutcome, RolloutImage, ShadowImage, ShadowReport, ShadowSpec,
};
pub use scorer::RegistryScorer;
pub use shared::engine_config;
pub use stats::{LatencyHistogram, PolicyStats, StatsSnapshot};
pub use watch::{DirectoryScanner, DirectoryWatcher, ScanReport};

#[doc(no_inline)]
pub use kvroute_core::candidate::{CandidateColumns, PolicyRequest, TaintTable};

/// What an instance is told through `set-context` before a decision: the taint table and the
/// router's block size. An instance is called again only when either differs from what it saw.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecisionContext<'a> {
    pub taints: &'a TaintTable,
    pub block_size: u32,
}

impl DecisionContext<'_> {
    /// What identifies this context for an instance.
    pub(crate) fn key(&self) -> (u64, u32) {
        (self.taints.version, self.block_size)
    }
}

/// The default policy component (`plugins/default`), built from source and embedded at build time
/// (build.rs).
pub const DEFAULT_POLICY_WASM: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/default_policy.wasm"));

/// The `dynamo` policy component (`plugins/dynamo`: Dynamo 1.6's default cost, bit-exact), embedded
/// like the default.
pub const DYNAMO_POLICY_WASM: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/dynamo_policy.wasm"));

/// The built-in policies, by name: registered at `kvroute serve`'s start, accepted by
/// `serve --policy NAME` and `replay --policy NAME`.
pub const BUILTIN_POLICIES: [(&str, &[u8]); 2] = [
    ("default", DEFAULT_POLICY_WASM),
    ("dynamo", DYNAMO_POLICY_WASM),
];

/// The embedded component of the built-in policy `name` (`default` or `dynamo`).
pub fn builtin_policy(name: &str) -> Option<&'static [u8]> {
    BUILTIN_POLICIES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
}
