//! `RevokePod`: the pod is gone or terminal; everything it holds or waits for
//! ends in this one entry, and next waiters are granted in the same entry.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{Hold, LockKey, OwnerState, ReleaseReason, WaitEndReason};

/// Revoke the pod lease of `pod_uid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokePod {
    /// The pod.
    pub pod_uid: String,
    /// Why (e.g. "pod deleted"), kept in the events.
    pub reason: String,
}

impl RevokePod {
    /// Idempotent: revoking a pod that holds nothing changes nothing.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        Ok(revoke_pod(txn, &self.pod_uid, &self.reason))
    }
}

/// Revokes the pod lease of `pod_uid`: ends its holds and waits (granting
/// next waiters) and starts the lifetime countdown of its pins.
pub(crate) fn revoke_pod(txn: &mut Txn<'_>, pod_uid: &str, reason: &str) -> Reply {
    let (released, dequeued, granted) = revoke_matching(
        txn,
        |uid, _lease| uid == pod_uid,
        ReleaseReason::PodRevoked {
            reason: reason.to_string(),
        },
        WaitEndReason::PodRevoked {
            reason: reason.to_string(),
        },
        true,
    );
    let pins_stopped = txn.set_pin_owner_state(pod_uid, OwnerState::Stopped);
    if !released.is_empty() || !dequeued.is_empty() || pins_stopped {
        txn.emit(EventKind::PodRevoked {
            pod_uid: pod_uid.to_string(),
            reason: reason.to_string(),
        });
    }
    Reply::Revoked {
        released,
        dequeued,
        granted,
    }
}

/// Ends every hold and wait whose `(pod_uid, lease_id)` matches: waits first
/// (so a released lock is not handed to another wait of the same owner), then
/// holds. With `grant_now`, each freed lock goes to its next waiter at once
/// (safe: that waiter is not this owner, so nothing later in this call ends
/// its hold) and the grants are returned; without, the locks are left to
/// [`Txn::grant_freed`], for a caller that ends several owners' holds.
pub(crate) fn revoke_matching(
    txn: &mut Txn<'_>,
    matches: impl Fn(&str, u64) -> bool,
    release_reason: ReleaseReason,
    wait_reason: WaitEndReason,
    grant_now: bool,
) -> (Vec<LockKey>, Vec<LockKey>, Vec<(LockKey, Hold)>) {
    let mut held = Vec::new();
    let mut waiting = Vec::new();
    for (key, lock) in &txn.state.locks {
        if lock
            .holder
            .as_ref()
            .is_some_and(|h| matches(&h.pod.uid, h.lease_id))
        {
            held.push(key.clone());
        }
        if lock.waiters.iter().any(|w| matches(&w.pod.uid, w.lease_id)) {
            waiting.push(key.clone());
        }
    }
    for key in &waiting {
        txn.remove_waiters(
            key,
            |w| matches(&w.pod.uid, w.lease_id),
            wait_reason.clone(),
        );
    }
    let mut granted = Vec::new();
    for key in &held {
        if !grant_now {
            txn.end_hold(key, release_reason.clone());
            continue;
        }
        let (_, next) = txn.release_and_hand_over(key, release_reason.clone());
        if let Some(hold) = next {
            granted.push((key.clone(), hold));
        }
    }
    (held, waiting, granted)
}
