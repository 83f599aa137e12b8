//! The watcher: follows the run's lock events through every fault.

use super::*;

/// Follows `prefix` from `start` until it has received the event at
/// `until` (set once the run's last event is known) or is stopped; returns
/// what it received and how many times it was told to re-list. Transient
/// errors are retried from the last position, as a user would.
pub async fn watcher(
    client: Client,
    start: pb::Revision,
    prefix: String,
    stop: Arc<AtomicBool>,
    until: Arc<Mutex<Option<(u64, u32)>>>,
) -> (Vec<pb::Event>, u64) {
    let mut received: Vec<pb::Event> = Vec::new();
    let mut relists = 0;
    let mut position = start;
    let reached = |received: &[pb::Event]| {
        let target = *until.lock().unwrap_or_else(|p| p.into_inner());
        target.is_some_and(|t| watcher_passed(received, t))
    };
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut watch) = client.watch(Some(position), vec![], &prefix).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        loop {
            if reached(&received) || stop.load(Ordering::SeqCst) {
                return (received, relists);
            }
            match tokio::time::timeout(Duration::from_millis(200), watch.next()).await {
                Err(_) => {}
                Ok(Ok(WatchUpdate::Events(events))) => received.extend(events),
                Ok(Ok(WatchUpdate::Relist { resume_at, .. })) => {
                    relists += 1;
                    received.push(pb::Event {
                        kind: crate::checkers::watch::RELIST.into(),
                        revision: Some(resume_at),
                        ..Default::default()
                    });
                }
                Ok(Err(_)) => break,
            }
            position = watch.position();
        }
    }
    (received, relists)
}

/// Whether a watcher that received `received` is past revision `target`:
/// it received that event or a later one, or it was told to re-list and
/// continue beyond it (its position was compacted away on the replica it
/// resumed on).
pub fn watcher_passed(received: &[pb::Event], target: (u64, u32)) -> bool {
    let Some(last) = received.last() else {
        return false;
    };
    let Some(revision) = last.revision.map(|r| (r.index, r.sub)) else {
        return false;
    };
    if last.kind == crate::checkers::watch::RELIST {
        revision > target
    } else {
        revision >= target
    }
}

/// What the watcher received, as of the log index `cutoff` the run is
/// judged at. A re-list marker stays whatever its resume point: it says
/// the watcher was told of a gap, and one resuming past the cutoff (a
/// replica that compacted away the watcher's position while leases ran
/// out after convergence) is how the watcher passed the last event it
/// waited for; dropping it made a watcher that had passed look stuck.
pub fn watched_as_of(received: Vec<pb::Event>, cutoff: u64) -> Vec<pb::Event> {
    received
        .into_iter()
        .filter(|e| {
            e.kind == crate::checkers::watch::RELIST || e.revision.is_none_or(|r| r.index <= cutoff)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, index: u64) -> pb::Event {
        pb::Event {
            kind: kind.into(),
            revision: Some(pb::Revision { index, sub: 0 }),
            ..Default::default()
        }
    }

    #[test]
    fn a_relist_past_the_cutoff_still_counts_as_passing_the_last_event() {
        let received = vec![
            event("LockGranted", 10),
            event(crate::checkers::watch::RELIST, 40),
        ];
        let kept = watched_as_of(received, 30);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(watcher_passed(&kept, (25, 0)));
    }

    #[test]
    fn events_past_the_cutoff_are_dropped() {
        let received = vec![event("LockGranted", 10), event("LockReleased", 40)];
        let kept = watched_as_of(received, 30);
        assert_eq!(kept.len(), 1);
        assert!(watcher_passed(&kept, (10, 0)));
        assert!(!watcher_passed(&kept, (25, 0)));
    }
}
