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

use super::convert::{hold_to, key_to, lock_to, outcome_from, pod_from};
use super::{Ctx, unexpected, validate};
use crate::error::{ApiError, Result};
use crate::sm::command::{Acquire, CancelOutcome, CancelWait, ForceRelease, Release};
use crate::sm::{Command, EventKind, Hold, LockKey, Reply, WaitEndReason};
use crate::store::waiters::{WaitSignal, WaitTicket};

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

/// Where a queued acquire stands after a check of the applied state.
enum WaitState {
    Granted(Hold),
    Waiting,
    Gone,
}

fn wait_state(ctx: &Ctx, key: &LockKey, pod_uid: &str) -> WaitState {
    let applied = ctx.state.read();
    match applied.state.locks.get(key) {
        Some(lock) if lock.holder.as_ref().is_some_and(|h| h.pod.uid == pod_uid) => {
            WaitState::Granted(lock.holder.clone().expect("checked above"))
        }
        Some(lock) if lock.position_of(pod_uid).is_some() => WaitState::Waiting,
        _ => WaitState::Gone,
    }
}

fn granted(ctx: &Ctx, hold: &Hold) -> pb::AcquireResponse {
    pb::AcquireResponse {
        state: pb::acquire_response::State::Granted as i32,
        hold: Some(hold_to(hold)),
        queue_position: 0,
        header: Some(ctx.header(false)),
    }
}

/// Follows a queued acquire until it is granted, its wait ends, its deadline
/// passes (then it cancels the wait) or the caller goes away (then it cancels
/// too, so an abandoned wait is never granted).
async fn follow_wait(
    ctx: Arc<Ctx>,
    key: LockKey,
    pod_uid: String,
    wait: Duration,
    mut ticket: WaitTicket,
    tx: mpsc::Sender<AcquireItem>,
) {
    let deadline = tokio::time::Instant::now() + wait;
    // A dedupe-replayed "queued" answer may be stale: look at the state once
    // before relying on events, which only report what happens from now on.
    let mut check_state = true;
    loop {
        if check_state {
            check_state = false;
            match wait_state(&ctx, &key, &pod_uid) {
                WaitState::Granted(hold) => {
                    let _ = tx.send(Ok(granted(&ctx, &hold))).await;
                    return;
                }
                WaitState::Gone => {
                    let err = ApiError::Aborted(format!(
                        "the wait of pod uid {pod_uid} for lock {key} already ended (deadline \
                         passed or pod revoked); acquire again"
                    ));
                    let _ = tx.send(Err(err.into())).await;
                    return;
                }
                WaitState::Waiting => {}
            }
        }
        tokio::select! {
            signal = ticket.recv() => match signal {
                Some(WaitSignal::Event(event)) => match event.kind {
                    EventKind::LockGranted { key: k, hold } if k == key && hold.pod.uid == pod_uid => {
                        let _ = tx.send(Ok(granted(&ctx, &hold))).await;
                        return;
                    }
                    EventKind::WaitEnded { key: k, pod, reason } if k == key && pod.uid == pod_uid => {
                        let err = match reason {
                            WaitEndReason::DeadlineExceeded => ApiError::DeadlineExceeded(format!(
                                "lock {key} was not granted to pod uid {pod_uid} before the wait \
                                 deadline; the pod left the queue"
                            )),
                            WaitEndReason::PodRevoked { reason } => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: pod revoked \
                                 ({reason})"
                            )),
                            WaitEndReason::NodeGone => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: the node is gone"
                            )),
                            WaitEndReason::LeaseEnded { lease_id } => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: lease \
                                 {lease_id} expired or was revoked"
                            )),
                        };
                        let _ = tx.send(Err(err.into())).await;
                        return;
                    }
                    _ => {}
                },
                // A snapshot replaced the state: it tells where we are.
                Some(WaitSignal::Recheck) => check_state = true,
                None => {
                    let err = ApiError::Unavailable("this replica is shutting down; acquire again on another replica".into());
                    let _ = tx.send(Err(err.into())).await;
                    return;
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                let result = cancel_wait(&ctx, &key, &pod_uid).await;
                let item = match result {
                    Ok(CancelOutcome::AlreadyGranted(hold)) => Ok(granted(&ctx, &hold)),
                    Ok(_) => Err(ApiError::DeadlineExceeded(format!(
                        "lock {key} was not granted to pod uid {pod_uid} within {} ms; the pod \
                         left the queue", wait.as_millis()
                    )).into()),
                    Err(err) => Err(err.into()),
                };
                let _ = tx.send(item).await;
                return;
            }
            _ = ctx.shutting_down() => {
                let err = ApiError::Unavailable("this replica is shutting down; acquire again (same pod uid) on another replica".into());
                let _ = tx.send(Err(err.into())).await;
                return;
            }
            _ = tx.closed() => {
                // The caller is gone. Remove its wait so the lock is never
                // handed to nobody; a hold that won the race stays (the same
                // pod acquiring again gets it back).
                if let Err(err) = cancel_wait(&ctx, &key, &pod_uid).await {
                    tracing::debug!(%key, pod_uid, %err, "could not cancel an abandoned wait");
                }
                return;
            }
        }
    }
}

async fn cancel_wait(ctx: &Ctx, key: &LockKey, pod_uid: &str) -> Result<CancelOutcome> {
    let command = Command::CancelWait(CancelWait {
        key: key.clone(),
        pod_uid: pod_uid.to_string(),
    });
    match ctx.write(None, command).await? {
        Reply::WaitCancelled(outcome) => Ok(outcome),
        other => Err(unexpected(other)),
    }
}

impl LockApi {
    async fn do_acquire(
        &self,
        caller: &Caller,
        req: pb::AcquireRequest,
    ) -> Result<ReceiverStream<AcquireItem>> {
        let ctx = &self.ctx;
        let request_id = validate::request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::Acquire(&key))?;
        let pod = req
            .pod
            .as_ref()
            .ok_or_else(|| ApiError::InvalidArgument("missing pod".into()))?;
        validate::pod(pod)?;
        validate::payload(&req.payload, ctx.config.max_payload_bytes)?;
        let max_wait = ctx.config.max_wait;
        let wait = Duration::from_millis(req.wait_timeout_ms);
        if wait > max_wait {
            return Err(ApiError::InvalidArgument(format!(
                "wait of {} ms is over the maximum of {} ms (tetherd --max-wait)",
                req.wait_timeout_ms,
                max_wait.as_millis()
            )));
        }
        let command = Command::Acquire(Acquire {
            key: key.clone(),
            pod: pod_from(pod),
            payload: req.payload,
            wait_ms: req.wait_timeout_ms,
            lease_id: req.lease_id,
            client_id: request_id
                .as_ref()
                .map(|r| r.client_id.clone())
                .unwrap_or_default(),
            queue_limit: ctx.config.max_queue_length,
        });
        // Register before proposing so the grant cannot slip between the
        // apply and the registration.
        let ticket = ctx.state.register_wait(&key, &pod.uid);
        let reply = ctx.write(request_id, command).await?;
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
                tokio::spawn(follow_wait(ctx.clone(), key, pod_uid, wait, ticket, tx));
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
        let request_id = validate::request_id(caller, req.request_id.as_ref())?;
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::Release(&key))?;
        validate::pod_uid(&req.pod_uid)?;
        let command = Command::Release(Release {
            key,
            pod_uid: req.pod_uid,
            token: req.token,
            outcome: outcome_from(req.outcome),
        });
        match self.ctx.write(request_id, command).await? {
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
        self.ctx.linearizable().await?;
        let hold = {
            let applied = self.ctx.state.read();
            applied
                .state
                .locks
                .get(&key)
                .and_then(|l| l.holder.as_ref())
                .map(hold_to)
        };
        Ok(pb::HolderResponse {
            hold,
            header: Some(self.ctx.header(true)),
        })
    }

    async fn do_get(
        &self,
        caller: &Caller,
        req: pb::GetLockRequest,
    ) -> Result<pb::GetLockResponse> {
        let key = validate::lock_key(req.key.as_ref())?;
        caller.require(Action::ReadLock(&key))?;
        self.ctx.linearizable().await?;
        let lock = {
            let applied = self.ctx.state.read();
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
            let applied = self.ctx.state.read();
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

    async fn do_force_release(
        &self,
        caller: &Caller,
        req: pb::ForceReleaseRequest,
    ) -> Result<pb::ForceReleaseResponse> {
        let request_id = validate::request_id(caller, req.request_id.as_ref())?;
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
        match self.ctx.write(request_id, command).await? {
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
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_acquire(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Acquire", result).map(Response::new)
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_release(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Release", result).map(Response::new)
    }

    async fn holder(
        &self,
        request: Request<pb::HolderRequest>,
    ) -> Result<Response<pb::HolderResponse>, Status> {
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_holder(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Holder", result).map(Response::new)
    }

    async fn get(
        &self,
        request: Request<pb::GetLockRequest>,
    ) -> Result<Response<pb::GetLockResponse>, Status> {
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_get(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Get", result).map(Response::new)
    }

    async fn list(
        &self,
        request: Request<pb::ListLocksRequest>,
    ) -> Result<Response<pb::ListLocksResponse>, Status> {
        let result = match self.ctx.auth.check(&request, Action::ListLocks) {
            Ok(_) => self.do_list(request.into_inner()),
            Err(err) => Err(err),
        };
        self.ctx.finish("List", result).map(Response::new)
    }

    async fn force_release(
        &self,
        request: Request<pb::ForceReleaseRequest>,
    ) -> Result<Response<pb::ForceReleaseResponse>, Status> {
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_force_release(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("ForceRelease", result).map(Response::new)
    }
}
