//! `Batch`: several clients' acquires and releases in one log entry, so that
//! one append (one fsync on each replica) commits them all.
//!
//! Every item keeps its own request id, so dedupe works per item exactly as
//! for an entry of its own, and its own reply. Items apply in order, as if
//! each were the next entry, except that they share the entry's index; that
//! index is the fencing token of any grant an item makes. Tokens must rise
//! strictly per lock, so a lock may be granted at most once per entry. Only
//! commands that touch just the lock they name (acquire and release) go in.
//!
//! In format 3 a batch holds at most one command per lock. Format 4 lets it
//! hold several (a release and the acquires queueing behind it, say), and
//! apply keeps the one-grant rule itself: a hold granted by an item cannot be
//! released by a later item of the same entry (its token did not exist when
//! the release was proposed), and only a release can end a hold within a
//! batch, so no lock is granted twice.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::Command;
use crate::sm::types::{LockKey, RequestId};

/// The log format that introduced batch entries.
pub const BATCH_FORMAT_VERSION: u16 = 3;

/// The log format whose batch entries may carry several commands on one
/// lock.
pub const SHARED_LOCK_BATCH_FORMAT_VERSION: u16 = 4;

/// Most items one batch entry may carry.
pub const MAX_BATCH_ITEMS: usize = 256;

/// Commands of several clients applied by one entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// In apply order.
    pub items: Vec<BatchItem>,
}

/// One client's command inside a [`Batch`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchItem {
    /// As on an entry of its own.
    pub request_id: Option<RequestId>,
    /// An acquire or a release.
    pub command: Command,
}

impl Batch {
    /// Whether an item is an acquire (whose rules change in format 9,
    /// [`super::TAKEOVER_FORMAT_VERSION`]).
    pub fn has_acquire(&self) -> bool {
        self.items
            .iter()
            .any(|item| item.command.acquire().is_some())
    }

    /// Whether an item is an acquire for a node object (which needs format
    /// [`super::NODE_OBJECT_FORMAT_VERSION`]).
    pub fn has_node_object_check(&self) -> bool {
        self.items
            .iter()
            .any(|item| matches!(item.command, Command::ForNodeObjects(_)))
    }

    /// Why this batch may not be applied in an entry of `format_version`, if
    /// it may not: no items, too many, a command that is not an acquire or
    /// release, or (before [`SHARED_LOCK_BATCH_FORMAT_VERSION`]) two commands
    /// on one lock. The leader forms batches that pass; apply checks again,
    /// so that a malformed entry is refused the same way on every replica.
    pub fn check(&self, format_version: u16) -> Result<(), String> {
        if self.items.is_empty() {
            return Err("a batch entry has no items".into());
        }
        if self.items.len() > MAX_BATCH_ITEMS {
            return Err(format!(
                "a batch entry has {} items, over the limit of {MAX_BATCH_ITEMS}",
                self.items.len()
            ));
        }
        if format_version < super::NODE_OBJECT_FORMAT_VERSION && self.has_node_object_check() {
            return Err(format!(
                "a batch entry of format {format_version} carries an acquire for a node object \
                 (format {})",
                super::NODE_OBJECT_FORMAT_VERSION
            ));
        }
        let shared_locks = format_version >= SHARED_LOCK_BATCH_FORMAT_VERSION;
        let mut keys = BTreeSet::new();
        for item in &self.items {
            let Some(key) = batchable_lock(&item.command) else {
                return Err("a batch entry may carry only acquires and releases".into());
            };
            if !keys.insert(key) && !shared_locks {
                return Err(format!(
                    "a batch entry of format {format_version} carries two commands on lock \
                     {key}; their grants would share a fencing token"
                ));
            }
        }
        Ok(())
    }

    /// Whether two items name the same lock (which needs format
    /// [`SHARED_LOCK_BATCH_FORMAT_VERSION`]).
    pub fn shares_a_lock(&self) -> bool {
        let mut keys = BTreeSet::new();
        !self
            .items
            .iter()
            .filter_map(|item| batchable_lock(&item.command))
            .all(|key| keys.insert(key))
    }
}

/// The lock a command names, if it may go into a batch: acquires and
/// releases touch only that lock (and the dedupe table), so a batch with one
/// command per lock keeps every lock's tokens strictly rising.
/// An acquire for the node object its caller saw (format 10) is one too:
/// its check reads only the node registry, which no batchable command
/// changes.
pub fn batchable_lock(command: &Command) -> Option<&LockKey> {
    match command {
        Command::Release(release) => Some(&release.key),
        other => other.acquire().map(|acquire| &acquire.key),
    }
}
