//! `Batch`: several clients' acquires and releases (and, from format 11,
//! their claims and pod reports) in one log entry, so that one append (one
//! fsync on each replica) commits them all.
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
//! the release was proposed), and until format 11 only a release can end a
//! hold within a batch, so no lock is granted twice.
//!
//! Format 11 lets a batch carry commands that name no lock as well: pin
//! assignments (a device claim is one) and pod reports and revokes, the
//! other entries of a bind (issue 64: each was an entry of its own, and the
//! entries are what the replicas' CPU goes on). An assignment and a report
//! of a starting or running pod touch only pins and the pod registry,
//! which no lock command reads, and carry no token. A terminal report or a
//! revoke ends a pod's holds and hands each lock to its next waiter under
//! the entry's index; apply refuses one that would end a hold granted by
//! this same entry (the lock would be granted twice under one token), and
//! the leader proposes a refused one again in an entry of its own.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::Command;
use crate::sm::types::{LockKey, RequestId};

/// The log format that introduced batch entries.
pub const BATCH_FORMAT_VERSION: u16 = 3;

/// The log format whose batch entries may carry several commands on one
/// lock.
pub const SHARED_LOCK_BATCH_FORMAT_VERSION: u16 = 4;

/// The log format whose batch entries may also carry commands that name no
/// lock: assignments, pod reports and pod revokes.
pub const LOCKLESS_BATCH_FORMAT_VERSION: u16 = 11;

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
    /// An acquire or a release; from format 11 also a command of
    /// [`BatchRole::Lockless`].
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

    /// Whether an item names no lock (which needs format
    /// [`LOCKLESS_BATCH_FORMAT_VERSION`]).
    pub fn has_lockless(&self) -> bool {
        self.items
            .iter()
            .any(|item| matches!(batch_role(&item.command), Some(BatchRole::Lockless)))
    }

    /// Why this batch may not be applied in an entry of `format_version`, if
    /// it may not: no items, too many, a command that may not be batched
    /// (before [`LOCKLESS_BATCH_FORMAT_VERSION`], one that is not an acquire
    /// or release), or (before [`SHARED_LOCK_BATCH_FORMAT_VERSION`]) two
    /// commands on one lock. The leader forms batches that pass; apply
    /// checks again, so that a malformed entry is refused the same way on
    /// every replica.
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
        let lockless = format_version >= LOCKLESS_BATCH_FORMAT_VERSION;
        let mut keys = BTreeSet::new();
        for item in &self.items {
            let key = match batch_role(&item.command) {
                Some(BatchRole::Lock(key)) => key,
                Some(BatchRole::Lockless) if lockless => continue,
                Some(BatchRole::Lockless) => {
                    return Err(format!(
                        "a batch entry of format {format_version} carries a command that names \
                         no lock (format {LOCKLESS_BATCH_FORMAT_VERSION})"
                    ));
                }
                None if lockless => {
                    return Err(
                        "a batch entry may carry only acquires, releases, assignments, \
                                pod reports and pod revokes"
                            .into(),
                    );
                }
                None => return Err("a batch entry may carry only acquires and releases".into()),
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

/// What a command is to a batch, if it may go into one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchRole<'a> {
    /// An acquire or a release: it touches only this lock (and the dedupe
    /// table), so a batch with one command per lock keeps every lock's
    /// tokens strictly rising. An acquire for the node object its caller
    /// saw (format 10) is one too: its check reads only the node registry,
    /// which no batchable command changes.
    Lock(&'a LockKey),
    /// From format 11: an assignment (plain or for the node objects its
    /// caller saw), a pod report or a pod revoke. They name no lock; a
    /// terminal report and a revoke may end holds, under the rule in the
    /// module doc.
    Lockless,
}

/// What `command` is to a batch; None if it may not go into one.
pub fn batch_role(command: &Command) -> Option<BatchRole<'_>> {
    match command {
        Command::Release(release) => Some(BatchRole::Lock(&release.key)),
        Command::Assign(_)
        | Command::ForNodeObjects(super::ForNodeObjects {
            command: super::NodeTaking::Assign(_),
            ..
        })
        | Command::ReportPod(_)
        | Command::RevokePod(_) => Some(BatchRole::Lockless),
        other => other.acquire().map(|acquire| BatchRole::Lock(&acquire.key)),
    }
}

/// The lock a command names, if it is an acquire or release (which every
/// batch format may carry).
pub fn batchable_lock(command: &Command) -> Option<&LockKey> {
    match batch_role(command)? {
        BatchRole::Lock(key) => Some(key),
        BatchRole::Lockless => None,
    }
}

/// The pod whose holds `command` may end as it applies, if it may end any
/// (a terminal or gone report, a revoke): in a batch it is refused when
/// one of those holds was granted by the same entry.
pub fn ends_holds_of(command: &Command) -> Option<&str> {
    match command {
        Command::RevokePod(revoke) => Some(&revoke.pod_uid),
        Command::ReportPod(report)
            if matches!(
                report.phase,
                crate::sm::PodPhase::Terminal | crate::sm::PodPhase::Gone
            ) =>
        {
            Some(&report.pod_uid)
        }
        _ => None,
    }
}
