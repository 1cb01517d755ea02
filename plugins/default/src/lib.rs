//! `default`: the policy `kvroute serve` runs when nothing else is configured. It prices every
//! candidate in **estimated milliseconds to the request's first token** and picks the cheapest.
//!
//! Dynamo's cost (the built-in `dynamo`, SPEC §7) adds prefill blocks and decode blocks one for
//! one. For the time to first token they are worth very different amounts: on a vLLM-like engine
//! (SPEC §10) a prompt block costs about 1 ms of prefill, while a block held by a decoding request
//! slows each step by microseconds. The replays in BENCHMARKS.md show what that costs. This policy
//! estimates instead (model.rs):
//!
//! - `own` = prompt tokens left after the cache credit (device blocks, host and disk blocks
//!   weighted like the native cost, or the prompt blocks an earlier request already booked there,
//!   whichever is more); at least the last block is computed, as an engine must.
//! - `Q = active_prefill_tokens + own`: the prefill work queued ahead of and including this
//!   request (engines prefill first come, first served), done in `steps = ceil(Q / budget)`
//!   chunked steps costing `steps·p0 + p1·Q + p2·Q²/steps` ms.
//! - Decode interference: every step also decodes when the candidate has active requests,
//!   `decode(u) = max(1, d0 + d1·u + d2·u²)` ms, `u` = (active decode blocks + this prompt's new
//!   blocks) / KV capacity; a busy candidate is mid-step: add `residual_frac` of its current step.
//! - `w × (p1·own + p2·own²)`: the compute this request adds, which later arrivals on that engine
//!   wait behind (a pure per-request greedy trades fleet work for its own first token and loses
//!   in the tail under bursts). How often later arrivals wait depends on the load, so
//!   `w = work_weight × load`, `load` = the mean over candidates of their queued prompt tokens
//!   over their step budget, each at most 1 (`Config::prefill_load`). Idle fleet: pure greedy;
//!   saturated: 12. A fixed weight had to trade the conv trace's p99 (4) against Azure code ×40's
//!   mean (8+); the load-scaled one wins both (BENCHMARKS.md). A **new session's first turn**
//!   (a session id no candidate is bound to) is priced at most at each candidate's own load
//!   (`new_session_local_work`): it decides where the session's later turns run, and a miss on
//!   an engine with nothing queued delays no one (`Config::local_work_weight` has the reasoning).
//! - `overflow_penalty_ms` when the request's blocks would not fit in the candidate's KV capacity
//!   (the engine would preempt).
//! - **Near ties by decode pace** (`decode_pace_tie_break`): at an aggregated decision, the
//!   candidates whose estimates lie within `residual_frac` of the cheapest one's current decode
//!   step (the residual the estimate guesses at) are ordered by an equal blend of their estimate
//!   and the inter-token latency joining their decode batch adds, `(a + 1)·decode(u_after) −
//!   a·decode(u_before)`, each spread over half the band (`Config::break_near_ties` has the
//!   reasoning).
//!
//! Step times come from one function, `Config::step_times`: the configured figures scaled by the
//! candidate's **learned speed** relative to the fleet (`learned_step_times`, opt-in; the
//! host fits each worker's prefill ms per token and decode ms per token from the lifecycle it
//! sees, interface 0.6.0, and the SDK's `RelativeSpeeds` takes the square root of each over the
//! fleet's mean, so a worker twice as slow is priced 1.41 times as long and a uniform fleet keeps
//! the model; 1 until learned), and the candidate's step budget.
//!
//! Stages (`Request::stage`): an aggregated decision and the prefill step of a disaggregated one
//! are estimated as above. At the **decode step** the engine receives the KV cache and computes
//! no prompt: no overlap credit, no own prefill, no `work_weight`; the first token waits for the
//! current step and one step that decodes this request beside the others (plus a chunk of the
//! prompts queued on a `both` engine), so decode candidates rank by load, never by what they cache.
//!
//! **Feed trust** (interface 0.7.0's `kv-feed-trust`): the cache credit of a candidate whose KV
//! event feed is `recovering` counts `recovering_overlap_weight` (0.5) of itself, of a `degraded`
//! one `degraded_overlap_weight` (0): the index is not the engine's cache there, and a false hit
//! costs a whole prompt's compute (`Config::trust_weight` has the reasoning). Blocks an earlier
//! request booked on the candidate are the router's own knowledge and keep their credit.
//!
//! **Sessions** (interface 0.8.0's `session-bound`, SPEC §12): the candidate holding the request's
//! session binding has its estimate multiplied by `1 - session_credit` (0.9), the one holding a
//! new subagent's parent session by `1 - parent_session_credit` (0.9); not at the decode step.
//! A modest share, so a session stays through small load swings but never piles onto a loaded
//! worker (`Config::session_factor` has the reasoning).
//!
//! The estimate (always > 0) is multiplied by SPEC §7's preferred-taint multiplier, so preferences
//! separate idle candidates too.
//!
//! Configuration (all optional; unknown keys are rejected). Defaults are SPEC §10's engine model:
//! `{"prefill_ms": [16.50142, 0.01518344, 4.209989e-7], "decode_ms": [5.74, 54.01, -25.74],
//!   "default_max_num_batched_tokens": 8192, "residual_frac": 0.5, "host_tier_weight": 0.75,
//!   "disk_tier_weight": 0.25, "overflow_penalty_ms": 10000, "credit_active_blocks": true,
//!   "work_weight": 12, "work_weight_follows_load": true, "learned_step_times": false,
//!   "recovering_overlap_weight": 0.5, "degraded_overlap_weight": 0, "session_credit": 0.1,
//!   "parent_session_credit": 0.1, "new_session_local_work": true,
//!   "decode_pace_tie_break": false}`

mod model;

pub use model::{Config, Load, Pace, Prompt, StepTimes};

use kvroute_sdk::{
    check_step_model, parse_config, preferred_multiplier, Candidates, Context, Decision, Policy,
    RelativeSpeeds, Request, SessionBound, Stage,
};

/// The default policy.
#[derive(Default)]
pub struct DefaultPolicy {
    config: Config,
}

impl DefaultPolicy {
    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

/// Checks a configuration's values (names the key and the reason).
fn check(c: &Config) -> Result<(), String> {
    check_step_model(
        "default",
        &c.prefill_ms,
        &c.decode_ms,
        c.default_max_num_batched_tokens,
        &[
            ("residual_frac", c.residual_frac),
            ("host_tier_weight", c.host_tier_weight),
            ("disk_tier_weight", c.disk_tier_weight),
            ("overflow_penalty_ms", c.overflow_penalty_ms),
            ("work_weight", c.work_weight),
        ],
    )?;
    for (key, v) in [
        ("recovering_overlap_weight", c.recovering_overlap_weight),
        ("degraded_overlap_weight", c.degraded_overlap_weight),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(format!(
                "default: {key} must be a number in [0, 1], got {v}"
            ));
        }
    }
    for (key, v) in [
        ("session_credit", c.session_credit),
        ("parent_session_credit", c.parent_session_credit),
    ] {
        if !(0.0..=0.5).contains(&v) {
            return Err(format!(
                "default: {key} must be a number in [0, 0.5], got {v}"
            ));
        }
    }
    Ok(())
}

impl Policy for DefaultPolicy {
    /// Prices candidates on its own figures: the host need not compute its native cost.
    fn host_columns(&self) -> kvroute_sdk::HostColumns {
        kvroute_sdk::HostColumns::empty()
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("default", json)?;
        check(&c)?;
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let config = &self.config;
        let load = config.prefill_load(c);
        let mut prompt = Prompt::of(req, config.work_weight_at(load));
        prompt.new_session = req.session_id.is_some() && c.session_bound.iter().all(|&b| b == 0);
        // Decode paces only for a tie-break at an aggregated decision: the request decodes where
        // it is routed (not at a disaggregated prefill step; the decode step ranks by load).
        let paced = config.decode_pace_tie_break && req.stage == Stage::Aggregated;
        let mut paces: Vec<Pace> = Vec::new();
        // One candidate's estimate at its step times (and its pace, for the tie-break).
        let mut priced = |l: Load, t: StepTimes| {
            if paced {
                paces.push(config.decode_pace(&prompt, &l, &t));
            }
            config.estimate_load(&prompt, &l, &t)
        };
        let mut costs: Vec<f64> = if config.learned_step_times {
            let speeds = RelativeSpeeds::of(c);
            Load::all(c)
                .zip(c.rows())
                .map(|(l, r)| {
                    let t = config.step_times(l.max_num_batched_tokens, speeds.get(r));
                    priced(l, t)
                })
                .collect()
        } else {
            // Every candidate shares the configured step times; only the budget differs.
            let step_times = config.model_step_times();
            Load::all(c)
                .map(|l| {
                    let t = step_times(l.max_num_batched_tokens);
                    priced(l, t)
                })
                .collect()
        };
        if !req.preferred_taints.is_empty() {
            for (cost, r) in costs.iter_mut().zip(c.rows()) {
                *cost *= preferred_multiplier(req, r);
            }
        }
        // The session binding (at most one candidate has one): a modest share off its estimate.
        if let Some(i) = c.session_bound.iter().position(|&b| b != 0) {
            costs[i] *=
                config.session_factor(req.stage, SessionBound::from_code(c.session_bound[i]));
        }
        if paced {
            config.break_near_ties(&mut costs, &paces);
        }
        Decision::Costs(costs)
    }
}

kvroute_sdk::export_policy!(DefaultPolicy);

#[cfg(test)]
mod tests;
