//! Latency samples and the figures printed from them, in an HDR histogram
//! (`hdrhistogram`, the field's standard for latency percentiles): three
//! significant digits at any latency from a nanosecond to an hour, in
//! constant memory however long a run records.

use std::time::Duration;

use hdrhistogram::Histogram;

/// The longest latency recorded as itself; longer ones count as this.
const LONGEST_NS: u64 = 3_600_000_000_000;

/// Collected latencies of one measurement.
#[derive(Debug, Clone)]
pub struct Samples {
    nanos: Histogram<u64>,
}

impl Default for Samples {
    fn default() -> Self {
        Self {
            nanos: Histogram::new_with_bounds(1, LONGEST_NS, 3)
                .expect("1 ns to 1 h at 3 significant digits is a valid histogram"),
        }
    }
}

impl Samples {
    /// Adds one latency.
    pub fn push(&mut self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.saturating_record(ns.clamp(1, LONGEST_NS));
    }

    /// Adds all of another set.
    pub fn extend(&mut self, other: Samples) {
        self.nanos
            .add(&other.nanos)
            .expect("histograms with the same bounds add");
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.nanos.len() as usize
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.nanos.is_empty()
    }

    /// The `q` quantile (0.0-1.0); zero when empty.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.nanos.value_at_quantile(q))
    }

    /// A CDF for charts: (latency in ms, fraction at or below) at `steps`
    /// evenly spaced fractions, ending at the slowest; empty when empty.
    pub fn cdf_ms(&self, steps: usize) -> Vec<(f64, f64)> {
        if self.is_empty() {
            return Vec::new();
        }
        let steps = steps.max(1);
        let mut points: Vec<(f64, f64)> = (1..=steps)
            .map(|i| {
                let fraction = i as f64 / steps as f64;
                let ms = self.nanos.value_at_quantile(fraction) as f64 / 1e6;
                (ms, fraction)
            })
            .collect();
        // Several fractions can fall on one recorded value: keep the
        // highest fraction of each.
        points.dedup_by(|later, earlier| {
            if later.0 == earlier.0 {
                earlier.1 = later.1;
                true
            } else {
                false
            }
        });
        points
    }
}

/// Milliseconds with three decimals, for tables.
pub fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the histogram's three significant digits.
    fn close(got: Duration, want: Duration) -> bool {
        (got.as_secs_f64() - want.as_secs_f64()).abs() <= want.as_secs_f64() / 1000.0
    }

    #[test]
    fn quantiles_hold_three_significant_digits() {
        let mut s = Samples::default();
        for ms in 1..=100 {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.len(), 100);
        for (q, want) in [(0.5, 50), (0.99, 99), (1.0, 100)] {
            let got = s.quantile(q);
            assert!(close(got, Duration::from_millis(want)), "p{q}: {got:?}");
        }
        assert_eq!(Samples::default().quantile(0.5), Duration::ZERO);
        let mut both = Samples::default();
        both.extend(s.clone());
        both.extend(s);
        assert_eq!(both.len(), 200);
    }

    #[test]
    fn cdf_points_are_monotone_and_end_at_the_slowest() {
        let mut s = Samples::default();
        for us in 1..=10_000u64 {
            s.push(Duration::from_micros(us * 10));
        }
        let points = s.cdf_ms(200);
        assert!(points.len() <= 200);
        assert!(
            points
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1)
        );
        let (slowest, all) = *points.last().unwrap();
        assert!((slowest - 100.0).abs() <= 0.1, "{slowest}");
        assert_eq!(all, 1.0);
        assert!(Samples::default().cdf_ms(10).is_empty());
        let mut one = Samples::default();
        one.push(Duration::from_millis(3));
        assert_eq!(one.cdf_ms(10).len(), 1);
    }
}
