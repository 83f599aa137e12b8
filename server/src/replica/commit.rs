//! Proposing an entry and waiting for its answer, without waiting for ever.
//!
//! openraft 0.9 keeps each pending `client_write`'s answer channel until the
//! entry is applied here or truncated from this replica's log. One path does
//! neither: a leader that loses its leadership with entries not yet
//! committed, and then falls so far behind that the new leader sends it a
//! snapshot reaching past the end of its log, installs that snapshot without
//! truncating (no local entry sits at the snapshot's index to conflict) and
//! purges the entries the snapshot covers. Their channels stay, unanswered,
//! for the life of the process (openraft fixed this after 0.9.25, the last
//! 0.9 release: issue 1761, "drain stranded client responders on PurgeLog").
//!
//! For a handler that is one unknown answer. For the leader's sweeper,
//! which awaits its own writes one after another, it was a replica that
//! never swept again: once it led again, no hold timed out and no wait
//! reached its deadline while it led (CI's chaos run of 8163a6b, seed 146).
//! For a write batch it was a permit never given back.
//!
//! So [`commit`] gives up on a write once this replica has stopped leading
//! the term it proposed in and [`stranded_grace`] has passed with no answer:
//! an answer that is coming arrives within a replication round of the new
//! leader's. The write's outcome is then unknown (it may be in the snapshot),
//! which is `UNAVAILABLE`: the client retries, its request id deduplicating.

use openraft::async_runtime::WatchReceiver as _;
use std::time::Duration;

use openraft::ServerState;
use openraft::raft::ClientWriteResponse;

use super::raft_errors::from_raft_error;
use crate::error::{ApiError, Result};
use crate::raft::{Raft, TypeConfig};
use crate::sm::Request;

/// How long a write may stay unanswered after this replica stopped leading
/// the term it was proposed in: three election timeouts (their upper
/// bound), at least a second.
pub fn stranded_grace(raft: &Raft) -> Duration {
    let election_max = Duration::from_millis(raft.config().election_timeout_max);
    (election_max * 3).max(Duration::from_secs(1))
}

/// Proposes `request` and waits for it to apply; gives up (`UNAVAILABLE`,
/// outcome unknown) if this replica stops leading the term it proposed in
/// and no answer comes within [`stranded_grace`] (see the module doc).
pub async fn commit(raft: &Raft, request: Request) -> Result<ClientWriteResponse<TypeConfig>> {
    let term = raft.metrics().borrow_watched().current_term;
    let write = raft.client_write(request);
    tokio::pin!(write);
    let stopped_leading = crate::raft::wait_for_metrics(raft, |m| {
        m.current_term != term || m.state != ServerState::Leader
    });
    tokio::select! {
        biased;
        written = &mut write => return written.map_err(from_raft_error),
        _ = stopped_leading => {}
    }
    let grace = stranded_grace(raft);
    match tokio::time::timeout(grace, write).await {
        Ok(written) => written.map_err(from_raft_error),
        Err(_) => {
            tracing::warn!(
                term,
                ?grace,
                "a write proposed as leader was not answered after this replica stopped \
                 leading; its outcome is unknown"
            );
            Err(ApiError::Unavailable(format!(
                "this replica stopped leading while the write was pending and no answer came \
                 within {grace:?}: its outcome is unknown; retry with the same request id"
            )))
        }
    }
}
