//! The fault harness itself, on real `tetherd` processes: each fault must
//! really happen (a cut link elects a new leader, a killed or paused replica
//! stops answering) and heal (the cluster converges and serves again).

use std::time::Duration;

use tether_chaos::cluster::{ClusterSpec, ProcessCluster, sibling_binary};
use tether_client::proto as pb;

async fn cluster() -> ProcessCluster {
    ProcessCluster::start_spec(ClusterSpec {
        slots: 4,
        proxied: true,
        ..ClusterSpec::quick(sibling_binary("tetherd"), 3)
    })
    .await
    .expect("a 3-replica cluster")
}

/// Polls `check` every 50 ms for up to 60 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn write_works(cluster: &ProcessCluster) {
    let client = cluster.client();
    let key = pb::LockKey {
        scope: "faults".into(),
        name: format!("k{}", rand_suffix()),
    };
    let pod = pb::Pod {
        uid: format!("u{}", rand_suffix()),
        namespace: "t".into(),
        name: "t".into(),
    };
    let held = client
        .acquire(&key, &pod, vec![], Duration::ZERO, 0)
        .await
        .expect("a write after healing");
    held.release(pb::Outcome::Allocated).await.expect("release");
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_leader_is_replaced_and_the_partition_heals() {
    let mut cluster = cluster().await;
    let client = cluster.client_with(Duration::from_secs(2));
    let old = cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    let rest: Vec<u64> = cluster
        .running()
        .into_iter()
        .filter(|id| *id != old.node_id)
        .collect();
    cluster.partition(&[old.node_id], &rest);
    eventually("the majority elects a new leader", || async {
        for &id in &rest {
            if let Ok(status) = client.status_of(&cluster.addr(id)).await
                && status.role == "leader"
                && status.term > old.term
            {
                return true;
            }
        }
        false
    })
    .await;
    cluster.heal_network();
    let healed = cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    assert_ne!(healed.term, old.term);
    write_works(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_way_cut_and_a_killed_leader_both_heal() {
    let mut cluster = cluster().await;
    let client = cluster.client_with(Duration::from_secs(2));
    let leader = cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    // The leader cannot send to anyone; it can still be sent to.
    for id in cluster.running() {
        if id != leader.node_id {
            cluster.set_link(leader.node_id, id, tether_chaos::proxy::LinkMode::Blackhole);
        }
    }
    eventually("a follower takes over", || async {
        cluster
            .statuses(&client)
            .await
            .values()
            .any(|s| s.role == "leader" && s.term > leader.term)
    })
    .await;
    cluster.heal_network();
    let now = cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    cluster.kill(now.node_id);
    eventually("another leader after kill -9", || async {
        cluster
            .statuses(&client)
            .await
            .values()
            .any(|s| s.role == "leader" && s.node_id != now.node_id)
    })
    .await;
    cluster.restart(now.node_id, None).unwrap();
    cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    write_works(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_replica_stops_answering_and_a_replaced_member_serves() {
    let mut cluster = cluster().await;
    let client = cluster.client_with(Duration::from_secs(2));
    let leader = cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    let follower = cluster
        .running()
        .into_iter()
        .find(|id| *id != leader.node_id)
        .unwrap();
    cluster.pause(follower).await;
    let addr = cluster.addr(follower);
    let answer = tokio::time::timeout(Duration::from_millis(500), client.status_of(&addr)).await;
    assert!(
        !matches!(answer, Ok(Ok(_))),
        "a SIGSTOPped replica answered"
    );
    cluster.resume(follower);
    cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    let new = cluster
        .replace(follower)
        .await
        .unwrap()
        .expect("a spare slot");
    let voters = cluster.voters(&client).await;
    assert!(
        voters.contains(&new) && !voters.contains(&follower),
        "{voters:?}"
    );
    cluster
        .wait_converged(Duration::from_secs(60))
        .await
        .unwrap();
    write_works(&cluster).await;
}
