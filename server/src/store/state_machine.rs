//! The state machine in RocksDB (openraft `RaftStateMachine`, storage-v2).
//!
//! The whole [`State`] lives in memory (one Raft group is sized for one
//! Kubernetes cluster) and in the `sm` column family; each `apply` writes the
//! keys it changed, its events and `last_applied` in one `WriteBatch`, and
//! `load` rebuilds the memory state from the column family at start-up.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use futures::TryStreamExt;
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, RaftSnapshotBuilder};
use openraft_legacy::network_v1::SnapshotReceiverFactory;
use rocksdb::{DB, IteratorMode, WriteBatch, WriteOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use super::keys::{self, LAST_APPLIED, MEMBERSHIP, NOW};
use super::waiters::{WaitRegistry, WaitTicket};
use super::{CF_EVENTS, CF_META, CF_SM, SnapshotGate, decode, encode, err};
use crate::cluster_id::{self, ClusterIdCell};
use crate::raft::{
    Entry, LogId, Snapshot, SnapshotMeta, StorageError, StoredMembership, TypeConfig,
};
use crate::sm::{self, Dirty, Event, FORMAT_VERSION, Response, SNAPSHOT_FORMAT_VERSION, State};
use crate::store::compat::{ClientSessionV2, StateV2};

/// `meta` key of the current snapshot.
const SNAPSHOT: &[u8] = b"snapshot";
/// `meta` key of the log index of the oldest retained event: events before it
/// were deleted (retention) or never stored here (installed by snapshot).
const EVENTS_FIRST: &[u8] = b"events_first";

/// How many events a slow in-process subscriber may fall behind before it is
/// told it lagged (it then re-reads the state).
const EVENT_CHANNEL_CAPACITY: usize = 16 * 1024;

/// The applied state with its Raft position.
#[derive(Debug, Default)]
pub struct AppliedState {
    /// Domain state.
    pub state: State,
    /// Last applied log id.
    pub last_applied: Option<LogId>,
    /// Last applied membership.
    pub membership: StoredMembership,
}

/// A read handle to the applied state and its event stream, shared by the
/// API handlers. Cheap to clone.
#[derive(Clone)]
pub struct StateHandle {
    inner: Arc<RwLock<AppliedState>>,
    events: broadcast::Sender<Event>,
    /// [`events_first_index`], kept in memory: watches check it for every
    /// batch and every wake-up, and reading it from RocksDB decompressed
    /// the stored snapshot each time (it shares a data block with the
    /// snapshot in `meta`; at 100k pins a 7.6 MiB block, too big for the
    /// block cache): a watch read ~70k events/s instead of ~350k.
    events_first: Arc<AtomicU64>,
    /// Queued acquires waiting for their grant (see [`WaitRegistry`]).
    waits: WaitRegistry,
    /// The cluster's id as this replica knows it ([`crate::cluster_id`]).
    cluster_id: Arc<ClusterIdCell>,
    /// Counts snapshot installs. An install moves the applied state and the
    /// start of the event history without emitting events, so watches
    /// asleep until the next event wait on this as well: otherwise a watch
    /// whose position the snapshot compacted away slept until some later
    /// apply, forever on a cluster that had gone quiet.
    installs: Arc<tokio::sync::watch::Sender<u64>>,
}

impl StateHandle {
    /// Reads the applied state. Hold the guard briefly: apply waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, AppliedState> {
        self.inner
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reads the applied state if no apply holds it right now: for callers
    /// to whom a guess is better than a wait.
    pub fn try_read(&self) -> Option<RwLockReadGuard<'_, AppliedState>> {
        match self.inner.try_read() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Events applied from now on. Subscribe before proposing a command whose
    /// later events you wait for.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Registers an acquire's wait for `key` by `pod_uid`: the ticket
    /// receives the events that grant it the lock or end its wait. Register
    /// before proposing the acquire.
    pub fn register_wait(&self, key: &crate::sm::LockKey, pod_uid: &str) -> WaitTicket {
        self.waits.register(key, pod_uid)
    }

    /// Changes each time a snapshot is installed (see `installs`). Take
    /// it before reading, like [`StateHandle::subscribe`].
    pub fn snapshot_installs(&self) -> tokio::sync::watch::Receiver<u64> {
        self.installs.subscribe()
    }

    /// The cluster's id as this replica knows it (shared: the Raft network
    /// and the gRPC server read it).
    pub fn cluster_id(&self) -> Arc<ClusterIdCell> {
        self.cluster_id.clone()
    }

    /// The lowest log index a watch or history may start from without
    /// missing a deleted event (see [`events_first_index`]). Raised before
    /// events are deleted, so a reader that checks it after reading sees
    /// any deletion its read may have met.
    pub fn events_first(&self) -> u64 {
        self.events_first.load(Ordering::SeqCst)
    }
}

/// The serialized form of a snapshot. `S` is the state, owned when read
/// and borrowed when written (a snapshot is encoded straight from the
/// applied state, without copying it first).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotFile<S = State> {
    /// Format of the snapshot ([`SNAPSHOT_FORMAT_VERSION`] when written by
    /// this build).
    pub format_version: u16,
    /// Last log id the snapshot covers.
    pub last_applied: Option<LogId>,
    /// Membership as of `last_applied`.
    pub membership: StoredMembership,
    /// The domain state, dedupe table included.
    pub state: S,
}

impl SnapshotFile {
    /// Decodes a snapshot, refusing one written by a newer format. A
    /// snapshot of format 1 or 2 holds the state in its older shape
    /// ([`StateV2`]), which is converted.
    pub fn decode(data: &[u8]) -> Result<SnapshotFile, StorageError> {
        let undecodable = |e: postcard::Error| {
            sm_read_err(std::io::Error::other(format!(
                "cannot decode snapshot ({e}); it may come from a newer Tether: upgrade this replica"
            )))
        };
        // The format comes first, so it can be read before the rest.
        let (format_version, _) = postcard::take_from_bytes::<u16>(data).map_err(undecodable)?;
        if format_version > FORMAT_VERSION {
            return Err(format_error("snapshot", format_version));
        }
        if format_version < sm::SESSION_BINDING_FORMAT_VERSION {
            let old: SnapshotFile<StateV2> = decode(data).map_err(undecodable)?;
            return Ok(SnapshotFile {
                format_version: old.format_version,
                last_applied: old.last_applied,
                membership: old.membership,
                state: old.state.into(),
            });
        }
        decode(data).map_err(undecodable)
    }
}

/// A snapshot as kept in the `meta` column family.
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// The state machine of one replica.
pub struct StateMachineStore {
    db: Arc<DB>,
    handle: StateHandle,
    retention: EventRetention,
    gate: Arc<SnapshotGate>,
    /// Where applies are timed (`tether_apply_duration_seconds`).
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

/// How long events (the audit trail behind watch and history) are kept.
/// Enforced when a snapshot is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRetention {
    /// Keep the events of this many most recent log entries.
    pub entries: u64,
    /// Keep events younger than this on committed time (0 = no age limit).
    pub age_ms: u64,
}

impl Default for EventRetention {
    fn default() -> Self {
        Self {
            entries: 1_000_000,
            age_ms: 7 * 24 * 3600 * 1000,
        }
    }
}

impl EventRetention {
    /// The first log index whose events are kept, at applied index `applied`
    /// and committed time `now_ms`. Committed time only grows along the log,
    /// so the age cut is the first event young enough.
    fn first_kept(&self, db: &DB, applied: u64, now_ms: u64) -> Result<u64, StorageError> {
        let mut first = applied.saturating_sub(self.entries);
        if self.age_ms > 0 && now_ms > self.age_ms {
            let cutoff = now_ms - self.age_ms;
            let start = keys::event_key(sm::Revision {
                index: first,
                sub: 0,
            });
            let mode = IteratorMode::From(&start, rocksdb::Direction::Forward);
            let mut young = None;
            for item in db.iterator_cf(cf(db, CF_EVENTS), mode) {
                let (_, value) = item.map_err(sm_read_err)?;
                let event: Event = decode(&value).map_err(sm_read_err)?;
                if event.time_ms >= cutoff {
                    young = Some(event.revision.index);
                    break;
                }
            }
            first = first.max(young.unwrap_or(applied + 1));
        }
        Ok(first)
    }
}

fn cf<'a>(db: &'a DB, name: &str) -> &'a rocksdb::ColumnFamily {
    db.cf_handle(name)
        .expect("column families are created at open")
}

fn synced() -> WriteOptions {
    let mut opts = WriteOptions::default();
    opts.set_sync(true);
    opts
}

fn sm_read_err(e: impl std::error::Error + 'static) -> StorageError {
    err::read_state_machine(&e)
}

fn sm_write_err(e: impl std::error::Error + 'static) -> StorageError {
    err::write_state_machine(&e)
}

fn format_error(what: &str, version: u16) -> StorageError {
    sm_read_err(std::io::Error::other(format!(
        "{what} has format {version} but this build understands up to {FORMAT_VERSION}: \
         upgrade this replica"
    )))
}

impl StateMachineStore {
    /// Loads the state machine persisted in `db` (empty on a new database).
    pub fn load(db: Arc<DB>) -> Result<Self, StorageError> {
        let mut applied = AppliedState::default();
        let sm_cf = cf(&db, CF_SM);
        // Sessions a build of format 5 or older wrote, to be rewritten in
        // today's shape under today's prefix.
        let mut sessions_to_move = Vec::new();
        for item in db.iterator_cf(sm_cf, IteratorMode::Start) {
            let (key, value) = item.map_err(sm_read_err)?;
            if let Some(rest) = key.strip_prefix(keys::LOCK_PREFIX) {
                let (scope, name) = keys::split_pair(rest);
                applied.state.locks.insert(
                    sm::LockKey::new(scope, name),
                    decode(&value).map_err(sm_read_err)?,
                );
            } else if let Some(rest) = key.strip_prefix(keys::PIN_PREFIX) {
                let (set, member) = keys::split_pair(rest);
                applied.state.pins.insert(
                    sm::PinKey::new(set, member),
                    decode(&value).map_err(sm_read_err)?,
                );
            } else if let Some(name) = key.strip_prefix(keys::NODE_PREFIX) {
                let name = String::from_utf8_lossy(name).into_owned();
                applied
                    .state
                    .nodes
                    .insert(name, decode(&value).map_err(sm_read_err)?);
            } else if let Some(uid) = key.strip_prefix(keys::POD_PREFIX) {
                let uid = String::from_utf8_lossy(uid).into_owned();
                applied
                    .state
                    .pods
                    .insert(uid, decode(&value).map_err(sm_read_err)?);
            } else if key.starts_with(keys::LEASE_PREFIX) {
                let lease: sm::TtlLease = decode(&value).map_err(sm_read_err)?;
                applied.state.leases.insert(lease.id, lease);
            } else if let Some(client) = key.strip_prefix(keys::SESSION_PREFIX) {
                let client = String::from_utf8_lossy(client).into_owned();
                applied
                    .state
                    .sessions
                    .insert(client, decode(&value).map_err(sm_read_err)?);
            } else if let Some(client) = key.strip_prefix(keys::SESSION_V2_PREFIX) {
                let client = String::from_utf8_lossy(client).into_owned();
                let old: ClientSessionV2 = decode(&value).map_err(sm_read_err)?;
                applied.state.sessions.insert(client.clone(), old.into());
                sessions_to_move.push(client);
            } else if &*key == LAST_APPLIED {
                applied.last_applied = decode(&value).map_err(sm_read_err)?;
            } else if &*key == MEMBERSHIP {
                applied.membership = decode(&value).map_err(sm_read_err)?;
            } else if &*key == NOW {
                applied.state.now_ms = decode(&value).map_err(sm_read_err)?;
            }
        }
        if !sessions_to_move.is_empty() {
            let mut batch = WriteBatch::default();
            for client in &sessions_to_move {
                let mut old_key = keys::SESSION_V2_PREFIX.to_vec();
                old_key.extend_from_slice(client.as_bytes());
                batch.delete_cf(sm_cf, old_key);
                let session = &applied.state.sessions[client];
                batch.put_cf(sm_cf, keys::session_key(client), encode(session));
            }
            db.write_opt(batch, &synced()).map_err(sm_write_err)?;
            tracing::info!(
                sessions = sessions_to_move.len(),
                "moved client sessions written by an older build to format 6"
            );
        }
        let (events, _) = broadcast::channel(EVENT_CHANNEL_CAPACITY);
        let events_first = events_first_index(&db)?;
        let cluster_id = Arc::new(ClusterIdCell::new(super::read_cluster_id(&db)?));
        let store = Self {
            db,
            handle: StateHandle {
                inner: Arc::new(RwLock::new(applied)),
                events,
                events_first: Arc::new(AtomicU64::new(events_first)),
                waits: WaitRegistry::default(),
                cluster_id,
                installs: Arc::new(tokio::sync::watch::Sender::new(0)),
            },
            retention: EventRetention::default(),
            gate: SnapshotGate::new(0),
            metrics: None,
        };

        // A snapshot newer than the persisted state cannot normally exist (the
        // snapshot is written after the state it was built from, through the
        // same write-ahead log), but if it does, the snapshot wins.
        if let Some(stored) = store.read_stored_snapshot()? {
            let sm_applied = store.handle.read().last_applied;
            if stored.meta.last_log_id > sm_applied {
                store.restore(&stored.data)?;
            }
            store
                .gate
                .stored(stored.meta.last_log_id.map_or(0, |l| l.index));
        }
        Ok(store)
    }

    /// The gate the log store's purges wait at (see [`SnapshotGate`]).
    pub fn snapshot_gate(&self) -> Arc<SnapshotGate> {
        self.gate.clone()
    }

    /// Sets how long events are kept; applied each time a snapshot is built.
    pub fn set_event_retention(&mut self, retention: EventRetention) {
        self.retention = retention;
    }

    /// Times each batch of applied entries into `metrics`.
    pub fn set_metrics(&mut self, metrics: Arc<crate::metrics::Metrics>) {
        self.metrics = Some(metrics);
    }

    /// The shared read handle.
    pub fn handle(&self) -> StateHandle {
        self.handle.clone()
    }

    fn read_stored_snapshot(&self) -> Result<Option<StoredSnapshot>, StorageError> {
        let Some(bytes) = self
            .db
            .get_cf(cf(&self.db, CF_META), SNAPSHOT)
            .map_err(sm_read_err)?
        else {
            return Ok(None);
        };
        decode(&bytes).map(Some).map_err(sm_read_err)
    }

    /// Replaces the state (memory and `sm` column family) with a snapshot's.
    fn restore(&self, data: &[u8]) -> Result<(), StorageError> {
        self.restore_with(data, |_| {})
    }

    /// [`Self::restore`], with what `also` adds to the same `WriteBatch`:
    /// written together or not at all.
    fn restore_with(
        &self,
        data: &[u8],
        also: impl FnOnce(&mut WriteBatch),
    ) -> Result<(), StorageError> {
        let file = SnapshotFile::decode(data)?;
        let sm_cf = cf(&self.db, CF_SM);
        let mut batch = WriteBatch::default();
        for item in self.db.iterator_cf(sm_cf, IteratorMode::Start) {
            let (key, _) = item.map_err(sm_read_err)?;
            batch.delete_cf(sm_cf, key);
        }
        write_state(&mut batch, &self.db, &file.state, None);
        batch.put_cf(sm_cf, NOW, encode(&file.state.now_ms));
        batch.put_cf(sm_cf, LAST_APPLIED, encode(&file.last_applied));
        batch.put_cf(sm_cf, MEMBERSHIP, encode(&file.membership));
        also(&mut batch);
        self.db
            .write_opt(
                batch,
                &super::sync_unless_planted("snapshot-install-without-sync"),
            )
            .map_err(sm_write_err)?;

        let mut applied = self.handle.inner.write().unwrap_or_else(|p| p.into_inner());
        applied.state = file.state;
        applied.last_applied = file.last_applied;
        applied.membership = file.membership;
        Ok(())
    }
}

/// Writes `changed` keys of one map into `batch`: put if present, delete if
/// gone.
fn write_changed<'a, K: Ord + 'a, V: Serialize>(
    batch: &mut WriteBatch,
    cf: &rocksdb::ColumnFamily,
    changed: impl IntoIterator<Item = &'a K>,
    map: &BTreeMap<K, V>,
    key: impl Fn(&K) -> Vec<u8>,
) {
    for k in changed {
        match map.get(k) {
            Some(value) => batch.put_cf(cf, key(k), encode(value)),
            None => batch.delete_cf(cf, key(k)),
        }
    }
}

/// Writes the keys an apply changed (`dirty`), or every key of the state
/// (`None`, when restoring a snapshot), into `batch`.
fn write_state(batch: &mut WriteBatch, db: &DB, state: &State, dirty: Option<&Dirty>) {
    let cf = cf(db, CF_SM);
    match dirty {
        Some(d) => {
            write_changed(batch, cf, &d.locks, &state.locks, keys::lock_key);
            write_changed(batch, cf, &d.leases, &state.leases, |id| {
                keys::lease_key(*id)
            });
            write_changed(batch, cf, &d.sessions, &state.sessions, |c| {
                keys::session_key(c)
            });
            write_changed(batch, cf, &d.pins, state.pins.as_map(), keys::pin_key);
            write_changed(batch, cf, &d.nodes, &state.nodes, |n| keys::node_key(n));
            write_changed(batch, cf, &d.pods, &state.pods, |u| keys::pod_key(u));
        }
        None => {
            write_changed(batch, cf, state.locks.keys(), &state.locks, keys::lock_key);
            write_changed(batch, cf, state.leases.keys(), &state.leases, |id| {
                keys::lease_key(*id)
            });
            write_changed(batch, cf, state.sessions.keys(), &state.sessions, |c| {
                keys::session_key(c)
            });
            write_changed(
                batch,
                cf,
                state.pins.keys(),
                state.pins.as_map(),
                keys::pin_key,
            );
            write_changed(batch, cf, state.nodes.keys(), &state.nodes, |n| {
                keys::node_key(n)
            });
            write_changed(batch, cf, state.pods.keys(), &state.pods, |u| {
                keys::pod_key(u)
            });
        }
    }
}

/// Builds snapshots from a copy of the applied state.
pub struct SnapshotBuilder {
    db: Arc<DB>,
    handle: StateHandle,
    retention: EventRetention,
    gate: Arc<SnapshotGate>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    type SnapshotData = Cursor<Vec<u8>>;

    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        let started = std::time::Instant::now();
        let (data, last_applied, membership, now_ms) = {
            // Encoded under the read lock rather than from a copy: a copy of
            // 100k pins doubled the replica's peak memory in the scale run,
            // and copying takes about as long as encoding.
            let applied = self.handle.read();
            let file = SnapshotFile {
                format_version: SNAPSHOT_FORMAT_VERSION,
                last_applied: applied.last_applied,
                membership: applied.membership.clone(),
                state: &applied.state,
            };
            (
                encode(&file),
                applied.last_applied,
                applied.membership.clone(),
                applied.state.now_ms,
            )
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        {
            // Not over a newer snapshot installed while this one was built.
            let _storing = self.gate.storing();
            let index = last_applied.map_or(0, |l| l.index);
            let covered = self.gate.covered();
            if covered > index {
                tracing::info!(
                    index,
                    installed = covered,
                    "a newer snapshot was installed while this one was built; it stays the stored one"
                );
            } else {
                self.db
                    .put_cf_opt(cf(&self.db, CF_META), SNAPSHOT, encode(&stored), &synced())
                    .map_err(|e| err::write_snapshot(&e))?;
                self.gate.stored(index);
            }
        }
        // Snapshots are the moment of housekeeping: events older than the
        // retention window are deleted (history beyond it is not kept).
        let applied = last_applied.map_or(0, |l| l.index);
        let first_kept = self.retention.first_kept(&self.db, applied, now_ms)?;
        if first_kept > self.handle.events_first() {
            compact_events(
                &self.db,
                first_kept,
                Compaction::Retention,
                &self.handle.events_first,
            )?;
        }
        tracing::info!(
            index = applied,
            bytes = stored.data.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "snapshot built"
        );
        Ok(Snapshot {
            meta,
            snapshot: Cursor::new(stored.data),
        })
    }
}

impl StateMachineStore {
    /// Applies committed entries as one RocksDB write (Raft's `apply`).
    fn apply_entries<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry>,
    {
        let mut responses = Vec::new();
        let mut all_events = Vec::new();
        let mut batch = WriteBatch::default();
        {
            let mut applied = self.handle.inner.write().unwrap_or_else(|p| p.into_inner());
            let mut dirty = Dirty::default();
            let mut membership_changed = false;
            // The cluster id this batch records, when this replica has none
            // yet (the first `ClusterId` entry it applies).
            let mut recorded_id: Option<String> = None;
            for entry in entries {
                applied.last_applied = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => Response::empty(),
                    EntryPayload::Normal(request) => {
                        if request.format_version > FORMAT_VERSION {
                            return Err(format_error(
                                &format!("log entry {}", entry.log_id.index),
                                request.format_version,
                            ));
                        }
                        if let sm::Command::Audit(audit) = &request.command
                            && audit.action == cluster_id::AUDIT_ACTION
                            && cluster_id::is_valid(&audit.detail)
                            && recorded_id.is_none()
                            && self.handle.cluster_id.get().is_none()
                        {
                            recorded_id = Some(audit.detail.clone());
                        }
                        let (response, events, changed) =
                            sm::apply(&mut applied.state, entry.log_id.index, &request);
                        dirty.merge(changed);
                        all_events.extend(events);
                        response
                    }
                    EntryPayload::Membership(membership) => {
                        applied.membership = StoredMembership::new(Some(entry.log_id), membership);
                        membership_changed = true;
                        Response::empty()
                    }
                };
                responses.push(response);
            }
            write_state(&mut batch, &self.db, &applied.state, Some(&dirty));
            let sm_cf = cf(&self.db, CF_SM);
            let events_cf = cf(&self.db, CF_EVENTS);
            for event in &all_events {
                batch.put_cf(events_cf, keys::event_key(event.revision), encode(event));
            }
            batch.put_cf(sm_cf, NOW, encode(&applied.state.now_ms));
            batch.put_cf(sm_cf, LAST_APPLIED, encode(&applied.last_applied));
            if membership_changed {
                batch.put_cf(sm_cf, MEMBERSHIP, encode(&applied.membership));
                // A crash here falls between the two phases of a membership
                // change (joint, then uniform) or mid-way through one.
                fail::fail_point!("sm-apply-membership-before-write");
            }
            if let Some(id) = &recorded_id {
                batch.put_cf(
                    cf(&self.db, CF_META),
                    super::CLUSTER_ID_KEY,
                    encode(&id.to_string()),
                );
            }
            fail::fail_point!("sm-apply-before-write");
            self.db.write(batch).map_err(sm_write_err)?;
            fail::fail_point!("sm-apply-after-write");
            if let Some(id) = recorded_id {
                // Stored with the batch above.
                match self.handle.cluster_id.adopt(&id, |_| Ok(())) {
                    Ok(()) => tracing::info!(cluster_id = id, "this replica's cluster id"),
                    Err(err) => tracing::warn!(
                        ?err,
                        logged = id,
                        "the log records another cluster id than the one this replica \
                         took from its leader; keeping the one it has"
                    ),
                }
            }
        }
        self.handle.waits.route(&all_events);
        for event in all_events {
            // No subscriber is not an error: nobody is waiting.
            let _ = self.handle.events.send(event);
        }
        Ok(responses)
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotData = Cursor<Vec<u8>>;
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let applied = self.handle.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<Strm>(&mut self, entries: Strm) -> Result<(), StorageError>
    where
        Strm:
            futures::Stream<Item = Result<EntryResponder<TypeConfig>, StorageError>> + Unpin + Send,
    {
        // openraft hands over the committed entries it read for this apply;
        // all of them go into one RocksDB write, and their callers hear back
        // once it is done.
        let (entries, responders): (Vec<Entry>, Vec<_>) =
            entries.try_collect::<Vec<_>>().await?.into_iter().unzip();
        let started = std::time::Instant::now();
        let responses = self.apply_entries(entries)?;
        if let Some(metrics) = &self.metrics {
            metrics.applied(started.elapsed());
        }
        for (responder, response) in responders.into_iter().zip(responses) {
            if let Some(responder) = responder {
                responder.send(response);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            db: self.db.clone(),
            handle: self.handle.clone(),
            retention: self.retention,
            gate: self.gate.clone(),
        }
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Cursor<Vec<u8>>,
    ) -> Result<(), StorageError> {
        // Also marked when the first chunk arrived (the 0.9 chunked
        // transfer): a purge must not pass the snapshot being installed.
        self.gate.begin_install();
        let result = self.install(meta, snapshot.into_inner());
        let covered = meta.last_log_id.map_or(0, |l| l.index);
        self.gate.end_install(result.is_ok().then_some(covered));
        // The entries the snapshot covers were never applied here, so their
        // grants produced no events: waiters read the new state instead.
        self.handle.waits.recheck_all();
        result
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        Ok(self.read_stored_snapshot()?.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Cursor::new(s.data),
        }))
    }
}

impl SnapshotReceiverFactory<TypeConfig> for StateMachineStore {
    type SnapshotReceiver = Cursor<Vec<u8>>;

    /// A snapshot sent in chunks (by a replica of the 0.9 build, or by any
    /// replica: the chunked transfer is what every build sends) starts.
    async fn begin_receiving_snapshot(&mut self) -> Result<Cursor<Vec<u8>>, StorageError> {
        self.gate.begin_install();
        Ok(Cursor::new(Vec::new()))
    }
}

impl StateMachineStore {
    /// Restores `data` and stores it as the current snapshot.
    fn install(&mut self, meta: &SnapshotMeta, data: Vec<u8>) -> Result<(), StorageError> {
        fail::fail_point!("sm-install-snapshot-before");
        let started = std::time::Instant::now();
        let covered = meta.last_log_id.map_or(0, |l| l.index);
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data,
        };
        let _storing = self.gate.storing();
        if super::planted("snapshot-install-in-two-writes") {
            // The planted bug: the state first, the stored snapshot after.
            self.restore(&stored.data)?;
            fail::fail_point!("sm-install-snapshot-after-state", |_| Err(
                err::write_snapshot(&"failpoint sm-install-snapshot-after-state")
            ));
            compact_events(
                &self.db,
                covered + 1,
                Compaction::SnapshotInstalled,
                &self.handle.events_first,
            )?;
            self.db
                .put_cf_opt(
                    cf(&self.db, CF_META),
                    SNAPSHOT,
                    encode(&stored),
                    &super::sync_unless_planted("snapshot-install-without-sync"),
                )
                .map_err(|e| err::write_snapshot(&e))?;
        } else {
            // The installed state, the stored snapshot and the event history's
            // new start in one write: a crash keeps all or none. Were the
            // state on disk without the snapshot, openraft would find at
            // start-up a state machine ahead of the log, purge the log up to
            // it, and then refuse to start with the log purged past the
            // stored snapshot (a power-loss chaos schedule found it on
            // 2026-12-05, seed 200208; regression test
            // `server/tests/snapshot_install_crash.rs`).
            //
            // This replica never applied the entries the snapshot covers, so
            // it has none of their events: its history starts after them.
            // Raised before the deletion: a watch that read across it
            // re-checks.
            let first = self
                .handle
                .events_first
                .fetch_max(covered + 1, Ordering::SeqCst);
            let first = first.max(covered + 1);
            let encoded = encode(&stored);
            self.restore_with(&stored.data, |batch| {
                batch.delete_range_cf(
                    cf(&self.db, CF_EVENTS),
                    keys::event_key(sm::Revision { index: 0, sub: 0 }),
                    keys::event_key(sm::Revision {
                        index: covered + 1,
                        sub: 0,
                    }),
                );
                batch.put_cf(cf(&self.db, CF_META), EVENTS_FIRST, encode(&first));
                batch.put_cf(cf(&self.db, CF_META), SNAPSHOT, encoded);
            })?;
            fail::fail_point!("sm-install-snapshot-after-state", |_| Err(
                err::write_snapshot(&"failpoint sm-install-snapshot-after-state")
            ));
        }
        self.gate.stored(covered);
        drop(_storing);
        fail::fail_point!("sm-install-snapshot-after");
        self.handle.installs.send_modify(|n| *n += 1);
        tracing::info!(
            index = covered,
            bytes = stored.data.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "snapshot installed"
        );
        Ok(())
    }
}

/// The last log id the stored snapshot covers, read without its data
/// (postcard writes the meta first).
pub fn stored_snapshot_log_id(db: &DB) -> Result<Option<LogId>, StorageError> {
    let Some(bytes) = db
        .get_cf(cf(db, CF_META), SNAPSHOT)
        .map_err(|e| err::read(&e))?
    else {
        return Ok(None);
    };
    let (meta, _) = postcard::take_from_bytes::<SnapshotMeta>(&bytes).map_err(|e| err::read(&e))?;
    Ok(meta.last_log_id)
}

/// The stored snapshot's data (a [`SnapshotFile`]) and the index it covers:
/// what a backup exports.
pub fn stored_snapshot(db: &DB) -> Result<Option<(u64, Vec<u8>)>, StorageError> {
    let Some(bytes) = db
        .get_cf(cf(db, CF_META), SNAPSHOT)
        .map_err(|e| err::read(&e))?
    else {
        return Ok(None);
    };
    let stored: StoredSnapshot = decode(&bytes).map_err(|e| err::read(&e))?;
    Ok(Some((
        stored.meta.last_log_id.map_or(0, |l| l.index),
        stored.data,
    )))
}

impl StateMachineStore {
    /// Makes an exported snapshot this (empty) replica's state, as a
    /// one-member cluster of `id` at `addr`: the state and log position are
    /// the backup's, so fencing tokens keep growing from where they were.
    /// Returns the last log id the backup covers.
    pub fn restore_backup(
        &mut self,
        data: &[u8],
        id: u64,
        addr: &str,
    ) -> Result<LogId, StorageError> {
        let file = SnapshotFile::decode(data)?;
        let Some(last) = file.last_applied else {
            return Err(err::read(&std::io::Error::other(
                "the backup covers no log entry",
            )));
        };
        let membership = openraft::Membership::new(
            vec![std::collections::BTreeSet::from([id])],
            std::collections::BTreeMap::from([(
                id,
                openraft::BasicNode {
                    addr: addr.to_string(),
                },
            )]),
        )
        .map_err(|e| err::read(&e))?;
        let file = SnapshotFile {
            format_version: SNAPSHOT_FORMAT_VERSION,
            last_applied: Some(last),
            membership: StoredMembership::new(Some(last), membership.clone()),
            state: file.state,
        };
        let meta = SnapshotMeta {
            last_log_id: Some(last),
            last_membership: StoredMembership::new(Some(last), membership),
        };
        self.install(&meta, encode(&file))?;
        Ok(last)
    }
}

/// Events stored at or after `from`, oldest first, at most `limit`.
pub fn read_events(db: &DB, from: sm::Revision, limit: usize) -> Result<Vec<Event>, StorageError> {
    let start = keys::event_key(from);
    let mode = IteratorMode::From(&start, rocksdb::Direction::Forward);
    let mut out = Vec::new();
    for item in db.iterator_cf(cf(db, CF_EVENTS), mode).take(limit) {
        let (_, value) = item.map_err(sm_read_err)?;
        out.push(decode(&value).map_err(sm_read_err)?);
    }
    Ok(out)
}

/// Why events below an index go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compaction {
    /// Retention: this replica holds every event below the index, and the
    /// ones deleted are exactly those it had.
    Retention,
    /// A snapshot covering everything below the index was installed: this
    /// replica never had those entries' events, whatever they were.
    SnapshotInstalled,
}

/// Deletes events of log indexes below `first_kept` and records from where
/// a watch misses nothing (see [`events_first_index`]). After retention
/// that is one past the newest deleted event — not `first_kept`, so a
/// watch from revision 1 of a cluster whose first entries had no events
/// (elections, membership) is not told it missed any.
fn compact_events(
    db: &DB,
    first_kept: u64,
    why: Compaction,
    cached: &AtomicU64,
) -> Result<(), StorageError> {
    let start = keys::event_key(sm::Revision { index: 0, sub: 0 });
    let end = keys::event_key(sm::Revision {
        index: first_kept,
        sub: 0,
    });
    let boundary = match why {
        Compaction::SnapshotInstalled => first_kept,
        Compaction::Retention => {
            let newest_deleted = db
                .iterator_cf(
                    cf(db, CF_EVENTS),
                    IteratorMode::From(&end, rocksdb::Direction::Reverse),
                )
                .map(|item| item.map_err(sm_read_err))
                .find(|item| item.as_ref().map_or(true, |(key, _)| key[..] < end[..]))
                .transpose()?;
            match newest_deleted {
                Some((key, _)) => keys::event_revision(&key).map_or(first_kept, |r| r.index + 1),
                None => 0,
            }
        }
    };
    let first = cached.load(Ordering::SeqCst).max(boundary);
    // Raised before the deletion: a watch that read across it re-checks.
    cached.fetch_max(first, Ordering::SeqCst);
    db.delete_range_cf(cf(db, CF_EVENTS), start, end)
        .map_err(sm_write_err)?;
    db.put_cf_opt(cf(db, CF_META), EVENTS_FIRST, encode(&first), &synced())
        .map_err(sm_write_err)
}

/// The lowest log index a watch or history may start from without missing
/// a deleted event (0 = none was ever deleted). Events from it on are all
/// retained; below it, some were deleted by retention or were never here
/// (the replica installed a snapshot covering them).
pub fn events_first_index(db: &DB) -> Result<u64, StorageError> {
    match db
        .get_cf(cf(db, CF_META), EVENTS_FIRST)
        .map_err(sm_read_err)?
    {
        Some(bytes) => decode(&bytes).map_err(sm_read_err),
        None => Ok(0),
    }
}
