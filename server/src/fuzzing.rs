//! Fuzz targets: each takes arbitrary bytes and must neither panic nor break
//! an invariant. They are called by the cargo-fuzz targets in `fuzz/`
//! (coverage-guided, nightly) and by `tether-fuzz` (a mutation fuzzer on
//! stable Rust that CI runs for a bounded time).
//!
//! - [`request`]: the first byte picks one of the 27 request messages;
//!   the rest is decoded as that protobuf message and, when it decodes, goes
//!   through the same validation as the gRPC handler. Decoded messages must
//!   re-encode to bytes that decode to the same message.
//! - [`stored`]: bytes read back from disk or a peer: a log entry, a
//!   snapshot, an event, and Raft messages. What decodes must re-encode to
//!   itself.
//! - [`commands`]: the bytes drive a sequence of commands (a small universe
//!   of locks, pods, nodes and pins, so they collide) through the state
//!   machine, checking after every entry that no lock has two owners, that
//!   tokens only grow, that waiters are granted in FIFO order, and that a
//!   second replica applying the same log ends in the same state, also
//!   after a snapshot round trip.

use std::collections::{BTreeMap, VecDeque};

use prost::Message;
use tether_proto as pb;

use crate::api::validate;
use crate::sm::affinity::{Affinity, AffinityTerm, LabelSelector};
use crate::sm::command::*;
use crate::sm::{
    Command, Event, EventKind, LockKey, NodeState, Outcome, PinKey, PodPhase, Request, RequestId,
    State, apply,
};
use crate::store::{SnapshotFile, decode, decode_entry, encode};

/// Names of the targets, for tools that run them by name.
pub const TARGETS: [&str; 3] = ["request", "stored", "commands"];

/// Runs target `name` on `data`. Panics on a finding. `Some(true)` when
/// the input was well-formed (it decoded), `None` for an unknown target.
pub fn run(name: &str, data: &[u8]) -> Option<bool> {
    match name {
        "request" => Some(request(data)),
        "stored" => Some(stored(data)),
        "commands" => Some(commands(data)),
        _ => None,
    }
}

/// Decodes `bytes` as `M`; when it decodes, checks the re-encoding and
/// hands the message to `check`.
fn decoded<M: Message + Default + PartialEq>(bytes: &[u8], check: impl FnOnce(&M)) -> bool {
    let Ok(message) = M::decode(bytes) else {
        return false;
    };
    let again = M::decode(message.encode_to_vec().as_slice())
        .expect("a message this build encoded decodes again");
    assert!(again == message, "protobuf re-encoding changed the message");
    check(&message);
    true
}

/// A client request through decoding and validation.
pub fn request(data: &[u8]) -> bool {
    let Some((&which, bytes)) = data.split_first() else {
        return false;
    };
    let limit = 64 * 1024;
    match which % 27 {
        0 => decoded::<pb::AcquireRequest>(bytes, |r| {
            let _ = validate::request_id(&crate::auth::Caller::anonymous(), r.request_id.as_ref());
            let _ = validate::lock_key(r.key.as_ref());
            if let Some(pod) = &r.pod {
                let _ = validate::pod(pod);
            }
            let _ = validate::payload(&r.payload, limit);
        }),
        1 => decoded::<pb::ReleaseRequest>(bytes, |r| {
            let _ = validate::request_id(&crate::auth::Caller::anonymous(), r.request_id.as_ref());
            let _ = validate::lock_key(r.key.as_ref());
            let _ = validate::pod_uid(&r.pod_uid);
        }),
        2 => decoded::<pb::HolderRequest>(bytes, |r| {
            let _ = validate::lock_key(r.key.as_ref());
            let _ = validate::pin_set(&r.claim_set);
        }),
        3 => decoded::<pb::GetLockRequest>(bytes, |r| {
            let _ = validate::lock_key(r.key.as_ref());
        }),
        4 => decoded::<pb::ListLocksRequest>(bytes, |_| {}),
        5 => decoded::<pb::ForceReleaseRequest>(bytes, |r| {
            let _ = validate::lock_key(r.key.as_ref());
            let _ = validate::text("operator", &r.operator, true);
            let _ = validate::text("reason", &r.reason, true);
        }),
        6 => decoded::<pb::AssignRequest>(bytes, |r| {
            let _ = validate::pin_key(r.key.as_ref());
            let _ = validate::candidates(&r.candidates);
            let _ = validate::labels("pin label", &r.labels, 64);
            let _ = validate::affinity(r.affinity.as_ref());
            let _ = validate::pod_uid(&r.pod_uid);
        }),
        7 => decoded::<pb::ReleasePinRequest>(bytes, |r| {
            let _ = validate::pin_key(r.key.as_ref());
            let _ = validate::text("reason", &r.reason, false);
        }),
        8 => decoded::<pb::GetPinRequest>(bytes, |r| {
            let _ = validate::pin_key(r.key.as_ref());
        }),
        9 => decoded::<pb::ListPinsRequest>(bytes, |_| {}),
        10 => decoded::<pb::RevokePodRequest>(bytes, |r| {
            let _ = validate::pod_uid(&r.pod_uid);
            let _ = validate::text("reason", &r.reason, false);
        }),
        11 => decoded::<pb::LeaseGrantRequest>(bytes, |_| {}),
        12 => decoded::<pb::LeaseKeepAliveRequest>(bytes, |_| {}),
        13 => decoded::<pb::LeaseRevokeRequest>(bytes, |_| {}),
        14 => decoded::<pb::ReportPodRequest>(bytes, |r| {
            let _ = validate::pod_uid(&r.pod_uid);
        }),
        15 => decoded::<pb::ReportNodeRequest>(bytes, |r| {
            let _ = validate::dns1123_subdomain("node name", &r.name);
            let _ = validate::labels("node label", &r.labels, 64);
        }),
        16 => decoded::<pb::WatchRequest>(bytes, |_| {}),
        17 => decoded::<pb::HistoryRequest>(bytes, |_| {}),
        18 => decoded::<pb::ChangeMembershipRequest>(bytes, |_| {}),
        19 => decoded::<pb::AddLearnerRequest>(bytes, |_| {}),
        20 => decoded::<pb::TransferLeaderRequest>(bytes, |_| {}),
        21 => decoded::<pb::StatusRequest>(bytes, |_| {}),
        22 => decoded::<pb::SnapshotRequest>(bytes, |_| {}),
        23 => decoded::<pb::ExportSnapshotRequest>(bytes, |_| {}),
        24 => decoded::<pb::RaftRequest>(bytes, |r| {
            // What the Raft service does with the bytes it carries.
            stored(&[[3].as_slice(), &r.data].concat());
        }),
        25 => decoded::<pb::WithdrawRequest>(bytes, |r| {
            let _ = validate::request_id(&crate::auth::Caller::anonymous(), r.request_id.as_ref());
            let _ = validate::lock_key(r.key.as_ref());
            let _ = validate::pod_uid(&r.pod_uid);
        }),
        _ => decoded::<pb::ReclaimRequest>(bytes, |r| {
            let _ = validate::request_id(&crate::auth::Caller::anonymous(), r.request_id.as_ref());
            let _ = validate::pin_key(r.key.as_ref());
            let _ = validate::dns1123_subdomain("node", &r.node);
            let _ = validate::pod_uid(&r.pod_uid);
            let _ = validate::labels("pin label", &r.labels, limit);
            let _ = validate::text("exclusive prefix", &r.exclusive_prefix, false);
        }),
    }
}

/// Checks that a value decoded from bytes encodes to bytes that decode to
/// the same value (what a replica writes back is what it read).
fn stable<T>(value: &T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let bytes = encode(value);
    let again: T = decode(&bytes).expect("what this build encoded decodes again");
    assert_eq!(
        format!("{again:?}"),
        format!("{value:?}"),
        "re-encoding changed a stored value"
    );
}

/// Bytes from disk or a peer.
pub fn stored(data: &[u8]) -> bool {
    let Some((&which, bytes)) = data.split_first() else {
        return false;
    };
    match which % 6 {
        0 => match decode_entry(bytes) {
            Ok(entry) => {
                stable(&entry);
                true
            }
            Err(_) => false,
        },
        1 => match SnapshotFile::decode(bytes) {
            Ok(file) => {
                stable(&file);
                true
            }
            Err(_) => false,
        },
        2 => match decode::<Event>(bytes) {
            Ok(event) => {
                stable(&event);
                true
            }
            Err(_) => false,
        },
        3 => match decode::<openraft::raft::AppendEntriesRequest<crate::raft::TypeConfig>>(bytes) {
            Ok(rpc) => {
                stable(&rpc);
                true
            }
            Err(_) => false,
        },
        4 => match crate::raft::network::decode_vote_request(bytes) {
            Ok(rpc) => {
                stable(&rpc);
                true
            }
            Err(_) => false,
        },
        _ => match decode::<
            openraft_legacy::network_v1::InstallSnapshotRequest<crate::raft::TypeConfig>,
        >(bytes)
        {
            Ok(rpc) => {
                stable(&rpc);
                true
            }
            Err(_) => false,
        },
    }
}

/// xorshift64*: small seeded pseudo-random numbers, so a seed replays the
/// same run (the state machine's property test, `tether-fuzz`). The seed
/// must not be 0.
///
/// Written here rather than taken from `rand` (which the chaos tests use):
/// this module is part of `tether-server`'s library, and `rand` would
/// enter `tetherd`'s dependency tree for a test helper of eight lines; and
/// the planted-bug tests run the property test from fixed seeds, whose
/// command sequences a new generator would change.
pub struct XorShift(pub u64);

impl XorShift {
    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// An index in `0..len`; 0 when `len` is 0.
    pub fn index(&mut self, len: usize) -> usize {
        if len == 0 {
            0
        } else {
            self.below(len as u64) as usize
        }
    }
}

/// Reads choices from the fuzz input; zeros once it runs out.
struct Choices<'a> {
    data: &'a [u8],
}

impl Choices<'_> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn below(&mut self, n: u8) -> u8 {
        self.byte() % n
    }

    fn exhausted(&self) -> bool {
        self.data.is_empty()
    }
}

const NODES: u8 = 4;

fn pod(uid: u8) -> crate::sm::Pod {
    crate::sm::Pod {
        uid: format!("p{uid}"),
        namespace: "ns".into(),
        name: format!("pod-{uid}"),
    }
}

fn next_command(c: &mut Choices<'_>, state: &State) -> Command {
    let lock = LockKey::new("gpu-bind", format!("n{}", c.below(3)));
    let uid = c.below(6);
    match c.below(17) {
        0..=3 => Command::Acquire(Acquire {
            key: lock,
            pod: pod(uid),
            payload: vec![uid; c.below(3) as usize],
            wait_ms: [0, 200, 5_000, 60_000][c.below(4) as usize],
            // Half of them on a live TTL lease, so that lease ends (several
            // in one sweep) end holds and waits of several owners.
            lease_id: match c.below(2) {
                0 => 0,
                _ => state
                    .leases
                    .keys()
                    .nth(usize::from(c.byte()) % state.leases.len().max(1))
                    .copied()
                    .unwrap_or(0),
            },
            client_id: format!("c{}", c.below(3)),
            queue_limit: 1 + u32::from(c.below(4)),
        }),
        4 | 5 => {
            let holder = state.locks.get(&lock).and_then(|l| l.holder.clone());
            let (pod_uid, token) = match (holder, c.below(4)) {
                (Some(h), 0..=2) => (h.pod.uid, h.token),
                (Some(h), _) => (h.pod.uid, h.token + 1),
                (None, _) => (format!("p{uid}"), u64::from(c.byte())),
            };
            Command::Release(Release {
                key: lock,
                pod_uid,
                token,
                outcome: [Outcome::Allocated, Outcome::Failed][c.below(2) as usize],
            })
        }
        6 => Command::RevokePod(RevokePod {
            pod_uid: format!("p{uid}"),
            reason: "fuzz".into(),
        }),
        7 => match c.below(4) {
            0 => Command::CancelWait(CancelWait {
                key: lock,
                pod_uid: format!("p{uid}"),
            }),
            1 => Command::AbandonWait(AbandonWait {
                key: lock,
                pod_uid: format!("p{uid}"),
                client_id: format!("c{}", c.below(3)),
                sequence: u64::from(c.byte()),
                answered_at: u64::from(c.byte()),
            }),
            // A caller that gave up: its wait ends or its hold is given back.
            2 => Command::Withdraw(Withdraw {
                key: lock,
                pod_uid: format!("p{uid}"),
            }),
            // The same, only for what this client queued or was granted.
            _ => Command::WithdrawOwn(WithdrawOwn {
                key: lock,
                pod_uid: format!("p{uid}"),
                client_id: format!("c{}", c.below(3)),
            }),
        },
        8 => Command::ForceRelease(ForceRelease {
            key: lock,
            operator: "fuzz".into(),
            reason: "fuzz".into(),
        }),
        9 | 10 => {
            let anti = AffinityTerm {
                selector: LabelSelector {
                    match_labels: BTreeMap::from([("app".into(), "spread".into())]),
                    ..Default::default()
                },
                topology_key: "zone".into(),
            };
            Command::Assign(Assign {
                key: PinKey::new("spread", format!("m{}", c.below(5))),
                candidates: (0..NODES).map(|i| format!("n{i}")).collect(),
                pod_uid: format!("p{uid}"),
                lifetime_ms: u64::from(c.below(3)) * 1000,
                labels: BTreeMap::from([("app".into(), "spread".into())]),
                affinity: Affinity {
                    required_anti: if c.below(2) == 0 { vec![anti] } else { vec![] },
                    ..Default::default()
                },
            })
        }
        11 => match c.below(2) {
            0 => Command::ReleasePin(ReleasePin {
                key: PinKey::new("spread", format!("m{}", c.below(5))),
                reason: "fuzz".into(),
            }),
            _ => Command::ReleasePinIf(ReleasePinIf {
                key: PinKey::new("spread", format!("m{}", c.below(5))),
                reason: "fuzz".into(),
                labels: BTreeMap::from([(
                    "app".to_string(),
                    ["spread", "other"][c.below(2) as usize].to_string(),
                )])
                .into(),
            }),
        },
        12 => {
            let node = c.below(NODES);
            Command::ReportNode(ReportNode {
                name: format!("n{node}"),
                uid: format!("uid-n{node}"),
                state: [
                    NodeState::Joined,
                    NodeState::Ready,
                    NodeState::NotReady,
                    NodeState::Gone,
                ][c.below(4) as usize],
                labels: Some(BTreeMap::from([("zone".into(), format!("z{}", node % 2))])),
                unschedulable: None,
            })
        }
        13 => Command::ReportPod(ReportPod {
            pod_uid: format!("p{uid}"),
            phase: [
                PodPhase::Starting,
                PodPhase::Running,
                PodPhase::Terminal,
                PodPhase::Gone,
            ][c.below(4) as usize],
        }),
        14 => match c.below(3) {
            0 => Command::GrantLease(GrantLease {
                ttl_ms: 1000 + u64::from(c.byte()) * 10,
            }),
            1 => Command::KeepAliveLease(KeepAliveLease {
                lease_id: u64::from(c.below(8)),
            }),
            _ => Command::RevokeLease(RevokeLease {
                lease_id: u64::from(c.below(8)),
            }),
        },
        16 => {
            // Acquires and releases on distinct locks, as a leader forms
            // them, and now and then assignments and pod reports and
            // revokes (format 11); now and then a malformed one (a lock
            // twice, or empty), which must be refused whole.
            let allow_repeats = c.below(8) == 0;
            let lockless = c.below(2) == 0;
            let mut items = Vec::new();
            let mut locks = std::collections::BTreeSet::new();
            for _ in 0..c.below(4) {
                let command = next_command(c, state);
                let joins = match batch_role(&command) {
                    Some(BatchRole::Lock(lock)) => locks.insert(lock.clone()) || allow_repeats,
                    Some(BatchRole::Lockless) => lockless,
                    None => false,
                };
                if joins {
                    items.push(BatchItem {
                        request_id: None,
                        command,
                    });
                }
            }
            Command::Batch(Batch { items })
        }
        _ => Command::Sweep(Sweep {
            leader_tenure_ms: u64::from(c.byte()) * 100,
            // Short timeouts too: holds due in the sweep that ends a lease.
            hold_timeout_ms: [1, 50, 3_000][c.below(3) as usize],
            scope_hold_timeout_ms: BTreeMap::new(),
            session_idle_ms: 60_000,
            node_tombstone_ms: 60_000,
        }),
    }
}

/// Lock invariants after an entry: a free lock has no waiters; no pod is
/// both holder and waiter or waits twice; the entry granted each lock at
/// most once, and every hold it granted still stands at its end (so no
/// client can be told "granted" for a hold the same entry ended); grants
/// follow the order waiters queued in and carry a token above every earlier
/// one of the lock.
pub fn check_lock_invariants(
    state: &State,
    new_events: &[Event],
    queues: &mut BTreeMap<LockKey, VecDeque<String>>,
    last_token: &mut BTreeMap<LockKey, u64>,
    context: &str,
) {
    for (key, lock) in &state.locks {
        assert!(
            lock.holder.is_some() || lock.waiters.is_empty(),
            "{context}: {key} free but has waiters"
        );
        let mut uids: Vec<_> = lock.waiters.iter().map(|w| w.pod.uid.clone()).collect();
        if let Some(h) = &lock.holder {
            uids.push(h.pod.uid.clone());
        }
        let total = uids.len();
        uids.sort();
        uids.dedup();
        assert_eq!(
            uids.len(),
            total,
            "{context}: {key} has a pod twice among holder and waiters"
        );
    }
    let mut granted_here = std::collections::BTreeSet::new();
    // Locks released because their node is gone, until that node's
    // `NodeGone` (emitted last): a grant in between hands a lock on a gone
    // node to a pod that must be scheduled elsewhere. (A later batch item
    // may take the lock again, for the node's next incarnation.)
    let mut released_as_gone = std::collections::BTreeSet::new();
    for event in new_events {
        match &event.kind {
            EventKind::LockReleased {
                key,
                reason: crate::sm::ReleaseReason::NodeGone,
                ..
            } => {
                released_as_gone.insert(key.clone());
            }
            EventKind::NodeGone { node } => released_as_gone.retain(|k| &k.name != node),
            EventKind::LockGranted { key, hold } => assert!(
                !released_as_gone.contains(key),
                "{context}: {key} granted to {} with token {} by the entry that released it because its node is gone",
                hold.pod,
                hold.token
            ),
            _ => {}
        }
        if let EventKind::LockGranted { key, hold } = &event.kind {
            assert!(
                granted_here.insert(key.clone()),
                "{context}: {key} granted twice in one entry (the second time to {} with token {})",
                hold.pod,
                hold.token
            );
            assert!(
                hold_stands(state, key, hold),
                "{context}: {key} granted to {} with token {} by an entry that also ended that hold",
                hold.pod,
                hold.token
            );
        }
    }
    for event in new_events {
        match &event.kind {
            EventKind::LockQueued { key, pod, .. } => queues
                .entry(key.clone())
                .or_default()
                .push_back(pod.uid.clone()),
            EventKind::WaitEnded { key, pod, .. } => queues
                .entry(key.clone())
                .or_default()
                .retain(|u| u != &pod.uid),
            EventKind::LockGranted { key, hold } => {
                let queue = queues.entry(key.clone()).or_default();
                if queue.contains(&hold.pod.uid) {
                    assert_eq!(
                        queue.front(),
                        Some(&hold.pod.uid),
                        "{context}: {key} granted out of FIFO order"
                    );
                    queue.pop_front();
                }
                let last = last_token.entry(key.clone()).or_default();
                assert!(
                    hold.token > *last,
                    "{context}: token {} not above {} on {key}",
                    hold.token,
                    last
                );
                *last = hold.token;
            }
            _ => {}
        }
    }
}

/// Whether `hold` is the current hold of `key` in `state`.
fn hold_stands(state: &State, key: &LockKey, hold: &crate::sm::Hold) -> bool {
    state
        .locks
        .get(key)
        .and_then(|l| l.holder.as_ref())
        .is_some_and(|h| h.token == hold.token && h.pod.uid == hold.pod.uid)
}

/// What a client is told it holds, it holds: a "granted" answer names a hold
/// that stands at the end of the entry, when the entry granted that hold (its
/// token is the entry's `index`) or answered nothing else. (A batch item may
/// be told of an older hold that a later item of the same entry releases:
/// in order, the hold stood when it was answered.)
pub fn check_granted_replies(
    state: &State,
    index: u64,
    command: &Command,
    response: &crate::sm::Response,
    context: &str,
) {
    let (answers, batched): (Vec<(&Command, &crate::sm::Response)>, bool) =
        match (command, &response.result) {
            (Command::Batch(batch), Ok(crate::sm::Reply::Batch(replies))) => (
                batch
                    .items
                    .iter()
                    .map(|i| &i.command)
                    .zip(replies)
                    .collect(),
                true,
            ),
            _ => (vec![(command, response)], false),
        };
    for (command, response) in answers {
        let (Command::Acquire(acquire), Ok(crate::sm::Reply::Granted(hold))) =
            (command, &response.result)
        else {
            continue;
        };
        if batched && hold.token != index {
            continue;
        }
        assert!(
            hold_stands(state, &acquire.key, hold),
            "{context}: an acquire of {} was answered granted with token {} (deduplicated: {}), \
             but that hold does not stand",
            acquire.key,
            hold.token,
            response.deduplicated
        );
    }
}

/// A command sequence through the state machine, with its invariants and
/// replica agreement checked.
pub fn commands(data: &[u8]) -> bool {
    let mut choices = Choices { data };
    let mut state = State::default();
    let mut log: Vec<Request> = Vec::new();
    let mut queues = BTreeMap::new();
    let mut last_token = BTreeMap::new();
    let mut now = 1_000_000u64;
    let mut snapshot: Option<(usize, Vec<u8>)> = None;
    while !choices.exhausted() && log.len() < 512 {
        now += u64::from(choices.byte()) * 8;
        let command = next_command(&mut choices, &state);
        let request_id = match choices.below(3) {
            0 => None,
            n => Some(RequestId {
                client_id: format!("c{n}"),
                sequence: log.len() as u64 + 1,
                first_incomplete: (log.len() as u64 + 1)
                    .saturating_sub(u64::from(choices.below(4))),
            }),
        };
        let request = Request::new(request_id, now, command);
        let index = log.len() as u64 + 1;
        let (response, events, _) = apply(&mut state, index, &request);
        check_granted_replies(
            &state,
            index,
            &request.command,
            &response,
            &format!("entry {index}"),
        );
        log.push(request);
        check_lock_invariants(
            &state,
            &events,
            &mut queues,
            &mut last_token,
            &format!("entry {index}"),
        );
        if snapshot.is_none() && choices.below(16) == 0 {
            snapshot = Some((log.len(), encode(&state)));
        }
    }
    // Another replica applying the same log agrees, from the start and
    // from the snapshot taken on the way.
    let mut replica = State::default();
    for (i, request) in log.iter().enumerate() {
        apply(&mut replica, i as u64 + 1, request);
    }
    assert_eq!(replica, state, "two replicas applying one log disagree");
    if let Some((at, bytes)) = snapshot {
        let mut restored: State = decode(&bytes).expect("a snapshot decodes");
        for (i, request) in log.iter().enumerate().skip(at) {
            apply(&mut restored, i as u64 + 1, request);
        }
        assert_eq!(
            restored, state,
            "a replica restored from a snapshot disagrees"
        );
    }
    true
}

/// Well-formed starting inputs for `target`: real encodings of every
/// request type, stored values and Raft messages, and command scripts.
/// `tether-fuzz --write-seeds` writes them into the corpus directory.
pub fn seed_inputs(target: &str) -> Vec<Vec<u8>> {
    match target {
        "request" => request_seeds(),
        "stored" => stored_seeds(),
        "commands" => (0u8..8)
            .map(|k| (0u8..=255).map(|b| b.wrapping_mul(k * 2 + 1)).collect())
            .collect(),
        _ => Vec::new(),
    }
}

fn tagged(tag: u8, message: &impl Message) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend(message.encode_to_vec());
    out
}

fn request_seeds() -> Vec<Vec<u8>> {
    let key = Some(pb::LockKey {
        scope: "gpu-bind".into(),
        name: "node-7".into(),
    });
    let pin_key = Some(pb::PinKey {
        set: "slurm".into(),
        member: "worker-0".into(),
    });
    let rid = Some(pb::RequestId {
        client_id: "scheduler-1".into(),
        sequence: 9,
        first_incomplete: 7,
    });
    let pod = Some(pb::Pod {
        uid: "6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f".into(),
        namespace: "ml".into(),
        name: "train-0".into(),
    });
    let term = pb::AffinityTerm {
        label_selector: Some(pb::LabelSelector {
            match_labels: [("app".to_string(), "slurm".to_string())].into(),
            match_expressions: vec![pb::LabelRequirement {
                key: "tier".into(),
                operator: "In".into(),
                values: vec!["a".into(), "b".into()],
            }],
        }),
        topology_key: "kubernetes.io/hostname".into(),
    };
    vec![
        tagged(
            0,
            &pb::AcquireRequest {
                request_id: rid.clone(),
                key: key.clone(),
                pod: pod.clone(),
                payload: b"gpu-0,gpu-1".to_vec(),
                wait_timeout_ms: 5000,
                lease_id: 3,
                node_uid: "0b7e4c1a-node".into(),
            },
        ),
        tagged(
            1,
            &pb::ReleaseRequest {
                request_id: rid.clone(),
                key: key.clone(),
                pod_uid: "6f1c2d9e".into(),
                token: 42,
                ..Default::default()
            },
        ),
        tagged(
            2,
            &pb::HolderRequest {
                key: key.clone(),
                claim_set: String::new(),
                unconfirmed: false,
            },
        ),
        tagged(3, &pb::GetLockRequest { key: key.clone() }),
        tagged(
            4,
            &pb::ListLocksRequest {
                scope: "gpu-bind".into(),
            },
        ),
        tagged(
            5,
            &pb::ForceReleaseRequest {
                request_id: rid.clone(),
                key: key.clone(),
                operator: "oncall".into(),
                reason: "stuck".into(),
            },
        ),
        tagged(
            6,
            &pb::AssignRequest {
                request_id: rid.clone(),
                key: pin_key.clone(),
                candidates: vec!["node-1".into(), "node-2".into()],
                pod_uid: "u1".into(),
                lifetime_ms: 60_000,
                labels: [("app".to_string(), "slurm".to_string())].into(),
                affinity: Some(pb::Affinity {
                    required_anti: vec![term.clone()],
                    preferred: vec![pb::WeightedAffinityTerm {
                        weight: 10,
                        term: Some(term),
                    }],
                    ..Default::default()
                }),
                candidate_uids: [("node-2".to_string(), "0b7e4c1a-node".to_string())].into(),
            },
        ),
        tagged(
            7,
            &pb::ReleasePinRequest {
                request_id: rid.clone(),
                key: pin_key.clone(),
                reason: "done".into(),
                if_labels: [("app".to_string(), "slurm".to_string())].into(),
            },
        ),
        tagged(8, &pb::GetPinRequest { key: pin_key }),
        tagged(
            9,
            &pb::ListPinsRequest {
                set: "slurm".into(),
                node: "node-1".into(),
            },
        ),
        tagged(
            10,
            &pb::RevokePodRequest {
                request_id: rid.clone(),
                pod_uid: "u1".into(),
                reason: "deleted".into(),
            },
        ),
        tagged(
            11,
            &pb::LeaseGrantRequest {
                request_id: rid.clone(),
                ttl_ms: 10_000,
            },
        ),
        tagged(12, &pb::LeaseKeepAliveRequest { lease_id: 3 }),
        tagged(
            13,
            &pb::LeaseRevokeRequest {
                request_id: rid.clone(),
                lease_id: 3,
            },
        ),
        tagged(
            14,
            &pb::ReportPodRequest {
                request_id: rid.clone(),
                pod_uid: "u1".into(),
                phase: 2,
            },
        ),
        tagged(
            15,
            &pb::ReportNodeRequest {
                request_id: rid,
                name: "node-1".into(),
                uid: "n1".into(),
                state: 2,
                labels: [("zone".to_string(), "a".to_string())].into(),
                set_labels: true,
                unschedulable: Some(false),
            },
        ),
        tagged(
            16,
            &pb::WatchRequest {
                start: Some(pb::Revision { index: 5, sub: 1 }),
                kinds: vec!["LockGranted".into()],
                key_prefix: "lock/".into(),
            },
        ),
        tagged(
            17,
            &pb::HistoryRequest {
                key: "lock/gpu-bind/node-7".into(),
                limit: 10,
                ..Default::default()
            },
        ),
        tagged(
            18,
            &pb::ChangeMembershipRequest {
                voters: vec![1, 2, 3],
                ..Default::default()
            },
        ),
        tagged(
            19,
            &pb::AddLearnerRequest {
                node_id: 4,
                addr: "tether-3.tether-peers:7420".into(),
                blocking: true,
            },
        ),
        tagged(20, &pb::TransferLeaderRequest { target_node_id: 2 }),
        tagged(21, &pb::StatusRequest {}),
        tagged(22, &pb::SnapshotRequest {}),
        tagged(23, &pb::ExportSnapshotRequest {}),
        tagged(
            24,
            &pb::RaftRequest {
                data: encode(
                    &openraft::raft::VoteRequest::<crate::raft::TypeConfig>::new(
                        openraft::Vote::new(3, 2),
                        None,
                    ),
                ),
            },
        ),
        tagged(
            25,
            &pb::WithdrawRequest {
                request_id: Some(pb::RequestId {
                    client_id: "scheduler-1".into(),
                    sequence: 10,
                    first_incomplete: 7,
                }),
                key: key.clone(),
                pod_uid: "6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f".into(),
            },
        ),
        tagged(
            26,
            &pb::ReclaimRequest {
                request_id: Some(pb::RequestId {
                    client_id: "plugin-1".into(),
                    sequence: 4,
                    first_incomplete: 4,
                }),
                key: Some(pb::PinKey {
                    set: "gpu-devices".into(),
                    member: "6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f".into(),
                }),
                node: "node-7".into(),
                pod_uid: "6f1c2d9e-3b7a-4c1e-9f0a-2b5d8e7c1a4f".into(),
                lifetime_ms: 1000,
                labels: [("devices.tether.io/gpu1".to_string(), "held".to_string())].into(),
                exclusive_prefix: "devices.tether.io/".into(),
                node_uid: "0b7e4c1a-node".into(),
            },
        ),
    ]
}

fn stored_seeds() -> Vec<Vec<u8>> {
    // A short realistic history: its entries, events and final state.
    let script: Vec<u8> = (0u8..=255).map(|b| b.wrapping_mul(37)).collect();
    let mut choices = Choices { data: &script };
    let mut state = State::default();
    let mut out = Vec::new();
    let mut entries = Vec::new();
    for index in 1..=24u64 {
        let command = next_command(&mut choices, &state);
        let request = Request::new(None, 1_000_000 + index * 100, command);
        let (_, events, _) = apply(&mut state, index, &request);
        let entry = crate::raft::Entry {
            log_id: crate::raft::log_id(1, 1, index),
            payload: openraft::EntryPayload::Normal(request),
        };
        out.push([vec![0], encode(&entry)].concat());
        for event in events.iter().take(2) {
            out.push([vec![2], encode(event)].concat());
        }
        entries.push(entry);
    }
    let nodes: BTreeMap<u64, openraft::BasicNode> =
        [(1u64, openraft::BasicNode::new("127.0.0.1:7420"))].into();
    let voters: std::collections::BTreeSet<u64> = [1u64].into();
    let membership =
        openraft::Membership::new(vec![voters], nodes).expect("one voter, who is a node");
    let last = entries.last().map(|e| e.log_id);
    let file = SnapshotFile {
        format_version: crate::sm::SNAPSHOT_FORMAT_VERSION,
        last_applied: last,
        membership: openraft::StoredMembership::new(last, membership),
        state,
    };
    out.push([vec![1], encode(&file)].concat());
    let vote = openraft::Vote::new(2, 1);
    let append: openraft::raft::AppendEntriesRequest<crate::raft::TypeConfig> =
        openraft::raft::AppendEntriesRequest {
            vote,
            prev_log_id: entries.first().map(|e| e.log_id),
            leader_commit: last,
            entries: entries.into_iter().skip(1).take(4).collect(),
        };
    out.push([vec![3], encode(&append)].concat());
    let ask = openraft::raft::VoteRequest::<crate::raft::TypeConfig>::new(vote, last);
    out.push([vec![4], encode(&ask)].concat());
    let install: openraft_legacy::network_v1::InstallSnapshotRequest<crate::raft::TypeConfig> =
        openraft_legacy::network_v1::InstallSnapshotRequest {
            vote,
            meta: openraft_legacy::network_v1::SnapshotMeta {
                last_log_id: last,
                last_membership: openraft::StoredMembership::default(),
                snapshot_id: "1-24".into(),
            },
            offset: 0,
            // The first chunk of a snapshot stream (the whole state when short).
            data: encode(&file.state).into_iter().take(64).collect(),
            done: false,
        };
    out.push([vec![5], encode(&install)].concat());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds are built by running commands (their shape follows the
    /// generator), outside the fuzzer's panic catching: they must build, be
    /// well-formed, and pass their target.
    #[test]
    fn every_target_s_seed_inputs_build_decode_and_pass() {
        for target in ["request", "stored", "commands"] {
            let seeds = seed_inputs(target);
            assert!(!seeds.is_empty(), "{target}: no seeds");
            for seed in &seeds {
                assert_eq!(run(target, seed), Some(true), "{target}: a seed is refused");
            }
        }
    }
}
