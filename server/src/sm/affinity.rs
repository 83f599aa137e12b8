//! Affinity and anti-affinity of pin assignments, after Kubernetes inter-pod
//! affinity: terms `{label_selector, topology_key}` over pin labels. Required
//! terms filter candidates, preferred terms (weight 1-100) order them.
//!
//! Evaluated inside the state machine against the applied pins, so two
//! assigners racing each other are serialized by the log and can never both
//! violate a rule.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::State;
use super::types::{Labels, Pin, PinKey};

/// The topology key that means "the node itself".
pub const HOSTNAME_TOPOLOGY: &str = "kubernetes.io/hostname";

/// Operator of a set-based selector requirement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SelectorOp {
    /// The label's value is one of the values.
    In,
    /// The label is absent or its value is none of the values.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// Operator.
    pub op: SelectorOp,
    /// Values (for In / NotIn).
    pub values: Vec<String>,
}

/// A Kubernetes-style label selector; all parts must match (an empty
/// selector matches everything).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LabelSelector {
    /// Exact key=value matches.
    pub match_labels: BTreeMap<String, String>,
    /// Set-based requirements.
    pub match_expressions: Vec<Requirement>,
}

/// What a selector reads labels from: a pin's stored [`Labels`] or the
/// labels of a pin being assigned.
pub trait LabelLookup {
    /// The value of `key`.
    fn label(&self, key: &str) -> Option<&String>;
}

impl LabelLookup for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&String> {
        self.get(key)
    }
}

impl LabelLookup for Labels {
    fn label(&self, key: &str) -> Option<&String> {
        self.get(key)
    }
}

impl LabelSelector {
    /// Whether `labels` satisfy the selector.
    pub fn matches(&self, labels: &impl LabelLookup) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.label(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.label(&r.key);
                match r.op {
                    SelectorOp::In => value.is_some_and(|v| r.values.contains(v)),
                    SelectorOp::NotIn => value.is_none_or(|v| !r.values.contains(v)),
                    SelectorOp::Exists => value.is_some(),
                    SelectorOp::DoesNotExist => value.is_none(),
                }
            })
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        for r in &self.match_expressions {
            parts.push(match r.op {
                SelectorOp::In => format!("{} in ({})", r.key, r.values.join(",")),
                SelectorOp::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
                SelectorOp::Exists => r.key.clone(),
                SelectorOp::DoesNotExist => format!("!{}", r.key),
            });
        }
        if parts.is_empty() {
            write!(f, "(everything)")
        } else {
            write!(f, "{}", parts.join(","))
        }
    }
}

/// One affinity term.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AffinityTerm {
    /// Which existing pins the term is about.
    pub selector: LabelSelector,
    /// The domain: `kubernetes.io/hostname` = the node, else a node label.
    pub topology_key: String,
}

/// A preferred term with its weight (1-100).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightedTerm {
    /// 1-100.
    pub weight: u32,
    /// The term.
    pub term: AffinityTerm,
}

/// All affinity rules of one assignment.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Affinity {
    /// Must share a domain with a matching pin.
    pub required: Vec<AffinityTerm>,
    /// Must not share a domain with any matching pin.
    pub required_anti: Vec<AffinityTerm>,
    /// Prefer sharing a domain with matching pins.
    pub preferred: Vec<WeightedTerm>,
    /// Prefer not sharing a domain with matching pins.
    pub preferred_anti: Vec<WeightedTerm>,
}

/// The value of topology `key` for `node`: the node name for the hostname
/// key, else the node's label in the registry (None if unknown or absent).
pub fn topology_value(state: &State, node: &str, key: &str) -> Option<String> {
    if key == HOSTNAME_TOPOLOGY {
        return Some(node.to_string());
    }
    state
        .nodes
        .get(node)
        .and_then(|n| n.labels.get(key).cloned())
}

/// The domains (topology values) that pins matching `term` occupy, with one
/// example pin per domain (the first by key) for error messages. With
/// `within`, only the domains of those nodes are sought: for the hostname
/// key a pin's domain is its node, so only their pins are looked at (the
/// pin table's node index); for any other key every pin is.
fn occupied(
    state: &State,
    term: &AffinityTerm,
    exclude: &PinKey,
    within: Option<&[String]>,
) -> BTreeMap<String, PinKey> {
    let mut domains = BTreeMap::new();
    let mut consider = |key: &PinKey, pin: &Pin| {
        if key != exclude
            && term.selector.matches(&pin.labels)
            && let Some(value) = topology_value(state, &pin.node, &term.topology_key)
        {
            domains.entry(value).or_insert_with(|| key.clone());
        }
    };
    match within {
        Some(nodes) if term.topology_key == HOSTNAME_TOPOLOGY => {
            for node in nodes {
                for (key, pin) in state.pins.on_node(node) {
                    consider(key, pin);
                }
            }
        }
        _ => {
            for (key, pin) in &state.pins {
                consider(key, pin);
            }
        }
    }
    domains
}

/// Why a candidate does not fit, or None if it does.
fn refusal(
    state: &State,
    candidate: &str,
    own_labels: &BTreeMap<String, String>,
    affinity: &Affinity,
    domains: &Domains,
) -> Option<String> {
    if let Some(node) = state.nodes.get(candidate) {
        if node.gone_at_ms.is_some() {
            return Some("node is gone".into());
        }
        if !node.ready {
            return Some("node is not ready".into());
        }
        if node.unschedulable {
            return Some("node is unschedulable (cordoned)".into());
        }
    }
    for (term, occupied) in affinity.required.iter().zip(&domains.required) {
        let Some(value) = topology_value(state, candidate, &term.topology_key) else {
            return Some(format!(
                "node has no label {} (required affinity)",
                term.topology_key
            ));
        };
        // The first pin of a group may go anywhere its own rule allows.
        let first_of_group = occupied.is_empty() && term.selector.matches(own_labels);
        if !first_of_group && !occupied.contains_key(&value) {
            return Some(format!(
                "no pin matching {} in {}={value} (required affinity)",
                term.selector, term.topology_key
            ));
        }
    }
    for (term, occupied) in affinity.required_anti.iter().zip(&domains.required_anti) {
        let Some(value) = topology_value(state, candidate, &term.topology_key) else {
            return Some(format!(
                "node has no label {} (required anti-affinity)",
                term.topology_key
            ));
        };
        if let Some(pin) = occupied.get(&value) {
            return Some(format!(
                "pin {pin} matching {} is already in {}={value} (required anti-affinity)",
                term.selector, term.topology_key
            ));
        }
    }
    None
}

/// Occupied domains per term, computed once per assignment.
struct Domains {
    required: Vec<BTreeMap<String, PinKey>>,
    required_anti: Vec<BTreeMap<String, PinKey>>,
    preferred: Vec<BTreeSet<String>>,
    preferred_anti: Vec<BTreeSet<String>>,
}

/// Picks the node for a new pin `key`: the first candidate, in order of
/// preferred-term score (then the caller's order), that passes every required
/// rule. On failure, lists for each candidate why it was refused.
pub fn choose(
    state: &State,
    key: &PinKey,
    candidates: &[String],
    own_labels: &BTreeMap<String, String>,
    affinity: &Affinity,
) -> Result<String, Vec<(String, String)>> {
    // Only the candidates' domains are read, except by a required term,
    // which also asks whether any pin anywhere matches (the first of a
    // group may go anywhere).
    place(
        state,
        key,
        candidates,
        own_labels,
        affinity,
        Some(candidates),
    )
}

/// [`choose`], the occupied domains sought `within` those nodes (None:
/// every pin looked at, as before the node index; the tests compare both).
fn place(
    state: &State,
    key: &PinKey,
    candidates: &[String],
    own_labels: &BTreeMap<String, String>,
    affinity: &Affinity,
    within: Option<&[String]>,
) -> Result<String, Vec<(String, String)>> {
    let domains = Domains {
        required: affinity
            .required
            .iter()
            .map(|t| occupied(state, t, key, None))
            .collect(),
        required_anti: affinity
            .required_anti
            .iter()
            .map(|t| occupied(state, t, key, within))
            .collect(),
        preferred: affinity
            .preferred
            .iter()
            .map(|w| occupied(state, &w.term, key, within).into_keys().collect())
            .collect(),
        preferred_anti: affinity
            .preferred_anti
            .iter()
            .map(|w| occupied(state, &w.term, key, within).into_keys().collect())
            .collect(),
    };
    let score = |candidate: &str| -> i64 {
        let mut score = 0i64;
        for (w, occupied) in affinity.preferred.iter().zip(&domains.preferred) {
            if topology_value(state, candidate, &w.term.topology_key)
                .is_some_and(|v| occupied.contains(&v))
            {
                score += i64::from(w.weight);
            }
        }
        for (w, occupied) in affinity.preferred_anti.iter().zip(&domains.preferred_anti) {
            if topology_value(state, candidate, &w.term.topology_key)
                .is_some_and(|v| occupied.contains(&v))
            {
                score -= i64::from(w.weight);
            }
        }
        score
    };
    let mut refusals = Vec::new();
    let mut fitting: Vec<(i64, usize, &String)> = Vec::new();
    for (order, candidate) in candidates.iter().enumerate() {
        match refusal(state, candidate, own_labels, affinity, &domains) {
            Some(why) => refusals.push((candidate.clone(), why)),
            None => fitting.push((score(candidate), order, candidate)),
        }
    }
    // Highest score first; ties keep the caller's order.
    fitting.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    match fitting.first() {
        Some((_, _, node)) => Ok((*node).clone()),
        None => Err(refusals),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::types::{NodeInfo, OwnerState, Pin};

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn node(zone: Option<&str>) -> NodeInfo {
        NodeInfo {
            uid: "uid".into(),
            labels: zone.map(|z| labels(&[("zone", z)])).unwrap_or_default(),
            ready: true,
            unschedulable: false,
            joined_at_ms: 0,
            gone_at_ms: None,
        }
    }

    fn pin(node: &str, app: &str) -> Pin {
        Pin {
            node: node.into(),
            pinned_at_ms: 0,
            pod_uid: String::new(),
            labels: labels(&[("app", app)]).into(),
            lifetime_ms: 0,
            last_running_at_ms: 0,
            owner: OwnerState::Unknown,
        }
    }

    fn app_term(app: &str, topology: &str) -> AffinityTerm {
        AffinityTerm {
            selector: LabelSelector {
                match_labels: labels(&[("app", app)]),
                ..Default::default()
            },
            topology_key: topology.into(),
        }
    }

    fn state() -> State {
        let mut state = State::default();
        state.nodes.insert("n1".into(), node(Some("a")));
        state.nodes.insert("n2".into(), node(Some("a")));
        state.nodes.insert("n3".into(), node(Some("b")));
        state.nodes.insert("n4".into(), node(None));
        state.pins.insert(PinKey::new("db", "0"), pin("n1", "db"));
        state
    }

    fn candidates(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn required_anti_affinity_by_zone_skips_occupied_zones_and_unlabelled_nodes() {
        let affinity = Affinity {
            required_anti: vec![app_term("db", "zone")],
            ..Default::default()
        };
        let own = labels(&[("app", "db")]);
        let chosen = choose(
            &state(),
            &PinKey::new("db", "1"),
            &candidates(&["n2", "n4", "n3"]),
            &own,
            &affinity,
        );
        assert_eq!(chosen, Ok("n3".into()));
        let err = choose(
            &state(),
            &PinKey::new("db", "1"),
            &candidates(&["n2", "n4"]),
            &own,
            &affinity,
        )
        .unwrap_err();
        assert_eq!(err.len(), 2);
        assert!(
            err[0].1.contains("db/0") && err[0].1.contains("zone=a"),
            "{err:?}"
        );
        assert!(err[1].1.contains("no label zone"), "{err:?}");
    }

    #[test]
    fn required_affinity_follows_matching_pins_and_lets_the_first_of_a_group_anywhere() {
        let affinity = Affinity {
            required: vec![app_term("db", "zone")],
            ..Default::default()
        };
        let chosen = choose(
            &state(),
            &PinKey::new("web", "0"),
            &candidates(&["n3", "n2"]),
            &labels(&[("app", "web")]),
            &affinity,
        );
        assert_eq!(chosen, Ok("n2".into()));
        let group = Affinity {
            required: vec![app_term("cache", "zone")],
            ..Default::default()
        };
        let first = choose(
            &state(),
            &PinKey::new("cache", "0"),
            &candidates(&["n3"]),
            &labels(&[("app", "cache")]),
            &group,
        );
        assert_eq!(first, Ok("n3".into()));
    }

    #[test]
    fn preferred_terms_order_candidates_and_ties_keep_the_callers_order() {
        let affinity = Affinity {
            preferred_anti: vec![WeightedTerm {
                weight: 50,
                term: app_term("db", HOSTNAME_TOPOLOGY),
            }],
            ..Default::default()
        };
        let chosen = choose(
            &state(),
            &PinKey::new("db", "1"),
            &candidates(&["n1", "n2", "n3"]),
            &BTreeMap::new(),
            &affinity,
        );
        assert_eq!(chosen, Ok("n2".into()));
        let affinity = Affinity {
            preferred: vec![WeightedTerm {
                weight: 10,
                term: app_term("db", "zone"),
            }],
            ..Default::default()
        };
        let chosen = choose(
            &state(),
            &PinKey::new("x", "1"),
            &candidates(&["n3", "n2", "n1"]),
            &BTreeMap::new(),
            &affinity,
        );
        assert_eq!(chosen, Ok("n2".into()));
    }

    #[test]
    fn gone_not_ready_and_cordoned_nodes_are_refused_with_reasons() {
        let mut state = state();
        state.nodes.get_mut("n1").unwrap().gone_at_ms = Some(1);
        state.nodes.get_mut("n2").unwrap().ready = false;
        state.nodes.get_mut("n3").unwrap().unschedulable = true;
        let err = choose(
            &state,
            &PinKey::new("x", "0"),
            &candidates(&["n1", "n2", "n3"]),
            &BTreeMap::new(),
            &Affinity::default(),
        )
        .unwrap_err();
        let reasons: Vec<&str> = err.iter().map(|(_, r)| r.as_str()).collect();
        assert_eq!(
            reasons,
            [
                "node is gone",
                "node is not ready",
                "node is unschedulable (cordoned)"
            ]
        );
    }

    #[test]
    fn selectors_match_like_kubernetes() {
        let sel = LabelSelector {
            match_labels: labels(&[("app", "db")]),
            match_expressions: vec![
                Requirement {
                    key: "tier".into(),
                    op: SelectorOp::In,
                    values: vec!["a".into(), "b".into()],
                },
                Requirement {
                    key: "canary".into(),
                    op: SelectorOp::DoesNotExist,
                    values: vec![],
                },
            ],
        };
        assert!(sel.matches(&labels(&[("app", "db"), ("tier", "b")])));
        assert!(!sel.matches(&labels(&[("app", "db"), ("tier", "c")])));
        assert!(!sel.matches(&labels(&[("app", "db"), ("tier", "a"), ("canary", "1")])));
        assert_eq!(sel.to_string(), "app=db,tier in (a,b),!canary");
    }

    /// Looking at the candidates' pins alone places every pin as looking
    /// at every pin did, refusals and their example pins included: random
    /// states, terms by hostname and by zone, candidates with repeats.
    #[test]
    fn looking_only_at_the_candidates_pins_places_as_looking_at_every_pin() {
        let seed: u64 = 20_261_205;
        println!("seed {seed}");
        let mut x = seed;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let nodes = ["n1", "n2", "n3", "n4", "n5", "n6"];
        let apps = ["db", "web", "cache"];
        let topologies = [HOSTNAME_TOPOLOGY, "zone"];
        fn terms(
            next: &mut impl FnMut(u64) -> u64,
            most: u64,
            apps: &[&str],
            topologies: &[&str],
        ) -> Vec<AffinityTerm> {
            (0..next(most + 1))
                .map(|_| {
                    let app = apps[next(apps.len() as u64) as usize];
                    app_term(app, topologies[next(2) as usize])
                })
                .collect()
        }
        for round in 0..500 {
            let mut state = State::default();
            for node in nodes {
                let zone = ["a", "b", "none"][next(3) as usize];
                state
                    .nodes
                    .insert(node.into(), self::node((zone != "none").then_some(zone)));
            }
            for member in 0..next(20) {
                let node = nodes[next(6) as usize];
                let app = apps[next(3) as usize];
                state
                    .pins
                    .insert(PinKey::new("s", member.to_string()), pin(node, app));
            }
            let weighted = |terms: Vec<AffinityTerm>, weight: u32| {
                terms
                    .into_iter()
                    .map(|term| WeightedTerm { weight, term })
                    .collect()
            };
            let affinity = Affinity {
                required: terms(&mut next, 1, &apps, &topologies),
                required_anti: terms(&mut next, 2, &apps, &topologies),
                preferred: weighted(terms(&mut next, 2, &apps, &topologies), 10),
                preferred_anti: weighted(terms(&mut next, 2, &apps, &topologies), 20),
            };
            let candidates: Vec<String> = (0..1 + next(4))
                .map(|_| nodes[next(6) as usize].to_string())
                .collect();
            let key = PinKey::new("s", next(25).to_string());
            let own = labels(&[("app", apps[next(3) as usize])]);
            assert_eq!(
                place(
                    &state,
                    &key,
                    &candidates,
                    &own,
                    &affinity,
                    Some(&candidates)
                ),
                place(&state, &key, &candidates, &own, &affinity, None),
                "seed {seed}, round {round}"
            );
        }
    }
}
