//! `tether-extender`: a kube-scheduler extender whose `bind` verb serializes
//! GPU binds per node through Tether (see `tether_embed::extender`).
//!
//! Configure kube-scheduler with an extender whose `urlPrefix` is this
//! server, `filterVerb: filter` and `bindVerb: bind` (see
//! `deploy/optional/gpu/scheduler.yaml`). The Kubernetes API is reached with the
//! in-cluster config or `KUBECONFIG`.

use std::sync::Arc;

use clap::Parser;
use tether_client::Options;
use tether_embed::accounting::{DEFAULT_LIFETIME, DeviceLedger};
use tether_embed::cli::ExtenderArgs;
use tether_embed::extender::{Extender, KubeBinder, serve_extender};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether_http::logging::init("info");
    let args = ExtenderArgs::parse();
    let kube = kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!("cannot reach the Kubernetes API (in-cluster config or KUBECONFIG): {e}")
    })?;
    let client = args.tether.client(Options::default())?;
    let config = args.extender_config().map_err(anyhow::Error::msg)?;
    let ledger = DeviceLedger::new(client.clone(), DEFAULT_LIFETIME);
    let extender = Arc::new(Extender::new(client, ledger, KubeBinder::new(kube), config));
    // Before the port opens: a SIGTERM from then on stops the server.
    let shutdown = tether_embed::shutdown_signal();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, endpoints = ?args.tether.endpoints, "tether-extender serving POST /bind");
    serve_extender(listener, extender, shutdown).await;
    Ok(())
}
