//! Pins under anti-affinity: the run's pins all carry a "one per node"
//! rule, so in the final state no node has two of them. Pins with a
//! lifetime: in the log, no pin expires before its lifetime has passed
//! since it was assigned (on committed time; the countdown starts no
//! earlier than the assignment, when its owner stops).
//!
//! Device claims (the claimer's pins, corrected by `Reclaim`): in the final
//! state no device label (`dev/...`) of a node is in two pins, and a claim
//! a second attempt made again stands as it made it (its first attempt's
//! release on condition of its own label ended nothing).
//!
//! Proves: affinity is evaluated atomically in apply even when assignments
//! race and faults hit; a pin's lifetime is honoured across leader changes
//! and clock skew; a claim correction takes a device out of every other pin
//! in the entry that claims it. Does not check pins the run did not create.

use std::collections::BTreeMap;

use super::Evidence;

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut by_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for pin in &evidence.pins {
        let member = pin.key.as_ref().map_or("?", |k| k.member.as_str());
        by_node.entry(pin.node.as_str()).or_default().push(member);
    }
    by_node
        .into_iter()
        .filter(|(_, members)| members.len() > 1)
        .map(|(node, members)| {
            format!("node {node} has pins {members:?} despite their anti-affinity")
        })
        .chain(early_expiries(evidence))
        .chain(doubly_claimed(evidence))
        .chain(remade_claims_lost(evidence))
        .collect()
}

/// Claims a second attempt made again that are gone or not its own at the
/// end: the first attempt's release on condition of its label ended them.
fn remade_claims_lost(evidence: &Evidence) -> Vec<String> {
    evidence
        .remade_claims
        .iter()
        .filter(|member| {
            !evidence.claims.iter().any(|pin| {
                pin.key.as_ref().is_some_and(|k| &k.member == *member)
                    && pin
                        .labels
                        .get(crate::claims::ATTEMPT_LABEL)
                        .map(String::as_str)
                        == Some("2")
            })
        })
        .map(|member| {
            format!(
                "claim {member}, made again by a second attempt, is gone or not that attempt's: \
                 the first attempt's release on condition of its label ended it"
            )
        })
        .collect()
}

/// Devices of a node that two of the claimer's pins claim.
fn doubly_claimed(evidence: &Evidence) -> Vec<String> {
    let mut claimed: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for pin in &evidence.claims {
        let member = pin.key.as_ref().map_or("?", |k| k.member.as_str());
        for device in pin
            .labels
            .keys()
            .filter(|l| l.starts_with(crate::claims::DEVICE_PREFIX))
        {
            claimed
                .entry((pin.node.as_str(), device.as_str()))
                .or_default()
                .push(member);
        }
    }
    claimed
        .into_iter()
        .filter(|(_, members)| members.len() > 1)
        .map(|((node, device), members)| {
            format!("{device} of node {node} is claimed by pins {members:?} at once")
        })
        .collect()
}

/// Pins of the log that expired before their lifetime had passed since
/// their assignment.
fn early_expiries(evidence: &Evidence) -> Vec<String> {
    if !evidence.events_complete {
        return Vec::new();
    }
    let mut found = Vec::new();
    for (key, events) in evidence
        .events
        .iter()
        .filter(|(k, _)| k.starts_with("pin/"))
    {
        let mut assigned: Option<(u64, u64)> = None;
        for event in events {
            match event.kind.as_str() {
                "PinAssigned" => {
                    let lifetime = event
                        .attributes
                        .get("lifetime_ms")
                        .and_then(|l| l.parse().ok())
                        .unwrap_or(0);
                    assigned = Some((event.time_ms, lifetime));
                }
                "PinReleased" if event.reason.starts_with("Expired") => {
                    if let Some((at, lifetime)) = assigned
                        && event.time_ms < at + lifetime
                    {
                        found.push(format!(
                            "{key}: expired at {} ms, {} ms after its assignment, before its \
                             lifetime of {lifetime} ms",
                            event.time_ms,
                            event.time_ms - at
                        ));
                    }
                    assigned = None;
                }
                "PinReleased" => assigned = None,
                _ => {}
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_client::proto as pb;

    #[test]
    fn a_device_claimed_by_two_pins_of_a_node_is_caught() {
        let claim = |member: &str, node: &str, devices: &[&str]| pb::Pin {
            key: Some(pb::PinKey {
                set: "s-claims".into(),
                member: member.into(),
            }),
            node: node.into(),
            labels: devices
                .iter()
                .map(|d| (format!("dev/{d}"), member.to_string()))
                .chain([("other".to_string(), "x".to_string())])
                .collect(),
            ..Default::default()
        };
        // The same device on two nodes, and two pins with other devices.
        let mut evidence = Evidence {
            claims: vec![
                claim("1a", "n1", &["gpu0"]),
                claim("1b", "n1", &["gpu1"]),
                claim("1c", "n2", &["gpu0", "gpu1"]),
            ],
            ..Evidence::default()
        };
        assert!(check(&evidence).is_empty());
        // The hand-made flaw: a correction that kept the other pin's label.
        evidence.claims.push(claim("1d", "n1", &["gpu1", "gpu2"]));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("dev/gpu1 of node n1"), "{found:?}");
    }

    #[test]
    fn two_pins_of_the_set_on_one_node_are_caught() {
        let pin = |member: &str, node: &str| pb::Pin {
            key: Some(pb::PinKey {
                set: "s".into(),
                member: member.into(),
            }),
            node: node.into(),
            ..Default::default()
        };
        let mut evidence = Evidence {
            pins: vec![pin("0", "n1"), pin("1", "n2")],
            ..Evidence::default()
        };
        assert!(check(&evidence).is_empty());
        evidence.pins.push(pin("2", "n1"));
        assert_eq!(check(&evidence).len(), 1);
    }

    #[test]
    fn a_pin_expiring_before_its_lifetime_is_caught() {
        let event = |kind: &str, time_ms: u64, reason: &str| pb::Event {
            kind: kind.into(),
            time_ms,
            reason: reason.into(),
            attributes: [("lifetime_ms".to_string(), "600".to_string())].into(),
            ..Default::default()
        };
        let log = |released_at| {
            vec![
                event("PinAssigned", 1_000, ""),
                event("PinReleased", released_at, "Expired { lifetime_ms: 600 }"),
            ]
        };
        let mut evidence = Evidence {
            events_complete: true,
            ..Evidence::default()
        };
        evidence.events.insert("pin/s-life/0".into(), log(1_700));
        assert!(check(&evidence).is_empty());
        evidence.events.insert("pin/s-life/0".into(), log(1_500));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("before its lifetime"), "{found:?}");
    }
}
