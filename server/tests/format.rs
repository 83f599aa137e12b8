//! On-disk formats outlive a release: bytes written by each format version
//! (kept in `tests/fixtures/format-v*/`) must still decode to the same values,
//! and data from a newer format must be refused with a clear error.
//!
//! To add fixtures for a new format version, bump `FORMAT_VERSION`, add a
//! directory, and run with `TETHER_WRITE_FIXTURES=1` once; never rewrite an
//! existing version's files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use openraft::{BasicNode, EntryPayload, Membership};
use tether_server::raft::{Entry, LogId, StoredMembership};
use tether_server::sm::affinity::*;
use tether_server::sm::command::*;
use tether_server::sm::*;
use tether_server::store::{SnapshotFile, decode, decode_entry, encode};

fn fixture(version: u16, name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/format-v{version}/{name}"))
}

fn log_id(term: u64, index: u64) -> LogId {
    tether_server::raft::log_id(term, 1, index)
}

fn pod(uid: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "ml".into(),
        name: format!("train-{uid}"),
    }
}

fn key() -> LockKey {
    LockKey::new("gpu-bind", "node-7")
}

fn pin_key() -> PinKey {
    PinKey::new("slurm/nodeset-a", "3")
}

fn pin() -> Pin {
    Pin {
        node: "node-7".into(),
        pinned_at_ms: 1_790_000_000_000,
        pod_uid: "a".into(),
        labels: BTreeMap::from([("app".into(), "slurmd".into())]).into(),
        lifetime_ms: 600_000,
        last_running_at_ms: 1_790_000_000_001,
        owner: OwnerState::Running,
    }
}

fn node_info() -> NodeInfo {
    NodeInfo {
        uid: "n-uid".into(),
        labels: BTreeMap::from([("zone".into(), "a".into())]),
        ready: true,
        unschedulable: false,
        joined_at_ms: 1_790_000_000_000,
        gone_at_ms: None,
    }
}

fn membership() -> Membership<u64, BasicNode> {
    let nodes = BTreeMap::from([(
        1,
        BasicNode {
            addr: "127.0.0.1:7420".into(),
        },
    )]);
    Membership::new(vec![BTreeSet::from([1])], nodes).expect("one voter, who is a node")
}

/// One entry of every kind that format 1 knows.
fn v1_entries() -> Vec<Entry> {
    let rid = Some(RequestId {
        client_id: "client-1".into(),
        sequence: 3,
        first_incomplete: 2,
    });
    let commands = vec![
        Command::Acquire(Acquire {
            key: key(),
            pod: pod("a"),
            payload: b"gpu0".to_vec(),
            wait_ms: 5000,
            lease_id: 0,
            client_id: "client-1".into(),
            queue_limit: 1024,
        }),
        Command::Release(Release {
            key: key(),
            pod_uid: "a".into(),
            token: 3,
            outcome: Outcome::Allocated,
        }),
        Command::ForceRelease(ForceRelease {
            key: key(),
            operator: "ops".into(),
            reason: "stuck".into(),
        }),
        Command::CancelWait(CancelWait {
            key: key(),
            pod_uid: "b".into(),
        }),
        Command::RevokePod(RevokePod {
            pod_uid: "a".into(),
            reason: "deleted".into(),
        }),
        Command::GrantLease(GrantLease { ttl_ms: 10_000 }),
        Command::KeepAliveLease(KeepAliveLease { lease_id: 9 }),
        Command::RevokeLease(RevokeLease { lease_id: 9 }),
        Command::Sweep(Sweep {
            leader_tenure_ms: 1,
            hold_timeout_ms: 300_000,
            scope_hold_timeout_ms: BTreeMap::from([("gpu-bind".into(), 120_000)]),
            session_idle_ms: 3_600_000,
            node_tombstone_ms: 86_400_000,
        }),
        Command::Assign(Assign {
            key: pin_key(),
            candidates: vec!["node-7".into(), "node-8".into()],
            pod_uid: "a".into(),
            lifetime_ms: 600_000,
            labels: BTreeMap::from([("app".into(), "slurmd".into())]),
            affinity: Affinity {
                required: vec![],
                required_anti: vec![AffinityTerm {
                    selector: LabelSelector {
                        match_labels: BTreeMap::from([("app".into(), "slurmd".into())]),
                        match_expressions: vec![Requirement {
                            key: "tier".into(),
                            op: SelectorOp::In,
                            values: vec!["a".into()],
                        }],
                    },
                    topology_key: "zone".into(),
                }],
                preferred: vec![],
                preferred_anti: vec![],
            },
        }),
        Command::ReleasePin(ReleasePin {
            key: pin_key(),
            reason: "scale-in".into(),
        }),
        Command::ReportNode(ReportNode {
            name: "node-7".into(),
            uid: "n-uid".into(),
            state: NodeState::Ready,
            labels: Some(BTreeMap::from([("zone".into(), "a".into())])),
            unschedulable: Some(false),
        }),
        Command::ReportPod(ReportPod {
            pod_uid: "a".into(),
            phase: PodPhase::Running,
        }),
    ];
    let mut entries = vec![
        Entry {
            log_id: log_id(1, 1),
            payload: EntryPayload::Blank,
        },
        Entry {
            log_id: log_id(1, 2),
            payload: EntryPayload::Membership(membership()),
        },
    ];
    for (i, command) in commands.into_iter().enumerate() {
        let request = Request {
            format_version: 1,
            request_id: rid.clone(),
            leader_time_ms: 1_790_000_000_000 + i as u64,
            command,
        };
        entries.push(Entry {
            log_id: log_id(1, 3 + i as u64),
            payload: EntryPayload::Normal(request),
        });
    }
    entries
}

fn v1_snapshot() -> SnapshotFile {
    let mut state = State::default();
    let hold = Hold {
        pod: pod("a"),
        token: 3,
        granted_at_ms: 1_790_000_000_000,
        payload: b"gpu0".to_vec(),
        client_id: "client-1".into(),
        lease_id: 0,
    };
    let waiter = Waiter {
        pod: pod("b"),
        queued_at_ms: 1_790_000_000_001,
        deadline_ms: 1_790_000_005_001,
        payload: vec![],
        client_id: "client-2".into(),
        lease_id: 9,
    };
    state.locks.insert(
        key(),
        Lock {
            holder: Some(hold.clone()),
            waiters: [waiter].into(),
            last_token: 3,
            stuck_token: 0,
        },
    );
    state.leases.insert(
        9,
        TtlLease {
            id: 9,
            ttl_ms: 10_000,
            expires_at_ms: 1_790_000_010_000,
        },
    );
    let mut session = ClientSession {
        last_seen_ms: 1_790_000_000_000,
        ..Default::default()
    };
    // Format 1 kept answers without fingerprints; they read back as such.
    let answer = |result| StoredAnswer {
        result,
        fingerprint: None,
        answered_at: 0,
    };
    session.keep(3, answer(Ok(Reply::Granted(hold))));
    session.keep(
        4,
        answer(Err(CommandError::QueueFull {
            key: key(),
            limit: 1024,
        })),
    );
    state.sessions.insert("client-1".into(), session);
    state.now_ms = 1_790_000_000_002;
    state.pins.insert(pin_key(), pin());
    state.nodes.insert("node-7".into(), node_info());
    state.pods.insert("a".into(), PodPhase::Running);
    SnapshotFile {
        format_version: 1,
        last_applied: Some(log_id(1, 12)),
        membership: StoredMembership::new(Some(log_id(1, 2)), membership()),
        state,
    }
}

#[test]
fn format_v1_log_entries_and_snapshot_still_decode() {
    let entries = v1_entries();
    let snapshot = v1_snapshot();
    // The format-1 files were written by a format-1 build; this build writes
    // snapshots in another shape, so they are never rewritten.
    check_log_fixture(1, &entries);
    let stored = SnapshotFile::decode(&std::fs::read(fixture(1, "snapshot.bin")).unwrap())
        .expect("a format-1 snapshot decodes");
    assert_eq!(stored, snapshot);
}

/// Format 2 added the `Audit` command (administrative actions recorded
/// with the identity that asked); everything of format 1 is unchanged.
fn v2_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + 1;
    vec![Entry {
        log_id: log_id(2, next),
        payload: EntryPayload::Normal(Request {
            format_version: 2,
            request_id: None,
            leader_time_ms: 1_790_000_100_000,
            command: Command::Audit(Audit {
                identity: "CN=admin, O=ops".into(),
                action: "ChangeMembership".into(),
                detail: "voters [1, 2, 3]".into(),
            }),
        }),
    }]
}

/// Whether to write `path` first: under `TETHER_WRITE_FIXTURES`, and only
/// when it does not exist yet (an existing version's files are never
/// rewritten).
fn write_fixture(path: &std::path::Path) -> bool {
    std::env::var("TETHER_WRITE_FIXTURES").is_ok() && !path.exists()
}

/// Checks that `format-v{version}/log.bin` decodes to `entries` (writing
/// it first, see [`write_fixture`]).
fn check_log_fixture(version: u16, entries: &[Entry]) {
    if write_fixture(&fixture(version, "log.bin")) {
        std::fs::create_dir_all(fixture(version, "")).unwrap();
        let encoded: Vec<Vec<u8>> = entries.iter().map(encode).collect();
        std::fs::write(fixture(version, "log.bin"), encode(&encoded)).unwrap();
    }
    let stored: Vec<Vec<u8>> =
        decode(&std::fs::read(fixture(version, "log.bin")).unwrap()).unwrap();
    assert_eq!(stored.len(), entries.len());
    for (bytes, expected) in stored.iter().zip(entries) {
        let entry = decode_entry(bytes)
            .unwrap_or_else(|e| panic!("a format-{version} entry does not decode: {e}"));
        assert_eq!(format!("{entry:?}"), format!("{expected:?}"));
    }
}

#[test]
fn format_v2_log_entries_still_decode() {
    check_log_fixture(2, &v2_entries());
}

/// A batch item of `client` with its request id's (sequence,
/// first incomplete).
fn batch_item(
    client: &str,
    (sequence, first_incomplete): (u64, u64),
    command: Command,
) -> BatchItem {
    BatchItem {
        request_id: Some(RequestId {
            client_id: client.into(),
            sequence,
            first_incomplete,
        }),
        command,
    }
}

/// A term-3 entry at `index` carrying `items` as one batch, written in
/// `format_version` by a leader at `leader_time_ms`.
fn batch_entry(
    index: u64,
    format_version: u16,
    leader_time_ms: u64,
    items: Vec<BatchItem>,
) -> Entry {
    Entry {
        log_id: log_id(3, index),
        payload: EntryPayload::Normal(Request {
            format_version,
            request_id: None,
            leader_time_ms,
            command: Command::Batch(Batch { items }),
        }),
    }
}

/// Format 3 added the `Batch` command (several clients' acquires and
/// releases in one entry); single commands are still written as format 2.
fn v3_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 1;
    let item = |client: &str, command: Command| batch_item(client, (7, 6), command);
    vec![batch_entry(
        next,
        3,
        1_790_000_200_000,
        vec![
            item(
                "client-1",
                Command::Acquire(Acquire {
                    key: LockKey::new("gpu-bind", "node-8"),
                    pod: pod("b"),
                    payload: b"plan".to_vec(),
                    wait_ms: 30_000,
                    lease_id: 0,
                    client_id: "client-1".into(),
                    queue_limit: 1024,
                }),
            ),
            item(
                "client-2",
                Command::Release(Release {
                    key: key(),
                    pod_uid: "a".into(),
                    token: 3,
                    outcome: Outcome::Allocated,
                }),
            ),
        ],
    )]
}

#[test]
fn format_v3_log_entries_still_decode() {
    check_log_fixture(3, &v3_entries());
}

/// Format 4 lets a batch carry several commands on one lock: an acquire
/// that queues, the holder's release handing over to it, and another
/// acquire.
fn v4_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 2;
    let item = |client: &str, command: Command| batch_item(client, (9, 9), command);
    let acquire = |uid: &str| {
        Command::Acquire(Acquire {
            key: key(),
            pod: pod(uid),
            payload: b"plan".to_vec(),
            wait_ms: 30_000,
            lease_id: 0,
            client_id: "client-3".into(),
            queue_limit: 1024,
        })
    };
    vec![batch_entry(
        next,
        4,
        1_790_000_300_000,
        vec![
            item("client-3", acquire("c")),
            item(
                "client-1",
                Command::Release(Release {
                    key: key(),
                    pod_uid: "b".into(),
                    token: 5,
                    outcome: Outcome::Allocated,
                }),
            ),
            item("client-4", acquire("d")),
        ],
    )]
}

#[test]
fn format_v4_log_entries_still_decode() {
    check_log_fixture(4, &v4_entries());
}

/// Format 5: a sweep that ends everything due before it grants, and a node
/// report that cannot bring a gone node back under its old UID (the same
/// bytes as in format 2; only the version differs, and with it how the
/// entries apply).
fn v5_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 3;
    let sweep = Command::Sweep(Sweep {
        leader_tenure_ms: 600_000,
        hold_timeout_ms: 300_000,
        scope_hold_timeout_ms: BTreeMap::from([("gpu-bind".into(), 120_000)]),
        session_idle_ms: 3_600_000,
        node_tombstone_ms: 86_400_000,
    });
    let report = Command::ReportNode(ReportNode {
        name: "node-7".into(),
        uid: "n-uid-2".into(),
        state: NodeState::Ready,
        labels: Some(BTreeMap::from([("zone".into(), "a".into())])),
        unschedulable: Some(false),
    });
    [sweep, report]
        .into_iter()
        .enumerate()
        .map(|(i, command)| Entry {
            log_id: log_id(3, next + i as u64),
            payload: EntryPayload::Normal(Request {
                format_version: 5,
                request_id: None,
                leader_time_ms: 1_790_000_400_000 + i as u64,
                command,
            }),
        })
        .collect()
}

#[test]
fn format_v5_log_entries_still_decode() {
    check_log_fixture(5, &v5_entries());
}

/// Format 6: client requests whose kept answers carry their command's
/// fingerprint and the entry that last answered them (an acquire, and a
/// batch, whose items carry request ids), the give-up of a wait whose caller
/// went away, and snapshots whose sessions keep both.
fn v6_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 5;
    let acquire = Command::Acquire(Acquire {
        key: LockKey::new("gpu-bind", "node-9"),
        pod: pod("e"),
        payload: b"plan".to_vec(),
        wait_ms: 30_000,
        lease_id: 0,
        client_id: "token:extender/client.00112233aabbccdd".into(),
        queue_limit: 1024,
    });
    let single = Entry {
        log_id: log_id(3, next),
        payload: EntryPayload::Normal(Request {
            format_version: 6,
            request_id: Some(RequestId {
                client_id: "token:extender/client.00112233aabbccdd".into(),
                sequence: 11,
                first_incomplete: 10,
            }),
            leader_time_ms: 1_790_000_500_000,
            command: acquire,
        }),
    };
    let release = Command::Release(Release {
        key: LockKey::new("gpu-bind", "node-9"),
        pod_uid: "e".into(),
        token: next,
        outcome: Outcome::Allocated,
    });
    let batch = batch_entry(
        next + 1,
        6,
        1_790_000_500_001,
        vec![batch_item(
            "token:plugin/client.0123456789abcdef",
            (2, 2),
            release,
        )],
    );
    let abandon = Entry {
        log_id: log_id(3, next + 2),
        payload: EntryPayload::Normal(Request {
            format_version: 6,
            request_id: None,
            leader_time_ms: 1_790_000_500_002,
            command: Command::AbandonWait(AbandonWait {
                key: LockKey::new("gpu-bind", "node-9"),
                pod_uid: "f".into(),
                client_id: "token:extender/client.00112233aabbccdd".into(),
                sequence: 12,
                answered_at: next - 1,
            }),
        }),
    };
    vec![single, batch, abandon]
}

fn v6_snapshot() -> SnapshotFile {
    let mut snapshot = v1_snapshot();
    snapshot.format_version = 6;
    let session = snapshot.state.sessions.get_mut("client-1").unwrap();
    let answer = session.responses.get_mut(&3).unwrap();
    answer.fingerprint = Some(0x0123_4567_89ab_cdef);
    answer.answered_at = 11;
    snapshot
}

#[test]
fn format_v6_log_entries_and_snapshot_still_decode() {
    check_log_fixture(6, &v6_entries());
    let snapshot = v6_snapshot();
    let path = fixture(6, "snapshot.bin");
    if write_fixture(&path) {
        std::fs::write(&path, encode(&snapshot)).unwrap();
    }
    let stored =
        SnapshotFile::decode(&std::fs::read(&path).unwrap()).expect("a format-6 snapshot decodes");
    assert_eq!(stored, snapshot);
}

/// Format 7: a withdrawal, an abandoned wait whose grant nobody took up
/// given back, and a claim correction in one command.
fn v7_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 8;
    let withdraw = Entry {
        log_id: log_id(4, next),
        payload: EntryPayload::Normal(Request {
            format_version: 7,
            request_id: Some(RequestId {
                client_id: "token:extender/client.00112233aabbccdd".into(),
                sequence: 13,
                first_incomplete: 13,
            }),
            leader_time_ms: 1_790_000_600_000,
            command: Command::Withdraw(Withdraw {
                key: LockKey::new("gpu-bind", "node-9"),
                pod_uid: "g".into(),
            }),
        }),
    };
    let abandon = Entry {
        log_id: log_id(4, next + 1),
        payload: EntryPayload::Normal(Request {
            format_version: 7,
            request_id: None,
            leader_time_ms: 1_790_000_600_001,
            command: Command::AbandonWait(AbandonWait {
                key: LockKey::new("gpu-bind", "node-9"),
                pod_uid: "h".into(),
                client_id: "token:extender/client.00112233aabbccdd".into(),
                sequence: 14,
                answered_at: next - 1,
            }),
        }),
    };
    let reclaim = Entry {
        log_id: log_id(4, next + 2),
        payload: EntryPayload::Normal(Request {
            format_version: 7,
            request_id: Some(RequestId {
                client_id: "token:plugin/client.0123456789abcdef".into(),
                sequence: 3,
                first_incomplete: 3,
            }),
            leader_time_ms: 1_790_000_600_002,
            command: Command::Reclaim(Reclaim {
                key: PinKey::new("gpu-devices", "i"),
                node: "node-9".into(),
                pod_uid: "i".into(),
                lifetime_ms: 1000,
                labels: BTreeMap::from([("devices.tether.io/gpu1".into(), "held".into())]),
                exclusive_prefix: "devices.tether.io/".into(),
            }),
        }),
    };
    vec![withdraw, abandon, reclaim]
}

#[test]
fn format_v7_log_entries_still_decode() {
    check_log_fixture(7, &v7_entries());
}

/// Format 8: node reports, which from this format are refused when they
/// name another node object than the registered one (the same shape as
/// before; what changed is how they apply).
fn v8_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 11;
    let report = |at: u64, uid: &str, state: NodeState| Entry {
        log_id: log_id(5, next + at),
        payload: EntryPayload::Normal(Request {
            format_version: 8,
            request_id: Some(RequestId {
                client_id: "token:bridge/client.fedcba9876543210".into(),
                sequence: 40 + at,
                first_incomplete: 40 + at,
            }),
            leader_time_ms: 1_790_000_700_000 + at,
            command: Command::ReportNode(ReportNode {
                name: "node-9".into(),
                uid: uid.into(),
                state,
                labels: None,
                unschedulable: None,
            }),
        }),
    };
    vec![
        report(0, "n-uid-9b", NodeState::Ready),
        report(1, "n-uid-9a", NodeState::NotReady),
    ]
}

#[test]
fn format_v8_log_entries_still_decode() {
    check_log_fixture(8, &v8_entries());
}

/// Format 9: another client's acquire takes a pod's hold or wait over (an
/// acquire's shape is unchanged; what changed is how it applies), a
/// withdrawal of the withdrawing client's own, and a pin release on
/// condition of its labels.
fn v9_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 13;
    let entry = |at: u64, client: &str, sequence: u64, command: Command| Entry {
        log_id: log_id(6, next + at),
        payload: EntryPayload::Normal(Request {
            format_version: 9,
            request_id: Some(RequestId {
                client_id: client.into(),
                sequence,
                first_incomplete: sequence,
            }),
            leader_time_ms: 1_790_000_800_000 + at,
            command,
        }),
    };
    let second_extender = "token:extender/client.99887766aabbccdd";
    let first_extender = "token:extender/client.00112233aabbccdd";
    vec![
        entry(
            0,
            second_extender,
            5,
            Command::Acquire(Acquire {
                key: LockKey::new("gpu-bind", "node-9"),
                pod: pod("k"),
                payload: b"plan-b".to_vec(),
                wait_ms: 30_000,
                lease_id: 0,
                client_id: second_extender.into(),
                queue_limit: 1024,
            }),
        ),
        entry(
            1,
            first_extender,
            21,
            Command::WithdrawOwn(WithdrawOwn {
                key: LockKey::new("gpu-bind", "node-9"),
                pod_uid: "k".into(),
                client_id: first_extender.into(),
            }),
        ),
        entry(
            2,
            first_extender,
            22,
            Command::ReleasePinIf(ReleasePinIf {
                key: PinKey::new("gpu-devices", "k"),
                reason: "the bind failed".into(),
                labels: BTreeMap::from([(
                    "bind.tether.io/lock-token".to_string(),
                    "41".to_string(),
                )])
                .into(),
            }),
        ),
    ]
}

#[test]
fn format_v9_log_entries_still_decode() {
    check_log_fixture(9, &v9_entries());
}

fn v10_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 16;
    let extender = "token:extender/client.99887766aabbccdd";
    let entry = |at: u64, sequence: u64, command: Command| Entry {
        log_id: log_id(7, next + at),
        payload: EntryPayload::Normal(Request {
            format_version: 10,
            request_id: Some(RequestId {
                client_id: extender.into(),
                sequence,
                first_incomplete: sequence,
            }),
            leader_time_ms: 1_790_000_900_000 + at,
            command,
        }),
    };
    let seen = |name: &str| SeenNode {
        name: name.into(),
        uid: format!("uid-{name}-b"),
    };
    vec![
        entry(
            0,
            7,
            Command::ForNodeObjects(ForNodeObjects {
                nodes: vec![seen("node-9")],
                command: NodeTaking::Acquire(Acquire {
                    key: LockKey::new("gpu-bind", "node-9"),
                    pod: pod("m"),
                    payload: b"plan-m".to_vec(),
                    wait_ms: 30_000,
                    lease_id: 0,
                    client_id: extender.into(),
                    queue_limit: 1024,
                }),
            }),
        ),
        entry(
            1,
            8,
            Command::ForNodeObjects(ForNodeObjects {
                nodes: vec![seen("node-9")],
                command: NodeTaking::Reclaim(Reclaim {
                    key: PinKey::new("gpu-devices", "m"),
                    node: "node-9".into(),
                    pod_uid: "m".into(),
                    lifetime_ms: 1_000,
                    labels: BTreeMap::from([(
                        "devices.tether.io/gpu1".to_string(),
                        "held".to_string(),
                    )]),
                    exclusive_prefix: "devices.tether.io/".into(),
                }),
            }),
        ),
        entry(
            2,
            9,
            Command::ForNodeObjects(ForNodeObjects {
                nodes: vec![seen("node-8"), seen("node-9")],
                command: NodeTaking::Assign(Assign {
                    key: PinKey::new("slurm", "worker-0"),
                    candidates: vec!["node-8".into(), "node-9".into()],
                    pod_uid: "w0".into(),
                    lifetime_ms: 0,
                    labels: BTreeMap::new(),
                    affinity: Affinity::default(),
                }),
            }),
        ),
    ]
}

#[test]
fn format_v10_log_entries_still_decode() {
    check_log_fixture(10, &v10_entries());
}

/// Format 11: a batch entry carrying a claim, a pod report and a revoke
/// beside an acquire.
fn v11_entries() -> Vec<Entry> {
    let next = v1_entries().len() as u64 + v2_entries().len() as u64 + 19;
    let extender = "token:extender/client.99887766aabbccdd";
    let id = |sequence: u64| {
        Some(RequestId {
            client_id: extender.into(),
            sequence,
            first_incomplete: sequence,
        })
    };
    let items = vec![
        BatchItem {
            request_id: id(10),
            command: Command::Acquire(Acquire {
                key: LockKey::new("gpu-bind", "node-9"),
                pod: pod("n"),
                payload: b"plan-n".to_vec(),
                wait_ms: 30_000,
                lease_id: 0,
                client_id: extender.into(),
                queue_limit: 1024,
            }),
        },
        BatchItem {
            request_id: id(11),
            command: Command::ForNodeObjects(ForNodeObjects {
                nodes: vec![SeenNode {
                    name: "node-9".into(),
                    uid: "uid-node-9-b".into(),
                }],
                command: NodeTaking::Assign(Assign {
                    key: PinKey::new("gpu-devices", "n"),
                    candidates: vec!["node-9".into()],
                    pod_uid: "n".into(),
                    lifetime_ms: 1_000,
                    labels: BTreeMap::from([(
                        "devices.tether.io/gpu2".to_string(),
                        "held".to_string(),
                    )]),
                    affinity: Affinity::default(),
                }),
            }),
        },
        BatchItem {
            request_id: None,
            command: Command::ReportPod(ReportPod {
                pod_uid: "m".into(),
                phase: PodPhase::Running,
            }),
        },
        BatchItem {
            request_id: None,
            command: Command::RevokePod(RevokePod {
                pod_uid: "l".into(),
                reason: "pod deleted".into(),
            }),
        },
    ];
    vec![Entry {
        log_id: log_id(7, next),
        payload: EntryPayload::Normal(Request {
            format_version: 11,
            request_id: None,
            leader_time_ms: 1_790_000_950_000,
            command: Command::Batch(Batch { items }),
        }),
    }]
}

#[test]
fn format_v11_log_entries_still_decode() {
    check_log_fixture(11, &v11_entries());
}

#[test]
fn entries_are_written_in_the_oldest_format_that_expresses_them() {
    // A replica of an older build keeps reading single commands without a
    // request id (format 2); batches that name a lock twice need format 4,
    // node reports format 5, sweeps (their clock rules and pod cleanup),
    // client requests and batches (whose items carry request ids) format 6.
    let single = Request::new(None, 1, v1_entries_command());
    assert_eq!(single.format_version, 2);
    let newest = |entries: Vec<Entry>| {
        let EntryPayload::Normal(request) = &entries[0].payload else {
            unreachable!("a normal entry")
        };
        Request::new(request.request_id.clone(), 1, request.command.clone())
    };
    // Batches of acquires and an acquire apply format 9's takeover rule.
    assert_eq!(newest(v3_entries()).format_version, 9);
    assert_eq!(newest(v4_entries()).format_version, 9);
    assert_eq!(
        newest(v5_entries()).format_version,
        6,
        "a sweep forgets pods from 6"
    );
    assert_eq!(newest(v6_entries()).format_version, 9);
    // An abandoned wait gives back a grant nobody took up from 7, and has a
    // format-6 form that keeps it; a withdrawal exists only from 7.
    let v7 = |at: usize| {
        let EntryPayload::Normal(request) = &v7_entries()[at].payload else {
            unreachable!("a normal entry")
        };
        Request::new(request.request_id.clone(), 1, request.command.clone())
    };
    assert_eq!(v7(0).format_version, 7);
    // From 9 an abandoned wait ends only its own client's wait.
    assert_eq!(v7(1).format_version, 9);
    assert_eq!(v7(1).for_members(Some(6)).format_version, 6);
    assert_eq!(v7(1).for_members(Some(7)).format_version, 7);
    assert_eq!(v7(0).for_members(Some(6)).format_version, 7);
    // While a member is known to read only format 5 (a rolling upgrade),
    // each goes out in format 5 (no older than its oldest form), which that
    // member's build applies as it always has; with no member known to be
    // older, nothing changes.
    let for_format = |entries, format| newest(entries).for_members(Some(format)).format_version;
    assert_eq!(for_format(v3_entries(), 5), 5);
    assert_eq!(for_format(v4_entries(), 5), 5);
    assert_eq!(for_format(v5_entries(), 5), 5);
    assert_eq!(for_format(v6_entries(), 5), 5);
    assert_eq!(for_format(v5_entries(), 4), 4);
    assert_eq!(for_format(v6_entries(), 2), 2);
    assert_eq!(
        for_format(v4_entries(), 2),
        4,
        "a batch naming a lock twice needs 4"
    );
    assert_eq!(newest(v6_entries()).for_members(Some(6)).format_version, 6);
    assert_eq!(newest(v6_entries()).for_members(None).format_version, 9);
    assert_eq!(newest(v6_entries()).for_members(Some(8)).format_version, 8);
    // A node report naming another node object is refused from 8, and
    // has older forms that adopt it, as builds of those formats did.
    let EntryPayload::Normal(report) = &v8_entries()[0].payload else {
        unreachable!("a normal entry")
    };
    let report = Request::new(report.request_id.clone(), 1, report.command.clone());
    assert_eq!(report.format_version, 8);
    assert_eq!(report.clone().for_members(Some(7)).format_version, 7);
    assert_eq!(report.for_members(Some(5)).format_version, 5);
    // Format 9's own commands have no older form.
    let v9 = |at: usize| {
        let EntryPayload::Normal(request) = &v9_entries()[at].payload else {
            unreachable!("a normal entry")
        };
        Request::new(request.request_id.clone(), 1, request.command.clone())
    };
    assert_eq!(v9(1).format_version, 9);
    assert_eq!(v9(1).for_members(Some(8)).format_version, 9);
    assert_eq!(v9(2).for_members(Some(7)).format_version, 9);
    // So have format 10's node-object checks (the API sends the plain
    // command while a member reads only older formats).
    let v10 = newest(v10_entries());
    assert_eq!(v10.format_version, 10);
    assert_eq!(v10.for_members(Some(9)).format_version, 10);
    // A batch with commands that name no lock exists only from 11: the
    // leader forms one only once every member reads 11.
    let v11 = newest(v11_entries());
    assert_eq!(v11.format_version, 11);
    assert_eq!(v11.for_members(Some(10)).format_version, 11);
    assert_eq!(FORMAT_VERSION, 11);
    assert_eq!(SNAPSHOT_FORMAT_VERSION, 6);
}

/// The command of the last format-1 entry.
fn v1_entries_command() -> Command {
    v1_entries()
        .into_iter()
        .rev()
        .find_map(|entry| match entry.payload {
            EntryPayload::Normal(request) => Some(request.command),
            _ => None,
        })
        .expect("format 1 has normal entries")
}

#[test]
fn data_from_a_newer_format_is_refused_with_a_clear_error() {
    let mut entry = v1_entries().pop().unwrap();
    if let EntryPayload::Normal(request) = &mut entry.payload {
        request.format_version = FORMAT_VERSION + 1;
    }
    let err = decode_entry(&encode(&entry)).unwrap_err();
    assert!(err.to_string().contains("upgrade this replica"), "{err}");

    let mut snapshot = v1_snapshot();
    snapshot.format_version = FORMAT_VERSION + 1;
    let err = SnapshotFile::decode(&encode(&snapshot)).unwrap_err();
    assert!(err.to_string().contains("upgrade this replica"), "{err}");

    // Bytes this build cannot parse at all (e.g. a command variant from the
    // future) are refused the same way, never guessed at.
    let mut bytes = encode(&v1_entries()[3]);
    let last = bytes.len() - 1;
    bytes.truncate(last);
    let err = decode_entry(&bytes).unwrap_err();
    assert!(err.to_string().contains("newer Tether"), "{err}");
}
