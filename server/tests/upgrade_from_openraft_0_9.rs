//! Data written by Tether on openraft 0.9 opens on this build.
//!
//! `tests/fixtures/openraft-0.9-cluster/` holds the data directories of a
//! 3-replica cluster as the openraft 0.9.25 build left them (RocksDB's own
//! info logs taken out): a snapshot, a purged log and a log tail after it,
//! held locks with payloads, a waiter, a TTL lease with a hold on it, pins,
//! nodes, pods and the event history. [`workload`] says what was done to
//! them; each replica's `expected.txt` is [`describe`] of its directory as
//! that build read it.
//!
//! - [`the_stored_data_reads_as_the_0_9_build_read_it`] opens every
//!   directory with this build's store and compares [`describe`] with
//!   `expected.txt`: vote, log, every entry, snapshot, applied state and
//!   events decode to the same values.
//! - [`the_cluster_restarts_and_keeps_every_hold`] starts the three
//!   replicas on copies of the directories and checks, through the API,
//!   that the holds are there with their tokens and payloads, that tokens
//!   go on growing, that the lease (expired since) ends its hold, and that
//!   the cluster takes writes.
//!
//! The fixture is never rewritten: it stands for what the 0.9 release
//! wrote. [`write_the_fixture`] (ignored, and refusing to overwrite) is the
//! program that wrote it, kept so that a reader can see how; run on a build
//! of another openraft, it would write that build's data instead.

mod common;

use openraft::async_runtime::WatchReceiver as _;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{DEADLINE, lock, pod};
use openraft::storage::RaftLogStorage;
use openraft::{EntryPayload, RaftLogReader, ServerState};
use tether_client::proto::{self as pb, Outcome, PodPhase};
use tether_client::{Client, Options};
use tether_server::Node;
use tether_server::raft::LogId;
use tether_server::sm::Revision;
use tether_server::store::{self, SnapshotFile};
use tether_server::testing::{Cluster, test_config};
use tokio::net::TcpListener;

/// Replica ids of the fixture's cluster.
const REPLICAS: [u64; 3] = [1, 2, 3];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/openraft-0.9-cluster")
}

fn replica_dir(root: &Path, id: u64) -> PathBuf {
    root.join(format!("replica-{id}"))
}

/// Copies a directory's files (the fixture is flat per replica). Opening
/// RocksDB writes to its directory, so tests open copies, never the
/// checked-in files.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in std::fs::read_dir(from).unwrap() {
        let file = file.unwrap();
        assert!(file.file_type().unwrap().is_file(), "{:?}", file.path());
        std::fs::copy(file.path(), to.join(file.file_name())).unwrap();
    }
}

fn log_id(id: &LogId) -> String {
    format!(
        "{}-{}-{}",
        id.leader_id.term, id.leader_id.node_id, id.index
    )
}

fn opt_log_id(id: Option<&LogId>) -> String {
    id.map_or_else(|| "none".to_string(), log_id)
}

/// Everything a replica's directory holds, as text: the vote, the log's
/// bounds and every entry, the stored snapshot, the applied state and the
/// events. Written with our own formats for openraft's types (its `Debug`
/// output is not a contract), so that two builds on different openraft
/// versions print the same text for the same data.
async fn describe(dir: &Path) -> String {
    let (db, mut log, sm) = store::open(dir).await.expect("the store opens");
    let mut out = String::new();
    let vote = log.read_vote().await.unwrap().expect("a vote is stored");
    writeln!(
        out,
        "vote: term {}, node {}, committed {}",
        vote.leader_id.term, vote.leader_id.node_id, vote.committed
    )
    .unwrap();
    let committed = log.read_committed().await.unwrap();
    writeln!(out, "committed: {}", opt_log_id(committed.as_ref())).unwrap();
    let bounds = log.get_log_state().await.unwrap();
    writeln!(
        out,
        "log: purged {}, last {}",
        opt_log_id(bounds.last_purged_log_id.as_ref()),
        opt_log_id(bounds.last_log_id.as_ref())
    )
    .unwrap();
    let first = bounds.last_purged_log_id.map_or(0, |l| l.index + 1);
    let last = bounds.last_log_id.map_or(0, |l| l.index);
    let entries = log.try_get_log_entries(first..=last).await.unwrap();
    assert_eq!(
        entries.len() as u64,
        last + 1 - first,
        "every index from {first} to {last} has its entry"
    );
    for entry in &entries {
        let payload = match &entry.payload {
            EntryPayload::Blank => "blank".to_string(),
            EntryPayload::Normal(request) => format!("{request:?}"),
            EntryPayload::Membership(m) => {
                format!("voters {:?}", m.voter_ids().collect::<Vec<_>>())
            }
        };
        writeln!(out, "entry {}: {payload}", log_id(&entry.log_id)).unwrap();
    }
    match store::state_machine::stored_snapshot(&db).unwrap() {
        None => writeln!(out, "snapshot: none").unwrap(),
        Some((index, data)) => {
            let file = SnapshotFile::decode(&data).expect("the snapshot decodes");
            writeln!(
                out,
                "snapshot: index {index}, format {}, last applied {}, voters {:?}\n  state: {:?}",
                file.format_version,
                opt_log_id(file.last_applied.as_ref()),
                file.membership.membership().voter_ids().collect::<Vec<_>>(),
                file.state
            )
            .unwrap();
        }
    }
    {
        let applied = sm.handle();
        let applied = applied.read();
        writeln!(
            out,
            "applied: {}, voters {:?}\n  state: {:?}",
            opt_log_id(applied.last_applied.as_ref()),
            applied
                .membership
                .membership()
                .voter_ids()
                .collect::<Vec<_>>(),
            applied.state
        )
        .unwrap();
    }
    let events =
        store::read_events(&db, Revision { index: 0, sub: 0 }, usize::MAX).expect("events decode");
    for event in events {
        writeln!(out, "event {event:?}").unwrap();
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_data_reads_as_the_0_9_build_read_it() {
    let scratch = tempfile::tempdir().unwrap();
    for id in REPLICAS {
        let from = replica_dir(&fixture_dir(), id);
        let dir = replica_dir(scratch.path(), id);
        copy_dir(&from.join("data"), &dir);
        let expected = std::fs::read_to_string(from.join("expected.txt")).unwrap();
        let found = describe(&dir).await;
        if found != expected {
            let first_difference = found
                .lines()
                .zip(expected.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(found.lines().count().min(expected.lines().count()));
            panic!(
                "replica {id}'s data reads differently from how the 0.9 build read it; \
                 first difference at line {}:\n  now:      {}\n  expected: {}",
                first_difference + 1,
                found.lines().nth(first_difference).unwrap_or("<end>"),
                expected.lines().nth(first_difference).unwrap_or("<end>"),
            );
        }
    }
}

/// The fixture's cluster, started on copies of its directories. Their
/// membership names the addresses the cluster had when it was written;
/// `--peer-dial` points each id at the port it has now.
async fn start_fixture_cluster(root: &Path) -> Vec<Node> {
    let mut listeners = Vec::new();
    for id in REPLICAS {
        copy_dir(
            &replica_dir(&fixture_dir(), id).join("data"),
            &replica_dir(root, id),
        );
        listeners.push((id, TcpListener::bind("127.0.0.1:0").await.unwrap()));
    }
    let dial: std::collections::BTreeMap<u64, String> = listeners
        .iter()
        .map(|(id, l)| (*id, l.local_addr().unwrap().to_string()))
        .collect();
    let mut nodes = Vec::new();
    for (id, grpc) in listeners {
        let mut config = test_config(id, &replica_dir(root, id));
        config.peer_dial = dial.clone();
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        nodes.push(
            Node::start_with(config, grpc, http)
                .await
                .expect("a replica of the 0.9 cluster starts"),
        );
    }
    nodes
}

/// The replica that leads, once one does.
async fn leader_of(nodes: &[Node]) -> &Node {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some(leader) = nodes
            .iter()
            .find(|n| n.raft().metrics().borrow_watched().state == ServerState::Leader)
        {
            return leader;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn client_of(node: &Node) -> Client {
    // Only the leader's address now: a follower's redirect names the
    // leader's address in the membership, the port of the written cluster.
    Client::new(
        [node.addr().to_string()],
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_restarts_and_keeps_every_hold() {
    tether_server::testing::init_tracing();
    let scratch = tempfile::tempdir().unwrap();
    let nodes = start_fixture_cluster(scratch.path()).await;
    let leader = leader_of(&nodes).await;
    let tether = client_of(leader);

    // The holds without an end of their own are there, unchanged.
    let a = tether
        .holder(&lock("node-1"))
        .await
        .unwrap()
        .expect("node-1 is held");
    assert_eq!(a.pod.as_ref().unwrap().uid, "pod-a");
    assert_eq!(a.payload, b"GPU-0,GPU-1".to_vec());
    let c = tether
        .holder(&lock("node-2"))
        .await
        .unwrap()
        .expect("node-2 is held");
    assert_eq!(c.pod.as_ref().unwrap().uid, "pod-c");
    let d = tether
        .holder(&lock("node-4"))
        .await
        .unwrap()
        .expect("node-4 is held");
    assert_eq!(d.pod.as_ref().unwrap().uid, "pod-d");
    assert_eq!(d.payload, b"GPU-3".to_vec());
    assert!(a.token < c.token && c.token < d.token, "{a:?} {c:?} {d:?}");

    // Re-acquiring for the holder's pod UID through this client (not the
    // one that acquired before the upgrade: a retried bind through another
    // extender) takes the hold over with a higher token (format 9); the
    // same client again gets that hold back.
    let again = tether
        .acquire(&lock("node-1"), &pod("pod-a"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(
        again.token() > a.token,
        "{} after {}",
        again.token(),
        a.token
    );
    let same = tether
        .acquire(&lock("node-1"), &pod("pod-a"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert_eq!(same.token(), again.token());
    let a_token = again.token();

    // The lease has expired since (committed time resumes from the wall
    // clock): its hold ends.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while tether.holder(&lock("node-3")).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the expired lease's hold on node-3 never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Pins, nodes and pods are there.
    let pin = tether
        .get_pin(&pin_key("0"))
        .await
        .unwrap()
        .expect("the pin is there");
    assert_eq!(
        (pin.node.as_str(), pin.pod_uid.as_str()),
        ("node-2", "slurmd-0")
    );
    assert_eq!(pin.labels.get("gres"), Some(&"gpu-2".to_string()));
    let nodes_known: Vec<String> = tether
        .list_nodes(true)
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.name)
        .collect();
    assert_eq!(nodes_known, ["node-1", "node-2", "node-3", "node-4"]);

    // Writes go on, with tokens above every one written before.
    let fresh = tether
        .acquire(&lock("node-9"), &pod("pod-z"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(
        fresh.token() > d.token,
        "{} after {}",
        fresh.token(),
        d.token
    );
    tether
        .release(&lock("node-1"), "pod-a", a_token, Outcome::Allocated)
        .await
        .unwrap();
    assert_ne!(
        tether
            .holder(&lock("node-1"))
            .await
            .unwrap()
            .map(|h| h.pod.unwrap().uid),
        Some("pod-a".to_string()),
        "node-1 was released"
    );
    for node in nodes {
        node.stop().await;
    }
}

fn pin_key(member: &str) -> pb::PinKey {
    pb::PinKey {
        set: "slurm/nodeset-a".into(),
        member: member.into(),
    }
}

/// What [`write_the_fixture`] does to a fresh 3-replica cluster. Each
/// replica builds a snapshot halfway, with the log kept short after it, so
/// the directories hold a snapshot, a purged log and entries after both.
async fn workload(cluster: &mut Cluster) {
    let tether = common::client(cluster);
    for (name, zone) in [
        ("node-1", "a"),
        ("node-2", "a"),
        ("node-3", "b"),
        ("node-4", "b"),
    ] {
        tether
            .report_node(pb::ReportNodeRequest {
                name: name.into(),
                uid: format!("uid-{name}"),
                state: pb::NodeState::NodeReady as i32,
                set_labels: true,
                labels: HashMap::from([("zone".to_string(), zone.to_string())]),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    tether
        .acquire(
            &lock("node-1"),
            &pod("pod-a"),
            b"GPU-0,GPU-1".to_vec(),
            Duration::ZERO,
            0,
        )
        .await
        .unwrap();
    for n in 0..10 {
        let held = tether
            .acquire(
                &lock("node-2"),
                &pod(&format!("pod-b{n}")),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
        held.release(Outcome::Allocated).await.unwrap();
    }
    tether
        .acquire(&lock("node-2"), &pod("pod-c"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let lease = tether.grant_lease(Duration::from_secs(5)).await.unwrap();
    tether
        .acquire(
            &lock("node-3"),
            &pod("pod-l"),
            vec![],
            Duration::ZERO,
            lease,
        )
        .await
        .unwrap();
    tether
        .report_pod("slurmd-0", PodPhase::PodRunning)
        .await
        .unwrap();
    tether
        .assign(
            &pin_key("0"),
            vec!["node-2".into()],
            "slurmd-0",
            Duration::ZERO,
            HashMap::from([("gres".to_string(), "gpu-2".to_string())]),
            pb::Affinity::default(),
        )
        .await
        .unwrap();
    // A pod deleted while it held a lock: the bridge's revoke.
    tether
        .acquire(&lock("node-5"), &pod("pod-gone"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    tether.revoke_pod("pod-gone", "pod deleted").await.unwrap();

    // Every replica snapshots here.
    let leader = cluster.wait_leader().await;
    let index = cluster.applied(leader);
    for id in REPLICAS {
        cluster.wait_applied(id, index).await;
        cluster.node(id).raft().trigger().snapshot().await.unwrap();
    }
    for id in REPLICAS {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while cluster
            .node(id)
            .raft()
            .metrics()
            .borrow_watched()
            .purged
            .is_none_or(|p| p.index + 5 < index)
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "replica {id} did not snapshot and purge"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // After the snapshot: a hold, and a waiter that is queued when the
    // cluster stops.
    tether
        .acquire(
            &lock("node-4"),
            &pod("pod-d"),
            b"GPU-3".to_vec(),
            Duration::ZERO,
            0,
        )
        .await
        .unwrap();
    let waiting = {
        let tether = tether.clone();
        tokio::spawn(async move {
            tether
                .acquire(
                    &lock("node-1"),
                    &pod("pod-e"),
                    vec![],
                    Duration::from_secs(600),
                    0,
                )
                .await
        })
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while tether
        .get(&lock("node-1"))
        .await
        .unwrap()
        .waiters
        .is_empty()
    {
        assert!(tokio::time::Instant::now() < deadline, "pod-e never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader = cluster.wait_leader().await;
    let index = cluster.applied(leader);
    for id in REPLICAS {
        cluster.wait_applied(id, index).await;
    }
    waiting.abort();
}

/// Writes the fixture. Run once, on the openraft 0.9 build, with
/// `TETHER_WRITE_UPGRADE_FIXTURE=1 cargo test -p tether-server --test
/// upgrade_from_openraft_0_9 -- --ignored`; it refuses to overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the fixture; run by hand, once"]
async fn write_the_fixture() {
    if std::env::var_os("TETHER_WRITE_UPGRADE_FIXTURE").is_none() {
        return;
    }
    let root = fixture_dir();
    assert!(
        !root.exists(),
        "{} exists: the fixture stands for the 0.9 release and is never rewritten",
        root.display()
    );
    let mut cluster = Cluster::start_with(3, |config| {
        config.snapshot_every = 1_000_000;
        config.keep_logs_after_snapshot = 2;
    })
    .await;
    workload(&mut cluster).await;
    let dirs: Vec<(u64, PathBuf)> = cluster
        .dirs
        .iter()
        .map(|(id, dir)| (*id, dir.path().to_path_buf()))
        .collect();
    // Followers first, so that no new election writes after the workload.
    let leader = cluster.wait_leader().await;
    for id in REPLICAS.into_iter().filter(|id| *id != leader) {
        cluster.stop(id).await;
    }
    cluster.stop(leader).await;
    for (id, dir) in dirs {
        let target = replica_dir(&root, id);
        std::fs::create_dir_all(target.join("data")).unwrap();
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap();
            let name = file.file_name().to_string_lossy().to_string();
            // RocksDB's info logs are not data; LOCK is made on open.
            if name == "LOCK" || name == "LOG" || name.starts_with("LOG.old") {
                continue;
            }
            std::fs::copy(file.path(), target.join("data").join(&name)).unwrap();
        }
        // Read as this build reads it, from a copy (opening writes).
        let scratch = tempfile::tempdir().unwrap();
        copy_dir(&target.join("data"), scratch.path());
        std::fs::write(target.join("expected.txt"), describe(scratch.path()).await).unwrap();
    }
    drop(cluster);
}
