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
use crate::sm::command::{
    ABANDON_WAIT_FORMAT_VERSION, AbandonWait, Acquire, CancelOutcome, CancelWait, ForceRelease,
    GIVE_BACK_FORMAT_VERSION, Release, Withdraw,
};
use crate::sm::{Command, EventKind, Hold, LockKey, Reply, RequestId, WaitEndReason};
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

/// The request that queued a wait, as the stream following it knows it: its
/// id (with the server-side client id) and the log index of the entry whose
/// answer the stream carries.
struct Answered {
    request_id: RequestId,
    index: u64,
}

/// Follows a queued acquire until it is granted, its wait ends, its deadline
/// passes (then it cancels the wait) or the caller goes away (then, unless a
/// retry of the request comes back for it, the wait is given up, so an
/// abandoned wait is not granted: [`give_up_wait`]).
async fn follow_wait(
    ctx: Arc<Ctx>,
    key: LockKey,
    pod_uid: String,
    wait: Duration,
    answered: Option<Answered>,
    mut ticket: WaitTicket,
    tx: mpsc::Sender<AcquireItem>,
) -> bool {
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
                    return true;
                }
                WaitState::Gone => {
                    let err = ApiError::Aborted(format!(
                        "the wait of pod uid {pod_uid} for lock {key} already ended (deadline \
                         passed or pod revoked); acquire again"
                    ));
                    let _ = tx.send(Err(err.into())).await;
                    return false;
                }
                WaitState::Waiting => {}
            }
        }
        tokio::select! {
            signal = ticket.recv() => match signal {
                Some(WaitSignal::Event(event)) => match event.kind {
                    EventKind::LockGranted { key: k, hold } if k == key && hold.pod.uid == pod_uid => {
                        let _ = tx.send(Ok(granted(&ctx, &hold))).await;
                        return true;
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
                            // The chaos checkers recognise this answer by
                            // "its caller went away" (chaos-tests/src/abandon.rs).
                            WaitEndReason::Abandoned => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: its caller \
                                 went away and no retry came back for it in time"
                            )),
                            WaitEndReason::Withdrawn => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: its caller \
                                 withdrew the acquire"
                            )),
                            WaitEndReason::LeaseEnded { lease_id } => ApiError::Aborted(format!(
                                "the wait of pod uid {pod_uid} for lock {key} ended: lease \
                                 {lease_id} expired or was revoked"
                            )),
                        };
                        let _ = tx.send(Err(err.into())).await;
                        return false;
                    }
                    _ => {}
                },
                // A snapshot replaced the state: it tells where we are.
                Some(WaitSignal::Recheck) => check_state = true,
                None => {
                    let err = ApiError::Unavailable("this replica is shutting down; acquire again on another replica".into());
                    let _ = tx.send(Err(err.into())).await;
                    return false;
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                let result = cancel_wait(&ctx, &key, &pod_uid).await;
                let won = matches!(result, Ok(CancelOutcome::AlreadyGranted(_)));
                let item = match result {
                    Ok(CancelOutcome::AlreadyGranted(hold)) => Ok(granted(&ctx, &hold)),
                    Ok(_) => Err(ApiError::DeadlineExceeded(format!(
                        "lock {key} was not granted to pod uid {pod_uid} within {} ms; the pod \
                         left the queue", wait.as_millis()
                    )).into()),
                    Err(err) => Err(err.into()),
                };
                let _ = tx.send(item).await;
                return won;
            }
            _ = ctx.shutting_down() => {
                let err = ApiError::Unavailable("this replica is shutting down; acquire again (same pod uid) on another replica".into());
                let _ = tx.send(Err(err.into())).await;
                return false;
            }
            _ = tx.closed() => {
                tokio::spawn(give_up_wait(ctx, key, pod_uid, answered, deadline));
                return false;
            }
        }
    }
}

/// Gives up the wait of a caller that went away, so the lock is not handed
/// to nobody. The caller's client retries a call whose connection reset with
/// the same request id, on this replica or another (the client library
/// within 20-500 ms, then with back-off), so first it waits
/// `--abandoned-wait-grace`; then it sends, through whichever
/// replica leads then (this one may not any more: [`end_wait`]), an
/// `AbandonWait` that removes the wait only if no retry of its request has
/// been answered since; while a member is not known to read format 6, a
/// plain `CancelWait`. Retries until the wait's own deadline, after which
/// the leader's sweep removes it anyway. A hold that won the race is given
/// back (format 7) unless the client has been seen since the grant; with a
/// member that reads only format 6, it stays (the same pod acquiring again
/// gets it back).
async fn give_up_wait(
    ctx: Arc<Ctx>,
    key: LockKey,
    pod_uid: String,
    answered: Option<Answered>,
    deadline: tokio::time::Instant,
) {
    tokio::select! {
        _ = tokio::time::sleep(ctx.config.abandoned_wait_grace) => {}
        _ = ctx.shutting_down() => return,
    }
    let every_member_reads_6 = ctx
        .peer_formats
        .newest_members_read(&ctx.raft, ctx.id)
        .is_none_or(|format| format >= ABANDON_WAIT_FORMAT_VERSION);
    let command = match answered {
        Some(answered) if every_member_reads_6 => Command::AbandonWait(AbandonWait {
            key: key.clone(),
            pod_uid: pod_uid.clone(),
            client_id: answered.request_id.client_id,
            sequence: answered.request_id.sequence,
            answered_at: answered.index,
        }),
        _ => Command::CancelWait(CancelWait {
            key: key.clone(),
            pod_uid: pod_uid.clone(),
        }),
    };
    let mut backoff = Duration::from_millis(50);
    loop {
        let err = match end_wait(&ctx, command.clone()).await {
            Ok(outcome) => {
                tracing::debug!(%key, pod_uid, ?outcome, "ended the wait of a caller that went away");
                ctx.metrics.abandoned_wait(match outcome {
                    CancelOutcome::Removed => "removed",
                    CancelOutcome::TakenUp => "taken_up",
                    CancelOutcome::AlreadyGranted(_) => "granted",
                    CancelOutcome::NotWaiting => "not_waiting",
                    CancelOutcome::GaveBack { .. } => "given_back",
                });
                return;
            }
            Err(err) => err,
        };
        if tokio::time::Instant::now() + backoff >= deadline {
            ctx.metrics.abandoned_wait("failed");
            tracing::warn!(
                %key, pod_uid, %err,
                "could not give up the wait of a caller that went away before its deadline; \
                 the leader's sweep removes it then"
            );
            return;
        }
        tracing::debug!(%key, pod_uid, %err, "giving up an abandoned wait: retrying");
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = ctx.shutting_down() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Applies `command` (a `CancelWait` or `AbandonWait`) through the leader:
/// here when this replica leads, else by the leader's `RaftService.EndWait`
/// (dialed as Raft messages are, with this replica's credentials).
/// How long the leader may take to answer an `EndWait`.
const END_WAIT_TIMEOUT: Duration = Duration::from_secs(5);

async fn end_wait(ctx: &Ctx, command: Command) -> Result<CancelOutcome> {
    let (leader_id, leader_addr) = match ctx.write(None, command.clone()).await {
        Ok(Reply::WaitCancelled(outcome)) => return Ok(outcome),
        Ok(other) => return Err(unexpected(other)),
        Err(ApiError::NotLeader {
            leader_id: Some(id),
            leader_addr: Some(addr),
        }) if id != ctx.id => (id, addr),
        Err(err) => return Err(err),
    };
    let unreachable = |e: &dyn std::fmt::Display| {
        ApiError::Unavailable(format!("leader {leader_id} at {leader_addr}: {e}"))
    };
    let request = ctx
        .dialer
        .message(leader_id, crate::store::encode(&command));
    let mut client = ctx
        .dialer
        .raft_client(leader_id, &leader_addr)
        .ok_or_else(|| unreachable(&"not an address that can be dialed"))?;
    let reply = tokio::time::timeout(END_WAIT_TIMEOUT, client.end_wait(request))
        .await
        .map_err(|_| unreachable(&"no answer within 5 s"))?
        .map_err(|status| unreachable(&status.message()))?
        .into_inner();
    match crate::store::decode(&reply.data) {
        Ok(Reply::WaitCancelled(outcome)) => Ok(outcome),
        Ok(other) => Err(unexpected(other)),
        Err(e) => Err(ApiError::Internal(format!(
            "undecodable EndWait reply: {e}"
        ))),
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
        let request_id = self.ctx.request_id(caller, req.request_id.as_ref())?;
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
        let (reply, index) = ctx.write_at(request_id.clone(), command).await?;
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
                    let granted =
                        follow_wait(ctx.clone(), key, pod_uid, wait, answered, ticket, tx).await;
                    ctx.metrics.waited(granted, queued_at.elapsed());
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
        if let Some(format) = ctx
            .peer_formats
            .newest_members_read(&ctx.raft, ctx.id)
            .filter(|format| *format < GIVE_BACK_FORMAT_VERSION)
        {
            return Err(ApiError::FailedPrecondition(format!(
                "withdraw needs every member to read format {GIVE_BACK_FORMAT_VERSION}; one \
                 reads only {format} (finish the upgrade, or release the hold by its token)"
            )));
        }
        let command = Command::Withdraw(Withdraw {
            key: key.clone(),
            pod_uid: req.pod_uid.clone(),
        });
        use pb::withdraw_response::Result as Withdrawn;
        let (result, given_back, next) = match ctx.write(request_id, command).await? {
            Reply::WaitCancelled(CancelOutcome::Removed) => (Withdrawn::WaitEnded, None, None),
            Reply::WaitCancelled(CancelOutcome::GaveBack { hold, next }) => {
                (Withdrawn::HoldGivenBack, Some(hold), next)
            }
            Reply::WaitCancelled(CancelOutcome::NotWaiting) => (Withdrawn::NotInvolved, None, None),
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

    async fn withdraw(
        &self,
        request: Request<pb::WithdrawRequest>,
    ) -> Result<Response<pb::WithdrawResponse>, Status> {
        let result = match self.ctx.auth.caller(&request) {
            Ok(caller) => self.do_withdraw(&caller, request.into_inner()).await,
            Err(err) => Err(err),
        };
        self.ctx.finish("Withdraw", result).map(Response::new)
    }
}
