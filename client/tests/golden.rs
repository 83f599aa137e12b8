//! Golden tests of `lockctl` output: a fixed script of commands against a
//! fresh single-node replica, every output format, compared with
//! `tests/golden/lockctl.txt`. Volatile parts (times, ports, client ids) are
//! normalized. Regenerate after an intended change with
//! `TETHER_UPDATE_GOLDEN=1 cargo test -p tether-client --test golden` and
//! review the diff.

use std::process::Command;

/// The script; `{lease}` is replaced by the lease id the script granted.
const SCRIPT: &[&str] = &[
    "cluster status",
    "-o json cluster status",
    "node report node-1 --state ready --label zone=a",
    "node report node-2 --state ready --label zone=b --uid uid-node-2",
    "node report node-2 --state ready --label zone=b --uid uid-node-2",
    "node list",
    "-o json node list",
    "-o yaml node list",
    "lock acquire gpu-bind/node-1 --pod-uid uid-1 --pod ml/train-0 --payload gpu0",
    "-o json lock acquire gpu-bind/node-1 --pod-uid uid-1 --pod ml/train-0 --payload gpu0",
    "lock acquire gpu-bind/node-1 --pod-uid uid-2 --pod ml/train-1",
    "lock holder gpu-bind/node-1",
    "-o json lock holder gpu-bind/node-1",
    "-o yaml lock holder gpu-bind/node-1",
    "lock get gpu-bind/node-1",
    "-o json lock get gpu-bind/node-1",
    "lock list",
    "-o json lock list --scope gpu-bind",
    "lock release gpu-bind/node-1 --pod-uid uid-1 --token 99",
    "lock release gpu-bind/node-1 --pod-uid uid-2 --token 5",
    "-o json lock release gpu-bind/node-1 --pod-uid uid-1 --token 5 --outcome allocated",
    "lock holder gpu-bind/node-1",
    "lock acquire gpu-bind/node-2 --pod-uid uid-3",
    "lock force-release gpu-bind/node-2 --reason stuck --operator ops",
    "-o json lock force-release gpu-bind/node-2 --reason again --operator ops",
    "lease grant 30s",
    "lease keep-alive {lease} --count 1",
    "-o json lease keep-alive {lease} --count 1",
    "-o json lease revoke {lease}",
    "lease revoke {lease}",
    "lease revoke-pod uid-9",
    "-o json lease revoke-pod uid-9 --reason deleted",
    "lease report-pod uid-1 --state running",
    "pin assign slurm/set-a/0 --candidates node-1,node-2 --pod-uid p0 --label app=db --require-anti app=db@zone",
    "-o json pin assign slurm/set-a/0 --candidates node-2 --pod-uid p0",
    "pin assign slurm/set-a/1 --candidates node-1 --label app=db --require-anti app=db@zone",
    "pin get slurm/set-a/0",
    "-o json pin get slurm/set-a/0",
    "-o yaml pin get slurm/set-a/0",
    "pin list --set slurm/set-a",
    "-o json pin list --node node-1",
    "pin release slurm/set-a/0 --reason scale-in",
    "pin release slurm/set-a/0",
    "node report node-1 --state gone",
    "-o json node list --all",
    "history lock/gpu-bind/node-1",
    "watch --from 1 --prefix node/ --count 3",
    "-o json watch --from 1 --prefix lock/gpu-bind/node-1 --count 2",
    "-o json history node/node-1",
    "cluster snapshot",
    "cluster transfer-leader 1",
    "cluster promote 9",
    "cluster remove 9",
    "lock acquire Bad/Name --pod-uid u",
    "pin get slurm/set-a/9",
];

/// Replaces what changes from run to run.
fn normalize(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let mut line = line.to_string();
        // Client ids carry a random incarnation: replaced first, as its 16
        // hex digits can hold a run of 13 decimal ones (CI's run of
        // 2d763b3 had `client.09c<ms>`).
        if let Some(pos) = line.find("client.") {
            let end = (pos + 7 + 16).min(line.len());
            if line[pos + 7..end].chars().all(|c| c.is_ascii_hexdigit()) {
                line = format!("{}client.<id>{}", &line[..pos], &line[end..]);
            }
        }
        // Wall-clock times (13-digit ms since the epoch).
        let mut result = String::new();
        let mut digits = String::new();
        for c in line.chars().chain(std::iter::once('\0')) {
            if c.is_ascii_digit() {
                digits.push(c);
                continue;
            }
            if digits.len() == 13 {
                result.push_str("<ms>");
            } else {
                result.push_str(&digits);
            }
            digits.clear();
            if c != '\0' {
                result.push(c);
            }
        }
        line = result;
        // Loopback ports.
        let mut from = 0;
        while let Some(found) = line[from..].find("127.0.0.1:") {
            let start = from + found + "127.0.0.1:".len();
            let end = start
                + line[start..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(line.len() - start);
            line = format!("{}<port>{}", &line[..start], &line[end..]);
            from = start;
        }
        // The snapshot's index counts log entries, whose number depends on
        // timing: commands that arrive together share a batch entry, and
        // the leader proposes sweeps when something falls due (a loaded CI
        // run of this script had one entry fewer).
        if let Some(index) = line.strip_prefix("snapshot at log index ")
            && index.chars().all(|c| c.is_ascii_digit())
        {
            line = "snapshot at log index <index>".to_string();
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_output_matches_the_golden_file() {
    let dir = tempfile::tempdir().unwrap();
    let node = tether_server::testing::single_node(dir.path()).await;
    let endpoint = node.addr().to_string();
    // Drawn at random: shown as <cluster-id>.
    let cluster_id = node
        .core()
        .cluster_id
        .get()
        .expect("single_node waits for it");

    let mut transcript = String::new();
    let mut lease = String::new();
    for line in SCRIPT {
        let line = line.replace("{lease}", &lease);
        let args: Vec<String> = line.split_whitespace().map(str::to_string).collect();
        let ep = endpoint.clone();
        let output = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_lockctl"))
                .arg("--endpoints")
                .arg(ep)
                .args(args)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        if line == "lease grant 30s" {
            lease = stdout.trim().to_string();
        }
        transcript.push_str(&format!("$ lockctl {line}\n"));
        transcript.push_str(&normalize(&stdout));
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !stderr.trim().is_empty() {
            transcript.push_str(&normalize(&format!("[stderr] {}", stderr.trim())));
        }
        transcript.push_str(&format!(
            "[exit {}]\n\n",
            output.status.code().unwrap_or(-1)
        ));
    }
    node.stop().await;
    let transcript = transcript.replace(&cluster_id, "<cluster-id>");

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/lockctl.txt");
    if std::env::var("TETHER_UPDATE_GOLDEN").is_ok() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &transcript).unwrap();
    }
    let golden =
        std::fs::read_to_string(&path).expect("golden file (TETHER_UPDATE_GOLDEN=1 creates it)");
    if golden != transcript {
        let first = golden
            .lines()
            .zip(transcript.lines())
            .position(|(a, b)| a != b);
        panic!(
            "lockctl output differs from {} (first differing line {:?}); run with TETHER_UPDATE_GOLDEN=1 to accept.\n--- got ---\n{transcript}",
            path.display(),
            first.map(|i| i + 1)
        );
    }
}

#[test]
fn a_client_id_whose_hex_holds_thirteen_decimal_digits_is_still_a_client_id() {
    let line = "  \"client_id\": \"client.09c1234567890123\",";
    assert_eq!(normalize(line), "  \"client_id\": \"client.<id>\",\n");
}
