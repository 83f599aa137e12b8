//! One deadline for a caller's whole operation, across every Tether call it
//! makes. A [`Client`](crate::Client) retries each call for its own
//! `retry_timeout`; an operation of several calls (the extender's bind:
//! acquire, claim, bind; the device plugin's `Allocate`: holder, claims,
//! release) could so chain several full retry budgets while its caller
//! (kube-scheduler's `httpTimeout`, the kubelet admitting a node's pods)
//! had long given up. Inside [`within`], every call of the task gives up at
//! the deadline (with [`Error::DeadlineExceeded`](crate::Error)), whatever
//! its own budget; [`unbounded`] lifts it for clean-up that must finish
//! (giving back a hold the operation took).

use std::future::Future;
use std::time::Instant;

tokio::task_local! {
    static CALLER_DEADLINE: Option<Instant>;
}

/// Runs `operation` with every Tether call in it (on this task) ending by
/// `deadline` at the latest.
pub async fn within<F: Future>(deadline: Instant, operation: F) -> F::Output {
    CALLER_DEADLINE.scope(Some(deadline), operation).await
}

/// Runs `operation` without the deadline of an enclosing [`within`]: for
/// clean-up that must finish even when the operation ran out of time.
pub async fn unbounded<F: Future>(operation: F) -> F::Output {
    CALLER_DEADLINE.scope(None, operation).await
}

/// The deadline in force on this task, if any.
pub fn current() -> Option<Instant> {
    CALLER_DEADLINE.try_with(|d| *d).ok().flatten()
}
