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
//! Votes are written with fsync; log appends are written unsynced and made
//! durable by the log store's sync thread before openraft hears of them
//! ([`log_store`]; on openraft 0.9 a group commit of this kind was measured
//! slower and reverted, see BENCHMARKS.md; on 0.10 it is to be measured
//! again). A state-machine apply writes its state changes, events and
//! `last_applied` in one `WriteBatch`: the batch is atomic, and because it
//! shares the write-ahead log with the Raft log, it is durable no later than
//! the next log sync; if a crash loses it, openraft re-applies the entries
//! from the durable log.

pub mod compat;
pub mod keys;
pub mod log_store;
pub mod state_machine;
pub mod waiters;

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, DB, MemtableFactory, Options};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use log_store::LogStore;
pub use log_store::decode_entry;
pub use state_machine::{
    EventRetention, SnapshotFile, StateHandle, StateMachineStore, events_first_index, read_events,
};

use crate::raft::StorageError;

/// Whether planted bug `name` is switched on (`FAILPOINTS=<name>=return`;
/// the chaos and power-loss tests must catch each). Always off without the
/// `failpoints` feature. The switches:
/// - `log-append-without-sync`: appends acknowledged to Raft unsynced;
/// - `vote-without-sync`: the vote written unsynced;
/// - `snapshot-install-without-sync`: an installed snapshot (its state and
///   its stored copy) written unsynced;
/// - `snapshot-install-in-two-writes`: an installed snapshot's state written
///   apart from the stored snapshot (before the fix of 2026-12-05);
/// - `leader-restore`: a restarted leader leads on in its old term (read by
///   `raft::start` when the replica starts).
pub(crate) fn planted(name: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        fail::eval(name, |_| ()).is_some()
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}

/// `options` fsynced, unless planted bug `name` is on.
pub(crate) fn sync_unless_planted(name: &str) -> rocksdb::WriteOptions {
    let mut options = rocksdb::WriteOptions::default();
    options.set_sync(!planted(name));
    options
}

/// Column family of Raft log entries.
pub const CF_LOG: &str = "log";
/// Column family of Raft metadata (vote, committed, purged, snapshot).
pub const CF_META: &str = "meta";
/// `meta` key of the cluster id ([`crate::cluster_id`]). In `meta`, not in
/// `sm`, so that installing a snapshot keeps it.
pub const CLUSTER_ID_KEY: &[u8] = b"cluster_id";
/// Column family of state-machine data.
pub const CF_SM: &str = "sm";
/// Column family of events by revision.
pub const CF_EVENTS: &str = "events";

/// Memory for the memtables of all column families together; above it
/// RocksDB flushes the largest. Also the most write-ahead log kept: a
/// restart replays at most this much. RocksDB's defaults (up to two 64 MiB
/// memtables per column family, the log kept until all are flushed) showed
/// in the scale run as ~520 MiB resident per replica and a 2.1 s restart.
const MEMTABLE_BUDGET: usize = 64 << 20;

/// One memtable of a column family (a flush writes it out as a file).
const MEMTABLE_SIZE: usize = 16 << 20;

/// Opens (creating if needed) the replica's database under `dir`.
pub fn open_db(dir: &Path) -> Result<Arc<DB>, rocksdb::Error> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_db_write_buffer_size(MEMTABLE_BUDGET);
    opts.set_max_total_wal_size(MEMTABLE_BUDGET as u64);
    // A vector memtable (below) takes no concurrent inserts. Concurrent
    // writers (log appends, applies, metadata) still form one RocksDB write
    // group; its leader then inserts for all of them.
    opts.set_allow_concurrent_memtable_write(false);
    let cfs = [CF_LOG, CF_META, CF_SM, CF_EVENTS].into_iter().map(|name| {
        let mut cf_opts = Options::default();
        cf_opts.set_write_buffer_size(MEMTABLE_SIZE);
        if name == CF_SM {
            // The state machine's keys are written on every apply, in no
            // order (locks, sessions, pods), and read back only whole, when
            // the replica opens or restores a snapshot: the state lives in
            // memory. A skip list paid a sorted insert per key (~8 % of the
            // replicas' CPU in a 64-client run); a vector appends, and sorts
            // once when the memtable is flushed or scanned.
            cf_opts.set_memtable_factory(MemtableFactory::Vector);
        }
        ColumnFamilyDescriptor::new(name, cf_opts)
    });
    Ok(Arc::new(DB::open_cf_descriptors(&opts, dir, cfs)?))
}

/// Keeps the log's purge point from passing the snapshot on disk while a
/// snapshot is being installed.
///
/// openraft 0.9, installing a snapshot on a follower, hands the state machine
/// the snapshot and tells the log store to purge up to its last index, and
/// the two can run in either order. Were the purge persisted first and the
/// replica to crash before the snapshot was, the replica would restart with
/// its log purged past its snapshot, which openraft refuses to start from
/// (found by the chaos tests' `sm-install-snapshot-before` crash point).
/// So while an install is in flight, a purge waits until the snapshot
/// covering it is stored; and once a snapshot has begun arriving, no purge
/// passes the stored one ([`SnapshotGate::may_purge`]).
pub struct SnapshotGate {
    installing: std::sync::atomic::AtomicBool,
    /// A snapshot began arriving in this process: from then on the log is
    /// never purged past the stored snapshot. Only an install makes
    /// openraft ask for more than the stored snapshot covers (a snapshot
    /// this replica builds is stored before openraft hears of it); a store
    /// that never receives one, as in openraft's storage suite, purges as
    /// asked.
    installs_began: std::sync::atomic::AtomicBool,
    /// Last log index covered by the stored snapshot.
    covered: tokio::sync::watch::Sender<u64>,
    /// Held while a snapshot is written as the stored one, so that a
    /// snapshot built from the state before an install cannot be written
    /// over the installed (newer) one: the log may already be purged up to
    /// the installed snapshot, and a replica whose stored snapshot is older
    /// than its purged log cannot start (openraft's startup check; seen in
    /// a 5-replica chaos run on 2026-12-02, seed 100014, not reproduced on
    /// replay).
    storing: std::sync::Mutex<()>,
}

/// Longest a purge waits for an install (then it goes ahead and warns: an
/// install that never finishes must not stall the log forever).
const PURGE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl SnapshotGate {
    /// A gate with `covered` as the stored snapshot's last index.
    pub fn new(covered: u64) -> Arc<Self> {
        Arc::new(Self {
            installing: false.into(),
            installs_began: false.into(),
            covered: tokio::sync::watch::Sender::new(covered),
            storing: std::sync::Mutex::new(()),
        })
    }

    /// Held while writing the stored snapshot (see the field).
    pub fn storing(&self) -> std::sync::MutexGuard<'_, ()> {
        self.storing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Last log index covered by a stored snapshot, as far as this gate was
    /// told.
    pub fn covered(&self) -> u64 {
        *self.covered.borrow()
    }

    /// A snapshot started arriving.
    pub fn begin_install(&self) {
        self.installs_began
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.installing
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// An install ended: stored (with the index it covers) or failed.
    pub fn end_install(&self, stored: Option<u64>) {
        if let Some(index) = stored {
            self.stored(index);
        }
        self.installing
            .store(false, std::sync::atomic::Ordering::SeqCst);
        // Wake purges waiting on a failed install too.
        self.covered.send_modify(|_| {});
    }

    /// A snapshot covering `index` is on disk.
    pub fn stored(&self, index: u64) {
        self.covered.send_modify(|c| *c = (*c).max(index));
    }

    /// Whether the log may be purged up to `index`: not past the stored
    /// snapshot, once one has begun arriving. Asked after [`Self::wait_before_purge`];
    /// a purge that may not happen is left for the next one (openraft
    /// reads nothing below the point it asked for, and the entries left
    /// behind are committed ones). Without this a replica killed while its
    /// install was being stored could restart with its log purged past its
    /// snapshot and not start at all (chaos runs on 2026-12-02, seed
    /// 100014, and on 2026-12-03, seed 65).
    pub fn may_purge(&self, index: u64) -> bool {
        !self
            .installs_began
            .load(std::sync::atomic::Ordering::SeqCst)
            || self.covered() >= index
    }

    /// Returns once purging up to `index` cannot pass the stored snapshot.
    pub async fn wait_before_purge(&self, index: u64) {
        let mut covered = self.covered.subscribe();
        let safe =
            |c: &u64| *c >= index || !self.installing.load(std::sync::atomic::Ordering::SeqCst);
        if tokio::time::timeout(PURGE_WAIT, covered.wait_for(safe))
            .await
            .is_err()
        {
            tracing::warn!(
                index,
                "the snapshot install covering a purge was not stored within {PURGE_WAIT:?}"
            );
        }
    }
}

/// Opens the database and builds both halves of the store over it. The
/// returned `Arc<DB>` lets the owner wait until Raft has let go of the
/// database (RocksDB allows one opener per directory).
pub async fn open(dir: &Path) -> Result<(Arc<DB>, LogStore, StateMachineStore), StorageError> {
    let started = std::time::Instant::now();
    let db = open_db(dir).map_err(|e| err::read_state_machine(&e))?;
    let sm = StateMachineStore::load(db.clone())?;
    tracing::info!(
        elapsed_ms = started.elapsed().as_millis() as u64,
        "database opened and state loaded"
    );
    let log = LogStore::new(db.clone(), sm.snapshot_gate());
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

/// Storage errors (`io::Error`, what openraft 0.10's storage traits
/// return) from any error value, each saying what was being done.
pub(crate) mod err {
    use crate::raft::StorageError;

    macro_rules! io_errors {
        ($($name:ident => $what:literal),*) => {$(
            pub(crate) fn $name<E: std::fmt::Display + ?Sized>(e: &E) -> StorageError {
                std::io::Error::other(format!(concat!("cannot ", $what, ": {}"), e))
            }
        )*};
    }
    io_errors!(
        read => "read the store",
        write => "write the store",
        read_logs => "read the log",
        write_logs => "write the log",
        write_vote => "write the vote",
        read_state_machine => "read the state machine",
        write_state_machine => "write the state machine",
        write_snapshot => "write the snapshot"
    );
}

/// The cluster id stored in `db`, if any.
pub fn read_cluster_id(db: &DB) -> Result<Option<String>, StorageError> {
    let cf = db
        .cf_handle(CF_META)
        .expect("the meta column family exists");
    match db.get_cf(cf, CLUSTER_ID_KEY) {
        Ok(Some(bytes)) => decode(&bytes)
            .map(Some)
            .map_err(|e| err::read_state_machine(&e)),
        Ok(None) => Ok(None),
        Err(e) => Err(err::read_state_machine(&e)),
    }
}

/// Stores the cluster id in `db`, synced.
pub fn write_cluster_id(db: &DB, id: &str) -> Result<(), rocksdb::Error> {
    let cf = db
        .cf_handle(CF_META)
        .expect("the meta column family exists");
    let mut options = rocksdb::WriteOptions::default();
    options.set_sync(true);
    db.put_cf_opt(cf, CLUSTER_ID_KEY, encode(&id.to_string()), &options)
}
