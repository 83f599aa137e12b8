//! NVIDIA GPUs as a node shows them, read under a host root (the node's `/`
//! mounted into the device plugin's container): what the device plugin
//! advertises (GPU UUIDs as device ids, as NVIDIA's own plugin does by
//! default), reports unhealthy, and hands a container in `Allocate`.
//!
//! What it reads, as the NVIDIA kernel driver lays it out:
//! - `proc/driver/nvidia/gpus/<PCI address>/information`: one
//!   `Key: value` per line; `Model`, `GPU UUID` and `Device Minor` are
//!   used, and the directory's name is the PCI address in sysfs's form
//!   (`0000:3b:00.0`). A GPU that falls off the bus loses its entry.
//! - `dev/nvidia<minor>` (the GPU's device node) and the driver's shared
//!   nodes `dev/nvidiactl`, `dev/nvidia-uvm`, `dev/nvidia-uvm-tools`.
//! - `sys/bus/pci/devices/<PCI address>/numa_node`: the GPU's NUMA node
//!   (`-1` where the platform names none), for topology.
//!
//! The fixture trees of the tests (`tests/fixtures/nvidia/`) copy that
//! layout as public sources show it: `Key: \t value` lines with `Device Minor:` as node-setup scripts
//! and validators parse it, and entry directories named by the lower-case
//! sysfs address (`0000:c1:00.0`). No driver runs here, so what a real
//! driver writes after a GPU falls off the bus (the entry gone, as assumed
//! here, or a UUID of question marks, also left out) is unconfirmed.
//!
//! A container gets its GPUs three ways at once, for every runtime: the CDI
//! names `nvidia.com/gpu=<UUID>` (containerd and CRI-O with CDI enabled,
//! from the spec `nvidia-ctk cdi generate` writes), `NVIDIA_VISIBLE_DEVICES`
//! (NVIDIA's container runtime without CDI), and the device nodes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where the driver lists its GPUs, under the host root.
const GPUS_DIR: &str = "proc/driver/nvidia/gpus";
/// The driver's device nodes every GPU container needs besides its own.
const SHARED_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];
/// The CDI kind of NVIDIA GPUs.
pub const CDI_KIND: &str = "nvidia.com/gpu";
/// The variable NVIDIA's container runtime reads (without CDI): the GPUs'
/// UUIDs, comma-separated.
pub const VISIBLE_DEVICES_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// One GPU of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// `GPU-…`: the device id it is advertised under.
    pub uuid: String,
    /// The driver's minor number: the GPU's node is `/dev/nvidia<minor>`.
    pub minor: u32,
    /// E.g. `NVIDIA A100-SXM4-80GB`.
    pub model: String,
    /// PCI address, e.g. `0000:3b:00.0`.
    pub pci_address: String,
    /// NUMA node, when the platform names one.
    pub numa_node: Option<u32>,
}

impl Gpu {
    /// `/dev/nvidia<minor>` as the container sees it.
    pub fn device_node(&self) -> String {
        format!("/dev/nvidia{}", self.minor)
    }

    /// `nvidia.com/gpu=<UUID>`.
    pub fn cdi_name(&self) -> String {
        format!("{CDI_KIND}={}", self.uuid)
    }
}

/// What discovery found: the GPUs, and the entries it could not use (with
/// why), to log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Discovery {
    /// By UUID.
    pub gpus: BTreeMap<String, Gpu>,
    /// `(entry, why)` for every entry left out.
    pub skipped: Vec<(String, String)>,
}

/// The fields of an `information` file.
fn fields(text: &str) -> BTreeMap<&str, &str> {
    text.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(key, value)| (key.trim(), value.trim()))
        .collect()
}

/// Reads the GPUs under `host_root`. A node without the driver's directory
/// has no GPUs (not an error: the plugin advertises none); an entry that
/// cannot be read or lacks a field, or whose device node is missing, is
/// skipped and named.
pub fn discover(host_root: &Path) -> std::io::Result<Discovery> {
    let dir = host_root.join(GPUS_DIR);
    let mut found = Discovery::default();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(err) => return Err(err),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        match read_gpu(host_root, &name, &entry.path()) {
            Ok(gpu) => {
                if let Some(twin) = found.gpus.get(&gpu.uuid) {
                    let why = format!("same UUID as {}", twin.pci_address);
                    found.skipped.push((name, why));
                } else {
                    found.gpus.insert(gpu.uuid.clone(), gpu);
                }
            }
            Err(why) => found.skipped.push((name, why)),
        }
    }
    Ok(found)
}

fn read_gpu(host_root: &Path, pci_address: &str, entry: &Path) -> Result<Gpu, String> {
    let text = std::fs::read_to_string(entry.join("information"))
        .map_err(|err| format!("cannot read its information: {err}"))?;
    let fields = fields(&text);
    let field = |key: &str| {
        fields
            .get(key)
            .copied()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("no `{key}` in its information"))
    };
    let uuid = field("GPU UUID")?;
    if !uuid.starts_with("GPU-") || uuid.contains('?') {
        return Err(format!(
            "its UUID {uuid:?} is not a GPU's (is the GPU lost?)"
        ));
    }
    let minor: u32 = field("Device Minor")?
        .parse()
        .map_err(|err| format!("its device minor is not a number: {err}"))?;
    let node = host_root.join(format!("dev/nvidia{minor}"));
    if !node.exists() {
        return Err(format!("its device node {} is missing", node.display()));
    }
    let numa_node = std::fs::read_to_string(
        host_root.join(format!("sys/bus/pci/devices/{pci_address}/numa_node")),
    )
    .ok()
    .and_then(|text| text.trim().parse::<i64>().ok())
    .and_then(|n| u32::try_from(n).ok());
    Ok(Gpu {
        uuid: uuid.to_string(),
        minor,
        model: fields.get("Model").copied().unwrap_or_default().to_string(),
        pci_address: pci_address.to_string(),
        numa_node,
    })
}

/// The health of every GPU advertised so far (`advertised`, by UUID) now
/// that `now` was discovered: true while it is there. A GPU that vanished
/// stays in the list as unhealthy, so the kubelet stops counting it and
/// gives it to nobody; a new one joins healthy.
pub fn health(advertised: &BTreeMap<String, Gpu>, now: &Discovery) -> BTreeMap<String, bool> {
    advertised
        .keys()
        .map(|uuid| (uuid.clone(), now.gpus.contains_key(uuid)))
        .chain(now.gpus.keys().map(|uuid| (uuid.clone(), true)))
        .collect()
}

/// What one container gets for its GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handover {
    /// `nvidia.com/gpu=<UUID>` each.
    pub cdi_devices: Vec<String>,
    /// `NVIDIA_VISIBLE_DEVICES`: the UUIDs, comma-separated.
    pub visible_devices: String,
    /// Device nodes (host path = container path): the GPUs' own, then the
    /// driver's shared ones that exist on the node.
    pub device_nodes: Vec<PathBuf>,
}

/// The hand-over of the GPUs `uuids` (in that order). Every one must be a
/// GPU of `found`: a device id the node does not have is refused, never
/// handed out as something else.
pub fn handover(host_root: &Path, found: &Discovery, uuids: &[String]) -> Result<Handover, String> {
    let mut gpus = Vec::with_capacity(uuids.len());
    for uuid in uuids {
        let gpu = found.gpus.get(uuid).ok_or_else(|| {
            format!(
                "device {uuid} is not a GPU of this node (its GPUs: {:?})",
                found.gpus.keys()
            )
        })?;
        gpus.push(gpu);
    }
    let mut device_nodes: Vec<PathBuf> = gpus
        .iter()
        .map(|g| PathBuf::from(g.device_node()))
        .collect();
    for shared in SHARED_NODES {
        if host_root.join("dev").join(shared).exists() {
            device_nodes.push(PathBuf::from("/dev").join(shared));
        }
    }
    Ok(Handover {
        cdi_devices: gpus.iter().map(|g| g.cdi_name()).collect(),
        visible_devices: gpus
            .iter()
            .map(|g| g.uuid.as_str())
            .collect::<Vec<_>>()
            .join(","),
        device_nodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_fixtures::{fall_off_the_bus, nvidia_node, nvidia_tree, uuid};

    #[test]
    fn one_gpu_is_found_with_its_uuid_minor_model_and_numa_node() {
        let root = nvidia_tree("one-gpu");
        let found = discover(&root).unwrap();
        assert!(found.skipped.is_empty(), "{:?}", found.skipped);
        let gpu = &found.gpus[&uuid(0)];
        assert_eq!(gpu.minor, 0);
        assert_eq!(gpu.model, "NVIDIA A100-SXM4-80GB");
        assert_eq!(gpu.pci_address, "0000:3b:00.0");
        // -1: the platform names no NUMA node.
        assert_eq!(gpu.numa_node, None);
        let given = handover(&root, &found, &[uuid(0)]).unwrap();
        assert_eq!(given.cdi_devices, [format!("nvidia.com/gpu={}", uuid(0))]);
        assert_eq!(given.visible_devices, uuid(0));
        assert_eq!(
            given.device_nodes,
            [
                "/dev/nvidia0",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn eight_gpus_on_two_numa_nodes_and_exactly_the_asked_ones_handed_over() {
        let root = nvidia_tree("eight-gpus");
        let found = discover(&root).unwrap();
        assert!(found.skipped.is_empty(), "{:?}", found.skipped);
        assert_eq!(found.gpus.len(), 8);
        for minor in 0..8 {
            assert_eq!(found.gpus[&uuid(minor)].numa_node, Some(minor / 4));
        }
        let asked = [uuid(6), uuid(5)];
        let given = handover(&root, &found, &asked).unwrap();
        assert_eq!(given.visible_devices, format!("{},{}", uuid(6), uuid(5)));
        assert_eq!(
            &given.device_nodes[..2],
            &["/dev/nvidia6", "/dev/nvidia5"].map(PathBuf::from)
        );
        assert_eq!(
            given.device_nodes.len(),
            5,
            "two GPUs and the three shared nodes"
        );
        // A device id the node does not have is refused, not replaced.
        let refused = handover(&root, &found, &[uuid(9)]).unwrap_err();
        assert!(refused.contains(&uuid(9)), "{refused}");
    }

    #[test]
    fn a_gpu_that_falls_off_the_bus_turns_unhealthy() {
        let root = nvidia_node("eight-gpus");
        let before = discover(root.path()).unwrap();
        assert!(
            health(&before.gpus, &before)
                .values()
                .all(|healthy| *healthy)
        );
        fall_off_the_bus(root.path(), "0000:28:00.0");
        let after = discover(root.path()).unwrap();
        let health = health(&before.gpus, &after);
        assert!(health[&uuid(0)]);
        assert!(!health[&uuid(1)], "still listed, as unhealthy");
        assert!(handover(root.path(), &after, &[uuid(1)]).is_err());
    }

    #[test]
    fn unusable_entries_are_named_and_a_node_without_the_driver_has_no_gpus() {
        let root = nvidia_node("eight-gpus");
        // A lost GPU's UUID reads as question marks; another's node is gone.
        let lost = root.path().join(GPUS_DIR).join("0000:18:00.0/information");
        let text = std::fs::read_to_string(&lost)
            .unwrap()
            .replace(&uuid(0), "GPU-????????");
        std::fs::write(&lost, text).unwrap();
        std::fs::remove_file(root.path().join("dev/nvidia1")).unwrap();
        let found = discover(root.path()).unwrap();
        assert_eq!(found.gpus.len(), 6, "the other six are still found");
        assert!(!found.gpus.contains_key(&uuid(0)) && !found.gpus.contains_key(&uuid(1)));
        assert_eq!(found.skipped.len(), 2);
        let why: Vec<&str> = found.skipped.iter().map(|(_, why)| why.as_str()).collect();
        assert!(why.iter().any(|w| w.contains("is not a GPU's")), "{why:?}");
        assert!(why.iter().any(|w| w.contains("device node")), "{why:?}");
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(discover(bare.path()).unwrap(), Discovery::default());
    }
}
