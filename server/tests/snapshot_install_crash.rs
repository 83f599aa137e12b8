//! A snapshot install cut short by a crash leaves a store openraft can start
//! from: the installed state is never on disk without the stored snapshot.
//!
//! Found by a power-loss chaos schedule on 2026-12-05 (seed 200208, a power
//! cut then a crash during a membership change): a follower killed while it
//! installed a snapshot had the new state written and the stored snapshot
//! not. At its next start openraft found the state machine ahead of the
//! log, purged the log up to it (its start-up clean-up), and then refused to
//! start: the log was purged past the stored snapshot, on every later start
//! too. The crash is made here with a failpoint right after the state's
//! write (`sm-install-snapshot-after-state`, the install then fails as a
//! kill would have ended it); the planted switch
//! `snapshot-install-in-two-writes` puts back the two writes, to show the
//! test catches them.

#![cfg(feature = "failpoints")]

use std::io::Cursor;

use openraft::RaftSnapshotBuilder;
use openraft::storage::{RaftLogStorage, RaftStateMachine, StorageHelper};
use tether_server::store;

/// Snapshots at indexes 10 and 20 of a store that applied 20 entries.
async fn snapshots_at_10_and_20() -> Vec<(tether_server::raft::SnapshotMeta, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let (_db, _log, mut sm) = store::open(dir.path()).await.unwrap();
    let mut snapshots = Vec::new();
    for batch in [1..=10u64, 11..=20] {
        let entries: Vec<_> = batch
            .map(|index| {
                Ok((
                    tether_server::raft::Entry {
                        log_id: tether_server::raft::log_id(1, 1, index),
                        payload: openraft::EntryPayload::Blank,
                    },
                    None,
                ))
            })
            .collect();
        RaftStateMachine::apply(&mut sm, futures::stream::iter(entries))
            .await
            .unwrap();
        let snapshot = sm
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();
        snapshots.push((snapshot.meta, snapshot.snapshot.into_inner()));
    }
    snapshots
}

/// Installs the first snapshot into an empty store, then the second with
/// the crash point armed; opens the store again as a restarted replica
/// does, runs openraft's start-up reading of it, and returns (log purged
/// up to, stored snapshot covers).
async fn purged_and_snapshot_after_a_cut_short_install(
    snapshots: &[(tether_server::raft::SnapshotMeta, Vec<u8>)],
) -> (Option<u64>, Option<u64>) {
    let dir = tempfile::tempdir().unwrap();
    {
        let (_db, _log, mut sm) = store::open(dir.path()).await.unwrap();
        let (meta, data) = &snapshots[0];
        sm.install_snapshot(meta, Cursor::new(data.clone()))
            .await
            .unwrap();
        let (meta, data) = &snapshots[1];
        fail::cfg("sm-install-snapshot-after-state", "return").unwrap();
        let result = sm.install_snapshot(meta, Cursor::new(data.clone())).await;
        fail::remove("sm-install-snapshot-after-state");
        assert!(result.is_err(), "the crash point cuts the install short");
    }
    let (_db, mut log, mut sm) = store::open(dir.path()).await.unwrap();
    StorageHelper::new(&mut log, &mut sm)
        .with_id(2)
        .get_initial_state()
        .await
        .unwrap();
    let purged = log
        .get_log_state()
        .await
        .unwrap()
        .last_purged_log_id
        .map(|l| l.index);
    let snapshot = sm
        .get_current_snapshot()
        .await
        .unwrap()
        .and_then(|s| s.meta.last_log_id)
        .map(|l| l.index);
    (purged, snapshot)
}

#[tokio::test]
async fn an_install_cut_short_after_the_state_leaves_the_snapshot_covering_the_purged_log() {
    let scenario = fail::FailScenario::setup();
    let snapshots = snapshots_at_10_and_20().await;

    // The planted bug: the state written apart from the stored snapshot.
    fail::cfg("snapshot-install-in-two-writes", "return").unwrap();
    let (purged, snapshot) = purged_and_snapshot_after_a_cut_short_install(&snapshots).await;
    fail::remove("snapshot-install-in-two-writes");
    println!("two writes: log purged to {purged:?}, snapshot covers {snapshot:?}");
    assert!(
        purged > snapshot,
        "with the planted bug the start-up purge passes the stored snapshot \
         (purged {purged:?}, snapshot {snapshot:?}): the test no longer reaches it"
    );

    // As built: one write; cut short after it, the snapshot is there.
    let (purged, snapshot) = purged_and_snapshot_after_a_cut_short_install(&snapshots).await;
    println!("one write: log purged to {purged:?}, snapshot covers {snapshot:?}");
    assert_eq!(snapshot, Some(20));
    assert!(
        purged <= snapshot,
        "the log is purged to {purged:?}, past the stored snapshot {snapshot:?}: \
         openraft would refuse to start"
    );
    scenario.teardown();
}
