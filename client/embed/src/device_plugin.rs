//! A kubelet device plugin (API v1beta1, gRPC over a unix socket) for a fake
//! GPU resource, whose `Allocate` learns the pod it serves from Tether.
//!
//! The kubelet passes `Allocate` only device ids. The plugin reads
//! `Holder(gpu-bind/<its node>)` — a linearizable read — to learn the pod and
//! its device plan (the hold's payload), answers from the plan, then releases
//! with the hold's token and outcome `allocated`. If nothing holds the lock
//! it refuses with a reason instead of guessing a pod. If the release fails
//! for a reason retrying can fix, `Allocate` fails too: the kubelet calls it
//! again, the hold is still there, and the retry completes.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use tether_client::proto::{LockKey, Outcome};
use tether_client::{Client, Error};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status};

use crate::plan::DevicePlan;
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
}

/// A hook run in `Allocate` after the holder is read and before the release
/// (fault injection in tests: a crash mid-`Allocate`).
pub type BeforeRelease = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The device plugin service.
pub struct GpuPlugin {
    client: Client,
    config: PluginConfig,
    before_release: Option<BeforeRelease>,
}

impl GpuPlugin {
    /// A plugin over a Tether client.
    pub fn new(client: Client, config: PluginConfig) -> Self {
        Self {
            client,
            config,
            before_release: None,
        }
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

    /// The container responses for a plan.
    fn respond(
        plan: &DevicePlan,
        token: u64,
        requests: &[api::ContainerAllocateRequest],
    ) -> api::AllocateResponse {
        let container = || api::ContainerAllocateResponse {
            envs: [
                ("TETHER_POD_UID", plan.pod_uid.clone()),
                ("TETHER_POD_NAMESPACE", plan.namespace.clone()),
                ("TETHER_POD_NAME", plan.name.clone()),
                ("TETHER_DEVICES", plan.devices.join(",")),
                ("TETHER_LOCK_TOKEN", token.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
            devices: plan
                .devices
                .iter()
                .map(|d| api::DeviceSpec {
                    container_path: format!("/dev/{d}"),
                    host_path: format!("/dev/{d}"),
                    permissions: "rw".into(),
                })
                .collect(),
            ..Default::default()
        };
        api::AllocateResponse {
            container_responses: requests.iter().map(|_| container()).collect(),
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
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|r| {
                let mut ids = r.must_include_device_i_ds.clone();
                for id in r.available_device_i_ds {
                    if ids.len() >= r.allocation_size.max(0) as usize {
                        break;
                    }
                    if !ids.contains(&id) {
                        ids.push(id);
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
        let request = request.into_inner();
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
                    "cannot read the holder of {}/{}: {err}",
                    key.scope, key.name
                )));
            }
        };
        let plan = DevicePlan::from_payload(&hold.payload).map_err(Status::failed_precondition)?;
        let pod_uid = hold.pod.as_ref().map(|p| p.uid.clone()).unwrap_or_default();
        if plan.pod_uid != pod_uid {
            return Err(Status::failed_precondition(format!(
                "the plan in {}/{} is for pod uid {} but the holder is {pod_uid}: refusing a swapped plan",
                key.scope, key.name, plan.pod_uid
            )));
        }
        let response = Self::respond(&plan, hold.token, &request.container_requests);
        if let Some(hook) = &self.before_release {
            hook().await;
        }
        match self
            .client
            .release(&key, &pod_uid, hold.token, Outcome::Allocated)
            .await
        {
            Ok(_) => {
                tracing::info!(pod_uid, token = hold.token, devices = ?plan.devices, "allocated and released");
                Ok(Response::new(response))
            }
            Err(Error::FailedPrecondition(msg)) => Err(Status::aborted(format!(
                "the hold of pod uid {pod_uid} (token {}) ended before Allocate finished: {msg}",
                hold.token
            ))),
            Err(err) => Err(Status::unavailable(format!(
                "allocated for pod uid {pod_uid} but the release did not go through ({err}); the kubelet \
                 will retry Allocate and the hold is still there"
            ))),
        }
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// Serves `plugin` on the unix socket `path` (replacing a stale socket file)
/// until `shutdown` resolves.
pub async fn serve_on_socket(
    plugin: GpuPlugin,
    path: &Path,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    if path.exists() {
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    Server::builder()
        .add_service(DevicePluginServer::new(plugin))
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
