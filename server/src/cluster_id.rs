//! The cluster's id: which Raft group a replica, a response and a Raft
//! message belong to, so that two clusters behind one address (a
//! StatefulSet that split, a replica left with another cluster's data) are
//! told apart instead of mixed.
//!
//! - **Drawn once**, by the first leader that finds none applied
//!   (`node::claim_cluster_id`: right after a cluster is initialized, and
//!   once on a cluster that an older build started), and written to the log
//!   as an `Audit` entry with action [`AUDIT_ACTION`]. The first such entry
//!   applied is the cluster's id on every member (the log orders them all
//!   alike); a later one, proposed by a leader that had not applied the
//!   first yet, changes nothing.
//! - **Kept by every member** in its database (the `meta` column family,
//!   which snapshots do not replace): on applying that entry, or, for a
//!   member that was sent a snapshot past it, from the Raft messages of its
//!   leader, which carry the id in [`METADATA`].
//! - **Checked**: a replica refuses Raft messages of another cluster
//!   (`replica::peer_service`); every gRPC response carries [`METADATA`] and the
//!   response header's `cluster_id`; a client that has seen one id names it
//!   on its requests and a replica of another cluster refuses them before
//!   doing anything ([`check_expected`]); the client also refuses an answer
//!   that names another id (`tether_client::cluster`).
//!
//! A cluster restored from a backup is a new cluster with a new id (the
//! backup holds the state, not the id): clients that talked to the old one
//! must be restarted.

use std::hash::{BuildHasher, Hasher};
use std::sync::RwLock;

/// The `Audit` action of the log entry that records the id (its detail).
pub const AUDIT_ACTION: &str = "ClusterId";

/// gRPC metadata with the cluster id: on every response, and on every Raft
/// message a replica sends.
pub const METADATA: &str = tether_proto::CLUSTER_ID_METADATA;

/// Refuses a client request meant for another cluster (its
/// [`tether_proto::EXPECT_CLUSTER_METADATA`] names another id than this
/// replica's), before any handler runs: a client that follows a leader of
/// another cluster changes nothing there.
pub fn check_expected(
    cell: &ClusterIdCell,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<(), tonic::Status> {
    let Some(expected) = metadata
        .get(tether_proto::EXPECT_CLUSTER_METADATA)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(());
    };
    match cell.get() {
        Some(ours) if ours != expected => {
            let mut refusal = tonic::Status::failed_precondition(format!(
                "this replica belongs to Tether cluster {ours}, but the client has been \
                 using cluster {expected}: two clusters answer at the client's addresses; \
                 nothing was done here"
            ));
            if let Ok(value) = ours.parse() {
                refusal
                    .metadata_mut()
                    .insert(tether_proto::WRONG_CLUSTER_METADATA, value);
            }
            Err(refusal)
        }
        _ => Ok(()),
    }
}

/// The id as this replica knows it; shared by the state machine (which
/// sets it), the Raft network (which sends it) and the gRPC server.
#[derive(Debug, Default)]
pub struct ClusterIdCell(RwLock<Option<String>>);

impl ClusterIdCell {
    /// A cell holding `id` (as read from the database), or none.
    pub fn new(id: Option<String>) -> Self {
        Self(RwLock::new(id))
    }

    /// The id, once known.
    pub fn get(&self) -> Option<String> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes `id` unless one is known; `persist` stores it first (under
    /// the cell's lock, so two callers cannot store two ids). Ok when the
    /// id is (now) `id`; Err with the known id when it differs.
    pub fn adopt(
        &self,
        id: &str,
        persist: impl FnOnce(&str) -> anyhow::Result<()>,
    ) -> Result<(), AdoptError> {
        let mut known = self.0.write().unwrap_or_else(|p| p.into_inner());
        match known.as_deref() {
            Some(kept) if kept == id => Ok(()),
            Some(kept) => Err(AdoptError::Other(kept.to_string())),
            None => {
                persist(id).map_err(|err| AdoptError::Storage(format!("{err:#}")))?;
                *known = Some(id.to_string());
                Ok(())
            }
        }
    }
}

/// Why an id was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdoptError {
    /// This replica belongs to another cluster (its id).
    Other(String),
    /// The id could not be stored.
    Storage(String),
}

/// A new id: 16 hex digits, random.
pub fn draw() -> String {
    format!("{:016x}", random_u64())
}

/// 64 random bits, for ids (this one, node ids) that only have to differ
/// between the few replicas and clusters that could ever meet.
/// `RandomState` is seeded from the OS, so no random-number crate is needed
/// in the server for it.
pub(crate) fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish()
}

/// Whether `id` can be a cluster id: 1 to 64 characters from `[0-9A-Za-z_-]`
/// (it travels in gRPC metadata).
pub fn is_valid(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_id_stays_and_another_is_refused() {
        let cell = ClusterIdCell::default();
        assert_eq!(cell.get(), None);
        let mut stored = Vec::new();
        cell.adopt("a1", |id| {
            stored.push(id.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(cell.get().as_deref(), Some("a1"));
        // The same id again: nothing stored twice.
        cell.adopt("a1", |_| panic!("stored again")).unwrap();
        assert_eq!(
            cell.adopt("b2", |_| panic!("stored another")),
            Err(AdoptError::Other("a1".into()))
        );
        assert_eq!(stored, ["a1"]);
        // A failed store leaves the cell empty.
        let cell = ClusterIdCell::default();
        assert!(matches!(
            cell.adopt("a1", |_| anyhow::bail!("disk full")),
            Err(AdoptError::Storage(_))
        ));
        assert_eq!(cell.get(), None);
        let drawn = draw();
        assert!(is_valid(&drawn) && drawn.len() == 16, "{drawn}");
        assert_ne!(draw(), drawn);
        assert!(!is_valid("") && !is_valid("a b") && !is_valid(&"x".repeat(65)));
    }
}
