//! Input validation at the API edge: bad input is refused before it reaches
//! the log, so it changes nothing.

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

/// A pod UID: 1-64 ASCII letters, digits or '-' (Kubernetes UIDs are UUIDs).
pub fn pod_uid(value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
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

/// A request id, if present: client id 1-128 printable ASCII, sequence > 0.
pub fn request_id(id: Option<&tether_proto::RequestId>) -> Result<Option<crate::sm::RequestId>> {
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
    Ok(Some(crate::sm::RequestId {
        client_id: id.client_id.clone(),
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
