//! The sitting leader's wall clock steps while it leads (a VM resumed, an
//! NTP step), 10 minutes ahead and then 10 minutes behind, on 3 replicas.
//! Committed time follows the leader's monotonic clock and only slews
//! towards the stepped wall clock (`replica/clock.rs`), so a TTL lease kept
//! alive every third of its TTL keeps its hold through the forward step
//! (before, it expired within seconds and its waiter was granted while the
//! keeper believed it held), and committed time keeps moving through the
//! backward step (before, it froze, and a lease whose keeper stopped never
//! expired). Needs `--features failpoints` (`clock-offset-ms` moves every
//! in-process replica's clock, the leader's among them); the failpoint is
//! process-wide, so this file holds one test.
#![cfg(feature = "failpoints")]

mod common;

use openraft::async_runtime::WatchReceiver as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{Cluster, DEADLINE, lock, pod};

const TTL: Duration = Duration::from_secs(6);
const STEP_MS: i64 = 600_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_clock_step_on_the_sitting_leader_neither_expires_kept_alive_leases_nor_freezes_time() {
    let cluster = Cluster::start(3).await;
    let client = common::client(&cluster);
    let leader = cluster.wait_leader().await;
    let committed = || cluster.node(leader).core().state.read().state.now_ms;
    let key = lock("node-clock");
    let lease = client.grant_lease(TTL).await.unwrap();
    client
        .acquire(&key, &pod("keeper"), vec![], Duration::ZERO, lease)
        .await
        .unwrap();
    let waiter = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .acquire(&key, &pod("next"), vec![], DEADLINE * 2, 0)
                .await
        })
    };
    // The keeper's keep-alives, every third of the TTL, counted.
    let kept = Arc::new(AtomicU32::new(0));
    let keeper = {
        let (client, kept) = (client.clone(), kept.clone());
        tokio::spawn(async move {
            loop {
                client
                    .keep_alive_once(lease)
                    .await
                    .expect("the kept-alive lease lives");
                kept.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(TTL / 3).await;
            }
        })
    };

    // The leader leads for two TTLs first, so that its lock-delay (a new
    // leader ends nothing before it has led for the TTL) is behind it.
    let started = committed();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while committed() < started + 2 * TTL.as_millis() as u64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "committed time moves on"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Ten minutes ahead, while it leads. Wait until committed time has
    // moved on by three TTLs and the keeper has kept the lease alive four
    // times: before, one sweep found the lease past its expiry and ended
    // its hold, and the next keep-alive was told the lease was gone.
    fail::cfg("clock-offset-ms", &format!("return({STEP_MS})")).unwrap();
    let stepped_at = committed();
    let kept_before = kept.load(Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while committed() < stepped_at + 3 * TTL.as_millis() as u64
        || kept.load(Ordering::SeqCst) < kept_before + 4
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "committed time moves on"
        );
        assert!(
            !keeper.is_finished(),
            "the kept-alive lease expired after a clock step ahead"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        cluster
            .node(leader)
            .raft()
            .metrics()
            .borrow_watched()
            .current_leader,
        Some(leader),
        "the leader stayed (its clock stepped while it led)"
    );
    assert!(
        !waiter.is_finished(),
        "the waiter was granted over the keeper"
    );
    let holder = client.holder(&key).await.unwrap().unwrap();
    assert_eq!(holder.pod.unwrap().uid, "keeper");
    assert!(
        committed() < stepped_at + STEP_MS as u64 / 2,
        "committed time followed the step"
    );

    // Ten minutes behind. The keeper stops: the lease must still expire,
    // and the waiter be granted, with committed time moving on.
    fail::cfg("clock-offset-ms", &format!("return({})", -STEP_MS)).unwrap();
    keeper.abort();
    let stopped = tokio::time::Instant::now();
    let granted = tokio::time::timeout(DEADLINE, waiter)
        .await
        .expect("the waiter is granted once the lease expires")
        .unwrap()
        .unwrap();
    assert_eq!(granted.pod_uid(), "next");
    println!(
        "clock stepped back {STEP_MS} ms: the stopped keeper's {TTL:?} lease expired and the \
         waiter was granted {:?} later",
        stopped.elapsed()
    );
    fail::remove("clock-offset-ms");
    cluster.shutdown().await;
}
