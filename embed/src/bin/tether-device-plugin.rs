//! `tether-device-plugin`: a kubelet device plugin for a node's NVIDIA GPUs
//! (or fake devices) whose `Allocate` learns its pod from Tether (see
//! `tether_embed::device_plugin`).

use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use tether_client::Options;
use tether_embed::cli::DevicePluginArgs;
use tether_embed::device_plugin::{GpuPlugin, Placement, PluginConfig, router, run};
use tether_embed::inventory::DeviceSource;

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
        claim_set: args.claim_set.clone(),
        inventory_set: args.inventory_set.clone(),
        devices: DeviceSource::parse(
            &args.devices,
            args.host_root.clone(),
            args.rescan,
            &args.device_prefix,
        )
        .map_err(anyhow::Error::msg)?,
        pod_uid: args.pod_uid.clone().unwrap_or_else(|| {
            let made = tether_embed::inventory::standalone_owner(&args.node_name);
            tracing::warn!(owner = made, "no --pod-uid (POD_UID): the published devices are owned by no pod and end with the node only");
            made
        }),
        allocate_deadline: args.allocate_timeout,
    };
    let placement = Placement {
        dir: args.plugin_dir,
        socket_name: args.socket_name,
    };
    let plugin = Arc::new(
        GpuPlugin::new(client, config)
            .with_context(|| format!("cannot read the GPUs under {}", args.host_root.display()))?,
    );
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
