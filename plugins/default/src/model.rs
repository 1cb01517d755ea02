//! The default's latency model: estimated milliseconds to the request's first token on one
//! candidate. Kept apart from the policy glue so the arithmetic can be read (and tested) alone.
//!
//! Step times come from ONE place, [`Config::step_times`]: the configured figures (SPEC §10's
//! engine model unless overridden), scaled by the candidate's learned speed relative to the fleet
//! (the SDK's [`Speed`], from the host's learned step times), and the candidate's own step budget.

use kvroute_sdk::{Candidates, FeedTrust, Request, SessionBound, Speed, Stage};

/// The larger of two finite figures. `f64::max` is a call into libm's `fmax` on wasm32 (NaN
/// rules); a compare keeps the per-candidate loop inline (the decision-cost budget, BENCHMARKS.md).
#[inline(always)]
fn max(a: f64, b: f64) -> f64 {
    if a > b {
        a
    } else {
        b
    }
}

/// The smaller of two finite figures (see [`max`]).
#[inline(always)]
fn min(a: f64, b: f64) -> f64 {
    if a < b {
        a
    } else {
        b
    }
}

/// The configuration (see the crate docs for each key's meaning and default).
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[p0, p1, p2]`: one step computing `T` prompt tokens lasts `p0 + p1·T + p2·T²` ms.
    pub prefill_ms: [f64; 3],
    /// `[d0, d1, d2]`: a decode step at KV utilisation `u` lasts `max(1, d0 + d1·u + d2·u²)` ms.
    pub decode_ms: [f64; 3],
    /// Step token budget of candidates that do not report one.
    pub default_max_num_batched_tokens: u32,
    /// Fraction of its current step a busy candidate is assumed to have left.
    pub residual_frac: f64,
    pub host_tier_weight: f64,
    pub disk_tier_weight: f64,
    /// Added when the request's blocks would not fit in the candidate's free KV blocks.
    pub overflow_penalty_ms: f64,
    /// Count this prompt's blocks already active on a candidate (booked by an earlier request)
    /// as cached.
    pub credit_active_blocks: bool,
    /// Weight of the request's own prefill compute (ms), added on top of its own wait, at full
    /// load; scaled by the candidates' load ([`Config::work_weight_at`]) when
    /// `work_weight_follows_load`.
    pub work_weight: f64,
    /// Scale `work_weight` by the candidates' prefill load (`false`: the fixed weight, for
    /// comparison).
    pub work_weight_follows_load: bool,
    /// Price a **new session's** first turn (a session id no candidate holds a binding for) with
    /// the work weight at most `work_weight ×` each candidate's own prefill load
    /// ([`Config::local_work_weight`]).
    pub new_session_local_work: bool,
    /// Scale each candidate's step times by its learned speed relative to the fleet (`false`:
    /// the configured model for every candidate, for comparison).
    pub learned_step_times: bool,
    /// Weight of the cache credit (device, host and disk overlaps) of a candidate whose KV feed
    /// is `recovering` (interface 0.7.0's `kv-feed-trust`), in [0, 1]. See
    /// [`Config::trust_weight`] for why 0.5.
    pub recovering_overlap_weight: f64,
    /// The same for a `degraded` feed (and reserved codes), in [0, 1]. See
    /// [`Config::trust_weight`] for why 0.
    pub degraded_overlap_weight: f64,
    /// The share of its estimate a candidate holding the request's session binding is spared
    /// (interface 0.8.0's `session-bound` = 1), in [0, 0.5]. See [`Config::session_factor`]
    /// for why 0.1.
    pub session_credit: f64,
    /// The same for the candidate holding a new subagent session's parent (`session-bound` = 2).
    pub parent_session_credit: f64,
    /// Break near ties by decode pace: among candidates whose estimates lie within
    /// `residual_frac` of the cheapest one's current decode step, rank by an equal blend of the
    /// estimate and the inter-token latency joining the decode batch costs
    /// ([`Config::break_near_ties`]).
    pub decode_pace_tie_break: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefill_ms: [16.50142, 1.518344e-2, 4.209989e-7],
            decode_ms: [5.74, 54.01, -25.74],
            default_max_num_batched_tokens: 8192,
            residual_frac: 0.5,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
            overflow_penalty_ms: 10_000.0,
            credit_active_blocks: true,
            work_weight: 12.0,
            work_weight_follows_load: true,
            new_session_local_work: true,
            learned_step_times: false,
            recovering_overlap_weight: 0.5,
            degraded_overlap_weight: 0.0,
            session_credit: 0.1,
            parent_session_credit: 0.1,
            decode_pace_tie_break: false,
        }
    }
}

/// What the estimate needs of the request and of the decision, computed once per decision (not
/// per candidate: the integer divisions here would otherwise dominate the per-candidate work).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prompt {
    pub stage: Stage,
    /// Prompt tokens.
    pub tokens: f64,
    /// Tokens per block.
    pub block: f64,
    /// Blocks a cache can serve at most: all but the one holding the last token.
    pub reusable_blocks: f64,
    /// Blocks the prompt occupies (a partial tail block counts).
    pub blocks: u32,
    /// The weight of this request's own prefill compute in this decision
    /// ([`Config::work_weight_at`]).
    pub work_weight: f64,
    /// The first turn of a new session: its work weight is capped at each candidate's own load.
    pub new_session: bool,
}

impl Prompt {
    /// The request's figures, with `work_weight` in force for this decision.
    pub fn of(req: &Request, work_weight: f64) -> Self {
        let b = req.block_size.max(1);
        let isl = req.prompt_tokens;
        Self {
            stage: req.stage,
            tokens: f64::from(isl),
            block: f64::from(b),
            reusable_blocks: f64::from(isl.saturating_sub(1) / b),
            blocks: isl.div_ceil(b),
            work_weight,
            new_session: false,
        }
    }
}

/// One candidate's step-time figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTimes {
    /// `[p0, p1, p2]` of `prefill(T) = p0 + p1·T + p2·T²` ms.
    pub prefill_ms: [f64; 3],
    /// `[d0, d1, d2]` of `decode(u) = max(1, d0 + d1·u + d2·u²)` ms.
    pub decode_ms: [f64; 3],
    /// Prompt tokens one step computes at most.
    pub budget: f64,
}

impl StepTimes {
    /// One step computing `tokens` prompt tokens.
    #[inline]
    pub fn prefill(&self, tokens: f64) -> f64 {
        let [c0, c1, c2] = self.prefill_ms;
        c0 + c1 * tokens + c2 * tokens * tokens
    }

    /// The compute `tokens` prompt tokens add to steps that run anyway (no per-step constant).
    #[inline]
    pub fn marginal_prefill(&self, tokens: f64) -> f64 {
        let [_, c1, c2] = self.prefill_ms;
        c1 * tokens + c2 * tokens * tokens
    }

    /// `queued` prompt tokens done in chunked steps of `budget`: `(steps, ms)`.
    #[inline]
    pub fn chunked_prefill(&self, queued: f64) -> (f64, f64) {
        let [c0, c1, c2] = self.prefill_ms;
        if queued <= self.budget {
            // One step (the common case): no division.
            return (1.0, c0 + c1 * queued + c2 * queued * queued);
        }
        let steps = max((queued / self.budget).ceil(), 1.0);
        (
            steps,
            steps * c0 + c1 * queued + c2 * queued * queued / steps,
        )
    }

    /// One decode step at KV utilisation `u`.
    #[inline]
    pub fn decode(&self, u: f64) -> f64 {
        let [c0, c1, c2] = self.decode_ms;
        max(c0 + c1 * u + c2 * u * u, 1.0)
    }
}

/// What joining a candidate's decode batch costs, for [`Config::break_near_ties`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pace {
    /// Inter-token latency one decode step there adds, summed over the batch, with this request
    /// in it against without: `(a + 1)·decode(u_after) − a·decode(u_before)`, `a` the
    /// candidate's active requests, `u` its KV utilisation before and after this prompt's new
    /// blocks (its own token's step plus the slowdown of each running request's).
    pub marginal_ms: f64,
    /// The candidate's current decode step, `decode(u_before)`; 0 when nothing runs there.
    pub current_ms: f64,
}

/// The figures of one candidate the model reads, loaded once from the columns. Estimates work on
/// these plain numbers rather than on a `Row`: [`Load::all`] walks the columns without a bounds
/// check per field.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    pub device_overlap: u32,
    pub host_overlap: u32,
    pub disk_overlap: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u32,
    pub active_prompt_blocks: u32,
    /// KV capacity in blocks (0 = unknown).
    pub total_kv_blocks: u64,
    /// Step token budget (0 = unknown: the configured default applies).
    pub max_num_batched_tokens: u32,
    /// The KV feed's trust state (interface 0.7.0).
    pub kv_feed_trust: FeedTrust,
}

impl Load {
    /// Every candidate's figures, in order, the columns walked together: zipped iterators check
    /// no index per field (indexing nine columns per candidate cost 0.2 µs of a 2.5 µs decision at
    /// 64 candidates, BENCHMARKS.md). The SDK checked that every column has one entry per
    /// candidate.
    pub fn all<'a>(c: &'a Candidates<'a>) -> impl ExactSizeIterator<Item = Load> + 'a {
        let (dev, host, disk) = (c.device_overlap, c.host_overlap, c.disk_overlap);
        let (prefill, decode, requests) = (
            c.active_prefill_tokens,
            c.active_decode_blocks,
            c.active_requests,
        );
        let (prompt, total, budget) = (
            c.active_prompt_blocks,
            c.total_kv_blocks,
            c.max_num_batched_tokens,
        );
        let overlaps = dev.iter().zip(host).zip(disk).zip(c.kv_feed_trust);
        let work = prefill.iter().zip(decode).zip(requests);
        let capacity = prompt.iter().zip(total).zip(budget);
        overlaps.zip(work).zip(capacity).map(
            |(((((&d, &h), &k), &trust), ((&p, &u), &r)), ((&a, &t), &b))| Load {
                device_overlap: d,
                host_overlap: h,
                disk_overlap: k,
                active_prefill_tokens: p,
                active_decode_blocks: u,
                active_requests: r,
                active_prompt_blocks: a,
                total_kv_blocks: t,
                max_num_batched_tokens: b,
                kv_feed_trust: FeedTrust::from_code(trust),
            },
        )
    }
}

impl Config {
    /// A candidate's step budget in prompt tokens: the one it reports, else (0 = unknown)
    /// `default_max_num_batched_tokens`. The one place the rule lives.
    #[inline(always)]
    pub fn budget(&self, reported: u32) -> u32 {
        match reported {
            0 => self.default_max_num_batched_tokens.max(1),
            b => b,
        }
    }

    /// The step times of a candidate reporting step budget `budget` at speed `s`: the ONE place
    /// step-time figures come from (the configured ones times the candidate's relative speed, and
    /// its [budget](Self::budget)).
    #[inline]
    pub fn step_times(&self, budget: u32, s: Speed) -> StepTimes {
        let scale = |c: [f64; 3], k: f64| [c[0] * k, c[1] * k, c[2] * k];
        StepTimes {
            prefill_ms: scale(self.prefill_ms, s.prefill),
            decode_ms: scale(self.decode_ms, s.decode),
            budget: f64::from(self.budget(budget)),
        }
    }

    /// [`Self::step_times`] at the model's speed for every candidate of a decision: the scaled
    /// figures once, each candidate's budget per call (the model's speed is 1, so this is
    /// `step_times(budget, Speed::MODEL)` without six multiplications per candidate).
    pub fn model_step_times(&self) -> impl Fn(u32) -> StepTimes + '_ {
        let model = self.step_times(0, Speed::MODEL);
        move |budget| StepTimes {
            budget: f64::from(self.budget(budget)),
            ..model
        }
    }

    /// The candidates' prefill load in [0, 1]: the mean over candidates of the prompt tokens
    /// queued there over its [budget](Self::budget), each at most 1 (a candidate with a full step
    /// or more queued counts as saturated).
    pub fn prefill_load(&self, c: &Candidates<'_>) -> f64 {
        let (queued, budgets) = (c.active_prefill_tokens, c.max_num_batched_tokens);
        let n = queued.len().min(budgets.len());
        if n == 0 {
            return 0.0;
        }
        // A fleet of one engine type reports one budget: sum whole tokens and divide once (a
        // division per candidate cost 0.3 µs at 64 candidates, a fifth of a whole decision).
        let first = budgets[0];
        if budgets.iter().all(|&b| b == first) {
            let budget = u64::from(self.budget(first));
            // At most u32::MAX tokens per candidate: no overflow below 4 billion candidates.
            let sum: u64 = queued.iter().map(|&q| q.min(budget)).sum();
            return sum as f64 / (budget as f64 * n as f64);
        }
        let sum: f64 = queued
            .iter()
            .zip(budgets)
            .map(|(&q, &b)| {
                let budget = f64::from(self.budget(b));
                min(q as f64, budget) / budget
            })
            .sum();
        sum / n as f64
    }

    /// The weight of a request's own prefill compute, given the candidates' prefill `load`
    /// ([`Self::prefill_load`]): `work_weight × load` when `work_weight_follows_load`, else
    /// `work_weight`. The work term prices what later arrivals on that engine wait behind; on a
    /// lightly loaded fleet they seldom wait (an idle engine takes them), near saturation every one
    /// does. A fixed weight has to choose: 4 kept the conv trace's p99 below round robin's, 8 and
    /// more gained 3% mean at Azure code ×40 and lost that p99 (BENCHMARKS.md).
    #[inline]
    pub fn work_weight_at(&self, load: f64) -> f64 {
        if self.work_weight_follows_load {
            self.work_weight * load
        } else {
            self.work_weight
        }
    }

    /// Estimated milliseconds from now to this request's first token on one candidate, at the
    /// request's stage: the request's figures computed once ([`Prompt::of`]), the candidate's
    /// loaded ([`Load`]) and its step times chosen ([`Self::step_times`]).
    #[inline(always)]
    pub fn estimate_load(&self, p: &Prompt, l: &Load, t: &StepTimes) -> f64 {
        match p.stage {
            Stage::Aggregated | Stage::Prefill => self.prefill_estimate(p, l, t),
            Stage::Decode => self.decode_estimate(p, l, t),
        }
    }

    /// Prompt tokens the candidate must compute for this request: those past the cache credit
    /// (device blocks, host and disk ones weighted, or the prompt blocks an earlier request booked
    /// there, whichever is more), at least the last block's worth being computed as an engine
    /// must, and at least 1.
    #[inline(always)]
    pub fn own_tokens(&self, p: &Prompt, l: &Load) -> f64 {
        let (d, h, k) = (l.device_overlap, l.host_overlap, l.disk_overlap);
        let cached = (f64::from(d)
            + self.host_tier_weight * f64::from(h.saturating_sub(d))
            + self.disk_tier_weight * f64::from(k.saturating_sub(d.max(h))))
            * self.trust_weight(l.kv_feed_trust);
        let credit = if self.credit_active_blocks {
            max(cached, f64::from(l.active_prompt_blocks))
        } else {
            cached
        };
        max(p.tokens - min(credit, p.reusable_blocks) * p.block, 1.0)
    }

    /// How much of a candidate's cache credit counts, by its KV feed's trust state. The overlap
    /// columns come from the feed; the prompt blocks an earlier request booked there
    /// (`active_prompt_blocks`) are the router's own and are never discounted.
    ///
    /// - `exact`: 1, the index is the engine's cache.
    /// - `recovering` (`recovering_overlap_weight`, 0.5): the feed has just joined or
    ///   reconnected, or a gap is being replayed. The index is wrong in both directions until
    ///   the replay completes (it lacks blocks stored during the gap and still holds blocks
    ///   evicted during it), and replays usually finish within a second: half credit keeps a
    ///   deep, probably real hit attractive while a comparable exact one wins.
    /// - `degraded` (`degraded_overlap_weight`, 0): events were lost for good. Going by its
    ///   overlap is betting a full prefill on a view the router knows is not the engine's; a
    ///   missed hit costs at most the recompute on an otherwise better-priced worker, a false
    ///   one adds a whole prompt's compute to a worker picked for its cache. The candidate still
    ///   competes on load, as a dead feed does under `dead_feed = "unknown"`.
    #[inline(always)]
    pub fn trust_weight(&self, t: FeedTrust) -> f64 {
        match t {
            FeedTrust::Exact => 1.0,
            FeedTrust::Recovering => self.recovering_overlap_weight,
            FeedTrust::Degraded => self.degraded_overlap_weight,
        }
    }

    /// What a candidate's estimate is multiplied by for the request's session binding
    /// (`session-bound`): `1 - session_credit` where the request's session is bound, `1 -
    /// parent_session_credit` where a new subagent's parent is, 1 elsewhere and at the decode
    /// step (the KV cache arrives by transfer there).
    ///
    /// Why a modest share and not a pin: the estimate already credits the session's cache where
    /// the index sees it, so the binding matters where the index cannot: blocks not yet
    /// reported, evicted or offloaded where the engine keeps more than the events say, and prompt
    /// changes (tool output, summarisation) that end the shared prefix early. 10% decides near
    /// ties and keeps a session through the small load swings between its turns, while a bound
    /// worker more than ~11% slower than the best loses it: sessions do not pile onto one worker
    /// (today's default packs agent sessions onto the workers holding their prefixes, and its ITL
    /// runs above `dynamo`'s; issue 36). A proportional share, not milliseconds, so an idle fleet
    /// and a saturated one weigh it alike. In `hard` mode the host pins a bound session itself
    /// while its worker is eligible, and this credit only ranks the one candidate.
    #[inline(always)]
    pub fn session_factor(&self, stage: Stage, bound: SessionBound) -> f64 {
        match (stage, bound) {
            (Stage::Decode, _) | (_, SessionBound::None) => 1.0,
            (_, SessionBound::Session) => 1.0 - self.session_credit,
            (_, SessionBound::Parent) => 1.0 - self.parent_session_credit,
        }
    }

    /// Blocks of the prompt the candidate must newly hold (those an earlier request made active
    /// are shared).
    #[inline(always)]
    fn new_blocks(p: &Prompt, l: &Load) -> u64 {
        u64::from(p.blocks.saturating_sub(l.active_prompt_blocks))
    }

    /// `1 / total_kv_blocks` (0 when unknown): one division per candidate, not per use.
    #[inline(always)]
    fn inverse_capacity(l: &Load) -> f64 {
        match l.total_kv_blocks {
            0 => 0.0,
            total => 1.0 / total as f64,
        }
    }

    /// KV utilisation with `blocks` in use, from [`Self::inverse_capacity`].
    #[inline(always)]
    fn util_of(inverse_capacity: f64, blocks: u64) -> f64 {
        min(blocks as f64 * inverse_capacity, 1.0)
    }

    /// `overflow_penalty_ms` when `blocks` more would not fit in the candidate's KV capacity
    /// (the engine would preempt), else 0.
    #[inline(always)]
    fn overflow(&self, l: &Load, blocks: u64) -> f64 {
        let total = l.total_kv_blocks;
        if total > 0 && l.active_decode_blocks + blocks > total {
            self.overflow_penalty_ms
        } else {
            0.0
        }
    }

    /// The work weight on one candidate: the decision's ([`Self::work_weight_at`]); for a new
    /// session's first turn (with `new_session_local_work` and a weight that follows the load), at
    /// most `work_weight ×` the candidate's own prefill load (its queued prompt tokens over its
    /// budget, at most 1).
    ///
    /// Why: the work term prices the compute a request adds by the fleet's load, because later
    /// arrivals wait behind it. A new session's first turn is different: it decides where every
    /// later turn runs (the binding keeps it there and its cache grows there), and its miss on an
    /// engine with nothing queued delays no one. Priced at the fleet's load, an idle engine that
    /// lacks a shared system prompt never wins a first turn, so agent sessions packed onto the
    /// engines that had it: on the agentic replay half the fleet got no request at all, and ITL
    /// rose 50% above `dynamo`'s (BENCHMARKS.md, issue 36). Later turns and requests without a
    /// session keep the fleet's weight (for all requests the cap cost Azure code ×25 8% of p50).
    #[inline(always)]
    pub fn local_work_weight(&self, p: &Prompt, ahead: f64, t: &StepTimes) -> f64 {
        if !(p.new_session && self.new_session_local_work && self.work_weight_follows_load) {
            return p.work_weight;
        }
        min(p.work_weight, self.work_weight * min(ahead / t.budget, 1.0))
    }

    /// The decode pace of one candidate for this request ([`Pace`]).
    #[inline(always)]
    pub fn decode_pace(&self, p: &Prompt, l: &Load, t: &StepTimes) -> Pace {
        let inv = Self::inverse_capacity(l);
        let new_blocks = Self::new_blocks(p, l);
        if l.active_requests == 0 {
            // It decodes alone: its own step at its own blocks, and no step under way.
            return Pace {
                marginal_ms: t.decode(Self::util_of(inv, new_blocks)),
                current_ms: 0.0,
            };
        }
        let used = l.active_decode_blocks;
        let before = t.decode(Self::util_of(inv, used));
        let after = t.decode(Self::util_of(inv, used + new_blocks));
        let a = f64::from(l.active_requests);
        Pace {
            marginal_ms: (a + 1.0) * after - a * before,
            current_ms: before,
        }
    }

    /// With `decode_pace_tie_break`: among the candidates whose cost lies within `band =
    /// residual_frac × the cheapest candidate's current decode step` of the cheapest, the order
    /// is by an equal blend of the cost and [`Pace::marginal_ms`], each spread over half the band
    /// (the cost's gap to the cheapest as it is, the pace's spread across the band's candidates
    /// scaled to half the band); the new costs stay within the band, so no candidate outside it
    /// moves.
    ///
    /// Why the band: the estimate of a busy candidate adds `residual_frac` of its current step
    /// for the part still to run, but where in that step the engine is, the router does not know:
    /// the first token can come anything up to a whole step earlier or later than the estimate's
    /// guess of half. Estimates closer than that residual are equal within the model's own
    /// resolution, so picking the cheaper one gains nothing the model can show. An idle cheapest
    /// candidate has no step under way: no band.
    ///
    /// Why pace: the estimate stops at the first token, so among such near-equal candidates the
    /// cheapest is an arbitrary one, and the default kept piling requests where the cache and the
    /// first step looked marginally better; every token of every request decoding there then ran
    /// in a longer step. In the replay's step model a decode-only step lasts `decode(u)`, so the
    /// inter-token latency a pick adds is what `marginal_ms` counts: the new request's own step
    /// and the slowdown its blocks bring to each request already running there. The figure
    /// ranks inside the band, never a price: it cannot pull a request off a candidate that is
    /// measurably faster to its first token (Azure conv ×20: ITL p50 from +0.7% over `dynamo`'s
    /// to below it, TTFT mean and p50 lower too; issue 36). Not at a disaggregated request's
    /// steps (`decide`): its prefill worker runs none of its decode, and the decode step ranks
    /// by load already.
    ///
    /// Why a blend and not the pace alone: within the band the estimate is uncertain, not void;
    /// a candidate near the band's edge is still expected to be that much later to its first
    /// token. With two candidates in the band the blend decides exactly as the pace alone would
    /// (the lighter batch's blended cost is at most half the band; the other's is half the band,
    /// since its pace is the spread's top): half each is the largest share of the cost that keeps
    /// every two-way near tie with the pace, which is what Azure conv's ITL gain rests on. The
    /// two differ only where three or more candidates share the band: there the pace alone
    /// takes the lightest batch even at the band's edge over one nearly as light at the
    /// cheapest's cost; the blend takes the one that does better on both together. Against the
    /// key off, over 40 seeds of the Mooncake trace (8 workers), the pace alone cost 0.28% ±
    /// 0.16 of mean TTFT and 0.26% of p50 (token hit rate 54.53% → 54.44%), the blend 0.06% ±
    /// 0.15 and −0.02% (54.55%); over 30 seeds of Azure conv ×20 both gain 0.93% of ITL p50,
    /// the blend 0.30% of mean TTFT to the pace's 0.26%. Off by default all the same: mean TTFT
    /// is the first goal, and on Mooncake the blend ties the key off, it does not beat it.
    pub fn break_near_ties(&self, costs: &mut [f64], paces: &[Pace]) {
        let Some((best, &m)) = costs.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1)) else {
            return;
        };
        let band = self.residual_frac * paces[best].current_ms;
        if band <= 0.0 {
            return;
        }
        let limit = m + band;
        let (mut lo, mut hi, mut within) = (f64::INFINITY, f64::NEG_INFINITY, 0);
        for (&c, p) in costs.iter().zip(paces) {
            if c <= limit {
                lo = min(lo, p.marginal_ms);
                hi = max(hi, p.marginal_ms);
                within += 1;
            }
        }
        if within < 2 || hi <= lo {
            return;
        }
        // Each figure over 0.4995 of the band: the cost's gap (at most the band) and the pace's
        // spread; every new cost stays below `limit`, where the candidates outside the band start.
        const HALF: f64 = 0.4995;
        let scale = HALF * band / (hi - lo);
        for (c, p) in costs.iter_mut().zip(paces) {
            if *c <= limit {
                *c = m + HALF * (*c - m) + (p.marginal_ms - lo) * scale;
            }
        }
    }

    /// An aggregated decision or the prefill step: the chosen engine computes the prompt.
    #[inline(always)]
    pub fn prefill_estimate(&self, p: &Prompt, l: &Load, t: &StepTimes) -> f64 {
        let own = self.own_tokens(p, l);
        let ahead = l.active_prefill_tokens as f64;
        let (steps, mut est) = t.chunked_prefill(ahead + own);
        let used = l.active_decode_blocks;
        let new_blocks = Self::new_blocks(p, l);
        if l.active_requests > 0 {
            // Every step also decodes the running requests; the current step is part done.
            let inv = Self::inverse_capacity(l);
            est += steps * t.decode(Self::util_of(inv, used + new_blocks));
            let current = if ahead > 0.0 {
                t.prefill(min(ahead, t.budget))
            } else {
                0.0
            } + t.decode(Self::util_of(inv, used));
            est += self.residual_frac * current;
        }
        // The compute this request adds, which later arrivals on that engine wait behind.
        est += self.local_work_weight(p, ahead, t) * t.marginal_prefill(own);
        est + self.overflow(l, new_blocks)
    }

    /// The decode step: the KV arrives by transfer, the engine computes no prompt, so overlap,
    /// the prompt's own prefill and `work_weight` do not apply. One step decoding this request
    /// beside the others (with a chunk of the prompts queued there), after the current one.
    #[inline(always)]
    pub fn decode_estimate(&self, p: &Prompt, l: &Load, t: &StepTimes) -> f64 {
        let ahead = l.active_prefill_tokens as f64;
        let chunk = if ahead > 0.0 {
            t.prefill(min(ahead, t.budget))
        } else {
            0.0
        };
        let used = l.active_decode_blocks;
        let new_blocks = Self::new_blocks(p, l);
        let inv = Self::inverse_capacity(l);
        let mut est = chunk + t.decode(Self::util_of(inv, used + new_blocks));
        if l.active_requests > 0 || ahead > 0.0 {
            est += self.residual_frac * (chunk + t.decode(Self::util_of(inv, used)));
        }
        est + self.overflow(l, new_blocks)
    }
}
