//! Write batching: acquires and releases of many clients share log entries.
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
//! A batch holds at most one command per lock (the entry's index is the
//! fencing token of any grant in it, and tokens must rise per lock). A
//! command on a lock already in the forming batch goes out at once in an
//! entry of its own, outside the in-flight limit, as every command did
//! before batching: a hot lock's commands keep pipelining instead of
//! waiting for a permit and a batch of their own.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::wall_clock_ms;
use crate::error::{ApiError, Result, from_raft_error};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::network::PeerFormats;
use crate::sm::{
    BATCH_FORMAT_VERSION, Batch, BatchItem, Command, LockKey, MAX_BATCH_ITEMS, Reply, Request,
    RequestId, Response, batchable_lock,
};

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
}

/// The queue in front of Raft for acquires and releases.
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
    reply: oneshot::Sender<Result<Response>>,
}

impl Proposal {
    fn lock(&self) -> &LockKey {
        batchable_lock(&self.command).expect("only batchable commands are queued")
    }

    fn payload_bytes(&self) -> usize {
        match &self.command {
            Command::Acquire(acquire) => acquire.payload.len(),
            _ => 0,
        }
    }
}

impl Proposer {
    /// Starts the task that forms and proposes batches. It ends when the
    /// proposer is dropped and the queue has drained.
    pub fn start(
        raft: Raft,
        id: u64,
        formats: Arc<PeerFormats>,
        limits: BatchLimits,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (queue, rx) = mpsc::channel(4 * MAX_BATCH_ITEMS);
        tokio::spawn(form_batches(raft.clone(), rx, limits, metrics));
        Self {
            queue,
            raft,
            id,
            formats,
        }
    }

    /// Whether batch entries may be written now: every other member, voter
    /// or learner, has answered a Raft message saying it reads them.
    pub fn may_batch(&self) -> bool {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        let peers = metrics
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .filter(|id| *id != self.id);
        self.formats.all_read(peers, BATCH_FORMAT_VERSION)
    }

    /// Proposes an acquire or release and returns its entry's response for
    /// this command alone.
    pub async fn propose(
        &self,
        request_id: Option<RequestId>,
        command: Command,
    ) -> Result<Response> {
        debug_assert!(batchable_lock(&command).is_some());
        let (reply, answer) = oneshot::channel();
        let stopped =
            || ApiError::Unavailable("this replica is shutting down; use another replica".into());
        self.queue
            .send(Proposal {
                request_id,
                command,
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
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
    /// lock yet. The first proposal always joins.
    fn offer(&mut self, proposal: Proposal, limits: &BatchLimits) -> Offer {
        let bytes = proposal.payload_bytes();
        if !self.proposals.is_empty() {
            if self.locks.contains(proposal.lock()) {
                return Offer::SameLock(proposal);
            }
            if self.proposals.len() >= limits.max_commands
                || self.payload_bytes + bytes > limits.max_payload_bytes
            {
                return Offer::NoRoom(proposal);
            }
        }
        self.locks.insert(proposal.lock().clone());
        self.payload_bytes += bytes;
        self.proposals.push(proposal);
        Offer::Added
    }

    fn is_full(&self, limits: &BatchLimits) -> bool {
        self.proposals.len() >= limits.max_commands
    }
}

/// Takes proposals off the queue, whatever is waiting each time an entry
/// may go out, and proposes them.
async fn form_batches(
    raft: Raft,
    mut queue: mpsc::Receiver<Proposal>,
    limits: BatchLimits,
    metrics: Arc<Metrics>,
) {
    let in_flight = Arc::new(Semaphore::new(limits.in_flight.max(1)));
    // A proposal the last batch had no room for: it starts the next one.
    let mut carried: Option<Proposal> = None;
    loop {
        let permit = in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let first = match carried.take() {
            Some(proposal) => proposal,
            None => match queue.recv().await {
                Some(proposal) => proposal,
                None => return,
            },
        };
        let mut batch = Forming::new();
        batch.offer(first, &limits);
        let mut alone = Vec::new();
        while !batch.is_full(&limits) {
            let Ok(proposal) = queue.try_recv() else {
                break;
            };
            match batch.offer(proposal, &limits) {
                Offer::Added => {}
                Offer::SameLock(proposal) => alone.push(proposal),
                Offer::NoRoom(proposal) => {
                    carried = Some(proposal);
                    break;
                }
            }
        }
        metrics.proposed_entry(batch.proposals.len());
        let raft_for_batch = raft.clone();
        tokio::spawn(async move {
            propose(&raft_for_batch, batch.proposals).await;
            drop(permit);
        });
        for proposal in alone {
            metrics.proposed_entry(1);
            let raft = raft.clone();
            tokio::spawn(async move { propose(&raft, vec![proposal]).await });
        }
    }
}

/// Proposes one entry for `proposals` and answers each of them.
async fn propose(raft: &Raft, mut proposals: Vec<Proposal>) {
    if proposals.len() == 1 {
        let proposal = proposals.pop().expect("one proposal");
        let request = Request::new(proposal.request_id, wall_clock_ms(), proposal.command);
        let result = raft
            .client_write(request)
            .await
            .map(|written| written.data)
            .map_err(from_raft_error);
        let _ = proposal.reply.send(result);
        return;
    }
    let mut replies = Vec::with_capacity(proposals.len());
    let mut items = Vec::with_capacity(proposals.len());
    for proposal in proposals {
        replies.push(proposal.reply);
        items.push(BatchItem {
            request_id: proposal.request_id,
            command: proposal.command,
        });
    }
    let request = Request::new(None, wall_clock_ms(), Command::Batch(Batch { items }));
    let answers: Vec<Result<Response>> = match raft.client_write(request).await {
        Ok(written) => match written.data.result {
            Ok(Reply::Batch(responses)) if responses.len() == replies.len() => {
                responses.into_iter().map(Ok).collect()
            }
            other => {
                let err = ApiError::Internal(format!(
                    "a batch of {} commands was answered with {other:?}",
                    replies.len()
                ));
                vec![Err(err); replies.len()]
            }
        },
        Err(err) => vec![Err(from_raft_error(err)); replies.len()],
    };
    for (reply, answer) in replies.into_iter().zip(answers) {
        // The caller may have gone (its RPC was cancelled): nothing to do.
        let _ = reply.send(answer);
    }
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
        }
    }

    const LIMITS: BatchLimits = BatchLimits {
        max_commands: 3,
        max_payload_bytes: 100,
        in_flight: 1,
    };

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
