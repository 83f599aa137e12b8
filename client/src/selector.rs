//! Parsing of label selectors and affinity terms as people write them:
//! `app=db,tier in (a,b),!canary` and `SELECTOR@TOPOLOGY[:WEIGHT]`.
//!
//! ```
//! use tether_client::selector::{parse_pin_key, parse_term};
//! let term = parse_term("app=slurmd@topology.kubernetes.io/zone").unwrap();
//! assert_eq!(term.topology_key, "topology.kubernetes.io/zone");
//! let key = parse_pin_key("slurm/nodeset-a/3").unwrap();
//! assert_eq!(key.member, "3");
//! ```

use std::collections::HashMap;

use tether_proto as pb;

use crate::error::{Error, Result};

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// Splits at commas that are not inside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn values(list: &str, part: &str) -> Result<Vec<String>> {
    let inner = list
        .trim()
        .strip_prefix('(')
        .and_then(|l| l.strip_suffix(')'))
        .ok_or_else(|| {
            invalid(format!(
                "selector part {part:?}: values go in parentheses, e.g. tier in (a,b)"
            ))
        })?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect())
}

/// Parses a Kubernetes-style selector: `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
/// `k notin (a,b)`, `k` (exists), `!k` (does not exist), comma-separated.
pub fn parse_selector(text: &str) -> Result<pb::LabelSelector> {
    let mut selector = pb::LabelSelector::default();
    let mut requirement = |key: &str, operator: &str, values: Vec<String>| {
        selector.match_expressions.push(pb::LabelRequirement {
            key: key.trim().to_string(),
            operator: operator.to_string(),
            values,
        });
    };
    let mut labels = HashMap::new();
    for part in split_top_level(text) {
        if let Some((key, value)) = part.split_once("!=") {
            requirement(key, "NotIn", vec![value.trim().to_string()]);
        } else if let Some((key, value)) = part.split_once("==").or_else(|| part.split_once('=')) {
            labels.insert(key.trim().to_string(), value.trim().to_string());
        } else if let Some((key, list)) = part.split_once(" notin ") {
            requirement(key, "NotIn", values(list, part)?);
        } else if let Some((key, list)) = part.split_once(" in ") {
            requirement(key, "In", values(list, part)?);
        } else if let Some(key) = part.strip_prefix('!') {
            requirement(key, "DoesNotExist", vec![]);
        } else if !part.contains(char::is_whitespace) {
            requirement(part, "Exists", vec![]);
        } else {
            return Err(invalid(format!("cannot read selector part {part:?}")));
        }
    }
    selector.match_labels = labels;
    Ok(selector)
}

/// Parses `SELECTOR@TOPOLOGY` (e.g. `app=db@topology.kubernetes.io/zone`).
pub fn parse_term(text: &str) -> Result<pb::AffinityTerm> {
    let (selector, topology) = text.rsplit_once('@').ok_or_else(|| {
        invalid(format!(
            "affinity term {text:?} must be SELECTOR@TOPOLOGY_KEY"
        ))
    })?;
    if topology.trim().is_empty() {
        return Err(invalid(format!(
            "affinity term {text:?} has no topology key after '@'"
        )));
    }
    Ok(pb::AffinityTerm {
        label_selector: Some(parse_selector(selector)?),
        topology_key: topology.trim().to_string(),
    })
}

/// Parses `SELECTOR@TOPOLOGY:WEIGHT` (weight 1-100).
pub fn parse_weighted_term(text: &str) -> Result<pb::WeightedAffinityTerm> {
    let (term, weight) = text.rsplit_once(':').ok_or_else(|| {
        invalid(format!(
            "preferred term {text:?} must be SELECTOR@TOPOLOGY_KEY:WEIGHT"
        ))
    })?;
    let weight: u32 = weight.trim().parse().map_err(|_| {
        invalid(format!(
            "preferred term {text:?}: weight {weight:?} is not a number 1-100"
        ))
    })?;
    Ok(pb::WeightedAffinityTerm {
        weight,
        term: Some(parse_term(term)?),
    })
}

/// Parses `k=v`.
pub fn parse_label(text: &str) -> Result<(String, String)> {
    text.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| invalid(format!("label {text:?} must be KEY=VALUE")))
}

/// Parses `SET/MEMBER`: the member is the last path segment
/// (`slurm/nodeset-a/3` is member `3` of set `slurm/nodeset-a`).
pub fn parse_pin_key(text: &str) -> Result<pb::PinKey> {
    match text.rsplit_once('/') {
        Some((set, member)) if !set.is_empty() && !member.is_empty() => Ok(pb::PinKey {
            set: set.to_string(),
            member: member.to_string(),
        }),
        _ => Err(invalid(format!(
            "pin {text:?} must be SET/MEMBER, e.g. slurm/nodeset-a/3"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_parse_like_kubectl() {
        let sel = parse_selector("app=db, tier in (a, b),!canary,env!=prod,gpu").unwrap();
        assert_eq!(
            sel.match_labels,
            HashMap::from([("app".to_string(), "db".to_string())])
        );
        let ops: Vec<(&str, &str, Vec<String>)> = sel
            .match_expressions
            .iter()
            .map(|r| (r.key.as_str(), r.operator.as_str(), r.values.clone()))
            .collect();
        assert_eq!(
            ops,
            vec![
                ("tier", "In", vec!["a".to_string(), "b".to_string()]),
                ("canary", "DoesNotExist", vec![]),
                ("env", "NotIn", vec!["prod".to_string()]),
                ("gpu", "Exists", vec![]),
            ]
        );
        assert!(parse_selector("tier in a,b").is_err());
    }

    #[test]
    fn terms_and_keys_parse() {
        let term = parse_weighted_term("app=db@topology.kubernetes.io/zone:50").unwrap();
        assert_eq!(term.weight, 50);
        assert_eq!(
            term.term.unwrap().topology_key,
            "topology.kubernetes.io/zone"
        );
        assert!(parse_term("app=db").is_err());
        let key = parse_pin_key("slurm/nodeset-a/3").unwrap();
        assert_eq!(
            (key.set.as_str(), key.member.as_str()),
            ("slurm/nodeset-a", "3")
        );
        assert!(parse_pin_key("nomember").is_err());
    }
}
