//! API errors and their one mapping to gRPC `Status`. Every message says what
//! was wrong and what the caller can do.

use tether_proto::{LEADER_ADDR_METADATA, LEADER_ID_METADATA};
use tonic::{Code, Status};

use crate::sm::CommandError;

/// `Result` of API operations.
pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// Why an API call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Malformed input; nothing was changed.
    #[error("{0}")]
    InvalidArgument(String),
    /// Input over a configured size; nothing was changed.
    #[error("{0}")]
    TooLarge(String),
    /// The caller is at a quota (its identity's sessions); nothing was
    /// changed.
    #[error("{0}")]
    QuotaExceeded(String),
    /// The state machine refused the command (deterministic).
    #[error(transparent)]
    Command(Box<CommandError>),
    /// This replica is not the leader; the caller should retry there.
    #[error("{}", not_leader_message(*.leader_id, .leader_addr))]
    NotLeader {
        /// The leader's id, if known.
        leader_id: Option<u64>,
        /// The leader's address, if known.
        leader_addr: Option<String>,
    },
    /// A wait ran out.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A wait ended because its owner was revoked.
    #[error("{0}")]
    Aborted(String),
    /// A precondition of a cluster operation is not met.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The replica cannot serve now (shutting down, no quorum); retry.
    #[error("{0}")]
    Unavailable(String),
    /// The caller could not be identified.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller's role does not allow the call; nothing was changed.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A bug or storage failure.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<CommandError> for ApiError {
    fn from(err: CommandError) -> Self {
        ApiError::Command(Box::new(err))
    }
}

fn not_leader_message(leader_id: Option<u64>, leader_addr: &Option<String>) -> String {
    match (leader_id, leader_addr) {
        (Some(id), Some(addr)) => {
            format!("this replica is not the leader; retry on the leader, node {id} at {addr}")
        }
        (Some(id), None) => format!("this replica is not the leader; the leader is node {id}"),
        _ => "this replica is not the leader and no leader is known yet; retry shortly".to_string(),
    }
}

impl ApiError {
    /// Label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ApiError::InvalidArgument(_) => "invalid_argument",
            ApiError::TooLarge(_) => "too_large",
            ApiError::QuotaExceeded(_) => "quota_exceeded",
            ApiError::Command(_) => "refused",
            ApiError::NotLeader { .. } => "not_leader",
            ApiError::DeadlineExceeded(_) => "deadline_exceeded",
            ApiError::Aborted(_) => "aborted",
            ApiError::FailedPrecondition(_) => "failed_precondition",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Unauthenticated(_) => "unauthenticated",
            ApiError::PermissionDenied(_) => "permission_denied",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Status {
        let message = err.to_string();
        match err {
            ApiError::InvalidArgument(_) => Status::invalid_argument(message),
            ApiError::TooLarge(_) | ApiError::QuotaExceeded(_) => {
                Status::resource_exhausted(message)
            }
            ApiError::Command(cmd) => {
                let code = match *cmd {
                    CommandError::QueueFull { .. }
                    | CommandError::NoCandidateFits { .. }
                    | CommandError::TooManySessions { .. } => Code::ResourceExhausted,
                    CommandError::LeaseNotFound { .. } => Code::NotFound,
                    CommandError::LockHeld { .. }
                    | CommandError::NotHolder { .. }
                    | CommandError::StaleToken { .. }
                    | CommandError::SequenceTooOld { .. }
                    | CommandError::RequestIdReused { .. }
                    | CommandError::NodeObjectMismatch { .. }
                    | CommandError::NodeObjectGone { .. }
                    | CommandError::PinLabelsDiffer { .. } => Code::FailedPrecondition,
                    CommandError::HoldEnded { .. } | CommandError::WaitEnded { .. } => {
                        Code::Aborted
                    }
                    CommandError::InvalidBatch { .. } => Code::Internal,
                };
                Status::new(code, message)
            }
            ApiError::NotLeader {
                leader_id,
                leader_addr,
            } => {
                let mut status = Status::unavailable(message);
                if let Some(id) = leader_id
                    && let Ok(value) = id.to_string().parse()
                {
                    status.metadata_mut().insert(LEADER_ID_METADATA, value);
                }
                if let Some(addr) = leader_addr
                    && let Ok(value) = addr.parse()
                {
                    status.metadata_mut().insert(LEADER_ADDR_METADATA, value);
                }
                status
            }
            ApiError::DeadlineExceeded(_) => Status::deadline_exceeded(message),
            ApiError::Aborted(_) => Status::aborted(message),
            ApiError::FailedPrecondition(_) => Status::failed_precondition(message),
            ApiError::Unavailable(_) => Status::unavailable(message),
            ApiError::Unauthenticated(_) => Status::unauthenticated(message),
            ApiError::PermissionDenied(_) => Status::permission_denied(message),
            ApiError::Internal(_) => Status::internal(message),
        }
    }
}

/// A gRPC status code's name as the gRPC specification spells it
/// (`UNAVAILABLE`): the `code` label of the call metrics and the `code` of
/// the HTTP/JSON API's errors.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
