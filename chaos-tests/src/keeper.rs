//! The lease keeper: a pod that holds a lock on a TTL lease its client
//! keeps alive, as a device plugin keeps its lease while it serves, with a
//! waiter queued behind it.
//!
//! Each round takes a fresh lock: the keeper grants a lease of the
//! replicas' shortest TTL, takes the lock on it (pod `k`), and once pod `w`
//! is told it queued behind, keeps the lease alive every sixth of its TTL
//! for 40–90 % of the TTL, then releases and revokes the lease. The lease
//! must outlive every one of those keep-alives by its TTL in real time (at
//! most [`SLEW_PERCENT`] less while committed time slews after a clock
//! step), so `w` is granted by the release, or, when a fault kept the
//! keep-alives from landing, once the lease has lapsed. Each round is
//! recorded as a [`KeptLease`] for the `leases` checker; the `clock-step`
//! fault (the sitting leader's wall clock 10 minutes ahead or behind) is
//! what it is there for.
//!
//! [`SLEW_PERCENT`]: crate::checkers::leases::SLEW_PERCENT

use std::sync::Arc;
use std::time::Duration;

use crate::history::{KeptLease, Outcome, Value};
use crate::rng::Rng;
use crate::workers::{Shared, lock_event_key, use_and_release};

/// What the server's answer says when a wait's deadline ended it
/// (`DEADLINE_EXCEEDED` from `server/src/api/lock.rs`): a definite end,
/// unlike the client's own timeout.
const WAIT_DEADLINE_MESSAGE: &str = "the pod left the queue";

/// What the waiter was told, and when (µs on the history's clock).
enum WaiterAnswer {
    Granted(u64),
    /// Its wait ended unserved.
    Ended(u64),
    Unknown,
}

/// The keeper's rounds (pods `k` and `w` are processes `process` and
/// `process + 1`), until stopped or the workload has no time left for one;
/// `ttl` is the lease's.
pub async fn keeper(shared: Arc<Shared>, process: u64, ttl: Duration, mut rng: Rng) {
    let mut round = 0u64;
    loop {
        // How long the round holds, keeping the lease alive: none that
        // would run past the workload starts.
        let hold = ttl * rng.between(40, 90) as u32 / 100;
        if !shared.may_start(hold) {
            break;
        }
        round += 1;
        let key = shared.lock(&format!("k{process}-{round}"));
        shared.track_lock(&key);
        let (k, w) = (format!("{}k", key.name), format!("{}w", key.name));
        let grant_sent_us = shared.history.now_us();
        let Ok(lease) = shared.client.grant_lease(ttl).await else {
            // An unknown grant ends at its TTL by itself.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let mut alive_sent_us = vec![grant_sent_us];
        let Outcome::Ok(Value::Granted(token)) = shared
            .acquire_on_lease(process, &key, &k, Duration::ZERO, lease, None)
            .await
        else {
            let _ = shared.client.revoke_lease(lease).await;
            continue;
        };
        // The waiter outwaits a lapsed lease plus the progress bound.
        let wait = ttl * 2 + crate::checkers::progress::BOUND;
        let (queued_tx, queued_rx) = tokio::sync::oneshot::channel();
        let waiter = {
            let (shared, key, w) = (shared.clone(), key.clone(), w.clone());
            let mut rng = rng.fork(round);
            tokio::spawn(async move {
                let sent_us = shared.history.now_us();
                let outcome = shared
                    .acquire_on_lease(process + 1, &key, &w, wait, 0, Some(queued_tx))
                    .await;
                let answered_us = shared.history.now_us();
                let answer = match outcome {
                    Outcome::Ok(Value::Granted(token)) => {
                        use_and_release(&shared, process + 1, &key, &w, token, &mut rng).await;
                        WaiterAnswer::Granted(answered_us)
                    }
                    Outcome::Ok(Value::Busy) => WaiterAnswer::Ended(answered_us),
                    Outcome::Unknown(why) if why.contains(WAIT_DEADLINE_MESSAGE) => {
                        WaiterAnswer::Ended(answered_us)
                    }
                    _ => WaiterAnswer::Unknown,
                };
                (sent_us, answer)
            })
        };
        let _ = queued_rx.await;
        // Hold, keeping the lease alive; use the resource once meanwhile.
        let until = tokio::time::Instant::now() + hold;
        let event_key = lock_event_key(&key);
        if let Some(read) = shared.shadow.read(&event_key, token) {
            shared.shadow.write(&event_key, token, read);
        }
        let mut gone_answered_us = None;
        while tokio::time::Instant::now() < until && !waiter.is_finished() {
            tokio::time::sleep(ttl / 6).await;
            let sent_us = shared.history.now_us();
            match shared.client.keep_alive_once(lease).await {
                Ok(0) => {
                    gone_answered_us.get_or_insert(shared.history.now_us());
                }
                Ok(_) => alive_sent_us.push(sent_us),
                Err(_) => {}
            }
        }
        let release_sent_us = shared.history.now_us();
        shared.release(process, &key, &k, token).await;
        // Whatever the release's outcome, the lease's revoke ends the hold.
        let _ = shared.client.revoke_lease(lease).await;
        let Ok((waiter_sent_us, answer)) = waiter.await else {
            continue;
        };
        shared.history.record_kept_lease(KeptLease {
            key: event_key,
            lease,
            ttl_ms: ttl.as_millis() as u64,
            alive_sent_us,
            gone_answered_us,
            release_sent_us: Some(release_sent_us),
            waiter_sent_us,
            waiter_wait_ms: wait.as_millis() as u64,
            waiter_granted_us: match answer {
                WaiterAnswer::Granted(at) => Some(at),
                _ => None,
            },
            waiter_ended_us: match answer {
                WaiterAnswer::Ended(at) => Some(at),
                _ => None,
            },
        });
    }
}
