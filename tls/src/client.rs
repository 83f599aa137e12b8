//! Dialling a replica over TLS with the current certificate.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::material::TlsMaterial;

/// A channel that connects (when first used, and again after a loss) over
/// TLS: the server's certificate must chain to the current CA and name the
/// host in `endpoint`'s URI (DNS name or IP address); this party presents
/// its current certificate. The URI's scheme is ignored.
pub fn lazy_channel(
    endpoint: Endpoint,
    tls: Arc<TlsMaterial>,
    connect_timeout: Duration,
) -> Channel {
    let connector = tower::service_fn(move |uri: Uri| {
        let tls = tls.clone();
        async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host in URI"))?;
            // An IPv6 literal comes bracketed.
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let name = ServerName::try_from(host.clone()).map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{host:?}: {e}"))
            })?;
            let connect = async {
                let tcp = TcpStream::connect((host.as_str(), port)).await?;
                tcp.set_nodelay(true)?;
                TlsConnector::from(tls.client_config())
                    .connect(name, tcp)
                    .await
            };
            let stream = tokio::time::timeout(connect_timeout, connect)
                .await
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "TLS connection to {host}:{port} not made within {connect_timeout:?}"
                        ),
                    )
                })??;
            Ok::<_, io::Error>(TokioIo::new(stream))
        }
    });
    endpoint.connect_with_connector_lazy(connector)
}
