//! `Sweep`: housekeeping the leader proposes when something is due on
//! committed time. What expires is decided here, from the entry's committed
//! time, so every replica reaches the same result.
//!
//! Lock-delay: a new leader's clock may run ahead of the old one's, so a hold
//! or TTL lease may expire only once the proposing leader has led for at least
//! that hold's timeout or that lease's TTL (`leader_tenure_ms`, stamped in the
//! entry). Anything still alive would have been refreshed or released through
//! this leader within that window.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::lease::end_lease;
use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{LockKey, ReleaseReason, WaitEndReason};

/// Expire what is due.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sweep {
    /// How long the proposing leader has led, ms (its own monotonic clock).
    pub leader_tenure_ms: u64,
    /// Hold timeout of scopes without their own.
    pub hold_timeout_ms: u64,
    /// Hold timeouts of scopes that have their own.
    pub scope_hold_timeout_ms: BTreeMap<String, u64>,
    /// Dedupe sessions idle this long are evicted.
    pub session_idle_ms: u64,
}

impl Sweep {
    /// The hold timeout of `scope`, or `None` while the lock-delay for it is
    /// in force.
    pub fn timeout_for(&self, scope: &str) -> Option<u64> {
        let timeout = self
            .scope_hold_timeout_ms
            .get(scope)
            .copied()
            .unwrap_or(self.hold_timeout_ms);
        (timeout <= self.leader_tenure_ms).then_some(timeout)
    }

    fn lease_may_expire(&self, lease: &crate::sm::TtlLease, now_ms: u64) -> bool {
        lease.expires_at_ms <= now_ms && lease.ttl_ms <= self.leader_tenure_ms
    }

    fn hold_due(&self, key: &LockKey, lock: &crate::sm::Lock, now_ms: u64) -> Option<u64> {
        let timeout = self.timeout_for(&key.scope)?;
        let hold = lock.holder.as_ref()?;
        (hold.granted_at_ms.saturating_add(timeout) <= now_ms).then_some(timeout)
    }

    /// Drops waits past their deadline, expires due TTL leases and held-too-long
    /// holds, and evicts idle dedupe sessions.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        let late = |w: &crate::sm::Waiter| w.deadline_ms != 0 && w.deadline_ms <= now;
        let late_waits: Vec<(LockKey, usize)> = txn
            .state
            .locks
            .iter()
            .map(|(k, l)| (k.clone(), l.waiters.iter().filter(|w| late(w)).count()))
            .filter(|(_, n)| *n > 0)
            .collect();
        let mut waits = 0;
        for (key, count) in &late_waits {
            txn.remove_waiters(key, late, WaitEndReason::DeadlineExceeded);
            waits += *count as u32;
        }

        let due_leases: Vec<u64> = txn
            .state
            .leases
            .values()
            .filter(|l| self.lease_may_expire(l, now))
            .map(|l| l.id)
            .collect();
        let leases = due_leases.len() as u32;
        for lease_id in due_leases {
            end_lease(txn, lease_id, true);
        }

        let due_holds: Vec<(LockKey, u64)> = txn
            .state
            .locks
            .iter()
            .filter_map(|(key, lock)| Some((key.clone(), self.hold_due(key, lock, now)?)))
            .collect();
        let holds = due_holds.len() as u32;
        for (key, timeout_ms) in due_holds {
            txn.release_and_hand_over(&key, ReleaseReason::HoldTimeout { timeout_ms });
        }

        let idle: Vec<String> = txn
            .state
            .sessions
            .iter()
            .filter(|(_, s)| s.last_seen_ms.saturating_add(self.session_idle_ms) <= now)
            .map(|(c, _)| c.clone())
            .collect();
        let sessions = idle.len() as u32;
        for client in idle {
            txn.state.sessions.remove(&client);
            txn.dirty.sessions.insert(client);
        }
        Ok(Reply::Swept {
            waits,
            leases,
            holds,
            sessions,
        })
    }
}

/// Whether a [`Sweep`] would expire anything at committed time `now_ms`: the
/// leader asks this of its applied state before proposing, so an idle cluster
/// writes no sweep entries.
pub fn sweep_due(state: &crate::sm::State, now_ms: u64, sweep: &Sweep) -> bool {
    let waits = state
        .locks
        .values()
        .flat_map(|l| l.waiters.iter())
        .any(|w| w.deadline_ms != 0 && w.deadline_ms <= now_ms);
    let leases = state
        .leases
        .values()
        .any(|l| sweep.lease_may_expire(l, now_ms));
    let holds = state
        .locks
        .iter()
        .any(|(k, l)| sweep.hold_due(k, l, now_ms).is_some());
    let sessions = state
        .sessions
        .values()
        .any(|s| s.last_seen_ms.saturating_add(sweep.session_idle_ms) <= now_ms);
    waits || leases || holds || sessions
}
