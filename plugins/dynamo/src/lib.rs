//! `dynamo`: Dynamo 1.6's default cost, bit-exact, as a built-in policy beside `default`.
//!
//! kvroute's default policy prices candidates in milliseconds (plugins/default); this one keeps
//! the cost kvroute started from, so every comparison (replays, A/B in production) can name it.
//! It is the host's native decision cost (SPEC §7): the `base-cost` column, which the host
//! computes for the request's stage with the router's `[cost]` weights (at the decode step no
//! overlap credit, as Dynamo), times the preferred-taint multiplier `exp(-tanh(s))`, with no
//! floor: a multiplier does nothing to a cost of 0, exactly as in Dynamo. The costs it returns are
//! the ones `kvroute_core::cost::native_costs` computes, so it picks what the native path picks.
//!
//! Configuration: none (`{}`); the weights are the router's `[cost]` section. Unknown keys are
//! rejected.

use kvroute_sdk::{
    parse_config, preferred_multiplier, Candidates, Context, Decision, Policy, Request,
};

/// The configuration: no keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {}

/// The `dynamo` policy.
#[derive(Default)]
pub struct Dynamo;

impl Policy for Dynamo {
    fn configure(&mut self, json: &str) -> Result<(), String> {
        let _: Config = parse_config("dynamo", json)?;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        Decision::Costs(
            c.rows()
                .map(|r| r.base_cost() * preferred_multiplier(req, r))
                .collect(),
        )
    }
}

kvroute_sdk::export_policy!(Dynamo);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{build, candidate, request, Harness};

    #[test]
    fn the_costs_are_the_base_costs_times_the_multiplier() {
        let mut h = Harness::<Dynamo>::new();
        let set = [
            candidate(1).active_prefill_tokens(4096).taints(&["zone=a"]),
            candidate(2).device_overlap(16).active_decode_blocks(40),
            candidate(3).taints(&["zone=b"]),
        ];
        for req in [
            request(256),
            request(256).prefer("zone=a", 0.5),
            request(256).prefer("zone=b", -0.3).prefill(),
            request(256).prefer("zone=b", 0.7).decode(),
        ] {
            let (_, wire_req, cols) = build(&req, &set);
            let want: Vec<f64> = cols
                .view()
                .rows()
                .map(|r| {
                    let s: f64 = wire_req
                        .preferred_taints
                        .iter()
                        .filter(|p| r.has_taint(p.taint))
                        .map(|p| f64::from(p.weight))
                        .sum();
                    let m = if wire_req.preferred_taints.is_empty() {
                        1.0
                    } else {
                        (-s.tanh()).exp()
                    };
                    r.base_cost() * m
                })
                .collect();
            let got = h.costs(&req, &set);
            assert_eq!(
                got.iter().map(|c| c.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|c| c.to_bits()).collect::<Vec<_>>(),
                "{got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn no_floor_idle_candidates_tie_whatever_the_preference() {
        let mut h = Harness::<Dynamo>::new();
        let set = [
            candidate(1).taints(&["zone=a"]).base_cost(0.0),
            candidate(2).taints(&["zone=b"]).base_cost(0.0),
        ];
        let costs = h.costs(&request(256).prefer("zone=b", 0.5), &set);
        assert_eq!(costs, vec![0.0, 0.0]);
    }

    #[test]
    fn config_takes_no_keys() {
        let mut h = Harness::<Dynamo>::new();
        h.configure("{}").unwrap();
        let e = h.configure(r#"{"preference_floor": 1}"#).unwrap_err();
        assert!(e.contains("preference_floor"), "{e}");
    }
}
