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
