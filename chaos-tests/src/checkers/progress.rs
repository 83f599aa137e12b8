//! Progress, the other half of safety: a lock whose holder is gone reaches
//! its next live waiter, within a bound, once the faults have healed.
//!
//! Two properties:
//! - **No waiter behind a free lock**, from the event log: at the end of
//!   every entry, a lock with queued waiters has a holder. (A release, an
//!   expiry, a revoke or a give-up that frees a lock grants its next waiter
//!   in the same entry.)
//! - **Recoveries within [`BOUND`]**: each [`Recovery`] the workload
//!   recorded (a lock that had to move on to a waiter: today, a grant that
//!   raced an abandoned wait) reached that waiter within the bound, unless
//!   a fault was in force during the bound (then the time is reported but
//!   not judged: the property holds after the faults heal).
//!
//! The bound is what the rules allow plus a margin for a loaded machine:
//! the lock-delay (the longest timeout a new leader waits out before it
//! ends anything: the chaos clusters' lease TTL), the abandoned-wait grace,
//! and [`MARGIN`].

use std::collections::BTreeMap;
use std::time::Duration;

use super::{Evidence, rev, uid_of};
use crate::abandon::ABANDONED_WAIT_GRACE;
use crate::history::Recovery;

/// Slack for a loaded 2-core machine: elections, fsyncs, scheduling.
pub const MARGIN: Duration = Duration::from_secs(3);

/// The chaos clusters' lock-delay: their shortest lease TTL, 3 x the
/// election timeout upper bound (2 x 300 ms).
pub const LOCK_DELAY: Duration = Duration::from_millis(1800);

/// How long a lock may take to reach its next waiter once it is due.
pub const BOUND: Duration = Duration::from_millis(
    LOCK_DELAY.as_millis() as u64
        + ABANDONED_WAIT_GRACE.as_millis() as u64
        + MARGIN.as_millis() as u64,
);

/// What the checker found: violations.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    if evidence.events_complete {
        for (key, events) in &evidence.events {
            if key.starts_with("lock/") {
                out.extend(waiters_behind_a_free_lock(key, events));
            }
        }
    }
    let bound_us = BOUND.as_micros() as u64;
    for recovery in &evidence.recoveries {
        if fault_during(
            &evidence.fault_windows,
            recovery.due_us,
            recovery.due_us + bound_us,
        ) {
            continue;
        }
        match recovery.granted_us {
            Some(at) if at.saturating_sub(recovery.due_us) <= bound_us => {}
            Some(at) => out.push(format!(
                "{} ({}): the next waiter was granted {} ms after the lock was due to move on, \
                 over the bound of {} ms, with no fault in force",
                recovery.key,
                recovery.cause,
                at.saturating_sub(recovery.due_us) / 1000,
                BOUND.as_millis()
            )),
            None => out.push(format!(
                "{} ({}): the next waiter was never granted (its wait ended first) although no \
                 fault was in force within {} ms of the lock being due to move on",
                recovery.key,
                recovery.cause,
                BOUND.as_millis()
            )),
        }
    }
    out
}

/// Times to recover (due to granted), for the summary; recoveries that
/// never came are left out (they are violations, or happened under faults).
pub fn recovery_times(recoveries: &[Recovery]) -> Vec<Duration> {
    recoveries
        .iter()
        .filter_map(|r| {
            r.granted_us
                .map(|at| Duration::from_micros(at.saturating_sub(r.due_us)))
        })
        .collect()
}

/// Whether a fault was in force at any time in `from..=to` (µs).
fn fault_during(windows: &[(u64, Option<u64>)], from: u64, to: u64) -> bool {
    windows
        .iter()
        .any(|(began, healed)| *began <= to && healed.is_none_or(|h| h >= from))
}

/// Entries after which `key` had queued waiters and no holder.
fn waiters_behind_a_free_lock(key: &str, events: &[tether_client::proto::Event]) -> Vec<String> {
    let mut out = Vec::new();
    let mut holder: Option<String> = None;
    let mut queue: Vec<String> = Vec::new();
    let mut by_entry: BTreeMap<u64, Vec<&tether_client::proto::Event>> = BTreeMap::new();
    for event in events {
        let index = event.revision.map_or(0, |r| r.index);
        by_entry.entry(index).or_default().push(event);
    }
    for (index, entry) in by_entry {
        for event in &entry {
            let uid = uid_of(event).to_string();
            match event.kind.as_str() {
                "LockGranted" => {
                    queue.retain(|u| *u != uid);
                    holder = Some(uid);
                }
                "LockQueued" => queue.push(uid),
                "WaitEnded" => queue.retain(|u| *u != uid),
                "LockReleased" => holder = None,
                _ => {}
            }
        }
        if holder.is_none() && !queue.is_empty() {
            let last = entry.last().map(|e| rev(e)).unwrap_or_default();
            out.push(format!(
                "{key}: after entry {index} (last event {last}) {queue:?} waited behind a free lock"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_client::proto as pb;

    fn event(index: u64, kind: &str, uid: &str) -> pb::Event {
        pb::Event {
            revision: Some(pb::Revision { index, sub: 0 }),
            kind: kind.into(),
            key: "lock/chaos/l".into(),
            pod: Some(pb::Pod {
                uid: uid.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn evidence(events: Vec<pb::Event>) -> Evidence {
        Evidence {
            events: BTreeMap::from([("lock/chaos/l".to_string(), events)]),
            events_complete: true,
            ..Evidence::default()
        }
    }

    #[test]
    fn a_release_that_hands_over_in_its_entry_is_progress() {
        let log = vec![
            event(1, "LockGranted", "a"),
            event(2, "LockQueued", "b"),
            event(3, "LockReleased", "a"),
            event(3, "LockGranted", "b"),
            event(4, "LockQueued", "c"),
            event(5, "WaitEnded", "c"),
            event(6, "LockReleased", "b"),
        ];
        assert_eq!(check(&evidence(log)), Vec::<String>::new());
    }

    #[test]
    fn a_waiter_left_behind_a_free_lock_is_reported() {
        let log = vec![
            event(1, "LockGranted", "a"),
            event(2, "LockQueued", "b"),
            event(3, "LockReleased", "a"),
            // Granted only by a later entry.
            event(4, "LockGranted", "b"),
        ];
        let found = check(&evidence(log));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("after entry 3"), "{found:?}");
    }

    fn recovery(due_ms: u64, granted_ms: Option<u64>) -> Recovery {
        Recovery {
            key: "lock/chaos/a".into(),
            cause: "a grant raced an abandoned wait",
            due_us: due_ms * 1000,
            granted_us: granted_ms.map(|ms| ms * 1000),
        }
    }

    #[test]
    fn recoveries_are_judged_against_the_bound_outside_faults_only() {
        let bound = BOUND.as_millis() as u64;
        let mut evidence = Evidence {
            recoveries: vec![
                recovery(1_000, Some(1_450)),
                recovery(10_000, Some(10_000 + bound + 1)),
                recovery(30_000, None),
                // Under a fault: not judged.
                recovery(50_000, None),
            ],
            fault_windows: vec![(49_000_000, Some(51_000_000))],
            ..Evidence::default()
        };
        let found = check(&evidence);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("over the bound"), "{found:?}");
        assert!(found[1].contains("never granted"), "{found:?}");
        assert_eq!(
            recovery_times(&evidence.recoveries),
            [
                Duration::from_millis(450),
                Duration::from_millis(bound + 1 + 10_000 - 10_000)
            ]
        );
        // A fault still in force at the end covers everything after it.
        evidence.fault_windows = vec![(0, None)];
        assert!(check(&evidence).is_empty());
    }
}
