//! History checkers, one per file. Each reads the run's [`Evidence`] and
//! returns what it found wrong; an empty list means the property held in
//! this run (not that it always holds).
//!
//! | checker | property |
//! |---|---|
//! | `mutual_exclusion` | never two holders of a lock at once: in the event log, and as clients saw it |
//! | `fencing` | the shadow resource never lost an update: stale tokens were refused |
//! | `tokens` | tokens strictly increase per lock, in log order and in real time |
//! | `durability` | every acknowledged operation is in the log after recovery |
//! | `fifo` | queued waiters are granted in the order they queued |
//! | `watch` | watch streams are in order, without gaps or repeats |
//! | `linearizability` | try-acquire / release / revoke match a sequential lock |
//! | `pins` | pins never break their anti-affinity rule; no pin expires early; no device is claimed by two pins of a node |
//! | `answers` | each pod is granted each lock at most once; a "granted" answer is the pod's own grant |
//! | `ends` | a gone node's lock and a revoked pod are granted nothing by the entry that ended them; an ended wait never comes back; no present caller is told it went away |
//! | `progress` | no waiter is left behind a free lock; a lock due to move on reaches its next waiter within a bound once faults have healed |
//! | `sessions` | one identity gets at most its session quota; the bridge is never refused a session |
//! | `nodes` | a live node never turns into another node object (UID) without the old one going |
//! | `leases` | a lease kept alive does not end before its TTL has run out in real time (clock steps included) |
//! | `attempts` | two attempts at one pod never share a hold, and a withdrawal never ends another attempt's |

pub mod answers;
pub mod attempts;
pub mod durability;
pub mod ends;
pub mod fencing;
pub mod fifo;
pub mod leases;
pub mod linearizability;
pub mod mutual_exclusion;
pub mod nodes;
pub mod pins;
pub mod progress;
pub mod sessions;
#[cfg(test)]
mod testkit;
pub mod tokens;
pub mod watch;

use std::collections::BTreeMap;

use tether_client::proto as pb;

use crate::history::{KeptLease, Op, Recovery, SessionFlood, ShadowWrite};

/// Everything a run leaves behind for the checkers.
#[derive(Debug, Default, Clone)]
pub struct Evidence {
    /// Client operations.
    pub ops: Vec<Op>,
    /// The final event log of every key the run touched, oldest first
    /// (read after the cluster healed and converged).
    pub events: BTreeMap<String, Vec<pb::Event>>,
    /// Writes the shadow resource saw, in arrival order.
    pub shadow: Vec<ShadowWrite>,
    /// What each watcher received, in order, with the key prefix it
    /// watched.
    pub watches: Vec<(String, Vec<pb::Event>)>,
    /// Locks driven by try-acquire only (the linearizability model's).
    pub try_locks: Vec<String>,
    /// Pins of the run (final state).
    pub pins: Vec<pb::Pin>,
    /// The claimer's pins (final state), whose `dev/` labels are device
    /// claims.
    pub claims: Vec<pb::Pin>,
    /// Members of the claimer's set made again by a second attempt whose
    /// first attempt then asked to release them on condition of its own
    /// label: each must stand with the second attempt's label.
    pub remade_claims: Vec<String>,
    /// Holds that may have been granted for the node object their acquire
    /// named (format 10): none may end with another object's `Gone`.
    pub taken_for_objects: Vec<crate::workers::TakenForObject>,
    /// `events` holds the run's whole log. When false (no replica kept it),
    /// the checkers that read the log skip it rather than report what is
    /// only missing history.
    pub events_complete: bool,
    /// Locks that had to move on to a waiter, and when they did.
    pub recoveries: Vec<Recovery>,
    /// When faults were in force: (began, healed; None if never), µs on
    /// the history's clock.
    pub fault_windows: Vec<(u64, Option<u64>)>,
    /// The lease keeper's rounds.
    pub kept_leases: Vec<KeptLease>,
    /// What the session flooder saw.
    pub session_floods: Vec<SessionFlood>,
}

/// Names of every checker, in report order.
pub const CHECKERS: [&str; 15] = [
    "mutual_exclusion",
    "fencing",
    "tokens",
    "durability",
    "fifo",
    "watch",
    "linearizability",
    "pins",
    "ends",
    "answers",
    "progress",
    "leases",
    "sessions",
    "nodes",
    "attempts",
];

/// Runs every checker: violations by checker name, and the locks whose
/// linearizability search ran out of `budget`.
pub fn check_all(
    evidence: &Evidence,
    budget: std::time::Duration,
) -> (BTreeMap<&'static str, Vec<String>>, Vec<String>) {
    let mut out = BTreeMap::new();
    out.insert("mutual_exclusion", mutual_exclusion::check(evidence));
    out.insert("fencing", fencing::check(evidence));
    out.insert("tokens", tokens::check(evidence));
    out.insert("durability", durability::check(evidence));
    out.insert("fifo", fifo::check(evidence));
    out.insert("watch", watch::check(evidence));
    let (violations, undecided) = linearizability::check(evidence, budget);
    out.insert("linearizability", violations);
    out.insert("pins", pins::check(evidence));
    out.insert("ends", ends::check(evidence));
    out.insert("answers", answers::check(evidence));
    out.insert("progress", progress::check(evidence));
    out.insert("leases", leases::check(evidence));
    out.insert("sessions", sessions::check(evidence));
    out.insert("nodes", nodes::check(evidence));
    out.insert("attempts", attempts::check(evidence));
    (out, undecided)
}

/// `pod.uid` of an event, or "".
pub(crate) fn uid_of(event: &pb::Event) -> &str {
    event.pod.as_ref().map_or("", |p| p.uid.as_str())
}

/// `index.sub` of an event, for messages.
pub(crate) fn rev(event: &pb::Event) -> String {
    event
        .revision
        .map_or("?".into(), |r| format!("{}.{}", r.index, r.sub))
}
