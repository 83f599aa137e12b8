//! `tether-device-plugin`: a kubelet device plugin for a fake GPU resource
//! whose `Allocate` learns its pod from Tether (see
//! `tether_embed::device_plugin`).

use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use tether_client::Options;
use tether_embed::cli::DevicePluginArgs;
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, router, run};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether_http::logging::init("info");
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
        allocate_deadline: args.allocate_timeout,
    };
    let placement = Placement {
        dir: args.plugin_dir,
        socket_name: args.socket_name,
    };
    let plugin = Arc::new(GpuPlugin::new(client, config));
    // One SIGTERM stops both the plugin and its HTTP side; so does the
    // plugin ending on its own (an error).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let signal = tether_embed::shutdown_signal();
    tokio::spawn({
        let stop_tx = stop_tx.clone();
        async move {
            signal.await;
            let _ = stop_tx.send(true);
        }
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let listener = tokio::net::TcpListener::bind(args.http_listen)
        .await
        .with_context(|| format!("cannot listen on {} for /metrics", args.http_listen))?;
    tracing::info!(listen = %args.http_listen, "serving /health and /metrics");
    let http = tokio::spawn(tether_http::serve(
        listener,
        router(plugin.clone()),
        stopped(stop_rx.clone()),
    ));
    let result = run(plugin, placement, stopped(stop_rx)).await;
    let _ = stop_tx.send(true);
    let _ = http.await;
    result
}
