//! Recovery on a 3-replica in-process cluster: restart from RocksDB, catch-up
//! by snapshot install, timeouts on committed time, membership changes.

mod common;

use openraft::async_runtime::WatchReceiver as _;
use std::time::Duration;

use common::{Cluster, DEADLINE, lock, pod};
use tether_client::Error;
use tether_client::proto::Outcome;

/// The state every replica must agree on (what a snapshot carries).
fn state_bytes(cluster: &Cluster, id: u64) -> Vec<u8> {
    tether_server::store::encode(&cluster.node(id).core().state.read().state)
}

/// Waits until `leader` has purged its log up to `index`.
async fn wait_purged(cluster: &Cluster, leader: u64, index: u64) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while cluster
        .node(leader)
        .raft()
        .metrics()
        .borrow_watched()
        .purged
        .map_or(0, |l| l.index)
        < index
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "leader did not purge its log up to {index}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The index of the last snapshot replica `id` built or installed.
fn snapshot_index_of(cluster: &Cluster, id: u64) -> u64 {
    cluster
        .node(id)
        .raft()
        .metrics()
        .borrow_watched()
        .snapshot
        .map_or(0, |l| l.index)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopped_replica_recovers_from_rocksdb_and_catches_up() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let leader = cluster.wait_leader().await;
    let follower = *cluster.addrs.keys().find(|id| **id != leader).unwrap();
    for i in 0..10 {
        client
            .acquire(
                &lock(&format!("before-{i}")),
                &pod("u1"),
                vec![i],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }
    cluster
        .wait_applied(follower, cluster.applied(leader))
        .await;
    cluster.stop(follower).await;
    for i in 0..10 {
        client
            .acquire(
                &lock(&format!("during-{i}")),
                &pod("u2"),
                vec![i],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }
    cluster.restart(follower).await;
    let target = cluster.applied(leader);
    cluster.wait_applied(follower, target).await;
    assert_eq!(
        state_bytes(&cluster, follower),
        state_bytes(&cluster, leader)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_cluster_restart_keeps_holds_queues_and_dedupe() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let hold = client
        .acquire(&lock("n1"), &pod("u1"), b"plan".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    let leader = cluster.wait_leader().await;
    for id in [1, 2, 3] {
        cluster.wait_applied(id, cluster.applied(leader)).await;
    }
    let before = state_bytes(&cluster, leader);
    for id in [1, 2, 3] {
        cluster.stop(id).await;
    }
    for id in [1, 2, 3] {
        cluster.restart(id).await;
    }
    let leader = cluster.wait_leader().await;
    let seen = client
        .holder(&lock("n1"))
        .await
        .unwrap()
        .expect("hold survived a full restart");
    assert_eq!(seen.token, hold.token);
    assert_eq!(seen.payload, b"plan");
    // Only the new leader's blank entry was added; the domain state is equal
    // except for committed time.
    let mut after: tether_server::sm::State =
        tether_server::store::decode(&state_bytes(&cluster, leader)).unwrap();
    let before: tether_server::sm::State = tether_server::store::decode(&before).unwrap();
    after.now_ms = before.now_ms;
    assert_eq!(after, before);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lagging_replica_is_brought_back_by_snapshot_install() {
    let mut cluster = Cluster::start_with(3, |c| {
        c.snapshot_every = 1_000_000;
        c.keep_logs_after_snapshot = 0;
    })
    .await;
    let client = common::client(&cluster);
    let leader = cluster.wait_leader().await;
    let lagging = *cluster.addrs.keys().find(|id| **id != leader).unwrap();
    cluster.stop(lagging).await;
    for i in 0..30 {
        client
            .acquire(
                &lock(&format!("n{i}")),
                &pod(&format!("u{i}")),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }
    let snapshot_index = client.snapshot().await.unwrap();
    assert!(snapshot_index >= 30);
    // The leader purged the log the snapshot covers.
    wait_purged(&cluster, leader, snapshot_index).await;
    cluster.restart(lagging).await;
    cluster.wait_applied(lagging, cluster.applied(leader)).await;
    let installed = snapshot_index_of(&cluster, lagging);
    assert!(
        installed >= snapshot_index,
        "lagging replica caught up without installing the snapshot"
    );
    assert_eq!(
        state_bytes(&cluster, lagging),
        state_bytes(&cluster, leader)
    );
    // And it survives a restart from the installed snapshot.
    cluster.stop(lagging).await;
    cluster.restart(lagging).await;
    cluster.wait_applied(lagging, cluster.applied(leader)).await;
    assert_eq!(
        state_bytes(&cluster, lagging),
        state_bytes(&cluster, leader)
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hold_timeout_releases_on_committed_time_and_hands_over() {
    let cluster = Cluster::start_with(3, |c| c.hold_timeout = Duration::from_millis(1500)).await;
    let client = common::client(&cluster);
    let key = lock("n-timeout");
    let first = client
        .acquire(&key, &pod("slow"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let next = client
        .acquire(&key, &pod("next"), vec![], DEADLINE, 0)
        .await
        .unwrap();
    assert_eq!(next.pod_uid(), "next");
    assert!(next.token > first.token);
    // The timed-out holder's token is now stale.
    let err = client
        .release(&key, "slow", first.token, Outcome::Allocated)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ttl_lease_keeps_holds_while_kept_alive_and_releases_them_when_it_expires() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    // Below 3 x the election timeout upper bound (3 x 1.5 s): refused.
    let err = client
        .grant_lease(Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("minimum")),
        "{err}"
    );
    let ttl = Duration::from_millis(4500);
    let lease = client.grant_lease(ttl).await.unwrap();
    let key = lock("n-lease");
    client
        .acquire(&key, &pod("lockctl-session"), vec![], Duration::ZERO, lease)
        .await
        .unwrap();
    let start = tokio::time::Instant::now();
    while start.elapsed() < ttl * 2 {
        assert_eq!(
            client.keep_alive_once(lease).await.unwrap(),
            ttl.as_millis() as u64
        );
        tokio::time::sleep(ttl / 4).await;
    }
    assert!(
        client.holder(&key).await.unwrap().is_some(),
        "kept alive, so still held"
    );
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while client.holder(&key).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(client.keep_alive_once(lease).await.unwrap(), 0);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_transfer_hands_over_to_the_target() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let leader = cluster.wait_leader().await;
    client
        .acquire(&lock("n1"), &pod("u1"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let target = *cluster.addrs.keys().find(|id| **id != leader).unwrap();
    assert_eq!(client.transfer_leader(target).await.unwrap(), target);
    assert_eq!(cluster.wait_leader().await, target);
    assert!(client.holder(&lock("n1")).await.unwrap().is_some());
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn learner_is_added_promoted_and_a_voter_removed() {
    let mut cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    client
        .acquire(&lock("n1"), &pod("u1"), b"p".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap();
    cluster.add_node(4).await;
    let addr4 = cluster.addrs[&4].to_string();
    client.add_learner(4, &addr4, true).await.unwrap();
    let leader = cluster.wait_leader().await;
    cluster.wait_applied(4, cluster.applied(leader)).await;
    assert_eq!(
        state_bytes(&cluster, 4),
        state_bytes(&cluster, leader),
        "learner replicated the state"
    );

    client
        .change_membership(vec![1, 2, 3, 4], false)
        .await
        .unwrap();
    // Replica 4 answers from what it has applied: the change committed on
    // the leader reaches it a moment later.
    let voters = wait_members(&client, &addr4, true, &[1, 2, 3, 4]).await;
    assert_eq!(voters, vec![1, 2, 3, 4]);

    // Remove a voter that is not the leader; the cluster keeps working.
    let leader = cluster.wait_leader().await;
    let removed = [1, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    let remaining: Vec<u64> = [1, 2, 3, 4]
        .into_iter()
        .filter(|id| *id != removed)
        .collect();
    client
        .change_membership(remaining.clone(), false)
        .await
        .unwrap();
    cluster.stop(removed).await;
    cluster.addrs.remove(&removed);
    cluster.nodes.remove(&removed);
    let client = common::client(&cluster);
    let hold = client
        .acquire(&lock("n2"), &pod("u2"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(hold.token > 0);
    let members = wait_members(&client, &addr4, false, &remaining).await;
    assert_eq!(members, remaining);
    cluster.shutdown().await;
}

/// The members (voters only, with `voters`) the replica at `addr` reports,
/// once they are `expected` or the deadline passed (then as they are).
async fn wait_members(
    client: &tether_client::Client,
    addr: &str,
    voters: bool,
    expected: &[u64],
) -> Vec<u64> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let status = client.status_of(addr).await.unwrap();
        let members: Vec<u64> = status
            .members
            .iter()
            .filter(|m| m.voter || !voters)
            .map(|m| m.node_id)
            .collect();
        if members == expected || tokio::time::Instant::now() > deadline {
            return members;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn membership_changes_sent_together_wait_for_each_other_instead_of_failing() {
    let mut cluster = Cluster::start(3).await;
    cluster.add_node(4).await;
    cluster.add_node(5).await;
    let addr4 = cluster.addrs[&4].to_string();
    let addr5 = cluster.addrs[&5].to_string();
    // Two operators at once: openraft takes one membership change at a time
    // and refuses the other while the first is uncommitted; the server waits
    // for the first to apply and then runs the second.
    let (first, second) = (common::client(&cluster), common::client(&cluster));
    let (added4, added5) = tokio::join!(
        first.add_learner(4, &addr4, false),
        second.add_learner(5, &addr5, false)
    );
    added4.expect("learner 4");
    added5.expect("learner 5");
    let (promoted, readded) = tokio::join!(
        first.change_membership(vec![1, 2, 3, 4], false),
        second.add_learner(5, &addr5, false)
    );
    promoted.expect("promoting 4 (a joint change, two entries)");
    readded.expect("re-adding learner 5 while 4 is promoted");
    let leader = cluster.wait_leader().await;
    let status = first
        .status_of(&cluster.addrs[&leader].to_string())
        .await
        .unwrap();
    let voters: Vec<u64> = status
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect();
    let members: Vec<u64> = status.members.iter().map(|m| m.node_id).collect();
    assert_eq!(voters, vec![1, 2, 3, 4]);
    assert_eq!(members, vec![1, 2, 3, 4, 5]);
    cluster.shutdown().await;
}

/// Writes `writers` x `per_writer` acquires with `payload`-byte payloads on
/// distinct locks, concurrently (so that they also share batch entries).
async fn write_backlog(
    client: &std::sync::Arc<tether_client::Client>,
    tag: &str,
    writers: usize,
    per_writer: usize,
    payload: usize,
) {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let client = client.clone();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            for i in 0..per_writer {
                client
                    .acquire(
                        &lock(&format!("{tag}-{w}-{i}")),
                        &pod(&format!("{tag}-{w}")),
                        vec![(i % 251) as u8; payload],
                        Duration::ZERO,
                        0,
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(DEADLINE, task)
            .await
            .expect("writer finished")
            .unwrap();
    }
}

/// A follower back from a stop whose backlog is many times one Raft message:
/// AppendEntries that would pass the limit are sent as several messages
/// that each fit (the network splits them; the receiver would refuse the
/// whole message, and the follower would never catch up), and a snapshot
/// goes over in chunks under the limit. The limit is lowered from
/// 64 MiB to 256 KiB so that 2 MiB of payloads reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_of_many_raft_messages_reaches_a_restarted_follower() {
    const MESSAGE_LIMIT: usize = 256 * 1024;
    const PAYLOAD: usize = 8 * 1024;
    let mut cluster = Cluster::start_with(3, |c| {
        c.raft_message_limit = MESSAGE_LIMIT;
        c.max_payload_bytes = PAYLOAD;
        c.max_request_bytes = MESSAGE_LIMIT / 4;
        c.snapshot_every = 1_000_000;
        c.keep_logs_after_snapshot = 0;
    })
    .await;
    let client = std::sync::Arc::new(common::client(&cluster));
    let leader = cluster.wait_leader().await;
    let follower = *cluster.addrs.keys().find(|id| **id != leader).unwrap();

    // By the log: 16 x 16 acquires of 8 KiB, 2 MiB, far fewer entries than
    // openraft's 300 per message, so its first AppendEntries would carry 8
    // times the limit.
    cluster.stop(follower).await;
    write_backlog(&client, "log", 16, 16, PAYLOAD).await;
    cluster.restart(follower).await;
    cluster
        .wait_applied(follower, cluster.applied(leader))
        .await;
    assert_eq!(
        state_bytes(&cluster, follower),
        state_bytes(&cluster, leader)
    );

    // By a snapshot of 4 MiB of holds, once the leader purged the log.
    cluster.stop(follower).await;
    write_backlog(&client, "snap", 16, 16, PAYLOAD).await;
    let snapshot_index = client.snapshot().await.unwrap();
    wait_purged(&cluster, leader, snapshot_index).await;
    cluster.restart(follower).await;
    cluster
        .wait_applied(follower, cluster.applied(leader))
        .await;
    let installed = snapshot_index_of(&cluster, follower);
    assert!(
        installed >= snapshot_index,
        "the follower caught up without installing the snapshot"
    );
    assert_eq!(
        state_bytes(&cluster, follower),
        state_bytes(&cluster, leader)
    );
    cluster.shutdown().await;
}
