//! A node is its object: the name a node is registered under changes
//! objects (UIDs) only by the old one going. From the final event log of
//! each node the run reported:
//! - a live node never turns into another object: a `NodeJoined` or
//!   `NodeUpdated` naming a UID other than the live node's, with no
//!   `NodeGone` between them, left what the old object held (its pins,
//!   device claims, its lock's holder and queue) on the name.
//!
//! - a hold taken for a node object (an acquire naming the object's UID,
//!   format 10: the ender's re-create rounds, for the new object both
//!   before the old one is reported gone and after) never ends with
//!   another object's `Gone`: a `LockReleased` or `WaitEnded` "node gone"
//!   of its pod is in the same entry as the `NodeGone` of that very
//!   object (the live one before it, by the node's log).
//!
//! Proves: Tether refuses a report about another node object than the one
//! it has registered, a node re-created under its name (the ender's
//! re-create rounds) goes and joins again, and what is taken for the new
//! object is refused while the old one is registered, so the old one's
//! `Gone` cannot end it. Does not judge whether a report was refused or
//! applied as the reporter meant: only what the log did.

use std::collections::BTreeMap;

use super::{Evidence, rev};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = live_objects_kept(evidence);
    out.extend(holds_end_with_their_object(evidence));
    out
}

/// Per node: the object each `NodeGone` ended, by entry index.
fn gone_objects(evidence: &Evidence, node: &str) -> BTreeMap<u64, String> {
    let mut gone = BTreeMap::new();
    let mut live = String::new();
    for event in evidence
        .events
        .get(&format!("node/{node}"))
        .into_iter()
        .flatten()
    {
        match event.kind.as_str() {
            "NodeJoined" | "NodeUpdated" => {
                if let Some(uid) = event.attributes.get("uid").filter(|u| !u.is_empty()) {
                    live = uid.clone();
                }
            }
            "NodeGone" => {
                let index = event.revision.map_or(0, |r| r.index);
                gone.insert(index, std::mem::take(&mut live));
            }
            _ => {}
        }
    }
    gone
}

/// A hold taken for one node object, ended "node gone" in an entry whose
/// `NodeGone` was another object's.
fn holds_end_with_their_object(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for taken in &evidence.taken_for_objects {
        let gone = gone_objects(evidence, &taken.node);
        for event in evidence.events.get(&taken.lock).into_iter().flatten() {
            let ends_by_gone = matches!(event.kind.as_str(), "LockReleased" | "WaitEnded")
                && event.reason == "node gone"
                && event.pod.as_ref().is_some_and(|p| p.uid == taken.pod_uid);
            if !ends_by_gone {
                continue;
            }
            let index = event.revision.map_or(0, |r| r.index);
            match gone.get(&index) {
                Some(object) if object.is_empty() || *object == taken.object => {}
                other => out.push(format!(
                    "{}: {} of pod {} at {}, taken for node object {}, ended by the Gone of {}",
                    taken.lock,
                    event.kind,
                    taken.pod_uid,
                    rev(event),
                    taken.object,
                    other.map_or("no object (no NodeGone in that entry)", String::as_str)
                )),
            }
        }
    }
    out
}

/// A live node never turns into another object.
fn live_objects_kept(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for (key, events) in evidence
        .events
        .iter()
        .filter(|(k, _)| k.starts_with("node/"))
    {
        // The UID of the live object under the name ("" when unknown).
        let mut live: Option<String> = None;
        for event in events {
            let uid = event.attributes.get("uid").cloned().unwrap_or_default();
            match event.kind.as_str() {
                "NodeJoined" | "NodeUpdated" => {
                    if let Some(was) = &live
                        && !was.is_empty()
                        && !uid.is_empty()
                        && *was != uid
                    {
                        out.push(format!(
                            "{key}: {} at {} names object {uid} while {was} was the live node, \
                             which never went",
                            event.kind,
                            rev(event)
                        ));
                    }
                    if !uid.is_empty() || live.is_none() {
                        live = Some(uid);
                    }
                }
                "NodeGone" => live = None,
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::event;

    const K: &str = "node/n1";

    fn node(kind: &str, uid: &str, index: u64) -> tether_client::proto::Event {
        let mut e = event(kind, K, "", 0, index);
        if !uid.is_empty() {
            e.attributes.insert("uid".into(), uid.into());
        }
        e
    }

    fn evidence(events: Vec<tether_client::proto::Event>) -> Evidence {
        Evidence {
            events: [(K.to_string(), events)].into(),
            events_complete: true,
            ..Evidence::default()
        }
    }

    #[test]
    fn a_node_re_created_after_it_went_is_fine() {
        let log = vec![
            node("NodeJoined", "a", 1),
            node("NodeReady", "", 2),
            node("NodeUpdated", "a", 3),
            node("NodeGone", "", 4),
            node("NodeJoined", "b", 5),
        ];
        assert!(check(&evidence(log)).is_empty());
    }

    #[test]
    fn a_live_node_that_turns_into_another_object_is_caught() {
        let adopted = vec![node("NodeJoined", "a", 1), node("NodeUpdated", "b", 2)];
        let found = check(&evidence(adopted));
        assert_eq!(found.len(), 1);
        assert!(found[0].contains("names object b while a was the live node"));
        let joined_twice = vec![node("NodeJoined", "a", 1), node("NodeJoined", "b", 2)];
        assert_eq!(check(&evidence(joined_twice)).len(), 1);
    }

    /// A hold taken for the node's object "b": ended by "b"'s Gone it is
    /// fine; by "a"'s (the old object, registered when it was taken) it is
    /// caught.
    #[test]
    fn a_hold_ended_by_another_objects_gone_is_caught() {
        let lock = "lock/gpu-bind/n1";
        let taken = crate::workers::TakenForObject {
            lock: lock.into(),
            pod_uid: "p".into(),
            node: "n1".into(),
            object: "b".into(),
        };
        let mut released = event("LockReleased", lock, "p", 3, 4);
        released.reason = "node gone".into();
        let with = |node_log: Vec<tether_client::proto::Event>| Evidence {
            events: [
                (K.to_string(), node_log),
                (lock.to_string(), vec![released.clone()]),
            ]
            .into(),
            events_complete: true,
            taken_for_objects: vec![taken.clone()],
            ..Evidence::default()
        };
        let own = vec![
            node("NodeJoined", "a", 1),
            node("NodeGone", "", 2),
            node("NodeJoined", "b", 3),
            node("NodeGone", "", 4),
        ];
        assert!(check(&with(own)).is_empty());
        let others = vec![node("NodeJoined", "a", 1), node("NodeGone", "", 4)];
        let found = check(&with(others));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("taken for node object b, ended by the Gone of a"),
            "{found:?}"
        );
    }

    #[test]
    fn a_node_without_a_uid_is_not_judged() {
        let log = vec![node("NodeJoined", "", 1), node("NodeUpdated", "b", 2)];
        assert!(check(&evidence(log)).is_empty());
    }
}
