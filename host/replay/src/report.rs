//! Results of a replay: per-policy metrics, `results.json`, the stdout table and the plots.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use crate::sim::{SimConfig, SimOutput};
use crate::trace::{PrefixSynthesis, Trace};

/// p50 / p90 / p99 and the mean, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Nearest-rank percentile of sorted values (NaN when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn latency(sorted: &[f64]) -> Latency {
    Latency {
        p50: percentile(sorted, 50.0),
        p90: percentile(sorted, 90.0),
        p99: percentile(sorted, 99.0),
        mean: if sorted.is_empty() {
            f64::NAN
        } else {
            sorted.iter().sum::<f64>() / sorted.len() as f64
        },
    }
}

/// Coefficient of variation (population standard deviation / mean); 0 for a constant or empty
/// series.
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// One policy's figures, as written to `results.json`.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub name: String,
    /// What was asked for on the command line (`round-robin`, `default`, a path...).
    pub spec: String,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests that got their last token.
    pub completed: usize,
    /// Requests the router or the worker refused (see `errors`).
    pub refused: usize,
    /// Prompt tokens served from the worker's prefix cache / prompt tokens, over the requests
    /// that got a first token.
    pub token_hit_rate: f64,
    /// Arrival to first token.
    pub ttft_ms: Latency,
    /// Gap between consecutive output tokens of a request, over every gap of every request.
    pub itl_ms: Latency,
    /// Output tokens of completed requests per simulated second (first arrival to last token).
    pub throughput_tok_s: f64,
    /// Coefficient of variation of the number of requests routed to each worker.
    pub load_cov: f64,
    /// Coefficient of variation of the prompt tokens each worker computed (cache misses).
    pub prefill_tokens_cov: f64,
    /// Largest share of the requests any one worker received.
    pub max_worker_share: f64,
    pub requests_per_worker: Vec<u64>,
    pub prefill_tokens_per_worker: Vec<u64>,
    pub preemptions: u64,
    pub evicted_blocks: u64,
    /// Decisions where the policy failed and the router used its native cost.
    pub policy_fallbacks: u64,
    pub kv_events_applied: u64,
    pub kv_events_rejected: u64,
    /// Router or worker refusals by code.
    pub errors: std::collections::BTreeMap<String, u64>,
    /// Simulated time from the first arrival to the last event.
    pub simulated_s: f64,
    /// Wall-clock time of this policy's simulation.
    pub wall_s: f64,
}

/// A policy's result plus the series the plots need.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    pub result: PolicyResult,
    /// Sorted TTFTs (ms).
    pub ttft_sorted: Vec<f64>,
    /// (bucket centre in s, token hit rate of requests arriving in the bucket).
    pub hit_rate_series: Vec<(f64, f64)>,
}

/// Buckets of the hit-rate-over-time plot.
pub const HIT_RATE_BUCKETS: usize = 50;

impl PolicyRun {
    pub fn from_output(
        name: String,
        spec: String,
        out: &SimOutput,
        policy_fallbacks: u64,
        wall_s: f64,
    ) -> Self {
        let mut prompt = 0u64;
        let mut hit = 0u64;
        let mut ttft = Vec::with_capacity(out.requests.len());
        let mut completed = 0usize;
        let mut output_tokens = 0u64;
        let mut errors = std::collections::BTreeMap::new();
        for o in &out.requests {
            if let Some(e) = &o.error {
                *errors.entry(e.clone()).or_insert(0u64) += 1;
            }
            if o.first_token_ms.is_finite() {
                prompt += u64::from(o.prompt_tokens);
                hit += u64::from(o.hit_tokens);
                ttft.push(o.first_token_ms - o.arrival_ms);
            }
            if o.done_ms.is_finite() {
                completed += 1;
                output_tokens += u64::from(o.output_tokens);
            }
        }
        ttft.sort_by(f64::total_cmp);
        let mut itl: Vec<f64> = out.itl_ms.iter().map(|&x| f64::from(x)).collect();
        itl.sort_by(f64::total_cmp);
        let per_worker: Vec<u64> = out.workers.iter().map(|w| w.requests).collect();
        let prefill: Vec<u64> = out.workers.iter().map(|w| w.prefill_tokens).collect();
        let routed: u64 = per_worker.iter().sum();
        let as_f = |v: &[u64]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let span_s = out.end_ms / 1000.0;

        // Hit rate over time, by arrival.
        let last = out
            .requests
            .iter()
            .map(|o| o.arrival_ms)
            .fold(0.0f64, f64::max);
        let width = (last / HIT_RATE_BUCKETS as f64).max(1e-9);
        let mut buckets = vec![(0u64, 0u64); HIT_RATE_BUCKETS];
        for o in out.requests.iter().filter(|o| o.first_token_ms.is_finite()) {
            let b = ((o.arrival_ms / width) as usize).min(HIT_RATE_BUCKETS - 1);
            buckets[b].0 += u64::from(o.hit_tokens);
            buckets[b].1 += u64::from(o.prompt_tokens);
        }
        let hit_rate_series = buckets
            .iter()
            .enumerate()
            .filter(|(_, (_, p))| *p > 0)
            .map(|(i, (h, p))| ((i as f64 + 0.5) * width / 1000.0, *h as f64 / *p as f64))
            .collect();

        let result = PolicyResult {
            name,
            spec,
            requests: out.requests.len(),
            completed,
            refused: out.requests.iter().filter(|o| o.error.is_some()).count(),
            token_hit_rate: if prompt == 0 {
                0.0
            } else {
                hit as f64 / prompt as f64
            },
            ttft_ms: latency(&ttft),
            itl_ms: latency(&itl),
            throughput_tok_s: if span_s > 0.0 {
                output_tokens as f64 / span_s
            } else {
                0.0
            },
            load_cov: coefficient_of_variation(&as_f(&per_worker)),
            prefill_tokens_cov: coefficient_of_variation(&as_f(&prefill)),
            max_worker_share: if routed == 0 {
                0.0
            } else {
                per_worker.iter().copied().max().unwrap_or(0) as f64 / routed as f64
            },
            requests_per_worker: per_worker,
            prefill_tokens_per_worker: prefill,
            preemptions: out.workers.iter().map(|w| w.preemptions).sum(),
            evicted_blocks: out.workers.iter().map(|w| w.evicted_blocks).sum(),
            policy_fallbacks,
            kv_events_applied: out.kv_events_applied,
            kv_events_rejected: out.kv_events_rejected,
            errors,
            simulated_s: span_s,
            wall_s,
        };
        Self {
            result,
            ttft_sorted: ttft,
            hit_rate_series,
        }
    }
}

/// `results.json`.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    pub trace: String,
    pub trace_format: String,
    pub trace_requests: usize,
    pub trace_prompt_tokens: u64,
    pub workers: u32,
    /// The simulated engines.
    pub worker_config: SimConfig,
    /// Arrival compression applied when loading.
    pub speedup: f64,
    pub max_requests: Option<usize>,
    /// Seed of the router's random tie-break and sampling (`--seed`).
    pub seed: u64,
    /// Prefix-sharing parameters, for traces whose prompts were synthesized (Azure).
    pub prefix_synthesis: Option<PrefixSynthesis>,
    /// How each figure is defined.
    pub definitions: Definitions,
    pub policies: Vec<PolicyResult>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Definitions {
    pub token_hit_rate: &'static str,
    pub load_cov: &'static str,
    pub throughput_tok_s: &'static str,
    pub ttft_ms: &'static str,
    pub itl_ms: &'static str,
}

impl Default for Definitions {
    fn default() -> Self {
        Self {
            token_hit_rate: "prompt tokens the chosen worker served from its prefix cache / all prompt tokens (requests that got a first token)",
            load_cov: "coefficient of variation (population std / mean) of the number of requests routed to each worker",
            throughput_tok_s: "output tokens of completed requests / simulated seconds from the first arrival to the last event",
            ttft_ms: "arrival to the end of the engine step that computed the last prompt token; nearest-rank percentiles",
            itl_ms: "time between consecutive output tokens, over all gaps of all requests; nearest-rank percentiles",
        }
    }
}

impl Results {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        trace: &Trace,
        workers: u32,
        sim: &SimConfig,
        speedup: f64,
        max_requests: Option<usize>,
        seed: u64,
        runs: &[PolicyRun],
    ) -> Self {
        Self {
            trace: trace.name.clone(),
            trace_format: trace.format.as_str().to_string(),
            trace_requests: trace.requests.len(),
            trace_prompt_tokens: trace.prompt_tokens(),
            workers,
            worker_config: sim.clone(),
            speedup,
            max_requests,
            seed,
            prefix_synthesis: trace.synthesis,
            definitions: Definitions::default(),
            policies: runs.iter().map(|r| r.result.clone()).collect(),
        }
    }
}

/// The results as a fixed-width table.
pub fn table(runs: &[PolicyRun]) -> String {
    let mut s = String::new();
    let w = runs
        .iter()
        .map(|r| r.result.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(12);
    let _ = writeln!(
        s,
        "{:<w$} {:>8} {:>8} {:>10} {:>10} {:>10} {:>8} {:>8} {:>10} {:>8} {:>8}",
        "policy",
        "requests",
        "hit_rate",
        "ttft_p50",
        "ttft_p90",
        "ttft_p99",
        "itl_p50",
        "itl_p99",
        "tok/s",
        "load_cov",
        "wall_s"
    );
    for r in runs {
        let r = &r.result;
        let _ = writeln!(
            s,
            "{:<w$} {:>8} {:>7.1}% {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>8.2} {:>10.1} {:>8.3} {:>8.2}",
            r.name,
            r.completed,
            r.token_hit_rate * 100.0,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
            r.throughput_tok_s,
            r.load_cov,
            r.wall_s
        );
    }
    s
}

// ---- plots ---------------------------------------------------------------------------------------

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 600);

/// Registers the embedded font (once). Text then renders without any system font.
fn ensure_font() -> Result<(), String> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err("the embedded font could not be loaded".into())
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// At most `max` points of a sorted series, evenly by rank, as (value, cumulative fraction).
fn cdf_points(sorted: &[f64], max: usize) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(max.max(1)).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (sorted[i], (i + 1) as f64 / n as f64))
        .collect();
    if pts.last().map(|p| p.1) != Some(1.0) {
        pts.push((sorted[n - 1], 1.0));
    }
    pts
}

fn draw_ttft_cdf<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
    title: &str,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let all = runs.iter().flat_map(|r| r.ttft_sorted.iter().copied());
    let (lo, hi) = all
        .filter(|v| *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (1.0, 10.0)
    };
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1.0f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(err)?;
    for (i, r) in runs.iter().enumerate() {
        let c = color(i);
        let pts = cdf_points(&r.ttft_sorted, 2000);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(r.result.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

fn draw_hit_rate<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
    title: &str,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let t_max = runs
        .iter()
        .flat_map(|r| r.hit_rate_series.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.02;
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..t_max, 0f64..100.0f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("arrival time (s)")
        .y_desc("token hit rate (%)")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(err)?;
    for (i, r) in runs.iter().enumerate() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = r
            .hit_rate_series
            .iter()
            .map(|&(t, h)| (t, h * 100.0))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(r.result.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Writes `ttft_cdf.{png,svg}` and `hit_rate.{png,svg}` into `dir`; returns the paths.
pub fn write_plots(
    dir: &Path,
    runs: &[PolicyRun],
    trace_label: &str,
) -> Result<Vec<PathBuf>, String> {
    ensure_font()?;
    let mut written = Vec::new();
    let ttft_title = format!("TTFT CDF — {trace_label}");
    let hit_title = format!("Token hit rate over time — {trace_label}");
    for (stem, which) in [("ttft_cdf", 0), ("hit_rate", 1)] {
        let svg = dir.join(format!("{stem}.svg"));
        {
            let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
            if which == 0 {
                draw_ttft_cdf(&root, runs, &ttft_title)?;
            } else {
                draw_hit_rate(&root, runs, &hit_title)?;
            }
        }
        written.push(svg);
        let png = dir.join(format!("{stem}.png"));
        {
            let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
            if which == 0 {
                draw_ttft_cdf(&root, runs, &ttft_title)?;
            } else {
                draw_hit_rate(&root, runs, &hit_title)?;
            }
        }
        written.push(png);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn cov_of_equal_loads_is_zero() {
        assert_eq!(coefficient_of_variation(&[5.0, 5.0, 5.0]), 0.0);
        let c = coefficient_of_variation(&[0.0, 0.0, 0.0, 8.0]);
        assert!((c - 3f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn cdf_points_end_at_one() {
        let v: Vec<f64> = (0..10_000).map(f64::from).collect();
        let p = cdf_points(&v, 100);
        assert!(p.len() <= 101);
        assert_eq!(p.last().unwrap().1, 1.0);
        assert!(cdf_points(&[], 10).is_empty());
    }
}
