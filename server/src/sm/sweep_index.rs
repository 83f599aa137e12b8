//! What a sweep can end, by the committed time from which it can fall due,
//! so that a sweep costs what it ends rather than what the state holds:
//! the leader's look ([`crate::sm::command::sweep_due`], every sweep
//! interval and after each pod stop) and the `Sweep` entry every replica
//! applies.
//!
//! Why: both went over every lock, lease, session, node, pin and reported
//! pod. At 1,000 GPU nodes (8,000 claims, 8,000 pods) a sweep follows each
//! pod's deletion, and ending a bench run's 8,000 claims cost the three
//! replicas 26–29 s of CPU, 3.3 ms a pod against 2.1 ms at 200 nodes, the
//! sweeps' scans about a tenth of it (`tether-bind-bench` under `perf`,
//! 2026-12-05, docs/bench/history/2026-12-05-96475fc-replica-cpu.md).
//!
//! What is indexed, each by the time from which it can be due:
//! - holds by grant time, the waits of a lock by the earliest deadline
//!   among them, TTL leases by expiry, client sessions by when they were
//!   last seen, node tombstones by when the node went;
//! - the reported pods that no hold, wait or pin names (exactly that set:
//!   a sweep forgets their phases);
//! - pins whose lifetime runs: in the pin table itself
//!   ([`crate::sm::pin_table::PinTable::expiring_by`]), which sees every
//!   change to a pin.
//!
//! A sweep still judges each candidate on the live state (lock-delay,
//! per-scope hold timeouts, a stuck hold reported once): the index only
//! says where to look, so what a sweep ends, and the order of its events,
//! are those of the full scan, entry for entry. The scans are kept
//! ([`crate::sm::command::sweep`]'s `scanned` functions): a state not yet
//! indexed is swept by them, and the state machine's tests compare the two
//! at every entry.
//!
//! How it stays in step: it is derived, never serialized (snapshots and
//! the store hold the state as before), built from the whole state the
//! first time an entry applies to a state read back, and after every entry
//! refreshed from the keys the entry changed ([`Dirty`]: the store writes
//! by these, so they name every change) and the pods the pin table saw gain
//! a first pin or lose their last. Entries change a handful of keys, so a
//! refresh costs what the entry touched.

use std::collections::{BTreeMap, BTreeSet};

use super::types::{Lock, LockKey};
use super::{Dirty, State};

/// Keys by a committed time, and each key's time.
#[derive(Clone)]
struct TimeIndex<K> {
    by_time: BTreeSet<(u64, K)>,
    time_of: BTreeMap<K, u64>,
}

impl<K> Default for TimeIndex<K> {
    fn default() -> Self {
        TimeIndex {
            by_time: BTreeSet::new(),
            time_of: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Clone> TimeIndex<K> {
    /// Files `key` under `time`, or takes it out (`None`).
    fn set(&mut self, key: &K, time: Option<u64>) {
        if self.time_of.get(key).copied() == time {
            return;
        }
        if let Some(old) = self.time_of.remove(key) {
            self.by_time.remove(&(old, key.clone()));
        }
        if let Some(time) = time {
            self.time_of.insert(key.clone(), time);
            self.by_time.insert((time, key.clone()));
        }
    }

    /// The keys filed at or before `time` (none for `None`), in time order.
    fn through(&self, time: Option<u64>) -> impl Iterator<Item = &K> {
        self.by_time
            .iter()
            .take_while(move |(at, _)| time.is_some_and(|t| *at <= t))
            .map(|(_, key)| key)
    }

    fn len(&self) -> usize {
        self.time_of.len()
    }
}

/// The index (see the module doc). Equal to any other, printed as nothing:
/// it is not part of the state, only a way into it.
#[derive(Clone, Default)]
pub struct SweepIndex {
    /// False until built from a whole state: a state read back from a
    /// snapshot or the store, or built by hand, is swept by full scans
    /// until its next entry builds this.
    built: bool,
    holds: TimeIndex<LockKey>,
    waits: TimeIndex<LockKey>,
    leases: TimeIndex<u64>,
    sessions: TimeIndex<String>,
    tombstones: TimeIndex<String>,
    /// The pods each lock names (holder and waiters), sorted, without
    /// repeats.
    names: BTreeMap<LockKey, Vec<String>>,
    /// How many locks name each pod.
    named: BTreeMap<String, u32>,
    /// Reported pods that no hold, wait or pin names.
    unreferenced: BTreeSet<String>,
}

impl PartialEq for SweepIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for SweepIndex {}

impl std::fmt::Debug for SweepIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SweepIndex")
    }
}

/// When `lock`'s hold was granted, if it has one.
fn hold_time(lock: &Lock) -> Option<u64> {
    lock.holder.as_ref().map(|h| h.granted_at_ms)
}

/// The earliest deadline among `lock`'s waits that have one.
fn wait_time(lock: &Lock) -> Option<u64> {
    lock.waiters
        .iter()
        .map(|w| w.deadline_ms)
        .filter(|d| *d != 0)
        .min()
}

/// The pods `lock` names, sorted, without repeats.
fn named_pods(lock: &Lock) -> Vec<String> {
    let mut pods: Vec<String> = lock
        .holder
        .iter()
        .map(|h| h.pod.uid.clone())
        .chain(lock.waiters.iter().map(|w| w.pod.uid.clone()))
        .collect();
    pods.sort_unstable();
    pods.dedup();
    pods
}

/// `time` less `length`, or `None` when nothing filed can be that old.
fn minus(time: u64, length: u64) -> Option<u64> {
    time.checked_sub(length)
}

impl SweepIndex {
    /// Whether it answers for the state it is in (else sweep by scans).
    pub fn is_built(&self) -> bool {
        self.built
    }

    /// Locks whose hold was granted at or before `time`.
    pub fn holds_granted_by(&self, time: Option<u64>) -> impl Iterator<Item = &LockKey> {
        self.holds.through(time)
    }

    /// Locks with a wait whose deadline is at or before `time`.
    pub fn waits_ending_by(&self, time: u64) -> impl Iterator<Item = &LockKey> {
        self.waits.through(Some(time))
    }

    /// Leases that expire at or before `time`.
    pub fn leases_expiring_by(&self, time: u64) -> impl Iterator<Item = &u64> {
        self.leases.through(Some(time))
    }

    /// Sessions idle for at least `idle_ms` at `now_ms`.
    pub fn sessions_idle(&self, now_ms: u64, idle_ms: u64) -> impl Iterator<Item = &String> {
        self.sessions.through(minus(now_ms, idle_ms))
    }

    /// Nodes gone for at least `kept_ms` at `now_ms`.
    pub fn tombstones_older(&self, now_ms: u64, kept_ms: u64) -> impl Iterator<Item = &String> {
        self.tombstones.through(minus(now_ms, kept_ms))
    }

    /// Reported pods that no hold, wait or pin names, in UID order.
    pub fn unreferenced(&self) -> &BTreeSet<String> {
        &self.unreferenced
    }

    /// Sizes, for tests: (holds, locks with waits, leases, sessions,
    /// tombstones).
    pub fn sizes(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.holds.len(),
            self.waits.len(),
            self.leases.len(),
            self.sessions.len(),
            self.tombstones.len(),
        )
    }

    /// Files `key`'s lock as it is now in `locks`; returns the pods it
    /// named before or names now.
    fn file_lock(&mut self, key: &LockKey, lock: Option<&Lock>) -> Vec<String> {
        let granted = lock.and_then(hold_time);
        // A planted bug for the sweep index's checks (`failpoints` feature,
        // FAILPOINTS=sm-sweep-index-misses-holds=return): no hold is filed,
        // so no hold times out.
        #[cfg(feature = "failpoints")]
        let granted =
            granted.filter(|_| fail::eval("sm-sweep-index-misses-holds", |_| ()).is_none());
        self.holds.set(key, granted);
        self.waits.set(key, lock.and_then(wait_time));
        let now = lock.map(named_pods).unwrap_or_default();
        let before = self.names.remove(key).unwrap_or_default();
        if before == now {
            if !now.is_empty() {
                self.names.insert(key.clone(), now);
            }
            return Vec::new();
        }
        for uid in &before {
            if let Some(count) = self.named.get_mut(uid) {
                *count -= 1;
                if *count == 0 {
                    self.named.remove(uid);
                }
            }
        }
        for uid in &now {
            *self.named.entry(uid.clone()).or_default() += 1;
        }
        let mut touched = before;
        touched.extend(now.iter().cloned());
        if !now.is_empty() {
            self.names.insert(key.clone(), now);
        }
        touched
    }

    /// Re-judges whether pod `uid` is named by nothing.
    fn judge_pod(&mut self, state: &State, uid: &str) {
        let unreferenced = state.pods.contains_key(uid)
            && state.pins.of_pod(uid).next().is_none()
            && !self.named.contains_key(uid);
        if unreferenced {
            if !self.unreferenced.contains(uid) {
                self.unreferenced.insert(uid.to_string());
            }
        } else {
            self.unreferenced.remove(uid);
        }
    }

    /// Built from the whole of `state`.
    fn build(state: &mut State) -> SweepIndex {
        let mut index = SweepIndex {
            built: true,
            ..SweepIndex::default()
        };
        for (key, lock) in &state.locks {
            index.file_lock(key, Some(lock));
        }
        for (id, lease) in &state.leases {
            index.leases.set(id, Some(lease.expires_at_ms));
        }
        for (client, session) in &state.sessions {
            index.sessions.set(client, Some(session.last_seen_ms));
        }
        for (name, node) in &state.nodes {
            index.tombstones.set(name, node.gone_at_ms);
        }
        state.pins.take_owner_changes();
        let pods: Vec<String> = state.pods.keys().cloned().collect();
        for uid in pods {
            index.judge_pod(state, &uid);
        }
        index
    }

    /// Brought in step with `state` after an entry that changed `dirty`.
    fn refresh(&mut self, state: &mut State, dirty: &Dirty) {
        let mut touched: BTreeSet<String> = state.pins.take_owner_changes();
        for key in &dirty.locks {
            touched.extend(self.file_lock(key, state.locks.get(key)));
        }
        for id in &dirty.leases {
            self.leases
                .set(id, state.leases.get(id).map(|l| l.expires_at_ms));
        }
        for client in &dirty.sessions {
            self.sessions
                .set(client, state.sessions.get(client).map(|s| s.last_seen_ms));
        }
        for name in &dirty.nodes {
            self.tombstones
                .set(name, state.nodes.get(name).and_then(|n| n.gone_at_ms));
        }
        touched.extend(dirty.pods.iter().cloned());
        for uid in touched {
            self.judge_pod(state, &uid);
        }
    }
}

impl State {
    /// Brings the sweep index in step with the state after an entry that
    /// changed `dirty` (or builds it, for a state read back).
    pub(crate) fn refresh_sweep_index(&mut self, dirty: &Dirty) {
        let mut index = std::mem::take(&mut self.sweep_index);
        if index.built {
            index.refresh(self, dirty);
        } else {
            index = SweepIndex::build(self);
        }
        self.sweep_index = index;
    }

    /// The sweep index (see [`crate::sm::sweep_index`]).
    pub fn sweep_index(&self) -> &SweepIndex {
        &self.sweep_index
    }
}
