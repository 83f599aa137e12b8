//! What lockctl prints: JSON values of the API's messages, YAML, and the
//! tables people read (`-o table`, the default).

use super::*;

pub(crate) struct Out {
    pub(crate) format: Format,
}

impl Out {
    /// Prints `value` as JSON, or `table` for people.
    pub(crate) fn print(&self, value: Value, table: impl FnOnce() -> String) {
        let text = match self.format {
            Format::Json => serde_json::to_string_pretty(&value).unwrap_or_default(),
            Format::Yaml => to_yaml(&value),
            Format::Table => table(),
        };
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", text.trim_end());
    }
}

pub(crate) fn payload_json(payload: &[u8]) -> Value {
    match std::str::from_utf8(payload) {
        Ok(text) => Value::String(text.to_string()),
        Err(_) => Value::String(
            payload
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
        ),
    }
}

pub(crate) fn pod_json(pod: &Option<pb::Pod>) -> Value {
    let pod = pod.clone().unwrap_or_default();
    json!({"uid": pod.uid, "namespace": pod.namespace, "name": pod.name})
}

pub(crate) fn hold_json(hold: &pb::Hold) -> Value {
    json!({
        "pod": pod_json(&hold.pod),
        "token": hold.token,
        "granted_at_ms": hold.granted_at_ms,
        "payload": payload_json(&hold.payload),
        "client_id": hold.client_id,
        "lease_id": hold.lease_id,
    })
}

pub(crate) fn lock_json(lock: &pb::LockState) -> Value {
    let key = lock.key.clone().unwrap_or_default();
    json!({
        "lock": format!("{}/{}", key.scope, key.name),
        "holder": lock.holder.as_ref().map(hold_json),
        "waiters": lock.waiters.iter().map(|w| json!({
            "pod": pod_json(&w.pod), "queued_at_ms": w.queued_at_ms, "deadline_ms": w.deadline_ms,
        })).collect::<Vec<_>>(),
    })
}

pub(crate) fn pod_label(pod: &Option<pb::Pod>) -> String {
    match pod {
        Some(p) if !p.namespace.is_empty() || !p.name.is_empty() => {
            format!("{}/{} ({})", p.namespace, p.name, p.uid)
        }
        Some(p) => p.uid.clone(),
        None => "-".into(),
    }
}

/// `value` as a YAML document, by the YAML crate the workspace shares
/// (serde-saphyr, which kube already brings).
pub(crate) fn to_yaml(value: &Value) -> String {
    serde_saphyr::to_string(value).unwrap_or_else(|err| format!("# cannot render as YAML: {err}\n"))
}

pub(crate) fn pin_json(pin: &pb::Pin) -> Value {
    let key = pin.key.clone().unwrap_or_default();
    let owner = pb::OwnerState::try_from(pin.owner)
        .map(|o| o.as_str_name())
        .unwrap_or("OWNER_UNKNOWN");
    json!({
        "pin": format!("{}/{}", key.set, key.member), "node": pin.node, "pod_uid": pin.pod_uid,
        "pinned_at_ms": pin.pinned_at_ms, "lifetime_ms": pin.lifetime_ms,
        "last_running_at_ms": pin.last_running_at_ms, "owner": owner, "labels": pin.labels,
    })
}

pub(crate) fn pin_table(pins: &[pb::Pin]) -> String {
    let mut text = format!(
        "{:<36} {:<28} {:<38} {:>10} {}\n",
        "PIN", "NODE", "POD", "LIFETIME", "OWNER"
    );
    for pin in pins {
        let key = pin.key.clone().unwrap_or_default();
        let lifetime = if pin.lifetime_ms == 0 {
            "permanent".to_string()
        } else {
            humantime::format_duration(Duration::from_millis(pin.lifetime_ms)).to_string()
        };
        let owner = pb::OwnerState::try_from(pin.owner)
            .map(|o| o.as_str_name())
            .unwrap_or("OWNER_UNKNOWN");
        text.push_str(&format!(
            "{:<36} {:<28} {:<38} {:>10} {}\n",
            format!("{}/{}", key.set, key.member),
            pin.node,
            if pin.pod_uid.is_empty() {
                "-"
            } else {
                &pin.pod_uid
            },
            lifetime,
            owner.trim_start_matches("OWNER_").to_lowercase()
        ));
    }
    text
}

pub(crate) fn event_json(event: &pb::Event) -> Value {
    let rev = event.revision.unwrap_or_default();
    json!({
        "revision": format!("{}.{}", rev.index, rev.sub), "time_ms": event.time_ms, "kind": event.kind,
        "key": event.key, "pod": event.pod.as_ref().map(|p| pod_json(&Some(p.clone()))), "token": event.token,
        "reason": event.reason, "node": event.node, "attributes": event.attributes,
    })
}

pub(crate) fn event_line(event: &pb::Event) -> String {
    let rev = event.revision.unwrap_or_default();
    let mut line = format!("{}.{} {} {}", rev.index, rev.sub, event.kind, event.key);
    if event.pod.is_some() {
        line.push_str(&format!(" pod={}", pod_label(&event.pod)));
    }
    if event.token > 0 {
        line.push_str(&format!(" token={}", event.token));
    }
    if !event.node.is_empty() && !event.key.starts_with("node/") {
        line.push_str(&format!(" node={}", event.node));
    }
    if !event.reason.is_empty() {
        line.push_str(&format!(" reason=\"{}\"", event.reason));
    }
    let mut attributes: Vec<_> = event.attributes.iter().collect();
    attributes.sort();
    for (k, v) in attributes {
        line.push_str(&format!(" {k}={v}"));
    }
    line
}

pub(crate) fn lock_table(locks: &[pb::LockState]) -> String {
    let mut text = format!(
        "{:<32} {:<48} {:>8} {:>7}\n",
        "LOCK", "HOLDER", "TOKEN", "WAITERS"
    );
    for lock in locks {
        let key = lock.key.clone().unwrap_or_default();
        let (holder, token) = match &lock.holder {
            Some(h) => (pod_label(&h.pod), h.token.to_string()),
            None => ("-".to_string(), "-".to_string()),
        };
        text.push_str(&format!(
            "{:<32} {:<48} {:>8} {:>7}\n",
            format!("{}/{}", key.scope, key.name),
            holder,
            token,
            lock.waiters.len()
        ));
        for (i, w) in lock.waiters.iter().enumerate() {
            text.push_str(&format!("  {}. {}\n", i + 1, pod_label(&w.pod)));
        }
    }
    text
}
