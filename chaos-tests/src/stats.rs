//! Latency samples and the figures printed from them.

use std::time::Duration;

/// Collected latencies of one measurement.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    latencies: Vec<Duration>,
}

impl Samples {
    /// Adds one latency.
    pub fn push(&mut self, latency: Duration) {
        self.latencies.push(latency);
    }

    /// Adds all of another set.
    pub fn extend(&mut self, other: Samples) {
        self.latencies.extend(other.latencies);
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.latencies.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.latencies.is_empty()
    }

    /// All latencies in milliseconds, fastest first (for CDF charts).
    pub fn sorted_ms(&mut self) -> Vec<f64> {
        self.latencies.sort_unstable();
        self.latencies
            .iter()
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect()
    }

    /// The `q` quantile (0.0-1.0), nearest-rank; zero when empty.
    pub fn quantile(&mut self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        self.latencies.sort_unstable();
        let rank =
            ((self.latencies.len() as f64 * q).ceil() as usize).clamp(1, self.latencies.len());
        self.latencies[rank - 1]
    }
}

/// Milliseconds with three decimals, for tables.
pub fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut s = Samples::default();
        for ms in 1..=100 {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.quantile(0.5), Duration::from_millis(50));
        assert_eq!(s.quantile(0.99), Duration::from_millis(99));
        assert_eq!(s.quantile(1.0), Duration::from_millis(100));
        assert_eq!(Samples::default().quantile(0.5), Duration::ZERO);
    }
}
