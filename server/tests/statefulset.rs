//! `tetherd --statefulset` as a StatefulSet runs it: each "pod" is a real
//! process with hostname `tether-<ordinal>`, its own loopback address
//! (127.0.1.<ordinal>, the same port for all, like pods behind a headless
//! service) and its own data directory (its volume). No cluster command is
//! ever issued by hand: bootstrap, restart with data, restart with a lost
//! volume, scaling 3 -> 5 -> 3 -> 5 (reusing the retained volumes) are all the
//! replicas' own doing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tether_client::proto::{LockKey, PinKey, Pod};
use tether_client::{Client, Options};
use tether_kube_testenv::{Process, unused_port};

const DEADLINE: Duration = Duration::from_secs(90);

/// One StatefulSet pod.
struct PodProcess {
    ordinal: u32,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    http: u16,
    /// `--bootstrap-expect`: the set's size.
    expect: u32,
    /// More environment for the next start (e.g. `TETHER_RESTORE_FROM`).
    extra_env: Vec<(String, String)>,
    /// Killed when dropped, or when the test process dies (`Process`'s
    /// watchdog); its output appended to `log` across restarts.
    child: Option<Process>,
}

impl PodProcess {
    fn ip(&self) -> String {
        format!("127.0.1.{}", self.ordinal)
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.ip(), self.port)
    }

    /// Starts the pod with the environment the StatefulSet gives it.
    fn start(&mut self) {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tetherd"));
        command
            .env("TETHER_STATEFULSET", "true")
            .env("HOSTNAME", format!("tether-{}", self.ordinal))
            .env("TETHER_LISTEN", self.addr())
            .env("TETHER_HTTP_LISTEN", format!("{}:{}", self.ip(), self.http))
            .env("TETHER_DATA_DIR", &self.data)
            .env(
                "TETHER_PEER_TEMPLATE",
                format!("127.0.1.{{ordinal}}:{}", self.port),
            )
            .env("TETHER_PROBE_ORDINALS", "5")
            .env("TETHER_BOOTSTRAP_EXPECT", self.expect.to_string())
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .env("TETHER_ELECTION_TIMEOUT", "500ms")
            .env("TETHER_SCALE_IN_AFTER", "2s")
            .env("RUST_LOG", "info,openraft=warn");
        let name = format!("tether-{}", self.ordinal);
        let child = Process::spawn_appending(&name, command, &self.log).expect("tetherd starts");
        self.child = Some(child);
    }

    /// SIGTERM, as Kubernetes stops a pod, and wait for the exit.
    fn terminate(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.signal("TERM");
            let _ = child.wait();
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    fn node_id(&self) -> u64 {
        std::fs::read_to_string(self.data.join("node-id"))
            .expect("the pod keeps its node id in its volume")
            .trim()
            .parse()
            .unwrap()
    }
}

/// A GET over plain HTTP/1.1; the whole response.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// `count` pods of a set whose `--bootstrap-expect` is `expect`.
fn pods(dir: &Path, count: u32, expect: u32, port: u16, http: u16) -> Vec<PodProcess> {
    (0..count)
        .map(|ordinal| PodProcess {
            ordinal,
            data: dir.join(format!("data-tether-{ordinal}")),
            log: dir.join(format!("tether-{ordinal}.log")),
            port,
            http,
            expect,
            extra_env: Vec::new(),
            child: None,
        })
        .collect()
}

/// Voters (id -> address) and the applied index of every live pod, as the
/// leader and the pods report them; None while there is no leader.
async fn cluster_view(pods: &[PodProcess]) -> Option<(BTreeMap<u64, String>, Vec<u64>)> {
    let client = Client::new(
        pods.iter().map(PodProcess::addr),
        Options {
            call_timeout: Duration::from_secs(1),
            retry_timeout: Duration::from_secs(1),
            ..Options::default()
        },
    )
    .unwrap();
    let leader = client.leader_status().await.ok()?;
    if leader.role != "leader" {
        return None;
    }
    let voters = leader
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| (m.node_id, m.addr.clone()))
        .collect();
    let mut applied = Vec::new();
    for pod in pods.iter().filter(|p| p.child.is_some()) {
        applied.push(client.status_of(&pod.addr()).await.ok()?.applied_index);
    }
    Some((voters, applied))
}

/// Waits until the voters are exactly the live pods' ids and all of them
/// have applied the same index.
async fn until_members(pods: &[PodProcess], what: &str) -> BTreeMap<u64, String> {
    let want: BTreeMap<u64, String> = pods
        .iter()
        .filter(|p| p.child.is_some())
        .map(|p| (p.node_id(), p.addr()))
        .collect();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let view = if want.len() == pods.iter().filter(|p| p.child.is_some()).count()
            && pods
                .iter()
                .filter(|p| p.child.is_some())
                .all(|p| p.data.join("node-id").exists())
        {
            cluster_view(pods).await
        } else {
            None
        };
        if let Some((voters, applied)) = &view
            && *voters == want
            && applied.windows(2).all(|w| w[0] == w[1])
        {
            return voters.clone();
        }
        if tokio::time::Instant::now() >= deadline {
            print_log_tails(pods);
            panic!("timed out: {what}; want voters {want:?}, saw {view:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The last lines of every pod's log (without openraft's), for a failure.
fn print_log_tails(pods: &[PodProcess]) {
    for pod in pods {
        let log = std::fs::read_to_string(&pod.log).unwrap_or_default();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| !l.starts_with("  ") && !l.contains("openraft::"))
            .collect();
        eprintln!(
            "--- tether-{} log tail:\n{}",
            pod.ordinal,
            lines[lines.len().saturating_sub(12)..].join("\n")
        );
    }
}

/// How many times `pod`'s log (all its starts) says it initialized a new
/// cluster.
fn initializations(pod: &PodProcess) -> usize {
    std::fs::read_to_string(&pod.log)
        .unwrap_or_default()
        .matches("initializes a new cluster")
        .count()
}

/// The cluster id every live pod reports: one, the same for all, not empty.
async fn one_cluster_id(pods: &[PodProcess]) -> String {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let mut ids = std::collections::BTreeSet::new();
        for pod in pods.iter().filter(|p| p.child.is_some()) {
            ids.insert(status(pod).await.map(|s| s.cluster_id).unwrap_or_default());
        }
        if ids.len() == 1 && !ids.first().unwrap().is_empty() {
            return ids.pop_first().unwrap();
        }
        if tokio::time::Instant::now() >= deadline {
            print_log_tails(pods);
            panic!("the pods report cluster ids {ids:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every live pod wrote its node id (first start).
async fn until_ids(pods: &[PodProcess]) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !pods
        .iter()
        .filter(|p| p.child.is_some())
        .all(|p| p.data.join("node-id").exists())
    {
        if tokio::time::Instant::now() >= deadline {
            print_log_tails(pods);
            panic!("pods never wrote their ids");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statefulset_bootstraps_survives_restarts_and_lost_volumes_and_scales_out_and_in() {
    let dir = tempfile::tempdir().unwrap();
    let (port, http) = (unused_port(), unused_port());
    let mut pods = pods(dir.path(), 5, 3, port, http);

    // podManagementPolicy: Parallel — three pods start at once.
    for pod in pods.iter_mut().take(3) {
        pod.start();
    }
    until_ids(&pods).await;
    let first = until_members(&pods, "three pods form one cluster").await;
    println!("bootstrapped: {first:?}");

    // State to carry through everything below.
    let client = Client::new(
        pods.iter().map(PodProcess::addr),
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap();
    let key = LockKey {
        scope: "gpu-bind".into(),
        name: "node-a".into(),
    };
    let owner = Pod {
        uid: "uid-1".into(),
        namespace: "ml".into(),
        name: "train-0".into(),
    };
    let token = client
        .acquire(&key, &owner, b"gpu0".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap()
        .token();

    // A pod restarted with its volume rejoins as itself.
    let id1 = pods[1].node_id();
    pods[1].kill9();
    pods[1].start();
    let after_restart = until_members(&pods, "tether-1 back with its data").await;
    assert_eq!(
        after_restart, first,
        "same members after a restart with data"
    );
    assert_eq!(pods[1].node_id(), id1);

    // A pod whose volume was lost comes back as a new member; the old one
    // (same address) is removed in the same change.
    let old2 = pods[2].node_id();
    pods[2].kill9();
    std::fs::remove_dir_all(&pods[2].data).unwrap();
    pods[2].start();
    until_ids(&pods).await;
    let replaced = until_members(&pods, "tether-2 replaced after losing its volume").await;
    let new2 = pods[2].node_id();
    assert_ne!(new2, old2, "node ids are never reused");
    assert!(!replaced.contains_key(&old2) && replaced.contains_key(&new2));

    // Scale 3 -> 5.
    pods[3].start();
    pods[4].start();
    until_ids(&pods).await;
    let five = until_members(&pods, "five members after scaling out").await;
    assert_eq!(five.len(), 5);

    // Scale 5 -> 3: the StatefulSet stops the two highest ordinals; the
    // leader notices they stay down and removes them. Their volumes stay.
    pods[4].terminate();
    pods[3].terminate();
    let three = until_members(&pods, "three members after scaling in").await;
    assert_eq!(three.len(), 3);

    // Scale 3 -> 5 again: the old volumes are reused, the pods notice they
    // were removed and join again under their own ids.
    let (id3, id4) = (pods[3].node_id(), pods[4].node_id());
    pods[3].start();
    pods[4].start();
    let again = until_members(&pods, "five members after scaling out again").await;
    assert!(again.contains_key(&id3) && again.contains_key(&id4));

    // Every pod passes the StatefulSet's readiness probe (member, leader
    // known, caught up) and liveness probe.
    for pod in &pods {
        let ready = http_get(&format!("{}:{}", pod.ip(), pod.http), "/ready");
        assert!(
            ready.starts_with("HTTP/1.1 200"),
            "tether-{}: {ready}",
            pod.ordinal
        );
        let live = http_get(&format!("{}:{}", pod.ip(), pod.http), "/live");
        assert!(
            live.starts_with("HTTP/1.1 200"),
            "tether-{}: {live}",
            pod.ordinal
        );
    }

    // The hold taken at the start is still there, same token.
    let holder = client.holder(&key).await.unwrap().expect("still held");
    assert_eq!(
        (holder.token, holder.pod.unwrap().uid),
        (token, "uid-1".to_string())
    );
}

/// What the tests below carry through a disaster: a hold and a pin.
struct Carried {
    key: LockKey,
    token: u64,
    pin: PinKey,
    node: String,
}

fn client_of(pods: &[PodProcess]) -> Client {
    Client::new(
        pods.iter().map(PodProcess::addr),
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap()
}

async fn take_state(client: &Client) -> Carried {
    let key = LockKey {
        scope: "gpu-bind".into(),
        name: "node-a".into(),
    };
    let owner = Pod {
        uid: "uid-1".into(),
        namespace: "ml".into(),
        name: "train-0".into(),
    };
    let token = client
        .acquire(&key, &owner, b"gpu0".to_vec(), Duration::ZERO, 0)
        .await
        .unwrap()
        .token();
    let pin = PinKey {
        set: "slurm/nodeset-a".into(),
        member: "0".into(),
    };
    let assigned = client
        .assign(
            &pin,
            vec!["node-b".into(), "node-c".into()],
            "uid-2",
            Duration::ZERO,
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let node = assigned.pin.expect("a pin").node;
    Carried {
        key,
        token,
        pin,
        node,
    }
}

/// The hold (same token, same holder) and the pin (same node) are there.
async fn assert_state(client: &Client, carried: &Carried) {
    let holder = client
        .holder(&carried.key)
        .await
        .unwrap()
        .expect("still held");
    assert_eq!(
        (holder.token, holder.pod.unwrap().uid),
        (carried.token, "uid-1".to_string())
    );
    let pin = client.get_pin(&carried.pin).await.unwrap().expect("pinned");
    assert_eq!(pin.node, carried.node);
}

/// `pod`'s status, asked directly.
async fn status(pod: &PodProcess) -> Option<tether_client::proto::StatusResponse> {
    let client = Client::new(
        [pod.addr()],
        Options {
            call_timeout: Duration::from_secs(2),
            retry_timeout: Duration::from_secs(2),
            ..Options::default()
        },
    )
    .unwrap();
    client.status_of(&pod.addr()).await.ok()
}

/// For `how_long`, no new cluster appears: none of `empty` (the pods that
/// lost their volumes) logs that it initialized a cluster or leads, and no
/// pod reports another cluster id than `cluster` (the set's own; a new
/// cluster would draw its own). A pod that kept its data may believe it
/// still leads (openraft resumes a committed vote for itself at start-up);
/// it cannot commit anything without a majority.
async fn assert_nobody_initializes(
    pods: &[PodProcess],
    empty: &[u32],
    how_long: Duration,
    cluster: &str,
) {
    let before: Vec<usize> = pods.iter().map(initializations).collect();
    let until = tokio::time::Instant::now() + how_long;
    let mut asked = 0;
    while tokio::time::Instant::now() < until {
        for pod in pods.iter().filter(|p| p.child.is_some()) {
            let Some(status) = status(pod).await else {
                continue;
            };
            asked += 1;
            let wrong = (empty.contains(&pod.ordinal)
                && (status.role == "leader"
                    || initializations(pod) != before[pod.ordinal as usize]))
                || !(status.cluster_id.is_empty() || status.cluster_id == cluster);
            if wrong {
                print_log_tails(pods);
                panic!(
                    "tether-{} started a cluster (role {}, cluster id {:?})",
                    pod.ordinal, status.role, status.cluster_id
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(asked > 0, "no pod ever answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_set_started_in_every_order_with_delays_forms_one_cluster() {
    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for order in orders {
        let dir = tempfile::tempdir().unwrap();
        let (port, http) = (unused_port(), unused_port());
        let mut pods = pods(dir.path(), 3, 3, port, http);
        for (position, ordinal) in order.into_iter().enumerate() {
            // The scenario's delays (not a wait on a condition): longer than
            // the three rounds after which ordinal 0 once started alone.
            match position {
                0 => {}
                1 => tokio::time::sleep(Duration::from_secs(4)).await,
                _ => tokio::time::sleep(Duration::from_millis(700)).await,
            }
            pods[ordinal].start();
        }
        until_ids(&pods).await;
        let members = until_members(&pods, &format!("order {order:?}: one cluster")).await;
        assert_eq!(members.len(), 3, "order {order:?}");
        let starts: Vec<usize> = pods.iter().map(initializations).collect();
        assert_eq!(
            starts,
            [1, 0, 0],
            "order {order:?}: ordinal 0 initializes, once, and nobody else"
        );
        let cluster = one_cluster_id(&pods).await;
        println!("order {order:?}: one cluster {cluster} of {members:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_set_restart_with_ordinal_0s_volume_lost_and_slow_peers_keeps_one_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let (port, http) = (unused_port(), unused_port());
    let mut pods = pods(dir.path(), 3, 3, port, http);
    for pod in pods.iter_mut() {
        pod.start();
    }
    until_ids(&pods).await;
    let first = until_members(&pods, "three pods form one cluster").await;
    let carried = take_state(&client_of(&pods)).await;
    let cluster = one_cluster_id(&pods).await;

    // The whole set stops; ordinal 0 comes back first, on a new empty
    // volume; its peers take 60 s (volumes attaching on other nodes).
    let old0 = pods[0].node_id();
    for pod in pods.iter_mut() {
        pod.terminate();
    }
    std::fs::remove_dir_all(&pods[0].data).unwrap();
    pods[0].start();
    assert_nobody_initializes(&pods, &[0], Duration::from_secs(60), &cluster).await;
    let alone = status(&pods[0]).await.expect("tether-0 answers");
    assert!(
        !alone.has_raft_state && alone.cluster_id.is_empty(),
        "{alone:?}"
    );
    let log0 = std::fs::read_to_string(&pods[0].log).unwrap();
    assert!(
        log0.contains("do not answer: a new cluster starts only"),
        "tether-0 says why it waits"
    );

    pods[1].start();
    pods[2].start();
    until_ids(&pods).await;
    let after = until_members(&pods, "tether-0 joins the old cluster as a new member").await;
    let new0 = pods[0].node_id();
    assert_ne!(new0, old0);
    assert!(after.contains_key(&new0) && !after.contains_key(&old0));
    for id in [pods[1].node_id(), pods[2].node_id()] {
        assert!(first.contains_key(&id) && after.contains_key(&id));
    }
    assert_state(&client_of(&pods), &carried).await;
    assert_eq!(
        initializations(&pods[0]),
        1,
        "only the first start initialized a cluster"
    );
    assert_eq!(
        one_cluster_id(&pods).await,
        cluster,
        "the new member took the cluster's id"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lost_volumes_start_nothing_and_the_ops_guides_restore_brings_the_set_back() {
    let dir = tempfile::tempdir().unwrap();
    let (port, http) = (unused_port(), unused_port());
    let mut pods = pods(dir.path(), 3, 3, port, http);
    for pod in pods.iter_mut() {
        pod.start();
    }
    until_ids(&pods).await;
    until_members(&pods, "three pods form one cluster").await;
    let client = client_of(&pods);
    let carried = take_state(&client).await;
    let lost_cluster = one_cluster_id(&pods).await;
    // The ops guide's backup.
    let (index, backup) = client.export_snapshot().await.unwrap();
    println!("backup at index {index}, {} bytes", backup.len());

    // Two of three volumes lost: ordinal 2's data alone cannot elect a
    // leader, and the empty ordinals must not start a cluster beside it.
    for pod in pods.iter_mut() {
        pod.terminate();
    }
    std::fs::remove_dir_all(&pods[0].data).unwrap();
    std::fs::remove_dir_all(&pods[1].data).unwrap();
    for pod in pods.iter_mut() {
        pod.start();
    }
    assert_nobody_initializes(&pods, &[0, 1], Duration::from_secs(15), &lost_cluster).await;
    // Nothing can be written either: ordinal 2 has no majority.
    let short = Client::new(
        pods.iter().map(PodProcess::addr),
        Options {
            call_timeout: Duration::from_secs(2),
            retry_timeout: Duration::from_secs(4),
            ..Options::default()
        },
    )
    .unwrap();
    let owner = Pod {
        uid: "uid-3".into(),
        namespace: "ml".into(),
        name: "train-1".into(),
    };
    let written = short
        .acquire(&carried.key, &owner, vec![], Duration::ZERO, 0)
        .await;
    assert!(written.is_err(), "a write went through: {written:?}");
    // tether-0 waits for ordinal 2's cluster: seeing its data, or, when
    // ordinal 2 was the last leader and resumed its leadership at start-up,
    // by asking it to be added (which it cannot commit).
    let log0 = std::fs::read_to_string(&pods[0].log).unwrap();
    assert!(
        log0.contains("ordinal 2 has data of an existing cluster")
            || log0.contains(&format!(
                "joining as a learner leader=\"{}\"",
                pods[2].addr()
            )),
        "tether-0 says why it waits"
    );

    // The ops guide's restore: scale to 1; tether-0 gets an empty volume
    // with the backup in it and starts once with TETHER_RESTORE_FROM.
    for pod in pods.iter_mut() {
        pod.terminate();
    }
    std::fs::remove_dir_all(&pods[0].data).unwrap();
    std::fs::create_dir_all(&pods[0].data).unwrap();
    let file = pods[0].data.join("tether.snap");
    std::fs::write(&file, &backup).unwrap();
    pods[0].extra_env = vec![("TETHER_RESTORE_FROM".into(), file.display().to_string())];
    pods[0].start();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while status(&pods[0]).await.is_none_or(|s| s.role != "leader") {
        if tokio::time::Instant::now() >= deadline {
            print_log_tails(&pods);
            panic!("the restored tether-0 never led");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Remove the variable (a restart keeps the restored data) and scale
    // out; the guide has the other members' volumes deleted first: they
    // hold the lost cluster's data.
    pods[0].terminate();
    pods[0].extra_env.clear();
    pods[0].start();
    let restored_cluster = one_cluster_id(&pods[..1]).await;
    assert_ne!(
        restored_cluster, lost_cluster,
        "a restored backup is a new cluster"
    );

    // The guide's step 4 and 5 (tether-1 may hold a copy of ordinal 2's
    // log: it was added as a learner by ordinal 2, which could not commit).
    std::fs::remove_dir_all(&pods[1].data).unwrap();
    std::fs::remove_dir_all(&pods[2].data).unwrap();
    pods[1].start();
    pods[2].start();
    until_ids(&pods).await;
    let members = until_members(&pods, "the others join the restored tether-0").await;
    assert_eq!(members.len(), 3);
    assert_state(&client_of(&pods), &carried).await;
    assert_eq!(one_cluster_id(&pods).await, restored_cluster);
}
