//! What an end ends stays ended in its entry:
//! - a lock released because the node it is named after is gone is granted
//!   to nobody by that entry, and every pod waiting for it is told its wait
//!   ended (those pods must be scheduled elsewhere);
//! - a pod whose holds were revoked is granted nothing by the entry that
//!   revoked it;
//! - a wait that ended (deadline, revoke, node gone, lease end, caller gone)
//!   never comes back: the pod is not granted or queued for that lock again
//!   (every pod of the chaos workload asks for each lock once; a retry of
//!   its request is answered with the wait's end);
//! - no caller that was there to hear it is told its wait was given up
//!   because its caller went away (a retry that came back keeps its wait).
//!
//! Proves: node-gone and revoke-pod end the holder and the queue together,
//! in one entry. Does not judge later entries: the lock may be acquired
//! again afterwards (a new node under the same name), and that is correct.

use std::collections::{BTreeMap, BTreeSet};

use super::{Evidence, rev, uid_of};
use crate::history::{Call, Value};

/// The `reason` of a `LockReleased` whose node is gone (`ReleaseReason`'s
/// display form).
const NODE_GONE: &str = "node gone";

/// The start of the `reason` of a `LockReleased` by a pod revoke.
const POD_REVOKED: &str = "pod revoked";

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for (key, events) in &evidence.events {
        // Waiters by uid, as the log has them up to the current event.
        let mut waiting: BTreeSet<String> = BTreeSet::new();
        // The entry whose node-gone release is being replayed, and the
        // waiters that must have left by the end of it.
        let mut gone_entry: Option<(u64, BTreeSet<String>)> = None;
        // (entry, pod) of revoke releases.
        let mut revoked: BTreeSet<(u64, String)> = BTreeSet::new();
        // Pods whose wait for this lock ended, and where.
        let mut ended: BTreeMap<String, String> = BTreeMap::new();
        for event in events {
            let index = event.revision.map_or(0, |r| r.index);
            if let Some((entry, left)) = &gone_entry
                && index != *entry
            {
                for uid in left.iter().filter(|u| waiting.contains(*u)) {
                    out.push(format!(
                        "{key}: {uid} still waits after its node was reported gone at {entry}"
                    ));
                }
                gone_entry = None;
            }
            let uid = uid_of(event).to_string();
            if matches!(event.kind.as_str(), "LockQueued" | "LockGranted")
                && let Some(at) = ended.get(&uid)
            {
                out.push(format!(
                    "{key}: {} for {uid} at {}, after its wait ended at {at}",
                    event.kind,
                    rev(event)
                ));
            }
            match event.kind.as_str() {
                "LockQueued" => {
                    waiting.insert(uid);
                }
                "WaitEnded" => {
                    waiting.remove(&uid);
                    ended.insert(uid, rev(event));
                }
                "LockReleased" if event.reason == NODE_GONE => {
                    gone_entry = Some((index, waiting.clone()));
                }
                "LockReleased" if event.reason.starts_with(POD_REVOKED) => {
                    revoked.insert((index, uid));
                }
                "LockGranted" => {
                    waiting.remove(&uid);
                    if gone_entry
                        .as_ref()
                        .is_some_and(|(entry, _)| *entry == index)
                    {
                        out.push(format!(
                            "{key}: granted to {uid} with token {} at {}, by the entry that released it because its node is gone",
                            event.token,
                            rev(event)
                        ));
                    }
                    if revoked.contains(&(index, uid.clone())) {
                        out.push(format!(
                            "{key}: granted to {uid} at {}, by the entry that revoked that pod",
                            rev(event)
                        ));
                    }
                }
                _ => {}
            }
        }
        if let Some((entry, left)) = gone_entry {
            for uid in left.iter().filter(|u| waiting.contains(*u)) {
                out.push(format!(
                    "{key}: {uid} still waits after its node was reported gone at {entry}"
                ));
            }
        }
    }
    for op in &evidence.ops {
        if let (Call::Acquire { uid, .. }, Some(Value::Abandoned)) = (&op.call, op.value()) {
            out.push(format!(
                "{}: {uid} (op {}) was told its wait was given up because its caller went away, while it was there",
                op.key, op.id
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::{event, queued};

    const K: &str = "lock/t/node-a";

    fn released(uid: &str, token: u64, index: u64, reason: &str) -> tether_client::proto::Event {
        let mut e = event("LockReleased", K, uid, token, index);
        e.reason = reason.into();
        e
    }

    #[test]
    fn a_gone_nodes_lock_handed_to_its_waiter_is_caught() {
        let mut evidence = Evidence::default();
        let healthy = vec![
            event("LockGranted", K, "h", 5, 5),
            queued(K, "w", 1, 6),
            event("WaitEnded", K, "w", 0, 9),
            released("h", 5, 9, NODE_GONE),
            // A later pod on the node's next incarnation.
            event("LockGranted", K, "x", 12, 12),
        ];
        evidence.events.insert(K.into(), healthy);
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // The planted bug: the holder released first, the waiter granted.
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "h", 5, 5),
                queued(K, "w", 1, 6),
                queued(K, "v", 2, 7),
                released("h", 5, 9, NODE_GONE),
                event("LockGranted", K, "w", 9, 9),
                event("WaitEnded", K, "v", 0, 9),
            ],
        );
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("because its node is gone"), "{found:?}");
    }

    #[test]
    fn a_waiter_left_queued_on_a_gone_node_is_caught() {
        let mut evidence = Evidence::default();
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "h", 5, 5),
                queued(K, "w", 1, 6),
                released("h", 5, 9, NODE_GONE),
            ],
        );
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("w still waits"), "{found:?}");
    }

    #[test]
    fn a_wait_that_comes_back_after_it_ended_is_caught() {
        let mut evidence = Evidence::default();
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "h", 5, 5),
                queued(K, "w", 1, 6),
                event("WaitEnded", K, "w", 0, 8),
                event("LockReleased", K, "h", 5, 9),
            ],
        );
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // A late copy of w's acquire applied as new after its wait ended.
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockGranted", K, "w", 11, 11));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("after its wait ended at 8.0"),
            "{found:?}"
        );
    }

    #[test]
    fn a_caller_told_it_went_away_is_caught() {
        let mut evidence = Evidence::default();
        let mut op = crate::checkers::testkit::granted(0, K, "w", 0, (0, 10));
        op.outcome = crate::history::Outcome::Ok(Value::Abandoned);
        evidence.ops.push(op);
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("while it was there"), "{found:?}");
    }

    #[test]
    fn a_revoked_pod_granted_by_its_revoke_is_caught() {
        let mut evidence = Evidence::default();
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "a", 5, 5),
                released("a", 5, 9, "pod revoked: deleted"),
                event("LockGranted", K, "b", 9, 9),
            ],
        );
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockGranted", K, "a", 9, 9));
        assert_eq!(check(&evidence).len(), 1, "{:?}", check(&evidence));
    }
}
