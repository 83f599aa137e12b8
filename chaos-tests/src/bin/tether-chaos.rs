//! `tether-chaos`: runs seeded fault schedules against real `tetherd`
//! processes on loopback and checks the histories. Prints one line per
//! failing schedule (with its seed) and a summary; exits 1 on any violation.
//!
//! ```text
//! tether-chaos --schedules 200                 # the CI run
//! tether-chaos --soak 4h --schedules 1000000   # a soak
//! tether-chaos --seed 1234 --schedules 1       # replay one seed
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tether_chaos::cluster::sibling_binary;
use tether_chaos::driver::{DriverOptions, run_many};
use tether_chaos::runner::RunConfig;
use tether_chaos::schedule::{FaultOptions, KINDS};

#[derive(Parser)]
#[command(about = "Seeded fault schedules against a real Tether cluster, with history checkers")]
struct Args {
    /// Schedules to run (schedule n uses seed SEED + n).
    #[arg(long, default_value_t = 200)]
    schedules: u64,
    /// First seed (default: from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop after this long even if schedules remain (soak mode).
    #[arg(long, value_parser = humantime::parse_duration)]
    soak: Option<Duration>,
    /// Voters per cluster.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Clusters run side by side.
    #[arg(long, default_value_t = 2)]
    lanes: usize,
    /// Schedules per cluster before a fresh one.
    #[arg(long, default_value_t = 25)]
    per_cluster: u64,
    /// How long clients run in each schedule.
    #[arg(long, default_value = "2500ms", value_parser = humantime::parse_duration)]
    workload: Duration,
    /// The tetherd binary (default: tetherd-failpoints, else tetherd, next
    /// to this one).
    #[arg(long)]
    tetherd: Option<PathBuf>,
    /// The tetherd is a `failpoints` build: draw failpoint crashes too
    /// (default: when the binary's name says so).
    #[arg(long)]
    failpoints: Option<bool>,
    /// Draw member replacements (remove, wipe, add, promote).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    membership: bool,
    /// FAILPOINTS for every replica, e.g. a deliberate bug:
    /// sm-acquire-ignore-holder=return. The run must then report violations.
    #[arg(long)]
    broken: Option<String>,
    /// Draw only this kind of fault (partition, isolate-leader, one-way,
    /// delay, flaky, kill, pause, transfer-leader, replace-member,
    /// failpoint-crash).
    #[arg(long)]
    only: Option<String>,
    /// Power-loss schedules: every replica's data directory on a mount of
    /// its own of the lazy file system (`tether-lazyfs`, the `lazyfs/`
    /// crate, or the binary TETHER_LAZYFS names), and each
    /// schedule opens with a power cut of a minority or of every replica
    /// (kill -9, unsynced writes dropped, restart on what the disk kept).
    #[arg(long)]
    power_loss: bool,
    /// Print every schedule.
    #[arg(long, short)]
    verbose: bool,
    /// RUST_LOG of the replicas, e.g. `info` (default: warnings only). A
    /// failing schedule's replica logs are kept beside its evidence.
    #[arg(long)]
    replica_log: Option<String>,
}

// More worker threads than cores: the run's proxies (every replica link),
// clients and fault injection share this runtime, and the harness makes a
// few blocking calls (killing and reaping replicas, a failpoint's HTTP
// request, dropping a cluster's data); with one thread per core, two lanes
// blocked at once would stall every proxy and client of both clusters.
#[tokio::main(flavor = "multi_thread", worker_threads = 8)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let tetherd = args.tetherd.unwrap_or_else(|| {
        let armed = sibling_binary("tetherd-failpoints");
        if armed.exists() {
            armed
        } else {
            sibling_binary("tetherd")
        }
    });
    let failpoints = args.failpoints.unwrap_or_else(|| {
        tetherd
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains("failpoints"))
    });
    let only = match args.only.as_deref() {
        None => None,
        Some(name) => Some(
            *KINDS
                .iter()
                .find(|k| **k == name)
                .ok_or_else(|| anyhow::anyhow!("--only {name:?}: not one of {KINDS:?}"))?,
        ),
    };
    if only.is_some_and(|o| o.starts_with("power-loss")) && !args.power_loss {
        anyhow::bail!(
            "--only {}: needs --power-loss (the data on LazyFS)",
            only.unwrap()
        );
    }
    if args.power_loss {
        tether_kube_testenv::lazyfs::available().map_err(anyhow::Error::msg)?;
    }
    if only == Some("failpoint-crash") && !failpoints {
        anyhow::bail!(
            "--only failpoint-crash needs a failpoints build of tetherd (--failpoints true)"
        );
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() % 1_000_000 * 1000)
            .unwrap_or(0)
    });
    let options = DriverOptions {
        tetherd,
        replicas: args.replicas,
        schedules: args.schedules,
        duration: args.soak,
        seed,
        lanes: args.lanes,
        per_cluster: args.per_cluster,
        workload: args.workload,
        faults: FaultOptions {
            failpoints,
            membership: args.membership,
            only,
            power_loss: args.power_loss,
        },
        failpoints_env: args.broken,
        run: RunConfig::default(),
        verbose: args.verbose,
        replica_log: args.replica_log,
        keep_evidence: true,
    };
    println!(
        "tether-chaos: {} schedules from seed {seed} ({} replicas, {} lanes, failpoints {}, \
         power loss {}, tetherd {}); replay one with --seed N --schedules 1",
        options.schedules,
        options.replicas,
        options.lanes,
        if failpoints { "on" } else { "off" },
        if args.power_loss {
            "on (tether-lazyfs)"
        } else {
            "off"
        },
        options.tetherd.display()
    );
    let summary = run_many(options.clone()).await?;
    for (seed, problem) in summary.failing.iter().take(20) {
        println!("failing seed {seed}: {problem}");
    }
    println!("{}", summary.line(&options));
    if !summary.clean() {
        std::process::exit(1);
    }
    Ok(())
}
