//! The `lockctl` binary against a real single-node replica: outputs, JSON,
//! and exit codes.

use std::process::{Command, Output};
use std::time::Duration;

use tether_server::Node;

async fn start_replica(dir: &std::path::Path) -> Node {
    tether_server::testing::single_node(dir).await
}

/// Runs lockctl off the async runtime's worker threads.
async fn lockctl(endpoint: &str, args: &[&str]) -> Output {
    let endpoint = endpoint.to_string();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_lockctl"))
            .arg("--endpoints")
            .arg(endpoint)
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_walkthrough_prints_tokens_and_uses_documented_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_replica(dir.path()).await;
    let ep = node.addr().to_string();

    let out = lockctl(
        &ep,
        &[
            "lock",
            "acquire",
            "gpu-bind/node-1",
            "--pod-uid",
            "uid-1",
            "--pod",
            "ml/train-0",
            "--payload",
            "gpu0",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let token: u64 = stdout(&out).parse().expect("acquire prints the token");

    let out = lockctl(
        &ep,
        &["lock", "acquire", "gpu-bind/node-1", "--pod-uid", "uid-2"],
    )
    .await;
    assert_eq!(out.status.code(), Some(3), "held lock: exit 3");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("token {token}")));

    let out = lockctl(&ep, &["-o", "json", "lock", "holder", "gpu-bind/node-1"]).await;
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["holder"]["token"], token);
    assert_eq!(json["holder"]["payload"], "gpu0");
    assert_eq!(json["holder"]["pod"]["namespace"], "ml");

    let out = lockctl(&ep, &["lock", "list"]).await;
    assert!(stdout(&out).contains("gpu-bind/node-1"), "{}", stdout(&out));

    let out = lockctl(
        &ep,
        &[
            "lock",
            "release",
            "gpu-bind/node-1",
            "--pod-uid",
            "uid-1",
            "--token",
            &(token + 1).to_string(),
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(3), "stale token: exit 3");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("current token is {token}")));

    let out = lockctl(
        &ep,
        &[
            "lock",
            "acquire",
            "gpu-bind/node-1",
            "--pod-uid",
            "uid-2",
            "--wait",
            "300ms",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(4), "wait deadline: exit 4");

    let out = lockctl(
        &ep,
        &[
            "lock",
            "release",
            "gpu-bind/node-1",
            "--pod-uid",
            "uid-1",
            "--token",
            &token.to_string(),
            "--outcome",
            "allocated",
        ],
    )
    .await;
    assert!(out.status.success(), "{out:?}");

    let out = lockctl(
        &ep,
        &["lock", "acquire", "gpu-bind/node-1", "--pod-uid", "uid-3"],
    )
    .await;
    assert!(out.status.success());
    let out = lockctl(
        &ep,
        &[
            "lock",
            "force-release",
            "gpu-bind/node-1",
            "--reason",
            "test",
            "--operator",
            "ops",
        ],
    )
    .await;
    assert!(stdout(&out).contains("force-released"), "{}", stdout(&out));
    let out = lockctl(&ep, &["lock", "holder", "gpu-bind/node-1"]).await;
    assert!(stdout(&out).contains("is free"), "{}", stdout(&out));

    let out = lockctl(&ep, &["lock", "acquire", "Bad/Name", "--pod-uid", "u"]).await;
    assert_eq!(out.status.code(), Some(2), "invalid argument: exit 2");

    let out = lockctl(&ep, &["lease", "revoke-pod", "uid-9"]).await;
    assert!(out.status.success(), "{out:?}");

    let out = lockctl(&ep, &["cluster", "status"]).await;
    assert!(stdout(&out).contains("leader: node 1"), "{}", stdout(&out));

    let dead = "127.0.0.1:1";
    let out = lockctl(dead, &["--timeout", "200ms", "cluster", "status"]).await;
    assert_eq!(out.status.code(), Some(5), "nothing reachable: exit 5");
    assert!(String::from_utf8_lossy(&out.stderr).contains("is tetherd running"));

    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_pins_nodes_watch_and_history() {
    let dir = tempfile::tempdir().unwrap();
    let node = start_replica(dir.path()).await;
    let ep = node.addr().to_string();
    for (name, zone) in [("node-1", "a"), ("node-2", "b")] {
        let out = lockctl(
            &ep,
            &[
                "node",
                "report",
                name,
                "--state",
                "ready",
                "--label",
                &format!("zone={zone}"),
            ],
        )
        .await;
        assert!(out.status.success(), "{out:?}");
    }
    let out = lockctl(&ep, &["-o", "json", "node", "list"]).await;
    let nodes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(nodes.as_array().unwrap().len(), 2);

    let assign = |member: &'static str| {
        let ep = ep.clone();
        async move {
            lockctl(
                &ep,
                &[
                    "pin",
                    "assign",
                    &format!("slurm/set-a/{member}"),
                    "--candidates",
                    "node-1,node-2",
                    "--pod-uid",
                    &format!("pod-{member}"),
                    "--label",
                    "app=db",
                    "--require-anti",
                    "app=db@zone",
                ],
            )
            .await
        }
    };
    assert_eq!(stdout(&assign("0").await), "slurm/set-a/0 -> node-1");
    assert_eq!(stdout(&assign("1").await), "slurm/set-a/1 -> node-2");
    let out = assign("2").await;
    assert_eq!(out.status.code(), Some(5), "no candidate fits: exit 5");
    assert!(String::from_utf8_lossy(&out.stderr).contains("required anti-affinity"));

    let out = lockctl(&ep, &["-o", "json", "pin", "get", "slurm/set-a/0"]).await;
    let pin: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(pin["node"], "node-1");
    let out = lockctl(&ep, &["lease", "report-pod", "pod-0", "--state", "running"]).await;
    assert!(out.status.success(), "{out:?}");
    let out = lockctl(&ep, &["node", "report", "node-1", "--state", "gone"]).await;
    assert!(stdout(&out).contains("1 pins"), "{}", stdout(&out));
    let out = lockctl(&ep, &["pin", "get", "slurm/set-a/0"]).await;
    assert_eq!(out.status.code(), Some(3), "gone with its node: exit 3");
    let out = lockctl(&ep, &["pin", "list", "--set", "slurm/set-a"]).await;
    assert!(
        stdout(&out).contains("slurm/set-a/1") && !stdout(&out).contains("slurm/set-a/0 "),
        "{}",
        stdout(&out)
    );

    let out = lockctl(&ep, &["history", "node/node-1"]).await;
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    assert!(
        lines.iter().any(|l| l.contains("NodeJoined node/node-1")),
        "{lines:?}"
    );
    assert!(
        lines.last().unwrap().contains("NodeGone node/node-1"),
        "{lines:?}"
    );

    // `watch` is a live tail: read its first lines, then stop it.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lockctl"))
        .args([
            "--endpoints",
            &ep,
            "watch",
            "--from",
            "1",
            "--prefix",
            "pin/",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout_pipe = child.stdout.take().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout_pipe)
            .lines()
            .next()
            .unwrap()
            .unwrap()
    });
    let first = tokio::time::timeout(Duration::from_secs(60), first)
        .await
        .unwrap()
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        first.contains("PinAssigned pin/slurm/set-a/0 node=node-1"),
        "{first}"
    );
    node.stop().await;
}

/// A backup `lockctl cluster export-snapshot` reported written survives a
/// power cut right after it (LazyFS: every write not fsynced is lost). It
/// once did not: the file was renamed into place unsynced, and a cut left
/// an empty file under the backup's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_backup_survives_a_power_cut() {
    use tether_kube_testenv::lazyfs::{self, LazyFs};
    if !lazyfs::available_or_skip("an_exported_backup_survives_a_power_cut") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = start_replica(&dir.path().join("data")).await;
    let ep = node.addr().to_string();
    let out = lockctl(
        &ep,
        &["lock", "acquire", "gpu-bind/node-1", "--pod-uid", "u1"],
    )
    .await;
    assert!(out.status.success());
    let disk = LazyFs::mount(
        dir.path(),
        "backups",
        &dir.path().join("backing"),
        &dir.path().join("backups"),
    )
    .unwrap();
    let backup = disk.mount_point().join("tether.snap");
    let mut command = disk.command(std::path::Path::new(env!("CARGO_BIN_EXE_lockctl")));
    command
        .arg("--endpoints")
        .arg(&ep)
        .args(["-o", "json", "cluster", "export-snapshot"])
        .arg(&backup);
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let reported: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    disk.clear_cache().unwrap();
    let kept = std::fs::read(disk.path().join("tether.snap")).unwrap();
    assert_eq!(
        kept.len() as u64,
        reported["bytes"].as_u64().unwrap(),
        "the backup after a power cut"
    );
    assert!(!kept.is_empty());
    node.shutdown().await;
}
