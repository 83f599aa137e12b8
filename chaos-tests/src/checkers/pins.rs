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
