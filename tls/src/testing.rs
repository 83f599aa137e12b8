//! Certificate authorities and certificates made on the fly, for tests.

use std::path::Path;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use crate::material::TlsFiles;

/// A throwaway certificate authority.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("CA certificate");
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate and key (PEM) for `common_name`, valid for the host
    /// names and IP addresses in `hosts` (as a server) and as a client.
    pub fn issue(&self, common_name: &str, hosts: &[&str]) -> (String, String) {
        let names: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("valid host names");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        (cert.pem(), key.serialize_pem())
    }

    /// Writes a certificate for `common_name` in cert-manager's layout
    /// (`tls.crt`, `tls.key`, `ca.crt`) into `dir`, replacing what is there.
    pub fn write_dir(&self, dir: &Path, common_name: &str, hosts: &[&str]) -> TlsFiles {
        self.write_dir_trusting(dir, common_name, hosts, &self.pem)
    }

    /// [`TestCa::write_dir`] with another `ca.crt` (e.g. a bundle of the old
    /// and the new CA during a CA rotation).
    pub fn write_dir_trusting(
        &self,
        dir: &Path,
        common_name: &str,
        hosts: &[&str],
        trusted_pem: &str,
    ) -> TlsFiles {
        std::fs::create_dir_all(dir).expect("certificate directory");
        let (cert, key) = self.issue(common_name, hosts);
        let files = TlsFiles::in_dir(dir);
        // The key first: a reader that sees the new certificate with the
        // old key refuses the pair and tries again later.
        std::fs::write(&files.key, key).expect("write key");
        std::fs::write(&files.cert, cert).expect("write certificate");
        std::fs::write(&files.ca, trusted_pem).expect("write CA");
        files
    }
}

/// A client configuration trusting `ca_pem` that presents no certificate,
/// offering `protocol` (ALPN, e.g. `http/1.1`) if given.
pub fn anonymous_client_config(
    ca_pem: &str,
    protocol: Option<&[u8]>,
) -> std::io::Result<std::sync::Arc<rustls::ClientConfig>> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(cert.map_err(std::io::Error::other)?)
            .map_err(std::io::Error::other)?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = protocol.map(|p| vec![p.to_vec()]).unwrap_or_default();
    Ok(std::sync::Arc::new(config))
}

/// A TLS connection to `addr` (whose certificate must name its IP) made
/// with `config`.
pub async fn connect(
    addr: std::net::SocketAddr,
    config: std::sync::Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::from(addr.ip());
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// Connects to `addr` over TLS trusting `ca_pem` but presenting no
/// certificate, sends a byte and waits for the answer: `Err` when the
/// server refuses (TLS 1.3 reports a refused client on the first read).
pub async fn connect_without_certificate(
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = connect(addr, anonymous_client_config(ca_pem, None)?).await?;
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\n").await?;
    let mut buf = [0u8; 64];
    match tls.read(&mut buf).await? {
        0 => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "closed by the server",
        )),
        _ => Ok(()),
    }
}

/// The certificate (DER) the server at `addr` presents to `client`.
pub async fn server_certificate(
    addr: std::net::SocketAddr,
    client: &std::sync::Arc<crate::TlsMaterial>,
) -> std::io::Result<Vec<u8>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::from(addr.ip());
    let tls = tokio_rustls::TlsConnector::from(client.client_config())
        .connect(name, tcp)
        .await?;
    let (_, session) = tls.get_ref();
    session
        .peer_certificates()
        .and_then(|certs| certs.first())
        .map(|cert| cert.to_vec())
        .ok_or_else(|| std::io::Error::other("no server certificate"))
}
