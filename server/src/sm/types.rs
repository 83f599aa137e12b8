//! Domain types of the replicated state: what the Raft log and snapshots
//! store (serde + postcard), independent of the gRPC wire types.
//!
//! Enums here are on-disk formats: variants are only ever appended, never
//! reordered or removed (postcard encodes the variant index).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

/// A lock name: `{scope, name}`, e.g. `{gpu-bind, node-gpu-1}`. Ordered by
/// scope then name, which is also the order pods must take several locks in.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LockKey {
    /// Lock family, one per vendor (DNS-1123 label).
    pub scope: String,
    /// Usually the node name (DNS-1123 subdomain).
    pub name: String,
}

impl LockKey {
    /// Builds a key from its two parts.
    pub fn new(scope: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            scope: scope.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.name)
    }
}

/// The owner of a hold or wait: a pod, identified by UID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Pod {
    /// Kubernetes pod UID: the identity. A new pod with the same name has a
    /// new UID and is a different owner.
    pub uid: String,
    /// Namespace, a label for people.
    pub namespace: String,
    /// Pod name, a label for people.
    pub name: String,
}

impl fmt::Display for Pod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() && self.name.is_empty() {
            write!(f, "uid {}", self.uid)
        } else {
            write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
        }
    }
}

/// A granted hold on a lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// The pod holding the lock.
    pub pod: Pod,
    /// Fencing token: the log index of the entry that granted the hold.
    pub token: u64,
    /// Committed (leader-stamped) time of the grant, ms since the epoch.
    pub granted_at_ms: u64,
    /// Opaque bytes stored with the hold (e.g. the device plan).
    pub payload: Vec<u8>,
    /// The client that acquired on the pod's behalf.
    pub client_id: String,
    /// TTL lease the hold belongs to (0 = none).
    pub lease_id: u64,
}

/// A queued acquire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiter {
    /// The waiting pod.
    pub pod: Pod,
    /// Committed time the wait was queued.
    pub queued_at_ms: u64,
    /// Committed time after which the wait is dropped (0 = none).
    pub deadline_ms: u64,
    /// Payload that becomes the hold's payload when granted.
    pub payload: Vec<u8>,
    /// The client that queued the wait.
    pub client_id: String,
    /// TTL lease the wait belongs to (0 = none).
    pub lease_id: u64,
}

impl Waiter {
    /// Turns this wait into a hold granted by the entry at `token`.
    pub fn into_hold(self, token: u64, now_ms: u64) -> Hold {
        Hold {
            pod: self.pod,
            token,
            granted_at_ms: now_ms,
            payload: self.payload,
            client_id: self.client_id,
            lease_id: self.lease_id,
        }
    }
}

/// State of one lock. A lock that is free with nobody waiting is still kept
/// (with `last_token`) so that tokens never go backwards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Lock {
    /// The current hold, if any.
    pub holder: Option<Hold>,
    /// FIFO queue of waits; the front is granted next.
    pub waiters: VecDeque<Waiter>,
    /// Highest token ever granted on this lock.
    pub last_token: u64,
    /// Token of the hold for which `LockStuck` was last emitted (0 = none),
    /// so a stuck hold is reported once, not at every sweep.
    pub stuck_token: u64,
}

impl Lock {
    /// 1-based queue position of a pod UID, if it waits.
    pub fn position_of(&self, pod_uid: &str) -> Option<usize> {
        self.waiters
            .iter()
            .position(|w| w.pod.uid == pod_uid)
            .map(|i| i + 1)
    }
}

/// A TTL lease for clients that are not pods (lockctl, tests).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlLease {
    /// Lease id: the log index of the entry that granted it.
    pub id: u64,
    /// Time to live after each keepalive.
    pub ttl_ms: u64,
    /// Committed time at which the lease expires unless kept alive.
    pub expires_at_ms: u64,
}

/// Outcome a holder reports on release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Not said.
    Unspecified,
    /// The device plugin allocated the devices.
    Allocated,
    /// The bind or allocation failed (the scheduler's Unreserve path).
    Failed,
}

/// Why a hold ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReleaseReason {
    /// The holder released it.
    Released {
        /// What the holder reported.
        outcome: Outcome,
    },
    /// An operator forced it.
    Forced {
        /// Who.
        operator: String,
        /// Why.
        reason: String,
    },
    /// The pod's lease was revoked (pod deleted or terminal).
    PodRevoked {
        /// Why, as the revoker said.
        reason: String,
    },
    /// The TTL lease it was attached to expired.
    LeaseExpired {
        /// The lease.
        lease_id: u64,
    },
    /// The TTL lease it was attached to was revoked.
    LeaseRevoked {
        /// The lease.
        lease_id: u64,
    },
    /// The hold timeout passed.
    HoldTimeout {
        /// The timeout that applied, ms.
        timeout_ms: u64,
    },
    /// The node the lock is named after is gone.
    NodeGone,
    /// Granted to a wait whose caller had gone away, given back because
    /// nothing from that caller came after the grant (format 7,
    /// [`crate::sm::command::AbandonWait`]).
    Abandoned,
    /// The pod's caller withdrew its acquire after the grant (format 7,
    /// [`crate::sm::command::Withdraw`]).
    Withdrawn,
}

impl fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReleaseReason::Released { outcome } => write!(f, "released ({outcome:?})"),
            ReleaseReason::Forced { operator, reason } => {
                write!(f, "force-released by {operator}: {reason}")
            }
            ReleaseReason::PodRevoked { reason } => write!(f, "pod revoked: {reason}"),
            ReleaseReason::LeaseExpired { lease_id } => write!(f, "lease {lease_id} expired"),
            ReleaseReason::LeaseRevoked { lease_id } => write!(f, "lease {lease_id} revoked"),
            ReleaseReason::HoldTimeout { timeout_ms } => {
                write!(f, "hold timeout ({timeout_ms} ms) passed")
            }
            ReleaseReason::NodeGone => write!(f, "node gone"),
            ReleaseReason::Abandoned => {
                write!(f, "granted to a wait whose caller had gone away")
            }
            ReleaseReason::Withdrawn => write!(f, "withdrawn by its caller"),
        }
    }
}

/// Why a wait left the queue without a grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitEndReason {
    /// Its deadline passed.
    DeadlineExceeded,
    /// The pod's lease was revoked.
    PodRevoked {
        /// Why, as the revoker said.
        reason: String,
    },
    /// The TTL lease it was attached to ended.
    LeaseEnded {
        /// The lease.
        lease_id: u64,
    },
    /// The node the lock is named after is gone.
    NodeGone,
    /// The caller that queued it went away and did not come back for it
    /// (format 6, [`crate::sm::command::AbandonWait`]).
    Abandoned,
    /// Its caller withdrew the acquire (format 7,
    /// [`crate::sm::command::Withdraw`]).
    Withdrawn,
}

/// The identity of one client request, for exactly-once application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestId {
    /// Chosen by the client process.
    pub client_id: String,
    /// Increasing per client.
    pub sequence: u64,
    /// The lowest sequence the client has not yet seen an answer to: every
    /// lower one is done, so its stored response may be dropped (the Raft
    /// thesis' client sessions, section 6.3).
    pub first_incomplete: u64,
}

/// Per-client dedupe record: the responses to the client's requests that it
/// may still retry, so that a retry gets the stored answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClientSession {
    /// Responses by sequence, from `acknowledged_below` on.
    pub responses: BTreeMap<u64, StoredAnswer>,
    /// Sequences below this are done (the client said so, or they fell out
    /// of the [`SESSION_MAX_RESPONSES`] bound): a request with one is refused
    /// rather than applied a second time.
    pub acknowledged_below: u64,
    /// Committed time of the client's last request, for eviction.
    pub last_seen_ms: u64,
    /// Bytes the kept answers count for ([`answer_size`]), held within
    /// [`SESSION_MAX_ANSWER_BYTES`] from format 6.
    pub answer_bytes: u64,
}

/// Most responses kept per client: the bound on requests one client may have
/// in flight (unacknowledged) at once.
pub const SESSION_MAX_RESPONSES: usize = 4096;

/// Most bytes of answers kept per client (format 6): an answer can carry a
/// 64 KiB payload, so 4,096 of them could otherwise hold 256 MiB for one
/// client. Past it the oldest answers are dropped, as past the count bound:
/// a retry of one is then refused as too old, never applied twice.
pub const SESSION_MAX_ANSWER_BYTES: u64 = 4 << 20;

/// Most client sessions kept (format 6). A request that would open one more
/// is refused with `RESOURCE_EXHAUSTED` and applies nothing; idle sessions
/// are evicted by the sweep (`--session-idle`). Each `Client` is one session,
/// so this is far above any real deployment (a device plugin per node, a few
/// schedulers and bridges) and stops only a caller that opens one per
/// request.
pub const MAX_SESSIONS: usize = 65_536;

/// Bytes one kept answer counts for: its result's encoding and a fixed 24
/// for the rest (sequence, fingerprint, index), which do not change while it
/// is kept.
pub fn answer_size(answer: &StoredAnswer) -> u64 {
    let result =
        postcard::serialize_with_flavor(&answer.result, postcard::ser_flavors::Size::default())
            .expect("an answer always encodes");
    result as u64 + 24
}

impl ClientSession {
    /// Keeps `answer` for `sequence`.
    pub fn keep(&mut self, sequence: u64, answer: StoredAnswer) {
        self.answer_bytes += answer_size(&answer);
        if let Some(replaced) = self.responses.insert(sequence, answer) {
            self.answer_bytes -= answer_size(&replaced);
        }
    }

    /// Raises the floor to `floor` (if higher) and forgets the answers below.
    pub fn forget_below(&mut self, floor: u64) {
        self.acknowledged_below = self.acknowledged_below.max(floor);
        let kept = self.responses.split_off(&self.acknowledged_below);
        for forgotten in std::mem::replace(&mut self.responses, kept).values() {
            self.answer_bytes -= answer_size(forgotten);
        }
    }

    /// Forgets the oldest answers, raising the floor past them, while more
    /// than `max_count` are kept, or (with `max_bytes`) while they count for
    /// more than `max_bytes` and more than one is kept.
    pub fn bound(&mut self, max_count: usize, max_bytes: Option<u64>) {
        while self.responses.len() > max_count
            || max_bytes.is_some_and(|max| self.answer_bytes > max && self.responses.len() > 1)
        {
            let (oldest, forgotten) = self.responses.pop_first().expect("non-empty");
            self.answer_bytes -= answer_size(&forgotten);
            self.acknowledged_below = oldest + 1;
        }
    }

    /// The lowest sequence this session has neither answered nor put below
    /// its floor: how far the client is known to have got.
    pub fn next_unseen(&self) -> u64 {
        self.responses
            .last_key_value()
            .map_or(self.acknowledged_below, |(sequence, _)| sequence + 1)
            .max(self.acknowledged_below)
    }
}

/// One kept answer of a client session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAnswer {
    /// What the command answered when it applied.
    pub result: crate::sm::CommandResult,
    /// [`command_fingerprint`] of the command that answered, so that a
    /// request reusing the id for another command is refused rather than
    /// given this answer. `None` for answers of entries older than format 6
    /// ([`crate::sm::SESSION_BINDING_FORMAT_VERSION`]), which are answered
    /// as they were then.
    pub fingerprint: Option<u64>,
    /// Log index of the latest entry that answered this request: its first
    /// application, or a retry of it (from format 6; 0 in answers kept
    /// before). A queued acquire whose caller went away is given up only if
    /// no retry has answered it since ([`crate::sm::command::AbandonWait`]).
    pub answered_at: u64,
}

/// A command's fingerprint: the first 8 bytes of the SHA-256 of its log
/// encoding. A collision-resistant hash, so not even a caller who chooses
/// both commands can make two different ones share a fingerprint; 8 bytes
/// because only commands under one request id are ever compared.
pub fn command_fingerprint(command: &crate::sm::Command) -> u64 {
    let bytes = postcard::to_stdvec(command).expect("a command always encodes");
    let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_ref()[..8]);
    u64::from_be_bytes(first)
}

/// A pin's name: `{set, member}`, e.g. `{slurm/nodeset-a, "3"}`. Members are
/// strings and gaps are normal.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PinKey {
    /// The workload (e.g. a NodeSet), may contain '/'.
    pub set: String,
    /// The member within it (e.g. an ordinal).
    pub member: String,
}

impl PinKey {
    /// Builds a key from its two parts.
    pub fn new(set: impl Into<String>, member: impl Into<String>) -> Self {
        Self {
            set: set.into(),
            member: member.into(),
        }
    }
}

impl fmt::Display for PinKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.set, self.member)
    }
}

/// What Tether knows of a pin's owning pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnerState {
    /// Nothing reported (no bridge, or not yet).
    Unknown,
    /// Alive, containers not started.
    Starting,
    /// Running: the lifetime countdown is paused.
    Running,
    /// Terminal or gone: the lifetime countdown runs from `last_running_at_ms`.
    Stopped,
}

/// A pin's labels: key/value pairs sorted by key, each key once.
///
/// A sorted list rather than a `BTreeMap` because a pin has one or two
/// labels and a `BTreeMap` allocates a whole node (about 0.5 KiB) for its
/// first entry: at 100k pins the maps alone were ~50 MB of the scale run's
/// heap. Encoded exactly as a map (the same bytes as the `BTreeMap` it
/// replaced), so logs and snapshots are unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Labels(Vec<(String, String)>);

impl Labels {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&String> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|i| &self.0[i].1)
    }

    /// The pairs, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        // A BTreeMap iterates sorted by key, without repeats.
        let mut pairs: Vec<(String, String)> = map.into_iter().collect();
        pairs.shrink_to_fit();
        Labels(pairs)
    }
}

impl Serialize for Labels {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(deserializer).map(Labels::from)
    }
}

/// A pod-to-node pin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// The node the member is pinned to.
    pub node: String,
    /// Committed time of the assignment.
    pub pinned_at_ms: u64,
    /// The current owning pod (may change across pod restarts; empty = none).
    pub pod_uid: String,
    /// Labels, matched by affinity terms of later assignments.
    pub labels: Labels,
    /// How long the pin outlives its stopped pod; 0 = permanent.
    pub lifetime_ms: u64,
    /// Committed time the owner was last seen running (or stopped).
    pub last_running_at_ms: u64,
    /// What is known of the owner.
    pub owner: OwnerState,
}

/// A node as the bridge reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Kubernetes node UID.
    pub uid: String,
    /// Node labels (topology for affinity).
    pub labels: BTreeMap<String, String>,
    /// Ready condition.
    pub ready: bool,
    /// `spec.unschedulable` (cordoned).
    pub unschedulable: bool,
    /// Committed time it joined.
    pub joined_at_ms: u64,
    /// Set when the node is gone: kept as a tombstone for a while so a late
    /// assignment cannot pin to it.
    pub gone_at_ms: Option<u64>,
}

/// A node report's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    /// Exists (created or first seen).
    Joined,
    /// Ready condition true.
    Ready,
    /// Ready condition false or unknown.
    NotReady,
    /// Deleted (NotFound after a list).
    Gone,
}

/// A pod report's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodPhase {
    /// Alive, containers not started (e.g. waiting for `Allocate`).
    Starting,
    /// Containers started.
    Running,
    /// Succeeded or Failed.
    Terminal,
    /// Deleted.
    Gone,
}

/// Why a pin ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PinReleaseReason {
    /// Released by a client.
    Released {
        /// Why, as the client said.
        reason: String,
    },
    /// Its node is gone.
    NodeGone,
    /// Its lifetime passed after the owner stopped.
    Expired {
        /// The lifetime.
        lifetime_ms: u64,
    },
}
