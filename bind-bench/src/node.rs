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
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
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

use crate::annotation::AnnotationPlugin;
use crate::world::{RESOURCE, SECOND_PREFIX, SECOND_RESOURCE, pod_selector};
use tether_embed::kind::DeviceKind;

/// Which system's device plugin a node runs.
#[derive(Clone)]
pub enum NodeMode {
    /// Tether's `GpuPlugin`.
    Tether,
    /// A plugin that answers `Allocate` with the kubelet's choice.
    NoLock,
    /// HAMi's, through the node annotation lock.
    Annotation(Arc<AnnotationPlugin>),
}

/// One simulated node: its plugins (one per device kind), and its
/// kubelet's books of devices.
pub struct SimNode {
    /// The node's name.
    pub name: String,
    /// Its device kinds: GPUs, then the second kind if it has any.
    kinds: Vec<KindPlugin>,
    client: tether_client::Client,
    owner: String,
    /// The device plugin the node runs now.
    mode: Mutex<NodeMode>,
    /// The device manager's books; held for a whole admission, as the
    /// kubelet admits one pod at a time.
    books: tokio::sync::Mutex<Books>,
}

/// One device kind of a node and Tether's plugin for it.
struct KindPlugin {
    /// The extended resource.
    resource: &'static str,
    /// How many devices.
    count: usize,
    /// Its device ids' prefix (the books hold every kind's ids).
    prefix: String,
    /// The pin set it publishes its devices in.
    inventory_set: String,
    plugin: GpuPlugin,
}

/// Free devices, and those given to each pod (by UID).
#[derive(Default)]
struct Books {
    free: BTreeSet<String>,
    given: BTreeMap<String, Vec<String>>,
}

impl SimNode {
    /// A node with `gpus` fake devices `gpu0..` and `npus` of the second
    /// kind `npu0..`, each kind's plugin a client of `endpoints` with
    /// `tether-device-plugin`'s defaults (the second kind's with the scope
    /// and sets the extender's `--also-kind` gives it).
    pub fn new(name: &str, gpus: usize, npus: usize, endpoints: &str) -> anyhow::Result<SimNode> {
        let owner = standalone_owner(name);
        let flags = |count: usize| {
            vec![
                "tether-device-plugin".to_string(),
                "--node-name".into(),
                name.into(),
                "--endpoints".into(),
                endpoints.into(),
                "--devices".into(),
                format!("fake:{count}"),
            ]
        };
        let mut kinds = vec![(RESOURCE, gpus, flags(gpus))];
        if npus > 0 {
            let second = DeviceKind::named(SECOND_RESOURCE, SECOND_PREFIX);
            let mut flags = flags(npus);
            flags.extend([
                "--resource-name".into(),
                second.resource,
                "--scope".into(),
                second.scope,
                "--claim-set".into(),
                second.claim_set,
                "--inventory-set".into(),
                second.inventory_set,
                "--device-prefix".into(),
                second.device_prefix,
            ]);
            kinds.push((SECOND_RESOURCE, npus, flags));
        }
        let mut client = None;
        let mut plugins = Vec::new();
        let mut free = BTreeSet::new();
        for (resource, count, flags) in kinds {
            let args = DevicePluginArgs::try_parse_from(flags)?;
            let kind_client = args.tether.client(Options {
                retry_timeout: args.allocate_timeout,
                ..Options::default()
            })?;
            let devices = DeviceSource::parse(
                &args.devices,
                args.host_root.clone(),
                args.rescan,
                &args.device_prefix,
            )
            .map_err(anyhow::Error::msg)?;
            let plugin = GpuPlugin::new(
                kind_client.clone(),
                PluginConfig {
                    node: name.to_string(),
                    scope: args.scope,
                    resource_name: args.resource_name,
                    claim_set: args.claim_set,
                    inventory_set: args.inventory_set.clone(),
                    devices,
                    pod_uid: owner.clone(),
                    allocate_deadline: args.allocate_timeout,
                },
            )?;
            free.extend(plugin.inventory().devices().into_iter().map(|d| d.id));
            client.get_or_insert(kind_client);
            plugins.push(KindPlugin {
                resource,
                count,
                prefix: args.device_prefix,
                inventory_set: args.inventory_set,
                plugin,
            });
        }
        Ok(SimNode {
            name: name.to_string(),
            kinds: plugins,
            client: client.expect("a node has GPUs"),
            owner,
            mode: Mutex::new(NodeMode::Tether),
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
        for kind in &self.kinds {
            publish(
                &self.client,
                &kind.inventory_set,
                &self.name,
                &self.owner,
                &kind.plugin.inventory(),
            )
            .await
            .with_context(|| format!("publishing {}'s {}", self.name, kind.resource))?;
        }
        let nodes: Api<Node> = Api::all(admin.clone());
        let node: Node = serde_json::from_value(json!({"metadata": {
            "name": self.name,
            "labels": {"kubernetes.io/hostname": self.name},
        }}))?;
        nodes.create(&PostParams::default(), &node).await?;
        let mut resources = json!({"cpu": "64", "memory": "512Gi", "pods": "110"});
        for kind in &self.kinds {
            resources[kind.resource] = kind.count.to_string().into();
        }
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

    /// Admits `pod` as the device manager does: kind by kind, for each
    /// container asking for devices of the kind, devices among its free
    /// ones (with Tether's plugin, its preferred ones first), and that
    /// kind's plugin's `Allocate` with them. Returns the devices the
    /// plugins gave the pod, or why admission failed.
    pub async fn admit(&self, pod: &Pod) -> Result<Vec<String>, String> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let mode = self.mode.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut books = self.books.lock().await;
        let mut picked_all = Vec::new();
        let mut given = Vec::new();
        for (index, kind) in self.kinds.iter().enumerate() {
            for demand in tether_embed::kubelet::demands(pod, kind.resource)? {
                let size = demand.count as usize;
                let available: Vec<String> = books
                    .free
                    .iter()
                    .filter(|id| id.strip_prefix(&kind.prefix).is_some_and(is_number))
                    .cloned()
                    .collect();
                let preferred = match mode {
                    NodeMode::Tether => preferred(&kind.plugin, &available, size).await,
                    NodeMode::NoLock | NodeMode::Annotation(_) => Vec::new(),
                };
                let mut picked: Vec<String> = preferred
                    .into_iter()
                    .filter(|id| available.contains(id))
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
                        "container {} asks for {size} {}, {} free on {}",
                        demand.name,
                        kind.resource,
                        picked.len(),
                        self.name
                    ));
                }
                match &mode {
                    NodeMode::Tether => given.extend(allocate(&kind.plugin, &picked).await?),
                    NodeMode::NoLock => given.extend(picked.iter().cloned()),
                    // HAMi's plugin of the first kind: through the lock.
                    // A second kind's plugin is not modelled: no pod asking
                    // for two kinds gets past HAMi's bind (HAMi-core #246,
                    // `crate::annotation`).
                    NodeMode::Annotation(plugin) if index == 0 => {
                        given.extend(plugin.allocate().await?)
                    }
                    NodeMode::Annotation(_) => given.extend(picked.iter().cloned()),
                }
                for id in &picked {
                    books.free.remove(id);
                }
                picked_all.extend(picked);
            }
        }
        books.given.insert(uid, picked_all);
        Ok(given)
    }

    /// Whether every device is free (no pod holds one).
    async fn idle(&self) -> bool {
        let books = self.books.lock().await;
        let devices: usize = self.kinds.iter().map(|k| k.count).sum();
        books.given.is_empty() && books.free.len() == devices
    }

    /// A pod of this node is gone: its devices are free again.
    pub async fn forget(&self, uid: &str) {
        let mut books = self.books.lock().await;
        if let Some(devices) = books.given.remove(uid) {
            books.free.extend(devices);
        }
    }
}

/// Whether `s` is a device number (what follows a kind's id prefix).
fn is_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Tether's plugin's preferred `size` devices among `available`.
async fn preferred(plugin: &GpuPlugin, available: &[String], size: usize) -> Vec<String> {
    plugin
        .get_preferred_allocation(tonic::Request::new(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.to_vec(),
                must_include_device_i_ds: Vec::new(),
                allocation_size: size as i32,
            }],
        }))
        .await
        .map(|r| r.into_inner().container_responses)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|r| r.device_i_ds)
        .collect()
}

/// Tether's plugin's `Allocate` of `picked`: the devices it gives (its
/// `TETHER_DEVICES`).
async fn allocate(plugin: &GpuPlugin, picked: &[String]) -> Result<Vec<String>, String> {
    let answer = plugin
        .allocate(tonic::Request::new(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: picked.to_vec(),
            }],
        }))
        .await
        .map_err(|status| format!("Allocate refused: {}", status.message()))?
        .into_inner();
    Ok(answer
        .container_responses
        .into_iter()
        .filter_map(|r| r.envs.get("TETHER_DEVICES").cloned())
        .flat_map(|d| d.split(',').map(str::to_string).collect::<Vec<_>>())
        .collect())
}

/// What a kubelet does last for a pod deleted with a grace period, once
/// its containers have stopped: deletes the object with no grace left, on
/// the condition that it is still the same pod (its UID).
async fn finish_deletion(admin: kube::Client, pod: Pod) {
    let (Some(namespace), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
        return;
    };
    let pods: Api<Pod> = Api::namespaced(admin, namespace);
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    for _ in 0..5 {
        match pods.delete(name, &params).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if [404, 409].contains(&e.code) => return,
            Err(err) => {
                tracing::warn!(%err, pod = name, "cannot finish the pod's deletion; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
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
    /// Seen marked for deletion (a kubelet admits it no more).
    pub deleting: bool,
}

/// The simulated nodes and the one watch that hands each a pod bound to
/// it.
pub struct Fleet {
    nodes: BTreeMap<String, Arc<SimNode>>,
    /// The bench's pods in every namespace (by [`crate::world::POD_LABEL`]).
    pods: Api<Pod>,
    admin: kube::Client,
    /// By `namespace/name`.
    records: Mutex<BTreeMap<String, PodRecord>>,
}

/// A pod's key in the records.
pub fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

impl Fleet {
    /// A fleet of `nodes` serving the bench's pods.
    pub fn new(nodes: Vec<Arc<SimNode>>, admin: kube::Client) -> Arc<Fleet> {
        Arc::new(Fleet {
            nodes: nodes.into_iter().map(|n| (n.name.clone(), n)).collect(),
            pods: Api::all(admin.clone()),
            admin,
            records: Mutex::default(),
        })
    }

    /// What the fleet has seen so far, by `namespace/name`.
    pub fn records(&self) -> BTreeMap<String, PodRecord> {
        self.with_records(|records| records.clone())
    }

    /// `read` of the records, under their lock (for the samples taken
    /// while a run is measured: no copy of the whole map).
    pub fn with_records<R>(&self, read: impl FnOnce(&BTreeMap<String, PodRecord>) -> R) -> R {
        read(&self.records.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether the fleet has seen pod `key` deleted.
    fn is_deleted(&self, key: &str) -> bool {
        self.with_records(|records| records.get(key).is_some_and(|r| r.deleted))
    }

    /// Whether the fleet has seen pod `key` marked for deletion or deleted:
    /// a kubelet does not admit it.
    fn is_ending(&self, key: &str) -> bool {
        self.with_records(|records| records.get(key).is_some_and(|r| r.deleted || r.deleting))
    }

    /// Gives every node the plugin `mode` makes for its name.
    pub fn set_mode(&self, mode: impl Fn(&str) -> NodeMode) {
        for (name, node) in &self.nodes {
            *node.mode.lock().unwrap_or_else(|p| p.into_inner()) = mode(name);
        }
    }

    /// Whether every pod of `namespace` the fleet saw is seen deleted, and
    /// no node holds a device for any pod.
    pub async fn all_forgotten(&self, namespace: &str) -> bool {
        let prefix = format!("{namespace}/");
        if self.with_records(|records| {
            records
                .iter()
                .any(|(k, r)| k.starts_with(&prefix) && !r.deleted)
        }) {
            return false;
        }
        for node in self.nodes.values() {
            if !node.idle().await {
                return false;
            }
        }
        true
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
        let config = watcher::Config::default().labels(&pod_selector());
        let events = watcher(self.pods.clone(), config).default_backoff();
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
                    let (Some(namespace), Some(name), Some(node)) = (
                        pod.metadata.namespace.clone(),
                        pod.metadata.name.clone(),
                        pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                    ) else {
                        continue;
                    };
                    let name = pod_key(&namespace, &name);
                    if pod.metadata.deletion_timestamp.is_some() {
                        // Deleted with a grace period: the node's kubelet
                        // admits it no more, and once any admission of it
                        // under way has ended (its queue runs in order)
                        // stops its containers (here there are none) and
                        // deletes the object for good.
                        let first = {
                            let mut records =
                                self.records.lock().unwrap_or_else(|p| p.into_inner());
                            let record = records.entry(name).or_default();
                            !std::mem::replace(&mut record.deleting, true)
                        };
                        if first && let Some(queue) = queues.get(&node) {
                            let _ = queue.send(pod);
                        }
                        continue;
                    }
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
                    if let (Some(namespace), Some(name)) =
                        (&pod.metadata.namespace, &pod.metadata.name)
                    {
                        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
                        let record = records.entry(pod_key(namespace, name)).or_default();
                        record.deleted = true;
                        if record.bound.is_some() && !record.deleting {
                            // No grace period: a forced deletion, or the API
                            // server's graceful-deletion check read the pod
                            // before its binding and chose none (a pod not
                            // scheduled is deleted at once), while the
                            // deletion itself then removed the bound pod. A
                            // kubelet may be admitting it right now.
                            tracing::debug!(pod = name, "a bound pod deleted with no grace period");
                        }
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
            let namespace = pod.metadata.namespace.clone().unwrap_or_default();
            let name = pod.metadata.name.clone().unwrap_or_default();
            let key = pod_key(&namespace, &name);
            if pod.metadata.deletion_timestamp.is_some() {
                finish_deletion(self.admin.clone(), pod).await;
                continue;
            }
            if self.is_ending(&key) {
                continue;
            }
            let result = node.admit(&pod).await;
            if self.is_deleted(&key)
                && let Some(uid) = &pod.metadata.uid
            {
                // Deleted while it was admitted: the deletion's forget may
                // have come first.
                node.forget(uid).await;
            }
            let at = Instant::now();
            let status = match &result {
                Ok(_) => json!({"status": {"phase": "Running"}}),
                Err(why) => json!({"status": {
                    "phase": "Failed", "reason": "UnexpectedAdmissionError", "message": why,
                }}),
            };
            {
                let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
                let record = records.entry(key).or_default();
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
            let pods: Api<Pod> = Api::namespaced(self.admin.clone(), &namespace);
            for _ in 0..5 {
                match pods
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
