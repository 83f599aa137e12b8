//! gRPC handlers: decode, validate, call Raft (or a linearizable read) and
//! convert. Errors map to `Status` in one place (`crate::error`).

pub mod batching;
pub mod clock;
pub mod cluster;
pub mod convert;
pub mod lease;
pub mod lock;
pub mod node;
pub mod pin;
pub mod raft;
pub mod reads;
pub mod sessions;
pub mod validate;
pub mod watch;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tether_proto::ResponseHeader;

use crate::config::Config;
use crate::error::{ApiError, Result, from_raft_error};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::sm::{Command, Reply, Request, RequestId, batchable_lock};
use crate::store::StateHandle;

/// What every handler needs: the Raft handle, a read handle on the applied
/// state, configuration and metrics.
pub struct Ctx {
    /// This replica's node id.
    pub id: u64,
    /// The address this replica advertises.
    pub addr: String,
    /// The Raft node.
    pub raft: Raft,
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
    /// (`node::watch_core`): from then on this replica serves nothing and
    /// `/live` fails.
    pub core_stopped: std::sync::OnceLock<String>,
    /// Set while this leader hands leadership over: new writes are refused
    /// with `UNAVAILABLE` (clients retry and find the new leader), so the
    /// target can catch up with a log that stops growing (Raft thesis 3.10).
    pub transferring: std::sync::atomic::AtomicBool,
    /// How callers are identified and what their roles allow.
    pub auth: crate::auth::Auth,
    /// How this replica dials the others.
    pub dialer: Arc<crate::raft::dial::PeerDialer>,
    /// Open watches per owner (identity or IP), for
    /// `--max-watchers-per-client`.
    pub watchers: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    /// The batching queue for acquires and releases; None when batching is
    /// off (`--batch-max-commands 1`).
    pub proposer: Option<batching::Proposer>,
    /// Shared ReadIndex rounds for linearizable reads.
    pub reads: Arc<reads::ReadBarrier>,
    /// The log formats the other replicas read: entries of a newer format
    /// are written only once every member reads it.
    pub peer_formats: Arc<crate::raft::network::PeerFormats>,
    /// The cluster's id as this replica knows it ([`crate::cluster_id`]).
    pub cluster_id: Arc<crate::cluster_id::ClusterIdCell>,
    /// Stamps for the entries this replica proposes ([`clock`]).
    pub clock: Arc<clock::CommitClock>,
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

impl Ctx {
    /// Proposes a command through Raft (leader only) and returns its reply.
    /// Refusals of the state machine come back as [`ApiError::Command`].
    pub async fn write(&self, request_id: Option<RequestId>, command: Command) -> Result<Reply> {
        self.write_at(request_id, command)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`Ctx::write`], with the log index of the entry that answered.
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
        let batching = match &self.proposer {
            Some(proposer) if batchable_lock(&command).is_some() => {
                proposer.batching().map(|batching| (proposer, batching))
            }
            _ => None,
        };
        let (response, index) = match batching {
            Some((proposer, batching)) => proposer.propose(request_id, command, batching).await?,
            None => {
                let request = self.request(request_id, self.stamp(), command);
                let written = self
                    .metrics
                    .time_commit(self.raft.client_write(request))
                    .await
                    .map_err(from_raft_error)?;
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
        let term = self.raft.metrics().borrow().current_term;
        self.clock.stamp(term)
    }

    /// A request's id as the state machine keys it
    /// ([`validate::request_id`]), admitted if it would open a new session
    /// ([`sessions::admit_in`]: the caller's identity under its quota, the
    /// table's reserved places only for the roles that need them).
    pub fn request_id(
        &self,
        caller: &crate::auth::Caller,
        id: Option<&tether_proto::RequestId>,
    ) -> Result<Option<RequestId>> {
        let id = validate::request_id(caller, id)?;
        if let Some(id) = &id {
            let limits = sessions::SessionLimits {
                per_identity: self.config.max_sessions_per_identity as usize,
                reserved: self.config.reserved_sessions as usize,
            };
            let applied = self.state.read();
            sessions::admit_in(&applied.state, caller, &id.client_id, limits)
                .map_err(ApiError::QuotaExceeded)?;
        }
        Ok(id)
    }

    /// Waits until this replica, as leader, has applied everything committed
    /// before the call (ReadIndex), so a following read is linearizable.
    pub async fn linearizable(&self) -> Result<()> {
        self.reads
            .wait()
            .await
            .map_err(crate::error::from_read_check_error)
    }

    /// Header for a response.
    pub fn header(&self, linearizable: bool) -> ResponseHeader {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        ResponseHeader {
            applied_index: metrics.last_applied.map_or(0, |id| id.index),
            node_id: self.id,
            leader_id: metrics.current_leader.unwrap_or(0),
            linearizable,
            cluster_id: self.cluster_id.get().unwrap_or_default(),
        }
    }

    /// Records a call's result in metrics and converts errors to `Status`.
    pub fn finish<T>(&self, method: &'static str, result: Result<T>) -> Result<T, tonic::Status> {
        match result {
            Ok(value) => {
                self.metrics.request(method, "ok");
                Ok(value)
            }
            Err(err) => {
                self.metrics.request(method, err.metric_label());
                Err(err.into())
            }
        }
    }
}

impl Ctx {
    /// The database, unless the replica has shut down.
    pub fn db(&self) -> Result<Arc<rocksdb::DB>> {
        self.db.upgrade().ok_or_else(|| {
            ApiError::Unavailable("this replica has shut down; use another replica".into())
        })
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
}

/// An unexpected reply variant: a bug, reported instead of panicking.
pub fn unexpected(reply: Reply) -> ApiError {
    ApiError::Internal(format!(
        "unexpected reply from the state machine: {reply:?}"
    ))
}
