//! `tether-deploy`: renders Tether's kustomize overlays in Rust, the way
//! `kustomize build` does for the features they use, so the manifests can be
//! checked in `cargo test` without a cluster or a kustomize binary:
//!
//! - `resources`: YAML files (one or more documents) and directories holding
//!   a `kustomization.yaml`, in order;
//! - `namespace`: set on every namespaced object;
//! - `replicas`: `{name, count}` applied to Deployments and StatefulSets.
//!
//! Any other field in a `kustomization.yaml` is refused, so an overlay cannot
//! quietly start using a feature this renderer would ignore. The test in
//! `tests/manifests.rs` also compares the result with `kubectl kustomize`
//! when kubectl is installed.

use std::path::Path;

use anyhow::{Context, bail, ensure};
use serde_json::Value;

/// Kinds that are not namespaced (the ones Tether's manifests use, and a
/// few more that a namespace must never be put on).
const CLUSTER_SCOPED: [&str; 7] = [
    "ClusterRole",
    "ClusterRoleBinding",
    "Namespace",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
];

/// The objects a kustomization directory renders to, in resource order.
pub fn render(dir: &Path) -> anyhow::Result<Vec<Value>> {
    let path = dir.join("kustomization.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let kustomization: Value =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let Value::Object(fields) = &kustomization else {
        bail!("{}: not a mapping", path.display());
    };
    for key in fields.keys() {
        ensure!(
            ["apiVersion", "kind", "resources", "namespace", "replicas"].contains(&key.as_str()),
            "{}: `{key}` is not supported by this renderer (resources, namespace and replicas are)",
            path.display()
        );
    }
    let mut objects = Vec::new();
    for resource in fields
        .get("resources")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = resource
            .as_str()
            .with_context(|| format!("{}: a resource is not a path", path.display()))?;
        let target = dir.join(name);
        if target.is_dir() {
            objects.extend(render(&target)?);
        } else {
            objects.extend(read_documents(&target)?);
        }
    }
    if let Some(namespace) = fields.get("namespace").and_then(Value::as_str) {
        for object in &mut objects {
            if !CLUSTER_SCOPED.contains(&kind(object)) {
                object["metadata"]["namespace"] = Value::String(namespace.to_string());
            }
        }
    }
    for rule in fields
        .get("replicas")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(name), Some(count)) = (
            rule.get("name").and_then(Value::as_str),
            rule.get("count").and_then(Value::as_u64),
        ) else {
            bail!("{}: replicas entries need name and count", path.display());
        };
        let mut matched = false;
        for object in &mut objects {
            if ["Deployment", "StatefulSet"].contains(&kind(object)) && self::name(object) == name {
                object["spec"]["replicas"] = Value::from(count);
                matched = true;
            }
        }
        ensure!(
            matched,
            "{}: replicas for {name:?} matches nothing",
            path.display()
        );
    }
    Ok(objects)
}

/// Every YAML document of a file, as JSON values (empty documents skipped).
pub fn read_documents(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(document)
            .with_context(|| format!("parsing {}", path.display()))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// An object's kind ("" if none).
pub fn kind(object: &Value) -> &str {
    object["kind"].as_str().unwrap_or("")
}

/// An object's name ("" if none).
pub fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or("")
}

/// Objects as YAML documents separated by `---`.
pub fn to_yaml(objects: &[Value]) -> anyhow::Result<String> {
    let mut out = String::new();
    for (n, object) in objects.iter().enumerate() {
        if n > 0 {
            out.push_str("---\n");
        }
        out.push_str(&serde_yaml::to_string(object)?);
    }
    Ok(out)
}
