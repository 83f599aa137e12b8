//! `ClusterService`: status, membership changes, leader transfer, snapshots.

use crate::auth::{Action, Caller};
use crate::sm::Command;
use crate::sm::command::Audit;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use openraft::{BasicNode, ServerState};
use tether_proto as pb;
use tether_proto::cluster_service_server::ClusterService;
use tonic::{Request, Response, Status};

use super::Ctx;
use crate::error::{ApiError, Result, from_raft_error};

/// The `ClusterService` implementation.
pub struct ClusterApi {
    ctx: Arc<Ctx>,
}

impl ClusterApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }
}

fn role_name(state: ServerState) -> &'static str {
    match state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

/// This replica's view of the cluster.
pub fn status(ctx: &Ctx) -> pb::StatusResponse {
    let metrics = ctx.raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership();
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let replication = metrics.replication.clone().unwrap_or_default();
    let members = membership
        .nodes()
        .map(|(id, node)| pb::Member {
            node_id: *id,
            addr: node.addr.clone(),
            voter: voters.contains(id),
            matched_index: replication
                .get(id)
                .copied()
                .flatten()
                .map_or(0, |l| l.index),
        })
        .collect();
    let leader_addr = metrics
        .current_leader
        .and_then(|id| membership.get_node(&id).map(|n| n.addr.clone()))
        .unwrap_or_default();
    pb::StatusResponse {
        node_id: ctx.id,
        addr: ctx.addr.clone(),
        role: role_name(metrics.state).to_string(),
        leader_id: metrics.current_leader.unwrap_or(0),
        leader_addr,
        term: metrics.current_term,
        last_log_index: metrics.last_log_index.unwrap_or(0),
        applied_index: metrics.last_applied.map_or(0, |l| l.index),
        snapshot_index: metrics.snapshot.map_or(0, |l| l.index),
        members,
        lock_count: ctx.state.read().state.locks.len() as u64,
        has_raft_state: metrics.last_log_index.is_some()
            || metrics.snapshot.is_some()
            || metrics.vote != openraft::Vote::default(),
        cluster_id: ctx.cluster_id.get().unwrap_or_default(),
    }
}

fn require_leader(ctx: &Ctx) -> Result<()> {
    let metrics = ctx.raft.metrics().borrow().clone();
    if metrics.state == ServerState::Leader {
        return Ok(());
    }
    let leader_addr = metrics.current_leader.and_then(|id| {
        metrics
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.addr.clone())
    });
    Err(ApiError::NotLeader {
        leader_id: metrics.current_leader,
        leader_addr,
    })
}

/// Hands leadership to `target`, a voter. openraft 0.9 has no leader transfer,
/// so this does it by hand: wait until the target has every entry, stop
/// heartbeats so the followers' leader lease lapses, then tell the target to
/// start an election at once (before any other follower's election timer
/// fires). Returns the new leader's id.
pub async fn transfer_leader(ctx: &Ctx, target: u64) -> Result<u64> {
    require_leader(ctx)?;
    if target == ctx.id {
        return Ok(ctx.id);
    }
    let metrics = ctx.raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership().clone();
    if !membership.voter_ids().any(|id| id == target) {
        return Err(ApiError::FailedPrecondition(format!(
            "node {target} is not a voter; promote it with ChangeMembership first"
        )));
    }
    let addr = membership
        .get_node(&target)
        .map(|n| n.addr.clone())
        .unwrap_or_default();
    let timeout = ctx.config.election_timeout_max() * 4;
    if ctx
        .transferring
        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return Err(ApiError::FailedPrecondition(
            "a leadership transfer is already in progress".into(),
        ));
    }
    // New writes are refused from here on, so the log stops growing.
    let result = hand_over(ctx, target, &addr, timeout).await;
    ctx.transferring.store(false, Ordering::SeqCst);
    result
}

/// Steps 1-3 of a transfer, with writes already held off.
async fn hand_over(ctx: &Ctx, target: u64, addr: &str, timeout: Duration) -> Result<u64> {
    // 1. The target must have the whole log, or it cannot win the election.
    let caught_up = tokio::time::timeout(timeout, async {
        let mut rx = ctx.raft.metrics();
        loop {
            let (last, matched) = {
                let m = rx.borrow();
                let matched = m
                    .replication
                    .as_ref()
                    .and_then(|r| r.get(&target).copied().flatten());
                (m.last_log_index, matched.map(|l| l.index))
            };
            if last.is_some() && matched >= last {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
    if caught_up.is_err() {
        return Err(ApiError::Unavailable(format!(
            "node {target} did not catch up with the log within {timeout:?}; try again"
        )));
    }

    // 2. Let the followers' leader lease lapse, 3. then the target elects.
    ctx.raft.runtime_config().heartbeat(false);
    let result = async {
        tokio::time::sleep(ctx.config.election_timeout_max() + Duration::from_millis(50)).await;
        // Dialed and marked like any Raft message.
        let mut client = ctx.dialer.raft_client(target, addr).ok_or_else(|| {
            ApiError::Unavailable(format!(
                "node {target} has an address that cannot be dialed: {addr}"
            ))
        })?;
        tokio::time::timeout(
            timeout,
            client.timeout_now(ctx.dialer.message(target, Vec::new())),
        )
        .await
        .map_err(|_| {
            ApiError::Unavailable(format!("node {target} did not answer within {timeout:?}"))
        })?
        .map_err(|e| ApiError::Unavailable(format!("node {target} refused to elect: {e}")))?;
        let mut rx = ctx.raft.metrics();
        tokio::time::timeout(timeout, async {
            loop {
                let leader = rx.borrow().current_leader;
                if leader.is_some() && leader != Some(ctx.id) {
                    return leader;
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        })
        .await
        .ok()
        .flatten()
        .ok_or_else(|| {
            ApiError::Unavailable(format!(
                "node {target} did not take over within {timeout:?}"
            ))
        })
    }
    .await;
    ctx.raft.runtime_config().heartbeat(true);
    result
}

/// How long a membership change waits for an earlier one to commit before
/// it reports the cluster busy.
const MEMBERSHIP_BUSY_WAIT: Duration = Duration::from_secs(10);

type MembershipResult = std::result::Result<
    openraft::raft::ClientWriteResponse<crate::raft::TypeConfig>,
    openraft::error::RaftError<u64, openraft::error::ClientWriteError<u64, openraft::BasicNode>>,
>;

/// Runs a membership change, and when openraft refuses it because an
/// earlier change has not committed yet (the second, uniform step of a
/// joint change is still in flight), waits for that change to be applied
/// and tries again: an operator's "add this learner" should not fail
/// because the previous command's last entry is a few milliseconds from
/// commit. Other errors, and a change still pending after
/// [`MEMBERSHIP_BUSY_WAIT`], are returned as they are.
async fn change_when_settled<F, Fut>(ctx: &Ctx, change: F) -> MembershipResult
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = MembershipResult>,
{
    let give_up = tokio::time::Instant::now() + MEMBERSHIP_BUSY_WAIT;
    loop {
        let result = change().await;
        let pending = match &result {
            Err(openraft::error::RaftError::APIError(
                openraft::error::ClientWriteError::ChangeMembershipError(
                    openraft::error::ChangeMembershipError::InProgress(busy),
                ),
            )) => busy.membership_log_id,
            _ => return result,
        };
        let remaining = give_up.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return result;
        }
        let index = pending.map_or(0, |id| id.index);
        tracing::info!(
            index,
            "a membership change is committing; waiting to apply it"
        );
        let mut rx = ctx.raft.metrics();
        let applied = tokio::time::timeout(
            remaining,
            rx.wait_for(|m| m.last_applied.as_ref().is_some_and(|a| a.index >= index)),
        )
        .await;
        if !matches!(applied, Ok(Ok(_))) {
            return result;
        }
    }
}

impl ClusterApi {
    /// Records an administrative action, with who asked, in the history
    /// before it is carried out: an action that cannot be recorded (this
    /// replica is not the leader, no quorum) is not carried out either.
    async fn audit(&self, caller: &Caller, action: &str, detail: String) -> Result<()> {
        let command = Command::Audit(Audit {
            identity: caller.identity.clone(),
            action: action.to_string(),
            detail,
        });
        self.ctx.write(None, command).await.map(|_| ())
    }

    async fn do_add_learner(&self, req: pb::AddLearnerRequest) -> Result<pb::AddLearnerResponse> {
        if req.node_id == 0 {
            return Err(ApiError::InvalidArgument(
                "node id 0 is reserved; ids start at 1".into(),
            ));
        }
        if req.addr.trim().is_empty() {
            return Err(ApiError::InvalidArgument(
                "the learner's address is required".into(),
            ));
        }
        let node = BasicNode {
            addr: req.addr.clone(),
        };
        let response = change_when_settled(&self.ctx, || {
            self.ctx
                .raft
                .add_learner(req.node_id, node.clone(), req.blocking)
        })
        .await
        .map_err(from_raft_error)?;
        tracing::info!(node_id = req.node_id, addr = req.addr, "learner added");
        Ok(pb::AddLearnerResponse {
            log_index: response.log_id.index,
        })
    }

    async fn do_change_membership(
        &self,
        req: pb::ChangeMembershipRequest,
    ) -> Result<pb::ChangeMembershipResponse> {
        if !req.remove_learners.is_empty() {
            if !req.voters.is_empty() {
                return Err(ApiError::InvalidArgument(
                    "give either voters or learners to remove, not both".into(),
                ));
            }
            let metrics = self.ctx.raft.metrics().borrow().clone();
            let membership = metrics.membership_config.membership();
            if let Some(voter) = req
                .remove_learners
                .iter()
                .find(|id| membership.voter_ids().any(|v| v == **id))
            {
                return Err(ApiError::FailedPrecondition(format!(
                    "node {voter} is a voter; remove it by leaving it out of the voters"
                )));
            }
            let remove: BTreeSet<u64> = req.remove_learners.iter().copied().collect();
            let response = change_when_settled(&self.ctx, || {
                self.ctx
                    .raft
                    .change_membership(openraft::ChangeMembers::RemoveNodes(remove.clone()), false)
            })
            .await
            .map_err(from_raft_error)?;
            tracing::info!(?remove, "learners removed");
            return Ok(pb::ChangeMembershipResponse {
                log_index: response.log_id.index,
            });
        }
        if req.voters.is_empty() {
            return Err(ApiError::InvalidArgument(
                "the voter set cannot be empty".into(),
            ));
        }
        let voters: BTreeSet<u64> = req.voters.iter().copied().collect();
        let response = change_when_settled(&self.ctx, || {
            self.ctx
                .raft
                .change_membership(voters.clone(), req.retain_as_learners)
        })
        .await
        .map_err(from_raft_error)?;
        tracing::info!(?voters, "membership changed");
        Ok(pb::ChangeMembershipResponse {
            log_index: response.log_id.index,
        })
    }

    /// A fresh snapshot (leader only, so it holds everything committed), in
    /// 1 MiB chunks.
    async fn do_export(&self) -> Result<Vec<pb::SnapshotChunk>> {
        require_leader(&self.ctx)?;
        self.do_snapshot().await?;
        let db = self.ctx.db()?;
        let (index, data) = crate::store::state_machine::stored_snapshot(&db)
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .ok_or_else(|| ApiError::Unavailable("no snapshot was stored; retry".into()))?;
        let total = data.len() as u64;
        Ok(data
            .chunks(1 << 20)
            .map(|piece| pb::SnapshotChunk {
                data: piece.to_vec(),
                snapshot_index: index,
                total_bytes: total,
            })
            .collect())
    }

    async fn do_snapshot(&self) -> Result<pb::SnapshotResponse> {
        let applied = self
            .ctx
            .raft
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index);
        self.ctx
            .raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| ApiError::Unavailable(format!("this replica has stopped: {e}")))?;
        let snapshot = self
            .ctx
            .raft
            .wait(Some(Duration::from_secs(60)))
            .metrics(
                |m| m.snapshot.map_or(0, |l| l.index) >= applied,
                "snapshot built",
            )
            .await
            .map_err(|e| ApiError::Unavailable(format!("snapshot not built: {e}")))?;
        Ok(pb::SnapshotResponse {
            snapshot_index: snapshot.snapshot.map_or(0, |l| l.index),
        })
    }
}

#[tonic::async_trait]
impl ClusterService for ClusterApi {
    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let result = self
            .ctx
            .auth
            .check(&request, Action::ClusterStatus)
            .map(|_| status(&self.ctx));
        self.ctx.finish("Status", result).map(Response::new)
    }

    async fn add_learner(
        &self,
        request: Request<pb::AddLearnerRequest>,
    ) -> Result<Response<pb::AddLearnerResponse>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ClusterAdmin) {
            Ok(caller) => {
                let req = request.into_inner();
                let detail = format!("node {} at {}", req.node_id, req.addr);
                match self.audit(&caller, "AddLearner", detail).await {
                    Ok(()) => self.do_add_learner(req).await,
                    Err(err) => Err(err),
                }
            }
            Err(err) => Err(err),
        };
        self.ctx.finish("AddLearner", result).map(Response::new)
    }

    async fn change_membership(
        &self,
        request: Request<pb::ChangeMembershipRequest>,
    ) -> Result<Response<pb::ChangeMembershipResponse>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ClusterAdmin) {
            Ok(caller) => {
                let req = request.into_inner();
                let detail = if req.remove_learners.is_empty() {
                    format!("voters {:?}", req.voters)
                } else {
                    format!("remove learners {:?}", req.remove_learners)
                };
                match self.audit(&caller, "ChangeMembership", detail).await {
                    Ok(()) => self.do_change_membership(req).await,
                    Err(err) => Err(err),
                }
            }
            Err(err) => Err(err),
        };
        self.ctx
            .finish("ChangeMembership", result)
            .map(Response::new)
    }

    async fn transfer_leader(
        &self,
        request: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ClusterAdmin) {
            Ok(caller) => {
                let target = request.into_inner().target_node_id;
                match self
                    .audit(&caller, "TransferLeader", format!("to node {target}"))
                    .await
                {
                    Ok(()) => transfer_leader(&self.ctx, target)
                        .await
                        .map(|leader_id| pb::TransferLeaderResponse { leader_id }),
                    Err(err) => Err(err),
                }
            }
            Err(err) => Err(err),
        };
        self.ctx.finish("TransferLeader", result).map(Response::new)
    }

    async fn snapshot(
        &self,
        request: Request<pb::SnapshotRequest>,
    ) -> Result<Response<pb::SnapshotResponse>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ClusterAdmin) {
            Ok(_) => self.do_snapshot().await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Snapshot", result).map(Response::new)
    }

    type ExportSnapshotStream =
        tokio_stream::Iter<std::vec::IntoIter<Result<pb::SnapshotChunk, Status>>>;

    async fn export_snapshot(
        &self,
        request: Request<pb::ExportSnapshotRequest>,
    ) -> Result<Response<Self::ExportSnapshotStream>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ClusterAdmin) {
            Ok(caller) => match self.audit(&caller, "ExportSnapshot", String::new()).await {
                Ok(()) => self.do_export().await,
                Err(err) => Err(err),
            },
            Err(err) => Err(err),
        };
        let chunks = self.ctx.finish("ExportSnapshot", result)?;
        Ok(Response::new(tokio_stream::iter(
            chunks.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }
}
