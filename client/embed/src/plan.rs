//! The device plan: which devices a pod gets on its node, chosen at bind and
//! carried to the device plugin as the Tether hold's payload.

use serde::{Deserialize, Serialize};

/// Devices planned for one pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// The pod the plan is for (the lock's holder).
    pub pod_uid: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Device ids on the node.
    pub devices: Vec<String>,
}

impl DevicePlan {
    /// The payload bytes (JSON, so operators can read it with lockctl).
    pub fn to_payload(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a plan always serializes")
    }

    /// Reads a plan from a hold's payload.
    pub fn from_payload(payload: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(payload)
            .map_err(|e| format!("the hold's payload is not a device plan: {e}"))
    }
}

/// Picks devices for a pod: `per_pod` consecutive devices of the node's
/// `devices_per_node`, starting at a position derived from the pod UID (a
/// stand-in for a real scheduler's Filter/Score decision).
#[derive(Debug, Clone)]
pub struct Planner {
    /// Device ids are `<prefix><index>`.
    pub device_prefix: String,
    /// Devices on each node.
    pub devices_per_node: usize,
    /// Devices per pod.
    pub per_pod: usize,
}

impl Planner {
    /// The plan for a pod.
    pub fn plan(&self, pod_uid: &str, namespace: &str, name: &str) -> DevicePlan {
        let start = pod_uid
            .bytes()
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
        let devices = (0..self.per_pod.min(self.devices_per_node))
            .map(|i| {
                format!(
                    "{}{}",
                    self.device_prefix,
                    (start + i) % self.devices_per_node
                )
            })
            .collect();
        DevicePlan {
            pod_uid: pod_uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            devices,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_are_deterministic() {
        let planner = Planner {
            device_prefix: "gpu".into(),
            devices_per_node: 8,
            per_pod: 2,
        };
        let plan = planner.plan("uid-1", "ml", "train-0");
        assert_eq!(plan, planner.plan("uid-1", "ml", "train-0"));
        assert_eq!(plan.devices.len(), 2);
        assert_eq!(DevicePlan::from_payload(&plan.to_payload()).unwrap(), plan);
        assert!(DevicePlan::from_payload(b"gpu0").is_err());
    }
}
