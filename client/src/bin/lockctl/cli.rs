//! The command line: clap's tree of nouns and verbs, the exit codes its
//! help prints, and the parsing of argument values clap leaves to us.

use super::*;

#[derive(Parser)]
#[command(name = "lockctl", version, about = "Operate a Tether lock cluster", after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// Replicas to talk to, comma-separated host:port (any replica; the
    /// leader is found and followed).
    #[arg(
        long,
        env = "TETHER_ENDPOINTS",
        default_value = "127.0.0.1:7420",
        global = true,
        value_delimiter = ','
    )]
    pub(crate) endpoints: Vec<String>,

    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Format::Table, global = true)]
    pub(crate) output: Format,

    /// Deadline of each attempt of a call.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration, global = true)]
    pub(crate) timeout: Duration,

    /// How long to keep retrying (other replicas, a new leader) before giving up.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub(crate) retry_for: Duration,

    #[command(flatten)]
    pub(crate) security: tether_client::SecurityArgs,

    #[command(subcommand)]
    pub(crate) command: Command,
}

pub(crate) const EXIT_CODES: &str = "Exit codes: 0 ok, 1 other error, 2 invalid arguments, 3 refused by the lock \
rules (held, not the holder, stale token, unknown lease, no such pin), 4 wait deadline passed, 5 no \
replica could serve or no candidate fits (for a write the outcome is unknown), 6 watch revision \
compacted, 7 permission denied or not authenticated (see --tls-dir, --token-file), 8 a replica of \
another cluster than the one first seen answered (nothing was done)";

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub(crate) enum Format {
    Table,
    Json,
    Yaml,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
pub(crate) enum PinCmd {
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
pub(crate) enum NodeStateArg {
    Joined,
    Ready,
    NotReady,
    Gone,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum PodStateArg {
    /// Alive, containers not started.
    Alive,
    Running,
    Terminal,
    Gone,
}

#[derive(Subcommand)]
pub(crate) enum NodeCmd {
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
pub(crate) enum ClusterCmd {
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
pub(crate) enum LockCmd {
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
pub(crate) enum OutcomeArg {
    Allocated,
    Failed,
}

#[derive(Subcommand)]
pub(crate) enum LeaseCmd {
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

pub(crate) fn parse_pod(uid: &str, pod: &Option<String>) -> Result<pb::Pod, Error> {
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

pub(crate) fn labels_map(
    labels: &[String],
) -> Result<std::collections::HashMap<String, String>, Error> {
    labels.iter().map(|l| parse_label(l)).collect()
}
