//! RocksDB storage of one replica: the Raft log (openraft `RaftLogStorage`)
//! and the state machine (`RaftStateMachine`), in one database with four
//! column families.
//!
//! | column family | keys | values |
//! |---|---|---|
//! | `log` | log index, big-endian u64 | postcard `Entry` |
//! | `meta` | `vote`, `committed`, `last_purged`, `snapshot` | postcard |
//! | `sm` | `l/<scope>\0<name>`, `t/<lease id>`, `s/<client id>`, `m/...` | postcard |
//! | `events` | log index + sub-index, big-endian | postcard `Event` |
//!
//! Log appends and votes are written with fsync. A state-machine apply writes
//! its state changes, events and `last_applied` in one `WriteBatch`: the batch
//! is atomic, and because it shares the write-ahead log with the (synced) Raft
//! log, it is durable no later than the next synced log write; if a crash
//! loses it, openraft re-applies the entries from the durable log.

// openraft's traits fix the error type (`StorageError`, large); helpers here
// return it too rather than converting back and forth.
#![allow(clippy::result_large_err)]

pub mod keys;
pub mod log_store;
pub mod state_machine;

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, DB, Options};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use log_store::LogStore;
pub use log_store::decode_entry;
pub use state_machine::{
    EventRetention, SnapshotFile, StateHandle, StateMachineStore, events_first_index, read_events,
};

use crate::raft::StorageError;

/// Column family of Raft log entries.
pub const CF_LOG: &str = "log";
/// Column family of Raft metadata (vote, committed, purged, snapshot).
pub const CF_META: &str = "meta";
/// Column family of state-machine data.
pub const CF_SM: &str = "sm";
/// Column family of events by revision.
pub const CF_EVENTS: &str = "events";

/// Opens (creating if needed) the replica's database under `dir`.
pub fn open_db(dir: &Path) -> Result<Arc<DB>, rocksdb::Error> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    let cfs = [CF_LOG, CF_META, CF_SM, CF_EVENTS]
        .into_iter()
        .map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    Ok(Arc::new(DB::open_cf_descriptors(&opts, dir, cfs)?))
}

/// Opens the database and builds both halves of the store over it. The
/// returned `Arc<DB>` lets the owner wait until Raft has let go of the
/// database (RocksDB allows one opener per directory).
pub async fn open(dir: &Path) -> Result<(Arc<DB>, LogStore, StateMachineStore), StorageError> {
    let db = open_db(dir).map_err(|e| err::read_state_machine(&e))?;
    let log = LogStore::new(db.clone());
    let sm = StateMachineStore::load(db.clone())?;
    Ok((db, log, sm))
}

/// Encodes a value in the log's binary format.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value).expect("postcard encoding of in-memory values cannot fail")
}

/// Decodes a value in the log's binary format.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}

/// Constructors of openraft storage errors from any error value.
pub(crate) mod err {
    use openraft::storage::SnapshotSignature;
    use openraft::{AnyError, StorageIOError};

    use crate::raft::StorageError;

    macro_rules! io_errors {
        ($($name:ident),*) => {$(
            pub(crate) fn $name<E: std::error::Error + 'static>(e: &E) -> StorageError {
                StorageIOError::$name(AnyError::new(e)).into()
            }
        )*};
    }
    io_errors!(
        read,
        write,
        read_logs,
        write_logs,
        write_vote,
        read_state_machine,
        write_state_machine
    );

    pub(crate) fn write_snapshot<E: std::error::Error + 'static>(
        signature: Option<SnapshotSignature<u64>>,
        e: &E,
    ) -> StorageError {
        StorageIOError::write_snapshot(signature, AnyError::new(e)).into()
    }
}
