//! A minimal HTTP/1.1 server: one request per connection, bodies with a
//! Content-Length. Enough for `/health`, `/metrics` and the scheduler
//! extender protocol (kube-scheduler POSTs JSON and reads JSON back) without
//! a web framework in every binary that embeds the client.
//!
//! While a handler runs, the server watches the connection: a client that
//! closes it (kube-scheduler's `httpTimeout` ran out) is reported through
//! [`HttpRequest::departure`], so a handler can stop waiting and undo what
//! nobody will hear about.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request accepted: a filter call of a scheduler that is not
/// node-cache capable carries every candidate Node object.
const MAX_REQUEST: usize = 64 * 1024 * 1024;

/// A parsed request.
pub struct HttpRequest {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Path, e.g. `/bind`.
    pub path: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Becomes true when the client closes the connection before the
    /// answer.
    gone: tokio::sync::watch::Receiver<bool>,
}

impl HttpRequest {
    /// A request as if read from a connection that stays open (tests,
    /// handlers called directly).
    pub fn new(method: &str, path: &str, body: Vec<u8>) -> Self {
        let (tx, gone) = tokio::sync::watch::channel(false);
        // Never sent to: the receiver keeps its value once the sender is
        // gone, and `Departure::wait` then never resolves.
        drop(tx);
        Self {
            method: method.into(),
            path: path.into(),
            body,
            gone,
        }
    }

    /// Whether, and when, the client closes the connection before the
    /// answer.
    pub fn departure(&self) -> Departure {
        Departure(self.gone.clone())
    }
}

/// Tells a handler that its client closed the connection (it will not read
/// the answer).
#[derive(Clone)]
pub struct Departure(tokio::sync::watch::Receiver<bool>);

impl Departure {
    /// Whether the client has gone.
    pub fn is_gone(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when the client has gone; pending forever while it stays.
    pub async fn wait(&self) {
        let mut gone = self.0.clone();
        if gone.wait_for(|g| *g).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A response: status line text, content type, body.
pub struct HttpResponse {
    /// e.g. `200 OK`.
    pub status: &'static str,
    /// e.g. `application/json`.
    pub content_type: &'static str,
    /// Body.
    pub body: Vec<u8>,
}

/// Serves `handler` until `shutdown` resolves.
pub async fn serve<H, F>(listener: TcpListener, handler: Arc<H>, shutdown: impl Future<Output = ()>)
where
    H: Fn(HttpRequest) -> F + Send + Sync + 'static,
    F: Future<Output = HttpResponse> + Send,
{
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let handler = handler.clone();
                    tokio::spawn(async move {
                        if let Err(err) = handle(stream, handler).await {
                            tracing::debug!(%err, "HTTP connection failed");
                        }
                    });
                }
                Err(err) => tracing::warn!(%err, "HTTP accept failed"),
            },
        }
    }
}

async fn read_request(stream: &mut TcpStream) -> std::io::Result<HttpRequest> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
        if buf.len() > MAX_REQUEST {
            return Err(std::io::Error::other("request head too large"));
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::other(
                "connection closed before the request head ended",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.lines();
    let mut first = lines.next().unwrap_or_default().split_whitespace();
    let method = first.next().unwrap_or_default().to_string();
    let path = first.next().unwrap_or_default().to_string();
    let length = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    if length > MAX_REQUEST {
        return Err(std::io::Error::other("request body too large"));
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::other(
                "connection closed before the body ended",
            ));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(HttpRequest::new(&method, &path, body))
}

async fn handle<H, F>(mut stream: TcpStream, handler: Arc<H>) -> std::io::Result<()>
where
    H: Fn(HttpRequest) -> F,
    F: Future<Output = HttpResponse>,
{
    let mut request = tokio::time::timeout(Duration::from_secs(30), read_request(&mut stream))
        .await
        .map_err(|_| std::io::Error::other("request timed out"))??;
    let (gone_tx, gone_rx) = tokio::sync::watch::channel(false);
    request.gone = gone_rx;
    let work = handler(request);
    tokio::pin!(work);
    let mut probe = [0u8; 512];
    let mut watching = true;
    let response = loop {
        tokio::select! {
            response = &mut work => break response,
            // The request is complete (one per connection), so anything
            // read now is the client closing, or bytes we ignore.
            read = stream.read(&mut probe), if watching => {
                if matches!(read, Ok(0) | Err(_)) {
                    let _ = gone_tx.send(true);
                    watching = false;
                }
            }
        }
    };
    let head = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        response.content_type,
        response.body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&response.body).await?;
    stream.shutdown().await
}
