//! `ReportNode`: the bridge reports a node joining, its readiness, labels and
//! schedulability, or its deletion. Idempotent: a report that changes nothing
//! emits nothing.
//!
//! A gone node stays gone: from format 5 ([`NODE_UID_FORMAT_VERSION`]) a
//! report for a name whose node is a tombstone brings the name back only
//! under another, non-empty node UID (a new Node object). A late report from
//! a lagging reporter, naming the deleted node's UID or none, changes
//! nothing; in older formats it brought the deleted node back with a
//! `NodeJoined`, and entries of those formats still apply that way.
//!
//! From format 6 ([`NODE_GONE_UID_FORMAT_VERSION`]) a `Gone` report names the
//! node object it is about: one whose UID differs from the registered
//! node's is about an older object under the name and changes nothing.
//!
//! From format 8 ([`NODE_REPLACED_FORMAT_VERSION`]) any other report naming
//! a UID other than the registered live node's is refused
//! ([`CommandError::NodeObjectMismatch`]) and changes nothing. A node is its
//! UID: a new UID under a known name is a node deleted and re-created (a
//! cloud replacement, a re-imaged machine that keeps its hostname), and
//! what the old object held must end with it — which only a `Gone` for the
//! old UID does, after the reporter has seen in the API server that the
//! old object is gone. The state machine cannot tell which of two UIDs is
//! the newer (a lagging reporter's stale view looks the same as a fresh
//! one), so it neither adopts the new UID (format 7 and older did: the
//! old node's pins, claims and locks stayed on the name, and a stale
//! report could flip the UID back) nor guesses that the old object is gone.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{
    NodeInfo, NodeState, PinKey, PinReleaseReason, ReleaseReason, WaitEndReason,
};

/// The log format from which a tombstoned node comes back only under a new
/// UID (see the module doc).
pub const NODE_UID_FORMAT_VERSION: u16 = 5;

/// The log format from which a `Gone` report naming a node UID ends only
/// the node object with that UID: a report about an older object under the
/// same name changes nothing.
pub const NODE_GONE_UID_FORMAT_VERSION: u16 = 6;

/// The log format from which a report (other than `Gone`) naming a node UID
/// other than the registered live node's is refused and changes nothing
/// (see the module doc).
pub const NODE_REPLACED_FORMAT_VERSION: u16 = 8;

/// Report node `name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportNode {
    /// Node name.
    pub name: String,
    /// Node UID (may be empty when unknown).
    pub uid: String,
    /// What happened.
    pub state: NodeState,
    /// New labels, if the report carries them.
    pub labels: Option<BTreeMap<String, String>>,
    /// New schedulability, if the report carries it.
    pub unschedulable: Option<bool>,
}

impl ReportNode {
    /// Applies the report; `Gone` releases the node's pins and the locks named
    /// after it in this same entry.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        let existing = txn
            .state
            .nodes
            .get(&self.name)
            .filter(|n| n.gone_at_ms.is_none())
            .cloned();
        if self.state == NodeState::Gone {
            let tombstoned = txn
                .state
                .nodes
                .get(&self.name)
                .is_some_and(|n| n.gone_at_ms.is_some());
            // About another node object than the one registered under the
            // name (deleted and recreated; a lagging reporter's delete of
            // the old one): the node that has the name now keeps its pins
            // and locks.
            let another_object = txn.format_version >= NODE_GONE_UID_FORMAT_VERSION
                && existing.as_ref().is_some_and(|n| {
                    !self.uid.is_empty() && !n.uid.is_empty() && n.uid != self.uid
                });
            if tombstoned || another_object {
                return Ok(Reply::NodeReported {
                    changed: false,
                    pins_released: 0,
                    locks_released: 0,
                });
            }
            return Ok(node_gone(txn, &self.name, self.uid));
        }
        if txn.format_version >= NODE_UID_FORMAT_VERSION
            && let Some(gone) = txn
                .state
                .nodes
                .get(&self.name)
                .filter(|n| n.gone_at_ms.is_some())
            && (self.uid.is_empty() || self.uid == gone.uid)
        {
            return Ok(Reply::NodeReported {
                changed: false,
                pins_released: 0,
                locks_released: 0,
            });
        }
        // Deliberate bug for the property test's "can fail" test: format
        // 7's rule, the new UID adopted under the name and what the old
        // object held left on it. Only with the `failpoints` feature and
        // FAILPOINTS=sm-node-adopts-another-object=return.
        #[cfg(feature = "failpoints")]
        let adopts = fail::eval("sm-node-adopts-another-object", |_| ()).is_some();
        #[cfg(not(feature = "failpoints"))]
        let adopts = false;
        if txn.format_version >= NODE_REPLACED_FORMAT_VERSION
            && !adopts
            && let Some(live) = &existing
            && !self.uid.is_empty()
            && !live.uid.is_empty()
            && live.uid != self.uid
        {
            return Err(CommandError::NodeObjectMismatch {
                node: self.name,
                registered_uid: live.uid.clone(),
                reported_uid: self.uid,
            });
        }
        let Some(mut info) = existing else {
            let info = NodeInfo {
                uid: self.uid,
                labels: self.labels.unwrap_or_default(),
                ready: self.state == NodeState::Ready,
                unschedulable: self.unschedulable.unwrap_or(false),
                joined_at_ms: now,
                gone_at_ms: None,
            };
            txn.state.nodes.insert(self.name.clone(), info.clone());
            txn.dirty.nodes.insert(self.name.clone());
            let ready = info.ready;
            txn.emit(EventKind::NodeJoined {
                node: self.name.clone(),
                info,
            });
            if ready {
                txn.emit(EventKind::NodeReady { node: self.name });
            }
            return Ok(Reply::NodeReported {
                changed: true,
                pins_released: 0,
                locks_released: 0,
            });
        };
        let before = info.clone();
        if !self.uid.is_empty() {
            info.uid = self.uid;
        }
        if let Some(labels) = self.labels {
            info.labels = labels;
        }
        if let Some(unschedulable) = self.unschedulable {
            info.unschedulable = unschedulable;
        }
        match self.state {
            NodeState::Ready => info.ready = true,
            NodeState::NotReady => info.ready = false,
            NodeState::Joined | NodeState::Gone => {}
        }
        if info == before {
            return Ok(Reply::NodeReported {
                changed: false,
                pins_released: 0,
                locks_released: 0,
            });
        }
        txn.state.nodes.insert(self.name.clone(), info.clone());
        txn.dirty.nodes.insert(self.name.clone());
        if info.ready != before.ready {
            let node = self.name.clone();
            txn.emit(if info.ready {
                EventKind::NodeReady { node }
            } else {
                EventKind::NodeNotReady { node }
            });
        }
        if info.labels != before.labels
            || info.unschedulable != before.unschedulable
            || info.uid != before.uid
        {
            txn.emit(EventKind::NodeUpdated {
                node: self.name,
                info,
            });
        }
        Ok(Reply::NodeReported {
            changed: true,
            pins_released: 0,
            locks_released: 0,
        })
    }
}

/// Marks `name` gone (a tombstone), releases every pin on it and every lock
/// named after it (holder and queue: those pods must be rescheduled).
fn node_gone(txn: &mut Txn<'_>, name: &str, uid: String) -> Reply {
    let now = txn.now_ms;
    let pins: Vec<PinKey> = txn
        .state
        .pins
        .on_node(name)
        .map(|(k, _)| k.clone())
        .collect();
    for key in &pins {
        txn.release_pin(key, PinReleaseReason::NodeGone);
    }
    let locks: Vec<_> = txn
        .state
        .locks
        .keys()
        .filter(|k| k.name == name)
        .cloned()
        .collect();
    let mut locks_released = 0;
    for key in &locks {
        // Deliberate bug for the checkers' "can fail" tests: the holder is
        // released before the queue is emptied, so the first waiter is
        // granted a lock on a node that is gone. Only with the `failpoints`
        // feature and FAILPOINTS=sm-node-gone-hands-over=return.
        #[cfg(feature = "failpoints")]
        if fail::eval("sm-node-gone-hands-over", |_| ()).is_some() {
            let (released, _) = txn.release_and_hand_over(key, ReleaseReason::NodeGone);
            locks_released += u32::from(released.is_some());
        }
        txn.remove_waiters(key, |_| true, WaitEndReason::NodeGone);
        let (released, _) = txn.release_and_hand_over(key, ReleaseReason::NodeGone);
        locks_released += u32::from(released.is_some());
    }
    let mut info = txn.state.nodes.remove(name).unwrap_or(NodeInfo {
        uid: String::new(),
        labels: BTreeMap::new(),
        ready: false,
        unschedulable: false,
        joined_at_ms: now,
        gone_at_ms: None,
    });
    if !uid.is_empty() {
        info.uid = uid;
    }
    info.ready = false;
    info.gone_at_ms = Some(now);
    txn.state.nodes.insert(name.to_string(), info);
    txn.dirty.nodes.insert(name.to_string());
    txn.emit(EventKind::NodeGone {
        node: name.to_string(),
    });
    Reply::NodeReported {
        changed: true,
        pins_released: pins.len() as u32,
        locks_released,
    }
}
