//! `tether-device-plugin`: a kubelet device plugin for a fake GPU resource
//! whose `Allocate` learns its pod from Tether (see
//! `tether_embed::device_plugin`).

use std::sync::Arc;

use clap::Parser;
use tether_client::Options;
use tether_embed::cli::DevicePluginArgs;
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, run};

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
    let args = DevicePluginArgs::parse();
    let options = Options {
        retry_timeout: args.allocate_timeout,
        ..Options::default()
    };
    let client = args.tether.client(options)?;
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
