//! The HTTP side of every Tether binary, served one way: tetherd's probes
//! and `/metrics`, the bridge's `/health` and `/metrics`, and the scheduler
//! extender's verbs are each an axum [`Router`] handed to [`serve`].
//!
//! axum (on hyper, both already in the tree through tonic) gives every one
//! of them keep-alive, chunked bodies, 404 for unknown paths, 405 with an
//! `Allow` header for a known path under another method, and a graceful
//! shutdown that answers the requests in flight.
//!
//! - [`departure`] — tells a handler that its client closed the connection
//!   (kube-scheduler's `httpTimeout` ran out), so it can undo what nobody
//!   will hear about.
//! - [`metrics`] — the OpenMetrics answer of `/metrics`, from
//!   `prometheus-client` registries.
//! - [`logging`] — not HTTP, but shared by the same binaries: their one
//!   `tracing` set-up.

pub mod departure;
pub mod logging;
pub mod metrics;

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::net::TcpListener;

pub use departure::Departure;

/// How long a shutdown waits for the requests in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` resolves, then stops
/// accepting, lets the requests in flight finish (for at most
/// [`SHUTDOWN_GRACE`]) and returns.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_with_grace(listener, router, shutdown, SHUTDOWN_GRACE).await;
}

/// [`serve`], waiting at most `grace` for the requests in flight once
/// `shutdown` resolved: a client that never finishes its request (hyper
/// sets no timeout on reading a request head here) cannot hold a stopping
/// process.
pub async fn serve_with_grace(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) {
    serve_connected::<_, std::net::SocketAddr>(listener, router, shutdown, grace).await;
}

/// [`serve_with_grace`] on any axum [`Listener`] (e.g. one that does TLS),
/// each request carrying what `C` learns of its connection as an
/// [`axum::extract::ConnectInfo<C>`] extension.
pub async fn serve_connected<L, C>(
    listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) where
    L: Listener,
    L::Addr: std::fmt::Debug,
    C: for<'a> Connected<IncomingStream<'a, L>> + Clone + Send + Sync + 'static,
{
    let address = listener.local_addr().ok();
    let (stopping_tx, stopping) = tokio::sync::oneshot::channel::<()>();
    let service = router.into_make_service_with_connect_info::<C>();
    let server = axum::serve(listener, service).with_graceful_shutdown(async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    });
    let overdue = async move {
        if stopping.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => {
            if let Err(err) = served {
                tracing::warn!(%err, ?address, "HTTP server failed");
            }
        }
        () = overdue => {
            tracing::warn!(?address, ?grace, "HTTP requests still open after the shutdown grace; closing");
        }
    }
}

/// A plain-text answer with `status`.
pub fn text(status: axum::http::StatusCode, body: impl Into<String>) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        status,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        body.into(),
    )
        .into_response()
}

/// `value` as a JSON answer with `status` (axum's `Json` needs its `json`
/// feature, a crate more for two callers).
pub fn json(
    status: axum::http::StatusCode,
    value: &impl serde::Serialize,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match serde_json::to_vec(value) {
        Ok(body) => (
            status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(err) => text(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("the answer could not be written as JSON: {err}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn started(router: Router) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, router, async {
            let _ = stopped.await;
        }));
        (address, stop)
    }

    /// Sends `requests` on one connection and reads until the server
    /// closes it (the last request asks it to).
    async fn exchange(address: std::net::SocketAddr, requests: &str) -> String {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(requests.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            stream.read_to_string(&mut answer),
        )
        .await
        .expect("the server closes the connection after the last request")
        .unwrap();
        answer
    }

    #[tokio::test]
    async fn json_answers_carry_their_status_and_content_type() {
        let router = Router::new().route(
            "/state",
            get(|| async {
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({"ready": false, "leader": null}),
                )
            }),
        );
        let (address, _stop) = started(router).await;
        let answer = exchange(
            address,
            "GET /state HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(
            answer.contains("content-type: application/json"),
            "{answer}"
        );
        assert!(
            answer.ends_with(r#"{"leader":null,"ready":false}"#),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn keep_alive_404_and_405_come_from_the_router() {
        let router =
            Router::new().route("/live", get(|| async { text(StatusCode::OK, "alive\n") }));
        let (address, _stop) = started(router).await;
        let answer = exchange(
            address,
            "GET /live HTTP/1.1\r\nHost: x\r\n\r\n\
             GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n\
             POST /live HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        let statuses: Vec<&str> = answer
            .lines()
            .filter(|line| line.starts_with("HTTP/1.1"))
            .collect();
        assert_eq!(
            statuses,
            [
                "HTTP/1.1 200 OK",
                "HTTP/1.1 404 Not Found",
                "HTTP/1.1 405 Method Not Allowed"
            ],
            "three answers on one connection: {answer}"
        );
        assert!(
            answer.to_ascii_lowercase().contains("allow: get"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn a_request_that_never_ends_does_not_hold_a_shutdown_past_its_grace() {
        let router =
            Router::new().route("/live", get(|| async { text(StatusCode::OK, "alive\n") }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_with_grace(
            listener,
            router,
            async {
                let _ = stopped.await;
            },
            std::time::Duration::from_millis(200),
        ));
        let mut stream = TcpStream::connect(address).await.unwrap();
        // Half a request head, never finished.
        stream.write_all(b"GET /live HTTP/1.1\r\nHo").await.unwrap();
        stop.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), server)
            .await
            .expect("the server returns once its grace is over")
            .unwrap();
        drop(stream);
    }

    #[tokio::test]
    async fn a_chunked_body_is_read_whole() {
        let router = Router::new().route(
            "/echo",
            axum::routing::post(|body: String| async move { text(StatusCode::OK, body) }),
        );
        let (address, _stop) = started(router).await;
        let answer = exchange(
            address,
            "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
             5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
        .await;
        assert!(answer.ends_with("hello world"), "{answer}");
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_finish() {
        let (entered_tx, entered) = tokio::sync::oneshot::channel::<()>();
        let entered_tx = std::sync::Arc::new(std::sync::Mutex::new(Some(entered_tx)));
        let router = Router::new().route(
            "/slow",
            get(move || {
                if let Some(tx) = entered_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                async {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    text(StatusCode::OK, "done")
                }
            }),
        );
        let (address, stop) = started(router).await;
        let call = tokio::spawn(exchange(
            address,
            "GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ));
        entered.await.unwrap();
        stop.send(()).unwrap();
        let answer = call.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.ends_with("done"), "{answer}");
    }
}
