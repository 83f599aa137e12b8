//! End to end: a 3-replica Tether, the scheduler extender (binding through a
//! fake Kubernetes API over HTTP), and the device plugin on a unix socket,
//! with `Allocate` driven as the kubelet drives it.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_client::http::{HttpRequest, HttpResponse, serve};
use tether_client::proto::LockKey;
use tether_client::{Client, Options};
use tether_embed::device_plugin::{
    BeforeRelease, GpuPlugin, PluginConfig, register, serve_on_socket, unix_channel,
};
use tether_embed::extender::{
    Extender, ExtenderBindingArgs, ExtenderBindingResult, ExtenderConfig, KubeBinder,
    serve_extender,
};
use tether_embed::plan::Planner;
use tether_embed::v1beta1 as api;
use tether_embed::v1beta1::device_plugin_client::DevicePluginClient;
use tether_server::testing::{Cluster, DEADLINE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const NODE: &str = "gpu-node-1";

fn planner() -> Planner {
    Planner {
        device_prefix: "gpu".into(),
        devices_per_node: 8,
        per_pod: 2,
    }
}

fn key() -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: NODE.into(),
    }
}

/// A fake Kubernetes API that accepts `pods/binding` POSTs, records them in
/// order, and refuses pods listed in `fail`.
#[derive(Default)]
struct FakeApi {
    bindings: Mutex<Vec<(String, String, Instant)>>,
    fail: Mutex<BTreeSet<String>>,
}

impl FakeApi {
    fn handle(&self, request: HttpRequest) -> HttpResponse {
        // /api/v1/namespaces/{ns}/pods/{name}/binding
        let parts: Vec<&str> = request
            .path
            .split('?')
            .next()
            .unwrap_or("")
            .split('/')
            .collect();
        if request.method != "POST" || parts.len() != 8 || parts[7] != "binding" {
            return HttpResponse {
                status: "404 Not Found",
                content_type: "application/json",
                body: b"{}".to_vec(),
            };
        }
        let name = parts[6].to_string();
        let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let node = body["target"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if self.fail.lock().unwrap().contains(&name) {
            let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": format!("pod {name} is being deleted"), "reason": "Conflict", "code": 409});
            return HttpResponse {
                status: "409 Conflict",
                content_type: "application/json",
                body: status.to_string().into_bytes(),
            };
        }
        self.bindings
            .lock()
            .unwrap()
            .push((name, node, Instant::now()));
        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201});
        HttpResponse {
            status: "201 Created",
            content_type: "application/json",
            body: status.to_string().into_bytes(),
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
}

/// Everything one scenario needs.
struct Rig {
    cluster: Cluster,
    client: Client,
    api: Arc<FakeApi>,
    extender: std::net::SocketAddr,
    socket: PathBuf,
    plugin: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

fn client_of(cluster: &Cluster) -> Client {
    Client::new(
        cluster.endpoints(),
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap()
}

fn start_plugin(
    cluster: &Cluster,
    socket: &std::path::Path,
    hook: Option<BeforeRelease>,
) -> JoinHandle<()> {
    let config = PluginConfig {
        node: NODE.into(),
        scope: "gpu-bind".into(),
        resource_name: "tether.io/gpu".into(),
        devices: (0..8).map(|i| format!("gpu{i}")).collect(),
    };
    let mut plugin = GpuPlugin::new(client_of(cluster), config);
    if let Some(hook) = hook {
        plugin = plugin.with_before_release(hook);
    }
    let socket = socket.to_path_buf();
    tokio::spawn(async move {
        serve_on_socket(plugin, &socket, std::future::pending())
            .await
            .unwrap()
    })
}

impl Rig {
    async fn start() -> Rig {
        let cluster = Cluster::start(3).await;
        let client = client_of(&cluster);
        let api = Arc::new(FakeApi::default());
        let api_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api_url = format!("http://{}", api_listener.local_addr().unwrap());
        let handler_api = api.clone();
        tokio::spawn(serve(
            api_listener,
            Arc::new(move |r| {
                let api = handler_api.clone();
                async move { api.handle(r) }
            }),
            std::future::pending(),
        ));
        let kube = kube::Client::try_from(kube::Config::new(api_url.parse().unwrap())).unwrap();
        let config = ExtenderConfig {
            scope: "gpu-bind".into(),
            wait: DEADLINE,
            planner: planner(),
        };
        let extender = Arc::new(Extender::new(
            client_of(&cluster),
            KubeBinder::new(kube),
            config,
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let extender_addr = listener.local_addr().unwrap();
        tokio::spawn(serve_extender(listener, extender, std::future::pending()));
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("tether-gpu.sock");
        let plugin = start_plugin(&cluster, &socket, None);
        let rig = Rig {
            cluster,
            client,
            api,
            extender: extender_addr,
            socket,
            plugin: Some(plugin),
            _dir: dir,
        };
        rig.wait_for("the plugin socket", async || rig.socket.exists())
            .await;
        rig
    }

    /// kube-scheduler's bind call.
    async fn bind(&self, pod: &str) -> ExtenderBindingResult {
        let args = ExtenderBindingArgs {
            pod_name: pod.into(),
            pod_namespace: "ml".into(),
            pod_uid: format!("uid-{pod}"),
            node: NODE.into(),
        };
        let body = serde_json::to_vec(&args).unwrap();
        let mut stream = TcpStream::connect(self.extender).await.unwrap();
        let head = format!(
            "POST /scheduler/bind HTTP/1.1\r\nHost: extender\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&body).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let text = String::from_utf8(response).unwrap();
        let (_, json) = text.split_once("\r\n\r\n").unwrap();
        serde_json::from_str(json).unwrap()
    }

    /// The kubelet's Allocate call (device ids only, no pod identity).
    async fn allocate(&self) -> Result<api::ContainerAllocateResponse, tonic::Status> {
        let channel = unix_channel(self.socket.clone())
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let request = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: vec!["gpu0".into()],
            }],
        };
        let response = DevicePluginClient::new(channel)
            .allocate(request)
            .await?
            .into_inner();
        Ok(response
            .container_responses
            .into_iter()
            .next()
            .expect("one container"))
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

    async fn shutdown(self) {
        if let Some(plugin) = self.plugin {
            plugin.abort();
        }
        self.cluster.shutdown().await;
    }
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
async fn fifty_pods_binding_to_one_node_are_each_allocated_their_own_plan_in_fifo_order() {
    let rig = Arc::new(Rig::start().await);
    let pods: Vec<String> = (0..50).map(|i| format!("train-{i}")).collect();
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let binds = bind_all(&rig, &names);
    // Everyone is either holding or queued before the first Allocate.
    rig.wait_for("49 queued binds", async || rig.waiters().await.len() == 49)
        .await;
    let mut queue = vec![rig.holder().await.expect("one pod holds the node")];
    queue.extend(rig.waiters().await);

    let mut served = Vec::new();
    for k in 0..50 {
        rig.wait_for("the next bind", async || rig.api.bound().len() > k)
            .await;
        let bound = rig.api.bound()[k].clone();
        let container = rig.allocate().await.expect("Allocate serves the holder");
        let pod_uid = &container.envs["TETHER_POD_UID"];
        assert_eq!(
            pod_uid,
            &format!("uid-{bound}"),
            "Allocate #{k} served a pod other than the one bound"
        );
        let plan = planner().plan(pod_uid, "ml", &bound);
        assert_eq!(
            container.envs["TETHER_DEVICES"],
            plan.devices.join(","),
            "device plan swapped for {bound}"
        );
        served.push(bound);
    }
    for bind in binds {
        assert_eq!(bind.await.unwrap().error, "");
    }
    assert_eq!(served, queue, "served out of FIFO order");
    assert_eq!(
        served.iter().collect::<BTreeSet<_>>().len(),
        50,
        "a pod was served twice"
    );
    assert_eq!(rig.holder().await, None);
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_deleted_right_after_its_bind_does_not_block_the_node() {
    // HAMi #1271: the lock owner disappears; HAMi waits out a 5-minute expiry.
    let rig = Arc::new(Rig::start().await);
    assert_eq!(rig.bind("doomed").await.error, "");
    let next = bind_all(&rig, &["next"]);
    rig.wait_for("the next bind to queue", async || {
        rig.waiters().await == ["next"]
    })
    .await;
    let revoked_at = Instant::now();
    // What the bridge sends when it sees the pod deleted.
    rig.client
        .revoke_pod("uid-doomed", "pod deleted")
        .await
        .unwrap();
    rig.wait_for("the next bind", async || {
        rig.api.bound().contains(&"next".to_string())
    })
    .await;
    let delay = rig.api.bindings.lock().unwrap().last().unwrap().2 - revoked_at;
    println!(
        "HAMi #1271 reproduction: pod revoke -> next pod bound in {delay:?} (3 replicas on loopback, fsync on; HAMi: up to 5 min)"
    );
    assert!(delay < Duration::from_secs(10), "{delay:?}");
    assert_eq!(next.into_iter().next().unwrap().await.unwrap().error, "");
    assert_eq!(
        rig.allocate().await.unwrap().envs["TETHER_POD_UID"],
        "uid-next"
    );
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_bind_releases_the_lock_and_the_next_waiter_proceeds() {
    let rig = Arc::new(Rig::start().await);
    rig.api.fail.lock().unwrap().insert("bad".into());
    assert_eq!(rig.bind("first").await.error, "");
    let bad = bind_all(&rig, &["bad"]);
    rig.wait_for("bad to queue", async || rig.waiters().await == ["bad"])
        .await;
    let good = bind_all(&rig, &["good"]);
    rig.wait_for("good to queue", async || {
        rig.waiters().await == ["bad", "good"]
    })
    .await;
    assert_eq!(
        rig.allocate().await.unwrap().envs["TETHER_POD_UID"],
        "uid-first"
    );
    let bad = bad.into_iter().next().unwrap().await.unwrap();
    assert!(bad.error.contains("is being deleted"), "{}", bad.error);
    assert_eq!(good.into_iter().next().unwrap().await.unwrap().error, "");
    assert_eq!(rig.api.bound(), ["first", "good"]);
    assert_eq!(
        rig.allocate().await.unwrap().envs["TETHER_POD_UID"],
        "uid-good"
    );
    let history = rig
        .client
        .history("lock/gpu-bind/gpu-node-1", 0, 0)
        .await
        .unwrap();
    let bad_release = history
        .events
        .iter()
        .find(|e| e.kind == "LockReleased" && e.pod.as_ref().unwrap().uid == "uid-bad")
        .unwrap();
    assert_eq!(bad_release.reason, "released (Failed)");
    Arc::into_inner(rig).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn allocate_with_no_holder_is_refused_instead_of_guessing() {
    let rig = Rig::start().await;
    let err = rig.allocate().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("refusing to guess"),
        "{}",
        err.message()
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_device_plugin_crashing_mid_allocate_is_retried_and_releases_exactly_once() {
    let mut rig = Rig::start().await;
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
    rig.plugin = Some(start_plugin(&rig.cluster, &rig.socket, Some(hook)));
    assert_eq!(rig.bind("victim").await.error, "");
    let token = rig.client.holder(&key()).await.unwrap().unwrap().token;

    let first_try = tokio::time::timeout(Duration::from_secs(2), rig.allocate());
    let (outcome, ()) = tokio::join!(first_try, reached.notified());
    assert!(
        outcome.is_err(),
        "the crashed Allocate never answers; the kubelet times out"
    );
    rig.plugin.take().unwrap().abort();
    assert_eq!(
        rig.holder().await.as_deref(),
        Some("victim"),
        "the hold survived the crash"
    );

    // The plugin restarts; the kubelet retries Allocate.
    rig.plugin = Some(start_plugin(&rig.cluster, &rig.socket, None));
    let container = loop {
        match rig.allocate().await {
            Ok(container) => break container,
            Err(status) if status.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(status) => panic!("{status}"),
        }
    };
    assert_eq!(container.envs["TETHER_POD_UID"], "uid-victim");
    assert_eq!(container.envs["TETHER_LOCK_TOKEN"], token.to_string());
    assert_eq!(rig.holder().await, None);
    let history = rig
        .client
        .history("lock/gpu-bind/gpu-node-1", 0, 0)
        .await
        .unwrap();
    let releases = history
        .events
        .iter()
        .filter(|e| e.kind == "LockReleased" && e.token == token)
        .count();
    assert_eq!(releases, 1, "released exactly once");
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_plugin_releases_with_the_same_token_on_a_new_leader() {
    let mut rig = Rig::start().await;
    assert_eq!(rig.bind("survivor").await.error, "");
    let token = rig.client.holder(&key()).await.unwrap().unwrap().token;
    let leader = rig.cluster.wait_leader().await;
    rig.cluster.stop(leader).await;
    assert_ne!(rig.cluster.wait_leader().await, leader);
    let container = rig
        .allocate()
        .await
        .expect("Allocate completes against the new leader");
    assert_eq!(container.envs["TETHER_POD_UID"], "uid-survivor");
    assert_eq!(container.envs["TETHER_LOCK_TOKEN"], token.to_string());
    assert_eq!(
        rig.holder().await,
        None,
        "released with the same token on the new leader"
    );
    rig.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_registers_with_the_kubelet_and_lists_its_devices() {
    use api::registration_server::{Registration, RegistrationServer};
    struct FakeKubelet(Arc<Mutex<Vec<api::RegisterRequest>>>);
    #[tonic::async_trait]
    impl Registration for FakeKubelet {
        async fn register(
            &self,
            request: tonic::Request<api::RegisterRequest>,
        ) -> Result<tonic::Response<api::Empty>, tonic::Status> {
            self.0.lock().unwrap().push(request.into_inner());
            Ok(tonic::Response::new(api::Empty {}))
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let kubelet_socket = dir.path().join("kubelet.sock");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::UnixListener::bind(&kubelet_socket).unwrap();
    let kubelet = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(FakeKubelet(seen.clone())))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener));
    let kubelet = tokio::spawn(kubelet);
    register(&kubelet_socket, "tether-gpu.sock", "tether.io/gpu")
        .await
        .unwrap();
    let request = seen.lock().unwrap()[0].clone();
    assert_eq!(
        (
            request.version.as_str(),
            request.endpoint.as_str(),
            request.resource_name.as_str()
        ),
        ("v1beta1", "tether-gpu.sock", "tether.io/gpu")
    );
    kubelet.abort();

    // ListAndWatch, as the kubelet opens it after registration.
    let client = Client::new(["127.0.0.1:1"], Options::default()).unwrap();
    let config = PluginConfig {
        node: NODE.into(),
        scope: "gpu-bind".into(),
        resource_name: "tether.io/gpu".into(),
        devices: vec!["gpu0".into(), "gpu1".into()],
    };
    let socket = dir.path().join("tether-gpu.sock");
    let plugin_socket = socket.clone();
    let plugin = tokio::spawn(async move {
        serve_on_socket(
            GpuPlugin::new(client, config),
            &plugin_socket,
            std::future::pending(),
        )
        .await
    });
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !socket.exists() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut plugin_client = DevicePluginClient::new(unix_channel(socket).await.unwrap());
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
