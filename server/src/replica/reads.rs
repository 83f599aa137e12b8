//! Linearizable reads share ReadIndex rounds. openraft 0.9's
//! `ensure_linearizable` confirms leadership with one heartbeat round to
//! the voters per call; under many concurrent reads each paid for its own.
//! Here reads that arrive while a round is running wait for the next one,
//! which then serves all of them, so there is at most one round in flight
//! and one more forming.
//!
//! Why a read may not join the round already running: that round took its
//! read index (the commit index it will wait for) before the read arrived,
//! so a write committed in between could be missing from what the read
//! sees. The round that starts after a read arrived takes its index after
//! it, as ReadIndex requires.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use openraft::ReadPolicy;
use openraft::error::{Fatal, LinearizableReadError, RaftError};
use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::raft::{Raft, TypeConfig};

/// What a round answers: this replica leads and has applied everything
/// committed before the round began, or why not.
pub type ReadCheck = Result<(), RaftError<TypeConfig, LinearizableReadError<TypeConfig>>>;

/// One ReadIndex round.
type Round = Box<dyn Fn() -> BoxFuture<'static, ReadCheck> + Send + Sync>;

/// Groups concurrent linearizable reads into shared ReadIndex rounds.
pub struct ReadBarrier {
    round: Round,
    pending: Mutex<Pending>,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct Pending {
    /// A task is running rounds.
    running: bool,
    /// Reads waiting for the next round.
    waiting: Vec<oneshot::Sender<ReadCheck>>,
}

impl ReadBarrier {
    /// A barrier over `raft`'s ReadIndex, counting its rounds in `metrics`.
    pub fn new(raft: Raft, metrics: Arc<Metrics>) -> Arc<Self> {
        Self::with_round(
            Box::new(move || {
                let raft = raft.clone();
                Box::pin(async move {
                    raft.ensure_linearizable(ReadPolicy::ReadIndex)
                        .await
                        .map(|_| ())
                })
            }),
            metrics,
        )
    }

    fn with_round(round: Round, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            round,
            pending: Mutex::default(),
            metrics,
        })
    }

    /// Resolves once a ReadIndex round that began after this call has
    /// confirmed this replica's leadership and this replica has applied
    /// everything committed before that round: a read of the applied state
    /// after it is linearizable.
    pub async fn wait(self: &Arc<Self>) -> ReadCheck {
        let (tx, rx) = oneshot::channel();
        let start_rounds = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.waiting.push(tx);
            !std::mem::replace(&mut pending.running, true)
        };
        if start_rounds {
            // A task of its own, so that a caller that goes away does not
            // stop the rounds others wait on.
            tokio::spawn(self.clone().run_rounds());
        }
        // The task is gone only if the runtime is shutting down.
        rx.await.unwrap_or(Err(RaftError::Fatal(Fatal::Stopped)))
    }

    /// Reads waiting for the next round.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.pending.lock().unwrap().waiting.len()
    }

    /// Runs rounds while reads wait, each for the reads that were waiting
    /// when it began.
    async fn run_rounds(self: Arc<Self>) {
        loop {
            let readers = {
                let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                if pending.waiting.is_empty() {
                    pending.running = false;
                    return;
                }
                std::mem::take(&mut pending.waiting)
            };
            self.metrics.read_round(readers.len());
            let result = (self.round)().await;
            for reader in readers {
                let _ = reader.send(result.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::Semaphore;

    /// A round that records when it starts and finishes only when the test
    /// adds a permit.
    struct GatedRounds {
        started: Mutex<Vec<usize>>,
        gate: Semaphore,
    }

    fn gated() -> (Arc<GatedRounds>, Arc<ReadBarrier>, Arc<Metrics>) {
        let rounds = Arc::new(GatedRounds {
            started: Mutex::default(),
            gate: Semaphore::new(0),
        });
        let metrics = Arc::new(Metrics::default());
        let recorder = rounds.clone();
        let barrier = ReadBarrier::with_round(
            Box::new(move || {
                let rounds = recorder.clone();
                Box::pin(async move {
                    let n = {
                        let mut started = rounds.started.lock().unwrap();
                        let n = started.len() + 1;
                        started.push(n);
                        started.len()
                    };
                    rounds.gate.acquire().await.unwrap().forget();
                    // Round n's answer names it, to tell rounds apart.
                    if n == 1 {
                        Ok(())
                    } else {
                        Err(RaftError::Fatal(Fatal::Stopped))
                    }
                })
            }),
            metrics.clone(),
        );
        (rounds, barrier, metrics)
    }

    async fn until(what: &str, check: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !check() {
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_read_arriving_during_a_round_waits_for_the_next_one() {
        let (rounds, barrier, metrics) = gated();
        let first = tokio::spawn({
            let barrier = barrier.clone();
            async move { barrier.wait().await }
        });
        until("round 1 starts", || {
            rounds.started.lock().unwrap().len() == 1
        })
        .await;
        // Arrive while round 1 runs: round 1's read index may predate us.
        let second = tokio::spawn({
            let barrier = barrier.clone();
            async move { barrier.wait().await }
        });
        let third = tokio::spawn({
            let barrier = barrier.clone();
            async move { barrier.wait().await }
        });
        until("both wait", || barrier.waiting() == 2).await;
        rounds.gate.add_permits(1);
        assert!(
            first.await.unwrap().is_ok(),
            "round 1 answers the first read"
        );
        // Round 2 began after the second and third reads arrived, and
        // serves both of them.
        until("round 2 starts", || {
            rounds.started.lock().unwrap().len() == 2
        })
        .await;
        assert!(!second.is_finished() && !third.is_finished());
        rounds.gate.add_permits(1);
        assert!(second.await.unwrap().is_err(), "answered by round 2");
        assert!(third.await.unwrap().is_err(), "answered by round 2");
        let text = metrics.render();
        assert!(text.contains("tether_read_index_rounds_total 2"), "{text}");
        assert!(text.contains("tether_linearizable_reads_total 3"), "{text}");
        // Nothing waits: no third round.
        tokio::task::yield_now().await;
        assert_eq!(rounds.started.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn rounds_start_again_after_going_idle() {
        let (rounds, barrier, _) = gated();
        rounds.gate.add_permits(2);
        // Bounded, so that a barrier that never starts a round again fails
        // here rather than hangs.
        let wait = || tokio::time::timeout(Duration::from_secs(30), barrier.wait());
        assert!(wait().await.expect("round 1 runs").is_ok());
        let second = wait().await.expect("a new round starts after idling");
        assert!(second.is_err(), "answered by round 2");
        assert_eq!(rounds.started.lock().unwrap().len(), 2);
    }
}
