//! Typed client errors that tell the caller what to do.
//!
//! ```no_run
//! # async fn demo(client: tether_client::Client, key: tether_client::proto::LockKey) -> Result<(), tether_client::Error> {
//! use tether_client::Error;
//! use tether_client::proto::Outcome;
//! match client.release(&key, "pod-uid", 41, Outcome::Allocated).await {
//!     Ok(_) => {}
//!     // Stale token or not the holder: someone else owns the lock now.
//!     Err(Error::FailedPrecondition(why)) => eprintln!("not ours any more: {why}"),
//!     // No leader reachable: the release may or may not have happened.
//!     Err(err) if err.is_retryable() => eprintln!("unknown outcome, read the holder: {err}"),
//!     Err(err) => return Err(err),
//! }
//! # Ok(()) }
//! ```

use tonic::{Code, Status};

/// `Result` of client calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a call failed, grouped by what the caller should do about it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The input was refused before anything changed; fix it, do not retry.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The lock is held by someone else, the caller is not the holder, or
    /// the token is stale. Read the current state; retrying the same call
    /// gives the same answer.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A wait ran out before the lock was granted; the pod left the queue.
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// Too large, or the queue is full; retry later or send less.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// The lease does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A wait ended because its pod or lease was revoked.
    #[error("aborted: {0}")]
    Aborted(String),
    /// No replica could serve the call before the retry budget ran out (no
    /// leader, all unreachable). For a write the outcome is unknown: it may
    /// have been applied. Retrying with the same request id is safe.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A watch start revision is older than the oldest retained event:
    /// re-list the state, then watch from `oldest_retained`.
    #[error("compacted: {message}")]
    Compacted {
        /// Log index of the oldest retained event.
        oldest_retained: u64,
        /// The server's explanation.
        message: String,
    },
    /// The caller's role does not allow the call (mutual TLS or tokens on).
    #[error("{0}")]
    PermissionDenied(String),
    /// The server could not tell who is calling (no or an unknown token).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// A replica of another cluster than the one this client has been
    /// using answered (see [`crate::cluster`]); nothing was done there.
    /// Two clusters answer at the client's addresses: an operator has to
    /// look (`lockctl cluster status` on each replica names its cluster).
    /// A client that is meant to move to a new cluster (after a restore
    /// from a backup) must be restarted.
    #[error("wrong cluster: {0}")]
    WrongCluster(String),
    /// Anything else the server said.
    #[error("{0}")]
    Other(String),
}

impl Error {
    /// Whether retrying the same call may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable(_) | Error::ResourceExhausted(_))
    }

    /// The exit code `lockctl` uses for this error (documented in its help).
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::InvalidArgument(_) => 2,
            Error::FailedPrecondition(_) | Error::NotFound(_) | Error::Aborted(_) => 3,
            Error::WrongCluster(_) => 8,
            Error::Compacted { .. } => 6,
            Error::DeadlineExceeded(_) => 4,
            Error::Unavailable(_) | Error::ResourceExhausted(_) => 5,
            Error::PermissionDenied(_) | Error::Unauthenticated(_) => 7,
            Error::Other(_) => 1,
        }
    }
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        let message = status.message().to_string();
        match status.code() {
            Code::InvalidArgument => Error::InvalidArgument(message),
            Code::FailedPrecondition
                if status
                    .metadata()
                    .contains_key(tether_proto::WRONG_CLUSTER_METADATA) =>
            {
                Error::WrongCluster(message)
            }
            Code::FailedPrecondition => Error::FailedPrecondition(message),
            Code::DeadlineExceeded => Error::DeadlineExceeded(message),
            Code::ResourceExhausted => Error::ResourceExhausted(message),
            Code::NotFound => Error::NotFound(message),
            Code::Aborted => Error::Aborted(message),
            Code::Unavailable => Error::Unavailable(message),
            Code::PermissionDenied => Error::PermissionDenied(message),
            Code::Unauthenticated => Error::Unauthenticated(message),
            Code::OutOfRange => {
                let compacted = status
                    .metadata()
                    .get(tether_proto::COMPACT_REVISION_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                match compacted {
                    Some(oldest_retained) => Error::Compacted {
                        oldest_retained,
                        message,
                    },
                    // gRPC's own "message length too large".
                    None => Error::InvalidArgument(format!(
                        "{message} (the replica's --max-request-bytes); nothing was changed"
                    )),
                }
            }
            code => Error::Other(format!("{code:?}: {message}")),
        }
    }
}
