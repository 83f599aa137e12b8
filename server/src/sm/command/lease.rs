//! TTL leases for clients that are not pods: grant, keepalive, revoke.

use serde::{Deserialize, Serialize};

use super::revoke_pod::revoke_matching;
use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{ReleaseReason, TtlLease, WaitEndReason};

/// Grant a lease with this TTL; its id is the entry's index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantLease {
    /// Time to live, ms (validated against the minimum at the API edge).
    pub ttl_ms: u64,
}

impl GrantLease {
    /// Always succeeds.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let lease_id = txn.index;
        let lease = TtlLease {
            id: lease_id,
            ttl_ms: self.ttl_ms,
            expires_at_ms: txn.now_ms.saturating_add(self.ttl_ms),
        };
        txn.state.leases.insert(lease_id, lease);
        txn.dirty.leases.insert(lease_id);
        txn.emit(EventKind::LeaseGranted {
            lease_id,
            ttl_ms: self.ttl_ms,
        });
        Ok(Reply::Lease {
            lease_id,
            ttl_ms: self.ttl_ms,
        })
    }
}

/// Restart a lease's TTL from this entry's committed time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepAliveLease {
    /// The lease.
    pub lease_id: u64,
}

impl KeepAliveLease {
    /// Answers TTL 0 when the lease no longer exists.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        let Some(lease) = txn.state.leases.get_mut(&self.lease_id) else {
            return Ok(Reply::Lease {
                lease_id: self.lease_id,
                ttl_ms: 0,
            });
        };
        lease.expires_at_ms = now.saturating_add(lease.ttl_ms);
        let ttl_ms = lease.ttl_ms;
        txn.dirty.leases.insert(self.lease_id);
        Ok(Reply::Lease {
            lease_id: self.lease_id,
            ttl_ms,
        })
    }
}

/// Revoke a lease and release what is attached to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeLease {
    /// The lease.
    pub lease_id: u64,
}

impl RevokeLease {
    /// Fails with `LeaseNotFound` if the lease is already gone.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        if !txn.state.leases.contains_key(&self.lease_id) {
            return Err(CommandError::LeaseNotFound {
                lease_id: self.lease_id,
            });
        }
        Ok(end_lease(txn, self.lease_id, false, true))
    }
}

/// Removes lease `lease_id` and everything attached to it; `grant_now` as
/// for [`revoke_matching`].
pub(crate) fn end_lease(txn: &mut Txn<'_>, lease_id: u64, expired: bool, grant_now: bool) -> Reply {
    txn.state.leases.remove(&lease_id);
    txn.dirty.leases.insert(lease_id);
    let release_reason = if expired {
        ReleaseReason::LeaseExpired { lease_id }
    } else {
        ReleaseReason::LeaseRevoked { lease_id }
    };
    let (released, dequeued, granted) = revoke_matching(
        txn,
        |_, lease| lease == lease_id,
        release_reason,
        WaitEndReason::LeaseEnded { lease_id },
        grant_now,
    );
    txn.emit(EventKind::LeaseEnded { lease_id, expired });
    Reply::Revoked {
        released,
        dequeued,
        granted,
    }
}
