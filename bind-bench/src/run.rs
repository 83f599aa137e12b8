//! Workloads and what they measure: pods created through the API server,
//! watched until every one is bound and allocated, and the report of
//! times, latencies, API requests, Tether's CPU and memory, and double
//! allocations.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tether_chaos::chart::{Chart, PALETTE, Scale, Series};
use tether_chaos::procfs::{cpu_seconds, memory_mib};
use tether_chaos::rng::Rng;
use tether_chaos::stats::{Samples, ms};

use crate::node::{PodRecord, pod_key};
use crate::system::System;
use crate::world::{POD_LABEL, RESOURCE, SCHEDULER_NAME, SECOND_RESOURCE, World};

/// Pod creations sent at once (the admin's client has no rate limit; a
/// burst is created as fast as the API server takes it).
const CREATES_IN_FLIGHT: usize = 32;
/// How long the replicas' idle CPU is measured before each run.
pub const IDLE_SAMPLE: Duration = Duration::from_secs(5);
/// How often progress is sampled (the chart's resolution).
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// A workload: what pods are created, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Every GPU of every node asked for at once, one GPU a pod.
    Burst,
    /// Every GPU asked for at once by 4-, 2- and 1-GPU pods (4 + 2 + 1 + 1
    /// on an 8-GPU node), the widest created first.
    Mixed,
    /// Every GPU taken by a one-GPU pod (not measured); then, at a steady
    /// rate, a live pod picked at random deleted and a new one-GPU pod
    /// created, which binds only once a deleted pod's GPU is free again
    /// ([`Churn`] sets the pace). Pods still waiting or binding are picked
    /// too: deleted at any moment, as pods are.
    Churn,
    /// HAMi-core #246's case: every node has as many devices of a second
    /// kind (`tether.io/npu`) as GPUs, and every pod asks for one of each,
    /// in two containers (one GPU, one of the second kind), all at once.
    /// Tether takes the node's lock of each kind, in one order; HAMi's
    /// backends take its one node lock once per kind, and the second take
    /// contends with the first.
    TwoKinds,
}

/// The churn workload's pace.
#[derive(Debug, Clone, Copy)]
pub struct Churn {
    /// Pods deleted, and as many created (None: half the GPUs).
    pub pods: Option<usize>,
    /// Deletions (each followed by a creation) per second.
    pub rate: f64,
    /// Seeds which live pod each deletion picks (the same seed picks the
    /// same pods for every system).
    pub seed: u64,
}

impl Default for Churn {
    fn default() -> Self {
        Churn {
            pods: None,
            rate: 20.0,
            seed: 52,
        }
    }
}

/// What one run is asked to do.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// The workload.
    pub workload: Workload,
    /// Simulated nodes.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus: usize,
    /// Give up waiting for the pods after this long (the churn workload's
    /// fill and its churn each).
    pub deadline: Duration,
    /// The churn workload's pace.
    pub churn: Churn,
}

impl Workload {
    /// The workload's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Burst => "burst",
            Workload::Mixed => "mixed",
            Workload::Churn => "churn",
            Workload::TwoKinds => "two-kinds",
        }
    }

    /// The pods it creates at once, in order: (name, GPUs). (The churn
    /// workload's are its fill.)
    pub fn pods(self, nodes: usize, gpus: usize) -> Vec<(String, usize)> {
        let widths: Vec<usize> = match self {
            Workload::Burst | Workload::Churn | Workload::TwoKinds => vec![1; nodes * gpus],
            Workload::Mixed => {
                let mut widths: Vec<usize> = (0..nodes).flat_map(|_| node_widths(gpus)).collect();
                // Widest first: kube-scheduler takes pods of one priority
                // in creation order, so every 4-GPU pod is placed while
                // nodes still have 4 free in a row, and what is left is a
                // multiple of the next width down: no pod is stranded by
                // the smaller ones spreading first.
                widths.sort_by(|a, b| b.cmp(a));
                widths
            }
        };
        widths
            .into_iter()
            .enumerate()
            .map(|(i, width)| (format!("{}-{i:05}-{width}gpu", self.name()), width))
            .collect()
    }
}

/// One node's GPUs as the mixed workload asks for them: 4, 2, 1, 1 again
/// and again while they fit, then 1s (8 GPUs: 4 + 2 + 1 + 1).
fn node_widths(gpus: usize) -> Vec<usize> {
    let mut widths = Vec::new();
    let mut left = gpus;
    for width in [4, 2, 1, 1].into_iter().cycle() {
        if left == 0 {
            break;
        }
        let width = width.min(left);
        widths.push(width);
        left -= width;
    }
    widths
}

/// What one workload run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// The system under test.
    pub system: String,
    /// The workload's name.
    pub workload: String,
    /// Nodes and GPUs per node.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus: usize,
    /// Pods created (the churn workload's: after its fill).
    pub pods: usize,
    /// The churn workload's churn.
    pub churn: Option<ChurnSummary>,
    /// From the first create until every pod was bound (None: not all were
    /// by the deadline).
    pub all_bound: Option<Duration>,
    /// From the first create until every pod had its devices.
    pub all_allocated: Option<Duration>,
    /// Per pod: its create returned → the fleet saw it bound.
    pub create_to_bound: Samples,
    /// Per pod: seen bound → its node's `Allocate` returned.
    pub bound_to_allocated: Samples,
    /// The pods slowest from create to bound, slowest first, with their
    /// times: the names to look up in kube-scheduler's log for a tail.
    pub slowest_to_bind: Vec<(String, Duration)>,
    /// The API server's requests (all clients) during the run, from its
    /// `apiserver_request_total`.
    pub api_requests: f64,
    /// CPU seconds the 3 replicas used during the run, together.
    pub replica_cpu_seconds: f64,
    /// From the first create until the pods were settled (or the deadline).
    pub run_time: Duration,
    /// The replicas' CPU, in cores together, over [`IDLE_SAMPLE`] before
    /// the run with nothing asked of them (heartbeats, the copies and
    /// watches that follow Tether).
    pub replica_idle_cores: f64,
    /// After the run, while its pods were deleted and Tether ended their
    /// claims: how long that took, and the replicas' CPU seconds in it.
    pub ending: (Duration, f64),
    /// Each replica's resident memory at the end, MiB.
    pub replica_rss_mib: Vec<f64>,
    /// Devices given to two live pods of one node at once.
    pub double_allocations: Vec<String>,
    /// Devices the plugins gave the run's pods, all together.
    pub devices_given: usize,
    /// Pods whose admission failed, with why: pods still there, each a
    /// pod a user would see fail.
    pub failed: Vec<(String, String)>,
    /// Pods deleted while the kubelet admitted them whose admission failed,
    /// with why. Nobody waits for these: the kubelet fails the admission
    /// of a pod whose object is gone, and the pod's hold and claim end with
    /// it (see the bench README's churn section).
    pub failed_deleted: Vec<(String, String)>,
    /// CPU seconds each kind of process used during the run (the replicas
    /// together), in the order of [`World::process_pids`].
    pub cpu_by_process: Vec<(&'static str, f64)>,
    /// Tether calls per pod by method, every replica's
    /// `tether_requests_total` together, and Raft log entries per pod.
    pub tether_calls_per_pod: BTreeMap<String, f64>,
    /// Raft log entries per pod (the replicas' highest last log index).
    pub log_entries_per_pod: f64,
    /// The same two while the pods were deleted and Tether ended their
    /// claims (after the run).
    pub ending_calls_per_pod: BTreeMap<String, f64>,
    pub ending_log_entries_per_pod: f64,
    /// Tether's extender's filter calls during the run; None for the
    /// other systems, whose filters are the bench's.
    pub tether_filter: Option<crate::world::FilterTime>,
    /// (seconds since the first create, pods bound so far).
    pub bound_over_time: Vec<(f64, usize)>,
}

/// Calls per pod by method, as "Method n.nn, ...".
fn calls_text(calls: &BTreeMap<String, f64>) -> String {
    let mut text = calls
        .iter()
        .filter(|(method, _)| method.as_str() != READ_ROUNDS)
        .map(|(method, n)| format!("{method} {n:.2}"))
        .collect::<Vec<_>>()
        .join(", ");
    if let Some(rounds) = calls.get(READ_ROUNDS) {
        text += &format!("; ReadIndex rounds {rounds:.2}");
    }
    text
}

/// The key under which [`tether_counts`] counts the replicas' ReadIndex
/// rounds beside the calls (each a heartbeat to every other voter, shared
/// by the linearizable reads that waited for it).
const READ_ROUNDS: &str = "ReadIndex rounds";

/// How many of the slowest pods a report names.
const SLOWEST_SHOWN: usize = 5;

/// What the churn workload did after its fill.
#[derive(Debug, Clone, Copy)]
pub struct ChurnSummary {
    /// Pods deleted, and as many created.
    pub replaced: usize,
    /// Deletions a second.
    pub rate: f64,
    /// The seed that picked them.
    pub seed: u64,
    /// New pods the churn deleted before they were bound.
    pub deleted_unbound: usize,
}

impl Report {
    /// The replicas' CPU per pod over the pods' whole life (the run, and
    /// the end of their claims after it) less what the replicas' idle rate
    /// would have used in that time, in ms.
    pub fn replica_ms_per_pod_less_idle(&self) -> f64 {
        let (ending, ending_cpu) = self.ending;
        let span = self.run_time.as_secs_f64() + ending.as_secs_f64();
        let busy = self.replica_cpu_seconds + ending_cpu - self.replica_idle_cores * span;
        busy * 1000.0 / self.pods.max(1) as f64
    }

    /// Pods bound per second over the whole burst.
    pub fn pods_per_second(&self) -> Option<f64> {
        self.all_bound
            .map(|d| self.pods as f64 / d.as_secs_f64().max(1e-9))
    }

    /// The report as text, one measure a line.
    pub fn to_text(&self) -> String {
        let secs = |d: Option<Duration>| {
            d.map_or("not all by the deadline".to_string(), |d| {
                format!("{:.2} s", d.as_secs_f64())
            })
        };
        let quantiles = |s: &Samples| {
            if s.is_empty() {
                "none".to_string()
            } else {
                format!(
                    "p50 {} p99 {} max {} ms",
                    ms(s.quantile(0.5)),
                    ms(s.quantile(0.99)),
                    ms(s.quantile(1.0))
                )
            }
        };
        let mut out = format!(
            "{} / {}: {} nodes x {} GPUs, {} pods\n",
            self.system, self.workload, self.nodes, self.gpus, self.pods
        );
        if let Some(churn) = &self.churn {
            out += &format!(
                "  churn                every GPU taken first; then {} pods deleted at random \
                 (seed {}) and {} created, {:.0} a second; {} of the new deleted before they \
                 were bound\n",
                churn.replaced, churn.seed, churn.replaced, churn.rate, churn.deleted_unbound
            );
        }
        out += &format!("  all bound after      {}\n", secs(self.all_bound));
        if self.all_bound.is_none()
            && let Some(&(at, bound)) = self.bound_over_time.last()
        {
            out += &format!(
                "  bound by then        {bound} of {} after {at:.0} s\n",
                self.pods
            );
        }
        out += &format!("  all allocated after  {}\n", secs(self.all_allocated));
        if let Some(rate) = self.pods_per_second() {
            out += &format!("  pods bound per second {rate:.1}\n");
        }
        out += &format!(
            "  create -> bound      {}\n",
            quantiles(&self.create_to_bound)
        );
        out += &format!(
            "  bound -> Allocate    {}\n",
            quantiles(&self.bound_to_allocated)
        );
        if !self.slowest_to_bind.is_empty() {
            let slowest: Vec<String> = self
                .slowest_to_bind
                .iter()
                .map(|(pod, took)| format!("{pod} {}", ms(*took)))
                .collect();
            out += &format!("  slowest to bind      {} ms\n", slowest.join(", "));
        }
        out += &format!(
            "  API server requests  {:.0} ({:.1} per pod)\n",
            self.api_requests,
            self.api_requests / self.pods.max(1) as f64
        );
        let (ending, ending_cpu) = self.ending;
        // Only Tether's runs use the replicas (the comparators' leave them
        // idle but for what follows Tether).
        if self.tether_filter.is_some() {
            out += &format!(
                "  replicas' CPU        idle {:.3} cores before the run; ending the pods' claims after \
             it {:.2} s of CPU in {:.1} s; per pod, its whole life less the idle rate, {:.2} ms\n",
                self.replica_idle_cores,
                ending_cpu,
                ending.as_secs_f64(),
                self.replica_ms_per_pod_less_idle()
            );
        }
        out += &format!(
            "  replicas' CPU        {:.2} s ({:.2} ms per pod); RSS {} MiB\n",
            self.replica_cpu_seconds,
            self.replica_cpu_seconds * 1000.0 / self.pods.max(1) as f64,
            self.replica_rss_mib
                .iter()
                .map(|m| format!("{m:.0}"))
                .collect::<Vec<_>>()
                .join("/")
        );
        out += &format!(
            "  CPU by process       {}\n",
            self.cpu_by_process
                .iter()
                .map(|(name, seconds)| format!("{name} {seconds:.1} s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if !self.tether_calls_per_pod.is_empty() {
            out += &format!(
                "  Tether per pod       {:.2} log entries; calls {}\n",
                self.log_entries_per_pod,
                calls_text(&self.tether_calls_per_pod)
            );
            out += &format!(
                "  ... ending the pods  {:.2} log entries; calls {}\n",
                self.ending_log_entries_per_pod,
                calls_text(&self.ending_calls_per_pod)
            );
        }
        if let Some(filter) = &self.tether_filter {
            let mean =
                |seconds: f64| Duration::from_secs_f64((seconds / filter.calls.max(1.0)).max(0.0));
            let quantile = |q: f64| filter.quantile(q).map_or("-".to_string(), ms);
            out += &format!(
                "  extender's filter    {:.0} calls, p50 {} p99 {} mean {} ms, of which on a core {} ms (mean)\n",
                filter.calls,
                quantile(0.5),
                quantile(0.99),
                ms(mean(filter.seconds)),
                ms(mean(filter.cpu_seconds))
            );
        }
        out += &format!(
            "  double allocations   {} (of {} devices given)\n",
            self.double_allocations.len(),
            self.devices_given
        );
        for d in self.double_allocations.iter().take(5) {
            out += &format!("    {d}\n");
        }
        out += &format!("  failed admissions    {}\n", self.failed.len());
        for (pod, why) in self.failed.iter().take(5) {
            out += &format!("    {pod}: {why}\n");
        }
        if !self.failed_deleted.is_empty() {
            out += &format!(
                "  of pods deleted while admitted {} (their objects gone: nobody waits for them)\n",
                self.failed_deleted.len()
            );
            for (pod, why) in self.failed_deleted.iter().take(5) {
                out += &format!("    {pod}: {why}\n");
            }
        }
        out
    }
}

/// The sum of the API server's `apiserver_request_total` counters: every
/// request it has served, by every client.
async fn api_requests(admin: &kube::Client) -> anyhow::Result<f64> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = admin.request_text(request).await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// What the replicas have counted so far: gRPC calls by method (every
/// replica's `tether_requests_total`, all results, together), and the
/// highest replica's last log index. A replica that does not answer counts
/// nothing.
/// Waits until Tether's log has not moved for [`QUIET_FOR`] (up to
/// [`QUIET_WAIT`]; false if it still moved then): what the world's set-up
/// or the last run left to apply (the bridge's reports of a thousand new
/// nodes, the end of a run's pods) is applied before the replicas' idle
/// CPU is measured and the run starts. At 1,000 nodes the set-up's node
/// reports went on for seconds after the nodes were registered, and were
/// counted as the first run's.
async fn wait_quiet(world: &World) -> bool {
    let deadline = Instant::now() + QUIET_WAIT;
    let mut last = tether_counts(world).1;
    let mut still_since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(QUIET_POLL).await;
        let now = tether_counts(world).1;
        if now != last {
            (last, still_since) = (now, Instant::now());
        } else if still_since.elapsed() >= QUIET_FOR {
            return true;
        }
    }
    false
}

/// How long Tether's log must stay still to count as quiet, how often it
/// is looked at, and the longest wait for it.
const QUIET_FOR: Duration = Duration::from_secs(1);
const QUIET_POLL: Duration = Duration::from_millis(200);
const QUIET_WAIT: Duration = Duration::from_secs(60);

/// The replicas' calls by method (and their ReadIndex rounds, under
/// [`READ_ROUNDS`]), summed, and the highest last log index.
fn tether_counts(world: &World) -> (BTreeMap<String, f64>, f64) {
    let mut calls: BTreeMap<String, f64> = BTreeMap::new();
    let mut last_log = 0.0_f64;
    for id in world.tether.running() {
        let Ok(text) = world.tether.metrics_text(id) else {
            continue;
        };
        for line in text.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if let Some(labels) = series.strip_prefix("tether_requests_total{")
                && let Some(method) = labels
                    .split(',')
                    .find_map(|l| l.strip_prefix("method=\""))
                    .and_then(|m| m.strip_suffix('"'))
            {
                *calls.entry(method.to_string()).or_default() += value;
            } else if series == "tether_read_index_rounds_total" {
                *calls.entry(READ_ROUNDS.to_string()).or_default() += value;
            } else if series == "tether_raft_last_log_index" {
                last_log = last_log.max(value);
            }
        }
    }
    (calls, last_log)
}

/// A pod of `workload` of width `gpus`, of the `tether-gpu` scheduler:
/// asking for `gpus` GPUs, and for the two-kinds workload as many devices
/// of the second kind in a second container.
fn gpu_pod(workload: Workload, name: &str, gpus: usize) -> anyhow::Result<Pod> {
    let mut containers = vec![json!({
        "name": "main", "image": "busybox",
        "resources": {"limits": {RESOURCE: gpus.to_string()}},
    })];
    if workload == Workload::TwoKinds {
        containers.push(json!({
            "name": "second", "image": "busybox",
            "resources": {"limits": {SECOND_RESOURCE: gpus.to_string()}},
        }));
    }
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {POD_LABEL.0: POD_LABEL.1}},
        "spec": {"schedulerName": SCHEDULER_NAME, "containers": containers},
    }))?)
}

/// Devices given to two live pods of one node: `node/device: pod, pod`.
pub fn double_allocations(records: &BTreeMap<String, PodRecord>) -> Vec<String> {
    let mut holders: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (pod, record) in records {
        if record.allocated.is_none() || record.deleted {
            continue;
        }
        for device in &record.devices {
            holders
                .entry((record.node.clone(), device.clone()))
                .or_default()
                .push(pod.clone());
        }
    }
    holders
        .into_iter()
        .filter(|(_, pods)| pods.len() > 1)
        .map(|((node, device), pods)| format!("{node}/{device}: {}", pods.join(", ")))
        .collect()
}

/// The pods one phase of a run created and deleted, as the phase goes on.
#[derive(Default)]
struct Phase {
    /// Pods created, by name: when their create returned.
    created: BTreeMap<String, Instant>,
    /// Their keys in the fleet's records, in creation order.
    keys: Vec<String>,
    /// Pods of the phase the workload deleted.
    deleted: BTreeSet<String>,
    /// Every create and delete of the phase has been sent.
    done: bool,
}

impl Phase {
    fn created(&mut self, namespace: &str, name: String, at: Instant) {
        self.keys.push(pod_key(namespace, &name));
        self.created.insert(name, at);
    }
}

/// Creates `wanted` at once, a few in flight, into `phase`.
async fn create_all(
    workload: Workload,
    pods: &Api<Pod>,
    namespace: &str,
    wanted: Vec<(String, usize)>,
    phase: &Mutex<Phase>,
) -> anyhow::Result<()> {
    let created: Vec<anyhow::Result<(String, Instant)>> = futures::stream::iter(wanted)
        .map(|(name, gpus)| {
            let pods = pods.clone();
            async move {
                pods.create(&PostParams::default(), &gpu_pod(workload, &name, gpus)?)
                    .await?;
                Ok((name, Instant::now()))
            }
        })
        .buffer_unordered(CREATES_IN_FLIGHT)
        .collect()
        .await;
    let mut phase = phase.lock().unwrap_or_else(|p| p.into_inner());
    for result in created {
        let (name, at) = result?;
        phase.created(namespace, name, at);
    }
    Ok(())
}

/// The churn: `churn.pods` times, at `churn.rate` a second from
/// `started`, deletes a live pod picked with the seed (gracefully, as a
/// user would: the node's kubelet finishes it) and creates a one-GPU pod.
async fn churn_pods(
    pods: &Api<Pod>,
    namespace: &str,
    mut live: Vec<String>,
    churn: Churn,
    count: usize,
    started: Instant,
    phase: &Mutex<Phase>,
) -> anyhow::Result<()> {
    let mut rng = Rng::new(churn.seed);
    for i in 0..count {
        let due = started + Duration::from_secs_f64(i as f64 / churn.rate.max(1e-3));
        tokio::time::sleep_until(due.into()).await;
        if !live.is_empty() {
            let victim = live.swap_remove(rng.below(live.len() as u64) as usize);
            match pods.delete(&victim, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(err) => return Err(err).context(format!("deleting pod {victim}")),
            }
            phase
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .deleted
                .insert(victim);
        }
        let name = format!("churn-next-{i:05}-1gpu");
        pods.create(&PostParams::default(), &gpu_pod(Workload::Churn, &name, 1)?)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        let at = Instant::now();
        phase
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .created(namespace, name.clone(), at);
        live.push(name);
    }
    Ok(())
}

/// Samples, every [`SAMPLE_EVERY`], how many of the phase's pods the
/// fleet has seen bound, until the phase is done and every pod of it not
/// deleted is settled (given its devices or failed), or `deadline` after
/// `started`. Returns the samples: (seconds since `started`, bound).
async fn follow(
    world: &World,
    phase: &Mutex<Phase>,
    started: Instant,
    deadline: Duration,
) -> Vec<(f64, usize)> {
    let mut bound_over_time = Vec::new();
    loop {
        let (bound, settled, survivors, done) = {
            let phase = phase.lock().unwrap_or_else(|p| p.into_inner());
            // Counted under the records' lock; no copy of the map.
            let (bound, settled, survivors) = world.fleet.with_records(|records| {
                let mut counts = (0, 0, 0);
                for key in &phase.keys {
                    let name = key.rsplit('/').next().unwrap_or_default();
                    let survives = !phase.deleted.contains(name);
                    counts.2 += usize::from(survives);
                    let Some(r) = records.get(key) else {
                        continue;
                    };
                    counts.0 += usize::from(r.bound.is_some());
                    counts.1 +=
                        usize::from(survives && (r.allocated.is_some() || r.failed.is_some()));
                }
                counts
            });
            (bound, settled, survivors, phase.done)
        };
        bound_over_time.push((started.elapsed().as_secs_f64(), bound));
        if (done && settled >= survivors) || started.elapsed() > deadline {
            return bound_over_time;
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// Runs the phase `drive` makes while following it; `drive`'s error, if
/// any, once the phase is marked done.
async fn drive_and_follow(
    world: &World,
    phase: &Mutex<Phase>,
    drive: impl std::future::Future<Output = anyhow::Result<()>>,
    started: Instant,
    deadline: Duration,
) -> anyhow::Result<Vec<(f64, usize)>> {
    let drive = async {
        let result = drive.await;
        phase.lock().unwrap_or_else(|p| p.into_inner()).done = true;
        result
    };
    let (driven, samples) = futures::join!(drive, follow(world, phase, started, deadline));
    driven?;
    Ok(samples)
}

/// Runs `options.workload` in `world` with `system` in use (the caller has
/// made it so, [`World::use_system`]), in a namespace of its own; gives up
/// waiting after `options.deadline`. The pods are deleted afterwards.
pub async fn run(world: &World, system: System, options: &RunOptions) -> anyhow::Result<Report> {
    let RunOptions {
        workload,
        nodes,
        gpus,
        deadline,
        churn,
    } = *options;
    let namespace = world.namespace(workload.name()).await;
    let pods: Api<Pod> = Api::namespaced(world.admin.clone(), &namespace);
    let at_once = workload.pods(nodes, gpus);
    let key = |name: &str| pod_key(&namespace, name);

    // The churn workload first fills every GPU, unmeasured.
    let fill = Mutex::new(Phase::default());
    let churned = if workload == Workload::Churn {
        let names: Vec<String> = at_once.iter().map(|(n, _)| n.clone()).collect();
        let filling = create_all(workload, &pods, &namespace, at_once.clone(), &fill);
        drive_and_follow(world, &fill, filling, Instant::now(), deadline).await?;
        let records = world.fleet.records();
        let unsettled = names
            .iter()
            .filter(|n| {
                records
                    .get(&key(n))
                    .is_none_or(|r| r.allocated.is_none() && r.failed.is_none())
            })
            .count();
        anyhow::ensure!(
            unsettled == 0,
            "{system:?}: {unsettled} of the churn's {} fill pods not bound and allocated after {deadline:?}",
            names.len()
        );
        Some((names, churn.pods.unwrap_or(nodes * gpus / 2)))
    } else {
        None
    };

    if !wait_quiet(world).await {
        tracing::warn!(
            "Tether's log still moved {QUIET_WAIT:?} after the run's start; the idle CPU is not idle"
        );
    }
    let pids = world.replica_pids();
    let replica_cpu = || pids.iter().filter_map(|p| cpu_seconds(*p)).sum::<f64>();
    // The replicas' rate with nothing asked of them: the window is the
    // measurement, not a wait for something.
    let (idle_from, idle_started) = (replica_cpu(), Instant::now());
    tokio::time::sleep(IDLE_SAMPLE).await;
    let replica_idle_cores =
        (replica_cpu() - idle_from) / idle_started.elapsed().as_secs_f64().max(0.001);
    let cpu_before = replica_cpu();
    let processes = world.process_pids();
    let process_cpu = || {
        processes
            .iter()
            .map(|(name, pid)| (*name, cpu_seconds(*pid).unwrap_or(0.0)))
            .collect::<Vec<_>>()
    };
    let process_cpu_before = process_cpu();
    let (calls_before, log_before) = tether_counts(world);
    let requests_before = api_requests(&world.admin).await?;
    let filter_before = world.tether_filter_time();
    let phase = Mutex::new(Phase::default());
    let started = Instant::now();
    let bound_over_time = match &churned {
        Some((live, count)) => {
            let churning = churn_pods(
                &pods,
                &namespace,
                live.clone(),
                churn,
                *count,
                started,
                &phase,
            );
            drive_and_follow(world, &phase, churning, started, deadline).await?
        }
        None => {
            let creating = create_all(workload, &pods, &namespace, at_once, &phase);
            drive_and_follow(world, &phase, creating, started, deadline).await?
        }
    };
    let Phase {
        created: created_at,
        deleted,
        ..
    } = std::mem::take(&mut *phase.lock().unwrap_or_else(|p| p.into_inner()));
    // The pods measured: those the phase created (the churn's deletions
    // of its own new pods aside).
    let measured: Vec<&String> = created_at
        .keys()
        .filter(|n| !deleted.contains(*n))
        .collect();
    let records = world.fleet.records();
    // When the last pod got there, if every pod did.
    let last = |at: fn(&PodRecord) -> Option<Instant>| {
        measured
            .iter()
            .map(|n| records.get(&key(n)).and_then(at))
            .collect::<Option<Vec<Instant>>>()
            .and_then(|all| all.into_iter().max())
            .map(|at| at.saturating_duration_since(started))
    };
    let all_bound = last(|r| r.bound);
    let all_allocated = last(|r| r.allocated);
    let requests_after = api_requests(&world.admin).await?;
    let (calls_after, log_after) = tether_counts(world);
    let per_pod = |n: f64| n / created_at.len().max(1) as f64;
    let calls_between = |before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>| {
        after
            .iter()
            .map(|(method, n)| {
                let was = before.get(method).copied().unwrap_or(0.0);
                (method.clone(), per_pod(n - was))
            })
            .filter(|(_, n)| *n >= 0.005)
            .collect::<BTreeMap<String, f64>>()
    };
    let tether_calls_per_pod = calls_between(&calls_before, &calls_after);
    let log_entries_per_pod = per_pod(log_after - log_before);
    let tether_filter =
        (system == System::Tether).then(|| world.tether_filter_time().since(&filter_before));
    let cpu_after = replica_cpu();
    let run_time = started.elapsed();
    let mut cpu_by_process: Vec<(&'static str, f64)> = Vec::new();
    for ((name, after), (_, before)) in process_cpu().into_iter().zip(process_cpu_before) {
        match cpu_by_process.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += after - before,
            None => cpu_by_process.push((name, after - before)),
        }
    }

    let mut create_to_bound = Samples::default();
    let mut bound_to_allocated = Samples::default();
    let mut failed = Vec::new();
    let mut failed_deleted = Vec::new();
    let mut slowest_to_bind = Vec::new();
    for (name, created) in &created_at {
        let Some(record) = records.get(&key(name)) else {
            continue;
        };
        if let Some(bound) = record.bound {
            let took = bound.saturating_duration_since(*created);
            create_to_bound.push(took);
            slowest_to_bind.push((name.clone(), took));
        }
        if let (Some(bound), Some(allocated)) = (record.bound, record.allocated) {
            bound_to_allocated.push(allocated.saturating_duration_since(bound));
        }
        if let Some(why) = &record.failed {
            let list = if record.deleted {
                &mut failed_deleted
            } else {
                &mut failed
            };
            list.push((name.clone(), why.clone()));
        }
    }
    let churn_summary = churned.map(|(_, count)| ChurnSummary {
        replaced: count,
        rate: churn.rate,
        seed: churn.seed,
        deleted_unbound: created_at
            .keys()
            .filter(|n| deleted.contains(*n))
            .filter(|n| records.get(&key(n)).is_none_or(|r| r.bound.is_none()))
            .count(),
    });
    let ours: BTreeMap<String, PodRecord> = records
        .into_iter()
        .filter(|(k, _)| k.starts_with(&format!("{namespace}/")))
        .collect();
    let mut report = Report {
        system: system.name().to_string(),
        workload: workload.name().to_string(),
        nodes,
        gpus,
        pods: created_at.len(),
        churn: churn_summary,
        all_bound,
        all_allocated,
        create_to_bound,
        bound_to_allocated,
        slowest_to_bind: {
            slowest_to_bind.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            slowest_to_bind.truncate(SLOWEST_SHOWN);
            slowest_to_bind
        },
        api_requests: requests_after - requests_before,
        replica_cpu_seconds: cpu_after - cpu_before,
        replica_idle_cores,
        ending: (Duration::ZERO, 0.0),
        ending_calls_per_pod: BTreeMap::new(),
        ending_log_entries_per_pod: 0.0,
        run_time,
        cpu_by_process,
        tether_calls_per_pod,
        log_entries_per_pod,
        tether_filter,
        replica_rss_mib: pids
            .iter()
            .filter_map(|p| memory_mib(*p).map(|(rss, _)| rss))
            .collect(),
        double_allocations: double_allocations(&ours),
        devices_given: ours
            .values()
            .filter(|r| r.allocated.is_some() && !r.deleted)
            .map(|r| r.devices.len())
            .sum(),
        failed,
        failed_deleted,
        bound_over_time,
    };
    let ending_started = Instant::now();
    world.clear(&namespace).await?;
    report.ending = (ending_started.elapsed(), replica_cpu() - cpu_after);
    let (calls_ended, log_ended) = tether_counts(world);
    report.ending_calls_per_pod = calls_between(&calls_after, &calls_ended);
    report.ending_log_entries_per_pod = per_pod(log_ended - log_after);
    Ok(report)
}

/// Each report's time to bind every pod against the first report's and
/// against the no-lock floor's, when those ran.
pub fn comparison(reports: &[Report]) -> String {
    let floor = reports
        .iter()
        .find(|r| r.system == System::NoLock.name())
        .and_then(|r| r.all_bound);
    let tether = reports
        .iter()
        .find(|r| r.system == System::Tether.name())
        .and_then(|r| r.all_bound);
    let mut out = String::from("all bound, side by side:\n");
    for r in reports {
        let Some(bound) = r.all_bound else {
            out += &format!("  {:<34} not all by the deadline\n", r.system);
            continue;
        };
        let ratio = |base: Option<Duration>| {
            base.map_or("-".to_string(), |b| {
                format!("{:.2}x", bound.as_secs_f64() / b.as_secs_f64().max(1e-9))
            })
        };
        // Under churn the time to bind all is mostly the churn's own
        // length; how long each new pod waited says more.
        let p99 = if r.create_to_bound.is_empty() {
            "-".to_string()
        } else {
            ms(r.create_to_bound.quantile(0.99))
        };
        out += &format!(
            "  {:<34} {:>8.2} s   {} the floor   {} Tether's   create -> bound p99 {p99} ms\n",
            r.system,
            bound.as_secs_f64(),
            ratio(floor),
            ratio(tether)
        );
    }
    out
}

/// Bound pods over time, one line per report, as SVG.
pub fn chart(reports: &[Report], subtitle: &str) -> String {
    let series: Vec<Series> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| Series {
            label: r.system.clone(),
            color: PALETTE[i % PALETTE.len()],
            dashed: i > 0,
            markers: false,
            points: r
                .bound_over_time
                .iter()
                .map(|&(t, n)| (t, n as f64))
                .collect(),
        })
        .collect();
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    Chart {
        title: "GPU pods bound over time".into(),
        subtitle: subtitle.into(),
        x_label: "seconds since the first pod was created".into(),
        y_label: "pods bound".into(),
        x: Scale::linear_from_zero(xs),
        y: Scale::linear_from_zero(ys),
        x_ticks: None,
        series,
    }
    .to_svg()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocated(node: &str, devices: &[&str]) -> PodRecord {
        PodRecord {
            node: node.into(),
            bound: Some(Instant::now()),
            allocated: Some(Instant::now()),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            failed: None,
            deleted: false,
            deleting: false,
        }
    }

    #[test]
    fn the_mixed_workload_fills_every_node_widest_first() {
        assert_eq!(node_widths(8), [4, 2, 1, 1]);
        assert_eq!(node_widths(4), [4]);
        assert_eq!(node_widths(3), [3]);
        assert_eq!(node_widths(16), [4, 2, 1, 1, 4, 2, 1, 1]);
        let pods = Workload::Mixed.pods(3, 8);
        assert_eq!(pods.len(), 12);
        assert_eq!(pods.iter().map(|(_, w)| w).sum::<usize>(), 24);
        assert!(pods.windows(2).all(|p| p[0].1 >= p[1].1));
        assert_eq!(pods[0].0, "mixed-00000-4gpu");
        let burst = Workload::Burst.pods(3, 8);
        assert_eq!(burst.len(), 24);
        assert!(burst.iter().all(|(_, w)| *w == 1));
    }

    #[test]
    fn a_device_of_two_live_pods_on_one_node_is_a_double_allocation() {
        let mut records = BTreeMap::new();
        records.insert("a".to_string(), allocated("n1", &["gpu0", "gpu1"]));
        records.insert("b".to_string(), allocated("n1", &["gpu1"]));
        // The same id on another node is another device.
        records.insert("c".to_string(), allocated("n2", &["gpu0"]));
        assert_eq!(double_allocations(&records), vec!["n1/gpu1: a, b"]);
        // A deleted pod's devices are free again.
        records.get_mut("a").unwrap().deleted = true;
        assert!(double_allocations(&records).is_empty());
    }
}
