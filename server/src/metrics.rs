//! The counters and histograms of one replica, kept in a `prometheus-client`
//! registry and served as OpenMetrics text on `/metrics` (with the gauges
//! `http.rs` reads from the state at scrape time).
//!
//! Counter names are registered without `_total`; the encoder adds it, so
//! the exposed names (`tether_requests_total`, ...) are the ones dashboards
//! and alerts have always used.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::codegen::http;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tether_http::metrics::{latency_histogram, wait_histogram};

/// `method` and `result` of a gRPC call counted by [`Metrics::request`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: &'static str,
    result: &'static str,
}

/// `method` and gRPC status `code` of a timed call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GrpcLabels {
    method: String,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    peer: u64,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Counters and histograms kept by the API, the storage and the leader's
/// background tasks.
pub struct Metrics {
    registry: Registry,
    requests: Family<CallLabels, Counter>,
    grpc_duration: HistogramFamily<GrpcLabels>,
    http_api_duration: HistogramFamily<GrpcLabels>,
    sweeps: Family<KindLabel, Counter>,
    abandoned_waits: Family<OutcomeLabel, Counter>,
    write_entries: Counter,
    write_commands: Counter,
    held_joined: Counter,
    held_expired: Counter,
    proposed_again: Counter,
    read_rounds: Counter,
    linearizable_reads: Counter,
    streams_opened: Family<PeerLabel, Counter>,
    unary_appends: Family<PeerLabel, Counter>,
    commit_duration: Histogram,
    fsync_duration: Histogram,
    apply_duration: Histogram,
    wait_duration: HistogramFamily<OutcomeLabel>,
}

/// What [`Metrics::raft_append`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RaftAppend {
    /// An AppendEntries stream opened to the peer.
    StreamOpened,
    /// An AppendEntries sent as a unary call (the peer has no stream).
    Unary,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<CallLabels, Counter>::default();
        registry.register(
            "tether_requests",
            "gRPC calls by method and result",
            requests.clone(),
        );
        let grpc_duration: HistogramFamily<GrpcLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "tether_grpc_request_duration_seconds",
            "gRPC calls by method and status code, from the request's arrival to its answer's headers \
             (for the server-streaming calls Acquire, Watch and LeaseKeepAlive: until the stream opens)",
            grpc_duration.clone(),
        );
        let http_api_duration: HistogramFamily<GrpcLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "tether_http_api_request_duration_seconds",
            "HTTP/JSON API calls by gRPC method (LockService.Release, ...) and status code, from \
             the request's arrival to its answer's headers (streams: until they open)",
            http_api_duration.clone(),
        );
        let sweeps = Family::<KindLabel, Counter>::default();
        registry.register(
            "tether_expired",
            "Waits, leases, holds and sessions expired by sweeps this replica proposed",
            sweeps.clone(),
        );
        let abandoned_waits = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "tether_abandoned_waits",
            "Queued acquires served here whose caller went away, by what giving the wait up found: \
             removed, taken_up (a retry of the request came back for it), given_back (the grant won the \
             race and was handed to the next waiter), granted (the grant won the race and the client was \
             seen since, or a member reads only format 6: the hold stays), not_waiting, failed (no leader \
             took it before the wait's deadline)",
            abandoned_waits.clone(),
        );
        let mut counter = |name: &str, help: &str| {
            let counter = Counter::default();
            registry.register(name, help, counter.clone());
            counter
        };
        let write_entries = counter(
            "tether_write_entries",
            "Log entries the batching queue of this replica proposed for acquires and releases, and once \
             every member reads format 11 for assignments and pod reports and revokes (one per batch; none \
             while batching is off or not every member reads batch entries yet)",
        );
        let write_commands = counter(
            "tether_write_commands",
            "Commands in those entries; divided by the entries, the mean batch size (a command proposed \
             again counts again)",
        );
        let held_joined = counter(
            "tether_held_acquires_joined",
            "Acquires that would queue behind another pod's hold, held back by the batching queue \
             (--batch-hold-queued) and sent in one entry with a later command on their lock (its release, \
             typically)",
        );
        let proposed_again = counter(
            "tether_write_commands_proposed_again",
            "Terminal pod reports and pod revokes refused in a batch entry because that entry granted \
             their pod a hold (ending it there would grant the lock twice under one token), and proposed \
             again in an entry of their own",
        );
        let held_expired = counter(
            "tether_held_acquires_expired",
            "Such held-back acquires sent without one, when their hold-back time ran out",
        );
        let read_rounds = counter(
            "tether_read_index_rounds",
            "ReadIndex rounds (a heartbeat round to the voters, then waiting for apply) this replica ran \
             for linearizable reads; reads arriving during a round share the next one",
        );
        let linearizable_reads = counter(
            "tether_linearizable_reads",
            "Linearizable reads those rounds served; divided by the rounds, the reads per round",
        );
        let streams_opened = Family::<PeerLabel, Counter>::default();
        registry.register(
            "tether_raft_append_streams_opened",
            "AppendEntries streams this replica opened to each peer while leading: one per replication \
             stream, one per ReadIndex round (openraft sends each round's heartbeat from a fresh client), \
             and one after each failed or timed-out message; opened beyond tether_read_index_rounds_total \
             means a troubled link",
            streams_opened.clone(),
        );
        let unary_appends = Family::<PeerLabel, Counter>::default();
        registry.register(
            "tether_raft_append_unary",
            "AppendEntries this replica sent to each peer as unary calls because the peer has no \
             AppendEntries stream (a replica of an older build)",
            unary_appends.clone(),
        );
        let commit_duration = latency_histogram();
        registry.register(
            "tether_commit_duration_seconds",
            "Writes this replica proposed as leader, from the proposal to its entry applied here \
             (replicated to a quorum, fsynced, applied)",
            commit_duration.clone(),
        );
        let fsync_duration = latency_histogram();
        registry.register(
            "tether_fsync_duration_seconds",
            "Synced writes of the Raft log (appends, truncations, purges, votes) to RocksDB",
            fsync_duration.clone(),
        );
        let apply_duration = latency_histogram();
        registry.register(
            "tether_apply_duration_seconds",
            "Batches of committed entries applied to the state machine, each batch as one write",
            apply_duration.clone(),
        );
        let wait_duration: HistogramFamily<OutcomeLabel> =
            Family::new_with_constructor(wait_histogram);
        registry.register(
            "tether_lock_wait_duration_seconds",
            "How long queued acquires served here waited, from being told they queued to their end: \
             outcome granted, or ended (the wait ended without a grant: deadline, cancel, revoke, node \
             gone, the caller leaving)",
            wait_duration.clone(),
        );
        // Every known label value from the start, so that the series exist
        // (at 0) before the first event: `increase()` in an alert sees the
        // first one, and a dashboard shows 0 rather than nothing.
        for kind in ["wait", "lease", "hold", "session", "pin", "stuck_hold"] {
            drop(sweeps.get_or_create(&KindLabel { kind }));
        }
        for outcome in [
            "removed",
            "taken_up",
            "given_back",
            "granted",
            "not_waiting",
            "failed",
        ] {
            drop(abandoned_waits.get_or_create(&OutcomeLabel { outcome }));
        }
        for outcome in ["granted", "ended"] {
            drop(wait_duration.get_or_create(&OutcomeLabel { outcome }));
        }
        Self {
            registry,
            requests,
            grpc_duration,
            http_api_duration,
            sweeps,
            abandoned_waits,
            write_entries,
            write_commands,
            held_joined,
            held_expired,
            proposed_again,
            read_rounds,
            linearizable_reads,
            streams_opened,
            unary_appends,
            commit_duration,
            fsync_duration,
            apply_duration,
            wait_duration,
        }
    }
}

impl Metrics {
    /// The registry `/metrics` encodes.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// These counters and histograms alone as OpenMetrics text (`/metrics`
    /// adds the gauges read from the state).
    pub fn render(&self) -> String {
        tether_http::metrics::encode(&[&self.registry])
    }

    /// Counts one call of `method` that ended with `result` ("ok" or an error
    /// label).
    pub fn request(&self, method: &'static str, result: &'static str) {
        self.requests
            .get_or_create(&CallLabels { method, result })
            .inc();
    }

    /// Times one gRPC call: `method` is the last part of its path, `code`
    /// the name of its status code.
    pub fn grpc_call(&self, method: String, code: &'static str, took: Duration) {
        self.grpc_duration
            .get_or_create(&GrpcLabels { method, code })
            .observe(took.as_secs_f64());
    }

    /// Times one call of the HTTP/JSON API: `method` is the gRPC method it
    /// serves (`LockService.Release`), `code` the name of its status code.
    pub fn http_api_call(&self, method: String, code: &'static str, took: Duration) {
        self.http_api_duration
            .get_or_create(&GrpcLabels { method, code })
            .observe(took.as_secs_f64());
    }

    /// Counts what a sweep expired.
    pub fn swept(&self, kind: &'static str, count: u64) {
        self.sweeps.get_or_create(&KindLabel { kind }).inc_by(count);
    }

    /// Counts one entry proposed for `commands` acquires and releases.
    pub fn proposed_entry(&self, commands: usize) {
        self.write_entries.inc();
        self.write_commands.inc_by(commands as u64);
    }

    /// Counts held-back acquires that went out with another command on
    /// their lock (`joined`) or alone once their time was up (`expired`).
    pub fn held_acquires(&self, joined: usize, expired: usize) {
        self.held_joined.inc_by(joined as u64);
        self.held_expired.inc_by(expired as u64);
    }

    /// Counts a command refused in a batch entry and proposed again alone.
    pub fn proposed_again(&self) {
        self.proposed_again.inc();
    }

    /// Counts one ReadIndex round serving `reads` linearizable reads.
    pub fn read_round(&self, reads: usize) {
        self.read_rounds.inc();
        self.linearizable_reads.inc_by(reads as u64);
    }

    fn appends(&self, event: RaftAppend) -> &Family<PeerLabel, Counter> {
        match event {
            RaftAppend::StreamOpened => &self.streams_opened,
            RaftAppend::Unary => &self.unary_appends,
        }
    }

    /// Counts one AppendEntries `event` towards `peer`.
    pub fn raft_append(&self, peer: u64, event: RaftAppend) {
        self.appends(event).get_or_create(&PeerLabel { peer }).inc();
    }

    /// How many AppendEntries `event`s towards `peer` were counted.
    pub fn raft_appends(&self, peer: u64, event: RaftAppend) -> u64 {
        // `get`, not `get_or_create`: a read makes no series.
        self.appends(event)
            .get(&PeerLabel { peer })
            .map_or(0, |counter| counter.get())
    }

    /// Counts one queued acquire whose caller went away, by `outcome`.
    pub fn abandoned_wait(&self, outcome: &'static str) {
        self.abandoned_waits
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// How many abandoned waits ended with `outcome`.
    pub fn abandoned_waits(&self, outcome: &'static str) -> u64 {
        self.abandoned_waits
            .get(&OutcomeLabel { outcome })
            .map_or(0, |counter| counter.get())
    }

    /// Times one write proposed as leader, from proposal to applied.
    pub fn committed(&self, took: Duration) {
        self.commit_duration.observe(took.as_secs_f64());
    }

    /// Awaits `write` (a `client_write`) and times it as a commit if it
    /// succeeds (a refusal to propose, e.g. not the leader, is no commit).
    pub async fn time_commit<T, E>(
        &self,
        write: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let started = Instant::now();
        let result = write.await;
        if result.is_ok() {
            self.committed(started.elapsed());
        }
        result
    }

    /// Times one synced write of the Raft log.
    pub fn fsynced(&self, took: Duration) {
        self.fsync_duration.observe(took.as_secs_f64());
    }

    /// Times one batch of entries applied to the state machine.
    pub fn applied(&self, took: Duration) {
        self.apply_duration.observe(took.as_secs_f64());
    }

    /// Times one queued acquire's wait; `granted` tells how it ended.
    pub fn waited(&self, granted: bool, took: Duration) {
        let outcome = if granted { "granted" } else { "ended" };
        self.wait_duration
            .get_or_create(&OutcomeLabel { outcome })
            .observe(took.as_secs_f64());
    }
}

/// A tower layer on the gRPC server that times every call into
/// `tether_grpc_request_duration_seconds` by method and status code.
#[derive(Clone)]
pub struct GrpcTimingLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for GrpcTimingLayer {
    type Service = GrpcTiming<S>;

    fn layer(&self, inner: S) -> GrpcTiming<S> {
        GrpcTiming {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service [`GrpcTimingLayer`] wraps around the gRPC routes.
#[derive(Clone)]
pub struct GrpcTiming<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B, R> tower::Service<http::Request<B>> for GrpcTiming<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let started = Instant::now();
        let answer = self.inner.call(request);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let response = answer.await?;
            // An error answered before any message carries its status in
            // the headers (trailers-only); a call that answers carries it in
            // the trailers, after these headers: it has started well.
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from_i32);
            // Methods nobody serves would make one series per made-up name.
            let method = if code == tonic::Code::Unimplemented {
                "unimplemented".to_string()
            } else {
                method
            };
            metrics.grpc_call(method, crate::error::code_name(code), started.elapsed());
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(metrics: &Metrics) -> String {
        metrics.render()
    }

    #[test]
    fn append_counters_render_per_peer() {
        let metrics = Metrics::default();
        metrics.raft_append(2, RaftAppend::StreamOpened);
        metrics.raft_append(2, RaftAppend::StreamOpened);
        metrics.raft_append(3, RaftAppend::Unary);
        let text = text(&metrics);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"tether_raft_append_streams_opened_total{peer=\"2\"} 2"));
        assert!(lines.contains(&"tether_raft_append_unary_total{peer=\"3\"} 1"));
        assert!(
            !text.contains("tether_raft_append_unary_total{peer=\"2\"}"),
            "no line for what did not happen"
        );
        assert!(lines.contains(&"# TYPE tether_raft_append_unary counter"));
    }

    #[test]
    fn requests_keep_their_names_and_latencies_fill_buckets() {
        let metrics = Metrics::default();
        metrics.request("Acquire", "ok");
        metrics.grpc_call("Acquire".into(), "OK", Duration::from_millis(3));
        metrics.committed(Duration::from_millis(2));
        metrics.waited(true, Duration::from_secs(2));
        let text = text(&metrics);
        assert!(
            text.contains("tether_requests_total{method=\"Acquire\",result=\"ok\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "tether_grpc_request_duration_seconds_bucket{le=\"0.004\",method=\"Acquire\",code=\"OK\"} 1\n"
            ) || text.contains(
                "tether_grpc_request_duration_seconds_bucket{method=\"Acquire\",code=\"OK\",le=\"0.004\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("tether_commit_duration_seconds_count 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tether_lock_wait_duration_seconds_count{outcome=\"granted\"} 1\n"),
            "{text}"
        );
    }
}
