//! What `tether-extender` and `tether-device-plugin` count, served as
//! OpenMetrics on `/metrics` (`prometheus-client`, as tetherd and the bridge
//! do). These are the two places where a GPU pod is bound or admitted, so
//! their failures are the ones an operator pages on: a refused `Allocate`
//! is a pod the kubelet failed.
//!
//! Counter names are registered without `_total`; the encoder adds it.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tether_http::metrics::{latency_histogram, short_latency_histogram, wait_histogram};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabel {
    health: &'static str,
}

/// A family whose known outcomes start at zero, so `increase()` sees the
/// first event of each.
fn outcomes(known: &[&'static str]) -> Family<OutcomeLabel, Counter> {
    let family = Family::<OutcomeLabel, Counter>::default();
    for outcome in known {
        let _ = family.get_or_create(&OutcomeLabel { outcome });
    }
    family
}

/// What a bind verb call ended in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindOutcome {
    /// Bound (or found bound by an earlier attempt).
    Bound,
    /// Refused: the scheduler backs off and schedules the pod again.
    Refused,
}

/// The extender's counters.
pub struct ExtenderMetrics {
    registry: Registry,
    binds: Family<OutcomeLabel, Counter>,
    bind_duration: Histogram,
    filters: Family<OutcomeLabel, Counter>,
    filter_duration: Histogram,
    filter_cpu: Counter<f64, std::sync::atomic::AtomicU64>,
    nudges: Counter,
    bind_overlaps: Counter,
    stale_plans: Counter,
}

impl Default for ExtenderMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let binds = outcomes(&["bound", "refused"]);
        registry.register(
            "tether_extender_binds",
            "Bind verb calls by outcome (refused: the scheduler retries the pod)",
            binds.clone(),
        );
        let bind_duration = wait_histogram();
        registry.register(
            "tether_extender_bind_duration_seconds",
            "Bind verb calls, from the request to the answer (includes the wait in the node's queue)",
            bind_duration.clone(),
        );
        let filters = outcomes(&["answered", "error"]);
        registry.register(
            "tether_extender_filters",
            "Filter verb calls by outcome (error: the scheduling attempt fails)",
            filters.clone(),
        );
        // The filter runs inside kube-scheduler's one-pod-at-a-time
        // scheduling cycle: its time is added to every pod's.
        let filter_duration = short_latency_histogram();
        registry.register(
            "tether_extender_filter_duration_seconds",
            "Filter verb calls, from the request to the answer (kube-scheduler waits for each before it schedules the next pod)",
            filter_duration.clone(),
        );
        // Its own CPU, apart from the wall time above: on a busy machine a
        // call waits for a core too, which the duration counts and this
        // does not.
        let filter_cpu = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "tether_extender_filter_cpu_seconds",
            "CPU time the extender's threads spent answering filter calls (divide by tether_extender_filters_total for the mean per call)",
            filter_cpu.clone(),
        );
        let nudges = Counter::default();
        registry.register(
            "tether_extender_requeue_nudges",
            "Refused pods the extender asked the scheduler about again because devices freed up",
            nudges.clone(),
        );
        let bind_overlaps = Counter::default();
        registry.register(
            "tether_extender_bind_overlaps",
            "Bind calls for a pod whose earlier bind call was still running (the scheduler gave up on it and tried again); each waited for the earlier one to end",
            bind_overlaps.clone(),
        );
        let stale_plans = Counter::default();
        registry.register(
            "tether_extender_stale_plans",
            "Binds whose device plan from the extender's watched copy of the claims Tether refused (a claim the copy had not yet seen); each read the claims from Tether and planned again",
            stale_plans.clone(),
        );
        Self {
            registry,
            binds,
            bind_duration,
            filters,
            filter_duration,
            filter_cpu,
            nudges,
            bind_overlaps,
            stale_plans,
        }
    }
}

impl ExtenderMetrics {
    /// Counts a device plan from the watched copy that Tether refused.
    pub fn stale_plan(&self) {
        self.stale_plans.inc();
    }

    /// Stale plans so far (see [`ExtenderMetrics::stale_plan`]).
    pub fn stale_plans(&self) -> u64 {
        self.stale_plans.get()
    }

    /// Counts a bind that took `seconds`.
    pub fn bind(&self, outcome: BindOutcome, seconds: f64) {
        let outcome = match outcome {
            BindOutcome::Bound => "bound",
            BindOutcome::Refused => "refused",
        };
        self.binds.get_or_create(&OutcomeLabel { outcome }).inc();
        self.bind_duration.observe(seconds);
    }

    /// Counts a filter call that took `seconds`, of which `cpu_seconds` on
    /// a core.
    pub fn filter(&self, answered: bool, seconds: f64, cpu_seconds: f64) {
        let outcome = if answered { "answered" } else { "error" };
        self.filters.get_or_create(&OutcomeLabel { outcome }).inc();
        self.filter_duration.observe(seconds);
        self.filter_cpu.inc_by(cpu_seconds);
    }

    /// Counts a bind call that waited for an earlier one of its pod.
    pub fn bind_overlap(&self) {
        self.bind_overlaps.inc();
    }

    /// Counts a refused pod asked about again.
    pub fn nudge(&self) {
        self.nudges.inc();
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        tether_http::metrics::encode(&[&self.registry])
    }
}

/// The device plugin's counters.
pub struct PluginMetrics {
    registry: Registry,
    allocates: Family<OutcomeLabel, Counter>,
    allocate_duration: Histogram,
    corrections: Counter,
    registrations: Counter,
    devices: Family<HealthLabel, Gauge>,
}

impl Default for PluginMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let allocates = outcomes(&["served", "refused"]);
        registry.register(
            "tether_device_plugin_allocates",
            "Allocate calls by outcome (refused: the kubelet fails the pod, it never retries)",
            allocates.clone(),
        );
        let allocate_duration = latency_histogram();
        registry.register(
            "tether_device_plugin_allocate_duration_seconds",
            "Allocate calls, from the kubelet's request to the answer",
            allocate_duration.clone(),
        );
        let corrections = Counter::default();
        registry.register(
            "tether_device_plugin_claim_corrections",
            "Pods whose device claim was corrected to the devices the kubelet gave instead of the planned ones",
            corrections.clone(),
        );
        let registrations = Counter::default();
        registry.register(
            "tether_device_plugin_registrations",
            "Registrations with the kubelet (one at start, one after each kubelet restart)",
            registrations.clone(),
        );
        let devices = Family::<HealthLabel, Gauge>::default();
        registry.register(
            "tether_device_plugin_devices",
            "Devices the plugin advertises to the kubelet, by health (unhealthy: a GPU whose driver entry is gone, given to no new pod)",
            devices.clone(),
        );
        Self {
            registry,
            allocates,
            allocate_duration,
            corrections,
            registrations,
            devices,
        }
    }
}

impl PluginMetrics {
    /// Counts an `Allocate` that took `seconds`.
    pub fn allocate(&self, served: bool, seconds: f64) {
        let outcome = if served { "served" } else { "refused" };
        self.allocates
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
        self.allocate_duration.observe(seconds);
    }

    /// Counts a corrected claim.
    pub fn correction(&self) {
        self.corrections.inc();
    }

    /// Counts a registration with the kubelet.
    pub fn registration(&self) {
        self.registrations.inc();
    }

    /// Sets the devices advertised now, healthy and not.
    pub fn devices(&self, healthy: usize, unhealthy: usize) {
        for (health, count) in [("healthy", healthy), ("unhealthy", unhealthy)] {
            self.devices
                .get_or_create(&HealthLabel { health })
                .set(count as i64);
        }
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        tether_http::metrics::encode(&[&self.registry])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_outcomes_start_at_zero_and_counters_end_in_total() {
        let extender = ExtenderMetrics::default();
        let text = extender.render();
        assert!(
            text.contains("tether_extender_binds_total{outcome=\"refused\"} 0\n"),
            "{text}"
        );
        extender.bind(BindOutcome::Bound, 0.2);
        extender.filter(false, 0.004, 0.001);
        let text = extender.render();
        assert!(
            text.contains("tether_extender_binds_total{outcome=\"bound\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_extender_filters_total{outcome=\"error\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_extender_bind_duration_seconds_count 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_extender_filter_duration_seconds_count 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_extender_filter_cpu_seconds_total 0.001\n"),
            "{text}"
        );
        let plugin = PluginMetrics::default();
        plugin.allocate(false, 0.01);
        plugin.correction();
        plugin.registration();
        plugin.devices(7, 1);
        let text = plugin.render();
        assert!(
            text.contains("tether_device_plugin_devices{health=\"unhealthy\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_device_plugin_allocates_total{outcome=\"refused\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_device_plugin_allocates_total{outcome=\"served\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_device_plugin_claim_corrections_total 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_device_plugin_registrations_total 1\n"),
            "{text}"
        );
    }
}
