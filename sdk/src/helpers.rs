//! Building blocks most policies need: the host's native cost, the preferred-taint multiplier,
//! picks, typed configuration, and each candidate's learned speed relative to the fleet.

use serde::de::DeserializeOwned;

use crate::{Candidates, Request, Row, Stage};

/// Weights of the native cost (SPEC §7). The defaults are the host's.
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostWeights {
    /// Weight of the prefill term.
    pub prefill_load_scale: f64,
    /// Credit of a host-memory block relative to a device block.
    pub host_tier_weight: f64,
    /// Credit of a disk/external block relative to a device block.
    pub disk_tier_weight: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
        }
    }
}

/// The host's native cost of one candidate, recomputed from its figures (equal to the
/// `base-cost` column with default weights):
/// `prefill_load_scale * max((active_prefill + isl)/B - credit, 0) + active_decode + new_blocks`,
/// where `new_blocks` counts the prompt's blocks rounded up, less those already active.
///
/// `credit` differs from SPEC §7's `1.0*device + 0.75*host + 0.25*disk` on purpose: the tiers
/// are matched independently, so a block held both on the device and in host memory appears in
/// both overlaps. Summing would credit it twice; here host counts only past the device overlap
/// and disk only past both: `device + 0.75*(host - device)⁺ + 0.25*(disk - max(device, host))⁺`.
/// With one tier in use the two formulas agree.
///
/// At [`Stage::Decode`] `credit` is 0, as in the host's decode step: the decode worker receives
/// the KV cache and computes no prompt, so what it holds saves nothing. The request's own prompt
/// term is then the same for every candidate, and the cost ranks by load alone (prefill work
/// queued there and KV blocks).
pub fn native_cost(req: &Request, row: Row<'_>, w: &CostWeights) -> f64 {
    let b = f64::from(req.block_size.max(1));
    let (d, h, k) = (row.device_overlap(), row.host_overlap(), row.disk_overlap());
    let credit = if req.stage == Stage::Decode {
        0.0
    } else {
        f64::from(d)
            + w.host_tier_weight * f64::from(h.saturating_sub(d))
            + w.disk_tier_weight * f64::from(k.saturating_sub(d.max(h)))
    };
    let prefill =
        ((row.active_prefill_tokens() as f64 + f64::from(req.prompt_tokens)) / b - credit).max(0.0);
    let blocks = req.prompt_tokens.div_ceil(req.block_size.max(1));
    let decode = row.active_decode_blocks() as f64
        + f64::from(blocks.saturating_sub(row.active_prompt_blocks()));
    w.prefill_load_scale * prefill + decode
}

/// Native costs of every candidate.
pub fn native_costs(req: &Request, c: &Candidates, w: &CostWeights) -> Vec<f64> {
    c.rows().map(|r| native_cost(req, r, w)).collect()
}

/// The sum of the request's preferred-taint weights the candidate has (0 when none).
pub fn preference_score(req: &Request, row: Row<'_>) -> f64 {
    req.preferred_taints
        .iter()
        .filter(|p| row.has_taint(p.taint))
        .map(|p| f64::from(p.weight))
        .sum()
}

/// SPEC §7's multiplier `exp(-tanh(s))`, in [0.368, 2.718]; 1 for a candidate with no preference.
pub fn preferred_multiplier(req: &Request, row: Row<'_>) -> f64 {
    if req.preferred_taints.is_empty() {
        return 1.0;
    }
    (-preference_score(req, row).tanh()).exp()
}

/// Index of the lowest finite cost (first on ties); `None` when there is none.
pub fn argmin(costs: &[f64]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, &c) in costs.iter().enumerate() {
        if c.is_finite() && best.is_none_or(|(_, b)| c < b) {
            best = Some((i, c));
        }
    }
    best.map(|(i, _)| i)
}

/// Samples an index with `p_i ∝ exp(-(c_i - min)/((max - min)·T))` using `u` in [0, 1) as the
/// random draw (pass your own RNG's output; plugins have no OS randomness). Temperature 0 or all
/// costs equal → [`argmin`].
pub fn softmax_pick(costs: &[f64], temperature: f64, u: f64) -> Option<usize> {
    let finite = costs.iter().copied().filter(|c| c.is_finite());
    let (min, max) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), c| {
        (a.min(c), b.max(c))
    });
    let spread = max - min;
    if !(temperature > 0.0 && spread > 0.0) {
        return argmin(costs);
    }
    let weight = |c: f64| {
        if c.is_finite() {
            (-(c - min) / (spread * temperature)).exp()
        } else {
            0.0
        }
    };
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut target = u.clamp(0.0, 1.0) * total;
    let mut last = None;
    for (i, &c) in costs.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            last = Some(i);
            if target < w {
                return Some(i);
            }
            target -= w;
        }
    }
    last
}

/// Parses a JSON configuration into `T`, with an error message an operator can act on (it names
/// the offending key and, for unknown keys, the accepted ones). `{}` and an empty string give
/// `T::default()` when `T` is `#[serde(default)]`.
pub fn parse_config<T: DeserializeOwned>(policy: &str, json: &str) -> Result<T, String> {
    let json = if json.trim().is_empty() { "{}" } else { json };
    // A configuration is an object: serde would also read a struct from an array of its values.
    if let Some(first) = json.trim_start().chars().next() {
        if first != '{' {
            let what = match first {
                '[' => "an array",
                '"' => "a string",
                'n' => "null",
                't' | 'f' => "a boolean",
                _ => "a number or not JSON",
            };
            return Err(format!(
                "{policy}: invalid configuration: expected a JSON object, got {what}"
            ));
        }
    }
    let de = &mut serde_json::Deserializer::from_str(json);
    let value: T = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            format!("{policy}: invalid configuration: {inner}")
        } else {
            format!("{policy}: invalid configuration: `{path}`: {inner}")
        }
    })?;
    de.end()
        .map_err(|e| format!("{policy}: invalid configuration: {e}"))?;
    Ok(value)
}

/// How fast a candidate is relative to the rest of the fleet, from the host's learned step times
/// (interface 0.6.0's `prefill-ms-per-token` and `decode-step-ms` columns): the square root of its
/// learned figure over the mean of the candidates that have one. A model of one engine's step
/// times, multiplied by these, prices a worker twice as slow as the others 1.41 times as long,
/// while a uniform fleet keeps the model as it is. 1 where the candidate (or every candidate) has
/// not been learned yet.
///
/// Why the square root: the fitted figures scatter under load, and a policy that prices the full
/// ratio feeds the scatter (it avoids the worker that looks slow, which then gets small requests,
/// which make its time per token look larger still). Replayed on Azure code at 40x on a uniform
/// fleet, the full ratio cost 50% on the TTFT p99; the square root costs nothing there and still
/// gains ~10% on the p99 of a fleet with half its workers 2x slower (BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Speed {
    /// Multiplier of prefill times.
    pub prefill: f64,
    /// Multiplier of decode step times.
    pub decode: f64,
}

impl Speed {
    /// The model as configured (nothing learned, or learned figures ignored).
    pub const MODEL: Speed = Speed {
        prefill: 1.0,
        decode: 1.0,
    };
}

/// The fleet means [`Speed`] is relative to, computed once per decision
/// ([`RelativeSpeeds::of`]), then [`RelativeSpeeds::get`] per candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RelativeSpeeds {
    mean_prefill: Option<f64>,
    mean_decode: Option<f64>,
}

impl RelativeSpeeds {
    /// The means of the learned (positive, finite) figures of the candidates.
    pub fn of(c: &Candidates) -> Self {
        fn mean(col: &[f64]) -> Option<f64> {
            let (sum, n) = col
                .iter()
                .filter(|v| v.is_finite() && **v > 0.0)
                .fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
            (n > 0).then(|| sum / f64::from(n))
        }
        Self {
            mean_prefill: mean(c.prefill_ms_per_token),
            mean_decode: mean(c.decode_step_ms),
        }
    }

    /// Candidate `r`'s speed.
    pub fn get(&self, r: Row<'_>) -> Speed {
        let rel = |v: Option<f64>, mean: Option<f64>| match (v, mean) {
            (Some(v), Some(m)) if v.is_finite() => (v / m).sqrt(),
            _ => 1.0,
        };
        Speed {
            prefill: rel(r.prefill_ms_per_token(), self.mean_prefill),
            decode: rel(r.decode_step_ms(), self.mean_decode),
        }
    }
}

/// Checks the step-time model a latency-pricing policy is configured with (`default`,
/// `ttft-aware`): `prefill_ms` `[p0 > 0, p1 >= 0, p2 >= 0]` and `decode_ms` finite, a step budget
/// of at least 1, and each named figure finite and `>= 0`. Errors name the policy, the key and the
/// reason.
pub fn check_step_model(
    policy: &str,
    prefill_ms: &[f64; 3],
    decode_ms: &[f64; 3],
    default_max_num_batched_tokens: u32,
    non_negative: &[(&str, f64)],
) -> Result<(), String> {
    let finite = |v: &[f64]| v.iter().all(|x| x.is_finite());
    if !finite(prefill_ms) || !finite(decode_ms) {
        return Err(format!(
            "{policy}: prefill_ms and decode_ms must be finite numbers"
        ));
    }
    if !(prefill_ms[0] > 0.0 && prefill_ms[1] >= 0.0 && prefill_ms[2] >= 0.0) {
        return Err(format!(
            "{policy}: prefill_ms must be [p0 > 0, p1 >= 0, p2 >= 0] (a step takes time and \
             more tokens never take less)"
        ));
    }
    if default_max_num_batched_tokens == 0 {
        return Err(format!(
            "{policy}: default_max_num_batched_tokens must be at least 1"
        ));
    }
    for &(key, v) in non_negative {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!(
                "{policy}: {key} must be a finite number >= 0, got {v}"
            ));
        }
    }
    Ok(())
}

/// A small, fast, seedable random number generator (SplitMix64) for policies that sample.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A float in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_model_is_checked_naming_the_policy_and_the_key() {
        let ok = |p: [f64; 3], budget: u32, w: f64| {
            check_step_model("p", &p, &[5.0, 50.0, -25.0], budget, &[("work_weight", w)])
        };
        assert_eq!(ok([16.5, 0.015, 4e-7], 8192, 4.0), Ok(()));
        assert_eq!(
            ok([f64::NAN, 0.0, 0.0], 1, 0.0).unwrap_err(),
            "p: prefill_ms and decode_ms must be finite numbers"
        );
        assert_eq!(
            ok([0.0, 0.0, 0.0], 1, 0.0).unwrap_err(),
            "p: prefill_ms must be [p0 > 0, p1 >= 0, p2 >= 0] (a step takes time and more tokens never take less)"
        );
        assert_eq!(
            ok([1.0, 0.0, 0.0], 0, 0.0).unwrap_err(),
            "p: default_max_num_batched_tokens must be at least 1"
        );
        assert_eq!(
            ok([1.0, 0.0, 0.0], 1, -1.0).unwrap_err(),
            "p: work_weight must be a finite number >= 0, got -1"
        );
    }

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Weights {
        decode: f64,
    }

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Config {
        weights: Weights,
        limit: u32,
    }

    #[test]
    fn parse_config_names_the_key_and_wants_an_object() {
        assert_eq!(parse_config::<Config>("p", "").unwrap(), Config::default());
        assert_eq!(
            parse_config::<Config>("p", r#"{"weights": {"decode": 2}}"#)
                .unwrap()
                .weights
                .decode,
            2.0
        );
        let e = parse_config::<Config>("p", r#"{"weights": {"decode": "x"}}"#).unwrap_err();
        assert!(
            e.contains("`weights.decode`") && e.starts_with("p: "),
            "{e}"
        );
        let e = parse_config::<Config>("p", r#"{"limt": 1}"#).unwrap_err();
        assert!(e.contains("limt") && e.contains("limit"), "{e}");
        for (json, what) in [("[1]", "an array"), ("null", "null"), ("3", "a number")] {
            let e = parse_config::<Config>("p", json).unwrap_err();
            assert!(
                e.contains("expected a JSON object") && e.contains(what),
                "{json}: {e}"
            );
        }
        assert!(
            parse_config::<Config>("p", "{} x").is_err(),
            "trailing characters"
        );
    }
}
