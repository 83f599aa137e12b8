//! Handshakes through `incoming` with real certificates: who the server sees,
//! strangers refused, a rotated certificate taken up without a restart.

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use tether_tls::testing::TestCa;
use tether_tls::{Conn, TlsMaterial, incoming};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_stream::StreamExt;
use tonic::transport::server::Connected;

const DEADLINE: Duration = Duration::from_secs(20);

async fn server(
    tls: Arc<TlsMaterial>,
) -> (
    std::net::SocketAddr,
    impl tokio_stream::Stream<Item = std::io::Result<Conn>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (addr, Box::pin(incoming(listener, Some(tls))))
}

async fn dial(addr: std::net::SocketAddr, client: &Arc<TlsMaterial>) -> std::io::Result<()> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = TlsConnector::from(client.client_config())
        .connect(name, tcp)
        .await?;
    // TLS 1.3 reports a refused client certificate on the first read.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tls.write_all(b"x").await?;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(Duration::from_millis(300), tls.read(&mut byte)).await {
        Ok(Err(err)) => Err(err),
        _ => Ok(()),
    }
}

#[tokio::test]
async fn the_server_sees_the_client_certificates_name_and_refuses_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("tether-test-ca");
    let server_tls =
        TlsMaterial::load(ca.write_dir(&dir.path().join("server"), "replica", &["127.0.0.1"]))
            .unwrap();
    let client_tls = TlsMaterial::load(ca.write_dir(
        &dir.path().join("client"),
        "device-plugin:node-a",
        &["localhost"],
    ))
    .unwrap();
    let (addr, mut conns) = server(server_tls).await;
    let dialled = tokio::spawn({
        let client_tls = client_tls.clone();
        async move { dial(addr, &client_tls).await }
    });
    let conn = tokio::time::timeout(DEADLINE, conns.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let identity = conn.connect_info().identity.unwrap().unwrap();
    assert_eq!(identity.name, "device-plugin:node-a");
    dialled.await.unwrap().unwrap();

    // A certificate from another CA: the handshake fails on both sides and
    // no connection comes out of `incoming`.
    let other = TestCa::new("someone-else");
    let stranger =
        TlsMaterial::load(other.write_dir(&dir.path().join("stranger"), "admin", &["localhost"]))
            .unwrap();
    // The server's handshakes progress only while its stream is polled.
    let refused = tokio::spawn(async move { dial(addr, &stranger).await });
    assert!(
        tokio::time::timeout(Duration::from_secs(1), conns.next())
            .await
            .is_err(),
        "no connection is handed to the server"
    );
    let refused = tokio::time::timeout(DEADLINE, refused)
        .await
        .unwrap()
        .unwrap();
    assert!(refused.is_err(), "a stranger's certificate is refused");
}

#[tokio::test]
async fn a_rotated_certificate_is_used_for_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("tether-test-ca");
    let server_tls =
        TlsMaterial::load(ca.write_dir(&dir.path().join("server"), "replica", &["127.0.0.1"]))
            .unwrap();
    let client_dir = dir.path().join("client");
    let client_tls =
        TlsMaterial::load(ca.write_dir(&client_dir, "scheduler", &["localhost"])).unwrap();
    let _watch = client_tls.watch(Duration::from_millis(50));
    assert!(!client_tls.reload().unwrap(), "nothing changed yet");

    ca.write_dir(&client_dir, "bridge", &["localhost"]);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while client_tls.identity().name != "bridge" {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watcher never took up the new certificate"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (addr, mut conns) = server(server_tls).await;
    let dialled = tokio::spawn({
        let client_tls = client_tls.clone();
        async move { dial(addr, &client_tls).await }
    });
    let conn = tokio::time::timeout(DEADLINE, conns.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        conn.connect_info().identity.unwrap().unwrap().name,
        "bridge"
    );
    dialled.await.unwrap().unwrap();

    // A broken rotation (a key that does not fit) keeps the working pair.
    std::fs::write(
        &client_tls.files().key,
        TestCa::new("x").issue("y", &["localhost"]).1,
    )
    .unwrap();
    let err = client_tls.reload().unwrap_err().to_string();
    assert!(err.contains("does not fit"), "{err}");
    assert_eq!(client_tls.identity().name, "bridge");
}
