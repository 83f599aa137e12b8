//! `LeaseService`: pod revokes and TTL leases.

use crate::auth::{Action, Caller};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tether_proto as pb;
use tether_proto::lease_service_server::LeaseService;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::convert::{granted_to, key_to};
use super::{Ctx, unexpected, validate};
use crate::error::{ApiError, Result};
use crate::sm::command::{GrantLease, KeepAliveLease, ReportPod, RevokeLease, RevokePod};
use crate::sm::{Command, LockKey, PodPhase, Reply};

/// The `LeaseService` implementation.
pub struct LeaseApi {
    ctx: Arc<Ctx>,
}

impl LeaseApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }
}

fn keys_to(keys: &[LockKey]) -> Vec<pb::LockKey> {
    keys.iter().map(key_to).collect()
}

async fn keep_alive(ctx: &Ctx, lease_id: u64) -> Result<pb::LeaseKeepAliveResponse> {
    match ctx
        .core
        .write(None, Command::KeepAliveLease(KeepAliveLease { lease_id }))
        .await?
    {
        Reply::Lease { lease_id, ttl_ms } => Ok(pb::LeaseKeepAliveResponse { lease_id, ttl_ms }),
        other => Err(unexpected(other)),
    }
}

impl LeaseApi {
    async fn do_revoke_pod(
        &self,
        caller: &Caller,
        req: pb::RevokePodRequest,
    ) -> Result<pb::RevokePodResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        validate::pod_uid(&req.pod_uid)?;
        validate::text("reason", &req.reason, false)?;
        let reason = if req.reason.is_empty() {
            "revoked".to_string()
        } else {
            req.reason
        };
        let command = Command::RevokePod(RevokePod {
            pod_uid: req.pod_uid.clone(),
            reason,
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::Revoked {
                released,
                dequeued,
                granted,
            } => {
                tracing::info!(
                    pod_uid = req.pod_uid,
                    released = released.len(),
                    dequeued = dequeued.len(),
                    "pod revoked"
                );
                Ok(pb::RevokePodResponse {
                    released: keys_to(&released),
                    dequeued: keys_to(&dequeued),
                    granted: granted_to(&granted),
                    header: Some(self.ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    async fn do_grant(
        &self,
        caller: &Caller,
        req: pb::LeaseGrantRequest,
    ) -> Result<pb::LeaseGrantResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let min = self.ctx.core.config.min_lease_ttl().as_millis() as u64;
        if req.ttl_ms < min {
            return Err(ApiError::InvalidArgument(format!(
                "lease TTL of {} ms is below the minimum of {min} ms (3 x the election timeout), \
                 which keeps leases alive through a leader election",
                req.ttl_ms
            )));
        }
        match self
            .ctx
            .core
            .write(
                request_id,
                Command::GrantLease(GrantLease { ttl_ms: req.ttl_ms }),
            )
            .await?
        {
            Reply::Lease { lease_id, ttl_ms } => Ok(pb::LeaseGrantResponse {
                lease_id,
                ttl_ms,
                header: Some(self.ctx.header(false)),
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn do_report_pod(
        &self,
        caller: &Caller,
        req: pb::ReportPodRequest,
    ) -> Result<pb::ReportPodResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        validate::pod_uid(&req.pod_uid)?;
        let phase = match pb::PodPhase::try_from(req.phase) {
            Ok(pb::PodPhase::PodStarting) => PodPhase::Starting,
            Ok(pb::PodPhase::PodRunning) => PodPhase::Running,
            Ok(pb::PodPhase::PodTerminal) => PodPhase::Terminal,
            Ok(pb::PodPhase::PodGone) => PodPhase::Gone,
            _ => {
                return Err(ApiError::InvalidArgument(
                    "pod phase must be one of POD_STARTING, POD_RUNNING, POD_TERMINAL, POD_GONE"
                        .into(),
                ));
            }
        };
        let command = Command::ReportPod(ReportPod {
            pod_uid: req.pod_uid.clone(),
            phase,
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::Revoked {
                released,
                dequeued,
                granted,
            } => {
                tracing::debug!(
                    pod_uid = req.pod_uid,
                    ?phase,
                    released = released.len(),
                    "pod reported"
                );
                Ok(pb::ReportPodResponse {
                    released: keys_to(&released),
                    dequeued: keys_to(&dequeued),
                    granted: granted_to(&granted),
                    header: Some(self.ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }

    async fn do_revoke(
        &self,
        caller: &Caller,
        req: pb::LeaseRevokeRequest,
    ) -> Result<pb::LeaseRevokeResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let command = Command::RevokeLease(RevokeLease {
            lease_id: req.lease_id,
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::Revoked {
                released,
                dequeued,
                granted,
            } => Ok(pb::LeaseRevokeResponse {
                released: keys_to(&released),
                dequeued: keys_to(&dequeued),
                granted: granted_to(&granted),
                header: Some(self.ctx.header(false)),
            }),
            other => Err(unexpected(other)),
        }
    }
}

impl LeaseApi {
    /// One keep-alive as a unary call: what the HTTP/JSON API serves as
    /// `LeaseService.KeepAlive` (HTTP has no stream from the client; a
    /// caller sends one request per renewal instead).
    pub async fn keep_alive_once(
        &self,
        request: Request<pb::LeaseKeepAliveRequest>,
    ) -> Result<Response<pb::LeaseKeepAliveResponse>, Status> {
        self.ctx
            .serve(
                "LeaseKeepAlive",
                request,
                Some(Action::Leases),
                |_, req| async move { keep_alive(&self.ctx, req.lease_id).await },
            )
            .await
    }
}

type KeepAliveStream =
    Pin<Box<dyn Stream<Item = std::result::Result<pb::LeaseKeepAliveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl LeaseService for LeaseApi {
    type KeepAliveStream = KeepAliveStream;

    async fn revoke_pod(
        &self,
        request: Request<pb::RevokePodRequest>,
    ) -> Result<Response<pb::RevokePodResponse>, Status> {
        self.ctx
            .serve(
                "RevokePod",
                request,
                Some(Action::RevokePod),
                |caller, req| async move { self.do_revoke_pod(&caller, req).await },
            )
            .await
    }

    async fn grant(
        &self,
        request: Request<pb::LeaseGrantRequest>,
    ) -> Result<Response<pb::LeaseGrantResponse>, Status> {
        self.ctx
            .serve(
                "LeaseGrant",
                request,
                Some(Action::Leases),
                |caller, req| async move { self.do_grant(&caller, req).await },
            )
            .await
    }

    async fn keep_alive(
        &self,
        request: Request<Streaming<pb::LeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        if let Err(err) = self.ctx.auth.check(&request, Action::Leases) {
            return Err(self
                .ctx
                .finish::<()>("LeaseKeepAlive", Err(err))
                .unwrap_err());
        }
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let ctx = self.ctx.clone();
        tokio::spawn(async move {
            while let Some(item) = incoming.next().await {
                let reply = match item {
                    Ok(req) => keep_alive(&ctx, req.lease_id).await,
                    Err(_) => return, // the caller went away
                };
                let failed = reply.is_err();
                let reply = ctx.finish("LeaseKeepAlive", reply);
                if tx.send(reply).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report_pod(
        &self,
        request: Request<pb::ReportPodRequest>,
    ) -> Result<Response<pb::ReportPodResponse>, Status> {
        self.ctx
            .serve(
                "ReportPod",
                request,
                Some(Action::Report),
                |caller, req| async move { self.do_report_pod(&caller, req).await },
            )
            .await
    }

    async fn revoke(
        &self,
        request: Request<pb::LeaseRevokeRequest>,
    ) -> Result<Response<pb::LeaseRevokeResponse>, Status> {
        self.ctx
            .serve(
                "LeaseRevoke",
                request,
                Some(Action::Leases),
                |caller, req| async move { self.do_revoke(&caller, req).await },
            )
            .await
    }
}
