//! Backup and restore: a snapshot exported from a running cluster becomes a
//! new one-member cluster with the same state, and fencing tokens keep
//! growing from where they were.

use std::time::Duration;

use openraft::ServerState;
use tether_client::proto::{LockKey, Outcome, Pod};
use tether_client::{Client, Options};
use tether_server::Node;
use tether_server::testing::test_config;
use tokio::net::TcpListener;

fn client(node: &Node) -> Client {
    Client::new(
        [node.addr().to_string()],
        Options {
            retry_timeout: Duration::from_secs(60),
            ..Options::default()
        },
    )
    .unwrap()
}

fn key(name: &str) -> LockKey {
    LockKey {
        scope: "gpu-bind".into(),
        name: name.into(),
    }
}

fn pod(uid: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "ml".into(),
        name: uid.into(),
    }
}

async fn start(config: tether_server::Config) -> anyhow::Result<Node> {
    let grpc = TcpListener::bind("127.0.0.1:0").await?;
    let http = TcpListener::bind("127.0.0.1:0").await?;
    Node::start_with(config, grpc, http).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_snapshot_restores_as_a_new_cluster_with_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let original = start(test_config(9, &dir.path().join("original")))
        .await
        .unwrap();
    original
        .raft()
        .wait(Some(Duration::from_secs(60)))
        .state(ServerState::Leader, "the original replica leads")
        .await
        .unwrap();
    let tether = client(&original);
    let held = tether
        .acquire(
            &key("node-a"),
            &pod("uid-a"),
            b"gpu0".to_vec(),
            Duration::ZERO,
            0,
        )
        .await
        .unwrap();
    for n in 0..20 {
        let h = tether
            .acquire(
                &key("node-b"),
                &pod(&format!("uid-b{n}")),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
        h.release(Outcome::Allocated).await.unwrap();
    }
    let (index, backup) = tether.export_snapshot().await.unwrap();
    assert!(index > 20, "the snapshot covers the writes: {index}");
    let file = dir.path().join("backup.snap");
    std::fs::write(&file, &backup).unwrap();
    original.shutdown().await;

    // Restoring needs an empty data directory.
    let mut refused = test_config(9, &dir.path().join("original"));
    refused.restore_from = Some(file.clone());
    let err = match start(refused).await {
        Ok(_) => panic!("restored over existing data"),
        Err(err) => format!("{err:#}"),
    };
    assert!(err.contains("empty data directory"), "{err}");

    // Restored under an id below the original leader's (9), in the
    // backup's term: the restored replica must still win its election (it
    // once stopped there, its vote not above the last entry's leader).
    let mut config = test_config(7, &dir.path().join("restored"));
    config.restore_from = Some(file);
    let restored = start(config).await.expect("the backup restores");
    restored
        .raft()
        .wait(Some(Duration::from_secs(60)))
        .state(ServerState::Leader, "the restored replica leads")
        .await
        .unwrap();
    let tether = client(&restored);
    let hold = tether
        .holder(&key("node-a"))
        .await
        .unwrap()
        .expect("still held");
    assert_eq!(
        (hold.token, hold.pod.unwrap().uid, hold.payload),
        (held.token(), "uid-a".to_string(), b"gpu0".to_vec())
    );
    let next = tether
        .acquire(&key("node-c"), &pod("uid-c"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(
        next.token() > index,
        "tokens go on from the backup's position"
    );
    let status = tether.leader_status().await.unwrap();
    assert_eq!(status.members.len(), 1);
    assert_eq!(status.members[0].node_id, 7);
    restored.shutdown().await;
}
