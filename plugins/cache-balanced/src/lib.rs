//! `cache-balanced`: cache affinity while the fleet is balanced, load balancing when it is not.
//!
//! The decision, in the style of SGLang's cache-aware gateway:
//! 1. Load of a candidate = its active requests (configurable: `load` = `requests` or
//!    `prefill_tokens`). The fleet is *imbalanced* when `max - min > balance_abs_threshold` **and**
//!    `max > balance_rel_threshold × min`. Then the least-loaded candidate is picked.
//! 2. Otherwise the candidate with the highest cache match rate (device overlap / prompt blocks)
//!    is picked if that rate exceeds `cache_threshold`; ties go to the less loaded.
//! 3. Otherwise (nothing cached enough) the least-loaded candidate is picked, so new prefixes
//!    spread over the fleet.
//!
//! Configuration (all optional; unknown keys rejected):
//! `{"cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 1.0001, "load": "requests"}`

use kvroute_sdk::{
    parse_config, plugin_info, Candidates, Context, Decision, PluginInfo, PluginKind, Policy,
    Request, Row,
};

/// What counts as load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMeasure {
    Requests,
    PrefillTokens,
}

/// The configuration.
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub cache_threshold: f64,
    pub balance_abs_threshold: f64,
    pub balance_rel_threshold: f64,
    pub load: LoadMeasure,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            cache_threshold: 0.5,
            balance_abs_threshold: 32.0,
            balance_rel_threshold: 1.0001,
            load: LoadMeasure::Requests,
        }
    }
}

/// The policy.
#[derive(Default)]
pub struct CacheBalanced {
    config: Config,
}

impl CacheBalanced {
    fn load(&self, r: Row<'_>) -> f64 {
        match self.config.load {
            LoadMeasure::Requests => f64::from(r.active_requests()),
            LoadMeasure::PrefillTokens => r.active_prefill_tokens() as f64,
        }
    }

    fn least_loaded(&self, c: &Candidates) -> usize {
        c.rows()
            .min_by(|a, b| {
                self.load(*a)
                    .total_cmp(&self.load(*b))
                    .then(a.base_cost().total_cmp(&b.base_cost()))
            })
            .map_or(0, |r| r.index())
    }
}

impl Policy for CacheBalanced {
    fn info(&self, name: &str, version: &str) -> PluginInfo {
        PluginInfo {
            kind: PluginKind::Selector,
            ..plugin_info(name, version)
        }
    }

    fn configure(&mut self, json: &str) -> Result<(), String> {
        let c: Config = parse_config("cache-balanced", json)?;
        if !(0.0..=1.0).contains(&c.cache_threshold) {
            return Err(format!(
                "cache-balanced: cache_threshold must be in [0, 1], got {}",
                c.cache_threshold
            ));
        }
        if !(c.balance_abs_threshold.is_finite() && c.balance_abs_threshold >= 0.0) {
            return Err(
                "cache-balanced: balance_abs_threshold must be a finite number >= 0".into(),
            );
        }
        if !(c.balance_rel_threshold.is_finite() && c.balance_rel_threshold >= 1.0) {
            return Err(
                "cache-balanced: balance_rel_threshold must be a finite number >= 1".into(),
            );
        }
        self.config = c;
        Ok(())
    }

    fn decide(&mut self, _ctx: &Context, req: &Request, c: &Candidates) -> Decision {
        let (min, max) = c
            .rows()
            .map(|r| self.load(r))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), l| {
                (a.min(l), b.max(l))
            });
        let imbalanced = max - min > self.config.balance_abs_threshold
            && max > self.config.balance_rel_threshold * min;
        if imbalanced {
            return Decision::Pick(self.least_loaded(c) as u32);
        }
        let blocks = f64::from(req.request_blocks.max(1));
        let best = c.rows().max_by(|a, b| {
            f64::from(a.device_overlap())
                .total_cmp(&f64::from(b.device_overlap()))
                .then(self.load(*b).total_cmp(&self.load(*a)))
        });
        match best {
            Some(r) if f64::from(r.device_overlap()) / blocks > self.config.cache_threshold => {
                Decision::Pick(r.index() as u32)
            }
            _ => Decision::Pick(self.least_loaded(c) as u32),
        }
    }
}

kvroute_sdk::export_policy!(CacheBalanced);

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_sdk::testing::{candidate, request, Harness};

    #[test]
    fn cache_wins_while_balanced() {
        let mut h = Harness::<CacheBalanced>::new();
        let set = [
            candidate(1).active_requests(3),
            candidate(2).device_overlap(12).active_requests(10),
            candidate(3).active_requests(0),
        ];
        // 16 blocks, 12 cached = 0.75 > 0.5.
        assert_eq!(h.pick(&request(256), &set).worker_id, 2);
        // Below the cache threshold: least loaded.
        let set2 = [
            set[0].clone(),
            set[1].clone().device_overlap(4),
            set[2].clone(),
        ];
        assert_eq!(h.pick(&request(256), &set2).worker_id, 3);
    }

    #[test]
    fn imbalance_overrides_cache() {
        let mut h = Harness::<CacheBalanced>::new();
        let set = [
            candidate(1).device_overlap(16).active_requests(50),
            candidate(2).active_requests(2),
        ];
        assert_eq!(h.pick(&request(256), &set).worker_id, 2);
        h.configure(r#"{"balance_abs_threshold": 100}"#).unwrap();
        assert_eq!(h.pick(&request(256), &set).worker_id, 1);
    }

    #[test]
    fn config_errors_name_the_key() {
        let mut h = Harness::<CacheBalanced>::new();
        assert!(h
            .configure(r#"{"cache_threshold": 2}"#)
            .unwrap_err()
            .contains("cache_threshold"));
        assert!(h
            .configure(r#"{"balance_rel_threshold": 0.5}"#)
            .unwrap_err()
            .contains("balance_rel_threshold"));
        assert!(h
            .configure(r#"{"load": "vibes"}"#)
            .unwrap_err()
            .contains("vibes"));
        h.configure(r#"{"load": "prefill_tokens"}"#).unwrap();
    }
}
