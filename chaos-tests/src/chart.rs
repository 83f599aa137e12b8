//! Line charts as SVG, for the benchmark's pictures: latency CDFs (log-scale
//! milliseconds against the fraction of operations) and throughput against
//! client count, drawn by `plotters` with its SVG backend (no fonts or
//! bitmaps: the browser or Markdown viewer renders the text). This module
//! picks the axes (whole decades, round linear steps, the client counts as
//! ticks), the colours and the dashes; plotters draws.

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;

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

    /// Where `value` falls on the drawn axis: itself on a linear axis, its
    /// decimal logarithm on a log one (plotted linearly, labelled with the
    /// value), clamped to the axis.
    fn position(&self, value: f64) -> f64 {
        let (low, high) = self.bounds();
        let at = match *self {
            Scale::Linear { .. } => value,
            Scale::Log { min, .. } => value.max(min * 1e-3).log10(),
        };
        at.clamp(low, high)
    }

    /// The drawn axis' ends (decimal logarithms on a log axis).
    fn bounds(&self) -> (f64, f64) {
        match *self {
            Scale::Linear { min, max } => (min, max),
            Scale::Log { min, max } => (min.log10(), max.log10()),
        }
    }

    /// The value at a drawn position (inverse of [`Scale::position`]).
    fn value(&self, position: f64) -> f64 {
        match *self {
            Scale::Linear { .. } => position,
            Scale::Log { .. } => 10f64.powf(position),
        }
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

const WIDTH: u32 = 760;
const HEIGHT: u32 = 460;
/// Room for the title and subtitle above the plot.
const TOP: u32 = 50;
/// Room for the legend right of the plot.
const LEGEND: u32 = 190;

/// A drawn axis with the ticks this module chose (decades and their 2s and
/// 5s, client counts, round linear steps) as its only grid lines and labels.
struct TickedAxis {
    range: Range<f64>,
    ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let fraction = if span > 0.0 {
            (value - self.range.start) / span
        } else {
            0.0
        };
        limit.0 + (fraction * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Bold grid lines and labels at the ticks; no light lines between.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// `#RRGGBB` as a colour (black if malformed).
fn rgb(hex: &str) -> RGBColor {
    let channel = |i: usize| {
        hex.get(i..i + 2)
            .and_then(|c| u8::from_str_radix(c, 16).ok())
            .unwrap_or(0)
    };
    RGBColor(channel(1), channel(3), channel(5))
}

/// Text as it may stand in an SVG document (for the error picture; plotters
/// escapes the text it draws).
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let mut svg = String::new();
        if let Err(err) = self.draw(&mut svg) {
            // Drawing into a String fails only on a plotters bug; say so in
            // the picture rather than lose the run's tables.
            svg = format!(
                r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}"><text x="10" y="20">chart not drawn: {}</text></svg>"#,
                escape(&err.to_string())
            );
        }
        svg
    }

    fn draw(&self, svg: &mut String) -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (heading, below) = root.split_vertically(TOP);
        heading.draw(&Text::new(
            self.title.clone(),
            (72, 8),
            ("sans-serif", 20).into_font().style(FontStyle::Bold),
        ))?;
        heading.draw(&Text::new(
            self.subtitle.clone(),
            (72, 30),
            ("sans-serif", 15)
                .into_font()
                .color(&RGBColor(0x55, 0x55, 0x55)),
        ))?;
        let (plot, legend) = below.split_horizontally(WIDTH - LEGEND);

        let ticks = |scale: &Scale, given: &Option<Vec<f64>>| -> Vec<f64> {
            given
                .clone()
                .unwrap_or_else(|| scale.ticks())
                .into_iter()
                .map(|v| scale.position(v))
                .collect()
        };
        let (x_low, x_high) = self.x.bounds();
        let (y_low, y_high) = self.y.bounds();
        let mut chart = ChartBuilder::on(&plot)
            .margin(8)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(
                TickedAxis {
                    range: x_low..x_high,
                    ticks: ticks(&self.x, &self.x_ticks),
                },
                TickedAxis {
                    range: y_low..y_high,
                    ticks: ticks(&self.y, &None),
                },
            )?;
        let x_label = |v: &f64| tick_label(self.x.value(*v));
        let y_label = |v: &f64| tick_label(self.y.value(*v));
        chart
            .configure_mesh()
            .x_desc(self.x_label.clone())
            .y_desc(self.y_label.clone())
            .x_label_formatter(&x_label)
            .y_label_formatter(&y_label)
            .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
            .light_line_style(TRANSPARENT)
            .axis_style(RGBColor(0x44, 0x44, 0x44))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 15))
            .draw()?;

        for series in &self.series {
            let color = rgb(series.color);
            let style = color.stroke_width(2);
            let points: Vec<(f64, f64)> = series
                .points
                .iter()
                .map(|(x, y)| (self.x.position(*x), self.y.position(*y)))
                .collect();
            if series.dashed {
                chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, style))?;
            } else {
                chart.draw_series(LineSeries::new(points.clone(), style))?;
            }
            if series.markers {
                chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
            }
        }

        // The legend beside the plot: a short line (dashed for comparisons)
        // and the series' label.
        for (i, series) in self.series.iter().enumerate() {
            let y = 16 + i as i32 * 20;
            let style = rgb(series.color).stroke_width(2);
            let dashes: &[(i32, i32)] = if series.dashed {
                &[(12, 18), (22, 28), (32, 38)]
            } else {
                &[(12, 40)]
            };
            for (from, to) in dashes {
                legend.draw(&PathElement::new(vec![(*from, y), (*to, y)], style))?;
            }
            legend.draw(&Text::new(
                series.label.clone(),
                (46, y - 6),
                ("sans-serif", 15).into_font(),
            ))?;
        }
        root.present()?;
        Ok(())
    }
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
        assert!(log.position(1.0).abs() < 1e-9, "log10(1) = 0");
        assert!((log.value(log.position(5.0)) - 5.0).abs() < 1e-9);
        assert_eq!(log.position(1000.0), 1.0, "clamped at the axis end");
        assert_eq!(tick_label(2000.0), "2k");
    }

    #[test]
    fn the_svg_draws_each_series_its_markers_and_legend_and_escapes_text() {
        let svg = chart(vec![
            Series {
                label: "tether".into(),
                color: PALETTE[0],
                dashed: false,
                markers: true,
                points: vec![(1.0, 400.0), (16.0, 1500.0), (64.0, 2300.0)],
            },
            Series {
                label: "etcd <dashed>".into(),
                color: PALETTE[1],
                dashed: true,
                markers: false,
                points: vec![(1.0, 300.0), (16.0, 900.0), (64.0, 1400.0)],
            },
        ])
        .to_svg();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("Pairs &lt;per&gt; second &amp; more"));
        assert!(!svg.contains("<per>"));
        assert!(svg.contains("etcd &lt;dashed&gt;"));
        // The solid series is one polyline; the dashed one many short ones.
        let blue = svg.matches("#0072B2").count() + svg.matches("#0072b2").count();
        let orange = svg.matches("#D55E00").count() + svg.matches("#d55e00").count();
        assert!(blue >= 5, "line, 3 markers and the legend in blue: {blue}");
        assert!(orange > 10, "dashes of the etcd line: {orange}");
        assert_eq!(
            svg.matches("<circle").count(),
            3,
            "markers of the solid series"
        );
        // Client counts label the x axis, thousands the y axis.
        for label in ["1", "16", "64", "256", "2k"] {
            assert!(
                svg.contains(&format!(">\n{label}\n</text>")),
                "{label} in {svg}"
            );
        }
    }
}
