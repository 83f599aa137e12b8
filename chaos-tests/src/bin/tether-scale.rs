//! `tether-scale`: the scale run of `BENCHMARKS.md`. Fills a 3-replica
//! Tether (real `tetherd` processes on loopback, fsync on, default snapshot
//! and retention settings) with `--nodes` registered nodes, `--pins` pins and
//! lock acquire/release pairs until about `--events` events are retained,
//! then measures what an operator feels at that size:
//!
//! - resident memory of every replica (now and peak);
//! - building a snapshot on the leader;
//! - installing it on a new, empty member (learner added, caught up);
//! - a follower's restart after `kill -9` (until it serves its old applied
//!   index), and a whole-cluster restart (until a leader answers); with
//!   `--power-loss` the data directories are on LazyFS and each kill is a
//!   power cut (what was not fsynced is lost before the restart);
//! - a watch catching up from revision 1.
//!
//! `./dev scale` builds release binaries and runs it; `--help` for the sizes.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use tether_chaos::cluster::{ClusterSpec, ProcessCluster, sibling_binary};
use tether_chaos::procfs::memory_mib;
use tether_client::proto as pb;
use tether_client::{Client, WatchUpdate};

#[derive(Parser)]
#[command(
    name = "tether-scale",
    about = "Fill a 3-replica Tether to a given size and measure memory, snapshots, restarts and watch catch-up"
)]
struct Args {
    /// Registered nodes.
    #[arg(long, default_value_t = 10_000)]
    nodes: u64,
    /// Pins (100 per set, each on one node).
    #[arg(long, default_value_t = 100_000)]
    pins: u64,
    /// Events to have retained (node reports and pins count; lock
    /// acquire/release pairs make up the rest, two events each).
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Requests in flight while filling.
    #[arg(long, default_value_t = 64)]
    concurrency: u64,
    /// Replicas.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// The tetherd binary (default: next to this one).
    #[arg(long)]
    tetherd: Option<PathBuf>,
    /// Each replica's data on a mount of its own of the lazy file system
    /// (`tether-lazyfs`, beside this binary, or the one TETHER_LAZYFS
    /// names); the restarts follow power cuts, not kills.
    #[arg(long)]
    power_loss: bool,
}

/// Runs `op(0..count)` with `concurrency` calls in flight; fails with the
/// first error.
async fn parallel<F, Fut>(count: u64, concurrency: u64, op: F) -> anyhow::Result<Duration>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let started = Instant::now();
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency.max(1) {
        let op = op.clone();
        let next = next.clone();
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return anyhow::Ok(());
                }
                op(i).await.with_context(|| format!("operation {i}"))?;
            }
        }));
    }
    for worker in workers {
        worker.await??;
    }
    Ok(started.elapsed())
}

fn node_name(i: u64) -> String {
    format!("node-{i:05}")
}

/// Bytes under `dir`.
fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => disk_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

/// `field=value` of the last line of a replica's log that contains
/// `message` (the timings `tetherd` logs at info level).
fn logged(cluster: &ProcessCluster, id: u64, message: &str, field: &str) -> Option<u64> {
    let log = std::fs::read_to_string(cluster.log_path(id)).ok()?;
    let line = log.lines().rev().find(|l| l.contains(message))?;
    let prefix = format!("{field}=");
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(&prefix))
        .and_then(|v| v.trim_matches('"').parse().ok())
}

fn print_memory(cluster: &ProcessCluster, ids: &[u64], when: &str) {
    for id in ids {
        match cluster.pid(*id).and_then(memory_mib) {
            Some((rss, peak)) => println!(
                "  replica {id}: RSS {rss:.0} MiB (peak {peak:.0} MiB), data dir {:.0} MiB  [{when}]",
                disk_bytes(&cluster.data_path(*id)) as f64 / 1048576.0
            ),
            None => println!(
                "  replica {id}: not running, data dir {:.0} MiB  [{when}]",
                disk_bytes(&cluster.data_path(*id)) as f64 / 1048576.0
            ),
        }
    }
}

/// Polls `addr` until it has applied `index`; the time it took.
async fn until_applied(client: &Client, addr: &str, index: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    loop {
        if let Ok(status) = client.status_of(addr).await
            && status.applied_index >= index
        {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{addr} did not apply {index} in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Watches everything from revision 1 until the marker node's event:
/// (events, re-lists, first revision seen, time taken).
async fn watch_from_one(client: &Client) -> anyhow::Result<(u64, u64, u64, Duration)> {
    let started = Instant::now();
    let mut watcher = client
        .watch(Some(pb::Revision { index: 1, sub: 0 }), Vec::new(), "")
        .await?;
    let (mut events, mut relists, mut first) = (0u64, 0u64, None);
    loop {
        match watcher.next().await? {
            WatchUpdate::Events(batch) => {
                if first.is_none() {
                    first = batch.first().and_then(|e| e.revision).map(|r| r.index);
                }
                events += batch.len() as u64;
                if batch.iter().any(|e| e.key == "node/scale-marker") {
                    return Ok((events, relists, first.unwrap_or(0), started.elapsed()));
                }
            }
            WatchUpdate::Relist { .. } => relists += 1,
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// One filling step's line: how many, how long, how many per second.
fn print_rate(what: &str, count: u64, took: Duration) {
    println!(
        "{what}: {count} in {} ({:.0}/s)",
        secs(took),
        count as f64 / took.as_secs_f64()
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tetherd = args
        .tetherd
        .clone()
        .unwrap_or_else(|| sibling_binary("tetherd"));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "tether-scale: {} replicas (tetherd processes), loopback, fsync on, default snapshot/retention settings, {cores} cores; \
         {} nodes, {} pins, ~{} events, {} requests in flight{}",
        args.replicas,
        args.nodes,
        args.pins,
        args.events,
        args.concurrency,
        if args.power_loss {
            "; data on LazyFS, restarts after power cuts"
        } else {
            ""
        }
    );
    let mut cluster = ProcessCluster::start_spec(ClusterSpec {
        tetherd,
        voters: args.replicas,
        // One spare id: the new member that gets the snapshot installed.
        slots: args.replicas + 1,
        proxied: false,
        extra_args: Vec::new(),
        failpoints: None,
        // The snapshot and start-up timings are logged at info level.
        log_filter: Some("info,openraft=warn".into()),
        tokens: false,
        lazyfs: args.power_loss,
    })
    .await?;
    let voters: Vec<u64> = (1..=args.replicas as u64).collect();
    let client = cluster.client();

    // Nodes: each joins and is ready (two events).
    let nodes = args.nodes;
    let took = parallel(nodes, args.concurrency, {
        let client = client.clone();
        move |i| {
            let client = client.clone();
            async move {
                client
                    .report_node(pb::ReportNodeRequest {
                        name: node_name(i),
                        uid: format!("uid-{}", node_name(i)),
                        state: pb::NodeState::NodeReady as i32,
                        set_labels: true,
                        labels: HashMap::from([(
                            "topology.kubernetes.io/zone".to_string(),
                            format!("zone-{}", i % 16),
                        )]),
                        ..Default::default()
                    })
                    .await?;
                Ok(())
            }
        }
    })
    .await?;
    print_rate("nodes registered", nodes, took);

    // Pins: 100 members per set, each on one node, permanent (one event each).
    let took = parallel(args.pins, args.concurrency, {
        let client = client.clone();
        move |i| {
            let client = client.clone();
            async move {
                let set = format!("scale/set-{:04}", i / 100);
                let key = pb::PinKey {
                    set: set.clone(),
                    member: (i % 100).to_string(),
                };
                client
                    .assign(
                        &key,
                        vec![node_name(i % nodes)],
                        &format!("pod-{i}"),
                        Duration::ZERO,
                        HashMap::from([("app".to_string(), set.replace('/', "-"))]),
                        pb::Affinity::default(),
                    )
                    .await?;
                Ok(())
            }
        }
    })
    .await?;
    print_rate("pins assigned", args.pins, took);

    // Lock pairs on the nodes' locks (two events each), no contention.
    let pairs = args.events.saturating_sub(2 * nodes + args.pins) / 2;
    let took = parallel(pairs, args.concurrency, {
        let client = client.clone();
        move |i| {
            let client = client.clone();
            async move {
                let key = pb::LockKey {
                    scope: "gpu-bind".into(),
                    name: node_name(i % nodes),
                };
                let owner = pb::Pod {
                    uid: format!("bind-{i}"),
                    namespace: "scale".into(),
                    name: format!("bind-{i}"),
                };
                let held = client
                    .acquire(&key, &owner, Vec::new(), Duration::from_secs(30), 0)
                    .await?;
                held.release(pb::Outcome::Allocated).await?;
                Ok(())
            }
        }
    })
    .await?;
    print_rate("lock pairs", pairs, took);
    let leader = cluster.wait_converged(Duration::from_secs(120)).await?;
    println!(
        "filled: leader {} applied index {}, last snapshot at {}",
        leader.node_id, leader.applied_index, leader.snapshot_index
    );
    println!("memory after filling:");
    print_memory(&cluster, &voters, "filled");

    // Snapshot build on the leader.
    let started = Instant::now();
    let index = client.snapshot().await?;
    let took = started.elapsed();
    println!(
        "snapshot build: {} (request to built, index {index}); tetherd logged {} ms for {:.1} MiB",
        secs(took),
        logged(&cluster, leader.node_id, "snapshot built", "elapsed_ms").unwrap_or(0),
        logged(&cluster, leader.node_id, "snapshot built", "bytes").unwrap_or(0) as f64 / 1048576.0
    );

    // Snapshot install on a new, empty member.
    let new = args.replicas as u64 + 1;
    cluster.restart(new, None)?;
    let started = Instant::now();
    client
        .add_learner(new, &cluster.addr(new), true)
        .await
        .context("adding the new learner")?;
    let took = started.elapsed();
    println!(
        "snapshot install: new member {new} added and caught up in {} (transfer + install + the log after it); \
         tetherd logged the install itself at {} ms for {:.1} MiB",
        secs(took),
        logged(&cluster, new, "snapshot installed", "elapsed_ms")
            .map_or("-".into(), |ms| ms.to_string()),
        logged(&cluster, new, "snapshot installed", "bytes").unwrap_or(0) as f64 / 1048576.0
    );
    print_memory(&cluster, &[new], "after install");
    client.remove_learners(vec![new]).await?;
    cluster.kill(new);

    // A follower's restart after kill -9.
    let follower = *voters
        .iter()
        .find(|id| **id != leader.node_id)
        .context("a follower")?;
    let applied = client.leader_status().await?.applied_index;
    let stop = if args.power_loss {
        "power cut"
    } else {
        "killed (-9)"
    };
    if args.power_loss {
        cluster.power_cut(follower)?;
    } else {
        cluster.kill(follower);
    }
    print_memory(&cluster, &[follower], "stopped");
    cluster.restart(follower, None)?;
    let took = until_applied(&client, &cluster.addr(follower), applied).await?;
    println!(
        "follower restart: replica {follower} {stop} and serving its applied index {applied} again {} after start \
         (tetherd logged {} ms to open the database and load the state)",
        secs(took),
        logged(
            &cluster,
            follower,
            "database opened and state loaded",
            "elapsed_ms"
        )
        .unwrap_or(0)
    );

    // The whole cluster killed and started again.
    for id in &voters {
        if args.power_loss {
            cluster.power_cut(*id)?;
        } else {
            cluster.kill(*id);
        }
    }
    print_memory(&cluster, &voters, "stopped");
    let started = Instant::now();
    for id in &voters {
        cluster.restart(*id, None)?;
    }
    cluster.wait_for_leader(Duration::from_secs(120)).await?;
    let leader_after = started.elapsed();
    let serving = client
        .holder(&pb::LockKey {
            scope: "gpu-bind".into(),
            name: node_name(0),
        })
        .await
        .map(|_| started.elapsed())?;
    println!(
        "cluster restart: all {} replicas {stop} and started; a leader after {}, a linearizable read answered after {} \
         (an election included)",
        args.replicas,
        secs(leader_after),
        secs(serving)
    );

    // A watch from revision 1 to the present: the present is marked by one
    // more node joining (a watch cannot tell "caught up" from "waiting").
    client
        .report_node(pb::ReportNodeRequest {
            name: "scale-marker".into(),
            uid: "uid-scale-marker".into(),
            state: pb::NodeState::NodeJoined as i32,
            ..Default::default()
        })
        .await?;
    let leader = client.leader_status().await?;
    // Twice: the first read after the restart may share the disk and CPU
    // with RocksDB's start-up work; the second shows the steady rate.
    for attempt in ["first", "second"] {
        let (events, relists, first, took) = watch_from_one(&client).await?;
        println!(
            "watch catch-up ({attempt}): {events} events (revisions {first} to {}) from revision 1 in {} ({:.0} events/s) from leader {}, {relists} re-lists",
            leader.applied_index,
            secs(took),
            events as f64 / took.as_secs_f64(),
            leader.node_id
        );
    }
    println!("memory at the end:");
    print_memory(&cluster, &voters, "end");
    Ok(())
}
