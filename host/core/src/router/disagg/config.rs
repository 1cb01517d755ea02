//! The `[disaggregation]` settings: how the KV transfer constrains the decode worker, whether a
//! fleet with no usable prefill worker may route aggregated, and when a request skips the remote
//! prefill (the bypass rules of Dynamo's conditional disaggregation, with its defaults).
//!
//! A struct of its own, in core, so that `kvroute serve`'s file, the replay simulator and a library
//! caller configure the same thing and [`DisaggConfig::validate`] is the one place its rules live.

use serde::{Deserialize, Serialize};

/// How the chosen prefill worker's transfer domain constrains the decode worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvTransferEnforcement {
    /// No constraint (cross-domain placements are still counted when a domain is set).
    #[default]
    None,
    /// The decode worker must be in the prefill worker's domain (a required taint).
    Required,
    /// The decode worker should be (a preferred taint with `kv_transfer_preferred_weight`).
    Preferred,
}

/// When a request skips the remote prefill and prefills on its decode worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BypassRule {
    #[default]
    Never,
    /// The prompt's part the decode worker lacks is small in tokens and as a share of the prompt.
    IslBounding,
    /// The chosen prefill worker is loaded past `bypass_max_prefill_load`.
    PrefillLoad,
    /// Either of the two.
    IslOrLoad,
}

impl BypassRule {
    pub fn as_str(self) -> &'static str {
        match self {
            BypassRule::Never => "never",
            BypassRule::IslBounding => "isl_bounding",
            BypassRule::PrefillLoad => "prefill_load",
            BypassRule::IslOrLoad => "isl_or_load",
        }
    }

    pub(crate) fn uses_isl(self) -> bool {
        matches!(self, BypassRule::IslBounding | BypassRule::IslOrLoad)
    }

    pub(crate) fn uses_load(self) -> bool {
        matches!(self, BypassRule::PrefillLoad | BypassRule::IslOrLoad)
    }
}

/// Dynamo's default absolute bound of the isl_bounding rule (tokens).
pub const DEFAULT_BYPASS_MAX_UNCACHED_TOKENS: u32 = 2048;
/// Dynamo's default ratio bound of the isl_bounding rule; kvroute's is none (issue 34: a short
/// fresh prompt is cheaper to prefill where it decodes than to send to a prefill worker and back,
/// however little of it is cached), and `bypass_max_uncached_ratio = 0.7` restores Dynamo's rule.
pub const DYNAMO_BYPASS_MAX_UNCACHED_RATIO: f64 = 0.7;

/// Settings of disaggregated routing (API.md, "Disaggregated prefill/decode").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggConfig {
    /// The topology domain the KV transfer should stay in (e.g. `zone`).
    pub kv_transfer_domain: Option<String>,
    pub kv_transfer_enforcement: KvTransferEnforcement,
    /// Weight of the preferred transfer taint, in (0, 1).
    pub kv_transfer_preferred_weight: f64,
    /// `false`: with no eligible prefill worker, route aggregated. `true`: refuse
    /// (`no_prefill_worker`), and refuse `disaggregation: off`.
    pub enforce: bool,
    pub bypass: BypassRule,
    /// isl_bounding: the uncached prompt tokens on the decode worker must be below this...
    pub bypass_max_uncached_tokens: u32,
    /// ...and, when set, below this share of the prompt (off by default; Dynamo's is 0.7).
    pub bypass_max_uncached_ratio: Option<f64>,
    /// prefill_load: the chosen prefill worker is loaded when its unprefilled tokens exceed this
    /// fraction of its `max_num_batched_tokens`.
    pub bypass_max_prefill_load: Option<f64>,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            kv_transfer_domain: None,
            kv_transfer_enforcement: KvTransferEnforcement::None,
            kv_transfer_preferred_weight: 0.5,
            enforce: false,
            bypass: BypassRule::Never,
            bypass_max_uncached_tokens: DEFAULT_BYPASS_MAX_UNCACHED_TOKENS,
            bypass_max_uncached_ratio: None,
            bypass_max_prefill_load: None,
        }
    }
}

impl DisaggConfig {
    /// Checks the settings; the error names the key (without the section).
    pub fn validate(&self) -> Result<(), String> {
        if let Some(d) = &self.kv_transfer_domain {
            if d.is_empty() || d.contains('=') || d.chars().any(char::is_control) {
                return Err(format!(
                    "kv_transfer_domain must be a topology domain name (non-empty, no `=`), \
                     got {d:?}"
                ));
            }
        }
        if self.kv_transfer_enforcement != KvTransferEnforcement::None
            && self.kv_transfer_domain.is_none()
        {
            return Err(
                "kv_transfer_enforcement is set but kv_transfer_domain is not: name the topology \
                 domain (e.g. \"zone\")"
                    .into(),
            );
        }
        let w = self.kv_transfer_preferred_weight;
        if !(w.is_finite() && w > 0.0 && w < 1.0) {
            return Err(format!(
                "kv_transfer_preferred_weight must be strictly between 0 and 1, got {w}"
            ));
        }
        if let Some(r) = self.bypass_max_uncached_ratio {
            if !(r.is_finite() && r > 0.0) {
                return Err(format!(
                    "bypass_max_uncached_ratio must be a finite number > 0, got {r}"
                ));
            }
        }
        match self.bypass_max_prefill_load {
            Some(l) if !(l.is_finite() && l > 0.0) => {
                return Err(format!(
                    "bypass_max_prefill_load must be a finite number > 0, got {l}"
                ))
            }
            None if self.bypass.uses_load() => {
                return Err(format!(
                    "bypass = \"{}\" needs bypass_max_prefill_load (a fraction of \
                     max_num_batched_tokens, e.g. 0.8)",
                    self.bypass.as_str()
                ))
            }
            _ => {}
        }
        if self.enforce && self.bypass != BypassRule::Never {
            return Err(format!(
                "enforce = true refuses local prefill, so bypass must be \"never\", got \"{}\"",
                self.bypass.as_str()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_dynamos_and_bad_settings_name_their_key() {
        let d = DisaggConfig::default();
        assert_eq!(d.validate(), Ok(()));
        assert_eq!(
            (d.bypass_max_uncached_tokens, d.bypass_max_uncached_ratio),
            (2048, None)
        );
        assert_eq!(d.kv_transfer_preferred_weight, 0.5);
        let refused = |c: DisaggConfig, key: &str| {
            let e = c.validate().unwrap_err();
            assert!(e.starts_with(key), "{e}");
        };
        refused(
            DisaggConfig {
                kv_transfer_enforcement: KvTransferEnforcement::Required,
                ..Default::default()
            },
            "kv_transfer_enforcement",
        );
        refused(
            DisaggConfig {
                kv_transfer_domain: Some("zo=ne".into()),
                ..Default::default()
            },
            "kv_transfer_domain",
        );
        for w in [0.0, 1.0, f64::NAN] {
            refused(
                DisaggConfig {
                    kv_transfer_preferred_weight: w,
                    ..Default::default()
                },
                "kv_transfer_preferred_weight",
            );
        }
        refused(
            DisaggConfig {
                bypass: BypassRule::PrefillLoad,
                ..Default::default()
            },
            "bypass",
        );
        refused(
            DisaggConfig {
                bypass_max_uncached_ratio: Some(0.0),
                ..Default::default()
            },
            "bypass_max_uncached_ratio",
        );
        refused(
            DisaggConfig {
                enforce: true,
                bypass: BypassRule::IslBounding,
                ..Default::default()
            },
            "enforce",
        );
        let c: DisaggConfig = serde_json::from_str(
            r#"{"kv_transfer_domain":"zone","kv_transfer_enforcement":"preferred",
                "bypass":"isl_or_load","bypass_max_prefill_load":0.8}"#,
        )
        .unwrap();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.bypass, BypassRule::IslOrLoad);
    }
}
