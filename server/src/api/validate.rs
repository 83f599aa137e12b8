//! Input validation at the API edge: bad input is refused before it reaches
//! the log, so it changes nothing.

use crate::auth::Caller;
use crate::error::{ApiError, Result};

/// Longest client id accepted.
pub const MAX_CLIENT_ID_LEN: usize = 128;
/// Longest free-text field (reasons, operator names).
pub const MAX_TEXT_LEN: usize = 1024;

fn invalid(msg: String) -> ApiError {
    ApiError::InvalidArgument(msg)
}

/// A DNS-1123 label: 1-63 lowercase alphanumerics or '-', starting and ending
/// alphanumeric (Kubernetes namespace rules).
pub fn dns1123_label(what: &str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what} {value:?} is not a valid DNS-1123 label: use 1-63 lowercase letters, digits \
             or '-', starting and ending with a letter or digit"
        )))
    }
}

/// A DNS-1123 subdomain: at most 253 characters, dot-separated DNS-1123
/// labels (Kubernetes node and pod name rules).
pub fn dns1123_subdomain(what: &str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value
            .split('.')
            .all(|label| dns1123_label(what, label).is_ok());
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what} {value:?} is not a valid DNS-1123 subdomain: use at most 253 lowercase \
             letters, digits, '-' or '.', each dot-separated part starting and ending with a \
             letter or digit"
        )))
    }
}

/// 1-64 ASCII letters, digits or '-': a Kubernetes object's UID (a UUID).
fn is_uid(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A node object's UID as a caller saw it: empty (not given), or as a pod
/// UID.
pub fn node_uid(node: &str, value: &str) -> Result<()> {
    if value.is_empty() || is_uid(value) {
        Ok(())
    } else {
        Err(invalid(format!(
            "node uid {value:?} of node {node:?} is not valid: use up to 64 letters, digits or \
             '-' (the node object's metadata.uid), or nothing"
        )))
    }
}

/// A pod UID: 1-64 ASCII letters, digits or '-' (Kubernetes UIDs are UUIDs).
pub fn pod_uid(value: &str) -> Result<()> {
    if is_uid(value) {
        Ok(())
    } else {
        Err(invalid(format!(
            "pod uid {value:?} is not valid: use 1-64 letters, digits or '-' (a Kubernetes UID \
             is a UUID such as 6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f)"
        )))
    }
}

/// A pod: valid UID; namespace and name optional but well-formed if given.
pub fn pod(pod: &tether_proto::Pod) -> Result<()> {
    pod_uid(&pod.uid)?;
    if !pod.namespace.is_empty() {
        dns1123_label("pod namespace", &pod.namespace)?;
    }
    if !pod.name.is_empty() {
        dns1123_subdomain("pod name", &pod.name)?;
    }
    Ok(())
}

/// A lock key: scope is a DNS-1123 label, name a DNS-1123 subdomain.
pub fn lock_key(key: Option<&tether_proto::LockKey>) -> Result<crate::sm::LockKey> {
    let key = key.ok_or_else(|| invalid("missing lock key (scope and name)".to_string()))?;
    dns1123_label("lock scope", &key.scope)?;
    dns1123_subdomain("lock name", &key.name)?;
    Ok(crate::sm::LockKey::new(&key.scope, &key.name))
}

/// A request id, if present: client id 1-128 printable ASCII, sequence > 0,
/// `first_incomplete` at most the sequence.
///
/// The session it names is bound to the caller: with authentication on, the
/// server puts the caller's identity in front of the client id
/// (`token:extender/client-1a2b...`), so a caller can neither read another
/// caller's kept answers nor move another caller's session, whatever client
/// id it sends. Without authentication (the development default) there are
/// no identities to bind to: any caller may do anything there anyway.
pub fn request_id(
    caller: &Caller,
    id: Option<&tether_proto::RequestId>,
) -> Result<Option<crate::sm::RequestId>> {
    let Some(id) = id else { return Ok(None) };
    let ok_client = !id.client_id.is_empty()
        && id.client_id.len() <= MAX_CLIENT_ID_LEN
        && id.client_id.bytes().all(|b| b.is_ascii_graphic());
    if !ok_client {
        return Err(invalid(format!(
            "client id {:?} is not valid: use 1-{MAX_CLIENT_ID_LEN} printable ASCII characters \
             without spaces",
            id.client_id
        )));
    }
    if id.sequence == 0 {
        return Err(invalid("request sequence must start at 1".to_string()));
    }
    if id.first_incomplete > id.sequence {
        return Err(invalid(format!(
            "first_incomplete {} is above the request's own sequence {}: a request is incomplete \
             until it is answered",
            id.first_incomplete, id.sequence
        )));
    }
    let client_id = if caller.authenticated() {
        format!("{}/{}", caller.identity, id.client_id)
    } else {
        id.client_id.clone()
    };
    Ok(Some(crate::sm::RequestId {
        client_id,
        sequence: id.sequence,
        first_incomplete: id.first_incomplete,
    }))
}

/// Free text (reasons, operator names): required or not, at most
/// [`MAX_TEXT_LEN`] bytes.
pub fn text(what: &str, value: &str, required: bool) -> Result<()> {
    if required && value.trim().is_empty() {
        return Err(invalid(format!("{what} is required")));
    }
    if value.len() > MAX_TEXT_LEN {
        return Err(invalid(format!(
            "{what} is longer than {MAX_TEXT_LEN} bytes"
        )));
    }
    Ok(())
}

/// A payload within the configured limit.
pub fn payload(payload: &[u8], limit: usize) -> Result<()> {
    if payload.len() > limit {
        return Err(ApiError::TooLarge(format!(
            "payload of {} bytes is over the limit of {limit} bytes (tetherd \
             --max-payload-bytes); store a reference to the data instead",
            payload.len()
        )));
    }
    Ok(())
}

/// Most `match_labels` one affinity selector may carry.
pub const MAX_SELECTOR_LABELS: usize = 64;

/// Most candidates one assignment may name.
pub const MAX_CANDIDATES: usize = 1000;

/// Most affinity terms (required, required-anti, preferred and
/// preferred-anti together) one assignment may carry: apply checks each
/// term against every pin of the set, inside the state machine.
pub const MAX_AFFINITY_TERMS: usize = 32;

/// Most `match_expressions` one selector may carry, and most values one
/// expression may list.
pub const MAX_SELECTOR_EXPRESSIONS: usize = 64;

fn label_key_ok(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 253
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b))
}

fn label_value_ok(value: &str) -> bool {
    value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Labels: at most `max_count`; keys up to 253 characters of letters,
/// digits and `-_./`; values up to 63 of letters, digits and `-_.`
/// (Kubernetes label rules, loosely).
pub fn labels(
    what: &str,
    labels: &std::collections::HashMap<String, String>,
    max_count: usize,
) -> Result<std::collections::BTreeMap<String, String>> {
    if labels.len() > max_count {
        return Err(ApiError::TooLarge(format!(
            "{} {what}s is over the limit of {max_count} (tetherd --max-labels)",
            labels.len()
        )));
    }
    for (key, value) in labels {
        if !label_key_ok(key) {
            return Err(invalid(format!(
                "{what} key {key:?} is not valid: use up to 253 letters, digits, '-', '_', '.' or '/'"
            )));
        }
        if !label_value_ok(value) {
            return Err(invalid(format!(
                "{what} value {value:?} (key {key:?}) is not valid: use up to 63 letters, digits, \
                 '-', '_' or '.'"
            )));
        }
    }
    Ok(labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
}

/// A pin key: set is 1-253 lowercase letters, digits, `-`, `.` or `/`; member
/// is 1-63 letters, digits, `-`, `_` or `.`.
pub fn pin_key(key: Option<&tether_proto::PinKey>) -> Result<crate::sm::PinKey> {
    let key = key.ok_or_else(|| invalid("missing pin key (set and member)".to_string()))?;
    pin_set(&key.set)?;
    let member_ok = !key.member.is_empty()
        && key.member.len() <= 63
        && key
            .member
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !member_ok {
        return Err(invalid(format!(
            "pin member {:?} is not valid: use 1-63 letters, digits, '-', '_' or '.' (e.g. 3)",
            key.member
        )));
    }
    Ok(crate::sm::PinKey::new(&key.set, &key.member))
}

/// A pin set: 1-253 lowercase letters, digits, `-`, `.` or `/`, not
/// starting or ending with `/`.
pub fn pin_set(set: &str) -> Result<()> {
    let set_ok = !set.is_empty()
        && set.len() <= 253
        && !set.starts_with('/')
        && !set.ends_with('/')
        && set
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-./".contains(&b));
    if !set_ok {
        return Err(invalid(format!(
            "pin set {set:?} is not valid: use 1-253 lowercase letters, digits, '-', '.' or '/' \
             (e.g. slurm/nodeset-a)"
        )));
    }
    Ok(())
}

/// Candidate node names: 1-[`MAX_CANDIDATES`] DNS-1123 subdomains.
pub fn candidates(candidates: &[String]) -> Result<Vec<String>> {
    if candidates.is_empty() {
        return Err(invalid("no candidate nodes given".to_string()));
    }
    if candidates.len() > MAX_CANDIDATES {
        return Err(ApiError::TooLarge(format!(
            "{} candidates is over the limit of {MAX_CANDIDATES}",
            candidates.len()
        )));
    }
    for node in candidates {
        dns1123_subdomain("candidate node", node)?;
    }
    Ok(candidates.to_vec())
}

fn selector(
    sel: Option<&tether_proto::LabelSelector>,
) -> Result<crate::sm::affinity::LabelSelector> {
    use crate::sm::affinity::{LabelSelector, Requirement, SelectorOp};
    let Some(sel) = sel else {
        return Ok(LabelSelector::default());
    };
    let match_labels = labels("selector label", &sel.match_labels, MAX_SELECTOR_LABELS)?;
    if sel.match_expressions.len() > MAX_SELECTOR_EXPRESSIONS {
        return Err(ApiError::TooLarge(format!(
            "{} selector expressions is over the limit of {MAX_SELECTOR_EXPRESSIONS}",
            sel.match_expressions.len()
        )));
    }
    if let Some(r) = sel
        .match_expressions
        .iter()
        .find(|r| r.values.len() > MAX_SELECTOR_EXPRESSIONS)
    {
        return Err(ApiError::TooLarge(format!(
            "selector on {:?} lists {} values, over the limit of {MAX_SELECTOR_EXPRESSIONS}",
            r.key,
            r.values.len()
        )));
    }
    let mut match_expressions = Vec::new();
    for r in &sel.match_expressions {
        if !label_key_ok(&r.key) {
            return Err(invalid(format!(
                "selector key {:?} is not a valid label key",
                r.key
            )));
        }
        let op = match r.operator.as_str() {
            "In" | "in" => SelectorOp::In,
            "NotIn" | "notin" => SelectorOp::NotIn,
            "Exists" | "exists" => SelectorOp::Exists,
            "DoesNotExist" | "doesnotexist" => SelectorOp::DoesNotExist,
            other => {
                return Err(invalid(format!(
                    "selector operator {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                )));
            }
        };
        let needs_values = matches!(op, SelectorOp::In | SelectorOp::NotIn);
        if needs_values == r.values.is_empty() {
            return Err(invalid(format!(
                "selector on {:?}: {} takes {}",
                r.key,
                r.operator,
                if needs_values {
                    "at least one value"
                } else {
                    "no values"
                }
            )));
        }
        if let Some(bad) = r.values.iter().find(|v| !label_value_ok(v)) {
            return Err(invalid(format!(
                "selector value {bad:?} is not a valid label value"
            )));
        }
        match_expressions.push(Requirement {
            key: r.key.clone(),
            op,
            values: r.values.clone(),
        });
    }
    Ok(LabelSelector {
        match_labels,
        match_expressions,
    })
}

fn term(term: Option<&tether_proto::AffinityTerm>) -> Result<crate::sm::affinity::AffinityTerm> {
    let term = term.ok_or_else(|| invalid("missing affinity term".to_string()))?;
    if !label_key_ok(&term.topology_key) {
        return Err(invalid(format!(
            "topology key {:?} is not a valid label key (e.g. kubernetes.io/hostname or \
             topology.kubernetes.io/zone)",
            term.topology_key
        )));
    }
    Ok(crate::sm::affinity::AffinityTerm {
        selector: selector(term.label_selector.as_ref())?,
        topology_key: term.topology_key.clone(),
    })
}

fn weighted(
    terms: &[tether_proto::WeightedAffinityTerm],
) -> Result<Vec<crate::sm::affinity::WeightedTerm>> {
    terms
        .iter()
        .map(|w| {
            if !(1..=100).contains(&w.weight) {
                return Err(invalid(format!(
                    "preferred term weight {} is not within 1-100",
                    w.weight
                )));
            }
            Ok(crate::sm::affinity::WeightedTerm {
                weight: w.weight,
                term: term(w.term.as_ref())?,
            })
        })
        .collect()
}

/// Affinity rules.
pub fn affinity(
    affinity: Option<&tether_proto::Affinity>,
) -> Result<crate::sm::affinity::Affinity> {
    let Some(a) = affinity else {
        return Ok(Default::default());
    };
    let terms =
        a.required.len() + a.required_anti.len() + a.preferred.len() + a.preferred_anti.len();
    if terms > MAX_AFFINITY_TERMS {
        return Err(ApiError::TooLarge(format!(
            "{terms} affinity terms is over the limit of {MAX_AFFINITY_TERMS} (required, \
             required-anti and preferred together); merge terms that share a topology key"
        )));
    }
    Ok(crate::sm::affinity::Affinity {
        required: a
            .required
            .iter()
            .map(|t| term(Some(t)))
            .collect::<Result<_>>()?,
        required_anti: a
            .required_anti
            .iter()
            .map(|t| term(Some(t)))
            .collect::<Result<_>>()?,
        preferred: weighted(&a.preferred)?,
        preferred_anti: weighted(&a.preferred_anti)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_kubernetes_rules() {
        assert!(dns1123_label("s", "gpu-bind").is_ok());
        assert!(dns1123_label("s", "GPU").is_err());
        assert!(dns1123_label("s", "-a").is_err());
        assert!(dns1123_label("s", &"a".repeat(64)).is_err());
        assert!(dns1123_subdomain("n", "node-1.zone-a").is_ok());
        assert!(dns1123_subdomain("n", "node..1").is_err());
        assert!(dns1123_subdomain("n", "node_1").is_err());
        assert!(dns1123_subdomain("n", "").is_err());
        assert!(pod_uid("6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f").is_ok());
        assert!(pod_uid("a/b").is_err());
        assert!(pod_uid("").is_err());
    }

    #[test]
    fn payload_limit_is_inclusive() {
        assert!(payload(&[0; 10], 10).is_ok());
        assert!(matches!(payload(&[0; 11], 10), Err(ApiError::TooLarge(_))));
    }
}
