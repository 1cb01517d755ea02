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
//! ## Stages
//! A disaggregated fleet routes each request twice: to a prefill worker, which computes the prompt
//! (cache overlap saves work there), then to a decode worker, which receives the KV cache and
//! decodes (overlap saves nothing; decode load and the transfer matter). [`Request::stage`] says
//! which of the two a decision ranks, or [`Stage::Aggregated`] for the ordinary one-step decision.
//! [`native_cost`] follows the host: at [`Stage::Decode`] it gives overlap no credit.
//!
//! ## State
//! One policy value lives per Wasm instance. The host keeps instances for a long time, but it may
//! replace one at any moment (after a trap or a missed deadline) and every configuration change or
//! swap creates fresh instances. State kept in `self` (caches, session maps) is therefore a
//! best-effort, per-instance memory: never rely on it for correctness.

#![warn(missing_docs)]

pub mod helpers;
pub mod testing;
pub mod wire;

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        // A copy of the workspace's wit/policy.wit inside the package, so the published crate
        // builds on its own; tests/cli.rs checks the two are equal.
        path: "wit",
        world: "policy-plugin",
        pub_export_macro: true,
        export_macro_name: "__kvroute_export_world",
        default_bindings_module: "kvroute_sdk::bindings",
    });
}

use std::collections::BTreeMap;

pub use bindings::kvroute::policy::types::{
    Decision, HostColumns, LogLevel, PluginInfo, PluginKind,
};

/// Everything of a decision but the request's scalars, exactly as it crosses the interface (WIT
/// `decision-data`: one list of 64-bit words holding every column, the taint index, the
/// request's preferred taints and its ids). Policies see it through [`Candidates`] and
/// [`Request`]; [`wire::pack`] builds one.
pub use bindings::kvroute::policy::types::DecisionData as WireData;
/// The host's context as it crosses the interface (WIT `record host-context`). Policies see it
/// as a [`Context`].
pub use bindings::kvroute::policy::types::HostContext as WireContext;
/// The request's scalars exactly as they cross the interface (WIT `record request`). Policies
/// see them, with the ids and preferred taints of [`WireData`], as a [`Request`].
pub use bindings::kvroute::policy::types::Request as WireRequest;
/// [`WireRequest`]'s yes-or-no facts ([`Request::ask_only`], [`Request::stage`]).
pub use bindings::kvroute::policy::types::RequestFlags;
pub use helpers::*;

/// The ABI version this SDK speaks (`plugin-info.abi-version`): 10, for `kvroute:policy@0.10.0`.
pub const ABI_VERSION: u32 = 10;

/// Which half of a routing decision the policy ranks (WIT `request-flags`: `prefill`, `decode`,
/// or neither).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Stage {
    /// An ordinary one-step decision: the chosen candidate computes the prompt and decodes it.
    /// Every decision of an aggregated fleet, and a disaggregated request that a bypass rule
    /// keeps on one worker.
    #[default]
    Aggregated,
    /// The prefill step of a disaggregated decision: the chosen candidate computes the prompt and
    /// sends its KV cache to a decode worker. Rank the prompt's work as for an aggregated
    /// decision: overlap saves computation here.
    Prefill,
    /// The decode step of a disaggregated decision: the chosen candidate receives the prompt's
    /// KV cache and decodes. It computes no prompt, so overlaps save nothing (the host's base
    /// cost gives them no credit): rank by decode load, and by the transfer (a preferred taint of
    /// the KV-transfer domain arrives among [`Request::preferred_taints`] when the operator
    /// configured one).
    Decode,
}

impl Stage {
    /// The stage's name as the API and the interface spell it: `aggregated`, `prefill`,
    /// `decode`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Aggregated => "aggregated",
            Stage::Prefill => "prefill",
            Stage::Decode => "decode",
        }
    }

    /// The stage the flags name; an error when both `prefill` and `decode` are set (the host
    /// never sends that).
    pub fn from_flags(flags: RequestFlags) -> Result<Self, String> {
        let has = |f: RequestFlags| flags.bits() & f.bits() != 0;
        let (prefill, decode) = (has(RequestFlags::PREFILL), has(RequestFlags::DECODE));
        match (prefill, decode) {
            (false, false) => Ok(Stage::Aggregated),
            (true, false) => Ok(Stage::Prefill),
            (false, true) => Ok(Stage::Decode),
            (true, true) => Err("request flags set both prefill and decode".to_string()),
        }
    }

    /// The flags that carry this stage.
    pub fn flags(self) -> RequestFlags {
        match self {
            Stage::Aggregated => RequestFlags::empty(),
            Stage::Prefill => RequestFlags::PREFILL,
            Stage::Decode => RequestFlags::DECODE,
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// One soft preference of the request: a taint id (see [`Context::taint_name`]) and a weight in
/// (-1, 1); positive means preferred, negative avoided, 0 neutral.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PreferredTaint {
    /// Index into the context's taint table.
    pub taint: u32,
    /// Finite weight in (-1, 1).
    pub weight: f32,
}

/// What a policy learns about the request being routed.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The request id (generated by the host when the client sent none).
    pub request_id: String,
    /// Prompt length in tokens (`isl`).
    pub prompt_tokens: u32,
    /// Complete blocks in the prompt (what the KV index can match): `prompt_tokens /
    /// block_size`, rounded down, so 0 for a prompt shorter than a block.
    pub request_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The client only asks where the request would go (`"book": false`): answer as usual,
    /// but remember nothing from this decision (the API promises that nothing changes).
    pub ask_only: bool,
    /// Which half of the routing decision this is: [`Stage::Aggregated`] (one step),
    /// [`Stage::Prefill`] or [`Stage::Decode`] (the two steps of a disaggregated decision).
    pub stage: Stage,
    /// Soft taint preferences (hard requirements were already applied by the host).
    pub preferred_taints: Vec<PreferredTaint>,
    /// Scheduling priority given by the client (higher = more important); 0 by default.
    pub priority: f64,
    /// Output tokens the client expects, when it said.
    pub expected_output_tokens: Option<u32>,
    /// Sampling temperature the host uses to pick from costs: 0 = lowest cost, > 0 = softmax.
    pub temperature: f64,
    /// Client session id, when given.
    pub session_id: Option<String>,
    /// Version of the taint table the ids refer to.
    pub taint_table_version: u64,
    /// The router's clock when the decision started, in ms since the Unix epoch (simulated time
    /// under `kvroute replay`). A hint for ageing state, not a sequence number.
    pub now_ms: u64,
}

impl Request {
    /// Assembles the request from its wire form, the packed decision data (which carries its
    /// ids and preferred taints) and the context (block size, taint-table version).
    pub fn from_wire(w: WireRequest, data: &[u64], ctx: &Context) -> Result<Self, String> {
        let v = wire::View::of(data)?;
        let ids = &v.u32s[v.preferred_start()..];
        let weights = &v.f64s[3 * v.n..];
        let text = |bytes: &[u8], what: &str| {
            std::str::from_utf8(bytes)
                .map(str::to_string)
                .map_err(|e| format!("{what} is not UTF-8: {e}"))
        };
        let request_id = text(v.request_id, "request-id")?;
        let session_id = text(v.session_id, "session-id")?;
        let preferred_taints = ids
            .iter()
            .zip(weights)
            .map(|(&taint, &weight)| PreferredTaint {
                taint,
                weight: weight as f32,
            })
            .collect();
        Ok(Self {
            request_id,
            prompt_tokens: w.prompt_tokens,
            request_blocks: w.prompt_tokens.checked_div(ctx.block_size()).unwrap_or(0),
            block_size: ctx.block_size(),
            ask_only: w.flags.bits() & RequestFlags::ASK_ONLY.bits() != 0,
            stage: Stage::from_flags(w.flags)?,
            preferred_taints,
            priority: w.priority,
            expected_output_tokens: (w.expected_output_tokens != 0)
                .then_some(w.expected_output_tokens),
            temperature: w.temperature,
            session_id: (!session_id.is_empty()).then_some(session_id),
            taint_table_version: ctx.version(),
            now_ms: w.now_ms,
        })
    }

    /// The wire form of the request's scalars (its ids and preferred taints travel in the
    /// decision data; see [`wire::pack`]).
    pub fn to_wire(&self) -> WireRequest {
        WireRequest {
            prompt_tokens: self.prompt_tokens,
            flags: if self.ask_only {
                RequestFlags::ASK_ONLY | self.stage.flags()
            } else {
                self.stage.flags()
            },
            priority: self.priority,
            expected_output_tokens: self.expected_output_tokens.unwrap_or(0),
            temperature: self.temperature,
            now_ms: self.now_ms,
        }
    }
}

/// How far a candidate's KV index (its overlap columns) can be trusted to be what its engine
/// holds: WIT column `kv-feed-trust` (since 0.7.0), from the candidate's KV event feed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FeedTrust {
    /// Every event applied in order (or the worker has no KV event feed).
    #[default]
    Exact,
    /// The feed just joined or reconnected, or a gap is being replayed: the index may miss blocks
    /// or hold evicted ones until the replay completes.
    Recovering,
    /// Events were lost for good: the index holds only what the engine stored since.
    Degraded,
}

impl FeedTrust {
    /// The interface's code: 0 exact, 1 recovering, 2 degraded; reserved values read as
    /// degraded (the safe side).
    pub fn from_code(code: u32) -> FeedTrust {
        match code {
            0 => FeedTrust::Exact,
            1 => FeedTrust::Recovering,
            _ => FeedTrust::Degraded,
        }
    }

    /// The interface's code of this state.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The state's name, as `GET /v1/workers` and explain write it.
    pub fn as_str(self) -> &'static str {
        match self {
            FeedTrust::Exact => "exact",
            FeedTrust::Recovering => "recovering",
            FeedTrust::Degraded => "degraded",
        }
    }
}

/// Whether a candidate holds the request's session binding: WIT column `session-bound` (since
/// 0.8.0). Bindings are the host's (`[sessions]`): made on a session's first booked turn, moved
/// with it, expired after an idle TTL, shared by cluster replicas and kept across policy swaps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SessionBound {
    /// No binding of this request here (no session, not bound yet, bound elsewhere, or off).
    #[default]
    None,
    /// The request's own session is bound here: its earlier turns' cache is likely here.
    Session,
    /// The request's session is new and its parent's (a subagent's) is bound here.
    Parent,
}

impl SessionBound {
    /// The interface's code: 0 none, 1 session, 2 parent; reserved values read as none.
    pub fn from_code(code: u32) -> SessionBound {
        match code {
            1 => SessionBound::Session,
            2 => SessionBound::Parent,
            _ => SessionBound::None,
        }
    }

    /// The interface's code.
    pub fn code(self) -> u32 {
        self as u32
    }
}

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

    /// Which host-computed columns this policy reads, as configured (asked right after a
    /// successful [`Policy::configure`]; interface 0.10.0). The host computes
    /// [`Candidates::base_cost`] only for a policy that answers [`HostColumns::BASE_COST`] and
    /// sends NaN there otherwise (so does [`testing::Harness`]). The default says it reads it;
    /// a policy that prices candidates on its own figures answers [`HostColumns::empty()`] and
    /// saves the host the native cost, about 4–5 ns per candidate per decision.
    fn host_columns(&self) -> HostColumns {
        HostColumns::BASE_COST
    }

    /// Ranks the candidates: one cost per candidate (lower is better) or a pick.
    fn decide(&mut self, ctx: &Context, req: &Request, candidates: &Candidates) -> Decision;
}

/// What a policy knows besides the request: the host's block size and taint-name table.
#[derive(Clone, Debug)]
pub struct Context {
    version: u64,
    block_size: u32,
    names: Vec<String>,
    ids: BTreeMap<String, u32>,
}

impl Default for Context {
    fn default() -> Self {
        Self::new(0, Vec::new())
    }
}

impl Context {
    /// A context with this taint table and block size 16.
    pub fn new(version: u64, names: Vec<String>) -> Self {
        let ids = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i as u32))
            .collect();
        Self {
            version,
            block_size: 16,
            names,
            ids,
        }
    }

    /// The same context with another block size.
    pub fn with_block_size(mut self, block_size: u32) -> Self {
        self.block_size = block_size;
        self
    }

    /// The context the host sent.
    pub fn from_wire(w: WireContext) -> Self {
        Self::new(w.version, w.taint_names).with_block_size(w.block_size)
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> u32 {
        self.block_size
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
    /// How far each candidate's overlaps can be trusted, as the interface's codes (0 exact,
    /// 1 recovering, 2 degraded; read them typed with [`Row::kv_feed_trust`] or
    /// [`FeedTrust::from_code`]).
    pub kv_feed_trust: &'a [u32],
    /// Whether each candidate holds the request's session binding, as the interface's codes (0
    /// none, 1 its session, 2 its parent session; typed: [`Row::session_bound`]).
    pub session_bound: &'a [u32],
    /// The host's native cost (without preferred taints); in a pipeline's selector stage, the
    /// weighted sum of the scorer stages.
    pub base_cost: &'a [f64],
    /// The worker's learned prefill milliseconds per uncached prompt token (0 = not learned yet).
    pub prefill_ms_per_token: &'a [f64],
    /// The worker's learned milliseconds per output token once decoding (0 = not learned yet).
    pub decode_step_ms: &'a [f64],
    /// Start of each candidate's taints in `taint_ids` (`count() + 1` entries, first 0).
    pub taint_offsets: &'a [u32],
    /// Taint ids of all candidates, back to back.
    pub taint_ids: &'a [u32],
}

impl<'a> Candidates<'a> {
    /// Splits the packed decision data into columns, checking every length once (the host
    /// guarantees them; a violation is reported, not indexed out of bounds later). The columns
    /// borrow `data` in place: nothing is copied.
    pub fn from_wire(data: &'a [u64]) -> Result<Self, String> {
        let v = wire::View::of(data)?;
        let n = v.n;
        let c64 = |k: usize| &v.u64s[k * n..(k + 1) * n];
        let c32 = |k: usize| &v.u32s[k * n..(k + 1) * n];
        let f = |k: usize| &v.f64s[k * n..(k + 1) * n];
        let taint_offsets = &v.u32s[9 * n..10 * n + 1];
        let taint_ids = &v.u32s[10 * n + 1..v.preferred_start()];
        let ordered = taint_offsets.windows(2).all(|p| p[0] <= p[1]);
        if taint_offsets[0] != 0 || taint_offsets[n] as usize != v.t || !ordered {
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
            kv_feed_trust: c32(7),
            session_bound: c32(8),
            base_cost: f(0),
            prefill_ms_per_token: f(1),
            decode_step_ms: f(2),
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
    /// How far the candidate's overlaps can be trusted (its KV event feed's state).
    pub fn kv_feed_trust(&self) -> FeedTrust {
        FeedTrust::from_code(self.cols.kv_feed_trust[self.index])
    }
    /// Whether the candidate holds the request's session binding (or its parent's).
    pub fn session_bound(&self) -> SessionBound {
        SessionBound::from_code(self.cols.session_bound[self.index])
    }

    /// The worker's learned prefill milliseconds per uncached prompt token, when learned.
    pub fn prefill_ms_per_token(&self) -> Option<f64> {
        Some(self.cols.prefill_ms_per_token[self.index]).filter(|v| *v > 0.0)
    }

    /// The worker's learned milliseconds per output token once decoding, when learned.
    pub fn decode_step_ms(&self) -> Option<f64> {
        Some(self.cols.decode_step_ms[self.index]).filter(|v| *v > 0.0)
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

    /// Routes panic messages to the host's log. Without it, Rust's default hook writes them to
    /// stderr, which a policy does not have: the write itself traps, the message is lost, and
    /// the author reads about a missing `wasi:cli/stderr` import instead of their panic. With
    /// it, the host shows `panicked at src/lib.rs:10:5: ...` as the reason of the trap (in
    /// `kvroute policy check`, upload errors and the server's log). Natively (tests) the
    /// default hook stays.
    fn install_panic_hook() {
        #[cfg(target_arch = "wasm32")]
        {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                std::panic::set_hook(Box::new(|info| {
                    log(LogLevel::Error, &info.to_string());
                }));
            });
        }
    }

    /// Per-instance state behind the generated exports.
    pub struct Slot<P: Policy> {
        pub policy: RefCell<Option<P>>,
        pub ctx: RefCell<Context>,
    }

    impl<P: Policy> Slot<P> {
        pub fn new() -> Self {
            install_panic_hook();
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

        pub fn set_context(&self, ctx: WireContext) {
            *self.ctx.borrow_mut() = Context::from_wire(ctx);
        }

        /// Decodes one decision and runs the policy on it.
        pub fn decide(&self, req: WireRequest, data: WireData) -> Decision {
            let decoded = Candidates::from_wire(&data).and_then(|c| {
                let r = Request::from_wire(req, &data, &self.ctx.borrow())?;
                Ok((r, c))
            });
            let (req, candidates) = match decoded {
                Ok(d) => d,
                // The host guarantees these lengths; if they are ever wrong, trapping makes it
                // fall back to its native cost and count it.
                Err(e) => panic!("kvroute-sdk: malformed decision from the host: {e}"),
            };
            self.with(|p, ctx| p.decide(ctx, &req, &candidates))
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
                fn configure(config_json: String) -> Result<$crate::HostColumns, String> {
                    __SLOT.with(|s| {
                        s.with(|p, _| {
                            <$policy as $crate::Policy>::configure(p, &config_json)?;
                            Ok(<$policy as $crate::Policy>::host_columns(p))
                        })
                    })
                }
                fn set_context(context: $crate::WireContext) {
                    __SLOT.with(|s| s.set_context(context))
                }
                fn decide(req: $crate::WireRequest, data: $crate::WireData) -> $crate::Decision {
                    __SLOT.with(|s| s.decide(req, data))
                }
            }
            #[cfg(target_arch = "wasm32")]
            $crate::bindings::__kvroute_export_world!(__KvrouteExport with_types_in $crate::bindings);
        };
    };
}
