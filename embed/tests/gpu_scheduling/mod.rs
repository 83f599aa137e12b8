//! What the GPU suites on a real kube-scheduler share (`real_scheduler.rs`
//! with the fake kubelet, `real_node.rs` with a real one): the manifests of
//! `deploy/optional/gpu` read as deployed (RBAC, the scheduler's
//! configuration), and extender replicas started as deployed.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as KubeNode, Pod as KubePod};
use serde_json::{Value, json};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::extender::{
    Binder, Extender, ExtenderBindingArgs, ExtenderConfig, KubeBinder, serve_extender,
};
use tether_embed::requeue::Nudged;
use tether_kube_testenv::{ControlPlane, gpu_manifests};
use tether_server::testing::DEADLINE;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::roles::{Endpoints, Identities, client_as};

pub const RESOURCE: &str = "tether.io/gpu";
/// The namespace the manifests' RBAC binds the accounts in.
pub const SYSTEM: &str = "tether-system";

pub type RunningExtender = Arc<Extender<TestBinder>>;

/// What the API server does to an extender's calls, as the test sets it:
/// nothing unless asked (every call goes to the real API server).
#[derive(Default)]
pub struct ApiFaults {
    /// Pod name -> the next read of it, held until the test lets it
    /// answer (it answers what the API server said when the read was made:
    /// a slow, overloaded API server).
    held_reads: std::sync::Mutex<std::collections::BTreeMap<String, Arc<HeldRead>>>,
    /// Pods whose next binding call lands but whose answer is lost, and
    /// whose next read after that fails too (an overloaded API server
    /// that times out both).
    lost_binds: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Pods whose next read fails (after a lost bind).
    failing_reads: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// A read held back by the test ([`ApiFaults::hold_next_read`]).
pub struct HeldRead {
    made: std::sync::atomic::AtomicBool,
    answer: tokio::sync::Semaphore,
}

impl Default for HeldRead {
    fn default() -> Self {
        Self {
            made: Default::default(),
            answer: tokio::sync::Semaphore::new(0),
        }
    }
}

impl HeldRead {
    /// Whether the read was made (and now waits to answer).
    pub fn made(&self) -> bool {
        self.made.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets it answer.
    pub fn answer(&self) {
        self.answer.add_permits(1);
    }
}

impl ApiFaults {
    /// Holds the next read of pod `name` until the test lets it answer.
    pub fn hold_next_read(&self, name: &str) -> Arc<HeldRead> {
        let held = Arc::new(HeldRead::default());
        self.held_reads
            .lock()
            .unwrap()
            .insert(name.into(), held.clone());
        held
    }

    /// The next binding of pod `name` lands with its answer lost, and the
    /// read after it fails.
    pub fn lose_next_bind(&self, name: &str) {
        self.lost_binds.lock().unwrap().insert(name.into());
    }
}

/// The extender's binder in these tests: [`KubeBinder`] with the faults
/// the test injects ([`ApiFaults`]).
pub struct TestBinder {
    real: KubeBinder,
    faults: Arc<ApiFaults>,
}

impl Binder for TestBinder {
    async fn pod(&self, namespace: &str, name: &str) -> Result<KubePod, String> {
        if self.faults.failing_reads.lock().unwrap().remove(name) {
            return Err(format!(
                "the server was unable to return a response in the time allotted (pod {name})"
            ));
        }
        let held = self.faults.held_reads.lock().unwrap().remove(name);
        let answer = self.real.pod(namespace, name).await;
        if let Some(held) = held {
            held.made.store(true, std::sync::atomic::Ordering::SeqCst);
            let _ = held.answer.acquire().await;
        }
        answer
    }

    async fn node(&self, name: &str) -> Result<KubeNode, String> {
        self.real.node(name).await
    }

    async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        let lost = self
            .faults
            .lost_binds
            .lock()
            .unwrap()
            .remove(&args.pod_name);
        let answer = self.real.bind(args).await;
        if lost && answer.is_ok() {
            self.faults
                .failing_reads
                .lock()
                .unwrap()
                .insert(args.pod_name.clone());
            return Err("Post \"pods/binding\": context deadline exceeded".into());
        }
        answer
    }

    async fn unbound_pods(&self) -> Result<Vec<KubePod>, String> {
        self.real.unbound_pods().await
    }

    async fn nudge(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        value: &str,
    ) -> Result<Nudged, String> {
        self.real.nudge(namespace, name, uid, value).await
    }

    async fn follow_deletions(&self, deleted: Arc<dyn Fn(&str) + Send + Sync>) {
        self.real.follow_deletions(deleted).await
    }

    async fn follow_nodes(&self, objects: Arc<tether_embed::node_objects::NodeObjects>) {
        self.real.follow_nodes(objects).await
    }
}

/// The manifests' objects of `kinds` in `file`.
pub fn objects_of(file: &str, kinds: &[&str]) -> Vec<Value> {
    gpu_manifests::objects_of(file, kinds).unwrap()
}

/// The manifest's KubeSchedulerConfiguration, the extender at `extender`
/// and the API server through `kubeconfig`.
pub fn scheduler_config(extender: SocketAddr, kubeconfig: &Path) -> Value {
    gpu_manifests::scheduler_config(extender, kubeconfig).unwrap()
}

/// Applies the RBAC of the extender, the bridge and the scheduler from the
/// manifests (their service accounts in [`SYSTEM`]).
pub async fn apply_rbac(plane: &ControlPlane) {
    gpu_manifests::apply_gpu_rbac(plane, SYSTEM).await.unwrap()
}

/// An extender replica as deployed (role `scheduler`, waiting `wait` for
/// a node's lock), serving on `listener`.
pub fn start_extender(
    cluster: &impl Endpoints,
    identities: &Identities,
    kube: &kube::Client,
    wait: Duration,
    listener: TcpListener,
) -> (RunningExtender, JoinHandle<()>) {
    start_extender_with(cluster, identities, kube, wait, listener, Arc::default())
}

/// [`start_extender`], its API calls meeting `faults`.
pub fn start_extender_with(
    cluster: &impl Endpoints,
    identities: &Identities,
    kube: &kube::Client,
    wait: Duration,
    listener: TcpListener,
    faults: Arc<ApiFaults>,
) -> (RunningExtender, JoinHandle<()>) {
    let tether = client_as(cluster, identities, "scheduler");
    let binder = TestBinder {
        real: KubeBinder::new(kube.clone()),
        faults,
    };
    let extender = Arc::new(Extender::new(
        tether.clone(),
        DeviceLedger::new(tether, DEFAULT_LIFETIME),
        binder,
        extender_config(wait),
    ));
    let task = tokio::spawn(serve_extender(
        listener,
        extender.clone(),
        std::future::pending(),
    ));
    (extender, task)
}

/// Starts the real bridge in the test's process: as its service account
/// (the manifests' RBAC), with Tether role `bridge` and its default resync.
pub async fn spawn_bridge(
    plane: &ControlPlane,
    cluster: &impl Endpoints,
    identities: &Identities,
) -> (Arc<tether_k8s_bridge::bridge::Bridge>, JoinHandle<()>) {
    let kube = plane
        .client_as_service_account(SYSTEM, "tether-bridge")
        .await;
    let tether = client_as(cluster, identities, "bridge");
    let bridge = tether_k8s_bridge::bridge::Bridge::new(tether, kube);
    let task = tokio::spawn({
        let bridge = bridge.clone();
        async move {
            bridge
                .run(Duration::from_secs(60), std::future::pending())
                .await
        }
    });
    (bridge, task)
}

/// The extender's configuration as deployed, waiting `wait` for a node's
/// lock, its binds bounded by the test deadline.
pub fn extender_config(wait: Duration) -> ExtenderConfig {
    ExtenderConfig {
        scope: "gpu-bind".into(),
        resource: RESOURCE.into(),
        wait,
        bind_deadline: DEADLINE,
        device_prefix: "gpu".into(),
        inventory_ttl: Duration::from_secs(30),
        also_kinds: Vec::new(),
    }
}

/// Creates node `name` with `labels`, as its kubelet registers it: Ready,
/// `resources` (beside 8 CPUs, 32 GiB and 110 pods) as capacity and
/// allocatable, and (as the node lifecycle controller does for a Ready
/// node) no `not-ready` taint.
pub async fn register_ready_node(
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
    name: &str,
    labels: Value,
    resources: &[(&str, String)],
) {
    let node = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))
        .expect("a node");
    nodes
        .create(&kube::api::PostParams::default(), &node)
        .await
        .unwrap();
    let mut all = json!({"cpu": "8", "memory": "32Gi", "pods": "110"});
    for (resource, count) in resources {
        all[*resource] = json!(count);
    }
    nodes
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {
                "capacity": all, "allocatable": all,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "lastHeartbeatTime": "2026-12-03T00:00:00Z",
                                "lastTransitionTime": "2026-12-03T00:00:00Z"}],
            }})),
        )
        .await
        .unwrap();
    remove_not_ready_taint(nodes, name).await;
}

/// Removes the taints of node `name` (the `node.kubernetes.io/not-ready`
/// one it was registered with), as the node lifecycle controller does once
/// the node is Ready; no such controller runs in these tests.
pub async fn remove_not_ready_taint(
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
    name: &str,
) {
    nodes
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await
        .unwrap();
}
