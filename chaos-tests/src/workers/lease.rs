//! The lease worker: holds and queues on TTL leases it stops keeping
//! alive, two at a time, so both end in one sweep with a third pod queued
//! behind them.

use super::*;

/// TTL-lease holders that stop keeping alive, until stopped or no round
/// fits in what is left of the workload; rounds are numbered from
/// `first_round` (the runner starts one worker on an odd round, one on an
/// even, so that both kinds run within a short workload). Each round
/// grants two leases of the same TTL at once; pod `a` takes the run's lease
/// lock on the first, pod `b` queues behind it on the second, pod `c`
/// queues behind both without a lease. Neither lease is kept alive (in one
/// round of two, `a` keeps its lease alive once and releases instead), so
/// both usually end in one sweep: the lock must then go to `c`, once, and
/// `b` must be told its wait ended. The round ends by revoking both leases.
/// Pods `a`, `b`, `c` are processes `process`, `process + 1`,
/// `process + 2`.
pub async fn lease_worker(
    shared: Arc<Shared>,
    process: u64,
    key: pb::LockKey,
    ttl: Duration,
    first_round: u64,
    mut rng: Rng,
) {
    // Either kind of round lasts about a TTL (b, or c, is granted when a
    // lease lapses): none that would run past the workload starts.
    let mut round = first_round - 1;
    while shared.may_start(ttl) {
        round += 1;
        let (first, second) = tokio::join!(
            shared.client.grant_lease(ttl),
            shared.client.grant_lease(ttl)
        );
        let (Ok(first), Ok(second)) = (first, second) else {
            // An unknown grant: the lease ends at its TTL by itself.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let leases_granted_us = shared.history.now_us();
        let uid = |who: &str| format!("{}-l{process}-{round}{who}", shared.prefix);
        let (a, b, c) = (uid("a"), uid("b"), uid("c"));
        let wait = ttl * 2;
        // c outwaits the progress bound after a's lease ends, so a lock that
        // does not move on shows as a recovery that never came.
        let wait_c = ttl + crate::checkers::progress::BOUND + Duration::from_secs(2);
        let held = shared
            .acquire_on_lease(process, &key, &a, Duration::ZERO, first, None)
            .await;
        let (queued_tx, queued_rx) = tokio::sync::oneshot::channel();
        let waiter_b = {
            let (shared, key, b) = (shared.clone(), key.clone(), b.clone());
            tokio::spawn(async move {
                shared
                    .acquire_on_lease(process + 1, &key, &b, wait, second, Some(queued_tx))
                    .await
            })
        };
        // b first in the queue, then c: c starts once b is told it queued,
        // or gave up (a fault may still reorder them on a retry; the
        // checkers judge whatever order the log shows).
        let _ = queued_rx.await;
        let waiter_c = {
            let (shared, key, c) = (shared.clone(), key.clone(), c.clone());
            tokio::spawn(async move {
                let outcome = shared.acquire(process + 2, &key, &c, wait_c).await;
                (outcome, shared.history.now_us())
            })
        };
        // In the rounds that abandon a's lease, the lock is due to move on
        // to c (b's lease ends as a's does) once a's TTL has passed.
        let abandoned = matches!(held, Outcome::Ok(Value::Granted(_))) && !round.is_multiple_of(2);
        match held {
            Outcome::Ok(Value::Granted(token)) if round.is_multiple_of(2) => {
                let _ = shared.client.keep_alive_once(first).await;
                use_and_release(&shared, process, &key, &a, token, &mut rng).await;
            }
            Outcome::Ok(Value::Granted(token)) => {
                // Abandoned: the lease's end releases it.
                let event_key = lock_event_key(&key);
                if let Some(read) = shared.shadow.read(&event_key, token) {
                    shared.shadow.write(&event_key, token, read);
                }
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process, &a).await;
            }
        }
        let b_outcome = waiter_b.await.expect("a lease waiter");
        let (c_outcome, c_answered_us) = waiter_c.await.expect("a lease waiter");
        if abandoned {
            shared.history.record_recovery(Recovery {
                key: lock_event_key(&key),
                cause: "a TTL lease not kept alive",
                due_us: leases_granted_us + ttl.as_micros() as u64,
                granted_us: matches!(c_outcome, Outcome::Ok(Value::Granted(_)))
                    .then_some(c_answered_us),
                answered_us: c_answered_us,
                in_memory: false,
            });
        }
        for (outcome, uid, process) in [(b_outcome, b, process + 1), (c_outcome, c, process + 2)] {
            match outcome {
                Outcome::Ok(Value::Granted(token)) => {
                    use_and_release(&shared, process, &key, &uid, token, &mut rng).await;
                }
                Outcome::Ok(_) | Outcome::Fail(_) => {}
                Outcome::Unknown(_) | Outcome::Pending => {
                    shared.revoke(process, &uid).await;
                }
            }
        }
        // Revoke both leases (those the round kept alive or that a fault
        // kept from ending): a lease revoke ends what is still attached, as
        // a lockctl session's end does. Already-ended leases answer not
        // found.
        for lease_id in [first, second] {
            let _ = shared.client.revoke_lease(lease_id).await;
        }
    }
}
