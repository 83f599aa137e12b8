//! `Reclaim`: make one pin carry exactly the labels given, taking its
//! exclusive labels out of every other pin of its set on its node, in one
//! entry (format 7).
//!
//! What the device plugin needs when the kubelet gave a pod other devices
//! than planned: the kubelet's accounting wins, so the pod's claim (a pin
//! labelled with its devices) must name exactly what it got, and any other
//! claim naming one of those devices is stale and loses it. Done as a
//! release and a new assignment per pin, a refusal in between (the node
//! cordoned or not ready, a racing claim) left a live pod without its claim,
//! or failed the admitting pod. Here nothing can come between, and no
//! schedulability rule applies: the kubelet has already admitted the pod.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::assign::owner_state;
use super::{CommandError, Reply};
use crate::sm::Txn;
use crate::sm::event::EventKind;
use crate::sm::types::{Pin, PinKey, PinReleaseReason};

/// Re-pin `key` on `node` with `labels`; the labels starting with
/// `exclusive_prefix` are taken out of the set's other pins on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reclaim {
    /// The pin (a device claim: set `gpu-devices`, member the pod UID).
    pub key: PinKey,
    /// The node it is on, or goes on.
    pub node: String,
    /// Its owning pod.
    pub pod_uid: String,
    /// How long it outlives its stopped pod; 0 = permanent.
    pub lifetime_ms: u64,
    /// Its labels, all of them, after the command.
    pub labels: BTreeMap<String, String>,
    /// Labels with this prefix are one pin's at a time on a node (device
    /// labels); empty = none are.
    pub exclusive_prefix: String,
}

/// What a reclaim did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reclaimed {
    /// The pin now.
    pub pin: Pin,
    /// The pin before, if it existed.
    pub previous: Option<Pin>,
    /// Other pins that lost exclusive labels, with the labels they lost
    /// (a pin left with none of them was released).
    pub taken_from: Vec<(PinKey, Vec<String>)>,
}

impl Reclaim {
    fn exclusive<'a>(&'a self, labels: impl Iterator<Item = &'a String>) -> BTreeSet<String> {
        labels
            .filter(|k| !self.exclusive_prefix.is_empty() && k.starts_with(&self.exclusive_prefix))
            .cloned()
            .collect()
    }

    /// Refuses a pin that is on another node, and a node that is gone;
    /// otherwise re-pins, taking labels from the other pins in the same
    /// entry.
    pub fn apply(self, txn: &mut Txn<'_>) -> Result<Reply, CommandError> {
        let refuse = |why: String| CommandError::NoCandidateFits {
            key: self.key.clone(),
            reasons: vec![(self.node.clone(), why)],
        };
        let previous = txn.state.pins.get(&self.key).cloned();
        if let Some(pin) = &previous
            && pin.node != self.node
        {
            return Err(refuse(format!("the pin is on node {}", pin.node)));
        }
        if txn
            .state
            .nodes
            .get(&self.node)
            .is_some_and(|n| n.gone_at_ms.is_some())
        {
            return Err(refuse("the node is gone".into()));
        }
        let wanted = self.exclusive(self.labels.keys());
        // A deliberate bug for the checkers' "can fail" tests: leave other
        // pins their labels. Only with the `failpoints` feature and
        // FAILPOINTS=sm-reclaim-keeps-others=return.
        #[cfg(feature = "failpoints")]
        let wanted = if fail::eval("sm-reclaim-keeps-others", |_| ()).is_some() {
            BTreeSet::new()
        } else {
            wanted
        };
        let losers: Vec<(PinKey, Pin, Vec<String>)> = txn
            .state
            .pins
            .on_node(&self.node)
            .filter(|(key, _)| key.set == self.key.set && **key != self.key)
            .filter_map(|(key, pin)| {
                let lost: Vec<String> = pin
                    .labels
                    .iter()
                    .map(|(k, _)| k)
                    .filter(|k| wanted.contains(*k))
                    .cloned()
                    .collect();
                (!lost.is_empty()).then(|| (key.clone(), pin.clone(), lost))
            })
            .collect();
        let now = txn.now_ms;
        let mut taken_from = Vec::new();
        for (key, pin, lost) in losers {
            let reason = format!("pin {} on node {} took {lost:?}", self.key, self.node);
            txn.release_pin(&key, PinReleaseReason::Released { reason });
            let kept: BTreeMap<String, String> = pin
                .labels
                .iter()
                .filter(|(k, _)| !lost.contains(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if !self.exclusive(kept.keys()).is_empty() {
                let remade = Pin {
                    labels: kept.into(),
                    pinned_at_ms: now,
                    ..pin
                };
                txn.state.pins.insert(key.clone(), remade.clone());
                txn.dirty.pins.insert(key.clone());
                txn.emit(EventKind::PinAssigned {
                    key: key.clone(),
                    pin: remade,
                });
            }
            taken_from.push((key, lost));
        }
        let unchanged = previous.as_ref().is_some_and(|pin| {
            pin.pod_uid == self.pod_uid && pin.labels.iter().eq(self.labels.iter())
        });
        let pin = if unchanged {
            previous.clone().expect("checked above")
        } else {
            if previous.is_some() {
                txn.release_pin(
                    &self.key,
                    PinReleaseReason::Released {
                        reason: "made again with the labels the kubelet's choice gave it".into(),
                    },
                );
            }
            let pin = Pin {
                node: self.node.clone(),
                pinned_at_ms: now,
                owner: owner_state(&txn.state.pods, &self.pod_uid),
                pod_uid: self.pod_uid.clone(),
                labels: self.labels.clone().into(),
                lifetime_ms: self.lifetime_ms,
                last_running_at_ms: now,
            };
            txn.state.pins.insert(self.key.clone(), pin.clone());
            txn.dirty.pins.insert(self.key.clone());
            txn.emit(EventKind::PinAssigned {
                key: self.key.clone(),
                pin: pin.clone(),
            });
            pin
        };
        Ok(Reply::Reclaimed(Box::new(Reclaimed {
            pin,
            previous,
            taken_from,
        })))
    }
}
