//! Issue 62 case 4 on the real kube-scheduler and API server: a pod that
//! asks for two device kinds is asked about again exactly when every kind
//! it was short of fits one node. kube-scheduler looks at a pod the
//! extender refused again only on a cluster event or after 5 minutes, and
//! Tether ending a claim is no cluster event: the extender must nudge the
//! pod (`tether_embed::requeue`), and only when it would fit.
//!
//! Two nodes, each with one GPU (`tether.io/gpu`) and one device of a
//! second kind (`example.com/npu`), published to Tether as each kind's
//! plugin publishes them; one extender planning both kinds (its
//! `--also-kind`), both kinds among the scheduler's `managedResources` (as
//! `deploy/optional/gpu/scheduler.yaml` says to list them). No kubelet
//! and no bridge: a pod's phase becomes Succeeded (as the kubelet reports
//! it), the scheduler frees its devices from that event, and the test
//! reports the pod gone to Tether itself, when it chooses, as the bridge
//! would.
//!
//! 1. A pod short of the GPU on one node and of the second kind on the
//!    other is bound once the second kind frees on the second node. Before,
//!    the extender remembered the refusal for the first kind only, and the
//!    freed device of the second kind never nudged it: it waited for the
//!    scheduler's 5-minute flush (past this test's deadline).
//! 2. A pod short of both kinds on one node is not asked about when only
//!    the GPU frees there, and is asked about, once, when the second kind
//!    frees too; then it is bound. Before, each GPU freed nudged it for
//!    nothing.

mod gpu_scheduling;
mod roles;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_scheduling::{SYSTEM, apply_rbac, register_ready_node, scheduler_config};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use roles::{Identities, client_as, cluster_on_tls};
use serde_json::json;
use tether_client::Client;
use tether_client::proto::PodPhase;
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::extender::{Extender, ExtenderConfig, KubeBinder, serve_extender};
use tether_embed::inventory::{DeviceSource, Inventory, publish};
use tether_embed::kind::DeviceKind;
use tether_kube_testenv::{ControlPlane, Process};
use tether_server::testing::{Cluster, DEADLINE};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const GPU: &str = "tether.io/gpu";
const NPU: &str = "example.com/npu";
const NODES: [&str; 2] = ["kinds-node-1", "kinds-node-2"];

/// How long a pod that must not be asked about again is watched: ten of
/// the extender's requeue passes (every 200 ms), each of which would have
/// nudged it.
const QUIET: Duration = Duration::from_secs(2);

fn npu_kind() -> DeviceKind {
    DeviceKind::named(NPU, "npu")
}

struct Rig {
    cluster: Cluster,
    /// Tether as the bridge and an operator would act.
    client: Client,
    pods: Api<Pod>,
    extender: Arc<Extender<KubeBinder>>,
    serving: JoinHandle<()>,
    _scheduler: Process,
    plane: ControlPlane,
    _dir: tempfile::TempDir,
}

impl Rig {
    /// Stops the extender and the replicas, as the other rigs do. Left to
    /// the runtime's drop, the replicas' RocksDB can still be open when the
    /// test process exits: a fresh-clone CI run of this binary aborted
    /// after its test passed ("terminate called without an active
    /// exception", C++'s abort; RocksDB is the C++ in this process).
    async fn shutdown(self) {
        self.serving.abort();
        self.cluster.shutdown().await;
    }

    async fn start(test: &str) -> Option<Rig> {
        let plane = ControlPlane::start_or_skip(test).await?;
        apply_rbac(&plane).await;
        let extender_kube = plane
            .client_as_service_account(SYSTEM, "tether-extender")
            .await;
        let scheduler_kubeconfig = plane
            .service_account_kubeconfig(SYSTEM, "tether-scheduler")
            .await;
        let identities = Identities::new();
        let cluster = cluster_on_tls(&identities).await;
        let client = client_as(&cluster, &identities, "admin");

        let tether = client_as(&cluster, &identities, "scheduler");
        let extender = Arc::new(Extender::new(
            tether.clone(),
            DeviceLedger::new(tether, DEFAULT_LIFETIME),
            KubeBinder::new(extender_kube),
            ExtenderConfig {
                scope: "gpu-bind".into(),
                resource: GPU.into(),
                wait: Duration::from_secs(3),
                bind_deadline: DEADLINE,
                device_prefix: "gpu".into(),
                inventory_ttl: Duration::from_secs(30),
                also_kinds: vec![npu_kind()],
            },
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let extender_addr: SocketAddr = listener.local_addr().unwrap();
        let serving = tokio::spawn(serve_extender(
            listener,
            extender.clone(),
            std::future::pending(),
        ));

        // The deployed scheduler configuration, with the second kind among
        // the extender's managed resources.
        let mut config = scheduler_config(extender_addr, &scheduler_kubeconfig);
        config["extenders"][0]["managedResources"]
            .as_array_mut()
            .expect("managed resources")
            .push(json!({"name": NPU, "ignoredByScheduler": false}));
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("scheduler.json");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let scheduler = plane.scheduler(&config_path).unwrap();

        let namespace = plane.namespace("kinds").await;
        let admin = plane.client().await;
        let rig = Rig {
            cluster,
            client,
            pods: Api::namespaced(admin, &namespace),
            extender,
            serving,
            _scheduler: scheduler,
            plane,
            _dir: dir,
        };
        for node in NODES {
            rig.register_node(node).await;
        }
        Some(rig)
    }

    /// Node `name` with one device of each kind, Ready, untainted, and
    /// each kind's devices published to Tether as its plugin would.
    async fn register_node(&self, name: &str) {
        let nodes: Api<Node> = Api::all(self.plane.client().await);
        let labels = json!({"kubernetes.io/hostname": name});
        let one = || "1".to_string();
        register_ready_node(&nodes, name, labels, &[(GPU, one()), (NPU, one())]).await;
        for kind in self.extender_kinds() {
            let source = DeviceSource::parse(
                "fake:1",
                "/".into(),
                Duration::from_secs(5),
                &kind.device_prefix,
            )
            .unwrap();
            let inventory = Inventory::read(&source).unwrap();
            publish(
                &self.client,
                &kind.inventory_set,
                name,
                &format!("plugin-{name}"),
                &inventory,
            )
            .await
            .unwrap();
        }
    }

    fn extender_kinds(&self) -> [DeviceKind; 2] {
        [DeviceKind::first(GPU, "gpu-bind", "gpu"), npu_kind()]
    }

    /// A pod of the `tether-gpu` scheduler asking for `gpus` and `npus`,
    /// on node `on` if given.
    async fn create_pod(&self, name: &str, gpus: u32, npus: u32, on: Option<&str>) -> String {
        let mut limits = serde_json::Map::new();
        if gpus > 0 {
            limits.insert(GPU.into(), gpus.to_string().into());
        }
        if npus > 0 {
            limits.insert(NPU.into(), npus.to_string().into());
        }
        let mut spec = json!({"schedulerName": "tether-gpu", "containers": [{
            "name": "main", "image": "busybox", "resources": {"limits": limits},
        }]});
        if let Some(node) = on {
            spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
        }
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap();
        let created = self
            .pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        created.metadata.uid.unwrap()
    }

    async fn node_of(&self, name: &str) -> Option<String> {
        self.pods
            .get(name)
            .await
            .unwrap()
            .spec
            .and_then(|s| s.node_name)
    }

    async fn wait_for(&self, what: &str, mut check: impl AsyncFnMut() -> bool) -> Duration {
        let started = Instant::now();
        while !check().await {
            assert!(
                started.elapsed() < DEADLINE,
                "timed out after {DEADLINE:?} waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        started.elapsed()
    }

    async fn bound_to(&self, name: &str, node: &str) {
        self.wait_for(&format!("{name} bound to {node}"), async || {
            self.node_of(name).await.as_deref() == Some(node)
        })
        .await;
    }

    /// Waits until the scheduler has parked pod `name` for the extender's
    /// refusal on every node.
    async fn refused(&self, name: &str) {
        let started = Instant::now();
        loop {
            let pod = self.pods.get(name).await.unwrap();
            let message = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| {
                    c.iter()
                        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                })
                .and_then(|c| c.message.clone());
            if message
                .as_deref()
                .is_some_and(|m| m.contains("claimed by live pods"))
            {
                return;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "{name} not refused by the extender within {DEADLINE:?}: node {:?}, {message:?}",
                pod.spec.and_then(|s| s.node_name)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Pod `name`'s container exits and the kubelet reports it Succeeded;
    /// it stays bound. The scheduler frees its devices from that event;
    /// Tether does not hear of it (nor does the extender's copy: it frees
    /// a pod's claims early only on the pod's delete).
    async fn succeed(&self, name: &str) {
        let state = json!({"terminated": {"exitCode": 0, "startedAt": "2026-12-06T00:00:00Z",
                                          "finishedAt": "2026-12-06T00:00:00Z"}});
        self.pods
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"status": {"phase": "Succeeded", "containerStatuses": [{
                        "name": "main", "image": "busybox", "imageID": "", "ready": false,
                        "restartCount": 0, "started": false, "state": state,
                    }]}}),
                ),
            )
            .await
            .unwrap();
    }

    /// What the bridge reports of a pod gone: Tether ends its claims.
    async fn report_gone(&self, uid: &str) {
        self.client
            .report_pod(uid, PodPhase::PodGone)
            .await
            .unwrap();
    }

    /// Until the extender's copy of kind `kind`'s claims shows none of pod
    /// `uid`'s.
    async fn claims_ended_in_the_copy(&self, uid: &str) {
        let views = self.extender.device_views();
        self.wait_for(
            &format!("pod {uid}'s claims gone from the copy"),
            async || {
                views.iter().all(|view| {
                    view.read(|pins| {
                        NODES
                            .iter()
                            .all(|node| !pins.live_claims(node).values().any(|by| by == uid))
                    })
                    .unwrap_or(false)
                })
            },
        )
        .await;
    }

    fn nudges(&self) -> u64 {
        let sample = "tether_extender_requeue_nudges_total ";
        self.extender
            .metrics()
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(sample))
            .map_or(0, |v| v.parse().unwrap())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_short_of_each_kind_on_another_node_or_both_on_one_is_asked_about_when_both_fit() {
    let Some(rig) = Rig::start(
        "a_pod_short_of_each_kind_on_another_node_or_both_on_one_is_asked_about_when_both_fit",
    )
    .await
    else {
        return;
    };
    let [n1, n2] = NODES;

    // 1. Node 1's GPU and node 2's second-kind device claimed by pods the
    // scheduler no longer counts (they succeeded; Tether not told yet).
    let x = rig.create_pod("x", 1, 0, Some(n1)).await;
    rig.bound_to("x", n1).await;
    let y = rig.create_pod("y", 0, 1, Some(n2)).await;
    rig.bound_to("y", n2).await;
    rig.succeed("x").await;
    rig.succeed("y").await;
    rig.create_pod("p", 1, 1, None).await;
    rig.refused("p").await;
    // Node 2's second kind frees: node 2 now fits both.
    let freed_at = Instant::now();
    rig.report_gone(&y).await;
    rig.bound_to("p", n2).await;
    println!(
        "case 1: p bound to {n2} {:?} after its second-kind device freed there",
        freed_at.elapsed()
    );

    // 2. Node 1 short of both kinds: x's GPU claim still stands; z takes
    // node 1's second-kind device and succeeds (Tether not told).
    let z = rig.create_pod("z", 0, 1, Some(n1)).await;
    rig.bound_to("z", n1).await;
    rig.succeed("z").await;
    rig.create_pod("q", 1, 1, None).await;
    rig.refused("q").await;
    let before = rig.nudges();
    // Only the GPU frees: q still does not fit, and is not asked about.
    rig.report_gone(&x).await;
    rig.claims_ended_in_the_copy(&x).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        rig.nudges(),
        before,
        "q was asked about again though node 1 still lacks the second kind"
    );
    assert_eq!(rig.node_of("q").await, None);
    // The second kind frees too: asked about once, and bound.
    let freed_at = Instant::now();
    rig.report_gone(&z).await;
    rig.bound_to("q", n1).await;
    assert_eq!(rig.nudges(), before + 1, "q asked about again once");
    println!(
        "case 2: q bound to {n1} {:?} after both kinds had freed there",
        freed_at.elapsed()
    );
    rig.shutdown().await;
}
