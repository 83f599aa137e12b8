//! Which `Allocate` calls the kubelet makes for a pod, derived from the
//! kubelet's own algorithm, so the extender can plan them and the device
//! plugin can tell when a pod is fully served.
//!
//! Read from kubernetes/kubernetes `pkg/kubelet/cm/devicemanager/manager.go`
//! (`ManagerImpl.Allocate`, `allocateContainerResources`,
//! `devicesToAllocate`), the v1.3x line:
//! - Admission calls `Allocate(pod, container)` for every init container in
//!   order, then every app container in order.
//! - For each container, for each device-plugin resource in its **limits**
//!   (extended resources cannot be overcommitted, so requests equal limits
//!   and the kubelet reads limits only), `devicesToAllocate` picks `limit`
//!   devices. It takes them first from the pod's `devicesToReuse`, then asks
//!   the plugin's `GetPreferredAllocation` (available ∪ already-picked, must
//!   include the already-picked, size = limit) only if reuse did not cover
//!   them all, and fills up from whatever is free.
//! - If it picked any device it sends **one** `Allocate` RPC with **all**
//!   the picked ids (reused ones included): a container with a limit above
//!   zero always gets a call at admission. A limit of zero gets none.
//! - After a non-restartable init container, its devices join
//!   `devicesToReuse` (init containers run one at a time and end before
//!   the app containers start). After a restartable init container (a
//!   sidecar, which keeps running) and after each app container, the
//!   container's devices leave it.
//! - An `Allocate` error fails the pod (`UnexpectedAdmissionError`); there
//!   is no retry.
//!
//! Which reusable devices the kubelet takes is its own choice (it iterates
//! a Go set), so a plan fixes how many ids of a call are reused and which
//! *new* devices it brings, never which of the reusable ones are taken.

use k8s_openapi::api::core::v1::{Container, Pod};
use serde::{Deserialize, Serialize};

/// One container's demand for the resource, in admission order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDemand {
    /// The container's name.
    pub name: String,
    /// Devices it asks for (its limit of the resource).
    pub count: u32,
    /// Init, sidecar or app container.
    pub kind: ContainerKind,
}

/// Where a container sits in the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerKind {
    /// An init container that runs to completion before the next one.
    Init,
    /// An init container with `restartPolicy: Always` (keeps running).
    Sidecar,
    /// An app container.
    App,
}

/// One `Allocate` call the kubelet will make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpectedCall {
    /// The container it is for.
    pub container: String,
    /// Device ids the call carries (the container's limit).
    pub size: u32,
    /// How many of them the kubelet takes from devices earlier init
    /// containers used.
    pub reused: u32,
    /// How many are new to the pod.
    pub new: u32,
}

/// The calls of one pod's admission and the devices it needs in all.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Admission {
    /// In the order the kubelet makes them.
    pub calls: Vec<ExpectedCall>,
}

impl Admission {
    /// Distinct devices the pod holds at most (the sum of `new`).
    pub fn devices(&self) -> u32 {
        self.calls.iter().map(|c| c.new).sum()
    }
}

/// The pod's demands for `resource`, init containers first, containers
/// that ask for none left out. A limit that is not a whole number of
/// devices is refused, as the API server would.
pub fn demands(pod: &Pod, resource: &str) -> Result<Vec<ContainerDemand>, String> {
    let Some(spec) = &pod.spec else {
        return Ok(Vec::new());
    };
    let init = spec.init_containers.iter().flatten().map(|c| {
        let sidecar = c.restart_policy.as_deref() == Some("Always");
        (
            c,
            if sidecar {
                ContainerKind::Sidecar
            } else {
                ContainerKind::Init
            },
        )
    });
    let app = spec.containers.iter().map(|c| (c, ContainerKind::App));
    let mut out = Vec::new();
    for (container, kind) in init.chain(app) {
        let count = limit(container, resource)?;
        if count > 0 {
            out.push(ContainerDemand {
                name: container.name.clone(),
                count,
                kind,
            });
        }
    }
    Ok(out)
}

/// A container's limit of `resource` (0 if it names none).
fn limit(container: &Container, resource: &str) -> Result<u32, String> {
    let Some(quantity) = container
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
    else {
        return Ok(0);
    };
    quantity.0.trim().parse::<u32>().map_err(|_| {
        format!(
            "container {:?} asks for {:?} of {resource}: devices are counted in whole numbers",
            container.name, quantity.0
        )
    })
}

/// The calls the kubelet makes for these demands (see the module doc).
pub fn admission(demands: &[ContainerDemand]) -> Admission {
    let mut reusable = 0u32;
    let mut admission = Admission::default();
    for demand in demands {
        let reused = demand.count.min(reusable);
        let new = demand.count - reused;
        admission.calls.push(ExpectedCall {
            container: demand.name.clone(),
            size: demand.count,
            reused,
            new,
        });
        match demand.kind {
            // Its devices (the reused ones were reusable already) join.
            ContainerKind::Init => reusable += new,
            // Its devices leave: the reused ones were in the set.
            ContainerKind::Sidecar | ContainerKind::App => reusable -= reused,
        }
    }
    admission
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(name: &str, count: u32, kind: ContainerKind) -> ContainerDemand {
        ContainerDemand {
            name: name.into(),
            count,
            kind,
        }
    }

    fn shape(admission: &Admission) -> Vec<(u32, u32)> {
        admission.calls.iter().map(|c| (c.reused, c.new)).collect()
    }

    #[test]
    fn app_containers_each_get_a_call_and_their_own_devices() {
        let a = admission(&[
            demand("a", 2, ContainerKind::App),
            demand("b", 1, ContainerKind::App),
        ]);
        assert_eq!(shape(&a), [(0, 2), (0, 1)]);
        assert_eq!(a.devices(), 3);
    }

    #[test]
    fn app_containers_reuse_what_an_init_container_used() {
        // init 2, then apps of 1 and 2: the first app reuses one of the two,
        // the second the other one and a new one.
        let a = admission(&[
            demand("init", 2, ContainerKind::Init),
            demand("a", 1, ContainerKind::App),
            demand("b", 2, ContainerKind::App),
        ]);
        assert_eq!(shape(&a), [(0, 2), (1, 0), (1, 1)]);
        assert_eq!(a.devices(), 3);
        // Every call is made, even one whose devices are all reused.
        assert_eq!(a.calls.len(), 3);
    }

    #[test]
    fn consecutive_init_containers_reuse_each_others_devices() {
        let a = admission(&[
            demand("i1", 1, ContainerKind::Init),
            demand("i2", 2, ContainerKind::Init),
            demand("app", 1, ContainerKind::App),
        ]);
        assert_eq!(shape(&a), [(0, 1), (1, 1), (1, 0)]);
        assert_eq!(a.devices(), 2);
    }

    #[test]
    fn a_sidecar_keeps_its_devices_away_from_later_containers() {
        let a = admission(&[
            demand("init", 1, ContainerKind::Init),
            demand("sidecar", 1, ContainerKind::Sidecar),
            demand("app", 1, ContainerKind::App),
        ]);
        // The sidecar reuses the init container's device and keeps it, so
        // the app needs a new one.
        assert_eq!(shape(&a), [(0, 1), (1, 0), (0, 1)]);
        assert_eq!(a.devices(), 2);
    }

    #[test]
    fn demands_read_limits_in_admission_order_and_skip_containers_without_any() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "u"},
            "spec": {
                "initContainers": [
                    {"name": "warm", "resources": {"limits": {"tether.io/gpu": "1"}}},
                    {"name": "proxy", "restartPolicy": "Always"},
                ],
                "containers": [
                    {"name": "main", "resources": {"limits": {"tether.io/gpu": "2", "cpu": "1"}}},
                    {"name": "log", "resources": {"limits": {"cpu": "100m"}}},
                ],
            }
        }))
        .unwrap();
        assert_eq!(
            demands(&pod, "tether.io/gpu").unwrap(),
            [
                demand("warm", 1, ContainerKind::Init),
                demand("main", 2, ContainerKind::App)
            ]
        );
        assert!(demands(&pod, "nvidia.com/gpu").unwrap().is_empty());
        let fractional: Pod = serde_json::from_value(serde_json::json!({
            "spec": {"containers": [
                {"name": "m", "resources": {"limits": {"tether.io/gpu": "500m"}}}
            ]}
        }))
        .unwrap();
        let err = demands(&fractional, "tether.io/gpu").unwrap_err();
        assert!(err.contains("whole numbers"), "{err}");
    }
}
