//! `Release`: the holder gives the lock up; the head of the queue is granted
//! in the same entry.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{LockKey, Outcome, ReleaseReason};

/// Release `key` held by `pod_uid` with `token`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    /// The lock.
    pub key: LockKey,
    /// The holder's pod UID.
    pub pod_uid: String,
    /// The holder's fencing token.
    pub token: u64,
    /// What the holder reports.
    pub outcome: Outcome,
}

impl Release {
    /// Refuses a pod that does not hold the lock (naming the holder and its
    /// token) and a stale token of the holding pod.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let holder = txn
            .state
            .locks
            .get(&self.key)
            .and_then(|l| l.holder.as_ref());
        match holder {
            None => {
                return Err(CommandError::NotHolder {
                    key: self.key,
                    pod_uid: self.pod_uid,
                    current: None,
                });
            }
            Some(hold) if hold.pod.uid != self.pod_uid => {
                return Err(CommandError::NotHolder {
                    key: self.key,
                    pod_uid: self.pod_uid,
                    current: Some((hold.pod.clone(), hold.token)),
                });
            }
            Some(hold) if hold.token != self.token => {
                return Err(CommandError::StaleToken {
                    key: self.key,
                    presented: self.token,
                    current: hold.token,
                });
            }
            Some(_) => {}
        }
        let reason = ReleaseReason::Released {
            outcome: self.outcome,
        };
        let (released, next) = txn.release_and_hand_over(&self.key, reason);
        Ok(Reply::Released { released, next })
    }
}
