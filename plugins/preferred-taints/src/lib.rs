//! `preferred-taints`: a scorer stage turning soft taint preferences into a cost, meant to be
//! combined with other scorers in a pipeline (the host sums `weight × cost` over stages).
//!
//! A candidate's preference score `s` is the sum of the weights of the preferred taints it has:
//! the request's `preferred_taints` (unless `use_request` is false) plus the configured `static`
//! ones. The cost is, by `mode`:
//! - `linear`: `-scale × s` (the default; additive, so it separates idle candidates too);
//! - `tanh`: `-scale × tanh(s)` (bounded in (-scale, scale));
//! - `multiplier`: `scale × (exp(-tanh(s)) - 1)` (SPEC §7's multiplier, shifted so neutral is 0).
//!
//! Configuration: `{"mode": "linear", "scale": 1.0, "use_request": true, "static": {"zone=a": 0.3}}`

use std::collections::BTreeMap;

use kvroute_sdk::{parse_config, preference_score, Candidates, Context, Decision, Policy, Request};

/// How a score becomes a cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Linear,
    Tanh,
    Multiplier,
}

/// The configuration.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub mode: Mode,
    pub scale: f64,
    pub use_request: bool,
    #[serde(rename = "static")]
    pub static_preferences: BTreeMap<String, f64>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: Mode::Linear,
            scale: 1.0,
            use_request: true,
            static_preferences: BTreeMap::new(),
        }
    }
}

/// The scorer.
#[derive(Default)]
pub struct PreferredTaints {
    config: Config,
}

impl Policy for PreferredTaints {
    /// Prices candidates on its own figures: the host need not compute its native cost.
    fn host_columns(&self) -> kvroute_sdk::HostColumns {
        kvroute_sdk::HostColumns::empty()
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("preferred-taints", json)?;
        if !(c.scale.is_finite() && c.scale >= 0.0) {
            return Err(format!(
                "preferred-taints: scale must be a finite number >= 0, got {}",
                c.scale
            ));
        }
        for (t, w) in &c.static_preferences {
            if !(w.is_finite() && *w > -1.0 && *w < 1.0) {
                return Err(format!(
                    "preferred-taints: static.{t} must be in (-1, 1), got {w}"
                ));
            }
        }
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let statics: Vec<(u32, f64)> = self
            .config
            .static_preferences
            .iter()
            .filter_map(|(name, w)| ctx.taint_id(name).map(|id| (id, *w)))
            .collect();
        let scale = self.config.scale;
        Decision::Costs(
            c.rows()
                .map(|r| {
                    let mut s = if self.config.use_request {
                        preference_score(req, r)
                    } else {
                        0.0
                    };
                    s += statics
                        .iter()
                        .filter(|(id, _)| r.has_taint(*id))
                        .map(|(_, w)| w)
                        .sum::<f64>();
                    match self.config.mode {
                        Mode::Linear => -scale * s,
                        Mode::Tanh => -scale * s.tanh(),
                        Mode::Multiplier => scale * ((-s.tanh()).exp() - 1.0),
                    }
                })
                .collect(),
        )
    }
}

kvroute_sdk::export_policy!(PreferredTaints);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, request, Harness};

    #[test]
    fn request_and_static_preferences_become_costs() {
        let mut h = Harness::<PreferredTaints>::new();
        let set = [
            candidate(1).taints(&["zone=a"]),
            candidate(2).taints(&["zone=b", "gpu=h100"]),
            candidate(3),
        ];
        let costs = h.costs(&request(64).prefer("zone=b", 0.5), &set);
        assert_eq!(costs, vec![0.0, -0.5, 0.0]);
        h.configure(r#"{"static": {"gpu=h100": 0.25, "zone=a": 0.9}, "mode": "linear"}"#)
            .unwrap();
        let costs = h.costs(&request(64).prefer("zone=b", 0.5), &set);
        assert_eq!(costs, vec![-0.9, -0.75, 0.0]);
        h.configure(r#"{"mode": "multiplier", "use_request": true}"#)
            .unwrap();
        let costs = h.costs(&request(64).prefer("zone=b", 0.5), &set);
        assert!((costs[1] - (0.62995 - 1.0)).abs() < 1e-4, "{costs:?}");
    }

    #[test]
    fn bad_config_is_refused() {
        let mut h = Harness::<PreferredTaints>::new();
        assert!(h
            .configure(r#"{"static": {"a": 1.5}}"#)
            .unwrap_err()
            .contains("static.a"));
        assert!(h.configure(r#"{"mode": "cubic"}"#).is_err());
    }
}
