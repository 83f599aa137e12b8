//! A kubelet, as far as device plugins see it: the `Registration` service
//! on `kubelet.sock`, and admission that calls a registered plugin as the
//! device manager does.
//!
//! The fake kubelet ([`FakeKubelet::admit`]) follows
//! kubernetes/kubernetes `pkg/kubelet/cm/devicemanager/manager.go`
//! (`ManagerImpl.Allocate`, `allocateContainerResources`,
//! `devicesToAllocate`), written out here on its own rather than through
//! `tether_embed::kubelet`, so the plugin is checked against the kubelet and
//! not against our model of it:
//! - init containers, then app containers, one `Allocate` per container
//!   whose limit of the resource is above zero, carrying all the ids picked
//!   for it;
//! - ids come first from the pod's reusable set (devices of finished init
//!   containers, taken in an order of the kubelet's own — here a seeded
//!   shuffle), then, if more are needed, from `GetPreferredAllocation`
//!   (available plus already picked, must include those, size = the limit)
//!   intersected with what is free, then from whatever is free; "free" is
//!   the healthy devices less those of every pod it admitted, Tether's or
//!   not (its `allocatedDevices`), so it can pass over planned devices;
//! - a non-restartable init container's ids join the reusable set; a
//!   sidecar's and an app container's leave it;
//! - an `Allocate` error fails the pod: no retry;
//! - a kubelet restart deletes every socket in the plugin directory and
//!   serves `kubelet.sock` afresh;
//! - on registration it dials the plugin and follows its `ListAndWatch`
//!   (`pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go`, `Run`):
//!   each answer is the whole device list and replaces the last one, its
//!   `Healthy` devices the ones it allocates from and counts as allocatable,
//!   the rest unhealthy (`manager.go`, `genericDeviceUpdateCallback`).
//!
//! Shared by `e2e.rs` (a fake API server) and `real_scheduler.rs` (a real
//! kube-apiserver and kube-scheduler). A real kubelet and containerd run
//! here too (`real_node.rs`, through `tether_kube_testenv::RealNode`), and
//! every scenario that needs nothing but the kubelet's own behaviour runs
//! there: a pod's exact GPUs by env, CDI and device node; pods at once;
//! init, app and sidecar containers; a pod without GPUs; a pod placed around
//! the scheduler (Allocate refused, the pod failed at admission); a deleted
//! pod's claim standing until its containers stop; a pod that exits; a
//! kubelet restart; a deleted plugin socket; a GPU falling off the bus; the
//! plugin from its image. The fake stays for what a real node cannot be
//! made to do here, use by use:
//!
//! | scenario | what the fake lets it do that a real node does not |
//! |---|---|
//! | e2e: eight pods in FIFO order | bind each at a moment chosen and admit none yet, to see the queue and the lock held between bind and `Allocate` |
//! | e2e: init and two GPU containers, one `Allocate` each | count and read each `Allocate` call (the real kubelet shows only the outcome) |
//! | e2e: a bind the scheduler gave up on; a pod deleted right after its bind; a failed bind; an abandoned bind | put a delete, a timeout or a release between bind and `Allocate`, a gap a real kubelet gives no handle on |
//! | e2e: a plugin crashing mid-`Allocate`; the release on a new leader | stop the plugin, or the leader, inside one `Allocate` |
//! | e2e: the plugin lists its devices | read the `ListAndWatch` answer itself (ids, health, NUMA) |
//! | e2e: the filter verb across nodes | many nodes at once |
//! | e2e: the kubelet's choice becomes the claim; a bind remakes a shrunk claim | admit other devices than planned ([`FakeKubelet::occupy`]), which a real kubelet does only when its own books differ from Tether's (devices it gave outside Tether), never on demand |
//! | e2e: NVIDIA by UUID and a lost GPU | read the `Allocate` answer (CDI names, control device nodes) and the extender's filter on a node that lost a GPU while claims stand |
//! | e2e: a socket deleted while registering | delete the socket between the kubelet's answer and the plugin's next look |
//! | e2e: published devices that vanish | no kubelet work at all; the fake is the cheapest registration |
//! | real_scheduler: pods racing, two extender replicas | admit each bound pod at a moment chosen, so the lock's hold is seen |
//! | real_scheduler: freed GPUs reach a pending pod (ended, unheard, extender restarted, claim correction, refused after the wait, HTTP timeout) | end a pod (a terminal phase) at a moment chosen, measured without the kubelet's grace period, on a node quiet by construction |
//!
//! What the real kubelet did that this model had not: it registers its node
//! with the `node.kubernetes.io/not-ready:NoSchedule` taint
//! (`real_scheduler.rs` removes it as the node lifecycle controller
//! would); with a sidecar still running it reports no terminal phase for
//! the pod; it fails a pod whose `Allocate` fails with phase `Failed` and
//! reason `UnexpectedAdmissionError` (the plugin's message in the pod's
//! status).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tether_embed::v1beta1 as api;
use tether_embed::v1beta1::device_plugin_client::DevicePluginClient;
use tether_embed::v1beta1::registration_server::{Registration, RegistrationServer};
use tokio::task::JoinHandle;

/// The kubelet's `Registration` service: records every registration and
/// follows the registered plugin's `ListAndWatch`.
#[derive(Clone, Default)]
pub struct Registrations(pub Arc<Mutex<Vec<api::RegisterRequest>>>, Following);

/// The device list as the plugin last sent it (id, healthy), and the task
/// that follows it.
#[derive(Clone, Default)]
pub struct Following {
    dir: PathBuf,
    devices: Arc<Mutex<Vec<(String, bool)>>>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
    /// `ListAndWatch` answers received.
    updates: Arc<std::sync::atomic::AtomicUsize>,
    /// Set by a test: the next registration deletes the plugin's socket
    /// before it answers, as a directory cleaned by hand can between the
    /// plugin's registration and its next look at its socket.
    delete_socket_on_register: Arc<std::sync::atomic::AtomicBool>,
}

impl Following {
    /// Dials the plugin at `endpoint` and replaces the device list with
    /// each `ListAndWatch` answer until the stream ends.
    fn follow(&self, endpoint: &str) {
        let socket = self.dir.join(endpoint);
        let (devices, updates) = (self.devices.clone(), self.updates.clone());
        let task = tokio::spawn(async move {
            let Ok(channel) = tether_embed::device_plugin::unix_channel(socket).await else {
                return;
            };
            let Ok(stream) = DevicePluginClient::new(channel)
                .list_and_watch(api::Empty {})
                .await
            else {
                return;
            };
            let mut stream = stream.into_inner();
            while let Ok(Some(answer)) = stream.message().await {
                *devices.lock().unwrap() = answer
                    .devices
                    .into_iter()
                    .map(|d| (d.id, d.health == "Healthy"))
                    .collect();
                updates.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        if let Some(old) = self.task.lock().unwrap().replace(task) {
            old.abort();
        }
    }
}

#[tonic::async_trait]
impl Registration for Registrations {
    async fn register(
        &self,
        request: tonic::Request<api::RegisterRequest>,
    ) -> Result<tonic::Response<api::Empty>, tonic::Status> {
        let request = request.into_inner();
        if self
            .1
            .delete_socket_on_register
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            let _ = std::fs::remove_file(self.1.dir.join(&request.endpoint));
        }
        self.1.follow(&request.endpoint);
        self.0.lock().unwrap().push(request);
        Ok(tonic::Response::new(api::Empty {}))
    }
}

/// The kubelet, as far as device plugins see it (see the module doc).
pub struct FakeKubelet {
    dir: PathBuf,
    /// The extended resource it admits pods for.
    resource: String,
    pub registrations: Registrations,
    server: Mutex<Option<JoinHandle<()>>>,
    /// Devices the kubelet has given to each pod.
    allocated: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

/// What one admission did: each container's answer, in call order.
pub type Admitted = Vec<(String, api::ContainerAllocateResponse)>;

impl FakeKubelet {
    /// A kubelet with `devices` of `resource` (all healthy until a
    /// plugin's `ListAndWatch` says otherwise), serving `kubelet.sock` in
    /// `dir`.
    pub fn start(dir: &Path, resource: &str, devices: Vec<String>) -> Arc<FakeKubelet> {
        let following = Following {
            dir: dir.to_path_buf(),
            devices: Arc::new(Mutex::new(devices.into_iter().map(|d| (d, true)).collect())),
            ..Following::default()
        };
        let kubelet = Arc::new(FakeKubelet {
            dir: dir.to_path_buf(),
            resource: resource.to_string(),
            registrations: Registrations(Arc::default(), following),
            server: Mutex::new(None),
            allocated: Mutex::default(),
        });
        kubelet.serve();
        kubelet
    }

    fn serve(&self) {
        let socket = self.dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let service = RegistrationServer::new(self.registrations.clone());
        *self.server.lock().unwrap() = Some(tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                .await;
        }));
    }

    /// What a kubelet restart does: its connections close (the
    /// `ListAndWatch` it follows too) and the directory is emptied.
    pub fn restart(&self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
        if let Some(following) = self.registrations.1.task.lock().unwrap().take() {
            following.abort();
        }
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "sock") {
                std::fs::remove_file(path).unwrap();
            }
        }
        self.serve();
    }

    /// The next registration deletes the plugin's socket before it
    /// answers.
    pub fn delete_socket_on_next_register(&self) {
        self.registrations
            .1
            .delete_socket_on_register
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The device list as the plugin last sent it: (id, healthy).
    pub fn devices(&self) -> Vec<(String, bool)> {
        self.registrations.1.devices.lock().unwrap().clone()
    }

    /// `ListAndWatch` answers received so far.
    pub fn device_updates(&self) -> usize {
        self.registrations
            .1
            .updates
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// What the node reports as allocatable: the healthy devices.
    pub fn allocatable(&self) -> usize {
        self.devices()
            .iter()
            .filter(|(_, healthy)| *healthy)
            .count()
    }

    pub fn registered(&self) -> usize {
        self.registrations.0.lock().unwrap().len()
    }

    pub fn plugin_socket(&self) -> Option<PathBuf> {
        let registrations = self.registrations.0.lock().unwrap();
        registrations
            .last()
            .map(|r| self.dir.join(&r.endpoint))
            .filter(|p| p.exists())
    }

    /// Admits `pod` as the device manager does; `seed` orders the reusable
    /// set as Go's set iteration would, arbitrarily.
    pub async fn admit(
        &self,
        pod: &k8s_openapi::api::core::v1::Pod,
        seed: u64,
    ) -> Result<Admitted, tonic::Status> {
        let socket = self
            .plugin_socket()
            .ok_or_else(|| tonic::Status::unavailable("no registered plugin"))?;
        let channel = tether_embed::device_plugin::unix_channel(socket)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut plugin = DevicePluginClient::new(channel);
        let uid = pod.metadata.uid.clone().unwrap();
        let spec = pod.spec.clone().unwrap();
        let containers = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| (c, c.restart_policy.as_deref() != Some("Always")))
            .chain(spec.containers.iter().map(|c| (c, false)));
        let mut reusable: Vec<String> = Vec::new();
        let mut answers = Vec::new();
        let mut rng = seed;
        for (container, runs_to_completion) in containers {
            let needed: usize = container
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get(&self.resource))
                .map_or(0, |q| q.0.parse().unwrap());
            if needed == 0 {
                continue;
            }
            // Reusable first, in an order of the kubelet's own.
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut order = reusable.clone();
            if !order.is_empty() {
                let turn = (rng >> 33) as usize % order.len();
                order.rotate_left(turn);
            }
            let mut picked: Vec<String> = order.into_iter().take(needed).collect();
            if picked.len() < needed {
                let in_use: BTreeSet<String> = self
                    .allocated
                    .lock()
                    .unwrap()
                    .values()
                    .flatten()
                    .cloned()
                    .collect();
                let available: Vec<String> = self
                    .devices()
                    .into_iter()
                    .filter(|(d, healthy)| *healthy && !in_use.contains(d) && !picked.contains(d))
                    .map(|(d, _)| d)
                    .collect();
                assert!(
                    available.len() >= needed - picked.len(),
                    "the kubelet has too few devices left for {uid}"
                );
                let preferred = plugin
                    .get_preferred_allocation(api::PreferredAllocationRequest {
                        container_requests: vec![api::ContainerPreferredAllocationRequest {
                            available_device_i_ds: available
                                .iter()
                                .chain(&picked)
                                .cloned()
                                .collect(),
                            must_include_device_i_ds: picked.clone(),
                            allocation_size: needed as i32,
                        }],
                    })
                    .await?
                    .into_inner();
                let preferred = &preferred.container_responses[0].device_i_ds;
                for d in preferred.iter().chain(&available) {
                    if picked.len() < needed && available.contains(d) && !picked.contains(d) {
                        picked.push(d.clone());
                    }
                }
            }
            self.allocated
                .lock()
                .unwrap()
                .entry(uid.clone())
                .or_default()
                .extend(picked.iter().cloned());
            // One Allocate with every id; an error fails the pod.
            let response = plugin
                .allocate(api::AllocateRequest {
                    container_requests: vec![api::ContainerAllocateRequest {
                        devices_ids: picked.clone(),
                    }],
                })
                .await?
                .into_inner();
            answers.push((
                container.name.clone(),
                response.container_responses.into_iter().next().unwrap(),
            ));
            if runs_to_completion
                && spec
                    .init_containers
                    .iter()
                    .flatten()
                    .any(|c| c.name == container.name)
            {
                for d in picked {
                    if !reusable.contains(&d) {
                        reusable.push(d);
                    }
                }
            } else {
                reusable.retain(|d| !picked.contains(d));
            }
        }
        Ok(answers)
    }

    /// The kubelet gives `devices` to a pod Tether never saw (admitted
    /// before the plugin ran, or scheduled around the extender).
    pub fn occupy(&self, uid: &str, devices: &[&str]) {
        self.allocated
            .lock()
            .unwrap()
            .entry(uid.to_string())
            .or_default()
            .extend(devices.iter().map(|d| d.to_string()));
    }

    /// The pod ended: its devices are free again.
    pub fn pod_ended(&self, uid: &str) {
        self.allocated.lock().unwrap().remove(uid);
    }
}
