//! An HTTP/1.1 client for the tests of the JSON API, plain or over TLS
//! (with a client certificate or without one), on hyper: already built for
//! tonic and axum, so no new client stack.

use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use tether_tls::TlsMaterial;
use tokio::io::{AsyncRead, AsyncWrite};

/// How to reach the HTTP port.
#[derive(Clone)]
pub enum Transport {
    /// Plain TCP.
    Plain,
    /// TLS presenting this certificate.
    Tls(Arc<TlsMaterial>),
    /// TLS trusting this CA (PEM) and presenting no certificate.
    TlsWithoutCertificate(String),
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// An answer read whole.
#[derive(Debug)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// Its headers.
    pub headers: hyper::HeaderMap,
    /// The body as JSON (a string when it is not JSON).
    pub body: serde_json::Value,
}

impl Answer {
    /// A header's value as text, or "".
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The error body's code name (`UNAVAILABLE`, ...), or "".
    pub fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
}

/// Sends one request on a new connection, with `token` as a bearer
/// token. `Err` when the connection or the TLS handshake is refused.
pub async fn send(
    addr: SocketAddr,
    transport: &Transport,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&serde_json::Value>,
) -> std::io::Result<hyper::Response<Incoming>> {
    let authorization = token.map(|token| format!("Bearer {token}"));
    let headers: Vec<(&str, &str)> = authorization
        .iter()
        .map(|value| ("authorization", value.as_str()))
        .collect();
    send_with(addr, transport, method, path, &headers, body).await
}

/// [`send`] with any `headers`.
pub async fn send_with(
    addr: SocketAddr,
    transport: &Transport,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&serde_json::Value>,
) -> std::io::Result<hyper::Response<Incoming>> {
    let io: Box<dyn Io> = match transport {
        Transport::Plain => Box::new(tokio::net::TcpStream::connect(addr).await?),
        Transport::Tls(material) => {
            Box::new(tether_tls::testing::connect(addr, material.http_client_config()).await?)
        }
        Transport::TlsWithoutCertificate(ca) => {
            let config = tether_tls::testing::anonymous_client_config(ca, Some(b"http/1.1"))?;
            Box::new(tether_tls::testing::connect(addr, config).await?)
        }
    };
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(std::io::Error::other)?;
    tokio::spawn(connection);
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = match body {
        Some(json) => {
            request = request.header("content-type", "application/json");
            Bytes::from(json.to_string())
        }
        None => Bytes::new(),
    };
    let request = request
        .body(Full::new(body))
        .map_err(std::io::Error::other)?;
    sender
        .send_request(request)
        .await
        .map_err(std::io::Error::other)
}

/// `POST path` with `body`, read whole.
pub async fn post(
    addr: SocketAddr,
    transport: &Transport,
    path: &str,
    token: Option<&str>,
    body: serde_json::Value,
) -> std::io::Result<Answer> {
    let response = send(addr, transport, "POST", path, token, Some(&body)).await?;
    read(response).await
}

/// `GET path`, read whole.
pub async fn get(addr: SocketAddr, transport: &Transport, path: &str) -> std::io::Result<Answer> {
    let response = send(addr, transport, "GET", path, None, None).await?;
    read(response).await
}

/// A response read whole.
pub async fn read(response: hyper::Response<Incoming>) -> std::io::Result<Answer> {
    let (parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
    Ok(Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// The lines of a newline-delimited JSON answer, as they come.
pub struct Lines {
    body: Incoming,
    buffer: Vec<u8>,
}

impl Lines {
    /// The lines of `response`'s body.
    pub fn of(response: hyper::Response<Incoming>) -> Self {
        Self {
            body: response.into_body(),
            buffer: Vec::new(),
        }
    }

    /// The next line as JSON; None once the body ends.
    pub async fn next(&mut self) -> Option<serde_json::Value> {
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                return Some(serde_json::from_slice(&line).expect("each line is JSON"));
            }
            let frame = self.body.frame().await?.expect("the body reads");
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
            }
        }
    }
}
