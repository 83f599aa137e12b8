//! Pins under anti-affinity: the run's pins all carry a "one per node"
//! rule, so in the final state no node has two of them.
//!
//! Proves: affinity is evaluated atomically in apply even when assignments
//! race and faults hit. Does not check pins the run did not create.

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
        .collect()
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
}
