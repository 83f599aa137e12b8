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
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::extender::{Extender, ExtenderConfig, KubeBinder, serve_extender};

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
    /// How long a bind waits in the node's queue. kube-scheduler gives an
    /// extender `httpTimeout` (5 s unless configured) for the whole call:
    /// keep this below it, minus the binding call, so the extender gives up
    /// before the scheduler does.
    #[arg(long, env = "TETHER_EXTENDER_BIND_WAIT", default_value = "3s", value_parser = humantime::parse_duration)]
    bind_wait: Duration,
    /// The extended resource whose devices are planned (what the device
    /// plugin advertises).
    #[arg(
        long,
        env = "TETHER_EXTENDER_RESOURCE",
        default_value = "tether.io/gpu"
    )]
    resource: String,
    /// GPUs per node (device ids `<prefix>0..N`, as the device plugin
    /// advertises them).
    #[arg(long, default_value_t = 8)]
    devices_per_node: usize,
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
        resource: args.resource,
        wait: args.bind_wait,
        node_devices: (0..args.devices_per_node)
            .map(|i| format!("{}{i}", args.device_prefix))
            .collect(),
    };
    let ledger = DeviceLedger::new(client.clone(), DEFAULT_LIFETIME);
    let extender = Arc::new(Extender::new(client, ledger, KubeBinder::new(kube), config));
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, endpoints = ?args.endpoints, "tether-extender serving POST /bind");
    serve_extender(listener, extender, tether_embed::shutdown_signal()).await;
    Ok(())
}
