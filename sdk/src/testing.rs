//! A native test harness: unit-test a policy with plain `cargo test`, no Wasm.
//!
//! ```
//! use kvroute_sdk::testing::{candidate, request, Harness};
//! use kvroute_sdk::{Candidates, Context, Decision, Policy, Request};
//!
//! #[derive(Default)]
//! struct MostCached;
//! impl Policy for MostCached {
//!     fn decide(&mut self, _: &Context, _: &Request, c: &Candidates) -> Decision {
//!         Decision::Costs(c.rows().map(|r| -f64::from(r.device_overlap())).collect())
//!     }
//! }
//!
//! let mut h = Harness::<MostCached>::new();
//! let set = [candidate(1), candidate(2).device_overlap(8)];
//! assert_eq!(h.pick(&request(256), &set).worker_id, 2);
//! // Identical candidates tie: the host picks one uniformly at random.
//! let tie = [candidate(1), candidate(2)];
//! let ids: Vec<u64> = h.lowest(&request(256), &tie).iter().map(|p| p.worker_id).collect();
//! assert_eq!(ids, [1, 2]);
//! ```
//! Candidates are described with [`candidate`] (taints by name); the harness builds the columns,
//! the taint table, and the host's base cost exactly as the host would, then calls your policy.
//! A request is an aggregated decision unless the test asks for a stage of a disaggregated one
//! ([`RequestSpec::prefill`], [`RequestSpec::decode`]); at the decode stage the base cost gives
//! overlap no credit, as the host's does:
//!
//! ```
//! # use kvroute_sdk::testing::{candidate, request, Harness};
//! # use kvroute_sdk::{Candidates, Context, Decision, Policy, Request, Stage};
//! #[derive(Default)]
//! struct CacheThenLoad;
//! impl Policy for CacheThenLoad {
//!     fn decide(&mut self, _: &Context, req: &Request, c: &Candidates) -> Decision {
//!         Decision::Costs(match req.stage {
//!             // The decode worker computes no prompt: only its load matters.
//!             Stage::Decode => c.rows().map(|r| r.active_decode_blocks() as f64).collect(),
//!             Stage::Aggregated | Stage::Prefill => c.base_cost.to_vec(),
//!         })
//!     }
//! }
//!
//! let mut h = Harness::<CacheThenLoad>::new();
//! // 256 tokens = 16 blocks, all cached on worker 1, which also holds 8 decode blocks.
//! let set = [candidate(1).device_overlap(16).active_decode_blocks(8), candidate(2)];
//! assert_eq!(h.pick(&request(256).prefill(), &set).worker_id, 1);
//! assert_eq!(h.pick(&request(256).decode(), &set).worker_id, 2);
//! ```

use std::cell::RefCell;

use crate::helpers::{native_cost, CostWeights};
use crate::{Candidates, Context, Decision, LogLevel, Policy, PreferredTaint, Request, Stage};

thread_local! {
    static LOGS: RefCell<Vec<(LogLevel, String)>> = const { RefCell::new(Vec::new()) };
}

#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn record_log(level: LogLevel, message: &str) {
    LOGS.with(|l| l.borrow_mut().push((level, message.to_string())));
}

/// Log lines the policy wrote on this thread since the last call.
pub fn take_logs() -> Vec<(LogLevel, String)> {
    LOGS.with(|l| std::mem::take(&mut *l.borrow_mut()))
}

/// One candidate of a test set.
#[derive(Clone, Debug, Default)]
pub struct CandidateSpec {
    worker_id: u64,
    dp_rank: u32,
    device_overlap: u32,
    host_overlap: u32,
    disk_overlap: u32,
    active_prefill_tokens: u64,
    active_decode_blocks: u64,
    active_requests: u32,
    active_prompt_blocks: u32,
    total_kv_blocks: u64,
    max_num_batched_tokens: u32,
    prefill_ms_per_token: f64,
    decode_step_ms: f64,
    kv_feed_trust: crate::FeedTrust,
    session_bound: crate::SessionBound,
    base_cost: Option<f64>,
    taints: Vec<String>,
}

/// A candidate with this worker id, rank 0, idle and with nothing cached.
pub fn candidate(worker_id: u64) -> CandidateSpec {
    CandidateSpec {
        worker_id,
        total_kv_blocks: 16_384,
        max_num_batched_tokens: 8_192,
        ..Default::default()
    }
}

/// For learned-step-time tests: three candidates with the same load (2,000 prefill tokens queued,
/// 3 requests, 400 decode blocks) and nothing cached, of which worker 1 learned at 0.02 ms per
/// prefill token and 10 ms per decode step, worker 2 twice as slow and worker 3 not learned yet
/// (the fleet's means are 0.03 and 15, so their relative speeds are 2/3, 4/3 and 1); and worker 1
/// with that load and no learned figures, which a policy prices with its model alone.
pub fn learned_fleet() -> ([CandidateSpec; 3], CandidateSpec) {
    let busy = |w| {
        candidate(w)
            .active_prefill_tokens(2000)
            .active_requests(3)
            .active_decode_blocks(400)
    };
    (
        [
            busy(1).prefill_ms_per_token(0.02).decode_step_ms(10.0),
            busy(2).prefill_ms_per_token(0.04).decode_step_ms(20.0),
            busy(3),
        ],
        busy(1),
    )
}

macro_rules! setters {
    ($($name:ident: $ty:ty),* $(,)?) => {
        $(
            #[doc = concat!("Sets `", stringify!($name), "`.")]
            pub fn $name(mut self, v: $ty) -> Self {
                self.$name = v;
                self
            }
        )*
    };
}

impl CandidateSpec {
    setters!(
        dp_rank: u32,
        device_overlap: u32,
        host_overlap: u32,
        disk_overlap: u32,
        active_prefill_tokens: u64,
        active_decode_blocks: u64,
        active_requests: u32,
        active_prompt_blocks: u32,
        total_kv_blocks: u64,
        max_num_batched_tokens: u32,
        prefill_ms_per_token: f64,
        decode_step_ms: f64,
        kv_feed_trust: crate::FeedTrust,
        session_bound: crate::SessionBound,
    );

    /// The candidate's worker id.
    pub fn id(&self) -> u64 {
        self.worker_id
    }

    /// Overrides the host's base cost (otherwise computed like the host does).
    pub fn base_cost(mut self, v: f64) -> Self {
        self.base_cost = Some(v);
        self
    }

    /// Sets the candidate's taints, by name.
    pub fn taints(mut self, names: &[&str]) -> Self {
        self.taints = names.iter().map(|s| s.to_string()).collect();
        self
    }
}

/// A request of the test.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    prompt_tokens: u32,
    block_size: u32,
    preferred: Vec<(String, f32)>,
    priority: f64,
    expected_output_tokens: Option<u32>,
    temperature: f64,
    session_id: Option<String>,
    request_id: String,
    now_ms: u64,
    ask_only: bool,
    stage: Stage,
}

/// A request with this many prompt tokens, block size 16, no preferences, temperature 0, at
/// `now_ms` 1,700,000,000,000, for an aggregated (one-step) decision.
pub fn request(prompt_tokens: u32) -> RequestSpec {
    RequestSpec {
        prompt_tokens,
        block_size: 16,
        preferred: Vec::new(),
        priority: 0.0,
        expected_output_tokens: None,
        temperature: 0.0,
        session_id: None,
        request_id: "test".into(),
        now_ms: 1_700_000_000_000,
        ask_only: false,
        stage: Stage::Aggregated,
    }
}

impl RequestSpec {
    /// Block size.
    pub fn block_size(mut self, b: u32) -> Self {
        self.block_size = b;
        self
    }
    /// Adds a soft preference for a taint (weight in (-1, 1)).
    pub fn prefer(mut self, taint: &str, weight: f32) -> Self {
        self.preferred.push((taint.to_string(), weight));
        self
    }
    /// Session id.
    pub fn session(mut self, id: &str) -> Self {
        self.session_id = Some(id.to_string());
        self
    }
    /// Temperature.
    pub fn temperature(mut self, t: f64) -> Self {
        self.temperature = t;
        self
    }
    /// Priority.
    pub fn priority(mut self, p: f64) -> Self {
        self.priority = p;
        self
    }
    /// Expected output tokens.
    pub fn expected_output(mut self, n: u32) -> Self {
        self.expected_output_tokens = Some(n);
        self
    }
    /// The router's clock at the decision (`now_ms`, ms since the Unix epoch; by default
    /// 1,700,000,000,000).
    pub fn at_ms(mut self, now_ms: u64) -> Self {
        self.now_ms = now_ms;
        self
    }
    /// An ask-only decision (`"book": false` in the HTTP API): the policy must remember nothing
    /// from it.
    pub fn ask_only(mut self) -> Self {
        self.ask_only = true;
        self
    }
    /// The stage of the decision ([`Stage::Aggregated`] by default).
    pub fn stage(mut self, stage: Stage) -> Self {
        self.stage = stage;
        self
    }
    /// The prefill step of a disaggregated decision ([`Stage::Prefill`]).
    pub fn prefill(self) -> Self {
        self.stage(Stage::Prefill)
    }
    /// The decode step of a disaggregated decision ([`Stage::Decode`]): the host's base cost
    /// gives overlap no credit.
    pub fn decode(self) -> Self {
        self.stage(Stage::Decode)
    }
    /// Request id.
    pub fn id(mut self, id: &str) -> Self {
        self.request_id = id.to_string();
        self
    }
}

/// Candidate columns owned by a test; [`CandidateSet::view`] gives the [`Candidates`] a policy sees.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CandidateSet {
    /// See [`Candidates::worker_id`].
    pub worker_id: Vec<u64>,
    /// See [`Candidates::dp_rank`].
    pub dp_rank: Vec<u32>,
    /// See [`Candidates::device_overlap`].
    pub device_overlap: Vec<u32>,
    /// See [`Candidates::host_overlap`].
    pub host_overlap: Vec<u32>,
    /// See [`Candidates::disk_overlap`].
    pub disk_overlap: Vec<u32>,
    /// See [`Candidates::active_prefill_tokens`].
    pub active_prefill_tokens: Vec<u64>,
    /// See [`Candidates::active_decode_blocks`].
    pub active_decode_blocks: Vec<u64>,
    /// See [`Candidates::active_requests`].
    pub active_requests: Vec<u32>,
    /// See [`Candidates::active_prompt_blocks`].
    pub active_prompt_blocks: Vec<u32>,
    /// See [`Candidates::total_kv_blocks`].
    pub total_kv_blocks: Vec<u64>,
    /// See [`Candidates::max_num_batched_tokens`].
    pub max_num_batched_tokens: Vec<u32>,
    /// See [`Candidates::kv_feed_trust`].
    pub kv_feed_trust: Vec<u32>,
    /// See [`Candidates::session_bound`].
    pub session_bound: Vec<u32>,
    /// See [`Candidates::base_cost`].
    pub base_cost: Vec<f64>,
    /// See [`Candidates::prefill_ms_per_token`].
    pub prefill_ms_per_token: Vec<f64>,
    /// See [`Candidates::decode_step_ms`].
    pub decode_step_ms: Vec<f64>,
    /// See [`Candidates::taint_offsets`].
    pub taint_offsets: Vec<u32>,
    /// See [`Candidates::taint_ids`].
    pub taint_ids: Vec<u32>,
}

impl CandidateSet {
    /// The view a policy receives.
    pub fn view(&self) -> Candidates<'_> {
        Candidates {
            worker_id: &self.worker_id,
            dp_rank: &self.dp_rank,
            device_overlap: &self.device_overlap,
            host_overlap: &self.host_overlap,
            disk_overlap: &self.disk_overlap,
            active_prefill_tokens: &self.active_prefill_tokens,
            active_decode_blocks: &self.active_decode_blocks,
            active_requests: &self.active_requests,
            active_prompt_blocks: &self.active_prompt_blocks,
            total_kv_blocks: &self.total_kv_blocks,
            max_num_batched_tokens: &self.max_num_batched_tokens,
            kv_feed_trust: &self.kv_feed_trust,
            session_bound: &self.session_bound,
            base_cost: &self.base_cost,
            prefill_ms_per_token: &self.prefill_ms_per_token,
            decode_step_ms: &self.decode_step_ms,
            taint_offsets: &self.taint_offsets,
            taint_ids: &self.taint_ids,
        }
    }

    /// The decision packed as it crosses the interface (WIT `decision-data`): these columns,
    /// and the request's preferred taints and ids.
    pub fn to_wire(&self, req: &Request) -> crate::WireData {
        crate::wire::pack(req, &self.view())
    }
}

/// Builds the host-side view of a request and its candidates: the context (taint table), the
/// request record and the columns, with base costs as the host computes them.
pub fn build(req: &RequestSpec, set: &[CandidateSpec]) -> (Context, Request, CandidateSet) {
    let mut names: Vec<String> = Vec::new();
    let id_of = |n: &str, names: &mut Vec<String>| -> u32 {
        match names.iter().position(|x| x == n) {
            Some(i) => i as u32,
            None => {
                names.push(n.to_string());
                (names.len() - 1) as u32
            }
        }
    };
    let mut c = CandidateSet {
        taint_offsets: vec![0],
        ..Default::default()
    };
    for s in set {
        c.worker_id.push(s.worker_id);
        c.dp_rank.push(s.dp_rank);
        c.device_overlap.push(s.device_overlap);
        c.host_overlap.push(s.host_overlap);
        c.disk_overlap.push(s.disk_overlap);
        c.active_prefill_tokens.push(s.active_prefill_tokens);
        c.active_decode_blocks.push(s.active_decode_blocks);
        c.active_requests.push(s.active_requests);
        c.active_prompt_blocks.push(s.active_prompt_blocks);
        c.total_kv_blocks.push(s.total_kv_blocks);
        c.max_num_batched_tokens.push(s.max_num_batched_tokens);
        c.kv_feed_trust.push(s.kv_feed_trust.code());
        c.session_bound.push(s.session_bound.code());
        c.base_cost.push(0.0);
        c.prefill_ms_per_token.push(s.prefill_ms_per_token);
        c.decode_step_ms.push(s.decode_step_ms);
        for t in &s.taints {
            let id = id_of(t, &mut names);
            c.taint_ids.push(id);
        }
        c.taint_offsets.push(c.taint_ids.len() as u32);
    }
    let preferred = req
        .preferred
        .iter()
        .map(|(n, w)| PreferredTaint {
            taint: id_of(n, &mut names),
            weight: *w,
        })
        .collect();
    let request = Request {
        request_id: req.request_id.clone(),
        prompt_tokens: req.prompt_tokens,
        request_blocks: req.prompt_tokens / req.block_size.max(1),
        block_size: req.block_size,
        ask_only: req.ask_only,
        stage: req.stage,
        preferred_taints: preferred,
        priority: req.priority,
        expected_output_tokens: req.expected_output_tokens,
        temperature: req.temperature,
        session_id: req.session_id.clone(),
        taint_table_version: 1,
        now_ms: req.now_ms,
    };
    let base: Vec<f64> = c
        .view()
        .rows()
        .zip(set)
        .map(|(r, s)| {
            s.base_cost
                .unwrap_or_else(|| native_cost(&request, r, &CostWeights::default()))
        })
        .collect();
    c.base_cost = base;
    (
        Context::new(1, names).with_block_size(req.block_size),
        request,
        c,
    )
}

/// Runs a policy natively.
pub struct Harness<P: Policy> {
    /// The policy under test (inspect its state freely).
    pub policy: P,
}

impl<P: Policy> Default for Harness<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Policy> Harness<P> {
    /// A harness around `P::default()`, not configured.
    pub fn new() -> Self {
        Self {
            policy: P::default(),
        }
    }

    /// Calls `configure`.
    pub fn configure(&mut self, json: &str) -> Result<(), String> {
        self.policy.configure(json)
    }

    /// Calls `decide` on the set and checks the answer the way the host does (length, finite
    /// costs, pick in range), panicking with a clear message on a violation.
    pub fn decide(&mut self, req: &RequestSpec, set: &[CandidateSpec]) -> Decision {
        let (ctx, request, mut cands) = build(req, set);
        // As the host does: no base cost for a policy that says it does not read it.
        if self.policy.host_columns().bits() & crate::HostColumns::BASE_COST.bits() == 0 {
            cands.base_cost.fill(f64::NAN);
        }
        // Through the interface's packed form and back, exactly as a Wasm build receives it.
        let wire = cands.to_wire(&request);
        let view = Candidates::from_wire(&wire).expect("the harness packs valid columns");
        let request = Request::from_wire(request.to_wire(), &wire, &ctx)
            .expect("the harness packs a valid request");
        debug_assert!(view
            .base_cost
            .iter()
            .zip(cands.view().base_cost)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let d = self.policy.decide(&ctx, &request, &view);
        match &d {
            Decision::Costs(c) => {
                assert_eq!(
                    c.len(),
                    set.len(),
                    "the policy returned {} costs for {} candidates",
                    c.len(),
                    set.len()
                );
                assert!(
                    c.iter().all(|x| x.is_finite()),
                    "the policy returned a non-finite cost: {c:?} (base costs are NaN for a \
                     policy whose host_columns() leaves out BASE_COST)"
                );
            }
            Decision::Pick(i) => assert!(
                (*i as usize) < set.len(),
                "pick {i} out of range ({} candidates)",
                set.len()
            ),
        }
        d
    }

    /// The costs the policy returns (panics if it picks).
    pub fn costs(&mut self, req: &RequestSpec, set: &[CandidateSpec]) -> Vec<f64> {
        match self.decide(req, set) {
            Decision::Costs(c) => c,
            Decision::Pick(i) => panic!("the policy picked {i} instead of returning costs"),
        }
    }

    /// The candidate the host routes to at temperature 0, named as the test named it:
    /// `h.pick(&req, &set).worker_id` is the `n` of the `candidate(n)` chosen (`.index` is its
    /// position in `set`, `.dp_rank` its rank).
    ///
    /// The host breaks ties at the lowest cost uniformly at random, so no single candidate is
    /// *the* pick of a tie: this panics when several candidates share the lowest cost, naming
    /// them. Assert a tie with [`Harness::lowest`]. A policy that returns `Pick(i)` chooses
    /// itself. The request's temperature is not applied (at `T > 0` the host samples from the
    /// costs; assert [`Harness::costs`] then).
    #[track_caller]
    pub fn pick(&mut self, req: &RequestSpec, set: &[CandidateSpec]) -> Picked {
        match self.decide(req, set) {
            Decision::Pick(i) => Picked::of(set, i as usize),
            Decision::Costs(c) => match lowest_indices(&c)[..] {
                [i] => Picked::of(set, i),
                ref tied => panic!(
                    "{} candidates tie at the lowest cost {}: {}; the host picks one of them \
                     uniformly at random, so assert the set with Harness::lowest (or give them \
                     different costs)",
                    tied.len(),
                    c[tied[0]],
                    tied.iter()
                        .map(|&i| Picked::of(set, i).to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
        }
    }

    /// Every candidate the host may route to at temperature 0: those at the lowest cost, in the
    /// set's order (one of them, uniformly at random), or the one the policy picked.
    pub fn lowest(&mut self, req: &RequestSpec, set: &[CandidateSpec]) -> Vec<Picked> {
        match self.decide(req, set) {
            Decision::Pick(i) => vec![Picked::of(set, i as usize)],
            Decision::Costs(c) => lowest_indices(&c)
                .into_iter()
                .map(|i| Picked::of(set, i))
                .collect(),
        }
    }
}

/// A candidate a decision routes to: the worker id and rank the test gave it with
/// `candidate(worker_id).dp_rank(r)`, and its position in the set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Picked {
    /// The `n` of `candidate(n)`.
    pub worker_id: u64,
    /// Its rank (`.dp_rank(r)`, 0 by default).
    pub dp_rank: u32,
    /// Its position in the candidate slice.
    pub index: usize,
}

impl Picked {
    fn of(set: &[CandidateSpec], index: usize) -> Self {
        Self {
            worker_id: set[index].worker_id,
            dp_rank: set[index].dp_rank,
            index,
        }
    }
}

impl std::fmt::Display for Picked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "worker {} rank {} (set[{}])",
            self.worker_id, self.dp_rank, self.index
        )
    }
}

/// Indices of the lowest cost, compared exactly as the host's temperature-0 pick does (the costs
/// are finite: [`Harness::decide`] checked).
fn lowest_indices(costs: &[f64]) -> Vec<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    (0..costs.len()).filter(|&i| costs[i] == min).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Costs given by the test: one per candidate, in order.
    #[derive(Default)]
    struct Fixed(Vec<f64>);
    impl Policy for Fixed {
        fn decide(&mut self, _: &Context, _: &Request, _: &Candidates) -> Decision {
            Decision::Costs(self.0.clone())
        }
    }

    #[test]
    fn pick_names_the_candidate_as_the_test_did() {
        let mut h = Harness::<Fixed>::new();
        h.policy.0 = vec![3.0, 1.0, 2.0];
        let set = [candidate(7), candidate(9).dp_rank(2), candidate(4)];
        let p = h.pick(&request(64), &set);
        assert_eq!(
            p,
            Picked {
                worker_id: 9,
                dp_rank: 2,
                index: 1
            }
        );
    }

    /// Records the request it was given.
    #[derive(Default)]
    struct Seen(Option<Request>);
    impl Policy for Seen {
        fn decide(&mut self, _: &Context, req: &Request, c: &Candidates) -> Decision {
            self.0 = Some(req.clone());
            Decision::Costs(vec![0.0; c.count()])
        }
    }

    #[test]
    fn the_stage_reaches_the_policy_through_the_wire_form() {
        let mut h = Harness::<Seen>::new();
        let set = [candidate(1)];
        for (spec, want) in [
            (request(64), Stage::Aggregated),
            (request(64).prefill(), Stage::Prefill),
            (request(64).decode(), Stage::Decode),
            (request(64).stage(Stage::Decode).ask_only(), Stage::Decode),
        ] {
            h.decide(&spec, &set);
            let seen = h.policy.0.take().unwrap();
            assert_eq!(seen.stage, want, "{spec:?}");
        }
        // ask-only and the stage are separate facts.
        h.decide(&request(64).prefill().ask_only(), &set);
        let seen = h.policy.0.take().unwrap();
        assert!(seen.ask_only && seen.stage == Stage::Prefill, "{seen:?}");
        h.decide(&request(64).decode(), &set);
        assert!(!h.policy.0.take().unwrap().ask_only);
    }

    /// Records each candidate's feed trust and taints.
    #[derive(Default)]
    struct SeenTrust(Vec<(crate::FeedTrust, Vec<u32>)>);
    impl Policy for SeenTrust {
        fn decide(&mut self, _: &Context, _: &Request, c: &Candidates) -> Decision {
            self.0 = c
                .rows()
                .map(|r| (r.kv_feed_trust(), r.taints().to_vec()))
                .collect();
            Decision::Costs(vec![0.0; c.count()])
        }
    }

    #[test]
    fn the_feed_trust_column_reaches_the_policy_through_the_wire_form() {
        use crate::FeedTrust::*;
        let mut h = Harness::<SeenTrust>::new();
        let set = [
            candidate(1).kv_feed_trust(Recovering).taints(&["zone=a"]),
            candidate(2),
            candidate(3).kv_feed_trust(Degraded).taints(&["zone=b"]),
        ];
        h.decide(&request(64).prefer("zone=a", 0.5), &set);
        assert_eq!(
            h.policy.0,
            vec![(Recovering, vec![0]), (Exact, vec![]), (Degraded, vec![1])]
        );
        // The packed list: column 7, column 8, then the taint index after them.
        let (_, r, c) = build(&request(64), &set);
        let w = c.to_wire(&r);
        let v = crate::wire::View::of(&w).unwrap();
        assert_eq!(&v.u32s[7 * 3..8 * 3], &[1, 0, 2]);
        assert_eq!(&v.u32s[8 * 3..9 * 3], &[0, 0, 0]);
        assert_eq!(&v.u32s[9 * 3..10 * 3 + 1], &[0, 1, 1, 2]);
        // Reserved codes read as degraded.
        assert_eq!(crate::FeedTrust::from_code(9), Degraded);
    }

    /// Records each candidate's session binding and taints.
    #[derive(Default)]
    struct SeenSession(Vec<(crate::SessionBound, Vec<u32>)>);
    impl Policy for SeenSession {
        fn decide(&mut self, _: &Context, _: &Request, c: &Candidates) -> Decision {
            self.0 = c
                .rows()
                .map(|r| (r.session_bound(), r.taints().to_vec()))
                .collect();
            Decision::Costs(vec![0.0; c.count()])
        }
    }

    #[test]
    fn the_session_bound_column_reaches_the_policy_through_the_wire_form() {
        use crate::SessionBound::*;
        let mut h = Harness::<SeenSession>::new();
        let set = [
            candidate(1).taints(&["zone=a"]),
            candidate(2).session_bound(Session),
            candidate(3).session_bound(Parent).taints(&["zone=b"]),
        ];
        h.decide(&request(64).prefer("zone=b", 0.5), &set);
        assert_eq!(
            h.policy.0,
            vec![(None, vec![0]), (Session, vec![]), (Parent, vec![1])]
        );
        let (_, r, c) = build(&request(64), &set);
        let w = c.to_wire(&r);
        let v = crate::wire::View::of(&w).unwrap();
        assert_eq!(&v.u32s[8 * 3..9 * 3], &[0, 1, 2]);
        assert_eq!(&v.u32s[9 * 3..10 * 3 + 1], &[0, 1, 1, 2]);
        // Reserved codes read as none.
        assert_eq!(crate::SessionBound::from_code(7), None);
    }

    /// Records the request's ids and preferences as the policy saw them.
    #[derive(Default)]
    struct SeenIds(Option<Request>);
    impl Policy for SeenIds {
        fn decide(&mut self, _: &Context, req: &Request, c: &Candidates) -> Decision {
            self.0 = Some(req.clone());
            Decision::Costs(vec![0.0; c.count()])
        }
    }

    #[test]
    fn the_ids_and_preferences_reach_the_policy_through_the_wire_form() {
        let mut h = Harness::<SeenIds>::new();
        let set = [candidate(1).taints(&["zone=a"]), candidate(2)];
        // An odd number of `u32` entries (padding) and ids of lengths that are not whole words.
        h.decide(
            &request(64)
                .id("req-ünï")
                .session("s-1")
                .prefer("zone=a", 0.5)
                .prefer("zone=b", -0.25),
            &set,
        );
        let seen = h.policy.0.take().unwrap();
        assert_eq!(seen.request_id, "req-ünï");
        assert_eq!(seen.session_id.as_deref(), Some("s-1"));
        assert_eq!(
            seen.preferred_taints
                .iter()
                .map(|p| (p.taint, p.weight))
                .collect::<Vec<_>>(),
            vec![(0, 0.5), (1, -0.25)]
        );
        h.decide(&request(64).id("r"), &set);
        assert_eq!(h.policy.0.take().unwrap().session_id, None);
    }

    #[test]
    fn a_header_that_does_not_match_the_length_is_malformed() {
        let (_, req, set) = build(&request(64), &[candidate(1), candidate(2)]);
        let mut w = set.to_wire(&req);
        assert!(Candidates::from_wire(&w).is_ok());
        w.push(0);
        let err = Candidates::from_wire(&w).unwrap_err();
        assert!(err.contains("words"), "{err}");
        assert!(Candidates::from_wire(&w[..2]).is_err());
    }

    #[test]
    fn both_stage_flags_are_a_malformed_request() {
        let (ctx, req, set) = build(&request(64), &[candidate(1)]);
        let wire_set = set.to_wire(&req);
        let mut wire = req.to_wire();
        wire.flags = crate::RequestFlags::PREFILL | crate::RequestFlags::DECODE;
        let err = Request::from_wire(wire, &wire_set, &ctx).unwrap_err();
        assert!(err.contains("prefill") && err.contains("decode"), "{err}");
    }

    #[test]
    fn the_decode_base_cost_gives_overlap_no_credit() {
        // 256 tokens = 16 blocks, all cached on worker 1, which also holds more decode blocks.
        let set = [
            candidate(1).device_overlap(16).active_decode_blocks(8),
            candidate(2),
        ];
        let base = |spec: &RequestSpec| build(spec, &set).2.base_cost;
        // Aggregated and prefill: the cache saves 16 blocks of prompt work, worth more than 8
        // decode blocks.
        for spec in [request(256), request(256).prefill()] {
            let b = base(&spec);
            assert_eq!(b, vec![8.0 + 16.0, 16.0 + 16.0], "{spec:?}");
        }
        // Decode: the prompt's 16 blocks cost every candidate the same; load decides.
        assert_eq!(
            base(&request(256).decode()),
            vec![16.0 + 8.0 + 16.0, 16.0 + 16.0]
        );
    }

    #[test]
    fn a_tie_is_a_set_not_a_pick() {
        let mut h = Harness::<Fixed>::new();
        h.policy.0 = vec![2.0, 1.0, 1.0];
        let set = [candidate(1), candidate(2), candidate(3)];
        let ids: Vec<u64> = h
            .lowest(&request(64), &set)
            .iter()
            .map(|p| p.worker_id)
            .collect();
        assert_eq!(ids, [2, 3]);
        let msg =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.pick(&request(64), &set)))
                .unwrap_err();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("2 candidates tie at the lowest cost 1")
                && msg.contains("worker 2 rank 0 (set[1]), worker 3 rank 0 (set[2])")
                && msg.contains("uniformly at random"),
            "{msg}"
        );
    }
}
