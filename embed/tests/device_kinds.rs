//! Pods asking for two device kinds (HAMi-core #246's case) through the
//! extender and each kind's device plugin: the bind takes each kind's node
//! lock and claims each kind's devices in that kind's set; each plugin's
//! `Allocate` releases its own kind's lock only; a bind whose second kind
//! has no free device gives back the first kind's lock and claim; the
//! filter refuses a node for the kind it lacks.
//!
//! Three in-process replicas; the Kubernetes side is a binder that answers
//! from memory (`real_scheduler.rs` and the bind bench's
//! `pods_of_two_device_kinds_...` run the same through the real API server
//! and kube-scheduler).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Container, Node as KubeNode, NodeStatus, Pod as KubePod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tether_client::proto::LockKey;
use tether_client::{Client, Options};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::device_plugin::{GpuPlugin, PluginConfig};
use tether_embed::extender::{Binder, Extender, ExtenderArgs, ExtenderBindingArgs, ExtenderConfig};
use tether_embed::inventory::DeviceSource;
use tether_embed::kind::DeviceKind;
use tether_embed::requeue::Nudged;
use tether_embed::v1beta1 as api;
use tether_embed::v1beta1::device_plugin_server::DevicePlugin as _;
use tether_http::Departure;
use tether_server::testing::Cluster;

const GPU: &str = "tether.io/gpu";
const NPU: &str = "example.com/npu";
const NODE: &str = "mixed-node-1";
/// The node's devices: two GPUs, one of the second kind.
const GPUS: usize = 2;
const NPUS: usize = 1;

/// The API server's answers, from memory: every pod asks for one GPU in
/// its first container and one device of the second kind in its second.
struct MemoryApi;

fn limits(resource: &str) -> Option<ResourceRequirements> {
    Some(ResourceRequirements {
        limits: Some(BTreeMap::from([(
            resource.to_string(),
            Quantity("1".into()),
        )])),
        ..ResourceRequirements::default()
    })
}

fn two_kind_pod(namespace: &str, name: &str) -> KubePod {
    KubePod {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![
                Container {
                    name: "main".into(),
                    resources: limits(GPU),
                    ..Container::default()
                },
                Container {
                    name: "second".into(),
                    resources: limits(NPU),
                    ..Container::default()
                },
            ],
            ..PodSpec::default()
        }),
        ..KubePod::default()
    }
}

impl Binder for MemoryApi {
    async fn pod(&self, namespace: &str, name: &str) -> Result<KubePod, String> {
        Ok(two_kind_pod(namespace, name))
    }

    async fn node(&self, name: &str) -> Result<KubeNode, String> {
        Ok(KubeNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                allocatable: Some(BTreeMap::from([
                    (GPU.to_string(), Quantity(GPUS.to_string())),
                    (NPU.to_string(), Quantity(NPUS.to_string())),
                ])),
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

fn second_kind() -> DeviceKind {
    DeviceKind::named(NPU, "npu")
}

fn extender(client: &Client) -> Extender<MemoryApi> {
    Extender::new(
        client.clone(),
        DeviceLedger::new(client.clone(), DEFAULT_LIFETIME),
        MemoryApi,
        ExtenderConfig {
            scope: "gpu-bind".into(),
            resource: GPU.into(),
            wait: Duration::from_secs(5),
            bind_deadline: Duration::from_secs(20),
            device_prefix: "gpu".into(),
            inventory_ttl: Duration::from_secs(30),
            also_kinds: vec![second_kind()],
        },
    )
}

/// Tether's plugin of one kind on the node, as `tether-device-plugin`
/// would run it (not served on a socket: the test calls it).
fn plugin(client: &Client, kind: &DeviceKind, count: usize) -> GpuPlugin {
    GpuPlugin::new(
        client.clone(),
        PluginConfig {
            node: NODE.into(),
            scope: kind.scope.clone(),
            resource_name: kind.resource.clone(),
            claim_set: kind.claim_set.clone(),
            inventory_set: kind.inventory_set.clone(),
            devices: DeviceSource::parse(
                &format!("fake:{count}"),
                "/".into(),
                Duration::from_secs(5),
                &kind.device_prefix,
            )
            .expect("a device source"),
            pod_uid: "plugin-pod".into(),
            allocate_deadline: Duration::from_secs(20),
        },
    )
    .expect("a plugin")
}

fn binding(name: &str) -> ExtenderBindingArgs {
    ExtenderBindingArgs {
        pod_name: name.into(),
        pod_namespace: "ml".into(),
        pod_uid: format!("uid-{name}"),
        node: NODE.into(),
    }
}

fn lock(scope: &str) -> LockKey {
    LockKey {
        scope: scope.into(),
        name: NODE.into(),
    }
}

/// The UID of the pod holding `scope`'s lock of the node, if any.
async fn holder(client: &Client, scope: &str) -> Option<String> {
    client
        .holder(&lock(scope))
        .await
        .expect("a holder read")
        .and_then(|hold| hold.pod.map(|pod| pod.uid))
}

/// The pod `uid`'s claim of `kind`: its node and devices.
async fn claim_of(client: &Client, kind: &DeviceKind, uid: &str) -> Option<(String, Vec<String>)> {
    DeviceLedger::new(client.clone(), DEFAULT_LIFETIME)
        .in_set(&kind.claim_set)
        .claim_of(uid)
        .await
        .expect("a claim read")
}

/// The kubelet's `Allocate` of `devices` for one container.
async fn allocate(plugin: &GpuPlugin, devices: &[&str]) -> Result<(), String> {
    plugin
        .allocate(tonic::Request::new(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: devices.iter().map(|d| d.to_string()).collect(),
            }],
        }))
        .await
        .map(|_| ())
        .map_err(|status| status.message().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_of_two_kinds_holds_each_kinds_lock_and_each_plugin_releases_its_own() {
    let cluster = Cluster::start(3).await;
    cluster.wait_leader().await;
    let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
    let extender = extender(&client);
    let first = DeviceKind::first(GPU, "gpu-bind", "gpu");
    let second = second_kind();

    let answer = extender.bind(&binding("a"), &Departure::never()).await;
    assert_eq!(answer.error, "", "the bind of a pod of two kinds");
    // Both of the node's locks, for the pod; a claim in each kind's set.
    assert_eq!(holder(&client, "gpu-bind").await.as_deref(), Some("uid-a"));
    assert_eq!(holder(&client, "npu-bind").await.as_deref(), Some("uid-a"));
    let gpu_claim = claim_of(&client, &first, "uid-a")
        .await
        .expect("a GPU claim");
    let npu_claim = claim_of(&client, &second, "uid-a")
        .await
        .expect("a claim of the second kind");
    assert_eq!(gpu_claim.0, NODE);
    assert_eq!(gpu_claim.1.len(), 1);
    assert!(gpu_claim.1[0].starts_with("gpu"), "{gpu_claim:?}");
    assert_eq!(npu_claim, (NODE.to_string(), vec!["npu0".to_string()]));

    // The second kind's plugin serves its container and releases its own
    // lock; the GPU lock stays for the GPU plugin, which then releases it.
    let npu_plugin = plugin(&client, &second, NPUS);
    allocate(&npu_plugin, &["npu0"])
        .await
        .expect("the second kind's Allocate");
    assert_eq!(holder(&client, "npu-bind").await, None);
    assert_eq!(
        holder(&client, "gpu-bind").await.as_deref(),
        Some("uid-a"),
        "the second kind's plugin released the GPU lock"
    );
    let gpu_plugin = plugin(&client, &first, GPUS);
    let gpu = gpu_claim.1[0].clone();
    allocate(&gpu_plugin, &[&gpu])
        .await
        .expect("the GPU Allocate");
    assert_eq!(holder(&client, "gpu-bind").await, None);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_whose_second_kind_is_taken_gives_back_the_first_kinds_lock_and_claim() {
    let cluster = Cluster::start(3).await;
    cluster.wait_leader().await;
    let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
    let extender = extender(&client);
    let second = second_kind();
    // Pod a takes a GPU and the node's one device of the second kind, and
    // its plugins serve it (its locks end; its claims stay while it runs).
    assert_eq!(
        extender
            .bind(&binding("a"), &Departure::never())
            .await
            .error,
        ""
    );
    let gpu = DeviceKind::first(GPU, "gpu-bind", "gpu");
    let (_, a_gpus) = claim_of(&client, &gpu, "uid-a")
        .await
        .expect("a's GPU claim");
    allocate(&plugin(&client, &second, NPUS), &["npu0"])
        .await
        .expect("a's second-kind Allocate");
    allocate(&plugin(&client, &gpu, GPUS), &[&a_gpus[0]])
        .await
        .expect("a's GPU Allocate");

    // The filter refuses the node for pod b, for the kind it lacks.
    let filtered = extender
        .filter(ExtenderArgs {
            pod: Some(two_kind_pod("ml", "b")),
            nodes: None,
            node_names: Some(vec![NODE.into()]),
        })
        .await;
    assert_eq!(filtered.error, "");
    assert_eq!(filtered.node_names, Some(Vec::new()));
    let why = filtered
        .failed_nodes
        .get(NODE)
        .expect("a reason for the node");
    assert!(why.contains(NPU), "{why}");
    assert!(!why.contains(GPU), "a GPU is free, yet: {why}");

    // Bound anyway (as a scheduler with a stale view might): the GPU is
    // free, the second kind is not. The bind fails and keeps nothing.
    let answer = extender.bind(&binding("b"), &Departure::never()).await;
    assert!(answer.error.contains(NPU), "{}", answer.error);
    assert_eq!(holder(&client, "gpu-bind").await, None);
    assert_eq!(holder(&client, "npu-bind").await, None);
    assert_eq!(
        claim_of(&client, &gpu, "uid-b").await,
        None,
        "the failed bind kept its GPU claim"
    );
    cluster.shutdown().await;
}

/// Issue 62, case 4: a pod short of both kinds on the node is remembered
/// for both, and asked about again only once both have freed — not when
/// the first kind alone frees (the refusal used to name the first kind
/// only, so the pod was asked about in vain, and never when the second
/// kind was the one that freed last).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_short_of_both_kinds_is_asked_about_again_once_both_free() {
    use tether_embed::accounting::ClaimOwner;
    let cluster = Cluster::start(3).await;
    cluster.wait_leader().await;
    let client = Client::new(cluster.endpoints(), Options::default()).expect("a client");
    let extender = extender(&client);
    let gpus = DeviceLedger::new(client.clone(), DEFAULT_LIFETIME);
    let npus = gpus.clone().in_set(&second_kind().claim_set);
    let owner = |uid: &'static str| ClaimOwner {
        uid,
        namespace: "ml",
        name: uid,
    };
    // Every device of both kinds claimed by live pods.
    gpus.claim(NODE, owner("x"), &["gpu0".into(), "gpu1".into()])
        .await
        .expect("x's GPUs");
    npus.claim(NODE, owner("y"), &["npu0".into()])
        .await
        .expect("y's device of the second kind");

    let filtered = extender
        .filter(ExtenderArgs {
            pod: Some(two_kind_pod("ml", "b")),
            nodes: None,
            node_names: Some(vec![NODE.into()]),
        })
        .await;
    assert_eq!(filtered.node_names, Some(Vec::new()));
    let refusal = extender.refusals().get("uid-b").expect("b's refusal");
    assert_eq!(
        refusal.nodes[NODE].keys().copied().collect::<Vec<_>>(),
        [0, 1],
        "short of both kinds on the node"
    );

    // The GPUs free: the pod still lacks the second kind.
    gpus.release("x", "ended").await.expect("x ends");
    assert_eq!(extender.requeue_pass().await, 0, "asked about in vain");
    // The second kind frees too: asked about.
    npus.release("y", "ended").await.expect("y ends");
    assert_eq!(extender.requeue_pass().await, 1);
    cluster.shutdown().await;
}
