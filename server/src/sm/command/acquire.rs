//! `Acquire`: take a lock at once, or join its FIFO queue.
//!
//! From format 9 ([`TAKEOVER_FORMAT_VERSION`]) a pod's hold or wait belongs
//! to the client that acquired it. The same client acquiring again gets it
//! back unchanged (its retries, and its own attempts one after another);
//! another client acquiring for the same pod takes it over: a hold is
//! granted again to the new client with a new token (this entry's index),
//! a wait keeps its place and becomes the new client's. That is a second
//! bind attempt of one pod (kube-scheduler gave up on the first and tried
//! again through another extender replica): the first attempt's token is
//! stale from then on, its withdrawal ([`super::WithdrawOwn`]) finds
//! nothing of its own, and its wait is granted to nobody, so it can never
//! end the hold the second attempt bound the pod with.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{Hold, LockKey, Pod, Waiter};

/// The format from which another client's acquire takes a pod's hold or
/// wait over (see the module doc). Before it, the second client shared the
/// first one's hold and token.
pub const TAKEOVER_FORMAT_VERSION: u16 = 9;

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
    /// Granted at once if the lock is free; the same pod UID re-acquiring
    /// from the same client gets its existing hold or queue position back,
    /// from another client takes it over (format 9, see the module doc);
    /// otherwise queued, unless the caller does not wait or the queue is
    /// full.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let takeover = txn.format_version >= TAKEOVER_FORMAT_VERSION;
        // A deliberate bug for the checkers' "can fail" tests: another
        // client's acquire shares the pod's hold and wait (the rule before
        // format 9). Only with the `failpoints` feature and
        // FAILPOINTS=sm-acquire-shares-attempts=return.
        #[cfg(feature = "failpoints")]
        let takeover = takeover && fail::eval("sm-acquire-shares-attempts", |_| ()).is_none();
        if let Some(lock) = txn.state.locks.get(&self.key) {
            if let Some(hold) = &lock.holder
                && hold.pod.uid == self.pod.uid
            {
                if !takeover || hold.client_id == self.client_id {
                    return Ok(Reply::Granted(hold.clone()));
                }
                return self.take_hold_over(txn);
            }
            if let Some(position) = lock.position_of(&self.pod.uid) {
                if takeover {
                    self.lease_exists(txn)?;
                    let now = txn.now_ms;
                    let lock = txn.lock_mut(&self.key);
                    let waiter = &mut lock.waiters[position - 1];
                    if waiter.client_id != self.client_id {
                        waiter.client_id = self.client_id;
                        waiter.payload = self.payload;
                        waiter.deadline_ms = now.saturating_add(self.wait_ms);
                        waiter.lease_id = self.lease_id;
                    }
                }
                return Ok(Reply::Queued {
                    position: position as u32,
                });
            }
        }
        self.lease_exists(txn)?;
        let now = txn.now_ms;
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
            None => Ok(self.grant(txn)),
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

    /// Grants the pod's hold again, to this client, with this entry's index
    /// as its token and this acquire's payload: the earlier client's token
    /// goes stale. A hold granted by this very entry (a batch item before
    /// this one) is not taken again: a lock is granted at most once per
    /// entry, so this acquire is refused as if the lock were another pod's.
    fn take_hold_over(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        self.lease_exists(txn)?;
        let index = txn.index;
        let lock = txn.lock_mut(&self.key);
        let held = lock.holder.as_ref().expect("the pod holds the lock");
        if held.token == index {
            return Err(CommandError::LockHeld {
                key: self.key,
                holder: held.pod.clone(),
                token: held.token,
            });
        }
        Ok(self.grant(txn))
    }

    /// Makes this acquire the lock's holder, with this entry's index as
    /// its token (whoever held it before, if anyone, no longer does).
    fn grant(self, txn: &mut Txn<'_>) -> Reply {
        let (index, now) = (txn.index, txn.now_ms);
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
        Reply::Granted(hold)
    }

    /// Refuses a TTL lease that does not exist.
    fn lease_exists(&self, txn: &Txn<'_>) -> Result<(), CommandError> {
        if self.lease_id != 0 && !txn.state.leases.contains_key(&self.lease_id) {
            return Err(CommandError::LeaseNotFound {
                lease_id: self.lease_id,
            });
        }
        Ok(())
    }
}
