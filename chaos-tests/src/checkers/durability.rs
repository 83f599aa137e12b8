//! Nothing acknowledged is lost: after the faults heal and the cluster
//! converges (every crashed replica restarted from its disk), each answered
//! grant, release, revoke and pin assignment is in the event log.
//!
//! Proves: an answer was only sent for a committed, durable entry. Does not
//! say anything of unknown operations (they may or may not be there).

use super::{Evidence, uid_of};
use crate::history::{Call, Value};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    if !evidence.events_complete {
        return out;
    }
    let logged = |key: &str, kind: &str, uid: &str, token: Option<u64>| {
        evidence.events.get(key).is_some_and(|events| {
            events
                .iter()
                .any(|e| e.kind == kind && uid_of(e) == uid && token.is_none_or(|t| t == e.token))
        })
    };
    for op in &evidence.ops {
        let missing = match (&op.call, op.value()) {
            (Call::Acquire { uid, .. }, Some(Value::Granted(token))) => {
                (!logged(&op.key, "LockGranted", uid, Some(*token)))
                    .then(|| format!("grant of token {token} to {uid}"))
            }
            (Call::Release { uid, token }, Some(Value::Released)) => {
                (!logged(&op.key, "LockReleased", uid, Some(*token)))
                    .then(|| format!("release of token {token} by {uid}"))
            }
            (Call::RevokePod { uid }, Some(Value::Revoked(keys))) => keys
                .iter()
                .find(|key| !logged(key, "LockReleased", uid, None))
                .map(|key| format!("revoke of {uid} releasing {key}")),
            (Call::Assign { uid }, Some(Value::Assigned(node))) => {
                // A new pin, or an existing one taken over by this pod (an
                // assignment answered with the pin that stands).
                let found = evidence.events.get(&op.key).is_some_and(|events| {
                    events.iter().any(|e| {
                        e.attributes.get("pod_uid") == Some(uid)
                            && ((e.kind == "PinAssigned" && e.node == *node)
                                || e.kind == "PinOwnerChanged")
                    })
                });
                (!found).then(|| format!("pin assignment to {node} for {uid}"))
            }
            _ => None,
        };
        if let Some(what) = missing {
            out.push(format!(
                "{}: acknowledged {what} (op {}) is not in the log",
                op.key, op.id
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::{event, granted, released};

    const K: &str = "lock/t/a";

    #[test]
    fn an_acknowledged_release_missing_from_the_log_is_caught() {
        let mut evidence = Evidence {
            events_complete: true,
            ops: vec![
                granted(0, K, "a", 5, (0, 10)),
                released(1, K, "a", 5, (20, 30)),
            ],
            ..Evidence::default()
        };
        evidence
            .events
            .insert(K.into(), vec![event("LockGranted", K, "a", 5, 5)]);
        assert_eq!(check(&evidence).len(), 1);
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockReleased", K, "a", 5, 6));
        assert!(check(&evidence).is_empty());
        // A partial log proves nothing either way.
        evidence.events.clear();
        evidence.events_complete = false;
        assert!(check(&evidence).is_empty());
    }
}
