//! What Tether knows that Kubernetes may no longer have, and how the bridge
//! makes sure before it tells Tether.
//!
//! Delete events are lost when the bridge is down or its watch breaks, so on
//! every list and on a periodic resync the bridge compares what Tether cares
//! about with its own cache of the cluster. A difference is only a
//! *candidate*: the cache can be behind (a pod created and bound during a
//! paginated list, a watch that is erroring, a node the other bridge replica
//! reported first), and revoking a live pod's hold hands its devices to
//! another pod. So a candidate is reported gone only when it is positively
//! known gone:
//! - the bridge saw its delete event (a tombstone), or
//! - a GET of its namespace/name (pods) or name (nodes) answers 404, or an
//!   object with another UID (the name was reused).
//!
//! A candidate whose GET fails, or whose name the bridge does not know (a
//! pin's owner it has never seen), is left for the next resync.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Command, NodeReport, NodeView, PodReport, PodView};

/// What Tether holds that the comparison looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TetherView {
    /// Pod UIDs that hold, wait for or are pinned by something.
    pub pod_uids: BTreeSet<String>,
    /// Live (not gone) nodes in Tether's registry: name → node UID (empty
    /// when the registry does not know it).
    pub nodes: BTreeMap<String, String>,
}

/// What the bridge's cache of the cluster shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveView {
    /// UIDs of cached pods.
    pub pod_uids: BTreeSet<String>,
    /// Cached nodes, by name.
    pub nodes: BTreeMap<String, NodeView>,
}

/// What a GET of one object by name answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<T> {
    /// 404: no object has the name.
    NotFound,
    /// The object that has the name now.
    Found(T),
    /// The GET failed (timeout, 5xx, ...): nothing is known.
    Failed,
}

/// Pod UIDs Tether cares about that are not in the bridge's cache: each must
/// be confirmed ([`confirm_pod`]) before it is reported.
pub fn pod_candidates(tether: &TetherView, live: &LiveView) -> Vec<String> {
    tether
        .pod_uids
        .difference(&live.pod_uids)
        .cloned()
        .collect()
}

/// A pod candidate after its GET: what to tell Tether. A pod found with its
/// UID is alive: Tether hears its state (nothing while unbound), never gone.
pub fn confirm_pod(uid: &str, lookup: Lookup<PodView>) -> Option<Command> {
    let gone = Command::Pod {
        uid: uid.to_string(),
        report: PodReport::Gone,
    };
    match lookup {
        Lookup::NotFound => Some(gone),
        Lookup::Found(pod) if pod.uid != uid => Some(gone),
        Lookup::Found(pod) => crate::mapping::pod_now(&pod),
        Lookup::Failed => None,
    }
}

/// Registry nodes whose object is not in the bridge's cache — no cached
/// node has the name, or the cached node under the name has another UID
/// (deleted and re-created) — with the UID the registry has for them:
/// each must be confirmed ([`confirm_node`]) before it is reported gone.
pub fn node_candidates(tether: &TetherView, live: &LiveView) -> Vec<(String, String)> {
    tether
        .nodes
        .iter()
        .filter(|(name, uid)| match live.nodes.get(*name) {
            None => true,
            Some(cached) => !uid.is_empty() && !cached.uid.is_empty() && cached.uid != **uid,
        })
        .map(|(name, uid)| (name.clone(), uid.clone()))
        .collect()
}

/// A node candidate (or a node delete event) after its GET: the node object
/// with UID `uid` is gone if no node has its name, or another object does
/// (deleted and recreated). The report carries `uid`, so Tether drops pins
/// and locks only for that object, never for the node that has the name
/// now. A node found with its UID (or with no UID to compare) is alive.
pub fn confirm_node(name: &str, uid: &str, lookup: Lookup<NodeView>) -> Option<Command> {
    let gone = matches!(&lookup, Lookup::NotFound)
        || matches!(&lookup, Lookup::Found(node) if !uid.is_empty() && node.uid != uid);
    gone.then(|| Command::Node {
        name: name.to_string(),
        uid: uid.to_string(),
        report: NodeReport::Gone,
        labels: None,
        unschedulable: None,
    })
}

/// Listed nodes Tether's registry lacks: reported joined, with their
/// readiness. Safe from any cache (a report of a live node changes nothing
/// that is not so). A name whose registered object was just confirmed gone
/// is passed without it in `tether` (its new object joins after the old
/// one's `Gone`); one registered under another UID that is not confirmed
/// gone is not reported (Tether would refuse it).
pub fn missing_joins(tether: &TetherView, live: &LiveView) -> Vec<Command> {
    let mut out = Vec::new();
    for (name, node) in live
        .nodes
        .iter()
        .filter(|(n, _)| !tether.nodes.contains_key(*n))
    {
        out.push(Command::Node {
            name: name.clone(),
            uid: node.uid.clone(),
            report: NodeReport::Joined,
            labels: Some(node.labels.clone()),
            unschedulable: Some(node.unschedulable),
        });
        let readiness = if node.ready {
            NodeReport::Ready
        } else {
            NodeReport::NotReady
        };
        out.push(Command::Node {
            name: name.clone(),
            uid: node.uid.clone(),
            report: readiness,
            labels: None,
            unschedulable: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Phase;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn node(name: &str, uid: &str) -> NodeView {
        NodeView {
            name: name.into(),
            uid: uid.into(),
            labels: BTreeMap::new(),
            ready: true,
            unschedulable: false,
        }
    }

    fn pod(uid: &str, bound: bool, started: bool) -> PodView {
        PodView {
            uid: uid.into(),
            namespace: "ml".into(),
            name: "train-0".into(),
            phase: if started {
                Phase::Running
            } else {
                Phase::Pending
            },
            deleting: false,
            started,
            bound,
        }
    }

    #[test]
    fn pods_missing_from_the_cache_are_only_candidates() {
        let tether = TetherView {
            pod_uids: set(&["alive", "deleted-while-down", "created-during-the-list"]),
            nodes: BTreeMap::new(),
        };
        let live = LiveView {
            pod_uids: set(&["alive", "someone-else"]),
            nodes: BTreeMap::new(),
        };
        assert_eq!(
            pod_candidates(&tether, &live),
            ["created-during-the-list", "deleted-while-down"]
        );
    }

    #[test]
    fn a_pod_is_reported_gone_only_when_its_get_says_so() {
        let gone = Some(Command::Pod {
            uid: "u1".into(),
            report: PodReport::Gone,
        });
        assert_eq!(confirm_pod("u1", Lookup::NotFound), gone);
        // The name now belongs to a new pod (a StatefulSet's replacement).
        assert_eq!(
            confirm_pod("u1", Lookup::Found(pod("u2", true, false))),
            gone
        );
        // Created and bound during the list: alive, and starting.
        assert_eq!(
            confirm_pod("u1", Lookup::Found(pod("u1", true, false))),
            Some(Command::Pod {
                uid: "u1".into(),
                report: PodReport::Starting
            })
        );
        assert_eq!(
            confirm_pod("u1", Lookup::Found(pod("u1", false, false))),
            None
        );
        // A failed GET proves nothing.
        assert_eq!(confirm_pod("u1", Lookup::Failed), None);
    }

    #[test]
    fn a_node_is_reported_gone_only_for_the_object_that_is_gone() {
        let tether = TetherView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([
                ("n1".into(), "uid-n1".into()),
                ("n-unseen".into(), "uid-x".into()),
            ]),
        };
        let live = LiveView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([("n1".into(), node("n1", "uid-n1"))]),
        };
        assert_eq!(
            node_candidates(&tether, &live),
            [("n-unseen".to_string(), "uid-x".to_string())]
        );
        let gone = |uid: &str| {
            Some(Command::Node {
                name: "n-unseen".into(),
                uid: uid.into(),
                report: NodeReport::Gone,
                labels: None,
                unschedulable: None,
            })
        };
        assert_eq!(
            confirm_node("n-unseen", "uid-x", Lookup::NotFound),
            gone("uid-x")
        );
        // Deleted and recreated under the name: the old object is gone.
        assert_eq!(
            confirm_node(
                "n-unseen",
                "uid-x",
                Lookup::Found(node("n-unseen", "uid-y"))
            ),
            gone("uid-x")
        );
        // This bridge had not seen it yet (the other replica reported it).
        assert_eq!(
            confirm_node(
                "n-unseen",
                "uid-x",
                Lookup::Found(node("n-unseen", "uid-x"))
            ),
            None
        );
        // No UID to compare: a node with the name is alive.
        assert_eq!(
            confirm_node("n-unseen", "", Lookup::Found(node("n-unseen", "uid-y"))),
            None
        );
        assert_eq!(confirm_node("n-unseen", "uid-x", Lookup::Failed), None);
    }

    #[test]
    fn a_registry_node_cached_under_another_uid_is_a_candidate() {
        let tether = TetherView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([
                ("n1".into(), "uid-old".into()),
                ("n2".into(), "".into()),
                ("n3".into(), "uid-n3".into()),
            ]),
        };
        let live = LiveView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([
                ("n1".into(), node("n1", "uid-new")),
                ("n2".into(), node("n2", "uid-n2")),
                ("n3".into(), node("n3", "uid-n3")),
            ]),
        };
        // n1 was re-created; n2's registry entry has no UID to compare.
        assert_eq!(
            node_candidates(&tether, &live),
            [("n1".to_string(), "uid-old".to_string())]
        );
        // Nothing joins under a name registered to another object...
        assert!(missing_joins(&tether, &live).is_empty());
        // ...until that object is confirmed gone.
        let mut after = tether.clone();
        after.nodes.remove("n1");
        let joins = missing_joins(&after, &live);
        assert!(matches!(
            &joins[0],
            Command::Node { name, uid, report: NodeReport::Joined, .. } if name == "n1" && uid == "uid-new"
        ));
        assert_eq!(joins.len(), 2);
    }

    #[test]
    fn listed_nodes_tether_lacks_are_reported_joined_and_ready() {
        let live = LiveView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([("n2".into(), node("n2", "uid-n2"))]),
        };
        let commands = missing_joins(&TetherView::default(), &live);
        assert!(matches!(
            &commands[0],
            Command::Node {
                report: NodeReport::Joined,
                ..
            }
        ));
        assert!(matches!(
            &commands[1],
            Command::Node {
                report: NodeReport::Ready,
                ..
            }
        ));
    }
}
