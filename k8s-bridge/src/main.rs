//! `tether-bridge`: watches Pods and Nodes and reports to Tether what it must
//! know (see `tether_k8s_bridge`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use clap::Parser;
use tether_client::Options;
use tether_k8s_bridge::bridge::Bridge;
use tether_k8s_bridge::config::BridgeConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether_http::logging::init("info");
    let args = BridgeConfig::parse();
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let kube = kube::Client::try_from(config)?;
    let tether = args.tether.client(Options::default())?;
    tracing::info!(endpoints = ?args.tether.endpoints, resync = ?args.resync, "tether-bridge starting");
    let bridge = Bridge::new(tether, kube);
    let http = tokio::net::TcpListener::bind(args.http_listen).await?;
    tokio::spawn(tether_http::serve(
        http,
        routes(bridge.clone()),
        std::future::pending(),
    ));
    bridge.run(args.resync, shutdown_signal()).await;
    tracing::info!("tether-bridge stopped");
    Ok(())
}

/// `GET /health` (200 once the first pod and node lists are in) and
/// `GET /metrics`; other methods 405, other paths 404.
fn routes(bridge: Arc<Bridge>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|State(bridge): State<Arc<Bridge>>| async move {
                if bridge.healthy() {
                    tether_http::text(StatusCode::OK, "ok\n")
                } else {
                    tether_http::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "waiting for the first pod and node lists\n",
                    )
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(bridge): State<Arc<Bridge>>| async move {
                tether_http::metrics::response(bridge.render_metrics())
            }),
        )
        .fallback(|| async {
            tether_http::text(StatusCode::NOT_FOUND, "try /health or /metrics\n")
        })
        .with_state(bridge)
}

/// SIGTERM (Kubernetes stopping the pod; as PID 1 the default action is
/// ignored, so without this every stop waits out the grace period) or
/// Ctrl-C.
async fn shutdown_signal() {
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: stopping"),
    }
}
