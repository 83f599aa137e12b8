//! The internal `RaftService`: hands replica-to-replica messages to openraft.

use crate::auth::Action;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tether_proto::raft_service_server::RaftService;
use tether_proto::{RaftReply, RaftRequest};
use tonic::{Request, Response, Status};

use super::Ctx;
use crate::sm::FORMAT_VERSION;
use crate::store::{decode, encode};

/// The `RaftService` implementation.
pub struct RaftApi {
    ctx: Arc<Ctx>,
}

impl RaftApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }
}

/// Metadata naming the replica a Raft message is meant for.
pub const TARGET_METADATA: &str = "x-tether-target-node";

/// Response metadata: the newest log format this replica reads
/// ([`FORMAT_VERSION`]), so that a leader writes entries of a new format
/// only once every member can read them.
pub const FORMAT_METADATA: &str = "x-tether-format";

impl RaftApi {
    /// Refuses a message meant for another node id. Raft messages do not
    /// name their target, so a replica that took over an address (a pod
    /// back with an empty volume and a new id) would otherwise answer for
    /// the member that used to live there, and the leader would see that
    /// member's log go backwards.
    fn check_target(&self, request: &Request<RaftRequest>) -> Result<(), Status> {
        self.ctx
            .auth
            .check(request, Action::Raft)
            .map_err(Status::from)?;
        let Some(target) = request.metadata().get(TARGET_METADATA) else {
            return Ok(());
        };
        match target.to_str().ok().and_then(|t| t.parse::<u64>().ok()) {
            Some(id) if id == self.ctx.id => Ok(()),
            _ => Err(Status::unavailable(format!(
                "this address now serves node {}, not node {target:?}",
                self.ctx.id
            ))),
        }
    }
}

fn decode_request<T: DeserializeOwned>(request: Request<RaftRequest>) -> Result<T, Status> {
    decode(&request.into_inner().data)
        .map_err(|e| Status::invalid_argument(format!("undecodable Raft message: {e}")))
}

fn reply<T: Serialize, E: Serialize>(result: Result<T, E>) -> Result<Response<RaftReply>, Status> {
    let mut response = Response::new(match result {
        Ok(value) => RaftReply {
            data: encode(&value),
            error: Vec::new(),
        },
        Err(err) => RaftReply {
            data: Vec::new(),
            error: encode(&err),
        },
    });
    response
        .metadata_mut()
        .insert(FORMAT_METADATA, FORMAT_VERSION.into());
    Ok(response)
}

#[tonic::async_trait]
impl RaftService for RaftApi {
    async fn append_entries(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        let rpc = decode_request(request)?;
        reply(self.ctx.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<RaftRequest>) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        let rpc = decode_request(request)?;
        reply(self.ctx.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        let rpc = decode_request(request)?;
        reply(self.ctx.raft.install_snapshot(rpc).await)
    }

    async fn timeout_now(
        &self,
        request: Request<RaftRequest>,
    ) -> Result<Response<RaftReply>, Status> {
        self.check_target(&request)?;
        tracing::info!("leader transfer: starting an election at the leader's request");
        let result = self
            .ctx
            .raft
            .trigger()
            .elect()
            .await
            .map_err(|e| e.to_string());
        reply(result)
    }
}
