//! `CancelWait`: a queued acquire gives up (its deadline passed on the
//! replica serving it). `AbandonWait`: the caller of a queued acquire went
//! away and no retry of its request came back for the wait.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::SESSION_BINDING_FORMAT_VERSION;
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
    /// The wait was kept: a retry of the acquire answered it after the
    /// answer the abandoning stream had ([`AbandonWait`]).
    TakenUp,
}

/// The wait queued by one client request, whose stream's caller went away:
/// removed unless a retry of that request (same id, on any replica) has been
/// answered since the entry `answered_at` that answered the stream. Without
/// that condition a client whose connection reset, and which retried at
/// once, would find its wait cancelled behind it (format 6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonWait {
    /// The lock.
    pub key: LockKey,
    /// The waiting pod.
    pub pod_uid: String,
    /// The request that queued the wait (server-side client id, bound to
    /// its caller).
    pub client_id: String,
    /// Its sequence.
    pub sequence: u64,
    /// Log index of the entry whose answer the abandoning stream carried.
    pub answered_at: u64,
}

/// Format in which [`AbandonWait`] first exists (it has no older form).
pub const ABANDON_WAIT_FORMAT_VERSION: u16 = SESSION_BINDING_FORMAT_VERSION;

impl AbandonWait {
    /// Idempotent, like [`CancelWait`]; a grant that won the race is
    /// reported and kept (the pod acquiring again gets it back).
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let retried_since = txn
            .state
            .sessions
            .get(&self.client_id)
            .and_then(|session| session.responses.get(&self.sequence))
            .is_some_and(|answer| answer.answered_at > self.answered_at);
        // A deliberate bug for the checkers' "can fail" tests: give the wait
        // up even when a retry came back for it. Only with the `failpoints`
        // feature and FAILPOINTS=sm-abandon-ignores-retry=return.
        #[cfg(feature = "failpoints")]
        let retried_since =
            retried_since && fail::eval("sm-abandon-ignores-retry", |_| ()).is_none();
        if retried_since {
            return Ok(Reply::WaitCancelled(CancelOutcome::TakenUp));
        }
        end_wait(txn, self.key, self.pod_uid, WaitEndReason::Abandoned)
    }
}

impl CancelWait {
    /// Idempotent; a grant that won the race is reported, never lost.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        end_wait(txn, self.key, self.pod_uid, WaitEndReason::DeadlineExceeded)
    }
}

/// Removes `pod_uid`'s wait on `key` for `reason`, or reports the hold it
/// became.
fn end_wait(
    txn: &mut Txn<'_>,
    key: LockKey,
    pod_uid: String,
    reason: WaitEndReason,
) -> Result<Reply, CommandError> {
    let Some(lock) = txn.state.locks.get(&key) else {
        return Ok(Reply::WaitCancelled(CancelOutcome::NotWaiting));
    };
    if let Some(hold) = &lock.holder
        && hold.pod.uid == pod_uid
    {
        return Ok(Reply::WaitCancelled(CancelOutcome::AlreadyGranted(
            hold.clone(),
        )));
    }
    if txn.remove_waiters(&key, |w| w.pod.uid == pod_uid, reason) {
        Ok(Reply::WaitCancelled(CancelOutcome::Removed))
    } else {
        Ok(Reply::WaitCancelled(CancelOutcome::NotWaiting))
    }
}
