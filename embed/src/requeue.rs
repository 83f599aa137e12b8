//! Asking kube-scheduler again about pods the extender's filter refused,
//! once devices free up on a node they were refused on.
//!
//! Why it is needed (kube-scheduler v1.36, read from its source):
//! - a pod that an extender's filter leaves without a node is parked in the
//!   unschedulable pool with `framework.ExtenderName` among its rejectors
//!   (`findNodesThatFitPod`, `pkg/scheduler/schedule_one.go`);
//! - extenders have no queueing hints, so the framework registers that name
//!   for every cluster event (`defaultEnqueueExtension`,
//!   `pkg/scheduler/framework/runtime/framework.go`, with
//!   `UnrollWildCardResource`): any Pod, Node, volume or DRA event moves the
//!   pod back to the active or back-off queue (the scheduler's own write of
//!   its `PodScheduled` condition too, once) — but once a retry finds
//!   nothing changed, nothing else does before the five-minute flush of the
//!   unschedulable pool (`flushUnschedulablePodsLeftover`,
//!   `podMaxInUnschedulablePodsDuration`);
//! - Tether ending a device claim is no Kubernetes event. A deleted pod's
//!   own delete event does re-queue the pending pod, but it reaches the
//!   scheduler in the same milliseconds as it reaches the bridge, so the
//!   scheduler may ask before Tether has heard (issue 49), and on a quiet
//!   node nothing asks again.
//!
//! The nudge: a merge patch of one annotation ([`NUDGE_ANNOTATION`]) on the
//! refused pod. An update of an unscheduled pod goes to the scheduling
//! queue's `Update` (`pkg/scheduler/backend/queue/scheduling_queue.go`) as
//! the event `{UnschedulablePod, Update}`, which the extender's
//! registration (`Pod`, all actions) matches: the pod moves to the active
//! queue, or to the back-off queue until its back-off (1 s doubling to
//! 10 s per attempt) has passed. One PATCH asks about exactly one pod;
//! touching the Node instead would re-queue every pod any extender refused
//! anywhere in the cluster, and the bridge does not know which pods were
//! refused or why.
//!
//! Which pods are nudged is decided by [`to_nudge`], a pure function: the
//! oldest refusals first, only as many as the freed devices fit (a pod
//! nudged and not yet tried again holds its share), so freeing one GPU on a
//! full cluster asks about one pod, not every pending one.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The annotation a nudge sets on a refused pod: when devices it was
/// refused for were seen free, in milliseconds since the epoch. Nothing
/// reads it; changing it is what makes the scheduler look at the pod.
pub const NUDGE_ANNOTATION: &str = "tether.io/devices-freed-at";

/// How often the requeuer compares refused pods with the claims, while
/// any pod is refused.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// A nudged pod that the filter has not seen again within this is nudged
/// again (the patch or its event was lost): above kube-scheduler's
/// longest back-off (`podMaxBackoffSeconds`, 10 s).
pub const RENUDGE_AFTER: Duration = Duration::from_secs(15);

/// A refusal the filter has not renewed within this is forgotten: the
/// scheduler tries every unschedulable pod again at least every five
/// minutes, and a renewed refusal is recorded again.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Nudges one pass sends at most (the rest wait for the next pass).
pub const NUDGES_PER_PASS: usize = 64;

/// The mark the filter's reason for a node short of free devices carries,
/// which kube-scheduler copies into the pod's `PodScheduled` condition: how
/// a restarted extender finds the pods an earlier one refused.
pub const REFUSED_MARK: &str = "(claimed by live pods)";

/// Whether `pod` is pending, parked by the scheduler with a reason of this
/// extender's filter among its nodes' ([`REFUSED_MARK`]).
pub fn refused_by_filter(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    let unbound = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty);
    unbound
        && pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
                    && c.message
                        .as_deref()
                        .is_some_and(|m| m.contains(REFUSED_MARK))
            })
}

/// A device kind, by the extender's index of it ([`crate::kind`]; 0 is the
/// first kind).
pub type KindIndex = usize;

/// A pod the filter left without a node because devices were claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The pod's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Each device kind the pod asks for, and how many devices of it it
    /// needs on one node.
    pub needs: BTreeMap<KindIndex, usize>,
    /// The nodes refused because too few of their devices were free: per
    /// node, each kind it was short of, and how many devices of that kind
    /// it has in all. A kind a node is not listed for had enough free when
    /// the filter judged it. The pod is asked about again once some node
    /// has enough free of every kind it was short of there (issue 62: a
    /// pod short of two kinds was remembered for the first only).
    pub nodes: BTreeMap<String, BTreeMap<KindIndex, usize>>,
    /// When the filter last refused it.
    pub refused_at: Instant,
    /// When it was last nudged, and toward which node.
    pub nudged: Option<(Instant, String)>,
    /// Read back from the pod's `PodScheduled` condition after this
    /// extender started, not seen by its filter: asked about once, then
    /// forgotten (the filter records it again if it still does not fit).
    pub recovered: bool,
}

impl Refusal {
    /// A refusal of `pod` (UID `uid`) made now, needing `needs`, refused
    /// on `nodes` for the kinds each lists.
    pub fn of(
        pod: &k8s_openapi::api::core::v1::Pod,
        uid: String,
        needs: BTreeMap<KindIndex, usize>,
        nodes: BTreeMap<String, BTreeMap<KindIndex, usize>>,
        recovered: bool,
    ) -> Refusal {
        Refusal {
            uid,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            needs,
            nodes,
            refused_at: Instant::now(),
            nudged: None,
            recovered,
        }
    }

    /// The kinds the refusal concerns: those a node was short of.
    pub fn kinds(&self) -> BTreeSet<KindIndex> {
        self.nodes
            .values()
            .flat_map(|k| k.keys().copied())
            .collect()
    }

    /// Nudged since the last refusal, and recently enough that the
    /// scheduler's retry may still be on its way.
    fn awaiting_retry(&self, now: Instant) -> Option<&str> {
        match &self.nudged {
            Some((at, node))
                if *at >= self.refused_at && now.saturating_duration_since(*at) < RENUDGE_AFTER =>
            {
                Some(node)
            }
            _ => None,
        }
    }

    /// What the pod takes of each kind it was short of on `node`.
    fn takes_on<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (KindIndex, usize)> + 'a {
        self.nodes
            .get(node)
            .into_iter()
            .flat_map(|kinds| kinds.keys())
            .map(|kind| (*kind, self.needs.get(kind).copied().unwrap_or(0)))
    }
}

/// Which refused pods to nudge now, and toward which node: `(uid, node)`.
///
/// `claimed` is kind -> node -> how many of its devices of that kind live
/// pods claim (stopped pods' claims are free). A node's free devices of a
/// kind are its count of them (as the refusal recorded it) less those.
/// Pods nudged and not yet tried again hold their need on their node
/// first; then refusals, oldest first, take a node they were refused on
/// where every kind they were short of there now fits. At most `limit`
/// pods are named.
pub fn to_nudge(
    refusals: &[Refusal],
    claimed: &BTreeMap<KindIndex, BTreeMap<String, usize>>,
    now: Instant,
    limit: usize,
) -> Vec<(String, String)> {
    let mut free: BTreeMap<(KindIndex, &str), usize> = BTreeMap::new();
    for refusal in refusals {
        for (node, kinds) in &refusal.nodes {
            for (kind, devices) in kinds {
                let taken = claimed
                    .get(kind)
                    .and_then(|nodes| nodes.get(node))
                    .copied()
                    .unwrap_or(0);
                free.entry((*kind, node))
                    .or_insert_with(|| devices.saturating_sub(taken));
            }
        }
    }
    for refusal in refusals {
        if let Some(node) = refusal.awaiting_retry(now) {
            for (kind, needed) in refusal.takes_on(node) {
                if let Some(left) = free.get_mut(&(kind, node)) {
                    *left = left.saturating_sub(needed);
                }
            }
        }
    }
    let mut waiting: Vec<&Refusal> = refusals
        .iter()
        .filter(|r| r.awaiting_retry(now).is_none())
        .collect();
    waiting.sort_by(|a, b| a.refused_at.cmp(&b.refused_at).then(a.uid.cmp(&b.uid)));
    let mut out = Vec::new();
    for refusal in waiting {
        if out.len() == limit {
            break;
        }
        let fits = refusal.nodes.keys().find(|node| {
            refusal.takes_on(node).all(|(kind, needed)| {
                free.get(&(kind, node.as_str()))
                    .is_some_and(|left| *left >= needed)
            })
        });
        if let Some(node) = fits {
            for (kind, needed) in refusal.takes_on(node) {
                *free.get_mut(&(kind, node.as_str())).expect("a known node") -= needed;
            }
            out.push((refusal.uid.clone(), node.clone()));
        }
    }
    out
}

/// The refusals one extender replica has made, by pod UID.
#[derive(Debug, Default)]
pub struct Refusals {
    by_uid: std::sync::Mutex<BTreeMap<String, Refusal>>,
}

impl Refusals {
    /// Records (or renews) a refusal; a nudge already sent stays recorded.
    pub fn refused(&self, mut refusal: Refusal) {
        let mut by_uid = self.by_uid.lock().expect("refusals lock");
        if let Some(old) = by_uid.get(&refusal.uid) {
            refusal.nudged = old.nudged.clone();
        }
        by_uid.insert(refusal.uid.clone(), refusal);
    }

    /// The pod found a node (or is gone): nothing to nudge.
    pub fn settled(&self, uid: &str) {
        self.by_uid.lock().expect("refusals lock").remove(uid);
    }

    /// The pod was nudged toward `node`.
    pub fn nudged(&self, uid: &str, node: &str, at: Instant) {
        if let Some(refusal) = self.by_uid.lock().expect("refusals lock").get_mut(uid) {
            refusal.nudged = Some((at, node.to_string()));
        }
    }

    /// The refusals standing, after forgetting those older than
    /// [`FORGET_AFTER`].
    pub fn standing(&self, now: Instant) -> Vec<Refusal> {
        let mut by_uid = self.by_uid.lock().expect("refusals lock");
        by_uid.retain(|_, r| now.saturating_duration_since(r.refused_at) < FORGET_AFTER);
        by_uid.values().cloned().collect()
    }

    /// The refused pod's record, if any.
    pub fn get(&self, uid: &str) -> Option<Refusal> {
        self.by_uid.lock().expect("refusals lock").get(uid).cloned()
    }
}

/// What a nudge found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Nudged {
    /// The pod was annotated: the scheduler looks at it again.
    Asked,
    /// The pod is gone, or another pod has its name now.
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal for want of the first kind alone.
    fn refusal(
        uid: &str,
        needed: usize,
        nodes: &[(&str, usize)],
        age_ms: u64,
        now: Instant,
    ) -> Refusal {
        Refusal {
            uid: uid.into(),
            namespace: "ml".into(),
            name: uid.into(),
            needs: BTreeMap::from([(0, needed)]),
            nodes: nodes
                .iter()
                .map(|(n, d)| (n.to_string(), BTreeMap::from([(0, *d)])))
                .collect(),
            refused_at: now - Duration::from_millis(age_ms),
            nudged: None,
            recovered: false,
        }
    }

    /// Claims of the first kind.
    fn claimed(counts: &[(&str, usize)]) -> BTreeMap<KindIndex, BTreeMap<String, usize>> {
        BTreeMap::from([(0, counts.iter().map(|(n, c)| (n.to_string(), *c)).collect())])
    }

    /// Claims of kinds 0 and 1.
    fn claimed_of_two(
        first: &[(&str, usize)],
        second: &[(&str, usize)],
    ) -> BTreeMap<KindIndex, BTreeMap<String, usize>> {
        let of =
            |counts: &[(&str, usize)]| counts.iter().map(|(n, c)| (n.to_string(), *c)).collect();
        BTreeMap::from([(0, of(first)), (1, of(second))])
    }

    #[test]
    fn a_pod_refused_for_one_kind_on_one_node_and_another_on_another_is_nudged_for_either() {
        // Needs one device of each kind; n1 (2 of each) was short of kind 0,
        // n2 (2 of each) of kind 1.
        let now = Instant::now();
        let pod = Refusal {
            needs: BTreeMap::from([(0, 1), (1, 1)]),
            nodes: BTreeMap::from([
                ("n1".to_string(), BTreeMap::from([(0, 2)])),
                ("n2".to_string(), BTreeMap::from([(1, 2)])),
            ]),
            ..refusal("p", 1, &[], 100, now)
        };
        let refusals = [pod];
        let full = claimed_of_two(&[("n1", 2), ("n2", 2)], &[("n1", 2), ("n2", 2)]);
        assert!(to_nudge(&refusals, &full, now, 10).is_empty());
        // Kind 1 frees on n2 (kind 0 there was never short): nudged to n2.
        let freed = claimed_of_two(&[("n1", 2), ("n2", 2)], &[("n1", 2), ("n2", 1)]);
        assert_eq!(
            to_nudge(&refusals, &freed, now, 10),
            [("p".to_string(), "n2".to_string())]
        );
        // Kind 0 frees on n1: nudged to n1.
        let freed = claimed_of_two(&[("n1", 1), ("n2", 2)], &[("n1", 2), ("n2", 2)]);
        assert_eq!(
            to_nudge(&refusals, &freed, now, 10),
            [("p".to_string(), "n1".to_string())]
        );
    }

    #[test]
    fn a_pod_short_of_two_kinds_on_a_node_is_nudged_once_both_fit() {
        let now = Instant::now();
        let pod = Refusal {
            needs: BTreeMap::from([(0, 1), (1, 1)]),
            nodes: BTreeMap::from([("n1".to_string(), BTreeMap::from([(0, 2), (1, 1)]))]),
            ..refusal("p", 1, &[], 100, now)
        };
        let refusals = [pod];
        let only_first = claimed_of_two(&[("n1", 1)], &[("n1", 1)]);
        assert!(to_nudge(&refusals, &only_first, now, 10).is_empty());
        let only_second = claimed_of_two(&[("n1", 2)], &[("n1", 0)]);
        assert!(to_nudge(&refusals, &only_second, now, 10).is_empty());
        let both = claimed_of_two(&[("n1", 1)], &[("n1", 0)]);
        assert_eq!(
            to_nudge(&refusals, &both, now, 10),
            [("p".to_string(), "n1".to_string())]
        );
    }

    #[test]
    fn a_pod_is_nudged_once_its_need_fits_on_a_node_it_was_refused_on() {
        let now = Instant::now();
        let wide = refusal("wide", 8, &[("n1", 8)], 100, now);
        assert!(to_nudge(std::slice::from_ref(&wide), &claimed(&[("n1", 8)]), now, 10).is_empty());
        assert!(to_nudge(std::slice::from_ref(&wide), &claimed(&[("n1", 1)]), now, 10).is_empty());
        assert_eq!(
            to_nudge(std::slice::from_ref(&wide), &claimed(&[]), now, 10),
            [("wide".to_string(), "n1".to_string())]
        );
    }

    #[test]
    fn freed_devices_go_to_the_oldest_refusals_that_fit_and_no_further() {
        let now = Instant::now();
        let refusals = [
            refusal("young", 1, &[("n1", 8), ("n2", 8)], 10, now),
            refusal("old", 2, &[("n1", 8), ("n2", 8)], 300, now),
            refusal("middle", 4, &[("n1", 8)], 200, now),
        ];
        // Two devices free on n1, none on n2: the oldest pod takes both;
        // the 4-wide one does not fit; the youngest finds nothing left.
        let picked = to_nudge(&refusals, &claimed(&[("n1", 6), ("n2", 8)]), now, 10);
        assert_eq!(picked, [("old".to_string(), "n1".to_string())]);
        // Three free: "old" takes two, "middle" (4) does not fit in the one
        // left, "young" takes it.
        let picked = to_nudge(&refusals, &claimed(&[("n1", 5), ("n2", 8)]), now, 10);
        assert_eq!(
            picked,
            [
                ("old".to_string(), "n1".to_string()),
                ("young".to_string(), "n1".to_string())
            ]
        );
        // The limit caps one pass.
        assert_eq!(to_nudge(&refusals, &claimed(&[]), now, 1).len(), 1);
    }

    #[test]
    fn a_nudged_pod_holds_its_share_until_it_is_tried_again_or_the_nudge_is_stale() {
        let now = Instant::now();
        let mut first = refusal("first", 1, &[("n1", 2)], 500, now);
        first.nudged = Some((now - Duration::from_millis(100), "n1".into()));
        let second = refusal("second", 1, &[("n1", 2)], 400, now);
        let third = refusal("third", 1, &[("n1", 2)], 300, now);
        let refusals = [first.clone(), second.clone(), third.clone()];
        // Two free: "first" awaits its retry and holds one; "second" gets
        // the other; "third" none.
        assert_eq!(
            to_nudge(&refusals, &claimed(&[]), now, 10),
            [("second".to_string(), "n1".to_string())]
        );
        // Refused again after its nudge: it competes again, oldest first.
        let mut refused_again = first.clone();
        refused_again.refused_at = now - Duration::from_millis(50);
        let refusals = [refused_again, second.clone(), third.clone()];
        assert_eq!(
            to_nudge(&refusals, &claimed(&[]), now, 10),
            [
                ("second".to_string(), "n1".to_string()),
                ("third".to_string(), "n1".to_string())
            ]
        );
        // A nudge older than RENUDGE_AFTER is sent again.
        let mut stale = first;
        stale.refused_at = now - RENUDGE_AFTER - Duration::from_secs(2);
        stale.nudged = Some((now - RENUDGE_AFTER - Duration::from_secs(1), "n1".into()));
        let refusals = [stale, second, third];
        assert_eq!(
            to_nudge(&refusals, &claimed(&[("n1", 1)]), now, 10),
            [("first".to_string(), "n1".to_string())]
        );
    }

    #[test]
    fn a_pod_parked_with_the_filters_reason_is_found_again() {
        let pod = |node: Option<&str>, reason: &str, message: &str| {
            let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "uid": "u"},
                "spec": {"containers": [], "nodeName": node},
                "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                    "status": "False", "reason": reason, "message": message}]},
            }))
            .unwrap();
            refused_by_filter(&pod)
        };
        let ours = "0/1 nodes are available: 1 tether.io/gpu: 2 devices needed, 0 of 2 free \
                    (claimed by live pods).";
        assert!(pod(None, "Unschedulable", ours));
        assert!(!pod(Some("n1"), "Unschedulable", ours), "bound");
        assert!(!pod(None, "SchedulerError", ours));
        assert!(!pod(
            None,
            "Unschedulable",
            "0/1 nodes are available: 1 Insufficient tether.io/gpu."
        ));
    }

    #[test]
    fn a_renewed_refusal_keeps_its_nudge_and_old_refusals_are_forgotten() {
        let now = Instant::now();
        let refusals = Refusals::default();
        refusals.refused(refusal("p", 1, &[("n1", 1)], 0, now));
        refusals.nudged("p", "n1", now);
        refusals.refused(refusal("p", 1, &[("n1", 1)], 0, now));
        assert_eq!(refusals.get("p").unwrap().nudged, Some((now, "n1".into())));
        refusals.settled("p");
        assert!(refusals.get("p").is_none());
        refusals.refused(refusal("q", 1, &[("n1", 1)], 0, now));
        assert_eq!(refusals.standing(now).len(), 1);
        assert!(refusals.standing(now + FORGET_AFTER).is_empty());
    }
}
