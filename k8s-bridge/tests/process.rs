//! The `tether-bridge` binary as Kubernetes runs it: a process that must stop
//! on SIGTERM. As a container's PID 1 it gets no default SIGTERM action, so
//! without its own handler every pod stop would wait out the whole
//! termination grace period and end in SIGKILL.

mod fake_apiserver;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApi, node};
use tether_server::testing::{Cluster, DEADLINE};

/// `GET path` on `addr`; the raw answer.
fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_stops_the_bridge_at_once() {
    let cluster = Cluster::start(1).await;
    let api = FakeApi::start().await;
    api.put_node(node("n1", true, "a"));
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    \
             user: u\ncurrent-context: c\n",
            api.url
        ),
    )
    .unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut bridge = Command::new(env!("CARGO_BIN_EXE_tether-bridge"))
        .args([
            "--endpoints",
            &cluster.endpoints().join(","),
            "--http-listen",
            &http,
        ])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !http_get(&http, "/health").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
        if started.elapsed() > DEADLINE {
            let _ = bridge.kill();
            panic!("the bridge did not become healthy");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = Command::new("kill")
        .args(["-TERM", &bridge.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let signalled = Instant::now();
    let exit = loop {
        if let Some(exit) = bridge.try_wait().unwrap() {
            break exit;
        }
        if signalled.elapsed() > Duration::from_secs(10) {
            let _ = bridge.kill();
            panic!("the bridge ignored SIGTERM for 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut log = String::new();
    bridge
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    println!("stopped {:?} after SIGTERM", signalled.elapsed());
    assert!(exit.success(), "exit {exit:?}; log:\n{log}");
    assert!(log.contains("SIGTERM"), "log:\n{log}");
    cluster.shutdown().await;
}
