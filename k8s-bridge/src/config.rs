//! `tether-bridge`'s flags (each also an environment variable). In the
//! library so the deployment manifests can be checked against them.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Configuration of one bridge.
#[derive(Parser)]
#[command(
    name = "tether-bridge",
    version,
    about = "Kubernetes → Tether bridge: releases what deleted pods and nodes held"
)]
pub struct BridgeConfig {
    /// The Tether replicas and the credentials for them.
    #[command(flatten)]
    pub tether: tether_client::ConnectArgs,
    /// A kubeconfig file (default: in-cluster config, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Address of `/health` and `/metrics`.
    #[arg(
        long,
        env = "TETHER_BRIDGE_HTTP_LISTEN",
        default_value = "127.0.0.1:8891"
    )]
    pub http_listen: std::net::SocketAddr,
    /// How often to diff Tether against the cached cluster state.
    #[arg(long, env = "TETHER_BRIDGE_RESYNC", default_value = "60s", value_parser = humantime::parse_duration)]
    pub resync: Duration,
}
