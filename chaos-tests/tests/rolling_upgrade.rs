//! A rolling upgrade of a 3-replica cluster from the previous release (the
//! build on openraft 0.9) to this build, on real `tetherd` processes: one
//! replica at a time is killed and started again on the new binary with its
//! data, and the cluster keeps serving through every mixed step.
//!
//! Every message kind crosses between the builds both ways: AppendEntries
//! (a new follower of an old leader, and old followers of a new leader),
//! votes (leader transfers to a new and to an old replica, each elected by
//! the other build), and snapshots in chunks (an old replica catching up
//! from a new leader's snapshot, a new one from an old leader's). Holds
//! taken before the roll are there after it with their tokens, and tokens
//! keep growing.
//!
//! The previous release's `tetherd` is built by `./dev test` from git
//! history (`dev`'s `build_previous_release`) and named by
//! `TETHER_PREVIOUS_TETHERD`. Without it the test says so and skips;
//! under `CI=true` it fails instead.

use std::path::PathBuf;
use std::time::Duration;

use tether_chaos::cluster::{ClusterSpec, ProcessCluster, sibling_binary};
use tether_client::Client;
use tether_client::proto::{self as pb, Outcome};

const DEADLINE: Duration = Duration::from_secs(60);

fn previous_tetherd() -> Option<PathBuf> {
    match std::env::var_os("TETHER_PREVIOUS_TETHERD") {
        Some(path) => Some(PathBuf::from(path)),
        None if std::env::var_os("CI").is_some() => {
            panic!("TETHER_PREVIOUS_TETHERD is not set (./dev test builds the previous release)")
        }
        None => {
            eprintln!(
                "SKIPPED: the rolling upgrade needs the previous release's tetherd in \
                 TETHER_PREVIOUS_TETHERD (./dev test builds it)"
            );
            None
        }
    }
}

fn lock(name: &str) -> pb::LockKey {
    pb::LockKey {
        scope: "gpu-bind".into(),
        name: name.into(),
    }
}

fn pod(uid: &str) -> pb::Pod {
    pb::Pod {
        uid: uid.into(),
        namespace: "ml".into(),
        name: uid.into(),
    }
}

/// `n` binds (acquire, then release) on locks of their own; every token
/// above `after`, and growing. Returns the last token.
async fn binds(client: &Client, round: &str, n: usize, after: u64) -> u64 {
    let mut last = after;
    for i in 0..n {
        let name = format!("{round}-{i}");
        let held = client
            .acquire(&lock(&name), &pod(&name), vec![], Duration::ZERO, 0)
            .await
            .unwrap_or_else(|e| panic!("{round}: bind {i} refused: {e}"));
        assert!(
            held.token() > last,
            "{round}: token {} after {last}",
            held.token()
        );
        last = held.token();
        held.release(Outcome::Allocated)
            .await
            .unwrap_or_else(|e| panic!("{round}: release {i} refused: {e}"));
    }
    last
}

/// Makes `id` the leader.
async fn lead(cluster: &ProcessCluster, client: &Client, id: u64) {
    if cluster.wait_for_leader(DEADLINE).await.unwrap().node_id == id {
        return;
    }
    client
        .transfer_leader(id)
        .await
        .unwrap_or_else(|e| panic!("leadership to {id}: {e}"));
    let leader = cluster.wait_for_leader(DEADLINE).await.unwrap();
    assert_eq!(
        leader.node_id, id,
        "the transfer elected {}",
        leader.node_id
    );
}

/// With `id` stopped: writes, a snapshot on the leader (whose log is then
/// purged), more writes; then starts `id` on `tetherd`, which can only
/// catch up by the snapshot. Returns the last token.
async fn catch_up_by_snapshot(
    cluster: &mut ProcessCluster,
    client: &Client,
    id: u64,
    tetherd: &std::path::Path,
    round: &str,
    after: u64,
) -> u64 {
    let last = binds(client, round, 20, after).await;
    let covered = client.snapshot().await.expect("the leader snapshots");
    let last = binds(client, &format!("{round}-after"), 5, last).await;
    cluster.restart_on(id, tetherd).unwrap();
    cluster.wait_caught_up(id, DEADLINE).await.unwrap();
    let status = client.status_of(&cluster.addr(id)).await.unwrap();
    assert!(
        status.snapshot_index >= covered,
        "{round}: replica {id} caught up without the snapshot at {covered}: {status:?}"
    );
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_rolls_from_the_previous_release_to_this_build_and_keeps_serving() {
    let Some(old) = previous_tetherd() else {
        return;
    };
    let new = sibling_binary("tetherd");
    let mut cluster = ProcessCluster::start_spec(ClusterSpec {
        tetherd: old.clone(),
        voters: 3,
        slots: 3,
        proxied: false,
        extra_args: vec![
            // Snapshots only when the test asks, and then the log is purged.
            "--snapshot-every=1000000".into(),
            "--keep-logs-after-snapshot=0".into(),
        ],
        failpoints: None,
        log_filter: None,
        tokens: false,
        lazyfs: false,
    })
    .await
    .expect("a cluster of the previous release");
    let client = cluster.client_with(DEADLINE);

    // Before the roll: a hold with a payload, and some history.
    let kept = client
        .acquire(
            &lock("node-kept"),
            &pod("kept"),
            b"GPU-0".to_vec(),
            Duration::ZERO,
            0,
        )
        .await
        .expect("a hold on the previous release");
    let mut last = binds(&client, "old", 10, kept.token()).await;

    // 1 on the new build: it follows an old leader.
    lead(&cluster, &client, 2).await;
    cluster.restart_on(1, &new).unwrap();
    cluster.wait_caught_up(1, DEADLINE).await.unwrap();
    last = binds(&client, "one-new", 10, last).await;

    // With 3 down, each election below needs the vote of the other build.
    // The new replica leads, elected by an old one; old 3 catches up from
    // its snapshot.
    cluster.kill(3);
    lead(&cluster, &client, 1).await;
    last = binds(&client, "new-leads", 10, last).await;
    last = catch_up_by_snapshot(&mut cluster, &client, 3, &old, "old-from-new", last).await;

    // An old replica leads, elected by the new one; 3 comes back on the
    // new build and catches up from the old leader's snapshot.
    cluster.kill(3);
    lead(&cluster, &client, 2).await;
    last = binds(&client, "old-leads", 10, last).await;
    last = catch_up_by_snapshot(&mut cluster, &client, 3, &new, "new-from-old", last).await;

    // The last old replica (the leader) rolls too.
    cluster.restart_on(2, &new).unwrap();
    cluster.wait_caught_up(2, DEADLINE).await.unwrap();
    last = binds(&client, "rolled", 10, last).await;
    let leader = cluster.wait_converged(DEADLINE).await.unwrap();
    lead(&cluster, &client, if leader.node_id == 3 { 1 } else { 3 }).await;
    binds(&client, "all-new", 10, last).await;

    // The hold from before the roll is there, unchanged.
    let hold = client
        .holder(&lock("node-kept"))
        .await
        .unwrap()
        .expect("the hold taken before the roll");
    assert_eq!(
        (hold.token, hold.pod.unwrap().uid, hold.payload),
        (kept.token(), "kept".to_string(), b"GPU-0".to_vec())
    );
}
