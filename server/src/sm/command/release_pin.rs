//! `ReleasePin`: a client ends a pin.

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{PinKey, PinReleaseReason};

/// Release pin `key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasePin {
    /// The pin.
    pub key: PinKey,
    /// Why (kept in the event).
    pub reason: String,
}

impl ReleasePin {
    /// Idempotent: releasing a pin that does not exist answers `None`.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let pin = txn.release_pin(
            &self.key,
            PinReleaseReason::Released {
                reason: self.reason,
            },
        );
        Ok(Reply::PinReleased { pin })
    }
}
