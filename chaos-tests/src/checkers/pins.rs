//! Pins under anti-affinity: the run's pins all carry a "one per node"
//! rule, so in the final state no node has two of them. Pins with a
//! lifetime: in the log, no pin expires before its lifetime has passed
//! since it was assigned (on committed time; the countdown starts no
//! earlier than the assignment, when its owner stops).
//!
//! Proves: affinity is evaluated atomically in apply even when assignments
//! race and faults hit; a pin's lifetime is honoured across leader changes
//! and clock skew. Does not check pins the run did not create.

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
