//! The ender: ends holds the other ways, each on a fresh lock with a holder
//! and a waiter (its node reported gone, its node deleted and re-created
//! under its name, a force release, the hold timeout).

use super::*;

/// How an ender round ends its holder's hold.
#[derive(Debug, Clone, Copy)]
enum Ending {
    /// The node the lock is named after is reported gone (the waiter's
    /// wait ends too).
    NodeGone,
    /// An operator force-releases it (the waiter is granted).
    ForceRelease,
    /// The holder never releases: the scope's hold timeout ends it.
    HoldTimeout,
    /// The node the lock is named after is deleted and re-created under
    /// its name, as the bridge reports it: the new object first (refused
    /// while the old one is registered), then the old object gone (the
    /// hold and the wait end as for `NodeGone`), the new object joined, and
    /// a lagging report about the old object (refused).
    NodeRecreated,
}

/// Ends holds the ways the other workers do not, until stopped. Each round
/// takes a fresh lock: pod `h` takes it, pod `w` queues behind it, and the
/// hold is ended by its node being reported gone, a force release, the
/// hold timeout of [`HOLD_TIMEOUT_SCOPE`], or its node re-created under its
/// name, in turn. Then `w` uses and
/// releases what it was granted, and `h` tries its release (refused, unless
/// the end did not happen). Pods `h` and `w` are processes `process` and
/// `process + 1`.
pub async fn ender(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    let mut round = 0u64;
    while !shared.stopped() {
        round += 1;
        let ending = [
            Ending::NodeGone,
            Ending::ForceRelease,
            Ending::HoldTimeout,
            Ending::NodeRecreated,
        ][(round % 4) as usize];
        let name = format!("{}-e{process}-{round}", shared.prefix);
        let key = pb::LockKey {
            scope: match ending {
                Ending::HoldTimeout => HOLD_TIMEOUT_SCOPE.into(),
                _ => SCOPE.into(),
            },
            name: name.clone(),
        };
        shared.track_lock(&key);
        let names_a_node = matches!(ending, Ending::NodeGone | Ending::NodeRecreated);
        if names_a_node {
            shared
                .extra_nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(name.clone());
        }
        if names_a_node
            && report_ender_node(&shared, &name, OLD_OBJECT, pb::NodeState::NodeReady)
                .await
                .is_err()
        {
            continue;
        }
        let (h, w) = (format!("{name}h"), format!("{name}w"));
        let Outcome::Ok(Value::Granted(token)) =
            shared.acquire(process, &key, &h, Duration::ZERO).await
        else {
            shared.revoke(process, &h).await;
            continue;
        };
        let granted_us = shared.history.now_us();
        // Past the hold timeout the lock is due to move on to w: w outwaits
        // the progress bound after it, and after the settling and the bound
        // that follow the heal of the schedule's last fault (every fault
        // heals by the workload's end). A w that gave up sooner would leave
        // a hold that never timed out unjudged whenever a fault came near
        // it. Only a hold that does not time out makes w wait that long.
        let w_wait = match ending {
            Ending::HoldTimeout => {
                use crate::checkers::progress::{BOUND, SETTLE};
                let after_the_faults = shared
                    .workload_ends
                    .saturating_duration_since(tokio::time::Instant::now())
                    + SETTLE
                    + BOUND
                    + Duration::from_secs(2);
                after_the_faults.max(HOLD_TIMEOUT + BOUND + Duration::from_secs(2))
            }
            _ => Duration::from_secs(3),
        };
        let (queued_tx, queued_rx) = tokio::sync::oneshot::channel();
        let waiter = {
            let (shared, key, w) = (shared.clone(), key.clone(), w.clone());
            tokio::spawn(async move {
                let outcome = shared
                    .acquire_on_lease(process + 1, &key, &w, w_wait, 0, Some(queued_tx))
                    .await;
                (outcome, shared.history.now_us())
            })
        };
        let _ = queued_rx.await;
        match ending {
            Ending::NodeGone => {
                let _ =
                    report_ender_node(&shared, &name, OLD_OBJECT, pb::NodeState::NodeGone).await;
            }
            Ending::NodeRecreated => recreate_node(&shared, process, &name).await,
            Ending::ForceRelease => {
                let _ = shared
                    .client
                    .force_release(&key, "chaos", "chaos: force release")
                    .await;
            }
            Ending::HoldTimeout => {}
        }
        let (w_outcome, w_answered_us) = waiter.await.expect("an ender's waiter");
        if matches!(ending, Ending::HoldTimeout) {
            shared.history.record_recovery(Recovery {
                key: lock_event_key(&key),
                cause: "a hold past its timeout",
                due_us: granted_us + HOLD_TIMEOUT.as_micros() as u64,
                granted_us: matches!(w_outcome, Outcome::Ok(Value::Granted(_)))
                    .then_some(w_answered_us),
                answered_us: w_answered_us,
                in_memory: false,
            });
        }
        match w_outcome {
            Outcome::Ok(Value::Granted(next)) => {
                use_and_release(&shared, process + 1, &key, &w, next, &mut rng).await;
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {}
            Outcome::Unknown(_) | Outcome::Pending => {
                shared.revoke(process + 1, &w).await;
            }
        }
        if !matches!(
            shared.release(process, &key, &h, token).await,
            Outcome::Ok(_)
        ) {
            shared.revoke(process, &h).await;
        }
    }
}

/// A re-create round's reports, as the bridge makes them, and a bind to
/// the new machine on the node's other lock (free: the round's holder and
/// waiter are on the first), taken for the new object (format 10): refused
/// while the old object is registered, taken once the new one has joined,
/// and left by a lagging reporter's late `Gone` of the old object; the
/// `nodes` checker judges how the log ended it. Each answer is what the
/// checkers judge by the log: a refused report leaves nothing there, an
/// applied one does.
async fn recreate_node(shared: &Shared, process: u64, name: &str) {
    let other_lock = pb::LockKey {
        scope: HOLD_TIMEOUT_SCOPE.into(),
        name: name.to_string(),
    };
    shared.track_lock(&other_lock);
    let binder = format!("{name}n");
    let new_object = format!("{name}-{NEW_OBJECT}");
    let bind = || shared.acquire_for_object(process, &other_lock, &binder, name, &new_object);
    // The new object reported while the old one is registered (refused),
    // and a bind to the new machine (refused likewise).
    let _ = report_ender_node(shared, name, NEW_OBJECT, pb::NodeState::NodeReady).await;
    let early = bind().await;
    for (object, state) in [
        (OLD_OBJECT, pb::NodeState::NodeGone),
        (NEW_OBJECT, pb::NodeState::NodeJoined),
        (NEW_OBJECT, pb::NodeState::NodeReady),
    ] {
        let _ = report_ender_node(shared, name, object, state).await;
    }
    let taken = match early {
        Outcome::Ok(Value::Granted(token)) => Outcome::Ok(Value::Granted(token)),
        _ => bind().await,
    };
    for state in [pb::NodeState::NodeReady, pb::NodeState::NodeGone] {
        let _ = report_ender_node(shared, name, OLD_OBJECT, state).await;
    }
    // Given up: released with its token, or (an answer lost) revoked.
    let released = match taken {
        Outcome::Ok(Value::Granted(token)) => {
            shared.release(process, &other_lock, &binder, token).await
        }
        Outcome::Ok(_) | Outcome::Fail(_) => return,
        Outcome::Unknown(_) | Outcome::Pending => Outcome::Pending,
    };
    if !matches!(released, Outcome::Ok(Value::Released)) {
        shared.revoke(process, &binder).await;
    }
}

/// The UID suffix of the node object an ender round's lock is first named
/// after, and of the object re-created under its name.
const OLD_OBJECT: &str = "uid";
const NEW_OBJECT: &str = "uid2";

/// Reports the node an ender round's lock is named after, as its `object`
/// (one UID per round's node and object).
async fn report_ender_node(
    shared: &Shared,
    name: &str,
    object: &str,
    state: pb::NodeState,
) -> tether_client::Result<()> {
    shared
        .client
        .report_node(pb::ReportNodeRequest {
            name: name.to_string(),
            uid: format!("{name}-{object}"),
            state: state as i32,
            ..Default::default()
        })
        .await
        .map(|_| ())
}
