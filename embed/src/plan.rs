//! The device plan: which devices a pod gets on its node and how the
//! kubelet's `Allocate` calls for it divide them.
//!
//! Chosen at bind in two parts: the pod and its calls ([`PodCalls`]) are
//! the Tether hold's payload; the devices are the pod's claim
//! ([`crate::accounting`]), made while the extender holds the node's lock.
//! The device plugin joins them into a [`DevicePlan`].

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::kubelet::Admission;

/// The pod a hold is for and the kubelet calls it will get: the hold's
/// payload (JSON, so operators can read it with lockctl).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodCalls {
    /// The pod (the lock's holder).
    pub pod_uid: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Its admission's `Allocate` calls and device count.
    pub admission: Admission,
}

impl PodCalls {
    /// The payload bytes.
    pub fn to_payload(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a plan always serializes")
    }

    /// Reads it from a hold's payload.
    pub fn from_payload(payload: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(payload)
            .map_err(|e| format!("the hold's payload is not a pod's device calls: {e}"))
    }

    /// The full plan, given the pod's claimed devices.
    pub fn with_devices(&self, devices: Vec<String>) -> Result<DevicePlan, String> {
        DevicePlan::new(
            &self.pod_uid,
            &self.namespace,
            &self.name,
            devices,
            &self.admission,
        )
    }
}

/// Devices planned for one pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// The pod the plan is for (the lock's holder).
    pub pod_uid: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Every device of the pod on the node.
    pub devices: Vec<String>,
    /// The kubelet's `Allocate` calls for the pod, in order.
    pub calls: Vec<PlannedCall>,
}

/// One expected `Allocate` call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedCall {
    /// The container it is for.
    pub container: String,
    /// Device ids the call carries.
    pub size: u32,
    /// Of those, how many the kubelet takes from an earlier init
    /// container's devices (its own pick).
    pub reused: u32,
    /// The devices new to the pod this call brings (`size - reused`).
    pub new_devices: Vec<String>,
}

impl DevicePlan {
    /// Divides `devices` (the pod's, `admission.devices()` of them) among the
    /// calls of `admission`, in order.
    pub fn new(
        pod_uid: &str,
        namespace: &str,
        name: &str,
        devices: Vec<String>,
        admission: &Admission,
    ) -> Result<Self, String> {
        if devices.len() != admission.devices() as usize {
            return Err(format!(
                "pod {namespace}/{name} needs {} devices, {} were given",
                admission.devices(),
                devices.len()
            ));
        }
        let mut rest = devices.iter();
        let calls = admission
            .calls
            .iter()
            .map(|call| PlannedCall {
                container: call.container.clone(),
                size: call.size,
                reused: call.reused,
                new_devices: rest.by_ref().take(call.new as usize).cloned().collect(),
            })
            .collect();
        Ok(Self {
            pod_uid: pod_uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            devices,
            calls,
        })
    }
}

/// The first `count` of `devices` (the node's, in order) that are not in
/// `in_use`, or why there are not enough.
pub fn pick_free(
    devices: &[String],
    in_use: &BTreeSet<String>,
    count: usize,
) -> Result<Vec<String>, String> {
    let free: Vec<String> = devices
        .iter()
        .filter(|d| !in_use.contains(*d))
        .take(count)
        .cloned()
        .collect();
    if free.len() < count {
        return Err(format!(
            "{count} devices needed, {} of {} free",
            devices.len() - in_use.iter().filter(|d| devices.contains(d)).count(),
            devices.len()
        ));
    }
    Ok(free)
}

/// `count` free devices of `devices` (the node's, in order; `in_use` are
/// not free) on as few NUMA nodes as it can, by `numa_of` (device -> its
/// NUMA node; devices without one are a group of their own): the NUMA node
/// with the fewest free devices that still holds `count` (best fit, so
/// larger free groups stay whole for larger pods), else the groups with
/// the most free devices first. Within a group, the node's order. Without
/// topology this is [`pick_free`].
pub fn pick_free_near(
    devices: &[String],
    numa_of: &BTreeMap<String, u32>,
    in_use: &BTreeSet<String>,
    count: usize,
) -> Result<Vec<String>, String> {
    let mut groups: BTreeMap<Option<u32>, Vec<&String>> = BTreeMap::new();
    for device in devices.iter().filter(|d| !in_use.contains(*d)) {
        groups
            .entry(numa_of.get(device).copied())
            .or_default()
            .push(device);
    }
    if groups.values().map(Vec::len).sum::<usize>() < count {
        return pick_free(devices, in_use, count);
    }
    if let Some(group) = groups
        .values()
        .filter(|g| g.len() >= count)
        .min_by_key(|g| g.len())
    {
        return Ok(group[..count].iter().map(|d| d.to_string()).collect());
    }
    let mut ordered: Vec<Vec<&String>> = groups.into_values().collect();
    // Stable: among groups of one size, the lower NUMA node first.
    ordered.sort_by_key(|g| std::cmp::Reverse(g.len()));
    Ok(ordered
        .into_iter()
        .flatten()
        .take(count)
        .map(|d| d.to_string())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::{ContainerDemand, ContainerKind, admission};

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_plan_divides_the_pods_devices_among_its_calls_and_round_trips() {
        let demands = [
            ContainerDemand {
                name: "init".into(),
                count: 1,
                kind: ContainerKind::Init,
            },
            ContainerDemand {
                name: "main".into(),
                count: 2,
                kind: ContainerKind::App,
            },
        ];
        let admission = admission(&demands);
        let plan =
            DevicePlan::new("uid-1", "ml", "train-0", ids(&["gpu2", "gpu5"]), &admission).unwrap();
        let news: Vec<_> = plan.calls.iter().map(|c| c.new_devices.clone()).collect();
        assert_eq!(news, [ids(&["gpu2"]), ids(&["gpu5"])]);
        assert_eq!(plan.calls[1].reused, 1);
        let calls = PodCalls {
            pod_uid: "uid-1".into(),
            namespace: "ml".into(),
            name: "train-0".into(),
            admission: admission.clone(),
        };
        let read = PodCalls::from_payload(&calls.to_payload()).unwrap();
        assert_eq!(read, calls);
        assert_eq!(read.with_devices(ids(&["gpu2", "gpu5"])).unwrap(), plan);
        assert!(PodCalls::from_payload(b"gpu0").is_err());
        assert!(DevicePlan::new("u", "ml", "p", ids(&["gpu1"]), &admission).is_err());
    }

    #[test]
    fn free_devices_are_picked_in_node_order() {
        let node = ids(&["gpu0", "gpu1", "gpu2", "gpu3"]);
        let in_use: BTreeSet<String> = ids(&["gpu0", "gpu2"]).into_iter().collect();
        assert_eq!(
            pick_free(&node, &in_use, 2).unwrap(),
            ids(&["gpu1", "gpu3"])
        );
        let err = pick_free(&node, &in_use, 3).unwrap_err();
        assert_eq!(err, "3 devices needed, 2 of 4 free");
    }

    #[test]
    fn several_gpus_are_planned_on_one_numa_node_when_one_holds_them() {
        // Eight GPUs, 0-3 on NUMA node 0 and 4-7 on node 1.
        let node: Vec<String> = (0..8).map(|i| format!("g{i}")).collect();
        let numa: BTreeMap<String, u32> =
            (0..8).map(|i| (format!("g{i}"), (i / 4) as u32)).collect();
        let used = |names: &[&str]| -> BTreeSet<String> { ids(names).into_iter().collect() };
        // Node 0 has two free, node 1 four: two GPUs go to node 0 (best
        // fit), keeping node 1 whole for a four-GPU pod.
        let in_use = used(&["g0", "g1"]);
        assert_eq!(
            pick_free_near(&node, &numa, &in_use, 2).unwrap(),
            ids(&["g2", "g3"])
        );
        assert_eq!(
            pick_free_near(&node, &numa, &in_use, 4).unwrap(),
            ids(&["g4", "g5", "g6", "g7"])
        );
        // Two free on node 0, three on node 1: three GPUs go to node 1,
        // where plain node order would split them across both.
        let in_use = used(&["g0", "g1", "g6"]);
        assert_eq!(
            pick_free_near(&node, &numa, &in_use, 3).unwrap(),
            ids(&["g4", "g5", "g7"])
        );
        assert_eq!(
            pick_free(&node, &in_use, 3).unwrap(),
            ids(&["g2", "g3", "g4"])
        );
        // No NUMA node holds five: the fuller node's first, then the other.
        let in_use = used(&["g0", "g1"]);
        assert_eq!(
            pick_free_near(&node, &numa, &in_use, 5).unwrap(),
            ids(&["g4", "g5", "g6", "g7", "g2"])
        );
        // Without topology: node order, as pick_free.
        assert_eq!(
            pick_free_near(&node, &BTreeMap::new(), &in_use, 3).unwrap(),
            pick_free(&node, &in_use, 3).unwrap()
        );
        assert!(pick_free_near(&node, &numa, &in_use, 7).is_err());
    }
}
