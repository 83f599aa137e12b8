//! The `/metrics` answer: OpenMetrics text from `prometheus-client`
//! registries, and the histogram buckets Tether's latencies share.

use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The content type of OpenMetrics text, which Prometheus asks for first.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The OpenMetrics text of `registries`, in order, with the one `# EOF`
/// the format ends with. Several registries serve a binary whose gauges are
/// read from its state at scrape time beside its long-lived counters.
pub fn encode(registries: &[&Registry]) -> String {
    let mut text = String::new();
    for registry in registries {
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_registry(&mut text, registry);
    }
    let _ = prometheus_client::encoding::text::encode_eof(&mut text);
    text
}

/// `text` (from [`encode`]) as the answer to a scrape.
pub fn response(text: String) -> Response {
    ([(CONTENT_TYPE, OPENMETRICS)], text).into_response()
}

/// A histogram of request-scale latencies in seconds: buckets from 0.25 ms
/// doubling to about 8 s (a fsync, an apply, a commit, a gRPC call).
pub fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

/// A histogram of sub-millisecond latencies in seconds: buckets from 25 µs
/// rising by a quarter to about 0.15 s, fine enough to read a median near
/// 0.2 ms within a few per cent (a call that runs inside another
/// component's serial loop, such as the extender's filter inside
/// kube-scheduler's cycle).
pub fn short_latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_025, 1.25, 40))
}

/// A histogram of waits in seconds: buckets from 1 ms doubling to about
/// 9 minutes (a queued acquire waits for every hold before it).
pub fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[test]
    fn registries_share_one_eof_and_counters_keep_their_total_names() {
        let mut first = Registry::default();
        let counter: Counter = Counter::default();
        first.register("tether_things", "Things seen", counter.clone());
        counter.inc_by(3);
        let mut second = Registry::default();
        let latency = latency_histogram();
        second.register(
            "tether_step_duration_seconds",
            "Step latency",
            latency.clone(),
        );
        latency.observe(0.003);
        let text = encode(&[&first, &second]);
        assert!(text.contains("# TYPE tether_things counter\n"), "{text}");
        assert!(text.contains("\ntether_things_total 3\n"), "{text}");
        assert!(
            text.contains("tether_step_duration_seconds_bucket{le=\"0.004\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_step_duration_seconds_count 1\n"),
            "{text}"
        );
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(text.ends_with("# EOF\n"));
    }
}
