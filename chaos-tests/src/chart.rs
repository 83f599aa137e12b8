//! Line charts as SVG, for the benchmark's pictures: latency CDFs (log-scale
//! milliseconds against the fraction of operations) and throughput against
//! client count. Hand-written SVG so the bench needs no plotting library;
//! the output is plain text that diffs and renders in any browser or in a
//! Markdown viewer.

use std::fmt::Write as _;

/// How values map onto an axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// Evenly spaced values, from `min` to `max`.
    Linear { min: f64, max: f64 },
    /// Evenly spaced powers, from `min` to `max` (both > 0).
    Log { min: f64, max: f64 },
}

impl Scale {
    /// A linear axis from zero (or the lowest value, if negative) to a
    /// rounded maximum above every value.
    pub fn linear_from_zero(values: impl IntoIterator<Item = f64>) -> Scale {
        let max = values.into_iter().fold(0.0_f64, f64::max);
        let step = nice_step(max.max(1e-9) / 5.0);
        Scale::Linear {
            min: 0.0,
            max: (max / step).ceil().max(1.0) * step,
        }
    }

    /// A log axis spanning whole decades around every positive value.
    pub fn log_decades(values: impl IntoIterator<Item = f64>) -> Scale {
        let (lo, hi) = values
            .into_iter()
            .filter(|v| *v > 0.0 && v.is_finite())
            .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if hi <= 0.0 {
            return Scale::Log {
                min: 1.0,
                max: 10.0,
            };
        }
        let min = 10f64.powf(lo.log10().floor());
        let mut max = 10f64.powf(hi.log10().ceil());
        if max <= min {
            max = min * 10.0;
        }
        Scale::Log { min, max }
    }

    /// Where `value` falls, 0.0 (axis start) to 1.0 (axis end), clamped.
    fn fraction(&self, value: f64) -> f64 {
        let f = match *self {
            Scale::Linear { min, max } => (value - min) / (max - min),
            Scale::Log { min, max } => {
                (value.max(min * 1e-3).ln() - min.ln()) / (max.ln() - min.ln())
            }
        };
        f.clamp(0.0, 1.0)
    }

    /// Tick positions: 1-2-5 steps per decade on a log axis, about five
    /// round steps on a linear one.
    fn ticks(&self) -> Vec<f64> {
        match *self {
            Scale::Linear { min, max } => {
                let step = nice_step((max - min) / 5.0);
                let mut ticks = Vec::new();
                let mut v = (min / step).ceil() * step;
                while v <= max + step * 1e-6 {
                    ticks.push(v);
                    v += step;
                }
                ticks
            }
            Scale::Log { min, max } => {
                let mut ticks = Vec::new();
                let mut decade = min;
                while decade <= max * (1.0 + 1e-9) {
                    for m in [1.0, 2.0, 5.0] {
                        let v = decade * m;
                        if v >= min * (1.0 - 1e-9) && v <= max * (1.0 + 1e-9) {
                            ticks.push(v);
                        }
                    }
                    decade *= 10.0;
                }
                ticks
            }
        }
    }
}

/// A round step (1, 2 or 5 times a power of ten) at or above `raw`.
fn nice_step(raw: f64) -> f64 {
    let raw = raw.max(1e-12);
    let magnitude = 10f64.powf(raw.log10().floor());
    let m = raw / magnitude;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// A tick label without trailing zeros: 0.5, 2, 1000, 0.25.
fn tick_label(v: f64) -> String {
    if v >= 1000.0 && (v / 1000.0).fract() == 0.0 {
        return format!("{}k", v / 1000.0);
    }
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    /// An SVG colour.
    pub color: &'static str,
    /// Dashed (the comparison system) or solid.
    pub dashed: bool,
    /// Draw a dot at every point (few points) or not (a CDF's hundreds).
    pub markers: bool,
    /// (x, y) in data units, in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// A chart: axes, labels and lines.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    /// One line under the title: the run's conditions.
    pub subtitle: String,
    pub x_label: String,
    pub y_label: String,
    pub x: Scale,
    pub y: Scale,
    /// Ticks to use on the x axis instead of the scale's own (client counts).
    pub x_ticks: Option<Vec<f64>>,
    pub series: Vec<Series>,
}

/// Colours told apart by most colour-blind readers (Okabe–Ito).
pub const PALETTE: [&str; 7] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
];

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 58.0;
const BOTTOM: f64 = 56.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Chart {
    fn x_px(&self, x: f64) -> f64 {
        LEFT + self.x.fraction(x) * (WIDTH - LEFT - RIGHT)
    }

    fn y_px(&self, y: f64) -> f64 {
        HEIGHT - BOTTOM - self.y.fraction(y) * (HEIGHT - TOP - BOTTOM)
    }

    /// The chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let mut svg = String::new();
        let plot_right = WIDTH - RIGHT;
        let plot_bottom = HEIGHT - BOTTOM;
        // `write!` to a String cannot fail.
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            svg,
            r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="22" font-size="16" font-weight="bold">{}</text>"#,
            escape(&self.title)
        );
        let _ = writeln!(
            svg,
            r##"<text x="{LEFT}" y="40" fill="#555">{}</text>"##,
            escape(&self.subtitle)
        );
        // Grid and tick labels.
        for y in self.y.ticks() {
            let py = self.y_px(y);
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" y1="{py:.1}" x2="{plot_right}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT - 6.0,
                py + 4.0,
                tick_label(y)
            );
        }
        let x_ticks = self.x_ticks.clone().unwrap_or_else(|| self.x.ticks());
        for x in x_ticks {
            let px = self.x_px(x);
            let _ = writeln!(
                svg,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{plot_bottom}" stroke="#eee"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                plot_bottom + 16.0,
                tick_label(x)
            );
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT}" y="{TOP}" width="{:.1}" height="{:.1}" fill="none" stroke="#444"/>"##,
            plot_right - LEFT,
            plot_bottom - TOP
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            (LEFT + plot_right) / 2.0,
            HEIGHT - 14.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            (TOP + plot_bottom) / 2.0,
            escape(&self.y_label)
        );
        // Lines, then the legend beside the plot.
        for (i, series) in self.series.iter().enumerate() {
            let dash = if series.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            if !series.points.is_empty() {
                let mut d = String::new();
                for (j, (x, y)) in series.points.iter().enumerate() {
                    let _ = write!(
                        d,
                        "{}{:.1} {:.1} ",
                        if j == 0 { "M" } else { "L" },
                        self.x_px(*x),
                        self.y_px(*y)
                    );
                }
                let _ = writeln!(
                    svg,
                    r#"<path d="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
                    d.trim_end(),
                    series.color
                );
                if series.markers {
                    for (x, y) in &series.points {
                        let _ = writeln!(
                            svg,
                            r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#,
                            self.x_px(*x),
                            self.y_px(*y),
                            series.color
                        );
                    }
                }
            }
            let ly = TOP + 8.0 + i as f64 * 20.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
                plot_right + 12.0,
                plot_right + 40.0,
                series.color,
                plot_right + 46.0,
                ly + 4.0,
                escape(&series.label)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

/// A CDF's points from sorted latencies in milliseconds: at most `steps + 1`
/// points (evenly spaced fractions), always including the slowest.
pub fn cdf_points(sorted_ms: &[f64], steps: usize) -> Vec<(f64, f64)> {
    let n = sorted_ms.len();
    if n == 0 {
        return Vec::new();
    }
    let steps = steps.max(1);
    let mut points: Vec<(f64, f64)> = (0..=steps)
        .map(|i| {
            let rank = ((i as f64 / steps as f64) * n as f64).ceil() as usize;
            let rank = rank.clamp(1, n);
            (sorted_ms[rank - 1], rank as f64 / n as f64)
        })
        .collect();
    points.dedup();
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>) -> Chart {
        Chart {
            title: "Pairs <per> second & more".into(),
            subtitle: "3 replicas".into(),
            x_label: "clients".into(),
            y_label: "pairs/s".into(),
            x: Scale::Log {
                min: 1.0,
                max: 256.0,
            },
            y: Scale::linear_from_zero([0.0, 2300.0]),
            x_ticks: Some(vec![1.0, 16.0, 64.0, 256.0]),
            series,
        }
    }

    #[test]
    fn linear_axes_round_up_to_a_nice_maximum_and_log_axes_to_whole_decades() {
        assert_eq!(
            Scale::linear_from_zero([120.0, 2300.0]),
            Scale::Linear {
                min: 0.0,
                max: 2500.0
            }
        );
        assert_eq!(
            Scale::log_decades([0.18, 3.0, 95.0]),
            Scale::Log {
                min: 0.1,
                max: 100.0
            }
        );
        let log = Scale::Log {
            min: 0.1,
            max: 10.0,
        };
        let ticks: Vec<String> = log.ticks().into_iter().map(tick_label).collect();
        assert_eq!(ticks, ["0.1", "0.2", "0.5", "1", "2", "5", "10"]);
        assert!((log.fraction(1.0) - 0.5).abs() < 1e-9);
        assert_eq!(log.fraction(1000.0), 1.0, "clamped at the axis end");
        assert_eq!(tick_label(2000.0), "2k");
    }

    #[test]
    fn the_svg_has_one_path_per_nonempty_series_inside_the_plot_and_escapes_text() {
        let svg = chart(vec![
            Series {
                label: "tether".into(),
                color: PALETTE[0],
                dashed: false,
                markers: true,
                points: vec![(1.0, 400.0), (16.0, 1500.0), (64.0, 2300.0)],
            },
            Series {
                label: "etcd".into(),
                color: PALETTE[1],
                dashed: true,
                markers: true,
                points: vec![],
            },
        ])
        .to_svg();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<path ").count(), 1);
        assert_eq!(svg.matches("<circle ").count(), 3);
        assert!(svg.contains("Pairs &lt;per&gt; second &amp; more"));
        assert!(!svg.contains("<per>"));
        // The highest point (64 clients, 2300 of 2500) is inside the plot area.
        let top = TOP + (1.0 - 2300.0 / 2500.0) * (HEIGHT - TOP - BOTTOM);
        assert!(svg.contains(&format!(
            "L{:.1} {:.1}",
            LEFT + 0.75 * (WIDTH - LEFT - RIGHT),
            top
        )));
        // Both series are in the legend, the comparison one dashed.
        assert_eq!(svg.matches("stroke-dasharray").count(), 1);
        assert!(svg.contains(">etcd</text>"));
    }

    #[test]
    fn cdf_points_are_bounded_monotone_and_end_at_the_slowest() {
        let sorted: Vec<f64> = (1..=10_000).map(|i| i as f64 / 100.0).collect();
        let points = cdf_points(&sorted, 200);
        assert!(points.len() <= 201);
        assert!(
            points
                .windows(2)
                .all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1)
        );
        assert_eq!(*points.last().unwrap(), (100.0, 1.0));
        assert_eq!(points[100], (50.0, 0.5));
        assert!(cdf_points(&[], 10).is_empty());
        assert_eq!(cdf_points(&[3.0], 10), vec![(3.0, 1.0)]);
    }
}
