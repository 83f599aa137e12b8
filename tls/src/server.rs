//! Accepting connections for a tonic server, with or without TLS.
//!
//! Handshakes run side by side (a slow or silent client cannot hold up the
//! others) and are bounded in time; a failed one is logged with the peer's
//! address and dropped. Each connection carries a [`PeerInfo`], which tonic
//! inserts into the extensions of every request on it.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;
use tonic::transport::server::Connected;

use crate::identity::{PeerIdentity, identity_of};
use crate::material::TlsMaterial;

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a request knows of the connection it came on.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The peer's address.
    pub remote_addr: Option<SocketAddr>,
    /// The verified certificate's identity, or why the certificate names
    /// nobody; None over plain TCP or when the client sent no certificate
    /// (allowed on the HTTP port only).
    pub identity: Option<Result<PeerIdentity, String>>,
}

/// An accepted connection.
pub enum Conn {
    /// Plain TCP (the insecure development mode).
    Plain(TcpStream),
    /// TLS with a verified client certificate.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        match self {
            Conn::Plain(tcp) => PeerInfo {
                remote_addr: tcp.peer_addr().ok(),
                identity: None,
            },
            Conn::Tls(tls) => {
                let (tcp, session) = tls.get_ref();
                // None without a certificate: only the HTTP port lets a
                // client in without one (the gRPC handshake requires it).
                let identity = session
                    .peer_certificates()
                    .and_then(|certs| certs.first())
                    .map(|leaf| identity_of(leaf));
                PeerInfo {
                    remote_addr: tcp.peer_addr().ok(),
                    identity,
                }
            }
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

type Handshake = Pin<Box<dyn Future<Output = Option<Conn>> + Send>>;

/// The connections of `listener`, over TLS when `tls` is given. Dropping
/// the stream closes the listener.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<TlsMaterial>>,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    incoming_with(listener, tls.map(|tls| tls.server_config()))
}

/// The connections of the HTTP port's `listener`: as [`incoming`], but
/// with [`TlsMaterial::http_server_config`] (HTTP/1.1, client certificate
/// optional).
pub fn incoming_http(
    listener: TcpListener,
    tls: Option<Arc<TlsMaterial>>,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    incoming_with(listener, tls.map(|tls| tls.http_server_config()))
}

fn incoming_with(
    listener: TcpListener,
    config: Option<Arc<rustls::ServerConfig>>,
) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
    Incoming {
        listener,
        acceptor: config.map(TlsAcceptor::from),
        handshakes: futures::stream::FuturesUnordered::new(),
    }
}

struct Incoming {
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
    handshakes: futures::stream::FuturesUnordered<Handshake>,
}

fn handshake(acceptor: TlsAcceptor, tcp: TcpStream, peer: SocketAddr) -> Handshake {
    Box::pin(async move {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => Some(Conn::Tls(Box::new(tls))),
            Ok(Err(err)) => {
                tracing::warn!(%peer, %err, "TLS handshake refused");
                None
            }
            Err(_) => {
                tracing::warn!(%peer, "TLS handshake not finished within {HANDSHAKE_TIMEOUT:?}");
                None
            }
        }
    })
}

impl Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use futures::StreamExt as _;
        let this = self.get_mut();
        loop {
            match this.listener.poll_accept(cx) {
                Poll::Ready(Ok((tcp, peer))) => {
                    // Small request/response messages: without TCP_NODELAY,
                    // Nagle's algorithm and delayed ACKs add ~40 ms.
                    let _ = tcp.set_nodelay(true);
                    match &this.acceptor {
                        None => return Poll::Ready(Some(Ok(Conn::Plain(tcp)))),
                        Some(acceptor) => {
                            this.handshakes.push(handshake(acceptor.clone(), tcp, peer))
                        }
                    }
                }
                // tonic logs accept errors and goes on accepting.
                Poll::Ready(Err(err)) => return Poll::Ready(Some(Err(err))),
                Poll::Pending => break,
            }
        }
        loop {
            match this.handshakes.poll_next_unpin(cx) {
                Poll::Ready(Some(Some(conn))) => return Poll::Ready(Some(Ok(conn))),
                Poll::Ready(Some(None)) => continue,
                Poll::Ready(None) | Poll::Pending => return Poll::Pending,
            }
        }
    }
}
