//! Real `tetherd` processes on loopback: `kill -9` and restart, and the
//! no-argument default.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tether_kube_testenv::{Process, unused_port};

use tether_client::proto::Outcome;
use tether_client::{Client, Options};

const DEADLINE: Duration = Duration::from_secs(60);

/// A `tetherd` child process (killed when dropped, or when the test
/// process dies: `Process`'s watchdog), its output appended to its log
/// across restarts.
struct Replica {
    id: u64,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Process>,
    addr: String,
}

impl Replica {
    fn spawn(&mut self) {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tetherd"));
        command
            .args(&self.args)
            .env("RUST_LOG", "info,openraft=warn");
        let name = format!("tetherd-{}", self.id);
        let child = Process::spawn_appending(&name, command, &self.log).expect("tetherd starts");
        self.child = Some(child);
    }

    /// SIGKILL: no shutdown, no flush.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }
}

fn start_cluster(dir: &Path, n: u64) -> Vec<Replica> {
    let ports: Vec<(u16, u16)> = (0..n).map(|_| (unused_port(), unused_port())).collect();
    let members = ports
        .iter()
        .enumerate()
        .map(|(i, (p, _))| format!("{}=127.0.0.1:{p}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut replicas = Vec::new();
    for (i, (port, http)) in ports.iter().enumerate() {
        let id = i as u64 + 1;
        let args = vec![
            format!("--node-id={id}"),
            format!("--listen=127.0.0.1:{port}"),
            format!("--http-listen=127.0.0.1:{http}"),
            format!("--data-dir={}", dir.join(format!("data-{id}")).display()),
            format!("--initial-members={members}"),
            "--election-timeout=750ms".into(),
            "--heartbeat-interval=100ms".into(),
        ];
        let mut replica = Replica {
            id,
            args,
            log: dir.join(format!("tetherd-{id}.log")),
            child: None,
            addr: format!("127.0.0.1:{port}"),
        };
        replica.spawn();
        replicas.push(replica);
    }
    replicas
}

fn client_of(replicas: &[Replica]) -> Client {
    let options = Options {
        retry_timeout: DEADLINE,
        ..Options::default()
    };
    Client::new(replicas.iter().map(|r| r.addr.clone()), options).unwrap()
}

/// Waits until some replica reports itself leader; returns (id, applied).
async fn wait_leader(client: &Client, replicas: &[Replica]) -> (u64, u64) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        for r in replicas.iter().filter(|r| r.child.is_some()) {
            if let Ok(status) = client.status_of(&r.addr).await
                && status.role == "leader"
            {
                return (status.node_id, status.applied_index);
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_applied(client: &Client, replica: &Replica, index: u64) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Ok(status) = client.status_of(&replica.addr).await
            && status.applied_index >= index
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica {} did not apply {index}",
            replica.id
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pod(uid: &str) -> tether_client::proto::Pod {
    tether_client::proto::Pod {
        uid: uid.into(),
        namespace: "default".into(),
        name: uid.into(),
    }
}

fn lock(name: &str) -> tether_client::proto::LockKey {
    tether_client::proto::LockKey {
        scope: "gpu-bind".into(),
        name: name.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_replicas_restart_from_rocksdb_keep_acknowledged_holds_and_catch_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut replicas = start_cluster(dir.path(), 3);
    let client = client_of(&replicas);
    wait_leader(&client, &replicas).await;

    let mut tokens = Vec::new();
    for i in 0..20 {
        let hold = client
            .acquire(
                &lock(&format!("n{i}")),
                &pod(&format!("u{i}")),
                vec![i],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
        tokens.push(hold.token);
    }

    // kill -9 a follower, write more, restart it: it recovers from its
    // RocksDB and catches up.
    let (leader, _) = wait_leader(&client, &replicas).await;
    let follower = replicas.iter().position(|r| r.id != leader).unwrap();
    replicas[follower].kill9();
    for i in 20..30 {
        let hold = client
            .acquire(
                &lock(&format!("n{i}")),
                &pod(&format!("u{i}")),
                vec![i],
                Duration::ZERO,
                0,
            )
            .await
            .unwrap();
        tokens.push(hold.token);
    }
    replicas[follower].spawn();
    let (_, applied) = wait_leader(&client, &replicas).await;
    wait_applied(&client, &replicas[follower], applied).await;

    // kill -9 the leader: every acknowledged hold survives with its token.
    let (leader, _) = wait_leader(&client, &replicas).await;
    let leader_pos = replicas.iter().position(|r| r.id == leader).unwrap();
    replicas[leader_pos].kill9();
    let (new_leader, _) = wait_leader(&client, &replicas).await;
    assert_ne!(new_leader, leader);
    for (i, token) in tokens.iter().enumerate() {
        let hold = client
            .holder(&lock(&format!("n{i}")))
            .await
            .unwrap()
            .expect("acknowledged hold survived");
        assert_eq!(hold.token, *token);
        assert_eq!(hold.payload, vec![i as u8]);
    }
    // Tokens keep increasing after the failover.
    client
        .release(&lock("n0"), "u0", tokens[0], Outcome::Allocated)
        .await
        .unwrap();
    let again = client
        .acquire(&lock("n0"), &pod("later"), vec![], Duration::ZERO, 0)
        .await
        .unwrap();
    assert!(again.token > *tokens.iter().max().unwrap());

    replicas[leader_pos].spawn();
    let (_, applied) = wait_leader(&client, &replicas).await;
    wait_applied(&client, &replicas[leader_pos], applied).await;

    // SIGTERM the leader: it hands leadership over, then exits cleanly.
    let (leader, _) = wait_leader(&client, &replicas).await;
    let pos = replicas.iter().position(|r| r.id == leader).unwrap();
    let mut child = replicas[pos].child.take().unwrap();
    child.signal("TERM");
    let exit = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(exit.success(), "tetherd exit status on SIGTERM: {exit:?}");
    let log = std::fs::read_to_string(&replicas[pos].log).unwrap();
    assert!(
        log.contains("leadership handed over before shutdown"),
        "no hand-over in the log:\n{log}"
    );
    let (new_leader, _) = wait_leader(&client, &replicas).await;
    assert_ne!(new_leader, leader);
    assert!(client.holder(&lock("n1")).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tetherd_without_arguments_serves_a_single_node_cluster_on_the_default_address() {
    if TcpListener::bind("127.0.0.1:7420").is_err() || TcpListener::bind("127.0.0.1:7421").is_err()
    {
        eprintln!("SKIPPED: 127.0.0.1:7420/7421 are in use by another process on this machine");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("tetherd.log");
    let mut command = Command::new(env!("CARGO_BIN_EXE_tetherd"));
    command.current_dir(dir.path()).env_remove("RUST_LOG");
    let mut child = Process::spawn("tetherd", command, &log_path, None).unwrap();
    let client = Client::new(
        ["127.0.0.1:7420"],
        Options {
            retry_timeout: DEADLINE,
            ..Options::default()
        },
    )
    .unwrap();
    let hold = client
        .acquire(
            &lock("node-1"),
            &pod("u1"),
            b"plan".to_vec(),
            Duration::ZERO,
            0,
        )
        .await
        .unwrap();
    assert_eq!(
        client.holder(&lock("node-1")).await.unwrap().unwrap().token,
        hold.token
    );
    assert!(
        dir.path().join("tether-data").is_dir(),
        "data goes to ./tether-data"
    );

    // SIGTERM: clean shutdown with exit code 0.
    child.signal("TERM");
    let deadline = std::time::Instant::now() + DEADLINE;
    let exit = loop {
        if let Some(exit) = child.exited() {
            break exit;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tetherd did not exit on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(child);
    let text = std::fs::read_to_string(&log_path).unwrap();
    let first_lines: String = text.lines().take(4).collect::<Vec<_>>().join("\n");
    assert!(first_lines.contains("127.0.0.1:7420"), "{first_lines}");
    assert!(first_lines.contains("./tether-data"), "{first_lines}");
    assert!(first_lines.contains("INSECURE"), "{first_lines}");
    assert!(first_lines.contains("single-node"), "{first_lines}");
    assert!(exit.success(), "exit status {exit:?}; log:\n{text}");
}
