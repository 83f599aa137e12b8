//! `tether-extender`: a kube-scheduler extender whose `bind` verb serializes
//! GPU binds per node through Tether (see `tether_embed::extender`).
//!
//! Configure kube-scheduler with an extender whose `urlPrefix` is this
//! server and `bindVerb: bind`. The Kubernetes API is reached with the
//! in-cluster config or `KUBECONFIG`.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tether_client::{Client, Options};
use tether_embed::extender::{Extender, ExtenderConfig, KubeBinder, serve_extender};
use tether_embed::plan::Planner;

#[derive(Parser)]
#[command(
    name = "tether-extender",
    version,
    about = "Scheduler-extender bind verb on Tether locks"
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
    #[command(flatten)]
    security: tether_client::SecurityArgs,
    /// Address to serve the extender on.
    #[arg(long, env = "TETHER_EXTENDER_LISTEN", default_value = "127.0.0.1:8890")]
    listen: std::net::SocketAddr,
    /// Lock scope.
    #[arg(long, env = "TETHER_EXTENDER_SCOPE", default_value = "gpu-bind")]
    scope: String,
    /// How long a bind waits in the node's queue.
    #[arg(long, env = "TETHER_EXTENDER_BIND_WAIT", default_value = "30s", value_parser = humantime::parse_duration)]
    bind_wait: Duration,
    /// GPUs per node (device ids `<prefix>0..N`).
    #[arg(long, default_value_t = 8)]
    devices_per_node: usize,
    /// GPUs per pod.
    #[arg(long, default_value_t = 1)]
    gpus_per_pod: usize,
    /// Device id prefix.
    #[arg(long, default_value = "gpu")]
    device_prefix: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, not in files or `kubectl logs`.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let kube = kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!("cannot reach the Kubernetes API (in-cluster config or KUBECONFIG): {e}")
    })?;
    let mut options = Options::default();
    args.security.apply(&mut options)?;
    let client = Client::new(args.endpoints.clone(), options)?;
    let config = ExtenderConfig {
        scope: args.scope,
        wait: args.bind_wait,
        planner: Planner {
            device_prefix: args.device_prefix,
            devices_per_node: args.devices_per_node,
            per_pod: args.gpus_per_pod,
        },
    };
    let extender = Arc::new(Extender::new(client, KubeBinder::new(kube), config));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, endpoints = ?args.endpoints, "tether-extender serving POST /bind");
    serve_extender(listener, extender, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await;
    Ok(())
}
