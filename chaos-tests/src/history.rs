//! The record of a chaos run: every client operation as invoke and then ok,
//! fail or unknown, with times on one monotonic clock (all clients live in
//! this process), plus what the shadow resource and the watchers saw.
//!
//! Outcomes follow Jepsen: **ok** is a definite answer (including "busy" and
//! "not the holder", which are answers, not failures), **fail** means the
//! operation certainly did not take effect (the server refused the input),
//! and **unknown** means it may or may not have taken effect — a timeout, an
//! unreachable leader, a broken connection. Checkers never treat unknown as
//! failed.

use std::sync::Mutex;
use std::time::Instant;

use tether_client::Error;

/// What a client asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// Acquire `key` for pod `uid`, waiting up to `wait_ms` (0 = try once).
    Acquire {
        /// The pod UID.
        uid: String,
        /// Queue wait.
        wait_ms: u64,
    },
    /// Release the hold of `uid` with `token`.
    Release {
        /// The pod UID.
        uid: String,
        /// Its token.
        token: u64,
    },
    /// Revoke the pod `uid` (everything it holds or waits for).
    RevokePod {
        /// The pod UID.
        uid: String,
    },
    /// Assign pin `key` (`pin/<set>/<member>`) for pod `uid`.
    Assign {
        /// The pod UID.
        uid: String,
    },
    /// Withdraw pod `uid`'s acquire of `key` (its wait or hold, as far as
    /// this process's client is concerned).
    Withdraw {
        /// The pod UID.
        uid: String,
    },
}

/// A definite answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Granted with this fencing token.
    Granted(u64),
    /// Held by another pod (try-acquire), or the wait ended unserved.
    Busy,
    /// The hold ended.
    Released,
    /// Not the holder or a stale token: nothing changed.
    Rejected,
    /// The revoke ended these holds (lock keys, `lock/<scope>/<name>`).
    Revoked(Vec<String>),
    /// The pin is on this node.
    Assigned(String),
    /// No node satisfied the pin's rules: nothing changed.
    Unsatisfiable,
    /// The wait ended because its caller went away, told to a caller that
    /// was there to hear it (the `ends` checker reports every one).
    Abandoned,
    /// A withdrawal gave back the hold with this token.
    GaveBack(u64),
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Still running when the history was taken: unknown.
    Pending,
    /// A definite answer.
    Ok(Value),
    /// Certainly not applied.
    Fail(String),
    /// May or may not have been applied.
    Unknown(String),
}

/// One operation.
#[derive(Debug, Clone)]
pub struct Op {
    /// Index in the history.
    pub id: usize,
    /// The worker that ran it (a worker runs one operation at a time).
    pub process: u64,
    /// `lock/<scope>/<name>` or `pin/<set>/<member>`; empty for revokes.
    pub key: String,
    /// What was asked.
    pub call: Call,
    /// Microseconds since the history began.
    pub invoke_us: u64,
    /// When the answer arrived (None while pending or unknown).
    pub complete_us: Option<u64>,
    /// The answer.
    pub outcome: Outcome,
}

impl Op {
    /// Whether the answer is definite.
    pub fn is_ok(&self) -> bool {
        matches!(self.outcome, Outcome::Ok(_))
    }

    /// The definite answer, if any.
    pub fn value(&self) -> Option<&Value> {
        match &self.outcome {
            Outcome::Ok(value) => Some(value),
            _ => None,
        }
    }
}

/// A write to the shadow resource.
#[derive(Debug, Clone)]
pub struct ShadowWrite {
    /// Lock key the resource belongs to.
    pub key: String,
    /// The writer's fencing token.
    pub token: u64,
    /// What the writer read before writing.
    pub read: u64,
    /// What the resource held when the write arrived.
    pub found: u64,
}

/// A lock whose holder was gone (or whose grant nobody would use) and
/// which had to reach its next waiter: what the `progress` checker bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// `lock/<scope>/<name>`.
    pub key: String,
    /// What made the lock due to move on, e.g. "a grant raced an abandoned
    /// wait".
    pub cause: &'static str,
    /// When it became due (µs on the history's clock).
    pub due_us: u64,
    /// When its next live waiter was told it was granted (None: it was
    /// not, within its wait).
    pub granted_us: Option<u64>,
    /// When that waiter's acquire ended, granted or not.
    pub answered_us: u64,
    /// The recovery rests on a give-up held only in the memory of the
    /// replica that served the caller's stream (`AbandonWait`): a fault
    /// from before it was due until the give-up can void it (the hold
    /// timeout, or the pod's revoke, then ends the hold instead).
    pub in_memory: bool,
}

/// One round of the lease keeper (`keeper.rs`): a hold on a TTL lease its
/// client kept alive, with a waiter behind it. What the `leases` checker
/// judges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptLease {
    /// `lock/<scope>/<name>`.
    pub key: String,
    /// The lease.
    pub lease: u64,
    /// Its TTL, ms.
    pub ttl_ms: u64,
    /// When each request that the lease was alive after was sent: its
    /// grant, and every keep-alive answered with a TTL (µs on the
    /// history's clock).
    pub alive_sent_us: Vec<u64>,
    /// When a keep-alive was first answered that the lease is gone (TTL 0).
    pub gone_answered_us: Option<u64>,
    /// When the keeper sent its release (None: it did not get to it).
    pub release_sent_us: Option<u64>,
    /// When the waiter sent its acquire.
    pub waiter_sent_us: u64,
    /// How long the waiter would wait, ms.
    pub waiter_wait_ms: u64,
    /// When the waiter was told it was granted (None: it was not).
    pub waiter_granted_us: Option<u64>,
    /// When the waiter was told its wait ended unserved (None: it was not).
    pub waiter_ended_us: Option<u64>,
}

/// What the session flooder (`sessions.rs`) saw in one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionFlood {
    /// The flooding identity's session quota.
    pub quota: usize,
    /// New clients of the flooding identity that got a session.
    pub admitted: usize,
    /// New clients of the flooding identity refused by the quota.
    pub refused: usize,
    /// New clients whose answer was lost (a fault).
    pub unknown: usize,
    /// Calls of the bridge's client that were not refused a session.
    pub bridge_calls: usize,
    /// Refusals that should not have happened: the bridge refused a
    /// session, or the flooder refused for another identity's sake.
    pub wrong_refusals: Vec<String>,
}

/// All operations of one run.
pub struct History {
    start: Instant,
    ops: Mutex<Vec<Op>>,
    kept_leases: Mutex<Vec<KeptLease>>,
    session_floods: Mutex<Vec<SessionFlood>>,
    recoveries: Mutex<Vec<Recovery>>,
    faults: Mutex<Vec<(u64, Option<u64>)>>,
}

/// Handle of an invoked operation.
#[derive(Debug, Clone, Copy)]
pub struct Invoked(usize);

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history whose clock starts now.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            ops: Mutex::new(Vec::new()),
            kept_leases: Mutex::new(Vec::new()),
            session_floods: Mutex::new(Vec::new()),
            recoveries: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
        }
    }

    /// Microseconds since the history began.
    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Records a round of the lease keeper.
    pub fn record_kept_lease(&self, kept: KeptLease) {
        self.kept_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kept);
    }

    /// Every lease keeper round recorded so far.
    pub fn kept_leases(&self) -> Vec<KeptLease> {
        self.kept_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records what the session flooder saw.
    pub fn record_session_flood(&self, flood: SessionFlood) {
        self.session_floods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(flood);
    }

    /// Every session flood recorded so far.
    pub fn session_floods(&self) -> Vec<SessionFlood> {
        self.session_floods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records a lock that had to reach its next waiter.
    pub fn record_recovery(&self, recovery: Recovery) {
        self.recoveries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(recovery);
    }

    /// Every recovery recorded so far.
    pub fn recoveries(&self) -> Vec<Recovery> {
        self.recoveries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A fault begins now.
    pub fn fault_began(&self) {
        let now = self.now_us();
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((now, None));
    }

    /// Every fault in force has healed now.
    pub fn faults_healed(&self) {
        let now = self.now_us();
        for fault in self
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter_mut()
        {
            fault.1.get_or_insert(now);
        }
    }

    /// The faults' windows: (began, healed; None while in force), µs.
    pub fn fault_windows(&self) -> Vec<(u64, Option<u64>)> {
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records an invocation.
    pub fn invoke(&self, process: u64, key: &str, call: Call) -> Invoked {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let id = ops.len();
        ops.push(Op {
            id,
            process,
            key: key.to_string(),
            call,
            invoke_us: self.now_us(),
            complete_us: None,
            outcome: Outcome::Pending,
        });
        Invoked(id)
    }

    /// Records the answer of an invocation.
    pub fn complete(&self, invoked: Invoked, outcome: Outcome) {
        let now = self.now_us();
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let op = &mut ops[invoked.0];
        if matches!(outcome, Outcome::Ok(_) | Outcome::Fail(_)) {
            op.complete_us = Some(now);
        }
        op.outcome = outcome;
    }

    /// A copy of every operation so far.
    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Sorts a client error into fail (certainly not applied) or unknown.
pub fn error_outcome(err: &Error) -> Outcome {
    match err {
        Error::InvalidArgument(_) | Error::NotFound(_) | Error::ResourceExhausted(_) => {
            Outcome::Fail(err.to_string())
        }
        _ => Outcome::Unknown(err.to_string()),
    }
}
