//! The wait lifecycle of a queued acquire: following it on the replica that
//! serves the caller's stream until it is granted or ends, cancelling it at
//! its deadline, giving it up when the caller goes away, and ending a wait
//! through whichever replica leads (`RaftService.EndWait`, dialed as Raft
//! messages are).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::Replica;
use crate::error::{ApiError, Result};
use crate::sm::command::{ABANDON_WAIT_FORMAT_VERSION, AbandonWait, CancelOutcome, CancelWait};
use crate::sm::{Command, EventKind, Hold, LockKey, Reply, RequestId, WaitEndReason};
use crate::store::waiters::{WaitSignal, WaitTicket};

/// How a followed wait ended.
#[derive(Debug)]
pub enum WaitOutcome {
    /// The pod was granted the lock.
    Granted(Hold),
    /// The wait ended without a grant (or could not be followed here): the
    /// caller's answer.
    Ended(ApiError),
    /// The caller went away; its wait is being given up.
    CallerGone,
}

/// Where a queued acquire stands after a check of the applied state.
enum WaitState {
    Granted(Hold),
    Waiting,
    Gone,
}

fn wait_state(core: &Replica, key: &LockKey, pod_uid: &str) -> WaitState {
    let applied = core.state.read();
    match applied.state.locks.get(key) {
        Some(lock) if lock.holder.as_ref().is_some_and(|h| h.pod.uid == pod_uid) => {
            WaitState::Granted(lock.holder.clone().expect("checked above"))
        }
        Some(lock) if lock.position_of(pod_uid).is_some() => WaitState::Waiting,
        _ => WaitState::Gone,
    }
}

/// The client whose wait of `pod_uid` for `key` is queued now, if it waits.
fn waiting_client(core: &Replica, key: &LockKey, pod_uid: &str) -> Option<String> {
    let applied = core.state.read();
    let lock = applied.state.locks.get(key)?;
    let position = lock.position_of(pod_uid)?;
    Some(lock.waiters[position - 1].client_id.clone())
}

/// Whether a hold or wait of `client` belongs to the call of `own` (the
/// server-side client id of the request that queued it, when it had one):
/// from format 9 another client's acquire of the same pod takes the wait
/// over, and its grant is that client's, not this call's.
fn belongs_to(own: Option<&str>, client: &str) -> bool {
    own.is_none_or(|own| own == client)
}

/// The answer to a call whose wait another client's acquire of the same pod
/// took over.
fn taken_over(key: &LockKey, pod_uid: &str) -> WaitOutcome {
    WaitOutcome::Ended(ApiError::Aborted(format!(
        "the wait of pod uid {pod_uid} for lock {key} was taken over by another client's acquire \
         of the same pod (a later attempt); this call holds nothing"
    )))
}

/// The request that queued a wait, as the stream following it knows it: its
/// id (with the server-side client id) and the log index of the entry whose
/// answer the stream carries.
pub struct Answered {
    /// The request's id.
    pub request_id: RequestId,
    /// The index of the entry that answered it.
    pub index: u64,
}

/// Follows a queued acquire until it is granted, its wait ends, its deadline
/// passes (then it cancels the wait) or `caller_gone` resolves (then, unless
/// a retry of the request comes back for it, the wait is given up, so an
/// abandoned wait is not granted: [`give_up_wait`]).
pub async fn follow(
    core: Arc<Replica>,
    key: LockKey,
    pod_uid: String,
    wait: Duration,
    answered: Option<Answered>,
    mut ticket: WaitTicket,
    caller_gone: impl Future<Output = ()>,
) -> WaitOutcome {
    let mut caller_gone = std::pin::pin!(caller_gone);
    let deadline = tokio::time::Instant::now() + wait;
    let own = answered.as_ref().map(|a| a.request_id.client_id.clone());
    let own = own.as_deref();
    // A dedupe-replayed "queued" answer may be stale: look at the state once
    // before relying on events, which only report what happens from now on.
    let mut check_state = true;
    loop {
        if check_state {
            check_state = false;
            match wait_state(&core, &key, &pod_uid) {
                WaitState::Granted(hold) if belongs_to(own, &hold.client_id) => {
                    return WaitOutcome::Granted(hold);
                }
                WaitState::Granted(_) => return taken_over(&key, &pod_uid),
                WaitState::Gone => {
                    let err = ApiError::Aborted(format!(
                        "the wait of pod uid {pod_uid} for lock {key} already ended (deadline \
                         passed or pod revoked); acquire again"
                    ));
                    return WaitOutcome::Ended(err);
                }
                WaitState::Waiting => {}
            }
        }
        tokio::select! {
            signal = ticket.recv() => match signal {
                Some(WaitSignal::Event(event)) => match event.kind {
                    EventKind::LockGranted { key: k, hold } if k == key && hold.pod.uid == pod_uid => {
                        if !belongs_to(own, &hold.client_id) {
                            return taken_over(&key, &pod_uid);
                        }
                        return WaitOutcome::Granted(hold);
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
                        return WaitOutcome::Ended(err);
                    }
                    _ => {}
                },
                // A snapshot replaced the state: it tells where we are.
                Some(WaitSignal::Recheck) => check_state = true,
                None => {
                    return WaitOutcome::Ended(ApiError::Unavailable(
                        "this replica is shutting down; acquire again on another replica".into(),
                    ));
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                // A wait another client took over has that client's
                // deadline: it is not this call's to cancel.
                if waiting_client(&core, &key, &pod_uid).is_some_and(|c| !belongs_to(own, &c)) {
                    return taken_over(&key, &pod_uid);
                }
                return match cancel_wait(&core, &key, &pod_uid).await {
                    Ok(CancelOutcome::AlreadyGranted(hold)) if !belongs_to(own, &hold.client_id) => {
                        taken_over(&key, &pod_uid)
                    }
                    Ok(CancelOutcome::AlreadyGranted(hold)) => WaitOutcome::Granted(hold),
                    Ok(_) => WaitOutcome::Ended(ApiError::DeadlineExceeded(format!(
                        "lock {key} was not granted to pod uid {pod_uid} within {} ms; the pod \
                         left the queue", wait.as_millis()
                    ))),
                    Err(err) => WaitOutcome::Ended(err),
                };
            }
            _ = core.shutting_down() => {
                return WaitOutcome::Ended(ApiError::Unavailable(
                    "this replica is shutting down; acquire again (same pod uid) on another replica".into(),
                ));
            }
            _ = &mut caller_gone => {
                tokio::spawn(give_up_wait(core, key, pod_uid, answered, deadline));
                return WaitOutcome::CallerGone;
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
    core: Arc<Replica>,
    key: LockKey,
    pod_uid: String,
    answered: Option<Answered>,
    deadline: tokio::time::Instant,
) {
    tokio::select! {
        _ = tokio::time::sleep(core.config.abandoned_wait_grace) => {}
        _ = core.shutting_down() => return,
    }
    let every_member_reads_6 = core.members_read(ABANDON_WAIT_FORMAT_VERSION);
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
        let err = match end_wait(&core, command.clone()).await {
            Ok(outcome) => {
                tracing::debug!(%key, pod_uid, ?outcome, "ended the wait of a caller that went away");
                core.metrics.abandoned_wait(match outcome {
                    CancelOutcome::Removed => "removed",
                    CancelOutcome::TakenUp => "taken_up",
                    CancelOutcome::AlreadyGranted(_) => "granted",
                    CancelOutcome::NotWaiting => "not_waiting",
                    CancelOutcome::GaveBack { .. } => "given_back",
                    CancelOutcome::TakenOver => "taken_over",
                });
                return;
            }
            Err(err) => err,
        };
        if tokio::time::Instant::now() + backoff >= deadline {
            core.metrics.abandoned_wait("failed");
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
            _ = core.shutting_down() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// How long the leader may take to answer an `EndWait`.
const END_WAIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Applies `command` (a `CancelWait` or `AbandonWait`) through the leader:
/// here when this replica leads, else by the leader's `RaftService.EndWait`
/// (dialed as Raft messages are, with this replica's credentials).
pub async fn end_wait(core: &Replica, command: Command) -> Result<CancelOutcome> {
    let (leader_id, leader_addr) = match core.write(None, command.clone()).await {
        Ok(Reply::WaitCancelled(outcome)) => return Ok(outcome),
        Ok(other) => return Err(super::unexpected(other)),
        Err(ApiError::NotLeader {
            leader_id: Some(id),
            leader_addr: Some(addr),
        }) if id != core.id => (id, addr),
        Err(err) => return Err(err),
    };
    let unreachable = |e: &dyn std::fmt::Display| {
        ApiError::Unavailable(format!("leader {leader_id} at {leader_addr}: {e}"))
    };
    let request = core
        .dialer
        .message(leader_id, crate::store::encode(&command));
    let mut client = core
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
        Ok(other) => Err(super::unexpected(other)),
        Err(e) => Err(ApiError::Internal(format!(
            "undecodable EndWait reply: {e}"
        ))),
    }
}

async fn cancel_wait(core: &Replica, key: &LockKey, pod_uid: &str) -> Result<CancelOutcome> {
    let command = Command::CancelWait(CancelWait {
        key: key.clone(),
        pod_uid: pod_uid.to_string(),
    });
    match core.write(None, command).await? {
        Reply::WaitCancelled(outcome) => Ok(outcome),
        other => Err(super::unexpected(other)),
    }
}
