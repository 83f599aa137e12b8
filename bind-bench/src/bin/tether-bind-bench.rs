//! `tether-bind-bench`: GPU pods through the real kube-scheduler, the
//! extender and Tether onto simulated GPU nodes, in one run on this
//! machine; prints what an operator feels (the crate's doc says what runs
//! and what a simulated node does).
//!
//! `./dev bench-binds [--nodes 200 --gpus 8 --chart binds.svg]`

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tether_bind_bench::run::{self, Churn, RunOptions, Workload};
use tether_bind_bench::system::System;
use tether_bind_bench::world::{World, WorldOptions};
use tether_chaos::cluster::sibling_binary;
use tether_kube_testenv::ControlPlane;

#[derive(Parser)]
#[command(
    name = "tether-bind-bench",
    about = "GPU binds through the real kube-scheduler and the extender onto simulated GPU nodes"
)]
struct Args {
    /// Simulated GPU nodes.
    #[arg(long, default_value_t = 200)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    /// The workload.
    #[arg(long, value_enum, default_value = "burst")]
    workload: Workload,
    /// The systems, in the order they run (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "tether,no-lock,annotation-lock-unlimited,annotation-lock"
    )]
    systems: Vec<System>,
    /// Give up waiting for one system's pods after this long.
    #[arg(long, default_value = "30m", value_parser = humantime::parse_duration)]
    deadline: Duration,
    /// The churn workload: pods deleted (and as many created) after the
    /// fill [default: half the GPUs].
    #[arg(long)]
    churn_pods: Option<usize>,
    /// The churn workload: deletions (each followed by a creation) a
    /// second.
    #[arg(long, default_value_t = Churn::default().rate)]
    churn_rate: f64,
    /// The churn workload: the seed that picks which live pod each
    /// deletion takes.
    #[arg(long, default_value_t = Churn::default().seed)]
    seed: u64,
    /// Write the chart of bound pods over time here (SVG).
    #[arg(long)]
    chart: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // kube's client logs each refused request as an error while the
            // API server starts; the control plane waits that out.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client::client::builder=off".into()),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let tetherd = sibling_binary("tetherd");
    anyhow::ensure!(
        tetherd.exists(),
        "no tetherd at {} (cargo build --release -p tether-server)",
        tetherd.display()
    );
    let started = std::time::Instant::now();
    let plane = ControlPlane::start().await?;
    let mut world = World::start(
        plane,
        &WorldOptions {
            tetherd,
            nodes: args.nodes,
            gpus: args.gpus,
            // The two-kinds workload's nodes have as many of the second
            // kind as GPUs; the others' have none.
            npus: if args.workload == Workload::TwoKinds {
                args.gpus
            } else {
                0
            },
        },
    )
    .await?;
    println!(
        "tether-bind-bench: {} nodes x {} GPUs, set up in {:.1} s (control plane, 3 replicas, extender, bridge, nodes)",
        args.nodes,
        args.gpus,
        started.elapsed().as_secs_f64()
    );
    anyhow::ensure!(
        args.churn_rate > 0.0 && args.churn_rate.is_finite(),
        "--churn-rate must be a positive number of deletions a second, not {}",
        args.churn_rate
    );
    let options = RunOptions {
        workload: args.workload,
        nodes: args.nodes,
        gpus: args.gpus,
        deadline: args.deadline,
        churn: Churn {
            pods: args.churn_pods,
            rate: args.churn_rate,
            seed: args.seed,
        },
    };
    if args.workload == Workload::Churn {
        println!("churn seed: {}", args.seed);
    }
    let mut reports = Vec::new();
    for system in &args.systems {
        world.use_system(*system).await?;
        let report = run::run(&world, *system, &options).await?;
        print!("{}", report.to_text());
        reports.push(report);
    }
    if reports.len() > 1 {
        print!("{}", run::comparison(&reports));
    }
    if let Some(path) = &args.chart {
        let subtitle = format!(
            "{} nodes x {} GPUs, {} workload; real kube-apiserver and kube-scheduler v1.36, 3 Tether replicas (fsync on), one machine",
            args.nodes,
            args.gpus,
            args.workload.name()
        );
        std::fs::write(path, run::chart(&reports, &subtitle))?;
        println!("chart: {}", path.display());
    }
    let tether_doubles: usize = reports
        .iter()
        .filter(|r| r.system == System::Tether.name())
        .map(|r| r.double_allocations.len())
        .sum();
    anyhow::ensure!(
        tether_doubles == 0,
        "{tether_doubles} double allocations with Tether"
    );
    Ok(())
}
