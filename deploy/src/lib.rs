//! `tether-deploy`: renders Tether's kustomize overlays in Rust, the way
//! `kustomize build` does for the features they use, so the manifests can be
//! checked in `cargo test` without a cluster or a kustomize binary:
//!
//! - `resources`: YAML files (one or more documents) and directories holding
//!   a `kustomization.yaml`, in order;
//! - `namespace`: set on every namespaced object;
//! - `replicas`: `{name, count}` applied to Deployments and StatefulSets;
//! - `images`: `{name, newName, newTag, digest}` applied to every container
//!   and init container whose image, without its tag or digest, is `name`.
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
        serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let Value::Object(fields) = &kustomization else {
        bail!("{}: not a mapping", path.display());
    };
    for key in fields.keys() {
        ensure!(
            [
                "apiVersion",
                "kind",
                "resources",
                "namespace",
                "replicas",
                "images"
            ]
            .contains(&key.as_str()),
            "{}: `{key}` is not supported by this renderer (resources, namespace, replicas and \
             images are)",
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
    for rule in fields
        .get("images")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let image = |key: &str| rule.get(key).and_then(Value::as_str);
        let name = image("name")
            .with_context(|| format!("{}: images entries need a name", path.display()))?;
        let mut matched = false;
        for object in &mut objects {
            for_each_container(object, &mut |container| {
                let Some(current) = container.get("image").and_then(Value::as_str) else {
                    return;
                };
                let (base, tag) = split_image(current);
                if base != name {
                    return;
                }
                let mut new = image("newName").unwrap_or(base).to_string();
                match (image("digest"), image("newTag"), tag) {
                    (Some(digest), _, _) => new = format!("{new}@{digest}"),
                    (None, Some(tag), _) => new = format!("{new}:{tag}"),
                    (None, None, Some(tag)) => new.push_str(tag),
                    (None, None, None) => {}
                }
                container["image"] = Value::String(new);
                matched = true;
            });
        }
        ensure!(
            matched,
            "{}: images entry {name:?} matches no container",
            path.display()
        );
    }
    Ok(objects)
}

/// An image reference split into its name and its tag or digest suffix
/// (`:tag` or `@sha256:...`, kept with its separator).
fn split_image(image: &str) -> (&str, Option<&str>) {
    if let Some(at) = image.find('@') {
        return (&image[..at], Some(&image[at..]));
    }
    match image.rfind(':') {
        // A colon after the last slash starts the tag (one before it is a
        // registry port).
        Some(colon) if image[colon..].find('/').is_none() => {
            (&image[..colon], Some(&image[colon..]))
        }
        _ => (image, None),
    }
}

/// Calls `f` on every container and init container anywhere in `object`
/// (pod templates of workloads, pods, job templates).
fn for_each_container(object: &mut Value, f: &mut dyn FnMut(&mut Value)) {
    match object {
        Value::Object(fields) => {
            for (key, value) in fields.iter_mut() {
                if (key == "containers" || key == "initContainers")
                    && let Value::Array(containers) = value
                {
                    containers.iter_mut().for_each(&mut *f);
                } else {
                    for_each_container(value, f);
                }
            }
        }
        Value::Array(items) => items
            .iter_mut()
            .for_each(|item| for_each_container(item, f)),
        _ => {}
    }
}

/// Every YAML document of a file, as JSON values (empty documents skipped).
pub fn read_documents(path: &Path) -> anyhow::Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    documents_of(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Every YAML document of `text`, as JSON values (empty documents skipped).
pub fn documents_of(text: &str) -> anyhow::Result<Vec<Value>> {
    let documents: Vec<Value> = serde_saphyr::from_multiple(text)?;
    Ok(documents.into_iter().filter(|v| !v.is_null()).collect())
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
        out.push_str(&serde_saphyr::to_string(object)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references_split_into_name_and_tag_or_digest() {
        assert_eq!(split_image("tether:latest"), ("tether", Some(":latest")));
        assert_eq!(split_image("tether"), ("tether", None));
        assert_eq!(
            split_image("registry:5000/team/tether:0.1"),
            ("registry:5000/team/tether", Some(":0.1"))
        );
        assert_eq!(
            split_image("registry:5000/tether"),
            ("registry:5000/tether", None)
        );
        assert_eq!(
            split_image("tether@sha256:abc"),
            ("tether", Some("@sha256:abc"))
        );
    }

    #[test]
    fn an_images_entry_renames_and_retags_matching_containers_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            "resources: [pods.yaml]\nimages:\n  - {name: tether, newName: reg.example/tether, newTag: \"1.2\"}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("pods.yaml"),
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  template:\n    spec:\n      \
             initContainers: [{name: i, image: tether:latest}]\n      containers:\n        - {name: a, image: tether}\n        \
             - {name: b, image: other:latest}\n",
        )
        .unwrap();
        let objects = render(dir.path()).unwrap();
        let spec = &objects[0]["spec"]["template"]["spec"];
        assert_eq!(spec["initContainers"][0]["image"], "reg.example/tether:1.2");
        assert_eq!(spec["containers"][0]["image"], "reg.example/tether:1.2");
        assert_eq!(spec["containers"][1]["image"], "other:latest");
        std::fs::write(
            dir.path().join("kustomization.yaml"),
            "resources: [pods.yaml]\nimages:\n  - {name: nothing, newTag: \"1\"}\n",
        )
        .unwrap();
        let err = render(dir.path()).unwrap_err().to_string();
        assert!(err.contains("matches no container"), "{err}");
    }
}
