//! Late interest: a pod can be deleted before Tether hears of it — the
//! scheduler's bind (an acquire) lands after the pod's deletion event has
//! passed the bridge, which then had no reason to report it. Without more,
//! the hold would wait for the next resync. So the bridge remembers the
//! UIDs of recently deleted pods, and when a UID becomes interesting it
//! checks them (and the pod cache) at once.
//!
//! Only what the bridge has seen counts: a UID it has never seen may be a
//! pod created a moment ago that its watch has not delivered yet, and
//! revoking that would break a healthy bind.

use std::collections::{HashSet, VecDeque};

use crate::mapping::pod_now;
use crate::model::{Command, PodReport, PodView};

/// UIDs of pods seen deleted, the most recent `capacity` of them.
#[derive(Debug, Clone)]
pub struct Tombstones {
    order: VecDeque<String>,
    set: HashSet<String>,
    capacity: usize,
}

impl Tombstones {
    /// Remembers up to `capacity` deleted UIDs (oldest forgotten first).
    pub fn new(capacity: usize) -> Self {
        Self {
            order: VecDeque::new(),
            set: HashSet::new(),
            capacity: capacity.max(1),
        }
    }

    /// `uid`'s pod was deleted.
    pub fn record(&mut self, uid: &str) {
        if !self.set.insert(uid.to_string()) {
            return;
        }
        self.order.push_back(uid.to_string());
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }

    /// Whether `uid`'s pod is known deleted.
    pub fn contains(&self, uid: &str) -> bool {
        self.set.contains(uid)
    }

    /// How many are remembered.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// What Tether must hear when `uid` has just become interesting: gone if
/// its pod was seen deleted, else the cached pod's state (`Starting` for a
/// bound pod that has not started, so its hold outlives the hold timeout);
/// nothing when the pod is unknown (maybe created a moment ago) or not
/// bound yet.
pub fn late_interest(
    uid: &str,
    cached: Option<&PodView>,
    tombstones: &Tombstones,
) -> Option<Command> {
    match cached {
        Some(pod) => pod_now(pod),
        None if tombstones.contains(uid) => Some(Command::Pod {
            uid: uid.to_string(),
            report: PodReport::Gone,
        }),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Phase;

    fn pod(uid: &str, phase: Phase) -> PodView {
        PodView {
            uid: uid.into(),
            namespace: "ns".into(),
            name: "p".into(),
            phase,
            deleting: false,
            started: false,
            bound: false,
        }
    }

    #[test]
    fn a_bind_after_the_deletion_is_reported_gone() {
        let mut tombstones = Tombstones::new(10);
        tombstones.record("u1");
        assert_eq!(
            late_interest("u1", None, &tombstones),
            Some(Command::Pod {
                uid: "u1".into(),
                report: PodReport::Gone
            })
        );
    }

    #[test]
    fn a_newly_interesting_pod_is_reported_as_it_is_and_unknown_ones_are_left() {
        let tombstones = Tombstones::new(10);
        let failed = pod("u2", Phase::Failed);
        assert_eq!(
            late_interest("u2", Some(&failed), &tombstones),
            Some(Command::Pod {
                uid: "u2".into(),
                report: PodReport::Terminal
            })
        );
        // Bound by the scheduler before the bridge heard of the hold.
        let bound = PodView {
            bound: true,
            ..pod("u3", Phase::Pending)
        };
        assert_eq!(
            late_interest("u3", Some(&bound), &tombstones),
            Some(Command::Pod {
                uid: "u3".into(),
                report: PodReport::Starting
            })
        );
        // Not bound yet: the bind's own event will say Starting.
        let unbound = pod("u4", Phase::Pending);
        assert_eq!(late_interest("u4", Some(&unbound), &tombstones), None);
        // Never seen: maybe created a moment ago; not ours to revoke.
        assert_eq!(late_interest("u5", None, &tombstones), None);
    }

    #[test]
    fn a_uid_recreated_after_deletion_is_not_revoked_while_cached_alive() {
        // Pod UIDs are unique, but the cache wins over the tombstone anyway.
        let mut tombstones = Tombstones::new(10);
        tombstones.record("u5");
        let alive = pod("u5", Phase::Pending);
        assert_eq!(late_interest("u5", Some(&alive), &tombstones), None);
    }

    #[test]
    fn the_oldest_tombstones_are_forgotten_past_capacity() {
        let mut tombstones = Tombstones::new(2);
        for uid in ["a", "b", "b", "c"] {
            tombstones.record(uid);
        }
        assert_eq!(tombstones.len(), 2);
        assert!(!tombstones.contains("a"));
        assert!(tombstones.contains("b") && tombstones.contains("c"));
    }
}
