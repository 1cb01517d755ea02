//! Rolling a policy version out on live traffic: **shadow** and **canary** (docs/POLICIES.md,
//! "Rollout").
//!
//! - A shadow runs a loaded, non-active version beside the active one, off the request path: for
//!   a sampled decision the calling thread copies the decision, in the wire form the active
//!   policy was just called with (one contiguous list, still in its cache), and the active
//!   policy's answer into a bounded queue (full: the copy is dropped and counted) and returns; one
//!   background thread, niced like the compile thread, asks the shadow version with exactly those
//!   words and compares its pick with the active one's. Nothing it does reaches the answer a
//!   client gets.
//!
//!   The copy is what the deciding thread pays (issue 37: at most 1 µs at the p50), so it
//!   allocates nothing and shares as little as it can with the shadow thread: the copies live in
//!   reused slots (their buffers keep their capacity; the shadow thread hands emptied slots back
//!   rather than freeing memory another thread allocated, which made glibc's arena lock bounce
//!   between the two threads, with a futex wake on the deciding thread every few decisions); the
//!   shadow thread takes the whole queue at once instead of locking it per decision; the slot
//!   keeps its `Arc`s of the shadow and the taint table while they do not change (no reference
//!   count bouncing); what each side writes sits on its own cache line; and a slot is reused
//!   only once it has waited behind ~2 MiB of other free slots (oldest first), by when the
//!   shadow thread's core no longer holds its lines, so refilling it does not take them back
//!   from that core one by one.
//! - A canary routes a fraction of decisions with a candidate version. The arm is a stable hash of
//!   the session id (of the request id when there is none, [`canary_arm`]), so a session never
//!   changes arms. The candidate's decisions and fallbacks are counted here; the outcomes (TTFT,
//!   ITL, cached tokens, errors) come from the data path ([`PolicyRegistry::record_outcome`]).
//!   Guardrails roll the canary back (the active version keeps every decision), keeping a record
//!   with the arms' figures at that moment; `promote` makes the candidate active.

pub mod stats;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, Weak};
use std::time::SystemTime;

use arc_swap::{ArcSwap, ArcSwapOption};
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use kvroute_core::candidate::{PolicyRequest, TaintTable};

use crate::answer::Answer;
use crate::bindings::kvroute::policy::types::Request;
use crate::error::{FallbackReason, PolicyError};
use crate::registry::version::PolicyVersion;
use crate::time::rfc3339;
use crate::wire::{device_overlap, Data};
use crate::DecisionContext;

pub use stats::{Difference, Samples, Summary};

/// One of the `known` names a report writes as a `&'static str`, read back (a record another
/// replica wrote, or one kept in a state store); any other name is refused.
pub(crate) fn known_str(s: &str, known: &[&'static str]) -> Result<&'static str, String> {
    known
        .iter()
        .find(|k| **k == s)
        .copied()
        .ok_or_else(|| format!("unknown name {s:?} (one of {known:?})"))
}

const RECORD_OUTCOMES: [&str; 4] = ["rolled_back", "promoted", "stopped", "superseded"];
const RECORD_RULES: [&str; 9] = [
    "ttft_mean",
    "ttft_p90",
    "itl_mean",
    "error_rate",
    "fallback_rate",
    "consecutive_failures",
    "auto_promote",
    "manual",
    "activation",
];

/// A [`CanaryRecord`] as read back.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CanaryRecordWire {
    outcome: String,
    rule: String,
    reason: String,
    ended_at: String,
    evidence: CanaryReport,
}

// By hand: derived, the `&'static str`s would tie it to `'static` input.
impl<'de> Deserialize<'de> for CanaryRecord {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let w = CanaryRecordWire::deserialize(d)?;
        Ok(Self {
            outcome: known_str(&w.outcome, &RECORD_OUTCOMES).map_err(D::Error::custom)?,
            rule: known_str(&w.rule, &RECORD_RULES).map_err(D::Error::custom)?,
            reason: w.reason,
            ended_at: w.ended_at,
            evidence: w.evidence,
        })
    }
}

/// Milliseconds since the Unix epoch of `t` (0 before it).
fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn from_epoch_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms)
}

/// Decisions the shadow queue holds (waiting or being evaluated); past that a sampled decision is
/// dropped (and counted).
pub const SHADOW_QUEUE_CAPACITY: usize = 1024;
/// Evaluated slots the shadow thread hands back at once.
const RETURN_BATCH: usize = 32;
/// Ended canaries kept (the oldest go first).
pub const MAX_RECORDS: usize = 32;

// ---------------------------------------------------------------------------------- arms

/// Which arm of a canary a decision belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// The active version.
    Control,
    /// The canary's candidate version.
    Candidate,
}

impl Arm {
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Control => "control",
            Arm::Candidate => "candidate",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The 64-bit hash that assigns arms: FNV-1a over the key's bytes, finished with splitmix64's
/// mixer. Stable across processes, releases and replicas (the replay uses the same function).
pub fn arm_hash(key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The arm of a decision keyed by `key` (the session id, or the request id when there is none) in
/// a canary of `fraction`: the candidate when the key's hash, as a number in [0, 1), is below the
/// fraction. A key keeps its arm for as long as the fraction does not change.
pub fn canary_arm(key: &str, fraction: f64) -> Arm {
    let u = (arm_hash(key) >> 11) as f64 / (1u64 << 53) as f64;
    if u < fraction {
        Arm::Candidate
    } else {
        Arm::Control
    }
}

/// The key of a request's arm: its session id, or its request id.
pub fn arm_key(req: &PolicyRequest) -> &str {
    req.session_id.as_deref().unwrap_or(&req.request_id)
}

// ---------------------------------------------------------------------------------- specs

fn invalid(field: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError::InvalidRollout {
        field: field.into(),
        message: message.into(),
    }
}

/// Parses JSON into `T`, naming the field at fault.
fn parse<T: serde::de::DeserializeOwned>(json: &str) -> Result<T, PolicyError> {
    let de = &mut serde_json::Deserializer::from_str(json);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        let root = path == "." || path.is_empty();
        // An unknown key is the path's last segment already; a missing one is named in the
        // message only, under the path of its object.
        let field = match msg.strip_prefix("missing field `") {
            Some(rest) => {
                let key = rest.split('`').next().unwrap_or_default();
                if root {
                    key.to_string()
                } else {
                    format!("{path}.{key}")
                }
            }
            None if root => "body".to_string(),
            None => path,
        };
        invalid(field, msg)
    })
}

fn one() -> f64 {
    1.0
}

/// `POST /v1/policies/{name}/shadow`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShadowSpec {
    /// The version to shadow (default: the name's current version).
    #[serde(default)]
    pub version: Option<u64>,
    /// Share of decisions evaluated, in (0, 1] (default 1).
    #[serde(default = "one")]
    pub sample: f64,
}

impl ShadowSpec {
    pub fn from_json(json: &str) -> Result<Self, PolicyError> {
        let s: Self = parse(json)?;
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), PolicyError> {
        if !(self.sample > 0.0 && self.sample <= 1.0) {
            return Err(invalid(
                "sample",
                format!("{} is not in (0, 1]", self.sample),
            ));
        }
        Ok(())
    }
}

/// Limits that roll a canary back.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Guardrails {
    /// Requests with a measured TTFT each arm needs before the latency rules judge (default 30).
    pub min_sample: u64,
    /// Roll back when the candidate's mean TTFT is worse than the control's by more than this
    /// fraction of it, at 95% confidence (the interval's lower end is past it). Default 0.10.
    pub ttft_mean_max_increase: Option<f64>,
    /// The same for the p90 of TTFT (order-statistic interval). Default 0.10.
    pub ttft_p90_max_increase: Option<f64>,
    /// The same for the mean inter-token latency. Default: off.
    pub itl_mean_max_increase: Option<f64>,
    /// Roll back when more than this share of the candidate arm's requests ended in an error
    /// (after `min_sample` requests). Default 0.05.
    pub max_error_rate: Option<f64>,
    /// Roll back when more than this share of the candidate's decisions fell back (after
    /// `min_decisions` decisions). Default 0.05.
    pub max_fallback_rate: Option<f64>,
    /// Candidate decisions before the fallback rule judges (default 20).
    pub min_decisions: u64,
}

impl Default for Guardrails {
    fn default() -> Self {
        Self {
            min_sample: 30,
            ttft_mean_max_increase: Some(0.10),
            ttft_p90_max_increase: Some(0.10),
            itl_mean_max_increase: None,
            max_error_rate: Some(0.05),
            max_fallback_rate: Some(0.05),
            min_decisions: 20,
        }
    }
}

/// Promote the candidate by itself once it wins.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AutoPromote {
    /// Requests with a measured TTFT each arm needs first.
    pub min_sample: u64,
}

/// `POST /v1/policies/{name}/canary`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CanarySpec {
    /// The candidate version (default: the name's current version).
    #[serde(default)]
    pub version: Option<u64>,
    /// Share of sessions routed by the candidate, in (0, 1).
    pub fraction: f64,
    #[serde(default)]
    pub guardrails: Guardrails,
    /// Off unless given.
    #[serde(default)]
    pub auto_promote: Option<AutoPromote>,
}

impl CanarySpec {
    pub fn from_json(json: &str) -> Result<Self, PolicyError> {
        let s: Self = parse(json)?;
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), PolicyError> {
        if !(self.fraction > 0.0 && self.fraction < 1.0) {
            return Err(invalid(
                "fraction",
                format!(
                    "{} is not in (0, 1) (promote to send everything)",
                    self.fraction
                ),
            ));
        }
        let g = &self.guardrails;
        if g.min_sample < 2 {
            return Err(invalid("guardrails.min_sample", "must be at least 2"));
        }
        for (field, v) in [
            (
                "guardrails.ttft_mean_max_increase",
                g.ttft_mean_max_increase,
            ),
            ("guardrails.ttft_p90_max_increase", g.ttft_p90_max_increase),
            ("guardrails.itl_mean_max_increase", g.itl_mean_max_increase),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(invalid(
                    field,
                    "must be a finite fraction >= 0 (or null: off)",
                ));
            }
        }
        for (field, v) in [
            ("guardrails.max_error_rate", g.max_error_rate),
            ("guardrails.max_fallback_rate", g.max_fallback_rate),
        ] {
            if v.is_some_and(|v| !(0.0..=1.0).contains(&v)) {
                return Err(invalid(field, "must be in [0, 1] (or null: off)"));
            }
        }
        if let Some(a) = &self.auto_promote {
            if a.min_sample < 2 {
                return Err(invalid("auto_promote.min_sample", "must be at least 2"));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------- shadow

/// The active policy's answer, as the shadow compares it (its costs are in [`ShadowJob::costs`]).
#[derive(Clone, Copy, Default)]
enum ActiveAnswer {
    Costs,
    Pick(usize),
    #[default]
    Fallback,
}

/// One sampled decision's copy: the decision in its wire form (the packed list the active
/// policy was just called with, one contiguous copy of words the deciding thread has in cache,
/// instead of one copy per column; and the shadow thread calls its policy with it as it is, with
/// no packing of its own). A slot is reused for decision after decision: its buffers keep their
/// capacity, and its `Arc`s stay while the next decision has the same ones.
#[derive(Default)]
struct ShadowJob {
    shadow: Option<Arc<Shadow>>,
    /// The request's scalars as the interface carries them (`None`: the slot is empty).
    wreq: Option<Request>,
    /// The packed `decision-data`.
    words: Vec<u64>,
    taints: Option<Arc<TaintTable>>,
    block_size: u32,
    active: ActiveAnswer,
    costs: Vec<f64>,
}

impl ShadowJob {
    /// Copies one decision into this slot, reusing its buffers.
    fn fill(
        &mut self,
        wreq: Request,
        data: Data<'_>,
        last_taints: &ArcSwapOption<TaintTable>,
        taints: &TaintTable,
        block_size: u32,
        answer: &Result<Answer, FallbackReason>,
    ) {
        self.wreq = Some(wreq);
        self.words.clear();
        self.words.extend_from_slice(data);
        let known = last_taints.load();
        match (&*known, &self.taints) {
            (Some(k), Some(t)) if Arc::ptr_eq(k, t) => {}
            (Some(k), _) => self.taints = Some(k.clone()),
            (None, _) => self.taints = Some(Arc::new(taints.clone())),
        }
        self.block_size = block_size;
        self.active = match answer {
            Ok(Answer::Costs(c)) => {
                self.costs.clear();
                self.costs.extend_from_slice(c);
                ActiveAnswer::Costs
            }
            Ok(Answer::Pick(i)) => ActiveAnswer::Pick(*i),
            Err(_) => ActiveAnswer::Fallback,
        };
    }

    /// About the words its buffers hold room for.
    fn room(&self) -> usize {
        self.words.capacity() + self.costs.capacity()
    }
}

#[derive(Default)]
struct ShadowAcc {
    compared: u64,
    agreed: u64,
    gap_n: u64,
    gap_sum: f64,
    gap_max: f64,
    rel_gap_sum: f64,
    rel_gap_n: u64,
    shadow_overlap: u64,
    active_overlap: u64,
    active_fallbacks: u64,
    evaluated: u64,
    errors: [u64; FallbackReason::ALL.len()],
    latency_ns: u64,
}

/// What the deciding threads count of a shadow (on a cache line of their own).
#[derive(Default)]
struct OfferCounts {
    seq: AtomicU64,
    queued: AtomicU64,
    dropped: AtomicU64,
}

/// One shadowed version and what it was seen to do.
pub struct Shadow {
    policy: Arc<PolicyVersion>,
    sample: f64,
    started_at: SystemTime,
    /// Written by the deciding threads.
    counts: CachePadded<OfferCounts>,
    /// Written by the shadow thread.
    acc: CachePadded<Mutex<ShadowAcc>>,
}

/// A shadow's figures (`GET /v1/policies/{name}/shadow`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ShadowReport {
    pub policy: String,
    pub version: u64,
    pub digest: String,
    pub sample: f64,
    pub started_at: String,
    /// Sampled decisions handed to the queue.
    pub queued: u64,
    /// Sampled decisions dropped because the queue was full.
    pub dropped: u64,
    /// Decisions the shadow version was asked about (so far).
    pub evaluated: u64,
    /// Decisions whose picks were compared (the shadow answered, the active did not fall back).
    pub compared: u64,
    /// Of those, the shadow picked the active policy's candidate.
    pub agreed: u64,
    pub agreement_rate: f64,
    /// Mean of `active_cost[shadow pick] − active_cost[active pick]`, by the active policy's own
    /// costs (decisions where the active one answered costs): how much worse the shadow's pick is
    /// by the active policy's figures.
    pub cost_gap_mean: f64,
    pub cost_gap_max: f64,
    /// The same gap over the active pick's cost (where that is not 0).
    pub cost_gap_relative_mean: f64,
    /// Mean device-overlap blocks of the shadow's pick, and of the active's.
    pub shadow_overlap_blocks_mean: f64,
    pub active_overlap_blocks_mean: f64,
    /// Shadow decisions that failed (would have fallen back), all kinds, and by kind.
    pub fallbacks: u64,
    pub errors_by_kind: std::collections::BTreeMap<&'static str, u64>,
    pub traps: u64,
    pub timeouts: u64,
    /// Decisions not compared because the active policy itself fell back.
    pub active_fallbacks: u64,
    /// Mean time of a shadow call on the background thread, in microseconds.
    pub mean_call_us: f64,
}

impl Shadow {
    fn sampled(&self) -> bool {
        if self.sample >= 1.0 {
            return true;
        }
        // A low-discrepancy sequence: every window of decisions gets its share.
        let n = self.counts.seq.fetch_add(1, Relaxed);
        let u = (n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64;
        u < self.sample
    }

    pub fn version(&self) -> &Arc<PolicyVersion> {
        &self.policy
    }

    fn evaluate(&self, job: &ShadowJob, ticks: u64) {
        let (Some(taints), Some(wreq)) = (&job.taints, job.wreq) else {
            return;
        };
        let ctx = DecisionContext {
            taints,
            block_size: job.block_size,
        };
        let start = std::time::Instant::now();
        let result = self.policy.run(wreq, &job.words, ctx, ticks, false);
        let nanos = start.elapsed().as_nanos() as u64;
        let mut acc = self.acc.lock();
        acc.evaluated += 1;
        acc.latency_ns += nanos;
        let shadow_pick = match result {
            Ok(Answer::Costs(c)) => argmin(&c),
            Ok(Answer::Pick(i)) => i,
            Err(f) => {
                acc.errors[f.reason.index()] += 1;
                return;
            }
        };
        let (active_pick, costs) = match job.active {
            ActiveAnswer::Costs => (argmin(&job.costs), Some(&job.costs)),
            ActiveAnswer::Pick(i) => (i, None),
            ActiveAnswer::Fallback => {
                acc.active_fallbacks += 1;
                return;
            }
        };
        let (Some(shadow_overlap), Some(active_overlap)) = (
            device_overlap(&job.words, shadow_pick),
            device_overlap(&job.words, active_pick),
        ) else {
            return;
        };
        acc.compared += 1;
        acc.agreed += u64::from(shadow_pick == active_pick);
        if let Some(c) = costs {
            let gap = c[shadow_pick] - c[active_pick];
            acc.gap_n += 1;
            acc.gap_sum += gap;
            acc.gap_max = acc.gap_max.max(gap);
            if c[active_pick] != 0.0 {
                acc.rel_gap_n += 1;
                acc.rel_gap_sum += gap / c[active_pick].abs();
            }
        }
        acc.shadow_overlap += u64::from(shadow_overlap);
        acc.active_overlap += u64::from(active_overlap);
    }

    pub fn report(&self) -> ShadowReport {
        let acc = self.acc.lock();
        let div = |a: f64, b: u64| if b == 0 { 0.0 } else { a / b as f64 };
        let errors_by_kind: std::collections::BTreeMap<&'static str, u64> = FallbackReason::ALL
            .iter()
            .filter(|r| acc.errors[r.index()] > 0)
            .map(|r| (r.as_str(), acc.errors[r.index()]))
            .collect();
        ShadowReport {
            policy: self.policy.name().to_string(),
            version: self.policy.version(),
            digest: self.policy.digest().to_string(),
            sample: self.sample,
            started_at: rfc3339(self.started_at),
            queued: self.counts.queued.load(Relaxed),
            dropped: self.counts.dropped.load(Relaxed),
            evaluated: acc.evaluated,
            compared: acc.compared,
            agreed: acc.agreed,
            agreement_rate: div(acc.agreed as f64, acc.compared),
            cost_gap_mean: div(acc.gap_sum, acc.gap_n),
            cost_gap_max: acc.gap_max,
            cost_gap_relative_mean: div(acc.rel_gap_sum, acc.rel_gap_n),
            shadow_overlap_blocks_mean: div(acc.shadow_overlap as f64, acc.compared),
            active_overlap_blocks_mean: div(acc.active_overlap as f64, acc.compared),
            fallbacks: acc.errors.iter().sum(),
            traps: acc.errors[FallbackReason::Trap.index()]
                + acc.errors[FallbackReason::MemoryLimit.index()],
            timeouts: acc.errors[FallbackReason::Deadline.index()],
            errors_by_kind,
            active_fallbacks: acc.active_fallbacks,
            mean_call_us: div(acc.latency_ns as f64 / 1000.0, acc.evaluated),
        }
    }
}

/// The index of the lowest cost (the first on ties): the pick at temperature 0.
fn argmin(c: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in c.iter().enumerate() {
        if x < c[best] {
            best = i;
        }
    }
    best
}

// ---------------------------------------------------------------------------------- canary

/// What the data path learned about one request (`PolicyRegistry::record_outcome`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    /// Time to the answer's first byte (streamed: the first token), in milliseconds; `None` when
    /// no byte came.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency of a streamed answer, in milliseconds (with two tokens or more).
    pub itl_ms: Option<f64>,
    /// The engine's `usage.prompt_tokens_details.cached_tokens`, when it reported it.
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: u64,
    /// The request failed on the engine's side (an error status, a broken stream, a timeout).
    pub error: bool,
    /// The decision fell back to the native cost.
    pub fallback: bool,
}

#[derive(Clone, Debug, Default)]
struct ArmOutcomes {
    requests: u64,
    errors: u64,
    fallbacks: u64,
    ttft: Samples,
    itl: Samples,
    cached: Samples,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// One arm as reported.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ArmReport {
    pub policy: String,
    pub version: u64,
    /// Decisions routed in this arm (each step of a disaggregated request counts).
    pub decisions: u64,
    /// Of those, fell back to the native cost.
    pub decision_fallbacks: u64,
    pub fallback_rate: f64,
    /// Requests whose outcome the data path reported.
    pub requests: u64,
    pub errors: u64,
    pub error_rate: f64,
    pub ttft_ms: Summary,
    pub itl_ms: Summary,
    pub cached_tokens: Summary,
    /// Engine-reported cached tokens over prompt tokens (requests that reported both).
    pub cached_token_ratio: f64,
}

/// Candidate minus control, figure by figure (absent until both arms have 2 samples).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Differences {
    pub ttft_mean_ms: Option<Difference>,
    pub ttft_p90_ms: Option<Difference>,
    pub itl_mean_ms: Option<Difference>,
    pub cached_tokens_mean: Option<Difference>,
    pub error_rate: Option<Difference>,
    pub fallback_rate: Option<Difference>,
}

/// A canary as reported (`GET /v1/policies/{name}/canary`), live or in a record.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CanaryReport {
    pub id: u64,
    pub policy: String,
    pub version: u64,
    pub fraction: f64,
    pub started_at: String,
    pub guardrails: Guardrails,
    pub auto_promote: Option<AutoPromote>,
    pub control: ArmReport,
    pub candidate: ArmReport,
    pub differences: Differences,
}

/// How a canary ended.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CanaryRecord {
    /// `rolled_back` (a guardrail), `promoted`, `stopped` (DELETE), `superseded` (another
    /// version was activated meanwhile).
    pub outcome: &'static str,
    /// The guardrail or action: `ttft_mean`, `ttft_p90`, `itl_mean`, `error_rate`,
    /// `fallback_rate`, `consecutive_failures`, `auto_promote`, `manual`, `activation`.
    pub rule: &'static str,
    pub reason: String,
    pub ended_at: String,
    /// The arms' figures at that moment.
    pub evidence: CanaryReport,
}

/// A running canary.
pub struct Canary {
    id: u64,
    pub(crate) candidate: Arc<PolicyVersion>,
    pub(crate) control: Arc<PolicyVersion>,
    spec: CanarySpec,
    started_at: SystemTime,
    /// This replica's decisions (the request path counts them here).
    decisions: [AtomicU64; 2],
    fallbacks: [AtomicU64; 2],
    /// The other replicas' decisions, merged from their outcome batches.
    remote_decisions: [AtomicU64; 2],
    remote_fallbacks: [AtomicU64; 2],
    /// This replica's decisions already handed to [`Canary::take_batch`].
    sent: Mutex<[(u64, u64); 2]>,
    pub(crate) consecutive: AtomicU32,
    /// Every replica's outcomes (this one's and the merged batches').
    outcomes: Mutex<[ArmOutcomes; 2]>,
    /// This replica's outcomes not yet handed to the publisher (cluster mode only).
    unsent: Option<Mutex<Unsent>>,
    /// Everything this replica published of this canary, for a replica that takes it up later.
    published: Mutex<Published>,
    ended: AtomicBool,
}

/// Outcomes waiting for the publisher, and those it had no room for.
#[derive(Default)]
struct Unsent {
    arms: [ArmDelta; 2],
    outcomes: usize,
    dropped: u64,
}

/// This replica's published outcomes of a canary, whole (samples up to [`SNAPSHOT_SAMPLES`] per
/// arm and figure), and the number of the last message they include.
#[derive(Default)]
struct Published {
    arms: [ArmDelta; 2],
    seq: u64,
    changed: bool,
}

/// Samples per arm and figure a replica's snapshot of its published outcomes carries (the counts
/// are whole; past this many, a later replica's figures for it rest on the first ones).
pub const SNAPSHOT_SAMPLES: usize = 10_000;

/// Outcomes a batch carries at most; past that (the publisher is stuck) an outcome is counted
/// here but not shared, and the batch says how many were left out.
pub const MAX_UNSENT_OUTCOMES: usize = 20_000;

/// One arm's new outcomes and decisions on one replica, as shared with the others.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArmDelta {
    pub decisions: u64,
    pub decision_fallbacks: u64,
    pub requests: u64,
    pub errors: u64,
    pub fallbacks: u64,
    /// Each request's TTFT (ms), ITL (ms) and engine-reported cached tokens, when measured.
    pub ttft: Vec<f64>,
    pub itl: Vec<f64>,
    pub cached: Vec<f64>,
    /// Sums for the cached-token ratio (requests that reported both).
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
}

impl ArmDelta {
    fn is_empty(&self) -> bool {
        self.decisions == 0 && self.requests == 0
    }

    /// Adds `other` (samples up to [`SNAPSHOT_SAMPLES`] per figure).
    fn absorb(&mut self, other: &ArmDelta) {
        self.decisions += other.decisions;
        self.decision_fallbacks += other.decision_fallbacks;
        self.requests += other.requests;
        self.errors += other.errors;
        self.fallbacks += other.fallbacks;
        for (dst, src) in [
            (&mut self.ttft, &other.ttft),
            (&mut self.itl, &other.itl),
            (&mut self.cached, &other.cached),
        ] {
            let room = SNAPSHOT_SAMPLES.saturating_sub(dst.len());
            dst.extend(src.iter().take(room));
        }
        self.cached_tokens += other.cached_tokens;
        self.prompt_tokens += other.prompt_tokens;
    }

    fn push(&mut self, out: &RequestOutcome) {
        self.requests += 1;
        self.errors += u64::from(out.error);
        self.fallbacks += u64::from(out.fallback);
        if let Some(t) = out.ttft_ms {
            self.ttft.push(t);
        }
        if let Some(t) = out.itl_ms {
            self.itl.push(t);
        }
        if let Some(c) = out.cached_tokens {
            self.cached.push(c as f64);
            self.cached_tokens += c;
            self.prompt_tokens += out.prompt_tokens;
        }
    }
}

/// A replica's new outcomes of one canary since its last batch (`PolicyRegistry::
/// take_outcome_batch`), merged by the others (`PolicyRegistry::merge_outcome_batch`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeBatch {
    /// The canary's id (the same on every replica).
    pub canary: u64,
    /// Control, candidate.
    pub arms: [ArmDelta; 2],
    /// Outcomes the replica measured but could not fit in its batches (counted, not shared).
    pub dropped: u64,
}

impl OutcomeBatch {
    /// Outcomes (requests) it carries.
    pub fn requests(&self) -> u64 {
        self.arms.iter().map(|a| a.requests).sum()
    }
}

/// The rollout state as kept in a state store and shared between replicas: what runs (the
/// shadows' and the canary's specs) and how the last canaries ended. The figures are not in it:
/// they travel as [`OutcomeBatch`]es.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutImage {
    #[serde(default)]
    pub shadows: Vec<ShadowImage>,
    #[serde(default)]
    pub canary: Option<CanaryImage>,
    /// Ended canaries, oldest first (at most [`MAX_RECORDS`]).
    #[serde(default)]
    pub records: Vec<CanaryRecord>,
}

/// A running shadow's spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowImage {
    pub name: String,
    pub version: u64,
    pub sample: f64,
    pub started_at_ms: u64,
}

/// The running canary's spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CanaryImage {
    pub id: u64,
    pub name: String,
    pub version: u64,
    /// The version active when it started (its control arm).
    pub control: String,
    pub control_version: u64,
    pub spec: CanarySpec,
    pub started_at_ms: u64,
}

/// What a replica should hold after reading `stored` (the store's rollout record, newer than
/// `written`, the last one this replica wrote or applied), given what it holds now (`local`).
///
/// The store's record wins, except for canaries this replica ended itself and has not written
/// yet (a guardrail fired here; their records are in `local` but not in `written`): those stay
/// ended, with their records, unless the store already has a record of them, which then wins
/// (two replicas deciding at once: the first written is the one every replica keeps). Returns
/// the image to hold, and the records of this replica's promotions the store's record overrode
/// (the promotion must be undone here).
pub fn merge_rollout(
    stored: &RolloutImage,
    local: &RolloutImage,
    written: &RolloutImage,
) -> (RolloutImage, Vec<CanaryRecord>) {
    let ids = |r: &[CanaryRecord]| r.iter().map(|r| r.evidence.id).collect::<Vec<_>>();
    let (written_ids, stored_ids) = (ids(&written.records), ids(&stored.records));
    let pending: Vec<&CanaryRecord> = local
        .records
        .iter()
        .filter(|r| !written_ids.contains(&r.evidence.id))
        .collect();
    let mut out = stored.clone();
    let mut overridden = Vec::new();
    for r in pending {
        match stored
            .records
            .iter()
            .find(|s| s.evidence.id == r.evidence.id)
        {
            Some(s) => {
                if r.outcome == "promoted" && s.outcome != "promoted" {
                    overridden.push(r.clone());
                }
            }
            None => {
                if out.canary.as_ref().is_some_and(|c| c.id == r.evidence.id) {
                    out.canary = None;
                }
                if !stored_ids.contains(&r.evidence.id) {
                    out.records.push(r.clone());
                }
            }
        }
    }
    while out.records.len() > MAX_RECORDS {
        out.records.remove(0);
    }
    (out, overridden)
}

impl Canary {
    pub(crate) fn arm_of(&self, req: &PolicyRequest) -> Arm {
        canary_arm(arm_key(req), self.spec.fraction)
    }

    /// Counts a decision of this replica; every replica's decisions and fallbacks in `arm` so far.
    pub(crate) fn count_decision(&self, arm: Arm, fallback: bool) -> (u64, u64) {
        let i = arm.index();
        let d = self.decisions[i].fetch_add(1, Relaxed) + 1;
        let f = if fallback {
            self.fallbacks[i].fetch_add(1, Relaxed) + 1
        } else {
            self.fallbacks[i].load(Relaxed)
        };
        (
            d + self.remote_decisions[i].load(Relaxed),
            f + self.remote_fallbacks[i].load(Relaxed),
        )
    }

    /// Every replica's decisions and fallbacks in arm `i`.
    fn fleet_decisions(&self, i: usize) -> (u64, u64) {
        (
            self.decisions[i].load(Relaxed) + self.remote_decisions[i].load(Relaxed),
            self.fallbacks[i].load(Relaxed) + self.remote_fallbacks[i].load(Relaxed),
        )
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The spec as kept in a state store.
    pub fn image(&self) -> CanaryImage {
        CanaryImage {
            id: self.id,
            name: self.candidate.name().to_string(),
            version: self.candidate.version(),
            control: self.control.name().to_string(),
            control_version: self.control.version(),
            spec: self.spec.clone(),
            started_at_ms: epoch_ms(self.started_at),
        }
    }

    /// This replica's outcomes and decisions since the last batch (cluster mode), or `None` when
    /// there are none.
    pub(crate) fn take_batch(&self) -> Option<OutcomeBatch> {
        let unsent = self.unsent.as_ref()?;
        let (mut arms, dropped) = {
            let mut u = unsent.lock();
            u.outcomes = 0;
            (std::mem::take(&mut u.arms), std::mem::take(&mut u.dropped))
        };
        {
            let mut sent = self.sent.lock();
            for (i, a) in arms.iter_mut().enumerate() {
                let (d, f) = (
                    self.decisions[i].load(Relaxed),
                    self.fallbacks[i].load(Relaxed),
                );
                a.decisions = d - sent[i].0;
                a.decision_fallbacks = f - sent[i].1;
                sent[i] = (d, f);
            }
        }
        if arms.iter().all(ArmDelta::is_empty) && dropped == 0 {
            return None;
        }
        Some(OutcomeBatch {
            canary: self.id,
            arms,
            dropped,
        })
    }

    /// Notes that this replica's message `seq` carried `batch` (published).
    pub(crate) fn note_published(&self, seq: u64, batch: &OutcomeBatch) {
        let mut p = self.published.lock();
        for (dst, src) in p.arms.iter_mut().zip(&batch.arms) {
            dst.absorb(src);
        }
        p.seq = seq;
        p.changed = true;
    }

    /// Everything this replica published, if it changed since the last call: the last message's
    /// number, and the outcomes as one batch.
    pub(crate) fn published_snapshot(&self) -> Option<(u64, OutcomeBatch)> {
        let mut p = self.published.lock();
        if !std::mem::take(&mut p.changed) {
            return None;
        }
        Some((
            p.seq,
            OutcomeBatch {
                canary: self.id,
                arms: p.arms.clone(),
                dropped: 0,
            },
        ))
    }

    /// Merges another replica's batch and judges the guardrails on every replica's figures.
    pub(crate) fn merge(&self, batch: &OutcomeBatch) -> Option<(Verdict, CanaryReport)> {
        for (i, a) in batch.arms.iter().enumerate() {
            self.remote_decisions[i].fetch_add(a.decisions, Relaxed);
            self.remote_fallbacks[i].fetch_add(a.decision_fallbacks, Relaxed);
        }
        let mut o = self.outcomes.lock();
        for (dst, a) in o.iter_mut().zip(&batch.arms) {
            dst.requests += a.requests;
            dst.errors += a.errors;
            dst.fallbacks += a.fallbacks;
            for &t in &a.ttft {
                dst.ttft.push(t);
            }
            for &t in &a.itl {
                dst.itl.push(t);
            }
            for &c in &a.cached {
                dst.cached.push(c);
            }
            dst.cached_tokens += a.cached_tokens;
            dst.prompt_tokens += a.prompt_tokens;
        }
        let (d, f) = self.fleet_decisions(Arm::Candidate.index());
        let verdict = self
            .outcome_verdict(&o, true)
            .or_else(|| self.decision_verdict(d, f))?;
        Some((verdict, self.report_of(&o)))
    }

    pub fn spec(&self) -> &CanarySpec {
        &self.spec
    }

    pub fn candidate(&self) -> &Arc<PolicyVersion> {
        &self.candidate
    }

    pub fn control(&self) -> &Arc<PolicyVersion> {
        &self.control
    }

    /// The arm whose version is `name`/`version`.
    fn arm_named(&self, name: &str, version: u64) -> Option<Arm> {
        if self.candidate.name() == name && self.candidate.version() == version {
            Some(Arm::Candidate)
        } else if self.control.name() == name && self.control.version() == version {
            Some(Arm::Control)
        } else {
            None
        }
    }

    fn arm_report(&self, arm: Arm, o: &ArmOutcomes) -> ArmReport {
        let v = match arm {
            Arm::Control => &self.control,
            Arm::Candidate => &self.candidate,
        };
        let (d, f) = self.fleet_decisions(arm.index());
        let div = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        ArmReport {
            policy: v.name().to_string(),
            version: v.version(),
            decisions: d,
            decision_fallbacks: f,
            fallback_rate: div(f, d),
            requests: o.requests,
            errors: o.errors,
            error_rate: div(o.errors, o.requests),
            ttft_ms: o.ttft.summary(),
            itl_ms: o.itl.summary(),
            cached_tokens: o.cached.summary(),
            cached_token_ratio: div(o.cached_tokens, o.prompt_tokens),
        }
    }

    fn report_of(&self, o: &[ArmOutcomes; 2]) -> CanaryReport {
        let (k, c) = (&o[0], &o[1]);
        let ((kd, kf), (cd, cf)) = (self.fleet_decisions(0), self.fleet_decisions(1));
        let differences = Differences {
            ttft_mean_ms: stats::mean_difference(&c.ttft, &k.ttft),
            ttft_p90_ms: stats::p90_difference(&c.ttft, &k.ttft),
            itl_mean_ms: stats::mean_difference(&c.itl, &k.itl),
            cached_tokens_mean: stats::mean_difference(&c.cached, &k.cached),
            error_rate: stats::rate_difference(c.errors, c.requests, k.errors, k.requests),
            fallback_rate: stats::rate_difference(cf, cd, kf, kd),
        };
        CanaryReport {
            id: self.id,
            policy: self.candidate.name().to_string(),
            version: self.candidate.version(),
            fraction: self.spec.fraction,
            started_at: rfc3339(self.started_at),
            guardrails: self.spec.guardrails.clone(),
            auto_promote: self.spec.auto_promote.clone(),
            control: self.arm_report(Arm::Control, k),
            candidate: self.arm_report(Arm::Candidate, c),
            differences,
        }
    }

    pub fn report(&self) -> CanaryReport {
        let o = self.outcomes.lock();
        self.report_of(&o)
    }

    /// The guardrail the candidate's decisions break, if any (fallback rate).
    pub(crate) fn decision_verdict(&self, decisions: u64, fallbacks: u64) -> Option<Verdict> {
        let g = &self.spec.guardrails;
        let max = g.max_fallback_rate?;
        if decisions >= g.min_decisions && fallbacks as f64 > max * decisions as f64 {
            return Some(Verdict::RollBack(
                "fallback_rate",
                format!(
                    "{fallbacks} of the candidate's {decisions} decisions fell back, over max_fallback_rate {max}"
                ),
            ));
        }
        None
    }

    /// Records an outcome and judges the guardrails (and auto-promotion).
    fn record(&self, arm: Arm, out: &RequestOutcome) -> Option<(Verdict, CanaryReport)> {
        let mut o = self.outcomes.lock();
        let a = &mut o[arm.index()];
        a.requests += 1;
        a.errors += u64::from(out.error);
        a.fallbacks += u64::from(out.fallback);
        if let Some(t) = out.ttft_ms {
            a.ttft.push(t);
        }
        if let Some(t) = out.itl_ms {
            a.itl.push(t);
        }
        if let Some(c) = out.cached_tokens {
            a.cached.push(c as f64);
            a.cached_tokens += c;
            a.prompt_tokens += out.prompt_tokens;
        }
        if let Some(unsent) = &self.unsent {
            let mut u = unsent.lock();
            if u.outcomes < MAX_UNSENT_OUTCOMES {
                u.outcomes += 1;
                u.arms[arm.index()].push(out);
            } else {
                u.dropped += 1;
            }
        }
        let verdict = self.outcome_verdict(&o, false)?;
        Some((verdict, self.report_of(&o)))
    }

    /// `every`: judge the p90 now whatever the count (a merged batch moves it by many).
    fn outcome_verdict(&self, o: &[ArmOutcomes; 2], every: bool) -> Option<Verdict> {
        let g = &self.spec.guardrails;
        let (k, c) = (&o[0], &o[1]);
        if let Some(max) = g.max_error_rate {
            if c.requests >= g.min_sample && c.errors as f64 > max * c.requests as f64 {
                return Some(Verdict::RollBack(
                    "error_rate",
                    format!(
                        "{} of the candidate's {} requests failed, over max_error_rate {max}",
                        c.errors, c.requests
                    ),
                ));
            }
        }
        let enough =
            |s: &Samples, t: &Samples| s.count() >= g.min_sample && t.count() >= g.min_sample;
        let worse = |rule: &'static str,
                     what: &str,
                     d: Option<Difference>,
                     max: f64,
                     control: f64| {
            let d = d?;
            (d.ci95[0] > max * control).then(|| {
                Verdict::RollBack(
                    rule,
                    format!(
                        "the candidate's {what} is worse by {:.3} ms ({:+.1}%, 95% interval [{:.3}, {:.3}] ms, n = {} / {}), over the allowed {:.1}%",
                        d.difference,
                        d.relative * 100.0,
                        d.ci95[0],
                        d.ci95[1],
                        d.n[0],
                        d.n[1],
                        max * 100.0
                    ),
                )
            })
        };
        if enough(&c.ttft, &k.ttft) {
            if let Some(max) = g.ttft_mean_max_increase {
                if let Some(v) = worse(
                    "ttft_mean",
                    "mean TTFT",
                    stats::mean_difference(&c.ttft, &k.ttft),
                    max,
                    k.ttft.mean(),
                ) {
                    return Some(v);
                }
            }
            // The p90 sorts the samples: judged on every outcome while they are few, then on
            // about one in a hundred.
            let total = c.ttft.count() + k.ttft.count();
            if let Some(max) = g.ttft_p90_max_increase {
                if every || total % (total / 100).max(1) == 0 {
                    let control = k.ttft.quantile_ci(0.9).0;
                    if let Some(v) = worse(
                        "ttft_p90",
                        "p90 TTFT",
                        stats::p90_difference(&c.ttft, &k.ttft),
                        max,
                        control,
                    ) {
                        return Some(v);
                    }
                }
            }
        }
        if let Some(max) = g.itl_mean_max_increase {
            if enough(&c.itl, &k.itl) {
                if let Some(v) = worse(
                    "itl_mean",
                    "mean ITL",
                    stats::mean_difference(&c.itl, &k.itl),
                    max,
                    k.itl.mean(),
                ) {
                    return Some(v);
                }
            }
        }
        if let Some(p) = &self.spec.auto_promote {
            if c.ttft.count() >= p.min_sample && k.ttft.count() >= p.min_sample {
                if let Some(d) = stats::mean_difference(&c.ttft, &k.ttft) {
                    if d.ci95[1] < 0.0 {
                        return Some(Verdict::Promote(format!(
                            "the candidate's mean TTFT is better by {:.3} ms ({:+.1}%, 95% interval [{:.3}, {:.3}] ms, n = {} / {})",
                            -d.difference,
                            d.relative * 100.0,
                            d.ci95[0],
                            d.ci95[1],
                            d.n[0],
                            d.n[1]
                        )));
                    }
                }
            }
        }
        None
    }
}

/// What a guardrail decided.
#[derive(Clone, Debug)]
pub(crate) enum Verdict {
    RollBack(&'static str, String),
    Promote(String),
}

// ---------------------------------------------------------------------------------- state

/// Registry-wide rollout counters.
#[derive(Debug, Default)]
pub struct RolloutCounters {
    pub canaries_started: AtomicU64,
    /// Canaries rolled back by a guardrail.
    pub rollbacks: AtomicU64,
    /// Candidates promoted (by hand or automatically).
    pub promotions: AtomicU64,
    /// Of those, automatically.
    pub auto_promotions: AtomicU64,
}

/// The registry's rollout state.
pub(crate) struct Rollout {
    /// Shadows by policy name (one each).
    pub shadows: ArcSwap<Vec<Arc<Shadow>>>,
    pub canary: ArcSwapOption<Canary>,
    pub records: Mutex<VecDeque<(String, CanaryRecord)>>,
    /// The shadow queue and its spare slots. A plain locked list the shadow thread polls (every
    /// millisecond when empty) and empties at once: a channel would wake the sleeping thread on
    /// every send, a system call on the deciding thread.
    queue: Arc<CachePadded<Mutex<ShadowQueue>>>,
    worker: OnceLock<()>,
    pub counters: RolloutCounters,
    pub(crate) next_id: AtomicU64,
    /// Cluster mode: canaries keep their outcomes for the publisher ([`Canary::take_batch`]).
    pub share: AtomicBool,
    /// A canary the shared state runs that this replica cannot (its versions are not the ones
    /// loaded and active here): kept as is, so this replica's writes do not end it everywhere.
    pub held: Mutex<Option<CanaryImage>>,
    /// The same for shadows.
    pub held_shadows: Mutex<Vec<ShadowImage>>,
}

/// The rollout state at one moment, to undo an operation ([`crate::Checkpoint`]).
pub(crate) struct RolloutCheckpoint {
    shadows: Arc<Vec<Arc<Shadow>>>,
    canary: Option<Arc<Canary>>,
    records: VecDeque<(String, CanaryRecord)>,
    held: Option<CanaryImage>,
    held_shadows: Vec<ShadowImage>,
}

impl Default for Rollout {
    fn default() -> Self {
        Self {
            shadows: ArcSwap::from_pointee(Vec::new()),
            canary: ArcSwapOption::empty(),
            records: Mutex::new(VecDeque::new()),
            queue: Arc::new(CachePadded::new(Mutex::new(ShadowQueue::default()))),
            worker: OnceLock::new(),
            counters: RolloutCounters::default(),
            next_id: AtomicU64::new(1),
            share: AtomicBool::new(false),
            held: Mutex::new(None),
            held_shadows: Mutex::new(Vec::new()),
        }
    }
}

/// The shadow queue and the slots that carry it. Boxed: a slot (~20 `Vec` headers) moves between
/// the lists as one pointer.
#[derive(Default)]
#[allow(clippy::vec_box)]
struct ShadowQueue {
    /// Copies waiting for the shadow thread, oldest first.
    pending: Vec<Box<ShadowJob>>,
    /// Evaluated slots, kept for the next copies, the longest-evaluated first.
    free: VecDeque<Box<ShadowJob>>,
    /// Words the free slots' buffers hold room for.
    free_words: usize,
    /// Slots that exist (waiting, being evaluated or free): at most [`SHADOW_QUEUE_CAPACITY`].
    slots: usize,
}

impl ShadowQueue {
    /// A slot for the next copy: the free slot evaluated longest ago, once the free slots hold
    /// [`REUSE_AFTER_WORDS`] (until then a new one, while fewer than the capacity exist). Reusing
    /// the slot evaluated last (a stack) made the deciding thread write into lines the shadow
    /// thread's core had just read, each taken back from that core: 0.1 to 0.4 µs more at the
    /// p50 (2026-12-02, BENCHMARKS.md).
    fn take(&mut self) -> Slot {
        if self.free_words < REUSE_AFTER_WORDS && self.slots < SHADOW_QUEUE_CAPACITY {
            self.slots += 1;
            return Slot::New;
        }
        match self.free.pop_front() {
            Some(job) => {
                self.free_words = self.free_words.saturating_sub(job.room());
                Slot::Reused(job)
            }
            None if self.slots < SHADOW_QUEUE_CAPACITY => {
                self.slots += 1;
                Slot::New
            }
            None => Slot::Full,
        }
    }

    /// Hands evaluated slots back (boxed: a slot moves as one pointer).
    #[allow(clippy::vec_box)]
    fn give_back(&mut self, done: &mut Vec<Box<ShadowJob>>) {
        for job in done.drain(..) {
            self.free_words += job.room();
            self.free.push_back(job);
        }
    }
}

/// Words of free slots kept before one is reused: 2 MiB, more than a core's own cache (1 MiB of L2
/// on the machine measured). The slots exist anyway while the shadow thread falls behind; the
/// idle shadow thread frees them after a second.
const REUSE_AFTER_WORDS: usize = (2 << 20) / 8;

/// A slot for a copy, or why there is none.
enum Slot {
    Reused(Box<ShadowJob>),
    /// None free, and fewer than the capacity exist: make one (counted already).
    New,
    Full,
}

impl Rollout {
    /// Starts the shadow thread on first use. It ends once the registry (and its queue) is gone.
    fn start_worker(&self, ticks: u64) {
        self.worker.get_or_init(|| {
            let queue = Arc::downgrade(&self.queue);
            let spawned = std::thread::Builder::new()
                .name("kvroute-policy-shadow".into())
                .spawn(move || shadow_thread(queue, ticks));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "could not start the shadow thread: shadows evaluate nothing");
            }
        });
    }

    /// Hands a sampled decision to every shadow (except the version that decided). Never blocks
    /// (beyond the queue's lock, held for a few pointer moves) and, once the slots exist, never
    /// allocates.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn offer(
        &self,
        decided_by: &Arc<PolicyVersion>,
        wreq: Request,
        data: Data<'_>,
        has_base_cost: bool,
        last_taints: &ArcSwapOption<TaintTable>,
        taints: &TaintTable,
        block_size: u32,
        answer: &Result<Answer, FallbackReason>,
        ticks: u64,
    ) {
        let shadows = self.shadows.load();
        if shadows.is_empty() {
            return;
        }
        for s in shadows.iter() {
            if Arc::ptr_eq(&s.policy, decided_by) || !s.sampled() {
                continue;
            }
            // Started after the router asked whether anyone reads the base cost: this
            // decision's columns came without it, which this shadow reads.
            if !has_base_cost && s.policy.reads_base_cost() {
                continue;
            }
            let slot = {
                let mut q = self.queue.lock();
                q.take()
            };
            let mut job = match slot {
                Slot::Reused(job) => job,
                Slot::New => Box::default(),
                Slot::Full => {
                    s.counts.dropped.fetch_add(1, Relaxed);
                    continue;
                }
            };
            if !job.shadow.as_ref().is_some_and(|j| Arc::ptr_eq(j, s)) {
                job.shadow = Some(s.clone());
            }
            job.fill(wreq, data, last_taints, taints, block_size, answer);
            self.queue.lock().pending.push(job);
            s.counts.queued.fetch_add(1, Relaxed);
        }
        self.start_worker(ticks);
    }

    /// Lets go of the shadow `Arc`s the free slots keep (a stopped shadow's version is not kept
    /// alive by them).
    pub(crate) fn forget_shadows(&self) {
        let mut q = self.queue.lock();
        for job in q.free.iter_mut() {
            job.shadow = None;
        }
    }

    pub(crate) fn new_shadow(&self, policy: Arc<PolicyVersion>, sample: f64) -> Arc<Shadow> {
        self.new_shadow_at(policy, sample, SystemTime::now())
    }

    pub(crate) fn new_shadow_at(
        &self,
        policy: Arc<PolicyVersion>,
        sample: f64,
        started_at: SystemTime,
    ) -> Arc<Shadow> {
        Arc::new(Shadow {
            policy,
            sample,
            started_at: from_epoch_ms(epoch_ms(started_at)),
            counts: CachePadded::new(OfferCounts::default()),
            acc: CachePadded::new(Mutex::new(ShadowAcc::default())),
        })
    }

    pub(crate) fn new_canary(
        &self,
        candidate: Arc<PolicyVersion>,
        control: Arc<PolicyVersion>,
        spec: CanarySpec,
    ) -> Arc<Canary> {
        // Above every id this replica knows of (ended ones too): ids stay unique in a cluster
        // as long as its replicas share the state (two starting at once: one write is refused).
        let known = self
            .records
            .lock()
            .iter()
            .map(|(_, r)| r.evidence.id)
            .chain(self.held.lock().as_ref().map(|c| c.id))
            .max()
            .unwrap_or(0);
        self.next_id.fetch_max(known + 1, Relaxed);
        let id = self.next_id.fetch_add(1, Relaxed);
        self.canary_with(id, candidate, control, spec, SystemTime::now())
    }

    pub(crate) fn canary_with(
        &self,
        id: u64,
        candidate: Arc<PolicyVersion>,
        control: Arc<PolicyVersion>,
        spec: CanarySpec,
        started_at: SystemTime,
    ) -> Arc<Canary> {
        self.next_id.fetch_max(id + 1, Relaxed);
        Arc::new(Canary {
            id,
            candidate,
            control,
            spec,
            // Kept to the millisecond, as a state store keeps it.
            started_at: from_epoch_ms(epoch_ms(started_at)),
            decisions: Default::default(),
            fallbacks: Default::default(),
            remote_decisions: Default::default(),
            remote_fallbacks: Default::default(),
            sent: Mutex::new(Default::default()),
            consecutive: AtomicU32::new(0),
            outcomes: Mutex::new(Default::default()),
            unsent: self
                .share
                .load(Relaxed)
                .then(|| Mutex::new(Unsent::default())),
            published: Mutex::new(Published::default()),
            ended: AtomicBool::new(false),
        })
    }

    /// The state as kept in a store (shadows by name, so two replicas holding the same ones
    /// write the same image).
    pub(crate) fn image(&self) -> RolloutImage {
        let mut shadows: Vec<ShadowImage> = self
            .shadows
            .load()
            .iter()
            .map(|s| ShadowImage {
                name: s.policy.name().to_string(),
                version: s.policy.version(),
                sample: s.sample,
                started_at_ms: epoch_ms(s.started_at),
            })
            .chain(self.held_shadows.lock().iter().cloned())
            .collect();
        shadows.sort_by(|a, b| a.name.cmp(&b.name));
        RolloutImage {
            shadows,
            canary: self
                .canary
                .load_full()
                .map(|c| c.image())
                .or_else(|| self.held.lock().clone()),
            records: self.records.lock().iter().map(|(_, r)| r.clone()).collect(),
        }
    }

    pub(crate) fn checkpoint(&self) -> RolloutCheckpoint {
        RolloutCheckpoint {
            shadows: self.shadows.load_full(),
            canary: self.canary.load_full(),
            records: self.records.lock().clone(),
            held: self.held.lock().clone(),
            held_shadows: self.held_shadows.lock().clone(),
        }
    }

    /// Puts the state back as it was at `c` (a canary ended since runs again).
    pub(crate) fn revert(&self, c: RolloutCheckpoint) {
        self.shadows.store(c.shadows);
        if let Some(canary) = &c.canary {
            canary.ended.store(false, Relaxed);
        }
        self.canary.store(c.canary);
        *self.records.lock() = c.records;
        *self.held.lock() = c.held;
        *self.held_shadows.lock() = c.held_shadows;
        self.forget_shadows();
    }

    /// Takes `canary` out (if it still runs) and keeps its record. False if it had ended already.
    pub(crate) fn end(
        &self,
        canary: &Arc<Canary>,
        outcome: &'static str,
        rule: &'static str,
        reason: String,
        evidence: Option<CanaryReport>,
    ) -> Option<CanaryRecord> {
        if canary.ended.swap(true, Relaxed) {
            return None;
        }
        let current = self.canary.load();
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, canary)) {
            self.canary.compare_and_swap(&*current, None);
        }
        let evidence = evidence.unwrap_or_else(|| canary.report());
        let record = CanaryRecord {
            outcome,
            rule,
            reason,
            ended_at: rfc3339(SystemTime::now()),
            evidence,
        };
        let mut records = self.records.lock();
        records.push_back((canary.candidate.name().to_string(), record.clone()));
        while records.len() > MAX_RECORDS {
            records.pop_front();
        }
        Some(record)
    }

    /// Takes `canary` out without a record (the shared state ended or replaced it; its record,
    /// if any, comes with that state).
    pub(crate) fn end_quietly(&self, canary: &Arc<Canary>) {
        canary.ended.store(true, Relaxed);
        let current = self.canary.load();
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, canary)) {
            self.canary.compare_and_swap(&*current, None);
        }
    }

    /// Records an outcome in the running canary; the verdict (with the evidence) if one is due.
    pub(crate) fn record(
        &self,
        policy: &str,
        version: u64,
        outcome: &RequestOutcome,
    ) -> Option<(Arc<Canary>, Verdict, CanaryReport)> {
        let canary = self.canary.load_full()?;
        if canary.ended.load(Relaxed) {
            return None;
        }
        let arm = canary.arm_named(policy, version)?;
        let (verdict, report) = canary.record(arm, outcome)?;
        Some((canary, verdict, report))
    }

    pub(crate) fn is_ended(c: &Canary) -> bool {
        c.ended.load(Relaxed)
    }
}

/// The shadow thread's body: every millisecond while there is work (every 50 ms after a second
/// without any: 20 wake-ups a second while no shadow runs), it takes every waiting copy at once,
/// evaluates them in order and hands the slots back in batches. After a second without work it
/// frees the spare slots. It ends once the queue (the registry) is gone.
fn shadow_thread(queue: Weak<CachePadded<Mutex<ShadowQueue>>>, ticks: u64) {
    crate::ticker::mark_background_thread();
    if let Err(e) = crate::worker::lower_priority(crate::worker::COMPILE_NICE) {
        tracing::warn!(error = %e, "could not lower the priority of the shadow thread");
    }
    let mut batch: Vec<Box<ShadowJob>> = Vec::new();
    let mut done: Vec<Box<ShadowJob>> = Vec::new();
    let mut idle = 0u32;
    while let Some(q) = queue.upgrade() {
        {
            let mut q = q.lock();
            q.give_back(&mut done);
            std::mem::swap(&mut q.pending, &mut batch);
        }
        if batch.is_empty() {
            idle = idle.saturating_add(1);
            if idle == 1000 {
                let spare = {
                    let mut q = q.lock();
                    q.slots -= q.free.len();
                    q.free_words = 0;
                    std::mem::take(&mut q.free)
                };
                drop(q);
                drop(spare);
            } else {
                drop(q);
            }
            let ms = if idle < 1000 { 1 } else { 50 };
            std::thread::sleep(std::time::Duration::from_millis(ms));
            continue;
        }
        idle = 0;
        for job in batch.drain(..) {
            if let Some(shadow) = &job.shadow {
                shadow.evaluate(&job, ticks);
            }
            done.push(job);
            if done.len() >= RETURN_BATCH {
                q.lock().give_back(&mut done);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::with_wit_decision;
    use kvroute_core::candidate::CandidateColumns;
    use kvroute_core::Stage;

    fn columns(n: usize, seed: u32) -> CandidateColumns {
        let u32s = |k: u32| (0..n as u32).map(|i| i * k + seed).collect::<Vec<u32>>();
        let u64s = |k: u64| {
            (0..n as u64)
                .map(|i| i * k + u64::from(seed))
                .collect::<Vec<u64>>()
        };
        let f64s = |k: f64| {
            (0..n)
                .map(|i| i as f64 * k + f64::from(seed))
                .collect::<Vec<f64>>()
        };
        CandidateColumns {
            worker_id: u64s(3),
            dp_rank: u32s(1),
            device_overlap: u32s(2),
            host_overlap: u32s(3),
            disk_overlap: u32s(4),
            active_prefill_tokens: u64s(5),
            active_decode_blocks: u64s(6),
            active_requests: u32s(7),
            active_prompt_blocks: u32s(8),
            total_kv_blocks: u64s(9),
            max_num_batched_tokens: u32s(10),
            kv_feed_trust: (0..n).map(|i| (i % 3) as u8).collect(),
            session_bound: if seed.is_multiple_of(2) {
                vec![1; n]
            } else {
                Vec::new()
            },
            base_cost: f64s(0.5),
            prefill_ms_per_token: f64s(0.25),
            decode_step_ms: Vec::new(),
            taint_offsets: (0..=n as u32).collect(),
            taint_ids: u32s(11),
        }
    }

    fn request(id: &str, session: Option<&str>, taints: usize) -> PolicyRequest {
        PolicyRequest {
            request_id: id.into(),
            prompt_tokens: 100 + taints as u32,
            request_blocks: 6,
            block_size: 16,
            preferred_taints: (0..taints as u32).map(|t| (t, 0.5)).collect(),
            priority: 1.5,
            expected_output_tokens: Some(taints as u32),
            temperature: 0.25,
            session_id: session.map(Into::into),
            now_ms: 17,
            ask_only: !taints.is_multiple_of(2),
        }
    }

    fn record(id: u64, outcome: &str) -> CanaryRecord {
        let arm = serde_json::json!({"policy": "p", "version": 1, "decisions": 0,
            "decision_fallbacks": 0, "fallback_rate": 0.0, "requests": 0, "errors": 0,
            "error_rate": 0.0, "ttft_ms": Summary::default(), "itl_ms": Summary::default(),
            "cached_tokens": Summary::default(), "cached_token_ratio": 0.0});
        serde_json::from_value(serde_json::json!({
            "outcome": outcome, "rule": "manual", "reason": format!("{outcome} {id}"),
            "ended_at": "2026-01-01T00:00:00Z",
            "evidence": {"id": id, "policy": "cand", "version": 2, "fraction": 0.2,
                "started_at": "2026-01-01T00:00:00Z", "guardrails": Guardrails::default(),
                "auto_promote": null, "control": arm, "candidate": arm,
                "differences": Differences::default()}
        }))
        .expect("a record reads back")
    }

    fn canary_image(id: u64) -> CanaryImage {
        CanaryImage {
            id,
            name: "cand".into(),
            version: 2,
            control: "default".into(),
            control_version: 1,
            spec: CanarySpec::from_json(r#"{"fraction": 0.2}"#).unwrap(),
            started_at_ms: 1,
        }
    }

    /// What a replica holds after reading the store's rollout record, given what it decided and
    /// has not written.
    #[test]
    fn merging_the_stored_rollout_keeps_unwritten_local_ends_unless_the_store_decided() {
        let shadow = ShadowImage {
            name: "other".into(),
            version: 1,
            sample: 0.5,
            started_at_ms: 3,
        };
        let written = RolloutImage {
            canary: Some(canary_image(7)),
            records: vec![record(6, "stopped")],
            ..Default::default()
        };
        // This replica rolled canary 7 back and has not written it yet.
        let local = RolloutImage {
            canary: None,
            records: vec![record(6, "stopped"), record(7, "rolled_back")],
            ..Default::default()
        };
        // Meanwhile another replica started a shadow (canary 7 still runs in its record): the
        // shadow is taken, canary 7 stays ended with this replica's record, to be written.
        let stored = RolloutImage {
            shadows: vec![shadow.clone()],
            ..written.clone()
        };
        let (out, undo) = merge_rollout(&stored, &local, &written);
        assert_eq!(out.shadows, vec![shadow.clone()]);
        assert_eq!(out.canary, None);
        assert_eq!(out.records, local.records);
        assert!(undo.is_empty());
        // Another replica ended canary 7 first (stopped): its record wins, nothing to undo.
        let stored = RolloutImage {
            canary: None,
            records: vec![record(6, "stopped"), record(7, "stopped")],
            ..Default::default()
        };
        let (out, undo) = merge_rollout(&stored, &local, &written);
        assert_eq!(out, stored);
        assert!(undo.is_empty());
        // This replica had promoted 7: that promotion lost and must be undone.
        let promoted = RolloutImage {
            records: vec![record(6, "stopped"), record(7, "promoted")],
            ..Default::default()
        };
        let (out, undo) = merge_rollout(&stored, &promoted, &written);
        assert_eq!(out, stored);
        assert_eq!(undo, vec![record(7, "promoted")]);
        // The same verdict on both: nothing to undo either.
        let (_, undo) = merge_rollout(&promoted, &promoted, &written);
        assert!(undo.is_empty());
        // Nothing pending here: the store's record, whatever it is (a new canary 8).
        let stored = RolloutImage {
            canary: Some(canary_image(8)),
            records: vec![record(6, "stopped"), record(7, "stopped")],
            ..Default::default()
        };
        let (out, _) = merge_rollout(&stored, &written, &written);
        assert_eq!(out, stored);
        // A record read back names only the outcomes and rules kvroute writes.
        let mut bad = serde_json::to_value(record(1, "stopped")).unwrap();
        bad["outcome"] = "exploded".into();
        let e = serde_json::from_value::<CanaryRecord>(bad).unwrap_err();
        assert!(e.to_string().contains("exploded"), "{e}");
    }

    /// New slots are made until the free ones hold the reuse window, then the one freed longest
    /// ago is reused; at the capacity a free slot is reused whatever the window, and with none
    /// free the copy is dropped.
    #[test]
    fn the_queue_reuses_the_slot_freed_longest_ago_once_enough_are_free() {
        let slot = |tag: u32| {
            let mut job = Box::<ShadowJob>::default();
            job.costs = Vec::with_capacity(REUSE_AFTER_WORDS / 2);
            job.block_size = tag;
            job
        };
        let tag = |s: Slot| match s {
            Slot::Reused(job) => Some(job.block_size),
            Slot::New => None,
            Slot::Full => Some(u32::MAX),
        };
        let mut q = ShadowQueue::default();
        for _ in 0..3 {
            assert_eq!(tag(q.take()), None);
        }
        q.give_back(&mut vec![slot(1)]);
        assert_eq!(tag(q.take()), None, "half the window free: a new slot");
        q.give_back(&mut vec![slot(2), slot(3)]);
        assert_eq!(tag(q.take()), Some(1));
        assert_eq!(tag(q.take()), Some(2));
        assert_eq!(tag(q.take()), None);
        assert_eq!((q.slots, q.free.len()), (5, 1));
        q.slots = SHADOW_QUEUE_CAPACITY;
        assert_eq!(tag(q.take()), Some(3));
        assert_eq!(tag(q.take()), Some(u32::MAX), "full");
        q.give_back(&mut vec![Box::default()]);
        assert_eq!(tag(q.take()), Some(0));
        assert_eq!(q.free_words, 0);
    }

    /// A reused slot holds exactly the decision it was last filled with (longer, shorter or
    /// empty lists after one another), and the request's scalars with it.
    #[test]
    fn a_reused_slot_holds_exactly_the_last_decision() {
        let taints = TaintTable::default();
        let last = ArcSwapOption::empty();
        let mut job = ShadowJob::default();
        for (n, seed, id, session, taints_per) in [
            (64, 2, "a-long-request-id", Some("session"), 3),
            (8, 1, "b", None, 0),
            (1024, 4, "c", Some("s"), 1),
            (0, 3, "", None, 2),
        ] {
            let cols = columns(n, seed);
            let req = request(id, session, taints_per);
            let answer = Ok(Answer::Costs(vec![1.5; n]));
            with_wit_decision(&req, &cols, Stage::Prefill, |wreq, data| {
                job.fill(wreq, data, &last, &taints, req.block_size, &answer);
                assert_eq!(job.words, data);
                // The generated record has no `PartialEq`; its `Debug` names every field.
                assert_eq!(format!("{:?}", job.wreq), format!("{:?}", Some(wreq)));
            });
            assert_eq!(job.costs, vec![1.5; n]);
            assert_eq!(job.block_size, req.block_size);
        }
    }
}
