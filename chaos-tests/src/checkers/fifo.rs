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
        for event in events {
            let uid = uid_of(event).to_string();
            match event.kind.as_str() {
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
                }
                _ => {}
            }
        }
    }
    out
}
