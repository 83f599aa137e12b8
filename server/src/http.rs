//! The HTTP port: `GET /health` (a leader is known), `/ready` (member,
//! leader known, caught up: for readiness probes), `/live` (the process
//! answers and its Raft core runs: for liveness probes), `/metrics`
//! (OpenMetrics), and the HTTP/JSON API (`POST /v1/...`, described at
//! `GET /openapi.json`; see [`crate::gateway`]), served by axum through
//! `tether_http`. With `--tls-dir` the port serves HTTPS and asks for a
//! client certificate without requiring one. A `failpoints` build also
//! serves `PUT /failpoints/{name}` (body: the actions, as in `FAILPOINTS`)
//! and `DELETE /failpoints/{name}`, so the chaos suite can change a running
//! replica, e.g. step the sitting leader's clock.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::extract::connect_info::Connected;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use axum::serve::IncomingStream;
use futures::{Stream, StreamExt as _};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tether_tls::{Conn, TlsMaterial};
use tokio::net::TcpListener;

use crate::api::Ctx;
use crate::gateway::HttpPeer;
use crate::replica::Role;

/// Serves until `shutdown` resolves, over TLS when `tls` is given.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<TlsMaterial>>,
    ctx: Arc<Ctx>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let listener = HttpListener::new(listener, tls);
    tether_http::serve_connected::<_, HttpPeer>(
        listener,
        router(ctx),
        shutdown,
        tether_http::SHUTDOWN_GRACE,
    )
    .await;
}

/// The HTTP port's connections as axum takes them: accepted (and, with
/// TLS, handshaken) by `tether_tls`, as the gRPC port's are.
struct HttpListener {
    connections: Pin<Box<dyn Stream<Item = std::io::Result<Conn>> + Send>>,
    local: SocketAddr,
}

impl HttpListener {
    fn new(listener: TcpListener, tls: Option<Arc<TlsMaterial>>) -> Self {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        Self {
            connections: Box::pin(tether_tls::incoming_http(listener, tls)),
            local,
        }
    }
}

impl axum::serve::Listener for HttpListener {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        use tonic::transport::server::Connected as _;
        loop {
            match self.connections.next().await {
                Some(Ok(conn)) => {
                    let peer = conn.connect_info().remote_addr.unwrap_or(self.local);
                    return (conn, peer);
                }
                // E.g. out of file descriptors: wait, as axum's own
                // listener does, rather than spin.
                Some(Err(err)) => {
                    tracing::warn!(%err, "HTTP accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

impl Connected<IncomingStream<'_, HttpListener>> for HttpPeer {
    fn connect_info(stream: IncomingStream<'_, HttpListener>) -> Self {
        HttpPeer(tonic::transport::server::Connected::connect_info(
            stream.io(),
        ))
    }
}

/// The routes: the probes and `/metrics` (GET), the JSON API (POST);
/// another method on a known path answers 405, an unknown path 404.
pub fn router(ctx: Arc<Ctx>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|State(ctx): State<Arc<Ctx>>| async move { health(&ctx) }),
        )
        .route(
            "/ready",
            get(|State(ctx): State<Arc<Ctx>>| async move { ready(&ctx) }),
        )
        .route(
            "/live",
            get(|State(ctx): State<Arc<Ctx>>| async move { live(&ctx) }),
        )
        .route(
            "/metrics",
            get(|State(ctx): State<Arc<Ctx>>| async move {
                tether_http::metrics::response(metrics(&ctx))
            }),
        )
        .merge(failpoint_routes())
        .with_state(ctx.clone())
        .merge(crate::gateway::router(ctx))
        .fallback(|| async {
            tether_http::text(
                StatusCode::NOT_FOUND,
                "not found: try /health, /ready, /live, /metrics, or the API under /v1 \
                 (GET /openapi.json lists it)\n",
            )
        })
}

/// `PUT` / `DELETE /failpoints/{name}`: only in `failpoints` builds.
#[cfg(feature = "failpoints")]
fn failpoint_routes() -> Router<Arc<Ctx>> {
    use axum::extract::Path;
    use axum::routing::put;
    Router::new().route(
        "/failpoints/{name}",
        put(|Path(name): Path<String>, actions: String| async move {
            match fail::cfg(name.clone(), actions.trim()) {
                Ok(()) => {
                    tracing::warn!(failpoint = %name, actions = %actions.trim(), "failpoint set");
                    tether_http::text(StatusCode::OK, "set\n")
                }
                Err(err) => tether_http::text(StatusCode::BAD_REQUEST, format!("{err}\n")),
            }
        })
        .delete(|Path(name): Path<String>| async move {
            fail::remove(&name);
            tracing::warn!(failpoint = %name, "failpoint removed");
            tether_http::text(StatusCode::OK, "removed\n")
        }),
    )
}

/// Without the `failpoints` feature there is nothing to change.
#[cfg(not(feature = "failpoints"))]
fn failpoint_routes() -> Router<Arc<Ctx>> {
    Router::new()
}

/// 200 while the Raft core runs; 503 once it stopped on its own (the
/// process is about to exit; until then the probe fails too).
fn live(ctx: &Ctx) -> Response {
    match ctx.core.core_stopped.get() {
        Some(reason) => tether_http::text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the Raft core stopped: {reason}\n"),
        ),
        None => tether_http::text(StatusCode::OK, "alive\n"),
    }
}

/// 200 when this replica is running and knows a leader; 503 otherwise.
fn health(ctx: &Ctx) -> Response {
    let view = ctx.core.view();
    let healthy = view.fatal.is_none() && view.leader_id.is_some();
    let body = serde_json::json!({
        "healthy": healthy,
        "node_id": ctx.core.id,
        "state": format!("{:?}", view.role),
        "leader": view.leader_id,
        "term": view.term,
        "applied_index": view.applied_index,
    });
    let status = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    tether_http::json(status, &body)
}

/// Entries a replica may have in its log but not yet applied and still be
/// called caught up.
const READY_APPLY_LAG: u64 = 1000;

/// Readiness: 200 when this replica is in the membership (voter or learner),
/// knows a leader, and has applied nearly all of its log — a StatefulSet's
/// readiness probe, so clients are only sent to replicas that can answer.
fn ready(ctx: &Ctx) -> Response {
    let view = ctx.core.view();
    let member = view.member(ctx.core.id).is_some();
    let last_log = view.last_log_index.unwrap_or(0);
    let applied = view.applied_index;
    let caught_up = last_log.saturating_sub(applied) <= READY_APPLY_LAG;
    let ready = view.fatal.is_none() && view.leader_id.is_some() && member && caught_up;
    let body = serde_json::json!({
        "ready": ready,
        "member": member,
        "leader": view.leader_id,
        "last_log_index": last_log,
        "applied_index": applied,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    tether_http::json(status, &body)
}

/// The replica's counters and histograms, then gauges read from its Raft
/// metrics and applied state now.
fn metrics(ctx: &Ctx) -> String {
    let view = ctx.core.view();
    let mut now = Registry::default();
    let mut gauge = |name: &str, help: &str, value: u64| {
        let gauge: Gauge = Gauge::default();
        gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
        now.register(name, help, gauge);
    };
    gauge("tether_raft_term", "Current Raft term", view.term);
    gauge(
        "tether_raft_is_leader",
        "1 if this replica leads",
        u64::from(view.role == Role::Leader),
    );
    gauge(
        "tether_raft_last_log_index",
        "Last log index",
        view.last_log_index.unwrap_or(0),
    );
    gauge(
        "tether_raft_applied_index",
        "Last applied log index",
        view.applied_index,
    );
    gauge(
        "tether_raft_snapshot_index",
        "Last snapshot's log index",
        view.snapshot_index.unwrap_or(0),
    );
    gauge(
        "tether_raft_leader_id",
        "Id of the leader this replica follows (0 while it knows none)",
        view.leader_id.unwrap_or(0),
    );
    {
        let applied = ctx.core.state.read();
        let state = &applied.state;
        let held = state.locks.values().filter(|l| l.holder.is_some()).count();
        let waiting: usize = state.locks.values().map(|l| l.waiters.len()).sum();
        let stuck = state
            .locks
            .values()
            .filter(|l| l.holder.as_ref().is_some_and(|h| h.token == l.stuck_token))
            .count();
        let live = state
            .nodes
            .values()
            .filter(|n| n.gone_at_ms.is_none())
            .count();
        gauge("tether_locks_held", "Locks with a holder", held as u64);
        gauge(
            "tether_lock_waiters",
            "Queued acquires over all locks",
            waiting as u64,
        );
        gauge(
            "tether_ttl_leases",
            "Live TTL leases",
            state.leases.len() as u64,
        );
        gauge(
            "tether_client_sessions",
            "Clients in the dedupe table",
            state.sessions.len() as u64,
        );
        gauge(
            "tether_locks_stuck",
            "Holds past their timeout whose pod has not started (kept, not handed over)",
            stuck as u64,
        );
        gauge("tether_pins", "Pod-to-node pins", state.pins.len() as u64);
        gauge("tether_nodes", "Live nodes in the registry", live as u64);
    }
    tether_http::metrics::encode(&[ctx.core.metrics.registry(), &now])
}
