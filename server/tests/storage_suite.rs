//! openraft's storage test suite against Tether's RocksDB log store and state
//! machine, each run in a fresh temp directory.

use openraft::testing::log::{StoreBuilder, Suite};
use openraft::{ErrorSubject, ErrorVerb, StorageError};
use tempfile::TempDir;
use tether_server::raft::TypeConfig;
use tether_server::store::{self, LogStore, StateMachineStore};

mod common;
use common::acquire_entry;

/// Builds stores for the suite. The log store syncs appends in one of two
/// ways (`log_store.rs`): the leader's own on its sync thread, another
/// replica's in the write itself; `own_id` picks which path the suite's
/// appends take.
struct RocksBuilder {
    own_id: Option<u64>,
}

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for RocksBuilder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore, StateMachineStore), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().expect("a temp dir");
        let (_db, log, sm) = store::open(dir.path())
            .await
            .map_err(|e| StorageError::from_io_error(ErrorSubject::Store, ErrorVerb::Read, e))?;
        let log = match self.own_id {
            Some(id) => log.with_own_id(id),
            None => log,
        };
        Ok((dir, log, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocksdb_store_passes_openraft_storage_suite() {
    // No id: every append goes through the sync thread.
    Suite::test_all(RocksBuilder { own_id: None })
        .await
        .expect("openraft storage suite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocksdb_store_passes_openraft_storage_suite_syncing_as_a_follower() {
    // An id no entry of the suite names: every append is another
    // replica's, synced in the write.
    Suite::test_all(RocksBuilder {
        own_id: Some(u64::MAX),
    })
    .await
    .expect("openraft storage suite, appends synced as a follower's");
}

/// Applies `entries` as openraft does: a stream of entries, none of which
/// has a caller waiting for its answer here.
async fn apply(
    sm: &mut StateMachineStore,
    entries: impl IntoIterator<Item = tether_server::raft::Entry>,
) -> Result<(), std::io::Error> {
    use openraft::storage::RaftStateMachine;
    let entries: Vec<_> = entries.into_iter().map(|e| Ok((e, None))).collect();
    RaftStateMachine::apply(sm, futures::stream::iter(entries)).await
}

mod store_behaviour {
    use openraft::RaftSnapshotBuilder;
    use openraft::storage::RaftStateMachine;
    use tether_server::sm::{EventKind, Revision};
    use tether_server::store::{self, EventRetention, read_events};

    #[tokio::test]
    async fn applied_state_and_events_survive_reopen_and_old_events_are_pruned_at_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (_db, _log, mut sm) = store::open(dir.path()).await.unwrap();
            super::apply(&mut sm, (1..=20).map(|i| super::acquire_entry(i, 1000 + i)))
                .await
                .unwrap();
        }
        let (db, _log, mut sm) = store::open(dir.path()).await.unwrap();
        let (applied, _) = sm.applied_state().await.unwrap();
        assert_eq!(
            applied.unwrap().index,
            20,
            "last_applied persisted with the state"
        );
        assert_eq!(sm.handle().read().state.locks.len(), 20);
        let events = read_events(&db, Revision { index: 0, sub: 0 }, 100).unwrap();
        assert_eq!(events.len(), 20);
        assert!(matches!(&events[0].kind, EventKind::LockGranted { hold, .. } if hold.token == 1));

        sm.set_event_retention(EventRetention {
            entries: 5,
            age_ms: 0,
        });
        let mut builder = sm.get_snapshot_builder().await;
        builder.build_snapshot().await.unwrap();
        let events = read_events(&db, Revision { index: 0, sub: 0 }, 100).unwrap();
        let indexes: Vec<u64> = events.iter().map(|e| e.revision.index).collect();
        assert_eq!(indexes, (15..=20).collect::<Vec<_>>());
    }

    /// openraft asks to purge up to an installed snapshot while the state
    /// machine is still storing it; a purge written before the snapshot
    /// (then a kill) left a replica whose log was purged past its stored
    /// snapshot, which openraft refuses to start from (chaos seed 65 on
    /// 2026-12-03). Once snapshots arrive, the log store never purges past
    /// the stored one, whatever becomes of the install.
    #[tokio::test]
    async fn the_log_is_never_purged_past_the_stored_snapshot() {
        use openraft::storage::RaftLogStorage;
        use tether_server::raft::log_id;
        let dir = tempfile::tempdir().unwrap();
        {
            let (_db, mut log, mut sm) = store::open(dir.path()).await.unwrap();
            super::apply(&mut sm, (1..=10).map(|i| super::acquire_entry(i, 1000 + i)))
                .await
                .unwrap();
            sm.get_snapshot_builder()
                .await
                .build_snapshot()
                .await
                .unwrap();
            // A snapshot up to 20 arrives and its install fails; openraft
            // has already asked to purge up to it.
            let meta = openraft::SnapshotMeta {
                last_log_id: Some(log_id(1, 1, 20)),
                last_membership: Default::default(),
            };
            let garbage = std::io::Cursor::new(b"not a snapshot".to_vec());
            assert!(sm.install_snapshot(&meta, garbage).await.is_err());
            log.purge(log_id(1, 1, 20)).await.unwrap();
            let state = log.get_log_state().await.unwrap();
            assert_eq!(
                state.last_purged_log_id,
                Some(log_id(1, 1, 10)),
                "purged no further than the stored snapshot (index 10), which \
                 counts as purged"
            );
            log.purge(log_id(1, 1, 8)).await.unwrap();
        }
        // What a restart reads: the log starts after the snapshot at 10.
        let (_db, mut log, mut sm) = store::open(dir.path()).await.unwrap();
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 1, 10)));
        assert!(state.last_log_id >= state.last_purged_log_id);
        let snapshot = sm
            .get_current_snapshot()
            .await
            .unwrap()
            .expect("a snapshot");
        assert_eq!(snapshot.meta.last_log_id.map(|l| l.index), Some(10));
    }
}

mod age_retention {
    use openraft::RaftSnapshotBuilder;
    use openraft::storage::RaftStateMachine;
    use tether_server::sm::Revision;
    use tether_server::store::{self, EventRetention, events_first_index, read_events};

    #[tokio::test]
    async fn events_older_than_the_retention_age_are_deleted_at_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _log, mut sm) = store::open(dir.path()).await.unwrap();
        // Entry i is stamped at i seconds.
        let entries = (1..=10u64).map(|index| super::acquire_entry(index, index * 1000));
        super::apply(&mut sm, entries).await.unwrap();
        // Keep 3.5 s of history at committed time 10 s: entries 7..=10.
        snapshot_keeping(&mut sm, 3_500).await;
        let kept = retained_indexes(&db);
        assert_eq!(kept, vec![7, 8, 9, 10]);
        assert_eq!(events_first_index(&db).unwrap(), 7);
    }

    /// Log indexes of the retained events, oldest first.
    fn retained_indexes(db: &rocksdb::DB) -> Vec<u64> {
        read_events(db, Revision { index: 0, sub: 0 }, 100)
            .unwrap()
            .iter()
            .map(|e| e.revision.index)
            .collect()
    }

    /// Builds a snapshot keeping events younger than `age_ms`.
    async fn snapshot_keeping(sm: &mut store::StateMachineStore, age_ms: u64) {
        sm.set_event_retention(EventRetention {
            entries: 1_000,
            age_ms,
        });
        sm.get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();
    }

    /// Entries without events (elections, membership) below the retention
    /// window do not make a watch from before them "compacted": only a
    /// deleted event does, and then one past the newest deleted one.
    #[tokio::test]
    async fn a_watch_from_revision_one_misses_nothing_until_an_event_is_deleted() {
        use openraft::EntryPayload;
        let dir = tempfile::tempdir().unwrap();
        let (db, _log, mut sm) = store::open(dir.path()).await.unwrap();
        // Entries 1-3 carry no events; 4-6 and 9-10 do; 7-8 carry none.
        let blank = |index| tether_server::raft::Entry {
            log_id: tether_server::raft::log_id(1, 1, index),
            payload: EntryPayload::Blank,
        };
        let entries = (1..=10u64).map(|index| match index {
            1..=3 | 7 | 8 => blank(index),
            _ => super::acquire_entry(index, index * 1000),
        });
        super::apply(&mut sm, entries).await.unwrap();
        // Everything is young: nothing deleted, a watch may start anywhere.
        snapshot_keeping(&mut sm, 60_000).await;
        assert_eq!(events_first_index(&db).unwrap(), 0);
        // Keep 1.5 s at committed time 10 s: events of 4-6 go; the newest
        // deleted was at 6, so a watch from 7 (no events at 7-8) is whole.
        snapshot_keeping(&mut sm, 1_500).await;
        let kept = retained_indexes(&db);
        assert_eq!(kept, vec![9, 10]);
        assert_eq!(events_first_index(&db).unwrap(), 7);
    }
}

/// The state machine hands a queued acquire the events that end its wait,
/// and tells it to read the state when a snapshot replaces the state.
mod waits {
    use std::time::Duration;

    use openraft::RaftSnapshotBuilder;
    use openraft::storage::RaftStateMachine;
    use tether_server::sm::{EventKind, LockKey};
    use tether_server::store::{self, waiters::WaitSignal};

    const DEADLINE: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn apply_hands_a_grant_to_the_wait_naming_its_lock_and_pod_only() {
        let dir = tempfile::tempdir().unwrap();
        let (_db, _log, mut sm) = store::open(dir.path()).await.unwrap();
        let handle = sm.handle();
        let mut waiting = handle.register_wait(&LockKey::new("gpu-bind", "node-2"), "u2");
        let mut other_pod = handle.register_wait(&LockKey::new("gpu-bind", "node-2"), "u9");
        super::apply(&mut sm, (1..=3).map(|i| super::acquire_entry(i, 1000 + i)))
            .await
            .unwrap();
        match tokio::time::timeout(DEADLINE, waiting.recv()).await {
            Ok(Some(WaitSignal::Event(event))) => assert!(
                matches!(&event.kind, EventKind::LockGranted { key, hold }
                    if key.name == "node-2" && hold.pod.uid == "u2" && hold.token == 2),
                "expected u2's grant of node-2 at token 2, got {event:?}"
            ),
            other => panic!("expected u2's grant, got {other:?}"),
        }
        assert!(waiting.try_recv().is_none(), "one grant, one signal");
        assert!(
            other_pod.try_recv().is_none(),
            "a wait for another pod on the same lock was told"
        );
    }

    #[tokio::test]
    async fn a_snapshot_install_tells_every_wait_to_read_the_state() {
        let source_dir = tempfile::tempdir().unwrap();
        let (_db, _log, mut source) = store::open(source_dir.path()).await.unwrap();
        super::apply(
            &mut source,
            (1..=5).map(|i| super::acquire_entry(i, 1000 + i)),
        )
        .await
        .unwrap();
        let snapshot = source
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();

        // A replica far behind: u3's grant reaches it inside the snapshot,
        // with no event.
        let dir = tempfile::tempdir().unwrap();
        let (_db, _log, mut behind) = store::open(dir.path()).await.unwrap();
        let handle = behind.handle();
        let key = LockKey::new("gpu-bind", "node-3");
        let mut waiting = handle.register_wait(&key, "u3");
        behind
            .install_snapshot(&snapshot.meta, snapshot.snapshot)
            .await
            .unwrap();
        match tokio::time::timeout(DEADLINE, waiting.recv()).await {
            Ok(Some(WaitSignal::Recheck)) => {}
            other => panic!("expected a recheck after the install, got {other:?}"),
        }
        let holder = handle.read().state.locks[&key].holder.clone();
        assert_eq!(holder.map(|h| h.pod.uid), Some("u3".to_string()));
    }
}

/// The log store's reads and its committed id, beyond openraft's suite.
mod log_store {
    use tether_server::store;

    /// Short ranges are read by key (`log_store.rs`,
    /// `POINT_READ_MAX_ENTRIES`), longer ones through an iterator: both
    /// return the same entries, skip a purged start and a missing end, and
    /// a hole in the middle is an error on the keyed path.
    #[tokio::test]
    async fn log_reads_by_key_and_by_iterator_agree_and_a_hole_is_an_error() {
        use openraft::RaftLogReader;
        use openraft::storage::{IOFlushed, RaftLogStorage};
        let dir = tempfile::tempdir().unwrap();
        let (db, mut log, _sm) = store::open(dir.path()).await.unwrap();
        log.append(
            (1..=100).map(|i| super::acquire_entry(i, i)),
            IOFlushed::noop(),
        )
        .await
        .unwrap();
        let indexes = |entries: Vec<tether_server::raft::Entry>| -> Vec<u64> {
            entries.iter().map(|e| e.log_id.index).collect()
        };
        // Keyed (short) and iterated (long) reads over the same entries.
        assert_eq!(
            indexes(log.try_get_log_entries(5..9).await.unwrap()),
            vec![5, 6, 7, 8]
        );
        assert_eq!(
            indexes(log.try_get_log_entries(98..=105).await.unwrap()),
            vec![98, 99, 100]
        );
        let long = indexes(log.try_get_log_entries(1..=100).await.unwrap());
        assert_eq!(long, (1..=100).collect::<Vec<_>>());
        assert_eq!(
            indexes(log.try_get_log_entries(95..).await.unwrap()),
            (95..=100).collect::<Vec<_>>()
        );

        // A purged start is skipped on both paths.
        log.purge(tether_server::raft::log_id(1, 1, 10))
            .await
            .unwrap();
        assert_eq!(
            indexes(log.try_get_log_entries(8..13).await.unwrap()),
            vec![11, 12]
        );
        let long = indexes(log.try_get_log_entries(1..=100).await.unwrap());
        assert_eq!(long, (11..=100).collect::<Vec<_>>());
        // Replication's read: nothing rather than entries that do not
        // follow the entry before its start (chaos seed 200048).
        assert!(log.limited_get_log_entries(8, 13).await.unwrap().is_empty());
        assert!(log.limited_get_log_entries(8, 80).await.unwrap().is_empty());
        assert_eq!(
            indexes(log.limited_get_log_entries(11, 13).await.unwrap()),
            vec![11, 12]
        );

        // A hole (written here directly: the store never makes one) is an
        // error when read by key, not a shorter answer.
        let cf = db.cf_handle(store::CF_LOG).unwrap();
        db.delete_cf(cf, store::keys::log_key(50)).unwrap();
        let err = log.try_get_log_entries(48..53).await.unwrap_err();
        assert!(
            err.to_string().contains("entry 51 but not entry 50"),
            "{err}"
        );
        // Reading up to the hole is fine.
        assert_eq!(
            indexes(log.try_get_log_entries(48..50).await.unwrap()),
            vec![48, 49]
        );
    }

    /// The committed log id openraft saves is written with the next append,
    /// not on its own (`log_store.rs`, `save_committed`): read back at once,
    /// stored once an append follows, and lagging by what no append
    /// followed after a restart.
    #[tokio::test]
    async fn the_committed_id_is_stored_with_the_next_append() {
        use openraft::storage::{IOFlushed, RaftLogStorage};
        use tether_server::raft::log_id;
        let dir = tempfile::tempdir().unwrap();
        {
            let (_db, log, _sm) = store::open(dir.path()).await.unwrap();
            // Synced where written, so that no sync thread outlives the store.
            let mut log = log.with_own_id(u64::MAX);
            log.append(
                (1..=3).map(|i| super::acquire_entry(i, i)),
                IOFlushed::noop(),
            )
            .await
            .unwrap();
            log.save_committed(Some(log_id(1, 1, 2))).await.unwrap();
            assert_eq!(log.read_committed().await.unwrap(), Some(log_id(1, 1, 2)));
            log.append([super::acquire_entry(4, 4)], IOFlushed::noop())
                .await
                .unwrap();
            // No append after this one: it is not stored.
            log.save_committed(Some(log_id(1, 1, 4))).await.unwrap();
            assert_eq!(log.read_committed().await.unwrap(), Some(log_id(1, 1, 4)));
        }
        let (_db, mut log, _sm) = store::open(dir.path()).await.unwrap();
        assert_eq!(log.read_committed().await.unwrap(), Some(log_id(1, 1, 2)));
    }
}
