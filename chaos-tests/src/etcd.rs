//! The comparison peer: a 3-member etcd (Debian's `etcd-server`) on loopback,
//! and the same lock workloads through etcd's v3lock API with a lease, the way
//! its concurrency package uses it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

use crate::cluster::free_port;
use crate::workload::Run;

/// etcd's generated API subset.
pub mod pb {
    /// `etcdserverpb`.
    pub mod etcdserverpb {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("etcdserverpb");
    }
    /// `v3lockpb`.
    pub mod v3lockpb {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("v3lockpb");
    }
}

use pb::etcdserverpb::kv_client::KvClient;
use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::{LeaseGrantRequest, RangeRequest};
use pb::v3lockpb::lock_client::LockClient;
use pb::v3lockpb::{LockRequest, UnlockRequest};

/// A 3-member (or n-member) etcd of child processes, killed on drop.
pub struct EtcdCluster {
    children: Vec<Child>,
    /// Client URLs.
    pub endpoints: Vec<String>,
    _dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `n` members with fsync on (etcd's default) and waits until a
    /// lock can be taken.
    pub async fn start(etcd: &Path, n: usize) -> anyhow::Result<EtcdCluster> {
        anyhow::ensure!(
            etcd.exists(),
            "no etcd at {} (apt-get install etcd-server)",
            etcd.display()
        );
        let dir = tempfile::tempdir()?;
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("e{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut children = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            children.push(
                Command::new(etcd)
                    .args(["--name", &format!("e{i}")])
                    .arg(format!(
                        "--data-dir={}",
                        dir.path().join(format!("e{i}")).display()
                    ))
                    .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
                    .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
                    .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                    .arg(format!(
                        "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                    ))
                    .arg(format!("--initial-cluster={initial}"))
                    .arg("--initial-cluster-state=new")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()?,
            );
        }
        let endpoints: Vec<String> = ports
            .iter()
            .map(|(c, _)| format!("http://127.0.0.1:{c}"))
            .collect();
        let cluster = EtcdCluster {
            children,
            endpoints,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(channel) = cluster.channel().await
                && let Ok(lease) = grant(&channel).await
                && let Ok(key) = lock(&channel, b"warm", lease).await
                && unlock(&channel, key).await.is_ok()
            {
                return Ok(cluster);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "etcd did not serve locks within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The members' process ids, in member order (`e0` first).
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// A channel to the first member.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Endpoint::from_shared(self.endpoints[0].clone())?
            .tcp_nodelay(true)
            .connect()
            .await?)
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn grant(channel: &Channel) -> Result<i64, tonic::Status> {
    let reply = LeaseClient::new(channel.clone())
        .lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
        .await?;
    Ok(reply.into_inner().id)
}

async fn lock(channel: &Channel, name: &[u8], lease: i64) -> Result<Vec<u8>, tonic::Status> {
    let reply = LockClient::new(channel.clone())
        .lock(LockRequest {
            name: name.to_vec(),
            lease,
        })
        .await?;
    Ok(reply.into_inner().key)
}

async fn unlock(channel: &Channel, key: Vec<u8>) -> Result<(), tonic::Status> {
    LockClient::new(channel.clone())
        .unlock(UnlockRequest { key })
        .await?;
    Ok(())
}

/// `clients` workers reading one key in a loop for `duration`, each read
/// linearizable (etcd's default: the member confirms with the leader's
/// ReadIndex before answering). A completed read counts as a pair.
pub async fn reads(channel: &Channel, clients: usize, duration: Duration, tag: &str) -> Run {
    let started = Instant::now();
    let deadline = started + duration;
    let key = format!("{tag}-r").into_bytes();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (channel, key) = (channel.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut run = Run::default();
            let mut kv = KvClient::new(channel);
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let request = RangeRequest {
                    key: key.clone(),
                    serializable: false,
                };
                run.record(t0, kv.range(request).await);
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

/// `clients` workers on their own locks (each with its own lease).
pub async fn uncontended(channel: &Channel, clients: usize, duration: Duration, tag: &str) -> Run {
    run(channel, clients, duration, |i| format!("{tag}-u{i}"), false).await
}

/// `clients` workers on one lock.
pub async fn contended(channel: &Channel, clients: usize, duration: Duration, tag: &str) -> Run {
    run(channel, clients, duration, |_| format!("{tag}-c"), true).await
}

async fn run(
    channel: &Channel,
    clients: usize,
    duration: Duration,
    name: impl Fn(usize) -> String,
    measure_handover: bool,
) -> Run {
    let started = Instant::now();
    let deadline = started + duration;
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (channel, name, released_at) =
            (channel.clone(), name(i).into_bytes(), released_at.clone());
        tasks.push(tokio::spawn(async move {
            let mut run = Run::default();
            let Ok(lease) = grant(&channel).await else {
                run.errors += 1;
                return run;
            };
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let Ok(key) = lock(&channel, &name, lease).await else {
                    run.errors += 1;
                    continue;
                };
                if measure_handover {
                    if let Some(at) = released_at.lock().unwrap().take() {
                        run.handover.push(at.elapsed());
                    }
                    *released_at.lock().unwrap() = Some(Instant::now());
                }
                match unlock(&channel, key).await {
                    Ok(()) => {
                        run.pairs += 1;
                        run.pair_latency.push(t0.elapsed());
                    }
                    Err(_) => run.errors += 1,
                }
            }
            run
        }));
    }
    Run::gather(tasks, started).await
}

/// The mixed scenario on etcd: the same arrivals, each taking its node's
/// lock with one of `sessions` leases (a lock is owned by a lease, so
/// binds in flight at once need different ones: the scheduler's sessions),
/// holding it [`crate::workload::MIXED_HOLD`], unlocking.
pub async fn mixed(channel: &Channel, arrivals: &[crate::workload::Arrival], tag: &str) -> Run {
    const SESSIONS: usize = 64;
    let mut leases = Vec::new();
    for _ in 0..SESSIONS {
        if let Ok(lease) = grant(channel).await {
            leases.push(lease);
        }
    }
    let pool = Arc::new(tokio::sync::Mutex::new(leases));
    let free = Arc::new(tokio::sync::Semaphore::new(pool.lock().await.len()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for arrival in arrivals.iter().copied() {
        let (channel, pool, free) = (channel.clone(), pool.clone(), free.clone());
        let name = format!("{tag}-node-{}", arrival.node).into_bytes();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until((started + arrival.at).into()).await;
            let arrived = Instant::now();
            let mut run = Run::default();
            let Ok(_permit) = free.acquire().await else {
                run.errors += 1;
                return run;
            };
            let lease = pool.lock().await.pop().expect("a permit means a lease");
            match lock(&channel, &name, lease).await {
                Ok(key) => {
                    run.pair_latency.push(arrived.elapsed());
                    tokio::time::sleep(crate::workload::MIXED_HOLD).await;
                    match unlock(&channel, key).await {
                        Ok(()) => run.pairs += 1,
                        Err(_) => run.errors += 1,
                    }
                }
                Err(_) => run.errors += 1,
            }
            pool.lock().await.push(lease);
            run
        }));
    }
    Run::gather(tasks, started).await
}
