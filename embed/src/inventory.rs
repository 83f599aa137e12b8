//! The devices a device plugin advertises, their health, and what a
//! container gets for some of them.
//!
//! Two sources: fake devices (`--devices fake:N`, for tests and demos),
//! always healthy, each handed over as the device node `/dev/<id>`; and the
//! node's NVIDIA GPUs (`--devices nvidia`), read under a host root by
//! [`crate::nvidia`] when the plugin starts and again every rescan. A GPU
//! that was advertised once stays in the list: while the driver lists it,
//! healthy; once it is gone (fallen off the bus), unhealthy, so the
//! kubelet stops counting it and gives it to no new pod, as it does when
//! NVIDIA's own plugin reports a GPU unhealthy. A GPU carries its NUMA node
//! as v1beta1 topology when the platform names one.
//!
//! The plugin publishes its node's devices in Tether, so that the
//! extender plans the device ids the kubelet knows (GPU UUIDs are nowhere
//! in the Node object, which counts devices only): one pin per node in
//! set [`INVENTORY_SET`], pinned to the node and owned by the plugin's pod,
//! with one label `inventory.tether.io/<id>` per device whose value is its
//! health and NUMA node (`healthy`, `unhealthy.numa1`). A `Reclaim` sets
//! the labels in one entry whenever the list changes, so a reader never
//! sees a node without its list in between. The pin ends as pins do: after
//! its lifetime once the plugin's pod has stopped, or with the node.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use tether_client::proto::{Pin, PinKey};
use tether_client::{Client, Error};

use crate::nvidia::{self, Discovery, Gpu};
use crate::v1beta1 as api;

/// The pin set the device plugins publish their nodes' devices in.
pub const INVENTORY_SET: &str = "gpu-inventory";

/// An inventory pin carries `<this><device id>` per device. Not the
/// claims' `devices.tether.io/`: a claim's anti-affinity terms match the
/// labels of every pin on the node, whatever its set, and would find
/// every device taken by the inventory.
pub const INVENTORY_LABEL_PREFIX: &str = "inventory.tether.io/";

/// How long a node's published devices outlive its plugin's pod: a new
/// plugin pod (a rolling update) publishes again well within it.
pub const INVENTORY_LIFETIME: Duration = Duration::from_secs(120);

/// Where a plugin's devices come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSource {
    /// Fake devices with these ids, always healthy; a container gets
    /// `/dev/<id>` for each.
    Fake(Vec<String>),
    /// The node's NVIDIA GPUs under `host_root` (the node's `/` as the
    /// plugin's container mounts it), read again every `rescan`.
    Nvidia {
        /// The node's root directory.
        host_root: PathBuf,
        /// How often the GPUs are read again for their health.
        rescan: Duration,
    },
}

/// How often `--devices nvidia` reads the driver's GPU list again.
pub const DEFAULT_RESCAN: Duration = Duration::from_secs(5);

impl DeviceSource {
    /// Parses `--devices`: `nvidia`, or `fake:N` with N fake devices named
    /// `<fake_prefix>0..N`.
    pub fn parse(
        value: &str,
        host_root: PathBuf,
        rescan: Duration,
        fake_prefix: &str,
    ) -> Result<DeviceSource, String> {
        if value == "nvidia" {
            return Ok(DeviceSource::Nvidia { host_root, rescan });
        }
        let count = value
            .strip_prefix("fake:")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| {
                format!("--devices {value:?}: expected `nvidia` or `fake:N` (N fake devices)")
            })?;
        Ok(DeviceSource::Fake(
            (0..count).map(|i| format!("{fake_prefix}{i}")).collect(),
        ))
    }

    /// How often the devices are read again (None: they never change).
    pub fn rescan(&self) -> Option<Duration> {
        match self {
            DeviceSource::Fake(_) => None,
            DeviceSource::Nvidia { rescan, .. } => Some(*rescan),
        }
    }
}

/// What one container gets for its devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Handover {
    /// Device nodes (host path = container path).
    pub device_nodes: Vec<String>,
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
    /// Environment variables besides the plugin's own.
    pub envs: Vec<(String, String)>,
}

/// The devices as last read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inventory {
    /// Fake devices, in the order given.
    Fake(Vec<String>),
    /// NVIDIA GPUs.
    Nvidia {
        /// Where they were read.
        host_root: PathBuf,
        /// Every GPU advertised so far, by UUID; those the last read did
        /// not find are unhealthy.
        advertised: BTreeMap<String, Gpu>,
        /// The last read.
        found: Discovery,
    },
}

impl Inventory {
    /// Reads the devices of `source` for the first time.
    pub fn read(source: &DeviceSource) -> std::io::Result<Inventory> {
        Ok(match source {
            DeviceSource::Fake(ids) => Inventory::Fake(ids.clone()),
            DeviceSource::Nvidia { host_root, .. } => {
                let found = nvidia::discover(host_root)?;
                Inventory::Nvidia {
                    host_root: host_root.clone(),
                    advertised: found.gpus.clone(),
                    found,
                }
            }
        })
    }

    /// Reads the devices again (fake devices stay as they are).
    pub fn reread(&self) -> std::io::Result<Inventory> {
        match self {
            Inventory::Fake(_) => Ok(self.clone()),
            Inventory::Nvidia { host_root, .. } => {
                Ok(self.with_discovery(nvidia::discover(host_root)?))
            }
        }
    }

    /// This inventory after a read that found `now`: GPUs found are
    /// healthy (new ones join), GPUs advertised before and not found stay,
    /// unhealthy.
    pub fn with_discovery(&self, now: Discovery) -> Inventory {
        match self {
            Inventory::Fake(_) => self.clone(),
            Inventory::Nvidia {
                host_root,
                advertised,
                ..
            } => {
                let mut advertised = advertised.clone();
                advertised.extend(
                    now.gpus
                        .iter()
                        .map(|(uuid, gpu)| (uuid.clone(), gpu.clone())),
                );
                Inventory::Nvidia {
                    host_root: host_root.clone(),
                    advertised,
                    found: now,
                }
            }
        }
    }

    /// Entries the last read could not use, with why (to log).
    pub fn skipped(&self) -> &[(String, String)] {
        match self {
            Inventory::Fake(_) => &[],
            Inventory::Nvidia { found, .. } => &found.skipped,
        }
    }

    /// The device list for `ListAndWatch`.
    pub fn devices(&self) -> Vec<api::Device> {
        match self {
            Inventory::Fake(ids) => ids
                .iter()
                .map(|id| api::Device {
                    id: id.clone(),
                    health: HEALTHY.into(),
                    topology: None,
                })
                .collect(),
            Inventory::Nvidia {
                advertised, found, ..
            } => {
                let health = nvidia::health(advertised, found);
                advertised
                    .values()
                    .map(|gpu| api::Device {
                        id: gpu.uuid.clone(),
                        health: if health.get(&gpu.uuid).copied().unwrap_or(false) {
                            HEALTHY
                        } else {
                            UNHEALTHY
                        }
                        .into(),
                        topology: gpu.numa_node.map(|id| api::TopologyInfo {
                            nodes: vec![api::NumaNode { id: i64::from(id) }],
                        }),
                    })
                    .collect()
            }
        }
    }

    /// What a container gets for `ids` (in that order). An id that is not
    /// a device of this node now (a GPU gone since the kubelet chose it) is
    /// refused with why, never handed over as something else.
    pub fn handover(&self, ids: &[String]) -> Result<Handover, String> {
        match self {
            Inventory::Fake(known) => {
                if let Some(unknown) = ids.iter().find(|id| !known.contains(id)) {
                    return Err(format!(
                        "device {unknown} is not a device of this plugin (its devices: {known:?})"
                    ));
                }
                Ok(Handover {
                    device_nodes: ids.iter().map(|id| format!("/dev/{id}")).collect(),
                    ..Handover::default()
                })
            }
            Inventory::Nvidia {
                host_root, found, ..
            } => {
                let given = nvidia::handover(host_root, found, ids)?;
                Ok(Handover {
                    device_nodes: given
                        .device_nodes
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect(),
                    cdi_devices: given.cdi_devices,
                    envs: vec![(
                        nvidia::VISIBLE_DEVICES_ENV.to_string(),
                        given.visible_devices,
                    )],
                })
            }
        }
    }
}

/// A device as a plugin published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedDevice {
    /// Its id (what the kubelet and the claims name).
    pub id: String,
    /// Whether the plugin reported it healthy.
    pub healthy: bool,
    /// Its NUMA node, when known.
    pub numa_node: Option<u32>,
}

impl Inventory {
    /// The labels of this inventory's pin (see the module doc).
    pub fn labels(&self) -> HashMap<String, String> {
        self.devices()
            .into_iter()
            .map(|device| {
                let mut value = if device.health == HEALTHY {
                    "healthy".to_string()
                } else {
                    "unhealthy".to_string()
                };
                if let Some(numa) = device.topology.as_ref().and_then(|t| t.nodes.first()) {
                    value.push_str(&format!(".numa{}", numa.id));
                }
                (format!("{INVENTORY_LABEL_PREFIX}{}", device.id), value)
            })
            .collect()
    }
}

/// The devices an inventory pin names, in id order.
pub fn published_devices(pin: &Pin) -> Vec<PublishedDevice> {
    let mut devices: Vec<PublishedDevice> = pin
        .labels
        .iter()
        .filter_map(|(key, value)| {
            let id = key.strip_prefix(INVENTORY_LABEL_PREFIX)?;
            let mut parts = value.split('.');
            let healthy = parts.next() == Some("healthy");
            let numa_node = parts
                .find_map(|part| part.strip_prefix("numa"))
                .and_then(|n| n.parse().ok());
            Some(PublishedDevice {
                id: id.to_string(),
                healthy,
                numa_node,
            })
        })
        .collect();
    devices.sort_by(|a, b| a.id.cmp(&b.id));
    devices
}

/// The pin member of `node`'s inventory: the node's name when it fits a
/// member (63 characters), else its first 46 and a hash of the whole.
pub fn inventory_member(node: &str) -> String {
    if node.len() <= 63 {
        return node.to_string();
    }
    format!("{}-{:016x}", &node[..46], fnv1a(node))
}

/// The owner of devices published by a plugin that runs outside a pod:
/// `device-plugin-` and a hash of the node name (a valid pod UID that no
/// pod has).
pub fn standalone_owner(node: &str) -> String {
    format!("device-plugin-{:016x}", fnv1a(node))
}

fn fnv1a(text: &str) -> u64 {
    // Stable across builds and machines, unlike std's hasher.
    text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The key of `node`'s inventory pin in `set` ([`INVENTORY_SET`], or a
/// further device kind's, [`crate::kind`]).
pub fn inventory_key(set: &str, node: &str) -> PinKey {
    PinKey {
        set: set.into(),
        member: inventory_member(node),
    }
}

/// Publishes `inventory` as `node`'s devices, owned by the plugin's pod
/// `pod_uid` (one `Reclaim`: the labels change in one entry), in `set`.
pub async fn publish(
    client: &Client,
    set: &str,
    node: &str,
    pod_uid: &str,
    inventory: &Inventory,
) -> Result<(), Error> {
    client
        .reclaim(
            &inventory_key(set, node),
            node,
            pod_uid,
            INVENTORY_LIFETIME,
            inventory.labels(),
            INVENTORY_LABEL_PREFIX,
        )
        .await
        .map(|_| ())
}

/// Every node's published devices in `set` (one read), by node.
pub async fn published_inventories(
    client: &Client,
    set: &str,
) -> Result<BTreeMap<String, Vec<PublishedDevice>>, Error> {
    Ok(client
        .list_pins(set, "")
        .await?
        .iter()
        .map(|pin| (pin.node.clone(), published_devices(pin)))
        .collect())
}

/// `node`'s published devices in `set`, if its plugin published them.
pub async fn published_inventory(
    client: &Client,
    set: &str,
    node: &str,
) -> Result<Option<Vec<PublishedDevice>>, Error> {
    Ok(client
        .get_pin(&inventory_key(set, node))
        .await?
        .filter(|pin| pin.node == node)
        .map(|pin| published_devices(&pin)))
}

/// v1beta1's health values.
const HEALTHY: &str = "Healthy";
const UNHEALTHY: &str = "Unhealthy";

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_fixtures::{fall_off_the_bus, nvidia_node, uuid};

    fn nvidia(root: &std::path::Path) -> DeviceSource {
        DeviceSource::Nvidia {
            host_root: root.to_path_buf(),
            rescan: DEFAULT_RESCAN,
        }
    }

    #[test]
    fn gpus_are_listed_by_uuid_with_their_numa_node_and_a_lost_one_stays_unhealthy() {
        let root = nvidia_node("eight-gpus");
        let inventory = Inventory::read(&nvidia(root.path())).unwrap();
        let listed = inventory.devices();
        assert_eq!(listed.len(), 8);
        for minor in 0..8 {
            let device = listed.iter().find(|d| d.id == uuid(minor)).unwrap();
            assert_eq!(device.health, "Healthy");
            let numa: Vec<i64> = device
                .topology
                .as_ref()
                .unwrap()
                .nodes
                .iter()
                .map(|n| n.id)
                .collect();
            assert_eq!(numa, [i64::from(minor / 4)]);
        }
        let given = inventory.handover(&[uuid(2), uuid(3)]).unwrap();
        assert_eq!(
            given.cdi_devices,
            [
                format!("nvidia.com/gpu={}", uuid(2)),
                format!("nvidia.com/gpu={}", uuid(3))
            ]
        );
        assert_eq!(
            given.envs,
            [(
                "NVIDIA_VISIBLE_DEVICES".to_string(),
                format!("{},{}", uuid(2), uuid(3))
            )]
        );
        assert_eq!(&given.device_nodes[..2], ["/dev/nvidia2", "/dev/nvidia3"]);
        assert!(given.device_nodes.contains(&"/dev/nvidiactl".to_string()));

        // GPU 3 falls off the bus: a rescan lists it unhealthy and no
        // longer hands it over; nothing else changes.
        fall_off_the_bus(root.path(), "0000:48:00.0");
        let after = inventory.reread().unwrap();
        assert_ne!(after, inventory);
        let health: Vec<(String, String)> = after
            .devices()
            .into_iter()
            .map(|d| (d.id, d.health))
            .collect();
        assert_eq!(health.len(), 8, "still listed");
        for (id, health) in &health {
            let expected = if *id == uuid(3) {
                "Unhealthy"
            } else {
                "Healthy"
            };
            assert_eq!(health, expected, "{id}");
        }
        let refused = after.handover(&[uuid(2), uuid(3)]).unwrap_err();
        assert!(refused.contains(&uuid(3)), "{refused}");
        // Read again with nothing changed: the same inventory (no update
        // goes to the kubelet).
        assert_eq!(after.reread().unwrap(), after);
    }

    #[test]
    fn the_published_labels_read_back_as_the_devices_with_health_and_numa_node() {
        let root = nvidia_node("eight-gpus");
        fall_off_the_bus(root.path(), "0000:18:00.0");
        let inventory = Inventory::read(&nvidia(root.path()))
            .unwrap()
            .with_discovery(nvidia::discover(root.path()).unwrap());
        let pin = Pin {
            labels: inventory.labels(),
            node: "gpu-node-1".into(),
            ..Pin::default()
        };
        let published = published_devices(&pin);
        // GPU 0's entry was gone at the first read: it was never
        // advertised, so it is not published either.
        assert_eq!(published.len(), 7);
        for device in &published {
            let minor = (1..8).find(|m| uuid(*m) == device.id).unwrap();
            assert!(device.healthy);
            assert_eq!(device.numa_node, Some(minor / 4));
        }
        // Once advertised and then lost: published unhealthy.
        let lost = Inventory::read(&nvidia(root.path())).unwrap();
        fall_off_the_bus(root.path(), "0000:28:00.0");
        let lost = lost.reread().unwrap();
        let pin = Pin {
            labels: lost.labels(),
            ..Pin::default()
        };
        let one = published_devices(&pin)
            .into_iter()
            .find(|d| d.id == uuid(1))
            .unwrap();
        assert_eq!((one.healthy, one.numa_node), (false, Some(0)));
        // Fake devices: healthy, no NUMA node.
        let fake = Inventory::Fake(vec!["gpu0".into()]);
        let pin = Pin {
            labels: fake.labels(),
            ..Pin::default()
        };
        assert_eq!(
            published_devices(&pin),
            [PublishedDevice {
                id: "gpu0".into(),
                healthy: true,
                numa_node: None
            }]
        );
    }

    #[test]
    fn an_inventory_member_fits_a_pin_member_and_names_the_node() {
        assert_eq!(inventory_member("gpu-node-1"), "gpu-node-1");
        let long = format!("{}.example.com", "a".repeat(80));
        let member = inventory_member(&long);
        assert_eq!(member.len(), 63);
        assert!(member.starts_with(&long[..46]));
        let other = format!("{}.example.org", "a".repeat(80));
        assert_ne!(inventory_member(&other), member);
    }

    #[test]
    fn one_gpu_without_a_numa_node_is_listed_without_topology_and_handed_over() {
        let root = crate::test_fixtures::nvidia_tree("one-gpu");
        let inventory = Inventory::read(&nvidia(&root)).unwrap();
        let listed = inventory.devices();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (&*listed[0].id, &*listed[0].health, &listed[0].topology),
            (&*uuid(0), "Healthy", &None)
        );
        let given = inventory.handover(&[uuid(0)]).unwrap();
        assert_eq!(given.cdi_devices, [format!("nvidia.com/gpu={}", uuid(0))]);
        assert_eq!(given.device_nodes[0], "/dev/nvidia0");
        assert_eq!(
            inventory.labels()[&format!("inventory.tether.io/{}", uuid(0))],
            "healthy"
        );
    }

    #[test]
    fn a_node_without_the_driver_advertises_no_gpus() {
        let bare = tempfile::tempdir().unwrap();
        let inventory = Inventory::read(&nvidia(bare.path())).unwrap();
        assert!(inventory.devices().is_empty());
    }

    #[test]
    fn the_devices_flag_parses_nvidia_and_fake_counts_and_refuses_the_rest() {
        let root = PathBuf::from("/host");
        let parse = |v: &str| DeviceSource::parse(v, root.clone(), DEFAULT_RESCAN, "gpu");
        assert_eq!(
            parse("nvidia").unwrap(),
            DeviceSource::Nvidia {
                host_root: root.clone(),
                rescan: DEFAULT_RESCAN
            }
        );
        assert_eq!(
            parse("fake:3").unwrap(),
            DeviceSource::Fake(vec!["gpu0".into(), "gpu1".into(), "gpu2".into()])
        );
        for bad in ["8", "fake:", "fake:x", "amd", ""] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains("nvidia") && err.contains("fake:N"), "{err}");
        }
    }

    #[test]
    fn fake_devices_are_healthy_and_handed_over_as_their_device_nodes() {
        let inventory =
            Inventory::read(&DeviceSource::Fake(vec!["gpu0".into(), "gpu1".into()])).unwrap();
        let devices = inventory.devices();
        assert_eq!(
            devices
                .iter()
                .map(|d| (&*d.id, &*d.health))
                .collect::<Vec<_>>(),
            [("gpu0", "Healthy"), ("gpu1", "Healthy")]
        );
        let given = inventory.handover(&["gpu1".into()]).unwrap();
        assert_eq!(given.device_nodes, ["/dev/gpu1"]);
        assert!(given.cdi_devices.is_empty() && given.envs.is_empty());
        assert!(inventory.handover(&["gpu7".into()]).is_err());
    }
}
