//! `LockService`: acquire (server-streamed grant), release, holder, get, list,
//! force-release.

use crate::auth::{Action, Caller};
use std::sync::Arc;
use std::time::Duration;

use tether_proto as pb;
use tether_proto::lock_service_server::LockService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::convert::{hold_to, key_to, lock_to, outcome_from, pin_to, pod_from};
use super::{Ctx, unexpected, validate};
use crate::error::{ApiError, Result};
use crate::replica::waits::{self, Answered, WaitOutcome};
use crate::sm::command::{
    Acquire, CancelOutcome, ForceRelease, GIVE_BACK_FORMAT_VERSION, NodeTaking, Release, SeenNode,
    TAKEOVER_FORMAT_VERSION, Withdraw, WithdrawOwn,
};
use crate::sm::{Command, Hold, Reply};

/// The `LockService` implementation.
pub struct LockApi {
    ctx: Arc<Ctx>,
}

impl LockApi {
    /// A service over a replica's context.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }
}

type AcquireItem = std::result::Result<pb::AcquireResponse, Status>;

fn granted(ctx: &Ctx, hold: &Hold) -> pb::AcquireResponse {
    pb::AcquireResponse {
        state: pb::acquire_response::State::Granted as i32,
        hold: Some(hold_to(hold)),
        queue_position: 0,
        header: Some(ctx.header(false)),
    }
}

impl LockApi {
    async fn do_acquire(
        &self,
        caller: &Caller,
        req: pb::AcquireRequest,
    ) -> Result<ReceiverStream<AcquireItem>> {
        let ctx = &self.ctx;
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::Acquire(&key))?;
        let pod = req
            .pod
            .as_ref()
            .ok_or_else(|| ApiError::InvalidArgument("missing pod".into()))?;
        validate::pod(pod)?;
        validate::payload(&req.payload, ctx.core.config.max_payload_bytes)?;
        let max_wait = ctx.core.config.max_wait;
        let wait = Duration::from_millis(req.wait_timeout_ms);
        if wait > max_wait {
            return Err(ApiError::InvalidArgument(format!(
                "wait of {} ms is over the maximum of {} ms (tetherd --max-wait)",
                req.wait_timeout_ms,
                max_wait.as_millis()
            )));
        }
        validate::node_uid(&key.name, &req.node_uid)?;
        let seen = vec![SeenNode {
            name: key.name.clone(),
            uid: req.node_uid,
        }];
        let acquire = Acquire {
            key: key.clone(),
            pod: pod_from(pod),
            payload: req.payload,
            wait_ms: req.wait_timeout_ms,
            lease_id: req.lease_id,
            client_id: request_id
                .as_ref()
                .map(|r| r.client_id.clone())
                .unwrap_or_default(),
            queue_limit: ctx.core.config.max_queue_length,
        };
        let command = ctx.taking_for(seen, NodeTaking::Acquire(acquire));
        // Register before proposing so the grant cannot slip between the
        // apply and the registration.
        let ticket = ctx.core.state.register_wait(&key, &pod.uid);
        let (reply, index) = ctx.core.write_at(request_id.clone(), command).await?;
        let (tx, rx) = mpsc::channel(2);
        match reply {
            Reply::Granted(hold) => {
                let _ = tx.send(Ok(granted(ctx, &hold))).await;
            }
            Reply::Queued { position } => {
                let queued = pb::AcquireResponse {
                    state: pb::acquire_response::State::Queued as i32,
                    hold: None,
                    queue_position: position,
                    header: Some(ctx.header(false)),
                };
                let _ = tx.send(Ok(queued)).await;
                let pod_uid = pod.uid.clone();
                let answered = request_id.map(|request_id| Answered { request_id, index });
                let ctx = ctx.clone();
                let queued_at = std::time::Instant::now();
                tokio::spawn(async move {
                    let core = ctx.core.clone();
                    let outcome =
                        waits::follow(core, key, pod_uid, wait, answered, ticket, tx.closed())
                            .await;
                    let won = matches!(outcome, WaitOutcome::Granted(_));
                    match outcome {
                        WaitOutcome::Granted(hold) => {
                            let _ = tx.send(Ok(granted(&ctx, &hold))).await;
                        }
                        WaitOutcome::Ended(err) => {
                            let _ = tx.send(Err(err.into())).await;
                        }
                        WaitOutcome::CallerGone => {}
                    }
                    ctx.core.metrics.waited(won, queued_at.elapsed());
                });
            }
            other => return Err(unexpected(other)),
        }
        Ok(ReceiverStream::new(rx))
    }

    async fn do_release(
        &self,
        caller: &Caller,
        req: pb::ReleaseRequest,
    ) -> Result<pb::ReleaseResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::Release(&key))?;
        validate::pod_uid(&req.pod_uid)?;
        let command = Command::Release(Release {
            key,
            pod_uid: req.pod_uid,
            token: req.token,
            outcome: outcome_from(req.outcome),
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::Released { next, .. } => Ok(pb::ReleaseResponse {
                next_holder: next.as_ref().map(hold_to),
                header: Some(self.ctx.header(false)),
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn do_holder(
        &self,
        caller: &Caller,
        req: pb::HolderRequest,
    ) -> Result<pb::HolderResponse> {
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::ReadLock(&key))?;
        let claim_read = !req.claim_set.is_empty();
        if claim_read {
            validate::pin_set(&req.claim_set)?;
            caller.require(Action::ReadPins)?;
        }
        if req.unconfirmed {
            self.ctx.core.leading()?;
        } else {
            self.ctx.core.linearizable().await?;
        }
        let (hold, claim) = {
            let applied = self.ctx.core.state.read();
            let holder = applied
                .state
                .locks
                .get(&key)
                .and_then(|l| l.holder.as_ref());
            // The holder's pin from the same state: the claim the hold was
            // granted with, as no pair of reads could give it.
            let claim = holder.filter(|_| claim_read).and_then(|h| {
                let pin_key = crate::sm::PinKey::new(&req.claim_set, &h.pod.uid);
                applied
                    .state
                    .pins
                    .get(&pin_key)
                    .map(|p| pin_to(&pin_key, p))
            });
            (holder.map(hold_to), claim)
        };
        Ok(pb::HolderResponse {
            hold,
            header: Some(self.ctx.header(!req.unconfirmed)),
            claim,
            claim_read,
        })
    }

    async fn do_get(
        &self,
        caller: &Caller,
        req: pb::GetLockRequest,
    ) -> Result<pb::GetLockResponse> {
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::ReadLock(&key))?;
        self.ctx.core.linearizable().await?;
        let lock = {
            let applied = self.ctx.core.state.read();
            match applied.state.locks.get(&key) {
                Some(lock) => lock_to(&key, lock),
                None => pb::LockState {
                    key: Some(key_to(&key)),
                    ..Default::default()
                },
            }
        };
        Ok(pb::GetLockResponse {
            lock: Some(lock),
            header: Some(self.ctx.header(true)),
        })
    }

    fn do_list(&self, req: pb::ListLocksRequest) -> Result<pb::ListLocksResponse> {
        if !req.scope.is_empty() {
            validate::dns1123_label("lock scope", &req.scope)?;
        }
        let locks = {
            let applied = self.ctx.core.state.read();
            applied
                .state
                .locks
                .iter()
                .filter(|(key, _)| req.scope.is_empty() || key.scope == req.scope)
                .map(|(key, lock)| lock_to(key, lock))
                .collect()
        };
        Ok(pb::ListLocksResponse {
            locks,
            header: Some(self.ctx.header(false)),
        })
    }

    async fn do_withdraw(
        &self,
        caller: &Caller,
        req: pb::WithdrawRequest,
    ) -> Result<pb::WithdrawResponse> {
        let ctx = &self.ctx;
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        // Whoever may queue a pod for the lock may take it out again.
        caller.require(Action::Acquire(&key))?;
        validate::pod_uid(&req.pod_uid)?;
        ctx.core.require_format(
            GIVE_BACK_FORMAT_VERSION,
            "withdraw",
            "finish the upgrade, or release the hold by its token",
        )?;
        // Only what this client queued or was granted: never a later
        // attempt's hold of the same pod; unless a member is known to read
        // only formats older than 9 (an upgrade). A member not heard from
        // yet (a new leader's first moments) does not count.
        let command = match &request_id {
            Some(id) if !ctx.core.member_known_older_than(TAKEOVER_FORMAT_VERSION) => {
                Command::WithdrawOwn(WithdrawOwn {
                    key: key.clone(),
                    pod_uid: req.pod_uid.clone(),
                    client_id: id.client_id.clone(),
                })
            }
            _ => Command::Withdraw(Withdraw {
                key: key.clone(),
                pod_uid: req.pod_uid.clone(),
            }),
        };
        use pb::withdraw_response::Result as Withdrawn;
        let (result, given_back, next) = match ctx.core.write(request_id, command).await? {
            Reply::WaitCancelled(CancelOutcome::Removed) => (Withdrawn::WaitEnded, None, None),
            Reply::WaitCancelled(CancelOutcome::GaveBack { hold, next }) => {
                (Withdrawn::HoldGivenBack, Some(hold), next)
            }
            Reply::WaitCancelled(CancelOutcome::NotWaiting) => (Withdrawn::NotInvolved, None, None),
            Reply::WaitCancelled(CancelOutcome::TakenOver) => (Withdrawn::TakenOver, None, None),
            other => return Err(unexpected(other)),
        };
        tracing::debug!(%key, pod_uid = req.pod_uid, ?result, "acquire withdrawn");
        Ok(pb::WithdrawResponse {
            result: result as i32,
            given_back: given_back.as_ref().map(hold_to),
            next_holder: next.as_ref().map(hold_to),
            header: Some(ctx.header(false)),
        })
    }

    async fn do_force_release(
        &self,
        caller: &Caller,
        req: pb::ForceReleaseRequest,
    ) -> Result<pb::ForceReleaseResponse> {
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::ForceRelease(&key))?;
        validate::text("operator", &req.operator, true)?;
        validate::text("reason", &req.reason, true)?;
        // The audit record names who really asked, not only who they say
        // they are.
        let operator = if caller.authenticated() {
            format!("{} [{}]", req.operator, caller.identity)
        } else {
            req.operator.clone()
        };
        let command = Command::ForceRelease(ForceRelease {
            key: key.clone(),
            operator: operator.clone(),
            reason: req.reason.clone(),
        });
        match self.ctx.core.write(request_id, command).await? {
            Reply::Released { released, next } => {
                tracing::warn!(%key, operator, reason = req.reason, released = ?released.as_ref().map(|h| h.token), "lock force-released");
                Ok(pb::ForceReleaseResponse {
                    released: released.as_ref().map(hold_to),
                    next_holder: next.as_ref().map(hold_to),
                    header: Some(self.ctx.header(false)),
                })
            }
            other => Err(unexpected(other)),
        }
    }
}

#[tonic::async_trait]
impl LockService for LockApi {
    type AcquireStream = ReceiverStream<AcquireItem>;

    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<Self::AcquireStream>, Status> {
        self.ctx
            .serve("Acquire", request, None, |caller, req| async move {
                self.do_acquire(&caller, req).await
            })
            .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.ctx
            .serve("Release", request, None, |caller, req| async move {
                self.do_release(&caller, req).await
            })
            .await
    }

    async fn holder(
        &self,
        request: Request<pb::HolderRequest>,
    ) -> Result<Response<pb::HolderResponse>, Status> {
        self.ctx
            .serve("Holder", request, None, |caller, req| async move {
                self.do_holder(&caller, req).await
            })
            .await
    }

    async fn get(
        &self,
        request: Request<pb::GetLockRequest>,
    ) -> Result<Response<pb::GetLockResponse>, Status> {
        self.ctx
            .serve("Get", request, None, |caller, req| async move {
                self.do_get(&caller, req).await
            })
            .await
    }

    async fn list(
        &self,
        request: Request<pb::ListLocksRequest>,
    ) -> Result<Response<pb::ListLocksResponse>, Status> {
        self.ctx
            .serve(
                "List",
                request,
                Some(Action::ListLocks),
                |_, req| async move { self.do_list(req) },
            )
            .await
    }

    async fn force_release(
        &self,
        request: Request<pb::ForceReleaseRequest>,
    ) -> Result<Response<pb::ForceReleaseResponse>, Status> {
        self.ctx
            .serve("ForceRelease", request, None, |caller, req| async move {
                self.do_force_release(&caller, req).await
            })
            .await
    }

    async fn withdraw(
        &self,
        request: Request<pb::WithdrawRequest>,
    ) -> Result<Response<pb::WithdrawResponse>, Status> {
        self.ctx
            .serve("Withdraw", request, None, |caller, req| async move {
                self.do_withdraw(&caller, req).await
            })
            .await
    }
}
