//! A leader cut off with writes pending, whose log the rest of the cluster
//! then outruns by a snapshot, answers those writes and sweeps again once
//! it leads again. openraft 0.9 left such writes unanswered for ever
//! (`replica/commit.rs` says why; 0.10 answers them "forward to the
//! leader", and commit.rs's timeout stays as the net); the leader's sweeper, which awaits its
//! writes one after another, then never swept again, and while that
//! replica led no hold timed out (CI's chaos run of 8163a6b, seed 146: a
//! waiter behind a hold past its timeout, never granted). The partition is
//! the failpoint `raft-cut-off`, so the failpoints feature is needed;
//! failpoints are process-wide, so this file holds one test.
#![cfg(feature = "failpoints")]

use openraft::async_runtime::WatchReceiver as _;
use std::time::Duration;

use tether_client::proto::{LockKey, Outcome, Pod};
use tether_client::{Client, Options};
use tether_server::sm::Command;
use tether_server::sm::command::Acquire;
use tether_server::testing::Cluster;

const DEADLINE: Duration = Duration::from_secs(60);

/// A scope whose holds time out after this long.
const SHORT: &str = "short";
const SHORT_HOLD: Duration = Duration::from_secs(3);

fn key(name: &str) -> LockKey {
    LockKey {
        scope: SHORT.into(),
        name: name.into(),
    }
}

fn pod(name: &str) -> Pod {
    Pod {
        uid: format!("uid-{name}"),
        namespace: "ml".into(),
        name: name.into(),
    }
}

/// Polls `condition` every 20 ms until it holds or [`DEADLINE`] passes.
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_pending_writes_a_snapshot_outran_answers_them_and_sweeps_again() {
    let cluster = Cluster::start_with(3, |c| {
        c.keep_logs_after_snapshot = 0;
        c.scope_hold_timeouts.insert(SHORT.into(), SHORT_HOLD);
    })
    .await;
    let old = cluster.wait_leader().await;
    let others: Vec<u64> = (1..=3).filter(|id| *id != old).collect();
    let options = Options {
        retry_timeout: DEADLINE,
        ..Options::default()
    };
    let client = Client::new(cluster.endpoints(), options.clone()).unwrap();
    let old_term = cluster
        .node(old)
        .raft()
        .metrics()
        .borrow_watched()
        .current_term;

    // A hold that comes due while the leader is cut off: its sweeper then
    // proposes a sweep that no quorum will commit.
    client
        .acquire(&key("due-while-cut"), &pod("a"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    fail::cfg("raft-cut-off", &format!("return({old})")).unwrap();
    // And a handler's write (an acquire, through the batching), pending
    // likewise.
    let pending = {
        let core = cluster.node(old).core().clone();
        tokio::spawn(async move {
            core.write(
                None,
                Command::Acquire(Acquire {
                    key: tether_server::sm::LockKey::new(SHORT, "written-while-cut"),
                    pod: tether_server::sm::Pod {
                        uid: "uid-b".into(),
                        namespace: "ml".into(),
                        name: "b".into(),
                    },
                    payload: vec![],
                    wait_ms: 0,
                    lease_id: 0,
                    client_id: String::new(),
                    queue_limit: 0,
                }),
            )
            .await
        })
    };

    // The other two elect a leader and move on: entries, then a snapshot
    // past the end of the old leader's log, and the log purged.
    let mut new = 0;
    wait_until("a new leader among the others", || {
        new = others
            .iter()
            .copied()
            .find(|id| {
                let m = cluster.node(*id).raft().metrics().borrow_watched().clone();
                m.current_leader == Some(*id) && m.current_term > old_term
            })
            .unwrap_or(0);
        new != 0
    })
    .await;
    let rest = Client::new(
        others
            .iter()
            .map(|id| cluster.node(*id).addr().to_string())
            .collect::<Vec<_>>(),
        options,
    )
    .unwrap();
    let old_last = cluster
        .node(old)
        .raft()
        .metrics()
        .borrow_watched()
        .last_log_index;
    let old_last = old_last.unwrap_or(0);
    let mut covered = 0;
    let mut round = 0;
    while covered <= old_last + 5 {
        for _ in 0..10 {
            round += 1;
            let name = format!("moving-on-{round}");
            let held = rest
                .acquire(&key(&name), &pod(&name), vec![], Duration::ZERO, 0)
                .await
                .unwrap();
            rest.release(&key(&name), &pod(&name).uid, held.token, Outcome::Allocated)
                .await
                .unwrap();
        }
        covered = cluster.node(new).core().snapshot().await.unwrap();
    }
    wait_until("the new leader's log purged", || {
        let m = cluster.node(new).raft().metrics().borrow_watched().clone();
        m.purged.is_some_and(|p| p.index >= covered)
    })
    .await;
    println!(
        "old leader {old} cut off at index {old_last}; leader {new} snapshotted up to {covered}"
    );

    // Healed: the old leader can only catch up by installing the snapshot,
    // which strands what it proposed while cut off.
    fail::remove("raft-cut-off");
    wait_until("the old leader installed the snapshot", || {
        let m = cluster.node(old).raft().metrics().borrow_watched().clone();
        m.snapshot.is_some_and(|s| s.index >= covered)
    })
    .await;
    let answer = tokio::time::timeout(DEADLINE, pending)
        .await
        .expect("the write pending on the old leader was never answered")
        .unwrap();
    println!("the write pending on the old leader: {answer:?}");
    let err = answer.expect_err("a write no quorum saw cannot have succeeded");
    let status = tonic::Status::from(err);
    // Retryable either way: openraft 0.10 answers "forward to the leader"
    // when the entry is truncated; commit.rs's timeout says "outcome is
    // unknown" when no answer comes.
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("outcome is unknown")
            || status.message().contains("not the leader"),
        "{status:?}"
    );

    // Leading again, the old leader's sweeper ends a hold past its timeout.
    // Only a round in which it led throughout (one term from the acquire
    // to the hold's end) shows that: on a loaded machine an election can
    // move leadership while the hold runs out, and then the round is tried
    // again.
    let term_of = |id: u64| {
        cluster
            .node(id)
            .raft()
            .metrics()
            .borrow_watched()
            .current_term
    };
    let mut shown = false;
    for round in 1..=5 {
        let leader = cluster.wait_leader().await;
        if leader != old {
            cluster
                .node(leader)
                .core()
                .transfer_leader(old)
                .await
                .unwrap();
        }
        if cluster.wait_leader().await != old {
            println!("round {round}: {old} did not take over; again");
            continue;
        }
        let term = term_of(old);
        let due = key(&format!("due-after-{round}"));
        client
            .acquire(&due, &pod("c"), vec![], Duration::ZERO, 0)
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while client.holder(&due).await.unwrap().is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the hold was not ended by its timeout (round {round})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if cluster.wait_leader().await == old && term_of(old) == term {
            shown = true;
            break;
        }
        println!("round {round}: leadership moved while the hold ran out; again");
    }
    assert!(
        shown,
        "no round in which {old} led throughout while a hold ran out"
    );
    cluster.shutdown().await;
}
