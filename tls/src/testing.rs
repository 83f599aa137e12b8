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
        std::fs::create_dir_all(dir).expect("certificate directory");
        let (cert, key) = self.issue(common_name, hosts);
        let files = TlsFiles::in_dir(dir);
        // The key first: a reader that sees the new certificate with the
        // old key refuses the pair and tries again later.
        std::fs::write(&files.key, key).expect("write key");
        std::fs::write(&files.cert, cert).expect("write certificate");
        std::fs::write(&files.ca, &self.pem).expect("write CA");
        files
    }
}
