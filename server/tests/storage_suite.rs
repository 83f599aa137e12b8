//! openraft's storage test suite against Tether's RocksDB log store and state
//! machine, each run in a fresh temp directory.

use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;
use tether_server::raft::{StorageError, TypeConfig};
use tether_server::store::{self, LogStore, StateMachineStore};

struct RocksBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for RocksBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().expect("a temp dir");
        let (_db, log, sm) = store::open(dir.path()).await?;
        Ok((dir, log, sm))
    }
}

#[test]
fn rocksdb_store_passes_openraft_storage_suite() {
    Suite::test_all(RocksBuilder).expect("openraft storage suite");
}
