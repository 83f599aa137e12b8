//! Both binaries stop cleanly on SIGTERM, which is how the kubelet stops a
//! pod: exit status 0, promptly, their socket or port given up. Before that,
//! each answers `/metrics` on its HTTP port.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tether_kube_testenv::unused_port;

const DEADLINE: Duration = Duration::from_secs(60);

fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill(1)");
    assert!(status.success());
}

fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} did not stop within {DEADLINE:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` over HTTP/1.1: the whole answer, or `None` if nothing
/// listens yet.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: plugin\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

#[test]
fn the_device_plugin_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let http_port = unused_port();
    let mut plugin = Command::new(env!("CARGO_BIN_EXE_tether-device-plugin"))
        .arg(format!("--plugin-dir={}", dir.path().display()))
        .arg(format!("--http-listen=127.0.0.1:{http_port}"))
        .arg("--endpoints=127.0.0.1:1")
        .env("NODE_NAME", "gpu-node-1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let socket = dir.path().join("tether-gpu.sock");
    // No kubelet answers: the plugin serves its socket and keeps trying to
    // register, which a SIGTERM must interrupt.
    wait_until("the plugin socket", || socket.exists());
    // Its HTTP side answers meanwhile: no registration yet, nothing served.
    let mut metrics = String::new();
    wait_until("/metrics", || {
        metrics = http_get(http_port, "/metrics").unwrap_or_default();
        metrics.starts_with("HTTP/1.1 200")
    });
    for line in [
        "tether_device_plugin_registrations_total 0",
        "tether_device_plugin_allocates_total{outcome=\"refused\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    let health = http_get(http_port, "/health").unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    sigterm(&plugin);
    let status = wait_exit(&mut plugin, "tether-device-plugin");
    assert!(status.success(), "{status}");
}

#[test]
fn the_extender_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    // A kubeconfig is enough to build the client; nothing dials it here.
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"http://127.0.0.1:1\"}\n\
         contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user: {}\n",
    )
    .unwrap();
    let port = unused_port();
    let mut extender = Command::new(env!("CARGO_BIN_EXE_tether-extender"))
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg("--endpoints=127.0.0.1:1")
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the extender to listen", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let metrics = http_get(port, "/metrics").unwrap();
    assert!(
        metrics.contains("tether_extender_binds_total{outcome=\"bound\"} 0"),
        "{metrics}"
    );
    sigterm(&extender);
    let status = wait_exit(&mut extender, "tether-extender");
    assert!(status.success(), "{status}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the port is given up"
    );
}
