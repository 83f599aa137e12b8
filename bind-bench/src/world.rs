//! The world one run binds pods in: the control plane, Tether, the
//! extender, the bridge, kube-scheduler as `deploy/optional/gpu` configures
//! it, and the simulated nodes (see the crate's doc for what each is).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use futures::StreamExt as _;
use serde_json::{Value, json};
use tether_chaos::cluster::ProcessCluster;
use tether_client::{Client, Options};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::cli::ExtenderArgs;
use tether_embed::extender::{Extender, ExtenderConfig, KubeBinder, serve_extender};
use tether_kube_testenv::{ControlPlane, Process, yaml_documents};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::node::{Fleet, SimNode};

/// The extended resource the nodes advertise and the pods ask for.
pub const RESOURCE: &str = "tether.io/gpu";
/// The namespace the manifests' RBAC binds the service accounts in.
pub const SYSTEM: &str = "tether-system";
/// The scheduler profile of `deploy/optional/gpu/scheduler.yaml`.
pub const SCHEDULER_NAME: &str = "tether-gpu";
/// How many node registrations are sent at once.
const REGISTRATIONS_IN_FLIGHT: usize = 16;

/// What a world is made of.
#[derive(Debug, Clone)]
pub struct WorldOptions {
    /// The `tetherd` the replicas run.
    pub tetherd: PathBuf,
    /// Simulated GPU nodes.
    pub nodes: usize,
    /// GPUs on each.
    pub gpus: usize,
}

/// Everything one run needs, running.
pub struct World {
    /// The control plane (stopped on drop).
    pub plane: ControlPlane,
    /// The 3 Tether replicas (stopped on drop).
    pub tether: ProcessCluster,
    /// The API server as the admin (the workload creates pods with it).
    pub admin: kube::Client,
    /// The namespace the workload's pods live in.
    pub namespace: String,
    /// The simulated nodes and the kubelet side that serves them.
    pub fleet: Arc<Fleet>,
    _scheduler: Process,
    tasks: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for World {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// `deploy/optional/gpu/<file>` in this checkout.
fn gpu_manifest(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/optional/gpu")
        .join(file)
}

/// The objects of `kinds` in manifest `file`.
fn objects_of(file: &str, kinds: &[&str]) -> anyhow::Result<Vec<Value>> {
    Ok(yaml_documents(&gpu_manifest(file))?
        .into_iter()
        .filter(|o| kinds.contains(&o["kind"].as_str().unwrap_or_default()))
        .collect())
}

/// The manifest's KubeSchedulerConfiguration, its extender at `extender`,
/// the API server through `kubeconfig`.
fn scheduler_config(extender: std::net::SocketAddr, kubeconfig: &Path) -> anyhow::Result<Value> {
    let config_map = objects_of("scheduler.yaml", &["ConfigMap"])?
        .into_iter()
        .next()
        .context("scheduler.yaml has no ConfigMap")?;
    let text = config_map["data"]["config.yaml"]
        .as_str()
        .context("the ConfigMap has no config.yaml")?;
    let mut config: Value = serde_saphyr::from_str(text)?;
    let extenders = config["extenders"]
        .as_array_mut()
        .context("the configuration has no extenders")?;
    anyhow::ensure!(extenders.len() == 1, "one extender expected");
    let url = extenders[0]["urlPrefix"].as_str().unwrap_or_default();
    let path = url
        .splitn(4, '/')
        .nth(3)
        .context("the extender's urlPrefix has no path")?;
    extenders[0]["urlPrefix"] = json!(format!("http://{extender}/{path}"));
    config["clientConnection"] = json!({"kubeconfig": kubeconfig.display().to_string()});
    Ok(config)
}

/// The extender's, the bridge's and the scheduler's service accounts and
/// RBAC, from the manifests.
async fn apply_rbac(plane: &ControlPlane) -> anyhow::Result<()> {
    let kinds = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"];
    let mut rbac = objects_of("extender.yaml", &kinds)?;
    rbac.extend(yaml_documents(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/bridge-rbac.yaml"),
    )?);
    rbac.extend(objects_of("scheduler.yaml", &kinds)?);
    plane.apply(&rbac, SYSTEM).await
}

impl World {
    /// Starts everything on `plane` and registers the nodes; returns once
    /// every node's devices are published and the scheduler runs.
    pub async fn start(plane: ControlPlane, options: &WorldOptions) -> anyhow::Result<World> {
        let dir = tempfile::tempdir()?;
        apply_rbac(&plane).await?;
        let tether = ProcessCluster::start(&options.tetherd, 3).await?;
        let endpoints = tether.endpoints.join(",");
        let mut tasks = Vec::new();

        // The extender, with tether-extender's own defaults.
        let args = ExtenderArgs::try_parse_from(["tether-extender", "--endpoints", &endpoints])?;
        let extender_kube = plane
            .client_as_service_account(SYSTEM, "tether-extender")
            .await;
        let client = args.tether.client(Options::default())?;
        let extender = Arc::new(Extender::new(
            client.clone(),
            DeviceLedger::new(client, DEFAULT_LIFETIME),
            KubeBinder::new(extender_kube),
            ExtenderConfig {
                scope: args.scope,
                resource: args.resource,
                wait: args.bind_wait,
                bind_deadline: args.bind_deadline,
                device_prefix: args.device_prefix,
                inventory_ttl: args.inventory_ttl,
            },
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let extender_addr = listener.local_addr()?;
        tasks.push(tokio::spawn(serve_extender(
            listener,
            extender,
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
        let namespace = plane.namespace("binds").await;
        let mut nodes = Vec::with_capacity(options.nodes);
        for i in 0..options.nodes {
            nodes.push(Arc::new(SimNode::new(
                &node_name(i),
                options.gpus,
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
        let fleet = Fleet::new(nodes, admin.clone(), &namespace);
        tasks.push(tokio::spawn(fleet.clone().serve()));

        let kubeconfig = plane
            .service_account_kubeconfig(SYSTEM, "tether-scheduler")
            .await;
        let config_path = dir.path().join("scheduler.json");
        std::fs::write(
            &config_path,
            scheduler_config(extender_addr, &kubeconfig)?.to_string(),
        )?;
        let scheduler = plane.scheduler_logging(&config_path, 2)?;
        Ok(World {
            plane,
            tether,
            admin,
            namespace,
            fleet,
            _scheduler: scheduler,
            tasks,
            _dir: dir,
        })
    }

    /// The replicas' process ids (for their CPU and memory).
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
