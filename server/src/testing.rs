//! Test support: in-process clusters of real replicas (RocksDB in temp dirs,
//! gRPC on loopback port 0) for this crate's tests and other crates' end-to-
//! end tests. Not used by `tetherd`.

use openraft::async_runtime::WatchReceiver as _;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Once;
use std::time::Duration;

use crate::{Config, Node};
use openraft::ServerState;
use tempfile::TempDir;
use tokio::net::TcpListener;

/// Generous deadline for anything a loaded 2-core machine must get done.
pub const DEADLINE: Duration = Duration::from_secs(60);

static TRACING: Once = Once::new();

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    TRACING.call_once(|| {
        if std::env::var("RUST_LOG").is_ok() {
            let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        }
    });
}

/// Replica settings for tests: fast enough to keep tests short, slow enough
/// not to flap under load.
pub fn test_config(id: u64, dir: &std::path::Path) -> Config {
    let mut config = Config::defaults();
    config.node_id = id;
    config.data_dir = dir.to_path_buf();
    config.heartbeat_interval = Duration::from_millis(100);
    config.election_timeout = Duration::from_millis(750);
    config.sweep_interval = Duration::from_millis(50);
    config
}

/// A cluster of in-process replicas.
pub struct Cluster {
    /// Running replicas by id (`None` while stopped).
    pub nodes: BTreeMap<u64, Option<Node>>,
    /// Data directories, kept across restarts.
    pub dirs: BTreeMap<u64, TempDir>,
    /// gRPC addresses, kept across restarts.
    pub addrs: BTreeMap<u64, SocketAddr>,
    /// Adjusts each replica's config before it starts.
    pub tweak: Tweak,
}

/// A config adjustment applied to every replica a [`Cluster`] starts.
pub type Tweak = std::sync::Arc<dyn Fn(&mut Config) + Send + Sync>;

fn no_tweak(_: &mut Config) {}

impl Cluster {
    /// Starts `n` replicas that bootstrap one cluster together.
    pub async fn start(n: u64) -> Cluster {
        Self::start_with(n, no_tweak).await
    }

    /// [`Cluster::start`] with a config adjustment.
    pub async fn start_with(
        n: u64,
        tweak: impl Fn(&mut Config) + Send + Sync + 'static,
    ) -> Cluster {
        init_tracing();
        let tweak: Tweak = std::sync::Arc::new(tweak);
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for id in 1..=n {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            addrs.insert(id, listener.local_addr().unwrap());
            listeners.insert(id, listener);
        }
        let members = addrs
            .iter()
            .map(|(id, a)| format!("{id}={a}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Cluster {
            nodes: BTreeMap::new(),
            dirs: BTreeMap::new(),
            addrs,
            tweak: tweak.clone(),
        };
        for (id, listener) in listeners {
            let dir = tempfile::tempdir().unwrap();
            let mut config = test_config(id, dir.path());
            config.initial_members = Some(members.clone());
            tweak(&mut config);
            let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let node = Node::start_with(config, listener, http)
                .await
                .expect("replica starts");
            cluster.nodes.insert(id, Some(node));
            cluster.dirs.insert(id, dir);
        }
        let leader = cluster.wait_leader().await;
        // The new leader's first (blank) entry is applied once a linearizable
        // read succeeds: tests then start from a settled log.
        cluster
            .node(leader)
            .raft()
            .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
            .await
            .expect("leader serves reads");
        // The first leader records the cluster id in an entry of its own:
        // wait for it too, so that the test's first write comes after it.
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while cluster.node(leader).core().cluster_id.get().is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the cluster never recorded its id"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster
    }

    /// The running replica `id`.
    pub fn node(&self, id: u64) -> &Node {
        self.nodes[&id].as_ref().expect("replica is running")
    }

    /// All gRPC endpoints (running or not), as a client would be configured.
    pub fn endpoints(&self) -> Vec<String> {
        self.addrs.values().map(|a| a.to_string()).collect()
    }

    /// Waits until every running replica agrees on one running leader.
    pub async fn wait_leader(&self) -> u64 {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let running: Vec<&Node> = self.nodes.values().flatten().collect();
            let leaders: Vec<Option<u64>> = running
                .iter()
                .map(|n| n.raft().metrics().borrow_watched().current_leader)
                .collect();
            if let Some(Some(leader)) = leaders.first().copied()
                && leaders.iter().all(|l| *l == Some(leader))
                && self.nodes.get(&leader).is_some_and(|n| {
                    n.as_ref().is_some_and(|n| {
                        n.raft().metrics().borrow_watched().state == ServerState::Leader
                    })
                })
            {
                return leader;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed leader within {DEADLINE:?}: {leaders:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops replica `id` without a leader hand-over.
    pub async fn stop(&mut self, id: u64) {
        let node = self
            .nodes
            .get_mut(&id)
            .and_then(Option::take)
            .expect("replica is running");
        node.stop().await;
    }

    /// Restarts replica `id` on its old address and data directory.
    pub async fn restart(&mut self, id: u64) {
        let mut config = test_config(id, self.dirs[&id].path());
        config.initial_members = Some(
            self.addrs
                .iter()
                .map(|(id, a)| format!("{id}={a}"))
                .collect::<Vec<_>>()
                .join(","),
        );
        (self.tweak)(&mut config);
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let listener = loop {
            match TcpListener::bind(self.addrs[&id]).await {
                Ok(listener) => break listener,
                Err(err) => {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "cannot rebind {}: {err}",
                        self.addrs[&id]
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = Node::start_with(config, listener, http)
            .await
            .expect("replica restarts");
        self.nodes.insert(id, Some(node));
    }

    /// Starts a new, empty replica `id` that waits to be added (it is not the
    /// lowest id of the initial members, so it does not bootstrap).
    pub async fn add_node(&mut self, id: u64) {
        let members = self
            .addrs
            .iter()
            .map(|(id, a)| format!("{id}={a}"))
            .collect::<Vec<_>>()
            .join(",");
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(id, dir.path());
        config.initial_members = Some(members);
        (self.tweak)(&mut config);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addrs.insert(id, listener.local_addr().unwrap());
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = Node::start_with(config, listener, http)
            .await
            .expect("new replica starts");
        self.nodes.insert(id, Some(node));
        self.dirs.insert(id, dir);
    }

    /// Waits until replica `id` has applied at least `index`.
    pub async fn wait_applied(&self, id: u64, index: u64) {
        self.node(id)
            .raft()
            .wait(Some(DEADLINE))
            .applied_index_at_least(Some(index), "catch up")
            .await
            .unwrap_or_else(|e| panic!("replica {id} did not apply {index}: {e}"));
    }

    /// Replica `id`'s last applied index, as its state machine has it
    /// (openraft 0.10 answers a write once it is applied, before its
    /// metrics show the apply).
    pub fn applied(&self, id: u64) -> u64 {
        self.node(id)
            .core()
            .state
            .read()
            .last_applied
            .map_or(0, |l| l.index)
    }

    /// Stops every replica.
    pub async fn shutdown(mut self) {
        for id in self.nodes.keys().copied().collect::<Vec<_>>() {
            if let Some(node) = self.nodes.get_mut(&id).and_then(Option::take) {
                node.stop().await;
            }
        }
    }
}

/// Starts a single-node cluster in `dir` on loopback port 0 and waits until
/// it leads and has applied its first entries (linearizable reads succeed).
pub async fn single_node(dir: &std::path::Path) -> Node {
    single_node_with(dir, |_| {}).await
}

/// [`single_node`] with a config adjustment.
pub async fn single_node_with(dir: &std::path::Path, tweak: impl FnOnce(&mut Config)) -> Node {
    let mut config = test_config(1, dir);
    tweak(&mut config);
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node = Node::start_with(config, grpc, http)
        .await
        .expect("replica starts");
    node.raft()
        .wait(Some(DEADLINE))
        .state(ServerState::Leader, "a single node leads")
        .await
        .expect("single node leads");
    node.raft()
        .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
        .await
        .expect("single node serves reads");
    // The leader's first entry of its own gives the cluster its id: wait
    // for it, so that tests start from the same log position every time.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while node.core().cluster_id.get().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the single node never recorded a cluster id"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    node
}
