//! A node is its object: the name a node is registered under changes
//! objects (UIDs) only by the old one going. From the final event log of
//! each node the run reported:
//! - a live node never turns into another object: a `NodeJoined` or
//!   `NodeUpdated` naming a UID other than the live node's, with no
//!   `NodeGone` between them, left what the old object held (its pins,
//!   device claims, its lock's holder and queue) on the name.
//!
//! Proves: Tether refuses a report about another node object than the one
//! it has registered, and a node re-created under its name (the ender's
//! re-create rounds) goes and joins again. Does not judge whether a report
//! was refused or applied as the reporter meant: only what the log did.

use super::{Evidence, rev};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
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

    #[test]
    fn a_node_without_a_uid_is_not_judged() {
        let log = vec![node("NodeJoined", "", 1), node("NodeUpdated", "b", 2)];
        assert!(check(&evidence(log)).is_empty());
    }
}
