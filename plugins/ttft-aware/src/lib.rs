//! `ttft-aware`: the candidate with the lowest estimated time to first token.
//!
//! The native cost (SPEC §7) adds prefill blocks and decode blocks one for one. For the time to
//! first token they are worth very different amounts: on a vLLM-like engine (SPEC §10) a prompt
//! block costs about 1 ms of prefill, while a block held by a decoding request slows each step by
//! a few microseconds. This policy prices each candidate in estimated milliseconds instead:
//!
//! - `own` = prompt tokens left after the cache credit (device blocks, plus host and disk blocks
//!   weighted like the native cost, or the prompt blocks an earlier request already booked there,
//!   whichever is more); at least the last block is computed, as an engine must.
//! - `Q = active_prefill_tokens + own`: the prefill work queued ahead of and including this
//!   request (engines prefill first come, first served), done in `steps = ceil(Q / max_num_batched_tokens)`
//!   chunked steps costing `steps·p0 + p1·Q + p2·Q²/steps` ms.
//! - Every step also decodes when the candidate has active requests:
//!   `decode(u) = max(1, d0 + d1·u + d2·u²)` ms, `u` = (active decode blocks + this prompt's new
//!   blocks) / KV capacity.
//! - A busy candidate is mid-step: add `residual_frac` of its current step.
//! - A candidate whose KV capacity the request would overflow gets `overflow_penalty_ms` more
//!   (engines preempt).
//! - `work_weight × (p1·own + p2·own²)`: the compute this request adds, which later arrivals on
//!   that engine wait behind. A pure per-request greedy (`work_weight` 0) sends a long prompt to an
//!   idle engine that has none of it cached, trading fleet work for its own first token; under
//!   bursts that shows up in everyone's tail. The default, 6, was chosen on replays of the Azure
//!   code trace (BENCHMARKS.md: p99 went from +5% to −5% against the native cost); lower values
//!   favour this request's own latency.
//!
//! That is the estimate of an aggregated decision and of the prefill step of a disaggregated one
//! (`Request::stage`): either way the chosen engine computes the prompt. At the **decode step** the
//! engine receives the prompt's KV cache by transfer and computes none of it, so overlap, the
//! prompt's own prefill and `work_weight` do not apply. The first token then waits for the
//! engine's current step (`residual_frac` of it, when busy) and one step that decodes this request
//! beside the others: `decode(u)` with `u` counting this prompt's blocks too, plus a chunk of the
//! prompts queued there (`prefill(min(active_prefill_tokens, budget))`, which a `both` engine mixes
//! into its steps). So decode candidates rank by KV utilisation and queued prefill work, the same
//! figures that set every later step, i.e. the request's inter-token latency; the overflow penalty
//! applies as above.
//!
//! **Learned step times** (`learned_step_times`, default false, opt-in; interface 0.6.0): the host fits
//! each worker's prefill ms per token and decode ms per token from the requests it sees. A fleet
//! is rarely uniform, and the model above is one engine's. So each candidate's prefill terms are
//! scaled by its learned prefill time relative to the mean of the candidates that have one (the
//! square root of the ratio, the SDK's `RelativeSpeeds`, which says why), and its decode terms
//! likewise: a worker twice as slow as the others is priced 1.41 times as long, while a uniform
//! fleet keeps the model as it is (every scale 1). Candidates not learned yet (0) keep
//! scale 1. `false` ignores the learned figures (the fixed model, for comparison).
//!
//! The estimate is then multiplied by SPEC §7's preferred-taint multiplier (never 0, so preferences
//! separate idle candidates too). Lower is better; the host picks the minimum, ties at random.
//!
//! Configuration (all optional; unknown keys rejected). Defaults are SPEC §10's engine model:
//! `{"prefill_ms": [16.50142, 0.01518344, 4.209989e-7], "decode_ms": [5.74, 54.01, -25.74],
//!   "default_max_num_batched_tokens": 8192, "residual_frac": 0.5, "host_tier_weight": 0.75,
//!   "disk_tier_weight": 0.25, "overflow_penalty_ms": 10000, "credit_active_blocks": true,
//!   "work_weight": 6, "learned_step_times": false}`

use kvroute_sdk::{
    check_step_model, parse_config, preferred_multiplier, Candidates, Context, Decision, Policy,
    RelativeSpeeds, Request, Row, Speed, Stage,
};

/// The configuration.
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
    /// Added when the request's blocks would not fit in the candidate's KV capacity.
    pub overflow_penalty_ms: f64,
    /// Count this prompt's blocks already active on a candidate (booked by an earlier request)
    /// as cached.
    pub credit_active_blocks: bool,
    /// Weight of the request's own prefill compute (ms), added on top of its own wait: > 0 favours
    /// cache hits (less work for the fleet) over an earlier first token for this request.
    pub work_weight: f64,
    /// Scale each candidate's prefill and decode terms by its worker's learned step times,
    /// relative to the fleet's (see the module docs).
    pub learned_step_times: bool,
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
            work_weight: 6.0,
            learned_step_times: false,
        }
    }
}

impl Config {
    fn prefill(&self, tokens: f64) -> f64 {
        let [c0, c1, c2] = self.prefill_ms;
        c0 + c1 * tokens + c2 * tokens * tokens
    }

    fn decode(&self, u: f64) -> f64 {
        let [c0, c1, c2] = self.decode_ms;
        (c0 + c1 * u + c2 * u * u).max(1.0)
    }

    /// Estimated milliseconds from now to this request's first token on `r`, at the request's
    /// stage.
    pub fn estimate(&self, req: &Request, r: Row<'_>) -> f64 {
        self.estimate_scaled(req, r, Speed::MODEL)
    }

    /// [`Config::estimate`] with the candidate's prefill and decode terms scaled by `s`.
    pub fn estimate_scaled(&self, req: &Request, r: Row<'_>, s: Speed) -> f64 {
        match req.stage {
            Stage::Aggregated | Stage::Prefill => self.prefill_estimate(req, r, s),
            Stage::Decode => self.decode_estimate(req, r, s),
        }
    }

    /// The step budget of `r`, in tokens.
    fn budget(&self, r: Row<'_>) -> f64 {
        f64::from(match r.max_num_batched_tokens() {
            0 => self.default_max_num_batched_tokens.max(1),
            m => m,
        })
    }

    /// KV utilisation of `r` with `blocks` in use (0 when its capacity is unknown).
    fn util(r: Row<'_>, blocks: u64) -> f64 {
        match r.total_kv_blocks() {
            0 => 0.0,
            total => (blocks as f64 / total as f64).min(1.0),
        }
    }

    /// Blocks of the prompt that `r` must newly hold (those an earlier request made active are
    /// shared).
    fn new_blocks(req: &Request, r: Row<'_>) -> u64 {
        let blocks = req.prompt_tokens.div_ceil(req.block_size.max(1));
        u64::from(blocks.saturating_sub(r.active_prompt_blocks()))
    }

    /// The decode step: milliseconds from the KV cache's arrival on `r` to the first token. The
    /// engine computes no prompt, so overlap earns nothing.
    pub fn decode_estimate(&self, req: &Request, r: Row<'_>, s: Speed) -> f64 {
        let ahead = r.active_prefill_tokens() as f64;
        let chunk = if ahead > 0.0 {
            s.prefill * self.prefill(ahead.min(self.budget(r)))
        } else {
            0.0
        };
        let used = r.active_decode_blocks();
        let new_blocks = Self::new_blocks(req, r);
        let mut est = chunk + s.decode * self.decode(Self::util(r, used + new_blocks));
        if r.active_requests() > 0 || ahead > 0.0 {
            est += self.residual_frac * (chunk + s.decode * self.decode(Self::util(r, used)));
        }
        let total = r.total_kv_blocks();
        if total > 0 && used + new_blocks > total {
            est += self.overflow_penalty_ms;
        }
        est
    }

    /// An aggregated decision or the prefill step: milliseconds from now to the first token of
    /// the prompt computed on `r`.
    pub fn prefill_estimate(&self, req: &Request, r: Row<'_>, s: Speed) -> f64 {
        let b = req.block_size.max(1);
        let isl = req.prompt_tokens;
        let (d, h, k) = (r.device_overlap(), r.host_overlap(), r.disk_overlap());
        let cached = f64::from(d)
            + self.host_tier_weight * f64::from(h.saturating_sub(d))
            + self.disk_tier_weight * f64::from(k.saturating_sub(d.max(h)));
        // Blocks an earlier request booked there computes first (its prefill is in
        // `active_prefill_tokens`); the engine reuses them even before their KV events arrive.
        let credit = if self.credit_active_blocks {
            cached.max(f64::from(r.active_prompt_blocks()))
        } else {
            cached
        };
        // An engine computes at least the prompt's last block.
        let reusable = f64::from(isl.saturating_sub(1) / b);
        let own = (f64::from(isl) - credit.min(reusable) * f64::from(b)).max(1.0);

        let budget = match r.max_num_batched_tokens() {
            0 => self.default_max_num_batched_tokens.max(1),
            m => m,
        } as f64;
        let ahead = r.active_prefill_tokens() as f64;
        let queued = ahead + own;
        let steps = (queued / budget).ceil().max(1.0);
        let [c0, c1, c2] = self.prefill_ms;
        let prefill = s.prefill * (steps * c0 + c1 * queued + c2 * queued * queued / steps);

        let blocks = isl.div_ceil(b);
        let new_blocks = u64::from(blocks.saturating_sub(r.active_prompt_blocks()));
        let used = r.active_decode_blocks();
        let total = r.total_kv_blocks();
        let util = |blocks: u64| {
            if total == 0 {
                0.0
            } else {
                (blocks as f64 / total as f64).min(1.0)
            }
        };
        let busy = r.active_requests() > 0;
        let mut est = prefill;
        if busy {
            est += steps * s.decode * self.decode(util(used + new_blocks));
            let current = if ahead > 0.0 {
                s.prefill * self.prefill(ahead.min(budget))
            } else {
                0.0
            } + s.decode * self.decode(util(used));
            est += self.residual_frac * current;
        }
        // The compute this request adds to the fleet, which later arrivals wait behind.
        est += self.work_weight * s.prefill * (c1 * own + c2 * own * own);
        if total > 0 && used + new_blocks > total {
            est += self.overflow_penalty_ms;
        }
        est
    }
}

/// The policy.
#[derive(Default)]
pub struct TtftAware {
    config: Config,
}

impl Policy for TtftAware {
    /// Prices candidates on its own figures: the host need not compute its native cost.
    fn host_columns(&self) -> kvroute_sdk::HostColumns {
        kvroute_sdk::HostColumns::empty()
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("ttft-aware", json)?;
        check_step_model(
            "ttft-aware",
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
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let speeds = RelativeSpeeds::of(c);
        let learned = self.config.learned_step_times;
        Decision::Costs(
            c.rows()
                .map(|r| {
                    let s = if learned { speeds.get(r) } else { Speed::MODEL };
                    self.config.estimate_scaled(req, r, s) * preferred_multiplier(req, r)
                })
                .collect(),
        )
    }
}

kvroute_sdk::export_policy!(TtftAware);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, learned_fleet, request, Harness};

    #[test]
    fn an_idle_candidate_costs_one_prefill_step() {
        let mut h = Harness::<TtftAware>::new();
        // 1,000 uncached tokens on an idle engine: one step, no decode, no residual.
        h.configure(r#"{"work_weight": 0}"#).unwrap();
        let costs = h.costs(&request(1000), &[candidate(1)]);
        let want = Config::default().prefill(1000.0);
        assert!((costs[0] - want).abs() < 1e-9, "{costs:?} vs {want}");
        // With the default work weight, the request's own compute counts 1 + 6 times.
        h.configure("{}").unwrap();
        let costs = h.costs(&request(1000), &[candidate(1)]);
        let [_, c1, c2] = Config::default().prefill_ms;
        let want = want + 6.0 * (c1 * 1000.0 + c2 * 1e6);
        assert!((costs[0] - want).abs() < 1e-9, "{costs:?} vs {want}");
    }

    #[test]
    fn the_work_weight_trades_this_request_s_wait_for_fleet_work() {
        let mut h = Harness::<TtftAware>::new();
        // 4,096 tokens, half cached on a worker with 1,536 prompt tokens queued; the other is idle.
        // The cached worker gives a later first token (queue) but computes 2,048 fewer tokens.
        let req = request(4096).block_size(64);
        let set = [
            candidate(1)
                .device_overlap(32)
                .active_prefill_tokens(1536)
                .active_requests(1),
            candidate(2),
        ];
        h.configure(r#"{"work_weight": 0}"#).unwrap();
        assert_eq!(h.pick(&req, &set).index, 1, "{:?}", h.costs(&req, &set));
        h.configure(r#"{"work_weight": 6}"#).unwrap();
        assert_eq!(h.pick(&req, &set).index, 0, "{:?}", h.costs(&req, &set));
    }

    #[test]
    fn a_cache_hit_beats_an_idle_engine_for_a_long_prompt() {
        let mut h = Harness::<TtftAware>::new();
        // 16,384 tokens = 256 blocks at 64: all but the last block cached on a decoding worker.
        let req = request(16_384).block_size(64);
        let set = [
            candidate(1),
            candidate(2)
                .device_overlap(256)
                .active_requests(6)
                .active_decode_blocks(2_000),
        ];
        assert_eq!(h.pick(&req, &set).index, 1);
        let costs = h.costs(&req, &set);
        // The cached worker computes one block: about one step plus a decode step and a half.
        assert!(costs[1] < 60.0, "{costs:?}");
        assert!(costs[0] > 200.0, "{costs:?}");
    }

    #[test]
    fn decode_blocks_weigh_little_next_to_prefill_work() {
        let mut h = Harness::<TtftAware>::new();
        let req = request(4096).block_size(64);
        // The native cost prefers worker 1 (fewer blocks in total); the time estimate knows 2,000
        // decoding blocks cost a few ms per step while 2,048 queued prompt tokens cost ~30 ms.
        let set = [
            candidate(1).active_prefill_tokens(2048).active_requests(1),
            candidate(2).active_decode_blocks(2_000).active_requests(8),
        ];
        let (_, _, cols) = kvroute_sdk::testing::build(&req, &set);
        let native: Vec<f64> = cols.view().rows().map(|r| r.base_cost()).collect();
        assert!(native[0] < native[1], "native order: {native:?}");
        let costs = h.costs(&req, &set);
        assert_eq!(h.pick(&req, &set).index, 1, "{costs:?}");
    }

    #[test]
    fn queued_prefill_ahead_delays_a_cached_request() {
        let mut h = Harness::<TtftAware>::new();
        let req = request(8192).block_size(64);
        // Fully cached on 1, but 3 full steps of other prompts are queued there.
        let set = [
            candidate(1)
                .device_overlap(128)
                .active_prefill_tokens(3 * 8192)
                .active_requests(3),
            candidate(2).device_overlap(64).active_requests(1),
        ];
        assert_eq!(h.pick(&req, &set).index, 1);
    }

    #[test]
    fn blocks_an_earlier_request_booked_count_as_cached() {
        let mut h = Harness::<TtftAware>::new();
        // A burst: the same 64-block prompt was just booked on worker 1 (no KV event yet).
        let req = request(4096).block_size(64);
        let set = [
            candidate(1)
                .active_prompt_blocks(64)
                .active_prefill_tokens(4096)
                .active_requests(1),
            candidate(2).active_requests(1).active_decode_blocks(100),
        ];
        assert_eq!(h.pick(&req, &set).index, 0, "{:?}", h.costs(&req, &set));
        h.configure(r#"{"credit_active_blocks": false}"#).unwrap();
        assert_eq!(h.pick(&req, &set).index, 1, "{:?}", h.costs(&req, &set));
    }

    #[test]
    fn overflowing_the_kv_capacity_is_penalised() {
        let mut h = Harness::<TtftAware>::new();
        let req = request(6400).block_size(64);
        let set = [
            candidate(1)
                .device_overlap(99)
                .total_kv_blocks(1000)
                .active_decode_blocks(950)
                .active_requests(4),
            candidate(2).total_kv_blocks(1000).active_requests(0),
        ];
        assert_eq!(h.pick(&req, &set).index, 1);
    }

    #[test]
    fn preferences_separate_idle_candidates() {
        let mut h = Harness::<TtftAware>::new();
        let set = [
            candidate(1).taints(&["zone=a"]),
            candidate(2).taints(&["zone=b"]),
        ];
        assert_eq!(h.pick(&request(256).prefer("zone=b", 0.5), &set).index, 1);
        assert_eq!(h.pick(&request(256).prefer("zone=a", 0.5), &set).index, 0);
    }

    #[test]
    fn the_prefill_step_is_estimated_as_an_aggregated_decision() {
        let mut h = Harness::<TtftAware>::new();
        let req = request(4096).block_size(64);
        let set = [
            candidate(1)
                .device_overlap(32)
                .active_prefill_tokens(1536)
                .active_requests(1),
            candidate(2).active_decode_blocks(500).active_requests(3),
        ];
        assert_eq!(h.costs(&req.clone().prefill(), &set), h.costs(&req, &set));
    }

    #[test]
    fn the_decode_step_ignores_overlap_and_ranks_by_decode_load() {
        let mut h = Harness::<TtftAware>::new();
        // 16,384 tokens = 256 blocks at 64, all cached on worker 1, which is decoding more.
        let req = request(16_384).block_size(64);
        let set = [
            candidate(1)
                .device_overlap(256)
                .active_decode_blocks(6_000)
                .active_requests(12),
            candidate(2).active_decode_blocks(1_000).active_requests(3),
        ];
        // Computing the prompt: the cache hit wins by far.
        assert_eq!(h.pick(&req, &set).worker_id, 1);
        assert_eq!(h.pick(&req.clone().prefill(), &set).worker_id, 1);
        // Receiving the KV cache: only the decode load counts.
        let decode = req.clone().decode();
        assert_eq!(
            h.pick(&decode, &set).worker_id,
            2,
            "{:?}",
            h.costs(&decode, &set)
        );
        // Overlap changes nothing at the decode step.
        let uncached = [set[0].clone().device_overlap(0), set[1].clone()];
        assert_eq!(h.costs(&decode, &set), h.costs(&decode, &uncached));
        // The estimate is one decode step (and the residual of the current one), not a prefill.
        let costs = h.costs(&decode, &set);
        let c = Config::default();
        let u = |b: f64| b / 16_384.0;
        let want = c.decode(u(1_256.0)) + 0.5 * c.decode(u(1_000.0));
        assert!((costs[1] - want).abs() < 1e-9, "{costs:?} vs {want}");
    }

    #[test]
    fn the_decode_step_weighs_queued_prefill_and_kv_pressure() {
        let mut h = Harness::<TtftAware>::new();
        let decode = request(4096).block_size(64).decode();
        // A `both` worker with 8,192 queued prompt tokens mixes a full prefill chunk into the
        // step that decodes this request; a decode-only worker with more KV in use does not.
        let set = [
            candidate(1).active_prefill_tokens(8192).active_requests(2),
            candidate(2).active_decode_blocks(4_000).active_requests(20),
        ];
        assert_eq!(
            h.pick(&decode, &set).worker_id,
            2,
            "{:?}",
            h.costs(&decode, &set)
        );
        // A worker the transferred KV would overflow is penalised.
        let set = [
            candidate(1)
                .total_kv_blocks(1_000)
                .active_decode_blocks(990)
                .active_requests(4),
            candidate(2)
                .total_kv_blocks(1_000)
                .active_decode_blocks(900)
                .active_requests(30),
        ];
        assert_eq!(
            h.pick(&decode, &set).worker_id,
            2,
            "{:?}",
            h.costs(&decode, &set)
        );
        // Preferred taints (the KV-transfer domain) separate equally loaded decode workers.
        let idle = [
            candidate(1).taints(&["topology/zone=a"]),
            candidate(2).taints(&["topology/zone=b"]),
        ];
        let req = request(4096).decode().prefer("topology/zone=a", 0.5);
        assert_eq!(h.pick(&req, &idle).worker_id, 1);
    }

    #[test]
    fn learned_step_times_scale_each_candidate_against_the_fleet() {
        let mut h = Harness::<TtftAware>::new();
        h.configure(r#"{"work_weight": 0, "learned_step_times": true}"#)
            .unwrap();
        // Same load and cache; worker 2 learned twice as slow, worker 3 not learned yet.
        let (set, model) = learned_fleet();
        let costs = h.costs(&request(1000), &set);
        let fixed = h.costs(&request(1000), std::slice::from_ref(&model))[0];
        // Against the mean of the learned ones (0.03, 15): √(2/3) and √(4/3) of the model, and 1.
        assert!(
            (costs[0] - fixed * (2.0f64 / 3.0).sqrt()).abs() < 1e-6,
            "{costs:?} vs {fixed}"
        );
        assert!(
            (costs[1] - fixed * (4.0f64 / 3.0).sqrt()).abs() < 1e-6,
            "{costs:?} vs {fixed}"
        );
        assert!((costs[2] - fixed).abs() < 1e-9, "{costs:?} vs {fixed}");
        // A uniform fleet keeps the model whatever its learned figures.
        let uniform = [
            model
                .clone()
                .prefill_ms_per_token(0.05)
                .decode_step_ms(30.0),
            model.prefill_ms_per_token(0.05).decode_step_ms(30.0),
        ];
        let u = h.costs(&request(1000), &uniform);
        assert!(
            (u[0] - fixed).abs() < 1e-9 && (u[1] - fixed).abs() < 1e-9,
            "{u:?}"
        );
        // Switched off: the fixed model for everyone.
        h.configure(r#"{"work_weight": 0, "learned_step_times": false}"#)
            .unwrap();
        let off = h.costs(&request(1000), &set);
        assert!(off.iter().all(|c| (c - fixed).abs() < 1e-9), "{off:?}");
    }

    #[test]
    fn config_is_checked() {
        let mut h = Harness::<TtftAware>::new();
        assert!(h
            .configure(r#"{"residual_frac": -1}"#)
            .unwrap_err()
            .contains("residual_frac"));
        assert!(h
            .configure(r#"{"prefill_ms": [0, 1, 0]}"#)
            .unwrap_err()
            .contains("prefill_ms"));
        assert!(h.configure(r#"{"nope": 1}"#).unwrap_err().contains("nope"));
        h.configure(r#"{"residual_frac": 0.25, "default_max_num_batched_tokens": 4096}"#)
            .unwrap();
        h.configure("{}").unwrap();
    }
}
