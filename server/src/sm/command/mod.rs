//! Commands of the state machine, one file each. Every command validates
//! against the state first and only then mutates, so a command that returns
//! an error has changed nothing.

mod acquire;
mod assign;
mod audit;
mod batch;
mod cancel_wait;
mod force_release;
mod lease;
mod node_object;
mod reclaim;
mod release;
mod release_pin;
mod report_node;
mod report_pod;
mod revoke_pod;
mod sweep;

pub use acquire::{Acquire, TAKEOVER_FORMAT_VERSION};
pub use assign::Assign;
pub use audit::Audit;
pub use batch::{
    BATCH_FORMAT_VERSION, Batch, BatchItem, BatchRole, LOCKLESS_BATCH_FORMAT_VERSION,
    MAX_BATCH_ITEMS, SHARED_LOCK_BATCH_FORMAT_VERSION, batch_role, batchable_lock, ends_holds_of,
};
pub use cancel_wait::{
    ABANDON_WAIT_FORMAT_VERSION, AbandonWait, CancelOutcome, CancelWait, GIVE_BACK_FORMAT_VERSION,
    Withdraw, WithdrawOwn,
};
pub use force_release::ForceRelease;
pub use lease::{GrantLease, KeepAliveLease, RevokeLease};
pub use node_object::{ForNodeObjects, NODE_OBJECT_FORMAT_VERSION, NodeTaking, SeenNode};
pub use reclaim::{Reclaim, Reclaimed};
pub use release::Release;
pub use release_pin::{ReleasePin, ReleasePinIf};
pub use report_node::{
    NODE_GONE_UID_FORMAT_VERSION, NODE_REPLACED_FORMAT_VERSION, NODE_UID_FORMAT_VERSION, ReportNode,
};
pub use report_pod::ReportPod;
pub use revoke_pod::RevokePod;
#[cfg(any(test, feature = "testing"))]
pub use sweep::due_by_index_and_by_scan;
pub use sweep::{
    DEFERRED_GRANTS_FORMAT_VERSION, POD_CLEANUP_FORMAT_VERSION, Sweep, sweep_due, unreferenced_pods,
};

use serde::{Deserialize, Serialize};

use super::Txn;
use super::types::{Hold, Labels, LockKey, NodeState, Pin, PinKey, Pod};

/// A command in the log. Variants are only appended (on-disk format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Take a lock or join its queue.
    Acquire(Acquire),
    /// Release a hold by its holder.
    Release(Release),
    /// Release a hold by an operator.
    ForceRelease(ForceRelease),
    /// Leave a queue (the wait deadline passed on the serving replica).
    CancelWait(CancelWait),
    /// Revoke everything a pod UID holds or waits for.
    RevokePod(RevokePod),
    /// Grant a TTL lease.
    GrantLease(GrantLease),
    /// Refresh a TTL lease.
    KeepAliveLease(KeepAliveLease),
    /// Revoke a TTL lease.
    RevokeLease(RevokeLease),
    /// Leader housekeeping: expire waits, leases, holds and sessions that are
    /// due on committed time.
    Sweep(Sweep),
    /// Pin a workload member to a node.
    Assign(Assign),
    /// Release a pin.
    ReleasePin(ReleasePin),
    /// Report a node's state (bridge).
    ReportNode(ReportNode),
    /// Report a pod's phase (bridge).
    ReportPod(ReportPod),
    /// Record an administrative action in the history. (Appended last:
    /// variants are encoded by position in the log.)
    Audit(Audit),
    /// Several clients' acquires and releases in one entry (format 3), and
    /// their assignments and pod reports (format 11).
    Batch(Batch),
    /// Leave a queue whose caller went away, unless a retry took it up
    /// (format 6); give back a grant nobody will use (format 7).
    AbandonWait(AbandonWait),
    /// A caller no longer wants a lock for a pod: end its wait or give back
    /// its hold (format 7).
    Withdraw(Withdraw),
    /// Re-pin a pin with exactly the given labels, taking its exclusive
    /// labels from the set's other pins on its node (format 7).
    Reclaim(Reclaim),
    /// A client no longer wants a lock for a pod: end the wait or hold it
    /// queued or was granted, never one another client took over (format 9).
    WithdrawOwn(WithdrawOwn),
    /// Release a pin only while it carries the given labels (format 9).
    ReleasePinIf(ReleasePinIf),
    /// An acquire, assignment or reclaim for the node objects the caller
    /// saw, refused if another is registered under a name (format 10).
    ForNodeObjects(ForNodeObjects),
}

impl Command {
    /// Applies the command. Deterministic; errors leave the state unchanged.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        match self {
            Command::Acquire(c) => c.apply(txn),
            Command::Release(c) => c.apply(txn),
            Command::ForceRelease(c) => c.apply(txn),
            Command::CancelWait(c) => c.apply(txn),
            Command::RevokePod(c) => c.apply(txn),
            Command::GrantLease(c) => c.apply(txn),
            Command::KeepAliveLease(c) => c.apply(txn),
            Command::RevokeLease(c) => c.apply(txn),
            Command::Sweep(c) => c.apply(txn),
            Command::Assign(c) => c.apply(txn),
            Command::ReleasePin(c) => c.apply(txn),
            Command::ReportNode(c) => c.apply(txn),
            Command::ReportPod(c) => c.apply(txn),
            Command::Audit(c) => c.apply(txn),
            Command::AbandonWait(c) => c.apply(txn),
            Command::Withdraw(c) => c.apply(txn),
            Command::Reclaim(c) => c.apply(txn),
            Command::WithdrawOwn(c) => c.apply(txn),
            Command::ReleasePinIf(c) => c.apply(txn),
            Command::ForNodeObjects(c) => c.apply(txn),
            // `sm::apply` applies a batch item by item; a batch can only get
            // here as an item of another, which `Batch::check` refuses.
            Command::Batch(_) => Err(CommandError::InvalidBatch {
                reason: "a batch inside a batch".into(),
            }),
        }
    }

    /// The acquire this command makes, plain or for the node objects its
    /// caller saw.
    pub fn acquire(&self) -> Option<&Acquire> {
        match self {
            Command::Acquire(acquire)
            | Command::ForNodeObjects(ForNodeObjects {
                command: NodeTaking::Acquire(acquire),
                ..
            }) => Some(acquire),
            _ => None,
        }
    }

    /// The oldest format that can express this command: entries are written
    /// in it, so replicas of an older build read every entry that does not
    /// need the newer format (see `FORMAT_VERSION`).
    pub fn format_version(&self) -> u16 {
        match self {
            Command::Batch(batch) if batch.has_lockless() => LOCKLESS_BATCH_FORMAT_VERSION,
            Command::Batch(batch) if batch.has_node_object_check() => NODE_OBJECT_FORMAT_VERSION,
            Command::Batch(batch) if batch.has_acquire() => TAKEOVER_FORMAT_VERSION,
            Command::Batch(batch) if batch.shares_a_lock() => SHARED_LOCK_BATCH_FORMAT_VERSION,
            Command::Batch(_) => BATCH_FORMAT_VERSION,
            Command::Sweep(_) => POD_CLEANUP_FORMAT_VERSION,
            Command::ReportNode(report) if report.state == NodeState::Gone => {
                NODE_GONE_UID_FORMAT_VERSION
            }
            Command::ReportNode(_) => NODE_REPLACED_FORMAT_VERSION,
            Command::Withdraw(_) | Command::Reclaim(_) => GIVE_BACK_FORMAT_VERSION,
            // Another client's acquire takes a pod's hold or wait over, and
            // an abandoned wait ends only its own client's wait.
            Command::Acquire(_)
            | Command::AbandonWait(_)
            | Command::WithdrawOwn(_)
            | Command::ReleasePinIf(_) => TAKEOVER_FORMAT_VERSION,
            Command::ForNodeObjects(_) => NODE_OBJECT_FORMAT_VERSION,
            _ => 2,
        }
    }

    /// The oldest format this command can be written in at all, applying as
    /// a build of that format applies it: a batch needs 3 (4 when it names
    /// a lock twice, 11 when an item names no lock), an abandoned wait 6 (it is sent only once every member
    /// reads 6; in 6 it keeps a grant that raced it), a withdrawal 7 (it is
    /// sent only once every member reads 7); every other command, a sweep and a node report included,
    /// has a format-2 form. While a member is known to read only
    /// older formats than an entry's, the leader writes the entry in this
    /// one ([`crate::sm::Request::for_members`]).
    pub fn oldest_form(&self) -> u16 {
        match self {
            Command::Batch(batch) if batch.has_lockless() => LOCKLESS_BATCH_FORMAT_VERSION,
            Command::Batch(batch) if batch.has_node_object_check() => NODE_OBJECT_FORMAT_VERSION,
            Command::Batch(batch) if batch.shares_a_lock() => SHARED_LOCK_BATCH_FORMAT_VERSION,
            Command::Batch(_) => BATCH_FORMAT_VERSION,
            Command::AbandonWait(_) => ABANDON_WAIT_FORMAT_VERSION,
            Command::Withdraw(_) | Command::Reclaim(_) => GIVE_BACK_FORMAT_VERSION,
            Command::WithdrawOwn(_) | Command::ReleasePinIf(_) => TAKEOVER_FORMAT_VERSION,
            Command::ForNodeObjects(_) => NODE_OBJECT_FORMAT_VERSION,
            _ => 2,
        }
    }
}

/// What a command answers. Variants are only appended (on-disk format: they
/// are kept in the dedupe table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Entries without a command (blank, membership).
    Empty,
    /// The acquire holds the lock.
    Granted(Hold),
    /// The acquire waits at this 1-based position.
    Queued {
        /// Position in the queue.
        position: u32,
    },
    /// A release (holder or forced).
    Released {
        /// The hold that ended (None if the lock was already free: forced only).
        released: Option<Hold>,
        /// Who was granted in the same entry.
        next: Option<Hold>,
    },
    /// The answer to a cancel.
    WaitCancelled(CancelOutcome),
    /// What a pod or lease revoke did.
    Revoked {
        /// Locks whose hold ended.
        released: Vec<LockKey>,
        /// Locks whose queue lost a wait.
        dequeued: Vec<LockKey>,
        /// Holds granted to next waiters.
        granted: Vec<(LockKey, Hold)>,
    },
    /// A TTL lease (granted or kept alive); ttl 0 = the lease is gone.
    Lease {
        /// The lease.
        lease_id: u64,
        /// TTL restarted at this value.
        ttl_ms: u64,
    },
    /// What a sweep expired.
    Swept {
        /// Waits dropped at their deadline.
        waits: u32,
        /// TTL leases expired.
        leases: u32,
        /// Holds released by the hold timeout.
        holds: u32,
        /// Dedupe sessions evicted.
        sessions: u32,
        /// Pins whose lifetime passed.
        pins: u32,
        /// Holds kept past their timeout because their pod has not started.
        stuck: u32,
    },
    /// An assignment's pin (existing or new).
    Pinned {
        /// The pin.
        pin: Pin,
        /// False when the pin already existed.
        created: bool,
    },
    /// A pin release (None if there was no such pin).
    PinReleased {
        /// The pin that ended.
        pin: Option<Pin>,
    },
    /// What a node report did.
    NodeReported {
        /// Whether the registry changed.
        changed: bool,
        /// Pins released (node gone).
        pins_released: u32,
        /// Lock holds released (node gone).
        locks_released: u32,
    },
    /// The replies of a batch's items, in order.
    Batch(Vec<crate::sm::Response>),
    /// What a reclaim did (format 7).
    Reclaimed(Box<Reclaimed>),
}

/// Deterministic refusals: returned to the client, never a replica failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CommandError {
    /// A non-waiting acquire found the lock held.
    #[error("lock {key} is held by {holder} with token {token}; acquire with a wait to queue")]
    LockHeld {
        /// The lock.
        key: LockKey,
        /// Its holder.
        holder: Pod,
        /// The holder's token.
        token: u64,
    },
    /// Release by a pod that does not hold the lock.
    #[error("pod uid {pod_uid} does not hold lock {key}; {}", describe_holder(.current))]
    NotHolder {
        /// The lock.
        key: LockKey,
        /// Who asked.
        pod_uid: String,
        /// The current holder and token, if any.
        current: Option<(Pod, u64)>,
    },
    /// The holder presented a token that is not its current one.
    #[error("token {presented} for lock {key} is stale: the current token is {current}")]
    StaleToken {
        /// The lock.
        key: LockKey,
        /// What was presented.
        presented: u64,
        /// The current hold's token.
        current: u64,
    },
    /// The queue is at its limit.
    #[error("the queue of lock {key} is full ({limit} waiters); retry later")]
    QueueFull {
        /// The lock.
        key: LockKey,
        /// The limit.
        limit: u32,
    },
    /// The TTL lease does not exist (never granted, expired or revoked).
    #[error("lease {lease_id} does not exist (expired or revoked); grant a new lease")]
    LeaseNotFound {
        /// The lease.
        lease_id: u64,
    },
    /// A request whose sequence the client already reported done (or that
    /// fell out of the dedupe bound): applying it could apply it twice, so it
    /// is refused.
    #[error(
        "request {client_id}#{sequence} is below the client's acknowledged sequences (first kept: {oldest_kept}); its outcome is unknown, read the state before retrying with a new sequence"
    )]
    SequenceTooOld {
        /// The client.
        client_id: String,
        /// The sequence presented.
        sequence: u64,
        /// The oldest sequence still remembered.
        oldest_kept: u64,
    },
    /// No candidate node satisfies the assignment's rules.
    #[error("no candidate node fits pin {key}: {}", describe_refusals(.reasons))]
    NoCandidateFits {
        /// The pin.
        key: PinKey,
        /// Per candidate, why it was refused.
        reasons: Vec<(String, String)>,
    },
    /// A batch entry that breaks the rules of a batch: nothing in it was
    /// applied. Only a faulty leader proposes one.
    #[error("malformed batch entry, nothing in it was applied: {reason}")]
    InvalidBatch {
        /// What was wrong.
        reason: String,
    },
    /// A retried acquire whose hold has ended since it was granted: the
    /// stored "granted" answer would name a hold that no longer stands.
    /// Only answered to retries, never kept in the dedupe table.
    #[error(
        "the hold of lock {key} granted to pod uid {pod_uid} with token {token} by this request \
         has ended since (released, revoked or expired); acquire again with a new request"
    )]
    HoldEnded {
        /// The lock.
        key: LockKey,
        /// The pod the hold was granted to.
        pod_uid: String,
        /// The ended hold's token.
        token: u64,
    },
    /// A retried acquire whose wait has ended since it was queued, without
    /// a grant. Only answered to retries, never kept in the dedupe table.
    #[error(
        "the wait of pod uid {pod_uid} for lock {key} queued by this request has ended since \
         (deadline passed, cancelled or pod revoked); acquire again with a new request"
    )]
    WaitEnded {
        /// The lock.
        key: LockKey,
        /// The pod that waited.
        pod_uid: String,
    },
    /// A request whose id already answered a different command (format 6):
    /// a retry must resend the same command, and a fresh command needs a
    /// fresh sequence. Refused without applying anything; never kept in the
    /// dedupe table.
    #[error(
        "request {client_id}#{sequence} was already used for a different command; a retry must \
         resend the same command, and a new command needs a new sequence"
    )]
    RequestIdReused {
        /// The client.
        client_id: String,
        /// The sequence presented.
        sequence: u64,
    },
    /// A request that would open one client session more than the dedupe
    /// table keeps (format 6). Applies nothing; never kept.
    #[error(
        "the dedupe table holds its limit of {limit} client sessions; idle ones are evicted \
         after tetherd --session-idle. A caller that makes a new client per request should \
         reuse one"
    )]
    TooManySessions {
        /// The limit.
        limit: u32,
    },
    /// A node report (format 8), or an acquire, assignment or reclaim
    /// (format 10), naming another node object than the one registered
    /// under the name: refused without applying anything.
    #[error(
        "node {node} is registered as the node object with UID {registered_uid}, not \
         {reported_uid}; nothing was changed: report {registered_uid} gone first if that object \
         was deleted (the name re-created; until the bridge has, nothing can be taken for the \
         new object); otherwise {reported_uid} is an older object"
    )]
    NodeObjectMismatch {
        /// The node name.
        node: String,
        /// The UID Tether has registered under the name.
        registered_uid: String,
        /// The UID the report or the taking named.
        reported_uid: String,
    },
    /// A conditional pin release found the pin without the labels it
    /// named (format 9): someone made the pin again since; it is kept.
    #[error(
        "pin {key} carries labels {actual:?}, not {expected:?}: it was made again since (by a later \
         attempt); it is kept"
    )]
    PinLabelsDiffer {
        /// The pin.
        key: PinKey,
        /// What the release asked for.
        expected: Labels,
        /// What the pin carries.
        actual: Labels,
    },
    /// An acquire, assignment or reclaim for a node object that was
    /// reported gone (format 10): nothing was taken.
    #[error("node {node} with UID {uid} was deleted: nothing can be taken for it")]
    NodeObjectGone {
        /// The node name.
        node: String,
        /// The gone object's UID.
        uid: String,
    },
}

fn describe_refusals(reasons: &[(String, String)]) -> String {
    if reasons.is_empty() {
        return "no candidate nodes were given".to_string();
    }
    reasons
        .iter()
        .map(|(node, why)| format!("{node}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn describe_holder(current: &Option<(Pod, u64)>) -> String {
    match current {
        Some((pod, token)) => format!("it is held by {pod} with token {token}"),
        None => "the lock is free".to_string(),
    }
}
