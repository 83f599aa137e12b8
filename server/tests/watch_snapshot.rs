//! A watch asleep on a replica that then installs a snapshot is woken: the
//! install emits no events, and the watch's position may be compacted
//! away by it, so the watch must be told to re-list (`OUT_OF_RANGE`) at
//! once, not at the next event, which on a quiet cluster never comes. (A
//! chaos run once ended with a watcher that "did not reach" the last
//! revision for this reason.) The failpoint `sm-install-snapshot-before`
//! holds the install back long enough to open the watch first, so the
//! failpoints feature is needed; failpoints are process-wide, so this file
//! holds one test.
#![cfg(feature = "failpoints")]

use openraft::async_runtime::WatchReceiver as _;
use std::time::Duration;

use tether_client::proto::watch_service_client::WatchServiceClient;
use tether_client::proto::{LockKey, Pod, Revision, WatchRequest};
use tether_client::{Client, Options};
use tether_server::Node;
use tether_server::testing::{single_node_with, test_config};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_install_wakes_a_watch_whose_position_it_compacted() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing kept after a snapshot: a new member gets the snapshot.
    let leader = single_node_with(&dir.path().join("1"), |c| c.keep_logs_after_snapshot = 0).await;
    let client = Client::new(
        [leader.addr().to_string()],
        Options {
            retry_timeout: Duration::from_secs(30),
            ..Options::default()
        },
    )
    .unwrap();
    for i in 0..10 {
        client
            .acquire(
                &LockKey {
                    scope: "gpu-bind".into(),
                    name: format!("node-{i}"),
                },
                &Pod {
                    uid: format!("uid-{i}"),
                    namespace: "ml".into(),
                    name: format!("train-{i}"),
                },
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }

    // Replica 2's address exists but nothing serves it yet: it is added as
    // a learner, and then a snapshot covers every entry (the additions
    // included) and the log is purged, so it can only catch up by
    // installing that snapshot, after which nothing is applied.
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    client.add_learner(2, &addr, false).await.unwrap();
    let covered = client.snapshot().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while leader
        .raft()
        .metrics()
        .borrow_watched()
        .purged
        .map_or(0, |l| l.index)
        < covered
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the log was not purged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    fail::cfg("sm-install-snapshot-before", "sleep(2000)").unwrap();
    let mut config = test_config(2, &dir.path().join("2"));
    config.initial_members = Some(format!("1={},2={addr}", leader.addr()));
    let learner = Node::start_with(config, grpc, http).await.unwrap();
    let mut watch = WatchServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .watch(WatchRequest {
            start: Some(Revision { index: 1, sub: 0 }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        }
    })
    .await;
    fail::remove("sm-install-snapshot-before");
    let status = ended
        .expect("the watch was not woken by the snapshot install")
        .expect("the watch ends with an error");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    // It was the install (openraft reports it just after).
    learner
        .raft()
        .wait(Some(Duration::from_secs(30)))
        .metrics(
            |m| m.snapshot.is_some_and(|l| l.index >= covered),
            "the snapshot installed",
        )
        .await
        .unwrap();
    println!("told to re-list after installing the snapshot at {covered}: {status:?}");
    learner.stop().await;
    leader.stop().await;
}
