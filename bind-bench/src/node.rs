//! Simulated GPU nodes: each node's Node object, device plugin and the
//! part of its kubelet that admits bound pods (the crate's doc says what
//! they do and do not do), and the fleet that hands each bound pod to its
//! node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser as _;
use futures::TryStreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use serde_json::json;
use tether_client::Options;
use tether_embed::cli::DevicePluginArgs;
use tether_embed::device_plugin::{GpuPlugin, PluginConfig};
use tether_embed::inventory::{DeviceSource, publish, standalone_owner};
use tether_embed::v1beta1 as api;
use tether_embed::v1beta1::device_plugin_server::DevicePlugin as _;
use tokio::sync::mpsc;

use crate::world::RESOURCE;

/// One simulated node: its plugin, and its kubelet's books of devices.
pub struct SimNode {
    /// The node's name.
    pub name: String,
    gpus: usize,
    plugin: GpuPlugin,
    client: tether_client::Client,
    owner: String,
    /// The device manager's books; held for a whole admission, as the
    /// kubelet admits one pod at a time.
    books: tokio::sync::Mutex<Books>,
}

/// Free devices, and those given to each pod (by UID).
#[derive(Default)]
struct Books {
    free: BTreeSet<String>,
    given: BTreeMap<String, Vec<String>>,
}

impl SimNode {
    /// A node with `gpus` fake devices `gpu0..`, its plugin a client of
    /// `endpoints` with `tether-device-plugin`'s defaults.
    pub fn new(name: &str, gpus: usize, endpoints: &str) -> anyhow::Result<SimNode> {
        let args = DevicePluginArgs::try_parse_from([
            "tether-device-plugin",
            "--node-name",
            name,
            "--endpoints",
            endpoints,
            "--devices",
            &format!("fake:{gpus}"),
        ])?;
        let client = args.tether.client(Options {
            retry_timeout: args.allocate_timeout,
            ..Options::default()
        })?;
        let owner = standalone_owner(name);
        let devices = DeviceSource::parse(
            &args.devices,
            args.host_root.clone(),
            args.rescan,
            &args.device_prefix,
        )
        .map_err(anyhow::Error::msg)?;
        let plugin = GpuPlugin::new(
            client.clone(),
            PluginConfig {
                node: name.to_string(),
                scope: args.scope,
                resource_name: args.resource_name,
                devices,
                pod_uid: owner.clone(),
                allocate_deadline: args.allocate_timeout,
            },
        )?;
        let free = plugin
            .inventory()
            .devices()
            .into_iter()
            .map(|d| d.id)
            .collect();
        Ok(SimNode {
            name: name.to_string(),
            gpus,
            plugin,
            client,
            owner,
            books: tokio::sync::Mutex::new(Books {
                free,
                given: BTreeMap::new(),
            }),
        })
    }

    /// Publishes the plugin's devices in Tether and registers the node as
    /// its kubelet would: Ready, the GPUs allocatable, no `not-ready`
    /// taint left.
    pub async fn register(&self, admin: &kube::Client) -> anyhow::Result<()> {
        publish(
            &self.client,
            &self.name,
            &self.owner,
            &self.plugin.inventory(),
        )
        .await
        .with_context(|| format!("publishing {}'s devices", self.name))?;
        let nodes: Api<Node> = Api::all(admin.clone());
        let node: Node = serde_json::from_value(json!({"metadata": {
            "name": self.name,
            "labels": {"kubernetes.io/hostname": self.name},
        }}))?;
        nodes.create(&PostParams::default(), &node).await?;
        let resources = json!({
            "cpu": "64", "memory": "512Gi", "pods": "110", RESOURCE: self.gpus.to_string(),
        });
        nodes
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {
                    "capacity": resources, "allocatable": resources,
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                    "lastHeartbeatTime": "2026-12-05T00:00:00Z",
                                    "lastTransitionTime": "2026-12-05T00:00:00Z"}],
                }})),
            )
            .await?;
        // What the node lifecycle controller does once the node is Ready
        // (none runs here).
        nodes
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"taints": null}})),
            )
            .await?;
        Ok(())
    }

    /// Admits `pod` as the device manager does: for each container asking
    /// for GPUs, the plugin's preferred devices among the free ones (then
    /// any free one), and `Allocate` with them. Returns the devices the
    /// plugin gave the pod (its `TETHER_DEVICES`), or why admission failed.
    pub async fn admit(&self, pod: &Pod) -> Result<Vec<String>, String> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let demands = tether_embed::kubelet::demands(pod, RESOURCE)?;
        let mut books = self.books.lock().await;
        let mut picked_all = Vec::new();
        let mut given = Vec::new();
        for demand in demands {
            let size = demand.count as usize;
            let available: Vec<String> = books.free.iter().cloned().collect();
            let preferred = self
                .plugin
                .get_preferred_allocation(tonic::Request::new(api::PreferredAllocationRequest {
                    container_requests: vec![api::ContainerPreferredAllocationRequest {
                        available_device_i_ds: available.clone(),
                        must_include_device_i_ds: Vec::new(),
                        allocation_size: demand.count as i32,
                    }],
                }))
                .await
                .map(|r| r.into_inner().container_responses)
                .unwrap_or_default();
            let mut picked: Vec<String> = preferred
                .into_iter()
                .flat_map(|r| r.device_i_ds)
                .filter(|id| books.free.contains(id))
                .take(size)
                .collect();
            for id in &available {
                if picked.len() >= size {
                    break;
                }
                if !picked.contains(id) {
                    picked.push(id.clone());
                }
            }
            if picked.len() < size {
                return Err(format!(
                    "container {} asks for {size} devices, {} free on {}",
                    demand.name,
                    picked.len(),
                    self.name
                ));
            }
            let answer = self
                .plugin
                .allocate(tonic::Request::new(api::AllocateRequest {
                    container_requests: vec![api::ContainerAllocateRequest {
                        devices_ids: picked.clone(),
                    }],
                }))
                .await
                .map_err(|status| format!("Allocate refused: {}", status.message()))?
                .into_inner();
            for response in answer.container_responses {
                if let Some(devices) = response.envs.get("TETHER_DEVICES") {
                    given.extend(devices.split(',').map(str::to_string));
                }
            }
            for id in &picked {
                books.free.remove(id);
            }
            picked_all.extend(picked);
        }
        books.given.insert(uid, picked_all);
        Ok(given)
    }

    /// A pod of this node is gone: its devices are free again.
    pub async fn forget(&self, uid: &str) {
        let mut books = self.books.lock().await;
        if let Some(devices) = books.given.remove(uid) {
            books.free.extend(devices);
        }
    }
}

/// What the fleet saw of one pod.
#[derive(Debug, Clone, Default)]
pub struct PodRecord {
    /// The node it was bound to.
    pub node: String,
    /// When the fleet's watch first showed it bound.
    pub bound: Option<Instant>,
    /// When its last `Allocate` returned.
    pub allocated: Option<Instant>,
    /// The devices the plugin gave it.
    pub devices: Vec<String>,
    /// Why its admission failed, if it did.
    pub failed: Option<String>,
    /// Seen deleted.
    pub deleted: bool,
}

/// The simulated nodes and the one watch that hands each a pod bound to
/// it.
pub struct Fleet {
    nodes: BTreeMap<String, Arc<SimNode>>,
    pods: Api<Pod>,
    /// By pod name.
    records: Mutex<BTreeMap<String, PodRecord>>,
}

impl Fleet {
    /// A fleet of `nodes` serving the pods of `namespace`.
    pub fn new(nodes: Vec<Arc<SimNode>>, admin: kube::Client, namespace: &str) -> Arc<Fleet> {
        Arc::new(Fleet {
            nodes: nodes.into_iter().map(|n| (n.name.clone(), n)).collect(),
            pods: Api::namespaced(admin, namespace),
            records: Mutex::default(),
        })
    }

    /// What the fleet has seen so far, by pod name.
    pub fn records(&self) -> BTreeMap<String, PodRecord> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Watches the namespace's pods until dropped: a pod newly bound goes
    /// to its node's queue (each node admits one at a time), a deleted
    /// one returns its devices.
    pub async fn serve(self: Arc<Self>) {
        let mut queues = BTreeMap::new();
        for (name, node) in &self.nodes {
            let (tx, rx) = mpsc::unbounded_channel::<Pod>();
            tokio::spawn(self.clone().admit_in_turn(node.clone(), rx));
            queues.insert(name.clone(), tx);
        }
        let events = watcher(self.pods.clone(), watcher::Config::default()).default_backoff();
        futures::pin_mut!(events);
        loop {
            let event = match events.try_next().await {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "the fleet's pod watch failed; it backs off and resumes");
                    continue;
                }
            };
            match event {
                watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                    let (Some(name), Some(node)) = (
                        pod.metadata.name.clone(),
                        pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                    ) else {
                        continue;
                    };
                    let fresh = {
                        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
                        let record = records.entry(name).or_default();
                        let fresh = record.bound.is_none();
                        if fresh {
                            record.node = node.clone();
                            record.bound = Some(Instant::now());
                        }
                        fresh
                    };
                    if fresh && let Some(queue) = queues.get(&node) {
                        let _ = queue.send(pod);
                    }
                }
                watcher::Event::Delete(pod) => {
                    if let Some(name) = &pod.metadata.name {
                        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
                        records.entry(name.clone()).or_default().deleted = true;
                    }
                    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                    if let (Some(node), Some(uid)) =
                        (node.and_then(|n| self.nodes.get(&n)), &pod.metadata.uid)
                    {
                        node.forget(uid).await;
                    }
                }
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
        }
    }

    /// Admits `node`'s pods one at a time, as its kubelet does, and
    /// reports each Running (or Failed, as the kubelet reports an
    /// admission error).
    async fn admit_in_turn(
        self: Arc<Self>,
        node: Arc<SimNode>,
        mut queue: mpsc::UnboundedReceiver<Pod>,
    ) {
        while let Some(pod) = queue.recv().await {
            let name = pod.metadata.name.clone().unwrap_or_default();
            let result = node.admit(&pod).await;
            let at = Instant::now();
            let status = match &result {
                Ok(_) => json!({"status": {"phase": "Running"}}),
                Err(why) => json!({"status": {
                    "phase": "Failed", "reason": "UnexpectedAdmissionError", "message": why,
                }}),
            };
            {
                let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
                let record = records.entry(name.clone()).or_default();
                match result {
                    Ok(devices) => {
                        record.allocated = Some(at);
                        record.devices = devices;
                    }
                    Err(why) => record.failed = Some(why),
                }
            }
            // The kubelet's status manager retries until the status is
            // written; a pod deleted meanwhile needs none.
            for _ in 0..5 {
                match self
                    .pods
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                {
                    Ok(_) => break,
                    Err(kube::Error::Api(e)) if e.code == 404 => break,
                    Err(err) => {
                        tracing::warn!(%err, pod = name, "cannot set the pod's phase; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
    }
}
