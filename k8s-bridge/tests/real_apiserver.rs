//! The bridge against a real kube-apiserver (v1.36, `tether-kube-testenv`)
//! and a 3-replica Tether: pod lifecycles as the API server really stores
//! them (binds through `pods/binding`, status through the `status`
//! subresource, graceful deletion that waits for the kubelet, force deletes,
//! the Eviction API, a name reused under a new UID), nodes deleted and
//! re-created while kube-controller-manager's pod GC deletes their pods, an
//! API server outage that ends in a real 410 Gone relist, two bridges, and a
//! bridge restarted after a deletion it did not see.
//!
//! The bridge runs as the `tether-bridge` service account with exactly the
//! ClusterRole of `deploy/base/bridge-rbac.yaml`, on a token the API server
//! issued. There is no kubelet: the test plays it ([`Kubelet`]), setting pod
//! status and finishing graceful deletions as
//! `pkg/kubelet/status/status_manager.go` does (a delete at grace period 0
//! once the containers have stopped).
//!
//! Tests share one control plane per run, each in a namespace of its own
//! with nodes of its own names; a test that stops the API server or runs
//! pod GC (which would delete other tests' pods bound to nodes that do not
//! exist) gets a plane of its own.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tether_client::proto::{self as pb, LockKey};
use tether_client::{Client, Options, WatchUpdate};
use tether_k8s_bridge::bridge::Bridge;
use tether_kube_testenv::{ControlPlane, Plane, watch_error_code, yaml_documents};
use tether_server::config::Config;
use tether_server::testing::{Cluster, DEADLINE};
use tokio::task::JoinHandle;

/// The namespace `deploy/base/bridge-rbac.yaml` binds the bridge's account in.
const BRIDGE_NAMESPACE: &str = "tether-system";

fn key(node: &str) -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: node.into(),
    }
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Applies the bridge's ServiceAccount, ClusterRole and ClusterRoleBinding
/// from the manifests and returns a client acting as that account.
async fn bridge_client(plane: &ControlPlane) -> kube::Client {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/base/bridge-rbac.yaml"
    );
    let objects = yaml_documents(Path::new(path)).unwrap();
    plane.apply(&objects, BRIDGE_NAMESPACE).await.unwrap();
    plane
        .client_as_service_account(BRIDGE_NAMESPACE, "tether-bridge")
        .await
}

/// The kubelet's and the scheduler's writes, made as the admin.
struct Kubelet {
    pods: Api<Pod>,
    nodes: Api<Node>,
}

const STARTED_AT: &str = "2026-12-03T00:00:00Z";

impl Kubelet {
    fn new(client: kube::Client, namespace: &str) -> Kubelet {
        Kubelet {
            pods: Api::namespaced(client.clone(), namespace),
            nodes: Api::all(client),
        }
    }

    /// Creates a pod (Pending, unbound) and returns it with its UID.
    async fn create_pod(&self, name: &str) -> Pod {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]},
        }))
        .unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    /// Creates a pod with an init container (a GPU check before the main
    /// container, as GPU operators' validators run).
    async fn create_pod_with_init(&self, name: &str) -> Pod {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"initContainers": [{"name": "gpu-init", "image": "busybox"}],
                     "containers": [{"name": "main", "image": "busybox"}]},
        }))
        .unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    /// The init container started (phase still Pending, main container
    /// waiting), as the kubelet reports it.
    async fn run_init(&self, name: &str) {
        self.patch_status(
            name,
            json!({"phase": "Pending",
                   "initContainerStatuses": [{
                       "name": "gpu-init", "image": "busybox", "imageID": "", "ready": false,
                       "restartCount": 0, "started": true,
                       "state": {"running": {"startedAt": STARTED_AT}}}],
                   "containerStatuses": [{
                       "name": "main", "image": "busybox", "imageID": "", "ready": false,
                       "restartCount": 0, "started": false,
                       "state": {"waiting": {"reason": "PodInitializing"}}}]}),
        )
        .await;
    }

    /// The scheduler's bind: `POST pods/<name>/binding`.
    async fn bind(&self, name: &str, node: &str) {
        let binding = json!({
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        });
        self.pods
            .create_subresource::<serde_json::Value, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await
            .unwrap();
    }

    async fn patch_status(&self, name: &str, status: serde_json::Value) {
        self.pods
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
            .unwrap();
    }

    /// The container started: phase Running.
    async fn run(&self, name: &str) {
        self.patch_status(
            name,
            json!({"phase": "Running", "containerStatuses": [{
                "name": "main", "image": "busybox", "imageID": "", "ready": true,
                "restartCount": 0, "started": true,
                "state": {"running": {"startedAt": STARTED_AT}},
            }]}),
        )
        .await;
    }

    /// The container ended: phase `phase` (Succeeded or Failed), with
    /// `reason` on the pod (`Evicted` for a node-pressure eviction).
    async fn finish(&self, name: &str, phase: &str, reason: Option<&str>) {
        let exit_code = if phase == "Succeeded" { 0 } else { 1 };
        let mut status = json!({"phase": phase, "containerStatuses": [{
            "name": "main", "image": "busybox", "imageID": "", "ready": false,
            "restartCount": 0, "started": false,
            "state": {"terminated": {"exitCode": exit_code, "startedAt": STARTED_AT,
                                      "finishedAt": STARTED_AT}},
        }]});
        if let Some(reason) = reason {
            status["reason"] = json!(reason);
        }
        self.patch_status(name, status).await;
    }

    /// A user's delete with the pod's own grace period: a bound pod that has
    /// not ended stays, with `deletionTimestamp` set, until the kubelet
    /// confirms.
    async fn delete(&self, name: &str) {
        self.pods
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    /// A delete at grace period 0: a force delete, or the kubelet confirming
    /// a graceful one once the containers have stopped.
    async fn delete_now(&self, name: &str) {
        self.pods
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
    }

    /// The Eviction API (what `kubectl drain` calls).
    async fn evict(&self, name: &str) {
        self.pods
            .evict(name, &EvictParams::default())
            .await
            .unwrap();
    }

    async fn pod_exists(&self, name: &str) -> bool {
        self.pods.get_opt(name).await.unwrap().is_some()
    }

    /// Creates a node and reports it Ready, as a kubelet registering does.
    async fn create_node(&self, name: &str, zone: &str) -> Node {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        }))
        .unwrap();
        let created = self
            .nodes
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
        self.set_node_ready(name, true).await;
        created
    }

    async fn set_node_ready(&self, name: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        self.nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [{
                    "type": "Ready", "status": status, "reason": "KubeletReady",
                    "lastHeartbeatTime": STARTED_AT, "lastTransitionTime": STARTED_AT,
                }]}})),
            )
            .await
            .unwrap();
    }

    async fn delete_node(&self, name: &str) {
        self.nodes
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
}

/// Tether's name for a Kubernetes pod.
fn tether_pod(pod: &Pod) -> pb::Pod {
    pb::Pod {
        uid: pod.metadata.uid.clone().unwrap(),
        namespace: pod.metadata.namespace.clone().unwrap(),
        name: pod.metadata.name.clone().unwrap(),
    }
}

fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap()
}

struct Rig {
    cluster: Cluster,
    client: Client,
    kubelet: Kubelet,
    /// Names this test's nodes apart from other tests' on a shared plane.
    prefix: String,
    bridge_kube: kube::Client,
    bridge: Option<(Arc<Bridge>, JoinHandle<()>)>,
    /// How long the bridge's Tether client retries a call before it fails.
    bridge_retry: Duration,
    plane: Plane,
}

impl Rig {
    /// A rig on the shared plane; `None` when the assets are missing.
    async fn shared(test: &str) -> Option<Rig> {
        Rig::shared_with(test, |_| {}).await
    }

    /// [`Rig::shared`] with Tether's replicas configured by `tweak`.
    async fn shared_with(
        test: &str,
        tweak: impl Fn(&mut Config) + Send + Sync + 'static,
    ) -> Option<Rig> {
        let plane = Plane::shared_or_skip(test)?;
        Some(Rig::start(plane, test, tweak).await)
    }

    /// A rig on a plane of its own; `None` when the assets are missing.
    async fn own(test: &str) -> Option<Rig> {
        let plane = Plane::own_or_skip(test).await?;
        Some(Rig::start(plane, test, |_| {}).await)
    }

    async fn start(
        plane: Plane,
        test: &str,
        tweak: impl Fn(&mut Config) + Send + Sync + 'static,
    ) -> Rig {
        let prefix: String = test.chars().filter(|c| *c != '_').take(12).collect();
        let namespace = plane
            .namespace(&test.replace('_', "-")[..20.min(test.len())])
            .await;
        let kubelet = Kubelet::new(plane.client().await, &namespace);
        let bridge_kube = bridge_client(&plane).await;
        let cluster = Cluster::start_with(3, tweak).await;
        let client = Client::new(
            cluster.endpoints(),
            Options {
                retry_timeout: DEADLINE,
                ..Options::default()
            },
        )
        .unwrap();
        let mut rig = Rig {
            cluster,
            client,
            kubelet,
            prefix,
            bridge_kube,
            bridge: None,
            bridge_retry: DEADLINE,
            plane,
        };
        rig.start_bridge();
        eventually("both lists done", async || rig.bridge().healthy()).await;
        rig
    }

    /// A node name of this test's own.
    fn node(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    fn spawn_bridge(&self) -> (Arc<Bridge>, JoinHandle<()>) {
        let options = Options {
            retry_timeout: self.bridge_retry,
            ..Options::default()
        };
        let tether = Client::new(self.cluster.endpoints(), options).unwrap();
        let bridge = Bridge::new(tether, self.bridge_kube.clone());
        let task = tokio::spawn(
            bridge
                .clone()
                .run(Duration::from_secs(3600), std::future::pending()),
        );
        (bridge, task)
    }

    fn start_bridge(&mut self) {
        self.bridge = Some(self.spawn_bridge());
    }

    /// Restarts the bridge with a Tether client that gives a call up after
    /// `retry` (so that a send fails during an outage).
    async fn restart_bridge_retrying_for(&mut self, retry: Duration) {
        self.stop_bridge();
        self.bridge_retry = retry;
        self.start_bridge();
        eventually("both lists done", async || self.bridge().healthy()).await;
    }

    fn stop_bridge(&mut self) {
        if let Some((_, task)) = self.bridge.take() {
            task.abort();
        }
    }

    fn bridge(&self) -> &Bridge {
        &self.bridge.as_ref().expect("bridge running").0
    }

    /// Takes `node`'s lock for `pod` at once.
    async fn hold(&self, node: &str, pod: &Pod) -> tether_client::Held {
        self.client
            .acquire(&key(node), &tether_pod(pod), vec![], Duration::ZERO, 0)
            .await
            .unwrap()
    }

    /// Queues `pod` for `node`'s lock in the background.
    fn wait_for(
        &self,
        node: &str,
        pod: &Pod,
    ) -> JoinHandle<tether_client::Result<tether_client::Held>> {
        let client = self.client.clone();
        let (key, pod) = (key(node), tether_pod(pod));
        tokio::spawn(async move { client.acquire(&key, &pod, vec![], DEADLINE, 0).await })
    }

    async fn until_interesting(&self, pod: &Pod) {
        let uid = uid(pod);
        eventually("the bridge to learn the pod", async || {
            self.bridge().is_interesting(&uid)
        })
        .await;
    }

    async fn holder_uid(&self, node: &str) -> Option<String> {
        self.client
            .holder(&key(node))
            .await
            .unwrap()
            .map(|h| h.pod.unwrap().uid)
    }

    /// Waits until `node`'s lock is free.
    async fn until_released(&self, node: &str) {
        eventually("the hold to be released", async || {
            self.holder_uid(node).await.is_none()
        })
        .await;
    }

    /// A barrier through the bridge's pod watch: a marker pod holds a lock
    /// of its own and fails; once that hold is gone, every pod event before
    /// the marker's has been handled too (one watch, in order).
    async fn pod_events_handled(&self) {
        let name = format!("marker-{}", rand_suffix());
        let lock = self.node(&name);
        let marker = self.kubelet.create_pod(&name).await;
        self.hold(&lock, &marker).await;
        self.until_interesting(&marker).await;
        self.kubelet.finish(&name, "Failed", None).await;
        self.until_released(&lock).await;
    }

    async fn shutdown(mut self) {
        self.stop_bridge();
        self.cluster.shutdown().await;
    }
}

/// A suffix unique in this process, for marker names.
fn rand_suffix() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unbound_pod_deleted_after_acquire_hands_the_lock_to_the_next_waiter() {
    let Some(rig) =
        Rig::shared("an_unbound_pod_deleted_after_acquire_hands_the_lock_to_the_next_waiter").await
    else {
        return;
    };
    let n1 = rig.node("n1");
    let owner = rig.kubelet.create_pod("owner").await;
    let next = rig.kubelet.create_pod("next").await;
    rig.hold(&n1, &owner).await;
    let waiter = rig.wait_for(&n1, &next);
    rig.until_interesting(&owner).await;
    let deleted_at = std::time::Instant::now();
    // Not bound: the API server removes it at once, whatever the grace.
    rig.kubelet.delete("owner").await;
    assert!(!rig.kubelet.pod_exists("owner").await);
    let held = waiter.await.unwrap().expect("the next waiter is granted");
    println!(
        "real API: pod delete -> next waiter granted in {:?}",
        deleted_at.elapsed()
    );
    assert_eq!(held.pod_uid(), uid(&next));
    // The bridge counts the report once Tether's answer reaches it, which
    // can be just after the waiter saw its grant.
    eventually("the report to be counted", async || {
        rig.bridge().metrics.commands_sent.get() > 0
    })
    .await;
    assert!(
        rig.bridge()
            .render_metrics()
            .contains("tether_bridge_lag_seconds_count")
    );
    rig.shutdown().await;
}

/// Succeeded, Failed, and Failed with reason Evicted (the kubelet's
/// node-pressure eviction) each end the pod's hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminal_phases_release_holds() {
    let Some(rig) = Rig::shared("terminal_phases_release_holds").await else {
        return;
    };
    let cases = [
        ("done", "Succeeded", None),
        ("crashed", "Failed", None),
        ("evicted", "Failed", Some("Evicted")),
    ];
    for (name, _, _) in cases {
        let pod = rig.kubelet.create_pod(name).await;
        rig.kubelet.bind(name, &rig.node(name)).await;
        rig.kubelet.run(name).await;
        rig.hold(&rig.node(name), &pod).await;
        rig.until_interesting(&pod).await;
    }
    for (name, phase, reason) in cases {
        rig.kubelet.finish(name, phase, reason).await;
        rig.until_released(&rig.node(name)).await;
        assert!(rig.kubelet.pod_exists(name).await, "terminal, not deleted");
    }
    rig.shutdown().await;
}

/// A graceful delete of a running pod leaves it in the API with a
/// `deletionTimestamp` while its containers stop: its hold stays (its
/// devices are still in use) until the kubelet confirms the deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_delete_keeps_a_running_pods_hold_until_the_kubelet_confirms() {
    let Some(rig) =
        Rig::shared("a_graceful_delete_keeps_a_running_pods_hold_until_the_kubelet_confirms").await
    else {
        return;
    };
    let node = rig.node("n1");
    let pod = rig.kubelet.create_pod("stopping").await;
    rig.kubelet.bind("stopping", &node).await;
    rig.kubelet.run("stopping").await;
    let held = rig.hold(&node, &pod).await;
    let next = rig.kubelet.create_pod("next").await;
    let waiter = rig.wait_for(&node, &next);
    rig.until_interesting(&pod).await;
    rig.kubelet.delete("stopping").await;
    let terminating = rig.kubelet.pods.get("stopping").await.unwrap();
    assert!(terminating.metadata.deletion_timestamp.is_some());
    rig.pod_events_handled().await;
    assert_eq!(rig.holder_uid(&node).await, Some(uid(&pod)));
    assert!(!waiter.is_finished());
    // The kubelet stopped the containers and confirms.
    rig.kubelet.delete_now("stopping").await;
    let granted = waiter.await.unwrap().expect("the next pod is granted");
    assert_eq!(granted.pod_uid(), uid(&next));
    let history = rig
        .client
        .history(&format!("lock/gpu-bind/{node}"), 0, 0)
        .await
        .unwrap();
    assert!(
        history
            .events
            .iter()
            .any(|e| e.kind == "LockReleased" && e.token == held.token())
    );
    rig.shutdown().await;
}

/// Deleting is not gone: a graceful delete of a bound pod whose GPU init
/// container still runs, and of one stuck before any container started
/// (an image pull), leaves each in the API with a `deletionTimestamp` while
/// the kubelet still counts its devices. Each keeps its hold, and the next
/// waiter waits, until the kubelet confirms the deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminating_pod_keeps_its_hold_until_it_is_gone_even_before_its_main_container_starts() {
    let Some(rig) = Rig::shared(
        "a_terminating_pod_keeps_its_hold_until_it_is_gone_even_before_its_main_container_starts",
    )
    .await
    else {
        return;
    };
    for (name, init_running) in [("gpu-init", true), ("image-pull", false)] {
        let node = rig.node(name);
        let pod = rig.kubelet.create_pod_with_init(name).await;
        rig.kubelet.bind(name, &node).await;
        if init_running {
            rig.kubelet.run_init(name).await;
        }
        rig.hold(&node, &pod).await;
        let next_name = format!("{name}-next");
        let next = rig.kubelet.create_pod(&next_name).await;
        let waiter = rig.wait_for(&node, &next);
        rig.until_interesting(&pod).await;
        rig.kubelet.delete(name).await;
        let terminating = rig.kubelet.pods.get(name).await.unwrap();
        assert!(terminating.metadata.deletion_timestamp.is_some(), "{name}");
        rig.pod_events_handled().await;
        assert_eq!(rig.holder_uid(&node).await, Some(uid(&pod)), "{name}");
        assert!(!waiter.is_finished(), "{name}: the next pod was granted");
        // The kubelet stopped what ran and confirms.
        rig.kubelet.delete_now(name).await;
        let granted = waiter.await.unwrap().expect("the next pod is granted");
        assert_eq!(granted.pod_uid(), uid(&next), "{name}");
    }
    rig.shutdown().await;
}

/// A pod fails while Tether has no quorum (the kubelet fails a pod whose
/// `Allocate` could not reach Tether: the same outage). The bridge's report
/// fails; once a quorum is back it is sent again, with back-off, and the
/// node's hold ends. Before, the lost report was never sent again (the pod
/// did not change any more) and the pod stayed `Starting` in Tether, keeping
/// the node until the hourly resync at best.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_that_fails_while_tether_has_no_quorum_is_reported_once_a_quorum_is_back() {
    let Some(mut rig) = Rig::shared(
        "a_pod_that_fails_while_tether_has_no_quorum_is_reported_once_a_quorum_is_back",
    )
    .await
    else {
        return;
    };
    rig.restart_bridge_retrying_for(Duration::from_secs(2))
        .await;
    let node = rig.node("n1");
    let pod = rig.kubelet.create_pod("failing").await;
    rig.kubelet.bind("failing", &node).await;
    rig.hold(&node, &pod).await;
    rig.until_interesting(&pod).await;
    // The outage: the leader and one follower stop. The follower left
    // cannot lead alone, so the report reaches no log at all (stopping
    // only followers would leave it in the leader's log, to commit later).
    let leader = rig.cluster.wait_leader().await;
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let stopped = [leader, follower];
    for id in &stopped {
        rig.cluster.stop(*id).await;
    }
    let errors_before = rig.bridge().metrics.command_errors.get();
    rig.kubelet.finish("failing", "Failed", None).await;
    eventually("the bridge's report to fail", async || {
        rig.bridge().metrics.command_errors.get() > errors_before
    })
    .await;
    for id in &stopped {
        rig.cluster.restart(*id).await;
    }
    rig.until_released(&node).await;
    // The failed send woke the retry loop (another path, such as Tether's
    // event stream resuming, may have sent the report first).
    eventually("the retry loop to resync", async || {
        rig.bridge().metrics.retries.get() >= 1
    })
    .await;
    rig.shutdown().await;
}

/// Force deletes (grace period 0) and evictions through the Eviction API.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn force_deletes_and_evictions_release_holds() {
    let Some(rig) = Rig::shared("force_deletes_and_evictions_release_holds").await else {
        return;
    };
    let forced_node = rig.node("forced");
    let evicted_node = rig.node("evicted");
    let forced = rig.kubelet.create_pod("forced").await;
    let evicted = rig.kubelet.create_pod("evicted").await;
    for (name, node, pod) in [
        ("forced", &forced_node, &forced),
        ("evicted", &evicted_node, &evicted),
    ] {
        rig.kubelet.bind(name, node).await;
        rig.kubelet.run(name).await;
        rig.hold(node, pod).await;
        rig.until_interesting(pod).await;
    }
    rig.kubelet.delete_now("forced").await;
    rig.until_released(&forced_node).await;
    // An eviction is a graceful delete: the hold stays until the kubelet
    // confirms, as above.
    rig.kubelet.evict("evicted").await;
    let terminating = rig.kubelet.pods.get("evicted").await.unwrap();
    assert!(terminating.metadata.deletion_timestamp.is_some());
    rig.pod_events_handled().await;
    assert_eq!(rig.holder_uid(&evicted_node).await, Some(uid(&evicted)));
    rig.kubelet.delete_now("evicted").await;
    rig.until_released(&evicted_node).await;
    rig.shutdown().await;
}

/// A StatefulSet's replacement pod: same name, new UID, queued behind the
/// pod it replaces. The old UID's hold ends; the new one is granted and
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_name_reused_under_a_new_uid_keeps_the_new_pods_place() {
    let Some(rig) = Rig::shared("a_name_reused_under_a_new_uid_keeps_the_new_pods_place").await
    else {
        return;
    };
    let node = rig.node("n1");
    let old = rig.kubelet.create_pod("worker-0").await;
    rig.kubelet.bind("worker-0", &node).await;
    rig.kubelet.run("worker-0").await;
    rig.hold(&node, &old).await;
    rig.until_interesting(&old).await;
    rig.kubelet.delete_now("worker-0").await;
    let new = rig.kubelet.create_pod("worker-0").await;
    assert_ne!(uid(&old), uid(&new));
    let granted = rig
        .wait_for(&node, &new)
        .await
        .unwrap()
        .expect("the replacement is granted");
    assert_eq!(granted.pod_uid(), uid(&new));
    rig.until_interesting(&new).await;
    rig.pod_events_handled().await;
    assert_eq!(rig.holder_uid(&node).await, Some(uid(&new)));
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_bridges_release_a_deleted_owner_exactly_once() {
    let Some(rig) = Rig::shared("two_bridges_release_a_deleted_owner_exactly_once").await else {
        return;
    };
    let (second, second_task) = rig.spawn_bridge();
    eventually("the second bridge's lists done", async || second.healthy()).await;
    let node = rig.node("n1");
    let owner = rig.kubelet.create_pod("owner").await;
    let next = rig.kubelet.create_pod("next").await;
    let first = rig.hold(&node, &owner).await;
    let waiter = rig.wait_for(&node, &next);
    rig.until_interesting(&owner).await;
    eventually("the second bridge to learn the pod", async || {
        second.is_interesting(&uid(&owner))
    })
    .await;
    rig.kubelet.delete("owner").await;
    let held = waiter.await.unwrap().expect("the next waiter is granted");
    assert_eq!(held.pod_uid(), uid(&next));
    // Both saw the deletion. Whether the second also sent its report
    // depends on whether Tether's release reached it first (then the pod no
    // longer interests it); either way the lock changes hands once.
    eventually("both bridges to see the deletion", async || {
        rig.bridge().knows_deleted(&uid(&owner)) && second.knows_deleted(&uid(&owner))
    })
    .await;
    let history = rig
        .client
        .history(&format!("lock/gpu-bind/{node}"), 0, 0)
        .await
        .unwrap();
    let releases: Vec<u64> = history
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased")
        .map(|e| e.token)
        .collect();
    assert_eq!(releases, [first.token()], "released exactly once");
    second_task.abort();
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_deleted_while_the_bridge_was_down_is_released_when_it_is_back() {
    let Some(mut rig) =
        Rig::shared("a_pod_deleted_while_the_bridge_was_down_is_released_when_it_is_back").await
    else {
        return;
    };
    let (gone_node, alive_node) = (rig.node("n1"), rig.node("n2"));
    let ghost = rig.kubelet.create_pod("ghost").await;
    let alive = rig.kubelet.create_pod("alive").await;
    rig.hold(&gone_node, &ghost).await;
    rig.hold(&alive_node, &alive).await;
    rig.until_interesting(&ghost).await;
    rig.stop_bridge();
    rig.kubelet.delete("ghost").await;
    rig.start_bridge();
    rig.until_released(&gone_node).await;
    assert_eq!(rig.holder_uid(&alive_node).await, Some(uid(&alive)));
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_joining_and_becoming_ready_is_seen_on_tethers_watch() {
    let Some(rig) = Rig::shared("a_node_joining_and_becoming_ready_is_seen_on_tethers_watch").await
    else {
        return;
    };
    let name = rig.node("joining");
    let mut watch = rig
        .client
        .watch(
            None,
            vec!["NodeJoined".into(), "NodeReady".into()],
            &format!("node/{name}"),
        )
        .await
        .unwrap();
    rig.kubelet.create_node(&name, "a").await;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(DEADLINE, watch.next())
            .await
            .expect("watch stalled")
            .unwrap()
        {
            WatchUpdate::Events(events) => seen.extend(events.into_iter().map(|e| e.kind)),
            WatchUpdate::Relist { .. } => panic!("unexpected gap"),
        }
    }
    assert_eq!(seen, ["NodeJoined", "NodeReady"]);
    rig.kubelet.delete_node(&name).await;
    rig.shutdown().await;
}

/// A node deleted (scaled away): its pins go at once; kube-controller-
/// manager's pod GC force-deletes the pods bound to it (after its 40 s
/// quarantine), and their holds go. The node re-created under its name (a
/// new UID) takes pins again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_node_loses_its_pins_and_pod_gc_ends_its_pods_holds() {
    let Some(rig) = Rig::own("a_deleted_node_loses_its_pins_and_pod_gc_ends_its_pods_holds").await
    else {
        return;
    };
    let _pod_gc = rig.plane.controller_manager(&["podgc"]).unwrap();
    let (doomed, other) = (rig.node("n1"), rig.node("n2"));
    let first_uid = rig.kubelet.create_node(&doomed, "a").await.metadata.uid;
    rig.kubelet.create_node(&other, "b").await;
    eventually("both nodes in the registry, ready", async || {
        let nodes = rig.client.list_nodes(false).await.unwrap();
        [&doomed, &other]
            .iter()
            .all(|n| nodes.iter().any(|m| &&m.name == n && m.ready))
    })
    .await;
    let pin_key = pb::PinKey {
        set: "slurm/set-a".into(),
        member: "0".into(),
    };
    let assign = async |candidates: Vec<String>| {
        rig.client
            .assign(
                &pin_key,
                candidates,
                "",
                Duration::ZERO,
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap()
            .pin
            .unwrap()
            .node
    };
    assert_eq!(assign(vec![doomed.clone()]).await, doomed);
    let pod = rig.kubelet.create_pod("on-doomed").await;
    rig.kubelet.bind("on-doomed", &doomed).await;
    rig.kubelet.run("on-doomed").await;
    rig.hold(&doomed, &pod).await;
    rig.until_interesting(&pod).await;

    let deleted_at = std::time::Instant::now();
    rig.kubelet.delete_node(&doomed).await;
    eventually("the pin to be released", async || {
        rig.client.get_pin(&pin_key).await.unwrap().is_none()
    })
    .await;
    println!("node delete -> pin released in {:?}", deleted_at.elapsed());
    // The next assign picks a live node.
    assert_eq!(assign(vec![doomed.clone(), other.clone()]).await, other);
    rig.client.release_pin(&pin_key, "test").await.unwrap();
    // Pod GC's quarantine is 40 s and it looks every 20 s: a minute and a
    // bit, well inside twice the deadline.
    let deadline = tokio::time::Instant::now() + DEADLINE * 2;
    while rig.kubelet.pod_exists("on-doomed").await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pod GC did not delete the pod of a deleted node"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rig.until_released(&doomed).await;
    println!(
        "node delete -> pod GC deleted its pod and its hold was released in {:?}",
        deleted_at.elapsed()
    );

    let second_uid = rig.kubelet.create_node(&doomed, "a").await.metadata.uid;
    assert_ne!(first_uid, second_uid);
    eventually("the re-created node in the registry, ready", async || {
        let nodes = rig.client.list_nodes(false).await.unwrap();
        nodes
            .iter()
            .any(|n| n.name == doomed && Some(&n.uid) == second_uid.as_ref() && n.ready)
    })
    .await;
    assert_eq!(assign(vec![doomed.clone()]).await, doomed);
    rig.shutdown().await;
}

/// What a node's object holds before it is deleted and re-created under its
/// name: an operator's permanent pin, a pod's device claim, its lock's
/// holder and a waiter in its queue.
struct OldNodeHoldings {
    node: String,
    old_uid: String,
    pin: pb::PinKey,
    claim: pb::PinKey,
    holder_token: u64,
    waiter: JoinHandle<tether_client::Result<tether_client::Held>>,
    /// Tether's node events from before the re-create on.
    watch: tether_client::Watcher,
}

impl Rig {
    /// Creates node `name`, waits until Tether has it registered and ready,
    /// and gives its object everything a node can hold.
    async fn node_holding_everything(&self, name: &str) -> OldNodeHoldings {
        let node = self.node(name);
        let old_uid = self
            .kubelet
            .create_node(&node, "a")
            .await
            .metadata
            .uid
            .unwrap();
        eventually("the node registered and ready", async || {
            let nodes = self.client.list_nodes(false).await.unwrap();
            nodes
                .iter()
                .any(|n| n.name == node && n.uid == old_uid && n.ready)
        })
        .await;
        let pin = pb::PinKey {
            set: "slurm/workers".into(),
            member: format!("{node}-0"),
        };
        let pinned = self
            .client
            .assign(
                &pin,
                vec![node.clone()],
                "",
                Duration::ZERO,
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        assert_eq!(pinned.pin.unwrap().node, node);
        let owner = self.kubelet.create_pod(&format!("{name}-owner")).await;
        let next = self.kubelet.create_pod(&format!("{name}-next")).await;
        let claim = pb::PinKey {
            set: "gpu-devices".into(),
            member: uid(&owner),
        };
        self.client
            .assign(
                &claim,
                vec![node.clone()],
                &uid(&owner),
                Duration::from_secs(1),
                [("devices.tether.io/gpu0".to_string(), "held".to_string())].into(),
                Default::default(),
            )
            .await
            .unwrap();
        let holder_token = self.hold(&node, &owner).await.token();
        let waiter = self.wait_for(&node, &next);
        eventually("the next pod queued", async || {
            let lock = self.client.get(&key(&node)).await.unwrap();
            !lock.waiters.is_empty()
        })
        .await;
        let watch = self
            .client
            .watch(
                None,
                vec!["NodeGone".into(), "NodeJoined".into()],
                &format!("node/{node}"),
            )
            .await
            .unwrap();
        OldNodeHoldings {
            node,
            old_uid,
            pin,
            claim,
            holder_token,
            waiter,
            watch,
        }
    }

    /// Deletes the node object and creates one under the same name; returns
    /// the new UID.
    async fn recreate_node(&self, node: &str) -> String {
        recreate_node_with(&self.kubelet, node).await
    }
}

/// Checks, within the bridge's usual bound (the test deadline), that
/// everything the old object held ended (each once, for the reason that its
/// node is gone) and that the new object joined, once, under its UID.
async fn assert_replaced(rig: &Rig, mut old: OldNodeHoldings, new_uid: &str) {
    assert_ne!(old.old_uid, new_uid);
    let started = std::time::Instant::now();
    let mut seen: Vec<(String, String)> = Vec::new();
    while !seen
        .iter()
        .any(|(kind, uid)| kind == "NodeJoined" && uid == new_uid)
    {
        match tokio::time::timeout(DEADLINE, old.watch.next())
            .await
            .expect("no NodeJoined for the re-created node")
            .unwrap()
        {
            WatchUpdate::Events(events) => seen.extend(events.into_iter().map(|e| {
                let uid = e.attributes.get("uid").cloned().unwrap_or_default();
                (e.kind, uid)
            })),
            WatchUpdate::Relist { .. } => panic!("unexpected gap"),
        }
    }
    println!(
        "node {} re-created: old object gone and new one joined {:?} after the check began",
        old.node,
        started.elapsed()
    );
    assert_eq!(
        seen.iter()
            .map(|(kind, _)| kind.as_str())
            .collect::<Vec<_>>(),
        ["NodeGone", "NodeJoined"],
        "the old object goes before the new one joins: {seen:?}"
    );
    let nodes = rig.client.list_nodes(false).await.unwrap();
    let registered = nodes.iter().find(|n| n.name == old.node).unwrap();
    assert_eq!(registered.uid, new_uid);
    assert!(rig.client.get_pin(&old.pin).await.unwrap().is_none());
    assert!(rig.client.get_pin(&old.claim).await.unwrap().is_none());
    assert_eq!(rig.holder_uid(&old.node).await, None);
    let waited = old.waiter.await.unwrap();
    assert!(
        waited.is_err(),
        "the queued pod's wait ends with the old node: {waited:?}"
    );
    let lock = rig
        .client
        .history(&format!("lock/gpu-bind/{}", old.node), 0, 0)
        .await
        .unwrap();
    let released: Vec<(u64, String)> = lock
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased")
        .map(|e| (e.token, e.reason.clone()))
        .collect();
    assert_eq!(released.len(), 1, "released once: {released:?}");
    assert_eq!(released[0].0, old.holder_token);
    assert_eq!(released[0].1, "node gone", "{released:?}");
    for key in [&old.pin, &old.claim] {
        let history = rig
            .client
            .history(&format!("pin/{}/{}", key.set, key.member), 0, 0)
            .await
            .unwrap();
        let reasons: Vec<&str> = history
            .events
            .iter()
            .filter(|e| e.kind == "PinReleased")
            .map(|e| e.reason.as_str())
            .collect();
        assert_eq!(reasons, ["NodeGone"], "{key:?}");
    }
    // The new object takes pins again.
    let pinned = rig
        .client
        .assign(
            &old.pin,
            vec![old.node.clone()],
            "",
            Duration::ZERO,
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    assert_eq!(pinned.pin.unwrap().node, old.node);
}

/// A node deleted and re-created under its name (a cloud replacement, a
/// re-imaged machine keeping its hostname) while the bridge was down: the
/// bridge's first list finds the name under another UID, confirms the old
/// object gone, reports it gone, and the new one joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_recreated_while_the_bridge_was_down_is_a_new_node() {
    let Some(mut rig) =
        Rig::shared("a_node_recreated_while_the_bridge_was_down_is_a_new_node").await
    else {
        return;
    };
    let old = rig.node_holding_everything("rn1").await;
    rig.stop_bridge();
    let new_uid = rig.recreate_node(&old.node).await;
    rig.start_bridge();
    assert_replaced(&rig, old, &new_uid).await;
    rig.shutdown().await;
}

/// Issue 62 case 3: what a scheduler takes for the new object of a node
/// re-created while the bridge was down is never ended by the old object's
/// `Gone`. While Tether still has the old object registered, a claim or
/// the bind lock taken for the new one (its UID as the scheduler saw it) is
/// refused and nothing is taken; once the bridge has reported the old
/// object gone and the new one joined, they are taken, and a late report
/// that the old object is gone (a lagging second bridge) ends none of it.
/// Before, the claim and the lock were taken under the name while the old
/// object held it, and the bridge's `Gone` for the old object ended them, a
/// holder in the middle of Allocate included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_was_taken_for_a_recreated_node_outlives_the_old_objects_gone() {
    let Some(mut rig) =
        Rig::shared("what_was_taken_for_a_recreated_node_outlives_the_old_objects_gone").await
    else {
        return;
    };
    let old = rig.node_holding_everything("rn3").await;
    let (node, old_uid) = (old.node.clone(), old.old_uid.clone());
    rig.stop_bridge();
    let new_uid = rig.recreate_node(&node).await;
    let pod = rig.kubelet.create_pod("rn3-new").await;
    let claim = pb::PinKey {
        set: "gpu-devices".into(),
        member: uid(&pod),
    };
    let devices = || [("devices.tether.io/gpu1".to_string(), "held".to_string())].into();
    let client = rig.client.clone();
    let take = async |node_uid: &str| {
        let claimed = client
            .reclaim_for_node_object(
                &claim,
                &node,
                node_uid,
                &uid(&pod),
                Duration::from_secs(1),
                devices(),
                "devices.tether.io/",
            )
            .await;
        let held = client
            .acquire_for_node_object(
                &key(&node),
                node_uid,
                &tether_pod(&pod),
                vec![],
                Duration::ZERO,
                0,
                |_| {},
            )
            .await;
        (claimed, held)
    };
    // The bridge away: Tether has the old object under the name.
    let (claimed, held) = take(&new_uid).await;
    for refused in [claimed.map(|_| ()), held.map(|_| ())] {
        match refused {
            Err(tether_client::Error::FailedPrecondition(message)) => assert!(
                message.contains(&old_uid) && message.contains(&new_uid),
                "{message}"
            ),
            other => panic!("taken for the new object while the old one is registered: {other:?}"),
        }
    }
    assert!(rig.client.get_pin(&claim).await.unwrap().is_none());
    // The bridge back: the old object's holdings end, the new one joins.
    rig.start_bridge();
    assert_replaced(&rig, old, &new_uid).await;
    let (claimed, held) = take(&new_uid).await;
    claimed.expect("claimed for the registered object");
    let token = held.expect("locked for the registered object").token();
    // A lagging reporter's delete of the old object changes nothing.
    let late = rig
        .client
        .report_node(pb::ReportNodeRequest {
            name: node.clone(),
            uid: old_uid.clone(),
            state: pb::NodeState::NodeGone as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!late.changed, "{late:?}");
    assert_eq!(rig.holder_uid(&node).await, Some(uid(&pod)));
    let hold = rig.client.holder(&key(&node)).await.unwrap().unwrap();
    assert_eq!(hold.token, token);
    assert!(rig.client.get_pin(&claim).await.unwrap().is_some());
    // And nothing more is taken for the old object.
    let (claimed, _) = take(&old_uid).await;
    assert!(
        matches!(claimed, Err(tether_client::Error::FailedPrecondition(_))),
        "{claimed:?}"
    );
    rig.shutdown().await;
}

/// The same re-create while the bridge's watch is cut off by an API server
/// outage, with etcd compacted: the resumed watch meets 410 Gone and
/// relists, and the relist pairs the name's old and new objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_recreated_during_a_watch_gap_is_a_new_node_after_the_relist() {
    let Some(rig) =
        Rig::own("a_node_recreated_during_a_watch_gap_is_a_new_node_after_the_relist").await
    else {
        return;
    };
    let old = rig.node_holding_everything("rn1").await;
    let before = rig
        .kubelet
        .nodes
        .get(&old.node)
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    rig.plane.stop_apiserver();
    let new_uid = {
        let other = rig.plane.extra_apiserver().await.unwrap();
        let kubelet = Kubelet::new(other.client().await, "default");
        let new_uid = recreate_node_with(&kubelet, &old.node).await;
        rig.plane.compact_etcd().await.unwrap();
        new_uid
    };
    rig.plane.start_apiserver().await.unwrap();
    let nodes: Api<Node> = Api::all(rig.plane.client().await);
    assert_eq!(watch_error_code(&nodes, &before).await, Some(410));
    assert_replaced(&rig, old, &new_uid).await;
    rig.shutdown().await;
}

/// Deletes node `node` and creates one under the same name through
/// `kubelet`'s API server; returns the new UID.
async fn recreate_node_with(kubelet: &Kubelet, node: &str) -> String {
    kubelet.delete_node(node).await;
    kubelet.create_node(node, "b").await.metadata.uid.unwrap()
}

/// Two bridges, both away across the re-create and back at once: both find
/// the name under another UID; the old object goes once and the new one
/// joins once, whichever reports first (the other's reports change nothing
/// or are refused and re-checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_bridges_back_after_a_node_recreate_end_the_old_node_once() {
    let Some(mut rig) =
        Rig::shared("two_bridges_back_after_a_node_recreate_end_the_old_node_once").await
    else {
        return;
    };
    let old = rig.node_holding_everything("rn1").await;
    rig.stop_bridge();
    let new_uid = rig.recreate_node(&old.node).await;
    rig.start_bridge();
    let (second, second_task) = rig.spawn_bridge();
    let node = old.node.clone();
    assert_replaced(&rig, old, &new_uid).await;
    eventually("the second bridge's lists done", async || second.healthy()).await;
    // Both bridges are settled: a later event about the node is reported
    // by both without bringing the old object back.
    rig.kubelet.set_node_ready(&node, false).await;
    eventually("the new node reported not ready", async || {
        let nodes = rig.client.list_nodes(false).await.unwrap();
        nodes
            .iter()
            .any(|n| n.name == node && n.uid == new_uid && !n.ready)
    })
    .await;
    let history = rig
        .client
        .history(&format!("node/{node}"), 0, 0)
        .await
        .unwrap();
    let kinds: Vec<&str> = history
        .events
        .iter()
        .map(|e| e.kind.as_str())
        .filter(|k| *k == "NodeGone" || *k == "NodeJoined")
        .collect();
    assert_eq!(kinds, ["NodeJoined", "NodeGone", "NodeJoined"]);
    second_task.abort();
    rig.shutdown().await;
}

/// The API server crashes. While it is down, a pod that holds is deleted
/// (through a second API server on the same etcd) and etcd's history is
/// compacted. The restarted API server's watch cache starts at etcd's
/// current revision, so the bridge's watch resumes into a real 410 Gone;
/// the relist finds the pod gone and releases its hold exactly once, and a
/// live pod keeps its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_server_outage_with_a_compaction_ends_in_a_relist_that_releases_once() {
    let Some(rig) =
        Rig::own("an_api_server_outage_with_a_compaction_ends_in_a_relist_that_releases_once")
            .await
    else {
        return;
    };
    let (lost_node, kept_node) = (rig.node("n1"), rig.node("n2"));
    let lost = rig.kubelet.create_pod("lost").await;
    let kept = rig.kubelet.create_pod("kept").await;
    let lost_hold = rig.hold(&lost_node, &lost).await;
    rig.hold(&kept_node, &kept).await;
    rig.until_interesting(&lost).await;
    let namespace = lost.metadata.namespace.clone().unwrap();

    rig.plane.stop_apiserver();
    {
        let other = rig.plane.extra_apiserver().await.unwrap();
        let pods: Api<Pod> = Api::namespaced(other.client().await, &namespace);
        pods.delete("lost", &DeleteParams::default().grace_period(0))
            .await
            .unwrap();
        rig.plane.compact_etcd().await.unwrap();
    }
    assert_eq!(
        rig.holder_uid(&lost_node).await,
        Some(uid(&lost)),
        "nothing can have told the bridge yet"
    );
    rig.plane.start_apiserver().await.unwrap();
    // What the bridge's resumed watch meets: any version from before the
    // outage is gone.
    let pods: Api<Pod> = Api::namespaced(rig.plane.client().await, &namespace);
    let before = kept.metadata.resource_version.clone().unwrap();
    assert_eq!(watch_error_code(&pods, &before).await, Some(410));
    rig.until_released(&lost_node).await;
    assert_eq!(rig.holder_uid(&kept_node).await, Some(uid(&kept)));
    rig.pod_events_handled().await;
    let history = rig
        .client
        .history(&format!("lock/gpu-bind/{lost_node}"), 0, 0)
        .await
        .unwrap();
    let releases = history
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased" && e.token == lost_hold.token())
        .count();
    assert_eq!(releases, 1, "released exactly once");
    rig.shutdown().await;
}

/// The scheduler lost a race: its bind (the acquire) arrives after the
/// pod's deletion, when no pod event will mention the pod again. The bridge
/// remembers the deletion and releases the hold at once, not at the next
/// resync (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_that_lands_after_its_pods_deletion_is_released_at_once() {
    let Some(rig) =
        Rig::shared("a_bind_that_lands_after_its_pods_deletion_is_released_at_once").await
    else {
        return;
    };
    let node = rig.node("n1");
    let late = rig.kubelet.create_pod("late").await;
    rig.kubelet.delete("late").await;
    eventually("the bridge to see the deletion", async || {
        rig.bridge().knows_deleted(&uid(&late))
    })
    .await;
    let granted_at = std::time::Instant::now();
    rig.hold(&node, &late).await;
    rig.until_released(&node).await;
    println!(
        "real API: late bind granted -> released in {:?}",
        granted_at.elapsed()
    );
    rig.shutdown().await;
}

/// DESIGN.md's stuck-hold rule with a bridge running: past the hold
/// timeout, a hold whose pod is bound and has not started (the kubelet's
/// `Allocate` may be slow) is kept and raises `LockStuck` while the next pod
/// waits; once the pod runs, the timeout releases the hold and the next pod
/// is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bound_pod_that_has_not_started_keeps_its_hold_past_the_timeout_until_it_runs() {
    let Some(rig) = Rig::shared_with(
        "a_bound_pod_that_has_not_started_keeps_its_hold_past_the_timeout_until_it_runs",
        |config| config.hold_timeout = Duration::from_secs(2),
    )
    .await
    else {
        return;
    };
    let node = rig.node("n1");
    let mut watch = rig
        .client
        .watch(None, vec![], &format!("lock/gpu-bind/{node}"))
        .await
        .unwrap();
    let slow = rig.kubelet.create_pod("slow").await;
    let next = rig.kubelet.create_pod("next").await;
    let granted_at = std::time::Instant::now();
    let held = rig.hold(&node, &slow).await;
    rig.kubelet.bind("slow", &node).await;
    let waiter = {
        let client = rig.client.clone();
        let (key, pod) = (key(&node), tether_pod(&next));
        tokio::spawn(async move { client.acquire(&key, &pod, vec![], DEADLINE * 2, 0).await })
    };
    let stuck = loop {
        let update = tokio::time::timeout(DEADLINE, watch.next())
            .await
            .expect("no LockStuck within the deadline")
            .unwrap();
        let WatchUpdate::Events(events) = update else {
            panic!("unexpected gap");
        };
        assert!(
            !events.iter().any(|e| e.kind == "LockReleased"),
            "the hold of a bound pod that has not started was released: {events:?}"
        );
        if let Some(stuck) = events.into_iter().find(|e| e.kind == "LockStuck") {
            break stuck;
        }
    };
    assert!(
        granted_at.elapsed() >= Duration::from_secs(2),
        "stuck before the timeout"
    );
    assert_eq!(stuck.token, held.token());
    assert_eq!(rig.holder_uid(&node).await, Some(uid(&slow)));
    assert!(!waiter.is_finished(), "the next pod still waits");
    rig.kubelet.run("slow").await;
    let granted = waiter.await.unwrap().expect("the next pod is granted");
    assert_eq!(granted.pod_uid(), uid(&next));
    let history = rig
        .client
        .history(&format!("lock/gpu-bind/{node}"), 0, 0)
        .await
        .unwrap();
    let released = history
        .events
        .iter()
        .find(|e| e.kind == "LockReleased" && e.token == held.token())
        .expect("released");
    assert!(released.reason.contains("hold timeout"), "{released:?}");
    rig.shutdown().await;
}
