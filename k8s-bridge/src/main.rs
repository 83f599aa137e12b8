//! `tether-bridge`: watches Pods and Nodes and reports to Tether what it must
//! know (see `tether_k8s_bridge`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tether_client::{Client, Options};
use tether_k8s_bridge::bridge::Bridge;

#[derive(Parser)]
#[command(
    name = "tether-bridge",
    version,
    about = "Kubernetes → Tether bridge: releases what deleted pods and nodes held"
)]
struct Args {
    /// Tether replicas, comma-separated host:port.
    #[arg(
        long,
        env = "TETHER_ENDPOINTS",
        default_value = "127.0.0.1:7420",
        value_delimiter = ','
    )]
    endpoints: Vec<String>,
    /// A kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// How often to diff Tether against the cached cluster state.
    #[arg(long, env = "TETHER_BRIDGE_RESYNC", default_value = "60s", value_parser = humantime::parse_duration)]
    resync: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let kube = kube::Client::try_from(config)?;
    let tether = Client::new(args.endpoints.clone(), Options::default())?;
    tracing::info!(endpoints = ?args.endpoints, resync = ?args.resync, "tether-bridge starting");
    Bridge::new(tether, kube)
        .run(args.resync, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    Ok(())
}
