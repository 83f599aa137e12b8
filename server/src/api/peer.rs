//! Calls one replica makes to another beside Raft's own messages: a leader
//! transfer's `TimeoutNow` to its target, a follower's `EndWait` to the
//! leader. They are dialed as Raft messages are (`--peer-dial`, the
//! replicas' TLS) and carry what every Raft message carries (the target's
//! id, the cluster id, the replica token of a cluster run with
//! `--auth-tokens`), so a receiver that checks Raft messages accepts them.
//! Before this module each call dialed on its own, and a leader transfer
//! sent neither token nor TLS: on a cluster with tokens every transfer was
//! refused "no bearer token".

use std::time::Duration;

use tether_proto::RaftRequest;
use tether_proto::raft_service_client::RaftServiceClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use super::Ctx;
use crate::error::ApiError;

/// Marks `request` as a message to replica `target` from a replica of
/// cluster `cluster_id` (when known), with `authorization` (when the
/// cluster runs with tokens). The receiver's checks are
/// `api::raft::RaftApi::check_target` and `check_cluster`.
pub fn mark<T>(
    request: &mut tonic::Request<T>,
    target: u64,
    authorization: Option<&MetadataValue<Ascii>>,
    cluster_id: Option<&str>,
) {
    let metadata = request.metadata_mut();
    if let Ok(target) = target.to_string().parse() {
        metadata.insert(super::raft::TARGET_METADATA, target);
    }
    if let Some(authorization) = authorization {
        metadata.insert(crate::auth::AUTHORIZATION, authorization.clone());
    }
    if let Some(Ok(value)) = cluster_id.map(str::parse) {
        metadata.insert(crate::cluster_id::METADATA, value);
    }
}

/// A Raft-service client of replica `target`, whose membership address is
/// `addr`: connected lazily, each call bounded by `timeout`. `Err` is an
/// address that cannot be dialed.
pub fn client(
    ctx: &Ctx,
    target: u64,
    addr: &str,
    timeout: Duration,
) -> Result<RaftServiceClient<Channel>, ApiError> {
    let dial = ctx
        .config
        .peer_dial
        .get(&target)
        .map_or(addr, String::as_str);
    let endpoint = Endpoint::from_shared(format!("http://{dial}"))
        .map_err(|e| ApiError::Unavailable(format!("cannot dial node {target} at {dial}: {e}")))?
        .connect_timeout(Duration::from_secs(1))
        .timeout(timeout);
    let channel = match &ctx.tls {
        Some(tls) => tether_tls::lazy_channel(endpoint, tls.clone(), Duration::from_secs(1)),
        None => endpoint.connect_lazy(),
    };
    Ok(RaftServiceClient::new(channel))
}

/// `data` as a message of this replica to replica `target` ([`mark`]ed).
pub fn request(ctx: &Ctx, target: u64, data: Vec<u8>) -> tonic::Request<RaftRequest> {
    let mut request = tonic::Request::new(RaftRequest { data });
    mark(
        &mut request,
        target,
        ctx.auth.peer_authorization().as_ref(),
        ctx.cluster_id.get().as_deref(),
    );
    request
}
