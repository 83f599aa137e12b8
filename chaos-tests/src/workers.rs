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
//!   a pod is deleted mid-bind;
//! - a **pin lifetime worker** assigns a pin with a 600 ms lifetime, reports
//!   its pod terminal and waits for the pin to expire, then again for a new
//!   pod;
//! - a **pin assigner** places the run's pins with one-per-node
//!   anti-affinity, racing itself;
//! - a **watcher** follows the run's lock events through every fault;
//! - the **retry storm** (duplicates, reconnects and a forging caller under
//!   one client session) is in `storm.rs`, the **abandoner** (queued callers
//!   that go away, and come back) in `abandon.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_client::proto as pb;
use tether_client::{Client, Error, WatchUpdate};

use crate::history::{Call, History, Outcome, Recovery, ShadowWrite, Value, error_outcome};
use crate::rng::Rng;

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
    /// Where operations are recorded.
    pub history: History,
    /// The fenced resource.
    pub shadow: Shadow,
    /// Pods holding a lock right now (revoke candidates).
    pub holding: Mutex<Vec<String>>,
    /// Set when the workload should wind down.
    pub stop: AtomicBool,
    /// Run prefix: every key and pod UID of the run starts with it.
    pub prefix: String,
    /// Locks the workers made up as they went (the ender's), for the
    /// runner to read their logs.
    pub extra_locks: Mutex<Vec<pb::LockKey>>,
}

impl Shared {
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
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
        let event_key = lock_event_key(key);
        let call = Call::Acquire {
            uid: uid.to_string(),
            wait_ms: wait.as_millis() as u64,
        };
        let invoked = self.history.invoke(process, &event_key, call);
        let queued = Mutex::new(queued);
        let result = self
            .client
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
        let outcome = match result {
            Ok(held) => Outcome::Ok(Value::Granted(held.token())),
            Err(Error::FailedPrecondition(_)) if wait.is_zero() => Outcome::Ok(Value::Busy),
            Err(Error::Aborted(message)) if message.contains(crate::abandon::ABANDONED_MESSAGE) => {
                Outcome::Ok(Value::Abandoned)
            }
            Err(Error::Aborted(_)) => Outcome::Ok(Value::Busy),
            Err(err) => error_outcome(&err),
        };
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

/// Try-acquire, fenced read-modify-write, release; until stopped.
pub async fn try_lock_worker(
    shared: Arc<Shared>,
    process: u64,
    locks: Vec<pb::LockKey>,
    mut rng: Rng,
) {
    let mut attempt = 0;
    while !shared.stopped() {
        attempt += 1;
        let key = rng.pick(&locks).clone();
        let event_key = lock_event_key(&key);
        let uid = format!("{}-p{process}-{attempt}", shared.prefix);
        match shared.acquire(process, &key, &uid, Duration::ZERO).await {
            Outcome::Ok(Value::Granted(token)) => {
                shared.set_holding(&uid, true);
                if let Some(read) = shared.shadow.read(&event_key, token) {
                    tokio::time::sleep(Duration::from_millis(rng.between(0, 4))).await;
                    shared.shadow.write(&event_key, token, read);
                }
                shared.set_holding(&uid, false);
                if !matches!(
                    shared.release(process, &key, &uid, token).await,
                    Outcome::Ok(_)
                ) {
                    shared.revoke(process, &uid).await;
                }
            }
            Outcome::Ok(_) | Outcome::Fail(_) => {
                tokio::time::sleep(Duration::from_millis(rng.between(1, 5))).await;
            }
            Outcome::Unknown(_) | Outcome::Pending => {
                // Maybe granted: do not leave the lock held by a pod that
                // will never release it.
                shared.revoke(process, &uid).await;
            }
        }
    }
}

/// Queue for one lock, hold briefly, release; until stopped.
pub async fn queue_worker(shared: Arc<Shared>, process: u64, key: pb::LockKey, mut rng: Rng) {
    let mut attempt = 0;
    while !shared.stopped() {
        attempt += 1;
        let uid = format!("{}-q{process}-{attempt}", shared.prefix);
        match shared
            .acquire(process, &key, &uid, Duration::from_secs(3))
            .await
        {
            Outcome::Ok(Value::Granted(token)) => {
                shared.set_holding(&uid, true);
                tokio::time::sleep(Duration::from_millis(rng.between(1, 8))).await;
                shared.set_holding(&uid, false);
                if !matches!(
                    shared.release(process, &key, &uid, token).await,
                    Outcome::Ok(_)
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

/// TTL-lease holders that stop keeping alive, until stopped. Each round
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
    mut rng: Rng,
) {
    let mut round = 0;
    while !shared.stopped() {
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
        let abandoned = matches!(held, Outcome::Ok(Value::Granted(_))) && round % 2 == 1;
        match held {
            Outcome::Ok(Value::Granted(token)) if round % 2 == 0 => {
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
}

/// Ends holds the ways the other workers do not, until stopped. Each round
/// takes a fresh lock: pod `h` takes it, pod `w` queues behind it, and the
/// hold is ended by its node being reported gone, a force release, or the
/// hold timeout of [`HOLD_TIMEOUT_SCOPE`], in turn. Then `w` uses and
/// releases what it was granted, and `h` tries its release (refused, unless
/// the end did not happen). Pods `h` and `w` are processes `process` and
/// `process + 1`.
pub async fn ender(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    let mut round = 0u64;
    while !shared.stopped() {
        round += 1;
        let ending =
            [Ending::NodeGone, Ending::ForceRelease, Ending::HoldTimeout][(round % 3) as usize];
        let name = format!("{}-e{process}-{round}", shared.prefix);
        let key = pb::LockKey {
            scope: match ending {
                Ending::HoldTimeout => HOLD_TIMEOUT_SCOPE.into(),
                _ => SCOPE.into(),
            },
            name: name.clone(),
        };
        shared
            .extra_locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.clone());
        if matches!(ending, Ending::NodeGone)
            && report_ender_node(&shared, &name, pb::NodeState::NodeReady)
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
        // the progress bound after it.
        let w_wait = match ending {
            Ending::HoldTimeout => {
                HOLD_TIMEOUT + crate::checkers::progress::BOUND + Duration::from_secs(2)
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
                let _ = report_ender_node(&shared, &name, pb::NodeState::NodeGone).await;
            }
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

/// Reports the node an ender round's lock is named after (one UID per
/// round's node).
async fn report_ender_node(
    shared: &Shared,
    name: &str,
    state: pb::NodeState,
) -> tether_client::Result<()> {
    shared
        .client
        .report_node(pb::ReportNodeRequest {
            name: name.to_string(),
            uid: format!("{name}-uid"),
            state: state as i32,
            ..Default::default()
        })
        .await
        .map(|_| ())
}

/// Revokes a random current holder now and then, like a pod deleted
/// mid-bind.
pub async fn revoker(shared: Arc<Shared>, process: u64, mut rng: Rng) {
    while !shared.stopped() {
        tokio::time::sleep(Duration::from_millis(rng.between(50, 250))).await;
        let victim = {
            let list = shared.holding.lock().unwrap_or_else(|p| p.into_inner());
            (!list.is_empty()).then(|| rng.pick(&list).clone())
        };
        if let Some(uid) = victim {
            shared.revoke(process, &uid).await;
        }
    }
}

/// Required anti-affinity "one per node" against the pins labelled
/// `label=value`.
fn one_per_node(label: &str, value: &str) -> pb::Affinity {
    let selector = pb::LabelSelector {
        match_labels: HashMap::from([(label.to_string(), value.to_string())]),
        match_expressions: vec![],
    };
    pb::Affinity {
        required_anti: vec![pb::AffinityTerm {
            label_selector: Some(selector),
            topology_key: "kubernetes.io/hostname".into(),
        }],
        ..Default::default()
    }
}

/// [`PIN_NODES`] in a seeded order, so assignment races differ per
/// schedule.
fn shuffled_pin_nodes(rng: &mut Rng) -> Vec<String> {
    let mut candidates: Vec<String> = PIN_NODES.iter().map(|n| n.to_string()).collect();
    for i in (1..candidates.len()).rev() {
        candidates.swap(i, rng.below(i as u64 + 1) as usize);
    }
    candidates
}

/// Pins of the run: `members` pins of set `prefix`, one per node at most.
pub async fn pin_assigner(shared: Arc<Shared>, process: u64, members: usize, mut rng: Rng) {
    let affinity = one_per_node("run", &shared.prefix);
    for member in 0..members {
        if shared.stopped() {
            return;
        }
        let key = pb::PinKey {
            set: shared.prefix.clone(),
            member: member.to_string(),
        };
        let event_key = format!("pin/{}/{}", key.set, key.member);
        let uid = format!("{}-pin{member}", shared.prefix);
        let candidates = shuffled_pin_nodes(&mut rng);
        for _ in 0..3 {
            let invoked =
                shared
                    .history
                    .invoke(process, &event_key, Call::Assign { uid: uid.clone() });
            let result = shared
                .client
                .assign(
                    &key,
                    candidates.clone(),
                    &uid,
                    Duration::ZERO,
                    HashMap::from([("run".to_string(), shared.prefix.clone())]),
                    affinity.clone(),
                )
                .await;
            let outcome = match result {
                Ok(response) => Outcome::Ok(Value::Assigned(
                    response.pin.map(|p| p.node).unwrap_or_default(),
                )),
                Err(Error::FailedPrecondition(_)) => Outcome::Ok(Value::Unsatisfiable),
                Err(err) => error_outcome(&err),
            };
            let definite = matches!(outcome, Outcome::Ok(_) | Outcome::Fail(_));
            shared.history.complete(invoked, outcome);
            if definite {
                break;
            }
        }
    }
}

/// Lifetime of the pins of [`pin_lifetimes`].
pub const PIN_LIFETIME: Duration = Duration::from_millis(600);

/// The event key of the pin [`pin_lifetimes`] assigns in a run of `prefix`.
pub fn pin_lifetime_event_key(prefix: &str) -> String {
    format!("pin/{prefix}-life/0")
}

/// Pins with a lifetime, one member of set `{prefix}-life`, `rounds` times:
/// assign it for a new pod (one per node, like the run's other pins, among
/// the pins of this set), report that pod terminal as the bridge would, and
/// wait for the pin to expire ([`PIN_LIFETIME`] after its owner stopped, on
/// committed time, once the leader has led that long). The next round's
/// assignment may land on another node. The pins checker checks from the
/// log that no pin expired before its lifetime.
pub async fn pin_lifetimes(shared: Arc<Shared>, process: u64, rounds: usize, mut rng: Rng) {
    let set = format!("{}-life", shared.prefix);
    let affinity = one_per_node("life", &shared.prefix);
    let key = pb::PinKey {
        set: set.clone(),
        member: "0".into(),
    };
    let event_key = pin_lifetime_event_key(&shared.prefix);
    for round in 0..rounds {
        if shared.stopped() {
            return;
        }
        let uid = format!("{}-life{round}", shared.prefix);
        let candidates = shuffled_pin_nodes(&mut rng);
        let invoked = shared
            .history
            .invoke(process, &event_key, Call::Assign { uid: uid.clone() });
        let result = shared
            .client
            .assign(
                &key,
                candidates,
                &uid,
                PIN_LIFETIME,
                HashMap::from([("life".to_string(), shared.prefix.clone())]),
                affinity.clone(),
            )
            .await;
        let outcome = match &result {
            Ok(response) => Outcome::Ok(Value::Assigned(
                response
                    .pin
                    .as_ref()
                    .map(|p| p.node.clone())
                    .unwrap_or_default(),
            )),
            Err(Error::FailedPrecondition(_)) => Outcome::Ok(Value::Unsatisfiable),
            Err(err) => error_outcome(err),
        };
        shared.history.complete(invoked, outcome);
        // The owner stops (reported again until it is known to be): the
        // countdown starts. Then until the pin expires. A round that cannot
        // see its pin gone in time ends the worker, so the next assignment
        // never takes over a pin that still stands.
        let give_up = tokio::time::Instant::now() + Duration::from_secs(15);
        let mut reported = false;
        loop {
            if shared.stopped() || tokio::time::Instant::now() >= give_up {
                return;
            }
            if !reported {
                reported = shared
                    .client
                    .report_pod(&uid, pb::PodPhase::PodTerminal)
                    .await
                    .is_ok();
            } else {
                match shared.client.get_pin(&key).await {
                    Ok(Some(pin)) if pin.pod_uid == uid => {}
                    Ok(Some(_)) => return,
                    Ok(None) => break,
                    Err(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Follows `prefix` from `start` until it has received the event at
/// `until` (set once the run's last event is known) or is stopped; returns
/// what it received and how many times it was told to re-list. Transient
/// errors are retried from the last position, as a user would.
pub async fn watcher(
    client: Client,
    start: pb::Revision,
    prefix: String,
    stop: Arc<AtomicBool>,
    until: Arc<Mutex<Option<(u64, u32)>>>,
) -> (Vec<pb::Event>, u64) {
    let mut received: Vec<pb::Event> = Vec::new();
    let mut relists = 0;
    let mut position = start;
    let reached = |received: &[pb::Event]| {
        let target = *until.lock().unwrap_or_else(|p| p.into_inner());
        target.is_some_and(|t| watcher_passed(received, t))
    };
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut watch) = client.watch(Some(position), vec![], &prefix).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        loop {
            if reached(&received) || stop.load(Ordering::SeqCst) {
                return (received, relists);
            }
            match tokio::time::timeout(Duration::from_millis(200), watch.next()).await {
                Err(_) => {}
                Ok(Ok(WatchUpdate::Events(events))) => received.extend(events),
                Ok(Ok(WatchUpdate::Relist { resume_at, .. })) => {
                    relists += 1;
                    received.push(pb::Event {
                        kind: crate::checkers::watch::RELIST.into(),
                        revision: Some(resume_at),
                        ..Default::default()
                    });
                }
                Ok(Err(_)) => break,
            }
            position = watch.position();
        }
    }
    (received, relists)
}

/// Whether a watcher that received `received` is past revision `target`:
/// it received that event or a later one, or it was told to re-list and
/// continue beyond it (its position was compacted away on the replica it
/// resumed on).
pub fn watcher_passed(received: &[pb::Event], target: (u64, u32)) -> bool {
    let Some(last) = received.last() else {
        return false;
    };
    let Some(revision) = last.revision.map(|r| (r.index, r.sub)) else {
        return false;
    };
    if last.kind == crate::checkers::watch::RELIST {
        revision > target
    } else {
        revision >= target
    }
}

/// Registers the pin nodes (idempotent).
pub async fn register_pin_nodes(client: &Client) -> tether_client::Result<()> {
    for name in PIN_NODES {
        client
            .report_node(pb::ReportNodeRequest {
                name: name.to_string(),
                uid: format!("{name}-uid"),
                state: pb::NodeState::NodeReady as i32,
                set_labels: true,
                labels: BTreeMap::from([("kubernetes.io/hostname".to_string(), name.to_string())])
                    .into_iter()
                    .collect(),
                unschedulable: Some(false),
                ..Default::default()
            })
            .await?;
    }
    Ok(())
}
