//! Prometheus metrics of one replica, rendered as text for `/metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters kept by the API and the leader's background tasks.
#[derive(Default)]
pub struct Metrics {
    /// gRPC calls by (method, result label).
    requests: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// Sweeps proposed by this replica as leader, by what they expired.
    sweeps: Mutex<BTreeMap<&'static str, u64>>,
    /// Log entries proposed for acquires and releases (one per batch).
    write_entries: AtomicU64,
    /// Acquires and releases in those entries.
    write_commands: AtomicU64,
}

impl Metrics {
    /// Counts one call of `method` that ended with `result` ("ok" or an error
    /// label).
    pub fn request(&self, method: &'static str, result: &'static str) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((method, result))
            .or_default() += 1;
    }

    /// Counts what a sweep expired.
    pub fn swept(&self, what: &'static str, count: u64) {
        *self
            .sweeps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(what)
            .or_default() += count;
    }

    /// Counts one entry proposed for `commands` acquires and releases.
    pub fn proposed_entry(&self, commands: usize) {
        self.write_entries.fetch_add(1, Ordering::Relaxed);
        self.write_commands
            .fetch_add(commands as u64, Ordering::Relaxed);
    }

    /// Renders the counters in Prometheus text format.
    pub fn render(&self, out: &mut String) {
        out.push_str("# HELP tether_requests_total gRPC calls by method and result.\n");
        out.push_str("# TYPE tether_requests_total counter\n");
        for ((method, result), n) in self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "tether_requests_total{{method=\"{method}\",result=\"{result}\"}} {n}"
            );
        }
        out.push_str("# HELP tether_expired_total Waits, leases, holds and sessions expired by sweeps this replica proposed.\n");
        out.push_str("# TYPE tether_expired_total counter\n");
        for (what, n) in self.sweeps.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "tether_expired_total{{kind=\"{what}\"}} {n}");
        }
        let counters = [
            (
                "tether_write_entries_total",
                "Log entries the batching queue of this replica proposed for acquires and releases (one per batch; none while batching is off or not every member reads batch entries yet).",
                &self.write_entries,
            ),
            (
                "tether_write_commands_total",
                "Acquires and releases in those entries; divided by the entries, the mean batch size.",
                &self.write_commands,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        }
    }
}
