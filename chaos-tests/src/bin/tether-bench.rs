//! `tether-bench`: drives a 3-replica Tether (real `tetherd` processes on
//! loopback, fsync on) with lock workloads and prints ops/s and latency
//! percentiles beside the disk's fsync floor measured in the same run.
//!
//! `cargo build --release -p tether-server -p tether-chaos && target/release/tether-bench`
//!
//! The etcd side of the comparison (issue 7) is not wired in yet: this prints
//! Tether's figures only.

use std::time::{Duration, Instant};

use clap::Parser;
use tether_chaos::cluster::{ProcessCluster, sibling_binary};
use tether_chaos::stats::{Samples, ms};
use tether_chaos::workload::{contended, uncontended};

#[derive(Parser)]
#[command(
    name = "tether-bench",
    about = "Lock workloads against a 3-replica Tether on loopback"
)]
struct Args {
    /// Seconds per scenario.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Client counts of the uncontended scenario.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    uncontended: Vec<usize>,
    /// Client counts of the contended scenario.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,64")]
    contended: Vec<usize>,
    /// Replicas.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// The tetherd binary (default: next to this one).
    #[arg(long)]
    tetherd: Option<std::path::PathBuf>,
}

/// A synced RocksDB put loop: the floor under any replicated commit here.
fn fsync_floor(n: usize) -> anyhow::Result<Samples> {
    let dir = tempfile::tempdir()?;
    let db = rocksdb::DB::open_default(dir.path())?;
    let mut opts = rocksdb::WriteOptions::default();
    opts.set_sync(true);
    let mut samples = Samples::default();
    for i in 0..n {
        let t0 = Instant::now();
        db.put_opt(i.to_be_bytes(), [0u8; 64], &opts)?;
        samples.push(t0.elapsed());
    }
    Ok(samples)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut floor = fsync_floor(1000)?;
    println!(
        "tether-bench: {} replicas (tetherd processes, loopback, fsync on), {cores} cores, {:?} per scenario",
        args.replicas, args.duration
    );
    println!(
        "fsync floor (RocksDB synced put, 1000 writes): p50 {} ms, p99 {} ms",
        ms(floor.quantile(0.5)),
        ms(floor.quantile(0.99))
    );
    let tetherd = args
        .tetherd
        .clone()
        .unwrap_or_else(|| sibling_binary("tetherd"));
    let cluster = ProcessCluster::start(&tetherd, args.replicas).await?;
    let client = cluster.client();
    // Warm up connections and the leader.
    uncontended(&client, 4, Duration::from_millis(500), "warm").await;

    println!();
    println!(
        "{:<13} {:>7} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>7}",
        "scenario",
        "clients",
        "pairs/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "handover50",
        "handover99",
        "errors"
    );
    for &clients in &args.uncontended {
        let mut run = uncontended(&client, clients, args.duration, &format!("u{clients}")).await;
        println!(
            "{:<13} {:>7} {:>10.0} {:>10} {:>10} {:>10} {:>12} {:>12} {:>7}",
            "uncontended",
            clients,
            run.rate(),
            ms(run.pair_latency.quantile(0.5)),
            ms(run.pair_latency.quantile(0.99)),
            ms(run.pair_latency.quantile(0.999)),
            "-",
            "-",
            run.errors
        );
    }
    for &clients in &args.contended {
        let mut run = contended(&client, clients, args.duration, &format!("c{clients}")).await;
        println!(
            "{:<13} {:>7} {:>10.0} {:>10} {:>10} {:>10} {:>12} {:>12} {:>7}",
            "contended",
            clients,
            run.rate(),
            ms(run.pair_latency.quantile(0.5)),
            ms(run.pair_latency.quantile(0.99)),
            ms(run.pair_latency.quantile(0.999)),
            ms(run.handover.quantile(0.5)),
            ms(run.handover.quantile(0.99)),
            run.errors
        );
    }
    Ok(())
}
