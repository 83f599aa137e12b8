//! What the bridge reads from Pods and Nodes, and the commands it sends.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};

/// A pod's phase, as Kubernetes reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Accepted, not all containers running yet.
    Pending,
    /// Bound and at least one container running.
    Running,
    /// All containers terminated successfully.
    Succeeded,
    /// All containers terminated, at least one in failure.
    Failed,
    /// Unknown (e.g. the node is unreachable).
    Unknown,
}

impl Phase {
    /// Whether the pod is done for good.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Succeeded | Phase::Failed)
    }
}

/// The parts of a Pod the bridge looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// The UID: the identity Tether keys on.
    pub uid: String,
    /// Namespace (for logs).
    pub namespace: String,
    /// Name (for logs).
    pub name: String,
    /// Phase.
    pub phase: Phase,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Some container, init containers and sidecars included, has started
    /// or run (so `Allocate` has happened).
    pub started: bool,
    /// `spec.nodeName` is set: the scheduler's bind has happened.
    pub bound: bool,
}

impl PodView {
    /// Reads a Pod; `None` without a UID (not a stored object).
    pub fn from_pod(pod: &Pod) -> Option<PodView> {
        let meta = &pod.metadata;
        let uid = meta.uid.clone()?;
        let status = pod.status.as_ref();
        let phase = match status.and_then(|s| s.phase.as_deref()) {
            Some("Running") => Phase::Running,
            Some("Succeeded") => Phase::Succeeded,
            Some("Failed") => Phase::Failed,
            Some("Pending") | None => Phase::Pending,
            Some(_) => Phase::Unknown,
        };
        // Any container the kubelet has started, init containers and
        // sidecars (restartable init containers) included: the kubelet calls
        // `Allocate` at admission, before the first of them runs.
        let started = status.is_some_and(|s| {
            let init = s.init_container_statuses.iter().flatten();
            let main = s.container_statuses.iter().flatten();
            init.chain(main).any(|c| {
                c.started == Some(true)
                    || c.restart_count > 0
                    || c.state
                        .as_ref()
                        .is_some_and(|st| st.running.is_some() || st.terminated.is_some())
                    || c.last_state
                        .as_ref()
                        .is_some_and(|st| st.terminated.is_some())
            })
        });
        Some(PodView {
            uid,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            phase,
            deleting: meta.deletion_timestamp.is_some(),
            started,
            bound: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| !n.is_empty()),
        })
    }
}

/// The parts of a Node the bridge looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// Node UID.
    pub uid: String,
    /// Labels (affinity topology).
    pub labels: BTreeMap<String, String>,
    /// The Ready condition is True.
    pub ready: bool,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
}

impl NodeView {
    /// Reads a Node; `None` without a name.
    pub fn from_node(node: &Node) -> Option<NodeView> {
        let meta = &node.metadata;
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        Some(NodeView {
            name: meta.name.clone()?,
            uid: meta.uid.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            ready,
            unschedulable: node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false),
        })
    }
}

/// Where a pod is in its lifecycle, as far as Tether must know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    /// Not bound to a node yet: the scheduler's bind has not happened, so
    /// Tether hears nothing and the hold timeout applies to its holds (a
    /// bind that never comes must not keep the node's lock).
    Unbound,
    /// Bound, no container started: the kubelet is admitting it (its
    /// `Allocate` may be slow). Its holds outlive the hold timeout.
    Starting,
    /// Some container started.
    Running,
    /// Succeeded or Failed (evicted pods are Failed).
    Terminal,
    /// Being deleted before it was bound: the API server refuses a bind
    /// to a pod with a `deletionTimestamp`, so no kubelet will ever admit
    /// it. A bound pod being deleted is not gone (its init container, a
    /// sidecar or a stuck image pull may still hold what the kubelet
    /// allocated): it is gone when its delete event arrives, or a GET
    /// answers 404 or another UID.
    Gone,
}

impl PodState {
    /// What to tell Tether of a pod in this state (nothing while unbound).
    pub fn report(self) -> Option<PodReport> {
        match self {
            PodState::Unbound => None,
            PodState::Starting => Some(PodReport::Starting),
            PodState::Running => Some(PodReport::Running),
            PodState::Terminal => Some(PodReport::Terminal),
            PodState::Gone => Some(PodReport::Gone),
        }
    }
}

impl PodView {
    /// The pod's lifecycle state.
    pub fn state(&self) -> PodState {
        // A planted bug for the trace replay (`bridge-deleting-is-gone`,
        // set with `fail::cfg`): every deleting pod counts as gone, as
        // before issue 34, while a bound one may still run init containers.
        let gone_at_once = !self.bound || fail::eval("bridge-deleting-is-gone", |_| ()).is_some();
        if self.deleting && gone_at_once {
            PodState::Gone
        } else if self.phase.is_terminal() {
            PodState::Terminal
        } else if self.started {
            PodState::Running
        } else if self.bound {
            PodState::Starting
        } else {
            PodState::Unbound
        }
    }
}

/// What a pod report says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodReport {
    /// Alive, containers not started.
    Starting,
    /// Containers started.
    Running,
    /// Succeeded or Failed.
    Terminal,
    /// Deleted (or being force-deleted).
    Gone,
}

/// What a node report says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeReport {
    /// Exists (first seen, or labels / schedulability changed).
    Joined,
    /// Ready.
    Ready,
    /// Not ready.
    NotReady,
    /// Gone: NotFound after a list.
    Gone,
}

/// A command for Tether. All are idempotent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Report a pod's phase (`Gone` / `Terminal` revoke its pod lease).
    Pod {
        /// Pod UID.
        uid: String,
        /// What to report.
        report: PodReport,
    },
    /// Report a node.
    Node {
        /// Node name.
        name: String,
        /// Node UID.
        uid: String,
        /// What to report.
        report: NodeReport,
        /// Labels to set, if this report carries them.
        labels: Option<BTreeMap<String, String>>,
        /// Schedulability to set, if this report carries it.
        unschedulable: Option<bool>,
    },
    /// A node delete event: check with a GET (NotFound, or another node
    /// under the name → report this node gone); a delete event alone is a
    /// hint.
    ConfirmNodeGone {
        /// Node name.
        name: String,
        /// UID of the node object the event was about.
        uid: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_are_read_from_their_api_objects() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train-0", "namespace": "ml", "uid": "u1",
                         "deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 0},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0, "started": true,
                 "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
            ]}
        }))
        .unwrap();
        let view = PodView::from_pod(&pod).unwrap();
        assert_eq!(
            (view.uid.as_str(), view.phase, view.deleting, view.started),
            ("u1", Phase::Running, true, true)
        );
        let pending: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"uid": "u2"}})).unwrap();
        let view = PodView::from_pod(&pending).unwrap();
        assert_eq!(
            (view.phase, view.started, view.deleting),
            (Phase::Pending, false, false)
        );
    }

    /// What counts as started: any init container, sidecar or container
    /// that runs, ran or restarted. Waiting for an image with nothing run
    /// before is not started.
    #[test]
    fn init_containers_sidecars_and_restarts_count_as_started() {
        let status = |status: serde_json::Value| {
            let pod: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"uid": "u"}, "status": status
            }))
            .unwrap();
            PodView::from_pod(&pod).unwrap().started
        };
        let waiting = serde_json::json!({"name": "main", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}});
        let init_running = serde_json::json!({"name": "init", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"running": {}}});
        let init_done = serde_json::json!({"name": "init", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 0}}});
        let sidecar_started = serde_json::json!({"name": "proxy", "image": "i", "imageID": "",
            "ready": false, "restartCount": 0, "started": true, "state": {"waiting": {}}});
        let crash_loop = serde_json::json!({"name": "main", "image": "i", "imageID": "", "ready": false,
            "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1}}});
        assert!(!status(
            serde_json::json!({"phase": "Pending", "containerStatuses": [waiting]})
        ));
        for (shape, started) in [
            (
                "init running",
                serde_json::json!({"initContainerStatuses": [init_running], "containerStatuses": [waiting]}),
            ),
            (
                "init done",
                serde_json::json!({"initContainerStatuses": [init_done], "containerStatuses": [waiting]}),
            ),
            (
                "sidecar started",
                serde_json::json!({"initContainerStatuses": [sidecar_started]}),
            ),
            (
                "crash loop",
                serde_json::json!({"containerStatuses": [crash_loop]}),
            ),
        ] {
            assert!(status(started), "{shape}");
        }
    }

    #[test]
    fn nodes_are_read_from_their_api_objects() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "uid": "nu", "labels": {"topology.kubernetes.io/zone": "a"}},
            "spec": {"unschedulable": true},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let view = NodeView::from_node(&node).unwrap();
        assert!(view.ready && view.unschedulable);
        assert_eq!(view.labels["topology.kubernetes.io/zone"], "a");
    }
}
