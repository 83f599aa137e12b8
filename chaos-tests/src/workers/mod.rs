//! The chaos workload: client workers that keep operating while faults hit,
//! recording every operation in the [`History`].
//!
//! - **try-lock workers** take one of the run's try-locks (no queue), use
//!   the shadow resource with their fencing token (read, pause, write), and
//!   release; when an outcome is unknown they revoke their pod so the lock
//!   is not left held;
//! - **queue workers** wait in one lock's FIFO queue, hold briefly, release;
//! - a **lease worker** holds and queues on TTL leases that it stops keeping
//!   alive, two leases at a time, so that both end in one sweep with a third
//!   pod queued behind them;
//! - an **ender** ends holds the other ways, each on a fresh lock with a
//!   holder and a waiter: the lock's node reported gone, a force release,
//!   and the hold timeout of scope [`HOLD_TIMEOUT_SCOPE`];
//! - a **revoker** revokes pods that currently hold, as the bridge does when
//!   a pod is deleted mid-bind, and deletes pods as their acquire goes out
//!   (acquire and revoke sent at once, so that they share batch entries);
//! - a **pin lifetime worker** assigns a pin with a 600 ms lifetime, reports
//!   its pod terminal and waits for the pin to expire, then again for a new
//!   pod;
//! - a **pin assigner** places the run's pins with one-per-node
//!   anti-affinity, racing itself;
//! - a **watcher** follows the run's lock events through every fault;
//! - the **retry storm** (duplicates, reconnects and a forging caller under
//!   one client session) is in `storm.rs`, the **abandoner** (queued callers
//!   that go away, and come back) in `abandon.rs`.
//!
//! One file per worker (`locks.rs`: try-lock and queue workers, `lease.rs`,
//! `ender.rs`, `revoker.rs`, `pins.rs`: assigner and lifetimes,
//! `watcher.rs`); this file holds what they share: the run's constants, the
//! shadow resource and [`Shared`], whose calls record the history.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_client::proto as pb;
use tether_client::{Client, Error, WatchUpdate};

use crate::history::{Call, History, Outcome, Recovery, ShadowWrite, Value, error_outcome};
use crate::rng::Rng;

mod ender;
mod lease;
mod locks;
mod pins;
mod revoker;
mod watcher;

pub use ender::ender;
pub use lease::lease_worker;
pub use locks::{queue_worker, try_lock_worker};
pub use pins::{
    PIN_LIFETIME, pin_assigner, pin_lifetime_event_key, pin_lifetimes, register_pin_nodes,
};
pub use revoker::revoker;
pub use watcher::{watched_as_of, watcher, watcher_passed};

/// The scope every chaos lock lives in.
pub const SCOPE: &str = "chaos";

/// The scope whose holds time out quickly on the chaos clusters
/// (`--scope-hold-timeouts`, see [`HOLD_TIMEOUT`]).
pub const HOLD_TIMEOUT_SCOPE: &str = "chaos-ht";

/// The hold timeout of [`HOLD_TIMEOUT_SCOPE`].
pub const HOLD_TIMEOUT: Duration = Duration::from_millis(500);

/// Nodes the pin assigner places pins on (registered once per cluster).
pub const PIN_NODES: [&str; 4] = [
    "chaos-node-0",
    "chaos-node-1",
    "chaos-node-2",
    "chaos-node-3",
];

/// `lock/<scope>/<name>`, the event key of a lock.
pub fn lock_event_key(key: &pb::LockKey) -> String {
    format!("lock/{}/{}", key.scope, key.name)
}

/// The resource the locks protect: it refuses any token below the highest
/// it has seen, on reads and writes (Kleppmann's fencing).
#[derive(Default)]
pub struct Shadow {
    /// Per lock key: (highest token seen, value).
    cells: Mutex<HashMap<String, (u64, u64)>>,
    writes: Mutex<Vec<ShadowWrite>>,
}

impl Shadow {
    /// Reads with `token`; None when the token is stale.
    pub fn read(&self, key: &str, token: u64) -> Option<u64> {
        let mut cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        let cell = cells.entry(key.to_string()).or_default();
        if token < cell.0 {
            return None;
        }
        cell.0 = token;
        Some(cell.1)
    }

    /// Writes `read + 1` with `token`; false when the token is stale.
    pub fn write(&self, key: &str, token: u64, read: u64) -> bool {
        let mut cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        let cell = cells.entry(key.to_string()).or_default();
        if token < cell.0 {
            return false;
        }
        self.writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ShadowWrite {
                key: key.to_string(),
                token,
                read,
                found: cell.1,
            });
        *cell = (token, read + 1);
        true
    }

    /// Accepted writes so far.
    pub fn writes(&self) -> Vec<ShadowWrite> {
        self.writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What the workers share.
pub struct Shared {
    /// The cluster.
    pub client: Client,
    /// The cluster through another client (its own session): a second
    /// bind attempt of a pod through another extender replica.
    pub second_client: Client,
    /// Where operations are recorded.
    pub history: History,
    /// The fenced resource.
    pub shadow: Shadow,
    /// Pods holding a lock right now (revoke candidates).
    pub holding: Mutex<Vec<String>>,
    /// Set when the workload should wind down.
    pub stop: AtomicBool,
    /// When the workload is due to end: workers whose rounds are long
    /// start none that would run past it ([`Shared::may_start`]).
    pub workload_ends: tokio::time::Instant,
    /// Run prefix: every key and pod UID of the run starts with it.
    pub prefix: String,
    /// Locks the workers made up as they went (the ender's), for the
    /// runner to read their logs.
    pub extra_locks: Mutex<Vec<pb::LockKey>>,
    /// Nodes the workers reported (the ender's), for the runner to read
    /// their logs.
    pub extra_nodes: Mutex<Vec<String>>,
    /// The claimer's claims made again by a second attempt, whose first
    /// attempt's release on condition of its label was answered: members
    /// of the claims set that must stand at the end, as the second attempt
    /// made them.
    pub remade_claims: Mutex<Vec<String>>,
    /// Holds that may have been granted for a node object the acquire
    /// named (the ender's re-create rounds): none may end with another
    /// object's `Gone`.
    pub taken_for_objects: Mutex<Vec<TakenForObject>>,
}

/// A hold taken for a node object ([`Shared::acquire_for_object`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenForObject {
    /// The lock's event key, `lock/<scope>/<name>`.
    pub lock: String,
    /// The pod it was taken for.
    pub pod_uid: String,
    /// The node the lock is named after.
    pub node: String,
    /// The UID of the node object it was taken for.
    pub object: String,
}

/// What an acquire's answer says of it.
fn acquire_outcome(result: tether_client::Result<tether_client::Held>, wait: Duration) -> Outcome {
    match result {
        Ok(held) => Outcome::Ok(Value::Granted(held.token())),
        Err(Error::FailedPrecondition(_)) if wait.is_zero() => Outcome::Ok(Value::Busy),
        Err(Error::Aborted(message)) if message.contains(crate::abandon::ABANDONED_MESSAGE) => {
            Outcome::Ok(Value::Abandoned)
        }
        Err(Error::Aborted(_)) => Outcome::Ok(Value::Busy),
        Err(err) => error_outcome(&err),
    }
}

impl Shared {
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Whether a round that takes about `round` may start: not once the
    /// workload is winding down, nor when it would end past the workload's
    /// end. The runner waits for every round in progress before it heals
    /// and reads the log, so a long round begun in the workload's last
    /// moments only lengthens the run (a TTL lease's round was the last to
    /// stop in 29 of 40 schedules, 1.3 s after the workload, median).
    pub(crate) fn may_start(&self, round: Duration) -> bool {
        !self.stopped() && tokio::time::Instant::now() + round <= self.workload_ends
    }

    /// Keeps a lock a worker made up (not one of the run's own), so that
    /// the runner reads its log.
    pub(crate) fn track_lock(&self, key: &pb::LockKey) {
        self.extra_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.clone());
    }

    pub(crate) fn pod(&self, uid: &str) -> pb::Pod {
        pb::Pod {
            uid: uid.to_string(),
            namespace: "chaos".into(),
            name: uid.to_string(),
        }
    }

    /// A lock of this run.
    pub fn lock(&self, name: &str) -> pb::LockKey {
        pb::LockKey {
            scope: SCOPE.into(),
            name: format!("{}-{name}", self.prefix),
        }
    }

    pub(crate) async fn acquire(
        &self,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
        wait: Duration,
    ) -> Outcome {
        self.acquire_on_lease(process, key, uid, wait, 0, None)
            .await
    }

    /// An acquire whose hold and wait belong to TTL lease `lease_id` (0 =
    /// none); `queued`, if given, is sent on once the acquire is told it
    /// waits in the queue (dropped unsent if it never is).
    pub(crate) async fn acquire_on_lease(
        &self,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
        wait: Duration,
        lease_id: u64,
        queued: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Outcome {
        self.acquire_through(&self.client, process, key, uid, wait, lease_id, queued)
            .await
    }

    /// [`Shared::acquire_on_lease`] through `client`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn acquire_through(
        &self,
        client: &Client,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
        wait: Duration,
        lease_id: u64,
        queued: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Outcome {
        let event_key = lock_event_key(key);
        let call = Call::Acquire {
            uid: uid.to_string(),
            wait_ms: wait.as_millis() as u64,
        };
        let invoked = self.history.invoke(process, &event_key, call);
        let queued = Mutex::new(queued);
        let result = client
            .acquire_with_progress(
                key,
                &self.pod(uid),
                Vec::new(),
                wait,
                lease_id,
                |progress| {
                    if matches!(progress, tether_client::AcquireProgress::Queued(_))
                        && let Some(queued) =
                            queued.lock().unwrap_or_else(|p| p.into_inner()).take()
                    {
                        let _ = queued.send(());
                    }
                },
            )
            .await;
        let outcome = acquire_outcome(result, wait);
        self.history.complete(invoked, outcome.clone());
        outcome
    }

    /// A try-acquire (wait 0) of `key`, a lock named after node `node`, for
    /// pod `uid`, taken for the node object with UID `node_uid` (format
    /// 10): `Rejected` while Tether has another object registered under
    /// the name. One that may have been granted is recorded for the
    /// `nodes` checker.
    pub(crate) async fn acquire_for_object(
        &self,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
        node: &str,
        node_uid: &str,
    ) -> Outcome {
        let event_key = lock_event_key(key);
        let call = Call::Acquire {
            uid: uid.to_string(),
            wait_ms: 0,
        };
        let invoked = self.history.invoke(process, &event_key, call);
        let result = self
            .client
            .acquire_for_node_object(
                key,
                node_uid,
                &self.pod(uid),
                Vec::new(),
                Duration::ZERO,
                0,
                |_| {},
            )
            .await;
        let outcome = match result {
            Err(Error::FailedPrecondition(message)) if message.contains("node object") => {
                Outcome::Ok(Value::Rejected)
            }
            result => acquire_outcome(result, Duration::ZERO),
        };
        if matches!(
            outcome,
            Outcome::Ok(Value::Granted(_)) | Outcome::Unknown(_) | Outcome::Pending
        ) {
            self.taken_for_objects
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(TakenForObject {
                    lock: event_key,
                    pod_uid: uid.to_string(),
                    node: node.to_string(),
                    object: node_uid.to_string(),
                });
        }
        self.history.complete(invoked, outcome.clone());
        outcome
    }

    pub(crate) async fn release(
        &self,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
        token: u64,
    ) -> Outcome {
        let call = Call::Release {
            uid: uid.to_string(),
            token,
        };
        let invoked = self.history.invoke(process, &lock_event_key(key), call);
        let outcome = match self
            .client
            .release(key, uid, token, pb::Outcome::Allocated)
            .await
        {
            Ok(_) => Outcome::Ok(Value::Released),
            Err(Error::FailedPrecondition(_)) => Outcome::Ok(Value::Rejected),
            Err(err) => error_outcome(&err),
        };
        self.history.complete(invoked, outcome.clone());
        outcome
    }

    /// Withdraws pod `uid`'s acquire of `key` through `client`.
    pub(crate) async fn withdraw(
        &self,
        client: &Client,
        process: u64,
        key: &pb::LockKey,
        uid: &str,
    ) -> Outcome {
        let call = Call::Withdraw {
            uid: uid.to_string(),
        };
        let invoked = self.history.invoke(process, &lock_event_key(key), call);
        let outcome = match client.withdraw(key, uid).await {
            Ok(answer) => match answer.given_back {
                Some(hold) => Outcome::Ok(Value::GaveBack(hold.token)),
                None => Outcome::Ok(Value::Rejected),
            },
            Err(err) => error_outcome(&err),
        };
        self.history.complete(invoked, outcome.clone());
        outcome
    }

    pub(crate) async fn revoke(&self, process: u64, uid: &str) -> Outcome {
        let call = Call::RevokePod {
            uid: uid.to_string(),
        };
        let invoked = self.history.invoke(process, "", call);
        let outcome = match self.client.revoke_pod(uid, "chaos: pod deleted").await {
            Ok(response) => Outcome::Ok(Value::Revoked(
                response.released.iter().map(lock_event_key).collect(),
            )),
            Err(err) => error_outcome(&err),
        };
        self.history.complete(invoked, outcome.clone());
        outcome
    }

    fn set_holding(&self, uid: &str, holding: bool) {
        let mut list = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|u| u != uid);
        if holding {
            list.push(uid.to_string());
        }
    }
}

/// Uses the shadow resource with `token`, then releases; an unknown release
/// revokes the pod so nothing stays held.
pub(crate) async fn use_and_release(
    shared: &Shared,
    process: u64,
    key: &pb::LockKey,
    uid: &str,
    token: u64,
    rng: &mut Rng,
) {
    let event_key = lock_event_key(key);
    if let Some(read) = shared.shadow.read(&event_key, token) {
        tokio::time::sleep(Duration::from_millis(rng.between(0, 4))).await;
        shared.shadow.write(&event_key, token, read);
    }
    if !matches!(
        shared.release(process, key, uid, token).await,
        Outcome::Ok(_)
    ) {
        shared.revoke(process, uid).await;
    }
}
