//! Mutual exclusion, twice:
//! - **in the log**: replaying a lock's events, a `LockGranted` never comes
//!   while another hold is open, and a `LockReleased` names the open hold;
//! - **as clients saw it**: a hold is certainly valid from the moment its
//!   grant was answered until its release was sent, when that release was
//!   answered "released" (so it was still the holder then). Two such windows
//!   of one lock must not overlap.
//!
//! Proves: no two pods held a lock at once, as far as these clients could
//! tell. Does not prove anything about holds whose release was unknown.

use std::collections::BTreeMap;

use super::{Evidence, rev, uid_of};
use crate::history::{Call, Value};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for (key, events) in &evidence.events {
        let mut open: Option<(String, u64)> = None;
        for event in events {
            match event.kind.as_str() {
                "LockGranted" => {
                    // Another client's acquire of the holding pod takes its
                    // hold over with a higher token (format 9): one hold,
                    // passed from one attempt to the next.
                    let taken_over = open
                        .as_ref()
                        .is_some_and(|(uid, token)| uid == uid_of(event) && event.token > *token);
                    if let Some((uid, token)) = open.as_ref().filter(|_| !taken_over) {
                        out.push(format!(
                            "{key}: granted to {} (token {}) at {} while {uid} held token {token}",
                            uid_of(event),
                            event.token,
                            rev(event)
                        ));
                    }
                    open = Some((uid_of(event).to_string(), event.token));
                }
                "LockReleased" => {
                    if open.as_ref().map(|(u, t)| (u.as_str(), *t))
                        != Some((uid_of(event), event.token))
                    {
                        out.push(format!(
                            "{key}: released {} token {} at {} but the open hold was {open:?}",
                            uid_of(event),
                            event.token,
                            rev(event)
                        ));
                    }
                    open = None;
                }
                _ => {}
            }
        }
    }
    // Client-side windows: (grant answered, release sent) per lock.
    let mut windows: BTreeMap<&str, Vec<(u64, u64, &str, u64)>> = BTreeMap::new();
    let released: Vec<_> = evidence
        .ops
        .iter()
        .filter(|op| op.value() == Some(&Value::Released))
        .collect();
    for op in &evidence.ops {
        let (Call::Acquire { uid, .. }, Some(Value::Granted(token)), Some(granted_at)) =
            (&op.call, op.value(), op.complete_us)
        else {
            continue;
        };
        let release = released.iter().find(|r| {
            r.key == op.key
                && r.call
                    == Call::Release {
                        uid: uid.clone(),
                        token: *token,
                    }
        });
        if let Some(release) = release
            && release.invoke_us > granted_at
        {
            windows
                .entry(&op.key)
                .or_default()
                .push((granted_at, release.invoke_us, uid, *token));
        }
    }
    for (key, mut list) in windows {
        list.sort();
        for pair in list.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.0 < a.1 && a.3 != b.3 {
                out.push(format!(
                    "{key}: clients held it at once: {} (token {}) over {}..{} µs and {} (token {}) from {} µs",
                    a.2, a.3, a.0, a.1, b.2, b.3, b.0
                ));
            }
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
    fn a_grant_over_an_open_hold_is_caught_and_a_clean_log_passes() {
        let mut evidence = Evidence {
            events_complete: true,
            ..Evidence::default()
        };
        evidence.events.insert(
            K.into(),
            vec![
                event("LockGranted", K, "a", 5, 5),
                event("LockReleased", K, "a", 5, 6),
                event("LockGranted", K, "b", 7, 7),
            ],
        );
        assert!(check(&evidence).is_empty());
        evidence
            .events
            .get_mut(K)
            .unwrap()
            .push(event("LockGranted", K, "c", 8, 8));
        assert_eq!(check(&evidence).len(), 1, "{:?}", check(&evidence));
    }

    #[test]
    fn overlapping_client_windows_are_caught() {
        let evidence = Evidence {
            ops: vec![
                granted(0, K, "a", 5, (0, 10)),
                granted(1, K, "b", 7, (5, 20)),
                released(2, K, "a", 5, (30, 40)),
                released(3, K, "b", 7, (50, 60)),
            ],
            ..Evidence::default()
        };
        assert_eq!(check(&evidence).len(), 1, "{:?}", check(&evidence));
    }
}
