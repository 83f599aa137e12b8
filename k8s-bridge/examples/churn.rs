//! Benchmark: the bridge's CPU and memory while a (fake) cluster churns many
//! pods of which some hold locks, and how many Tether commands that costs.
//!
//! ```sh
//! cargo build -p tether-k8s-bridge            # the tether-bridge binary it runs
//! cargo run -p tether-k8s-bridge --example churn [PODS] [HOLDERS] [SECONDS]
//! ```
//! Defaults: 10000 pods, 1000 holding locks, 30 s of churn. The bridge runs
//! as its own process (so its CPU and RSS are its own) against the fake API
//! server of the tests; Tether runs in this process (3 replicas, fsync on).

#[path = "../tests/fake_apiserver/mod.rs"]
mod fake_apiserver;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApi, pod};
use tether_client::proto::{LockKey, Pod};
use tether_client::{Client, Options};
use tether_server::testing::{Cluster, DEADLINE};

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) of a process, from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11).and_then(|f| f.parse().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|f| f.parse().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ is 100 on Linux
}

/// Resident memory of a process in MiB, from /proc.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: bridge\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

#[tokio::main]
async fn main() {
    let (pods, holders, seconds) = (arg(1, 10_000), arg(2, 1_000), arg(3, 30));
    let bridge_bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("tether-bridge");
    assert!(
        bridge_bin.exists(),
        "build the bridge first: cargo build -p tether-k8s-bridge (looked for {})",
        bridge_bin.display()
    );

    let cluster = Cluster::start(3).await;
    let client = Client::new(
        cluster.endpoints(),
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap();
    let api = FakeApi::start().await;
    for i in 0..pods {
        api.put_pod(pod(&format!("p{i}"), &format!("uid-p{i}"), "Running", true));
    }
    for i in 0..holders {
        let key = LockKey {
            scope: "gpu-bind".into(),
            name: format!("node-{i}"),
        };
        let owner = Pod {
            uid: format!("uid-p{i}"),
            namespace: "ml".into(),
            name: format!("p{i}"),
        };
        client
            .acquire(&key, &owner, vec![], Duration::ZERO, 0)
            .await
            .unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\ncurrent-context: c\n",
        api.url
    )).unwrap();
    let http = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut bridge = Command::new(&bridge_bin)
        .args([
            "--endpoints",
            &cluster.endpoints().join(","),
            "--http-listen",
            &http,
            "--resync",
            "10s",
        ])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = bridge.id();
    let started = Instant::now();
    while !http_get(&http, "/health").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
        assert!(
            started.elapsed() < DEADLINE,
            "the bridge did not become healthy"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let synced_in = started.elapsed();

    // Churn: modify random pods; delete and recreate pods that hold nothing.
    let cpu_before = cpu_seconds(pid);
    let (mut events, mut rss_max, mut rng) = (0u64, 0f64, 0x2545_f491_4f6c_dd1du64);
    let churn_started = Instant::now();
    let mut last_sample = Instant::now();
    let mut generation = vec![0u32; pods];
    while churn_started.elapsed() < Duration::from_secs(seconds as u64) {
        for _ in 0..20 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % pods as u64) as usize;
            if i >= holders && rng % 10 == 0 {
                api.delete_pod("ml", &format!("p{i}"));
                generation[i] += 1;
                api.put_pod(pod(
                    &format!("p{i}"),
                    &format!("uid-p{i}-g{}", generation[i]),
                    "Pending",
                    false,
                ));
                events += 2;
            } else {
                let uid = if generation[i] == 0 {
                    format!("uid-p{i}")
                } else {
                    format!("uid-p{i}-g{}", generation[i])
                };
                let mut object = pod(&format!("p{i}"), &uid, "Running", true);
                object["metadata"]["labels"] =
                    serde_json::json!({"churn": (rng % 1000).to_string()});
                api.put_pod(object);
                events += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        if last_sample.elapsed() >= Duration::from_secs(1) {
            rss_max = rss_max.max(rss_mib(pid));
            last_sample = Instant::now();
        }
    }
    let churn = churn_started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu_before;
    rss_max = rss_max.max(rss_mib(pid));
    let metrics = http_get(&http, "/metrics").unwrap_or_default();
    let metric = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .unwrap_or("?")
            .to_string()
    };
    let held = client
        .list("gpu-bind")
        .await
        .unwrap()
        .iter()
        .filter(|l| l.holder.is_some())
        .count();
    let _ = bridge.kill();
    let _ = bridge.wait();

    println!("bridge under churn: {pods} pods, {holders} holding locks, {churn:.0} s");
    println!(
        "  conditions: bridge as its own process (debug build unless built with --release), fake API server over HTTP, 3 in-process Tether replicas with fsync on, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("  initial list and sync: {synced_in:?}");
    println!(
        "  pod events sent by the fake: {events} ({:.0}/s)",
        events as f64 / churn
    );
    println!(
        "  bridge CPU: {:.1}% of one core; RSS max {rss_max:.1} MiB",
        100.0 * cpu / churn
    );
    println!(
        "  Tether commands sent: {} (events seen {})",
        metric("tether_bridge_commands_total"),
        metric("tether_bridge_events_total")
    );
    println!("  locks still held: {held} of {holders} (holders were only modified, never deleted)");
    cluster.shutdown().await;
}
