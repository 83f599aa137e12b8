//! `tetherd`: run one Tether replica.
//!
//! With no arguments it starts a single-node cluster with its data in
//! `./tether-data`, serving gRPC on 127.0.0.1:7420 and HTTP (`/health`,
//! `/metrics`) on 127.0.0.1:7421 — an insecure development default.

use clap::Parser;
use tether_server::{Config, Node};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether_http::logging::init("info,openraft=warn");
    #[cfg(feature = "failpoints")]
    let _failpoints = arm_failpoints();
    let config = Config::parse();
    tracing::info!(
        // In StatefulSet mode the id is read from the data directory later.
        node_id = (!config.statefulset).then_some(config.node_id),
        statefulset = config.statefulset,
        listen = %config.listen,
        http = %config.http_listen,
        data_dir = %config.data_dir.display(),
        "tetherd starting"
    );
    match (&config.tls_dir, &config.auth_tokens) {
        (Some(dir), _) => tracing::info!(
            tls_dir = %dir.display(),
            "mutual TLS on: callers need a certificate from the CA; roles come from certificates"
        ),
        (None, Some(tokens)) => tracing::warn!(
            tokens = %tokens.display(),
            "INSECURE TRANSPORT: roles come from bearer tokens sent in clear text over plain \
             TCP; for development only (use --tls-dir elsewhere)"
        ),
        (None, None) => tracing::warn!(
            "INSECURE: no TLS and no authentication; anyone who can reach {} can take and \
             release locks. Keep it on loopback or a trusted network, or use --tls-dir.",
            config.listen
        ),
    }
    if config.initial_members.is_none() && !config.statefulset {
        tracing::info!("no --initial-members: running as a single-node cluster");
    }
    let node = Node::start(config).await?;
    let core_stopped = tokio::select! {
        _ = wait_for_signal() => None,
        reason = node.core_stopped() => Some(reason),
    };
    let Some(reason) = core_stopped else {
        tracing::info!("shutting down");
        node.shutdown().await;
        return Ok(());
    };
    node.stop().await;
    // A plain exit code, not an error with a backtrace: the line above the
    // exit says what happened (`node::watch_core` logged the details).
    tracing::error!(
        reason,
        "the Raft core stopped; exiting with status 1 so that this replica is restarted (it \
         recovers from its data directory)"
    );
    std::process::exit(1)
}

/// SIGTERM (Kubernetes) or Ctrl-C.
async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler cannot fail on unix");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Reads FAILPOINTS (e.g. `sm-apply-before-write=3*off->panic`) and makes any
/// panic abort the process: a failpoint's "panic" is then a crash at exactly
/// that line, like `kill -9` there, whichever task it fires in.
#[cfg(feature = "failpoints")]
fn arm_failpoints() -> fail::FailScenario<'static> {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        std::process::abort();
    }));
    tracing::warn!(
        "built with failpoints: FAILPOINTS={:?}",
        std::env::var("FAILPOINTS").ok()
    );
    fail::FailScenario::setup()
}
