//! `Audit`: an administrative action recorded in the event history with the
//! identity that asked for it (membership changes, leader transfers,
//! snapshot exports). It changes no lock, pin or lease.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::{EventKind, Txn};

/// Record `action` by `identity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// Who asked: the certificate subject, `token:<name>` or `anonymous`.
    pub identity: String,
    /// What, e.g. `ChangeMembership`.
    pub action: String,
    /// The request's arguments, for people.
    pub detail: String,
}

impl Audit {
    /// Emits one `AdminAction` event; never refused.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        txn.emit(EventKind::AdminAction {
            identity: self.identity,
            action: self.action,
            detail: self.detail,
        });
        Ok(Reply::Empty)
    }
}
