//! A kubelet device plugin (API v1beta1, gRPC over a unix socket) for GPUs
//! (the node's NVIDIA GPUs or fake devices, see [`crate::inventory`]),
//! whose `Allocate` learns the pod it serves from Tether.
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
//! kubelet's accounting and what the container gets agree (it reads the
//! hold from the leader's applied state without a ReadIndex round, as
//! steering may be a moment behind: `HolderRequest.unconfirmed`); the container
//! always gets exactly the ids the kubelet sent. Where the kubelet chose
//! other devices (its own accounting has planned ones taken: a pod it
//! admitted without Tether, or a claim that ended before the kubelet freed
//! the device), the last call corrects the pod's device claim to the
//! kubelet's choice before the hold is released, so Tether's ledger never
//! keeps naming a device a live pod does not have, or missing one it has.
//!
//! `ListAndWatch` sends the device list, then the list again whenever a
//! rescan changes it (a GPU turned unhealthy, or a new one), for as long
//! as the kubelet keeps the stream.
//!
//! The kubelet deletes every socket in its device-plugin directory and
//! creates `kubelet.sock` afresh when it restarts; [`run`] notices either
//! and serves and registers again.

use std::collections::{BTreeMap, BTreeSet};
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

use crate::accounting::{ClaimOwner, DEFAULT_LIFETIME, DeviceLedger, devices_of};
use crate::inventory::{DeviceSource, Inventory, inventory_key, publish};
use crate::metrics::PluginMetrics;
use crate::plan::{DevicePlan, PlannedCall, PodCalls};
use crate::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::v1beta1::registration_client::RegistrationClient;
use crate::v1beta1::{self as api};

/// How a call reads its node's hold.
#[derive(Debug, Clone, Copy)]
enum Read {
    /// Linearizably (ReadIndex): what `Allocate` decides by.
    Linearizable,
    /// From the leader's applied state, unconfirmed: what
    /// `GetPreferredAllocation` steers by.
    Unconfirmed,
}

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
    /// The pin set of this kind's device claims (`gpu-devices`; a further
    /// device kind has its own, [`crate::kind`]).
    pub claim_set: String,
    /// The pin set this plugin publishes its node's devices in
    /// (`gpu-inventory`, or its kind's).
    pub inventory_set: String,
    /// The devices to advertise.
    pub devices: DeviceSource,
    /// The plugin's own pod: the owner of the node's published devices
    /// (see [`crate::inventory`]).
    pub pod_uid: String,
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
    /// The devices as last read; `ListAndWatch` streams every change.
    inventory: tokio::sync::watch::Sender<Inventory>,
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
    /// A plugin over a Tether client, with its devices read for the first
    /// time (an unreadable driver directory is an error; a node without
    /// one has no GPUs).
    pub fn new(client: Client, config: PluginConfig) -> std::io::Result<Self> {
        let inventory = Inventory::read(&config.devices)?;
        for (entry, why) in inventory.skipped() {
            tracing::warn!(entry, why, "a GPU entry of the driver is left out");
        }
        tracing::info!(devices = ?inventory.devices().iter().map(|d| &d.id).collect::<Vec<_>>(), "devices read");
        let metrics = PluginMetrics::default();
        count_devices(&metrics, &inventory);
        Ok(Self {
            ledger: DeviceLedger::new(client.clone(), DEFAULT_LIFETIME).in_set(&config.claim_set),
            inventory: tokio::sync::watch::Sender::new(inventory),
            client,
            config,
            before_release: None,
            progress: tokio::sync::Mutex::default(),
            metrics,
        })
    }

    /// The devices as last read.
    pub fn inventory(&self) -> Inventory {
        self.inventory.borrow().clone()
    }

    /// Publishes the devices in Tether for the extender, at start and
    /// after every change, retrying (backing off up to 10 s) until each
    /// list is acknowledged; a newer list replaces one being retried.
    /// Between changes it checks every [`PUBLISHED_CHECK_EVERY`] that the
    /// list is still there as published (the pin ends once Tether counts
    /// its owner stopped, or by an operator's hand) and publishes it again
    /// if not. Runs until dropped.
    async fn publish_devices(&self) {
        const FIRST_BACKOFF: Duration = Duration::from_millis(200);
        let mut lists = self.inventory.subscribe();
        let mut backoff = FIRST_BACKOFF;
        let node = &self.config.node;
        loop {
            let inventory = lists.borrow_and_update().clone();
            if let Err(err) = publish(
                &self.client,
                &self.config.inventory_set,
                node,
                &self.config.pod_uid,
                &inventory,
            )
            .await
            {
                tracing::warn!(%err, ?backoff, "cannot publish the devices in Tether yet; the extender cannot plan this node's devices until then");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
            tracing::info!(
                node,
                devices = inventory.devices().len(),
                "devices published in Tether"
            );
            backoff = FIRST_BACKOFF;
            loop {
                tokio::select! {
                    changed = lists.changed() => {
                        if changed.is_err() {
                            return std::future::pending().await;
                        }
                        break;
                    }
                    () = tokio::time::sleep(PUBLISHED_CHECK_EVERY) => {
                        match self
                            .client
                            .get_pin(&inventory_key(&self.config.inventory_set, node)).await {
                            Ok(Some(pin))
                                if pin.node == *node
                                    && pin.pod_uid == self.config.pod_uid
                                    && pin.labels == inventory.labels() => {}
                            Ok(_) => {
                                tracing::warn!(node, "the published devices are gone or changed; publishing them again");
                                break;
                            }
                            Err(err) => {
                                tracing::debug!(%err, "cannot check the published devices; checking again later");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Reads the devices again every rescan of their source and publishes
    /// a changed list to `ListAndWatch`; runs until dropped (fake devices
    /// never change: it only waits).
    async fn rescan_devices(&self) {
        let Some(every) = self.config.devices.rescan() else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(every).await;
            let current = self.inventory();
            let read = {
                let current = current.clone();
                tokio::task::spawn_blocking(move || current.reread()).await
            };
            let next = match read {
                Ok(Ok(next)) => next,
                Ok(Err(err)) => {
                    tracing::warn!(%err, "cannot read the GPUs again; keeping the last list");
                    continue;
                }
                Err(err) => {
                    tracing::warn!(%err, "the GPU read failed; keeping the last list");
                    continue;
                }
            };
            if next == current {
                continue;
            }
            let before: BTreeMap<String, String> = current
                .devices()
                .into_iter()
                .map(|d| (d.id, d.health))
                .collect();
            for device in next.devices() {
                if before.get(&device.id) != Some(&device.health) {
                    tracing::warn!(
                        device = device.id,
                        health = device.health,
                        "a device's health changed; telling the kubelet"
                    );
                }
            }
            for (entry, why) in next.skipped() {
                tracing::warn!(entry, why, "a GPU entry of the driver is left out");
            }
            count_devices(&self.metrics, &next);
            self.inventory.send_replace(next);
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
    /// plugin cannot tell which pod a call is for. `Read::Unconfirmed` reads
    /// the leader's applied state without a ReadIndex round: for steering
    /// only (`GetPreferredAllocation`), as it may be behind just after an
    /// election; `Allocate` reads linearizably.
    async fn holder_and_plan(&self, read: Read) -> Result<(Hold, DevicePlan), Status> {
        let key = self.key();
        let set = self.ledger.set();
        // One read for both: the hold and its pod's claim from one state.
        let answer = match read {
            Read::Linearizable => self.client.holder_and_claim(&key, set).await,
            Read::Unconfirmed => self.client.holder_and_claim_unconfirmed(&key, set).await,
        };
        let (hold, claim) = match answer {
            Ok((Some(hold), claim)) => (hold, claim),
            Ok((None, _)) => {
                return Err(Status::failed_precondition(format!(
                    "no pod holds {}/{}: refusing to guess which pod this Allocate is for (the scheduler \
                     extender takes the lock at bind; was the pod bound without it?)",
                    key.scope, key.name
                )));
            }
            Err(err) => {
                return Err(Status::unavailable(format!(
                    "cannot read the holder of {}/{} and its device claim, so this pod's Allocate \
                     fails (the kubelet does not retry it; the pod is recreated by its controller): \
                     {err}",
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
        let devices = match claim {
            Some(pin) if pin.node == self.config.node => devices_of(&pin),
            Some(pin) => {
                let node = pin.node;
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

    /// One container's answer: exactly the devices the kubelet chose, as
    /// the inventory hands them over (device nodes; for GPUs also CDI
    /// names and `NVIDIA_VISIBLE_DEVICES`). A device this node does not
    /// have now is refused: the kubelet then fails the pod.
    fn respond(
        &self,
        plan: &DevicePlan,
        token: u64,
        call: &PlannedCall,
        devices: &[String],
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let given = self.inventory.borrow().handover(devices).map_err(|why| {
            Status::failed_precondition(format!(
                "cannot hand pod {}/{} its devices: {why}",
                plan.namespace, plan.name
            ))
        })?;
        Ok(api::ContainerAllocateResponse {
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
            .chain(given.envs)
            .collect(),
            devices: given
                .device_nodes
                .into_iter()
                .map(|node| api::DeviceSpec {
                    container_path: node.clone(),
                    host_path: node,
                    permissions: "rw".into(),
                })
                .collect(),
            cdi_devices: given
                .cdi_devices
                .into_iter()
                .map(|name| api::CdiDevice { name })
                .collect(),
            ..Default::default()
        })
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

/// Sets the device gauges from `inventory`.
fn count_devices(metrics: &PluginMetrics, inventory: &Inventory) {
    let devices = inventory.devices();
    let healthy = devices.iter().filter(|d| d.health == "Healthy").count();
    metrics.devices(healthy, devices.len() - healthy);
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
        // The list now, then every changed list; the stream stays open
        // (the kubelet treats a closed stream as a plugin failure).
        let lists = tokio_stream::wrappers::WatchStream::new(self.inventory.subscribe());
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(
            lists,
            |inventory| {
                Ok(api::ListAndWatchResponse {
                    devices: inventory.devices(),
                })
            },
        ))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        // The plan's next call, if a pod holds the lock; without one the
        // kubelet's own choice stands (Allocate refuses later anyway).
        // Read without a ReadIndex round: a preference only, so an answer
        // from just after an election, behind the grant, costs a claim
        // corrected at the last Allocate, never a device given twice.
        let next = match self.holder_and_plan(Read::Unconfirmed).await {
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
        let (hold, plan) = self.holder_and_plan(Read::Linearizable).await?;
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
            container_responses.push(self.respond(
                &plan,
                hold.token,
                call,
                &container.devices_ids,
            )?);
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

/// How often a plugin checks that its published devices are still there.
pub const PUBLISHED_CHECK_EVERY: Duration = Duration::from_secs(30);

/// How long a stopping plugin server may take to finish its calls: a
/// `ListAndWatch` stream never ends by itself, so one a kubelet still
/// holds open is cut after this.
const SERVER_STOP_GRACE: Duration = Duration::from_secs(2);

/// Stops a plugin server started by [`serve_and_register`]: asks it to
/// stop, then cuts what is still open after [`SERVER_STOP_GRACE`].
async fn stop_server(
    stop: tokio::sync::oneshot::Sender<()>,
    mut server: tokio::task::JoinHandle<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let _ = stop.send(());
    match tokio::time::timeout(SERVER_STOP_GRACE, &mut server).await {
        Ok(joined) => joined?,
        Err(_) => {
            server.abort();
            tracing::info!(
                "closed the plugin server's streams still open (a kubelet's ListAndWatch)"
            );
            Ok(())
        }
    }
}

/// Serves `plugin` in `placement` and registers it with the kubelet, and
/// does both again whenever the kubelet restarts (its `kubelet.sock` is
/// created afresh, or the plugin's own socket is deleted), until
/// `shutdown` resolves. Registration is retried until the kubelet answers.
/// For as long as it runs, the devices are read again (for
/// `ListAndWatch`) and published in Tether (for the extender).
pub async fn run(
    plugin: Arc<GpuPlugin>,
    placement: Placement,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (rescanning, publishing) = (plugin.clone(), plugin.clone());
    tokio::select! {
        result = serve_and_register(plugin, placement, shutdown) => result,
        () = rescanning.rescan_devices() => unreachable!("the rescan runs until dropped"),
        () = publishing.publish_devices() => unreachable!("publishing runs until dropped"),
    }
}

async fn serve_and_register(
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
        // Which file is ours is read before registering: once registered,
        // the kubelet may dial, and the socket may be deleted, before this
        // task runs again.
        let ours = file_identity(&socket);
        let registered_with = loop {
            if server.is_finished() {
                return server.await?;
            }
            let kubelet = file_identity(&kubelet_socket);
            match register(&kubelet_socket, &placement.socket_name, &resource).await {
                Ok(()) => {
                    plugin.metrics.registration();
                    tracing::info!(node = plugin.config.node, resource, socket = %socket.display(), "registered with the kubelet");
                    break kubelet;
                }
                Err(err) => {
                    tracing::warn!(%err, kubelet = %kubelet_socket.display(), "cannot register with the kubelet yet; retrying");
                }
            }
            tokio::select! {
                _ = &mut shutdown => {
                    return stop_server(stop_tx, server).await;
                }
                _ = tokio::time::sleep(KUBELET_CHECK_EVERY) => {}
            }
        };
        // Watch for a restarted kubelet.
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    return stop_server(stop_tx, server).await;
                }
                _ = tokio::time::sleep(KUBELET_CHECK_EVERY) => {}
            }
            if server.is_finished() {
                return server.await?;
            }
            let kubelet = file_identity(&kubelet_socket);
            let now_ours = file_identity(&socket);
            if kubelet.is_some() && kubelet != registered_with
                || now_ours.is_none()
                || now_ours != ours
            {
                tracing::info!(
                    "the kubelet restarted (its socket or ours was replaced): serving and registering again"
                );
                break;
            }
        }
        if let Err(err) = stop_server(stop_tx, server).await {
            tracing::warn!(%err, "the old plugin server ended with an error");
        }
    }
}
