//! After a (re)list: what Tether knows that Kubernetes no longer has. Delete
//! events are hints — they are lost when the bridge is down or its watch
//! breaks — so on every list and on a periodic resync the bridge diffs
//! Tether's view against the live objects and reports what is missing.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{Command, NodeReport, NodeView, PodReport};

/// What Tether holds that the diff looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TetherView {
    /// Pod UIDs that hold, wait for or are pinned by something.
    pub pod_uids: BTreeSet<String>,
    /// Live (not gone) nodes in Tether's registry.
    pub nodes: BTreeSet<String>,
}

/// What a complete list of the cluster showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveView {
    /// UIDs of pods that exist and are not terminal.
    pub pod_uids: BTreeSet<String>,
    /// Nodes that exist, by name.
    pub nodes: BTreeMap<String, NodeView>,
}

/// The commands that bring Tether in line with a complete list: every pod
/// UID Tether cares about that no longer exists is reported gone (releasing
/// its holds and waits, starting its pins' countdown); every registry node
/// missing from the list is reported gone (the list is the NotFound); every
/// listed node Tether lacks is reported joined. Idempotent: applying the
/// result twice changes nothing the second time.
pub fn orphans(tether: &TetherView, live: &LiveView) -> Vec<Command> {
    let mut out = Vec::new();
    for uid in tether.pod_uids.difference(&live.pod_uids) {
        out.push(Command::Pod {
            uid: uid.clone(),
            report: PodReport::Gone,
        });
    }
    for name in tether.nodes.iter().filter(|n| !live.nodes.contains_key(*n)) {
        out.push(Command::Node {
            name: name.clone(),
            uid: String::new(),
            report: NodeReport::Gone,
            labels: None,
            unschedulable: None,
        });
    }
    for (name, node) in live
        .nodes
        .iter()
        .filter(|(n, _)| !tether.nodes.contains(*n))
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

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn node(name: &str) -> NodeView {
        NodeView {
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: BTreeMap::new(),
            ready: true,
            unschedulable: false,
        }
    }

    #[test]
    fn pods_and_nodes_missing_from_the_list_are_reported_gone() {
        let tether = TetherView {
            pod_uids: set(&["alive", "deleted-while-down"]),
            nodes: set(&["n1", "n-gone"]),
        };
        let live = LiveView {
            pod_uids: set(&["alive", "someone-else"]),
            nodes: BTreeMap::from([("n1".into(), node("n1"))]),
        };
        let commands = orphans(&tether, &live);
        assert_eq!(
            commands,
            vec![
                Command::Pod {
                    uid: "deleted-while-down".into(),
                    report: PodReport::Gone
                },
                Command::Node {
                    name: "n-gone".into(),
                    uid: String::new(),
                    report: NodeReport::Gone,
                    labels: None,
                    unschedulable: None
                },
            ]
        );
    }

    #[test]
    fn listed_nodes_tether_lacks_are_reported_joined_and_ready() {
        let live = LiveView {
            pod_uids: BTreeSet::new(),
            nodes: BTreeMap::from([("n2".into(), node("n2"))]),
        };
        let commands = orphans(&TetherView::default(), &live);
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

    #[test]
    fn a_view_in_line_with_the_list_needs_nothing() {
        let tether = TetherView {
            pod_uids: set(&["a"]),
            nodes: set(&["n1"]),
        };
        let live = LiveView {
            pod_uids: set(&["a", "b"]),
            nodes: BTreeMap::from([("n1".into(), node("n1"))]),
        };
        assert!(orphans(&tether, &live).is_empty());
    }
}
