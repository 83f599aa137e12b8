//! The bridge at run time: kube-rs watchers on Pods and Nodes, a watch on
//! Tether's event stream for the interest set, a periodic resync, and a
//! retry loop that resyncs with back-off after any failed send until
//! everything is acknowledged, all feeding the pure decisions of
//! `mapping`, `orphans` and `reconcile` and sending their commands to
//! Tether.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tether_client::proto as pb;
use tether_client::{Client, WatchUpdate};

use crate::interest::Interest;
use crate::mapping::{node_change, pod_change};
use crate::model::{Command, NodeReport, NodeView, PodReport, PodView};
use crate::orphans::{
    LiveView, Lookup, TetherView, confirm_node, confirm_pod, missing_joins, node_candidates,
    pod_candidates,
};
use crate::reconcile::{node_corrections, pod_corrections};
use crate::tombstones::{Tombstones, late_interest};

/// Tether events that make a pod UID interesting.
const INTEREST_KINDS: [&str; 4] = [
    "LockGranted",
    "LockQueued",
    "PinAssigned",
    "PinOwnerChanged",
];

/// Pod watch events taken together at most: those already received when
/// the bridge gets to them (a burst of pods starting), so a quiet watch
/// still sends each event's commands at once.
const MAX_EVENTS_PER_BATCH: usize = 512;

/// Pods whose commands are sent side by side at most.
const MAX_PODS_IN_FLIGHT: usize = 64;

/// `commands` split into lanes by pod, each lane in the order given: a pod's
/// reports must reach Tether in order (a Running sent after its Gone would
/// count a deleted pod alive again), different pods' need not. Other
/// commands each get a lane of their own.
fn lanes_by_pod(commands: Vec<Command>) -> Vec<Vec<Command>> {
    let mut lanes: Vec<Vec<Command>> = Vec::new();
    let mut lane_of: HashMap<String, usize> = HashMap::new();
    for command in commands {
        let lane = match &command {
            Command::Pod { uid, .. } => lane_of.get(uid).copied(),
            _ => None,
        };
        match lane {
            Some(lane) => lanes[lane].push(command),
            None => {
                if let Command::Pod { uid, .. } = &command {
                    lane_of.insert(uid.clone(), lanes.len());
                }
                lanes.push(vec![command]);
            }
        }
    }
    lanes
}

/// Counters and the lag histogram for `/metrics` and tests, in a
/// `prometheus-client` registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Kubernetes watch events handled.
    pub events_seen: Counter,
    /// Commands Tether accepted.
    pub commands_sent: Counter,
    /// Commands that failed (sent again, with back-off, while still needed).
    pub command_errors: Counter,
    /// Resyncs run because a send failed.
    pub retries: Counter,
    /// Orphans found by lists and resyncs (confirmed, reported).
    pub orphans_found: Counter,
    /// Candidates a resync could not confirm gone (alive, GET failed, or
    /// name unknown): left alone.
    pub unconfirmed: Counter,
    /// Kubernetes event to Tether commit, seconds.
    pub lag: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let mut counter = |name: &str, help: &str| {
            let counter = Counter::default();
            registry.register(name, help, counter.clone());
            counter
        };
        let events_seen = counter("tether_bridge_events", "Kubernetes watch events handled");
        let commands_sent = counter("tether_bridge_commands", "Commands Tether applied");
        let command_errors = counter(
            "tether_bridge_command_errors",
            "Commands that failed (sent again, with back-off, while still needed)",
        );
        let retries = counter(
            "tether_bridge_retries",
            "Resyncs run with back-off because a command failed",
        );
        let orphans_found = counter(
            "tether_bridge_orphans",
            "Objects Tether still held for, found missing by a list or resync",
        );
        let unconfirmed = counter(
            "tether_bridge_unconfirmed",
            "Resync candidates not confirmed gone (alive, GET failed or name unknown), left alone",
        );
        let lag = tether_http::metrics::latency_histogram();
        registry.register(
            "tether_bridge_lag_seconds",
            "Kubernetes event received to the Tether command it caused committed",
            lag.clone(),
        );
        Self {
            registry,
            events_seen,
            commands_sent,
            command_errors,
            retries,
            orphans_found,
            unconfirmed,
            lag,
        }
    }
}

/// One running bridge.
pub struct Bridge {
    tether: Client,
    kube: kube::Client,
    interest: Mutex<Interest>,
    pods: Mutex<HashMap<String, PodView>>,
    nodes: Mutex<BTreeMap<String, NodeView>>,
    pods_listed: AtomicBool,
    nodes_listed: AtomicBool,
    tombstones: Mutex<Tombstones>,
    /// The last pod report Tether acknowledged, by pod UID (for the pods it
    /// cares about): a pod whose current report differs is due it.
    acked: Mutex<HashMap<String, PodReport>>,
    /// Woken by a failed send: the retry loop resyncs with back-off.
    failed: tokio::sync::Notify,
    /// Counters.
    pub metrics: Metrics,
}

/// First and longest pause of the retry loop between resyncs.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Deleted pod UIDs remembered for late binds (about 10 MB at most).
const TOMBSTONES: usize = 100_000;

fn pod_phase(report: PodReport) -> pb::PodPhase {
    match report {
        PodReport::Starting => pb::PodPhase::PodStarting,
        PodReport::Running => pb::PodPhase::PodRunning,
        PodReport::Terminal => pb::PodPhase::PodTerminal,
        PodReport::Gone => pb::PodPhase::PodGone,
    }
}

fn node_state(report: NodeReport) -> pb::NodeState {
    match report {
        NodeReport::Joined => pb::NodeState::NodeJoined,
        NodeReport::Ready => pb::NodeState::NodeReady,
        NodeReport::NotReady => pb::NodeState::NodeNotReady,
        NodeReport::Gone => pb::NodeState::NodeGone,
    }
}

/// Sends a `Pod` or `Node` command to Tether. `ConfirmNodeGone` needs the
/// API server: the caller resolves it into a `Node` report (or nothing) first;
/// passed here it is refused without a call.
pub async fn send_report(tether: &Client, command: &Command) -> Result<(), tether_client::Error> {
    match command {
        Command::Pod { uid, report } => {
            tether.report_pod(uid, pod_phase(*report)).await.map(|_| ())
        }
        Command::Node {
            name,
            uid,
            report,
            labels,
            unschedulable,
        } => {
            let request = pb::ReportNodeRequest {
                name: name.clone(),
                uid: uid.clone(),
                state: node_state(*report) as i32,
                set_labels: labels.is_some(),
                labels: labels.clone().unwrap_or_default().into_iter().collect(),
                unschedulable: *unschedulable,
                ..Default::default()
            };
            tether.report_node(request).await.map(|_| ())
        }
        Command::ConfirmNodeGone { name, .. } => Err(tether_client::Error::InvalidArgument(
            format!("node {name}: a delete event must be confirmed against the API server first"),
        )),
    }
}

impl Bridge {
    /// A bridge between a Kubernetes API and a Tether cluster.
    pub fn new(tether: Client, kube: kube::Client) -> Arc<Bridge> {
        Arc::new(Bridge {
            tether,
            kube,
            interest: Mutex::default(),
            pods: Mutex::default(),
            nodes: Mutex::default(),
            pods_listed: AtomicBool::new(false),
            nodes_listed: AtomicBool::new(false),
            tombstones: Mutex::new(Tombstones::new(TOMBSTONES)),
            acked: Mutex::default(),
            failed: tokio::sync::Notify::new(),
            metrics: Metrics::default(),
        })
    }

    /// Runs until `shutdown` resolves (or this future is dropped): the pod
    /// and node watchers, the Tether event watch, a resync every `resync`,
    /// and the retry loop.
    pub async fn run(
        self: Arc<Self>,
        resync: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        // Fix the Tether watch position before reading the state, so no
        // grant between the read and the watch is missed (a repeat is
        // harmless: the interest set is a set).
        let watch = loop {
            match self
                .tether
                .watch(None, INTEREST_KINDS.map(String::from).to_vec(), "")
                .await
            {
                Ok(watch) => break watch,
                Err(err) => {
                    tracing::warn!(%err, "cannot reach Tether yet; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        if let Err(err) = self.refresh_interest().await {
            tracing::warn!(%err, "cannot read Tether's state yet; the resync will retry");
        }
        // A JoinSet aborts its tasks when dropped: on shutdown, and also
        // when this future is dropped (a caller aborting the bridge's task
        // must not leave its watchers running, a second bridge).
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(self.clone().watch_pods());
        tasks.spawn(self.clone().watch_nodes());
        tasks.spawn(self.clone().watch_tether(watch));
        tasks.spawn(self.clone().resync_every(resync));
        tasks.spawn(self.clone().retry_failed());
        shutdown.await;
        tasks.abort_all();
    }

    /// Healthy once both the pod and the node list have completed (the
    /// bridge's view is whole).
    pub fn healthy(&self) -> bool {
        self.pods_listed.load(Ordering::Relaxed) && self.nodes_listed.load(Ordering::Relaxed)
    }

    /// OpenMetrics text for `/metrics`: the counters, the lag histogram and
    /// how many pods Tether holds, queues or pins for now.
    pub fn render_metrics(&self) -> String {
        let interesting = self
            .interest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .uids()
            .len();
        let mut now = Registry::default();
        let gauge: Gauge = Gauge::default();
        gauge.set(interesting as i64);
        now.register(
            "tether_bridge_interesting_pods",
            "Pod UIDs Tether holds, queues or pins for",
            gauge,
        );
        tether_http::metrics::encode(&[&self.metrics.registry, &now])
    }

    /// Rebuilds the interest set from Tether's locks and pins.
    pub async fn refresh_interest(&self) -> Result<(), tether_client::Error> {
        let (locks, at_locks) = self.tether.list_with_index("").await?;
        let (pins, at_pins) = self.tether.list_pins_with_index("", "").await?;
        let applied = at_locks.min(at_pins);
        self.interest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rebuild(&locks, &pins, applied);
        Ok(())
    }

    /// Whether the bridge saw this pod UID deleted (and still remembers).
    pub fn knows_deleted(&self, uid: &str) -> bool {
        self.tombstones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(uid)
    }

    /// Whether Tether cares about this pod UID, as far as the bridge knows.
    pub fn is_interesting(&self, uid: &str) -> bool {
        self.interesting(uid)
    }

    fn interesting(&self, uid: &str) -> bool {
        self.interest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(uid)
    }

    /// Sends one command; `seen_at` is when the Kubernetes event arrived.
    /// False when it failed: the retry loop then resyncs until what is
    /// still needed is acknowledged.
    async fn send(&self, command: Command, seen_at: Instant) -> bool {
        let result = match &command {
            Command::Pod { .. } | Command::Node { .. } => send_report(&self.tether, &command).await,
            Command::ConfirmNodeGone { name, uid } => {
                return match self.lookup_node(name).await {
                    Lookup::Failed => {
                        // A failed GET never unpins: the retry resyncs.
                        self.failed.notify_one();
                        false
                    }
                    lookup => match confirm_node(name, uid, lookup) {
                        Some(gone) => Box::pin(self.send(gone, seen_at)).await,
                        // Recreated under the same name: alive.
                        None => true,
                    },
                };
            }
        };
        match result {
            Ok(()) => {
                if let Command::Pod { uid, report } = &command {
                    self.acked
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(uid.clone(), *report);
                }
                let lag = seen_at.elapsed().as_micros() as u64;
                self.metrics.commands_sent.inc();
                self.metrics.lag.observe(lag as f64 / 1e6);
                match &command {
                    Command::Pod { uid, report } => {
                        tracing::info!(pod_uid = %uid, ?report, lag_us = lag, "pod reported to Tether")
                    }
                    Command::Node { name, report, .. } => {
                        tracing::info!(node = %name, ?report, lag_us = lag, "node reported to Tether")
                    }
                    Command::ConfirmNodeGone { name, .. } => {
                        tracing::info!(node = %name, "node gone confirmed")
                    }
                }
            }
            Err(err) => {
                self.metrics.command_errors.inc();
                let (pod_uid, node) = match &command {
                    Command::Pod { uid, .. } => (uid.as_str(), ""),
                    Command::Node { name, .. } | Command::ConfirmNodeGone { name, .. } => {
                        ("", name.as_str())
                    }
                };
                tracing::warn!(pod_uid, node, ?command, %err, "command not applied; sent again with back-off while still needed");
                self.failed.notify_one();
                return false;
            }
        }
        true
    }

    /// GET of a pod by namespace and name.
    async fn lookup_pod(&self, namespace: &str, name: &str) -> Lookup<PodView> {
        let pods: kube::Api<Pod> = kube::Api::namespaced(self.kube.clone(), namespace);
        match pods.get_opt(name).await {
            Ok(None) => Lookup::NotFound,
            Ok(Some(pod)) => PodView::from_pod(&pod).map_or(Lookup::Failed, Lookup::Found),
            Err(err) => {
                tracing::warn!(namespace, name, %err, "cannot read the pod; leaving it to the next resync");
                Lookup::Failed
            }
        }
    }

    /// GET of a node by name.
    async fn lookup_node(&self, name: &str) -> Lookup<NodeView> {
        let nodes: kube::Api<Node> = kube::Api::all(self.kube.clone());
        match nodes.get_opt(name).await {
            Ok(None) => Lookup::NotFound,
            Ok(Some(node)) => NodeView::from_node(&node).map_or(Lookup::Failed, Lookup::Found),
            Err(err) => {
                tracing::warn!(node = name, %err, "cannot read the node; leaving it to the next resync");
                Lookup::Failed
            }
        }
    }

    /// Handles an added or changed pod: its view goes into the cache and
    /// the commands it needs into `out`. Returns its view.
    fn pod_applied(&self, pod: &Pod, out: &mut Vec<Command>) -> Option<PodView> {
        let new = PodView::from_pod(pod)?;
        let old = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(new.uid.clone(), new.clone());
        out.extend(pod_change(
            old.as_ref(),
            Some(&new),
            self.interesting(&new.uid),
        ));
        Some(new)
    }

    /// Sends `commands` taken from one batch of watch events: each pod's in
    /// the order they came, different pods' side by side, so that a burst
    /// of reports shares Raft entries (the replicas batch concurrent
    /// writes) instead of waiting a commit each. Sent one at a time, the
    /// Starting and Running reports of 1,600 pods starting queued a later
    /// deletion's report behind them (issue 52's churn: the new pods' p99
    /// create→bound went from 123–873 ms to about 40 ms in two of three runs).
    async fn send_by_pod(&self, commands: Vec<Command>, seen_at: Instant) {
        let lanes = lanes_by_pod(commands);
        futures::stream::iter(lanes)
            .for_each_concurrent(MAX_PODS_IN_FLIGHT, |lane| async move {
                for command in lane {
                    self.send(command, seen_at).await;
                }
            })
            .await;
    }

    async fn watch_pods(self: Arc<Self>) {
        let api: kube::Api<Pod> = kube::Api::all(self.kube.clone());
        // The events already there are taken together (their commands are
        // sent by pod, side by side); the next batch waits until they are.
        let stream = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .ready_chunks(MAX_EVENTS_PER_BATCH);
        futures::pin_mut!(stream);
        let mut relisted: HashMap<String, PodView> = HashMap::new();
        while let Some(batch) = stream.next().await {
            let seen_at = Instant::now();
            let mut commands = Vec::new();
            for event in batch {
                self.pod_event(event, seen_at, &mut relisted, &mut commands)
                    .await;
            }
            self.send_by_pod(commands, seen_at).await;
        }
    }

    /// One event of the pod watch: commands for Tether go into `commands`,
    /// to be sent with the rest of the batch. A relist's end first sends
    /// what is collected, then resyncs with the new list.
    async fn pod_event(
        &self,
        event: Result<Event<Pod>, watcher::Error>,
        seen_at: Instant,
        relisted: &mut HashMap<String, PodView>,
        commands: &mut Vec<Command>,
    ) {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                tracing::warn!(%err, "pod watch failed; backing off");
                return;
            }
        };
        self.metrics.events_seen.inc();
        match event {
            Event::Init => relisted.clear(),
            Event::InitApply(pod) => {
                if let Some(view) = self.pod_applied(&pod, commands) {
                    relisted.insert(view.uid.clone(), view);
                }
            }
            Event::Apply(pod) => {
                self.pod_applied(&pod, commands);
            }
            Event::Delete(pod) => {
                let Some(gone) = PodView::from_pod(&pod) else {
                    return;
                };
                let old = self
                    .pods
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&gone.uid);
                self.tombstones
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .record(&gone.uid);
                commands.extend(pod_change(
                    Some(old.as_ref().unwrap_or(&gone)),
                    None,
                    self.interesting(&gone.uid),
                ));
                relisted.remove(&gone.uid);
            }
            Event::InitDone => {
                // What the list's pods need is sent first: the resync
                // compares Tether's state with what was acknowledged.
                self.send_by_pod(std::mem::take(commands), seen_at).await;
                // The list is the truth: replace the cache, then release
                // whatever Tether holds for pods that are not in it.
                *self.pods.lock().unwrap_or_else(|p| p.into_inner()) = std::mem::take(relisted);
                self.pods_listed.store(true, Ordering::Relaxed);
                if let Err(err) = self.refresh_interest().await {
                    tracing::warn!(%err, "cannot read Tether's state after a pod list; the resync will retry");
                    return;
                }
                self.resync_pods(seen_at).await;
            }
        }
    }

    async fn watch_nodes(self: Arc<Self>) {
        let api: kube::Api<Node> = kube::Api::all(self.kube.clone());
        let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
        futures::pin_mut!(stream);
        let mut relisted: BTreeMap<String, NodeView> = BTreeMap::new();
        while let Some(event) = stream.next().await {
            let seen_at = Instant::now();
            let event = match event {
                Ok(event) => event,
                Err(err) => {
                    tracing::warn!(%err, "node watch failed; backing off");
                    continue;
                }
            };
            self.metrics.events_seen.inc();
            match event {
                Event::Init => relisted.clear(),
                Event::InitApply(node) => {
                    // Reported from the complete list at InitDone.
                    if let Some(view) = NodeView::from_node(&node) {
                        relisted.insert(view.name.clone(), view);
                    }
                }
                Event::Apply(node) => {
                    let Some(new) = NodeView::from_node(&node) else {
                        continue;
                    };
                    let old = self
                        .nodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(&new.name)
                        .cloned();
                    for command in node_change(old.as_ref(), Some(&new)) {
                        self.send(command, seen_at).await;
                    }
                    self.nodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(new.name.clone(), new);
                }
                Event::Delete(node) => {
                    let Some(gone) = NodeView::from_node(&node) else {
                        continue;
                    };
                    self.nodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&gone.name);
                    for command in node_change(Some(&gone), None) {
                        self.send(command, seen_at).await;
                    }
                }
                Event::InitDone => {
                    let previous = std::mem::replace(
                        &mut *self.nodes.lock().unwrap_or_else(|p| p.into_inner()),
                        std::mem::take(&mut relisted),
                    );
                    self.nodes_listed.store(true, Ordering::Relaxed);
                    // Changes of nodes we knew (readiness, labels) while the
                    // watch was down.
                    let current = self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    for (name, new) in &current {
                        if let Some(old) = previous.get(name) {
                            for command in node_change(Some(old), Some(new)) {
                                self.send(command, seen_at).await;
                            }
                        }
                    }
                    self.resync_nodes(seen_at).await;
                }
            }
        }
    }

    /// Follows Tether's events to keep the interest set current. The watcher
    /// resumes across disconnects by itself; after a gap it re-reads state.
    async fn watch_tether(self: Arc<Self>, mut watch: tether_client::Watcher) {
        loop {
            match watch.next().await {
                Ok(WatchUpdate::Events(events)) => {
                    let seen_at = Instant::now();
                    let fresh: Vec<String> = {
                        let mut interest = self.interest.lock().unwrap_or_else(|p| p.into_inner());
                        events.iter().filter_map(|e| interest.apply(e)).collect()
                    };
                    // A pod that became interesting after it was deleted or
                    // went terminal (a late bind): report it now.
                    let late: Vec<Command> = {
                        let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
                        let tombstones = self.tombstones.lock().unwrap_or_else(|p| p.into_inner());
                        fresh
                            .iter()
                            .filter_map(|uid| late_interest(uid, pods.get(uid), &tombstones))
                            .collect()
                    };
                    for command in late {
                        self.send(command, seen_at).await;
                    }
                }
                Ok(WatchUpdate::Relist { .. }) => {
                    if let Err(err) = self.refresh_interest().await {
                        tracing::warn!(%err, "cannot re-read Tether's state");
                    }
                }
                Err(err) => {
                    tracing::warn!(%err, "Tether watch failed; retrying from where it was");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// The pods' side of a resync: every cached pod Tether cares about whose
    /// current report Tether has not acknowledged ([`pod_corrections`]), and
    /// the orphans: interesting UIDs the pod cache lacks, each reported gone
    /// only when known gone (seen deleted, or a GET of its name answers 404
    /// or another UID); a candidate found alive is reported as it is. False
    /// when something could not be sent or checked.
    async fn resync_pods(&self, seen_at: Instant) -> bool {
        if !self.pods_listed.load(Ordering::Relaxed) {
            return true;
        }
        let interesting = self
            .interest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .uids()
            .clone();
        let (mut commands, cached) = {
            let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            let acked = self.acked.lock().unwrap_or_else(|p| p.into_inner());
            let cached: BTreeSet<String> = pods.keys().cloned().collect();
            (pod_corrections(&interesting, &pods, &acked), cached)
        };
        let corrections = commands.len();
        let live = LiveView {
            pod_uids: cached,
            nodes: BTreeMap::new(),
        };
        let tether = TetherView {
            pod_uids: interesting,
            nodes: BTreeMap::new(),
        };
        let mut complete = true;
        for uid in pod_candidates(&tether, &live) {
            let acked_gone = self
                .acked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&uid)
                == Some(&PodReport::Gone);
            if acked_gone {
                continue;
            }
            if self.knows_deleted(&uid) {
                commands.push(Command::Pod {
                    uid,
                    report: PodReport::Gone,
                });
                continue;
            }
            let name = self
                .interest
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .name_of(&uid)
                .cloned();
            let Some((namespace, name)) = name else {
                // A pin's owner this bridge has never seen: nothing proves
                // it gone (its node going away still ends the pin).
                self.metrics.unconfirmed.inc();
                tracing::debug!(pod_uid = %uid, "a pod Tether names is not in the cache and its name is unknown; not reported");
                continue;
            };
            let lookup = self.lookup_pod(&namespace, &name).await;
            complete &= !matches!(lookup, Lookup::Failed);
            match confirm_pod(&uid, lookup) {
                Some(command) => commands.push(command),
                None => {
                    self.metrics.unconfirmed.inc();
                }
            }
        }
        if corrections > 0 {
            tracing::info!(
                count = corrections,
                "resync: pods whose report Tether has not acknowledged"
            );
        }
        let orphans = commands.split_off(corrections);
        for command in commands {
            complete &= self.send(command, seen_at).await;
        }
        complete & self.send_orphans(orphans, seen_at).await
    }

    /// The nodes' side of a resync: registry nodes whose object the cache
    /// lacks (no node under the name, or one with another UID), each
    /// reported gone only when a GET shows that node object gone; listed
    /// nodes the registry lacks (or had under an object just reported
    /// gone), reported joined; and listed nodes whose
    /// registry entry differs (labels, schedulability, readiness), corrected
    /// ([`node_corrections`]). False when something could not be sent or
    /// read.
    async fn resync_nodes(&self, seen_at: Instant) -> bool {
        if !self.nodes_listed.load(Ordering::Relaxed) {
            return true;
        }
        let listed = match self.tether.list_nodes(false).await {
            Ok(nodes) => nodes,
            Err(err) => {
                tracing::warn!(%err, "cannot read Tether's node registry; retrying with back-off");
                self.failed.notify_one();
                return false;
            }
        };
        let registry: BTreeMap<String, NodeView> = listed
            .into_iter()
            .map(|n| {
                let view = NodeView {
                    name: n.name.clone(),
                    uid: n.uid,
                    labels: n.labels.into_iter().collect(),
                    ready: n.ready,
                    unschedulable: n.unschedulable,
                };
                (n.name, view)
            })
            .collect();
        let live = LiveView {
            pod_uids: BTreeSet::new(),
            nodes: self.nodes.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        };
        let tether = TetherView {
            pod_uids: BTreeSet::new(),
            nodes: registry
                .iter()
                .map(|(name, n)| (name.clone(), n.uid.clone()))
                .collect(),
        };
        let mut commands = Vec::new();
        let mut complete = true;
        let mut after_gones = tether.clone();
        for (name, uid) in node_candidates(&tether, &live) {
            let lookup = self.lookup_node(&name).await;
            complete &= !matches!(lookup, Lookup::Failed);
            match confirm_node(&name, &uid, lookup) {
                Some(gone) => {
                    after_gones.nodes.remove(&name);
                    commands.push(gone);
                }
                None => {
                    self.metrics.unconfirmed.inc();
                }
            }
        }
        // Sent after the gones: a node re-created under its name joins once
        // its old object has been reported gone.
        commands.extend(missing_joins(&after_gones, &live));
        let corrections = node_corrections(&registry, &live.nodes);
        if !corrections.is_empty() {
            tracing::info!(
                count = corrections.len(),
                "resync: nodes whose registry entry differs from the API server's"
            );
        }
        for command in corrections {
            complete &= self.send(command, seen_at).await;
        }
        complete & self.send_orphans(commands, seen_at).await
    }

    async fn send_orphans(&self, commands: Vec<Command>, seen_at: Instant) -> bool {
        if !commands.is_empty() {
            tracing::info!(
                count = commands.len(),
                "resync found what Tether still holds for missing objects"
            );
        }
        self.metrics.orphans_found.inc_by(commands.len() as u64);
        let mut complete = true;
        for command in commands {
            complete &= self.send(command, seen_at).await;
        }
        complete
    }

    /// After a failed send: resync with back-off (200 ms doubling to 30 s)
    /// until a resync sends and checks everything it must. Nothing is
    /// dropped: what is still needed is recomputed from the caches each
    /// time, so a report a later event made moot is not sent.
    async fn retry_failed(self: Arc<Self>) {
        loop {
            self.failed.notified().await;
            let mut pause = RETRY_FIRST;
            loop {
                tokio::time::sleep(pause).await;
                self.metrics.retries.inc();
                let now = Instant::now();
                let pods = self.resync_pods(now).await;
                let nodes = self.resync_nodes(now).await;
                if pods && nodes {
                    tracing::info!("retry: everything Tether must hear is acknowledged");
                    break;
                }
                pause = (pause * 2).min(RETRY_MAX);
            }
        }
    }

    async fn resync_every(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(err) = self.refresh_interest().await {
                tracing::warn!(%err, "resync: cannot read Tether's state");
                continue;
            }
            self.forget_acknowledged();
            let now = Instant::now();
            self.resync_pods(now).await;
            self.resync_nodes(now).await;
        }
    }

    /// Keeps acknowledged reports only for pods Tether still cares about or
    /// the cache still has.
    fn forget_acknowledged(&self) {
        let interest = self.interest.lock().unwrap_or_else(|p| p.into_inner());
        let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        self.acked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|uid, _| interest.contains(uid) || pods.contains_key(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, report: PodReport) -> Command {
        Command::Pod {
            uid: uid.to_string(),
            report,
        }
    }

    #[test]
    fn each_pods_commands_keep_their_order_in_a_lane_of_their_own() {
        let confirm = Command::ConfirmNodeGone {
            name: "n1".into(),
            uid: "node-uid".into(),
        };
        let lanes = lanes_by_pod(vec![
            pod("a", PodReport::Starting),
            pod("b", PodReport::Starting),
            confirm.clone(),
            pod("a", PodReport::Running),
            pod("a", PodReport::Gone),
            pod("b", PodReport::Terminal),
        ]);
        assert_eq!(
            lanes,
            vec![
                vec![
                    pod("a", PodReport::Starting),
                    pod("a", PodReport::Running),
                    pod("a", PodReport::Gone),
                ],
                vec![pod("b", PodReport::Starting), pod("b", PodReport::Terminal)],
                vec![confirm],
            ]
        );
        assert!(lanes_by_pod(Vec::new()).is_empty());
    }
}
