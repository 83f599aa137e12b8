//! A replica whose Raft core stops on its own (here: the disk refuses a log
//! write, failpoint `log-append-error`) stops pretending to be alive:
//! `/live` fails, open watches end with `UNAVAILABLE` so their clients move
//! to another replica, and the node reports why (tetherd's `main` then
//! exits with status 1; the chaos test
//! `a_replica_whose_raft_core_stops_exits_and_recovers_when_restarted` sees
//! that exit and the recovery). Needs `--features failpoints`; the
//! failpoint is process-wide, so this file holds one test.
#![cfg(feature = "failpoints")]

use std::time::Duration;

use tether_client::proto::watch_service_client::WatchServiceClient;
use tether_client::proto::{LockKey, Pod, WatchRequest};
use tether_client::{Client, Options};
use tether_server::testing::single_node;

const DEADLINE: Duration = Duration::from_secs(60);

/// `GET /live`: the status line, or None when nothing answers.
async fn live(addr: std::net::SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response.lines().next().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_raft_core_stops_fails_live_and_ends_its_watches() {
    let dir = tempfile::tempdir().unwrap();
    let node = single_node(dir.path()).await;
    assert_eq!(
        live(node.http_addr()).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    let mut watch = WatchServiceClient::connect(format!("http://{}", node.addr()))
        .await
        .unwrap()
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();

    // The next log write fails: openraft's core stops on the storage error.
    fail::cfg("log-append-error", "return").unwrap();
    let client = Client::new(
        [node.addr().to_string()],
        Options {
            call_timeout: Duration::from_secs(2),
            retry_timeout: Duration::from_secs(2),
            ..Options::default()
        },
    )
    .unwrap();
    let key = LockKey {
        scope: "gpu-bind".into(),
        name: "node-a".into(),
    };
    let pod = Pod {
        uid: "uid-1".into(),
        namespace: "ml".into(),
        name: "train-0".into(),
    };
    let written = client.acquire(&key, &pod, vec![], Duration::ZERO, 0).await;
    assert!(
        written.is_err(),
        "written with a refusing disk: {written:?}"
    );

    let why = tokio::time::timeout(DEADLINE, node.core_stopped())
        .await
        .expect("the node notices its core stopped");
    println!("core stopped: {why}");
    fail::remove("log-append-error");

    // The watch ends with UNAVAILABLE (events sent before are fine).
    let ended = tokio::time::timeout(DEADLINE, async {
        loop {
            match watch.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        }
    })
    .await
    .expect("the watch ends");
    let status = ended.expect("the watch ends with an error, not quietly");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");

    // /live fails: 503, or nothing answers any more.
    let after = live(node.http_addr()).await;
    assert!(
        after.as_deref() != Some("HTTP/1.1 200 OK"),
        "/live still says alive: {after:?}"
    );
    println!("/live after the core stopped: {after:?}");
    node.stop().await;
}
