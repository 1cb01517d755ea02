//! `default`: the policy `kvroute serve` runs when nothing else is configured.
//!
//! It is the host's native KV-aware cost (SPEC §7: prefill work left after the cache credit, plus
//! decode blocks) with the request's preferred taints applied as a multiplier, minus the weak spot
//! SPEC names: a multiplier does nothing to a cost of 0, so idle or fully cached candidates would
//! tie whatever the request prefers. Here the multiplier applies to `cost + floor` (then `floor` is
//! taken back off), so a preferred candidate wins a tie at 0 while large costs are ordered as
//! before. `floor` defaults to one block of work.
//!
//! Configuration (all optional; unknown keys are rejected):
//! `{"prefill_load_scale": 1.0, "host_tier_weight": 0.75, "disk_tier_weight": 0.25, "preference_floor": 1.0}`

use kvroute_sdk::{
    native_cost, parse_config, preferred_multiplier, Candidates, Context, CostWeights, Decision,
    Policy, Request,
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
        let host_weights = self.config.weights() == CostWeights::default();
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
