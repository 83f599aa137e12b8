//! Write batching: acquires and releases of many clients share log entries,
//! and from format 11 their assignments and pod reports and revokes too.
//!
//! openraft 0.9 appends (and fsyncs) each `client_write` on the leader on its
//! own, even when many are queued, so a leader commits at most one client
//! write per fsync. Here acquires and releases go through one queue instead;
//! a task takes whatever is waiting and proposes it as one
//! [`Command::Batch`] entry. A limited number of entries is in flight at a
//! time, so batches form exactly when the log is busy: a lone client's
//! command goes out at once, in an entry of its own (and in the older
//! entry format), with no added latency.
//!
//! Batch entries are a newer log format (3) than single commands (2): a
//! leader batches only once every other member has said, in its answers to
//! Raft messages, that it reads format 3 (see `raft::network::PeerFormats`).
//! Until then (a rolling upgrade from an older build, or a member that has
//! not answered since this replica started) commands go out one per entry,
//! as before.
//!
//! In format 3 a batch holds at most one command per lock (the entry's index
//! is the fencing token of any grant in it, and tokens must rise per lock),
//! and a command on a lock already in the forming batch goes out at once in
//! an entry of its own, outside the in-flight limit: a hot lock's commands
//! keep pipelining instead of waiting for a permit and a batch of their own.
//! Once every member reads format 4, commands on one lock share a batch (the
//! state machine grants a lock at most once per entry), and an acquire that
//! will queue behind another pod's hold is held back for up to
//! `--batch-hold-queued`, so that it goes out with the lock's next release.
//! On a contended lock each hand-over then takes one entry, not two: the
//! release no longer waits behind the previous holder's queueing acquire for
//! the leader's fsync and a replication round (openraft 0.9 replicates one
//! entry after another).
//!
//! Once every member reads format 11, assignments (device claims among
//! them), pod reports and pod revokes join batches too
//! ([`crate::sm::BatchRole::Lockless`]): a bind's claim and the bridge's
//! report that its pod runs no longer take an entry each. They name no
//! lock, so they are never held back and never meet the one-command-per-lock
//! rule. A terminal report or revoke that apply refuses because it would
//! end a hold granted by the same entry is proposed again at once, in an
//! entry of its own.

use openraft::async_runtime::WatchReceiver as _;
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::clock::CommitClock;
use super::commit::commit;
use crate::error::{ApiError, Result};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::network::PeerFormats;
use crate::sm::{
    BATCH_FORMAT_VERSION, Batch, BatchItem, Command, CommandError, LOCKLESS_BATCH_FORMAT_VERSION,
    LockKey, MAX_BATCH_ITEMS, Reply, Request, RequestId, Response,
    SHARED_LOCK_BATCH_FORMAT_VERSION, batch_role, batchable_lock, command::ends_holds_of,
};
use crate::store::StateHandle;

/// How batches are formed.
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most commands in one entry (at most [`MAX_BATCH_ITEMS`]).
    pub max_commands: usize,
    /// Most lock payload bytes in one entry; a single command over it still
    /// goes out, alone.
    pub max_payload_bytes: usize,
    /// Most batch entries proposed and not yet answered.
    pub in_flight: usize,
    /// Longest an acquire that will queue is held back to share the entry
    /// of its lock's next release (zero: never).
    pub hold_queued: Duration,
}

/// How a command may be batched, as the members' formats allow (each
/// allows what the one before it does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Batching {
    /// Format 3: at most one command per lock in an entry.
    OneCommandPerLock,
    /// Format 4: several commands on one lock may share an entry, and an
    /// acquire that will queue may wait for its lock's next release.
    SharedLocks,
    /// Format 11: commands that name no lock (assignments, pod reports and
    /// revokes) join batches too.
    WithLockless,
}

/// The queue in front of Raft for acquires and releases, and from format
/// 11 assignments and pod reports and revokes.
pub struct Proposer {
    queue: mpsc::Sender<Proposal>,
    raft: Raft,
    /// This replica's id.
    id: u64,
    formats: Arc<PeerFormats>,
}

/// One client's command waiting to be proposed.
struct Proposal {
    request_id: Option<RequestId>,
    command: Command,
    /// The entry's response for this command, and the entry's log index.
    reply: oneshot::Sender<Result<(Response, u64)>>,
    /// May join a batch that already has a command on its lock (and, if
    /// it is an acquire that will queue, be held back).
    shares_locks: bool,
    /// Until when it is held back, once it is.
    held_until: Option<Instant>,
    /// The oldest format another member was known to read when it was
    /// queued (`Request::for_members`).
    oldest_member_known: Option<u16>,
}

impl Proposal {
    /// The lock it names; None for a command of
    /// [`crate::sm::BatchRole::Lockless`].
    fn lock(&self) -> Option<&LockKey> {
        batchable_lock(&self.command)
    }

    fn payload_bytes(&self) -> usize {
        self.command
            .acquire()
            .map_or(0, |acquire| acquire.payload.len())
    }
}

impl Proposer {
    /// Starts the task that forms and proposes batches. It ends when the
    /// proposer is dropped and the queue has drained.
    pub fn start(
        raft: Raft,
        id: u64,
        formats: Arc<PeerFormats>,
        state: StateHandle,
        limits: BatchLimits,
        metrics: Arc<Metrics>,
        clock: Arc<CommitClock>,
    ) -> Self {
        let (queue, rx) = mpsc::channel(4 * MAX_BATCH_ITEMS);
        tokio::spawn(form_batches(
            raft.clone(),
            rx,
            limits,
            state,
            metrics,
            clock,
        ));
        Self {
            queue,
            raft,
            id,
            formats,
        }
    }

    /// How batch entries may be written now, if at all: as the oldest
    /// format that every other member, voter or learner, has said (in its
    /// answers to Raft messages) that it reads.
    pub fn batching(&self) -> Option<Batching> {
        batching_for(self.formats.newest_members_read(&self.raft, self.id))
    }

    /// Whether `command` may be proposed here under `batching`.
    pub fn may_batch(command: &Command, batching: Batching) -> bool {
        match batch_role(command) {
            Some(crate::sm::BatchRole::Lock(_)) => true,
            Some(crate::sm::BatchRole::Lockless) => batching >= Batching::WithLockless,
            None => false,
        }
    }

    /// Proposes a command that [`Proposer::may_batch`] and returns its
    /// entry's response for this command alone, and the entry's log index.
    pub async fn propose(
        &self,
        request_id: Option<RequestId>,
        command: Command,
        batching: Batching,
    ) -> Result<(Response, u64)> {
        debug_assert!(Self::may_batch(&command, batching));
        let (reply, answer) = oneshot::channel();
        let stopped =
            || ApiError::Unavailable("this replica is shutting down; use another replica".into());
        self.queue
            .send(Proposal {
                request_id,
                command,
                reply,
                shares_locks: batching >= Batching::SharedLocks,
                held_until: None,
                oldest_member_known: self.formats.oldest_member_known(&self.raft, self.id),
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// How commands may be batched when every other member reads `members_read`
/// (None: there is no other member; 0: one has not answered yet).
fn batching_for(members_read: Option<u16>) -> Option<Batching> {
    match members_read {
        None => Some(Batching::WithLockless),
        Some(format) if format >= LOCKLESS_BATCH_FORMAT_VERSION => Some(Batching::WithLockless),
        Some(format) if format >= SHARED_LOCK_BATCH_FORMAT_VERSION => Some(Batching::SharedLocks),
        Some(format) if format >= BATCH_FORMAT_VERSION => Some(Batching::OneCommandPerLock),
        Some(_) => None,
    }
}

/// A batch being formed: its proposals, the locks they name and their
/// payload bytes.
struct Forming {
    proposals: Vec<Proposal>,
    locks: BTreeSet<LockKey>,
    payload_bytes: usize,
}

/// What became of a proposal offered to a [`Forming`] batch.
enum Offer {
    /// It joined the batch.
    Added,
    /// The batch already has a command on its lock.
    SameLock(Proposal),
    /// The batch is full (commands or payload bytes).
    NoRoom(Proposal),
}

impl Forming {
    fn new() -> Self {
        Self {
            proposals: Vec::new(),
            locks: BTreeSet::new(),
            payload_bytes: 0,
        }
    }

    /// Adds `proposal` if the batch has room for it and does not name its
    /// lock yet (or the proposal may share a lock, or names none). The
    /// first proposal always joins.
    fn offer(&mut self, proposal: Proposal, limits: &BatchLimits) -> Offer {
        let bytes = proposal.payload_bytes();
        if !self.proposals.is_empty() {
            if !proposal.shares_locks && proposal.lock().is_some_and(|l| self.locks.contains(l)) {
                return Offer::SameLock(proposal);
            }
            if self.proposals.len() >= limits.max_commands
                || self.payload_bytes + bytes > limits.max_payload_bytes
            {
                return Offer::NoRoom(proposal);
            }
        }
        if let Some(lock) = proposal.lock() {
            self.locks.insert(lock.clone());
        }
        self.payload_bytes += bytes;
        self.proposals.push(proposal);
        Offer::Added
    }

    fn is_full(&self, limits: &BatchLimits) -> bool {
        self.proposals.len() >= limits.max_commands
    }

    /// Adds the proposals held back on `lock`, after those already in;
    /// those it has no room for stay held.
    fn take_held(&mut self, lock: &LockKey, held: &mut HeldBack, limits: &BatchLimits) -> usize {
        let mut joined = 0;
        for proposal in held.take(lock) {
            match self.offer(proposal, limits) {
                Offer::Added => joined += 1,
                Offer::SameLock(proposal) | Offer::NoRoom(proposal) => held.restore(proposal),
            }
        }
        joined
    }
}

/// Whether `proposal` is to be held back rather than go out now: it may be
/// ([`HeldBack::may_hold`]), and it will queue, as far as the applied state
/// tells: another pod holds the lock, and no release of it is on its way.
/// While an apply holds the state, it goes out: waiting for the state would
/// hold up every proposal behind it, for a guess.
fn to_hold(
    held: &HeldBack,
    proposal: &Proposal,
    state: &StateHandle,
    releasing: &Releasing,
) -> bool {
    if !held.may_hold(proposal) {
        return false;
    }
    let Some(acquire) = proposal.command.acquire() else {
        return false;
    };
    let Some(applied) = state.try_read() else {
        return false;
    };
    let held_by_another = applied
        .state
        .locks
        .get(&acquire.key)
        .and_then(|lock| lock.holder.as_ref())
        .is_some_and(|hold| hold.pod.uid != acquire.pod.uid);
    drop(applied);
    held_by_another && !releasing.has(&acquire.key)
}

/// Locks with a release proposed and not yet answered. An acquire on one
/// of them is not held back: the holder the applied state shows is on its
/// way out, and no later release may come to take the acquire along.
#[derive(Default)]
struct Releasing {
    locks: std::sync::Mutex<std::collections::HashMap<LockKey, usize>>,
}

impl Releasing {
    fn has(&self, lock: &LockKey) -> bool {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(lock)
    }

    /// Notes the releases among `proposals`; returns their locks, for
    /// [`Releasing::end`] once the entry is answered.
    fn start(&self, proposals: &[Proposal]) -> Vec<LockKey> {
        let released: Vec<LockKey> = proposals
            .iter()
            .filter_map(|p| match &p.command {
                Command::Release(release) => Some(release.key.clone()),
                _ => None,
            })
            .collect();
        if !released.is_empty() {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            for lock in &released {
                *locks.entry(lock.clone()).or_default() += 1;
            }
        }
        released
    }

    fn end(&self, released: Vec<LockKey>) {
        if released.is_empty() {
            return;
        }
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        for lock in released {
            if let std::collections::hash_map::Entry::Occupied(mut proposed) = locks.entry(lock) {
                *proposed.get_mut() -= 1;
                if *proposed.get() == 0 {
                    proposed.remove();
                }
            }
        }
    }
}

/// Acquires held back until their lock's next command goes out, or their
/// time is up, in the order they came.
struct HeldBack {
    proposals: VecDeque<Proposal>,
    hold: Duration,
}

impl HeldBack {
    fn new(hold: Duration) -> Self {
        Self {
            proposals: VecDeque::new(),
            hold,
        }
    }

    /// Whether `proposal` may be held back at all: an acquire that may share
    /// an entry with other commands on its lock and would wait for it.
    fn may_hold(&self, proposal: &Proposal) -> bool {
        proposal.shares_locks
            && !self.hold.is_zero()
            && proposal
                .command
                .acquire()
                .is_some_and(|acquire| acquire.wait_ms > 0)
    }

    fn hold(&mut self, mut proposal: Proposal, now: Instant) {
        proposal.held_until = Some(now + self.hold);
        self.proposals.push_back(proposal);
    }

    /// When the longest-held proposal is due to go out.
    fn next_due(&self) -> Option<Instant> {
        self.proposals.front().and_then(|p| p.held_until)
    }

    /// The longest-held proposal, if its time is up by `now` (or `now` is
    /// None: the queue closed, so everything goes out).
    fn pop_due(&mut self, now: Option<Instant>) -> Option<Proposal> {
        let due = match (now, self.next_due()) {
            (None, _) => true,
            (Some(now), Some(until)) => until <= now,
            (Some(_), None) => false,
        };
        if due {
            self.proposals.pop_front()
        } else {
            None
        }
    }

    /// Every proposal held on `lock`, in the order they came.
    fn take(&mut self, lock: &LockKey) -> Vec<Proposal> {
        // Called for every command added to a batch: most find nothing, and
        // must not rebuild the queue for it.
        if !self.proposals.iter().any(|p| p.lock() == Some(lock)) {
            return Vec::new();
        }
        let mut taken = Vec::new();
        let mut kept = VecDeque::with_capacity(self.proposals.len());
        for proposal in self.proposals.drain(..) {
            if proposal.lock() == Some(lock) {
                taken.push(proposal);
            } else {
                kept.push_back(proposal);
            }
        }
        self.proposals = kept;
        taken
    }

    /// Holds a taken proposal again, in its place by its time.
    fn restore(&mut self, proposal: Proposal) {
        let at = self
            .proposals
            .partition_point(|p| p.held_until <= proposal.held_until);
        self.proposals.insert(at, proposal);
    }
}

/// Takes proposals off the queue, whatever is waiting each time an entry
/// may go out, and proposes them.
async fn form_batches(
    raft: Raft,
    mut queue: mpsc::Receiver<Proposal>,
    limits: BatchLimits,
    state: StateHandle,
    metrics: Arc<Metrics>,
    clock: Arc<CommitClock>,
) {
    let in_flight = Arc::new(Semaphore::new(limits.in_flight.max(1)));
    // A proposal the last batch had no room for: it starts the next one.
    let mut carried: Option<Proposal> = None;
    let mut held = HeldBack::new(limits.hold_queued);
    let releasing = Arc::new(Releasing::default());
    let mut queue_open = true;
    loop {
        let permit = in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        // The next entry starts with a carried proposal, a held one whose
        // time is up, or the next to arrive that is not held back.
        let first = loop {
            if let Some(proposal) = carried.take() {
                break Some((proposal, false));
            }
            let now = queue_open.then(Instant::now);
            if let Some(proposal) = held.pop_due(now) {
                break Some((proposal, true));
            }
            if !queue_open {
                break None;
            }
            let next = match held.next_due() {
                Some(due) => tokio::select! {
                    next = queue.recv() => next,
                    _ = tokio::time::sleep_until(due) => continue,
                },
                None => queue.recv().await,
            };
            match next {
                Some(proposal) if to_hold(&held, &proposal, &state, &releasing) => {
                    held.hold(proposal, Instant::now())
                }
                Some(proposal) => break Some((proposal, false)),
                None => queue_open = false,
            }
        };
        let Some((first, was_held)) = first else {
            return;
        };
        // Held acquires on a lock go out right after the command that comes
        // for it (a release, typically, which hands over to them).
        // (Those taken along by a held one whose time is up met no other
        // command either: they count as run out, like it.)
        let mut batch = Forming::new();
        let first_lock = first.lock().cloned();
        let first_shares = first.shares_locks;
        batch.offer(first, &limits);
        let (mut joined, mut expired) = (0, usize::from(was_held));
        if first_shares && let Some(first_lock) = first_lock {
            let taken = batch.take_held(&first_lock, &mut held, &limits);
            if was_held {
                expired += taken;
            } else {
                joined += taken;
            }
        }
        let mut alone = Vec::new();
        while queue_open && !batch.is_full(&limits) {
            let Ok(proposal) = queue.try_recv() else {
                break;
            };
            if proposal.lock().is_some_and(|l| !batch.locks.contains(l))
                && to_hold(&held, &proposal, &state, &releasing)
            {
                held.hold(proposal, Instant::now());
                continue;
            }
            let (lock, shares) = (proposal.lock().cloned(), proposal.shares_locks);
            match batch.offer(proposal, &limits) {
                Offer::Added => {
                    if let (true, Some(lock)) = (shares, &lock) {
                        joined += batch.take_held(lock, &mut held, &limits);
                    }
                }
                Offer::SameLock(proposal) => alone.push(proposal),
                Offer::NoRoom(proposal) => {
                    carried = Some(proposal);
                    break;
                }
            }
        }
        metrics.held_acquires(joined, expired);
        metrics.proposed_entry(batch.proposals.len());
        let raft_for_batch = raft.clone();
        let metrics_for_batch = metrics.clone();
        let clock_for_batch = clock.clone();
        let released = releasing.start(&batch.proposals);
        let releasing_for_batch = releasing.clone();
        tokio::spawn(async move {
            propose(
                &raft_for_batch,
                &metrics_for_batch,
                &clock_for_batch,
                batch.proposals,
            )
            .await;
            releasing_for_batch.end(released);
            drop(permit);
        });
        for proposal in alone {
            metrics.proposed_entry(1);
            let raft = raft.clone();
            let metrics = metrics.clone();
            let clock = clock.clone();
            let released = releasing.start(std::slice::from_ref(&proposal));
            let releasing = releasing.clone();
            tokio::spawn(async move {
                propose(&raft, &metrics, &clock, vec![proposal]).await;
                releasing.end(released);
            });
        }
    }
}

/// Proposes one entry for `proposals` and answers each of them. A report
/// or revoke that apply refused because it would end a hold granted by the
/// same entry is proposed again, in an entry of its own.
async fn propose(
    raft: &Raft,
    metrics: &Metrics,
    clock: &CommitClock,
    mut proposals: Vec<Proposal>,
) {
    let stamp = clock.stamp(raft.metrics().borrow_watched().current_term);
    if proposals.len() == 1 {
        let proposal = proposals.pop().expect("one proposal");
        let result = propose_alone(
            raft,
            metrics,
            stamp,
            proposal.request_id,
            proposal.command,
            proposal.oldest_member_known,
        )
        .await;
        let _ = proposal.reply.send(result);
        return;
    }
    let mut replies = Vec::with_capacity(proposals.len());
    let mut items = Vec::with_capacity(proposals.len());
    // What to propose again if apply refuses it: (request id, command).
    let mut again = Vec::with_capacity(proposals.len());
    let oldest_member_known = proposals.iter().filter_map(|p| p.oldest_member_known).min();
    for proposal in proposals {
        replies.push(proposal.reply);
        again.push(
            ends_holds_of(&proposal.command)
                .is_some()
                .then(|| (proposal.request_id.clone(), proposal.command.clone())),
        );
        items.push(BatchItem {
            request_id: proposal.request_id,
            command: proposal.command,
        });
    }
    let request =
        Request::new(None, stamp, Command::Batch(Batch { items })).for_members(oldest_member_known);
    let answers: Vec<Result<(Response, u64)>> =
        match metrics.time_commit(commit(raft, request)).await {
            Ok(written) => match written.data.result {
                Ok(Reply::Batch(responses)) if responses.len() == replies.len() => {
                    let index = written.log_id.index;
                    responses.into_iter().map(|r| Ok((r, index))).collect()
                }
                other => {
                    let err = ApiError::Internal(format!(
                        "a batch of {} commands was answered with {other:?}",
                        replies.len()
                    ));
                    vec![Err(err); replies.len()]
                }
            },
            Err(err) => vec![Err(err); replies.len()],
        };
    let mut refused = Vec::new();
    for ((reply, answer), again) in replies.into_iter().zip(answers).zip(again) {
        match (answer, again) {
            (Ok((response, _)), Some(again))
                if matches!(response.result, Err(CommandError::InvalidBatch { .. })) =>
            {
                refused.push((reply, again));
            }
            // The caller may have gone (its RPC was cancelled): nothing to do.
            (answer, _) => drop(reply.send(answer)),
        }
    }
    for (reply, (request_id, command)) in refused {
        metrics.proposed_again();
        metrics.proposed_entry(1);
        let stamp = clock.stamp(raft.metrics().borrow_watched().current_term);
        let answer = propose_alone(
            raft,
            metrics,
            stamp,
            request_id,
            command,
            oldest_member_known,
        )
        .await;
        let _ = reply.send(answer);
    }
}

/// Proposes `command` in an entry of its own; its response and the entry's
/// log index.
async fn propose_alone(
    raft: &Raft,
    metrics: &Metrics,
    stamp: u64,
    request_id: Option<RequestId>,
    command: Command,
    oldest_member_known: Option<u16>,
) -> Result<(Response, u64)> {
    let request = Request::new(request_id, stamp, command).for_members(oldest_member_known);
    metrics
        .time_commit(commit(raft, request))
        .await
        .map(|written| (written.data, written.log_id.index))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sm::Pod;
    use crate::sm::command::{Acquire, Release};

    fn acquire(lock: &str, payload_bytes: usize) -> Proposal {
        let command = Command::Acquire(Acquire {
            key: LockKey::new("gpu-bind", lock),
            pod: Pod {
                uid: format!("uid-{lock}"),
                namespace: "ns".into(),
                name: "pod".into(),
            },
            payload: vec![0; payload_bytes],
            wait_ms: 0,
            lease_id: 0,
            client_id: "c".into(),
            queue_limit: 10,
        });
        proposal(command)
    }

    fn release(lock: &str) -> Proposal {
        proposal(Command::Release(Release {
            key: LockKey::new("gpu-bind", lock),
            pod_uid: format!("uid-{lock}"),
            token: 1,
            outcome: crate::sm::Outcome::Allocated,
        }))
    }

    fn proposal(command: Command) -> Proposal {
        Proposal {
            request_id: None,
            command,
            reply: oneshot::channel().0,
            shares_locks: false,
            held_until: None,
            oldest_member_known: None,
        }
    }

    /// `proposal` as made once every member reads format 4.
    fn sharing(mut proposal: Proposal) -> Proposal {
        proposal.shares_locks = true;
        proposal
    }

    fn waiting(lock: &str, payload_bytes: usize) -> Proposal {
        let mut proposal = sharing(acquire(lock, payload_bytes));
        if let Command::Acquire(acquire) = &mut proposal.command {
            acquire.wait_ms = 1_000;
        }
        proposal
    }

    const LIMITS: BatchLimits = BatchLimits {
        max_commands: 3,
        max_payload_bytes: 100,
        in_flight: 1,
        hold_queued: Duration::from_millis(2),
    };

    fn locks_of(proposals: &[Proposal]) -> Vec<(String, bool)> {
        proposals
            .iter()
            .map(|p| {
                let is_release = matches!(p.command, Command::Release(_));
                let lock = p.lock().map_or_else(|| "-".into(), |l| l.name.clone());
                (lock, is_release)
            })
            .collect()
    }

    #[test]
    fn with_shared_locks_commands_on_one_lock_share_the_batch() {
        let mut batch = Forming::new();
        assert!(added(batch.offer(sharing(acquire("a", 0)), &LIMITS)));
        assert!(added(batch.offer(sharing(release("a")), &LIMITS)));
        assert!(added(batch.offer(sharing(acquire("b", 0)), &LIMITS)));
        assert_eq!(
            locks_of(&batch.proposals),
            [("a".into(), false), ("a".into(), true), ("b".into(), false)]
        );
        // The limits still hold.
        assert!(matches!(
            batch.offer(sharing(release("a")), &LIMITS),
            Offer::NoRoom(_)
        ));
    }

    #[test]
    fn held_acquires_wait_in_order_and_leave_with_their_lock_or_when_due() {
        let mut held = HeldBack::new(LIMITS.hold_queued);
        assert!(held.may_hold(&waiting("a", 0)));
        assert!(!held.may_hold(&sharing(acquire("a", 0))), "does not wait");
        assert!(!held.may_hold(&sharing(release("a"))));
        let mut one_per_lock = waiting("a", 0);
        one_per_lock.shares_locks = false;
        assert!(!held.may_hold(&one_per_lock), "format 3");
        assert!(!HeldBack::new(Duration::ZERO).may_hold(&waiting("a", 0)));

        let t0 = Instant::now();
        let ms = Duration::from_millis;
        held.hold(waiting("a", 1), t0);
        held.hold(waiting("b", 2), t0 + ms(1));
        held.hold(waiting("a", 3), t0 + ms(2));
        assert_eq!(held.next_due(), Some(t0 + ms(2)));
        assert!(held.pop_due(Some(t0 + ms(1))).is_none(), "not due yet");

        // A command on lock a takes both of its held acquires, oldest first.
        let taken = held.take(&LockKey::new("gpu-bind", "a"));
        let bytes: Vec<usize> = taken.iter().map(Proposal::payload_bytes).collect();
        assert_eq!(bytes, [1, 3]);
        assert_eq!(held.next_due(), Some(t0 + ms(3)), "b is next");

        // One put back goes to its place by time.
        let mut taken = taken.into_iter();
        held.restore(taken.next().unwrap());
        assert_eq!(held.next_due(), Some(t0 + ms(2)));
        assert_eq!(held.pop_due(Some(t0 + ms(2))).unwrap().payload_bytes(), 1);
        assert!(held.pop_due(Some(t0 + ms(2))).is_none());
        assert_eq!(held.pop_due(Some(t0 + ms(3))).unwrap().payload_bytes(), 2);
        assert!(held.next_due().is_none());

        // Once the queue has closed, everything held goes at once.
        held.hold(waiting("c", 4), t0 + ms(10));
        assert_eq!(held.pop_due(None).unwrap().payload_bytes(), 4);
        assert!(held.pop_due(None).is_none());
    }

    #[test]
    fn a_batch_takes_the_acquires_held_on_a_lock_it_names_while_it_has_room() {
        let mut held = HeldBack::new(LIMITS.hold_queued);
        let now = Instant::now();
        for bytes in [1, 2, 3] {
            held.hold(waiting("a", bytes), now);
        }
        held.hold(waiting("b", 0), now);
        let mut batch = Forming::new();
        assert!(added(batch.offer(sharing(release("a")), &LIMITS)));
        let key = LockKey::new("gpu-bind", "a");
        assert_eq!(batch.take_held(&key, &mut held, &LIMITS), 2, "room for two");
        assert_eq!(
            locks_of(&batch.proposals),
            [("a".into(), true), ("a".into(), false), ("a".into(), false)]
        );
        // The third stays held, still ahead of b's.
        assert_eq!(held.take(&key).len(), 1);
        assert_eq!(held.proposals.len(), 1);
    }

    fn report_running(uid: &str) -> Proposal {
        proposal(Command::ReportPod(crate::sm::command::ReportPod {
            pod_uid: uid.into(),
            phase: crate::sm::PodPhase::Running,
        }))
    }

    /// A member of an older build holds batching back to what it reads:
    /// claims and reports join batches only once every member reads 11.
    #[test]
    fn batching_follows_the_oldest_format_every_member_reads() {
        assert_eq!(batching_for(None), Some(Batching::WithLockless));
        assert_eq!(batching_for(Some(11)), Some(Batching::WithLockless));
        assert_eq!(batching_for(Some(10)), Some(Batching::SharedLocks));
        assert_eq!(batching_for(Some(4)), Some(Batching::SharedLocks));
        assert_eq!(batching_for(Some(3)), Some(Batching::OneCommandPerLock));
        assert_eq!(batching_for(Some(2)), None);
        assert_eq!(batching_for(Some(0)), None, "a member not heard from yet");
        let report = report_running("u1").command;
        for members_read in [Some(10), Some(3), Some(0)] {
            assert!(
                !batching_for(members_read).is_some_and(|b| Proposer::may_batch(&report, b)),
                "{members_read:?}"
            );
        }
        assert!(Proposer::may_batch(
            &report,
            batching_for(Some(11)).expect("batching")
        ));
    }

    #[test]
    fn commands_naming_no_lock_join_any_batch_from_format_11_only() {
        let report = report_running("u1").command;
        assert!(!Proposer::may_batch(&report, Batching::SharedLocks));
        assert!(Proposer::may_batch(&report, Batching::WithLockless));
        assert!(Proposer::may_batch(
            &acquire("a", 0).command,
            Batching::OneCommandPerLock
        ));
        let lease = Command::GrantLease(crate::sm::command::GrantLease { ttl_ms: 1 });
        assert!(!Proposer::may_batch(&lease, Batching::WithLockless));

        // Several reports share a batch with one command per lock, and none
        // is ever held back.
        let mut batch = Forming::new();
        assert!(added(batch.offer(acquire("a", 0), &LIMITS)));
        assert!(added(batch.offer(report_running("u1"), &LIMITS)));
        assert!(added(batch.offer(report_running("u2"), &LIMITS)));
        assert_eq!(
            locks_of(&batch.proposals),
            [
                ("a".into(), false),
                ("-".into(), false),
                ("-".into(), false)
            ]
        );
        assert!(!HeldBack::new(LIMITS.hold_queued).may_hold(&report_running("u3")));
        let mut held = HeldBack::new(LIMITS.hold_queued);
        held.hold(waiting("a", 0), Instant::now());
        assert!(held.take(&LockKey::new("gpu-bind", "b")).is_empty());
        assert_eq!(held.take(&LockKey::new("gpu-bind", "a")).len(), 1);
    }

    fn added(offer: Offer) -> bool {
        matches!(offer, Offer::Added)
    }

    #[test]
    fn a_second_command_on_a_lock_is_handed_back_to_go_alone() {
        let mut batch = Forming::new();
        assert!(added(batch.offer(acquire("a", 0), &LIMITS)));
        assert!(added(batch.offer(acquire("b", 0), &LIMITS)));
        let Offer::SameLock(back) = batch.offer(release("a"), &LIMITS) else {
            panic!("lock a is in the batch already");
        };
        assert!(matches!(back.command, Command::Release(_)));
        assert_eq!(batch.proposals.len(), 2);
    }

    #[test]
    fn a_batch_stops_at_its_command_and_payload_limits_but_one_always_goes() {
        let mut batch = Forming::new();
        for lock in ["a", "b", "c"] {
            assert!(added(batch.offer(acquire(lock, 10), &LIMITS)));
        }
        assert!(batch.is_full(&LIMITS));
        assert!(matches!(
            batch.offer(acquire("d", 0), &LIMITS),
            Offer::NoRoom(_)
        ));

        let mut batch = Forming::new();
        assert!(added(batch.offer(acquire("a", 60), &LIMITS)));
        assert!(
            matches!(batch.offer(acquire("b", 60), &LIMITS), Offer::NoRoom(_)),
            "120 > 100 bytes"
        );
        assert!(
            added(batch.offer(acquire("c", 40), &LIMITS)),
            "100 bytes fit"
        );

        // A command over the payload limit on its own still goes, alone.
        let mut batch = Forming::new();
        assert!(added(batch.offer(acquire("a", 500), &LIMITS)));
        assert!(matches!(
            batch.offer(acquire("b", 0), &LIMITS),
            Offer::NoRoom(_)
        ));
    }
}
