//! Level-triggered reports: what Tether must still hear about the pods and
//! nodes the bridge's cache shows, whatever events were seen or lost.
//!
//! Reporting only on a change (`mapping.rs`) loses a report for good when
//! its send fails: a pod that failed while Tether had no quorum (the kubelet
//! fails a pod whose `Allocate` could not reach Tether — the same outage)
//! stayed `Starting` in Tether and kept its node's lock for ever, because
//! the pod never changed again. So, as a kube-runtime controller does, the
//! bridge compares: on start, on every resync, and again with back-off
//! after any failed send, until everything is acknowledged.
//! - A pod Tether cares about is due its current report until Tether has
//!   acknowledged that report (the bridge keeps the last acknowledged
//!   report of each such pod; a restarted bridge knows none, so it reports
//!   every such pod once).
//! - A node is compared with Tether's own registry entry (its labels,
//!   schedulability and readiness), so a change missed while the bridge was
//!   down or a send failed is corrected too.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::mapping::node_change;
use crate::model::{Command, NodeView, PodReport, PodView};

/// The reports cached pods that Tether cares about are due: each pod in
/// `interesting` and in `cache` whose current report (nothing while
/// unbound) is not the one Tether last acknowledged for it.
pub fn pod_corrections(
    interesting: &BTreeSet<String>,
    cache: &HashMap<String, PodView>,
    acked: &HashMap<String, PodReport>,
) -> Vec<Command> {
    // A planted bug for the trace replay (`bridge-forgets-lost-reports`, set
    // with `fail::cfg`): the edge-triggered bridge, which never sent a lost
    // report again.
    if fail::eval("bridge-forgets-lost-reports", |_| ()).is_some() {
        return Vec::new();
    }
    interesting
        .iter()
        .filter_map(|uid| cache.get(uid))
        .filter_map(|pod| {
            let report = pod.state().report()?;
            (acked.get(&pod.uid) != Some(&report)).then(|| Command::Pod {
                uid: pod.uid.clone(),
                report,
            })
        })
        .collect()
}

/// The reports that bring Tether's registry entry of each cached node in
/// line with the node object: labels and schedulability (a `Joined` that
/// carries them), readiness. Only for the same node object (same UID, or a
/// registry entry without one); a node under a new UID is the orphan
/// resync's (`orphans.rs`).
pub fn node_corrections(
    registry: &BTreeMap<String, NodeView>,
    cache: &BTreeMap<String, NodeView>,
) -> Vec<Command> {
    let mut out = Vec::new();
    for (name, live) in cache {
        let Some(known) = registry.get(name) else {
            continue;
        };
        if !known.uid.is_empty() && known.uid != live.uid {
            continue;
        }
        let known = NodeView {
            uid: live.uid.clone(),
            ..known.clone()
        };
        out.extend(node_change(Some(&known), Some(live)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NodeReport, Phase};

    fn pod(uid: &str, phase: Phase, started: bool, bound: bool) -> PodView {
        PodView {
            uid: uid.into(),
            namespace: "ml".into(),
            name: format!("p-{uid}"),
            phase,
            deleting: false,
            started,
            bound,
        }
    }

    #[test]
    fn a_pod_is_reported_until_its_current_report_is_acknowledged() {
        let failed = pod("u1", Phase::Failed, false, true);
        let running = pod("u2", Phase::Running, true, true);
        let unbound = pod("u3", Phase::Pending, false, false);
        let dull = pod("u4", Phase::Failed, false, true);
        let cache: HashMap<String, PodView> = [&failed, &running, &unbound, &dull]
            .into_iter()
            .map(|p| (p.uid.clone(), p.clone()))
            .collect();
        let interesting: BTreeSet<String> = ["u1", "u2", "u3", "u9"].map(String::from).into();
        // The Failed report was lost (Tether still has Starting); the
        // Running one was acknowledged; an unbound pod is not reported; u4
        // is not interesting; u9 is not cached (the orphan resync's).
        let acked = HashMap::from([
            ("u1".to_string(), PodReport::Starting),
            ("u2".to_string(), PodReport::Running),
        ]);
        assert_eq!(
            pod_corrections(&interesting, &cache, &acked),
            [Command::Pod {
                uid: "u1".into(),
                report: PodReport::Terminal
            }]
        );
        // A restarted bridge has acknowledged nothing: every cached pod it
        // cares about is reported once.
        assert_eq!(
            pod_corrections(&interesting, &cache, &HashMap::new()).len(),
            2
        );
    }

    fn node(uid: &str, ready: bool, zone: &str, cordoned: bool) -> NodeView {
        NodeView {
            name: "n1".into(),
            uid: uid.into(),
            labels: BTreeMap::from([("zone".to_string(), zone.to_string())]),
            ready,
            unschedulable: cordoned,
        }
    }

    #[test]
    fn a_node_whose_registry_entry_differs_is_corrected() {
        let cache = BTreeMap::from([("n1".to_string(), node("nu1", true, "a", false))]);
        let same = BTreeMap::from([("n1".to_string(), node("nu1", true, "a", false))]);
        assert!(node_corrections(&same, &cache).is_empty());
        // Readiness, labels and the cordon missed while a send failed.
        let stale = BTreeMap::from([("n1".to_string(), node("nu1", false, "b", true))]);
        let fixes = node_corrections(&stale, &cache);
        assert!(
            matches!(&fixes[0], Command::Node { report: NodeReport::Joined, labels: Some(l), unschedulable: Some(false), .. } if l["zone"] == "a")
        );
        assert!(matches!(
            &fixes[1],
            Command::Node {
                report: NodeReport::Ready,
                ..
            }
        ));
        // Another node object under the name: not corrected here.
        let other = BTreeMap::from([("n1".to_string(), node("nu0", false, "b", true))]);
        assert!(node_corrections(&other, &cache).is_empty());
        // A registry entry without a UID is the same node.
        let no_uid = BTreeMap::from([("n1".to_string(), node("", false, "a", false))]);
        assert_eq!(node_corrections(&no_uid, &cache).len(), 1);
    }
}
