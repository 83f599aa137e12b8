//! The replica core: what sits between the request handlers (`api/`) and
//! Raft with its store (`raft/`, `store/`). Handlers decode, validate,
//! authorize, call the core and convert; the core writes commands (batched,
//! stamped with committed time), serves linearizable reads, follows and
//! ends waits, changes the membership, hands leadership over, and runs the
//! leader's sweeper. Only the core and `raft/` name openraft's types: the
//! handlers see [`Replica`]'s methods and [`View`].
//!
//! # Layout
//! - `mod.rs` — [`Replica`]: the write and read paths, [`View`].
//! - `batching.rs` — acquires and releases of many clients share entries.
//! - `reads.rs` — shared ReadIndex rounds for linearizable reads.
//! - `clock.rs` — the stamps of the entries this replica proposes.
//! - `commit.rs` — proposing an entry and awaiting its answer, giving up on
//!   one openraft 0.9 leaves unanswered.
//! - `waits.rs` — following a queued acquire, and ending a wait through
//!   the leader.
//! - `membership.rs` — learners, voters, leader transfer, snapshots.
//! - `tasks.rs` — what runs beside the handlers: the leader's sweeper, the
//!   cluster id's claim, the core's watch, departed peers' connections.
//! - `peer_service.rs` — the `RaftService` the other replicas call.
//! - `raft_errors.rs` — openraft's errors as API errors.

pub mod batching;
pub mod clock;
pub mod commit;
pub mod membership;
pub mod peer_service;
pub mod raft_errors;
pub mod reads;
pub mod tasks;
pub mod waits;

use openraft::async_runtime::WatchReceiver as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use openraft::ServerState;

use crate::config::Config;
use crate::error::{ApiError, Result};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::dial::PeerDialer;
use crate::raft::network::PeerFormats;
use crate::sm::{Command, Event, Reply, Request, RequestId};
use crate::store::StateHandle;

/// One replica's core: its Raft node, its applied state, and the machinery
/// every transport's handlers share.
pub struct Replica {
    /// This replica's node id.
    pub id: u64,
    /// The address this replica advertises.
    pub addr: String,
    /// The Raft node: only the core drives it.
    raft: Raft,
    /// Applied state and event stream.
    pub state: StateHandle,
    /// The replica's database, for reading events (watch, history). Weak, so
    /// that a connection outliving the replica's shutdown does not keep the
    /// database open.
    pub db: std::sync::Weak<rocksdb::DB>,
    /// Configuration.
    pub config: Arc<Config>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Turns true when the replica shuts down: long-running calls (queued
    /// acquires) then end with `UNAVAILABLE` so their clients move on.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// Why Raft's core stopped, once it has without being asked to
    /// ([`tasks::watch_core`]): from then on this replica serves nothing and
    /// `/live` fails.
    pub core_stopped: std::sync::OnceLock<String>,
    /// Set while this leader hands leadership over: new writes are refused
    /// with `UNAVAILABLE` (clients retry and find the new leader), so the
    /// target can catch up with a log that stops growing (Raft thesis 3.10).
    transferring: std::sync::atomic::AtomicBool,
    /// How this replica dials the others.
    pub dialer: Arc<PeerDialer>,
    /// The batching queue for acquires and releases; None when batching is
    /// off (`--batch-max-commands 1`).
    proposer: Option<batching::Proposer>,
    /// Shared ReadIndex rounds for linearizable reads.
    reads: Arc<reads::ReadBarrier>,
    /// The log formats the other replicas read: entries of a newer format
    /// are written only once every member reads it.
    peer_formats: Arc<PeerFormats>,
    /// The cluster's id as this replica knows it ([`crate::cluster_id`]).
    pub cluster_id: Arc<crate::cluster_id::ClusterIdCell>,
    /// Stamps for the entries this replica proposes ([`clock`]).
    clock: Arc<clock::CommitClock>,
}

/// What a replica is made of ([`Replica::new`]).
pub struct Parts {
    /// This replica's node id.
    pub id: u64,
    /// The address it advertises.
    pub addr: String,
    /// Its Raft node.
    pub raft: Raft,
    /// Its applied state.
    pub state: StateHandle,
    /// Its database.
    pub db: std::sync::Weak<rocksdb::DB>,
    /// Configuration.
    pub config: Arc<Config>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// The shutdown signal.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// How it dials the others.
    pub dialer: Arc<PeerDialer>,
    /// What the others read, as the Raft network learns it.
    pub peer_formats: Arc<PeerFormats>,
    /// The cluster's id.
    pub cluster_id: Arc<crate::cluster_id::ClusterIdCell>,
}

/// A replica's role in its cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It leads.
    Leader,
    /// It follows, as a voter.
    Follower,
    /// It stands for election.
    Candidate,
    /// It follows without a vote.
    Learner,
    /// It has stopped.
    Shutdown,
}

impl Role {
    /// The role's name in `Status` answers.
    pub fn name(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Follower => "follower",
            Role::Candidate => "candidate",
            Role::Learner => "learner",
            Role::Shutdown => "shutdown",
        }
    }
}

/// A member of the cluster, as this replica sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its node id.
    pub id: u64,
    /// Its membership address.
    pub addr: String,
    /// Whether it votes.
    pub voter: bool,
    /// The last log index known to be replicated to it (leader only).
    pub matched_index: u64,
}

/// What this replica knows of its cluster now: its Raft metrics, without
/// openraft's types.
#[derive(Debug, Clone)]
pub struct View {
    /// Its role.
    pub role: Role,
    /// Why its Raft core stopped, if it has.
    pub fatal: Option<String>,
    /// Current term.
    pub term: u64,
    /// The leader it knows of.
    pub leader_id: Option<u64>,
    /// That leader's membership address.
    pub leader_addr: Option<String>,
    /// Index of its last log entry, if any.
    pub last_log_index: Option<u64>,
    /// Index of the last entry applied (0 before any).
    pub applied_index: u64,
    /// Index of its last snapshot, if any.
    pub snapshot_index: Option<u64>,
    /// The membership, by id.
    pub members: Vec<Member>,
    /// Whether it has any Raft state (log, snapshot or a vote).
    pub has_raft_state: bool,
}

impl View {
    /// The member `id`, if it is one.
    pub fn member(&self, id: u64) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// Whether `id` is a voter.
    pub fn is_voter(&self, id: u64) -> bool {
        self.member(id).is_some_and(|m| m.voter)
    }
}

/// Wall-clock time in ms since the epoch: what the stamps of the entries
/// this replica proposes as leader follow ([`clock::CommitClock`]), never
/// read inside apply.
///
/// With the `failpoints` feature, `FAILPOINTS=clock-offset-ms=return(N)`
/// moves this replica's clock by N ms (negative: behind), as a host whose
/// clock is off would: the chaos harness's clock-skew fault.
pub fn wall_clock_ms() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    #[cfg(feature = "failpoints")]
    if let Some(offset) = fail::eval("clock-offset-ms", |arg| {
        arg.and_then(|a| a.trim().parse::<i64>().ok())
    })
    .flatten()
    {
        return now.saturating_add_signed(offset);
    }
    now
}

impl Replica {
    /// The core of a replica made of `parts`, with the write batching
    /// `config` asks for.
    pub fn new(parts: Parts) -> Self {
        let Parts {
            id,
            addr,
            raft,
            state,
            db,
            config,
            metrics,
            shutdown,
            dialer,
            peer_formats,
            cluster_id,
        } = parts;
        let clock = Arc::new(clock::CommitClock::new(state.clone()));
        let proposer = (config.batch_max_commands > 1).then(|| {
            let limits = batching::BatchLimits {
                max_commands: config.batch_max_commands as usize,
                // Keeps a batch entry well inside one Raft message.
                max_payload_bytes: config.max_request_bytes,
                in_flight: config.batch_in_flight as usize,
                hold_queued: config.batch_hold_queued,
            };
            batching::Proposer::start(
                raft.clone(),
                id,
                peer_formats.clone(),
                state.clone(),
                limits,
                metrics.clone(),
                clock.clone(),
            )
        });
        let reads = reads::ReadBarrier::new(raft.clone(), metrics.clone());
        Self {
            id,
            addr,
            raft,
            state,
            db,
            config,
            metrics,
            shutdown,
            core_stopped: Default::default(),
            transferring: Default::default(),
            dialer,
            proposer,
            reads,
            peer_formats,
            cluster_id,
            clock,
        }
    }

    /// Proposes a command through Raft (leader only) and returns its reply.
    /// Refusals of the state machine come back as [`ApiError::Command`].
    pub async fn write(&self, request_id: Option<RequestId>, command: Command) -> Result<Reply> {
        self.write_at(request_id, command)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`Replica::write`], with the log index of the entry that answered.
    pub async fn write_at(
        &self,
        request_id: Option<RequestId>,
        command: Command,
    ) -> Result<(Reply, u64)> {
        if self.transferring.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ApiError::Unavailable(
                "leadership is being transferred; retry in a moment".into(),
            ));
        }
        let batching = self.proposer.as_ref().and_then(|proposer| {
            proposer
                .batching()
                .filter(|batching| batching::Proposer::may_batch(&command, *batching))
                .map(|batching| (proposer, batching))
        });
        let (response, index) = match batching {
            Some((proposer, batching)) => proposer.propose(request_id, command, batching).await?,
            None => {
                let request = self.request(request_id, self.stamp(), command);
                let written = self
                    .metrics
                    .time_commit(commit::commit(&self.raft, request))
                    .await?;
                (written.data, written.log_id.index)
            }
        };
        Ok((response.result?, index))
    }

    /// The log entry for `command`, stamped `leader_time_ms`: in the oldest
    /// format that expresses it with this build's rules, except that while
    /// another member has said it reads only older formats (a rolling
    /// upgrade) it goes out in the format that member reads (or the
    /// command's oldest form, if newer) and then applies as that member's
    /// build applies it ([`Request::for_members`]). A member
    /// that has not answered does not count: if it turns out to be older, it
    /// stops with a clear error at the entry rather than applying it wrongly.
    pub fn request(
        &self,
        request_id: Option<RequestId>,
        leader_time_ms: u64,
        command: Command,
    ) -> Request {
        Request::new(request_id, leader_time_ms, command)
            .for_members(self.peer_formats.oldest_member_known(&self.raft, self.id))
    }

    /// The stamp for an entry this replica proposes now ([`clock`]).
    pub fn stamp(&self) -> u64 {
        let term = self.raft.metrics().borrow_watched().current_term;
        self.clock.stamp(term)
    }

    /// Whether every other member has said it reads log format `format`
    /// (true without other members): only then may this replica, as
    /// leader, write a command that exists only from that format.
    pub fn members_read(&self, format: u16) -> bool {
        self.format_members_read()
            .is_none_or(|newest| newest >= format)
    }

    /// Whether another member has said that it reads only formats older
    /// than `format` (a rolling upgrade from an older build). Unlike
    /// [`Replica::members_read`], a member that has not answered since
    /// this replica started (a new leader's first moments) does not count.
    pub fn member_known_older_than(&self, format: u16) -> bool {
        self.peer_formats
            .oldest_member_known(&self.raft, self.id)
            .is_some_and(|oldest| oldest < format)
    }

    /// The newest log format every other member has said it reads (None
    /// without other members; 0 while one has not answered since this
    /// replica started).
    pub fn format_members_read(&self) -> Option<u16> {
        self.peer_formats.newest_members_read(&self.raft, self.id)
    }

    /// `Ok` when every other member reads `format`, which `command` needs;
    /// else a refusal that says what to do `otherwise`.
    pub fn require_format(&self, format: u16, command: &str, otherwise: &str) -> Result<()> {
        match self.format_members_read().filter(|read| *read < format) {
            Some(read) => Err(ApiError::FailedPrecondition(format!(
                "{command} needs every member to read format {format}; one reads only {read} \
                 ({otherwise})"
            ))),
            None => Ok(()),
        }
    }

    /// Waits until this replica, as leader, has applied everything committed
    /// before the call (ReadIndex), so a following read is linearizable.
    pub async fn linearizable(&self) -> Result<()> {
        self.reads
            .wait()
            .await
            .map_err(raft_errors::from_read_check_error)
    }

    /// Whether this replica leads as far as it knows, without asking the
    /// followers (no ReadIndex round): `NotLeader` with the leader it knows
    /// of, if any, otherwise. For reads that may be behind the newest
    /// writes.
    pub fn leading(&self) -> Result<()> {
        if self.raft.metrics().borrow_watched().state == ServerState::Leader {
            return Ok(());
        }
        let view = self.view();
        Err(ApiError::NotLeader {
            leader_id: view.leader_id,
            leader_addr: view.leader_addr,
        })
    }

    /// What this replica knows of its cluster now.
    pub fn view(&self) -> View {
        let m = self.raft.metrics().borrow_watched().clone();
        let membership = m.membership_config.membership();
        let replication = m.replication.clone().unwrap_or_default();
        let members = membership
            .nodes()
            .map(|(id, node)| Member {
                id: *id,
                addr: node.addr.clone(),
                voter: membership.voter_ids().any(|v| v == *id),
                matched_index: replication
                    .get(id)
                    .copied()
                    .flatten()
                    .map_or(0, |l| l.index),
            })
            .collect();
        let leader_addr = m
            .current_leader
            .and_then(|id| membership.get_node(&id).map(|n| n.addr.clone()));
        View {
            role: match m.state {
                ServerState::Leader => Role::Leader,
                ServerState::Follower => Role::Follower,
                ServerState::Candidate => Role::Candidate,
                ServerState::Learner => Role::Learner,
                ServerState::Shutdown => Role::Shutdown,
            },
            fatal: m.running_state.as_ref().err().map(|e| e.to_string()),
            term: m.current_term,
            leader_id: m.current_leader,
            leader_addr,
            last_log_index: m.last_log_index,
            applied_index: m.last_applied.map_or(0, |l| l.index),
            snapshot_index: m.snapshot.map(|l| l.index),
            members,
            has_raft_state: m.last_log_index.is_some()
                || m.snapshot.is_some()
                // A fresh replica's vote is term 0 (openraft 0.10 names
                // the replica itself in it, 0.9 named node 0).
                || m.vote.leader_id.term > 0
                || m.vote.committed,
        }
    }

    /// The index of the last entry applied, and the leader this replica
    /// knows of: what every response's header says, read without copying
    /// the rest of the metrics.
    pub fn applied_and_leader(&self) -> (u64, Option<u64>) {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        (m.last_applied.map_or(0, |l| l.index), m.current_leader)
    }

    /// `Ok` when this replica leads; else where the leader is.
    pub fn require_leader(&self) -> Result<()> {
        let view = self.view();
        if view.role == Role::Leader {
            return Ok(());
        }
        Err(ApiError::NotLeader {
            leader_id: view.leader_id,
            leader_addr: view.leader_addr,
        })
    }

    /// The database, unless the replica has shut down.
    pub fn db(&self) -> Result<Arc<rocksdb::DB>> {
        self.db.upgrade().ok_or_else(|| {
            ApiError::Unavailable("this replica has shut down; use another replica".into())
        })
    }

    /// Up to `limit` events of the stored log from `from` on (older ones
    /// may have been compacted: [`StateHandle::events_first`]).
    pub fn read_events(&self, from: crate::sm::Revision, limit: usize) -> Result<Vec<Event>> {
        let db = self.db()?;
        crate::store::read_events(&db, from, limit)
            .map_err(|e| ApiError::Internal(format!("reading events: {e}")))
    }

    /// The stored snapshot (its index and bytes), if one was stored.
    pub fn stored_snapshot(&self) -> Result<Option<(u64, Vec<u8>)>> {
        let db = self.db()?;
        crate::store::state_machine::stored_snapshot(&db)
            .map_err(|e| ApiError::Internal(format!("reading the snapshot: {e}")))
    }

    /// Resolves once the replica is shutting down.
    pub async fn shutting_down(&self) {
        let mut rx = self.shutdown.clone();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// The Raft node, for the wiring and tests (they wait on its metrics);
    /// handlers use the methods above.
    pub fn raft_handle(&self) -> &Raft {
        &self.raft
    }

    /// Stops the Raft node (the replica is shutting down).
    pub async fn stop_raft(&self) {
        if let Err(err) = self.raft.shutdown().await {
            tracing::warn!(%err, "Raft shutdown failed");
        }
    }
}

/// An unexpected reply variant: a bug, reported instead of panicking.
pub fn unexpected(reply: Reply) -> ApiError {
    ApiError::Internal(format!(
        "unexpected reply from the state machine: {reply:?}"
    ))
}
