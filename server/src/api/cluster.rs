//! `ClusterService`: status, membership changes, leader transfer, snapshots.

use crate::auth::{Action, Caller};
use crate::sm::Command;
use crate::sm::command::Audit;
use std::collections::BTreeSet;
use std::sync::Arc;

use tether_proto as pb;
use tether_proto::cluster_service_server::ClusterService;
use tonic::{Request, Response, Status};

use super::Ctx;
use crate::error::{ApiError, Result};

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

/// This replica's view of the cluster.
pub fn status(ctx: &Ctx) -> pb::StatusResponse {
    let view = ctx.core.view();
    let members = view
        .members
        .iter()
        .map(|m| pb::Member {
            node_id: m.id,
            addr: m.addr.clone(),
            voter: m.voter,
            matched_index: m.matched_index,
        })
        .collect();
    pb::StatusResponse {
        node_id: ctx.core.id,
        addr: ctx.core.addr.clone(),
        role: view.role.name().to_string(),
        leader_id: view.leader_id.unwrap_or(0),
        leader_addr: view.leader_addr.unwrap_or_default(),
        term: view.term,
        last_log_index: view.last_log_index.unwrap_or(0),
        applied_index: view.applied_index,
        snapshot_index: view.snapshot_index.unwrap_or(0),
        members,
        lock_count: ctx.core.state.read().state.locks.len() as u64,
        has_raft_state: view.has_raft_state,
        cluster_id: ctx.core.cluster_id.get().unwrap_or_default(),
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
        self.ctx.core.write(None, command).await.map(|_| ())
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
        let log_index = self
            .ctx
            .core
            .add_learner(req.node_id, &req.addr, req.blocking)
            .await?;
        tracing::info!(node_id = req.node_id, addr = req.addr, "learner added");
        Ok(pb::AddLearnerResponse { log_index })
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
            let view = self.ctx.core.view();
            if let Some(voter) = req.remove_learners.iter().find(|id| view.is_voter(**id)) {
                return Err(ApiError::FailedPrecondition(format!(
                    "node {voter} is a voter; remove it by leaving it out of the voters"
                )));
            }
            let remove: BTreeSet<u64> = req.remove_learners.iter().copied().collect();
            let log_index = self.ctx.core.remove_learners(&remove).await?;
            tracing::info!(?remove, "learners removed");
            return Ok(pb::ChangeMembershipResponse { log_index });
        }
        if req.voters.is_empty() {
            return Err(ApiError::InvalidArgument(
                "the voter set cannot be empty".into(),
            ));
        }
        let voters: BTreeSet<u64> = req.voters.iter().copied().collect();
        let log_index = self
            .ctx
            .core
            .change_voters(&voters, req.retain_as_learners)
            .await?;
        tracing::info!(?voters, "membership changed");
        Ok(pb::ChangeMembershipResponse { log_index })
    }

    /// A fresh snapshot (leader only, so it holds everything committed), in
    /// 1 MiB chunks.
    async fn do_export(&self) -> Result<Vec<pb::SnapshotChunk>> {
        self.ctx.core.require_leader()?;
        self.do_snapshot().await?;
        let (index, data) = self
            .ctx
            .core
            .stored_snapshot()?
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
        let snapshot_index = self.ctx.core.snapshot().await?;
        Ok(pb::SnapshotResponse { snapshot_index })
    }
}

#[tonic::async_trait]
impl ClusterService for ClusterApi {
    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let allow = Some(Action::ClusterStatus);
        self.ctx
            .serve("Status", request, allow, |_, _| async move {
                Ok(status(&self.ctx))
            })
            .await
    }

    async fn add_learner(
        &self,
        request: Request<pb::AddLearnerRequest>,
    ) -> Result<Response<pb::AddLearnerResponse>, Status> {
        let allow = Some(Action::ClusterAdmin);
        self.ctx
            .serve("AddLearner", request, allow, |caller, req| async move {
                let detail = format!("node {} at {}", req.node_id, req.addr);
                self.audit(&caller, "AddLearner", detail).await?;
                self.do_add_learner(req).await
            })
            .await
    }

    async fn change_membership(
        &self,
        request: Request<pb::ChangeMembershipRequest>,
    ) -> Result<Response<pb::ChangeMembershipResponse>, Status> {
        let allow = Some(Action::ClusterAdmin);
        self.ctx
            .serve(
                "ChangeMembership",
                request,
                allow,
                |caller, req| async move {
                    let detail = if req.remove_learners.is_empty() {
                        format!("voters {:?}", req.voters)
                    } else {
                        format!("remove learners {:?}", req.remove_learners)
                    };
                    self.audit(&caller, "ChangeMembership", detail).await?;
                    self.do_change_membership(req).await
                },
            )
            .await
    }

    async fn transfer_leader(
        &self,
        request: Request<pb::TransferLeaderRequest>,
    ) -> Result<Response<pb::TransferLeaderResponse>, Status> {
        let allow = Some(Action::ClusterAdmin);
        self.ctx
            .serve("TransferLeader", request, allow, |caller, req| async move {
                let target = req.target_node_id;
                self.audit(&caller, "TransferLeader", format!("to node {target}"))
                    .await?;
                let leader_id = self.ctx.core.transfer_leader(target).await?;
                Ok(pb::TransferLeaderResponse { leader_id })
            })
            .await
    }

    async fn snapshot(
        &self,
        request: Request<pb::SnapshotRequest>,
    ) -> Result<Response<pb::SnapshotResponse>, Status> {
        self.ctx
            .serve(
                "Snapshot",
                request,
                Some(Action::ClusterAdmin),
                |_, _| async move { self.do_snapshot().await },
            )
            .await
    }

    type ExportSnapshotStream =
        tokio_stream::Iter<std::vec::IntoIter<Result<pb::SnapshotChunk, Status>>>;

    async fn export_snapshot(
        &self,
        request: Request<pb::ExportSnapshotRequest>,
    ) -> Result<Response<Self::ExportSnapshotStream>, Status> {
        let allow = Some(Action::ClusterAdmin);
        let chunks = self
            .ctx
            .serve("ExportSnapshot", request, allow, |caller, _| async move {
                self.audit(&caller, "ExportSnapshot", String::new()).await?;
                self.do_export().await
            })
            .await?
            .into_inner();
        Ok(Response::new(tokio_stream::iter(
            chunks.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }
}
