//! End to end: a 3-replica Tether, the scheduler extender (reading and
//! binding pods through a real kube-apiserver v1.36, as its service account
//! with the manifests' RBAC), and the device plugin on a unix socket,
//! registered with a fake kubelet that drives it as the real one does. The
//! test calls the extender's verbs itself, as kube-scheduler would, to
//! choose when each bind arrives (`real_scheduler.rs` runs the extender
//! under a real kube-scheduler).
//!
//! The fake kubelet (`fake_kubelet/`, whose doc names the upstream code it
//! follows) drives the plugin as the device manager does. Each scenario has
//! a control plane of its own (`tether-kube-testenv`); its nodes carry
//! `status.allocatable` of the resource as the kubelet writes it
//! (`ManagerImpl.GetCapacity`: the count of the plugin's healthy devices, a
//! plain integer). A binding that fails is a real one: the API server
//! refuses to bind a pod that is being deleted (a finalizer keeps it).
//!
//! One scenario runs on a fake API server instead, for what a real one
//! cannot be made to do on demand: answer one chosen binding call after the
//! scheduler's timeout (`a_bind_the_scheduler_gave_up_on_...`). The fake
//! answers `GET pods/<name>`, `GET nodes/<name>` and `POST
//! pods/<name>/binding` as the API server does: 201 and `spec.nodeName`
//! set, or 409 Conflict when the pod is already bound.
//!
//! Tether runs with mutual TLS and each part with the role it is deployed
//! with: the extender `scheduler`, the plugin `device-plugin:<its node>`,
//! the test itself (acting as the bridge and an operator) `admin`. A
//! permission a part lacks fails its scenario.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use fake_kubelet::{Admitted, FakeKubelet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use roles::{Identities, client_as, cluster_on_tls_with};
use tether_client::proto::LockKey;
use tether_client::{Client, Options};
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::device_plugin::{BeforeRelease, GpuPlugin, Placement, PluginConfig, run};
use tether_embed::extender::{
    Extender, ExtenderBindingArgs, ExtenderBindingResult, KubeBinder, serve_extender,
};
use tether_embed::inventory::DeviceSource;
use tether_embed::v1beta1 as api;
use tether_embed::v1beta1::device_plugin_client::DevicePluginClient;
use tether_kube_testenv::{Plane, yaml_documents};
use tether_server::testing::{Cluster, DEADLINE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

mod fake_kubelet;
mod fixtures;
mod gpu_scheduling;
mod roles;

const NODE: &str = "gpu-node-1";
const RESOURCE: &str = "tether.io/gpu";

fn node_devices() -> Vec<String> {
    (0..8).map(|i| format!("gpu{i}")).collect()
}

fn key() -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: NODE.into(),
    }
}

/// A container of a pod: name, devices it asks for, init / sidecar / app.
#[derive(Clone, Copy)]
enum Kind {
    Init,
    Sidecar,
    App,
}

/// A pod manifest as the API server returns it.
fn pod_json(name: &str, containers: &[(&str, u32, Kind)]) -> serde_json::Value {
    let container = |(cname, gpus, kind): &(&str, u32, Kind)| {
        let mut c = serde_json::json!({"name": cname, "image": "busybox"});
        if *gpus > 0 {
            c["resources"] = serde_json::json!({"limits": {RESOURCE: gpus.to_string()}});
        }
        if matches!(kind, Kind::Sidecar) {
            c["restartPolicy"] = "Always".into();
        }
        c
    };
    let init: Vec<_> = containers
        .iter()
        .filter(|c| !matches!(c.2, Kind::App))
        .map(container)
        .collect();
    let app: Vec<_> = containers
        .iter()
        .filter(|c| matches!(c.2, Kind::App))
        .map(container)
        .collect();
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"), "resourceVersion": "1"},
        "spec": {"initContainers": init, "containers": app},
    })
}

/// The fake Kubernetes API, for the one scenario that needs it (see the
/// module doc).
#[derive(Default)]
struct FakeApi {
    pods: Mutex<BTreeMap<String, serde_json::Value>>,
    nodes: Mutex<BTreeMap<String, serde_json::Value>>,
    bindings: Mutex<Vec<(String, String, Instant)>>,
    /// Bindings of these pods fail with 409 "being deleted".
    fail: Mutex<BTreeSet<String>>,
    /// Bindings of these pods are answered this late.
    slow: Mutex<BTreeMap<String, Duration>>,
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn api_status(code: u16, reason: &str, message: String) -> serde_json::Value {
    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": message, "reason": reason, "code": code})
}

impl FakeApi {
    fn add(&self, pod: serde_json::Value) {
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        self.pods.lock().unwrap().insert(name, pod);
    }

    /// A node with `devices` of the resource allocatable (none: the
    /// resource is absent, as on a node without the plugin).
    fn add_node(&self, name: &str, devices: Option<&str>) {
        let mut node = serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "uid": format!("node-uid-{name}"), "resourceVersion": "1"},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi"}},
        });
        if let Some(devices) = devices {
            node["status"]["allocatable"][RESOURCE] = devices.into();
        }
        self.nodes.lock().unwrap().insert(name.to_string(), node);
    }

    async fn handle(&self, method: Method, uri: Uri, body: Bytes) -> Response {
        // /api/v1/namespaces/{ns}/pods/{name}[/binding] or /api/v1/nodes/{name}
        let path = uri.path().to_string();
        let parts: Vec<&str> = path.split('/').collect();
        if parts.len() == 5 && parts[3] == "nodes" {
            let node = self.nodes.lock().unwrap().get(parts[4]).cloned();
            return match (method.as_str(), node) {
                ("GET", Some(node)) => json_response(StatusCode::OK, node),
                ("GET", None) => json_response(
                    StatusCode::NOT_FOUND,
                    api_status(404, "NotFound", format!("nodes \"{}\" not found", parts[4])),
                ),
                _ => json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    api_status(405, "MethodNotAllowed", path),
                ),
            };
        }
        if path == "/api/v1/pods" && method == Method::GET {
            // The extender's look, at its start, for pods an earlier
            // extender refused: those not yet bound (its field selector).
            let unbound: Vec<serde_json::Value> = self
                .pods
                .lock()
                .unwrap()
                .values()
                .filter(|pod| pod["spec"]["nodeName"].as_str().is_none())
                .cloned()
                .collect();
            return json_response(
                StatusCode::OK,
                serde_json::json!({"apiVersion": "v1", "kind": "PodList",
                    "metadata": {"resourceVersion": "1"}, "items": unbound}),
            );
        }
        if parts.len() < 7 || parts[5] != "pods" {
            return json_response(
                StatusCode::NOT_FOUND,
                api_status(404, "NotFound", path.clone()),
            );
        }
        let name = parts[6].to_string();
        let Some(pod) = self.pods.lock().unwrap().get(&name).cloned() else {
            return json_response(
                StatusCode::NOT_FOUND,
                api_status(404, "NotFound", format!("pods \"{name}\" not found")),
            );
        };
        match (method.as_str(), parts.get(7)) {
            ("GET", None) => json_response(StatusCode::OK, pod),
            ("POST", Some(&"binding")) => {
                let delay = self.slow.lock().unwrap().get(&name).copied();
                if let Some(delay) = delay {
                    tokio::time::sleep(delay).await;
                }
                let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let node = body["target"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                if self.fail.lock().unwrap().contains(&name) {
                    return json_response(
                        StatusCode::CONFLICT,
                        api_status(409, "Conflict", format!("pod {name} is being deleted")),
                    );
                }
                let mut pods = self.pods.lock().unwrap();
                let pod = pods.get_mut(&name).unwrap();
                if let Some(bound) = pod["spec"]["nodeName"].as_str() {
                    let message = format!(
                        "Operation cannot be fulfilled on pods/binding \"{name}\": pod {name} is already \
                         assigned to node \"{bound}\""
                    );
                    return json_response(
                        StatusCode::CONFLICT,
                        api_status(409, "Conflict", message),
                    );
                }
                pod["spec"]["nodeName"] = node.clone().into();
                self.bindings
                    .lock()
                    .unwrap()
                    .push((name, node, Instant::now()));
                json_response(
                    StatusCode::CREATED,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}),
                )
            }
            _ => json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                api_status(405, "MethodNotAllowed", path),
            ),
        }
    }

    fn bound(&self) -> Vec<String> {
        self.bindings
            .lock()
            .unwrap()
            .iter()
            .map(|(name, _, _)| name.clone())
            .collect()
    }

    fn pod(&self, name: &str) -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(self.pods.lock().unwrap()[name].clone()).unwrap()
    }
}

/// A real kube-apiserver (a control plane of the scenario's own) as the
/// scheduler and the kubelet see it: pods in `ml`, nodes with the
/// resource allocatable.
struct RealApi {
    /// Kept for its life: the control plane stops when the scenario ends.
    _plane: Plane,
    pods: Api<Pod>,
    nodes: Api<Node>,
    /// Pod name -> the UID the API server gave it.
    uids: Mutex<BTreeMap<String, String>>,
    /// Pods seen bound, in the order they were first seen, and when.
    bound: Mutex<Vec<(String, Instant)>>,
}

/// The Kubernetes API the extender reads and binds through.
enum KubeSide {
    Real(Box<RealApi>),
    /// Only for what a real API server cannot be made to do on demand (see
    /// the module doc).
    Fake(Arc<FakeApi>),
}

impl KubeSide {
    /// Creates a pod from `pod_json`.
    async fn add(&self, pod: serde_json::Value) {
        match self {
            KubeSide::Fake(api) => api.add(pod),
            KubeSide::Real(api) => {
                let mut pod = pod;
                let metadata = pod["metadata"].as_object_mut().unwrap();
                metadata.remove("uid");
                metadata.remove("resourceVersion");
                let pod: Pod = serde_json::from_value(pod).unwrap();
                let created = api.pods.create(&PostParams::default(), &pod).await.unwrap();
                api.uids.lock().unwrap().insert(
                    created.metadata.name.unwrap(),
                    created.metadata.uid.unwrap(),
                );
            }
        }
    }

    /// The UID of the pod named `name`.
    fn uid(&self, name: &str) -> String {
        match self {
            KubeSide::Fake(_) => format!("uid-{name}"),
            KubeSide::Real(api) => api.uids.lock().unwrap()[name].clone(),
        }
    }

    /// A node with `devices` of the resource allocatable (none: the
    /// resource is absent, as on a node without the plugin), as the kubelet
    /// reports it.
    async fn add_node(&self, name: &str, devices: Option<&str>) {
        match self {
            KubeSide::Fake(api) => api.add_node(name, devices),
            KubeSide::Real(api) => {
                let node: Node =
                    serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
                        .unwrap();
                api.nodes
                    .create(&PostParams::default(), &node)
                    .await
                    .unwrap();
                let mut resources =
                    serde_json::json!({"cpu": "8", "memory": "32Gi", "pods": "110"});
                if let Some(devices) = devices {
                    resources[RESOURCE] = devices.into();
                }
                api.nodes
                    .patch_status(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({"status": {
                            "capacity": resources, "allocatable": resources}})),
                    )
                    .await
                    .unwrap();
            }
        }
    }

    /// The pods bound so far, in the order they were bound (on the real API
    /// server: in the order first seen bound, which is the order of the
    /// binds as long as the node's lock lets one through at a time).
    async fn bound(&self) -> Vec<String> {
        match self {
            KubeSide::Fake(api) => api.bound(),
            KubeSide::Real(api) => {
                let list = api.pods.list(&Default::default()).await.unwrap();
                let mut bound = api.bound.lock().unwrap();
                let mut new: Vec<String> = list
                    .items
                    .into_iter()
                    .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                    .map(|p| p.metadata.name.unwrap())
                    .filter(|n| !bound.iter().any(|(b, _)| b == n))
                    .collect();
                new.sort();
                let now = Instant::now();
                bound.extend(new.into_iter().map(|n| (n, now)));
                bound.iter().map(|(n, _)| n.clone()).collect()
            }
        }
    }

    /// When `name` was (first seen) bound.
    async fn bound_at(&self, name: &str) -> Option<Instant> {
        match self {
            KubeSide::Fake(api) => api
                .bindings
                .lock()
                .unwrap()
                .iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, _, at)| *at),
            KubeSide::Real(api) => {
                self.bound().await;
                let bound = api.bound.lock().unwrap();
                bound.iter().find(|(n, _)| n == name).map(|(_, at)| *at)
            }
        }
    }

    async fn pod(&self, name: &str) -> Pod {
        match self {
            KubeSide::Fake(api) => api.pod(name),
            KubeSide::Real(api) => api.pods.get(name).await.unwrap(),
        }
    }

    /// Makes the pod's binding fail as the API server fails a binding of a
    /// pod being deleted: on the real one, a finalizer keeps the deleted pod.
    async fn doom(&self, name: &str) {
        match self {
            KubeSide::Fake(api) => {
                api.fail.lock().unwrap().insert(name.to_string());
            }
            KubeSide::Real(api) => {
                api.pods
                    .patch(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({"metadata": {
                            "finalizers": ["example.com/keep"]}})),
                    )
                    .await
                    .unwrap();
                api.pods.delete(name, &Default::default()).await.unwrap();
            }
        }
    }

    fn fake(&self) -> &FakeApi {
        match self {
            KubeSide::Fake(api) => api,
            KubeSide::Real(_) => panic!("this scenario needs the fake API server"),
        }
    }
}

/// Everything one scenario needs.
struct Rig {
    cluster: Cluster,
    /// An `admin` client: the test acts as the bridge and an operator.
    client: Client,
    /// Certificates of each role (`device-plugin:<node>` for the plugin).
    identities: Identities,
    api: KubeSide,
    kubelet: Arc<FakeKubelet>,
    extender: std::net::SocketAddr,
    /// The extender serving at `extender`.
    extender_state: Arc<Extender<KubeBinder>>,
    plugin: Option<RunningPlugin>,
    /// Where the plugin's devices come from.
    devices: DeviceSource,
    _dir: tempfile::TempDir,
}

/// The plugin's role on the rig's node.
fn plugin_role() -> String {
    format!("device-plugin:{NODE}")
}

/// A device plugin serving in a task of the test.
struct RunningPlugin {
    task: JoinHandle<()>,
    service: Arc<GpuPlugin>,
}

impl RunningPlugin {
    fn abort(&self) {
        self.task.abort();
    }
}

fn start_plugin(
    cluster: &Cluster,
    identities: &Identities,
    dir: &Path,
    devices: &DeviceSource,
    hook: Option<BeforeRelease>,
) -> RunningPlugin {
    let config = PluginConfig {
        node: NODE.into(),
        scope: "gpu-bind".into(),
        resource_name: RESOURCE.into(),
        claim_set: tether_embed::accounting::DEVICE_SET.into(),
        inventory_set: tether_embed::inventory::INVENTORY_SET.into(),
        devices: devices.clone(),
        pod_uid: "device-plugin-pod".into(),
        allocate_deadline: DEADLINE,
    };
    let mut plugin =
        GpuPlugin::new(client_as(cluster, identities, &plugin_role()), config).unwrap();
    if let Some(hook) = hook {
        plugin = plugin.with_before_release(hook);
    }
    let placement = Placement {
        dir: dir.to_path_buf(),
        socket_name: "tether-gpu.sock".into(),
    };
    let service = Arc::new(plugin);
    let task = tokio::spawn({
        let service = service.clone();
        async move {
            run(service, placement, std::future::pending())
                .await
                .unwrap()
        }
    });
    RunningPlugin { task, service }
}

impl Rig {
    /// A scenario on a real API server; `None` (the test reported skipped)
    /// without the control-plane binaries.
    async fn start(test: &str) -> Option<Rig> {
        Self::start_with_wait(test, DEADLINE).await
    }

    async fn start_with_wait(test: &str, wait: Duration) -> Option<Rig> {
        Self::start_with_grace(test, wait, None).await
    }

    /// [`Rig::start_with_wait`] with the replicas' `--abandoned-wait-grace`
    /// set (its default when `None`).
    async fn start_with_grace(
        test: &str,
        wait: Duration,
        abandoned_wait_grace: Option<Duration>,
    ) -> Option<Rig> {
        let devices = DeviceSource::Fake(node_devices());
        Self::start_real(test, wait, abandoned_wait_grace, devices).await
    }

    /// A scenario on a real API server whose plugin's devices come from
    /// `devices`.
    async fn start_real(
        test: &str,
        wait: Duration,
        abandoned_wait_grace: Option<Duration>,
        devices: DeviceSource,
    ) -> Option<Rig> {
        let plane = Plane::own_or_skip(test).await?;
        // The extender runs as its service account with the manifests' RBAC.
        let manifest =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/optional/gpu/extender.yaml");
        let rbac: Vec<serde_json::Value> = yaml_documents(&manifest)
            .unwrap()
            .into_iter()
            .filter(|o| {
                ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
                    .contains(&o["kind"].as_str().unwrap_or_default())
            })
            .collect();
        plane.apply(&rbac, "tether-system").await.unwrap();
        let kube = plane
            .client_as_service_account("tether-system", "tether-extender")
            .await;
        let admin = plane.client().await;
        plane
            .apply(
                &[serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "ml"}})],
                "ml",
            )
            .await
            .unwrap();
        let api = KubeSide::Real(Box::new(RealApi {
            pods: Api::namespaced(admin.clone(), "ml"),
            nodes: Api::all(admin),
            _plane: plane,
            uids: Mutex::default(),
            bound: Mutex::default(),
        }));
        Some(Self::start_on(api, kube, wait, abandoned_wait_grace, devices).await)
    }

    /// A scenario on the fake API server (see the module doc for which).
    async fn start_on_fake(wait: Duration) -> Rig {
        let devices = DeviceSource::Fake(node_devices());
        let api = Arc::new(FakeApi::default());
        let api_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api_url = format!("http://{}", api_listener.local_addr().unwrap());
        let handler_api = api.clone();
        let api_routes =
            axum::Router::new().fallback(move |method: Method, uri: Uri, body: Bytes| {
                let api = handler_api.clone();
                async move { api.handle(method, uri, body).await }
            });
        tokio::spawn(tether_http::serve(
            api_listener,
            api_routes,
            std::future::pending(),
        ));
        let kube = kube::Client::try_from(kube::Config::new(api_url.parse().unwrap())).unwrap();
        Self::start_on(KubeSide::Fake(api), kube, wait, None, devices).await
    }

    async fn start_on(
        api: KubeSide,
        kube: kube::Client,
        wait: Duration,
        abandoned_wait_grace: Option<Duration>,
        devices: DeviceSource,
    ) -> Rig {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .try_init();
        let identities = Identities::new();
        let cluster = cluster_on_tls_with(&identities, move |config| {
            if let Some(grace) = abandoned_wait_grace {
                config.abandoned_wait_grace = grace;
            }
        })
        .await;
        let client = client_as(&cluster, &identities, "admin");
        api.add_node(NODE, Some("8")).await;
        api.add_node("gpu-node-2", Some("8")).await;
        let config = gpu_scheduling::extender_config(wait);
        let scheduler = client_as(&cluster, &identities, "scheduler");
        let extender = Arc::new(Extender::new(
            scheduler.clone(),
            DeviceLedger::new(scheduler, DEFAULT_LIFETIME),
            KubeBinder::new(kube),
            config,
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let extender_addr = listener.local_addr().unwrap();
        let extender_state = extender.clone();
        tokio::spawn(serve_extender(listener, extender, std::future::pending()));
        let dir = tempfile::tempdir().unwrap();
        // The kubelet knows fake devices from the start; real GPUs only
        // from the plugin's ListAndWatch.
        let seeded = match &devices {
            DeviceSource::Fake(ids) => ids.clone(),
            DeviceSource::Nvidia { .. } => Vec::new(),
        };
        let kubelet = FakeKubelet::start(dir.path(), RESOURCE, seeded);
        let plugin = start_plugin(&cluster, &identities, dir.path(), &devices, None);
        let rig = Rig {
            cluster,
            client,
            identities,
            api,
            kubelet,
            extender: extender_addr,
            extender_state,
            plugin: Some(plugin),
            devices,
            _dir: dir,
        };
        rig.wait_for("the plugin to register", async || {
            rig.kubelet.plugin_socket().is_some()
        })
        .await;
        rig
    }

    /// A one-container pod asking for `gpus`.
    async fn add_pod(&self, name: &str, gpus: u32) {
        self.api
            .add(pod_json(name, &[("main", gpus, Kind::App)]))
            .await;
    }

    /// The UID of the pod named `name`.
    fn uid(&self, name: &str) -> String {
        self.api.uid(name)
    }

    /// The name of the pod whose UID is `uid`.
    fn name_of(&self, uid: &str) -> String {
        match &self.api {
            KubeSide::Fake(_) => uid.trim_start_matches("uid-").to_string(),
            KubeSide::Real(api) => api
                .uids
                .lock()
                .unwrap()
                .iter()
                .find(|(_, u)| *u == uid)
                .map(|(n, _)| n.clone())
                .unwrap_or_else(|| uid.to_string()),
        }
    }

    /// kube-scheduler's bind call.
    async fn bind(&self, pod: &str) -> ExtenderBindingResult {
        self.bind_within(pod, DEADLINE)
            .await
            .expect("the extender answers")
    }

    /// kube-scheduler's bind call, given up after `timeout` (its
    /// `httpTimeout`): `None` if no answer came by then.
    async fn bind_within(&self, pod: &str, timeout: Duration) -> Option<ExtenderBindingResult> {
        let args = ExtenderBindingArgs {
            pod_name: pod.into(),
            pod_namespace: "ml".into(),
            pod_uid: self.uid(pod),
            node: NODE.into(),
        };
        let answer = self
            .post(
                "/scheduler/bind",
                &serde_json::to_value(&args).unwrap(),
                timeout,
            )
            .await?;
        Some(serde_json::from_value(answer).unwrap())
    }

    /// A POST of `body` to the extender, as kube-scheduler's HTTP client
    /// sends it; the connection is closed after `timeout` without an answer
    /// (`None`).
    async fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
        timeout: Duration,
    ) -> Option<serde_json::Value> {
        let body = serde_json::to_vec(body).unwrap();
        let call = async {
            let mut stream = TcpStream::connect(self.extender).await.unwrap();
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: extender\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            stream.write_all(&body).await.unwrap();
            let mut response = Vec::new();
            stream.read_to_end(&mut response).await.unwrap();
            let text = String::from_utf8(response).unwrap();
            let (_, json) = text.split_once("\r\n\r\n").unwrap();
            serde_json::from_str(json).unwrap()
        };
        tokio::time::timeout(timeout, call).await.ok()
    }

    /// The kubelet admits `pod` (as bound in the fake API).
    async fn admit(&self, pod: &str) -> Result<Admitted, tonic::Status> {
        self.kubelet.admit(&self.api.pod(pod).await, 7).await
    }

    async fn wait_for(&self, what: &str, mut check: impl AsyncFnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !check().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until the plugin's published device list names `count`
    /// devices.
    async fn wait_for_published(&self, what: &str, count: usize) {
        self.wait_for(what, async || {
            tether_embed::inventory::published_inventory(
                &self.client,
                tether_embed::inventory::INVENTORY_SET,
                NODE,
            )
            .await
            .unwrap()
            .is_some_and(|devices| devices.len() == count)
        })
        .await;
    }

    async fn waiters(&self) -> Vec<String> {
        let state = self.client.get(&key()).await.unwrap();
        state
            .waiters
            .iter()
            .map(|w| w.pod.clone().unwrap().name)
            .collect()
    }

    async fn holder(&self) -> Option<String> {
        self.client
            .holder(&key())
            .await
            .unwrap()
            .map(|h| h.pod.unwrap().name)
    }

    /// Device claims on the node: device -> pod uid.
    async fn claims(&self) -> BTreeMap<String, String> {
        DeviceLedger::new(self.client.clone(), DEFAULT_LIFETIME)
            .in_use(NODE)
            .await
            .unwrap()
    }

    /// What the bridge does when a pod ends, and the kubelet frees its
    /// devices.
    async fn end_pod(&self, pod: &str) {
        let uid = self.uid(pod);
        self.client.revoke_pod(&uid, "pod deleted").await.unwrap();
        self.kubelet.pod_ended(&uid);
    }

    async fn lock_history(&self) -> Vec<tether_client::proto::Event> {
        self.client
            .history("lock/gpu-bind/gpu-node-1", 0, 0)
            .await
            .unwrap()
            .events
    }

    async fn shutdown(self) {
        if let Some(plugin) = self.plugin {
            plugin.abort();
        }
        self.cluster.shutdown().await;
    }
}

/// The devices the answers gave, per container.
fn devices_of(admitted: &Admitted) -> Vec<(String, Vec<String>)> {
    admitted
        .iter()
        .map(|(name, answer)| {
            let mut ids: Vec<String> = answer.envs["TETHER_DEVICES"]
                .split(',')
                .map(str::to_string)
                .collect();
            ids.sort();
            let mut mounted: Vec<String> = answer
                .devices
                .iter()
                .map(|d| d.host_path.trim_start_matches("/dev/").to_string())
                .collect();
            mounted.sort();
            assert_eq!(ids, mounted, "container {name}: env and mounts disagree");
            (name.clone(), ids)
        })
        .collect()
}

fn bind_all(rig: &Arc<Rig>, pods: &[&str]) -> Vec<JoinHandle<ExtenderBindingResult>> {
    pods.iter()
        .map(|pod| {
            let (rig, pod) = (rig.clone(), pod.to_string());
            tokio::spawn(async move { rig.bind(&pod).await })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_one_gpu_pods_fill_an_eight_device_node_in_fifo_order_and_share_no_device() {
    let Some(rig) = Rig::start(
        "eight_one_gpu_pods_fill_an_eight_device_node_in_fifo_order_and_share_no_device",
    )
    .await
    else {
        return;
    };
    let rig = Arc::new(rig);
    let pods: Vec<String> = (0..8).map(|i| format!("train-{i}")).collect();
    for pod in &pods {
        rig.add_pod(pod, 1).await;
    }
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let binds = bind_all(&rig, &names);
    // Everyone is either holding or queued before the first Allocate.
    rig.wait_for("7 queued binds", async || rig.waiters().await.len() == 7)
        .await;
    let mut queue = vec![rig.holder().await.expect("one pod holds the node")];
    queue.extend(rig.waiters().await);

    let mut served = Vec::new();
    let mut devices_seen = BTreeMap::new();
    for k in 0..8 {
        rig.wait_for("the next bind", async || rig.api.bound().await.len() > k)
            .await;
        let bound = rig.api.bound().await[k].clone();
        let admitted = rig.admit(&bound).await.expect("the kubelet admits the pod");
        assert_eq!(admitted.len(), 1, "one container, one Allocate");
        let answer = &admitted[0].1;
        assert_eq!(
            answer.envs["TETHER_POD_UID"],
            rig.uid(&bound),
            "Allocate #{k} served a pod other than the one bound"
        );
        let (_, devices) = devices_of(&admitted).remove(0);
        for device in devices {
            if let Some(other) = devices_seen.insert(device.clone(), bound.clone()) {
                panic!("{device} given to both {other} and {bound}");
            }
        }
        served.push(bound);
    }
    for bind in binds {
        assert_eq!(bind.await.unwrap().error, "");
    }
    assert_eq!(served, queue, "served out of FIFO order");
    assert_eq!(devices_seen.len(), 8);
    assert_eq!(rig.holder().await, None);
    // The Tether accounting agrees with what the kubelet gave out.
    let claims = rig.claims().await;
    let claimed: BTreeMap<String, String> = claims
        .into_iter()
        .map(|(d, uid)| (d, rig.name_of(&uid)))
        .collect();
    assert_eq!(claimed, devices_seen);

    // A ninth pod finds the node full, with a reason, and takes no lock.
    rig.add_pod("late", 1).await;
    let refused = rig.bind("late").await;
    assert!(refused.error.contains("0 of 8 free"), "{}", refused.error);
    assert_eq!(rig.holder().await, None);
    // One pod ends: after its claim's lifetime the device is offered again.
    rig.end_pod("train-3").await;
    let freed = devices_seen
        .iter()
        .find(|(_, pod)| *pod == "train-3")
        .map(|(d, _)| d.clone())
        .unwrap();
    rig.wait_for("the ended pod's claim to go", async || {
        !rig.claims().await.contains_key(&freed)
    })
    .await;
    assert_eq!(rig.bind("late").await.error, "");
    let admitted = rig.admit("late").await.unwrap();
    assert_eq!(devices_of(&admitted), [("main".to_string(), vec![freed])]);
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_with_an_init_container_and_two_gpu_containers_gets_one_allocate_per_container() {
    let Some(rig) = Rig::start(
        "a_pod_with_an_init_container_and_two_gpu_containers_gets_one_allocate_per_container",
    )
    .await
    else {
        return;
    };
    // init asks for 1, main for 2, logger for 1, a CPU container for none:
    // the kubelet makes 3 calls, and main reuses the init container's
    // device.
    rig.api
        .add(pod_json(
            "multi",
            &[
                ("warm-up", 1, Kind::Init),
                ("main", 2, Kind::App),
                ("logger", 1, Kind::App),
                ("cpu-only", 0, Kind::App),
            ],
        ))
        .await;
    // A sidecar keeps the init container's device it reuses, so the app
    // container after it needs new ones.
    rig.api
        .add(pod_json(
            "sidecar",
            &[
                ("warm-up", 1, Kind::Init),
                ("proxy", 1, Kind::Sidecar),
                ("main", 1, Kind::App),
            ],
        ))
        .await;
    rig.add_pod("next", 1).await;
    assert_eq!(rig.bind("multi").await.error, "");
    let admitted = rig.admit("multi").await.expect("admitted");
    let per_container = devices_of(&admitted);
    let names: Vec<&str> = per_container.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["warm-up", "main", "logger"]);
    let init = &per_container[0].1;
    let main = &per_container[1].1;
    let logger = &per_container[2].1;
    assert_eq!((init.len(), main.len(), logger.len()), (1, 2, 1));
    assert!(
        main.contains(&init[0]),
        "main reuses the init container's device"
    );
    assert!(
        main.iter().all(|d| !logger.contains(d)),
        "app containers share no device: {main:?} {logger:?}"
    );
    // Every answer names the same pod; the hold ended after the last call.
    assert!(
        admitted
            .iter()
            .all(|(_, a)| a.envs["TETHER_POD_UID"] == rig.uid("multi"))
    );
    assert_eq!(rig.holder().await, None);
    let claimed: BTreeSet<String> = rig.claims().await.into_keys().collect();
    let given: BTreeSet<String> = main.iter().chain(logger).cloned().collect();
    assert_eq!(claimed, given, "the claim is the pod's devices (3 of them)");

    assert_eq!(rig.bind("sidecar").await.error, "");
    let admitted = rig.admit("sidecar").await.expect("admitted");
    let per_container = devices_of(&admitted);
    let (init, proxy, main) = (
        &per_container[0].1,
        &per_container[1].1,
        &per_container[2].1,
    );
    assert_eq!(
        proxy, init,
        "the sidecar reuses the init container's device"
    );
    assert!(!main.contains(&proxy[0]), "the sidecar keeps its device");
    assert_eq!(rig.holder().await, None);

    // The next pod is served a device no live pod has.
    assert_eq!(rig.bind("next").await.error, "");
    let admitted = rig.admit("next").await.unwrap();
    let (_, devices) = devices_of(&admitted).remove(0);
    let taken: BTreeSet<String> = given.iter().chain(proxy).chain(main).cloned().collect();
    assert!(!taken.contains(&devices[0]), "{devices:?} is taken");
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_the_scheduler_gave_up_on_is_retried_without_failing_anything() {
    // The bind wait (3 s) is below the scheduler's 5 s httpTimeout. On the
    // fake API server: its binding answers late on demand.
    let rig = Arc::new(Rig::start_on_fake(Duration::from_secs(3)).await);
    rig.add_pod("first", 1).await;
    rig.add_pod("second", 1).await;
    assert_eq!(rig.bind("first").await.error, "");
    // "second" queues behind the unallocated "first": the extender gives up
    // within its bind wait, before the scheduler's timeout, and frees the
    // claim it took.
    let started = Instant::now();
    let busy = rig
        .bind_within("second", Duration::from_secs(5))
        .await
        .expect("answered within the scheduler's 5 s");
    assert!(busy.error.contains("is busy"), "{}", busy.error);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        !rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("second"))
    );

    // A binding call slower than the scheduler's timeout: the scheduler
    // gives up, the extender finishes the bind; the scheduler's retry finds
    // the pod bound and says so, and nothing is released as failed.
    rig.admit("first").await.unwrap();
    rig.api
        .fake()
        .slow
        .lock()
        .unwrap()
        .insert("second".into(), Duration::from_secs(6));
    assert!(
        rig.bind_within("second", Duration::from_secs(5))
            .await
            .is_none(),
        "the scheduler times out"
    );
    rig.wait_for("the slow binding to land", async || {
        rig.api.bound().await.contains(&"second".to_string())
    })
    .await;
    let retried = rig.bind("second").await;
    assert_eq!(retried.error, "", "a retried bind of a bound pod succeeds");
    let admitted = rig.admit("second").await.unwrap();
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("second"));
    let failed: Vec<_> = rig
        .lock_history()
        .await
        .into_iter()
        .filter(|e| e.kind == "LockReleased" && e.reason.contains("Failed"))
        .collect();
    assert!(failed.is_empty(), "released as failed: {failed:?}");
    assert_eq!(rig.holder().await, None);
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_deleted_right_after_its_bind_does_not_block_the_node() {
    // HAMi #1271: the lock owner disappears; HAMi waits out a 5-minute expiry.
    let Some(rig) = Rig::start("a_pod_deleted_right_after_its_bind_does_not_block_the_node").await
    else {
        return;
    };
    let rig = Arc::new(rig);
    rig.add_pod("doomed", 1).await;
    rig.add_pod("next", 1).await;
    assert_eq!(rig.bind("doomed").await.error, "");
    let next = bind_all(&rig, &["next"]);
    rig.wait_for("the next bind to queue", async || {
        rig.waiters().await == ["next"]
    })
    .await;
    let revoked_at = Instant::now();
    // What the bridge sends when it sees the pod deleted.
    rig.end_pod("doomed").await;
    rig.wait_for("the next bind", async || {
        rig.api.bound().await.contains(&"next".to_string())
    })
    .await;
    let delay = rig.api.bound_at("next").await.unwrap() - revoked_at;
    println!(
        "HAMi #1271 reproduction: pod revoke -> next pod bound in {delay:?} (3 replicas on loopback, fsync on; HAMi: up to 5 min)"
    );
    assert!(delay < Duration::from_secs(10), "{delay:?}");
    assert_eq!(next.into_iter().next().unwrap().await.unwrap().error, "");
    let admitted = rig.admit("next").await.unwrap();
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("next"));
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_bind_releases_the_lock_and_the_claim_and_the_next_waiter_proceeds() {
    let Some(rig) =
        Rig::start("a_failed_bind_releases_the_lock_and_the_claim_and_the_next_waiter_proceeds")
            .await
    else {
        return;
    };
    let rig = Arc::new(rig);
    for pod in ["first", "bad", "good"] {
        rig.add_pod(pod, 1).await;
    }
    rig.api.doom("bad").await;
    assert_eq!(rig.bind("first").await.error, "");
    let bad = bind_all(&rig, &["bad"]);
    rig.wait_for("bad to queue", async || rig.waiters().await == ["bad"])
        .await;
    let good = bind_all(&rig, &["good"]);
    rig.wait_for("good to queue", async || {
        rig.waiters().await == ["bad", "good"]
    })
    .await;
    let admitted = rig.admit("first").await.unwrap();
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("first"));
    let bad = bad.into_iter().next().unwrap().await.unwrap();
    assert!(bad.error.contains("is being deleted"), "{}", bad.error);
    assert_eq!(good.into_iter().next().unwrap().await.unwrap().error, "");
    assert_eq!(rig.api.bound().await, ["first", "good"]);
    assert!(
        !rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("bad")),
        "the failed bind's claim is released"
    );
    let admitted = rig.admit("good").await.unwrap();
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("good"));
    let history = rig.lock_history().await;
    let bad_release = history
        .iter()
        .find(|e| e.kind == "LockReleased" && e.pod.as_ref().unwrap().uid == rig.uid("bad"))
        .unwrap();
    assert_eq!(bad_release.reason, "released (Failed)");
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_crashing_mid_allocate_fails_only_that_pod() {
    let Some(mut rig) = Rig::start("a_plugin_crashing_mid_allocate_fails_only_that_pod").await
    else {
        return;
    };
    rig.add_pod("victim", 1).await;
    rig.add_pod("next", 1).await;
    // Replace the plugin with one that "crashes" after reading the holder,
    // before releasing: it never gets further.
    rig.plugin.take().unwrap().abort();
    let reached = Arc::new(tokio::sync::Notify::new());
    let signal = reached.clone();
    let hook: BeforeRelease = Arc::new(move || {
        let signal = signal.clone();
        Box::pin(async move {
            signal.notify_one();
            std::future::pending::<()>().await;
        })
    });
    rig.plugin = Some(start_plugin(
        &rig.cluster,
        &rig.identities,
        rig._dir.path(),
        &rig.devices,
        Some(hook),
    ));
    assert_eq!(rig.bind("victim").await.error, "");
    let admission = tokio::time::timeout(Duration::from_secs(2), rig.admit("victim"));
    let (outcome, ()) = tokio::join!(admission, reached.notified());
    assert!(outcome.is_err(), "the crashed Allocate never answers");
    rig.plugin.take().unwrap().abort();
    assert_eq!(
        rig.holder().await.as_deref(),
        Some("victim"),
        "the hold survived the crash"
    );
    // The kubelet does not retry: the pod is Failed, the bridge reports it,
    // and the node is free for the next pod.
    rig.end_pod("victim").await;
    rig.plugin = Some(start_plugin(
        &rig.cluster,
        &rig.identities,
        rig._dir.path(),
        &rig.devices,
        None,
    ));
    assert_eq!(rig.bind("next").await.error, "");
    rig.wait_for("the plugin to serve again", async || {
        rig.kubelet.plugin_socket().is_some()
    })
    .await;
    let admitted = loop {
        match rig.admit("next").await {
            Ok(admitted) => break admitted,
            // The restarted plugin's socket may not be up yet.
            Err(status) if status.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(status) => panic!("{status}"),
        }
    };
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("next"));
    assert_eq!(rig.holder().await, None);
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_plugin_releases_with_the_same_token_on_a_new_leader() {
    let Some(mut rig) = Rig::start("the_plugin_releases_with_the_same_token_on_a_new_leader").await
    else {
        return;
    };
    rig.add_pod("survivor", 1).await;
    assert_eq!(rig.bind("survivor").await.error, "");
    let token = rig.client.holder(&key()).await.unwrap().unwrap().token;
    let leader = rig.cluster.wait_leader().await;
    rig.cluster.stop(leader).await;
    assert_ne!(rig.cluster.wait_leader().await, leader);
    let admitted = rig
        .admit("survivor")
        .await
        .expect("Allocate completes against the new leader");
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("survivor"));
    assert_eq!(admitted[0].1.envs["TETHER_LOCK_TOKEN"], token.to_string());
    assert_eq!(
        rig.holder().await,
        None,
        "released with the same token on the new leader"
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_lists_its_devices_to_the_kubelet() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = FakeKubelet::start(dir.path(), RESOURCE, node_devices());
    let client = Client::new(["127.0.0.1:1"], Options::default()).unwrap();
    let config = PluginConfig {
        node: NODE.into(),
        scope: "gpu-bind".into(),
        resource_name: RESOURCE.into(),
        claim_set: tether_embed::accounting::DEVICE_SET.into(),
        inventory_set: tether_embed::inventory::INVENTORY_SET.into(),
        devices: DeviceSource::Fake(vec!["gpu0".into(), "gpu1".into()]),
        pod_uid: "device-plugin-pod".into(),
        allocate_deadline: DEADLINE,
    };
    let placement = Placement {
        dir: dir.path().to_path_buf(),
        socket_name: "tether-gpu.sock".into(),
    };
    let plugin = tokio::spawn(run(
        Arc::new(GpuPlugin::new(client, config).unwrap()),
        placement,
        std::future::pending(),
    ));
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let socket = loop {
        if let Some(socket) = kubelet.plugin_socket() {
            break socket;
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut plugin_client = DevicePluginClient::new(
        tether_embed::device_plugin::unix_channel(socket)
            .await
            .unwrap(),
    );
    let options = plugin_client
        .get_device_plugin_options(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(options.get_preferred_allocation_available);
    let mut devices = plugin_client
        .list_and_watch(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    let first = devices.message().await.unwrap().unwrap();
    let ids: Vec<&str> = first.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["gpu0", "gpu1"]);
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));
    plugin.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_filter_verb_drops_nodes_without_enough_unclaimed_devices_with_a_reason() {
    let Some(rig) =
        Rig::start("the_filter_verb_drops_nodes_without_enough_unclaimed_devices_with_a_reason")
            .await
    else {
        return;
    };
    // Seven devices of gpu-node-1 claimed by live pods; gpu-node-2 free.
    let ledger = DeviceLedger::new(rig.client.clone(), DEFAULT_LIFETIME);
    for i in 0..7 {
        let claim = ledger
            .claim(
                NODE,
                tether_embed::accounting::ClaimOwner {
                    uid: &format!("uid-busy-{i}"),
                    namespace: "ml",
                    name: &format!("busy-{i}"),
                },
                &[format!("gpu{i}")],
            )
            .await
            .unwrap();
        assert!(
            matches!(claim, tether_embed::accounting::Claim::Held(_)),
            "{claim:?}"
        );
    }
    // Nodes with other device counts, read from their allocatable.
    rig.api.add_node("gpu-node-4", Some("4")).await;
    rig.api.add_node("cpu-node", None).await;
    // A count that is not an integer ("500m") the API server refuses to
    // store on a node, so the extender never reads one (its parsing of such
    // values is a unit test in src/extender/mod.rs).
    let KubeSide::Real(api) = &rig.api else {
        unreachable!("a real API server")
    };
    let odd: Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "odd-node"}})).unwrap();
    api.nodes
        .create(&PostParams::default(), &odd)
        .await
        .unwrap();
    let refused = api
        .nodes
        .patch_status(
            "odd-node",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"allocatable": {RESOURCE: "500m"}}})),
        )
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("must be an integer"),
        "{refused}"
    );
    let five = rig
        .post(
            "/scheduler/filter",
            &serde_json::json!({"Pod": pod_json("five", &[("main", 5, Kind::App)]),
                "NodeNames": ["gpu-node-4", "cpu-node", "gone-node", "gpu-node-2"]}),
            DEADLINE,
        )
        .await
        .unwrap();
    assert_eq!(
        five["NodeNames"],
        serde_json::json!(["gpu-node-2"]),
        "{five}"
    );
    let never = &five["FailedAndUnresolvableNodes"];
    let failed = &five["FailedNodes"];
    assert!(
        never["gpu-node-4"]
            .as_str()
            .unwrap()
            .contains("needs 5 tether.io/gpu devices; the node has 4"),
        "{five}"
    );
    assert!(
        never["cpu-node"]
            .as_str()
            .unwrap()
            .contains("the node has 0"),
        "{five}"
    );
    assert!(
        failed["gone-node"]
            .as_str()
            .unwrap()
            .contains("cannot read node gone-node"),
        "{five}"
    );
    // A bind that reaches a node too small anyway (kube-scheduler without
    // the filter verb) is refused, and keeps neither the lock nor a claim.
    rig.api
        .add(pod_json("five", &[("main", 5, Kind::App)]))
        .await;
    let args = ExtenderBindingArgs {
        pod_name: "five".into(),
        pod_namespace: "ml".into(),
        pod_uid: rig.uid("five"),
        node: "gpu-node-4".into(),
    };
    let refused = rig
        .post(
            "/scheduler/bind",
            &serde_json::to_value(&args).unwrap(),
            DEADLINE,
        )
        .await
        .unwrap();
    let error = refused["Error"].as_str().unwrap();
    assert!(
        error.contains("needs 5 tether.io/gpu devices; node gpu-node-4 has 4 allocatable"),
        "{refused}"
    );
    let small = LockKey {
        scope: "gpu-bind".into(),
        name: "gpu-node-4".into(),
    };
    assert!(rig.client.holder(&small).await.unwrap().is_none());
    assert!(ledger.claim_of(&rig.uid("five")).await.unwrap().is_none());
    assert!(rig.api.bound().await.is_empty());
    let filter = async |pod: serde_json::Value, names: bool| {
        let nodes = [NODE, "gpu-node-2"];
        let args = if names {
            serde_json::json!({"Pod": pod, "NodeNames": nodes})
        } else {
            let items: Vec<_> = nodes
                .iter()
                .map(|n| {
                    serde_json::json!({"metadata": {"name": n},
                        "status": {"allocatable": {RESOURCE: "8"}}})
                })
                .collect();
            serde_json::json!({"Pod": pod, "Nodes": {"metadata": {}, "items": items}})
        };
        rig.post("/scheduler/filter", &args, DEADLINE)
            .await
            .unwrap()
    };
    // The filter reads the extender's copy of the claims, which follows
    // Tether's events: wait until it has the seven made above.
    rig.wait_for(
        "the filter's copy of the claims to show seven",
        async || {
            let two = filter(pod_json("two", &[("main", 2, Kind::App)]), true).await;
            two["NodeNames"] == serde_json::json!(["gpu-node-2"])
        },
    )
    .await;
    // One GPU fits on both; two fit only on the free node, and the full
    // one says why; nine fit nowhere, ever.
    let one = filter(pod_json("one", &[("main", 1, Kind::App)]), true).await;
    assert_eq!(
        one["NodeNames"],
        serde_json::json!([NODE, "gpu-node-2"]),
        "{one}"
    );
    assert_eq!(one["Error"], "");
    let two = filter(pod_json("two", &[("main", 2, Kind::App)]), true).await;
    assert_eq!(two["NodeNames"], serde_json::json!(["gpu-node-2"]), "{two}");
    let why = two["FailedNodes"][NODE].as_str().unwrap();
    assert!(why.contains("2 devices needed, 1 of 8 free"), "{why}");
    let nine = filter(pod_json("nine", &[("main", 9, Kind::App)]), true).await;
    assert_eq!(nine["NodeNames"], serde_json::json!([]), "{nine}");
    assert_eq!(
        nine["FailedAndUnresolvableNodes"]
            .as_object()
            .unwrap()
            .len(),
        2,
        "{nine}"
    );
    // Node objects in, node objects out (a scheduler that is not
    // node-cache capable).
    let two = filter(pod_json("two", &[("main", 2, Kind::App)]), false).await;
    let kept: Vec<&str> = two["Nodes"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(kept, ["gpu-node-2"], "{two}");
    assert!(two.get("NodeNames").is_none());
    // A pod without GPUs is never filtered.
    let web = filter(pod_json("web", &[("main", 0, Kind::App)]), true).await;
    assert_eq!(web["NodeNames"], serde_json::json!([NODE, "gpu-node-2"]));
    // A malformed call gets an error, not a guess.
    let bad = rig
        .post(
            "/scheduler/filter",
            &serde_json::json!({"Pod": 7}),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(
        bad["Error"]
            .as_str()
            .unwrap()
            .contains("malformed ExtenderArgs"),
        "{bad}"
    );
    rig.shutdown().await;
}

/// The kubelet's accounting is the node's truth: when it gives a pod other
/// devices than the plan (the planned ones are taken in its eyes), the
/// pod's claim becomes what it gave, and a stale claim of another pod on
/// those devices loses them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kubelets_choice_of_devices_becomes_the_pods_claim() {
    let Some(rig) = Rig::start("the_kubelets_choice_of_devices_becomes_the_pods_claim").await
    else {
        return;
    };
    // gpu0..gpu5 the kubelet gave to a pod Tether never saw.
    rig.kubelet.occupy(
        "uid-outsider",
        &["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5"],
    );
    // A claim on gpu5 and gpu6 whose pod was never admitted with them.
    let ledger = DeviceLedger::new(rig.client.clone(), DEFAULT_LIFETIME);
    let stale = tether_embed::accounting::ClaimOwner {
        uid: "uid-stale",
        namespace: "ml",
        name: "stale",
    };
    let claim = ledger
        .claim(NODE, stale, &["gpu5".to_string(), "gpu6".to_string()])
        .await
        .unwrap();
    assert!(
        matches!(claim, tether_embed::accounting::Claim::Held(_)),
        "{claim:?}"
    );
    rig.add_pod("a", 2).await;
    assert_eq!(rig.bind("a").await.error, "");
    let planned: Vec<String> = rig
        .claims()
        .await
        .into_iter()
        .filter(|(_, uid)| *uid == rig.uid("a"))
        .map(|(device, _)| device)
        .collect();
    assert_eq!(
        planned,
        ["gpu0", "gpu1"],
        "the extender planned what Tether saw free"
    );
    let admitted = rig.admit("a").await.expect("admitted");
    assert_eq!(
        devices_of(&admitted),
        [(
            "main".to_string(),
            vec!["gpu6".to_string(), "gpu7".to_string()]
        )],
        "the container gets what the kubelet chose"
    );
    let claims = rig.claims().await;
    let a = rig.uid("a");
    let expected: BTreeMap<String, String> = [
        ("gpu5", "uid-stale"),
        ("gpu6", a.as_str()),
        ("gpu7", a.as_str()),
    ]
    .into_iter()
    .map(|(d, u)| (d.to_string(), u.to_string()))
    .collect();
    assert_eq!(claims, expected, "the claims follow the kubelet");
    assert_eq!(
        rig.holder().await,
        None,
        "the pod's hold was released after"
    );
    let metrics = rig.plugin.as_ref().unwrap().service.metrics().render();
    assert!(
        metrics.contains("tether_device_plugin_claim_corrections_total 1\n"),
        "{metrics}"
    );
    rig.shutdown().await;
}

/// A claim left by an earlier bind of a pod (the bind did not finish and
/// its claim was not ended) that another pod's claim correction then
/// shrank: the pod's next bind to the node ends it and claims afresh,
/// rather than failing every time on the short claim (issue 53).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_remakes_the_pods_own_claim_that_another_correction_shrank() {
    let Some(rig) =
        Rig::start("a_bind_remakes_the_pods_own_claim_that_another_correction_shrank").await
    else {
        return;
    };
    rig.add_pod("b", 2).await;
    rig.add_pod("a", 1).await;
    let ledger = DeviceLedger::new(rig.client.clone(), DEFAULT_LIFETIME);
    let (a, b) = (rig.uid("a"), rig.uid("b"));
    let owner = |uid| tether_embed::accounting::ClaimOwner {
        uid,
        namespace: "ml",
        name: "x",
    };
    ledger
        .claim(NODE, owner(&b), &["gpu6".to_string(), "gpu7".to_string()])
        .await
        .unwrap();
    ledger
        .correct(NODE, owner(&a), &["gpu7".to_string()])
        .await
        .unwrap();
    assert_eq!(ledger.claim_of(&b).await.unwrap().unwrap().1, ["gpu6"]);
    let result = rig.bind("b").await;
    assert_eq!(result.error, "", "the short claim failed the bind");
    let (node, devices) = ledger.claim_of(&b).await.unwrap().unwrap();
    assert_eq!((node.as_str(), devices.len()), (NODE, 2), "{devices:?}");
    assert!(!devices.contains(&"gpu7".to_string()), "{devices:?}");
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_whose_scheduler_went_away_leaves_the_queue_and_keeps_nothing() {
    // A bind wait far longer than the scheduler's timeout (a
    // misconfiguration the extender must survive), and than this test's
    // waits: only noticing the scheduler leave ends the wait in time.
    let Some(rig) = Rig::start_with_wait(
        "a_bind_whose_scheduler_went_away_leaves_the_queue_and_keeps_nothing",
        DEADLINE * 5,
    )
    .await
    else {
        return;
    };
    rig.add_pod("first", 1).await;
    rig.add_pod("second", 1).await;
    assert_eq!(rig.bind("first").await.error, "");
    let gave_up = rig.bind_within("second", Duration::from_secs(2)).await;
    assert!(gave_up.is_none(), "the scheduler's call timed out");
    rig.wait_for("second to leave the queue", async || {
        rig.waiters().await.is_empty()
    })
    .await;
    assert_eq!(rig.holder().await.as_deref(), Some("first"));
    rig.admit("first").await.unwrap();
    assert_eq!(
        rig.holder().await,
        None,
        "the abandoned bind was not granted"
    );
    assert!(
        !rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("second"))
    );
    assert!(!rig.api.bound().await.contains(&"second".to_string()));
    // The scheduler schedules the pod again.
    assert_eq!(rig.bind("second").await.error, "");
    let admitted = rig.admit("second").await.unwrap();
    assert_eq!(admitted[0].1.envs["TETHER_POD_UID"], rig.uid("second"));
    rig.shutdown().await;
}

/// The scheduler gives up on a bind (its `httpTimeout`) and the node's
/// holder releases right after: the extender withdraws the bind's acquire
/// in one command, so the lock goes to the next pod, not to the pod nobody
/// binds. The replicas' abandoned-wait grace is set longer than this test's
/// deadline, so only the extender's withdrawal can free the node in time
/// (before it, the grant that raced the departure kept the node for the
/// hold timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_abandoned_just_before_the_holder_releases_gives_the_node_to_the_next_pod() {
    let Some(rig) = Rig::start_with_grace(
        "a_bind_abandoned_just_before_the_holder_releases_gives_the_node_to_the_next_pod",
        DEADLINE * 5,
        Some(DEADLINE * 10),
    )
    .await
    else {
        return;
    };
    rig.add_pod("first", 1).await;
    rig.add_pod("second", 1).await;
    rig.add_pod("third", 1).await;
    assert_eq!(rig.bind("first").await.error, "");
    let gave_up = rig.bind_within("second", Duration::from_secs(2)).await;
    assert!(gave_up.is_none(), "the scheduler's call timed out");
    // The holder releases at once; the third pod's bind queues.
    rig.admit("first").await.unwrap();
    let third = rig.bind("third").await;
    assert_eq!(third.error, "", "the next pod is bound");
    assert_eq!(rig.holder().await.as_deref(), Some("third"));
    assert!(
        !rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("second")),
        "the abandoned bind claimed devices"
    );
    assert!(!rig.api.bound().await.contains(&"second".to_string()));
    rig.shutdown().await;
}

/// The plugin on a host root shaped like an eight-GPU node
/// (`tests/fixtures/nvidia/eight-gpus`, GPUs on NUMA nodes 0 and 1): the
/// kubelet learns the GPUs by UUID from `ListAndWatch`, the extender
/// plans on the UUIDs the plugin published, and each container gets
/// exactly its GPUs as CDI names, `NVIDIA_VISIBLE_DEVICES` and device
/// nodes. A GPU that falls off the bus turns unhealthy for the kubelet
/// and the extender alike, and no later pod is planned or given it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nvidia_gpus_are_planned_and_handed_over_by_uuid_and_a_lost_one_goes_to_no_pod() {
    use fixtures::{fall_off_the_bus, nvidia_node, uuid};
    use tether_embed::inventory::{INVENTORY_SET, published_inventory};
    let host = nvidia_node("eight-gpus");
    let Some(rig) = Rig::start_real(
        "nvidia_gpus_are_planned_and_handed_over_by_uuid_and_a_lost_one_goes_to_no_pod",
        DEADLINE,
        None,
        DeviceSource::Nvidia {
            host_root: host.path().to_path_buf(),
            rescan: Duration::from_millis(100),
        },
    )
    .await
    else {
        return;
    };
    let all: BTreeSet<String> = (0..8).map(uuid).collect();
    rig.wait_for("the kubelet to list the eight GPUs", async || {
        let listed = rig.kubelet.devices();
        listed.iter().all(|(_, healthy)| *healthy)
            && listed
                .iter()
                .map(|(id, _)| id.clone())
                .collect::<BTreeSet<_>>()
                == all
    })
    .await;
    rig.wait_for_published("the plugin to publish the GPUs", 8)
        .await;
    let published = published_inventory(&rig.client, INVENTORY_SET, NODE)
        .await
        .unwrap()
        .unwrap();
    for device in &published {
        let minor = (0..8).find(|m| uuid(*m) == device.id).unwrap();
        assert!(device.healthy);
        assert_eq!(device.numa_node, Some(minor / 4), "{}", device.id);
    }

    // A two-GPU pod: planned on two UUIDs, handed exactly those.
    rig.add_pod("train-a", 2).await;
    assert_eq!(rig.bind("train-a").await.error, "");
    let claimed: BTreeSet<String> = rig.claims().await.into_keys().collect();
    assert_eq!(claimed.len(), 2);
    assert!(claimed.is_subset(&all), "claims name UUIDs: {claimed:?}");
    let numa: BTreeSet<Option<u32>> = published
        .iter()
        .filter(|d| claimed.contains(&d.id))
        .map(|d| d.numa_node)
        .collect();
    assert_eq!(numa.len(), 1, "both GPUs on one NUMA node: {claimed:?}");
    let admitted = rig.admit("train-a").await.unwrap();
    assert_eq!(admitted.len(), 1);
    let answer = &admitted[0].1;
    let given: BTreeSet<String> = answer.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(str::to_string)
        .collect();
    assert_eq!(given, claimed, "the kubelet was steered to the plan");
    let cdi: BTreeSet<String> = answer.cdi_devices.iter().map(|d| d.name.clone()).collect();
    assert_eq!(
        cdi,
        claimed
            .iter()
            .map(|u| format!("nvidia.com/gpu={u}"))
            .collect::<BTreeSet<_>>()
    );
    let nodes: BTreeSet<String> = answer.devices.iter().map(|d| d.host_path.clone()).collect();
    let minors = (0..8).filter(|m| claimed.contains(&uuid(*m)));
    let wanted: BTreeSet<String> = minors
        .map(|m| format!("/dev/nvidia{m}"))
        .chain(["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"].map(String::from))
        .collect();
    assert_eq!(nodes, wanted);
    rig.wait_for("the hold to be released", async || {
        rig.holder().await.is_none()
    })
    .await;

    // An unclaimed GPU falls off the bus.
    let lost = (0..8).find(|m| !claimed.contains(&uuid(*m))).unwrap();
    fall_off_the_bus(
        host.path(),
        &format!("0000:{:02x}:00.0", 0x18 + lost * 0x10),
    );
    rig.wait_for("the kubelet to see the lost GPU unhealthy", async || {
        rig.kubelet
            .devices()
            .iter()
            .any(|(id, healthy)| *id == uuid(lost) && !healthy)
    })
    .await;
    assert_eq!(
        rig.kubelet.allocatable(),
        7,
        "the kubelet counts it no more"
    );
    let metrics = rig.plugin.as_ref().unwrap().service.metrics().render();
    for line in [
        "tether_device_plugin_devices{health=\"healthy\"} 7",
        "tether_device_plugin_devices{health=\"unhealthy\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    rig.wait_for("the plugin to publish it unhealthy", async || {
        published_inventory(&rig.client, INVENTORY_SET, NODE)
            .await
            .unwrap()
            .is_some_and(|devices| devices.iter().any(|d| d.id == uuid(lost) && !d.healthy))
    })
    .await;
    // Five healthy GPUs are free: a six-GPU pod no longer fits (once the
    // filter's copy, which follows Tether's events, has the new list), a
    // five-GPU pod gets exactly the five, never the lost one.
    rig.wait_for("the filter to leave out the lost GPU", async || {
        let six = rig
            .post(
                "/scheduler/filter",
                &serde_json::json!({"Pod": pod_json("six", &[("main", 6, Kind::App)]),
                    "NodeNames": [NODE]}),
                DEADLINE,
            )
            .await
            .unwrap();
        six["NodeNames"] == serde_json::json!([])
    })
    .await;
    rig.add_pod("train-b", 5).await;
    assert_eq!(rig.bind("train-b").await.error, "");
    let admitted = rig.admit("train-b").await.unwrap();
    let given: BTreeSet<String> = admitted[0].1.envs["NVIDIA_VISIBLE_DEVICES"]
        .split(',')
        .map(str::to_string)
        .collect();
    let free: BTreeSet<String> = all
        .iter()
        .filter(|u| !claimed.contains(*u) && **u != uuid(lost))
        .cloned()
        .collect();
    assert_eq!(given, free);
    rig.shutdown().await;
}

/// The plugin's socket deleted in the moment between the kubelet's answer
/// to a registration and the plugin's next look at its socket: the plugin
/// still sees it gone and serves and registers again (it once read which
/// file was its own only after registering, saw none, and took "none" for
/// its own from then on).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_socket_deleted_while_registering_is_served_again() {
    let rig = Rig::start_on_fake(DEADLINE).await;
    rig.wait_for("the kubelet to follow ListAndWatch", async || {
        rig.kubelet.device_updates() > 0
    })
    .await;
    rig.kubelet.delete_socket_on_next_register();
    std::fs::remove_file(rig.kubelet.plugin_socket().unwrap()).unwrap();
    rig.wait_for("the plugin to register twice more", async || {
        rig.kubelet.registered() == 3 && rig.kubelet.plugin_socket().is_some()
    })
    .await;
    rig.wait_for("the kubelet to follow the newest server", async || {
        rig.kubelet.allocatable() == 8 && rig.kubelet.device_updates() > 1
    })
    .await;
    rig.shutdown().await;
}

/// The node's published devices released by hand (or ended because Tether
/// counted the plugin's pod stopped): the plugin publishes them again
/// within its check period, so the extender keeps planning real ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn published_devices_that_vanish_are_published_again() {
    use tether_embed::device_plugin::PUBLISHED_CHECK_EVERY;
    use tether_embed::inventory::{INVENTORY_SET, inventory_key, published_inventory};
    let rig = Rig::start_on_fake(DEADLINE).await;
    rig.wait_for("the plugin to publish its devices", async || {
        published_inventory(&rig.client, INVENTORY_SET, NODE)
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let released = rig
        .client
        .release_pin(&inventory_key(INVENTORY_SET, NODE), "by hand")
        .await
        .unwrap();
    assert!(released.is_some());
    let gone_at = Instant::now();
    rig.wait_for_published("the plugin to publish them again", 8)
        .await;
    let after = gone_at.elapsed();
    println!("published again {after:?} after the release");
    assert!(after <= PUBLISHED_CHECK_EVERY * 2, "{after:?}");
    rig.shutdown().await;
}

/// Issue 62 case 3 through the extender on the real API server: the node
/// is deleted and created again under its name while the bridge is away
/// (here the test reports nodes to Tether as the bridge would, and
/// reports nothing while "away"). A bind to the new machine names the new
/// object, as the extender's node watch sees it, and is refused while
/// Tether has the old one registered, taking nothing; once the old object
/// is reported gone and the new one joined, the bind goes through, and a
/// late report that the old object is gone ends neither its hold nor its
/// claim. Before, the bind took both under the old object's registration,
/// and the old object's `Gone` ended them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bind_to_a_node_recreated_while_the_bridge_was_away_is_taken_for_the_new_object() {
    let Some(rig) = Rig::start(
        "a_bind_to_a_node_recreated_while_the_bridge_was_away_is_taken_for_the_new_object",
    )
    .await
    else {
        return;
    };
    let KubeSide::Real(api) = &rig.api else {
        unreachable!("a real API server")
    };
    let report = async |uid: &str, state: tether_client::proto::NodeState| {
        rig.client
            .report_node(tether_client::proto::ReportNodeRequest {
                name: NODE.into(),
                uid: uid.into(),
                state: state as i32,
                ..Default::default()
            })
            .await
            .unwrap()
    };
    let objects = rig.extender_state.node_objects();
    let uid_of = async || api.nodes.get(NODE).await.unwrap().metadata.uid.unwrap();
    let old_uid = uid_of().await;
    report(&old_uid, tether_client::proto::NodeState::NodeReady).await;
    rig.wait_for("the extender's watch to see the node", async || {
        objects.uid_of(NODE) == old_uid
    })
    .await;
    rig.add_pod("before", 1).await;
    assert_eq!(rig.bind("before").await.error, "");

    // Re-created while the bridge is away.
    api.nodes.delete(NODE, &Default::default()).await.unwrap();
    rig.wait_for("the old node object deleted", async || {
        api.nodes.get_opt(NODE).await.unwrap().is_none()
    })
    .await;
    rig.api.add_node(NODE, Some("8")).await;
    let new_uid = uid_of().await;
    rig.wait_for("the extender's watch to see the new object", async || {
        objects.uid_of(NODE) == new_uid
    })
    .await;
    rig.add_pod("after", 1).await;
    let refused = rig.bind("after").await.error;
    assert!(
        refused.contains(&old_uid) && refused.contains(&new_uid),
        "{refused}"
    );
    assert!(
        !rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("after")),
        "nothing claimed for the refused bind"
    );
    assert_ne!(rig.holder().await.as_deref(), Some("after"));

    // The bridge back: the old object gone (what it held ends), the new one
    // joined; the scheduler's retry binds.
    report(&old_uid, tether_client::proto::NodeState::NodeGone).await;
    report(&new_uid, tether_client::proto::NodeState::NodeReady).await;
    assert_eq!(rig.bind("after").await.error, "");
    assert_eq!(rig.holder().await.as_deref(), Some("after"));
    let claimed: Vec<String> = rig
        .claims()
        .await
        .into_iter()
        .filter(|(_, uid)| *uid == rig.uid("after"))
        .map(|(device, _)| device)
        .collect();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    // A lagging reporter's delete of the old object changes nothing.
    let late = report(&old_uid, tether_client::proto::NodeState::NodeGone).await;
    assert!(!late.changed, "{late:?}");
    assert_eq!(rig.holder().await.as_deref(), Some("after"));
    assert!(
        rig.claims()
            .await
            .values()
            .any(|uid| *uid == rig.uid("after"))
    );
}
