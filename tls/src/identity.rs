//! The name a certificate gives its holder.
//!
//! Tether reads a caller's role from its certificate: a URI subject
//! alternative name `tether:<name>` (e.g. `tether:device-plugin:node-a`)
//! when there is one — cert-manager's `uris:` field sets it — otherwise the
//! subject's common name (`commonName:`). The subject is kept for audit
//! records.

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The URI SAN prefix that names a Tether identity.
pub const URI_PREFIX: &str = "tether:";

/// Who is at the other end of a verified TLS connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The name the role is read from.
    pub name: String,
    /// The certificate's subject, e.g. `CN=scheduler, O=gpu-team`.
    pub subject: String,
}

/// Reads the identity of a DER certificate. Errors say why none was found.
pub fn identity_of(der: &[u8]) -> Result<PeerIdentity, String> {
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| format!("the certificate cannot be parsed: {e}"))?;
    let subject = cert.subject().to_string();
    let from_uri = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .and_then(|san| {
            san.value.general_names.iter().find_map(|name| match name {
                GeneralName::URI(uri) => uri.strip_prefix(URI_PREFIX).map(str::to_string),
                _ => None,
            })
        });
    let name = match from_uri {
        Some(name) => name,
        None => cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string)
            .ok_or_else(|| {
                format!(
                    "the certificate ({subject}) has neither a `{URI_PREFIX}` URI SAN nor a \
                     common name to take a role from"
                )
            })?,
    };
    Ok(PeerIdentity { name, subject })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

    fn cert(cn: Option<&str>, uri: Option<&str>) -> Vec<u8> {
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.distinguished_name = DistinguishedName::new();
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        if let Some(uri) = uri {
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_common_name_names_the_holder() {
        let id = identity_of(&cert(Some("device-plugin:node-a"), None)).unwrap();
        assert_eq!(id.name, "device-plugin:node-a");
        assert!(
            id.subject.contains("CN=device-plugin:node-a"),
            "{}",
            id.subject
        );
    }

    #[test]
    fn a_tether_uri_san_wins_over_the_common_name() {
        let id = identity_of(&cert(
            Some("scheduler-pod-7"),
            Some("tether:device-plugin:node-b"),
        ))
        .unwrap();
        assert_eq!(id.name, "device-plugin:node-b");
        let id = identity_of(&cert(Some("bridge"), Some("spiffe://cluster/ns/x"))).unwrap();
        assert_eq!(id.name, "bridge", "other URIs are not names");
    }

    #[test]
    fn a_certificate_without_a_name_is_refused_with_a_reason() {
        let err = identity_of(&cert(None, None)).unwrap_err();
        assert!(err.contains("neither"), "{err}");
        let err = identity_of(b"not a certificate").unwrap_err();
        assert!(err.contains("cannot be parsed"), "{err}");
    }
}
