//! The comparator: HAMi's node lock, written out in the bench, so that the
//! same workloads run through the same scheduler against it.
//!
//! What it copies, and from where. The lock itself was read against HAMi's
//! `pkg/util/nodelock/nodelock.go` (`LockNode`, `SetNodeLock`,
//! `ReleaseNodeLock`, `ParseNodeLock`, `DefaultStrategy`); the filter, bind
//! and `Allocate` follow `../shared/BACKGROUND.md`:
//! - the lock is the node annotation `hami.io/mutex.lock`, value
//!   `<RFC 3339 time>,<namespace>,<pod name>`; one lock per node; the owner
//!   is namespace/name;
//! - acquire (`LockNode`): no lock → set it; older than 5 minutes, or held
//!   by another pod that is gone → released without the owner check, then
//!   set; otherwise refused ("node … has been locked within 5m0s"), also
//!   when the holder is this very pod;
//! - set (`SetNodeLock`): refused at once if the node is locked; else a GET
//!   and a merge patch carrying the node's `resourceVersion`, tried 5 times
//!   on any error, pauses from 100 ms doubling plus up to half again
//!   (`Jitter: 0.5`); the tries do not look at the lock again;
//! - release (`ReleaseNodeLock`): nothing without a lock or when the lock
//!   names another pod (unless the owner check is skipped); else GET and a
//!   patch removing it, tried the same way;
//! - in each process, one node's sets and releases go one at a time (its
//!   `nodeLockManager`);
//! - the bind (its scheduler's `Bind`, `pkg/scheduler/scheduler.go`) reads
//!   the pod and the node, locks the node once for each device kind the
//!   pod asks for (`lockAllDevices` calls each vendor backend's `LockNode`,
//!   and the backends share the one annotation, so a pod asking for two
//!   kinds is refused by its own first lock: HAMi-core #246, HAMi #2243,
//!   mended by HAMi #2255, merged 2026-08, which this comparator, read
//!   from the code before it, does not have), patches the pod
//!   (`hami.io/bind-phase=allocating`, the bind time in Unix seconds),
//!   then calls `pods/binding`; on a failed lock or binding it releases the
//!   lock and answers the error;
//! - not copied: the Kubernetes Events its scheduler records for each
//!   filter and bind (client-go's event broadcaster writes them apart,
//!   merged and rate-limited on its own);
//! - the filter picks the node and the devices (HAMi's default policy,
//!   binpack: the fullest node that fits) and writes the devices into the
//!   pod's annotations; a failed bind is backed off by kube-scheduler and
//!   tried again;
//! - the device plugin's `Allocate` carries no pod: it reads the node's lock
//!   to find the pod, reads the pod's devices from its annotation, sets
//!   `hami.io/bind-phase=success` and releases the lock;
//! - every call the scheduler side and each node's plugin make to the API
//!   server passes its own client-side rate limiter, as client-go's: HAMi's
//!   `pkg/util/client/options.go` takes client-go's `rest.DefaultQPS` (5)
//!   and `rest.DefaultBurst` (10) unless `--kube-qps` / `--kube-burst` say
//!   otherwise (its scheduler's `cmd/scheduler/main.go`).
//!
//! It keeps the devices in use per node in memory, from its own filter
//! choices, as HAMi's scheduler keeps its usage cache, and frees a pod's
//! when its watch of pods sees the pod deleted or ended, as HAMi's
//! informer does ([`AnnotationExtender::follow_pods`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use serde_json::json;
use tether_embed::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};

use crate::world::{RESOURCE, SECOND_RESOURCE, pod_selector};

/// The node annotation that is the lock.
pub const LOCK_ANNOTATION: &str = "hami.io/mutex.lock";
/// The pod annotation with the devices the filter chose.
pub const DEVICES_ANNOTATION: &str = "hami.io/devices-to-allocate";
/// The pod annotation the bind and `Allocate` move along.
pub const PHASE_ANNOTATION: &str = "hami.io/bind-phase";
/// A lock older than this is taken over.
const LOCK_TIMEOUT: Duration = Duration::from_secs(300);
/// Tries of one lock write, and the first pause between them (doubling).
const WRITE_TRIES: u32 = 5;
const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// Client-go's client-side rate limit (`QPS`, `Burst`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Requests per second, refilled continuously.
    pub qps: f64,
    /// Requests that may go at once from a full bucket.
    pub burst: f64,
}

impl RateLimit {
    /// HAMi's: client-go's defaults.
    pub const HAMI: RateLimit = RateLimit {
        qps: 5.0,
        burst: 10.0,
    };
}

/// A token bucket callers wait on before each request, as client-go's
/// `flowcontrol` token-bucket limiter: `qps` tokens a second up to `burst`,
/// each request takes one, a caller without one waits until it is due.
/// Written out here (a mutex over the bucket) rather than taking a
/// rate-limiting crate into the tree for one comparator of one bench.
pub struct Limiter {
    limit: Option<RateLimit>,
    /// Tokens (negative: owed by callers already waiting) and when counted
    /// (tokio's clock, so that a test can run it paused).
    bucket: Mutex<(f64, tokio::time::Instant)>,
}

impl Limiter {
    /// A limiter; `None` lets every request through at once.
    pub fn new(limit: Option<RateLimit>) -> Limiter {
        let tokens = limit.map_or(0.0, |l| l.burst);
        Limiter {
            limit,
            bucket: Mutex::new((tokens, tokio::time::Instant::now())),
        }
    }

    /// Waits until this caller's request may go.
    pub async fn wait(&self) {
        let Some(limit) = self.limit else {
            return;
        };
        let wait = {
            let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
            let now = tokio::time::Instant::now();
            let refilled = (bucket.0 + now.duration_since(bucket.1).as_secs_f64() * limit.qps)
                .min(limit.burst);
            // Take the token now, even if it is only due later: callers
            // queue in the order they asked, as with client-go's limiter.
            *bucket = (refilled - 1.0, now);
            if bucket.0 >= 0.0 {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(-bucket.0 / limit.qps)
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// The lock annotation of `node`, if it is locked.
fn lock_value(node: &Node) -> Option<String> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LOCK_ANNOTATION).cloned())
}

/// What an API call through a limited client can fail with.
fn api_error(what: &str, e: kube::Error) -> String {
    format!("{what}: {e}")
}

/// `<RFC 3339 time>,<namespace>,<name>`, or the older bare `<RFC 3339
/// time>` (no owner: namespace and name empty), parsed as HAMi's
/// `ParseNodeLock` does: any other number of parts is malformed.
fn parse_lock(value: &str) -> Option<(Instant, String, String)> {
    let parts: Vec<&str> = value.split(',').collect();
    match parts.as_slice() {
        [time] => Some((stamped_at(time)?, String::new(), String::new())),
        [time, namespace, name] => {
            Some((stamped_at(time)?, namespace.to_string(), name.to_string()))
        }
        _ => None,
    }
}

/// When a lock stamped `time` (RFC 3339, UTC, whole seconds, as the bench
/// writes it) was taken, as an `Instant` of this process.
fn stamped_at(time: &str) -> Option<Instant> {
    let stamped = parse_rfc3339_seconds(time)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs();
    let age = Duration::from_secs(now.saturating_sub(stamped));
    Instant::now().checked_sub(age)
}

/// Seconds since the epoch of `YYYY-MM-DDTHH:MM:SSZ`.
fn parse_rfc3339_seconds(time: &str) -> Option<u64> {
    let bytes = time.as_bytes();
    if bytes.len() != 20 || bytes[19] != b'Z' {
        return None;
    }
    let num = |range: std::ops::Range<usize>| time.get(range)?.parse::<u64>().ok();
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Seconds since the Unix epoch, now.
fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ`.
fn rfc3339_now() -> String {
    let secs = unix_seconds();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // The civil date from days (Howard Hinnant's algorithm, inverted).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

/// The pause before try `attempt + 1`: `base` doubled per try, plus up to
/// half of it again (`wait.Backoff` with `Factor: 2.0, Jitter: 0.5`, HAMi's
/// `DefaultStrategy`).
fn jittered(base: Duration, attempt: u32) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let jitter = f64::from(nanos % 1_000) / 1_000.0 * 0.5;
    (base * 2u32.pow(attempt)).mul_f64(1.0 + jitter)
}

/// The node lock, as HAMi's scheduler and device plugin take and release
/// it, through one limited client.
pub struct NodeLock {
    nodes: Api<Node>,
    client: kube::Client,
    limiter: Arc<Limiter>,
    /// One mutex per node: this process's sets and releases of one node's
    /// lock go one at a time (HAMi's `nodeLockManager`).
    serial: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl NodeLock {
    /// The lock over `client`, its calls through `limiter`.
    pub fn new(client: kube::Client, limiter: Arc<Limiter>) -> NodeLock {
        NodeLock {
            nodes: Api::all(client.clone()),
            client,
            limiter,
            serial: Mutex::default(),
        }
    }

    async fn get_node(&self, node: &str) -> Result<Node, String> {
        self.limiter.wait().await;
        self.nodes
            .get(node)
            .await
            .map_err(|e| api_error("reading the node", e))
    }

    /// Sets (`Some`) or removes (`None`) the lock on `node` as read at
    /// `resource_version`.
    async fn write(
        &self,
        node: &str,
        resource_version: Option<String>,
        value: Option<String>,
    ) -> Result<(), kube::Error> {
        self.limiter.wait().await;
        let patch = json!({"metadata": {
            "resourceVersion": resource_version,
            "annotations": {LOCK_ANNOTATION: value},
        }});
        self.nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }

    /// This process's mutex for `node`.
    fn serial(&self, node: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(node.to_string())
            .or_default()
            .clone()
    }

    /// `write` tried 5 times, each try on the node read afresh (HAMi's
    /// `retry.OnError` with `DefaultStrategy`, every error retried).
    async fn write_retried(
        &self,
        node: &str,
        value: Option<&str>,
        what: &str,
    ) -> Result<(), String> {
        let mut last = String::new();
        for attempt in 0..WRITE_TRIES {
            if attempt > 0 {
                tokio::time::sleep(jittered(FIRST_PAUSE, attempt - 1)).await;
            }
            let current = match self.get_node(node).await {
                Ok(current) => current,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            match self
                .write(
                    node,
                    current.metadata.resource_version,
                    value.map(str::to_string),
                )
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) => last = api_error(what, e),
            }
        }
        Err(format!("{what}, {WRITE_TRIES} tries: {last}"))
    }

    /// HAMi's `SetNodeLock`: refused at once if the node is locked; else the
    /// lock for `namespace/name` written, tried 5 times. The tries do not
    /// look at the lock again: each carries the `resourceVersion` it read,
    /// so only a write in between makes one fail.
    async fn set(&self, node: &str, namespace: &str, name: &str) -> Result<(), String> {
        let serial = self.serial(node);
        let _one_at_a_time = serial.lock().await;
        let current = self.get_node(node).await?;
        if lock_value(&current).is_some() {
            return Err(format!("node {node} is locked"));
        }
        let value = format!("{},{namespace},{name}", rfc3339_now());
        self.write_retried(node, Some(&value), "setting the node lock")
            .await
    }

    /// HAMi's `ReleaseNodeLock`: nothing to do without a lock, or (unless
    /// `owner` is None: the owner check skipped) when the lock is another
    /// pod's; else removed, tried 5 times.
    pub async fn release(&self, node: &str, owner: Option<(&str, &str)>) -> Result<(), String> {
        let serial = self.serial(node);
        let _one_at_a_time = serial.lock().await;
        let current = self.get_node(node).await?;
        let Some(value) = lock_value(&current) else {
            return Ok(());
        };
        if let Some((namespace, name)) = owner
            && !value.ends_with(&format!(",{namespace},{name}"))
        {
            return Ok(());
        }
        self.write_retried(node, None, "releasing the node lock")
            .await
    }

    /// Takes `node`'s lock for pod `namespace/name` (HAMi's `LockNode`): no
    /// lock → set it; an expired one, or one whose pod (another than this
    /// one) is gone → released without the owner check, then set; any
    /// other → refused, this pod's own included.
    pub async fn lock(&self, node: &str, namespace: &str, name: &str) -> Result<(), String> {
        let current = self.get_node(node).await?;
        let Some(value) = lock_value(&current) else {
            return self.set(node, namespace, name).await;
        };
        let (at, owner_namespace, owner) = parse_lock(&value)
            .ok_or_else(|| format!("malformed lock annotation {value:?} on node {node}"))?;
        let take_over = if at.elapsed() > LOCK_TIMEOUT {
            true
        } else if !owner_namespace.is_empty()
            && !owner.is_empty()
            && (owner_namespace != namespace || owner != name)
        {
            self.limiter.wait().await;
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &owner_namespace);
            match pods.get(&owner).await {
                Err(kube::Error::Api(e)) if e.code == 404 => true,
                Err(e) => return Err(api_error("reading the lock's owner", e)),
                Ok(_) => false,
            }
        } else {
            false
        };
        if !take_over {
            return Err(format!(
                "node {node} has been locked within {}m0s",
                LOCK_TIMEOUT.as_secs() / 60
            ));
        }
        self.release(node, None).await?;
        self.set(node, namespace, name).await
    }

    /// The pod holding `node`'s lock, as the device plugin finds it.
    pub async fn owner(&self, node: &str) -> Result<(String, String), String> {
        let current = self.get_node(node).await?;
        let value = lock_value(&current)
            .ok_or_else(|| format!("node {node} is not locked: no pod to allocate for"))?;
        parse_lock(&value)
            .map(|(_, namespace, name)| (namespace, name))
            .ok_or_else(|| format!("unreadable lock {value:?} on {node}"))
    }
}

/// Patches pod `namespace/name`'s annotations through `limiter`.
async fn annotate_pod(
    client: &kube::Client,
    limiter: &Limiter,
    namespace: &str,
    name: &str,
    annotations: serde_json::Value,
) -> Result<(), String> {
    limiter.wait().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
    )
    .await
    .map(|_| ())
    .map_err(|e| api_error("annotating the pod", e))
}

/// HAMi's scheduler side: filter (node and devices) and bind (the lock).
pub struct AnnotationExtender {
    client: kube::Client,
    limiter: Arc<Limiter>,
    lock: NodeLock,
    gpus: usize,
    /// Node → device → pod UID, from the filter's choices.
    used: Mutex<BTreeMap<String, BTreeMap<String, String>>>,
}

impl AnnotationExtender {
    /// The scheduler side over `client`, every call through one limiter of
    /// `limit`; nodes have `gpus` devices `gpu0..`.
    pub fn new(client: kube::Client, limit: Option<RateLimit>, gpus: usize) -> Arc<Self> {
        let limiter = Arc::new(Limiter::new(limit));
        Arc::new(AnnotationExtender {
            lock: NodeLock::new(client.clone(), limiter.clone()),
            client,
            limiter,
            gpus,
            used: Mutex::default(),
        })
    }

    /// Follows the bench's pods as HAMi's scheduler follows pods with its
    /// informer (`onDelPod`, and `onUpdatePod` for a pod that has ended):
    /// a deleted or finished pod's devices are free in the usage cache.
    /// Runs until dropped.
    pub async fn follow_pods(self: Arc<Self>) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().labels(&pod_selector());
        let events = watcher(pods, config).default_backoff();
        futures::pin_mut!(events);
        loop {
            let pod = match events.try_next().await {
                Ok(Some(watcher::Event::Delete(pod))) => pod,
                Ok(Some(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)))
                    if pod
                        .status
                        .as_ref()
                        .and_then(|s| s.phase.as_deref())
                        .is_some_and(|p| p == "Succeeded" || p == "Failed") =>
                {
                    pod
                }
                Ok(Some(_)) => continue,
                Ok(None) => return,
                Err(err) => {
                    tracing::warn!(%err, "the annotation lock's pod watch failed; it backs off and resumes");
                    continue;
                }
            };
            if let Some(uid) = &pod.metadata.uid {
                self.forget(uid);
            }
        }
    }

    /// A pod is gone: its devices are free in the usage cache.
    pub fn forget(&self, uid: &str) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        for devices in used.values_mut() {
            devices.retain(|_, owner| owner != uid);
        }
    }

    /// The filter: the fullest node among the candidates with enough free
    /// devices (binpack), the devices written into the pod's annotations.
    async fn filter(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        let Some(pod) = args.pod else {
            return ExtenderFilterResult {
                error: "no pod in ExtenderArgs".into(),
                ..Default::default()
            };
        };
        let wanted = tether_embed::kubelet::demands(&pod, RESOURCE)
            .map(|d| d.iter().map(|c| c.count as usize).sum::<usize>())
            .unwrap_or(0);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let candidates = args.node_names.unwrap_or_default();
        let chosen = {
            let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
            // A pod filtered again (its bind failed) gives its choice back.
            for devices in used.values_mut() {
                devices.retain(|_, owner| *owner != uid);
            }
            let free_on = |node: &str, used: &BTreeMap<String, BTreeMap<String, String>>| {
                self.gpus - used.get(node).map_or(0, BTreeMap::len)
            };
            let best = candidates
                .iter()
                .filter(|n| free_on(n, &used) >= wanted)
                .min_by_key(|n| (free_on(n, &used), n.to_string()))
                .cloned();
            best.map(|node| {
                let taken = used.entry(node.clone()).or_default();
                let devices: Vec<String> = (0..self.gpus)
                    .map(|i| format!("gpu{i}"))
                    .filter(|d| !taken.contains_key(d))
                    .take(wanted)
                    .collect();
                for d in &devices {
                    taken.insert(d.clone(), uid.clone());
                }
                (node, devices)
            })
        };
        let Some((node, devices)) = chosen else {
            return ExtenderFilterResult {
                node_names: Some(Vec::new()),
                failed_nodes: candidates
                    .into_iter()
                    .map(|n| (n, "not enough free devices".to_string()))
                    .collect(),
                ..Default::default()
            };
        };
        let (namespace, name) = (
            pod.metadata.namespace.clone().unwrap_or_default(),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        if let Err(e) = annotate_pod(
            &self.client,
            &self.limiter,
            &namespace,
            &name,
            json!({DEVICES_ANNOTATION: devices.join(",")}),
        )
        .await
        {
            self.forget(&uid);
            return ExtenderFilterResult {
                error: e,
                ..Default::default()
            };
        }
        ExtenderFilterResult {
            node_names: Some(vec![node]),
            ..Default::default()
        }
    }

    /// The bind: the node's lock, the pod's bind phase, the binding; the
    /// lock released on any failure.
    async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        let (namespace, name, node) = (&args.pod_namespace, &args.pod_name, &args.node);
        // HAMi's `Bind` reads the pod and the node before it locks.
        self.limiter.wait().await;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let pod = match pods.get(name).await {
            Ok(pod) => pod,
            Err(e) => {
                return ExtenderBindingResult {
                    error: api_error("reading the pod", e),
                };
            }
        };
        // One `LockNode` per device kind (vendor backend) the pod asks for,
        // as `lockAllDevices` makes them: every backend's is this one
        // annotation.
        let kinds = [RESOURCE, SECOND_RESOURCE]
            .into_iter()
            .filter(|resource| {
                tether_embed::kubelet::demands(&pod, resource).is_ok_and(|d| !d.is_empty())
            })
            .count()
            .max(1);
        self.limiter.wait().await;
        if let Err(e) = Api::<Node>::all(self.client.clone()).get(node).await {
            return ExtenderBindingResult {
                error: api_error("reading the node", e),
            };
        }
        for taken in 0..kinds {
            if let Err(e) = self.lock.lock(node, namespace, name).await {
                if taken > 0 {
                    // HAMi-core #246: the pod's own first lock refused the
                    // second; the bind fails and gives the lock back.
                    let _ = self.lock.release(node, Some((namespace, name))).await;
                }
                return ExtenderBindingResult { error: e };
            }
        }
        let bound = async {
            annotate_pod(
                &self.client,
                &self.limiter,
                namespace,
                name,
                json!({PHASE_ANNOTATION: "allocating", "hami.io/bind-time": unix_seconds().to_string()}),
            )
            .await?;
            self.limiter.wait().await;
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
            let binding = json!({
                "apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": args.pod_uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            });
            pods.create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &Default::default(),
                &binding,
            )
            .await
            .map(|_| ())
            .map_err(|e| api_error("binding the pod", e))
        }
        .await;
        match bound {
            Ok(()) => ExtenderBindingResult {
                error: String::new(),
            },
            Err(e) => {
                let _ = self.lock.release(node, Some((namespace, name))).await;
                ExtenderBindingResult { error: e }
            }
        }
    }
}

impl crate::verbs::Verbs for AnnotationExtender {
    async fn filter(&self, args: ExtenderArgs) -> ExtenderFilterResult {
        AnnotationExtender::filter(self, args).await
    }

    async fn bind(&self, args: ExtenderBindingArgs) -> ExtenderBindingResult {
        AnnotationExtender::bind(self, args).await
    }
}

/// HAMi's device plugin side on one node: `Allocate` finds the pod through
/// the lock, answers with the pod's devices, and releases the lock.
pub struct AnnotationPlugin {
    node: String,
    client: kube::Client,
    limiter: Arc<Limiter>,
    lock: NodeLock,
}

impl AnnotationPlugin {
    /// The plugin of `node` over its own client and limiter.
    pub fn new(node: &str, client: kube::Client, limit: Option<RateLimit>) -> AnnotationPlugin {
        let limiter = Arc::new(Limiter::new(limit));
        AnnotationPlugin {
            node: node.to_string(),
            lock: NodeLock::new(client.clone(), limiter.clone()),
            client,
            limiter,
        }
    }

    /// One `Allocate` (the kubelet's ids are not used: the devices are the
    /// pod's annotation's). Returns the devices given.
    pub async fn allocate(&self) -> Result<Vec<String>, String> {
        let (namespace, name) = self.lock.owner(&self.node).await?;
        self.limiter.wait().await;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let pod = pods
            .get(&name)
            .await
            .map_err(|e| api_error("reading the pod the lock names", e))?;
        let devices: Vec<String> = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(DEVICES_ANNOTATION))
            .map(|d| d.split(',').map(str::to_string).collect())
            .unwrap_or_default();
        annotate_pod(
            &self.client,
            &self.limiter,
            &namespace,
            &name,
            json!({PHASE_ANNOTATION: "success"}),
        )
        .await?;
        self.lock
            .release(&self.node, Some((&namespace, &name)))
            .await?;
        Ok(devices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_stamps_read_back_as_written() {
        let now = rfc3339_now();
        let (at, namespace, name) = parse_lock(&format!("{now},ns,pod-1")).unwrap();
        assert!(at.elapsed() < Duration::from_secs(5), "{now}");
        assert_eq!((namespace.as_str(), name.as_str()), ("ns", "pod-1"));
        assert_eq!(
            parse_rfc3339_seconds("2026-12-05T00:00:00Z"),
            Some(1_796_428_800)
        );
        assert_eq!(parse_rfc3339_seconds("1970-01-01T00:00:01Z"), Some(1));
        let (_, namespace, name) = parse_lock(&now).unwrap();
        assert_eq!((namespace.as_str(), name.as_str()), ("", ""));
        assert!(parse_lock("not a lock").is_none());
        assert!(parse_lock(&format!("{now},ns")).is_none());
    }

    #[tokio::test]
    async fn the_limiter_lets_a_burst_through_then_paces_at_its_rate() {
        // 10 a second, 10 at once: the first 10 go, the next 5 take 0.5 s.
        let limiter = Limiter::new(Some(RateLimit {
            qps: 10.0,
            burst: 10.0,
        }));
        let started = tokio::time::Instant::now();
        for _ in 0..10 {
            limiter.wait().await;
        }
        let burst = started.elapsed();
        for _ in 0..5 {
            limiter.wait().await;
        }
        let paced = started.elapsed();
        // Lower bounds only are certain; the upper ones are loose, for a
        // loaded machine.
        assert!(burst < Duration::from_millis(400), "{burst:?}");
        assert!(paced >= Duration::from_millis(450), "{paced:?}");
        assert!(paced < Duration::from_secs(5), "{paced:?}");
        let unlimited = Limiter::new(None);
        let started = tokio::time::Instant::now();
        for _ in 0..1000 {
            unlimited.wait().await;
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
