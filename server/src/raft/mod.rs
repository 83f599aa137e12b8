//! Raft wiring: the openraft type configuration and the network between
//! replicas.

pub mod dial;
pub mod network;

use std::io::Cursor;

use crate::sm::{Request, Response};

openraft::declare_raft_types!(
    /// Tether's openraft type configuration.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = u64,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// Largest Raft message a replica accepts (and sends): AppendEntries carry
/// many entries, snapshots come in chunks; client requests are bounded by
/// `--max-request-bytes` instead, at most a quarter of this so that one entry
/// always fits a message. The default of `Config::raft_message_limit`.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// A Tether replica's Raft handle.
pub type Raft = openraft::Raft<TypeConfig>;
/// A log id in Tether's configuration.
pub type LogId = openraft::LogId<u64>;
/// Membership as stored with its log id.
pub type StoredMembership = openraft::StoredMembership<u64, openraft::BasicNode>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// Storage errors.
pub type StorageError = openraft::StorageError<u64>;
