//! A kubelet device plugin (API v1beta1, gRPC over a unix socket) for a fake
//! GPU resource, whose `Allocate` learns the pod it serves from Tether.
//!
//! The kubelet passes `Allocate` only device ids, once per container that
//! asks for the resource (init containers first), and never retries one
//! that fails: the pod fails with `UnexpectedAdmissionError` (see
//! [`crate::kubelet`]). So each call reads `Holder(gpu-bind/<its node>)` — a
//! linearizable read, retried by the client across elections for up to its
//! retry timeout — to learn the pod and its plan (the hold's payload), and
//! serves the plan's next call. Only the last call of the pod releases the
//! hold, with its token and outcome `allocated`; if that release cannot get
//! through, the answer still goes to the kubelet (the devices are the
//! pod's) and the release goes on in the background. If nothing holds the
//! lock, or the call does not fit the plan, it refuses with a reason instead
//! of guessing a pod.
//!
//! `GetPreferredAllocation` steers the kubelet to the plan's devices, so the
//! kubelet's accounting and what the container gets agree; the container
//! always gets exactly the ids the kubelet sent. Where the kubelet chose
//! other devices (its own accounting has planned ones taken: a pod it
//! admitted without Tether, or a claim that ended before the kubelet freed
//! the device), the last call corrects the pod's device claim to the
//! kubelet's choice before the hold is released, so Tether's ledger never
//! keeps naming a device a live pod does not have, or missing one it has.
//!
//! The kubelet deletes every socket in its device-plugin directory and
//! creates `kubelet.sock` afresh when it restarts; [`run`] notices either
//! and serves and registers again.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tether_client::proto::{Hold, LockKey, Outcome};
use tether_client::{Client, Error};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status};

use crate::accounting::{ClaimOwner, DEFAULT_LIFETIME, DeviceLedger};
use crate::metrics::PluginMetrics;
use crate::plan::{DevicePlan, PlannedCall, PodCalls};
use crate::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::v1beta1::registration_client::RegistrationClient;
use crate::v1beta1::{self as api};

/// The API version this plugin speaks.
pub const API_VERSION: &str = "v1beta1";

/// Plugin settings.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// The node this plugin runs on (the lock's name).
    pub node: String,
    /// Lock scope, e.g. `gpu-bind`.
    pub scope: String,
    /// Extended resource name, e.g. `tether.io/gpu`.
    pub resource_name: String,
    /// Device ids to advertise.
    pub devices: Vec<String>,
    /// The deadline of one whole `Allocate`, every Tether call in it
    /// together (`tether_client::deadline`): the kubelet admits the node's
    /// pods one at a time and waits for the answer, so one slow call must
    /// not chain several retry budgets.
    pub allocate_deadline: std::time::Duration,
}

/// A hook run in `Allocate` after the holder is read and before the release
/// (fault injection in tests: a crash mid-`Allocate`).
pub type BeforeRelease = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The device plugin service.
pub struct GpuPlugin {
    client: Client,
    ledger: DeviceLedger,
    config: PluginConfig,
    before_release: Option<BeforeRelease>,
    /// How far the current hold's calls are served; one `Allocate` at a
    /// time (the kubelet admits pods one by one anyway).
    progress: tokio::sync::Mutex<Progress>,
    metrics: PluginMetrics,
}

/// Calls served for one hold.
#[derive(Debug, Default)]
struct Progress {
    token: u64,
    served: usize,
    /// Every device the kubelet has sent for the hold's pod so far.
    given: BTreeSet<String>,
}

impl GpuPlugin {
    /// A plugin over a Tether client.
    pub fn new(client: Client, config: PluginConfig) -> Self {
        Self {
            ledger: DeviceLedger::new(client.clone(), DEFAULT_LIFETIME),
            client,
            config,
            before_release: None,
            progress: tokio::sync::Mutex::default(),
            metrics: PluginMetrics::default(),
        }
    }

    /// What the plugin has counted.
    pub fn metrics(&self) -> &PluginMetrics {
        &self.metrics
    }

    /// Installs a fault-injection hook (see [`BeforeRelease`]).
    pub fn with_before_release(mut self, hook: BeforeRelease) -> Self {
        self.before_release = Some(hook);
        self
    }

    fn key(&self) -> LockKey {
        LockKey {
            scope: self.config.scope.clone(),
            name: self.config.node.clone(),
        }
    }

    /// The current hold of this node's lock and its plan, or why the
    /// plugin cannot tell which pod a call is for.
    async fn holder_and_plan(&self) -> Result<(Hold, DevicePlan), Status> {
        let key = self.key();
        let hold = match self.client.holder(&key).await {
            Ok(Some(hold)) => hold,
            Ok(None) => {
                return Err(Status::failed_precondition(format!(
                    "no pod holds {}/{}: refusing to guess which pod this Allocate is for (the scheduler \
                     extender takes the lock at bind; was the pod bound without it?)",
                    key.scope, key.name
                )));
            }
            Err(err) => {
                return Err(Status::unavailable(format!(
                    "cannot read the holder of {}/{}, so this pod's Allocate fails (the kubelet does \
                     not retry it; the pod is recreated by its controller): {err}",
                    key.scope, key.name
                )));
            }
        };
        let calls = PodCalls::from_payload(&hold.payload).map_err(Status::failed_precondition)?;
        let pod_uid = hold
            .pod
            .as_ref()
            .map(|p| p.uid.as_str())
            .unwrap_or_default();
        if calls.pod_uid != pod_uid {
            return Err(Status::failed_precondition(format!(
                "the plan in {}/{} is for pod uid {} but the holder is {pod_uid}: refusing a swapped plan",
                key.scope, key.name, calls.pod_uid
            )));
        }
        let claim = self.ledger.claim_of(pod_uid).await.map_err(|err| {
            Status::unavailable(format!(
                "cannot read the device claim of pod uid {pod_uid}, so this Allocate fails (the \
                 kubelet does not retry it): {err}"
            ))
        })?;
        let devices = match claim {
            Some((node, devices)) if node == self.config.node => devices,
            Some((node, _)) => {
                return Err(Status::failed_precondition(format!(
                    "pod uid {pod_uid} holds {}/{} but its devices are claimed on node {node}",
                    key.scope, key.name
                )));
            }
            None => {
                return Err(Status::failed_precondition(format!(
                    "pod uid {pod_uid} holds {}/{} but has no device claim (the extender claims \
                     devices before it binds; was the claim released?)",
                    key.scope, key.name
                )));
            }
        };
        let plan = calls
            .with_devices(devices)
            .map_err(Status::failed_precondition)?;
        Ok((hold, plan))
    }

    /// One container's answer: exactly the devices the kubelet chose.
    fn respond(
        plan: &DevicePlan,
        token: u64,
        call: &PlannedCall,
        devices: &[String],
    ) -> api::ContainerAllocateResponse {
        api::ContainerAllocateResponse {
            envs: [
                ("TETHER_POD_UID", plan.pod_uid.clone()),
                ("TETHER_POD_NAMESPACE", plan.namespace.clone()),
                ("TETHER_POD_NAME", plan.name.clone()),
                ("TETHER_CONTAINER", call.container.clone()),
                ("TETHER_DEVICES", devices.join(",")),
                ("TETHER_LOCK_TOKEN", token.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            devices: devices
                .iter()
                .map(|d| api::DeviceSpec {
                    container_path: format!("/dev/{d}"),
                    host_path: format!("/dev/{d}"),
                    permissions: "rw".into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Makes the pod's device claim name what the kubelet gave it, if that
    /// is not what was planned, while the pod still holds the node's lock
    /// (see [`DeviceLedger::correct`]). The kubelet's accounting is the
    /// node's truth; a claim that disagreed would let the extender plan
    /// another pod onto devices this one has. If the claim cannot be
    /// corrected the call fails: the kubelet then fails the pod and takes
    /// the devices back, rather than run it on devices Tether does not know
    /// it has.
    async fn follow_the_kubelet(
        &self,
        plan: &DevicePlan,
        given: &BTreeSet<String>,
    ) -> Result<(), Status> {
        let planned: BTreeSet<&String> = plan.devices.iter().collect();
        if given.iter().eq(planned.iter().copied()) {
            return Ok(());
        }
        let given: Vec<String> = given.iter().cloned().collect();
        let owner = ClaimOwner {
            uid: &plan.pod_uid,
            namespace: &plan.namespace,
            name: &plan.name,
        };
        match self.ledger.correct(&self.config.node, owner, &given).await {
            Ok(correction) => {
                self.metrics.correction();
                tracing::warn!(pod_uid = plan.pod_uid, planned = ?correction.planned, given = ?given, taken_from = ?correction.taken_from, "device claim corrected to what the kubelet gave");
                Ok(())
            }
            Err(err) => Err(Status::unavailable(format!(
                "the kubelet gave pod {}/{} devices {given:?}, not the planned {:?}, and its device \
                 claim cannot be corrected, so this Allocate fails (the kubelet does not retry \
                 it): {err}",
                plan.namespace, plan.name, plan.devices
            ))),
        }
    }

    /// Releases the hold after its pod's last call. A release that cannot
    /// get through goes on in the background: the pod has its devices, and
    /// failing the call would only fail the pod.
    async fn release(&self, hold: &Hold) -> Result<(), Status> {
        let key = self.key();
        let pod_uid = hold.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        match self
            .client
            .release(&key, &pod_uid, hold.token, Outcome::Allocated)
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::FailedPrecondition(msg)) => Err(Status::aborted(format!(
                "the hold of pod uid {pod_uid} (token {}) ended before Allocate finished: {msg}",
                hold.token
            ))),
            Err(err) => {
                tracing::warn!(pod_uid, token = hold.token, %err, "allocated, but the release did not get through; retrying in the background");
                let (client, token) = (self.client.clone(), hold.token);
                tokio::spawn(async move {
                    let mut backoff = Duration::from_millis(200);
                    loop {
                        tokio::time::sleep(backoff).await;
                        match client
                            .release(&key, &pod_uid, token, Outcome::Allocated)
                            .await
                        {
                            Ok(_) => {
                                tracing::info!(pod_uid, token, "released in the background");
                                return;
                            }
                            Err(Error::FailedPrecondition(msg)) => {
                                tracing::info!(pod_uid, token, msg, "the hold already ended");
                                return;
                            }
                            Err(err) => {
                                tracing::warn!(pod_uid, token, %err, "release still failing");
                                backoff = (backoff * 2).min(Duration::from_secs(5));
                            }
                        }
                    }
                });
                Ok(())
            }
        }
    }
}

type ListAndWatchStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for GpuPlugin {
    type ListAndWatchStream = ListAndWatchStream;

    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(api::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let devices = self
            .config
            .devices
            .iter()
            .map(|id| api::Device {
                id: id.clone(),
                health: "Healthy".into(),
                topology: None,
            })
            .collect();
        // The fake devices never change: send the list once and keep the
        // stream open (the kubelet treats a closed stream as plugin failure).
        let first = tokio_stream::once(Ok(api::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::chain(
            first,
            tokio_stream::pending(),
        ))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        // The plan's next call, if a pod holds the lock; without one the
        // kubelet's own choice stands (Allocate refuses later anyway).
        let next = match self.holder_and_plan().await {
            Ok((hold, plan)) => {
                let progress = self.progress.lock().await;
                let served = if progress.token == hold.token {
                    progress.served
                } else {
                    0
                };
                plan.calls.get(served).cloned().map(|call| (call, plan))
            }
            Err(_) => None,
        };
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|r| {
                let size = r.allocation_size.max(0) as usize;
                let available: BTreeSet<&String> = r.available_device_i_ds.iter().collect();
                let mut ids = r.must_include_device_i_ds.clone();
                let planned = next
                    .iter()
                    .flat_map(|(call, plan)| call.new_devices.iter().chain(plan.devices.iter()));
                for id in planned.chain(r.available_device_i_ds.iter()) {
                    if ids.len() >= size {
                        break;
                    }
                    if available.contains(id) && !ids.contains(id) {
                        ids.push(id.clone());
                    }
                }
                api::ContainerPreferredAllocationResponse { device_i_ds: ids }
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let started = std::time::Instant::now();
        let answer = tether_client::deadline::within(
            started + self.config.allocate_deadline,
            self.serve_allocate(request.into_inner()),
        )
        .await;
        self.metrics
            .allocate(answer.is_ok(), started.elapsed().as_secs_f64());
        if let Err(status) = &answer {
            tracing::warn!(code = ?status.code(), message = status.message(), "Allocate refused; the kubelet fails the pod");
        }
        answer.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

impl GpuPlugin {
    /// One `Allocate`: serve the hold's next calls from its plan.
    async fn serve_allocate(
        &self,
        request: api::AllocateRequest,
    ) -> Result<api::AllocateResponse, Status> {
        let mut progress = self.progress.lock().await;
        let (hold, plan) = self.holder_and_plan().await?;
        if progress.token != hold.token {
            *progress = Progress {
                token: hold.token,
                ..Progress::default()
            };
        }
        let mut served = progress.served;
        let mut given = progress.given.clone();
        let mut container_responses = Vec::new();
        for container in &request.container_requests {
            let Some(call) = plan.calls.get(served) else {
                return Err(Status::failed_precondition(format!(
                    "all {} Allocate calls planned for pod {}/{} were served; a call for devices {:?} \
                     is for a pod the extender did not bind: refusing to guess",
                    plan.calls.len(),
                    plan.namespace,
                    plan.name,
                    container.devices_ids
                )));
            };
            if container.devices_ids.len() != call.size as usize {
                return Err(Status::failed_precondition(format!(
                    "Allocate for {} devices {:?}, but the next container of pod {}/{} ({:?}) is \
                     planned {}: refusing to serve another pod's call with this plan",
                    container.devices_ids.len(),
                    container.devices_ids,
                    plan.namespace,
                    plan.name,
                    call.container,
                    call.size
                )));
            }
            let outside: Vec<&String> = container
                .devices_ids
                .iter()
                .filter(|d| !plan.devices.contains(d))
                .collect();
            if !outside.is_empty() {
                tracing::warn!(pod_uid = plan.pod_uid, container = call.container, ?outside, planned = ?plan.devices, "the kubelet chose devices outside the plan (its own accounting has the planned ones taken); the container gets what the kubelet chose and the claim follows it");
            }
            given.extend(container.devices_ids.iter().cloned());
            container_responses.push(Self::respond(
                &plan,
                hold.token,
                call,
                &container.devices_ids,
            ));
            served += 1;
        }
        if served == plan.calls.len() {
            self.follow_the_kubelet(&plan, &given).await?;
            if let Some(hook) = &self.before_release {
                hook().await;
            }
            self.release(&hold).await?;
            tracing::info!(pod_uid = plan.pod_uid, token = hold.token, calls = served, devices = ?plan.devices, "pod fully allocated; lock released");
        }
        progress.served = served;
        progress.given = given;
        Ok(api::AllocateResponse {
            container_responses,
        })
    }
}

/// The plugin's HTTP side: `GET /health` and `GET /metrics`.
pub fn router(plugin: Arc<GpuPlugin>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/health",
            get(|| async { tether_http::text(axum::http::StatusCode::OK, "ok\n") }),
        )
        .route(
            "/metrics",
            get(move || async move { tether_http::metrics::response(plugin.metrics.render()) }),
        )
}

/// Serves `plugin` on the unix socket `path` (replacing a stale socket file)
/// until `shutdown` resolves.
pub async fn serve_on_socket(
    plugin: Arc<GpuPlugin>,
    path: &Path,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    Server::builder()
        .add_service(DevicePluginServer::from_arc(plugin))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}

/// A gRPC channel over a unix socket.
pub async fn unix_channel(path: PathBuf) -> anyhow::Result<tonic::transport::Channel> {
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::try_from("http://[::1]:1")?
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await?;
    Ok(channel)
}

/// Registers the plugin with the kubelet (its `Registration` service on
/// `kubelet_socket`); `endpoint` is the plugin socket's file name.
pub async fn register(
    kubelet_socket: &Path,
    endpoint: &str,
    resource_name: &str,
) -> anyhow::Result<()> {
    let channel = unix_channel(kubelet_socket.to_path_buf()).await?;
    RegistrationClient::new(channel)
        .register(api::RegisterRequest {
            version: API_VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource_name.into(),
            options: Some(api::DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: true,
            }),
        })
        .await?;
    Ok(())
}

/// Where the plugin lives: the kubelet's device-plugin directory and the
/// plugin's socket name in it.
#[derive(Debug, Clone)]
pub struct Placement {
    /// The kubelet's device-plugin directory
    /// (`/var/lib/kubelet/device-plugins`).
    pub dir: PathBuf,
    /// The plugin's socket file name in it.
    pub socket_name: String,
}

/// How often [`run`] looks for a restarted kubelet.
pub const KUBELET_CHECK_EVERY: Duration = Duration::from_millis(500);

/// The identity of a file (device and inode), to see it replaced.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Serves `plugin` in `placement` and registers it with the kubelet, and
/// does both again whenever the kubelet restarts (its `kubelet.sock` is
/// created afresh, or the plugin's own socket is deleted), until
/// `shutdown` resolves. Registration is retried until the kubelet answers.
pub async fn run(
    plugin: Arc<GpuPlugin>,
    placement: Placement,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let socket = placement.dir.join(&placement.socket_name);
    let kubelet_socket = placement.dir.join("kubelet.sock");
    let resource = plugin.config.resource_name.clone();
    tokio::pin!(shutdown);
    loop {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn({
            let (plugin, socket) = (plugin.clone(), socket.clone());
            async move {
                serve_on_socket(plugin, &socket, async {
                    let _ = stop_rx.await;
                })
                .await
            }
        });
        // Register once the socket exists, so the kubelet can dial it at once.
        while file_identity(&socket).is_none() && !server.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (registered_with, ours) = loop {
            if server.is_finished() {
                return server.await?;
            }
            let kubelet = file_identity(&kubelet_socket);
            match register(&kubelet_socket, &placement.socket_name, &resource).await {
                Ok(()) => {
                    plugin.metrics.registration();
                    tracing::info!(node = plugin.config.node, resource, socket = %socket.display(), "registered with the kubelet");
                    break (kubelet, file_identity(&socket));
                }
                Err(err) => {
                    tracing::warn!(%err, kubelet = %kubelet_socket.display(), "cannot register with the kubelet yet; retrying");
                }
            }
            tokio::select! {
                _ = &mut shutdown => {
                    let _ = stop_tx.send(());
                    return server.await?;
                }
                _ = tokio::time::sleep(KUBELET_CHECK_EVERY) => {}
            }
        };
        // Watch for a restarted kubelet.
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    let _ = stop_tx.send(());
                    return server.await?;
                }
                _ = tokio::time::sleep(KUBELET_CHECK_EVERY) => {}
            }
            if server.is_finished() {
                return server.await?;
            }
            let kubelet = file_identity(&kubelet_socket);
            if kubelet.is_some() && kubelet != registered_with || file_identity(&socket) != ours {
                tracing::info!(
                    "the kubelet restarted (its socket or ours was replaced): serving and registering again"
                );
                break;
            }
        }
        let _ = stop_tx.send(());
        if let Err(err) = server.await? {
            tracing::warn!(%err, "the old plugin server ended with an error");
        }
    }
}
