//! `ReleasePin`: a client ends a pin. `ReleasePinIf` (format 9): only
//! while the pin carries the labels the caller names, so that a caller
//! ends the pin it made and never one made again since by someone else
//! (a later bind attempt of the same pod claiming its devices).

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::types::{Labels, PinKey, PinReleaseReason};

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

/// Release pin `key` if it carries every one of `labels`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasePinIf {
    /// The pin.
    pub key: PinKey,
    /// Why (kept in the event).
    pub reason: String,
    /// Labels (name and value) the pin must carry to be released.
    pub labels: Labels,
}

impl ReleasePinIf {
    /// A pin that does not exist answers `None`, as [`ReleasePin`]; one
    /// without the labels is refused ([`CommandError::PinLabelsDiffer`])
    /// and kept.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let Some(pin) = txn.state.pins.get(&self.key) else {
            return Ok(Reply::PinReleased { pin: None });
        };
        let carries = self
            .labels
            .iter()
            .all(|(name, value)| pin.labels.get(name) == Some(value));
        // A deliberate bug for the checkers' "can fail" tests: release
        // whatever the pin carries. Only with the `failpoints` feature and
        // FAILPOINTS=sm-release-pin-ignores-labels=return.
        #[cfg(feature = "failpoints")]
        let carries = carries || fail::eval("sm-release-pin-ignores-labels", |_| ()).is_some();
        if !carries {
            return Err(CommandError::PinLabelsDiffer {
                key: self.key,
                expected: self.labels,
                actual: pin.labels.clone(),
            });
        }
        let pin = txn.release_pin(
            &self.key,
            PinReleaseReason::Released {
                reason: self.reason,
            },
        );
        Ok(Reply::PinReleased { pin })
    }
}
