//! A minimal HTTP/1.1 server: one request per connection, bodies with a
//! Content-Length. Enough for `/health`, `/metrics` and the scheduler
//! extender protocol (kube-scheduler POSTs JSON and reads JSON back) without
//! a web framework in every binary that embeds the client.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request accepted.
const MAX_REQUEST: usize = 1024 * 1024;

/// A parsed request.
pub struct HttpRequest {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Path, e.g. `/bind`.
    pub path: String,
    /// Body bytes.
    pub body: Vec<u8>,
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
    Ok(HttpRequest { method, path, body })
}

async fn handle<H, F>(mut stream: TcpStream, handler: Arc<H>) -> std::io::Result<()>
where
    H: Fn(HttpRequest) -> F,
    F: Future<Output = HttpResponse>,
{
    let request = tokio::time::timeout(Duration::from_secs(30), read_request(&mut stream))
        .await
        .map_err(|_| std::io::Error::other("request timed out"))??;
    let response = handler(request).await;
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
