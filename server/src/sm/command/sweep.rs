//! `Sweep`: housekeeping the leader proposes when something is due on
//! committed time. What expires is decided here, from the entry's committed
//! time, so every replica reaches the same result; the leader only decides
//! *whether* holds and leases may expire at all (lock-delay after a leader
//! change) and passes that in.

use serde::{Deserialize, Serialize};

use super::lease::end_lease;
use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{LockKey, ReleaseReason, WaitEndReason};

/// Expire what is due.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sweep {
    /// Hold timeout to enforce; `None` while the leader's lock-delay is in
    /// force (it has not yet led for one full timeout window).
    pub hold_timeout_ms: Option<u64>,
    /// Whether TTL leases may expire (false during the lock-delay).
    pub expire_leases: bool,
    /// Dedupe sessions idle this long are evicted.
    pub session_idle_ms: u64,
}

impl Sweep {
    /// Drops waits past their deadline, expires due TTL leases and held-too-long
    /// holds, and evicts idle dedupe sessions.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        let mut waits = 0;
        let late_waits: Vec<LockKey> = txn
            .state
            .locks
            .iter()
            .filter(|(_, l)| l.waiters.iter().any(|w| w.deadline_ms != 0 && w.deadline_ms <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in &late_waits {
            let before = txn.state.locks.get(key).map_or(0, |l| l.waiters.len());
            txn.remove_waiters(
                key,
                |w| w.deadline_ms != 0 && w.deadline_ms <= now,
                WaitEndReason::DeadlineExceeded,
            );
            let after = txn.state.locks.get(key).map_or(0, |l| l.waiters.len());
            waits += (before - after) as u32;
        }

        let mut leases = 0;
        if self.expire_leases {
            let due: Vec<u64> = txn
                .state
                .leases
                .values()
                .filter(|l| l.expires_at_ms <= now)
                .map(|l| l.id)
                .collect();
            for lease_id in due {
                end_lease(txn, lease_id, true);
                leases += 1;
            }
        }

        let mut holds = 0;
        if let Some(timeout_ms) = self.hold_timeout_ms {
            let due: Vec<LockKey> = txn
                .state
                .locks
                .iter()
                .filter(|(_, l)| {
                    l.holder.as_ref().is_some_and(|h| h.granted_at_ms.saturating_add(timeout_ms) <= now)
                })
                .map(|(k, _)| k.clone())
                .collect();
            for key in due {
                txn.release_and_hand_over(&key, ReleaseReason::HoldTimeout { timeout_ms });
                holds += 1;
            }
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
        Ok(Reply::Swept { waits, leases, holds, sessions })
    }
}

/// Whether a [`Sweep`] with these settings would expire anything at committed
/// time `now_ms`: the leader asks this of its applied state before proposing,
/// so an idle cluster writes no sweep entries.
pub fn sweep_due(state: &crate::sm::State, now_ms: u64, sweep: &Sweep) -> bool {
    let waits = state
        .locks
        .values()
        .flat_map(|l| l.waiters.iter())
        .any(|w| w.deadline_ms != 0 && w.deadline_ms <= now_ms);
    let leases = sweep.expire_leases && state.leases.values().any(|l| l.expires_at_ms <= now_ms);
    let holds = sweep.hold_timeout_ms.is_some_and(|timeout| {
        state
            .locks
            .values()
            .filter_map(|l| l.holder.as_ref())
            .any(|h| h.granted_at_ms.saturating_add(timeout) <= now_ms)
    });
    let sessions = state
        .sessions
        .values()
        .any(|s| s.last_seen_ms.saturating_add(sweep.session_idle_ms) <= now_ms);
    waits || leases || holds || sessions
}
