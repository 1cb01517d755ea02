//! # kvroute-sdk: write a kvroute routing policy in minutes
//!
//! A policy ranks the eligible candidates of one routing decision. The kvroute host has already
//! applied every hard rule (allowed workers, required taints, pins, overload), computed each
//! candidate's cache overlap and load, and its own native cost; your policy only decides which
//! candidate is best. Implement [`Policy`], export it with [`export_policy!`], build with
//! `cargo build --release --target wasm32-wasip2`, and check the result with
//! `kvroute policy check target/wasm32-wasip2/release/NAME.wasm`.
//!
//! ```ignore
//! use kvroute_sdk::{Candidates, Context, Decision, Policy, Request};
//!
//! #[derive(Default)]
//! struct LeastLoaded;
//!
//! impl Policy for LeastLoaded {
//!     fn decide(&mut self, _ctx: &Context, _req: &Request, c: &Candidates) -> Decision {
//!         Decision::Costs(c.rows().map(|r| r.active_requests() as f64).collect())
//!     }
//! }
//!
//! kvroute_sdk::export_policy!(LeastLoaded);
//! ```
//!
//! Everything the WIT interface (`wit/policy.wit`) defines is re-exported here under plain names;
//! the generated glue stays hidden. The same code runs natively, so a policy is unit-tested with
//! plain `cargo test` through [`testing`], no Wasm involved.
//!
//! ## No capabilities
//! A policy runs with no WASI capabilities: files, the clock, the network and stdio trap. The
//! environment reads as empty, and `wasi:random` is a fixed pseudo-random stream per instance (not
//! entropy: it lets language runtimes and `std::collections::HashMap`'s `RandomState` start, and
//! keeps answers reproducible). Use [`SplitMix64`] for randomness of your own and
//! `Request::now_ms` (the router's clock, simulated under `kvroute replay`) for time.
//!
//! ## State
//! One policy value lives per Wasm instance. The host keeps instances for a long time, but it may
//! replace one at any moment (after a trap or a missed deadline) and every configuration change or
//! swap creates fresh instances. State kept in `self` (caches, session maps) is therefore a
//! best-effort, per-instance memory: never rely on it for correctness.

#![warn(missing_docs)]

pub mod helpers;
pub mod testing;

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "policy-plugin",
        pub_export_macro: true,
        export_macro_name: "__kvroute_export_world",
        default_bindings_module: "kvroute_sdk::bindings",
    });
}

use std::collections::BTreeMap;

pub use bindings::kvroute::policy::types::{
    Decision, LogLevel, PluginInfo, PluginKind, PreferredTaint, Request,
};

/// The candidates exactly as they cross the interface (WIT `record candidates`: columns packed
/// per primitive type). Policies see them through [`Candidates`].
pub use bindings::kvroute::policy::types::Candidates as WireCandidates;
pub use helpers::*;

/// The ABI version this SDK speaks (`plugin-info.abi-version`).
pub const ABI_VERSION: u32 = 2;

/// The default [`Policy::info`]: named after the crate (without a `kvroute-plugin-` prefix), this
/// SDK's ABI version, a deterministic scorer. Override fields with struct update syntax:
/// `PluginInfo { kind: PluginKind::Selector, ..plugin_info(name, version) }`.
pub fn plugin_info(crate_name: &str, crate_version: &str) -> PluginInfo {
    PluginInfo {
        name: crate_name
            .strip_prefix("kvroute-plugin-")
            .unwrap_or(crate_name)
            .to_string(),
        version: crate_version.to_string(),
        abi_version: ABI_VERSION,
        deterministic: true,
        kind: PluginKind::Scorer,
    }
}

/// A routing policy. Only [`Policy::decide`] is required.
pub trait Policy: Default + 'static {
    /// Describes the policy. The default uses the crate's name and version (passed in by
    /// [`export_policy!`]), a deterministic scorer.
    fn info(&self, crate_name: &str, crate_version: &str) -> PluginInfo {
        plugin_info(crate_name, crate_version)
    }

    /// Applies the operator's JSON configuration (`{}` when none was given). The error message is
    /// shown to the operator verbatim: say what is wrong and what is accepted. The default accepts
    /// only an empty object. Use [`parse_config`] for typed configuration.
    fn configure(&mut self, config_json: &str) -> Result<(), String> {
        match serde_json::from_str::<serde_json::Value>(config_json) {
            Ok(serde_json::Value::Object(m)) if m.is_empty() => Ok(()),
            Ok(_) => Err("this policy takes no configuration: send {}".to_string()),
            Err(e) => Err(format!("configuration is not valid JSON: {e}")),
        }
    }

    /// Ranks the candidates: one cost per candidate (lower is better) or a pick.
    fn decide(&mut self, ctx: &Context, req: &Request, candidates: &Candidates) -> Decision;
}

/// What a policy knows besides the request: the taint-name table.
#[derive(Clone, Debug, Default)]
pub struct Context {
    version: u64,
    names: Vec<String>,
    ids: BTreeMap<String, u32>,
}

impl Context {
    /// A context with this taint table.
    pub fn new(version: u64, names: Vec<String>) -> Self {
        let ids = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i as u32))
            .collect();
        Self {
            version,
            names,
            ids,
        }
    }

    /// The id of a taint name, if any candidate in the fleet ever had it.
    pub fn taint_id(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The name of a taint id.
    pub fn taint_name(&self, id: u32) -> Option<&str> {
        self.names.get(id as usize).map(String::as_str)
    }

    /// The taint table's version.
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// The eligible candidates of one decision, as typed columns (struct of arrays).
///
/// Every column has one entry per candidate, in the same order, except `taint_ids` (all
/// candidates' taints back to back) and `taint_offsets` (one more entry than candidates): candidate
/// `i` has the taints `taint_ids[taint_offsets[i] as usize..taint_offsets[i + 1] as usize]`.
/// Iterate typed rows with [`Candidates::rows`], or read whole columns for vectorizable loops.
/// The slices borrow the lists the host sent; nothing is copied.
#[derive(Clone, Copy, Debug, Default)]
pub struct Candidates<'a> {
    /// Worker id of each candidate.
    pub worker_id: &'a [u64],
    /// Data-parallel rank of each candidate inside its worker.
    pub dp_rank: &'a [u32],
    /// Leading prompt blocks held on the device (GPU).
    pub device_overlap: &'a [u32],
    /// Leading prompt blocks held in host memory (matched independently of the device tier).
    pub host_overlap: &'a [u32],
    /// Leading prompt blocks held on disk or external storage.
    pub disk_overlap: &'a [u32],
    /// Booked prompt tokens not yet prefilled.
    pub active_prefill_tokens: &'a [u64],
    /// KV blocks used by active requests (shared blocks once).
    pub active_decode_blocks: &'a [u64],
    /// Requests booked.
    pub active_requests: &'a [u32],
    /// Leading blocks of this prompt already active on the candidate.
    pub active_prompt_blocks: &'a [u32],
    /// KV capacity in blocks (0 = unknown).
    pub total_kv_blocks: &'a [u64],
    /// Prefill token budget per engine step (0 = unknown).
    pub max_num_batched_tokens: &'a [u32],
    /// The host's native cost (without preferred taints); in a pipeline's selector stage, the
    /// weighted sum of the scorer stages.
    pub base_cost: &'a [f64],
    /// Start of each candidate's taints in `taint_ids` (`count() + 1` entries, first 0).
    pub taint_offsets: &'a [u32],
    /// Taint ids of all candidates, back to back.
    pub taint_ids: &'a [u32],
}

impl<'a> Candidates<'a> {
    /// Splits the packed interface lists into columns, checking every length once (the host
    /// guarantees them; a violation is reported, not indexed out of bounds later).
    pub fn from_wire(w: &'a WireCandidates) -> Result<Self, String> {
        let n = w.count as usize;
        if w.columns64.len() != 4 * n {
            return Err(format!(
                "columns64 has {} entries, expected 4 x {n}",
                w.columns64.len()
            ));
        }
        if w.columns32.len() < 8 * n + 1 {
            return Err(format!(
                "columns32 has {} entries, expected at least 8 x {n} + 1",
                w.columns32.len()
            ));
        }
        if w.base_cost.len() != n {
            return Err(format!(
                "base-cost has {} entries, expected {n}",
                w.base_cost.len()
            ));
        }
        let c64 = |k: usize| &w.columns64[k * n..(k + 1) * n];
        let c32 = |k: usize| &w.columns32[k * n..(k + 1) * n];
        let taint_offsets = &w.columns32[7 * n..8 * n + 1];
        let taint_ids = &w.columns32[8 * n + 1..];
        let ordered = taint_offsets.windows(2).all(|p| p[0] <= p[1]);
        if taint_offsets[0] != 0 || !ordered || taint_offsets[n] as usize != taint_ids.len() {
            return Err("taint-offsets are not a valid index into taint-ids".to_string());
        }
        Ok(Self {
            worker_id: c64(0),
            active_prefill_tokens: c64(1),
            active_decode_blocks: c64(2),
            total_kv_blocks: c64(3),
            dp_rank: c32(0),
            device_overlap: c32(1),
            host_overlap: c32(2),
            disk_overlap: c32(3),
            active_requests: c32(4),
            active_prompt_blocks: c32(5),
            max_num_batched_tokens: c32(6),
            base_cost: &w.base_cost,
            taint_offsets,
            taint_ids,
        })
    }

    /// Number of candidates.
    pub fn count(&self) -> usize {
        self.worker_id.len()
    }

    /// True when there is no candidate (the host never calls a policy with none).
    pub fn is_empty(&self) -> bool {
        self.worker_id.is_empty()
    }

    /// Every candidate as a [`Row`], in order.
    pub fn rows(&self) -> impl ExactSizeIterator<Item = Row<'_>> + '_ {
        (0..self.count()).map(move |index| Row { cols: self, index })
    }

    /// One candidate. Panics when `index >= count()`.
    pub fn row(&self, index: usize) -> Row<'_> {
        assert!(index < self.count(), "candidate index out of range");
        Row { cols: self, index }
    }
}

/// One candidate, viewed across the columns (no copy).
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    cols: &'a Candidates<'a>,
    index: usize,
}

impl<'a> Row<'a> {
    /// Position in the columns (what a [`Decision::Pick`] names).
    pub fn index(&self) -> usize {
        self.index
    }
    /// Worker id.
    pub fn worker_id(&self) -> u64 {
        self.cols.worker_id[self.index]
    }
    /// Data-parallel rank.
    pub fn dp_rank(&self) -> u32 {
        self.cols.dp_rank[self.index]
    }
    /// Leading prompt blocks held on the device.
    pub fn device_overlap(&self) -> u32 {
        self.cols.device_overlap[self.index]
    }
    /// Leading prompt blocks held in host memory.
    pub fn host_overlap(&self) -> u32 {
        self.cols.host_overlap[self.index]
    }
    /// Leading prompt blocks held on disk or external storage.
    pub fn disk_overlap(&self) -> u32 {
        self.cols.disk_overlap[self.index]
    }
    /// Booked prompt tokens not yet prefilled.
    pub fn active_prefill_tokens(&self) -> u64 {
        self.cols.active_prefill_tokens[self.index]
    }
    /// KV blocks in use by active requests.
    pub fn active_decode_blocks(&self) -> u64 {
        self.cols.active_decode_blocks[self.index]
    }
    /// Requests booked.
    pub fn active_requests(&self) -> u32 {
        self.cols.active_requests[self.index]
    }
    /// Leading blocks of this prompt already active on the candidate.
    pub fn active_prompt_blocks(&self) -> u32 {
        self.cols.active_prompt_blocks[self.index]
    }
    /// KV capacity in blocks (0 = unknown).
    pub fn total_kv_blocks(&self) -> u64 {
        self.cols.total_kv_blocks[self.index]
    }
    /// Prefill token budget per step (0 = unknown).
    pub fn max_num_batched_tokens(&self) -> u32 {
        self.cols.max_num_batched_tokens[self.index]
    }
    /// The host's native cost (without preferred taints).
    pub fn base_cost(&self) -> f64 {
        self.cols.base_cost[self.index]
    }
    /// Taint ids of the candidate.
    pub fn taints(&self) -> &'a [u32] {
        let o = self.cols.taint_offsets;
        let (a, b) = (o[self.index] as usize, o[self.index + 1] as usize);
        self.cols.taint_ids.get(a..b).unwrap_or(&[])
    }
    /// Whether the candidate has a taint id.
    pub fn has_taint(&self, id: u32) -> bool {
        self.taints().contains(&id)
    }
    /// Whether the candidate has a taint, by name.
    pub fn has_taint_named(&self, ctx: &Context, name: &str) -> bool {
        ctx.taint_id(name).is_some_and(|id| self.has_taint(id))
    }
}

/// Writes a log line through the host (rate-limited there). Natively (tests) it goes to
/// [`testing::take_logs`].
pub fn log(level: LogLevel, message: &str) {
    #[cfg(target_arch = "wasm32")]
    bindings::kvroute::policy::host_log::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    testing::record_log(level, message);
}

#[doc(hidden)]
pub mod __private {
    use super::*;
    use std::cell::RefCell;

    /// Per-instance state behind the generated exports.
    pub struct Slot<P: Policy> {
        pub policy: RefCell<Option<P>>,
        pub ctx: RefCell<Context>,
    }

    impl<P: Policy> Slot<P> {
        pub fn new() -> Self {
            Self {
                policy: RefCell::new(None),
                ctx: RefCell::new(Context::default()),
            }
        }

        pub fn with<R>(&self, f: impl FnOnce(&mut P, &Context) -> R) -> R {
            let mut p = self.policy.borrow_mut();
            let p = p.get_or_insert_with(P::default);
            f(p, &self.ctx.borrow())
        }

        pub fn set_taints(&self, version: u64, names: Vec<String>) {
            *self.ctx.borrow_mut() = Context::new(version, names);
        }
    }

    impl<P: Policy> Default for Slot<P> {
        fn default() -> Self {
            Self::new()
        }
    }

    pub use crate::bindings::exports::kvroute::policy::policy::Guest;
}

/// Exports a [`Policy`] type as the component's `kvroute:policy/policy` implementation.
///
/// Use once per plugin crate, at the crate root: `kvroute_sdk::export_policy!(MyPolicy);`
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        const _: () = {
            // The component exports exist only in the Wasm build; natively (unit tests through
            // `kvroute_sdk::testing`) the crate is a plain library.
            #[allow(dead_code)]
            struct __KvrouteExport;
            ::std::thread_local! {
                static __SLOT: $crate::__private::Slot<$policy> = $crate::__private::Slot::new();
            }
            impl $crate::__private::Guest for __KvrouteExport {
                fn info() -> $crate::PluginInfo {
                    __SLOT.with(|s| {
                        s.with(|p, _| {
                            <$policy as $crate::Policy>::info(
                                p,
                                env!("CARGO_PKG_NAME"),
                                env!("CARGO_PKG_VERSION"),
                            )
                        })
                    })
                }
                fn configure(config_json: String) -> Result<(), String> {
                    __SLOT.with(|s| {
                        s.with(|p, _| <$policy as $crate::Policy>::configure(p, &config_json))
                    })
                }
                fn set_taint_table(version: u64, names: Vec<String>) {
                    __SLOT.with(|s| s.set_taints(version, names))
                }
                fn decide(req: $crate::Request, wire: $crate::WireCandidates) -> $crate::Decision {
                    let candidates = match $crate::Candidates::from_wire(&wire) {
                        Ok(c) => c,
                        // The host checks these lengths before every call; if they are ever
                        // wrong, trapping makes it fall back to its native cost and count it.
                        Err(e) => panic!("kvroute-sdk: malformed candidates from the host: {e}"),
                    };
                    __SLOT.with(|s| {
                        s.with(|p, ctx| <$policy as $crate::Policy>::decide(p, ctx, &req, &candidates))
                    })
                }
            }
            #[cfg(target_arch = "wasm32")]
            $crate::bindings::__kvroute_export_world!(__KvrouteExport with_types_in $crate::bindings);
        };
    };
}
