//! `Assign`: pin a workload member to a node, atomically checking affinity
//! against every pin already applied.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::affinity::{Affinity, choose};
use crate::sm::event::EventKind;
use crate::sm::types::{OwnerState, Pin, PinKey, PodPhase};

/// Pin `key` to one of `candidates`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assign {
    /// The pin.
    pub key: PinKey,
    /// Nodes to choose from, in the caller's order of preference.
    pub candidates: Vec<String>,
    /// The owning pod (empty = none yet).
    pub pod_uid: String,
    /// How long the pin outlives its stopped pod; 0 = permanent.
    pub lifetime_ms: u64,
    /// Labels of the new pin (what other pins' affinity terms match).
    pub labels: BTreeMap<String, String>,
    /// Rules against existing pins.
    pub affinity: Affinity,
}

/// The owner state a pin starts with, from what is known of its pod.
pub(crate) fn owner_state(pods: &BTreeMap<String, PodPhase>, pod_uid: &str) -> OwnerState {
    match pods.get(pod_uid) {
        Some(PodPhase::Starting) => OwnerState::Starting,
        Some(PodPhase::Running) => OwnerState::Running,
        _ => OwnerState::Unknown,
    }
}

impl Assign {
    /// Returns the existing pin if there is one (taking the new pod as its
    /// owner: permanent pins survive pod restarts); otherwise picks a node.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let now = txn.now_ms;
        if let Some(pin) = txn.state.pins.get(&self.key) {
            let mut pin = pin.clone();
            if !self.pod_uid.is_empty() && pin.pod_uid != self.pod_uid {
                pin.owner = owner_state(&txn.state.pods, &self.pod_uid);
                pin.pod_uid = self.pod_uid.clone();
                pin.last_running_at_ms = now;
                txn.state.pins.insert(self.key.clone(), pin.clone());
                txn.dirty.pins.insert(self.key.clone());
                txn.emit(EventKind::PinOwnerChanged {
                    key: self.key,
                    pod_uid: self.pod_uid,
                });
            }
            return Ok(Reply::Pinned {
                pin,
                created: false,
            });
        }
        let node = choose(
            txn.state,
            &self.key,
            &self.candidates,
            &self.labels,
            &self.affinity,
        )
        .map_err(|reasons| CommandError::NoCandidateFits {
            key: self.key.clone(),
            reasons,
        })?;
        let pin = Pin {
            node,
            pinned_at_ms: now,
            owner: owner_state(&txn.state.pods, &self.pod_uid),
            pod_uid: self.pod_uid,
            labels: self.labels.into(),
            lifetime_ms: self.lifetime_ms,
            last_running_at_ms: now,
        };
        txn.state.pins.insert(self.key.clone(), pin.clone());
        txn.dirty.pins.insert(self.key.clone());
        txn.emit(EventKind::PinAssigned {
            key: self.key,
            pin: pin.clone(),
        });
        Ok(Reply::Pinned { pin, created: true })
    }
}
