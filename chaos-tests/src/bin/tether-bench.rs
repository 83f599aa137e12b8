//! `tether-bench`: drives a 3-replica Tether (real `tetherd` processes on
//! loopback, fsync on) with lock workloads and prints ops/s and latency
//! percentiles beside the disk's fsync floor measured in the same run.
//! Beside it, the same workloads against a 3-member etcd (Debian's
//! `etcd-server`, fsync on, its v3lock API with a lease) started on loopback
//! in the same run, with the Tether/etcd ratio. Without etcd installed it
//! prints Tether's figures only.
//!
//! With `--unbatched` a second Tether cluster runs the same workloads with
//! write batching off (`--batch-max-commands 1`, row `no-batch`): the
//! before and after of batching, in one run.
//!
//! With `--baseline PATH` a third cluster runs another `tetherd` build (row
//! `baseline`) through the same scenarios, each right after the current
//! build's: the before and after of a code change, in one run under the same
//! conditions. `--rounds N` runs every scenario N times per system,
//! alternating systems within each round, and ends with each row's median
//! and range over the rounds (run-to-run noise on a shared 2-core machine is
//! ±15 %, larger than most changes).
//!
//! With `--cpu` each scenario's rows (`tether`, `no-batch` or `baseline`
//! when run, and `etcd`) are followed by the CPU time each replica (leader
//! first) or etcd member and the bench itself used during it, from
//! `/proc/<pid>/stat`: where the two cores went, and the replicas' (or the
//! members') CPU per completed pair. The latter moves less from run to run
//! than pairs/s on a shared machine, so it is the figure to compare two
//! builds, or Tether and etcd, by (the rounds summary has its median).
//! Before the scenarios, each system's idle CPU over `IDLE_SPAN` with no
//! client calling.
//!
//! With `--logs DIR` the Tether replicas' logs are copied there at the end
//! and every scenario's rows say when it started (UTC, as in the logs), to
//! find what a replica was doing during a slow run.
//!
//! After the lock scenarios, `--reads` clients read one lock's holder in a
//! loop: linearizable reads, which touch neither the log nor the disk (etcd:
//! a `Range` on one key, linearizable as by default).
//!
//! With `--charts DIR` it also draws the run as SVG: throughput against
//! clients, and latency CDFs of each scenario (`chart.rs`).
//!
//! `cargo build --release -p tether-server -p tether-chaos && target/release/tether-bench`

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tether_chaos::chart::{Chart, PALETTE, Scale, Series};
use tether_chaos::cluster::{ClusterSpec, ProcessCluster, sibling_binary};
use tether_chaos::etcd::{self, EtcdCluster};
use tether_chaos::procfs::cpu_seconds;
use tether_chaos::stats::{Samples, ms};
use tether_chaos::workload::{
    Run, contended, mixed, mixed_floor, poisson_arrivals, reads, uncontended,
};

#[derive(Parser)]
#[command(
    name = "tether-bench",
    about = "Lock workloads against a 3-replica Tether (and etcd) on loopback"
)]
struct Args {
    /// Seconds per scenario per system.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Client counts of the uncontended scenario.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    uncontended: Vec<usize>,
    /// Client counts of the contended scenario.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,64")]
    contended: Vec<usize>,
    /// Arrival rates (binds per second) of the mixed scenario: binds arrive
    /// as a Poisson process over --mixed-nodes node locks, each held 20 ms.
    #[arg(long, value_delimiter = ',', default_value = "100,400")]
    mixed_rates: Vec<f64>,
    /// Client counts of the read scenario: each client reads one lock's
    /// holder in a loop, linearizably (Tether `Holder`: ReadIndex, nothing
    /// written to the log; etcd a `Range` on one key, its default
    /// linearizable read).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    reads: Vec<usize>,
    /// Scenarios to leave out, e.g. `--skip mixed,reads` for the lock
    /// scenarios alone.
    #[arg(long, value_delimiter = ',')]
    skip: Vec<Scenario>,
    /// Nodes of the mixed scenario.
    #[arg(long, default_value_t = 1000)]
    mixed_nodes: usize,
    /// Seed of the mixed scenario's arrivals (the same for both systems).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Replicas (and etcd members).
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// The tetherd binary (default: next to this one).
    #[arg(long)]
    tetherd: Option<std::path::PathBuf>,
    /// The etcd binary (`apt-get install etcd-server`); skipped if absent.
    #[arg(long, default_value = "/usr/bin/etcd")]
    etcd: std::path::PathBuf,
    /// Write SVG charts of the run into this directory (created if missing).
    #[arg(long)]
    charts: Option<std::path::PathBuf>,
    /// Also run Tether with write batching off (`--batch-max-commands 1`),
    /// as the row `no-batch`.
    #[arg(long)]
    unbatched: bool,
    /// Another tetherd build to run beside this one, as the row `baseline`
    /// (e.g. the build before a change).
    #[arg(long)]
    baseline: Option<std::path::PathBuf>,
    /// Times every scenario runs per system; with more than one, a summary
    /// of medians and ranges follows the rows.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// After each scenario, print the CPU used by each replica of every
    /// Tether row, each etcd member and the bench during that row's run,
    /// and the replicas' (members') CPU per completed pair; before the
    /// scenarios, each system's idle CPU (Linux `/proc`).
    #[arg(long)]
    cpu: bool,
    /// Copy every Tether replica's log here at the end
    /// (`<row>-tetherd-<id>.log`), and print each scenario's start time.
    #[arg(long)]
    logs: Option<std::path::PathBuf>,
}

/// A scenario, as `--skip` names it.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Scenario {
    Uncontended,
    Contended,
    Mixed,
    Reads,
}

impl Args {
    /// Empties the client counts (or rates) of the scenarios `--skip`
    /// names: a scenario with none is not run.
    fn drop_skipped(&mut self) {
        for scenario in self.skip.clone() {
            match scenario {
                Scenario::Uncontended => self.uncontended.clear(),
                Scenario::Contended => self.contended.clear(),
                Scenario::Mixed => self.mixed_rates.clear(),
                Scenario::Reads => self.reads.clear(),
            }
        }
    }
}

/// Tether with its default settings.
const TETHER: &str = "tether";
/// Tether with write batching off.
const NO_BATCH: &str = "no-batch";
/// Another tetherd build (`--baseline`).
const BASELINE: &str = "baseline";
/// The etcd cluster.
const ETCD: &str = "etcd";

/// One scenario's figures for one system, kept for the charts and the
/// summary of rounds.
struct Measured {
    system: &'static str,
    scenario: &'static str,
    clients: usize,
    rate: f64,
    /// Pair latency CDF: (ms, fraction at or below).
    pair_cdf: Vec<(f64, f64)>,
    /// Hand-over latency CDF (contended runs; empty otherwise).
    handover_cdf: Vec<(f64, f64)>,
    /// p50 pair latency, as printed in the row.
    pair_p50: Duration,
    /// p50 hand-over latency (contended runs; zero otherwise).
    handover_p50: Duration,
    /// CPU the replicas used per completed pair, in ms (`--cpu`, Tether rows).
    replica_cpu_ms_per_pair: Option<f64>,
}

impl Measured {
    fn of(system: &'static str, scenario: &'static str, clients: usize, run: &mut Run) -> Self {
        Measured {
            system,
            scenario,
            clients,
            rate: run.rate(),
            pair_cdf: run.pair_latency.cdf_ms(CDF_STEPS),
            handover_cdf: run.handover.cdf_ms(CDF_STEPS),
            pair_p50: run.pair_latency.quantile(0.5),
            handover_p50: run.handover.quantile(0.5),
            replica_cpu_ms_per_pair: None,
        }
    }
}

/// Points per latency CDF in the charts.
const CDF_STEPS: usize = 400;

/// What the lock scenarios' throughput counts.
const PAIRS: &str = "acquire + release pairs";

/// Tether solid, the others dashed.
fn is_comparison(system: &str) -> bool {
    system != TETHER
}

/// Operations per second against clients, one line per system; `what`
/// names the operation ("acquire + release pairs", "reads").
fn throughput_chart(
    results: &[Measured],
    scenario: &str,
    what: &str,
    subtitle: &str,
) -> Option<Chart> {
    let rows: Vec<&Measured> = results.iter().filter(|m| m.scenario == scenario).collect();
    if rows.is_empty() {
        return None;
    }
    let mut series = Vec::new();
    for (i, system) in [TETHER, ETCD, NO_BATCH, BASELINE].into_iter().enumerate() {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|m| m.system == system)
            .map(|m| (m.clients as f64, m.rate))
            .collect();
        if !points.is_empty() {
            series.push(Series {
                label: system.to_string(),
                color: PALETTE[i],
                dashed: is_comparison(system),
                markers: true,
                points,
            });
        }
    }
    let mut clients: Vec<f64> = rows.iter().map(|m| m.clients as f64).collect();
    clients.sort_by(f64::total_cmp);
    clients.dedup();
    Some(Chart {
        title: format!("{scenario}: {what} per second"),
        subtitle: subtitle.to_string(),
        x_label: "clients (log scale)".into(),
        y_label: format!("{what}/s"),
        x: Scale::Log {
            min: clients[0].min(1.0),
            max: clients[clients.len() - 1].max(2.0),
        },
        y: Scale::linear_from_zero(rows.iter().map(|m| m.rate)),
        x_ticks: Some(clients),
        series,
    })
}

/// Latency CDFs of one scenario: a colour per client count (or rate), Tether
/// solid and etcd dashed. `handover` picks the hand-over latencies.
fn cdf_chart(
    results: &[Measured],
    scenario: &str,
    handover: bool,
    what: &str,
    per: &str,
    subtitle: &str,
) -> Option<Chart> {
    // Tether beside etcd; the unbatched and baseline Tethers only in the
    // throughput charts (a third set of lines per client count would hide
    // the other two).
    let rows: Vec<&Measured> = results
        .iter()
        .filter(|m| m.scenario == scenario && m.system != NO_BATCH && m.system != BASELINE)
        .filter(|m| {
            !(if handover {
                &m.handover_cdf
            } else {
                &m.pair_cdf
            })
            .is_empty()
        })
        .collect();
    if rows.is_empty() {
        return None;
    }
    let mut counts: Vec<usize> = rows.iter().map(|m| m.clients).collect();
    counts.sort_unstable();
    counts.dedup();
    let series = rows
        .iter()
        .map(|m| {
            let color_index = counts.iter().position(|c| *c == m.clients).unwrap_or(0);
            let cdf = if handover {
                &m.handover_cdf
            } else {
                &m.pair_cdf
            };
            Series {
                label: format!("{} {} {per}", m.system, m.clients),
                color: PALETTE[color_index % PALETTE.len()],
                dashed: is_comparison(m.system),
                markers: false,
                points: cdf.clone(),
            }
        })
        .collect::<Vec<_>>();
    let x = Scale::log_decades(series.iter().flat_map(|s| s.points.iter().map(|(x, _)| *x)));
    Some(Chart {
        title: format!("{scenario}: {what} latency CDF"),
        subtitle: subtitle.to_string(),
        x_label: format!("{what} latency, ms (log scale)"),
        y_label: "fraction at or below".into(),
        x,
        y: Scale::Linear { min: 0.0, max: 1.0 },
        x_ticks: None,
        series,
    })
}

fn write_charts(dir: &std::path::Path, results: &[Measured], subtitle: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let charts = [
        (
            "throughput-uncontended.svg",
            throughput_chart(results, "uncontended", PAIRS, subtitle),
        ),
        (
            "throughput-contended.svg",
            throughput_chart(results, "contended", PAIRS, subtitle),
        ),
        (
            "latency-cdf-uncontended.svg",
            cdf_chart(results, "uncontended", false, "pair", "clients", subtitle),
        ),
        (
            "handover-cdf-contended.svg",
            cdf_chart(results, "contended", true, "hand-over", "clients", subtitle),
        ),
        (
            "latency-cdf-mixed.svg",
            cdf_chart(results, "mixed", false, "bind", "binds/s", subtitle),
        ),
        (
            "throughput-reads.svg",
            throughput_chart(results, "reads", "reads", subtitle),
        ),
        (
            "latency-cdf-reads.svg",
            cdf_chart(results, "reads", false, "read", "clients", subtitle),
        ),
    ];
    for (file, chart) in charts {
        if let Some(chart) = chart {
            let path = dir.join(file);
            std::fs::write(&path, chart.to_svg())?;
            println!("chart: {}", path.display());
        }
    }
    Ok(())
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

/// The Tether leader's status, or an error naming what needed it.
async fn leader_of(
    cluster: &ProcessCluster,
    client: &tether_client::Client,
    purpose: &str,
) -> anyhow::Result<tether_client::proto::StatusResponse> {
    cluster
        .leader(client)
        .await
        .ok_or_else(|| anyhow::anyhow!("no Tether leader for {purpose}"))
}

/// Sequential Status calls to the leader: a gRPC round trip through the
/// client library with no Raft and no disk, the floor under every acquire
/// and release besides the fsyncs.
async fn rpc_floor(
    cluster: &ProcessCluster,
    client: &tether_client::Client,
    n: usize,
) -> anyhow::Result<Samples> {
    let leader = leader_of(cluster, client, "the RPC floor").await?;
    let mut samples = Samples::default();
    for _ in 0..n {
        let t0 = Instant::now();
        client.status_of(&leader.addr).await?;
        samples.push(t0.elapsed());
    }
    Ok(samples)
}

/// Prints one scenario's rows; Tether's rows carry their ratio to etcd's
/// pairs/s when etcd ran (not for the mixed scenario, whose rate is set).
fn print_rows(runs: &mut [(&'static str, Run)], scenario: &str, clients: usize, contended: bool) {
    let etcd_rate = runs
        .iter()
        .find(|(system, _)| *system == ETCD)
        .map(|(_, run)| run.rate());
    for (system, run) in runs.iter_mut() {
        let ratio = match etcd_rate {
            Some(etcd) if *system != ETCD && scenario != "mixed" => {
                Some(run.rate() / etcd.max(1e-9))
            }
            _ => None,
        };
        row(system, scenario, clients, run, contended, ratio);
    }
}

fn row(
    system: &str,
    scenario: &str,
    clients: usize,
    run: &mut Run,
    contended: bool,
    ratio: Option<f64>,
) {
    let (h50, h99) = if contended {
        (
            ms(run.handover.quantile(0.5)),
            ms(run.handover.quantile(0.99)),
        )
    } else {
        ("-".to_string(), "-".to_string())
    };
    println!(
        "{:<8} {:<12} {:>7} {:>10.0} {:>9} {:>9} {:>9} {:>11} {:>11} {:>7} {:>7}",
        system,
        scenario,
        clients,
        run.rate(),
        ms(run.pair_latency.quantile(0.5)),
        ms(run.pair_latency.quantile(0.99)),
        ms(run.pair_latency.quantile(0.999)),
        h50,
        h99,
        run.errors,
        ratio.map_or("-".to_string(), |r| format!("{r:.1}x")),
    );
    if let Some(err) = &run.first_error {
        println!("        first error: {err}");
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    args.drop_skipped();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let floor = fsync_floor(1000)?;
    println!(
        "tether-bench: {} replicas each (tetherd processes; etcd members), loopback, fsync on for both, {cores} cores, {:?} per scenario per system",
        args.replicas, args.duration
    );
    println!(
        "fsync floor (RocksDB synced put, 1000 writes): p50 {} ms, p99 {} ms",
        ms(floor.quantile(0.5)),
        ms(floor.quantile(0.99))
    );
    let subtitle = format!(
        "{} replicas each, loopback, fsync on (floor p50 {} ms), {cores} cores, {:?} per scenario",
        args.replicas,
        ms(floor.quantile(0.5)),
        args.duration
    );
    let mut results = Vec::new();
    let tetherd = args
        .tetherd
        .clone()
        .unwrap_or_else(|| sibling_binary("tetherd"));
    let cluster = ProcessCluster::start_spec(cluster_spec(&args, &tetherd, &[])).await?;
    // Tether variants by row name; the unbatched one is a second cluster,
    // idle while the first runs.
    let mut tethers = vec![(TETHER, cluster.client())];
    let unbatched = if args.unbatched {
        let spec = cluster_spec(&args, &tetherd, &["--batch-max-commands", "1"]);
        let cluster = ProcessCluster::start_spec(spec).await?;
        tethers.push((NO_BATCH, cluster.client()));
        Some(cluster)
    } else {
        None
    };
    let baseline = match &args.baseline {
        Some(path) => {
            let cluster = ProcessCluster::start_spec(cluster_spec(&args, path, &[])).await?;
            tethers.push((BASELINE, cluster.client()));
            Some(cluster)
        }
        None => None,
    };
    let mut variants = vec![format!(
        "{TETHER}: {} with its defaults (write batching on)",
        tetherd.display()
    )];
    if unbatched.is_some() {
        variants.push(format!(
            "{NO_BATCH}: the same with --batch-max-commands 1 (batching off)"
        ));
    }
    if let Some(path) = &args.baseline {
        variants.push(format!("{BASELINE}: {} with its defaults", path.display()));
    }
    println!("{}", variants.join("; "));
    for (_, client) in &tethers {
        // Warm up connections and the leader.
        uncontended(client, 4, Duration::from_millis(500), "warm").await;
    }
    let rpc = rpc_floor(&cluster, &tethers[0].1, 1000).await?;
    println!(
        "gRPC round trip floor (Status RPC to the Tether leader: no Raft, no disk; 1000 calls): p50 {} ms, p99 {} ms",
        ms(rpc.quantile(0.5)),
        ms(rpc.quantile(0.99))
    );
    let etcd = if args.etcd.exists() {
        let etcd = EtcdCluster::start(&args.etcd, args.replicas).await?;
        let channel = etcd.channel().await?;
        Some((etcd, channel))
    } else {
        println!(
            "etcd: {} not found (apt-get install etcd-server); Tether only",
            args.etcd.display()
        );
        None
    };

    // Every Tether cluster by its row's name.
    let clusters: Vec<(&'static str, &ProcessCluster)> = [
        (TETHER, Some(&cluster)),
        (NO_BATCH, unbatched.as_ref()),
        (BASELINE, baseline.as_ref()),
    ]
    .into_iter()
    .filter_map(|(row, cluster)| cluster.map(|c| (row, c)))
    .collect();
    // One probe per Tether variant and one for etcd, by row name.
    let mut cpu = Vec::new();
    if args.cpu {
        for (row, cluster) in &clusters {
            let (_, client) = tethers
                .iter()
                .find(|(system, _)| system == row)
                .expect("every started cluster has a row");
            cpu.push((*row, CpuProbe::of(cluster, client, args.replicas).await?));
        }
        if let Some((members, _)) = &etcd {
            cpu.push((ETCD, CpuProbe::of_etcd(members)));
        }
        print_idle_cpu(&cpu).await;
    }
    println!();
    println!(
        "{:<8} {:<12} {:>7} {:>10} {:>9} {:>9} {:>9} {:>11} {:>11} {:>7} {:>7}",
        "system",
        "scenario",
        "clients",
        "pairs/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "handover50",
        "handover99",
        "errors",
        "ratio"
    );
    for round in 1..=args.rounds {
        if args.rounds > 1 {
            println!("round {round} of {}", args.rounds);
        }
        let rows = run_round(&args, &tethers, etcd.as_ref().map(|(_, c)| c), &cpu).await;
        results.extend(rows);
    }
    if !args.mixed_rates.is_empty() {
        println!(
            "mixed: {} node locks, binds arriving as a Poisson process at the rate in the clients column \
             (per second, seed {}), each held 20 ms then released; pairs/s = binds completed per \
             second, latencies = arrival -> lock granted (what the scheduler waits for)",
            args.mixed_nodes, args.seed
        );
        // What the arrivals alone cost: binds to a node already binding
        // wait for its release whatever the system.
        let commit = 2 * rpc.quantile(0.5) + 2 * floor.quantile(0.5);
        for rate in &args.mixed_rates {
            let arrivals = poisson_arrivals(*rate, args.mixed_nodes, args.duration, args.seed);
            let idle = mixed_floor(&arrivals, Duration::ZERO);
            let at_floor = mixed_floor(&arrivals, commit);
            println!(
                "mixed {rate} binds/s, arrival -> grant if commits took no time: p50 {} ms, p99 {} ms; \
                 if each took the commit floor ({} ms): p50 {} ms, p99 {} ms",
                ms(idle.quantile(0.5)),
                ms(idle.quantile(0.99)),
                ms(commit),
                ms(at_floor.quantile(0.5)),
                ms(at_floor.quantile(0.99)),
            );
        }
    }
    if !args.reads.is_empty() {
        println!(
            "reads: each client reads one lock's holder (Tether: Holder, etcd: Range on one key) in a loop, \
             linearizable (ReadIndex: the leader confirms it still leads, nothing goes to the log); \
             pairs/s = reads per second, latencies = one read"
        );
    }
    if args.rounds > 1 {
        print_summary(&results, args.rounds);
    }
    if let Some(dir) = &args.charts {
        write_charts(dir, &median_rounds(results), &subtitle)?;
    }
    if let Some(dir) = &args.logs {
        std::fs::create_dir_all(dir)?;
        for (row, cluster) in &clusters {
            for id in cluster.running() {
                let to = dir.join(format!("{row}-tetherd-{id}.log"));
                std::fs::copy(cluster.log_path(id), &to)?;
                println!("log: {}", to.display());
            }
        }
    }
    Ok(())
}

/// A Tether cluster of `--replicas` running `tetherd` with `extra_args`;
/// with `--logs`, the replicas log at info level (snapshots, elections).
fn cluster_spec(args: &Args, tetherd: &std::path::Path, extra_args: &[&str]) -> ClusterSpec {
    ClusterSpec {
        tetherd: tetherd.to_path_buf(),
        voters: args.replicas,
        slots: args.replicas,
        proxied: false,
        extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
        failpoints: None,
        log_filter: args.logs.as_ref().map(|_| "info,openraft=warn".to_string()),
        tokens: false,
        lazyfs: false,
    }
}

/// Wall-clock time of day in UTC, `HH:MM:SS.mmm` (the replicas' log
/// timestamps are UTC).
fn utc_time_of_day() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let ms_of_day = now.as_millis() % (24 * 3600 * 1000);
    let (h, rest) = (ms_of_day / 3_600_000, ms_of_day % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    format!("{h:02}:{m:02}:{:02}.{:03}", rest / 1000, rest % 1000)
}

/// Runs every scenario once on every system (Tether variants in turn, then
/// etcd), printing the rows; returns the figures for the charts and summary.
async fn run_round(
    args: &Args,
    tethers: &[(&'static str, tether_client::Client)],
    etcd: Option<&tonic::transport::Channel>,
    cpu: &[(&'static str, CpuProbe)],
) -> Vec<Measured> {
    let mut results = Vec::new();
    let scenarios = args
        .uncontended
        .iter()
        .map(|c| (false, *c))
        .chain(args.contended.iter().map(|c| (true, *c)));
    for (is_contended, clients) in scenarios {
        let name = if is_contended {
            "contended"
        } else {
            "uncontended"
        };
        let tag = format!("{name}-{clients}");
        note_start(args, name, clients);
        let duration = args.duration;
        let (mut runs, cpu_used) = run_tethers(tethers, cpu, |client| {
            let tag = tag.clone();
            async move {
                if is_contended {
                    contended(&client, clients, duration, &tag).await
                } else {
                    uncontended(&client, clients, duration, &tag).await
                }
            }
        })
        .await;
        let mut cpu_used = cpu_used;
        if let Some(channel) = etcd {
            let run = with_cpu(cpu, &mut cpu_used, async {
                if is_contended {
                    etcd::contended(channel, clients, duration, &tag).await
                } else {
                    etcd::uncontended(channel, clients, duration, &tag).await
                }
            })
            .await;
            runs.push((ETCD, run));
        }
        print_rows(&mut runs, name, clients, is_contended);
        results.extend(measure_with_cpu(runs, name, clients, cpu, &cpu_used));
    }
    for rate in &args.mixed_rates {
        // The same arrivals for every system.
        let arrivals = Arc::new(poisson_arrivals(
            *rate,
            args.mixed_nodes,
            args.duration,
            args.seed,
        ));
        let tag = format!("mixed-{rate}");
        note_start(args, "mixed", *rate as usize);
        let (mut runs, cpu_used) = run_tethers(tethers, cpu, |client| {
            let (tag, arrivals) = (tag.clone(), arrivals.clone());
            async move { mixed(&client, &arrivals, &tag).await }
        })
        .await;
        let mut cpu_used = cpu_used;
        if let Some(channel) = etcd {
            let run = with_cpu(cpu, &mut cpu_used, etcd::mixed(channel, &arrivals, &tag)).await;
            runs.push((ETCD, run));
        }
        print_rows(&mut runs, "mixed", *rate as usize, false);
        results.extend(measure_with_cpu(
            runs,
            "mixed",
            *rate as usize,
            cpu,
            &cpu_used,
        ));
    }
    for &clients in &args.reads {
        let tag = format!("reads-{clients}");
        note_start(args, "reads", clients);
        let duration = args.duration;
        let (mut runs, cpu_used) = run_tethers(tethers, cpu, |client| {
            let tag = tag.clone();
            async move { reads(&client, clients, duration, &tag).await }
        })
        .await;
        let mut cpu_used = cpu_used;
        if let Some(channel) = etcd {
            let run = with_cpu(
                cpu,
                &mut cpu_used,
                etcd::reads(channel, clients, duration, &tag),
            )
            .await;
            runs.push((ETCD, run));
        }
        print_rows(&mut runs, "reads", clients, false);
        results.extend(measure_with_cpu(runs, "reads", clients, cpu, &cpu_used));
    }
    results
}

/// With `--logs`, prints when a scenario starts, to line it up with the
/// replicas' logs.
fn note_start(args: &Args, scenario: &str, clients: usize) {
    if args.logs.is_some() {
        println!(
            "        ({scenario} {clients} started {} UTC)",
            utc_time_of_day()
        );
    }
}

/// Runs `workload` against every Tether row in turn, sampling each probed
/// row's CPU around its run: the runs and the CPU they used, by row.
async fn run_tethers<F, Fut>(
    tethers: &[(&'static str, tether_client::Client)],
    cpu: &[(&'static str, CpuProbe)],
    workload: F,
) -> (Vec<(&'static str, Run)>, Vec<(&'static str, CpuUsed)>)
where
    F: Fn(tether_client::Client) -> Fut,
    Fut: std::future::Future<Output = Run>,
{
    let mut runs = Vec::new();
    let mut cpu_used = Vec::new();
    for (system, client) in tethers {
        let probe = probe_of(cpu, system);
        let before = probe.map(CpuProbe::sample);
        let run = workload(client.clone()).await;
        if let (Some(probe), Some(before)) = (probe, before) {
            cpu_used.push((*system, probe.used(&before, &probe.sample())));
        }
        runs.push((*system, run));
    }
    (runs, cpu_used)
}

/// Runs etcd's `workload`, sampling etcd's probe (if any) around it into
/// `cpu_used`.
async fn with_cpu(
    cpu: &[(&'static str, CpuProbe)],
    cpu_used: &mut Vec<(&'static str, CpuUsed)>,
    workload: impl std::future::Future<Output = Run>,
) -> Run {
    let probe = probe_of(cpu, ETCD);
    let before = probe.map(CpuProbe::sample);
    let run = workload.await;
    if let (Some(probe), Some(before)) = (probe, before) {
        cpu_used.push((ETCD, probe.used(&before, &probe.sample())));
    }
    run
}

/// How long each system's idle CPU is measured (`--cpu`).
const IDLE_SPAN: Duration = Duration::from_secs(5);

/// Each probed system's CPU over [`IDLE_SPAN`] with no client calling:
/// heartbeats, timers, background work. One system at a time, so none
/// measures the others' start-up.
async fn print_idle_cpu(cpu: &[(&'static str, CpuProbe)]) {
    for (row, probe) in cpu {
        let before = probe.sample();
        tokio::time::sleep(IDLE_SPAN).await;
        let used = probe.used(&before, &probe.sample());
        let parts: Vec<String> = probe
            .processes
            .iter()
            .zip(&used.seconds)
            .take(probe.processes.len() - 1)
            .map(|((label, _), s)| format!("{label} {:.1} %", s / used.wall * 100.0))
            .collect();
        println!(
            "idle cpu ({row}, % of one core over {:.1} s, no client calling): {}; together {:.1} %",
            used.wall,
            parts.join(", "),
            used.replicas_seconds() / used.wall * 100.0
        );
    }
}

/// The CPU probe of a row, if it has one.
fn probe_of<'a>(cpu: &'a [(&'static str, CpuProbe)], system: &str) -> Option<&'a CpuProbe> {
    cpu.iter().find(|(row, _)| *row == system).map(|(_, p)| p)
}

/// Each run's figures, with its replicas' CPU per pair where it was probed;
/// prints each probed row's CPU line.
fn measure_with_cpu(
    runs: Vec<(&'static str, Run)>,
    scenario: &'static str,
    clients: usize,
    cpu: &[(&'static str, CpuProbe)],
    cpu_used: &[(&'static str, CpuUsed)],
) -> Vec<Measured> {
    let mut measured = Vec::new();
    for (system, mut run) in runs {
        let mut m = Measured::of(system, scenario, clients, &mut run);
        let used = cpu_used.iter().find(|(row, _)| *row == system);
        if let (Some(probe), Some((_, used))) = (probe_of(cpu, system), used) {
            let per_pair = used.replicas_seconds() * 1000.0 / (run.pairs.max(1) as f64);
            println!("        {}", probe.report(system, used, per_pair));
            m.replica_cpu_ms_per_pair = Some(per_pair);
        }
        measured.push(m);
    }
    measured
}

/// CPU seconds each probed process used over a span of wall time.
struct CpuUsed {
    /// Per process, in the probe's order (the bench last).
    seconds: Vec<f64>,
    wall: f64,
}

impl CpuUsed {
    /// CPU seconds of the replicas (or members) together (the bench left
    /// out).
    fn replicas_seconds(&self) -> f64 {
        let replicas = &self.seconds[..self.seconds.len() - 1];
        replicas.iter().sum()
    }
}

/// CPU time of one system's processes (a Tether cluster's replicas, or
/// etcd's members) and of the bench, from `/proc`.
struct CpuProbe {
    /// Label and pid, leader first, the bench last.
    processes: Vec<(String, u32)>,
}

/// One reading: CPU seconds per process, and when.
struct CpuSample {
    seconds: Vec<f64>,
    at: Instant,
}

impl CpuProbe {
    async fn of(
        cluster: &ProcessCluster,
        client: &tether_client::Client,
        replicas: usize,
    ) -> anyhow::Result<Self> {
        let leader = leader_of(cluster, client, "--cpu").await?.node_id;
        let mut processes = Vec::new();
        let ids = std::iter::once(leader).chain((1..=replicas as u64).filter(|id| *id != leader));
        for id in ids {
            let pid = cluster
                .pid(id)
                .ok_or_else(|| anyhow::anyhow!("replica {id} is not running"))?;
            let role = if id == leader { "leader" } else { "follower" };
            processes.push((format!("n{id} {role}"), pid));
        }
        processes.push(("bench".to_string(), std::process::id()));
        Ok(CpuProbe { processes })
    }

    /// The members of etcd (`e0`, `e1`, ...) and the bench.
    fn of_etcd(etcd: &EtcdCluster) -> Self {
        let mut processes: Vec<(String, u32)> = etcd
            .pids()
            .into_iter()
            .enumerate()
            .map(|(i, pid)| (format!("e{i}"), pid))
            .collect();
        processes.push(("bench".to_string(), std::process::id()));
        CpuProbe { processes }
    }

    fn sample(&self) -> CpuSample {
        CpuSample {
            seconds: self
                .processes
                .iter()
                .map(|(_, pid)| cpu_seconds(*pid).unwrap_or(f64::NAN))
                .collect(),
            at: Instant::now(),
        }
    }

    /// What each process used between two samples.
    fn used(&self, before: &CpuSample, after: &CpuSample) -> CpuUsed {
        CpuUsed {
            seconds: before
                .seconds
                .iter()
                .zip(&after.seconds)
                .map(|(b, a)| a - b)
                .collect(),
            wall: (after.at - before.at).as_secs_f64().max(1e-9),
        }
    }

    /// "cpu (tether, ...): n1 leader 71 %, ...; replicas 0.52 ms per pair".
    fn report(&self, row: &str, used: &CpuUsed, replica_ms_per_pair: f64) -> String {
        let parts: Vec<String> = self
            .processes
            .iter()
            .zip(&used.seconds)
            .map(|((label, _), s)| format!("{label} {:.0} %", s / used.wall * 100.0))
            .collect();
        format!(
            "cpu ({row}, % of one core over {:.1} s): {}; {} {replica_ms_per_pair:.3} ms per pair",
            used.wall,
            parts.join(", "),
            if row == ETCD { "members" } else { "replicas" }
        )
    }
}

/// The rows of one system, scenario and client count (or rate), in the
/// order the rounds ran.
fn group_rows(results: &[Measured]) -> Vec<Vec<&Measured>> {
    let mut groups: Vec<Vec<&Measured>> = Vec::new();
    for m in results {
        match groups.iter_mut().find(|g| {
            g[0].system == m.system && g[0].scenario == m.scenario && g[0].clients == m.clients
        }) {
            Some(group) => group.push(m),
            None => groups.push(vec![m]),
        }
    }
    groups
}

/// The median of `values` (the lower middle for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[(values.len() - 1) / 2]
}

/// Each row's median pairs/s over the rounds with its range, and the median
/// of the rounds' p50 pair and hand-over latencies and (`--cpu`) of the
/// replicas' CPU per pair.
fn print_summary(results: &[Measured], rounds: u32) {
    println!();
    println!("medians over {rounds} rounds (range of pairs/s in brackets)");
    println!(
        "{:<8} {:<12} {:>7} {:>10} {:>19} {:>9} {:>11} {:>12}",
        "system", "scenario", "clients", "pairs/s", "range", "p50 ms", "handover50", "cpu ms/pair"
    );
    for group in group_rows(results) {
        let rates: Vec<f64> = group.iter().map(|m| m.rate).collect();
        let low = rates.iter().copied().fold(f64::INFINITY, f64::min);
        let high = rates.iter().copied().fold(0.0, f64::max);
        let p50 = median(group.iter().map(|m| millis(m.pair_p50)).collect());
        let handover = if group[0].handover_cdf.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{:.3}",
                median(group.iter().map(|m| millis(m.handover_p50)).collect())
            )
        };
        let cpu: Vec<f64> = group
            .iter()
            .filter_map(|m| m.replica_cpu_ms_per_pair)
            .collect();
        let cpu = if cpu.is_empty() {
            "-".to_string()
        } else {
            format!("{:.3}", median(cpu))
        };
        println!(
            "{:<8} {:<12} {:>7} {:>10.0} {:>19} {:>9.3} {:>11} {:>12}",
            group[0].system,
            group[0].scenario,
            group[0].clients,
            median(rates),
            format!("[{low:.0}, {high:.0}]"),
            p50,
            handover,
            cpu
        );
    }
}

/// A duration in milliseconds.
fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// For the charts, one round per row: the one with the median pairs/s (so
/// a chart of several rounds shows a typical round, not an outlier).
fn median_rounds(results: Vec<Measured>) -> Vec<Measured> {
    let medians: Vec<(&'static str, &'static str, usize, f64)> = group_rows(&results)
        .into_iter()
        .map(|group| {
            let rate = median(group.iter().map(|m| m.rate).collect());
            (group[0].system, group[0].scenario, group[0].clients, rate)
        })
        .collect();
    let mut taken = vec![false; medians.len()];
    let mut chosen = Vec::new();
    for m in results {
        let Some(i) = medians
            .iter()
            .position(|k| k.0 == m.system && k.1 == m.scenario && k.2 == m.clients)
        else {
            continue;
        };
        if !taken[i] && m.rate == medians[i].3 {
            taken[i] = true;
            chosen.push(m);
        }
    }
    chosen
}
