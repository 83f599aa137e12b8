//! `tetherd` configuration: every flag also reads a `TETHER_*` environment
//! variable. Libraries take this struct; only `main` parses arguments.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Configuration of one replica.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tetherd",
    version,
    about = "Tether replica: Raft-replicated lock service"
)]
pub struct Config {
    /// This replica's Raft node id (unique in the cluster, > 0).
    #[arg(long, env = "TETHER_NODE_ID", default_value_t = 1)]
    pub node_id: u64,

    /// Address the gRPC server (client API and replica traffic) listens on.
    #[arg(long, env = "TETHER_LISTEN", default_value = "127.0.0.1:7420")]
    pub listen: SocketAddr,

    /// Address other replicas and clients reach this replica at
    /// (default: the listen address).
    #[arg(long, env = "TETHER_ADVERTISE")]
    pub advertise: Option<String>,

    /// Directory of this replica's RocksDB data.
    #[arg(long, env = "TETHER_DATA_DIR", default_value = "./tether-data")]
    pub data_dir: PathBuf,

    /// Initial cluster, `ID=ADDR,ID=ADDR,...` (like etcd's --initial-cluster).
    /// The replica with the lowest id initializes an empty cluster with these
    /// members; the others wait to be contacted. Ignored once data exists.
    /// Default: this replica alone (a single-node cluster).
    #[arg(long, env = "TETHER_INITIAL_MEMBERS")]
    pub initial_members: Option<String>,

    /// Run as a Kubernetes StatefulSet member: the node id is drawn once and
    /// kept in the data directory, the ordinal comes from the hostname
    /// (`<set>-<ordinal>`), ordinal 0 starts the cluster once the whole set
    /// (--bootstrap-expect) answers empty and the others join it (learner,
    /// then voter); --node-id and --initial-members are ignored.
    #[arg(long, env = "TETHER_STATEFULSET")]
    pub statefulset: bool,

    /// This pod's hostname, `<set>-<ordinal>` (default: $HOSTNAME, else the
    /// system's).
    #[arg(long, env = "TETHER_HOSTNAME")]
    pub hostname: Option<String>,

    /// Where StatefulSet peers are reached, with `{ordinal}` for the ordinal
    /// (default: `<set>-{ordinal}.<set>-peers:<listen port>`, the headless
    /// service's names). Also this replica's advertised address unless
    /// --advertise is given.
    #[arg(long, env = "TETHER_PEER_TEMPLATE")]
    pub peer_template: Option<String>,

    /// StatefulSet mode: the leader removes voters holding the highest
    /// ordinals once they have been unreachable this long (a scale-in);
    /// 0s never removes anyone.
    #[arg(long, env = "TETHER_SCALE_IN_AFTER", default_value = "5m", value_parser = humantime::parse_duration)]
    pub scale_in_after: Duration,

    /// StatefulSet mode: how many replicas the set has (fill it from the
    /// StatefulSet's `replicas`), like Consul's bootstrap-expect. An empty
    /// replica starts a new cluster only if it is ordinal 0 and every one of
    /// ordinals 0..N answers and has no Raft state; a replica that finds any
    /// peer with data never starts one, it waits to be added.
    #[arg(long, env = "TETHER_BOOTSTRAP_EXPECT")]
    pub bootstrap_expect: Option<u32>,

    /// Ordinals a joining StatefulSet replica asks for the leader (0..N).
    #[arg(long, env = "TETHER_PROBE_ORDINALS", default_value_t = 16)]
    pub probe_ordinals: u32,

    /// Dial some replicas at other addresses than the ones in the cluster's
    /// membership, `ID=ADDR,...`: for a replica that reaches its peers through
    /// a proxy or NAT. The chaos tests route every peer link through a
    /// fault-injecting proxy this way. Clients are not affected.
    #[arg(long, env = "TETHER_PEER_DIAL", value_parser = parse_peer_dial, default_value = "")]
    pub peer_dial: PeerDial,

    /// Start from a backup (a file written by `lockctl cluster export-snapshot`)
    /// as a one-member cluster. The data directory must be empty; the state
    /// and log position are the backup's, so fencing tokens keep growing.
    /// Scale out afterwards by adding members.
    #[arg(long, env = "TETHER_RESTORE_FROM")]
    pub restore_from: Option<PathBuf>,

    /// Directory holding this replica's certificate in cert-manager's layout
    /// (`tls.crt`, `tls.key`, `ca.crt`). Turns on mutual TLS for clients and
    /// replicas alike: every caller needs a certificate from that CA, and its
    /// role comes from the certificate (a `tether:<role>` URI SAN, else the
    /// common name). The replica's own certificate must name `replica` and
    /// cover the addresses peers dial. The files are re-read when they change.
    #[arg(long, env = "TETHER_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,

    /// How often the TLS files are checked for a rotated certificate.
    #[arg(long, env = "TETHER_TLS_RELOAD_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,

    /// Development without TLS: a file of `TOKEN ROLE [NAME]` lines; callers
    /// send `authorization: Bearer TOKEN` and get that role. Tokens cross the
    /// network in clear text; use --tls-dir anywhere that matters.
    #[arg(long, env = "TETHER_AUTH_TOKENS", conflicts_with = "tls_dir")]
    pub auth_tokens: Option<PathBuf>,

    /// Address of the HTTP server for `/health` and `/metrics`.
    #[arg(long, env = "TETHER_HTTP_LISTEN", default_value = "127.0.0.1:7421")]
    pub http_listen: SocketAddr,

    /// Hold timeout (backstop) of every scope without its own. At least
    /// 1ms: a hold is never ended by the entry that granted it.
    #[arg(long, env = "TETHER_HOLD_TIMEOUT", default_value = "5m", value_parser = parse_hold_timeout)]
    pub hold_timeout: Duration,

    /// Per-scope hold timeouts, `SCOPE=DURATION,...` (e.g. `gpu-bind=2m`).
    #[arg(long, env = "TETHER_SCOPE_HOLD_TIMEOUTS", value_parser = parse_scope_timeouts, default_value = "")]
    pub scope_hold_timeouts: ScopeTimeouts,

    /// Largest lock payload accepted, in bytes.
    #[arg(long, env = "TETHER_MAX_PAYLOAD_BYTES", default_value_t = 64 * 1024)]
    pub max_payload_bytes: usize,

    /// Largest request a client may send, in bytes (Raft traffic between
    /// replicas has its own, larger bound). Must leave room for a payload of
    /// --max-payload-bytes, and be at most 16 MiB (a quarter of the Raft
    /// message limit, so that any one log entry fits a message).
    #[arg(long, env = "TETHER_MAX_REQUEST_BYTES", default_value_t = 1024 * 1024)]
    pub max_request_bytes: usize,

    /// Largest Raft message between replicas, in bytes. Not a flag: every
    /// replica must use the same; tests lower it to reach the splitting of
    /// large AppendEntries with little data.
    #[arg(skip = crate::raft::MAX_RAFT_MESSAGE_BYTES)]
    pub raft_message_limit: usize,

    /// Most labels a node report or a pin may carry.
    #[arg(long, env = "TETHER_MAX_LABELS", default_value_t = 64)]
    pub max_labels: usize,

    /// Most watches one client (certificate identity, or IP address without
    /// authentication) may have open on one replica.
    #[arg(long, env = "TETHER_MAX_WATCHERS_PER_CLIENT", default_value_t = 64)]
    pub max_watchers_per_client: usize,

    /// Most exactly-once sessions (distinct client ids with a request
    /// answered in the last `--session-idle`) one authenticated identity may
    /// have; admin and replica identities are not counted. A new client of
    /// an identity at its quota is refused with RESOURCE_EXHAUSTED, so one
    /// caller (a device plugin's certificate) cannot fill the table.
    #[arg(long, env = "TETHER_MAX_SESSIONS_PER_IDENTITY", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_sessions_per_identity: u32,

    /// Sessions of the cluster-wide table (65,536) kept for the bridge,
    /// scheduler, admin and replica roles: other callers get no new session
    /// once only these are left.
    #[arg(long, env = "TETHER_RESERVED_SESSIONS", default_value_t = 8192,
          value_parser = clap::value_parser!(u32).range(0..65_536))]
    pub reserved_sessions: u32,

    /// Longest wait queue per lock.
    #[arg(long, env = "TETHER_MAX_QUEUE_LENGTH", default_value_t = 1024)]
    pub max_queue_length: u32,

    /// Most acquires and releases of different clients proposed together in
    /// one log entry when writes queue up on the leader (one append and one
    /// fsync per replica for all of them). 1 turns batching off.
    #[arg(long, env = "TETHER_BATCH_MAX_COMMANDS", default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=crate::sm::MAX_BATCH_ITEMS as i64))]
    pub batch_max_commands: u32,

    /// Most batch entries the leader has proposed and not yet committed;
    /// further acquires and releases queue and go out together in the next.
    /// (While a member of an older build, which reads at most one command
    /// per lock in an entry, remains, a command on a lock the forming batch
    /// already has goes out alone at once, outside this limit.)
    #[arg(long, env = "TETHER_BATCH_IN_FLIGHT", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub batch_in_flight: u32,

    /// Longest the leader holds back an acquire that will queue (another pod
    /// holds its lock), so that it goes out in one entry with the lock's
    /// next release instead of taking a log entry, an fsync per replica and
    /// a replication round of its own. A held acquire goes out with the next
    /// acquire or release of its lock, or when this time is up: it delays the
    /// "queued" answer, and a grant only if the lock is freed otherwise
    /// (forced release, expiry) meanwhile. Only once every member reads
    /// entries that carry several commands on one lock. 0 turns it off.
    #[arg(long, env = "TETHER_BATCH_HOLD_QUEUED", default_value = "2ms", value_parser = humantime::parse_duration)]
    pub batch_hold_queued: Duration,

    /// Longest wait an acquire may ask for.
    #[arg(long, env = "TETHER_MAX_WAIT", default_value = "15m", value_parser = humantime::parse_duration)]
    pub max_wait: Duration,

    /// How long a queued acquire whose caller went away keeps its place
    /// before it is given up: a retry of the call (same request id, any
    /// replica) within this time keeps the wait. Longer keeps waits of
    /// callers behind slow networks; shorter frees locks sooner when a
    /// caller really is gone (a grant to nobody holds the lock until the
    /// hold timeout).
    #[arg(long, env = "TETHER_ABANDONED_WAIT_GRACE", default_value = "3s", value_parser = humantime::parse_duration)]
    pub abandoned_wait_grace: Duration,

    /// Raft heartbeat interval.
    #[arg(long, env = "TETHER_HEARTBEAT_INTERVAL", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub heartbeat_interval: Duration,

    /// Raft election timeout (lower bound; the upper bound is twice this).
    /// TTL leases may not be shorter than 3 x the upper bound.
    #[arg(long, env = "TETHER_ELECTION_TIMEOUT", default_value = "1s", value_parser = humantime::parse_duration)]
    pub election_timeout: Duration,

    /// Build a snapshot after this many log entries since the last one.
    #[arg(long, env = "TETHER_SNAPSHOT_EVERY", default_value_t = 10_000)]
    pub snapshot_every: u64,

    /// Log entries kept after a snapshot (for followers that lag a little).
    #[arg(long, env = "TETHER_KEEP_LOGS_AFTER_SNAPSHOT", default_value_t = 1_000)]
    pub keep_logs_after_snapshot: u64,

    /// How often the leader checks for waits, leases and holds that are due.
    #[arg(long, env = "TETHER_SWEEP_INTERVAL", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,

    /// Events (the audit trail of grants, releases, revokes) of this many most
    /// recent log entries are kept on disk; older ones are deleted when a
    /// snapshot is built.
    #[arg(
        long,
        env = "TETHER_EVENT_RETENTION_ENTRIES",
        default_value_t = 1_000_000
    )]
    pub event_retention_entries: u64,

    /// Events older than this (committed time) are deleted when a snapshot
    /// is built; `0s` keeps them regardless of age.
    #[arg(long, env = "TETHER_EVENT_RETENTION_AGE", default_value = "7d", value_parser = humantime::parse_duration)]
    pub event_retention_age: Duration,

    /// How long a gone node is remembered (so a late assignment cannot pin to
    /// it) before its tombstone is dropped.
    #[arg(long, env = "TETHER_NODE_TOMBSTONE", default_value = "24h", value_parser = humantime::parse_duration)]
    pub node_tombstone: Duration,

    /// Dedupe records of clients idle this long are dropped.
    #[arg(long, env = "TETHER_SESSION_IDLE", default_value = "1h", value_parser = humantime::parse_duration)]
    pub session_idle: Duration,
}

/// Hold timeouts by scope.
pub type ScopeTimeouts = BTreeMap<String, Duration>;

/// A hold timeout: a duration of at least one millisecond. A zero timeout
/// would make every hold due in the entry that grants it, so the sweep that
/// granted a lock would also have to end that hold.
fn parse_hold_timeout(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text.trim()).map_err(|e| e.to_string())?;
    if duration < Duration::from_millis(1) {
        return Err(format!(
            "a hold timeout must be at least 1ms, got {text:?}: a hold must be able to outlive              the entry that granted it"
        ));
    }
    Ok(duration)
}

fn parse_scope_timeouts(text: &str) -> Result<ScopeTimeouts, String> {
    let mut out = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (scope, duration) = part
            .split_once('=')
            .ok_or_else(|| format!("expected SCOPE=DURATION, got {part:?}"))?;
        let duration = parse_hold_timeout(duration)
            .map_err(|e| format!("bad hold timeout for scope {scope:?}: {e}"))?;
        out.insert(scope.trim().to_string(), duration);
    }
    Ok(out)
}

/// Replica id -> the address to dial it at (see `--peer-dial`).
pub type PeerDial = BTreeMap<u64, String>;

fn parse_peer_dial(text: &str) -> Result<PeerDial, String> {
    if text.trim().is_empty() {
        return Ok(PeerDial::new());
    }
    parse_members(text)
}

/// Parses `ID=ADDR,ID=ADDR,...`.
pub fn parse_members(text: &str) -> Result<BTreeMap<u64, String>, String> {
    let mut out = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("expected ID=ADDR, got {part:?}"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("bad node id {id:?} in {part:?}"))?;
        if id == 0 {
            return Err("node id 0 is reserved; ids start at 1".to_string());
        }
        if out.insert(id, addr.trim().to_string()).is_some() {
            return Err(format!("node id {id} appears twice"));
        }
    }
    if out.is_empty() {
        return Err("no members given".to_string());
    }
    Ok(out)
}

impl Config {
    /// What `tetherd` with no arguments would use (`TETHER_*` environment
    /// variables still apply).
    pub fn defaults() -> Self {
        Config::parse_from(["tetherd"])
    }

    /// Upper bound of the election timeout.
    pub fn election_timeout_max(&self) -> Duration {
        self.election_timeout * 2
    }

    /// Shortest TTL a lease may have: 3 x the election timeout upper bound,
    /// so a lease cannot expire during an ordinary leader election.
    pub fn min_lease_ttl(&self) -> Duration {
        self.election_timeout_max() * 3
    }

    /// The hold timeout that applies to a scope.
    pub fn hold_timeout_for(&self, scope: &str) -> Duration {
        self.scope_hold_timeouts
            .get(scope)
            .copied()
            .unwrap_or(self.hold_timeout)
    }

    /// The longest hold timeout of any scope: the leader's lock-delay.
    pub fn longest_hold_timeout(&self) -> Duration {
        self.scope_hold_timeouts
            .values()
            .copied()
            .fold(self.hold_timeout, Duration::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_hold_timeout_is_refused_for_every_scope_and_the_default() {
        assert_eq!(parse_hold_timeout("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_hold_timeout("1ms").unwrap(), Duration::from_millis(1));
        for zero in ["0s", "0ms", "500us"] {
            let err = parse_hold_timeout(zero).unwrap_err();
            assert!(err.contains("at least 1ms"), "{zero}: {err}");
        }
        let err = parse_scope_timeouts("gpu-bind=2m,npu-bind=0s").unwrap_err();
        assert!(
            err.contains("npu-bind") && err.contains("at least 1ms"),
            "{err}"
        );
        let parsed = parse_scope_timeouts("gpu-bind=2m").unwrap();
        assert_eq!(parsed["gpu-bind"], Duration::from_secs(120));
        // Through clap too: the flag refuses it before the replica starts.
        let err = Config::try_parse_from(["tetherd", "--hold-timeout", "0s"]).unwrap_err();
        assert!(err.to_string().contains("at least 1ms"), "{err}");
    }
}
