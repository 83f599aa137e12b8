//! `Sweep`: housekeeping the leader proposes when something is due on
//! committed time. What expires is decided here, from the entry's committed
//! time, so every replica reaches the same result.
//!
//! One grant per lock per entry: a sweep may end holds and waits of many
//! owners (several TTL leases due together, hold timeouts). From format 5
//! ([`DEFERRED_GRANTS_FORMAT_VERSION`]) it ends everything that is due first
//! and only then grants each freed lock to its next waiter, once. Entries of
//! older formats granted as they went, which could grant a lock to a waiter
//! whose lease ended later in the same sweep and then grant it again under
//! the same token; they still apply that way, so old logs replay to the state
//! they first produced.
//!
//! Lock-delay: a new leader's clock may run ahead of the old one's, so a hold,
//! TTL lease or pin may expire only once the proposing leader has led for at
//! least that hold's timeout, lease's TTL or pin's lifetime
//! (`leader_tenure_ms`, stamped in the entry). Anything still alive would have
//! been refreshed or released through this leader within that window. From
//! format 6 ([`CLOCK_RULES_FORMAT_VERSION`]) the same holds for a wait's
//! deadline, an idle session's eviction and a node tombstone's removal.
//!
//! What is due is decided on committed time (the highest leader stamp
//! applied, `State::now_ms`), never on a replica's own clock: the leader
//! asks [`sweep_due`] at the time its sweep will apply at, the later of its
//! clock and committed time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::lease::end_lease;
use super::{CommandError, Reply};
use crate::sm::event::EventKind;
use crate::sm::types::{
    ClientSession, Lock, LockKey, NodeInfo, OwnerState, Pin, PinKey, PinReleaseReason, PodPhase,
    ReleaseReason, TtlLease, WaitEndReason, Waiter,
};
use crate::sm::{State, Txn};

/// The log format from which a sweep ends everything due before it grants
/// (see the module doc).
pub const DEFERRED_GRANTS_FORMAT_VERSION: u16 = 5;

/// The log format from which a sweep also forgets the reported phases of
/// pods that nothing refers to any more (no hold, wait or pin names them):
/// a pod reported running that then released its hold would otherwise stay
/// in every snapshot for ever. A phase matters only for a pod's holds (the
/// stuck-hold rule) and for a pin it is given; the bridge reports the pods
/// that hold or wait, after they do.
pub const POD_CLEANUP_FORMAT_VERSION: u16 = 6;

/// The log format from which every time-based end of a sweep waits out the
/// lock-delay, as holds, TTL leases and pins always have: a wait ends at its
/// deadline, an idle session is evicted and a node tombstone dropped only
/// once the proposing leader has led for at least the wait's length, the
/// idle time or the tombstone time. A new leader whose clock runs ahead
/// would otherwise evict a session early (and a late retry of a request it
/// answered would then apply twice) or end waits early.
pub const CLOCK_RULES_FORMAT_VERSION: u16 = 6;

/// Pod UIDs with a reported phase that no hold, wait or pin names.
pub fn unreferenced_pods(state: &State) -> Vec<String> {
    unreferenced(state).cloned().collect()
}

/// Whether any pod with a reported phase is named by no hold, wait or pin
/// ([`unreferenced_pods`] without collecting them).
pub fn any_unreferenced_pod(state: &State) -> bool {
    unreferenced(state).next().is_some()
}

/// The pods of [`unreferenced_pods`], in UID order. The pods and the pin
/// table's index of owners are both in UID order, and are walked side by
/// side, rather than every pin's owner collected into a set: the sweeper
/// asks this of the whole state every sweep interval and after each pod
/// stop, and with 8,000 pods holding claims (1,000 GPU nodes) the
/// collection put string comparisons and tree inserts at a third of the
/// replicas' CPU samples over a burst and the end of its pods
/// (`tether-bind-bench` under `perf`, 2026-12-05, build of f59693d), and
/// ending the 8,000 claims cost the replicas 47.7 s of CPU (26–29 s with
/// the walk).
fn unreferenced(state: &State) -> impl Iterator<Item = &String> {
    // Holders and waiters: one set, as a lock names few pods.
    let mut named: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    if !state.pods.is_empty() {
        for lock in state.locks.values() {
            named.extend(lock.holder.iter().map(|h| h.pod.uid.as_str()));
            named.extend(lock.waiters.iter().map(|w| w.pod.uid.as_str()));
        }
    }
    let mut owners = state.pins.owners().peekable();
    state.pods.keys().filter(move |uid| {
        while owners.next_if(|owner| owner < uid).is_some() {}
        let owns_pins = owners.peek() == Some(uid);
        !owns_pins && !named.contains(uid.as_str())
    })
}

/// Expire what is due.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sweep {
    /// How long the proposing leader has led, ms (its own monotonic clock).
    pub leader_tenure_ms: u64,
    /// Hold timeout of scopes without their own.
    pub hold_timeout_ms: u64,
    /// Hold timeouts of scopes that have their own.
    pub scope_hold_timeout_ms: BTreeMap<String, u64>,
    /// Dedupe sessions idle this long are evicted.
    pub session_idle_ms: u64,
    /// Tombstones of gone nodes are dropped this long after the node went.
    pub node_tombstone_ms: u64,
}

/// What a hold past its timeout gets.
#[derive(Debug, PartialEq, Eq)]
enum HoldVerdict {
    /// Not yet due (or the lock-delay protects it).
    NotDue,
    /// Due, and its pod is unknown, running, terminal or gone: release.
    Release(u64),
    /// Due, but its pod is alive and not started: keep, report once.
    Stuck,
    /// Stuck and already reported.
    StuckReported,
}

impl Sweep {
    /// The hold timeout of `scope`, or `None` while the lock-delay for it is
    /// in force.
    pub fn timeout_for(&self, scope: &str) -> Option<u64> {
        let timeout = self
            .scope_hold_timeout_ms
            .get(scope)
            .copied()
            .unwrap_or(self.hold_timeout_ms);
        (timeout <= self.leader_tenure_ms).then_some(timeout)
    }

    fn lease_due(&self, lease: &TtlLease, now_ms: u64) -> bool {
        lease.expires_at_ms <= now_ms && lease.ttl_ms <= self.leader_tenure_ms
    }

    /// Whether the proposing leader has led for `length_ms` (always true
    /// for entries older than [`CLOCK_RULES_FORMAT_VERSION`], which ended
    /// waits, sessions and tombstones without it).
    fn led_for(&self, length_ms: u64, format_version: u16) -> bool {
        format_version < CLOCK_RULES_FORMAT_VERSION || length_ms <= self.leader_tenure_ms
    }

    fn wait_due(&self, waiter: &Waiter, now_ms: u64, format_version: u16) -> bool {
        waiter.deadline_ms != 0
            && waiter.deadline_ms <= now_ms
            && self.led_for(
                waiter.deadline_ms.saturating_sub(waiter.queued_at_ms),
                format_version,
            )
    }

    fn session_due(&self, session: &ClientSession, now_ms: u64, format_version: u16) -> bool {
        session.last_seen_ms.saturating_add(self.session_idle_ms) <= now_ms
            && self.led_for(self.session_idle_ms, format_version)
    }

    fn tombstone_due(&self, node: &NodeInfo, now_ms: u64, format_version: u16) -> bool {
        node.gone_at_ms
            .is_some_and(|t| t.saturating_add(self.node_tombstone_ms) <= now_ms)
            && self.led_for(self.node_tombstone_ms, format_version)
    }

    fn pin_due(&self, pin: &Pin, now_ms: u64) -> bool {
        // A deliberate bug for the checkers' "can fail" tests: a pin expires
        // when half its lifetime has passed. Only with the `failpoints`
        // feature and FAILPOINTS=sm-pin-expires-early=return.
        #[cfg(feature = "failpoints")]
        let pin = &Pin {
            lifetime_ms: match fail::eval("sm-pin-expires-early", |_| ()) {
                Some(()) => pin.lifetime_ms / 2,
                None => pin.lifetime_ms,
            },
            ..pin.clone()
        };
        pin.lifetime_ms > 0
            && pin.owner == OwnerState::Stopped
            && pin.last_running_at_ms.saturating_add(pin.lifetime_ms) <= now_ms
            && pin.lifetime_ms <= self.leader_tenure_ms
    }

    fn hold_verdict(&self, state: &State, key: &LockKey, lock: &Lock, now_ms: u64) -> HoldVerdict {
        let (Some(timeout), Some(hold)) = (self.timeout_for(&key.scope), lock.holder.as_ref())
        else {
            return HoldVerdict::NotDue;
        };
        if hold.granted_at_ms.saturating_add(timeout) > now_ms {
            return HoldVerdict::NotDue;
        }
        match state.pods.get(&hold.pod.uid) {
            Some(PodPhase::Starting) if lock.stuck_token == hold.token => {
                HoldVerdict::StuckReported
            }
            Some(PodPhase::Starting) => HoldVerdict::Stuck,
            _ => HoldVerdict::Release(timeout),
        }
    }

    /// Drops waits past their deadline, expires due TTL leases, holds and
    /// pins, reports stuck holds, evicts idle sessions and old tombstones.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        let format = txn.format_version;
        // Grants wait until every end is applied (format 5 on), or are made
        // as each hold ends (older entries, replayed as they first applied).
        let grant_as_ending = txn.format_version < DEFERRED_GRANTS_FORMAT_VERSION;
        // A deliberate bug for the checkers' "can fail" tests: grant as each
        // hold ends, whatever the format. Only with the `failpoints` feature
        // and FAILPOINTS=sm-sweep-grant-per-end=return.
        #[cfg(feature = "failpoints")]
        let grant_as_ending =
            grant_as_ending || fail::eval("sm-sweep-grant-per-end", |_| ()).is_some();
        // The index (see `sweep_index`), unless the state is not indexed
        // yet, or holds may be granted as others end: a hold granted in this
        // very sweep is not in the index taken at its start.
        let look = if txn.state.sweep_index().is_built() && !grant_as_ending {
            Look::Indexed
        } else {
            Look::Scanned
        };
        let late_waits = checked(look, |look| self.late_waits(txn.state, now, format, look));
        let mut waits = 0;
        for (key, count) in &late_waits {
            txn.remove_waiters(
                key,
                |w| self.wait_due(w, now, format),
                WaitEndReason::DeadlineExceeded,
            );
            waits += *count as u32;
        }

        let due_leases = checked(look, |look| self.due_leases(txn.state, now, look));
        let leases = due_leases.len() as u32;
        for lease_id in due_leases {
            end_lease(txn, lease_id, true, grant_as_ending);
        }

        let mut holds = 0;
        let mut stuck = 0;
        let verdicts = checked(look, |look| self.hold_verdicts(txn.state, now, look));
        for (key, verdict) in verdicts {
            match verdict {
                HoldVerdict::Release(timeout_ms) => {
                    let reason = ReleaseReason::HoldTimeout { timeout_ms };
                    if grant_as_ending {
                        txn.release_and_hand_over(&key, reason);
                    } else {
                        txn.end_hold(&key, reason);
                    }
                    holds += 1;
                }
                HoldVerdict::Stuck => {
                    let lock = txn.lock_mut(&key);
                    let hold = lock.holder.clone().expect("a stuck verdict has a holder");
                    lock.stuck_token = hold.token;
                    let held_ms = now.saturating_sub(hold.granted_at_ms);
                    txn.emit(EventKind::LockStuck {
                        key,
                        pod: hold.pod,
                        token: hold.token,
                        held_ms,
                    });
                    stuck += 1;
                }
                HoldVerdict::NotDue | HoldVerdict::StuckReported => {}
            }
        }

        let due_pins = checked(look, |look| self.due_pins(txn.state, now, look));
        let pins = due_pins.len() as u32;
        for (key, lifetime_ms) in due_pins {
            txn.release_pin(&key, PinReleaseReason::Expired { lifetime_ms });
        }

        let idle = checked(look, |look| {
            self.idle_sessions(txn.state, now, format, look)
        });
        let sessions = idle.len() as u32;
        for client in idle {
            txn.state.sessions.remove(&client);
            txn.dirty.sessions.insert(client);
        }

        let old_tombstones = checked(look, |look| {
            self.old_tombstones(txn.state, now, format, look)
        });
        for name in old_tombstones {
            txn.state.nodes.remove(&name);
            txn.dirty.nodes.insert(name);
        }

        if txn.format_version >= POD_CLEANUP_FORMAT_VERSION {
            // After the ends above (a waiter about to be granted still waits,
            // so it is still named): the index brought in step with them
            // first.
            let forgotten = match look {
                Look::Indexed => {
                    txn.state.refresh_sweep_index(&txn.dirty);
                    let indexed: Vec<String> = txn
                        .state
                        .sweep_index()
                        .unreferenced()
                        .iter()
                        .cloned()
                        .collect();
                    #[cfg(test)]
                    assert_eq!(indexed, unreferenced_pods(txn.state), "unreferenced pods");
                    indexed
                }
                Look::Scanned => unreferenced_pods(txn.state),
            };
            for uid in forgotten {
                txn.state.pods.remove(&uid);
                txn.dirty.pods.insert(uid);
            }
        }
        Ok(Reply::Swept {
            waits,
            leases,
            holds,
            sessions,
            pins,
            stuck,
        })
    }

    /// The locks with waits past their deadline, and how many, in key
    /// order.
    fn late_waits(
        &self,
        state: &State,
        now: u64,
        format: u16,
        look: Look,
    ) -> Vec<(LockKey, usize)> {
        let count = |lock: &Lock| {
            lock.waiters
                .iter()
                .filter(|w| self.wait_due(w, now, format))
                .count()
        };
        let counted: Vec<(LockKey, usize)> = match look {
            Look::Scanned => state
                .locks
                .iter()
                .map(|(k, l)| (k.clone(), count(l)))
                .collect(),
            Look::Indexed => in_order(state.sweep_index().waits_ending_by(now))
                .into_iter()
                .filter_map(|k| Some((k.clone(), count(state.locks.get(k)?))))
                .collect(),
        };
        counted.into_iter().filter(|(_, n)| *n > 0).collect()
    }

    /// The leases due, in id order.
    fn due_leases(&self, state: &State, now: u64, look: Look) -> Vec<u64> {
        let due = |l: &&TtlLease| self.lease_due(l, now);
        match look {
            Look::Scanned => state.leases.values().filter(due).map(|l| l.id).collect(),
            Look::Indexed => in_order(state.sweep_index().leases_expiring_by(now))
                .into_iter()
                .filter_map(|id| state.leases.get(id))
                .filter(due)
                .map(|l| l.id)
                .collect(),
        }
    }

    /// The holds to end or report stuck, in key order.
    fn hold_verdicts(&self, state: &State, now: u64, look: Look) -> Vec<(LockKey, HoldVerdict)> {
        let judged = |key: &LockKey| {
            let verdict = self.hold_verdict(state, key, state.locks.get(key)?, now);
            matches!(verdict, HoldVerdict::Release(_) | HoldVerdict::Stuck)
                .then(|| (key.clone(), verdict))
        };
        match look {
            Look::Scanned => state.locks.keys().filter_map(judged).collect(),
            Look::Indexed => {
                // Granted long enough ago for the shortest timeout of any
                // scope; each is judged by its own.
                let shortest = self
                    .scope_hold_timeout_ms
                    .values()
                    .copied()
                    .chain([self.hold_timeout_ms])
                    .min()
                    .unwrap_or(self.hold_timeout_ms);
                in_order(
                    state
                        .sweep_index()
                        .holds_granted_by(now.checked_sub(shortest)),
                )
                .into_iter()
                .filter_map(judged)
                .collect()
            }
        }
    }

    /// The pins due, with their lifetimes, in key order.
    fn due_pins(&self, state: &State, now: u64, look: Look) -> Vec<(PinKey, u64)> {
        let due =
            |(k, p): (&PinKey, &Pin)| self.pin_due(p, now).then(|| (k.clone(), p.lifetime_ms));
        match pins_look(look) {
            Look::Scanned => state.pins.iter().filter_map(due).collect(),
            Look::Indexed => {
                let mut due: Vec<(PinKey, u64)> =
                    state.pins.expiring_by(now).filter_map(due).collect();
                due.sort_unstable();
                due
            }
        }
    }

    /// The sessions idle long enough to evict, in client order.
    fn idle_sessions(&self, state: &State, now: u64, format: u16, look: Look) -> Vec<String> {
        let due = |c: &&String| {
            state
                .sessions
                .get(*c)
                .is_some_and(|s| self.session_due(s, now, format))
        };
        match look {
            Look::Scanned => state.sessions.keys().filter(due).cloned().collect(),
            Look::Indexed => in_order(state.sweep_index().sessions_idle(now, self.session_idle_ms))
                .into_iter()
                .filter(due)
                .cloned()
                .collect(),
        }
    }

    /// The node tombstones old enough to drop, in name order.
    fn old_tombstones(&self, state: &State, now: u64, format: u16, look: Look) -> Vec<String> {
        let due = |name: &&String| {
            state
                .nodes
                .get(*name)
                .is_some_and(|n| self.tombstone_due(n, now, format))
        };
        match look {
            Look::Scanned => state.nodes.keys().filter(due).cloned().collect(),
            Look::Indexed => in_order(
                state
                    .sweep_index()
                    .tombstones_older(now, self.node_tombstone_ms),
            )
            .into_iter()
            .filter(due)
            .cloned()
            .collect(),
        }
    }
}

/// Where a sweep looks for what is due: the state's sweep index, or every
/// item of the state (a state not indexed yet, old formats' grants as holds
/// end, and the tests' comparison).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    Indexed,
    Scanned,
}

/// What `find` answers through `look`; in the state machine's own tests,
/// checked against the full scan's answer (see `sweep_index`).
fn checked<T: PartialEq + std::fmt::Debug>(look: Look, find: impl Fn(Look) -> T) -> T {
    let found = find(look);
    #[cfg(test)]
    if look == Look::Indexed {
        assert_eq!(
            found,
            find(Look::Scanned),
            "the sweep index and the full scan differ"
        );
    }
    found
}

/// The keys an index gave, in key order (it gives them in time order).
fn in_order<'a, K: Ord + 'a>(keys: impl Iterator<Item = &'a K>) -> Vec<&'a K> {
    let mut keys: Vec<&K> = keys.collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// How to find the pins due: a planted bug that expires pins early
/// (`sm-pin-expires-early`) makes them due before the time the pin table
/// files them under, so it is looked for in full.
fn pins_look(look: Look) -> Look {
    #[cfg(feature = "failpoints")]
    if fail::eval("sm-pin-expires-early", |_| ()).is_some() {
        return Look::Scanned;
    }
    look
}

/// Whether a [`Sweep`] written in `format_version` would change anything at
/// committed time `now_ms`: the leader asks this of its applied state before
/// proposing, so an idle cluster writes no sweep entries.
pub fn sweep_due(state: &State, now_ms: u64, sweep: &Sweep, format_version: u16) -> bool {
    let look = if state.sweep_index().is_built() {
        Look::Indexed
    } else {
        Look::Scanned
    };
    due_through(state, now_ms, sweep, format_version, look)
}

/// [`sweep_due`] through the index or by a full scan.
fn due_through(state: &State, now_ms: u64, sweep: &Sweep, format: u16, look: Look) -> bool {
    let pods = format >= POD_CLEANUP_FORMAT_VERSION
        && match look {
            Look::Indexed => !state.sweep_index().unreferenced().is_empty(),
            Look::Scanned => any_unreferenced_pod(state),
        };
    pods || !sweep.late_waits(state, now_ms, format, look).is_empty()
        || !sweep.due_leases(state, now_ms, look).is_empty()
        || !sweep.hold_verdicts(state, now_ms, look).is_empty()
        || !sweep.due_pins(state, now_ms, look).is_empty()
        || !sweep.idle_sessions(state, now_ms, format, look).is_empty()
        || !sweep.old_tombstones(state, now_ms, format, look).is_empty()
}

/// What a sweep at `now_ms` would find due, part by part, through the
/// sweep index and by a full scan of the state (`None` while the state is
/// not indexed): the state machine's tests compare the two after every
/// entry.
#[cfg(any(test, feature = "testing"))]
pub fn due_by_index_and_by_scan(
    state: &State,
    now_ms: u64,
    sweep: &Sweep,
    format: u16,
) -> Option<(String, String)> {
    if !state.sweep_index().is_built() {
        return None;
    }
    let found = |look: Look| {
        let pods = match look {
            Look::Indexed => state.sweep_index().unreferenced().iter().cloned().collect(),
            Look::Scanned => unreferenced_pods(state),
        };
        format!(
            "waits {:?}\nleases {:?}\nholds {:?}\npins {:?}\nsessions {:?}\ntombstones {:?}\npods {:?}",
            sweep.late_waits(state, now_ms, format, look),
            sweep.due_leases(state, now_ms, look),
            sweep.hold_verdicts(state, now_ms, look),
            sweep.due_pins(state, now_ms, look),
            sweep.idle_sessions(state, now_ms, format, look),
            sweep.old_tombstones(state, now_ms, format, look),
            pods,
        )
    };
    Some((found(Look::Indexed), found(Look::Scanned)))
}
