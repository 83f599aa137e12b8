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
    /// Held-back acquires that went out with another command on their lock.
    held_joined: AtomicU64,
    /// Held-back acquires whose time ran out before one came.
    held_expired: AtomicU64,
    /// ReadIndex rounds run for linearizable reads.
    read_rounds: AtomicU64,
    /// Linearizable reads those rounds served.
    linearizable_reads: AtomicU64,
    /// How this replica sent AppendEntries to each peer: streams opened,
    /// and messages sent as unary calls to peers without the stream.
    raft_appends: Mutex<BTreeMap<(u64, RaftAppend), u64>>,
    /// Queued acquires whose caller went away, by what giving them up found
    /// (`removed`, `taken_up` by a retry, `granted` before it applied,
    /// `not_waiting`, `failed` before the wait's deadline).
    abandoned_waits: Mutex<BTreeMap<&'static str, u64>>,
}

/// What [`Metrics::raft_append`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RaftAppend {
    /// An AppendEntries stream opened to the peer.
    StreamOpened,
    /// An AppendEntries sent as a unary call (the peer has no stream).
    Unary,
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

    /// Counts held-back acquires that went out with another command on
    /// their lock (`joined`) or alone once their time was up (`expired`).
    pub fn held_acquires(&self, joined: usize, expired: usize) {
        self.held_joined.fetch_add(joined as u64, Ordering::Relaxed);
        self.held_expired
            .fetch_add(expired as u64, Ordering::Relaxed);
    }

    /// Counts one ReadIndex round serving `reads` linearizable reads.
    pub fn read_round(&self, reads: usize) {
        self.read_rounds.fetch_add(1, Ordering::Relaxed);
        self.linearizable_reads
            .fetch_add(reads as u64, Ordering::Relaxed);
    }

    /// Counts one AppendEntries `event` towards `peer`.
    pub fn raft_append(&self, peer: u64, event: RaftAppend) {
        *self
            .raft_appends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((peer, event))
            .or_default() += 1;
    }

    /// How many AppendEntries `event`s towards `peer` were counted.
    pub fn raft_appends(&self, peer: u64, event: RaftAppend) -> u64 {
        self.raft_appends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(peer, event))
            .copied()
            .unwrap_or(0)
    }

    /// Counts one queued acquire whose caller went away, by `outcome`.
    pub fn abandoned_wait(&self, outcome: &'static str) {
        *self
            .abandoned_waits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(outcome)
            .or_default() += 1;
    }

    /// How many abandoned waits ended with `outcome`.
    pub fn abandoned_waits(&self, outcome: &'static str) -> u64 {
        self.abandoned_waits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(outcome)
            .copied()
            .unwrap_or(0)
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
        out.push_str("# HELP tether_abandoned_waits_total Queued acquires served here whose caller went away, by what giving the wait up found: removed, taken_up (a retry of the request came back for it), granted (the grant won the race; the hold stays), not_waiting, failed (no leader took it before the wait's deadline).\n");
        out.push_str("# TYPE tether_abandoned_waits_total counter\n");
        for (outcome, n) in self
            .abandoned_waits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "tether_abandoned_waits_total{{outcome=\"{outcome}\"}} {n}"
            );
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
            (
                "tether_held_acquires_joined_total",
                "Acquires that would queue behind another pod's hold, held back by the batching queue (--batch-hold-queued) and sent in one entry with a later command on their lock (its release, typically).",
                &self.held_joined,
            ),
            (
                "tether_held_acquires_expired_total",
                "Such held-back acquires sent without one, when their hold-back time ran out.",
                &self.held_expired,
            ),
            (
                "tether_read_index_rounds_total",
                "ReadIndex rounds (a heartbeat round to the voters, then waiting for apply) this replica ran for linearizable reads; reads arriving during a round share the next one.",
                &self.read_rounds,
            ),
            (
                "tether_linearizable_reads_total",
                "Linearizable reads those rounds served; divided by the rounds, the reads per round.",
                &self.linearizable_reads,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        }
        let appends = self
            .raft_appends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let families = [
            (
                "tether_raft_append_streams_opened_total",
                "AppendEntries streams this replica opened to each peer while leading: one per replication stream, one per ReadIndex round (openraft sends each round's heartbeat from a fresh client), and one after each failed or timed-out message; opened beyond tether_read_index_rounds_total means a troubled link.",
                RaftAppend::StreamOpened,
            ),
            (
                "tether_raft_append_unary_total",
                "AppendEntries this replica sent to each peer as unary calls because the peer has no AppendEntries stream (a replica of an older build).",
                RaftAppend::Unary,
            ),
        ];
        for (name, help, event) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for ((peer, _), n) in appends.iter().filter(|((_, e), _)| *e == event) {
                let _ = writeln!(out, "{name}{{peer=\"{peer}\"}} {n}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_counters_render_per_peer() {
        let metrics = Metrics::default();
        metrics.raft_append(2, RaftAppend::StreamOpened);
        metrics.raft_append(2, RaftAppend::StreamOpened);
        metrics.raft_append(3, RaftAppend::Unary);
        let mut text = String::new();
        metrics.render(&mut text);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"tether_raft_append_streams_opened_total{peer=\"2\"} 2"));
        assert!(lines.contains(&"tether_raft_append_unary_total{peer=\"3\"} 1"));
        assert!(
            !text.contains("tether_raft_append_unary_total{peer=\"2\"}"),
            "no line for what did not happen"
        );
        assert!(lines.contains(&"# TYPE tether_raft_append_unary_total counter"));
    }
}
