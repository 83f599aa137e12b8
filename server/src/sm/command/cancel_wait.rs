//! `CancelWait`: a queued acquire gives up (its deadline passed on the
//! replica serving it). `AbandonWait`: the caller of a queued acquire went
//! away and no retry of its request came back for the wait. `Withdraw`: the
//! caller says it no longer wants the lock for the pod (kube-scheduler gave
//! up on the bind), whether the pod still waits or has been granted.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::SESSION_BINDING_FORMAT_VERSION;
use crate::sm::Txn;
use crate::sm::types::{Hold, LockKey, ReleaseReason, WaitEndReason};

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
    /// The pod had been granted the lock; the hold was ended and the lock
    /// handed to the next waiter in the same entry ([`Withdraw`], and
    /// [`AbandonWait`] from format 7).
    GaveBack {
        /// The hold that ended.
        hold: Hold,
        /// Who was granted in its place.
        next: Option<Hold>,
    },
    /// The pod's wait or hold is another client's now: that client's
    /// acquire of the same pod took it over (format 9, [`WithdrawOwn`]).
    TakenOver,
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

/// From this format [`AbandonWait`] gives back a hold its wait became when
/// nothing from its client came after the grant, and [`Withdraw`] exists.
/// Before it, a grant that raced the give-up was kept for a caller that was
/// gone, and its node waited for the hold timeout.
pub const GIVE_BACK_FORMAT_VERSION: u16 = 7;

/// `pod_uid` no longer wants `key`: its wait ends, or the hold it was
/// granted is given back and the next waiter granted, in one entry. What a
/// caller that gave up on an acquire sends (the extender, when
/// kube-scheduler's `httpTimeout` ran out on a bind), instead of dropping
/// the call and looking for a hold once (which a grant a moment later
/// escaped). Idempotent: a second one finds nothing and answers
/// [`CancelOutcome::NotWaiting`] (format 7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Withdraw {
    /// The lock.
    pub key: LockKey,
    /// The pod that no longer wants it.
    pub pod_uid: String,
}

impl Withdraw {
    /// Ends the pod's wait, or its hold (handing the lock over), or finds
    /// neither.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let holds = txn
            .state
            .locks
            .get(&self.key)
            .and_then(|l| l.holder.as_ref())
            .is_some_and(|h| h.pod.uid == self.pod_uid);
        // A deliberate bug for the checkers' "can fail" tests: end only
        // waits, keeping a hold granted before the caller gave up. Only with
        // the `failpoints` feature and FAILPOINTS=sm-withdraw-keeps-hold=return.
        #[cfg(feature = "failpoints")]
        let holds = holds && fail::eval("sm-withdraw-keeps-hold", |_| ()).is_none();
        if holds {
            return Ok(give_back(txn, &self.key, ReleaseReason::Withdrawn));
        }
        end_wait(txn, self.key, self.pod_uid, WaitEndReason::Withdrawn)
    }
}

/// Ends the hold on `key` for `reason` and grants the next waiter.
fn give_back(txn: &mut Txn<'_>, key: &LockKey, reason: ReleaseReason) -> Reply {
    let (released, next) = txn.release_and_hand_over(key, reason);
    match released {
        Some(hold) => Reply::WaitCancelled(CancelOutcome::GaveBack { hold, next }),
        None => Reply::WaitCancelled(CancelOutcome::NotWaiting),
    }
}

impl AbandonWait {
    /// Idempotent, like [`CancelWait`]. A grant that won the race is given
    /// back (format 7) when it went to this client's wait after the
    /// abandoned answer and nothing from the client has applied since the
    /// grant (a later request of its own may have taken the hold up); before
    /// format 7, or when the client has been seen since, it is reported and
    /// kept (the pod acquiring again gets it back).
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
        let give_back_rule = txn.format_version >= GIVE_BACK_FORMAT_VERSION;
        // A deliberate bug for the checkers' "can fail" tests: keep a grant
        // that raced the give-up (format 6's rule). Only with the
        // `failpoints` feature and FAILPOINTS=sm-abandon-keeps-grant=return.
        #[cfg(feature = "failpoints")]
        let give_back_rule =
            give_back_rule && fail::eval("sm-abandon-keeps-grant", |_| ()).is_none();
        if give_back_rule && self.granted_to_nobody(txn) {
            return Ok(give_back(txn, &self.key, ReleaseReason::Abandoned));
        }
        // From format 9 a wait another client took over is that client's.
        if txn.format_version >= super::TAKEOVER_FORMAT_VERSION
            && waits_for_another_client(txn, &self.key, &self.pod_uid, &self.client_id)
        {
            return Ok(Reply::WaitCancelled(CancelOutcome::NotWaiting));
        }
        end_wait(txn, self.key, self.pod_uid, WaitEndReason::Abandoned)
    }

    /// Whether the pod holds the lock by a grant of this client's wait made
    /// after the abandoned answer, with nothing from the client applied at
    /// or after the grant's committed time. (Committed time never goes
    /// back, so a request of the client that applied after the grant has
    /// `last_seen_ms` at or past `granted_at_ms`; one in the same
    /// millisecond counts as after: the hold is kept.)
    fn granted_to_nobody(&self, txn: &Txn<'_>) -> bool {
        let Some(hold) = txn
            .state
            .locks
            .get(&self.key)
            .and_then(|l| l.holder.as_ref())
        else {
            return false;
        };
        let seen_since = txn
            .state
            .sessions
            .get(&self.client_id)
            .is_some_and(|s| s.last_seen_ms >= hold.granted_at_ms);
        hold.pod.uid == self.pod_uid
            && hold.client_id == self.client_id
            && hold.token > self.answered_at
            && !seen_since
    }
}

/// `pod_uid` no longer wants `key` as far as client `client_id` is
/// concerned: the wait it queued ends, or the hold it was granted is given
/// back and the next waiter granted, in one entry; a wait or hold another
/// client took over since ([`super::TAKEOVER_FORMAT_VERSION`]: a later bind
/// attempt of the same pod) is left alone and answered
/// [`CancelOutcome::TakenOver`]. What [`Withdraw`] is from format 9: an
/// extender whose scheduler hung up on a bind can no longer end the hold a
/// later attempt of the same pod bound the pod with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WithdrawOwn {
    /// The lock.
    pub key: LockKey,
    /// The pod that no longer wants it.
    pub pod_uid: String,
    /// The server-side id of the client that withdraws.
    pub client_id: String,
}

impl WithdrawOwn {
    /// Ends the client's wait or hold of the pod, or finds neither of its
    /// own.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let lock = txn.state.locks.get(&self.key);
        let hold = lock
            .and_then(|l| l.holder.as_ref())
            .filter(|h| h.pod.uid == self.pod_uid);
        let ignore_client = {
            // A deliberate bug for the checkers' "can fail" tests: withdraw
            // whichever client's hold or wait it is (the `Withdraw` of
            // format 7). Only with the `failpoints` feature and
            // FAILPOINTS=sm-withdraw-ignores-client=return.
            #[cfg(feature = "failpoints")]
            {
                fail::eval("sm-withdraw-ignores-client", |_| ()).is_some()
            }
            #[cfg(not(feature = "failpoints"))]
            {
                false
            }
        };
        if let Some(hold) = hold {
            if hold.client_id != self.client_id && !ignore_client {
                return Ok(Reply::WaitCancelled(CancelOutcome::TakenOver));
            }
            return Ok(give_back(txn, &self.key, ReleaseReason::Withdrawn));
        }
        if waits_for_another_client(txn, &self.key, &self.pod_uid, &self.client_id)
            && !ignore_client
        {
            return Ok(Reply::WaitCancelled(CancelOutcome::TakenOver));
        }
        end_wait(txn, self.key, self.pod_uid, WaitEndReason::Withdrawn)
    }
}

/// Whether `pod_uid` waits for `key` under another client than `client_id`.
fn waits_for_another_client(txn: &Txn<'_>, key: &LockKey, pod_uid: &str, client_id: &str) -> bool {
    txn.state.locks.get(key).is_some_and(|lock| {
        lock.waiters
            .iter()
            .any(|w| w.pod.uid == pod_uid && w.client_id != client_id)
    })
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
