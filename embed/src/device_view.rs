//! The extender's watched copy of the device pins its filter reads: every
//! node's device claims (set [`DEVICE_SET`]) and published inventory (set
//! [`INVENTORY_SET`]), kept current from Tether's event stream. A further
//! device kind ([`crate::kind`]) has a copy of its own, of its own sets.
//!
//! Why: kube-scheduler calls the filter for one pod at a time and waits for
//! the answer before it schedules the next, so the filter's time is added to
//! every pod's. Listing every claim and every inventory from Tether on each
//! call cost 11 ms a pod at 200 nodes × 8 GPUs (1,600 calls, mean 11.0 ms,
//! `tether-bind-bench`, 2026-12-05, build of af890a2), three quarters of the
//! burst's time, and it grows with the cluster. From this copy a call took
//! 0.39 ms (build of 4caaf85, same bench).
//!
//! How it stays current, as the bridge follows Tether: the watch is opened
//! first, then both sets are listed, so no change between the two is
//! missed. An event that carries all the copy needs is applied as it comes
//! ([`Pins::apply_event`]): a pin made or corrected (`PinAssigned`, which
//! carries the whole pin, its owner state and labels), a pin ended
//! (`PinReleased`: which pin, on which node) and a pod reported or revoked
//! (`PodReported`, `PodRevoked`: its claims' owners turn stopped or live
//! again; the filter reads only that of the owner). For the others the copy
//! re-reads the node's pins of the set the event touched ([`touched`], a
//! pure function): a claim taken over by a recreated pod (`PinOwnerChanged`,
//! by the node the copy has for it), and a `PinAssigned` from a replica of
//! a build before its events carried the pin (by its node). Re-reading
//! those keeps the copy to what a list answers; applying the others saves
//! the reads a pod cost (one at its bind, two at its end,
//! `tether-bind-bench`, 2026-12-07) and tells the filter of freed devices a
//! read sooner. A compacted watch position, a failed
//! read or an event naming a pin the copy does not know starts over with a
//! full list; so does [`RESYNC`] passing, which bounds how long a change no
//! event names would stay unseen (none is known: every write to these pins
//! emits one of the events above).
//!
//! A pod's object deleted from the API server counts its claims stopped
//! at once ([`DeviceView::pod_deleted`], fed by the extender's own pod
//! watch): kube-scheduler frees the pod's devices in its cache from that
//! delete event and asks the filter about a waiting pod right away, before
//! the bridge's report has reached Tether and ended the claims. Read from
//! Tether alone, the copy lagged the scheduler by a commit and a re-read,
//! and the filter refused pods the scheduler saw fit (issue 52's churn:
//! the first new pod was refused 17 times in 620 ms). The bind still waits
//! for the claims' end in Tether before it claims the devices.
//!
//! Each node's live claims and healthy published devices are worked out
//! when its pins change, not at each filter call, and a filter call reads
//! them under the copy's lock ([`DeviceView::read`]), copying nothing.
//!
//! The copy may lag a change by the time its event takes to arrive and its
//! node to be re-read (milliseconds: one commit, one watch hop, and one
//! read only for an owner change), and by at most [`RESYNC`] a change no
//! event names. The filter only
//! steers, and the bind's first plan of devices, made from the copy too,
//! is decided by Tether: a claim refuses a device another claim holds, and
//! the bind then plans again from a read of the node's claims
//! (`tests/stale_plan.rs`). A pod the filter refused is
//! asked about again when this same copy shows devices freed on a node it
//! was refused on ([`crate::requeue`]), so the filter it asks for sees them
//! freed too. Until the copy has its first list, and while it starts over,
//! [`DeviceView::read`] says so and the filter reads Tether directly.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use tether_client::proto as pb;
use tether_client::{Client, WatchUpdate};

use crate::accounting::{DEVICE_SET, devices_of, owner_stopped};
use crate::extender::healthy_ids;
use crate::inventory::{INVENTORY_SET, PublishedDevice, published_devices};

/// The event kinds that can change the pins the copy holds.
pub const WATCHED_KINDS: [&str; 5] = [
    "PinAssigned",
    "PinReleased",
    "PinOwnerChanged",
    "PodReported",
    "PodRevoked",
];

/// How often the copy starts over from a full list even when no event
/// asked it to. Besides a change no event names, this bounds how long a
/// watch on a replica that was cut off from the others (still serving,
/// applying nothing, so sending nothing) keeps the copy stale: the watch
/// has no heartbeat to tell silence from a cut. A full list at 1,000
/// nodes × 8 GPUs is 9,000 pins, once every 10 s.
pub const RESYNC: Duration = Duration::from_secs(10);

/// Node re-reads in flight at once.
const READS_IN_FLIGHT: usize = 16;

/// How long the copy waits before starting over after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// A set's pins on one node: what one `list_pins(set, node)` answers.
pub type NodeSet = (String, String);

/// What the filter reads of one node, worked out when its pins change
/// rather than at every filter call.
#[derive(Debug, Default, Clone)]
struct NodeSummary {
    /// Its devices claimed by pods not known to have stopped: device ->
    /// pod uid.
    live: BTreeMap<String, String>,
    /// The healthy devices its plugin published (None: it published none).
    healthy: Option<Vec<String>>,
    /// How many of `healthy` no live claim holds: a pod needing at most
    /// this many fits at a glance (a pod's own claim counts free too, so a
    /// node short by this count is judged device by device).
    free: usize,
}

/// The two sets a copy follows: one device kind's claims and inventories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sets {
    /// The claims' set.
    pub claims: String,
    /// The published inventories' set.
    pub inventory: String,
}

impl Default for Sets {
    /// The first device kind's sets.
    fn default() -> Self {
        Sets {
            claims: DEVICE_SET.into(),
            inventory: INVENTORY_SET.into(),
        }
    }
}

impl Sets {
    /// A device kind's sets.
    pub fn of(kind: &crate::kind::DeviceKind) -> Sets {
        Sets {
            claims: kind.claim_set.clone(),
            inventory: kind.inventory_set.clone(),
        }
    }
}

/// The pins of the two sets, indexed the ways the events need.
#[derive(Debug, Default, Clone)]
pub struct Pins {
    /// Which sets these are.
    sets: Sets,
    /// Node -> what the filter reads of it.
    /// (Hashed: every filter call looks up each of its candidates.)
    summary: HashMap<String, NodeSummary>,
    /// (set, node) -> member -> pin.
    by_node: BTreeMap<NodeSet, BTreeMap<String, pb::Pin>>,
    /// (set, member) -> node.
    node_of: BTreeMap<(String, String), String>,
    /// Pod uid -> nodes where it has device claims.
    claims_of_pod: BTreeMap<String, BTreeSet<String>>,
    /// Pods whose objects the API server removed, seen by the extender's
    /// own pod watch, while the copy still has claims of theirs: counted
    /// stopped, as kube-scheduler counts their devices free from the same
    /// delete event, before the bridge's report has reached Tether.
    deleted: BTreeSet<String>,
}

impl Pins {
    /// The pins of a full list of the two sets, with the pods of `deleted`
    /// that still have claims there counted stopped.
    pub fn from_list(
        pins: impl IntoIterator<Item = (String, String, pb::Pin)>,
        deleted: BTreeSet<String>,
    ) -> Pins {
        Pins::from_list_of(Sets::default(), pins, deleted)
    }

    /// [`Pins::from_list`] of a device kind's `sets`.
    pub fn from_list_of(
        sets: Sets,
        pins: impl IntoIterator<Item = (String, String, pb::Pin)>,
        deleted: BTreeSet<String>,
    ) -> Pins {
        let mut grouped: BTreeMap<NodeSet, Vec<(String, pb::Pin)>> = BTreeMap::new();
        for (set, member, pin) in pins {
            grouped
                .entry((set, pin.node.clone()))
                .or_default()
                .push((member, pin));
        }
        let mut out = Pins {
            sets,
            ..Pins::default()
        };
        let claimed: BTreeSet<&String> = grouped
            .iter()
            .filter(|((set, _), _)| *set == out.sets.claims)
            .flat_map(|(_, pins)| pins.iter().map(|(_, pin)| &pin.pod_uid))
            .collect();
        out.deleted = deleted
            .into_iter()
            .filter(|uid| claimed.contains(uid))
            .collect();
        for (node_set, pins) in grouped {
            out.put(&node_set, pins);
        }
        out
    }

    /// The pods the copy counts deleted (see [`Pins::pod_deleted`]).
    pub fn deleted(&self) -> &BTreeSet<String> {
        &self.deleted
    }

    /// Whether the pod of `uid` was seen deleted while it had claims here.
    pub fn is_deleted(&self, uid: &str) -> bool {
        self.deleted.contains(uid)
    }

    /// The pod of `uid` is gone from the API server: its claims count
    /// stopped from now on, until they end. Returns whether a device
    /// became free for the filter (false for a pod with no claims here,
    /// which is not remembered).
    pub fn pod_deleted(&mut self, uid: &str) -> bool {
        let Some(nodes) = self.claims_of_pod.get(uid).cloned() else {
            return false;
        };
        if !self.deleted.insert(uid.to_string()) {
            return false;
        }
        let mut freed = false;
        for node in nodes {
            let before = self
                .summary
                .get(&node)
                .map(|s| s.live.len())
                .unwrap_or_default();
            self.summarize(&(self.sets.claims.clone(), node.clone()));
            let after = self
                .summary
                .get(&node)
                .map(|s| s.live.len())
                .unwrap_or_default();
            freed |= after < before;
        }
        freed
    }

    /// Puts `pins` (member, pin) in place of what the copy had of
    /// `node_set`. Returns whether a device of the node became free for
    /// the filter: a live claim ended or its pod stopped, or a healthy
    /// device appeared.
    pub fn replace(&mut self, node_set: &NodeSet, pins: Vec<(String, pb::Pin)>) -> bool {
        let before = self.summary.get(&node_set.1).cloned().unwrap_or_default();
        self.put(node_set, pins);
        let after = self.summary.get(&node_set.1);
        let live_after = after.map(|s| &s.live);
        let healthy_after = after.and_then(|s| s.healthy.as_deref()).unwrap_or_default();
        let healthy_before = before.healthy.as_deref().unwrap_or_default();
        before
            .live
            .keys()
            .any(|device| !live_after.is_some_and(|live| live.contains_key(device)))
            || healthy_after.iter().any(|d| !healthy_before.contains(d))
    }

    fn put(&mut self, node_set: &NodeSet, pins: Vec<(String, pb::Pin)>) {
        let (set, node) = node_set;
        let mut unclaimed = Vec::new();
        for (member, old) in self.by_node.remove(node_set).unwrap_or_default() {
            self.node_of.remove(&(set.clone(), member));
            if *set == self.sets.claims
                && let Some(nodes) = self.claims_of_pod.get_mut(&old.pod_uid)
            {
                nodes.remove(node);
                if nodes.is_empty() {
                    self.claims_of_pod.remove(&old.pod_uid);
                    unclaimed.push(old.pod_uid);
                }
            }
        }
        let mut members = BTreeMap::new();
        for (member, pin) in pins {
            self.node_of
                .insert((set.clone(), member.clone()), node.clone());
            if *set == self.sets.claims && !pin.pod_uid.is_empty() {
                self.claims_of_pod
                    .entry(pin.pod_uid.clone())
                    .or_default()
                    .insert(node.clone());
            }
            members.insert(member, pin);
        }
        // A deleted pod whose claims all ended is forgotten: nothing is left
        // to count stopped.
        for uid in unclaimed {
            if !self.claims_of_pod.contains_key(&uid) {
                self.deleted.remove(&uid);
            }
        }
        if !members.is_empty() {
            self.by_node.insert(node_set.clone(), members);
        }
        self.summarize(node_set);
    }

    /// Works out again what the filter reads of `node_set`'s node.
    fn summarize(&mut self, node_set: &NodeSet) {
        let (set, node) = node_set;
        let pins = self
            .by_node
            .get(node_set)
            .into_iter()
            .flat_map(|m| m.values());
        let deleted = &self.deleted;
        let summary = self.summary.entry(node.clone()).or_default();
        if *set == self.sets.claims {
            summary.live = BTreeMap::new();
            for pin in pins.filter(|pin| !owner_stopped(pin) && !deleted.contains(&pin.pod_uid)) {
                for device in devices_of(pin) {
                    summary.live.insert(device, pin.pod_uid.clone());
                }
            }
        } else if *set == self.sets.inventory {
            // A node publishes one inventory pin; the list answers it alone.
            summary.healthy = pins
                .into_iter()
                .next()
                .map(|pin| healthy_ids(&published_devices(pin)));
        }
        summary.free = summary
            .healthy
            .iter()
            .flatten()
            .filter(|device| !summary.live.contains_key(*device))
            .count();
        if summary.live.is_empty() && summary.healthy.is_none() {
            self.summary.remove(node);
        }
    }

    /// How many of `node`'s published healthy devices no live claim holds
    /// (None: its plugin published none), kept as its pins change.
    pub fn free(&self, node: &str) -> Option<usize> {
        let summary = self.summary.get(node)?;
        summary.healthy.as_ref().map(|_| summary.free)
    }

    /// Devices of `node` claimed by pods not known to have stopped: device
    /// -> pod uid (what [`crate::accounting::DeviceLedger::live_claims_by_node`]
    /// answers for one node).
    pub fn live_claims(&self, node: &str) -> BTreeMap<String, String> {
        self.claims_on(node).cloned().unwrap_or_default()
    }

    /// Every device of `node` a claim in the copy holds, stopped pods'
    /// claims too (Tether holds them until their sweep): device -> pod uid.
    /// What a bind may plan around; the filter counts only [`Pins::claims_on`].
    pub fn all_claims_on(&self, node: &str) -> BTreeMap<String, String> {
        let node_set = (self.sets.claims.clone(), node.to_string());
        self.by_node
            .get(&node_set)
            .into_iter()
            .flat_map(|members| members.values())
            .flat_map(|pin| {
                devices_of(pin)
                    .into_iter()
                    .map(|d| (d, pin.pod_uid.clone()))
            })
            .collect()
    }

    /// [`Pins::live_claims`] without a copy; None for a node without any.
    pub fn claims_on(&self, node: &str) -> Option<&BTreeMap<String, String>> {
        self.summary
            .get(node)
            .map(|s| &s.live)
            .filter(|l| !l.is_empty())
    }

    /// The healthy devices `node`'s plugin published (None: it published
    /// none).
    pub fn healthy(&self, node: &str) -> Option<&[String]> {
        self.summary.get(node)?.healthy.as_deref()
    }

    /// Every node's live claims (what [`Pins::live_claims`] answers for
    /// each node with claims).
    pub fn live_claims_by_node(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.summary
            .iter()
            .filter(|(_, s)| !s.live.is_empty())
            .map(|(node, s)| (node.clone(), s.live.clone()))
            .collect()
    }

    /// Applies `event` to the copy if it carries all the copy needs: a pin
    /// made (`PinAssigned` with the pin's owner state and labels), a pin
    /// ended (`PinReleased`: which pin, on which node) or a pod's claims
    /// turned stopped or live (`PodReported`, `PodRevoked`). Returns
    /// whether a device became free for the filter, or None for an event
    /// that is to be re-read ([`touched`]): an owner change (its event
    /// carries no labels), an assignment from a build whose events do not
    /// carry the pin, or a report of a phase this build does not know.
    ///
    /// Applied in the stream's order, an event leaves the copy as a re-read
    /// would, with exceptions that heal themselves, all from an event
    /// replayed after a read that already showed a later state (the watch
    /// opened before the list, or a re-read ran ahead of the stream): an
    /// end replayed after the pin was made again under the same key
    /// removes the new pin until that pin's own `PinAssigned`, later in the
    /// stream, puts it back; an assignment replayed after its pin ended puts
    /// the pin back until its `PinReleased`, later in the stream, takes it
    /// out. Meanwhile the filter may offer a device that is claimed (the
    /// claim then refuses the bind's plan) or pass over one that is free.
    pub fn apply_event(&mut self, event: &pb::Event) -> Option<bool> {
        match event.kind.as_str() {
            "PinAssigned" => {
                let pin = pin_of_assigned(event)?;
                let (set, member) = event.key.strip_prefix("pin/")?.split_once('/')?;
                if set != self.sets.claims && set != self.sets.inventory {
                    return Some(false);
                }
                let key = (set.to_string(), member.to_string());
                let mut freed = false;
                // Made again elsewhere (a correction that moved it): out of
                // its old node first.
                if let Some(old) = self.node_of.get(&key).cloned()
                    && old != pin.node
                {
                    let node_set = (key.0.clone(), old);
                    let rest = self.members_but(&node_set, member);
                    freed |= self.replace(&node_set, rest);
                }
                let node_set = (key.0, pin.node.clone());
                let mut members = self.members_but(&node_set, member);
                members.push((member.to_string(), pin));
                freed |= self.replace(&node_set, members);
                Some(freed)
            }
            "PinReleased" => {
                let (set, member) = event.key.strip_prefix("pin/")?.split_once('/')?;
                if set != self.sets.claims && set != self.sets.inventory {
                    return Some(false);
                }
                let key = (set.to_string(), member.to_string());
                let Some(node) = self.node_of.get(&key).cloned() else {
                    // Not in the copy: ended already, or made in this batch
                    // and to be read with it.
                    return Some(false);
                };
                let node_set = (key.0, node);
                let rest = self.members_but(&node_set, member);
                Some(self.replace(&node_set, rest))
            }
            "PodReported" | "PodRevoked" => {
                let uid = event.key.strip_prefix("pod/").unwrap_or_default();
                let owner = owner_after(event)?;
                let stopped = owner == pb::OwnerState::OwnerStopped;
                let mut freed = false;
                for node in self.claims_of_pod.get(uid).cloned().unwrap_or_default() {
                    let node_set = (self.sets.claims.clone(), node);
                    let members = self.by_node.get(&node_set).cloned().unwrap_or_default();
                    // Only what the filter reads of a claim's owner changes
                    // it: whether it stopped.
                    if !members
                        .values()
                        .any(|pin| pin.pod_uid == uid && owner_stopped(pin) != stopped)
                    {
                        continue;
                    }
                    let pins = members
                        .into_iter()
                        .map(|(member, mut pin)| {
                            if pin.pod_uid == uid {
                                pin.owner = owner as i32;
                            }
                            (member, pin)
                        })
                        .collect();
                    freed |= self.replace(&node_set, pins);
                }
                Some(freed)
            }
            _ => None,
        }
    }

    /// The pins the copy has of `node_set`, but `member`'s.
    fn members_but(&self, node_set: &NodeSet, member: &str) -> Vec<(String, pb::Pin)> {
        self.by_node
            .get(node_set)
            .into_iter()
            .flatten()
            .filter(|(m, _)| m.as_str() != member)
            .map(|(m, pin)| (m.clone(), pin.clone()))
            .collect()
    }

    /// The devices `node`'s plugin published, if it published any.
    pub fn published(&self, node: &str) -> Option<Vec<PublishedDevice>> {
        let key = (self.sets.inventory.clone(), node.to_string());
        // A node publishes one inventory pin; the list answers it alone.
        let pin = self.by_node.get(&key)?.values().next()?;
        Some(published_devices(pin))
    }
}

/// The owner state a pod report or revoke gives the pod's claims, as
/// Tether sets it: stopped if revoked or reported terminal or gone,
/// starting or running as reported; None for a phase this build does not
/// know.
fn owner_after(event: &pb::Event) -> Option<pb::OwnerState> {
    match (event.kind.as_str(), event.attributes.get("phase")) {
        ("PodRevoked", _) => Some(pb::OwnerState::OwnerStopped),
        (_, Some(phase)) if phase == "Terminal" || phase == "Gone" => {
            Some(pb::OwnerState::OwnerStopped)
        }
        (_, Some(phase)) if phase == "Starting" => Some(pb::OwnerState::OwnerStarting),
        (_, Some(phase)) if phase == "Running" => Some(pb::OwnerState::OwnerRunning),
        _ => None,
    }
}

/// The pin a `PinAssigned` event made, as a read would answer what the copy
/// uses of it (node, owner pod and its state, labels); None for an event
/// without the pin's owner state, which a build before the events carried
/// the pin sends, and which is to be re-read.
fn pin_of_assigned(event: &pb::Event) -> Option<pb::Pin> {
    let owner = pb::OwnerState::from_str_name(event.attributes.get("owner")?)?;
    if event.node.is_empty() {
        return None;
    }
    let (set, member) = event.key.strip_prefix("pin/")?.split_once('/')?;
    Some(pb::Pin {
        key: Some(pb::PinKey {
            set: set.into(),
            member: member.into(),
        }),
        node: event.node.clone(),
        pinned_at_ms: event.time_ms,
        pod_uid: event.attributes.get("pod_uid").cloned().unwrap_or_default(),
        labels: event
            .attributes
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("label.")?.to_string(), v.clone())))
            .collect(),
        lifetime_ms: event
            .attributes
            .get("lifetime_ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or_default(),
        last_running_at_ms: 0,
        owner: owner as i32,
    })
}

/// What an event asks of the copy.
#[derive(Debug, PartialEq, Eq)]
pub enum Touched {
    /// Re-read these sets' pins of these nodes.
    Nodes(BTreeSet<NodeSet>),
    /// Start over from a full list: the event names a pin the copy cannot
    /// place.
    Everything,
}

/// Which (set, node) pins `event` may have changed, by what the copy
/// holds and by `assigned_earlier` (event key -> node of the `PinAssigned`
/// events before it in the same batch, which the copy has not read yet):
/// see the module doc.
pub fn touched(
    event: &pb::Event,
    pins: &Pins,
    assigned_earlier: &BTreeMap<String, String>,
) -> Touched {
    let mut nodes = BTreeSet::new();
    match event.kind.as_str() {
        "PinAssigned" | "PinReleased" | "PinOwnerChanged" => {
            let Some((set, member)) = event
                .key
                .strip_prefix("pin/")
                .and_then(|rest| rest.split_once('/'))
            else {
                return Touched::Nodes(nodes);
            };
            if set != pins.sets.claims && set != pins.sets.inventory {
                return Touched::Nodes(nodes);
            }
            let node = if event.node.is_empty() {
                pins.node_of
                    .get(&(set.to_string(), member.to_string()))
                    .or_else(|| assigned_earlier.get(&event.key))
                    .cloned()
            } else {
                Some(event.node.clone())
            };
            match node {
                Some(node) => {
                    nodes.insert((set.to_string(), node));
                }
                None => return Touched::Everything,
            }
        }
        "PodReported" | "PodRevoked" => {
            let uid = event.key.strip_prefix("pod/").unwrap_or_default();
            // Whether the pod's claims now count stopped (None: a phase this
            // build does not know).
            let stopped = owner_after(event).map(|owner| owner == pb::OwnerState::OwnerStopped);
            for node in pins.claims_of_pod.get(uid).into_iter().flatten() {
                let node_set = (pins.sets.claims.clone(), node.clone());
                // Only what the filter reads of a claim's owner can make a
                // re-read worth it: whether it stopped.
                let flips = pins
                    .by_node
                    .get(&node_set)
                    .into_iter()
                    .flat_map(|members| members.values())
                    .any(|pin| pin.pod_uid == uid && Some(owner_stopped(pin)) != stopped);
                if flips {
                    nodes.insert(node_set);
                }
            }
        }
        _ => {}
    }
    Touched::Nodes(nodes)
}

/// The copy and whether it can be read.
#[derive(Default)]
struct Copy {
    pins: Pins,
    synced: bool,
}

/// Marks the copy not whole when dropped, with the follower holding it.
struct Unfollowed(Arc<DeviceView>);

impl Drop for Unfollowed {
    fn drop(&mut self) {
        self.0.lock().synced = false;
    }
}

/// The watched copy; [`DeviceView::follow`] keeps it current.
pub struct DeviceView {
    client: Client,
    /// The device kind's sets this copy follows.
    sets: Sets,
    /// Read by each filter call for its candidates, written for each batch
    /// of events: both brief, so one lock and no copies.
    copy: Mutex<Copy>,
    /// Told when devices became free in the copy (or it was listed anew),
    /// so that the pods refused for want of them are asked about at once
    /// ([`DeviceView::freed`]).
    freed: tokio::sync::Notify,
}

impl DeviceView {
    /// A copy not yet listed: [`DeviceView::read`] answers `None` until
    /// [`DeviceView::follow`] has listed once.
    pub fn new(client: Client) -> DeviceView {
        DeviceView::of(client, Sets::default())
    }

    /// A copy of a device kind's `sets`, not yet listed.
    pub fn of(client: Client, sets: Sets) -> DeviceView {
        DeviceView {
            client,
            copy: Mutex::new(Copy {
                pins: Pins {
                    sets: sets.clone(),
                    ..Pins::default()
                },
                synced: false,
            }),
            sets,
            freed: tokio::sync::Notify::new(),
        }
    }

    /// Resolves once devices have become free in the copy since the last
    /// time it resolved (or the copy was listed anew): a change while
    /// nobody waits is kept for the next wait.
    pub async fn freed(&self) {
        self.freed.notified().await;
    }

    /// The pod of `uid` is gone from the API server (the extender's pod
    /// watch saw its delete event): its claims count stopped in the copy
    /// until they end (see [`Pins::pod_deleted`]), and the pods refused for
    /// want of its devices are asked about again. Kept across a relist of
    /// the copy; a copy not yet listed has no claims to mark.
    pub fn pod_deleted(&self, uid: &str) {
        let freed = self.lock().pins.pod_deleted(uid);
        if freed {
            self.freed.notify_one();
        }
    }

    /// Whether the copy counts the pod of `uid` deleted (its claims, which
    /// Tether still has, end once the bridge's report is in).
    pub fn is_deleted(&self, uid: &str) -> bool {
        self.lock().pins.is_deleted(uid)
    }

    /// `read` of the copy as it is now, if it is whole (listed and
    /// followed since); None if it is not.
    pub fn read<R>(&self, read: impl FnOnce(&Pins) -> R) -> Option<R> {
        let copy = self.lock();
        copy.synced.then(|| read(&copy.pins))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Copy> {
        self.copy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps the copy current until dropped: list, then follow the events;
    /// start over after a failure, a compaction or [`RESYNC`]. Once this
    /// future is dropped (its task aborted), the copy reads as not whole: a
    /// copy nobody follows goes stale, and its readers must read Tether.
    pub async fn follow(self: Arc<Self>) {
        let _unfollowed = Unfollowed(self.clone());
        loop {
            if let Err(err) = self.list_and_follow().await {
                tracing::warn!(
                    %err,
                    "the extender's copy of the device claims stopped following Tether; the filter \
                     reads Tether directly until it has listed again"
                );
                self.lock().synced = false;
                tokio::time::sleep(RETRY).await;
            }
        }
    }

    /// One round: open the watch, list, follow until [`RESYNC`] or a
    /// compaction (Ok) or a failure (Err).
    async fn list_and_follow(&self) -> Result<(), tether_client::Error> {
        let mut watch = self
            .client
            .watch(None, WATCHED_KINDS.map(String::from).to_vec(), "")
            .await?;
        let mut listed = Vec::new();
        for set in [&self.sets.claims, &self.sets.inventory] {
            for pin in self.client.list_pins(set, "").await? {
                listed.push((set.to_string(), pin));
            }
        }
        {
            let mut copy = self.lock();
            let deleted = std::mem::take(&mut copy.pins.deleted);
            let pins = Pins::from_list_of(
                self.sets.clone(),
                listed
                    .into_iter()
                    .filter_map(|(set, pin)| Some((set, pin.key.clone()?.member, pin))),
                deleted,
            );
            *copy = Copy { pins, synced: true };
        }
        self.freed.notify_one();
        let until = Instant::now() + RESYNC;
        loop {
            let update = match tokio::time::timeout_at(until.into(), watch.next()).await {
                Err(_) => return Ok(()),
                Ok(update) => update?,
            };
            let events = match update {
                WatchUpdate::Events(events) => events,
                WatchUpdate::Relist { .. } => return Ok(()),
            };
            // A planted staleness for `tests/stale_plan.rs`
            // (`device-view-frozen`, set with `fail::cfg`): the copy stays
            // whole but takes in no change, as one a slow watch has not
            // reached yet.
            if fail::eval("device-view-frozen", |_| ()).is_some() {
                continue;
            }
            let mut stale = BTreeSet::new();
            let mut assigned = BTreeMap::new();
            let mut freed = false;
            // A planted bug for `tests/device_view.rs`
            // (`device-view-ignores-pod-reports`, set with `fail::cfg`):
            // a stopped pod's claims would count taken until the resync.
            let planted = fail::eval("device-view-ignores-pod-reports", |_| ()).is_some();
            // Another (`device-view-assignments-lose-labels`): the copy
            // would apply each assignment without the labels its event
            // carries, so a claim made would name no device.
            let unlabelled = fail::eval("device-view-assignments-lose-labels", |_| ()).is_some();
            {
                let mut copy = self.lock();
                for event in &events {
                    if planted && event.key.starts_with("pod/") {
                        continue;
                    }
                    let stripped;
                    let event = if unlabelled && event.kind == "PinAssigned" {
                        let mut without = event.clone();
                        without.attributes.retain(|k, _| !k.starts_with("label."));
                        stripped = without;
                        &stripped
                    } else {
                        event
                    };
                    if let Some(freed_now) = copy.pins.apply_event(event) {
                        freed |= freed_now;
                        continue;
                    }
                    match touched(event, &copy.pins, &assigned) {
                        Touched::Nodes(nodes) => stale.extend(nodes),
                        Touched::Everything => return Ok(()),
                    }
                    if event.kind == "PinAssigned" {
                        assigned.insert(event.key.clone(), event.node.clone());
                    }
                }
            }
            if stale.is_empty() {
                if freed {
                    self.freed.notify_one();
                }
                continue;
            }
            let client = &self.client;
            let reads: Vec<_> = futures::stream::iter(stale)
                .map(|(set, node)| async move {
                    let read = client.list_pins(&set, &node).await;
                    ((set, node), read)
                })
                .buffer_unordered(READS_IN_FLIGHT)
                .collect()
                .await;
            let mut read_again = Vec::with_capacity(reads.len());
            for (node_set, read) in reads {
                let read = read?
                    .into_iter()
                    // A set filtered by node answers only that node's pins.
                    .filter_map(|pin| Some((pin.key.clone()?.member, pin)))
                    .collect();
                read_again.push((node_set, read));
            }
            {
                let mut copy = self.lock();
                for (node_set, read) in read_again {
                    freed |= copy.pins.replace(&node_set, read);
                }
            }
            if freed {
                self.freed.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::accounting::DEVICE_LABEL_PREFIX;
    use crate::inventory::INVENTORY_LABEL_PREFIX;

    fn claim(node: &str, uid: &str, devices: &[&str], owner: pb::OwnerState) -> pb::Pin {
        pb::Pin {
            key: Some(pb::PinKey {
                set: DEVICE_SET.into(),
                member: uid.into(),
            }),
            node: node.into(),
            pod_uid: uid.into(),
            owner: owner as i32,
            labels: devices
                .iter()
                .map(|d| (format!("{DEVICE_LABEL_PREFIX}{d}"), "true".into()))
                .collect(),
            ..Default::default()
        }
    }

    fn inventory(node: &str, healthy: &[&str]) -> pb::Pin {
        pb::Pin {
            key: Some(pb::PinKey {
                set: INVENTORY_SET.into(),
                member: node.into(),
            }),
            node: node.into(),
            labels: healthy
                .iter()
                .map(|d| (format!("{INVENTORY_LABEL_PREFIX}{d}"), "healthy".into()))
                .collect(),
            ..Default::default()
        }
    }

    fn listed(pins: Vec<pb::Pin>) -> Pins {
        Pins::from_list(
            pins.into_iter().map(|pin| {
                let key = pin.key.clone().unwrap();
                (key.set, key.member, pin)
            }),
            BTreeSet::new(),
        )
    }

    fn event(kind: &str, key: &str, node: &str) -> pb::Event {
        pb::Event {
            kind: kind.into(),
            key: key.into(),
            node: node.into(),
            ..Default::default()
        }
    }

    fn reported(uid: &str, phase: &str) -> pb::Event {
        pb::Event {
            attributes: [("phase".to_string(), phase.to_string())].into(),
            ..event("PodReported", &format!("pod/{uid}"), "")
        }
    }

    /// The `PinAssigned` event Tether sends when it makes `pin`.
    fn assigned(pin: &pb::Pin) -> pb::Event {
        let key = pin.key.clone().unwrap();
        let mut attributes: std::collections::HashMap<String, String> = pin
            .labels
            .iter()
            .map(|(k, v)| (format!("label.{k}"), v.clone()))
            .collect();
        attributes.insert("pod_uid".into(), pin.pod_uid.clone());
        attributes.insert("lifetime_ms".into(), pin.lifetime_ms.to_string());
        attributes.insert("owner".into(), pin.owner().as_str_name().into());
        pb::Event {
            attributes,
            ..event(
                "PinAssigned",
                &format!("pin/{}/{}", key.set, key.member),
                &pin.node,
            )
        }
    }

    fn none() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn nodes(list: &[(&str, &str)]) -> Touched {
        Touched::Nodes(
            list.iter()
                .map(|(s, n)| (s.to_string(), n.to_string()))
                .collect(),
        )
    }

    /// `pin` moved to `set`.
    fn in_set(set: &str, mut pin: pb::Pin) -> pb::Pin {
        if let Some(key) = pin.key.as_mut() {
            key.set = set.into();
        }
        pin
    }

    #[test]
    fn a_second_kinds_copy_reads_its_own_sets_and_no_other() {
        let npu = Sets {
            claims: "npu-devices".into(),
            inventory: "npu-inventory".into(),
        };
        let pins = Pins::from_list_of(
            npu.clone(),
            [
                in_set(
                    "npu-devices",
                    claim("n1", "a", &["npu0"], pb::OwnerState::OwnerRunning),
                ),
                in_set("npu-inventory", inventory("n1", &["npu0", "npu1"])),
                // The first kind's pins, were a list to answer them.
                claim("n1", "b", &["gpu0"], pb::OwnerState::OwnerRunning),
                inventory("n1", &["gpu0"]),
            ]
            .into_iter()
            .map(|pin| {
                let key = pin.key.clone().unwrap();
                (key.set, key.member, pin)
            }),
            BTreeSet::new(),
        );
        assert_eq!(
            pins.live_claims("n1"),
            BTreeMap::from([("npu0".to_string(), "a".to_string())])
        );
        assert_eq!(
            pins.healthy("n1"),
            Some(&["npu0".to_string(), "npu1".to_string()][..])
        );
        // Events about the first kind's pins touch nothing here; its own
        // sets' do.
        assert_eq!(
            touched(
                &event("PinReleased", "pin/gpu-devices/b", "n1"),
                &pins,
                &none()
            ),
            nodes(&[])
        );
        assert_eq!(
            touched(
                &event("PinReleased", "pin/npu-devices/a", "n1"),
                &pins,
                &none()
            ),
            nodes(&[("npu-devices", "n1")])
        );
        assert_eq!(
            touched(&reported("a", "Gone"), &pins, &none()),
            nodes(&[("npu-devices", "n1")])
        );
    }

    #[test]
    fn live_claims_leave_out_stopped_pods_and_published_devices_come_from_the_inventory() {
        let pins = listed(vec![
            claim("n1", "a", &["gpu0", "gpu1"], pb::OwnerState::OwnerRunning),
            claim("n1", "b", &["gpu2"], pb::OwnerState::OwnerStopped),
            claim("n2", "c", &["gpu0"], pb::OwnerState::OwnerUnknown),
            inventory("n1", &["gpu0", "gpu1", "gpu2"]),
        ]);
        assert_eq!(
            pins.live_claims("n1"),
            BTreeMap::from([("gpu0".into(), "a".into()), ("gpu1".into(), "a".into())])
        );
        assert_eq!(pins.live_claims("n3"), BTreeMap::new());
        assert_eq!(
            pins.live_claims_by_node(),
            BTreeMap::from([
                ("n1".into(), pins.live_claims("n1")),
                ("n2".into(), BTreeMap::from([("gpu0".into(), "c".into())])),
            ])
        );
        let published = pins.published("n1").unwrap();
        assert_eq!(
            published.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
            ["gpu0", "gpu1", "gpu2"]
        );
        assert!(pins.published("n2").is_none());
        assert_eq!(pins.healthy("n1").unwrap(), ["gpu0", "gpu1", "gpu2"]);
        assert!(pins.healthy("n2").is_none());
    }

    #[test]
    fn each_event_names_the_nodes_to_read_again() {
        let pins = listed(vec![
            claim("n1", "a", &["gpu0"], pb::OwnerState::OwnerRunning),
            claim("n2", "a2", &["gpu0"], pb::OwnerState::OwnerRunning),
            inventory("n3", &["gpu0"]),
        ]);
        // A claim made or ended names its node.
        assert_eq!(
            touched(
                &event("PinAssigned", "pin/gpu-devices/z", "n4"),
                &pins,
                &none()
            ),
            nodes(&[(DEVICE_SET, "n4")])
        );
        assert_eq!(
            touched(
                &event("PinReleased", "pin/gpu-inventory/n3", "n3"),
                &pins,
                &none()
            ),
            nodes(&[(INVENTORY_SET, "n3")])
        );
        // A claim taken over names no node: the copy knows it.
        assert_eq!(
            touched(
                &event("PinOwnerChanged", "pin/gpu-devices/a2", ""),
                &pins,
                &none()
            ),
            nodes(&[(DEVICE_SET, "n2")])
        );
        // One assigned earlier in the same batch: the node of that event.
        let earlier = BTreeMap::from([("pin/gpu-devices/new".to_string(), "n5".to_string())]);
        assert_eq!(
            touched(
                &event("PinOwnerChanged", "pin/gpu-devices/new", ""),
                &pins,
                &earlier
            ),
            nodes(&[(DEVICE_SET, "n5")])
        );
        // One the copy does not know: start over.
        assert_eq!(
            touched(
                &event("PinOwnerChanged", "pin/gpu-devices/new", ""),
                &pins,
                &none()
            ),
            Touched::Everything
        );
        // A pod's report: the nodes of its claims, none if it has none,
        // when it turns them stopped (or live again, or it cannot tell).
        assert_eq!(
            touched(&reported("a", "Terminal"), &pins, &none()),
            nodes(&[(DEVICE_SET, "n1")])
        );
        assert_eq!(
            touched(&event("PodRevoked", "pod/a", ""), &pins, &none()),
            nodes(&[(DEVICE_SET, "n1")])
        );
        assert_eq!(
            touched(&reported("a", "Running"), &pins, &none()),
            nodes(&[])
        );
        assert_eq!(
            touched(&reported("a", "Evicted"), &pins, &none()),
            nodes(&[(DEVICE_SET, "n1")])
        );
        assert_eq!(
            touched(&event("PodRevoked", "pod/other", ""), &pins, &none()),
            nodes(&[])
        );
        // Pins of other sets are not the copy's.
        assert_eq!(
            touched(&event("PinAssigned", "pin/slurm/w1", "n1"), &pins, &none()),
            nodes(&[])
        );
    }

    /// Ends and stops are applied from their events, leaving the copy as a
    /// re-read of the node would; assignments and owner changes are left
    /// to a re-read.
    #[test]
    fn ends_and_stops_are_applied_from_their_events() {
        use pb::OwnerState::{OwnerRunning, OwnerStopped};
        let mut pins = listed(vec![
            claim("n1", "a", &["gpu0"], OwnerRunning),
            claim("n1", "b", &["gpu1"], OwnerRunning),
            inventory("n1", &["gpu0", "gpu1", "gpu2"]),
        ]);
        assert_eq!(pins.free("n1"), Some(1));
        // a's pod gone: its claim counts stopped and its device free, as a
        // read of the node would show.
        assert_eq!(pins.apply_event(&reported("a", "Gone")), Some(true));
        assert_eq!(pins.free("n1"), Some(2));
        let read = listed(vec![
            claim("n1", "a", &["gpu0"], OwnerStopped),
            claim("n1", "b", &["gpu1"], OwnerRunning),
            inventory("n1", &["gpu0", "gpu1", "gpu2"]),
        ]);
        assert_eq!(pins.live_claims_by_node(), read.live_claims_by_node());
        assert_eq!(pins.all_claims_on("n1"), read.all_claims_on("n1"));
        assert_eq!(pins.apply_event(&reported("a", "Terminal")), Some(false));
        // Its claim ends: no device more is free, and the claim is gone.
        assert_eq!(
            pins.apply_event(&event("PinReleased", "pin/gpu-devices/a", "n1")),
            Some(false)
        );
        assert_eq!(
            pins.all_claims_on("n1"),
            BTreeMap::from([("gpu1".to_string(), "b".to_string())])
        );
        // b revoked, then (as a report of it could) live again.
        assert_eq!(
            pins.apply_event(&event("PodRevoked", "pod/b", "")),
            Some(true)
        );
        assert_eq!(pins.free("n1"), Some(3));
        assert_eq!(pins.apply_event(&reported("b", "Running")), Some(false));
        assert_eq!(pins.free("n1"), Some(2));
        // The end of a pin the copy lacks, or of another set's: nothing.
        assert_eq!(
            pins.apply_event(&event("PinReleased", "pin/gpu-devices/zz", "n1")),
            Some(false)
        );
        assert_eq!(
            pins.apply_event(&event("PinReleased", "pin/slurm/w1", "n1")),
            Some(false)
        );
        // The inventory's end: the node publishes nothing.
        assert_eq!(
            pins.apply_event(&event("PinReleased", "pin/gpu-inventory/n1", "n1")),
            Some(false)
        );
        assert_eq!(pins.free("n1"), None);
        // Left to a re-read: what the event cannot say (an assignment
        // from a build whose events do not carry the pin).
        assert_eq!(
            pins.apply_event(&event("PinAssigned", "pin/gpu-devices/c", "n1")),
            None
        );
        assert_eq!(
            pins.apply_event(&event("PinOwnerChanged", "pin/gpu-devices/b", "")),
            None
        );
        assert_eq!(pins.apply_event(&reported("b", "Evicted")), None);
    }

    /// An assignment whose event carries the pin (owner state and labels)
    /// leaves the copy as a read of its node would, without the read: a
    /// claim made, an inventory published, a claim corrected onto another
    /// node.
    #[test]
    fn assignments_are_applied_from_events_that_carry_the_pin() {
        use pb::OwnerState::{OwnerRunning, OwnerStarting};
        let a = claim("n1", "a", &["gpu0"], OwnerRunning);
        let mut pins = listed(vec![a.clone(), inventory("n1", &["gpu0", "gpu1", "gpu2"])]);
        assert_eq!(pins.free("n1"), Some(2));
        // c's claim on n1: one device fewer free, none freed.
        let c = claim("n1", "c", &["gpu1"], OwnerStarting);
        assert_eq!(pins.apply_event(&assigned(&c)), Some(false));
        assert_eq!(pins.free("n1"), Some(1));
        let read = listed(vec![
            a.clone(),
            c.clone(),
            inventory("n1", &["gpu0", "gpu1", "gpu2"]),
        ]);
        assert_eq!(pins.all_claims_on("n1"), read.all_claims_on("n1"));
        assert_eq!(pins.live_claims_by_node(), read.live_claims_by_node());
        // n2 publishes its devices.
        assert_eq!(
            pins.apply_event(&assigned(&inventory("n2", &["gpu0", "gpu1"]))),
            Some(true)
        );
        assert_eq!(pins.free("n2"), Some(2));
        assert_eq!(
            pins.published("n2").map(|d| d.len()),
            read_published(&inventory("n2", &["gpu0", "gpu1"]))
        );
        // c's claim made again on n2 (a correction): n1's device is free
        // again, n2 has one fewer.
        let moved = claim("n2", "c", &["gpu1"], OwnerStarting);
        assert_eq!(pins.apply_event(&assigned(&moved)), Some(true));
        assert_eq!(pins.free("n1"), Some(2));
        assert_eq!(pins.free("n2"), Some(1));
        let read = listed(vec![
            a,
            moved,
            inventory("n1", &["gpu0", "gpu1", "gpu2"]),
            inventory("n2", &["gpu0", "gpu1"]),
        ]);
        assert_eq!(pins.live_claims_by_node(), read.live_claims_by_node());
        assert_eq!(pins.all_claims_on("n1"), read.all_claims_on("n1"));
        assert_eq!(pins.all_claims_on("n2"), read.all_claims_on("n2"));
        // Another set's pin: nothing to the copy.
        let mut other = claim("n1", "w1", &[], OwnerRunning);
        other.key = Some(pb::PinKey {
            set: "slurm".into(),
            member: "w1".into(),
        });
        assert_eq!(pins.apply_event(&assigned(&other)), Some(false));
        assert_eq!(pins.free("n1"), Some(2));
    }

    fn read_published(pin: &pb::Pin) -> Option<usize> {
        Some(published_devices(pin).len())
    }

    /// The free count the filter looks at first follows the inventory
    /// and the claims as they change, in whichever order they come.
    #[test]
    fn a_nodes_free_count_follows_its_inventory_and_its_claims() {
        let claims = (DEVICE_SET.to_string(), "n1".to_string());
        let published = (INVENTORY_SET.to_string(), "n1".to_string());
        let a = claim("n1", "a", &["gpu0"], pb::OwnerState::OwnerRunning);
        let b = claim("n1", "b", &["gpu1", "gpu9"], pb::OwnerState::OwnerRunning);
        // Claims before any inventory: nothing is known free.
        let mut pins = listed(vec![a.clone()]);
        assert_eq!(pins.free("n1"), None);
        pins.replace(
            &published,
            vec![("n1".into(), inventory("n1", &["gpu0", "gpu1", "gpu2"]))],
        );
        assert_eq!(pins.free("n1"), Some(2));
        // A claim naming a device the node did not publish takes only the
        // published one.
        pins.replace(
            &claims,
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
        );
        assert_eq!(pins.free("n1"), Some(1));
        // A deleted pod's claim is free for the filter.
        pins.pod_deleted("b");
        assert_eq!(pins.free("n1"), Some(2));
        // A smaller inventory, then none.
        pins.replace(&published, vec![("n1".into(), inventory("n1", &["gpu0"]))]);
        assert_eq!(pins.free("n1"), Some(0));
        pins.replace(&published, vec![]);
        assert_eq!(pins.free("n1"), None);
        // Every claim ended, the inventory back.
        pins.replace(&claims, vec![]);
        pins.replace(
            &published,
            vec![("n1".into(), inventory("n1", &["gpu0", "gpu1"]))],
        );
        assert_eq!(pins.free("n1"), Some(2));
    }

    #[test]
    fn a_deleted_pods_claims_count_stopped_until_they_end_and_a_relist_keeps_that() {
        let n1 = (DEVICE_SET.to_string(), "n1".to_string());
        let a = claim("n1", "a", &["gpu0"], pb::OwnerState::OwnerRunning);
        let b = claim("n1", "b", &["gpu1"], pb::OwnerState::OwnerRunning);
        let mut pins = listed(vec![a.clone(), b.clone()]);
        // A pod with no claim here is not remembered.
        assert!(!pins.pod_deleted("z"));
        assert!(!pins.is_deleted("z"));
        // b's object is gone: its device is free for the filter at once.
        assert!(pins.pod_deleted("b"));
        assert!(pins.is_deleted("b"));
        assert_eq!(
            pins.live_claims("n1"),
            BTreeMap::from([("gpu0".into(), "a".into())])
        );
        // Seen twice, it frees nothing more.
        assert!(!pins.pod_deleted("b"));
        // A re-read of the node that still has b's claim keeps it stopped.
        pins.replace(&n1, vec![("a".into(), a.clone()), ("b".into(), b.clone())]);
        assert!(pins.is_deleted("b"));
        assert!(!pins.live_claims("n1").contains_key("gpu1"));
        // So does a relist, while the claim is there...
        let relisted = Pins::from_list(
            [a.clone(), b]
                .into_iter()
                .map(|pin| (DEVICE_SET.to_string(), pin.pod_uid.clone(), pin)),
            pins.deleted().clone(),
        );
        assert!(relisted.is_deleted("b"));
        assert!(!relisted.live_claims("n1").contains_key("gpu1"));
        // ...but once the claim has ended the pod is forgotten.
        pins.replace(&n1, vec![("a".into(), a.clone())]);
        assert!(!pins.is_deleted("b"));
        let relisted = Pins::from_list(
            [(DEVICE_SET.to_string(), "a".to_string(), a)],
            BTreeSet::from(["b".to_string()]),
        );
        assert!(relisted.deleted().is_empty());
    }

    #[test]
    fn a_node_read_again_replaces_what_the_copy_had_of_it() {
        let mut pins = listed(vec![
            claim("n1", "a", &["gpu0"], pb::OwnerState::OwnerRunning),
            claim("n1", "b", &["gpu1"], pb::OwnerState::OwnerRunning),
        ]);
        // b's claim ended, c's was made.
        let c = claim("n1", "c", &["gpu1"], pb::OwnerState::OwnerStarting);
        let a = claim("n1", "a", &["gpu0"], pb::OwnerState::OwnerRunning);
        // gpu1 went from b to c: nothing came free.
        assert!(!pins.replace(
            &(DEVICE_SET.into(), "n1".into()),
            vec![("a".into(), a.clone()), ("c".into(), c.clone())],
        ));
        assert_eq!(
            pins.live_claims("n1"),
            BTreeMap::from([("gpu0".into(), "a".into()), ("gpu1".into(), "c".into())])
        );
        // b is forgotten: its report touches nothing; c's touches n1.
        assert_eq!(touched(&reported("b", "Gone"), &pins, &none()), nodes(&[]));
        assert_eq!(
            touched(&reported("c", "Gone"), &pins, &none()),
            nodes(&[(DEVICE_SET, "n1")])
        );
        // c's pod stopped: its device is free for the filter.
        let c_stopped = claim("n1", "c", &["gpu1"], pb::OwnerState::OwnerStopped);
        assert!(pins.replace(
            &(DEVICE_SET.into(), "n1".into()),
            vec![("a".into(), a), ("c".into(), c_stopped)],
        ));
        // Every claim of n1 ended.
        assert!(pins.replace(&(DEVICE_SET.into(), "n1".into()), Vec::new()));
        assert!(pins.live_claims("n1").is_empty());
        // A device published healthy is free too; one gone is not.
        let published = (INVENTORY_SET.to_string(), "n1".to_string());
        assert!(pins.replace(
            &published,
            vec![("n1".into(), inventory("n1", &["gpu0", "gpu1"]))]
        ));
        assert!(!pins.replace(&published, vec![("n1".into(), inventory("n1", &["gpu0"]))]));
        assert_eq!(
            touched(
                &event("PinOwnerChanged", "pin/gpu-devices/a", ""),
                &pins,
                &none()
            ),
            Touched::Everything
        );
    }
}
