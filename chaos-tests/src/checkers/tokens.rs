//! Fencing tokens strictly increase per lock:
//! - in log order: each `LockGranted` of a lock carries a larger token than
//!   the one before;
//! - in real time: when pod A's grant was answered before pod B's acquire
//!   was sent, B's token is larger.
//!
//! - one grant per entry: a `LockReleased` never ends a hold in the entry
//!   that granted it (the token is that entry's index), so no client was
//!   told "granted" for a hold that did not outlive its grant.
//!
//! Proves: a later holder can always fence an earlier one. Does not cover
//! grants whose answer was lost (unknown), beyond what the log shows.

use super::{Evidence, rev, uid_of};
use crate::history::{Call, Value};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for (key, events) in &evidence.events {
        let mut last: Option<(u64, String)> = None;
        for event in events.iter().filter(|e| e.kind == "LockGranted") {
            if let Some((token, _)) = &last
                && event.token <= *token
            {
                out.push(format!(
                    "{key}: token {} granted at {} is not above the previous {token}",
                    event.token,
                    rev(event)
                ));
            }
            last = Some((event.token, uid_of(event).to_string()));
        }
        for event in events.iter().filter(|e| e.kind == "LockReleased") {
            if event.revision.is_some_and(|r| r.index == event.token) {
                out.push(format!(
                    "{key}: the hold of {} with token {} ended at {}, in the entry that granted it",
                    uid_of(event),
                    event.token,
                    rev(event)
                ));
            }
        }
    }
    let grants: Vec<(&str, &str, u64, u64, u64)> = evidence
        .ops
        .iter()
        .filter_map(|op| match (&op.call, op.value(), op.complete_us) {
            (Call::Acquire { uid, .. }, Some(Value::Granted(token)), Some(done)) => {
                Some((op.key.as_str(), uid.as_str(), *token, op.invoke_us, done))
            }
            _ => None,
        })
        .collect();
    for a in &grants {
        for b in &grants {
            if a.0 == b.0 && a.1 != b.1 && a.4 < b.3 && b.2 <= a.2 {
                out.push(format!(
                    "{}: {} got token {} after {} had been answered token {}",
                    a.0, b.1, b.2, a.1, a.2
                ));
            }
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
    fn tokens_going_backwards_in_the_log_or_in_real_time_are_caught() {
        let mut evidence = Evidence::default();
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "a", 5, 5),
                event("LockGranted", K, "b", 7, 7),
            ],
        );
        evidence.ops = vec![
            granted(0, K, "a", 5, (0, 10)),
            granted(1, K, "b", 7, (20, 30)),
        ];
        assert!(check(&evidence).is_empty());
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockGranted", K, "c", 6, 9));
        evidence.ops.push(granted(2, K, "c", 6, (40, 50)));
        // Once in the log, once against b's earlier answer (a's 5 is lower).
        assert_eq!(check(&evidence).len(), 2, "{:?}", check(&evidence));
    }

    #[test]
    fn a_hold_ended_by_the_entry_that_granted_it_is_caught() {
        let mut evidence = Evidence::default();
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "a", 5, 5),
                event("LockReleased", K, "a", 5, 9),
                event("LockGranted", K, "b", 9, 9),
            ],
        );
        assert!(check(&evidence).is_empty(), "{:?}", check(&evidence));
        // The sweep at 9 granted b and, ending b's lease, ended it again.
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockReleased", K, "b", 9, 9));
        let found = check(&evidence);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains("in the entry that granted it"),
            "{found:?}"
        );
    }
}
