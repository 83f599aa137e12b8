//! `lockctl`: operate a Tether cluster from the shell.
//!
//! Exit codes: 0 success; 1 other error; 2 invalid arguments; 3 refused by
//! the lock rules (held, not the holder, stale token, unknown lease, no such
//! pin, wait aborted); 4 a wait's deadline passed; 5 no replica could serve
//! (no leader, unreachable; for a write the outcome is then unknown), no
//! candidate node fits a pin, or a quota was reached; 6 a watch revision
//! was compacted; 7 permission denied or not authenticated; 8 a replica of
//! another cluster than the one first seen answered (nothing was done).

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tether_client::proto::{self as pb, Outcome};
use tether_client::selector::{parse_label, parse_pin_key, parse_term, parse_weighted_term};
use tether_client::{AcquireProgress, Client, Error, Options, WatchUpdate, parse_lock_key};

#[derive(Parser)]
#[command(name = "lockctl", version, about = "Operate a Tether lock cluster", after_help = EXIT_CODES)]
struct Cli {
    /// Replicas to talk to, comma-separated host:port (any replica; the
    /// leader is found and followed).
    #[arg(
        long,
        env = "TETHER_ENDPOINTS",
        default_value = "127.0.0.1:7420",
        global = true,
        value_delimiter = ','
    )]
    endpoints: Vec<String>,

    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Table, global = true)]
    output: Format,

    /// Deadline of each attempt of a call.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, global = true)]
    timeout: Duration,

    /// How long to keep retrying (other replicas, a new leader) before giving up.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    retry_for: Duration,

    #[command(flatten)]
    security: tether_client::SecurityArgs,

    #[command(subcommand)]
    command: Command,
}

const EXIT_CODES: &str = "Exit codes: 0 ok, 1 other error, 2 invalid arguments, 3 refused by the lock \
rules (held, not the holder, stale token, unknown lease, no such pin), 4 wait deadline passed, 5 no \
replica could serve or no candidate fits (for a write the outcome is unknown), 6 watch revision \
compacted, 7 permission denied or not authenticated (see --tls-dir, --token-file), 8 a replica of \
another cluster than the one first seen answered (nothing was done)";

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Format {
    Table,
    Json,
    Yaml,
}

#[derive(Subcommand)]
enum Command {
    /// Cluster membership and health.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Locks: acquire, release, read, force-release.
    #[command(subcommand)]
    Lock(LockCmd),
    /// Pod leases and TTL leases.
    #[command(subcommand)]
    Lease(LeaseCmd),
    /// Pod-to-node pins.
    #[command(subcommand)]
    Pin(PinCmd),
    /// The node registry.
    #[command(subcommand)]
    Node(NodeCmd),
    /// Follow the event stream live.
    Watch {
        /// First revision (log index) to show; default: from now on.
        #[arg(long)]
        from: Option<u64>,
        /// Only these kinds (e.g. NodeJoined, LockGranted); repeatable.
        #[arg(long = "kind")]
        kinds: Vec<String>,
        /// Only keys with this prefix (e.g. node/, lock/gpu-bind/).
        #[arg(long, default_value = "")]
        prefix: String,
        /// Stop after this many events (default: follow until interrupted).
        #[arg(long)]
        count: Option<usize>,
    },
    /// Print a shell completion script: `source <(lockctl completion bash)`.
    Completion {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Retained events of one key: lock/<scope>/<name>, pin/<set>/<member>,
    /// node/<name>.
    History {
        /// The key, e.g. lock/gpu-bind/node-7.
        key: String,
        /// Only events newer than this (e.g. 24h).
        #[arg(long, value_parser = humantime::parse_duration)]
        since: Option<Duration>,
        /// At most this many events.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
}

#[derive(Subcommand)]
enum PinCmd {
    /// Pin SET/MEMBER to a node (or show its existing pin).
    Assign {
        /// SET/MEMBER, e.g. slurm/nodeset-a/3 (the member is the last segment).
        pin: String,
        /// Candidate nodes in order of preference, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        candidates: Vec<String>,
        /// The owning pod's UID.
        #[arg(long, default_value = "")]
        pod_uid: String,
        /// How long the pin outlives its stopped pod (0 = permanent).
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        lifetime: Duration,
        /// Pin label KEY=VALUE; repeatable.
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Required affinity SELECTOR@TOPOLOGY; repeatable.
        #[arg(long = "require")]
        require: Vec<String>,
        /// Required anti-affinity SELECTOR@TOPOLOGY; repeatable.
        #[arg(long = "require-anti")]
        require_anti: Vec<String>,
        /// Preferred affinity SELECTOR@TOPOLOGY:WEIGHT; repeatable.
        #[arg(long = "prefer")]
        prefer: Vec<String>,
        /// Preferred anti-affinity SELECTOR@TOPOLOGY:WEIGHT; repeatable.
        #[arg(long = "prefer-anti")]
        prefer_anti: Vec<String>,
    },
    /// Release a pin.
    Release {
        /// SET/MEMBER.
        pin: String,
        /// Why.
        #[arg(long, default_value = "released with lockctl")]
        reason: String,
    },
    /// Show one pin (linearizable).
    Get {
        /// SET/MEMBER.
        pin: String,
    },
    /// List pins of a set and/or on a node.
    List {
        /// Only this set.
        #[arg(long, default_value = "")]
        set: String,
        /// Only pins on this node.
        #[arg(long, default_value = "")]
        node: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum NodeStateArg {
    Joined,
    Ready,
    NotReady,
    Gone,
}

#[derive(Clone, Copy, ValueEnum)]
enum PodStateArg {
    /// Alive, containers not started.
    Alive,
    Running,
    Terminal,
    Gone,
}

#[derive(Subcommand)]
enum NodeCmd {
    /// Report a node the way the bridge does.
    Report {
        /// Node name.
        name: String,
        /// What happened.
        #[arg(long, value_enum)]
        state: NodeStateArg,
        /// Node label KEY=VALUE (replaces all labels when given); repeatable.
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Node UID. A name reported gone comes back only under another
        /// UID (a new Node object); other reports for it change nothing.
        #[arg(long, default_value = "")]
        uid: String,
        /// Mark cordoned (true) or schedulable (false).
        #[arg(long)]
        unschedulable: Option<bool>,
    },
    /// The node registry.
    List {
        /// Include tombstones of gone nodes.
        #[arg(long)]
        all: bool,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Every endpoint's view: role, term, indexes, members.
    Status,
    /// Make a learner a voter (the other voters stay).
    Promote {
        /// The learner's node id.
        node_id: u64,
    },
    /// Remove a member (voter or learner) from the cluster.
    Remove {
        /// The node id.
        node_id: u64,
    },
    /// Add a non-voting member that replicates the log.
    AddLearner {
        /// Its node id.
        node_id: u64,
        /// Its address (host:port).
        addr: String,
        /// Return at once instead of waiting for it to catch up.
        #[arg(long)]
        no_wait: bool,
    },
    /// Set the voters to exactly these node ids (promotes learners; members
    /// left out are removed, or kept as learners with --retain).
    ChangeMembership {
        /// The voter ids.
        #[arg(required = true)]
        voters: Vec<u64>,
        /// Keep dropped voters as learners.
        #[arg(long)]
        retain: bool,
    },
    /// Hand leadership to another voter.
    TransferLeader {
        /// The target node id.
        node_id: u64,
    },
    /// Build a snapshot on the leader now.
    Snapshot,
    /// Build a snapshot on the leader and save it to FILE: a backup, to
    /// restore with `tetherd --restore-from FILE` into an empty data directory
    ExportSnapshot {
        /// Where to write the backup (replaced if it exists)
        file: std::path::PathBuf,
    },
}

#[derive(Subcommand)]
enum LockCmd {
    /// Take a lock for a pod (waits in the FIFO queue with --wait); prints
    /// the fencing token.
    Acquire {
        /// SCOPE/NAME, e.g. gpu-bind/node-1.
        lock: String,
        /// The pod's UID (the owner).
        #[arg(long)]
        pod_uid: String,
        /// The pod as NAMESPACE/NAME (labels for people).
        #[arg(long)]
        pod: Option<String>,
        /// Payload stored with the hold.
        #[arg(long, conflicts_with = "payload_file")]
        payload: Option<String>,
        /// Read the payload from a file.
        #[arg(long)]
        payload_file: Option<std::path::PathBuf>,
        /// How long to wait in the queue (0 = fail at once if held).
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
        wait: Duration,
        /// Attach the hold to a TTL lease.
        #[arg(long, default_value_t = 0)]
        lease: u64,
    },
    /// Release a hold (pod UID + token).
    Release {
        /// SCOPE/NAME.
        lock: String,
        /// The holder's pod UID.
        #[arg(long)]
        pod_uid: String,
        /// The holder's fencing token.
        #[arg(long)]
        token: u64,
        /// What happened.
        #[arg(long, value_enum, default_value_t = OutcomeArg::Allocated)]
        outcome: OutcomeArg,
    },
    /// The current holder (linearizable read).
    Holder {
        /// SCOPE/NAME.
        lock: String,
    },
    /// Holder and queue of one lock (linearizable read).
    Get {
        /// SCOPE/NAME.
        lock: String,
    },
    /// Locks with a holder or waiters.
    List {
        /// Only this scope.
        #[arg(long, default_value = "")]
        scope: String,
    },
    /// Release whatever holds a lock (audited).
    ForceRelease {
        /// SCOPE/NAME.
        lock: String,
        /// Why (kept in the audit event).
        #[arg(long)]
        reason: String,
        /// Who (default: $USER).
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum OutcomeArg {
    Allocated,
    Failed,
}

#[derive(Subcommand)]
enum LeaseCmd {
    /// Report a pod's phase the way the bridge does.
    ReportPod {
        /// The pod UID.
        pod_uid: String,
        /// Its phase.
        #[arg(long, value_enum)]
        state: PodStateArg,
    },
    /// Release every hold and queued wait of a pod UID.
    RevokePod {
        /// The pod UID.
        pod_uid: String,
        /// Why.
        #[arg(long, default_value = "revoked with lockctl")]
        reason: String,
    },
    /// Grant a TTL lease; prints its id.
    Grant {
        /// Its TTL, e.g. 30s.
        #[arg(value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
    /// Keep a TTL lease alive until interrupted.
    KeepAlive {
        /// The lease id.
        lease_id: u64,
        /// Stop after this many keepalives (default: until interrupted).
        #[arg(long)]
        count: Option<usize>,
    },
    /// Revoke a TTL lease.
    Revoke {
        /// The lease id.
        lease_id: u64,
    },
}

fn payload_json(payload: &[u8]) -> Value {
    match std::str::from_utf8(payload) {
        Ok(text) => Value::String(text.to_string()),
        Err(_) => Value::String(
            payload
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
        ),
    }
}

fn pod_json(pod: &Option<pb::Pod>) -> Value {
    let pod = pod.clone().unwrap_or_default();
    json!({"uid": pod.uid, "namespace": pod.namespace, "name": pod.name})
}

fn hold_json(hold: &pb::Hold) -> Value {
    json!({
        "pod": pod_json(&hold.pod),
        "token": hold.token,
        "granted_at_ms": hold.granted_at_ms,
        "payload": payload_json(&hold.payload),
        "client_id": hold.client_id,
        "lease_id": hold.lease_id,
    })
}

fn lock_json(lock: &pb::LockState) -> Value {
    let key = lock.key.clone().unwrap_or_default();
    json!({
        "lock": format!("{}/{}", key.scope, key.name),
        "holder": lock.holder.as_ref().map(hold_json),
        "waiters": lock.waiters.iter().map(|w| json!({
            "pod": pod_json(&w.pod), "queued_at_ms": w.queued_at_ms, "deadline_ms": w.deadline_ms,
        })).collect::<Vec<_>>(),
    })
}

fn pod_label(pod: &Option<pb::Pod>) -> String {
    match pod {
        Some(p) if !p.namespace.is_empty() || !p.name.is_empty() => {
            format!("{}/{} ({})", p.namespace, p.name, p.uid)
        }
        Some(p) => p.uid.clone(),
        None => "-".into(),
    }
}

fn parse_pod(uid: &str, pod: &Option<String>) -> Result<pb::Pod, Error> {
    let (namespace, name) = match pod {
        None => (String::new(), String::new()),
        Some(text) => match text.split_once('/') {
            Some((ns, name)) => (ns.to_string(), name.to_string()),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "--pod {text:?} must be NAMESPACE/NAME"
                )));
            }
        },
    };
    Ok(pb::Pod {
        uid: uid.to_string(),
        namespace,
        name,
    })
}

struct Out {
    format: Format,
}

impl Out {
    /// Prints `value` as JSON, or `table` for people.
    fn print(&self, value: Value, table: impl FnOnce() -> String) {
        let text = match self.format {
            Format::Json => serde_json::to_string_pretty(&value).unwrap_or_default(),
            Format::Yaml => to_yaml(&value),
            Format::Table => table(),
        };
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", text.trim_end());
    }
}

/// `value` as a YAML document, by the YAML crate the workspace shares
/// (serde-saphyr, which kube already brings).
fn to_yaml(value: &Value) -> String {
    serde_saphyr::to_string(value).unwrap_or_else(|err| format!("# cannot render as YAML: {err}\n"))
}

/// (voters, learners) as the leader sees them.
async fn membership(client: &Client) -> Result<(Vec<u64>, Vec<u64>), Error> {
    let status = client.leader_status().await?;
    let voters = status
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect();
    let learners = status
        .members
        .iter()
        .filter(|m| !m.voter)
        .map(|m| m.node_id)
        .collect();
    Ok((voters, learners))
}

/// For "no replica could serve": what each endpoint says, so the operator
/// sees at once whether the cluster lacks a quorum or the endpoints are wrong.
async fn explain_unavailable(client: &Client) -> String {
    let mut reachable = 0;
    let mut lines = Vec::new();
    for addr in client.endpoints() {
        match client.status_of(addr).await {
            Ok(s) => {
                reachable += 1;
                let leader = if s.leader_id == 0 {
                    "no leader".to_string()
                } else {
                    format!("leader {}", s.leader_id)
                };
                lines.push(format!(
                    "{addr}: node {} {} term {} ({leader})",
                    s.node_id, s.role, s.term
                ));
            }
            Err(_) => lines.push(format!("{addr}: unreachable")),
        }
    }
    format!(
        "no leader yet — {reachable}/{} endpoints reachable: {}",
        client.endpoints().len(),
        lines.join("; ")
    )
}

async fn cluster_status(client: &Client, out: &Out) -> Result<(), Error> {
    let mut rows = Vec::new();
    let mut reachable = 0;
    let mut members = Vec::new();
    let mut leader = None;
    for addr in client.endpoints() {
        match client.status_of(addr).await {
            Ok(status) => {
                reachable += 1;
                if status.leader_id != 0 {
                    leader = Some((status.leader_id, status.leader_addr.clone()));
                }
                if members.is_empty() {
                    members = status.members.clone();
                }
                rows.push(json!({
                    "endpoint": addr, "node_id": status.node_id, "role": status.role,
                    "leader_id": status.leader_id, "term": status.term,
                    "last_log_index": status.last_log_index, "applied_index": status.applied_index,
                    "snapshot_index": status.snapshot_index, "locks": status.lock_count,
                    "cluster_id": status.cluster_id,
                }));
            }
            Err(err) => rows.push(json!({"endpoint": addr, "error": err.to_string()})),
        }
    }
    if reachable == 0 {
        return Err(Error::Unavailable(format!(
            "no endpoint answered ({}); is tetherd running? (--endpoints / TETHER_ENDPOINTS)",
            client.endpoints().join(",")
        )));
    }
    let members_json: Vec<Value> = members
        .iter()
        .map(|m| json!({"node_id": m.node_id, "addr": m.addr, "voter": m.voter, "matched_index": m.matched_index}))
        .collect();
    let value =
        json!({"endpoints": rows, "members": members_json, "leader": leader.as_ref().map(|l| l.0)});
    out.print(value, || {
        let mut text = String::new();
        text.push_str(&format!("{:<22} {:>4} {:<10} {:>6} {:>6} {:>10} {:>10} {:>6} {:<16}\n", "ENDPOINT", "ID", "ROLE", "LEADER", "TERM", "LAST_LOG", "APPLIED", "LOCKS", "CLUSTER"));
        for row in &rows {
            if let Some(err) = row.get("error") {
                text.push_str(&format!("{:<22} unreachable: {}\n", row["endpoint"].as_str().unwrap_or(""), err.as_str().unwrap_or("")));
            } else {
                text.push_str(&format!(
                    "{:<22} {:>4} {:<10} {:>6} {:>6} {:>10} {:>10} {:>6} {:<16}\n",
                    row["endpoint"].as_str().unwrap_or(""), row["node_id"].to_string(), row["role"].as_str().unwrap_or(""),
                    row["leader_id"].to_string(), row["term"].to_string(), row["last_log_index"].to_string(),
                    row["applied_index"].to_string(), row["locks"].to_string(),
                    row["cluster_id"].as_str().filter(|id| !id.is_empty()).unwrap_or("-")
                ));
            }
        }
        text.push_str("\nMEMBERS\n");
        for m in &members {
            text.push_str(&format!("  node {} at {} ({}), matched index {}\n", m.node_id, m.addr, if m.voter { "voter" } else { "learner" }, m.matched_index));
        }
        match &leader {
            Some((id, addr)) => text.push_str(&format!("\nleader: node {id} at {addr}\n")),
            None => text.push_str(&format!(
                "\nno leader yet — {reachable}/{} endpoints reachable; a majority of voters must be up\n",
                client.endpoints().len()
            )),
        }
        text
    });
    Ok(())
}

async fn run(cli: Cli) -> Result<(), Error> {
    let mut options = Options {
        call_timeout: cli.timeout,
        retry_timeout: cli.retry_for,
        ..Options::default()
    };
    cli.security.apply(&mut options)?;
    let client = Client::new(cli.endpoints.clone(), options)?;
    let out = Out { format: cli.output };
    match cli.command {
        Command::Cluster(ClusterCmd::Status) => cluster_status(&client, &out).await?,
        Command::Cluster(ClusterCmd::AddLearner {
            node_id,
            addr,
            no_wait,
        }) => {
            let index = client.add_learner(node_id, &addr, !no_wait).await?;
            out.print(json!({"node_id": node_id, "log_index": index}), || {
                format!("node {node_id} added as learner (log index {index})")
            });
        }
        Command::Cluster(ClusterCmd::ChangeMembership { voters, retain }) => {
            let index = client.change_membership(voters.clone(), retain).await?;
            out.print(json!({"voters": voters, "log_index": index}), || {
                format!("voters are now {voters:?} (log index {index})")
            });
        }
        Command::Cluster(ClusterCmd::TransferLeader { node_id }) => {
            let leader = client.transfer_leader(node_id).await?;
            out.print(json!({"leader_id": leader}), || {
                format!("leader is now node {leader}")
            });
        }
        Command::Cluster(ClusterCmd::Promote { node_id }) => {
            let (voters, learners) = membership(&client).await?;
            if voters.contains(&node_id) {
                return Err(Error::FailedPrecondition(format!(
                    "node {node_id} is already a voter"
                )));
            }
            if !learners.contains(&node_id) {
                return Err(Error::FailedPrecondition(format!(
                    "node {node_id} is not a learner; add it first with `lockctl cluster add-learner {node_id} ADDR`"
                )));
            }
            let mut new_voters = voters.clone();
            new_voters.push(node_id);
            new_voters.sort();
            let index = client.change_membership(new_voters.clone(), false).await?;
            out.print(json!({"voters": new_voters, "log_index": index}), || {
                format!(
                    "node {node_id} promoted; voters are now {new_voters:?} (log index {index})"
                )
            });
        }
        Command::Cluster(ClusterCmd::Remove { node_id }) => {
            let (voters, learners) = membership(&client).await?;
            let index = if voters.contains(&node_id) {
                let remaining: Vec<u64> =
                    voters.iter().copied().filter(|id| *id != node_id).collect();
                if remaining.is_empty() {
                    return Err(Error::FailedPrecondition(
                        "cannot remove the last voter".into(),
                    ));
                }
                client.change_membership(remaining, false).await?
            } else if learners.contains(&node_id) {
                client.remove_learners(vec![node_id]).await?
            } else {
                return Err(Error::NotFound(format!("node {node_id} is not a member")));
            };
            out.print(json!({"removed": node_id, "log_index": index}), || {
                format!("node {node_id} removed (log index {index}); stop its tetherd and delete its data directory")
            });
        }
        Command::Cluster(ClusterCmd::Snapshot) => {
            let index = client.snapshot().await?;
            out.print(json!({"snapshot_index": index}), || {
                format!("snapshot at log index {index}")
            });
        }
        Command::Cluster(ClusterCmd::ExportSnapshot { file }) => {
            let (index, data) = client.export_snapshot().await?;
            // Written aside, then renamed: a half-written backup never
            // takes the name of a good one.
            let partial = file.with_extension("partial");
            std::fs::write(&partial, &data)
                .and_then(|()| std::fs::rename(&partial, &file))
                .map_err(|e| {
                    tether_client::Error::InvalidArgument(format!(
                        "cannot write {}: {e}",
                        file.display()
                    ))
                })?;
            out.print(
                json!({"snapshot_index": index, "bytes": data.len(), "file": file.display().to_string()}),
                || {
                    format!(
                        "snapshot at log index {index}: {} bytes written to {}",
                        data.len(),
                        file.display()
                    )
                },
            );
        }
        Command::Lock(LockCmd::Acquire {
            lock,
            pod_uid,
            pod,
            payload,
            payload_file,
            wait,
            lease,
        }) => {
            let key = parse_lock_key(&lock)?;
            let pod = parse_pod(&pod_uid, &pod)?;
            let payload = match (payload, payload_file) {
                (Some(text), _) => text.into_bytes(),
                (None, Some(path)) => std::fs::read(&path).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "cannot read --payload-file {}: {e}",
                        path.display()
                    ))
                })?,
                (None, None) => Vec::new(),
            };
            let table = out.format == Format::Table;
            let hold = client
                .acquire_with_progress(&key, &pod, payload, wait, lease, |progress| {
                    if let (AcquireProgress::Queued(position), true) = (progress, table) {
                        eprintln!(
                            "queued for {lock} at position {position}; waiting up to {}",
                            humantime::format_duration(wait)
                        );
                    }
                })
                .await?;
            out.print(hold_json(&hold), || hold.token.to_string());
        }
        Command::Lock(LockCmd::Release {
            lock,
            pod_uid,
            token,
            outcome,
        }) => {
            let key = parse_lock_key(&lock)?;
            let outcome = match outcome {
                OutcomeArg::Allocated => Outcome::Allocated,
                OutcomeArg::Failed => Outcome::Failed,
            };
            let next = client.release(&key, &pod_uid, token, outcome).await?;
            out.print(
                json!({"released": true, "next_holder": next.as_ref().map(hold_json)}),
                || match &next {
                    Some(hold) => format!(
                        "released; granted to {} with token {}",
                        pod_label(&hold.pod),
                        hold.token
                    ),
                    None => "released".to_string(),
                },
            );
        }
        Command::Lock(LockCmd::Holder { lock }) => {
            let key = parse_lock_key(&lock)?;
            let hold = client.holder(&key).await?;
            out.print(
                json!({"lock": lock, "holder": hold.as_ref().map(hold_json)}),
                || match &hold {
                    Some(h) => format!(
                        "{lock} held by {} token {} payload {}",
                        pod_label(&h.pod),
                        h.token,
                        payload_json(&h.payload)
                    ),
                    None => format!("{lock} is free"),
                },
            );
        }
        Command::Lock(LockCmd::Get { lock }) => {
            let key = parse_lock_key(&lock)?;
            let state = client.get(&key).await?;
            out.print(lock_json(&state), || {
                lock_table(std::slice::from_ref(&state))
            });
        }
        Command::Lock(LockCmd::List { scope }) => {
            let locks = client.list(&scope).await?;
            out.print(Value::Array(locks.iter().map(lock_json).collect()), || {
                lock_table(&locks)
            });
        }
        Command::Lock(LockCmd::ForceRelease {
            lock,
            reason,
            operator,
        }) => {
            let key = parse_lock_key(&lock)?;
            let reply = client.force_release(&key, &operator, &reason).await?;
            out.print(
                json!({"released": reply.released.as_ref().map(hold_json), "next_holder": reply.next_holder.as_ref().map(hold_json)}),
                || match (&reply.released, &reply.next_holder) {
                    (None, _) => format!("{lock} was already free"),
                    (Some(h), None) => format!("force-released {lock} from {} (token {})", pod_label(&h.pod), h.token),
                    (Some(h), Some(n)) => format!(
                        "force-released {lock} from {} (token {}); granted to {} with token {}",
                        pod_label(&h.pod), h.token, pod_label(&n.pod), n.token
                    ),
                },
            );
        }
        Command::Lease(LeaseCmd::RevokePod { pod_uid, reason }) => {
            let reply = client.revoke_pod(&pod_uid, &reason).await?;
            let keys = |keys: &[pb::LockKey]| {
                keys.iter()
                    .map(|k| format!("{}/{}", k.scope, k.name))
                    .collect::<Vec<_>>()
            };
            let released = keys(&reply.released);
            let dequeued = keys(&reply.dequeued);
            out.print(json!({"released": released, "dequeued": dequeued, "granted": reply.granted.len()}), || {
                format!("pod {pod_uid}: released {released:?}, left queues {dequeued:?}, {} next waiters granted", reply.granted.len())
            });
        }
        Command::Lease(LeaseCmd::Grant { ttl }) => {
            let id = client.grant_lease(ttl).await?;
            out.print(json!({"lease_id": id}), || id.to_string());
        }
        Command::Lease(LeaseCmd::KeepAlive { lease_id, count }) => {
            for round in 1.. {
                let ttl = client.keep_alive_once(lease_id).await?;
                if ttl == 0 {
                    return Err(Error::NotFound(format!(
                        "lease {lease_id} expired or was revoked"
                    )));
                }
                out.print(json!({"lease_id": lease_id, "ttl_ms": ttl}), || {
                    format!(
                        "lease {lease_id} kept alive (ttl {})",
                        humantime::format_duration(Duration::from_millis(ttl))
                    )
                });
                if count.is_some_and(|n| round >= n) {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ttl / 3)) => {}
                    _ = tokio::signal::ctrl_c() => return Ok(()),
                }
            }
        }
        Command::Lease(LeaseCmd::ReportPod { pod_uid, state }) => {
            let phase = match state {
                PodStateArg::Alive => pb::PodPhase::PodStarting,
                PodStateArg::Running => pb::PodPhase::PodRunning,
                PodStateArg::Terminal => pb::PodPhase::PodTerminal,
                PodStateArg::Gone => pb::PodPhase::PodGone,
            };
            let reply = client.report_pod(&pod_uid, phase).await?;
            out.print(
                json!({"released": reply.released.len(), "dequeued": reply.dequeued.len()}),
                || {
                    format!(
                        "pod {pod_uid} reported; {} holds released, {} waits dropped",
                        reply.released.len(),
                        reply.dequeued.len()
                    )
                },
            );
        }
        Command::Pin(cmd) => pin_command(&client, &out, cmd).await?,
        // Answered in `main` before any connection is made.
        Command::Completion { .. } => {}
        Command::Node(cmd) => node_command(&client, &out, cmd).await?,
        Command::Watch {
            from,
            kinds,
            prefix,
            count,
        } => {
            let start = from.map(|index| pb::Revision { index, sub: 0 });
            let mut watch = client.watch(start, kinds, &prefix).await?;
            let mut shown = 0;
            while count.is_none_or(|n| shown < n) {
                let batch = tokio::select! {
                    batch = watch.next() => batch?,
                    _ = tokio::signal::ctrl_c() => return Ok(()),
                };
                match batch {
                    WatchUpdate::Events(events) => {
                        for event in events.iter().take(count.map_or(usize::MAX, |n| n - shown)) {
                            out.print(event_json(event), || event_line(event));
                            shown += 1;
                        }
                    }
                    WatchUpdate::Relist {
                        resume_at,
                        oldest_retained,
                    } => eprintln!(
                        "lockctl: events before log index {oldest_retained} are no longer retained; \
                         some were missed. Continuing from {}.{} (re-list what you need)",
                        resume_at.index, resume_at.sub
                    ),
                }
            }
        }
        Command::History { key, since, limit } => {
            let since_ms = since.map_or(0, |d| {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                now.saturating_sub(d).as_millis() as u64
            });
            let reply = client.history(&key, since_ms, limit).await?;
            let oldest = reply.oldest_retained.map_or(0, |r| r.index);
            out.print(
                json!({"events": reply.events.iter().map(event_json).collect::<Vec<_>>(), "oldest_retained": oldest}),
                || {
                    let mut text: String = reply.events.iter().map(|e| event_line(e) + "\n").collect();
                    if reply.events.is_empty() {
                        text.push_str(&format!("no events for {key}"));
                    }
                    if oldest > 0 {
                        text.push_str(&format!("(history before log index {oldest} is no longer retained)\n"));
                    }
                    text
                },
            );
        }
        Command::Lease(LeaseCmd::Revoke { lease_id }) => {
            let reply = client.revoke_lease(lease_id).await?;
            out.print(
                json!({"released": reply.released.len(), "dequeued": reply.dequeued.len()}),
                || {
                    format!(
                        "lease {lease_id} revoked: {} holds released, {} waits dropped",
                        reply.released.len(),
                        reply.dequeued.len()
                    )
                },
            );
        }
    }
    Ok(())
}

fn labels_map(labels: &[String]) -> Result<std::collections::HashMap<String, String>, Error> {
    labels.iter().map(|l| parse_label(l)).collect()
}

fn pin_json(pin: &pb::Pin) -> Value {
    let key = pin.key.clone().unwrap_or_default();
    let owner = pb::OwnerState::try_from(pin.owner)
        .map(|o| o.as_str_name())
        .unwrap_or("OWNER_UNKNOWN");
    json!({
        "pin": format!("{}/{}", key.set, key.member), "node": pin.node, "pod_uid": pin.pod_uid,
        "pinned_at_ms": pin.pinned_at_ms, "lifetime_ms": pin.lifetime_ms,
        "last_running_at_ms": pin.last_running_at_ms, "owner": owner, "labels": pin.labels,
    })
}

fn pin_table(pins: &[pb::Pin]) -> String {
    let mut text = format!(
        "{:<36} {:<28} {:<38} {:>10} {}\n",
        "PIN", "NODE", "POD", "LIFETIME", "OWNER"
    );
    for pin in pins {
        let key = pin.key.clone().unwrap_or_default();
        let lifetime = if pin.lifetime_ms == 0 {
            "permanent".to_string()
        } else {
            humantime::format_duration(Duration::from_millis(pin.lifetime_ms)).to_string()
        };
        let owner = pb::OwnerState::try_from(pin.owner)
            .map(|o| o.as_str_name())
            .unwrap_or("OWNER_UNKNOWN");
        text.push_str(&format!(
            "{:<36} {:<28} {:<38} {:>10} {}\n",
            format!("{}/{}", key.set, key.member),
            pin.node,
            if pin.pod_uid.is_empty() {
                "-"
            } else {
                &pin.pod_uid
            },
            lifetime,
            owner.trim_start_matches("OWNER_").to_lowercase()
        ));
    }
    text
}

fn event_json(event: &pb::Event) -> Value {
    let rev = event.revision.unwrap_or_default();
    json!({
        "revision": format!("{}.{}", rev.index, rev.sub), "time_ms": event.time_ms, "kind": event.kind,
        "key": event.key, "pod": event.pod.as_ref().map(|p| pod_json(&Some(p.clone()))), "token": event.token,
        "reason": event.reason, "node": event.node, "attributes": event.attributes,
    })
}

fn event_line(event: &pb::Event) -> String {
    let rev = event.revision.unwrap_or_default();
    let mut line = format!("{}.{} {} {}", rev.index, rev.sub, event.kind, event.key);
    if event.pod.is_some() {
        line.push_str(&format!(" pod={}", pod_label(&event.pod)));
    }
    if event.token > 0 {
        line.push_str(&format!(" token={}", event.token));
    }
    if !event.node.is_empty() && !event.key.starts_with("node/") {
        line.push_str(&format!(" node={}", event.node));
    }
    if !event.reason.is_empty() {
        line.push_str(&format!(" reason=\"{}\"", event.reason));
    }
    let mut attributes: Vec<_> = event.attributes.iter().collect();
    attributes.sort();
    for (k, v) in attributes {
        line.push_str(&format!(" {k}={v}"));
    }
    line
}

async fn pin_command(client: &Client, out: &Out, cmd: PinCmd) -> Result<(), Error> {
    match cmd {
        PinCmd::Assign {
            pin,
            candidates,
            pod_uid,
            lifetime,
            labels,
            require,
            require_anti,
            prefer,
            prefer_anti,
        } => {
            let key = parse_pin_key(&pin)?;
            let affinity = pb::Affinity {
                required: require
                    .iter()
                    .map(|t| parse_term(t))
                    .collect::<Result<_, _>>()?,
                required_anti: require_anti
                    .iter()
                    .map(|t| parse_term(t))
                    .collect::<Result<_, _>>()?,
                preferred: prefer
                    .iter()
                    .map(|t| parse_weighted_term(t))
                    .collect::<Result<_, _>>()?,
                preferred_anti: prefer_anti
                    .iter()
                    .map(|t| parse_weighted_term(t))
                    .collect::<Result<_, _>>()?,
            };
            let reply = client
                .assign(
                    &key,
                    candidates,
                    &pod_uid,
                    lifetime,
                    labels_map(&labels)?,
                    affinity,
                )
                .await?;
            let pinned = reply.pin.unwrap_or_default();
            let mut value = pin_json(&pinned);
            value["created"] = json!(reply.created);
            out.print(value, || {
                format!(
                    "{pin} -> {}{}",
                    pinned.node,
                    if reply.created { "" } else { " (existing pin)" }
                )
            });
        }
        PinCmd::Release { pin, reason } => {
            let key = parse_pin_key(&pin)?;
            let released = client.release_pin(&key, &reason).await?;
            out.print(
                json!({"released": released.as_ref().map(pin_json)}),
                || match &released {
                    Some(p) => format!("released {pin} (was on {})", p.node),
                    None => format!("{pin} was not pinned"),
                },
            );
        }
        PinCmd::Get { pin } => {
            let key = parse_pin_key(&pin)?;
            match client.get_pin(&key).await? {
                Some(p) => out.print(pin_json(&p), || pin_table(std::slice::from_ref(&p))),
                None => return Err(Error::NotFound(format!("{pin} is not pinned"))),
            }
        }
        PinCmd::List { set, node } => {
            let pins = client.list_pins(&set, &node).await?;
            out.print(Value::Array(pins.iter().map(pin_json).collect()), || {
                pin_table(&pins)
            });
        }
    }
    Ok(())
}

async fn node_command(client: &Client, out: &Out, cmd: NodeCmd) -> Result<(), Error> {
    match cmd {
        NodeCmd::Report {
            name,
            state,
            labels,
            uid,
            unschedulable,
        } => {
            let state = match state {
                NodeStateArg::Joined => pb::NodeState::NodeJoined,
                NodeStateArg::Ready => pb::NodeState::NodeReady,
                NodeStateArg::NotReady => pb::NodeState::NodeNotReady,
                NodeStateArg::Gone => pb::NodeState::NodeGone,
            };
            let request = pb::ReportNodeRequest {
                name: name.clone(),
                uid,
                state: state as i32,
                set_labels: !labels.is_empty(),
                labels: labels_map(&labels)?,
                unschedulable,
                ..Default::default()
            };
            let reply = client.report_node(request).await?;
            out.print(
                json!({"changed": reply.changed, "pins_released": reply.pins_released, "locks_released": reply.locks_released}),
                || match (reply.changed, reply.pins_released + reply.locks_released) {
                    (false, _) => format!("node {name}: no change"),
                    (true, 0) => format!("node {name} reported"),
                    (true, _) => format!(
                        "node {name} gone: {} pins and {} locks released",
                        reply.pins_released, reply.locks_released
                    ),
                },
            );
        }
        NodeCmd::List { all } => {
            let nodes = client.list_nodes(all).await?;
            let rows: Vec<Value> = nodes
                .iter()
                .map(|n| json!({"name": n.name, "uid": n.uid, "ready": n.ready, "unschedulable": n.unschedulable, "labels": n.labels, "gone_at_ms": n.gone_at_ms}))
                .collect();
            out.print(Value::Array(rows), || {
                let mut text = format!(
                    "{:<28} {:<10} {:<14} {}\n",
                    "NODE", "READY", "SCHEDULABLE", "LABELS"
                );
                for n in &nodes {
                    let mut labels: Vec<String> =
                        n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    labels.sort();
                    let ready = if n.gone_at_ms > 0 {
                        "gone"
                    } else if n.ready {
                        "yes"
                    } else {
                        "no"
                    };
                    let schedulable = if n.unschedulable { "cordoned" } else { "yes" };
                    text.push_str(&format!(
                        "{:<28} {:<10} {:<14} {}\n",
                        n.name,
                        ready,
                        schedulable,
                        labels.join(",")
                    ));
                }
                text
            });
        }
    }
    Ok(())
}

fn lock_table(locks: &[pb::LockState]) -> String {
    let mut text = format!(
        "{:<32} {:<48} {:>8} {:>7}\n",
        "LOCK", "HOLDER", "TOKEN", "WAITERS"
    );
    for lock in locks {
        let key = lock.key.clone().unwrap_or_default();
        let (holder, token) = match &lock.holder {
            Some(h) => (pod_label(&h.pod), h.token.to_string()),
            None => ("-".to_string(), "-".to_string()),
        };
        text.push_str(&format!(
            "{:<32} {:<48} {:>8} {:>7}\n",
            format!("{}/{}", key.scope, key.name),
            holder,
            token,
            lock.waiters.len()
        ));
        for (i, w) in lock.waiters.iter().enumerate() {
            text.push_str(&format!("  {}. {}\n", i + 1, pod_label(&w.pod)));
        }
    }
    text
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completion { shell } = cli.command {
        let mut command = Cli::command();
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command, "lockctl", &mut script);
        // A closed pipe (`| head`) is not an error worth a panic.
        let _ = std::io::stdout().write_all(&script);
        return ExitCode::SUCCESS;
    }
    let mut explain_options = Options {
        call_timeout: cli.timeout,
        ..Options::default()
    };
    // A bad --tls-dir is reported by `run`; the explanation does without.
    let _ = cli.security.apply(&mut explain_options);
    let explain = Client::new(cli.endpoints.clone(), explain_options);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lockctl: {err}");
            if let (Error::Unavailable(_), Ok(client)) = (&err, explain) {
                eprintln!("lockctl: {}", explain_unavailable(&client).await);
            }
            ExitCode::from(err.exit_code() as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn yaml_output_reads_back_as_the_same_value_with_ambiguous_strings_kept() {
        let value = json!({
            "lock": "gpu-bind/node-1",
            "holder": {"token": 3, "payload": "true", "pod": "no", "note": "a: b # c", "at": "1e3"},
            "waiters": [{"pod": "a"}, {"pod": "b"}],
            "empty": [],
            "none": {},
        });
        let text = to_yaml(&value);
        let back: Value = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        assert!(
            text.contains("lock: gpu-bind/node-1"),
            "block style: {text}"
        );
    }
}
