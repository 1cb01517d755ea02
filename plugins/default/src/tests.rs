//! Unit tests of the default's latency model, run natively through the SDK's harness.

use super::*;
use kvroute_sdk::testing::{build, candidate, learned_fleet, request, Harness};
use kvroute_sdk::Speed;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

#[test]
fn an_idle_candidate_costs_one_prefill_step_plus_the_work_term() {
    let mut h = Harness::<DefaultPolicy>::new();
    let c = Config::default();
    // 1,000 uncached tokens on an idle engine: one step, no decode, no residual; on an idle
    // fleet the work term follows the load to 0.
    h.configure("{}").unwrap();
    let costs = h.costs(&request(1000), &[candidate(1)]);
    let step = c.prefill_ms[0] + c.prefill_ms[1] * 1000.0 + c.prefill_ms[2] * 1e6;
    assert!(close(costs[0], step), "{costs:?} vs {step}");
    // A fixed work weight (the default 12) counts the request's own compute 1 + 12 times.
    assert_eq!(c.work_weight, 12.0);
    h.configure(r#"{"work_weight_follows_load": false}"#)
        .unwrap();
    let costs = h.costs(&request(1000), &[candidate(1)]);
    let want = step + 12.0 * (c.prefill_ms[1] * 1000.0 + c.prefill_ms[2] * 1e6);
    assert!(close(costs[0], want), "{costs:?} vs {want}");
}

#[test]
fn the_work_weight_follows_the_candidates_prefill_load() {
    // Load: 8,192 queued of 8,192 (1), 20,000 of 2,048 (capped at 1), 1,024 of the default
    // 8,192 (0.125), idle (0): mean 2.125 / 4.
    let set = [
        candidate(1).active_prefill_tokens(8192).active_requests(2),
        candidate(2)
            .active_prefill_tokens(20_000)
            .max_num_batched_tokens(2048)
            .active_requests(3),
        candidate(3).active_prefill_tokens(1024).active_requests(1),
        candidate(4),
    ];
    let req = request(3000).block_size(64);
    let (_, _, cols) = build(&req, &set);
    let c = Config::default();
    let load = c.prefill_load(&cols.view());
    assert!(close(load, 2.125 / 4.0), "{load}");
    assert!(close(c.work_weight_at(load), 12.0 * 2.125 / 4.0));
    // The default prices every candidate as the fixed weight 12 × load would.
    let mut h = Harness::<DefaultPolicy>::new();
    let following = h.costs(&req, &set);
    let fixed = format!(
        r#"{{"work_weight": {}, "work_weight_follows_load": false}}"#,
        12.0 * 2.125 / 4.0
    );
    h.configure(&fixed).unwrap();
    let want = h.costs(&req, &set);
    for (a, b) in following.iter().zip(&want) {
        assert!(close(*a, *b), "{following:?} vs {want:?}");
    }
    // The decode step computes no prompt: the load changes nothing there.
    let decode = req.clone().decode();
    h.configure("{}").unwrap();
    let a = h.costs(&decode, &set);
    h.configure(r#"{"work_weight_follows_load": false}"#)
        .unwrap();
    assert_eq!(a, h.costs(&decode, &set));
    // One budget for the whole fleet (the common case) takes the whole-token sum: the same load.
    let uniform = [set[0].clone(), set[2].clone(), set[3].clone()];
    let (_, _, cols) = build(&req, &uniform);
    let load = c.prefill_load(&cols.view());
    assert!(close(load, 1.125 / 3.0), "{load}");
    // An empty column set has no load (the host never sends one; the helper still answers).
    assert_eq!(c.prefill_load(&Default::default()), 0.0);
}

#[test]
fn step_times_come_from_one_place_the_candidate_s_budget_or_the_default() {
    let c = Config::default();
    let req = request(4096).block_size(64);
    let set = [candidate(1).max_num_batched_tokens(2048), candidate(2)];
    let (_, _, cols) = build(&req, &set);
    let view = cols.view();
    let (own, other) = (
        c.step_times(view.row(0).max_num_batched_tokens(), Speed::MODEL),
        c.step_times(view.row(1).max_num_batched_tokens(), Speed::MODEL),
    );
    assert_eq!(own.budget, 2048.0);
    assert_eq!(other.budget, 8192.0);
    // The per-decision shortcut at the model's speed gives the same figures.
    let shared = c.model_step_times();
    assert_eq!((shared(2048), shared(0)), (own, other));
    assert_eq!(own.prefill_ms, c.prefill_ms);
    // A 2,048-token budget splits 4,096 uncached tokens over two steps: two step constants.
    let mut h = Harness::<DefaultPolicy>::new();
    h.configure(r#"{"work_weight": 0}"#).unwrap();
    let costs = h.costs(&req, &set);
    let [p0, p1, p2] = c.prefill_ms;
    assert!(close(
        costs[0],
        2.0 * p0 + p1 * 4096.0 + p2 * 4096.0 * 4096.0 / 2.0
    ));
    assert!(close(costs[1], p0 + p1 * 4096.0 + p2 * 4096.0 * 4096.0));
    // Configured step times flow through the same function into every estimate.
    h.configure(r#"{"work_weight": 0, "prefill_ms": [10, 0.02, 0]}"#)
        .unwrap();
    let costs = h.costs(&req, &set[1..]);
    assert!(close(costs[0], 10.0 + 0.02 * 4096.0), "{costs:?}");
}

#[test]
fn the_work_weight_trades_this_request_s_wait_for_fleet_work() {
    let mut h = Harness::<DefaultPolicy>::new();
    // 4,096 tokens, half cached on a worker with 1,536 prompt tokens queued; the other is idle.
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
    h.configure("{}").unwrap();
    assert_eq!(h.pick(&req, &set).index, 0, "{:?}", h.costs(&req, &set));
}

#[test]
fn a_cache_hit_beats_an_idle_engine_for_a_long_prompt() {
    let mut h = Harness::<DefaultPolicy>::new();
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
    assert!(costs[1] < 60.0 && costs[0] > 200.0, "{costs:?}");
}

#[test]
fn decode_blocks_weigh_little_next_to_queued_prefill_unlike_dynamo_s_cost() {
    let mut h = Harness::<DefaultPolicy>::new();
    let req = request(4096).block_size(64);
    let set = [
        candidate(1).active_prefill_tokens(2048).active_requests(1),
        candidate(2).active_decode_blocks(2_000).active_requests(8),
    ];
    // Dynamo's cost (the base-cost column) prefers worker 1: fewer blocks in total.
    let (_, _, cols) = build(&req, &set);
    let native: Vec<f64> = cols.view().rows().map(|r| r.base_cost()).collect();
    assert!(native[0] < native[1], "native order: {native:?}");
    // In milliseconds, 2,000 decoding blocks cost a few ms per step, 2,048 queued tokens ~30 ms.
    assert_eq!(h.pick(&req, &set).index, 1, "{:?}", h.costs(&req, &set));
}

#[test]
fn queued_prefill_ahead_delays_a_cached_request() {
    let mut h = Harness::<DefaultPolicy>::new();
    let req = request(8192).block_size(64);
    let set = [
        candidate(1)
            .device_overlap(128)
            .active_prefill_tokens(3 * 8192)
            .active_requests(3),
        candidate(2).device_overlap(64).active_requests(1),
    ];
    assert_eq!(h.pick(&req, &set).index, 1, "{:?}", h.costs(&req, &set));
}

#[test]
fn blocks_an_earlier_request_booked_count_as_cached() {
    let mut h = Harness::<DefaultPolicy>::new();
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
    let mut h = Harness::<DefaultPolicy>::new();
    let req = request(6400).block_size(64);
    let set = [
        candidate(1)
            .device_overlap(99)
            .total_kv_blocks(1000)
            .active_decode_blocks(950)
            .active_requests(4),
        candidate(2).total_kv_blocks(1000),
    ];
    assert_eq!(h.pick(&req, &set).index, 1, "{:?}", h.costs(&req, &set));
    let costs = h.costs(&req, &set);
    assert!(
        costs[0] > Config::default().overflow_penalty_ms,
        "{costs:?}"
    );
    h.configure(r#"{"overflow_penalty_ms": 0}"#).unwrap();
    assert_eq!(h.pick(&req, &set).index, 0, "{:?}", h.costs(&req, &set));
}

#[test]
fn preferences_separate_idle_candidates_the_estimate_is_never_zero() {
    let mut h = Harness::<DefaultPolicy>::new();
    let set = [
        candidate(1).taints(&["zone=a"]).device_overlap(16),
        candidate(2).taints(&["zone=b"]).device_overlap(16),
    ];
    // Fully cached and idle on both: Dynamo's cost would tie at 0 whatever the preference.
    let costs = h.costs(&request(256), &set);
    assert!(costs.iter().all(|&c| c > 0.0), "{costs:?}");
    assert_eq!(h.pick(&request(256).prefer("zone=b", 0.5), &set).index, 1);
    assert_eq!(h.pick(&request(256).prefer("zone=a", 0.5), &set).index, 0);
    assert_eq!(h.pick(&request(256).prefer("zone=a", -0.5), &set).index, 1);
    // The multiplier is SPEC §7's: exp(-tanh(0.5)) on the preferred candidate.
    let plain = h.costs(&request(256), &set);
    let pref = h.costs(&request(256).prefer("zone=b", 0.5), &set);
    assert!(
        close(pref[1], plain[1] * (-(0.5f64).tanh()).exp()),
        "{pref:?}"
    );
    assert_eq!(pref[0], plain[0]);
}

#[test]
fn the_decode_step_ranks_by_load_not_overlap() {
    let mut h = Harness::<DefaultPolicy>::new();
    // 16,384 tokens = 256 blocks at 64, all cached on worker 1, which is decoding more.
    let req = request(16_384).block_size(64);
    let set = [
        candidate(1)
            .device_overlap(256)
            .active_decode_blocks(6_000)
            .active_requests(12),
        candidate(2).active_decode_blocks(1_000).active_requests(3),
    ];
    // Computing the prompt: the cache hit wins by far, aggregated or at the prefill step.
    assert_eq!(h.pick(&req, &set).worker_id, 1);
    assert_eq!(h.pick(&req.clone().prefill(), &set).worker_id, 1);
    assert_eq!(h.costs(&req.clone().prefill(), &set), h.costs(&req, &set));
    // Receiving the KV cache: only the load counts, overlap changes nothing.
    let decode = req.clone().decode();
    assert_eq!(
        h.pick(&decode, &set).worker_id,
        2,
        "{:?}",
        h.costs(&decode, &set)
    );
    let uncached = [set[0].clone().device_overlap(0), set[1].clone()];
    assert_eq!(h.costs(&decode, &set), h.costs(&decode, &uncached));
    // One decode step (and half the current one), no prefill and no work term.
    let budget = build(&decode, &set)
        .2
        .view()
        .row(1)
        .max_num_batched_tokens();
    let t = Config::default().step_times(budget, Speed::MODEL);
    let u = |b: f64| b / 16_384.0;
    let want = t.decode(u(1_256.0)) + 0.5 * t.decode(u(1_000.0));
    let costs = h.costs(&decode, &set);
    assert!(close(costs[1], want), "{costs:?} vs {want}");
}

#[test]
fn the_decode_step_weighs_queued_prefill_and_keeps_preferences() {
    let mut h = Harness::<DefaultPolicy>::new();
    let decode = request(4096).block_size(64).decode();
    // A `both` worker with 8,192 queued prompt tokens mixes a full prefill chunk into the step
    // that decodes this request; a decode-only worker with more KV in use does not.
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
    // A preferred KV-transfer domain separates equally loaded decode workers.
    let idle = [
        candidate(1).taints(&["topology/zone=a"]),
        candidate(2).taints(&["topology/zone=b"]),
    ];
    let req = request(4096).decode().prefer("topology/zone=b", 0.5);
    assert_eq!(h.pick(&req, &idle).worker_id, 2);
}

#[test]
fn config_is_checked_and_unknown_keys_are_rejected() {
    let mut h = Harness::<DefaultPolicy>::new();
    for (json, key) in [
        (r#"{"residual_frac": -1}"#, "residual_frac"),
        (r#"{"work_weight": -0.5}"#, "work_weight"),
        (r#"{"prefill_ms": [0, 1, 0]}"#, "prefill_ms"),
        (
            r#"{"default_max_num_batched_tokens": 0}"#,
            "default_max_num_batched_tokens",
        ),
        (r#"{"preference_floor": 1}"#, "preference_floor"),
        (r#"{"nope": 1}"#, "nope"),
    ] {
        let e = h.configure(json).unwrap_err();
        assert!(e.contains(key), "{json}: {e}");
        // A refused configuration changes nothing.
        assert_eq!(*h.policy.config(), Config::default(), "{json}");
    }
    h.configure(r#"{"residual_frac": 0.25, "default_max_num_batched_tokens": 4096}"#)
        .unwrap();
    assert_eq!(h.policy.config().residual_frac, 0.25);
    h.configure("{}").unwrap();
    assert_eq!(*h.policy.config(), Config::default());
}

#[test]
fn learned_step_times_scale_each_candidate_against_the_fleet() {
    let mut h = Harness::<DefaultPolicy>::new();
    // Off unless configured (BENCHMARKS.md: on a uniform fleet near saturation the fitted
    // figures scatter and the p99 suffers).
    assert!(!Config::default().learned_step_times);
    h.configure(r#"{"learned_step_times": true}"#).unwrap();
    // Same load and cache; worker 2 learned twice as slow as worker 1, worker 3 not learned yet.
    let (set, model) = learned_fleet();
    let costs = h.costs(&request(1000), &set);
    let fixed = h.costs(&request(1000), std::slice::from_ref(&model))[0];
    // Against the mean of the learned ones (0.03, 15): √(2/3) and √(4/3) of the model, and 1.
    assert!(
        close(costs[0], fixed * (2.0f64 / 3.0).sqrt()),
        "{costs:?} vs {fixed}"
    );
    assert!(
        close(costs[1], fixed * (4.0f64 / 3.0).sqrt()),
        "{costs:?} vs {fixed}"
    );
    assert!(close(costs[2], fixed), "{costs:?} vs {fixed}");
    // So the slow worker loses to an idle-equal fast one it would otherwise tie with.
    assert!(costs[0] < costs[2] && costs[2] < costs[1]);
    // A uniform fleet keeps the model whatever its learned figures.
    let uniform = [
        model
            .clone()
            .prefill_ms_per_token(0.05)
            .decode_step_ms(30.0),
        model.prefill_ms_per_token(0.05).decode_step_ms(30.0),
    ];
    let u = h.costs(&request(1000), &uniform);
    assert!(close(u[0], fixed) && close(u[1], fixed), "{u:?}");
    // Switched off: the configured model for everyone.
    h.configure(r#"{"learned_step_times": false}"#).unwrap();
    let off = h.costs(&request(1000), &set);
    assert!(off.iter().all(|c| close(*c, fixed)), "{off:?}");
}

/// Interface 0.7.0: the cache credit of a candidate whose KV feed is recovering counts half, of a
/// degraded one nothing; the prompt blocks the router itself booked there keep their credit.
#[test]
fn overlap_on_an_untrusted_feed_is_discounted() {
    use kvroute_sdk::FeedTrust::{Degraded, Exact, Recovering};
    let mut h = Harness::<DefaultPolicy>::new();
    // 4,096 tokens = 256 blocks of 16; each candidate holds 200 of them on the device.
    let req = request(4096);
    let set = |t| {
        [
            candidate(1).device_overlap(200).kv_feed_trust(t),
            candidate(2),
        ]
    };
    let cost = |h: &mut Harness<DefaultPolicy>, t| h.costs(&req, &set(t))[0];
    let (exact, recovering, degraded) = (
        cost(&mut h, Exact),
        cost(&mut h, Recovering),
        cost(&mut h, Degraded),
    );
    let uncached = h.costs(&req, &[candidate(1), candidate(2)])[0];
    assert!(
        exact < recovering && recovering < degraded,
        "{exact} {recovering} {degraded}"
    );
    // Degraded: as if nothing were cached. Recovering: as if half the blocks were.
    assert!(close(degraded, uncached), "{degraded} vs {uncached}");
    let half = h.costs(&req, &[candidate(1).device_overlap(100), candidate(2)])[0];
    assert!(close(recovering, half), "{recovering} vs {half}");
    // The deep hit on an exact feed wins; on a degraded one the idle peer is as good.
    assert_eq!(h.pick(&req, &set(Exact)).worker_id, 1);
    // Blocks an earlier request booked there are the router's own: not discounted.
    let booked = |t| {
        [
            candidate(1)
                .active_prompt_blocks(200)
                .active_requests(1)
                .kv_feed_trust(t),
            candidate(2),
        ]
    };
    assert!(close(
        h.costs(&req, &booked(Degraded))[0],
        h.costs(&req, &booked(Exact))[0]
    ));
    // Configurable, within [0, 1].
    h.configure(r#"{"degraded_overlap_weight": 1, "recovering_overlap_weight": 1}"#)
        .unwrap();
    assert!(close(cost(&mut h, Degraded), exact) && close(cost(&mut h, Recovering), exact));
    let e = h
        .configure(r#"{"recovering_overlap_weight": 1.5}"#)
        .unwrap_err();
    assert!(e.contains("recovering_overlap_weight"), "{e}");
}

/// Interface 0.8.0: the candidate holding the request's session binding (or a new subagent's
/// parent's) is spared `session_credit` of its estimate: it wins ties and small load gaps, and
/// loses to a clearly less loaded peer, so sessions do not pile onto one worker.
#[test]
fn a_session_binding_is_worth_a_modest_share_of_the_estimate() {
    use kvroute_sdk::SessionBound::{Parent, Session};
    let mut h = Harness::<DefaultPolicy>::new();
    let req = request(1024);
    let idle = [
        candidate(1),
        candidate(2).session_bound(Session),
        candidate(3),
    ];
    let plain = h.costs(&req, &[candidate(1), candidate(2), candidate(3)]);
    let costs = h.costs(&req, &idle);
    assert!(close(costs[1], 0.9 * plain[1]), "{costs:?} vs {plain:?}");
    assert!(close(costs[0], plain[0]) && close(costs[2], plain[2]));
    assert_eq!(h.pick(&req, &idle).worker_id, 2);
    let parent = [
        candidate(1),
        candidate(2),
        candidate(3).session_bound(Parent),
    ];
    assert_eq!(h.pick(&req, &parent).worker_id, 3);
    // A small load gap (a few prompt tokens queued) is kept through; a large one (a decoding
    // request and a full step queued) is not.
    let loaded = |tokens, requests| {
        [
            candidate(1),
            candidate(2)
                .session_bound(Session)
                .active_prefill_tokens(tokens)
                .active_requests(requests),
        ]
    };
    assert_eq!(h.pick(&req, &loaded(64, 0)).worker_id, 2);
    assert_eq!(h.pick(&req, &loaded(8192, 1)).worker_id, 1);
    // Configurable within [0, 0.5]; 0 turns it off.
    h.configure(r#"{"session_credit": 0, "parent_session_credit": 0}"#)
        .unwrap();
    let off = h.costs(&req, &idle);
    assert!(close(off[1], plain[1]), "{off:?}");
    for (json, key) in [
        (r#"{"session_credit": 0.6}"#, "session_credit"),
        (
            r#"{"parent_session_credit": -0.1}"#,
            "parent_session_credit",
        ),
    ] {
        let e = h.configure(json).unwrap_err();
        assert!(e.contains(key), "{json}: {e}");
    }
}

/// A new session's first turn (a session id, no binding anywhere) is priced with the work weight
/// capped at each candidate's own load: on a loaded fleet it takes an idle engine that lacks the
/// shared prefix rather than pile onto the loaded ones that hold it. Requests without a session,
/// and a bound session's later turns, keep the fleet's weight and the cache hit.
#[test]
fn a_new_session_s_first_turn_prices_its_miss_by_the_candidate_s_own_load() {
    use kvroute_sdk::SessionBound::Session;
    let mut h = Harness::<DefaultPolicy>::new();
    // 7,500 tokens, 6,000 of them (93 blocks) cached on three loaded workers (6,000 to 8,000
    // prompt tokens queued: fleet load 0.65); one idle and cold.
    let loaded = |id: u64| {
        candidate(id)
            .device_overlap(93)
            .active_prefill_tokens(5000 + 1000 * id)
            .active_requests(40)
            .active_decode_blocks(8000)
            .total_kv_blocks(16_384)
    };
    let set = [
        loaded(1),
        loaded(2),
        loaded(3),
        candidate(4).total_kv_blocks(16_384),
    ];
    let plain = request(7500).block_size(64);
    let first = plain.clone().session("agent-7");
    assert_eq!(
        h.pick(&plain, &set).worker_id,
        1,
        "{:?}",
        h.costs(&plain, &set)
    );
    assert_eq!(
        h.pick(&first, &set).worker_id,
        4,
        "{:?}",
        h.costs(&first, &set)
    );
    // The loaded candidates, each above the fleet's load, are priced as before.
    let (a, b) = (h.costs(&plain, &set), h.costs(&first, &set));
    assert!(close(a[0], b[0]) && b[3] < a[3], "{a:?} vs {b:?}");
    // A later turn (its session bound to worker 1) keeps the fleet's weight and its cache.
    let bound = [
        loaded(1).session_bound(Session),
        loaded(2),
        loaded(3),
        candidate(4).total_kv_blocks(16_384),
    ];
    assert_eq!(
        h.pick(&first, &bound).worker_id,
        1,
        "{:?}",
        h.costs(&first, &bound)
    );
    // Configurable: off, a first turn is priced as any request.
    h.configure(r#"{"new_session_local_work": false}"#).unwrap();
    assert_eq!(h.costs(&first, &set), a);
}

#[test]
fn near_ties_go_to_the_candidate_whose_decode_batch_the_request_slows_least() {
    assert!(!Config::default().decode_pace_tie_break, "off by default");
    let c = Config::default();
    let t = c.step_times(0, Speed::MODEL);
    let total = 16_384.0;
    // 16 blocks; both candidates hold 1,000 blocks, so every step is as long on either. Worker
    // 1 caches the first block (64 tokens, ~1 ms less prefill) but decodes 30 requests, worker 2
    // decodes 2: the same blocks slow 30 requests' steps there.
    let req = request(1024).block_size(64);
    let crowded = candidate(1)
        .device_overlap(1)
        .active_decode_blocks(1_000)
        .active_requests(30);
    let light = candidate(2).active_decode_blocks(1_000).active_requests(2);
    let set = [crowded.clone(), light.clone()];
    let mut h = Harness::<DefaultPolicy>::new();
    let off = h.costs(&req, &set);
    let gap = off[1] - off[0];
    let band = c.residual_frac * t.decode(1_000.0 / total);
    assert!(gap > 0.0 && gap < band, "{off:?}: gap {gap} within {band}");
    assert_eq!(
        h.pick(&req, &set).index,
        0,
        "the cache wins the first token: {off:?}"
    );
    h.configure(r#"{"decode_pace_tie_break": true}"#).unwrap();
    let on = h.costs(&req, &set);
    assert_eq!(
        h.pick(&req, &set).index,
        1,
        "the lighter batch wins the near tie: {on:?}"
    );
    // Two candidates in the band: the lighter pace wins wherever in the band it lies. Each
    // figure is spread over half the band: the lighter batch keeps half its cost gap, the
    // crowded one (the pace spread's top) sits at half the band; both stay inside it.
    let (before, after) = (t.decode(1_000.0 / total), t.decode(1_016.0 / total));
    let pace = |a: f64| (a + 1.0) * after - a * before;
    assert!(pace(2.0) < pace(30.0));
    assert!(close(on[1], off[0] + 0.4995 * gap), "{on:?}");
    assert!(close(on[0], off[0] + 0.4995 * band), "{on:?}");
    assert!(on[0] > on[1] && on[0] < off[0] + band, "{on:?}");
    // Past the band the cache keeps the pick: 8 cached blocks are ~8 ms of prefill, more than
    // half a step, and neither cost moves.
    let deep = [crowded.clone().device_overlap(8), light.clone()];
    h.configure("{}").unwrap();
    let deep_off = h.costs(&req, &deep);
    assert!(deep_off[1] - deep_off[0] > band, "{deep_off:?}");
    h.configure(r#"{"decode_pace_tie_break": true}"#).unwrap();
    assert_eq!(h.costs(&req, &deep), deep_off);
    // An idle cheapest candidate has no step under way to be unsure of: no band, no change.
    let idle_first = [candidate(1).device_overlap(1), light.clone()];
    h.configure("{}").unwrap();
    let idle_off = h.costs(&req, &idle_first);
    h.configure(r#"{"decode_pace_tie_break": true}"#).unwrap();
    assert_eq!(h.costs(&req, &idle_first), idle_off);
    // A disaggregated request decodes elsewhere than its prefill worker, and the decode step
    // ranks by load: neither stage is touched.
    for staged in [req.clone().prefill(), req.clone().decode()] {
        h.configure("{}").unwrap();
        let a = h.costs(&staged, &set);
        h.configure(r#"{"decode_pace_tie_break": true}"#).unwrap();
        assert_eq!(h.costs(&staged, &set), a);
    }
}

#[test]
fn a_near_tie_of_three_weighs_the_estimate_beside_the_pace() {
    let c = Config::default();
    let t = c.step_times(0, Speed::MODEL);
    let total = 16_384.0;
    // 16 blocks of 64 tokens; all three hold 1,000 blocks, so their steps are equally long and
    // their estimates differ by the cache alone (~1 ms of prefill per block, nothing queued).
    // Worker 1 caches 4 blocks but decodes 30 requests; worker 2 caches 3 and decodes 3; worker
    // 3 caches none and decodes 2: the lightest batch, ~4 ms later to the first token.
    let req = request(1024).block_size(64);
    let set = [
        candidate(1)
            .device_overlap(4)
            .active_decode_blocks(1_000)
            .active_requests(30),
        candidate(2)
            .device_overlap(3)
            .active_decode_blocks(1_000)
            .active_requests(3),
        candidate(3).active_decode_blocks(1_000).active_requests(2),
    ];
    let mut h = Harness::<DefaultPolicy>::new();
    let off = h.costs(&req, &set);
    let band = c.residual_frac * t.decode(1_000.0 / total);
    assert!(off[0] < off[1] && off[1] < off[2], "{off:?}");
    assert!(
        off[2] - off[0] < band,
        "all three in the band: {off:?}, band {band}"
    );
    assert_eq!(
        h.pick(&req, &set).index,
        0,
        "the cache wins the first token"
    );
    // The pace alone would take worker 3 (the lightest batch) at the band's edge; worker 2's
    // batch is nearly as light and its first token ~3 ms sooner: it wins on both together.
    let (before, after) = (t.decode(1_000.0 / total), t.decode(1_016.0 / total));
    let pace = |a: f64| (a + 1.0) * after - a * before;
    assert!(pace(2.0) < pace(3.0) && pace(3.0) < pace(30.0));
    h.configure(r#"{"decode_pace_tie_break": true}"#).unwrap();
    let on = h.costs(&req, &set);
    assert_eq!(h.pick(&req, &set).index, 1, "{on:?}");
    let blend = |i: usize, a: f64| {
        off[0]
            + 0.4995 * (off[i] - off[0])
            + 0.4995 * band * (pace(a) - pace(2.0)) / (pace(30.0) - pace(2.0))
    };
    for (i, a) in [(0, 30.0), (1, 3.0), (2, 2.0)] {
        assert!(close(on[i], blend(i, a)), "{i}: {on:?}");
        assert!(on[i] >= off[0] && on[i] < off[0] + band, "{on:?}");
    }
}

#[test]
fn decode_pace_counts_the_request_s_own_step_and_each_running_request_s_slowdown() {
    let c = Config::default();
    let t = c.step_times(0, Speed::MODEL);
    let total = 16_384.0;
    let req = request(1024).block_size(64);
    let (_, request, cols) = build(
        &req,
        &[
            candidate(1).active_decode_blocks(2_000).active_requests(10),
            candidate(2)
                .active_decode_blocks(2_000)
                .active_prompt_blocks(16)
                .active_requests(10),
            candidate(3),
        ],
    );
    let view = cols.view();
    let prompt = Prompt::of(&request, 0.0);
    let paces: Vec<Pace> = Load::all(&view)
        .map(|l| c.decode_pace(&prompt, &l, &t))
        .collect();
    let (before, after) = (t.decode(2_000.0 / total), t.decode(2_016.0 / total));
    assert!(
        close(paces[0].marginal_ms, 11.0 * after - 10.0 * before),
        "{paces:?}"
    );
    assert!(close(paces[0].current_ms, before));
    // Blocks an earlier request booked are shared: only its own step is added.
    assert!(close(paces[1].marginal_ms, before), "{paces:?}");
    // Alone on an idle engine: its own step, nothing under way.
    assert!(close(paces[2].marginal_ms, t.decode(16.0 / total)));
    assert_eq!(paces[2].current_ms, 0.0);
}
