//! The pins of the replicated state, with three indexes: by node, by
//! owning pod, and the pins whose lifetime runs (owner stopped, lifetime
//! set) by the committed time they fall due.
//!
//! Why: without them, a claim's placement (`affinity::choose`), a pod's
//! report (`Txn::set_pin_owner_state`), a correction (`Reclaim`), a node's
//! departure and a `ListPins` of one node each looked at every pin in the
//! cluster. At 1,000 GPU nodes (8,000 claims) that made each bind's cost
//! grow with the cluster (`tether-bind-bench`, 2026-12-05: the leader's
//! replica CPU per pod 3.8 ms at 200 nodes, 12.5 ms at 1,000, with
//! `affinity::occupied`, `set_pin_owner_state` and string comparisons on
//! top of its profile). The third lets a sweep look at the pins that can be
//! due rather than at all of them ([`crate::sm::sweep_index`] says why).
//!
//! The indexes are derived: they are not serialized (a snapshot and the
//! store hold the map alone, as before), they are rebuilt whenever a table
//! is built from a map, and every change goes through [`PinTable::insert`],
//! [`PinTable::remove`] or [`PinTable::modify`], which keep them in step.
//! Equality is the map's. Iterating an index gives the keys in key order,
//! as filtering the whole map did, so what a command decides and emits is
//! the same as before, entry for entry.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::types::{OwnerState, Pin, PinKey};

/// Pins by key, indexed by node and by owning pod.
#[derive(Clone, Default)]
pub struct PinTable {
    by_key: BTreeMap<PinKey, Pin>,
    /// Node -> the keys of its pins.
    by_node: BTreeMap<String, BTreeSet<PinKey>>,
    /// Owning pod uid -> the keys of its pins ("" for pins with none).
    by_pod: BTreeMap<String, BTreeSet<PinKey>>,
    /// (due time, key) of each pin whose lifetime runs: its owner stopped
    /// and its lifetime not 0 (permanent). See [`expiry`].
    expiring: BTreeSet<(u64, PinKey)>,
    /// The pods that came to own pins or stopped owning any since
    /// [`PinTable::take_owner_changes`] last took them: what the sweep
    /// index re-judges (a pod with no pin may be named by nothing now).
    owner_changes: BTreeSet<String>,
}

/// The committed time from which `pin` may expire, if its lifetime runs.
/// A sweep ends it then, once the proposing leader has led for the
/// lifetime too (`Sweep`'s lock-delay).
pub fn expiry(pin: &Pin) -> Option<u64> {
    (pin.lifetime_ms > 0 && pin.owner == OwnerState::Stopped)
        .then(|| pin.last_running_at_ms.saturating_add(pin.lifetime_ms))
}

/// Printed as the map alone, as the state printed its pins before the
/// indexes (a test reads a replica's state back against the text an older
/// build printed).
impl std::fmt::Debug for PinTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.by_key.fmt(f)
    }
}

impl PartialEq for PinTable {
    fn eq(&self, other: &Self) -> bool {
        self.by_key == other.by_key
    }
}

impl Eq for PinTable {}

impl Serialize for PinTable {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.by_key.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for PinTable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<PinKey, Pin>::deserialize(deserializer).map(PinTable::from)
    }
}

impl From<BTreeMap<PinKey, Pin>> for PinTable {
    fn from(by_key: BTreeMap<PinKey, Pin>) -> Self {
        let mut table = PinTable::default();
        for (key, pin) in by_key {
            table.insert(key, pin);
        }
        table
    }
}

impl<'a> IntoIterator for &'a PinTable {
    type Item = (&'a PinKey, &'a Pin);
    type IntoIter = std::collections::btree_map::Iter<'a, PinKey, Pin>;

    fn into_iter(self) -> Self::IntoIter {
        self.by_key.iter()
    }
}

/// Adds `key` to `index[name]`; true if `name` had no entry before.
fn index_add(index: &mut BTreeMap<String, BTreeSet<PinKey>>, name: &str, key: &PinKey) -> bool {
    match index.get_mut(name) {
        Some(keys) => {
            keys.insert(key.clone());
            false
        }
        None => {
            index.insert(name.to_string(), BTreeSet::from([key.clone()]));
            true
        }
    }
}

/// Takes `key` out of `index[name]`, dropping an emptied entry; true if
/// it was dropped.
fn index_remove(index: &mut BTreeMap<String, BTreeSet<PinKey>>, name: &str, key: &PinKey) -> bool {
    if let Some(keys) = index.get_mut(name) {
        keys.remove(key);
        if keys.is_empty() {
            index.remove(name);
            return true;
        }
    }
    false
}

impl PinTable {
    /// The pins as a map (read only: changes go through the table).
    pub fn as_map(&self) -> &BTreeMap<PinKey, Pin> {
        &self.by_key
    }

    /// The pin of `key`.
    pub fn get(&self, key: &PinKey) -> Option<&Pin> {
        self.by_key.get(key)
    }

    /// Whether `key` is pinned.
    pub fn contains_key(&self, key: &PinKey) -> bool {
        self.by_key.contains_key(key)
    }

    /// How many pins there are.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Every pin, in key order.
    pub fn iter(&self) -> std::collections::btree_map::Iter<'_, PinKey, Pin> {
        self.by_key.iter()
    }

    /// Every key, in order.
    pub fn keys(&self) -> impl Iterator<Item = &PinKey> {
        self.by_key.keys()
    }

    /// Every pin, in key order.
    pub fn values(&self) -> impl Iterator<Item = &Pin> {
        self.by_key.values()
    }

    /// The pins of set `set`, in key order.
    pub fn of_set<'a>(&'a self, set: &'a str) -> impl Iterator<Item = (&'a PinKey, &'a Pin)> {
        let from = PinKey::new(set, "");
        self.by_key
            .range(from..)
            .take_while(move |(key, _)| key.set == set)
    }

    /// The pins on `node`, in key order.
    pub fn on_node<'a>(&'a self, node: &str) -> impl Iterator<Item = (&'a PinKey, &'a Pin)> {
        self.indexed(self.by_node.get(node))
    }

    /// The pins owned by pod `pod_uid`, in key order.
    pub fn of_pod<'a>(&'a self, pod_uid: &str) -> impl Iterator<Item = (&'a PinKey, &'a Pin)> {
        self.indexed(self.by_pod.get(pod_uid))
    }

    /// The UIDs of the pods that own pins ("" if any pin has no owner), in
    /// order, from the index: no pin is looked at.
    pub fn owners(&self) -> impl Iterator<Item = &String> {
        self.by_pod.keys()
    }

    fn indexed<'a>(
        &'a self,
        keys: Option<&'a BTreeSet<PinKey>>,
    ) -> impl Iterator<Item = (&'a PinKey, &'a Pin)> {
        keys.into_iter().flatten().filter_map(|key| {
            let pin = self.by_key.get(key)?;
            Some((key, pin))
        })
    }

    /// The pins whose lifetime runs and that may expire at committed time
    /// `now_ms` ([`expiry`] at or before it), in due order. Whether each
    /// is due is still the sweep's to say (the lock-delay).
    pub fn expiring_by(&self, now_ms: u64) -> impl Iterator<Item = (&PinKey, &Pin)> {
        self.expiring
            .iter()
            .take_while(move |(due, _)| *due <= now_ms)
            .filter_map(|(_, key)| Some((key, self.by_key.get(key)?)))
    }

    /// Takes the pods that came to own a first pin or lost their last one
    /// since the last call (see the field's doc).
    pub fn take_owner_changes(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.owner_changes)
    }

    /// Puts `pin` at `key`; returns the pin it replaced.
    pub fn insert(&mut self, key: PinKey, pin: Pin) -> Option<Pin> {
        let old = self.remove(&key);
        index_add(&mut self.by_node, &pin.node, &key);
        if index_add(&mut self.by_pod, &pin.pod_uid, &key) {
            self.note_owner_change(&pin.pod_uid);
        }
        if let Some(due) = expiry(&pin) {
            self.expiring.insert((due, key.clone()));
        }
        self.by_key.insert(key, pin);
        old
    }

    /// Takes the pin of `key` out.
    pub fn remove(&mut self, key: &PinKey) -> Option<Pin> {
        let pin = self.by_key.remove(key)?;
        index_remove(&mut self.by_node, &pin.node, key);
        if index_remove(&mut self.by_pod, &pin.pod_uid, key) {
            self.note_owner_change(&pin.pod_uid);
        }
        if let Some(due) = expiry(&pin) {
            self.expiring.remove(&(due, key.clone()));
        }
        Some(pin)
    }

    fn note_owner_change(&mut self, pod_uid: &str) {
        // A planted bug for the sweep index's checks (`failpoints` feature,
        // FAILPOINTS=sm-sweep-index-misses-owner=return): a pod that lost
        // its last pin is not re-judged.
        #[cfg(feature = "failpoints")]
        if fail::eval("sm-sweep-index-misses-owner", |_| ()).is_some()
            && !self.by_pod.contains_key(pod_uid)
        {
            return;
        }
        if !self.owner_changes.contains(pod_uid) {
            self.owner_changes.insert(pod_uid.to_string());
        }
    }

    /// Changes the pin of `key` in place with `change` (any field, the
    /// indexes follow); false if there is none.
    pub fn modify(&mut self, key: &PinKey, change: impl FnOnce(&mut Pin)) -> bool {
        let Some(mut pin) = self.remove(key) else {
            return false;
        };
        change(&mut pin);
        self.insert(key.clone(), pin);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::types::OwnerState;

    fn pin(node: &str, pod: &str) -> Pin {
        Pin {
            node: node.into(),
            pinned_at_ms: 0,
            pod_uid: pod.into(),
            labels: Default::default(),
            lifetime_ms: 0,
            last_running_at_ms: 0,
            owner: OwnerState::Unknown,
        }
    }

    /// What filtering the whole map answers, for comparison.
    fn scanned(table: &PinTable, keep: impl Fn(&Pin) -> bool) -> Vec<PinKey> {
        table
            .iter()
            .filter(|(_, p)| keep(p))
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn keys<'a>(pins: impl Iterator<Item = (&'a PinKey, &'a Pin)>) -> Vec<PinKey> {
        pins.map(|(k, _)| k.clone()).collect()
    }

    /// The indexes answer what a scan of the map answers, in the same
    /// order, after every kind of change.
    fn indexes_agree(table: &PinTable) {
        for node in ["n1", "n2", "n3"] {
            assert_eq!(
                keys(table.on_node(node)),
                scanned(table, |p| p.node == node)
            );
        }
        for pod in ["a", "b", "c", ""] {
            assert_eq!(
                keys(table.of_pod(pod)),
                scanned(table, |p| p.pod_uid == pod)
            );
        }
        for set in ["s", "s/x", "t"] {
            assert_eq!(
                keys(table.of_set(set)),
                table
                    .keys()
                    .filter(|k| k.set == set)
                    .cloned()
                    .collect::<Vec<_>>()
            );
        }
        // A table rebuilt from its map (a snapshot read back) is equal and
        // indexed alike.
        let rebuilt = PinTable::from(table.by_key.clone());
        assert_eq!(&rebuilt, table);
        assert_eq!(rebuilt.by_node, table.by_node);
        assert_eq!(rebuilt.by_pod, table.by_pod);
        assert_eq!(rebuilt.expiring, table.expiring);
        // The pins that may expire by each time, in due order, as a scan
        // finds them.
        for now in [0, 5, 10, 15, 20, 1_000] {
            let mut scan: Vec<(u64, PinKey)> = table
                .iter()
                .filter_map(|(k, p)| Some((expiry(p)?, k.clone())))
                .filter(|(due, _)| *due <= now)
                .collect();
            scan.sort();
            let indexed: Vec<(u64, PinKey)> = table
                .expiring_by(now)
                .map(|(k, p)| (expiry(p).unwrap(), k.clone()))
                .collect();
            assert_eq!(indexed, scan, "pins expiring by {now}");
        }
    }

    #[test]
    fn the_indexes_follow_every_change() {
        let mut table = PinTable::default();
        table.insert(PinKey::new("s", "2"), pin("n1", "a"));
        table.insert(PinKey::new("s", "1"), pin("n1", "b"));
        table.insert(PinKey::new("s/x", "1"), pin("n2", "a"));
        table.insert(PinKey::new("t", "1"), pin("n1", ""));
        indexes_agree(&table);
        // Replaced with another node and owner.
        let old = table.insert(PinKey::new("s", "2"), pin("n3", "c"));
        assert_eq!(old.unwrap().node, "n1");
        indexes_agree(&table);
        // Its owner changed in place.
        assert!(table.modify(&PinKey::new("s", "1"), |p| p.pod_uid = "c".into()));
        assert!(!table.modify(&PinKey::new("s", "9"), |p| p.pod_uid = "c".into()));
        indexes_agree(&table);
        // Removed, down to nothing.
        assert!(table.remove(&PinKey::new("s/x", "1")).is_some());
        assert!(table.remove(&PinKey::new("s/x", "1")).is_none());
        indexes_agree(&table);
        for key in table.keys().cloned().collect::<Vec<_>>() {
            table.remove(&key);
        }
        assert!(table.is_empty());
        assert!(table.by_node.is_empty() && table.by_pod.is_empty());
        assert!(table.expiring.is_empty());
    }

    /// A pin enters the expiring index when its owner stops with a
    /// lifetime set, moves when it is stopped again later, and leaves when
    /// its owner runs again, its lifetime is made permanent or it ends;
    /// each pod that gains a first pin or loses its last is noted once.
    #[test]
    fn pins_whose_lifetime_runs_are_found_by_their_due_time() {
        let stopped = |node: &str, pod: &str, at: u64, lifetime: u64| Pin {
            owner: OwnerState::Stopped,
            last_running_at_ms: at,
            lifetime_ms: lifetime,
            ..pin(node, pod)
        };
        let mut table = PinTable::default();
        table.insert(PinKey::new("s", "1"), stopped("n1", "a", 10, 5));
        table.insert(PinKey::new("s", "2"), stopped("n1", "b", 0, 1));
        table.insert(PinKey::new("s", "3"), stopped("n2", "b", 0, 0));
        table.insert(PinKey::new("s", "4"), pin("n2", "c"));
        indexes_agree(&table);
        assert_eq!(
            table.take_owner_changes(),
            BTreeSet::from(["a".to_string(), "b".into(), "c".into()])
        );
        // Running again: its countdown stops.
        table.modify(&PinKey::new("s", "2"), |p| p.owner = OwnerState::Running);
        // Stopped later: due later.
        table.modify(&PinKey::new("s", "1"), |p| p.last_running_at_ms = 14);
        // Stopped with a lifetime: due from now on.
        table.modify(&PinKey::new("s", "4"), |p| {
            p.owner = OwnerState::Stopped;
            p.lifetime_ms = 3;
        });
        indexes_agree(&table);
        let due: Vec<&str> = table
            .expiring_by(19)
            .map(|(k, _)| k.member.as_str())
            .collect();
        assert_eq!(due, ["4", "1"]);
        table.remove(&PinKey::new("s", "1"));
        indexes_agree(&table);
        // a and c each lost their only pin for a moment in `modify`; b kept
        // one throughout.
        assert_eq!(
            table.take_owner_changes(),
            BTreeSet::from(["a".to_string(), "c".into()])
        );
        assert!(table.take_owner_changes().is_empty());
    }

    #[test]
    fn a_table_serializes_as_its_map() {
        let mut table = PinTable::default();
        table.insert(PinKey::new("s", "1"), pin("n1", "a"));
        let as_map = postcard::to_allocvec(&table.by_key).unwrap();
        assert_eq!(postcard::to_allocvec(&table).unwrap(), as_map);
        let back: PinTable = postcard::from_bytes(&as_map).unwrap();
        assert_eq!(back, table);
        assert_eq!(keys(back.of_pod("a")), [PinKey::new("s", "1")]);
    }
}
