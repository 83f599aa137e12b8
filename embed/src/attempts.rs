//! One bind attempt per pod at a time in an extender.
//!
//! kube-scheduler gives up on a bind when its extender `httpTimeout`
//! passes, or when it restarts or fails over, and binds the same pod again.
//! The first attempt may still run: waiting for a stopped claim, or through
//! an election. Both attempts act for the pod's UID through the same Tether
//! client, and Tether answers the same client's acquire of a pod with the
//! hold it already has (the same token), so without this gate the first
//! attempt, finding its caller gone, would undo what the second bound the
//! pod with: release the token, hand the node to the next waiter, delete
//! the claim (issue 62, case 1).
//!
//! A later attempt waits here, within its own bind deadline, until the
//! earlier one is over: its undo included, and the releases it leaves to
//! run in the background ([`Turn`] is shared with them). Attempts through
//! other extender replicas are kept apart by Tether itself: another client's
//! acquire takes the pod's hold over with a new token (format 9), and a
//! claim is ended only by the attempt whose token it carries
//! ([`crate::accounting::BIND_TOKEN_LABEL`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

/// The pods with a bind attempt under way or waiting.
#[derive(Default)]
pub struct Attempts {
    by_pod: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A bind attempt's turn at its pod: the next attempt of the pod starts
/// once every clone of this is dropped.
#[derive(Clone)]
pub struct Turn(#[allow(dead_code)] Arc<TurnInner>);

struct TurnInner {
    pod_uid: String,
    attempts: Arc<Attempts>,
    _guard: OwnedMutexGuard<()>,
}

impl Drop for TurnInner {
    fn drop(&mut self) {
        // Forget the pod when no other attempt waits for it (the map holds
        // one reference, this turn's guard another until it drops, after
        // this: so 1 means nobody else has the mutex).
        let mut by_pod = self.attempts.by_pod.lock().expect("attempts lock");
        if let Some(gate) = by_pod.get(&self.pod_uid)
            && Arc::strong_count(gate) <= 2
        {
            by_pod.remove(&self.pod_uid);
        }
    }
}

impl Attempts {
    /// Waits for the pod's earlier attempts to be over (calling
    /// `on_wait` first when there is one); this attempt's turn, and
    /// whether it had to wait.
    pub async fn turn(self: &Arc<Self>, pod_uid: &str, on_wait: impl FnOnce()) -> (Turn, bool) {
        let gate = self
            .by_pod
            .lock()
            .expect("attempts lock")
            .entry(pod_uid.to_string())
            .or_default()
            .clone();
        let (guard, waited) = match gate.clone().try_lock_owned() {
            Ok(guard) => (guard, false),
            Err(_) => {
                on_wait();
                (gate.lock_owned().await, true)
            }
        };
        let turn = Turn(Arc::new(TurnInner {
            pod_uid: pod_uid.to_string(),
            attempts: self.clone(),
            _guard: guard,
        }));
        (turn, waited)
    }

    /// Pods with an attempt under way or waiting.
    pub fn pods(&self) -> usize {
        self.by_pod.lock().expect("attempts lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_later_attempt_waits_until_every_clone_of_the_earlier_turn_is_dropped() {
        let attempts = Arc::new(Attempts::default());
        let (first, waited) = attempts.turn("p", || ()).await;
        assert!(!waited);
        let background = first.clone();
        drop(first);
        let later = {
            let attempts = attempts.clone();
            tokio::spawn(async move { attempts.turn("p", || ()).await })
        };
        // Another pod is not held up.
        let (other, _) = attempts.turn("q", || ()).await;
        drop(other);
        tokio::task::yield_now().await;
        assert!(
            !later.is_finished(),
            "started while the background undo ran"
        );
        drop(background);
        let (turn, waited) = tokio::time::timeout(Duration::from_secs(30), later)
            .await
            .expect("the later attempt's turn")
            .unwrap();
        assert!(waited);
        drop(turn);
        assert_eq!(attempts.pods(), 0, "nothing kept once all are over");
    }
}
