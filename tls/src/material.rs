//! Certificate, key and CA read from files, and read again when they change.
//!
//! Kubernetes updates a mounted Secret by swapping a symlink, so the three
//! files change together but are read one at a time: a read may see a new
//! certificate beside the old key. Such a mix fails the key check and the
//! previous material stays in use until the next look finds a consistent set.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::identity::{PeerIdentity, identity_of};

/// Where the three PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This party's certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates peers must chain to.
    pub ca: PathBuf,
}

impl TlsFiles {
    /// cert-manager's layout: `tls.crt`, `tls.key` and `ca.crt` in `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            ca: dir.join("ca.crt"),
        }
    }
}

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file was read but is not what it should be.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// One consistent set, ready for handshakes.
struct Material {
    /// The file contents this set was built from, to notice changes.
    contents: [Vec<u8>; 3],
    key: Arc<CertifiedKey>,
    identity: PeerIdentity,
    client_verifier: Arc<dyn ClientCertVerifier>,
    server_verifier: Arc<WebPkiServerVerifier>,
}

/// The current certificate, key and CA, shared by every connection.
pub struct TlsMaterial {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Material>>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial")
            .field("files", &self.files)
            .field("identity", &self.identity())
            .finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(path: &Path, message: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(path, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "holds no certificate"));
    }
    Ok(certs)
}

fn build(
    files: &TlsFiles,
    provider: &Arc<CryptoProvider>,
    contents: [Vec<u8>; 3],
) -> Result<Material, TlsError> {
    let [cert_pem, key_pem, ca_pem] = &contents;
    let chain = certificates(&files.cert, cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| invalid(&files.key, format!("not a PEM private key: {e}")))?;
    let key = CertifiedKey::from_der(chain.clone(), key, provider).map_err(|e| {
        invalid(
            &files.key,
            format!("does not fit {}: {e}", files.cert.display()),
        )
    })?;
    let identity = identity_of(&chain[0]).map_err(|e| invalid(&files.cert, e))?;
    let mut roots = RootCertStore::empty();
    for ca in certificates(&files.ca, ca_pem)? {
        roots
            .add(ca)
            .map_err(|e| invalid(&files.ca, format!("not a usable CA certificate: {e}")))?;
    }
    let roots = Arc::new(roots);
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| invalid(&files.ca, e.to_string()))?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| invalid(&files.ca, e.to_string()))?;
    Ok(Material {
        contents,
        key: Arc::new(key),
        identity,
        client_verifier,
        server_verifier,
    })
}

impl TlsMaterial {
    /// Reads and checks the files: the key must fit the certificate, the CA
    /// must parse, and the certificate must name its holder.
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let contents = [read(&files.cert)?, read(&files.key)?, read(&files.ca)?];
        let material = build(&files, &provider, contents)?;
        Ok(Arc::new(Self {
            files,
            provider,
            current: RwLock::new(Arc::new(material)),
        }))
    }

    fn current(&self) -> Arc<Material> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The files this material comes from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Who this party's own certificate says it is.
    pub fn identity(&self) -> PeerIdentity {
        self.current().identity.clone()
    }

    /// Reads the files again; when they changed and form a valid set, new
    /// handshakes use them. `Ok(true)` when something new was taken up; an
    /// error leaves the previous set in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let contents = [
            read(&self.files.cert)?,
            read(&self.files.key)?,
            read(&self.files.ca)?,
        ];
        if self.current().contents == contents {
            return Ok(false);
        }
        let material = build(&self.files, &self.provider, contents)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(material);
        Ok(true)
    }

    /// Looks at the files every `every` and takes up changes, logging what
    /// it did. Ends when the returned handle is aborted.
    pub fn watch(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let material = self.clone();
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                tokio::time::sleep(every).await;
                match material.reload() {
                    Ok(true) => {
                        failing = false;
                        tracing::info!(
                            cert = %material.files.cert.display(),
                            identity = material.identity().name,
                            "TLS certificate reloaded; new connections use it"
                        );
                    }
                    Ok(false) => failing = false,
                    Err(err) => {
                        // Once per failure streak: a half-written rotation
                        // fixes itself at the next look.
                        if !failing {
                            tracing::warn!(%err, "TLS files changed but cannot be used; keeping the previous certificate");
                        }
                        failing = true;
                    }
                }
            }
        })
    }

    /// A server configuration that requires a client certificate from the
    /// CA and presents the current certificate, both as of each handshake.
    pub fn server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_client_cert_verifier(Arc::new(ClientCheck {
                material: self.clone(),
                required: true,
            }))
            .with_cert_resolver(Arc::new(Current(self.clone())));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(config)
    }

    /// The HTTP port's server configuration: HTTP/1.1, and a client
    /// certificate asked for but not required. Probes (the kubelet sends
    /// none) and `/metrics` are open; the JSON API names the certificate's
    /// holder as gRPC does, and refuses a caller without one. A certificate
    /// that is sent must still chain to the CA.
    pub fn http_server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .with_client_cert_verifier(Arc::new(ClientCheck {
                material: self.clone(),
                required: false,
            }))
            .with_cert_resolver(Arc::new(Current(self.clone())));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    /// A client configuration that presents the current certificate and
    /// accepts servers whose certificate chains to the current CA and names
    /// the host dialled.
    pub fn client_config(self: &Arc<Self>) -> Arc<ClientConfig> {
        self.client_config_for(b"h2")
    }

    /// [`Self::client_config`] for the HTTP port (HTTP/1.1).
    pub fn http_client_config(self: &Arc<Self>) -> Arc<ClientConfig> {
        self.client_config_for(b"http/1.1")
    }

    fn client_config_for(self: &Arc<Self>, protocol: &[u8]) -> Arc<ClientConfig> {
        let mut config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default TLS versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Current(self.clone())))
            .with_client_cert_resolver(Arc::new(Current(self.clone())));
        config.alpn_protocols = vec![protocol.to_vec()];
        Arc::new(config)
    }
}

/// Answers rustls with whatever material is current at the time of asking.
#[derive(Debug)]
struct Current(Arc<TlsMaterial>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }
}

impl rustls::client::ResolvesClientCert for Current {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Checks client certificates against the CA current at each handshake;
/// `required` false lets a client without one in (the HTTP port).
#[derive(Debug)]
struct ClientCheck {
    material: Arc<TlsMaterial>,
    required: bool,
}

impl ClientCertVerifier for ClientCheck {
    fn client_auth_mandatory(&self) -> bool {
        self.required
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional; the CA can change under a borrowed slice.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.material
            .current()
            .client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.material
            .current()
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.material
            .current()
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.material
            .current()
            .client_verifier
            .supported_verify_schemes()
    }
}

impl ServerCertVerifier for Current {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().server_verifier.supported_verify_schemes()
    }
}
