//! The GPU path on a real node: kube-scheduler v1.36 with the extender as
//! `deploy/optional/gpu` configures it (`gpu_scheduling/`), a real kubelet
//! and containerd (`tether_kube_testenv::RealNode`) driving the device
//! plugin over the real v1beta1 API, containerd applying the CDI devices
//! the plugin names, the real bridge, and a 3-replica Tether on mutual TLS
//! (three `tetherd` processes, the workspace's build).
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
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_scheduling::{
    RESOURCE, RunningExtender, apply_rbac, scheduler_config, spawn_bridge, start_extender,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use roles::{Endpoints, Identities, ReplicaProcesses, client_as};
use serde_json::json;
use tether_client::Client;
use tether_client::proto::LockKey;
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, run};
use tether_embed::inventory::DeviceSource;
use tether_kube_testenv::node::BUSYBOX_IMAGE;
use tether_kube_testenv::{ControlPlane, NodeOptions, Process, RealNode, node_assets_or_skip};
use tether_server::testing::DEADLINE;
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
    cluster: ReplicaProcesses,
    /// Tether as an operator would act.
    client: Client,
    pods: Api<Pod>,
    namespace: String,
    node: RealNode,
    _extender: RunningExtender,
    scheduler: Process,
    tasks: Vec<JoinHandle<()>>,
    /// The fixture host root the plugin reads (a test may change it).
    host: tempfile::TempDir,
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

/// What the node's plugin serves.
#[derive(Clone, Copy)]
enum Devices {
    /// The NVIDIA fixture host's eight GPUs.
    Nvidia,
    /// `--devices fake:4`: `gpu0` to `gpu3`, device nodes `/dev/gpu<n>`.
    Fake,
}

const FAKE_DEVICES: usize = 4;

impl Rig {
    async fn start(test: &str) -> Option<Rig> {
        Rig::start_with(test, Devices::Nvidia).await
    }

    async fn start_with(test: &str, devices: Devices) -> Option<Rig> {
        node_assets_or_skip(test)?;
        let plane = ControlPlane::start_or_skip(test).await?;
        apply_rbac(&plane).await;
        let identities = Identities::new();
        let cluster = ReplicaProcesses::start(&sibling("tetherd"), &identities, true).await;
        let client = client_as(&cluster, &identities, "admin");

        // The node: the fixture's device nodes exist in its /dev.
        let host = fixtures::nvidia_node("eight-gpus");
        let fake_ids: Vec<String> = (0..FAKE_DEVICES).map(|n| format!("gpu{n}")).collect();
        let device_nodes = match devices {
            Devices::Nvidia => std::fs::read_dir(host.path().join("dev"))
                .unwrap()
                .map(|entry| (entry.unwrap().file_name().into_string().unwrap(), 1, 3))
                .collect(),
            Devices::Fake => fake_ids.iter().map(|id| (id.clone(), 1, 3)).collect(),
        };
        let node = RealNode::start(&plane, NODE, NodeOptions { device_nodes })
            .await
            .expect("the node starts");
        std::fs::write(node.cdi_dir().join("nvidia.json"), cdi_spec().to_string()).unwrap();
        remove_registration_taint(&plane).await;

        let plugin = Arc::new(
            GpuPlugin::new(
                client_as(&cluster, &identities, &format!("device-plugin:{NODE}")),
                PluginConfig {
                    node: NODE.into(),
                    scope: "gpu-bind".into(),
                    resource_name: RESOURCE.into(),
                    claim_set: tether_embed::accounting::DEVICE_SET.into(),
                    inventory_set: tether_embed::inventory::INVENTORY_SET.into(),
                    devices: match devices {
                        Devices::Nvidia => DeviceSource::Nvidia {
                            host_root: host.path().to_path_buf(),
                            rescan: Duration::from_secs(1),
                        },
                        Devices::Fake => DeviceSource::Fake(fake_ids.clone()),
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
            // Ends with an error only once the node is gone (its namespace
            // with it) at the end of a test.
            if let Err(err) = run(plugin, placement, std::future::pending()).await {
                println!("the device plugin stopped: {err:#}");
            }
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
            host,
            plane,
        };
        rig.wait_for("the bridge's first lists", async || bridge.healthy())
            .await;
        let count = match devices {
            Devices::Nvidia => 8,
            Devices::Fake => FAKE_DEVICES as u64,
        };
        rig.wait_for("the kubelet to count the plugin's devices", async || {
            rig.allocatable().await == count
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
        self.create(name, vec![], vec![container("main", gpus, PRINT_AND_RUN)])
            .await
    }

    /// Creates [`pod_json`]'s pod.
    async fn create(
        &self,
        name: &str,
        init: Vec<serde_json::Value>,
        app: Vec<serde_json::Value>,
    ) -> Pod {
        self.create_from(pod_json(name, init, app)).await
    }

    /// Creates `pod`, a Pod's JSON.
    async fn create_from(&self, pod: serde_json::Value) -> Pod {
        let pod: Pod = serde_json::from_value(pod).unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    /// Waits until the scheduler has found no node for pod `name`.
    async fn until_unschedulable(&self, name: &str) {
        self.wait_for(&format!("pod {name} to be refused"), async || {
            self.pods
                .get(name)
                .await
                .unwrap()
                .status
                .and_then(|s| s.conditions)
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "PodScheduled" && c.status == "False")
                })
        })
        .await;
    }

    async fn phase(&self, name: &str) -> String {
        self.pods
            .get(name)
            .await
            .unwrap()
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default()
    }

    /// The devices claimed for pod `name`.
    async fn claim_of(&self, name: &str) -> BTreeSet<String> {
        let uid = self.uid_of(name).await;
        self.claim_of_uid(&uid).await
    }

    /// The devices claimed for the pod with UID `uid`.
    async fn claim_of_uid(&self, uid: &str) -> BTreeSet<String> {
        self.claims()
            .await
            .into_iter()
            .filter(|(_, owner)| owner == uid)
            .map(|(device, _)| device)
            .collect()
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
        self.printed(name, "main")
    }

    /// What container `container` of pod `name` printed.
    fn printed(&self, name: &str, container: &str) -> ContainerView {
        ContainerView::parse(&self.node.container_log(&self.namespace, name, container))
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
        drop(self.cluster);
    }
}

/// A binary of the workspace's build, beside this crate's
/// `tether-device-plugin` (a workspace test build builds every package's
/// binaries).
fn sibling(binary: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_BIN_EXE_tether-device-plugin"))
        .parent()
        .unwrap()
        .join(binary)
}

/// A pod for the `tether-gpu` scheduler with these init and app
/// containers, on the host network, never restarted, stopped within 2 s of
/// its delete.
fn pod_json(
    name: &str,
    init: Vec<serde_json::Value>,
    app: Vec<serde_json::Value>,
) -> serde_json::Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "tether-gpu",
            "hostNetwork": true,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "initContainers": init,
            "containers": app,
        },
    })
}

/// What a container prints before it runs on: its environment and `/dev`.
const PRINT_AND_RUN: &str = "env; echo DEV $(ls /dev); exec sleep 3600";
/// The same, then it exits.
const PRINT_AND_EXIT: &str = "env; echo DEV $(ls /dev)";

/// A busybox container asking for `gpus`, running `script`.
fn container(name: &str, gpus: u32, script: &str) -> serde_json::Value {
    json!({
        "name": name,
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
        "resources": {"limits": {RESOURCE: gpus.to_string()}},
    })
}

/// The devices a container was handed, by `TETHER_DEVICES`.
fn handed(view: &ContainerView) -> BTreeSet<String> {
    view.env
        .get("TETHER_DEVICES")
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

/// Prints the taints the kubelet registered the node with, then removes
/// them as the node lifecycle controller would.
async fn remove_registration_taint(plane: &ControlPlane) {
    let nodes: Api<Node> = Api::all(plane.client().await);
    let registered = nodes.get(NODE).await.unwrap();
    println!(
        "the kubelet registered {NODE} with taints {:?}",
        registered.spec.and_then(|s| s.taints)
    );
    gpu_scheduling::remove_not_ready_taint(&nodes, NODE).await;
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

/// Fake devices (`--devices fake:4`) the same way: the pod runs, and its
/// container gets its planned devices (`TETHER_DEVICES`) and their device
/// nodes, which exist on the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fake_devices_are_handed_with_their_device_nodes_on_a_real_node() {
    let Some(rig) = Rig::start_with(
        "fake_devices_are_handed_with_their_device_nodes_on_a_real_node",
        Devices::Fake,
    )
    .await
    else {
        return;
    };
    rig.create_pod("fake", 2).await;
    let seen = rig.output_of("fake").await;
    let planned = rig.claim_of("fake").await;
    assert_eq!(planned.len(), 2);
    assert_eq!(handed(&seen), planned);
    let nodes: BTreeSet<String> = seen
        .dev
        .iter()
        .filter(|d| d.starts_with("gpu"))
        .cloned()
        .collect();
    assert_eq!(nodes, planned, "the device nodes: {seen:?}");
    assert_eq!(rig.holder().await, None, "the lock is free after Allocate");
    rig.shutdown().await;
}

/// A pod with a GPU in its init container and two in its app container, as
/// the real kubelet admits it: one `Allocate` for each, the app container
/// given the init container's GPU again (the kubelet's reusable set) and
/// one more, and the pod's claim exactly the app container's GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn init_and_app_containers_get_their_gpus_from_the_real_kubelet() {
    let Some(rig) =
        Rig::start("init_and_app_containers_get_their_gpus_from_the_real_kubelet").await
    else {
        return;
    };
    rig.create(
        "staged",
        vec![container("check", 1, PRINT_AND_EXIT)],
        vec![container("main", 2, PRINT_AND_RUN)],
    )
    .await;
    let app = rig.output_of("staged").await;
    let init = rig.printed("staged", "check");
    let (init_gpus, app_gpus) = (handed(&init), handed(&app));
    println!("init container: {init_gpus:?}, app container: {app_gpus:?}");
    assert_eq!(init_gpus.len(), 1, "{init:?}");
    assert_eq!(app_gpus.len(), 2, "{app:?}");
    assert!(
        init_gpus.is_subset(&app_gpus),
        "the init container's GPU is reused"
    );
    init.assert_handed(&init_gpus);
    app.assert_handed(&app_gpus);
    assert_eq!(init.env["TETHER_CONTAINER"], "check");
    assert_eq!(app.env["TETHER_CONTAINER"], "main");
    assert_eq!(rig.claim_of("staged").await, app_gpus);
    assert_eq!(rig.holder().await, None, "the lock is free after Allocate");
    rig.shutdown().await;
}

/// A running pod that holds all eight GPUs is deleted while another waits
/// for eight: while the kubelet stops it (the object terminating, its
/// container still running through the grace period) its claim stands;
/// once the kubelet has stopped it (a terminal phase, then the object
/// gone), the bridge ends the claim and the waiting pod is bound and runs
/// with all eight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_gpu_pods_devices_go_to_a_waiting_pod_only_once_the_kubelet_stopped_it() {
    let Some(rig) = Rig::start(
        "a_deleted_gpu_pods_devices_go_to_a_waiting_pod_only_once_the_kubelet_stopped_it",
    )
    .await
    else {
        return;
    };
    deleted_while_another_waits(&rig, vec![], vec![container("main", 8, STUBBORN)]).await;
    rig.shutdown().await;
}

/// The same with the GPUs in a sidecar (a restartable init container) that
/// outlives the app container it serves: the app container stops at once,
/// the sidecar only when killed, and the claim stands until the sidecar
/// has stopped too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_pods_gpus_stay_claimed_while_its_sidecar_still_runs() {
    let Some(rig) =
        Rig::start("a_deleted_pods_gpus_stay_claimed_while_its_sidecar_still_runs").await
    else {
        return;
    };
    let mut sidecar = container("side", 8, STUBBORN);
    sidecar["restartPolicy"] = json!("Always");
    let app = json!({
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", "trap 'exit 0' TERM; echo DEV $(ls /dev); while true; do sleep 1; done"],
    });
    deleted_while_another_waits(&rig, vec![sidecar], vec![app]).await;
    rig.shutdown().await;
}

/// Stops only when killed: the kubelet waits out the grace period (2 s).
const STUBBORN: &str = "trap '' TERM; env; echo DEV $(ls /dev); while true; do sleep 1; done";

/// Pod `first` (these containers, all eight GPUs) runs; pod `second`
/// waits for eight; `first` is deleted. Checks that the claim of `first`
/// stands, and `second` does not run, while any container of `first`
/// runs, and that `second` then runs with all eight.
async fn deleted_while_another_waits(
    rig: &Rig,
    init: Vec<serde_json::Value>,
    app: Vec<serde_json::Value>,
) {
    let all: BTreeSet<String> = (0..8).map(fixtures::uuid).collect();
    rig.create("first", init, app).await;
    rig.output_of("first").await;
    assert_eq!(rig.claim_of("first").await, all);
    let first_uid = rig.uid_of("first").await;
    rig.create_pod("second", 8).await;
    rig.until_unschedulable("second").await;
    let deleted_at = Instant::now();
    rig.pods.delete("first", &Default::default()).await.unwrap();
    // The claim is read before the pod: a claim ended by the pod's
    // terminal phase is read after the status that carried that phase.
    let mut running_while_terminating = 0;
    loop {
        let claim = rig.claim_of_uid(&first_uid).await;
        let Some(pod) = rig.pods.get_opt("first").await.unwrap() else {
            break;
        };
        if pod.metadata.deletion_timestamp.is_some() && some_container_runs(&pod) {
            running_while_terminating += 1;
            assert_eq!(
                claim, all,
                "the claim ended while a container of the pod still ran: {:?}",
                pod.status
            );
            assert_ne!(rig.phase("second").await, "Running");
        }
        assert!(
            deleted_at.elapsed() < POD_DEADLINE,
            "the pod was never deleted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "the terminating pod was seen with a container running {running_while_terminating} times"
    );
    assert!(
        running_while_terminating > 0,
        "the grace period was never seen"
    );
    let gone_after = deleted_at.elapsed();
    let seen = rig.output_of("second").await;
    println!(
        "first pod deleted -> object gone in {gone_after:?} -> second running {:?} after the delete",
        deleted_at.elapsed()
    );
    seen.assert_handed(&all);
    assert_eq!(rig.claim_of("second").await, all);
}

/// Issue 62 case 5: a force delete (`kubectl delete --grace-period=0
/// --force`) removes the pod object while the kubelet is still killing its
/// containers. The kubelet's device manager counts the pod's devices free
/// at once (v1.36.3 `pkg/kubelet/kubelet.go`, `HandlePodRemoves`: the pod
/// leaves the pod manager before its containers are killed, so
/// `GetActivePods` no longer lists it and `devicemanager`'s
/// `UpdateAllocatedDevices`, run before the next `Allocate`, drops its
/// devices). Tether does the same: the bridge sees the object gone and the
/// claim ends, and a pod waiting for all eight GPUs is scheduled and gets
/// them from the kubelet. Holding the claim longer would only make the
/// extender refuse devices the kubelet hands out anyway. The test prints
/// how long the deleted pod's container went on running after its claim
/// ended, and whether it still ran when the next pod started.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_force_deleted_pods_gpus_are_free_at_once_as_the_kubelet_counts_them() {
    let Some(rig) =
        Rig::start("a_force_deleted_pods_gpus_are_free_at_once_as_the_kubelet_counts_them").await
    else {
        return;
    };
    let all: BTreeSet<String> = (0..8).map(fixtures::uuid).collect();
    // A beat a second, TERM ignored: the kubelet kills it after the
    // minimum grace period (2 s) once it acts on the removal.
    let beating = "trap '' TERM; env; echo DEV $(ls /dev); while true; do echo BEAT; sleep 1; done";
    rig.create("first", vec![], vec![container("main", 8, beating)])
        .await;
    rig.output_of("first").await;
    assert_eq!(rig.claim_of("first").await, all);
    let first_uid = rig.uid_of("first").await;
    rig.create_pod("second", 8).await;
    rig.until_unschedulable("second").await;
    let force = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let deleted_at = std::time::SystemTime::now();
    rig.pods.delete("first", &force).await.unwrap();
    // The first pod's beats, read while the kubelet still has its log.
    let mut beats: Vec<std::time::SystemTime> = Vec::new();
    let mut read_beats = |rig: &Rig| {
        for (time, text) in rig
            .node
            .container_log_lines(&rig.namespace, "first", "main")
        {
            if text == "BEAT"
                && let Ok(at) = humantime::parse_rfc3339_weak(&time)
                && !beats.contains(&at)
            {
                beats.push(at);
            }
        }
    };
    let claim_ended_at = loop {
        read_beats(&rig);
        if rig.claim_of_uid(&first_uid).await.is_empty() {
            break std::time::SystemTime::now();
        }
        assert!(
            deleted_at.elapsed().unwrap() < POD_DEADLINE,
            "the force-deleted pod's claim never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(rig.pods.get_opt("first").await.unwrap().is_none());
    // The kubelet gives all eight to the waiting pod.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        read_beats(&rig);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = rig.output_of("second").await;
    seen.assert_handed(&all);
    assert_eq!(rig.claim_of("second").await, all);
    let second_started = rig
        .node
        .container_log_lines(&rig.namespace, "second", "main")
        .first()
        .and_then(|(time, _)| humantime::parse_rfc3339_weak(time).ok())
        .expect("the second pod logged");
    let last_beat = beats.iter().max().copied();
    let after = |later: std::time::SystemTime, earlier: std::time::SystemTime| {
        later
            .duration_since(earlier)
            .map_or_else(|e| -(e.duration().as_secs_f64()), |d| d.as_secs_f64())
    };
    println!(
        "force delete -> claim ended {:.3} s later; the first pod's last beat {} s after the \
         claim ended; the second pod's first line {:.3} s after the force delete, {} s after \
         the first pod's last beat",
        after(claim_ended_at, deleted_at),
        last_beat.map_or("(none seen)".into(), |b| format!(
            "{:.3}",
            after(b, claim_ended_at)
        )),
        after(second_started, deleted_at),
        last_beat.map_or("(none seen)".into(), |b| format!(
            "{:.3}",
            after(second_started, b)
        )),
    );
    rig.shutdown().await;
}

/// Whether the kubelet reports some container of `pod` (init containers
/// and sidecars included) running.
fn some_container_runs(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|s| {
        s.init_container_statuses
            .iter()
            .flatten()
            .chain(s.container_statuses.iter().flatten())
            .any(|c| {
                c.state
                    .as_ref()
                    .is_some_and(|state| state.running.is_some())
            })
    })
}

/// The kubelet restarted under a running GPU pod: the plugin serves and
/// registers again, a new GPU pod runs, and it gets another GPU than the
/// running pod's (the kubelet's checkpoint kept that one taken; so did
/// Tether's claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_kubelet_restart_a_new_gpu_pod_runs_beside_the_running_one() {
    let Some(mut rig) =
        Rig::start("after_a_kubelet_restart_a_new_gpu_pod_runs_beside_the_running_one").await
    else {
        return;
    };
    rig.create_pod("before", 1).await;
    let before = handed(&rig.output_of("before").await);
    rig.node
        .restart_kubelet()
        .await
        .expect("the kubelet restarts");
    rig.wait_for("the plugin registered again, eight GPUs", async || {
        rig.allocatable().await == 8
    })
    .await;
    rig.create_pod("after", 1).await;
    let after = rig.output_of("after").await;
    after.assert_handed(&handed(&after));
    assert!(
        before.is_disjoint(&handed(&after)),
        "{before:?} {:?}",
        handed(&after)
    );
    assert_eq!(rig.phase("before").await, "Running");
    rig.shutdown().await;
}

/// A GPU pod whose container exits: its terminal phase (reported by the
/// bridge) ends its claim, and the node's lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_pod_that_exits_gives_its_gpus_back_on_a_real_node() {
    let Some(rig) = Rig::start("a_gpu_pod_that_exits_gives_its_gpus_back_on_a_real_node").await
    else {
        return;
    };
    rig.create("brief", vec![], vec![container("main", 2, PRINT_AND_EXIT)])
        .await;
    rig.wait_for("the pod to succeed", async || {
        rig.phase("brief").await == "Succeeded"
    })
    .await;
    let ended_at = Instant::now();
    rig.wait_for("its claim to end", async || {
        rig.claim_of("brief").await.is_empty()
    })
    .await;
    println!("pod succeeded -> claim ended in {:?}", ended_at.elapsed());
    assert_eq!(handed(&rig.printed("brief", "main")).len(), 2);
    assert_eq!(rig.holder().await, None);
    rig.shutdown().await;
}

/// Eight one-GPU pods and a pod without GPUs created at once: the real
/// scheduler binds the eight one at a time through the node's lock, and
/// each runs with a GPU of its own, exactly its claim, which names its pod
/// (so the bridge can confirm it gone by GET); the pod without GPUs takes
/// no claim and is handed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_one_gpu_pods_and_one_without_gpus_at_once_each_run_with_their_own_on_a_real_node() {
    let Some(rig) = Rig::start(
        "eight_one_gpu_pods_and_one_without_gpus_at_once_each_run_with_their_own_on_a_real_node",
    )
    .await
    else {
        return;
    };
    let names: Vec<String> = (0..8).map(|n| format!("one-{n}")).collect();
    let without_gpus = json!({
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", PRINT_AND_RUN],
    });
    let created = names
        .iter()
        .map(|name| rig.create_pod(name, 1))
        .collect::<Vec<_>>();
    futures::future::join_all(created).await;
    rig.create("web", vec![], vec![without_gpus]).await;
    let mut given = BTreeSet::new();
    for name in &names {
        let seen = rig.output_of(name).await;
        let claim = rig.claim_of(name).await;
        assert_eq!(claim.len(), 1, "{name}: {claim:?}");
        seen.assert_handed(&claim);
        assert!(given.is_disjoint(&claim), "{name} shares {claim:?}");
        given.extend(claim);
    }
    assert_eq!(given, (0..8).map(fixtures::uuid).collect());
    let web = rig.output_of("web").await;
    assert!(
        handed(&web).is_empty() && web.visible().is_empty(),
        "{web:?}"
    );
    assert!(rig.claim_of("web").await.is_empty());
    let pins = rig
        .client
        .list_pins(tether_embed::accounting::DEVICE_SET, NODE)
        .await
        .unwrap();
    assert_eq!(pins.len(), 8, "{pins:?}");
    for pin in &pins {
        assert_eq!(
            pin.labels[tether_client::proto::POD_NAMESPACE_LABEL],
            rig.namespace
        );
        assert!(
            names.contains(&pin.labels[tether_client::proto::POD_NAME_LABEL]),
            "{pin:?}"
        );
    }
    assert_eq!(
        rig.holder().await,
        None,
        "the lock is free after the Allocates"
    );
    rig.shutdown().await;
}

/// A GPU pod placed around the scheduler (`spec.nodeName` set by its
/// creator, so no extender bound it and nothing holds the node's lock):
/// the real kubelet calls `Allocate`, the plugin refuses rather than guess
/// which pod it serves, and the kubelet fails the pod at admission; nothing
/// is claimed, and a pod placed by the scheduler then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_pod_placed_around_the_scheduler_fails_admission_and_claims_nothing() {
    let Some(rig) =
        Rig::start("a_gpu_pod_placed_around_the_scheduler_fails_admission_and_claims_nothing")
            .await
    else {
        return;
    };
    let mut stray = pod_json("stray", vec![], vec![container("main", 1, PRINT_AND_RUN)]);
    stray["spec"]["nodeName"] = json!(NODE);
    rig.create_from(stray).await;
    rig.wait_for("the kubelet to fail the stray pod", async || {
        rig.phase("stray").await == "Failed"
    })
    .await;
    let status = rig.pods.get("stray").await.unwrap().status.unwrap();
    println!(
        "the kubelet failed the stray pod: {:?}: {:?}",
        status.reason, status.message
    );
    assert_eq!(status.reason.as_deref(), Some("UnexpectedAdmissionError"));
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("refusing to guess")),
        "{status:?}"
    );
    assert!(rig.claims().await.is_empty());
    assert_eq!(rig.holder().await, None);
    rig.create_pod("placed", 1).await;
    let seen = rig.output_of("placed").await;
    seen.assert_handed(&rig.claim_of("placed").await);
    rig.shutdown().await;
}

/// The plugin's socket deleted under the real kubelet (a directory cleaned
/// by hand): the plugin serves and registers again, the kubelet keeps
/// counting eight GPUs, and a new GPU pod runs through the new socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_plugin_socket_is_served_again_under_the_real_kubelet() {
    let Some(rig) =
        Rig::start("a_deleted_plugin_socket_is_served_again_under_the_real_kubelet").await
    else {
        return;
    };
    let socket = rig.node.device_plugin_dir().join("tether-gpu.sock");
    let first = std::fs::metadata(&socket).unwrap().ino();
    std::fs::remove_file(&socket).unwrap();
    rig.wait_for("the plugin to serve a new socket", async || {
        std::fs::metadata(&socket).is_ok_and(|m| m.ino() != first)
    })
    .await;
    rig.create_pod("after", 1).await;
    let seen = rig.output_of("after").await;
    seen.assert_handed(&rig.claim_of("after").await);
    assert_eq!(rig.allocatable().await, 8);
    rig.shutdown().await;
}

/// A GPU falls off the bus (the driver drops its entry in the fixture host):
/// the plugin reports it unhealthy, the real kubelet counts seven GPUs, a
/// pod asking for eight is not placed, and a pod asking for seven gets the
/// seven that are left, never the lost one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_that_falls_off_the_bus_is_given_to_no_pod_by_the_real_kubelet() {
    let Some(rig) =
        Rig::start("a_gpu_that_falls_off_the_bus_is_given_to_no_pod_by_the_real_kubelet").await
    else {
        return;
    };
    let lost = 5;
    fixtures::fall_off_the_bus(
        rig.host.path(),
        &format!("0000:{:02x}:00.0", 0x18 + lost * 0x10),
    );
    rig.wait_for("the kubelet to count seven GPUs", async || {
        rig.allocatable().await == 7
    })
    .await;
    rig.create_pod("too-many", 8).await;
    rig.create_pod("seven", 7).await;
    let seen = rig.output_of("seven").await;
    let left: BTreeSet<String> = (0..8).filter(|m| *m != lost).map(fixtures::uuid).collect();
    seen.assert_handed(&left);
    assert_eq!(rig.claim_of("seven").await, left);
    assert_ne!(rig.phase("too-many").await, "Running");
    assert!(
        rig.pods
            .get("too-many")
            .await
            .unwrap()
            .spec
            .and_then(|s| s.node_name)
            .is_none(),
        "a pod asking for eight is not placed"
    );
    rig.shutdown().await;
}

/// The plugin as its DaemonSet runs it: the project's image, built from
/// the binaries beside the test's (`deploy/image.sh`, as `./dev image`
/// builds it from a release build), is imported into the node's
/// containerd; `deploy/optional/gpu/device-plugin.yaml`'s DaemonSet is
/// applied; the DaemonSet controller (kube-controller-manager) makes its
/// pod and the default kube-scheduler places it on the node, labelled as
/// its selector asks (its affinity and tolerations let it). The kubelet
/// runs it (its socket in the hostPath plugin directory, `POD_UID` from the
/// downward API), counts its eight fake devices, and the plugin publishes
/// them in Tether as owned by its pod. Changed for the test, in code: the
/// pod runs on the host network with `TETHER_ENDPOINTS` on loopback (the
/// replicas are `tetherd` processes on loopback, not behind a Service; in
/// clear text, as the manifest's plugin calls), and its metrics port moved
/// to a free one (the host network is shared with the other tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_device_plugin_image_runs_from_its_daemonset_manifest_on_a_real_node() {
    use tether_embed::inventory::{INVENTORY_SET, inventory_key, published_inventory};
    let test = "the_device_plugin_image_runs_from_its_daemonset_manifest_on_a_real_node";
    node_assets_or_skip(test);
    let Some(plane) = ControlPlane::start_or_skip(test).await else {
        return;
    };
    let bin_dir = sibling("tether-device-plugin")
        .parent()
        .unwrap()
        .to_path_buf();
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("tether-image.tar");
    let built = std::process::Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/image.sh"),
    )
    .arg(&bin_dir)
    .arg(&archive)
    .output()
    .unwrap();
    assert!(
        built.status.success(),
        "deploy/image.sh failed (are tetherd, lockctl and tether-bridge built beside {}?): {}",
        bin_dir.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let cluster =
        ReplicaProcesses::start(&bin_dir.join("tetherd"), &Identities::new(), false).await;
    let node = RealNode::start(&plane, NODE, NodeOptions::default())
        .await
        .expect("the node starts");
    node.import_image(&archive).expect("the image imports");
    remove_registration_taint(&plane).await;
    let nodes: Api<Node> = Api::all(plane.client().await);
    nodes
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tether.io/gpu-node": "true"}}})),
        )
        .await
        .unwrap();

    // The DaemonSet controller makes the pod; the default scheduler places
    // it (DaemonSet pods go through a scheduler, with affinity for their
    // node).
    let _daemonsets = plane
        .controller_manager(&["daemonset"])
        .expect("kube-controller-manager starts");
    let default_config = node.dir().join("default-scheduler.json");
    std::fs::write(
        &default_config,
        json!({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": false},
            "clientConnection": {"kubeconfig": plane.kubeconfig().display().to_string()},
        })
        .to_string(),
    )
    .unwrap();
    let _default_scheduler = plane
        .scheduler(&default_config)
        .expect("kube-scheduler starts");

    let mut daemonset = gpu_scheduling::objects_of("device-plugin.yaml", &["DaemonSet"]).remove(0);
    let spec = &mut daemonset["spec"]["template"]["spec"];
    spec["hostNetwork"] = json!(true);
    let metrics_port = tether_kube_testenv::unused_port();
    let container = &mut spec["containers"][0];
    container["ports"][0]["containerPort"] = json!(metrics_port);
    for env in container["env"].as_array_mut().unwrap() {
        match env["name"].as_str().unwrap() {
            "TETHER_ENDPOINTS" => env["value"] = json!(cluster.endpoints().join(",")),
            "TETHER_DEVICE_PLUGIN_HTTP_LISTEN" => {
                env["value"] = json!(format!("0.0.0.0:{metrics_port}"))
            }
            _ => {}
        }
    }
    let namespace = plane.namespace("plugin").await;
    plane
        .apply(&[daemonset], &namespace)
        .await
        .expect("the DaemonSet applies");
    let pods: Api<Pod> = Api::namespaced(plane.client().await, &namespace);
    let by_label = ListParams::default().labels("app.kubernetes.io/name=tether-device-plugin");
    let deadline = Instant::now() + POD_DEADLINE;
    let plugin_pod = loop {
        let listed = pods.list(&by_label).await.unwrap().items;
        if let Some(pod) = listed
            .into_iter()
            .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE))
        {
            break pod;
        }
        assert!(
            Instant::now() < deadline,
            "the DaemonSet's pod was never placed on {NODE}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (name, uid) = (
        plugin_pod.metadata.name.unwrap(),
        plugin_pod.metadata.uid.unwrap(),
    );
    println!("the DaemonSet controller made pod {name}, placed on {NODE}");

    let client = Client::new(cluster.endpoints(), Default::default()).unwrap();
    let deadline = Instant::now() + POD_DEADLINE;
    loop {
        let allocatable = nodes
            .get(NODE)
            .await
            .ok()
            .and_then(|n| n.status?.allocatable?.get(RESOURCE).cloned())
            .map(|q| q.0)
            .unwrap_or_default();
        let published = published_inventory(&client, INVENTORY_SET, NODE)
            .await
            .ok()
            .flatten()
            .map_or(0, |devices| devices.len());
        if allocatable == "8" && published == 8 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the plugin from the image did not serve (allocatable {allocatable:?}, published \
             {published}):\n{}\n{}",
            node.log_tails(30),
            node.container_log(&namespace, &name, "device-plugin")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pin = client
        .get_pin(&inventory_key(INVENTORY_SET, NODE))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pin.pod_uid, uid, "owned by the plugin's pod (POD_UID)");
    let running = pods.get(&name).await.unwrap();
    assert_eq!(
        running.status.and_then(|s| s.phase).as_deref(),
        Some("Running")
    );
    drop(node);
    drop(cluster);
}
