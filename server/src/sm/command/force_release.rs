//! `ForceRelease`: an operator ends a hold, audited with who and why.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{LockKey, ReleaseReason};

/// Release whatever holds `key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForceRelease {
    /// The lock.
    pub key: LockKey,
    /// Who forces it (kept in the event).
    pub operator: String,
    /// Why (kept in the event).
    pub reason: String,
}

impl ForceRelease {
    /// Releases the holder (if any) and grants the next waiter. Releasing a
    /// free lock is not an error: the answer says nothing was released.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        if txn
            .state
            .locks
            .get(&self.key)
            .and_then(|l| l.holder.as_ref())
            .is_none()
        {
            return Ok(Reply::Released {
                released: None,
                next: None,
            });
        }
        let reason = ReleaseReason::Forced {
            operator: self.operator,
            reason: self.reason,
        };
        let (released, next) = txn.release_and_hand_over(&self.key, reason);
        Ok(Reply::Released { released, next })
    }
}
