//! The pod UIDs Tether cares about: holders and waiters of locks, owners of
//! pins. Built from Tether's state, kept current from its event stream, so
//! the bridge sends nothing for the other pods of a large cluster.

use std::collections::{BTreeMap, BTreeSet};

use tether_client::proto as pb;

/// The set of interesting pod UIDs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interest {
    uids: BTreeSet<String>,
    /// Namespace and name of the interesting pods Tether names (holders,
    /// waiters, and owners of pins labelled with them; other pins name only
    /// their owner's UID), for the GET that confirms a pod gone.
    names: BTreeMap<String, (String, String)>,
    /// UIDs learned from events, by the log index of their event, kept until
    /// a state read at or past that index includes them: a rebuild from a
    /// replica that had not applied them yet must not drop them.
    recent: BTreeMap<u64, Vec<String>>,
}

impl Interest {
    /// From a full read of Tether's locks and pins.
    pub fn from_state(locks: &[pb::LockState], pins: &[pb::Pin]) -> Interest {
        let mut interest = Interest::default();
        for lock in locks {
            let holder = lock.holder.as_ref().and_then(|h| h.pod.as_ref());
            let waiters = lock.waiters.iter().filter_map(|w| w.pod.as_ref());
            for pod in holder.into_iter().chain(waiters) {
                interest.add_pod(pod);
            }
        }
        for pin in pins.iter().filter(|p| !p.pod_uid.is_empty()) {
            interest.uids.insert(pin.pod_uid.clone());
            if let (Some(namespace), Some(name)) = (
                pin.labels.get(pb::POD_NAMESPACE_LABEL),
                pin.labels.get(pb::POD_NAME_LABEL),
            ) {
                interest
                    .names
                    .entry(pin.pod_uid.clone())
                    .or_insert_with(|| (namespace.clone(), name.clone()));
            }
        }
        interest
    }

    fn add_pod(&mut self, pod: &pb::Pod) {
        if !pod.name.is_empty() {
            self.names
                .insert(pod.uid.clone(), (pod.namespace.clone(), pod.name.clone()));
        }
        self.uids.insert(pod.uid.clone());
    }

    /// Namespace and name of an interesting pod, if Tether named them.
    pub fn name_of(&self, uid: &str) -> Option<&(String, String)> {
        self.names.get(uid)
    }

    /// Replaces the set with a state read made at log index `applied`,
    /// keeping what events after that index added.
    pub fn rebuild(&mut self, locks: &[pb::LockState], pins: &[pb::Pin], applied: u64) {
        let mut fresh = Interest::from_state(locks, pins);
        self.recent = self.recent.split_off(&(applied + 1));
        for uids in self.recent.values() {
            fresh.uids.extend(uids.iter().cloned());
        }
        // Names learned from events stay while their UID does.
        for (uid, name) in std::mem::take(&mut self.names) {
            if fresh.uids.contains(&uid) {
                fresh.names.entry(uid).or_insert(name);
            }
        }
        self.uids = fresh.uids;
        self.names = fresh.names;
    }

    /// Whether Tether cares about this pod.
    pub fn contains(&self, uid: &str) -> bool {
        self.uids.contains(uid)
    }

    /// The UIDs.
    pub fn uids(&self) -> &BTreeSet<String> {
        &self.uids
    }

    /// Follows one Tether event. Grants, queued waits and pin owners add a
    /// UID. Removal happens only by rebuilding from state: a pod stays
    /// interesting while anything might still refer to it, and a stale extra
    /// UID costs at most one idempotent report. Returns the UID when it was
    /// not interesting before.
    pub fn apply(&mut self, event: &pb::Event) -> Option<String> {
        let uid = match event.kind.as_str() {
            "LockGranted" | "LockQueued" => {
                let pod = event.pod.as_ref()?;
                if !pod.name.is_empty() {
                    self.names
                        .insert(pod.uid.clone(), (pod.namespace.clone(), pod.name.clone()));
                }
                Some(pod.uid.clone())
            }
            "PinAssigned" | "PinOwnerChanged" => event
                .attributes
                .get("pod_uid")
                .filter(|u| !u.is_empty())
                .cloned(),
            _ => None,
        };
        let uid = uid?;
        let index = event.revision.map_or(0, |r| r.index);
        self.recent.entry(index).or_default().push(uid.clone());
        self.uids.insert(uid.clone()).then_some(uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> Option<pb::Pod> {
        Some(pb::Pod {
            uid: uid.into(),
            namespace: "ml".into(),
            name: format!("pod-{uid}"),
        })
    }

    #[test]
    fn holders_waiters_and_pin_owners_are_interesting() {
        let lock = pb::LockState {
            holder: Some(pb::Hold {
                pod: pod("h"),
                ..Default::default()
            }),
            waiters: vec![pb::Waiter {
                pod: pod("w"),
                ..Default::default()
            }],
            ..Default::default()
        };
        let pin = pb::Pin {
            pod_uid: "p".into(),
            ..Default::default()
        };
        let named_pin = pb::Pin {
            pod_uid: "claim".into(),
            labels: [
                (pb::POD_NAMESPACE_LABEL.to_string(), "ml".to_string()),
                (pb::POD_NAME_LABEL.to_string(), "train-0".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let mut interest = Interest::from_state(&[lock], &[pin, named_pin]);
        assert!(interest.contains("h") && interest.contains("w") && interest.contains("p"));
        assert_eq!(
            interest.name_of("claim"),
            Some(&("ml".to_string(), "train-0".to_string())),
            "a pin labelled with its owner names it"
        );
        assert_eq!(
            interest.name_of("h"),
            Some(&("ml".to_string(), "pod-h".to_string()))
        );
        assert_eq!(
            interest.name_of("p"),
            None,
            "an unlabelled pin names only its owner's UID"
        );
        assert!(!interest.contains("bystander"));
        let event = pb::Event {
            kind: "LockQueued".into(),
            pod: pod("late"),
            ..Default::default()
        };
        interest.apply(&event);
        assert!(interest.contains("late"));
        let mut pinned = pb::Event {
            kind: "PinAssigned".into(),
            ..Default::default()
        };
        pinned
            .attributes
            .insert("pod_uid".into(), "slurmd-3".into());
        interest.apply(&pinned);
        assert!(interest.contains("slurmd-3"));
    }

    #[test]
    fn a_rebuild_from_an_older_read_keeps_what_newer_events_added() {
        let mut interest = Interest::default();
        let event = pb::Event {
            kind: "LockGranted".into(),
            pod: pod("new"),
            revision: Some(pb::Revision { index: 10, sub: 0 }),
            ..Default::default()
        };
        interest.apply(&event);
        // A replica that had applied only up to 9 knows nothing of it.
        interest.rebuild(&[], &[], 9);
        assert!(interest.contains("new"));
        // A read at 10 or later includes it if it still matters.
        interest.rebuild(&[], &[], 10);
        assert!(!interest.contains("new"), "no longer held: dropped");
    }
}
