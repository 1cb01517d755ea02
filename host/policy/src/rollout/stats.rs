//! The statistics of a canary: per-arm samples, and confidence intervals of the differences.
//!
//! - Means (TTFT, ITL, cached tokens): Welch's t interval, 95%, with the Welch–Satterthwaite
//!   degrees of freedom (a table of t quantiles up to 30, then `1.96 + 2.4 / df`, within 0.2% of
//!   the exact quantile).
//! - p90: each arm's distribution-free 95% interval of the quantile from order statistics (ranks
//!   `n·0.9 ± 1.96·sqrt(n·0.9·0.1)`), and for the difference the conservative interval from the
//!   ends of both: `[cand_lo − ctrl_hi, cand_hi − ctrl_lo]` (its coverage is at least 90%, and in
//!   practice above 95%: it is wider than the exact interval).
//! - Rates (errors, fallbacks): the normal (Wald) interval of the difference of two proportions.

use serde::{Deserialize, Serialize};

/// Samples kept per arm and figure; later samples are counted but not kept.
pub const MAX_SAMPLES: usize = 100_000;

/// 95% two-sided quantile of Student's t with `df` degrees of freedom.
pub fn t95(df: f64) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if !df.is_finite() || df <= 1.0 {
        return T[0];
    }
    if df <= 30.0 {
        return T[(df.floor() as usize).clamp(1, 30) - 1];
    }
    1.96 + 2.4 / df
}

/// One figure's samples in one arm.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    values: Vec<f64>,
    count: u64,
    sum: f64,
    sum_sq: f64,
}

impl Samples {
    pub fn push(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        self.count += 1;
        self.sum += v;
        self.sum_sq += v * v;
        if self.values.len() < MAX_SAMPLES {
            self.values.push(v);
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        self.sum / self.count as f64
    }

    /// Sample variance (n − 1).
    pub fn variance(&self) -> f64 {
        if self.count < 2 {
            return 0.0;
        }
        let n = self.count as f64;
        ((self.sum_sq - self.sum * self.sum / n) / (n - 1.0)).max(0.0)
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The `q` quantile and its 95% order-statistic interval (0s when empty).
    pub fn quantile_ci(&self, q: f64) -> (f64, f64, f64) {
        let v = self.sorted();
        quantile_ci_sorted(&v, q)
    }

    pub fn summary(&self) -> Summary {
        let v = self.sorted();
        let (p50, _, _) = quantile_ci_sorted(&v, 0.5);
        let (p90, p90_lo, p90_hi) = quantile_ci_sorted(&v, 0.9);
        Summary {
            n: self.count,
            mean: self.mean(),
            sd: self.variance().sqrt(),
            p50,
            p90,
            p90_ci95: [p90_lo, p90_hi],
        }
    }
}

fn quantile_ci_sorted(v: &[f64], q: f64) -> (f64, f64, f64) {
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let nf = n as f64;
    let at = |rank: f64| v[(rank.max(1.0).min(nf) as usize) - 1];
    let half = 1.96 * (nf * q * (1.0 - q)).sqrt();
    (
        at((nf * q).ceil()),
        at((nf * q - half).floor()),
        at((nf * q + half).ceil()),
    )
}

/// A figure of one arm as reported.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub n: u64,
    pub mean: f64,
    pub sd: f64,
    pub p50: f64,
    pub p90: f64,
    /// 95% interval of the p90 (order statistics).
    pub p90_ci95: [f64; 2],
}

/// The candidate's figure minus the control's, with a 95% interval.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Difference {
    /// Candidate − control.
    pub difference: f64,
    /// The difference over the control's figure (0 when the control's is 0).
    pub relative: f64,
    /// 95% confidence interval of the difference.
    pub ci95: [f64; 2],
    /// Whether the interval excludes 0.
    pub significant: bool,
    /// How the interval was computed: `welch_t`, `order_statistics`, `two_proportions`.
    pub method: &'static str,
    /// Samples behind it: candidate, control.
    pub n: [u64; 2],
}

impl Difference {
    fn new(diff: f64, control: f64, lo: f64, hi: f64, method: &'static str, n: [u64; 2]) -> Self {
        Self {
            difference: diff,
            relative: if control != 0.0 { diff / control } else { 0.0 },
            ci95: [lo, hi],
            significant: lo > 0.0 || hi < 0.0,
            method,
            n,
        }
    }
}

/// Welch's t interval of `cand.mean − ctrl.mean`. `None` with fewer than 2 samples in an arm.
pub fn mean_difference(cand: &Samples, ctrl: &Samples) -> Option<Difference> {
    if cand.count < 2 || ctrl.count < 2 {
        return None;
    }
    let (n1, n2) = (cand.count as f64, ctrl.count as f64);
    let (v1, v2) = (cand.variance() / n1, ctrl.variance() / n2);
    let se = (v1 + v2).sqrt();
    let df = if v1 + v2 > 0.0 {
        (v1 + v2).powi(2) / (v1 * v1 / (n1 - 1.0) + v2 * v2 / (n2 - 1.0))
    } else {
        n1 + n2 - 2.0
    };
    let diff = cand.mean() - ctrl.mean();
    let half = t95(df) * se;
    Some(Difference::new(
        diff,
        ctrl.mean(),
        diff - half,
        diff + half,
        "welch_t",
        [cand.count, ctrl.count],
    ))
}

/// The conservative interval of `cand.p90 − ctrl.p90` from each arm's order-statistic interval.
pub fn p90_difference(cand: &Samples, ctrl: &Samples) -> Option<Difference> {
    if cand.count < 2 || ctrl.count < 2 {
        return None;
    }
    let (c, c_lo, c_hi) = cand.quantile_ci(0.9);
    let (k, k_lo, k_hi) = ctrl.quantile_ci(0.9);
    Some(Difference::new(
        c - k,
        k,
        c_lo - k_hi,
        c_hi - k_lo,
        "order_statistics",
        [cand.count, ctrl.count],
    ))
}

/// The Wald interval of the difference of two proportions `a/n − b/m`.
pub fn rate_difference(a: u64, n: u64, b: u64, m: u64) -> Option<Difference> {
    if n == 0 || m == 0 {
        return None;
    }
    let (p1, p2) = (a as f64 / n as f64, b as f64 / m as f64);
    let se = (p1 * (1.0 - p1) / n as f64 + p2 * (1.0 - p2) / m as f64).sqrt();
    let diff = p1 - p2;
    Some(Difference::new(
        diff,
        p2,
        diff - 1.96 * se,
        diff + 1.96 * se,
        "two_proportions",
        [n, m],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(v: impl IntoIterator<Item = f64>) -> Samples {
        let mut s = Samples::default();
        for x in v {
            s.push(x);
        }
        s
    }

    #[test]
    fn welch_matches_a_worked_example() {
        // Worked by hand: means 19.78 and 21.95, standard error 0.5416, Welch–Satterthwaite df
        // 12.6 (the table's t quantile for 12: 2.179), so -2.17 ± 1.180.
        let a = samples([19.1, 20.3, 18.8, 21.0, 20.1, 19.7, 18.9, 20.4, 19.5, 20.0]);
        let b = samples([21.0, 22.6, 19.8, 23.9, 20.5, 24.1, 21.7, 22.3, 20.2, 23.4]);
        let d = mean_difference(&a, &b).unwrap();
        assert!((d.difference - -2.17).abs() < 1e-9, "{d:?}");
        assert!(d.significant && d.ci95[1] < 0.0, "{d:?}");
        assert!(
            (d.ci95[0] - -3.350).abs() < 0.005 && (d.ci95[1] - -0.990).abs() < 0.005,
            "{d:?}"
        );
    }

    #[test]
    fn identical_arms_are_not_significant() {
        let a = samples((0..200).map(|i| (i % 17) as f64));
        let b = samples((0..300).map(|i| (i % 17) as f64));
        assert!(!mean_difference(&a, &b).unwrap().significant);
        assert!(!p90_difference(&a, &b).unwrap().significant);
        assert!(!rate_difference(3, 100, 3, 100).unwrap().significant);
    }

    #[test]
    fn a_shifted_arm_is_significant_in_mean_and_p90() {
        let a = samples((0..400).map(|i| 100.0 + (i % 50) as f64));
        let b = samples((0..400).map(|i| 50.0 + (i % 50) as f64));
        let m = mean_difference(&a, &b).unwrap();
        assert!(m.significant && m.ci95[0] > 45.0, "{m:?}");
        let p = p90_difference(&a, &b).unwrap();
        assert!(p.significant && (p.difference - 50.0).abs() < 1.5, "{p:?}");
        assert!(rate_difference(30, 100, 2, 100).unwrap().significant);
    }

    #[test]
    fn t_quantiles() {
        assert_eq!(t95(1.0), 12.706);
        assert_eq!(t95(10.5), 2.228);
        assert!((t95(60.0) - 2.000).abs() < 0.005);
        assert!((t95(1e9) - 1.96).abs() < 1e-6);
    }
}

/// A [`Difference`] as read back (a record another replica wrote, or a state store kept).
#[derive(Deserialize)]
struct DifferenceWire {
    difference: f64,
    relative: f64,
    ci95: [f64; 2],
    significant: bool,
    method: String,
    n: [u64; 2],
}

// By hand: derived, the `&'static str` would tie it to `'static` input.
impl<'de> Deserialize<'de> for Difference {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = DifferenceWire::deserialize(d)?;
        Ok(Self {
            difference: w.difference,
            relative: w.relative,
            ci95: w.ci95,
            significant: w.significant,
            method: super::known_str(
                &w.method,
                &["welch_t", "order_statistics", "two_proportions"],
            )
            .map_err(serde::de::Error::custom)?,
            n: w.n,
        })
    }
}
