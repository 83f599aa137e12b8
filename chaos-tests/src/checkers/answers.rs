//! Each command applies once, and each answer is its own:
//! - in the log, a pod is granted a lock at most once (every pod of the
//!   chaos workload asks for each lock once; its retries, duplicates and
//!   late copies must be answered, never applied again), apart from a
//!   grant while it holds: another client's attempt taking its hold over;
//! - a client told "granted, token T" holds the log's grant T of that lock,
//!   not another pod's (the answer to another command under the same
//!   request id).
//!
//! Proves: the session table deduplicates retries across reconnects,
//! leader changes and forged ids, in the runs' histories. Does not judge
//! grants whose answer was lost (unknown) or that are missing from the log
//! (`durability` reports those).

use std::collections::BTreeMap;

use super::{Evidence, rev, uid_of};
use crate::history::{Call, Value};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    if !evidence.events_complete {
        return out;
    }
    // Per lock: token -> pod granted it.
    let mut granted: BTreeMap<&str, BTreeMap<u64, &str>> = BTreeMap::new();
    for (key, events) in &evidence.events {
        let mut first: BTreeMap<&str, &tether_client::proto::Event> = BTreeMap::new();
        // The pod holding the lock: granted again while it holds, it was
        // taken over by another attempt (format 9), not applied twice.
        let mut holding: Option<&str> = None;
        for event in events {
            if event.kind == "LockReleased" {
                holding = None;
                continue;
            }
            if event.kind != "LockGranted" {
                continue;
            }
            let uid = uid_of(event);
            let taken_over = holding == Some(uid);
            holding = Some(uid);
            if taken_over {
                granted
                    .entry(key.as_str())
                    .or_default()
                    .insert(event.token, uid);
                continue;
            }
            granted
                .entry(key.as_str())
                .or_default()
                .insert(event.token, uid);
            if let Some(earlier) = first.insert(uid, event) {
                out.push(format!(
                    "{key}: {uid} granted at {} (token {}) and again at {} (token {}): a request applied twice",
                    rev(earlier),
                    earlier.token,
                    rev(event),
                    event.token
                ));
                first.insert(uid, earlier);
            }
        }
    }
    for op in &evidence.ops {
        let (Call::Acquire { uid, .. }, Some(Value::Granted(token))) = (&op.call, op.value())
        else {
            continue;
        };
        if let Some(other) = granted
            .get(op.key.as_str())
            .and_then(|tokens| tokens.get(token))
            .filter(|other| **other != uid.as_str())
        {
            out.push(format!(
                "{}: {uid} was answered token {token} (op {}), which the log grants to {other}: the answer to another command",
                op.key, op.id
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::{event, granted};

    const K: &str = "lock/t/a";

    #[test]
    fn a_request_applied_twice_is_caught() {
        let mut evidence = Evidence {
            events_complete: true,
            ..Evidence::default()
        };
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "a", 5, 5),
                event("LockReleased", K, "a", 5, 7),
                event("LockGranted", K, "b", 8, 8),
                event("LockReleased", K, "b", 8, 9),
            ],
        );
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // A late copy of a's acquire, applied as new.
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockGranted", K, "a", 12, 12));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("applied twice"), "{found:?}");
    }

    #[test]
    fn the_answer_to_another_command_is_caught() {
        let mut evidence = Evidence {
            events_complete: true,
            ops: vec![granted(0, K, "a", 5, (0, 10))],
            ..Evidence::default()
        };
        evidence
            .events
            .insert(K.into(), vec![event("LockGranted", K, "a", 5, 5)]);
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // The forger, under a's request id, told a's grant.
        evidence.ops.push(granted(1, K, "forger", 5, (20, 30)));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("another command"), "{found:?}");
    }
}
