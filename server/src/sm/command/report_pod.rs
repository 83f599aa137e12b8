//! `ReportPod`: the bridge reports a pod's phase. Running pauses the lifetime
//! countdown of its pins; terminal or gone revokes its pod lease (holds and
//! waits) and starts that countdown.

use serde::{Deserialize, Serialize};

use super::revoke_pod::revoke_pod;
use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{OwnerState, PodPhase};

/// Report the phase of pod `pod_uid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportPod {
    /// The pod.
    pub pod_uid: String,
    /// Its phase.
    pub phase: PodPhase,
}

impl ReportPod {
    /// Idempotent: a report that changes nothing emits nothing.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let uid = self.pod_uid;
        let (owner, alive) = match self.phase {
            PodPhase::Starting => (OwnerState::Starting, true),
            PodPhase::Running => (OwnerState::Running, true),
            PodPhase::Terminal | PodPhase::Gone => (OwnerState::Stopped, false),
        };
        let before = txn.state.pods.get(&uid).copied();
        if alive {
            txn.state.pods.insert(uid.clone(), self.phase);
        } else {
            txn.state.pods.remove(&uid);
        }
        let changed_pod = before != (alive.then_some(self.phase));
        if changed_pod {
            txn.dirty.pods.insert(uid.clone());
        }
        let changed_pins = txn.set_pin_owner_state(&uid, owner);
        let reply = if alive {
            Reply::Revoked {
                released: vec![],
                dequeued: vec![],
                granted: vec![],
            }
        } else {
            let reason = if self.phase == PodPhase::Gone {
                "pod gone"
            } else {
                "pod terminal"
            };
            revoke_pod(txn, &uid, reason)
        };
        if changed_pod || changed_pins {
            txn.emit(EventKind::PodReported {
                pod_uid: uid,
                phase: self.phase,
            });
        }
        Ok(reply)
    }
}
