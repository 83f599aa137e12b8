//! `NodeService`: node reports (from the bridge) and the registry listing.

use crate::auth::{Action, Caller};
use std::sync::Arc;

use tether_proto as pb;
use tether_proto::node_service_server::NodeService;
use tonic::{Request, Response, Status};

use super::convert::node_to;
use super::{Ctx, unexpected, validate};
use crate::error::{ApiError, Result};
use crate::sm::command::ReportNode;
use crate::sm::{Command, NodeState, Reply};

/// The `NodeService` implementation.
pub struct NodeApi {
    ctx: Arc<Ctx>,
}

impl NodeApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }

    async fn do_report(
        &self,
        caller: &Caller,
        req: pb::ReportNodeRequest,
    ) -> Result<pb::ReportNodeResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        validate::dns1123_subdomain("node name", &req.name)?;
        validate::text("node uid", &req.uid, false)?;
        let state = match pb::NodeState::try_from(req.state) {
            Ok(pb::NodeState::NodeJoined) => NodeState::Joined,
            Ok(pb::NodeState::NodeReady) => NodeState::Ready,
            Ok(pb::NodeState::NodeNotReady) => NodeState::NotReady,
            Ok(pb::NodeState::NodeGone) => NodeState::Gone,
            _ => {
                return Err(ApiError::InvalidArgument(
                    "node state must be one of NODE_JOINED, NODE_READY, NODE_NOT_READY, NODE_GONE"
                        .into(),
                ));
            }
        };
        let labels = if req.set_labels {
            Some(validate::labels(
                "node label",
                &req.labels,
                self.ctx.core.config.max_labels,
            )?)
        } else if !req.labels.is_empty() {
            return Err(ApiError::InvalidArgument(
                "labels were given but set_labels is false: set it to replace the node's labels, \
                 or send no labels to keep them"
                    .into(),
            ));
        } else {
            None
        };
        let command = Command::ReportNode(ReportNode {
            name: req.name.clone(),
            uid: req.uid,
            state,
            labels,
            unschedulable: req.unschedulable,
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::NodeReported {
                changed,
                pins_released,
                locks_released,
            } => {
                if changed {
                    tracing::info!(
                        node = req.name,
                        ?state,
                        pins_released,
                        locks_released,
                        "node reported"
                    );
                }
                Ok(pb::ReportNodeResponse {
                    changed,
                    pins_released,
                    locks_released,
                    header: Some(self.ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    fn do_list(&self, req: pb::ListNodesRequest) -> pb::ListNodesResponse {
        let applied = self.ctx.core.state.read();
        let nodes = applied
            .state
            .nodes
            .iter()
            .filter(|(_, n)| req.include_gone || n.gone_at_ms.is_none())
            .map(|(name, n)| node_to(name, n))
            .collect();
        pb::ListNodesResponse {
            nodes,
            header: Some(self.ctx.header(false)),
        }
    }
}

#[tonic::async_trait]
impl NodeService for NodeApi {
    async fn report(
        &self,
        request: Request<pb::ReportNodeRequest>,
    ) -> Result<Response<pb::ReportNodeResponse>, Status> {
        self.ctx
            .serve(
                "ReportNode",
                request,
                Some(Action::Report),
                |caller, req| async move { self.do_report(&caller, req).await },
            )
            .await
    }

    async fn list(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let result = self
            .ctx
            .auth
            .check(&request, Action::ReadNodes)
            .map(|_| self.do_list(request.into_inner()));
        self.ctx.finish("ListNodes", result).map(Response::new)
    }
}
