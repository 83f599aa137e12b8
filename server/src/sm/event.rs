//! Events: what applying an entry emits. They feed in-process waiters (a
//! queued Acquire learns of its grant from `LockGranted`), the events column
//! family, and later the watch stream and history.

use serde::{Deserialize, Serialize};

use super::types::{
    Hold, LockKey, NodeInfo, Pin, PinKey, PinReleaseReason, Pod, PodPhase, ReleaseReason,
    WaitEndReason,
};

/// Position of an event: the log index of its entry and its order within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Revision {
    /// Log index of the entry.
    pub index: u64,
    /// Order within the entry, from 0.
    pub sub: u32,
}

/// One event with its revision and committed time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Where it sits in the event stream.
    pub revision: Revision,
    /// Committed time of its entry.
    pub time_ms: u64,
    /// What happened.
    pub kind: EventKind,
}

/// What happened. Variants are only appended (on-disk format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// A hold was granted (at once or to a waiter).
    LockGranted {
        /// The lock.
        key: LockKey,
        /// The new hold.
        hold: Hold,
    },
    /// An acquire joined the queue.
    LockQueued {
        /// The lock.
        key: LockKey,
        /// Who waits.
        pod: Pod,
        /// 1-based position.
        position: u32,
    },
    /// A hold ended.
    LockReleased {
        /// The lock.
        key: LockKey,
        /// The former holder.
        pod: Pod,
        /// Its token.
        token: u64,
        /// Why.
        reason: ReleaseReason,
    },
    /// A wait left the queue without a grant.
    WaitEnded {
        /// The lock.
        key: LockKey,
        /// Who waited.
        pod: Pod,
        /// Why.
        reason: WaitEndReason,
    },
    /// A pod's lease was revoked.
    PodRevoked {
        /// The pod UID.
        pod_uid: String,
        /// Why, as the revoker said.
        reason: String,
    },
    /// A TTL lease was granted.
    LeaseGranted {
        /// The lease.
        lease_id: u64,
        /// Its TTL.
        ttl_ms: u64,
    },
    /// A TTL lease ended.
    LeaseEnded {
        /// The lease.
        lease_id: u64,
        /// True if it expired, false if revoked.
        expired: bool,
    },
    /// A pin was created.
    PinAssigned {
        /// The pin.
        key: PinKey,
        /// Its state.
        pin: Pin,
    },
    /// A pin ended.
    PinReleased {
        /// The pin.
        key: PinKey,
        /// The node it pinned to.
        node: String,
        /// Why.
        reason: PinReleaseReason,
    },
    /// An existing pin got a new owning pod (the member's pod was recreated).
    PinOwnerChanged {
        /// The pin.
        key: PinKey,
        /// The new owner.
        pod_uid: String,
    },
    /// A node joined (or re-joined after being gone).
    NodeJoined {
        /// Node name.
        node: String,
        /// Its registry entry.
        info: NodeInfo,
    },
    /// A node became ready.
    NodeReady {
        /// Node name.
        node: String,
    },
    /// A node stopped being ready.
    NodeNotReady {
        /// Node name.
        node: String,
    },
    /// A node's labels or schedulability changed.
    NodeUpdated {
        /// Node name.
        node: String,
        /// Its registry entry.
        info: NodeInfo,
    },
    /// A node is gone; its pins and locks were released in the same entry.
    NodeGone {
        /// Node name.
        node: String,
    },
    /// A pod's phase was reported.
    PodReported {
        /// Pod UID.
        pod_uid: String,
        /// The phase.
        phase: PodPhase,
    },
    /// A hold passed its timeout while its pod is alive and not started: it
    /// is kept (handing over during a slow `Allocate` would swap devices
    /// between pods) and reported instead.
    LockStuck {
        /// The lock.
        key: LockKey,
        /// The holder.
        pod: Pod,
        /// Its token.
        token: u64,
        /// How long it has been held, ms.
        held_ms: u64,
    },
    /// An operator changed the cluster (membership, leadership, snapshot
    /// export). (Appended last: variants are encoded by position.)
    AdminAction {
        /// Who: certificate subject, `token:<name>` or `anonymous`.
        identity: String,
        /// What, e.g. `ChangeMembership`.
        action: String,
        /// Its arguments.
        detail: String,
    },
}
