//! Real `tetherd` processes on loopback, each with its own temp data dir;
//! all are killed when the cluster is dropped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tether_client::{Client, Options};

/// A cluster of `tetherd` child processes.
pub struct ProcessCluster {
    children: Vec<Child>,
    /// gRPC endpoints, `127.0.0.1:PORT`.
    pub endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

/// A loopback port that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// `tetherd` next to the running executable (same target directory).
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let dir = exe.parent().expect("a directory");
    // Examples and tests live one level deeper than the binaries.
    [
        dir.join(name),
        dir.parent().map(|d| d.join(name)).unwrap_or_default(),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| dir.join(name))
}

impl ProcessCluster {
    /// Starts `n` replicas that bootstrap one cluster; waits for a leader.
    pub async fn start(tetherd: &Path, n: usize) -> anyhow::Result<ProcessCluster> {
        anyhow::ensure!(
            tetherd.exists(),
            "no tetherd at {} (cargo build -p tether-server)",
            tetherd.display()
        );
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, (p, _))| format!("{}=127.0.0.1:{p}", i + 1))
            .collect::<Vec<_>>()
            .join(",");
        let mut children = Vec::new();
        for (i, (port, http)) in ports.iter().enumerate() {
            let child = Command::new(tetherd)
                .arg(format!("--node-id={}", i + 1))
                .arg(format!("--listen=127.0.0.1:{port}"))
                .arg(format!("--http-listen=127.0.0.1:{http}"))
                .arg(format!(
                    "--data-dir={}",
                    dir.path().join(format!("d{}", i + 1)).display()
                ))
                .arg(format!("--initial-members={members}"))
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            children.push(child);
        }
        let endpoints: Vec<String> = ports
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        let cluster = ProcessCluster {
            children,
            endpoints,
            _dir: dir,
        };
        let client = cluster.client();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let mut leader = false;
            for endpoint in &cluster.endpoints {
                if let Ok(status) = client.status_of(endpoint).await {
                    leader |= status.role == "leader";
                }
            }
            if leader {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "no leader within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(cluster)
    }

    /// A client of every replica.
    pub fn client(&self) -> Client {
        let options = Options {
            retry_timeout: Duration::from_secs(60),
            ..Options::default()
        };
        Client::new(self.endpoints.clone(), options).expect("endpoints are valid")
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
