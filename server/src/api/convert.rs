//! Conversions between the state machine's domain types and `tether.v1` wire
//! types, at the API edge.

use tether_proto as pb;

use crate::sm;

/// Domain pod from wire (validated before).
pub fn pod_from(pod: &pb::Pod) -> sm::Pod {
    sm::Pod {
        uid: pod.uid.clone(),
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
    }
}

/// Wire pod.
pub fn pod_to(pod: &sm::Pod) -> pb::Pod {
    pb::Pod {
        uid: pod.uid.clone(),
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
    }
}

/// Wire lock key.
pub fn key_to(key: &sm::LockKey) -> pb::LockKey {
    pb::LockKey {
        scope: key.scope.clone(),
        name: key.name.clone(),
    }
}

/// Wire hold.
pub fn hold_to(hold: &sm::Hold) -> pb::Hold {
    pb::Hold {
        pod: Some(pod_to(&hold.pod)),
        token: hold.token,
        granted_at_ms: hold.granted_at_ms,
        payload: hold.payload.clone(),
        client_id: hold.client_id.clone(),
        lease_id: hold.lease_id,
    }
}

/// Wire lock state.
pub fn lock_to(key: &sm::LockKey, lock: &sm::Lock) -> pb::LockState {
    pb::LockState {
        key: Some(key_to(key)),
        holder: lock.holder.as_ref().map(hold_to),
        waiters: lock
            .waiters
            .iter()
            .map(|w| pb::Waiter {
                pod: Some(pod_to(&w.pod)),
                queued_at_ms: w.queued_at_ms,
                deadline_ms: w.deadline_ms,
                payload: w.payload.clone(),
                client_id: w.client_id.clone(),
                lease_id: w.lease_id,
            })
            .collect(),
        last_token: lock.last_token,
    }
}

/// Domain outcome from wire.
pub fn outcome_from(outcome: i32) -> sm::Outcome {
    match pb::Outcome::try_from(outcome) {
        Ok(pb::Outcome::Allocated) => sm::Outcome::Allocated,
        Ok(pb::Outcome::Failed) => sm::Outcome::Failed,
        _ => sm::Outcome::Unspecified,
    }
}

/// Wire form of a revoke's result.
pub fn granted_to(granted: &[(sm::LockKey, sm::Hold)]) -> Vec<pb::GrantedHold> {
    granted
        .iter()
        .map(|(key, hold)| pb::GrantedHold {
            key: Some(key_to(key)),
            hold: Some(hold_to(hold)),
        })
        .collect()
}

/// Wire pin key.
pub fn key_of_pin(key: &sm::PinKey) -> pb::PinKey {
    pb::PinKey {
        set: key.set.clone(),
        member: key.member.clone(),
    }
}

/// Wire pin.
pub fn pin_to(key: &sm::PinKey, pin: &sm::Pin) -> pb::Pin {
    pb::Pin {
        key: Some(key_of_pin(key)),
        node: pin.node.clone(),
        pinned_at_ms: pin.pinned_at_ms,
        pod_uid: pin.pod_uid.clone(),
        labels: pin
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        lifetime_ms: pin.lifetime_ms,
        last_running_at_ms: pin.last_running_at_ms,
        owner: owner_to(&pin.owner) as i32,
    }
}

/// Wire owner state.
fn owner_to(owner: &sm::OwnerState) -> pb::OwnerState {
    match owner {
        sm::OwnerState::Unknown => pb::OwnerState::OwnerUnknown,
        sm::OwnerState::Starting => pb::OwnerState::OwnerStarting,
        sm::OwnerState::Running => pb::OwnerState::OwnerRunning,
        sm::OwnerState::Stopped => pb::OwnerState::OwnerStopped,
    }
}

/// Wire node.
pub fn node_to(name: &str, node: &sm::NodeInfo) -> pb::Node {
    pb::Node {
        name: name.to_string(),
        uid: node.uid.clone(),
        labels: node
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        ready: node.ready,
        unschedulable: node.unschedulable,
        joined_at_ms: node.joined_at_ms,
        gone_at_ms: node.gone_at_ms.unwrap_or(0),
    }
}

/// Wire revision.
pub fn revision_to(revision: sm::Revision) -> pb::Revision {
    pb::Revision {
        index: revision.index,
        sub: revision.sub,
    }
}

fn lock_event_key(key: &sm::LockKey) -> String {
    format!("lock/{}/{}", key.scope, key.name)
}

fn pin_event_key(key: &sm::PinKey) -> String {
    format!("pin/{}/{}", key.set, key.member)
}

/// Wire event: kind name, key string, and the fields that kind has.
pub fn event_to(event: &sm::Event) -> pb::Event {
    use sm::EventKind as K;
    let mut out = pb::Event {
        revision: Some(revision_to(event.revision)),
        time_ms: event.time_ms,
        ..Default::default()
    };
    let mut attr = |k: &str, v: String| {
        out.attributes.insert(k.to_string(), v);
    };
    let (kind, key, pod, token, reason, node, payload): (
        &str,
        String,
        Option<&sm::Pod>,
        u64,
        String,
        String,
        Vec<u8>,
    ) = match &event.kind {
        K::LockGranted { key, hold } => {
            attr("client_id", hold.client_id.clone());
            (
                "LockGranted",
                lock_event_key(key),
                Some(&hold.pod),
                hold.token,
                String::new(),
                String::new(),
                hold.payload.clone(),
            )
        }
        K::LockQueued { key, pod, position } => {
            attr("position", position.to_string());
            (
                "LockQueued",
                lock_event_key(key),
                Some(pod),
                0,
                String::new(),
                String::new(),
                vec![],
            )
        }
        K::LockReleased {
            key,
            pod,
            token,
            reason,
        } => {
            if let sm::ReleaseReason::Forced { operator, .. } = reason {
                attr("operator", operator.clone());
            }
            (
                "LockReleased",
                lock_event_key(key),
                Some(pod),
                *token,
                reason.to_string(),
                String::new(),
                vec![],
            )
        }
        K::WaitEnded { key, pod, reason } => (
            "WaitEnded",
            lock_event_key(key),
            Some(pod),
            0,
            format!("{reason:?}"),
            String::new(),
            vec![],
        ),
        K::LockStuck {
            key,
            pod,
            token,
            held_ms,
        } => {
            attr("held_ms", held_ms.to_string());
            (
                "LockStuck",
                lock_event_key(key),
                Some(pod),
                *token,
                "pod has not started".into(),
                String::new(),
                vec![],
            )
        }
        K::PodRevoked { pod_uid, reason } => (
            "PodRevoked",
            format!("pod/{pod_uid}"),
            None,
            0,
            reason.clone(),
            String::new(),
            vec![],
        ),
        K::PodReported { pod_uid, phase } => {
            attr("phase", format!("{phase:?}"));
            (
                "PodReported",
                format!("pod/{pod_uid}"),
                None,
                0,
                String::new(),
                String::new(),
                vec![],
            )
        }
        K::LeaseGranted { lease_id, ttl_ms } => {
            attr("ttl_ms", ttl_ms.to_string());
            (
                "LeaseGranted",
                format!("lease/{lease_id}"),
                None,
                0,
                String::new(),
                String::new(),
                vec![],
            )
        }
        K::LeaseEnded { lease_id, expired } => {
            let reason = if *expired { "expired" } else { "revoked" };
            (
                "LeaseEnded",
                format!("lease/{lease_id}"),
                None,
                0,
                reason.into(),
                String::new(),
                vec![],
            )
        }
        K::PinAssigned { key, pin } => {
            attr("pod_uid", pin.pod_uid.clone());
            attr("lifetime_ms", pin.lifetime_ms.to_string());
            // The whole pin as made, so that a watcher keeping a copy of a
            // set (the extender's) need not read the pin back: what its
            // owner is known to be, and each label as `label.<key>`.
            // `owner` is always there: it tells such a watcher that the
            // labels are too (an event from a build before this carries
            // neither).
            attr("owner", owner_to(&pin.owner).as_str_name().to_string());
            for (k, v) in pin.labels.iter() {
                attr(&format!("label.{k}"), v.clone());
            }
            (
                "PinAssigned",
                pin_event_key(key),
                None,
                0,
                String::new(),
                pin.node.clone(),
                vec![],
            )
        }
        K::PinReleased { key, node, reason } => (
            "PinReleased",
            pin_event_key(key),
            None,
            0,
            format!("{reason:?}"),
            node.clone(),
            vec![],
        ),
        K::PinOwnerChanged { key, pod_uid } => {
            attr("pod_uid", pod_uid.clone());
            (
                "PinOwnerChanged",
                pin_event_key(key),
                None,
                0,
                String::new(),
                String::new(),
                vec![],
            )
        }
        K::NodeJoined { node, info } | K::NodeUpdated { node, info } => {
            for (k, v) in &info.labels {
                attr(&format!("label.{k}"), v.clone());
            }
            attr("ready", info.ready.to_string());
            attr("unschedulable", info.unschedulable.to_string());
            // Which node object: a name re-created after a delete joins
            // again under a new UID.
            if !info.uid.is_empty() {
                attr("uid", info.uid.clone());
            }
            let kind = if matches!(event.kind, K::NodeJoined { .. }) {
                "NodeJoined"
            } else {
                "NodeUpdated"
            };
            (
                kind,
                format!("node/{node}"),
                None,
                0,
                String::new(),
                node.clone(),
                vec![],
            )
        }
        K::NodeReady { node } => (
            "NodeReady",
            format!("node/{node}"),
            None,
            0,
            String::new(),
            node.clone(),
            vec![],
        ),
        K::NodeNotReady { node } => (
            "NodeNotReady",
            format!("node/{node}"),
            None,
            0,
            String::new(),
            node.clone(),
            vec![],
        ),
        K::NodeGone { node } => (
            "NodeGone",
            format!("node/{node}"),
            None,
            0,
            String::new(),
            node.clone(),
            vec![],
        ),
        K::AdminAction {
            identity,
            action,
            detail,
        } => {
            attr("identity", identity.clone());
            attr("action", action.clone());
            attr("detail", detail.clone());
            (
                "AdminAction",
                "cluster/admin".to_string(),
                None,
                0,
                String::new(),
                String::new(),
                vec![],
            )
        }
    };
    out.kind = kind.to_string();
    out.key = key;
    out.pod = pod.map(pod_to);
    out.token = token;
    out.reason = reason;
    out.node = node;
    out.payload = payload;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_pin_assigned_event_carries_the_whole_pin() {
        let pin = sm::Pin {
            node: "n1".into(),
            pinned_at_ms: 5,
            pod_uid: "u1".into(),
            labels: BTreeMap::from([("tether.dev/device.gpu-0".to_string(), "true".to_string())])
                .into(),
            lifetime_ms: 1,
            last_running_at_ms: 0,
            owner: sm::OwnerState::Starting,
        };
        let event = event_to(&sm::Event {
            revision: sm::Revision { index: 7, sub: 0 },
            time_ms: 5,
            kind: sm::EventKind::PinAssigned {
                key: sm::PinKey {
                    set: "gpu-devices".into(),
                    member: "u1".into(),
                },
                pin,
            },
        });
        assert_eq!(event.kind, "PinAssigned");
        assert_eq!(event.key, "pin/gpu-devices/u1");
        assert_eq!(event.node, "n1");
        let attr = |k: &str| event.attributes.get(k).map(String::as_str);
        assert_eq!(attr("pod_uid"), Some("u1"));
        assert_eq!(attr("owner"), Some("OWNER_STARTING"));
        assert_eq!(attr("label.tether.dev/device.gpu-0"), Some("true"));
        assert_eq!(attr("lifetime_ms"), Some("1"));
    }
}
