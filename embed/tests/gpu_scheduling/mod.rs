//! What the GPU suites on a real kube-scheduler share (`real_scheduler.rs`
//! with the fake kubelet, `real_node.rs` with a real one): the manifests of
//! `deploy/optional/gpu` read as deployed (RBAC, the scheduler's
//! configuration), and extender replicas started as deployed.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::extender::{Extender, ExtenderConfig, KubeBinder, serve_extender};
use tether_kube_testenv::{ControlPlane, gpu_manifests};
use tether_server::testing::DEADLINE;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::roles::{Endpoints, Identities, client_as};

pub const RESOURCE: &str = "tether.io/gpu";
/// The namespace the manifests' RBAC binds the accounts in.
pub const SYSTEM: &str = "tether-system";

pub type RunningExtender = Arc<Extender<KubeBinder>>;

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
    let tether = client_as(cluster, identities, "scheduler");
    let extender = Arc::new(Extender::new(
        tether.clone(),
        DeviceLedger::new(tether, DEFAULT_LIFETIME),
        KubeBinder::new(kube.clone()),
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
