//! Hands the applied events that end a queued acquire's wait (its grant, or
//! the end of its wait) to that acquire alone.
//!
//! A queued acquire used to follow the replica's whole event stream (a
//! `broadcast` receiver) and pick out the event naming its lock and pod. Every
//! waiter then woke for every event: with 64 pods queued on one lock, each
//! hand-over woke all 63 waiters several times over, and every acquire,
//! granted at once or not, drained the events applied during its commit when
//! its receiver was dropped. Here a waiter registers its lock and pod UID
//! before proposing and receives only the events naming both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::sm::{Event, EventKind, LockKey};

/// What a registered waiter is told.
#[derive(Debug)]
pub enum WaitSignal {
    /// An applied event naming its lock and pod: `LockGranted` or
    /// `WaitEnded`.
    Event(Box<Event>),
    /// The state changed without events (a snapshot was installed): read the
    /// state to learn where the wait stands.
    Recheck,
}

/// Waiters by lock, then by pod UID (several calls may wait for the same lock
/// and pod, e.g. a retry while the first call still runs).
type Waiters = HashMap<LockKey, HashMap<String, Vec<(u64, mpsc::UnboundedSender<WaitSignal>)>>>;

/// The registry shared by the state machine (which routes) and the lock API
/// (which registers). Cheap to clone.
#[derive(Clone, Default)]
pub struct WaitRegistry {
    inner: Arc<Registry>,
}

#[derive(Default)]
struct Registry {
    waiters: Mutex<Waiters>,
    next_id: AtomicU64,
}

impl WaitRegistry {
    fn waiters(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.inner
            .waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a wait for `key` by `pod_uid`. Register before proposing
    /// the acquire, so its grant cannot be applied before anyone listens.
    /// The registration ends when the ticket is dropped.
    pub fn register(&self, key: &LockKey, pod_uid: &str) -> WaitTicket {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiters()
            .entry(key.clone())
            .or_default()
            .entry(pod_uid.to_string())
            .or_default()
            .push((id, tx));
        WaitTicket {
            registry: self.clone(),
            key: key.clone(),
            pod_uid: pod_uid.to_string(),
            id,
            signals: rx,
        }
    }

    /// Hands each event that names a registered lock and pod to its waiters.
    /// Called by apply with the events of one apply, in order.
    pub fn route(&self, events: &[Event]) {
        let waiters = self.waiters();
        if waiters.is_empty() {
            return;
        }
        for event in events {
            let (key, pod_uid) = match &event.kind {
                EventKind::LockGranted { key, hold } => (key, &hold.pod.uid),
                EventKind::WaitEnded { key, pod, .. } => (key, &pod.uid),
                _ => continue,
            };
            let Some(senders) = waiters.get(key).and_then(|by_pod| by_pod.get(pod_uid)) else {
                continue;
            };
            for (_, tx) in senders {
                // A waiter that went away unregisters when its ticket drops.
                let _ = tx.send(WaitSignal::Event(Box::new(event.clone())));
            }
        }
    }

    /// Tells every waiter to read the state again (after a snapshot install,
    /// which changes the state without events).
    pub fn recheck_all(&self) {
        for by_pod in self.waiters().values() {
            for senders in by_pod.values() {
                for (_, tx) in senders {
                    let _ = tx.send(WaitSignal::Recheck);
                }
            }
        }
    }

    fn unregister(&self, key: &LockKey, pod_uid: &str, id: u64) {
        let mut waiters = self.waiters();
        let Some(by_pod) = waiters.get_mut(key) else {
            return;
        };
        if let Some(senders) = by_pod.get_mut(pod_uid) {
            senders.retain(|(sender_id, _)| *sender_id != id);
            if senders.is_empty() {
                by_pod.remove(pod_uid);
            }
        }
        if by_pod.is_empty() {
            waiters.remove(key);
        }
    }

    /// How many waits are registered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiters()
            .values()
            .flat_map(|by_pod| by_pod.values())
            .map(Vec::len)
            .sum()
    }
}

/// One registered wait: receives its signals until dropped.
pub struct WaitTicket {
    registry: WaitRegistry,
    key: LockKey,
    pod_uid: String,
    id: u64,
    signals: mpsc::UnboundedReceiver<WaitSignal>,
}

impl WaitTicket {
    /// The next signal. Never ends while the ticket is registered (the
    /// registry holds the sender); a caller also watches for shutdown.
    pub async fn recv(&mut self) -> Option<WaitSignal> {
        self.signals.recv().await
    }

    /// A signal already sent, if any (does not wait).
    pub fn try_recv(&mut self) -> Option<WaitSignal> {
        self.signals.try_recv().ok()
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        self.registry.unregister(&self.key, &self.pod_uid, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::{Hold, Pod, Revision, WaitEndReason};

    fn key(name: &str) -> LockKey {
        LockKey::new("gpu-bind", name)
    }

    fn pod(uid: &str) -> Pod {
        Pod {
            uid: uid.into(),
            ..Default::default()
        }
    }

    fn event(index: u64, kind: EventKind) -> Event {
        Event {
            revision: Revision { index, sub: 0 },
            time_ms: 0,
            kind,
        }
    }

    fn granted(lock: &str, uid: &str, token: u64) -> Event {
        event(
            token,
            EventKind::LockGranted {
                key: key(lock),
                hold: Hold {
                    pod: pod(uid),
                    token,
                    granted_at_ms: 0,
                    payload: Vec::new(),
                    client_id: String::new(),
                    lease_id: 0,
                },
            },
        )
    }

    fn next_now(ticket: &mut WaitTicket) -> Option<WaitSignal> {
        ticket.try_recv()
    }

    #[test]
    fn an_event_reaches_only_the_wait_it_names() {
        let registry = WaitRegistry::default();
        let mut a = registry.register(&key("n1"), "uid-a");
        let mut b = registry.register(&key("n1"), "uid-b");
        let mut other_lock = registry.register(&key("n2"), "uid-a");
        registry.route(&[
            granted("n1", "uid-a", 7),
            event(
                8,
                EventKind::WaitEnded {
                    key: key("n1"),
                    pod: pod("uid-b"),
                    reason: WaitEndReason::NodeGone,
                },
            ),
            // Not a wait's end: routed to nobody.
            event(
                9,
                EventKind::LockQueued {
                    key: key("n1"),
                    pod: pod("uid-a"),
                    position: 1,
                },
            ),
        ]);
        match next_now(&mut a) {
            Some(WaitSignal::Event(e)) => assert_eq!(e.revision.index, 7),
            other => panic!("uid-a expected its grant, got {other:?}"),
        }
        assert!(next_now(&mut a).is_none(), "uid-a got a second signal");
        match next_now(&mut b) {
            Some(WaitSignal::Event(e)) => assert_eq!(e.revision.index, 8),
            other => panic!("uid-b expected its wait's end, got {other:?}"),
        }
        assert!(next_now(&mut b).is_none());
        assert!(
            next_now(&mut other_lock).is_none(),
            "a wait on another lock was told"
        );
    }

    #[test]
    fn every_call_waiting_for_the_same_lock_and_pod_is_told_and_dropping_unregisters() {
        let registry = WaitRegistry::default();
        let mut first = registry.register(&key("n1"), "uid-a");
        let mut retry = registry.register(&key("n1"), "uid-a");
        assert_eq!(registry.len(), 2);
        registry.route(&[granted("n1", "uid-a", 3)]);
        assert!(matches!(next_now(&mut first), Some(WaitSignal::Event(_))));
        assert!(matches!(next_now(&mut retry), Some(WaitSignal::Event(_))));
        drop(first);
        assert_eq!(registry.len(), 1);
        registry.route(&[granted("n1", "uid-a", 4)]);
        assert!(
            matches!(next_now(&mut retry), Some(WaitSignal::Event(e)) if e.revision.index == 4)
        );
        drop(retry);
        assert_eq!(registry.len(), 0);
        assert!(registry.waiters().is_empty(), "empty entries are removed");
    }

    #[test]
    fn recheck_reaches_every_wait() {
        let registry = WaitRegistry::default();
        let mut a = registry.register(&key("n1"), "uid-a");
        let mut b = registry.register(&key("n2"), "uid-b");
        registry.recheck_all();
        assert!(matches!(next_now(&mut a), Some(WaitSignal::Recheck)));
        assert!(matches!(next_now(&mut b), Some(WaitSignal::Recheck)));
    }
}
