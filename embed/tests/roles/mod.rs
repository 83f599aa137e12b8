//! Tether on mutual TLS with each part holding the role it is deployed
//! with: a throwaway CA, the replicas' certificate, and a client certificate
//! per role (`admin`, `scheduler`, `device-plugin:<node>`).

use std::path::PathBuf;
use std::sync::Arc;

use tether_client::{Client, Options};
use tether_server::testing::{Cluster, DEADLINE};
use tether_tls::TlsMaterial;
use tether_tls::testing::TestCa;

/// A throwaway CA and the certificates it issues, one directory a role.
pub struct Identities {
    ca: TestCa,
    dir: tempfile::TempDir,
}

impl Identities {
    pub fn new() -> Identities {
        Identities {
            ca: TestCa::new("tether-e2e"),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// The replicas' certificate directory (one for all: they all listen
    /// on 127.0.0.1).
    pub fn replicas(&self) -> PathBuf {
        let dir = self.dir.path().join("replica");
        self.ca
            .write_dir(&dir, "replica", &["127.0.0.1", "localhost"]);
        dir
    }

    /// A client certificate naming `role`.
    pub fn of(&self, role: &str) -> Arc<TlsMaterial> {
        let dir = self.dir.path().join(role.replace(':', "-"));
        TlsMaterial::load(self.ca.write_dir(&dir, role, &["localhost"])).unwrap()
    }
}

/// A client of `cluster` with the certificate of `role`.
pub fn client_as(cluster: &Cluster, identities: &Identities, role: &str) -> Client {
    Client::new(
        cluster.endpoints(),
        Options {
            retry_timeout: DEADLINE,
            tls: Some(identities.of(role)),
            ..Options::default()
        },
    )
    .unwrap()
}

/// Three replicas serving mutual TLS with the identities' replica
/// certificate.
// Each suite uses one of the two.
#[allow(dead_code)]
pub async fn cluster_on_tls(identities: &Identities) -> Cluster {
    cluster_on_tls_with(identities, |_| {}).await
}

/// [`cluster_on_tls`] with the replicas' configuration changed by `tweak`.
#[allow(dead_code)]
pub async fn cluster_on_tls_with(
    identities: &Identities,
    tweak: impl Fn(&mut tether_server::config::Config) + Send + Sync + 'static,
) -> Cluster {
    let replicas = identities.replicas();
    Cluster::start_with(3, move |config| {
        config.tls_dir = Some(replicas.clone());
        tweak(config);
    })
    .await
}
