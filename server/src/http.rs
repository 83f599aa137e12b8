//! The HTTP side port: `GET /health` (a leader is known), `/ready` (member,
//! leader known, caught up: for readiness probes), `/live` (the process
//! answers: for liveness probes) and `/metrics` (Prometheus text).
//! A deliberately tiny HTTP/1.1 responder: four read-only endpoints do not
//! justify a web framework in the dependency tree.

use std::fmt::Write;
use std::sync::Arc;

use openraft::ServerState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::api::Ctx;

/// Serves until `shutdown` resolves.
pub async fn serve(listener: TcpListener, ctx: Arc<Ctx>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let ctx = ctx.clone();
                    tokio::spawn(async move {
                        if let Err(err) = handle(stream, &ctx).await {
                            tracing::debug!(%err, "HTTP connection failed");
                        }
                    });
                }
                Err(err) => tracing::warn!(%err, "HTTP accept failed"),
            },
        }
    }
}

async fn handle(mut stream: TcpStream, ctx: &Ctx) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    // Read until the end of the request head (or the buffer is full).
    while len < buf.len() && !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            stream.read(&mut buf[len..]),
        )
        .await
        .map_err(|_| std::io::Error::other("request head timed out"))??;
        if n == 0 {
            break;
        }
        len += n;
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = match (method, path) {
        ("GET", "/health") => health(ctx),
        ("GET", "/ready") => ready(ctx),
        ("GET", "/live") => match ctx.core_stopped.get() {
            // The process is about to exit; until then the probe fails too.
            Some(reason) => (
                "503 Service Unavailable",
                "text/plain",
                format!("the Raft core stopped: {reason}\n"),
            ),
            None => ("200 OK", "text/plain", "alive\n".into()),
        },
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics(ctx)),
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "not found: try /health, /ready, /live or /metrics\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET is served\n".into(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// 200 when this replica is running and knows a leader; 503 otherwise.
fn health(ctx: &Ctx) -> (&'static str, &'static str, String) {
    let m = ctx.raft.metrics().borrow().clone();
    let healthy = m.running_state.is_ok() && m.current_leader.is_some();
    let body = format!(
        "{{\"healthy\":{healthy},\"node_id\":{},\"state\":\"{:?}\",\"leader\":{},\"term\":{},\"applied_index\":{}}}\n",
        ctx.id,
        m.state,
        m.current_leader
            .map_or("null".to_string(), |l| l.to_string()),
        m.current_term,
        m.last_applied.map_or(0, |l| l.index),
    );
    let status = if healthy {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    (status, "application/json", body)
}

/// Entries a replica may have in its log but not yet applied and still be
/// called caught up.
const READY_APPLY_LAG: u64 = 1000;

/// Readiness: 200 when this replica is in the membership (voter or learner),
/// knows a leader, and has applied nearly all of its log — a StatefulSet's
/// readiness probe, so clients are only sent to replicas that can answer.
fn ready(ctx: &Ctx) -> (&'static str, &'static str, String) {
    let m = ctx.raft.metrics().borrow().clone();
    let member = m
        .membership_config
        .membership()
        .nodes()
        .any(|(id, _)| *id == ctx.id);
    let last_log = m.last_log_index.unwrap_or(0);
    let applied = m.last_applied.map_or(0, |l| l.index);
    let caught_up = last_log.saturating_sub(applied) <= READY_APPLY_LAG;
    let ready = m.running_state.is_ok() && m.current_leader.is_some() && member && caught_up;
    let body = format!(
        "{{\"ready\":{ready},\"member\":{member},\"leader\":{},\"last_log_index\":{last_log},\"applied_index\":{applied}}}\n",
        m.current_leader
            .map_or("null".to_string(), |l| l.to_string()),
    );
    let status = if ready {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    (status, "application/json", body)
}

fn metrics(ctx: &Ctx) -> String {
    let m = ctx.raft.metrics().borrow().clone();
    let mut out = String::new();
    let gauge = |out: &mut String, name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    };
    gauge(
        &mut out,
        "tether_raft_term",
        "Current Raft term.",
        m.current_term,
    );
    gauge(
        &mut out,
        "tether_raft_is_leader",
        "1 if this replica leads.",
        u64::from(m.state == ServerState::Leader),
    );
    gauge(
        &mut out,
        "tether_raft_last_log_index",
        "Last log index.",
        m.last_log_index.unwrap_or(0),
    );
    gauge(
        &mut out,
        "tether_raft_applied_index",
        "Last applied log index.",
        m.last_applied.map_or(0, |l| l.index),
    );
    gauge(
        &mut out,
        "tether_raft_snapshot_index",
        "Last snapshot's log index.",
        m.snapshot.map_or(0, |l| l.index),
    );
    {
        let applied = ctx.state.read();
        let held = applied
            .state
            .locks
            .values()
            .filter(|l| l.holder.is_some())
            .count() as u64;
        let waiting = applied
            .state
            .locks
            .values()
            .map(|l| l.waiters.len() as u64)
            .sum();
        gauge(&mut out, "tether_locks_held", "Locks with a holder.", held);
        gauge(
            &mut out,
            "tether_lock_waiters",
            "Queued acquires over all locks.",
            waiting,
        );
        gauge(
            &mut out,
            "tether_ttl_leases",
            "Live TTL leases.",
            applied.state.leases.len() as u64,
        );
        gauge(
            &mut out,
            "tether_client_sessions",
            "Clients in the dedupe table.",
            applied.state.sessions.len() as u64,
        );
        let stuck = applied
            .state
            .locks
            .values()
            .filter(|l| l.holder.as_ref().is_some_and(|h| h.token == l.stuck_token))
            .count() as u64;
        gauge(
            &mut out,
            "tether_locks_stuck",
            "Holds past their timeout whose pod has not started (kept, not handed over).",
            stuck,
        );
        gauge(
            &mut out,
            "tether_pins",
            "Pod-to-node pins.",
            applied.state.pins.len() as u64,
        );
        let live = applied
            .state
            .nodes
            .values()
            .filter(|n| n.gone_at_ms.is_none())
            .count() as u64;
        gauge(
            &mut out,
            "tether_nodes",
            "Live nodes in the registry.",
            live,
        );
    }
    ctx.metrics.render(&mut out);
    out
}
