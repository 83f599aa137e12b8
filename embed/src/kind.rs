//! Device kinds: one extended resource, its node lock scope, and the pin
//! sets its claims and inventories live in.
//!
//! A node may carry devices of several kinds (GPUs from one vendor and
//! accelerators from another), each advertised by its own device plugin.
//! The kubelet calls each plugin's `Allocate` for its own resource only,
//! and each plugin learns the pod it serves from its own kind's lock. So
//! every kind has a lock of its own per node (`<scope>/<node>`), and a pod
//! asking for two kinds holds both locks, taken in the order of their
//! scopes' names, so that two such binds never wait on each other in a
//! circle. Each plugin releases only its own kind's lock.
//!
//! HAMi shares one node lock (`hami.io/mutex.lock`) among all its vendor
//! backends: a pod asking for two kinds took it once per backend and, until
//! HAMi #2255, contended with itself and was never bound (HAMi-core #246,
//! HAMi #2243). Separate locks per kind cannot meet that, and a pod of one
//! kind does not wait for a bind of another kind on the same node.
//!
//! The first kind is the one the extender's `--resource`, `--scope` and
//! `--device-prefix` name, with the sets every build before kinds used
//! ([`crate::accounting::DEVICE_SET`], [`crate::inventory::INVENTORY_SET`]);
//! each further kind (`--also-kind RESOURCE=PREFIX`) takes its scope and
//! sets from its prefix ([`DeviceKind::named`]).

use crate::accounting::DEVICE_SET;
use crate::inventory::INVENTORY_SET;

/// One kind of device and where Tether keeps what is known of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceKind {
    /// The extended resource, e.g. `tether.io/gpu`.
    pub resource: String,
    /// The node lock scope, e.g. `gpu-bind`.
    pub scope: String,
    /// Device ids of a node whose plugin published none are this prefix
    /// and a number (`gpu0`...).
    pub device_prefix: String,
    /// The pin set pods' device claims live in.
    pub claim_set: String,
    /// The pin set the plugins publish their nodes' devices in.
    pub inventory_set: String,
}

impl DeviceKind {
    /// The first kind: `resource` locked under `scope`, with the sets
    /// every build before kinds used.
    pub fn first(resource: &str, scope: &str, device_prefix: &str) -> DeviceKind {
        DeviceKind {
            resource: resource.into(),
            scope: scope.into(),
            device_prefix: device_prefix.into(),
            claim_set: DEVICE_SET.into(),
            inventory_set: INVENTORY_SET.into(),
        }
    }

    /// A further kind: `resource`, with scope `<prefix>-bind` and sets
    /// `<prefix>-devices` and `<prefix>-inventory`.
    pub fn named(resource: &str, prefix: &str) -> DeviceKind {
        DeviceKind {
            resource: resource.into(),
            scope: format!("{prefix}-bind"),
            device_prefix: prefix.into(),
            claim_set: format!("{prefix}-devices"),
            inventory_set: format!("{prefix}-inventory"),
        }
    }

    /// Parses `RESOURCE=PREFIX` (`--also-kind example.com/npu=npu`): the
    /// prefix must be a lowercase DNS label short enough for the scope and
    /// set names made from it.
    pub fn parse(spec: &str) -> Result<DeviceKind, String> {
        let (resource, prefix) = spec.split_once('=').ok_or_else(|| {
            format!("device kind {spec:?} is not RESOURCE=PREFIX (e.g. example.com/npu=npu)")
        })?;
        let (resource, prefix) = (resource.trim(), prefix.trim());
        if resource.is_empty() || !resource.contains('/') {
            return Err(format!(
                "device kind {spec:?}: {resource:?} is not an extended resource name (domain/name)"
            ));
        }
        let label_ok = !prefix.is_empty()
            && prefix.len() <= MAX_PREFIX
            && prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !prefix.starts_with('-')
            && !prefix.ends_with('-');
        if !label_ok {
            return Err(format!(
                "device kind {spec:?}: prefix {prefix:?} must be 1 to {MAX_PREFIX} lowercase \
                 letters, digits or '-', not starting or ending with '-'"
            ));
        }
        Ok(DeviceKind::named(resource, prefix))
    }
}

/// The longest prefix: `<prefix>-inventory` stays a DNS label (63).
const MAX_PREFIX: usize = 50;

/// Checks that `kinds` name distinct resources, scopes and sets: two kinds
/// sharing a lock or a set would be one kind counted twice.
pub fn check_distinct(kinds: &[DeviceKind]) -> Result<(), String> {
    let mut seen = std::collections::BTreeMap::new();
    for kind in kinds {
        for (what, name) in [
            ("resource", &kind.resource),
            ("scope", &kind.scope),
            ("set", &kind.claim_set),
            ("set", &kind.inventory_set),
        ] {
            if let Some(other) = seen.insert((what, name.clone()), kind.resource.clone()) {
                return Err(format!(
                    "device kinds {other} and {} share the {what} {name:?}; give each kind its own",
                    kind.resource
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_kind_keeps_the_sets_of_builds_before_kinds() {
        let gpu = DeviceKind::first("tether.io/gpu", "gpu-bind", "gpu");
        assert_eq!(gpu.claim_set, "gpu-devices");
        assert_eq!(gpu.inventory_set, "gpu-inventory");
        // A further kind named like the first gets the same names.
        assert_eq!(DeviceKind::named("tether.io/gpu", "gpu"), gpu);
    }

    #[test]
    fn a_further_kind_is_parsed_from_resource_and_prefix() {
        let npu = DeviceKind::parse("example.com/npu=npu").unwrap();
        assert_eq!(npu.resource, "example.com/npu");
        assert_eq!(npu.scope, "npu-bind");
        assert_eq!(npu.claim_set, "npu-devices");
        assert_eq!(npu.inventory_set, "npu-inventory");
        assert_eq!(npu.device_prefix, "npu");
    }

    #[test]
    fn a_bad_kind_is_refused_with_what_is_wrong() {
        for (spec, says) in [
            ("example.com/npu", "RESOURCE=PREFIX"),
            ("npu=npu", "extended resource"),
            ("example.com/npu=", "prefix"),
            ("example.com/npu=NPU", "lowercase"),
            ("example.com/npu=-npu", "'-'"),
            ("example.com/npu=a.b", "lowercase"),
        ] {
            let err = DeviceKind::parse(spec).unwrap_err();
            assert!(err.contains(says), "{spec}: {err}");
        }
        let long = format!("example.com/x={}", "a".repeat(MAX_PREFIX + 1));
        assert!(DeviceKind::parse(&long).is_err());
    }

    #[test]
    fn kinds_sharing_a_lock_or_a_set_are_refused() {
        let gpu = DeviceKind::first("tether.io/gpu", "gpu-bind", "gpu");
        let npu = DeviceKind::named("example.com/npu", "npu");
        assert!(check_distinct(&[gpu.clone(), npu.clone()]).is_ok());
        let err =
            check_distinct(&[gpu.clone(), DeviceKind::named("example.com/x", "gpu")]).unwrap_err();
        assert!(err.contains("scope \"gpu-bind\""), "{err}");
        let err = check_distinct(&[npu.clone(), npu]).unwrap_err();
        assert!(err.contains("resource"), "{err}");
    }
}
