//! `ClusterService`: status, membership changes, leader transfer, snapshots.

use crate::auth::{Action, Caller};
use crate::sm::Command;
use crate::sm::command::Audit;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tether_proto as pb;
use tether_proto::cluster_service_server::ClusterService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::{Ctx, Sent, send_or_cut};
use crate::error::{ApiError, Result};

/// Bytes of the snapshot in one `SnapshotChunk`.
const EXPORT_CHUNK: usize = 1 << 20;

/// An export reader that does not take a chunk within this long is cut, as
/// a slow watcher is: what it holds (the snapshot) is let go.
const SLOW_EXPORT_READER_TIMEOUT: Duration = Duration::from_secs(30);

/// Chunks in flight to one export reader beyond the one being sent.
const EXPORT_CHUNKS_BUFFERED: usize = 2;

/// Sends `data` (the snapshot at `index`) in chunks of `chunk` bytes as the
/// reader takes them: a chunk is copied out only when the one before it
/// has gone into the stream's small buffer, so an export holds the snapshot
/// once and a few chunks, not the snapshot twice (issue 53). A reader that
/// takes nothing for `timeout` gets an error saying so and the stream ends,
/// letting the snapshot go.
pub fn stream_snapshot(
    index: u64,
    data: Vec<u8>,
    chunk: usize,
    timeout: Duration,
) -> ReceiverStream<std::result::Result<pb::SnapshotChunk, Status>> {
    // One slot more than the chunks buffered, for the error (send_or_cut).
    let (tx, rx) = mpsc::channel(EXPORT_CHUNKS_BUFFERED + 1);
    tokio::spawn(async move {
        let total = data.len() as u64;
        for piece in data.chunks(chunk.max(1)) {
            let chunk = pb::SnapshotChunk {
                data: piece.to_vec(),
                snapshot_index: index,
                total_bytes: total,
            };
            let too_slow = || {
                ApiError::TooLarge(format!(
                    "snapshot export reader too slow: it did not read for {timeout:?}; export \
                     again"
                ))
            };
            if send_or_cut(&tx, chunk, timeout, too_slow).await != Sent::Sent {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

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
    /// A fresh snapshot's index and data (one RocksDB value, read once).
    async fn do_export(&self) -> Result<(u64, Vec<u8>)> {
        self.ctx.core.require_leader()?;
        self.do_snapshot().await?;
        self.ctx
            .core
            .stored_snapshot()?
            .ok_or_else(|| ApiError::Unavailable("no snapshot was stored; retry".into()))
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

    type ExportSnapshotStream = ReceiverStream<Result<pb::SnapshotChunk, Status>>;

    async fn export_snapshot(
        &self,
        request: Request<pb::ExportSnapshotRequest>,
    ) -> Result<Response<Self::ExportSnapshotStream>, Status> {
        let allow = Some(Action::ClusterAdmin);
        let (index, data) = self
            .ctx
            .serve("ExportSnapshot", request, allow, |caller, _| async move {
                self.audit(&caller, "ExportSnapshot", String::new()).await?;
                self.do_export().await
            })
            .await?
            .into_inner();
        Ok(Response::new(stream_snapshot(
            index,
            data,
            EXPORT_CHUNK,
            SLOW_EXPORT_READER_TIMEOUT,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt as _;

    /// The chunks come in order and add up to the snapshot.
    #[tokio::test]
    async fn an_export_streams_the_snapshot_in_chunks() {
        let data: Vec<u8> = (0..10u8).collect();
        let chunks: Vec<_> = stream_snapshot(7, data.clone(), 4, Duration::from_secs(30))
            .collect()
            .await;
        let chunks: Vec<pb::SnapshotChunk> = chunks.into_iter().map(Result::unwrap).collect();
        assert_eq!(chunks.len(), 3);
        assert!(
            chunks
                .iter()
                .all(|c| c.snapshot_index == 7 && c.total_bytes == 10)
        );
        let joined: Vec<u8> = chunks.into_iter().flat_map(|c| c.data).collect();
        assert_eq!(joined, data);
    }

    /// A reader that stops reading is cut after the timeout: what was
    /// buffered, then an error that says why, then the end; the rest of
    /// the snapshot is never copied out.
    #[tokio::test]
    async fn a_stalled_export_reader_is_cut() {
        let mut stream = stream_snapshot(1, vec![0; 100], 10, Duration::from_millis(100));
        assert!(stream.next().await.unwrap().is_ok());
        // Stop reading until the exporter has given up (its sender gone).
        let mut rx = stream.into_inner();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !rx.is_closed() {
            assert!(tokio::time::Instant::now() < deadline, "never cut");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut rest = Vec::new();
        while let Some(item) = rx.recv().await {
            rest.push(item);
        }
        let oks = rest.iter().filter(|r| r.is_ok()).count();
        assert!(
            oks <= EXPORT_CHUNKS_BUFFERED,
            "{oks} chunks after the stall"
        );
        let err = rest.last().unwrap().as_ref().unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("too slow"), "{}", err.message());
    }
}
