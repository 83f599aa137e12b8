//! The abandoner: queued acquires whose caller goes away, and callers that
//! come back for their wait.
//!
//! Each round takes a fresh lock: pod `h` takes it, pod `w` queues behind it
//! under a request id of the abandoner's own session, and pod `x` queues
//! behind `w`. Then `w`'s caller goes away (its stream is dropped). In one
//! round of two it comes back within half of the chaos clusters'
//! [`ABANDONED_WAIT_GRACE`] with the same request id, on a fresh connection,
//! and follows its wait to the end: the wait must have been kept, in its
//! place. In the other it stays away, in three kinds of round taking turns
//! (rounds 1, 3, 5, then again):
//! - **inside the grace**: `h` releases at once: the lock is granted to
//!   `w`, whom nobody will serve, and the replica that served `w`'s stream
//!   must give it up through the leader (`AbandonWait`), handing the lock
//!   on to `x` (format 7);
//! - **withdrawn**: the caller withdraws, as the extender does when
//!   kube-scheduler hangs up on a bind (`LockService.Withdraw`, one entry
//!   in the log), and `h` releases at once, before or after the withdrawal
//!   (drawn from the seed alone): `w`'s wait ends, or the hold `w` was
//!   granted is given back and `x` granted;
//! - **past the grace**: `h` holds past the grace, then releases; the wait
//!   was given up meanwhile (`AbandonWait`), so the lock goes to `x` (or to
//!   `w` if a fault kept the wait from being given up in time; it is then
//!   revoked, as the bridge would revoke a pod that went away).
//!
//! How long `x` waited from `h`'s release (inside the grace) or from the
//! later answer of release and withdrawal is recorded as a [`Recovery`] for
//! the `progress` checker, which bounds it; a withdrawn round's is judged
//! even near faults (nothing rests on one replica's memory).
//!
//! What the checkers see: a client that came back, and is then told its
//! wait was given up because its caller went away, is a violation
//! (`Value::Abandoned`, reported by `ends`); a wait that ended is never
//! granted or queued again afterwards (`ends`); and `fifo`,
//! `mutual_exclusion`, `tokens` and `answers` read the same log.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tether_client::Error;
use tether_client::proto as pb;
use tether_client::proto::lock_service_client::LockServiceClient;
use tonic::Status;

use crate::history::{Call, Outcome, Recovery, Value, error_outcome};
use crate::rng::Rng;
use crate::storm::{Session, acquire_request, first_answer, fresh_client};
use crate::workers::{Shared, lock_event_key, use_and_release};

/// `--abandoned-wait-grace` of the chaos clusters.
pub const ABANDONED_WAIT_GRACE: Duration = Duration::from_millis(400);

/// How long `w` and `x` may wait.
const WAIT: Duration = Duration::from_secs(3);

/// How long `x` may wait in a round where `h` releases inside the grace:
/// well past the `progress` checker's bound, so a lock that does not move
/// on shows as a recovery that never came, not as a wait that ended.
const INSIDE_GRACE_WAIT: Duration = Duration::from_secs(10);

/// The phrase of the server's answer to a stream whose wait was given up
/// because its caller went away (`server/src/api/lock.rs`).
pub const ABANDONED_MESSAGE: &str = "its caller went away";

/// How a followed acquire ended, as the history records it.
fn acquire_outcome(result: Result<Option<pb::Hold>, Error>) -> Outcome {
    match result {
        Ok(Some(hold)) => Outcome::Ok(Value::Granted(hold.token)),
        Ok(None) => Outcome::Unknown("the stream ended without an answer".into()),
        Err(Error::Aborted(message)) if message.contains(ABANDONED_MESSAGE) => {
            Outcome::Ok(Value::Abandoned)
        }
        Err(Error::FailedPrecondition(_) | Error::Aborted(_) | Error::DeadlineExceeded(_)) => {
            Outcome::Ok(Value::Busy)
        }
        Err(err) => error_outcome(&err),
    }
}

/// Follows `stream` to its grant or its end.
async fn follow(
    mut stream: tonic::Streaming<pb::AcquireResponse>,
) -> Result<Option<pb::Hold>, Status> {
    while let Some(message) = stream.message().await? {
        if message.hold.is_some() {
            return Ok(message.hold);
        }
    }
    Ok(None)
}

/// The abandoner's rounds (pods `h`, `w`, `x` are processes `process` to
/// `process + 2`), until stopped.
pub async fn abandoner(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    let session = Session {
        client_id: format!("{}-abandon{process}", shared.prefix),
        last: Arc::new(AtomicU64::new(0)),
    };
    // The withdrawing rounds' order, drawn apart from the rest so that it
    // follows from the seed alone (the rest depends on what answers came).
    let mut order = rng.fork(0x57D);
    let mut round = 0u64;
    while !shared.stopped() {
        round += 1;
        let comes_back = round.is_multiple_of(2);
        let key = shared.lock(&format!("a{process}-{round}"));
        shared.track_lock(&key);
        let name = key.name.clone();
        let (h, w, x) = (format!("{name}h"), format!("{name}w"), format!("{name}x"));
        let Outcome::Ok(Value::Granted(token)) =
            shared.acquire(process, &key, &h, Duration::ZERO).await
        else {
            shared.revoke(process, &h).await;
            continue;
        };
        // w queues under an id of the abandoner's session, on a connection
        // of its own; the stream is dropped once w is told it queued.
        let id = session.next();
        let request = acquire_request(&shared, &key, &w, id, WAIT);
        let call = Call::Acquire {
            uid: w.clone(),
            wait_ms: WAIT.as_millis() as u64,
        };
        let invoked = shared
            .history
            .invoke(process + 1, &lock_event_key(&key), call.clone());
        // Queued first (h holds), or granted if h's hold ended.
        let first = first_answer(&shared, &request).await;
        let queued = matches!(first, Ok(None));
        // Dropped: the stream (and its connection) is gone with the client.
        let first = match first {
            Ok(None) => Outcome::Unknown("the caller went away while queued".into()),
            other => acquire_outcome(other),
        };
        shared.history.complete(invoked, first.clone());
        // Stay-away rounds take turns: inside the grace, withdrawn, past the
        // grace (rounds 1, 3, 5, then again).
        let stay_away_turn = (round / 2) % 3;
        let inside_grace = queued && !comes_back && stay_away_turn == 0;
        let withdraws = queued && !comes_back && stay_away_turn == 1;
        let x_wait = if inside_grace || withdraws {
            INSIDE_GRACE_WAIT
        } else {
            WAIT
        };
        let waiter_x = {
            let (shared, key, x) = (shared.clone(), key.clone(), x.clone());
            tokio::spawn(async move {
                let outcome = shared.acquire(process + 2, &key, &x, x_wait).await;
                (outcome, shared.history.now_us())
            })
        };
        let back = queued && comes_back;
        let returned = back.then(|| {
            let (shared, request, call) = (shared.clone(), request.clone(), call.clone());
            let delay =
                Duration::from_millis(rng.between(0, ABANDONED_WAIT_GRACE.as_millis() as u64 / 2));
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let invoked = shared.history.invoke(
                    process + 1,
                    &lock_event_key(request.key.as_ref().expect("a key")),
                    call,
                );
                let result = fresh_client(&shared)
                    .with_leader(WAIT, |conn| {
                        let request = request.clone();
                        async move {
                            let stream = LockServiceClient::new(conn)
                                .acquire(request)
                                .await?
                                .into_inner();
                            follow(stream).await
                        }
                    })
                    .await;
                let outcome = acquire_outcome(result);
                shared.history.complete(invoked, outcome.clone());
                outcome
            })
        });
        // h holds past the grace (and the leader's round trip), then
        // releases; or, inside the grace, at once.
        let mut released_at = None;
        if withdraws {
            let key = key.clone();
            // Under the session that queued the wait, as the extender
            // withdraws through the client that acquired: from format 9 a
            // withdrawal ends only its own client's wait or hold.
            let withdraw = || async {
                let request = pb::WithdrawRequest {
                    request_id: Some(session.next()),
                    key: Some(key.clone()),
                    pod_uid: w.clone(),
                };
                let answer = fresh_client(&shared)
                    .with_leader(Duration::ZERO, |conn| {
                        let request = request.clone();
                        async move {
                            LockServiceClient::new(conn)
                                .withdraw(request)
                                .await
                                .map(tonic::Response::into_inner)
                        }
                    })
                    .await;
                answer.is_ok_and(|a| {
                    matches!(
                        a.result(),
                        pb::withdraw_response::Result::WaitEnded
                            | pb::withdraw_response::Result::HoldGivenBack
                            | pb::withdraw_response::Result::NotInvolved
                    )
                })
            };
            let release = || async {
                matches!(
                    shared.release(process, &key, &h, token).await,
                    Outcome::Ok(Value::Released)
                )
            };
            let (withdrawn, released) = if order.percent(50) {
                let withdrawn = withdraw().await;
                (withdrawn, release().await)
            } else {
                let released = release().await;
                (withdraw().await, released)
            };
            if withdrawn && released {
                released_at = Some(shared.history.now_us());
            } else {
                // An unknown answer: end what is left as the bridge would.
                shared.revoke(process, &h).await;
                shared.revoke(process + 1, &w).await;
            }
        } else if inside_grace {
            match shared.release(process, &key, &h, token).await {
                Outcome::Ok(Value::Released) => released_at = Some(shared.history.now_us()),
                _ => {
                    shared.revoke(process, &h).await;
                }
            }
        } else {
            tokio::time::sleep(ABANDONED_WAIT_GRACE + Duration::from_millis(rng.between(200, 400)))
                .await;
            use_and_release(&shared, process, &key, &h, token, &mut rng).await;
        }
        let w_outcome = match returned {
            Some(task) => task.await.expect("the returning caller"),
            None => first,
        };
        match w_outcome {
            Outcome::Ok(Value::Granted(next)) if back => {
                use_and_release(&shared, process + 1, &key, &w, next, &mut rng).await;
            }
            // Inside the grace, w's end waits until x is answered: a revoke
            // now would hand the lock on itself and hide a grant kept for
            // nobody. A withdrawal has ended it.
            _ if inside_grace || withdraws => {}
            _ => {
                // Gone for good (or unknown): whatever w still holds or
                // waits for ends, as the bridge would end it.
                shared.revoke(process + 1, &w).await;
            }
        }
        let (x_outcome, x_answered_at) = waiter_x.await.expect("x");
        if let Some(due_us) = released_at {
            let granted_us =
                matches!(x_outcome, Outcome::Ok(Value::Granted(_))).then_some(x_answered_at);
            shared.history.record_recovery(Recovery {
                key: lock_event_key(&key),
                cause: if withdraws {
                    "a bind was withdrawn"
                } else {
                    "a grant raced an abandoned wait"
                },
                due_us,
                granted_us,
                answered_us: x_answered_at,
                in_memory: !withdraws,
            });
        }
        if inside_grace {
            shared.revoke(process + 1, &w).await;
        }
        match x_outcome {
            Outcome::Ok(Value::Granted(next)) => {
                use_and_release(&shared, process + 2, &key, &x, next, &mut rng).await;
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process + 2, &x).await;
            }
        }
    }
}
