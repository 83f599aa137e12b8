//! `ForNodeObjects`: an acquire, assignment or reclaim taken for the node
//! objects the caller saw (format 10), refused if Tether has another
//! object registered under one of their names.
//!
//! A node is its UID: a name deleted and re-created (a cloud replacement, a
//! re-imaged machine that keeps its hostname) is another node, and a `Gone`
//! report about the old object ends everything under the name
//! ([`super::report_node`]). Without the UID, a scheduler that bound pods
//! to the new machine while the bridge was away took claims and the bind
//! lock under the name the old object still held in Tether; when the bridge
//! came back and reported the old object gone, those ended with it, a
//! holder in the middle of Allocate included. With it, what is taken under
//! a name is always taken for the object registered there (or for one
//! Tether has not heard of yet), so a report about one object ends only
//! what was taken for that object:
//!
//! - a live node registered under the name with another UID: refused
//!   ([`CommandError::NodeObjectMismatch`]); the caller plans again once
//!   the bridge has reported the old object gone and the new one joined
//!   (the state machine cannot tell which of two UIDs is the newer);
//! - the name's tombstone carries the caller's UID: that object is gone,
//!   refused ([`CommandError::NodeObjectGone`]);
//! - no node under the name, or a tombstone of another object: taken (the
//!   bridge reports the new object when it catches up; a late `Gone` for
//!   the tombstoned object changes nothing).
//!
//! A node Tether never registered has no object to compare: a `Gone`
//! report for such a name still ends everything under it, as before.

use serde::{Deserialize, Serialize};

use super::{Acquire, Assign, CommandError, Reclaim, Reply};
use crate::sm::Txn;

/// The log format from which a command can name the node objects it is
/// taken for (see the module doc).
pub const NODE_OBJECT_FORMAT_VERSION: u16 = 10;

/// A node as the caller saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenNode {
    /// The node's name.
    pub name: String,
    /// The UID of the node object the caller saw under the name.
    pub uid: String,
}

/// The commands that take something on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeTaking {
    /// A node's lock (its name is the lock's name).
    Acquire(Acquire),
    /// A pin on one of the candidates.
    Assign(Assign),
    /// A pin on one node.
    Reclaim(Reclaim),
}

impl NodeTaking {
    /// The command without the check.
    pub fn into_command(self) -> super::Command {
        match self {
            NodeTaking::Acquire(acquire) => super::Command::Acquire(acquire),
            NodeTaking::Assign(assign) => super::Command::Assign(assign),
            NodeTaking::Reclaim(reclaim) => super::Command::Reclaim(reclaim),
        }
    }
}

/// Apply `command` only if every node in `nodes` is the object the caller
/// saw, or one Tether has not registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForNodeObjects {
    /// The nodes the command takes something on, as the caller saw them.
    pub nodes: Vec<SeenNode>,
    /// What to take.
    pub command: NodeTaking,
}

impl ForNodeObjects {
    /// Checks the nodes, then applies the command; a refusal changes
    /// nothing.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        // Deliberate bug for the property test's "can fail" test: the
        // objects are not compared, so a claim or hold taken for a new
        // object sits under the old one's registration and ends with its
        // `Gone`. Only with the `failpoints` feature and
        // FAILPOINTS=sm-node-object-unchecked=return.
        #[cfg(feature = "failpoints")]
        let unchecked = fail::eval("sm-node-object-unchecked", |_| ()).is_some();
        #[cfg(not(feature = "failpoints"))]
        let unchecked = false;
        if !unchecked {
            for seen in &self.nodes {
                check(txn, seen)?;
            }
        }
        match self.command {
            NodeTaking::Acquire(acquire) => acquire.apply(txn),
            NodeTaking::Assign(assign) => assign.apply(txn),
            NodeTaking::Reclaim(reclaim) => reclaim.apply(txn),
        }
    }
}

/// Whether `seen` may be taken on: see the module doc.
fn check(txn: &Txn<'_>, seen: &SeenNode) -> Result<(), CommandError> {
    let Some(node) = txn.state.nodes.get(&seen.name) else {
        return Ok(());
    };
    if seen.uid.is_empty() || node.uid.is_empty() {
        return Ok(());
    }
    match node.gone_at_ms {
        None if node.uid != seen.uid => Err(CommandError::NodeObjectMismatch {
            node: seen.name.clone(),
            registered_uid: node.uid.clone(),
            reported_uid: seen.uid.clone(),
        }),
        Some(_) if node.uid == seen.uid => Err(CommandError::NodeObjectGone {
            node: seen.name.clone(),
            uid: seen.uid.clone(),
        }),
        _ => Ok(()),
    }
}
