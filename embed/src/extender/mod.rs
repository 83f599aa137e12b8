//! The scheduler-extender `bind` verb on Tether.
//!
//! kube-scheduler POSTs `ExtenderBindingArgs` to the extender's bind URL.
//! The extender reads the pod, and if it asks for none of the managed
//! resource binds it at once: such pods never take a node lock. Otherwise
//! it derives the kubelet's `Allocate` calls for the pod
//! ([`crate::kubelet`]), takes `gpu-bind/<node>` for the pod's UID with
//! those calls as payload — waiting its turn in Tether's FIFO queue, pushed
//! the grant, rather than failing and letting the scheduler retry — claims
//! free devices on the node in Tether ([`crate::accounting`]), then binds
//! the pod through the Kubernetes API. The lock is kept on
//! success: the device plugin's `Allocate` calls read it to learn the pod
//! and the last of them releases it. On any failure the extender releases
//! the lock with outcome `failed` (the Unreserve path) and the device claim,
//! and returns the error, so kube-scheduler backs off and retries.
//!
//! A node's device ids are what its device plugin published in Tether
//! ([`crate::inventory`]: GPU UUIDs, the healthy ones); for a node whose
//! plugin published none (an older plugin), `<prefix>0..N` with N its
//! allocatable count of the resource, as before.
//!
//! Each further device kind (`--also-kind`, [`crate::kind`]) has a lock,
//! claims and plugin of its own: a pod asking for several kinds takes each
//! kind's `<scope>/<node>` in the order of the scopes' names, with that
//! kind's calls as payload, then claims each kind's devices; a failure at
//! any step gives back everything taken. The filter judges every kind the
//! pod asks for.
//!
//! A retried bind of the same pod is idempotent: the claim and the hold of
//! the same UID come back unchanged, and a pod the API already shows bound
//! to the node (an earlier attempt got through) is reported bound, never
//! released as failed.
//!
//! Its parts: the filter verb ([`filter`]), one bind's device claim
//! ([`claim`]); here, the bind from the lock to the binding and its undo,
//! the refusals' requeue and the HTTP server.

mod claim;
mod filter;

pub use filter::{unfit_node, unfit_nodes};

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tether_client::deadline::unbounded;
use tether_client::proto::{LockKey, Outcome, Pod};
use tether_client::{Client, Error, Held};
use tokio::net::TcpListener;

use crate::accounting::{Claim, ClaimOwner, DeviceLedger};
use crate::attempts::{Attempts, Turn};
use crate::device_view::{DeviceView, Pins, Sets};
use crate::inventory::{PublishedDevice, published_inventories, published_inventory};
use crate::kind::DeviceKind;
use crate::kubelet;
use crate::metrics::{BindOutcome, ExtenderMetrics};
use crate::node_objects::NodeObjects;
use crate::plan::{PodCalls, pick_free, pick_free_near};
use crate::requeue::{
    NUDGE_ANNOTATION, NUDGES_PER_PASS, Nudged, POLL_INTERVAL, REFUSED_MARK, Refusal, Refusals,
    refused_by_filter, to_nudge,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod as KubePod};
use tether_http::Departure;
use tether_http::departure::detect_departure;

/// What kube-scheduler sends to the bind verb.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingArgs {
    /// Pod name.
    #[serde(rename = "PodName")]
    pub pod_name: String,
    /// Pod namespace.
    #[serde(rename = "PodNamespace")]
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node chosen.
    #[serde(rename = "Node")]
    pub node: String,
}

/// What the bind verb answers; an empty error means bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    /// Why binding failed ("" on success).
    #[serde(rename = "Error")]
    pub error: String,
}

/// What kube-scheduler sends to the filter verb (`ExtenderArgs`): the pod
/// and the candidate nodes, as names when the extender is configured
/// `nodeCacheCapable`, else as Node objects.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    #[serde(rename = "Pod")]
    pub pod: Option<KubePod>,
    /// Candidate nodes (not node-cache capable).
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<k8s_openapi::List<k8s_openapi::api::core::v1::Node>>,
    /// Candidate node names (node-cache capable).
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

/// What the filter verb answers (`ExtenderFilterResult`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ExtenderFilterResult {
    /// The nodes that fit, when they came as objects.
    #[serde(rename = "Nodes", skip_serializing_if = "Option::is_none")]
    pub nodes: Option<k8s_openapi::List<k8s_openapi::api::core::v1::Node>>,
    /// The nodes that fit, when they came as names.
    #[serde(rename = "NodeNames", skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    /// Nodes that do not fit now, and why (preemption may free devices).
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that can never fit the pod, and why.
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// Why the whole call failed ("" if it did not).
    #[serde(rename = "Error")]
    pub error: String,
}

/// Why a node cannot take a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unfit {
    /// Not now: too few free devices, or its devices unknown.
    Now(String),
    /// Never: fewer devices than the pod needs.
    Never(String),
}

/// The device ids of `node`: `<prefix>0` up to its allocatable count of
/// `resource` (what the device plugin advertises and the kubelet reports
/// as healthy), in order; none if the node has none of the resource. A
/// quantity that is not a plain count (`1500m`, `1Ki`) is refused.
pub fn node_inventory(
    node: &KubeNode,
    resource: &str,
    prefix: &str,
) -> Result<Vec<String>, String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let Some(quantity) = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
    else {
        return Ok(Vec::new());
    };
    let count: usize = quantity.0.trim().parse().map_err(|_| {
        format!(
            "node {name} reports allocatable {resource} {:?}, not a plain count of devices (the \
             kubelet writes one, such as \"8\")",
            quantity.0
        )
    })?;
    if count > MAX_DEVICES_PER_NODE {
        return Err(format!(
            "node {name} reports {count} allocatable {resource}; at most {MAX_DEVICES_PER_NODE} \
             devices a node are planned"
        ));
    }
    Ok((0..count).map(|i| format!("{prefix}{i}")).collect())
}

/// The device ids to plan on a node whose plugin published `devices`: the
/// healthy ones.
pub fn healthy_ids(devices: &[PublishedDevice]) -> Vec<String> {
    devices
        .iter()
        .filter(|d| d.healthy)
        .map(|d| d.id.clone())
        .collect()
}

/// More devices than any node has; a larger count is a misreport.
const MAX_DEVICES_PER_NODE: usize = 1024;

/// The Kubernetes API calls the bind verb makes.
pub trait Binder: Send + Sync + 'static {
    /// Reads the pod.
    fn pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<KubePod, String>> + Send;
    /// Reads a node (for its allocatable devices).
    fn node(&self, name: &str) -> impl Future<Output = Result<KubeNode, String>> + Send;
    /// Binds (the `pods/binding` subresource); an error is returned to the
    /// scheduler as text.
    fn bind(&self, args: &ExtenderBindingArgs) -> impl Future<Output = Result<(), String>> + Send;
    /// The pods not bound to a node yet (`spec.nodeName` empty), for
    /// finding those an earlier extender refused ([`crate::requeue`]).
    fn unbound_pods(&self) -> impl Future<Output = Result<Vec<KubePod>, String>> + Send;
    /// Makes kube-scheduler look at an unscheduled pod again (see
    /// [`crate::requeue`]): sets [`NUDGE_ANNOTATION`] on the pod of this
    /// UID to `value`.
    fn nudge(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        value: &str,
    ) -> impl Future<Output = Result<Nudged, String>> + Send;
    /// Calls `deleted` with the UID of each pod the API server removes,
    /// until dropped, as kube-scheduler's informer sees them (see
    /// [`DeviceView::pod_deleted`]). The default sees none.
    fn follow_deletions(
        &self,
        deleted: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> impl Future<Output = ()> + Send {
        let _ = deleted;
        std::future::pending()
    }
    /// Keeps `objects` current with the node object under each name, until
    /// dropped. The default sees none (binds name no object).
    fn follow_nodes(&self, objects: Arc<NodeObjects>) -> impl Future<Output = ()> + Send {
        let _ = objects;
        std::future::pending()
    }
}

/// Binds through the Kubernetes API with kube-rs.
pub struct KubeBinder {
    client: kube::Client,
}

impl KubeBinder {
    /// A binder over a kube client (in-cluster config or a kubeconfig).
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Binder for KubeBinder {
    async fn pod(&self, namespace: &str, name: &str) -> Result<KubePod, String> {
        let pods: kube::Api<KubePod> = kube::Api::namespaced(self.client.clone(), namespace);
        pods.get(name)
            .await
            .map_err(|e| format!("cannot read pod {namespace}/{name}: {e}"))
    }

    async fn node(&self, name: &str) -> Result<KubeNode, String> {
        let nodes: kube::Api<KubeNode> = kube::Api::all(self.client.clone());
        nodes
            .get(name)
            .await
            .map_err(|e| format!("cannot read node {name}: {e}"))
    }

    async fn bind(&self, args: &ExtenderBindingArgs) -> Result<(), String> {
        let pods: kube::Api<KubePod> =
            kube::Api::namespaced(self.client.clone(), &args.pod_namespace);
        let binding = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        });
        pods.create_subresource::<_, serde_json::Value>(
            "binding",
            &args.pod_name,
            &Default::default(),
            &binding,
        )
        .await
        .map(|_| ())
        .map_err(|e| {
            format!(
                "binding {}/{} to {} failed: {e}",
                args.pod_namespace, args.pod_name, args.node
            )
        })
    }

    async fn unbound_pods(&self) -> Result<Vec<KubePod>, String> {
        let pods: kube::Api<KubePod> = kube::Api::all(self.client.clone());
        let params = kube::api::ListParams::default().fields("spec.nodeName=");
        pods.list(&params)
            .await
            .map(|list| list.items)
            .map_err(|e| format!("cannot list the pods not yet bound: {e}"))
    }

    async fn nudge(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        value: &str,
    ) -> Result<Nudged, String> {
        let pods: kube::Api<KubePod> = kube::Api::namespaced(self.client.clone(), namespace);
        // The UID in the patch is a precondition: a pod created again
        // under the name is another pod, and is not touched.
        let patch = serde_json::json!({"metadata": {
            "uid": uid,
            "annotations": {NUDGE_ANNOTATION: value},
        }});
        match pods
            .patch(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => Ok(Nudged::Asked),
            Err(kube::Error::Api(status)) if [404, 409, 422].contains(&status.code) => {
                Ok(Nudged::Gone)
            }
            Err(e) => Err(format!("cannot annotate pod {namespace}/{name}: {e}")),
        }
    }

    async fn follow_nodes(&self, objects: Arc<NodeObjects>) {
        objects.follow(self.client.clone()).await
    }

    async fn follow_deletions(&self, deleted: Arc<dyn Fn(&str) + Send + Sync>) {
        use futures::TryStreamExt as _;
        use kube::runtime::WatchStreamExt as _;
        use kube::runtime::watcher;
        // Only delete events are wanted, and of them only the UID: a watch
        // of the pods' metadata (an Api of `PartialObjectMeta` asks for
        // metadata only), with no copy of the pods kept.
        let pods: kube::Api<kube::core::PartialObjectMeta<KubePod>> =
            kube::Api::all(self.client.clone());
        let events = watcher(pods, watcher::Config::default()).default_backoff();
        futures::pin_mut!(events);
        loop {
            match events.try_next().await {
                Ok(Some(watcher::Event::Delete(pod))) => {
                    if let Some(uid) = pod.metadata.uid.as_deref() {
                        deleted(uid);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "the extender's pod watch failed; it backs off and resumes (until then the filter learns of deleted pods from Tether)");
                }
            }
        }
    }
}

/// Extender settings.
#[derive(Debug, Clone)]
pub struct ExtenderConfig {
    /// Lock scope, e.g. `gpu-bind`.
    pub scope: String,
    /// The extended resource whose devices are planned, e.g. `tether.io/gpu`.
    pub resource: String,
    /// How long a bind waits in the queue for the node's lock. Keep it
    /// below the scheduler's `httpTimeout` minus the binding call, so the
    /// extender gives up before the scheduler does.
    pub wait: Duration,
    /// The deadline of one whole bind, every Tether call in it together
    /// (`tether_client::deadline`); what undoes a failed bind is not cut
    /// short. Below the scheduler's `httpTimeout`.
    pub bind_deadline: Duration,
    /// Device ids are this prefix and a number, as the device plugin
    /// advertises them; how many a node has is its allocatable count of
    /// the resource.
    pub device_prefix: String,
    /// How long the filter verb trusts a node's device count it read (the
    /// bind verb reads it afresh).
    pub inventory_ttl: Duration,
    /// Device kinds planned besides the first (`resource`, `scope`,
    /// `device_prefix`), each with its own lock scope and sets
    /// ([`crate::kind`]).
    pub also_kinds: Vec<DeviceKind>,
}

impl ExtenderConfig {
    /// Every device kind planned: the first, then [`ExtenderConfig::also_kinds`].
    pub fn kinds(&self) -> Vec<DeviceKind> {
        let mut kinds = vec![DeviceKind::first(
            &self.resource,
            &self.scope,
            &self.device_prefix,
        )];
        kinds.extend(self.also_kinds.iter().cloned());
        kinds
    }
}

/// One device kind as the extender plans it.
struct Kind {
    spec: DeviceKind,
    ledger: DeviceLedger,
    /// The filter's copy of this kind's claims and inventories, followed
    /// by [`serve_extender`] ([`crate::device_view`]).
    view: Arc<DeviceView>,
    /// Node -> when its device ids were read (from its Node object), and
    /// what they were.
    inventory: std::sync::Mutex<BTreeMap<String, (Instant, Vec<String>)>>,
}

/// Node reads one filter call makes at a time (only nodes not read within
/// the inventory TTL are read).
const NODE_READS_IN_FLIGHT: usize = 16;

/// Claim attempts before a bind gives up (each re-reads the node's claims
/// after a lost race).
const CLAIM_ATTEMPTS: usize = 5;

/// How long a bind waits for claims of stopped pods to end when it needs
/// their devices (they end at the sweep the leader makes when it applies
/// the pod's report, one commit later), and how often it looks.
const STOPPED_CLAIM_WAIT: Duration = Duration::from_secs(3);
const STOPPED_CLAIM_POLL: Duration = Duration::from_millis(25);

/// Whether `pod` is the pod `args` binds, bound to `args.node`.
fn bound_here(pod: &KubePod, args: &ExtenderBindingArgs) -> bool {
    pod.metadata.uid.as_deref() == Some(args.pod_uid.as_str())
        && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(args.node.as_str())
}

/// Devices one bind attempt claimed of one kind.
struct Claimed<'a> {
    kind: &'a Kind,
    devices: Vec<String>,
    /// The token of the attempt's hold of the kind's lock, which the claim
    /// carries ([`crate::accounting::BIND_TOKEN_LABEL`]).
    attempt: u64,
}

/// The bind verb.
pub struct Extender<B> {
    client: Client,
    binder: B,
    config: ExtenderConfig,
    /// The device kinds planned, the first kind first.
    kinds: Vec<Kind>,
    metrics: ExtenderMetrics,
    /// Pods the filter left without a node for want of free devices, to be
    /// asked about again when devices free up ([`crate::requeue`]).
    refusals: Refusals,
    /// One bind attempt per pod at a time ([`crate::attempts`]).
    attempts: Arc<Attempts>,
    /// The node object under each name, which a bind takes its locks and
    /// claims for ([`crate::node_objects`]).
    node_objects: Arc<NodeObjects>,
}

impl<B: Binder> Extender<B> {
    /// The node object under each name, as the extender's watch sees it
    /// (what its binds take their locks and claims for).
    pub fn node_objects(&self) -> &NodeObjects {
        &self.node_objects
    }

    /// An extender over a Tether client and a binder; `ledger` keeps the
    /// first kind's claims, and each further kind's are kept in its own
    /// set by a ledger like it.
    pub fn new(client: Client, ledger: DeviceLedger, binder: B, config: ExtenderConfig) -> Self {
        let kinds = config
            .kinds()
            .into_iter()
            .enumerate()
            .map(|(index, spec)| Kind {
                ledger: if index == 0 {
                    ledger.clone()
                } else {
                    ledger.clone().in_set(&spec.claim_set)
                },
                view: Arc::new(DeviceView::of(client.clone(), Sets::of(&spec))),
                inventory: std::sync::Mutex::default(),
                spec,
            })
            .collect();
        Self {
            client,
            binder,
            config,
            kinds,
            metrics: ExtenderMetrics::default(),
            refusals: Refusals::default(),
            attempts: Arc::default(),
            node_objects: Arc::default(),
        }
    }

    /// The pods refused for want of free devices, not yet placed.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// What the verbs have counted.
    pub fn metrics(&self) -> &ExtenderMetrics {
        &self.metrics
    }

    /// The filter's copy of the first kind's claims and inventories; keep
    /// it current with [`DeviceView::follow`] ([`serve_extender`] does).
    pub fn device_view(&self) -> &Arc<DeviceView> {
        &self.kinds[0].view
    }

    /// The filter's copies of every kind's claims and inventories, the
    /// first kind's first.
    pub fn device_views(&self) -> Vec<Arc<DeviceView>> {
        self.kinds.iter().map(|k| k.view.clone()).collect()
    }

    /// `node`'s device ids of `kind`, from a Node object at hand.
    fn remember(&self, kind: &Kind, node: &KubeNode) -> Result<Vec<String>, String> {
        let devices = node_inventory(node, &kind.spec.resource, &kind.spec.device_prefix)?;
        if let Some(name) = node.metadata.name.clone() {
            kind.inventory
                .lock()
                .expect("inventory lock")
                .insert(name, (Instant::now(), devices.clone()));
        }
        Ok(devices)
    }

    /// `name`'s device ids of `kind`: read from the API unless read within
    /// `max_age`.
    async fn devices_of(
        &self,
        kind: &Kind,
        name: &str,
        max_age: Duration,
    ) -> Result<Vec<String>, String> {
        if let Some((read, devices)) = kind.inventory.lock().expect("inventory lock").get(name)
            && read.elapsed() <= max_age
        {
            return Ok(devices.clone());
        }
        let node = self.binder.node(name).await?;
        self.remember(kind, &node)
    }

    /// Handles one bind: read the pod, acquire (FIFO), claim devices, bind;
    /// undo on failure, and when `scheduler` goes away before the binding
    /// call (its `httpTimeout` ran out: it has given up on this bind and
    /// will schedule the pod again).
    pub async fn bind(
        &self,
        args: &ExtenderBindingArgs,
        scheduler: &Departure,
    ) -> ExtenderBindingResult {
        let started = Instant::now();
        // A planted bug for `tests/bind_deadline.rs` (`extender-bind-unbounded`,
        // set with `fail::cfg`): each call of the bind retries on its own
        // budget, as before issue 34, past the scheduler's `httpTimeout`.
        // An earlier attempt of the same pod ends first, its undo included
        // ([`crate::attempts`]).
        let attempt = async {
            let (turn, _) = self
                .attempts
                .turn(&args.pod_uid, || self.metrics.bind_overlap())
                .await;
            self.try_bind(args, scheduler, &turn).await
        };
        let result = if fail::eval("extender-bind-unbounded", |_| ()).is_some() {
            attempt.await
        } else {
            tether_client::deadline::within(started + self.config.bind_deadline, attempt).await
        };
        let outcome = match result {
            Ok(_) => BindOutcome::Bound,
            Err(_) => BindOutcome::Refused,
        };
        self.metrics.bind(outcome, started.elapsed().as_secs_f64());
        match result {
            Ok(summary) => {
                self.refusals.settled(&args.pod_uid);
                tracing::info!(
                    pod_uid = args.pod_uid,
                    node = args.node,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "{summary}"
                );
                ExtenderBindingResult {
                    error: String::new(),
                }
            }
            Err(error) => {
                tracing::warn!(
                    pod_uid = args.pod_uid,
                    node = args.node,
                    error,
                    "bind refused"
                );
                ExtenderBindingResult { error }
            }
        }
    }

    async fn try_bind(
        &self,
        args: &ExtenderBindingArgs,
        scheduler: &Departure,
        turn: &Turn,
    ) -> Result<String, String> {
        let who = format!("{}/{}", args.pod_namespace, args.pod_name);
        let pod = self.binder.pod(&args.pod_namespace, &args.pod_name).await?;
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        if uid != args.pod_uid {
            return Err(format!(
                "pod {who} now has uid {uid:?}, not {:?}: it was deleted and created again; the \
                 scheduler binds the new pod on its own",
                args.pod_uid
            ));
        }
        match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(node) if node == args.node => {
                // An earlier attempt of this bind got through.
                return Ok(format!("{who} is already bound to {node}"));
            }
            Some(node) => {
                return Err(format!(
                    "pod {who} is already bound to node {node}, not {}",
                    args.node
                ));
            }
            None => {}
        }
        // Each kind the pod asks for, in the order of the kinds' lock
        // scopes: every bind takes its locks in that one order, so two
        // binds that both need two kinds never wait on each other in a
        // circle ([`crate::kind`]).
        let mut wanted = Vec::new();
        for kind in &self.kinds {
            let demands = kubelet::demands(&pod, &kind.spec.resource)
                .map_err(|e| format!("pod {who}: {e}"))?;
            if !demands.is_empty() {
                wanted.push((kind, kubelet::admission(&demands)));
            }
        }
        if wanted.is_empty() {
            self.binder.bind(args).await?;
            let resources: Vec<&str> = self
                .kinds
                .iter()
                .map(|k| k.spec.resource.as_str())
                .collect();
            return Ok(format!(
                "bound; {who} asks for no {}, so no lock was taken",
                resources.join(" or ")
            ));
        }
        wanted.sort_by(|(a, _), (b, _)| a.spec.scope.cmp(&b.spec.scope));
        let holder = Pod {
            uid: args.pod_uid.clone(),
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
        };
        // Taken for the node object under the name as the extender's watch
        // sees it: refused while Tether has another registered there.
        let node_uid = self.node_objects.uid_of(&args.node);
        // The node's locks first: binds to one node then claim devices one
        // at a time, in FIFO order, and never race each other for them.
        let mut holds = Vec::with_capacity(wanted.len());
        for (kind, admission) in &wanted {
            let calls = PodCalls {
                pod_uid: args.pod_uid.clone(),
                namespace: args.pod_namespace.clone(),
                name: args.pod_name.clone(),
                admission: admission.clone(),
            };
            let key = LockKey {
                scope: kind.spec.scope.clone(),
                name: args.node.clone(),
            };
            // An attempt the scheduler has left takes nothing more: another
            // client's acquire of the pod would take the hold over from a
            // later attempt that may be binding the pod now.
            if scheduler.is_gone() {
                self.leave(args, holds, &[], turn).await;
                return Err(format!(
                    "the scheduler gave up on binding {who} before it took {}/{}",
                    key.scope, key.name
                ));
            }
            let acquired = tokio::select! {
                acquired = self.client.acquire_for_node_object(
                    &key,
                    &node_uid,
                    &holder,
                    calls.to_payload(),
                    self.config.wait,
                    0,
                    |_| {},
                ) => acquired,
                () = scheduler.wait() => {
                    // One definite act: the wait ends, or a grant that raced the
                    // departure is given back to the next waiter — unless a
                    // later attempt has bound the pod to the node meanwhile.
                    if let Some(why) = self.keeps_holds(args).await {
                        return Err(format!(
                            "the scheduler gave up on binding {who} while it waited for {}/{}; \
                             what it took is kept: {why}",
                            key.scope, key.name
                        ));
                    }
                    self.withdraw(&key, args).await;
                    self.give_back_holds(args, holds, turn).await;
                    return Err(format!(
                        "the scheduler gave up on binding {who} while it waited for {}/{}; \
                         nothing was kept",
                        key.scope, key.name
                    ));
                }
            };
            match acquired {
                Ok(held) => holds.push(held),
                Err(err) => {
                    self.give_back_holds(args, holds, turn).await;
                    return Err(match err {
                        Error::DeadlineExceeded(_) => format!(
                            "node {} is busy: {who} did not get {}/{} within {:?}; retry",
                            args.node, key.scope, key.name, self.config.wait
                        ),
                        other => {
                            format!("cannot take {}/{} for {who}: {other}", key.scope, key.name)
                        }
                    });
                }
            }
        }
        // Each kind's claim names the token of that kind's hold: the bind
        // attempt that made it, and the only one that may end it.
        let mut claimed: Vec<Claimed> = Vec::with_capacity(wanted.len());
        for ((kind, admission), held) in wanted.iter().zip(&holds) {
            let attempt = held.token();
            match self
                .claim_devices(
                    kind,
                    args,
                    &node_uid,
                    admission.devices() as usize,
                    attempt,
                    scheduler,
                )
                .await
            {
                Ok(devices) => claimed.push(Claimed {
                    kind,
                    devices,
                    attempt,
                }),
                Err(error) if scheduler.is_gone() => {
                    self.leave(args, holds, &claimed, turn).await;
                    return Err(error);
                }
                Err(error) => {
                    self.give_back_holds(args, holds, turn).await;
                    for claim in claimed {
                        self.release_claim(&claim, args, "the bind failed").await;
                    }
                    return Err(error);
                }
            }
        }
        let tokens: Vec<u64> = holds.iter().map(|held| held.token()).collect();
        if scheduler.is_gone() {
            if let Some(why) = self.keeps_holds(args).await {
                return Err(format!(
                    "the scheduler gave up on binding {who} before the binding call; what it \
                     took is kept: {why}"
                ));
            }
            self.undo(args, holds, &claimed, "the scheduler gave up on the bind")
                .await;
            return Err(format!(
                "the scheduler gave up on binding {who} before the binding call; nothing was kept"
            ));
        }
        // A hold another attempt of the pod took over since (through
        // another extender replica, format 9) is not this attempt's to bind
        // with: that attempt binds, or gives the node back.
        for (held, (kind, _)) in holds.iter().zip(&wanted) {
            let key = LockKey {
                scope: kind.spec.scope.clone(),
                name: args.node.clone(),
            };
            let current = self
                .client
                .holder(&key)
                .await
                .map_err(|e| format!("cannot read the holder of {}/{}: {e}", key.scope, key.name))?
                .map(|hold| hold.token);
            if current != Some(held.token()) {
                for claim in &claimed {
                    self.release_claim(claim, args, "another attempt took the lock over")
                        .await;
                }
                return Err(format!(
                    "another bind attempt of {who} took {}/{} over (token {current:?}, this \
                     attempt's {}); this attempt binds nothing",
                    key.scope,
                    key.name,
                    held.token()
                ));
            }
        }
        let kept = match tokens.as_slice() {
            [token] => format!("lock {token} kept for the device plugin"),
            _ => format!("locks {tokens:?} kept for the device plugins"),
        };
        // From here the binding call runs to its end whatever the
        // scheduler does: a pod bound is a pod bound.
        if let Err(error) = self.binder.bind(args).await {
            // The binding may have gone through with its answer lost: only
            // a read that shows the pod not bound here undoes.
            match self.binder.pod(&args.pod_namespace, &args.pod_name).await {
                Ok(pod) if bound_here(&pod, args) => {
                    return Ok(format!(
                        "bound (the binding call answered {error:?}, but the pod is on the \
                         node); {kept}"
                    ));
                }
                Ok(_) => {
                    // Unreserve: give the node to the next waiter at once.
                    self.undo(args, holds, &claimed, "the bind failed").await;
                    return Err(error);
                }
                Err(read) => {
                    // Unknown: the pod may be bound and its Allocate need
                    // the hold. Kept: the scheduler's next attempt of the
                    // pod takes it up, and an unbound pod's hold ends at
                    // its hold timeout.
                    tracing::warn!(
                        pod_uid = args.pod_uid,
                        node = args.node,
                        error,
                        read,
                        "the binding call and the read after it both failed; the holds and claims are kept"
                    );
                    return Err(format!(
                        "{error}; and the pod cannot be read ({read}), so it may be bound: \
                         {kept}, and the pod's device claims"
                    ));
                }
            }
        }
        let devices: Vec<&String> = claimed.iter().flat_map(|c| &c.devices).collect();
        Ok(format!("bound with devices {devices:?}; {kept}"))
    }

    /// Why an attempt the scheduler left must keep what it took, if it
    /// must: the pod is bound to the node (another attempt of the pod got
    /// through, and its `Allocate` needs the hold), or it cannot be read
    /// (it may be).
    async fn keeps_holds(&self, args: &ExtenderBindingArgs) -> Option<String> {
        match self.binder.pod(&args.pod_namespace, &args.pod_name).await {
            Ok(pod) if bound_here(&pod, args) => Some(format!(
                "the pod is bound to {} (another attempt got through)",
                args.node
            )),
            Ok(_) => None,
            Err(err) => Some(format!("the pod cannot be read ({err}); it may be bound")),
        }
    }

    /// Leaves a bind whose scheduler went away: what it took is given
    /// back, unless [`Extender::keeps_holds`].
    async fn leave(
        &self,
        args: &ExtenderBindingArgs,
        holds: Vec<Held>,
        claimed: &[Claimed<'_>],
        turn: &Turn,
    ) {
        if holds.is_empty() && claimed.is_empty() {
            return;
        }
        if let Some(why) = self.keeps_holds(args).await {
            tracing::info!(
                pod_uid = args.pod_uid,
                node = args.node,
                why,
                "the scheduler left the bind; what it took is kept"
            );
            return;
        }
        self.give_back_holds(args, holds, turn).await;
        for claim in claimed {
            self.release_claim(claim, args, "the scheduler gave up on the bind")
                .await;
        }
    }

    /// Undoes a bind that got its locks and claims but will not bind: each
    /// hold released with outcome `failed`, then each claim, whatever it
    /// takes (not cut short by the bind's deadline).
    async fn undo(
        &self,
        args: &ExtenderBindingArgs,
        holds: Vec<Held>,
        claimed: &[Claimed<'_>],
        reason: &str,
    ) {
        for held in holds {
            let token = held.token();
            if let Err(err) = unbounded(held.release(Outcome::Failed)).await {
                tracing::error!(pod_uid = args.pod_uid, node = args.node, token, reason, %err, "release failed; the hold timeout or a pod revoke will free it");
            }
        }
        for claim in claimed {
            self.release_claim(claim, args, reason).await;
        }
    }

    /// Gives back the holds a bind took before it failed, with outcome
    /// `failed`. The scheduler hears once the node is given back, or at the
    /// bind's deadline, whichever comes first; past the deadline the
    /// release goes on in the background for as long as it takes (a claim
    /// fails at the deadline when Tether has no quorum, and so would the
    /// release, after the client's whole retry budget).
    async fn give_back_holds(&self, args: &ExtenderBindingArgs, holds: Vec<Held>, turn: &Turn) {
        if holds.is_empty() {
            return;
        }
        let (pod_uid, node) = (args.pod_uid.clone(), args.node.clone());
        // The pod's next attempt waits for these releases too: it would get
        // the same holds back (the same client), and lose them to them.
        let turn = turn.clone();
        let release = tokio::spawn(unbounded(async move {
            let _turn = turn;
            for held in holds {
                if let Err(err) = held.release(Outcome::Failed).await {
                    tracing::error!(pod_uid, node, %err, "release after a failed bind failed; the hold timeout or a pod revoke will free it");
                }
            }
        }));
        match tether_client::deadline::current() {
            Some(deadline) => {
                let deadline = tokio::time::Instant::from_std(deadline);
                let _ = tokio::time::timeout_at(deadline, release).await;
            }
            None => {
                let _ = release.await;
            }
        }
    }

    /// Takes the pod out of `key`'s queue, or gives back the hold it was
    /// granted as the scheduler left, in one command (`Withdraw`), retried
    /// as any write until the client's retry timeout. Dropping the acquire
    /// alone left the wait queued for the server's abandoned-wait grace, and
    /// a grant in that window went to a pod nobody would bind.
    async fn withdraw(&self, key: &LockKey, args: &ExtenderBindingArgs) {
        match unbounded(self.client.withdraw(key, &args.pod_uid)).await {
            Ok(withdrawn) => {
                tracing::debug!(pod_uid = args.pod_uid, node = args.node, result = ?withdrawn.result(), "withdrew the acquire of a bind the scheduler left");
            }
            Err(err @ Error::FailedPrecondition(_)) => {
                // A member still reads only format 6 (an upgrade under
                // way): look for a hold once, as builds before did; the
                // server gives the wait up after its grace.
                tracing::warn!(pod_uid = args.pod_uid, node = args.node, %err, "cannot withdraw yet; releasing a hold if the pod has one");
                self.give_back(key, args).await;
            }
            Err(err) => {
                tracing::error!(pod_uid = args.pod_uid, node = args.node, %err, "cannot withdraw the acquire of a bind the scheduler left; the server gives the wait up after its abandoned-wait grace, and a hold nobody took up with it")
            }
        }
    }

    /// Releases `key` if the pod holds it (during an upgrade, when
    /// [`Extender::withdraw`] is refused).
    async fn give_back(&self, key: &LockKey, args: &ExtenderBindingArgs) {
        match unbounded(self.client.holder(key)).await {
            Ok(Some(hold)) if hold.pod.as_ref().is_some_and(|p| p.uid == args.pod_uid) => {
                if let Err(err) =
                    unbounded(
                        self.client
                            .release(key, &args.pod_uid, hold.token, Outcome::Failed),
                    )
                    .await
                {
                    tracing::error!(pod_uid = args.pod_uid, node = args.node, %err, "cannot give back a hold the scheduler left; the hold timeout or a pod revoke will free it");
                }
            }
            Ok(_) => {}
            Err(err) => {
                tracing::error!(pod_uid = args.pod_uid, node = args.node, %err, "cannot check for a hold the scheduler left; the hold timeout or a pod revoke will free it")
            }
        }
    }

    /// Finds the pods an earlier extender (before a restart, or another
    /// replica that stopped) refused and the scheduler has parked: pending,
    /// `PodScheduled=False` with this filter's reason. Each is remembered as
    /// refused on every node whose devices (of the first kind it asks for)
    /// are published, to be asked about once devices fit. Returns how many.
    pub async fn recover_refusals(&self) -> Result<usize, String> {
        let pods = self.binder.unbound_pods().await?;
        let mut nodes_of_kind = Vec::with_capacity(self.kinds.len());
        for kind in &self.kinds {
            let published = published_inventories(&self.client, &kind.spec.inventory_set)
                .await
                .map_err(|e| format!("cannot read the devices the nodes published: {e}"))?;
            let nodes: BTreeMap<String, usize> = published
                .iter()
                .map(|(node, devices)| (node.clone(), healthy_ids(devices).len()))
                .collect();
            nodes_of_kind.push(nodes);
        }
        let mut recovered = 0;
        for pod in pods.iter().filter(|p| refused_by_filter(p)) {
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            if self.refusals.get(&uid).is_some() {
                continue;
            }
            // Every kind it asks for, on every node that published it:
            // asked about once a node has all of them free.
            let needs: BTreeMap<usize, usize> = self
                .kinds
                .iter()
                .enumerate()
                .filter_map(|(index, kind)| {
                    let demands = kubelet::demands(pod, &kind.spec.resource).ok()?;
                    let needed = kubelet::admission(&demands).devices() as usize;
                    (needed > 0).then_some((index, needed))
                })
                .collect();
            let mut nodes: BTreeMap<String, BTreeMap<usize, usize>> = BTreeMap::new();
            for kind in needs.keys() {
                for (node, count) in &nodes_of_kind[*kind] {
                    nodes.entry(node.clone()).or_default().insert(*kind, *count);
                }
            }
            // A node must offer every kind.
            nodes.retain(|_, kinds| kinds.len() == needs.len());
            if needs.is_empty() || nodes.is_empty() {
                continue;
            }
            self.refusals
                .refused(Refusal::of(pod, uid, needs, nodes, true));
            recovered += 1;
        }
        Ok(recovered)
    }

    /// One pass of the requeuer: reads the claims of every kind a refusal
    /// concerns (where the filter reads them) and nudges the refused pods
    /// that now fit a node they were refused on, in every kind they were
    /// short of there. Returns how many were asked about.
    pub async fn requeue_pass(&self) -> usize {
        let now = Instant::now();
        let standing = self.refusals.standing(now);
        if standing.is_empty() {
            return 0;
        }
        let kinds: BTreeSet<usize> = standing.iter().flat_map(Refusal::kinds).collect();
        let mut claimed = BTreeMap::new();
        for index in kinds {
            let Some(kind) = self.kinds.get(index) else {
                continue;
            };
            match self.claimed_counts(kind).await {
                Some(counts) => {
                    claimed.insert(index, counts);
                }
                // Unknown claims of a kind: nobody is asked this pass
                // (a pod short of it may not fit).
                None => return 0,
            }
        }
        self.nudge_fitting(&standing, &claimed, now, NUDGES_PER_PASS)
            .await
    }

    /// How many devices of `kind` live pods claim, per node: from the
    /// filter's own copy when it is whole (a pod is asked about when the
    /// copy its filter will read shows the devices freed), else from
    /// Tether; `None` when neither can be read.
    async fn claimed_counts(&self, kind: &Kind) -> Option<BTreeMap<String, usize>> {
        let claims = match kind.view.read(Pins::live_claims_by_node) {
            Some(claims) => Ok(claims),
            None => kind.ledger.live_claims_by_node().await,
        };
        match claims {
            Ok(claims) => Some(
                claims
                    .iter()
                    .map(|(node, devices)| (node.clone(), devices.len()))
                    .collect(),
            ),
            Err(err) => {
                tracing::warn!(%err, kind = kind.spec.resource, "cannot read the device claims to ask about refused pods; next pass");
                None
            }
        }
    }

    /// Nudges up to `limit` of `standing` that now fit a node they were
    /// refused on, given `claimed` (kind -> node -> claimed devices).
    async fn nudge_fitting(
        &self,
        standing: &[Refusal],
        claimed: &BTreeMap<usize, BTreeMap<String, usize>>,
        now: Instant,
        limit: usize,
    ) -> usize {
        let mut asked = 0;
        for (uid, node) in to_nudge(standing, claimed, now, limit) {
            let Some(refusal) = standing.iter().find(|r| r.uid == uid) else {
                continue;
            };
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis()
                .to_string();
            match self
                .binder
                .nudge(&refusal.namespace, &refusal.name, &uid, &stamp)
                .await
            {
                Ok(Nudged::Asked) => {
                    if refusal.recovered {
                        // Asked once; the filter records it again if it
                        // still does not fit.
                        self.refusals.settled(&uid);
                    } else {
                        self.refusals.nudged(&uid, &node, Instant::now());
                    }
                    self.metrics.nudge();
                    asked += 1;
                    tracing::info!(
                        pod_uid = uid,
                        pod = format!("{}/{}", refusal.namespace, refusal.name),
                        node,
                        refused_ms = now
                            .saturating_duration_since(refusal.refused_at)
                            .as_millis() as u64,
                        "devices freed on a node the pod was refused: asked the scheduler again"
                    );
                }
                Ok(Nudged::Gone) => self.refusals.settled(&uid),
                Err(err) => tracing::warn!(
                    pod_uid = uid,
                    err,
                    "cannot ask the scheduler about a refused pod; next pass"
                ),
            }
        }
        asked
    }
}

/// Largest request body accepted: a filter call of a scheduler that is not
/// node-cache capable carries every candidate Node object.
const MAX_REQUEST: usize = 64 * 1024 * 1024;

/// The extender's routes: `POST <urlPrefix>/filter` and
/// `POST <urlPrefix>/bind` under any prefix (the scheduler configuration's
/// `urlPrefix`), `GET /health` and `GET /metrics`. Each request learns when its client
/// closes the connection ([`tether_http::departure`]); a bind runs in a task
/// of its own so that it can leave the queue and give back what it took
/// after kube-scheduler has gone.
pub fn router<B: Binder>(extender: Arc<Extender<B>>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async { tether_http::text(StatusCode::OK, "ok\n") }),
        )
        .route(
            "/metrics",
            get(|State(extender): State<Arc<Extender<B>>>| async move {
                tether_http::metrics::response(extender.metrics.render())
            }),
        )
        .route("/{*verb}", post(verb::<B>))
        .layer(DefaultBodyLimit::max(MAX_REQUEST))
        .layer(axum::middleware::from_fn(detect_departure))
        .with_state(extender)
}

/// `POST .../bind` with `ExtenderBindingArgs`, `POST .../filter` with
/// `ExtenderArgs`; anything else is not found.
async fn verb<B: Binder>(
    State(extender): State<Arc<Extender<B>>>,
    Path(path): Path<String>,
    scheduler: Departure,
    body: Bytes,
) -> Response {
    let path = format!("/{}", path.trim_end_matches('/'));
    if path.ends_with("/bind") {
        let result = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
            Ok(args) if args.pod_uid.is_empty() || args.node.is_empty() => ExtenderBindingResult {
                error: "bind request without PodUID or Node".into(),
            },
            Ok(args) => {
                Departure::run_detached(async move { extender.bind(&args, &scheduler).await }).await
            }
            Err(err) => ExtenderBindingResult {
                error: format!("malformed ExtenderBindingArgs: {err}"),
            },
        };
        json(&result)
    } else if path.ends_with("/filter") {
        let result = match serde_json::from_slice::<ExtenderArgs>(&body) {
            Ok(args) => extender.filter(args).await,
            Err(err) => ExtenderFilterResult {
                error: format!("malformed ExtenderArgs: {err}"),
                ..Default::default()
            },
        };
        json(&result)
    } else {
        tether_http::text(
            StatusCode::NOT_FOUND,
            "the extender serves POST .../filter, POST .../bind and GET /health\n",
        )
    }
}

fn json(value: &impl Serialize) -> Response {
    tether_http::json(StatusCode::OK, value)
}

/// Serves the extender on `listener` until `shutdown` resolves.
pub async fn serve_extender<B: Binder>(
    listener: TcpListener,
    extender: Arc<Extender<B>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    // Stopped with the server, also when this future is dropped.
    let _requeuer = AbortOnDrop(tokio::spawn(requeue_refused(extender.clone())));
    let views = extender.device_views();
    let _views: Vec<AbortOnDrop> = views
        .iter()
        .map(|view| AbortOnDrop(tokio::spawn(view.clone().follow())))
        .collect();
    let nodes = extender.clone();
    let _nodes = AbortOnDrop(tokio::spawn(async move {
        nodes.binder.follow_nodes(nodes.node_objects.clone()).await
    }));
    let deletions = extender.clone();
    let _deletions = AbortOnDrop(tokio::spawn(async move {
        deletions
            .binder
            .follow_deletions(Arc::new(move |uid: &str| {
                for view in &views {
                    view.pod_deleted(uid);
                }
            }))
            .await
    }));
    tether_http::serve(listener, router(extender), shutdown).await;
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs [`Extender::requeue_pass`] every [`POLL_INTERVAL`] (a pass with no
/// refused pod reads nothing).
/// First finds the pods an earlier extender refused
/// ([`Extender::recover_refusals`], again every [`RECOVER_RETRY`] until it
/// succeeds).
pub async fn requeue_refused<B: Binder>(extender: Arc<Extender<B>>) {
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut recover_at = Some(Instant::now());
    let views = extender.device_views();
    loop {
        // Every poll interval (a nudge lost, a refusal recovered), and at
        // once when the filter's copy sees devices freed: a pod refused
        // just before a claim ended is asked about again in milliseconds,
        // not up to a poll interval later.
        tokio::select! {
            _ = tick.tick() => {}
            _ = futures::future::select_all(views.iter().map(|view| Box::pin(view.freed()))) => {}
        }
        if let Some(at) = recover_at
            && Instant::now() >= at
        {
            match extender.recover_refusals().await {
                Ok(count) => {
                    tracing::info!(
                        count,
                        "pods an earlier extender refused, to ask about again once devices free up"
                    );
                    recover_at = None;
                }
                Err(err) => {
                    tracing::warn!(
                        err,
                        "cannot look for pods an earlier extender refused yet; retrying"
                    );
                    recover_at = Some(Instant::now() + RECOVER_RETRY);
                }
            }
        }
        extender.requeue_pass().await;
    }
}

/// How long [`requeue_refused`] waits before looking again for pods an
/// earlier extender refused, after a failed look.
const RECOVER_RETRY: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, allocatable: Option<&str>) -> KubeNode {
        let mut node = serde_json::json!({"metadata": {"name": name},
            "status": {"allocatable": {"cpu": "4"}}});
        if let Some(count) = allocatable {
            node["status"]["allocatable"]["tether.io/gpu"] = count.into();
        }
        serde_json::from_value(node).unwrap()
    }

    #[test]
    fn a_nodes_devices_are_its_allocatable_count_of_the_resource() {
        let inventory = |n: &KubeNode| node_inventory(n, "tether.io/gpu", "gpu");
        assert_eq!(
            inventory(&node("a", Some("3"))).unwrap(),
            ["gpu0", "gpu1", "gpu2"]
        );
        assert!(inventory(&node("b", None)).unwrap().is_empty());
        assert!(inventory(&node("c", Some("0"))).unwrap().is_empty());
        let err = inventory(&node("d", Some("1500m"))).unwrap_err();
        assert!(
            err.contains("node d") && err.contains("not a plain count"),
            "{err}"
        );
        let err = inventory(&node("e", Some("1Ki"))).unwrap_err();
        assert!(err.contains("not a plain count"), "{err}");
        let err = inventory(&node("f", Some("100000"))).unwrap_err();
        assert!(err.contains("at most 1024"), "{err}");
        let no_status: KubeNode =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "g"}})).unwrap();
        assert!(inventory(&no_status).unwrap().is_empty());
    }

    #[test]
    fn nodes_are_unfit_by_their_own_inventory_and_claims() {
        let devices = |n: usize| -> Vec<String> { (0..n).map(|i| format!("gpu{i}")).collect() };
        let inventory: BTreeMap<String, Result<Vec<String>, String>> = [
            ("big", Ok(devices(8))),
            ("small", Ok(devices(2))),
            ("none", Ok(Vec::new())),
            ("unread", Err("cannot read node unread: 503".to_string())),
        ]
        .into_iter()
        .map(|(n, d)| (n.to_string(), d))
        .collect();
        // On "small", another pod has gpu0 and this pod gpu1 (a retry).
        let claims: BTreeMap<String, BTreeMap<String, String>> = [(
            "small".to_string(),
            [("gpu0", "other"), ("gpu1", "me")]
                .into_iter()
                .map(|(d, u)| (d.to_string(), u.to_string()))
                .collect(),
        )]
        .into_iter()
        .collect();
        let candidates: Vec<String> = ["big", "small", "none", "unread", "unlisted"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (failed, never) =
            unfit_nodes(&candidates, 1, &inventory, &claims, "me", "tether.io/gpu");
        assert_eq!(failed.keys().collect::<Vec<_>>(), ["unlisted", "unread"]);
        assert_eq!(never.keys().collect::<Vec<_>>(), ["none"]);
        assert!(failed["unread"].contains("503"));
        let (failed, never) =
            unfit_nodes(&candidates, 2, &inventory, &claims, "me", "tether.io/gpu");
        assert!(
            failed["small"].contains("2 devices needed, 1 of 2 free"),
            "{failed:?}"
        );
        assert_eq!(never.keys().collect::<Vec<_>>(), ["none"]);
        let (failed, never) =
            unfit_nodes(&candidates, 0, &inventory, &claims, "me", "tether.io/gpu");
        assert!(
            failed.is_empty() && never.is_empty(),
            "no devices, no filtering"
        );
    }

    #[test]
    fn binding_args_use_the_schedulers_field_names() {
        let json = r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u-1","Node":"n1"}"#;
        let args: ExtenderBindingArgs = serde_json::from_str(json).unwrap();
        assert_eq!(args.pod_uid, "u-1");
        assert_eq!(
            serde_json::to_string(&ExtenderBindingResult {
                error: String::new()
            })
            .unwrap(),
            r#"{"Error":""}"#
        );
    }
}
