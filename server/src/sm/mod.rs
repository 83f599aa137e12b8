//! The replicated state machine: domain state, commands and their
//! deterministic application.
//!
//! `apply` is a pure function of (state, log index, request): no wall clock,
//! no randomness, no I/O. Time enters only as the leader's stamp on each
//! entry (`leader_time_ms`), folded into a monotonic `now_ms`. Re-applying
//! the same entries to the same state yields the same state, events and
//! responses, which is what makes crash recovery (re-apply from the last
//! durable `last_applied`) and snapshots safe.
//!
//! # Layout
//! - `types.rs` — locks, holds, waiters, leases, pins, nodes, reasons.
//! - `event.rs` — what applying an entry emits.
//! - `command/` — one file per command, each with its `apply`; `batch.rs`
//!   applies several clients' lock commands in one entry, `sweep.rs` ends
//!   what has timed out.
//! - `pin_table.rs` — the pins, indexed by node and by owning pod.
//! - `affinity.rs` — where `Assign` places a pin (required terms filter,
//!   preferred terms order).
//! - `tests.rs` — the per-entry property test and its planted bugs.

// Command errors are values of the replicated state (kept in the dedupe table
// and returned whole), not errors bubbling through hot paths: their size is
// the size of what they report.
#![allow(clippy::result_large_err)]

pub mod affinity;
pub mod command;
pub mod event;
pub mod pin_table;
pub mod sweep_index;
pub mod types;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use pin_table::PinTable;

pub use command::{
    BATCH_FORMAT_VERSION, Batch, BatchItem, BatchRole, Command, CommandError,
    DEFERRED_GRANTS_FORMAT_VERSION, LOCKLESS_BATCH_FORMAT_VERSION, MAX_BATCH_ITEMS,
    NODE_UID_FORMAT_VERSION, Reply, SHARED_LOCK_BATCH_FORMAT_VERSION, batch_role, batchable_lock,
};
pub use event::{Event, EventKind, Revision};
pub use types::*;

/// Format version of log entries and snapshots written by this build. A
/// replica that meets a newer version stops instead of guessing.
/// 1: the first; 2: adds `Command::Audit` and `EventKind::AdminAction`;
/// 3: adds `Command::Batch`; 4: lets a batch carry several commands on one
/// lock; 5: a sweep ends everything that is due before it grants any freed
/// lock, each at most once ([`DEFERRED_GRANTS_FORMAT_VERSION`]), and a gone
/// node comes back only under a new UID ([`NODE_UID_FORMAT_VERSION`]); 6:
/// a client session keeps each answer with its command's fingerprint and
/// its floor moves only over sequences it has seen
/// ([`SESSION_BINDING_FORMAT_VERSION`]), a sweep forgets the phases of pods
/// nothing names ([`command::POD_CLEANUP_FORMAT_VERSION`]), a caller's
/// abandoned wait is given up unless a retry came back for it
/// (`AbandonWait`), and snapshots keep what sessions gained
/// ([`SNAPSHOT_FORMAT_VERSION`]); 7: an abandoned wait's grant that nobody
/// took up is given back, a caller can withdraw an acquire, wait or hold,
/// in one command, and a device claim is corrected in one command
/// (`Reclaim`) ([`command::GIVE_BACK_FORMAT_VERSION`]); 8: a node report
/// naming another node object than the registered one is refused
/// ([`command::NODE_REPLACED_FORMAT_VERSION`]); 9: another client's acquire
/// of a pod takes the pod's hold (new token) or wait over, a withdrawal
/// ends only the withdrawing client's own, and a pin can be released on
/// condition of its labels ([`command::TAKEOVER_FORMAT_VERSION`]); 10: an
/// acquire, assignment or reclaim can name the node objects it is taken
/// for, refused when another is registered under a name
/// ([`command::NODE_OBJECT_FORMAT_VERSION`]); 11: a batch may carry
/// assignments and pod reports and revokes too, and refuses one that would
/// end a hold granted by the same entry ([`LOCKLESS_BATCH_FORMAT_VERSION`]).
///
/// An entry is written in the oldest format that can express it
/// ([`Command::format_version`]) and snapshots in [`SNAPSHOT_FORMAT_VERSION`],
/// so a replica of an older build keeps following a leader of this one: the
/// leader writes batches (3), batches naming a lock twice (4) and batches
/// with commands that name no lock (11) only once
/// every member has said that it reads them, and sweeps, node reports and
/// client requests in the newest format unless a member has said that it
/// reads only an older one (then in the oldest form, [`Command::oldest_form`]).
pub const FORMAT_VERSION: u16 = 11;

/// From this format a client request's answer is kept with the fingerprint
/// of its command, a retry is answered only when it carries the same
/// command ([`CommandError::RequestIdReused`] otherwise), and a request
/// moves its session's floor (`first_incomplete`) only over sequences the
/// session has already seen, so one request cannot put a client's next
/// requests out of reach.
pub const SESSION_BINDING_FORMAT_VERSION: u16 = 6;

/// Format version written in snapshots. 2 (also what format-1 snapshots
/// hold): the state as of format 2; 6: session answers carry fingerprints
/// ([`StoredAnswer`]). A snapshot shares the numbering of log entries, so a
/// build that reads up to format 5 refuses a format-6 snapshot with "upgrade
/// this replica" rather than misreading it. Format 7 changes no stored
/// shape that a format-6 member could meet: the only new answer a session
/// keeps (a withdrawal's `GaveBack`) exists once every member reads 7.
/// Nor does format 8: its one new answer (a refused node report's
/// `NodeObjectMismatch`) is written only once every member reads 8. Nor
/// format 9: its new answers (`TakenOver`, `PinLabelsDiffer`) come only
/// from its new commands, sent once every member reads 9.
pub const SNAPSHOT_FORMAT_VERSION: u16 = 6;

/// One log entry's application payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u16,
    /// For exactly-once: present on client requests, absent on commands the
    /// leader proposes itself (sweeps).
    pub request_id: Option<RequestId>,
    /// The leader's wall clock when it proposed the entry, ms since the epoch.
    pub leader_time_ms: u64,
    /// What to do.
    pub command: Command,
}

/// What openraft logs for an entry's payload: its format and command
/// (the command's fields are in its `Debug` form).
impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "format {} {:?}", self.format_version, self.command)
    }
}

impl Request {
    /// A request in the oldest format that can express `command` with the
    /// rules of this build: client requests (and batches, whose items are)
    /// in [`SESSION_BINDING_FORMAT_VERSION`] or later.
    pub fn new(request_id: Option<RequestId>, leader_time_ms: u64, command: Command) -> Self {
        let mut format_version = command.format_version();
        if request_id.is_some() || matches!(command, Command::Batch(_)) {
            format_version = format_version.max(SESSION_BINDING_FORMAT_VERSION);
        }
        Self {
            format_version,
            request_id,
            leader_time_ms,
            command,
        }
    }

    /// This request as the leader writes it while another member is known
    /// to read only formats up to `oldest_known` (a rolling upgrade): in that
    /// format, or its command's oldest form ([`Command::oldest_form`]) if
    /// that is newer, so the member reads it and applies it as its build
    /// does (every rule of a format applies from that format on, so a
    /// format-5 entry applies alike in builds of format 5 and 6). Unchanged
    /// when no member is known to be older. (Batches go out only once every
    /// member reads their format, `Proposer::batching`.)
    pub fn for_members(mut self, oldest_known: Option<u16>) -> Self {
        if let Some(format) = oldest_known.filter(|format| *format < self.format_version) {
            self.format_version = format.max(self.command.oldest_form());
        }
        self
    }
}

/// What a command returns: deterministic errors are part of the result (and
/// of the dedupe table), not failures of the state machine.
pub type CommandResult = Result<Reply, CommandError>;

/// The application response of one log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The command's result.
    pub result: CommandResult,
    /// True when this answer came from the dedupe table (a retry).
    pub deduplicated: bool,
}

impl Response {
    /// The response of an entry without a command (blank, membership).
    pub fn empty() -> Self {
        Self {
            result: Ok(Reply::Empty),
            deduplicated: false,
        }
    }
}

/// The whole replicated state. Everything here is in snapshots, but for
/// the sweep index, which is derived from the rest.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct State {
    /// Locks that have a holder or waiters. A lock with neither is dropped:
    /// tokens are log indexes, so a later grant has a higher token anyway.
    pub locks: BTreeMap<LockKey, Lock>,
    /// TTL leases by id.
    pub leases: BTreeMap<u64, TtlLease>,
    /// Dedupe table by client id.
    pub sessions: BTreeMap<String, ClientSession>,
    /// Committed time: the highest leader stamp applied so far.
    pub now_ms: u64,
    /// Pod-to-node pins (indexed by node and by owning pod).
    pub pins: PinTable,
    /// The node registry (live nodes, and tombstones of gone ones).
    pub nodes: BTreeMap<String, NodeInfo>,
    /// Reported phases of pods that are alive (starting or running); a pod
    /// absent here is unknown, terminal or gone.
    pub pods: BTreeMap<String, PodPhase>,
    /// What sweeps can end, by when ([`sweep_index`]): not serialized,
    /// equal to any other, built again for a state read back.
    #[serde(skip)]
    pub(crate) sweep_index: sweep_index::SweepIndex,
}

/// Printed as before the sweep index (a test reads a replica's state back
/// against the text an older build printed): the state alone.
impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("locks", &self.locks)
            .field("leases", &self.leases)
            .field("sessions", &self.sessions)
            .field("now_ms", &self.now_ms)
            .field("pins", &self.pins)
            .field("nodes", &self.nodes)
            .field("pods", &self.pods)
            .finish()
    }
}

/// The keys an entry changed, so the store writes only those.
#[derive(Debug, Default)]
pub struct Dirty {
    /// Locks changed (written, or deleted when gone from the state).
    pub locks: BTreeSet<LockKey>,
    /// Leases changed.
    pub leases: BTreeSet<u64>,
    /// Sessions changed.
    pub sessions: BTreeSet<String>,
    /// Pins changed.
    pub pins: BTreeSet<PinKey>,
    /// Nodes changed.
    pub nodes: BTreeSet<String>,
    /// Pods changed.
    pub pods: BTreeSet<String>,
}

impl Dirty {
    /// Folds another entry's changes into this one.
    pub fn merge(&mut self, other: Dirty) {
        self.locks.extend(other.locks);
        self.leases.extend(other.leases);
        self.sessions.extend(other.sessions);
        self.pins.extend(other.pins);
        self.nodes.extend(other.nodes);
        self.pods.extend(other.pods);
    }
}

/// A command's view of the state while one entry applies: the state, the
/// entry's index and committed time, and what it has changed and emitted.
pub struct Txn<'a> {
    /// The state being changed.
    pub state: &'a mut State,
    /// Log index of the entry: fencing token of any grant it makes.
    pub index: u64,
    /// Committed time of the entry.
    pub now_ms: u64,
    /// Events emitted so far, in order.
    pub events: Vec<Event>,
    /// Keys changed so far.
    pub dirty: Dirty,
    /// Format of the entry being applied: entries apply as they did when
    /// their format was the newest, so old logs replay to the same state.
    pub format_version: u16,
    /// Locks whose hold a command ended with [`Txn::end_hold`] and that are
    /// granted to their next waiter once that command is done.
    freed: BTreeSet<LockKey>,
    /// Planted bugs only (`failpoints` feature): locks whose next grant
    /// reuses the token of the hold just ended (see [`Txn::end_hold`]).
    #[cfg(feature = "failpoints")]
    reused_tokens: BTreeMap<LockKey, u64>,
}

impl Txn<'_> {
    /// Records an event with the next sub-index of this entry.
    pub fn emit(&mut self, kind: EventKind) {
        let sub = self.events.len() as u32;
        self.events.push(Event {
            revision: Revision {
                index: self.index,
                sub,
            },
            time_ms: self.now_ms,
            kind,
        });
    }

    /// The lock for `key`, created empty if absent; marks it dirty.
    pub fn lock_mut(&mut self, key: &LockKey) -> &mut Lock {
        self.dirty.locks.insert(key.clone());
        self.state.locks.entry(key.clone()).or_default()
    }

    /// Drops locks that have neither holder nor waiters among those this
    /// entry touched.
    fn drop_idle_locks(&mut self) {
        for key in &self.dirty.locks {
            if let Some(lock) = self.state.locks.get(key)
                && lock.holder.is_none()
                && lock.waiters.is_empty()
            {
                self.state.locks.remove(key);
            }
        }
    }

    /// Grants the lock to the head of its queue, if the lock is free and
    /// someone waits. The token is this entry's index.
    pub fn grant_next(&mut self, key: &LockKey) -> Option<Hold> {
        let (index, now) = (self.index, self.now_ms);
        #[cfg(feature = "failpoints")]
        let index = match self.lock_mut(key).waiters.is_empty() {
            true => index,
            false => self.reused_tokens.remove(key).unwrap_or(index),
        };
        let lock = self.lock_mut(key);
        if lock.holder.is_some() {
            return None;
        }
        let waiter = lock.waiters.pop_front()?;
        let hold = waiter.into_hold(index, now);
        lock.last_token = index;
        lock.holder = Some(hold.clone());
        self.emit(EventKind::LockGranted {
            key: key.clone(),
            hold: hold.clone(),
        });
        Some(hold)
    }

    /// Ends the current hold of `key` for `reason` without granting the
    /// lock: [`Txn::grant_freed`] grants it once the command has ended
    /// everything it ends. A command that ends holds of several owners (a
    /// sweep) must do it this way: granting as it goes could hand a lock to
    /// a waiter whose own end comes later in the same entry, and then to the
    /// next waiter under the same token.
    pub fn end_hold(&mut self, key: &LockKey, reason: ReleaseReason) -> Option<Hold> {
        let released = self.lock_mut(key).holder.take();
        // Deliberate bugs for the checkers' "can fail" tests: the next grant
        // after a force release, or a hold timeout, reuses the ended hold's
        // token. Only with the `failpoints` feature and
        // FAILPOINTS=sm-force-release-reuses-token=return (or
        // sm-hold-timeout-reuses-token).
        #[cfg(feature = "failpoints")]
        if let Some(hold) = &released {
            let planted = match &reason {
                ReleaseReason::Forced { .. } => "sm-force-release-reuses-token",
                ReleaseReason::HoldTimeout { .. } => "sm-hold-timeout-reuses-token",
                _ => "",
            };
            if !planted.is_empty() && fail::eval(planted, |_| ()).is_some() {
                self.reused_tokens.insert(key.clone(), hold.token);
            }
        }
        if let Some(hold) = &released {
            self.emit(EventKind::LockReleased {
                key: key.clone(),
                pod: hold.pod.clone(),
                token: hold.token,
                reason,
            });
            self.freed.insert(key.clone());
        }
        released
    }

    /// Grants every lock freed by [`Txn::end_hold`] to its next waiter, once
    /// each, in key order.
    pub fn grant_freed(&mut self) {
        for key in std::mem::take(&mut self.freed) {
            self.grant_next(&key);
        }
    }

    /// Ends the current hold of `key` for `reason` and grants the next
    /// waiter at once. Returns (released hold, next hold). Only for a
    /// command whose later steps cannot end the hold it grants (one lock, or
    /// one owner whose waits are all gone already).
    pub fn release_and_hand_over(
        &mut self,
        key: &LockKey,
        reason: ReleaseReason,
    ) -> (Option<Hold>, Option<Hold>) {
        let released = self.end_hold(key, reason);
        self.freed.remove(key);
        let next = self.grant_next(key);
        (released, next)
    }

    /// Ends pin `key` (if it exists) for `reason`; returns it.
    pub fn release_pin(&mut self, key: &PinKey, reason: PinReleaseReason) -> Option<Pin> {
        let pin = self.state.pins.remove(key)?;
        self.dirty.pins.insert(key.clone());
        self.emit(EventKind::PinReleased {
            key: key.clone(),
            node: pin.node.clone(),
            reason,
        });
        Some(pin)
    }

    /// Records what is known of the pod owning pins: `Running` refreshes
    /// `last_running_at`, `Stopped` starts the lifetime countdown from now.
    /// Returns true if any pin changed.
    pub fn set_pin_owner_state(&mut self, pod_uid: &str, owner: OwnerState) -> bool {
        let now = self.now_ms;
        let mut changed = false;
        let owned: Vec<PinKey> = self
            .state
            .pins
            .of_pod(pod_uid)
            .filter(|(_, pin)| pin.owner != owner)
            .map(|(key, _)| key.clone())
            .collect();
        for key in owned {
            self.state.pins.modify(&key, |pin| {
                if owner == OwnerState::Running || owner == OwnerState::Stopped {
                    pin.last_running_at_ms = now;
                }
                pin.owner = owner;
            });
            self.dirty.pins.insert(key);
            changed = true;
        }
        changed
    }

    /// Removes every wait on `key` matching `pred`, emitting `WaitEnded`.
    /// Returns true if any was removed.
    pub fn remove_waiters(
        &mut self,
        key: &LockKey,
        pred: impl Fn(&Waiter) -> bool,
        reason: WaitEndReason,
    ) -> bool {
        let lock = self.lock_mut(key);
        let mut removed = Vec::new();
        lock.waiters.retain(|w| {
            if pred(w) {
                removed.push(w.pod.clone());
                false
            } else {
                true
            }
        });
        let any = !removed.is_empty();
        for pod in removed {
            self.emit(EventKind::WaitEnded {
                key: key.clone(),
                pod,
                reason: reason.clone(),
            });
        }
        any
    }
}

/// Applies one request at log index `index`. Deterministic: the same state,
/// index and request always give the same result, events and state.
///
/// A request whose `(client_id, sequence)` was applied before is answered from
/// the dedupe table and changes nothing else. A batch applies its items in
/// order, each deduplicated on its own, and answers [`Reply::Batch`].
pub fn apply(state: &mut State, index: u64, request: &Request) -> (Response, Vec<Event>, Dirty) {
    let now_ms = state.now_ms.max(request.leader_time_ms);
    state.now_ms = now_ms;
    let mut txn = Txn {
        state,
        index,
        now_ms,
        events: Vec::new(),
        dirty: Dirty::default(),
        format_version: request.format_version,
        freed: BTreeSet::new(),
        #[cfg(feature = "failpoints")]
        reused_tokens: BTreeMap::new(),
    };
    let response = match &request.command {
        Command::Batch(batch) => {
            let checked = if request.request_id.is_some() {
                Err("a batch entry carries its items' request ids, not one of its own".into())
            } else {
                batch.check(request.format_version)
            };
            let replies = match checked {
                Ok(()) => batch
                    .items
                    .iter()
                    .map(|item| match ends_this_entrys_grant(&txn, &item.command) {
                        Some(reason) => Response {
                            result: Err(CommandError::InvalidBatch { reason }),
                            deduplicated: false,
                        },
                        None => apply_one(&mut txn, item.request_id.as_ref(), &item.command),
                    })
                    .collect(),
                Err(reason) => {
                    let refused = Response {
                        result: Err(CommandError::InvalidBatch { reason }),
                        deduplicated: false,
                    };
                    vec![refused; batch.items.len()]
                }
            };
            Response {
                result: Ok(Reply::Batch(replies)),
                deduplicated: false,
            }
        }
        command => apply_one(&mut txn, request.request_id.as_ref(), command),
    };
    // Once per entry: dropping idle locks after all of a batch's items
    // equals dropping after each (a lock freed by one item, a release or
    // from format 11 a revoke, and taken again by a later one keeps its
    // `stuck_token`, which names an older hold and so changes nothing).
    txn.drop_idle_locks();
    let Txn {
        state,
        events,
        dirty,
        ..
    } = txn;
    state.refresh_sweep_index(&dirty);
    (response, events, dirty)
}

/// Why a batch item may not apply, if it ends a hold that an earlier item of
/// the same entry granted: the hold's token is the entry's own index, and
/// letting the item through would let the lock be granted a second time
/// under the same token. A release presenting that token (no client could
/// have been told it when the entry was proposed) and, from format 11, a
/// terminal report or revoke of the pod holding it are refused, without
/// touching the dedupe table, so that a retry in a later entry is applied as
/// new (the leader proposes a refused report or revoke again on its own).
fn ends_this_entrys_grant(txn: &Txn<'_>, command: &Command) -> Option<String> {
    if let Command::Release(release) = command {
        let hold = txn.state.locks.get(&release.key)?.holder.as_ref()?;
        return (hold.token == txn.index && release.token == txn.index).then(|| {
            format!(
                "the release of lock {} presents token {}, granted by this same entry: a token \
                 can be released only after its grant was applied",
                release.key, release.token
            )
        });
    }
    let pod_uid = command::ends_holds_of(command)?;
    // A deliberate bug for the checkers' "can fail" tests: a batched report
    // or revoke ends whatever its pod holds, so a lock granted earlier in
    // the entry is granted again under the same token. Only with the
    // `failpoints` feature and FAILPOINTS=sm-batch-revoke-ends-own-grant=return.
    #[cfg(feature = "failpoints")]
    if fail::eval("sm-batch-revoke-ends-own-grant", |_| ()).is_some() {
        return None;
    }
    txn.state.locks.iter().find_map(|(key, lock)| {
        lock.holder
            .as_ref()
            .filter(|hold| hold.pod.uid == pod_uid && hold.token == txn.index)
            .map(|hold| {
                format!(
                    "pod {pod_uid} holds lock {key} under token {}, granted by this same entry: \
                     ending it here would grant the lock twice under one token; the pod's \
                     report or revoke goes in an entry of its own",
                    hold.token
                )
            })
    })
}

/// The answer to a retry of `command`, whose first answer was `stored`. An
/// acquire's answer says where the pod stands now, as of this entry: a
/// "granted" answer only while that very hold stands (else `HoldEnded`), a
/// "queued" one with the current position, or the hold the wait became, or
/// `WaitEnded`. Other commands get their first answer again.
fn current_answer(
    state: &State,
    command: &Command,
    stored: &CommandResult,
    format_version: u16,
) -> CommandResult {
    let Some(acquire) = command.acquire() else {
        return stored.clone();
    };
    let taken_over = |hold: &Hold| {
        format_version >= command::TAKEOVER_FORMAT_VERSION && hold.client_id != acquire.client_id
    };
    let lock = state.locks.get(&acquire.key);
    let holder = lock
        .and_then(|l| l.holder.as_ref())
        .filter(|h| h.pod.uid == acquire.pod.uid);
    match stored {
        Ok(Reply::Granted(hold)) => match holder {
            Some(current) if current.token == hold.token => stored.clone(),
            _ => Err(CommandError::HoldEnded {
                key: acquire.key.clone(),
                pod_uid: acquire.pod.uid.clone(),
                token: hold.token,
            }),
        },
        Ok(Reply::Queued { .. }) => {
            match (holder, lock.and_then(|l| l.position_of(&acquire.pod.uid))) {
                // A hold another client took over is not this request's
                // (format 9: its grant went to that client).
                (Some(current), _) if taken_over(current) => Err(CommandError::WaitEnded {
                    key: acquire.key.clone(),
                    pod_uid: acquire.pod.uid.clone(),
                }),
                (Some(current), _) => Ok(Reply::Granted(current.clone())),
                (None, Some(position)) => Ok(Reply::Queued {
                    position: position as u32,
                }),
                (None, None) => Err(CommandError::WaitEnded {
                    key: acquire.key.clone(),
                    pod_uid: acquire.pod.uid.clone(),
                }),
            }
        }
        _ => stored.clone(),
    }
}

/// Applies one client's command within `txn`, with the dedupe table.
fn apply_one(txn: &mut Txn<'_>, request_id: Option<&RequestId>, command: &Command) -> Response {
    // A deliberate bug for the checkers' "can fail" tests: no dedupe table
    // at all, so every retry and late copy of a request is applied again.
    // Only with the `failpoints` feature and FAILPOINTS=sm-dedupe-skip=return.
    #[cfg(feature = "failpoints")]
    let request_id = request_id.filter(|_| fail::eval("sm-dedupe-skip", |_| ()).is_none());
    let bound = txn.format_version >= SESSION_BINDING_FORMAT_VERSION;
    let fingerprint = (bound && request_id.is_some()).then(|| command_fingerprint(command));
    // A deliberate bug for the checkers' "can fail" tests: answer any command
    // under a kept id from the table, as format 5 did. Only with the
    // `failpoints` feature and FAILPOINTS=sm-dedupe-ignore-command=return.
    #[cfg(feature = "failpoints")]
    let fingerprint =
        fingerprint.filter(|_| fail::eval("sm-dedupe-ignore-command", |_| ()).is_none());
    if let Some(id) = request_id
        && let Some(session) = txn.state.sessions.get(&id.client_id)
    {
        if let Some(stored) = session.responses.get(&id.sequence) {
            if let (Some(kept), Some(presented)) = (stored.fingerprint, fingerprint)
                && kept != presented
            {
                let err = CommandError::RequestIdReused {
                    client_id: id.client_id.clone(),
                    sequence: id.sequence,
                };
                return Response {
                    result: Err(err),
                    deduplicated: false,
                };
            }
            let result = current_answer(txn.state, command, &stored.result, txn.format_version);
            if bound {
                // A retry takes the request up again: a queued acquire is
                // not given up for a caller that left before it
                // (`AbandonWait`).
                let index = txn.index;
                let session = txn
                    .state
                    .sessions
                    .get_mut(&id.client_id)
                    .expect("found above");
                session
                    .responses
                    .get_mut(&id.sequence)
                    .expect("found above")
                    .answered_at = index;
                txn.dirty.sessions.insert(id.client_id.clone());
            }
            return Response {
                result,
                deduplicated: true,
            };
        }
        if id.sequence < session.acknowledged_below {
            let err = CommandError::SequenceTooOld {
                client_id: id.client_id.clone(),
                sequence: id.sequence,
                oldest_kept: session.acknowledged_below,
            };
            return Response {
                result: Err(err),
                deduplicated: false,
            };
        }
    }

    if let Some(id) = request_id
        && bound
        && !txn.state.sessions.contains_key(&id.client_id)
        && txn.state.sessions.len() >= MAX_SESSIONS
    {
        let err = CommandError::TooManySessions {
            limit: MAX_SESSIONS as u32,
        };
        return Response {
            result: Err(err),
            deduplicated: false,
        };
    }

    let result = command.clone().apply(txn);
    // What the command freed is granted now, before the next batch item.
    txn.grant_freed();

    if let Some(id) = request_id {
        let now_ms = txn.now_ms;
        let session = txn.state.sessions.entry(id.client_id.clone()).or_default();
        // Forget what the client has seen answered; bound the rest. From
        // format 6 the floor moves only over sequences the session had seen
        // before this request: a request claiming that everything up to a
        // far-ahead sequence is done (a forged or corrupt `first_incomplete`)
        // cannot put the client's next sequences below the floor.
        let mut done_below = id.first_incomplete.min(id.sequence);
        if bound {
            done_below = done_below.min(session.next_unseen());
        }
        session.keep(
            id.sequence,
            StoredAnswer {
                result: result.clone(),
                fingerprint,
                // Kept as the fingerprint is, from format 6: an older entry
                // keeps what an older build kept.
                answered_at: if bound { txn.index } else { 0 },
            },
        );
        session.forget_below(done_below);
        session.bound(
            SESSION_MAX_RESPONSES,
            bound.then_some(SESSION_MAX_ANSWER_BYTES),
        );
        session.last_seen_ms = now_ms;
        txn.dirty.sessions.insert(id.client_id.clone());
    }
    Response {
        result,
        deduplicated: false,
    }
}

#[cfg(test)]
mod tests;
