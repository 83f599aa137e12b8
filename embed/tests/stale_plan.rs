//! A bind plans its devices from the extender's watched copy of the claims
//! instead of reading them from Tether (issue 64: a read saved per pod),
//! and Tether still decides: a plan from a copy that has not yet seen a
//! claim is refused by the claimed device's anti-affinity, and the bind
//! reads the claims and plans again, taking a free device. No device is
//! given twice.
//!
//! The copy is made stale on purpose with the failpoint
//! `device-view-frozen` (it stays whole and takes in no change). The
//! failpoint is process-wide, so this file holds one test. Three
//! in-process replicas; the Kubernetes side answers from memory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    Container, Node as KubeNode, NodeStatus, Pod as KubePod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tether_client::{Client, Options};
use tether_embed::accounting::{Claim, ClaimOwner, DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::extender::{Binder, Extender, ExtenderBindingArgs, ExtenderConfig};
use tether_embed::requeue::Nudged;
use tether_http::Departure;
use tether_server::testing::Cluster;

const GPU: &str = "tether.io/gpu";
const NODE: &str = "gpu-node-1";

/// The API server's answers, from memory: a node of two GPUs, pods of one.
struct MemoryApi;

impl Binder for MemoryApi {
    async fn pod(&self, namespace: &str, name: &str) -> Result<KubePod, String> {
        Ok(KubePod {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "main".into(),
                    resources: Some(ResourceRequirements {
                        limits: Some(BTreeMap::from([(GPU.to_string(), Quantity("1".into()))])),
                        ..ResourceRequirements::default()
                    }),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            ..KubePod::default()
        })
    }

    async fn node(&self, name: &str) -> Result<KubeNode, String> {
        Ok(KubeNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(BTreeMap::from([(GPU.to_string(), Quantity("2".into()))])),
                ..NodeStatus::default()
            }),
            ..KubeNode::default()
        })
    }

    async fn bind(&self, _args: &ExtenderBindingArgs) -> Result<(), String> {
        Ok(())
    }

    async fn unbound_pods(&self) -> Result<Vec<KubePod>, String> {
        Ok(Vec::new())
    }

    async fn nudge(&self, _: &str, _: &str, _: &str, _: &str) -> Result<Nudged, String> {
        Ok(Nudged::Asked)
    }
}

fn binding(name: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: "ml".into(),
        pod_uid: format!("uid-{name}"),
        node: NODE.into(),
    }
}

/// The pod `uid`'s claimed devices on the node.
async fn claimed(ledger: &DeviceLedger, uid: &str) -> Vec<String> {
    match ledger.claim_of(uid).await.expect("a claim read") {
        Some((node, devices)) if node == NODE => devices,
        other => panic!("pod {uid} has no claim on {NODE}: {other:?}"),
    }
}

/// Waits (20 s at most) until the extender's copy of the claims shows
/// `uid`'s claim on the node.
async fn until_the_copy_shows(extender: &Extender<MemoryApi>, uid: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let shown = extender.device_view().read(|pins| {
            pins.claims_on(NODE)
                .is_some_and(|claims| claims.values().any(|owner| owner == uid))
        });
        if shown == Some(true) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the extender's copy did not show {uid}'s claim in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plan_from_a_stale_copy_is_refused_by_tether_and_planned_again_from_a_read() {
    let cluster = Cluster::start(3).await;
    cluster.wait_leader().await;
    let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
    let ledger = DeviceLedger::new(client.clone(), DEFAULT_LIFETIME);
    let extender = Arc::new(Extender::new(
        client.clone(),
        ledger.clone(),
        MemoryApi,
        ExtenderConfig {
            scope: "gpu-bind".into(),
            resource: GPU.into(),
            wait: Duration::from_secs(5),
            bind_deadline: Duration::from_secs(20),
            device_prefix: "gpu".into(),
            inventory_ttl: Duration::from_secs(30),
            also_kinds: Vec::new(),
        },
    ));
    let following = tokio::spawn(extender.device_view().clone().follow());

    // A copy that is current: the bind plans from it and Tether takes the
    // plan (pod a gets the first free GPU).
    let bound = extender.bind(&binding("a"), &Departure::never()).await;
    assert_eq!(bound.error, "", "pod a's bind");
    let a_devices = claimed(&ledger, "uid-a").await;
    assert_eq!(a_devices, ["gpu0"]);
    assert_eq!(extender.metrics().stale_plans(), 0, "a current copy's plan");
    until_the_copy_shows(&extender, "uid-a").await;
    // The device plugin's release of a's hold, so b's bind is not queued.
    let a_hold = client
        .holder(&tether_client::proto::LockKey {
            scope: "gpu-bind".into(),
            name: NODE.into(),
        })
        .await
        .expect("a holder read")
        .expect("a's hold");
    client
        .release(
            &tether_client::proto::LockKey {
                scope: "gpu-bind".into(),
                name: NODE.into(),
            },
            "uid-a",
            a_hold.token,
            tether_client::proto::Outcome::Allocated,
        )
        .await
        .expect("a's release");

    // The copy stops taking in changes; another client then claims the
    // node's other GPU for pod c, which the copy does not see.
    fail::cfg("device-view-frozen", "return").expect("the failpoint");
    let taken = ledger
        .claim(
            NODE,
            ClaimOwner {
                uid: "uid-c",
                namespace: "ml",
                name: "c",
            },
            &["gpu1".to_string()],
        )
        .await
        .expect("c's claim");
    assert!(matches!(taken, Claim::Held(_)), "c's claim: {taken:?}");
    // Pod a is deleted meanwhile (its claim ends), so one GPU is free in
    // Tether: gpu0. The copy, frozen, still shows a on gpu0 and gpu1 free,
    // and plans gpu1.
    ledger
        .release("uid-a", "pod a deleted")
        .await
        .expect("a's claim ended");
    let bound = extender.bind(&binding("b"), &Departure::never()).await;
    fail::remove("device-view-frozen");
    assert_eq!(bound.error, "", "pod b's bind");
    assert_eq!(
        extender.metrics().stale_plans(),
        1,
        "the frozen copy's plan (gpu1, claimed by c) was refused once"
    );
    assert_eq!(
        claimed(&ledger, "uid-b").await,
        ["gpu0"],
        "b took the free GPU"
    );
    assert_eq!(claimed(&ledger, "uid-c").await, ["gpu1"], "c kept its GPU");
    following.abort();
    cluster.shutdown().await;
}
