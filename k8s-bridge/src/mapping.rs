//! One watch event → the commands it calls for. Only transitions produce
//! commands (a pod that stays Running says nothing), and only for pods Tether
//! cares about.

use crate::model::{Command, NodeReport, NodeView, PodReport, PodView};

/// What Tether should hear about one pod, given its previous view (`None` if
/// first seen) and its new one (`None` if deleted). `interesting` is whether
/// the pod UID holds, waits or is pinned in Tether. A pod is reported each
/// time its [`PodState`] changes to one Tether hears of, and when first
/// seen in one: so a bound pod that has not started is reported `Starting`
/// (its holds outlive the hold timeout) from the moment it is bound.
pub fn pod_change(old: Option<&PodView>, new: Option<&PodView>, interesting: bool) -> Vec<Command> {
    if !interesting {
        return Vec::new();
    }
    let Some(new) = new else {
        return match old {
            Some(old) => vec![pod_report(&old.uid, PodReport::Gone)],
            None => Vec::new(),
        };
    };
    let now = new.state();
    if old.map(PodView::state) == Some(now) {
        return Vec::new();
    }
    now.report()
        .map(|report| pod_report(&new.uid, report))
        .into_iter()
        .collect()
}

/// What Tether must hear of a pod that has just become interesting (a bind
/// or a pin named it), from the bridge's view of it: its current state.
pub fn pod_now(pod: &PodView) -> Option<Command> {
    pod.state()
        .report()
        .map(|report| pod_report(&pod.uid, report))
}

fn pod_report(uid: &str, report: PodReport) -> Command {
    Command::Pod {
        uid: uid.to_string(),
        report,
    }
}

/// What Tether should hear about one node, given its previous view (`None`
/// if first seen) and its new one (`None` if a delete event arrived). A
/// node is its UID: a view under the same name with another UID (a watch
/// that relisted, or missed the delete) is the old node deleted — to be
/// confirmed, then reported gone, so that what it held ends — and a new
/// one joined, in that order (Tether refuses reports about a node object
/// other than the one it has registered under the name).
pub fn node_change(old: Option<&NodeView>, new: Option<&NodeView>) -> Vec<Command> {
    let Some(new) = new else {
        return match old {
            Some(old) => vec![Command::ConfirmNodeGone {
                name: old.name.clone(),
                uid: old.uid.clone(),
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
        Some(old) if !old.uid.is_empty() && !new.uid.is_empty() && old.uid != new.uid => vec![
            Command::ConfirmNodeGone {
                name: old.name.clone(),
                uid: old.uid.clone(),
            },
            node(NodeReport::Joined, true),
            node(readiness, false),
        ],
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
    use crate::model::{Phase, PodState};

    fn pod(phase: Phase, started: bool) -> PodView {
        PodView {
            uid: "u1".into(),
            namespace: "ml".into(),
            name: "train-0".into(),
            phase,
            deleting: false,
            started,
            bound: true,
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

    /// Every lifecycle shape a pod that holds or waits goes through, and
    /// what Tether hears of each: on first sight (a relist, or the bridge
    /// starting) and on the transition from the shape before it.
    #[test]
    fn every_lifecycle_shape_yields_its_report() {
        let unbound = PodView {
            bound: false,
            ..pod(Phase::Pending, false)
        };
        let bound = pod(Phase::Pending, false);
        let running = pod(Phase::Running, true);
        let succeeded = pod(Phase::Succeeded, false);
        let failed = pod(Phase::Failed, false);
        // Evicted: the kubelet fails the pod (reason Evicted).
        let evicted = pod(Phase::Failed, true);
        // Graceful deletion of a running pod: its containers are stopping.
        let terminating = PodView {
            deleting: true,
            ..running.clone()
        };
        let force_deleted = PodView {
            deleting: true,
            ..running.clone()
        };
        // Deleted while bound and not started (an image pull, or Allocate
        // not yet answered): the kubelet may still count its devices.
        let deleted_before_start = PodView {
            deleting: true,
            ..bound.clone()
        };
        // Deleted before it was bound: the API server refuses a bind to a
        // pod with a deletionTimestamp, so it never reaches a kubelet.
        let deleted_unbound = PodView {
            deleting: true,
            ..unbound.clone()
        };
        // The phase is unknown (node unreachable) but a container ran.
        let unknown = pod(Phase::Unknown, true);
        // (shape, view before, view now, state now, report on the change)
        type Case<'a> = (
            &'a str,
            Option<&'a PodView>,
            &'a PodView,
            PodState,
            Option<PodReport>,
        );
        let cases: [Case; 13] = [
            (
                "pending, not bound",
                None,
                &unbound,
                PodState::Unbound,
                None,
            ),
            (
                "bound, not started (first sight)",
                None,
                &bound,
                PodState::Starting,
                Some(PodReport::Starting),
            ),
            (
                "the bind",
                Some(&unbound),
                &bound,
                PodState::Starting,
                Some(PodReport::Starting),
            ),
            (
                "started",
                Some(&bound),
                &running,
                PodState::Running,
                Some(PodReport::Running),
            ),
            (
                "running (first sight)",
                None,
                &running,
                PodState::Running,
                Some(PodReport::Running),
            ),
            (
                "succeeded",
                Some(&running),
                &succeeded,
                PodState::Terminal,
                Some(PodReport::Terminal),
            ),
            (
                "failed",
                Some(&running),
                &failed,
                PodState::Terminal,
                Some(PodReport::Terminal),
            ),
            (
                "evicted",
                Some(&running),
                &evicted,
                PodState::Terminal,
                Some(PodReport::Terminal),
            ),
            (
                "deletionTimestamp set while running",
                Some(&running),
                &terminating,
                PodState::Running,
                None,
            ),
            (
                "force-deleted (gone at its delete event)",
                Some(&running),
                &force_deleted,
                PodState::Running,
                None,
            ),
            (
                "deleted before it started (gone at its delete event)",
                Some(&bound),
                &deleted_before_start,
                PodState::Starting,
                None,
            ),
            (
                "deleted before it was bound",
                Some(&unbound),
                &deleted_unbound,
                PodState::Gone,
                Some(PodReport::Gone),
            ),
            (
                "phase unknown, started",
                Some(&running),
                &unknown,
                PodState::Running,
                None,
            ),
        ];
        for (shape, old, new, state, report) in cases {
            assert_eq!(new.state(), state, "{shape}");
            assert_eq!(
                reports(pod_change(old, Some(new), true)),
                report.into_iter().collect::<Vec<_>>(),
                "{shape}"
            );
            // Unchanged: nothing again.
            assert_eq!(
                reports(pod_change(Some(new), Some(new), true)),
                [],
                "{shape} (again)"
            );
            // Becoming interesting in this shape: its state, as on first sight.
            assert_eq!(
                pod_now(new).into_iter().collect::<Vec<_>>(),
                pod_change(None, Some(new), true),
                "{shape} (newly interesting)"
            );
        }
        // The watch's Delete event, from any shape.
        for old in [
            &unbound,
            &bound,
            &running,
            &terminating,
            &deleted_before_start,
        ] {
            assert_eq!(
                reports(pod_change(Some(old), None, true)),
                [PodReport::Gone]
            );
        }
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
            [Command::ConfirmNodeGone {
                name: "n1".into(),
                uid: "nu1".into()
            }]
        );
    }

    #[test]
    fn a_node_seen_under_another_uid_is_the_old_one_gone_then_a_new_one_joined() {
        let recreated = NodeView {
            uid: "nu2".into(),
            ..node(false, "b")
        };
        let commands = node_change(Some(&node(true, "a")), Some(&recreated));
        assert_eq!(
            commands[0],
            Command::ConfirmNodeGone {
                name: "n1".into(),
                uid: "nu1".into()
            }
        );
        assert!(
            matches!(&commands[1], Command::Node { uid, report: NodeReport::Joined, labels: Some(l), .. } if uid == "nu2" && l["zone"] == "b")
        );
        assert!(matches!(
            &commands[2],
            Command::Node { uid, report: NodeReport::NotReady, .. } if uid == "nu2"
        ));
        assert_eq!(commands.len(), 3);
        // Nothing to compare: the same node, whose UID is now known.
        let no_uid = NodeView {
            uid: String::new(),
            ..node(true, "a")
        };
        assert!(matches!(
            node_change(Some(&no_uid), Some(&node(true, "a"))).as_slice(),
            [Command::Node { uid, report: NodeReport::Joined, .. }] if uid == "nu1"
        ));
    }
}
