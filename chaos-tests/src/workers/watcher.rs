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
