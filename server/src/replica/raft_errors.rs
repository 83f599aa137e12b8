//! openraft's errors as API errors: a follower's "forward to the leader"
//! becomes `NotLeader` (the client retries there), a stopped core
//! `UNAVAILABLE`, a read round short of a quorum `UNAVAILABLE` too.

use crate::error::ApiError;
use crate::raft::TypeConfig;

/// Maps a failed ReadIndex round. A round that did not hear from a quorum
/// (a follower slow to answer, a stream being re-opened, a partition) says
/// nothing lasting about the request: it is `UNAVAILABLE`, which clients
/// retry, never `FAILED_PRECONDITION`, which they must not.
pub fn from_read_check_error(
    err: openraft::error::RaftError<TypeConfig, openraft::error::LinearizableReadError<TypeConfig>>,
) -> ApiError {
    match err {
        openraft::error::RaftError::APIError(
            openraft::error::LinearizableReadError::QuorumNotEnough(e),
        ) => ApiError::Unavailable(format!(
            "this replica could not confirm its leadership for a linearizable read ({e}); retry"
        )),
        other => from_raft_error(other),
    }
}

/// Maps openraft's "forward to leader" and fatal errors.
pub fn from_raft_error<E>(err: openraft::error::RaftError<TypeConfig, E>) -> ApiError
where
    E: std::fmt::Debug
        + std::fmt::Display
        + openraft::TryAsRef<openraft::error::ForwardToLeader<TypeConfig>>,
{
    if let Some(forward) = err.forward_to_leader() {
        return ApiError::NotLeader {
            leader_id: forward.leader_id,
            leader_addr: forward.leader_node.as_ref().map(|n| n.addr.clone()),
        };
    }
    match err {
        openraft::error::RaftError::Fatal(fatal) => ApiError::Unavailable(format!(
            "this replica has stopped ({fatal}); use another replica"
        )),
        openraft::error::RaftError::APIError(e) => ApiError::FailedPrecondition(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::error::{LinearizableReadError, QuorumNotEnough, RaftError};
    use tonic::Status;

    #[test]
    fn a_read_round_short_of_a_quorum_is_retryable() {
        let err = RaftError::APIError(LinearizableReadError::QuorumNotEnough(QuorumNotEnough {
            cluster: "{voters:[{1,2,3}]}".into(),
            got: [1].into(),
        }));
        let status = Status::from(from_read_check_error(err));
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(
            status.message().contains("confirm its leadership"),
            "{status:?}"
        );
    }
}
