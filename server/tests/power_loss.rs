//! A power cut right after each synced write of the store: what the store
//! acknowledged is still there when it opens again. The store runs in a
//! child process (this test binary, re-run as `power_cut_child`) on a LazyFS
//! mount (`tether_kube_testenv::lazyfs`): it makes one write through the
//! real code, says so, and is killed (`kill -9`); LazyFS then drops every
//! write not fsynced, and the test opens the store on what the disk kept.
//!
//! Why here and not only in the chaos runs (`tether-chaos --power-loss`):
//! every write of a replica shares one RocksDB write-ahead log, so any
//! later synced write (the next append, a purge) makes an unsynced one
//! before it durable too. A vote or a snapshot install written without a
//! sync is lost only by a power cut in the moment between it and the next
//! synced write, one replication round trip, which a chaos schedule does
//! not hit. Here the cut comes exactly there.
//!
//! Each check is also run against its planted bug (`failpoints` builds:
//! `vote-without-sync`, `snapshot-install-without-sync`), which it must
//! catch.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::{RaftLogReader, RaftSnapshotBuilder};
use tether_kube_testenv::Process;
use tether_kube_testenv::lazyfs::{self, LazyFs};
use tether_server::raft::Vote;
use tether_server::store;

/// Which write the child makes (`vote`, `snapshot`, `cluster-id`,
/// `node-id`).
const SCENARIO_VAR: &str = "TETHER_POWER_CUT_SCENARIO";
/// The store's directory, as the child (inside the mount's namespace) sees it.
const DIR_VAR: &str = "TETHER_POWER_CUT_DIR";
/// A planted bug the child switches on first.
const PLANTED_VAR: &str = "TETHER_POWER_CUT_PLANTED";
/// What the child prints once the store acknowledged its write.
const ACKNOWLEDGED: &str = "POWER-CUT-CHILD-ACKNOWLEDGED";

/// The vote the child saves.
fn the_vote() -> Vote {
    Vote::new(7, 2)
}

/// The child's side: run by the parent only (without the variable it does
/// nothing, so `cargo test -- --ignored` passes it by).
#[tokio::test]
#[ignore = "the power-cut tests' child process"]
async fn power_cut_child() {
    let (Ok(scenario), Ok(dir)) = (std::env::var(SCENARIO_VAR), std::env::var(DIR_VAR)) else {
        return;
    };
    let dir = Path::new(&dir);
    if let Ok(planted) = std::env::var(PLANTED_VAR) {
        planted_on(&planted);
    }
    match scenario.as_str() {
        "vote" => {
            let (_db, mut log, _sm) = store::open(dir).await.unwrap();
            log.save_vote(&the_vote()).await.unwrap();
        }
        "snapshot" => {
            // Built elsewhere (not on LazyFS), installed here.
            let source_dir = tempfile::tempdir().unwrap();
            let (_source_db, _log, mut source) = store::open(source_dir.path()).await.unwrap();
            let entries: Vec<_> = (1..=5)
                .map(|i| Ok((common::acquire_entry(i, 1000 + i), None)))
                .collect();
            source.apply(futures::stream::iter(entries)).await.unwrap();
            let snapshot = source
                .get_snapshot_builder()
                .await
                .build_snapshot()
                .await
                .unwrap();
            let (_db, _log, mut sm) = store::open(dir).await.unwrap();
            sm.install_snapshot(&snapshot.meta, snapshot.snapshot)
                .await
                .unwrap();
        }
        "cluster-id" => {
            let db = store::open_db(dir).unwrap();
            store::write_cluster_id(&db, "power-cut-cluster").unwrap();
        }
        "node-id" => {
            // What `tetherd --statefulset` does first on an empty volume.
            let id = tether_server::statefulset::node_id(dir).unwrap();
            println!("NODE-ID {id}");
        }
        other => panic!("no scenario {other}"),
    }
    println!("{ACKNOWLEDGED}");
    // Killed here by the parent: no shutdown, no close.
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

#[cfg(feature = "failpoints")]
fn planted_on(name: &str) {
    fail::cfg(name, "return").unwrap();
}

#[cfg(not(feature = "failpoints"))]
fn planted_on(name: &str) {
    panic!("planted bug {name} needs a failpoints build");
}

/// A LazyFS whose store directory the child wrote `scenario` to, with
/// `planted` on, and was then cut off; `None` after a loud skip where LazyFS
/// cannot run (a failure under `CI=true`).
fn power_cut_after(test: &str, scenario: &str, planted: Option<&str>) -> Option<Cut> {
    if !lazyfs::available_or_skip(test) {
        return None;
    }
    let work = tempfile::tempdir().unwrap();
    let disk = LazyFs::mount(
        work.path(),
        "disk",
        &work.path().join("backing"),
        &work.path().join("mount"),
    )
    .unwrap();
    let store_dir = disk.mount_point().join("store");
    let mut command: Command = disk.command(&std::env::current_exe().unwrap());
    command
        .args(["--exact", "power_cut_child", "--ignored", "--nocapture"])
        .env(SCENARIO_VAR, scenario)
        .env(DIR_VAR, &store_dir);
    if let Some(planted) = planted {
        command.env(PLANTED_VAR, planted);
    }
    let log = work.path().join("child.log");
    let mut child = Process::spawn("power-cut-child", command, &log, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        if output.contains(ACKNOWLEDGED) {
            break;
        }
        assert!(
            child.exited().is_none() && Instant::now() < deadline,
            "the child did not acknowledge its write:\n{output}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill();
    disk.clear_cache().unwrap();
    let printed = std::fs::read_to_string(&log).unwrap_or_default();
    Some(Cut {
        disk,
        printed,
        _work: work,
    })
}

/// The disk after the cut.
struct Cut {
    disk: LazyFs,
    /// What the child printed.
    printed: String,
    _work: tempfile::TempDir,
}

impl Cut {
    /// The store's directory as this process reaches it.
    fn store_dir(&self) -> std::path::PathBuf {
        self.disk.path().join("store")
    }
}

async fn vote_after_cut(test: &str, planted: Option<&str>) -> Option<Option<Vote>> {
    let cut = power_cut_after(test, "vote", planted)?;
    let (_db, mut log, _sm) = store::open(&cut.store_dir()).await.unwrap();
    Some(log.read_vote().await.unwrap())
}

/// The checker of the vote: a vote the store acknowledged survives.
fn check_vote_kept(found: Option<Vote>) -> Result<(), String> {
    match found {
        Some(vote) if vote == the_vote() => Ok(()),
        other => Err(format!(
            "the acknowledged vote {} was lost by a power cut: the store holds {other:?}",
            the_vote()
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_vote_survives_a_power_cut() {
    let test = "an_acknowledged_vote_survives_a_power_cut";
    let Some(found) = vote_after_cut(test, None).await else {
        return;
    };
    check_vote_kept(found).unwrap();
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_saves_the_vote_without_a_sync_is_caught() {
    let test = "a_build_that_saves_the_vote_without_a_sync_is_caught";
    let Some(found) = vote_after_cut(test, Some("vote-without-sync")).await else {
        return;
    };
    let caught = check_vote_kept(found).expect_err("the lost vote is caught");
    println!("caught: {caught}");
}

/// What the store holds of the snapshot after the cut: the stored
/// snapshot's last index and the applied index of the state.
async fn snapshot_after_cut(test: &str, planted: Option<&str>) -> Option<(Option<u64>, u64)> {
    let cut = power_cut_after(test, "snapshot", planted)?;
    let (_db, _log, mut sm) = store::open(&cut.store_dir()).await.unwrap();
    let stored = sm
        .get_current_snapshot()
        .await
        .unwrap()
        .and_then(|s| s.meta.last_log_id)
        .map(|id| id.index);
    let (applied, _) = sm.applied_state().await.unwrap();
    Some((stored, applied.map_or(0, |id| id.index)))
}

/// The checker of an install: the installed snapshot is the stored one and
/// the state is the snapshot's (entries 1 to 5).
fn check_snapshot_kept(found: (Option<u64>, u64)) -> Result<(), String> {
    match found {
        (Some(5), 5) => Ok(()),
        (stored, applied) => Err(format!(
            "the acknowledged install of a snapshot up to index 5 was lost by a power cut: \
             stored snapshot up to {stored:?}, state applied up to {applied}"
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_installed_snapshot_survives_a_power_cut() {
    let test = "an_installed_snapshot_survives_a_power_cut";
    let Some(found) = snapshot_after_cut(test, None).await else {
        return;
    };
    check_snapshot_kept(found).unwrap();
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_installs_snapshots_without_a_sync_is_caught() {
    let test = "a_build_that_installs_snapshots_without_a_sync_is_caught";
    let Some(found) = snapshot_after_cut(test, Some("snapshot-install-without-sync")).await else {
        return;
    };
    let caught = check_snapshot_kept(found).expect_err("the lost install is caught");
    println!("caught: {caught}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_id_survives_a_power_cut() {
    let Some(cut) = power_cut_after("the_cluster_id_survives_a_power_cut", "cluster-id", None)
    else {
        return;
    };
    let db = store::open_db(&cut.store_dir()).unwrap();
    assert_eq!(
        store::read_cluster_id(&db).unwrap().as_deref(),
        Some("power-cut-cluster")
    );
}

/// Found by LazyFS: the node id a StatefulSet replica draws on its first
/// start was written and renamed into place without a sync, so a power cut
/// soon after left the file empty (the rename kept, its data lost) and the
/// replica could not start again ("does not hold a node id").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statefulset_replicas_drawn_node_id_survives_a_power_cut() {
    let Some(cut) = power_cut_after(
        "a_statefulset_replicas_drawn_node_id_survives_a_power_cut",
        "node-id",
        None,
    ) else {
        return;
    };
    let drawn: u64 = cut
        .printed
        .lines()
        .find_map(|l| l.strip_prefix("NODE-ID "))
        .expect("the child printed the id")
        .trim()
        .parse()
        .unwrap();
    let kept = tether_server::statefulset::node_id(&cut.store_dir());
    assert_eq!(kept.map_err(|e| format!("{e:#}")), Ok(drawn));
}
