//! Cluster ids keep clusters apart: every cluster draws one, every response
//! names it, and a client that has used one cluster refuses a replica of
//! another (nothing is done there); a replica refuses the Raft messages of
//! another cluster's leader. The StatefulSet tests (`tests/statefulset.rs`)
//! check that the members of a set share one id, and that a restored backup
//! is a new cluster.

use std::time::Duration;

use tether_client::proto::lock_service_client::LockServiceClient;
use tether_client::proto::{HolderRequest, LockKey, Pod};
use tether_client::{Client, Error, Options};
use tether_server::Node;
use tether_server::testing::{single_node, test_config};

const DEADLINE: Duration = Duration::from_secs(60);

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

fn client(addrs: &[&Node]) -> Client {
    Client::new(
        addrs.iter().map(|n| n.addr().to_string()),
        Options {
            call_timeout: Duration::from_secs(2),
            retry_timeout: Duration::from_secs(10),
            ..Options::default()
        },
    )
    .unwrap()
}

/// The cluster id `node` reports, once it has one.
async fn cluster_id(node: &Node) -> String {
    let client = client(&[node]);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Ok(status) = client.status_of(&node.addr().to_string()).await
            && !status.cluster_id.is_empty()
        {
            return status.cluster_id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no cluster id within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_used_one_cluster_refuses_a_replica_of_another() {
    let dir = tempfile::tempdir().unwrap();
    let a = single_node(&dir.path().join("a")).await;
    let b = single_node(&dir.path().join("b")).await;
    let (id_a, id_b) = (cluster_id(&a).await, cluster_id(&b).await);
    assert_ne!(id_a, id_b, "each cluster draws its own id");

    // Every response names the cluster: in metadata and in the header,
    // refusals included.
    let mut raw = LockServiceClient::connect(format!("http://{}", b.addr()))
        .await
        .unwrap();
    let answer = raw
        .holder(HolderRequest {
            key: Some(key("node-a")),
            ..Default::default()
        })
        .await
        .unwrap();
    let named = answer
        .metadata()
        .get(tether_client::proto::CLUSTER_ID_METADATA)
        .map(|v| v.to_str().unwrap().to_string());
    assert_eq!(named.as_deref(), Some(id_b.as_str()));
    assert_eq!(answer.into_inner().header.unwrap().cluster_id, id_b);
    let refused = raw
        .holder(HolderRequest {
            key: None,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        refused
            .metadata()
            .get(tether_client::proto::CLUSTER_ID_METADATA)
            .map(|v| v.to_str().unwrap()),
        Some(id_b.as_str()),
        "a refusal names the cluster too"
    );

    // A client of [a, b] uses a (its first endpoint) ...
    let both = client(&[&a, &b]);
    both.acquire(&key("node-a"), &pod("uid-1"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    // ... and, a gone, refuses to use b: b does nothing.
    a.shutdown().await;
    let err = both
        .acquire(&key("node-b"), &pod("uid-2"), vec![], Duration::ZERO, 0)
        .await
        .unwrap_err();
    let Error::WrongCluster(message) = &err else {
        panic!("expected a wrong-cluster refusal, got {err:?}");
    };
    assert!(
        message.contains(&id_a) && message.contains(&id_b),
        "the refusal names both clusters: {message}"
    );
    assert_eq!(err.exit_code(), 8);
    let only_b = client(&[&b]);
    assert!(
        only_b.holder(&key("node-b")).await.unwrap().is_none(),
        "the refused acquire changed nothing on b"
    );
    // A new client (restarted after, say, a restore) uses b.
    only_b
        .acquire(&key("node-b"), &pod("uid-2"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_keeps_its_cluster_id_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let node = single_node(dir.path()).await;
    let id = cluster_id(&node).await;
    node.shutdown().await;
    let node = single_node(dir.path()).await;
    assert_eq!(cluster_id(&node).await, id);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refuses_the_raft_messages_of_another_clusters_leader() {
    let dir = tempfile::tempdir().unwrap();
    let a = single_node(&dir.path().join("a")).await;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let b = Node::start_with(test_config(2, &dir.path().join("b")), grpc, http)
        .await
        .unwrap();
    let id_b = cluster_id(&b).await;
    let b_client = client(&[&b]);
    b_client
        .acquire(&key("node-b"), &pod("uid-b"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    let before = b_client.status_of(&b.addr().to_string()).await.unwrap();

    // a's leader is told that b is its learner: it replicates to b, and b
    // refuses every message (another cluster's id).
    let a_client = client(&[&a]);
    a_client
        .add_learner(2, &b.addr().to_string(), false)
        .await
        .unwrap();
    for n in 0..20 {
        a_client
            .acquire(
                &key(&format!("a-{n}")),
                &pod("uid-a"),
                vec![],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline {
        let now = b_client.status_of(&b.addr().to_string()).await.unwrap();
        assert_eq!(
            (now.last_log_index, now.term, now.cluster_id.as_str()),
            (before.last_log_index, before.term, id_b.as_str()),
            "b took nothing from a"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let leader = a_client.leader_status().await.unwrap();
    let learner = leader.members.iter().find(|m| m.node_id == 2).unwrap();
    assert_eq!(learner.matched_index, 0, "a never replicated to b");
    assert!(
        b_client.holder(&key("node-b")).await.unwrap().is_some(),
        "b's own state is intact"
    );
    a.shutdown().await;
    b.shutdown().await;
}
