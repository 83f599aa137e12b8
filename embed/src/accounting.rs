//! Device accounting in Tether, so that no two live pods on a node are ever
//! planned the same device, whichever extender replica plans them.
//!
//! Each pod that holds devices on a node has one pin: key `{gpu-devices,
//! <pod uid>}`, pinned to the node, owned by the pod, with one label
//! `devices.tether.io/<device id>` per device. A claim is one `Assign`
//! whose required anti-affinity terms (one per device: "no pin with this
//! device's label on this node") the state machine checks against every
//! applied pin in the same entry, so two claims racing for a device can
//! never both win. The pin ends with its pod, as pins do: when the bridge
//! reports the pod stopped or deleted, the pin expires after its lifetime
//! (the shortest there is, see [`DEFAULT_LIFETIME`]); when the node is gone,
//! with the node. A claim that fails after the fact (the bind failed) is
//! released at once.
//!
//! A claim whose pod Tether knows has stopped (its owner state is
//! `OWNER_STOPPED`: the bridge reported it terminal or its object deleted,
//! both only once the kubelet has stopped its containers) is free for
//! planning ([`DeviceLedger::live_claims_by_node`]): it ends at the leader's
//! next sweep, and a bind that meets it waits for that.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tether_client::proto::{
    Affinity, AffinityTerm, LabelRequirement, LabelSelector, OwnerState, POD_NAME_LABEL,
    POD_NAMESPACE_LABEL, Pin, PinKey,
};
use tether_client::{Client, Error};

/// The pin set device claims live in.
pub const DEVICE_SET: &str = "gpu-devices";

/// A claim's pin carries one label `<this><device id>` per device.
pub const DEVICE_LABEL_PREFIX: &str = "devices.tether.io/";

/// The label naming the bind attempt a claim was made by: the token of
/// the node lock the attempt held (tokens rise per lock, so a later
/// attempt's is higher). A bind attempt ends only a claim carrying its own
/// token ([`DeviceLedger::release_attempt`]), so an attempt kube-scheduler
/// gave up on cannot end the claim a later attempt of the same pod bound
/// the pod with (format 9).
pub const BIND_TOKEN_LABEL: &str = "bind.tether.io/lock-token";

/// How long a claim outlives its stopped pod: the shortest lifetime there
/// is (0 would make the pin permanent), so the claim ends at the sweep the
/// leader makes as soon as it applies the bridge's report (at the latest
/// one `--sweep-interval`, 100 ms by default, later). Nothing is gained by waiting longer: the bridge reports a pod
/// stopped only once the kubelet has stopped its containers (its phase is
/// terminal, or its object is deleted, which the kubelet does last), and
/// every moment a freed device stays claimed is a moment a pending pod is
/// refused it (issue 49: a second here cost a pending pod five minutes).
pub const DEFAULT_LIFETIME: Duration = Duration::from_millis(1);

/// Attempts of [`DeviceLedger::correct`] before it gives up.
const CORRECT_ATTEMPTS: usize = 3;

/// The topology key meaning "the node itself".
const HOSTNAME: &str = "kubernetes.io/hostname";

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The devices are the pod's now (or already were, on this node).
    Held(Vec<String>),
    /// The pod already holds devices on another node (an earlier bind that
    /// did not finish): release them before claiming here.
    OnOtherNode {
        /// Where.
        node: String,
        /// Which.
        devices: Vec<String>,
    },
    /// Another pod took one of the devices since they were read.
    Taken(String),
    /// The pod already claims devices on this node, by another bind
    /// attempt than the one asking ([`BIND_TOKEN_LABEL`]; `None` when the
    /// claim names no attempt).
    OtherAttempt {
        /// That attempt's lock token.
        token: Option<u64>,
        /// The devices it claims.
        devices: Vec<String>,
    },
}

/// The pod a claim is for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimOwner<'a> {
    /// Its UID (the claim's owner).
    pub uid: &'a str,
    /// Its namespace.
    pub namespace: &'a str,
    /// Its name.
    pub name: &'a str,
}

/// Who claims a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedBy {
    /// The pod's UID.
    pub pod_uid: String,
    /// Tether knows the pod has stopped: the claim ends at the next sweep.
    pub owner_stopped: bool,
    /// The lock token of the bind attempt that made the claim
    /// ([`BIND_TOKEN_LABEL`]), if it names one.
    pub attempt: Option<u64>,
}

/// The lock token of the bind attempt that made claim `pin`, if it names
/// one.
pub fn attempt_of(pin: &Pin) -> Option<u64> {
    pin.labels.get(BIND_TOKEN_LABEL)?.parse().ok()
}

/// Whether the pod that owns `pin` is known to have stopped.
pub fn owner_stopped(pin: &Pin) -> bool {
    pin.owner == OwnerState::OwnerStopped as i32
}

/// Device claims over a Tether client.
#[derive(Clone)]
pub struct DeviceLedger {
    client: Client,
    lifetime: Duration,
    /// The pin set of the claims ([`DEVICE_SET`] unless
    /// [`DeviceLedger::in_set`] says another: one set per device kind,
    /// [`crate::kind`]).
    set: String,
}

/// The devices a claim pin names, sorted.
pub fn devices_of(pin: &Pin) -> Vec<String> {
    let mut devices: Vec<String> = pin
        .labels
        .keys()
        .filter_map(|k| k.strip_prefix(DEVICE_LABEL_PREFIX))
        .map(str::to_string)
        .collect();
    devices.sort();
    devices
}

fn key(set: &str, pod_uid: &str) -> PinKey {
    PinKey {
        set: set.into(),
        member: pod_uid.into(),
    }
}

/// Whether `value` can be a pin label value (at most 63 letters, digits,
/// `-`, `_` or `.`).
fn label_value_ok(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The labels and anti-affinity terms of `pod`'s claim on `devices`. The
/// pod's namespace and name go along when they fit a label, so the bridge
/// can confirm the pod gone even if it never saw it.
fn claim_request(pod: &ClaimOwner<'_>, devices: &[String]) -> (HashMap<String, String>, Affinity) {
    let mut labels: HashMap<String, String> = devices
        .iter()
        .map(|d| (format!("{DEVICE_LABEL_PREFIX}{d}"), "held".to_string()))
        .collect();
    if label_value_ok(pod.namespace) && label_value_ok(pod.name) {
        labels.insert(POD_NAMESPACE_LABEL.into(), pod.namespace.into());
        labels.insert(POD_NAME_LABEL.into(), pod.name.into());
    }
    let required_anti = devices
        .iter()
        .map(|d| AffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: HashMap::new(),
                match_expressions: vec![LabelRequirement {
                    key: format!("{DEVICE_LABEL_PREFIX}{d}"),
                    operator: "Exists".into(),
                    values: Vec::new(),
                }],
            }),
            topology_key: HOSTNAME.into(),
        })
        .collect();
    (
        labels,
        Affinity {
            required_anti,
            ..Affinity::default()
        },
    )
}

impl DeviceLedger {
    /// A ledger whose claims outlive their pods by `lifetime`.
    pub fn new(client: Client, lifetime: Duration) -> Self {
        Self {
            client,
            lifetime,
            set: DEVICE_SET.into(),
        }
    }

    /// This ledger over the claims in `set` (a device kind's,
    /// [`crate::kind::DeviceKind::claim_set`]).
    pub fn in_set(mut self, set: &str) -> Self {
        self.set = set.into();
        self
    }

    /// The pin set of the claims.
    pub fn set(&self) -> &str {
        &self.set
    }

    /// Device id -> the pod UID that holds it, on `node`.
    pub async fn in_use(&self, node: &str) -> Result<BTreeMap<String, String>, Error> {
        Ok(self
            .claims_on(node)
            .await?
            .into_iter()
            .map(|(device, by)| (device, by.pod_uid))
            .collect())
    }

    /// Device id -> who claims it, on `node`, stopped owners included.
    pub async fn claims_on(&self, node: &str) -> Result<BTreeMap<String, ClaimedBy>, Error> {
        let pins = self.client.list_pins(&self.set, node).await?;
        Ok(pins
            .iter()
            .flat_map(|pin| {
                devices_of(pin).into_iter().map(|d| {
                    (
                        d,
                        ClaimedBy {
                            pod_uid: pin.pod_uid.clone(),
                            owner_stopped: owner_stopped(pin),
                            attempt: attempt_of(pin),
                        },
                    )
                })
            })
            .collect())
    }

    /// Every node's claims of pods not known to have stopped: node ->
    /// device -> pod uid. A stopped pod's claim is left out: its devices
    /// are free for planning (the claim ends at the next sweep).
    pub async fn live_claims_by_node(
        &self,
    ) -> Result<BTreeMap<String, BTreeMap<String, String>>, Error> {
        let pins = self.client.list_pins(&self.set, "").await?;
        let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for pin in pins.iter().filter(|pin| !owner_stopped(pin)) {
            let node = out.entry(pin.node.clone()).or_default();
            for device in devices_of(pin) {
                node.insert(device, pin.pod_uid.clone());
            }
        }
        Ok(out)
    }

    /// The pod's claim, if it has one: node and devices.
    pub async fn claim_of(&self, pod_uid: &str) -> Result<Option<(String, Vec<String>)>, Error> {
        Ok(self
            .client
            .get_pin(&key(&self.set, pod_uid))
            .await?
            .map(|pin| (pin.node.clone(), devices_of(&pin))))
    }

    /// Claims `devices` on `node` for the pod, atomically.
    pub async fn claim(
        &self,
        node: &str,
        pod: ClaimOwner<'_>,
        devices: &[String],
    ) -> Result<Claim, Error> {
        self.claim_for(node, pod, devices, None, "").await
    }

    /// Claims `devices` on `node` for the pod, atomically, for the bind
    /// attempt that holds the node's lock with token `attempt`
    /// ([`BIND_TOKEN_LABEL`]). A claim the pod already has on the node by
    /// another attempt is answered [`Claim::OtherAttempt`] and left as it
    /// is. A non-empty `node_uid` is the node object the claim is taken
    /// for: refused ([`Error::FailedPrecondition`]) while Tether has another
    /// object registered under the name ([`crate::node_objects`]).
    pub async fn claim_for(
        &self,
        node: &str,
        pod: ClaimOwner<'_>,
        devices: &[String],
        attempt: Option<u64>,
        node_uid: &str,
    ) -> Result<Claim, Error> {
        let pod_uid = pod.uid;
        let (mut labels, affinity) = claim_request(&pod, devices);
        if let Some(token) = attempt {
            labels.insert(BIND_TOKEN_LABEL.into(), token.to_string());
        }
        let seen = if node_uid.is_empty() {
            HashMap::new()
        } else {
            HashMap::from([(node.to_string(), node_uid.to_string())])
        };
        match self
            .client
            .assign_for_node_objects(
                &key(&self.set, pod_uid),
                vec![node.to_string()],
                seen,
                pod_uid,
                self.lifetime,
                labels,
                affinity,
            )
            .await
        {
            Ok(reply) => {
                let pin = reply.pin.unwrap_or_default();
                if pin.node != node {
                    return Ok(Claim::OnOtherNode {
                        node: pin.node.clone(),
                        devices: devices_of(&pin),
                    });
                }
                if attempt.is_some() && attempt_of(&pin) != attempt {
                    return Ok(Claim::OtherAttempt {
                        token: attempt_of(&pin),
                        devices: devices_of(&pin),
                    });
                }
                Ok(Claim::Held(devices_of(&pin)))
            }
            Err(Error::ResourceExhausted(why)) if why.contains("anti-affinity") => {
                Ok(Claim::Taken(why))
            }
            Err(err) => Err(err),
        }
    }

    /// Ends the pod's claim (its bind failed, or it moved).
    pub async fn release(&self, pod_uid: &str, reason: &str) -> Result<(), Error> {
        self.client
            .release_pin(&key(&self.set, pod_uid), reason)
            .await?;
        Ok(())
    }

    /// Ends the pod's claim if bind attempt `attempt` made it (it carries
    /// that [`BIND_TOKEN_LABEL`]): false, and the claim kept, when another
    /// attempt made it again since. No claim at all is true.
    pub async fn release_attempt(
        &self,
        pod_uid: &str,
        attempt: u64,
        reason: &str,
    ) -> Result<bool, Error> {
        let labels = HashMap::from([(BIND_TOKEN_LABEL.to_string(), attempt.to_string())]);
        match self
            .client
            .release_pin_if(&key(&self.set, pod_uid), reason, labels)
            .await
        {
            Ok(_) => Ok(true),
            Err(Error::FailedPrecondition(why)) if why.contains("made again since") => Ok(false),
            // A member still reads only format 8 (an upgrade): as before.
            Err(Error::FailedPrecondition(why)) if why.contains("format") => {
                self.release(pod_uid, reason).await?;
                Ok(true)
            }
            Err(err) => Err(err),
        }
    }

    /// Makes the pod's claim on `node` name exactly `devices`: what the
    /// kubelet gave it, which wins over what was planned. The kubelet
    /// hands out only devices no admitted pod of its own accounting has, so
    /// another claim naming one of them is stale (its pod was never
    /// admitted with it, or has ended): that device is taken out of it.
    ///
    /// One command in Tether (`Reclaim`, format 7): nothing can come
    /// between the stale claims losing their devices and the pod's claim
    /// being made again, and no schedulability rule applies (the kubelet
    /// has admitted the pod; a cordoned or not-ready node must not fail it).
    /// While a member still reads only format 6 (an upgrade), it falls back
    /// to ending and making claims one by one, under the node's lock.
    pub async fn correct(
        &self,
        node: &str,
        pod: ClaimOwner<'_>,
        devices: &[String],
    ) -> Result<Correction, Error> {
        let mut sorted = devices.to_vec();
        sorted.sort();
        let (labels, _) = claim_request(&pod, &sorted);
        let reclaimed = self
            .client
            .reclaim(
                &key(&self.set, pod.uid),
                node,
                pod.uid,
                self.lifetime,
                labels,
                DEVICE_LABEL_PREFIX,
            )
            .await;
        let done = match reclaimed {
            Ok(done) => done,
            Err(Error::FailedPrecondition(why)) if why.contains("format") => {
                tracing::warn!(%why, "a replica reads only format 6: correcting the claim in steps");
                return self.correct_in_steps(node, pod, devices).await;
            }
            Err(Error::ResourceExhausted(why)) if why.contains("the pin is on node") => {
                return Err(Error::FailedPrecondition(format!(
                    "pod uid {} has a device claim on another node: {why}",
                    pod.uid
                )));
            }
            Err(err) => return Err(err),
        };
        let planned = done.previous.as_ref().map(devices_of).unwrap_or_default();
        let taken_from = done
            .taken
            .iter()
            .map(|taken| {
                let owner = taken.key.as_ref().map_or("", |k| k.member.as_str());
                let lost = taken
                    .labels
                    .iter()
                    .filter_map(|l| l.strip_prefix(DEVICE_LABEL_PREFIX))
                    .map(str::to_string)
                    .collect();
                (owner.to_string(), lost)
            })
            .collect();
        Ok(Correction {
            changed: planned != sorted,
            planned,
            taken_from,
        })
    }

    /// [`DeviceLedger::correct`] as builds before format 7 did it: a claim
    /// is ended and made again, so call it only while the pod holds the
    /// node's lock, as the device plugin's `Allocate` does (claims on a node
    /// are made under that lock, so none can slip in between).
    async fn correct_in_steps(
        &self,
        node: &str,
        pod: ClaimOwner<'_>,
        devices: &[String],
    ) -> Result<Correction, Error> {
        let mut first_planned = None;
        let mut last_loss = String::new();
        // A claim read from a leader that had not yet applied it can be
        // missed once; the made-again claim then loses to it and the next
        // attempt sees it.
        for _ in 0..CORRECT_ATTEMPTS {
            match self.correct_once(node, pod, devices).await? {
                Ok(mut correction) => {
                    if let Some(planned) = first_planned {
                        correction.planned = planned;
                    }
                    return Ok(correction);
                }
                Err((planned, why)) => {
                    first_planned.get_or_insert(planned);
                    last_loss = why;
                }
            }
        }
        Err(Error::FailedPrecondition(format!(
            "the devices the kubelet gave pod uid {} are still claimed after {CORRECT_ATTEMPTS} \
             attempts: {last_loss}",
            pod.uid
        )))
    }

    /// One attempt of [`DeviceLedger::correct_in_steps`]: the correction, or the
    /// devices the claim named and why a claim was lost.
    async fn correct_once(
        &self,
        node: &str,
        pod: ClaimOwner<'_>,
        devices: &[String],
    ) -> Result<Result<Correction, (Vec<String>, String)>, Error> {
        let wanted: BTreeSet<&String> = devices.iter().collect();
        let mut correction = Correction::default();
        for pin in self.client.list_pins(&self.set, node).await? {
            let owner = pin.pod_uid.as_str();
            let held = devices_of(&pin);
            if owner == pod.uid {
                correction.planned = held;
                continue;
            }
            let (lost, kept): (Vec<String>, Vec<String>) =
                held.into_iter().partition(|d| wanted.contains(d));
            if lost.is_empty() {
                continue;
            }
            let reason = format!(
                "the kubelet gave {lost:?} to pod uid {}: this claim was stale",
                pod.uid
            );
            self.client
                .release_pin(&key(&self.set, owner), &reason)
                .await?;
            if !kept.is_empty() {
                let label = |name: &str| pin.labels.get(name).map_or("", String::as_str);
                let other = ClaimOwner {
                    uid: owner,
                    namespace: label(POD_NAMESPACE_LABEL),
                    name: label(POD_NAME_LABEL),
                };
                self.claim(node, other, &kept).await?;
            }
            correction.taken_from.push((owner.to_string(), lost));
        }
        let mut sorted = devices.to_vec();
        sorted.sort();
        if correction.planned == sorted {
            return Ok(Ok(correction));
        }
        if !correction.planned.is_empty() {
            self.client
                .release_pin(
                    &key(&self.set, pod.uid),
                    &format!("the kubelet gave the pod {sorted:?}; the claim is made again"),
                )
                .await?;
        }
        match self.claim(node, pod, &sorted).await? {
            // `claim` names no attempt, so it never answers `OtherAttempt`.
            Claim::Held(_) | Claim::OtherAttempt { .. } => {
                correction.changed = true;
                Ok(Ok(correction))
            }
            Claim::OnOtherNode { node: other, .. } => Err(Error::FailedPrecondition(format!(
                "pod uid {} has a device claim on node {other}, not {node}",
                pod.uid
            ))),
            Claim::Taken(why) => Ok(Err((correction.planned, why))),
        }
    }
}

/// What [`DeviceLedger::correct`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Correction {
    /// The devices the pod's claim named before (sorted; none if it had
    /// no claim on the node).
    pub planned: Vec<String>,
    /// Whether the pod's claim was made again with other devices.
    pub changed: bool,
    /// Devices taken out of other pods' stale claims: pod uid, devices.
    pub taken_from: Vec<(String, Vec<String>)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_labels_each_device_and_forbids_it_to_every_other_pin_on_the_node() {
        let devices = vec!["gpu1".to_string(), "gpu4".to_string()];
        let owner = ClaimOwner {
            uid: "u",
            namespace: "ml",
            name: "train-0",
        };
        let (labels, affinity) = claim_request(&owner, &devices);
        assert_eq!(labels.len(), 4);
        assert_eq!(labels[POD_NAME_LABEL], "train-0");
        assert_eq!(labels["devices.tether.io/gpu4"], "held");
        assert_eq!(affinity.required_anti.len(), 2);
        let term = &affinity.required_anti[0];
        assert_eq!(term.topology_key, "kubernetes.io/hostname");
        let selector = term.label_selector.as_ref().unwrap();
        assert_eq!(selector.match_expressions[0].key, "devices.tether.io/gpu1");
        assert_eq!(selector.match_expressions[0].operator, "Exists");
        let pin = Pin {
            labels: labels.clone(),
            ..Pin::default()
        };
        assert_eq!(devices_of(&pin), devices);
        // A name too long for a label stays out; the claim still works.
        let long = "p".repeat(64);
        let (labels, _) = claim_request(
            &ClaimOwner {
                name: &long,
                ..owner
            },
            &devices,
        );
        assert_eq!(labels.len(), 2);
    }
}
