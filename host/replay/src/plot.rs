//! The replay's plots: the TTFT CDF and the token hit rate over time, as SVG and PNG.
//!
//! They compare policies that often behave alike, so each policy gets its own colour, line width,
//! dash pattern and marker (markers staggered between policies): two curves that coincide still
//! show both. The legend sits in its own panel beside the chart, so it never covers data, and the
//! TTFT axis gets its own ticks (1-2-5, else every integer multiple, else a linear step within the
//! range), since plotters' log axis labels only powers of ten and left a 10–90 ms spread bare.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::report::PolicyRun;

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (1100, 620);
/// Width of the legend panel on the right of each chart.
const LEGEND_W: u32 = 220;
/// Markers per CDF curve.
const CDF_MARKERS: usize = 10;

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

/// How policy `i` is drawn: everything differs from its neighbours, not only the colour.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Look {
    color: RGBColor,
    width: u32,
    /// (dash, gap) in pixels; `None` is solid.
    dash: Option<(u32, u32)>,
    /// 0 circle, 1 triangle, 2 cross, 3 square.
    marker: usize,
}

fn look(i: usize) -> Look {
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
    const DASH: [Option<(u32, u32)>; 4] = [None, Some((12, 6)), Some((3, 4)), Some((16, 4))];
    Look {
        color: C[i % C.len()],
        // Earlier series are wider, so a later one drawn on top leaves its edges visible.
        width: if i == 0 { 4 } else { 2 },
        dash: DASH[i % DASH.len()],
        marker: i % 4,
    }
}

fn draw_line<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    pts: Vec<CT::From>,
    l: Look,
) -> Result<(), String>
where
    CT::From: Clone + 'static,
{
    let style = l.color.stroke_width(l.width);
    match l.dash {
        None => area.draw(&PathElement::new(pts, style)).map_err(err),
        Some((d, g)) => area
            .draw(&DashedPathElement::new(pts, d, g, style))
            .map_err(err),
    }
}

fn draw_marker<DB: DrawingBackend, CT: CoordTranslate>(
    area: &DrawingArea<DB, CT>,
    at: CT::From,
    l: Look,
) -> Result<(), String>
where
    CT::From: Clone + 'static,
{
    let style = l.color.stroke_width(2);
    let e = EmptyElement::at(at);
    match l.marker {
        0 => area.draw(&(e + Circle::new((0, 0), 5, style))),
        1 => area.draw(&(e + TriangleMarker::new((0, 0), 6, style))),
        2 => area.draw(&(e + Cross::new((0, 0), 5, style))),
        _ => area.draw(&(e + Rectangle::new([(-4, -4), (4, 4)], style))),
    }
    .map_err(err)
}

/// The legend, in its own panel: a sample of each policy's line and marker, and its name.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
) -> Result<(), String> {
    area.fill(&WHITE).map_err(err)?;
    let font = (FONT, 15).into_font().color(&BLACK);
    for (i, r) in runs.iter().enumerate() {
        let l = look(i);
        let y = 70 + 30 * i as i32;
        draw_line(area, vec![(10, y), (60, y)], l)?;
        draw_marker(area, (35, y), l)?;
        let mut name = r.result.name.clone();
        if name.chars().count() > 20 {
            name = name.chars().take(19).collect::<String>() + "…";
        }
        area.draw(&Text::new(name, (70, y - 9), font.clone()))
            .map_err(err)?;
    }
    Ok(())
}

/// `v` ms as an axis label: three significant digits at most, no trailing zeros.
fn fmt_ms(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = 2i32
        .saturating_sub(v.abs().log10().floor() as i32)
        .clamp(0, 3) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Ticks (labelled, with a gridline) and light gridlines of a log axis over `lo..hi`: 1-2-5 when
/// that gives five, else every integer multiple of a power of ten, else a linear step; at least
/// four ticks inside the range whatever its width.
pub fn log_ticks(lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    let (k0, k1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let within = |mantissas: &[f64]| -> Vec<f64> {
        let mut v = Vec::new();
        for k in k0..=k1 {
            for m in mantissas {
                // Through the string form, so 3 × 0.1 is 0.3.
                let x: f64 = format!("{m}e{k}").parse().unwrap_or(f64::NAN);
                if (lo..=hi).contains(&x) {
                    v.push(x);
                }
            }
        }
        v
    };
    let all: Vec<f64> = (1..10).map(f64::from).collect();
    let mut ticks = within(&[1.0, 2.0, 5.0]);
    if ticks.len() < 5 {
        ticks = within(&all);
    }
    if ticks.len() < 4 {
        // A narrow range: the largest linear 1-2-5 step that still gives four ticks. Ticks are
        // built from integers and a power of ten so that they print as written (0.22, not
        // 0.22000000000000003).
        let quarter = (hi - lo) / 4.0;
        let e = quarter.log10().floor() as i32;
        let m = [5i64, 2, 1]
            .into_iter()
            .find(|&m| m as f64 * 10f64.powi(e) <= quarter)
            .unwrap_or(1);
        let step = m as f64 * 10f64.powi(e);
        let first = (lo / step - 1e-9).ceil() as i64;
        let last = (hi / step + 1e-9).floor() as i64;
        ticks = (first..=last)
            .map(|k| format!("{}e{e}", k * m).parse().unwrap_or(f64::NAN))
            .collect();
    }
    let light = within(&all)
        .into_iter()
        .filter(|x| !ticks.contains(x))
        .collect();
    (ticks, light)
}

/// At most `max` points of a sorted series, evenly by rank, as (value, cumulative fraction).
pub fn cdf_points(sorted: &[f64], max: usize) -> Vec<(f64, f64)> {
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

/// Where series `i` of `n` puts its CDF markers: at fractions staggered between series, so the
/// markers of coinciding curves do not hide each other.
fn cdf_markers(sorted: &[f64], i: usize, n: usize) -> Vec<(f64, f64)> {
    if sorted.is_empty() {
        return Vec::new();
    }
    (0..CDF_MARKERS)
        .map(|k| {
            let f = (k as f64 + (i as f64 + 1.0) / (n as f64 + 1.0)) / CDF_MARKERS as f64;
            let idx = ((f * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
            (sorted[idx], (idx + 1) as f64 / sorted.len() as f64)
        })
        .collect()
}

/// Which latency a CDF plot draws.
#[derive(Clone, Copy)]
enum Series {
    Ttft,
    Itl,
}

impl Series {
    fn of(self, r: &PolicyRun) -> &[f64] {
        match self {
            Series::Ttft => &r.ttft_sorted,
            Series::Itl => &r.itl_sorted,
        }
    }

    fn x_desc(self) -> &'static str {
        match self {
            Series::Ttft => "TTFT (ms, log scale)",
            Series::Itl => "inter-token latency (ms, log scale)",
        }
    }

    fn y_desc(self) -> &'static str {
        match self {
            Series::Ttft => "fraction of requests",
            Series::Itl => "fraction of token gaps",
        }
    }
}

fn draw_cdf<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
    title: &str,
    series: Series,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, (FONT, 20)).map_err(err)?;
    let (left, legend) = root.split_horizontally(SIZE.0 - LEGEND_W);
    let all = runs.iter().flat_map(|r| series.of(r).iter().copied());
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
    let (ticks, light) = log_ticks(lo, hi);
    let mut chart = ChartBuilder::on(&left)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (lo..hi)
                .log_scale()
                .with_key_points(ticks)
                .with_light_points(light),
            0f64..1.0f64,
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(series.x_desc())
        .y_desc(series.y_desc())
        .x_label_formatter(&|v| fmt_ms(*v))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .bold_line_style(BLACK.mix(0.25))
        .light_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(err)?;
    let area = chart.plotting_area();
    for (i, r) in runs.iter().enumerate() {
        let l = look(i);
        draw_line(area, cdf_points(series.of(r), 2000), l)?;
        for p in cdf_markers(series.of(r), i, runs.len()) {
            draw_marker(area, p, l)?;
        }
    }
    draw_legend(&legend, runs)?;
    root.present().map_err(err)
}

fn draw_hit_rate<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
    title: &str,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, (FONT, 20)).map_err(err)?;
    let (left, legend) = root.split_horizontally(SIZE.0 - LEGEND_W);
    let t_max = runs
        .iter()
        .flat_map(|r| r.hit_rate_series.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.02;
    let mut chart = ChartBuilder::on(&left)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..t_max, 0f64..100.0f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("arrival time (s)")
        .y_desc("token hit rate (%)")
        .x_label_formatter(&|v| fmt_ms(*v))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(err)?;
    let area = chart.plotting_area();
    for (i, r) in runs.iter().enumerate() {
        let l = look(i);
        let pts: Vec<(f64, f64)> = r
            .hit_rate_series
            .iter()
            .map(|&(t, h)| (t, h * 100.0))
            .collect();
        draw_line(area, pts.clone(), l)?;
        for p in pts {
            draw_marker(area, p, l)?;
        }
    }
    draw_legend(&legend, runs)?;
    root.present().map_err(err)
}

/// Writes `ttft_cdf.{png,svg}` and `hit_rate.{png,svg}` into `dir`; returns the paths. `label`
/// (trace, fleet, speedup) ends both titles.
fn draw_one<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    runs: &[PolicyRun],
    which: usize,
    title: &str,
) -> Result<(), String> {
    match which {
        0 => draw_cdf(root, runs, title, Series::Ttft),
        1 => draw_cdf(root, runs, title, Series::Itl),
        _ => draw_hit_rate(root, runs, title),
    }
}

pub fn write_plots(dir: &Path, runs: &[PolicyRun], label: &str) -> Result<Vec<PathBuf>, String> {
    ensure_font()?;
    let mut written = Vec::new();
    let titles = [
        format!("TTFT CDF — {label}"),
        format!("Inter-token latency CDF — {label}"),
        format!("Token hit rate over time — {label}"),
    ];
    for (stem, which) in [("ttft_cdf", 0), ("itl_cdf", 1), ("hit_rate", 2)] {
        let svg = dir.join(format!("{stem}.svg"));
        draw_one(
            &SVGBackend::new(&svg, SIZE).into_drawing_area(),
            runs,
            which,
            &titles[which],
        )?;
        written.push(svg);
        let png = dir.join(format!("{stem}.png"));
        draw_one(
            &BitMapBackend::new(&png, SIZE).into_drawing_area(),
            runs,
            which,
            &titles[which],
        )?;
        written.push(png);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_end_at_one() {
        let v: Vec<f64> = (0..10_000).map(f64::from).collect();
        let p = cdf_points(&v, 100);
        assert!(p.len() <= 101);
        assert_eq!(p.last().unwrap().1, 1.0);
        assert!(cdf_points(&[], 10).is_empty());
    }

    /// A 10–90 ms spread (the axis 9–99 ms) once had no tick at all: plotters labels only powers
    /// of ten on a log axis.
    #[test]
    fn every_ttft_range_gets_ticks_inside_it() {
        let (_, light) = log_ticks(9.0, 99.0);
        for (lo, hi) in [
            (9.0, 99.0),
            (45.0, 66.0),
            (0.2, 0.3),
            (20.0, 5000.0),
            (101.0, 130.0),
        ] {
            let (t, light) = log_ticks(lo, hi);
            assert!(t.len() >= 4, "{lo}..{hi}: {t:?}");
            assert!(t.iter().all(|x| (lo..=hi).contains(x)), "{lo}..{hi}: {t:?}");
            assert!(light.iter().all(|x| !t.contains(x)));
        }
        assert_eq!(
            log_ticks(9.0, 99.0).0,
            vec![9.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
        );
        assert_eq!(
            log_ticks(20.0, 5000.0).0,
            vec![20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0]
        );
        // The Azure code trace's spread: four 1-2-5 ticks are too few.
        assert_eq!(
            log_ticks(14.0, 230.0).0,
            vec![20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 200.0]
        );
        assert_eq!(log_ticks(45.0, 66.0).0, vec![45.0, 50.0, 55.0, 60.0, 65.0]);
        assert_eq!(
            log_ticks(0.2, 0.3).0,
            vec![0.2, 0.22, 0.24, 0.26, 0.28, 0.3]
        );
        assert!(light.is_empty() || light.iter().all(|x| (9.0..=99.0).contains(x)));
    }

    #[test]
    fn labels_have_three_significant_digits_at_most() {
        assert_eq!(fmt_ms(20.0), "20");
        assert_eq!(fmt_ms(0.3), "0.3");
        assert_eq!(fmt_ms(2.5), "2.5");
        assert_eq!(fmt_ms(1000.0), "1000");
        // The time axis starts at 0.
        assert_eq!(fmt_ms(0.0), "0");
    }

    #[test]
    fn policies_differ_in_more_than_colour() {
        for i in 0..3 {
            for j in i + 1..4 {
                let (a, b) = (look(i), look(j));
                assert!(a.dash != b.dash && a.marker != b.marker, "{i} vs {j}");
            }
        }
        // Markers of coinciding curves sit at different heights.
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let (m0, m1) = (cdf_markers(&v, 0, 2), cdf_markers(&v, 1, 2));
        assert!(m0.iter().zip(&m1).all(|(a, b)| a.1 != b.1));
    }
}
