//! Manifest objects of any kind onto an API server: server-side apply with
//! strict field validation (what `kubectl apply --server-side` sends; with
//! `--dry-run=server` nothing is stored), the kind's resource and scope
//! found through discovery.

use anyhow::Context;
use kube::api::{Api, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::discovery::{Discovery, Scope};
use serde_json::Value;

/// Whether an apply is stored or only checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Stored.
    ForReal,
    /// Admitted and validated as if stored, then dropped.
    DryRun,
}

/// The group, version and kind an object names.
pub fn gvk_of(object: &Value) -> GroupVersionKind {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    GroupVersionKind::gvk(group, version, object["kind"].as_str().unwrap_or_default())
}

/// The API of `object`'s kind: in its own namespace, or `namespace` when it
/// names none, if the kind is namespaced.
pub fn api_for(
    client: &kube::Client,
    discovery: &Discovery,
    object: &Value,
    namespace: &str,
) -> anyhow::Result<Api<DynamicObject>> {
    let gvk = gvk_of(object);
    let (resource, capabilities) = discovery
        .resolve_gvk(&gvk)
        .with_context(|| format!("the API server serves no {gvk:?}"))?;
    Ok(match capabilities.scope {
        Scope::Namespaced => {
            let namespace = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or(namespace);
            Api::namespaced_with(client.clone(), namespace, &resource)
        }
        Scope::Cluster => Api::all_with(client.clone(), &resource),
    })
}

/// Server-side applies `object` (strict field validation, conflicts
/// forced) as `mode` says.
pub async fn apply(
    client: &kube::Client,
    discovery: &Discovery,
    object: &Value,
    namespace: &str,
    mode: Mode,
) -> anyhow::Result<DynamicObject> {
    let mut params = PatchParams::apply("tether-kube-testenv")
        .force()
        .validation_strict();
    if mode == Mode::DryRun {
        params = params.dry_run();
    }
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let applied = api_for(client, discovery, object, namespace)?
        .patch(name, &params, &Patch::Apply(object))
        .await
        .with_context(|| format!("{} {name}", object["kind"].as_str().unwrap_or_default()))?;
    Ok(applied)
}
