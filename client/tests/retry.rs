//! The client's retry path: the answer to an applied request is lost (a
//! proxy swallows it), the client times out and retries on another endpoint
//! with the same request id, and gets the original answer; the state shows
//! one application.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tether_client::{Client, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Forwards TCP to `target`; while `swallow` is set, bytes coming back from
/// the server are read and dropped (the request arrives, the answer never
/// does).
async fn lossy_proxy(
    target: std::net::SocketAddr,
    swallow: Arc<AtomicBool>,
) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let swallow = swallow.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(
                    async move { tokio::io::copy(&mut client_read, &mut server_write).await },
                );
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = match server_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if !swallow.load(Ordering::SeqCst)
                        && client_write.write_all(&buf[..n]).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_a_lost_answer_returns_the_original_answer_and_applies_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = tether_server::testing::single_node(dir.path()).await;

    let swallow = Arc::new(AtomicBool::new(false));
    let proxy = lossy_proxy(node.addr(), swallow.clone()).await;
    // The first attempt must reach the server before the client gives up on
    // it, or there is nothing to deduplicate: with 1.5 s a loaded CI machine
    // (three test binaries at once) once let the timeout fire first, and the
    // retry was the only write (CI run of 44309c5).
    let options = Options {
        call_timeout: Duration::from_secs(5),
        retry_timeout: Duration::from_secs(30),
        client_id: Some("retry-client".into()),
        ..Options::default()
    };
    // The proxy first: the first attempt goes through it.
    let client = Client::new([proxy.to_string(), node.addr().to_string()], options).unwrap();
    // Warm the connection through the proxy, then start swallowing answers.
    client
        .holder(&tether_client::proto::LockKey {
            scope: "gpu-bind".into(),
            name: "n1".into(),
        })
        .await
        .unwrap();
    swallow.store(true, Ordering::SeqCst);

    let before = node.core().state.read().last_applied.map_or(0, |l| l.index);
    let started = std::time::Instant::now();
    let lease_id = client
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("the retry succeeds");
    eprintln!("grant with a lost answer took {:?}", started.elapsed());
    let leases: Vec<u64> = node
        .core()
        .state
        .read()
        .state
        .leases
        .keys()
        .copied()
        .collect();
    assert_eq!(
        leases,
        vec![lease_id],
        "applied exactly once, and the retry got the original lease id"
    );
    // Both attempts reached the log (the retry is answered from the dedupe
    // table, as its own entry), but only one of them granted.
    // The state machine's own position: openraft 0.10 answers a write as
    // the state machine applies it, before its metrics show the apply.
    let applied = node.core().state.read().last_applied.map_or(0, |l| l.index);
    assert_eq!(
        applied - before,
        2,
        "one application plus one deduplicated retry"
    );
    assert_eq!(
        lease_id,
        before + 1,
        "the lease id is the index of the first, applied attempt"
    );
    node.stop().await;
}

/// A process that restarts with the same configured client id must not meet
/// its previous incarnation's session: its sequences start at 1 again, and
/// the server would answer them from the old incarnation's kept answers
/// (another lock's hold) or refuse them as too old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_client_with_a_stable_id_gets_a_session_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let node = tether_server::testing::single_node(dir.path()).await;
    let options = || Options {
        client_id: Some("extender-0".into()),
        ..Options::default()
    };
    let key = |name: &str| tether_client::proto::LockKey {
        scope: "gpu-bind".into(),
        name: name.into(),
    };
    let pod = |uid: &str| tether_client::proto::Pod {
        uid: uid.into(),
        namespace: "ml".into(),
        name: format!("train-{uid}"),
    };
    let first = Client::new([node.addr().to_string()], options()).unwrap();
    let held = first
        .acquire(&key("node-a"), &pod("a"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    // The "restart": a new client, same options, sequence 1 again.
    let second = Client::new([node.addr().to_string()], options()).unwrap();
    assert_ne!(first.client_id(), second.client_id());
    assert!(second.client_id().starts_with("extender-0."));
    let other = second
        .acquire(&key("node-b"), &pod("b"), vec![], Duration::ZERO, 0)
        .await
        .expect("applied as a new request");
    assert_eq!(other.pod.as_ref().unwrap().uid, "b");
    assert_ne!(other.token, held.token);
    let state = node.core().state.read();
    assert!(
        state
            .state
            .locks
            .contains_key(&tether_server::sm::LockKey::new("gpu-bind", "node-b"))
    );
    assert_eq!(state.state.sessions.len(), 2, "one session per incarnation");
    drop(state);
    // A configured id the server could not take with the incarnation added
    // is refused at once.
    let long = Options {
        client_id: Some("x".repeat(tether_client::MAX_CLIENT_ID_PREFIX_LEN + 1)),
        ..Options::default()
    };
    assert!(matches!(
        Client::new([node.addr().to_string()], long),
        Err(tether_client::Error::InvalidArgument(_))
    ));
}
