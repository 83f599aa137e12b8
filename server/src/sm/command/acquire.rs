//! `Acquire`: take a lock at once, or join its FIFO queue.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{Hold, LockKey, Pod, Waiter};

/// Take `key` for `pod`, or wait for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acquire {
    /// The lock.
    pub key: LockKey,
    /// The pod acquiring.
    pub pod: Pod,
    /// Stored with the hold.
    pub payload: Vec<u8>,
    /// How long to wait in the queue; 0 = fail at once if held.
    pub wait_ms: u64,
    /// TTL lease to attach to (0 = none).
    pub lease_id: u64,
    /// The acting client.
    pub client_id: String,
    /// Queue length limit in force when the leader proposed the entry.
    pub queue_limit: u32,
}

impl Acquire {
    /// Granted at once if the lock is free; the same pod UID re-acquiring gets
    /// its existing hold or queue position back; otherwise queued, unless the
    /// caller does not wait or the queue is full.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        if let Some(lock) = txn.state.locks.get(&self.key) {
            if let Some(hold) = &lock.holder
                && hold.pod.uid == self.pod.uid
            {
                return Ok(Reply::Granted(hold.clone()));
            }
            if let Some(position) = lock.position_of(&self.pod.uid) {
                return Ok(Reply::Queued {
                    position: position as u32,
                });
            }
        }
        if self.lease_id != 0 && !txn.state.leases.contains_key(&self.lease_id) {
            return Err(CommandError::LeaseNotFound {
                lease_id: self.lease_id,
            });
        }
        let (index, now) = (txn.index, txn.now_ms);
        let current = txn
            .state
            .locks
            .get(&self.key)
            .and_then(|l| l.holder.clone());
        // A deliberate bug for the chaos tests' "the checkers can fail" test:
        // grant over the current holder. Only with the `failpoints` feature
        // and FAILPOINTS=sm-acquire-ignore-holder=return.
        #[cfg(feature = "failpoints")]
        let current = current.filter(|_| fail::eval("sm-acquire-ignore-holder", |_| ()).is_none());
        match current {
            None => {
                let hold = Hold {
                    pod: self.pod,
                    token: index,
                    granted_at_ms: now,
                    payload: self.payload,
                    client_id: self.client_id,
                    lease_id: self.lease_id,
                };
                let lock = txn.lock_mut(&self.key);
                lock.holder = Some(hold.clone());
                lock.last_token = index;
                txn.emit(EventKind::LockGranted {
                    key: self.key,
                    hold: hold.clone(),
                });
                Ok(Reply::Granted(hold))
            }
            Some(holder) => {
                if self.wait_ms == 0 {
                    return Err(CommandError::LockHeld {
                        key: self.key,
                        holder: holder.pod,
                        token: holder.token,
                    });
                }
                let queued = txn
                    .state
                    .locks
                    .get(&self.key)
                    .map_or(0, |l| l.waiters.len());
                if queued >= self.queue_limit as usize {
                    return Err(CommandError::QueueFull {
                        key: self.key,
                        limit: self.queue_limit,
                    });
                }
                let waiter = Waiter {
                    pod: self.pod.clone(),
                    queued_at_ms: now,
                    deadline_ms: now.saturating_add(self.wait_ms),
                    payload: self.payload,
                    client_id: self.client_id,
                    lease_id: self.lease_id,
                };
                let lock = txn.lock_mut(&self.key);
                lock.waiters.push_back(waiter);
                let position = lock.waiters.len() as u32;
                txn.emit(EventKind::LockQueued {
                    key: self.key,
                    pod: self.pod,
                    position,
                });
                Ok(Reply::Queued { position })
            }
        }
    }
}
