//! `tether-device-plugin`: a kubelet device plugin for a fake GPU resource
//! whose `Allocate` learns its pod from Tether (see
//! `tether_embed::device_plugin`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tether_client::{Client, Options};
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, run};

#[derive(Parser)]
#[command(
    name = "tether-device-plugin",
    version,
    about = "Kubelet device plugin that serves the pod holding gpu-bind/<node>"
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
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Lock scope.
    #[arg(long, default_value = "gpu-bind")]
    scope: String,
    /// Extended resource name.
    #[arg(long, default_value = "tether.io/gpu")]
    resource_name: String,
    /// Number of fake GPUs.
    #[arg(long, default_value_t = 8)]
    devices: usize,
    /// Device id prefix.
    #[arg(long, default_value = "gpu")]
    device_prefix: String,
    /// The kubelet's device-plugin directory.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    plugin_dir: PathBuf,
    /// This plugin's socket file name in that directory.
    #[arg(long, default_value = "tether-gpu.sock")]
    socket_name: String,
    /// How long one `Allocate` keeps retrying Tether (across an election,
    /// say) before it fails. The kubelet never retries a failed Allocate:
    /// the pod fails. The kubelet waits for the answer while it admits the
    /// pod, so keep this to seconds.
    #[arg(long, env = "TETHER_ALLOCATE_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    allocate_timeout: Duration,
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
    let mut options = Options {
        retry_timeout: args.allocate_timeout,
        ..Options::default()
    };
    args.security.apply(&mut options)?;
    let client = Client::new(args.endpoints.clone(), options)?;
    let config = PluginConfig {
        node: args.node_name.clone(),
        scope: args.scope,
        resource_name: args.resource_name.clone(),
        devices: (0..args.devices)
            .map(|i| format!("{}{i}", args.device_prefix))
            .collect(),
    };
    let placement = Placement {
        dir: args.plugin_dir,
        socket_name: args.socket_name,
    };
    run(
        Arc::new(GpuPlugin::new(client, config)),
        placement,
        tether_embed::shutdown_signal(),
    )
    .await
}
