//! Raft wiring: the openraft type configuration and the network between
//! replicas.

pub mod dial;
pub mod network;

use std::io::Cursor;

use crate::sm::{Request, Response};

openraft::declare_raft_types!(
    /// Tether's openraft type configuration.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        AsyncRuntime = openraft::TokioRuntime,
);

/// Largest Raft message a replica accepts (and sends): AppendEntries carry
/// many entries, snapshots come in chunks; client requests are bounded by
/// `--max-request-bytes` instead, at most a quarter of this so that one entry
/// always fits a message. The default of `Config::raft_message_limit`.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// A Tether replica's Raft handle.
pub type Raft = openraft::Raft<TypeConfig, crate::store::StateMachineStore>;
/// A log id in Tether's configuration: (term, leader node id) and index,
/// the 0.9 layout (openraft's default, "advanced", leader ids).
pub type LogId = openraft::type_config::alias::LogIdOf<TypeConfig>;
/// The leader id a log id carries.
pub type CommittedLeaderId = openraft::type_config::alias::CommittedLeaderIdOf<TypeConfig>;
/// A vote.
pub type Vote = openraft::type_config::alias::VoteOf<TypeConfig>;
/// A membership (voter sets and nodes).
pub type Membership = openraft::Membership<u64, openraft::BasicNode>;
/// Membership as stored with its log id.
pub type StoredMembership = openraft::type_config::alias::StoredMembershipOf<TypeConfig>;
/// What a snapshot covers.
pub type SnapshotMeta = openraft::type_config::alias::SnapshotMetaOf<TypeConfig>;
/// A snapshot with its data.
pub type Snapshot = openraft::type_config::alias::SnapshotOf<TypeConfig, Cursor<Vec<u8>>>;
/// A log entry.
pub type Entry = openraft::type_config::alias::EntryOf<TypeConfig>;
/// Storage errors. openraft 0.10's storage traits return `io::Error`; the
/// store's messages say what was being read or written.
pub type StorageError = std::io::Error;

/// Starts replica `id`'s Raft node over `network` and the two stores, with
/// the timing, snapshot policy and message limit of `config`.
pub async fn start(
    id: u64,
    config: &crate::config::Config,
    network: network::Network,
    log_store: crate::store::LogStore,
    sm_store: crate::store::StateMachineStore,
) -> anyhow::Result<Raft> {
    use anyhow::Context as _;
    let election_ms = config.election_timeout.as_millis() as u64;
    let raft_config = openraft::Config {
        cluster_name: "tether".to_string(),
        heartbeat_interval: config.heartbeat_interval.as_millis() as u64,
        election_timeout_min: election_ms,
        election_timeout_max: election_ms * 2,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(config.snapshot_every),
        max_in_snapshot_log_to_keep: config.keep_logs_after_snapshot,
        // openraft's 3 MiB chunks, or half the Raft message limit when
        // that is lower, so a chunk and its metadata fit one message.
        snapshot_max_chunk_size: (config.raft_message_limit as u64 / 2).min(3 * 1024 * 1024),
        // A restarted leader campaigns in a new term, as Raft has it,
        // rather than leading on in its old one (openraft's default). The
        // leader's own sync overlaps sending its entries out, and the
        // followers' syncs alone can commit them: a power cut can take
        // from the leader's disk an entry a client was told of. Leading on
        // in that term, it would put its next entry at that index under the
        // same term, the followers would take it for the one they hold, and
        // the grant would be lost and granted again (the power-loss chaos
        // schedules found it on 2026-12-05; regression test
        // `a_leader_that_lost_its_unsynced_tail_to_a_power_cut_does_not_lead_on_in_its_term`,
        // which also runs a build with the planted switch `leader-restore`
        // on, to show it catches this).
        enable_leader_restore: Some(crate::store::planted("leader-restore")),
        ..Default::default()
    }
    .validate()
    .context("invalid Raft timing (the heartbeat must be shorter than the election timeout)")?;
    Raft::new(
        id,
        std::sync::Arc::new(raft_config),
        network,
        log_store,
        sm_store,
    )
    .await
    .context("cannot start Raft")
}

/// Raft's metrics, as openraft publishes them.
pub type Metrics = openraft::RaftMetrics<TypeConfig>;

/// Waits until `raft`'s metrics satisfy `done` (openraft's watch receiver
/// has no `wait_for`); Err if the Raft core is gone first.
pub async fn wait_for_metrics(raft: &Raft, done: impl Fn(&Metrics) -> bool) -> Result<(), ()> {
    use openraft::async_runtime::WatchReceiver as _;
    let mut rx = raft.metrics();
    loop {
        if done(&rx.borrow_watched()) {
            return Ok(());
        }
        if rx.changed().await.is_err() {
            return Err(());
        }
    }
}

/// The log id of entry `index` proposed by `node` as leader in `term`.
pub fn log_id(term: u64, node: u64, index: u64) -> LogId {
    LogId::new(
        CommittedLeaderId {
            term,
            node_id: node,
        },
        index,
    )
}
