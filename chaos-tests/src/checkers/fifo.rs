//! FIFO among queued waiters. Replaying each lock's events: a waiter joins
//! at the back (`LockQueued` with position = queue length + 1), leaves on
//! `WaitEnded`, and while anyone waits, the next `LockGranted` goes to the
//! head of the queue.
//!
//! Proves: no waiter was overtaken. Does not judge waits whose acquire was
//! never logged (it never queued).

use std::collections::VecDeque;

use super::{Evidence, rev, uid_of};

/// Violations found.
pub fn check(evidence: &Evidence) -> Vec<String> {
    let mut out = Vec::new();
    for (key, events) in &evidence.events {
        let mut queue: VecDeque<String> = VecDeque::new();
        // The holder: granted again while it holds, another attempt of the
        // pod took its hold over (format 9); nobody waiting is overtaken.
        let mut holder: Option<String> = None;
        for event in events {
            let uid = uid_of(event).to_string();
            match event.kind.as_str() {
                "LockReleased" => holder = None,
                "LockGranted" if holder.as_deref() == Some(uid.as_str()) => {}
                "LockQueued" => {
                    let position = event
                        .attributes
                        .get("position")
                        .and_then(|p| p.parse::<usize>().ok());
                    if let Some(position) = position
                        && position != queue.len() + 1
                    {
                        out.push(format!(
                            "{key}: {uid} queued at position {position} behind {} waiters at {}",
                            queue.len(),
                            rev(event)
                        ));
                    }
                    queue.push_back(uid);
                }
                "WaitEnded" => queue.retain(|w| *w != uid),
                "LockGranted" => {
                    if let Some(head) = queue.front()
                        && *head != uid
                    {
                        out.push(format!(
                            "{key}: granted to {uid} at {} ahead of waiter {head}",
                            rev(event)
                        ));
                    }
                    queue.retain(|w| *w != uid);
                    holder = Some(uid);
                }
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkers::testkit::{event, queued};

    const K: &str = "lock/t/a";

    #[test]
    fn overtaking_a_waiter_is_caught_and_leaving_the_queue_is_fine() {
        let log = |second: &str| {
            vec![
                event("LockGranted", K, "h", 1, 1),
                queued(K, "w1", 1, 2),
                queued(K, "w2", 2, 3),
                queued(K, "w3", 3, 4),
                event("WaitEnded", K, "w1", 0, 5),
                event("LockReleased", K, "h", 1, 6),
                event("LockGranted", K, second, 6, 6),
            ]
        };
        let mut evidence = Evidence::default();
        evidence.events.insert(K.into(), log("w2"));
        assert!(check(&evidence).is_empty());
        evidence.events.insert(K.into(), log("w3"));
        assert_eq!(check(&evidence).len(), 1);
    }
}
