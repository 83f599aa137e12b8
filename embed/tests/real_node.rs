//! The GPU path on a real node: kube-scheduler v1.36 with the extender as
//! `deploy/optional/gpu` configures it (`gpu_scheduling/`), a real kubelet
//! and containerd (`tether_kube_testenv::RealNode`) driving the device
//! plugin over the real v1beta1 API, containerd applying the CDI devices
//! the plugin names, the real bridge, and a 3-replica Tether on mutual TLS
//! (in the test's process).
//!
//! The node is the NVIDIA fixture host (`tests/fixtures/nvidia/eight-gpus`:
//! eight GPUs on NUMA nodes 0 and 1). Its device nodes exist in the node's
//! `/dev` (made with `/dev/null`'s numbers, which the devices cgroup lets a
//! container open), and a CDI spec for the fixture's UUIDs in containerd's
//! CDI directory gives each GPU an environment variable of its own and its
//! device node. Each pod is busybox printing its environment and `/dev`;
//! the test reads that from the kubelet's log files.
//!
//! The device plugin runs in the test's process and serves the kubelet
//! through the node's namespace (`RealNode::device_plugin_dir`). The node
//! reports status at the kubelet's own cadence. The one thing the test
//! does that a cluster's controllers would: it removes the `not-ready`
//! taint the node was registered with (the node lifecycle controller's
//! work once the node is Ready).

mod fixtures;
mod gpu_scheduling;
mod roles;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_scheduling::{
    RESOURCE, RunningExtender, apply_rbac, scheduler_config, spawn_bridge, start_extender,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use roles::{Identities, client_as, cluster_on_tls};
use serde_json::json;
use tether_client::Client;
use tether_client::proto::LockKey;
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, run};
use tether_embed::inventory::DeviceSource;
use tether_kube_testenv::node::BUSYBOX_IMAGE;
use tether_kube_testenv::{ControlPlane, NodeOptions, Process, RealNode, node_assets_or_skip};
use tether_server::testing::{Cluster, DEADLINE};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const NODE: &str = "gpu-real-1";

/// The extender's bind wait as deployed (`tether-extender`'s default).
const DEPLOYED_WAIT: Duration = Duration::from_secs(3);

/// How long a pod may take from creation to its container's end: the
/// scheduler, the bind, the kubelet's sandbox and container (seconds here),
/// on a loaded 2-core machine.
const POD_DEADLINE: Duration = Duration::from_secs(120);

struct Rig {
    cluster: Cluster,
    /// Tether as an operator would act.
    client: Client,
    pods: Api<Pod>,
    namespace: String,
    node: RealNode,
    _extender: RunningExtender,
    scheduler: Process,
    tasks: Vec<JoinHandle<()>>,
    _host: tempfile::TempDir,
    plane: ControlPlane,
}

/// A CDI spec for the fixture's eight GPUs: kind `nvidia.com/gpu`, each
/// device named by its UUID, giving `TETHER_CDI_GPU_<minor>=<UUID>` and
/// its device node.
fn cdi_spec() -> serde_json::Value {
    let devices: Vec<serde_json::Value> = (0..8)
        .map(|minor| {
            json!({
                "name": fixtures::uuid(minor),
                "containerEdits": {
                    "env": [format!("TETHER_CDI_GPU_{minor}={}", fixtures::uuid(minor))],
                    "deviceNodes": [{"path": format!("/dev/nvidia{minor}")}],
                },
            })
        })
        .collect();
    json!({"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices})
}

impl Rig {
    async fn start(test: &str) -> Option<Rig> {
        node_assets_or_skip(test)?;
        let plane = ControlPlane::start_or_skip(test).await?;
        apply_rbac(&plane).await;
        let identities = Identities::new();
        let cluster = cluster_on_tls(&identities).await;
        let client = client_as(&cluster, &identities, "admin");

        // The node: the fixture's device nodes exist in its /dev.
        let host = fixtures::nvidia_node("eight-gpus");
        let device_nodes = std::fs::read_dir(host.path().join("dev"))
            .unwrap()
            .map(|entry| (entry.unwrap().file_name().into_string().unwrap(), 1, 3))
            .collect();
        let node = RealNode::start(&plane, NODE, NodeOptions { device_nodes })
            .await
            .expect("the node starts");
        std::fs::write(node.cdi_dir().join("nvidia.json"), cdi_spec().to_string()).unwrap();
        remove_not_ready_taint(&plane).await;

        let plugin = Arc::new(
            GpuPlugin::new(
                client_as(&cluster, &identities, &format!("device-plugin:{NODE}")),
                PluginConfig {
                    node: NODE.into(),
                    scope: "gpu-bind".into(),
                    resource_name: RESOURCE.into(),
                    devices: DeviceSource::Nvidia {
                        host_root: host.path().to_path_buf(),
                        rescan: Duration::from_secs(1),
                    },
                    pod_uid: "device-plugin-pod".into(),
                    allocate_deadline: DEADLINE,
                },
            )
            .unwrap(),
        );
        let placement = Placement {
            dir: node.device_plugin_dir(),
            socket_name: "tether-gpu.sock".into(),
        };
        let mut tasks = vec![tokio::spawn(async move {
            run(plugin, placement, std::future::pending())
                .await
                .unwrap()
        })];

        let extender_kube = plane
            .client_as_service_account(gpu_scheduling::SYSTEM, "tether-extender")
            .await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let extender_addr = listener.local_addr().unwrap();
        let (extender, serving) = start_extender(
            &cluster,
            &identities,
            &extender_kube,
            DEPLOYED_WAIT,
            listener,
        );
        tasks.push(serving);
        let scheduler_kubeconfig = plane
            .service_account_kubeconfig(gpu_scheduling::SYSTEM, "tether-scheduler")
            .await;
        let config = scheduler_config(extender_addr, &scheduler_kubeconfig);
        let config_path = node.dir().join("scheduler.json");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let scheduler = plane.scheduler(&config_path).unwrap();
        let (bridge, bridge_task) = spawn_bridge(&plane, &cluster, &identities).await;
        tasks.push(bridge_task);

        let namespace = plane.namespace("gpu").await;
        let rig = Rig {
            pods: Api::namespaced(plane.client().await, &namespace),
            namespace,
            cluster,
            client,
            node,
            _extender: extender,
            scheduler,
            tasks,
            _host: host,
            plane,
        };
        rig.wait_for("the bridge's first lists", async || bridge.healthy())
            .await;
        rig.wait_for("the kubelet to count the plugin's eight GPUs", async || {
            rig.allocatable().await == 8
        })
        .await;
        Some(rig)
    }

    /// The node's allocatable GPUs, as the kubelet reports them.
    async fn allocatable(&self) -> u64 {
        let nodes: Api<Node> = Api::all(self.plane.client().await);
        nodes
            .get(NODE)
            .await
            .ok()
            .and_then(|n| n.status?.allocatable?.get(RESOURCE).cloned())
            .and_then(|q| q.0.parse().ok())
            .unwrap_or(0)
    }

    async fn wait_for(&self, what: &str, mut check: impl AsyncFnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + POD_DEADLINE;
        while !check().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}\n{}\n{}",
                self.node.log_tails(30),
                self.scheduler.log_tail(20)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A busybox pod for the `tether-gpu` scheduler asking for `gpus`,
    /// printing its environment and `/dev`, then running on (its claim
    /// stands while it runs).
    async fn create_pod(&self, name: &str, gpus: u32) -> Pod {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "schedulerName": "tether-gpu",
                "hostNetwork": true,
                "restartPolicy": "Never",
                "containers": [{
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "env; echo DEV $(ls /dev); exec sleep 3600"],
                    "resources": {"limits": {RESOURCE: gpus.to_string()}},
                }],
            },
        }))
        .unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    /// Waits for pod `name` to run and print what it was given; that.
    async fn output_of(&self, name: &str) -> ContainerView {
        let started = Instant::now();
        self.wait_for(&format!("pod {name} to run and print"), async || {
            let phase = self
                .pods
                .get(name)
                .await
                .unwrap()
                .status
                .and_then(|s| s.phase)
                .unwrap_or_default();
            assert!(
                phase == "Pending" || phase == "Running",
                "pod {name} is {phase}"
            );
            phase == "Running"
                && self
                    .node
                    .container_log(&self.namespace, name, "main")
                    .contains("DEV ")
        })
        .await;
        println!("pod {name} created -> running in {:?}", started.elapsed());
        ContainerView::parse(&self.node.container_log(&self.namespace, name, "main"))
    }

    /// Device claims on the node: device -> pod uid.
    async fn claims(&self) -> BTreeMap<String, String> {
        DeviceLedger::new(self.client.clone(), DEFAULT_LIFETIME)
            .in_use(NODE)
            .await
            .unwrap()
    }

    async fn holder(&self) -> Option<String> {
        self.client
            .holder(&LockKey {
                scope: "gpu-bind".into(),
                name: NODE.into(),
            })
            .await
            .unwrap()
            .map(|h| h.pod.unwrap().name)
    }

    async fn uid_of(&self, name: &str) -> String {
        self.pods.get(name).await.unwrap().metadata.uid.unwrap()
    }

    async fn shutdown(self) {
        for task in &self.tasks {
            task.abort();
        }
        drop(self.node);
        self.cluster.shutdown().await;
    }
}

/// Removes the `node.kubernetes.io/not-ready` taint the node was
/// registered with, as the node lifecycle controller does once it is Ready.
async fn remove_not_ready_taint(plane: &ControlPlane) {
    let nodes: Api<Node> = Api::all(plane.client().await);
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": null}})),
        )
        .await
        .unwrap();
}

/// What a pod's container printed: its environment and its `/dev`.
#[derive(Debug)]
struct ContainerView {
    env: BTreeMap<String, String>,
    dev: BTreeSet<String>,
}

impl ContainerView {
    fn parse(log: &str) -> ContainerView {
        let mut env = BTreeMap::new();
        let mut dev = BTreeSet::new();
        for line in log.lines() {
            if let Some(listing) = line.strip_prefix("DEV ") {
                dev.extend(listing.split_whitespace().map(str::to_string));
            } else if let Some((k, v)) = line.split_once('=') {
                env.insert(k.to_string(), v.to_string());
            }
        }
        ContainerView { env, dev }
    }

    /// The GPUs by `NVIDIA_VISIBLE_DEVICES`.
    fn visible(&self) -> BTreeSet<String> {
        self.env
            .get("NVIDIA_VISIBLE_DEVICES")
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// The GPUs by the CDI spec's edits (minor -> UUID).
    fn cdi(&self) -> BTreeMap<u32, String> {
        self.env
            .iter()
            .filter_map(|(k, v)| {
                Some((k.strip_prefix("TETHER_CDI_GPU_")?.parse().ok()?, v.clone()))
            })
            .collect()
    }

    /// The GPUs' device nodes in the container (`nvidia<minor>`).
    fn gpu_nodes(&self) -> BTreeSet<u32> {
        self.dev
            .iter()
            .filter_map(|d| d.strip_prefix("nvidia")?.parse().ok())
            .collect()
    }

    /// Checks that the container was handed exactly `gpus` (UUIDs) every
    /// way: `NVIDIA_VISIBLE_DEVICES`, the CDI edits, the device nodes.
    fn assert_handed(&self, gpus: &BTreeSet<String>) {
        assert_eq!(&self.visible(), gpus, "NVIDIA_VISIBLE_DEVICES: {self:?}");
        let cdi = self.cdi();
        assert_eq!(
            cdi.values().cloned().collect::<BTreeSet<_>>(),
            *gpus,
            "the CDI edits: {self:?}"
        );
        for (minor, uuid) in &cdi {
            assert_eq!(*uuid, fixtures::uuid(*minor));
        }
        assert_eq!(
            self.gpu_nodes(),
            cdi.keys().copied().collect(),
            "the device nodes: {self:?}"
        );
    }
}

/// A one-GPU pod placed by the real scheduler runs, and its container sees
/// exactly the GPU planned for it (the pod's claim) by
/// `NVIDIA_VISIBLE_DEVICES`, by the CDI spec's edits and by its device
/// node; the node's lock is free once the kubelet's `Allocate` is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_gpu_pod_runs_with_exactly_its_planned_gpu_on_a_real_node() {
    let Some(rig) =
        Rig::start("a_one_gpu_pod_runs_with_exactly_its_planned_gpu_on_a_real_node").await
    else {
        return;
    };
    rig.create_pod("one", 1).await;
    let seen = rig.output_of("one").await;
    let uid = rig.uid_of("one").await;
    let planned: BTreeSet<String> = rig
        .claims()
        .await
        .into_iter()
        .filter(|(_, owner)| *owner == uid)
        .map(|(device, _)| device)
        .collect();
    assert_eq!(planned.len(), 1, "one GPU claimed: {planned:?}");
    seen.assert_handed(&planned);
    assert_eq!(seen.env["TETHER_POD_NAME"], "one");
    assert_eq!(rig.holder().await, None, "the lock is free after Allocate");
    rig.shutdown().await;
}

/// Two two-GPU pods created at once: the real scheduler binds them one
/// after the other through the node's lock, and the real kubelet hands
/// them disjoint GPUs, each exactly its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_two_gpu_pods_at_once_get_disjoint_gpus_on_a_real_node() {
    let Some(rig) = Rig::start("two_two_gpu_pods_at_once_get_disjoint_gpus_on_a_real_node").await
    else {
        return;
    };
    rig.create_pod("pair-a", 2).await;
    rig.create_pod("pair-b", 2).await;
    let (a, b) = (rig.output_of("pair-a").await, rig.output_of("pair-b").await);
    let claims = rig.claims().await;
    let claimed = |uid: &str| -> BTreeSet<String> {
        claims
            .iter()
            .filter(|(_, owner)| owner.as_str() == uid)
            .map(|(device, _)| device.clone())
            .collect()
    };
    let (uid_a, uid_b) = (rig.uid_of("pair-a").await, rig.uid_of("pair-b").await);
    let (gpus_a, gpus_b) = (claimed(&uid_a), claimed(&uid_b));
    assert_eq!(gpus_a.len(), 2, "{claims:?}");
    assert_eq!(gpus_b.len(), 2, "{claims:?}");
    assert!(gpus_a.is_disjoint(&gpus_b), "{gpus_a:?} {gpus_b:?}");
    a.assert_handed(&gpus_a);
    b.assert_handed(&gpus_b);
    assert_eq!(rig.holder().await, None, "the lock is free after Allocate");
    rig.shutdown().await;
}
