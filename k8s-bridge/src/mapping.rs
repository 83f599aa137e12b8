//! One watch event → the commands it calls for. Only transitions produce
//! commands (a pod that stays Running says nothing), and only for pods Tether
//! cares about.

use crate::model::{Command, NodeReport, NodeView, PodReport, PodView};

/// What Tether should hear about one pod, given its previous view (`None` if
/// first seen) and its new one (`None` if deleted). `interesting` is whether
/// the pod UID holds, waits or is pinned in Tether.
pub fn pod_change(old: Option<&PodView>, new: Option<&PodView>, interesting: bool) -> Vec<Command> {
    if !interesting {
        return Vec::new();
    }
    let report = |uid: &str, report| {
        vec![Command::Pod {
            uid: uid.to_string(),
            report,
        }]
    };
    let Some(new) = new else {
        return match old {
            Some(old) => report(&old.uid, PodReport::Gone),
            None => Vec::new(),
        };
    };
    let was = old.map(classify);
    let now = classify(new);
    if was == Some(now) {
        return Vec::new();
    }
    report(&new.uid, now)
}

/// The report a pod's current view calls for.
fn classify(pod: &PodView) -> PodReport {
    if pod.deleting && (pod.grace_zero || !pod.started) {
        // Force-deleted, or deleted before it ever started: it will never
        // need its devices, whatever the phase says.
        PodReport::Gone
    } else if pod.phase.is_terminal() {
        PodReport::Terminal
    } else if pod.started {
        PodReport::Running
    } else {
        PodReport::Starting
    }
}

/// What Tether should hear about one node, given its previous view (`None`
/// if first seen) and its new one (`None` if a delete event arrived).
pub fn node_change(old: Option<&NodeView>, new: Option<&NodeView>) -> Vec<Command> {
    let Some(new) = new else {
        return match old {
            Some(old) => vec![Command::ConfirmNodeGone {
                name: old.name.clone(),
            }],
            None => Vec::new(),
        };
    };
    let node = |report, with_details: bool| Command::Node {
        name: new.name.clone(),
        uid: new.uid.clone(),
        report,
        labels: with_details.then(|| new.labels.clone()),
        unschedulable: with_details.then_some(new.unschedulable),
    };
    let readiness = if new.ready {
        NodeReport::Ready
    } else {
        NodeReport::NotReady
    };
    match old {
        None => vec![node(NodeReport::Joined, true), node(readiness, false)],
        Some(old) => {
            let mut out = Vec::new();
            if old.labels != new.labels
                || old.unschedulable != new.unschedulable
                || old.uid != new.uid
            {
                out.push(node(NodeReport::Joined, true));
            }
            if old.ready != new.ready {
                out.push(node(readiness, false));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::model::Phase;

    fn pod(phase: Phase, started: bool) -> PodView {
        PodView {
            uid: "u1".into(),
            namespace: "ml".into(),
            name: "train-0".into(),
            phase,
            deleting: false,
            grace_zero: false,
            started,
        }
    }

    fn reports(commands: Vec<Command>) -> Vec<PodReport> {
        commands
            .into_iter()
            .map(|c| match c {
                Command::Pod { report, .. } => report,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn every_phase_and_deletion_shape_maps_to_one_report_on_change() {
        let pending = pod(Phase::Pending, false);
        let running = pod(Phase::Running, true);
        let succeeded = pod(Phase::Succeeded, false);
        let failed = pod(Phase::Failed, false);
        let unknown = pod(Phase::Unknown, true);
        assert_eq!(
            reports(pod_change(None, Some(&pending), true)),
            [PodReport::Starting]
        );
        assert_eq!(
            reports(pod_change(Some(&pending), Some(&pending), true)),
            []
        );
        assert_eq!(
            reports(pod_change(Some(&pending), Some(&running), true)),
            [PodReport::Running]
        );
        assert_eq!(
            reports(pod_change(Some(&running), Some(&running), true)),
            []
        );
        assert_eq!(
            reports(pod_change(Some(&running), Some(&succeeded), true)),
            [PodReport::Terminal]
        );
        assert_eq!(
            reports(pod_change(Some(&running), Some(&failed), true)),
            [PodReport::Terminal]
        );
        assert_eq!(reports(pod_change(Some(&failed), Some(&failed), true)), []);
        assert_eq!(
            reports(pod_change(Some(&running), Some(&unknown), true)),
            [],
            "unknown phase but started: still running"
        );
        // Deleted (the watch's Delete event).
        assert_eq!(
            reports(pod_change(Some(&running), None, true)),
            [PodReport::Gone]
        );
        // Graceful deletion of a running pod: not gone until it is.
        let terminating = PodView {
            deleting: true,
            ..running.clone()
        };
        assert_eq!(
            reports(pod_change(Some(&running), Some(&terminating), true)),
            []
        );
        // Force deletion (grace period 0).
        let forced = PodView {
            deleting: true,
            grace_zero: true,
            ..running.clone()
        };
        assert_eq!(
            reports(pod_change(Some(&running), Some(&forced), true)),
            [PodReport::Gone]
        );
        // Deleted before it started: it will never need its devices.
        let doomed = PodView {
            deleting: true,
            ..pending.clone()
        };
        assert_eq!(
            reports(pod_change(Some(&pending), Some(&doomed), true)),
            [PodReport::Gone]
        );
        // Already started, first seen by a (re)list: say so.
        assert_eq!(
            reports(pod_change(None, Some(&running), true)),
            [PodReport::Running]
        );
    }

    #[test]
    fn pods_tether_does_not_care_about_produce_nothing() {
        let running = pod(Phase::Running, true);
        assert!(pod_change(None, Some(&running), false).is_empty());
        assert!(pod_change(Some(&running), None, false).is_empty());
    }

    #[test]
    fn same_name_with_a_new_uid_is_a_different_pod() {
        let old = pod(Phase::Running, true);
        let new = PodView {
            uid: "u2".into(),
            ..pod(Phase::Pending, false)
        };
        // The old pod's deletion and the new pod's creation arrive as two
        // events, each about its own UID.
        assert_eq!(
            pod_change(Some(&old), None, true),
            [Command::Pod {
                uid: "u1".into(),
                report: PodReport::Gone
            }]
        );
        assert_eq!(
            pod_change(None, Some(&new), true),
            [Command::Pod {
                uid: "u2".into(),
                report: PodReport::Starting
            }]
        );
    }

    fn node(ready: bool, zone: &str) -> NodeView {
        NodeView {
            name: "n1".into(),
            uid: "nu1".into(),
            labels: BTreeMap::from([("zone".to_string(), zone.to_string())]),
            ready,
            unschedulable: false,
        }
    }

    #[test]
    fn nodes_join_change_readiness_relabel_and_deletions_are_confirmed() {
        let joined = node_change(None, Some(&node(true, "a")));
        assert!(
            matches!(&joined[0], Command::Node { report: NodeReport::Joined, labels: Some(l), .. } if l["zone"] == "a")
        );
        assert!(matches!(
            &joined[1],
            Command::Node {
                report: NodeReport::Ready,
                labels: None,
                ..
            }
        ));
        assert!(node_change(Some(&node(true, "a")), Some(&node(true, "a"))).is_empty());
        let not_ready = node_change(Some(&node(true, "a")), Some(&node(false, "a")));
        assert!(matches!(
            not_ready.as_slice(),
            [Command::Node {
                report: NodeReport::NotReady,
                ..
            }]
        ));
        let relabel = node_change(Some(&node(true, "a")), Some(&node(true, "b")));
        assert!(
            matches!(relabel.as_slice(), [Command::Node { report: NodeReport::Joined, labels: Some(l), .. }] if l["zone"] == "b")
        );
        let cordoned = NodeView {
            unschedulable: true,
            ..node(true, "a")
        };
        let cordon = node_change(Some(&node(true, "a")), Some(&cordoned));
        assert!(matches!(
            cordon.as_slice(),
            [Command::Node {
                unschedulable: Some(true),
                ..
            }]
        ));
        assert_eq!(
            node_change(Some(&node(true, "a")), None),
            [Command::ConfirmNodeGone { name: "n1".into() }]
        );
    }
}
