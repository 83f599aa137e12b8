//! The retry storm: exactly-once answers under duplicates, reconnects and a
//! forging caller.
//!
//! - A **stormer** takes and releases a lock of its own under request ids it
//!   numbers itself (one client session, as `tether-client` keeps one). It
//!   sends every request 1–3 times at once, each copy on a fresh connection
//!   (a new [`Client`]), and half the time once more after the answers came,
//!   as a client that lost its connection and tried again. After each
//!   release it sends its acquire once more, late: that copy must be
//!   answered (`HoldEnded`, or `SequenceTooOld` once the floor passed it),
//!   never applied again.
//! - A **forger** sends acquires for pods of its own, and releases of holds
//!   it never had, under the stormer's client id (which any reader sees in `Hold.client_id`), at the stormer's
//!   current and next sequences and now and then far ahead. The chaos
//!   clusters run without authentication, so the server cannot tell the two
//!   callers apart (with authentication on it binds each session to its
//!   caller: `server/tests/security.rs`); what keeps each caller's answers
//!   its own is that a kept id answers only the command it was kept for.
//!   Whichever command reaches a sequence first is applied, the other is
//!   refused with `RequestIdReused`, and the stormer moves on to its next
//!   sequence.
//!
//! Every copy is an operation in the history, with the pod it asked for
//! and the token it was told. The `answers` checker then holds the log to
//! it: each pod is granted each lock at most once (nothing applied twice),
//! and every "granted" answer is that pod's own grant in the log (no caller
//! got the answer to another command); `durability` and `mutual_exclusion`
//! read the same operations.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tether_client::proto as pb;
use tether_client::proto::lock_service_client::LockServiceClient;
use tether_client::{Client, Error, Options};

use crate::history::{Call, Outcome, Value, error_outcome};
use crate::rng::Rng;
use crate::workers::{Shared, lock_event_key};

/// How long one copy of a request is retried (leader changes included)
/// before it counts as unknown.
const COPY_RETRY: Duration = Duration::from_millis(800);

/// Times one command is tried under fresh sequences when a forger took its
/// sequence first.
const TRIES_PER_COMMAND: usize = 4;

/// What the server answered one command, as far as the stormer needs to
/// know it.
enum Answer {
    /// A definite answer (or unknown: the copies may have applied it).
    Definite(Outcome),
    /// Every definite copy was refused because the sequence already served
    /// another command (the forger's): nothing of this command applied.
    SequenceTaken,
}

/// The stormer's session: its client id and the next sequence.
pub(crate) struct Session {
    pub(crate) client_id: String,
    /// The last sequence handed out (the forger reads it).
    pub(crate) last: Arc<AtomicU64>,
}

impl Session {
    /// A fresh id claiming every earlier sequence answered (the stormer
    /// works one command at a time, and gives up unknown ones).
    pub(crate) fn next(&self) -> pb::RequestId {
        let sequence = self.last.fetch_add(1, Ordering::SeqCst) + 1;
        pb::RequestId {
            client_id: self.client_id.clone(),
            sequence,
            first_incomplete: sequence,
        }
    }
}

/// A client with connections of its own (a reconnect), short budgets.
pub(crate) fn fresh_client(shared: &Shared) -> Client {
    let options = Options {
        call_timeout: Duration::from_millis(600),
        retry_timeout: COPY_RETRY,
        ..shared.client.options().clone()
    };
    Client::new(shared.client.endpoints().to_vec(), options).expect("the run's endpoints")
}

/// How a refused reuse of a request id is recorded (the server's message
/// names the sequence, which would make every refusal an outcome of its
/// own in the run's summary).
const REUSED: &str = "request id already used for another command";

/// An acquire of `key` for pod `uid` under `id`, waiting up to `wait`.
pub(crate) fn acquire_request(
    shared: &Shared,
    key: &pb::LockKey,
    uid: &str,
    id: pb::RequestId,
    wait: Duration,
) -> pb::AcquireRequest {
    pb::AcquireRequest {
        request_id: Some(id),
        key: Some(key.clone()),
        pod: Some(shared.pod(uid)),
        payload: Vec::new(),
        wait_timeout_ms: wait.as_millis() as u64,
        lease_id: 0,
        node_uid: String::new(),
    }
}

/// Sends `request` on a fresh connection and reads its first answer: the
/// hold, or None when it is queued (a wait-0 acquire is never queued). The
/// stream is dropped with it, as a caller that goes away drops it.
pub(crate) async fn first_answer(
    shared: &Shared,
    request: &pb::AcquireRequest,
) -> Result<Option<pb::Hold>, Error> {
    fresh_client(shared)
        .with_leader(Duration::ZERO, |conn| {
            let request = request.clone();
            async move {
                let mut stream = LockServiceClient::new(conn)
                    .acquire(request)
                    .await?
                    .into_inner();
                Ok(stream.message().await?.and_then(|m| m.hold))
            }
        })
        .await
}

/// Whether `err` refuses a request id that served another command.
fn taken(err: &Error) -> bool {
    matches!(err, Error::FailedPrecondition(m) if m.contains("different command"))
}

/// One copy of an acquire (wait 0) under `id`, recorded as an operation.
/// Returns the outcome and whether the id was refused as reused.
async fn acquire_copy(
    shared: &Shared,
    process: u64,
    key: &pb::LockKey,
    uid: &str,
    id: &pb::RequestId,
) -> (Outcome, bool) {
    let call = Call::Acquire {
        uid: uid.to_string(),
        wait_ms: 0,
    };
    let invoked = shared.history.invoke(process, &lock_event_key(key), call);
    let request = acquire_request(shared, key, uid, id.clone(), Duration::ZERO);
    let result = first_answer(shared, &request).await;
    let (outcome, reused) = match result {
        // Recorded with the token the answer carries, whichever pod it
        // names: an answer to another command is then a grant the log
        // does not have for this pod.
        Ok(Some(hold)) => (Outcome::Ok(Value::Granted(hold.token)), false),
        Ok(None) => (
            Outcome::Unknown("the stream ended without an answer".into()),
            false,
        ),
        Err(err) if taken(&err) => (Outcome::Fail(REUSED.into()), true),
        // Held, ended since (a late copy), or too old: nothing applied.
        Err(Error::FailedPrecondition(_) | Error::Aborted(_)) => (Outcome::Ok(Value::Busy), false),
        Err(err) => (error_outcome(&err), false),
    };
    shared.history.complete(invoked, outcome.clone());
    (outcome, reused)
}

/// One copy of a release under `id`, recorded as an operation.
async fn release_copy(
    shared: &Shared,
    process: u64,
    key: &pb::LockKey,
    uid: &str,
    token: u64,
    id: &pb::RequestId,
) -> (Outcome, bool) {
    let call = Call::Release {
        uid: uid.to_string(),
        token,
    };
    let invoked = shared.history.invoke(process, &lock_event_key(key), call);
    let request = pb::ReleaseRequest {
        request_id: Some(id.clone()),
        key: Some(key.clone()),
        pod_uid: uid.to_string(),
        token,
        outcome: pb::Outcome::Allocated as i32,
    };
    let result = fresh_client(shared)
        .unary(request, |conn, request| async move {
            LockServiceClient::new(conn).release(request).await
        })
        .await;
    let (outcome, reused) = match result {
        Ok(_) => (Outcome::Ok(Value::Released), false),
        Err(err) if taken(&err) => (Outcome::Fail(REUSED.into()), true),
        Err(Error::FailedPrecondition(_)) => (Outcome::Ok(Value::Rejected), false),
        Err(err) => (error_outcome(&err), false),
    };
    shared.history.complete(invoked, outcome.clone());
    (outcome, reused)
}

/// Sends one command 1–3 times at once (and maybe once more afterwards),
/// each copy on its own connection; folds the copies' answers.
async fn storm<F, Fut>(rng: &mut Rng, copy: F) -> Answer
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = (Outcome, bool)>,
{
    let mut answers: Vec<(Outcome, bool)> = match rng.between(1, 3) {
        1 => vec![copy().await],
        2 => {
            let (a, b) = tokio::join!(copy(), copy());
            vec![a, b]
        }
        _ => {
            let (a, b, c) = tokio::join!(copy(), copy(), copy());
            vec![a, b, c]
        }
    };
    if rng.below(2) == 0 {
        tokio::time::sleep(Duration::from_millis(rng.between(0, 30))).await;
        answers.push(copy().await);
    }
    let definite = || {
        answers
            .iter()
            .filter(|(o, _)| matches!(o, Outcome::Ok(_) | Outcome::Fail(_)))
    };
    if definite().next().is_some() && definite().all(|(_, reused)| *reused) {
        return Answer::SequenceTaken;
    }
    // An answer that is not a refusal, else unknown (the copies may have
    // applied it).
    let chosen = answers
        .iter()
        .find(|(o, reused)| !reused && matches!(o, Outcome::Ok(_)))
        .or_else(|| {
            answers
                .iter()
                .find(|(o, _)| matches!(o, Outcome::Unknown(_)))
        })
        .map_or(Outcome::Pending, |(o, _)| o.clone());
    Answer::Definite(chosen)
}

/// Sends `command` under fresh sequences until one is not taken by the
/// forger (at most [`TRIES_PER_COMMAND`] times): the id it was sent under
/// and its answer, or None if the forger took every one.
async fn send<F, Fut>(
    session: &Session,
    rng: &mut Rng,
    command: F,
) -> Option<(pb::RequestId, Outcome)>
where
    F: Fn(pb::RequestId) -> Fut,
    Fut: std::future::Future<Output = (Outcome, bool)>,
{
    for _ in 0..TRIES_PER_COMMAND {
        let id = session.next();
        if let Answer::Definite(outcome) = storm(rng, || command(id.clone())).await {
            return Some((id, outcome));
        }
    }
    None
}

/// The stormer and its forger (processes `process` and `process + 1`), on
/// `key`, until stopped.
pub async fn retry_storm(shared: Arc<Shared>, process: u64, key: pb::LockKey, mut rng: Rng) {
    let session = Session {
        client_id: format!("{}-storm{process}", shared.prefix),
        last: Arc::new(AtomicU64::new(0)),
    };
    let forger = tokio::spawn(forger(
        shared.clone(),
        process + 1,
        key.clone(),
        session.client_id.clone(),
        session.last.clone(),
        rng.fork(1),
    ));
    let mut round = 0;
    while !shared.stopped() {
        round += 1;
        let uid = format!("{}-r{process}-{round}", shared.prefix);
        let acquire = |id: pb::RequestId| {
            let (shared, key, uid) = (&shared, &key, &uid);
            async move { acquire_copy(shared, process, key, uid, &id).await }
        };
        let Some((acquire_id, outcome)) = send(&session, &mut rng, acquire).await else {
            continue;
        };
        let late = Duration::from_millis(rng.between(0, 20));
        let granted = match outcome {
            Outcome::Ok(Value::Granted(token)) => {
                // The release, and racing it the acquire's late copy: it is
                // answered from the table while the hold stands, as ended
                // after it, or as too old once the release moved the floor.
                let release = |id: pb::RequestId| {
                    let (shared, key, uid) = (&shared, &key, &uid);
                    async move { release_copy(shared, process, key, uid, token, &id).await }
                };
                let (released, (again, _)) =
                    tokio::join!(send(&session, &mut rng, release), async {
                        tokio::time::sleep(late).await;
                        acquire_copy(&shared, process, &key, &uid, &acquire_id).await
                    });
                if !matches!(released, Some((_, Outcome::Ok(Value::Released)))) {
                    shared.revoke(process, &uid).await;
                }
                Some((token, again))
            }
            Outcome::Ok(_) | Outcome::Fail(_) => None,
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process, &uid).await;
                let (again, _) = acquire_copy(&shared, process, &key, &uid, &acquire_id).await;
                Some((0, again))
            }
        };
        // A late copy granted another hold than the first answer: applied
        // again (the answers checker reports it), or applied for the first
        // time after the revoke. Either way nobody will release it.
        if let Some((token, Outcome::Ok(Value::Granted(again)))) = granted
            && again != token
        {
            shared.revoke(process, &uid).await;
        }
    }
    forger.await.expect("the forger");
}

/// Acquires for pods of its own, and releases of holds it never had, under
/// the stormer's client id, until stopped; releases (through its own
/// session) what it is granted.
async fn forger(
    shared: Arc<Shared>,
    process: u64,
    key: pb::LockKey,
    victim: String,
    victim_last: Arc<AtomicU64>,
    mut rng: Rng,
) {
    let mut attempt = 0;
    while !shared.stopped() {
        attempt += 1;
        tokio::time::sleep(Duration::from_millis(rng.between(5, 40))).await;
        let last = victim_last.load(Ordering::SeqCst);
        // The stormer's current sequence (already used: refused), its next
        // ones (taken first: the stormer is refused), or far ahead,
        // claiming everything before it done (the floor must not follow).
        let (sequence, first_incomplete) = match rng.below(8) {
            0 => (last + 1000, last + 1000),
            1..=3 => (last.max(1), rng.between(1, last.max(1))),
            _ => (last + rng.between(1, 2), 1),
        };
        let id = pb::RequestId {
            client_id: victim.clone(),
            sequence,
            first_incomplete,
        };
        let uid = format!("{}-f{process}-{attempt}", shared.prefix);
        if rng.below(2) == 0 {
            // A release of a hold it never had: refused as not the holder,
            // unless the answer of the stormer's release under this id is
            // handed out (a "released" the log does not have).
            let token = rng.between(1, 1 << 20);
            release_copy(&shared, process, &key, &uid, token, &id).await;
            continue;
        }
        let (outcome, _) = acquire_copy(&shared, process, &key, &uid, &id).await;
        match outcome {
            Outcome::Ok(Value::Granted(token)) => {
                if !matches!(
                    shared.release(process, &key, &uid, token).await,
                    Outcome::Ok(Value::Released)
                ) {
                    shared.revoke(process, &uid).await;
                }
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process, &uid).await;
            }
        }
    }
}
