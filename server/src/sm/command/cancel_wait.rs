//! `CancelWait`: a queued acquire gives up (its deadline passed on the
//! replica serving it).

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{Hold, LockKey, WaitEndReason};

/// Remove `pod_uid`'s wait on `key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelWait {
    /// The lock.
    pub key: LockKey,
    /// The waiting pod.
    pub pod_uid: String,
}

/// What a cancel found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CancelOutcome {
    /// The wait was removed.
    Removed,
    /// Too late: the pod was granted the lock before the cancel applied. The
    /// caller must use (or release) this hold rather than drop it.
    AlreadyGranted(Hold),
    /// The pod neither waits for nor holds the lock.
    NotWaiting,
}

impl CancelWait {
    /// Idempotent; a grant that won the race is reported, never lost.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let Some(lock) = txn.state.locks.get(&self.key) else {
            return Ok(Reply::WaitCancelled(CancelOutcome::NotWaiting));
        };
        if let Some(hold) = &lock.holder
            && hold.pod.uid == self.pod_uid
        {
            return Ok(Reply::WaitCancelled(CancelOutcome::AlreadyGranted(
                hold.clone(),
            )));
        }
        let uid = self.pod_uid;
        if txn.remove_waiters(
            &self.key,
            |w| w.pod.uid == uid,
            WaitEndReason::DeadlineExceeded,
        ) {
            Ok(Reply::WaitCancelled(CancelOutcome::Removed))
        } else {
            Ok(Reply::WaitCancelled(CancelOutcome::NotWaiting))
        }
    }
}
