//! `default`: the policy `kvroute serve` runs when nothing else is configured.
//!
//! It is the host's native KV-aware cost (SPEC §7: prefill work left after the cache credit, plus
//! decode blocks) with the request's preferred taints applied as a multiplier, minus the weak spot
//! SPEC names: a multiplier does nothing to a cost of 0, so idle or fully cached candidates would
//! tie whatever the request prefers. Here the multiplier applies to `cost + floor` (then `floor` is
//! taken back off), so a preferred candidate wins a tie at 0 while large costs are ordered as
//! before. `floor` defaults to one block of work.
//!
//! Stages (`Request::stage`): an aggregated decision and the prefill step of a disaggregated one
//! are ranked as above, cache overlap and all. At the decode step the worker receives the KV
//! cache and computes no prompt, so the policy computes the native cost itself with no overlap
//! credit (the SDK's `native_cost` at `Stage::Decode`), whatever the `base-cost` column says: it
//! ranks by load (prefill work queued there, KV blocks held and the prompt's blocks it will hold),
//! and a candidate never wins the decode step for what it has cached. Preferred taints still apply
//! (the KV-transfer domain arrives as one when the operator prefers transfers within a domain).
//!
//! Configuration (all optional; unknown keys are rejected):
//! `{"prefill_load_scale": 1.0, "host_tier_weight": 0.75, "disk_tier_weight": 0.25, "preference_floor": 1.0}`

use kvroute_sdk::{
    native_cost, parse_config, preferred_multiplier, Candidates, Context, CostWeights, Decision,
    Policy, Request, Stage,
};

/// The configuration.
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub prefill_load_scale: f64,
    pub host_tier_weight: f64,
    pub disk_tier_weight: f64,
    /// Cost added before the preferred-taint multiplier (and removed after), in blocks.
    pub preference_floor: f64,
}

impl Default for Config {
    fn default() -> Self {
        let w = CostWeights::default();
        Self {
            prefill_load_scale: w.prefill_load_scale,
            host_tier_weight: w.host_tier_weight,
            disk_tier_weight: w.disk_tier_weight,
            preference_floor: 1.0,
        }
    }
}

impl Config {
    fn weights(&self) -> CostWeights {
        CostWeights {
            prefill_load_scale: self.prefill_load_scale,
            host_tier_weight: self.host_tier_weight,
            disk_tier_weight: self.disk_tier_weight,
        }
    }
}

/// The default policy.
#[derive(Default)]
pub struct DefaultPolicy {
    config: Config,
}

impl Policy for DefaultPolicy {
    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("default", json)?;
        for (k, v) in [
            ("prefill_load_scale", c.prefill_load_scale),
            ("host_tier_weight", c.host_tier_weight),
            ("disk_tier_weight", c.disk_tier_weight),
            ("preference_floor", c.preference_floor),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "default: {k} must be a finite number >= 0, got {v}"
                ));
            }
        }
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        // At the decode step, never trust a base cost that might credit overlap: the decode
        // worker computes no prompt (`native_cost` gives no credit there).
        let host_weights =
            self.config.weights() == CostWeights::default() && req.stage != Stage::Decode;
        let floor = self.config.preference_floor;
        let w = self.config.weights();
        Decision::Costs(
            c.rows()
                .map(|r| {
                    let base = if host_weights {
                        r.base_cost()
                    } else {
                        native_cost(req, r, &w)
                    };
                    let m = preferred_multiplier(req, r);
                    (base + floor) * m - floor
                })
                .collect(),
        )
    }
}

kvroute_sdk::export_policy!(DefaultPolicy);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, request, Harness};

    #[test]
    fn follows_the_native_cost() {
        let mut h = Harness::<DefaultPolicy>::new();
        let set = [
            candidate(1).active_prefill_tokens(4096),
            candidate(2).device_overlap(16),
            candidate(3),
        ];
        // 256 tokens = 16 blocks: worker 2 has them all cached.
        assert_eq!(h.pick(&request(256), &set).index, 1);
        let costs = h.costs(&request(256), &set);
        assert!(costs[0] > costs[2], "loaded worker costs more: {costs:?}");
    }

    #[test]
    fn preferences_separate_idle_candidates() {
        let mut h = Harness::<DefaultPolicy>::new();
        let set = [
            candidate(1).taints(&["zone=a"]).device_overlap(16),
            candidate(2).taints(&["zone=b"]).device_overlap(16),
        ];
        // Fully cached on both: native cost is 16 decode blocks each... make them truly zero-cost
        // by overriding the base cost, as a fully cached idle candidate has.
        let set = [set[0].clone().base_cost(0.0), set[1].clone().base_cost(0.0)];
        assert_eq!(h.pick(&request(256).prefer("zone=b", 0.5), &set).index, 1);
        assert_eq!(h.pick(&request(256).prefer("zone=a", 0.5), &set).index, 0);
        assert_eq!(h.pick(&request(256).prefer("zone=a", -0.5), &set).index, 1);
    }

    #[test]
    fn the_decode_step_ranks_by_load_not_overlap() {
        let mut h = Harness::<DefaultPolicy>::new();
        // 4,096 tokens = 256 blocks. Worker 1 holds all of them but is busier decoding; worker 2
        // holds nothing and is idle.
        let set = [
            candidate(1).device_overlap(256).active_decode_blocks(64),
            candidate(2),
        ];
        // Aggregated and prefill: 256 blocks of prompt work saved beat 64 decode blocks.
        assert_eq!(h.pick(&request(4096), &set).worker_id, 1);
        assert_eq!(h.pick(&request(4096).prefill(), &set).worker_id, 1);
        // Decode: the KV arrives by transfer, the cache saves nothing, the idle worker wins.
        assert_eq!(h.pick(&request(4096).decode(), &set).worker_id, 2);
        // Even when the base-cost column credits overlap (a host or pipeline that did), and with
        // custom weights.
        let credited = [
            set[0].clone().base_cost(64.0),
            set[1].clone().base_cost(512.0),
        ];
        assert_eq!(h.pick(&request(4096).decode(), &credited).worker_id, 2);
        h.configure(r#"{"prefill_load_scale": 2.0}"#).unwrap();
        assert_eq!(h.pick(&request(4096).decode(), &credited).worker_id, 2);
        assert_eq!(h.pick(&request(4096).prefill(), &set).worker_id, 1);
    }

    #[test]
    fn the_decode_step_weighs_queued_prefill_and_blocks_and_keeps_preferences() {
        let mut h = Harness::<DefaultPolicy>::new();
        // Decode costs differ only by load: 1,600 queued prompt tokens (100 blocks of prefill work
        // on a `both` worker) weigh more than 60 KV blocks.
        let set = [
            candidate(1).active_prefill_tokens(1600).device_overlap(256),
            candidate(2).active_decode_blocks(60),
        ];
        let costs = h.costs(&request(4096).decode(), &set);
        assert!(
            (costs[0] - costs[1] - 40.0).abs() < 1e-9,
            "100 prefill blocks vs 60 decode blocks: {costs:?}"
        );
        assert_eq!(h.pick(&request(4096).decode(), &set).worker_id, 2);
        // A preferred KV-transfer domain separates two equally loaded decode workers.
        let idle = [
            candidate(1).taints(&["topology/zone=a"]),
            candidate(2).taints(&["topology/zone=b"]),
        ];
        let req = request(4096).decode().prefer("topology/zone=b", 0.5);
        assert_eq!(h.pick(&req, &idle).worker_id, 2);
    }

    #[test]
    fn large_costs_keep_the_spec_order_and_config_is_checked() {
        let mut h = Harness::<DefaultPolicy>::new();
        let set = [
            candidate(1).base_cost(1000.0).taints(&["fast"]),
            candidate(2).base_cost(100.0),
        ];
        assert_eq!(h.pick(&request(64).prefer("fast", 0.5), &set).index, 1);
        assert!(h
            .configure(r#"{"preference_floor": -1}"#)
            .unwrap_err()
            .contains("preference_floor"));
        assert!(h.configure(r#"{"nope": 1}"#).unwrap_err().contains("nope"));
        h.configure(r#"{"prefill_load_scale": 2.0}"#).unwrap();
        h.configure("{}").unwrap();
    }
}
