//! Benchmark: how long from a pod-delete watch event to the next waiter's
//! grant, through the bridge and a 3-replica Tether (in-process, loopback,
//! RocksDB with fsync on), against the fake API server of the tests.
//!
//! `cargo run --release -p tether-k8s-bridge --example delete_latency [N]`
//! (N deletions, default 1000). Prints p50/p99/max and the conditions.

#[path = "../tests/fake_apiserver/mod.rs"]
mod fake_apiserver;

use std::time::{Duration, Instant};

use fake_apiserver::{FakeApi, pod};
use tether_client::proto::{LockKey, Pod};
use tether_client::{Client, Options};
use tether_k8s_bridge::bridge::Bridge;
use tether_server::testing::{Cluster, DEADLINE};

fn tether_pod(name: &str) -> Pod {
    Pod {
        uid: format!("uid-{name}"),
        namespace: "ml".into(),
        name: name.into(),
    }
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let cluster = Cluster::start(3).await;
    let options = || Options {
        retry_timeout: DEADLINE,
        ..Options::default()
    };
    let client = Client::new(cluster.endpoints(), options()).unwrap();
    let api = FakeApi::start().await;
    let bridge = Bridge::new(
        Client::new(cluster.endpoints(), options()).unwrap(),
        api.client(),
    );
    tokio::spawn(
        bridge
            .clone()
            .run(Duration::from_secs(3600), std::future::pending()),
    );

    let mut latencies = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let key = LockKey {
            scope: "gpu-bind".into(),
            name: format!("node-{}", round % 50),
        };
        let (owner, next) = (format!("owner-{round}"), format!("next-{round}"));
        api.put_pod(pod(&owner, &format!("uid-{owner}"), "Pending", false));
        api.put_pod(pod(&next, &format!("uid-{next}"), "Pending", false));
        client
            .acquire(&key, &tether_pod(&owner), vec![], Duration::ZERO, 0)
            .await
            .unwrap();
        let waiter = {
            let (client, key, next) = (client.clone(), key.clone(), next.clone());
            tokio::spawn(async move {
                client
                    .acquire(&key, &tether_pod(&next), vec![], DEADLINE, 0)
                    .await
            })
        };
        // Wait until the waiter is queued and the bridge knows the owner.
        while client.get(&key).await.unwrap().waiters.is_empty()
            || !bridge.is_interesting(&format!("uid-{owner}"))
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let deleted = Instant::now();
        api.delete_pod("ml", &owner);
        let held = waiter.await.unwrap().unwrap();
        latencies.push(deleted.elapsed());
        held.release(tether_client::proto::Outcome::Allocated)
            .await
            .unwrap();
        api.delete_pod("ml", &next);
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    println!("pod delete event -> next waiter granted, {rounds} deletions");
    println!(
        "  conditions: 3 Tether replicas in one process on loopback, RocksDB fsync on, bridge via a fake API server over HTTP, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "  p50 {:?}  p99 {:?}  max {:?}",
        at(0.50),
        at(0.99),
        latencies[latencies.len() - 1]
    );
    let text = bridge.render_metrics();
    let value = |name: &str| {
        text.lines()
            .find_map(|line| {
                line.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    let count = value("tether_bridge_lag_seconds_count").max(1.0);
    let lag = Duration::from_secs_f64(value("tether_bridge_lag_seconds_sum") / count);
    println!(
        "  of which the bridge's own part (event received -> Tether committed), mean: {lag:?}"
    );
    cluster.shutdown().await;
}
