//! The Raft log in RocksDB (openraft `RaftLogStorage`).
//!
//! Votes, truncations and purges are synced RocksDB writes. Appends are
//! written unsynced, so that openraft can read and replicate them at once,
//! and made durable by the [`Flusher`] thread, which syncs RocksDB's
//! write-ahead log and only then tells openraft (its `IOFlushed` callback):
//! a leader's own fsync overlaps sending the entries to the followers, and
//! appends that arrive while a sync runs share the next one. A follower's
//! appends (entries another replica proposed) are synced in the write
//! itself when the flusher has nothing pending: the leader waits for that
//! sync anyway, and the hand-off to the flusher's thread and back cost a
//! follower CPU and latency (an A/B is in BENCHMARKS.md). The committed log
//! id, a hint to openraft, is not written on its own: it goes out with the
//! next append.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use crate::metrics::Metrics;
use openraft::RaftLogReader;
use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use rocksdb::{DB, Direction, IteratorMode, WriteBatch, WriteOptions};

use super::err;
use super::keys::{log_index, log_key};
use super::{CF_LOG, CF_META, SnapshotGate, decode, encode};
use crate::raft::{Entry, LogId, StorageError, TypeConfig, Vote};
use crate::sm::FORMAT_VERSION;

/// Longest range of entries read by key instead of through an iterator.
/// openraft reads a few entries at a time in steady state (those just
/// committed, to apply them; those just appended, to replicate them), and a
/// RocksDB iterator costs far more to set up than a few point reads: it
/// opens a cursor on every memtable and table file and on the range
/// deletions of purges. A profile at 64 clients had 4 % of all samples in
/// setting up the iterators of these reads.
const POINT_READ_MAX_ENTRIES: u64 = 64;

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const LAST_PURGED: &[u8] = b"last_purged";

/// The Raft log of one replica. Cheap to clone: clones share the database.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<DB>,
    gate: Arc<SnapshotGate>,
    /// Where synced writes are timed (`tether_fsync_duration_seconds`).
    metrics: Option<Arc<Metrics>>,
    /// Makes appends durable; started by the first append (after
    /// [`LogStore::with_metrics`]), shared by the clones.
    flusher: Arc<std::sync::OnceLock<Flusher>>,
    /// Appends handed to the flusher and not yet acknowledged.
    unsynced: Arc<std::sync::atomic::AtomicUsize>,
    /// This replica's id: appends of entries it proposed as leader go to
    /// the flusher (their sync overlaps sending them to the followers);
    /// others are synced where they are written ([`LogStore::with_own_id`]).
    own_id: Option<u64>,
    /// The latest committed log id openraft asked to save and not yet
    /// written: it goes out with the next append's write (see
    /// `save_committed`), shared by the clones.
    committed_to_save: Arc<std::sync::Mutex<Option<Option<LogId>>>>,
}

/// Syncs the write-ahead log behind unsynced appends and then calls their
/// callbacks, in append order, on a thread of its own (an fsync blocks).
/// Every callback waiting when a sync starts is answered by it. The thread
/// ends once every clone of the store is dropped.
struct Flusher {
    waiting: std::sync::mpsc::Sender<IOFlushed<TypeConfig>>,
}

impl Flusher {
    fn start(
        db: Arc<DB>,
        metrics: Option<Arc<Metrics>>,
        unsynced: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        let (waiting, queue) = std::sync::mpsc::channel::<IOFlushed<TypeConfig>>();
        std::thread::Builder::new()
            .name("tether-log-sync".into())
            .spawn(move || {
                while let Ok(first) = queue.recv() {
                    let mut callbacks = vec![first];
                    callbacks.extend(queue.try_iter());
                    // Appended, possibly replicated, not yet synced here.
                    fail::fail_point!("log-append-before-sync");
                    let started = std::time::Instant::now();
                    // Everything written to the log before the sync began
                    // is durable when it returns.
                    let result = if super::planted("log-append-without-sync") {
                        Ok(())
                    } else {
                        db.flush_wal(true)
                    };
                    if let Some(metrics) = &metrics {
                        metrics.fsynced(started.elapsed());
                    }
                    match result {
                        Ok(()) => {
                            // Synced but not yet acknowledged to Raft.
                            fail::fail_point!("log-append-before-ack");
                            let answered = callbacks.len();
                            for callback in callbacks {
                                callback.io_completed(Ok(()));
                            }
                            // Counted down after the answers: a later
                            // append synced in its own write is never
                            // answered before these.
                            unsynced.fetch_sub(answered, std::sync::atomic::Ordering::AcqRel);
                        }
                        Err(e) => {
                            let answered = callbacks.len();
                            for callback in callbacks {
                                callback.io_completed(Err(std::io::Error::other(format!(
                                    "cannot sync the log: {e}"
                                ))));
                            }
                            // After the answers too.
                            unsynced.fetch_sub(answered, std::sync::atomic::Ordering::AcqRel);
                        }
                    }
                }
            })
            .expect("the log sync thread starts");
        Self { waiting }
    }
}

fn synced() -> WriteOptions {
    let mut opts = WriteOptions::default();
    opts.set_sync(true);
    opts
}

impl LogStore {
    /// A log store over an open database.
    pub fn new(db: Arc<DB>, gate: Arc<SnapshotGate>) -> Self {
        Self {
            db,
            gate,
            metrics: None,
            flusher: Arc::default(),
            unsynced: Arc::default(),
            own_id: None,
            committed_to_save: Arc::default(),
        }
    }

    /// This store, knowing its replica's id (see `own_id`); without it,
    /// every append is synced on the flusher's thread.
    pub fn with_own_id(mut self, id: u64) -> Self {
        self.own_id = Some(id);
        self
    }

    /// This store, timing its synced writes into `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Runs one synced write and times it.
    fn synced_write(
        &self,
        write: impl FnOnce(&WriteOptions) -> Result<(), rocksdb::Error>,
    ) -> Result<(), rocksdb::Error> {
        let started = std::time::Instant::now();
        let result = write(&synced());
        if let Some(metrics) = &self.metrics {
            metrics.fsynced(started.elapsed());
        }
        result
    }

    fn cf_log(&self) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(CF_LOG)
            .expect("log column family is created at open")
    }

    fn cf_meta(&self) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(CF_META)
            .expect("meta column family is created at open")
    }

    fn get_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, StorageError> {
        let Some(bytes) = self
            .db
            .get_cf(self.cf_meta(), key)
            .map_err(|e| err::read(&e))?
        else {
            return Ok(None);
        };
        decode(&bytes).map(Some).map_err(|e| err::read(&e))
    }

    /// Records that the log starts after `log_id` (a restored backup covers
    /// everything up to it), and that `node_id`, the restored replica, has
    /// voted for itself in that entry's term. Without the vote the replica
    /// would campaign in the backup's own term, and Raft (openraft checks
    /// it) refuses a leader whose vote is not above the leader of the last
    /// entry: with another node id in that term the restored replica's
    /// core stopped at its first election whenever its id was the lower.
    pub fn start_after(&self, log_id: LogId, node_id: u64) -> Result<(), StorageError> {
        self.put_meta(VOTE, &Vote::new(log_id.leader_id.term, node_id))?;
        self.put_meta(LAST_PURGED, &log_id)
    }

    fn put_meta<T: serde::Serialize>(&self, key: &[u8], value: &T) -> Result<(), StorageError> {
        self.synced_write(|opts| self.db.put_cf_opt(self.cf_meta(), key, encode(value), opts))
            .map_err(|e| err::write(&e))
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId>, StorageError> {
        let mut iter = self.db.iterator_cf(self.cf_log(), IteratorMode::End);
        match iter.next() {
            None => Ok(None),
            Some(item) => {
                let (_, value) = item.map_err(|e| err::read_logs(&e))?;
                let entry = decode_entry(&value)?;
                Ok(Some(entry.log_id))
            }
        }
    }

    /// The entries `start..end` (at most [`POINT_READ_MAX_ENTRIES`]) read by
    /// key in one `MultiGet`, which reads all of them from one view of the
    /// database, as an iterator would. Missing keys are allowed at the start
    /// (purged) and at the end (not appended yet), as openraft's
    /// `try_get_log_entries` asks; a key missing between two present ones
    /// is a hole in the log, an error.
    fn read_entries_by_key(&self, start: u64, end: u64) -> Result<Vec<Entry>, StorageError> {
        let keys: Vec<[u8; 8]> = (start..end).map(log_key).collect();
        let mut out = Vec::with_capacity(keys.len());
        let mut ended_at = None;
        for (index, value) in
            (start..end).zip(self.db.batched_multi_get_cf(self.cf_log(), &keys, true))
        {
            match value.map_err(|e| err::read_logs(&e))? {
                Some(bytes) if ended_at.is_none() => out.push(decode_entry(&bytes)?),
                Some(_) => {
                    let missing = ended_at.unwrap_or_default();
                    return Err(err::read_logs(&format!(
                        "the log holds entry {index} but not entry {missing} before it"
                    )));
                }
                None if out.is_empty() => {}
                None => ended_at = ended_at.or(Some(index)),
            }
        }
        Ok(out)
    }
}

/// Decodes a log entry, stopping the replica with a clear error if it was
/// written by a newer format than this build understands.
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, StorageError> {
    let entry: Entry = decode(bytes).map_err(|e| {
        err::read_logs(&std::io::Error::other(format!(
            "cannot decode a log entry ({e}); it may have been written by a newer Tether \
             (this build writes format {FORMAT_VERSION}): upgrade this replica"
        )))
    })?;
    if let openraft::EntryPayload::Normal(request) = &entry.payload
        && request.format_version > FORMAT_VERSION
    {
        return Err(err::read_logs(&std::io::Error::other(format!(
            "log entry {} has format {} but this build understands up to {FORMAT_VERSION}: \
             upgrade this replica",
            entry.log_id.index, request.format_version
        ))));
    }
    Ok(entry)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Some(i.saturating_add(1)),
            Bound::Excluded(i) => Some(*i),
            Bound::Unbounded => None,
        };
        if let Some(end) = end
            && end.saturating_sub(start) <= POINT_READ_MAX_ENTRIES
        {
            return self.read_entries_by_key(start, end);
        }
        let mut out = Vec::new();
        let mode = IteratorMode::From(&log_key(start), Direction::Forward);
        for item in self.db.iterator_cf(self.cf_log(), mode) {
            let (key, value) = item.map_err(|e| err::read_logs(&e))?;
            let index = log_index(&key);
            if !range.contains(&index) {
                break;
            }
            out.push(decode_entry(&value)?);
        }
        Ok(out)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.get_meta(VOTE)
    }

    /// What replication sends after entry `start - 1`: the entries from
    /// `start`, or none at all when `start` itself is purged. openraft's
    /// replication stream may read a range it chose before a purge the
    /// leader made meanwhile (a follower that had been down, a snapshot
    /// built); the entries after the purge point would then go out as if
    /// they followed `start - 1` (a debug assertion in openraft, chaos
    /// seed 200048 on 2026-12-05; in a release build a hole in the
    /// follower's log). An empty answer it sends as a heartbeat and tries
    /// again, by which time it knows of the purge and sends the snapshot.
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        let entries = self.try_get_log_entries(start..end).await?;
        if entries.first().is_some_and(|e| e.log_id.index != start) {
            tracing::info!(
                start,
                first = entries.first().map(|e| e.log_id.index),
                "replication asked for entries purged since it chose them; sending none"
            );
            return Ok(Vec::new());
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        // What the stored snapshot covers counts as purged: openraft never
        // reads those entries again, and a purge it asked for may have been
        // left undone (`SnapshotGate::may_purge`), so entries kept below the
        // snapshot need not join up with those after it.
        let purged: Option<LogId> = self.get_meta(LAST_PURGED)?;
        let last_purged_log_id =
            purged.max(super::state_machine::stored_snapshot_log_id(&self.db)?);
        let last_log_id = self.last_entry_log_id()?.max(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        let options = super::sync_unless_planted("vote-without-sync");
        self.synced_write(|_| {
            self.db
                .put_cf_opt(self.cf_meta(), VOTE, encode(vote), &options)
        })
        .map_err(|_| err::write_vote(&std::io::Error::other("RocksDB write of the vote failed")))
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Kept in memory and written with the next append, not written
        // here. openraft treats the committed id as a hint: at start-up it
        // re-applies up to the larger of it and the state machine's
        // `last_applied`, which is stored with each apply, so a committed id
        // that lags by the entries of one append only means learning them
        // from the leader again. A write of its own was one more RocksDB
        // write (a WAL `write` call) per commit on every replica, 2.6 % of
        // all samples at 64 clients. (Syncing it, earlier, cost a second
        // fsync per commit.)
        let mut pending = self
            .committed_to_save
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if pending.as_ref().is_none_or(|saved| *saved < committed) {
            *pending = Some(committed);
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let stored = self.get_meta::<Option<LogId>>(COMMITTED)?.flatten();
        let pending = *self
            .committed_to_save
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        Ok(pending.map_or(stored, |pending| pending.max(stored)))
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut batch = WriteBatch::default();
        let mut proposer = None;
        for entry in entries {
            proposer.get_or_insert(entry.log_id.leader_id.node_id);
            batch.put_cf(self.cf_log(), log_key(entry.log_id.index), encode(&entry));
        }
        let committed = self
            .committed_to_save
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(committed) = committed {
            batch.put_cf(self.cf_meta(), COMMITTED, encode(&committed));
        }
        fail::fail_point!("log-append-before-write");
        // The disk failing a write (EIO): a storage error is fatal to Raft's
        // core, which stops; the dead-core test arms it. Only with the
        // `failpoints` feature.
        #[cfg(feature = "failpoints")]
        if fail::eval("log-append-error", |_| ()).is_some() {
            let e = std::io::Error::other("failpoint log-append-error: the disk refused the write");
            callback.io_completed(Err(std::io::Error::other(e.to_string())));
            return Err(err::write_logs(&e));
        }
        // A follower's append: nothing to overlap its sync with (the
        // leader waits for it), so it is synced here, without a hand-off
        // to the flusher's thread and back. Only when no earlier append
        // is still waiting there, so that acknowledgements stay in order.
        // Without an id (a store opened for tools and tests) every append
        // goes to the flusher.
        let synced_here = self
            .own_id
            .is_some_and(|own| proposer.is_some_and(|p| p != own))
            && self.unsynced.load(std::sync::atomic::Ordering::Acquire) == 0;
        if synced_here {
            let options = super::sync_unless_planted("log-append-without-sync");
            return match self.synced_write(|_| self.db.write_opt(batch, &options)) {
                Ok(()) => {
                    fail::fail_point!("log-append-before-ack");
                    callback.io_completed(Ok(()));
                    Ok(())
                }
                Err(e) => {
                    callback.io_completed(Err(std::io::Error::other(e.to_string())));
                    Err(err::write_logs(&e))
                }
            };
        }
        match self.db.write(batch) {
            Ok(()) => {
                let flusher = self.flusher.get_or_init(|| {
                    Flusher::start(self.db.clone(), self.metrics.clone(), self.unsynced.clone())
                });
                self.unsynced
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                if let Err(unsent) = flusher.waiting.send(callback) {
                    // Only if the thread died (it does not return early).
                    unsent
                        .0
                        .io_completed(Err(std::io::Error::other("the log sync thread is gone")));
                    return Err(err::write_logs("the log sync thread is gone"));
                }
                Ok(())
            }
            Err(e) => {
                callback.io_completed(Err(std::io::Error::other(e.to_string())));
                Err(err::write_logs(&e))
            }
        }
    }

    async fn truncate_after(&mut self, last_kept: Option<LogId>) -> Result<(), StorageError> {
        let first_removed = last_kept.map_or(0, |l| l.index + 1);
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(self.cf_log(), log_key(first_removed), log_key(u64::MAX));
        // delete_range's end is exclusive: remove the last possible key too.
        batch.delete_cf(self.cf_log(), log_key(u64::MAX));
        self.synced_write(|opts| self.db.write_opt(batch, opts))
            .map_err(|e| err::write_logs(&e))
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.gate.wait_before_purge(log_id.index).await;
        // Never past the stored snapshot (see `SnapshotGate::may_purge`).
        if !self.gate.may_purge(log_id.index) {
            tracing::warn!(
                purge = log_id.index,
                snapshot = self.gate.covered(),
                "not purging the log past the stored snapshot; a later purge will"
            );
            return Ok(());
        }
        // Record the purge point first: if the deletion is interrupted, the
        // remaining entries below it are ignored, never a hole.
        tracing::debug!(
            purge = log_id.index,
            snapshot = self.gate.covered(),
            "purging the log"
        );
        self.put_meta(LAST_PURGED, &log_id)?;
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(self.cf_log(), log_key(0), log_key(log_id.index + 1));
        self.synced_write(|opts| self.db.write_opt(batch, opts))
            .map_err(|e| err::write_logs(&e))
    }
}
