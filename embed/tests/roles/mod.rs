//! Tether on mutual TLS with each part holding the role it is deployed
//! with: a throwaway CA, the replicas' certificate, and a client certificate
//! per role (`admin`, `scheduler`, `device-plugin:<node>`); the replicas
//! either in the test's process ([`cluster_on_tls`]) or as `tetherd`
//! processes ([`ReplicaProcesses`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tether_client::{Client, Options};
use tether_kube_testenv::{Process, unused_port};
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

/// Where a Tether cluster serves clients.
pub trait Endpoints {
    /// Its replicas' gRPC addresses.
    fn endpoints(&self) -> Vec<String>;
}

impl Endpoints for Cluster {
    fn endpoints(&self) -> Vec<String> {
        Cluster::endpoints(self)
    }
}

/// A client of `cluster` with the certificate of `role`.
pub fn client_as(cluster: &impl Endpoints, identities: &Identities, role: &str) -> Client {
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

/// Three `tetherd` processes (the binary beside the test's, as a workspace
/// build leaves it), each with its own data directory and log, on mutual
/// TLS with the identities' replica certificate when given one. Killed on
/// drop, or by `Process`'s watchdog when the test process dies.
// Only real_node runs the replicas as processes.
#[allow(dead_code)]
pub struct ReplicaProcesses {
    endpoints: Vec<String>,
    replicas: Vec<Process>,
    dir: tempfile::TempDir,
}

#[allow(dead_code)]
impl ReplicaProcesses {
    /// Starts them and waits for a leader, asking as `admin`.
    pub async fn start(tetherd: &Path, identities: &Identities, tls: bool) -> ReplicaProcesses {
        assert!(
            tetherd.exists(),
            "no {}: the replicas run the workspace's tetherd (cargo build -p tether-server)",
            tetherd.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<(u16, u16)> = (0..3).map(|_| (unused_port(), unused_port())).collect();
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, (grpc, _))| format!("{}=127.0.0.1:{grpc}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let certificates = tls.then(|| identities.replicas());
        let mut replicas = Vec::new();
        for (i, (grpc, http)) in ports.iter().enumerate() {
            let id = i + 1;
            let mut command = Command::new(tetherd);
            command
                .arg(format!("--node-id={id}"))
                .arg(format!("--listen=127.0.0.1:{grpc}"))
                .arg(format!("--http-listen=127.0.0.1:{http}"))
                .arg(format!(
                    "--data-dir={}",
                    dir.path().join(format!("data-{id}")).display()
                ))
                .arg(format!("--initial-members={members}"))
                .env("RUST_LOG", "warn");
            if let Some(certificates) = &certificates {
                command.arg(format!("--tls-dir={}", certificates.display()));
            }
            let log = dir.path().join(format!("tetherd-{id}.log"));
            replicas.push(Process::spawn(&format!("tetherd-{id}"), command, &log, None).unwrap());
        }
        let cluster = ReplicaProcesses {
            endpoints: ports
                .iter()
                .map(|(grpc, _)| format!("127.0.0.1:{grpc}"))
                .collect(),
            replicas,
            dir,
        };
        let admin = if tls {
            client_as(&cluster, identities, "admin")
        } else {
            Client::new(cluster.endpoints(), Options::default()).unwrap()
        };
        let deadline = tokio::time::Instant::now() + DEADLINE;
        'waiting: loop {
            for addr in &cluster.endpoints {
                if admin
                    .status_of(addr)
                    .await
                    .is_ok_and(|status| status.role == "leader")
                {
                    break 'waiting;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no leader among the tetherd processes within {DEADLINE:?}:\n{}",
                cluster.log_tails(20)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cluster
    }

    /// The last `lines` lines of each replica's log.
    pub fn log_tails(&self, lines: usize) -> String {
        (1..=self.replicas.len())
            .map(|id| {
                let text =
                    std::fs::read_to_string(self.dir.path().join(format!("tetherd-{id}.log")))
                        .unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                format!(
                    "tetherd-{id}:\n{}",
                    all[all.len().saturating_sub(lines)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Endpoints for ReplicaProcesses {
    fn endpoints(&self) -> Vec<String> {
        self.endpoints.clone()
    }
}
