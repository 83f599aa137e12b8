//! `tether-device-plugin`: a kubelet device plugin for a fake GPU resource
//! whose `Allocate` learns its pod from Tether (see
//! `tether_embed::device_plugin`).

use std::path::PathBuf;

use clap::Parser;
use tether_client::{Client, Options};
use tether_embed::device_plugin::{GpuPlugin, PluginConfig, register, serve_on_socket};

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
    let mut options = Options::default();
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
    let socket = args.plugin_dir.join(&args.socket_name);
    let server = tokio::spawn({
        let socket = socket.clone();
        async move {
            serve_on_socket(GpuPlugin::new(client, config), &socket, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
        }
    });
    // Register once the socket exists, so the kubelet can dial it at once.
    while !socket.exists() && !server.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    register(
        &args.plugin_dir.join("kubelet.sock"),
        &args.socket_name,
        &args.resource_name,
    )
    .await?;
    tracing::info!(node = args.node_name, resource = args.resource_name, socket = %socket.display(), "registered with the kubelet");
    server.await??;
    Ok(())
}
