//! The world one run binds pods in: the control plane, Tether, the
//! extender, the bridge, kube-scheduler as `deploy/optional/gpu` configures
//! it, and the simulated nodes (see the crate's doc for what each is).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tether_chaos::cluster::ProcessCluster;
use tether_client::{Client, Options};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::cli::ExtenderArgs;
use tether_embed::extender::{Extender, KubeBinder, serve_extender};
use tether_kube_testenv::gpu_manifests::{apply_gpu_rbac, scheduler_config};
use tether_kube_testenv::{ControlPlane, Process};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::node::{Fleet, NodeMode, SimNode};
use crate::system::System;

/// The extended resource the nodes advertise and the pods ask for.
pub const RESOURCE: &str = "tether.io/gpu";
/// The second device kind of the two-kinds workload (HAMi-core #246's
/// case): its resource, and the extender's `--also-kind` for it.
pub const SECOND_RESOURCE: &str = "tether.io/npu";
/// The second kind's device id prefix (its scope is `npu-bind`, its sets
/// `npu-devices` and `npu-inventory`, [`tether_embed::kind`]).
pub const SECOND_PREFIX: &str = "npu";
/// The namespace the manifests' RBAC binds the service accounts in.
pub const SYSTEM: &str = "tether-system";
/// The scheduler profile of `deploy/optional/gpu/scheduler.yaml`.
pub const SCHEDULER_NAME: &str = "tether-gpu";
/// How many node registrations are sent at once.
const REGISTRATIONS_IN_FLIGHT: usize = 16;
/// The label every pod of the bench carries (the fleet watches by it).
pub const POD_LABEL: (&str, &str) = ("app.kubernetes.io/part-of", "tether-bind-bench");

/// The label selector of the bench's pods, for the watches that follow
/// them (the fleet's kubelets, the annotation lock's informer).
pub fn pod_selector() -> String {
    format!("{}={}", POD_LABEL.0, POD_LABEL.1)
}
/// Longest wait for the scheduler to place a probe pod, or for a
/// namespace's pods to be gone.
const SETTLE: Duration = Duration::from_secs(120);

/// What a world is made of.
#[derive(Debug, Clone)]
pub struct WorldOptions {
    /// The `tetherd` the replicas run.
    pub tetherd: PathBuf,
    /// Simulated GPU nodes.
    pub nodes: usize,
    /// GPUs on each.
    pub gpus: usize,
    /// Devices of the second kind on each ([`SECOND_RESOURCE`]; 0: the
    /// nodes have none, and the extender plans one kind).
    pub npus: usize,
}

/// Everything one run needs, running.
pub struct World {
    /// The control plane (stopped on drop).
    pub plane: ControlPlane,
    /// The 3 Tether replicas (stopped on drop).
    pub tether: ProcessCluster,
    /// The API server as the admin (the workload creates pods with it).
    pub admin: kube::Client,
    /// The simulated nodes and the kubelet side that serves them.
    pub fleet: Arc<Fleet>,
    /// kube-scheduler, configured for the system in use.
    scheduler: Option<Process>,
    scheduler_kubeconfig: PathBuf,
    /// Tether's extender, serving all along.
    tether_extender: std::net::SocketAddr,
    /// The same extender, for what it counts.
    tether_extender_metrics: Arc<Extender<KubeBinder>>,
    /// A comparator's extender, while its system is in use.
    comparator: Option<JoinHandle<()>>,
    /// Pins that are not claims: every node's published devices, one pin
    /// per node and device kind.
    inventory_pins: usize,
    gpus: usize,
    tasks: Vec<JoinHandle<()>>,
    dir: tempfile::TempDir,
}

impl Drop for World {
    fn drop(&mut self) {
        for task in self.tasks.iter().chain(&self.comparator) {
            task.abort();
        }
    }
}

impl World {
    /// Starts everything on `plane` and registers the nodes; returns once
    /// every node's devices are published and the scheduler runs.
    pub async fn start(plane: ControlPlane, options: &WorldOptions) -> anyhow::Result<World> {
        let dir = tempfile::tempdir()?;
        apply_gpu_rbac(&plane, SYSTEM).await?;
        let tether = ProcessCluster::start(&options.tetherd, 3).await?;
        let endpoints = tether.endpoints.join(",");
        let mut tasks = Vec::new();

        // The extender, with tether-extender's own defaults.
        let mut flags = vec![
            "tether-extender".to_string(),
            "--endpoints".into(),
            endpoints.clone(),
        ];
        if options.npus > 0 {
            flags.push("--also-kind".into());
            flags.push(format!("{SECOND_RESOURCE}={SECOND_PREFIX}"));
        }
        let args = ExtenderArgs::try_parse_from(flags)?;
        let config = args.extender_config().map_err(anyhow::Error::msg)?;
        let kinds = config.kinds().len();
        let extender_kube = plane
            .client_as_service_account(SYSTEM, "tether-extender")
            .await;
        let client = args.tether.client(Options::default())?;
        let extender = Arc::new(Extender::new(
            client.clone(),
            DeviceLedger::new(client, DEFAULT_LIFETIME),
            KubeBinder::new(extender_kube),
            config,
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let extender_addr = listener.local_addr()?;
        tasks.push(tokio::spawn(serve_extender(
            listener,
            extender.clone(),
            std::future::pending(),
        )));

        // The bridge, with its default resync.
        let bridge_kube = plane
            .client_as_service_account(SYSTEM, "tether-bridge")
            .await;
        let bridge =
            tether_k8s_bridge::bridge::Bridge::new(tether_client(&tether.endpoints)?, bridge_kube);
        tasks.push(tokio::spawn(async move {
            bridge
                .run(Duration::from_secs(60), std::future::pending())
                .await
        }));

        // The nodes, before the scheduler, so that its first look sees
        // them all.
        let admin = plane.client().await;
        let mut nodes = Vec::with_capacity(options.nodes);
        for i in 0..options.nodes {
            nodes.push(Arc::new(SimNode::new(
                &node_name(i),
                options.gpus,
                options.npus,
                &endpoints,
            )?));
        }
        let registered: Vec<anyhow::Result<()>> = futures::stream::iter(nodes.iter().cloned())
            .map(|node| {
                let admin = admin.clone();
                async move { node.register(&admin).await }
            })
            .buffer_unordered(REGISTRATIONS_IN_FLIGHT)
            .collect()
            .await;
        for result in registered {
            result?;
        }
        let fleet = Fleet::new(nodes, admin.clone());
        tasks.push(tokio::spawn(fleet.clone().serve()));

        let scheduler_kubeconfig = plane
            .service_account_kubeconfig(SYSTEM, "tether-scheduler")
            .await;
        let mut world = World {
            plane,
            tether,
            admin,
            fleet,
            scheduler: None,
            scheduler_kubeconfig,
            tether_extender: extender_addr,
            tether_extender_metrics: extender,
            comparator: None,
            inventory_pins: options.nodes * kinds,
            gpus: options.gpus,
            tasks,
            dir,
        };
        world.use_system(System::Tether).await?;
        Ok(world)
    }

    /// Makes `system` the one the scheduler and the nodes use: its
    /// extender serving, each node's plugin its own, and kube-scheduler
    /// started afresh with its extender's URL. Returns once the scheduler
    /// has placed a probe pod (one asking for no GPU, which it places
    /// without the extender).
    pub async fn use_system(&mut self, system: System) -> anyhow::Result<()> {
        if let Some(task) = self.comparator.take() {
            task.abort();
        }
        let extender = match system {
            System::Tether => self.tether_extender,
            System::NoLock => {
                let router =
                    crate::verbs::router(crate::nolock::NoLockExtender::new(self.admin.clone()));
                self.serve_comparator(router, std::future::ready(()))
                    .await?
            }
            System::AnnotationLock | System::AnnotationLockUnlimited => {
                // HAMi's RBAC lets its scheduler patch nodes and pods; the
                // bench's accounts do not, so it acts as the admin.
                let extender = crate::annotation::AnnotationExtender::new(
                    self.admin.clone(),
                    system.rate_limit(),
                    self.gpus,
                );
                let follow = extender.clone().follow_pods();
                self.serve_comparator(crate::verbs::router(extender), follow)
                    .await?
            }
        };
        let admin = self.admin.clone();
        self.fleet.set_mode(|node| match system {
            System::Tether => NodeMode::Tether,
            System::NoLock => NodeMode::NoLock,
            System::AnnotationLock | System::AnnotationLockUnlimited => {
                NodeMode::Annotation(Arc::new(crate::annotation::AnnotationPlugin::new(
                    node,
                    admin.clone(),
                    system.rate_limit(),
                )))
            }
        });
        // The old scheduler stops before the new one starts (drop kills).
        self.scheduler = None;
        let config_path = self.dir.path().join("scheduler.json");
        std::fs::write(
            &config_path,
            scheduler_config(extender, &self.scheduler_kubeconfig)?.to_string(),
        )?;
        self.scheduler = Some(self.plane.scheduler_logging(&config_path, 2)?);
        self.probe().await
    }

    /// Tether's extender's filter calls so far, from its
    /// `tether_extender_filter_duration_seconds` and
    /// `tether_extender_filter_cpu_seconds`.
    pub fn tether_filter_time(&self) -> FilterTime {
        FilterTime::from_metrics(&self.tether_extender_metrics.metrics().render())
    }

    /// Serves a comparator's extender on a port of its own, and runs
    /// `beside` (its watch) as long as it serves; its address.
    async fn serve_comparator(
        &mut self,
        router: axum::Router,
        beside: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<std::net::SocketAddr> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        self.comparator = Some(tokio::spawn(async move {
            let serve = tether_http::serve(listener, router, std::future::pending());
            tokio::join!(serve, beside);
        }));
        Ok(addr)
    }

    /// Waits until the scheduler places a pod that asks for no GPU, then
    /// deletes it.
    async fn probe(&self) -> anyhow::Result<()> {
        let namespace = self.namespace("probe").await;
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), &namespace);
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "probe", "labels": {POD_LABEL.0: POD_LABEL.1}},
            "spec": {"schedulerName": SCHEDULER_NAME,
                     "containers": [{"name": "main", "image": "busybox"}]},
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
        let deadline = std::time::Instant::now() + SETTLE;
        loop {
            let placed = pods
                .get("probe")
                .await?
                .spec
                .and_then(|s| s.node_name)
                .is_some();
            if placed {
                break;
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "kube-scheduler placed no pod within {SETTLE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.clear(&namespace).await
    }

    /// A new namespace for a workload's pods.
    pub async fn namespace(&self, prefix: &str) -> String {
        self.plane.namespace(prefix).await
    }

    /// Deletes every pod of `namespace` at once (no grace: no kubelet is
    /// there to confirm), and waits until the nodes have seen them go and
    /// taken their devices back, and Tether has ended every device claim
    /// (the bridge's reports of the pods, the claims' end at the leader's
    /// sweep): the next run starts on quiet replicas, and what ending a
    /// run's pods costs Tether is counted with that run.
    pub async fn clear(&self, namespace: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let delete = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        let all = ListParams::default();
        again_if_cut(|| pods.delete_collection(&delete, &all)).await?;
        let deadline = std::time::Instant::now() + SETTLE;
        loop {
            let left = again_if_cut(|| pods.list(&all)).await?.items.len();
            let claims = self.claims_left();
            if left == 0 && claims == 0 && self.fleet.all_forgotten(namespace).await {
                return Ok(());
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{left} pods of {namespace} and {claims} device claims in Tether still there \
                 after {SETTLE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How many device claims the replica furthest behind still has: its
    /// pins (its `tether_pins` gauge) less the nodes' published devices.
    /// Read from the replicas' metrics rather than by listing the claims,
    /// so that the wait adds next to nothing to the CPU it measures (a
    /// list is a linearizable read answering every claim). A replica whose
    /// metrics cannot be read counts as not done.
    fn claims_left(&self) -> usize {
        let mut left = 0;
        for id in self.tether.running() {
            let pins = self
                .tether
                .metrics_text(id)
                .ok()
                .and_then(|text| {
                    text.lines()
                        .find_map(|l| l.strip_prefix("tether_pins ")?.trim().parse::<f64>().ok())
                })
                .map_or(usize::MAX, |pins| pins as usize);
            left = left.max(pins.saturating_sub(self.inventory_pins));
        }
        left
    }

    /// The replicas' process ids (for their CPU and memory).
    /// Every process of the world by what it is, for measuring what each
    /// costs: etcd, the API server, the scheduler, the replicas, and this
    /// process (the extender, the bridge, the simulated nodes, the
    /// comparators and the workload).
    pub fn process_pids(&self) -> Vec<(&'static str, u32)> {
        let mut pids = self.plane.pids();
        if let Some(scheduler) = &self.scheduler {
            pids.push(("kube-scheduler", scheduler.id()));
        }
        pids.extend(self.replica_pids().into_iter().map(|pid| ("tetherd", pid)));
        pids.push(("bench process", std::process::id()));
        pids
    }

    pub fn replica_pids(&self) -> Vec<u32> {
        self.tether
            .running()
            .into_iter()
            .filter_map(|id| self.tether.pid(id))
            .collect()
    }
}

/// A Tether client of `endpoints` with the default options (each embedded
/// part has its own, as each runs in a process of its own when deployed).
fn tether_client(endpoints: &[String]) -> anyhow::Result<Client> {
    Ok(Client::new(endpoints.to_vec(), Options::default())?)
}

/// The name of node `i`.
pub fn node_name(i: usize) -> String {
    format!("gpu-node-{i:04}")
}

/// Runs `call` and, while it fails because the connection was cut under
/// it (the API server closed a pooled connection as the request went out:
/// "connection closed before message completed"), up to twice more.
/// Only for calls that may be repeated: a delete of what is left, a list.
/// A 1,000 x 8 run once ended in its set-up on one such cut.
async fn again_if_cut<T, F>(mut call: impl FnMut() -> F) -> kube::Result<T>
where
    F: std::future::Future<Output = kube::Result<T>>,
{
    let mut tries = 0;
    loop {
        match call().await {
            Err(kube::Error::Service(err)) if tries < 2 => {
                tries += 1;
                tracing::warn!(%err, "a call to the API server was cut; trying it again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// What an extender's filter metrics say so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FilterTime {
    /// Seconds in filter calls.
    pub seconds: f64,
    /// Calls.
    pub calls: f64,
    /// Seconds of those on a core.
    pub cpu_seconds: f64,
    /// The duration histogram's cumulative buckets: (upper bound in
    /// seconds, calls at or under it), bounds rising, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
}

impl FilterTime {
    /// Reads the filter's counters from the extender's OpenMetrics text.
    pub fn from_metrics(text: &str) -> FilterTime {
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let buckets = text
            .lines()
            .filter_map(|l| {
                let rest =
                    l.strip_prefix("tether_extender_filter_duration_seconds_bucket{le=\"")?;
                let (bound, count) = rest.split_once("\"}")?;
                let bound = if bound == "+Inf" {
                    f64::INFINITY
                } else {
                    bound.parse().ok()?
                };
                Some((bound, count.trim().parse().ok()?))
            })
            .collect();
        FilterTime {
            seconds: value("tether_extender_filter_duration_seconds_sum "),
            calls: value("tether_extender_filter_duration_seconds_count "),
            cpu_seconds: value("tether_extender_filter_cpu_seconds_total "),
            buckets,
        }
    }

    /// The calls since `before`: each counter and bucket less its value
    /// then.
    pub fn since(&self, before: &FilterTime) -> FilterTime {
        let buckets = self
            .buckets
            .iter()
            .map(|&(bound, count)| {
                let earlier = before
                    .buckets
                    .iter()
                    .find(|(b, _)| *b == bound)
                    .map_or(0.0, |(_, c)| *c);
                (bound, count - earlier)
            })
            .collect();
        FilterTime {
            seconds: self.seconds - before.seconds,
            calls: self.calls - before.calls,
            cpu_seconds: self.cpu_seconds - before.cpu_seconds,
            buckets,
        }
    }

    /// The `q` quantile of the calls' durations, from the buckets as
    /// Prometheus's `histogram_quantile` reads them: the bucket the rank
    /// falls in, and a straight line from its lower bound to its upper
    /// one. None without calls, or when the rank falls in the open `+Inf`
    /// bucket.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return None;
                }
                let within = if count > lower.1 {
                    (rank - lower.1) / (count - lower.1)
                } else {
                    0.0
                };
                return Some(Duration::from_secs_f64(
                    lower.0 + (bound - lower.0) * within,
                ));
            }
            lower = (bound, count);
        }
        None
    }
}

#[cfg(test)]
mod filter_time_tests {
    use super::*;

    const TEXT: &str = "\
tether_extender_filter_duration_seconds_sum 0.0030
tether_extender_filter_duration_seconds_count 10
tether_extender_filter_duration_seconds_bucket{le=\"0.0001\"} 2
tether_extender_filter_duration_seconds_bucket{le=\"0.0002\"} 6
tether_extender_filter_duration_seconds_bucket{le=\"0.0004\"} 10
tether_extender_filter_duration_seconds_bucket{le=\"+Inf\"} 10
tether_extender_filter_cpu_seconds_total 0.0010
";

    #[test]
    fn the_median_is_read_within_its_bucket() {
        let time = FilterTime::from_metrics(TEXT);
        assert_eq!(time.calls, 10.0);
        assert_eq!(time.buckets.len(), 4);
        // Rank 5 of 10 falls in (0.1 ms, 0.2 ms], 3 of its 4 calls in.
        let p50 = time.quantile(0.5).unwrap().as_secs_f64();
        assert!((p50 - 0.000_175).abs() < 1e-9, "{p50}");
        let p100 = time.quantile(1.0).unwrap().as_secs_f64();
        assert!((p100 - 0.000_4).abs() < 1e-9, "{p100}");
    }

    #[test]
    fn calls_since_a_reading_leave_the_earlier_ones_out() {
        let after = FilterTime::from_metrics(TEXT);
        let before = FilterTime::from_metrics(
            &TEXT
                .replace("count 10", "count 2")
                .replace("\"0.0002\"} 6", "\"0.0002\"} 2")
                .replace("\"0.0004\"} 10", "\"0.0004\"} 2")
                .replace("\"+Inf\"} 10", "\"+Inf\"} 2"),
        );
        let since = after.since(&before);
        assert_eq!(since.calls, 8.0);
        // None of the 8 later calls took 0.1 ms or less: rank 2 of 8 is
        // half-way through the 4 in (0.1 ms, 0.2 ms].
        let p25 = since.quantile(0.25).unwrap().as_secs_f64();
        assert!((p25 - 0.000_15).abs() < 1e-9, "{p25}");
        assert_eq!(FilterTime::default().quantile(0.5), None);
    }
}
